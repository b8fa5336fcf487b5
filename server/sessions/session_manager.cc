// The session table: ids, block tables, the per-session FIFO, expiry and
// eviction.
#include "server/sessions/session_manager.h"

#include <algorithm>
#include <random>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "engine/attention_params.h"
#include "engine/tensor.h"

namespace attnserve {
namespace {

// How many gone sessions are remembered for a precise error message.
constexpr size_t kGoneRemembered = 1 << 16;

uint64_t RandomU64() {
  std::random_device rd;
  return (static_cast<uint64_t>(rd()) << 32) ^ rd();
}

std::string ShapeText(const SessionShape& s) {
  return absl::StrCat(DTypeName(s.input_dtype).data(), " Hq=", s.num_heads,
                      " Hkv=", s.num_kv_heads, " Dk=", s.head_dim, " Dv=", s.head_dim_v);
}

}  // namespace

struct SessionManager::ModelCache {
  ModelCache(std::string name, int64_t bytes, std::shared_ptr<KvSlabMemory> memory)
      : model(std::move(name)), pool(bytes, std::move(memory)) {}
  const std::string model;
  KvBlockPool pool;
  // Idle sessions, least recently used first: eviction candidates.
  std::list<Session*> lru;
  int64_t sessions = 0;
  SessionStats counters;  // appends, evictions, expiries
  ModelMetrics* metrics = nullptr;
  // The model was unloaded: the cache is destroyed (its memory returned)
  // when its last session is freed.
  bool unloaded = false;
};

struct SessionManager::Session {
  std::string id;
  ModelCache* cache = nullptr;
  std::optional<SessionShape> shape;
  absl::Duration ttl;
  int64_t max_tokens = 0;
  int64_t length = 0;  // tokens committed
  SessionKeyRange keys;  // the model's sliding window and chunk; 0 = none
  // One pool block per block_tokens tokens: K part, then V part. The first
  // `released` are null: freed, before every later query's visible keys.
  std::vector<void*> k_blocks, v_blocks;
  size_t released = 0;
  int64_t block_bytes = 0;
  bool busy = false;     // a request bound and not yet Finished
  bool closing = false;  // closed while busy: freed at Finished
  Gone close_reason = Gone::kClosed;  // when closing
  std::deque<std::unique_ptr<InferenceRequest>> queued;
  absl::Time expires = absl::InfiniteFuture();
  std::list<Session*>::iterator lru_it;
};

SessionManager::SessionManager(SessionOptions options, Clock* clock, Metrics* metrics)
    : options_(std::move(options)),
      clock_(clock),
      metrics_(metrics),
      epoch_(RandomU64()),
      epoch_hex_(absl::StrFormat("%016x", epoch_)) {}

SessionManager::~SessionManager() {
  absl::MutexLock lock(&mu_);
  for (auto& [id, s] : sessions_) {
    for (void* b : s->k_blocks) {
      if (b != nullptr) s->cache->pool.Free(b, s->block_bytes);
    }
  }
}

absl::StatusOr<SessionManager::ModelCache*> SessionManager::CacheFor(
    const std::string& model, std::shared_ptr<KvSlabMemory> memory) {
  std::unique_ptr<ModelCache>& cache = caches_[model];
  if (cache != nullptr && cache->pool.memory() != memory) {
    // The model was reloaded onto an engine whose blocks live elsewhere (a
    // GPU's memory or the host's): the old pool goes once it is empty.
    if (cache->sessions > 0) {
      return absl::UnavailableError(absl::StrCat(
          "model: '", model, "' was reloaded onto another engine and sessions of the previous "
          "one are still finishing; retry shortly"));
    }
    cache.reset();
  }
  if (cache != nullptr) cache->unloaded = false;  // loaded again
  if (cache == nullptr) {
    cache = std::make_unique<ModelCache>(model, options_.kv_cache_bytes, std::move(memory));
    if (metrics_ != nullptr) cache->metrics = metrics_->ForModel(model);
  }
  return cache.get();
}

void SessionManager::Publish(ModelCache& cache) {
  if (cache.metrics == nullptr) return;
  cache.metrics->SetSessionCache(cache.sessions, cache.pool.blocks_used(), cache.pool.blocks_free(),
                                 cache.pool.held_bytes(), cache.pool.capacity_bytes());
}

absl::StatusOr<OpenedSession> SessionManager::Open(const std::string& model,
                                                   std::optional<SessionShape> fixed,
                                                   absl::Duration ttl, int64_t max_tokens,
                                                   SessionKeyRange keys, const std::string& id,
                                                   std::shared_ptr<KvSlabMemory> memory) {
  if (!id.empty()) {
    const bool well_formed =
        id.size() >= 16 && id.size() <= 128 &&
        std::all_of(id.begin(), id.end(), [](char c) {
          return absl::ascii_isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '_' ||
                 c == '.';
        });
    if (!well_formed) {
      return absl::InvalidArgumentError(absl::StrCat(
          "session_id: a chosen id must be 16 to 128 characters of A-Z a-z 0-9 - _ . (make it "
          "random), got ", id.size(), " characters"));
    }
  }
  if (ttl < absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        absl::StrCat("ttl: must be >= 0 (0 = the server's ", absl::FormatDuration(options_.ttl),
                     "), got ", absl::FormatDuration(ttl)));
  }
  if (ttl > options_.max_ttl) {
    return absl::InvalidArgumentError(
        absl::StrCat("ttl: at most ", absl::FormatDuration(options_.max_ttl), ", got ",
                     absl::FormatDuration(ttl)));
  }
  if (max_tokens < 0 || max_tokens > options_.max_tokens) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_tokens: must be in [0, ", options_.max_tokens,
                     "] (0 = the server's limit, --session-max-tokens), got ", max_tokens));
  }
  absl::MutexLock lock(&mu_);
  SweepLocked();
  if (static_cast<int64_t>(sessions_.size()) >= options_.max_sessions) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "sessions: ", sessions_.size(), " open, the server's limit (--max-sessions); close "
        "sessions you no longer use"));
  }
  if (!id.empty() && (sessions_.contains(id) || gone_.contains(id))) {
    return absl::AlreadyExistsError(
        absl::StrCat("session_id: session '", id, "' exists or was used recently; choose another"));
  }
  absl::StatusOr<ModelCache*> cache = CacheFor(model, std::move(memory));
  if (!cache.ok()) return cache.status();
  auto s = std::make_unique<Session>();
  // "s<epoch>-<serial>-<random>": the epoch tells a restarted server's ids
  // apart, the random part makes ids hard to guess.
  s->id = !id.empty() ? id
                      : absl::StrFormat("s%s-%d-%016x", epoch_hex_, next_serial_++, RandomU64());
  s->cache = *cache;
  s->shape = fixed;
  s->ttl = ttl == absl::ZeroDuration() ? options_.ttl : ttl;
  s->max_tokens = max_tokens == 0 ? options_.max_tokens : max_tokens;
  s->keys = {std::max<int64_t>(keys.window, 0), std::max<int64_t>(keys.chunk, 0),
             std::max<int64_t>(keys.dense_up_to, 0)};
  OpenedSession opened{s->id, model, s->ttl, s->max_tokens, options_.block_tokens};
  Session* raw = s.get();
  sessions_.emplace(raw->id, std::move(s));
  ++raw->cache->sessions;
  MakeIdle(*raw);
  Publish(*raw->cache);
  return opened;
}

