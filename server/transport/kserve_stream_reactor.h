// KServeStreamReactor: one ModelStreamInfer call (Triton's bidirectional
// streaming inference). Each message is parsed and submitted like a unary
// ModelInfer; its answer is written in completion order, one write at a
// time, under the same flow-control bound as AttendStream.
#ifndef ATTNSERVE_SERVER_TRANSPORT_KSERVE_STREAM_REACTOR_H_
#define ATTNSERVE_SERVER_TRANSPORT_KSERVE_STREAM_REACTOR_H_

#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "grpcpp/support/byte_buffer.h"
#include "inference/grpc_service.pb.h"
#include "server/transport/kserve_codec.h"
#include "server/transport/kserve_service.h"

namespace attnserve {

// Answers: a ModelStreamInferResponse per message; OK -> infer_response with
// the outputs; failed -> error_message (the status message, as Triton sends
// it) and infer_response carrying only id and model_name, so the client can
// tell which request failed. A message that is not a valid ModelInferRequest
// is answered in its place ("ModelStreamInfer message 3 could not be parsed
// ...") and the stream goes on, as Triton keeps a stream open after a failed
// request.
//
// Flow control and lifetime as AttendStreamReactor (attend_stream_reactor.h):
// at most max_stream_backlog answers owed before reading stops; the reactor
// deletes itself in OnDone and finishes only when nothing is owed.
class KServeStreamReactor final
    : public grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
 public:
  KServeStreamReactor(KServeServiceImpl* service, grpc::CallbackServerContext* context);

  void OnReadDone(bool ok) override;
  void OnWriteDone(bool ok) override;
  void OnCancel() override;
  void OnDone() override;

  // Server shutdown: stop reading; end once everything accepted is answered.
  void ServerShutdown();

 private:
  struct Message {
    inference::ModelInferRequest request;
    KServeInferInputs decoded;
    std::string scratch;  // outputs computed but not returned
    inference::ModelStreamInferResponse answer;
    grpc::ByteBuffer answer_bytes;
  };

  void Answer(std::unique_ptr<Message> message, absl::Status status);
  void WriteLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void MaybeReadLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void MaybeFinishLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  KServeServiceImpl* const service_;
  grpc::CallbackServerContext* const context_;
  const bool counted_;

  grpc::ByteBuffer read_bytes_;
  int64_t messages_read_ = 0;
  absl::Mutex mu_;
  std::deque<std::unique_ptr<Message>> backlog_ ABSL_GUARDED_BY(mu_);
  size_t owed_ ABSL_GUARDED_BY(mu_) = 0;
  bool reading_ ABSL_GUARDED_BY(mu_) = false;
  bool paused_ ABSL_GUARDED_BY(mu_) = false;
  bool reads_done_ ABSL_GUARDED_BY(mu_) = false;
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool write_failed_ ABSL_GUARDED_BY(mu_) = false;
  bool draining_ ABSL_GUARDED_BY(mu_) = false;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace attnserve

#endif  // ATTNSERVE_SERVER_TRANSPORT_KSERVE_STREAM_REACTOR_H_
