// Server-side sessions on the GPU: the kernels over a session's paged K/V
// cache (engine/paged_kv.h) in device memory. Append writes a request's new
// K/V rows into the blocks; the split-KV decode reads the blocks in place for
// requests with few query rows; gather copies them into a contiguous buffer
// for the engine's other attention paths (prefills, multi-token appends:
// cuDNN's SDPA where it takes them, else the kernels written here).
//
// Hand-written: no library computes attention over this block layout
// ([num_kv_heads][block_tokens][head_dim] per block, a table of block
// pointers per session) with our visibility rules; cuDNN's paged SDPA wants
// its blocks in one container tensor indexed by a page table (ours come
// from many slabs, each its own allocation), and flash-attention's paged
// decode is a PyTorch extension. fp32 accumulation and fixed reduction orders; the
// decode is bound by reading the cache, so its kernel is written to keep
// many reads in flight (see the .cu).
//
// Plain header (no absl), so that the .cu file compiles with nvcc alone.
// Every pointer the launchers take is a device pointer, the block tables
// included (arrays of block addresses in device memory).
#ifndef ATTNSERVE_ENGINE_CUDA_PAGED_ATTENTION_H_
#define ATTNSERVE_ENGINE_CUDA_PAGED_ATTENTION_H_

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "engine/attention_params.h"
#include "engine/dtype.h"

