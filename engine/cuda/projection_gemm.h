// The projection GEMMs on cuBLASLt: y = x W^T + b for row-major x [rows, in]
// and a PyTorch-layout weight W [out, in], with the bias fused into the
// epilogue. FLOAT16/BFLOAT16 run on the tensor cores with fp32 accumulation;
// FLOAT32 runs in full fp32 (no TF32), to stay within the fp32 tolerances.
#ifndef ATTNSERVE_ENGINE_CUDA_PROJECTION_GEMM_H_
#define ATTNSERVE_ENGINE_CUDA_PROJECTION_GEMM_H_

#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <map>
#include <memory>
#include <tuple>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "engine/cuda/device_memory.h"
#include "engine/dtype.h"

namespace attnserve::cuda {

// One per stream. Not thread-safe (it caches the chosen algorithm per shape).
class ProjectionGemm {
 public:
  static absl::StatusOr<std::unique_ptr<ProjectionGemm>> Create(cudaStream_t stream);
  ~ProjectionGemm();
  ProjectionGemm(const ProjectionGemm&) = delete;
  ProjectionGemm& operator=(const ProjectionGemm&) = delete;

  // Enqueues y[rows, out] = x[rows, in] * w[out, in]^T (+ bias[out]) on the
  // stream. Every pointer is on the device and of `type` (FLOAT32, FLOAT16
  // or BFLOAT16); bias may be null; y must not alias x or w.
  absl::Status Linear(DType type, const void* x, int64_t rows, int64_t in, const void* w,
                      const void* bias, int64_t out, void* y);

 private:
  explicit ProjectionGemm(cudaStream_t stream) : stream_(stream) {}

  // The cuBLASLt algorithm for a shape, or none when cuBLASLt offers nothing
  // (then cublasGemmEx plus a bias kernel serve it).
  struct Choice {
    bool use_lt = false;
    cublasLtMatmulAlgo_t algo{};
  };
  using ShapeKey = std::tuple<int, int64_t, int64_t, int64_t, bool>;

  absl::Status LinearFallback(DType type, const void* x, int64_t rows, int64_t in, const void* w,
                              const void* bias, int64_t out, void* y);

  cudaStream_t stream_;
  cublasLtHandle_t lt_ = nullptr;
  cublasHandle_t blas_ = nullptr;
  DeviceBuffer workspace_;
  std::map<ShapeKey, Choice> choices_;
};

}  // namespace attnserve::cuda

#endif  // ATTNSERVE_ENGINE_CUDA_PROJECTION_GEMM_H_
