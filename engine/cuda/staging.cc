// Host <-> device staging for the CUDA engine: pinned-memory uploads on the
// copy stream, downloads delivered after the one synchronisation of a call,
// and the one-time upload of a layer's weights.
#include "engine/cuda/staging.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "engine/cuda/attention_kernels.h"
#include "engine/cuda/cuda_status.h"
#include "engine/rope.h"
#include "engine/tensor.h"

namespace attnserve::cuda {

absl::StatusOr<std::unique_ptr<Workspace>> Workspace::Create(AttentionSource source,
                                                              bool experimental_fused) {
  auto ws = std::make_unique<Workspace>();
  ws->source = source;
  ws->experimental_fused = experimental_fused;
  int device = 0;
  ATTNSERVE_CUDA_CALL(cudaGetDevice(&device));
  ATTNSERVE_CUDA_CALL(cudaDeviceGetAttribute(&ws->max_shared_bytes,
                                             cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  ATTNSERVE_CUDA_CALL(cudaStreamCreateWithFlags(&ws->stream, cudaStreamNonBlocking));
  ATTNSERVE_CUDA_CALL(cudaStreamCreateWithFlags(&ws->copy_stream, cudaStreamNonBlocking));
  ATTNSERVE_CUDA_CALL(cudaStreamCreateWithFlags(&ws->download_stream, cudaStreamNonBlocking));
  ATTNSERVE_CUDA_CALL(cudaEventCreateWithFlags(&ws->uploaded, cudaEventDisableTiming));
  const char* profile = std::getenv("ATTNSERVE_CUDA_PROFILE");
  ws->profile = profile != nullptr && std::strcmp(profile, "1") == 0;
  absl::StatusOr<std::unique_ptr<ProjectionGemm>> gemm = ProjectionGemm::Create(ws->stream);
  if (!gemm.ok()) return gemm.status();
  ws->gemm = std::move(*gemm);
  absl::StatusOr<std::unique_ptr<UnfusedAttention>> unfused = UnfusedAttention::Create(ws->stream);
  if (!unfused.ok()) return unfused.status();
  ws->unfused = std::move(*unfused);
  if (source != AttentionSource::kKernels) {
    // Plans per workspace: a cuDNN handle and its plans serve one call at a
    // time, as a workspace does.
    constexpr size_t kMaxPlans = 256;
    absl::StatusOr<std::unique_ptr<CudnnSdpa>> sdpa = CudnnSdpa::Create(kMaxPlans);
    if (sdpa.ok()) {
      ws->sdpa = std::move(*sdpa);
    } else if (source == AttentionSource::kCudnn) {
      return sdpa.status();
    }
  }
  return ws;
}

Workspace::~Workspace() {
  if (copy_stream != nullptr) (void)cudaStreamSynchronize(copy_stream);
  if (stream != nullptr) (void)cudaStreamSynchronize(stream);
  if (download_stream != nullptr) (void)cudaStreamSynchronize(download_stream);
  gemm.reset();
  unfused.reset();
  sdpa.reset();
  if (uploaded != nullptr) (void)cudaEventDestroy(uploaded);
  for (cudaEvent_t e : events) (void)cudaEventDestroy(e);
  for (cudaEvent_t e : computed) (void)cudaEventDestroy(e);
  if (download_stream != nullptr) (void)cudaStreamDestroy(download_stream);
  if (copy_stream != nullptr) (void)cudaStreamDestroy(copy_stream);
  if (stream != nullptr) (void)cudaStreamDestroy(stream);
}

Call::Call(Workspace& ws) : ws_(ws) {
  if (!ws_.profile) return;
  start_ = std::chrono::steady_clock::now();
  MarkCompute(Mark::kRun);
}

cudaEvent_t Call::NextEvent() {
  if (events_used_ == ws_.events.size()) {
    cudaEvent_t e = nullptr;
    if (cudaEventCreate(&e) != cudaSuccess) {
      (void)cudaGetLastError();
      return nullptr;
    }
    ws_.events.push_back(e);
  }
  return ws_.events[events_used_++];
}

void Call::MarkCompute(Mark mark) {
  cudaEvent_t e = NextEvent();
  if (e == nullptr || cudaEventRecord(e, ws_.stream) != cudaSuccess) return;
  compute_marks_.emplace_back(mark, e);
}

cudaEvent_t Call::MarkStart(cudaStream_t stream) {
  cudaEvent_t e = NextEvent();
  if (e == nullptr || cudaEventRecord(e, stream) != cudaSuccess) return nullptr;
  return e;
}

void Call::MarkEnd(cudaStream_t stream, cudaEvent_t start,
                   std::vector<std::pair<cudaEvent_t, cudaEvent_t>>* spans) {
  cudaEvent_t e = start != nullptr ? NextEvent() : nullptr;
  if (e == nullptr || cudaEventRecord(e, stream) != cudaSuccess) return;
  spans->emplace_back(start, e);
}

// After the streams have finished: the sums of the marked spans.
void Call::PrintProfile() {
  auto ms = [](cudaEvent_t a, cudaEvent_t b) {
    float t = 0.0f;
    if (cudaEventElapsedTime(&t, a, b) != cudaSuccess) {
      (void)cudaGetLastError();
      return 0.0;
    }
    return static_cast<double>(t);
  };
  double upload = 0.0, download = 0.0, compute = 0.0;
  for (const auto& [a, b] : upload_spans_) upload += ms(a, b);
  for (const auto& [a, b] : download_spans_) download += ms(a, b);
  // Compute runs from a kRun mark to the next kWait or kEnd.
  cudaEvent_t open = nullptr;
  for (const auto& [mark, e] : compute_marks_) {
    if ((mark == Mark::kWait || mark == Mark::kEnd) && open != nullptr) {
      compute += ms(open, e);
      open = nullptr;
    }
    if (mark == Mark::kRun) open = e;
  }
  const double call =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start_).count();
  std::fprintf(stderr,
               "attnserve: cuda call: requests %d upload_ms %.4f download_ms %.4f compute_ms %.4f "
               "call_ms %.4f\n",
               requests_, upload, download, compute, call);
}

Call::~Call() {
  if (!finished_) {
    (void)cudaStreamSynchronize(ws_.copy_stream);
    (void)cudaStreamSynchronize(ws_.stream);
    (void)cudaStreamSynchronize(ws_.download_stream);
    (void)cudaGetLastError();
    ws_.device.Reset();
    ws_.pinned.Reset();
  }
}

absl::StatusOr<void*> Call::Upload(const void* host, size_t bytes) {
  if (InRequestMemory(host, bytes)) return UploadStaged(host, bytes);
  absl::StatusOr<void*> staging = ws_.pinned.Allocate(bytes);
  if (!staging.ok()) return staging.status();
  std::memcpy(*staging, host, bytes);
  return UploadStaged(*staging, bytes);
}

absl::StatusOr<void*> Call::UploadHeads(const void* host, size_t elem_size, int64_t batch,
                                        int64_t heads, int64_t len, int64_t dim, int64_t stride_b,
                                        int64_t stride_h, int64_t stride_row, int64_t rows) {
  const size_t bytes = static_cast<size_t>(batch * heads * len * dim) * elem_size;
  const bool contiguous = stride_row == dim && (heads == 1 || stride_h == len * dim) &&
                          (batch == 1 || stride_b == heads * len * dim);
  const void* staging = host;  // contiguous rows in page-locked request memory: read in place
  if (!contiguous || !InRequestMemory(host, bytes)) {
    absl::StatusOr<void*> packed = ws_.pinned.Allocate(bytes);
    if (!packed.ok()) return packed.status();
    staging = *packed;
    if (contiguous) {
      std::memcpy(*packed, host, bytes);
    } else {
      const size_t row_bytes = static_cast<size_t>(dim) * elem_size;
      char* dst = static_cast<char*>(*packed);
      const char* src = static_cast<const char*>(host);
      for (int64_t b = 0; b < batch; ++b)
        for (int64_t h = 0; h < heads; ++h)
          for (int64_t i = 0; i < len; ++i) {
            std::memcpy(dst, src + (b * stride_b + h * stride_h + i * stride_row) * elem_size,
                        row_bytes);
            dst += row_bytes;
          }
    }
  }
  if (rows == len) return UploadStaged(staging, bytes);
  // Each (b, h) block of len * dim lands at the start of rows * dim.
  const size_t block = static_cast<size_t>(len * dim) * elem_size;
  const size_t pitch = static_cast<size_t>(rows * dim) * elem_size;
  const size_t blocks = static_cast<size_t>(batch * heads);
  absl::StatusOr<void*> device = ws_.device.Allocate(pitch * blocks);
  if (!device.ok()) return device.status();
  cudaEvent_t start = ws_.profile ? MarkStart(ws_.copy_stream) : nullptr;
  ATTNSERVE_CUDA_CALL(cudaMemcpy2DAsync(*device, pitch, staging, block, block, blocks,
                                        cudaMemcpyHostToDevice, ws_.copy_stream));
  if (ws_.profile) MarkEnd(ws_.copy_stream, start, &upload_spans_);
  ATTNSERVE_CUDA_CALL(cudaMemset2DAsync(static_cast<char*>(*device) + block, pitch, 0,
                                        pitch - block, blocks, ws_.copy_stream));
  return *device;
}

absl::Status Call::UploadsDone() {
  ATTNSERVE_CUDA_CALL(cudaEventRecord(ws_.uploaded, ws_.copy_stream));
  if (ws_.profile) MarkCompute(Mark::kWait);
  ATTNSERVE_CUDA_CALL(cudaStreamWaitEvent(ws_.stream, ws_.uploaded, 0));
  if (ws_.profile) MarkCompute(Mark::kRun);
  return absl::OkStatus();
}

absl::Status Call::DownloadRows(const void* device, size_t row_bytes, size_t pitch,
                                size_t count, std::function<void(const char* pinned)> deliver) {
  absl::StatusOr<void*> staging = ws_.pinned.Allocate(row_bytes * count);
  if (!staging.ok()) return staging.status();
  ATTNSERVE_CUDA_RETURN_IF_ERROR(CopyDown(*staging, device, row_bytes, pitch, count));
  const char* pinned = static_cast<const char*>(*staging);
  deliveries_.push_back([pinned, deliver = std::move(deliver)] { deliver(pinned); });
  return absl::OkStatus();
}

absl::Status Call::DownloadRowsTo(const void* device, size_t row_bytes, size_t pitch,
                                  size_t count, void* host) {
  const size_t bytes = row_bytes * count;
  if (InRequestMemory(host, bytes)) return CopyDown(host, device, row_bytes, pitch, count);
  return DownloadRows(device, row_bytes, pitch, count, [host, bytes](const char* pinned) {
    std::memcpy(host, pinned, bytes);
  });
}

absl::Status Call::CopyDown(void* host, const void* device, size_t row_bytes, size_t pitch,
                            size_t count) {
  // The download stream waits for the compute enqueued so far.
  if (computed_used_ == ws_.computed.size()) {
    cudaEvent_t e = nullptr;
    ATTNSERVE_CUDA_CALL(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    ws_.computed.push_back(e);
  }
  cudaEvent_t computed = ws_.computed[computed_used_++];
  ATTNSERVE_CUDA_CALL(cudaEventRecord(computed, ws_.stream));
  ATTNSERVE_CUDA_CALL(cudaStreamWaitEvent(ws_.download_stream, computed, 0));
  cudaEvent_t start = ws_.profile ? MarkStart(ws_.download_stream) : nullptr;
  if (pitch == row_bytes) {
    ATTNSERVE_CUDA_CALL(cudaMemcpyAsync(host, device, row_bytes * count, cudaMemcpyDeviceToHost,
                                        ws_.download_stream));
  } else {
    ATTNSERVE_CUDA_CALL(cudaMemcpy2DAsync(host, row_bytes, device, pitch, row_bytes, count,
                                          cudaMemcpyDeviceToHost, ws_.download_stream));
  }
  if (ws_.profile) MarkEnd(ws_.download_stream, start, &download_spans_);
  return absl::OkStatus();
}

absl::Status Call::Finish() {
  if (ws_.profile) MarkCompute(Mark::kEnd);
  ATTNSERVE_CUDA_CALL(cudaStreamSynchronize(ws_.copy_stream));
  ATTNSERVE_CUDA_CALL(cudaStreamSynchronize(ws_.stream));
  ATTNSERVE_CUDA_CALL(cudaStreamSynchronize(ws_.download_stream));
  for (const std::function<void()>& deliver : deliveries_) deliver();
  finished_ = true;
  if (ws_.profile) PrintProfile();
  ws_.device.Reset();
  ws_.pinned.Reset();
  return absl::OkStatus();
}

absl::StatusOr<void*> Call::UploadStaged(const void* staging, size_t bytes) {
  absl::StatusOr<void*> device = ws_.device.Allocate(bytes);
  if (!device.ok()) return device.status();
  cudaEvent_t start = ws_.profile ? MarkStart(ws_.copy_stream) : nullptr;
  ATTNSERVE_CUDA_CALL(
      cudaMemcpyAsync(*device, staging, bytes, cudaMemcpyHostToDevice, ws_.copy_stream));
  if (ws_.profile) MarkEnd(ws_.copy_stream, start, &upload_spans_);
  return *device;
}

absl::Status StageMaskAndLengths(Call& call, const AttentionParams& p, AttentionParams& a) {
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
    a.mask = p.mask;
    a.mask.data = *mask;
  }
  return absl::OkStatus();
}

DType PrecisionDType(Precision precision) {
  switch (precision) {
    case Precision::kBFloat16:
      return DType::kBFloat16;
    case Precision::kFloat16:
      return DType::kFloat16;
    case Precision::kFloat32:
      break;
  }
  return DType::kFloat32;
}

namespace {

// `bytes` of host memory as a device buffer, enqueued on `stream` (the
// caller synchronises).
absl::StatusOr<DeviceBuffer> UploadBytes(const void* host, size_t bytes, cudaStream_t stream) {
  absl::StatusOr<DeviceBuffer> buffer = DeviceBuffer::Allocate(bytes);
  if (!buffer.ok()) return buffer.status();
  ATTNSERVE_CUDA_CALL(
      cudaMemcpyAsync(buffer->data(), host, bytes, cudaMemcpyHostToDevice, stream));
  return buffer;
}

// One fp32 host weight as a device buffer of `type` (synchronous: done once).
absl::StatusOr<DeviceBuffer> UploadWeight(const Tensor& host, DType type, cudaStream_t stream) {
  const int64_t n = static_cast<int64_t>(host.byte_size() / sizeof(float));
  absl::StatusOr<DeviceBuffer> fp32 = UploadBytes(host.data(), host.byte_size(), stream);
  if (!fp32.ok()) return fp32.status();
  if (type == DType::kFloat32) {
    ATTNSERVE_CUDA_CALL(cudaStreamSynchronize(stream));
    return fp32;
  }
  absl::StatusOr<DeviceBuffer> converted =
      DeviceBuffer::Allocate(static_cast<size_t>(n) * DTypeSize(type));
  if (!converted.ok()) return converted.status();
  ATTNSERVE_CUDA_CALL(
      LaunchConvert(fp32->data(), DType::kFloat32, converted->data(), type, n, stream));
  ATTNSERVE_CUDA_CALL(cudaStreamSynchronize(stream));
  return converted;
}

}  // namespace

absl::StatusOr<std::unique_ptr<DeviceLayer>> UploadLayer(const AttentionLayer& layer,
                                                         cudaStream_t stream) {
  auto uploaded = std::make_unique<DeviceLayer>();
  uploaded->layer_id = layer.id.value();
  uploaded->type = PrecisionDType(layer.config.precision);
  const LayerWeights& w = layer.weights;
  // The projections in the layer's precision; the QK-norm weights, sinks,
  // relative bias table and relative position embeddings in FLOAT32, as the
  // cpu engine reads them.
  struct Part {
    const Tensor* host;
    DeviceBuffer* device;
    DType type;
  };
  const DType t = uploaded->type, f32 = DType::kFloat32;
  // A latent layer's wkv_a (and bkv_a) in two: the latent's rows and the
  // rotary key's.
  Tensor wkv_c, bkv_c, wk_rope, bk_rope;
  if (layer.config.latent.enabled) {
    const int64_t rank = layer.config.latent.kv_lora_rank, rope = layer.config.latent.rope_dim;
    const int64_t in = w.wkv_a.shape()[1];
    auto rows_of = [](const Tensor& m, int64_t row0, int64_t rows, int64_t cols) {
      Tensor part(DType::kFloat32, cols > 0 ? Shape{rows, cols} : Shape{rows});
      std::memcpy(part.data(), m.data_as<float>() + row0 * std::max<int64_t>(cols, 1),
                  part.byte_size());
      return part;
    };
    wkv_c = rows_of(w.wkv_a, 0, rank, in);
    wk_rope = rows_of(w.wkv_a, rank, rope, in);
    if (w.bkv_a.byte_size() != 0) {
      bkv_c = rows_of(w.bkv_a, 0, rank, 0);
      bk_rope = rows_of(w.bkv_a, rank, rope, 0);
    }
  }
  const Part parts[] = {{&w.wq, &uploaded->wq, t},         {&w.bq, &uploaded->bq, t},
                        {&w.wk, &uploaded->wk, t},         {&w.bk, &uploaded->bk, t},
                        {&w.wv, &uploaded->wv, t},         {&w.bv, &uploaded->bv, t},
                        {&w.wo, &uploaded->wo, t},         {&w.bo, &uploaded->bo, t},
                        {&w.wg, &uploaded->wg, t},         {&w.bg, &uploaded->bg, t},
                        {&w.q_norm, &uploaded->q_norm, f32}, {&w.k_norm, &uploaded->k_norm, f32},
                        {&w.sinks, &uploaded->sinks, f32},
                        {&w.relative_bias, &uploaded->relative_bias, f32},
                        {&w.relative_key, &uploaded->relative_key, f32},
                        {&w.relative_query, &uploaded->relative_query, f32},
                        {&w.wq_a, &uploaded->wq_a, t},     {&w.bq_a, &uploaded->bq_a, t},
                        {&wkv_c, &uploaded->wkv_c, t},     {&bkv_c, &uploaded->bkv_c, t},
                        {&wk_rope, &uploaded->wk_rope, t}, {&bk_rope, &uploaded->bk_rope, t},
                        {&w.q_a_norm, &uploaded->q_a_norm, f32},
                        {&w.kv_a_norm, &uploaded->kv_a_norm, f32}};
  for (const Part& part : parts) {
    if (part.host->byte_size() == 0) continue;  // no bias (or no such weight)
    if (part.host->dtype() != DType::kFloat32) {
      return absl::InvalidArgumentError(
          absl::StrCat("layer '", layer.config.name, "': weights must be FLOAT32"));
    }
    absl::StatusOr<DeviceBuffer> buffer = UploadWeight(*part.host, part.type, stream);
    if (!buffer.ok()) return buffer.status();
    *part.device = std::move(*buffer);
  }
  const RopeConfig& rope = layer.config.rope;
  if (rope.type != RopeConfig::Type::kNone) {
    // Position 0 picks the one set, or LongRoPE's short one; its long one at
    // the first position that asks for it.
    const RopeFrequencies freq = ComputeRopeFrequencies(rope, 0);
    absl::StatusOr<DeviceBuffer> buffer =
        UploadBytes(freq.inv_freq.data(), freq.inv_freq.size() * sizeof(double), stream);
    if (!buffer.ok()) return buffer.status();
    if (rope.type == RopeConfig::Type::kLongRope) {
      const RopeFrequencies long_freq =
          ComputeRopeFrequencies(rope, rope.original_max_position_embeddings);
      absl::StatusOr<DeviceBuffer> long_buffer = UploadBytes(
          long_freq.inv_freq.data(), long_freq.inv_freq.size() * sizeof(double), stream);
      if (!long_buffer.ok()) return long_buffer.status();
      uploaded->long_inv_freq = std::move(*long_buffer);
    }
    ATTNSERVE_CUDA_CALL(cudaStreamSynchronize(stream));
    uploaded->inv_freq = std::move(*buffer);
    uploaded->attention_factor = freq.attention_factor;
  }
  return uploaded;
}

}  // namespace attnserve::cuda
