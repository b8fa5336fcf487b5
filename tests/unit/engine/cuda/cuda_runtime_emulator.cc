// Host stand-ins for the CUDA runtime calls the CUDA engine and its kernels'
// launchers make, for code compiled on warp_emulator.h: one device (an
// sm_90 with an H100's shared memory per block), device and page-locked
// memory from the host's heap, and streams whose work runs as late, and in
// as unfavourable an order, as CUDA's rules allow (cuda_runtime_emulator.h
// says which). Linked into every emulated test and into the emulated CUDA
// module (libattnserve_cuda_emulated.so). Test-only; written here.
#include "tests/unit/engine/cuda/cuda_runtime_emulator.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

namespace attnserve::emu {
namespace {

// One stream's queue. `done` counts the operations that have run, so an
// event recorded after the n-th operation has completed once done >= n.
struct Stream;
struct Operation {
  uint64_t seq = 0;             // its place in program order (all streams)
  std::function<void()> work;   // empty for a wait
  std::shared_ptr<Stream> on;   // a wait: until on->done >= count
  uint64_t count = 0;
};
struct Stream {
  explicit Stream(bool blocking) : blocking(blocking) {}
  const bool blocking;  // created without cudaStreamNonBlocking
  std::deque<Operation> pending;
  uint64_t enqueued = 0;
  uint64_t done = 0;
};
struct Event {
  std::shared_ptr<Stream> stream;  // null: never recorded, or on the legacy stream
  uint64_t count = 0;
};

struct Device {
  std::mutex mutex;  // guards everything below; held while work runs
  std::vector<std::shared_ptr<Stream>> streams;
  uint64_t seq = 0;
  std::map<uintptr_t, size_t> page_locked;  // base -> bytes
};

Device& TheDevice() {
  static Device* device = new Device;  // never destroyed: streams may outlive statics
  return *device;
}

bool Ready(const Operation& op) { return op.on == nullptr || op.on->done >= op.count; }

// Runs pending operations until `reached()` holds. Of the streams whose next
// operation may run, it always takes the one enqueued last: a reader or a
// writer that does not wait for what it depends on runs before it, so the
// missing dependency shows as a wrong result. The globally oldest pending
// operation is always ready (what it waits for was enqueued before it), so
// this ends.
template <typename Reached>
void RunUntil(Device& d, Reached reached) {
  while (!reached()) {
    Stream* next = nullptr;
    for (const std::shared_ptr<Stream>& s : d.streams) {
      if (s->pending.empty() || !Ready(s->pending.front())) continue;
      if (next == nullptr || s->pending.front().seq > next->pending.front().seq) next = s.get();
    }
    if (next == nullptr) {
      std::fprintf(stderr, "cuda_runtime_emulator: nothing can run (a bug in the emulator)\n");
      std::abort();
    }
    Operation op = std::move(next->pending.front());
    next->pending.pop_front();
    if (op.work) op.work();
    ++next->done;
  }
}

void RunAll(Device& d) {
  RunUntil(d, [&d] {
    return std::all_of(d.streams.begin(), d.streams.end(),
                       [](const std::shared_ptr<Stream>& s) { return s->pending.empty(); });
  });
}

// What the legacy default stream waits for before its work: every blocking
// stream's.
void RunBlocking(Device& d) {
  RunUntil(d, [&d] {
    return std::all_of(d.streams.begin(), d.streams.end(), [](const std::shared_ptr<Stream>& s) {
      return !s->blocking || s->pending.empty();
    });
  });
}

struct StreamHandle {
  std::shared_ptr<Stream> stream;
};
Stream* StreamOf(cudaStream_t stream) {
  return stream == nullptr ? nullptr : reinterpret_cast<StreamHandle*>(stream)->stream.get();
}
std::shared_ptr<Stream> SharedStreamOf(cudaStream_t stream) {
  return stream == nullptr ? nullptr : reinterpret_cast<StreamHandle*>(stream)->stream;
}
Event& EventOf(cudaEvent_t event) { return *reinterpret_cast<Event*>(event); }

// Appends an operation to `stream` (the lock held); returns its count once
// run. On the legacy stream (null) the work runs now, after the blocking
// streams'.
uint64_t EnqueueLocked(Device& d, cudaStream_t stream, std::function<void()> work) {
  Stream* s = StreamOf(stream);
  if (s == nullptr) {
    RunBlocking(d);
    if (work) work();
    return 0;
  }
  s->pending.push_back(Operation{++d.seq, std::move(work), nullptr, 0});
  return ++s->enqueued;
}

bool PageLocked(Device& d, const void* p, size_t bytes) {
  const auto addr = reinterpret_cast<uintptr_t>(p);
  auto it = d.page_locked.upper_bound(addr);
  if (it == d.page_locked.begin()) return false;
  --it;
  return addr + bytes <= it->first + it->second;
}

// An asynchronous copy as CUDA performs it for the host side's kind of
// memory: from page-locked memory the source is read when the copy runs;
// from pageable memory it is read before the call returns; into pageable
// memory the call returns once the copy has run.
cudaError_t CopyAsync(cudaStream_t stream, cudaMemcpyKind kind, const void* host_side,
                      size_t host_bytes, std::function<void(const void* src)> copy,
                      const void* src) {
  Device& d = TheDevice();
  std::lock_guard<std::mutex> lock(d.mutex);
  const bool pageable = !PageLocked(d, host_side, host_bytes);
  if (kind == cudaMemcpyHostToDevice && pageable) {
    auto snapshot = std::make_shared<std::vector<char>>(
        static_cast<const char*>(src), static_cast<const char*>(src) + host_bytes);
    EnqueueLocked(d, stream, [copy, snapshot] { copy(snapshot->data()); });
    return cudaSuccess;
  }
  const uint64_t count = EnqueueLocked(d, stream, [copy, src] { copy(src); });
  if (kind == cudaMemcpyDeviceToHost && pageable && stream != nullptr) {
    Stream* s = StreamOf(stream);
    RunUntil(d, [s, count] { return s->done >= count; });
  }
  return cudaSuccess;
}

constexpr size_t kAlignment = 256;  // what cudaMalloc guarantees

// Fresh memory holds 0xff bytes (NaN as floats): what nothing wrote is
// garbage on a GPU too.
void* Allocate(size_t bytes) {
  const size_t rounded = (std::max<size_t>(bytes, 1) + kAlignment - 1) / kAlignment * kAlignment;
  void* p = std::aligned_alloc(kAlignment, rounded);
  if (p != nullptr) std::memset(p, 0xff, rounded);
  return p;
}

}  // namespace

int& MaxSharedOptin() {
  static int bytes = 227 * 1024;  // an H100's (and H200's)
  return bytes;
}

void Enqueue(cudaStream_t stream, std::function<void()> work) {
  Device& d = TheDevice();
  std::lock_guard<std::mutex> lock(d.mutex);
  EnqueueLocked(d, stream, std::move(work));
}

}  // namespace attnserve::emu

