// One served model as the request path sees it: its layer, the engine that
// runs it, its batching overrides and whether it can serve. Plain C++: the
// reported config is a forward-declared proto, so nothing that includes this
// header pulls in generated code.
#ifndef ATTNSERVE_SERVER_MODELS_SERVED_MODEL_H_
#define ATTNSERVE_SERVER_MODELS_SERVED_MODEL_H_

#include <cstdint>
#include <memory>
#include <string>

#include "engine/attention_engine.h"
#include "engine/attention_layer.h"

namespace attnserve {
namespace v1 {
class ModelConfig;
}  // namespace v1

// A model's own batching settings (config.pbtxt `batching` and `instances`);
// 0 = the server's default (flags) for that field.
struct ModelBatching {
  int max_batch_requests = 0;
  int64_t max_batch_tokens = 0;
  int64_t max_queue_delay_us = 0;
  int max_queue_size = 0;
  int instances = 0;
};

// kUnloaded: taken out of service (RepositoryModelUnload, or its folder
// left a polled repository), or in the repository but not loaded yet
// (--model-control-mode=explicit).
enum class ModelState { kReady, kFailed, kUnloaded };

// Immutable once built; shared (shared_ptr) with the requests running on it,
// so an unload or reload never pulls a layer from under a running request.
struct ServedModel {
  std::string name;
  // Both set when kReady; either may be null otherwise.
  std::shared_ptr<const AttentionLayer> layer;
  std::shared_ptr<AttentionEngine> engine;
  // The layer's weights measured once (when kReady): validation bounds a
  // projection model's scores with them before compute.
  LayerWeightBounds weight_bounds;
  ModelBatching batching;
  // The config as ListModels/GetModel report it (every default resolved).
  // Never null.
  std::shared_ptr<const v1::ModelConfig> config;
  ModelState state = ModelState::kFailed;
  // Why the model is not ready (empty when ready).
  std::string reason;

  bool ready() const { return state == ModelState::kReady; }
};

}  // namespace attnserve

#endif  // ATTNSERVE_SERVER_MODELS_SERVED_MODEL_H_
