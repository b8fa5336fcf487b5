// Google Benchmark for the CPU engine on the shapes: the fused
// attention core (fp32 and bf16), the full projection layer, and the
// machine's ceilings measured the same way (oneDNN matmul on the core's GEMM
// sizes, a STREAM triad), the extra peak RSS of long sequences, and
// demo-mha batches of 16-token requests (the batching case of issue 3).
// bench/compare_peers.py runs this with --benchmark_format=json next to
// PyTorch and prints the ratios; docs/PERFORMANCE.md records them.
//
// Names: <what>/<shape>/<dtype>/threads:<n>. Counters: GFLOPs (useful
// multiply-adds x 2 per second), GBps (bytes per second; for the core, the
// K/V bytes a decode step must read), extra_MiB.
#include <omp.h>
#include <stdio.h>

#include <cmath>
#include <cstring>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "benchmark/benchmark.h"
#include "engine/attention_engine.h"
#include "engine/attention_layer.h"
#include "engine/attention_task.h"
#include "engine/cpu/flash_attention.h"
#include "engine/model/builtin_models.h"
#include "engine/tensor.h"
#include "oneapi/dnnl/dnnl.hpp"

namespace attnserve {
namespace {

// The shapes. MHA shapes are self-attention with head_dim E / H.
struct BenchShape {
  const char* name;
  int64_t batch, q_len, kv_len, heads, head_dim;
  bool layer;  // also benchmark the nn.MultiheadAttention layer (E = H * D)
};
const BenchShape kShapes[] = {
    {"B1_L128_E512_H8", 1, 128, 128, 8, 64, true},
    {"B8_L512_E768_H12", 8, 512, 512, 12, 64, true},
    {"B1_L2048_E1024_H16", 1, 2048, 2048, 16, 64, true},
    {"B32_L64_E256_H4", 32, 64, 64, 4, 64, true},
    {"decode_B16_Lk1024_H16_D64", 16, 1, 1024, 16, 64, false},
    {"long_B1_L8192_H16_D64", 1, 8192, 8192, 16, 64, false},
    // Short key sequences of the serving benchmarks (issue 3): the 16 MiB
    // sdpa payload of bench/overhead.sh, and 32 demo-mha requests' cores.
    {"few_keys_B1_L65536_Lk8_H1_D64", 1, 65536, 8, 1, 64, false},
    {"short_B32_L16_H8_D64", 32, 16, 16, 8, 64, false},
};

double CoreFlops(const BenchShape& s) {
  return 4.0 * s.batch * s.heads * s.q_len * s.kv_len * s.head_dim;
}

// Fills a tensor with values in [-1, 1) (deterministic).
Tensor RandomTensor(DType dtype, Shape shape, uint64_t seed) {
  Tensor t(dtype, std::move(shape));
  SplitMix64 rng(seed);
  for (int64_t i = 0; i < t.num_elements(); ++i) StoreFromFloat(dtype, t.data(), i, rng.Uniform(1.0f));
  return t;
}

// Inputs and output of one sdpa request in head layout.
struct CoreInputs {
  Tensor q, k, v, out;
  AttentionParams p;
  CoreInputs(const BenchShape& s, DType dtype) {
    q = RandomTensor(dtype, {s.batch, s.heads, s.q_len, s.head_dim}, 1);
    k = RandomTensor(dtype, {s.batch, s.heads, s.kv_len, s.head_dim}, 2);
    v = RandomTensor(dtype, {s.batch, s.heads, s.kv_len, s.head_dim}, 3);
    out = Tensor(dtype, {s.batch, s.heads, s.q_len, s.head_dim});
    std::memset(out.data(), 0, out.byte_size());
    p.batch = s.batch;
    p.num_heads = p.num_kv_heads = s.heads;
    p.head_dim = p.head_dim_v = s.head_dim;
    p.q_len = s.q_len;
    p.kv_len = s.kv_len;
    p.dtype = p.out_dtype = dtype;
    p.q = q.data();
    p.k = k.data();
    p.v = v.data();
    p.out = out.data();
    HeadLayoutStrides(s.heads, s.q_len, s.head_dim, &p.q_stride_b, &p.q_stride_h, &p.q_stride_row);
    HeadLayoutStrides(s.heads, s.kv_len, s.head_dim, &p.k_stride_b, &p.k_stride_h, &p.k_stride_row);
    HeadLayoutStrides(s.heads, s.kv_len, s.head_dim, &p.v_stride_b, &p.v_stride_h, &p.v_stride_row);
    HeadLayoutStrides(s.heads, s.q_len, s.head_dim, &p.o_stride_b, &p.o_stride_h, &p.o_stride_row);
    p.scale = 1.0f / std::sqrt(static_cast<float>(s.head_dim));
  }
};

// Inputs of one self-attention request as the cpu engine's fused [Wq; Wk; Wv]
// projection leaves them: rows [B, L, 3 * H * D] (each token's q, k and v
// side by side), output rows [B, L, H * D]. The core reads them with row
// strides of 3E elements (12 KiB at E = 1024), not head_dim.
struct FusedCoreInputs {
  Tensor qkv, out;
  AttentionParams p;
  FusedCoreInputs(const BenchShape& s, DType dtype) {
    const int64_t e = s.heads * s.head_dim;
    // 64-byte aligned starts, as the engine's activation buffers have (a
    // Tensor's bytes start 16 bytes into a page): a head's 256-byte slice
    // of an output row then covers whole cache lines, and two threads
    // writing neighbouring heads never share one.
    const int64_t slack = 64 / static_cast<int64_t>(DTypeSize(dtype));
    qkv = RandomTensor(dtype, {s.batch * s.q_len * 3 * e + slack}, 1);
    out = Tensor(dtype, {s.batch * s.q_len * e + slack});
    std::memset(out.data(), 0, out.byte_size());
    p.batch = s.batch;
    p.num_heads = p.num_kv_heads = s.heads;
    p.head_dim = p.head_dim_v = s.head_dim;
    p.q_len = p.kv_len = s.q_len;
    p.dtype = p.out_dtype = dtype;
    const size_t es = DTypeSize(dtype);
    auto align64 = [](void* x) {
      return reinterpret_cast<unsigned char*>((reinterpret_cast<uintptr_t>(x) + 63) & ~uintptr_t{63});
    };
    unsigned char* base = align64(qkv.data());
    p.q = base;
    p.k = base + e * es;
    p.v = base + 2 * e * es;
    p.out = align64(out.data());
    p.q_stride_b = p.k_stride_b = p.v_stride_b = s.q_len * 3 * e;
    p.q_stride_h = p.k_stride_h = p.v_stride_h = s.head_dim;
    p.q_stride_row = p.k_stride_row = p.v_stride_row = 3 * e;
    p.o_stride_b = s.q_len * e;
    p.o_stride_h = s.head_dim;
    p.o_stride_row = e;
    p.scale = 1.0f / std::sqrt(static_cast<float>(s.head_dim));
  }
};

// The fused attention core (what nn.MultiheadAttention calls between its
// projections; non-causal, no mask), on inputs in head layout or (`Inputs` =
// FusedCoreInputs) as the engine's fused projection leaves them.
// Times the flash kernel on `p` at `threads`; false (the state skipped with
// the error) when the kernel refuses it.
bool TimeFlash(benchmark::State& state, const AttentionParams& p, int threads) {
  cpu::FlashOptions opt;
  opt.num_threads = threads;
  if (absl::Status st = cpu::FlashAttention({p}, opt); !st.ok()) {
    state.SkipWithError(std::string(st.message()).c_str());
    return false;
  }
  for (auto _ : state) {
    benchmark::DoNotOptimize(cpu::FlashAttention({p}, opt));
    benchmark::ClobberMemory();
  }
  state.SetLabel(std::string(cpu::CpuIsaName(*cpu::FlashIsaFor(p, opt))));
  return true;
}

template <typename Inputs = CoreInputs>
void BM_Core(benchmark::State& state, BenchShape s, DType dtype, int threads) {
  Inputs in(s, dtype);
  if (!TimeFlash(state, in.p, threads)) return;
  state.counters["GFLOPs"] = benchmark::Counter(CoreFlops(s), benchmark::Counter::kIsIterationInvariantRate);
  const double kv_bytes = 2.0 * s.batch * s.heads * s.kv_len * s.head_dim * DTypeSize(dtype);
  state.counters["GBps"] = benchmark::Counter(kv_bytes, benchmark::Counter::kIsIterationInvariantRate);
}

// The position biases bench/position_bias.py weighs.
enum class PositionBias { kNone, kAlibi, kRelative, kEmbedded };

// The core, causal or not, plain or with a position bias: ALiBi (BLOOM's
// slopes, 2^-8h/H: head h's scores biased by slope_h * (key - query
// position)) or a relative bias table of T5's reach (128 keys each way,
// values in [-1, 1]), or relative position embeddings of DeBERTa v3's reach
// (512 positions each way; both terms, tables in [-1, 1]).
void BM_CoreBiased(benchmark::State& state, BenchShape s, DType dtype, int threads, bool causal,
                   PositionBias bias) {
  CoreInputs in(s, dtype);
  in.p.causal = causal;
  std::vector<float> slopes;
  for (int64_t h = 0; h < s.heads; ++h) {
    slopes.push_back(std::exp2(-8.0f * static_cast<float>(h + 1) / static_cast<float>(s.heads)));
  }
  constexpr int64_t kDistance = 128;
  const Tensor table = RandomTensor(DType::kFloat32, {s.heads, 2 * kDistance + 1}, 7);
  if (bias == PositionBias::kAlibi) in.p.alibi_slopes = slopes.data();
  if (bias == PositionBias::kRelative) {
    in.p.relative_bias = table.data_as<float>();
    in.p.relative_bias_distance = kDistance;
  }
  constexpr int64_t kReach = 512;
  Tensor key_table, query_table;
  if (bias == PositionBias::kEmbedded) {
    key_table = RandomTensor(DType::kFloat32, {s.heads, s.head_dim, 2 * kReach + 1}, 8);
    query_table = RandomTensor(DType::kFloat32, {s.heads, s.head_dim, 2 * kReach + 1}, 9);
    in.p.relative_key = key_table.data_as<float>();
    in.p.relative_query = query_table.data_as<float>();
    in.p.relative_embedding_distance = kReach;
  }
  TimeFlash(state, in.p, threads);
}

// The GEMM ceiling of the core: oneDNN's batched matmuls S = Q K^T and
// O = P V on the same sizes (fp32, or bf16 in / fp32 accumulate), no
// softmax. The long shape is run one head at a time (its full S would be
// 4 GiB) and counted as all heads.
void BM_GemmCeiling(benchmark::State& state, BenchShape s, DType dtype, int threads) {
  using dnnl::memory;
  omp_set_num_threads(threads);
  dnnl::engine eng(dnnl::engine::kind::cpu, 0);
  dnnl::stream stream(eng);
  const bool per_head = s.q_len * s.kv_len > (int64_t{64} << 20) / s.heads;
  const int64_t bh = per_head ? 1 : s.batch * s.heads;
  const int64_t repeats = per_head ? s.batch * s.heads : 1;
  const int64_t m = s.q_len, n = s.kv_len, d = s.head_dim;
  const memory::data_type dt = dtype == DType::kBFloat16 ? memory::data_type::bf16 : memory::data_type::f32;
  const memory::data_type acc = memory::data_type::f32;
  // S = Q [bh, m, d] x K^T (K [bh, n, d] read transposed) -> [bh, m, n].
  memory::desc q_md({bh, m, d}, dt, memory::format_tag::abc);
  memory::desc kt_md({bh, d, n}, dt, memory::dims{n * d, 1, d});
  memory::desc s_md({bh, m, n}, acc, memory::format_tag::abc);
  // O = P [bh, m, n] x V [bh, n, d] -> [bh, m, d].
  memory::desc p_md({bh, m, n}, dt, memory::format_tag::abc);
  memory::desc v_md({bh, n, d}, dt, memory::format_tag::abc);
  memory::desc o_md({bh, m, d}, acc, memory::format_tag::abc);
  dnnl::matmul qk, pv;
  try {
    qk = dnnl::matmul(dnnl::matmul::primitive_desc(dnnl::matmul::desc(q_md, kt_md, s_md), eng));
    pv = dnnl::matmul(dnnl::matmul::primitive_desc(dnnl::matmul::desc(p_md, v_md, o_md), eng));
  } catch (const dnnl::error& e) {
    // oneDNN 2.6 has no bf16 matmul on AVX2-only CPUs (emulated on AVX-512).
    state.SkipWithError(absl::StrCat("oneDNN has no such matmul on this CPU: ", e.what()).c_str());
    return;
  }
  memory q(q_md, eng), k(kt_md, eng), sc(s_md, eng), p(p_md, eng), v(v_md, eng), o(o_md, eng);
  for (memory* mem : {&q, &k, &sc, &p, &v, &o}) {
    std::memset(mem->get_data_handle(), 0, mem->get_desc().get_size());
  }
  auto run = [&] {
    for (int64_t r = 0; r < repeats; ++r) {
      qk.execute(stream, {{DNNL_ARG_SRC, q}, {DNNL_ARG_WEIGHTS, k}, {DNNL_ARG_DST, sc}});
      pv.execute(stream, {{DNNL_ARG_SRC, p}, {DNNL_ARG_WEIGHTS, v}, {DNNL_ARG_DST, o}});
    }
    stream.wait();
  };
  run();
  for (auto _ : state) run();
  state.counters["GFLOPs"] = benchmark::Counter(CoreFlops(s), benchmark::Counter::kIsIterationInvariantRate);
  state.SetLabel(per_head ? "one head at a time" : "");
}

// The cpu engine on `threads` threads, or null after marking `state` skipped.
std::unique_ptr<AttentionEngine> CpuEngineOrSkip(benchmark::State& state, int threads) {
  EngineOptions eo;
  eo.num_threads = threads;
  absl::StatusOr<std::unique_ptr<AttentionEngine>> engine = CreateEngine("cpu", eo);
  if (!engine.ok()) {
    state.SkipWithError(std::string(engine.status().message()).c_str());
    return nullptr;
  }
  return std::move(*engine);
}

// nn.MultiheadAttention forward (batch first, self-attention, biases,
// need_weights=False) through the cpu engine: projections + fused core.
// `modern`: the same layer with RoPE (default, whole heads) and QK-norm, as a
// Llama/Qwen3 layer computes them, to measure what they add.
void BM_Layer(benchmark::State& state, BenchShape s, Precision precision, int threads,
              bool modern) {
  const int64_t e = s.heads * s.head_dim;
  auto layer = std::make_shared<AttentionLayer>();
  LayerConfig& c = layer->config;
  c.name = "bench";
  c.has_projections = true;
  c.embed_dim = c.query_dim = c.key_dim = c.value_dim = c.out_dim = e;
  c.num_heads = c.num_kv_heads = s.heads;
  c.head_dim = s.head_dim;
  c.precision = precision;
  const float bound = 1.0f / std::sqrt(static_cast<float>(e));
  LayerWeights& w = layer->weights;
  w.wq = SeededUniformTensor({e, e}, 11, bound);
  w.wk = SeededUniformTensor({e, e}, 12, bound);
  w.wv = SeededUniformTensor({e, e}, 13, bound);
  w.wo = SeededUniformTensor({e, e}, 14, bound);
  w.bq = SeededUniformTensor({e}, 15, bound);
  w.bk = SeededUniformTensor({e}, 16, bound);
  w.bv = SeededUniformTensor({e}, 17, bound);
  w.bo = SeededUniformTensor({e}, 18, bound);
  if (modern) {
    c.rope.type = RopeConfig::Type::kDefault;
    c.rope.theta = 10000.0;
    c.rope.rotary_dim = s.head_dim;
    c.qk_norm.enabled = true;
    w.q_norm = SeededUniformTensor({s.head_dim}, 19, 1.0f);
    w.k_norm = SeededUniformTensor({s.head_dim}, 20, 1.0f);
  }
  std::unique_ptr<AttentionEngine> engine = CpuEngineOrSkip(state, threads);
  if (engine == nullptr) return;
  const DType dtype = precision == Precision::kBFloat16 ? DType::kBFloat16 : DType::kFloat32;
  Tensor x = RandomTensor(dtype, {s.batch, s.q_len, e}, 21);
  Tensor y(dtype, {s.batch, s.q_len, e});
  AttentionTask task;
  task.query = x.view();
  task.scale = 1.0f / std::sqrt(static_cast<float>(s.head_dim));
  task.output = y.mutable_view();
  if (absl::Status st = engine->Run(*layer, {&task, 1}); !st.ok()) {
    state.SkipWithError(std::string(st.message()).c_str());
    return;
  }
  for (auto _ : state) {
    benchmark::DoNotOptimize(engine->Run(*layer, {&task, 1}));
    benchmark::ClobberMemory();
  }
  const double proj_flops = 2.0 * s.batch * s.q_len * e * e * 4;
  state.counters["GFLOPs"] =
      benchmark::Counter(proj_flops + CoreFlops(s), benchmark::Counter::kIsIterationInvariantRate);
}

// A multi-head latent attention layer (LatentAttention) of DeepSeek's
// shapes: E, H heads of nope 128 + rope 64 query/key features and 128 value
// features, a key/value latent of 512, a query latent of `q_lora_rank` (0:
// one q_proj, DeepSeek-V2-Lite), causal self-attention with RoPE, through the
// cpu engine. bench/latent_bench.py runs it next to transformers'
// DeepseekV2Attention.
struct LatentShape {
  const char* name;
  int64_t batch, len, embed, heads, q_lora_rank;
};
const LatentShape kLatentShapes[] = {
    {"V2Lite_B1_L512_E2048_H16", 1, 512, 2048, 16, 0},
    {"V2Lite_B8_L128_E2048_H16", 8, 128, 2048, 16, 0},
    {"QLora_B1_L512_E2048_H16", 1, 512, 2048, 16, 768},
};

void BM_LatentLayer(benchmark::State& state, LatentShape s, Precision precision, int threads) {
  constexpr int64_t kNope = 128, kRope = 64, kV = 128, kKvRank = 512;
  auto layer = std::make_shared<AttentionLayer>();
  LayerConfig& c = layer->config;
  c.name = "bench-latent";
  c.has_projections = true;
  c.embed_dim = c.query_dim = c.key_dim = c.value_dim = c.out_dim = s.embed;
  c.num_heads = c.num_kv_heads = s.heads;
  c.head_dim = kNope + kRope;
  c.precision = precision;
  c.causal = true;
  c.latent = {true, s.q_lora_rank, kKvRank, kRope, kV, 1e-6, 1e-6};
  c.rope.type = RopeConfig::Type::kDefault;
  c.rope.theta = 10000.0;
  c.rope.rotary_dim = kRope;
  c.rope.interleaved = true;
  LayerWeights& w = layer->weights;
  auto weight = [](int64_t out, int64_t in, uint64_t seed) {
    return SeededUniformTensor({out, in}, seed, 1.0f / std::sqrt(static_cast<float>(in)));
  };
  const int64_t q_in = s.q_lora_rank > 0 ? s.q_lora_rank : s.embed;
  if (s.q_lora_rank > 0) {
    w.wq_a = weight(s.q_lora_rank, s.embed, 31);
    w.q_a_norm = SeededUniformTensor({s.q_lora_rank}, 32, 1.0f);
  }
  w.wq = weight(s.heads * c.head_dim, q_in, 33);
  w.wkv_a = weight(kKvRank + kRope, s.embed, 34);
  w.kv_a_norm = SeededUniformTensor({kKvRank}, 35, 1.0f);
  w.wk = weight(s.heads * kNope, kKvRank, 36);
  w.wv = weight(s.heads * kV, kKvRank, 37);
  w.wo = weight(s.embed, s.heads * kV, 38);
  if (absl::Status v = ValidateLayer(*layer); !v.ok()) {
    state.SkipWithError(std::string(v.message()).c_str());
    return;
  }
  std::unique_ptr<AttentionEngine> engine = CpuEngineOrSkip(state, threads);
  if (engine == nullptr) return;
  const DType dtype = precision == Precision::kBFloat16 ? DType::kBFloat16 : DType::kFloat32;
  Tensor x = RandomTensor(dtype, {s.batch, s.len, s.embed}, 39);
  Tensor y(dtype, {s.batch, s.len, s.embed});
  AttentionTask task;
  task.query = x.view();
  task.causal = true;
  task.scale = 1.0f / std::sqrt(static_cast<float>(c.head_dim));
  task.output = y.mutable_view();
  if (absl::Status st = engine->Run(*layer, {&task, 1}); !st.ok()) {
    state.SkipWithError(std::string(st.message()).c_str());
    return;
  }
  for (auto _ : state) {
    benchmark::DoNotOptimize(engine->Run(*layer, {&task, 1}));
    benchmark::ClobberMemory();
  }
  const double rows = static_cast<double>(s.batch * s.len);
  const double proj = 2.0 * rows *
                      (static_cast<double>(w.wkv_a.num_elements() + w.wq_a.num_elements() +
                                           w.wq.num_elements() + w.wk.num_elements() +
                                           w.wv.num_elements() + w.wo.num_elements()));
  // Causal: about half of the L x L scores.
  const double core = 2.0 * s.batch * s.heads * s.len * s.len * (c.head_dim + kV) / 2;
  state.counters["GFLOPs"] =
      benchmark::Counter(proj + core, benchmark::Counter::kIsIterationInvariantRate);
}

// oneDNN sgemm ceiling of the layer: the four projection GEMMs ([B*L, E] x
// [E, E] with bias) plus the core's two batched GEMMs.
void BM_LayerGemmCeiling(benchmark::State& state, BenchShape s, int threads) {
  using dnnl::memory;
  omp_set_num_threads(threads);
  dnnl::engine eng(dnnl::engine::kind::cpu, 0);
  dnnl::stream stream(eng);
  const int64_t e = s.heads * s.head_dim, rows = s.batch * s.q_len;
  const auto f32 = memory::data_type::f32;
  memory::desc x_md({rows, e}, f32, memory::format_tag::ab);
  memory::desc w_md({e, e}, f32, memory::format_tag::ba);
  memory::desc b_md({1, e}, f32, memory::format_tag::ab);
  dnnl::matmul proj(dnnl::matmul::primitive_desc(dnnl::matmul::desc(x_md, w_md, b_md, x_md), eng));
  memory x(x_md, eng), w(w_md, eng), b(b_md, eng), y(x_md, eng);
  for (memory* mem : {&x, &w, &b, &y}) std::memset(mem->get_data_handle(), 0, mem->get_desc().get_size());
  const int64_t bh = s.batch * s.heads, m = s.q_len, n = s.kv_len, d = s.head_dim;
  memory::desc q_md({bh, m, d}, f32, memory::format_tag::abc);
  memory::desc kt_md({bh, d, n}, f32, memory::dims{n * d, 1, d});
  memory::desc s_md({bh, m, n}, f32, memory::format_tag::abc);
  memory::desc v_md({bh, n, d}, f32, memory::format_tag::abc);
  dnnl::matmul qk(dnnl::matmul::primitive_desc(dnnl::matmul::desc(q_md, kt_md, s_md), eng));
  dnnl::matmul pv(dnnl::matmul::primitive_desc(dnnl::matmul::desc(s_md, v_md, q_md), eng));
  memory q(q_md, eng), k(kt_md, eng), sc(s_md, eng), v(v_md, eng), o(q_md, eng);
  for (memory* mem : {&q, &k, &sc, &v, &o}) std::memset(mem->get_data_handle(), 0, mem->get_desc().get_size());
  auto run = [&] {
    for (int r = 0; r < 4; ++r)
      proj.execute(stream, {{DNNL_ARG_SRC, x}, {DNNL_ARG_WEIGHTS, w}, {DNNL_ARG_BIAS, b}, {DNNL_ARG_DST, y}});
    qk.execute(stream, {{DNNL_ARG_SRC, q}, {DNNL_ARG_WEIGHTS, k}, {DNNL_ARG_DST, sc}});
    pv.execute(stream, {{DNNL_ARG_SRC, sc}, {DNNL_ARG_WEIGHTS, v}, {DNNL_ARG_DST, o}});
    stream.wait();
  };
  run();
  for (auto _ : state) run();
  const double flops = 2.0 * rows * e * e * 4 + CoreFlops(s);
  state.counters["GFLOPs"] = benchmark::Counter(flops, benchmark::Counter::kIsIterationInvariantRate);
}

// The serving case of issue 3: `requests` demo-mha requests of one sequence
// of 16 tokens (fp32), run as one ragged batch through the cpu engine, as the
// batcher hands them over. Counter per_request: time / requests (seconds).
constexpr int64_t kServingTokens = 16;

void BM_DemoMhaBatch(benchmark::State& state, int requests, int threads) {
  const std::shared_ptr<const AttentionLayer> layer = MakeDemoMhaLayer();
  const int64_t e = layer->config.embed_dim;
  std::unique_ptr<AttentionEngine> engine = CpuEngineOrSkip(state, threads);
  if (engine == nullptr) return;
  std::vector<Tensor> xs, ys;
  std::vector<AttentionTask> tasks(static_cast<size_t>(requests));
  for (int r = 0; r < requests; ++r) {
    xs.push_back(RandomTensor(DType::kFloat32, {1, kServingTokens, e}, 100 + r));
    ys.emplace_back(DType::kFloat32, Shape{1, kServingTokens, e});
  }
  for (int r = 0; r < requests; ++r) {
    tasks[r].query = xs[r].view();
    tasks[r].scale = 1.0f / std::sqrt(static_cast<float>(layer->config.head_dim));
    tasks[r].output = ys[r].mutable_view();
  }
  if (absl::Status st = engine->Run(*layer, tasks); !st.ok()) {
    state.SkipWithError(std::string(st.message()).c_str());
    return;
  }
  for (auto _ : state) {
    benchmark::DoNotOptimize(engine->Run(*layer, tasks));
    benchmark::ClobberMemory();
  }
  state.counters["per_request"] = benchmark::Counter(
      requests, benchmark::Counter::kIsIterationInvariantRate | benchmark::Counter::kInvert);
  const double flops = requests * (2.0 * kServingTokens * e * e * 4 +
                                   4.0 * kServingTokens * kServingTokens * e);
  state.counters["GFLOPs"] = benchmark::Counter(flops, benchmark::Counter::kIsIterationInvariantRate);
}

// Its sgemm ceiling: demo-mha's four projections as single oneDNN matmuls
// over all requests' rows stacked ([requests * 16, 512] x [512, 512] + bias,
// weights prepacked), i.e. what batching could give with no attention core,
// no gather/scatter and no batch invariance to keep.
void BM_DemoMhaBatchGemmCeiling(benchmark::State& state, int requests, int threads) {
  using dnnl::memory;
  omp_set_num_threads(threads);
  dnnl::engine eng(dnnl::engine::kind::cpu, 0);
  dnnl::stream stream(eng);
  const int64_t e = MakeDemoMhaLayer()->config.embed_dim, rows = requests * kServingTokens;
  const auto f32 = memory::data_type::f32;
  memory::desc x_md({rows, e}, f32, memory::format_tag::ab);
  memory::desc w_any({e, e}, f32, memory::format_tag::any);
  memory::desc b_md({1, e}, f32, memory::format_tag::ab);
  const dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(x_md, w_any, b_md, x_md), eng);
  dnnl::matmul proj(pd);
  std::vector<memory> ws;
  for (int i = 0; i < 4; ++i) ws.emplace_back(pd.weights_desc(), eng);
  memory x(x_md, eng), b(b_md, eng), y(x_md, eng);
  for (memory* mem : {&x, &b, &y, &ws[0], &ws[1], &ws[2], &ws[3]}) {
    std::memset(mem->get_data_handle(), 0, mem->get_desc().get_size());
  }
  auto run = [&] {
    for (const memory& w : ws) {
      proj.execute(stream, {{DNNL_ARG_SRC, x}, {DNNL_ARG_WEIGHTS, w}, {DNNL_ARG_BIAS, b}, {DNNL_ARG_DST, y}});
    }
    stream.wait();
  };
  run();
  for (auto _ : state) run();
  state.counters["per_request"] = benchmark::Counter(
      requests, benchmark::Counter::kIsIterationInvariantRate | benchmark::Counter::kInvert);
  state.counters["GFLOPs"] = benchmark::Counter(2.0 * rows * e * e * 4,
                                                benchmark::Counter::kIsIterationInvariantRate);
}

// STREAM triad a = b + s * c over three float arrays of `mib` MiB in all,
// first touched by the threads that use them. GBps counts 12 bytes per
// element (STREAM's convention: two reads, one write).
void BM_StreamTriad(benchmark::State& state, int64_t mib, int threads) {
  const int64_t n = (mib << 20) / 12;
  std::unique_ptr<float[]> a(new float[static_cast<size_t>(n)]), b(new float[static_cast<size_t>(n)]),
      c(new float[static_cast<size_t>(n)]);
  float* pa = a.get();
  float* pb = b.get();
  float* pc = c.get();
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    pa[i] = 0.0f;
    pb[i] = 1.0f;
    pc[i] = 2.0f;
  }
  const float scalar = 3.0f;
  for (auto _ : state) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t i = 0; i < n; ++i) pa[i] = pb[i] + scalar * pc[i];
    benchmark::ClobberMemory();
  }
  state.counters["GBps"] = benchmark::Counter(12.0 * n, benchmark::Counter::kIsIterationInvariantRate);
}

