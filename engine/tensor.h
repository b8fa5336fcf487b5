// Shapes and non-owning tensor views over the dtypes of dtype.h: the currency
// of engine/. Nothing here allocates tensor data; sizes are computed with
// overflow checks.
#ifndef ATTNSERVE_ENGINE_TENSOR_H_
#define ATTNSERVE_ENGINE_TENSOR_H_

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "engine/dtype.h"

namespace attnserve {

// "FLOAT32", "FLOAT16", "BFLOAT16", "BOOL" (the proto enum names).
std::string_view DTypeName(DType dtype);

using Shape = std::vector<int64_t>;

// Product of dims. Error (InvalidArgument) if a dim is < 1 or the product
// overflows int64 or exceeds `limit`.
absl::StatusOr<int64_t> NumElements(absl::Span<const int64_t> shape,
                                    int64_t limit = INT64_MAX);
// "[2, 8, 128, 64]".
std::string ShapeString(absl::Span<const int64_t> shape);

// A read-only view of a row-major (C order) tensor owned by someone else.
struct TensorView {
  DType dtype = DType::kFloat32;
  Shape shape;
  const void* data = nullptr;

  int64_t rank() const { return static_cast<int64_t>(shape.size()); }
  int64_t dim(int i) const { return shape[static_cast<size_t>(i)]; }
  // Precondition: the shape was validated (no overflow).
  int64_t num_elements() const;
  size_t byte_size() const { return static_cast<size_t>(num_elements()) * DTypeSize(dtype); }
  bool empty() const { return data == nullptr; }
};

// A writable view of a row-major tensor owned by someone else.
struct MutableTensorView {
  DType dtype = DType::kFloat32;
  Shape shape;
  void* data = nullptr;

  int64_t num_elements() const;
  size_t byte_size() const { return static_cast<size_t>(num_elements()) * DTypeSize(dtype); }
  bool empty() const { return data == nullptr; }
  TensorView view() const { return TensorView{dtype, shape, data}; }
};

// An owning row-major tensor (engine scratch, test data, built-in weights).
class Tensor {
 public:
  Tensor() = default;
  Tensor(DType dtype, Shape shape);

  DType dtype() const { return dtype_; }
  const Shape& shape() const { return shape_; }
  int64_t num_elements() const;
  void* data() { return bytes_.data(); }
  const void* data() const { return bytes_.data(); }
  template <typename T> T* data_as() { return reinterpret_cast<T*>(bytes_.data()); }
  template <typename T> const T* data_as() const { return reinterpret_cast<const T*>(bytes_.data()); }
  size_t byte_size() const { return bytes_.size(); }
  TensorView view() const { return TensorView{dtype_, shape_, bytes_.data()}; }
  MutableTensorView mutable_view() { return MutableTensorView{dtype_, shape_, bytes_.data()}; }

 private:
  DType dtype_ = DType::kFloat32;
  Shape shape_;
  std::vector<unsigned char, std::allocator<unsigned char>> bytes_;
};

// Half-precision conversions (round to nearest even; NaN stays NaN).
float HalfToFloat(uint16_t h);
uint16_t FloatToHalf(float f);
inline float BFloat16ToFloat(uint16_t b) {
  uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
uint16_t FloatToBFloat16(float f);

// Reads element i of a FLOAT32/FLOAT16/BFLOAT16 buffer as float
// (BOOL reads as 0 or 1).
float LoadAsFloat(DType dtype, const void* data, int64_t i);
// Writes `value` rounded to `dtype` (FLOAT32/FLOAT16/BFLOAT16) at element i.
void StoreFromFloat(DType dtype, void* data, int64_t i, float value);
// Bulk conversions of n elements.
void ConvertToFloat(DType dtype, const void* src, int64_t n, float* dst);
void ConvertFromFloat(const float* src, int64_t n, DType dtype, void* dst);

}  // namespace attnserve

#endif  // ATTNSERVE_ENGINE_TENSOR_H_
