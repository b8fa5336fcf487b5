// GPU throughput of the CUDA backend's pieces, device-resident (no host
// copies): the attention core in TFLOP/s, as the engine runs it (cuDNN's
// SDPA through cudnn_sdpa.h, with the first call's plan build timed apart;
// fp32 on the unfused path of unfused_attention.h) next to the kernels
// written here, and the projection GEMM (bias
// fused) against plain cuBLAS GEMMs of the same shape and against a large
// square GEMM (the ceiling). Prints one JSON object per line, which
// bench/cuda_bench.py turns into a table next to PyTorch's SDPA. --paged
// measures instead the paged-KV kernels of sessions (paged_attention.h): the
// split-KV decode reading the blocks in place against gathering them and
// running the fused kernel, by query rows and cached length (where the
// engine's kPagedDecodeMaxQueryRows should sit).
//
//   attnserve_cuda_bench [--quick] [--iters N] [--paged]
#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "engine/cuda/attention_kernels.h"
#include "engine/cuda/cuda_status.h"
#include "engine/cuda/cudnn_sdpa.h"
#include "engine/cuda/device_memory.h"
#include "engine/cuda/paged_attention.h"
#include "engine/cuda/projection_gemm.h"
#include "engine/cuda/unfused_attention.h"

namespace attnserve::cuda {
namespace {

const char* TypeName(DType t) {
  switch (t) {
    case DType::kFloat32:
      return "fp32";
    case DType::kFloat16:
      return "fp16";
    case DType::kBFloat16:
      return "bf16";
    default:
      return "bool";
  }
}

// A device buffer of n random values in [-1, 1) of type t.
DeviceBuffer Random(DType t, int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  std::vector<float> host(static_cast<size_t>(n));
  for (float& x : host) x = dist(rng);
  absl::StatusOr<DeviceBuffer> fp32 = DeviceBuffer::Allocate(host.size() * 4);
  absl::StatusOr<DeviceBuffer> out =
      DeviceBuffer::Allocate(static_cast<size_t>(n) * DTypeSize(t));
  if (!fp32.ok() || !out.ok()) {
    std::fprintf(stderr, "allocation failed\n");
    std::exit(1);
  }
  cudaMemcpy(fp32->data(), host.data(), host.size() * 4, cudaMemcpyHostToDevice);
  LaunchConvert(fp32->data(), DType::kFloat32, out->data(), t, n, nullptr);
  cudaDeviceSynchronize();
  return std::move(*out);
}

// Milliseconds per call of `fn` (after warm-up), timed with events.
template <typename Fn>
double TimeMs(Fn fn, int iters) {
  for (int i = 0; i < 3; ++i) fn();
  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  cudaEventRecord(start);
  for (int i = 0; i < iters; ++i) fn();
  cudaEventRecord(stop);
  cudaEventSynchronize(stop);
  float ms = 0;
  cudaEventElapsedTime(&ms, start, stop);
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  return ms / iters;
}

void Check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    std::fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(err));
    std::exit(1);
  }
}

// The bench's cuDNN handle and plans; null (and said once) without cuDNN.
CudnnSdpa* BenchSdpa() {
  static CudnnSdpa* sdpa = [] {
    absl::StatusOr<std::unique_ptr<CudnnSdpa>> made = CudnnSdpa::Create(64);
    if (!made.ok()) {
      std::fprintf(stderr, "no cuDNN rows: %s\n", std::string(made.status().message()).c_str());
      return static_cast<CudnnSdpa*>(nullptr);
    }
    return made->release();
  }();
  return sdpa;
}

// `batch` copies of `len` as cuDNN's sequence lengths, on the device.
DeviceBuffer SequenceLengths(int64_t batch, int64_t len) {
  std::vector<int32_t> host(static_cast<size_t>(batch), static_cast<int32_t>(len));
  absl::StatusOr<DeviceBuffer> buf = DeviceBuffer::Allocate(host.size() * sizeof(int32_t));
  if (!buf.ok()) std::exit(1);
  Check(cudaMemcpy(buf->data(), host.data(), host.size() * sizeof(int32_t),
                   cudaMemcpyHostToDevice),
        "sequence lengths");
  return std::move(*buf);
}

