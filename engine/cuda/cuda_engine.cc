// The CUDA engine: stages each request through pinned memory onto the
// device, runs the projections (cuBLASLt) and the attention kernels, and
// copies the results back. A whole batch is enqueued before the one
// synchronisation at its end: uploads go on a copy stream and compute waits
// for each request's uploads through an event, so while the GPU computes
// request n the host packs request n+1 and the copy engine uploads it.
// Requests never share a launch: each request's kernels and GEMM shapes
// depend on that request alone, which is what makes results batch-invariant.
#include "engine/cuda/cuda_engine.h"

#include <cuda_runtime_api.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "engine/attention_params_check.h"
#include "engine/attention_task.h"
#include "engine/cuda/attention_kernels.h"
#include "engine/cuda/cuda_status.h"
#include "engine/cuda/device_memory.h"
#include "engine/cuda/projection_gemm.h"

namespace attnserve::cuda {
namespace {

static_assert(static_cast<int>(DType::kFloat32) == static_cast<int>(ElemType::kF32));
static_assert(static_cast<int>(DType::kFloat16) == static_cast<int>(ElemType::kF16));
static_assert(static_cast<int>(DType::kBFloat16) == static_cast<int>(ElemType::kBF16));
static_assert(static_cast<int>(DType::kBool) == static_cast<int>(ElemType::kBool));

ElemType ToElem(DType dtype) { return static_cast<ElemType>(dtype); }

size_t ElemSize(ElemType type) {
  switch (type) {
    case ElemType::kF32:
      return 4;
    case ElemType::kF16:
    case ElemType::kBF16:
      return 2;
    case ElemType::kBool:
      return 1;
  }
  return 0;
}

ElemType PrecisionType(Precision precision) {
  switch (precision) {
    case Precision::kBFloat16:
      return ElemType::kBF16;
    case Precision::kFloat16:
      return ElemType::kF16;
    case Precision::kFloat32:
      break;
  }
  return ElemType::kF32;
}

// The streams of one call and the memory it stages through. Owned by the
// engine's pool; one call at a time.
struct Workspace {
  cudaStream_t stream = nullptr;       // compute and downloads
  cudaStream_t copy_stream = nullptr;  // uploads
  cudaEvent_t uploaded = nullptr;      // recorded on copy_stream after a request's uploads
  std::unique_ptr<ProjectionGemm> gemm;
  Arena device{Arena::Kind::kDevice};
  Arena pinned{Arena::Kind::kPinnedHost};

  ~Workspace() {
    if (copy_stream != nullptr) (void)cudaStreamSynchronize(copy_stream);
    if (stream != nullptr) (void)cudaStreamSynchronize(stream);
    gemm.reset();
    if (uploaded != nullptr) (void)cudaEventDestroy(uploaded);
    if (copy_stream != nullptr) (void)cudaStreamDestroy(copy_stream);
    if (stream != nullptr) (void)cudaStreamDestroy(stream);
  }
};

// One Run/Attend call on a workspace: allocations from its arenas, copies
// through pinned memory, and the host-side deliveries that run once the
// streams have finished. Per request: Upload*, then UploadsDone, then
// compute and Download on stream(). If the call is abandoned on an error,
// the destructor still waits for both streams before the memory is reused.
class Call {
 public:
  explicit Call(Workspace& ws) : ws_(ws) {}
  ~Call() {
    if (!finished_) {
      (void)cudaStreamSynchronize(ws_.copy_stream);
      (void)cudaStreamSynchronize(ws_.stream);
      (void)cudaGetLastError();
      ws_.device.Reset();
      ws_.pinned.Reset();
    }
  }
  Call(const Call&) = delete;
  Call& operator=(const Call&) = delete;

  cudaStream_t stream() const { return ws_.stream; }
  ProjectionGemm& gemm() { return *ws_.gemm; }

  absl::StatusOr<void*> DeviceAlloc(size_t bytes) { return ws_.device.Allocate(bytes); }

