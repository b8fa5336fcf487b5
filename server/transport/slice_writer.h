// A protobuf message's bytes written as gRPC slices: the small fields copied
// into slices of their own, large payloads (result tensors in host buffers)
// referenced where they lie, so gRPC sends them without copying them into
// its own buffer. Callers write fields in protobuf's order, so the bytes are
// exactly protobuf's serialization of the message with the payloads set.
#ifndef ATTNSERVE_SERVER_TRANSPORT_SLICE_WRITER_H_
#define ATTNSERVE_SERVER_TRANSPORT_SLICE_WRITER_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "engine/host_buffer.h"
#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/slice.h"

namespace attnserve {

class SliceWriter {
 public:
  // Copies `bytes` (field tags, lengths, small messages).
  void Append(absl::string_view bytes);
  // References `buffer`: the slice owns it from here on, and gRPC frees it
  // once sent.
  void Reference(HostBuffer buffer);
  // Appends everything `other` holds, leaving it empty.
  void Splice(SliceWriter&& other);
  size_t size() const { return size_; }
  // The bytes so far; InternalError naming `type` when they are over
  // protobuf's 2 GiB message limit.
  absl::Status Finish(absl::string_view type, grpc::ByteBuffer* bytes);

 private:
  void Flush();
  std::string pending_;
  std::vector<grpc::Slice> slices_;
  size_t size_ = 0;
};

// Protobuf's varint encoding of `value`, appended to `out`.
void AppendVarint(uint64_t value, std::string* out);

// The tag and length that start a length-delimited field (a bytes, string
// or message field) `field` of `length` bytes.
std::string LengthDelimitedHeader(uint32_t field, size_t length);

}  // namespace attnserve

#endif  // ATTNSERVE_SERVER_TRANSPORT_SLICE_WRITER_H_