// One cuDNN SDPA call of `args` on the default stream, its scratch from
// `scratch` (reset first: one stream, so the next call reuses the memory
// in order). False, with the reason on stderr, when cuDNN declines it.
bool EnqueueSdpa(CudnnSdpa& sdpa, const SdpaArgs& args, Arena& scratch) {
  scratch.Reset();
  const absl::Status st =
      sdpa.Enqueue(args, [&scratch](size_t bytes) { return scratch.Allocate(bytes); }, nullptr);
  if (!st.ok()) {
    const SdpaShape& s = args.shape;
    std::fprintf(stderr, "cuDNN SDPA (%s B%ld H%ld/%ld Lq%ld Lk%ld D%ld%s): %s\n",
                 TypeName(s.dtype), static_cast<long>(s.batch), static_cast<long>(s.heads),
                 static_cast<long>(s.kv_heads), static_cast<long>(s.q_len),
                 static_cast<long>(s.kv_len), static_cast<long>(s.head_dim),
                 s.causal ? " causal" : "", std::string(st.message()).c_str());
    return false;
  }
  return true;
}

// Self-attention params over device buffers in head layout [B, H, rows, D]
// (rows >= len; the rows past len are padding), causal off, scale 1.
AttentionParams HeadLayoutParams(DType t, int64_t batch, int64_t heads, int64_t len, int64_t rows,
                                 int64_t dim, const DeviceBuffer& q, const DeviceBuffer& k,
                                 const DeviceBuffer& v, const DeviceBuffer& out) {
  AttentionParams a;
  a.batch = batch;
  a.num_heads = a.num_kv_heads = heads;
  a.head_dim = a.head_dim_v = dim;
  a.q_len = a.kv_len = len;
  a.dtype = a.out_dtype = t;
  a.q = q.data();
  a.k = k.data();
  a.v = v.data();
  a.out = out.data();
  HeadLayoutStrides(heads, rows, dim, &a.q_stride_b, &a.q_stride_h, &a.q_stride_row);
  HeadLayoutStrides(heads, rows, dim, &a.k_stride_b, &a.k_stride_h, &a.k_stride_row);
  HeadLayoutStrides(heads, rows, dim, &a.v_stride_b, &a.v_stride_h, &a.v_stride_row);
  HeadLayoutStrides(heads, rows, dim, &a.o_stride_b, &a.o_stride_h, &a.o_stride_row);
  return a;
}

