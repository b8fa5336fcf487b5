// What the two flash-attention kernels (flash_attention.cu for FLOAT16 and
// BFLOAT16, flash_attention_fp32.cu for FLOAT32) share: copies global ->
// shared memory by cp.async, ldmatrix, and the online softmax of the two
// query rows one thread holds in an m16n8 accumulator tile. Both kernels
// compute S = Q K^T in 8-key tiles whose accumulator layout is the same
// (g = lane / 4, t = lane % 4):
//   c0, c1 = S[g][2t..2t+1], c2, c3 = S[g + 8][2t..2t+1]
// so everything between the two products (scale, masks, maxima, exp2, sums)
// and the final normalise-and-store is written once, here.
#ifndef ATTNSERVE_ENGINE_CUDA_FLASH_TILE_CUH_
#define ATTNSERVE_ENGINE_CUDA_FLASH_TILE_CUH_

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "engine/cuda/attention_kernels.h"
#include "engine/cuda/device_utils.cuh"

namespace attnserve::cuda::flash {

constexpr unsigned kFullMask = 0xffffffffu;
constexpr float kLog2e = 1.4426950408889634f;

// The instructions below run on a GPU; tests/unit/engine/cuda/warp_emulator.h
// defines them instead where a test runs a kernel on the CPU.
#if !defined(ATTNSERVE_CUDA_EMULATION)
__device__ __forceinline__ uint32_t SharedAddress(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// Four 8x8 matrices of 16-bit elements (8 rows of 16 bytes each) from shared
// memory: lanes 8m..8m+7 supply the row addresses of matrix m, and lane l
// receives in r[m] the 32-bit word (row l / 4, bytes 4 (l % 4)..) of matrix
// m (.trans: rows and columns of 16-bit elements exchanged). With 32-bit
// elements each matrix is 8 rows of 4 and r[m] is element (l / 4, l % 4).
__device__ __forceinline__ void LoadMatrices(uint32_t (&r)[4], const void* row_address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(SharedAddress(row_address)));
}
__device__ __forceinline__ void LoadMatricesTransposed(uint32_t (&r)[4], const void* row_address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(SharedAddress(row_address)));
}

