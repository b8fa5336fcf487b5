// The fused attention kernel for FLOAT16/BFLOAT16 with head dims 64 and 128:
// flash-attention's forward pass (online softmax over key tiles, nothing of
// size Lq x Lk ever written to memory) on mma.sync.m16n8k16 tensor-core
// instructions with fp32 accumulation, sm_80 and newer. Written here (no
// maintained library offers a fused kernel with this masking contract).
//
// One block per 128-row query tile, eight warps of 16 rows each. K and V
// arrive in 64-key tiles through cp.async into two shared-memory stages, so
// tile j+1 loads while tile j computes; fragments come from shared memory
// through ldmatrix (.trans for V); Q's fragments are read once and stay in
// registers; P never leaves registers (the accumulator of S = Q K^T over two
// adjacent 8-key tiles is exactly the A fragment of P for P V). Scores are
// kept in the log2 domain (exp2). Masks are evaluated only on tiles that
// need them (a mask tensor, or keys past some row's visible end); a warp
// skips tiles none of its rows can see (the causal diagonal), and causal
// grids start with the heaviest tiles.
//
// Fragment layouts are the ones the PTX ISA documents for
// mma.m16n8k16 with .f16/.bf16 inputs (g = lane / 4, t = lane % 4):
//   A (16x16, row major), 4 x b32: {a0,a1} = A[g][2t..2t+1],
//       {a2,a3} = A[g+8][2t..2t+1], {a4,a5} = A[g][2t+8..], {a6,a7} = A[g+8][2t+8..]
//   B (16x8, column major), 2 x b32: {b0,b1} = B[2t..2t+1][g], {b2,b3} = B[2t+8..2t+9][g]
//   C/D (16x8, fp32), 4 x f32: c0,c1 = C[g][2t..2t+1], c2,c3 = C[g+8][2t..2t+1]
// ldmatrix.x4 gives lane l the 32-bit word (row l/4, cols 2(l%4)..) of each
// of four 8x8 matrices whose row addresses lanes 8m..8m+7 supply (.trans:
// rows and columns exchanged), which is each of those fragments in turn.
#include <cstdint>

#include "engine/cuda/attention_kernels.h"
#include "engine/cuda/device_utils.cuh"
#include "engine/cuda/static_switch.h"

namespace attnserve::cuda {
namespace {

constexpr int kWarps = 8;               // each owns 16 query rows
constexpr int kBlockM = 16 * kWarps;    // query rows per block
constexpr int kBlockN = 64;             // keys per tile
constexpr int kThreads = kWarps * 32;
constexpr unsigned kFullMask = 0xffffffffu;
constexpr float kLog2e = 1.4426950408889634f;

template <typename T>
struct Mma;

template <>
struct Mma<__half> {
  __device__ static uint32_t Pack(float lo, float hi) {
    const __half2 h = __floats2half2_rn(lo, hi);  // .x (low 16 bits) = lo
    return *reinterpret_cast<const uint32_t*>(&h);
  }
  // d += a * b
  __device__ static void Run(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%10, %11, %12, %13};\n"
        : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "f"(d[0]), "f"(d[1]),
          "f"(d[2]), "f"(d[3]));
  }
};

template <>
struct Mma<__nv_bfloat16> {
  __device__ static uint32_t Pack(float lo, float hi) {
    const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);  // .x (low 16 bits) = lo
    return *reinterpret_cast<const uint32_t*>(&h);
  }
  __device__ static void Run(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%10, %11, %12, %13};\n"
        : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "f"(d[0]), "f"(d[1]),
          "f"(d[2]), "f"(d[3]));
  }
};