// One attention shape: the kernel written here (flash, or the general one
// where flash does not apply) and, when cuDNN loads, cuDNN's SDPA through
// CudnnSdpa. `len` is the exact length; the buffers have the rows of its
// bucket, as the engine lays them out for cuDNN (cudnn_sdpa.h).
void BenchAttention(DType t, int64_t batch, int64_t heads, int64_t len, int64_t dim, bool causal,
                    int iters) {
  const int64_t rows = SdpaBucketLength(len);
  const int64_t n = batch * heads * rows * dim;
  DeviceBuffer q = Random(t, n, 1), k = Random(t, n, 2), v = Random(t, n, 3);
  absl::StatusOr<DeviceBuffer> out =
      DeviceBuffer::Allocate(static_cast<size_t>(n) * DTypeSize(t));
  if (!out.ok()) std::exit(1);
  AttentionParams a = HeadLayoutParams(t, batch, heads, len, rows, dim, q, k, v, *out);
  a.causal = causal;
  a.scale = 1.0f / std::sqrt(static_cast<float>(dim));
  // 2 GEMMs of 2*L*L*D flops each per (b, h); causal does about half.
  const double flops = 4.0 * batch * heads * len * len * dim * (causal ? 0.5 : 1.0);
  auto print = [&](const char* kernel, double ms, double first_ms) {
    std::printf(
        "{\"kind\": \"attention\", \"kernel\": \"%s\", \"dtype\": \"%s\", \"batch\": %ld, "
        "\"heads\": %ld, \"seq\": %ld, \"bucket\": %ld, \"head_dim\": %ld, \"causal\": %s, "
        "\"ms\": %.4f, \"first_call_ms\": %.2f, \"tflops\": %.2f}\n",
        kernel, TypeName(t), static_cast<long>(batch), static_cast<long>(heads),
        static_cast<long>(len), static_cast<long>(rows),
        static_cast<long>(dim), causal ? "true" : "false", ms, first_ms,
        flops / (ms * 1e-3) / 1e12);
    std::fflush(stdout);
  };

  if (t == DType::kFloat32) {
    // fp32: the engine's unfused path (unfused_attention.h), with 3xTF32
    // GEMMs (the engine's default, kernel "unfused") and with full-fp32 ones
    // ("unfused-fp32"), then the fused fp32 kernel ("flash-fp32"). The
    // general kernel (about 0.5 TFLOP/s here) is not timed.
    for (UnfusedAttention::Gemm gemm :
         {UnfusedAttention::Gemm::k3xTf32, UnfusedAttention::Gemm::kFp32}) {
      absl::StatusOr<std::unique_ptr<UnfusedAttention>> unfused =
          UnfusedAttention::Create(nullptr, gemm);
      if (!unfused.ok()) std::exit(1);
      Arena scratch{Arena::Kind::kDevice};
      const double unfused_ms = TimeMs(
          [&] {
            scratch.Reset();
            absl::Status st = (*unfused)->Enqueue(
                a, [&scratch](size_t bytes) { return scratch.Allocate(bytes); }, nullptr);
            if (!st.ok()) {
              std::fprintf(stderr, "unfused: %s\n", std::string(st.message()).c_str());
              std::exit(1);
            }
          },
          iters);
      Check(cudaDeviceSynchronize(), "unfused");
      print(gemm == UnfusedAttention::Gemm::k3xTf32 ? "unfused" : "unfused-fp32", unfused_ms,
            0.0);
    }
    // The fused fp32 kernel (flash_attention_fp32.cu; the engine's with
    // ATTNSERVE_CUDA_EXPERIMENTAL_FUSED=1), 3xTF32 inside the flash loop.
    int max_shared = 0;
    Check(cudaDeviceGetAttribute(&max_shared, cudaDevAttrMaxSharedMemoryPerBlockOptin, 0),
          "shared memory per block");
    if (FlashAttentionFp32Supports(a, max_shared)) {
      const double fused_ms = TimeMs(
          [&] { Check(LaunchFlashAttentionFp32(a, max_shared, nullptr), "fused fp32 launch"); },
          iters);
      Check(cudaDeviceSynchronize(), "fused fp32");
      print("flash-fp32", fused_ms, 0.0);
    }
    return;
  }

  const bool flash = FlashAttentionSupports(a);
  const double ms = TimeMs(
      [&] {
        Check(flash ? LaunchFlashAttention(a, nullptr) : LaunchAttentionGeneral(a, nullptr),
              "attention launch");
      },
      iters);
  Check(cudaDeviceSynchronize(), "attention");
  print(flash ? "flash" : "general", ms, 0.0);

  CudnnSdpa* sdpa = BenchSdpa();
  if (sdpa == nullptr) return;
  SdpaArgs args;
  SdpaShape& s = args.shape;
  s.dtype = t;
  s.batch = batch;
  s.heads = s.kv_heads = heads;
  s.head_dim = s.head_dim_v = dim;
  s.q_len = s.kv_len = len;
  s.q_rows = s.kv_rows = rows;
  s.causal = causal;
  args.q = q.data();
  args.k = k.data();
  args.v = v.data();
  args.out = out->data();
  args.scale = a.scale;
  DeviceBuffer lens;
  if (CudnnSdpa::NeedsSequenceLengths(s)) {
    lens = SequenceLengths(batch, len);
    args.seq_len_q = args.seq_len_kv = static_cast<const int32_t*>(lens.data());
  }
  Arena scratch{Arena::Kind::kDevice};
  auto call = [&] { return EnqueueSdpa(*sdpa, args, scratch); };
  // The first call builds the plan: timed on the host, to the end of the work.
  const auto start = std::chrono::steady_clock::now();
  if (!call()) return;
  Check(cudaDeviceSynchronize(), "cudnn first call");
  const double first_ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  const double cudnn_ms = TimeMs([&] { call(); }, iters);
  Check(cudaDeviceSynchronize(), "cudnn");
  print("cudnn", cudnn_ms, first_ms);
}

