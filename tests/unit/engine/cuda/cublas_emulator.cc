// cuBLAS and cuBLASLt stand-ins (cublas_emulator.h says what they model).
#include "tests/unit/engine/cuda/cublas_emulator.h"

#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <mutex>

#include "tests/unit/engine/cuda/cuda_runtime_emulator.h"

// The library's handles: what they were given.
struct cublasContext {
  cudaStream_t stream = nullptr;
  cublasMath_t math = CUBLAS_DEFAULT_MATH;
};
struct cublasLtContext {};

namespace attnserve::emu {

std::vector<GemmCall>& GemmLog() {
  static std::vector<GemmCall> log;
  return log;
}

namespace {

std::mutex log_mutex;  // engines call from several threads

// Element i of a matrix of `type`, as the compute type reads it.
inline float GemmInput(const void* data, cudaDataType type, int64_t i, bool tf32) {
  switch (type) {
    case CUDA_R_32F: {
      const float x = static_cast<const float*>(data)[i];
      return tf32 ? std::bit_cast<float>(std::bit_cast<uint32_t>(x) & 0xffffe000u) : x;
    }
    case CUDA_R_16F:
      return __half2float(static_cast<const __half*>(data)[i]);
    case CUDA_R_16BF:
      return __bfloat162float(static_cast<const __nv_bfloat16*>(data)[i]);
    default:
      std::abort();  // ruled out by GemmTypesSupported
  }
}

// cuBLAS's table of cublasGemmEx type combinations, for the ones this
// project asks for: 32F compute (plain or pedantic) takes 32F, 16F or 16BF
// inputs with a 32F output, or the 16-bit inputs with an output of their
// type; FAST_TF32 takes 32F only.
inline bool GemmTypesSupported(cudaDataType a, cudaDataType b, cudaDataType c,
                               cublasComputeType_t compute) {
  if (a != b) return false;
  switch (compute) {
    case CUBLAS_COMPUTE_32F:
    case CUBLAS_COMPUTE_32F_PEDANTIC:
      if (a == CUDA_R_32F) return c == CUDA_R_32F;
      if (a == CUDA_R_16F || a == CUDA_R_16BF) return c == CUDA_R_32F || c == a;
      return false;
    case CUBLAS_COMPUTE_32F_FAST_TF32:
      return a == CUDA_R_32F && c == CUDA_R_32F;
    default:
      return false;
  }
}

}  // namespace
}  // namespace attnserve::emu

