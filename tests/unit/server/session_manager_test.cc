// SessionManager: ids, shape rules, the per-session FIFO,
// token limits, TTL expiry on a FakeClock, LRU eviction, and blocks returned
// on close.
#include "server/sessions/session_manager.h"

#include <algorithm>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "engine/attention_params.h"
#include "server/request/fake_clock.h"

namespace attnserve {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

// sdpa, fp32, Hkv=2, Dk=Dv=8, 16-token blocks: 16 * 2 * 16 * 4 = 2048 bytes.
constexpr int64_t kBlockBytes = 2048;

std::shared_ptr<const ServedModel> Model(const std::string& name) {
  auto m = std::make_shared<ServedModel>();
  m->name = name;
  m->state = ModelState::kReady;
  return m;
}

class SessionManagerTest : public ::testing::Test {
 protected:
  SessionOptions Options(int64_t blocks = 8) {
    SessionOptions o;
    o.kv_cache_bytes = blocks * kBlockBytes;
    o.block_tokens = 16;
    o.ttl = absl::Seconds(10);
    o.max_tokens = 1000;
    o.max_queued_per_session = 2;
    return o;
  }

  std::unique_ptr<InferenceRequest> Request(const std::string& sid, int64_t new_rows,
                                            int64_t hq = 4, DType dtype = DType::kFloat32) {
    auto r = std::make_unique<InferenceRequest>();
    r->session_id = sid;
    r->model = sdpa_;
    r->task.query.dtype = dtype;
    r->dims = {1, 1, new_rows, hq, 2, 8, 8};
    return r;
  }

  std::string Open(SessionManager& m, absl::Duration ttl = absl::ZeroDuration(),
                   int64_t max_tokens = 0) {
    absl::StatusOr<OpenedSession> s = m.Open("sdpa", std::nullopt, ttl, max_tokens);
    EXPECT_TRUE(s.ok()) << s.status();
    return s.ok() ? s->id : "";
  }

  // Submits, expects it bound, and finishes it with `status`.
  void Run(SessionManager& m, const std::string& sid, int64_t rows,
           absl::Status status = absl::OkStatus()) {
    std::unique_ptr<InferenceRequest> r = Request(sid, rows);
    ASSERT_TRUE(m.Submit(&r).ok());
    ASSERT_NE(r, nullptr);
    SessionManager::Next next = m.Finished(*r, status);
    EXPECT_EQ(next.bound, nullptr);
  }

  FakeClock clock_;
  std::shared_ptr<const ServedModel> sdpa_ = Model("sdpa");
};

TEST_F(SessionManagerTest, BindsBlocksAndCommitsOnSuccessOnly) {
  SessionManager m(Options(), &clock_, nullptr);
  const std::string sid = Open(m);
  std::unique_ptr<InferenceRequest> r = Request(sid, 20);
  ASSERT_TRUE(m.Submit(&r).ok());
  ASSERT_NE(r, nullptr);
  EXPECT_TRUE(r->task.paged.enabled());
  EXPECT_EQ(r->task.paged.cached_len, 0);
  EXPECT_EQ(r->task.paged.k_blocks.size(), 2u);  // 20 tokens, 16 a block
  EXPECT_EQ(static_cast<char*>(r->task.paged.v_blocks[0]) -
                static_cast<char*>(r->task.paged.k_blocks[0]),
            16 * 2 * 8 * 4);
  EXPECT_EQ(r->session_length, 20);
  m.Finished(*r, absl::OkStatus());
  EXPECT_EQ(m.Stats("sdpa").blocks_used, 2);
  EXPECT_EQ(m.Stats("sdpa").appends, 1);

  // A failed request leaves the length (and frees the blocks it took).
  r = Request(sid, 20);
  ASSERT_TRUE(m.Submit(&r).ok());
  EXPECT_EQ(r->task.paged.cached_len, 20);
  EXPECT_EQ(m.Stats("sdpa").blocks_used, 3);
  m.Finished(*r, absl::DeadlineExceededError("late"));
  EXPECT_EQ(m.Stats("sdpa").blocks_used, 2);
  r = Request(sid, 1);
  ASSERT_TRUE(m.Submit(&r).ok());
  EXPECT_EQ(r->task.paged.cached_len, 20);
  EXPECT_EQ(r->session_length, 21);
  m.Finished(*r, absl::OkStatus());
}

TEST_F(SessionManagerTest, ShapeAndModelMustMatchTheFirstRequest) {
  SessionManager m(Options(), &clock_, nullptr);
  const std::string sid = Open(m);
  Run(m, sid, 3);
  std::unique_ptr<InferenceRequest> r = Request(sid, 1, /*hq=*/2);
  absl::Status s = m.Submit(&r);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("Hq=4"));
  EXPECT_NE(r, nullptr);  // still the caller's
  r = Request(sid, 1, 4, DType::kFloat16);
  EXPECT_EQ(m.Submit(&r).code(), absl::StatusCode::kInvalidArgument);
  r = Request(sid, 1);
  r->model = Model("other");
  s = m.Submit(&r);
  EXPECT_THAT(s.message(), HasSubstr("bound to model 'sdpa'"));
}

