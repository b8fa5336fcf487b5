// The cpu backend: converts inputs to fp32 at the edge, runs the projections
// as oneDNN matmuls with fused bias, hands the core to the fused flash kernel
// (cpu/flash_attention.h, which reads any dtype and layout in place) and
// converts the result to the requested dtype. Each task is computed on its
// own, which is what makes results independent of batch composition.
#include "engine/cpu/cpu_engine.h"

#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "engine/cpu/dnnl_matmul.h"
#include "engine/cpu/flash_attention.h"

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

class CpuEngine final : public AttentionEngine {
 public:
  explicit CpuEngine(const EngineOptions& options) : options_(options) {}

  std::string_view name() const override { return "cpu"; }

  absl::Status Attend(absl::Span<const AttentionParams> batch) override {
    return Guarded([&](dnnl::stream&) -> absl::Status {
      for (const AttentionParams& p : batch) {
        if (absl::Status s = CheckAttentionParams(p); !s.ok()) return s;
      }
      // One call for the whole ragged batch: its work items share the threads.
      return cpu::FlashAttention(batch, FlashOptionsFor(nullptr));
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
                             : cpu::FlashAttention({&*params, 1}, FlashOptionsFor(&layer.config));
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

  // Threads as configured; bf16 products only when the layer's precision
  // asks for them (otherwise bf16/fp16 inputs are widened and the result is
  // as exact as for fp32 inputs).
  cpu::FlashOptions FlashOptionsFor(const LayerConfig* layer) const {
    cpu::FlashOptions o;
    o.num_threads = options_.num_threads;
    o.precision = layer != nullptr && layer->precision == Precision::kBFloat16
                      ? cpu::FlashPrecision::kBFloat16
                      : cpu::FlashPrecision::kFloat32;
    return o;
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
    if (absl::Status s = cpu::FlashAttention({&p, 1}, FlashOptionsFor(&layer.config)); !s.ok())
      return s;

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
