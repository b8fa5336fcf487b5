// Attention requests for the fused kernels' tests, and their float64 oracle
// written straight from attention_params.h's definition: causal
// (bottom-right), sliding window, key lengths, bool and additive masks
// through broadcast strides, softcapping, sinks, ALiBi, a relative position
// bias table, relative position embeddings, grouped-query heads, the head
// and token layouts. Shared by the GPU test (fused_attention_test.cc) and
// their CPU emulations (flash_attention*_emulated_test.cc).
#ifndef ATTNSERVE_TESTS_UNIT_ENGINE_CUDA_ATTENTION_ORACLE_H_
#define ATTNSERVE_TESTS_UNIT_ENGINE_CUDA_ATTENTION_ORACLE_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "engine/attention_params.h"
#include "engine/dtype.h"
#include "engine/tensor.h"
#include "gtest/gtest.h"

namespace attnserve::oracle {

enum class Mask { kNone, kBoolPerBatch, kAdditivePerHead };
// Which tables of relative position embeddings a case has
// (AttentionParams::relative_key, relative_query).
enum class Embeddings { kBoth, kContentToPosition, kPositionToContent };

struct Case {
  DType dtype = DType::kFloat32;
  DType out_dtype = DType::kFloat32;  // kBool: the inputs' dtype
  int64_t batch = 2, heads = 4, kv_heads = 2, q_len = 1, kv_len = 1, dim = 64;
  bool causal = false;
  bool token_layout = false;  // [B, L, H * D] instead of [B, H, L, D]
  bool lengths = false;       // key lengths: the first sequence a third, the second none
  Mask mask = Mask::kNone;
  float scale = 0.0f;  // 0: 1 / sqrt(dim)
  int64_t window = 0;
  float softcap = 0.0f;
  bool sinks = false;
  bool alibi = false;  // ALiBi slopes (AlibiSlope), one per query head
  // > 0: a relative position bias table of this distance D (random
  // [heads, 2D + 1], MakeInputs).
  int64_t relative_bias_distance = 0;
  // > 0: relative position embeddings of this distance D (random tables
  // [heads, dim, 2D + 1], MakeInputs): `embeddings` says which.
  int64_t relative_embedding_distance = 0;
  Embeddings embeddings = Embeddings::kBoth;

