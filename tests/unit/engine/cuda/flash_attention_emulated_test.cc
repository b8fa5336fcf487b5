// The fused fp16/bf16 kernel (engine/cuda/flash_attention.cu, its source
// compiled here for the host) run on the CPU by warp_emulator.h, against
// float64 attention over the same rounded inputs (attention_oracle.h): its
// tile loops, index arithmetic, masks, windows, softcapping, sinks, ALiBi,
// the relative position bias, the relative position embeddings and the
// online softmax, checked without a GPU
// (flash_attention_fp32_emulated_test does the same for the fp32 kernel;
// fused_attention_test runs both on a GPU). Small shapes: one CUDA thread
// is one std::thread.
#include "tests/unit/engine/cuda/warp_emulator.h"  // first: it stands in for the device

#include <cstdint>
#include <random>

#include "engine/cuda/flash_attention.cu"  // NOLINT(build/include): the kernel itself
#include "gtest/gtest.h"
#include "tests/unit/engine/cuda/attention_oracle.h"

namespace attnserve::cuda {
namespace {

using oracle::Case;

// Runs case c's kernel variant on the emulator and checks it.
void EmulateAndCompare(const Case& c, std::mt19937& rng) {
  SCOPED_TRACE(c.Describe());
  oracle::Inputs in = oracle::MakeInputs(c, rng);
  const AttentionParams& a = in.params;
  ASSERT_TRUE(FlashAttentionSupports(a));
  const int64_t q_tiles = (a.q_len + kBlockM - 1) / kBlockM;
  const int64_t blocks = q_tiles * a.num_heads * a.batch;
  const auto run = [&]<typename T, int D, bool kCausal>() {
    emu::Launch(blocks, kThreads, SharedBytes<T, D>(),
                [&] { FlashAttentionKernel<T, D, kCausal>(a, q_tiles); });
  };
  const bool half = a.dtype == DType::kFloat16;
  if (a.head_dim == 64) {
    if (half) {
      a.causal ? run.template operator()<__half, 64, true>()
               : run.template operator()<__half, 64, false>();
    } else {
      a.causal ? run.template operator()<__nv_bfloat16, 64, true>()
               : run.template operator()<__nv_bfloat16, 64, false>();
    }
  } else {
    if (half) {
      a.causal ? run.template operator()<__half, 128, true>()
               : run.template operator()<__half, 128, false>();
    } else {
      a.causal ? run.template operator()<__nv_bfloat16, 128, true>()
               : run.template operator()<__nv_bfloat16, 128, false>();
    }
  }
  EXPECT_EQ(oracle::CompareWithFloat64(in, in.out.data()), 0)
      << "outputs off float64 by more than the tolerance";
}

// Both dtypes and head dims, causal or not, lengths inside and on the query
// and key tiles (Lq > Lk: leading causal rows see no key), GQA.
TEST(FlashKernelEmulated, MatchesFloat64OnTileShapes) {
  std::mt19937 rng(25);
  int n = 0;
  for (DType dtype : {DType::kFloat16, DType::kBFloat16}) {
    for (int64_t dim : {64, 128}) {
      for (bool causal : {false, true}) {
        Case c;
        c.dtype = c.out_dtype = dtype;
        c.batch = 1;
        c.heads = 2;
        c.kv_heads = 1;
        c.dim = dim;
        c.causal = causal;
        c.q_len = n % 2 == 0 ? 129 : 40;
        c.kv_len = n % 2 == 0 ? 96 : 150;
        EmulateAndCompare(c, rng);
        if (HasFatalFailure()) return;
        ++n;
      }
    }
  }
}

// Every rule: masks, key lengths, the token layout, another output dtype,
// windows, softcapping, sinks (oracle::RuleCases).
TEST(FlashKernelEmulated, MatchesFloat64WithMasksWindowsSoftcapAndSinks) {
  std::mt19937 rng(26);
  for (const Case& c : oracle::RuleCases({DType::kBFloat16, DType::kFloat16})) {
    EmulateAndCompare(c, rng);
    if (HasFatalFailure()) return;
  }
}

// ALiBi, causal and not, with GQA, Lq < Lk and Lq > Lk, a window, sinks,
// softcapping, masks and key lengths (oracle::AlibiCases).
TEST(FlashKernelEmulated, MatchesFloat64WithAlibi) {
  std::mt19937 rng(27);
  for (const Case& c : oracle::AlibiCases({DType::kFloat16, DType::kBFloat16})) {
    EmulateAndCompare(c, rng);
    if (HasFatalFailure()) return;
  }
}

// A relative position bias table, both clamps binding and none, with every
// rule, GQA, ALiBi beside it, Lq > Lk (oracle::RelativeBiasCases).
TEST(FlashKernelEmulated, MatchesFloat64WithRelativeBias) {
  std::mt19937 rng(28);
  for (const Case& c : oracle::RelativeBiasCases({DType::kFloat16, DType::kBFloat16})) {
    EmulateAndCompare(c, rng);
    if (HasFatalFailure()) return;
  }
}

// Relative position embeddings, each set of tables, both clamps binding and
// none, with every rule, GQA, ALiBi and a relative bias beside them, Lq > Lk
// (oracle::RelativeEmbeddingCases): their terms from the Q and K tiles in
// shared memory.
TEST(FlashKernelEmulated, MatchesFloat64WithRelativeEmbeddings) {
  std::mt19937 rng(29);
  for (const Case& c : oracle::RelativeEmbeddingCases({DType::kBFloat16, DType::kFloat16})) {
    EmulateAndCompare(c, rng);
    if (HasFatalFailure()) return;
  }
}

}  // namespace
}  // namespace attnserve::cuda
