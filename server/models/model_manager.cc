// Model control: loads, reloads and unloads beside the serving versions,
// swapped under the registry's serving lock.
#include "server/models/model_manager.h"

#include <sys/stat.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/notification.h"
#include "attnserve/v1/model_config.pb.h"
#include "server/models/warmup.h"

namespace attnserve {
namespace {

namespace fs = std::filesystem;

// What poll mode compares between passes: every file of the folder with its
// size, modification time and inode, so that a file replaced by rename (the
// atomic way to publish new weights) counts as changed even within one
// mtime tick.
std::string FolderFingerprint(const std::string& folder) {
  std::vector<std::string> entries;
  std::error_code ec;
  for (fs::directory_iterator it(folder, ec), end; !ec && it != end; it.increment(ec)) {
    struct stat st;
    if (::stat(it->path().c_str(), &st) != 0 || !S_ISREG(st.st_mode)) continue;
    entries.push_back(absl::StrCat(it->path().filename().string(), ":", st.st_size, ":",
                                   st.st_mtim.tv_sec, ".", st.st_mtim.tv_nsec, ":", st.st_ino));
  }
  std::sort(entries.begin(), entries.end());
  return absl::StrJoin(entries, ";");
}

// The registry entry of a model that is not serving: listed UNAVAILABLE
// with `reason`, its last config kept for GetModel.
std::shared_ptr<const ServedModel> NotServing(const std::string& name, ModelState state,
                                              std::string reason,
                                              std::shared_ptr<const v1::ModelConfig> config) {
  auto model = std::make_shared<ServedModel>();
  model->name = name;
  model->state = state;
  model->reason = std::move(reason);
  if (config == nullptr) {
    auto c = std::make_shared<v1::ModelConfig>();
    c->set_name(name);
    config = std::move(c);
  }
  model->config = std::move(config);
  return model;
}

std::string BackendOf(const ServedModel& model) {
  return model.engine != nullptr ? std::string(model.engine->name()) : "";
}

}  // namespace

absl::StatusOr<ModelControlMode> ParseModelControlMode(const std::string& text) {
  if (text == "none") return ModelControlMode::kNone;
  if (text == "poll") return ModelControlMode::kPoll;
  if (text == "explicit") return ModelControlMode::kExplicit;
  return absl::InvalidArgumentError(absl::StrCat(
      "--model-control-mode: \"", text, "\" is not one of none, poll, explicit"));
}

const char* ModelControlModeName(ModelControlMode mode) {
  switch (mode) {
    case ModelControlMode::kNone: return "none";
    case ModelControlMode::kPoll: return "poll";
    case ModelControlMode::kExplicit: return "explicit";
  }
  return "?";
}

ModelManager::ModelManager(ModelControlOptions options, std::shared_ptr<BackendEngines> engines,
                           ModelRegistry* registry)
    : options_(std::move(options)), engines_(std::move(engines)), registry_(registry) {}

absl::StatusOr<std::unique_ptr<ModelManager>> ModelManager::Create(
    ModelControlOptions options, std::shared_ptr<BackendEngines> engines,
    ModelRegistry* registry) {
  const char* mode = ModelControlModeName(options.mode);
  if (options.mode != ModelControlMode::kNone && options.repository.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--model-control-mode=", mode, " needs a --model-repository to load models from"));
  }
  if (options.mode != ModelControlMode::kExplicit && !options.load_models.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--load-model is for --model-control-mode=explicit (the mode is ", mode,
        ", which loads every model of the repository)"));
  }
  if (options.mode == ModelControlMode::kPoll && options.poll_interval <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("--repository-poll-secs: must be >= 1");
  }
  std::unique_ptr<ModelManager> m(
      new ModelManager(std::move(options), std::move(engines), registry));
  for (const auto& model : registry->List()) m->builtin_.insert(model->name);
  const ModelControlOptions& o = m->options_;
  if (o.repository.empty()) return m;

