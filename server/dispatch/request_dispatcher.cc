// RequestDispatcher: lookup, validation, output binding, scheduling and the
// request metrics, in that order.
#include "server/dispatch/request_dispatcher.h"

#include <utility>

#include "absl/strings/str_cat.h"

namespace attnserve {
namespace {

// The metrics label of requests whose model is unknown: client-supplied
// names never become label values (unbounded series).
constexpr char kUnknownModelLabel[] = "(unknown)";

// What a queued request holds in memory: the input bytes as received and
// the outputs allocated for it (BatcherOptions::max_queue_bytes).
int64_t RequestBytes(const AttendInputs& inputs, const AttentionTask& task) {
  int64_t bytes = 0;
  for (const InputTensor* t :
       {&inputs.query, &inputs.key, &inputs.value, &inputs.attn_mask, &inputs.sinks}) {
    bytes += static_cast<int64_t>(t->data.size());
  }
  bytes += static_cast<int64_t>((inputs.key_lengths.size() + inputs.positions.size()) *
                                sizeof(int64_t));
  for (const MutableTensorView* out : {&task.output, &task.weights}) {
    if (!out->shape.empty()) bytes += static_cast<int64_t>(out->byte_size());
  }
  return bytes;
}

}  // namespace

RequestDispatcher::RequestDispatcher(const ModelRegistry* registry, BatchingScheduler* scheduler,
                                     Metrics* metrics, Clock* clock, ValidationOptions validation,
                                     SessionManager* sessions)
    : registry_(registry),
      scheduler_(scheduler),
      metrics_(metrics),
      clock_(clock),
      validation_(std::move(validation)),
      sessions_(sessions) {}

void RequestDispatcher::CountAnswer(InferenceRequest& request) {
  // Every answer, whoever gives it, is counted here: the metrics wrap the
  // front end's completion.
  request.done = [this, done = std::move(request.done)](absl::Status status,
                                                        const InferenceRequest& r) mutable {
    RecordAnswer(r, status);
    done(std::move(status), r);
  };
}

void RequestDispatcher::Reject(std::unique_ptr<InferenceRequest> request, absl::Status status) {
  CountAnswer(*request);
  request->Complete(std::move(status));
}

void RequestDispatcher::Submit(std::unique_ptr<InferenceRequest> request,
                               const AttendInputs& inputs, OutputAllocator allocate) {
  CountAnswer(*request);
  absl::Status status = Start(request, inputs, allocate);
  // Refused: the request is still ours, and this is its one answer.
  if (!status.ok()) request->Complete(std::move(status));
}

absl::Status RequestDispatcher::Start(std::unique_ptr<InferenceRequest>& request,
                                      const AttendInputs& inputs, OutputAllocator allocate) {
  // From the lookup until the request is queued, the model cannot change
  // (ModelRegistry::serving_mu): it is queued on the version it is
  // validated against.
  absl::ReaderMutexLock serving(&registry_->serving_mu());
  // A session request that names no model runs on the session's model (and
  // an unknown, closed, expired or evicted session is its first error).
  std::string session_model;
  if (!inputs.session_id.empty() && inputs.model.empty() && sessions_ != nullptr) {
    absl::StatusOr<std::string> m = sessions_->ModelOf(inputs.session_id);
    if (!m.ok()) return m.status();
    session_model = *std::move(m);
  }
  const absl::string_view requested = session_model.empty() ? inputs.model : session_model;
  // The caller's credentials are checked on the name, before the lookup.
  if (absl::Status s =
          request->access.Check(requested, [this] { return registry_->default_model(); });
      !s.ok()) {
    return s;
  }
  absl::StatusOr<std::shared_ptr<const ServedModel>> model = registry_->Find(requested);
  if (!model.ok()) return model.status();
  request->model = *std::move(model);
  const ServedModel& served = *request->model;
  if (!served.ready()) {
    return absl::UnavailableError(
        absl::StrCat("model: '", served.name, "' is not ready: ", served.reason));
  }
  absl::StatusOr<ValidatedRequest> validated =
      ValidateAttendInputs(inputs, served.layer->config, validation_, &served.weight_bounds);
  if (!validated.ok()) return validated.status();
  // A session request reaches the engine as a paged task, so the engine is
  // asked about it as one (the cuda engine computes a request's window,
  // softcap and sinks only there); its cache is bound later, by Submit.
  const bool session = !inputs.session_id.empty() && sessions_ != nullptr;
  if (session) validated->task.paged.block_tokens = sessions_->options().block_tokens;
  const absl::Status accepted = served.engine->Accepts(served.layer->config, validated->task);
  validated->task.paged = PagedKv{};
  if (!accepted.ok()) return accepted;

  request->task = std::move(validated->task);
  request->dims = validated->dims;
  // The engine writes straight into the front end's buffers, which the
  // transport sends from (attnserve.v1) or serializes (KServe v2).
  absl::StatusOr<MutableTensorView> output =
      allocate(OutputName::kOutput, validated->output_dtype, validated->output_shape);
  if (!output.ok()) return output.status();
  request->task.output = *output;
  if (!validated->weights_shape.empty()) {
    absl::StatusOr<MutableTensorView> weights =
        allocate(OutputName::kWeights, validated->output_dtype, validated->weights_shape);
    if (!weights.ok()) return weights.status();
    request->task.weights = *weights;
  }
  request->bytes = RequestBytes(inputs, request->task);
  if (!inputs.session_id.empty()) {
    if (sessions_ == nullptr) {
      return absl::UnimplementedError("session_id: this server does not serve sessions");
    }
    request->session_id = std::string(inputs.session_id);
    // On error the request is still ours (and not bound: its answer does
    // not touch the session).
    if (absl::Status s = sessions_->Submit(&request); !s.ok()) return s;
    if (request == nullptr) return absl::OkStatus();  // queued behind the session's request
    WrapSessionDone(*request);
  }
  return Schedule(request);
}

absl::Status RequestDispatcher::Schedule(std::unique_ptr<InferenceRequest>& request) {
  // Counted before Schedule, so that a fast completion never takes the gauge
  // below zero; RecordAnswer takes it back for every request the scheduler
  // accepted (enqueued set).
  ModelMetrics* mm = metrics_ != nullptr ? metrics_->ForModel(request->model->name) : nullptr;
  if (mm != nullptr) mm->InflightAdd(1);
  absl::Status status = scheduler_->Schedule(&request);
  if (!status.ok() && mm != nullptr) mm->InflightAdd(-1);
  return status;
}

void RequestDispatcher::WrapSessionDone(InferenceRequest& request) {
  request.done = [this, done = std::move(request.done)](absl::Status status,
                                                        const InferenceRequest& r) mutable {
    SessionManager::Next next = sessions_->Finished(r, status);
    done(std::move(status), r);  // r may be gone from here on
    StartSessionRequests(std::move(next));
  };
}

void RequestDispatcher::StartSessionRequests(SessionManager::Next next) {
  for (auto& [request, status] : next.failed) request->Complete(std::move(status));
  if (next.bound == nullptr) return;
  WrapSessionDone(*next.bound);
  // A refusal answers it, and its answer starts the session's next request.
  if (absl::Status s = Schedule(next.bound); !s.ok()) next.bound->Complete(std::move(s));
}

absl::StatusOr<OpenedSession> RequestDispatcher::OpenSession(absl::string_view model,
                                                             absl::Duration ttl,
                                                             int64_t max_tokens,
                                                             absl::string_view session_id) {
  if (sessions_ == nullptr) {
    return absl::UnimplementedError("OpenSession: this server does not serve sessions");
  }
  // A session is opened on the version serving now: a later reload ends it.
  absl::ReaderMutexLock serving(&registry_->serving_mu());
  absl::StatusOr<std::shared_ptr<const ServedModel>> found = registry_->Find(model);
  if (!found.ok()) return found.status();
  const ServedModel& served = **found;
  if (!served.ready()) {
    return absl::UnavailableError(
        absl::StrCat("model: '", served.name, "' is not ready: ", served.reason));
  }
  if (!served.engine->SupportsSessions()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "model: '", served.name, "' is served by the ", std::string(served.engine->name()),
        " engine, which does not serve sessions (the cpu and cuda engines do)"));
  }
  std::optional<SessionShape> fixed;
  const LayerConfig& layer = served.layer->config;
  if (layer.has_projections) {
    // The cache holds the projected K/V (or what the engine caches in their
    // stead) in FLOAT32 whatever the inputs.
    fixed = ProjectionSessionShape(*served.engine, layer);
  }
  // The blocks live where the engine reads them (a GPU's memory for cuda).
  return sessions_->Open(served.name, fixed, ttl, max_tokens,
                         SessionKeyRange{layer.sliding_window, layer.attention_chunk,
                                         layer.sparse_index_topk},
                         std::string(session_id), served.engine->kv_slab_memory());
}

