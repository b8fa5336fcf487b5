// The paged K/V kernels of server-side sessions (paged_attention.h): append,
// gather, and the split-KV decode with its combine pass.
#include "engine/cuda/paged_attention.h"

#include <algorithm>
#include <cstdint>

#include "engine/cuda/device_utils.cuh"

namespace attnserve::cuda {
namespace {

constexpr int kWarpSize = 32;
constexpr unsigned kFullMask = 0xffffffffu;

// Elementwise kernels: grid-stride loops over a capped grid.
constexpr int kCopyThreads = 256;
unsigned CopyGrid(int64_t n) {
  return static_cast<unsigned>(std::min<int64_t>((n + kCopyThreads - 1) / kCopyThreads, 1 << 16));
}

// The decode kernel: 4 warps per block, each warp taking every 4th key of
// the block's chunk.
constexpr int kDecodeWarps = 4;
constexpr int kDecodeThreads = kDecodeWarps * kWarpSize;
constexpr int kPerLane = static_cast<int>(kPagedDecodeMaxHeadDim) / kWarpSize;  // 8
constexpr int kCombineThreads = 128;

// A decode block takes up to kTileRows query rows of one kv head: the rows
// r = (h - g * group) * q_len + i of the heads h of kv head g's group, so
// each K/V row it reads serves all of them.
constexpr int kTileRows = 8;

int64_t RowTiles(const AttentionParams& a) {
  const int64_t group_rows = a.num_heads / a.num_kv_heads * a.q_len;
  return (group_rows + kTileRows - 1) / kTileRows;
}

// How the keys of every row are split: `chunks` chunks of `chunk_keys`
// keys (the last one shorter), none empty.
struct Split {
  int64_t chunks = 1;
  int64_t chunk_keys = 1;
};

Split SplitFor(const AttentionParams& a) {
  const int64_t tiles = a.num_kv_heads * RowTiles(a);
  const int64_t most = (a.kv_len + kPagedDecodeMinChunkKeys - 1) / kPagedDecodeMinChunkKeys;
  const int64_t wanted = (kPagedDecodeTargetBlocks + tiles - 1) / tiles;
  Split split;
  const int64_t chunks = std::max<int64_t>(1, std::min(most, wanted));
  split.chunk_keys = (a.kv_len + chunks - 1) / chunks;
  split.chunks = (a.kv_len + split.chunk_keys - 1) / split.chunk_keys;
  return split;
}

// One partial per (row, chunk): max, sum, then head_dim_v accumulators.
__host__ __device__ inline int64_t PartialFloats(const AttentionParams& a) {
  return a.head_dim_v + 2;
}

// Element e of K [Hkv, len, head_dim] followed by V [Hkv, len, head_dim_v]
// (the element order of append and gather): which of the two, and its head,
// row and feature.
struct KvElement {
  bool is_k;
  int64_t h, row, d, dim;
  int64_t f;  // e within its tensor
};
__device__ __forceinline__ KvElement KvElementAt(int64_t e, int64_t hkv, int64_t len,
                                                 int64_t head_dim, int64_t head_dim_v) {
  KvElement x;
  const int64_t k_elems = hkv * len * head_dim;
  x.is_k = e < k_elems;
  x.f = x.is_k ? e : e - k_elems;
  x.dim = x.is_k ? head_dim : head_dim_v;
  x.d = x.f % x.dim;
  x.row = (x.f / x.dim) % len;
  x.h = x.f / x.dim / len;
  return x;
}

// The new rows' K then V: element (h, r, d) goes to the block that holds
// token cached_len + r.
__global__ void PagedAppendKernel(AttentionParams rows, PagedCacheArgs cache) {
  const int64_t hkv = rows.num_kv_heads, len = rows.kv_len;
  const int64_t n = hkv * len * (rows.head_dim + rows.head_dim_v);
  const int64_t bt = cache.block_tokens;
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < n;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const KvElement x = KvElementAt(e, hkv, len, rows.head_dim, rows.head_dim_v);
    const int64_t src = x.is_k ? x.h * rows.k_stride_h + x.row * rows.k_stride_row + x.d
                               : x.h * rows.v_stride_h + x.row * rows.v_stride_row + x.d;
    const int64_t pos = cache.cached_len + x.row;
    void* block = (x.is_k ? cache.k_blocks : cache.v_blocks)[pos / bt];
    if (block == nullptr) continue;  // never the case for new rows (CheckPagedKv)
    StoreElement(block, cache.dtype, (x.h * bt + pos % bt) * x.dim + x.d,
                 LoadElement(x.is_k ? rows.k : rows.v, rows.dtype, src));
  }
}

// The cache's K then V into `out` (PagedGatherOut): element (h, row, d) of
// K or V, rows past a.kv_len zeros.
__global__ void PagedGatherKernel(AttentionParams a, PagedGatherOut out) {
  const int64_t hkv = a.num_kv_heads, rows = out.rows;
  const int64_t n = hkv * rows * (a.head_dim + a.head_dim_v);
  const int64_t bt = a.block_tokens;
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < n;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const KvElement x = KvElementAt(e, hkv, rows, a.head_dim, a.head_dim_v);
    const void* block =
        x.row < a.kv_len ? (x.is_k ? a.k_blocks : a.v_blocks)[x.row / bt] : nullptr;
    const float value = block == nullptr
                            ? 0.0f
                            : LoadElement(block, a.dtype, (x.h * bt + x.row % bt) * x.dim + x.d);
    const int64_t at = out.token_layout ? (x.row * hkv + x.h) * x.dim + x.d : x.f;
    StoreElement(x.is_k ? out.k : out.v, out.dtype, at, value);
  }
}