TEST_F(SessionManagerTest, RequestsOfOneSessionRunOneAtATimeInArrivalOrder) {
  SessionManager m(Options(), &clock_, nullptr);
  const std::string sid = Open(m);
  std::unique_ptr<InferenceRequest> first = Request(sid, 1);
  ASSERT_TRUE(m.Submit(&first).ok());
  ASSERT_NE(first, nullptr);
  std::unique_ptr<InferenceRequest> second = Request(sid, 2), third = Request(sid, 3);
  second->id = "second";
  third->id = "third";
  ASSERT_TRUE(m.Submit(&second).ok());
  ASSERT_TRUE(m.Submit(&third).ok());
  EXPECT_EQ(second, nullptr);  // queued
  EXPECT_EQ(third, nullptr);
  std::unique_ptr<InferenceRequest> fourth = Request(sid, 1);
  EXPECT_EQ(m.Submit(&fourth).code(), absl::StatusCode::kResourceExhausted);  // queue limit 2

  SessionManager::Next next = m.Finished(*first, absl::OkStatus());
  ASSERT_NE(next.bound, nullptr);
  EXPECT_EQ(next.bound->id, "second");
  EXPECT_EQ(next.bound->task.paged.cached_len, 1);
  next = m.Finished(*next.bound, absl::OkStatus());
  ASSERT_NE(next.bound, nullptr);
  EXPECT_EQ(next.bound->id, "third");
  EXPECT_EQ(next.bound->task.paged.cached_len, 3);
  EXPECT_EQ(next.bound->session_length, 6);
  next = m.Finished(*next.bound, absl::OkStatus());
  EXPECT_EQ(next.bound, nullptr);
  EXPECT_TRUE(next.failed.empty());
}

TEST_F(SessionManagerTest, TokenLimit) {
  SessionManager m(Options(), &clock_, nullptr);
  const std::string sid = Open(m, absl::ZeroDuration(), /*max_tokens=*/10);
  Run(m, sid, 8);
  std::unique_ptr<InferenceRequest> r = Request(sid, 3);
  absl::Status s = m.Submit(&r);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(s.message(), HasSubstr("limit of 10"));
  Run(m, sid, 2);  // exactly at the limit
  EXPECT_EQ(m.Open("sdpa", std::nullopt, absl::ZeroDuration(), 1001).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// A DSA model's sessions (SessionKeyRange::dense_up_to, sparse_index_topk)
// hold at most that many tokens in all, whatever their max_tokens; the
// refusal names the rule, and the session stays usable below it.
TEST_F(SessionManagerTest, DenseUpToLimitsTheWholeLength) {
  SessionManager m(Options(), &clock_, nullptr);
  absl::StatusOr<OpenedSession> opened = m.Open("sdpa", std::nullopt, absl::ZeroDuration(), 0,
                                                SessionKeyRange{.dense_up_to = 20});
  ASSERT_TRUE(opened.ok()) << opened.status();
  Run(m, opened->id, 15);
  std::unique_ptr<InferenceRequest> r = Request(opened->id, 6);
  absl::Status s = m.Submit(&r);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), AllOf(HasSubstr("holds 15 tokens; 6 more"),
                                 HasSubstr("sparse_index_topk = 20")));
  Run(m, opened->id, 5);  // exactly at the limit
}

