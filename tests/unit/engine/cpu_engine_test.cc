// The cpu backend against the float64 reference over seeded random cases
// (every mask kind and broadcast shape, GQA, cross attention, Dv != Dk, each
// dtype, fully masked rows, need_weights, sdpa and projection layers), plus
// determinism, batch invariance and concurrent use; and the stacked
// projections: a task alone vs among random co-tenants (fp32, bf16 and fp16
// layers), thread-count invariance, bf16 accuracy, the per-layer cache.
//
// Error metric, per tensor: max_i |cpu_i - ref_i| / max(max_i |ref_i|, 1e-30),
// with the reference computed in float64 and written as FLOAT32. Tolerances by
// the dtype the cpu backend writes (inputs of any dtype are read exactly by
// both engines, so only the output rounding differs):
//   FLOAT32   1e-5  (the bound)
//   FLOAT16   1e-3  (half an fp16 ulp is 2^-11 = 4.9e-4 of the element)
//   BFLOAT16  8e-3  (half a bf16 ulp is 2^-8 = 3.9e-3 of the element)
// Besides that metric: no NaN anywhere, and wherever the reference is exactly
// zero (fully masked rows, masked keys) the cpu result is exactly zero too.
#include "engine/cpu/cpu_engine.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "engine/attention_engine.h"
#include "engine/attention_layer.h"
#include "engine/cpu/flash_attention.h"
#include "engine/cpu/projection.h"
#include "engine/cpu/thread_buffer.h"
#include "engine/model/builtin_models.h"
#include "engine/qk_norm.h"
#include "engine/reference/reference_engine.h"
#include "engine/rope.h"
#include "gtest/gtest.h"
#include "tests/unit/engine/test_latent_layer.h"
#include "tests/unit/engine/test_rng.h"

namespace attnserve {
namespace {

constexpr int kNumRandomCases = 240;

double Tolerance(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return 1e-5;
    case DType::kFloat16: return 1e-3;
    case DType::kBFloat16: return 8e-3;
    case DType::kBool: break;
  }
  return 0.0;
}

using testutil::Rng;

Tensor RandomTensor(Rng& rng, DType dtype, Shape shape, float amplitude) {
  Tensor t(dtype, std::move(shape));
  for (int64_t i = 0; i < t.num_elements(); ++i) {
    StoreFromFloat(dtype, t.data(), i, rng.Uniform(-amplitude, amplitude));
  }
  return t;
}

std::vector<float> AsFloats(const Tensor& t) {
  std::vector<float> out(static_cast<size_t>(t.num_elements()));
  ConvertToFloat(t.dtype(), t.data(), t.num_elements(), out.data());
  return out;
}

std::string DT(DType d) { return std::string(DTypeName(d)); }

// One request and how to run it.
struct Case {
  std::string label;
  std::shared_ptr<const AttentionLayer> layer;
  Tensor q, k, v, mask;  // k, v empty: self-attention
  std::vector<int64_t> key_lengths;
  bool causal = false;
  float scale = 1.0f;
  bool need_weights = false, average_weights = false;
  DType out_dtype = DType::kFloat32, weights_dtype = DType::kFloat32;
  // Per-request options (bare sdpa) and explicit rotary positions.
  int64_t window = 0;
  float softcap = 0.0f;
  std::vector<float> sinks;
  std::vector<int64_t> positions;
};

// Outputs of one run of a case, and the task pointing at them.
struct CaseRun {
  Tensor out, weights;
  AttentionTask task;

  CaseRun(const Case& c, DType out_dtype, DType weights_dtype) {
    task.query = c.q.view();
    if (c.k.byte_size() != 0) {
      task.key = c.k.view();
      task.value = c.v.view();
    }
    task.causal = c.causal;
    task.scale = c.scale;
    task.key_lengths = c.key_lengths;
    if (c.mask.byte_size() != 0) task.attn_mask = c.mask.view();
    task.window = c.window;
    task.softcap = c.softcap;
    task.sinks = c.sinks;
    task.positions = c.positions;
    const TaskDims d = GetTaskDims(c.layer->config, task);
    out = Tensor(out_dtype, OutputShape(c.layer->config, d));
    task.output = out.mutable_view();
    if (c.need_weights) {
      weights = Tensor(weights_dtype, WeightsShape(d, c.average_weights));
      task.weights = weights.mutable_view();
      task.average_weights = c.average_weights;
    }
  }
};

std::shared_ptr<const AttentionLayer> RandomProjectionLayer(Rng& rng, bool self_attention) {
  auto layer = std::make_shared<AttentionLayer>();
  LayerConfig& c = layer->config;
  c.name = "random-projection";
  c.has_projections = true;
  c.num_kv_heads = rng.Pick<int64_t>({1, 2});
  c.num_heads = c.num_kv_heads * rng.Pick<int64_t>({1, 2, 3});
  c.head_dim = rng.Pick<int64_t>({2, 4, 8});
  c.embed_dim = c.num_heads * c.head_dim;
  c.query_dim = rng.Pick<int64_t>({4, 8, 12});
  c.key_dim = self_attention ? c.query_dim : rng.Pick<int64_t>({3, 6, 16});
  c.value_dim = self_attention ? c.query_dim : rng.Pick<int64_t>({5, 8, 16});
  c.out_dim = rng.Pick<int64_t>({3, 8, 10});
  const int64_t qf = c.num_heads * c.head_dim, kvf = c.num_kv_heads * c.head_dim;
  LayerWeights& w = layer->weights;
  auto weight = [&](int64_t out, int64_t in) {
    return RandomTensor(rng, DType::kFloat32, {out, in},
                        1.0f / std::sqrt(static_cast<float>(in)));
  };
  auto bias = [&](int64_t n) {
    return rng.Chance(0.5) ? RandomTensor(rng, DType::kFloat32, {n}, 0.5f) : Tensor();
  };
  w.wq = weight(qf, c.query_dim);
  w.bq = bias(qf);
  w.wk = weight(kvf, c.key_dim);
  w.bk = bias(kvf);
  w.wv = weight(kvf, c.value_dim);
  w.bv = bias(kvf);
  w.wo = weight(c.out_dim, qf);
  w.bo = bias(c.out_dim);
  // Half the layers rotate Q and K (RoPE), each scaling type, either pairing,
  // whole or partial heads: the reference rotates in float64 on its own.
  if (rng.Chance(0.5)) {
    RopeConfig& r = c.rope;
    r.type = rng.Pick<RopeConfig::Type>({RopeConfig::Type::kDefault, RopeConfig::Type::kLinear,
                                         RopeConfig::Type::kLlama3, RopeConfig::Type::kYarn,
                                         RopeConfig::Type::kLongRope});
    r.theta = rng.Pick<double>({10000.0, 500000.0, 10.0});
    r.rotary_dim = rng.Chance(0.5) ? c.head_dim : 2;
    r.interleaved = rng.Chance(0.3);
    r.factor = rng.Pick<double>({2.0, 8.0});
    r.low_freq_factor = 1.0;
    r.high_freq_factor = 4.0;
    r.original_max_position_embeddings = rng.Pick<int64_t>({4, 16});
    r.beta_fast = 32.0;
    r.beta_slow = 1.0;
    if (r.type == RopeConfig::Type::kLongRope) {
      // Requests longer than original_max_position_embeddings take the
      // long factors: both sets are drawn with these lengths.
      for (int64_t i = 0; i < r.rotary_dim / 2; ++i) {
        r.short_factor.push_back(rng.Pick<double>({1.0, 1.25, 3.0}));
        r.long_factor.push_back(rng.Pick<double>({1.0, 6.0, 40.0}));
      }
    }
  }
  // Some slide a window over the keys, some cap their logits.
  if (rng.Chance(0.3)) c.sliding_window = rng.Int(1, 6);
  if (rng.Chance(0.3)) c.softcap = rng.Pick<float>({0.5f, 5.0f, 50.0f});
  // Some add a sink logit per head to the softmax denominator.
  if (rng.Chance(0.3)) {
    c.sinks = true;
    w.sinks = RandomTensor(rng, DType::kFloat32, {c.num_heads}, 3.0f);
  }
  // A third normalise Q and K first (QK-norm, either weight form): each
  // head, or each token's whole projection (OLMo-2).
  if (rng.Chance(0.33)) {
    c.qk_norm.enabled = true;
    c.qk_norm.eps = rng.Pick<double>({1e-6, 1e-2});
    c.qk_norm.weight_offset = rng.Chance(0.5);
    c.qk_norm.whole_projection = rng.Chance(0.4);
    c.qk_norm.after_rope = rng.Chance(0.3);  // Hunyuan
    const int64_t q_width = c.qk_norm.whole_projection ? qf : c.head_dim;
    const int64_t k_width = c.qk_norm.whole_projection ? kvf : c.head_dim;
    w.q_norm = RandomTensor(rng, DType::kFloat32, {q_width}, 1.0f);
    w.k_norm = RandomTensor(rng, DType::kFloat32, {k_width}, 1.0f);
  }
  // A third gate the core output by sigmoid of a projection of the query
  // input (Qwen3-Next, Qwen3.5, AFMoE), some with a bias.
  if (rng.Chance(0.33)) {
    c.output_gate = true;
    w.wg = weight(qf, c.query_dim);
    w.bg = bias(qf);
  }
  // Llama 4: a quarter are causal layers of chunked attention, a quarter
  // scale their queries by the temperature of their index.
  if (rng.Chance(0.25)) {
    c.causal = true;
    c.attention_chunk = rng.Int(1, 6);
  }
  if (rng.Chance(0.25)) {
    c.temperature_tuning.enabled = true;
    c.temperature_tuning.floor_scale = rng.Pick<double>({1.0, 3.0, 8192.0});
    c.temperature_tuning.attn_scale = rng.Pick<double>({0.1, 0.7, -0.3});
  }
  EXPECT_TRUE(ValidateLayer(*layer).ok()) << ValidateLayer(*layer);
  return layer;
}

// The key rows of a task whose draw gave `lk` beside `lq` queries: at least
// lq on a layer with temperature tuning, whose query i sits at index
// Lk - Lq + i and must not be negative (CheckTask refuses Lq > Lk there).
int64_t KeyRows(const LayerConfig& c, int64_t lq, int64_t lk) {
  return c.temperature_tuning.enabled ? std::max(lk, lq) : lk;
}

// A bool or additive mask of `shape` with some rows masked out entirely.
Tensor RandomMask(Rng& rng, DType dtype, const Shape& shape) {
  Tensor t(dtype, shape);
  const int64_t row_len = shape.back();
  const float neg_inf = -std::numeric_limits<float>::infinity();
  bool row_masked = false;
  for (int64_t i = 0; i < t.num_elements(); ++i) {
    if (i % row_len == 0) row_masked = rng.Chance(0.2);
    if (dtype == DType::kBool) {
      t.data_as<uint8_t>()[i] = !row_masked && rng.Chance(0.7) ? 1 : 0;
    } else {
      const float value =
          row_masked || rng.Chance(0.1) ? neg_inf : rng.Uniform(-2.0f, 2.0f);
      StoreFromFloat(dtype, t.data(), i, value);
    }
  }
  return t;
}

// Case i of the sweep. Mask kinds, layer kinds and dtypes are cycled (not
// drawn) so that every combination the issue lists is covered for sure.
Case RandomCase(int i, const std::shared_ptr<const AttentionLayer>& sdpa,
                const std::shared_ptr<const AttentionLayer>& demo) {
  Rng rng(static_cast<uint32_t>(0x5EED0000 + i));
  enum MaskKind { kNone, kBool, kAddF32, kAddF16, kAddBF16, kKeyLengths, kCausal, kAll };
  const int mask_kind = i % 8;
  const int layer_kind = (i / 8) % 5;  // 0-2 sdpa, 3 random projection, 4 demo-mha
  const int shape_variant = (i / 8) % 9;
  const int causal_shape = (i / 8) % 3;  // Lq < Lk, Lq > Lk, Lq == Lk
  const DType dtypes[] = {DType::kFloat32, DType::kFloat16, DType::kBFloat16};
  const DType in_dtype = dtypes[(i / 40) % 3];

  Case c;
  c.out_dtype = dtypes[rng.Int(0, 2)];
  c.weights_dtype = dtypes[rng.Int(0, 2)];
  const bool self_attention = layer_kind >= 3 && rng.Chance(0.5);
  if (layer_kind < 2) {
    c.layer = sdpa;
  } else if (layer_kind == 2) {
    // Bare attention with a sliding window over the keys.
    auto windowed = std::make_shared<AttentionLayer>(*sdpa);
    windowed->config.name = "sdpa-window";
    windowed->config.sliding_window = rng.Int(1, 5);
    if (rng.Chance(0.5)) windowed->config.softcap = rng.Pick<float>({0.3f, 3.0f});
    if (rng.Chance(0.4)) {  // and chunked attention (a causal layer), with or without it
      windowed->config.name = "sdpa-chunk";
      windowed->config.causal = true;
      windowed->config.attention_chunk = rng.Int(1, 5);
      if (rng.Chance(0.5)) windowed->config.sliding_window = 0;
    }
    c.layer = windowed;
  } else if (layer_kind == 3) {
    c.layer = RandomProjectionLayer(rng, self_attention);
  } else {
    c.layer = demo;
  }
  const LayerConfig& lc = c.layer->config;

  const int64_t batch = rng.Int(1, 3);
  int64_t lq = rng.Int(1, 9), lk = rng.Int(1, 9);
  if (mask_kind == kCausal || mask_kind == kAll) {
    if (causal_shape == 0) lk = lq + rng.Int(1, 4);
    if (causal_shape == 1) lq = lk + rng.Int(1, 4);
    if (causal_shape == 2) lk = lq;
  }
  if (self_attention) lk = lq;
  lk = KeyRows(lc, lq, lk);
  const float amplitude = rng.Pick<float>({0.5f, 1.0f, 2.0f});

  int64_t hq, head_dim;
  if (!lc.has_projections) {
    const int64_t hkv = rng.Int(1, 3);
    hq = hkv * rng.Pick<int64_t>({1, 2, 4});
    head_dim = rng.Pick<int64_t>({1, 3, 8, 16, 32});
    const int64_t head_dim_v = rng.Chance(0.5) ? head_dim : rng.Pick<int64_t>({2, 5, 16});
    c.q = RandomTensor(rng, in_dtype, {batch, hq, lq, head_dim}, amplitude);
    c.k = RandomTensor(rng, in_dtype, {batch, hkv, lk, head_dim}, amplitude);
    c.v = RandomTensor(rng, in_dtype, {batch, hkv, lk, head_dim_v}, amplitude);
  } else {
    hq = lc.num_heads;
    head_dim = lc.head_dim;
    c.q = RandomTensor(rng, in_dtype, {batch, lq, lc.query_dim}, amplitude);
    if (!self_attention) {
      c.k = RandomTensor(rng, in_dtype, {batch, lk, lc.key_dim}, amplitude);
      c.v = RandomTensor(rng, in_dtype, {batch, lk, lc.value_dim}, amplitude);
    }
  }

  const std::vector<Shape> mask_shapes = {
      {lq, lk},     {batch, 1, lq, lk}, {1, hq, lq, lk}, {batch, hq, lq, lk}, {hq, lq, lk},
      {1, lk},      {lq, 1},            {batch, 1, 1, lk}, {1, 1, lq, lk}};
  const Shape& mask_shape = mask_shapes[static_cast<size_t>(shape_variant)];
  std::string mask_label = "none";
  switch (mask_kind) {
    case kBool:
    case kAll:
      c.mask = RandomMask(rng, DType::kBool, mask_shape);
      mask_label = "bool" + ShapeString(mask_shape);
      break;
    case kAddF32:
    case kAddF16:
    case kAddBF16: {
      const DType mdt = mask_kind == kAddF32   ? DType::kFloat32
                        : mask_kind == kAddF16 ? DType::kFloat16
                                               : DType::kBFloat16;
      c.mask = RandomMask(rng, mdt, mask_shape);
      mask_label = "additive " + DT(mdt) + ShapeString(mask_shape);
      break;
    }
    default:
      break;
  }
  if (mask_kind == kKeyLengths || mask_kind == kAll) {
    for (int64_t b = 0; b < batch; ++b) c.key_lengths.push_back(rng.Int(0, lk));
    mask_label += " key_lengths";
  }
  c.causal = mask_kind == kCausal || mask_kind == kAll || lc.causal;  // as the server sets it
  if (c.causal) mask_label += " causal";

  const float request_scale = rng.Chance(0.3) ? rng.Uniform(0.2f, 1.5f) : 0.0f;
  c.scale = ResolveScale(lc, request_scale, head_dim);
  c.need_weights = rng.Chance(0.6);
  c.average_weights = c.need_weights && rng.Chance(0.5);

  // Per-request options of bare sdpa (over the layer's own, if any), and
  // explicit positions (arbitrary, repeated, out of order) for RoPE layers;
  // drawn from a generator of their own so the cases above stay as they were.
  Rng extra(static_cast<uint32_t>(0xFEED0000 + i));
  std::string options_label;
  if (!lc.has_projections) {
    if (extra.Chance(0.3)) c.window = extra.Int(1, 6);
    if (extra.Chance(0.3)) c.softcap = extra.Pick<float>({0.4f, 4.0f});
    if (extra.Chance(0.3)) {
      for (int64_t h = 0; h < hq; ++h) c.sinks.push_back(extra.Uniform(-3.0f, 3.0f));
    }
    options_label = absl::StrCat(c.window > 0 ? absl::StrCat(" request window ", c.window) : "",
                                 c.softcap > 0 ? absl::StrCat(" request softcap ", c.softcap) : "",
                                 c.sinks.empty() ? "" : " request sinks");
  } else if (lc.rope.type != RopeConfig::Type::kNone && lc.attention_chunk == 0 && lq <= lk &&
             extra.Chance(0.5)) {
    for (int64_t j = 0; j < batch * lk; ++j) c.positions.push_back(extra.Int(0, 5000));
    options_label = " explicit positions";
  }

  c.label = absl::StrCat(
      "case ", i, ": layer ", lc.name, self_attention ? " (self-attention)" : "",
      lc.rope.type != RopeConfig::Type::kNone
          ? absl::StrCat(" rope ", RopeTypeName(lc.rope.type), "/", lc.rope.rotary_dim,
                         lc.rope.interleaved ? " interleaved" : "")
          : "",
      lc.qk_norm.enabled ? (lc.qk_norm.weight_offset ? " qk-norm(1+w)" : " qk-norm") : "",
      lc.qk_norm.whole_projection ? " over the projection" : "",
      lc.qk_norm.after_rope ? " after rope" : "",
      lc.sliding_window > 0 ? absl::StrCat(" window ", lc.sliding_window) : "",
      lc.attention_chunk > 0 ? absl::StrCat(" chunk ", lc.attention_chunk) : "",
      lc.temperature_tuning.enabled
          ? absl::StrCat(" temperature ", lc.temperature_tuning.floor_scale, "/",
                         lc.temperature_tuning.attn_scale)
          : "",
      lc.softcap > 0 ? absl::StrCat(" softcap ", lc.softcap) : "",
      lc.sinks ? " sinks" : "", lc.output_gate ? " output gate" : "", options_label,
      ", query ",
      ShapeString(c.q.shape()), c.k.byte_size() ? ", key " + ShapeString(c.k.shape()) : "",
      c.v.byte_size() ? ", value " + ShapeString(c.v.shape()) : "", ", in ", DT(in_dtype),
      ", out ", DT(c.out_dtype), ", mask ", mask_label,
      c.need_weights ? (c.average_weights ? ", weights averaged " : ", weights per head ")
                     : "",
      c.need_weights ? DT(c.weights_dtype) : "");
  return c;
}

// The metric in the file comment; returns a failure message or "".
std::string Compare(const char* what, const std::vector<float>& got,
                    const std::vector<float>& ref, DType got_dtype) {
  if (got.size() != ref.size()) return absl::StrCat(what, ": size mismatch");
  double max_ref = 0.0, max_diff = 0.0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (std::isnan(got[i])) return absl::StrCat(what, ": NaN at ", i);
    if (ref[i] == 0.0f && got[i] != 0.0f) {
      return absl::StrCat(what, ": element ", i, " is ", got[i],
                          " where the reference is exactly 0 (masked)");
    }
    max_ref = std::max(max_ref, std::fabs(static_cast<double>(ref[i])));
    max_diff = std::max(max_diff, std::fabs(static_cast<double>(got[i]) - ref[i]));
  }
  const double rel = max_diff / std::max(max_ref, 1e-30);
  if (rel > Tolerance(got_dtype)) {
    return absl::StrCat(what, ": relative error ", rel, " > ", Tolerance(got_dtype), " (",
                        DT(got_dtype), ")");
  }
  return "";
}

class CpuEngineTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<std::unique_ptr<AttentionEngine>> cpu = CreateEngine("cpu");
    ASSERT_TRUE(cpu.ok()) << cpu.status();
    cpu_ = std::move(*cpu);
    reference_ = NewReferenceEngine();
  }

  // Runs `c` on both engines and checks the cpu result against the reference.
  void CheckAgainstReference(const Case& c) {
    CaseRun ref(c, DType::kFloat32, DType::kFloat32);
    CaseRun got(c, c.out_dtype, c.weights_dtype);
    const absl::Status rs = reference_->Run(*c.layer, {&ref.task, 1});
    ASSERT_TRUE(rs.ok()) << c.label << ": " << rs;
    const absl::Status cs = cpu_->Run(*c.layer, {&got.task, 1});
    ASSERT_TRUE(cs.ok()) << c.label << ": " << cs;
    std::string err = Compare("output", AsFloats(got.out), AsFloats(ref.out), c.out_dtype);
    EXPECT_EQ(err, "") << c.label;
    if (c.need_weights) {
      err = Compare("weights", AsFloats(got.weights), AsFloats(ref.weights), c.weights_dtype);
      EXPECT_EQ(err, "") << c.label;
    }
  }

  std::shared_ptr<const AttentionLayer> sdpa_ = MakeSdpaLayer();
  std::shared_ptr<const AttentionLayer> demo_ = MakeDemoMhaLayer();
  std::unique_ptr<AttentionEngine> cpu_, reference_;
};

TEST_F(CpuEngineTest, MatchesReferenceOnRandomCases) {
  for (int i = 0; i < kNumRandomCases; ++i) {
    CheckAgainstReference(RandomCase(i, sdpa_, demo_));
    if (HasFatalFailure()) return;
  }
}

// A sliding window over sequences long enough that whole 256-key blocks fall
// before every row's window (skipped) and that decode splits its keys into
// chunks: prefill, prefill with cross lengths, a decode row, with weights;
// and without causal (a two-sided window, the later keys' blocks cut too).
TEST_F(CpuEngineTest, SlidingWindowOverLongSequences) {
  Rng rng(78);
  auto windowed = std::make_shared<AttentionLayer>(*sdpa_);
  windowed->config.name = "sdpa-window-100";
  windowed->config.sliding_window = 100;
  struct Shape2 {
    int64_t lq, lk;
    bool causal, weights;
  };
  for (const Shape2 s : {Shape2{700, 700, true, false}, Shape2{300, 900, true, false},
                         Shape2{1, 2000, true, false}, Shape2{600, 600, false, true},
                         Shape2{700, 700, false, false}, Shape2{300, 900, false, false}}) {
    Case c;
    c.layer = windowed;
    c.q = RandomTensor(rng, DType::kFloat32, {1, 4, s.lq, 32}, 1.0f);
    c.k = RandomTensor(rng, DType::kFloat32, {1, 2, s.lk, 32}, 1.0f);
    c.v = RandomTensor(rng, DType::kFloat32, {1, 2, s.lk, 32}, 1.0f);
    c.causal = s.causal;
    c.need_weights = s.weights;
    c.scale = ResolveScale(windowed->config, 0.0f, 32);
    c.label = absl::StrCat("window 100, Lq ", s.lq, " Lk ", s.lk, s.causal ? " causal" : "",
                           s.weights ? " weights" : "");
    CheckAgainstReference(c);
  }
}

// ALiBi (BLOOM, MPT) over sequences long enough for every kernel path: long
// prefills (whole key blocks; Lq < Lk), a decode row split across threads
// (each chunk biased by its keys' own index), the weights pass, a two-sided
// window without causal, a bool mask and key lengths on top, bf16 inputs;
// and a projection layer. Slopes from BLOOM's steepest to MPT-30B's
// flattest, so some rows see a handful of keys and some the whole sequence.
TEST_F(CpuEngineTest, AlibiOverLongSequences) {
  Rng rng(87);
  auto alibi = std::make_shared<AttentionLayer>(*sdpa_);
  alibi->config.name = "sdpa-alibi";
  alibi->config.alibi_slopes = {0.5f, 0.0625f, 1.0f / 256, 1.0f / 4096};
  struct Shape2 {
    int64_t lq, lk;
    bool causal, weights;
    int64_t window;
    bool masked;
    DType dtype;
  };
  for (const Shape2 s : {Shape2{700, 700, true, false, 0, false, DType::kFloat32},
                         Shape2{300, 900, true, false, 0, false, DType::kFloat32},
                         Shape2{1, 3000, true, false, 0, false, DType::kFloat32},
                         Shape2{40, 600, true, true, 0, false, DType::kFloat32},
                         Shape2{500, 500, false, false, 100, false, DType::kFloat32},
                         Shape2{200, 400, false, true, 0, true, DType::kFloat32},
                         Shape2{300, 300, true, false, 0, false, DType::kBFloat16}}) {
    Case c;
    c.layer = alibi;
    c.q = RandomTensor(rng, s.dtype, {2, 4, s.lq, 32}, 1.0f);
    c.k = RandomTensor(rng, s.dtype, {2, 2, s.lk, 32}, 1.0f);
    c.v = RandomTensor(rng, s.dtype, {2, 2, s.lk, 32}, 1.0f);
    c.causal = s.causal;
    c.window = s.window;
    c.need_weights = s.weights;
    c.out_dtype = s.dtype;
    if (s.masked) {
      c.mask = RandomMask(rng, DType::kBool, {2, 1, s.lq, s.lk});
      c.key_lengths = {s.lk, s.lk / 3};
    }
    c.scale = ResolveScale(alibi->config, 0.0f, 32);
    c.label = absl::StrCat("ALiBi, Lq ", s.lq, " Lk ", s.lk, s.causal ? " causal" : "",
                           s.weights ? " weights" : "", s.window ? " window" : "",
                           s.masked ? " mask" : "", " ", std::string(DTypeName(s.dtype)));
    CheckAgainstReference(c);
  }
  Rng layer_rng(88);
  auto projected = std::make_shared<AttentionLayer>(*RandomProjectionLayer(layer_rng, false));
  projected->config.name = "alibi-projection";
  projected->config.alibi_slopes.clear();
  for (int64_t h = 0; h < projected->config.num_heads; ++h) {
    projected->config.alibi_slopes.push_back(0.25f / static_cast<float>(1 << h));
  }
  ASSERT_TRUE(ValidateLayer(*projected).ok()) << ValidateLayer(*projected);
  const LayerConfig& lc = projected->config;
  for (const int64_t lq : {1, 64}) {
    Case c;
    c.layer = projected;
    c.q = RandomTensor(rng, DType::kFloat32, {1, lq, lc.query_dim}, 1.0f);
    c.k = RandomTensor(rng, DType::kFloat32, {1, 700, lc.key_dim}, 1.0f);
    c.v = RandomTensor(rng, DType::kFloat32, {1, 700, lc.value_dim}, 1.0f);
    c.causal = true;
    c.scale = ResolveScale(lc, 0.0f, lc.head_dim);
    c.label = absl::StrCat("ALiBi projection layer, Lq ", lq, " Lk 700");
    CheckAgainstReference(c);
  }
}

