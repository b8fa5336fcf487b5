// InferenceRequest: the one request type of the server, from the front end
// that decoded it to the engine call that computes it and back. Owned by
// exactly one party at a time (front end -> scheduler -> batch), answered
// through exactly one completion path: Complete().
#ifndef ATTNSERVE_SERVER_REQUEST_INFERENCE_REQUEST_H_
#define ATTNSERVE_SERVER_REQUEST_INFERENCE_REQUEST_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "absl/functional/any_invocable.h"
#include "absl/status/status.h"
#include "absl/time/time.h"
#include "engine/attention_task.h"
#include "server/models/served_model.h"
#include "server/request/model_access.h"

namespace attnserve {

// Where a request's time went inside the server (server clock).
struct RequestTiming {
  absl::Duration queue;    // scheduled -> its batch closed (or it was dropped)
  absl::Duration compute;  // its batch's engine call
  int batch_requests = 0;  // requests that shared the engine call; 0 = none ran
};

// Thread safety: the front end fills the fields before handing the request
// to the scheduler; from then on they are read-only, except `enqueued` and
// `timing`, which the scheduler writes before Complete. cancelled() and
// Complete() may be called from any thread.
class InferenceRequest {
 public:
  // Runs exactly once, from Complete(), on the completing thread (a batcher
  // worker, or the front end's thread for a request refused before
  // compute). OK: task.output (and task.weights) are written. Must not block
  // for long. The request may be destroyed right after it returns.
  using DoneFn = absl::AnyInvocable<void(absl::Status status, const InferenceRequest& request)>;

  InferenceRequest() = default;
  InferenceRequest(const InferenceRequest&) = delete;
  InferenceRequest& operator=(const InferenceRequest&) = delete;

  // The client's request id (echoed in the answer; used in messages).
  std::string id;
  // The session the request attends in (AttendRequest.session_id); empty =
  // stateless. Set by the front end.
  std::string session_id;
  // Session requests: tokens the session holds once this request's rows are
  // appended (set when the request is bound to the session's cache; reported
  // in the answer when it succeeds).
  int64_t session_length = 0;
  // Resolved by the dispatcher; keeps the layer and engine alive while the
  // request exists. Null until then (and in batcher tests).
  std::shared_ptr<const ServedModel> model;
  // Validated inputs and options; output (and weights) point at the
  // front end's response buffers. Every buffer it points to stays valid
  // until `done` has run.
  AttentionTask task;
  // The task's dims, as validation derived them.
  TaskDims dims;
  // Memory the request holds while it waits: its input tensors' bytes plus
  // the outputs allocated for it (set by the dispatcher; the unit of
  // BatcherOptions::max_queue_bytes). Default: 0.
  int64_t bytes = 0;
  // When the front end received the request. Default: not set.
  absl::Time received = absl::InfinitePast();
  // Still queued at its deadline: finishes DEADLINE_EXCEEDED, not computed.
  // Default: none.
  absl::Time deadline = absl::InfiniteFuture();
  // Optional: true once nobody waits for the answer any more (client gone);
  // a queued request then finishes CANCELLED without compute. Thread-safe,
  // cheap, non-blocking (called under the batcher's lock).
  std::function<bool()> is_cancelled;
  // The models the caller may use, from its credentials (the front end sets
  // it; see ModelAccess). The dispatcher answers PERMISSION_DENIED for any
  // other. Default: every model -- a front end that authenticates callers
  // must set it.
  ModelAccess access;
  DoneFn done;

  // Set by the scheduler.
  absl::Time enqueued = absl::InfinitePast();
  RequestTiming timing;

  // The unit of BatcherOptions::max_batch_tokens: query tokens, B * Lq.
  int64_t tokens() const { return dims.batch * dims.q_len; }

  bool cancelled() const { return is_cancelled && is_cancelled(); }

  // Answers the request: runs `done` with `status`. Only the first call has
  // an effect (returns true), so a cancellation racing with the end of a
  // computation cannot answer twice. Never call it while holding a lock that
  // `done` may take.
  bool Complete(absl::Status status) {
    if (completed_.exchange(true, std::memory_order_acq_rel)) return false;
    if (done) done(std::move(status), *this);
    return true;
  }
  bool completed() const { return completed_.load(std::memory_order_acquire); }

 private:
  std::atomic<bool> completed_{false};
};

}  // namespace attnserve

#endif  // ATTNSERVE_SERVER_REQUEST_INFERENCE_REQUEST_H_
