// SliceWriter: pending small bytes are flushed into a slice of their own
// before each referenced buffer.
#include "server/transport/slice_writer.h"

#include <climits>
#include <utility>

#include "absl/strings/str_cat.h"

namespace attnserve {

void SliceWriter::Append(absl::string_view bytes) {
  pending_.append(bytes.data(), bytes.size());
  size_ += bytes.size();
}

void SliceWriter::Reference(HostBuffer buffer) {
  Flush();
  size_ += buffer.size();
  auto* owned = new HostBuffer(std::move(buffer));
  slices_.emplace_back(owned->data(), owned->size(),
                       [](void* p) { delete static_cast<HostBuffer*>(p); }, owned);
}

void SliceWriter::Splice(SliceWriter&& other) {
  Flush();
  other.Flush();
  for (grpc::Slice& slice : other.slices_) slices_.push_back(std::move(slice));
  size_ += other.size_;
  other.slices_.clear();
  other.size_ = 0;
}

absl::Status SliceWriter::Finish(absl::string_view type, grpc::ByteBuffer* bytes) {
  if (size_ > static_cast<size_t>(INT_MAX)) {
    return absl::InternalError(absl::StrCat("could not serialize the ", type, " answer (", size_,
                                            " bytes): over protobuf's 2 GiB limit"));
  }
  Flush();
  *bytes = grpc::ByteBuffer(slices_.data(), slices_.size());
  return absl::OkStatus();
}

void SliceWriter::Flush() {
  if (pending_.empty()) return;
  slices_.emplace_back(pending_);  // copies: metadata only
  pending_.clear();
}

void AppendVarint(uint64_t value, std::string* out) {
  while (value >= 0x80) {
    out->push_back(static_cast<char>(value | 0x80));
    value >>= 7;
  }
  out->push_back(static_cast<char>(value));
}

std::string LengthDelimitedHeader(uint32_t field, size_t length) {
  std::string h;
  AppendVarint(field << 3 | 2, &h);  // wire type 2: length-delimited
  AppendVarint(length, &h);
  return h;
}

}  // namespace attnserve