// 16 bytes global -> shared without passing through registers; when !valid
// the 16 bytes become zeros and nothing is read.
__device__ __forceinline__ void CopyAsync16(void* dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(SharedAddress(dst)),
               "l"(src), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void CommitCopies() { asm volatile("cp.async.commit_group;\n" ::); }
__device__ __forceinline__ void WaitCopies() { asm volatile("cp.async.wait_group 0;\n" ::); }
#endif  // !ATTNSERVE_CUDA_EMULATION

// Starts copying rows [row0, row0 + kRows) of a [rows, D] view (row stride in
// elements) into shared memory with row pitch kLd elements, 16 bytes per
// cp.async, spread over kThreads threads; rows at or past `rows` become
// zeros, so that padding keys contribute 0 * 0 rather than 0 * garbage.
template <typename T, int D, int kRows, int kLd, int kThreads>
__device__ __forceinline__ void CopyTile(T* dst, const T* src, int64_t stride_row, int64_t row0,
                                         int64_t rows) {
  constexpr int kPerChunk = 16 / static_cast<int>(sizeof(T));
  constexpr int kChunks = D / kPerChunk;  // 16-byte chunks per row
  static_assert(kRows * kChunks % kThreads == 0, "whole rounds of chunks");
#pragma unroll
  for (int round = 0; round < kRows * kChunks / kThreads; ++round) {
    const int c = static_cast<int>(threadIdx.x) + round * kThreads;
    const int r = c / kChunks;
    const int col = (c % kChunks) * kPerChunk;
    const bool valid = row0 + r < rows;
    CopyAsync16(dst + r * kLd + col, valid ? src + (row0 + r) * stride_row + col : src, valid);
  }
}

// The (batch, head, query tile) a block computes. The grid is one block per
// (b, h, tile) flattened into blockIdx.x with the tile fastest (neighbouring
// blocks share K/V in L2); with last_first (causal grids) the last tiles,
// which see the most keys, start first.
template <typename T>
struct BlockTile {
  int64_t b, h, i0;  // i0: the tile's first query row
  const T* q;        // head h's rows
  const T* k;        // its kv head's rows
  const T* v;

  __device__ __forceinline__ BlockTile(const AttentionParams& a, int64_t q_tiles, int block_m,
                                       bool last_first) {
    int64_t block = blockIdx.x;
    const int64_t tile = last_first ? q_tiles - 1 - block % q_tiles : block % q_tiles;
    block /= q_tiles;
    h = block % a.num_heads;
    b = block / a.num_heads;
    i0 = tile * block_m;
    const int64_t kv_head = h / (a.num_heads / a.num_kv_heads);
    q = static_cast<const T*>(a.q) + b * a.q_stride_b + h * a.q_stride_h;
    k = static_cast<const T*>(a.k) + b * a.k_stride_b + kv_head * a.k_stride_h;
    v = static_cast<const T*>(a.v) + b * a.v_stride_b + kv_head * a.v_stride_h;
  }
};

// Two shared-memory stages of K and V tiles of kN keys (rows kLd elements
// apart): Load starts copying the tile of keys [row0, row0 + kN) into a
// stage (keys past kv_len become zeros).
template <typename T, int D, int kN, int kLd, int kThreads>
struct KvStages {
  T* k;  // [2][kN][kLd]
  T* v;

  __device__ __forceinline__ void Load(const BlockTile<T>& tile, const AttentionParams& a,
                                       int stage, int64_t row0) {
    CopyTile<T, D, kN, kLd, kThreads>(k + stage * kN * kLd, tile.k, a.k_stride_row, row0, a.kv_len);
    CopyTile<T, D, kN, kLd, kThreads>(v + stage * kN * kLd, tile.v, a.v_stride_row, row0, a.kv_len);
  }
  __device__ __forceinline__ const T* KTile(int64_t it) const { return k + (it & 1) * kN * kLd; }
  __device__ __forceinline__ const T* VTile(int64_t it) const { return v + (it & 1) * kN * kLd; }
};

// Host-side: whether every row of Q, K and V starts 16 bytes aligned (what
// cp.async of 16-byte chunks needs): the pointers, and each stride a
// multiple of the elements in 16 bytes.
inline bool RowsAligned16(const AttentionParams& a) {
  const int64_t per16 = 16 / static_cast<int64_t>(DTypeSize(a.dtype));
  for (const void* p : {a.q, a.k, a.v}) {
    if (reinterpret_cast<uintptr_t>(p) % 16 != 0) return false;
  }
  for (int64_t stride : {a.q_stride_b, a.q_stride_h, a.q_stride_row, a.k_stride_b, a.k_stride_h,
                         a.k_stride_row, a.v_stride_b, a.v_stride_h, a.v_stride_row}) {
    if (stride % per16 != 0) return false;
  }
  return true;
}

// Keys any row of a block of query rows [i0, i0 + rows) of batch b may see:
// [0, BlockKeyEnd). Causal cuts at the block's last row.
template <bool kCausal>
__device__ __forceinline__ int64_t BlockKeyEnd(const AttentionParams& a, int64_t b, int64_t i0,
                                               int64_t rows) {
  int64_t end = a.kv_len;
  if (a.key_lengths != nullptr) end = min(end, a.key_lengths[b]);
  if (kCausal) {
    const int64_t last_row = min(i0 + rows, a.q_len) - 1;
    end = min(end, last_row + (a.kv_len - a.q_len) + 1);
  }
  return end;
}

// The operands of the relative position embeddings' terms (RowPair::Softmax)
// in a kernel's shared memory: a thread's two query rows (g and g + 8 of its
// warp's 16), and the key tile being scored, its rows `ld` elements apart.
template <typename T>
struct SharedRows {
  const T* q[2];
  const T* k;
  int64_t ld;
};

// The two query rows (g and g + 8 of a warp's 16) whose accumulators a
// thread holds, and their online softmax: running maxima in the log2 domain
// and this thread's part of the running sums (the four threads of a row each
// sum the keys they hold; Normalizers adds the four). Every rule of
// attention_params.h: causal, key lengths and the sliding window through
// each row's visible keys [row_begin, row_end), masks, softcapping, sinks,
// ALiBi, the relative position bias, the relative position embeddings.
struct RowPair {
  int64_t row[2];
  int64_t row_begin[2];  // keys [row_begin, row_end) may be visible
  int64_t row_end[2];    // 0 past q_len
  int64_t both_begin;    // keys from here on are past both rows' window starts
  int64_t both_see;      // keys before this are before both rows' ends
  int64_t warp_begin;    // keys any row of the warp may see: [warp_begin, warp_end)
  int64_t warp_end;
  float m[2];
  float l[2];

  __device__ __forceinline__ void Start(const AttentionParams& a, int64_t b, int64_t h,
                                        int64_t warp_first, int g, int t) {
    row[0] = warp_first + g;
    row[1] = row[0] + 8;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      row_begin[r] = RowKeyBegin(a, row[r]);
      row_end[r] = row[r] < a.q_len ? RowKeyEnd(a, b, row[r]) : 0;
    }
    both_begin = max(row_begin[0], row_begin[1]);
    both_see = min(row_end[0], row_end[1]);
    // RowKeyBegin and RowKeyEnd grow with the row: the warp's first row
    // starts first, its last row sees the most.
    const int64_t warp_last = min(warp_first + 15, a.q_len - 1);
    warp_begin = RowKeyBegin(a, warp_first);
    warp_end = warp_first <= warp_last ? RowKeyEnd(a, b, warp_last) : 0;
    // A head's sink joins each row's softmax as one more key, of logit
    // sinks[h] and no value: the running max starts at it and one thread of
    // the row's four counts its exp2(0) = 1. A row that sees no key keeps
    // O = 0, so its output is zeros either way (attention_params.h).
    const bool sink = a.sinks != nullptr;
    m[0] = m[1] = sink ? a.sinks[h] * kLog2e : -INFINITY;
    l[0] = l[1] = sink && t == 0 ? 1.0f : 0.0f;
  }

  // s holds the raw scores Q K^T of kTiles 8-key tiles starting at key j0
  // (whose rows `tiles` holds). Adds the relative position embeddings'
  // terms to them, scales them (and softcaps) into the log2 domain, masking
  // where some key of the tiles is not visible to a row or a mask tensor
  // applies, and adding the position biases (ALiBi's, the relative bias
  // table's; these and the embeddings every key has, so they take the
  // masked path); updates the maxima and sums, and leaves in s the
  // unnormalised probabilities exp2(x - max). On return alpha[r] is the
  // factor by which row r's earlier accumulators must shrink (0 while the
  // row had seen nothing).
  template <int kTiles, typename T>
  __device__ __forceinline__ void Softmax(float (&s)[kTiles][4], const AttentionParams& a,
                                          int64_t b, int64_t h, int64_t j0, int t, bool has_mask,
                                          float scale_log2, const SharedRows<T>& tiles,
                                          float (&alpha)[2]) {
    const bool embedded = HasRelativeEmbeddings(a);
    const bool needs_mask = has_mask || a.alibi_slopes != nullptr || a.relative_bias != nullptr ||
                            embedded || j0 + kTiles * 8 > both_see || j0 < both_begin;
    const bool softcap = a.softcap > 0.0f;
    const int64_t offset = a.kv_len - a.q_len;  // row i's position: i + offset
    float tile_max[2] = {m[0], m[1]};
#pragma unroll
    for (int n = 0; n < kTiles; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = e >> 1;
        float x;
        if (needs_mask) {
          const int64_t j = j0 + n * 8 + 2 * t + (e & 1);
          x = -INFINITY;
          if (j >= row_begin[r] && j < row_end[r]) {
            float raw = s[n][e];
            if (embedded) {
              raw += RelativeEmbeddings(a, h, row[r] + offset, j, tiles.q[r],
                                        tiles.k + (j - j0) * tiles.ld);
            }
            x = ApplyMask(a.mask, b, h, row[r], j,
                          AddPositionBias(a, h, row[r] + offset, j, Softcap(a, raw * a.scale))) *
                kLog2e;
          }
        } else {
          x = softcap ? Softcap(a, s[n][e] * a.scale) * kLog2e : s[n][e] * scale_log2;
        }
        s[n][e] = x;
        tile_max[r] = fmaxf(tile_max[r], x);
      }
    }
    float shift[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(kFullMask, tile_max[r], 1));
      tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(kFullMask, tile_max[r], 2));
      // A row with nothing visible yet keeps max -inf; shift by 0 then so that
      // exp2(-inf - shift) is 0 rather than NaN.
      shift[r] = tile_max[r] == -INFINITY ? 0.0f : tile_max[r];
      alpha[r] = exp2f(m[r] - shift[r]);  // 0 when m was -inf
      m[r] = tile_max[r];
      l[r] *= alpha[r];
    }
