// The general attention kernel (engine/cuda/attention_general.cu, the
// fallback for what cuDNN, the fused kernels and the unfused path do not
// serve: every dtype and head dim, per-head weights) compiled for the host
// and run on warp_emulator.h against float64 attention (attention_oracle.h):
// every rule (masks, key lengths, the token layout, windows, softcapping,
// sinks, ALiBi, a relative position bias, relative position embeddings,
// another output dtype) in the
// three dtypes, outputs and weights. Checked without a GPU;
// cuda_engine_test runs it on one.
#include "tests/unit/engine/cuda/warp_emulator.h"  // first: it stands in for the device

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "engine/cuda/attention_general.cu"  // NOLINT(build/include): the kernel itself
#include "gtest/gtest.h"
#include "tests/unit/engine/cuda/attention_oracle.h"

namespace attnserve::cuda {
namespace {

using oracle::Case;

// Case c on the kernel, with per-head weights when asked, checked against
// float64.
void RunAndCompare(const Case& c, bool weights, std::mt19937& rng) {
  SCOPED_TRACE(c.Describe() + (weights ? " weights" : ""));
  oracle::Inputs in = oracle::MakeInputs(c, rng);
  std::vector<float> w(c.batch * c.heads * c.q_len * c.kv_len, std::nanf(""));
  AttentionParams a = in.params;
  if (weights) {
    a.weights = w.data();
    a.weights_dtype = DType::kFloat32;
  }
  ASSERT_EQ(LaunchAttentionGeneral(a, /*stream=*/nullptr), cudaSuccess);
  EXPECT_EQ(oracle::CompareWithFloat64(in, in.out.data()), 0) << "outputs off float64";
  if (weights) {
    // All in fp32: the scores' sums and exp, about 1e-6 relative.
    EXPECT_EQ(oracle::CompareWeightsWithFloat64(in, w.data(), DType::kFloat32, 1e-6, 1e-5), 0)
        << "weights off float64";
  }
}

TEST(AttentionGeneralEmulated, EveryRuleInEveryDtypeMatchesFloat64) {
  std::mt19937 rng(21);
  int n = 0;
  for (const DType dtype : {DType::kFloat32, DType::kFloat16, DType::kBFloat16}) {
    for (Case c : oracle::RuleCases({dtype})) {
      // A head dim the fused kernels do not take, on every other case.
      if (n % 2 == 1) c.dim = 40;
      RunAndCompare(c, /*weights=*/n++ % 2 == 0, rng);
    }
  }
}

// ALiBi with every rule it meets (oracle::AlibiCases) in the three dtypes,
// outputs and weights.
TEST(AttentionGeneralEmulated, AlibiInEveryDtypeMatchesFloat64) {
  std::mt19937 rng(23);
  int n = 0;
  for (const DType dtype : {DType::kFloat32, DType::kFloat16, DType::kBFloat16}) {
    for (Case c : oracle::AlibiCases({dtype})) {
      if (n % 2 == 1) c.dim = 40;
      RunAndCompare(c, /*weights=*/n++ % 2 == 0, rng);
    }
  }
}

// A relative position bias table with every rule it meets
// (oracle::RelativeBiasCases: both clamps binding and none, ALiBi beside it)
// in the three dtypes, outputs and weights.
TEST(AttentionGeneralEmulated, RelativeBiasInEveryDtypeMatchesFloat64) {
  std::mt19937 rng(24);
  int n = 0;
  for (const DType dtype : {DType::kFloat32, DType::kFloat16, DType::kBFloat16}) {
    for (Case c : oracle::RelativeBiasCases({dtype})) {
      if (n % 2 == 1) c.dim = 40;
      RunAndCompare(c, /*weights=*/n++ % 2 == 0, rng);
    }
  }
}

// Relative position embeddings with every rule they meet
// (oracle::RelativeEmbeddingCases: each set of tables, both clamps binding
// and none, ALiBi and a relative bias beside them) in the three dtypes,
// outputs and weights.
TEST(AttentionGeneralEmulated, RelativeEmbeddingsInEveryDtypeMatchFloat64) {
  std::mt19937 rng(25);
  int n = 0;
  for (const DType dtype : {DType::kFloat32, DType::kFloat16, DType::kBFloat16}) {
    for (Case c : oracle::RelativeEmbeddingCases({dtype})) {
      if (n % 2 == 1) c.dim = 40;
      RunAndCompare(c, /*weights=*/n++ % 2 == 0, rng);
    }
  }
}

// One query row over many keys (a decode), GQA, and a request whose rows see
// no key at all (causal with Lq > Lk): zeros, never NaN.
TEST(AttentionGeneralEmulated, DecodeRowsAndRowsThatSeeNothing) {
  std::mt19937 rng(22);
  const Case decode = oracle::MakeCase(DType::kBFloat16, 1, 8, 2, 1, 333, 128, false);
  const Case blind = oracle::MakeCase(DType::kFloat32, 1, 2, 2, 30, 9, 32, true);
  for (const Case& c : {decode, blind}) {
    SCOPED_TRACE(c.Describe());
    oracle::Inputs in = oracle::MakeInputs(c, rng);
    ASSERT_EQ(LaunchAttentionGeneral(in.params, /*stream=*/nullptr), cudaSuccess);
    EXPECT_EQ(oracle::CompareWithFloat64(in, in.out.data()), 0) << "outputs off float64";
  }
}

}  // namespace
}  // namespace attnserve::cuda