// Row j of kv head `g` in a K (dim = head_dim) or V (head_dim_v) table.
template <typename T>
__device__ __forceinline__ const T* PagedRow(const void* const* blocks, int64_t block_tokens,
                                             int64_t dim, int64_t g, int64_t j) {
  const T* block = static_cast<const T*>(blocks[j / block_tokens]);
  return block + (g * block_tokens + j % block_tokens) * dim;
}

// One decode block of request `a`: (kv head g, tile of rows, chunk) =
// `block`, its grid flattened as (g * tiles + tile) * chunks + chunk. For
// each of its rows (h, i) it writes
// partial[((h * q_len + i) * chunks + chunk) * (Dv + 2)]: the chunk's max
// score m (-inf when the row sees none of its keys), the sum of
// exp(score - m) and the Dv accumulators sum exp(score - m) * v.
//
// Each warp takes tiles of 32 keys (warp w the tiles w, w + 4, ... of the
// chunk). Lane t computes the scores of key j0 + t for all the block's rows
// (its K row read whole, 16 bytes at a time where rows are 16-byte
// aligned); the warp then updates each row's online softmax over the tile
// (max and sum by butterflies, so every lane holds the same values), and
// accumulates P V with lanes over the features (d = lane + 32 u), each
// key's probabilities passed round by shuffles. So every K and V row is read
// once for all the rows of the tile, and no dot product is reduced across
// lanes.
//
// The step is bound by reading the cache, so reads are issued in groups
// before their values are used: kKLoads 16-byte loads of a K row per lane,
// and the V rows of kVGroup keys per warp (one load each in flight instead
// of one key's row at a time), after each lane has asked L2 for its key's
// V row while scoring. kRows is the most rows a block of this
// launch computes (1 for a one-row decode without grouped heads), so such
// a decode does not pay for eight. Neither changes any sum's order: the
// scores add over d, P V over the keys, in increasing order.
constexpr int kKLoads = 4;

