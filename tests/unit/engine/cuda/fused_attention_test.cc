// The fused attention kernels (engine/cuda/flash_attention.cu for FLOAT16 and
// BFLOAT16, flash_attention_fp32.cu for FLOAT32): which requests each takes
// (host-side, runs without a GPU), and on a GPU each kernel launched
// directly against float64 attention computed here from the same inputs (as
// rounded to the dtype), through every rule they serve: causal
// (bottom-right), key lengths, bool and additive masks through broadcast
// strides, grouped-query heads, Lq != Lk, the head and token layouts, rows
// that see no key, another output dtype, and the rules of today's layers:
// sliding windows, logit softcapping, sinks. fp32 results must be within
// 1e-5 of float64 (the GPU issue's bar). Linked against the CUDA backend's
// objects (the module hides them), so the kernel that runs is the one under
// test, not whatever the engine routes to.
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
  a.q_stride_row = a.k_stride_row = a.v_stride_row = a.o_stride_row = head_dim;
  a.q_stride_h = a.o_stride_h = a.q_len * head_dim;
  a.k_stride_h = a.v_stride_h = a.kv_len * head_dim;
  a.q_stride_b = a.o_stride_b = a.num_heads * a.q_stride_h;
  a.k_stride_b = a.v_stride_b = a.num_kv_heads * a.k_stride_h;
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