  absl::MutexLock lock(&m->change_mu_);
  if (o.mode != ModelControlMode::kExplicit) {
    // Fingerprints first: a file changed while it loads is loaded again by
    // the next poll.
    absl::StatusOr<std::vector<std::string>> folders = ListModelFolders(o.repository);
    if (!folders.ok()) return folders.status();
    for (const std::string& folder : *folders) {
      m->tracked_[folder] = Tracked{ModelNameOfFolder(folder), FolderFingerprint(folder)};
    }
    if (absl::Status s = AddRepositoryModels(o.repository, o.strict, m->engines_.get(), registry);
        !s.ok()) {
      return s;
    }
    return m;
  }

  // Explicit: the named models are loaded, the others listed as not loaded.
  absl::StatusOr<std::vector<std::string>> folders = ListModelFolders(o.repository);
  if (!folders.ok()) return folders.status();
  std::map<std::string, std::string> folder_of;  // name -> folder
  std::vector<std::string> failures;
  for (const std::string& folder : *folders) {
    auto [it, inserted] = folder_of.emplace(ModelNameOfFolder(folder), folder);
    if (!inserted) {
      failures.push_back(absl::StrCat(folder, ": model name '", it->first, "' is already used by ",
                                      it->second));
    }
  }
  const bool all = std::find(o.load_models.begin(), o.load_models.end(), "*") != o.load_models.end();
  for (const std::string& name : o.load_models) {
    if (name != "*" && !folder_of.contains(name)) {
      std::vector<std::string> names;
      for (const auto& [n, f] : folder_of) names.push_back(n);
      return absl::InvalidArgumentError(absl::StrCat(
          "--load-model: no model '", name, "' in the repository ", o.repository,
          " (its models: ", names.empty() ? "(none)" : absl::StrJoin(names, ", "), ")"));
    }
  }
  for (const auto& [name, folder] : folder_of) {
    if (m->builtin_.contains(name)) {
      failures.push_back(absl::StrCat(folder, ": model name '", name,
                                      "' is already taken (a built-in model)"));
      continue;
    }
    const bool load =
        all || std::find(o.load_models.begin(), o.load_models.end(), name) != o.load_models.end();
    if (!load) {
      (void)registry->Put(NotServing(
          name, ModelState::kUnloaded,
          "not loaded (--model-control-mode=explicit: load it with RepositoryModelLoad)",
          nullptr));
      continue;
    }
    std::string failure;
    RepositoryModel folder_model = LoadModelFolder(folder);
    std::shared_ptr<ServedModel> model =
        MakeRepositoryServedModel(folder_model, o.repository, m->engines_.get(), &failure);
    if (!failure.empty()) failures.push_back(absl::StrCat("model '", name, "': ", failure));
    (void)registry->Put(std::move(model));
  }
  if (!failures.empty()) {
    if (o.strict) {
      return absl::InvalidArgumentError(absl::StrCat(
          "model repository ", o.repository, ": ", failures.size(),
          " model(s) failed to load (--strict-model-loading=false serves the others):\n  ",
          absl::StrJoin(failures, "\n  ")));
    }
    for (const std::string& f : failures) {
      std::fprintf(stderr, "attnserve: model repository %s: %s (not ready)\n",
                   o.repository.c_str(), f.c_str());
    }
  }
  return m;
}

ModelManager::~ModelManager() { Stop(); }

void ModelManager::Start(BatchingScheduler* scheduler, SessionManager* sessions,
                         Metrics* metrics) {
  {
    absl::MutexLock lock(&change_mu_);
    scheduler_ = scheduler;
    sessions_ = sessions;
    metrics_ = metrics;
  }
  absl::MutexLock lock(&queue_mu_);
  if (started_ || stopping_) return;
  started_ = true;
  if (options_.mode != ModelControlMode::kNone) thread_ = std::thread([this] { Run(); });
}

void ModelManager::Stop() {
  std::deque<Job> refused;
  {
    absl::MutexLock lock(&queue_mu_);
    if (stopping_) return;
    stopping_ = true;
    refused.swap(jobs_);
  }
  for (Job& job : refused) {
    job.done(absl::UnavailableError("server is shutting down; the model change was not made"));
  }
  if (thread_.joinable()) thread_.join();
}

