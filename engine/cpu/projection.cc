// Chunked projections: prepacked oneDNN matmuls of a fixed row count, the
// gather/scatter that stacks a batch's rows into them, and the per-layer cache.
#include "engine/cpu/projection.h"

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <new>
#include <random>
#include <unordered_map>

#include "absl/strings/str_cat.h"
#include "engine/cpu/cpu_features.h"

#ifdef _OPENMP
#include <omp.h>
#endif

namespace attnserve::cpu {
namespace {

using dt = dnnl::memory::data_type;

dt DnnlType(DType dtype) { return dtype == DType::kBFloat16 ? dt::bf16 : dt::f32; }

bool Aligned64(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 63) == 0; }

// Runs `fn` on a thread whose OpenMP thread count is 1, so that oneDNN
// builds (and later runs) single-threaded primitives. The count is set
// inside a one-thread parallel region, whose ICVs die with it: the caller's
// own thread count is left alone. Exceptions cross the region as values.
template <typename Fn>
void OnOneThread(Fn&& fn) {
  std::exception_ptr error;
#ifdef _OPENMP
#pragma omp parallel num_threads(1)
  {
    omp_set_num_threads(1);
#endif
    try {
      fn();
    } catch (...) {
      error = std::current_exception();
    }
#ifdef _OPENMP
  }
#endif
  if (error) std::rethrow_exception(error);
}

// GCC 12's AVX-512 intrinsics trip a false -Wmaybe-uninitialized.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

// fp32 -> bf16 with round to nearest even, NaN kept quiet: bitwise what
// FloatToBFloat16 does, 16 lanes at a time.
__attribute__((target("avx512f,avx512bw"))) void FloatToBFloat16Avx512(const float* src,
                                                                         int64_t n,
                                                                         uint16_t* dst) {
  const __m512i round = _mm512_set1_epi32(0x7FFF), one = _mm512_set1_epi32(1);
  const __m512i abs_mask = _mm512_set1_epi32(0x7FFFFFFF), inf = _mm512_set1_epi32(0x7F800000);
  const __m512i quiet = _mm512_set1_epi32(0x0040);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512i x = _mm512_loadu_si512(src + i);
    const __m512i hi = _mm512_srli_epi32(x, 16);
    __m512i r = _mm512_srli_epi32(
        _mm512_add_epi32(_mm512_add_epi32(x, round), _mm512_and_si512(hi, one)), 16);
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(x, abs_mask), inf);
    r = _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(hi, quiet));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), _mm512_cvtepi32_epi16(r));
  }
  for (; i < n; ++i) dst[i] = FloatToBFloat16(src[i]);
}

__attribute__((target("avx512f,avx512bw"))) void BFloat16ToFloatAvx512(const uint16_t* src,
                                                                         int64_t n, float* dst) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i));
    _mm512_storeu_si512(dst + i, _mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  for (; i < n; ++i) dst[i] = BFloat16ToFloat(src[i]);
}

#pragma GCC diagnostic pop

// n elements from `sdt` to `ddt` (float types), exact or round to nearest
// even. Each element's result depends only on its own value.
void Convert(const void* src, DType sdt, int64_t n, void* dst, DType ddt) {
  if (sdt == ddt) {
    std::memcpy(dst, src, static_cast<size_t>(n) * DTypeSize(sdt));
  } else if (sdt == DType::kFloat32 && ddt == DType::kBFloat16) {
    if (GetCpuFeatures().avx512) {
      FloatToBFloat16Avx512(static_cast<const float*>(src), n, static_cast<uint16_t*>(dst));
    } else {
      ConvertFromFloat(static_cast<const float*>(src), n, ddt, dst);
    }
  } else if (sdt == DType::kBFloat16 && ddt == DType::kFloat32) {
    if (GetCpuFeatures().avx512) {
      BFloat16ToFloatAvx512(static_cast<const uint16_t*>(src), n, static_cast<float*>(dst));
    } else {
      ConvertToFloat(sdt, src, n, static_cast<float*>(dst));
    }
  } else if (ddt == DType::kFloat32) {
    ConvertToFloat(sdt, src, n, static_cast<float*>(dst));
  } else if (sdt == DType::kFloat32) {
    ConvertFromFloat(static_cast<const float*>(src), n, ddt, dst);
  } else {  // fp16 <-> bf16, through fp32 (exact widening, one rounding)
    float tmp[256];
    for (int64_t i = 0; i < n; i += 256) {
      const int64_t m = std::min<int64_t>(256, n - i);
      ConvertToFloat(sdt, static_cast<const unsigned char*>(src) + i * DTypeSize(sdt), m, tmp);
      Convert(tmp, DType::kFloat32, m, static_cast<unsigned char*>(dst) + i * DTypeSize(ddt),
              ddt);
    }
  }
}