__device__ __forceinline__ uint32_t SharedAddress(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// Four 8x8 matrices of 16-bit elements from shared memory (see the top).
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

// Starts copying rows [row0, row0 + kRows) of a [rows, D] view (row stride in
// elements) into shared memory with row pitch D + 8; rows at or past `rows`
// become zeros, so that padding keys contribute 0 * 0 rather than 0 * garbage.
// The 16 bytes of padding per row shift consecutive rows by 4 banks: the
// eight row addresses of one ldmatrix hit distinct banks.
template <typename T, int D, int kRows>
__device__ __forceinline__ void CopyTile(T* dst, const T* src, int64_t stride_row, int64_t row0,
                                         int64_t rows) {
  constexpr int kChunks = D / 8;  // 16-byte chunks per row
  static_assert(kRows * kChunks % kThreads == 0, "whole rounds of chunks");
#pragma unroll
  for (int round = 0; round < kRows * kChunks / kThreads; ++round) {
    const int c = static_cast<int>(threadIdx.x) + round * kThreads;
    const int r = c / kChunks;
    const int col = (c % kChunks) * 8;
    const bool valid = row0 + r < rows;
    CopyAsync16(dst + r * (D + 8) + col, valid ? src + (row0 + r) * stride_row + col : src, valid);
  }
}

template <typename T, int D>
constexpr int SharedBytes() {
  // Q, then two stages of K, then two stages of V.
  return (kBlockM + 4 * kBlockN) * (D + 8) * static_cast<int>(sizeof(T));
}

// Grid: one block per (b, h, 128-row query tile), flattened into blockIdx.x
// with the tile fastest (neighbouring blocks share K/V in L2).
template <typename T, int D, bool kCausal>
__global__ void __launch_bounds__(kThreads, 1)
    FlashAttentionKernel(AttentionParams a, int64_t q_tiles) {
  constexpr int kLd = D + 8;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* q_tile = reinterpret_cast<T*>(smem_raw);
  T* k_stages = q_tile + kBlockM * kLd;
  T* v_stages = k_stages + 2 * kBlockN * kLd;

  int64_t block = blockIdx.x;
  // Causal: the last query tiles see the most keys; start them first.
  const int64_t tile = kCausal ? q_tiles - 1 - block % q_tiles : block % q_tiles;
  block /= q_tiles;
  const int64_t h = block % a.num_heads;
  const int64_t b = block / a.num_heads;
  const int64_t kv_head = h / (a.num_heads / a.num_kv_heads);
  const int64_t i0 = tile * kBlockM;

  const int warp = static_cast<int>(threadIdx.x) / 32;
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const int g = lane >> 2;
  const int t = lane & 3;

  const T* q = static_cast<const T*>(a.q) + b * a.q_stride_b + h * a.q_stride_h;
  const T* k = static_cast<const T*>(a.k) + b * a.k_stride_b + kv_head * a.k_stride_h;
  const T* v = static_cast<const T*>(a.v) + b * a.v_stride_b + kv_head * a.v_stride_h;

  // The two query rows this thread holds accumulators for, and the keys each
  // may see: [0, row_end). Rows past q_len see nothing and are not stored.
  int64_t row[2];
  int64_t row_end[2];
  row[0] = i0 + warp * 16 + g;
  row[1] = row[0] + 8;
  for (int r = 0; r < 2; ++r) row_end[r] = row[r] < a.q_len ? RowKeyEnd(a, b, row[r]) : 0;
  // Keys before this are visible to both rows: no per-element test needed.
  const int64_t both_see = min(row_end[0], row_end[1]);
  const bool has_mask = a.mask.kind != MaskParams::Kind::kNone;
  // Keys any row of this warp may see (RowKeyEnd grows with the row).
  const int64_t warp_first = i0 + warp * 16;
  const int64_t warp_last = min(warp_first + 15, a.q_len - 1);
  const int64_t warp_end = warp_first <= warp_last ? RowKeyEnd(a, b, warp_last) : 0;

  // Keys any row of the block may see.
  int64_t block_end = a.kv_len;
  if (a.key_lengths != nullptr) block_end = min(block_end, a.key_lengths[b]);
  if (kCausal) {
    const int64_t last_row = min(i0 + kBlockM, a.q_len) - 1;
    block_end = min(block_end, last_row + (a.kv_len - a.q_len) + 1);
  }
  const int64_t n_tiles = block_end > 0 ? (block_end + kBlockN - 1) / kBlockN : 0;

  CopyTile<T, D, kBlockM>(q_tile, q, a.q_stride_row, i0, a.q_len);
  if (n_tiles > 0) {
    CopyTile<T, D, kBlockN>(k_stages, k, a.k_stride_row, 0, a.kv_len);
    CopyTile<T, D, kBlockN>(v_stages, v, a.v_stride_row, 0, a.kv_len);
  }
  CommitCopies();

  uint32_t q_frag[D / 16][4];
  float o[D / 8][4];
#pragma unroll
  for (int n = 0; n < D / 8; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
  float m[2] = {-INFINITY, -INFINITY};  // running row maxima (log2 domain)
  float l[2] = {0.0f, 0.0f};            // this thread's part of the row sums
  const float scale_log2 = a.scale * kLog2e;

  for (int64_t it = 0; it < n_tiles; ++it) {
    // Tile `it` has landed for every thread, and every warp is done with the
    // stage the next copy overwrites (the one tile it - 1 used).
    WaitCopies();
    __syncthreads();
    if (it == 0) {
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
        LoadMatrices(q_frag[kk],
                     q_tile + (warp * 16 + (lane & 15)) * kLd + kk * 16 + (lane >> 4) * 8);
      }
    }
    if (it + 1 < n_tiles) {
      const int next = static_cast<int>((it + 1) & 1);
      CopyTile<T, D, kBlockN>(k_stages + next * kBlockN * kLd, k, a.k_stride_row,
                              (it + 1) * kBlockN, a.kv_len);
      CopyTile<T, D, kBlockN>(v_stages + next * kBlockN * kLd, v, a.v_stride_row,
                              (it + 1) * kBlockN, a.kv_len);
    }
    CommitCopies();
    const int64_t j0 = it * kBlockN;
    if (j0 >= warp_end) continue;  // no row of this warp sees these keys (nor later ones)
    const T* k_tile = k_stages + (it & 1) * kBlockN * kLd;
    const T* v_tile = v_stages + (it & 1) * kBlockN * kLd;

    // S = Q K^T for this warp's 16 rows and the tile's 64 keys: 8 n-tiles.
    // B[kk*16 + x][n*8 + y] = K[n*8 + y][kk*16 + x]: rows of K are columns of
    // B, so plain ldmatrix of K's rows gives B's fragments, two n-tiles at once.
    float s[kBlockN / 8][4];
#pragma unroll
    for (int n = 0; n < kBlockN / 8; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
#pragma unroll
      for (int n = 0; n < kBlockN / 8; n += 2) {
        uint32_t kb[4];
        LoadMatrices(kb, k_tile + (n * 8 + (lane >> 4) * 8 + (lane & 7)) * kLd + kk * 16 +
                             ((lane >> 3) & 1) * 8);
        Mma<T>::Run(s[n], q_frag[kk], kb[0], kb[1]);
        Mma<T>::Run(s[n + 1], q_frag[kk], kb[2], kb[3]);
      }
    }

    // Scale (and mask where needed) into the log2 domain; the new row maxima
    // (reduced over the 4 threads of a row).
    const bool needs_mask = has_mask || j0 + kBlockN > both_see;
    float tile_max[2] = {m[0], m[1]};
#pragma unroll
    for (int n = 0; n < kBlockN / 8; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = e >> 1;
        float x = s[n][e] * scale_log2;
        if (needs_mask) {
          const int64_t j = j0 + n * 8 + 2 * t + (e & 1);
          x = j < row_end[r] ? ApplyMask(a.mask, b, h, row[r], j, s[n][e] * a.scale) * kLog2e
                             : -INFINITY;
        }
        s[n][e] = x;
        tile_max[r] = fmaxf(tile_max[r], x);
      }
    }
    float alpha[2];
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
    for (int n = 0; n < kBlockN / 8; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = e >> 1;
        const float p = exp2f(s[n][e] - shift[r]);
        s[n][e] = p;
        l[r] += p;
      }
    }
#pragma unroll
    for (int n = 0; n < D / 8; ++n) {
      o[n][0] *= alpha[0];
      o[n][1] *= alpha[0];
      o[n][2] *= alpha[1];
      o[n][3] *= alpha[1];
    }

    // O += P V, 16 keys per step; P's A fragment comes from S tiles 2kk, 2kk+1.
    // B[x][y] = V[kk*16 + x][n*8 + y]: ldmatrix.trans of V's rows.
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk) {
      const uint32_t p_frag[4] = {Mma<T>::Pack(s[2 * kk][0], s[2 * kk][1]),
                                  Mma<T>::Pack(s[2 * kk][2], s[2 * kk][3]),
                                  Mma<T>::Pack(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                                  Mma<T>::Pack(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
      for (int n = 0; n < D / 8; n += 2) {
        uint32_t vb[4];
        LoadMatricesTransposed(vb, v_tile + (kk * 16 + ((lane >> 3) & 1) * 8 + (lane & 7)) * kLd +
                                       n * 8 + (lane >> 4) * 8);
        Mma<T>::Run(o[n], p_frag, vb[0], vb[1]);
        Mma<T>::Run(o[n + 1], p_frag, vb[2], vb[3]);
      }
    }
  }
  WaitCopies();  // with no key tile, Q's copy is still in flight

  // Normalise and store. l == 0 only for rows that saw no key: zeros.
  float inv_l[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    l[r] += __shfl_xor_sync(kFullMask, l[r], 1);
    l[r] += __shfl_xor_sync(kFullMask, l[r], 2);
    inv_l[r] = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
  }
  // Two adjacent outputs as one 32-bit store when the output is T and every
  // pair is 4-byte aligned; element by element otherwise.
  const bool paired = a.out_dtype == a.dtype && reinterpret_cast<uintptr_t>(a.out) % 4 == 0 &&
                      a.o_stride_b % 2 == 0 && a.o_stride_h % 2 == 0 && a.o_stride_row % 2 == 0;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    if (row[r] >= a.q_len) continue;
    const int64_t base = b * a.o_stride_b + h * a.o_stride_h + row[r] * a.o_stride_row;
#pragma unroll
    for (int n = 0; n < D / 8; ++n) {
      const int64_t col = n * 8 + 2 * t;
      const float lo = o[n][2 * r] * inv_l[r];
      const float hi = o[n][2 * r + 1] * inv_l[r];
      if (paired) {
        *reinterpret_cast<uint32_t*>(static_cast<T*>(a.out) + base + col) = Mma<T>::Pack(lo, hi);
      } else {
        StoreElement(a.out, a.out_dtype, base + col, lo);
        StoreElement(a.out, a.out_dtype, base + col + 1, hi);
      }
    }
  }
}

