// Turns the tensors of a checkpoint (PyTorch, Hugging Face, fused-QKV, Keras
// layouts) into the engine's canonical LayerWeights.
#ifndef ATTNSERVE_ENGINE_MODEL_WEIGHT_LOADER_H_
#define ATTNSERVE_ENGINE_MODEL_WEIGHT_LOADER_H_

#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/attention_layer.h"
#include "engine/model/safetensors.h"

namespace attnserve {

// How the projections are stored in the checkpoint.
enum class WeightLayout {
  // nn.MultiheadAttention: packed `in_proj_weight` [Hq*hd + 2*Hkv*hd, E] as
  // [Wq; Wk; Wv] (used when the file has it), else `q_proj_weight`,
  // `k_proj_weight`, `v_proj_weight` (PyTorch's layout when kdim/vdim differ
  // from embed_dim). Biases always come packed in `in_proj_bias` [3E]: the
  // thirds whose bias flag is set are used. `out_proj.weight`/`out_proj.bias`.
  kTorchMha,
  // Hugging Face style: `q_proj.weight`, `k_proj.weight`, `v_proj.weight`,
  // `o_proj.weight` and `.bias` for each; k/v have num_kv_heads heads (GQA).
  kSeparateQkv,
  // One linear `qkv.weight` [H*3*hd, in] (+ `qkv.bias`) whose output is laid
  // out per head, [q_h | k_h | v_h] for each head h (implementations that
  // reshape to [B, L, H, 3*hd] and split: GPT-NeoX, Bloom). `out_proj.*`.
  // Needs query_dim == key_dim == value_dim and num_kv_heads == num_heads.
  kFusedQkvPerHead,
  // Keras Dense / EinsumDense kernels stored [in, out] and transposed here:
  // `query/kernel` [in, H*hd] or [in, H, hd], `query/bias` [H*hd] or [H, hd],
  // likewise `key/`, `value/`; `attention_output/kernel` [H*hd, out] or
  // [H, hd, out], `attention_output/bias` [out] (keras.layers.MultiHeadAttention
  // names).
  kKerasDense,
};

// "TORCH_MHA", "SEPARATE_QKV", "FUSED_QKV_PER_HEAD", "KERAS_DENSE".
const char* WeightLayoutName(WeightLayout layout);

// Where the tensors of one layer live. Roles (keys of `tensor_names`):
//   q_weight k_weight v_weight out_weight q_bias k_bias v_bias out_bias
//   in_proj_weight in_proj_bias   (kTorchMha)
//   qkv_weight qkv_bias           (kFusedQkvPerHead)
//   q_norm_weight k_norm_weight   (every layout, with qk_norm)
//   sinks                         (every layout, with sinks)
//   relative_bias                 (every layout, with relative_bias_distance:
//                                 [num_heads, 2 * distance + 1])
//   relative_key relative_query   (every layout, with relative_embeddings'
//                                 content_to_position / position_to_content:
//                                 [num_heads, head_dim, 2 * distance + 1])
//   gate_weight gate_bias         (every layout, with a separate output gate)
//   q_a_weight q_a_bias q_a_norm_weight q_b_weight kv_a_weight kv_a_bias
//   kv_a_norm_weight kv_b_weight  (kSeparateQkv, with latent attention)
//
// A latent layer (LayerConfig::latent; kSeparateQkv only, DeepSeek's names)
// reads q_weight (q_proj.weight) or, with q_lora_rank > 0, q_a_weight,
// q_a_norm_weight and q_b_weight (its q_bias flag is then q_a_proj's bias);
// kv_a_weight (kv_a_proj_with_mqa.weight; k_bias is its bias),
// kv_a_norm_weight, and kv_b_weight [H * (nope + v_head_dim), kv_lora_rank],
// whose rows per head, [k_nope_h | v_h], become LayerWeights::wk and wv.
struct WeightSpec {
  WeightLayout layout = WeightLayout::kTorchMha;
  // Prepended to every tensor name (e.g. "encoder.layers.3.self_attn.").
  std::string tensor_prefix;
  // Role -> tensor name (without the prefix), overriding the layout default.
  std::map<std::string, std::string> tensor_names;
  // Which projections carry a bias. A bias tensor of this layer that is in
  // the file while its flag is false is an error (a forgotten flag).
  bool q_bias = true;
  bool k_bias = true;
  bool v_bias = true;
  bool out_bias = true;
  // QK-norm weights ([head_dim] each) are read when set; a file holding this
  // layer's q_norm/k_norm weights without it is an error (as for biases).
  bool qk_norm = false;
  // Attention sinks ([num_heads]) are read when set; likewise an error when
  // in the file without it.
  bool sinks = false;
  // Where the output gate's weights are (LayerConfig::output_gate):
  // kSeparate: roles gate_weight [num_heads * head_dim, query_dim] (Keras:
  // [query_dim, ...], transposed) and, with gate_bias, gate_bias; a gate
  // tensor in the file without it is an error (as for biases).
  // kQueryPerHead (kSeparateQkv only): q_weight holds 2 * num_heads *
  // head_dim rows, each head's query rows then its gate rows, and q_bias
  // (with q_bias) splits the same way (Qwen3-Next's q_proj).
  enum class Gate { kNone, kSeparate, kQueryPerHead };
  Gate gate = Gate::kNone;
  bool gate_bias = false;
};

// The roles a layout reads (valid keys of WeightSpec::tensor_names).
std::vector<std::string> WeightRoles(WeightLayout layout);
// The default tensor name of a role in a layout ("" when the role is unused).
std::string DefaultTensorName(WeightLayout layout, const std::string& role);

// Builds canonical weights (PyTorch Linear layout [out, in], FLOAT32) for a
// layer with projections. `config` must have every dim resolved. Weights are
// rounded to config.precision (bf16/fp16 values held in fp32) so every
// backend starts from the same numbers. Errors name the file, the tensor
// (with its prefix) and the expected vs actual shape; tensors in the file
// that the layer does not use are ignored (one layer of a larger checkpoint).
absl::StatusOr<LayerWeights> LoadLayerWeights(const SafetensorsFile& file,
                                              const LayerConfig& config,
                                              const WeightSpec& spec);

}  // namespace attnserve

#endif  // ATTNSERVE_ENGINE_MODEL_WEIGHT_LOADER_H_