template <typename T, int kLaneDims, int kRows>
__device__ __forceinline__ void DecodeBlock(const AttentionParams& a, int64_t tiles,
                                            int64_t chunks, int64_t chunk_keys, float* partial,
                                            int64_t block) {
  static_assert(kRows <= kTileRows);
  constexpr int kVGroup = 32 / kLaneDims;  // V rows in flight: 8 of 128 features, 4 of 256
  __shared__ __align__(16) float sq[kRows][kPagedDecodeMaxHeadDim];
  __shared__ float warp_m[kDecodeWarps][kRows];
  __shared__ float warp_l[kDecodeWarps][kRows];
  __shared__ float warp_acc[kDecodeWarps][kRows][kLaneDims * kWarpSize];

  const int warp = static_cast<int>(threadIdx.x) / kWarpSize;
  const int lane = static_cast<int>(threadIdx.x) % kWarpSize;
  const int64_t chunk = block % chunks;
  const int64_t tile = block / chunks % tiles;
  const int64_t g = block / chunks / tiles;
  const int64_t group = a.num_heads / a.num_kv_heads;
  const int64_t first = tile * kTileRows;  // of the group's rows
  // At most kRows (the launch's template is chosen so).
  const int rows = static_cast<int>(min(int64_t{kTileRows}, group * a.q_len - first));
  // Row r of the tile: head g * group + (first + r) / q_len, query index
  // (first + r) % q_len, at position that index + kv_len - q_len.
  auto head_of = [&](int r) { return g * group + (first + r) / a.q_len; };
  auto index_of = [&](int r) { return (first + r) % a.q_len; };

  // The rows' queries, zeros past head_dim (the K loop reads sq 16 bytes at
  // a time).
  for (int r = 0; r < kRows; ++r) {
    const T* q_row = r < rows ? static_cast<const T*>(a.q) + head_of(r) * a.q_stride_h +
                                    index_of(r) * a.q_stride_row
                              : nullptr;
    for (int64_t d = threadIdx.x; d < kPagedDecodeMaxHeadDim; d += kDecodeThreads) {
      sq[r][d] = q_row != nullptr && d < a.head_dim ? ToFloat(q_row[d]) : 0.0f;
    }
  }
  __syncthreads();

  int64_t pos[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r) pos[r] = index_of(min(r, rows - 1)) + a.kv_len - a.q_len;
  // Each row's ALiBi slope: its own head's (a tile's rows may span the
  // group's heads); 0 for the rows past the tile, whose head may not exist.
  float slope[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    slope[r] = a.alibi_slopes != nullptr && r < rows ? a.alibi_slopes[head_of(r)] : 0.0f;
  }
  // Likewise each row's head's row of the relative bias table; null for the
  // rows past the tile.
  const float* bias_row[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    bias_row[r] = a.relative_bias != nullptr && r < rows
                      ? a.relative_bias + head_of(r) * (2 * a.relative_bias_distance + 1)
                      : nullptr;
  }
  const bool embedded = HasRelativeEmbeddings(a);
  // The keys any row of the tile may see: the chunk, cut by the latest
  // row's causal (or two-sided window's) end and the earliest row's window
  // start (or attention chunk start).
  int64_t min_pos = pos[0], max_pos = pos[0];
#pragma unroll
  for (int r = 1; r < kRows; ++r) {
    min_pos = min(min_pos, pos[r]);
    max_pos = max(max_pos, pos[r]);
  }
  int64_t lo = chunk * chunk_keys;
  int64_t hi = min(a.kv_len, lo + chunk_keys);
  if (a.causal) hi = min(hi, max_pos + 1);
  if (!a.causal && a.window > 0) hi = min(hi, max_pos + a.window);  // two-sided
  if (a.window > 0) lo = max(lo, min_pos - a.window + 1);
  if (a.chunk > 0) lo = max(lo, min_pos / a.chunk * a.chunk);

  // K rows of 16-byte multiples (and blocks 16-byte aligned: the pool's
  // are 64-byte aligned) are read as 16-byte vectors.
  constexpr int kVec = 16 / static_cast<int>(sizeof(T));
  const bool vector_k = (a.head_dim % kVec) == 0;

  float m[kRows], l[kRows], acc[kRows][kLaneDims];
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    m[r] = -INFINITY;
    l[r] = 0.0f;
#pragma unroll
    for (int u = 0; u < kLaneDims; ++u) acc[r][u] = 0.0f;
  }
  for (int64_t j0 = lo + int64_t{warp} * kWarpSize; j0 < hi;
       j0 += int64_t{kDecodeWarps} * kWarpSize) {
    const int64_t j = j0 + lane;
    float s[kRows];
#pragma unroll
    for (int r = 0; r < kRows; ++r) s[r] = 0.0f;
    if (j < hi) {
      // The lane's key's V row towards L2 while its K row is read and
      // scored, so that P V below finds it there.
      const uintptr_t v_row = reinterpret_cast<uintptr_t>(
          PagedRow<T>(a.v_blocks, a.block_tokens, a.head_dim_v, g, j));
      const uintptr_t v_end = v_row + static_cast<uintptr_t>(a.head_dim_v) * sizeof(T) - 1;
      for (uintptr_t line = v_row & ~uintptr_t{127}; line <= v_end; line += 128) {
#if !defined(ATTNSERVE_CUDA_EMULATION)  // a hint; nothing to emulate
        asm volatile("prefetch.global.L2 [%0];" : : "l"(line));
#endif
      }
      const T* k = PagedRow<T>(a.k_blocks, a.block_tokens, a.head_dim, g, j);
      if (vector_k) {
        for (int64_t d0 = 0; d0 < a.head_dim; d0 += kKLoads * kVec) {
          uint4 raw[kKLoads];
#pragma unroll
          for (int u = 0; u < kKLoads; ++u) {
            raw[u] = d0 + u * kVec < a.head_dim
                         ? *reinterpret_cast<const uint4*>(k + d0 + u * kVec)
                         : make_uint4(0, 0, 0, 0);
          }
#pragma unroll
          for (int u = 0; u < kKLoads; ++u) {
            if (d0 + u * kVec < a.head_dim) {
              const T* x = reinterpret_cast<const T*>(&raw[u]);
#pragma unroll
              for (int e = 0; e < kVec; e += 4) {
                const float x0 = ToFloat(x[e]), x1 = ToFloat(x[e + 1]);
                const float x2 = ToFloat(x[e + 2]), x3 = ToFloat(x[e + 3]);
#pragma unroll
                for (int r = 0; r < kRows; ++r) {
                  const float4 qv = *reinterpret_cast<const float4*>(&sq[r][d0 + u * kVec + e]);
                  s[r] += qv.x * x0;
                  s[r] += qv.y * x1;
                  s[r] += qv.z * x2;
                  s[r] += qv.w * x3;
                }
              }
            }
          }
        }
      } else {
        for (int64_t d = 0; d < a.head_dim; ++d) {
          const float xd = ToFloat(k[d]);
#pragma unroll
          for (int r = 0; r < kRows; ++r) s[r] += sq[r][d] * xd;
        }
      }
      // The relative position embeddings' terms of each row's head with
      // this key, added to its raw score.
      if (embedded) {
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
          if (r < rows) s[r] += RelativeEmbeddings(a, head_of(r), pos[r], j, sq[r], k);
        }
      }
    }
    // Scores (with the embeddings' terms) after the scale, softcap, ALiBi's
    // bias, the relative bias and the row's visibility (-inf where it sees
    // no such key).
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const bool sees = r < rows && j < hi && !(a.causal && j > pos[r]) &&
                        !(a.window > 0 && j < pos[r] - a.window + 1) &&
                        !(a.window > 0 && !a.causal && j > pos[r] + a.window - 1) &&
                        !(a.chunk > 0 && j < pos[r] / a.chunk * a.chunk);
      float sc = s[r] * a.scale;
      if (a.softcap > 0.0f) sc = a.softcap * tanhf(sc / a.softcap);
      if (a.alibi_slopes != nullptr) sc += AlibiBias(slope[r], pos[r], j);
      if (bias_row[r] != nullptr) {
        sc += RelativeBias(bias_row[r], a.relative_bias_distance, pos[r], j);
      }
      s[r] = sees ? sc : -INFINITY;
    }
    // Per row: the tile's max, the new running max, the probabilities and
    // their sum; s[r] becomes lane's key's probability (0 if unseen).
    float correction[kRows];
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      float tile_m = s[r];
#pragma unroll
      for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
        tile_m = fmaxf(tile_m, __shfl_xor_sync(kFullMask, tile_m, offset));
      }
      const float m_new = fmaxf(m[r], tile_m);
      if (m_new == -INFINITY) {  // nothing seen yet: keep the zeros
        correction[r] = 1.0f;
        s[r] = 0.0f;
        continue;
      }
      correction[r] = expf(m[r] - m_new);  // 0 while m is -inf
      const float p = s[r] == -INFINITY ? 0.0f : expf(s[r] - m_new);
      float sum = p;
