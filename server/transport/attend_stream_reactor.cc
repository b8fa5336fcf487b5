// AttendStreamReactor: reads, submits, answers and flow control of one
// AttendStream.
#include "server/transport/attend_stream_reactor.h"

#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "server/transport/attend_codec.h"
#include "server/transport/status_util.h"

namespace attnserve {

AttendStreamReactor::AttendStreamReactor(AttentionServiceImpl* service,
                                         grpc::CallbackServerContext* context)
    : service_(service), context_(context), counted_(service->CallStarted()) {
  service_->AddStream(this);
  absl::MutexLock lock(&mu_);
  if (finished_) return;  // opened during shutdown: already ended
  reading_ = true;
  StartRead(&read_bytes_);
}

void AttendStreamReactor::OnReadDone(bool ok) {
  if (!ok) {  // client half-closed (or the call ended)
    std::optional<grpc::Status> finish;
    {
      absl::MutexLock lock(&mu_);
      reading_ = false;
      reads_done_ = true;
      finish = MaybeFinishLocked();
    }
    if (finish) Finish(*std::move(finish));
    return;
  }
  // The message's tensors must outlive its request: parse it into its own
  // Message (the one copy of the bytes, as gRPC's own parse made).
  auto message = std::make_unique<Message>();
  const absl::Status parsed =
      ParseAttendRequest(&read_bytes_, "AttendStream message", ++messages_read_,
                         &message->request);
  if (!parsed.ok()) service_->CountUnparseable("AttendStream");
  message->answer.set_id(message->request.id());
  {
    absl::MutexLock lock(&mu_);
    reading_ = false;
    if (finished_) return;  // stream already ended: never accepted
    ++owed_;
  }
  // From here the completion owns the message (it may even run before
  // StartAttend returns).
  Message* raw = message.release();
  service_->StartAttend(context_, parsed, raw->request, raw->answer.mutable_response(),
                        [this, raw](absl::Status status) {
                          Answer(std::unique_ptr<Message>(raw), std::move(status));
                        });
  absl::MutexLock lock(&mu_);
  paused_ = true;
  MaybeReadLocked();
}

void AttendStreamReactor::OnWriteDone(bool ok) {
  std::optional<grpc::Status> finish;
  {
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
    finish = MaybeFinishLocked();
  }
  if (finish) Finish(*std::move(finish));
}

void AttendStreamReactor::OnCancel() { service_->dispatcher_->CancelledOnAnyModel(); }

void AttendStreamReactor::OnDone() {
  AttentionServiceImpl* service = service_;
  const bool counted = counted_;
  service->RemoveStream(this);
  delete this;
  if (counted) service->CallDone();
}

void AttendStreamReactor::ServerShutdown() {
  std::optional<grpc::Status> finish;
  {
    absl::MutexLock lock(&mu_);
    draining_ = true;
    finish = MaybeFinishLocked();
  }
  if (finish) Finish(*std::move(finish));
}

void AttendStreamReactor::Answer(std::unique_ptr<Message> message, absl::Status status) {
  message->request.Clear();  // inputs no longer needed; free them now
  if (!status.ok()) {
    message->answer.clear_response();
    message->answer.set_code(static_cast<int>(status.code()));
    const grpc::Status bounded = ToGrpcStatus(status);
    message->answer.set_message(bounded.error_message());
  }
  // Serialized here, outside mu_, rather than by StartWrite under it.
  if (absl::Status s = SerializeMessage(message->answer, &message->answer_bytes); !s.ok()) {
    // Over protobuf's size limit: answer the error instead (a few bytes).
    message->answer.clear_response();
    message->answer.set_code(static_cast<int>(s.code()));
    message->answer.set_message(ToGrpcStatus(s).error_message());
    SerializeMessage(message->answer, &message->answer_bytes).IgnoreError();
  }
  std::optional<grpc::Status> finish;
  {
    absl::MutexLock lock(&mu_);
    --owed_;
    if (!write_failed_) {
      backlog_.push_back(std::move(message));
      if (!writing_) WriteLocked();
    }
    MaybeReadLocked();
    finish = MaybeFinishLocked();
  }
  // Last touch of this reactor: once Finish is called, OnDone may delete it
  // on another thread at any moment (this runs on a batcher worker, outside
  // any gRPC reaction, so gRPC does not wait for it).
  if (finish) Finish(*std::move(finish));
}

void AttendStreamReactor::WriteLocked() {
  writing_ = true;
  StartWrite(&backlog_.front()->answer_bytes);
}

void AttendStreamReactor::MaybeReadLocked() {
  if (!paused_ || reading_ || reads_done_ || finished_ || draining_ || write_failed_) return;
  if (owed_ + backlog_.size() >= service_->options_.max_stream_backlog) return;
  paused_ = false;
  reading_ = true;
  StartRead(&read_bytes_);
}

std::optional<grpc::Status> AttendStreamReactor::MaybeFinishLocked() {
  if (finished_ || writing_ || owed_ > 0) return std::nullopt;
  if (write_failed_) {
    finished_ = true;
    return grpc::Status(grpc::StatusCode::CANCELLED, "client stopped receiving");
  }
  if (backlog_.empty() && reads_done_) {
    finished_ = true;
    return grpc::Status::OK;
  }
  if (backlog_.empty() && draining_) {
    finished_ = true;
    return grpc::Status(grpc::StatusCode::UNAVAILABLE,
                        "server is shutting down; every request read was answered");
  }
  return std::nullopt;
}

}  // namespace attnserve
