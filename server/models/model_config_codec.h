// ModelConfig (the proto of config.pbtxt, ListModels and GetModel) <-> the
// plain structs the engine and the request path run on: every conversion
// between the two, in one place.
#ifndef ATTNSERVE_SERVER_MODELS_MODEL_CONFIG_CODEC_H_
#define ATTNSERVE_SERVER_MODELS_MODEL_CONFIG_CODEC_H_

#include "attnserve/v1/model_config.pb.h"
#include "engine/attention_layer.h"
#include "engine/dtype.h"
#include "engine/model/weight_loader.h"
#include "server/models/served_model.h"

namespace attnserve {

// The layer's dims and options as a ModelConfig: kind "sdpa" or "mha",
// precision "fp32" / "bf16" / "fp16", biases from which bias tensors exist.
// Weight-file fields (layout, names) stay unset: a built layer has none.
v1::ModelConfig LayerToModelConfig(const AttentionLayer& layer);

// A resolved ModelConfig (see ResolveModelConfig) as the engine's structs,
// and its batching settings as the scheduler's.
LayerConfig ToLayerConfig(const v1::ModelConfig& config);
WeightSpec ToWeightSpec(const v1::ModelConfig& config);
WeightLayout ToWeightLayout(v1::ModelConfig::WeightLayout layout);
ModelBatching ToModelBatching(const v1::ModelConfig& config);

// A resolved warmup entry's input dtype ("fp32", "bf16" or "fp16").
DType ToWarmupDType(const v1::WarmupShape& warmup);

// RoPE settings both ways. ToRopeConfig reads an unknown type as kNone: call
// it on resolved configs (ResolveModelConfig refuses unknown types by name).
RopeConfig ToRopeConfig(const v1::RotaryEmbedding& rope);
v1::RotaryEmbedding FromRopeConfig(const RopeConfig& rope);

}  // namespace attnserve

#endif  // ATTNSERVE_SERVER_MODELS_MODEL_CONFIG_CODEC_H_
