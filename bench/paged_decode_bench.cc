// One batched decode step of many sessions through the CPU flash kernel with
// paged K/V (AttentionParams::k_blocks), next to its two peers measured in
// the same process: a read of the same K/V bytes (the memory-bandwidth bound
// of the step; issue 17 asks for the step within 1.5x of it) and the same
// step with contiguous K/V. docs/PERFORMANCE.md, "Paged decode".
//
// Per session: one query token, Hq heads over Hkv kv heads, context Lk, head
// dim 128, causal. The sessions' blocks come from one pool in a scrambled
// order (as a cache that has served for a while hands them out), and the
// pool is far larger than the last-level cache, so every step reads K/V
// from memory.
//
// "Time" is wall-clock; "CPU" the whole process's CPU time (every thread):
// on a shared host the CPU-time ratios are the steadier figures.
#include <immintrin.h>
#include <omp.h>
#include <sys/mman.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "benchmark/benchmark.h"
#include "engine/attention_params.h"
#include "engine/cpu/flash_attention.h"
#include "engine/tensor.h"

namespace attnserve {
namespace {

struct DecodeShape {
  int64_t sessions, context, hq, hkv, d, block_tokens;
  DType dtype;
  // > 0: a sliding window; the blocks before FirstWindowKey are released
  // (null, never allocated), as a session of a windowed model leaves them.
  int64_t window = 0;
};

struct FreeDeleter {
  void operator()(void* p) const { std::free(p); }
};
using Bytes = std::unique_ptr<uint8_t, FreeDeleter>;

// 2 MiB aligned, and backed by transparent huge pages where the kernel
// allows (ATTNSERVE_BENCH_HUGEPAGES=0: not asked for): a scrambled block
// table touches a new 4 KiB page every block, so 4 KiB pages would make
// this a TLB benchmark.
Bytes AllocBytes(size_t n) {
  constexpr size_t kHuge = size_t{2} << 20;
  const size_t bytes = (n + kHuge - 1) / kHuge * kHuge;
  void* p = std::aligned_alloc(kHuge, bytes);
  const char* env = std::getenv("ATTNSERVE_BENCH_HUGEPAGES");
  if (p != nullptr && (env == nullptr || std::string(env) != "0")) madvise(p, bytes, MADV_HUGEPAGE);
  return Bytes(static_cast<uint8_t*>(p));
}

// Fills `n` elements of `dt` with values in [-1, 1): a 64 KiB random
// pattern repeated at shifting offsets (fast to write, not constant),
// written by the threads that will read it.
void FillValues(void* dst, DType dt, int64_t n, int threads) {
  constexpr int64_t kPattern = 16 * 1024;
  std::vector<uint8_t> pattern(static_cast<size_t>(kPattern) * 2 * DTypeSize(dt));
  std::mt19937 gen(7);
  for (int64_t i = 0; i < 2 * kPattern; ++i)
    StoreFromFloat(dt, pattern.data(), i, static_cast<float>(gen() % 2000) / 1000.0f - 1.0f);
  const int64_t es = static_cast<int64_t>(DTypeSize(dt));
  const int64_t chunks = (n + kPattern - 1) / kPattern;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t len = std::min(kPattern, n - c * kPattern);
    std::memcpy(static_cast<char*>(dst) + c * kPattern * es, pattern.data() + (c * 977 % kPattern) * es,
                static_cast<size_t>(len * es));
  }
}

// The sessions of one decode step: K and V blocks in one scrambled pool,
// optionally the same K/V contiguous, one query token each.
struct DecodeStep {
  DecodeShape s;
  int64_t block_elems_k, blocks_per_session, first_block;
  Bytes pool, contiguous, q, out;
  std::vector<std::vector<const void*>> k_blocks, v_blocks;
  std::vector<AttentionParams> paged_params, contiguous_params;

  // The K/V bytes a step reads: the blocks it holds.
  int64_t KvBytes() const {
    return s.sessions * 2 * (blocks_per_session - first_block) * block_elems_k *
           static_cast<int64_t>(DTypeSize(s.dtype));
  }

