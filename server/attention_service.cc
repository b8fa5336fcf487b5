// AttentionService handlers: the transport edge (proto <-> engine task,
// absl::Status -> grpc::Status), unary and streaming.
#include "server/attention_service.h"

#include <chrono>
#include <deque>
#include <memory>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "server/status_util.h"
#include "server/tensor_codec.h"

namespace attnserve {
namespace {

int64_t Micros(SteadyClock::duration d) {
  return std::chrono::duration_cast<std::chrono::microseconds>(d).count();
}

// The call's deadline on the steady clock; max() when there is none (gRPC
// reports "none" as a far-future system time).
SteadyClock::time_point SteadyDeadline(const grpc::CallbackServerContext& context) {
  const auto system_deadline = context.deadline();
  const auto system_now = std::chrono::system_clock::now();
  if (system_deadline >= system_now + std::chrono::hours(24 * 365)) {
    return SteadyClock::time_point::max();
  }
  return SteadyClock::now() +
         std::chrono::duration_cast<SteadyClock::duration>(system_deadline - system_now);
}

// A label for requests whose model is unknown: user-supplied names never
// become label values (unbounded series).
constexpr char kUnknownModelLabel[] = "(unknown)";

}  // namespace

AttentionServiceImpl::AttentionServiceImpl(const ModelRegistry* registry,
                                           AttendScheduler* scheduler, Metrics* metrics,
                                           AttentionServiceOptions options)
    : registry_(registry), scheduler_(scheduler), metrics_(metrics), options_(std::move(options)) {}

void AttentionServiceImpl::RecordAnswer(const std::string& model_name, const absl::Status& status,
                                        SteadyClock::time_point received) {
  if (metrics_ == nullptr) return;
  metrics_->ForModel(model_name.empty() ? kUnknownModelLabel : model_name)
      ->RequestDone(status.code(),
                    std::chrono::duration<double>(SteadyClock::now() - received).count());
}

// ---------------------------------------------------------------- Attend

// Finishes from the scheduler's completion; OnCancel asks the scheduler to
// drop the queued work at once instead of when its batch would close.
class AttentionServiceImpl::UnaryReactor final : public grpc::ServerUnaryReactor {
 public:
  explicit UnaryReactor(AttentionServiceImpl* service)
      : service_(service), counted_(service->CallStarted()) {}

  void Start(grpc::CallbackServerContext* context, const v1::AttendRequest* request,
             v1::AttendResponse* response) {
    const SteadyClock::time_point received = SteadyClock::now();
    absl::Status status;
    if (!counted_ || service_->shutting_down_.load()) {
      status = absl::UnavailableError("server is shutting down; not accepting requests");
    } else {
      // request, response and context stay valid until OnDone: gRPC frees
      // them only after the reactor is done.
      status = service_->StartAttend(
          context, *request, response, received, &model_name_,
          [this, received](absl::Status final_status) {
            service_->RecordAnswer(model_name_, final_status, received);
            Finish(ToGrpcStatus(final_status));
          });
    }
    if (!status.ok()) {
      service_->RecordAnswer(model_name_, status, received);
      Finish(ToGrpcStatus(status));
    }
  }

  // gRPC runs OnCancel only after the handler returned, so model_name_ is
  // no longer written.
  void OnCancel() override { service_->scheduler_->Wake(model_name_); }
  void OnDone() override {
    AttentionServiceImpl* service = service_;
    const bool counted = counted_;
    delete this;
    if (counted) service->CallDone();
  }

