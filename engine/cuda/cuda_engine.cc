// The CUDA engine: the AttentionEngine over a pool of workspaces and the
// device-resident layers; fused attention from cuDNN where it takes the
// request, else from the kernels written here
// ($ATTNSERVE_CUDA_ATTENTION). A whole batch is enqueued before the one
// synchronisation at its end: uploads go on a copy stream and compute waits
// for each request's uploads through an event, so while the GPU computes
// request n the host packs request n+1 and the copy engine uploads it, and
// request n-1's output comes back on a third stream (staging.h); each
// request runs on its own launches (dispatch.h), except the decode steps of
// sessions, which share one launch per batch.
#include "engine/cuda/cuda_engine.h"

#include <cuda_runtime_api.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "engine/attention_task.h"
#include "engine/cuda/cudnn_sdpa.h"
#include "engine/cuda/cuda_status.h"
#include "engine/cuda/dispatch.h"
#include "engine/cuda/staging.h"

namespace attnserve::cuda {
namespace {

// $ATTNSERVE_CUDA_EXPERIMENTAL_FUSED: unset, "0" or "1".
absl::StatusOr<bool> ParseExperimentalFused(const char* value) {
  if (value == nullptr || std::strcmp(value, "") == 0 || std::strcmp(value, "0") == 0) {
    return false;
  }
  if (std::strcmp(value, "1") == 0) return true;
  return absl::InvalidArgumentError(
      absl::StrCat("ATTNSERVE_CUDA_EXPERIMENTAL_FUSED: '", value, "' is not 0 or 1"));
}

class CudaEngine final : public AttentionEngine {
 public:
  CudaEngine(int device, AttentionSource source, bool experimental_fused)
      : device_(device), source_(source), experimental_fused_(experimental_fused) {}
  ~CudaEngine() override {
    (void)cudaSetDevice(device_);
    idle_.clear();
    layers_.clear();
  }

  std::string_view name() const override { return "cuda"; }