// Today's layers' rules where cuDNN does not take them: the fused kernel
// written here (flash_attention.cu, with ATTNSERVE_CUDA_EXPERIMENTAL_FUSED=1
// the engine's route) against the default route, timed as the engine runs
// it: the unfused path (the inputs widened to fp32, then
// unfused_attention.h), or the general kernel where one head's scores
// exceed the unfused path's bound. bf16, causal, head dim 128; `window` or
// `softcap`.
void BenchLayerFeature(const char* name, int64_t batch, int64_t heads, int64_t len,
                       int64_t window, float softcap, int iters) {
  constexpr int64_t kDim = 128;
  const DType t = DType::kBFloat16;
  const int64_t n = batch * heads * len * kDim;
  DeviceBuffer q = Random(t, n, 11), k = Random(t, n, 12), v = Random(t, n, 13);
  absl::StatusOr<DeviceBuffer> out = DeviceBuffer::Allocate(static_cast<size_t>(n) * 2);
  if (!out.ok()) std::exit(1);
  AttentionParams a = HeadLayoutParams(t, batch, heads, len, len, kDim, q, k, v, *out);
  a.causal = true;
  a.window = window;
  a.softcap = softcap;
  a.scale = 1.0f / std::sqrt(static_cast<float>(kDim));
  // The score pairs computed: a causal row i sees min(i + 1, window) keys.
  double pairs = 0;
  for (int64_t i = 0; i < len; ++i) pairs += window > 0 ? std::min(i + 1, window) : i + 1;
  const double flops = 4.0 * batch * heads * pairs * kDim;
  auto print = [&](const char* kernel, double ms) {
    std::printf(
        "{\"kind\": \"layer_feature\", \"feature\": \"%s\", \"kernel\": \"%s\", \"dtype\": "
        "\"bf16\", \"batch\": %ld, \"heads\": %ld, \"seq\": %ld, \"head_dim\": %ld, \"window\": "
        "%ld, \"softcap\": %.1f, \"ms\": %.4f, \"tflops\": %.2f}\n",
        name, kernel, static_cast<long>(batch), static_cast<long>(heads), static_cast<long>(len),
        static_cast<long>(kDim), static_cast<long>(window), softcap, ms,
        flops / (ms * 1e-3) / 1e12);
    std::fflush(stdout);
  };
  if (!FlashAttentionSupports(a)) std::exit(1);
  print("flash", TimeMs([&] { Check(LaunchFlashAttention(a, nullptr), "flash"); }, iters));
  AttentionParams f = a;
  f.dtype = DType::kFloat32;
  if (!UnfusedAttention::Supports(f)) {
    // One head's scores past the unfused path's bound: the default engine
    // runs the general kernel here (dispatch.cc, RunCore), so that is the
    // row the fused kernel is measured against (one timed call: it takes
    // about a second at this size).
    print("general", TimeMs([&] { Check(LaunchAttentionGeneral(a, nullptr), "general"); }, 1));
    Check(cudaDeviceSynchronize(), "layer feature");
    return;
  }
  absl::StatusOr<std::unique_ptr<UnfusedAttention>> unfused = UnfusedAttention::Create(nullptr);
  absl::StatusOr<DeviceBuffer> wide = DeviceBuffer::Allocate(static_cast<size_t>(n) * 4 * 3);
  if (!unfused.ok() || !wide.ok()) std::exit(1);
  float* w = static_cast<float*>(wide->data());
  f.q = w;
  f.k = w + n;
  f.v = w + 2 * n;
  const void* narrow[3] = {a.q, a.k, a.v};
  Arena scratch{Arena::Kind::kDevice};
  auto run_unfused = [&] {
    for (int i = 0; i < 3; ++i) {
      Check(LaunchConvert(narrow[i], t, w + i * n, DType::kFloat32, n, nullptr), "widen");
    }
    scratch.Reset();
    absl::Status st = (*unfused)->Enqueue(
        f, [&scratch](size_t bytes) { return scratch.Allocate(bytes); }, nullptr);
    if (!st.ok()) std::exit(1);
  };
  print("unfused", TimeMs(run_unfused, std::max(1, iters / 4)));
  Check(cudaDeviceSynchronize(), "layer feature");
}

// Plain cublasGemmEx, no bias: the same GEMM as Linear without the epilogue.
double CublasGemmMs(cublasHandle_t blas, DType t, const void* x, int64_t rows, int64_t in,
                    const void* w, int64_t out, void* y, int iters) {
  const cudaDataType_t dt = t == DType::kFloat32   ? CUDA_R_32F
                            : t == DType::kFloat16 ? CUDA_R_16F
                                                   : CUDA_R_16BF;
  const float alpha = 1.0f, beta = 0.0f;
  return TimeMs(
      [&] {
        cublasGemmEx(blas, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(out), static_cast<int>(rows),
                     static_cast<int>(in), &alpha, w, dt, static_cast<int>(in), x, dt,
                     static_cast<int>(in), &beta, y, dt, static_cast<int>(out), CUBLAS_COMPUTE_32F,
                     CUBLAS_GEMM_DEFAULT);
      },
      iters);
}

