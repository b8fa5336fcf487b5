// Server-side attention sessions: the session table, each session's block
// table over its model's KvBlockPool, idle-TTL expiry, LRU eviction under
// memory pressure, per-session limits, and the per-session FIFO that runs a
// session's requests one at a time in arrival order. Plain C++ below the
// transport: the RequestDispatcher drives it (docs/ARCHITECTURE.md).
//
// Hand-written: no maintained C++ library does a paged KV cache with session
// routing (vLLM's block manager and Triton's sequence batcher are each half
// of it, in Python and inside Triton's scheduler).
#ifndef ATTNSERVE_SERVER_SESSIONS_SESSION_MANAGER_H_
#define ATTNSERVE_SERVER_SESSIONS_SESSION_MANAGER_H_

#include <cstdint>
#include <deque>
#include <list>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "engine/attention_engine.h"
#include "engine/attention_layer.h"
#include "engine/dtype.h"
#include "server/metrics/metrics.h"
#include "server/request/clock.h"
#include "server/request/inference_request.h"
#include "server/sessions/kv_block_pool.h"
#include "server/sessions/session_options.h"

namespace attnserve {

// What a session's cache stores per token, and what its requests must match.
struct SessionShape {
  DType input_dtype = DType::kFloat32;  // the requests' query/key/value dtype
  DType cache_dtype = DType::kFloat32;  // what the blocks hold
  int64_t num_heads = 0, num_kv_heads = 0, head_dim = 0, head_dim_v = 0;
};

// The fixed shape of a session on projection layer `layer` served by
// `engine`: the engine's cache geometry (SessionCacheGeometry), FLOAT32.
SessionShape ProjectionSessionShape(const AttentionEngine& engine, const LayerConfig& layer);

struct OpenedSession {
  std::string id;
  std::string model;
  absl::Duration ttl;
  int64_t max_tokens = 0;
  int64_t block_tokens = 0;
};

// Per model, for metrics and tests.
struct SessionStats {
  int64_t sessions_open = 0;
  int64_t blocks_used = 0, blocks_free = 0;
  int64_t bytes_held = 0, bytes_capacity = 0;
  int64_t appends = 0, evictions = 0, expiries = 0;
};

// The keys a query of a session's model can see, from its layer: its
// sliding window and its attention chunk (0 = none; attention_params.h).
struct SessionKeyRange {
  int64_t window = 0;
  int64_t chunk = 0;
  // > 0: the most tokens the session may hold in all (LayerConfig::
  // sparse_index_topk: beyond, DSA's indexer would drop keys).
  int64_t dense_up_to = 0;
};

// Thread-safe. One mutex guards everything: every operation is a few map
// lookups and block-list edits, never an engine call. Does not own the clock
// or the metrics (nullable); both must outlive it.
//
// Blocks of a session with a request in flight are read and written by the
// engine without the lock; they are never evicted, expired or freed then
// (eviction and expiry pick idle sessions only; a close waits for the
// request to finish before freeing).
class SessionManager {
 public:
  SessionManager(SessionOptions options, Clock* clock, Metrics* metrics);
  ~SessionManager();

  const SessionOptions& options() const { return options_; }

  // Opens a session on `model`. `fixed`: the cache geometry when the model
  // fixes it (projection models); nullopt = taken from the first request
  // (sdpa). ttl <= 0 / max_tokens <= 0: the server's defaults. `keys`: the
  // model's sliding window and attention chunk; with either, after each
  // request the blocks wholly before every later query's first visible key
  // (FirstWindowKey) are released, so the session holds about window (or
  // chunk) + 256 tokens plus a block whatever its length, and max_tokens
  // bounds the tokens it holds, not its length.
  // InvalidArgument for a TTL over max_ttl or max_tokens over the limit;
  // ResourceExhausted at max_sessions.
  // `id`: the client's choice (OpenSessionRequest.session_id: 16 to 128
  // characters of A-Z a-z 0-9 - _ .; AlreadyExists when open or recently
  // gone), or empty for one made here.
  // `memory`: where the model's engine wants the blocks
  // (AttentionEngine::kv_slab_memory; nullptr = host memory). The model's
  // pool is made with it; a model whose engine changed memory (a reload onto
  // another backend) gets a new pool once its old sessions are gone, and
  // Unavailable until then.
  absl::StatusOr<OpenedSession> Open(const std::string& model, std::optional<SessionShape> fixed,
                                     absl::Duration ttl, int64_t max_tokens,
                                     SessionKeyRange keys = {}, const std::string& id = "",
                                     std::shared_ptr<KvSlabMemory> memory = nullptr);

  // Closes session `id`: its blocks return to the pool (after its request in
  // flight, if any, finishes). Returns the tokens it held; requests queued
  // behind the one in flight are moved to `orphans` for the caller to answer
  // (NOT_FOUND: closed). NotFound / Aborted as for Submit.
  absl::StatusOr<int64_t> Close(absl::string_view id,
                                std::vector<std::unique_ptr<InferenceRequest>>* orphans);