  DecodeStep(const DecodeShape& shape, bool with_contiguous, int threads) : s(shape) {
    const int64_t es = static_cast<int64_t>(DTypeSize(s.dtype));
    blocks_per_session = (s.context + s.block_tokens - 1) / s.block_tokens;
    first_block = FirstWindowKey(s.context - 1, s.window, 0) / s.block_tokens;
    block_elems_k = s.hkv * s.block_tokens * s.d;
    const int64_t blocks = 2 * s.sessions * (blocks_per_session - first_block);  // K and V
    const int64_t pool_elems = blocks * block_elems_k;
    pool = AllocBytes(static_cast<size_t>(pool_elems * es));
    FillValues(pool.get(), s.dtype, pool_elems, threads);
    std::vector<int64_t> slot(static_cast<size_t>(blocks));
    std::iota(slot.begin(), slot.end(), int64_t{0});
    std::shuffle(slot.begin(), slot.end(), std::mt19937(11));
    size_t next = 0;
    k_blocks.resize(static_cast<size_t>(s.sessions));
    v_blocks.resize(static_cast<size_t>(s.sessions));
    for (int64_t i = 0; i < s.sessions; ++i)
      for (int64_t b = 0; b < blocks_per_session; ++b) {
        if (b < first_block) {  // released: outside the window
          k_blocks[static_cast<size_t>(i)].push_back(nullptr);
          v_blocks[static_cast<size_t>(i)].push_back(nullptr);
          continue;
        }
        k_blocks[static_cast<size_t>(i)].push_back(pool.get() + slot[next++] * block_elems_k * es);
        v_blocks[static_cast<size_t>(i)].push_back(pool.get() + slot[next++] * block_elems_k * es);
      }
    const int64_t q_elems = s.sessions * s.hq * s.d;
    q = AllocBytes(static_cast<size_t>(q_elems * es));
    FillValues(q.get(), s.dtype, q_elems, 1);
    out = AllocBytes(static_cast<size_t>(q_elems) * 4);
    const int64_t kv_elems = s.hkv * s.context * s.d;  // per session, K or V
    if (with_contiguous) {
      // The same values, [session][K|V][Hkv][Lk][D].
      contiguous = AllocBytes(static_cast<size_t>(2 * s.sessions * kv_elems * es));
#pragma omp parallel for num_threads(threads) schedule(static)
      for (int64_t i = 0; i < s.sessions; ++i)
        for (int64_t kv = 0; kv < 2; ++kv)
          for (int64_t h = 0; h < s.hkv; ++h)
            for (int64_t b = 0; b < blocks_per_session; ++b) {
              const int64_t t0 = b * s.block_tokens, n = std::min(s.block_tokens, s.context - t0);
              const auto& table = kv == 0 ? k_blocks : v_blocks;
              std::memcpy(contiguous.get() + (((i * 2 + kv) * s.hkv + h) * s.context + t0) * s.d * es,
                          static_cast<const uint8_t*>(table[static_cast<size_t>(i)][static_cast<size_t>(b)]) +
                              h * s.block_tokens * s.d * es,
                          static_cast<size_t>(n * s.d * es));
            }
    }
    for (int64_t i = 0; i < s.sessions; ++i) {
      AttentionParams p;
      p.batch = 1;
      p.num_heads = s.hq;
      p.num_kv_heads = s.hkv;
      p.head_dim = p.head_dim_v = s.d;
      p.q_len = 1;
      p.kv_len = s.context;
      p.dtype = s.dtype;
      p.out_dtype = DType::kFloat32;
      SetContiguousStrides(&p, HeadLayoutStrides);
      p.q = q.get() + i * s.hq * s.d * es;
      p.out = out.get() + i * s.hq * s.d * 4;
      p.causal = true;
      p.window = s.window;
      p.scale = 1.0f / std::sqrt(static_cast<float>(s.d));
      AttentionParams paged = p;
      paged.k_blocks = k_blocks[static_cast<size_t>(i)].data();
      paged.v_blocks = v_blocks[static_cast<size_t>(i)].data();
      paged.block_tokens = s.block_tokens;
      paged_params.push_back(paged);
      if (with_contiguous) {
        p.k = contiguous.get() + (i * 2) * kv_elems * es;
        p.v = contiguous.get() + (i * 2 + 1) * kv_elems * es;
        contiguous_params.push_back(p);
      }
    }
  }
};

// Sum of 64-bit words over [p, p + bytes) (a multiple of 128): four
// independent AVX2 accumulators, so the loads, not the adds, set the pace.
__attribute__((target("avx2"))) uint64_t ReadBytesAvx2(const void* p, int64_t bytes) {
  const __m256i* v = static_cast<const __m256i*>(p);
  __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
  for (int64_t i = 0; i < bytes / 32; i += 4) {
    a0 = _mm256_add_epi64(a0, _mm256_load_si256(v + i));
    a1 = _mm256_add_epi64(a1, _mm256_load_si256(v + i + 1));
    a2 = _mm256_add_epi64(a2, _mm256_load_si256(v + i + 2));
    a3 = _mm256_add_epi64(a3, _mm256_load_si256(v + i + 3));
  }
  const __m256i s = _mm256_add_epi64(_mm256_add_epi64(a0, a1), _mm256_add_epi64(a2, a3));
  alignas(32) uint64_t lanes[4];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), s);
  return lanes[0] + lanes[1] + lanes[2] + lanes[3];
}
uint64_t ReadBytesScalar(const void* p, int64_t bytes) {
  const uint64_t* w = static_cast<const uint64_t*>(p);
  uint64_t a0 = 0, a1 = 0, a2 = 0, a3 = 0;
  for (int64_t i = 0; i < bytes / 8; i += 4) {
    a0 += w[i];
    a1 += w[i + 1];
    a2 += w[i + 2];
    a3 += w[i + 3];
  }
  return a0 + a1 + a2 + a3;
}