 private:
  AttentionServiceImpl* const service_;
  const bool counted_;  // opened before shutdown: shutdown waits for it
  std::string model_name_;
};

grpc::ServerUnaryReactor* AttentionServiceImpl::Attend(grpc::CallbackServerContext* context,
                                                       const v1::AttendRequest* request,
                                                       v1::AttendResponse* response) {
  auto* reactor = new UnaryReactor(this);
  reactor->Start(context, request, response);
  return reactor;
}

absl::Status AttentionServiceImpl::StartAttend(grpc::CallbackServerContext* context,
                                               const v1::AttendRequest& request,
                                               v1::AttendResponse* response,
                                               SteadyClock::time_point received,
                                               std::string* model_name,
                                               absl::AnyInvocable<void(absl::Status)> done) {
  absl::StatusOr<std::shared_ptr<const ServedModel>> model = registry_->Find(request.model());
  if (!model.ok()) return model.status();
  *model_name = (*model)->name;
  if (!(*model)->ready()) {
    return absl::UnavailableError(
        absl::StrCat("model: '", (*model)->name, "' is not ready: ", (*model)->reason));
  }
  absl::StatusOr<ValidatedRequest> validated =
      ValidateAttendRequest(request, (*model)->layer->config, options_.validation);
  if (!validated.ok()) return validated.status();

  auto work = std::make_unique<AttendWork>();
  work->model = *std::move(model);
  work->task = std::move(validated->task);
  // The engine writes straight into the response's buffers: the only copy
  // of the output is gRPC's serialization.
  response->set_id(request.id());
  work->task.output =
      AllocateTensor(validated->output_dtype, validated->output_shape, response->mutable_output());
  if (!validated->weights_shape.empty()) {
    work->task.weights = AllocateTensor(validated->output_dtype, validated->weights_shape,
                                        response->mutable_weights());
  }
  work->deadline = SteadyDeadline(*context);
  work->is_cancelled = [context] { return context->IsCancelled(); };
  work->done = [done = std::move(done), response, received](absl::Status status,
                                                            const WorkTiming& timing) mutable {
    if (status.ok()) {
      v1::Timing* t = response->mutable_timing();
      t->set_queue_us(Micros(timing.queue));
      t->set_compute_us(Micros(timing.compute));
      t->set_total_us(Micros(SteadyClock::now() - received));
      t->set_batch_requests(timing.batch_requests);
    }
    done(std::move(status));
  };
  work->scheduled_at = SteadyClock::now();
  // On failure the work (and its `done`) stays ours and is dropped here.
  return scheduler_->Schedule(&work);
}

// ---------------------------------------------------------- AttendStream

// One AttendStream. Each message is validated and scheduled like a unary
// request; its answer (response or status, with its id) is queued and
// written in completion order, one write at a time.
//
// Flow control: the stream owes at most max_stream_backlog responses
// (scheduled + waiting to be written). At the bound no read is issued, so
// when the client stops reading responses, writes stall, the backlog fills
// and the server stops reading requests: HTTP/2 flow control then pushes
// back on the client's writes.
//
// Lifetime: the stream finishes only when nothing is owed (no work in the
// scheduler refers to it), so completions never touch a deleted reactor.
class AttentionServiceImpl::StreamReactor final
    : public grpc::ServerBidiReactor<v1::AttendRequest, v1::AttendStreamResponse> {
 public:
  StreamReactor(AttentionServiceImpl* service, grpc::CallbackServerContext* context)
      : service_(service), context_(context), counted_(service->CallStarted()) {
    service_->AddStream(this);
    absl::MutexLock lock(&mu_);
    if (finished_) return;  // opened during shutdown: already ended
    reading_ = true;
    StartRead(&request_);
  }

  void OnReadDone(bool ok) override {
    const SteadyClock::time_point received = SteadyClock::now();
    if (!ok) {  // client half-closed (or the call ended)
      absl::MutexLock lock(&mu_);
      reading_ = false;
      reads_done_ = true;
      MaybeFinishLocked();
      return;
    }
    // The message's tensors must outlive its work: move it (no byte copy)
    // out of the read buffer into its own Message.
    auto message = std::make_unique<Message>();
    message->request = std::move(request_);
    message->answer.set_id(message->request.id());
    {
      absl::MutexLock lock(&mu_);
      reading_ = false;
      if (finished_) return;  // stream already ended: never accepted
      ++owed_;
    }

    absl::Status status;
    if (service_->shutting_down_.load()) {
      status = absl::UnavailableError("server is shutting down; not accepting requests");
    } else {
      Message* raw = message.get();
      status = service_->StartAttend(
          context_, raw->request, raw->answer.mutable_response(), received, &raw->model_name,
          [this, raw, received](absl::Status final_status) {
            Answer(std::unique_ptr<Message>(raw), std::move(final_status), received);
          });
      // Scheduled: `done` owns the message now (it may even have run).
      // release() only forgets the pointer.
      if (status.ok()) static_cast<void>(message.release());
    }
    if (!status.ok()) Answer(std::move(message), std::move(status), received);

    absl::MutexLock lock(&mu_);
    paused_ = true;
    MaybeReadLocked();
  }

  void OnWriteDone(bool ok) override {
    absl::MutexLock lock(&mu_);
    backlog_.pop_front();
    writing_ = false;
    if (!ok) {
      write_failed_ = true;  // client gone: the rest of the backlog is dropped
      backlog_.clear();
    } else if (!backlog_.empty()) {
      WriteLocked();
    }
    MaybeReadLocked();
    MaybeFinishLocked();
  }

  // The client went away: queued work of this stream should leave the
  // queues now (its is_cancelled() reads the context).
  void OnCancel() override { service_->scheduler_->Wake(""); }

  void OnDone() override {
    AttentionServiceImpl* service = service_;
    const bool counted = counted_;
    service->RemoveStream(this);
    delete this;
    if (counted) service->CallDone();
  }

  // Server shutdown: stop reading; end the stream once everything accepted
  // has been answered.
  void ServerShutdown() {
    absl::MutexLock lock(&mu_);
    draining_ = true;
    MaybeFinishLocked();
  }

 private:
  struct Message {
    v1::AttendRequest request;
    v1::AttendStreamResponse answer;
    std::string model_name;
  };

  // Queues the answer of one accepted message (any thread).
  void Answer(std::unique_ptr<Message> message, absl::Status status,
              SteadyClock::time_point received) {
    service_->RecordAnswer(message->model_name, status, received);
    message->request.Clear();  // inputs no longer needed; free them now
    if (!status.ok()) {
      message->answer.clear_response();
      message->answer.set_code(static_cast<int>(status.code()));
      const grpc::Status bounded = ToGrpcStatus(status);
      message->answer.set_message(bounded.error_message());
    }
    absl::MutexLock lock(&mu_);
    --owed_;
    if (!write_failed_) {
      backlog_.push_back(std::move(message));
      if (!writing_) WriteLocked();
    }
    MaybeReadLocked();
    MaybeFinishLocked();
  }

  void WriteLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    writing_ = true;
    StartWrite(&backlog_.front()->answer);
  }

