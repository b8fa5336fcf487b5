// The reference backend: every semantic of attention_params.h written as the
// most direct loop over doubles, so that reading it is the specification.
#include "engine/reference/reference_engine.h"

#include <cmath>
#include <limits>
#include <new>
#include <vector>

#include "absl/status/status.h"
#include "engine/attention_params_check.h"

namespace attnserve {
namespace {

// Contiguous [B, H, L, D] doubles.
struct Heads {
  int64_t batch = 0, heads = 0, len = 0, dim = 0;
  std::vector<double> data;

  Heads(int64_t b, int64_t h, int64_t l, int64_t d)
      : batch(b), heads(h), len(l), dim(d), data(static_cast<size_t>(b * h * l * d), 0.0) {}
  double* row(int64_t b, int64_t h, int64_t i) {
    return data.data() + ((b * heads + h) * len + i) * dim;
  }
  const double* row(int64_t b, int64_t h, int64_t i) const {
    return data.data() + ((b * heads + h) * len + i) * dim;
  }
};

// Reads a strided [B, H, L, D] view of any float dtype into doubles.
Heads LoadHeads(DType dtype, const void* data, int64_t b_n, int64_t h_n, int64_t l_n,
                int64_t d_n, int64_t stride_b, int64_t stride_h, int64_t stride_row) {
  Heads out(b_n, h_n, l_n, d_n);
  for (int64_t b = 0; b < b_n; ++b)
    for (int64_t h = 0; h < h_n; ++h)
      for (int64_t i = 0; i < l_n; ++i)
        for (int64_t d = 0; d < d_n; ++d)
          out.row(b, h, i)[d] =
              LoadAsFloat(dtype, data, b * stride_b + h * stride_h + i * stride_row + d);
  return out;
}

bool Visible(const AttentionParams& p, int64_t b, int64_t h, int64_t i, int64_t j) {
  if (p.causal && j > i + (p.kv_len - p.q_len)) return false;
  if (p.key_lengths != nullptr && j >= p.key_lengths[b]) return false;
  if (p.mask.kind == MaskParams::Kind::kBool) {
    const int64_t at = b * p.mask.stride_b + h * p.mask.stride_h + i * p.mask.stride_q +
                       j * p.mask.stride_k;
    if (static_cast<const uint8_t*>(p.mask.data)[at] == 0) return false;
  }
  return true;
}

double AdditiveMask(const AttentionParams& p, int64_t b, int64_t h, int64_t i, int64_t j) {
  if (p.mask.kind != MaskParams::Kind::kAdditive) return 0.0;
  const int64_t at = b * p.mask.stride_b + h * p.mask.stride_h + i * p.mask.stride_q +
                     j * p.mask.stride_k;
  return LoadAsFloat(p.mask.dtype, p.mask.data, at);
}

// softmax(Q K^T * scale + mask) V over doubles. q: [B, Hq, Lq, Dk], k: [B,
// Hkv, Lk, Dk], v: [B, Hkv, Lk, Dv]; writes out [B, Hq, Lq, Dv] and probs
// [B, Hq, Lq, Lk]. Only dims, masks and scale are read from `p`.
void AttendDouble(const AttentionParams& p, const Heads& q, const Heads& k, const Heads& v,
                  Heads& out, Heads& probs) {
  const int64_t group = p.num_heads / p.num_kv_heads;
  const double neg_inf = -std::numeric_limits<double>::infinity();
  std::vector<double> scores(static_cast<size_t>(p.kv_len));
  std::vector<bool> visible(static_cast<size_t>(p.kv_len));
  for (int64_t b = 0; b < p.batch; ++b) {
    for (int64_t h = 0; h < p.num_heads; ++h) {
      const int64_t g = h / group;  // the kv head this query head reads
      for (int64_t i = 0; i < p.q_len; ++i) {
        const double* qi = q.row(b, h, i);
        double row_max = neg_inf;
        for (int64_t j = 0; j < p.kv_len; ++j) {
          visible[j] = Visible(p, b, h, i, j);
          if (!visible[j]) continue;
          const double* kj = k.row(b, g, j);
          double dot = 0.0;
          for (int64_t d = 0; d < p.head_dim; ++d) dot += qi[d] * kj[d];
          scores[j] = dot * static_cast<double>(p.scale) + AdditiveMask(p, b, h, i, j);
          row_max = std::max(row_max, scores[j]);
        }
        double* oi = out.row(b, h, i);
        double* pi = probs.row(b, h, i);
        // No visible key, or only keys masked to -inf: zeros, not NaN.
        if (row_max == neg_inf) continue;
        double sum = 0.0;
        for (int64_t j = 0; j < p.kv_len; ++j) {
          pi[j] = visible[j] ? std::exp(scores[j] - row_max) : 0.0;
          sum += pi[j];
        }
        for (int64_t j = 0; j < p.kv_len; ++j) pi[j] /= sum;
        for (int64_t j = 0; j < p.kv_len; ++j) {
          if (pi[j] == 0.0) continue;
          const double* vj = v.row(b, g, j);
          for (int64_t d = 0; d < p.head_dim_v; ++d) oi[d] += pi[j] * vj[d];
        }
      }
    }
  }
}

// Writes the probabilities to p.weights (per head, or the mean over heads).
void StoreWeights(const AttentionParams& p, const Heads& probs) {
  if (p.weights == nullptr) return;
  for (int64_t b = 0; b < p.batch; ++b)
    for (int64_t i = 0; i < p.q_len; ++i)
      for (int64_t j = 0; j < p.kv_len; ++j) {
        if (p.average_weights) {
          double sum = 0.0;
          for (int64_t h = 0; h < p.num_heads; ++h) sum += probs.row(b, h, i)[j];
          StoreFromFloat(p.weights_dtype, p.weights, (b * p.q_len + i) * p.kv_len + j,
                         static_cast<float>(sum / static_cast<double>(p.num_heads)));
        } else {
          for (int64_t h = 0; h < p.num_heads; ++h)
            StoreFromFloat(p.weights_dtype, p.weights,
                           ((b * p.num_heads + h) * p.q_len + i) * p.kv_len + j,
                           static_cast<float>(probs.row(b, h, i)[j]));
        }
      }
}

// y[r, n] = sum_c x[r, c] * w[n, c] + bias[n] for x [rows, in]
// and w [out, in] FLOAT32 (PyTorch Linear layout).
std::vector<double> Linear(const std::vector<double>& x, int64_t rows, int64_t in,
                           const Tensor& w, const Tensor& bias) {
  const int64_t out = w.shape()[0];
  const float* wp = w.data_as<float>();
  const float* bp = bias.byte_size() != 0 ? bias.data_as<float>() : nullptr;
  std::vector<double> y(static_cast<size_t>(rows * out));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t n = 0; n < out; ++n) {
      double acc = bp != nullptr ? bp[n] : 0.0;
      for (int64_t c = 0; c < in; ++c) acc += x[r * in + c] * static_cast<double>(wp[n * in + c]);
      y[r * out + n] = acc;
    }
  return y;
}

std::vector<double> LoadAll(const TensorView& t) {
  std::vector<double> out(static_cast<size_t>(t.num_elements()));
  for (int64_t i = 0; i < static_cast<int64_t>(out.size()); ++i)
    out[i] = LoadAsFloat(t.dtype, t.data, i);
  return out;
}

// [B, L, H*D] token layout -> [B, H, L, D] heads.
Heads SplitHeads(const std::vector<double>& x, int64_t batch, int64_t len, int64_t heads,
                 int64_t dim) {
  Heads out(batch, heads, len, dim);
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t l = 0; l < len; ++l)
      for (int64_t h = 0; h < heads; ++h)
        for (int64_t d = 0; d < dim; ++d)
          out.row(b, h, l)[d] = x[((b * len + l) * heads + h) * dim + d];
  return out;
}

