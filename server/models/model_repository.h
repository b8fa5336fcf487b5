// A model repository on disk (--model-repository DIR): one folder per model
// holding config.pbtxt (a ModelConfig in text format) and weights.safetensors.
#ifndef ATTNSERVE_SERVER_MODELS_MODEL_REPOSITORY_H_
#define ATTNSERVE_SERVER_MODELS_MODEL_REPOSITORY_H_

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "attnserve/v1/model_config.pb.h"
#include "engine/attention_engine.h"
#include "engine/attention_layer.h"
#include "engine/model/weight_loader.h"
#include "server/models/model_registry.h"

namespace attnserve {

inline constexpr char kModelConfigFile[] = "config.pbtxt";
inline constexpr char kModelWeightsFile[] = "weights.safetensors";

// One folder of the repository, loaded or not.
struct RepositoryModel {
  // The config's name, else the folder name.
  std::string name;
  // DIR/<folder>.
  std::string directory;
  // As written, with every default resolved when the config parsed (what
  // ListModels/GetModel report).
  v1::ModelConfig config;
  // OK when loaded; else the reason, naming the file, the tensor or field,
  // and expected vs actual.
  absl::Status status;
  // Set iff status is OK.
  std::shared_ptr<const AttentionLayer> layer;
};

// Parses config.pbtxt text. Unknown fields, bad enum values and syntax
// errors are InvalidArgument naming `path`, the line and column, and the
// field.
absl::StatusOr<v1::ModelConfig> ParseModelConfig(const std::string& text, const std::string& path);

// Fills defaults in place (name = `default_name`, kind "mha", dims from
// embed_dim/num_heads, weight_layout TORCH_MHA, precision "fp32", backend
// "auto", each warmup entry's kv_len = q_len and dtype "fp32") and checks
// that the dims and options agree. Errors name `path`, the field, the rule
// and the values.
absl::Status ResolveModelConfig(const std::string& path, const std::string& default_name,
                                v1::ModelConfig* config);

// Loads one model folder; never fails as a whole: problems land in status.
RepositoryModel LoadModelFolder(const std::string& directory);

// Every sub-folder of `dir` whose name does not start with '.', as paths,
// sorted. Error only when `dir` itself cannot be listed.
absl::StatusOr<std::vector<std::string>> ListModelFolders(const std::string& dir);

// The name model folder `directory` serves under: its config's name, else
// the folder's name (also when the config cannot be read). Reads only the
// config, never the weights.
std::string ModelNameOfFolder(const std::string& directory);

// Every model folder of `dir` (ListModelFolders), each loaded
// independently. A second folder claiming a name already taken fails with a
// reason naming both folders. Error only when `dir` itself cannot be listed.
absl::StatusOr<std::vector<RepositoryModel>> LoadModelRepository(const std::string& dir);

// The engines repository models run on, one per backend, created on first
// use and shared by the models that ask for it: "auto" (and the default
// engine's own name) is `default_engine`. Thread-safe.
class BackendEngines {
 public:
  BackendEngines(std::shared_ptr<AttentionEngine> default_engine, EngineOptions engine_options);
  // The engine of `backend` ("auto", "cpu", "reference", "cuda"); the error
  // of CreateEngine when it cannot be made.
  absl::StatusOr<std::shared_ptr<AttentionEngine>> For(const std::string& backend);

 private:
  const EngineOptions engine_options_;
  absl::Mutex mu_;
  std::map<std::string, std::shared_ptr<AttentionEngine>> engines_ ABSL_GUARDED_BY(mu_);
};

// The served model of loaded folder `m` of repository `dir`: ready on the
// engine its backend names, else failed with the reason, its paths relative
// to `dir`; then *failure (if given) holds the reason with
// full paths, for the operator's log.
std::shared_ptr<ServedModel> MakeRepositoryServedModel(const RepositoryModel& m,
                                                       const std::string& dir,
                                                       BackendEngines* engines,
                                                       std::string* failure = nullptr);

// Loads `dir` and adds every model to `registry` (MakeRepositoryServedModel;
// a name taken by a registered model fails). strict: the first bad model is
// returned as the error and nothing from the repository is added. Not
// strict: bad models are added as FAILED with their reason, the rest serve.
absl::Status AddRepositoryModels(const std::string& dir, bool strict, BackendEngines* engines,
                                 ModelRegistry* registry);

}  // namespace attnserve

#endif  // ATTNSERVE_SERVER_MODELS_MODEL_REPOSITORY_H_