TEST_F(SessionManagerTest, IdleSessionsExpireAfterTheirTtl) {
  SessionManager m(Options(), &clock_, nullptr);
  const std::string short_lived = Open(m);  // 10 s
  const std::string long_lived = Open(m, absl::Seconds(60));
  Run(m, short_lived, 17);
  EXPECT_EQ(m.Stats("sdpa").blocks_used, 2);
  clock_.Advance(absl::Seconds(9));
  Run(m, short_lived, 1);  // use restarts the TTL
  clock_.Advance(absl::Seconds(9));
  m.Sweep();
  EXPECT_EQ(m.Stats("sdpa").sessions_open, 2);
  clock_.Advance(absl::Seconds(2));
  m.Sweep();
  EXPECT_EQ(m.Stats("sdpa").sessions_open, 1);
  EXPECT_EQ(m.Stats("sdpa").expiries, 1);
  EXPECT_EQ(m.Stats("sdpa").blocks_used, 0);
  EXPECT_EQ(m.Stats("sdpa").blocks_free, 2);  // back on the free list
  std::unique_ptr<InferenceRequest> r = Request(short_lived, 1);
  absl::Status s = m.Submit(&r);
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(s.message(), HasSubstr("expired"));
  EXPECT_THAT(s.message(), HasSubstr(short_lived));
  Run(m, long_lived, 1);
}

TEST_F(SessionManagerTest, BusySessionsDoNotExpire) {
  SessionManager m(Options(), &clock_, nullptr);
  const std::string sid = Open(m);
  std::unique_ptr<InferenceRequest> r = Request(sid, 1);
  ASSERT_TRUE(m.Submit(&r).ok());
  clock_.Advance(absl::Minutes(5));
  m.Sweep();
  EXPECT_EQ(m.Stats("sdpa").sessions_open, 1);
  m.Finished(*r, absl::OkStatus());
  EXPECT_EQ(m.Stats("sdpa").sessions_open, 1);  // idle from now on
}

TEST_F(SessionManagerTest, FullCacheEvictsTheLeastRecentlyUsedIdleSession) {
  SessionManager m(Options(/*blocks=*/3), &clock_, nullptr);
  const std::string a = Open(m), b = Open(m), c = Open(m);
  Run(m, a, 16);
  Run(m, b, 16);
  Run(m, c, 16);
  Run(m, a, 1);  // a: 2 blocks; evicts b (least recently used), not c
  EXPECT_EQ(m.Stats("sdpa").evictions, 1);
  std::unique_ptr<InferenceRequest> r = Request(b, 1);
  absl::Status s = m.Submit(&r);
  EXPECT_EQ(s.code(), absl::StatusCode::kAborted);
  EXPECT_THAT(s.message(), HasSubstr("resend the prefix"));
  Run(m, c, 1);  // c is intact; needs a block: evicts a

  // Sessions with a request in flight are never evicted: the cache is full
  // of them and the newcomer is refused.
  const std::string d = Open(m), e = Open(m);
  std::unique_ptr<InferenceRequest> rc = Request(c, 1);
  ASSERT_TRUE(m.Submit(&rc).ok());  // c: 18 tokens, its 2 blocks
  std::unique_ptr<InferenceRequest> rd = Request(d, 16);
  ASSERT_TRUE(m.Submit(&rd).ok());  // evicts nothing: one block is free
  const int64_t evicted = m.Stats("sdpa").evictions;
  std::unique_ptr<InferenceRequest> re = Request(e, 16);
  s = m.Submit(&re);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_THAT(s.message(), HasSubstr("requests in flight"));
  EXPECT_EQ(m.Stats("sdpa").evictions, evicted);
  m.Finished(*rc, absl::OkStatus());
  m.Finished(*rd, absl::OkStatus());
  // A session that alone needs more than the whole cache: refused, nothing
  // evicted for it.
  const int64_t evictions = m.Stats("sdpa").evictions;
  re = Request(e, 16 * 3 + 1);
  s = m.Submit(&re);
  EXPECT_THAT(s.message(), HasSubstr("more than the whole KV cache"));
  EXPECT_EQ(m.Stats("sdpa").evictions, evictions);
}

