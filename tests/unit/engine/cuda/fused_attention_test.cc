// The fused attention kernels (engine/cuda/flash_attention.cu for FLOAT16 and
// BFLOAT16, flash_attention_fp32.cu for FLOAT32): which requests each takes
// (host-side, runs without a GPU), and on a GPU each kernel launched
// directly against float64 attention computed here from the same inputs (as
// rounded to the dtype), through every rule they serve: causal
// (bottom-right), key lengths, bool and additive masks through broadcast
// strides, grouped-query heads, Lq != Lk, the head and token layouts, rows
// that see no key, another output dtype, and the rules of today's layers:
// sliding windows, logit softcapping, sinks, ALiBi, a relative position
// bias, relative position embeddings. fp32 results must be within 1e-5 of
// float64 (the GPU issue's bar). Linked against the CUDA backend's objects
// (the module hides them), so the kernel that runs is the one under test,
// not whatever the engine routes to.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "engine/attention_params.h"
#include "engine/cuda/attention_kernels.h"
#include "engine/dtype.h"
#include "engine/tensor.h"
#include "gtest/gtest.h"
#include "tests/unit/engine/cuda/attention_oracle.h"

namespace attnserve::cuda {
namespace {

constexpr int kH100SharedBytes = 227 * 1024;  // sm_90's opt-in maximum per block
constexpr int kA100SharedBytes = 163 * 1024;  // sm_80's

// A request both kernels take but for the dtype: head layout [B, H, L, D],
// 16-byte aligned.
AttentionParams Plain(DType dtype, int64_t head_dim) {
  alignas(16) static float storage[4];
  AttentionParams a;
  a.batch = 2;
  a.num_heads = 4;
  a.num_kv_heads = 2;
  a.head_dim = a.head_dim_v = head_dim;
  a.q_len = a.kv_len = 96;
  a.dtype = a.out_dtype = dtype;
  a.q = a.k = a.v = storage;
  a.out = storage;
  SetContiguousStrides(&a, HeadLayoutStrides);
  a.scale = 0.125f;
  return a;
}

bool Supports(const AttentionParams& a) {
  return a.dtype == DType::kFloat32 ? FlashAttentionFp32Supports(a, kH100SharedBytes)
                                    : FlashAttentionSupports(a);
}

TEST(FlashAttentionSupports, TakesEveryMaskingRuleAtHeadDims64And128) {
  static const int64_t kLengths[2] = {1, 2};
  static const float kSinks[4] = {};
  for (DType dtype : {DType::kFloat32, DType::kFloat16, DType::kBFloat16}) {
    for (int64_t d : {64, 128}) {
      AttentionParams a = Plain(dtype, d);
      EXPECT_TRUE(Supports(a)) << DTypeName(dtype) << " " << d;
      a.causal = true;
      a.key_lengths = kLengths;
      a.mask.kind = MaskParams::Kind::kBool;
      a.window = 16;
      a.softcap = 30.0f;
      a.sinks = kSinks;
      a.q_len = 1;  // a decode row over 96 keys
      a.out_dtype = DType::kFloat32;
      EXPECT_TRUE(Supports(a)) << DTypeName(dtype) << " " << d;
      EXPECT_TRUE(UsesLayerFeatures(a));
    }
  }
  EXPECT_TRUE(FlashAttentionFp32Supports(Plain(DType::kFloat32, 128), kA100SharedBytes));
}

TEST(FlashAttentionSupports, RefusesWhatTheKernelsDoNotCompute) {
  struct Case {
    const char* what;
    void (*change)(AttentionParams&);
  };
  alignas(16) static float buffer[8];
  static const void* const kBlocks[1] = {buffer};
  const Case cases[] = {
      {"head dim 80", [](AttentionParams& a) { a.head_dim = a.head_dim_v = 80; }},
      {"head dim 256", [](AttentionParams& a) { a.head_dim = a.head_dim_v = 256; }},
      {"Dv != Dk", [](AttentionParams& a) { a.head_dim_v = 128; }},
      {"weights", [](AttentionParams& a) { a.weights = buffer; }},
      {"paged K/V", [](AttentionParams& a) { a.k_blocks = a.v_blocks = kBlocks; }},
      {"q not 16-byte aligned", [](AttentionParams& a) { a.q = buffer + 1; }},
      {"v not 16-byte aligned", [](AttentionParams& a) { a.v = buffer + 2; }},
      {"k row stride 66", [](AttentionParams& a) { a.k_stride_row = 66; }},
      {"q head stride odd", [](AttentionParams& a) { a.q_stride_h += 1; }},
  };
  for (DType dtype : {DType::kFloat32, DType::kFloat16, DType::kBFloat16}) {
    for (const Case& c : cases) {
      AttentionParams a = Plain(dtype, 64);
      c.change(a);
      EXPECT_FALSE(Supports(a)) << DTypeName(dtype) << ": " << c.what;
    }
  }
  // Each kernel takes its own dtypes only.
  EXPECT_FALSE(FlashAttentionSupports(Plain(DType::kFloat32, 64)));
  EXPECT_FALSE(FlashAttentionFp32Supports(Plain(DType::kFloat16, 64), kH100SharedBytes));
  EXPECT_FALSE(FlashAttentionFp32Supports(Plain(DType::kBFloat16, 64), kH100SharedBytes));
  // fp16 rows must be 16-byte multiples: a row stride of 4 elements is not.
  AttentionParams a = Plain(DType::kFloat16, 64);
  a.k_stride_row = 68;
  EXPECT_FALSE(FlashAttentionSupports(a));
}

TEST(FlashAttentionSupports, Fp32FitsAnA100AndRefusesADeviceWithLessSharedMemory) {
  for (int64_t d : {64, 128}) {
    const AttentionParams a = Plain(DType::kFloat32, d);
    const int bytes = FlashAttentionFp32SharedBytes(d);
    EXPECT_GT(bytes, 48 * 1024) << d;  // the launch raises the limit
    EXPECT_LE(bytes, kA100SharedBytes) << d;
    EXPECT_TRUE(FlashAttentionFp32Supports(a, bytes)) << d;
    EXPECT_FALSE(FlashAttentionFp32Supports(a, bytes - 1)) << d;
    // sm_86 / sm_89 have 99 KiB per block: the unfused path serves them.
    EXPECT_FALSE(FlashAttentionFp32Supports(a, 99 * 1024)) << d;
  }
  EXPECT_EQ(FlashAttentionFp32SharedBytes(80), 0);
}

TEST(FlashAttentionSupports, LayerFeaturesAreTheWindowSoftcapSinksAndPositionBiases) {
  static const float kSinks[4] = {};
  static const float kSlopes[4] = {0.5f, 0.25f, 0.125f, 0.0625f};
  static const float kTable[4 * 7] = {};
  static const float kEmbeddings[4 * 64 * 7] = {};
  AttentionParams a = Plain(DType::kFloat16, 64);
  EXPECT_FALSE(UsesLayerFeatures(a));
  a.causal = true;
  a.mask.kind = MaskParams::Kind::kAdditive;
  EXPECT_FALSE(UsesLayerFeatures(a));
  for (int feature = 0; feature < 7; ++feature) {
    AttentionParams f = Plain(DType::kFloat16, 64);
    if (feature == 0) f.window = 1;
    if (feature == 1) f.softcap = 50.0f;
    if (feature == 2) f.sinks = kSinks;
    if (feature == 3) f.alibi_slopes = kSlopes;
    if (feature == 4) f.relative_bias = kTable, f.relative_bias_distance = 3;
    if (feature == 5) f.relative_key = kEmbeddings, f.relative_embedding_distance = 3;
    if (feature == 6) f.relative_query = kEmbeddings, f.relative_embedding_distance = 3;
    EXPECT_TRUE(UsesLayerFeatures(f)) << feature;
  }
}

// ------------------------------------------------------------------ on a GPU

bool HaveGpu(std::string* why) {
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess || count == 0) {
    (void)cudaGetLastError();
    *why = err != cudaSuccess ? cudaGetErrorString(err) : "no CUDA device";
    return false;
  }
  int major = 0;
  (void)cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0);
  if (major < 8) {
    *why = "compute capability below 8.0";
    return false;
  }
  return true;
}