// Chunked attention (Llama 4) over chunks of 64 keys: long prefills whose
// rows start at their chunk's first key, a decode row split across threads
// (only its chunk's key blocks count), and the weights pass.
TEST_F(CpuEngineTest, ChunkedAttentionOverLongSequences) {
  Rng rng(80);
  auto chunked = std::make_shared<AttentionLayer>(*sdpa_);
  chunked->config.name = "sdpa-chunk-64";
  chunked->config.causal = true;
  chunked->config.attention_chunk = 64;
  ASSERT_TRUE(ValidateLayer(*chunked).ok()) << ValidateLayer(*chunked);
  struct Shape2 {
    int64_t lq, lk;
    bool weights;
  };
  for (const Shape2 s : {Shape2{700, 700, false}, Shape2{300, 900, false},
                         Shape2{1, 2000, false}, Shape2{3, 1990, false},
                         Shape2{200, 200, true}}) {
    Case c;
    c.layer = chunked;
    c.q = RandomTensor(rng, DType::kFloat32, {1, 4, s.lq, 32}, 1.0f);
    c.k = RandomTensor(rng, DType::kFloat32, {1, 2, s.lk, 32}, 1.0f);
    c.v = RandomTensor(rng, DType::kFloat32, {1, 2, s.lk, 32}, 1.0f);
    c.causal = true;
    c.need_weights = s.weights;
    c.scale = ResolveScale(chunked->config, 0.0f, 32);
    c.label = absl::StrCat("chunk 64, Lq ", s.lq, " Lk ", s.lk, s.weights ? " weights" : "");
    CheckAgainstReference(c);
  }
}

// Multi-head latent attention (DeepSeek-V2/V3) against the reference: with
// and without the query's latent, with and without biases, RoPE of several
// types on each head's last features (either pairing), causal or not, key
// lengths, bool masks, explicit positions, weights, any input dtype; then a
// bf16 layer within bf16's tolerance.
TEST_F(CpuEngineTest, LatentAttentionMatchesReference) {
  Rng rng(81);
  auto uniform = [&](float lo, float hi) { return rng.Uniform(lo, hi); };
  for (int i = 0; i < 40; ++i) {
    testutil::LatentShape shape;
    shape.heads = rng.Int(1, 3);
    shape.rope = rng.Pick<int64_t>({2, 4, 8});
    shape.nope = rng.Pick<int64_t>({2, 6, 8});
    shape.v_head_dim = rng.Pick<int64_t>({3, 8, 12});
    shape.q_lora_rank = rng.Pick<int64_t>({0, 0, 5, 24});
    shape.kv_lora_rank = rng.Pick<int64_t>({4, 10, 32});
    shape.embed = rng.Pick<int64_t>({8, 20});
    shape.out = rng.Pick<int64_t>({6, 20});
    shape.biases = rng.Chance(0.5);
    const Precision precision = i % 10 == 9 ? Precision::kBFloat16 : Precision::kFloat32;
    std::shared_ptr<AttentionLayer> layer =
        testutil::RandomLatentLayer(shape, precision, uniform);
    LayerConfig& lc = layer->config;
    lc.causal = rng.Chance(0.4);
    const int rope = static_cast<int>(rng.Int(0, 2));
    if (rope > 0) {
      lc.rope.type = rope == 1 ? RopeConfig::Type::kDefault : RopeConfig::Type::kYarn;
      lc.rope.theta = 10000.0;
      lc.rope.rotary_dim = shape.rope;
      lc.rope.interleaved = rng.Chance(0.5);
      lc.rope.factor = 40.0;
      lc.rope.original_max_position_embeddings = 8;
      lc.rope.beta_fast = 32.0;
      lc.rope.beta_slow = 1.0;
      lc.rope.attention_factor = 1.0;
      // DeepSeek-V3: softmax_scale * mscale^2
      lc.scale = static_cast<float>(std::pow(0.1 * std::log(40.0) + 1.0, 2) /
                                    std::sqrt(static_cast<double>(lc.head_dim)));
      // Mistral 4: every query feature scaled by its position's band.
      if (rng.Chance(0.4)) {
        lc.temperature_tuning = {true, rng.Pick<double>({2.0, 3.0, 64.0}), 0.7, rng.Chance(0.7)};
      }
    }
    ASSERT_TRUE(ValidateLayer(*layer).ok()) << ValidateLayer(*layer);

    Case c;
    c.layer = layer;
    const int64_t batch = rng.Int(1, 3), len = rng.Int(1, 20);
    const DType in = rng.Pick<DType>({DType::kFloat32, DType::kBFloat16, DType::kFloat16});
    c.q = RandomTensor(rng, in, {batch, len, shape.embed}, 2.0f);
    c.causal = lc.causal || rng.Chance(0.3);
    if (rng.Chance(0.4)) {
      for (int64_t b = 0; b < batch; ++b) c.key_lengths.push_back(rng.Int(0, len));
    }
    if (rng.Chance(0.3)) c.mask = RandomMask(rng, DType::kBool, {batch, 1, len, len});
    if (rope > 0 && rng.Chance(0.4)) {
      for (int64_t j = 0; j < batch * len; ++j) c.positions.push_back(rng.Int(0, 3000));
    }
    c.need_weights = rng.Chance(0.4);
    // A bf16 layer's results are checked within bf16's tolerance.
    c.out_dtype = c.weights_dtype =
        precision == Precision::kBFloat16 ? DType::kBFloat16 : DType::kFloat32;
    c.scale = ResolveScale(lc, 0.0f, lc.head_dim);
    c.label = absl::StrCat("latent case ", i, ": heads ", shape.heads, " nope ", shape.nope,
                           " rope ", shape.rope, " v ", shape.v_head_dim, " q_lora ",
                           shape.q_lora_rank, " kv_lora ", shape.kv_lora_rank,
                           shape.biases ? " biases" : "",
                           rope == 0 ? " no rope" : rope == 1 ? " rope" : " yarn",
                           lc.rope.interleaved ? " interleaved" : "",
                           !lc.temperature_tuning.enabled ? ""
                           : lc.temperature_tuning.by_position
                               ? " temperature by position"
                               : " temperature by index",
                           c.causal ? " causal" : "", c.key_lengths.empty() ? "" : " lengths",
                           c.mask.byte_size() ? " mask" : "",
                           c.positions.empty() ? "" : " positions", ", B ", batch, " L ", len,
                           " in ", DT(in), precision == Precision::kBFloat16 ? ", bf16 layer" : "");
    CheckAgainstReference(c);
    if (HasFatalFailure()) return;
  }
}

// QKV clipping (OLMo, DBRX) on random projection layers with every other
// feature (QK-norm before and after RoPE, windows, gates, ...), tight enough
// that many values clamp: self- and cross-attention against the reference.
TEST_F(CpuEngineTest, ClipQkvMatchesReference) {
  Rng rng(83);
  for (int i = 0; i < 30; ++i) {
    const bool self_attention = i % 2 == 0;
    auto layer = std::make_shared<AttentionLayer>(*RandomProjectionLayer(rng, self_attention));
    layer->config.clip_qkv = rng.Pick<float>({0.25f, 0.5f, 8.0f});
    ASSERT_TRUE(ValidateLayer(*layer).ok()) << ValidateLayer(*layer);
    const LayerConfig& lc = layer->config;
    Case c;
    c.layer = layer;
    const int64_t batch = rng.Int(1, 2), lq = rng.Int(1, 12);
    const int64_t lk = self_attention ? lq : KeyRows(lc, lq, rng.Int(1, 12));
    c.q = RandomTensor(rng, DType::kFloat32, {batch, lq, lc.query_dim}, 3.0f);
    if (!self_attention) {
      c.k = RandomTensor(rng, DType::kFloat32, {batch, lk, lc.key_dim}, 3.0f);
      c.v = RandomTensor(rng, DType::kFloat32, {batch, lk, lc.value_dim}, 3.0f);
    }
    c.causal = lc.causal || (lq <= lk && rng.Chance(0.5));
    c.need_weights = rng.Chance(0.5);
    c.scale = ResolveScale(lc, 0.0f, lc.head_dim);
    c.label = absl::StrCat("clip case ", i, ": clip ", lc.clip_qkv,
                           self_attention ? " self" : " cross",
                           lc.qk_norm.enabled ? " qk-norm" : "",
                           lc.qk_norm.after_rope ? " after rope" : "",
                           lc.rope.type != RopeConfig::Type::kNone ? " rope" : "",
                           lc.output_gate ? " gate" : "", ", B ", batch, " Lq ", lq, " Lk ", lk);
    CheckAgainstReference(c);
    if (HasFatalFailure()) return;
  }
}

// The value norm (Gemma 3n, Gemma 4) on random projection layers with every
// other feature (QK-norm, RoPE, windows, gates, clipping), in every input
// type, self- and cross-attention, against the reference.
TEST_F(CpuEngineTest, ValueNormMatchesReference) {
  Rng rng(85);
  for (int i = 0; i < 24; ++i) {
    const bool self_attention = i % 2 == 0;
    auto layer = std::make_shared<AttentionLayer>(*RandomProjectionLayer(rng, self_attention));
    layer->config.v_norm_eps = rng.Pick<double>({1e-6, 1e-2});
    if (rng.Chance(0.3)) layer->config.clip_qkv = 0.5f;
    ASSERT_TRUE(ValidateLayer(*layer).ok()) << ValidateLayer(*layer);
    const LayerConfig& lc = layer->config;
    Case c;
    c.layer = layer;
    const int64_t batch = rng.Int(1, 2), lq = rng.Int(1, 12);
    const int64_t lk = self_attention ? lq : KeyRows(lc, lq, rng.Int(1, 12));
    const DType in = rng.Pick<DType>({DType::kFloat32, DType::kBFloat16, DType::kFloat16});
    c.q = RandomTensor(rng, in, {batch, lq, lc.query_dim}, 2.0f);
    if (!self_attention) {
      c.k = RandomTensor(rng, in, {batch, lk, lc.key_dim}, 2.0f);
      c.v = RandomTensor(rng, in, {batch, lk, lc.value_dim}, 2.0f);
    }
    c.causal = lc.causal || (lq <= lk && rng.Chance(0.5));
    c.need_weights = rng.Chance(0.5);
    c.scale = ResolveScale(lc, 0.0f, lc.head_dim);
    c.label = absl::StrCat("v_norm case ", i, ": eps ", lc.v_norm_eps,
                           self_attention ? " self" : " cross",
                           lc.qk_norm.enabled ? " qk-norm" : "",
                           lc.rope.type != RopeConfig::Type::kNone ? " rope" : "",
                           lc.clip_qkv > 0 ? " clip" : "", lc.output_gate ? " gate" : "",
                           ", B ", batch, " Lq ", lq, " Lk ", lk, " in ", DT(in));
    CheckAgainstReference(c);
    if (HasFatalFailure()) return;
  }
}