using attnserve::emu::Device;
using attnserve::emu::TheDevice;

extern "C" {

cudaError_t cudaGetLastError(void) { return cudaSuccess; }
cudaError_t cudaPeekAtLastError(void) { return cudaSuccess; }
const char* cudaGetErrorName(cudaError_t error) {
  switch (error) {
    case cudaSuccess:
      return "cudaSuccess";
    case cudaErrorMemoryAllocation:
      return "cudaErrorMemoryAllocation";
    case cudaErrorInvalidValue:
      return "cudaErrorInvalidValue";
    case cudaErrorNotReady:
      return "cudaErrorNotReady";
    default:
      return "cudaError (emulated)";
  }
}
const char* cudaGetErrorString(cudaError_t error) { return cudaGetErrorName(error); }

cudaError_t cudaGetDeviceCount(int* count) {
  *count = 1;
  return cudaSuccess;
}
cudaError_t cudaGetDevice(int* device) {
  *device = 0;
  return cudaSuccess;
}
cudaError_t cudaSetDevice(int device) {
  return device == 0 ? cudaSuccess : cudaErrorInvalidDevice;
}
cudaError_t cudaDeviceSynchronize(void) {
  Device& d = TheDevice();
  std::lock_guard<std::mutex> lock(d.mutex);
  attnserve::emu::RunAll(d);
  return cudaSuccess;
}
cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int device) {
  if (device != 0) return cudaErrorInvalidDevice;
  switch (attr) {
    case cudaDevAttrComputeCapabilityMajor:
      *value = 9;
      return cudaSuccess;
    case cudaDevAttrComputeCapabilityMinor:
      *value = 0;
      return cudaSuccess;
    case cudaDevAttrMaxSharedMemoryPerBlockOptin:
      *value = attnserve::emu::MaxSharedOptin();
      return cudaSuccess;
    case cudaDevAttrMultiProcessorCount:
      *value = 132;
      return cudaSuccess;
    default:
      return cudaErrorInvalidValue;
  }
}
cudaError_t cudaGetDeviceProperties(cudaDeviceProp* prop, int device) {
  if (device != 0) return cudaErrorInvalidDevice;
  *prop = cudaDeviceProp{};
  std::strncpy(prop->name, "attnserve CPU emulation", sizeof(prop->name) - 1);
  prop->major = 9;
  prop->minor = 0;
  prop->multiProcessorCount = 132;
  prop->sharedMemPerBlockOptin = static_cast<size_t>(attnserve::emu::MaxSharedOptin());
  prop->sharedMemPerBlock = 48 * 1024;
  prop->maxThreadsPerBlock = 1024;
  prop->warpSize = 32;
  prop->totalGlobalMem = size_t{80} << 30;
  return cudaSuccess;
}
cudaError_t cudaFuncSetAttribute(const void* /*func*/, cudaFuncAttribute /*attr*/, int /*value*/) {
  return cudaSuccess;
}

