// Proto Tensor <-> InputTensor / MutableTensorView.
#include "server/transport/tensor_codec.h"

#include <cstddef>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace attnserve {

absl::StatusOr<DType> DTypeFromProto(int proto_dtype, absl::string_view field) {
  switch (proto_dtype) {
    case v1::FLOAT32: return DType::kFloat32;
    case v1::FLOAT16: return DType::kFloat16;
    case v1::BFLOAT16: return DType::kBFloat16;
    case v1::BOOL: return DType::kBool;
    case v1::DATA_TYPE_UNSPECIFIED:
      return absl::InvalidArgumentError(
          absl::StrCat(field, ": dtype must be set (FLOAT32, FLOAT16, BFLOAT16 or BOOL), got ",
                       "DATA_TYPE_UNSPECIFIED"));
    default:
      return absl::InvalidArgumentError(absl::StrCat(
          field, ": unknown dtype value ", proto_dtype,
          " (expected FLOAT32=1, FLOAT16=2, BFLOAT16=3 or BOOL=4)"));
  }
}

v1::DataType DTypeToProto(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return v1::FLOAT32;
    case DType::kFloat16: return v1::FLOAT16;
    case DType::kBFloat16: return v1::BFLOAT16;
    case DType::kBool: return v1::BOOL;
  }
  return v1::DATA_TYPE_UNSPECIFIED;
}

std::string ProtoDTypeName(int proto_dtype) {
  if (v1::DataType_IsValid(proto_dtype)) {
    return v1::DataType_Name(static_cast<v1::DataType>(proto_dtype));
  }
  return absl::StrCat(proto_dtype);
}

bool IsEmptyTensor(const v1::Tensor& tensor, const HostBuffer* data) {
  return tensor.dtype() == v1::DATA_TYPE_UNSPECIFIED && tensor.shape_size() == 0 &&
         (data != nullptr ? data->size() == 0 : tensor.data().empty());
}

InputTensor DecodeTensor(const v1::Tensor& tensor, bool has, absl::string_view field,
                         const HostBuffer* data) {
  InputTensor input;
  input.present = has && !IsEmptyTensor(tensor, data);
  if (!input.present) return input;
  absl::StatusOr<DType> dtype = DTypeFromProto(tensor.dtype(), absl::StrCat(field, ".dtype"));
  if (dtype.ok()) {
    input.dtype = *dtype;
  } else {
    input.decode_error = dtype.status();
  }
  input.shape.assign(tensor.shape().begin(), tensor.shape().end());
  input.data = data != nullptr ? absl::string_view(data->data(), data->size()) : tensor.data();
  return input;
}

MutableTensorView AllocateTensor(DType dtype, const Shape& shape, v1::Tensor* tensor) {
  tensor->set_dtype(DTypeToProto(dtype));
  tensor->mutable_shape()->Assign(shape.begin(), shape.end());
  MutableTensorView view{dtype, shape, nullptr};
  std::string* data = tensor->mutable_data();
  data->resize(view.byte_size());
  view.data = data->data();
  return view;
}

}  // namespace attnserve
