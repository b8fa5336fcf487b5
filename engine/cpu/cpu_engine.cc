// The cpu backend. For a projection layer it stacks every task's rows into
// the projections (oneDNN matmuls over fixed-height chunks,
// engine/cpu/projection.h), runs the whole batch's attention core in one call
// of the fused flash kernel (engine/cpu/flash_attention.h) and scatters the
// output projection into each task's output in its dtype; a bare sdpa layer
// is one flash call per task. Fixed chunks and a core that computes each
// request on its own keep results independent of batch composition.
#include "engine/cpu/cpu_engine.h"

#include <cstring>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "engine/cpu/flash_attention.h"
#include "engine/cpu/output_gate.h"
#include "engine/cpu/projection.h"
#include "engine/cpu/rotary.h"
#include "engine/cpu/thread_buffer.h"
#include "engine/rope.h"

#ifdef _OPENMP
#include <omp.h>
#endif

namespace attnserve {
namespace {

using cpu::BufferSlot;
using cpu::ChunkedLinear;
using cpu::LinearJob;
using cpu::RowLayout;
using cpu::ThreadBuffer;

class CpuEngine final : public AttentionEngine {
 public:
  explicit CpuEngine(const EngineOptions& options)
      : options_(options), engine_(dnnl::engine::kind::cpu, 0), projections_(engine_) {}

  std::string_view name() const override { return "cpu"; }

  absl::Status Run(const AttentionLayer& layer, absl::Span<const AttentionTask> batch) override {
    return Guarded([&]() -> absl::Status {
      std::vector<AttentionParams> params;
      params.reserve(batch.size());
      for (const AttentionTask& task : batch) {
        if (absl::Status s = CheckTask(layer.config, task); !s.ok()) return s;
        absl::StatusOr<AttentionParams> p = MakeCoreParams(layer.config, task);
        if (!p.ok()) return p.status();
        if (layer.config.sinks) p->sinks = layer.weights.sinks.data_as<float>();
        params.push_back(*p);
      }
      if (params.empty()) return absl::OkStatus();
      if (!layer.config.has_projections) {
        for (size_t i = 0; i < params.size(); ++i) {
          AttentionParams& p = params[i];
          if (absl::Status s = UseSessionCache(batch[i], &p); !s.ok()) return s;
          absl::Status s = RunCore({&p, 1}, FlashOptionsFor(&layer.config));
          if (!s.ok()) return s;
        }
        return absl::OkStatus();
      }
      return RunProjected(layer, batch, params);
    });
  }

  bool SupportsSessions() const override { return true; }

 private:
  // Sets the thread count and turns anything thrown inside (oneDNN errors,
  // allocation failures) into a Status.
  template <typename Fn>
  absl::Status Guarded(Fn&& fn) {
#ifdef _OPENMP
    if (options_.num_threads > 0) omp_set_num_threads(options_.num_threads);
#endif
    try {
      return fn();
    } catch (const dnnl::error& e) {
      return absl::InternalError(absl::StrCat("cpu engine: oneDNN error: ", e.what()));
    } catch (const std::bad_alloc&) {
      return absl::ResourceExhaustedError("cpu engine: out of memory");
    } catch (const std::exception& e) {
      return absl::InternalError(absl::StrCat("cpu engine: ", e.what()));
    }
  }

