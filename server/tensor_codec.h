// Proto Tensor <-> engine tensor views without copying tensor bytes: input
// views point into the request's `data` strings, outputs are allocated in
// the response's `data` strings and written there by the engine.
#ifndef ATTNSERVE_SERVER_TENSOR_CODEC_H_
#define ATTNSERVE_SERVER_TENSOR_CODEC_H_

#include <cstdint>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "attnserve/v1/attention.pb.h"
#include "engine/tensor.h"

namespace attnserve {

// DATA_TYPE_UNSPECIFIED and values outside the enum (proto3 enums are open)
// are InvalidArgument naming `field`, e.g. "query.dtype".
absl::StatusOr<DType> DTypeFromProto(int proto_dtype, absl::string_view field);
v1::DataType DTypeToProto(DType dtype);
// "FLOAT32", "DATA_TYPE_UNSPECIFIED", or the number for unknown values.
std::string ProtoDTypeName(int proto_dtype);

// DTypeName as an absl::string_view: Debian's abseil has its own
// string_view type, which is what absl::StrCat takes.
inline absl::string_view DTypeLabel(DType dtype) {
  const std::string_view name = DTypeName(dtype);
  return absl::string_view(name.data(), name.size());
}

// True when the message carries nothing (no dtype, shape or data): optional
// tensors sent as `{}` by JSON-ish clients count as absent.
bool IsEmptyTensor(const v1::Tensor& tensor);

// A read-only view of `tensor`; `field` ("query", "attn_mask") prefixes
// every error message. Checks, in order: dtype set and known; every dim
// >= 1; the element count fits in int64 and is <= `max_elements`; `data`
// holds exactly elements * element size bytes. Ranks are the caller's
// business (they depend on the model). Failures are InvalidArgument, except
// a count over `max_elements`: ResourceExhausted (a server limit, not a
// malformed request).
//
// Lifetime: the view points into `tensor.data()`; `tensor` must outlive it
// and stay unmodified.
absl::StatusOr<TensorView> ViewTensor(const v1::Tensor& tensor, absl::string_view field,
                                      int64_t max_elements = INT64_MAX);

// Sets `tensor`'s dtype and shape, sizes its data for them and returns a
// writable view of that data, so the engine writes the response bytes in
// place. Precondition: `shape` was validated (dims >= 1, no overflow).
//
// Lifetime: the view is valid until `tensor->data` is next modified.
MutableTensorView AllocateTensor(DType dtype, const Shape& shape, v1::Tensor* tensor);

}  // namespace attnserve

#endif  // ATTNSERVE_SERVER_TENSOR_CODEC_H_