  bool ContentToPosition() const {
    return relative_embedding_distance > 0 && embeddings != Embeddings::kPositionToContent;
  }
  bool PositionToContent() const {
    return relative_embedding_distance > 0 && embeddings != Embeddings::kContentToPosition;
  }
  DType OutDType() const { return out_dtype == DType::kBool ? dtype : out_dtype; }
  std::string Describe() const {
    return std::string(DTypeName(dtype)) + " " +
           testing::PrintToString(
               std::vector<int64_t>{batch, heads, kv_heads, q_len, kv_len, dim}) +
           (causal ? " causal" : "") + (token_layout ? " tokens" : " heads") +
           (lengths ? " lengths" : "") + " mask " + std::to_string(static_cast<int>(mask)) +
           " window " + std::to_string(window) + " softcap " + std::to_string(softcap) +
           (sinks ? " sinks" : "") + (alibi ? " alibi" : "") +
           (relative_bias_distance > 0
                ? " relative_bias " + std::to_string(relative_bias_distance)
                : "") +
           (relative_embedding_distance > 0
                ? " embeddings " + std::to_string(relative_embedding_distance) +
                      (ContentToPosition() ? " c2p" : "") + (PositionToContent() ? " p2c" : "")
                : "") +
           " out " + std::string(DTypeName(OutDType()));
  }
};

// Head h's ALiBi slope among `heads`: BLOOM's 2^(-8 (h + 1) / heads), each
// head's own, the steepest (head 0) enough to make keys far from the query
// negligible and the flattest a small tilt over a few hundred keys.
inline float AlibiSlope(int64_t h, int64_t heads) {
  return std::exp2(-8.0f * static_cast<float>(h + 1) / static_cast<float>(heads));
}

// A case of that shape in `dtype` (output too), head layout, no mask.
inline Case MakeCase(DType dtype, int64_t batch, int64_t heads, int64_t kv_heads, int64_t q_len,
                     int64_t kv_len, int64_t dim, bool causal) {
  Case c;
  c.dtype = c.out_dtype = dtype;
  c.batch = batch;
  c.heads = heads;
  c.kv_heads = kv_heads;
  c.q_len = q_len;
  c.kv_len = kv_len;
  c.dim = dim;
  c.causal = causal;
  return c;
}

// A case's inputs on the host: the tensors in their dtype (what a kernel
// reads) and as floats (the same values), and `params` pointing at them.
struct Inputs {
  Case c;
  std::vector<uint8_t> q_bytes, k_bytes, v_bytes;
  std::vector<float> q, k, v;
  std::vector<int64_t> lengths;
  std::vector<float> sinks;
  std::vector<float> alibi_slopes;
  std::vector<float> relative_bias;
  std::vector<float> relative_key, relative_query;  // empty: none
  std::vector<uint8_t> bool_mask;
  std::vector<float> add_mask;
  std::vector<uint8_t> out;  // OutDType(), filled with NaN bytes
  AttentionParams params;
};

// n random values in [-1, 1] as rounded to `dtype`: `bytes` holds them in
// the dtype, the result as floats (what the kernel reads, exactly).
inline std::vector<float> RandomInput(DType dtype, int64_t n, std::mt19937& rng,
                                      std::vector<uint8_t>* bytes) {
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  std::vector<float> values(n);
  for (float& x : values) x = dist(rng);
  bytes->resize(static_cast<size_t>(n) * DTypeSize(dtype));
  ConvertFromFloat(values.data(), n, dtype, bytes->data());
  ConvertToFloat(dtype, bytes->data(), n, values.data());
  return values;
}

// Random inputs for case c, `params` over host memory (dense layouts).
inline Inputs MakeInputs(const Case& c, std::mt19937& rng) {
  Inputs in;
  in.c = c;
  const int64_t nq = c.batch * c.heads * c.q_len * c.dim;
  const int64_t nk = c.batch * c.kv_heads * c.kv_len * c.dim;
  in.q = RandomInput(c.dtype, nq, rng, &in.q_bytes);
  in.k = RandomInput(c.dtype, nk, rng, &in.k_bytes);
  in.v = RandomInput(c.dtype, nk, rng, &in.v_bytes);
  in.lengths.assign(c.batch, c.kv_len);
  if (c.lengths) {
    in.lengths[0] = c.kv_len / 3;
    if (c.batch > 1) in.lengths[1] = 0;  // a sequence with no keys: zeros
  }
  for (int64_t h = 0; h < c.heads && c.sinks; ++h) in.sinks.push_back(-1.0f + 0.7f * h);
  for (int64_t h = 0; h < c.heads && c.alibi; ++h) {
    in.alibi_slopes.push_back(AlibiSlope(h, c.heads));
  }
  // A table of distinct entries, large enough to move the probabilities and
  // asymmetric, so that a lookup at the wrong distance (the wrong sign of j
  // - position, a missing clamp) shows.
  if (c.relative_bias_distance > 0) {
    std::uniform_real_distribution<float> entry(-2.0f, 2.0f);
    in.relative_bias.resize(c.heads * (2 * c.relative_bias_distance + 1));
    for (float& x : in.relative_bias) x = entry(rng);
  }
  // Embedding tables of distinct entries per distance and feature, large
  // enough that each score's terms move the probabilities.
  for (auto [used, table] : {std::pair{c.ContentToPosition(), &in.relative_key},
                             std::pair{c.PositionToContent(), &in.relative_query}}) {
    if (!used) continue;
    std::uniform_real_distribution<float> entry(-1.0f, 1.0f);
    table->resize(c.heads * c.dim * (2 * c.relative_embedding_distance + 1));
    for (float& x : *table) x = entry(rng);
  }
  AttentionParams& a = in.params;
  // Masks: bool [B, 1, Lq, Lk] (every fifth key of each row blocked, row 1
  // blocked whole), additive [1, H, 1, Lk] (a head-dependent ramp, -inf on
  // key 0 of head 0).
  if (c.mask == Mask::kBoolPerBatch) {
    in.bool_mask.assign(c.batch * c.q_len * c.kv_len, 1);
    for (int64_t b = 0; b < c.batch; ++b)
      for (int64_t i = 0; i < c.q_len; ++i)
        for (int64_t j = 0; j < c.kv_len; ++j)
          if ((i + j + b) % 5 == 0 || i == 1) in.bool_mask[(b * c.q_len + i) * c.kv_len + j] = 0;
    a.mask.kind = MaskParams::Kind::kBool;
    a.mask.dtype = DType::kBool;
    a.mask.data = in.bool_mask.data();
    a.mask.stride_b = c.q_len * c.kv_len;
    a.mask.stride_q = c.kv_len;
    a.mask.stride_k = 1;
  } else if (c.mask == Mask::kAdditivePerHead) {
    in.add_mask.resize(c.heads * c.kv_len);
    for (int64_t h = 0; h < c.heads; ++h)
      for (int64_t j = 0; j < c.kv_len; ++j)
        in.add_mask[h * c.kv_len + j] = -0.01f * static_cast<float>((j * (h + 1)) % 37);
    in.add_mask[0] = -std::numeric_limits<float>::infinity();
    a.mask.kind = MaskParams::Kind::kAdditive;
    a.mask.dtype = DType::kFloat32;
    a.mask.data = in.add_mask.data();
    a.mask.stride_h = c.kv_len;
    a.mask.stride_k = 1;
  }
  a.batch = c.batch;
  a.num_heads = c.heads;
  a.num_kv_heads = c.kv_heads;
  a.head_dim = a.head_dim_v = c.dim;
  a.q_len = c.q_len;
  a.kv_len = c.kv_len;
  a.dtype = c.dtype;
  a.out_dtype = c.OutDType();
  a.causal = c.causal;
  a.window = c.window;
  a.softcap = c.softcap;
  a.scale = c.scale > 0.0f ? c.scale
                           : static_cast<float>(1.0 / std::sqrt(static_cast<double>(c.dim)));
  SetContiguousStrides(&a, c.token_layout ? TokenLayoutStrides : HeadLayoutStrides);
  in.out.assign(static_cast<size_t>(nq) * DTypeSize(a.out_dtype), 0xff);
  a.q = in.q_bytes.data();
  a.k = in.k_bytes.data();
  a.v = in.v_bytes.data();
  a.out = in.out.data();
  if (c.lengths) a.key_lengths = in.lengths.data();
  if (c.sinks) a.sinks = in.sinks.data();
  if (c.alibi) a.alibi_slopes = in.alibi_slopes.data();
  if (c.relative_bias_distance > 0) {
    a.relative_bias = in.relative_bias.data();
    a.relative_bias_distance = c.relative_bias_distance;
  }
  if (c.relative_embedding_distance > 0) {
    if (c.ContentToPosition()) a.relative_key = in.relative_key.data();
    if (c.PositionToContent()) a.relative_query = in.relative_query.data();
    a.relative_embedding_distance = c.relative_embedding_distance;
  }
  return in;
}

// Small cases of every rule, for the CPU emulations of the kernels: masks
// (bool per batch with a fully blocked row, additive per head), key lengths
// (one sequence with none), the token layout, another output dtype, sliding
// windows that skip whole key tiles and cut others (one two-sided, not
// causal), softcapping, sinks, alone and together; head dims 64 and 128,
// grouped and plain heads, the dtypes in turn.
inline std::vector<Case> RuleCases(const std::vector<DType>& dtypes) {
  struct Variant {
    Mask mask;
    bool lengths, token_layout;
    int64_t window;
    float softcap;
    bool sinks;
  };
  const Variant variants[] = {
      {Mask::kBoolPerBatch, false, false, 0, 0.0f, false},
      {Mask::kAdditivePerHead, true, true, 0, 0.0f, false},
      {Mask::kNone, false, false, 70, 0.0f, false},
      {Mask::kNone, true, false, 7, 5.0f, true},
      {Mask::kBoolPerBatch, false, true, 90, 0.0f, true},
      {Mask::kNone, false, false, 0, 5.0f, false},
      // Not causal (n == 6): a two-sided window.
      {Mask::kNone, false, false, 40, 0.0f, false},
  };
  std::vector<Case> cases;
  int n = 0;
  for (const Variant& v : variants) {
    Case c;
    c.dtype = dtypes[n % dtypes.size()];
    // Case 3 writes another dtype than it reads.
    if (n == 3) c.out_dtype = c.dtype == DType::kFloat32 ? DType::kFloat16 : DType::kFloat32;
    else c.out_dtype = c.dtype;
    c.batch = v.lengths ? 2 : 1;
    c.heads = 2;
    c.kv_heads = n % 2 == 0 ? 1 : 2;
    c.dim = n % 2 == 0 ? 64 : 128;
    c.causal = n < 5;
    c.q_len = 48 + 10 * n;
    c.kv_len = 200 + 3 * n;
    c.mask = v.mask;
    c.lengths = v.lengths;
    c.token_layout = v.token_layout;
    c.window = v.window;
    c.softcap = v.softcap;
    c.scale = v.softcap > 0.0f ? 0.5f : 0.0f;  // scores large enough for the cap to bend
    c.sinks = v.sinks;
    cases.push_back(c);
    ++n;
  }
  return cases;
}

// ALiBi cases for the CPU emulations of the kernels: every rule case
// (RuleCases: causal and not, masks, key lengths, the token layout, another
// output dtype, windows, softcapping, sinks, Lq < Lk, where j - position is
// what counts) with slopes, and two more: four query heads over one kv head
// (a group's rows, each its own slope) with a window and sinks, and Lq > Lk
// with a two-sided window (the first rows see no key).
inline std::vector<Case> AlibiCases(const std::vector<DType>& dtypes) {
  std::vector<Case> cases = RuleCases(dtypes);
  Case grouped = MakeCase(dtypes.front(), 1, 4, 1, 60, 230, 64, /*causal=*/true);
  grouped.window = 70;
  grouped.sinks = true;
  Case wide = MakeCase(dtypes.back(), 1, 2, 1, 140, 90, 64, /*causal=*/false);
  wide.window = 30;
  wide.sinks = true;
  cases.push_back(grouped);
  cases.push_back(wide);
  for (Case& c : cases) c.alibi = true;
  return cases;
}

// Relative position bias cases for the CPU emulations of the kernels: every
// rule case with a table of distance 3 or 5 (each in both dtypes of two;
// keys tens away from the query, so both clamps bind: the earlier keys'
// under causal, the later keys' too in the cases that are not), and two
// more: four query heads over one kv head (a group's rows, each its own
// head's table row) with a window, sinks and ALiBi's slopes too (both
// position biases), and Lq > Lk without a window and a distance past every
// query-key distance (no clamp).
inline std::vector<Case> RelativeBiasCases(const std::vector<DType>& dtypes) {
  std::vector<Case> cases = RuleCases(dtypes);
  for (size_t n = 0; n < cases.size(); ++n) cases[n].relative_bias_distance = n % 3 == 1 ? 5 : 3;
  Case grouped = MakeCase(dtypes.front(), 1, 4, 1, 60, 230, 64, /*causal=*/true);
  grouped.window = 70;
  grouped.sinks = true;
  grouped.alibi = true;
  grouped.relative_bias_distance = 5;
  Case wide = MakeCase(dtypes.back(), 1, 2, 1, 140, 90, 64, /*causal=*/false);
  wide.relative_bias_distance = 200;
  cases.push_back(grouped);
  cases.push_back(wide);
  return cases;
}

// Relative position embeddings cases for the CPU emulations of the kernels:
// every rule case with tables of distance 3 or 5 (both clamps binding, as in
// RelativeBiasCases), the three sets of tables in turn (both, content to
// position alone, position to content alone), and two more: four query
// heads over one kv head (each row its own head's tables against the
// group's one key row) with a window, sinks, ALiBi's slopes and a relative
// bias table too (every position term at once), and Lq > Lk without a
// window and a distance past every query-key distance (no clamp).
inline std::vector<Case> RelativeEmbeddingCases(const std::vector<DType>& dtypes) {
  std::vector<Case> cases = RuleCases(dtypes);
  const Embeddings sets[] = {Embeddings::kBoth, Embeddings::kContentToPosition,
                             Embeddings::kPositionToContent};
  for (size_t n = 0; n < cases.size(); ++n) {
    cases[n].relative_embedding_distance = n % 2 == 1 ? 5 : 3;
    cases[n].embeddings = sets[n % 3];
  }
  Case grouped = MakeCase(dtypes.front(), 1, 4, 1, 60, 230, 64, /*causal=*/true);
  grouped.window = 70;
  grouped.sinks = true;
  grouped.alibi = true;
  grouped.relative_bias_distance = 4;
  grouped.relative_embedding_distance = 5;
  Case wide = MakeCase(dtypes.back(), 1, 2, 1, 140, 90, 64, /*causal=*/false);
  wide.relative_embedding_distance = 200;
  cases.push_back(grouped);
  cases.push_back(wide);
  return cases;
}

// Row i of head h, batch b: the logits t[j] of the keys it sees (the score
// Q_i . K_j plus the relative position embeddings' Q_i . relative_key[h][:,
// c] + K_j . relative_query[h][:, c] for c = clamp(j - position, -D, D) +
// D, scaled, softcapped, plus ALiBi's slope_h * (j - position), plus the
// relative bias table's entry for clamp(j - position, -D, D), plus the
// additive mask), -inf for the keys it does not (key lengths, causal,
// window, bool mask, -inf additive mask); returns whether it sees any.
inline bool RowLogits(const Inputs& in, int64_t b, int64_t h, int64_t i, std::vector<double>* t) {
  const Case& c = in.c;
  const AttentionParams& a = in.params;
  const int64_t hk = h / (c.heads / c.kv_heads);
  const int64_t position = i + c.kv_len - c.q_len;
  t->assign(c.kv_len, -INFINITY);
  bool sees = false;
  for (int64_t j = 0; j < c.kv_len; ++j) {
    if (j >= in.lengths[b]) continue;
    if (c.causal && j > position) continue;
    if (c.window > 0 && j < position - c.window + 1) continue;
    if (c.window > 0 && !c.causal && j > position + c.window - 1) continue;  // two-sided
    if (c.mask == Mask::kBoolPerBatch && in.bool_mask[(b * c.q_len + i) * c.kv_len + j] == 0) {
      continue;
    }
    const double extra = c.mask == Mask::kAdditivePerHead ? in.add_mask[h * c.kv_len + j] : 0.0;
    if (std::isinf(extra)) continue;
    const float* qi = &in.q[b * a.q_stride_b + h * a.q_stride_h + i * a.q_stride_row];
    const float* kj = &in.k[b * a.k_stride_b + hk * a.k_stride_h + j * a.k_stride_row];
    double dot = 0.0;
    for (int64_t d = 0; d < c.dim; ++d) dot += static_cast<double>(qi[d]) * kj[d];
    if (c.relative_embedding_distance > 0) {
      const int64_t e = c.relative_embedding_distance;
      const int64_t column = std::clamp(j - position, -e, e) + e;
      for (int64_t d = 0; d < c.dim; ++d) {
        const int64_t at = (h * c.dim + d) * (2 * e + 1) + column;
        if (c.ContentToPosition()) dot += static_cast<double>(qi[d]) * in.relative_key[at];
        if (c.PositionToContent()) dot += static_cast<double>(kj[d]) * in.relative_query[at];
      }
    }
    double logit = dot * static_cast<double>(a.scale);  // the scale as the kernel has it
    if (c.softcap > 0.0f) logit = c.softcap * std::tanh(logit / c.softcap);
    if (c.alibi) {
      logit += static_cast<double>(in.alibi_slopes[h]) * static_cast<double>(j - position);
    }
    if (c.relative_bias_distance > 0) {
      const int64_t d = c.relative_bias_distance;
      logit += in.relative_bias[h * (2 * d + 1) + std::clamp(j - position, -d, d) + d];
    }
    (*t)[j] = logit + extra;
    sees = true;
  }
  return sees;
}

// The row's probabilities p[j] (zeros for the keys it does not see, and for
// a row that sees none); a row that sees a key counts its sink in the max
// and the sum, and gives it no probability.
inline void RowProbabilities(const Inputs& in, int64_t b, int64_t h, int64_t i,
                             std::vector<double>* p) {
  const bool sees = RowLogits(in, b, h, i, p);
  const double sink = sees && in.c.sinks ? in.sinks[h] : -INFINITY;
  double max = sink;
  for (const double t : *p) max = std::max(max, t);
  double sum = sees && in.c.sinks ? std::exp(sink - max) : 0.0;
  for (double& t : *p) {
    t = std::isinf(t) ? 0.0 : std::exp(t - max);
    sum += t;
  }
  for (double& t : *p) t = sees ? t / sum : 0.0;
}

// The row's natural-log log-sum-exp over the keys it sees (no sinks): what
// a fused kernel's softmax statistics hold; -inf for a row that sees none.
inline double RowLogSumExp(const Inputs& in, int64_t b, int64_t h, int64_t i) {
  std::vector<double> t;
  if (!RowLogits(in, b, h, i, &t)) return -INFINITY;
  const double max = *std::max_element(t.begin(), t.end());
  double sum = 0.0;
  for (const double x : t) sum += std::isinf(x) ? 0.0 : std::exp(x - max);
  return max + std::log(sum);
}

// Checks `out` (in.params' output layout and dtype) against float64
// attention over the same inputs: fp32 within 1e-5 absolute; fp16/bf16
// inputs within their kernels' rounding of P (and an output dtype's
// rounding). Reports up to five outputs that are off; returns how many are.
inline int64_t CompareWithFloat64(const Inputs& in, const void* out) {
  const Case& c = in.c;
  const AttentionParams& a = in.params;
  const DType out_dtype = c.OutDType();
  double atol = 1e-5, rtol = 0.0;
  if (c.dtype == DType::kFloat16) atol = 2e-3, rtol = 1e-2;
  if (c.dtype == DType::kBFloat16) atol = 1.5e-2, rtol = 2e-2;
  if (out_dtype == DType::kFloat16) rtol = std::max(rtol, 1e-3);
  if (out_dtype == DType::kBFloat16) rtol = std::max(rtol, 8e-3);
  const int64_t group = c.heads / c.kv_heads;
  int64_t bad = 0;
  std::vector<double> p;
  for (int64_t b = 0; b < c.batch; ++b) {
    for (int64_t h = 0; h < c.heads; ++h) {
      const int64_t hk = h / group;
      for (int64_t i = 0; i < c.q_len; ++i) {
        RowProbabilities(in, b, h, i, &p);
        for (int64_t d = 0; d < c.dim; ++d) {
          double want = 0.0;
          for (int64_t j = 0; j < c.kv_len; ++j) {
            if (p[j] != 0.0) {
              want += p[j] * in.v[b * a.v_stride_b + hk * a.v_stride_h + j * a.v_stride_row + d];
            }
          }
          const int64_t at = b * a.o_stride_b + h * a.o_stride_h + i * a.o_stride_row + d;
          const double got = LoadAsFloat(out_dtype, out, at);
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
  return bad;
}

// Checks per-head attention weights ([B, Hq, Lq, Lk] contiguous, in
// `dtype`) against the float64 probabilities within atol + rtol * |p|.
// Reports up to five that are off; returns how many are.
inline int64_t CompareWeightsWithFloat64(const Inputs& in, const void* weights, DType dtype,
                                         double atol, double rtol) {
  const Case& c = in.c;
  int64_t bad = 0;
  std::vector<double> p;
  for (int64_t b = 0; b < c.batch; ++b) {
    for (int64_t h = 0; h < c.heads; ++h) {
      for (int64_t i = 0; i < c.q_len; ++i) {
        RowProbabilities(in, b, h, i, &p);
        for (int64_t j = 0; j < c.kv_len; ++j) {
          const double got =
              LoadAsFloat(dtype, weights, ((b * c.heads + h) * c.q_len + i) * c.kv_len + j);
          if (!(std::abs(got - p[j]) <= atol + rtol * p[j])) {  // NaN fails too
            if (bad < 5) {
              ADD_FAILURE() << "weight b " << b << " h " << h << " i " << i << " j " << j
                            << ": got " << got << ", float64 " << p[j];
            }
            ++bad;
          }
        }
      }
    }
  }
  return bad;
}

}  // namespace attnserve::oracle

#endif  // ATTNSERVE_TESTS_UNIT_ENGINE_CUDA_ATTENTION_ORACLE_H_