// Cohere's QK-norm: LayerNorm (the mean subtracted) per head with weights
// per head, with RoPE, GQA, bf16 and fp16 inputs, self- and
// cross-attention, against the reference.
TEST_F(CpuEngineTest, LayerNormQkNormWithWeightsPerHeadMatchesReference) {
  Rng rng(84);
  for (int i = 0; i < 24; ++i) {
    const bool self_attention = i % 2 == 0;
    auto layer = std::make_shared<AttentionLayer>(*RandomProjectionLayer(rng, self_attention));
    LayerConfig& lc = layer->config;
    lc.qk_norm.enabled = true;
    lc.qk_norm.eps = 1e-5;
    lc.qk_norm.whole_projection = false;
    lc.qk_norm.subtract_mean = true;
    lc.qk_norm.per_head_weights = rng.Chance(0.75);
    lc.qk_norm.weight_offset = false;
    const int64_t q_width = QkNormWeightCount(lc.qk_norm, lc.num_heads, lc.head_dim);
    const int64_t k_width = QkNormWeightCount(lc.qk_norm, lc.num_kv_heads, lc.head_dim);
    layer->weights.q_norm = RandomTensor(rng, DType::kFloat32, {q_width}, 1.5f);
    layer->weights.k_norm = RandomTensor(rng, DType::kFloat32, {k_width}, 1.5f);
    ASSERT_TRUE(ValidateLayer(*layer).ok()) << ValidateLayer(*layer);
    Case c;
    c.layer = layer;
    const int64_t batch = rng.Int(1, 2), lq = rng.Int(1, 12);
    const int64_t lk = self_attention ? lq : KeyRows(lc, lq, rng.Int(1, 12));
    const DType in = rng.Pick<DType>({DType::kFloat32, DType::kBFloat16, DType::kFloat16});
    c.q = RandomTensor(rng, in, {batch, lq, lc.query_dim}, 2.0f);
    if (!self_attention) {
      c.k = RandomTensor(rng, in, {batch, lk, lc.key_dim}, 2.0f);
      c.v = RandomTensor(rng, in, {batch, lk, lc.value_dim}, 2.0f);
    }
    c.causal = lc.causal || (lq <= lk && rng.Chance(0.5));
    c.need_weights = rng.Chance(0.5);
    c.scale = ResolveScale(lc, 0.0f, lc.head_dim);
    c.label = absl::StrCat("layer-norm qk-norm case ", i,
                           lc.qk_norm.per_head_weights ? " weights per head" : " shared weights",
                           lc.qk_norm.after_rope ? " after rope" : "",
                           self_attention ? " self" : " cross", " heads ", lc.num_heads, "/",
                           lc.num_kv_heads, " dim ", lc.head_dim, " in ", DT(in));
    CheckAgainstReference(c);
    if (HasFatalFailure()) return;
  }
}

// Temperature by position (Ministral 3, Mistral 4's llama_4_scaling_beta):
// RoPE layers whose queries scale by their position's band, with implicit
// and explicit positions, self- and cross-attention, against the reference.
TEST_F(CpuEngineTest, TemperatureByPositionMatchesReference) {
  Rng rng(85);
  for (int i = 0; i < 24; ++i) {
    const bool self_attention = i % 2 == 0;
    auto layer = std::make_shared<AttentionLayer>(*RandomProjectionLayer(rng, self_attention));
    LayerConfig& lc = layer->config;
    if (lc.rope.type == RopeConfig::Type::kNone) {
      lc.rope.type = RopeConfig::Type::kYarn;
      lc.rope.rotary_dim = lc.head_dim;
      lc.rope.factor = 8.0;
      lc.rope.original_max_position_embeddings = 4;
      lc.rope.beta_fast = 32.0;
      lc.rope.beta_slow = 1.0;
    }
    lc.temperature_tuning = {true, rng.Pick<double>({2.0, 3.0, 64.0}), 0.1, true};
    lc.attention_chunk = 0;  // explicit positions below
    ASSERT_TRUE(ValidateLayer(*layer).ok()) << ValidateLayer(*layer);
    Case c;
    c.layer = layer;
    const int64_t batch = rng.Int(1, 2), lq = rng.Int(1, 12);
    const int64_t lk = self_attention ? lq : lq + rng.Int(0, 6);
    c.q = RandomTensor(rng, DType::kFloat32, {batch, lq, lc.query_dim}, 2.0f);
    if (!self_attention) {
      c.k = RandomTensor(rng, DType::kFloat32, {batch, lk, lc.key_dim}, 2.0f);
      c.v = RandomTensor(rng, DType::kFloat32, {batch, lk, lc.value_dim}, 2.0f);
    }
    if (rng.Chance(0.5)) {
      for (int64_t j = 0; j < batch * lk; ++j) c.positions.push_back(rng.Int(0, 300));
    }
    c.causal = lc.causal || rng.Chance(0.5);
    c.scale = ResolveScale(lc, 0.0f, lc.head_dim);
    c.label = absl::StrCat("temperature by position case ", i, ": floor ",
                           lc.temperature_tuning.floor_scale,
                           self_attention ? " self" : " cross",
                           c.positions.empty() ? "" : " explicit positions", ", B ", batch,
                           " Lq ", lq, " Lk ", lk);
    CheckAgainstReference(c);
    if (HasFatalFailure()) return;
    if (!self_attention && lq > 1) {
      // One query more than keys: the first would sit at index -1, whose
      // factor 1 + 0.1 * log1p(floor(-1 / floor_scale)) is -inf. Refused.
      Case over = c;
      over.positions.clear();
      over.k = RandomTensor(rng, DType::kFloat32, {batch, lq - 1, lc.key_dim}, 2.0f);
      over.v = RandomTensor(rng, DType::kFloat32, {batch, lq - 1, lc.value_dim}, 2.0f);
      CaseRun run(over, DType::kFloat32, DType::kFloat32);
      const absl::Status status = cpu_->Run(*over.layer, {&run.task, 1});
      EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << c.label;
      EXPECT_NE(status.message().find("temperature_tuning needs Lq <= Lk"), std::string::npos)
          << c.label << ": " << status;
    }
  }
}

// A latent layer's sessions cache the compressed latent and rotary key
// (SessionCacheGeometry: one row of kv_lora_rank + rope_dim key features and
// kv_lora_rank value features per token) and attend with the queries
// absorbed into the latent: prefill, decode steps and appends, each equal to
// the rows of one causal request over every token (the reference engine,
// which computes the expanded keys and values), with and without the query's
// latent, RoPE at the sessions' positions, Mistral 4's temperature.
TEST_F(CpuEngineTest, LatentSessionsCacheTheLatentAndEqualOneCausalRequest) {
  Rng rng(86);
  auto uniform = [&](float lo, float hi) { return rng.Uniform(lo, hi); };
  for (int i = 0; i < 6; ++i) {
    testutil::LatentShape shape;
    shape.heads = rng.Int(1, 4);
    shape.q_lora_rank = i % 2 == 0 ? 0 : 10;
    shape.kv_lora_rank = rng.Pick<int64_t>({6, 12});
    shape.biases = i % 3 == 1;
    std::shared_ptr<AttentionLayer> layer =
        testutil::RandomLatentLayer(shape, Precision::kFloat32, uniform);
    LayerConfig& lc = layer->config;
    lc.causal = true;
    lc.rope.type = RopeConfig::Type::kYarn;
    lc.rope.theta = 10000.0;
    lc.rope.rotary_dim = shape.rope;
    lc.rope.interleaved = i % 2 == 1;
    lc.rope.factor = 40.0;
    lc.rope.original_max_position_embeddings = 8;
    lc.rope.beta_fast = 32.0;
    lc.rope.beta_slow = 1.0;
    lc.rope.attention_factor = 1.0;
    if (i >= 4) lc.temperature_tuning = {true, 4.0, 0.7, true};  // Mistral 4
    ASSERT_TRUE(ValidateLayer(*layer).ok()) << ValidateLayer(*layer);
    const KvCacheGeometry g = cpu_->SessionCacheGeometry(lc);
    EXPECT_EQ(g.num_kv_heads, 1);
    EXPECT_EQ(g.head_dim, shape.kv_lora_rank + shape.rope);
    EXPECT_EQ(g.head_dim_v, shape.kv_lora_rank);

    const std::vector<int64_t> steps = {7, 1, 1, 3, 1, 20, 1};
    int64_t len = 0;
    for (int64_t step : steps) len += step;
    const Tensor x = RandomTensor(rng, DType::kFloat32, {1, len, shape.embed}, 2.0f);
    Tensor want(DType::kFloat32, {1, len, shape.out});
    AttentionTask full;
    full.query = x.view();
    full.causal = true;
    full.scale = ResolveScale(lc, 0.0f, lc.head_dim);
    full.output = want.mutable_view();
    ASSERT_TRUE(reference_->Run(*layer, {&full, 1}).ok());

    // Host blocks of 16 tokens: K [16][Dk] then V [16][Dv], FLOAT32.
    constexpr int64_t kBlock = 16;
    std::vector<std::vector<float>> blocks;
    std::vector<void*> k_blocks, v_blocks;
    for (int64_t b = 0; b < (len + kBlock - 1) / kBlock; ++b) {
      blocks.emplace_back(static_cast<size_t>(kBlock * (g.head_dim + g.head_dim_v)));
      k_blocks.push_back(blocks.back().data());
      v_blocks.push_back(blocks.back().data() + kBlock * g.head_dim);
    }
    int64_t cached = 0;
    for (int64_t step : steps) {
      Tensor xs(DType::kFloat32, {1, step, shape.embed});
      std::memcpy(xs.data(), x.data_as<float>() + cached * shape.embed, xs.byte_size());
      Tensor got(DType::kFloat32, {1, step, shape.out});
      AttentionTask t = full;
      t.query = xs.view();
      t.output = got.mutable_view();
      t.paged.dtype = DType::kFloat32;
      t.paged.num_kv_heads = g.num_kv_heads;
      t.paged.head_dim = g.head_dim;
      t.paged.head_dim_v = g.head_dim_v;
      t.paged.block_tokens = kBlock;
      t.paged.cached_len = cached;
      t.paged.k_blocks = k_blocks;
      t.paged.v_blocks = v_blocks;
      const absl::Status status = cpu_->Run(*layer, {&t, 1});
      ASSERT_TRUE(status.ok()) << status << " at " << cached;
      const std::vector<float> all = AsFloats(want);
      const std::vector<float> rows(all.begin() + cached * shape.out,
                                    all.begin() + (cached + step) * shape.out);
      EXPECT_EQ(Compare("output", AsFloats(got), rows, DType::kFloat32), "")
          << "case " << i << ", step of " << step << " at " << cached;
      if (HasFailure()) return;
      cached += step;
    }
  }
}

// A latent layer takes the query only: a key and value are refused.
TEST_F(CpuEngineTest, LatentAttentionRefusesAKey) {
  Rng rng(82);
  std::shared_ptr<AttentionLayer> layer = testutil::RandomLatentLayer(
      testutil::LatentShape{}, Precision::kFloat32,
      [&](float lo, float hi) { return rng.Uniform(lo, hi); });
  Case c;
  c.layer = layer;
  c.q = RandomTensor(rng, DType::kFloat32, {1, 4, 16}, 1.0f);
  c.k = RandomTensor(rng, DType::kFloat32, {1, 4, 16}, 1.0f);
  c.v = RandomTensor(rng, DType::kFloat32, {1, 4, 16}, 1.0f);
  CaseRun run(c, DType::kFloat32, DType::kFloat32);
  const absl::Status status = cpu_->Run(*layer, {&run.task, 1});
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  EXPECT_NE(status.message().find("latent"), std::string::npos) << status;
}

// Sinks join each row's softmax once: in a prefill, in a decode row whose
// keys are split across threads in chunks (the sink joins where the chunks
// are combined), and in the weights pass.
TEST_F(CpuEngineTest, SinksOverLongSequences) {
  Rng rng(79);
  std::shared_ptr<const AttentionLayer> base = RandomProjectionLayer(rng, false);
  auto layer = std::make_shared<AttentionLayer>(*base);
  layer->config.name = "sinks";
  layer->config.sinks = true;
  layer->config.sliding_window = 0;
  layer->weights.sinks = RandomTensor(rng, DType::kFloat32, {layer->config.num_heads}, 3.0f);
  ASSERT_TRUE(ValidateLayer(*layer).ok()) << ValidateLayer(*layer);
  const LayerConfig& lc = layer->config;
  struct Shape2 {
    int64_t lq, lk;
    bool weights;
  };
  for (const Shape2 s : {Shape2{300, 300, false}, Shape2{1, 3000, false}, Shape2{40, 600, true}}) {
    Case c;
    c.layer = layer;
    c.q = RandomTensor(rng, DType::kFloat32, {1, s.lq, lc.query_dim}, 1.0f);
    c.k = RandomTensor(rng, DType::kFloat32, {1, s.lk, lc.key_dim}, 1.0f);
    c.v = RandomTensor(rng, DType::kFloat32, {1, s.lk, lc.value_dim}, 1.0f);
    c.causal = true;
    c.need_weights = s.weights;
    c.scale = ResolveScale(lc, 0.0f, lc.head_dim);
    c.label = absl::StrCat("sinks, Lq ", s.lq, " Lk ", s.lk, s.weights ? " weights" : "");
    CheckAgainstReference(c);
  }
}