cudaError_t cudaMalloc(void** ptr, size_t bytes) {
  *ptr = attnserve::emu::Allocate(bytes);
  return *ptr != nullptr ? cudaSuccess : cudaErrorMemoryAllocation;
}
// cudaFree and cudaFreeHost synchronise the device first, as CUDA's do.
cudaError_t cudaFree(void* ptr) {
  Device& d = TheDevice();
  std::lock_guard<std::mutex> lock(d.mutex);
  attnserve::emu::RunAll(d);
  std::free(ptr);
  return cudaSuccess;
}
cudaError_t cudaHostAlloc(void** ptr, size_t bytes, unsigned int /*flags*/) {
  *ptr = attnserve::emu::Allocate(bytes);
  if (*ptr == nullptr) return cudaErrorMemoryAllocation;
  Device& d = TheDevice();
  std::lock_guard<std::mutex> lock(d.mutex);
  d.page_locked[reinterpret_cast<uintptr_t>(*ptr)] = bytes;
  return cudaSuccess;
}
cudaError_t cudaMallocHost(void** ptr, size_t bytes) {
  return cudaHostAlloc(ptr, bytes, cudaHostAllocDefault);
}
cudaError_t cudaFreeHost(void* ptr) {
  Device& d = TheDevice();
  std::lock_guard<std::mutex> lock(d.mutex);
  attnserve::emu::RunAll(d);
  d.page_locked.erase(reinterpret_cast<uintptr_t>(ptr));
  std::free(ptr);
  return cudaSuccess;
}

// Synchronous copies and memsets: on the legacy stream, so now.
cudaError_t cudaMemcpy(void* dst, const void* src, size_t bytes, cudaMemcpyKind /*kind*/) {
  attnserve::emu::Enqueue(nullptr, [=] {
    if (bytes > 0) std::memmove(dst, src, bytes);
  });
  return cudaSuccess;
}
cudaError_t cudaMemset(void* ptr, int value, size_t bytes) {
  attnserve::emu::Enqueue(nullptr, [=] {
    if (bytes > 0) std::memset(ptr, value, bytes);
  });
  return cudaSuccess;
}

cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind,
                            cudaStream_t stream) {
  const void* host_side = kind == cudaMemcpyDeviceToHost ? dst : src;
  return attnserve::emu::CopyAsync(
      stream, kind, host_side, bytes,
      [dst, bytes](const void* from) {
        if (bytes > 0) std::memmove(dst, from, bytes);
      },
      src);
}
cudaError_t cudaMemcpy2DAsync(void* dst, size_t dpitch, const void* src, size_t spitch,
                              size_t width, size_t height, cudaMemcpyKind kind,
                              cudaStream_t stream) {
  if (width > dpitch || width > spitch) return cudaErrorInvalidPitchValue;
  if (height == 0 || width == 0) return cudaSuccess;
  const bool down = kind == cudaMemcpyDeviceToHost;
  const size_t host_bytes = (height - 1) * (down ? dpitch : spitch) + width;
  return attnserve::emu::CopyAsync(
      stream, kind, down ? static_cast<const void*>(dst) : src, host_bytes,
      [=](const void* from) {
        for (size_t r = 0; r < height; ++r) {
          std::memcpy(static_cast<char*>(dst) + r * dpitch,
                      static_cast<const char*>(from) + r * spitch, width);
        }
      },
      src);
}
cudaError_t cudaMemsetAsync(void* ptr, int value, size_t bytes, cudaStream_t stream) {
  attnserve::emu::Enqueue(stream, [=] {
    if (bytes > 0) std::memset(ptr, value, bytes);
  });
  return cudaSuccess;
}
cudaError_t cudaMemset2DAsync(void* ptr, size_t pitch, int value, size_t width, size_t height,
                              cudaStream_t stream) {
  if (width > pitch) return cudaErrorInvalidPitchValue;
  attnserve::emu::Enqueue(stream, [=] {
    for (size_t r = 0; r < height; ++r) {
      std::memset(static_cast<char*>(ptr) + r * pitch, value, width);
    }
  });
  return cudaSuccess;
}

