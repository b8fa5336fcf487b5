// CUDA runtime and cuBLAS error codes as absl::Status: nothing outside
// engine/cuda/ sees a cudaError_t.
#ifndef ATTNSERVE_ENGINE_CUDA_CUDA_STATUS_H_
#define ATTNSERVE_ENGINE_CUDA_CUDA_STATUS_H_

#include <cublas_api.h>
#include <cuda_runtime_api.h>

#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace attnserve::cuda {

// OK for cudaSuccess. Out-of-memory is ResourceExhausted; everything else is
// Internal (a failure of the device or of this backend, never of the input).
// Clears the thread's last-error slot, so that a non-sticky error does not
// resurface in a later, unrelated call.
inline absl::Status CudaStatus(cudaError_t err, absl::string_view what) {
  if (err == cudaSuccess) return absl::OkStatus();
  (void)cudaGetLastError();
  const std::string message = absl::StrCat("CUDA backend: ", what, ": ", cudaGetErrorName(err),
                                           " (", cudaGetErrorString(err), ")");
  if (err == cudaErrorMemoryAllocation) return absl::ResourceExhaustedError(message);
  return absl::InternalError(message);
}

inline absl::Status CublasStatus(cublasStatus_t status, absl::string_view what) {
  if (status == CUBLAS_STATUS_SUCCESS) return absl::OkStatus();
  const std::string message =
      absl::StrCat("CUDA backend: ", what, ": ", cublasGetStatusName(status), " (",
                   cublasGetStatusString(status), ")");
  if (status == CUBLAS_STATUS_ALLOC_FAILED) return absl::ResourceExhaustedError(message);
  return absl::InternalError(message);
}

}  // namespace attnserve::cuda

// Returns from the enclosing function when `expr` (an absl::Status) is not OK.
#define ATTNSERVE_CUDA_RETURN_IF_ERROR(expr)                          \
  do {                                                                \
    if (absl::Status _status = (expr); !_status.ok()) return _status; \
  } while (0)

// The same for a CUDA runtime call or a cuBLAS(Lt) call; the message names the call.
#define ATTNSERVE_CUDA_CALL(call) \
  ATTNSERVE_CUDA_RETURN_IF_ERROR(::attnserve::cuda::CudaStatus((call), #call))
#define ATTNSERVE_CUBLAS_CALL(call) \
  ATTNSERVE_CUDA_RETURN_IF_ERROR(::attnserve::cuda::CublasStatus((call), #call))

#endif  // ATTNSERVE_ENGINE_CUDA_CUDA_STATUS_H_