absl::StatusOr<SessionManager::Session*> SessionManager::Find(absl::string_view id) {
  auto it = sessions_.find(id);
  if (it != sessions_.end() && !it->second->closing) return it->second.get();
  auto gone = gone_.find(id);
  if (gone != gone_.end() || (it != sessions_.end() && it->second->closing)) {
    const GoneRecord why = gone != gone_.end()
                               ? gone->second
                               : GoneRecord{it->second->close_reason, it->second->cache->model};
    switch (why.why) {
      case Gone::kClosed:
        return absl::NotFoundError(absl::StrCat("session_id: session '", id, "' is closed"));
      case Gone::kExpired:
        return absl::NotFoundError(absl::StrCat(
            "session_id: session '", id, "' expired (idle longer than its ttl)"));
      case Gone::kEvicted:
        return absl::AbortedError(absl::StrCat(
            "session_id: session '", id, "' was evicted to free KV-cache memory; open a new "
            "session and resend the prefix"));
      case Gone::kModelReloaded:
      case Gone::kModelUnloaded:
        return ModelChangedStatus(id, why.model, why.why == Gone::kModelUnloaded);
    }
  }
  // "s<16 hex>-..." from another epoch: an earlier instance of this server.
  if (id.size() > 18 && id[0] == 's' && id[17] == '-' && id.substr(1, 16) != epoch_hex_) {
    return absl::NotFoundError(absl::StrCat(
        "session_id: unknown session '", id, "' (sessions do not survive a server restart; "
        "this server started after it was opened: open a new session and resend the prefix)"));
  }
  return absl::NotFoundError(absl::StrCat(
      "session_id: unknown session '", id, "' (never opened here, or closed or expired long ago)"));
}

