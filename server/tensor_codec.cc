// Proto Tensor <-> engine views; see tensor_codec.h for the checks.
#include "server/tensor_codec.h"

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

bool IsEmptyTensor(const v1::Tensor& tensor) {
  return tensor.dtype() == v1::DATA_TYPE_UNSPECIFIED && tensor.shape_size() == 0 &&
         tensor.data().empty();
}

absl::StatusOr<TensorView> ViewTensor(const v1::Tensor& tensor, absl::string_view field,
                                      int64_t max_elements) {
  absl::StatusOr<DType> dtype = DTypeFromProto(tensor.dtype(), absl::StrCat(field, ".dtype"));
  if (!dtype.ok()) return dtype.status();

  Shape shape(tensor.shape().begin(), tensor.shape().end());
  for (size_t i = 0; i < shape.size(); ++i) {
    if (shape[i] < 1) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ".shape: every dim must be >= 1, got ", shape[i], " at dim ", i,
                       " (shape ", ShapeString(shape), ")"));
    }
  }
  // NumElements reports overflow; the limit is checked here so that the
  // message can say which of the two happened.
  absl::StatusOr<int64_t> elements = NumElements(shape);
  if (!elements.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(field, ".shape: element count of ",
                                                   ShapeString(shape), " overflows int64"));
  }
  if (*elements > max_elements) {
    return absl::ResourceExhaustedError(
        absl::StrCat(field, ".shape: ", ShapeString(shape), " has ", *elements,
                     " elements, more than the server's limit of ", max_elements));
  }
  const size_t element_size = DTypeSize(*dtype);
  // elements <= INT64_MAX and element_size <= 4: compare in 128 bits to stay
  // exact whatever the limit.
  const unsigned __int128 expected =
      static_cast<unsigned __int128>(*elements) * static_cast<unsigned __int128>(element_size);
  if (expected != tensor.data().size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ".data: expected ", static_cast<uint64_t>(expected), " bytes (shape ",
        ShapeString(shape), " x ", DTypeLabel(*dtype), " ", element_size, " bytes), got ",
        tensor.data().size()));
  }
  // std::string storage comes from operator new (16-byte aligned) or the
  // in-object buffer (8-byte aligned), so element reads are aligned.
  return TensorView{*dtype, std::move(shape), tensor.data().data()};
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
