// QK-norm and RoPE on the GPU (engine/cuda/qk_transform.cu, the kernels and
// their launchers compiled for the host) run on warp_emulator.h against the
// cpu engine's own functions (engine/cpu/rotary.h), which the CUDA engine
// promises to match: every RoPE scaling type, partial and interleaved
// rotation, implicit and explicit positions per sequence, padded row
// strides, QK-norm with and without the (1 + w) offset, in FLOAT32 and
// BFLOAT16 (the cpu engine's dtypes), and FLOAT16 against float64; and
// Llama 4's query temperature. Checked
// without a GPU; cuda_engine_test runs them on one (LlmLayerFeatures*).
#include "tests/unit/engine/cuda/warp_emulator.h"  // first: it stands in for the device

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "engine/cpu/rotary.h"
#include "engine/cuda/qk_transform.cu"  // NOLINT(build/include): the kernels themselves
#include "engine/rope.h"
#include "engine/temperature.h"
#include "engine/tensor.h"
#include "gtest/gtest.h"

namespace attnserve::cuda {
namespace {

// A [rows, row_stride] matrix of `dtype` whose first heads * head_dim
// features of each row are random in [-2, 2]; the padding past them holds
// a marker that must survive.
struct Rows {
  DType dtype;
  int64_t rows, row_stride;
  std::vector<uint8_t> bytes;
  float At(int64_t i) const { return LoadAsFloat(dtype, bytes.data(), i); }
};
constexpr float kPadding = 7.0f;

Rows RandomRows(DType dtype, int64_t rows, int64_t heads, int64_t head_dim, int64_t row_stride,
                std::mt19937& rng) {
  std::uniform_real_distribution<float> dist(-2.0f, 2.0f);
  std::vector<float> values(static_cast<size_t>(rows * row_stride));
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < row_stride; ++c) {
      values[r * row_stride + c] = c < heads * head_dim ? dist(rng) : kPadding;
    }
  }
  Rows out{dtype, rows, row_stride, {}};
  out.bytes.resize(values.size() * DTypeSize(dtype));
  ConvertFromFloat(values.data(), static_cast<int64_t>(values.size()), dtype, out.bytes.data());
  return out;
}

// Every element of `got` within rtol of `want` (relative to max(|want|, 1)).
int64_t CountOff(const Rows& got, const Rows& want, double rtol) {
  int64_t bad = 0;
  for (int64_t i = 0; i < got.rows * got.row_stride; ++i) {
    const double g = got.At(i), w = want.At(i);
    if (!(std::abs(g - w) <= rtol * std::max(std::abs(w), 1.0))) {
      if (bad < 5) ADD_FAILURE() << "element " << i << ": got " << g << ", want " << w;
      ++bad;
    }
  }
  return bad;
}

struct RopeCase {
  std::string name;
  RopeConfig rope;
};

std::vector<RopeCase> RopeCases(int64_t head_dim) {
  std::vector<RopeCase> cases;
  RopeConfig r;
  r.type = RopeConfig::Type::kDefault;
  r.theta = 500000.0;
  r.rotary_dim = head_dim;
  cases.push_back({"default", r});
  r.type = RopeConfig::Type::kLlama3;
  r.factor = 8.0;
  r.low_freq_factor = 1.0;
  r.high_freq_factor = 4.0;
  r.original_max_position_embeddings = 8192;
  cases.push_back({"llama3", r});
  r = RopeConfig{};
  r.type = RopeConfig::Type::kLinear;
  r.factor = 2.0;
  r.rotary_dim = head_dim / 2;  // partial, interleaved (GPT-J)
  r.interleaved = true;
  cases.push_back({"linear partial interleaved", r});
  r = RopeConfig{};
  r.type = RopeConfig::Type::kYarn;
  r.theta = 150000.0;
  r.rotary_dim = head_dim;
  r.factor = 32.0;
  r.original_max_position_embeddings = 4096;
  r.beta_fast = 32.0;
  r.beta_slow = 1.0;
  r.attention_factor = 1.3465735902799727;  // scales cos and sin
  cases.push_back({"yarn", r});
  r = RopeConfig{};
  r.type = RopeConfig::Type::kLongRope;  // Phi-3.5: a divisor per frequency
  r.rotary_dim = head_dim * 3 / 4;       // partial (Phi-4-mini)
  r.factor = 32.0;
  r.original_max_position_embeddings = 4096;
  for (int64_t i = 0; i < r.rotary_dim / 2; ++i) {
    r.short_factor.push_back(1.0 + 0.05 * static_cast<double>(i));
    r.long_factor.push_back(1.0 + 1.5 * static_cast<double>(i));
  }
  cases.push_back({"longrope", r});
  return cases;
}

