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
#include <optional>
#include <random>
#include <unordered_map>

#include <unistd.h>

#include "absl/strings/str_cat.h"
#include "engine/cpu/cpu_features.h"
#include "engine/cpu/thread_buffer.h"

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

// The first block of `blocks` (sorted by row0) that ends after `row`.
template <typename Block>
typename std::vector<Block>::const_iterator FirstEndingAfter(const std::vector<Block>& blocks,
                                                             int64_t row) {
  return std::partition_point(blocks.begin(), blocks.end(),
                              [&](const Block& b) { return b.row0 + b.rows <= row; });
}

// Chunk `chunk`'s src rows read in place: one `in` block covers the chunk,
// already in the linear's src type, with K-element rows and a 64-byte
// aligned start. nullptr when the chunk has to be gathered.
const void* InPlaceSrc(const LinearJob& job, int64_t chunk) {
  const ChunkedLinear& lin = *job.linear;
  const int64_t r0 = chunk * lin.chunk_rows(), r1 = r0 + lin.chunk_rows();
  const size_t s_row = static_cast<size_t>(lin.in_features()) * DTypeSize(lin.src_dtype());
  auto in = FirstEndingAfter(job.in, r0);
  if (in == job.in.end() || in->row0 > r0 || in->row0 + in->rows < r1 ||
      in->dtype != lin.src_dtype() || in->stride != lin.in_features()) {
    return nullptr;
  }
  const void* src = static_cast<const unsigned char*>(in->data) + (r0 - in->row0) * s_row;
  return Aligned64(src) ? src : nullptr;
}

// Chunk `chunk`'s src rows, converted to the src type, into `buf`
// ([chunk_rows(), K]); rows no `in` block covers are zeros.
void GatherChunk(const LinearJob& job, int64_t chunk, unsigned char* buf) {
  const ChunkedLinear& lin = *job.linear;
  const int64_t k = lin.in_features();
  const int64_t r0 = chunk * lin.chunk_rows(), r1 = r0 + lin.chunk_rows();
  const DType sdt = lin.src_dtype();
  const size_t s_row = static_cast<size_t>(k) * DTypeSize(sdt);
  int64_t r = r0;  // next row of the chunk to fill
  for (auto in = FirstEndingAfter(job.in, r0); in != job.in.end() && in->row0 < r1; ++in) {
    const int64_t b0 = std::max(r0, in->row0), b1 = std::min(r1, in->row0 + in->rows);
    if (b0 > r) std::memset(buf + (r - r0) * s_row, 0, (b0 - r) * s_row);
    const size_t in_es = DTypeSize(in->dtype);
    for (int64_t row = b0; row < b1; ++row) {
      Convert(static_cast<const unsigned char*>(in->data) + (row - in->row0) * in->stride * in_es,
              in->dtype, k, buf + (row - r0) * s_row, sdt);
    }
    r = b1;
  }
  if (r < r1) std::memset(buf + (r - r0) * s_row, 0, (r1 - r) * s_row);
}

// Panel `panel` of chunk `chunk` of `job` on `src`: written in place when one
// `out` block covers the chunk in the dst type with N-element rows and the
// linear writes panels into full rows (dst_row_stride() == N), else into
// `dst_buf` ([chunk_rows(), dst_row_stride()], this thread's) and scattered
// from there.
void RunPanelOf(const LinearJob& job, int64_t chunk, int64_t panel, const void* src,
                unsigned char* dst_buf, unsigned char* scratchpad, dnnl::stream& stream) {
  const ChunkedLinear& lin = *job.linear;
  const int64_t n = lin.out_features(), cols = lin.panel_cols(), col0 = panel * cols;
  const int64_t ld = lin.dst_row_stride();
  const int64_t r0 = chunk * lin.chunk_rows(), r1 = r0 + lin.chunk_rows();
  const DType ddt = lin.dst_dtype();
  const size_t d_es = DTypeSize(ddt), d_row = static_cast<size_t>(ld) * d_es;

  auto out = FirstEndingAfter(job.out, r0);
  const bool in_place_dst = ld == n && out != job.out.end() && out->row0 <= r0 &&
                            out->row0 + out->rows >= r1 && out->dtype == ddt &&
                            out->stride == n;
  if (in_place_dst) {
    lin.RunChunk(src,
                 static_cast<unsigned char*>(out->data) + (r0 - out->row0) * d_row + col0 * d_es,
                 panel, scratchpad, stream);
    return;
  }
  unsigned char* base = dst_buf + (ld == n ? col0 * d_es : 0);
  lin.RunChunk(src, base, panel, scratchpad, stream);
  for (; out != job.out.end() && out->row0 < r1; ++out) {
    const int64_t b0 = std::max(r0, out->row0), b1 = std::min(r1, out->row0 + out->rows);
    const size_t out_es = DTypeSize(out->dtype);
    for (int64_t row = b0; row < b1; ++row) {
      Convert(base + (row - r0) * d_row, ddt, cols,
              static_cast<unsigned char*>(out->data) +
                  ((row - out->row0) * out->stride + col0) * out_es,
              out->dtype);
    }
  }
}

}  // namespace