#pragma unroll
      for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
        sum += __shfl_xor_sync(kFullMask, sum, offset);
      }
      l[r] = l[r] * correction[r] + sum;
      m[r] = m_new;
      s[r] = p;
    }
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
#pragma unroll
      for (int u = 0; u < kLaneDims; ++u) acc[r][u] *= correction[r];
    }
    // P V over the tile's keys in order, kVGroup V rows loaded at a time.
    const int count = static_cast<int>(min(int64_t{kWarpSize}, hi - j0));
    for (int t0 = 0; t0 < count; t0 += kVGroup) {
      float vd[kVGroup][kLaneDims];
#pragma unroll
      for (int tt = 0; tt < kVGroup; ++tt) {
        const T* v = t0 + tt < count
                         ? PagedRow<T>(a.v_blocks, a.block_tokens, a.head_dim_v, g, j0 + t0 + tt)
                         : nullptr;
#pragma unroll
        for (int u = 0; u < kLaneDims; ++u) {
          const int64_t d = lane + u * kWarpSize;
          vd[tt][u] = v != nullptr && d < a.head_dim_v ? ToFloat(v[d]) : 0.0f;
        }
      }
#pragma unroll
      for (int tt = 0; tt < kVGroup; ++tt) {
        if (t0 + tt < count) {  // the same for the whole warp
#pragma unroll
          for (int r = 0; r < kRows; ++r) {
            const float p = __shfl_sync(kFullMask, s[r], t0 + tt);
#pragma unroll
            for (int u = 0; u < kLaneDims; ++u) acc[r][u] += p * vd[tt][u];
          }
        }
      }
    }
  }
  if (lane == 0) {
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      warp_m[warp][r] = m[r];
      warp_l[warp][r] = l[r];
    }
  }
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
#pragma unroll
    for (int u = 0; u < kLaneDims; ++u) {
      const int64_t d = lane + u * kWarpSize;
      if (d < a.head_dim_v) warp_acc[warp][r][d] = acc[r][u];
    }
  }
  __syncthreads();

  // Each row's warps combined in warp order.
  for (int r = 0; r < rows; ++r) {
    float chunk_m = -INFINITY;
    for (int w = 0; w < kDecodeWarps; ++w) chunk_m = fmaxf(chunk_m, warp_m[w][r]);
    float factor[kDecodeWarps];
    for (int w = 0; w < kDecodeWarps; ++w) {
      factor[w] = warp_m[w][r] == -INFINITY ? 0.0f : expf(warp_m[w][r] - chunk_m);
    }
    float* out =
        partial + ((head_of(r) * a.q_len + index_of(r)) * chunks + chunk) * PartialFloats(a);
    if (threadIdx.x == 0) {
      float chunk_l = 0.0f;
      for (int w = 0; w < kDecodeWarps; ++w) chunk_l += warp_l[w][r] * factor[w];
      out[0] = chunk_m;
      out[1] = chunk_l;
    }
    for (int64_t d = threadIdx.x; d < a.head_dim_v; d += kDecodeThreads) {
      float sum = 0.0f;
      for (int w = 0; w < kDecodeWarps; ++w) sum += warp_acc[w][r][d] * factor[w];
      out[2 + d] = sum;
    }
  }
}

