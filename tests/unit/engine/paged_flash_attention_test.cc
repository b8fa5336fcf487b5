// Paged K/V in the fused CPU kernel (AttentionParams::k_blocks read by
// engine/cpu/flash_attention.h): a session's K/V scattered over cache blocks
// taken in scrambled order from one pool, whose unused slots and block tails
// hold NaN (so a read outside the session's keys shows), against
//  - the same request with the same K/V contiguous: bitwise equal, every
//    variant this CPU runs (the kernel reads the same values through the
//    same 256-key blocks, see engine/cpu/flash_kernel/driver.h);
//  - the reference engine (float64) on the contiguous tensors: relative
//    error 1e-5 for the fp32 variants (+1e-3 for an FLOAT16 output), 1e-2
//    for the bf16 ones on BFLOAT16 inputs (other inputs are rounded by them);
//  - itself alone, inside a span of many sessions and with 1..3 threads:
//    bitwise equal (batch and thread-count invariance).
// Covers fp32/fp16/bf16, GQA, causal bottom-right, Lq = 1 and > 1, lengths
// not a multiple of the block, block_tokens 16, 32, 48, 256 and 512 (one
// block longer than the keys), odd head dims, key_lengths and weights.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <numeric>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "engine/attention_engine.h"
#include "engine/attention_layer.h"
#include "engine/cpu/cpu_features.h"
#include "engine/cpu/flash_attention.h"
#include "engine/reference/reference_engine.h"
#include "engine/tensor.h"
#include "gtest/gtest.h"
#include "tests/unit/engine/test_rng.h"

namespace attnserve::cpu {
namespace {

using testutil::Rng;

// Cache blocks of one model: `slots` blocks of `slot_bytes`, NaN-filled
// (0xFF bytes are NaN in FLOAT32, FLOAT16 and BFLOAT16), handed out in a
// scrambled order.
class BlockPool {
 public:
  BlockPool(int64_t slots, int64_t slot_bytes, Rng& rng)
      : slot_bytes_(slot_bytes), bytes_(static_cast<size_t>(slots * slot_bytes), 0xFF) {
    order_.resize(static_cast<size_t>(slots));
    std::iota(order_.begin(), order_.end(), int64_t{0});
    for (size_t i = order_.size(); i > 1; --i)
      std::swap(order_[i - 1], order_[static_cast<size_t>(rng.Int(0, static_cast<int64_t>(i) - 1))]);
  }
  void* Take() {
    if (next_ >= order_.size()) return nullptr;
    return bytes_.data() + order_[next_++] * slot_bytes_;
  }

 private:
  int64_t slot_bytes_;
  std::vector<uint8_t> bytes_;
  std::vector<int64_t> order_;
  size_t next_ = 0;
};

struct Case {
  int64_t hq, hkv, d, dv, lq, lk, block_tokens;
  DType dtype;
  bool causal = false;
  bool weights = false, average = false;
  int64_t key_length = -1;  // >= 0: key_lengths = {key_length}
  DType out_dtype = DType::kFloat32;

  std::string Label() const {
    return absl::StrCat("H", hq, "/", hkv, " D", d, "/", dv, " Lq", lq, " Lk", lk, " block ",
                        block_tokens, " ", std::string(DTypeName(dtype)), causal ? " causal" : "",
                        weights ? (average ? " avg-weights" : " weights") : "",
                        key_length >= 0 ? absl::StrCat(" key_length ", key_length) : "",
                        " out ", std::string(DTypeName(out_dtype)));
  }
};

// One session: contiguous Q/K/V tensors, the same K/V copied into pool
// blocks, and the outputs of both layouts.
struct Session {
  Case c;
  Tensor q, k, v;
  std::vector<const void*> k_blocks, v_blocks;
  std::vector<int64_t> key_lengths;
  std::vector<uint8_t> out_contiguous, out_paged, w_contiguous, w_paged;
  std::unique_ptr<BlockPool> own_pool;  // when not paged into a shared one