void ModelManager::Run() {
  absl::Time next_poll = absl::Now() + options_.poll_interval;
  while (true) {
    Job job;
    {
      absl::MutexLock lock(&queue_mu_);
      auto ready = [this] { return stopping_ || !jobs_.empty(); };
      if (options_.mode == ModelControlMode::kPoll) {
        queue_mu_.AwaitWithDeadline(absl::Condition(&ready), next_poll);
      } else {
        queue_mu_.Await(absl::Condition(&ready));
      }
      if (stopping_) return;
      if (!jobs_.empty()) {
        job = std::move(jobs_.front());
        jobs_.pop_front();
      }
    }
    if (job.change) {
      absl::Status status = job.change();
      job.done(std::move(status));
      continue;
    }
    if (absl::Now() >= next_poll) {
      if (absl::Status s = PollOnce(); !s.ok()) {
        std::fprintf(stderr, "attnserve: repository poll: %s\n", std::string(s.message()).c_str());
      }
      next_poll = absl::Now() + options_.poll_interval;
    }
  }
}

void ModelManager::Enqueue(absl::AnyInvocable<absl::Status()> change,
                           absl::AnyInvocable<void(absl::Status)> done) {
  {
    absl::MutexLock lock(&queue_mu_);
    if (!stopping_ && started_) {
      jobs_.push_back(Job{std::move(change), std::move(done)});
      return;
    }
  }
  done(absl::UnavailableError("server is shutting down; the model change was not made"));
}

absl::Status ModelManager::CheckExplicit(const char* op, const std::string& name) const {
  if (options_.mode != ModelControlMode::kExplicit) {
    return absl::FailedPreconditionError(absl::StrCat(
        op, ": the server's model control mode is ", ModelControlModeName(options_.mode),
        options_.mode == ModelControlMode::kPoll
            ? " (it follows the repository's files: change them instead)"
            : " (models are read once at startup)",
        "; start it with --model-control-mode=explicit to load and unload models"));
  }
  if (name.empty()) return absl::InvalidArgumentError(absl::StrCat(op, ": model name is empty"));
  if (builtin_.contains(name)) {
    return absl::FailedPreconditionError(
        absl::StrCat(op, ": '", name, "' is a built-in model; it is always loaded"));
  }
  return absl::OkStatus();
}

void ModelManager::Load(const std::string& name, absl::AnyInvocable<void(absl::Status)> done) {
  if (absl::Status s = CheckExplicit("RepositoryModelLoad", name); !s.ok()) {
    done(std::move(s));
    return;
  }
  Enqueue(
      [this, name]() -> absl::Status {
        absl::MutexLock lock(&change_mu_);
        absl::StatusOr<std::string> folder = FolderOf(name);
        if (!folder.ok()) return folder.status();
        return LoadFolder(name, *folder);
      },
      std::move(done));
}

void ModelManager::Unload(const std::string& name, absl::AnyInvocable<void(absl::Status)> done) {
  if (absl::Status s = CheckExplicit("RepositoryModelUnload", name); !s.ok()) {
    done(std::move(s));
    return;
  }
  Enqueue(
      [this, name]() -> absl::Status {
        absl::MutexLock lock(&change_mu_);
        return UnloadModel(name, "unloaded (RepositoryModelUnload)");
      },
      std::move(done));
}

absl::Status ModelManager::LoadAndWait(const std::string& name) {
  return Wait(&ModelManager::Load, name);
}

absl::Status ModelManager::UnloadAndWait(const std::string& name) {
  return Wait(&ModelManager::Unload, name);
}

absl::Status ModelManager::Wait(ChangeFn change, const std::string& name) {
  absl::Notification finished;
  absl::Status result;
  (this->*change)(name, [&](absl::Status s) {
    result = std::move(s);
    finished.Notify();
  });
  finished.WaitForNotification();
  return result;
}