void BenchProjection(DType t, int64_t rows, int64_t in, int64_t out, int iters) {
  absl::StatusOr<std::unique_ptr<ProjectionGemm>> gemm = ProjectionGemm::Create(nullptr);
  if (!gemm.ok()) {
    std::fprintf(stderr, "%s\n", std::string(gemm.status().message()).c_str());
    std::exit(1);
  }
  DeviceBuffer x = Random(t, rows * in, 4), w = Random(t, out * in, 5), b = Random(t, out, 6);
  absl::StatusOr<DeviceBuffer> y =
      DeviceBuffer::Allocate(static_cast<size_t>(rows * out) * DTypeSize(t));
  if (!y.ok()) std::exit(1);
  const double ms = TimeMs(
      [&] {
        absl::Status s = (*gemm)->Linear(t, x.data(), rows, in, w.data(), b.data(), out, y->data());
        if (!s.ok()) {
          std::fprintf(stderr, "%s\n", std::string(s.message()).c_str());
          std::exit(1);
        }
      },
      iters);
  cublasHandle_t blas;
  cublasCreate(&blas);
  const double cublas_ms =
      CublasGemmMs(blas, t, x.data(), rows, in, w.data(), out, y->data(), iters);
  cublasDestroy(blas);
  Check(cudaDeviceSynchronize(), "projection");
  const double flops = 2.0 * rows * in * out;
  std::printf(
      "{\"kind\": \"projection\", \"dtype\": \"%s\", \"rows\": %ld, \"in\": %ld, \"out\": %ld, "
      "\"ms\": %.4f, \"tflops\": %.2f, \"cublas_same_shape_tflops\": %.2f}\n",
      TypeName(t), static_cast<long>(rows), static_cast<long>(in), static_cast<long>(out), ms,
      flops / (ms * 1e-3) / 1e12, flops / (cublas_ms * 1e-3) / 1e12);
  std::fflush(stdout);
}

// The ceiling: the best of a few large square GEMMs.
void BenchCeiling(DType t, int iters) {
  cublasHandle_t blas;
  cublasCreate(&blas);
  double best = 0;
  for (int64_t n : {4096, 8192}) {
    DeviceBuffer a = Random(t, n * n, 7), b = Random(t, n * n, 8);
    absl::StatusOr<DeviceBuffer> c =
        DeviceBuffer::Allocate(static_cast<size_t>(n * n) * DTypeSize(t));
    if (!c.ok()) std::exit(1);
    const double ms = CublasGemmMs(blas, t, a.data(), n, n, b.data(), n, c->data(), iters);
    best = std::max(best, 2.0 * n * n * n / (ms * 1e-3) / 1e12);
  }
  cublasDestroy(blas);
  Check(cudaDeviceSynchronize(), "ceiling");
  std::printf("{\"kind\": \"gemm_ceiling\", \"dtype\": \"%s\", \"tflops\": %.2f}\n", TypeName(t),
              best);
  std::fflush(stdout);
}

