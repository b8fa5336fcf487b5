// The cpu backend against the float64 reference over seeded random cases
// (every mask kind and broadcast shape, GQA, cross attention, Dv != Dk, each
// dtype, fully masked rows, need_weights, sdpa and projection layers), plus
// determinism, batch invariance and concurrent use.
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
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "engine/attention_engine.h"
#include "engine/cpu/attention_core.h"
#include "engine/model/builtin_models.h"
#include "engine/reference/reference_engine.h"
#include "gtest/gtest.h"

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

// Portable draws from mt19937 (whose sequence the standard fixes; the
// std:: distributions are implementation-defined).
class Rng {
 public:
  explicit Rng(uint32_t seed) : gen_(seed) {}
  int64_t Int(int64_t lo, int64_t hi) {  // [lo, hi]
    return lo + static_cast<int64_t>(gen_() % static_cast<uint32_t>(hi - lo + 1));
  }
  float Uniform(float lo, float hi) {
    return lo + (hi - lo) * static_cast<float>(gen_() >> 8) * 0x1.0p-24f;
  }
  bool Chance(double p) { return static_cast<double>(gen_() >> 8) * 0x1.0p-24 < p; }
  template <typename T>
  const T& Pick(const std::vector<T>& v) {
    return v[static_cast<size_t>(Int(0, static_cast<int64_t>(v.size()) - 1))];
  }

