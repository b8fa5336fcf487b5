// The fused attention kernel for FLOAT16/BFLOAT16 with head dims 64 and 128:
// flash-attention's forward pass (online softmax over key tiles, nothing of
// size Lq x Lk ever written to memory) on mma.sync.m16n8k16 tensor-core
// instructions with fp32 accumulation, sm_80 and newer.
//
// Kept deliberately plain: one 64-row query tile per block, four warps of 16
// rows each, 64-key tiles loaded into shared memory with 16-byte loads, and
// fragments read from shared memory with ordinary 32-bit loads. No cp.async
// pipelining, no ldmatrix, no wgmma: those are the next steps for speed, once
// this version has been checked on a GPU.
//
// Fragment layouts are the ones the PTX ISA documents for
// mma.m16n8k16 with .f16/.bf16 inputs (g = lane / 4, t = lane % 4):
//   A (16x16, row major), 4 x b32: {a0,a1} = A[g][2t..2t+1],
//       {a2,a3} = A[g+8][2t..2t+1], {a4,a5} = A[g][2t+8..], {a6,a7} = A[g+8][2t+8..]
//   B (16x8, column major), 2 x b32: {b0,b1} = B[2t..2t+1][g], {b2,b3} = B[2t+8..2t+9][g]
//   C/D (16x8, fp32), 4 x f32: c0,c1 = C[g][2t..2t+1], c2,c3 = C[g+8][2t..2t+1]
// The accumulator of S = Q K^T over two adjacent 8-key tiles is therefore
// exactly the A fragment of P for P V, so P never leaves registers.
#include <cstdint>

#include "engine/cuda/attention_kernels.h"
#include "engine/cuda/device_utils.cuh"
#include "engine/cuda/static_switch.h"

