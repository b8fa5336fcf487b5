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
// need them (a mask tensor, or keys outside some row's visible range); a
// block starts at the first tile of its first row's sliding window, a warp
// skips tiles none of its rows can see (the causal diagonal, the window),
// and causal grids start with the heaviest tiles. Softcapping, sinks, ALiBi,
// the relative position bias and the relative position embeddings (their
// terms from the Q and K tiles in shared memory, in fp32 on the CUDA cores)
// as flash_tile.cuh applies them.
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
#include <cstring>

#include "engine/cuda/attention_kernels.h"
#include "engine/cuda/device_utils.cuh"
#include "engine/cuda/flash_tile.cuh"
#include "engine/cuda/static_switch.h"

namespace attnserve::cuda {
namespace {

constexpr int kWarps = 8;               // each owns 16 query rows
constexpr int kBlockM = 16 * kWarps;    // query rows per block
constexpr int kBlockN = 64;             // keys per tile
constexpr int kThreads = kWarps * 32;
using flash::kLog2e;

template <typename T>
struct Mma;

template <>
struct Mma<__half> {
  __device__ static uint32_t Pack(float lo, float hi) {
    const __half2 h = __floats2half2_rn(lo, hi);  // .x (low 16 bits) = lo
    uint32_t bits;
    memcpy(&bits, &h, sizeof(bits));
    return bits;
  }
  // d += a * b
  __device__ static void Run(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
#if defined(ATTNSERVE_CUDA_EMULATION)  // tests/unit/engine/cuda/warp_emulator.h
    emu::MmaM16N8K16(d, a, b0, b1, emu::HalfBits);
#else
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%10, %11, %12, %13};\n"
        : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "f"(d[0]), "f"(d[1]),
          "f"(d[2]), "f"(d[3]));
#endif
  }
};

template <>
struct Mma<__nv_bfloat16> {
  __device__ static uint32_t Pack(float lo, float hi) {
    const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);  // .x (low 16 bits) = lo
    uint32_t bits;
    memcpy(&bits, &h, sizeof(bits));
    return bits;
  }
  __device__ static void Run(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
#if defined(ATTNSERVE_CUDA_EMULATION)
    emu::MmaM16N8K16(d, a, b0, b1, emu::Bfloat16Bits);
#else
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%10, %11, %12, %13};\n"
        : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "f"(d[0]), "f"(d[1]),
          "f"(d[2]), "f"(d[3]));
#endif
  }
};

// Shared-memory rows are D + 8 elements apart: the 16 bytes of padding per
// row shift consecutive rows by 4 banks, so the eight row addresses of one
// ldmatrix hit distinct banks.
template <int D>
constexpr int kPitch = D + 8;

template <typename T, int D>
constexpr int SharedBytes() {
  // Q, then two stages of K, then two stages of V.
  return (kBlockM + 4 * kBlockN) * kPitch<D> * static_cast<int>(sizeof(T));
}