TEST_F(SessionManagerTest, ModelReloadEndsItsSessionsAndUnloadReturnsTheCache) {
  SessionManager m(Options(), &clock_, nullptr);
  const std::string idle = Open(m), busy = Open(m);
  Run(m, idle, 20);
  std::unique_ptr<InferenceRequest> in_flight = Request(busy, 3);
  ASSERT_TRUE(m.Submit(&in_flight).ok());
  ASSERT_NE(in_flight, nullptr);
  std::unique_ptr<InferenceRequest> queued = Request(busy, 1);
  ASSERT_TRUE(m.Submit(&queued).ok());
  ASSERT_EQ(queued, nullptr);

  std::vector<std::unique_ptr<InferenceRequest>> orphans;
  EXPECT_EQ(m.CloseModel("sdpa", /*unloaded=*/false, &orphans), 2);
  ASSERT_EQ(orphans.size(), 1u);  // the queued one, for the caller to answer
  std::unique_ptr<InferenceRequest> r = Request(idle, 1);
  absl::Status s = m.Submit(&r);
  EXPECT_EQ(s.code(), absl::StatusCode::kAborted);
  EXPECT_THAT(s.message(), HasSubstr("its model 'sdpa' was reloaded"));
  // The request in flight finishes; its session is then gone, for the same reason.
  SessionManager::Next next = m.Finished(*in_flight, absl::OkStatus());
  EXPECT_EQ(next.bound, nullptr);
  r = Request(busy, 1);
  EXPECT_THAT(m.Submit(&r).message(), HasSubstr("was reloaded"));
  EXPECT_EQ(m.Stats("sdpa").sessions_open, 0);
  EXPECT_EQ(m.Stats("sdpa").blocks_used, 0);
  EXPECT_GT(m.Stats("sdpa").bytes_held, 0);  // a reload keeps the pool for the new version

  // An unload returns the pool itself once its last session is freed.
  const std::string again = Open(m);
  Run(m, again, 5);
  EXPECT_EQ(m.CloseModel("sdpa", /*unloaded=*/true, &orphans), 1);
  r = Request(again, 1);
  EXPECT_THAT(m.Submit(&r).message(), HasSubstr("its model 'sdpa' was unloaded"));
  EXPECT_EQ(m.Stats("sdpa").bytes_held, 0);
  EXPECT_EQ(m.Stats("sdpa").bytes_capacity, 0);  // no cache at all
  EXPECT_EQ(m.CloseModel("sdpa", true, &orphans), 0);
}

