// The cpu backend: converts inputs to fp32 at the edge, runs the projections
// as oneDNN matmuls with fused bias, hands the core to AttentionCoreF32 and
// converts the result to the requested dtype. Each task is computed on its
// own, which is what makes results independent of batch composition.
#include "engine/cpu/cpu_engine.h"

#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "engine/cpu/attention_core.h"
#include "engine/cpu/dnnl_matmul.h"

#ifdef _OPENMP
#include <omp.h>
#endif

namespace attnserve {
namespace {

using cpu::MatmulCache;
using cpu::MatmulShape;

// A float32 view of a contiguous tensor: the data itself when it already is
// FLOAT32, else a converted copy.
class Float32Input {
 public:
  explicit Float32Input(const TensorView& t) {
    if (t.dtype == DType::kFloat32) {
      data_ = static_cast<const float*>(t.data);
      return;
    }
    copy_.resize(static_cast<size_t>(t.num_elements()));
    ConvertToFloat(t.dtype, t.data, t.num_elements(), copy_.data());
    data_ = copy_.data();
  }
  const float* data() const { return data_; }

 private:
  std::vector<float> copy_;
  const float* data_ = nullptr;
};

// Gathers a strided [B, H, L, D] view of any float dtype into contiguous fp32.
std::vector<float> GatherHeads(DType dtype, const void* data, int64_t batch, int64_t heads,
                               int64_t len, int64_t dim, int64_t stride_b, int64_t stride_h,
                               int64_t stride_row) {
  std::vector<float> out(static_cast<size_t>(batch * heads * len * dim));
  const auto* bytes = static_cast<const unsigned char*>(data);
  const size_t elem = DTypeSize(dtype);
  float* dst = out.data();
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t i = 0; i < len; ++i, dst += dim) {
        const int64_t at = b * stride_b + h * stride_h + i * stride_row;
        ConvertToFloat(dtype, bytes + static_cast<size_t>(at) * elem, dim, dst);
      }
  return out;
}

class CpuEngine final : public AttentionEngine {
 public:
  explicit CpuEngine(const EngineOptions& options) : options_(options) {}

  std::string_view name() const override { return "cpu"; }

  absl::Status Attend(absl::Span<const AttentionParams> batch) override {
    return Guarded([&](dnnl::stream& stream) -> absl::Status {
      for (const AttentionParams& p : batch) {
        if (absl::Status s = CheckAttentionParams(p); !s.ok()) return s;
        if (absl::Status s = AttendOne(p, stream); !s.ok()) return s;
      }
      return absl::OkStatus();
    });
  }

  absl::Status Run(const AttentionLayer& layer, absl::Span<const AttentionTask> batch) override {
    return Guarded([&](dnnl::stream& stream) -> absl::Status {
      for (const AttentionTask& task : batch) {
        if (absl::Status s = CheckTask(layer.config, task); !s.ok()) return s;
        absl::StatusOr<AttentionParams> params = MakeCoreParams(layer.config, task);
        if (!params.ok()) return params.status();
        absl::Status s = layer.config.has_projections
                             ? RunProjected(layer, task, *params, stream)
                             : AttendOne(*params, stream);
        if (!s.ok()) return s;
      }
      return absl::OkStatus();
    });
  }

 private:
  // Sets the thread count, makes a stream, and turns anything thrown inside
  // (oneDNN errors, allocation failures) into a Status.
  template <typename Fn>
  absl::Status Guarded(Fn&& fn) {
#ifdef _OPENMP
    if (options_.num_threads > 0) omp_set_num_threads(options_.num_threads);
#endif
    try {
      dnnl::stream stream(matmuls_.engine());
      return fn(stream);
    } catch (const dnnl::error& e) {
      return absl::InternalError(absl::StrCat("cpu engine: oneDNN error: ", e.what()));
    } catch (const std::bad_alloc&) {
      return absl::ResourceExhaustedError("cpu engine: out of memory");
    } catch (const std::exception& e) {
      return absl::InternalError(absl::StrCat("cpu engine: ", e.what()));
    }
  }