bool HasBf16Matmuls() {
  const CpuFeatures& cpu = GetCpuFeatures();
  return cpu.avx512_bf16 || cpu.amx_bf16;
}

size_t DefaultPanelBytes() {
  static const size_t bytes = [] {
    const long l2 = sysconf(_SC_LEVEL2_CACHE_SIZE);
    if (l2 <= 0) return size_t{512} << 10;
    return std::clamp<size_t>(static_cast<size_t>(l2) / 2, size_t{256} << 10, size_t{2} << 20);
  }();
  return bytes;
}

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
    DType dst_dtype, size_t max_panel_bytes) {
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
  const size_t col_bytes = static_cast<size_t>(k) * DTypeSize(linear->src_dtype_);
  const size_t budget = max_panel_bytes > 0 ? max_panel_bytes : DefaultPanelBytes();
  int64_t cols = n;
  if (static_cast<size_t>(n) * col_bytes > budget) {
    for (int64_t c = n - 1; c >= 16; --c) {
      if (n % c == 0 && c % 16 == 0 && static_cast<size_t>(c) * col_bytes <= budget) {
        cols = c;
        break;
      }
    }
  }
  linear->panel_cols_ = cols;
  // fp32 panels go straight into full output rows (no copy; oneDNN 2.6 runs
  // a strided dst on its jit gemm, as fast as brgemm here). bf16 panels stay
  // dense: a strided dst would move them off the AMX brgemm kernels onto a
  // gemm 2-3x slower.
  linear->dst_ld_ = linear->src_dtype_ == DType::kFloat32 ? n : cols;
  const int64_t panels = n / cols;

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
      l.dst_md_ = dnnl::memory::desc({h, cols}, DnnlType(dst_dtype), {l.dst_ld_, 1});
      const dnnl::memory::desc wei_any({k, cols}, DnnlType(wdt), dnnl::memory::format_tag::any);
      const dnnl::memory::desc bias_md({1, cols}, dt::f32, {cols, 1});
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
      for (int64_t p = 0; p < panels; ++p) {
        // Rows [p * cols, (p + 1) * cols) of W [N, K] are this panel's [K, cols].
        dnnl::memory user_mem(dnnl::memory::desc({k, cols}, DnnlType(wdt), {1, k}), engine,
                              user.data() + p * cols * k * DTypeSize(wdt));
        l.weights_.emplace_back(pd.weights_desc(), engine);
        dnnl::reorder(user_mem, l.weights_.back()).execute(stream, user_mem, l.weights_.back());
        if (has_bias) {
          l.bias_.emplace_back(bias_md, engine);
          std::memcpy(l.bias_.back().get_data_handle(), bias.data() + p * cols,
                      static_cast<size_t>(cols) * sizeof(float));
        }
      }
      stream.wait();

      // Position check: every row of the chunk the same random vector; all
      // output rows of every panel must then be bitwise equal.
      AlignedBytes src(h * k * DTypeSize(wdt));
      AlignedBytes dst(h * l.dst_ld_ * DTypeSize(dst_dtype));
      AlignedBytes pad(std::max<size_t>(l.scratchpad_bytes_, 1));
      std::mt19937 gen(12345);
      std::vector<float> row(static_cast<size_t>(k));
      const size_t s_row = static_cast<size_t>(k) * DTypeSize(wdt);
      const size_t d_es = DTypeSize(dst_dtype), d_row = static_cast<size_t>(l.dst_ld_) * d_es;
      for (int trial = 0; trial < 2 && l.rows_independent_; ++trial) {
        for (float& v : row) v = static_cast<float>(gen() >> 8) * 0x1.0p-23f - 1.0f;
        for (int64_t r = 0; r < h; ++r) {
          Convert(row.data(), DType::kFloat32, k, src.data() + r * s_row, wdt);
        }
        for (int64_t p = 0; p < panels; ++p) {
          unsigned char* base = dst.data() + (l.dst_ld_ == n ? p * cols * d_es : 0);
          l.RunChunk(src.data(), base, p, pad.data(), stream);
          for (int64_t r = 1; r < h; ++r) {
            if (std::memcmp(base, base + r * d_row, cols * d_es) != 0) {
              l.rows_independent_ = false;
            }
          }
        }
      }
    });
  } catch (const dnnl::error& e) {
    const std::string what =
        absl::StrCat("ChunkedLinear: oneDNN matmul [", h, ", ", k, "] x [", k, ", ", n, "] in ",
                     std::string(DTypeName(wdt)), ": ", e.what());
    if (e.status == dnnl_unimplemented) {
      return absl::UnimplementedError(absl::StrCat(what, " (none on this CPU)"));
    }
    return absl::InternalError(what);
  }
  return std::unique_ptr<const ChunkedLinear>(std::move(linear));
}

