// The one plain struct every attention kernel takes: dims, strided pointers,
// masks, scale, grouped-query heads. One AttentionParams is one request; a
// ragged batch is a span of them (each with its own lengths, masks, options).
// Plain C++ (no absl, no STL), so that the CUDA kernels take it as it is,
// with device pointers in it; mask_broadcast.h builds its MaskParams.
#ifndef ATTNSERVE_ENGINE_ATTENTION_PARAMS_H_
#define ATTNSERVE_ENGINE_ATTENTION_PARAMS_H_

#include <cstdint>

#include "engine/dtype.h"

namespace attnserve {

// A mask over scores [b, h, i, j], read through broadcast strides.
struct MaskParams {
  enum class Kind : uint8_t {
    kNone,
    kBool,      // BOOL bytes: nonzero = may attend
    kAdditive,  // FLOAT32/FLOAT16/BFLOAT16 values added to the scaled scores
  };
  Kind kind = Kind::kNone;
  DType dtype = DType::kBool;
  const void* data = nullptr;
  // Element strides over [b, h, i, j]; 0 broadcasts that dim.
  int64_t stride_b = 0, stride_h = 0, stride_q = 0, stride_k = 0;
};

// softmax(Q K^T * scale + mask) V for one request of `batch` sequences.
// Element (b, h, i, d) of Q lives at q[b*q_stride_b + h*q_stride_h +
// i*q_stride_row + d] (the last dim is contiguous); likewise K, V, O. So the
// head layout [B, H, L, D] and the projected layout [B, L, H*D] are both
// expressed without copies.
struct AttentionParams {
  // Dims.
  int64_t batch = 0;
  int64_t num_heads = 0;     // Hq
  int64_t num_kv_heads = 0;  // Hkv; num_heads % num_kv_heads == 0
  int64_t head_dim = 0;      // Dk (of Q and K)
  int64_t head_dim_v = 0;    // Dv (of V and O)
  int64_t q_len = 0;         // Lq
  int64_t kv_len = 0;        // Lk

  // Inputs: all three share `dtype` (FLOAT32, FLOAT16 or BFLOAT16).
  DType dtype = DType::kFloat32;
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  int64_t q_stride_b = 0, q_stride_h = 0, q_stride_row = 0;
  int64_t k_stride_b = 0, k_stride_h = 0, k_stride_row = 0;
  int64_t v_stride_b = 0, v_stride_h = 0, v_stride_row = 0;
  // Paged K/V (server-side sessions, a paged KV cache). When k_blocks is set,
  // K and V are read from fixed-size blocks of `block_tokens` tokens instead
  // of through k/v and their strides: key (h, j, d) lives at
  //   k_blocks[j / block_tokens][(h * block_tokens + j % block_tokens) * head_dim + d]
  // and value (h, j, d) likewise in v_blocks with head_dim_v; the blocks hold
  // `dtype` elements. ceil(kv_len / block_tokens) pointers each; batch == 1
  // (one sequence per params: a batch of sessions is a span of params).
  // block_tokens is a multiple of kPagedBlockTokensMultiple: a kernel whose
  // key tiles are min(its tile, block_tokens) keys, aligned to the block,
  // never has a tile straddle two blocks. With a sliding window, the blocks
  // before FirstWindowKey (below) may be null.
  const void* const* k_blocks = nullptr;
  const void* const* v_blocks = nullptr;
  int64_t block_tokens = 0;

  // Output [b, h, i, :Dv] in `out_dtype`.
  DType out_dtype = DType::kFloat32;
  void* out = nullptr;
  int64_t o_stride_b = 0, o_stride_h = 0, o_stride_row = 0;

  // Masking. Query i sits at position i + (kv_len - q_len) (bottom-right
  // aligned) and sees key j iff all hold:
  //   causal => j <= i + (kv_len - q_len)
  //   window > 0 => j >= i + (kv_len - q_len) - window + 1   (sliding window)
  //   window > 0 and not causal => j <= i + (kv_len - q_len) + window - 1
  //                                (a two-sided window: the keys within
  //                                 window - 1 positions either side)
  //   chunk > 0 => j >= (i + (kv_len - q_len)) / chunk * chunk
  //                                (chunked attention: with causal, the
  //                                 query's own chunk of `chunk` keys)
  //   key_lengths != nullptr => j < key_lengths[b]
  //   mask is kBool => mask(b, h, i, j) != 0
  // A row that sees no key yields zeros (output and weights), never NaN.
  // FirstVisibleKey (below) is the window and chunk rules' first key,
  // KeyEndOfRow the causal and window rules' end.
  bool causal = false;
  int64_t window = 0;
  int64_t chunk = 0;
  const int64_t* key_lengths = nullptr;  // [batch], values in [0, kv_len]
  MaskParams mask;