absl::StatusOr<int64_t> SessionManager::Close(
    absl::string_view id, std::vector<std::unique_ptr<InferenceRequest>>* orphans) {
  absl::MutexLock lock(&mu_);
  absl::StatusOr<Session*> found = Find(id);
  if (!found.ok()) return found.status();
  Session* s = *found;
  const int64_t tokens = s->length;
  while (!s->queued.empty()) {
    orphans->push_back(std::move(s->queued.front()));
    s->queued.pop_front();
  }
  if (s->busy) {
    s->closing = true;  // Finished frees it
  } else {
    Remove(s, Gone::kClosed);
  }
  return tokens;
}

absl::Status SessionManager::ModelChangedStatus(absl::string_view session_id,
                                                absl::string_view model, bool unloaded) {
  if (unloaded) {
    return absl::AbortedError(absl::StrCat("session_id: session '", session_id,
                                           "' ended: its model '", model, "' was unloaded"));
  }
  return absl::AbortedError(absl::StrCat(
      "session_id: session '", session_id, "' ended: its model '", model,
      "' was reloaded (new weights or config); open a new session and resend the prefix"));
}

int SessionManager::CloseModel(const std::string& model, bool unloaded,
                               std::vector<std::unique_ptr<InferenceRequest>>* orphans) {
  absl::MutexLock lock(&mu_);
  auto cache = caches_.find(model);
  if (cache == caches_.end()) return 0;
  const Gone why = unloaded ? Gone::kModelUnloaded : Gone::kModelReloaded;
  std::vector<Session*> ending;
  for (auto& [id, s] : sessions_) {
    if (s->cache == cache->second.get() && !s->closing) ending.push_back(s.get());
  }
  for (Session* s : ending) {
    while (!s->queued.empty()) {
      orphans->push_back(std::move(s->queued.front()));
      s->queued.pop_front();
    }
    if (s->busy) {
      s->closing = true;  // Finished frees it
      s->close_reason = why;
    } else {
      Remove(s, why);
    }
  }
  if (unloaded) {
    cache->second->unloaded = true;
    if (cache->second->sessions == 0) DropCache(cache->second.get());
  }
  return static_cast<int>(ending.size());
}

void SessionManager::DropCache(ModelCache* cache) {
  // The gauges say what is left: nothing.
  if (cache->metrics != nullptr) cache->metrics->SetSessionCache(0, 0, 0, 0, 0);
  const std::string model = cache->model;
  caches_.erase(model);  // destroys *cache: its pool unmaps its slabs
}

