// An attention layer as the engine sees it: dims, options and weights in one
// canonical layout, whatever checkpoint format they came from.
#ifndef ATTNSERVE_ENGINE_ATTENTION_LAYER_H_
#define ATTNSERVE_ENGINE_ATTENTION_LAYER_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "engine/tensor.h"

namespace attnserve {

enum class Precision : uint8_t { kFloat32, kBFloat16, kFloat16 };

// `v` as a weight stored in `precision` keeps it: rounded to bf16 or fp16 the
// way the tensor conversions round (FloatToBFloat16, FloatToHalf), widened
// back to float.
inline float RoundTo(Precision precision, float v) {
  switch (precision) {
    case Precision::kFloat32: return v;
    case Precision::kBFloat16: return BFloat16ToFloat(FloatToBFloat16(v));
    case Precision::kFloat16: return HalfToFloat(FloatToHalf(v));
  }
  return v;
}

// Rotary position embeddings (RoPE) of a projection layer, applied to the
// projected Q and K of every head as Hugging Face transformers applies them
// (engine/rope.h): the first `rotary_dim` features of a head rotate by
// position * inv_freq[i], in pairs (i, i + rotary_dim / 2) ("rotate half":
// Llama, Mistral, Qwen, Gemma, Phi, GPT-NeoX) or (2i, 2i + 1) when
// `interleaved` (GPT-J). The scaling types change inv_freq (and, for YaRN and
// LongRoPE, scale cos and sin by attention_factor); fields a type does not
// use are 0. LongRoPE (Phi-3.5, Phi-4-mini) has two sets of frequencies, and
// a forward call uses the long ones when its largest position reaches
// original_max_position_embeddings (ComputeRopeFrequencies).
struct RopeConfig {
  enum class Type : uint8_t { kNone, kDefault, kLinear, kLlama3, kYarn, kLongRope };
  Type type = Type::kNone;
  double theta = 10000.0;  // the base of the frequencies
  int64_t rotary_dim = 0;  // even, 0 < rotary_dim <= head_dim
  bool interleaved = false;
  double factor = 0.0;            // linear, llama3, yarn, longrope: > 0
  double low_freq_factor = 0.0;   // llama3
  double high_freq_factor = 0.0;  // llama3: >= low_freq_factor
  int64_t original_max_position_embeddings = 0;  // llama3, yarn, longrope
  double beta_fast = 0.0, beta_slow = 0.0;       // yarn
  double attention_factor = 0.0;                 // yarn, longrope: > 0
  bool truncate = true;                          // yarn: round the correction range outwards
  // longrope: rotary_dim / 2 divisors of the frequencies each (> 0).
  std::vector<double> short_factor, long_factor;
};

// QK-norm: RMSNorm of the projected Q and K, before RoPE, with a learned
// weight per feature: x / sqrt(mean(x^2) + eps) * w, or * (1 + w) with
// weight_offset (Gemma). Over each head (Qwen3, Gemma3), or, with
// whole_projection, over all the heads of a token's projection at once
// (OLMo-2: the mean over num_heads * head_dim features for Q,
// num_kv_heads * head_dim for K). With after_rope, it normalises the rotated
// Q and K instead (Hunyuan).
//
// With subtract_mean, each vector's mean is subtracted first and the
// variance taken about it: LayerNorm without a bias (Cohere's
// CohereLayerNorm, use_qk_norm). With per_head_weights, each head has
// weights of its own: [num_heads * head_dim] for Q, [num_kv_heads *
// head_dim] for K, head h's at h * head_dim (Cohere's [heads, head_dim]);
// not with whole_projection.
struct QkNormConfig {
  bool enabled = false;
  double eps = 1e-6;  // > 0
  bool weight_offset = false;
  bool whole_projection = false;
  bool after_rope = false;
  bool subtract_mean = false;
  bool per_head_weights = false;
};

// Attention temperature tuning (Llama 4's layers without RoPE,
// attn_temperature_tuning): each query row, after the projections (and any
// QK-norm and RoPE), is multiplied by
//   log1p(floor((p + 1) / floor_scale)) * attn_scale + 1,
// p the query's index in its sequence (in a session, after its cached
// tokens), as transformers takes its cache position: explicit positions do
// not change it (engine/temperature.h).
//
// With by_position (Ministral 3, Mistral 4: transformers'
// get_llama_4_attn_scale), the factor is 1 + attn_scale * log(1 + floor(p /
// floor_scale)) with p the query's rotary position: its index after the
// cached tokens, or its explicit position.
struct TemperatureTuning {
  bool enabled = false;
  double floor_scale = 0.0;  // > 0
  double attn_scale = 0.0;   // finite
  bool by_position = false;
};

// Multi-head latent attention (DeepSeek-V2/V3, Kimi K2; transformers'
// DeepseekV3Attention). Each head's query and key have head_dim = nope +
// rope_dim features: the first nope ("no position") features, then rope_dim
// that RoPE rotates (LayerConfig::rope, rotary_dim == rope_dim, on those last
// features). Per token x:
//   query = x Wq^T + bq, or with q_lora_rank > 0
//           RMSNorm(x Wq_a^T + bq_a; q_a_norm) Wq^T
//   [c | k_rope] = x Wkv_a^T + bkv_a          (kv_lora_rank + rope_dim)
//   c' = RMSNorm(c; kv_a_norm)
//   key_h = [c' Wk_h^T | k_rope]  (k_rope, one vector, shared by every head)
//   value_h = c' Wv_h^T           (v_head_dim features)
// RMSNorm(x; w) = x / sqrt(mean(x^2) + eps) * w, the mean in float64. Wk and
// Wv are kv_b_proj's rows split per head (weight_loader.h); there are as many
// key/value heads as query heads, and no QK-norm, output gate or sinks.
// temperature_tuning (Mistral 4's by_position) scales each query head's
// whole row, nope and rope features, after RoPE. K and V both come from the
// token's own input, so a request carries no separate key or value
// (self-attention only).
struct LatentAttention {
  bool enabled = false;
  int64_t q_lora_rank = 0;   // 0: one query projection from x
  int64_t kv_lora_rank = 0;  // > 0
  int64_t rope_dim = 0;      // > 0, even, < head_dim
  int64_t v_head_dim = 0;    // > 0
  double q_norm_eps = 1e-6;  // > 0 (q_lora_rank > 0)
  double kv_norm_eps = 1e-6;  // > 0
};

// Relative position embeddings in the scores (DeBERTa's disentangled
// attention, DeBERTa v1 to v3): learned vectors per distance that the
// queries score as keys (content to position, LayerWeights::relative_key)
// and the keys score as queries (position to content, relative_query), each
// [num_heads, head_dim, 2 * distance + 1] (AttentionParams::relative_key).
// Projection layers only, not latent.
struct RelativeEmbeddings {
  int64_t distance = 0;  // > 0: enabled
  bool content_to_position = false;
  bool position_to_content = false;
};

struct LayerConfig {
  std::string name;
  // false: bare scaled-dot-product attention ("sdpa"); inputs are in head
  // layout [B, H, L, D] and no weights exist. true: nn.MultiheadAttention
  // semantics (batch first); inputs are [B, L, dim].
  bool has_projections = false;