TEST(QkTransformEmulated, RopeMatchesTheCpuEngine) {
  std::mt19937 rng(31);
  constexpr int64_t kBatch = 2, kSeq = 5, kHeads = 3, kDim = 64, kStride = kHeads * kDim + 8;
  // Explicit positions, per sequence, with gaps and past 4096 (YaRN's and
  // Llama 3's scaled range); read from offset `first` of each row.
  const int64_t first = 2;
  const int64_t positions_stride = first + kSeq;
  const std::vector<int64_t> positions = {0, 0, 3, 4, 9, 10, 4100,  // sequence 0
                                          0, 0, 0, 1, 2, 8000, 8001};
  for (const RopeCase& rc : RopeCases(kDim)) {
    ASSERT_TRUE(ValidateRope(rc.rope, kDim).ok()) << rc.name;
    // The largest position of the explicit ones (LongRoPE's long factors).
    const RopeFrequencies freq = ComputeRopeFrequencies(rc.rope, 8001);
    for (const DType dtype : {DType::kFloat32, DType::kBFloat16}) {
      for (const bool explicit_positions : {false, true}) {
        SCOPED_TRACE(rc.name + " " + std::string(DTypeName(dtype)) +
                     (explicit_positions ? " explicit positions" : " implicit"));
        const Rows input = RandomRows(dtype, kBatch * kSeq, kHeads, kDim, kStride, rng);
        Rows gpu = input, cpu = input;
        RotaryArgs args;
        args.inv_freq = freq.inv_freq.data();
        args.attention_factor = freq.attention_factor;
        args.rotary_dim = rc.rope.rotary_dim;
        args.interleaved = rc.rope.interleaved;
        args.first = first;
        if (explicit_positions) {
          args.positions = positions.data();
          args.positions_stride = positions_stride;
        }
        ASSERT_EQ(LaunchRotary(gpu.bytes.data(), dtype, kBatch * kSeq, kSeq, kStride, kHeads, kDim,
                               args, /*stream=*/nullptr),
                  cudaSuccess);
        const size_t elem = DTypeSize(dtype);
        for (int64_t b = 0; b < kBatch; ++b) {
          cpu::RotateRows(rc.rope, freq, dtype, cpu.bytes.data() + b * kSeq * kStride * elem,
                          kSeq, kStride, kHeads, kDim, first,
                          explicit_positions ? positions.data() + b * positions_stride + first
                                             : nullptr,
                          /*threads=*/1);
        }
        // The same float operations on the same values: equal but for a
        // fused multiply-add the host compiler may form on one side.
        EXPECT_EQ(CountOff(gpu, cpu, dtype == DType::kFloat32 ? 1e-6 : 8e-3), 0);
        int64_t changed = 0;
        for (int64_t i = 0; i < input.rows * input.row_stride; ++i) {
          changed += gpu.At(i) != input.At(i);
        }
        // A good share of the rotated features change (a small angle may
        // leave a bf16 as it was).
        EXPECT_GT(changed, input.rows * kHeads * args.rotary_dim / 4) << "too little rotated";
      }
    }
  }
}

// FLOAT16 (not a cpu engine dtype): each rotated pair against float64 over
// the same inputs and the float cos and sin.
TEST(QkTransformEmulated, RopeInFloat16MatchesFloat64) {
  std::mt19937 rng(32);
  constexpr int64_t kRows = 6, kHeads = 2, kDim = 32, kStride = kHeads * kDim;
  const RopeConfig rope = RopeCases(kDim)[0].rope;
  const RopeFrequencies freq = ComputeRopeFrequencies(rope, 45);
  const Rows input = RandomRows(DType::kFloat16, kRows, kHeads, kDim, kStride, rng);
  Rows gpu = input;
  RotaryArgs args;
  args.inv_freq = freq.inv_freq.data();
  args.rotary_dim = rope.rotary_dim;
  args.first = 40;
  ASSERT_EQ(LaunchRotary(gpu.bytes.data(), DType::kFloat16, kRows, kRows, kStride, kHeads, kDim,
                         args, /*stream=*/nullptr),
            cudaSuccess);
  std::vector<double> c(kDim / 2), s(kDim / 2);
  int64_t bad = 0;
  for (int64_t r = 0; r < kRows; ++r) {
    RopeAngles(freq, args.first + r, c.data(), s.data());
    for (int64_t h = 0; h < kHeads; ++h) {
      for (int64_t i = 0; i < kDim / 2; ++i) {
        const int64_t a = r * kStride + h * kDim + i, b = a + kDim / 2;
        const double cf = static_cast<float>(c[i]), sf = static_cast<float>(s[i]);
        const double want_a = input.At(a) * cf - input.At(b) * sf;
        const double want_b = input.At(b) * cf + input.At(a) * sf;
        for (const auto& [at, want] : {std::pair{a, want_a}, std::pair{b, want_b}}) {
          if (!(std::abs(gpu.At(at) - want) <= 1e-3 * std::max(std::abs(want), 1.0))) {
            if (bad++ < 5) {
              ADD_FAILURE() << "element " << at << ": got " << gpu.At(at) << ", want " << want;
            }
          }
        }
      }
    }
  }
  EXPECT_EQ(bad, 0);
}

