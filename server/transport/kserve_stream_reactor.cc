// KServeStreamReactor: reads, submits, answers and flow control of one
// ModelStreamInfer call.
#include "server/transport/kserve_stream_reactor.h"

#include <utility>

#include "server/transport/attend_codec.h"
#include "server/transport/status_util.h"

namespace attnserve {

KServeStreamReactor::KServeStreamReactor(KServeServiceImpl* service,
                                         grpc::CallbackServerContext* context)
    : service_(service), context_(context), counted_(service->CallStarted()) {
  service_->AddStream(this);
  absl::MutexLock lock(&mu_);
  if (finished_) return;  // opened during shutdown: already ended
  reading_ = true;
  StartRead(&read_bytes_);
}

void KServeStreamReactor::OnReadDone(bool ok) {
  if (!ok) {  // client half-closed (or the call ended)
    absl::MutexLock lock(&mu_);
    reading_ = false;
    reads_done_ = true;
    MaybeFinishLocked();
    return;
  }
  auto message = std::make_unique<Message>();
  const absl::Status parsed =
      ParseMessage(&read_bytes_, "ModelStreamInfer message", ++messages_read_, &message->request);
  {
    absl::MutexLock lock(&mu_);
    reading_ = false;
    if (finished_) return;  // stream already ended: never accepted
    ++owed_;
  }
  // From here the completion owns the message (it may run before StartInfer
  // returns).
  Message* raw = message.release();
  service_->StartInfer(context_, parsed, raw->request, &raw->decoded,
                       raw->answer.mutable_infer_response(), &raw->scratch,
                       [this, raw](absl::Status status) {
                         Answer(std::unique_ptr<Message>(raw), std::move(status));
                       });
  absl::MutexLock lock(&mu_);
  paused_ = true;
  MaybeReadLocked();
}

void KServeStreamReactor::OnWriteDone(bool ok) {
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

void KServeStreamReactor::OnCancel() { service_->dispatcher_->CancelledOnAnyModel(); }

void KServeStreamReactor::OnDone() {
  KServeServiceImpl* service = service_;
  const bool counted = counted_;
  service->RemoveStream(this);
  delete this;
  if (counted) service->CallDone();
}

void KServeStreamReactor::ServerShutdown() {
  absl::MutexLock lock(&mu_);
  draining_ = true;
  MaybeFinishLocked();
}

void KServeStreamReactor::Answer(std::unique_ptr<Message> message, absl::Status status) {
  message->request.Clear();  // inputs no longer needed; free them now
  inference::ModelInferResponse* response = message->answer.mutable_infer_response();
  if (!status.ok()) {
    // Triton's form: the message alone; the response names the request.
    response->clear_outputs();
    response->clear_raw_output_contents();
    message->answer.set_error_message(ToGrpcStatus(status).error_message());
  }
  if (message->decoded.flag_final_response) {
    (*response->mutable_parameters())["triton_final_response"].set_bool_param(true);
  }
  if (absl::Status s = SerializeMessage(message->answer, &message->answer_bytes); !s.ok()) {
    // Over protobuf's size limit: answer the error instead (a few bytes).
    response->clear_outputs();
    response->clear_raw_output_contents();
    message->answer.set_error_message(ToGrpcStatus(s).error_message());
    SerializeMessage(message->answer, &message->answer_bytes).IgnoreError();
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

void KServeStreamReactor::WriteLocked() {
  writing_ = true;
  StartWrite(&backlog_.front()->answer_bytes);
}

void KServeStreamReactor::MaybeReadLocked() {
  if (!paused_ || reading_ || reads_done_ || finished_ || draining_ || write_failed_) return;
  if (owed_ + backlog_.size() >= service_->options_.max_stream_backlog) return;
  paused_ = false;
  reading_ = true;
  StartRead(&read_bytes_);
}

void KServeStreamReactor::MaybeFinishLocked() {
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

}  // namespace attnserve