  int Threads() const {
#ifdef _OPENMP
    return options_.num_threads > 0 ? options_.num_threads : omp_get_max_threads();
#else
    return 1;
#endif
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

  // A session task: appends the new K/V rows `p` reads (the request's, or
  // the projected ones) into its cache and points `p` at the whole cache.
  static absl::Status UseSessionCache(const AttentionTask& task, AttentionParams* p) {
    if (!task.paged.enabled()) return absl::OkStatus();
    if (p->dtype != task.paged.dtype) {
      // bf16 activations (bf16 layers on CPUs with bf16 matmuls) against the
      // FLOAT32 cache of projection models.
      return absl::UnimplementedError(absl::StrCat(
          "cpu engine: session cache holds ", std::string(DTypeName(task.paged.dtype)),
          ", the attention core computes in ", std::string(DTypeName(p->dtype))));
    }
    if (absl::Status s = CheckPagedKv(task.paged, *p); !s.ok()) return s;
    AppendPagedRows(task.paged, *p);
    PointAtPagedKv(task.paged, p);
    return absl::OkStatus();
  }

  // QK-norm then RoPE (or RoPE then QK-norm, qk_norm.after_rope), then the
  // queries' temperature, on every task's projected Q and K, in place,
  // before a session appends its keys (the cache holds normalised, rotated
  // keys). A sequence's keys sit at cached_len + j and its queries at the
  // bottom-right positions kv_total - Lq + i, kv_total = cached_len + Lk;
  // or, with explicit positions, key j at positions[b][j] and query i at
  // positions[b][Lk - Lq + i] (the temperature takes the index, never the
  // explicit position). Each task is one forward call: its largest
  // position picks LongRoPE's factors.
  void PrepareQk(const AttentionLayer& layer, absl::Span<const AttentionTask> batch,
                 absl::Span<const AttentionParams> params) {
    const LayerConfig& c = layer.config;
    const bool rope = c.rope.type != RopeConfig::Type::kNone;
    // The one set of frequencies, or LongRoPE's short and long ones, computed
    // once per call.
    const RopeFrequencies short_freq = ComputeRopeFrequencies(c.rope, 0);
    const RopeFrequencies long_freq =
        c.rope.type == RopeConfig::Type::kLongRope
            ? ComputeRopeFrequencies(c.rope, c.rope.original_max_position_embeddings)
            : RopeFrequencies();
    for (size_t t = 0; t < params.size(); ++t) {
      const AttentionParams& p = params[t];
      const int64_t cached = batch[t].paged.enabled() ? batch[t].paged.cached_len : 0;
      const RopeFrequencies& freq =
          RopeUsesLongFactors(c.rope, LargestRopePosition(batch[t].positions, cached, p.kv_len))
              ? long_freq
              : short_freq;
      const int64_t first_query = cached + p.kv_len - p.q_len;
      const size_t size = DTypeSize(p.dtype);
      for (int64_t b = 0; b < p.batch; ++b) {
        // const_cast: q and k point into this call's own projection buffers.
        char* q = static_cast<char*>(const_cast<void*>(p.q)) + b * p.q_stride_b * size;
        char* k = static_cast<char*>(const_cast<void*>(p.k)) + b * p.k_stride_b * size;
        auto normalize = [&] {
          if (!c.qk_norm.enabled) return;
          // A row's heads are contiguous in the projection buffers.
          const QkNormVectors qn = QkNormShape(c.qk_norm, p.num_heads, p.head_dim);
          const QkNormVectors kn = QkNormShape(c.qk_norm, p.num_kv_heads, p.head_dim);
          cpu::NormalizeRows(c.qk_norm, layer.weights.q_norm.data_as<float>(), p.dtype, q,
                             p.q_len, p.q_stride_row, qn.count, qn.dim, options_.num_threads);
          cpu::NormalizeRows(c.qk_norm, layer.weights.k_norm.data_as<float>(), p.dtype, k,
                             p.kv_len, p.k_stride_row, kn.count, kn.dim, options_.num_threads);
        };
        auto rotate = [&] {
          if (!rope) return;
          const int64_t* key_positions =
              batch[t].positions.empty() ? nullptr : batch[t].positions.data() + b * p.kv_len;
          const int64_t* query_positions =
              key_positions != nullptr ? key_positions + (p.kv_len - p.q_len) : nullptr;
          if (first_query == cached && p.q_len == p.kv_len) {
            // Self-attention: row r of Q and of K share position cached + r.
            cpu::RotateRowPairs(c.rope, freq, p.dtype, q, p.q_stride_row, p.num_heads, k,
                                p.k_stride_row, p.num_kv_heads, p.q_len, p.head_dim, cached,
                                key_positions, options_.num_threads);
            return;
          }
          cpu::RotateRows(c.rope, freq, p.dtype, q, p.q_len, p.q_stride_row, p.num_heads,
                          p.head_dim, first_query, query_positions, options_.num_threads);
          cpu::RotateRows(c.rope, freq, p.dtype, k, p.kv_len, p.k_stride_row, p.num_kv_heads,
                          p.head_dim, cached, key_positions, options_.num_threads);
        };
        if (c.qk_norm.after_rope) {  // Hunyuan
          rotate();
          normalize();
        } else {
          normalize();
          rotate();
        }
        if (c.temperature_tuning.enabled) {  // Llama 4's layers without RoPE
          cpu::ScaleQueryRows(c.temperature_tuning, p.dtype, q, p.q_len, p.q_stride_row,
                              p.num_heads * p.head_dim, first_query, options_.num_threads);
        }
      }
    }
  }

  // The attention core of every request in `params`: the one place the core
  // is called. Paged params (sessions) are read in place, block by block
  // (cpu::FlashAttention), with no gather into contiguous scratch.
  static absl::Status RunCore(absl::Span<AttentionParams> params,
                              const cpu::FlashOptions& options) {
    return cpu::FlashAttention(params, options);
  }

  // nn.MultiheadAttention (batch first) over the whole batch:
  //  1. projections: self-attention tasks' query rows through one fused
  //     [Wq; Wk; Wv] linear ([Wq; Wk; Wv; Wg] with an output gate),
  //     cross-attention tasks' query, key and value rows through Wq, Wk, Wv
  //     (and their query rows through Wg); all stacked, in one parallel pass
  //     over chunks;
  //  2. the core of every task in one FlashAttention call, reading heads in
  //     place from the stacked activations and writing the stacked core
  //     output; with an output gate, that times sigmoid(gate);
  //  3. the output projection over that, scattered into each task's output.
  // Activations between the steps are FLOAT32, or BFLOAT16 for bf16 layers on
  // CPUs with bf16 matmuls (LayerProjections::activation_dtype).
  absl::Status RunProjected(const AttentionLayer& layer, absl::Span<const AttentionTask> batch,
                            std::vector<AttentionParams>& params) {
    const LayerConfig& c = layer.config;
    std::shared_ptr<cpu::LayerProjections> projections = projections_.Get(layer);
    const DType act = projections->activation_dtype();
    const size_t act_size = DTypeSize(act);
    const int64_t qf = c.num_heads * c.head_dim, kvf = c.num_kv_heads * c.head_dim;

    std::vector<size_t> self_tasks, cross_tasks;
    std::vector<int64_t> self_rows, cross_q_rows, cross_kv_rows, all_q_rows;
    for (size_t i = 0; i < batch.size(); ++i) {
      const AttentionParams& p = params[i];
      all_q_rows.push_back(p.batch * p.q_len);
      if (batch[i].key.empty()) {
        self_tasks.push_back(i);
        self_rows.push_back(p.batch * p.q_len);
      } else {
        cross_tasks.push_back(i);
        cross_q_rows.push_back(p.batch * p.q_len);
        cross_kv_rows.push_back(p.batch * p.kv_len);
      }
    }
    auto get = [&](absl::StatusOr<const ChunkedLinear*> l, const ChunkedLinear** out) {
      if (l.ok()) *out = *l;
      return l.status();
    };
    const ChunkedLinear *qkv = nullptr, *wq = nullptr, *wk = nullptr, *wv = nullptr,
                        *wo = nullptr, *wg = nullptr;
    if (!self_tasks.empty()) {
      if (absl::Status s = get(projections->qkv(layer), &qkv); !s.ok()) return s;
    }
    if (!cross_tasks.empty()) {
      if (absl::Status s = get(projections->q(layer), &wq); !s.ok()) return s;
      if (absl::Status s = get(projections->k(layer), &wk); !s.ok()) return s;
      if (absl::Status s = get(projections->v(layer), &wv); !s.ok()) return s;
      if (c.output_gate) {
        if (absl::Status s = get(projections->g(layer), &wg); !s.ok()) return s;
      }
    }
    if (absl::Status s = get(projections->o(layer), &wo); !s.ok()) return s;

    // 1. Q/K/V (and gate) projections into stacked activations.
    const int64_t gate_n = c.output_gate ? qf : 0;
    const int64_t qkv_n = qf + 2 * kvf + gate_n;
    auto layout = [](const ChunkedLinear* linear, const std::vector<int64_t>& rows) {
      return linear != nullptr ? cpu::LayoutRowsFor(*linear, rows) : RowLayout{};
    };
    const RowLayout self_layout = layout(qkv, self_rows);
    const RowLayout q_layout = layout(wq, cross_q_rows);
    const RowLayout k_layout = layout(wk, cross_kv_rows);
    const RowLayout v_layout = layout(wv, cross_kv_rows);
    const RowLayout g_layout = layout(wg, cross_q_rows);
    // The calling thread's buffers, kept for its next batch (thread_buffer.h).
    ThreadBuffer qkv_buf(BufferSlot::kQkvActivations, self_layout.total * qkv_n * act_size);
    ThreadBuffer q_buf(BufferSlot::kQActivations, q_layout.total * qf * act_size);
    ThreadBuffer k_buf(BufferSlot::kKActivations, k_layout.total * kvf * act_size);
    ThreadBuffer v_buf(BufferSlot::kVActivations, v_layout.total * kvf * act_size);
    ThreadBuffer g_buf(BufferSlot::kGActivations, g_layout.total * gate_n * act_size);

    std::vector<LinearJob> jobs;
    auto add_job = [&](const ChunkedLinear* linear, const RowLayout& layout,
                       const std::vector<size_t>& tasks, const std::vector<int64_t>& rows,
                       TensorView AttentionTask::*input, const ThreadBuffer& out) {
      if (tasks.empty()) return;
      LinearJob job;
      job.linear = linear;
      job.rows = layout.total;
      for (size_t t = 0; t < tasks.size(); ++t) {
        const TensorView& x = batch[tasks[t]].*input;
        job.in.push_back({layout.offsets[t], rows[t], x.dtype, x.data, x.shape.back()});
      }
      job.out.push_back({0, layout.total, act, out.data(), linear->out_features()});
      jobs.push_back(std::move(job));
    };
    add_job(qkv, self_layout, self_tasks, self_rows, &AttentionTask::query, qkv_buf);
    add_job(wq, q_layout, cross_tasks, cross_q_rows, &AttentionTask::query, q_buf);
    add_job(wk, k_layout, cross_tasks, cross_kv_rows, &AttentionTask::key, k_buf);
    add_job(wv, v_layout, cross_tasks, cross_kv_rows, &AttentionTask::value, v_buf);
    if (wg != nullptr) {
      add_job(wg, g_layout, cross_tasks, cross_q_rows, &AttentionTask::query, g_buf);
    }
    if (absl::Status s = cpu::RunLinearJobs(jobs, engine_, Threads()); !s.ok()) return s;

    // 2. The core over the whole batch, into the stacked core output.
    const RowLayout o_layout = cpu::LayoutRowsFor(*wo, all_q_rows);
    ThreadBuffer core(BufferSlot::kCoreOutput, o_layout.total * qf * act_size);
    auto at = [&](const ThreadBuffer& buf, int64_t row, int64_t row_elems, int64_t col) {
      return buf.data() + (row * row_elems + col) * static_cast<int64_t>(act_size);
    };
    for (size_t t = 0; t < self_tasks.size(); ++t) {
      AttentionParams& p = params[self_tasks[t]];
      const int64_t row = self_layout.offsets[t];
      p.q = at(qkv_buf, row, qkv_n, 0);
      p.k = at(qkv_buf, row, qkv_n, qf);
      p.v = at(qkv_buf, row, qkv_n, qf + kvf);
      p.q_stride_row = p.k_stride_row = p.v_stride_row = qkv_n;
      p.q_stride_b = p.q_len * qkv_n;
      p.k_stride_b = p.v_stride_b = p.kv_len * qkv_n;
    }
    for (size_t t = 0; t < cross_tasks.size(); ++t) {
      AttentionParams& p = params[cross_tasks[t]];
      p.q = at(q_buf, q_layout.offsets[t], qf, 0);
      p.k = at(k_buf, k_layout.offsets[t], kvf, 0);
      p.v = at(v_buf, v_layout.offsets[t], kvf, 0);
      p.q_stride_row = qf;
      p.k_stride_row = p.v_stride_row = kvf;
      p.q_stride_b = p.q_len * qf;
      p.k_stride_b = p.v_stride_b = p.kv_len * kvf;
    }
    int64_t covered = 0;  // rows of `core` the core writes; the rest are zeroed
    for (size_t i = 0; i < params.size(); ++i) {
      AttentionParams& p = params[i];
      p.dtype = act;
      p.out_dtype = act;
      p.q_stride_h = p.k_stride_h = p.v_stride_h = c.head_dim;
      p.out = at(core, o_layout.offsets[i], qf, 0);
      TokenLayoutStrides(p.num_heads, p.q_len, p.head_dim_v, &p.o_stride_b, &p.o_stride_h,
                         &p.o_stride_row);
      const int64_t row = o_layout.offsets[i];
      if (row > covered) std::memset(at(core, covered, qf, 0), 0, (row - covered) * qf * act_size);
      covered = row + all_q_rows[i];
    }
    if (o_layout.total > covered) {
      std::memset(at(core, covered, qf, 0), 0, (o_layout.total - covered) * qf * act_size);
    }
    if (c.qk_norm.enabled || c.rope.type != RopeConfig::Type::kNone ||
        c.temperature_tuning.enabled) {
      PrepareQk(layer, batch, params);
    }
    for (size_t i = 0; i < params.size(); ++i) {
      if (absl::Status s = UseSessionCache(batch[i], &params[i]); !s.ok()) return s;
    }
    if (absl::Status s = RunCore(absl::MakeSpan(params), FlashOptionsFor(&c)); !s.ok()) return s;
    if (c.output_gate) {
      for (size_t t = 0; t < self_tasks.size(); ++t) {
        const size_t i = self_tasks[t];
        cpu::GateRows(act, at(core, o_layout.offsets[i], qf, 0), qf,
                      at(qkv_buf, self_layout.offsets[t], qkv_n, qf + 2 * kvf), qkv_n,
                      all_q_rows[i], qf, options_.num_threads);
      }
      for (size_t t = 0; t < cross_tasks.size(); ++t) {
        const size_t i = cross_tasks[t];
        cpu::GateRows(act, at(core, o_layout.offsets[i], qf, 0), qf,
                      at(g_buf, g_layout.offsets[t], qf, 0), qf, all_q_rows[i], qf,
                      options_.num_threads);
      }
    }

    // 3. Output projection, scattered into each task's output.
    LinearJob out_job;
    out_job.linear = wo;
    out_job.rows = o_layout.total;
    out_job.in.push_back({0, o_layout.total, act, core.data(), qf});
    for (size_t i = 0; i < batch.size(); ++i) {
      const MutableTensorView& y = batch[i].output;
      out_job.out.push_back({o_layout.offsets[i], all_q_rows[i], y.dtype, y.data, c.out_dim});
    }
    return cpu::RunLinearJobs({&out_job, 1}, engine_, Threads());
  }

  const EngineOptions options_;
  const dnnl::engine engine_;
  cpu::ProjectionCache projections_;
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
