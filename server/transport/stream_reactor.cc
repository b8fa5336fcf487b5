// StreamReactor: reads, answers and flow control of one inference stream.
#include "server/transport/stream_reactor.h"

#include <optional>
#include <utility>

namespace attnserve {

StreamReactor::StreamReactor(CallTracker* calls, StreamHandler* handler,
                             grpc::CallbackServerContext* context, size_t max_backlog)
    : calls_(calls),
      handler_(handler),
      context_(context),
      max_backlog_(max_backlog),
      counted_(calls->CallStarted()) {
  calls_->AddStream(this);
  absl::MutexLock lock(&mu_);
  if (finished_) return;  // opened during shutdown: already ended
  reading_ = true;
  StartRead(&read_bytes_);
}

void StreamReactor::OnReadDone(bool ok) {
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
  {
    absl::MutexLock lock(&mu_);
    reading_ = false;
    if (finished_) return;  // stream already ended: never accepted
    ++owed_;
  }
  // The answer may come back before StartStreamMessage returns.
  handler_->StartStreamMessage(context_, &read_bytes_, ++messages_read_,
                               [this](grpc::ByteBuffer answer) { Answer(std::move(answer)); });
  absl::MutexLock lock(&mu_);
  paused_ = true;
  MaybeReadLocked();
}

void StreamReactor::OnWriteDone(bool ok) {
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

void StreamReactor::OnCancel() { handler_->StreamCancelled(); }

void StreamReactor::OnDone() {
  CallTracker* calls = calls_;
  const bool counted = counted_;
  calls->RemoveStream(this);
  delete this;
  if (counted) calls->CallDone();
}

void StreamReactor::ServerShutdown() {
  std::optional<grpc::Status> finish;
  {
    absl::MutexLock lock(&mu_);
    draining_ = true;
    finish = MaybeFinishLocked();
  }
  if (finish) Finish(*std::move(finish));
}

void StreamReactor::Answer(grpc::ByteBuffer answer) {
  std::optional<grpc::Status> finish;
  {
    absl::MutexLock lock(&mu_);
    --owed_;
    if (!write_failed_) {
      backlog_.push_back(std::move(answer));
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

void StreamReactor::WriteLocked() {
  writing_ = true;
  StartWrite(&backlog_.front());
}

void StreamReactor::MaybeReadLocked() {
  if (!paused_ || reading_ || reads_done_ || finished_ || draining_ || write_failed_) return;
  if (owed_ + backlog_.size() >= max_backlog_) return;
  paused_ = false;
  reading_ = true;
  StartRead(&read_bytes_);
}

std::optional<grpc::Status> StreamReactor::MaybeFinishLocked() {
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

namespace {

class FinishedStreamReactor final
    : public grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
 public:
  explicit FinishedStreamReactor(grpc::Status status) { Finish(std::move(status)); }
  void OnDone() override { delete this; }
};

}  // namespace

grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* FinishedStream(grpc::Status status) {
  return new FinishedStreamReactor(std::move(status));
}

}  // namespace attnserve
