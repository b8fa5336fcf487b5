// The fused CPU attention kernel (engine/cpu/flash_attention.h), every
// variant forced in turn, against a float64 reference over seeded random
// ragged batches: causal with Lq != Lk, GQA, bool and additive masks with
// broadcast, key_lengths, fully masked rows, decode shapes, Dv != Dk, every
// dtype, weights; plus determinism, batch, thread-count and layout invariance.
//
// Error metric, per tensor (the project's, as in cpu_engine_test):
// max_i |got_i - ref_i| / max(max_i |ref_i|, 1e-30); no NaN; and where the
// reference is exactly zero (masked keys, fully masked rows) the kernel
// writes exactly zero. Tolerances:
//   fp32 variants (scalar, avx2, avx512): 1e-5, plus the output rounding
//     (FLOAT16 1e-3, BFLOAT16 8e-3).
//   bf16 variants (bf16, amx): inputs rounded to bf16 first, then compared
//     with the float64 reference of the rounded inputs: 1e-2 (the softmax
//     probabilities are rounded to bf16, 2^-9 relative, before P V), plus
//     the output rounding.
#include "engine/cpu/flash_attention.h"

#include <stdlib.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "engine/cpu/cpu_features.h"
#include "engine/tensor.h"
#include "gtest/gtest.h"
#include "tests/unit/engine/test_rng.h"

namespace attnserve::cpu {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

using testutil::Rng;

std::string DT(DType d) { return std::string(DTypeName(d)); }

enum class MaskShape { kNone, kLqLk, kB1LqLk, k1HLqLk, kBHLqLk, kB11Lk, kLq1 };

struct Shape4 {
  int64_t batch = 1, heads = 1, kv_heads = 1, q_len = 1, kv_len = 1, dk = 16, dv = 16;
};

// One request with its own buffers; `p` points into them.
struct Request {
  Shape4 s;
  bool causal = false;
  bool token_layout = false;  // [B, L, H*D] instead of [B, H, L, D]
  DType dtype = DType::kFloat32, out_dtype = DType::kFloat32, weights_dtype = DType::kFloat32;
  MaskParams::Kind mask_kind = MaskParams::Kind::kNone;
  MaskShape mask_shape = MaskShape::kNone;
  DType mask_dtype = DType::kBool;
  bool need_weights = false, average_weights = false;
  std::string label;

  std::vector<uint8_t> q, k, v, out, weights, mask;
  std::vector<int64_t> key_lengths;
  AttentionParams p;
  // Reference results, computed on first use: [0] from the inputs as
  // stored, [1] from the inputs rounded to bf16.
  bool have_ref[2] = {false, false};
  std::vector<float> ref_out[2], ref_weights[2];

  Request() = default;
  Request(const Request&) = delete;
  Request& operator=(const Request&) = delete;