std::vector<std::string> ModelManager::RepositoryModelNames() const {
  std::vector<std::string> names;
  if (options_.mode != ModelControlMode::kExplicit) return names;
  absl::StatusOr<std::vector<std::string>> folders = ListModelFolders(options_.repository);
  if (!folders.ok()) return names;
  for (const std::string& folder : *folders) names.push_back(ModelNameOfFolder(folder));
  return names;
}

absl::StatusOr<std::string> ModelManager::FolderOf(const std::string& name) const {
  absl::StatusOr<std::vector<std::string>> folders = ListModelFolders(options_.repository);
  if (!folders.ok()) return folders.status();
  std::vector<std::string> names;
  for (const std::string& folder : *folders) {
    std::string n = ModelNameOfFolder(folder);
    if (n == name) return folder;
    names.push_back(std::move(n));
  }
  return absl::NotFoundError(absl::StrCat(
      "model: no model '", name, "' in the model repository (its models: ",
      names.empty() ? "(none)" : absl::StrJoin(names, ", "), ")"));
}

absl::Status ModelManager::LoadFolder(const std::string& name, const std::string& folder) {
  const absl::Time start = absl::Now();
  RepositoryModel loaded = LoadModelFolder(folder);
  absl::Status status = loaded.status;
  if (status.ok() && loaded.name != name) {
    status = absl::InvalidArgumentError(absl::StrCat(
        folder, ": its config now names model '", loaded.name, "', not '", name, "'"));
  }
  std::shared_ptr<ServedModel> model;
  if (status.ok()) {
    std::string failure;
    model = MakeRepositoryServedModel(loaded, options_.repository, engines_.get(), &failure);
    if (!failure.empty()) status = absl::InvalidArgumentError(model->reason);
  }
  if (status.ok() && options_.warmup) {
    absl::StatusOr<absl::Duration> took = WarmUpModel(*model);
    if (!took.ok()) status = took.status();
  }
  std::unique_ptr<DynamicBatcher> batcher;
  if (status.ok()) {
    absl::StatusOr<std::unique_ptr<DynamicBatcher>> made = scheduler_->MakeBatcher(model);
    if (made.ok()) {
      batcher = *std::move(made);
    } else {
      status = made.status();
    }
  }
  if (metrics_ != nullptr) metrics_->ModelLoadFinished(name, status.ok());
  if (!status.ok()) {
    const std::string reason = std::string(status.message());
    std::fprintf(stderr, "attnserve: model '%s': load failed: %s\n", name.c_str(),
                 reason.c_str());
    absl::StatusOr<std::shared_ptr<const ServedModel>> serving = registry_->Find(name);
    if (serving.ok() && (*serving)->ready()) {
      // The old version keeps serving; the index shows why the new one did
      // not replace it.
      registry_->SetLoadError(
          name, absl::StrCat("the new version failed to load (the previous one is serving): ",
                             reason));
    } else {
      std::shared_ptr<const v1::ModelConfig> config =
          model != nullptr ? model->config : nullptr;
      Swap(NotServing(name, ModelState::kFailed, reason, std::move(config)), nullptr, false);
    }
    return absl::Status(status.code(), absl::StrCat("model '", name, "': ", reason));
  }
  Swap(std::move(model), std::move(batcher), false);
  std::fprintf(stderr, "attnserve: model '%s' loaded from %s in %s\n", name.c_str(),
               folder.c_str(),
               absl::FormatDuration(absl::Trunc(absl::Now() - start, absl::Microseconds(100)))
                   .c_str());
  return absl::OkStatus();
}

absl::Status ModelManager::UnloadModel(const std::string& name, absl::string_view why) {
  absl::StatusOr<std::shared_ptr<const ServedModel>> serving = registry_->Find(name);
  if (!serving.ok()) return serving.status();
  if ((*serving)->state == ModelState::kUnloaded) return absl::OkStatus();
  Swap(NotServing(name, ModelState::kUnloaded, std::string(why), (*serving)->config), nullptr,
       true);
  if (metrics_ != nullptr) metrics_->ModelUnloaded(name);
  std::fprintf(stderr, "attnserve: model '%s' %s\n", name.c_str(), std::string(why).c_str());
  return absl::OkStatus();
}