  // Issues the next read if one is wanted and the backlog has room.
  void MaybeReadLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (!paused_ || reading_ || reads_done_ || finished_ || draining_ || write_failed_) return;
    if (owed_ + backlog_.size() >= service_->options_.max_stream_backlog) return;
    paused_ = false;
    reading_ = true;
    StartRead(&request_);
  }

  void MaybeFinishLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (finished_ || writing_ || owed_ > 0) return;
    if (write_failed_) {
      finished_ = true;
      Finish(grpc::Status(grpc::StatusCode::CANCELLED, "client stopped receiving"));
    } else if (backlog_.empty() && reads_done_) {
      finished_ = true;
      Finish(grpc::Status::OK);
    } else if (backlog_.empty() && draining_) {
      finished_ = true;
      Finish(grpc::Status(grpc::StatusCode::UNAVAILABLE,
                          "server is shutting down; every request read was answered"));
    }
  }

  AttentionServiceImpl* const service_;
  grpc::CallbackServerContext* const context_;
  const bool counted_;  // opened before shutdown: shutdown waits for it

  v1::AttendRequest request_;  // read buffer; touched only by the read in flight
  absl::Mutex mu_;
  // Answers waiting to be written; front() is being written when writing_.
  std::deque<std::unique_ptr<Message>> backlog_ ABSL_GUARDED_BY(mu_);
  size_t owed_ ABSL_GUARDED_BY(mu_) = 0;  // accepted, not yet answered
  bool reading_ ABSL_GUARDED_BY(mu_) = false;
  bool paused_ ABSL_GUARDED_BY(mu_) = false;  // a read is wanted but not issued
  bool reads_done_ ABSL_GUARDED_BY(mu_) = false;
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool write_failed_ ABSL_GUARDED_BY(mu_) = false;
  bool draining_ ABSL_GUARDED_BY(mu_) = false;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
};