  // The core for params of any dtypes: fp16/bf16 inputs and outputs go
  // through contiguous fp32 copies.
  absl::Status AttendOne(const AttentionParams& p, dnnl::stream& stream) {
    AttentionParams f = p;
    std::vector<float> q, k, v, out;
    if (p.dtype != DType::kFloat32) {
      q = GatherHeads(p.dtype, p.q, p.batch, p.num_heads, p.q_len, p.head_dim, p.q_stride_b,
                      p.q_stride_h, p.q_stride_row);
      k = GatherHeads(p.dtype, p.k, p.batch, p.num_kv_heads, p.kv_len, p.head_dim,
                      p.k_stride_b, p.k_stride_h, p.k_stride_row);
      v = GatherHeads(p.dtype, p.v, p.batch, p.num_kv_heads, p.kv_len, p.head_dim_v,
                      p.v_stride_b, p.v_stride_h, p.v_stride_row);
      f.dtype = DType::kFloat32;
      f.q = q.data();
      f.k = k.data();
      f.v = v.data();
      HeadLayoutStrides(p.num_heads, p.q_len, p.head_dim, &f.q_stride_b, &f.q_stride_h,
                        &f.q_stride_row);
      HeadLayoutStrides(p.num_kv_heads, p.kv_len, p.head_dim, &f.k_stride_b, &f.k_stride_h,
                        &f.k_stride_row);
      HeadLayoutStrides(p.num_kv_heads, p.kv_len, p.head_dim_v, &f.v_stride_b, &f.v_stride_h,
                        &f.v_stride_row);
    }
    if (p.out_dtype != DType::kFloat32) {
      out.resize(static_cast<size_t>(p.batch * p.num_heads * p.q_len * p.head_dim_v));
      f.out_dtype = DType::kFloat32;
      f.out = out.data();
      HeadLayoutStrides(p.num_heads, p.q_len, p.head_dim_v, &f.o_stride_b, &f.o_stride_h,
                        &f.o_stride_row);
    }
    if (absl::Status s = cpu::AttentionCoreF32(f, matmuls_, stream); !s.ok()) return s;
    if (p.out_dtype != DType::kFloat32) {
      auto* dst = static_cast<unsigned char*>(p.out);
      const size_t elem = DTypeSize(p.out_dtype);
      const float* src = out.data();
      for (int64_t b = 0; b < p.batch; ++b)
        for (int64_t h = 0; h < p.num_heads; ++h)
          for (int64_t i = 0; i < p.q_len; ++i, src += p.head_dim_v) {
            const int64_t at = b * p.o_stride_b + h * p.o_stride_h + i * p.o_stride_row;
            ConvertFromFloat(src, p.head_dim_v, p.out_dtype,
                             dst + static_cast<size_t>(at) * elem);
          }
    }
    return absl::OkStatus();
  }

  // y [rows, N] = x [rows, K] w^T + bias, w in PyTorch Linear layout [N, K].
  absl::Status Linear(const float* x, int64_t rows, const Tensor& w, const Tensor& bias,
                      float* y, dnnl::stream& stream) {
    const int64_t n = w.shape()[0], k = w.shape()[1];
    MatmulShape shape;
    shape.src_dims = {rows, k};
    shape.src_strides = {k, 1};
    shape.wei_dims = {k, n};
    shape.wei_strides = {1, k};  // w^T, read in place
    shape.dst_dims = {rows, n};
    shape.dst_strides = {n, 1};
    shape.has_bias = bias.byte_size() != 0;
    return matmuls_.Execute(shape, x, w.data_as<float>(),
                            shape.has_bias ? bias.data_as<float>() : nullptr, y, stream);
  }