  int64_t OutElems() const { return s.batch * s.heads * s.q_len * s.dv; }
  int64_t WeightElems() const {
    return s.batch * (average_weights ? 1 : s.heads) * s.q_len * s.kv_len;
  }
};

void FillRandom(Rng& rng, DType dt, int64_t n, float amp, std::vector<uint8_t>* buf) {
  buf->resize(static_cast<size_t>(n) * DTypeSize(dt));
  for (int64_t i = 0; i < n; ++i) StoreFromFloat(dt, buf->data(), i, amp * rng.Normal());
}

// Builds the buffers and params of `r` (its shape and options already set).
void Materialize(Rng& rng, Request& r) {
  const Shape4& s = r.s;
  AttentionParams& p = r.p;
  p = AttentionParams{};
  p.batch = s.batch;
  p.num_heads = s.heads;
  p.num_kv_heads = s.kv_heads;
  p.head_dim = s.dk;
  p.head_dim_v = s.dv;
  p.q_len = s.q_len;
  p.kv_len = s.kv_len;
  p.dtype = r.dtype;
  p.out_dtype = r.out_dtype;
  p.causal = r.causal;
  // Sometimes large logits, so the running max matters.
  const float qamp = rng.Chance(0.3) ? 3.0f : 1.0f;
  FillRandom(rng, r.dtype, s.batch * s.heads * s.q_len * s.dk, qamp, &r.q);
  FillRandom(rng, r.dtype, s.batch * s.kv_heads * s.kv_len * s.dk, 1.0f, &r.k);
  FillRandom(rng, r.dtype, s.batch * s.kv_heads * s.kv_len * s.dv, 1.0f, &r.v);
  r.out.assign(static_cast<size_t>(r.OutElems()) * DTypeSize(r.out_dtype), 0xFF);  // NaN-ish fill
  auto strides = [&](int64_t heads, int64_t len, int64_t dim, int64_t* sb, int64_t* sh,
                     int64_t* sr) {
    if (r.token_layout) TokenLayoutStrides(heads, len, dim, sb, sh, sr);
    else HeadLayoutStrides(heads, len, dim, sb, sh, sr);
  };
  strides(s.heads, s.q_len, s.dk, &p.q_stride_b, &p.q_stride_h, &p.q_stride_row);
  strides(s.kv_heads, s.kv_len, s.dk, &p.k_stride_b, &p.k_stride_h, &p.k_stride_row);
  strides(s.kv_heads, s.kv_len, s.dv, &p.v_stride_b, &p.v_stride_h, &p.v_stride_row);
  strides(s.heads, s.q_len, s.dv, &p.o_stride_b, &p.o_stride_h, &p.o_stride_row);
  p.q = r.q.data();
  p.k = r.k.data();
  p.v = r.v.data();
  p.out = r.out.data();
  p.scale = rng.Chance(0.5) ? 1.0f / std::sqrt(static_cast<float>(s.dk)) : rng.Uniform(0.05f, 0.5f);

  if (!r.key_lengths.empty()) p.key_lengths = r.key_lengths.data();

  if (r.mask_kind != MaskParams::Kind::kNone) {
    int64_t mb = 1, mh = 1, mq = s.q_len;
    switch (r.mask_shape) {
      case MaskShape::kLqLk: mb = 1; mh = 1; break;
      case MaskShape::kB1LqLk: mb = s.batch; mh = 1; break;
      case MaskShape::k1HLqLk: mb = 1; mh = s.heads; break;
      case MaskShape::kBHLqLk: mb = s.batch; mh = s.heads; break;
      case MaskShape::kB11Lk: mb = s.batch; mh = 1; mq = 1; break;
      case MaskShape::kLq1: break;  // [Lq, 1]: one value per query row
      case MaskShape::kNone: break;
    }
    const int64_t mk = r.mask_shape == MaskShape::kLq1 ? 1 : s.kv_len;
    const int64_t n = mb * mh * mq * mk;
    p.mask.kind = r.mask_kind;
    p.mask.dtype = r.mask_kind == MaskParams::Kind::kBool ? DType::kBool : r.mask_dtype;
    p.mask.stride_k = mk == 1 ? 0 : 1;
    p.mask.stride_q = mq == 1 ? 0 : mk;
    p.mask.stride_h = mh == 1 ? 0 : mq * mk;
    p.mask.stride_b = mb == 1 ? 0 : mh * mq * mk;
    r.mask.resize(static_cast<size_t>(n) * DTypeSize(p.mask.dtype));
    // Some mask rows block everything: fully masked query rows.
    for (int64_t row = 0; row < n / mk; ++row) {
      const bool all_blocked = rng.Chance(0.08);
      for (int64_t j = 0; j < mk; ++j) {
        const int64_t e = row * mk + j;
        if (r.mask_kind == MaskParams::Kind::kBool) {
          r.mask[static_cast<size_t>(e)] = !all_blocked && rng.Chance(0.75) ? 1 : 0;
        } else {
          const float x = all_blocked || rng.Chance(0.1) ? -kInf : rng.Normal();
          StoreFromFloat(p.mask.dtype, r.mask.data(), e, x);
        }
      }
    }
    p.mask.data = r.mask.data();
  }
  if (r.need_weights) {
    r.weights.assign(static_cast<size_t>(r.WeightElems()) * DTypeSize(r.weights_dtype), 0xFF);
    p.weights = r.weights.data();
    p.weights_dtype = r.weights_dtype;
    p.average_weights = r.average_weights;
  }
  r.label = absl::StrCat(
      "B", s.batch, " H", s.heads, "/", s.kv_heads, " Lq", s.q_len, " Lk", s.kv_len, " D", s.dk,
      "/", s.dv, r.causal ? " causal" : "", r.key_lengths.empty() ? "" : " key_lengths",
      r.token_layout ? " token-layout" : "", " in ", DT(r.dtype), " out ", DT(r.out_dtype),
      r.mask_kind == MaskParams::Kind::kNone
          ? ""
          : absl::StrCat(r.mask_kind == MaskParams::Kind::kBool ? " bool" : " additive ",
                         r.mask_kind == MaskParams::Kind::kBool ? "" : DT(r.mask_dtype),
                         " mask shape#", static_cast<int>(r.mask_shape)),
      r.need_weights ? (r.average_weights ? " weights(avg " : " weights(") : "",
      r.need_weights ? DT(r.weights_dtype) + ")" : "");
}

// softmax(Q K^T * scale + mask) V in float64 over the stored inputs, rounded
// to bf16 first when `bf16_inputs`.
void Reference(const Request& r, bool bf16_inputs, std::vector<float>* out,
               std::vector<float>* weights) {
  const AttentionParams& p = r.p;
  const Shape4& s = r.s;
  auto in = [&](const void* base, int64_t idx) {
    const float x = LoadAsFloat(p.dtype, base, idx);
    return static_cast<double>(bf16_inputs ? BFloat16ToFloat(FloatToBFloat16(x)) : x);
  };
  // Inputs as double in head layout, read once.
  auto gather = [&](const void* base, int64_t heads, int64_t len, int64_t dim, int64_t sb,
                    int64_t sh, int64_t sr) {
    std::vector<double> x(static_cast<size_t>(s.batch * heads * len * dim));
    size_t e = 0;
    for (int64_t b = 0; b < s.batch; ++b)
      for (int64_t h = 0; h < heads; ++h)
        for (int64_t i = 0; i < len; ++i)
          for (int64_t d = 0; d < dim; ++d) x[e++] = in(base, b * sb + h * sh + i * sr + d);
    return x;
  };
  const std::vector<double> q =
      gather(p.q, s.heads, s.q_len, s.dk, p.q_stride_b, p.q_stride_h, p.q_stride_row);
  const std::vector<double> k =
      gather(p.k, s.kv_heads, s.kv_len, s.dk, p.k_stride_b, p.k_stride_h, p.k_stride_row);
  const std::vector<double> v =
      gather(p.v, s.kv_heads, s.kv_len, s.dv, p.v_stride_b, p.v_stride_h, p.v_stride_row);
  const int64_t g = s.heads / s.kv_heads;
  out->assign(static_cast<size_t>(r.OutElems()), 0.0f);
  std::vector<double> wsum;
  if (r.need_weights) wsum.assign(static_cast<size_t>(r.WeightElems()), 0.0);
  std::vector<double> sc(static_cast<size_t>(s.kv_len)), acc(static_cast<size_t>(s.dv));
  std::vector<char> vis(static_cast<size_t>(s.kv_len));
  for (int64_t b = 0; b < s.batch; ++b)
    for (int64_t h = 0; h < s.heads; ++h)
      for (int64_t i = 0; i < s.q_len; ++i) {
        const int64_t hk = h / g;
        const double* qrow = &q[static_cast<size_t>(((b * s.heads + h) * s.q_len + i) * s.dk)];
        int64_t end = s.kv_len;
        if (p.key_lengths) end = std::min(end, p.key_lengths[b]);
        if (p.causal) end = std::min(end, i + s.kv_len - s.q_len + 1);
        double mx = -INFINITY;
        for (int64_t j = 0; j < s.kv_len; ++j) {
          char& visible = vis[static_cast<size_t>(j)];
          visible = j < end;
          if (!visible) continue;
          const double* krow = &k[static_cast<size_t>(((b * s.kv_heads + hk) * s.kv_len + j) * s.dk)];
          double dot = 0;
          for (int64_t d = 0; d < s.dk; ++d) dot += qrow[d] * krow[d];
          double x = dot * p.scale;
          const int64_t mo = b * p.mask.stride_b + h * p.mask.stride_h + i * p.mask.stride_q +
                             j * p.mask.stride_k;
          if (p.mask.kind == MaskParams::Kind::kBool) {
            if (static_cast<const uint8_t*>(p.mask.data)[mo] == 0) visible = 0;
          } else if (p.mask.kind == MaskParams::Kind::kAdditive) {
            x += LoadAsFloat(p.mask.dtype, p.mask.data, mo);
            if (std::isinf(x)) visible = 0;
          }
          sc[static_cast<size_t>(j)] = x;
          if (visible) mx = std::max(mx, x);
        }
        if (mx == -INFINITY) continue;  // fully masked: zeros
        double sum = 0;
        for (int64_t j = 0; j < s.kv_len; ++j) {
          double& e = sc[static_cast<size_t>(j)];
          e = vis[static_cast<size_t>(j)] ? std::exp(e - mx) : 0.0;
          sum += e;
        }
        std::fill(acc.begin(), acc.end(), 0.0);
        for (int64_t j = 0; j < s.kv_len; ++j) {
          const double w = sc[static_cast<size_t>(j)] / sum;
          if (r.need_weights) {
            const int64_t wi = r.average_weights ? (b * s.q_len + i) * s.kv_len + j
                                                 : ((b * s.heads + h) * s.q_len + i) * s.kv_len + j;
            wsum[static_cast<size_t>(wi)] += w;
          }
          if (w == 0) continue;
          const double* vrow = &v[static_cast<size_t>(((b * s.kv_heads + hk) * s.kv_len + j) * s.dv)];
          for (int64_t d = 0; d < s.dv; ++d) acc[static_cast<size_t>(d)] += w * vrow[d];
        }
        for (int64_t d = 0; d < s.dv; ++d)
          (*out)[static_cast<size_t>(((b * s.heads + h) * s.q_len + i) * s.dv + d)] =
              static_cast<float>(acc[static_cast<size_t>(d)]);
      }
  if (r.need_weights) {
    weights->resize(wsum.size());
    const double div = r.average_weights ? static_cast<double>(s.heads) : 1.0;
    for (size_t e = 0; e < wsum.size(); ++e) (*weights)[e] = static_cast<float>(wsum[e] / div);
  }
}

// The kernel's output as [B, H, Lq, Dv] floats (whatever its layout).
std::vector<float> GotOutput(const Request& r) {
  const AttentionParams& p = r.p;
  std::vector<float> got(static_cast<size_t>(r.OutElems()));
  for (int64_t b = 0; b < r.s.batch; ++b)
    for (int64_t h = 0; h < r.s.heads; ++h)
      for (int64_t i = 0; i < r.s.q_len; ++i)
        for (int64_t d = 0; d < r.s.dv; ++d)
          got[static_cast<size_t>(((b * r.s.heads + h) * r.s.q_len + i) * r.s.dv + d)] = LoadAsFloat(
              p.out_dtype, p.out, b * p.o_stride_b + h * p.o_stride_h + i * p.o_stride_row + d);
  return got;
}

std::vector<float> GotWeights(const Request& r) {
  std::vector<float> got(static_cast<size_t>(r.WeightElems()));
  for (size_t e = 0; e < got.size(); ++e)
    got[e] = LoadAsFloat(r.weights_dtype, r.weights.data(), static_cast<int64_t>(e));
  return got;
}

double RoundingTolerance(DType d) {
  switch (d) {
    case DType::kFloat16: return 1e-3;
    case DType::kBFloat16: return 8e-3;
    default: return 0.0;
  }
}

// The metric in the file comment; "" when within `tol`.
std::string Compare(const char* what, const std::vector<float>& got, const std::vector<float>& ref,
                    double tol) {
  double max_ref = 0.0, max_diff = 0.0;
  size_t worst = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (std::isnan(got[i])) return absl::StrCat(what, ": NaN at ", i);
    if (ref[i] == 0.0f && got[i] != 0.0f)
      return absl::StrCat(what, ": element ", i, " is ", got[i], " where the reference is exactly 0");
    max_ref = std::max(max_ref, std::fabs(static_cast<double>(ref[i])));
    const double diff = std::fabs(static_cast<double>(got[i]) - ref[i]);
    if (diff > max_diff) {
      max_diff = diff;
      worst = i;
    }
  }
  const double rel = max_diff / std::max(max_ref, 1e-30);
  if (rel > tol) {
    return absl::StrCat(what, ": relative error ", rel, " > ", tol, " (worst element ", worst,
                        ": got ", got[worst], ", want ", ref[worst], ")");
  }
  return "";
}

