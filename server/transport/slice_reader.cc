// Reading protobuf's wire format from gRPC's slices (slice_reader.h).
#include "server/transport/slice_reader.h"

#include <algorithm>
#include <climits>
#include <cstring>

#include "server/transport/message_codec.h"
#include "server/transport/protobuf_log.h"

namespace attnserve {

SliceReader::SliceReader(grpc::ByteBuffer* bytes) : ok_(bytes->Dump(&slices_).ok()) {
  if (!ok_) slices_.clear();
  for (const grpc::Slice& s : slices_) left_ += s.size();
}

template <typename Part>
bool SliceReader::Consume(size_t n, Part part) {
  if (n > left_) return false;
  left_ -= n;
  while (n > 0) {
    const grpc::Slice& s = slices_[slice_];
    const size_t take = std::min(n, s.size() - offset_);
    part(reinterpret_cast<const char*>(s.begin()) + offset_, take);
    n -= take;
    offset_ += take;
    if (offset_ == s.size()) {
      ++slice_;
      offset_ = 0;
    }
  }
  return true;
}

bool SliceReader::Read(char* out, size_t n) {
  return Consume(n, [&](const char* from, size_t take) {
    if (out != nullptr) {
      std::memcpy(out, from, take);
      out += take;
    }
    if (record_ != nullptr) record_->append(from, take);
  });
}

bool SliceReader::ReadPieces(size_t n, std::vector<absl::string_view>* pieces) {
  return Consume(n, [pieces](const char* from, size_t take) { pieces->emplace_back(from, take); });
}

bool SliceReader::ReadVarint(int max_bytes, uint64_t* value, std::string* raw) {
  *value = 0;
  for (int i = 0; i < max_bytes; ++i) {
    char c;
    if (!Read(&c, 1)) return false;
    if (raw != nullptr) raw->push_back(c);
    const uint64_t byte = static_cast<uint8_t>(c);
    *value |= (byte & 0x7F) << (7 * i);
    if (byte < 0x80) return true;
  }
  return false;
}

bool ReadTag(SliceReader& in, uint32_t* tag, std::string* raw) {
  uint64_t value;
  if (!in.ReadVarint(5, &value, raw) || value > UINT32_MAX || (value >> 3) == 0) return false;
  *tag = static_cast<uint32_t>(value);
  return true;
}

bool ReadLength(SliceReader& in, size_t end, size_t* length) {
  uint64_t value;
  if (!in.ReadVarint(5, &value) || value > INT_MAX || in.left() < end) return false;
  *length = static_cast<size_t>(value);
  return *length <= in.left() - end;
}

bool CopyBody(uint32_t tag, SliceReader& in, std::string* out) {
  in.set_record(out);
  bool ok = false;
  uint64_t ignored;
  switch (tag & 7) {
    case kWireVarint: ok = in.ReadVarint(10, &ignored); break;
    case kWireFixed64: ok = in.Skip(8); break;
    case kWireFixed32: ok = in.Skip(4); break;
    case kWireLengthDelimited: {
      uint64_t length;
      ok = in.ReadVarint(5, &length) && length <= INT_MAX && length <= in.left() &&
           in.Skip(static_cast<size_t>(length));
      break;
    }
    default: break;
  }
  in.set_record(nullptr);
  return ok;
}

absl::Status FinishSplitParse(grpc::ByteBuffer* bytes, absl::string_view what, int64_t number,
                              bool split, const std::string& rest,
                              google::protobuf::MessageLite* request,
                              absl::FunctionRef<void()> undo) {
  if (split) {
    bool parsed;
    {
      ScopedProtobufLogCapture capture;  // protobuf's complaints go to the client
      parsed = request->ParseFromString(rest);
    }
    if (parsed) {
      bytes->Clear();
      return absl::OkStatus();
    }
  }
  // Whatever the split did not take, protobuf parses whole, and words the
  // error itself.
  undo();
  request->Clear();
  return ParseRequestMessage(bytes, what, number, request);
}

}  // namespace attnserve