SessionShape ProjectionSessionShape(const AttentionEngine& engine, const LayerConfig& layer) {
  const KvCacheGeometry g = engine.SessionCacheGeometry(layer);
  SessionShape shape;
  shape.cache_dtype = DType::kFloat32;
  shape.num_heads = layer.num_heads;
  shape.num_kv_heads = g.num_kv_heads;
  shape.head_dim = g.head_dim;
  shape.head_dim_v = g.head_dim_v;
  return shape;
}

absl::Status SessionManager::CheckShape(Session& s, const InferenceRequest& r) {
  if (r.model == nullptr || r.model->name != s.cache->model) {
    return absl::InvalidArgumentError(absl::StrCat(
        "model: session '", s.id, "' is bound to model '", s.cache->model, "', the request names '",
        r.model != nullptr ? r.model->name : "", "'"));
  }
  const TaskDims& d = r.dims;
  SessionShape got{r.task.query.dtype, DType::kFloat32, d.num_heads, d.num_kv_heads,
                   d.head_dim, d.head_dim_v};
  if (r.model->layer != nullptr && r.model->engine != nullptr &&
      r.model->layer->config.has_projections) {
    // What the model's engine caches for it (a reloaded model may differ).
    got = ProjectionSessionShape(*r.model->engine, r.model->layer->config);
    got.input_dtype = r.task.query.dtype;
  }
  if (!s.shape.has_value()) {
    got.cache_dtype = got.input_dtype;  // sdpa: K/V are stored as sent
    s.shape = got;
    s.block_bytes = options_.block_tokens * d.num_kv_heads * (d.head_dim + d.head_dim_v) *
                    static_cast<int64_t>(DTypeSize(got.cache_dtype));
    return absl::OkStatus();
  }
  SessionShape& want = *s.shape;
  if (s.block_bytes == 0) {
    // A projection model's geometry, fixed at Open; the first request fixes
    // the input dtype.
    want.input_dtype = got.input_dtype;
    s.block_bytes = options_.block_tokens * want.num_kv_heads * (want.head_dim + want.head_dim_v) *
                    static_cast<int64_t>(DTypeSize(want.cache_dtype));
  }
  if (got.input_dtype != want.input_dtype || got.num_heads != want.num_heads ||
      got.num_kv_heads != want.num_kv_heads || got.head_dim != want.head_dim ||
      got.head_dim_v != want.head_dim_v) {
    return absl::InvalidArgumentError(absl::StrCat(
        "session_id: session '", s.id, "' holds ", ShapeText(want), ", the request has ",
        ShapeText(got)));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> SessionManager::ModelOf(absl::string_view id) {
  absl::MutexLock lock(&mu_);
  SweepLocked();
  absl::StatusOr<Session*> s = Find(id);
  if (!s.ok()) return s.status();
  return (*s)->cache->model;
}

absl::Status SessionManager::Submit(std::unique_ptr<InferenceRequest>* request) {
  InferenceRequest& r = **request;
  absl::MutexLock lock(&mu_);
  SweepLocked();
  absl::StatusOr<Session*> found = Find(r.session_id);
  if (!found.ok()) return found.status();
  Session& s = **found;
  if (absl::Status st = CheckShape(s, r); !st.ok()) return st;
  if (s.busy) {
    if (static_cast<int64_t>(s.queued.size()) >= options_.max_queued_per_session) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "session_id: session '", s.id, "' already has ", s.queued.size(),
          " requests waiting behind the one in flight (the limit); wait for answers"));
    }
    s.queued.push_back(std::move(*request));
    return absl::OkStatus();
  }
  // Busy first: out of the LRU, so that making room cannot evict it.
  MakeBusy(s);
  if (absl::Status st = Bind(s, r); !st.ok()) {
    MakeIdle(s);
    return st;
  }
  return absl::OkStatus();
}