TEST(FlashAttentionSupports, LayerFeaturesAreTheWindowSoftcapAndSinks) {
  static const float kSinks[4] = {};
  AttentionParams a = Plain(DType::kFloat16, 64);
  EXPECT_FALSE(UsesLayerFeatures(a));
  a.causal = true;
  a.mask.kind = MaskParams::Kind::kAdditive;
  EXPECT_FALSE(UsesLayerFeatures(a));
  for (int feature = 0; feature < 3; ++feature) {
    AttentionParams f = Plain(DType::kFloat16, 64);
    if (feature == 0) f.window = 1;
    if (feature == 1) f.softcap = 50.0f;
    if (feature == 2) f.sinks = kSinks;
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

enum class Mask { kNone, kBoolPerBatch, kAdditivePerHead };

struct Case {
  DType dtype = DType::kFloat32;
  DType out_dtype = DType::kFloat32;  // kBool: the inputs' dtype
  int64_t batch = 2, heads = 4, kv_heads = 2, q_len = 1, kv_len = 1, dim = 64;
  bool causal = false;
  bool token_layout = false;  // [B, L, H * D] instead of [B, H, L, D]
  bool lengths = false;
  Mask mask = Mask::kNone;
  float scale = 0.0f;  // 0: 1 / sqrt(dim)
  int64_t window = 0;
  float softcap = 0.0f;
  bool sinks = false;

  std::string Describe() const {
    return std::string(DTypeName(dtype)) + " " +
           testing::PrintToString(
               std::vector<int64_t>{batch, heads, kv_heads, q_len, kv_len, dim}) +
           (causal ? " causal" : "") + (token_layout ? " tokens" : " heads") +
           (lengths ? " lengths" : "") + " mask " + std::to_string(static_cast<int>(mask)) +
           " window " + std::to_string(window) + " softcap " + std::to_string(softcap) +
           (sinks ? " sinks" : "") + " out " + std::string(DTypeName(out_dtype));
  }
};

// Element strides of [B, rows, heads, dim] in one of the two layouts.
void Strides(const Case& c, int64_t heads, int64_t rows, int64_t dim, int64_t* sb, int64_t* sh,
             int64_t* sr) {
  if (c.token_layout) {
    *sr = heads * dim;
    *sh = dim;
    *sb = rows * heads * dim;
  } else {
    *sr = dim;
    *sh = rows * dim;
    *sb = heads * rows * dim;
  }
}

// n random values in [-1, 1] as rounded to `dtype`: `bytes` holds them in
// the dtype, the result as floats (what the kernel reads, exactly).
std::vector<float> RandomInput(DType dtype, int64_t n, std::mt19937& rng,
                               std::vector<uint8_t>* bytes) {
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  std::vector<float> values(n);
  for (float& x : values) x = dist(rng);
  bytes->resize(static_cast<size_t>(n) * DTypeSize(dtype));
  ConvertFromFloat(values.data(), n, dtype, bytes->data());
  ConvertToFloat(dtype, bytes->data(), n, values.data());
  return values;
}

// Device copies, freed on scope exit.
struct DeviceBuffers {
  std::vector<void*> owned;
  ~DeviceBuffers() {
    for (void* p : owned) (void)cudaFree(p);
  }
  void* Copy(const void* host, size_t bytes) {
    void* p = nullptr;
    if (cudaMalloc(&p, std::max<size_t>(bytes, 1)) != cudaSuccess) return nullptr;
    owned.push_back(p);
    if (cudaMemcpy(p, host, bytes, cudaMemcpyHostToDevice) != cudaSuccess) return nullptr;
    return p;
  }
};

// Runs case c on its dtype's kernel and checks every output against float64.
void RunAndCompare(const Case& c, std::mt19937& rng) {
  SCOPED_TRACE(c.Describe());
  const DType out_dtype = c.out_dtype == DType::kBool ? c.dtype : c.out_dtype;
  const int64_t nq = c.batch * c.heads * c.q_len * c.dim;
  const int64_t nk = c.batch * c.kv_heads * c.kv_len * c.dim;
  std::vector<uint8_t> q_bytes, k_bytes, v_bytes;
  const std::vector<float> q = RandomInput(c.dtype, nq, rng, &q_bytes);
  const std::vector<float> k = RandomInput(c.dtype, nk, rng, &k_bytes);
  const std::vector<float> v = RandomInput(c.dtype, nk, rng, &v_bytes);
  std::vector<int64_t> lengths(c.batch, c.kv_len);
  if (c.lengths) {
    lengths[0] = c.kv_len / 3;
    if (c.batch > 1) lengths[1] = 0;  // a sequence with no keys: zeros
  }
  std::vector<float> sinks;
  for (int64_t h = 0; h < c.heads && c.sinks; ++h) sinks.push_back(-1.0f + 0.7f * h);
  // Masks: bool [B, 1, Lq, Lk] (every fifth key of each row blocked, row 1
  // blocked whole), additive [1, H, 1, Lk] (a head-dependent ramp, -inf on
  // key 0 of head 0).
  std::vector<uint8_t> bool_mask;
  std::vector<float> add_mask;
  MaskParams mask;
  if (c.mask == Mask::kBoolPerBatch) {
    bool_mask.assign(c.batch * c.q_len * c.kv_len, 1);
    for (int64_t b = 0; b < c.batch; ++b)
      for (int64_t i = 0; i < c.q_len; ++i)
        for (int64_t j = 0; j < c.kv_len; ++j)
          if ((i + j + b) % 5 == 0 || i == 1) bool_mask[(b * c.q_len + i) * c.kv_len + j] = 0;
    mask.kind = MaskParams::Kind::kBool;
    mask.dtype = DType::kBool;
    mask.stride_b = c.q_len * c.kv_len;
    mask.stride_q = c.kv_len;
    mask.stride_k = 1;
  } else if (c.mask == Mask::kAdditivePerHead) {
    add_mask.resize(c.heads * c.kv_len);
    for (int64_t h = 0; h < c.heads; ++h)
      for (int64_t j = 0; j < c.kv_len; ++j)
        add_mask[h * c.kv_len + j] = -0.01f * static_cast<float>((j * (h + 1)) % 37);
    add_mask[0] = -std::numeric_limits<float>::infinity();
    mask.kind = MaskParams::Kind::kAdditive;
    mask.dtype = DType::kFloat32;
    mask.stride_h = c.kv_len;
    mask.stride_k = 1;
  }

  AttentionParams a;
  a.batch = c.batch;
  a.num_heads = c.heads;
  a.num_kv_heads = c.kv_heads;
  a.head_dim = a.head_dim_v = c.dim;
  a.q_len = c.q_len;
  a.kv_len = c.kv_len;
  a.dtype = c.dtype;
  a.out_dtype = out_dtype;
  a.causal = c.causal;
  a.window = c.window;
  a.softcap = c.softcap;
  a.scale = c.scale > 0.0f ? c.scale
                           : static_cast<float>(1.0 / std::sqrt(static_cast<double>(c.dim)));
  Strides(c, c.heads, c.q_len, c.dim, &a.q_stride_b, &a.q_stride_h, &a.q_stride_row);
  Strides(c, c.kv_heads, c.kv_len, c.dim, &a.k_stride_b, &a.k_stride_h, &a.k_stride_row);
  Strides(c, c.kv_heads, c.kv_len, c.dim, &a.v_stride_b, &a.v_stride_h, &a.v_stride_row);
  Strides(c, c.heads, c.q_len, c.dim, &a.o_stride_b, &a.o_stride_h, &a.o_stride_row);
  a.mask = mask;

  // Host data is laid out by the same strides (both layouts are dense).
  const size_t out_bytes = static_cast<size_t>(nq) * DTypeSize(out_dtype);
  DeviceBuffers device;
  a.q = device.Copy(q_bytes.data(), q_bytes.size());
  a.k = device.Copy(k_bytes.data(), k_bytes.size());
  a.v = device.Copy(v_bytes.data(), v_bytes.size());
  std::vector<uint8_t> out(out_bytes, 0xff);  // NaNs where nothing is written
  a.out = device.Copy(out.data(), out_bytes);
  if (c.lengths) {
    a.key_lengths =
        static_cast<const int64_t*>(device.Copy(lengths.data(), lengths.size() * 8));
  }
  if (c.sinks) a.sinks = static_cast<const float*>(device.Copy(sinks.data(), sinks.size() * 4));
  if (!bool_mask.empty()) a.mask.data = device.Copy(bool_mask.data(), bool_mask.size());
  if (!add_mask.empty()) a.mask.data = device.Copy(add_mask.data(), add_mask.size() * 4);
  for (void* p : device.owned) ASSERT_NE(p, nullptr) << "device allocation or copy";

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
  CUDA_OK(cudaMemcpy(out.data(), const_cast<void*>(static_cast<const void*>(a.out)), out_bytes,
                     cudaMemcpyDeviceToHost));

  // float64 attention, straight from attention_params.h's definition.
  const int64_t group = c.heads / c.kv_heads;
  // fp32: 1e-5 absolute. fp16/bf16: P is rounded to the dtype for P V.
  double atol = 1e-5, rtol = 0.0;
  if (c.dtype == DType::kFloat16) atol = 2e-3, rtol = 1e-2;
  if (c.dtype == DType::kBFloat16) atol = 1.5e-2, rtol = 2e-2;
  if (out_dtype == DType::kFloat16) rtol = std::max(rtol, 1e-3);
  if (out_dtype == DType::kBFloat16) rtol = std::max(rtol, 8e-3);
  int64_t bad = 0;
  std::vector<double> p(c.kv_len);
  for (int64_t b = 0; b < c.batch; ++b) {
    for (int64_t h = 0; h < c.heads; ++h) {
      const int64_t hk = h / group;
      for (int64_t i = 0; i < c.q_len; ++i) {
        const int64_t position = i + c.kv_len - c.q_len;
        double max = -INFINITY;
        bool sees = false;
        for (int64_t j = 0; j < c.kv_len; ++j) {
          p[j] = -INFINITY;
          if (j >= lengths[b]) continue;
          if (c.causal && j > position) continue;
          if (c.window > 0 && j < position - c.window + 1) continue;
          if (c.mask == Mask::kBoolPerBatch && bool_mask[(b * c.q_len + i) * c.kv_len + j] == 0)
            continue;
          const double extra = c.mask == Mask::kAdditivePerHead ? add_mask[h * c.kv_len + j] : 0;
          if (std::isinf(extra)) continue;
          const float* qi = &q[b * a.q_stride_b + h * a.q_stride_h + i * a.q_stride_row];
          const float* kj = &k[b * a.k_stride_b + hk * a.k_stride_h + j * a.k_stride_row];
          double dot = 0.0;
          for (int64_t d = 0; d < c.dim; ++d) dot += static_cast<double>(qi[d]) * kj[d];
          double t = dot * static_cast<double>(a.scale);  // the scale as the kernel has it
          if (c.softcap > 0.0f) t = c.softcap * std::tanh(t / c.softcap);
          p[j] = t + extra;
          max = std::max(max, p[j]);
          sees = true;
        }
        // A row that sees a key counts its sink in the max and the sum.
        const double sink = sees && c.sinks ? sinks[h] : -INFINITY;
        max = std::max(max, sink);
        double sum = sees && c.sinks ? std::exp(sink - max) : 0.0;
        for (int64_t j = 0; j < c.kv_len; ++j) {
          p[j] = std::isinf(p[j]) ? 0.0 : std::exp(p[j] - max);
          sum += p[j];
        }
        for (int64_t d = 0; d < c.dim; ++d) {
          double want = 0.0;
          if (sees) {
            for (int64_t j = 0; j < c.kv_len; ++j) {
              if (p[j] != 0.0) {
                want += p[j] * v[b * a.v_stride_b + hk * a.v_stride_h + j * a.v_stride_row + d];
              }
            }
            want /= sum;
          }
          const int64_t at = b * a.o_stride_b + h * a.o_stride_h + i * a.o_stride_row + d;
          const double got = LoadAsFloat(out_dtype, out.data(), at);
          if (!(std::abs(got - want) <= atol + rtol * std::abs(want))) {  // NaN fails too
            if (bad < 5) {
              ADD_FAILURE() << "b " << b << " h " << h << " i " << i << " d " << d << ": got "
                            << got << ", float64 " << want;
            }
            ++bad;
          }
        }
      }
    }
  }
  EXPECT_EQ(bad, 0) << "outputs off float64 by more than the tolerance";
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