// A random request. `decode`: Lq 1..4 and long keys.
std::unique_ptr<Request> RandomRequest(Rng& rng, bool decode) {
  auto r = std::make_unique<Request>();
  Shape4& s = r->s;
  static const std::vector<std::pair<int64_t, int64_t>> kHeads = {
      {1, 1}, {2, 2}, {4, 1}, {4, 2}, {6, 3}, {8, 2}, {3, 3}};
  const auto [hq, hkv] = rng.Pick(kHeads);
  s.heads = hq;
  s.kv_heads = hkv;
  s.batch = rng.Int(1, 3);
  static const std::vector<int64_t> kDims = {8, 16, 24, 32, 40, 64, 80, 96, 128};
  s.dk = rng.Pick(kDims);
  s.dv = rng.Chance(0.7) ? s.dk : rng.Pick(kDims);
  if (decode) {
    s.q_len = rng.Int(1, 4);
    s.kv_len = rng.Pick(std::vector<int64_t>{513, 1000, 1536, 2048, 4096});
    s.batch = rng.Int(1, 2);
  } else {
    s.q_len = rng.Chance(0.3) ? rng.Int(1, 8) : rng.Int(9, 150);
    s.kv_len = rng.Chance(0.3) ? rng.Int(1, 16) : rng.Int(17, 400);
    if (rng.Chance(0.3)) s.kv_len = s.q_len;
  }
  r->causal = rng.Chance(0.4);
  r->token_layout = rng.Chance(0.3);
  static const std::vector<DType> kFloat = {DType::kFloat32, DType::kFloat32, DType::kFloat16,
                                            DType::kBFloat16};
  r->dtype = rng.Pick(kFloat);
  r->out_dtype = rng.Chance(0.7) ? DType::kFloat32 : rng.Pick(kFloat);
  if (rng.Chance(0.3)) {
    r->key_lengths.resize(static_cast<size_t>(s.batch));
    for (auto& l : r->key_lengths) l = rng.Chance(0.15) ? 0 : rng.Int(1, s.kv_len);
  }
  const int mk = static_cast<int>(rng.Int(0, 2));
  if (mk > 0) {
    r->mask_kind = mk == 1 ? MaskParams::Kind::kBool : MaskParams::Kind::kAdditive;
    r->mask_shape = static_cast<MaskShape>(rng.Int(1, 6));
    r->mask_dtype = rng.Pick(kFloat);
  }
  if (!decode && rng.Chance(0.2)) {
    r->need_weights = true;
    r->average_weights = rng.Chance(0.5);
    r->weights_dtype = rng.Chance(0.7) ? DType::kFloat32 : rng.Pick(kFloat);
  }
  Materialize(rng, *r);
  return r;
}

