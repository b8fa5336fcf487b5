// In: one pass over the wire that copies the four tensors' `data` into host
// buffers and everything else, unchanged, into a small message that protobuf
// then parses. Out: the answer's fields as protobuf writes them, with the
// results' bytes as slices that reference their buffers.
#include "server/transport/attend_wire.h"

#include <climits>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "google/protobuf/io/coded_stream.h"
#include "grpcpp/support/proto_buffer_reader.h"
#include "grpcpp/support/slice.h"
#include "server/transport/message_codec.h"
#include "server/transport/protobuf_log.h"
#include "server/transport/tensor_codec.h"

namespace attnserve {
namespace {

namespace io = google::protobuf::io;

// Protobuf's wire types.
constexpr uint32_t kVarint = 0, kFixed64 = 1, kLengthDelimited = 2, kFixed32 = 5;
// AttendRequest's Tensor fields, and Tensor's `data`.
constexpr uint32_t kQuery = v1::AttendRequest::kQueryFieldNumber;
constexpr uint32_t kKey = v1::AttendRequest::kKeyFieldNumber;
constexpr uint32_t kValue = v1::AttendRequest::kValueFieldNumber;
constexpr uint32_t kAttnMask = v1::AttendRequest::kAttnMaskFieldNumber;
constexpr uint32_t kTensorData = v1::Tensor::kDataFieldNumber;

void AppendVarint(uint64_t value, std::string* out) {
  while (value >= 0x80) {
    out->push_back(static_cast<char>(value | 0x80));
    value >>= 7;
  }
  out->push_back(static_cast<char>(value));
}

void AppendFixed(uint64_t value, int bytes, std::string* out) {
  for (int i = 0; i < bytes; ++i) out->push_back(static_cast<char>(value >> (8 * i)));
}

// Whether `length` bytes are left in `in`, which reads `total` bytes in all
// (checked before anything of that size is allocated: a few bytes on the
// wire must not claim gigabytes).
bool Left(const io::CodedInputStream& in, uint32_t length, size_t total) {
  const int until_limit = in.BytesUntilLimit();  // -1: no limit pushed
  return length <= total - static_cast<size_t>(in.CurrentPosition()) &&
         (until_limit < 0 || length <= static_cast<uint32_t>(until_limit));
}

// Copies the field whose `tag` was just read from `in` to `out`, unchanged
// in meaning. False: malformed or truncated, or a group (deprecated; left to
// protobuf's own parse).
bool CopyField(uint32_t tag, io::CodedInputStream& in, size_t total, std::string* out) {
  AppendVarint(tag, out);
  switch (tag & 7) {
    case kVarint: {
      uint64_t v;
      if (!in.ReadVarint64(&v)) return false;
      AppendVarint(v, out);
      return true;
    }
    case kFixed64: {
      uint64_t v;
      if (!in.ReadLittleEndian64(&v)) return false;
      AppendFixed(v, 8, out);
      return true;
    }
    case kFixed32: {
      uint32_t v;
      if (!in.ReadLittleEndian32(&v)) return false;
      AppendFixed(v, 4, out);
      return true;
    }
    case kLengthDelimited: {
      uint32_t length;
      if (!in.ReadVarint32(&length) || !Left(in, length, total)) return false;
      AppendVarint(length, out);
      const size_t at = out->size();
      out->resize(at + length);
      return in.ReadRaw(out->data() + at, static_cast<int>(length));
    }
    default:
      return false;
  }
}

// One Tensor message of `length` bytes: its `data` into `*payload` (the last
// occurrence wins), the rest into `out` as a Tensor without `data`.
bool SplitTensor(uint32_t length, io::CodedInputStream& in, size_t total, HostBufferPool& pool,
                 std::optional<HostBuffer>* payload, std::string* out) {
  const io::CodedInputStream::Limit limit = in.PushLimit(static_cast<int>(length));
  std::string rest;
  while (const uint32_t tag = in.ReadTag()) {
    if (tag != (kTensorData << 3 | kLengthDelimited)) {
      if (!CopyField(tag, in, total, &rest)) return false;
      continue;
    }
    uint32_t size;
    if (!in.ReadVarint32(&size) || !Left(in, size, total)) return false;
    absl::StatusOr<HostBuffer> buffer = pool.Allocate(size);
    if (!buffer.ok()) return false;
    if (!in.ReadRaw(buffer->data(), static_cast<int>(size))) return false;
    *payload = *std::move(buffer);
  }
  // A tag of 0 inside the message, or a malformed one, stops the loop early.
  if (!in.ConsumedEntireMessage() || in.BytesUntilLimit() != 0) return false;
  in.PopLimit(limit);
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
  grpc::ProtoBufferReader reader(bytes);
  if (!reader.status().ok()) return false;
  io::CodedInputStream in(&reader);
  const size_t total = bytes->Length();
  while (const uint32_t tag = in.ReadTag()) {
    std::optional<HostBuffer>* payload = PayloadOf(tag >> 3, payloads);
    if (payload == nullptr || (tag & 7) != kLengthDelimited) {
      if (!CopyField(tag, in, total, rest)) return false;
      continue;
    }
    uint32_t length;
    if (!in.ReadVarint32(&length) || !Left(in, length, total)) return false;
    AppendVarint(tag, rest);
    if (!SplitTensor(length, in, total, pool, payload, rest)) return false;
  }
  // ReadTag answers 0 at the end, and for a malformed or truncated tag or
  // field number 0.
  return in.ConsumedEntireMessage() && static_cast<size_t>(in.CurrentPosition()) == total;
}

// A message's bytes as gRPC slices: small runs copied into slices of their
// own, result tensors referenced where they lie.
class SliceWriter {
 public:
  void Append(absl::string_view bytes) {
    pending_.append(bytes.data(), bytes.size());
    size_ += bytes.size();
  }
  // The slice owns `buffer` from here on; gRPC frees it once sent.
  void Reference(HostBuffer buffer) {
    Flush();
    size_ += buffer.size();
    auto* owned = new HostBuffer(std::move(buffer));
    slices_.emplace_back(owned->data(), owned->size(),
                         [](void* p) { delete static_cast<HostBuffer*>(p); }, owned);
  }
  void Splice(SliceWriter&& other) {
    Flush();
    other.Flush();
    for (grpc::Slice& slice : other.slices_) slices_.push_back(std::move(slice));
    size_ += other.size_;
    other.slices_.clear();
    other.size_ = 0;
  }
  size_t size() const { return size_; }
  grpc::ByteBuffer Finish() {
    Flush();
    return grpc::ByteBuffer(slices_.data(), slices_.size());
  }