grpc::ServerBidiReactor<v1::AttendRequest, v1::AttendStreamResponse>*
AttentionServiceImpl::AttendStream(grpc::CallbackServerContext* context) {
  return new StreamReactor(this, context);
}

void AttentionServiceImpl::AddStream(StreamReactor* stream) {
  absl::MutexLock lock(&streams_mu_);
  streams_.insert(stream);
  // A stream opened after shutdown began: drain (and so end) it at once.
  if (shutting_down_.load()) stream->ServerShutdown();
}

void AttentionServiceImpl::RemoveStream(StreamReactor* stream) {
  absl::MutexLock lock(&streams_mu_);
  streams_.erase(stream);
}

bool AttentionServiceImpl::CallStarted() {
  absl::MutexLock lock(&calls_mu_);
  if (shutting_down_.load()) return false;
  ++open_calls_;
  return true;
}

void AttentionServiceImpl::CallDone() {
  absl::MutexLock lock(&calls_mu_);
  --open_calls_;
}

bool AttentionServiceImpl::WaitForNoCalls(absl::Duration timeout) {
  absl::MutexLock lock(&calls_mu_);
  auto idle = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(calls_mu_) { return open_calls_ == 0; };
  return calls_mu_.AwaitWithTimeout(absl::Condition(&idle), timeout);
}

void AttentionServiceImpl::BeginShutdown() {
  {
    // Under calls_mu_: a call is either counted or sees the flag.
    absl::MutexLock lock(&calls_mu_);
    shutting_down_.store(true);
  }
  absl::MutexLock lock(&streams_mu_);
  for (StreamReactor* stream : streams_) stream->ServerShutdown();
}

v1::ModelStatus AttentionServiceImpl::ToModelStatus(const ServedModel& model,
                                                    const std::string& default_name) const {
  v1::ModelStatus status;
  status.set_name(model.name);
  *status.mutable_config() = model.config;
  status.set_state(model.state);
  status.set_reason(model.reason);
  if (model.engine != nullptr) status.set_backend(std::string(model.engine->name()));
  status.set_is_default(model.name == default_name);
  return status;
}

grpc::ServerUnaryReactor* AttentionServiceImpl::ListModels(grpc::CallbackServerContext* context,
                                                           const v1::ListModelsRequest* request,
                                                           v1::ListModelsResponse* response) {
  const std::string default_name = registry_->default_model();
  for (const auto& model : registry_->List()) {
    *response->add_models() = ToModelStatus(*model, default_name);
  }
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

grpc::ServerUnaryReactor* AttentionServiceImpl::GetModel(grpc::CallbackServerContext* context,
                                                         const v1::GetModelRequest* request,
                                                         v1::ModelStatus* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  absl::StatusOr<std::shared_ptr<const ServedModel>> model = registry_->Find(request->name());
  if (!model.ok()) {
    reactor->Finish(ToGrpcStatus(model.status()));
  } else {
    *response = ToModelStatus(**model, registry_->default_model());
    reactor->Finish(grpc::Status::OK);
  }
  return reactor;
}

}  // namespace attnserve