// Runs `reqs` as ragged batches of 1..4 and checks each against the
// reference. Returns the number of requests checked.
int CheckAgainstReference(CpuIsa isa, std::vector<std::unique_ptr<Request>>& reqs, Rng& rng) {
  FlashOptions opt;
  opt.isa = isa;
  const bool bf16 = IsBf16Isa(isa);
  const double compute_tol = bf16 ? 1e-2 : 1e-5;
  size_t next = 0;
  while (next < reqs.size()) {
    const size_t n = std::min(reqs.size() - next, static_cast<size_t>(rng.Int(1, 4)));
    std::vector<AttentionParams> batch;
    for (size_t k = 0; k < n; ++k) batch.push_back(reqs[next + k]->p);
    opt.num_threads = static_cast<int>(rng.Int(0, 3));
    const absl::Status status = FlashAttention(batch, opt);
    EXPECT_TRUE(status.ok()) << status;
    for (size_t k = 0; k < n; ++k) {
      Request& r = *reqs[next + k];
      const int which = bf16 && r.dtype != DType::kBFloat16 ? 1 : 0;
      if (!r.have_ref[which]) {
        Reference(r, which == 1, &r.ref_out[which], &r.ref_weights[which]);
        r.have_ref[which] = true;
      }
      const std::vector<float>& ref_out = r.ref_out[which];
      const std::vector<float>& ref_w = r.ref_weights[which];
      const std::string e1 =
          Compare("output", GotOutput(r), ref_out, compute_tol + RoundingTolerance(r.out_dtype));
      EXPECT_EQ(e1, "") << CpuIsaName(isa) << ": " << r.label;
      if (r.need_weights) {
        const std::string e2 = Compare("weights", GotWeights(r), ref_w,
                                       compute_tol + RoundingTolerance(r.weights_dtype));
        EXPECT_EQ(e2, "") << CpuIsaName(isa) << ": " << r.label;
      }
    }
    next += n;
  }
  return static_cast<int>(reqs.size());
}

