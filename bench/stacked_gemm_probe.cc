// stacked_gemm_probe: may a batch's projection GEMMs be stacked (all tokens of
// all requests in one oneDNN matmul) without breaking bitwise batch
// invariance, and what does keeping them per request cost? Checks each
// request's rows of the stacked product against the same request alone, then
// times per-request vs stacked for a batch like the serving benchmark's.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "engine/cpu/dnnl_matmul.h"

#ifdef _OPENMP
#include <omp.h>
#endif

namespace {

using attnserve::cpu::MatmulCache;
using attnserve::cpu::MatmulShape;

// y [rows, n] = x [rows, k] w^T + b, w [n, k] (PyTorch Linear layout), as the
// cpu engine's projections do it.
void Linear(MatmulCache& cache, dnnl::stream& stream, const float* x, int64_t rows,
            const float* w, const float* b, int64_t n, int64_t k, float* y) {
  MatmulShape s;
  s.src_dims = {rows, k};
  s.src_strides = {k, 1};
  s.wei_dims = {k, n};
  s.wei_strides = {1, k};
  s.dst_dims = {rows, n};
  s.dst_strides = {n, 1};
  s.has_bias = true;
  absl::Status st = cache.Execute(s, x, w, b, y, stream);
  if (!st.ok()) {
    std::fprintf(stderr, "matmul: %s\n", std::string(st.message()).c_str());
    std::exit(1);
  }
}

// The batch-invariant-by-construction way to stack: fixed chunks of kChunk
// rows (the tail zero-padded), each one single-threaded matmul of the same
// shape, chunks spread over threads. Every row then goes through the same
// kernel with the same reduction order whatever its co-tenants, M or
// thread count (oneDNN runs single-threaded inside a parallel region).
constexpr int64_t kChunk = 32;
void ChunkedLinear(MatmulCache& cache, const float* x, int64_t rows, const float* w,
                   const float* b, int64_t n, int64_t k, float* y) {
  const int64_t chunks = (rows + kChunk - 1) / kChunk;
#pragma omp parallel for schedule(static)
  for (int64_t c = 0; c < chunks; ++c) {
    dnnl::stream stream(cache.engine());
    const int64_t r0 = c * kChunk, r = std::min(kChunk, rows - r0);
    if (r == kChunk) {
      Linear(cache, stream, x + r0 * k, kChunk, w, b, n, k, y + r0 * n);
    } else {
      std::vector<float> xin(kChunk * k, 0.0f), yout(kChunk * n);
      std::memcpy(xin.data(), x + r0 * k, r * k * sizeof(float));
      Linear(cache, stream, xin.data(), kChunk, w, b, n, k, yout.data());
      std::memcpy(y + r0 * n, yout.data(), r * n * sizeof(float));
    }
  }
}

double Seconds(std::chrono::steady_clock::duration d) {
  return std::chrono::duration<double>(d).count();
}

}  // namespace

