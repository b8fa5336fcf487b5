// stacked_gemm_probe: what stacking a batch's projection GEMMs costs and buys,
// and whether it keeps bitwise batch invariance. Compares the cpu engine's
// chunked stacking (engine/cpu/projection.h: fixed 32-row single-threaded
// matmuls on prepacked weights) with per-request GEMMs and one stacked GEMM.
// The bf16-compute columns are left out on CPUs where the engine computes bf16
// layers in fp32 (no AVX512_BF16 or AMX: cpu::HasBf16Matmuls()).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "bench/dnnl_matmul.h"
#include "engine/cpu/projection.h"

#ifdef _OPENMP
#include <omp.h>
#endif

namespace {

using attnserve::DType;
using attnserve::Precision;
using attnserve::Tensor;
using attnserve::cpu::ChunkedLinear;
using attnserve::cpu::LinearJob;
using attnserve::bench::MatmulCache;
using attnserve::bench::MatmulShape;

void Check(const absl::Status& s, const char* what) {
  if (!s.ok()) {
    std::fprintf(stderr, "%s: %s\n", what, std::string(s.message()).c_str());
    std::exit(1);
  }
}

// y [rows, n] = x [rows, k] w^T + b with w [n, k] read in place (transposed
// strides): the cpu engine's projections before chunked stacking.
void Linear(MatmulCache& cache, dnnl::stream& stream, const float* x, int64_t rows,
            const Tensor& w, const Tensor& b, float* y) {
  const int64_t n = w.shape()[0], k = w.shape()[1];
  MatmulShape s;
  s.src_dims = {rows, k};
  s.src_strides = {k, 1};
  s.wei_dims = {k, n};
  s.wei_strides = {1, k};
  s.dst_dims = {rows, n};
  s.dst_strides = {n, 1};
  s.has_bias = true;
  Check(cache.Execute(s, x, w.data_as<float>(), b.data_as<float>(), y, stream), "matmul");
}

// The engine's way: the requests' rows stacked, in chunks.
void Chunked(const ChunkedLinear& linear, const dnnl::engine& engine, const float* x,
             const std::vector<int64_t>& rows, float* y, int threads) {
  const attnserve::cpu::RowLayout layout = attnserve::cpu::LayoutRowsFor(linear, rows);
  LinearJob job;
  job.linear = &linear;
  job.rows = layout.total;
  int64_t done = 0;
  for (size_t i = 0; i < rows.size(); ++i) {
    job.in.push_back({layout.offsets[i], rows[i], DType::kFloat32, x + done * linear.in_features(),
                      linear.in_features()});
    job.out.push_back({layout.offsets[i], rows[i], DType::kFloat32,
                       y + done * linear.out_features(), linear.out_features()});
    done += rows[i];
  }
  Check(attnserve::cpu::RunLinearJobs({&job, 1}, engine, threads), "chunked");
}

Tensor RandomTensor(std::mt19937& rng, attnserve::Shape shape, float scale) {
  std::normal_distribution<float> normal;
  Tensor t(DType::kFloat32, std::move(shape));
  for (int64_t i = 0; i < t.num_elements(); ++i) t.data_as<float>()[i] = normal(rng) * scale;
  return t;
}

double Seconds(std::chrono::steady_clock::duration d) {
  return std::chrono::duration<double>(d).count();
}

template <typename Fn>
double TimeIt(int reps, Fn&& fn) {
  for (int warm = 0; warm < 5; ++warm) fn();
  const auto t0 = std::chrono::steady_clock::now();
  for (int rep = 0; rep < reps; ++rep) fn();
  return Seconds(std::chrono::steady_clock::now() - t0) / reps;
}

}  // namespace