// RMSNorm with w or (1 + w) shared by the heads, and Cohere's LayerNorm
// (the mean subtracted) with weights per head.
TEST(QkTransformEmulated, QkNormMatchesTheCpuEngine) {
  std::mt19937 rng(33);
  std::uniform_real_distribution<float> dist(-0.5f, 1.5f);
  constexpr int64_t kRows = 11, kHeads = 3;  // 33 vectors: a partial last block
  struct Kind {
    const char* name;
    bool offset, subtract_mean, per_head_weights;
  };
  for (const int64_t dim : {128, 40}) {  // 40: lanes past the head's end
    std::vector<float> w(kHeads * dim);
    for (float& x : w) x = dist(rng);
    for (const Kind kind : {Kind{"w", false, false, false}, Kind{"(1 + w)", true, false, false},
                            Kind{"layer norm, weights per head", false, true, true}}) {
      for (const DType dtype : {DType::kFloat32, DType::kBFloat16}) {
        SCOPED_TRACE("dim " + std::to_string(dim) + " " + kind.name + " " +
                     std::string(DTypeName(dtype)));
        const int64_t stride = kHeads * dim + 4;
        Rows input = RandomRows(dtype, kRows, kHeads, dim, stride, rng);
        if (kind.subtract_mean) {  // means far from 0, as LayerNorm meets them
          for (int64_t r = 0; r < kRows; ++r) {
            for (int64_t d = 0; d < kHeads * dim; ++d) {
              StoreFromFloat(dtype, input.bytes.data(), r * stride + d,
                             input.At(r * stride + d) + 3.0f);
            }
          }
        }
        Rows gpu = input, cpu = input;
        QkNormConfig norm;
        norm.enabled = true;
        norm.eps = 1e-6;
        norm.weight_offset = kind.offset;
        norm.subtract_mean = kind.subtract_mean;
        norm.per_head_weights = kind.per_head_weights;
        ASSERT_EQ(LaunchQkNorm(gpu.bytes.data(), dtype, kRows, stride, kHeads, dim, w.data(),
                               norm.eps, norm.weight_offset, norm.subtract_mean,
                               norm.per_head_weights ? dim : 0, /*stream=*/nullptr),
                  cudaSuccess);
        cpu::NormalizeRows(norm, w.data(), dtype, cpu.bytes.data(), kRows, stride, kHeads, dim,
                           /*threads=*/1);
        // The float64 sums in another order: the inverse norm may differ in
        // its last float bit.
        EXPECT_EQ(CountOff(gpu, cpu, dtype == DType::kFloat32 ? 1e-6 : 8e-3), 0);
        if (kind.subtract_mean && dtype == DType::kFloat32) {
          // Each head's output has mean 0 before its weights: undo them.
          for (int64_t h = 0; h < kHeads; ++h) {
            double mean = 0;
            for (int64_t d = 0; d < dim; ++d) mean += gpu.At(h * dim + d) / w[h * dim + d];
            EXPECT_NEAR(mean / static_cast<double>(dim), 0.0, 1e-4) << "head " << h;
          }
        }
      }
    }
  }
}