void ChunkedLinear::RunChunk(const void* src, void* dst, int64_t panel, void* scratchpad,
                             dnnl::stream& stream) const {
  const size_t p = static_cast<size_t>(panel);
  // oneDNN takes non-const handles; it only reads src.
  std::unordered_map<int, dnnl::memory> args = {
      {DNNL_ARG_SRC, dnnl::memory(src_md_, engine_, const_cast<void*>(src))},
      {DNNL_ARG_WEIGHTS, weights_[p]},
      {DNNL_ARG_DST, dnnl::memory(dst_md_, engine_, dst)}};
  if (!bias_.empty()) args.emplace(DNNL_ARG_BIAS, bias_[p]);
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
    int64_t panel;
  };
  std::vector<Item> gathers, items;
  // Chunks of a multi-panel job that are not read in place are gathered once,
  // into the staged rows at staged_offset[job], instead of once per panel.
  std::vector<size_t> staged_offset(jobs.size(), 0);
  size_t staged_bytes = 0;
  size_t src_bytes = 0, dst_bytes = 0, pad_bytes = 1;
  {
    for (size_t j = 0; j < jobs.size(); ++j) {
      const LinearJob& job = jobs[j];
      if (job.linear == nullptr || job.rows % job.linear->chunk_rows() != 0) {
        return absl::InternalError("RunLinearJobs: rows must be a multiple of chunk_rows()");
      }
      const ChunkedLinear& lin = *job.linear;
      const int64_t h = lin.chunk_rows(), chunks = job.rows / h;
      const size_t s_chunk = h * lin.in_features() * DTypeSize(lin.src_dtype());
      src_bytes = std::max(src_bytes, s_chunk);
      dst_bytes = std::max(dst_bytes, h * lin.out_features() * DTypeSize(lin.dst_dtype()));
      pad_bytes = std::max(pad_bytes, lin.scratchpad_bytes());
      if (lin.panels() > 1) {
        for (int64_t c = 0; c < chunks; ++c) {
          if (InPlaceSrc(job, c) == nullptr) gathers.push_back({j, c, 0});
        }
        if (!gathers.empty() && gathers.back().job == j) {
          staged_offset[j] = staged_bytes;
          staged_bytes += static_cast<size_t>(chunks) * s_chunk;  // a multiple of 64
        }
      }
      for (int64_t p = 0; p < lin.panels(); ++p) {
        for (int64_t c = 0; c < chunks; ++c) items.push_back({j, c, p});
      }
    }
  }
  if (items.empty()) return absl::OkStatus();
  std::optional<ThreadBuffer> staged;
  try {
    if (staged_bytes > 0) staged.emplace(BufferSlot::kStagedRows, staged_bytes);
  } catch (const std::bad_alloc&) {
    return absl::ResourceExhaustedError("projection: out of memory for staged rows");
  }
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
  auto staged_chunk = [&](const Item& item) {
    const ChunkedLinear& lin = *jobs[item.job].linear;
    return staged->data() + staged_offset[item.job] +
           item.chunk * lin.chunk_rows() * lin.in_features() * DTypeSize(lin.src_dtype());
  };
  const int64_t n_gathers = static_cast<int64_t>(gathers.size());
  const int64_t n_items = static_cast<int64_t>(items.size());
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
#ifdef _OPENMP
    // oneDNN inside a chunk runs on this thread only (the primitives were
    // built for one thread); the count dies with the region.
    omp_set_num_threads(1);