// The process's memory on transparent huge pages, MiB (smaps_rollup).
double HugePagesMiB() {
  std::ifstream f("/proc/self/smaps_rollup");
  std::string line;
  while (std::getline(f, line)) {
    if (line.rfind("AnonHugePages:", 0) == 0) return std::stod(line.substr(14)) / 1024;
  }
  return -1;
}

void SetBytesCounter(benchmark::State& state, const DecodeStep& step) {
  state.counters["THP_MiB"] = HugePagesMiB();
  state.counters["KV_MiB"] = static_cast<double>(step.KvBytes()) / (1 << 20);
  state.counters["GBps"] = benchmark::Counter(static_cast<double>(step.KvBytes()),
                                              benchmark::Counter::kIsIterationInvariantRate);
}

// The peer: every K/V block of every session read once (what a decode
// step must read), blocks spread over the threads.
void BM_ReadKv(benchmark::State& state, DecodeShape s, int threads) {
  DecodeStep step(s, false, threads);
  const int64_t block_bytes = step.block_elems_k * static_cast<int64_t>(DTypeSize(s.dtype));
  std::vector<const void*> blocks;
  for (int64_t i = 0; i < s.sessions; ++i) {
    for (const void* b : step.k_blocks[static_cast<size_t>(i)]) {
      if (b != nullptr) blocks.push_back(b);
    }
    for (const void* b : step.v_blocks[static_cast<size_t>(i)]) {
      if (b != nullptr) blocks.push_back(b);
    }
  }
  const bool avx2 = __builtin_cpu_supports("avx2");
  const int64_t n = static_cast<int64_t>(blocks.size());
  for (auto _ : state) {
    uint64_t sum = 0;
#pragma omp parallel for num_threads(threads) schedule(static) reduction(+ : sum)
    for (int64_t b = 0; b < n; ++b)
      sum += avx2 ? ReadBytesAvx2(blocks[static_cast<size_t>(b)], block_bytes)
                  : ReadBytesScalar(blocks[static_cast<size_t>(b)], block_bytes);
    benchmark::DoNotOptimize(sum);
  }
  SetBytesCounter(state, step);
}