namespace attnserve::cuda {
namespace {

constexpr int kBlockM = 64;  // query rows per block
constexpr int kBlockN = 64;  // keys per tile
constexpr int kWarps = 4;    // each owns 16 query rows
constexpr int kThreads = kWarps * 32;
constexpr unsigned kFullMask = 0xffffffffu;

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

// Two adjacent 16-bit elements as one 32-bit register (lower address = low half).
template <typename T>
__device__ __forceinline__ uint32_t Load2(const T* p) {
  return *reinterpret_cast<const uint32_t*>(p);
}

template <typename T>
__device__ __forceinline__ uint32_t Bits(const T* p) {
  return *reinterpret_cast<const uint16_t*>(p);
}

// Copies rows [row0, row0 + 64) of a [rows, D] view (row stride in elements)
// into shared memory with row pitch kLd; rows at or past `rows` become zeros,
// so that padding keys contribute 0 * 0 rather than 0 * garbage.
template <typename T, int D, int kLd>
__device__ __forceinline__ void LoadTile(T* dst, const T* src, int64_t stride_row, int64_t row0,
                                         int64_t rows) {
  constexpr int kChunks = D / 8;  // 16-byte chunks per row
  for (int c = static_cast<int>(threadIdx.x); c < kBlockM * kChunks; c += kThreads) {
    const int r = c / kChunks;
    const int col = (c % kChunks) * 8;
    uint4 value = make_uint4(0, 0, 0, 0);
    if (row0 + r < rows)
      value = *reinterpret_cast<const uint4*>(src + (row0 + r) * stride_row + col);
    *reinterpret_cast<uint4*>(dst + r * kLd + col) = value;
  }
}

template <typename T, int D>
constexpr int SharedBytes() {
  return 3 * kBlockM * (D + 8) * static_cast<int>(sizeof(T));
}

// Grid: one block per (b, h, 64-row query tile), flattened into blockIdx.x.
template <typename T, int D, bool kCausal>
__global__ void __launch_bounds__(kThreads)
    FlashAttentionKernel(AttentionParams a, int64_t q_tiles) {
  static_assert(kBlockM == kBlockN, "LoadTile copies kBlockM rows");
  constexpr int kLd = D + 8;  // row pitch: 16 bytes of padding shift each row by 4 banks
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* q_tile = reinterpret_cast<T*>(smem_raw);
  T* k_tile = q_tile + kBlockM * kLd;
  T* v_tile = k_tile + kBlockN * kLd;

  int64_t block = blockIdx.x;
  const int64_t tile = block % q_tiles;
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

  // Keys any row of the block may see.
  int64_t block_end = a.kv_len;
  if (a.key_lengths != nullptr) block_end = min(block_end, a.key_lengths[b]);
  if (kCausal) {
    const int64_t last_row = min(i0 + kBlockM, a.q_len) - 1;
    block_end = min(block_end, last_row + (a.kv_len - a.q_len) + 1);
  }

  LoadTile<T, D, kLd>(q_tile, q, a.q_stride_row, i0, a.q_len);

  float o[D / 8][4];
#pragma unroll
  for (int n = 0; n < D / 8; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
  float m[2] = {-INFINITY, -INFINITY};  // running row maxima (scaled, masked scores)
  float l[2] = {0.0f, 0.0f};            // this thread's part of the row sums

  for (int64_t j0 = 0; j0 < block_end; j0 += kBlockN) {
    __syncthreads();  // the previous tile's K/V are no longer read
    LoadTile<T, D, kLd>(k_tile, k, a.k_stride_row, j0, a.kv_len);
    LoadTile<T, D, kLd>(v_tile, v, a.v_stride_row, j0, a.kv_len);
    __syncthreads();  // Q (first time), K and V are in shared memory

    // S = Q K^T for this warp's 16 rows and the tile's 64 keys: 8 n-tiles.
    float s[kBlockN / 8][4];
#pragma unroll
    for (int n = 0; n < kBlockN / 8; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      const T* qa = q_tile + (warp * 16 + g) * kLd + kk * 16 + 2 * t;
      const uint32_t a_frag[4] = {Load2(qa), Load2(qa + 8 * kLd), Load2(qa + 8),
                                  Load2(qa + 8 * kLd + 8)};
#pragma unroll
      for (int n = 0; n < kBlockN / 8; ++n) {
        // B[kk*16 + x][n*8 + y] = K[n*8 + y][kk*16 + x]: a row of K is a column of B.
        const T* kb = k_tile + (n * 8 + g) * kLd + kk * 16 + 2 * t;
        Mma<T>::Run(s[n], a_frag, Load2(kb), Load2(kb + 8));
      }
    }

    // Scale and mask; the new row maxima (reduced over the 4 threads of a row).
    float tile_max[2] = {m[0], m[1]};
#pragma unroll
    for (int n = 0; n < kBlockN / 8; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = e >> 1;
        const int64_t j = j0 + n * 8 + 2 * t + (e & 1);
        float x = -INFINITY;
        if (j < row_end[r]) x = ApplyMask(a.mask, b, h, row[r], j, s[n][e] * a.scale);
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
      // exp(-inf - shift) is 0 rather than NaN.
      shift[r] = tile_max[r] == -INFINITY ? 0.0f : tile_max[r];
      alpha[r] = expf(m[r] - shift[r]);  // 0 when m was -inf
      m[r] = tile_max[r];
      l[r] *= alpha[r];
    }
#pragma unroll
    for (int n = 0; n < kBlockN / 8; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = e >> 1;
        const float p = expf(s[n][e] - shift[r]);
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
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk) {
      const uint32_t p_frag[4] = {Mma<T>::Pack(s[2 * kk][0], s[2 * kk][1]),
                                  Mma<T>::Pack(s[2 * kk][2], s[2 * kk][3]),
                                  Mma<T>::Pack(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                                  Mma<T>::Pack(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
      for (int n = 0; n < D / 8; ++n) {
        // B[x][y] = V[kk*16 + x][n*8 + y]: two keys' values for one dim per register.
        const T* vb = v_tile + (kk * 16 + 2 * t) * kLd + n * 8 + g;
        const uint32_t b0 = Bits(vb) | (Bits(vb + kLd) << 16);
        const uint32_t b1 = Bits(vb + 8 * kLd) | (Bits(vb + 9 * kLd) << 16);
        Mma<T>::Run(o[n], p_frag, b0, b1);
      }
    }
  }

  // Normalise and store. l == 0 only for rows that saw no key: zeros.
  float inv_l[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    l[r] += __shfl_xor_sync(kFullMask, l[r], 1);
    l[r] += __shfl_xor_sync(kFullMask, l[r], 2);
    inv_l[r] = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
  }
#pragma unroll
  for (int n = 0; n < D / 8; ++n) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int r = e >> 1;
      if (row[r] >= a.q_len) continue;
      const int64_t col = n * 8 + 2 * t + (e & 1);
      StoreElement(a.out, a.out_dtype,
                   b * a.o_stride_b + h * a.o_stride_h + row[r] * a.o_stride_row + col,
                   o[n][e] * inv_l[r]);
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