  // Projection dims (has_projections only). Q projects query_dim ->
  // num_heads * head_dim, K key_dim -> num_kv_heads * head_dim, V value_dim
  // -> num_kv_heads * head_dim, O num_heads * head_dim -> out_dim.
  int64_t embed_dim = 0;
  int64_t num_heads = 0;
  int64_t num_kv_heads = 0;
  int64_t head_dim = 0;
  int64_t query_dim = 0;
  int64_t key_dim = 0;
  int64_t value_dim = 0;
  int64_t out_dim = 0;

  // 0 = 1/sqrt(head_dim). A request's nonzero scale overrides it.
  float scale = 0.0f;
  // Every request is causal (in addition to requests that ask for it).
  bool causal = false;
  // Weight and compute precision of the projections and attention core.
  Precision precision = Precision::kFloat32;
  // Projection layers only. Positions: a request's keys sit at 0..Lk-1 (in a
  // session, continuing after its cached tokens) and its queries at
  // Lk-Lq..Lk-1, the bottom-right rule of `causal`.
  RopeConfig rope;
  // Projection layers only; its weights are LayerWeights::q_norm / k_norm.
  QkNormConfig qk_norm;
  // > 0: sliding-window attention, Hugging Face's rule: the query at position
  // p sees keys p - sliding_window + 1 .. p (with causal; positions as above).
  // Without causal the window is two-sided: keys p - sliding_window + 1 ..
  // p + sliding_window - 1 (EmbeddingGemma's, Gemma 4's bidirectional layers).
  int64_t sliding_window = 0;
  // > 0: chunked attention (Llama 4's attention_chunk_size): the query at
  // position p sees keys floor(p / attention_chunk) * attention_chunk .. p,
  // its own chunk (positions as above; causal layers only).
  int64_t attention_chunk = 0;
  // Projection layers only (above).
  TemperatureTuning temperature_tuning;
  // > 0: logit softcapping: scores = softcap * tanh(scores / softcap) after
  // the scale, before the masks (Gemma 2's attn_logit_softcapping).
  float softcap = 0.0f;
  // Attention sinks (gpt-oss): LayerWeights::sinks holds one logit per query
  // head that joins each row's softmax denominator with no value row.
  // Projection layers only.
  bool sinks = false;
  // ALiBi (BLOOM, MPT, Falcon-RW): empty, or one slope per query head; head
  // h's score of key j for the query at position p gets alibi_slopes[h] *
  // (j - p) added after the scale and softcap, before the masks (positions
  // as above; AttentionParams::alibi_slopes). Finite.
  std::vector<float> alibi_slopes;
  // > 0: a learned relative position bias (T5, mT5, UMT5, MPNet) that reaches
  // relative_bias_distance keys each way: LayerWeights::relative_bias, head
  // h's score of key j for the query at position p gets relative_bias[h][
  // clamp(j - p, -D, D) + D] added after the scale, softcap and ALiBi, before
  // the masks (AttentionParams::relative_bias). Projection layers only.
  int64_t relative_bias_distance = 0;
  // Relative position embeddings (above): head h's raw score Q_i . K_j gets
  // Q_i . relative_key[h][:, c] + K_j . relative_query[h][:, c] added before
  // the scale, c = clamp(j - p, -distance, distance) + distance (positions
  // as above); at least one of the two when distance > 0.
  RelativeEmbeddings relative_embeddings;
  // Gated attention (Qwen3-Next, Qwen3.5, AFMoE): each token's core output,
  // its heads concatenated ([num_heads * head_dim]), is multiplied
  // elementwise by sigmoid(x Wg^T + bg) of the token's query input before
  // the output projection (LayerWeights::wg, bg; engine/output_gate.h).
  // Projection layers only.
  bool output_gate = false;
  // > 0: QKV clipping (OLMo's and DBRX's clip_qkv): every projected query,
  // key and value feature is clamped to [-clip_qkv, clip_qkv], after the
  // projections (and a QK-norm before RoPE), before RoPE. Projection layers
  // only; not with latent attention.
  float clip_qkv = 0.0f;