TEST_F(SessionManagerTest, CloseReturnsBlocksAndAnswersQueuedRequests) {
  SessionManager m(Options(), &clock_, nullptr);
  const std::string sid = Open(m);
  Run(m, sid, 40);
  EXPECT_EQ(m.Stats("sdpa").blocks_used, 3);
  std::vector<std::unique_ptr<InferenceRequest>> orphans;
  absl::StatusOr<int64_t> released = m.Close(sid, &orphans);
  ASSERT_TRUE(released.ok());
  EXPECT_EQ(*released, 40);
  EXPECT_EQ(m.Stats("sdpa").blocks_used, 0);
  EXPECT_EQ(m.Stats("sdpa").blocks_free, 3);
  EXPECT_EQ(m.Stats("sdpa").sessions_open, 0);
  EXPECT_EQ(m.Close(sid, &orphans).status().code(), absl::StatusCode::kNotFound);

  // Closed while busy: queued requests come back, blocks are freed when the
  // request in flight finishes.
  const std::string busy = Open(m);
  std::unique_ptr<InferenceRequest> r = Request(busy, 20), queued = Request(busy, 1);
  ASSERT_TRUE(m.Submit(&r).ok());
  ASSERT_TRUE(m.Submit(&queued).ok());
  ASSERT_TRUE(m.Close(busy, &orphans).ok());
  EXPECT_EQ(orphans.size(), 1u);
  EXPECT_EQ(m.Stats("sdpa").blocks_used, 2);
  SessionManager::Next next = m.Finished(*r, absl::OkStatus());
  EXPECT_EQ(next.bound, nullptr);
  EXPECT_EQ(m.Stats("sdpa").blocks_used, 0);
  std::unique_ptr<InferenceRequest> late = Request(busy, 1);
  EXPECT_THAT(m.Submit(&late).message(), HasSubstr("closed"));
}

TEST_F(SessionManagerTest, IdsOfAnotherInstanceSayTheServerRestarted) {
  SessionManager first(Options(), &clock_, nullptr), second(Options(), &clock_, nullptr);
  const std::string sid = Open(first);
  std::unique_ptr<InferenceRequest> r = Request(sid, 1);
  absl::Status s = second.Submit(&r);
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(s.message(), HasSubstr("do not survive a server restart"));
  r = Request("made-up", 1);
  s = second.Submit(&r);
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(s.message(), HasSubstr("unknown session 'made-up'"));
}

TEST_F(SessionManagerTest, SessionLimit) {
  SessionOptions o = Options();
  o.max_sessions = 1;
  SessionManager m(o, &clock_, nullptr);
  Open(m);
  EXPECT_EQ(m.Open("sdpa", std::nullopt, absl::ZeroDuration(), 0).status().code(),
            absl::StatusCode::kResourceExhausted);
}

// A sliding-window session releases the blocks wholly before the first key
// any later query's window reaches (FirstWindowKey: 256-token aligned), so
// it holds about window + 256 tokens plus a block however long it grows; the
// token limit counts what it holds; closing frees the rest.
TEST_F(SessionManagerTest, SlidingWindowSessionsReleaseBlocksOutsideTheWindow) {
  SessionOptions o = Options(/*blocks=*/64);
  o.max_tokens = 600;
  SessionManager m(o, &clock_, nullptr);
  absl::StatusOr<OpenedSession> opened =
      m.Open("sdpa", std::nullopt, absl::ZeroDuration(), 0, SessionKeyRange{.window = 100});
  ASSERT_TRUE(opened.ok()) << opened.status();
  const std::string sid = opened->id;
  Run(m, sid, 300);  // prefill: every block still needed by the next query
  EXPECT_EQ(m.Stats("sdpa").blocks_used, 19);  // ceil(300 / 16)
  int64_t most = 0;
  for (int64_t len = 300; len < 2000; ++len) {
    std::unique_ptr<InferenceRequest> r = Request(sid, 1);
    ASSERT_TRUE(m.Submit(&r).ok()) << "at length " << len;  // past max_tokens = 600
    const PagedKv& p = r->task.paged;
    // The blocks the next query's window reaches are all there.
    const int64_t first = FirstWindowKey(len, 100, 0) / 16;
    for (int64_t b = 0; b < static_cast<int64_t>(p.k_blocks.size()); ++b) {
      EXPECT_EQ(p.k_blocks[b] == nullptr, b < first) << "block " << b << " at length " << len;
    }
    m.Finished(*r, absl::OkStatus());
    most = std::max(most, m.Stats("sdpa").blocks_used);
  }
  // window 100 + the 256-token grain + a partial block at each end.
  EXPECT_LE(most, (100 + 256) / 16 + 2);
  EXPECT_GE(most, 100 / 16);
  std::vector<std::unique_ptr<InferenceRequest>> orphans;
  absl::StatusOr<int64_t> released = m.Close(sid, &orphans);
  ASSERT_TRUE(released.ok());
  EXPECT_EQ(*released, 2000);
  EXPECT_EQ(m.Stats("sdpa").blocks_used, 0);
}