int main() {
  constexpr int64_t kIn = 512, kOut = 512;  // demo-mha's Q projection
  std::mt19937 rng(1);
  std::normal_distribution<float> normal;
  std::vector<float> w(kIn * kOut), b(kOut);
  for (float& v : w) v = normal(rng) * 0.05f;
  for (float& v : b) v = normal(rng);
  MatmulCache cache;
  dnnl::stream stream(cache.engine());

  // 1. Invariance: random batches of requests of 1..64 tokens; each
  //    request's rows of the stacked product vs the request alone.
  int checked = 0, differing = 0;
  std::uniform_int_distribution<int> len(1, 64), count(2, 32);
  for (int trial = 0; trial < 200; ++trial) {
    const int n = count(rng);
    std::vector<int64_t> rows(n), offset(n);
    int64_t total = 0;
    for (int i = 0; i < n; ++i) {
      rows[i] = len(rng);
      offset[i] = total;
      total += rows[i];
    }
    std::vector<float> x(total * kIn), stacked(total * kOut);
    for (float& v : x) v = normal(rng);
    Linear(cache, stream, x.data(), total, w.data(), b.data(), kOut, kIn, stacked.data());
    for (int i = 0; i < n; ++i) {
      std::vector<float> alone(rows[i] * kOut);
      Linear(cache, stream, x.data() + offset[i] * kIn, rows[i], w.data(), b.data(), kOut, kIn,
             alone.data());
      ++checked;
      if (std::memcmp(alone.data(), stacked.data() + offset[i] * kOut,
                      alone.size() * sizeof(float)) != 0) {
        ++differing;
      }
    }
  }
  std::printf("invariance: %d of %d requests differ bitwise between stacked and alone\n",
              differing, checked);

  // 1b. The chunked stacking against a lone request run the same way.
  checked = differing = 0;
  for (int trial = 0; trial < 200; ++trial) {
    const int n = count(rng);
    std::vector<int64_t> rows(n), offset(n);
    int64_t total = 0;
    for (int i = 0; i < n; ++i) {
      rows[i] = len(rng);
      offset[i] = total;
      total += rows[i];
    }
    std::vector<float> x(total * kIn), stacked(total * kOut);
    for (float& v : x) v = normal(rng);
    ChunkedLinear(cache, x.data(), total, w.data(), b.data(), kOut, kIn, stacked.data());
    for (int i = 0; i < n; ++i) {
      std::vector<float> alone(rows[i] * kOut);
      ChunkedLinear(cache, x.data() + offset[i] * kIn, rows[i], w.data(), b.data(), kOut, kIn,
                    alone.data());
      ++checked;
      differing += std::memcmp(alone.data(), stacked.data() + offset[i] * kOut,
                               alone.size() * sizeof(float)) != 0;
    }
  }
  std::printf("invariance (chunked): %d of %d requests differ bitwise\n", differing, checked);

  // 2. Cost: 32 requests of 16 tokens (the serving benchmark's batch), per
  //    request vs stacked, Q/K/V/O shaped (4 projections).
  constexpr int kRequests = 32, kTokens = 16, kReps = 200;
  std::vector<float> x(kRequests * kTokens * kIn), y(kRequests * kTokens * kOut);
  for (float& v : x) v = normal(rng);
  auto time_it = [&](int mode) {  // 0 per request, 1 stacked, 2 chunked
    for (int warm = 0; warm < 10; ++warm) {
      Linear(cache, stream, x.data(), kRequests * kTokens, w.data(), b.data(), kOut, kIn, y.data());
    }
    const auto t0 = std::chrono::steady_clock::now();
    for (int rep = 0; rep < kReps; ++rep) {
      for (int proj = 0; proj < 4; ++proj) {
        if (mode == 1) {
          Linear(cache, stream, x.data(), kRequests * kTokens, w.data(), b.data(), kOut, kIn,
                 y.data());
        } else if (mode == 2) {
          ChunkedLinear(cache, x.data(), kRequests * kTokens, w.data(), b.data(), kOut, kIn,
                        y.data());
        } else {
          for (int r = 0; r < kRequests; ++r) {
            Linear(cache, stream, x.data() + r * kTokens * kIn, kTokens, w.data(), b.data(), kOut,
                   kIn, y.data() + r * kTokens * kOut);
          }
        }
      }
    }
    return Seconds(std::chrono::steady_clock::now() - t0) / kReps;
  };
  const double per_request = time_it(0), stacked = time_it(1), chunked = time_it(2);
  int threads = 1;
#ifdef _OPENMP
  threads = omp_get_max_threads();
#endif
  std::printf("projections of %d x %d tokens (4 x [%lld -> %lld]), %d threads: per request "
              "%.1f us, stacked %.1f us, chunked %.1f us; per-request cost %.2fx of stacked, "
              "%.2fx of chunked\n",
              kRequests, kTokens, static_cast<long long>(kIn), static_cast<long long>(kOut),
              threads, per_request * 1e6, stacked * 1e6, chunked * 1e6, per_request / stacked,
              per_request / chunked);
  return 0;
}
