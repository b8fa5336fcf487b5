// Host stand-ins for the cuBLAS and cuBLASLt calls of the CUDA engine
// (defined in cublas_emulator.cc, in the attnserve_cuda_emulation library
// with the CUDA runtime's, cuda_runtime_emulator.cc), for code compiled on
// warp_emulator.h: the unfused path's test, and the emulated CUDA module.
// Test-only; written here.
//
// Device memory is host memory; each GEMM runs on the handle's stream as
// cuda_runtime_emulator.h says (alpha and beta read when called, a batched
// call's pointer arrays when it runs). cublasGemmBatchedEx (and cublasGemmEx, one batch)
// computes C_i = alpha op(A_i) op(B_i) + beta C_i over column-major
// matrices as cuBLAS defines it, after checking its arguments as cuBLAS
// documents for cublasGemmEx (negative sizes, leading
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
// a path asked for. cuBLASLt's heuristic finds no algorithm (as it may on a
// GPU for a shape), so the projections take their cublasGemmEx fallback.
#ifndef ATTNSERVE_TESTS_UNIT_ENGINE_CUDA_CUBLAS_EMULATOR_H_
#define ATTNSERVE_TESTS_UNIT_ENGINE_CUDA_CUBLAS_EMULATOR_H_

#include <cublas_api.h>

#include <vector>

namespace attnserve::emu {

// One cublasGemmBatchedEx (or cublasGemmEx) call as made.
struct GemmCall {
  int m, n, k, batch;
  cublasComputeType_t compute;
};
// Every call since the program started or the log was cleared.
std::vector<GemmCall>& GemmLog();

// The multiply-adds a list of calls asked for.
inline double GemmWork(const std::vector<GemmCall>& calls) {
  double work = 0.0;
  for (const GemmCall& c : calls) work += double{1} * c.m * c.n * c.k * c.batch;
  return work;
}

}  // namespace attnserve::emu

#endif  // ATTNSERVE_TESTS_UNIT_ENGINE_CUDA_CUBLAS_EMULATOR_H_