// Random requests shared by every variant's test (so each reference is
// computed once per process).
std::vector<std::unique_ptr<Request>>& SharedCases(uint32_t seed, bool decode, int count) {
  static std::vector<std::unique_ptr<Request>> sets[2];
  std::vector<std::unique_ptr<Request>>& reqs = sets[decode ? 1 : 0];
  if (reqs.empty()) {
    Rng rng(seed);
    for (int c = 0; c < count; ++c) reqs.push_back(RandomRequest(rng, decode));
  }
  return reqs;
}

class FlashIsaTest : public ::testing::TestWithParam<CpuIsa> {
 protected:
  void SetUp() override {
    if (!CpuSupports(GetParam())) GTEST_SKIP() << CpuIsaName(GetParam()) << " not supported here";
  }
};

TEST_P(FlashIsaTest, RandomRaggedBatchesMatchReference) {
  Rng rng(1234);
  std::vector<std::unique_ptr<Request>>& reqs = SharedCases(1234, false, 160);
  EXPECT_EQ(CheckAgainstReference(GetParam(), reqs, rng), 160);
}

TEST_P(FlashIsaTest, DecodeShapesMatchReference) {
  Rng rng(99);
  std::vector<std::unique_ptr<Request>>& reqs = SharedCases(99, true, 24);
  EXPECT_EQ(CheckAgainstReference(GetParam(), reqs, rng), 24);
}

// Each shape in each dtype, the options varied over the requests made
// (request c, counted from `phase`: causal every second, token layout every
// third, random key lengths every fourth).
std::vector<std::unique_ptr<Request>> EachShapeInEachDType(Rng& rng, const std::vector<Shape4>& shapes,
                                                           const std::vector<DType>& dtypes, int phase) {
  std::vector<std::unique_ptr<Request>> reqs;
  int c = phase;
  for (const Shape4& s : shapes) {
    for (DType dt : dtypes) {
      auto r = std::make_unique<Request>();
      r->s = s;
      r->dtype = dt;
      r->causal = c % 2 == 0;
      r->token_layout = c % 3 == 0;
      if (c % 4 == 1) {
        r->key_lengths.resize(static_cast<size_t>(s.batch));
        for (auto& l : r->key_lengths) l = rng.Int(1, s.kv_len);
      }
      Materialize(rng, *r);
      reqs.push_back(std::move(r));
      ++c;
    }
  }
  return reqs;
}

// Decode requests with many (sequence, kv head) pairs, which are computed
// as whole rows over several key blocks instead of key chunks
// (flash::kSplitMaxPairs), and the same shapes just under the limit (split).
TEST_P(FlashIsaTest, ManyPairDecodeMatchesReference) {
  Rng rng(31);
  const std::vector<Shape4> shapes = {{16, 4, 4, 1, 700, 64, 64},   // 64 pairs: whole rows
                                      {8, 16, 8, 2, 800, 32, 48},   // 64 pairs, GQA, Dv != Dk
                                      {21, 3, 3, 1, 600, 64, 64},   // 63 pairs: split
                                      {32, 2, 2, 3, 1100, 16, 16}};
  std::vector<std::unique_ptr<Request>> reqs =
      EachShapeInEachDType(rng, shapes, {DType::kFloat32, DType::kBFloat16}, 0);
  EXPECT_EQ(CheckAgainstReference(GetParam(), reqs, rng), 8);
}

// Grouped-query decode with 5 to 8 query rows per kv head (group x query
// positions): up to flash::kDirectMaxRows (7) they take the direct path (K
// and V read in place; bf16 inputs the AVX-512 fp32 kernel), 8 the packed
// one. Lk 1100 crosses the key-chunk split; Dv != Dk once.
TEST_P(FlashIsaTest, GroupedDecodeAtTheDirectLimitMatchesReference) {
  Rng rng(57);
  const std::vector<Shape4> shapes = {{2, 40, 8, 1, 700, 128, 128},  // group 5 (Qwen2.5-14B)
                                      {1, 6, 1, 1, 1100, 64, 64},    // group 6
                                      {2, 28, 4, 1, 513, 128, 128},  // group 7 (Qwen2.5-7B)
                                      {1, 8, 1, 1, 300, 64, 32},     // group 8: packed
                                      {3, 2, 2, 6, 900, 64, 64},     // MHA, 6 new positions
                                      {1, 14, 2, 1, 1100, 64, 64}};  // group 7, split
  std::vector<std::unique_ptr<Request>> reqs =
      EachShapeInEachDType(rng, shapes, {DType::kFloat32, DType::kFloat16, DType::kBFloat16}, 1);
  EXPECT_EQ(CheckAgainstReference(GetParam(), reqs, rng), 18);
}