#pragma unroll
    for (int n = 0; n < kTiles; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = e >> 1;
        const float p = exp2f(s[n][e] - shift[r]);
        s[n][e] = p;
        l[r] += p;
      }
    }
  }

  // 1 / (row sum) per row, 0 for a row that saw no key (its output is zeros).
  __device__ __forceinline__ void Normalizers(float (&inv_l)[2]) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      l[r] += __shfl_xor_sync(kFullMask, l[r], 1);
      l[r] += __shfl_xor_sync(kFullMask, l[r], 2);
      inv_l[r] = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
    }
  }
};

// The key tiles of kN keys a block computes: [first, end). Before `first`
// every key is outside the window of the block's first row (the earliest
// window); from `end` on, past what its last row may see.
struct TileRange {
  int64_t first;
  int64_t end;
};

// A block's start, for a thread of warp `warp` (16 query rows each) whose
// accumulator rows are g and g + 8 (t: its place among a row's four
// threads): its rows, and copies of the block's Q tile (kBlockM rows) and of
// its first K/V tile started as one group. Returns the block's key tiles.
template <typename T, int D, int kBlockM, int kN, int kLd, int kThreads, bool kCausal>
__device__ __forceinline__ TileRange StartBlock(const AttentionParams& a, const BlockTile<T>& bt,
                                                int warp, int g, int t, T* q_tile,
                                                KvStages<T, D, kN, kLd, kThreads>& stages,
                                                RowPair& rows) {
  rows.Start(a, bt.b, bt.h, bt.i0 + warp * 16, g, t);
  const int64_t block_end = BlockKeyEnd<kCausal>(a, bt.b, bt.i0, kBlockM);
  TileRange tiles;
  tiles.first = RowKeyBegin(a, bt.i0) / kN;
  tiles.end = block_end > 0 ? (block_end + kN - 1) / kN : 0;
  CopyTile<T, D, kBlockM, kLd, kThreads>(q_tile, bt.q, a.q_stride_row, bt.i0, a.q_len);
  if (tiles.first < tiles.end) {
    stages.Load(bt, a, static_cast<int>(tiles.first & 1), tiles.first * kN);
  }
  CommitCopies();
  return tiles;
}

