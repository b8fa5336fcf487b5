// attnserve.v1.AttentionService on gRPC's callback API. Handlers return at
// once: Attend (and each AttendStream message) validates, binds the outputs
// into the response and hands the work to an AttendScheduler, whose
// completion sends the answer.
#ifndef ATTNSERVE_SERVER_ATTENTION_SERVICE_H_
#define ATTNSERVE_SERVER_ATTENTION_SERVICE_H_

#include <atomic>
#include <cstddef>
#include <set>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/functional/any_invocable.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "attnserve/v1/attention.grpc.pb.h"
#include "server/attend_scheduler.h"
#include "server/metrics.h"
#include "server/model_registry.h"
#include "server/validation.h"

namespace attnserve {

struct AttentionServiceOptions {
  // Size limits applied to every Attend request. Default: ValidationOptions{}.
  ValidationOptions validation;
  // AttendStream flow control: most responses one stream may owe at once
  // (requests being computed plus responses waiting to be written). At the
  // bound the server stops reading the stream until the client reads.
  // Default: 64.
  size_t max_stream_backlog = 64;
};

// Thread-safe (gRPC calls handlers concurrently). Does not own the registry,
// the scheduler or the metrics (nullable); all must outlive the grpc::Server
// this is registered with (i.e. until its Shutdown() has returned).
//
// Every request gets exactly one answer: the unary status, or one
// AttendStreamResponse per stream message carrying the request's id and its
// own status (a failed message does not end the stream).
class AttentionServiceImpl final : public v1::AttentionService::CallbackService {
 public:
  AttentionServiceImpl(const ModelRegistry* registry, AttendScheduler* scheduler,
                       Metrics* metrics = nullptr, AttentionServiceOptions options = {});

  grpc::ServerUnaryReactor* Attend(grpc::CallbackServerContext* context,
                                   const v1::AttendRequest* request,
                                   v1::AttendResponse* response) override;
  grpc::ServerBidiReactor<v1::AttendRequest, v1::AttendStreamResponse>* AttendStream(
      grpc::CallbackServerContext* context) override;
  grpc::ServerUnaryReactor* ListModels(grpc::CallbackServerContext* context,
                                       const v1::ListModelsRequest* request,
                                       v1::ListModelsResponse* response) override;
  grpc::ServerUnaryReactor* GetModel(grpc::CallbackServerContext* context,
                                     const v1::GetModelRequest* request,
                                     v1::ModelStatus* response) override;

  // From now on new requests (unary or stream messages) are answered
  // UNAVAILABLE; open streams stop reading and end (UNAVAILABLE) once every
  // request they accepted has been answered. Work already accepted is left
  // to the scheduler to finish. Idempotent.
  void BeginShutdown();

  // Waits until every Attend and AttendStream call opened before
  // BeginShutdown is done (its answers handed to gRPC and sent), up to
  // `timeout`. True when they all are. Calls opened later are answered
  // UNAVAILABLE at once and not waited for, so a steady stream of newcomers
  // cannot hold shutdown up.
  bool WaitForNoCalls(absl::Duration timeout);

 private:
  class UnaryReactor;
  class StreamReactor;

  // Everything up to handing the work over: model lookup, validation,
  // output binding, Schedule. On OK, `done` runs exactly once (from a
  // scheduler thread) with the final status, after the response's timing is
  // filled in. On error `done` is dropped unrun and the error is the answer.
  // `*model_name` is set once the model is known (for metrics and Wake).
  absl::Status StartAttend(grpc::CallbackServerContext* context, const v1::AttendRequest& request,
                           v1::AttendResponse* response, SteadyClock::time_point received,
                           std::string* model_name, absl::AnyInvocable<void(absl::Status)> done);
  // One answered request, for the metrics.
  void RecordAnswer(const std::string& model_name, const absl::Status& status,
                    SteadyClock::time_point received);
  v1::ModelStatus ToModelStatus(const ServedModel& model, const std::string& default_name) const;

  void AddStream(StreamReactor* stream);
  void RemoveStream(StreamReactor* stream);
  // Counts a call opened before BeginShutdown (returns true) so that
  // shutdown waits for it; calls opened later are refused and not waited for.
  bool CallStarted();
  void CallDone();

  const ModelRegistry* const registry_;
  AttendScheduler* const scheduler_;
  Metrics* const metrics_;
  const AttentionServiceOptions options_;

  std::atomic<bool> shutting_down_{false};
  absl::Mutex streams_mu_;
  std::set<StreamReactor*> streams_ ABSL_GUARDED_BY(streams_mu_);
  absl::Mutex calls_mu_;
  // Attend + AttendStream calls opened before shutdown and not yet done.
  int64_t open_calls_ ABSL_GUARDED_BY(calls_mu_) = 0;
};

}  // namespace attnserve

#endif  // ATTNSERVE_SERVER_ATTENTION_SERVICE_H_
