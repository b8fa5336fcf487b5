// The cpu backend's projections: y = x W^T + b as oneDNN matmuls over rows
// stacked from every task of a batch, cut into fixed-height chunks so that a
// row's result never depends on what else is in the batch. Internal to engine/cpu.
#ifndef ATTNSERVE_ENGINE_CPU_PROJECTION_H_
#define ATTNSERVE_ENGINE_CPU_PROJECTION_H_

#include <cstdint>
#include <map>
#include <memory>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "engine/attention_layer.h"
#include "engine/tensor.h"
#include "oneapi/dnnl/dnnl.hpp"

namespace attnserve::cpu {

// Rows per chunk. Every chunk of a stacked projection is one single-threaded
// matmul of exactly chunk_rows() rows (a short last chunk is zero-padded), so
// the primitive, its blocking and its summation order are fixed per layer:
// the batch decides only which chunk and which position a row lands in.
//
// The height is fixed per linear from its weight size: kChunkRows (32) keeps
// an AVX-512 fp32 or AMX bf16 matmul near its single-core peak while a lone
// short request wastes at most 31 padded rows; linears whose weights exceed
// kTallChunkWeightBytes (several times a core's L2) use kTallChunkRows (64),
// since every chunk streamed the whole weight matrix from L3 and 32 rows no
// longer amortised that (B8 L512 E768 fp32: 7% faster with 64, measured
// before column panels kept each panel's weights in L2).
inline constexpr int64_t kChunkRows = 32;
inline constexpr int64_t kTallChunkRows = 64;
inline constexpr size_t kTallChunkWeightBytes = size_t{4} << 20;

// Column panels. A linear whose weights exceed the panel budget is cut into
// equal panels of output columns, each prepacked on its own and small enough
// to stay in a core's L2 while RunLinearJobs runs it over every chunk of a
// batch (panel-major): the weights then come from L3 once per batch instead
// of once per chunk, and a lone request's single chunk still has one item
// per panel for the threads to share. Splitting columns changes no output
// element's summation (each is one K-long dot product of one primitive), so
// the panel count does not affect batch invariance.
//
// The budget is half the L2 of the CPU we run on (sysconf), clamped to
// [256 KiB, 2 MiB]; 512 KiB when the L2 size is unknown.
size_t DefaultPanelBytes();

// Rows [row0, row0 + rows) of a stacked matrix that live in someone else's
// buffer: row r at data + (r - row0) * stride elements of `dtype`, its
// columns contiguous.
struct RowBlock {
  int64_t row0 = 0;
  int64_t rows = 0;
  DType dtype = DType::kFloat32;
  const void* data = nullptr;
  int64_t stride = 0;
};
struct MutableRowBlock {
  int64_t row0 = 0;
  int64_t rows = 0;
  DType dtype = DType::kFloat32;
  void* data = nullptr;
  int64_t stride = 0;
};

// y [M, N] = x [M, K] W^T + b for any M, as ceil(M / chunk_rows()) x
// panels() matmuls of chunk_rows() rows by panel_cols() columns, with each
// panel's weights prepacked (oneDNN's preferred layout) once.
//
// W and b are first rounded to `rounding` (bf16 or fp16 values; exact when
// the weight loader already did it). x and W then enter the matmul as
// `compute_dtype` (FLOAT32, or BFLOAT16 with fp32 accumulation and an fp32
// bias); dst is `dst_dtype` (FLOAT32 or BFLOAT16).
//
// Thread safety: immutable after Create; RunChunk may run concurrently.
class ChunkedLinear {
 public:
  // W = the rows of `weights` stacked ([n_i, K] each, PyTorch Linear layout,
  // FLOAT32; several = a fused projection such as [Wq; Wk; Wv]); b = the
  // matching `biases` (an empty Tensor = zeros). Builds and checks the
  // primitive with one OpenMP thread (see rows_independent()). Unimplemented
  // when oneDNN has no such matmul on this CPU (BFLOAT16 compute_dtype on
  // AVX2-only CPUs: see HasBf16Matmuls()).
  //
  // `max_panel_bytes`: prepacked weight bytes per column panel (0 =
  // DefaultPanelBytes()). The panel width is the widest divisor of N that is
  // a multiple of 16 and fits; N itself when it all fits or no such divisor
  // exists.
  static absl::StatusOr<std::unique_ptr<const ChunkedLinear>> Create(
      const dnnl::engine& engine, absl::Span<const Tensor* const> weights,
      absl::Span<const Tensor* const> biases, Precision rounding, DType compute_dtype,
      DType dst_dtype, size_t max_panel_bytes = 0);