// o[n] (n-tile n of the m16n8 accumulators: features n * 8 + 2t, + 1) times
// each row's alpha.
template <int kTiles>
__device__ __forceinline__ void Rescale(float (&o)[kTiles][4], const float (&alpha)[2]) {
#pragma unroll
  for (int n = 0; n < kTiles; ++n) {
    o[n][0] *= alpha[0];
    o[n][1] *= alpha[0];
    o[n][2] *= alpha[1];
    o[n][3] *= alpha[1];
  }
}

// Two adjacent elements of T, rounded to nearest even, as one store.
__device__ __forceinline__ void StorePair(float* p, float lo, float hi) {
  *reinterpret_cast<float2*>(p) = make_float2(lo, hi);
}
__device__ __forceinline__ void StorePair(__half* p, float lo, float hi) {
  *reinterpret_cast<__half2*>(p) = __floats2half2_rn(lo, hi);
}
__device__ __forceinline__ void StorePair(__nv_bfloat16* p, float lo, float hi) {
  *reinterpret_cast<__nv_bfloat162*>(p) = __floats2bfloat162_rn(lo, hi);
}

// Normalises the rows' accumulators o (D / 8 n-tiles over the output's
// features) and stores them into a.out for head h of batch b. Two adjacent
// outputs go as one store when the output is T and every pair is aligned;
// element by element (any out_dtype) otherwise. Rows past q_len are not
// stored.
template <typename T, int D>
__device__ __forceinline__ void StoreRows(const AttentionParams& a, const RowPair& rows,
                                          const float (&o)[D / 8][4], const float (&inv_l)[2],
                                          int64_t b, int64_t h, int t) {
  const bool paired = a.out_dtype == a.dtype &&
                      reinterpret_cast<uintptr_t>(a.out) % (2 * sizeof(T)) == 0 &&
                      a.o_stride_b % 2 == 0 && a.o_stride_h % 2 == 0 && a.o_stride_row % 2 == 0;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    if (rows.row[r] >= a.q_len) continue;
    const int64_t base = b * a.o_stride_b + h * a.o_stride_h + rows.row[r] * a.o_stride_row;
#pragma unroll
    for (int n = 0; n < D / 8; ++n) {
      const int64_t col = n * 8 + 2 * t;
      const float lo = o[n][2 * r] * inv_l[r];
      const float hi = o[n][2 * r + 1] * inv_l[r];
      if (paired) {
        StorePair(static_cast<T*>(a.out) + base + col, lo, hi);
      } else {
        StoreElement(a.out, a.out_dtype, base + col, lo);
        StoreElement(a.out, a.out_dtype, base + col + 1, hi);
      }
    }
  }
}

}  // namespace attnserve::cuda::flash

#endif  // ATTNSERVE_ENGINE_CUDA_FLASH_TILE_CUH_
