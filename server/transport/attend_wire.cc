// In: one pass over gRPC's slices that copies the four tensors' `data` into
// host buffers and everything else, byte for byte, into a small message that
// protobuf then parses. Out: the answer's fields as protobuf writes them, with the
// results' bytes as slices that reference their buffers.
#include "server/transport/attend_wire.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "grpcpp/support/slice.h"
#include "server/transport/message_codec.h"
#include "server/transport/protobuf_log.h"
#include "server/transport/slice_writer.h"
#include "server/transport/tensor_codec.h"

namespace attnserve {
namespace {

// Protobuf's wire types.
constexpr uint32_t kVarint = 0, kFixed64 = 1, kLengthDelimited = 2, kFixed32 = 5;
// AttendRequest's Tensor fields, and Tensor's `data`.
constexpr uint32_t kQuery = v1::AttendRequest::kQueryFieldNumber;
constexpr uint32_t kKey = v1::AttendRequest::kKeyFieldNumber;
constexpr uint32_t kValue = v1::AttendRequest::kValueFieldNumber;
constexpr uint32_t kAttnMask = v1::AttendRequest::kAttnMaskFieldNumber;
constexpr uint32_t kTensorData = v1::Tensor::kDataFieldNumber;

// gRPC's slices read front to back. Every byte read is also appended to
// `record` while it is set, so a field the split leaves alone reaches
// protobuf exactly as it came.
class SliceReader {
 public:
  explicit SliceReader(grpc::ByteBuffer* bytes) : ok_(bytes->Dump(&slices_).ok()) {
    for (const grpc::Slice& s : slices_) left_ += s.size();
  }
  bool ok() const { return ok_; }
  size_t left() const { return left_; }
  void set_record(std::string* record) { record_ = record; }

  // `n` bytes into `out` (and the record). False: fewer are left.
  bool Read(char* out, size_t n) {
    if (n > left_) return false;
    left_ -= n;
    while (n > 0) {
      const grpc::Slice& s = slices_[slice_];
      const size_t take = std::min(n, s.size() - offset_);
      const char* from = reinterpret_cast<const char*>(s.begin()) + offset_;
      if (out != nullptr) {
        std::memcpy(out, from, take);
        out += take;
      }
      if (record_ != nullptr) record_->append(from, take);
      n -= take;
      offset_ += take;
      if (offset_ == s.size()) {
        ++slice_;
        offset_ = 0;
      }
    }
    return true;
  }
  bool Skip(size_t n) { return Read(nullptr, n); }