// Explicit positions as a left-padded batch uses them: sequence B (4
// tokens) padded on the left to sequence A's 6, its pads masked out of the
// keys and its tokens at positions 0..3, gives B's rows exactly as B alone
// with implicit positions (to float rounding), and A's rows as A alone.
// Explicit positions 0..L-1 are bitwise the implicit ones.
TEST_F(CpuEngineTest, ExplicitPositionsServeLeftPaddedBatches) {
  Rng rng(31);
  auto layer = std::make_shared<AttentionLayer>(*RandomProjectionLayer(rng, true));
  LayerConfig& lc = layer->config;
  lc.name = "rope-left-padded";
  lc.rope = RopeConfig();
  lc.rope.type = RopeConfig::Type::kDefault;
  lc.rope.theta = 10000.0;
  lc.rope.rotary_dim = lc.head_dim;
  lc.sliding_window = 0;
  ASSERT_TRUE(ValidateLayer(*layer).ok()) << ValidateLayer(*layer);
  const int64_t la = 6, lb = 4, pad = la - lb, dim = lc.query_dim;
  const Tensor a = RandomTensor(rng, DType::kFloat32, {1, la, dim}, 1.0f);
  const Tensor b = RandomTensor(rng, DType::kFloat32, {1, lb, dim}, 1.0f);
  const float scale = ResolveScale(lc, 0.0f, lc.head_dim);

  auto run = [&](Case c) {
    c.layer = layer;
    c.causal = true;
    c.scale = scale;
    CaseRun r(c, DType::kFloat32, DType::kFloat32);
    const absl::Status st = cpu_->Run(*layer, {&r.task, 1});
    EXPECT_TRUE(st.ok()) << st;
    return AsFloats(r.out);
  };
  Case alone_a, alone_b;
  alone_a.q = a;
  alone_b.q = b;
  const std::vector<float> out_a = run(alone_a), out_b = run(alone_b);

  Case padded;
  padded.q = Tensor(DType::kFloat32, {2, la, dim});
  std::memcpy(padded.q.data(), a.data(), a.byte_size());
  float* qb = padded.q.data_as<float>() + la * dim;
  for (int64_t i = 0; i < pad * dim; ++i) qb[i] = rng.Uniform(-1.0f, 1.0f);  // pad tokens
  std::memcpy(qb + pad * dim, b.data(), b.byte_size());
  padded.mask = Tensor(DType::kBool, {2, 1, 1, la});
  for (int64_t j = 0; j < 2 * la; ++j) padded.mask.data_as<uint8_t>()[j] = j >= la + pad || j < la;
  padded.positions = {0, 1, 2, 3, 4, 5, /*pads*/ 1, 1, 0, 1, 2, 3};
  const std::vector<float> out = run(padded);
  const int64_t out_dim = lc.out_dim;
  const std::vector<float> got_a(out.begin(), out.begin() + la * out_dim);
  const std::vector<float> got_b(out.begin() + (la + pad) * out_dim, out.end());
  EXPECT_EQ(Compare("sequence A", got_a, out_a, DType::kFloat32), "");
  EXPECT_EQ(Compare("sequence B", got_b, out_b, DType::kFloat32), "");

  Case implicit, explicit_positions;
  implicit.q = explicit_positions.q = a;
  explicit_positions.positions = {0, 1, 2, 3, 4, 5};
  EXPECT_EQ(run(explicit_positions), run(implicit));
}

TEST_F(CpuEngineTest, LongerSequences) {
  // A few cases big enough that oneDNN's blocking and threading kick in.
  Rng rng(77);
  for (int64_t len : {64, 130}) {
    Case c;
    c.layer = sdpa_;
    c.q = RandomTensor(rng, DType::kFloat32, {2, 4, len, 64}, 1.0f);
    c.k = RandomTensor(rng, DType::kFloat32, {2, 2, len + 3, 64}, 1.0f);
    c.v = RandomTensor(rng, DType::kFloat32, {2, 2, len + 3, 48}, 1.0f);
    c.causal = true;
    c.scale = ResolveScale(sdpa_->config, 0.0f, 64);
    c.need_weights = true;
    c.label = absl::StrCat("sdpa len ", len);
    CheckAgainstReference(c);

    Case m;
    m.layer = demo_;
    m.q = RandomTensor(rng, DType::kBFloat16, {1, len, 512}, 1.0f);
    m.scale = ResolveScale(demo_->config, 0.0f, 64);
    m.key_lengths = {len - 5};
    m.label = absl::StrCat("demo-mha self-attention len ", len);
    CheckAgainstReference(m);
  }
}

// [B, L, H * D] (token layout) -> [B, H, L, D] (head layout), same dtype and
// bits: what the sdpa layer takes.
Tensor ToHeadLayout(const Tensor& t, int64_t heads) {
  const int64_t b = t.shape()[0], len = t.shape()[1], d = t.shape()[2] / heads;
  Tensor h(t.dtype(), {b, heads, len, d});
  const size_t row_bytes = static_cast<size_t>(d) * DTypeSize(t.dtype());
  const char* src = static_cast<const char*>(t.data());
  char* dst = static_cast<char*>(h.data());
  for (int64_t bi = 0; bi < b; ++bi) {
    for (int64_t i = 0; i < len; ++i) {
      for (int64_t hi = 0; hi < heads; ++hi) {
        std::memcpy(dst + ((bi * heads + hi) * len + i) * row_bytes,
                    src + ((bi * len + i) * heads + hi) * row_bytes, row_bytes);
      }
    }
  }
  return h;
}

TEST_F(CpuEngineTest, FlashAttentionTakesStridedParamsOfAnyDType) {
  // Token-layout [B, L, H*D] inputs straight into the flash kernel (with the
  // options the cpu engine gives a layer-less call), fp16 in and bf16 out;
  // the oracle is the reference engine's sdpa layer over the same values
  // copied into head layout.
  Rng rng(5);
  const int64_t b = 2, hq = 4, hkv = 2, lq = 5, lk = 7, d = 8;
  const float scale = 0.3f;
  for (DType in : {DType::kFloat32, DType::kFloat16}) {
    const Tensor q = RandomTensor(rng, in, {b, lq, hq * d}, 1.0f);
    const Tensor k = RandomTensor(rng, in, {b, lk, hkv * d}, 1.0f);
    const Tensor v = RandomTensor(rng, in, {b, lk, hkv * d}, 1.0f);
    Tensor out_cpu(DType::kBFloat16, {b, lq, hq * d});
    Tensor w_cpu(DType::kFloat32, {b, hq, lq, lk});
    AttentionParams p;
    p.batch = b;
    p.num_heads = hq;
    p.num_kv_heads = hkv;
    p.head_dim = p.head_dim_v = d;
    p.q_len = lq;
    p.kv_len = lk;
    p.dtype = in;
    p.q = q.data();
    p.k = k.data();
    p.v = v.data();
    TokenLayoutStrides(hq, lq, d, &p.q_stride_b, &p.q_stride_h, &p.q_stride_row);
    TokenLayoutStrides(hkv, lk, d, &p.k_stride_b, &p.k_stride_h, &p.k_stride_row);
    TokenLayoutStrides(hkv, lk, d, &p.v_stride_b, &p.v_stride_h, &p.v_stride_row);
    TokenLayoutStrides(hq, lq, d, &p.o_stride_b, &p.o_stride_h, &p.o_stride_row);
    p.causal = true;
    p.scale = scale;
    p.out = out_cpu.data();
    p.out_dtype = DType::kBFloat16;
    p.weights = w_cpu.data();
    cpu::FlashOptions options;
    options.precision = cpu::FlashPrecision::kFloat32;
    ASSERT_TRUE(cpu::FlashAttention({&p, 1}, options).ok());

    Case c;
    c.layer = sdpa_;
    c.q = ToHeadLayout(q, hq);
    c.k = ToHeadLayout(k, hkv);
    c.v = ToHeadLayout(v, hkv);
    c.causal = true;
    c.scale = scale;
    c.need_weights = true;
    CaseRun ref(c, DType::kFloat32, DType::kFloat32);
    ASSERT_TRUE(reference_->Run(*sdpa_, {&ref.task, 1}).ok());
    EXPECT_EQ(Compare("output", AsFloats(ToHeadLayout(out_cpu, hq)), AsFloats(ref.out),
                      DType::kBFloat16),
              "");
    EXPECT_EQ(Compare("weights", AsFloats(w_cpu), AsFloats(ref.weights), DType::kFloat32), "");
  }
}

// Runs the tasks `order` (indices into `cases`, all of one layer) as one
// batch; returns each case's {output, weights} at its index (empty tensors
// for cases not in the batch).
std::vector<std::pair<Tensor, Tensor>> RunBatch(AttentionEngine& engine,
                                                const std::vector<Case>& cases,
                                                const std::vector<size_t>& order) {
  std::vector<std::unique_ptr<CaseRun>> runs(cases.size());
  std::vector<AttentionTask> tasks;
  for (size_t i : order) {
    runs[i] = std::make_unique<CaseRun>(cases[i], cases[i].out_dtype, cases[i].weights_dtype);
    tasks.push_back(runs[i]->task);
  }
  const absl::Status s = engine.Run(*cases[order[0]].layer, tasks);
  EXPECT_TRUE(s.ok()) << s;
  std::vector<std::pair<Tensor, Tensor>> results(cases.size());
  for (size_t i = 0; i < cases.size(); ++i) {
    if (runs[i] != nullptr) results[i] = {std::move(runs[i]->out), std::move(runs[i]->weights)};
  }
  return results;
}

bool BitwiseEqual(const Tensor& a, const Tensor& b) {
  return a.byte_size() == b.byte_size() &&
         (a.byte_size() == 0 || std::memcmp(a.data(), b.data(), a.byte_size()) == 0);
}

// Cases of one layer for the determinism and invariance tests: the sweep's
// cases that use it.
std::vector<Case> CasesOfLayer(const std::shared_ptr<const AttentionLayer>& layer,
                               const std::shared_ptr<const AttentionLayer>& sdpa,
                               const std::shared_ptr<const AttentionLayer>& demo, size_t n) {
  std::vector<Case> cases;
  for (int i = 0; cases.size() < n && i < kNumRandomCases; ++i) {
    Case c = RandomCase(i, sdpa, demo);
    if (c.layer == layer) cases.push_back(std::move(c));
  }
  return cases;
}

TEST_F(CpuEngineTest, DeterministicAndBatchInvariant) {
  for (const auto& layer : {sdpa_, demo_}) {
    const std::vector<Case> cases = CasesOfLayer(layer, sdpa_, demo_, 8);
    ASSERT_EQ(cases.size(), 8u);
    // Each task alone, twice.
    std::vector<std::pair<Tensor, Tensor>> alone(cases.size());
    for (size_t i = 0; i < cases.size(); ++i) {
      alone[i] = std::move(RunBatch(*cpu_, cases, {i})[i]);
      const auto again = RunBatch(*cpu_, cases, {i});
      EXPECT_TRUE(BitwiseEqual(alone[i].first, again[i].first)) << "rerun of " << cases[i].label;
      EXPECT_TRUE(BitwiseEqual(alone[i].second, again[i].second)) << "rerun of " << cases[i].label;
    }
    // All tasks in one Run, in two different orders.
    for (const std::vector<size_t>& order :
         {std::vector<size_t>{0, 1, 2, 3, 4, 5, 6, 7}, std::vector<size_t>{5, 2, 7, 0, 3, 6, 1, 4}}) {
      const auto together = RunBatch(*cpu_, cases, order);
      for (size_t i = 0; i < cases.size(); ++i) {
        EXPECT_TRUE(BitwiseEqual(alone[i].first, together[i].first))
            << "output of " << cases[i].label;
        EXPECT_TRUE(BitwiseEqual(alone[i].second, together[i].second))
            << "weights of " << cases[i].label;
      }
    }
  }
}

// The engines write every byte of a task's output and weights: the server
// hands them buffers it has not cleared (reused request memory,
// engine/host_buffer.h), so nothing may depend on what was there before.
TEST_F(CpuEngineTest, EveryOutputByteIsWritten) {
  for (AttentionEngine* engine : {cpu_.get(), reference_.get()}) {
    for (int i = 0; i < kNumRandomCases; ++i) {
      const Case c = RandomCase(i, sdpa_, demo_);
      CaseRun zeros(c, c.out_dtype, c.weights_dtype);  // Tensor starts at zero
      CaseRun ones(c, c.out_dtype, c.weights_dtype);
      std::memset(ones.out.data(), 0xFF, ones.out.byte_size());
      if (ones.weights.byte_size() > 0) {
        std::memset(ones.weights.data(), 0xFF, ones.weights.byte_size());
      }
      ASSERT_TRUE(engine->Run(*c.layer, {&zeros.task, 1}).ok()) << c.label;
      ASSERT_TRUE(engine->Run(*c.layer, {&ones.task, 1}).ok()) << c.label;
      EXPECT_TRUE(BitwiseEqual(zeros.out, ones.out)) << engine->name() << " output of " << c.label;
      EXPECT_TRUE(BitwiseEqual(zeros.weights, ones.weights))
          << engine->name() << " weights of " << c.label;
    }
  }
}

TEST_F(CpuEngineTest, ConcurrentCallsGiveTheSameBits) {
  const std::vector<Case> cases = CasesOfLayer(sdpa_, sdpa_, demo_, 6);
  std::vector<size_t> all(cases.size());
  for (size_t i = 0; i < all.size(); ++i) all[i] = i;
  const auto expected = RunBatch(*cpu_, cases, all);
  std::vector<std::vector<std::pair<Tensor, Tensor>>> results(3);
  std::vector<std::thread> threads;
  for (size_t t = 0; t < results.size(); ++t) {
    threads.emplace_back([&, t] {
      for (int rep = 0; rep < 3; ++rep) results[t] = RunBatch(*cpu_, cases, all);
    });
  }
  for (std::thread& th : threads) th.join();
  for (const auto& r : results) {
    ASSERT_EQ(r.size(), expected.size());
    for (size_t i = 0; i < r.size(); ++i) {
      EXPECT_TRUE(BitwiseEqual(r[i].first, expected[i].first)) << "output " << i;
      EXPECT_TRUE(BitwiseEqual(r[i].second, expected[i].second)) << "weights " << i;
    }
  }
}