float RoundTo(Precision precision, float v) {
  switch (precision) {
    case Precision::kFloat32: return v;
    case Precision::kBFloat16: return BFloat16ToFloat(FloatToBFloat16(v));
    case Precision::kFloat16: return HalfToFloat(FloatToHalf(v));
  }
  return v;
}

// The first block of `blocks` (sorted by row0) that ends after `row`.
template <typename Block>
typename std::vector<Block>::const_iterator FirstEndingAfter(const std::vector<Block>& blocks,
                                                             int64_t row) {
  return std::partition_point(blocks.begin(), blocks.end(),
                              [&](const Block& b) { return b.row0 + b.rows <= row; });
}

// Chunk `chunk` of `job`: gather (or read in place), one matmul, scatter (or
// write in place). The buffers are this thread's.
void RunChunkOf(const LinearJob& job, int64_t chunk, unsigned char* src_buf,
                unsigned char* dst_buf, unsigned char* scratchpad, dnnl::stream& stream) {
  const ChunkedLinear& lin = *job.linear;
  const int64_t k = lin.in_features(), n = lin.out_features();
  const int64_t r0 = chunk * lin.chunk_rows(), r1 = r0 + lin.chunk_rows();
  const DType sdt = lin.src_dtype(), ddt = lin.dst_dtype();
  const size_t s_row = static_cast<size_t>(k) * DTypeSize(sdt);
  const size_t d_row = static_cast<size_t>(n) * DTypeSize(ddt);

  const void* src = src_buf;
  auto in = FirstEndingAfter(job.in, r0);
  const bool in_place_src =
      in != job.in.end() && in->row0 <= r0 && in->row0 + in->rows >= r1 && in->dtype == sdt &&
      in->stride == k &&
      Aligned64(static_cast<const unsigned char*>(in->data) + (r0 - in->row0) * s_row);
  if (in_place_src) {
    src = static_cast<const unsigned char*>(in->data) + (r0 - in->row0) * s_row;
  } else {
    int64_t r = r0;  // next row of the chunk to fill
    for (; in != job.in.end() && in->row0 < r1; ++in) {
      const int64_t b0 = std::max(r0, in->row0), b1 = std::min(r1, in->row0 + in->rows);
      if (b0 > r) std::memset(src_buf + (r - r0) * s_row, 0, (b0 - r) * s_row);
      const size_t in_es = DTypeSize(in->dtype);
      for (int64_t row = b0; row < b1; ++row) {
        Convert(static_cast<const unsigned char*>(in->data) + (row - in->row0) * in->stride * in_es,
                in->dtype, k, src_buf + (row - r0) * s_row, sdt);
      }
      r = b1;
    }
    if (r < r1) std::memset(src_buf + (r - r0) * s_row, 0, (r1 - r) * s_row);
  }

  auto out = FirstEndingAfter(job.out, r0);
  const bool in_place_dst = out != job.out.end() && out->row0 <= r0 &&
                            out->row0 + out->rows >= r1 && out->dtype == ddt &&
                            out->stride == n;
  void* dst = in_place_dst ? static_cast<unsigned char*>(out->data) + (r0 - out->row0) * d_row
                           : dst_buf;
  lin.RunChunk(src, dst, scratchpad, stream);
  if (in_place_dst) return;
  for (; out != job.out.end() && out->row0 < r1; ++out) {
    const int64_t b0 = std::max(r0, out->row0), b1 = std::min(r1, out->row0 + out->rows);
    const size_t out_es = DTypeSize(out->dtype);
    for (int64_t row = b0; row < b1; ++row) {
      Convert(dst_buf + (row - r0) * d_row, ddt, n,
              static_cast<unsigned char*>(out->data) + (row - out->row0) * out->stride * out_es,
              out->dtype);
    }
  }
}