  // Copies `bytes` of host memory to a new device allocation (on the copy
  // stream: compute may use it after UploadsDone).
  absl::StatusOr<void*> Upload(const void* host, size_t bytes) {
    absl::StatusOr<void*> staging = ws_.pinned.Allocate(bytes);
    if (!staging.ok()) return staging.status();
    std::memcpy(*staging, host, bytes);
    return UploadStaged(*staging, bytes);
  }

  // Packs a strided [B, H, L, D] view (element strides, last dim contiguous)
  // into a contiguous device copy.
  absl::StatusOr<void*> UploadHeads(const void* host, size_t elem_size, int64_t batch,
                                    int64_t heads, int64_t len, int64_t dim, int64_t stride_b,
                                    int64_t stride_h, int64_t stride_row) {
    const size_t bytes = static_cast<size_t>(batch * heads * len * dim) * elem_size;
    absl::StatusOr<void*> staging = ws_.pinned.Allocate(bytes);
    if (!staging.ok()) return staging.status();
    const bool contiguous = stride_row == dim && (heads == 1 || stride_h == len * dim) &&
                            (batch == 1 || stride_b == heads * len * dim);
    if (contiguous) {
      std::memcpy(*staging, host, bytes);
    } else {
      const size_t row_bytes = static_cast<size_t>(dim) * elem_size;
      char* dst = static_cast<char*>(*staging);
      const char* src = static_cast<const char*>(host);
      for (int64_t b = 0; b < batch; ++b)
        for (int64_t h = 0; h < heads; ++h)
          for (int64_t i = 0; i < len; ++i) {
            std::memcpy(dst, src + (b * stride_b + h * stride_h + i * stride_row) * elem_size,
                        row_bytes);
            dst += row_bytes;
          }
    }
    return UploadStaged(*staging, bytes);
  }

  // Makes work enqueued on stream() from now on wait for every upload so far.
  absl::Status UploadsDone() {
    ATTNSERVE_CUDA_CALL(cudaEventRecord(ws_.uploaded, ws_.copy_stream));
    ATTNSERVE_CUDA_CALL(cudaStreamWaitEvent(ws_.stream, ws_.uploaded, 0));
    return absl::OkStatus();
  }

  // Copies `bytes` from the device to pinned memory; `deliver` gets the
  // pinned copy after the stream has finished (in Finish).
  absl::Status Download(const void* device, size_t bytes,
                        std::function<void(const char* pinned)> deliver) {
    absl::StatusOr<void*> staging = ws_.pinned.Allocate(bytes);
    if (!staging.ok()) return staging.status();
    ATTNSERVE_CUDA_CALL(
        cudaMemcpyAsync(*staging, device, bytes, cudaMemcpyDeviceToHost, ws_.stream));
    const char* pinned = static_cast<const char*>(*staging);
    deliveries_.push_back([pinned, deliver = std::move(deliver)] { deliver(pinned); });
    return absl::OkStatus();
  }

  // Waits for the streams, then hands every result to its caller-owned buffer.
  absl::Status Finish() {
    ATTNSERVE_CUDA_CALL(cudaStreamSynchronize(ws_.copy_stream));
    ATTNSERVE_CUDA_CALL(cudaStreamSynchronize(ws_.stream));
    for (const std::function<void()>& deliver : deliveries_) deliver();
    finished_ = true;
    ws_.device.Reset();
    ws_.pinned.Reset();
    return absl::OkStatus();
  }

 private:
  absl::StatusOr<void*> UploadStaged(void* staging, size_t bytes) {
    absl::StatusOr<void*> device = ws_.device.Allocate(bytes);
    if (!device.ok()) return device.status();
    ATTNSERVE_CUDA_CALL(
        cudaMemcpyAsync(*device, staging, bytes, cudaMemcpyHostToDevice, ws_.copy_stream));
    return *device;
  }

