// Engine LayerConfig <-> the ModelConfig proto that ListModels/GetModel
// report (and that a model repository's config.pbtxt will hold).
#ifndef ATTNSERVE_SERVER_MODEL_CONFIG_CODEC_H_
#define ATTNSERVE_SERVER_MODEL_CONFIG_CODEC_H_

#include "attnserve/v1/model_config.pb.h"
#include "engine/attention_layer.h"

namespace attnserve {

// The layer's dims and options as a ModelConfig: kind "sdpa" or "mha",
// precision "fp32" / "bf16" / "fp16", biases from which bias tensors exist.
// Weight-file fields (layout, names) stay unset: a built layer has none.
v1::ModelConfig LayerToModelConfig(const AttentionLayer& layer);

}  // namespace attnserve

#endif  // ATTNSERVE_SERVER_MODEL_CONFIG_CODEC_H_
