// Proto Tensor <-> the request path's tensors without copying tensor bytes:
// inputs point into the request's `data` strings, outputs are allocated in
// the response's `data` strings and written there by the engine.
#ifndef ATTNSERVE_SERVER_TRANSPORT_TENSOR_CODEC_H_
#define ATTNSERVE_SERVER_TRANSPORT_TENSOR_CODEC_H_

#include <cstdint>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "attnserve/v1/attention.pb.h"
#include "engine/host_buffer.h"
#include "engine/tensor.h"
#include "server/request/attend_inputs.h"

namespace attnserve {

// DATA_TYPE_UNSPECIFIED and values outside the enum (proto3 enums are open)
// are InvalidArgument naming `field`, e.g. "query.dtype".
absl::StatusOr<DType> DTypeFromProto(int proto_dtype, absl::string_view field);
v1::DataType DTypeToProto(DType dtype);
// "FLOAT32", "DATA_TYPE_UNSPECIFIED", or the number for unknown values.
std::string ProtoDTypeName(int proto_dtype);

// True when the message carries nothing (no dtype, shape or data): optional
// tensors sent as `{}` by JSON-ish clients count as absent. `data`: as for
// DecodeTensor.
bool IsEmptyTensor(const v1::Tensor& tensor, const HostBuffer* data = nullptr);

// `tensor` as the request path's InputTensor: no bytes copied, nothing
// checked but the dtype code (a bad one becomes decode_error, naming
// "<field>.dtype"). `has`: the message field is set; a set but empty tensor
// counts as absent too.
//
// `data`, when given, is the tensor's bytes taken out of the message on the
// wire (attend_wire.h), read instead of `tensor.data()`.
//
// Lifetime: the result points into `tensor.data()` (or `*data`), which must
// outlive it.
InputTensor DecodeTensor(const v1::Tensor& tensor, bool has, absl::string_view field,
                         const HostBuffer* data = nullptr);

// Sets `tensor`'s dtype and shape, sizes its data for them and returns a
// writable view of that data, so the engine writes the response bytes in
// place. Precondition: `shape` was validated (dims >= 1, no overflow).
//
// Lifetime: the view is valid until `tensor->data` is next modified.
MutableTensorView AllocateTensor(DType dtype, const Shape& shape, v1::Tensor* tensor);

}  // namespace attnserve

#endif  // ATTNSERVE_SERVER_TRANSPORT_TENSOR_CODEC_H_