namespace attnserve::cuda {

// Where LaunchPagedAppend writes: a session's cache (PagedKv) with its block
// tables on the device. Null blocks (released outside a sliding window) are
// never written.
struct PagedCacheArgs {
  DType dtype = DType::kFloat32;  // what the blocks hold
  void* const* k_blocks = nullptr;
  void* const* v_blocks = nullptr;
  int64_t block_tokens = 0;
  int64_t cached_len = 0;  // the new rows go to [cached_len, cached_len + rows)
};

// Copies the K/V rows `rows` reads (batch 0; rows.kv_len rows of each of
// rows.num_kv_heads heads, head_dim / head_dim_v wide, rows.dtype, through
// rows.k / rows.v and their head and row strides) into the cache at token
// positions [cached_len, cached_len + rows.kv_len), converting to
// cache.dtype. Key (h, pos, d) goes to
//   k_blocks[pos / block_tokens][(h * block_tokens + pos % block_tokens) * head_dim + d]
// and likewise V with head_dim_v.
cudaError_t LaunchPagedAppend(const AttentionParams& rows, const PagedCacheArgs& cache,
                              cudaStream_t stream);

// Where LaunchPagedGather writes: K and V of `rows` rows per head (at least
// the cache's length; the rows past it zeros, as a cuDNN plan's bucket
// wants them) in `dtype`, in head layout k [Hkv, rows, head_dim], v [Hkv,
// rows, head_dim_v], or token layout k [rows, Hkv * head_dim], v [rows,
// Hkv * head_dim_v].
struct PagedGatherOut {
  void* k = nullptr;
  void* v = nullptr;
  DType dtype = DType::kFloat32;
  int64_t rows = 0;
  bool token_layout = false;
};

// Gathers the paged K/V of `a` (a.k_blocks / a.v_blocks set; a.kv_len
// tokens of a.dtype, the blocks' dtype) into `out`, converting to
// out.dtype. Null blocks read as zeros (nothing reads them: they lie before
// every row's window). cudaErrorInvalidValue when out.rows < a.kv_len.
cudaError_t LaunchPagedGather(const AttentionParams& a, const PagedGatherOut& out,
                              cudaStream_t stream);

// The split-KV decode over paged K/V: softmax(Q K^T * scale) V for `a`
// (batch 1; a.k_blocks / a.v_blocks set, a.kv_len the whole cache; q in
// a.dtype, the blocks' dtype, at its strides; out in a.out_dtype at its
// strides). Every visibility rule of a session (attention_params.h):
// causal bottom-right, sliding window, softcap, ALiBi (a.alibi_slopes a
// device array of num_heads slopes, or null), the relative position bias
// (a.relative_bias a device array [num_heads, 2 * relative_bias_distance +
// 1], or null), the relative position embeddings (a.relative_key and
// a.relative_query device arrays [num_heads, head_dim, 2 *
// relative_embedding_distance + 1], either or both null), sinks (a.sinks a
// device array of num_heads logits, or null), grouped-query heads. No mask,
// no key_lengths, no weights. A row that sees no key gives zeros.
//
// One CUDA block per (kv head, tile of up to 8 of its query rows, chunk of
// keys) computes each row's partial (max, sum, accumulator) over the chunk
// in fp32 into `scratch`, reading each K and V row once for all the tile's
// rows (grouped-query heads share them); a second kernel combines the
// chunks of each row in chunk order. The keys are split into equal chunks
// (the last one shorter), no more than kv_len / kPagedDecodeMinChunkKeys
// rounded up, as many as bring the blocks to about kPagedDecodeTargetBlocks
// (a decode step of few rows gets many chunks; a long request few, which
// bounds the scratch). Deterministic: the split,
// hence the result, depends on the request alone.
inline constexpr int64_t kPagedDecodeMinChunkKeys = 128;
inline constexpr int64_t kPagedDecodeTargetBlocks = 2048;
inline constexpr int64_t kPagedDecodeMaxHeadDim = 256;
// The engine takes this path for requests with at most this many query rows
// (decode steps, short appends); longer ones gather and use the engine's
// other kernels. A first guess, to be measured.
inline constexpr int64_t kPagedDecodeMaxQueryRows = 16;

// Whether LaunchPagedDecode computes `a`: head dims up to
// kPagedDecodeMaxHeadDim, batch 1, no mask, key_lengths or weights.
bool PagedDecodeSupports(const AttentionParams& a);
// Bytes of device scratch LaunchPagedDecode needs for `a`.
size_t PagedDecodeScratchBytes(const AttentionParams& a);
cudaError_t LaunchPagedDecode(const AttentionParams& a, void* scratch, cudaStream_t stream);

// The decodes of a batch of session requests in one launch of each of the
// two kernels, instead of two launches per request: a step of 32 sessions
// is then one grid wide enough to keep every SM reading. Each request's
// arithmetic (its split into chunks, every sum's order) is what
// LaunchPagedDecode does for it alone, so results stay batch-invariant,
// bitwise.
//
//   1. PlanPagedDecodeBatch fills entries[i] for requests[i] (each one
//      PagedDecodeSupports, all of one dtype), its scratch at scratch[i]
//      (PagedDecodeScratchBytes(requests[i]) bytes of device memory);
//   2. the caller copies the entries to device memory;
//   3. LaunchPagedDecodeBatch(plan, the device copy, stream).
struct PagedDecodeEntry {
  AttentionParams a;
  float* partial = nullptr;  // the request's scratch
  int64_t tiles = 0, chunks = 0, chunk_keys = 0;
  int64_t first_block = 0;  // its first block in the decode kernel's grid
  int64_t first_row = 0;    // its first row in the combine kernel's grid
};
struct PagedDecodeBatchPlan {
  int count = 0;
  DType dtype = DType::kFloat32;
  int64_t blocks = 0;  // decode grid
  int64_t rows = 0;    // combine grid
  int64_t max_head_dim_v = 0;
  int64_t max_tile_rows = 0;  // the most query rows one decode block computes
};
PagedDecodeBatchPlan PlanPagedDecodeBatch(const AttentionParams* requests, void* const* scratch,
                                          int count, PagedDecodeEntry* entries);
cudaError_t LaunchPagedDecodeBatch(const PagedDecodeBatchPlan& plan,
                                   const PagedDecodeEntry* device_entries, cudaStream_t stream);

}  // namespace attnserve::cuda

#endif  // ATTNSERVE_ENGINE_CUDA_PAGED_ATTENTION_H_