  // The model session `id` is bound to; the errors of Submit for an
  // unknown, closed, expired or evicted session.
  absl::StatusOr<std::string> ModelOf(absl::string_view id);

  // Takes a validated request for session (*request)->session_id (B == 1,
  // no mask, key_lengths or weights: server/request/validation.h) whose
  // model is (*request)->model. On success the manager owns it until it
  // hands it back: *request is the request bound to the cache (task.paged
  // set, session_length = the length it will leave), which the caller
  // schedules now, or null when it waits behind the session's request in
  // flight (Finished hands it back). On error *request is untouched:
  //   NotFound: unknown, closed or expired session (the message names it
  //     and says which; ids of an earlier server instance say that
  //     sessions do not survive a restart);
  //   Aborted: the session was evicted ("resend the prefix");
  //   InvalidArgument: model, shape or dtype different from the session's;
  //   ResourceExhausted: over the session's token limit, its queue limit,
  //     or the cache is full of sessions with requests in flight.
  absl::Status Submit(std::unique_ptr<InferenceRequest>* request);

  // What follows the answer of a session's request in flight.
  struct Next {
    // The session's next request, bound: schedule it.
    std::unique_ptr<InferenceRequest> bound;
    // Requests that could not be bound (token limit, full cache, session
    // closed meanwhile): answer each with its status.
    std::vector<std::pair<std::unique_ptr<InferenceRequest>, absl::Status>> failed;
  };
  // `request` (bound by Submit or a previous Finished) has been answered
  // with `status`: OK commits its rows to the session's length, anything
  // else leaves the length as it was. Then binds the next queued request.
  // Call exactly once per bound request, without holding locks `done`
  // callbacks take.
  Next Finished(const InferenceRequest& request, const absl::Status& status);

  // Model `model` was reloaded (`unloaded` false) or unloaded: each of its
  // sessions ends as Close ends it (a request in flight finishes first), and
  // later requests naming one are ABORTED saying why ("open a new session
  // and resend the prefix"): a cache filled by one version of the weights
  // is never extended by another. Queued requests move to `orphans`, to be
  // answered with the returned status. After an unload the model's cache
  // memory is returned once its last session is freed. Returns how many
  // sessions ended.
  int CloseModel(const std::string& model, bool unloaded,
                 std::vector<std::unique_ptr<InferenceRequest>>* orphans);
  // The status of requests orphaned by CloseModel.
  static absl::Status ModelChangedStatus(absl::string_view session_id, absl::string_view model,
                                         bool unloaded);

  // Closes every idle session whose TTL has passed (also done lazily by
  // Open, Submit and allocation). Cheap when nothing expired.
  void Sweep();

  SessionStats Stats(const std::string& model) const;

 private:
  struct Session;
  struct ModelCache;
  enum class Gone { kClosed, kExpired, kEvicted, kModelReloaded, kModelUnloaded };
  struct GoneRecord {
    Gone why;
    std::string model;
  };

  absl::StatusOr<Session*> Find(absl::string_view id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status CheckShape(Session& s, const InferenceRequest& r) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Allocates the blocks for r's rows and fills r.task.paged.
  absl::Status Bind(Session& s, InferenceRequest& r) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Frees the session's blocks past `tokens`.
  void Trim(Session& s, int64_t tokens) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Frees the blocks no later query of a windowed or chunked session can see.
  void ReleaseOutsideWindow(Session& s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void MakeIdle(Session& s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void MakeBusy(Session& s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Frees an idle (or finishing) session and remembers why it is gone.
  void Remove(Session* s, Gone why) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void SweepLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Publish(ModelCache& cache) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Destroys the cache of an unloaded model whose last session is gone.
  void DropCache(ModelCache* cache) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The cache of `model`, made with `memory` if new (or if it held another
  // memory and no session); Unavailable while sessions of another memory
  // remain.
  absl::StatusOr<ModelCache*> CacheFor(const std::string& model,
                                       std::shared_ptr<KvSlabMemory> memory)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const SessionOptions options_;
  Clock* const clock_;
  Metrics* const metrics_;
  // Random per process: ids carry it, so that an id from an earlier
  // instance is recognised as such.
  const uint64_t epoch_;
  const std::string epoch_hex_;

  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, std::unique_ptr<Session>> sessions_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, std::unique_ptr<ModelCache>> caches_ ABSL_GUARDED_BY(mu_);
  // Idle sessions by expiry time.
  std::set<std::pair<absl::Time, Session*>> expiry_ ABSL_GUARDED_BY(mu_);
  // Why recent sessions are gone, bounded (oldest forgotten first).
  absl::flat_hash_map<std::string, GoneRecord> gone_ ABSL_GUARDED_BY(mu_);
  std::deque<std::string> gone_order_ ABSL_GUARDED_BY(mu_);
  uint64_t next_serial_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace attnserve

#endif  // ATTNSERVE_SERVER_SESSIONS_SESSION_MANAGER_H_