void BM_Decode(benchmark::State& state, DecodeShape s, bool paged, int threads) {
  DecodeStep step(s, !paged, threads);
  cpu::FlashOptions opt;
  opt.num_threads = threads;
  const std::vector<AttentionParams>& params = paged ? step.paged_params : step.contiguous_params;
  if (absl::Status st = cpu::FlashAttention(params, opt); !st.ok()) {
    state.SkipWithError(std::string(st.message()).c_str());
    return;
  }
  for (auto _ : state) benchmark::DoNotOptimize(cpu::FlashAttention(params, opt));
  SetBytesCounter(state, step);
  state.counters["sessions_per_s"] =
      benchmark::Counter(static_cast<double>(s.sessions), benchmark::Counter::kIsIterationInvariantRate);
}

void RegisterAll() {
  const int max_threads = omp_get_max_threads();
  std::vector<int> thread_counts = {1};
  if (max_threads >= 2) thread_counts.push_back(2);
  if (max_threads > 2) thread_counts.push_back(max_threads);
  // 32 sessions at context 4096, head dim 128, 32 query heads: GQA over 8
  // kv heads (fp16 512 MiB, fp32 1 GiB of K/V per step) and MHA over 32
  // (fp16 2 GiB); 16-token blocks (vLLM's default) and 256.
  const std::vector<DecodeShape> shapes = {
      {32, 4096, 32, 8, 128, 16, DType::kFloat16},  {32, 4096, 32, 8, 128, 16, DType::kFloat32},
      {32, 4096, 32, 32, 128, 16, DType::kFloat16}, {32, 4096, 32, 8, 128, 256, DType::kFloat16},
      // MHA with 8 heads: what bench/session_decode.sh asks of the server.
      {32, 4096, 8, 8, 128, 16, DType::kFloat16},
      // Grouped-query heads around flash::kDirectMaxRows (7 rows per kv
      // head read K/V in place, 8 pack K): Qwen2.5-14B's 40/8, 48/8,
      // Qwen2.5-7B's 28/4, and 64/8 (Llama-3-70B, gpt-oss); bf16 too.
      {32, 4096, 40, 8, 128, 16, DType::kFloat16},  {32, 4096, 48, 8, 128, 16, DType::kFloat16},
      {32, 4096, 28, 4, 128, 16, DType::kFloat16},  {32, 4096, 64, 8, 128, 16, DType::kFloat16},
      {32, 4096, 40, 8, 128, 16, DType::kBFloat16}, {32, 4096, 28, 4, 128, 16, DType::kBFloat16},
      // The same at context 32768 with a 4096-token sliding window: the
      // session holds (and the step reads) about the window.
      {32, 32768, 8, 8, 128, 16, DType::kFloat16, 4096},
  };
  for (const DecodeShape& s : shapes) {
    const std::string name =
        absl::StrCat("S", s.sessions, "_Lk", s.context, s.window > 0 ? absl::StrCat("_W", s.window) : "",
                     "_H", s.hq, "_KV", s.hkv, "_D", s.d, "/",
                     s.dtype == DType::kFloat16    ? "fp16"
                     : s.dtype == DType::kBFloat16 ? "bf16"
                                                   : "fp32",
                     "/block:", s.block_tokens);
    for (int t : thread_counts) {
      const std::string suffix = absl::StrCat("/threads:", t);
      benchmark::RegisterBenchmark(absl::StrCat("ReadKv/", name, suffix).c_str(), BM_ReadKv, s, t)
          ->Unit(benchmark::kMillisecond)
          ->MeasureProcessCPUTime()
          ->UseRealTime();
      benchmark::RegisterBenchmark(absl::StrCat("PagedDecode/", name, suffix).c_str(), BM_Decode, s, true, t)
          ->Unit(benchmark::kMillisecond)
          ->MeasureProcessCPUTime()
          ->UseRealTime();
      if (s.block_tokens == 16 && s.window == 0) {  // the contiguous step does not depend on the block size
        benchmark::RegisterBenchmark(absl::StrCat("ContiguousDecode/", name, suffix).c_str(), BM_Decode, s,
                                     false, t)
            ->Unit(benchmark::kMillisecond)
            ->MeasureProcessCPUTime()
            ->UseRealTime();
      }
    }
  }
}

}  // namespace
}  // namespace attnserve

int main(int argc, char** argv) {
  attnserve::RegisterAll();
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