  Workspace& ws_;
  std::vector<std::function<void()>> deliveries_;
  bool finished_ = false;
};

// A layer's weights on the device, in the layer's precision. Biases are null
// when the layer has none.
struct DeviceLayer {
  const void* source = nullptr;  // the host wq it was made from (detects address reuse)
  Precision precision = Precision::kFloat32;
  ElemType type = ElemType::kF32;
  DeviceBuffer wq, bq, wk, bk, wv, bv, wo, bo;
};

// Converts `n` elements of type `from` already on the device to `to`, into a
// new arena allocation (or returns `data` when the types match).
absl::StatusOr<const void*> ConvertOnDevice(Call& call, const void* data, ElemType from,
                                            ElemType to, int64_t n) {
  if (from == to) return data;
  absl::StatusOr<void*> out = call.DeviceAlloc(static_cast<size_t>(n) * ElemSize(to));
  if (!out.ok()) return out.status();
  ATTNSERVE_CUDA_CALL(LaunchConvert(data, from, *out, to, n, call.stream()));
  return static_cast<const void*>(*out);
}

// Uploads the mask's extent and the key lengths of `p` and points `a` at
// them (before the request's UploadsDone).
absl::Status StageMaskAndLengths(Call& call, const AttentionParams& p, DeviceAttention& a) {
  a.causal = p.causal;
  a.scale = p.scale;
  if (p.key_lengths != nullptr) {
    absl::StatusOr<void*> lengths =
        call.Upload(p.key_lengths, static_cast<size_t>(p.batch) * sizeof(int64_t));
    if (!lengths.ok()) return lengths.status();
    a.key_lengths = static_cast<const int64_t*>(*lengths);
  }
  if (p.mask.kind != MaskParams::Kind::kNone) {
    // The mask is a dense tensor read through broadcast strides: its extent
    // is one past the largest index any (b, h, i, j) reaches.
    const int64_t last = (p.batch - 1) * p.mask.stride_b + (p.num_heads - 1) * p.mask.stride_h +
                         (p.q_len - 1) * p.mask.stride_q + (p.kv_len - 1) * p.mask.stride_k;
    const size_t bytes = static_cast<size_t>(last + 1) * DTypeSize(p.mask.dtype);
    absl::StatusOr<void*> mask = call.Upload(p.mask.data, bytes);
    if (!mask.ok()) return mask.status();
    a.mask.kind = p.mask.kind == MaskParams::Kind::kBool ? MaskKind::kBool : MaskKind::kAdditive;
    a.mask.type = ToElem(p.mask.dtype);
    a.mask.data = *mask;
    a.mask.stride_b = p.mask.stride_b;
    a.mask.stride_h = p.mask.stride_h;
    a.mask.stride_q = p.mask.stride_q;
    a.mask.stride_k = p.mask.stride_k;
  }
  return absl::OkStatus();
}

// Runs the attention core for device-side `a` (inputs, output, mask already
// set) and, when `p` asks for weights, downloads them into p.weights.
absl::Status RunCore(Call& call, DeviceAttention& a, const AttentionParams& p) {
  void* weights = nullptr;  // final device weights, in p.weights_dtype
  size_t weights_bytes = 0;
  if (p.weights != nullptr) {
    const int64_t per_head = p.batch * p.num_heads * p.q_len * p.kv_len;
    const ElemType weights_type = ToElem(p.weights_dtype);
    if (p.average_weights) {
      // Per-head probabilities in fp32 first, then a deterministic mean.
      absl::StatusOr<void*> probs = call.DeviceAlloc(static_cast<size_t>(per_head) * 4);
      if (!probs.ok()) return probs.status();
      a.weights = *probs;
      a.weights_type = ElemType::kF32;
      weights_bytes = static_cast<size_t>(p.batch * p.q_len * p.kv_len) * ElemSize(weights_type);
    } else {
      weights_bytes = static_cast<size_t>(per_head) * ElemSize(weights_type);
    }
    absl::StatusOr<void*> out = call.DeviceAlloc(weights_bytes);
    if (!out.ok()) return out.status();
    weights = *out;
    if (!p.average_weights) {
      a.weights = weights;
      a.weights_type = weights_type;
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
                                           ToElem(p.weights_dtype), call.stream()));
  }
  void* host = p.weights;
  return call.Download(weights, weights_bytes, [host, weights_bytes](const char* pinned) {
    std::memcpy(host, pinned, weights_bytes);
  });
}

// The engines' shared guard on bare AttentionParams, plus what the kernels
// additionally rely on (the server validates requests; this keeps a bad
// call from touching memory out of bounds).
absl::Status CheckParams(const AttentionParams& p) {
  ATTNSERVE_CUDA_RETURN_IF_ERROR(CheckAttentionParams(p));
  if ((p.mask.kind == MaskParams::Kind::kBool && p.mask.dtype != DType::kBool) ||
      p.mask.stride_b < 0 || p.mask.stride_h < 0 || p.mask.stride_q < 0 || p.mask.stride_k < 0) {
    return absl::InvalidArgumentError(
        "AttentionParams: a bool mask must be BOOL and mask strides must be >= 0");
  }
  if (!std::isfinite(p.scale) || p.scale <= 0.0f) {
    return absl::InvalidArgumentError(
        absl::StrCat("AttentionParams: scale must be finite and > 0, got ", p.scale));
  }
  return absl::OkStatus();
}

class CudaEngine final : public AttentionEngine {
 public:
  explicit CudaEngine(int device) : device_(device) {}
  ~CudaEngine() override {
    (void)cudaSetDevice(device_);
    idle_.clear();
    layers_.clear();
  }

