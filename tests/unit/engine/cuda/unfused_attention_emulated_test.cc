// The unfused attention path (engine/cuda/unfused_attention.cc: fp32
// requests and need_weights) run on the CPU: its host code as written, its
// kernels (softmax_rows.cu) on warp_emulator.h, its cuBLAS calls on
// cublas_emulator.h, against float64 attention (attention_oracle.h).
// Checked without a GPU: the 3xTF32 split and its GEMMs' shapes and leading
// dimensions, the causal row blocks (whose GEMMs stop at each block's
// diagonal), the softmax's rules, the scatter into the output's layout and
// dtype, and need_weights from a fused kernel's row statistics
// (EnqueueWeights). cuda_engine_test runs the same path on a GPU, against
// the real cuBLAS.
#include "tests/unit/engine/cuda/warp_emulator.h"  // first: it stands in for the device

#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <vector>

#include "engine/cuda/softmax_rows.cu"        // NOLINT(build/include): the kernels themselves
#include "engine/cuda/unfused_attention.cc"  // NOLINT(build/include): the path's host code
#include "gtest/gtest.h"
#include "tests/unit/engine/cuda/attention_oracle.h"
#include "tests/unit/engine/cuda/cublas_emulator.h"
#include "tests/unit/engine/cuda/cuda_runtime_emulator.h"

namespace attnserve::cuda {
namespace {

using oracle::Case;
using oracle::MakeCase;
using oracle::Mask;

// "Device" memory for one request: separate host allocations (so that ASan
// sees a read past any of them), each filled with NaN bytes, so that a
// GEMM or a kernel reading what nothing wrote poisons the result.
class Arena {
 public:
  absl::StatusOr<void*> Alloc(size_t bytes) {
    buffers_.push_back(std::make_unique<unsigned char[]>(std::max<size_t>(bytes, 1)));
    std::memset(buffers_.back().get(), 0xff, bytes);
    return static_cast<void*>(buffers_.back().get());
  }

