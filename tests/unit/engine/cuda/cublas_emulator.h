// Host stand-ins for the cuBLAS and CUDA runtime calls of the unfused
// attention path (engine/cuda/unfused_attention.cc), so that its host code,
// compiled here with softmax_rows.cu's kernels on warp_emulator.h, runs on a
// machine without a GPU. Include it after warp_emulator.h; one such test per
// executable (the stand-ins are the program's only definitions of these
// symbols, and it links no CUDA library). Test-only; written here.
//
// Device memory is host memory and streams run nothing: every call completes
// when it returns. cublasGemmBatchedEx computes C_i = alpha op(A_i) op(B_i) +
// beta C_i over column-major matrices as cuBLAS defines it, after checking
// its arguments as cuBLAS documents for cublasGemmEx (negative sizes, leading
// dimensions smaller than the matrices they hold: CUBLAS_STATUS_INVALID_VALUE;
// a type combination cuBLAS does not offer for the compute type:
// CUBLAS_STATUS_NOT_SUPPORTED), so a call the real library would refuse
// fails here too. Precision, per compute type: products accumulated in fp32
// in k order (std::fma); 16-bit inputs read exactly (their products are
// exact in fp32, as on the tensor cores); CUBLAS_COMPUTE_32F_FAST_TF32 reads
// each fp32 input as TF32 by dropping its low 13 mantissa bits, the coarser
// of the roundings the tensor cores may apply (truncation, 2^-10 relative,
// against 2^-11 for cvt.rna), so an exactness bound that holds here holds
// on the GPU. The calls are recorded (GemmLog) for a test to count the work
// a path asked for.
#ifndef ATTNSERVE_TESTS_UNIT_ENGINE_CUDA_CUBLAS_EMULATOR_H_
#define ATTNSERVE_TESTS_UNIT_ENGINE_CUDA_CUBLAS_EMULATOR_H_

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

// The library's handle: the stream and math mode it was given.
struct cublasContext {
  cudaStream_t stream = nullptr;
  cublasMath_t math = CUBLAS_DEFAULT_MATH;
};

namespace attnserve::emu {

// One cublasGemmBatchedEx call as made.
struct GemmCall {
  int m, n, k, batch;
  cublasComputeType_t compute;
};
inline std::vector<GemmCall>& GemmLog() {
  static std::vector<GemmCall> log;
  return log;
}

// The multiply-adds a list of calls asked for.
inline double GemmWork(const std::vector<GemmCall>& calls) {
  double work = 0.0;
  for (const GemmCall& c : calls) work += double{1} * c.m * c.n * c.k * c.batch;
  return work;
}

// What cudaDeviceGetAttribute reports for cudaDevAttrMaxSharedMemoryPerBlockOptin
// (a test sets it before the first launch that asks).
inline int& MaxSharedOptin() {
  static int bytes = 48 * 1024;
  return bytes;
}

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

cublasStatus_t cublasGemmBatchedEx(cublasHandle_t /*handle*/, cublasOperation_t transa,
                                   cublasOperation_t transb, int m, int n, int k,
                                   const void* alpha, const void* const a_array[],
                                   cudaDataType a_type, int lda, const void* const b_array[],
                                   cudaDataType b_type, int ldb, const void* beta,
                                   void* const c_array[], cudaDataType c_type, int ldc,
                                   int batch_count, cublasComputeType_t compute,
                                   cublasGemmAlgo_t /*algo*/) {
  using attnserve::emu::GemmInput;
  const auto op_ok = [](cublasOperation_t op) { return op == CUBLAS_OP_N || op == CUBLAS_OP_T; };
  if (m < 0 || n < 0 || k < 0 || batch_count < 0 || !op_ok(transa) || !op_ok(transb) ||
      lda < std::max(1, transa == CUBLAS_OP_N ? m : k) ||
      ldb < std::max(1, transb == CUBLAS_OP_N ? k : n) || ldc < std::max(1, m)) {
    return CUBLAS_STATUS_INVALID_VALUE;
  }
  if (!attnserve::emu::GemmTypesSupported(a_type, b_type, c_type, compute)) {
    return CUBLAS_STATUS_NOT_SUPPORTED;
  }
  attnserve::emu::GemmLog().push_back({m, n, k, batch_count, compute});
  const bool tf32 = compute == CUBLAS_COMPUTE_32F_FAST_TF32;
  const float al = *static_cast<const float*>(alpha), be = *static_cast<const float*>(beta);
  for (int batch = 0; batch < batch_count; ++batch) {
    for (int col = 0; col < n; ++col) {
      for (int row = 0; row < m; ++row) {
        float acc = 0.0f;
        for (int x = 0; x < k; ++x) {
          const int64_t ai = transa == CUBLAS_OP_N ? row + int64_t{x} * lda : x + int64_t{row} * lda;
          const int64_t bi = transb == CUBLAS_OP_N ? x + int64_t{col} * ldb : col + int64_t{x} * ldb;
          acc = std::fma(GemmInput(a_array[batch], a_type, ai, tf32),
                         GemmInput(b_array[batch], b_type, bi, tf32), acc);
        }
        const int64_t ci = row + int64_t{col} * ldc;
        // beta == 0: C is not read (it may hold anything, NaN included).
        const float prior = be == 0.0f ? 0.0f : GemmInput(c_array[batch], c_type, ci, false);
        const float value = al * acc + be * prior;
        switch (c_type) {
          case CUDA_R_32F:
            static_cast<float*>(c_array[batch])[ci] = value;
            break;
          case CUDA_R_16F:
            static_cast<__half*>(c_array[batch])[ci] = __float2half_rn(value);
            break;
          default:
            static_cast<__nv_bfloat16*>(c_array[batch])[ci] = __float2bfloat16_rn(value);
            break;
        }
      }
    }
  }
  return CUBLAS_STATUS_SUCCESS;
}

cudaError_t cudaMemsetAsync(void* ptr, int value, size_t count, cudaStream_t /*stream*/) {
  std::memset(ptr, value, count);
  return cudaSuccess;
}
cudaError_t cudaGetDevice(int* device) {
  *device = 0;
  return cudaSuccess;
}
cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int /*device*/) {
  if (attr != cudaDevAttrMaxSharedMemoryPerBlockOptin) return cudaErrorInvalidValue;
  *value = attnserve::emu::MaxSharedOptin();
  return cudaSuccess;
}
const char* cudaGetErrorName(cudaError_t error) {
  return error == cudaSuccess ? "cudaSuccess" : "cudaError (emulated)";
}
const char* cudaGetErrorString(cudaError_t error) { return cudaGetErrorName(error); }

}  // extern "C"

#endif  // ATTNSERVE_TESTS_UNIT_ENGINE_CUDA_CUBLAS_EMULATOR_H_