// Row `row` (h * q_len + i) of request `e`: combines the row's chunks in
// chunk order, the sink (if any) joining the denominator, and writes the
// output row at a.out's strides in a.out_dtype.
__device__ __forceinline__ void CombineRow(const PagedDecodeEntry& e, int64_t row) {
  const AttentionParams& a = e.a;
  const int64_t chunks = e.chunks;
  const int64_t i = row % a.q_len;
  const int64_t h = row / a.q_len;
  const int64_t stride = PartialFloats(a);
  const float* base = e.partial + row * chunks * stride;
  const int64_t out_row = h * a.o_stride_h + i * a.o_stride_row;

  float row_m = -INFINITY;
  for (int64_t c = 0; c < chunks; ++c) row_m = fmaxf(row_m, base[c * stride]);
  if (row_m == -INFINITY) {  // sees no key: zeros (a sink alone has no value row)
    for (int64_t d = threadIdx.x; d < a.head_dim_v; d += blockDim.x) {
      StoreElement(a.out, a.out_dtype, out_row + d, 0.0f);
    }
    return;
  }
  const float sink = a.sinks != nullptr ? a.sinks[h] : -INFINITY;
  row_m = fmaxf(row_m, sink);
  float row_l = a.sinks != nullptr ? expf(sink - row_m) : 0.0f;
  for (int64_t c = 0; c < chunks; ++c) {
    const float m = base[c * stride];
    if (m != -INFINITY) row_l += base[c * stride + 1] * expf(m - row_m);
  }
  // row_l >= 1: the largest of the row's maxima (a key's or the sink) adds
  // exp(0).
  for (int64_t d = threadIdx.x; d < a.head_dim_v; d += blockDim.x) {
    float sum = 0.0f;
    for (int64_t c = 0; c < chunks; ++c) {
      const float m = base[c * stride];
      if (m != -INFINITY) sum += base[c * stride + 2 + d] * expf(m - row_m);
    }
    StoreElement(a.out, a.out_dtype, out_row + d, sum / row_l);
  }
}