// Grid: one block per (b, h, 128-row query tile) (flash::BlockTile).
template <typename T, int D, bool kCausal>
__global__ void __launch_bounds__(kThreads, 1)
    FlashAttentionKernel(AttentionParams a, int64_t q_tiles) {
  constexpr int kLd = kPitch<D>;
  ATTNSERVE_DYNAMIC_SHARED(smem_raw);
  T* q_tile = reinterpret_cast<T*>(smem_raw);
  flash::KvStages<T, D, kBlockN, kLd, kThreads> stages;
  stages.k = q_tile + kBlockM * kLd;
  stages.v = stages.k + 2 * kBlockN * kLd;

  const flash::BlockTile<T> bt(a, q_tiles, kBlockM, /*last_first=*/kCausal);
  const int64_t b = bt.b, h = bt.h;
  const int warp = static_cast<int>(threadIdx.x) / 32;
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const int g = lane >> 2;
  const int t = lane & 3;
  flash::RowPair rows;
  const flash::TileRange tiles = flash::StartBlock<T, D, kBlockM, kBlockN, kLd, kThreads, kCausal>(
      a, bt, warp, g, t, q_tile, stages, rows);
  const bool has_mask = a.mask.kind != MaskParams::Kind::kNone;

  uint32_t q_frag[D / 16][4];
  float o[D / 8][4];
#pragma unroll
  for (int n = 0; n < D / 8; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
  const float scale_log2 = a.scale * kLog2e;
  // The relative position embeddings' operands: this thread's query rows
  // and a key tile, in shared memory.
  const auto embedding_rows = [&](const T* k_tile) {
    return flash::SharedRows<T>{
        {q_tile + (warp * 16 + g) * kLd, q_tile + (warp * 16 + g + 8) * kLd}, k_tile, kLd};
  };

  for (int64_t it = tiles.first; it < tiles.end; ++it) {
    // Tile `it` has landed for every thread, and every warp is done with the
    // stage the next copy overwrites (the one tile it - 1 used).
    flash::WaitCopies();
    __syncthreads();
    if (it == tiles.first) {
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
        flash::LoadMatrices(q_frag[kk],
                            q_tile + (warp * 16 + (lane & 15)) * kLd + kk * 16 + (lane >> 4) * 8);
      }
    }
    if (it + 1 < tiles.end) stages.Load(bt, a, static_cast<int>((it + 1) & 1), (it + 1) * kBlockN);
    flash::CommitCopies();
    const int64_t j0 = it * kBlockN;
    // No row of this warp sees these keys (after warp_end: nor later ones).
    if (j0 >= rows.warp_end || j0 + kBlockN <= rows.warp_begin) continue;
    const T* k_tile = stages.KTile(it);
    const T* v_tile = stages.VTile(it);

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
        flash::LoadMatrices(kb, k_tile + (n * 8 + (lane >> 4) * 8 + (lane & 7)) * kLd +
                                    kk * 16 + ((lane >> 3) & 1) * 8);
        Mma<T>::Run(s[n], q_frag[kk], kb[0], kb[1]);
        Mma<T>::Run(s[n + 1], q_frag[kk], kb[2], kb[3]);
      }
    }

    // Scale (and mask where needed) into the log2 domain, the new row maxima,
    // P = exp2(S - max) in place; O shrinks by alpha.
    float alpha[2];
    rows.Softmax(s, a, b, h, j0, t, has_mask, scale_log2, embedding_rows(k_tile), alpha);
    flash::Rescale(o, alpha);

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
        flash::LoadMatricesTransposed(
            vb, v_tile + (kk * 16 + ((lane >> 3) & 1) * 8 + (lane & 7)) * kLd + n * 8 +
                    (lane >> 4) * 8);
        Mma<T>::Run(o[n], p_frag, vb[0], vb[1]);
        Mma<T>::Run(o[n + 1], p_frag, vb[2], vb[3]);
      }
    }
  }
  flash::WaitCopies();  // with no key tile, Q's copy is still in flight

  // Normalise and store. l == 0 only for rows that saw no key: zeros.
  float inv_l[2];
  rows.Normalizers(inv_l);
  flash::StoreRows<T, D>(a, rows, o, inv_l, b, h, t);
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
  ATTNSERVE_LAUNCH((FlashAttentionKernel<T, D, kCausal>), static_cast<unsigned>(blocks), kThreads,
                   kShared, stream, a, q_tiles);
  return cudaGetLastError();
}

}  // namespace

bool FlashAttentionSupports(const AttentionParams& a) {
  if (a.dtype != DType::kFloat16 && a.dtype != DType::kBFloat16) return false;
  if (a.head_dim != a.head_dim_v || (a.head_dim != 64 && a.head_dim != 128)) return false;
  if (a.weights != nullptr || a.k_blocks != nullptr) return false;
  return flash::RowsAligned16(a);
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