 private:
  std::mt19937 gen_;
};

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
  EXPECT_TRUE(ValidateLayer(*layer).ok());
  return layer;
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
  if (layer_kind < 3) {
    c.layer = sdpa;
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
  c.causal = mask_kind == kCausal || mask_kind == kAll;
  if (c.causal) mask_label += " causal";

  const float request_scale = rng.Chance(0.3) ? rng.Uniform(0.2f, 1.5f) : 0.0f;
  c.scale = ResolveScale(lc, request_scale, head_dim);
  c.need_weights = rng.Chance(0.6);
  c.average_weights = c.need_weights && rng.Chance(0.5);

  c.label = absl::StrCat(
      "case ", i, ": layer ", lc.name, self_attention ? " (self-attention)" : "", ", query ",
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

TEST_F(CpuEngineTest, AttendTakesStridedParamsOfAnyDType) {
  // Token-layout [B, L, H*D] inputs through Attend(), fp16 in and bf16 out.
  Rng rng(5);
  const int64_t b = 2, hq = 4, hkv = 2, lq = 5, lk = 7, d = 8;
  for (DType in : {DType::kFloat32, DType::kFloat16}) {
    const Tensor q = RandomTensor(rng, in, {b, lq, hq * d}, 1.0f);
    const Tensor k = RandomTensor(rng, in, {b, lk, hkv * d}, 1.0f);
    const Tensor v = RandomTensor(rng, in, {b, lk, hkv * d}, 1.0f);
    Tensor out_ref(DType::kFloat32, {b, lq, hq * d}), out_cpu(DType::kBFloat16, {b, lq, hq * d});
    Tensor w_ref(DType::kFloat32, {b, hq, lq, lk}), w_cpu(DType::kFloat32, {b, hq, lq, lk});
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
    p.scale = 0.3f;
    AttentionParams pr = p, pc = p;
    pr.out = out_ref.data();
    pr.weights = w_ref.data();
    pc.out = out_cpu.data();
    pc.out_dtype = DType::kBFloat16;
    pc.weights = w_cpu.data();
    ASSERT_TRUE(reference_->Attend({&pr, 1}).ok());
    ASSERT_TRUE(cpu_->Attend({&pc, 1}).ok());
    EXPECT_EQ(Compare("output", AsFloats(out_cpu), AsFloats(out_ref), DType::kBFloat16), "");
    EXPECT_EQ(Compare("weights", AsFloats(w_cpu), AsFloats(w_ref), DType::kFloat32), "");
  }
}

TEST_F(CpuEngineTest, CoreSplitsLargeRequestsWithoutChangingResults) {
  // Forces the core's per-batch-element, few-rows-at-a-time path with a tiny
  // score budget and compares with the reference.
  Rng rng(9);
  const int64_t b = 3, hq = 4, hkv = 1, lq = 11, lk = 6, d = 5, dv = 3;
  const Tensor q = RandomTensor(rng, DType::kFloat32, {b, hq, lq, d}, 1.0f);
  const Tensor k = RandomTensor(rng, DType::kFloat32, {b, hkv, lk, d}, 1.0f);
  const Tensor v = RandomTensor(rng, DType::kFloat32, {b, hkv, lk, dv}, 1.0f);
  const Tensor mask = RandomMask(rng, DType::kFloat16, {b, 1, lq, lk});
  Tensor out_ref(DType::kFloat32, {b, hq, lq, dv}), out_cpu(DType::kFloat32, {b, hq, lq, dv});
  Tensor w_ref(DType::kFloat32, {b, lq, lk}), w_cpu(DType::kFloat32, {b, lq, lk});
  AttentionParams p;
  p.batch = b;
  p.num_heads = hq;
  p.num_kv_heads = hkv;
  p.head_dim = d;
  p.head_dim_v = dv;
  p.q_len = lq;
  p.kv_len = lk;
  p.q = q.data();
  p.k = k.data();
  p.v = v.data();
  HeadLayoutStrides(hq, lq, d, &p.q_stride_b, &p.q_stride_h, &p.q_stride_row);
  HeadLayoutStrides(hkv, lk, d, &p.k_stride_b, &p.k_stride_h, &p.k_stride_row);
  HeadLayoutStrides(hkv, lk, dv, &p.v_stride_b, &p.v_stride_h, &p.v_stride_row);
  HeadLayoutStrides(hq, lq, dv, &p.o_stride_b, &p.o_stride_h, &p.o_stride_row);
  p.mask = *MakeMaskParams(mask.view(), b, hq, lq, lk);
  p.scale = 0.7f;
  p.average_weights = true;
  AttentionParams pr = p, pc = p;
  pr.out = out_ref.data();
  pr.weights = w_ref.data();
  ASSERT_TRUE(reference_->Attend({&pr, 1}).ok());
  for (int64_t budget : {int64_t{1}, hq * lk * 3, hq * lk * lq * 2}) {
    pc.out = out_cpu.data();
    pc.weights = w_cpu.data();
    cpu::MatmulCache matmuls;
    dnnl::stream stream(matmuls.engine());
    ASSERT_TRUE(cpu::AttentionCoreF32(pc, matmuls, stream, budget).ok());
    EXPECT_EQ(Compare("output", AsFloats(out_cpu), AsFloats(out_ref), DType::kFloat32), "")
        << "budget " << budget;
    EXPECT_EQ(Compare("weights", AsFloats(w_cpu), AsFloats(w_ref), DType::kFloat32), "")
        << "budget " << budget;
  }
}

std::vector<Tensor> RunAndCollect(AttentionEngine& engine, const std::vector<Case>& cases,
                                  const std::vector<size_t>& order) {
  std::vector<std::unique_ptr<CaseRun>> runs(cases.size());
  std::vector<AttentionTask> tasks;
  for (size_t i : order) {
    runs[i] = std::make_unique<CaseRun>(cases[i], cases[i].out_dtype, cases[i].weights_dtype);
    tasks.push_back(runs[i]->task);
  }
  const absl::Status s = engine.Run(*cases[order[0]].layer, tasks);
  EXPECT_TRUE(s.ok()) << s;
  std::vector<Tensor> results;
  for (size_t i = 0; i < cases.size(); ++i) {
    if (runs[i] == nullptr) continue;
    results.push_back(std::move(runs[i]->out));
    results.push_back(std::move(runs[i]->weights));
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
    std::vector<std::vector<Tensor>> alone;
    for (size_t i = 0; i < cases.size(); ++i) {
      alone.push_back(RunAndCollect(*cpu_, cases, {i}));
      std::vector<Tensor> again = RunAndCollect(*cpu_, cases, {i});
      for (size_t t = 0; t < again.size(); ++t) {
        EXPECT_TRUE(BitwiseEqual(alone[i][t], again[t])) << "rerun of " << cases[i].label;
      }
    }
    // All tasks in one Run, in two different orders.
    for (const std::vector<size_t>& order :
         {std::vector<size_t>{0, 1, 2, 3, 4, 5, 6, 7}, std::vector<size_t>{5, 2, 7, 0, 3, 6, 1, 4}}) {
      const std::vector<Tensor> together = RunAndCollect(*cpu_, cases, order);
      for (size_t i = 0; i < cases.size(); ++i) {
        EXPECT_TRUE(BitwiseEqual(alone[i][0], together[2 * i])) << "output of " << cases[i].label;
        EXPECT_TRUE(BitwiseEqual(alone[i][1], together[2 * i + 1]))
            << "weights of " << cases[i].label;
      }
    }
  }
}

TEST_F(CpuEngineTest, ConcurrentCallsGiveTheSameBits) {
  const std::vector<Case> cases = CasesOfLayer(sdpa_, sdpa_, demo_, 6);
  std::vector<size_t> all(cases.size());
  for (size_t i = 0; i < all.size(); ++i) all[i] = i;
  const std::vector<Tensor> expected = RunAndCollect(*cpu_, cases, all);
  std::vector<std::vector<Tensor>> results(3);
  std::vector<std::thread> threads;
  for (size_t t = 0; t < results.size(); ++t) {
    threads.emplace_back([&, t] {
      for (int rep = 0; rep < 3; ++rep) results[t] = RunAndCollect(*cpu_, cases, all);
    });
  }
  for (std::thread& th : threads) th.join();
  for (const std::vector<Tensor>& r : results) {
    ASSERT_EQ(r.size(), expected.size());
    for (size_t i = 0; i < r.size(); ++i) EXPECT_TRUE(BitwiseEqual(r[i], expected[i])) << i;
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

}  // namespace
}  // namespace attnserve
