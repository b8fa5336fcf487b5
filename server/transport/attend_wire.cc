// In: one pass over gRPC's slices that copies the four tensors' `data` into
// host buffers and everything else, byte for byte, into a small message that
// protobuf then parses. Out: the answer's fields as protobuf writes them, with the
// results' bytes as slices that reference their buffers.
#include "server/transport/attend_wire.h"

#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "grpcpp/support/slice.h"
#include "server/transport/slice_reader.h"
#include "server/transport/slice_writer.h"
#include "server/transport/tensor_codec.h"

namespace attnserve {
namespace {

// AttendRequest's Tensor fields, and Tensor's `data`.
constexpr uint32_t kQuery = v1::AttendRequest::kQueryFieldNumber;
constexpr uint32_t kKey = v1::AttendRequest::kKeyFieldNumber;
constexpr uint32_t kValue = v1::AttendRequest::kValueFieldNumber;
constexpr uint32_t kAttnMask = v1::AttendRequest::kAttnMaskFieldNumber;
constexpr uint32_t kTensorData = v1::Tensor::kDataFieldNumber;
constexpr uint32_t kTensorDtype = v1::Tensor::kDtypeFieldNumber;

// The bytes per value of a float DataType code as sent; 0 for any other.
int FloatWidth(uint64_t code) {
  if (code > static_cast<uint64_t>(INT_MAX)) return 0;
  const absl::StatusOr<DType> dtype = DTypeFromProto(static_cast<int>(code), "dtype");
  return dtype.ok() && IsFloat(*dtype) ? static_cast<int>(DTypeSize(*dtype)) : 0;
}

// One Tensor message of `length` bytes: its `data` into `*payload` (the last
// occurrence wins), copied and scanned at the width of the dtype read so far
// (protobuf writes dtype first), the rest into `out`, as it came, as a
// Tensor without `data`.
bool SplitTensor(size_t length, SliceReader& in, HostBufferPool& pool, PayloadCopier& copier,
                 std::optional<AttendPayload>* payload, std::string* out) {
  const size_t end = in.left() - length;  // what is left once the Tensor is read
  std::string rest;
  int width = 0;  // of the dtype read so far (the last occurrence wins)
  std::vector<absl::string_view> pieces;
  while (in.left() > end) {
    uint32_t tag;
    std::string raw_tag;
    if (!ReadTag(in, &tag, &raw_tag) || in.left() < end) return false;
    if (tag == (kTensorDtype << 3 | kWireVarint)) {
      rest += raw_tag;
      uint64_t code;  // read as CopyBody reads a varint, its bytes kept
      if (!in.ReadVarint(10, &code, &rest) || in.left() < end) return false;
      width = FloatWidth(code);
      continue;
    }
    if (tag != (kTensorData << 3 | kWireLengthDelimited)) {
      rest += raw_tag;
      if (!CopyBody(tag, in, &rest) || in.left() < end) return false;  // not past the Tensor
      continue;
    }
    size_t size;
    if (!ReadLength(in, end, &size)) return false;
    absl::StatusOr<HostBuffer> buffer = pool.Allocate(size);
    pieces.clear();
    if (!buffer.ok() || !in.ReadPieces(size, &pieces)) return false;
    const ValueScan scan = copier.Copy(pieces, buffer->data(), width);
    *payload = AttendPayload{*std::move(buffer), std::nullopt};
    if (scan.width > 0) (*payload)->scan = scan;
  }
  if (in.left() != end) return false;  // a field ran past the Tensor's end
  AppendVarint(rest.size(), out);
  out->append(rest);
  return true;
}

std::optional<AttendPayload>* PayloadOf(uint32_t field, AttendPayloads* payloads) {
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
bool Split(grpc::ByteBuffer* bytes, HostBufferPool& pool, PayloadCopier& copier,
           std::string* rest, AttendPayloads* payloads) {
  SliceReader in(bytes);
  if (!in.ok()) return false;
  while (in.left() > 0) {
    uint32_t tag;
    std::string raw_tag;
    if (!ReadTag(in, &tag, &raw_tag)) return false;
    std::optional<AttendPayload>* payload = PayloadOf(tag >> 3, payloads);
    if (payload == nullptr || (tag & 7) != kWireLengthDelimited) {
      *rest += raw_tag;
      if (!CopyBody(tag, in, rest)) return false;
      continue;
    }
    size_t length;
    if (!ReadLength(in, 0, &length)) return false;
    *rest += raw_tag;
    if (!SplitTensor(length, in, pool, copier, payload, rest)) return false;
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
                                HostBufferPool& pool, PayloadCopier& copier,
                                v1::AttendRequest* request, AttendPayloads* payloads) {
  std::string rest;
  const bool split = Split(bytes, pool, copier, &rest, payloads);
  return FinishSplitParse(bytes, what, number, split, rest, request,
                          [payloads] { *payloads = AttendPayloads(); });
}

}  // namespace attnserve