 private:
  std::vector<std::unique_ptr<unsigned char[]>> buffers_;
};

// Rows of up to 100 keys keep the softmax's row in (emulated) shared memory,
// longer ones go through the score row: both variants of SoftmaxRowsKernel.
constexpr int64_t kSharedRowKeys = 100;
[[maybe_unused]] const bool kSharedLimitSet = [] {
  emu::MaxSharedOptin() = kSharedReserve + kSharedRowKeys * static_cast<int>(sizeof(float));
  return true;
}();

// Per-head weights [B, Hq, Lq, Lk] in fp32, NaN until written.
std::vector<float> NanWeights(const Case& c) {
  return std::vector<float>(c.batch * c.heads * c.q_len * c.kv_len, std::nanf(""));
}

// Small fp32 requests through every rule the softmax applies: masks, key
// lengths (a sequence with none), the token layout, windows, softcapping,
// sinks, another output dtype, a decode row, Lq > Lk (rows that see nothing),
// a two-sided window (not causal).
std::vector<Case> Fp32RuleCases() {
  std::vector<Case> cases;
  Case c = MakeCase(DType::kFloat32, 1, 2, 1, 24, 77, 64, true);
  c.mask = Mask::kBoolPerBatch;
  cases.push_back(c);
  c = MakeCase(DType::kFloat32, 2, 2, 2, 20, 90, 32, false);
  c.mask = Mask::kAdditivePerHead;
  c.lengths = true;
  c.token_layout = true;
  cases.push_back(c);
  c = MakeCase(DType::kFloat32, 1, 2, 1, 30, 70, 32, true);
  c.window = 9;
  c.softcap = 5.0f;
  c.scale = 0.5f;  // scores large enough for the cap to bend
  c.sinks = true;
  c.out_dtype = DType::kFloat16;
  cases.push_back(c);
  cases.push_back(MakeCase(DType::kFloat32, 1, 4, 2, 1, 130, 64, false));  // a decode row
  cases.push_back(MakeCase(DType::kFloat32, 1, 2, 2, 40, 25, 32, true));   // Lq > Lk
  c = MakeCase(DType::kFloat32, 2, 2, 1, 50, 60, 32, false);  // a two-sided window
  c.window = 12;
  cases.push_back(c);
  return cases;
}

// Causal requests past 512 query rows, which the path runs by row blocks
// whose GEMMs stop at each block's diagonal: Lq < Lk, and Lq > Lk with key
// lengths (the first rows see nothing, the last rows a third of the keys).
std::vector<Case> CausalRowBlockCases(DType dtype) {
  std::vector<Case> cases;
  cases.push_back(MakeCase(dtype, 1, 1, 1, 512, 560, 32, true));
  Case c = MakeCase(dtype, 1, 1, 1, 520, 300, 32, true);
  c.lengths = true;
  cases.push_back(c);
  return cases;
}

// Runs `c` through UnfusedAttention::Enqueue (weights too when asked) and
// checks output and weights against float64.
void EnqueueAndCompare(UnfusedAttention::Gemm gemm, const Case& c, bool weights,
                       std::mt19937& rng) {
  SCOPED_TRACE(c.Describe() + (gemm == UnfusedAttention::Gemm::kFp32 ? " fp32 GEMMs" : " 3xTF32") +
               (weights ? " weights" : ""));
  oracle::Inputs in = oracle::MakeInputs(c, rng);
  std::vector<float> w = NanWeights(c);
  AttentionParams a = in.params;
  if (weights) {
    a.weights = w.data();
    a.weights_dtype = DType::kFloat32;
  }
  absl::StatusOr<std::unique_ptr<UnfusedAttention>> unfused =
      UnfusedAttention::Create(/*stream=*/nullptr, gemm);
  ASSERT_TRUE(unfused.ok()) << unfused.status();
  ASSERT_TRUE(UnfusedAttention::Supports(a));
  Arena arena;
  const absl::Status status = (*unfused)->Enqueue(
      a, [&arena](size_t bytes) { return arena.Alloc(bytes); }, /*stream=*/nullptr);
  ASSERT_TRUE(status.ok()) << status;
  EXPECT_EQ(oracle::CompareWithFloat64(in, in.out.data()), 0)
      << "outputs off float64 by more than 1e-5";
  if (weights) {
    EXPECT_EQ(oracle::CompareWeightsWithFloat64(in, w.data(), DType::kFloat32, 1e-6, 1e-5), 0)
        << "weights off float64";
  }
}

TEST(UnfusedAttentionEmulated, Fp32RulesWithinOneInOneHundredThousandOfFloat64) {
  std::mt19937 rng(11);
  int n = 0;
  for (const Case& c : Fp32RuleCases()) {
    for (const auto gemm : {UnfusedAttention::Gemm::k3xTf32, UnfusedAttention::Gemm::kFp32}) {
      EnqueueAndCompare(gemm, c, /*weights=*/n++ % 2 == 0, rng);
    }
  }
}

// A position bias through the softmax: `cases` (fp32: causal and not,
// masks, key lengths, a window, softcapping, sinks, rows in shared memory
// and not) and the causal row blocks given theirs by `add_bias`, on both
// GEMM paths, weights on every other. Weights from row statistics are not
// for a position bias: their source, cuDNN, refuses one (SdpaRefusal).
void CheckPositionBias(std::vector<Case> cases, uint32_t seed,
                       const std::function<void(Case&)>& add_bias) {
  std::mt19937 rng(seed);
  Case blocks = MakeCase(DType::kFloat32, 1, 2, 1, 512, 560, 32, true);
  add_bias(blocks);
  cases.push_back(blocks);
  int n = 0;
  for (const Case& c : cases) {
    for (const auto gemm : {UnfusedAttention::Gemm::k3xTf32, UnfusedAttention::Gemm::kFp32}) {
      EnqueueAndCompare(gemm, c, /*weights=*/n++ % 2 == 0, rng);
    }
  }
  Case half = MakeCase(DType::kFloat16, 1, 2, 1, 24, 77, 64, true);
  add_bias(half);
  oracle::Inputs in = oracle::MakeInputs(half, rng);
  std::vector<float> w = NanWeights(half);
  in.params.weights = w.data();
  EXPECT_FALSE(UnfusedAttention::SupportsWeights(in.params));
}

// ALiBi (oracle::AlibiCases).
TEST(UnfusedAttentionEmulated, AlibiWithinOneInOneHundredThousandOfFloat64) {
  CheckPositionBias(oracle::AlibiCases({DType::kFloat32}), 14, [](Case& c) { c.alibi = true; });
}

// A relative position bias table (oracle::RelativeBiasCases: both clamps
// binding and none, ALiBi beside it; the row blocks with a distance of 5).
TEST(UnfusedAttentionEmulated, RelativeBiasWithinOneInOneHundredThousandOfFloat64) {
  CheckPositionBias(oracle::RelativeBiasCases({DType::kFloat32}), 15,
                    [](Case& c) { c.relative_bias_distance = 5; });
}

// Relative position embeddings (oracle::RelativeEmbeddingCases: each set of
// tables, both clamps binding and none, ALiBi and a relative bias beside
// them; the row blocks with both tables of distance 5): their terms from Q
// and K in the softmax, added to the GEMM's scores.
TEST(UnfusedAttentionEmulated, RelativeEmbeddingsWithinOneInOneHundredThousandOfFloat64) {
  CheckPositionBias(oracle::RelativeEmbeddingCases({DType::kFloat32}), 16,
                    [](Case& c) { c.relative_embedding_distance = 5; });
}

// The row blocks: exact, and their GEMMs do a little over half the work of
// the whole score matrix (what they are for), on both GEMM paths.
TEST(UnfusedAttentionEmulated, CausalRowBlocksAreExactAndSkipTheMaskedHalf) {
  std::mt19937 rng(12);
  for (const auto gemm : {UnfusedAttention::Gemm::k3xTf32, UnfusedAttention::Gemm::kFp32}) {
    for (const Case& c : CausalRowBlockCases(DType::kFloat32)) {
      emu::GemmLog().clear();
      EnqueueAndCompare(gemm, c, /*weights=*/c.lengths, rng);
      // Every GEMM of the path involves the score matrix (Q K^T, then P V,
      // and with 3xTF32 P_l V_h): the whole matrix's share of each is
      // Lq Lk per pair times its third dimension.
      const int64_t parts = gemm == UnfusedAttention::Gemm::k3xTf32 ? 3 + 2 + 1 : 1 + 1;
      const double whole = static_cast<double>(c.q_len) * c.kv_len * c.dim * parts;
      const double done = emu::GemmWork(emu::GemmLog());
      EXPECT_LT(done, 0.7 * whole) << "the row blocks did not skip the masked keys";
      EXPECT_GT(done, 0.0);
    }
  }
}

// need_weights beside a fused kernel: the kernel's output is not this
// path's; the weights come from its row statistics (here the float64
// log-sum-exp, rounded to fp32, laid out per (b, h) over `lse_rows` rows as
// a plan's bucket pads them, the padding NaN) and a GEMM of the 16-bit Q
// and K.
void WeightsFromStatsAndCompare(const Case& c, DType weights_dtype, std::mt19937& rng) {
  SCOPED_TRACE(c.Describe() + " weights " + std::string(DTypeName(weights_dtype)));
  oracle::Inputs in = oracle::MakeInputs(c, rng);
  AttentionParams a = in.params;
  const int64_t lse_rows = (c.q_len + 63) / 64 * 64 + 64;
  std::vector<float> lse(c.batch * c.heads * lse_rows, std::nanf(""));
  for (int64_t b = 0; b < c.batch; ++b) {
    for (int64_t h = 0; h < c.heads; ++h) {
      for (int64_t i = 0; i < c.q_len; ++i) {
        lse[(b * c.heads + h) * lse_rows + i] =
            static_cast<float>(oracle::RowLogSumExp(in, b, h, i));
      }
    }
  }
  std::vector<unsigned char> w(c.batch * c.heads * c.q_len * c.kv_len * DTypeSize(weights_dtype),
                               0xff);
  a.weights = w.data();
  a.weights_dtype = weights_dtype;
  ASSERT_TRUE(UnfusedAttention::SupportsWeights(a));
  absl::StatusOr<std::unique_ptr<UnfusedAttention>> unfused =
      UnfusedAttention::Create(/*stream=*/nullptr);
  ASSERT_TRUE(unfused.ok()) << unfused.status();
  Arena arena;
  const absl::Status status = (*unfused)->EnqueueWeights(
      a, lse.data(), lse_rows, [&arena](size_t bytes) { return arena.Alloc(bytes); },
      /*stream=*/nullptr);
  ASSERT_TRUE(status.ok()) << status;
  // The scores from exact products and fp32 sums, then exp(t - lse): about
  // 1e-5 relative; a 16-bit weight's own rounding adds 2^-11 (fp16) or 2^-9
  // (bf16).
  double rtol = 1e-4;
  if (weights_dtype == DType::kFloat16) rtol = 1e-3;
  if (weights_dtype == DType::kBFloat16) rtol = 4e-3;
  EXPECT_EQ(oracle::CompareWeightsWithFloat64(in, w.data(), weights_dtype, 1e-6, rtol), 0)
      << "weights off float64";
}

TEST(UnfusedAttentionEmulated, WeightsFromRowStatisticsMatchFloat64) {
  std::mt19937 rng(13);
  Case c = MakeCase(DType::kFloat16, 1, 2, 1, 24, 77, 64, true);
  c.mask = Mask::kBoolPerBatch;
  WeightsFromStatsAndCompare(c, DType::kFloat32, rng);
  c = MakeCase(DType::kBFloat16, 2, 2, 2, 20, 90, 32, false);
  c.mask = Mask::kAdditivePerHead;
  c.lengths = true;
  c.token_layout = true;
  WeightsFromStatsAndCompare(c, DType::kFloat32, rng);
  c = MakeCase(DType::kBFloat16, 1, 2, 1, 30, 70, 64, true);
  c.window = 9;
  WeightsFromStatsAndCompare(c, DType::kBFloat16, rng);
  WeightsFromStatsAndCompare(MakeCase(DType::kFloat16, 1, 4, 2, 1, 130, 64, false),
                             DType::kFloat32, rng);
  WeightsFromStatsAndCompare(MakeCase(DType::kFloat16, 1, 2, 2, 40, 25, 32, true),
                             DType::kFloat16, rng);
  for (const Case& rows : CausalRowBlockCases(DType::kFloat16)) {
    emu::GemmLog().clear();
    WeightsFromStatsAndCompare(rows, DType::kFloat32, rng);
    EXPECT_LT(emu::GemmWork(emu::GemmLog()),
              0.7 * static_cast<double>(rows.q_len) * rows.kv_len * rows.dim)
        << "the row blocks did not skip the masked keys";
  }
}

}  // namespace
}  // namespace attnserve::cuda