TEST_F(CpuEngineTest, RejectsBadTasksWithoutThrowing) {
  Case c = RandomCase(0, sdpa_, demo_);
  CaseRun run(c, DType::kFloat32, DType::kFloat32);
  const int64_t too_long[] = {1000, 1000, 1000};
  run.task.key_lengths = absl::MakeSpan(too_long, static_cast<size_t>(c.q.shape()[0]));
  const absl::Status s = cpu_->Run(*c.layer, {&run.task, 1});
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
}

// --- Stacked projections (engine/cpu/projection.h) ------------------------
//
// The cpu backend stacks the rows of every task of a batch into fixed-height
// chunked matmuls. The tests below put tasks of projection layers (fp32, bf16
// and fp16 precision) into batches with random co-tenants (other lengths, self
// and cross attention, masks, dtypes, need_weights) at random positions and
// require the same bits as the task alone; they also check thread-count
// invariance and accuracy against the float64 reference.
//
// bf16 layers: the reference runs on the same bf16-rounded weights, biases and
// inputs; the cpu backend additionally rounds Q, K, V, the softmax
// probabilities and the core output to bf16 (fp32 accumulation), so its error
// bound is a few bf16 ulps of the largest output: kBf16LayerTolerance.
constexpr double kBf16LayerTolerance = 2e-2;

// A projection layer whose query, key and value dims are equal (so tasks may
// be self- or cross-attention), weights drawn from `seed`, NOT rounded to the
// precision (the engine must do it).
std::shared_ptr<const AttentionLayer> MakeProjectionLayer(uint32_t seed, int64_t dim,
                                                          int64_t heads, int64_t kv_heads,
                                                          int64_t head_dim, int64_t out_dim,
                                                          Precision precision) {
  Rng rng(seed);
  auto layer = std::make_shared<AttentionLayer>();
  LayerConfig& c = layer->config;
  c.name = absl::StrCat("proj-", dim, "-", heads, "x", head_dim, "-", static_cast<int>(precision));
  c.has_projections = true;
  c.num_heads = heads;
  c.num_kv_heads = kv_heads;
  c.head_dim = head_dim;
  c.embed_dim = heads * head_dim;
  c.query_dim = c.key_dim = c.value_dim = dim;
  c.out_dim = out_dim;
  c.precision = precision;
  const int64_t qf = heads * head_dim, kvf = kv_heads * head_dim;
  LayerWeights& w = layer->weights;
  auto weight = [&](int64_t out, int64_t in) {
    return RandomTensor(rng, DType::kFloat32, {out, in}, 1.0f / std::sqrt(static_cast<float>(in)));
  };
  w.wq = weight(qf, dim);
  w.bq = RandomTensor(rng, DType::kFloat32, {qf}, 0.5f);
  w.wk = weight(kvf, dim);  // no bk: a fused QKV with a partial bias
  w.wv = weight(kvf, dim);
  w.bv = RandomTensor(rng, DType::kFloat32, {kvf}, 0.5f);
  w.wo = weight(out_dim, qf);
  w.bo = RandomTensor(rng, DType::kFloat32, {out_dim}, 0.5f);
  EXPECT_TRUE(ValidateLayer(*layer).ok());
  return layer;
}

// `layer` with another precision (same weights, unrounded).
std::shared_ptr<const AttentionLayer> WithPrecision(const AttentionLayer& layer,
                                                    Precision precision) {
  auto copy = std::make_shared<AttentionLayer>(layer);
  copy->config.precision = precision;
  copy->config.name += precision == Precision::kBFloat16 ? "-bf16" : "-fp16";
  return copy;
}

Tensor Rounded(const Tensor& t, Precision precision) {
  if (t.byte_size() == 0 || precision == Precision::kFloat32) return t;
  Tensor r = t;
  for (int64_t i = 0; i < r.num_elements(); ++i) {
    StoreFromFloat(r.dtype(), r.data(), i, RoundTo(precision, LoadAsFloat(t.dtype(), t.data(), i)));
  }
  return r;
}

// What the reference should compute for `c` on the cpu backend: weights and
// biases rounded to the layer precision, and for bf16 layers the inputs too.
Case ReferenceCaseFor(const Case& c) {
  const Precision precision = c.layer->config.precision;
  if (precision == Precision::kFloat32) return c;
  auto layer = std::make_shared<AttentionLayer>(*c.layer);
  LayerWeights& w = layer->weights;
  for (Tensor* t : {&w.wq, &w.bq, &w.wk, &w.bk, &w.wv, &w.bv, &w.wo, &w.bo}) {
    *t = Rounded(*t, precision);
  }
  Case r = c;
  r.layer = layer;
  if (precision == Precision::kBFloat16) {
    r.q = Rounded(c.q, precision);
    r.k = Rounded(c.k, precision);
    r.v = Rounded(c.v, precision);
  }
  return r;
}

// A random task for a projection layer made by MakeProjectionLayer: batch 1-2,
// 1-max_len tokens, self or cross attention, any input/output dtype, a mask
// kind, and sometimes weights.
Case RandomProjectionTask(Rng& rng, const std::shared_ptr<const AttentionLayer>& layer,
                          int64_t max_len) {
  const LayerConfig& lc = layer->config;
  Case c;
  c.layer = layer;
  const bool self_attention = rng.Chance(0.5);
  const int64_t batch = rng.Int(1, 2);
  const int64_t lq = rng.Int(1, max_len);
  const int64_t lk = self_attention ? lq : rng.Int(1, max_len);
  const DType in = rng.Pick<DType>({DType::kFloat32, DType::kFloat16, DType::kBFloat16});
  c.q = RandomTensor(rng, in, {batch, lq, lc.query_dim}, 1.0f);
  if (!self_attention) {
    c.k = RandomTensor(rng, in, {batch, lk, lc.key_dim}, 1.0f);
    c.v = RandomTensor(rng, in, {batch, lk, lc.value_dim}, 1.0f);
  }
  std::string mask_label = "none";
  switch (rng.Int(0, 4)) {
    case 1:
      c.mask = RandomMask(rng, DType::kBool, {batch, 1, lq, lk});
      mask_label = "bool";
      break;
    case 2:
      c.mask = RandomMask(rng, DType::kFloat32, {lq, lk});
      mask_label = "additive";
      break;
    case 3:
      for (int64_t b = 0; b < batch; ++b) c.key_lengths.push_back(rng.Int(0, lk));
      mask_label = "key_lengths";
      break;
    case 4:
      c.causal = true;
      mask_label = "causal";
      break;
    default:
      break;
  }
  c.scale = ResolveScale(lc, 0.0f, lc.head_dim);
  c.need_weights = rng.Chance(0.25);
  c.average_weights = c.need_weights && rng.Chance(0.5);
  c.out_dtype = rng.Pick<DType>({DType::kFloat32, DType::kFloat16, DType::kBFloat16});
  c.weights_dtype = DType::kFloat32;
  c.label = absl::StrCat("layer ", lc.name, self_attention ? " self" : " cross", ", query ",
                         ShapeString(c.q.shape()), ", kv len ", lk, ", in ", DT(in), ", out ",
                         DT(c.out_dtype), ", mask ", mask_label,
                         c.need_weights ? ", weights" : "");
  return c;
}

// One request of the position tests below: its lengths, causal, weights
// wanted, a bool mask and key lengths on top.
struct LongSequence {
  int64_t lq, lk;
  bool causal, weights, masked;
};

class StackedProjectionTest : public CpuEngineTest {
 protected:
  // `layer` (4 heads of 16 over 2 KV heads, inputs of 32) and its bf16 copy on
  // one random request of shape `s`, each against the reference.
  void CheckLongSequence(const std::shared_ptr<AttentionLayer>& layer, const LongSequence& s,
                         Rng& rng) {
    ASSERT_TRUE(ValidateLayer(*layer).ok()) << ValidateLayer(*layer);
    for (const auto& each : {std::shared_ptr<const AttentionLayer>(layer),
                             WithPrecision(*layer, Precision::kBFloat16)}) {
      Case c;
      c.layer = each;
      c.q = RandomTensor(rng, DType::kFloat32, {2, s.lq, 32}, 1.0f);
      if (s.lq != s.lk) {
        c.k = RandomTensor(rng, DType::kFloat32, {2, s.lk, 32}, 1.0f);
        c.v = RandomTensor(rng, DType::kFloat32, {2, s.lk, 32}, 1.0f);
      }
      c.causal = s.causal;
      c.need_weights = s.weights;
      if (s.masked) {
        c.mask = RandomMask(rng, DType::kBool, {2, 1, s.lq, s.lk});
        c.key_lengths = {s.lk, s.lk / 3};
      }
      c.scale = ResolveScale(each->config, 0.0f, 16);
      c.label = absl::StrCat(each->config.name, ", Lq ", s.lq, " Lk ", s.lk,
                             s.causal ? " causal" : "", s.weights ? " weights" : "",
                             s.masked ? " mask" : "");
      const auto got = RunBatch(*cpu_, {c}, {0});
      CheckAccuracy(c, got[0].first, got[0].second);
    }
  }

  // The layers under test: demo-mha and a small odd-sized GQA layer, each in
  // fp32 and bf16 precision, and a wide fp32 layer whose fused QKV weights
  // (7 MiB) take 64-row chunks.
  std::vector<std::shared_ptr<const AttentionLayer>> Layers() {
    const auto odd = MakeProjectionLayer(31, 24, 3, 1, 8, 10, Precision::kFloat32);
    return {demo_, WithPrecision(*demo_, Precision::kBFloat16), odd,
            WithPrecision(*odd, Precision::kBFloat16), wide_};
  }

  std::shared_ptr<const AttentionLayer> wide_ =
      MakeProjectionLayer(33, 768, 12, 12, 64, 40, Precision::kFloat32);

  // Pool of random tasks of `layer`; lengths up to 70 tokens so that tasks
  // span several 32-row chunks and share chunks with their neighbours.
  std::vector<Case> Pool(const std::shared_ptr<const AttentionLayer>& layer, uint32_t seed,
                         size_t n) {
    Rng rng(seed);
    std::vector<Case> pool;
    for (size_t i = 0; i < n; ++i) pool.push_back(RandomProjectionTask(rng, layer, 70));
    return pool;
  }

  void CheckAccuracy(const Case& c, const Tensor& out, const Tensor& weights) {
    const Case rc = ReferenceCaseFor(c);
    CaseRun ref(rc, DType::kFloat32, DType::kFloat32);
    ASSERT_TRUE(reference_->Run(*rc.layer, {&ref.task, 1}).ok()) << c.label;
    const bool bf16 = c.layer->config.precision == Precision::kBFloat16;
    auto check = [&](const char* what, const Tensor& got, const Tensor& want, DType dtype) {
      if (!bf16) {
        EXPECT_EQ(Compare(what, AsFloats(got), AsFloats(want), dtype), "") << c.label;
        return;
      }
      const std::vector<float> g = AsFloats(got), w = AsFloats(want);
      double max_ref = 0.0, max_diff = 0.0;
      for (size_t i = 0; i < g.size(); ++i) {
        ASSERT_FALSE(std::isnan(g[i])) << c.label;
        max_ref = std::max(max_ref, std::fabs(static_cast<double>(w[i])));
        max_diff = std::max(max_diff, std::fabs(static_cast<double>(g[i]) - w[i]));
      }
      EXPECT_LE(max_diff / std::max(max_ref, 1e-30), kBf16LayerTolerance) << what << ", " << c.label;
    };
    check("output", out, ref.out, c.out_dtype);
    if (c.need_weights) check("weights", weights, ref.weights, c.weights_dtype);
  }
};

TEST_F(StackedProjectionTest, TaskAloneEqualsTaskAmongRandomCoTenants) {
  uint32_t seed = 100;
  for (const auto& layer : Layers()) {
    const std::vector<Case> pool = Pool(layer, ++seed, 14);
    std::vector<std::pair<Tensor, Tensor>> alone(pool.size());
    for (size_t i = 0; i < pool.size(); ++i) {
      alone[i] = std::move(RunBatch(*cpu_, pool, {i})[i]);
      CheckAccuracy(pool[i], alone[i].first, alone[i].second);
    }
    Rng rng(seed * 7);
    for (int trial = 0; trial < 12; ++trial) {
      // A random subset of 2..all tasks in random order.
      std::vector<size_t> order(pool.size());
      for (size_t i = 0; i < order.size(); ++i) order[i] = i;
      for (size_t i = order.size() - 1; i > 0; --i) {
        std::swap(order[i], order[static_cast<size_t>(rng.Int(0, static_cast<int64_t>(i)))]);
      }
      order.resize(static_cast<size_t>(rng.Int(2, static_cast<int64_t>(pool.size()))));
      const auto together = RunBatch(*cpu_, pool, order);
      for (size_t pos = 0; pos < order.size(); ++pos) {
        const size_t i = order[pos];
        EXPECT_TRUE(BitwiseEqual(alone[i].first, together[i].first))
            << "output of " << pool[i].label << " at position " << pos << " of " << order.size();
        EXPECT_TRUE(BitwiseEqual(alone[i].second, together[i].second))
            << "weights of " << pool[i].label << " at position " << pos;
      }
    }
  }
}

