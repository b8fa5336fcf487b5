// A protobuf message's bytes read field by field from gRPC's slices, as
// protobuf itself reads them: the counterpart of slice_writer.h for parsers
// that take large bytes fields (request tensors) out of a message into host
// buffers and leave every other field, byte for byte, to protobuf.
#ifndef ATTNSERVE_SERVER_TRANSPORT_SLICE_READER_H_
#define ATTNSERVE_SERVER_TRANSPORT_SLICE_READER_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "google/protobuf/message_lite.h"
#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/slice.h"

namespace attnserve {

// Protobuf's wire types.
inline constexpr uint32_t kWireVarint = 0, kWireFixed64 = 1, kWireLengthDelimited = 2,
                          kWireFixed32 = 5;

// gRPC's slices read front to back. Every byte read is also appended to
// `record` while it is set, so a field the reader's caller leaves alone
// reaches protobuf exactly as it came.
class SliceReader {
 public:
  explicit SliceReader(grpc::ByteBuffer* bytes);
  // False: the buffer's slices could not be read (then nothing is left).
  bool ok() const { return ok_; }
  size_t left() const { return left_; }
  void set_record(std::string* record) { record_ = record; }

  // `n` bytes into `out` (nullptr: skipped; the record gets them either
  // way). False: fewer are left.
  bool Read(char* out, size_t n);
  bool Skip(size_t n) { return Read(nullptr, n); }
  // The next `n` bytes as views into the slices, in order, appended to
  // `pieces` (valid while this reader lives), for a caller that copies them
  // itself; never recorded. False: fewer are left.
  bool ReadPieces(size_t n, std::vector<absl::string_view>* pieces);

  // A varint of at most `max_bytes` bytes; its bytes into `raw` too, when
  // given. False: truncated or longer.
  bool ReadVarint(int max_bytes, uint64_t* value, std::string* raw = nullptr);

 private:
  // Moves past the next `n` bytes (false, moving nowhere: fewer are left),
  // handing each slice's part of them to `part(const char*, size_t)`.
  template <typename Part>
  bool Consume(size_t n, Part part);

  std::vector<grpc::Slice> slices_;
  bool ok_;
  size_t left_ = 0;
  size_t slice_ = 0, offset_ = 0;
  std::string* record_ = nullptr;
};

// Tags and lengths are read as strictly as protobuf reads them: a tag in at
// most 5 bytes and 32 bits with a field number, a length in at most 5 bytes
// and below 2^31. Whatever else protobuf would refuse is left in the bytes
// it gets, which it then refuses itself.
//
// A tag, its bytes appended to `raw`.
bool ReadTag(SliceReader& in, uint32_t* tag, std::string* raw);

// A length whose bytes lie before `end` (in.left() at the end of the message
// being read), as does what it measures: checked before anything that large
// is allocated, so a few bytes on the wire cannot claim gigabytes.
bool ReadLength(SliceReader& in, size_t end, size_t* length);

// The body of a field whose tag was just read, as it is, into `out`. False:
// truncated, or a group (deprecated: protobuf's to parse).
bool CopyBody(uint32_t tag, SliceReader& in, std::string* out);

// The end of a parse that took large fields out of `bytes`: when `split`
// (the fields were taken), protobuf parses `rest`, what the split left;
// when not, or when protobuf refuses `rest`, `undo` drops whatever the split
// took and protobuf parses `bytes` whole (ParseRequestMessage: the same
// result, and its own error). Releases `bytes` either way.
absl::Status FinishSplitParse(grpc::ByteBuffer* bytes, absl::string_view what, int64_t number,
                              bool split, const std::string& rest,
                              google::protobuf::MessageLite* request,
                              absl::FunctionRef<void()> undo);

}  // namespace attnserve

#endif  // ATTNSERVE_SERVER_TRANSPORT_SLICE_READER_H_