#endif
    std::unique_ptr<dnnl::stream> stream;
    // This worker's buffers, kept for its next call (thread_buffer.h).
    std::optional<ThreadBuffer> src, dst, pad;
    try {
      stream = std::make_unique<dnnl::stream>(engine);
      src.emplace(BufferSlot::kChunkSrc, src_bytes);
      dst.emplace(BufferSlot::kChunkDst, dst_bytes);
      pad.emplace(BufferSlot::kChunkScratchpad, pad_bytes);
    } catch (const dnnl::error& e) {
      fail(absl::InternalError(absl::StrCat("projection: oneDNN stream: ", e.what())));
    } catch (const std::bad_alloc&) {
      fail(absl::ResourceExhaustedError("projection: out of memory for chunk buffers"));
    }
    // Every thread reaches both worksharing loops, ready or not; the barrier
    // between them puts every staged chunk in place before any panel reads it.
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < n_gathers; ++i) {
      if (failed.load(std::memory_order_relaxed)) continue;
      const Item& item = gathers[static_cast<size_t>(i)];
      GatherChunk(jobs[item.job], item.chunk, staged_chunk(item));
    }
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < n_items; ++i) {
      if (failed.load(std::memory_order_relaxed)) continue;
      const Item& item = items[static_cast<size_t>(i)];
      const LinearJob& job = jobs[item.job];
      try {
        const void* in = InPlaceSrc(job, item.chunk);
        if (in == nullptr && job.linear->panels() > 1) {
          in = staged_chunk(item);
        } else if (in == nullptr) {
          GatherChunk(job, item.chunk, src->data());
          in = src->data();
        }
        RunPanelOf(job, item.chunk, item.panel, in, dst->data(), pad->data(), *stream);
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
absl::StatusOr<const ChunkedLinear*> LayerProjections::g(const AttentionLayer& layer) {
  return Get(kG, layer);
}

absl::StatusOr<const ChunkedLinear*> LayerProjections::latent_a(const AttentionLayer& layer) {
  return Get(kLatentA, layer);
}
absl::StatusOr<const ChunkedLinear*> LayerProjections::kv_b(const AttentionLayer& layer) {
  return Get(kKvB, layer);
}

absl::StatusOr<const LayerProjections::AbsorbedLinears*> LayerProjections::absorbed(
    const AttentionLayer& layer) {
  absl::MutexLock lock(&mu_);
  if (absorbed_ != nullptr) return absorbed_.get();
  const LayerConfig& c = layer.config;
  const LayerWeights& w = layer.weights;
  const int64_t h = c.num_heads, rank = c.latent.kv_lora_rank;
  const int64_t nope = c.head_dim - c.latent.rope_dim, dv = c.latent.v_head_dim;
  const DType act = activation_dtype();
  auto made = std::make_unique<AbsorbedLinears>();
  const Tensor no_bias;
  for (int64_t head = 0; head < h; ++head) {
    // Wk_h^T: row x holds column x of head h's nope rows of Wk.
    Tensor key(DType::kFloat32, {rank, nope});
    const float* wk = w.wk.data_as<float>() + head * nope * rank;
    for (int64_t n = 0; n < nope; ++n) {
      for (int64_t x = 0; x < rank; ++x) key.data_as<float>()[x * nope + n] = wk[n * rank + x];
    }
    Tensor value(DType::kFloat32, {dv, rank});
    std::memcpy(value.data(), w.wv.data_as<float>() + head * dv * rank, value.byte_size());
    for (auto [weight, out] : {std::pair{&key, &made->key_absorbed}, {&value, &made->value}}) {
      absl::StatusOr<std::unique_ptr<const ChunkedLinear>> linear =
          ChunkedLinear::Create(engine_, {weight}, {&no_bias}, precision_, act, act);
      if (!linear.ok()) return linear.status();
      out->push_back(std::move(*linear));
    }
  }
  absorbed_ = std::move(made);
  return absorbed_.get();
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
    case kQkv:
      if (layer.config.output_gate) {
        create({&w.wq, &w.wk, &w.wv, &w.wg}, {&w.bq, &w.bk, &w.bv, &w.bg}, act);
      } else {
        create({&w.wq, &w.wk, &w.wv}, {&w.bq, &w.bk, &w.bv}, act);
      }
      break;
    case kQ: create({&w.wq}, {&w.bq}, act); break;
    case kK: create({&w.wk}, {&w.bk}, act); break;
    case kV: create({&w.wv}, {&w.bv}, act); break;
    // fp32 out: the task's output dtype is applied when rows are scattered.
    case kO: create({&w.wo}, {&w.bo}, DType::kFloat32); break;
    case kG: create({&w.wg}, {&w.bg}, act); break;
    case kLatentA:
      if (layer.config.latent.q_lora_rank > 0) {
        create({&w.wq_a, &w.wkv_a}, {&w.bq_a, &w.bkv_a}, act);
      } else {
        create({&w.wq, &w.wkv_a}, {&w.bq, &w.bkv_a}, act);
      }
      break;
    case kKvB: create({&w.wk, &w.wv}, {&w.bk, &w.bv}, act); break;
    case kCount: break;
  }
  if (!made.ok()) return made.status();
  linears_[which] = std::move(*made);
  return linears_[which].get();
}

std::shared_ptr<LayerProjections> ProjectionCache::Get(const AttentionLayer& layer) {
  absl::MutexLock lock(&mu_);
  Entry& entry = entries_[&layer];
  entry.last_use = ++clock_;
  if (entry.projections == nullptr || entry.layer_id != layer.id.value()) {
    entry.layer_id = layer.id.value();
    entry.projections = std::make_shared<LayerProjections>(engine_, layer.config.precision,
                                                           HasBf16Matmuls());
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