// The entry of the request that grid element `x` belongs to (its first
// block or row at or before x, the last such: requests with none have the
// next one's offset), copied into shared memory. `entries` null: `single`.
// Every thread searches alike (the same loads), so no barrier is needed
// before the copy.
template <bool kRowsGrid>
__device__ __forceinline__ const PagedDecodeEntry& LoadEntry(const PagedDecodeEntry* entries,
                                                             int count,
                                                             const PagedDecodeEntry& single,
                                                             int64_t x, void* smem) {
  const PagedDecodeEntry* src = &single;
  if (entries != nullptr) {
    int lo = 0, hi = count - 1;
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      const int64_t start = kRowsGrid ? entries[mid].first_row : entries[mid].first_block;
      if (start <= x) {
        lo = mid;
      } else {
        hi = mid - 1;
      }
    }
    src = &entries[lo];
  }
  static_assert(sizeof(PagedDecodeEntry) % sizeof(uint32_t) == 0);
  constexpr int kWords = sizeof(PagedDecodeEntry) / sizeof(uint32_t);
  const auto* from = reinterpret_cast<const uint32_t*>(src);
  auto* to = static_cast<uint32_t*>(smem);
  for (int w = threadIdx.x; w < kWords; w += blockDim.x) to[w] = from[w];
  __syncthreads();
  return *static_cast<const PagedDecodeEntry*>(smem);
}