template <typename T, int D, bool kCausal>
cudaError_t Launch(const AttentionParams& a, cudaStream_t stream) {
  constexpr int kShared = SharedBytes<T, D>();
  if (kShared > 48 * 1024) {
    const cudaError_t err = cudaFuncSetAttribute(
        FlashAttentionKernel<T, D, kCausal>, cudaFuncAttributeMaxDynamicSharedMemorySize, kShared);
    if (err != cudaSuccess) return err;
  }
  const int64_t q_tiles = (a.q_len + kBlockM - 1) / kBlockM;
  const int64_t blocks = q_tiles * a.num_heads * a.batch;
  if (blocks > INT32_MAX) return cudaErrorInvalidConfiguration;
  FlashAttentionKernel<T, D, kCausal>
      <<<static_cast<unsigned>(blocks), kThreads, kShared, stream>>>(a, q_tiles);
  return cudaGetLastError();
}

bool Aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

}  // namespace

bool FlashAttentionSupports(const AttentionParams& a) {
  if (a.dtype != DType::kFloat16 && a.dtype != DType::kBFloat16) return false;
  if (a.head_dim != a.head_dim_v || (a.head_dim != 64 && a.head_dim != 128)) return false;
  if (a.weights != nullptr) return false;
  if (a.window > 0 || a.softcap > 0.0f || a.sinks != nullptr) return false;
  if (!Aligned16(a.q) || !Aligned16(a.k) || !Aligned16(a.v)) return false;
  for (int64_t stride : {a.q_stride_b, a.q_stride_h, a.q_stride_row, a.k_stride_b, a.k_stride_h,
                         a.k_stride_row, a.v_stride_b, a.v_stride_h, a.v_stride_row}) {
    if (stride % 8 != 0) return false;
  }
  return true;
}

// The variants: {fp16, bf16} x {64, 128} x {causal, not}.
cudaError_t LaunchFlashAttention(const AttentionParams& args, cudaStream_t stream) {
  if (!FlashAttentionSupports(args)) return cudaErrorInvalidValue;
  return ATTNSERVE_HEAD_DIM_SWITCH(args.head_dim, kHeadDim, [&] {
    return ATTNSERVE_BOOL_SWITCH(args.causal, kCausal, [&] {
      if (args.dtype == DType::kFloat16) return Launch<__half, kHeadDim, kCausal>(args, stream);
      return Launch<__nv_bfloat16, kHeadDim, kCausal>(args, stream);
    });
  });
}

}  // namespace attnserve::cuda