uint64_t Mix(uint64_t h, uint64_t v) {
  h ^= v + 0x9E3779B97F4A7C15ull + (h << 6) + (h >> 2);
  return h;
}

// What identifies a layer's weights beyond its address: dims, precision,
// weight addresses and sizes, and 16 values sampled from each tensor. Cheap
// (about 130 loads) and computed on every call.
uint64_t Fingerprint(const AttentionLayer& layer) {
  const LayerConfig& c = layer.config;
  uint64_t h = 0;
  for (int64_t v : {c.num_heads, c.num_kv_heads, c.head_dim, c.query_dim, c.key_dim,
                    c.value_dim, c.out_dim, static_cast<int64_t>(c.precision)}) {
    h = Mix(h, static_cast<uint64_t>(v));
  }
  const LayerWeights& w = layer.weights;
  for (const Tensor* t : {&w.wq, &w.bq, &w.wk, &w.bk, &w.wv, &w.bv, &w.wo, &w.bo}) {
    h = Mix(h, reinterpret_cast<uintptr_t>(t->data()));
    h = Mix(h, t->byte_size());
    const size_t words = t->byte_size() / sizeof(uint32_t);
    if (words == 0) continue;
    const auto* u = static_cast<const unsigned char*>(t->data());
    for (size_t i = 0; i < 16; ++i) {
      uint32_t word;
      std::memcpy(&word, u + (i * (words - 1) / 15) * sizeof word, sizeof word);
      h = Mix(h, word);
    }
  }
  return h;
}

}  // namespace

AlignedBytes::AlignedBytes(size_t bytes) : size_(bytes) {
  if (bytes == 0) return;
  void* p = std::aligned_alloc(64, (bytes + 63) / 64 * 64);
  if (p == nullptr) throw std::bad_alloc();
  data_.reset(static_cast<unsigned char*>(p));
}

void AlignedBytes::Free::operator()(unsigned char* p) const { std::free(p); }