class ReferenceEngine final : public AttentionEngine {
 public:
  std::string_view name() const override { return "reference"; }

  absl::Status Attend(absl::Span<const AttentionParams> batch) override {
    return Guarded([&] { return AttendAll(batch); });
  }

  absl::Status Run(const AttentionLayer& layer, absl::Span<const AttentionTask> batch) override {
    return Guarded([&] { return RunAll(layer, batch); });
  }

 private:
  // The only thing that can throw here is allocation.
  template <typename Fn>
  static absl::Status Guarded(Fn&& fn) {
    try {
      return fn();
    } catch (const std::bad_alloc&) {
      return absl::ResourceExhaustedError("reference engine: out of memory");
    }
  }

  absl::Status AttendAll(absl::Span<const AttentionParams> batch) {
    for (const AttentionParams& p : batch) {
      if (absl::Status s = CheckAttentionParams(p); !s.ok()) return s;
      const Heads q = LoadHeads(p.dtype, p.q, p.batch, p.num_heads, p.q_len, p.head_dim,
                                p.q_stride_b, p.q_stride_h, p.q_stride_row);
      const Heads k = LoadHeads(p.dtype, p.k, p.batch, p.num_kv_heads, p.kv_len, p.head_dim,
                                p.k_stride_b, p.k_stride_h, p.k_stride_row);
      const Heads v = LoadHeads(p.dtype, p.v, p.batch, p.num_kv_heads, p.kv_len,
                                p.head_dim_v, p.v_stride_b, p.v_stride_h, p.v_stride_row);
      Heads out(p.batch, p.num_heads, p.q_len, p.head_dim_v);
      Heads probs(p.batch, p.num_heads, p.q_len, p.kv_len);
      AttendDouble(p, q, k, v, out, probs);
      for (int64_t b = 0; b < p.batch; ++b)
        for (int64_t h = 0; h < p.num_heads; ++h)
          for (int64_t i = 0; i < p.q_len; ++i)
            for (int64_t d = 0; d < p.head_dim_v; ++d)
              StoreFromFloat(p.out_dtype, p.out,
                             b * p.o_stride_b + h * p.o_stride_h + i * p.o_stride_row + d,
                             static_cast<float>(out.row(b, h, i)[d]));
      StoreWeights(p, probs);
    }
    return absl::OkStatus();
  }