// Llama 4's attention temperature tuning: each query row of two sequences
// (rows 0-12 and 13-25, their indices after 1000 cached tokens) times the
// cpu engine's factor, bitwise in FLOAT32 and BFLOAT16; the row padding is
// kept; and the factor itself against float64 at a floor boundary.
TEST(QkTransformEmulated, QueryTemperatureMatchesTheCpuEngine) {
  std::mt19937 rng(34);
  TemperatureTuning t;
  t.enabled = true;
  t.floor_scale = 8.0;
  t.attn_scale = 0.1;
  constexpr int64_t kSeq = 13, kHeads = 3, kDim = 16, kFirst = 1000;
  const int64_t stride = kHeads * kDim + 4, width = kHeads * kDim;
  for (const DType dtype : {DType::kFloat32, DType::kBFloat16}) {
    SCOPED_TRACE(std::string(DTypeName(dtype)));
    const Rows input = RandomRows(dtype, 2 * kSeq, kHeads, kDim, stride, rng);
    Rows gpu = input, cpu = input;
    TemperatureArgs a;
    a.floor_scale = t.floor_scale;
    a.attn_scale = t.attn_scale;
    a.first = kFirst;
    ASSERT_EQ(LaunchQueryTemperature(gpu.bytes.data(), dtype, 2 * kSeq, kSeq, stride, width, a,
                                     /*stream=*/nullptr),
              cudaSuccess);
    for (int64_t b = 0; b < 2; ++b) {
      cpu::ScaleQueryRows(t, dtype, cpu.bytes.data() + b * kSeq * stride * DTypeSize(dtype), kSeq,
                          stride, width, kFirst, nullptr, /*threads=*/1);
    }
    EXPECT_EQ(gpu.bytes, cpu.bytes);
    EXPECT_NE(gpu.bytes, input.bytes);

    // By position (Ministral 3): each sequence's queries at explicit
    // positions, the last kSeq of its kSeq + 3 keys' positions.
    TemperatureTuning by = t;
    by.by_position = true;
    std::vector<int64_t> positions(2 * (kSeq + 3));
    for (size_t i = 0; i < positions.size(); ++i) positions[i] = 37 * static_cast<int64_t>(i) % 91;
    Rows gpu_by = input, cpu_by = input;
    a.by_position = true;
    a.positions = positions.data();
    a.positions_stride = kSeq + 3;
    a.first = 3;
    ASSERT_EQ(LaunchQueryTemperature(gpu_by.bytes.data(), dtype, 2 * kSeq, kSeq, stride, width,
                                     a, /*stream=*/nullptr),
              cudaSuccess);
    for (int64_t b = 0; b < 2; ++b) {
      cpu::ScaleQueryRows(by, dtype, cpu_by.bytes.data() + b * kSeq * stride * DTypeSize(dtype),
                          kSeq, stride, width, 0, positions.data() + b * (kSeq + 3) + 3,
                          /*threads=*/1);
    }
    EXPECT_EQ(gpu_by.bytes, cpu_by.bytes);
    EXPECT_NE(gpu_by.bytes, gpu.bytes);
  }
  // By position: 1 + beta * log(1 + floor(p / original_max)), 1 below it.
  TemperatureTuning mistral;
  mistral.enabled = mistral.by_position = true;
  mistral.floor_scale = 16384.0;
  mistral.attn_scale = 0.1;
  EXPECT_DOUBLE_EQ(QueryTemperature(mistral, 16383), 1.0);
  EXPECT_DOUBLE_EQ(QueryTemperature(mistral, 16384), 1.0 + 0.1 * std::log(2.0));
  // 1 below index floor_scale - 1; from there log1p(floor((p + 1) / 8)) grows.
  EXPECT_DOUBLE_EQ(QueryTemperature(t, 6), 1.0);
  EXPECT_DOUBLE_EQ(QueryTemperature(t, 7), 1.0 + 0.1 * std::log(2.0));
  EXPECT_DOUBLE_EQ(QueryTemperature(t, 8190), 1.0 + 0.1 * std::log(1024.0));
}

// QKV clipping: the kernel and the cpu engine's pass give the same bits,
// every feature within [-limit, limit], those inside it untouched, the
// padding past each row's width untouched.
TEST(QkTransformEmulated, ClipMatchesTheCpuEngine) {
  std::mt19937 rng(35);
  constexpr int64_t kRows = 9, kHeads = 3, kDim = 16;
  const int64_t stride = kHeads * kDim + 4, width = kHeads * kDim;
  constexpr float kLimit = 0.375f;
  for (const DType dtype : {DType::kFloat32, DType::kBFloat16}) {
    SCOPED_TRACE(std::string(DTypeName(dtype)));
    const Rows input = RandomRows(dtype, kRows, kHeads, kDim, stride, rng);
    Rows gpu = input, cpu = input;
    ASSERT_EQ(LaunchClip(gpu.bytes.data(), dtype, kRows, stride, width, kLimit, nullptr),
              cudaSuccess);
    cpu::ClipRows(dtype, cpu.bytes.data(), kRows, stride, width, kLimit, /*threads=*/1);
    EXPECT_EQ(gpu.bytes, cpu.bytes);
    int64_t clipped = 0;
    for (int64_t r = 0; r < kRows; ++r) {
      for (int64_t d = 0; d < stride; ++d) {
        const float in = LoadAsFloat(dtype, input.bytes.data(), r * stride + d);
        const float out = LoadAsFloat(dtype, gpu.bytes.data(), r * stride + d);
        if (d >= width) {
          ASSERT_EQ(out, in) << "padding at row " << r;
        } else {
          ASSERT_EQ(out, std::clamp(in, -kLimit, kLimit)) << "row " << r << " feature " << d;
          clipped += out != in;
        }
      }
    }
    EXPECT_GT(clipped, 0);
  }
}

}  // namespace
}  // namespace attnserve::cuda