// The engine keeps its activation and chunk buffers per thread from call to
// call (engine/cpu/thread_buffer.h). Whatever an earlier call left in them --
// here NaN in every slot of the calling thread and of each OpenMP worker --
// must never reach a result: every task, alone and in a batch, gives the
// bits a thread with fresh buffers gives.
TEST_F(StackedProjectionTest, StaleThreadBuffersNeverReachAResult) {
  auto poison = [] {
    for (int s = 0; s < static_cast<int>(cpu::BufferSlot::kCount); ++s) {
      const size_t bytes = size_t{3} << 20;  // 9 slots x 3 MiB: all kept
      cpu::ThreadBuffer b(static_cast<cpu::BufferSlot>(s), bytes);
      std::fill_n(reinterpret_cast<float*>(b.data()), bytes / sizeof(float),
                  std::numeric_limits<float>::quiet_NaN());
    }
  };
  uint32_t seed = 300;
  for (const auto& layer : Layers()) {
    const std::vector<Case> pool = Pool(layer, ++seed, 6);
    std::vector<size_t> all(pool.size());
    for (size_t i = 0; i < all.size(); ++i) all[i] = i;
    std::vector<std::pair<Tensor, Tensor>> fresh;
    std::thread([&] { fresh = RunBatch(*cpu_, pool, all); }).join();
    for (size_t i = 0; i < pool.size(); ++i) {
#pragma omp parallel num_threads(3)
      poison();
      poison();
      const auto alone = RunBatch(*cpu_, pool, {i});
      EXPECT_TRUE(BitwiseEqual(fresh[i].first, alone[i].first)) << "alone: " << pool[i].label;
      EXPECT_TRUE(BitwiseEqual(fresh[i].second, alone[i].second)) << "alone: " << pool[i].label;
    }
#pragma omp parallel num_threads(3)
    poison();
    poison();
    const auto together = RunBatch(*cpu_, pool, all);
    for (size_t i = 0; i < pool.size(); ++i) {
      EXPECT_TRUE(BitwiseEqual(fresh[i].first, together[i].first)) << "batch: " << pool[i].label;
      EXPECT_TRUE(BitwiseEqual(fresh[i].second, together[i].second)) << "batch: " << pool[i].label;
    }
  }
}

TEST_F(StackedProjectionTest, ResultsDoNotDependOnTheThreadCount) {
  std::vector<std::unique_ptr<AttentionEngine>> engines;
  for (int threads : {1, 2, 3}) {
    absl::StatusOr<std::unique_ptr<AttentionEngine>> e = CreateEngine("cpu", {threads});
    ASSERT_TRUE(e.ok()) << e.status();
    engines.push_back(std::move(*e));
  }
  uint32_t seed = 200;
  for (const auto& layer : Layers()) {
    const std::vector<Case> pool = Pool(layer, ++seed, 10);
    std::vector<size_t> all(pool.size());
    for (size_t i = 0; i < all.size(); ++i) all[i] = i;
    const auto expected = RunBatch(*engines[0], pool, all);
    for (size_t e = 1; e < engines.size(); ++e) {
      const auto got = RunBatch(*engines[e], pool, all);
      for (size_t i = 0; i < pool.size(); ++i) {
        EXPECT_TRUE(BitwiseEqual(expected[i].first, got[i].first))
            << "threads " << e + 1 << ", output of " << pool[i].label;
        EXPECT_TRUE(BitwiseEqual(expected[i].second, got[i].second))
            << "threads " << e + 1 << ", weights of " << pool[i].label;
      }
    }
  }
}

TEST_F(StackedProjectionTest, ConcurrentFirstCallsOnAFreshEngineGiveTheSameBits) {
  // Several threads race to prepare the same layer (prepacked weights are
  // built on first use under the layer's lock) and then run it together.
  for (const auto& layer : {demo_, WithPrecision(*demo_, Precision::kBFloat16)}) {
    const std::vector<Case> pool = Pool(layer, 300, 6);
    std::vector<size_t> all(pool.size());
    for (size_t i = 0; i < all.size(); ++i) all[i] = i;
    const auto expected = RunBatch(*cpu_, pool, all);
    absl::StatusOr<std::unique_ptr<AttentionEngine>> fresh = CreateEngine("cpu");
    ASSERT_TRUE(fresh.ok());
    std::vector<std::vector<std::pair<Tensor, Tensor>>> results(4);
    std::vector<std::thread> threads;
    for (size_t t = 0; t < results.size(); ++t) {
      threads.emplace_back([&, t] { results[t] = RunBatch(**fresh, pool, all); });
    }
    for (std::thread& th : threads) th.join();
    for (const auto& r : results) {
      for (size_t i = 0; i < pool.size(); ++i) {
        EXPECT_TRUE(BitwiseEqual(r[i].first, expected[i].first)) << pool[i].label;
        EXPECT_TRUE(BitwiseEqual(r[i].second, expected[i].second)) << pool[i].label;
      }
    }
  }
}

TEST_F(StackedProjectionTest, Fp16LayerIsFp32ComputeWithFp16Weights) {
  // Documented behaviour: fp16 precision rounds weights and biases to fp16
  // values and computes in fp32 (inputs are not rounded): fp32 tolerance
  // against a reference on the rounded weights.
  const auto layer = WithPrecision(*MakeProjectionLayer(41, 24, 3, 1, 8, 10, Precision::kFloat32),
                                   Precision::kFloat16);
  const std::vector<Case> pool = Pool(layer, 41, 8);
  std::vector<size_t> all(pool.size());
  for (size_t i = 0; i < all.size(); ++i) all[i] = i;
  const auto got = RunBatch(*cpu_, pool, all);
  for (size_t i = 0; i < pool.size(); ++i) CheckAccuracy(pool[i], got[i].first, got[i].second);
}

TEST_F(StackedProjectionTest, ANewLayerAtAFreedLayersAddressGetsItsOwnWeights) {
  // The engine caches prepacked weights by layer address; a layer built in the
  // same storage after another was destroyed must not see the old weights.
  std::optional<AttentionLayer> slot;
  for (uint32_t seed : {51u, 52u, 53u}) {
    slot.emplace(*MakeProjectionLayer(seed, 24, 3, 1, 8, 10, Precision::kFloat32));
    // A non-owning shared_ptr: every case of this round uses `slot`'s address.
    const std::shared_ptr<const AttentionLayer> layer(&*slot, [](const AttentionLayer*) {});
    const std::vector<Case> pool = Pool(layer, seed, 3);
    for (size_t i = 0; i < pool.size(); ++i) {
      const auto got = RunBatch(*cpu_, pool, {i});
      CheckAccuracy(pool[i], got[i].first, got[i].second);
    }
    slot.reset();
  }
}

TEST_F(StackedProjectionTest, ALayerRebuiltInPlaceWithANewIdGetsItsNewWeights) {
  // The strongest reuse: the same layer object and the same weight buffers,
  // every output weight changed, as a layer rebuilt in place would be. Only
  // the new LayerId tells the engine; with the old id it would keep serving
  // the weights it prepacked first.
  AttentionLayer built = *MakeProjectionLayer(54, 24, 3, 1, 8, 10, Precision::kFloat32);
  const std::shared_ptr<const AttentionLayer> layer(&built, [](const AttentionLayer*) {});
  for (uint32_t round = 0; round < 2; ++round) {
    const std::vector<Case> pool = Pool(layer, 60 + round, 2);
    for (size_t i = 0; i < pool.size(); ++i) {
      const auto got = RunBatch(*cpu_, pool, {i});
      CheckAccuracy(pool[i], got[i].first, got[i].second);
    }
    float* wo = built.weights.wo.data_as<float>();
    for (int64_t k = 0; k < built.weights.wo.num_elements(); ++k) wo[k] = 0.5f - 2.0f * wo[k];
    const uint64_t old_id = built.id.value();
    built.id = LayerId();
    ASSERT_NE(built.id.value(), old_id);
  }
}

// A relative position bias (T5, MPNet) over sequences longer than its
// distance and than one 256-key block, on fp32 and bf16 layers against the
// reference: an encoder's self-attention, cross lengths with causal (each
// row's position bottom-right), a decode row split across threads, the
// weights pass, a bool mask and key lengths on top; a distance of 5, so
// most keys take the table's ends, and T5's 128.
TEST_F(StackedProjectionTest, RelativeBiasOverLongSequences) {
  Rng rng(89);
  const auto base = MakeProjectionLayer(34, 32, 4, 2, 16, 24, Precision::kFloat32);
  for (const auto& [distance, s] :
       {std::pair<int64_t, LongSequence>{128, {700, 700, false, false, false}},
        {5, {300, 300, false, false, false}},
        {128, {300, 900, true, false, false}},
        {128, {1, 3000, true, false, false}},
        {5, {40, 600, true, true, false}},
        {128, {200, 400, false, true, true}}}) {
    auto biased = std::make_shared<AttentionLayer>(*base);
    biased->config.name = absl::StrCat("relative-bias-", distance);
    biased->config.relative_bias_distance = distance;
    biased->weights.relative_bias = RandomTensor(rng, DType::kFloat32, {4, 2 * distance + 1},
                                                 3.0f);
    CheckLongSequence(biased, s, rng);
  }
}

// Relative position embeddings (DeBERTa) over sequences longer than their
// distance and than one 256-key block, on fp32 and bf16 layers with grouped
// KV heads against the reference: content-to-position and
// position-to-content terms alone and together, an encoder's
// self-attention, cross lengths with causal (each row's position
// bottom-right), a decode row split across threads, the weights pass, a
// bool mask and key lengths on top; distance 5 (most keys take the tables'
// ends, vectors straddling them) and 300.
TEST_F(StackedProjectionTest, RelativeEmbeddingsOverLongSequences) {
  Rng rng(90);
  const auto base = MakeProjectionLayer(35, 32, 4, 2, 16, 24, Precision::kFloat32);
  struct Embedded {
    int64_t distance;
    bool c2p, p2c;
    LongSequence s;
  };
  for (const Embedded& e : {Embedded{300, true, true, {700, 700, false, false, false}},
                            Embedded{5, true, false, {300, 300, false, false, false}},
                            Embedded{5, false, true, {300, 300, false, false, false}},
                            Embedded{300, true, true, {300, 900, true, false, false}},
                            Embedded{5, true, true, {1, 3000, true, false, false}},
                            Embedded{5, true, true, {40, 600, true, true, false}},
                            Embedded{300, true, true, {200, 400, false, true, true}}}) {
    auto embedded = std::make_shared<AttentionLayer>(*base);
    embedded->config.name = absl::StrCat("relative-embeddings-", e.distance, e.c2p ? "-c2p" : "",
                                         e.p2c ? "-p2c" : "");
    embedded->config.relative_embeddings = {e.distance, e.c2p, e.p2c};
    const Shape table{4, 16, 2 * e.distance + 1};
    if (e.c2p) embedded->weights.relative_key = RandomTensor(rng, DType::kFloat32, table, 1.0f);
    if (e.p2c) embedded->weights.relative_query = RandomTensor(rng, DType::kFloat32, table, 1.0f);
    CheckLongSequence(embedded, e.s, rng);
  }
}

TEST(ChunkedLinearTest, RowsAreIndependentOfTheirPositionInAChunk) {
  // Not required for correctness (the engine falls back to chunk-aligned
  // tasks), but expected of oneDNN's kernels on x86; a failure here means the
  // fallback is the path in use on this CPU.
  dnnl::engine engine(dnnl::engine::kind::cpu, 0);
  const auto layer = MakeProjectionLayer(61, 24, 3, 1, 8, 10, Precision::kFloat32);
  for (Precision precision : {Precision::kFloat32, Precision::kBFloat16}) {
    // bf16 compute where the engine uses it, else the fp32 fallback.
    cpu::LayerProjections projections(engine, precision, cpu::HasBf16Matmuls());
    for (auto get : {&cpu::LayerProjections::qkv, &cpu::LayerProjections::o}) {
      absl::StatusOr<const cpu::ChunkedLinear*> linear = (projections.*get)(*layer);
      ASSERT_TRUE(linear.ok()) << linear.status();
      // Measured true on AVX-512 Xeons; oneDNN 2.6's AVX2 kernels (AMD EPYC)
      // give row results that depend on the row's place in a chunk.
      if (!(*linear)->rows_independent() && !cpu::GetCpuFeatures().avx512) {
        GTEST_SKIP() << "rows_independent() is false on this CPU without AVX-512; the engine "
                        "aligns each task to a chunk there (checked by "
                        "PanelsComputeEveryColumnAndKeepRowsInvariant and CpuEngineTest)";
      }
      EXPECT_TRUE((*linear)->rows_independent());
    }
  }
}