  int64_t in_features() const { return k_; }
  int64_t out_features() const { return n_; }
  // Type of x as the matmul reads it: FLOAT32 or BFLOAT16.
  DType src_dtype() const { return src_dtype_; }
  DType dst_dtype() const { return dst_dtype_; }
  // kChunkRows or kTallChunkRows (see there).
  int64_t chunk_rows() const { return chunk_rows_; }
  // Output columns per panel (divides out_features()), and the panel count.
  int64_t panel_cols() const { return panel_cols_; }
  int64_t panels() const { return n_ / panel_cols_; }

  // Whether a row's output is bitwise the same at every position of a chunk,
  // checked once at creation by running a chunk whose rows are all equal.
  // When false, callers start each task's rows at a chunk boundary, so that a
  // task meets the same primitive at the same positions whatever its batch.
  bool rows_independent() const { return rows_independent_; }

  // Row stride of RunChunk's dst, in elements: out_features() when panels
  // are written into full output rows (fp32), panel_cols() when each panel
  // is written densely (bf16).
  int64_t dst_row_stride() const { return dst_ld_; }

  // One panel of one chunk: src [chunk_rows(), K] contiguous in src_dtype();
  // dst [chunk_rows(), panel_cols()] in dst_dtype() with rows
  // dst_row_stride() elements apart, receiving output columns
  // [panel * panel_cols(), (panel + 1) * panel_cols()).
  // Runs on the calling thread (callers set the OpenMP thread count to 1
  // first). `scratchpad` holds scratchpad_bytes(). Throws dnnl::error.
  void RunChunk(const void* src, void* dst, int64_t panel, void* scratchpad,
                dnnl::stream& stream) const;
  size_t scratchpad_bytes() const { return scratchpad_bytes_; }

 private:
  ChunkedLinear() = default;

  int64_t k_ = 0, n_ = 0, chunk_rows_ = kChunkRows, panel_cols_ = 1, dst_ld_ = 1;
  DType src_dtype_ = DType::kFloat32, dst_dtype_ = DType::kFloat32;
  bool rows_independent_ = true;
  dnnl::engine engine_;
  dnnl::matmul primitive_;
  dnnl::memory::desc src_md_, dst_md_, scratchpad_md_;
  std::vector<dnnl::memory> weights_, bias_;  // per panel; prepacked, owned
  size_t scratchpad_bytes_ = 0;
};

// One stacked projection over a batch: `rows` rows (a multiple of the
// linear's chunk_rows()) whose inputs are `in` and whose outputs go to `out` (each
// sorted by row0, not overlapping). Rows that no `in` block covers read as
// zeros; outputs of rows that no `out` block covers are dropped.
struct LinearJob {
  const ChunkedLinear* linear = nullptr;
  int64_t rows = 0;
  std::vector<RowBlock> in;
  std::vector<MutableRowBlock> out;
};

// Runs every (chunk, panel) of every job on `threads` OpenMP threads, panel
// by panel so that a panel's weights stay in cache across the chunks. Items
// are handed out dynamically; which thread runs one changes no result: each
// is the same single-threaded matmul on its own rows and columns. Inputs are
// converted to the linear's src type while gathered into a 64-byte aligned
// chunk buffer (for a linear of several panels, once per chunk in a first
// pass); an `in` block already in that type with a 64-byte aligned start and
// rows of exactly K elements is read in place. Errors: Internal (oneDNN) or
// ResourceExhausted.
absl::Status RunLinearJobs(absl::Span<const LinearJob> jobs, const dnnl::engine& engine,
                           int threads);

// An uninitialised, 64-byte aligned byte buffer (stacked activations and
// per-thread chunk buffers: every chunk then starts 64-byte aligned).
class AlignedBytes {
 public:
  AlignedBytes() = default;
  explicit AlignedBytes(size_t bytes);  // throws std::bad_alloc
  unsigned char* data() const { return data_.get(); }
  size_t size() const { return size_; }

 private:
  struct Free {
    void operator()(unsigned char* p) const;
  };
  std::unique_ptr<unsigned char, Free> data_;
  size_t size_ = 0;
};

// Placement of blocks of rows one after another in a stacked matrix for
// `linear` (each block at a chunk boundary unless linear.rows_independent());
// `total` is rounded up to the linear's chunk_rows().
struct RowLayout {
  std::vector<int64_t> offsets;
  int64_t total = 0;
};
RowLayout LayoutRows(absl::Span<const int64_t> rows, int64_t chunk_rows, bool aligned);
RowLayout LayoutRowsFor(const ChunkedLinear& linear, absl::Span<const int64_t> rows);

// Whether the engine gives a bf16 layer's matmuls bf16 operands: true on CPUs
// with AVX512_BF16 or AMX. Elsewhere bf16 layers compute in fp32 on
// bf16-rounded weights: oneDNN 2.6 has no bf16 matmul at all on AVX2-only
// CPUs (ChunkedLinear::Create returns Unimplemented there) and emulates one on
// other AVX-512 CPUs, slower than fp32.
bool HasBf16Matmuls();

// The per-layer state of the projections: the prepacked linears, each built
// on the first call that needs it and kept for the life of the entry.
//
// Thread safety: thread-safe. Getters may block while a linear is built.
class LayerProjections {
 public:
  // `bf16_compute`: whether a bf16 layer's matmuls take bf16 operands
  // (ProjectionCache passes HasBf16Matmuls(); true where it is false makes
  // a bf16 layer's getters fail on AVX2-only CPUs). Without it a bf16 layer
  // computes in fp32 on bf16-rounded weights.
  LayerProjections(const dnnl::engine& engine, Precision precision, bool bf16_compute)
      : engine_(engine),
        precision_(precision),
        activation_dtype_(precision == Precision::kBFloat16 && bf16_compute ? DType::kBFloat16
                                                                            : DType::kFloat32) {}

