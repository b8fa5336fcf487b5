// ModelManager: the served models change while requests run, with Triton's
// model control modes (--model-control-mode):
//   none      the repository is read once at startup (the default);
//   poll      it is re-read every --repository-poll-secs: a new folder is
//             loaded, a changed one (config or weights) reloaded, a removed
//             one unloaded;
//   explicit  only the --load-model models are loaded at startup; clients
//             load, reload and unload with KServe's RepositoryModelLoad /
//             RepositoryModelUnload.
//
// A load builds the new version beside the serving one -- weights read and
// checked, engine chosen, warm-up batch computed, batcher started -- and only
// then swaps it in: under the registry's serving lock (model_registry.h) the
// registry entry and the model's queue change together, so requests already
// queued finish on the old version and later ones get the new; none fails
// because of the swap. The old queue is then drained and the old version's
// memory is freed when its last request is answered. A version that fails to
// load changes nothing that serves: the old one stays ready, and the reason
// is in the repository index (ModelRegistry::LoadError) and the log. A
// model's sessions end at a reload or unload (SessionManager::CloseModel): a
// KV cache filled by one version's weights is never extended by another's.
//
// Built-in models (sdpa, demo-mha) are not in the repository and are never
// loaded or unloaded.
#ifndef ATTNSERVE_SERVER_MODELS_MODEL_MANAGER_H_
#define ATTNSERVE_SERVER_MODELS_MODEL_MANAGER_H_

#include <deque>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/functional/any_invocable.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "server/batching/batching_scheduler.h"
#include "server/metrics/metrics.h"
#include "server/models/model_registry.h"
#include "server/models/model_repository.h"
#include "server/sessions/session_manager.h"

namespace attnserve {

enum class ModelControlMode { kNone, kPoll, kExplicit };

// "none", "poll", "explicit"; anything else is InvalidArgument naming the
// flag and the choices.
absl::StatusOr<ModelControlMode> ParseModelControlMode(const std::string& text);
const char* ModelControlModeName(ModelControlMode mode);

struct ModelControlOptions {
  ModelControlMode mode = ModelControlMode::kNone;
  // The model repository (--model-repository); empty = none (then only
  // mode none is allowed).
  std::string repository;
  // At startup: any bad model stops the server (--strict-model-loading).
  // Later loads never stop it: a failed load is reported and the old
  // version keeps serving.
  bool strict = true;
  // poll: how often the repository is re-read (--repository-poll-secs).
  absl::Duration poll_interval = absl::Seconds(15);
  // explicit: the models loaded at startup (--load-model, repeatable); "*"
  // loads every model of the repository.
  std::vector<std::string> load_models;
  // Compute a warm-up batch before a loaded version serves (--model-warmup).
  bool warmup = true;
  // How long the queue of a replaced or unloaded version may take to drain:
  // requests still queued after it are answered UNAVAILABLE (the server's
  // shutdown grace).
  absl::Duration drain_grace = absl::Seconds(8);
};

// Thread-safe. Changes run one at a time on the manager's own thread, in
// the order they were asked for.
class ModelManager {
 public:
  // Reads the repository as `options.mode` says and adds its models to
  // `registry` (none/poll: every folder; explicit: the load_models, the
  // other folders listed UNAVAILABLE "not loaded"). Call before the
  // scheduler is built from the registry. InvalidArgument naming the flag
  // for inconsistent options, an unknown --load-model, or (strict) a model
  // that fails to load. `registry` must outlive the manager.
  static absl::StatusOr<std::unique_ptr<ModelManager>> Create(
      ModelControlOptions options, std::shared_ptr<BackendEngines> engines,
      ModelRegistry* registry);

  // Stop().
  ~ModelManager();
  ModelManager(const ModelManager&) = delete;
  ModelManager& operator=(const ModelManager&) = delete;

  // From now on models may change: poll mode starts polling, Load and
  // Unload are served. `scheduler`, `sessions` (nullable) and `metrics`
  // (nullable) must outlive the manager (or its Stop).
  void Start(BatchingScheduler* scheduler, SessionManager* sessions, Metrics* metrics);

  // Stops polling and answers changes not yet started UNAVAILABLE; waits
  // for the change in progress, and for the old queues it drains. Idempotent.
  void Stop();

  const ModelControlOptions& options() const { return options_; }

