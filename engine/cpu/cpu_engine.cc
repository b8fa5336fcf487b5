// The cpu backend. For a projection layer it stacks every task's rows into
// the projections (oneDNN matmuls over fixed-height chunks,
// engine/cpu/projection.h), runs the whole batch's attention core in one call
// of the fused flash kernel (engine/cpu/flash_attention.h) and scatters the
// output projection into each task's output in its dtype; a bare sdpa layer
// is one flash call per task. Fixed chunks and a core that computes each
// request on its own keep results independent of batch composition.
#include "engine/cpu/cpu_engine.h"

#include <cstring>
#include <optional>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "engine/cpu/flash_attention.h"
#include "engine/cpu/latent_keys.h"
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

// The layer's relative position embeddings, when it has them
// (AttentionParams::relative_key).
void SetRelativeEmbeddings(const AttentionLayer& layer, AttentionParams* p) {
  const RelativeEmbeddings& r = layer.config.relative_embeddings;
  if (r.distance == 0) return;
  if (r.content_to_position) p->relative_key = layer.weights.relative_key.data_as<float>();
  if (r.position_to_content) p->relative_query = layer.weights.relative_query.data_as<float>();
  p->relative_embedding_distance = r.distance;
}

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
        if (layer.config.relative_bias_distance > 0) {
          p->relative_bias = layer.weights.relative_bias.data_as<float>();
          p->relative_bias_distance = layer.config.relative_bias_distance;
        }
        SetRelativeEmbeddings(layer, &*p);
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
      if (layer.config.latent.enabled) return RunLatent(layer, batch, params);
      return RunProjected(layer, batch, params);
    });
  }

  bool SupportsSessions() const override { return true; }

  // A latent layer's sessions cache each token's normalised latent and
  // rotated rotary key as one key row [c' | k_rope] and c' as its value
  // (kv_lora_rank + rope_dim + kv_lora_rank values per token: 1088 for
  // DeepSeek-V3 against 40960 for its heads' keys and values); RunLatent
  // attends over them with each head's query absorbed into the latent.
  KvCacheGeometry SessionCacheGeometry(const LayerConfig& layer) const override {
    if (!layer.latent.enabled) return AttentionEngine::SessionCacheGeometry(layer);
    const LatentAttention& m = layer.latent;
    return {1, m.kv_lora_rank + m.rope_dim, m.kv_lora_rank};
  }

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

  // The value norm, then QK-norm, QKV clipping (V too) and RoPE (or
  // clipping, RoPE and QK-norm, qk_norm.after_rope) on every task's
  // projected Q, K and V, in place, before a session appends its keys and
  // values (the cache holds normalised, clipped, rotated ones). A
  // sequence's keys sit at cached_len + j and its queries at the
  // bottom-right positions kv_total - Lq + i, kv_total = cached_len + Lk; or,
  // with explicit positions, key j at positions[b][j] and query i at
  // positions[b][Lk - Lq + i]. Each task is one forward call: its largest
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
        // QKV clipping (OLMo, DBRX), after the projections and a QK-norm
        // before RoPE (OLMoE's order); V's rows too, before a session
        // caches them.
        auto clip = [&] {
          if (c.clip_qkv <= 0) return;
          char* v = static_cast<char*>(const_cast<void*>(p.v)) + b * p.v_stride_b * size;
          cpu::ClipRows(p.dtype, q, p.q_len, p.q_stride_row, p.num_heads * p.head_dim,
                        c.clip_qkv, options_.num_threads);
          cpu::ClipRows(p.dtype, k, p.kv_len, p.k_stride_row, p.num_kv_heads * p.head_dim,
                        c.clip_qkv, options_.num_threads);
          cpu::ClipRows(p.dtype, v, p.kv_len, p.v_stride_row, p.num_kv_heads * p.head_dim_v,
                        c.clip_qkv, options_.num_threads);
        };
        if (c.v_norm_eps > 0) {  // Gemma 3n, Gemma 4: each value head, no weight
          QkNormConfig norm;
          norm.enabled = true;
          norm.eps = c.v_norm_eps;
          char* v = static_cast<char*>(const_cast<void*>(p.v)) + b * p.v_stride_b * size;
          cpu::NormalizeRows(norm, nullptr, p.dtype, v, p.kv_len, p.v_stride_row,
                             p.num_kv_heads, p.head_dim_v, options_.num_threads);
        }
        if (c.qk_norm.after_rope) {  // Hunyuan
          clip();
          rotate();
          normalize();
        } else {
          normalize();
          clip();
          rotate();
        }
      }
    }
  }

  // The queries' temperature (Llama 4's layers without RoPE, Ministral 3,
  // Mistral 4), after PrepareQk, on every head's whole query row: the query
  // at index cached_len + Lk - Lq + i; by_position, at its explicit position
  // when the task has positions (by index, they never change it).
  void ScaleQueries(const LayerConfig& c, absl::Span<const AttentionTask> batch,
                    absl::Span<const AttentionParams> params) {
    for (size_t t = 0; t < params.size(); ++t) {
      const AttentionParams& p = params[t];
      const int64_t cached = batch[t].paged.enabled() ? batch[t].paged.cached_len : 0;
      const size_t size = DTypeSize(p.dtype);
      for (int64_t b = 0; b < p.batch; ++b) {
        // const_cast: q points into this call's own projection buffers.
        char* q = static_cast<char*>(const_cast<void*>(p.q)) + b * p.q_stride_b * size;
        const int64_t* query_positions =
            c.temperature_tuning.by_position && !batch[t].positions.empty()
                ? batch[t].positions.data() + b * p.kv_len + (p.kv_len - p.q_len)
                : nullptr;
        cpu::ScaleQueryRows(c.temperature_tuning, p.dtype, q, p.q_len, p.q_stride_row,
                            p.num_heads * p.head_dim, cached + p.kv_len - p.q_len,
                            query_positions, options_.num_threads);
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
    for (AttentionParams& p : params) p.q_stride_h = p.k_stride_h = p.v_stride_h = c.head_dim;
    PlaceCoreOutputs(params, all_q_rows, o_layout, core, act, qf);
    if (c.qk_norm.enabled || c.rope.type != RopeConfig::Type::kNone || c.clip_qkv > 0 ||
        c.v_norm_eps > 0) {
      PrepareQk(layer, batch, params);
    }
    if (c.temperature_tuning.enabled) ScaleQueries(c, batch, params);
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
    return ProjectOut(*wo, o_layout, core, act, qf, batch, all_q_rows);
  }

  // The output projection of the stacked core output `core` (rows of
  // `width` elements of `act`, task i's at o_layout.offsets[i]), scattered
  // into each task's output in its dtype.
  absl::Status ProjectOut(const ChunkedLinear& wo, const RowLayout& o_layout,
                          const ThreadBuffer& core, DType act, int64_t width,
                          absl::Span<const AttentionTask> batch,
                          const std::vector<int64_t>& q_rows) {
    LinearJob out_job;
    out_job.linear = &wo;
    out_job.rows = o_layout.total;
    out_job.in.push_back({0, o_layout.total, act, core.data(), width});
    for (size_t i = 0; i < batch.size(); ++i) {
      const MutableTensorView& y = batch[i].output;
      out_job.out.push_back({o_layout.offsets[i], q_rows[i], y.dtype, y.data, wo.out_features()});
    }
    return cpu::RunLinearJobs({&out_job, 1}, engine_, Threads());
  }

  // Points every task's core output at its rows of the stacked `core` (rows
  // of `width` elements of `act` at o_layout.offsets[i]) and zeroes the rows
  // no task writes, which the output projection reads too.
  static void PlaceCoreOutputs(std::vector<AttentionParams>& params,
                               const std::vector<int64_t>& q_rows, const RowLayout& o_layout,
                               const ThreadBuffer& core, DType act, int64_t width) {
    const size_t act_size = DTypeSize(act);
    auto row_at = [&](int64_t row) { return core.data() + row * width * act_size; };
    int64_t covered = 0;
    for (size_t i = 0; i < params.size(); ++i) {
      AttentionParams& p = params[i];
      p.dtype = act;
      p.out_dtype = act;
      p.out = row_at(o_layout.offsets[i]);
      TokenLayoutStrides(p.num_heads, p.q_len, p.head_dim_v, &p.o_stride_b, &p.o_stride_h,
                         &p.o_stride_row);
      const int64_t row = o_layout.offsets[i];
      if (row > covered) std::memset(row_at(covered), 0, (row - covered) * width * act_size);
      covered = row + q_rows[i];
    }
    if (o_layout.total > covered) {
      std::memset(row_at(covered), 0, (o_layout.total - covered) * width * act_size);
    }
  }

  // Multi-head latent attention (LatentAttention) over the whole batch; every
  // task is self-attention:
  //  1. the latents: every task's rows through the fused [Wq_a; Wkv_a]
  //     ([Wq; Wkv_a] without q_lora_rank), then the RMSNorm of the query
  //     latent and of the key/value latent, in place;
  //  2. the query through q_b's Wq (with q_lora_rank), and the keys' nope
  //     features and the values through the fused [Wk; Wv], in one pass;
  //  3. RoPE on each query head's last rope_dim features and on the token's
  //     one rotary key (PrepareQk), then each head's key assembled as
  //     [k_nope_h | k_rope]; any temperature on the whole query rows;
  //  4. the core of every task in one call, 5. the output projection, as
  //     RunProjected does.
  absl::Status RunLatent(const AttentionLayer& layer, absl::Span<const AttentionTask> batch,
                         std::vector<AttentionParams>& params) {
    const LayerConfig& c = layer.config;
    const LayerWeights& w = layer.weights;
    const LatentAttention& m = c.latent;
    std::shared_ptr<cpu::LayerProjections> projections = projections_.Get(layer);
    const DType act = projections->activation_dtype();
    const size_t act_size = DTypeSize(act);
    const bool q_lora = m.q_lora_rank > 0;
    const int64_t h = c.num_heads, dqk = c.head_dim, dv = m.v_head_dim;
    const int64_t nope = dqk - m.rope_dim, qf = h * dqk, of = h * dv;
    // The latent row: [query latent (or the query itself) | c | k_rope].
    const int64_t kv_col = q_lora ? m.q_lora_rank : qf;
    const int64_t rope_col = kv_col + m.kv_lora_rank, a_n = rope_col + m.rope_dim;
    const int64_t kv_n = h * (nope + dv);  // [k_nope of every head | values]

    std::vector<int64_t> rows;
    for (const AttentionParams& p : params) rows.push_back(p.batch * p.q_len);
    const ChunkedLinear *la = nullptr, *wq = nullptr, *kvb = nullptr, *wo = nullptr;
    for (auto [made, out] :
         {std::pair{projections->latent_a(layer), &la}, std::pair{projections->kv_b(layer), &kvb},
          std::pair{projections->o(layer), &wo}}) {
      if (!made.ok()) return made.status();
      *out = *made;
    }
    if (q_lora) {
      absl::StatusOr<const ChunkedLinear*> made = projections->q(layer);
      if (!made.ok()) return made.status();
      wq = *made;
    }
    auto at = [&](const ThreadBuffer& buf, int64_t row, int64_t row_elems, int64_t col) {
      return buf.data() + (row * row_elems + col) * static_cast<int64_t>(act_size);
    };

    // 1. The latents, normalised in place (every stacked row: those no task
    // covers hold the bias and stay finite).
    const RowLayout a_layout = cpu::LayoutRowsFor(*la, rows);
    ThreadBuffer a_buf(BufferSlot::kQkvActivations, a_layout.total * a_n * act_size);
    {
      LinearJob job;
      job.linear = la;
      job.rows = a_layout.total;
      for (size_t t = 0; t < batch.size(); ++t) {
        const TensorView& x = batch[t].query;
        job.in.push_back({a_layout.offsets[t], rows[t], x.dtype, x.data, x.shape.back()});
      }
      job.out.push_back({0, a_layout.total, act, a_buf.data(), a_n});
      if (absl::Status s = cpu::RunLinearJobs({&job, 1}, engine_, Threads()); !s.ok()) return s;
    }
    QkNormConfig norm;
    norm.enabled = true;
    if (q_lora) {
      norm.eps = m.q_norm_eps;
      cpu::NormalizeRows(norm, w.q_a_norm.data_as<float>(), act, a_buf.data(), a_layout.total,
                         a_n, 1, m.q_lora_rank, options_.num_threads);
    }
    norm.eps = m.kv_norm_eps;
    cpu::NormalizeRows(norm, w.kv_a_norm.data_as<float>(), act, at(a_buf, 0, a_n, kv_col),
                       a_layout.total, a_n, 1, m.kv_lora_rank, options_.num_threads);

    // 2. The query (with q_lora_rank), the keys' nope features and values
    // (not for sessions, which attend over the latent itself).
    std::vector<int64_t> kv_rows = rows;
    for (size_t t = 0; t < batch.size(); ++t) {
      if (batch[t].paged.enabled()) kv_rows[t] = 0;
    }
    const RowLayout q_layout = q_lora ? cpu::LayoutRowsFor(*wq, rows) : RowLayout{};
    const RowLayout kv_layout = cpu::LayoutRowsFor(*kvb, kv_rows);
    ThreadBuffer q_buf(BufferSlot::kQActivations, q_layout.total * qf * act_size);
    ThreadBuffer kv_buf(BufferSlot::kVActivations, kv_layout.total * kv_n * act_size);
    {
      std::vector<LinearJob> jobs;
      auto add_job = [&](const ChunkedLinear* linear, const RowLayout& layout,
                         absl::Span<const int64_t> job_rows, int64_t col, const ThreadBuffer& out) {
        if (layout.total == 0) return;
        LinearJob job;
        job.linear = linear;
        job.rows = layout.total;
        for (size_t t = 0; t < batch.size(); ++t) {
          if (job_rows[t] == 0) continue;
          job.in.push_back({layout.offsets[t], job_rows[t], act,
                            at(a_buf, a_layout.offsets[t], a_n, col), a_n});
        }
        job.out.push_back({0, layout.total, act, out.data(), linear->out_features()});
        jobs.push_back(std::move(job));
      };
      if (q_lora) add_job(wq, q_layout, rows, 0, q_buf);
      add_job(kvb, kv_layout, kv_rows, kv_col, kv_buf);
      if (absl::Status s = cpu::RunLinearJobs(jobs, engine_, Threads()); !s.ok()) return s;
    }

    // 3. RoPE on the queries' rope features and the one rotary key per
    // token, then the keys of every head.
    std::vector<AttentionParams> rope_params = params;
    for (size_t t = 0; t < params.size(); ++t) {
      AttentionParams& p = params[t];
      p.q = q_lora ? at(q_buf, q_layout.offsets[t], qf, 0) : at(a_buf, a_layout.offsets[t], a_n, 0);
      p.q_stride_row = q_lora ? qf : a_n;
      AttentionParams& r = rope_params[t];
      r.dtype = act;
      r.q = static_cast<const char*>(p.q) + nope * static_cast<int64_t>(act_size);
      r.q_stride_row = p.q_stride_row;
      r.q_stride_b = p.q_len * r.q_stride_row;
      r.k = at(a_buf, a_layout.offsets[t], a_n, rope_col);
      r.num_kv_heads = 1;  // the rotary key: one "head" of rope_dim features
      r.k_stride_row = a_n;
      r.k_stride_b = p.kv_len * a_n;
    }
    if (c.rope.type != RopeConfig::Type::kNone) PrepareQk(layer, batch, rope_params);
    const RowLayout k_layout = cpu::LayoutRows(kv_rows, 1, false);
    ThreadBuffer k_buf(BufferSlot::kKActivations, k_layout.total * qf * act_size);
    for (size_t t = 0; t < params.size(); ++t) {
      if (kv_rows[t] == 0) continue;
      cpu::AssembleLatentKeys(act, at(k_buf, k_layout.offsets[t], qf, 0), qf,
                              at(kv_buf, kv_layout.offsets[t], kv_n, 0), kv_n,
                              at(a_buf, a_layout.offsets[t], a_n, rope_col), a_n, rows[t], h,
                              nope, m.rope_dim, options_.num_threads);
    }

    // 4. The core, into the stacked core output (sessions: below).
    for (size_t t = 0; t < params.size(); ++t) {
      AttentionParams& p = params[t];
      p.q_stride_b = p.q_len * p.q_stride_row;
      p.q_stride_h = dqk;
      if (kv_rows[t] == 0) continue;
      p.k = at(k_buf, k_layout.offsets[t], qf, 0);
      p.v = at(kv_buf, kv_layout.offsets[t], kv_n, h * nope);
      p.k_stride_row = qf;
      p.v_stride_row = kv_n;
      p.k_stride_b = p.kv_len * qf;
      p.v_stride_b = p.kv_len * kv_n;
      p.k_stride_h = dqk;
      p.v_stride_h = dv;
    }
    const RowLayout o_layout = cpu::LayoutRowsFor(*wo, rows);
    ThreadBuffer core(BufferSlot::kCoreOutput, o_layout.total * of * act_size);
    PlaceCoreOutputs(params, rows, o_layout, core, act, of);
    // Mistral 4's temperature, on each query head's whole row (after RoPE).
    if (c.temperature_tuning.enabled) ScaleQueries(c, batch, params);

    // Sessions cache each token's latent and rotary key (SessionCacheGeometry)
    // and attend over them with the queries absorbed into the latent.
    std::vector<size_t> sessions;
    std::vector<int64_t> session_rows;
    for (size_t t = 0; t < params.size(); ++t) {
      if (!batch[t].paged.enabled()) continue;
      sessions.push_back(t);
      session_rows.push_back(rows[t]);
    }
    const cpu::LayerProjections::AbsorbedLinears* absorbed = nullptr;
    RowLayout s_layout;
    const int64_t qa = m.kv_lora_rank + m.rope_dim, qaf = h * qa, lf = h * m.kv_lora_rank;
    std::optional<ThreadBuffer> qa_buf, latent_out;
    if (!sessions.empty()) {
      absl::StatusOr<const cpu::LayerProjections::AbsorbedLinears*> made =
          projections->absorbed(layer);
      if (!made.ok()) return made.status();
      absorbed = *made;
      s_layout = cpu::LayoutRowsFor(*absorbed->key_absorbed[0], session_rows);
      qa_buf.emplace(BufferSlot::kLatentQueries, s_layout.total * qaf * act_size);
      latent_out.emplace(BufferSlot::kLatentOutput, s_layout.total * lf * act_size);
      if (absl::Status s = AbsorbQueries(*absorbed, sessions, s_layout, params, *qa_buf, nope,
                                         m.kv_lora_rank, m.rope_dim, act);
          !s.ok()) {
        return s;
      }
      for (size_t i = 0; i < sessions.size(); ++i) {
        AttentionParams& p = params[sessions[i]];
        const int64_t row0 = s_layout.offsets[i];
        const int64_t a_row0 = a_layout.offsets[sessions[i]];
        p.q = at(*qa_buf, row0, qaf, 0);
        p.q_stride_row = qaf;
        p.q_stride_b = p.q_len * qaf;
        p.q_stride_h = qa;
        p.head_dim = qa;
        p.num_kv_heads = 1;
        // K: [c' | k_rope] and V: c', read from the latent rows in place.
        p.k = p.v = at(a_buf, a_row0, a_n, kv_col);
        p.k_stride_row = p.v_stride_row = a_n;
        p.k_stride_b = p.v_stride_b = p.kv_len * a_n;
        p.k_stride_h = qa;
        p.v_stride_h = p.head_dim_v = m.kv_lora_rank;
        p.out = at(*latent_out, row0, lf, 0);
        TokenLayoutStrides(h, p.q_len, m.kv_lora_rank, &p.o_stride_b, &p.o_stride_h,
                           &p.o_stride_row);
      }
    }
    for (size_t i = 0; i < params.size(); ++i) {
      if (absl::Status s = UseSessionCache(batch[i], &params[i]); !s.ok()) return s;
    }
    if (absl::Status s = RunCore(absl::MakeSpan(params), FlashOptionsFor(&c)); !s.ok()) return s;
    if (!sessions.empty()) {
      // Each head's values from its output over the latent, into the
      // stacked core output.
      std::vector<LinearJob> jobs(static_cast<size_t>(h));
      for (int64_t head = 0; head < h; ++head) {
        LinearJob& job = jobs[static_cast<size_t>(head)];
        job.linear = absorbed->value[static_cast<size_t>(head)].get();
        job.rows = s_layout.total;
        for (size_t i = 0; i < sessions.size(); ++i) {
          const int64_t row0 = s_layout.offsets[i], n = session_rows[i];
          job.in.push_back({row0, n, act, at(*latent_out, row0, lf, head * m.kv_lora_rank), lf});
          job.out.push_back(
              {row0, n, act, at(core, o_layout.offsets[sessions[i]], of, head * dv), of});
        }
      }
      if (absl::Status s = cpu::RunLinearJobs(jobs, engine_, Threads()); !s.ok()) return s;
    }

    // 5. Output projection.
    return ProjectOut(*wo, o_layout, core, act, of, batch, rows);
  }

  // A latent layer's session queries absorbed into the latent: for each
  // session task sessions[i] (its rows at s_layout.offsets[i] of `out`, H
  // heads of kv_lora_rank + rope_dim features), head h's q_nope_h Wk_h
  // (key_absorbed[h]) followed by its rotated rope features, so that its
  // product with a cached [c' | k_rope] is the score of the expanded key
  // [c' Wk_h^T | k_rope].
  absl::Status AbsorbQueries(const cpu::LayerProjections::AbsorbedLinears& absorbed,
                             absl::Span<const size_t> sessions, const RowLayout& s_layout,
                             absl::Span<const AttentionParams> params, const ThreadBuffer& out,
                             int64_t nope, int64_t rank, int64_t rope_dim, DType act) {
    const size_t size = DTypeSize(act);
    const int64_t heads = static_cast<int64_t>(absorbed.key_absorbed.size());
    const int64_t qa = rank + rope_dim, qaf = heads * qa, dqk = nope + rope_dim;
    auto query = [&](size_t i, int64_t row, int64_t col) {
      const AttentionParams& p = params[sessions[i]];
      return static_cast<const char*>(p.q) + (row * p.q_stride_row + col) * size;
    };
    std::vector<LinearJob> jobs(static_cast<size_t>(heads));
    for (int64_t head = 0; head < heads; ++head) {
      LinearJob& job = jobs[static_cast<size_t>(head)];
      job.linear = absorbed.key_absorbed[static_cast<size_t>(head)].get();
      job.rows = s_layout.total;
      for (size_t i = 0; i < sessions.size(); ++i) {
        const AttentionParams& p = params[sessions[i]];
        job.in.push_back({s_layout.offsets[i], p.q_len, act, query(i, 0, head * dqk),
                          p.q_stride_row});
      }
      job.out.push_back({0, s_layout.total, act,
                         out.data() + head * qa * static_cast<int64_t>(size), qaf});
    }
    if (absl::Status s = cpu::RunLinearJobs(jobs, engine_, Threads()); !s.ok()) return s;
    for (size_t i = 0; i < sessions.size(); ++i) {
      for (int64_t row = 0; row < params[sessions[i]].q_len; ++row) {
        unsigned char* dst =
            out.data() + (s_layout.offsets[i] + row) * qaf * static_cast<int64_t>(size);
        for (int64_t head = 0; head < heads; ++head) {
          std::memcpy(dst + (head * qa + rank) * static_cast<int64_t>(size),
                      query(i, row, head * dqk + nope), static_cast<size_t>(rope_dim) * size);
        }
      }
    }
    return absl::OkStatus();
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