  std::string_view name() const override { return "cuda"; }

  absl::Status Attend(absl::Span<const AttentionParams> batch) override {
    for (const AttentionParams& p : batch) ATTNSERVE_CUDA_RETURN_IF_ERROR(CheckParams(p));
    ATTNSERVE_CUDA_CALL(cudaSetDevice(device_));
    absl::StatusOr<Lease> ws = Acquire();
    if (!ws.ok()) return ws.status();
    Call call(*ws->get());
    for (const AttentionParams& p : batch) {
      ATTNSERVE_CUDA_RETURN_IF_ERROR(EnqueueHostAttention(call, p, ToElem(p.dtype)));
    }
    return call.Finish();
  }

  absl::Status Run(const AttentionLayer& layer, absl::Span<const AttentionTask> batch) override {
    const LayerConfig& config = layer.config;
    for (const AttentionTask& task : batch) {
      ATTNSERVE_CUDA_RETURN_IF_ERROR(CheckTask(config, task));
    }
    ATTNSERVE_CUDA_CALL(cudaSetDevice(device_));
    absl::StatusOr<Lease> ws = Acquire();
    if (!ws.ok()) return ws.status();
    const DeviceLayer* weights = nullptr;
    if (config.has_projections) {
      absl::StatusOr<const DeviceLayer*> uploaded = GetDeviceLayer(layer, *ws->get());
      if (!uploaded.ok()) return uploaded.status();
      weights = *uploaded;
    }
    Call call(*ws->get());
    for (const AttentionTask& task : batch) {
      absl::StatusOr<AttentionParams> params = MakeCoreParams(config, task);
      if (!params.ok()) return params.status();
      if (!config.has_projections) {
        // Bare attention computes in the inputs' dtype unless the layer asks
        // for a lower precision.
        const ElemType compute = config.precision == Precision::kFloat32
                                     ? ToElem(params->dtype)
                                     : PrecisionType(config.precision);
        ATTNSERVE_CUDA_RETURN_IF_ERROR(EnqueueHostAttention(call, *params, compute));
      } else {
        ATTNSERVE_CUDA_RETURN_IF_ERROR(EnqueueProjected(call, config, *weights, task, *params));
      }
    }
    return call.Finish();
  }

 private:
  // A workspace borrowed from the pool; returned on destruction.
  class Lease {
   public:
    Lease(CudaEngine* engine, std::unique_ptr<Workspace> ws)
        : engine_(engine), ws_(std::move(ws)) {}
    Lease(Lease&&) = default;
    Lease& operator=(Lease&&) = default;
    ~Lease() {
      if (ws_ != nullptr) engine_->Release(std::move(ws_));
    }
    Workspace* get() const { return ws_.get(); }

   private:
    CudaEngine* engine_;
    std::unique_ptr<Workspace> ws_;
  };