absl::StatusOr<std::unique_ptr<const ChunkedLinear>> ChunkedLinear::Create(
    const dnnl::engine& engine, absl::Span<const Tensor* const> weights,
    absl::Span<const Tensor* const> biases, Precision rounding, DType compute_dtype,
    DType dst_dtype) {
  if (weights.empty() || weights.size() != biases.size()) {
    return absl::InternalError("ChunkedLinear: one bias (maybe empty) per weight required");
  }
  const int64_t k = weights[0]->shape().size() == 2 ? weights[0]->shape()[1] : 0;
  int64_t n = 0;
  bool has_bias = false;
  for (size_t i = 0; i < weights.size(); ++i) {
    const Tensor& w = *weights[i];
    if (w.dtype() != DType::kFloat32 || w.shape().size() != 2 || w.shape()[1] != k || k < 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("ChunkedLinear: weights must be FLOAT32 [n, ", k, "], got ",
                       ShapeString(w.shape())));
    }
    const Tensor& b = *biases[i];
    if (b.byte_size() != 0) {
      if (b.dtype() != DType::kFloat32 || b.shape() != Shape{w.shape()[0]}) {
        return absl::InvalidArgumentError(absl::StrCat(
            "ChunkedLinear: bias must be FLOAT32 [", w.shape()[0], "], got ", ShapeString(b.shape())));
      }
      has_bias = true;
    }
    n += w.shape()[0];
  }

  auto linear = std::unique_ptr<ChunkedLinear>(new ChunkedLinear());
  linear->k_ = k;
  linear->n_ = n;
  linear->src_dtype_ = compute_dtype == DType::kBFloat16 ? DType::kBFloat16 : DType::kFloat32;
  linear->dst_dtype_ = dst_dtype;
  linear->engine_ = engine;
  const size_t weight_bytes = static_cast<size_t>(n * k) * DTypeSize(linear->src_dtype_);
  const int64_t h = weight_bytes > kTallChunkWeightBytes ? kTallChunkRows : kChunkRows;
  linear->chunk_rows_ = h;

  // W stacked in PyTorch layout [N, K] is the matmul's [K, N] weights with
  // strides {1, K}; values rounded to the layer precision (exact when the
  // weight loader already did), held as the compute type.
  const size_t nk = static_cast<size_t>(n * k);
  const DType wdt = linear->src_dtype_;
  AlignedBytes user(nk * DTypeSize(wdt));
  std::vector<float> bias(static_cast<size_t>(n), 0.0f);
  {
    std::vector<float> rounded;
    size_t row = 0;
    for (size_t i = 0; i < weights.size(); ++i) {
      const Tensor& w = *weights[i];
      const int64_t count = w.num_elements();
      rounded.assign(w.data_as<float>(), w.data_as<float>() + count);
      for (float& v : rounded) v = RoundTo(rounding, v);
      Convert(rounded.data(), DType::kFloat32, count, user.data() + row * k * DTypeSize(wdt), wdt);
      if (biases[i]->byte_size() != 0) {
        const float* b = biases[i]->data_as<float>();
        for (int64_t j = 0; j < w.shape()[0]; ++j) bias[row + j] = RoundTo(rounding, b[j]);
      }
      row += static_cast<size_t>(w.shape()[0]);
    }
  }

  try {
    OnOneThread([&] {
      ChunkedLinear& l = *linear;
      l.src_md_ = dnnl::memory::desc({h, k}, DnnlType(wdt), {k, 1});
      l.dst_md_ = dnnl::memory::desc({h, n}, DnnlType(dst_dtype), {n, 1});
      const dnnl::memory::desc wei_any({k, n}, DnnlType(wdt), dnnl::memory::format_tag::any);
      const dnnl::memory::desc bias_md({1, n}, dt::f32, {n, 1});
      dnnl::primitive_attr attr;
      // Each execution brings its own scratchpad (one per thread), so one
      // primitive runs on several threads at once.
      attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
      const dnnl::matmul::desc desc =
          has_bias ? dnnl::matmul::desc(l.src_md_, wei_any, bias_md, l.dst_md_)
                   : dnnl::matmul::desc(l.src_md_, wei_any, l.dst_md_);
      const dnnl::matmul::primitive_desc pd(desc, attr, engine);
      l.primitive_ = dnnl::matmul(pd);
      l.scratchpad_md_ = pd.scratchpad_desc();
      l.scratchpad_bytes_ = l.scratchpad_md_.get_size();

      dnnl::stream stream(engine);
      dnnl::memory user_mem(dnnl::memory::desc({k, n}, DnnlType(wdt), {1, k}), engine,
                            user.data());
      l.weights_ = dnnl::memory(pd.weights_desc(), engine);
      dnnl::reorder(user_mem, l.weights_).execute(stream, user_mem, l.weights_);
      if (has_bias) {
        l.bias_ = dnnl::memory(bias_md, engine);
        std::memcpy(l.bias_.get_data_handle(), bias.data(), bias.size() * sizeof(float));
      }
      stream.wait();

      // Position check: every row of the chunk the same random vector; all
      // output rows must then be bitwise equal.
      AlignedBytes src(h * k * DTypeSize(wdt));
      AlignedBytes dst(h * n * DTypeSize(dst_dtype));
      AlignedBytes pad(std::max<size_t>(l.scratchpad_bytes_, 1));
      std::mt19937 gen(12345);
      std::vector<float> row(static_cast<size_t>(k));
      const size_t s_row = static_cast<size_t>(k) * DTypeSize(wdt);
      const size_t d_row = static_cast<size_t>(n) * DTypeSize(dst_dtype);
      for (int trial = 0; trial < 2 && l.rows_independent_; ++trial) {
        for (float& v : row) v = static_cast<float>(gen() >> 8) * 0x1.0p-23f - 1.0f;
        for (int64_t r = 0; r < h; ++r) {
          Convert(row.data(), DType::kFloat32, k, src.data() + r * s_row, wdt);
        }
        l.RunChunk(src.data(), dst.data(), pad.data(), stream);
        for (int64_t r = 1; r < h; ++r) {
          if (std::memcmp(dst.data(), dst.data() + r * d_row, d_row) != 0) {
            l.rows_independent_ = false;
          }
        }
      }
    });
  } catch (const dnnl::error& e) {
    return absl::InternalError(absl::StrCat("ChunkedLinear: oneDNN matmul [", h, ", ",
                                            k, "] x [", k, ", ", n, "]: ", e.what()));
  }
  return std::unique_ptr<const ChunkedLinear>(std::move(linear));
}