// `sessions` caches of `kv_len` tokens each in blocks of `block_tokens` laid
// out in a shuffled order (as a pool hands them out), bf16, Hq 32 over Hkv
// 8, head dim 128; `q_len` query rows of each attend causally over its
// cache. Prints the split-KV decode's time for all sessions in one launch
// (as the engine runs a batch of session steps: LaunchPagedDecodeBatch)
// and with one launch per session, a device copy of the same K/V bytes
// (the step's memory floor: the decode must read them all), and, for one
// session, the gather + fused kernel's time and the gather + cuDNN's (the
// engine's route for requests of more than kPagedDecodeMaxQueryRows rows:
// the gather at the plan's bucket, the query at its own; -1 without cuDNN
// or when it declines).
void BenchPaged(int64_t sessions, int64_t q_len, int64_t kv_len, int64_t block_tokens,
                int iters) {
  const DType t = DType::kBFloat16;
  const int64_t hq = 32, hkv = 8, dim = 128;
  const int64_t blocks = (kv_len + block_tokens - 1) / block_tokens;
  const int64_t block_elems = 2 * hkv * block_tokens * dim;  // K part then V part
  const int64_t total_blocks = sessions * blocks;
  DeviceBuffer slab = Random(t, total_blocks * block_elems, 4);
  DeviceBuffer q = Random(t, sessions * hq * q_len * dim, 5);
  std::vector<int64_t> order(static_cast<size_t>(total_blocks));
  for (int64_t i = 0; i < total_blocks; ++i) order[i] = i;
  std::shuffle(order.begin(), order.end(), std::mt19937(6));
  const size_t elem = DTypeSize(t);
  // Tables: session s's K table at [2 s blocks, ...), its V table after it.
  std::vector<const void*> table_host;
  for (int64_t s = 0; s < sessions; ++s) {
    std::vector<const void*> k_table, v_table;
    for (int64_t b = 0; b < blocks; ++b) {
      const char* block =
          static_cast<const char*>(slab.data()) + order[s * blocks + b] * block_elems * elem;
      k_table.push_back(block);
      v_table.push_back(block + hkv * block_tokens * dim * elem);
    }
    table_host.insert(table_host.end(), k_table.begin(), k_table.end());
    table_host.insert(table_host.end(), v_table.begin(), v_table.end());
  }
  absl::StatusOr<DeviceBuffer> tables = DeviceBuffer::Allocate(table_host.size() * sizeof(void*));
  absl::StatusOr<DeviceBuffer> out = DeviceBuffer::Allocate(sessions * hq * q_len * dim * elem);
  AttentionParams a;
  a.batch = 1;
  a.num_heads = hq;
  a.num_kv_heads = hkv;
  a.head_dim = a.head_dim_v = dim;
  a.q_len = q_len;
  a.kv_len = kv_len;
  a.dtype = a.out_dtype = t;
  a.causal = true;
  a.scale = 1.0f / std::sqrt(static_cast<float>(dim));
  a.block_tokens = block_tokens;
  const size_t scratch_bytes = PagedDecodeScratchBytes(a);
  absl::StatusOr<DeviceBuffer> scratch = DeviceBuffer::Allocate(sessions * scratch_bytes);
  absl::StatusOr<DeviceBuffer> gathered = DeviceBuffer::Allocate(2 * hkv * kv_len * dim * elem);
  const size_t kv_bytes = static_cast<size_t>(2 * hkv * kv_len * dim) * elem * sessions;
  absl::StatusOr<DeviceBuffer> copy = DeviceBuffer::Allocate(kv_bytes);
  if (!tables.ok() || !out.ok() || !scratch.ok() || !gathered.ok() || !copy.ok()) {
    std::fprintf(stderr, "allocation failed\n");
    std::exit(1);
  }
  auto* table = static_cast<const void**>(tables->data());
  cudaMemcpy(table, table_host.data(), table_host.size() * sizeof(void*), cudaMemcpyHostToDevice);
  SetContiguousStrides(&a, HeadLayoutStrides);
  a.k_stride_b = a.k_stride_h = a.k_stride_row = 0;
  a.v_stride_b = a.v_stride_h = a.v_stride_row = 0;
  auto session = [&](int64_t s) {
    AttentionParams p = a;
    p.q = static_cast<const char*>(q.data()) + s * hq * q_len * dim * elem;
    p.out = static_cast<char*>(out->data()) + s * hq * q_len * dim * elem;
    p.k_blocks = table + 2 * s * blocks;
    p.v_blocks = table + (2 * s + 1) * blocks;
    return p;
  };
  std::vector<AttentionParams> requests;
  std::vector<void*> scratches;
  for (int64_t s = 0; s < sessions; ++s) {
    requests.push_back(session(s));
    scratches.push_back(static_cast<char*>(scratch->data()) + s * scratch_bytes);
  }
  std::vector<PagedDecodeEntry> entries(requests.size());
  const PagedDecodeBatchPlan plan = PlanPagedDecodeBatch(
      requests.data(), scratches.data(), static_cast<int>(requests.size()), entries.data());
  absl::StatusOr<DeviceBuffer> device_entries =
      DeviceBuffer::Allocate(entries.size() * sizeof(PagedDecodeEntry));
  if (!device_entries.ok()) {
    std::fprintf(stderr, "allocation failed\n");
    std::exit(1);
  }
  Check(cudaMemcpy(device_entries->data(), entries.data(),
                   entries.size() * sizeof(PagedDecodeEntry), cudaMemcpyHostToDevice),
        "entries upload");
  const double decode_ms = TimeMs(
      [&] {
        Check(LaunchPagedDecodeBatch(
                  plan, static_cast<const PagedDecodeEntry*>(device_entries->data()), nullptr),
              "paged decode batch");
      },
      iters);
  const double per_session_ms = TimeMs(
      [&] {
        for (int64_t s = 0; s < sessions; ++s) {
          Check(LaunchPagedDecode(session(s), static_cast<char*>(scratch->data()) +
                                                  s * scratch_bytes,
                                  nullptr),
                "paged decode");
        }
      },
      iters);
  const double copy_ms = TimeMs(
      [&] {
        Check(cudaMemcpyAsync(copy->data(), slab.data(), kv_bytes, cudaMemcpyDeviceToDevice,
                              nullptr),
              "device copy");
      },
      iters);
  const AttentionParams one = session(0);
  AttentionParams g = one;
  g.k = gathered->data();
  g.v = static_cast<char*>(gathered->data()) + hkv * kv_len * dim * elem;
  g.k_blocks = g.v_blocks = nullptr;
  g.block_tokens = 0;
  SetContiguousStrides(&g, HeadLayoutStrides);
  const double gather_ms = TimeMs(
      [&] {
        Check(LaunchPagedGather(one,
                                PagedGatherOut{const_cast<void*>(g.k), const_cast<void*>(g.v), t,
                                               one.kv_len, /*token_layout=*/false},
                                nullptr),
              "paged gather");
        Check(FlashAttentionSupports(g) ? LaunchFlashAttention(g, nullptr)
                                        : LaunchAttentionGeneral(g, nullptr),
              "attention over the gathered cache");
      },
      iters);
  double gather_cudnn_ms = -1.0;
  if (CudnnSdpa* sdpa = BenchSdpa(); sdpa != nullptr) {
    const int64_t q_rows = SdpaBucketLength(q_len), kv_rows = SdpaBucketLength(kv_len);
    DeviceBuffer bucket_q = Random(t, hq * q_rows * dim, 7);
    absl::StatusOr<DeviceBuffer> bucket_out = DeviceBuffer::Allocate(hq * q_rows * dim * elem);
    absl::StatusOr<DeviceBuffer> bucket_kv = DeviceBuffer::Allocate(2 * hkv * kv_rows * dim * elem);
    if (!bucket_out.ok() || !bucket_kv.ok()) std::exit(1);
    char* k_rows = static_cast<char*>(bucket_kv->data());
    char* v_rows = k_rows + hkv * kv_rows * dim * elem;
    SdpaArgs args;
    SdpaShape& s = args.shape;
    s.dtype = t;
    s.batch = 1;
    s.heads = hq;
    s.kv_heads = hkv;
    s.head_dim = s.head_dim_v = dim;
    s.q_len = q_len;
    s.kv_len = kv_len;
    s.q_rows = q_rows;
    s.kv_rows = kv_rows;
    s.causal = true;
    args.q = bucket_q.data();
    args.k = k_rows;
    args.v = v_rows;
    args.out = bucket_out->data();
    args.scale = a.scale;
    DeviceBuffer q_lens, kv_lens;
    if (CudnnSdpa::NeedsSequenceLengths(s)) {
      q_lens = SequenceLengths(1, q_len);
      kv_lens = SequenceLengths(1, kv_len);
      args.seq_len_q = static_cast<const int32_t*>(q_lens.data());
      args.seq_len_kv = static_cast<const int32_t*>(kv_lens.data());
    }
    Arena sdpa_scratch{Arena::Kind::kDevice};
    auto run = [&] {
      Check(LaunchPagedGather(one, PagedGatherOut{k_rows, v_rows, t, kv_rows, false}, nullptr),
            "paged gather at a bucket");
      return EnqueueSdpa(*sdpa, args, sdpa_scratch);
    };
    if (run()) {  // the first call builds the plan
      Check(cudaDeviceSynchronize(), "gather + cuDNN first call");
      gather_cudnn_ms = TimeMs([&] { run(); }, iters);
    }
  }
  std::printf(
      "{\"kind\": \"paged\", \"dtype\": \"%s\", \"sessions\": %lld, \"q_len\": %lld, "
      "\"kv_len\": %lld, \"block_tokens\": %lld, \"decode_ms\": %.4f, \"copy_ms\": %.4f, "
      "\"decode_gbps\": %.1f, \"copy_over_decode\": %.2f, \"decode_ms_launch_per_session\": %.4f, "
      "\"gather_flash_ms_one\": %.4f, \"gather_cudnn_ms_one\": %.4f}\n",
      TypeName(t), static_cast<long long>(sessions), static_cast<long long>(q_len),
      static_cast<long long>(kv_len), static_cast<long long>(block_tokens), decode_ms, copy_ms,
      static_cast<double>(kv_bytes) / decode_ms / 1e6, copy_ms / decode_ms, per_session_ms,
      gather_ms, gather_cudnn_ms);
  std::fflush(stdout);
}