extern "C" {

cublasStatus_t cublasCreate_v2(cublasHandle_t* handle) {
  *handle = new cublasContext;
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasDestroy_v2(cublasHandle_t handle) {
  delete handle;
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasSetStream_v2(cublasHandle_t handle, cudaStream_t stream) {
  handle->stream = stream;
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasSetMathMode(cublasHandle_t handle, cublasMath_t mode) {
  handle->math = mode;
  return CUBLAS_STATUS_SUCCESS;
}
const char* cublasGetStatusName(cublasStatus_t status) {
  switch (status) {
    case CUBLAS_STATUS_SUCCESS:
      return "CUBLAS_STATUS_SUCCESS";
    case CUBLAS_STATUS_INVALID_VALUE:
      return "CUBLAS_STATUS_INVALID_VALUE";
    case CUBLAS_STATUS_NOT_SUPPORTED:
      return "CUBLAS_STATUS_NOT_SUPPORTED";
    default:
      return "CUBLAS_STATUS_(other)";
  }
}
const char* cublasGetStatusString(cublasStatus_t status) { return cublasGetStatusName(status); }

}  // extern "C"

namespace attnserve::emu {
namespace {

// C = alpha op(A) op(B) + beta C for each of `batch_count` matrices, the
// matrices' addresses read when it runs (a batched call's arrays are device
// memory that earlier work on the stream may write).
void RunGemm(cublasOperation_t transa, cublasOperation_t transb, int m, int n, int k, float al,
             const std::function<const void*(int)>& a_at, cudaDataType a_type, int lda,
             const std::function<const void*(int)>& b_at, cudaDataType b_type, int ldb, float be,
             const std::function<void*(int)>& c_at, cudaDataType c_type, int ldc,
             int batch_count, bool tf32) {
  for (int batch = 0; batch < batch_count; ++batch) {
    const void* a = a_at(batch);
    const void* b = b_at(batch);
    void* c = c_at(batch);
    for (int col = 0; col < n; ++col) {
      for (int row = 0; row < m; ++row) {
        float acc = 0.0f;
        for (int x = 0; x < k; ++x) {
          const int64_t ai =
              transa == CUBLAS_OP_N ? row + int64_t{x} * lda : x + int64_t{row} * lda;
          const int64_t bi =
              transb == CUBLAS_OP_N ? x + int64_t{col} * ldb : col + int64_t{x} * ldb;
          acc = std::fma(GemmInput(a, a_type, ai, tf32), GemmInput(b, b_type, bi, tf32), acc);
        }
        const int64_t ci = row + int64_t{col} * ldc;
        // beta == 0: C is not read (it may hold anything, NaN included).
        const float prior = be == 0.0f ? 0.0f : GemmInput(c, c_type, ci, false);
        const float value = al * acc + be * prior;
        switch (c_type) {
          case CUDA_R_32F:
            static_cast<float*>(c)[ci] = value;
            break;
          case CUDA_R_16F:
            static_cast<__half*>(c)[ci] = __float2half_rn(value);
            break;
          default:
            static_cast<__nv_bfloat16*>(c)[ci] = __float2bfloat16_rn(value);
            break;
        }
      }
    }
  }
}

// The arguments cuBLAS checks before it enqueues anything; the call logged.
cublasStatus_t CheckGemm(cublasOperation_t transa, cublasOperation_t transb, int m, int n, int k,
                         cudaDataType a_type, int lda, cudaDataType b_type, int ldb,
                         cudaDataType c_type, int ldc, int batch_count,
                         cublasComputeType_t compute) {
  const auto op_ok = [](cublasOperation_t op) { return op == CUBLAS_OP_N || op == CUBLAS_OP_T; };
  if (m < 0 || n < 0 || k < 0 || batch_count < 0 || !op_ok(transa) || !op_ok(transb) ||
      lda < std::max(1, transa == CUBLAS_OP_N ? m : k) ||
      ldb < std::max(1, transb == CUBLAS_OP_N ? k : n) || ldc < std::max(1, m)) {
    return CUBLAS_STATUS_INVALID_VALUE;
  }
  if (!GemmTypesSupported(a_type, b_type, c_type, compute)) return CUBLAS_STATUS_NOT_SUPPORTED;
  const std::lock_guard<std::mutex> lock(log_mutex);
  GemmLog().push_back({m, n, k, batch_count, compute});
  return CUBLAS_STATUS_SUCCESS;
}

// A GEMM call: checked as cuBLAS checks it, then run on `stream`
// (cuda_runtime_emulator.h); alpha and beta are host values, read now.
cublasStatus_t EnqueueGemm(cudaStream_t stream, cublasOperation_t transa,
                           cublasOperation_t transb, int m, int n, int k, const void* alpha,
                           std::function<const void*(int)> a_at, cudaDataType a_type, int lda,
                           std::function<const void*(int)> b_at, cudaDataType b_type, int ldb,
                           const void* beta, std::function<void*(int)> c_at, cudaDataType c_type,
                           int ldc, int batch_count, cublasComputeType_t compute) {
  const cublasStatus_t status = CheckGemm(transa, transb, m, n, k, a_type, lda, b_type, ldb,
                                          c_type, ldc, batch_count, compute);
  if (status != CUBLAS_STATUS_SUCCESS) return status;
  const float al = *static_cast<const float*>(alpha), be = *static_cast<const float*>(beta);
  const bool tf32 = compute == CUBLAS_COMPUTE_32F_FAST_TF32;
  Enqueue(stream, [=, a_at = std::move(a_at), b_at = std::move(b_at), c_at = std::move(c_at)] {
    RunGemm(transa, transb, m, n, k, al, a_at, a_type, lda, b_at, b_type, ldb, be, c_at, c_type,
            ldc, batch_count, tf32);
  });
  return CUBLAS_STATUS_SUCCESS;
}

}  // namespace
}  // namespace attnserve::emu

extern "C" {

// The GEMMs (EnqueueGemm): a batched call's pointer arrays are device
// memory, read when it runs.
cublasStatus_t cublasGemmBatchedEx(cublasHandle_t handle, cublasOperation_t transa,
                                   cublasOperation_t transb, int m, int n, int k,
                                   const void* alpha, const void* const a_array[],
                                   cudaDataType a_type, int lda, const void* const b_array[],
                                   cudaDataType b_type, int ldb, const void* beta,
                                   void* const c_array[], cudaDataType c_type, int ldc,
                                   int batch_count, cublasComputeType_t compute,
                                   cublasGemmAlgo_t /*algo*/) {
  return attnserve::emu::EnqueueGemm(
      handle->stream, transa, transb, m, n, k, alpha, [a_array](int i) { return a_array[i]; },
      a_type, lda, [b_array](int i) { return b_array[i]; }, b_type, ldb, beta,
      [c_array](int i) { return c_array[i]; }, c_type, ldc, batch_count, compute);
}

cublasStatus_t cublasGemmEx(cublasHandle_t handle, cublasOperation_t transa,
                            cublasOperation_t transb, int m, int n, int k, const void* alpha,
                            const void* a, cudaDataType a_type, int lda, const void* b,
                            cudaDataType b_type, int ldb, const void* beta, void* c,
                            cudaDataType c_type, int ldc, cublasComputeType_t compute,
                            cublasGemmAlgo_t /*algo*/) {
  return attnserve::emu::EnqueueGemm(
      handle->stream, transa, transb, m, n, k, alpha, [a](int) { return a; }, a_type, lda,
      [b](int) { return b; }, b_type, ldb, beta, [c](int) { return c; }, c_type, ldc, 1, compute);
}
cublasStatus_t cublasSetWorkspace_v2(cublasHandle_t /*handle*/, void* /*workspace*/,
                                     size_t /*bytes*/) {
  return CUBLAS_STATUS_SUCCESS;
}

// cuBLASLt: descriptors that hold nothing, and a heuristic that finds no
// algorithm (so no cublasLtMatmul call is ever made).
cublasStatus_t cublasLtCreate(cublasLtHandle_t* handle) {
  *handle = new cublasLtContext;
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtDestroy(cublasLtHandle_t handle) {
  delete handle;
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmulDescCreate(cublasLtMatmulDesc_t* desc, cublasComputeType_t /*compute*/,
                                        cudaDataType_t /*scale*/) {
  *desc = new cublasLtMatmulDescOpaque_t{};
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmulDescDestroy(cublasLtMatmulDesc_t desc) {
  delete desc;
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmulDescSetAttribute(cublasLtMatmulDesc_t /*desc*/,
                                              cublasLtMatmulDescAttributes_t /*attr*/,
                                              const void* /*buf*/, size_t /*bytes*/) {
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatrixLayoutCreate(cublasLtMatrixLayout_t* layout, cudaDataType /*type*/,
                                          uint64_t /*rows*/, uint64_t /*cols*/, int64_t /*ld*/) {
  *layout = new cublasLtMatrixLayoutOpaque_t{};
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatrixLayoutDestroy(cublasLtMatrixLayout_t layout) {
  delete layout;
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmulPreferenceCreate(cublasLtMatmulPreference_t* pref) {
  *pref = new cublasLtMatmulPreferenceOpaque_t{};
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmulPreferenceDestroy(cublasLtMatmulPreference_t pref) {
  delete pref;
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmulPreferenceSetAttribute(cublasLtMatmulPreference_t /*pref*/,
                                                    cublasLtMatmulPreferenceAttributes_t /*attr*/,
                                                    const void* /*buf*/, size_t /*bytes*/) {
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmulAlgoGetHeuristic(
    cublasLtHandle_t /*handle*/, cublasLtMatmulDesc_t /*desc*/, cublasLtMatrixLayout_t /*a*/,
    cublasLtMatrixLayout_t /*b*/, cublasLtMatrixLayout_t /*c*/, cublasLtMatrixLayout_t /*d*/,
    cublasLtMatmulPreference_t /*pref*/, int /*requested*/,
    cublasLtMatmulHeuristicResult_t* /*results*/, int* found) {
  *found = 0;
  return CUBLAS_STATUS_NOT_SUPPORTED;
}
cublasStatus_t cublasLtMatmul(cublasLtHandle_t /*handle*/, cublasLtMatmulDesc_t /*desc*/,
                              const void* /*alpha*/, const void* /*a*/,
                              cublasLtMatrixLayout_t /*a_desc*/, const void* /*b*/,
                              cublasLtMatrixLayout_t /*b_desc*/, const void* /*beta*/,
                              const void* /*c*/, cublasLtMatrixLayout_t /*c_desc*/, void* /*d*/,
                              cublasLtMatrixLayout_t /*d_desc*/,
                              const cublasLtMatmulAlgo_t* /*algo*/, void* /*workspace*/,
                              size_t /*workspace_bytes*/, cudaStream_t /*stream*/) {
  return CUBLAS_STATUS_NOT_SUPPORTED;
}

}  // extern "C"