absl::StatusOr<std::string> RequestDispatcher::SessionModel(absl::string_view session_id) {
  if (sessions_ == nullptr) {
    return absl::UnimplementedError("this server does not serve sessions");
  }
  return sessions_->ModelOf(session_id);
}

absl::StatusOr<int64_t> RequestDispatcher::CloseSession(absl::string_view session_id) {
  if (sessions_ == nullptr) {
    return absl::UnimplementedError("CloseSession: this server does not serve sessions");
  }
  std::vector<std::unique_ptr<InferenceRequest>> orphans;
  absl::StatusOr<int64_t> released = sessions_->Close(session_id, &orphans);
  for (auto& r : orphans) {
    r->Complete(absl::NotFoundError(absl::StrCat(
        "session_id: session '", session_id, "' was closed before this request ran")));
  }
  return released;
}

void RequestDispatcher::Cancelled(absl::string_view model) {
  absl::StatusOr<std::shared_ptr<const ServedModel>> served = registry_->Find(model);
  if (served.ok()) scheduler_->Wake((*served)->name);
}

void RequestDispatcher::CancelledOnAnyModel() { scheduler_->WakeAll(); }

void RequestDispatcher::RecordAnswer(const InferenceRequest& request,
                                     const absl::Status& status) {
  if (metrics_ == nullptr) return;
  ModelMetrics* mm =
      metrics_->ForModel(request.model != nullptr ? request.model->name : kUnknownModelLabel);
  if (request.enqueued != absl::InfinitePast()) mm->InflightAdd(-1);
  mm->RequestDone(status.code(), absl::ToDoubleSeconds(clock_->Now() - request.received));
}

}  // namespace attnserve