int Main(int argc, char** argv) {
  bool quick = false;
  bool paged = false;
  int iters = 20;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--quick") == 0) {
      quick = true;
    } else if (std::strcmp(argv[i], "--paged") == 0) {
      paged = true;
    } else if (std::strcmp(argv[i], "--iters") == 0 && i + 1 < argc) {
      iters = std::atoi(argv[++i]);
    } else {
      std::fprintf(stderr, "usage: %s [--quick] [--iters N] [--paged]\n", argv[0]);
      return 2;
    }
  }
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    std::fprintf(stderr, "no CUDA device: nothing to measure\n");
    return 1;
  }
  cudaDeviceProp prop{};
  cudaGetDeviceProperties(&prop, 0);
  std::printf("{\"kind\": \"device\", \"name\": \"%s\", \"sm\": %d%d}\n", prop.name, prop.major,
              prop.minor);
  if (paged) {
    // The GPU issue's decode check: 32 sessions x 4k context, one step.
    for (int64_t block_tokens : {16, 64}) BenchPaged(32, 1, 4096, block_tokens, iters);
    for (int64_t kv_len : quick ? std::vector<int64_t>{4096}
                                : std::vector<int64_t>{1024, 4096, 16384, 65536}) {
      for (int64_t q_len : {1, 4, 16, 32, 64}) {
        for (int64_t block_tokens : {16, 64}) BenchPaged(1, q_len, kv_len, block_tokens, iters);
      }
    }
    // Session prefills (the whole prompt at once) and a long append: where
    // the engine gathers, gather + cuDNN against gather + our fused kernel.
    for (const auto& [q_len, kv_len] :
         std::vector<std::pair<int64_t, int64_t>>{{2000, 2000}, {4096, 4096}, {500, 4596}}) {
      BenchPaged(1, q_len, kv_len, 16, iters);
    }
    return 0;
  }

  const std::vector<int64_t> lens =
      quick ? std::vector<int64_t>{2048} : std::vector<int64_t>{512, 1024, 2048, 4096, 8192, 16384};
  for (DType t : {DType::kBFloat16, DType::kFloat16}) {
    for (int64_t dim : {64, 128}) {
      for (bool causal : {false, true}) {
        for (int64_t len : lens) {
          // About 16k tokens per batch, 16 heads of 128 (or 32 of 64): 2048 wide.
          const int64_t batch = std::max<int64_t>(1, 16384 / len);
          BenchAttention(t, batch, 2048 / dim, len, dim, causal, iters);
        }
      }
    }
  }
  // Lengths off a bucket boundary: cuDNN pads them (cudnn_sdpa.h); the
  // exact-length rows above are the comparison.
  for (int64_t len : quick ? std::vector<int64_t>{2000} : std::vector<int64_t>{1000, 2000, 4000}) {
    BenchAttention(DType::kBFloat16, std::max<int64_t>(1, 16384 / len), 16, len, 128, true, iters);
  }
  // fp32: the unfused path, 3xTF32 and full-fp32 GEMMs, and the fused fp32
  // kernel. These rows and the two layer features below decide whether the
  // fused kernels' routes become the default (docs/CUDA.md), so --quick
  // keeps them all.
  BenchAttention(DType::kFloat32, 4, 16, 2048, 128, false, iters);
  BenchAttention(DType::kFloat32, 4, 16, 2048, 128, true, iters);
  BenchAttention(DType::kFloat32, 8, 32, 1024, 64, false, iters);
  // Gemma 2's softcapping and a Mistral-sized window over a long prompt.
  BenchLayerFeature("softcap 50", 4, 16, 2048, 0, 50.0f, iters);
  BenchLayerFeature("window 4096", 1, 16, 16384, 4096, 0.0f, iters);
  for (DType t : {DType::kBFloat16, DType::kFloat16, DType::kFloat32}) {
    BenchCeiling(t, iters);
    for (int64_t rows : {4096, 16384}) {
      BenchProjection(t, rows, 4096, 4096, iters);
      BenchProjection(t, rows, 4096, 3 * 4096, iters);
    }
  }
  return 0;
}

}  // namespace
}  // namespace attnserve::cuda

int main(int argc, char** argv) { return attnserve::cuda::Main(argc, argv); }