  // > 0: each projected value head is RMS-normalised without a weight
  // (Gemma 3n's and Gemma 4's v_norm), v / sqrt(mean(v^2) + v_norm_eps),
  // the mean in float64, after the projections and before any clipping and
  // before a session caches it. 0: none. Projection layers, not latent.
  double v_norm_eps = 0.0;
  // Non-empty: the keys and values are another layer's (KV sharing, Gemma 3n
  // and Gemma 4), named here: the K/V projections and norms are that
  // layer's, applied to the key/value inputs, which a request must carry (the
  // server refuses one without; the engine computes what it is given).
  // Projection layers, not latent.
  std::string kv_source;
  // > 0: DeepSeek's sparse attention (DSA), whose indexer keeps each query's
  // top sparse_index_topk keys: dense attention over at most that many keys
  // (the server refuses more; the engine computes what it is given).
  int64_t sparse_index_topk = 0;
  // Multi-head latent attention (above); projection layers only.
  LatentAttention latent;
};

// The largest relative_bias_distance a layer takes (T5's and MPNet's: 128).
inline constexpr int64_t kMaxRelativeBiasDistance = int64_t{1} << 16;
// The largest RelativeEmbeddings::distance a layer takes (DeBERTa v3's reach
// about 520 positions, v1's 512).
inline constexpr int64_t kMaxRelativeEmbeddingDistance = int64_t{1} << 16;

// Features of each head's value and core output: latent.v_head_dim for a
// latent layer, head_dim otherwise.
inline int64_t ValueHeadDim(const LayerConfig& c) {
  return c.latent.enabled ? c.latent.v_head_dim : c.head_dim;
}

// Weights in PyTorch Linear layout ([out_features, in_features]), FLOAT32.
// An empty bias Tensor (no data) means no bias. A latent layer
// (LayerConfig::latent) has its own shapes, listed after the fields.
struct LayerWeights {
  Tensor wq, bq;  // [num_heads * head_dim, query_dim], [num_heads * head_dim]
  Tensor wk, bk;  // [num_kv_heads * head_dim, key_dim], [num_kv_heads * head_dim]
  Tensor wv, bv;  // [num_kv_heads * head_dim, value_dim], [num_kv_heads * head_dim]
  Tensor wo, bo;  // [out_dim, num_heads * head_dim], [out_dim]
  // QK-norm weights when LayerConfig::qk_norm.enabled, [head_dim] each, or
  // with whole_projection or per_head_weights [num_heads * head_dim] and
  // [num_kv_heads * head_dim] (engine/qk_norm.h, QkNormShape); empty
  // otherwise.
  Tensor q_norm, k_norm;
  // [num_heads] when LayerConfig::sinks; empty otherwise.
  Tensor sinks;
  // [num_heads, 2 * relative_bias_distance + 1] when
  // LayerConfig::relative_bias_distance > 0; empty otherwise.
  Tensor relative_bias;
  // [num_heads, head_dim, 2 * distance + 1] when
  // LayerConfig::relative_embeddings has content_to_position (relative_key)
  // or position_to_content (relative_query); empty otherwise.
  Tensor relative_key, relative_query;
  // When LayerConfig::output_gate: [num_heads * head_dim, query_dim] and
  // [num_heads * head_dim] (bg may be empty); empty otherwise.
  Tensor wg, bg;
  // Latent layers (Dqk = head_dim, nope = head_dim - rope_dim, Dv =
  // v_head_dim, H = num_heads = num_kv_heads):
  //   wq [H * Dqk, q_lora_rank > 0 ? q_lora_rank : query_dim], bq empty
  //     (with q_lora_rank: wq_a [q_lora_rank, query_dim], bq_a, q_a_norm
  //     [q_lora_rank]);
  //   wkv_a [kv_lora_rank + rope_dim, query_dim], bkv_a, kv_a_norm
  //     [kv_lora_rank];
  //   wk [H * nope, kv_lora_rank], wv [H * Dv, kv_lora_rank], bk, bv empty;
  //   wo [out_dim, H * Dv], bo.
  // Empty on other layers.
  Tensor wq_a, bq_a, q_a_norm;
  Tensor wkv_a, bkv_a, kv_a_norm;
};

// A number no other layer object of this process ever gets: engines that keep
// a converted copy of a layer's weights (the CUDA engine's device copy) key it
// on this, because a layer's address, and its weights' addresses, can be
// reused by a later layer once it is gone. A copy or a move is another layer
// object and gets its own id.
class LayerId {
 public:
  LayerId();
  LayerId(const LayerId&) : LayerId() {}
  LayerId& operator=(const LayerId&);
  uint64_t value() const { return value_; }

