// Per-request dispatch of the CUDA engine: device-side AttentionParams built
// from the host-side ones, the attention core (cuDNN's SDPA where it takes
// the request, else the fused or the general kernel written here), the
// cuBLASLt projections around it, dtype conversions and the head average of
// the weights.
#include "engine/cuda/dispatch.h"

#include <cstring>
#include <functional>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"

#include "engine/cuda/attention_kernels.h"
#include "engine/cuda/cuda_status.h"
#include "engine/cuda/paged_attention.h"
#include "engine/cuda/unfused_attention.h"
#include "engine/paged_kv.h"
#include "engine/qk_norm.h"
#include "engine/rope.h"

namespace attnserve::cuda {
namespace {

// Converts `n` elements of type `from` already on the device to `to`, into a
// new arena allocation (or returns `data` when the types match).
absl::StatusOr<const void*> ConvertOnDevice(Call& call, const void* data, DType from, DType to,
                                            int64_t n) {
  if (from == to) return data;
  absl::StatusOr<void*> out = call.DeviceAlloc(static_cast<size_t>(n) * DTypeSize(to));
  if (!out.ok()) return out.status();
  ATTNSERVE_CUDA_CALL(LaunchConvert(data, from, *out, to, n, call.stream()));
  return static_cast<const void*>(*out);
}

// The device-side params of host-side `p`: its dims, causal flag, window,
// chunk, scale and softcap. Every pointer (sinks, ALiBi slopes, the
// relative bias table and the relative position embeddings with their
// distances too), dtype and stride is left for the caller to set.
AttentionParams DeviceParams(const AttentionParams& p) {
  AttentionParams a;
  a.batch = p.batch;
  a.num_heads = p.num_heads;
  a.num_kv_heads = p.num_kv_heads;
  a.head_dim = p.head_dim;
  a.head_dim_v = p.head_dim_v;
  a.q_len = p.q_len;
  a.kv_len = p.kv_len;
  a.causal = p.causal;
  a.window = p.window;
  a.chunk = p.chunk;
  a.scale = p.scale;
  a.softcap = p.softcap;
  return a;
}

// The rotation of a task's queries (PrepareQk): rotary.first is theirs; a
// key's is `positions != nullptr ? 0 : cached_len`.
RotaryArgs QueryRotary(const LayerConfig& config, const DeviceLayer& w, const AttentionParams& p,
                       const int64_t* positions, int64_t cached_len, int64_t max_position) {
  RotaryArgs rotary;
  rotary.inv_freq = static_cast<const double*>(RopeUsesLongFactors(config.rope, max_position)
                                                   ? w.long_inv_freq.data()
                                                   : w.inv_freq.data());
  rotary.attention_factor = w.attention_factor;
  rotary.rotary_dim = config.rope.rotary_dim;
  rotary.interleaved = config.rope.interleaved;
  rotary.positions = positions;
  rotary.positions_stride = p.kv_len;
  rotary.first = (positions != nullptr ? 0 : cached_len) + p.kv_len - p.q_len;
  return rotary;
}

// The queries' temperature (config.temperature_tuning) on every head's
// whole row of a task's projected queries q [B * Lq, H * Dqk], after RoPE:
// Llama 4's layers without RoPE by index, never by explicit position;
// by_position (Ministral 3, Mistral 4) at the explicit positions when given.
absl::Status ScaleQueries(Call& call, const LayerConfig& config, const DeviceLayer& w,
                          const AttentionParams& p, void* q, const int64_t* positions,
                          int64_t cached_len) {
  const TemperatureTuning& t = config.temperature_tuning;
  const int64_t width = p.num_heads * p.head_dim;
  TemperatureArgs a;
  a.floor_scale = t.floor_scale;
  a.attn_scale = t.attn_scale;
  a.by_position = t.by_position;
  a.positions = t.by_position ? positions : nullptr;
  a.positions_stride = p.kv_len;
  a.first = (a.positions != nullptr ? 0 : cached_len) + p.kv_len - p.q_len;
  ATTNSERVE_CUDA_CALL(LaunchQueryTemperature(q, w.type, p.batch * p.q_len, p.q_len, width, width,
                                             a, call.stream()));
  return absl::OkStatus();
}

// The value norm, QK-norm, then QKV clipping (V too) and RoPE (or clipping,
// RoPE, then QK-norm), then the queries' temperature, on a projection
// layer's projected Q, K and V (token layout: rows b * Lq + i and b * Lk +
// j), in place, as the cpu engine applies them: keys at positions
// cached_len + j and queries at the bottom-right ones, cached_len + Lk - Lq
// + i; or, with the task's explicit positions (on the device, [B, Lk]), key
// j at positions[b][j] and query i at positions[b][Lk - Lq + i].
// `max_position`, the task's largest (LargestRopePosition), picks LongRoPE's
// factors.
absl::Status PrepareQk(Call& call, const LayerConfig& config, const DeviceLayer& w,
                       const AttentionParams& p, void* q, void* k, void* v,
                       const int64_t* positions, int64_t cached_len, int64_t max_position) {
  const int64_t q_rows = p.batch * p.q_len, kv_rows = p.batch * p.kv_len;
  const int64_t q_stride = p.num_heads * p.head_dim, k_stride = p.num_kv_heads * p.head_dim;
  auto normalize = [&]() -> absl::Status {
    if (!config.qk_norm.enabled) return absl::OkStatus();
    const QkNormConfig& norm = config.qk_norm;
    const QkNormVectors qn = QkNormShape(norm, p.num_heads, p.head_dim);
    const QkNormVectors kn = QkNormShape(norm, p.num_kv_heads, p.head_dim);
    ATTNSERVE_CUDA_CALL(LaunchQkNorm(q, w.type, q_rows, q_stride, qn.count, qn.dim,
                                     static_cast<const float*>(w.q_norm.data()), norm.eps,
                                     norm.weight_offset, norm.subtract_mean, qn.weight_stride,
                                     call.stream()));
    ATTNSERVE_CUDA_CALL(LaunchQkNorm(k, w.type, kv_rows, k_stride, kn.count, kn.dim,
                                     static_cast<const float*>(w.k_norm.data()), norm.eps,
                                     norm.weight_offset, norm.subtract_mean, kn.weight_stride,
                                     call.stream()));
    return absl::OkStatus();
  };
  if (config.v_norm_eps > 0) {  // Gemma 3n, Gemma 4: each value head, no weight
    ATTNSERVE_CUDA_CALL(LaunchQkNorm(v, w.type, kv_rows, p.num_kv_heads * p.head_dim_v,
                                     p.num_kv_heads, p.head_dim_v, nullptr, config.v_norm_eps,
                                     false, false, 0, call.stream()));
  }
  // The norm before RoPE, or after it (Hunyuan).
  if (!config.qk_norm.after_rope) ATTNSERVE_CUDA_RETURN_IF_ERROR(normalize());
  if (config.clip_qkv > 0) {
    // QKV clipping (OLMo, DBRX): after a QK-norm before RoPE, before RoPE.
    const int64_t v_stride = p.num_kv_heads * p.head_dim_v;
    for (const auto& [x, rows, stride] : {std::tuple<void*, int64_t, int64_t>{q, q_rows, q_stride},
                                          {k, kv_rows, k_stride},
                                          {v, kv_rows, v_stride}}) {
      ATTNSERVE_CUDA_CALL(
          LaunchClip(x, w.type, rows, stride, stride, config.clip_qkv, call.stream()));
    }
  }
  if (config.rope.type != RopeConfig::Type::kNone) {
    RotaryArgs rotary = QueryRotary(config, w, p, positions, cached_len, max_position);
    ATTNSERVE_CUDA_CALL(LaunchRotary(q, w.type, q_rows, p.q_len, q_stride, p.num_heads,
                                     p.head_dim, rotary, call.stream()));
    rotary.first = positions != nullptr ? 0 : cached_len;
    ATTNSERVE_CUDA_CALL(LaunchRotary(k, w.type, kv_rows, p.kv_len, k_stride, p.num_kv_heads,
                                     p.head_dim, rotary, call.stream()));
  }
  if (config.qk_norm.after_rope) ATTNSERVE_CUDA_RETURN_IF_ERROR(normalize());
  if (config.temperature_tuning.enabled) {
    ATTNSERVE_CUDA_RETURN_IF_ERROR(ScaleQueries(call, config, w, p, q, positions, cached_len));
  }
  return absl::OkStatus();
}

// Multi-head latent attention's projections (LatentAttention, as the cpu
// engine computes them) of a self-attention task's rows x [rows, query_dim]
// in the compute type: into q [rows, H * Dqk], k [rows, H * Dqk] and v
// [rows, H * Dv], with RoPE on each query head's last rope_dim features and
// on the token's one rotary key, as PrepareQk positions them, then any
// temperature (ScaleQueries) on the whole query rows.
absl::Status ProjectLatent(Call& call, const LayerConfig& config, const DeviceLayer& w,
                           const AttentionParams& p, const void* x, void* q, void* k, void* v,
                           const int64_t* positions, int64_t cached_len, int64_t max_position) {
  const LatentAttention& m = config.latent;
  const DType ct = w.type;
  const size_t es = DTypeSize(ct);
  const int64_t rows = p.batch * p.q_len, h = config.num_heads, dqk = config.head_dim;
  const int64_t nope = dqk - m.rope_dim, in = config.query_dim;
  auto alloc = [&](int64_t features) {
    return call.DeviceAlloc(static_cast<size_t>(rows * features) * es);
  };
  ProjectionGemm& gemm = call.gemm();
  if (m.q_lora_rank > 0) {
    absl::StatusOr<void*> qa = alloc(m.q_lora_rank);
    if (!qa.ok()) return qa.status();
    ATTNSERVE_CUDA_RETURN_IF_ERROR(
        gemm.Linear(ct, x, rows, in, w.wq_a.data(), w.bq_a.data(), m.q_lora_rank, *qa));
    ATTNSERVE_CUDA_CALL(LaunchQkNorm(*qa, ct, rows, m.q_lora_rank, 1, m.q_lora_rank,
                                     static_cast<const float*>(w.q_a_norm.data()),
                                     m.q_norm_eps, false, false, 0, call.stream()));
    ATTNSERVE_CUDA_RETURN_IF_ERROR(
        gemm.Linear(ct, *qa, rows, m.q_lora_rank, w.wq.data(), w.bq.data(), h * dqk, q));
  } else {
    ATTNSERVE_CUDA_RETURN_IF_ERROR(
        gemm.Linear(ct, x, rows, in, w.wq.data(), w.bq.data(), h * dqk, q));
  }
  absl::StatusOr<void*> latent = alloc(m.kv_lora_rank);
  if (!latent.ok()) return latent.status();
  absl::StatusOr<void*> k_rope = alloc(m.rope_dim);
  if (!k_rope.ok()) return k_rope.status();
  absl::StatusOr<void*> k_nope = alloc(h * nope);
  if (!k_nope.ok()) return k_nope.status();
  ATTNSERVE_CUDA_RETURN_IF_ERROR(
      gemm.Linear(ct, x, rows, in, w.wkv_c.data(), w.bkv_c.data(), m.kv_lora_rank, *latent));
  ATTNSERVE_CUDA_RETURN_IF_ERROR(
      gemm.Linear(ct, x, rows, in, w.wk_rope.data(), w.bk_rope.data(), m.rope_dim, *k_rope));
  ATTNSERVE_CUDA_CALL(LaunchQkNorm(*latent, ct, rows, m.kv_lora_rank, 1, m.kv_lora_rank,
                                   static_cast<const float*>(w.kv_a_norm.data()), m.kv_norm_eps,
                                   false, false, 0, call.stream()));
  ATTNSERVE_CUDA_RETURN_IF_ERROR(gemm.Linear(ct, *latent, rows, m.kv_lora_rank, w.wk.data(),
                                             w.bk.data(), h * nope, *k_nope));
  ATTNSERVE_CUDA_RETURN_IF_ERROR(gemm.Linear(ct, *latent, rows, m.kv_lora_rank, w.wv.data(),
                                             w.bv.data(), h * m.v_head_dim, v));
  if (config.rope.type != RopeConfig::Type::kNone) {
    RotaryArgs rotary = QueryRotary(config, w, p, positions, cached_len, max_position);
    ATTNSERVE_CUDA_CALL(LaunchRotary(static_cast<char*>(q) + static_cast<size_t>(nope) * es, ct,
                                     rows, p.q_len, h * dqk, h, dqk, rotary, call.stream()));
    rotary.first = positions != nullptr ? 0 : cached_len;
    ATTNSERVE_CUDA_CALL(LaunchRotary(*k_rope, ct, rows, p.kv_len, m.rope_dim, 1, m.rope_dim,
                                     rotary, call.stream()));
  }
  if (config.temperature_tuning.enabled) {  // Mistral 4: the whole query rows, after RoPE
    ATTNSERVE_CUDA_RETURN_IF_ERROR(ScaleQueries(call, config, w, p, q, positions, cached_len));
  }
  ATTNSERVE_CUDA_CALL(
      LaunchAssembleLatentKeys(k, *k_nope, *k_rope, ct, rows, h, nope, m.rope_dim, call.stream()));
  return absl::OkStatus();
}

// A request's way to cuDNN, decided from host-side params before the
// request's uploads complete (the sequence lengths cuDNN reads are uploaded
// with them).
struct SdpaRoute {
  bool use = false;
  SdpaShape shape;
  const int32_t* seq_len_q = nullptr;  // device, when the plan pads
  const int32_t* seq_len_kv = nullptr;
};

// The route for host-side `p` computed in `compute` over contiguous Q/K/V/O
// in the token layout or the head layout, with the rows per sequence its
// buffers must have (route.shape.q_rows / kv_rows). Unimplemented, naming
// the reason, when the engine must use cuDNN (ATTNSERVE_CUDA_ATTENTION=cudnn)
// and cannot.
absl::StatusOr<SdpaRoute> RouteSdpa(Call& call, const AttentionParams& p, DType compute,
                                    bool token_layout) {
  SdpaRoute route;
  if (call.attention_source() == AttentionSource::kKernels || call.sdpa() == nullptr) {
    return route;
  }
  std::optional<std::string> why = SdpaRefusal(p, compute);
  if (!why.has_value() && p.weights != nullptr) {
    // The weights come from one score GEMM beside cuDNN's statistics.
    AttentionParams w = p;
    w.dtype = compute;
    if (!UnfusedAttention::SupportsWeights(w)) {
      why = "need_weights of a head whose scores exceed the unfused path's memory bound";
    }
  }
  if (why.has_value()) {
    if (call.attention_source() == AttentionSource::kCudnn) {
      return absl::UnimplementedError(absl::StrCat(
          "cuda engine (ATTNSERVE_CUDA_ATTENTION=cudnn): cuDNN cannot serve this request: ", *why));
    }
    return route;
  }
  SdpaShape& s = route.shape;
  s.dtype = compute;
  s.batch = p.batch;
  s.heads = p.num_heads;
  s.kv_heads = p.num_kv_heads;
  s.head_dim = p.head_dim;
  s.head_dim_v = p.head_dim_v;
  s.q_len = p.q_len;
  s.kv_len = p.kv_len;
  // Bucketed rows where the layout allows them in place: the head layout
  // ([B, H, rows, D], padded on upload), and the token layout of one
  // sequence (rows past its length at the end of the buffer). A token layout
  // of several sequences has each start where the previous ends: exact.
  const bool bucketed = !token_layout || p.batch == 1;
  s.q_rows = bucketed ? SdpaBucketLength(p.q_len) : p.q_len;
  s.kv_rows = bucketed ? SdpaBucketLength(p.kv_len) : p.kv_len;
  s.token_layout = token_layout;
  s.causal = p.causal;
  s.has_key_lengths = p.key_lengths != nullptr;
  s.mask = p.mask.kind;
  s.mask_dtype = p.mask.dtype;
  s.mask_per_batch = p.mask.stride_b != 0;
  s.mask_per_head = p.mask.stride_h != 0;
  s.window = p.window;
  s.sinks = p.sinks != nullptr;
  s.stats = p.weights != nullptr;
  if (CudnnSdpa::NeedsSequenceLengths(s)) {
    std::vector<int32_t> q_lens(static_cast<size_t>(p.batch), static_cast<int32_t>(p.q_len));
    std::vector<int32_t> kv_lens(static_cast<size_t>(p.batch), static_cast<int32_t>(p.kv_len));
    if (p.key_lengths != nullptr) {
      for (int64_t b = 0; b < p.batch; ++b) kv_lens[b] = static_cast<int32_t>(p.key_lengths[b]);
    }
    absl::StatusOr<void*> q = call.Upload(q_lens.data(), q_lens.size() * sizeof(int32_t));
    if (!q.ok()) return q.status();
    absl::StatusOr<void*> kv = call.Upload(kv_lens.data(), kv_lens.size() * sizeof(int32_t));
    if (!kv.ok()) return kv.status();
    route.seq_len_q = static_cast<const int32_t*>(*q);
    route.seq_len_kv = static_cast<const int32_t*>(*kv);
  }
  route.use = true;
  return route;
}

// cuDNN's SDPA for device-side `a` along `route`, each row's log-sum-exp
// into `stats` when the route asks for them. Unimplemented when cuDNN
// declines the shape (nothing enqueued).
absl::Status RunCudnn(Call& call, const AttentionParams& a, const SdpaRoute& route,
                      float* stats) {
  SdpaArgs args;
  args.shape = route.shape;
  args.q = a.q;
  args.k = a.k;
  args.v = a.v;
  args.seq_len_q = route.seq_len_q;
  args.seq_len_kv = route.seq_len_kv;
  args.mask = a.mask;
  args.scale = a.scale;
  args.sinks = a.sinks;
  args.stats = stats;
  args.out = a.out;
  const int64_t out_n = a.batch * a.num_heads * route.shape.q_rows * a.head_dim_v;
  if (a.out_dtype != a.dtype) {  // cuDNN writes the inputs' dtype; convert after
    absl::StatusOr<void*> out = call.DeviceAlloc(static_cast<size_t>(out_n) * DTypeSize(a.dtype));
    if (!out.ok()) return out.status();
    args.out = *out;
  }
  ATTNSERVE_CUDA_RETURN_IF_ERROR(call.sdpa()->Enqueue(
      args, [&call](size_t bytes) { return call.DeviceAlloc(bytes); }, call.stream()));
  if (args.out != a.out) {
    ATTNSERVE_CUDA_CALL(LaunchConvert(args.out, a.dtype, a.out, a.out_dtype, out_n, call.stream()));
  }
  return absl::OkStatus();
}

// Elements a strided [B, H, L, D] view spans from its first element.
int64_t Extent(int64_t batch, int64_t heads, int64_t len, int64_t dim, int64_t stride_b,
               int64_t stride_h, int64_t stride_row) {
  if (batch == 0 || heads == 0 || len == 0) return 0;
  return (batch - 1) * stride_b + (heads - 1) * stride_h + (len - 1) * stride_row + dim;
}

// Host-side `p`'s Q, K and V uploaded into head layout [B, H, rows, D] of
// p.dtype, q_rows / kv_rows rows per head (more than the lengths for a
// cuDNN bucket: the tail rows zeroed).
struct HeadUploads {
  void* q = nullptr;
  void* k = nullptr;
  void* v = nullptr;
};
absl::StatusOr<HeadUploads> UploadHeadLayout(Call& call, const AttentionParams& p,
                                             int64_t q_rows, int64_t kv_rows) {
  const size_t in_size = DTypeSize(p.dtype);
  HeadUploads up;
  absl::StatusOr<void*> q =
      call.UploadHeads(p.q, in_size, p.batch, p.num_heads, p.q_len, p.head_dim, p.q_stride_b,
                       p.q_stride_h, p.q_stride_row, q_rows);
  if (!q.ok()) return q.status();
  absl::StatusOr<void*> k =
      call.UploadHeads(p.k, in_size, p.batch, p.num_kv_heads, p.kv_len, p.head_dim, p.k_stride_b,
                       p.k_stride_h, p.k_stride_row, kv_rows);
  if (!k.ok()) return k.status();
  absl::StatusOr<void*> v =
      call.UploadHeads(p.v, in_size, p.batch, p.num_kv_heads, p.kv_len, p.head_dim_v,
                       p.v_stride_b, p.v_stride_h, p.v_stride_row, kv_rows);
  if (!v.ok()) return v.status();
  up.q = *q;
  up.k = *k;
  up.v = *v;
  return up;
}

// Downloads device `out` ([B, Hq, q_rows, Dv] in p.out_dtype) without its
// rows past q_len, scattered into p.out's strides after the call.
absl::Status DownloadHeadLayout(Call& call, const void* out, const AttentionParams& p,
                                int64_t q_rows) {
  const size_t out_size = DTypeSize(p.out_dtype);
  const size_t block = static_cast<size_t>(p.q_len * p.head_dim_v) * out_size;
  const size_t pitch = static_cast<size_t>(q_rows * p.head_dim_v) * out_size;
  const bool packed = p.o_stride_row == p.head_dim_v &&
                      (p.num_heads == 1 || p.o_stride_h == p.q_len * p.head_dim_v) &&
                      (p.batch == 1 || p.o_stride_b == p.num_heads * p.q_len * p.head_dim_v);
  if (packed) {
    return call.DownloadRowsTo(out, block, pitch, static_cast<size_t>(p.batch * p.num_heads),
                               p.out);
  }
  return call.DownloadRows(
      out, block, pitch, static_cast<size_t>(p.batch * p.num_heads),
      [p, out_size](const char* pinned) {
        const size_t row_bytes = static_cast<size_t>(p.head_dim_v) * out_size;
        char* host = static_cast<char*>(p.out);
        for (int64_t b = 0; b < p.batch; ++b)
          for (int64_t h = 0; h < p.num_heads; ++h)
            for (int64_t i = 0; i < p.q_len; ++i) {
              std::memcpy(host + (b * p.o_stride_b + h * p.o_stride_h + i * p.o_stride_row) *
                                     static_cast<int64_t>(out_size),
                          pinned, row_bytes);
              pinned += row_bytes;
            }
      });
}

// The unfused path (unfused_attention.h) for what the fused kernel does not
// take: fp32 inputs as they are, fp16/bf16 ones widened to fp32 first (same
// strides), so the result is exact and weights come from the same pass.
// False when it does not fit (one head's scores over its memory bound): the
// general kernel serves those.
absl::StatusOr<bool> RunUnfused(Call& call, const AttentionParams& a) {
  AttentionParams f = a;
  f.dtype = DType::kFloat32;
  if (!UnfusedAttention::Supports(f)) return false;
  if (a.dtype != DType::kFloat32) {
    struct Input {
      const void** data;
      int64_t heads, len, dim, sb, sh, sr;
    };
    for (const Input& in : {Input{&f.q, a.num_heads, a.q_len, a.head_dim, a.q_stride_b,
                                  a.q_stride_h, a.q_stride_row},
                            Input{&f.k, a.num_kv_heads, a.kv_len, a.head_dim, a.k_stride_b,
                                  a.k_stride_h, a.k_stride_row},
                            Input{&f.v, a.num_kv_heads, a.kv_len, a.head_dim_v, a.v_stride_b,
                                  a.v_stride_h, a.v_stride_row}}) {
      const int64_t n = Extent(a.batch, in.heads, in.len, in.dim, in.sb, in.sh, in.sr);
      absl::StatusOr<const void*> wide = ConvertOnDevice(call, *in.data, a.dtype, f.dtype, n);
      if (!wide.ok()) return wide.status();
      *in.data = *wide;
    }
  }
  ATTNSERVE_CUDA_RETURN_IF_ERROR(call.unfused().Enqueue(
      f, [&call](size_t bytes) { return call.DeviceAlloc(bytes); }, call.stream()));
  return true;
}

// Bare attention's host-side params carry no layer tables: the relative
// position bias and the relative position embeddings are projection layers'
// (ValidateLayer), which EnqueueProjected gives their device copies. Tables
// here would not reach the kernels, so they are refused, never dropped.
absl::Status RefuseHostTables(const AttentionParams& p) {
  if (p.relative_bias != nullptr || p.relative_key != nullptr || p.relative_query != nullptr) {
    return absl::InvalidArgumentError(
        "cuda engine: a relative position bias or relative position embeddings on bare "
        "attention (projection layers only)");
  }
  return absl::OkStatus();
}

// Runs the attention core for device-side `a` (inputs, output, mask already
// set) and, when `p` asks for weights, downloads them into p.weights.
absl::Status RunCore(Call& call, AttentionParams& a, const AttentionParams& p,
                     const SdpaRoute& route) {
  void* weights = nullptr;  // final device weights, in p.weights_dtype
  size_t weights_bytes = 0;
  if (p.weights != nullptr) {
    const int64_t per_head = p.batch * p.num_heads * p.q_len * p.kv_len;
    if (p.average_weights) {
      // Per-head probabilities in fp32 first, then a deterministic mean.
      absl::StatusOr<void*> probs = call.DeviceAlloc(static_cast<size_t>(per_head) * 4);
      if (!probs.ok()) return probs.status();
      a.weights = *probs;
      a.weights_dtype = DType::kFloat32;
      weights_bytes =
          static_cast<size_t>(p.batch * p.q_len * p.kv_len) * DTypeSize(p.weights_dtype);
    } else {
      weights_bytes = static_cast<size_t>(per_head) * DTypeSize(p.weights_dtype);
    }
    absl::StatusOr<void*> out = call.DeviceAlloc(weights_bytes);
    if (!out.ok()) return out.status();
    weights = *out;
    if (!p.average_weights) {
      a.weights = weights;
      a.weights_dtype = p.weights_dtype;
    }
  }

  bool done = false;
  if (route.use) {
    // With weights: each row's log-sum-exp from cuDNN, the probabilities
    // from one GEMM of the scores (UnfusedAttention::EnqueueWeights).
    float* stats = nullptr;
    if (weights != nullptr) {
      absl::StatusOr<void*> buffer = call.DeviceAlloc(
          static_cast<size_t>(a.batch * a.num_heads * route.shape.q_rows) * sizeof(float));
      if (!buffer.ok()) return buffer.status();
      stats = static_cast<float*>(*buffer);
    }
    const absl::Status cudnn = RunCudnn(call, a, route, stats);
    if (cudnn.ok()) {
      if (stats != nullptr) {
        ATTNSERVE_CUDA_RETURN_IF_ERROR(call.unfused().EnqueueWeights(
            a, stats, route.shape.q_rows, [&call](size_t bytes) { return call.DeviceAlloc(bytes); },
            call.stream()));
      }
      done = true;
    } else if (!absl::IsUnimplemented(cudnn)) {
      return cudnn;
    } else if (call.attention_source() == AttentionSource::kCudnn) {
      return absl::UnimplementedError(absl::StrCat(
          "cuda engine (ATTNSERVE_CUDA_ATTENTION=cudnn): cuDNN declines this shape: ",
          cudnn.message()));
    }
    // Else cuDNN declined this shape (cached): the kernels below serve it.
  }
  if (!done) {
    // The fused kernels, for what a GPU run has verified them on unless the
    // engine was made with ATTNSERVE_CUDA_EXPERIMENTAL_FUSED=1.
    const bool experimental = call.experimental_fused();
    if (FlashAttentionSupports(a) && (experimental || !UsesLayerFeatures(a))) {
      ATTNSERVE_CUDA_CALL(LaunchFlashAttention(a, call.stream()));
    } else if (experimental && FlashAttentionFp32Supports(a, call.max_shared_bytes())) {
      ATTNSERVE_CUDA_CALL(LaunchFlashAttentionFp32(a, call.max_shared_bytes(), call.stream()));
    } else if (absl::StatusOr<bool> unfused = RunUnfused(call, a); !unfused.ok()) {
      return unfused.status();
    } else if (!*unfused) {
      ATTNSERVE_CUDA_CALL(LaunchAttentionGeneral(a, call.stream()));
    }
  }

  if (weights == nullptr) return absl::OkStatus();
  if (p.average_weights) {
    ATTNSERVE_CUDA_CALL(LaunchAverageHeads(static_cast<const float*>(a.weights), p.batch,
                                           p.num_heads, p.q_len * p.kv_len, weights,
                                           p.weights_dtype, call.stream()));
  }
  return call.DownloadTo(weights, weights_bytes, p.weights);
}

// ------------------------------------------------ sessions (paged K/V)
// A session's request appends its new K/V rows into the cache's blocks and
// attends over the whole cache (engine/paged_kv.h): AttendPaged, from
// EnqueueProjected and EnqueuePagedHostAttention.

// Whether the split-KV decode (paged_attention.h) serves paged params `c`
// rather than gather + RunCore: requests of few query rows.
bool UsePagedDecode(const AttentionParams& c) {
  return PagedDecodeSupports(c) && c.q_len <= kPagedDecodeMaxQueryRows;
}

// cuDNN for a session request that the split-KV decode does not take
// (more than kPagedDecodeMaxQueryRows query rows: prefills, long appends),
// over the gathered cache: the route for host-side `p` (the task's core
// params over its new rows) attending over all cache.cached_len +
// p.kv_len tokens, computed in `compute`, Q, K, V and O all in the token or
// the head layout. `compute`: the cache's dtype for bare attention (K/V
// stored as sent); a projection layer's precision for its FLOAT32 cache,
// which holds what its projections computed in that precision, so the
// gather's narrowing is exact (and at any rate the precision the layer
// asks its attention to compute in, as a stateless request does). Its
// plan's buckets are the rows the query and output buffers must have
// (route.shape.q_rows) and the gather writes (kv_rows). No route for
// decode steps (the decode reads the blocks in place), for what cuDNN
// cannot compute exactly (fp32 among them), and for everything with
// ATTNSERVE_CUDA_ATTENTION=kernels; with =cudnn a prefill cuDNN cannot
// serve is Unimplemented naming why, as a stateless request is (a decode
// step is the engine's own in every mode: cuDNN has no in-place decode of
// these blocks). The sequence lengths are uploaded through the call: call
// before UploadsDone.
absl::StatusOr<SdpaRoute> RoutePagedPrefill(Call& call, const AttentionParams& p,
                                            const PagedKv& cache, DType compute,
                                            bool token_layout) {
  if (p.q_len <= kPagedDecodeMaxQueryRows) return SdpaRoute{};
  AttentionParams whole = p;
  whole.kv_len = cache.cached_len + p.kv_len;
  whole.dtype = compute;
  return RouteSdpa(call, whole, compute, token_layout);
}

// A paged task's attention: appends the new K/V rows device-side `a` reads
// (a.k / a.v in a.dtype at their strides, batch 0, a.kv_len rows) into
// `cache` on the device, then attends a's query (a.dtype, its strides) over
// all cache.cached_len + a.kv_len tokens into a.out (a.out_dtype, its
// strides), and enqueues `then` (the work that reads a.out). A split-KV
// decode joins `decodes` with `then`, both enqueued at decodes.Flush; the
// rest computes and enqueues `then` now. `p`: the task's host-side core
// params over the new rows (its causal flag, scale, window, softcap, host
// sinks and host ALiBi slopes are used; a's device sinks and slopes, when
// set, come first; a's relative bias table and relative position
// embeddings, a projection layer's on the device, as they are). `route`
// (RoutePagedPrefill, or none): when it is used, a's query and output have
// route.shape.q_rows rows per head in its layout, the rows past q_len of
// the query zeros, and the attention computes in route.shape.dtype. The
// block tables (and the sinks and slopes) are uploaded through the call,
// so this makes the stream wait for every upload so far.
absl::Status AttendPaged(Call& call, const PagedKv& cache, const AttentionParams& p,
                         const AttentionParams& a, const SdpaRoute& route,
                         PagedDecodes& decodes, std::function<absl::Status()> then) {
  const int64_t total = cache.cached_len + a.kv_len;
  const int64_t blocks = (total + cache.block_tokens - 1) / cache.block_tokens;
  const size_t table_bytes = static_cast<size_t>(blocks) * sizeof(void*);
  absl::StatusOr<void*> k_table = call.Upload(cache.k_blocks.data(), table_bytes);
  if (!k_table.ok()) return k_table.status();
  absl::StatusOr<void*> v_table = call.Upload(cache.v_blocks.data(), table_bytes);
  if (!v_table.ok()) return v_table.status();
  const float* sinks = a.sinks;  // a projection layer's learned sinks, on the device
  if (sinks == nullptr && p.sinks != nullptr) {  // a request's, on the host
    absl::StatusOr<void*> up =
        call.Upload(p.sinks, static_cast<size_t>(p.num_heads) * sizeof(float));
    if (!up.ok()) return up.status();
    sinks = static_cast<const float*>(*up);
  }
  const float* alibi_slopes = a.alibi_slopes;  // a projection layer's, uploaded
  if (alibi_slopes == nullptr && p.alibi_slopes != nullptr) {  // a bare layer's, on the host
    absl::StatusOr<void*> up =
        call.Upload(p.alibi_slopes, static_cast<size_t>(p.num_heads) * sizeof(float));
    if (!up.ok()) return up.status();
    alibi_slopes = static_cast<const float*>(*up);
  }
  ATTNSERVE_CUDA_RETURN_IF_ERROR(call.UploadsDone());

  // 1. The new rows into their blocks, in the cache's dtype.
  PagedCacheArgs dst;
  dst.dtype = cache.dtype;
  dst.k_blocks = static_cast<void* const*>(*k_table);
  dst.v_blocks = static_cast<void* const*>(*v_table);
  dst.block_tokens = cache.block_tokens;
  dst.cached_len = cache.cached_len;
  ATTNSERVE_CUDA_CALL(LaunchPagedAppend(a, dst, call.stream()));

  // 2. Params over the whole cache, the query in the dtype the attention
  // computes in (the cache's, or a cuDNN route's), with the zeros of a
  // cuDNN bucket's rows past q_len.
  const DType compute = route.use ? route.shape.dtype : cache.dtype;
  AttentionParams c = a;
  c.dtype = compute;
  const int64_t q_rows = route.use ? route.shape.q_rows : a.q_len;
  absl::StatusOr<const void*> q = ConvertOnDevice(
      call, a.q, a.dtype, compute,
      Extent(1, a.num_heads, q_rows, a.head_dim, a.q_stride_b, a.q_stride_h, a.q_stride_row));
  if (!q.ok()) return q.status();
  c.q = *q;
  c.kv_len = total;
  c.k = c.v = nullptr;
  c.k_stride_b = c.k_stride_h = c.k_stride_row = 0;
  c.v_stride_b = c.v_stride_h = c.v_stride_row = 0;
  c.k_blocks = static_cast<const void* const*>(*k_table);
  c.v_blocks = static_cast<const void* const*>(*v_table);
  c.block_tokens = cache.block_tokens;
  c.causal = p.causal;
  c.scale = p.scale;
  c.window = p.window;
  c.chunk = p.chunk;
  c.softcap = p.softcap;
  c.sinks = sinks;
  c.alibi_slopes = alibi_slopes;
  c.key_lengths = nullptr;
  c.mask = MaskParams{};
  c.weights = nullptr;

  // 3a. Few query rows: the split-KV decode reads the blocks in place, in
  // one launch with the batch's other decodes (never along a route, which
  // RoutePagedPrefill gives only past the decode's rows: c is in the
  // cache's dtype).
  if (!route.use && UsePagedDecode(c)) {
    absl::StatusOr<void*> scratch = call.DeviceAlloc(PagedDecodeScratchBytes(c));
    if (!scratch.ok()) return scratch.status();
    decodes.Add(c, *scratch, std::move(then));
    return absl::OkStatus();
  }
  // 3b. Prefills and long appends: the blocks gathered into contiguous
  // buffers of `compute` (rows: the cache's length, or its cuDNN bucket
  // with zeros past it; head layout, or a route's token layout), then the
  // core path of stateless requests: cuDNN along `route`, else the kernels
  // written here. A copy of the cache per request: one pass over K and V,
  // small beside a prefill's attention, which reads them once per 128
  // query rows.
  PagedGatherOut gathered;
  gathered.dtype = compute;
  gathered.rows = route.use ? route.shape.kv_rows : total;
  gathered.token_layout = route.use && route.shape.token_layout;
  const size_t elem = DTypeSize(compute);
  absl::StatusOr<void*> k = call.DeviceAlloc(
      static_cast<size_t>(c.num_kv_heads * gathered.rows * c.head_dim) * elem);
  if (!k.ok()) return k.status();
  absl::StatusOr<void*> v = call.DeviceAlloc(
      static_cast<size_t>(c.num_kv_heads * gathered.rows * c.head_dim_v) * elem);
  if (!v.ok()) return v.status();
  gathered.k = *k;
  gathered.v = *v;
  AttentionParams stored = c;
  stored.dtype = cache.dtype;  // what the blocks hold
  ATTNSERVE_CUDA_CALL(LaunchPagedGather(stored, gathered, call.stream()));
  AttentionParams g = c;
  g.k = gathered.k;
  g.v = gathered.v;
  g.k_blocks = g.v_blocks = nullptr;
  g.block_tokens = 0;
  const LayoutStrides layout = gathered.token_layout ? TokenLayoutStrides : HeadLayoutStrides;
  layout(g.num_kv_heads, gathered.rows, g.head_dim, &g.k_stride_b, &g.k_stride_h,
         &g.k_stride_row);
  layout(g.num_kv_heads, gathered.rows, g.head_dim_v, &g.v_stride_b, &g.v_stride_h,
         &g.v_stride_row);
  AttentionParams host = p;  // RunCore reads it for the weights only: none
  host.kv_len = total;
  host.weights = nullptr;
  ATTNSERVE_CUDA_RETURN_IF_ERROR(RunCore(call, g, host, route));
  return then();
}

}  // namespace

void PagedDecodes::Add(const AttentionParams& params, void* scratch,
                       std::function<absl::Status()> then) {
  pending_.push_back(Pending{params, scratch, std::move(then)});
}

absl::Status PagedDecodes::Flush(Call& call) {
  std::vector<Pending> pending = std::move(pending_);
  pending_.clear();
  // One launch of each kernel per cache dtype (a kernel reads one element
  // type), the requests in their batch order.
  for (const DType dtype : {DType::kFloat32, DType::kFloat16, DType::kBFloat16}) {
    std::vector<AttentionParams> params;
    std::vector<void*> scratch;
    for (const Pending& d : pending) {
      if (d.params.dtype != dtype) continue;
      params.push_back(d.params);
      scratch.push_back(d.scratch);
    }
    if (params.empty()) continue;
    std::vector<PagedDecodeEntry> entries(params.size());
    const PagedDecodeBatchPlan plan = PlanPagedDecodeBatch(
        params.data(), scratch.data(), static_cast<int>(params.size()), entries.data());
    absl::StatusOr<void*> table =
        call.Upload(entries.data(), entries.size() * sizeof(PagedDecodeEntry));
    if (!table.ok()) return table.status();
    ATTNSERVE_CUDA_RETURN_IF_ERROR(call.UploadsDone());
    ATTNSERVE_CUDA_CALL(LaunchPagedDecodeBatch(
        plan, static_cast<const PagedDecodeEntry*>(*table), call.stream()));
  }
  for (Pending& d : pending) ATTNSERVE_CUDA_RETURN_IF_ERROR(d.then());
  return absl::OkStatus();
}

absl::Status EnqueueHostAttention(Call& call, const AttentionParams& p, DType compute) {
  ATTNSERVE_CUDA_RETURN_IF_ERROR(RefuseHostTables(p));
  // cuDNN or not is decided first: its plans want Q, K, V and O with the
  // rows of the lengths' buckets, and the uploads write that layout.
  absl::StatusOr<SdpaRoute> route = RouteSdpa(call, p, compute, /*token_layout=*/false);
  if (!route.ok()) return route.status();
  const int64_t q_rows = route->use ? route->shape.q_rows : p.q_len;
  const int64_t kv_rows = route->use ? route->shape.kv_rows : p.kv_len;

  const DType in_type = p.dtype;
  absl::StatusOr<HeadUploads> in = UploadHeadLayout(call, p, q_rows, kv_rows);
  if (!in.ok()) return in.status();

  AttentionParams a = DeviceParams(p);
  ATTNSERVE_CUDA_RETURN_IF_ERROR(StageMaskAndLengths(call, p, a));
  if (p.sinks != nullptr) {  // the task's own, on the host
    absl::StatusOr<void*> sinks =
        call.Upload(p.sinks, static_cast<size_t>(p.num_heads) * sizeof(float));
    if (!sinks.ok()) return sinks.status();
    a.sinks = static_cast<const float*>(*sinks);
  }
  if (p.alibi_slopes != nullptr) {  // the layer's, on the host
    absl::StatusOr<void*> slopes =
        call.Upload(p.alibi_slopes, static_cast<size_t>(p.num_heads) * sizeof(float));
    if (!slopes.ok()) return slopes.status();
    a.alibi_slopes = static_cast<const float*>(*slopes);
  }
  ATTNSERVE_CUDA_RETURN_IF_ERROR(call.UploadsDone());
  a.dtype = compute;
  absl::StatusOr<const void*> qc =
      ConvertOnDevice(call, in->q, in_type, compute, p.batch * p.num_heads * q_rows * p.head_dim);
  if (!qc.ok()) return qc.status();
  absl::StatusOr<const void*> kc = ConvertOnDevice(
      call, in->k, in_type, compute, p.batch * p.num_kv_heads * kv_rows * p.head_dim);
  if (!kc.ok()) return kc.status();
  absl::StatusOr<const void*> vc = ConvertOnDevice(
      call, in->v, in_type, compute, p.batch * p.num_kv_heads * kv_rows * p.head_dim_v);
  if (!vc.ok()) return vc.status();
  a.q = *qc;
  a.k = *kc;
  a.v = *vc;

  // [B, H, rows, D] buffers; the kernels read them through these strides.
  HeadLayoutStrides(p.num_heads, q_rows, p.head_dim, &a.q_stride_b, &a.q_stride_h,
                    &a.q_stride_row);
  HeadLayoutStrides(p.num_kv_heads, kv_rows, p.head_dim, &a.k_stride_b, &a.k_stride_h,
                    &a.k_stride_row);
  HeadLayoutStrides(p.num_kv_heads, kv_rows, p.head_dim_v, &a.v_stride_b, &a.v_stride_h,
                    &a.v_stride_row);
  HeadLayoutStrides(p.num_heads, q_rows, p.head_dim_v, &a.o_stride_b, &a.o_stride_h,
                    &a.o_stride_row);

  // The output comes back without its padding rows and is scattered into
  // p.out's strides.
  a.out_dtype = p.out_dtype;
  const size_t out_size = DTypeSize(a.out_dtype);
  absl::StatusOr<void*> out = call.DeviceAlloc(
      static_cast<size_t>(p.batch * p.num_heads * q_rows * p.head_dim_v) * out_size);
  if (!out.ok()) return out.status();
  a.out = *out;
  ATTNSERVE_CUDA_RETURN_IF_ERROR(RunCore(call, a, p, *route));
  return DownloadHeadLayout(call, a.out, p, q_rows);
}

absl::Status EnqueueProjected(Call& call, const LayerConfig& config, const DeviceLayer& w,
                              const AttentionTask& task, const AttentionParams& p,
                              PagedDecodes& decodes) {
  const DType ct = w.type;
  const size_t ct_size = DTypeSize(ct);
  const DType in_type = task.query.dtype;
  const bool self_attention = task.key.empty() && task.value.empty();
  const int64_t q_rows = p.batch * p.q_len;
  const int64_t kv_rows = p.batch * p.kv_len;
  const int64_t key_dim = self_attention ? config.query_dim : config.key_dim;
  const int64_t value_dim = self_attention ? config.query_dim : config.value_dim;

  // Everything this request uploads, then the compute that waits for it.
  AttentionParams a = DeviceParams(p);
  absl::StatusOr<void*> raw_q = call.Upload(
      task.query.data, static_cast<size_t>(q_rows * config.query_dim) * DTypeSize(in_type));
  if (!raw_q.ok()) return raw_q.status();
  absl::StatusOr<void*> raw_k = raw_q;
  absl::StatusOr<void*> raw_v = raw_q;
  if (!self_attention) {
    raw_k =
        call.Upload(task.key.data, static_cast<size_t>(kv_rows * key_dim) * DTypeSize(in_type));
    if (!raw_k.ok()) return raw_k.status();
    raw_v = call.Upload(task.value.data,
                        static_cast<size_t>(kv_rows * value_dim) * DTypeSize(in_type));
    if (!raw_v.ok()) return raw_v.status();
  }
  ATTNSERVE_CUDA_RETURN_IF_ERROR(StageMaskAndLengths(call, p, a));
  const int64_t* positions = nullptr;  // device
  if (!task.positions.empty()) {
    absl::StatusOr<void*> uploaded =
        call.Upload(task.positions.data(), task.positions.size() * sizeof(int64_t));
    if (!uploaded.ok()) return uploaded.status();
    positions = static_cast<const int64_t*>(*uploaded);
  }
  // The layer's ALiBi slopes (LayerConfig keeps them on the host) join the
  // device params; `routed` keeps the host pointer, which cuDNN refuses.
  if (p.alibi_slopes != nullptr) {
    absl::StatusOr<void*> slopes =
        call.Upload(p.alibi_slopes, static_cast<size_t>(p.num_heads) * sizeof(float));
    if (!slopes.ok()) return slopes.status();
    a.alibi_slopes = static_cast<const float*>(*slopes);
  }
  // The layer's sinks, relative bias table and relative position
  // embeddings (on the device) join the params; the route sees them.
  AttentionParams routed = p;
  if (config.sinks) a.sinks = routed.sinks = static_cast<const float*>(w.sinks.data());
  if (config.relative_bias_distance > 0) {
    a.relative_bias = routed.relative_bias = static_cast<const float*>(w.relative_bias.data());
    a.relative_bias_distance = routed.relative_bias_distance = config.relative_bias_distance;
  }
  if (const RelativeEmbeddings& r = config.relative_embeddings; r.distance > 0) {
    if (r.content_to_position) {
      a.relative_key = routed.relative_key = static_cast<const float*>(w.relative_key.data());
    }
    if (r.position_to_content) {
      a.relative_query = routed.relative_query =
          static_cast<const float*>(w.relative_query.data());
    }
    a.relative_embedding_distance = routed.relative_embedding_distance = r.distance;
  }
  // A session's request attends over its whole cache: a cuDNN plan of that
  // (a prefill or long append in bf16/fp16 precision), else none.
  const bool paged = task.paged.enabled();
  absl::StatusOr<SdpaRoute> route =
      paged ? RoutePagedPrefill(call, routed, task.paged, ct, /*token_layout=*/true)
            : RouteSdpa(call, routed, ct, /*token_layout=*/true);
  if (!route.ok()) return route.status();
  ATTNSERVE_CUDA_RETURN_IF_ERROR(call.UploadsDone());

  // Inputs in the compute type (self-attention converts once).
  absl::StatusOr<const void*> xq =
      ConvertOnDevice(call, *raw_q, in_type, ct, q_rows * config.query_dim);
  if (!xq.ok()) return xq.status();
  absl::StatusOr<const void*> xk = xq;
  absl::StatusOr<const void*> xv = xq;
  if (!self_attention) {
    xk = ConvertOnDevice(call, *raw_k, in_type, ct, kv_rows * key_dim);
    if (!xk.ok()) return xk.status();
    xv = ConvertOnDevice(call, *raw_v, in_type, ct, kv_rows * value_dim);
    if (!xv.ok()) return xv.status();
  }

  // The projections write B * L rows; a cuDNN plan of one sequence wants
  // its bucket's rows, the tail zeroed (RouteSdpa). A session's new K/V rows
  // go into its cache, and the plan reads the cache's gather.
  const int64_t q_buffer_rows = route->use ? p.batch * route->shape.q_rows : q_rows;
  const int64_t kv_buffer_rows =
      route->use && !paged ? p.batch * route->shape.kv_rows : kv_rows;
  const int64_t q_features = p.num_heads * p.head_dim;
  const int64_t kv_features = p.num_kv_heads * p.head_dim;
  const int64_t v_features = p.num_kv_heads * p.head_dim_v;
  auto projected = [&](int64_t rows, int64_t buffer_rows,
                       int64_t features) -> absl::StatusOr<void*> {
    absl::StatusOr<void*> buffer =
        call.DeviceAlloc(static_cast<size_t>(buffer_rows * features) * ct_size);
    if (!buffer.ok() || buffer_rows == rows) return buffer;
    ATTNSERVE_CUDA_CALL(cudaMemsetAsync(
        static_cast<char*>(*buffer) + static_cast<size_t>(rows * features) * ct_size, 0,
        static_cast<size_t>((buffer_rows - rows) * features) * ct_size, call.stream()));
    return buffer;
  };
  absl::StatusOr<void*> q = projected(q_rows, q_buffer_rows, q_features);
  if (!q.ok()) return q.status();
  absl::StatusOr<void*> k = projected(kv_rows, kv_buffer_rows, kv_features);
  if (!k.ok()) return k.status();
  absl::StatusOr<void*> v = projected(kv_rows, kv_buffer_rows, v_features);
  if (!v.ok()) return v.status();
  const int64_t cached_len = paged ? task.paged.cached_len : 0;
  const int64_t max_position = LargestRopePosition(task.positions, cached_len, p.kv_len);
  if (config.latent.enabled) {
    // Self-attention only (CheckTask): Q, K and V from the query's rows.
    ATTNSERVE_CUDA_RETURN_IF_ERROR(ProjectLatent(call, config, w, p, *xq, *q, *k, *v, positions,
                                                 cached_len, max_position));
  } else {
    ATTNSERVE_CUDA_RETURN_IF_ERROR(call.gemm().Linear(
        ct, *xq, q_rows, config.query_dim, w.wq.data(), w.bq.data(), q_features, *q));
    ATTNSERVE_CUDA_RETURN_IF_ERROR(call.gemm().Linear(ct, *xk, kv_rows, key_dim, w.wk.data(),
                                                      w.bk.data(), kv_features, *k));
    ATTNSERVE_CUDA_RETURN_IF_ERROR(call.gemm().Linear(ct, *xv, kv_rows, value_dim, w.wv.data(),
                                                      w.bv.data(), v_features, *v));
  }
  // Gated attention: sigmoid(x Wg^T + bg) of every query row, applied to the
  // attention output before the out-projection (in `finish`).
  void* gate = nullptr;
  if (config.output_gate) {
    absl::StatusOr<void*> g = call.DeviceAlloc(static_cast<size_t>(q_rows * q_features) * ct_size);
    if (!g.ok()) return g.status();
    gate = *g;
    ATTNSERVE_CUDA_RETURN_IF_ERROR(call.gemm().Linear(ct, *xq, q_rows, config.query_dim,
                                                      w.wg.data(), w.bg.data(), q_features,
                                                      gate));
  }
  if (!config.latent.enabled) {
    ATTNSERVE_CUDA_RETURN_IF_ERROR(
        PrepareQk(call, config, w, p, *q, *k, *v, positions, cached_len, max_position));
  }

  // Attention over the token layout [B, L, H*D], written in the same layout
  // (the out-projection reads the first B * Lq rows).
  const int64_t o_features = p.num_heads * p.head_dim_v;
  absl::StatusOr<void*> attn =
      call.DeviceAlloc(static_cast<size_t>(q_buffer_rows * o_features) * ct_size);
  if (!attn.ok()) return attn.status();
  a.dtype = ct;
  a.q = *q;
  a.k = *k;
  a.v = *v;
  a.out_dtype = ct;
  a.out = *attn;
  SetContiguousStrides(&a, TokenLayoutStrides);

  // Out-projection, then the output dtype, then home: after the attention,
  // which for a session's decode step is enqueued with the batch's others.
  // `call`, `config`, `w` and `task` outlive the Run.
  auto finish = [&call, &config, &w, &task, ct, ct_size, q_rows, o_features, gate,
                 attn = *attn]() -> absl::Status {
    if (gate != nullptr) {
      ATTNSERVE_CUDA_CALL(LaunchOutputGate(attn, gate, ct, q_rows * o_features, call.stream()));
    }
    absl::StatusOr<void*> y =
        call.DeviceAlloc(static_cast<size_t>(q_rows * config.out_dim) * ct_size);
    if (!y.ok()) return y.status();
    ATTNSERVE_CUDA_RETURN_IF_ERROR(call.gemm().Linear(ct, attn, q_rows, o_features, w.wo.data(),
                                                      w.bo.data(), config.out_dim, *y));
    const DType out_type = task.output.dtype;
    const int64_t out_n = q_rows * config.out_dim;
    absl::StatusOr<const void*> result = ConvertOnDevice(call, *y, ct, out_type, out_n);
    if (!result.ok()) return result.status();
    const size_t out_bytes = static_cast<size_t>(out_n) * DTypeSize(out_type);
    return call.DownloadTo(*result, out_bytes, task.output.data);
  };
  if (paged) {
    // Sessions: the projected K/V rows go into the cache, the attention
    // reads the whole cache (AttendPaged), along the route when there is one.
    return AttendPaged(call, task.paged, p, a, *route, decodes, std::move(finish));
  }
  ATTNSERVE_CUDA_RETURN_IF_ERROR(RunCore(call, a, p, *route));
  return finish();
}

absl::Status CheckPagedTask(const LayerConfig& config, const AttentionTask& task) {
  absl::StatusOr<AttentionParams> p = MakeCoreParams(config, task);
  if (!p.ok()) return p.status();
  ATTNSERVE_CUDA_RETURN_IF_ERROR(CheckPagedKv(task.paged, *p));
  if (task.paged.dtype == DType::kBool) {
    return absl::InvalidArgumentError("paged kv: the cache must hold a float dtype");
  }
  return absl::OkStatus();
}

absl::Status EnqueuePagedHostAttention(Call& call, const AttentionParams& p,
                                       const PagedKv& cache, PagedDecodes& decodes) {
  ATTNSERVE_CUDA_RETURN_IF_ERROR(RefuseHostTables(p));
  // cuDNN or not first: its plan wants the query and output at its bucket's
  // rows, and the upload writes that layout (the tail zeroed).
  absl::StatusOr<SdpaRoute> route =
      RoutePagedPrefill(call, p, cache, cache.dtype, /*token_layout=*/false);
  if (!route.ok()) return route.status();
  const int64_t q_rows = route->use ? route->shape.q_rows : p.q_len;
  absl::StatusOr<HeadUploads> in = UploadHeadLayout(call, p, q_rows, p.kv_len);
  if (!in.ok()) return in.status();

  // The new rows and the query in head layout [1, H, rows, D], the
  // request's dtype; the output [1, Hq, q_rows, Dv] in its output dtype.
  AttentionParams a = DeviceParams(p);
  a.dtype = p.dtype;
  a.q = in->q;
  a.k = in->k;
  a.v = in->v;
  a.out_dtype = p.out_dtype;
  absl::StatusOr<void*> out = call.DeviceAlloc(
      static_cast<size_t>(p.num_heads * q_rows * p.head_dim_v) * DTypeSize(a.out_dtype));
  if (!out.ok()) return out.status();
  a.out = *out;
  SetContiguousStrides(&a, HeadLayoutStrides);
  HeadLayoutStrides(p.num_heads, q_rows, p.head_dim, &a.q_stride_b, &a.q_stride_h,
                    &a.q_stride_row);
  HeadLayoutStrides(p.num_heads, q_rows, p.head_dim_v, &a.o_stride_b, &a.o_stride_h,
                    &a.o_stride_row);
  // `call` outlives the Run; p.out is the caller's until Finish.
  return AttendPaged(call, cache, p, a, *route, decodes,
                     [&call, out = a.out, p, q_rows]() -> absl::Status {
                       return DownloadHeadLayout(call, out, p, q_rows);
                     });
}

}  // namespace attnserve::cuda