int main() {
  constexpr int64_t kDim = 512;  // demo-mha: E 512, Q/K/V/O all 512 -> 512
  std::mt19937 rng(1);
  const Tensor wq = RandomTensor(rng, {kDim, kDim}, 0.05f), wk = RandomTensor(rng, {kDim, kDim}, 0.05f);
  const Tensor wv = RandomTensor(rng, {kDim, kDim}, 0.05f), wo = RandomTensor(rng, {kDim, kDim}, 0.05f);
  const Tensor bq = RandomTensor(rng, {kDim}, 1.0f), bk = RandomTensor(rng, {kDim}, 1.0f);
  const Tensor bv = RandomTensor(rng, {kDim}, 1.0f), bo = RandomTensor(rng, {kDim}, 1.0f);
  MatmulCache cache;
  dnnl::stream stream(cache.engine());
  int threads = 1;
#ifdef _OPENMP
  threads = omp_get_max_threads();
#endif
  auto make = [&](std::vector<const Tensor*> w, std::vector<const Tensor*> b, Precision p) {
    const DType compute = p == Precision::kBFloat16 ? DType::kBFloat16 : DType::kFloat32;
    auto l = ChunkedLinear::Create(cache.engine(), w, b, p, compute, DType::kFloat32);
    Check(l.status(), "ChunkedLinear");
    return std::move(*l);
  };
  const auto qkv = make({&wq, &wk, &wv}, {&bq, &bk, &bv}, Precision::kFloat32);
  const auto out = make({&wo}, {&bo}, Precision::kFloat32);
  const bool bf16 = attnserve::cpu::HasBf16Matmuls();
  std::unique_ptr<const ChunkedLinear> qkv_bf16, out_bf16;
  if (bf16) {
    qkv_bf16 = make({&wq, &wk, &wv}, {&bq, &bk, &bv}, Precision::kBFloat16);
    out_bf16 = make({&wo}, {&bo}, Precision::kBFloat16);
  } else {
    std::printf("bf16 compute: skipped (no AVX512_BF16 or AMX; the engine computes bf16 layers "
                "in fp32 here)\n");
  }
  std::printf("chunked primitives: rows independent of their position in a chunk: %s\n",
              qkv->rows_independent() && out->rows_independent() &&
                      (!bf16 || (qkv_bf16->rows_independent() && out_bf16->rows_independent()))
                  ? "yes"
                  : "NO (the engine aligns tasks to chunks)");

  // 1. Invariance: random batches of 2-32 requests of 1-64 tokens; each
  //    request's rows of the stacked product vs the request alone, for one
  //    stacked GEMM and for the engine's chunks (fp32 and bf16).
  std::uniform_int_distribution<int> len(1, 64), count(2, 32);
  int checked = 0, differ_stacked = 0, differ_chunked = 0, differ_bf16 = 0;
  for (int trial = 0; trial < 100; ++trial) {
    const int n = count(rng);
    std::vector<int64_t> rows(n), offset(n);
    int64_t total = 0;
    for (int i = 0; i < n; ++i) {
      rows[i] = len(rng);
      offset[i] = total;
      total += rows[i];
    }
    const Tensor x = RandomTensor(rng, {total, kDim}, 1.0f);
    std::vector<float> stacked(total * kDim), chunked(total * 3 * kDim), chunked_bf16;
    Linear(cache, stream, x.data_as<float>(), total, wq, bq, stacked.data());
    Chunked(*qkv, cache.engine(), x.data_as<float>(), rows, chunked.data(), threads);
    if (bf16) {
      chunked_bf16.resize(total * 3 * kDim);
      Chunked(*qkv_bf16, cache.engine(), x.data_as<float>(), rows, chunked_bf16.data(), threads);
    }
    for (int i = 0; i < n; ++i) {
      const float* xi = x.data_as<float>() + offset[i] * kDim;
      std::vector<float> alone(rows[i] * kDim), alone3(rows[i] * 3 * kDim);
      Linear(cache, stream, xi, rows[i], wq, bq, alone.data());
      differ_stacked += std::memcmp(alone.data(), stacked.data() + offset[i] * kDim,
                                    alone.size() * sizeof(float)) != 0;
      Chunked(*qkv, cache.engine(), xi, {rows[i]}, alone3.data(), threads);
      differ_chunked += std::memcmp(alone3.data(), chunked.data() + offset[i] * 3 * kDim,
                                    alone3.size() * sizeof(float)) != 0;
      if (bf16) {
        Chunked(*qkv_bf16, cache.engine(), xi, {rows[i]}, alone3.data(), threads);
        differ_bf16 += std::memcmp(alone3.data(), chunked_bf16.data() + offset[i] * 3 * kDim,
                                   alone3.size() * sizeof(float)) != 0;
      }
      ++checked;
    }
  }
  std::printf("invariance (%d requests in 100 random batches, %d threads): differ bitwise from "
              "alone: one stacked GEMM %d, chunked fp32 %d, chunked bf16 %s\n",
              checked, threads, differ_stacked, differ_chunked,
              bf16 ? std::to_string(differ_bf16).c_str() : "skipped");

  // 2. Cost of demo-mha's four projections (Q, K, V, O: 4 x [512 -> 512])
  //    over 32 requests of 16 tokens, and over one request alone.
  for (int requests : {32, 1}) {
    constexpr int64_t kTokens = 16;
    const int64_t total = requests * kTokens;
    const Tensor x = RandomTensor(rng, {total, kDim}, 1.0f);
    std::vector<float> y(total * 3 * kDim);
    const std::vector<int64_t> rows(requests, kTokens);
    const float* xp = x.data_as<float>();
    const int reps = requests == 1 ? 400 : 40;
    const double per_request = TimeIt(reps, [&] {
      for (const Tensor* w : {&wq, &wk, &wv, &wo}) {
        for (int r = 0; r < requests; ++r) {
          Linear(cache, stream, xp + r * kTokens * kDim, kTokens, *w, bq, y.data() + r * kTokens * kDim);
        }
      }
    });
    const double stacked = TimeIt(reps, [&] {
      for (const Tensor* w : {&wq, &wk, &wv, &wo}) Linear(cache, stream, xp, total, *w, bq, y.data());
    });
    const double chunked = TimeIt(reps, [&] {
      Chunked(*qkv, cache.engine(), xp, rows, y.data(), threads);
      Chunked(*out, cache.engine(), xp, rows, y.data(), threads);
    });
    const double gflop = 2.0 * total * kDim * kDim * 4 / 1e9;
    std::string bf16_time = "skipped";
    if (bf16) {
      const double chunked_bf16 = TimeIt(reps, [&] {
        Chunked(*qkv_bf16, cache.engine(), xp, rows, y.data(), threads);
        Chunked(*out_bf16, cache.engine(), xp, rows, y.data(), threads);
      });
      char buf[64];
      std::snprintf(buf, sizeof buf, "%8.1f us (%.0f GFLOP/s)", chunked_bf16 * 1e6,
                    gflop / chunked_bf16);
      bf16_time = buf;
    }
    std::printf("%2d x %lld tokens, 4 x [%lld -> %lld], %d threads: per request %8.1f us, one "
                "stacked GEMM %8.1f us, engine chunks fp32 %8.1f us (%.0f GFLOP/s), bf16 %s\n",
                requests, static_cast<long long>(kTokens), static_cast<long long>(kDim),
                static_cast<long long>(kDim), threads, per_request * 1e6, stacked * 1e6,
                chunked * 1e6, gflop / chunked, bf16_time.c_str());
  }
  return 0;
}
