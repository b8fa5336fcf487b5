// The element-wise CUDA kernels (engine/cuda/elementwise.cu, compiled for
// the host) run on warp_emulator.h against loops over the same definitions
// (attention_kernels.h): a mask expanded into cuDNN's bias through its
// broadcast strides with the bucket's padding, dtype conversion, the
// projections' bias, the output gate, the weights' mean over heads. Checked without a GPU;
// cuda_engine_test runs them on one, inside the engine.
#include "tests/unit/engine/cuda/warp_emulator.h"  // first: it stands in for the device

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "engine/cuda/elementwise.cu"  // NOLINT(build/include): the kernels themselves
#include "engine/tensor.h"
#include "gtest/gtest.h"

namespace attnserve::cuda {
namespace {

std::vector<float> Random(int64_t n, std::mt19937& rng) {
  std::uniform_real_distribution<float> dist(-3.0f, 3.0f);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

std::vector<uint8_t> ToBytes(const std::vector<float>& v, DType dtype) {
  std::vector<uint8_t> bytes(v.size() * DTypeSize(dtype));
  ConvertFromFloat(v.data(), static_cast<int64_t>(v.size()), dtype, bytes.data());
  return bytes;
}

// A bool mask [B, 1, Lq, Lk] broadcast over heads and an additive FLOAT16
// mask [1, H, 1, Lk] broadcast over batch and rows, each expanded to a
// bucket [B, H, q_pad, kv_pad] in FLOAT32 and BFLOAT16: the mask's value
// (0 or -inf for bool) inside the lengths, 0 in the padding.
TEST(ElementwiseEmulated, ExpandMaskReadsBroadcastStridesAndPadsWithZeros) {
  std::mt19937 rng(41);
  constexpr int64_t kB = 2, kH = 3, kLq = 5, kLk = 7, kQPad = 8, kKvPad = 16;
  std::vector<uint8_t> bools(kB * kLq * kLk);
  for (size_t i = 0; i < bools.size(); ++i) bools[i] = (i * 7 + 3) % 4 != 0;
  MaskParams bool_mask;
  bool_mask.kind = MaskParams::Kind::kBool;
  bool_mask.dtype = DType::kBool;
  bool_mask.data = bools.data();
  bool_mask.stride_b = kLq * kLk;
  bool_mask.stride_q = kLk;
  bool_mask.stride_k = 1;
  const std::vector<float> additive = Random(kH * kLk, rng);
  const std::vector<uint8_t> additive_bytes = ToBytes(additive, DType::kFloat16);
  MaskParams add_mask;
  add_mask.kind = MaskParams::Kind::kAdditive;
  add_mask.dtype = DType::kFloat16;
  add_mask.data = additive_bytes.data();
  add_mask.stride_h = kLk;
  add_mask.stride_k = 1;
  for (const MaskParams& m : {bool_mask, add_mask}) {
    for (const DType out_type : {DType::kFloat32, DType::kBFloat16}) {
      SCOPED_TRACE(std::string(m.kind == MaskParams::Kind::kBool ? "bool" : "additive") + " into " +
                   std::string(DTypeName(out_type)));
      std::vector<uint8_t> out(kB * kH * kQPad * kKvPad * DTypeSize(out_type), 0xff);
      ASSERT_EQ(LaunchExpandMask(m, kB, kH, kLq, kLk, kQPad, kKvPad, out.data(), out_type,
                                 /*stream=*/nullptr),
                cudaSuccess);
      int64_t bad = 0;
      for (int64_t b = 0; b < kB; ++b)
        for (int64_t h = 0; h < kH; ++h)
          for (int64_t i = 0; i < kQPad; ++i)
            for (int64_t j = 0; j < kKvPad; ++j) {
              float want = 0.0f;
              if (i < kLq && j < kLk) {
                if (m.kind == MaskParams::Kind::kBool) {
                  want = bools[(b * kLq + i) * kLk + j] != 0 ? 0.0f : -INFINITY;
                } else {
                  want = LoadAsFloat(DType::kFloat16, additive_bytes.data(), h * kLk + j);
                }
              }
              // The stored value: `want` rounded to out_type.
              uint8_t rounded[4];
              ConvertFromFloat(&want, 1, out_type, rounded);
              ConvertToFloat(out_type, rounded, 1, &want);
              const float got =
                  LoadAsFloat(out_type, out.data(), ((b * kH + h) * kQPad + i) * kKvPad + j);
              if (!(got == want) && bad++ < 5) {
                ADD_FAILURE() << "(" << b << ", " << h << ", " << i << ", " << j << "): got "
                              << got << ", want " << want;
              }
            }
      EXPECT_EQ(bad, 0);
    }
  }
}

// Conversion rounds to nearest even as the host's ConvertFromFloat does.
TEST(ElementwiseEmulated, ConvertRoundsAsTheHostDoes) {
  std::mt19937 rng(42);
  const std::vector<float> values = Random(3000, rng);
  const int64_t n = static_cast<int64_t>(values.size());
  for (const DType to : {DType::kFloat16, DType::kBFloat16}) {
    SCOPED_TRACE(DTypeName(to));
    std::vector<uint8_t> got(n * DTypeSize(to), 0xff);
    ASSERT_EQ(LaunchConvert(values.data(), DType::kFloat32, got.data(), to, n, nullptr),
              cudaSuccess);
    EXPECT_EQ(got, ToBytes(values, to));
    // And back to fp32, exactly.
    std::vector<float> back(n, std::nanf(""));
    ASSERT_EQ(LaunchConvert(got.data(), to, back.data(), DType::kFloat32, n, nullptr),
              cudaSuccess);
    std::vector<float> want(n);
    ConvertToFloat(to, got.data(), n, want.data());
    EXPECT_EQ(back, want);
  }
}

TEST(ElementwiseEmulated, AddBiasAddsPerColumn) {
  std::mt19937 rng(43);
  constexpr int64_t kRows = 37, kCols = 29;
  const std::vector<float> y = Random(kRows * kCols, rng), bias = Random(kCols, rng);
  for (const DType type : {DType::kFloat32, DType::kBFloat16}) {
    SCOPED_TRACE(DTypeName(type));
    std::vector<uint8_t> got = ToBytes(y, type);
    const std::vector<uint8_t> bias_bytes = ToBytes(bias, type);
    std::vector<float> y_in(y.size()), b_in(bias.size());
    ConvertToFloat(type, got.data(), kRows * kCols, y_in.data());
    ConvertToFloat(type, bias_bytes.data(), kCols, b_in.data());
    ASSERT_EQ(LaunchAddBias(got.data(), bias_bytes.data(), type, kRows, kCols, nullptr),
              cudaSuccess);
    std::vector<float> want(y.size());
    for (int64_t r = 0; r < kRows; ++r)
      for (int64_t c = 0; c < kCols; ++c) want[r * kCols + c] = y_in[r * kCols + c] + b_in[c];
    EXPECT_EQ(got, ToBytes(want, type));
  }
}

// Gated attention: x * sigmoid(gate) against float64 sigmoid, within the
// type's rounding (the sigmoid rounded to bf16/fp16 first, then the
// product, as PyTorch computes such a layer); an infinite gate closes
// (x * 0) or opens (x exactly) the gate.
TEST(ElementwiseEmulated, OutputGateIsSigmoidTimesValue) {
  std::mt19937 rng(44);
  std::vector<float> x = Random(1000, rng), gate = Random(1000, rng);
  for (float& g : gate) g *= 4.0f;  // over sigmoid's whole curve
  gate[0] = INFINITY;
  gate[1] = -INFINITY;
  const int64_t n = static_cast<int64_t>(x.size());
  for (const DType type : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
    SCOPED_TRACE(DTypeName(type));
    std::vector<uint8_t> got = ToBytes(x, type);
    const std::vector<uint8_t> gate_bytes = ToBytes(gate, type);
    std::vector<float> x_in(n), g_in(n), out(n);
    ConvertToFloat(type, got.data(), n, x_in.data());
    ConvertToFloat(type, gate_bytes.data(), n, g_in.data());
    ASSERT_EQ(LaunchOutputGate(got.data(), gate_bytes.data(), type, n, nullptr), cudaSuccess);
    ConvertToFloat(type, got.data(), n, out.data());
    // Two roundings to the type (or float's few ulps for FLOAT32).
    const double eps = type == DType::kFloat32    ? 1e-6
                       : type == DType::kBFloat16 ? 2.0 / 256
                                                  : 2.0 / 2048;
    for (int64_t i = 0; i < n; ++i) {
      const double want = x_in[i] / (1.0 + std::exp(-static_cast<double>(g_in[i])));
      // fp16 results below 2^-14 are subnormal: spaced 2^-24 apart.
      const double floor = type == DType::kFloat16 ? std::ldexp(1.0, -24) : 1e-30;
      ASSERT_NEAR(out[i], want, eps * std::fabs(want) + floor) << "element " << i;
    }
    EXPECT_EQ(out[0], x_in[0]);
    EXPECT_EQ(out[1], 0.0f);
  }
}

// Latent attention's keys: each head's nope features then the token's one
// rotary key, every value copied exactly, in each float dtype.
TEST(ElementwiseEmulated, LatentKeysAreEachHeadsNopeThenTheSharedRope) {
  std::mt19937 rng(45);
  constexpr int64_t kRows = 7, kHeads = 3, kNope = 5, kRope = 4, kDim = kNope + kRope;
  const std::vector<float> nope = Random(kRows * kHeads * kNope, rng);
  const std::vector<float> rope = Random(kRows * kRope, rng);
  for (const DType type : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
    SCOPED_TRACE(DTypeName(type));
    const std::vector<uint8_t> nope_bytes = ToBytes(nope, type), rope_bytes = ToBytes(rope, type);
    std::vector<uint8_t> key(kRows * kHeads * kDim * DTypeSize(type), 0xFF);
    ASSERT_EQ(LaunchAssembleLatentKeys(key.data(), nope_bytes.data(), rope_bytes.data(), type,
                                       kRows, kHeads, kNope, kRope, nullptr),
              cudaSuccess);
    const size_t es = DTypeSize(type);
    for (int64_t r = 0; r < kRows; ++r) {
      for (int64_t h = 0; h < kHeads; ++h) {
        const uint8_t* k = key.data() + ((r * kHeads + h) * kDim) * es;
        EXPECT_EQ(std::memcmp(k, nope_bytes.data() + (r * kHeads + h) * kNope * es, kNope * es),
                  0)
            << "row " << r << " head " << h;
        EXPECT_EQ(std::memcmp(k + kNope * es, rope_bytes.data() + r * kRope * es, kRope * es), 0)
            << "row " << r << " head " << h;
      }
    }
  }
}

// The mean over heads, summed in head order: the same float sum on the host.
TEST(ElementwiseEmulated, AverageHeadsIsTheMeanInHeadOrder) {
  std::mt19937 rng(44);
  constexpr int64_t kBatch = 2, kHeads = 5, kPerHead = 300;
  const std::vector<float> probs = Random(kBatch * kHeads * kPerHead, rng);
  std::vector<float> got(kBatch * kPerHead, std::nanf(""));
  ASSERT_EQ(LaunchAverageHeads(probs.data(), kBatch, kHeads, kPerHead, got.data(),
                               DType::kFloat32, nullptr),
            cudaSuccess);
  for (int64_t b = 0; b < kBatch; ++b) {
    for (int64_t r = 0; r < kPerHead; ++r) {
      float sum = 0.0f;
      for (int64_t h = 0; h < kHeads; ++h) sum += probs[(b * kHeads + h) * kPerHead + r];
      ASSERT_EQ(got[b * kPerHead + r], sum * (1.0f / kHeads)) << "b " << b << " r " << r;
    }
  }
}

}  // namespace
}  // namespace attnserve::cuda