#define REQUIRE_GPU()                                                   \
  do {                                                                  \
    std::string why;                                                    \
    if (!HaveGpu(&why)) {                                               \
      const char* require = std::getenv("ATTNSERVE_REQUIRE_GPU");       \
      if (require != nullptr && std::strcmp(require, "1") == 0) {       \
        FAIL() << "ATTNSERVE_REQUIRE_GPU=1 and no usable GPU: " << why; \
      }                                                                 \
      GTEST_SKIP() << "no usable GPU: " << why;                         \
    }                                                                   \
  } while (0)

#define CUDA_OK(expr)                                                          \
  do {                                                                         \
    const cudaError_t err_ = (expr);                                           \
    ASSERT_EQ(err_, cudaSuccess) << #expr << ": " << cudaGetErrorString(err_); \
  } while (0)

using oracle::Case;
using oracle::Mask;

// Device copies, freed on scope exit.
struct DeviceBuffers {
  std::vector<void*> owned;
  bool failed = false;  // an allocation or copy failed
  ~DeviceBuffers() {
    for (void* p : owned) (void)cudaFree(p);
  }
  // A device copy of `bytes` of host memory (null for null).
  template <typename T>
  T* Copy(T* host, size_t bytes) {
    if (host == nullptr) return nullptr;
    void* p = nullptr;
    if (cudaMalloc(&p, std::max<size_t>(bytes, 1)) != cudaSuccess) {
      failed = true;
      return nullptr;
    }
    owned.push_back(p);
    if (cudaMemcpy(p, host, bytes, cudaMemcpyHostToDevice) != cudaSuccess) failed = true;
    return static_cast<T*>(p);
  }
};