void ChunkedLinear::RunChunk(const void* src, void* dst, void* scratchpad,
                             dnnl::stream& stream) const {
  // oneDNN takes non-const handles; it only reads src.
  std::unordered_map<int, dnnl::memory> args = {
      {DNNL_ARG_SRC, dnnl::memory(src_md_, engine_, const_cast<void*>(src))},
      {DNNL_ARG_WEIGHTS, weights_},
      {DNNL_ARG_DST, dnnl::memory(dst_md_, engine_, dst)}};
  if (bias_) args.emplace(DNNL_ARG_BIAS, bias_);
  if (scratchpad_bytes_ > 0) {
    args.emplace(DNNL_ARG_SCRATCHPAD, dnnl::memory(scratchpad_md_, engine_, scratchpad));
  }
  primitive_.execute(stream, args);
  stream.wait();
}

RowLayout LayoutRows(absl::Span<const int64_t> rows, int64_t chunk_rows, bool aligned) {
  RowLayout layout;
  layout.offsets.reserve(rows.size());
  int64_t next = 0;
  for (int64_t r : rows) {
    if (aligned) next = (next + chunk_rows - 1) / chunk_rows * chunk_rows;
    layout.offsets.push_back(next);
    next += r;
  }
  layout.total = (next + chunk_rows - 1) / chunk_rows * chunk_rows;
  return layout;
}

RowLayout LayoutRowsFor(const ChunkedLinear& linear, absl::Span<const int64_t> rows) {
  return LayoutRows(rows, linear.chunk_rows(), !linear.rows_independent());
}

absl::Status RunLinearJobs(absl::Span<const LinearJob> jobs, const dnnl::engine& engine,
                           int threads) {
  struct Item {
    size_t job;
    int64_t chunk;
  };
  std::vector<Item> items;
  size_t src_bytes = 0, dst_bytes = 0, pad_bytes = 1;
  for (size_t j = 0; j < jobs.size(); ++j) {
    const LinearJob& job = jobs[j];
    if (job.linear == nullptr || job.rows % job.linear->chunk_rows() != 0) {
      return absl::InternalError("RunLinearJobs: rows must be a multiple of chunk_rows()");
    }
    const ChunkedLinear& lin = *job.linear;
    const int64_t h = lin.chunk_rows();
    src_bytes = std::max(src_bytes, h * lin.in_features() * DTypeSize(lin.src_dtype()));
    dst_bytes = std::max(dst_bytes, h * lin.out_features() * DTypeSize(lin.dst_dtype()));
    pad_bytes = std::max(pad_bytes, lin.scratchpad_bytes());
    for (int64_t c = 0; c < job.rows / h; ++c) items.push_back({j, c});
  }
  if (items.empty()) return absl::OkStatus();
  threads = static_cast<int>(std::clamp<size_t>(static_cast<size_t>(std::max(threads, 1)), 1,
                                                items.size()));

  std::atomic<bool> failed{false};
  absl::Mutex mu;
  absl::Status first_error;
  auto fail = [&](absl::Status s) {
    absl::MutexLock lock(&mu);
    if (first_error.ok()) first_error = std::move(s);
    failed.store(true, std::memory_order_relaxed);
  };
  const int64_t n_items = static_cast<int64_t>(items.size());
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
#ifdef _OPENMP
    // oneDNN inside a chunk runs on this thread only (the primitives were
    // built for one thread); the count dies with the region.
    omp_set_num_threads(1);
#endif
    std::unique_ptr<dnnl::stream> stream;
    AlignedBytes src, dst, pad;
    try {
      stream = std::make_unique<dnnl::stream>(engine);
      src = AlignedBytes(src_bytes);
      dst = AlignedBytes(dst_bytes);
      pad = AlignedBytes(pad_bytes);
    } catch (const dnnl::error& e) {
      fail(absl::InternalError(absl::StrCat("projection: oneDNN stream: ", e.what())));
    } catch (const std::bad_alloc&) {
      fail(absl::ResourceExhaustedError("projection: out of memory for chunk buffers"));
    }
    // Every thread reaches the worksharing loop, ready or not.
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < n_items; ++i) {
      if (failed.load(std::memory_order_relaxed)) continue;
      const Item& item = items[static_cast<size_t>(i)];
      try {
        RunChunkOf(jobs[item.job], item.chunk, src.data(), dst.data(), pad.data(), *stream);
      } catch (const dnnl::error& e) {
        fail(absl::InternalError(absl::StrCat("projection: oneDNN matmul failed (status ",
                                              static_cast<int>(e.status), "): ", e.what())));
      } catch (const std::exception& e) {
        fail(absl::InternalError(absl::StrCat("projection: ", e.what())));
      }
    }
  }
  return first_error;
}