 private:
  void Flush() {
    if (pending_.empty()) return;
    slices_.emplace_back(pending_);  // copies: metadata only
    pending_.clear();
  }
  std::string pending_;
  std::vector<grpc::Slice> slices_;
  size_t size_ = 0;
};

std::string Header(uint32_t field, size_t length) {
  std::string h;
  AppendVarint(field << 3 | kLengthDelimited, &h);
  AppendVarint(length, &h);
  return h;
}

// A Tensor field: its dtype and shape (and data, if it holds any), then
// `data` from `payload`: the order protobuf writes them in.
void WriteTensor(uint32_t field, const v1::Tensor& tensor, HostBuffer payload, SliceWriter& w) {
  const std::string meta = tensor.SerializeAsString();
  const std::string data = payload.size() > 0 ? Header(kTensorData, payload.size()) : "";
  w.Append(Header(field, meta.size() + data.size() + payload.size()));
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

absl::Status Finish(SliceWriter& w, absl::string_view type, grpc::ByteBuffer* bytes) {
  if (w.size() > static_cast<size_t>(INT_MAX)) {
    return absl::InternalError(absl::StrCat("could not serialize the ", type, " answer (",
                                            w.size(), " bytes): over protobuf's 2 GiB limit"));
  }
  *bytes = w.Finish();
  return absl::OkStatus();
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
  return Finish(w, response.GetTypeName(), bytes);
}

absl::Status SerializeAttendStreamResponse(const v1::AttendStreamResponse& answer,
                                           AttendResults results, grpc::ByteBuffer* bytes) {
  SliceWriter w;
  v1::AttendStreamResponse head = answer;  // small: the response's results are not in it
  head.clear_response();
  w.Append(head.SerializeAsString());
  if (answer.has_response()) {  // the last field
    SliceWriter response = WriteResponse(answer.response(), std::move(results));
    w.Append(Header(v1::AttendStreamResponse::kResponseFieldNumber, response.size()));
    w.Splice(std::move(response));
  }
  return Finish(w, answer.GetTypeName(), bytes);
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