  // Multiplies Q K^T; already resolved (finite, > 0).
  float scale = 1.0f;
  // > 0: logit softcapping (Gemma 2): each scaled score s becomes
  // softcap * tanh(s / softcap), before the masks are added.
  float softcap = 0.0f;
  // Attention sinks (gpt-oss): [num_heads] logits, one per query head, that
  // join each row's softmax denominator as a key with no value row (the
  // probabilities of the real keys then sum to less than 1). nullptr: none.
  const float* sinks = nullptr;
  // ALiBi (BLOOM, MPT, Falcon-RW): [num_heads] slopes, one per query head.
  // Head h's score of key j for the query at position q (i + kv_len - q_len)
  // gets alibi_slopes[h] * (j - q) added after the scale and softcap, before
  // the masks. The models add slope * j (or slope * (j - (Lk - 1))): per row
  // a constant away, which softmax does not see; j - q keeps the bias small
  // (<= 0 under causal) at any length. nullptr: none.
  const float* alibi_slopes = nullptr;
  // A learned relative position bias (T5, mT5, UMT5, MPNet): [num_heads,
  // 2 * relative_bias_distance + 1] FLOAT32, row h for query head h. Head h's
  // score of key j for the query at position q (as above) gets
  // relative_bias[h * (2D + 1) + clamp(j - q, -D, D) + D] added after the
  // scale, softcap and ALiBi, before the masks (D = relative_bias_distance):
  // the models' buckets of j - q, each bucket's learned value written out
  // per distance, every distance beyond D in the bucket of D (or -D).
  // nullptr: none (relative_bias_distance is then unused).
  const float* relative_bias = nullptr;
  int64_t relative_bias_distance = 0;
  // Relative position embeddings in the scores (DeBERTa's disentangled
  // attention): FLOAT32 tables [num_heads, head_dim, 2D + 1], D =
  // relative_embedding_distance, each head's values for one feature
  // contiguous along the distance. With c = clamp(j - q, -D, D) + D (q the
  // query's position, as above), head h's raw score of key j, Q_i . K_j, gets
  //   sum_d Q_i[d] * relative_key[h][d][c]     (content to position)
  //   + sum_d K_j[d] * relative_query[h][d][c] (position to content)
  // added before the scale, so the scale, softcap, biases and masks act on
  // the sum (K_j: kv head h / (Hq / Hkv)'s key row). Either table may be
  // nullptr; both nullptr: none (the distance is then unused).
  const float* relative_key = nullptr;
  const float* relative_query = nullptr;
  int64_t relative_embedding_distance = 0;

  // Optional softmax probabilities in `weights_dtype`, contiguous:
  // [batch, num_heads, q_len, kv_len], or [batch, q_len, kv_len] averaged
  // over heads when average_weights. nullptr = not wanted.
  void* weights = nullptr;
  DType weights_dtype = DType::kFloat32;
  bool average_weights = false;
};

// Paged K/V blocks hold a multiple of this many tokens (see AttentionParams).
inline constexpr int64_t kPagedBlockTokensMultiple = 16;

// The first key the query at `position` sees under the sliding window and
// chunk rules (AttentionParams; 0 without either). It never decreases as
// the position grows.
inline int64_t FirstVisibleKey(int64_t position, int64_t window, int64_t chunk) {
  int64_t start = 0;
  if (window > 0 && position - window + 1 > start) start = position - window + 1;
  if (chunk > 0 && position / chunk * chunk > start) start = position / chunk * chunk;
  return start;
}

// One past the last key the query at `position` sees under the causal and
// sliding window rules (AttentionParams), before kv_len and key_lengths cut
// it: position + 1 with causal, position + window for a two-sided window,
// else no bound (INT64_MAX). It never decreases as the position grows.
inline int64_t KeyEndOfRow(int64_t position, bool causal, int64_t window) {
  if (causal) return position + 1;
  if (window > 0) return position + window;
  return INT64_MAX;
}

// Sliding windows and chunks over paged K/V. A kernel may read keys from the
// start of the kWindowGrainTokens-aligned run that holds a row's first
// visible key (the cpu kernel's key blocks are aligned so, which keeps a
// paged request bitwise equal to the contiguous one), never earlier. So the
// blocks wholly before FirstWindowKey(first query position, window, chunk)
// may be null (a session releases them): with window or chunk > 0, no
// weights, the first query row at position kv_len - q_len.
inline constexpr int64_t kWindowGrainTokens = 256;
inline int64_t FirstWindowKey(int64_t first_query_position, int64_t window, int64_t chunk) {
  const int64_t start = FirstVisibleKey(first_query_position, window, chunk);
  return start / kWindowGrainTokens * kWindowGrainTokens;
}

// Strides for a contiguous [B, H, L, D] tensor.
inline void HeadLayoutStrides(int64_t heads, int64_t len, int64_t dim,
                              int64_t* stride_b, int64_t* stride_h,
                              int64_t* stride_row) {
  *stride_row = dim;
  *stride_h = len * dim;
  *stride_b = heads * len * dim;
}

// Strides for a contiguous [B, L, H * D] tensor read as heads.
inline void TokenLayoutStrides(int64_t heads, int64_t len, int64_t dim,
                               int64_t* stride_b, int64_t* stride_h,
                               int64_t* stride_row) {
  *stride_row = heads * dim;
  *stride_h = dim;
  *stride_b = len * heads * dim;
}

// HeadLayoutStrides or TokenLayoutStrides.
using LayoutStrides = void (*)(int64_t heads, int64_t len, int64_t dim, int64_t* stride_b,
                               int64_t* stride_h, int64_t* stride_row);

// Sets every stride of `p` for contiguous Q, K, V and O, all in `layout`
// (Q and O over num_heads, K and V over num_kv_heads).
inline void SetContiguousStrides(AttentionParams* p, LayoutStrides layout) {
  layout(p->num_heads, p->q_len, p->head_dim, &p->q_stride_b, &p->q_stride_h, &p->q_stride_row);
  layout(p->num_kv_heads, p->kv_len, p->head_dim, &p->k_stride_b, &p->k_stride_h,
         &p->k_stride_row);
  layout(p->num_kv_heads, p->kv_len, p->head_dim_v, &p->v_stride_b, &p->v_stride_h,
         &p->v_stride_row);
  layout(p->num_heads, p->q_len, p->head_dim_v, &p->o_stride_b, &p->o_stride_h, &p->o_stride_row);
}

}  // namespace attnserve

#endif  // ATTNSERVE_ENGINE_ATTENTION_PARAMS_H_