absl::Status SessionManager::Bind(Session& s, InferenceRequest& r) {
  const int64_t new_rows = r.dims.kv_len;
  const int64_t total = s.length + new_rows;
  const int64_t bt = options_.block_tokens;
  // Tokens the cache holds: those of released blocks are gone.
  const int64_t held = s.length - static_cast<int64_t>(s.released) * bt;
  if (s.keys.dense_up_to > 0 && total > s.keys.dense_up_to) {
    return absl::InvalidArgumentError(absl::StrCat(
        "session_id: session '", s.id, "' holds ", s.length, " tokens; ", new_rows,
        " more would pass its model's sparse_index_topk = ", s.keys.dense_up_to,
        " (DeepSeek's sparse attention: past it the indexer keeps each query's top ",
        s.keys.dense_up_to, " keys, which attnserve does not compute)"));
  }
  if (held + new_rows > s.max_tokens) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "session_id: session '", s.id, "' holds ", held, " tokens; ", new_rows,
        " more would exceed its limit of ", s.max_tokens,
        " (OpenSession max_tokens, --session-max-tokens)"));
  }
  const size_t needed = static_cast<size_t>((total + bt - 1) / bt);
  ModelCache& cache = *s.cache;
  if (static_cast<int64_t>(needed - s.released) * s.block_bytes > cache.pool.capacity_bytes()) {
    // Refused before evicting anyone for it.
    return absl::ResourceExhaustedError(absl::StrCat(
        "session_id: session '", s.id, "' would hold ", held + new_rows, " tokens in ",
        needed - s.released, " blocks of ", s.block_bytes,
        " bytes, more than the whole KV cache of model '", cache.model, "' (",
        cache.pool.capacity_bytes(), " bytes, --kv-cache-bytes)"));
  }
  while (s.k_blocks.size() < needed) {
    void* block = cache.pool.Allocate(s.block_bytes);
    if (block == nullptr) {
      SweepLocked();
      block = cache.pool.Allocate(s.block_bytes);
    }
    // Evict least recently used idle sessions until the block fits.
    while (block == nullptr && !cache.lru.empty()) {
      Session* victim = cache.lru.front();
      ++cache.counters.evictions;
      if (cache.metrics != nullptr) cache.metrics->SessionEvicted();
      Remove(victim, Gone::kEvicted);
      block = cache.pool.Allocate(s.block_bytes);
    }
    if (block == nullptr) {
      Trim(s, s.length);
      Publish(cache);
      return absl::ResourceExhaustedError(absl::StrCat(
          "session_id: the KV cache of model '", cache.model, "' is full (",
          cache.pool.capacity_bytes(), " bytes, --kv-cache-bytes) with sessions that have "
          "requests in flight; retry later"));
    }
    s.k_blocks.push_back(block);
    s.v_blocks.push_back(static_cast<char*>(block) +
                         bt * s.shape->num_kv_heads * s.shape->head_dim *
                             static_cast<int64_t>(DTypeSize(s.shape->cache_dtype)));
  }
  PagedKv& p = r.task.paged;
  p.dtype = s.shape->cache_dtype;
  p.num_kv_heads = s.shape->num_kv_heads;
  p.head_dim = s.shape->head_dim;
  p.head_dim_v = s.shape->head_dim_v;
  p.block_tokens = bt;
  p.cached_len = s.length;
  p.k_blocks = absl::MakeConstSpan(s.k_blocks);
  p.v_blocks = absl::MakeConstSpan(s.v_blocks);
  r.session_length = total;
  Publish(cache);
  return absl::OkStatus();
}

void SessionManager::Trim(Session& s, int64_t tokens) {
  const int64_t bt = options_.block_tokens;
  const size_t keep = static_cast<size_t>((tokens + bt - 1) / bt);
  while (s.k_blocks.size() > keep) {
    if (s.k_blocks.back() != nullptr) s.cache->pool.Free(s.k_blocks.back(), s.block_bytes);
    s.k_blocks.pop_back();
    s.v_blocks.pop_back();
  }
  s.released = std::min(s.released, s.k_blocks.size());
}

