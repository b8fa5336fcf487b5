// The models this server serves, by name: each one's layer, the engine that
// runs it, its config as reported by ListModels/GetModel, and its state.
// Built-ins are added at startup; a model repository on disk adds more
// through the same Add().
#ifndef ATTNSERVE_SERVER_MODELS_MODEL_REGISTRY_H_
#define ATTNSERVE_SERVER_MODELS_MODEL_REGISTRY_H_

#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "engine/attention_engine.h"
#include "engine/attention_layer.h"
#include "server/models/served_model.h"

namespace attnserve {

// A ready model when `layer` passes ValidateLayer, else a failed one that
// carries the reason (listed, never run). Its reported config is derived
// from the layer (LayerToModelConfig); no batching overrides.
std::shared_ptr<const ServedModel> MakeServedModel(std::shared_ptr<const AttentionLayer> layer,
                                                   std::shared_ptr<AttentionEngine> engine);

// Thread-safe: every method may be called concurrently.
//
// Models change while requests run (server/models/model_manager.h): a
// change holds serving_mu() exclusively while it swaps the registry entry,
// the model's batcher and its sessions, and the request path holds it
// shared from a model's lookup until the request is queued on that model's
// batcher. So a request is always queued on the version it was validated
// against, and no request falls between two versions.
class ModelRegistry {
 public:
  ModelRegistry() = default;
  ModelRegistry(const ModelRegistry&) = delete;
  ModelRegistry& operator=(const ModelRegistry&) = delete;

  // AlreadyExists if the name is taken, InvalidArgument if it is empty.
  absl::Status Add(std::shared_ptr<const ServedModel> model);

  // Registers `model` under its name, replacing the model registered there
  // (returned; null when the name is new), and clears the name's load
  // error. InvalidArgument if the name is empty.
  absl::StatusOr<std::shared_ptr<const ServedModel>> Put(std::shared_ptr<const ServedModel> model);

  // Why the latest load of `name` failed while an earlier version kept
  // serving (shown in the repository index next to READY); cleared by Put.
  void SetLoadError(absl::string_view name, std::string reason);
  std::string LoadError(absl::string_view name) const;

  // See the class comment: exclusive for a change of the served models,
  // shared from lookup to queueing on the request path.
  absl::Mutex& serving_mu() const { return serving_mu_; }

  // The model that requests naming no model get. NotFound (listing the
  // available names) if `name` is not registered.
  absl::Status SetDefaultModel(absl::string_view name);
  std::string default_model() const;

  // `name` empty = the default model: the one place that rule lives.
  // NotFound names the model and lists the available ones. The model may
  // have failed to load: callers that run it check ready().
  absl::StatusOr<std::shared_ptr<const ServedModel>> Find(absl::string_view name) const;

  // Every model, READY or not, sorted by name.
  std::vector<std::shared_ptr<const ServedModel>> List() const;

 private:
  std::string AvailableNamesLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  mutable absl::Mutex serving_mu_;
  mutable absl::Mutex mu_;
  std::map<std::string, std::string, std::less<>> load_errors_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, std::shared_ptr<const ServedModel>, std::less<>> models_
      ABSL_GUARDED_BY(mu_);
  std::string default_model_ ABSL_GUARDED_BY(mu_);
};

// Adds the built-in models, `sdpa` and `demo-mha`, run on `engine`.
absl::Status AddBuiltinModels(std::shared_ptr<AttentionEngine> engine, ModelRegistry* registry);

}  // namespace attnserve

#endif  // ATTNSERVE_SERVER_MODELS_MODEL_REGISTRY_H_