void ModelManager::Swap(std::shared_ptr<const ServedModel> next,
                        std::unique_ptr<DynamicBatcher> batcher, bool unloading) {
  const std::string name = next->name;
  std::unique_ptr<DynamicBatcher> old_batcher;
  std::shared_ptr<const ServedModel> old;
  std::vector<std::unique_ptr<InferenceRequest>> orphans;
  {
    // No request is between its lookup and its queueing now: the entry, the
    // queue and the sessions change as one.
    absl::MutexLock serving(&registry_->serving_mu());
    if (batcher != nullptr) {
      absl::StatusOr<std::unique_ptr<DynamicBatcher>> replaced =
          scheduler_->Replace(next, std::move(batcher));
      if (!replaced.ok()) return;  // shutting down: nothing changes any more
      old_batcher = *std::move(replaced);
    } else {
      old_batcher = scheduler_->Remove(name);
    }
    absl::StatusOr<std::shared_ptr<const ServedModel>> put = registry_->Put(next);
    if (put.ok()) old = *std::move(put);
    if (sessions_ != nullptr && old != nullptr && old->ready()) {
      sessions_->CloseModel(name, unloading, &orphans);
    }
  }
  for (auto& r : orphans) {
    const std::string id = r->session_id;
    r->Complete(SessionManager::ModelChangedStatus(id, name, unloading));
  }
  if (metrics_ != nullptr) {
    // attnserve_model_ready: 1 serving, 0 failed, no series when unloaded.
    const bool unloaded = next->state == ModelState::kUnloaded;
    if (old != nullptr && old->state != ModelState::kUnloaded &&
        (unloaded || BackendOf(*old) != BackendOf(*next))) {
      metrics_->RemoveModelReady(name, BackendOf(*old));
    }
    if (!unloaded) metrics_->SetModelReady(name, BackendOf(*next), next->ready());
  }
  // Requests queued on the old version are computed on it; its layer is
  // freed with the last of them.
  if (old_batcher != nullptr) old_batcher->Shutdown(options_.drain_grace);
}

absl::Status ModelManager::PollOnce() {
  absl::MutexLock lock(&change_mu_);
  return PollLocked();
}

absl::Status ModelManager::PollLocked() {
  absl::StatusOr<std::vector<std::string>> folders = ListModelFolders(options_.repository);
  if (!folders.ok()) return folders.status();
  std::map<std::string, Tracked> now;
  for (const std::string& folder : *folders) {
    now[folder] = Tracked{ModelNameOfFolder(folder), FolderFingerprint(folder)};
  }
  // Folders gone (or now serving another name): their models are unloaded.
  std::set<std::string> current_names;
  for (const auto& [folder, t] : now) current_names.insert(t.name);
  for (auto it = tracked_.begin(); it != tracked_.end();) {
    auto found = now.find(it->first);
    const bool gone = found == now.end() || found->second.name != it->second.name;
    if (gone && !current_names.contains(it->second.name) && !builtin_.contains(it->second.name)) {
      (void)UnloadModel(it->second.name, "unloaded (its folder left the model repository)");
    }
    it = gone ? tracked_.erase(it) : std::next(it);
  }
  // New or changed folders are (re)loaded.
  std::map<std::string, std::string> owner;  // name -> folder, among tracked
  for (const auto& [folder, t] : tracked_) owner.emplace(t.name, folder);
  for (const auto& [folder, t] : now) {
    auto it = tracked_.find(folder);
    if (it != tracked_.end() && it->second.fingerprint == t.fingerprint) continue;
    tracked_[folder] = t;
    if (builtin_.contains(t.name)) continue;  // listed FAILED at startup, as a clash
    auto [o, inserted] = owner.emplace(t.name, folder);
    if (!inserted && o->second != folder) {
      std::fprintf(stderr, "attnserve: repository poll: %s: model name '%s' is already used by %s\n",
                   folder.c_str(), t.name.c_str(), o->second.c_str());
      continue;
    }
    (void)LoadFolder(t.name, folder);
  }
  return absl::OkStatus();
}

}  // namespace attnserve