void SessionManager::ReleaseOutsideWindow(Session& s) {
  if (s.keys.window <= 0 && s.keys.chunk <= 0) return;
  // The next query sits at position `length`: it and every later one see no
  // key before FirstWindowKey(length, window, chunk).
  const size_t dead = static_cast<size_t>(
      FirstWindowKey(s.length, s.keys.window, s.keys.chunk) / options_.block_tokens);
  for (; s.released < std::min(dead, s.k_blocks.size()); ++s.released) {
    s.cache->pool.Free(s.k_blocks[s.released], s.block_bytes);
    s.k_blocks[s.released] = nullptr;
    s.v_blocks[s.released] = nullptr;
  }
}

void SessionManager::MakeIdle(Session& s) {
  s.busy = false;
  s.expires = clock_->Now() + s.ttl;
  expiry_.emplace(s.expires, &s);
  s.cache->lru.push_back(&s);
  s.lru_it = std::prev(s.cache->lru.end());
}

void SessionManager::MakeBusy(Session& s) {
  s.busy = true;
  expiry_.erase({s.expires, &s});
  s.cache->lru.erase(s.lru_it);
}

void SessionManager::Remove(Session* s, Gone why) {
  if (!s->busy) {
    expiry_.erase({s->expires, s});
    s->cache->lru.erase(s->lru_it);
  }
  Trim(*s, 0);
  ModelCache& cache = *s->cache;
  --cache.sessions;
  if (gone_order_.size() >= kGoneRemembered) {
    gone_.erase(gone_order_.front());
    gone_order_.pop_front();
  }
  gone_[s->id] = GoneRecord{why, cache.model};
  gone_order_.push_back(s->id);
  sessions_.erase(s->id);  // destroys *s
  Publish(cache);
  if (cache.unloaded && cache.sessions == 0) DropCache(&cache);
}

SessionManager::Next SessionManager::Finished(const InferenceRequest& request,
                                              const absl::Status& status) {
  Next next;
  absl::MutexLock lock(&mu_);
  auto it = sessions_.find(request.session_id);
  if (it == sessions_.end()) return next;
  Session& s = *it->second;
  ModelCache& cache = *s.cache;
  if (status.ok()) {
    s.length = request.session_length;
    ReleaseOutsideWindow(s);
    ++cache.counters.appends;
    if (cache.metrics != nullptr) cache.metrics->SessionAppended();
  } else {
    Trim(s, s.length);  // the rows were not committed
  }
  if (s.closing) {
    Remove(&s, s.close_reason);
    return next;
  }
  while (!s.queued.empty()) {
    std::unique_ptr<InferenceRequest> r = std::move(s.queued.front());
    s.queued.pop_front();
    if (absl::Status st = Bind(s, *r); !st.ok()) {
      next.failed.emplace_back(std::move(r), std::move(st));
      continue;
    }
    next.bound = std::move(r);
    return next;  // still busy
  }
  MakeIdle(s);
  Publish(cache);
  return next;
}

void SessionManager::Sweep() {
  absl::MutexLock lock(&mu_);
  SweepLocked();
}

void SessionManager::SweepLocked() {
  const absl::Time now = clock_->Now();
  while (!expiry_.empty() && expiry_.begin()->first <= now) {
    Session* s = expiry_.begin()->second;
    ++s->cache->counters.expiries;
    if (s->cache->metrics != nullptr) s->cache->metrics->SessionExpired();
    Remove(s, Gone::kExpired);
  }
}

SessionStats SessionManager::Stats(const std::string& model) const {
  absl::MutexLock lock(&mu_);
  SessionStats st;
  auto it = caches_.find(model);
  if (it == caches_.end()) return st;
  const ModelCache& c = *it->second;
  st = c.counters;
  st.sessions_open = c.sessions;
  st.blocks_used = c.pool.blocks_used();
  st.blocks_free = c.pool.blocks_free();
  st.bytes_held = c.pool.held_bytes();
  st.bytes_capacity = c.pool.capacity_bytes();
  return st;
}

}  // namespace attnserve