TEST(ChunkedLinearTest, ChunkHeightFollowsTheWeightSize) {
  dnnl::engine engine(dnnl::engine::kind::cpu, 0);
  const auto wide = MakeProjectionLayer(33, 768, 12, 12, 64, 40, Precision::kFloat32);
  cpu::LayerProjections fp32(engine, Precision::kFloat32, true);
  cpu::LayerProjections bf16(engine, Precision::kBFloat16, cpu::HasBf16Matmuls());
  cpu::LayerProjections demo(engine, Precision::kFloat32, true);  // one per layer
  const auto demo_layer = MakeDemoMhaLayer();
  using Linear = absl::StatusOr<const cpu::ChunkedLinear*>;
  const Linear fp32_qkv = fp32.qkv(*wide), fp32_o = fp32.o(*wide), bf16_qkv = bf16.qkv(*wide),
               demo_qkv = demo.qkv(*demo_layer);
  for (const Linear* l : {&fp32_qkv, &fp32_o, &bf16_qkv, &demo_qkv}) {
    ASSERT_TRUE(l->ok()) << l->status();
  }
  EXPECT_EQ((*fp32_qkv)->chunk_rows(), cpu::kTallChunkRows);  // 768 x 2304 fp32: 6.75 MiB
  EXPECT_EQ((*fp32_o)->chunk_rows(), cpu::kChunkRows);
  // 3.4 MiB in bf16; the fp32 fallback's 6.75 MiB on CPUs without bf16 matmuls.
  EXPECT_EQ((*bf16_qkv)->chunk_rows(),
            cpu::HasBf16Matmuls() ? cpu::kChunkRows : cpu::kTallChunkRows);
  EXPECT_EQ((*demo_qkv)->chunk_rows(), cpu::kChunkRows);  // 3 MiB
}

TEST(ChunkedLinearTest, ColumnPanelsAreSizedByTheBudget) {
  dnnl::engine engine(dnnl::engine::kind::cpu, 0);
  Rng rng(81);
  const Tensor w = RandomTensor(rng, DType::kFloat32, {96, 24}, 0.3f);
  const Tensor b = RandomTensor(rng, DType::kFloat32, {96}, 0.5f);
  auto make = [&](size_t budget) {
    auto l = cpu::ChunkedLinear::Create(engine, {&w}, {&b}, Precision::kFloat32, DType::kFloat32,
                                        DType::kFloat32, budget);
    EXPECT_TRUE(l.ok()) << l.status();
    return std::move(*l);
  };
  // 96 columns x 96 bytes each: widest multiple-of-16 divisor that fits.
  EXPECT_EQ(make(32 * 96)->panel_cols(), 32);
  EXPECT_EQ(make(32 * 96)->panels(), 3);
  EXPECT_EQ(make(60 * 96)->panel_cols(), 48);
  EXPECT_EQ(make(96 * 96)->panels(), 1);
  EXPECT_EQ(make(8 * 96)->panels(), 1);  // no multiple of 16 fits: one panel
  // The engine's budget on this CPU: demo-mha's fused QKV (3 MiB fp32) is
  // always cut, since the budget is at most 2 MiB.
  EXPECT_LE(cpu::DefaultPanelBytes(), size_t{2} << 20);
  cpu::LayerProjections demo(engine, Precision::kFloat32, true);
  const cpu::ChunkedLinear* qkv = *demo.qkv(*MakeDemoMhaLayer());
  EXPECT_GT(qkv->panels(), 1);
  EXPECT_LE(static_cast<size_t>(qkv->panel_cols()) * 512 * sizeof(float),
            cpu::DefaultPanelBytes());
}

TEST(ChunkedLinearTest, PanelsComputeEveryColumnAndKeepRowsInvariant) {
  // y = x W^T + b through 3 column panels, against float64 and against one
  // panel; then rows of a block alone vs the same rows among co-tenants at
  // other offsets (chunk-aligned ones where rows_independent() is false, as
  // LayoutRowsFor places them), on 1 and 2 threads, into outputs of other
  // dtypes and strides (the scatter of each panel's columns). fp32 and bf16
  // layers, in the compute type the engine gives them on this CPU.
  dnnl::engine engine(dnnl::engine::kind::cpu, 0);
  Rng rng(82);
  constexpr int64_t kN = 96, kK = 24;
  const Tensor w = RandomTensor(rng, DType::kFloat32, {kN, kK}, 0.3f);
  const Tensor b = RandomTensor(rng, DType::kFloat32, {kN}, 0.5f);
  for (Precision precision : {Precision::kFloat32, Precision::kBFloat16}) {
    const DType compute = precision == Precision::kBFloat16 && cpu::HasBf16Matmuls()
                              ? DType::kBFloat16
                              : DType::kFloat32;
    auto paneled = cpu::ChunkedLinear::Create(engine, {&w}, {&b}, precision, compute,
                                              DType::kFloat32, 32 * kK * DTypeSize(compute));
    auto whole = cpu::ChunkedLinear::Create(engine, {&w}, {&b}, precision, compute,
                                            DType::kFloat32, 1 << 20);
    ASSERT_TRUE(paneled.ok()) << paneled.status();
    ASSERT_TRUE(whole.ok()) << whole.status();
    ASSERT_EQ((*paneled)->panels(), 3);
    ASSERT_EQ((*whole)->panels(), 1);

    // rows [row0, row0 + x.rows) of a `total`-row job; output row stride
    // `stride` (>= kN) in `out_dtype`.
    auto run = [&](const cpu::ChunkedLinear& linear, const std::vector<const Tensor*>& xs,
                   const std::vector<int64_t>& row0, int64_t total, DType out_dtype,
                   int64_t stride, int threads) {
      std::vector<Tensor> ys;
      cpu::LinearJob job;
      job.linear = &linear;
      job.rows = (total + linear.chunk_rows() - 1) / linear.chunk_rows() * linear.chunk_rows();
      for (size_t i = 0; i < xs.size(); ++i) {
        const int64_t rows = xs[i]->shape()[0];
        ys.emplace_back(out_dtype, Shape{rows, stride});
        job.in.push_back({row0[i], rows, xs[i]->dtype(), xs[i]->data(), kK});
      }
      for (size_t i = 0; i < xs.size(); ++i) {
        job.out.push_back({row0[i], xs[i]->shape()[0], out_dtype, ys[i].data(), stride});
      }
      const absl::Status s = cpu::RunLinearJobs({&job, 1}, engine, threads);
      EXPECT_TRUE(s.ok()) << s;
      return ys;
    };
    const Tensor x = RandomTensor(rng, DType::kFloat32, {45, kK}, 1.0f);
    const Tensor y = run(**paneled, {&x}, {0}, 45, DType::kFloat32, kN, 1)[0];
    const Tensor y1 = run(**whole, {&x}, {0}, 45, DType::kFloat32, kN, 1)[0];
    const Tensor wr = Rounded(w, precision), br = Rounded(b, precision);
    const Tensor xr = Rounded(x, compute == DType::kBFloat16 ? precision : Precision::kFloat32);
    const double tolerance = compute == DType::kFloat32 ? 1e-5 : 1e-2;
    for (int64_t r = 0; r < 45; ++r) {
      for (int64_t n = 0; n < kN; ++n) {
        double want = br.data_as<float>()[n];
        for (int64_t k = 0; k < kK; ++k) {
          want += static_cast<double>(xr.data_as<float>()[r * kK + k]) * wr.data_as<float>()[n * kK + k];
        }
        const float got = y.data_as<float>()[r * kN + n];
        ASSERT_NEAR(got, want, tolerance * (1.0 + std::fabs(want))) << "row " << r << " col " << n;
        ASSERT_NEAR(got, y1.data_as<float>()[r * kN + n], tolerance * (1.0 + std::fabs(want)));
      }
    }

    // Where a row's bits depend on its place in a chunk (oneDNN 2.6's AVX2
    // kernels), a block starts at a chunk boundary, as in the engine.
    const int64_t h = (*paneled)->chunk_rows();
    auto place = [&](int64_t row) {
      return (*paneled)->rows_independent() ? row : (row + h - 1) / h * h;
    };
    const Tensor target = RandomTensor(rng, DType::kFloat16, {37, kK}, 1.0f);
    for (DType out_dtype : {DType::kFloat32, DType::kBFloat16}) {
      const int64_t stride = out_dtype == DType::kFloat32 ? kN : kN + 5;
      const Tensor alone = run(**paneled, {&target}, {0}, 37, out_dtype, stride, 1)[0];
      for (int trial = 0; trial < 6; ++trial) {
        const Tensor before = RandomTensor(rng, DType::kFloat32, {rng.Int(1, 70), kK}, 1.0f);
        const Tensor after = RandomTensor(rng, DType::kBFloat16, {rng.Int(1, 40), kK}, 1.0f);
        const int64_t at = place(before.shape()[0] + rng.Int(0, 3));
        const int64_t end = place(at + 37 + rng.Int(0, 3));
        const auto ys = run(**paneled, {&before, &target, &after}, {0, at, end},
                            end + after.shape()[0], out_dtype, stride, trial % 2 + 1);
        EXPECT_TRUE(BitwiseEqual(alone, ys[1]))
            << DT(compute) << " compute, out " << DT(out_dtype) << ", rows at " << at
            << (at % h == 0 ? " (chunk-aligned)" : "");
      }
    }
  }
}

TEST(ChunkedLinearTest, AMatmulOneDnnLacksIsUnimplementedNotAnAbort) {
  // oneDNN 2.6 has bf16 matmuls on every AVX-512 CPU (emulated without
  // AVX512_BF16) and none below; the engine never asks for one there
  // (HasBf16Matmuls), but a caller that does gets a Status.
  if (cpu::GetCpuFeatures().avx512) GTEST_SKIP() << "this CPU has oneDNN bf16 matmuls (AVX-512)";
  ASSERT_FALSE(cpu::HasBf16Matmuls());
  dnnl::engine engine(dnnl::engine::kind::cpu, 0);
  Rng rng(72);
  const Tensor w = RandomTensor(rng, DType::kFloat32, {40, 24}, 0.3f);
  const Tensor b = RandomTensor(rng, DType::kFloat32, {40}, 0.5f);
  const auto linear = cpu::ChunkedLinear::Create(engine, {&w}, {&b}, Precision::kBFloat16,
                                                 DType::kBFloat16, DType::kFloat32);
  EXPECT_EQ(linear.status().code(), absl::StatusCode::kUnimplemented) << linear.status();
  const auto layer = MakeProjectionLayer(61, 24, 3, 1, 8, 10, Precision::kBFloat16);
  cpu::LayerProjections forced(engine, Precision::kBFloat16, /*bf16_compute=*/true);
  EXPECT_EQ(forced.qkv(*layer).status().code(), absl::StatusCode::kUnimplemented);
}

TEST(ChunkedLinearTest, RoundsWeightsToThePrecisionThenComputesInTheComputeType) {
  // A bf16 or fp16 layer computed in fp32 (fp16 always; bf16 on CPUs without
  // AVX512_BF16/AMX) is bitwise an fp32 linear on pre-rounded weights.
  dnnl::engine engine(dnnl::engine::kind::cpu, 0);
  Rng rng(71);
  const Tensor w = RandomTensor(rng, DType::kFloat32, {40, 24}, 0.3f);
  const Tensor b = RandomTensor(rng, DType::kFloat32, {40}, 0.5f);
  const Tensor x = RandomTensor(rng, DType::kFloat32, {45, 24}, 1.0f);
  auto run = [&](const cpu::ChunkedLinear& linear) {
    Tensor y(DType::kFloat32, {45, 40});
    cpu::LinearJob job;
    job.linear = &linear;
    job.rows = 64;
    job.in.push_back({0, 45, DType::kFloat32, x.data(), 24});
    job.out.push_back({0, 45, DType::kFloat32, y.data(), 40});
    EXPECT_TRUE(cpu::RunLinearJobs({&job, 1}, engine, 2).ok());
    return y;
  };
  for (Precision precision : {Precision::kBFloat16, Precision::kFloat16}) {
    const Tensor wr = Rounded(w, precision), br = Rounded(b, precision);
    auto rounded = cpu::ChunkedLinear::Create(engine, {&w}, {&b}, precision, DType::kFloat32,
                                              DType::kFloat32);
    auto plain = cpu::ChunkedLinear::Create(engine, {&wr}, {&br}, Precision::kFloat32,
                                            DType::kFloat32, DType::kFloat32);
    ASSERT_TRUE(rounded.ok() && plain.ok());
    EXPECT_TRUE(BitwiseEqual(run(**rounded), run(**plain)));
  }
  EXPECT_EQ(cpu::LayerProjections(engine, Precision::kBFloat16, false).activation_dtype(),
            DType::kFloat32);
  EXPECT_EQ(cpu::LayerProjections(engine, Precision::kBFloat16, true).activation_dtype(),
            DType::kBFloat16);
  EXPECT_EQ(cpu::LayerProjections(engine, Precision::kFloat16, true).activation_dtype(),
            DType::kFloat32);
}

TEST(ChunkedLinearTest, LayoutRowsPacksOrAlignsToChunks) {
  const cpu::RowLayout packed = cpu::LayoutRows({5, 40, 1}, 32, false);
  EXPECT_EQ(packed.offsets, (std::vector<int64_t>{0, 5, 45}));
  EXPECT_EQ(packed.total, 64);
  const cpu::RowLayout aligned = cpu::LayoutRows({5, 40, 1}, 32, true);
  EXPECT_EQ(aligned.offsets, (std::vector<int64_t>{0, 32, 96}));
  EXPECT_EQ(aligned.total, 128);
  EXPECT_EQ(cpu::LayoutRows({5, 40, 1}, 64, false).total, 64);
  EXPECT_EQ(cpu::LayoutRows({}, 32, false).total, 0);
}

}  // namespace
}  // namespace attnserve