// Hand-picked shapes at the edges of the kernel's blocking.
TEST_P(FlashIsaTest, BlockEdgesMatchReference) {
  Rng rng(7);
  std::vector<std::unique_ptr<Request>> reqs;
  const std::vector<Shape4> shapes = {
      {1, 1, 1, 1, 1, 1, 1},          // smallest
      {1, 2, 1, 64, 256, 64, 64},     // exactly one row block and one key block
      {1, 1, 1, 65, 257, 64, 64},     // one past each
      {1, 1, 1, 100, 700, 64, 48},    // causal Lq < Lk, several key blocks
      {1, 4, 1, 16, 512, 32, 32},     // GQA group fills one row block, no split
      {1, 8, 1, 1, 513, 64, 64},      // just past the split threshold
      {2, 2, 2, 3, 2050, 17, 33},     // odd dims, split, ragged chunk
      {1, 1, 1, 300, 40, 16, 16},     // Lq > Lk, causal rows before the diagonal see nothing
      {1, 2, 1, 20, 300, 256, 512},   // wide heads
      {1, 1, 1, 2, 700, 200, 40},     // decode with dims off the vector width
      {1, 3, 1, 70, 90, 17, 9},       // odd everything
      {1, 2, 1, 200, 8, 64, 64},      // few keys: one 16-key vector (fp32 kernels)
      {2, 8, 8, 16, 16, 64, 64},      // demo-mha's 16-token requests
      {1, 1, 1, 9, 49, 64, 64},       // 64-key tile, then one vector of keys
  };
  for (const Shape4& s : shapes) {
    for (bool causal : {false, true}) {
      auto r = std::make_unique<Request>();
      r->s = s;
      r->causal = causal;
      Materialize(rng, *r);
      reqs.push_back(std::move(r));
    }
  }
  CheckAgainstReference(GetParam(), reqs, rng);
}

TEST_P(FlashIsaTest, FullyMaskedRowsAreZero) {
  Rng rng(5);
  std::vector<std::unique_ptr<Request>> reqs;
  for (int kind = 0; kind < 3; ++kind) {
    auto r = std::make_unique<Request>();
    r->s = Shape4{2, 2, 1, 5, 700, 32, 32};
    r->need_weights = kind == 2;
    if (kind == 0) r->key_lengths = {0, 700};  // batch 0: no key at all
    if (kind >= 1) {
      r->mask_kind = kind == 1 ? MaskParams::Kind::kBool : MaskParams::Kind::kAdditive;
      r->mask_shape = MaskShape::kBHLqLk;
      r->mask_dtype = DType::kFloat32;
    }
    Materialize(rng, *r);
    if (kind >= 1) {  // block every key of query row 0 of every (b, h)
      for (int64_t bh = 0; bh < 4; ++bh)
        for (int64_t j = 0; j < 700; ++j) {
          const int64_t e = bh * 5 * 700 + j;
          if (kind == 1) r->mask[static_cast<size_t>(e)] = 0;
          else StoreFromFloat(r->mask_dtype, r->mask.data(), e, -kInf);
        }
    }
    reqs.push_back(std::move(r));
  }
  CheckAgainstReference(GetParam(), reqs, rng);
  // Explicitly: row 0 (and batch 0 of the key_lengths case) is all zeros.
  for (int kind = 0; kind < 3; ++kind) {
    const std::vector<float> out = GotOutput(*reqs[static_cast<size_t>(kind)]);
    for (int64_t d = 0; d < 32; ++d) EXPECT_EQ(out[static_cast<size_t>(d)], 0.0f) << kind;
  }
}

// Same inputs twice, alone and inside ragged batches, with 1..3 threads:
// bitwise the same output (and weights).
TEST_P(FlashIsaTest, DeterministicBatchAndThreadInvariant) {
  Rng rng(42);
  std::vector<std::unique_ptr<Request>> reqs;
  for (int c = 0; c < 6; ++c) reqs.push_back(RandomRequest(rng, false));
  for (int c = 0; c < 3; ++c) reqs.push_back(RandomRequest(rng, true));
  {
    auto r = std::make_unique<Request>();  // a causal request with a weights pass
    r->s = Shape4{1, 4, 2, 70, 300, 64, 64};
    r->causal = true;
    r->need_weights = true;
    r->average_weights = true;
    Materialize(rng, *r);
    reqs.push_back(std::move(r));
  }
  FlashOptions opt;
  opt.isa = GetParam();
  // Alone, single thread: the baseline.
  std::vector<std::vector<uint8_t>> base_out, base_w;
  for (auto& r : reqs) {
    opt.num_threads = 1;
    ASSERT_TRUE(FlashAttention({r->p}, opt).ok());
    base_out.push_back(r->out);
    base_w.push_back(r->weights);
  }
  for (int threads : {1, 2, 3}) {
    opt.num_threads = threads;
    // Alone again.
    for (size_t k = 0; k < reqs.size(); ++k) {
      std::fill(reqs[k]->out.begin(), reqs[k]->out.end(), 0xAB);
      ASSERT_TRUE(FlashAttention({reqs[k]->p}, opt).ok());
      EXPECT_EQ(reqs[k]->out, base_out[k]) << "alone, " << threads << " threads: " << reqs[k]->label;
      EXPECT_EQ(reqs[k]->weights, base_w[k]) << reqs[k]->label;
    }
    // All together, in a rotated order, as one ragged batch.
    std::vector<AttentionParams> batch;
    for (size_t k = 0; k < reqs.size(); ++k) {
      const size_t idx = (k + static_cast<size_t>(threads)) % reqs.size();
      std::fill(reqs[idx]->out.begin(), reqs[idx]->out.end(), 0xCD);
      batch.push_back(reqs[idx]->p);
    }
    ASSERT_TRUE(FlashAttention(batch, opt).ok());
    for (size_t k = 0; k < reqs.size(); ++k) {
      EXPECT_EQ(reqs[k]->out, base_out[k]) << "batched, " << threads << " threads: " << reqs[k]->label;
      EXPECT_EQ(reqs[k]->weights, base_w[k]) << reqs[k]->label;
    }
  }
}

