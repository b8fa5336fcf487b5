// The element types of engine tensors. Plain C++ (no absl, no STL), so that
// host code and the nvcc-compiled CUDA kernels share one definition.
#ifndef ATTNSERVE_ENGINE_DTYPE_H_
#define ATTNSERVE_ENGINE_DTYPE_H_

#include <cstddef>
#include <cstdint>

namespace attnserve {

enum class DType : uint8_t { kFloat32, kFloat16, kBFloat16, kBool };

// FLOAT32, FLOAT16 or BFLOAT16: the dtypes attention computes on.
constexpr bool IsFloat(DType dtype) {
  return dtype == DType::kFloat32 || dtype == DType::kFloat16 || dtype == DType::kBFloat16;
}

// Bytes per element: 4, 2, 2, 1.
constexpr size_t DTypeSize(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return 4;
    case DType::kFloat16: return 2;
    case DType::kBFloat16: return 2;
    case DType::kBool: return 1;
  }
  return 0;
}

}  // namespace attnserve

#endif  // ATTNSERVE_ENGINE_DTYPE_H_
