// Moving data between the host and the GPU for the CUDA engine: a call's
// streams and arenas (Workspace), its uploads through pinned memory and its
// downloads into caller-owned buffers (Call), and a layer's weights made
// resident on the device once (DeviceLayer).
#ifndef ATTNSERVE_ENGINE_CUDA_STAGING_H_
#define ATTNSERVE_ENGINE_CUDA_STAGING_H_

#include <cuda_runtime_api.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "engine/attention_layer.h"
#include "engine/attention_params.h"
#include "engine/cuda/attention_kernels.h"
#include "engine/cuda/cudnn_sdpa.h"
#include "engine/cuda/device_memory.h"
#include "engine/cuda/projection_gemm.h"
#include "engine/cuda/unfused_attention.h"
#include "engine/dtype.h"
#include "engine/host_buffer.h"

namespace attnserve::cuda {

// The streams of one call and the memory it stages through. Owned by the
// engine's pool; used by one call at a time. Create and use it with the
// engine's device current.
struct Workspace {
  // Non-blocking streams, so that they never synchronise implicitly with
  // the legacy default stream. A workspace of source kAuto or kCudnn gets a
  // cuDNN handle when cuDNN is available (kCudnn requires it).
  static absl::StatusOr<std::unique_ptr<Workspace>> Create(AttentionSource source,
                                                           bool experimental_fused);
  ~Workspace();  // waits for both streams

  cudaStream_t stream = nullptr;           // compute
  cudaStream_t copy_stream = nullptr;      // uploads
  cudaStream_t download_stream = nullptr;  // downloads, after the compute they read
  cudaEvent_t uploaded = nullptr;          // recorded on copy_stream after a request's uploads
  // Recorded on `stream` before each download, which download_stream waits
  // for: so request n's download overlaps request n+1's compute (the GPU's
  // two copy engines and its SMs all busy).
  std::vector<cudaEvent_t> computed;
  std::unique_ptr<ProjectionGemm> gemm;
  AttentionSource source = AttentionSource::kAuto;
  // ATTNSERVE_CUDA_EXPERIMENTAL_FUSED=1: the fused kernels also serve what
  // no GPU run has verified yet (dispatch.cc, RunCore).
  bool experimental_fused = false;
  int max_shared_bytes = 0;  // the device's shared memory per block (opt-in)
  std::unique_ptr<CudnnSdpa> sdpa;  // null: our kernels only
  std::unique_ptr<UnfusedAttention> unfused;
  Arena device{Arena::Kind::kDevice};
  Arena pinned{Arena::Kind::kPinnedHost};
  // The engine's request memory (page-locked; AttentionEngine::request_memory):
  // an input or result that lies in one of its buffers is copied between it
  // and the device in place, not through `pinned`. Not owned; null: every
  // input and result goes through `pinned`.
  const HostBufferPool* request_memory = nullptr;
  // ATTNSERVE_CUDA_PROFILE=1 when the workspace was made: each call
  // measures where its time goes (Call, below) and reports it on stderr.
  bool profile = false;
  std::vector<cudaEvent_t> events;  // timing events, reused by every call
};

// One Run/Attend call on a workspace: allocations from its arenas, copies
// through pinned memory, and the host-side deliveries that run once the
// streams have finished. Per request: Upload*, then UploadsDone, then
// compute on stream() and DownloadRows* (which runs on the download stream once
// the compute enqueued before it is done). If the call is abandoned on an
// error, the destructor still waits for the streams before the memory is
// reused.
//
// Not thread-safe; borrows the workspace for its lifetime. Host buffers
// passed to Upload* are read before the method returns, except those in the
// workspace's request_memory, which the copy engine reads in place until
// Finish; those a DownloadRows* delivers into must stay alive until Finish.
//
// With the workspace's `profile` on, a call times its parts with CUDA events
// and Finish prints one line on stderr:
//   attnserve: cuda call: requests N upload_ms U download_ms D compute_ms C call_ms T
// U and D: the copies' time on the device; C: the compute stream's work
// outside its waits for uploads (kernels, GEMMs, device copies); T: the
// host's time from the call's start to the end of Finish, so T - max(U, C,
// D) is at least what the host spent outside them (packing, launches,
// waits, deliveries). bench/gpu_session.sh serve reads these lines.
class Call {
 public:
  explicit Call(Workspace& ws);
  ~Call();
  Call(const Call&) = delete;
  Call& operator=(const Call&) = delete;

  cudaStream_t stream() const { return ws_.stream; }
  ProjectionGemm& gemm() { return *ws_.gemm; }
  AttentionSource attention_source() const { return ws_.source; }
  bool experimental_fused() const { return ws_.experimental_fused; }
  int max_shared_bytes() const { return ws_.max_shared_bytes; }
  CudnnSdpa* sdpa() { return ws_.sdpa.get(); }
  UnfusedAttention& unfused() { return *ws_.unfused; }

  // Device memory valid until Finish (or the call's end).
  absl::StatusOr<void*> DeviceAlloc(size_t bytes) { return ws_.device.Allocate(bytes); }

  // Copies `bytes` of host memory to a new device allocation (on the copy
  // stream: compute may use it after UploadsDone).
  absl::StatusOr<void*> Upload(const void* host, size_t bytes);

  // Packs a strided [B, H, L, D] view (element strides, last dim contiguous)
  // into a contiguous device copy [B, H, rows, D], rows >= L: the rows past
  // L are zeros (the layout of a cuDNN plan's bucket; no extra pass).
  absl::StatusOr<void*> UploadHeads(const void* host, size_t elem_size, int64_t batch,
                                    int64_t heads, int64_t len, int64_t dim, int64_t stride_b,
                                    int64_t stride_h, int64_t stride_row, int64_t rows);