// A row's result does not depend on the rows whose softmax is computed
// beside it. Rows that see every key of a block go through the kernel's
// several-row softmax; the others (here: causal rows) one row at a time.
// Row i of a bottom-right causal request over Lk = n + 7 keys sees exactly
// the first n + i keys, and its group of rows is never all fully visible;
// the same query row against those keys alone, in a non-causal request of
// eight copies of it (every group fully visible), must give the same bits.
TEST_P(FlashIsaTest, ARowGivesTheSameBitsWhicheverRowsShareItsSoftmax) {
  Rng rng(11);
  constexpr int64_t kHeads = 2, kRows = 8, kDim = 64;
  for (DType dt : {DType::kFloat32, DType::kBFloat16}) {
    for (int64_t n : {9, 16, 37, 64, 250}) {
      Request causal;
      causal.s = Shape4{1, kHeads, kHeads, kRows, n + kRows - 1, kDim, kDim};
      causal.causal = true;
      causal.dtype = causal.out_dtype = dt;
      Materialize(rng, causal);
      FlashOptions opt;
      opt.isa = GetParam();
      opt.num_threads = 1;
      ASSERT_TRUE(FlashAttention({causal.p}, opt).ok()) << causal.label;
      const size_t es = DTypeSize(dt);
      const size_t row_bytes = static_cast<size_t>(kDim) * es;
      for (int64_t i = 0; i < kRows; ++i) {
        const int64_t keys = n + i;
        Request alone;
        alone.s = Shape4{1, kHeads, kHeads, kRows, keys, kDim, kDim};
        alone.dtype = alone.out_dtype = dt;
        Materialize(rng, alone);
        alone.p.scale = causal.p.scale;
        for (int64_t h = 0; h < kHeads; ++h) {  // head layout [B, H, L, D]
          const uint8_t* q_row = causal.q.data() + (h * kRows + i) * row_bytes;
          for (int64_t r = 0; r < kRows; ++r)
            std::memcpy(alone.q.data() + (h * kRows + r) * row_bytes, q_row, row_bytes);
          std::memcpy(alone.k.data() + h * keys * row_bytes,
                      causal.k.data() + h * (n + kRows - 1) * row_bytes, keys * row_bytes);
          std::memcpy(alone.v.data() + h * keys * row_bytes,
                      causal.v.data() + h * (n + kRows - 1) * row_bytes, keys * row_bytes);
        }
        ASSERT_TRUE(FlashAttention({alone.p}, opt).ok()) << alone.label;
        for (int64_t h = 0; h < kHeads; ++h)
          for (int64_t r = 0; r < kRows; ++r)
            EXPECT_EQ(0, std::memcmp(alone.out.data() + (h * kRows + r) * row_bytes,
                                     causal.out.data() + (h * kRows + i) * row_bytes, row_bytes))
                << causal.label << ": head " << h << ", causal row " << i << " against copy " << r;
      }
    }
  }
}