// Runs case c on its dtype's kernel and checks every output against float64.
void RunAndCompare(const Case& c, std::mt19937& rng) {
  SCOPED_TRACE(c.Describe());
  oracle::Inputs in = oracle::MakeInputs(c, rng);
  AttentionParams a = in.params;  // host pointers, replaced by device copies
  DeviceBuffers device;
  a.q = device.Copy(a.q, in.q_bytes.size());
  a.k = device.Copy(a.k, in.k_bytes.size());
  a.v = device.Copy(a.v, in.v_bytes.size());
  a.out = device.Copy(a.out, in.out.size());
  a.key_lengths = device.Copy(a.key_lengths, in.lengths.size() * sizeof(int64_t));
  a.sinks = device.Copy(a.sinks, in.sinks.size() * sizeof(float));
  a.alibi_slopes = device.Copy(a.alibi_slopes, in.alibi_slopes.size() * sizeof(float));
  a.relative_bias = device.Copy(a.relative_bias, in.relative_bias.size() * sizeof(float));
  a.relative_key = device.Copy(a.relative_key, in.relative_key.size() * sizeof(float));
  a.relative_query = device.Copy(a.relative_query, in.relative_query.size() * sizeof(float));
  a.mask.data = device.Copy(a.mask.data, in.bool_mask.size() + in.add_mask.size() * 4);
  ASSERT_FALSE(device.failed) << "device allocation or copy: "
                              << cudaGetErrorString(cudaGetLastError());

  if (c.dtype == DType::kFloat32) {
    int max_shared = 0;
    CUDA_OK(cudaDeviceGetAttribute(&max_shared, cudaDevAttrMaxSharedMemoryPerBlockOptin, 0));
    ASSERT_TRUE(FlashAttentionFp32Supports(a, max_shared)) << "max shared " << max_shared;
    CUDA_OK(LaunchFlashAttentionFp32(a, max_shared, nullptr));
  } else {
    ASSERT_TRUE(FlashAttentionSupports(a));
    CUDA_OK(LaunchFlashAttention(a, nullptr));
  }
  CUDA_OK(cudaDeviceSynchronize());
  CUDA_OK(cudaMemcpy(in.out.data(), a.out, in.out.size(), cudaMemcpyDeviceToHost));
  EXPECT_EQ(oracle::CompareWithFloat64(in, in.out.data()), 0)
      << "outputs off float64 by more than the tolerance";
}

constexpr DType kDTypes[] = {DType::kFloat32, DType::kFloat16, DType::kBFloat16};

TEST(FlashAttentionKernel, MatchesFloat64OnEveryTileShape) {
  REQUIRE_GPU();
  std::mt19937 rng(5);
  for (DType dtype : kDTypes) {
    for (int64_t dim : {64, 128}) {
      for (bool causal : {false, true}) {
        // Lengths inside and exactly on the 128-row query tiles and the 32-
        // and 64-key key tiles, Lq < Lk and Lq > Lk (causal: leading rows
        // see no key).
        for (auto [lq, lk] : {std::pair<int64_t, int64_t>{1, 1},
                              {1, 300},
                              {31, 33},
                              {127, 127},
                              {128, 128},
                              {129, 257},
                              {300, 129},
                              {200, 1100}}) {
          Case c;
          c.dtype = c.out_dtype = dtype;
          c.batch = lk > 500 ? 1 : 2;  // the float64 reference's time
          c.dim = dim;
          c.causal = causal;
          c.q_len = lq;
          c.kv_len = lk;
          RunAndCompare(c, rng);
          if (HasFatalFailure()) return;
        }
      }
    }
  }
}

TEST(FlashAttentionKernel, MatchesFloat64WithMasksLengthsAndLayouts) {
  REQUIRE_GPU();
  std::mt19937 rng(6);
  int n = 0;
  for (DType dtype : kDTypes) {
    for (Mask mask : {Mask::kNone, Mask::kBoolPerBatch, Mask::kAdditivePerHead}) {
      for (bool lengths : {false, true}) {
        for (bool token_layout : {false, true}) {
          Case c;
          c.dtype = dtype;
          c.dim = n % 2 == 0 ? 64 : 128;
          c.causal = n % 3 == 0;
          c.q_len = 70 + 40 * (n % 4);
          c.kv_len = 150 + 7 * (n % 12);
          c.heads = n % 2 == 0 ? 4 : 6;
          c.kv_heads = n % 2 == 0 ? 1 : 3;
          c.mask = mask;
          c.lengths = lengths;
          c.token_layout = token_layout;
          c.out_dtype = n % 5 == 4 ? (dtype == DType::kFloat32 ? DType::kFloat16 : DType::kFloat32)
                                   : dtype;
          RunAndCompare(c, rng);
          if (HasFatalFailure()) return;
          ++n;
        }
      }
    }
  }
}