  explicit Session(const Case& cs, Rng& rng) : c(cs) {
    q = Tensor(c.dtype, {1, c.hq, c.lq, c.d});
    k = Tensor(c.dtype, {1, c.hkv, c.lk, c.d});
    v = Tensor(c.dtype, {1, c.hkv, c.lk, c.dv});
    const float qamp = rng.Chance(0.3) ? 3.0f : 1.0f;  // large logits sometimes
    for (Tensor* t : {&q, &k, &v}) {
      const float amp = t == &q ? qamp : 1.0f;
      for (int64_t i = 0; i < t->num_elements(); ++i) StoreFromFloat(c.dtype, t->data(), i, amp * rng.Normal());
    }
    if (c.key_length >= 0) key_lengths = {c.key_length};
    const size_t out_bytes = static_cast<size_t>(c.hq * c.lq * c.dv) * DTypeSize(c.out_dtype);
    out_contiguous.assign(out_bytes, 0xEE);
    out_paged.assign(out_bytes, 0xEE);
    if (c.weights) {
      const size_t w = static_cast<size_t>((c.average ? 1 : c.hq) * c.lq * c.lk) * 4;
      w_contiguous.assign(w, 0xEE);
      w_paged.assign(w, 0xEE);
    }
  }

  int64_t BlockBytes(int64_t dim) const {
    return c.hkv * c.block_tokens * dim * static_cast<int64_t>(DTypeSize(c.dtype));
  }

  // Copies K and V into blocks from `pool` (layout [Hkv][block_tokens][D]).
  void Page(BlockPool& pool) {
    const int64_t bt = c.block_tokens, es = static_cast<int64_t>(DTypeSize(c.dtype));
    const int64_t blocks = (c.lk + bt - 1) / bt;
    for (int64_t blk = 0; blk < blocks; ++blk) {
      void* kb = pool.Take();
      void* vb = pool.Take();
      ASSERT_NE(kb, nullptr);
      ASSERT_NE(vb, nullptr);
      k_blocks.push_back(kb);
      v_blocks.push_back(vb);
      for (int64_t h = 0; h < c.hkv; ++h)
        for (int64_t t = 0; t < bt && blk * bt + t < c.lk; ++t) {
          const int64_t j = blk * bt + t;
          std::memcpy(static_cast<char*>(kb) + (h * bt + t) * c.d * es,
                      static_cast<const char*>(k.data()) + (h * c.lk + j) * c.d * es,
                      static_cast<size_t>(c.d * es));
          std::memcpy(static_cast<char*>(vb) + (h * bt + t) * c.dv * es,
                      static_cast<const char*>(v.data()) + (h * c.lk + j) * c.dv * es,
                      static_cast<size_t>(c.dv * es));
        }
    }
  }

