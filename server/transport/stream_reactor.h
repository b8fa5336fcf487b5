// StreamReactor: one bidirectional inference stream (attnserve.v1's
// AttendStream, KServe v2's ModelStreamInfer), whatever its protocol. Each
// message read is handed to the service's StreamHandler, which parses and
// submits it like a unary request; its serialized answer is written in
// completion order, one write at a time, under a flow-control bound.
#ifndef ATTNSERVE_SERVER_TRANSPORT_STREAM_REACTOR_H_
#define ATTNSERVE_SERVER_TRANSPORT_STREAM_REACTOR_H_

#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <optional>

#include "absl/base/thread_annotations.h"
#include "absl/functional/any_invocable.h"
#include "absl/synchronization/mutex.h"
#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/server_callback.h"
#include "grpcpp/support/status.h"
#include "server/transport/call_tracker.h"

namespace attnserve {

// What a service does with the messages of its streams.
class StreamHandler {
 public:
  virtual ~StreamHandler() = default;
  // Receives the serialized answer of one message.
  using AnswerFn = absl::AnyInvocable<void(grpc::ByteBuffer answer)>;
  // Parses message `number` (counting from 1) of a stream from `bytes` (and
  // may release them) and starts it. Every message gets exactly one answer,
  // a response or an error in the protocol's form (a message that cannot be
  // parsed too), through `answer`, from this thread or a batcher worker,
  // possibly before this returns. `context` outlives the answer.
  virtual void StartStreamMessage(grpc::CallbackServerContext* context, grpc::ByteBuffer* bytes,
                                  int64_t number, AnswerFn answer) = 0;
  // The client went away: queued requests of the stream should leave the
  // queues now (their is_cancelled() reads the context).
  virtual void StreamCancelled() = 0;
};

// Flow control: the stream owes at most `max_backlog` answers (submitted +
// waiting to be written). At the bound no read is issued, so when the client
// stops reading answers, writes stall, the backlog fills and the server stops
// reading requests: HTTP/2 flow control then pushes back on the client.
//
// A failed message does not end the stream: its answer says so and the next
// message is read as usual (gRPC's framing is intact), as Triton's streaming
// API does. The stream ends OK after the client half-closes and every answer
// is written; CANCELLED when a write fails (client gone); UNAVAILABLE when
// the server shuts down, once everything accepted has been answered.
//
// Lifetime: created by a service's stream handler method, deletes itself in
// OnDone. The stream finishes only when nothing is owed (no request in the
// server refers to it), so completions never touch a deleted reactor; and
// Finish is called outside mu_, as the last thing a thread does with the
// reactor.
class StreamReactor final : public grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
 public:
  // `calls` and `handler` outlive the stream (the service owns both).
  StreamReactor(CallTracker* calls, StreamHandler* handler, grpc::CallbackServerContext* context,
                size_t max_backlog);

  void OnReadDone(bool ok) override;
  void OnWriteDone(bool ok) override;
  void OnCancel() override;
  void OnDone() override;

  // Server shutdown: stop reading; end the stream once everything accepted
  // has been answered. Any thread.
  void ServerShutdown();

 private:
  // Queues the answer of one accepted message (any thread).
  void Answer(grpc::ByteBuffer answer);
  void WriteLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Issues the next read if one is wanted and the backlog has room.
  void MaybeReadLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The status to Finish the stream with, when it is done (then finished_
  // is set). The caller calls Finish only after releasing mu_: Finish lets
  // OnDone delete this reactor on another thread, and a MutexLock still
  // held would then unlock freed memory (the soak's abort: "Mutex unlocked
  // when destroyed or not locked").
  std::optional<grpc::Status> MaybeFinishLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  CallTracker* const calls_;
  StreamHandler* const handler_;
  grpc::CallbackServerContext* const context_;
  const size_t max_backlog_;
  const bool counted_;  // opened before shutdown: shutdown waits for it

  // Read buffer and the number of messages read; touched only by the read in
  // flight (reads never overlap).
  grpc::ByteBuffer read_bytes_;
  int64_t messages_read_ = 0;

  absl::Mutex mu_;
  // Answers waiting to be written; front() is being written when writing_.
  std::deque<grpc::ByteBuffer> backlog_ ABSL_GUARDED_BY(mu_);
  size_t owed_ ABSL_GUARDED_BY(mu_) = 0;  // accepted, not yet answered
  bool reading_ ABSL_GUARDED_BY(mu_) = false;
  bool paused_ ABSL_GUARDED_BY(mu_) = false;  // a read is wanted but not issued
  bool reads_done_ ABSL_GUARDED_BY(mu_) = false;
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool write_failed_ ABSL_GUARDED_BY(mu_) = false;
  bool draining_ ABSL_GUARDED_BY(mu_) = false;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
};

// A stream answered `status` at once, before any read (an unauthenticated
// call); deletes itself when gRPC is done with it.
grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* FinishedStream(grpc::Status status);

}  // namespace attnserve

#endif  // ATTNSERVE_SERVER_TRANSPORT_STREAM_REACTOR_H_