// The same values in head layout [B, H, L, D] (Q and V read in place by the
// fp32 variants) and in token layout [B, L, H * D] (rows H * D apart: packed
// first): bitwise the same output. Shapes span one and several key blocks,
// GQA and Dv != Dk.
TEST_P(FlashIsaTest, LayoutDoesNotChangeTheResult) {
  Rng rng(7);
  const Shape4 shapes[] = {{2, 4, 4, 70, 70, 64, 64},
                           {1, 8, 2, 300, 520, 64, 64},
                           {1, 2, 2, 33, 260, 32, 48},
                           {3, 4, 4, 1, 600, 64, 64}};
  for (const Shape4& s : shapes) {
    for (bool causal : {false, true}) {
      Request head;
      head.s = s;
      head.causal = causal && s.q_len > 1;
      Materialize(rng, head);
      Request token;
      token.s = s;
      token.causal = head.causal;
      token.token_layout = true;
      Materialize(rng, token);
      token.p.scale = head.p.scale;
      // token[b][i][h][d] = head[b][h][i][d] for q, k, v.
      auto relayout = [&](const std::vector<uint8_t>& src, int64_t heads, int64_t len, int64_t dim,
                          std::vector<uint8_t>* dst) {
        const size_t es = DTypeSize(head.dtype);
        for (int64_t b = 0; b < s.batch; ++b)
          for (int64_t h = 0; h < heads; ++h)
            for (int64_t i = 0; i < len; ++i)
              std::memcpy(dst->data() + (((b * len + i) * heads + h) * dim) * es,
                          src.data() + (((b * heads + h) * len + i) * dim) * es, dim * es);
      };
      relayout(head.q, s.heads, s.q_len, s.dk, &token.q);
      relayout(head.k, s.kv_heads, s.kv_len, s.dk, &token.k);
      relayout(head.v, s.kv_heads, s.kv_len, s.dv, &token.v);
      FlashOptions opt;
      opt.isa = GetParam();
      opt.num_threads = 2;
      ASSERT_TRUE(FlashAttention({head.p}, opt).ok()) << head.label;
      ASSERT_TRUE(FlashAttention({token.p}, opt).ok()) << token.label;
      std::vector<uint8_t> expected(token.out.size());
      relayout(head.out, s.heads, s.q_len, s.dv, &expected);
      EXPECT_EQ(token.out, expected) << head.label << " vs " << token.label;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(AllVariants, FlashIsaTest,
                         ::testing::Values(CpuIsa::kScalar, CpuIsa::kAvx2, CpuIsa::kAvx512,
                                           CpuIsa::kAvx512Bf16, CpuIsa::kAmx),
                         [](const ::testing::TestParamInfo<CpuIsa>& info) {
                           return std::string(CpuIsaName(info.param));
                         });

// The fp32 variants agree with each other far more closely than with
// anything bf16: AVX2 and AVX-512 differ only in summation order.
TEST(FlashAttentionTest, Avx2MatchesAvx512) {
  if (!CpuSupports(CpuIsa::kAvx512)) GTEST_SKIP() << "no AVX-512 on this CPU";
  Rng rng(77);
  for (int c = 0; c < 20; ++c) {
    auto r = RandomRequest(rng, c % 4 == 0);
    FlashOptions opt;
    opt.isa = CpuIsa::kAvx2;
    ASSERT_TRUE(FlashAttention({r->p}, opt).ok());
    const std::vector<float> a = GotOutput(*r);
    opt.isa = CpuIsa::kAvx512;
    ASSERT_TRUE(FlashAttention({r->p}, opt).ok());
    const std::vector<float> b = GotOutput(*r);
    EXPECT_EQ(Compare("avx2 vs avx512", a, b, 2e-5 + RoundingTolerance(r->out_dtype)), "") << r->label;
  }
}

TEST(FlashAttentionTest, EnvironmentForcesVariant) {
  FlashOptions opt;
  ASSERT_EQ(setenv(kCpuIsaEnv, "scalar", 1), 0);
  absl::StatusOr<CpuIsa> isa = ResolveFlashIsa(DType::kFloat32, opt);
  ASSERT_TRUE(isa.ok());
  EXPECT_EQ(*isa, CpuIsa::kScalar);
  ASSERT_EQ(setenv(kCpuIsaEnv, "sse9", 1), 0);
  EXPECT_EQ(ResolveFlashIsa(DType::kFloat32, opt).status().code(),
            absl::StatusCode::kFailedPrecondition);
  opt.isa = CpuIsa::kScalar;  // the argument wins over the environment
  EXPECT_TRUE(ResolveFlashIsa(DType::kFloat32, opt).ok());
  ASSERT_EQ(unsetenv(kCpuIsaEnv), 0);
  opt.isa.reset();
  EXPECT_EQ(*ResolveFlashIsa(DType::kFloat32, opt), BestFp32Isa());
  if (std::optional<CpuIsa> bf = BestBf16Isa()) {
    EXPECT_EQ(*ResolveFlashIsa(DType::kBFloat16, opt), *bf);
    opt.precision = FlashPrecision::kFloat32;
    EXPECT_EQ(*ResolveFlashIsa(DType::kBFloat16, opt), BestFp32Isa());
    opt.precision = FlashPrecision::kBFloat16;
    EXPECT_EQ(*ResolveFlashIsa(DType::kFloat32, opt), *bf);
    // Decode-shaped requests stay on the fp32 kernel unless forced.
    AttentionParams p;
    p.dtype = DType::kBFloat16;
    p.num_heads = 8;
    p.num_kv_heads = 2;
    p.q_len = 1;
    if (CpuSupports(CpuIsa::kAvx512)) {
      EXPECT_EQ(*FlashIsaFor(p, opt), CpuIsa::kAvx512);
    }
    p.q_len = 2;  // 8 rows per kv head
    EXPECT_EQ(*FlashIsaFor(p, opt), *bf);
    opt.isa = *bf;
    p.q_len = 1;
    EXPECT_EQ(*FlashIsaFor(p, opt), *bf);
  } else {
    // No bf16 products on this CPU: bf16 requests and bf16 precision run the
    // best fp32 variant, and forcing a bf16 one is refused.
    EXPECT_EQ(*ResolveFlashIsa(DType::kBFloat16, opt), BestFp32Isa());
    opt.precision = FlashPrecision::kBFloat16;
    EXPECT_EQ(*ResolveFlashIsa(DType::kFloat32, opt), BestFp32Isa());
    for (CpuIsa isa : {CpuIsa::kAvx512Bf16, CpuIsa::kAmx}) {
      opt.isa = isa;
      EXPECT_EQ(ResolveFlashIsa(DType::kBFloat16, opt).status().code(),
                absl::StatusCode::kFailedPrecondition);
    }
  }
}

TEST(FlashAttentionTest, RejectsBadParams) {
  Rng rng(3);
  Request r;
  r.s = Shape4{1, 4, 3, 2, 2, 8, 8};  // 4 % 3 != 0
  Materialize(rng, r);
  absl::Status s = FlashAttention({r.p});
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("num_kv_heads"), std::string::npos) << s.message();
  r.s = Shape4{1, 2, 2, 2, 2, 8, 8};
  Materialize(rng, r);
  r.p.k = nullptr;
  EXPECT_EQ(FlashAttention({r.p}).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(FlashAttention({}).ok());
}

}  // namespace
}  // namespace attnserve::cpu