// The decode of a batch (entries, count) or of one request (`single`):
// one CUDA block per decode block of every request.
template <typename T, int kLaneDims, int kRows>
__global__ void __launch_bounds__(kDecodeThreads)
    PagedDecodeKernel(const PagedDecodeEntry* entries, int count, PagedDecodeEntry single) {
  __shared__ __align__(16) unsigned char entry[sizeof(PagedDecodeEntry)];
  const PagedDecodeEntry& e = LoadEntry<false>(entries, count, single, blockIdx.x, entry);
  DecodeBlock<T, kLaneDims, kRows>(e.a, e.tiles, e.chunks, e.chunk_keys, e.partial,
                                   static_cast<int64_t>(blockIdx.x) - e.first_block);
}

// One CUDA block per output row of every request.
__global__ void PagedCombineKernel(const PagedDecodeEntry* entries, int count,
                                   PagedDecodeEntry single) {
  __shared__ __align__(16) unsigned char entry[sizeof(PagedDecodeEntry)];
  const PagedDecodeEntry& e = LoadEntry<true>(entries, count, single, blockIdx.x, entry);
  CombineRow(e, static_cast<int64_t>(blockIdx.x) - e.first_row);
}

template <typename T, int kLaneDims, int kRows>
cudaError_t LaunchDecodeFor(const PagedDecodeBatchPlan& plan, const PagedDecodeEntry* entries,
                            const PagedDecodeEntry& single, cudaStream_t stream) {
  ATTNSERVE_LAUNCH((PagedDecodeKernel<T, kLaneDims, kRows>), static_cast<unsigned>(plan.blocks),
                   kDecodeThreads, 0, stream, entries, plan.count, single);
  if (const cudaError_t err = cudaGetLastError(); err != cudaSuccess) return err;
  ATTNSERVE_LAUNCH(PagedCombineKernel, static_cast<unsigned>(plan.rows), kCombineThreads, 0,
                   stream, entries, plan.count, single);
  return cudaGetLastError();
}

// The template for the plan's widest V rows and fullest tile.
template <typename T, int kLaneDims>
cudaError_t LaunchDecodeRows(const PagedDecodeBatchPlan& plan, const PagedDecodeEntry* entries,
                             const PagedDecodeEntry& single, cudaStream_t stream) {
  if (plan.max_tile_rows <= 1) {
    return LaunchDecodeFor<T, kLaneDims, 1>(plan, entries, single, stream);
  }
  if (plan.max_tile_rows <= 2) {
    return LaunchDecodeFor<T, kLaneDims, 2>(plan, entries, single, stream);
  }
  if (plan.max_tile_rows <= 4) {
    return LaunchDecodeFor<T, kLaneDims, 4>(plan, entries, single, stream);
  }
  return LaunchDecodeFor<T, kLaneDims, kTileRows>(plan, entries, single, stream);
}

template <typename T>
cudaError_t LaunchDecodeType(const PagedDecodeBatchPlan& plan, const PagedDecodeEntry* entries,
                             const PagedDecodeEntry& single, cudaStream_t stream) {
  if (plan.max_head_dim_v <= 4 * kWarpSize) {
    return LaunchDecodeRows<T, 4>(plan, entries, single, stream);
  }
  return LaunchDecodeRows<T, kPerLane>(plan, entries, single, stream);
}

// `entries` (device) null: the plan's one request is `single`.
cudaError_t LaunchPlanned(const PagedDecodeBatchPlan& plan, const PagedDecodeEntry* entries,
                          const PagedDecodeEntry& single, cudaStream_t stream) {
  if (plan.blocks <= 0 || plan.rows <= 0) return cudaSuccess;
  if (plan.blocks > INT32_MAX || plan.rows > INT32_MAX) return cudaErrorInvalidConfiguration;
  switch (plan.dtype) {
    case DType::kFloat16:
      return LaunchDecodeType<__half>(plan, entries, single, stream);
    case DType::kBFloat16:
      return LaunchDecodeType<__nv_bfloat16>(plan, entries, single, stream);
    default:
      return LaunchDecodeType<float>(plan, entries, single, stream);
  }
}

}  // namespace