// A chunked-attention session (Llama 4) releases the blocks before its
// current chunk's grain-aligned start: with chunks of 300, it holds at most
// one chunk + the 256-token grain + a block, whatever its length.
TEST_F(SessionManagerTest, ChunkedSessionsReleaseBlocksBeforeTheirChunk) {
  SessionOptions o = Options(/*blocks=*/64);
  o.max_tokens = 800;
  SessionManager m(o, &clock_, nullptr);
  absl::StatusOr<OpenedSession> opened =
      m.Open("sdpa", std::nullopt, absl::ZeroDuration(), 0, SessionKeyRange{.chunk = 300});
  ASSERT_TRUE(opened.ok()) << opened.status();
  const std::string sid = opened->id;
  Run(m, sid, 200);
  int64_t most = 0, released_ever = 0;
  for (int64_t len = 200; len < 1500; ++len) {
    std::unique_ptr<InferenceRequest> r = Request(sid, 1);
    ASSERT_TRUE(m.Submit(&r).ok()) << "at length " << len;  // past max_tokens = 800
    const PagedKv& p = r->task.paged;
    const int64_t first = FirstWindowKey(len, 0, 300) / 16;
    for (int64_t b = 0; b < static_cast<int64_t>(p.k_blocks.size()); ++b) {
      EXPECT_EQ(p.k_blocks[b] == nullptr, b < first) << "block " << b << " at length " << len;
    }
    released_ever = std::max(released_ever, first);
    m.Finished(*r, absl::OkStatus());
    most = std::max(most, m.Stats("sdpa").blocks_used);
  }
  EXPECT_GT(released_ever, 0);
  EXPECT_LE(most, (300 + 256) / 16 + 2);
}

// Without a window nothing is released, and the limit is on the length.
TEST_F(SessionManagerTest, SessionsWithoutAWindowKeepEveryBlock) {
  SessionManager m(Options(/*blocks=*/64), &clock_, nullptr);
  const std::string sid = Open(m, absl::ZeroDuration(), 400);
  Run(m, sid, 390);
  for (int i = 0; i < 10; ++i) Run(m, sid, 1);
  EXPECT_EQ(m.Stats("sdpa").blocks_used, 25);  // ceil(400 / 16)
  std::unique_ptr<InferenceRequest> r = Request(sid, 1);
  EXPECT_EQ(m.Submit(&r).code(), absl::StatusCode::kResourceExhausted);
}

// A client-chosen id (OpenSessionRequest.session_id): used as given, well
// formed or refused naming the rule, and never twice.
TEST_F(SessionManagerTest, ChosenIdsAreUsedOnceAndMustBeWellFormed) {
  SessionManager m(Options(), &clock_, nullptr);
  const std::string id = "c0123456789abcdef0123456789abcdef";
  absl::StatusOr<OpenedSession> s = m.Open("sdpa", std::nullopt, absl::ZeroDuration(), 0, {}, id);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->id, id);
  Run(m, id, 3);
  EXPECT_EQ(m.Open("sdpa", std::nullopt, absl::ZeroDuration(), 0, {}, id).status().code(),
            absl::StatusCode::kAlreadyExists);
  std::vector<std::unique_ptr<InferenceRequest>> orphans;
  ASSERT_TRUE(m.Close(id, &orphans).ok());
  // Closed: still taken (its next call says closed, not unknown).
  EXPECT_EQ(m.Open("sdpa", std::nullopt, absl::ZeroDuration(), 0, {}, id).status().code(),
            absl::StatusCode::kAlreadyExists);
  for (const std::string& bad :
       {std::string("short"), std::string(129, 'a'), std::string("bad id with spaces")}) {
    absl::Status st = m.Open("sdpa", std::nullopt, absl::ZeroDuration(), 0, {}, bad).status();
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_THAT(st.message(), HasSubstr("16 to 128 characters")) << bad;
  }
}

