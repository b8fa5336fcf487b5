// RequestDispatcher: the request path every front end shares. A front end
// decodes its wire message into AttendInputs and an InferenceRequest and
// calls Submit; model lookup, validation, output binding, scheduling,
// deadlines and the per-request metrics happen here, once, for all of them.
#ifndef ATTNSERVE_SERVER_DISPATCH_REQUEST_DISPATCHER_H_
#define ATTNSERVE_SERVER_DISPATCH_REQUEST_DISPATCHER_H_

#include <memory>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "engine/tensor.h"
#include "server/batching/batching_scheduler.h"
#include "server/metrics/metrics.h"
#include "server/models/model_registry.h"
#include "server/request/attend_inputs.h"
#include "server/request/clock.h"
#include "server/request/inference_request.h"
#include "server/request/validation.h"
#include "server/sessions/session_manager.h"

namespace attnserve {

// Which result tensor a front end is asked to allocate.
enum class OutputName { kOutput, kWeights };

// Thread-safe: Submit may be called concurrently from any thread. Does not
// own the registry, the scheduler, the sessions (nullable: no sessions), the
// metrics (nullable) or the clock; all must outlive it.
//
// Session requests (AttendInputs::session_id) take the same path: lookup
// (a request that names no model runs on the session's), validation, output
// binding, then the session manager, which binds the request to the
// session's cache or queues it behind the session's request in flight; a
// bound request is scheduled like any other and, once answered, hands its
// session to the next queued one. So a session's requests run one at a
// time, in arrival order, while different sessions batch together.
class RequestDispatcher {
 public:
  // Allocates a result tensor where the front end's response will carry it
  // and returns a writable view of it: the engine writes there directly, and
  // every byte of it (the memory need not be cleared). Called on Submit's
  // thread, before Submit returns. An error (the client's own memory for the
  // result is too small) answers the request with it.
  using OutputAllocator = absl::FunctionRef<absl::StatusOr<MutableTensorView>(
      OutputName name, DType dtype, const Shape& shape)>;

  RequestDispatcher(const ModelRegistry* registry, BatchingScheduler* scheduler, Metrics* metrics,
                    Clock* clock, ValidationOptions validation,
                    SessionManager* sessions = nullptr);

  // Runs `request`, whose id, received, deadline, is_cancelled and done the
  // front end has set, on the model `inputs.model` names (empty = the
  // default model). The request is answered exactly once through its
  // Complete(): on this thread when it is refused before compute (unknown
  // or failed model, a model outside request->access, invalid inputs, queue
  // full, shutting down), otherwise
  // later from a batcher worker. `inputs`' views must stay valid until then.
  void Submit(std::unique_ptr<InferenceRequest> request, const AttendInputs& inputs,
              OutputAllocator allocate);

  // Answers `request` with `status` (not OK) without running it, counted
  // like every other answer: for requests a front end refuses itself (the
  // server is shutting down).
  void Reject(std::unique_ptr<InferenceRequest> request, absl::Status status);

  // A queued request's cancelled() may have turned true: have the queue of
  // the model the client named (empty = the default model) look now, or,
  // when the front end cannot tell which model (a stream's requests), every
  // queue.
  void Cancelled(absl::string_view model);
  void CancelledOnAnyModel();

  // OpenSession on `model` (empty = the default model): the model must be
  // ready and served by an engine that supports sessions (FailedPrecondition
  // otherwise). Errors of SessionManager::Open; Unimplemented without
  // sessions.
  absl::StatusOr<OpenedSession> OpenSession(absl::string_view model, absl::Duration ttl,
                                            int64_t max_tokens,
                                            absl::string_view session_id = "");
  // CloseSession: the tokens the session held. Requests queued behind its
  // request in flight are answered NOT_FOUND (closed).
  absl::StatusOr<int64_t> CloseSession(absl::string_view session_id);
  // The model a session was opened on (NOT_FOUND when it is unknown,
  // closed, expired or evicted; Unimplemented without sessions).
  absl::StatusOr<std::string> SessionModel(absl::string_view session_id);

  // The server's clock: front ends stamp `received` and deadlines with it.
  Clock* clock() const { return clock_; }

 private:
  // Puts the metrics in front of the front end's `done`.
  void CountAnswer(InferenceRequest& request);
  // Everything up to handing the request over; on error the caller answers.
  absl::Status Start(std::unique_ptr<InferenceRequest>& request, const AttendInputs& inputs,
                     OutputAllocator allocate);
  // Puts the session hand-over (SessionManager::Finished) in front of the
  // answer of a session request.
  void WrapSessionDone(InferenceRequest& request);
  // Schedules what Finished handed back and answers what it refused.
  void StartSessionRequests(SessionManager::Next next);
  // Hands the request to the scheduler, counted in the inflight gauge.
  absl::Status Schedule(std::unique_ptr<InferenceRequest>& request);
  // The metrics of one answered request.
  void RecordAnswer(const InferenceRequest& request, const absl::Status& status);

  const ModelRegistry* const registry_;
  BatchingScheduler* const scheduler_;
  Metrics* const metrics_;
  Clock* const clock_;
  const ValidationOptions validation_;
  SessionManager* const sessions_;
};

}  // namespace attnserve

#endif  // ATTNSERVE_SERVER_DISPATCH_REQUEST_DISPATCHER_H_