// Resident set (kind "VmRSS" or "VmHWM") in bytes, from /proc/self/status.
int64_t ProcStatusBytes(const char* kind) {
  std::ifstream f("/proc/self/status");
  std::string line;
  while (std::getline(f, line)) {
    if (line.rfind(kind, 0) == 0) return std::stoll(line.substr(std::strlen(kind) + 1)) * 1024;
  }
  return -1;
}

// Peak RSS the core adds beyond its inputs and outputs: the high-water mark
// is reset (clear_refs 5) after the inputs exist and the thread pool has
// started, then read after one call.
void BM_PeakRss(benchmark::State& state, BenchShape s, DType dtype, int threads) {
  CoreInputs in(s, dtype);
  cpu::FlashOptions opt;
  opt.num_threads = threads;
  BenchShape tiny = s;
  tiny.q_len = tiny.kv_len = 64;
  CoreInputs warm(tiny, dtype);
  (void)cpu::FlashAttention({warm.p}, opt);  // threads + their scratch exist
  double extra = -1;
  for (auto _ : state) {
    std::ofstream("/proc/self/clear_refs") << "5";
    const int64_t before = ProcStatusBytes("VmRSS:");
    benchmark::DoNotOptimize(cpu::FlashAttention({in.p}, opt));
    extra = static_cast<double>(ProcStatusBytes("VmHWM:") - before) / (1 << 20);
  }
  state.counters["extra_MiB"] = extra;
  state.counters["inputs_outputs_MiB"] =
      static_cast<double>(in.q.byte_size() + in.k.byte_size() + in.v.byte_size() + in.out.byte_size()) /
      (1 << 20);
}