  // Activation type of the matmuls and between the projections and the
  // attention core: BFLOAT16 for bf16 layers with bf16 compute, else FLOAT32.
  DType activation_dtype() const { return activation_dtype_; }

  // The fused [Wq; Wk; Wv] (self-attention; [Wq; Wk; Wv; Wg] with an output
  // gate), Q, K, V, output and gate linears of `layer` (the layer this entry
  // was made for; read only while building).
  absl::StatusOr<const ChunkedLinear*> qkv(const AttentionLayer& layer);
  absl::StatusOr<const ChunkedLinear*> q(const AttentionLayer& layer);
  absl::StatusOr<const ChunkedLinear*> k(const AttentionLayer& layer);
  absl::StatusOr<const ChunkedLinear*> v(const AttentionLayer& layer);
  absl::StatusOr<const ChunkedLinear*> o(const AttentionLayer& layer);
  absl::StatusOr<const ChunkedLinear*> g(const AttentionLayer& layer);
  // A latent layer's (LatentAttention): the fused first projections of x,
  // [Wq_a; Wkv_a] ([Wq; Wkv_a] without q_lora_rank), and the fused [Wk; Wv]
  // of the normalised latent; q() is then q_b_proj's Wq.
  absl::StatusOr<const ChunkedLinear*> latent_a(const AttentionLayer& layer);
  absl::StatusOr<const ChunkedLinear*> kv_b(const AttentionLayer& layer);
  // A latent layer's per-head linears over the latent (sessions, which
  // cache the latent): key_absorbed[h] maps head h's nope query features to
  // the latent (weight Wk_h^T, [kv_lora_rank, nope]: q_nope_h Wk_h), and
  // value[h] the attention's output over the latent to head h's value
  // features (Wv_h, [v_head_dim, kv_lora_rank]), both without biases.
  struct AbsorbedLinears {
    std::vector<std::unique_ptr<const ChunkedLinear>> key_absorbed, value;
  };
  absl::StatusOr<const AbsorbedLinears*> absorbed(const AttentionLayer& layer);

 private:
  enum Which { kQkv, kQ, kK, kV, kO, kG, kLatentA, kKvB, kCount };
  absl::StatusOr<const ChunkedLinear*> Get(Which which, const AttentionLayer& layer);

  const dnnl::engine engine_;
  const Precision precision_;
  const DType activation_dtype_;
  absl::Mutex mu_;
  std::unique_ptr<const ChunkedLinear> linears_[kCount] ABSL_GUARDED_BY(mu_);
  std::unique_ptr<const AbsorbedLinears> absorbed_ ABSL_GUARDED_BY(mu_);
};

// LayerProjections by layer address (AttentionEngine's contract lets an
// engine key per-layer state so). An entry also records the layer's LayerId,
// so a new layer built at a freed layer's address gets a fresh entry instead
// of the old weights.
//
// Thread safety: thread-safe. Entries are shared_ptrs: one replaced or
// evicted while a call uses it stays alive until that call ends.
class ProjectionCache {
 public:
  // `capacity`: layers kept; the least recently used one is dropped beyond
  // it (and rebuilt if it comes back).
  explicit ProjectionCache(const dnnl::engine& engine, size_t capacity = 64)
      : engine_(engine), capacity_(capacity) {}

  std::shared_ptr<LayerProjections> Get(const AttentionLayer& layer);

 private:
  struct Entry {
    uint64_t layer_id = 0;
    uint64_t last_use = 0;
    std::shared_ptr<LayerProjections> projections;
  };

  const dnnl::engine engine_;
  const size_t capacity_;
  absl::Mutex mu_;
  uint64_t clock_ ABSL_GUARDED_BY(mu_) = 0;
  std::map<const AttentionLayer*, Entry> entries_ ABSL_GUARDED_BY(mu_);
};

}  // namespace attnserve::cpu

#endif  // ATTNSERVE_ENGINE_CPU_PROJECTION_H_
