// Fused, tiled ("flash") attention for the CPU backend: softmax(QK^T*s+mask)V
// over a ragged batch of AttentionParams without materialising the scores.
//
// Hand-written because no maintained library does this on our platform:
// oneDNN 2.6 (Debian 12's libdnnl) has no fused SDPA primitive (its graph
// API fusion arrived in 3.x), and a GEMM + softmax + GEMM composition writes
// and re-reads an [Lq, Lk] score matrix per head, which is memory bound and
// grows quadratically with the sequence.
//
// Variants (engine/cpu/cpu_features.h): scalar, AVX2+FMA and AVX-512 in fp32;
// AVX512_BF16 (vdpbf16ps) and AMX (tdpbf16ps) with bf16 products and fp32
// accumulation. Softmax, masks and accumulation are fp32 in every variant.
#ifndef ATTNSERVE_ENGINE_CPU_FLASH_ATTENTION_H_
#define ATTNSERVE_ENGINE_CPU_FLASH_ATTENTION_H_

#include <optional>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "engine/attention_params.h"
#include "engine/cpu/cpu_features.h"

namespace attnserve::cpu {

// How the products Q K^T and P V are computed. bf16 products need AVX512_BF16
// or AMX (BestBf16Isa()); on other CPUs kAuto and kBFloat16 compute them in
// fp32, as kFloat32 does.
enum class FlashPrecision {
  // bf16 products when the inputs are BFLOAT16 (exact: they already are
  // bf16), fp32 otherwise.
  kAuto,
  // Always fp32 products (bf16/fp16 inputs are widened).
  kFloat32,
  // bf16 products for every input dtype (fp32/fp16 inputs and the softmax
  // probabilities are rounded to bf16): faster, ~3 significant digits.
  kBFloat16,
};

struct FlashOptions {
  // Worker threads for this call (OpenMP). 0 = omp_get_max_threads(), i.e.
  // OMP_NUM_THREADS or every core. Results never depend on it.
  // Default: 0.
  int num_threads = 0;

  // Forces a kernel variant; it must be supported by this CPU
  // (FailedPrecondition otherwise). A bf16 variant implies bf16 products, an
  // fp32 one fp32 products, whatever `precision` says. nullopt = the
  // ATTNSERVE_CPU_ISA environment variable if set, else the best variant for
  // `precision` and the inputs' dtype. Default: nullopt.
  std::optional<CpuIsa> isa;

  // Default: kAuto.
  FlashPrecision precision = FlashPrecision::kAuto;
};

// Computes every request of `batch` (each its own dims, dtypes, masks,
// lengths and options; see AttentionParams). Inputs may be FLOAT32, FLOAT16
// or BFLOAT16; the output and weights any of those.
//
// Paged K/V (AttentionParams::k_blocks, a session's KV cache) is read in
// place, block by block, without gathering it: a paged request's output
// and weights are bitwise equal to those of the same request with the same
// K/V laid out contiguously, for every variant and block size.
//
// Guarantees:
//  - Each output row is computed by one fixed sequence of operations that
//    depends only on its own request and the variant chosen: results are
//    bitwise reproducible and independent of the thread count and of the
//    other requests in `batch` (batch invariance).
//  - A query row that sees no key yields zeros (output and weights).
//  - Without weights, scratch is O(threads * block) plus, for requests with
//    few query rows and long keys (decode), O(heads * rows * Lk/512 * Dv)
//    partial results; no [Lq, Lk] matrix is ever allocated. With weights,
//    one [64, Lk] fp32 row block per thread.
//
// Errors: InvalidArgument when a request fails the kernel's own guard
// checks (null pointers, dims < 1, Hq % Hkv != 0, non-float dtypes; paged:
// both block tables and every block they need set, block_tokens a multiple
// of kPagedBlockTokensMultiple, batch 1);
// FailedPrecondition for a forced variant this CPU lacks or an unknown
// ATTNSERVE_CPU_ISA value. Nothing is written on error.
//
// Thread safety: may be called concurrently; every call uses its own
// scratch (per OpenMP worker thread).
absl::Status FlashAttention(absl::Span<const AttentionParams> batch,
                            const FlashOptions& options = {});

// The variant `options` (and the environment variable) select for inputs of
// `dtype`, or FailedPrecondition.
absl::StatusOr<CpuIsa> ResolveFlashIsa(DType dtype, const FlashOptions& options);

// The variant FlashAttention runs for request `p`: ResolveFlashIsa, except
// that decode-shaped requests (at most 7 query rows per kv head, grouped
// heads x new positions: flash::kDirectMaxRows) run on the AVX-512 fp32
// kernel instead of an automatically chosen bf16 one (they are bound by
// reading K/V, and fp32 products of bf16 inputs are exact).
absl::StatusOr<CpuIsa> FlashIsaFor(const AttentionParams& p, const FlashOptions& options);

}  // namespace attnserve::cpu

#endif  // ATTNSERVE_ENGINE_CPU_FLASH_ATTENTION_H_