cudaError_t cudaStreamCreateWithFlags(cudaStream_t* stream, unsigned int flags) {
  Device& d = TheDevice();
  std::lock_guard<std::mutex> lock(d.mutex);
  auto s = std::make_shared<attnserve::emu::Stream>((flags & cudaStreamNonBlocking) == 0);
  d.streams.push_back(s);
  *stream = reinterpret_cast<cudaStream_t>(new attnserve::emu::StreamHandle{std::move(s)});
  return cudaSuccess;
}
cudaError_t cudaStreamCreate(cudaStream_t* stream) {
  return cudaStreamCreateWithFlags(stream, cudaStreamDefault);
}
// A destroyed stream's pending work still runs (here before the call returns).
cudaError_t cudaStreamDestroy(cudaStream_t stream) {
  if (stream == nullptr) return cudaErrorInvalidResourceHandle;
  Device& d = TheDevice();
  std::lock_guard<std::mutex> lock(d.mutex);
  auto* handle = reinterpret_cast<attnserve::emu::StreamHandle*>(stream);
  attnserve::emu::Stream* s = handle->stream.get();
  attnserve::emu::RunUntil(d, [s] { return s->pending.empty(); });
  std::erase(d.streams, handle->stream);
  delete handle;
  return cudaSuccess;
}
cudaError_t cudaStreamSynchronize(cudaStream_t stream) {
  Device& d = TheDevice();
  std::lock_guard<std::mutex> lock(d.mutex);
  attnserve::emu::Stream* s = attnserve::emu::StreamOf(stream);
  if (s == nullptr) {
    attnserve::emu::RunBlocking(d);
  } else {
    attnserve::emu::RunUntil(d, [s] { return s->pending.empty(); });
  }
  return cudaSuccess;
}
// The stream's later work waits for the event's latest record as of this
// call (none: nothing to wait for).
cudaError_t cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t event, unsigned int /*flags*/) {
  Device& d = TheDevice();
  std::lock_guard<std::mutex> lock(d.mutex);
  const attnserve::emu::Event& e = attnserve::emu::EventOf(event);
  attnserve::emu::Stream* s = attnserve::emu::StreamOf(stream);
  if (e.stream == nullptr) return cudaSuccess;
  if (s == nullptr) {
    attnserve::emu::RunUntil(d, [&e] { return e.stream->done >= e.count; });
    return cudaSuccess;
  }
  s->pending.push_back(attnserve::emu::Operation{++d.seq, nullptr, e.stream, e.count});
  ++s->enqueued;
  return cudaSuccess;
}
cudaError_t cudaEventCreate(cudaEvent_t* event) {
  *event = reinterpret_cast<cudaEvent_t>(new attnserve::emu::Event);
  return cudaSuccess;
}
cudaError_t cudaEventCreateWithFlags(cudaEvent_t* event, unsigned int /*flags*/) {
  return cudaEventCreate(event);
}
cudaError_t cudaEventDestroy(cudaEvent_t event) {
  Device& d = TheDevice();
  std::lock_guard<std::mutex> lock(d.mutex);
  delete &attnserve::emu::EventOf(event);
  return cudaSuccess;
}
cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream) {
  Device& d = TheDevice();
  std::lock_guard<std::mutex> lock(d.mutex);
  attnserve::emu::Event& e = attnserve::emu::EventOf(event);
  e.stream = attnserve::emu::SharedStreamOf(stream);
  e.count = e.stream == nullptr ? 0 : e.stream->enqueued;
  return cudaSuccess;
}
cudaError_t cudaEventSynchronize(cudaEvent_t event) {
  Device& d = TheDevice();
  std::lock_guard<std::mutex> lock(d.mutex);
  const attnserve::emu::Event& e = attnserve::emu::EventOf(event);
  if (e.stream != nullptr) {
    attnserve::emu::RunUntil(d, [&e] { return e.stream->done >= e.count; });
  }
  return cudaSuccess;
}
cudaError_t cudaEventQuery(cudaEvent_t event) {
  Device& d = TheDevice();
  std::lock_guard<std::mutex> lock(d.mutex);
  const attnserve::emu::Event& e = attnserve::emu::EventOf(event);
  return e.stream == nullptr || e.stream->done >= e.count ? cudaSuccess : cudaErrorNotReady;
}
cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t /*start*/, cudaEvent_t /*end*/) {
  *ms = 0.0f;
  return cudaSuccess;
}

}  // extern "C"