void RegisterAll() {
  const int max_threads = omp_get_max_threads();
  std::vector<int> thread_counts = {1};
  if (max_threads >= 2) thread_counts.push_back(2);
  if (max_threads > 2) thread_counts.push_back(max_threads);
  for (const BenchShape& s : kShapes) {
    for (int t : thread_counts) {
      const std::string suffix = absl::StrCat("/threads:", t);
      for (DType dt : {DType::kFloat32, DType::kBFloat16}) {
        const std::string dn = dt == DType::kFloat32 ? "fp32" : "bf16";
        benchmark::RegisterBenchmark(absl::StrCat("Core/", s.name, "/", dn, suffix).c_str(), BM_Core<>, s, dt, t)
            ->Unit(benchmark::kMillisecond)
            ->UseRealTime();
        if (s.q_len == s.kv_len && s.q_len > 1) {
          benchmark::RegisterBenchmark(absl::StrCat("CoreFusedQkv/", s.name, "/", dn, suffix).c_str(),
                                       BM_Core<FusedCoreInputs>, s, dt, t)
              ->Unit(benchmark::kMillisecond)
              ->UseRealTime();
        }
        struct Biased {
          const char* name;
          bool causal;
          PositionBias bias;
        };
        for (const Biased b : {Biased{"CoreCausal/", true, PositionBias::kNone},
                               Biased{"CoreCausalAlibi/", true, PositionBias::kAlibi},
                               Biased{"CoreCausalRelative/", true, PositionBias::kRelative},
                               Biased{"CoreRelative/", false, PositionBias::kRelative},
                               Biased{"CoreEmbedded/", false, PositionBias::kEmbedded}}) {
          benchmark::RegisterBenchmark(absl::StrCat(b.name, s.name, "/", dn, suffix).c_str(),
                                       BM_CoreBiased, s, dt, t, b.causal, b.bias)
              ->Unit(benchmark::kMillisecond)
              ->UseRealTime();
        }
        benchmark::RegisterBenchmark(absl::StrCat("GemmCeiling/", s.name, "/", dn, suffix).c_str(),
                                     BM_GemmCeiling, s, dt, t)
            ->Unit(benchmark::kMillisecond)
            ->UseRealTime();
      }
      if (s.layer) {
        benchmark::RegisterBenchmark(absl::StrCat("Layer/", s.name, "/fp32", suffix).c_str(), BM_Layer, s,
                                     Precision::kFloat32, t, false)
            ->Unit(benchmark::kMillisecond)
            ->UseRealTime();
        benchmark::RegisterBenchmark(absl::StrCat("Layer/", s.name, "/bf16", suffix).c_str(), BM_Layer, s,
                                     Precision::kBFloat16, t, false)
            ->Unit(benchmark::kMillisecond)
            ->UseRealTime();
        benchmark::RegisterBenchmark(
            absl::StrCat("LayerRopeQkNorm/", s.name, "/fp32", suffix).c_str(), BM_Layer, s,
            Precision::kFloat32, t, true)
            ->Unit(benchmark::kMillisecond)
            ->UseRealTime();
        benchmark::RegisterBenchmark(absl::StrCat("LayerGemmCeiling/", s.name, "/fp32", suffix).c_str(),
                                     BM_LayerGemmCeiling, s, t)
            ->Unit(benchmark::kMillisecond)
            ->UseRealTime();
      }
    }
  }
  for (const LatentShape& s : kLatentShapes) {
    for (int t : thread_counts) {
      for (Precision p : {Precision::kFloat32, Precision::kBFloat16}) {
        benchmark::RegisterBenchmark(absl::StrCat("LatentLayer/", s.name,
                                                  p == Precision::kFloat32 ? "/fp32" : "/bf16",
                                                  "/threads:", t)
                                         .c_str(),
                                     BM_LatentLayer, s, p, t)
            ->Unit(benchmark::kMillisecond)
            ->UseRealTime();
      }
    }
  }
  for (int t : thread_counts) {
    // The decode shape's K/V (128 MiB fp32) and a set far beyond any cache.
    for (int64_t mib : {128, 3072}) {
      benchmark::RegisterBenchmark(absl::StrCat("StreamTriad/MiB:", mib, "/threads:", t).c_str(),
                                   BM_StreamTriad, mib, t)
          ->Unit(benchmark::kMillisecond)
          ->UseRealTime();
    }
  }
  for (int t : thread_counts) {
    for (int requests : {1, 16, 32}) {
      const std::string suffix = absl::StrCat("/requests:", requests, "/threads:", t);
      benchmark::RegisterBenchmark(absl::StrCat("DemoMhaBatch", suffix).c_str(), BM_DemoMhaBatch,
                                   requests, t)
          ->Unit(benchmark::kMillisecond)
          ->UseRealTime();
      benchmark::RegisterBenchmark(absl::StrCat("DemoMhaBatchGemmCeiling", suffix).c_str(),
                                   BM_DemoMhaBatchGemmCeiling, requests, t)
          ->Unit(benchmark::kMillisecond)
          ->UseRealTime();
    }
  }
  const BenchShape& longest = kShapes[5];
  for (DType dt : {DType::kFloat32, DType::kBFloat16}) {
    benchmark::RegisterBenchmark(
        absl::StrCat("PeakRss/", longest.name, dt == DType::kFloat32 ? "/fp32" : "/bf16", "/threads:",
                     thread_counts.back())
            .c_str(),
        BM_PeakRss, longest, dt, thread_counts.back())
        ->Iterations(1)
        ->Unit(benchmark::kMillisecond)
        ->UseRealTime();
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