  // Makes work enqueued on stream() from now on wait for every upload so far.
  absl::Status UploadsDone();

  // Copies `count` rows of `row_bytes` that lie `pitch` bytes apart on the
  // device to pinned memory; `deliver` gets them packed after the streams
  // have finished (in Finish).
  absl::Status DownloadRows(const void* device, size_t row_bytes, size_t pitch, size_t count,
                            std::function<void(const char* pinned)> deliver);

  // Copies `count` rows of `row_bytes`, `pitch` bytes apart on the device,
  // packed into caller-owned `host` (valid until Finish): straight into it
  // when it lies in the workspace's page-locked request memory, else through
  // pinned staging and a copy in Finish.
  absl::Status DownloadRowsTo(const void* device, size_t row_bytes, size_t pitch, size_t count,
                              void* host);
  absl::Status DownloadTo(const void* device, size_t bytes, void* host) {
    return DownloadRowsTo(device, bytes, bytes, 1, host);
  }

  // Waits for the streams, then hands every result to its caller-owned buffer.
  absl::Status Finish();

  // How many requests the call serves (for the profile line).
  void set_requests(int requests) { requests_ = requests; }

 private:
  absl::StatusOr<void*> UploadStaged(const void* staging, size_t bytes);

  // Whether `host` can be the source of an asynchronous upload as it is (it
  // lies in the workspace's page-locked request memory).
  bool InRequestMemory(const void* host, size_t bytes) const {
    return ws_.request_memory != nullptr && ws_.request_memory->Contains(host, bytes);
  }

  // Enqueues on the download stream, after the compute enqueued so far, the
  // copy of `count` rows of `row_bytes` (`pitch` apart on the device) packed
  // into page-locked `host`.
  absl::Status CopyDown(void* host, const void* device, size_t row_bytes, size_t pitch,
                        size_t count);

  // Profiling (ws_.profile): events from the workspace's pool, marks on the
  // compute stream in order, the copies' start and end on their streams.
  enum class Mark { kRun, kWait, kEnd };
  cudaEvent_t NextEvent();
  void MarkCompute(Mark mark);
  cudaEvent_t MarkStart(cudaStream_t stream);
  void MarkEnd(cudaStream_t stream, cudaEvent_t start,
               std::vector<std::pair<cudaEvent_t, cudaEvent_t>>* spans);
  void PrintProfile();

  Workspace& ws_;
  std::vector<std::function<void()>> deliveries_;
  bool finished_ = false;
  int requests_ = 0;
  size_t computed_used_ = 0;  // of ws_.computed
  size_t events_used_ = 0;
  std::vector<std::pair<Mark, cudaEvent_t>> compute_marks_;
  std::vector<std::pair<cudaEvent_t, cudaEvent_t>> upload_spans_, download_spans_;
  std::chrono::steady_clock::time_point start_;
};

// Uploads the key lengths and the mask's extent of host-side `p` and points
// device-side `a` at them (before the request's UploadsDone). The mask keeps
// p's kind, dtype and broadcast strides.
absl::Status StageMaskAndLengths(Call& call, const AttentionParams& p, AttentionParams& a);

// The dtype a layer of `precision` computes in.
DType PrecisionDType(Precision precision);

// A layer's weights on the device, in the layer's precision. Biases are null
// when the layer has none. Immutable once made; shared by concurrent calls.
struct DeviceLayer {
  uint64_t layer_id = 0;  // LayerId of the layer it was made from
  DType type = DType::kFloat32;  // PrecisionDType(layer.config.precision)
  DeviceBuffer wq, bq, wk, bk, wv, bv, wo, bo;
  DeviceBuffer wg, bg;  // the output gate's, when the layer has one
  // A latent layer's (LatentAttention): the query latent's wq_a, bq_a; the
  // first kv_lora_rank rows of wkv_a (and bkv_a) as wkv_c, bkv_c, its last
  // rope_dim rows as wk_rope, bk_rope, so that each GEMM writes a contiguous
  // output; the two RMSNorm weights in FLOAT32.
  DeviceBuffer wq_a, bq_a, wkv_c, bkv_c, wk_rope, bk_rope;
  DeviceBuffer q_a_norm, kv_a_norm;
  // FLOAT32 whatever the precision, as the cpu engine reads them: the
  // QK-norm weights [head_dim], the sinks [num_heads], the relative
  // position bias table [num_heads, 2 * relative_bias_distance + 1] and the
  // relative position embeddings' tables relative_key and relative_query
  // [num_heads, head_dim, 2 * relative_embeddings.distance + 1], when the
  // layer has them.
  DeviceBuffer q_norm, k_norm, sinks, relative_bias, relative_key, relative_query;
  // RoPE: the inverse frequencies (float64, engine/rope.h), when the layer
  // rotates; LongRoPE's long set beside them (its short set in inv_freq),
  // which a call takes when its largest position asks (RopeUsesLongFactors).
  DeviceBuffer inv_freq, long_inv_freq;
  double attention_factor = 1.0;
};

// Uploads `layer`'s FLOAT32 weights converted to its precision (the QK-norm
// weights, sinks, relative bias table and relative position embeddings as
// they are, RoPE's frequencies in float64), synchronously on `stream` (done
// once per layer). InvalidArgument for weights of another dtype.
absl::StatusOr<std::unique_ptr<DeviceLayer>> UploadLayer(const AttentionLayer& layer,
                                                         cudaStream_t stream);

}  // namespace attnserve::cuda

#endif  // ATTNSERVE_ENGINE_CUDA_STAGING_H_