cudaError_t LaunchPagedAppend(const AttentionParams& rows, const PagedCacheArgs& cache,
                              cudaStream_t stream) {
  const int64_t n = rows.num_kv_heads * rows.kv_len * (rows.head_dim + rows.head_dim_v);
  if (n <= 0) return cudaSuccess;
  ATTNSERVE_LAUNCH(PagedAppendKernel, CopyGrid(n), kCopyThreads, 0, stream, rows, cache);
  return cudaGetLastError();
}

cudaError_t LaunchPagedGather(const AttentionParams& a, const PagedGatherOut& out,
                              cudaStream_t stream) {
  if (out.rows < a.kv_len) return cudaErrorInvalidValue;
  const int64_t n = a.num_kv_heads * out.rows * (a.head_dim + a.head_dim_v);
  if (n <= 0) return cudaSuccess;
  ATTNSERVE_LAUNCH(PagedGatherKernel, CopyGrid(n), kCopyThreads, 0, stream, a, out);
  return cudaGetLastError();
}

bool PagedDecodeSupports(const AttentionParams& a) {
  return a.batch == 1 && a.k_blocks != nullptr && a.v_blocks != nullptr && a.block_tokens > 0 &&
         a.head_dim >= 1 && a.head_dim <= kPagedDecodeMaxHeadDim && a.head_dim_v >= 1 &&
         a.head_dim_v <= kPagedDecodeMaxHeadDim && a.key_lengths == nullptr &&
         a.mask.kind == MaskParams::Kind::kNone && a.weights == nullptr && a.dtype != DType::kBool;
}

size_t PagedDecodeScratchBytes(const AttentionParams& a) {
  return static_cast<size_t>(a.num_heads * a.q_len * SplitFor(a).chunks * PartialFloats(a)) *
         sizeof(float);
}

PagedDecodeBatchPlan PlanPagedDecodeBatch(const AttentionParams* requests, void* const* scratch,
                                          int count, PagedDecodeEntry* entries) {
  PagedDecodeBatchPlan plan;
  plan.count = count;
  if (count > 0) plan.dtype = requests[0].dtype;
  for (int i = 0; i < count; ++i) {
    const AttentionParams& a = requests[i];
    PagedDecodeEntry& e = entries[i];
    e = PagedDecodeEntry{};
    e.a = a;
    e.partial = static_cast<float*>(scratch[i]);
    e.first_block = plan.blocks;
    e.first_row = plan.rows;
    if (a.num_heads * a.q_len <= 0 || a.kv_len <= 0) continue;  // nothing to compute
    const Split split = SplitFor(a);
    e.tiles = RowTiles(a);
    e.chunks = split.chunks;
    e.chunk_keys = split.chunk_keys;
    plan.blocks += a.num_kv_heads * e.tiles * e.chunks;
    plan.rows += a.num_heads * a.q_len;
    plan.max_head_dim_v = std::max(plan.max_head_dim_v, a.head_dim_v);
    plan.max_tile_rows = std::max(
        plan.max_tile_rows, std::min<int64_t>(kTileRows, a.num_heads / a.num_kv_heads * a.q_len));
  }
  return plan;
}

cudaError_t LaunchPagedDecodeBatch(const PagedDecodeBatchPlan& plan,
                                   const PagedDecodeEntry* device_entries, cudaStream_t stream) {
  if (device_entries == nullptr && plan.count > 0) return cudaErrorInvalidValue;
  return LaunchPlanned(plan, device_entries, PagedDecodeEntry{}, stream);
}

cudaError_t LaunchPagedDecode(const AttentionParams& a, void* scratch, cudaStream_t stream) {
  PagedDecodeEntry single;
  const PagedDecodeBatchPlan plan = PlanPagedDecodeBatch(&a, &scratch, 1, &single);
  return LaunchPlanned(plan, nullptr, single, stream);
}

}  // namespace attnserve::cuda
