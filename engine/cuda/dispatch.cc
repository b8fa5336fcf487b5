// Per-request dispatch of the CUDA engine: device-side AttentionParams built
// from the host-side ones, the fused or the general attention kernel, the
// cuBLASLt projections around it, dtype conversions and the head average of
// the weights.
#include "engine/cuda/dispatch.h"

#include <cstring>

#include "engine/cuda/attention_kernels.h"
#include "engine/cuda/cuda_status.h"

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

// The device-side params of host-side `p`: its dims, causal flag and scale.
// Every pointer, dtype and stride is left for the caller to set.
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
  a.scale = p.scale;
  return a;
}

// Runs the attention core for device-side `a` (inputs, output, mask already
// set) and, when `p` asks for weights, downloads them into p.weights.
absl::Status RunCore(Call& call, AttentionParams& a, const AttentionParams& p) {
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

  if (FlashAttentionSupports(a)) {
    ATTNSERVE_CUDA_CALL(LaunchFlashAttention(a, call.stream()));
  } else {
    ATTNSERVE_CUDA_CALL(LaunchAttentionGeneral(a, call.stream()));
  }

  if (weights == nullptr) return absl::OkStatus();
  if (p.average_weights) {
    ATTNSERVE_CUDA_CALL(LaunchAverageHeads(static_cast<const float*>(a.weights), p.batch,
                                           p.num_heads, p.q_len * p.kv_len, weights,
                                           p.weights_dtype, call.stream()));
  }
  void* host = p.weights;
  return call.Download(weights, weights_bytes, [host, weights_bytes](const char* pinned) {
    std::memcpy(host, pinned, weights_bytes);
  });
}

}  // namespace

absl::Status EnqueueHostAttention(Call& call, const AttentionParams& p, DType compute) {
  const DType in_type = p.dtype;
  const size_t in_size = DTypeSize(in_type);
  absl::StatusOr<void*> q =
      call.UploadHeads(p.q, in_size, p.batch, p.num_heads, p.q_len, p.head_dim, p.q_stride_b,
                       p.q_stride_h, p.q_stride_row);
  if (!q.ok()) return q.status();
  absl::StatusOr<void*> k =
      call.UploadHeads(p.k, in_size, p.batch, p.num_kv_heads, p.kv_len, p.head_dim, p.k_stride_b,
                       p.k_stride_h, p.k_stride_row);
  if (!k.ok()) return k.status();
  absl::StatusOr<void*> v =
      call.UploadHeads(p.v, in_size, p.batch, p.num_kv_heads, p.kv_len, p.head_dim_v,
                       p.v_stride_b, p.v_stride_h, p.v_stride_row);
  if (!v.ok()) return v.status();

  AttentionParams a = DeviceParams(p);
  ATTNSERVE_CUDA_RETURN_IF_ERROR(StageMaskAndLengths(call, p, a));
  ATTNSERVE_CUDA_RETURN_IF_ERROR(call.UploadsDone());
  a.dtype = compute;
  absl::StatusOr<const void*> qc =
      ConvertOnDevice(call, *q, in_type, compute, p.batch * p.num_heads * p.q_len * p.head_dim);
  if (!qc.ok()) return qc.status();
  absl::StatusOr<const void*> kc = ConvertOnDevice(
      call, *k, in_type, compute, p.batch * p.num_kv_heads * p.kv_len * p.head_dim);
  if (!kc.ok()) return kc.status();
  absl::StatusOr<const void*> vc = ConvertOnDevice(
      call, *v, in_type, compute, p.batch * p.num_kv_heads * p.kv_len * p.head_dim_v);
  if (!vc.ok()) return vc.status();
  a.q = *qc;
  a.k = *kc;
  a.v = *vc;

  // The output comes back contiguous and is scattered into p.out's strides.
  a.out_dtype = p.out_dtype;
  const size_t out_size = DTypeSize(a.out_dtype);
  const size_t out_bytes =
      static_cast<size_t>(p.batch * p.num_heads * p.q_len * p.head_dim_v) * out_size;
  absl::StatusOr<void*> out = call.DeviceAlloc(out_bytes);
  if (!out.ok()) return out.status();
  a.out = *out;
  SetContiguousStrides(&a, HeadLayoutStrides);
  ATTNSERVE_CUDA_RETURN_IF_ERROR(RunCore(call, a, p));

  return call.Download(a.out, out_bytes, [p, out_size](const char* pinned) {
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

absl::Status EnqueueProjected(Call& call, const LayerConfig& config, const DeviceLayer& w,
                              const AttentionTask& task, const AttentionParams& p) {
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

  const int64_t q_features = p.num_heads * p.head_dim;
  const int64_t kv_features = p.num_kv_heads * p.head_dim;
  const int64_t v_features = p.num_kv_heads * p.head_dim_v;
  absl::StatusOr<void*> q = call.DeviceAlloc(static_cast<size_t>(q_rows * q_features) * ct_size);
  if (!q.ok()) return q.status();
  absl::StatusOr<void*> k = call.DeviceAlloc(static_cast<size_t>(kv_rows * kv_features) * ct_size);
  if (!k.ok()) return k.status();
  absl::StatusOr<void*> v = call.DeviceAlloc(static_cast<size_t>(kv_rows * v_features) * ct_size);
  if (!v.ok()) return v.status();
  ATTNSERVE_CUDA_RETURN_IF_ERROR(call.gemm().Linear(ct, *xq, q_rows, config.query_dim,
                                                    w.wq.data(), w.bq.data(), q_features, *q));
  ATTNSERVE_CUDA_RETURN_IF_ERROR(
      call.gemm().Linear(ct, *xk, kv_rows, key_dim, w.wk.data(), w.bk.data(), kv_features, *k));
  ATTNSERVE_CUDA_RETURN_IF_ERROR(
      call.gemm().Linear(ct, *xv, kv_rows, value_dim, w.wv.data(), w.bv.data(), v_features, *v));

  // Attention over the token layout [B, L, H*D], written in the same layout.
  const int64_t o_features = p.num_heads * p.head_dim_v;
  absl::StatusOr<void*> attn = call.DeviceAlloc(static_cast<size_t>(q_rows * o_features) * ct_size);
  if (!attn.ok()) return attn.status();
  a.dtype = ct;
  a.q = *q;
  a.k = *k;
  a.v = *v;
  a.out_dtype = ct;
  a.out = *attn;
  SetContiguousStrides(&a, TokenLayoutStrides);
  ATTNSERVE_CUDA_RETURN_IF_ERROR(RunCore(call, a, p));

  // Out-projection, then the output dtype, then home.
  absl::StatusOr<void*> y =
      call.DeviceAlloc(static_cast<size_t>(q_rows * config.out_dim) * ct_size);
  if (!y.ok()) return y.status();
  ATTNSERVE_CUDA_RETURN_IF_ERROR(call.gemm().Linear(ct, *attn, q_rows, o_features, w.wo.data(),
                                                    w.bo.data(), config.out_dim, *y));
  const DType out_type = task.output.dtype;
  const int64_t out_n = q_rows * config.out_dim;
  absl::StatusOr<const void*> result = ConvertOnDevice(call, *y, ct, out_type, out_n);
  if (!result.ok()) return result.status();
  const size_t out_bytes = static_cast<size_t>(out_n) * DTypeSize(out_type);
  void* host = task.output.data;
  return call.Download(*result, out_bytes, [host, out_bytes](const char* pinned) {
    std::memcpy(host, pinned, out_bytes);
  });
}

}  // namespace attnserve::cuda