absl::StatusOr<const ChunkedLinear*> LayerProjections::qkv(const AttentionLayer& layer) {
  return Get(kQkv, layer);
}
absl::StatusOr<const ChunkedLinear*> LayerProjections::q(const AttentionLayer& layer) {
  return Get(kQ, layer);
}
absl::StatusOr<const ChunkedLinear*> LayerProjections::k(const AttentionLayer& layer) {
  return Get(kK, layer);
}
absl::StatusOr<const ChunkedLinear*> LayerProjections::v(const AttentionLayer& layer) {
  return Get(kV, layer);
}
absl::StatusOr<const ChunkedLinear*> LayerProjections::o(const AttentionLayer& layer) {
  return Get(kO, layer);
}

absl::StatusOr<const ChunkedLinear*> LayerProjections::Get(Which which,
                                                           const AttentionLayer& layer) {
  absl::MutexLock lock(&mu_);
  if (linears_[which] != nullptr) return linears_[which].get();
  const LayerWeights& w = layer.weights;
  const DType act = activation_dtype();
  absl::StatusOr<std::unique_ptr<const ChunkedLinear>> made;
  auto create = [&](std::initializer_list<const Tensor*> weights,
                    std::initializer_list<const Tensor*> biases, DType dst) {
    made = ChunkedLinear::Create(engine_, weights, biases, precision_, act, dst);
  };
  switch (which) {
    case kQkv: create({&w.wq, &w.wk, &w.wv}, {&w.bq, &w.bk, &w.bv}, act); break;
    case kQ: create({&w.wq}, {&w.bq}, act); break;
    case kK: create({&w.wk}, {&w.bk}, act); break;
    case kV: create({&w.wv}, {&w.bv}, act); break;
    // fp32 out: the task's output dtype is applied when rows are scattered.
    case kO: create({&w.wo}, {&w.bo}, DType::kFloat32); break;
    case kCount: break;
  }
  if (!made.ok()) return made.status();
  linears_[which] = std::move(*made);
  return linears_[which].get();
}

std::shared_ptr<LayerProjections> ProjectionCache::Get(const AttentionLayer& layer) {
  const uint64_t fingerprint = Fingerprint(layer);
  absl::MutexLock lock(&mu_);
  Entry& entry = entries_[&layer];
  entry.last_use = ++clock_;
  if (entry.projections == nullptr || entry.fingerprint != fingerprint) {
    entry.fingerprint = fingerprint;
    const CpuFeatures& cpu = GetCpuFeatures();
    entry.projections = std::make_shared<LayerProjections>(engine_, layer.config.precision,
                                                           cpu.avx512_bf16 || cpu.amx_bf16);
  }
  std::shared_ptr<LayerProjections> result = entry.projections;
  if (entries_.size() > capacity_) {
    auto oldest = std::min_element(entries_.begin(), entries_.end(), [](const auto& a, const auto& b) {
      return a.second.last_use < b.second.last_use;
    });
    entries_.erase(oldest);
  }
  return result;
}

}  // namespace attnserve::cpu