  AttentionParams Base() const {
    AttentionParams p;
    p.batch = 1;
    p.num_heads = c.hq;
    p.num_kv_heads = c.hkv;
    p.head_dim = c.d;
    p.head_dim_v = c.dv;
    p.q_len = c.lq;
    p.kv_len = c.lk;
    p.dtype = c.dtype;
    p.out_dtype = c.out_dtype;
    SetContiguousStrides(&p, HeadLayoutStrides);
    p.q = q.data();
    p.causal = c.causal;
    p.scale = 1.0f / std::sqrt(static_cast<float>(c.d));
    if (!key_lengths.empty()) p.key_lengths = key_lengths.data();
    p.average_weights = c.average;
    return p;
  }
  AttentionParams Contiguous() {
    AttentionParams p = Base();
    p.k = k.data();
    p.v = v.data();
    p.out = out_contiguous.data();
    if (c.weights) p.weights = w_contiguous.data();
    return p;
  }
  AttentionParams Paged() {
    AttentionParams p = Base();
    p.k_blocks = k_blocks.data();
    p.v_blocks = v_blocks.data();
    p.block_tokens = c.block_tokens;
    p.out = out_paged.data();
    if (c.weights) p.weights = w_paged.data();
    return p;
  }
};

// A session paged into a pool of its own, with a few spare NaN slots so the
// scrambled order leaves gaps.
std::unique_ptr<Session> MakeSession(const Case& c, Rng& rng) {
  auto s = std::make_unique<Session>(c, rng);
  const int64_t blocks = (c.lk + c.block_tokens - 1) / c.block_tokens;
  s->own_pool = std::make_unique<BlockPool>(2 * blocks + 5, std::max(s->BlockBytes(c.d), s->BlockBytes(c.dv)), rng);
  s->Page(*s->own_pool);
  return s;
}

// Output (or weights) as floats.
std::vector<float> Floats(const std::vector<uint8_t>& bytes, DType dt) {
  std::vector<float> f(bytes.size() / DTypeSize(dt));
  ConvertToFloat(dt, bytes.data(), static_cast<int64_t>(f.size()), f.data());
  return f;
}

// max |got - ref| / max |ref|, NaN -> infinity.
double RelativeError(const std::vector<float>& got, const std::vector<float>& ref) {
  double max_ref = 0, max_diff = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (std::isnan(got[i])) return INFINITY;
    max_ref = std::max(max_ref, std::fabs(static_cast<double>(ref[i])));
    max_diff = std::max(max_diff, std::fabs(static_cast<double>(got[i]) - ref[i]));
  }
  return max_diff / std::max(max_ref, 1e-30);
}

// The reference engine on the contiguous tensors: output (and weights) as
// floats.
void Reference(const Session& s, std::vector<float>* out, std::vector<float>* weights) {
  const Case& c = s.c;
  AttentionLayer sdpa;
  sdpa.config.name = "sdpa";
  Tensor o(DType::kFloat32, {1, c.hq, c.lq, c.dv});
  Tensor w;
  AttentionTask task;
  task.query = s.q.view();
  task.key = s.k.view();
  task.value = s.v.view();
  task.causal = c.causal;
  task.scale = 1.0f / std::sqrt(static_cast<float>(c.d));
  task.key_lengths = s.key_lengths;
  task.output = o.mutable_view();
  if (c.weights) {
    w = Tensor(DType::kFloat32, c.average ? Shape{1, c.lq, c.lk} : Shape{1, c.hq, c.lq, c.lk});
    task.weights = w.mutable_view();
    task.average_weights = c.average;
  }
  const absl::Status st = NewReferenceEngine()->Run(sdpa, {&task, 1});
  ASSERT_TRUE(st.ok()) << st;
  out->assign(o.data_as<float>(), o.data_as<float>() + o.num_elements());
  if (c.weights) weights->assign(w.data_as<float>(), w.data_as<float>() + w.num_elements());
}

const std::vector<Case>& Cases() {
  using D = DType;
  static const std::vector<Case> cases = {
      // Decode (Lq 1, <= 4 rows per kv head: K/V read in place, keys split
      // into 512-key chunks), GQA, 16-token blocks.
      {8, 2, 64, 64, 1, 1000, 16, D::kFloat32, true},
      {8, 2, 64, 64, 1, 1000, 16, D::kFloat16, true},
      {8, 2, 64, 64, 1, 1000, 16, D::kBFloat16, true},
      {4, 4, 128, 128, 1, 4096, 256, D::kFloat16, true},  // blocks = the kernel's key blocks
      {4, 4, 128, 128, 1, 700, 48, D::kFloat32, true},    // blocks straddle the key blocks
      {2, 1, 64, 64, 1, 512, 16, D::kFloat32, false},     // keys fill the last block exactly
      {2, 2, 16, 16, 1, 1, 16, D::kFloat32, false},       // one key
      // A few query rows: packed (transposed) K, split keys.
      {8, 2, 32, 32, 3, 777, 16, D::kFloat16, true},
      {2, 1, 36, 20, 2, 300, 32, D::kFloat32, true},  // dims off the vector width
      // Prefill: many rows, packed K and V, causal bottom-right.
      {4, 2, 64, 64, 200, 200, 16, D::kFloat32, true},
      {4, 2, 64, 64, 150, 600, 256, D::kBFloat16, true},
      {2, 2, 64, 64, 100, 600, 512, D::kFloat32, true},  // one block per key block: V in place
      {4, 1, 64, 48, 70, 333, 512, D::kFloat16, false},  // one block longer than the keys
      {4, 2, 64, 64, 4, 900, 16, D::kFloat32, true, false, false, 517},  // key_lengths
      {4, 2, 64, 64, 1, 900, 48, D::kFloat16, true, false, false, -1, D::kFloat16},
      // Weights (two passes over packed K/V).
      {4, 2, 32, 32, 20, 300, 16, D::kFloat32, true, true, false},
      {4, 2, 32, 32, 5, 129, 32, D::kFloat16, false, true, true},
  };
  return cases;
}

class PagedFlashTest : public ::testing::TestWithParam<CpuIsa> {
 protected:
  void SetUp() override {
    if (!CpuSupports(GetParam())) GTEST_SKIP() << CpuIsaName(GetParam()) << " not supported here";
  }
};

TEST_P(PagedFlashTest, EqualsContiguousBitwiseAndMatchesReference) {
  const CpuIsa isa = GetParam();
  const bool bf16 = IsBf16Isa(isa);
  Rng rng(2024);
  for (const Case& c : Cases()) {
    SCOPED_TRACE(c.Label());
    std::unique_ptr<Session> s = MakeSession(c, rng);
    FlashOptions opt;
    opt.isa = isa;
    for (int threads : {1, 2}) {
      opt.num_threads = threads;
      const AttentionParams contiguous = s->Contiguous(), paged = s->Paged();
      ASSERT_TRUE(FlashAttention({&contiguous, 1}, opt).ok());
      const absl::Status st = FlashAttention({&paged, 1}, opt);
      ASSERT_TRUE(st.ok()) << st;
      EXPECT_EQ(s->out_paged, s->out_contiguous) << threads << " threads";
      EXPECT_EQ(s->w_paged, s->w_contiguous) << threads << " threads";
    }
    if (bf16 && c.dtype != DType::kBFloat16) continue;  // it rounds the inputs: see the flash test
    std::vector<float> ref_out, ref_w;
    Reference(*s, &ref_out, &ref_w);
    const double tol = (bf16 ? 1e-2 : 1e-5) + (c.out_dtype == DType::kFloat16 ? 1e-3 : 0.0);
    EXPECT_LE(RelativeError(Floats(s->out_paged, c.out_dtype), ref_out), tol);
    if (c.weights) {
      EXPECT_LE(RelativeError(Floats(s->w_paged, DType::kFloat32), ref_w), tol);
    }
  }
}

// A sliding window or an attention chunk (Llama 4) over paged K/V whose
// blocks wholly before FirstWindowKey are released (null, as a session
// leaves them): the kernel never reads them, and the result is bitwise the
// contiguous one with the same window and chunk.
TEST_P(PagedFlashTest, SlidingWindowNeverReadsReleasedBlocks) {
  const CpuIsa isa = GetParam();
  using D = DType;
  const struct {
    Case c;
    int64_t window, chunk;
  } cases[] = {
      {{8, 2, 64, 64, 1, 3000, 16, D::kFloat32, true}, 700, 0},   // decode, split keys
      {{8, 2, 64, 64, 1, 1337, 48, D::kFloat16, true}, 100, 0},   // blocks straddle the grain
      {{4, 2, 32, 32, 3, 2100, 16, D::kFloat32, true}, 256, 0},   // a few rows
      {{4, 2, 64, 64, 40, 1500, 32, D::kBFloat16, true}, 300, 0},  // prefill chunk
      {{2, 1, 64, 64, 1, 600, 512, D::kFloat32, true}, 50, 0},    // one block per grain
      {{8, 2, 64, 64, 1, 3000, 16, D::kFloat32, true}, 0, 1024},  // a decode in its chunk
      {{4, 2, 64, 64, 40, 1500, 32, D::kBFloat16, true}, 0, 512},  // a prefill in its chunk
      {{4, 2, 32, 32, 3, 2100, 16, D::kFloat32, true}, 256, 1000},  // both: the chunk binds
  };
  Rng rng(77);
  for (const auto& [c, window, chunk] : cases) {
    SCOPED_TRACE(absl::StrCat(c.Label(), " window ", window, " chunk ", chunk));
    std::unique_ptr<Session> s = MakeSession(c, rng);
    const int64_t first = FirstWindowKey(c.lk - c.lq, window, chunk) / c.block_tokens;
    ASSERT_GT(first, 0) << "the case must release blocks";
    for (int64_t b = 0; b < first; ++b) s->k_blocks[b] = s->v_blocks[b] = nullptr;
    FlashOptions opt;
    opt.isa = isa;
    for (int threads : {1, 2}) {
      opt.num_threads = threads;
      AttentionParams contiguous = s->Contiguous(), paged = s->Paged();
      contiguous.window = paged.window = window;
      contiguous.chunk = paged.chunk = chunk;
      ASSERT_TRUE(FlashAttention({&contiguous, 1}, opt).ok());
      const absl::Status st = FlashAttention({&paged, 1}, opt);
      ASSERT_TRUE(st.ok()) << st;
      EXPECT_EQ(s->out_paged, s->out_contiguous) << threads << " threads";
    }
    // One block more released than allowed is refused, not read.
    s->k_blocks[first] = s->v_blocks[first] = nullptr;
    AttentionParams paged = s->Paged();
    paged.window = window;
    paged.chunk = chunk;
    EXPECT_EQ(FlashAttention({&paged, 1}, opt).code(), absl::StatusCode::kInvalidArgument);
  }
}

// 12 decode/prefill sessions of one model (one pool, blocks interleaved),
// lengths 1..2000: each result alone (1 thread) is the baseline; inside the
// span, in rotated orders and with 1..3 threads, every byte is the same;
// and it equals the contiguous layout.
TEST_P(PagedFlashTest, ManySessionsBatchAndThreadInvariant) {
  const CpuIsa isa = GetParam();
  Rng rng(77);
  constexpr int kSessions = 12;
  const int64_t bt = 16;
  std::vector<Case> cases;
  int64_t blocks = 0;
  for (int i = 0; i < kSessions; ++i) {
    Case c{8, 2, 64, 64, i % 5 == 4 ? 5 : 1, rng.Int(1, 2000), bt, DType::kFloat16, true};
    if (i == 3) c.lk = 4096;
    blocks += (c.lk + bt - 1) / bt;
    cases.push_back(c);
  }
  BlockPool pool(2 * blocks + 7, 2 * 64 * bt * 2, rng);
  std::vector<std::unique_ptr<Session>> sessions;
  // Page the sessions' blocks in an interleaved order, as appends would.
  for (const Case& c : cases) sessions.push_back(std::make_unique<Session>(c, rng));
  for (auto& s : sessions) s->Page(pool);

  FlashOptions opt;
  opt.isa = isa;
  opt.num_threads = 1;
  std::vector<std::vector<uint8_t>> alone;
  for (auto& s : sessions) {
    const AttentionParams p = s->Paged(), pc = s->Contiguous();
    ASSERT_TRUE(FlashAttention({&p, 1}, opt).ok());
    ASSERT_TRUE(FlashAttention({&pc, 1}, opt).ok());
    EXPECT_EQ(s->out_paged, s->out_contiguous) << s->c.Label();
    alone.push_back(s->out_paged);
  }
  for (int threads : {1, 2, 3}) {
    opt.num_threads = threads;
    std::vector<AttentionParams> span;
    for (size_t k = 0; k < sessions.size(); ++k) {
      Session& s = *sessions[(k + static_cast<size_t>(threads) * 5) % sessions.size()];
      std::fill(s.out_paged.begin(), s.out_paged.end(), 0xCD);
      span.push_back(s.Paged());
    }
    ASSERT_TRUE(FlashAttention(span, opt).ok());
    for (size_t k = 0; k < sessions.size(); ++k)
      EXPECT_EQ(sessions[k]->out_paged, alone[k]) << threads << " threads: " << sessions[k]->c.Label();
  }
}

INSTANTIATE_TEST_SUITE_P(AllVariants, PagedFlashTest,
                         ::testing::Values(CpuIsa::kScalar, CpuIsa::kAvx2, CpuIsa::kAvx512,
                                           CpuIsa::kAvx512Bf16, CpuIsa::kAmx),
                         [](const ::testing::TestParamInfo<CpuIsa>& info) {
                           return std::string(CpuIsaName(info.param));
                         });

TEST(PagedFlashAttentionTest, RejectsBadPagedParams) {
  Rng rng(3);
  auto s = MakeSession(Case{2, 1, 16, 16, 1, 40, 16, DType::kFloat32}, rng);
  auto expect_invalid = [&](AttentionParams p, const std::string& needle) {
    const absl::Status st = FlashAttention({&p, 1});
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << needle;
    EXPECT_NE(st.message().find(needle), std::string::npos) << st.message();
  };
  AttentionParams p = s->Paged();
  EXPECT_TRUE(FlashAttention({&p, 1}).ok());
  p.block_tokens = 8;
  expect_invalid(p, "block_tokens (8) must be a positive multiple of 16");
  p.block_tokens = 24;
  expect_invalid(p, "block_tokens (24)");
  p.block_tokens = 0;
  expect_invalid(p, "block_tokens (0)");
  p = s->Paged();
  p.v_blocks = nullptr;
  expect_invalid(p, "both k_blocks and v_blocks");
  p = s->Paged();
  p.batch = 2;
  expect_invalid(p, "batch must be 1");
  std::vector<const void*> holes = s->k_blocks;
  holes[2] = nullptr;  // 40 keys need 3 blocks of 16
  p = s->Paged();
  p.k_blocks = holes.data();
  expect_invalid(p, "k_blocks[2] and v_blocks[2] must be set");
  // The contiguous pointers are not needed (nor read) when paged.
  p = s->Paged();
  p.k = nullptr;
  p.v = nullptr;
  EXPECT_TRUE(FlashAttention({&p, 1}).ok());
}

}  // namespace
}  // namespace attnserve::cpu