// Today's layers' rules (a sliding window, logit softcapping, sinks) alone
// and together, with causal or not, masks and key lengths: windows of 1 key,
// shorter than a key tile, and spanning several over 400-450 keys (a
// block's first tiles and a warp's are skipped), rows whose window holds no
// visible key (zeros, sinks or not).
TEST(FlashAttentionKernel, WindowSoftcapAndSinksMatchFloat64) {
  REQUIRE_GPU();
  std::mt19937 rng(7);
  int n = 0;
  for (DType dtype : kDTypes) {
    for (int64_t window : {0, 1, 37, 300}) {
      for (int features = 0; features < 4; ++features) {
        const bool softcap = features & 1, sinks = features & 2;
        if (window == 0 && features == 0) continue;  // the tests above
        Case c;
        c.dtype = c.out_dtype = dtype;
        c.batch = n % 5 == 1 ? 2 : 1;  // two with key lengths: the second sees nothing
        c.dim = n % 2 == 0 ? 64 : 128;
        c.causal = n % 3 != 2;
        c.window = window;
        c.softcap = softcap ? 5.0f : 0.0f;  // low enough to bend the scores
        c.sinks = sinks;
        c.scale = softcap ? 0.5f : 0.0f;
        c.q_len = n % 4 == 3 ? 1 : 130 + 37 * (n % 3);
        c.kv_len = 400 + 50 * (n % 2);
        c.lengths = n % 5 == 1;
        c.mask = n % 7 == 3 ? Mask::kBoolPerBatch : n % 7 == 5 ? Mask::kAdditivePerHead
                                                              : Mask::kNone;
        RunAndCompare(c, rng);
        if (HasFatalFailure()) return;
        ++n;
      }
    }
  }
}

// ALiBi with the rules it meets in a model's layers (oracle::AlibiCases:
// causal and not, GQA, Lq < Lk and Lq > Lk, a window, sinks, softcapping,
// masks, key lengths) in every dtype.
TEST(FlashAttentionKernel, AlibiMatchesFloat64) {
  REQUIRE_GPU();
  std::mt19937 rng(9);
  for (DType dtype : kDTypes) {
    for (const Case& c : oracle::AlibiCases({dtype})) {
      RunAndCompare(c, rng);
      if (HasFatalFailure()) return;
    }
  }
}

// A relative position bias table with the rules it meets
// (oracle::RelativeBiasCases: both clamps binding and none, GQA, ALiBi
// beside it, Lq > Lk, a window, sinks, softcapping, masks, key lengths) in
// every dtype.
TEST(FlashAttentionKernel, RelativeBiasMatchesFloat64) {
  REQUIRE_GPU();
  std::mt19937 rng(10);
  for (DType dtype : kDTypes) {
    for (const Case& c : oracle::RelativeBiasCases({dtype})) {
      RunAndCompare(c, rng);
      if (HasFatalFailure()) return;
    }
  }
}

// Relative position embeddings with the rules they meet
// (oracle::RelativeEmbeddingCases: each set of tables, both clamps binding
// and none, GQA, ALiBi and a relative bias beside them, Lq > Lk, a window,
// sinks, softcapping, masks, key lengths) in every dtype.
TEST(FlashAttentionKernel, RelativeEmbeddingsMatchFloat64) {
  REQUIRE_GPU();
  std::mt19937 rng(11);
  for (DType dtype : kDTypes) {
    for (const Case& c : oracle::RelativeEmbeddingCases({dtype})) {
      RunAndCompare(c, rng);
      if (HasFatalFailure()) return;
    }
  }
}

// Scores far apart (scale 1 instead of 1 / sqrt(dim): scores spread over
// about +-15): the running maximum moves across many key tiles and earlier
// tiles' sums shrink by exp2 of large differences; fp32 still within 1e-5
// of float64.
TEST(FlashAttentionKernel, LongRowsWithLargeScoresStayExact) {
  REQUIRE_GPU();
  std::mt19937 rng(8);
  for (int64_t dim : {64, 128}) {
    Case c;
    c.batch = 1;
    c.heads = c.kv_heads = 2;
    c.dim = dim;
    c.q_len = 40;
    c.kv_len = 2500;
    c.causal = dim == 128;
    c.scale = 1.0f;
    RunAndCompare(c, rng);
    if (HasFatalFailure()) return;
  }
}

}  // namespace
}  // namespace attnserve::cuda