  // Explicit mode: loads model `name` from the repository, or reloads it
  // when loaded (re-reading its files). `done` runs once with the outcome,
  // on the manager's thread (or on the caller's when refused at once):
  // OK once the new version serves; NotFound when no repository folder
  // serves that name; FailedPrecondition in another mode or for a built-in
  // model; the load's error (InvalidArgument naming the file and field)
  // when the new version failed, the old one (if any) still serving;
  // Unavailable once Stop began.
  void Load(const std::string& name, absl::AnyInvocable<void(absl::Status)> done);
  // Explicit mode: takes model `name` out of service. Requests already
  // queued are computed; later ones get UNAVAILABLE naming it; its sessions
  // end (ABORTED). `done`: OK once its queue has drained (also when it was
  // not loaded); NotFound for a name the server does not know;
  // FailedPrecondition and Unavailable as Load.
  void Unload(const std::string& name, absl::AnyInvocable<void(absl::Status)> done);
  // Blocking forms of the two.
  absl::Status LoadAndWait(const std::string& name);
  absl::Status UnloadAndWait(const std::string& name);

  // Explicit mode: the names the repository's folders serve now (a folder
  // added after startup included), for the repository index to list the ones
  // the registry does not know as not loaded. Empty in other modes (their
  // registry follows the repository) or when it cannot be listed.
  std::vector<std::string> RepositoryModelNames() const;

  // Poll mode: one pass over the repository now, on the caller's thread
  // (the poll thread calls it every poll_interval). Error only when the
  // repository cannot be listed.
  absl::Status PollOnce();

 private:
  ModelManager(ModelControlOptions options, std::shared_ptr<BackendEngines> engines,
               ModelRegistry* registry);

  // What poll mode knows of one folder: the name it serves and its files'
  // fingerprint when last loaded.
  struct Tracked {
    std::string name;
    std::string fingerprint;
  };

  // Load or Unload, waited for.
  using ChangeFn = void (ModelManager::*)(const std::string&,
                                          absl::AnyInvocable<void(absl::Status)>);
  absl::Status Wait(ChangeFn change, const std::string& name);

  // The manager's thread: changes, in order, and in poll mode a poll every
  // poll_interval.
  void Run();
  // Queues a change for Run; answered Unavailable once stopping.
  void Enqueue(absl::AnyInvocable<absl::Status()> change,
               absl::AnyInvocable<void(absl::Status)> done);

  // Loads `folder` as a new version of `name` and swaps it in; on failure
  // the serving version stays and the reason is recorded. Serialised by
  // change_mu_.
  absl::Status LoadFolder(const std::string& name, const std::string& folder)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(change_mu_);
  absl::Status UnloadModel(const std::string& name, absl::string_view why)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(change_mu_);
  // Makes `next` what `next->name` serves: a ready version with its queue
  // `batcher` (MakeBatcher(next)), or a not-ready entry (batcher null: the
  // queue is removed). Ends the sessions of the version it replaces and
  // drains that version's queue.
  void Swap(std::shared_ptr<const ServedModel> next, std::unique_ptr<DynamicBatcher> batcher,
            bool unloading) ABSL_EXCLUSIVE_LOCKS_REQUIRED(change_mu_);
  absl::Status PollLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(change_mu_);
  // The folder serving `name`, by config name or folder name; NotFound
  // listing the repository's models.
  absl::StatusOr<std::string> FolderOf(const std::string& name) const;
  // FailedPrecondition unless mode is explicit; for built-in names too.
  absl::Status CheckExplicit(const char* op, const std::string& name) const;

  const ModelControlOptions options_;
  const std::shared_ptr<BackendEngines> engines_;
  ModelRegistry* const registry_;
  // Names registered before the repository (the built-ins): never changed.
  std::set<std::string, std::less<>> builtin_;

  // Held for the whole of one change (or poll pass).
  absl::Mutex change_mu_;
  BatchingScheduler* scheduler_ ABSL_GUARDED_BY(change_mu_) = nullptr;
  SessionManager* sessions_ ABSL_GUARDED_BY(change_mu_) = nullptr;
  Metrics* metrics_ ABSL_GUARDED_BY(change_mu_) = nullptr;
  std::map<std::string, Tracked> tracked_ ABSL_GUARDED_BY(change_mu_);  // by folder

  absl::Mutex queue_mu_;
  struct Job {
    absl::AnyInvocable<absl::Status()> change;
    absl::AnyInvocable<void(absl::Status)> done;
  };
  std::deque<Job> jobs_ ABSL_GUARDED_BY(queue_mu_);
  bool started_ ABSL_GUARDED_BY(queue_mu_) = false;
  bool stopping_ ABSL_GUARDED_BY(queue_mu_) = false;
  std::thread thread_;
};

}  // namespace attnserve

#endif  // ATTNSERVE_SERVER_MODELS_MODEL_MANAGER_H_