// Slabs from an engine's memory (AttentionEngine::kv_slab_memory): recorded,
// at addresses nobody may touch.
class RecordingSlabMemory final : public KvSlabMemory {
 public:
  void* Map(int64_t bytes) override {
    const uintptr_t base = next_;
    next_ += static_cast<uintptr_t>(bytes) + 4096;
    live[base] = bytes;
    return reinterpret_cast<void*>(base);
  }
  void Unmap(void* base, int64_t bytes) override {
    EXPECT_EQ(live[reinterpret_cast<uintptr_t>(base)], bytes);
    live.erase(reinterpret_cast<uintptr_t>(base));
  }
  bool Holds(const void* p) const {
    const uintptr_t a = reinterpret_cast<uintptr_t>(p);
    auto it = live.upper_bound(a);
    if (it == live.begin()) return false;
    --it;
    return a < it->first + static_cast<uintptr_t>(it->second);
  }
  std::map<uintptr_t, int64_t> live;

 private:
  uintptr_t next_ = uintptr_t{0x7e0000000000};
};

TEST_F(SessionManagerTest, BlocksLiveInTheEnginesMemory) {
  auto memory = std::make_shared<RecordingSlabMemory>();
  {
    SessionManager m(Options(), &clock_, nullptr);
    absl::StatusOr<OpenedSession> opened =
        m.Open("sdpa", std::nullopt, absl::ZeroDuration(), 0, {}, "", memory);
    ASSERT_TRUE(opened.ok()) << opened.status();
    std::unique_ptr<InferenceRequest> r = Request(opened->id, 20);
    ASSERT_TRUE(m.Submit(&r).ok());
    ASSERT_NE(r, nullptr);
    EXPECT_EQ(memory->live.size(), 1u);
    for (void* b : r->task.paged.k_blocks) EXPECT_TRUE(memory->Holds(b));
    for (void* b : r->task.paged.v_blocks) EXPECT_TRUE(memory->Holds(b));
    m.Finished(*r, absl::OkStatus());
    EXPECT_EQ(m.Stats("sdpa").blocks_used, 2);

    // Another memory for the same model (a reload onto another backend):
    // refused while a session of the old one is open, a new pool after.
    auto other = std::make_shared<RecordingSlabMemory>();
    EXPECT_EQ(m.Open("sdpa", std::nullopt, absl::ZeroDuration(), 0, {}, "", other).status().code(),
              absl::StatusCode::kUnavailable);
    std::vector<std::unique_ptr<InferenceRequest>> orphans;
    ASSERT_TRUE(m.Close(opened->id, &orphans).ok());
    opened = m.Open("sdpa", std::nullopt, absl::ZeroDuration(), 0, {}, "", other);
    ASSERT_TRUE(opened.ok()) << opened.status();
    EXPECT_TRUE(memory->live.empty()) << "the old pool returned its slabs";
    r = Request(opened->id, 1);
    ASSERT_TRUE(m.Submit(&r).ok());
    EXPECT_TRUE(other->Holds(r->task.paged.k_blocks[0]));
    m.Finished(*r, absl::OkStatus());
  }
  EXPECT_TRUE(memory->live.empty());
}

}  // namespace
}  // namespace attnserve