  absl::Status Run(const AttentionLayer& layer, absl::Span<const AttentionTask> batch) override {
    const LayerConfig& config = layer.config;
    for (const AttentionTask& task : batch) {
      ATTNSERVE_CUDA_RETURN_IF_ERROR(CheckTask(config, task));
      if (task.paged.enabled()) ATTNSERVE_CUDA_RETURN_IF_ERROR(CheckPagedTask(config, task));
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
    call.set_requests(static_cast<int>(batch.size()));
    PagedDecodes decodes;  // the batch's session decode steps, launched together
    for (const AttentionTask& task : batch) {
      absl::StatusOr<AttentionParams> params = MakeCoreParams(config, task);
      if (!params.ok()) return params.status();
      if (!config.has_projections && task.paged.enabled()) {
        // A session: the cache's dtype, whatever the layer's precision.
        ATTNSERVE_CUDA_RETURN_IF_ERROR(
            EnqueuePagedHostAttention(call, *params, task.paged, decodes));
      } else if (!config.has_projections) {
        // Bare attention computes in the inputs' dtype unless the layer asks
        // for a lower precision.
        const DType compute = config.precision == Precision::kFloat32
                                  ? params->dtype
                                  : PrecisionDType(config.precision);
        ATTNSERVE_CUDA_RETURN_IF_ERROR(EnqueueHostAttention(call, *params, compute));
      } else {
        ATTNSERVE_CUDA_RETURN_IF_ERROR(
            EnqueueProjected(call, config, *weights, task, *params, decodes));
      }
    }
    ATTNSERVE_CUDA_RETURN_IF_ERROR(decodes.Flush(call));
    return call.Finish();
  }

  bool SupportsSessions() const override { return true; }

  std::shared_ptr<KvSlabMemory> kv_slab_memory() const override { return slab_memory_; }

  std::shared_ptr<HostBufferPool> request_memory() const override { return request_memory_; }

 private:
  // Session blocks in device memory: one cudaMalloc per slab (the pool
  // carves 2 MiB slabs, so this is rare), freed with cudaFree.
  // Thread-safe: the runtime's allocator is; the device is set per call
  // (it is per thread).
  class DeviceSlabMemory final : public KvSlabMemory {
   public:
    explicit DeviceSlabMemory(int device) : device_(device) {}
    void* Map(int64_t bytes) override {
      void* base = nullptr;
      if (cudaSetDevice(device_) != cudaSuccess ||
          cudaMalloc(&base, static_cast<size_t>(bytes)) != cudaSuccess) {
        (void)cudaGetLastError();  // out of memory is the caller's nullptr, not sticky
        return nullptr;
      }
      return base;
    }
    void Unmap(void* base, int64_t bytes) override {
      (void)bytes;
      (void)cudaSetDevice(device_);
      (void)cudaFree(base);
    }

   private:
    const int device_;
  };

  // Page-locked host memory for requests' tensor bytes, which the front end
  // copies from the wire once and the copy engine uploads from in place.
  // cudaHostAlloc is slow (it maps and locks pages), so freed buffers are
  // kept: up to 256 MiB, each at most 64 MiB. Out of page-locked memory,
  // Allocate fails and the front end parses into ordinary memory instead.
  static std::shared_ptr<HostBufferPool> PageLockedRequestMemory(int device) {
    HostBufferPool::Backing backing{
        [device](size_t bytes) -> void* {
          void* data = nullptr;
          if (cudaSetDevice(device) != cudaSuccess ||
              cudaHostAlloc(&data, bytes, cudaHostAllocDefault) != cudaSuccess) {
            (void)cudaGetLastError();
            return nullptr;
          }
          return data;
        },
        [](void* data, size_t) { (void)cudaFreeHost(data); }};
    return std::make_shared<HostBufferPool>(std::move(backing), size_t{256} << 20,
                                            size_t{64} << 20);
  }

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
    // A new concurrent caller: one more workspace.
    absl::StatusOr<std::unique_ptr<Workspace>> ws = Workspace::Create(source_, experimental_fused_);
    if (!ws.ok()) return ws.status();
    (*ws)->request_memory = request_memory_.get();
    return Lease(this, std::move(*ws));
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
    // A layer at the address of one that is gone has another id: the slot
    // is replaced (and the old device copy freed), never reused.
    if (slot != nullptr && slot->layer_id == layer.id.value()) {
      return slot.get();
    }
    absl::StatusOr<std::unique_ptr<DeviceLayer>> uploaded = UploadLayer(layer, ws.stream);
    if (!uploaded.ok()) return uploaded.status();
    slot = std::move(*uploaded);
    return slot.get();
  }

  const int device_;
  const AttentionSource source_;
  const bool experimental_fused_;
  const std::shared_ptr<KvSlabMemory> slab_memory_ = std::make_shared<DeviceSlabMemory>(device_);
  const std::shared_ptr<HostBufferPool> request_memory_ = PageLockedRequestMemory(device_);

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
  // Where fused attention comes from (cudnn_sdpa.h): cuDNN where it takes a
  // request unless the environment says otherwise.
  const char* source_name = std::getenv("ATTNSERVE_CUDA_ATTENTION");
  absl::StatusOr<AttentionSource> source =
      ParseAttentionSource(source_name != nullptr ? source_name : "");
  if (!source.ok()) return source.status();
  if (*source == AttentionSource::kCudnn) {
    if (absl::Status cudnn = CudnnAvailable(); !cudnn.ok()) {
      return absl::UnavailableError(
          absl::StrCat("ATTNSERVE_CUDA_ATTENTION=cudnn: ", cudnn.message()));
    }
  }
  // Whether the fused kernels serve what no GPU run has verified yet
  // (attention_kernels.h): only when the environment asks.
  absl::StatusOr<bool> experimental =
      ParseExperimentalFused(std::getenv("ATTNSERVE_CUDA_EXPERIMENTAL_FUSED"));
  if (!experimental.ok()) return experimental.status();
  return std::unique_ptr<AttentionEngine>(new CudaEngine(kDevice, *source, *experimental));
}

}  // namespace attnserve::cuda
