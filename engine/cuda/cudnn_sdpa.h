// cuDNN's fused scaled-dot-product attention (fp16/bf16 forward) for the CUDA
// engine, through the cuDNN frontend's graph API. libcudnn.so.9 is opened at
// run time: without it the module still loads and the engine's own kernels
// serve everything.
//
// Which requests cuDNN serves is decided in two steps. SdpaRefusal (host
// side, no GPU) rules out what cuDNN cannot compute exactly as
// attention_params.h defines it: rows that see no key (answered with zeros
// here, which cuDNN does not promise), fp32, head dims that are not
// multiples of 8, causal with Lq > Lk, softcapping, ALiBi (cuDNN's alibi
// mask has its own fixed slopes), a relative position bias (cuDNN takes no
// bias table, only a bias tensor the size of the scores), relative position
// embeddings (terms of the raw scores from per-distance tables), a sliding
// window other than with bottom-right causal alone (its diagonal band's
// left bound is aligned to the lengths cuDNN is given), sinks with a mask
// (its sink token, cuDNN 9.13 and newer), need_weights with sinks. Then
// cuDNN itself may refuse the graph (unsupported head dim, bias type, ...):
// the refusal is cached with its shape and the engine's kernels serve it.
//
// need_weights: the plan also writes each query row's softmax statistic,
// the log-sum-exp of its scaled, masked scores (SdpaArgs::stats); the
// engine then computes the probabilities from one GEMM of the scores and
// exp(score - statistic) (unfused_attention.h, EnqueueWeights).
//
// Plans are keyed by a shape bucket: the caller lays the data out with
// SdpaBucketLength rows per sequence (uploading into that layout, so no
// extra pass over the data) and the exact lengths reach cuDNN as sequence
// lengths (its padding mask). So a server that sees many lengths builds few
// plans.
#ifndef ATTNSERVE_ENGINE_CUDA_CUDNN_SDPA_H_
#define ATTNSERVE_ENGINE_CUDA_CUDNN_SDPA_H_

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "engine/attention_params.h"
#include "engine/cuda/device_memory.h"
#include "engine/dtype.h"

namespace attnserve::cuda {

// Where fused attention comes from, for every call of an engine. Read from
// $ATTNSERVE_CUDA_ATTENTION when the engine is made.
enum class AttentionSource {
  kAuto,     // "auto" (default): cuDNN where it takes the request, else our kernels
  kCudnn,    // "cudnn": cuDNN only; what it refuses is UNIMPLEMENTED with the reason
  kKernels,  // "kernels": the kernels written here only (flash_attention.cu, attention_general.cu)
};
absl::StatusOr<AttentionSource> ParseAttentionSource(const std::string& name);

// Opens libcudnn.so.9 once per process. Unavailable with the reason (the
// dlopen error, or a cuDNN older than 9.0) when it cannot be used; OK when
// it can. Thread-safe.
absl::Status CudnnAvailable();

// The bucket a sequence length is planned at: the next power of two up to
// 64, then the next multiple of a quarter of the power of two below it (at
// most 25% padding; 3 -> 4, 65 -> 80, 1000 -> 1024, 4097 -> 5120).
int64_t SdpaBucketLength(int64_t len);

// Why cuDNN cannot compute host-side request `p` (its masks and key lengths
// readable on the host) in `compute` exactly as attention_params.h defines
// it, or nullopt when it may. Costs at most one pass over the mask.
std::optional<std::string> SdpaRefusal(const AttentionParams& p, DType compute);

// True when some query row of host-side `p` sees no key (key length 0,
// causal with Lq > Lk, or a mask row that blocks every key the row may see).
bool SomeRowSeesNoKey(const AttentionParams& p);

// How one request is laid out for cuDNN: the shape its plan is built for.
struct SdpaShape {
  DType dtype = DType::kFloat16;  // Q, K, V and O
  int64_t batch = 0, heads = 0, kv_heads = 0, head_dim = 0, head_dim_v = 0;
  int64_t q_len = 0, kv_len = 0;    // exact
  int64_t q_rows = 0, kv_rows = 0;  // rows per sequence in the buffers (>= the lengths)
  bool token_layout = false;        // [B, rows, H * D] (else [B, H, rows, D]), contiguous
  bool causal = false;
  bool has_key_lengths = false;
  MaskParams::Kind mask = MaskParams::Kind::kNone;
  DType mask_dtype = DType::kFloat32;
  bool mask_per_batch = false, mask_per_head = false;  // else broadcast over that dim
  int64_t window = 0;  // > 0: sliding window (causal, no mask, no key lengths)
  bool sinks = false;  // one sink logit per query head (SdpaArgs::sinks)
  bool stats = false;  // also each row's log-sum-exp (SdpaArgs::stats)
};

// One request for CudnnSdpa::Enqueue, all pointers on the device. Q, K, V
// and O are contiguous in `shape`'s layout with q_rows / kv_rows rows per
// sequence; the rows past q_len / kv_len of K and V hold finite values
// (zeros: a masked score still multiplies its V row by 0), O's are written
// with values to ignore. `mask` has the broadcast strides of
// attention_params.h over the exact lengths.
struct SdpaArgs {
  SdpaShape shape;
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  void* out = nullptr;  // shape.dtype
  const int32_t* seq_len_q = nullptr;   // [batch]: q_len each; needed when the plan pads
  const int32_t* seq_len_kv = nullptr;  // [batch]: key_lengths or kv_len; likewise
  MaskParams mask;
  float scale = 1.0f;
  const float* sinks = nullptr;  // [heads] FLOAT32 when shape.sinks
  // When shape.stats: [batch, heads, q_rows] FLOAT32, row i of (b, h) gets
  // ln(sum_j exp(t_j)) over the scores t_j = scale * q.k_j (+ mask) of the
  // keys it sees (rows past q_len: values to ignore).
  float* stats = nullptr;
};

// A cuDNN handle and the plans built with it. One per engine workspace, used
// by one call at a time (not thread-safe). Create and use with the engine's
// device current.
class CudnnSdpa {
 public:
  // Unavailable when CudnnAvailable() is not OK. `max_plans` bounds the plan
  // cache (least recently used out first); refusals are cached alongside.
  static absl::StatusOr<std::unique_ptr<CudnnSdpa>> Create(size_t max_plans);
  ~CudnnSdpa();

  // Whether the plan for this request masks padding (rows past the lengths,
  // or key lengths), so that the caller stages SdpaArgs::seq_len_q/kv.
  static bool NeedsSequenceLengths(const SdpaShape& shape);

  // Enqueues the request on `stream`. Device scratch (the expanded mask,
  // cuDNN's workspace) comes from `alloc`, valid until the stream has run.
  // Returns:
  //   OK            enqueued;
  //   Unimplemented cuDNN refuses this shape (message: its reason); nothing
  //                 was enqueued, the caller computes it another way;
  //   other         a CUDA or cuDNN failure.
  absl::Status Enqueue(const SdpaArgs& args, DeviceAllocator alloc, cudaStream_t stream);

 private:
  struct Impl;
  explicit CudnnSdpa(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace attnserve::cuda

#endif  // ATTNSERVE_ENGINE_CUDA_CUDNN_SDPA_H_