  absl::Status RunAll(const AttentionLayer& layer, absl::Span<const AttentionTask> batch) {
    for (const AttentionTask& task : batch) {
      if (absl::Status s = CheckTask(layer.config, task); !s.ok()) return s;
      absl::StatusOr<AttentionParams> params = MakeCoreParams(layer.config, task);
      if (!params.ok()) return params.status();
      if (!layer.config.has_projections) {
        if (absl::Status s = AttendAll({&*params, 1}); !s.ok()) return s;
        continue;
      }
      if (absl::Status s = RunProjected(layer, task, *params); !s.ok()) return s;
    }
    return absl::OkStatus();
  }

  // nn.MultiheadAttention (batch first): project, attend per head, project out.
  static absl::Status RunProjected(const AttentionLayer& layer, const AttentionTask& task,
                                   const AttentionParams& p) {
    const LayerConfig& c = layer.config;
    const LayerWeights& w = layer.weights;
    const bool self_attention = task.key.empty();
    const std::vector<double> xq = LoadAll(task.query);
    const std::vector<double> xk = self_attention ? xq : LoadAll(task.key);
    const std::vector<double> xv = self_attention ? xq : LoadAll(task.value);
    const int64_t kdim = self_attention ? c.query_dim : c.key_dim;
    const int64_t vdim = self_attention ? c.query_dim : c.value_dim;
    const Heads q = SplitHeads(Linear(xq, p.batch * p.q_len, c.query_dim, w.wq, w.bq),
                               p.batch, p.q_len, p.num_heads, p.head_dim);
    const Heads k = SplitHeads(Linear(xk, p.batch * p.kv_len, kdim, w.wk, w.bk), p.batch,
                               p.kv_len, p.num_kv_heads, p.head_dim);
    const Heads v = SplitHeads(Linear(xv, p.batch * p.kv_len, vdim, w.wv, w.bv), p.batch,
                               p.kv_len, p.num_kv_heads, p.head_dim_v);
    Heads heads_out(p.batch, p.num_heads, p.q_len, p.head_dim_v);
    Heads probs(p.batch, p.num_heads, p.q_len, p.kv_len);
    AttendDouble(p, q, k, v, heads_out, probs);
    StoreWeights(p, probs);

    // Concatenate heads back to [B, Lq, Hq*Dv], then the out projection.
    const int64_t features = p.num_heads * p.head_dim_v;
    std::vector<double> merged(static_cast<size_t>(p.batch * p.q_len * features));
    for (int64_t b = 0; b < p.batch; ++b)
      for (int64_t i = 0; i < p.q_len; ++i)
        for (int64_t h = 0; h < p.num_heads; ++h)
          for (int64_t d = 0; d < p.head_dim_v; ++d)
            merged[(b * p.q_len + i) * features + h * p.head_dim_v + d] =
                heads_out.row(b, h, i)[d];
    const std::vector<double> y = Linear(merged, p.batch * p.q_len, features, w.wo, w.bo);
    for (int64_t i = 0; i < static_cast<int64_t>(y.size()); ++i)
      StoreFromFloat(task.output.dtype, task.output.data, i, static_cast<float>(y[i]));
    return absl::OkStatus();
  }
};

}  // namespace

std::unique_ptr<AttentionEngine> NewReferenceEngine() {
  return std::make_unique<ReferenceEngine>();
}

}  // namespace attnserve