  // A varint of at most `max_bytes` bytes; its bytes into `raw` too, when
  // given. False: truncated or longer.
  bool ReadVarint(int max_bytes, uint64_t* value, std::string* raw = nullptr) {
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

 private:
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
bool ReadTag(SliceReader& in, uint32_t* tag, std::string* raw) {
  uint64_t value;
  if (!in.ReadVarint(5, &value, raw) || value > UINT32_MAX || (value >> 3) == 0) return false;
  *tag = static_cast<uint32_t>(value);
  return true;
}

// A length whose bytes lie before `end` (in.left() at the end of the message
// being read), as does what it measures.
bool ReadLength(SliceReader& in, size_t end, size_t* length) {
  uint64_t value;
  if (!in.ReadVarint(5, &value) || value > INT_MAX || in.left() < end) return false;
  *length = static_cast<size_t>(value);
  // Checked before anything that large is allocated: a few bytes on the
  // wire must not claim gigabytes.
  return *length <= in.left() - end;
}

// The body of a field whose tag was just read, as it is, into `out`. False:
// truncated, or a group (deprecated: protobuf's to parse).
bool CopyBody(uint32_t tag, SliceReader& in, std::string* out) {
  in.set_record(out);
  bool ok = false;
  uint64_t ignored;
  switch (tag & 7) {
    case kVarint: ok = in.ReadVarint(10, &ignored); break;
    case kFixed64: ok = in.Skip(8); break;
    case kFixed32: ok = in.Skip(4); break;
    case kLengthDelimited: {
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

// One Tensor message of `length` bytes: its `data` into `*payload` (the last
// occurrence wins), the rest into `out`, as it came, as a Tensor without
// `data`.
bool SplitTensor(size_t length, SliceReader& in, HostBufferPool& pool,
                 std::optional<HostBuffer>* payload, std::string* out) {
  const size_t end = in.left() - length;  // what is left once the Tensor is read
  std::string rest;
  while (in.left() > end) {
    uint32_t tag;
    std::string raw_tag;
    if (!ReadTag(in, &tag, &raw_tag) || in.left() < end) return false;
    if (tag != (kTensorData << 3 | kLengthDelimited)) {
      rest += raw_tag;
      if (!CopyBody(tag, in, &rest) || in.left() < end) return false;  // not past the Tensor
      continue;
    }
    size_t size;
    if (!ReadLength(in, end, &size)) return false;
    absl::StatusOr<HostBuffer> buffer = pool.Allocate(size);
    if (!buffer.ok() || !in.Read(buffer->data(), size)) return false;
    *payload = *std::move(buffer);
  }
  if (in.left() != end) return false;  // a field ran past the Tensor's end
  AppendVarint(rest.size(), out);
  out->append(rest);
  return true;
}

std::optional<HostBuffer>* PayloadOf(uint32_t field, AttendPayloads* payloads) {
  switch (field) {
    case kQuery: return &payloads->query;
    case kKey: return &payloads->key;
    case kValue: return &payloads->value;
    case kAttnMask: return &payloads->attn_mask;
    default: return nullptr;
  }
}

// The message without its tensors' data, into `rest`; false: leave the
// bytes to protobuf.
bool Split(grpc::ByteBuffer* bytes, HostBufferPool& pool, std::string* rest,
           AttendPayloads* payloads) {
  SliceReader in(bytes);
  if (!in.ok()) return false;
  while (in.left() > 0) {
    uint32_t tag;
    std::string raw_tag;
    if (!ReadTag(in, &tag, &raw_tag)) return false;
    std::optional<HostBuffer>* payload = PayloadOf(tag >> 3, payloads);
    if (payload == nullptr || (tag & 7) != kLengthDelimited) {
      *rest += raw_tag;
      if (!CopyBody(tag, in, rest)) return false;
      continue;
    }
    size_t length;
    if (!ReadLength(in, 0, &length)) return false;
    *rest += raw_tag;
    if (!SplitTensor(length, in, pool, payload, rest)) return false;
  }
  return true;
}

// A Tensor field: its dtype and shape (and data, if it holds any), then
// `data` from `payload`: the order protobuf writes them in.
void WriteTensor(uint32_t field, const v1::Tensor& tensor, HostBuffer payload, SliceWriter& w) {
  const std::string meta = tensor.SerializeAsString();
  const std::string data =
      payload.size() > 0 ? LengthDelimitedHeader(kTensorData, payload.size()) : "";
  w.Append(LengthDelimitedHeader(field, meta.size() + data.size() + payload.size()));
  w.Append(meta);
  w.Append(data);
  if (payload.size() > 0) w.Reference(std::move(payload));
}

// `response` in field order: id, output, weights, the rest.
SliceWriter WriteResponse(const v1::AttendResponse& response, AttendResults results) {
  SliceWriter w;
  v1::AttendResponse head;
  head.set_id(response.id());
  w.Append(head.SerializeAsString());
  if (response.has_output()) {
    WriteTensor(v1::AttendResponse::kOutputFieldNumber, response.output(),
                std::move(results.output), w);
  }
  if (response.has_weights()) {
    WriteTensor(v1::AttendResponse::kWeightsFieldNumber, response.weights(),
                std::move(results.weights), w);
  }
  v1::AttendResponse tail = response;  // small: its results' bytes are not in it
  tail.clear_id();
  tail.clear_output();
  tail.clear_weights();
  w.Append(tail.SerializeAsString());
  return w;
}

}  // namespace

MutableTensorView AllocateResult(HostBufferPool& pool, DType dtype, const Shape& shape,
                                 v1::Tensor* tensor, HostBuffer* bytes) {
  MutableTensorView view{dtype, shape, nullptr};
  absl::StatusOr<HostBuffer> buffer = pool.Allocate(view.byte_size());
  if (!buffer.ok() || buffer->size() == 0) return AllocateTensor(dtype, shape, tensor);
  tensor->set_dtype(DTypeToProto(dtype));
  tensor->mutable_shape()->Assign(shape.begin(), shape.end());
  tensor->clear_data();
  view.data = buffer->data();
  *bytes = *std::move(buffer);
  return view;
}

absl::Status SerializeAttendResponse(const v1::AttendResponse& response, AttendResults results,
                                     grpc::ByteBuffer* bytes) {
  SliceWriter w = WriteResponse(response, std::move(results));
  return w.Finish(response.GetTypeName(), bytes);
}

absl::Status SerializeAttendStreamResponse(const v1::AttendStreamResponse& answer,
                                           AttendResults results, grpc::ByteBuffer* bytes) {
  SliceWriter w;
  v1::AttendStreamResponse head = answer;  // small: the response's results are not in it
  head.clear_response();
  w.Append(head.SerializeAsString());
  if (answer.has_response()) {  // the last field
    SliceWriter response = WriteResponse(answer.response(), std::move(results));
    w.Append(LengthDelimitedHeader(v1::AttendStreamResponse::kResponseFieldNumber,
                                   response.size()));
    w.Splice(std::move(response));
  }
  return w.Finish(answer.GetTypeName(), bytes);
}

absl::Status ParseAttendRequest(grpc::ByteBuffer* bytes, absl::string_view what, int64_t number,
                                HostBufferPool& pool, v1::AttendRequest* request,
                                AttendPayloads* payloads) {
  std::string rest;
  if (Split(bytes, pool, &rest, payloads)) {
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
  *payloads = AttendPayloads();
  request->Clear();
  return ParseRequestMessage(bytes, what, number, request);
}

}  // namespace attnserve
