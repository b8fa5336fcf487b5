// The CUDA kernels' host-side interface: the launchers that pick a compiled
// variant for an AttentionParams over device pointers. Plain headers only (no
// absl), so that the .cu files compile with nvcc alone.
#ifndef ATTNSERVE_ENGINE_CUDA_ATTENTION_KERNELS_H_
#define ATTNSERVE_ENGINE_CUDA_ATTENTION_KERNELS_H_

#include <cuda_runtime_api.h>

#include <cstdint>

#include "engine/attention_params.h"
#include "engine/dtype.h"

namespace attnserve::cuda {

// The attention launchers take AttentionParams whose every pointer (q, k, v,
// out, key_lengths, mask.data, sinks, alibi_slopes, relative_bias,
// relative_key, relative_query, weights) is on the device. Weights, when
// wanted, are written per head, contiguous [batch, num_heads, q_len,
// kv_len] in weights_dtype: average_weights must be false (the engine
// averages them with LaunchAverageHeads).

// The fused tensor-core kernel (flash_attention.cu) serves a request when its
// inputs are FLOAT16/BFLOAT16, head_dim == head_dim_v is 64 or 128, no
// weights are wanted, K/V are not paged and q/k/v are 16-byte aligned with
// strides that are multiples of 8 elements; every masking rule, the sliding
// window, softcapping, sinks, ALiBi, the relative position bias and the
// relative position embeddings included (the embeddings' terms from the
// query and key tiles in shared memory). (The engine routes requests with
// the last six to it only with ATTNSERVE_CUDA_EXPERIMENTAL_FUSED=1, until a
// GPU run has verified them: UsesLayerFeatures.)
bool FlashAttentionSupports(const AttentionParams& args);
cudaError_t LaunchFlashAttention(const AttentionParams& args, cudaStream_t stream);

// The fused fp32 kernel (flash_attention_fp32.cu): the same with both
// products exact to fp32 by 3xTF32 on tensor cores. Serves a request when
// its inputs are FLOAT32, head_dim == head_dim_v is 64 or 128, no weights
// are wanted, K/V are not paged, q/k/v are 16-byte aligned with strides that
// are multiples of 4 elements, and the kernel's shared memory
// (FlashAttentionFp32SharedBytes: 102 KiB at head dim 64, 132 KiB at 128)
// fits the device's max_shared_bytes per block (opt-in). The engine routes
// requests to it only with ATTNSERVE_CUDA_EXPERIMENTAL_FUSED=1, until a GPU
// run has verified it.
int FlashAttentionFp32SharedBytes(int64_t head_dim);
bool FlashAttentionFp32Supports(const AttentionParams& args, int max_shared_bytes);
cudaError_t LaunchFlashAttentionFp32(const AttentionParams& args, int max_shared_bytes,
                                     cudaStream_t stream);

// Whether a request asks for what today's attention layers add (a sliding
// window or chunk, logit softcapping, sinks, ALiBi, a relative position
// bias, relative position embeddings): the fused kernels' newer rules.
inline bool UsesLayerFeatures(const AttentionParams& args) {
  return args.window > 0 || args.chunk > 0 || args.softcap > 0.0f || args.sinks != nullptr ||
         args.alibi_slopes != nullptr || args.relative_bias != nullptr ||
         args.relative_key != nullptr || args.relative_query != nullptr;
}

// The general kernel (attention_general.cu): any float dtype, any head dims,
// writes weights when asked. Slower; one warp per query row.
cudaError_t LaunchAttentionGeneral(const AttentionParams& args, cudaStream_t stream);

// The unfused path (unfused_attention.h), over FLOAT32 q/k/v (FLOAT16 or
// BFLOAT16 for the pointers of EnqueueWeights' GEMM), for the (b, h) pairs
// [p0, p0 + count) of `a` (pair = b * num_heads + h):
//  - LaunchPairPointers: the batched GEMMs' pointer arrays (count each): Q,
//    K (kv head h / group) and V rows of each pair, its score block
//    s + n * q_len * kv_len (and, when lo_ptrs is set, lo + n * q_len *
//    kv_len: the low parts of 3xTF32), its output block o + n * q_len *
//    head_dim_v;
//  - LaunchSoftmaxRows: each score row in place -> probabilities (the
//    relative position embeddings' terms, from a's FLOAT32 q and k, added
//    to the raw scores; scale, softcap, ALiBi, relative bias, causal,
//    window, key_lengths, mask, sinks; zeros for a row that sees no key),
//    and into a.weights (per head, weights_dtype) when set;
//    cudaErrorInvalidValue for embeddings over another dtype.
//    With `lo` (same layout as s), s gets each probability's TF32 high part
//    and lo the rest (3xTF32 products, below);
//  - LaunchScatterOutput: o [count, q_len, head_dim_v] into a.out's strides
//    and out_dtype; with `split`, o is [count, q_len, 2 * head_dim_v] and
//    each output is the sum of its two halves.
cudaError_t LaunchPairPointers(const AttentionParams& a, int64_t p0, int64_t count,
                               const float* s, const float* lo, float* o, const void** q_ptrs,
                               const void** k_ptrs, const void** v_ptrs, void** s_ptrs,
                               void** lo_ptrs, void** o_ptrs, cudaStream_t stream);
cudaError_t LaunchSoftmaxRows(const AttentionParams& a, int64_t p0, int64_t count, float* s,
                              float* lo, cudaStream_t stream);
cudaError_t LaunchScatterOutput(const AttentionParams& a, int64_t p0, int64_t count,
                                const float* o, bool split, cudaStream_t stream);
// need_weights from row statistics (UnfusedAttention::EnqueueWeights): for
// the chunk's score rows s [count, q_len, kv_len] (Q K^T, unscaled) and the
// rows' log-sum-exp lse[(b * num_heads + h) * lse_rows + i], writes
// exp(t - lse) for the keys a row sees (t = mask(scale * s), the softmax's
// rules but softcap, sinks, ALiBi, the relative bias and the relative
// position embeddings, which the statistics' source refuses), zero
// elsewhere and for a row that sees no key, into a.weights (per head,
// weights_dtype).
cudaError_t LaunchWeightsFromStats(const AttentionParams& a, int64_t p0, int64_t count,
                                   const float* s, const float* lse, int64_t lse_rows,
                                   cudaStream_t stream);

// 3xTF32 operands (unfused_attention.h): x [batch, heads, len, dim] FLOAT32
// at strides (stride_b, stride_h, stride_row; the last dim contiguous) ->
// out contiguous [batch, heads, len, parts * dim], each row the `parts`
// copies that `pattern` names of its TF32 high part (h) and the rest (l):
// kHhl = [h | h | l] (Q), kHlh = [h | l | h] (K), kHl = [h | l] (V).
enum class Tf32Split { kHhl, kHlh, kHl };
cudaError_t LaunchTf32Split(const float* x, int64_t batch, int64_t heads, int64_t len,
                            int64_t dim, int64_t stride_b, int64_t stride_h, int64_t stride_row,
                            Tf32Split pattern, float* out, cudaStream_t stream);

// What happens to a projection layer's projected Q and K between the
// projections and the attention core, in place, as the cpu engine does it
// (qk_transform.cu; engine/qk_norm.h, engine/rope.h). Both read rows
// r < rows of a matrix of `type` (FLOAT32, FLOAT16 or BFLOAT16) at
// x + r * row_stride elements, `heads` heads of head_dim features each, and
// compute in float with float64 where the cpu engine uses it.
//
// QK-norm of every head: x / sqrt(mean(x^2) + eps) * w, or * (1 + w) with
// weight_offset, or (x - mean) / sqrt(var + eps) * w with subtract_mean; the
// means in float64; head h's weights [head_dim] FLOAT32 on the device at
// w + h * weight_stride (0: shared by every head); w nullptr: weights of 1
// (the value norm).
cudaError_t LaunchQkNorm(void* x, DType type, int64_t rows, int64_t row_stride, int64_t heads,
                         int64_t head_dim, const float* w, double eps, bool weight_offset,
                         bool subtract_mean, int64_t weight_stride, cudaStream_t stream);

// RoPE of every head's first rotary_dim features: pairs (i, i + rotary_dim /
// 2), or (2i, 2i + 1) when interleaved, rotate by position * inv_freq[i];
// cos and sin in float64 (times attention_factor), rounded to float once.
// Row r is token t = r % seq_len of sequence b = r / seq_len, at position
// positions[b * positions_stride + first + t] when `positions` (device) is
// set, else first + t.
struct RotaryArgs {
  const double* inv_freq = nullptr;  // [rotary_dim / 2], device
  double attention_factor = 1.0;
  int64_t rotary_dim = 0;
  bool interleaved = false;
  const int64_t* positions = nullptr;
  int64_t positions_stride = 0;
  int64_t first = 0;
};
cudaError_t LaunchRotary(void* x, DType type, int64_t rows, int64_t seq_len, int64_t row_stride,
                         int64_t heads, int64_t head_dim, const RotaryArgs& rotary,
                         cudaStream_t stream);

// QKV clipping (clip_qkv): the first `width` features of rows r < rows (at
// x + r * row_stride elements of `type`) clamped to [-limit, limit].
cudaError_t LaunchClip(void* x, DType type, int64_t rows, int64_t row_stride, int64_t width,
                       float limit, cudaStream_t stream);

// Attention temperature tuning (engine/temperature.h) of every query row:
// row r (its `width` features) is token t = r % seq_len of sequence b = r /
// seq_len, at index first + t, or at positions[b * positions_stride + first
// + t] when `positions` (device) is set, and is multiplied by
// log1p(floor((p + 1) / floor_scale)) * attn_scale + 1, or without the + 1
// when by_position (float64, rounded to float once).
struct TemperatureArgs {
  double floor_scale = 0.0;
  double attn_scale = 0.0;
  bool by_position = false;
  const int64_t* positions = nullptr;
  int64_t positions_stride = 0;
  int64_t first = 0;
};
cudaError_t LaunchQueryTemperature(void* x, DType type, int64_t rows, int64_t seq_len,
                                   int64_t row_stride, int64_t width, const TemperatureArgs& a,
                                   cudaStream_t stream);

// dst[i] = (dst_type) src[i] for i < n (float dtypes only).
cudaError_t LaunchConvert(const void* src, DType src_type, void* dst, DType dst_type, int64_t n,
                          cudaStream_t stream);

// y[r, c] += bias[c] for a row-major [rows, cols] y; y and bias share `type`.
cudaError_t LaunchAddBias(void* y, const void* bias, DType type, int64_t rows, int64_t cols,
                          cudaStream_t stream);

// Gated attention (engine/output_gate.h): x[i] *= sigmoid(gate[i]) for
// i < n, x and gate of `type`; for bf16/fp16 the sigmoid is rounded to it
// before the product, as PyTorch computes a layer of that dtype.
cudaError_t LaunchOutputGate(void* x, const void* gate, DType type, int64_t n,
                             cudaStream_t stream);

// Multi-head latent attention's keys (LatentAttention): for r < rows and
// h < heads, key[r][h] = [nope[r][h] (nope_dim) | rope[r] (rope_dim)], all
// contiguous and of `type` (the values copied exactly).
cudaError_t LaunchAssembleLatentKeys(void* key, const void* nope, const void* rope, DType type,
                                     int64_t rows, int64_t heads, int64_t nope_dim,
                                     int64_t rope_dim, cudaStream_t stream);

// out[b, r] = mean over h of probs[b, h, r] for probs [batch, heads, per_head]
// (fp32), summed in head order so that the result is deterministic.
cudaError_t LaunchAverageHeads(const float* probs, int64_t batch, int64_t heads, int64_t per_head,
                               void* out, DType out_type, cudaStream_t stream);

// out[b, h, i, j] for b < batch, h < heads, i < q_pad, j < kv_pad
// (contiguous, `out_type`): the mask's additive value at (b, h, i, j) read
// through its broadcast strides (a bool mask gives 0 or -inf), or 0 where
// i >= q_len or j >= kv_len. Pass batch 1 (heads 1) for a mask that
// broadcasts over that dim.
cudaError_t LaunchExpandMask(const MaskParams& mask, int64_t batch, int64_t heads, int64_t q_len,
                             int64_t kv_len, int64_t q_pad, int64_t kv_pad, void* out,
                             DType out_type, cudaStream_t stream);

}  // namespace attnserve::cuda

#endif  // ATTNSERVE_ENGINE_CUDA_ATTENTION_KERNELS_H_