 private:
  uint64_t value_;
};

// Immutable once built; shared by every engine instance that serves it.
struct AttentionLayer {
  LayerConfig config;
  LayerWeights weights;
  LayerId id;
};

// How much one projection y = W x + b can grow a value: every |y_i| <=
// gain * max|x| + bias, with gain = max over rows of sum_j |W[i, j]| (W's
// infinity norm) and bias = max |b|; the same bounds every partial sum of
// the product. +inf when a weight is not finite. Zero when absent.
struct ProjectionBound {
  double gain = 0;
  double bias = 0;
  double Apply(double max_abs_x) const { return gain * max_abs_x + bias; }
};

// The projections' bounds: what validation needs to bound a projection
// model's scores before compute (server/request/validation.h). Measured
// once per layer (one pass over the weights). `g` is the output gate's
// (zero without one): its projection must stay finite (a NaN weight would
// reach every output through sigmoid), while the gate itself, in [0, 1],
// makes the core output that `o` is applied to no larger.
// For a latent layer, q, k and v bound the query, key and value heads the
// attention core sees (the RMSNorm of a latent bounds each of its features by
// sqrt(rank) * max|weight|, whatever the input), and `latent` the latent
// projections themselves (x Wq_a^T and x Wkv_a^T; zero on other layers).
// q_norm and k_norm are the largest |w| of the QK-norm weights (zero without
// them; +inf when one is not finite): a normalised head's 2-norm is at most
// sqrt(its features) * max|w| (or 1 + max|w| with weight_offset), whatever
// the projection.
struct LayerWeightBounds {
  ProjectionBound q, k, v, o, g, latent;
  double q_norm = 0, k_norm = 0;
  // The largest |value| of the relative position embeddings
  // (LayerWeights::relative_key, relative_query; zero without them, +inf
  // when one is not finite): a query's content-to-position term is at most
  // max|Q| * head_dim * relative_key, a key's likewise.
  double relative_key = 0, relative_query = 0;
};
LayerWeightBounds MeasureWeightBounds(const LayerWeights& weights);

// Checks dims and weight shapes against each other (names the tensor and the
// expected vs actual shape on failure).
absl::Status ValidateLayer(const AttentionLayer& layer);

}  // namespace attnserve

#endif  // ATTNSERVE_ENGINE_ATTENTION_LAYER_H_
