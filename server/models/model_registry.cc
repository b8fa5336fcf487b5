// Name -> served model, plus the built-in models.
#include "server/models/model_registry.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "engine/model/builtin_models.h"
#include "attnserve/v1/model_config.pb.h"
#include "server/models/model_config_codec.h"

namespace attnserve {

std::shared_ptr<const ServedModel> MakeServedModel(std::shared_ptr<const AttentionLayer> layer,
                                                   std::shared_ptr<AttentionEngine> engine) {
  auto model = std::make_shared<ServedModel>();
  model->name = layer->config.name;
  auto config = std::make_shared<v1::ModelConfig>(LayerToModelConfig(*layer));
  if (engine != nullptr) config->set_backend(std::string(engine->name()));
  model->config = std::move(config);
  if (absl::Status valid = ValidateLayer(*layer); !valid.ok()) {
    model->state = ModelState::kFailed;
    model->reason = std::string(valid.message());
  } else if (engine == nullptr) {
    model->state = ModelState::kFailed;
    model->reason = "no engine";
  } else {
    model->state = ModelState::kReady;
    model->weight_bounds = MeasureWeightBounds(layer->weights);
  }
  model->layer = std::move(layer);
  model->engine = std::move(engine);
  return model;
}

absl::Status ModelRegistry::Add(std::shared_ptr<const ServedModel> model) {
  if (model->name.empty()) return absl::InvalidArgumentError("model name: must not be empty");
  absl::MutexLock lock(&mu_);
  auto [it, inserted] = models_.emplace(model->name, model);
  if (!inserted) {
    return absl::AlreadyExistsError(
        absl::StrCat("model '", model->name, "' is already registered"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<const ServedModel>> ModelRegistry::Put(
    std::shared_ptr<const ServedModel> model) {
  if (model->name.empty()) return absl::InvalidArgumentError("model name: must not be empty");
  absl::MutexLock lock(&mu_);
  std::shared_ptr<const ServedModel>& slot = models_[model->name];
  load_errors_.erase(model->name);
  std::shared_ptr<const ServedModel> old = std::move(slot);
  slot = std::move(model);
  return old;
}

void ModelRegistry::SetLoadError(absl::string_view name, std::string reason) {
  absl::MutexLock lock(&mu_);
  load_errors_[std::string(name)] = std::move(reason);
}

std::string ModelRegistry::LoadError(absl::string_view name) const {
  absl::MutexLock lock(&mu_);
  auto it = load_errors_.find(name);
  return it == load_errors_.end() ? std::string() : it->second;
}

absl::Status ModelRegistry::SetDefaultModel(absl::string_view name) {
  absl::MutexLock lock(&mu_);
  if (models_.find(name) == models_.end()) {
    return absl::NotFoundError(absl::StrCat("default model '", name,
                                            "' is not registered; available: ",
                                            AvailableNamesLocked()));
  }
  default_model_ = std::string(name);
  return absl::OkStatus();
}

std::string ModelRegistry::default_model() const {
  absl::MutexLock lock(&mu_);
  return default_model_;
}

absl::StatusOr<std::shared_ptr<const ServedModel>> ModelRegistry::Find(
    absl::string_view name) const {
  absl::MutexLock lock(&mu_);
  const absl::string_view key = name.empty() ? absl::string_view(default_model_) : name;
  auto it = models_.find(key);
  if (it == models_.end()) {
    if (name.empty()) {
      return absl::NotFoundError(absl::StrCat(
          "model: no model named and the server has no default model; available: ",
          AvailableNamesLocked()));
    }
    return absl::NotFoundError(absl::StrCat("model: unknown model '", name,
                                            "'; available: ", AvailableNamesLocked()));
  }
  return it->second;
}

std::vector<std::shared_ptr<const ServedModel>> ModelRegistry::List() const {
  absl::MutexLock lock(&mu_);
  std::vector<std::shared_ptr<const ServedModel>> models;
  models.reserve(models_.size());
  for (const auto& [name, model] : models_) models.push_back(model);
  return models;
}

std::string ModelRegistry::AvailableNamesLocked() const {
  if (models_.empty()) return "(none)";
  std::vector<absl::string_view> names;
  names.reserve(models_.size());
  for (const auto& [name, model] : models_) names.push_back(name);
  return absl::StrJoin(names, ", ");
}

absl::Status AddBuiltinModels(std::shared_ptr<AttentionEngine> engine, ModelRegistry* registry) {
  for (std::shared_ptr<const AttentionLayer> layer : {MakeSdpaLayer(), MakeDemoMhaLayer()}) {
    if (absl::Status s = registry->Add(MakeServedModel(std::move(layer), engine)); !s.ok()) {
      return s;
    }
  }
  return absl::OkStatus();
}

}  // namespace attnserve