  absl::StatusOr<Lease> Acquire() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (!idle_.empty()) {
        std::unique_ptr<Workspace> ws = std::move(idle_.back());
        idle_.pop_back();
        return Lease(this, std::move(ws));
      }
    }
    // A new concurrent caller: one more stream. Non-blocking, so that it
    // never synchronises implicitly with the legacy default stream.
    auto ws = std::make_unique<Workspace>();
    ATTNSERVE_CUDA_CALL(cudaStreamCreateWithFlags(&ws->stream, cudaStreamNonBlocking));
    ATTNSERVE_CUDA_CALL(cudaStreamCreateWithFlags(&ws->copy_stream, cudaStreamNonBlocking));
    ATTNSERVE_CUDA_CALL(cudaEventCreateWithFlags(&ws->uploaded, cudaEventDisableTiming));
    absl::StatusOr<std::unique_ptr<ProjectionGemm>> gemm = ProjectionGemm::Create(ws->stream);
    if (!gemm.ok()) return gemm.status();
    ws->gemm = std::move(*gemm);
    return Lease(this, std::move(ws));
  }

  void Release(std::unique_ptr<Workspace> ws) {
    std::lock_guard<std::mutex> lock(mutex_);
    idle_.push_back(std::move(ws));
  }

  // The layer's weights on the device, uploading them on first use. Holds
  // the lock through an upload, so concurrent first calls upload once.
  absl::StatusOr<const DeviceLayer*> GetDeviceLayer(const AttentionLayer& layer, Workspace& ws) {
    std::lock_guard<std::mutex> lock(layers_mutex_);
    std::unique_ptr<DeviceLayer>& slot = layers_[&layer];
    if (slot != nullptr && slot->source == layer.weights.wq.data() &&
        slot->precision == layer.config.precision) {
      return slot.get();
    }
    auto uploaded = std::make_unique<DeviceLayer>();
    uploaded->source = layer.weights.wq.data();
    uploaded->precision = layer.config.precision;
    uploaded->type = PrecisionType(layer.config.precision);
    const LayerWeights& w = layer.weights;
    const std::pair<const Tensor*, DeviceBuffer*> parts[] = {
        {&w.wq, &uploaded->wq}, {&w.bq, &uploaded->bq}, {&w.wk, &uploaded->wk},
        {&w.bk, &uploaded->bk}, {&w.wv, &uploaded->wv}, {&w.bv, &uploaded->bv},
        {&w.wo, &uploaded->wo}, {&w.bo, &uploaded->bo}};
    for (const auto& [host, device] : parts) {
      if (host->byte_size() == 0) continue;  // no bias
      if (host->dtype() != DType::kFloat32) {
        return absl::InvalidArgumentError(
            absl::StrCat("layer '", layer.config.name, "': weights must be FLOAT32"));
      }
      absl::StatusOr<DeviceBuffer> buffer = UploadWeight(*host, uploaded->type, ws.stream);
      if (!buffer.ok()) return buffer.status();
      *device = std::move(*buffer);
    }
    slot = std::move(uploaded);
    return slot.get();
  }

  // One fp32 host weight as a device buffer of `type` (synchronous: done once).
  static absl::StatusOr<DeviceBuffer> UploadWeight(const Tensor& host, ElemType type,
                                                   cudaStream_t stream) {
    const int64_t n = static_cast<int64_t>(host.byte_size() / sizeof(float));
    absl::StatusOr<DeviceBuffer> fp32 = DeviceBuffer::Allocate(host.byte_size());
    if (!fp32.ok()) return fp32.status();
    ATTNSERVE_CUDA_CALL(cudaMemcpyAsync(fp32->data(), host.data(), host.byte_size(),
                                        cudaMemcpyHostToDevice, stream));
    if (type == ElemType::kF32) {
      ATTNSERVE_CUDA_CALL(cudaStreamSynchronize(stream));
      return fp32;
    }
    absl::StatusOr<DeviceBuffer> converted =
        DeviceBuffer::Allocate(static_cast<size_t>(n) * ElemSize(type));
    if (!converted.ok()) return converted.status();
    ATTNSERVE_CUDA_CALL(
        LaunchConvert(fp32->data(), ElemType::kF32, converted->data(), type, n, stream));
    ATTNSERVE_CUDA_CALL(cudaStreamSynchronize(stream));
    return converted;
  }

  // Attention over host-side params (head layout or any strides): upload,
  // convert to `compute` if needed, attend, download.
  absl::Status EnqueueHostAttention(Call& call, const AttentionParams& p, ElemType compute) {
    const ElemType in_type = ToElem(p.dtype);
    const size_t in_size = ElemSize(in_type);
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

    DeviceAttention a;
    ATTNSERVE_CUDA_RETURN_IF_ERROR(StageMaskAndLengths(call, p, a));
    ATTNSERVE_CUDA_RETURN_IF_ERROR(call.UploadsDone());
    a.batch = p.batch;
    a.num_heads = p.num_heads;
    a.num_kv_heads = p.num_kv_heads;
    a.head_dim = p.head_dim;
    a.head_dim_v = p.head_dim_v;
    a.q_len = p.q_len;
    a.kv_len = p.kv_len;
    a.type = compute;
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
    HeadLayoutStrides(p.num_heads, p.q_len, p.head_dim, &a.q_stride_b, &a.q_stride_h,
                      &a.q_stride_row);
    HeadLayoutStrides(p.num_kv_heads, p.kv_len, p.head_dim, &a.k_stride_b, &a.k_stride_h,
                      &a.k_stride_row);
    HeadLayoutStrides(p.num_kv_heads, p.kv_len, p.head_dim_v, &a.v_stride_b, &a.v_stride_h,
                      &a.v_stride_row);

    // The output comes back contiguous and is scattered into p.out's strides.
    a.out_type = ToElem(p.out_dtype);
    const size_t out_size = ElemSize(a.out_type);
    const size_t out_bytes =
        static_cast<size_t>(p.batch * p.num_heads * p.q_len * p.head_dim_v) * out_size;
    absl::StatusOr<void*> out = call.DeviceAlloc(out_bytes);
    if (!out.ok()) return out.status();
    a.out = *out;
    HeadLayoutStrides(p.num_heads, p.q_len, p.head_dim_v, &a.o_stride_b, &a.o_stride_h,
                      &a.o_stride_row);
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

  // nn.MultiheadAttention (batch first) on the device: in-projections,
  // attention over the projected [B, L, H*D] buffers, out-projection.
  absl::Status EnqueueProjected(Call& call, const LayerConfig& config, const DeviceLayer& w,
                                const AttentionTask& task, const AttentionParams& p) {
    const ElemType ct = w.type;
    const size_t ct_size = ElemSize(ct);
    const ElemType in_type = ToElem(task.query.dtype);
    const bool self_attention = task.key.empty() && task.value.empty();
    const int64_t q_rows = p.batch * p.q_len;
    const int64_t kv_rows = p.batch * p.kv_len;
    const int64_t key_dim = self_attention ? config.query_dim : config.key_dim;
    const int64_t value_dim = self_attention ? config.query_dim : config.value_dim;

    // Everything this request uploads, then the compute that waits for it.
    DeviceAttention a;
    absl::StatusOr<void*> raw_q = call.Upload(
        task.query.data, static_cast<size_t>(q_rows * config.query_dim) * ElemSize(in_type));
    if (!raw_q.ok()) return raw_q.status();
    absl::StatusOr<void*> raw_k = raw_q;
    absl::StatusOr<void*> raw_v = raw_q;
    if (!self_attention) {
      raw_k =
          call.Upload(task.key.data, static_cast<size_t>(kv_rows * key_dim) * ElemSize(in_type));
      if (!raw_k.ok()) return raw_k.status();
      raw_v = call.Upload(task.value.data,
                          static_cast<size_t>(kv_rows * value_dim) * ElemSize(in_type));
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
    absl::StatusOr<void*> k =
        call.DeviceAlloc(static_cast<size_t>(kv_rows * kv_features) * ct_size);
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
    absl::StatusOr<void*> attn =
        call.DeviceAlloc(static_cast<size_t>(q_rows * o_features) * ct_size);
    if (!attn.ok()) return attn.status();
    a.batch = p.batch;
    a.num_heads = p.num_heads;
    a.num_kv_heads = p.num_kv_heads;
    a.head_dim = p.head_dim;
    a.head_dim_v = p.head_dim_v;
    a.q_len = p.q_len;
    a.kv_len = p.kv_len;
    a.type = ct;
    a.q = *q;
    a.k = *k;
    a.v = *v;
    TokenLayoutStrides(p.num_heads, p.q_len, p.head_dim, &a.q_stride_b, &a.q_stride_h,
                       &a.q_stride_row);
    TokenLayoutStrides(p.num_kv_heads, p.kv_len, p.head_dim, &a.k_stride_b, &a.k_stride_h,
                       &a.k_stride_row);
    TokenLayoutStrides(p.num_kv_heads, p.kv_len, p.head_dim_v, &a.v_stride_b, &a.v_stride_h,
                       &a.v_stride_row);
    a.out_type = ct;
    a.out = *attn;
    TokenLayoutStrides(p.num_heads, p.q_len, p.head_dim_v, &a.o_stride_b, &a.o_stride_h,
                       &a.o_stride_row);
    ATTNSERVE_CUDA_RETURN_IF_ERROR(RunCore(call, a, p));

    // Out-projection, then the output dtype, then home.
    absl::StatusOr<void*> y =
        call.DeviceAlloc(static_cast<size_t>(q_rows * config.out_dim) * ct_size);
    if (!y.ok()) return y.status();
    ATTNSERVE_CUDA_RETURN_IF_ERROR(call.gemm().Linear(ct, *attn, q_rows, o_features, w.wo.data(),
                                                      w.bo.data(), config.out_dim, *y));
    const ElemType out_type = ToElem(task.output.dtype);
    const int64_t out_n = q_rows * config.out_dim;
    absl::StatusOr<const void*> result = ConvertOnDevice(call, *y, ct, out_type, out_n);
    if (!result.ok()) return result.status();
    const size_t out_bytes = static_cast<size_t>(out_n) * ElemSize(out_type);
    void* host = task.output.data;
    return call.Download(*result, out_bytes, [host, out_bytes](const char* pinned) {
      std::memcpy(host, pinned, out_bytes);
    });
  }

  const int device_;

  std::mutex mutex_;  // guards idle_
  std::vector<std::unique_ptr<Workspace>> idle_;

  std::mutex layers_mutex_;  // guards layers_
  std::unordered_map<const AttentionLayer*, std::unique_ptr<DeviceLayer>> layers_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<AttentionEngine>> NewCudaEngine(const EngineOptions& options) {
  (void)options;  // host-side staging is single-threaded per call
  int count = 0;
  if (const cudaError_t err = cudaGetDeviceCount(&count); err != cudaSuccess) {
    (void)cudaGetLastError();
    return absl::UnavailableError(
        absl::StrCat("no CUDA device: cudaGetDeviceCount: ", cudaGetErrorString(err)));
  }
  if (count < 1) {
    return absl::UnavailableError("no CUDA device: cudaGetDeviceCount found 0 devices");
  }
  constexpr int kDevice = 0;  // CUDA_VISIBLE_DEVICES picks which GPU is 0
  int major = 0;
  int minor = 0;
  cudaDeviceProp prop{};
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, kDevice) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, kDevice) != cudaSuccess ||
      cudaGetDeviceProperties(&prop, kDevice) != cudaSuccess) {
    (void)cudaGetLastError();
    return absl::UnavailableError("no usable CUDA device: cannot query device 0");
  }
  if (major < 8) {
    return absl::UnavailableError(absl::StrCat("no usable CUDA device: ", prop.name,
                                               " has compute capability ", major, ".", minor,
                                               "; the CUDA backend is built for 8.0 and newer"));
  }
  if (const cudaError_t err = cudaSetDevice(kDevice); err != cudaSuccess) {
    (void)cudaGetLastError();
    return absl::UnavailableError(
        absl::StrCat("no usable CUDA device: cudaSetDevice: ", cudaGetErrorString(err)));
  }
  // Create the context now, so that a broken driver shows here, not in the
  // first request.
  if (const cudaError_t err = cudaFree(nullptr); err != cudaSuccess) {
    (void)cudaGetLastError();
    return absl::UnavailableError(
        absl::StrCat("no usable CUDA device: context creation: ", cudaGetErrorString(err)));
  }
  return std::unique_ptr<AttentionEngine>(new CudaEngine(kDevice));
}

}  // namespace attnserve::cuda