  // nn.MultiheadAttention (batch first): Q/K/V projections into token layout
  // [B, L, H*D], the core reading heads in place, then the out projection.
  absl::Status RunProjected(const AttentionLayer& layer, const AttentionTask& task,
                            AttentionParams p, dnnl::stream& stream) {
    const LayerWeights& w = layer.weights;
    const bool self_attention = task.key.empty();
    const int64_t q_rows = p.batch * p.q_len, kv_rows = p.batch * p.kv_len;
    const int64_t q_features = p.num_heads * p.head_dim;
    const int64_t kv_features = p.num_kv_heads * p.head_dim;

    std::vector<float> q(static_cast<size_t>(q_rows * q_features));
    std::vector<float> k(static_cast<size_t>(kv_rows * kv_features));
    std::vector<float> v(static_cast<size_t>(kv_rows * kv_features));
    {
      const Float32Input xq(task.query);
      if (absl::Status s = Linear(xq.data(), q_rows, w.wq, w.bq, q.data(), stream); !s.ok())
        return s;
      if (self_attention) {
        if (absl::Status s = Linear(xq.data(), kv_rows, w.wk, w.bk, k.data(), stream); !s.ok())
          return s;
        if (absl::Status s = Linear(xq.data(), kv_rows, w.wv, w.bv, v.data(), stream); !s.ok())
          return s;
      } else {
        const Float32Input xk(task.key);
        if (absl::Status s = Linear(xk.data(), kv_rows, w.wk, w.bk, k.data(), stream); !s.ok())
          return s;
        const Float32Input xv(task.value);
        if (absl::Status s = Linear(xv.data(), kv_rows, w.wv, w.bv, v.data(), stream); !s.ok())
          return s;
      }
    }

    std::vector<float> heads_out(static_cast<size_t>(q_rows * q_features));
    p.dtype = DType::kFloat32;
    p.out_dtype = DType::kFloat32;
    p.q = q.data();
    p.k = k.data();
    p.v = v.data();
    p.out = heads_out.data();
    TokenLayoutStrides(p.num_heads, p.q_len, p.head_dim, &p.q_stride_b, &p.q_stride_h,
                       &p.q_stride_row);
    TokenLayoutStrides(p.num_kv_heads, p.kv_len, p.head_dim, &p.k_stride_b, &p.k_stride_h,
                       &p.k_stride_row);
    TokenLayoutStrides(p.num_kv_heads, p.kv_len, p.head_dim_v, &p.v_stride_b, &p.v_stride_h,
                       &p.v_stride_row);
    TokenLayoutStrides(p.num_heads, p.q_len, p.head_dim_v, &p.o_stride_b, &p.o_stride_h,
                       &p.o_stride_row);
    if (absl::Status s = cpu::AttentionCoreF32(p, matmuls_, stream); !s.ok()) return s;

    const DType out_dtype = task.output.dtype;
    std::vector<float> y;
    float* y_data = static_cast<float*>(task.output.data);
    if (out_dtype != DType::kFloat32) {
      y.resize(static_cast<size_t>(task.output.num_elements()));
      y_data = y.data();
    }
    if (absl::Status s = Linear(heads_out.data(), q_rows, w.wo, w.bo, y_data, stream); !s.ok())
      return s;
    if (out_dtype != DType::kFloat32) {
      ConvertFromFloat(y.data(), static_cast<int64_t>(y.size()), out_dtype, task.output.data);
    }
    return absl::OkStatus();
  }

  const EngineOptions options_;
  MatmulCache matmuls_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<AttentionEngine>> NewCpuEngine(const EngineOptions& options) {
  if (options.num_threads < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("cpu engine: num_threads must be >= 0, got ", options.num_threads));
  }
  try {
    return std::unique_ptr<AttentionEngine>(std::make_unique<CpuEngine>(options));
  } catch (const dnnl::error& e) {
    return absl::UnavailableError(absl::StrCat("cpu engine: oneDNN unavailable: ", e.what()));
  }
}

}  // namespace attnserve
