// AttendStreamReactor: one AttendStream call. Each message is parsed and
// submitted like a unary Attend; its answer (response or status, with its id)
// is written in completion order, one write at a time, under a flow-control
// bound.
#ifndef ATTNSERVE_SERVER_TRANSPORT_ATTEND_STREAM_REACTOR_H_
#define ATTNSERVE_SERVER_TRANSPORT_ATTEND_STREAM_REACTOR_H_

#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <optional>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "attnserve/v1/attention.grpc.pb.h"
#include "grpcpp/support/byte_buffer.h"
#include "server/transport/attention_service.h"

namespace attnserve {

// Flow control: the stream owes at most max_stream_backlog responses
// (submitted + waiting to be written). At the bound no read is issued, so
// when the client stops reading responses, writes stall, the backlog fills
// and the server stops reading requests: HTTP/2 flow control then pushes
// back on the client's writes.
//
// A message that is not a valid AttendRequest is answered in its place in the
// stream like any other refused request: code INVALID_ARGUMENT, a message
// naming its position ("AttendStream message 3 could not be parsed ..."), an
// empty id; the stream goes on (gRPC's framing is intact, so the next message
// is read as usual), as Triton's streaming API answers a failed request with
// an error response and keeps the stream open.
//
// Lifetime: created by AttentionServiceImpl::AttendStream, deletes itself in
// OnDone. The stream finishes only when nothing is owed (no request in the
// server refers to it), so completions never touch a deleted reactor; and
// Finish is called outside mu_, as the last thing a thread does with the
// reactor.
class AttendStreamReactor final : public grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
 public:
  AttendStreamReactor(AttentionServiceImpl* service, grpc::CallbackServerContext* context);

  void OnReadDone(bool ok) override;
  void OnWriteDone(bool ok) override;
  // The client went away: queued requests of this stream should leave the
  // queues now (their is_cancelled() reads the context).
  void OnCancel() override;
  void OnDone() override;

  // Server shutdown: stop reading; end the stream once everything accepted
  // has been answered. Any thread.
  void ServerShutdown();

 private:
  struct Message {
    v1::AttendRequest request;
    v1::AttendStreamResponse answer;
    grpc::ByteBuffer answer_bytes;  // the serialized answer, once it is known
  };

  // Queues the answer of one accepted message (any thread).
  void Answer(std::unique_ptr<Message> message, absl::Status status);
  void WriteLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Issues the next read if one is wanted and the backlog has room.
  void MaybeReadLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The status to Finish the stream with, when it is done (then finished_
  // is set). The caller calls Finish only after releasing mu_: Finish lets
  // OnDone delete this reactor on another thread, and a MutexLock still
  // held would then unlock freed memory (the soak's abort: "Mutex unlocked
  // when destroyed or not locked").
  std::optional<grpc::Status> MaybeFinishLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  AttentionServiceImpl* const service_;
  grpc::CallbackServerContext* const context_;
  const bool counted_;  // opened before shutdown: shutdown waits for it

  // Read buffer and the number of messages read; touched only by the read in
  // flight (reads never overlap).
  grpc::ByteBuffer read_bytes_;
  int64_t messages_read_ = 0;
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

}  // namespace attnserve

#endif  // ATTNSERVE_SERVER_TRANSPORT_ATTEND_STREAM_REACTOR_H_
