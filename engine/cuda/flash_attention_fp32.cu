// The fused attention kernel for FLOAT32 inputs with head dims 64 and 128:
// flash_attention.cu's design (online softmax over key tiles, scores never
// written to memory, tiles the causal diagonal hides skipped) with both
// products exact to fp32 by 3xTF32 on tensor cores, mma.sync.m16n8k8 with
// .tf32 inputs and fp32 accumulation, sm_80 and newer. Written here: no
// maintained library offers a fused fp32 attention with this masking
// contract (cuDNN's SDPA is fp16/bf16; PyTorch's efficient backend is SIMT
// fp32 inside PyTorch).
//
// 3xTF32: each fp32 operand x is split into hi, x with its low 13 mantissa
// bits cleared (a TF32 value: 10 explicit mantissa bits), and the rest
// lo = x - hi, exact in fp32 and below 2^-10 |x|; then a b = a_hi b_hi +
// a_hi b_lo + a_lo b_hi + a_lo b_lo with the last term (below 2^-20 |a b|)
// dropped, and the tensor cores reading lo's leading 11 bits (below 2^-20
// |a b| again for each of the two middle terms): each product within
// 3 x 2^-20 (3e-6) of exact at worst, and a sum's errors mostly cancel (the
// tests hold results to 1e-5 of float64). Truncating rather than rounding
// hi costs two instructions per element instead of seven (sm_90 has no
// instruction for cvt.rna.satfinite.tf32: it is emulated) and never
// overflows (|hi| <= |x|: every finite input stays finite).
//
// One block per 128-row query tile, eight warps of 16 rows each; K and V in
// key tiles (64 keys at head dim 64, 32 at 128: the shared memory of Q and two
// stages of each stays under an A100's 163 KiB) through cp.async into two
// stages, so tile j+1 loads while tile j computes. Rows are D + 4 floats apart
// in shared memory (consecutive rows 4 banks apart).
//
// Fragment layouts of mma.m16n8k8 with .tf32 inputs (PTX ISA; g = lane / 4,
// t = lane % 4):
//   A (16x8, row major): a0 = A[g][t], a1 = A[g+8][t], a2 = A[g][t+4], a3 = A[g+8][t+4]
//   B (8x8, column major): b0 = B[t][g], b1 = B[t+4][g]
//   C/D (16x8, fp32): c0, c1 = C[g][2t..2t+1], c2, c3 = C[g+8][2t..2t+1]
// ldmatrix on 32-bit elements gives lane l element (l / 4, l % 4) of each of
// four 8x4 blocks: Q's A fragment from rows of Q (blocks: rows 0-7 and 8-15,
// columns 0-3 and 4-7), K's B fragments from rows of K (B[k][n] = K[n][k]).
// P V: the accumulator of S holds keys 2t and 2t+1 of each 8-key tile where
// P's A fragment wants keys t and t+4. A sum over keys does not depend on how
// they are numbered, so P V numbers key 2t as t and 2t+1 as t+4: P's fragment
// is {c0, c2, c1, c3} of the scores' (no shuffle), and V's B fragment is rows
// 2t and 2t+1 of the tile at column g (scalar shared loads, every lane a
// distinct bank with the D + 4 pitch).
#include <cstdint>

#include "engine/cuda/attention_kernels.h"
#include "engine/cuda/device_utils.cuh"
#include "engine/cuda/flash_tile.cuh"
#include "engine/cuda/static_switch.h"

namespace attnserve::cuda {
namespace {

constexpr int kWarps = 8;             // each owns 16 query rows
constexpr int kBlockM = 16 * kWarps;  // query rows per block
constexpr int kThreads = kWarps * 32;

template <int D>
constexpr int kBlockN = D == 64 ? 64 : 32;  // keys per tile
template <int D>
constexpr int kPitch = D + 4;  // floats between rows in shared memory

template <int D>
constexpr int SharedBytes() {
  // Q, then two stages of K, then two stages of V.
  return (kBlockM + 4 * kBlockN<D>) * kPitch<D> * static_cast<int>(sizeof(float));
}

// x = hi + lo exactly: hi is x truncated to TF32, lo the rest (top).
__device__ __forceinline__ void Split(uint32_t x, uint32_t& hi, uint32_t& lo) {
  hi = x & 0xffffe000u;
  lo = __float_as_uint(__uint_as_float(x) - __uint_as_float(hi));
}

#if !defined(ATTNSERVE_CUDA_EMULATION)  // else tests/unit/engine/cuda/warp_emulator.h's
// d += a * b on TF32 tensor cores.
__device__ __forceinline__ void MmaTf32(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                        uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 "
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%10, %11, %12, %13};\n"
      : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "f"(d[0]), "f"(d[1]),
        "f"(d[2]), "f"(d[3]));
}
#endif

// A fragment split into its high and low parts.
struct SplitA {
  uint32_t hi[4];
  uint32_t lo[4];
  SplitA() = default;
  __device__ __forceinline__ explicit SplitA(const uint32_t (&x)[4]) {
#pragma unroll
    for (int i = 0; i < 4; ++i) Split(x[i], hi[i], lo[i]);
  }
};

// d += a * b to fp32 accuracy (3xTF32; the small products first).
__device__ __forceinline__ void Mma3xTf32(float (&d)[4], const SplitA& a, uint32_t b0,
                                          uint32_t b1) {
  uint32_t b0_hi, b0_lo, b1_hi, b1_lo;
  Split(b0, b0_hi, b0_lo);
  Split(b1, b1_hi, b1_lo);
  MmaTf32(d, a.lo, b0_hi, b1_hi);
  MmaTf32(d, a.hi, b0_lo, b1_lo);
  MmaTf32(d, a.hi, b0_hi, b1_hi);
}

// Grid: one block per (b, h, 128-row query tile) (flash::BlockTile).
template <int D, bool kCausal>
__global__ void __launch_bounds__(kThreads, 1)
    FlashAttentionFp32Kernel(AttentionParams a, int64_t q_tiles) {
  constexpr int kN = kBlockN<D>;
  constexpr int kLd = kPitch<D>;
  ATTNSERVE_DYNAMIC_SHARED(smem_raw);
  float* q_tile = reinterpret_cast<float*>(smem_raw);
  flash::KvStages<float, D, kN, kLd, kThreads> stages;
  stages.k = q_tile + kBlockM * kLd;
  stages.v = stages.k + 2 * kN * kLd;

  const flash::BlockTile<float> bt(a, q_tiles, kBlockM, /*last_first=*/kCausal);
  const int64_t b = bt.b, h = bt.h;
  const int warp = static_cast<int>(threadIdx.x) / 32;
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const int g = lane >> 2;
  const int t = lane & 3;
  flash::RowPair rows;
  const flash::TileRange tiles = flash::StartBlock<float, D, kBlockM, kN, kLd, kThreads, kCausal>(
      a, bt, warp, g, t, q_tile, stages, rows);
  const bool has_mask = a.mask.kind != MaskParams::Kind::kNone;

  float o[D / 8][4];
#pragma unroll
  for (int n = 0; n < D / 8; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
  const float scale_log2 = a.scale * flash::kLog2e;
  // This warp's Q rows; lane l addresses row l % 16 of an ldmatrix.
  const float* q_rows = q_tile + (warp * 16 + (lane & 15)) * kLd + (lane >> 4) * 4;
  // The relative position embeddings' operands: this thread's query rows
  // and a key tile, in shared memory.
  const auto embedding_rows = [&](const float* k_tile) {
    return flash::SharedRows<float>{
        {q_tile + (warp * 16 + g) * kLd, q_tile + (warp * 16 + g + 8) * kLd}, k_tile, kLd};
  };

  for (int64_t it = tiles.first; it < tiles.end; ++it) {
    // Tile `it` has landed for every thread, and every warp is done with the
    // stage the next copy overwrites (the one tile it - 1 used).
    flash::WaitCopies();
    __syncthreads();
    if (it + 1 < tiles.end) stages.Load(bt, a, static_cast<int>((it + 1) & 1), (it + 1) * kN);
    flash::CommitCopies();
    const int64_t j0 = it * kN;
    // No row of this warp sees these keys (after warp_end: nor later ones).
    if (j0 >= rows.warp_end || j0 + kN <= rows.warp_begin) continue;
    const float* k_tile = stages.KTile(it);
    const float* v_tile = stages.VTile(it);

    // S = Q K^T for this warp's 16 rows and the tile's keys, 8 dims per step.
    // ldmatrix of K's rows n*8.. gives B's fragments of n-tiles n and n+1:
    // blocks (keys n*8.., dims 0-3), (.., dims 4-7), (keys n*8+8.., 0-3), (.., 4-7).
    // In chains of kChain steps (8 dims each), each chain's sum added to S
    // in fp32: the tensor cores cut each mma's sum toward zero (below), so
    // a score loses what one short chain loses, whatever the head dim.
    constexpr int kChain = 2;
    float s[kN / 8][4];
#pragma unroll
    for (int n = 0; n < kN / 8; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
#pragma unroll
    for (int k0 = 0; k0 < D / 8; k0 += kChain) {
      float chain[kN / 8][4];
#pragma unroll
      for (int n = 0; n < kN / 8; ++n) chain[n][0] = chain[n][1] = chain[n][2] = chain[n][3] = 0.0f;
#pragma unroll
      for (int kk = k0; kk < k0 + kChain; ++kk) {
        uint32_t q_frag[4];
        flash::LoadMatrices(q_frag, q_rows + kk * 8);
        const SplitA qa(q_frag);
#pragma unroll
        for (int n = 0; n < kN / 8; n += 2) {
          uint32_t kb[4];
          flash::LoadMatrices(kb, k_tile + (n * 8 + (lane >> 4) * 8 + (lane & 7)) * kLd +
                                      kk * 8 + ((lane >> 3) & 1) * 4);
          Mma3xTf32(chain[n], qa, kb[0], kb[1]);
          Mma3xTf32(chain[n + 1], qa, kb[2], kb[3]);
        }
      }
#pragma unroll
      for (int n = 0; n < kN / 8; ++n) {
#pragma unroll
        for (int i = 0; i < 4; ++i) s[n][i] += chain[n][i];
      }
    }

    // Scale (and mask where needed) into the log2 domain, the new row maxima,
    // P = exp2(S - max) in place; alpha: how much O shrinks.
    float alpha[2];
    rows.Softmax(s, a, b, h, j0, t, has_mask, scale_log2, embedding_rows(k_tile), alpha);

    // This tile's P V, one 8-key tile per step, keys renumbered (top): P's
    // fragment {c0, c2, c1, c3}; V's rows 2t and 2t+1 of the tile at feature
    // f*8 + g. Into accumulators of its own, then O = O * alpha + P V in
    // fp32 (alpha: each row's shrink, rows g and g + 8): the tensor cores
    // cut each mma's sum toward zero (H200 runs 1-2: rows of 2048-2500 keys
    // accumulated into O off float64 by 1.5e-5-2.4e-5; the emulator's model
    // of it, Tf32Accumulation::kTruncated, gives the same), so a chain of
    // mma only as long as a tile's, and round-to-nearest between tiles,
    // keeps the error from growing with the row. Feature by feature where
    // the tile's split P takes fewer registers than a whole P V (head dim
    // 128), else 8-key tile by 8-key tile.
    const auto add_to_o = [&](float (&o_f)[4], const float (&pv_f)[4]) {
      o_f[0] = fmaf(o_f[0], alpha[0], pv_f[0]);
      o_f[1] = fmaf(o_f[1], alpha[0], pv_f[1]);
      o_f[2] = fmaf(o_f[2], alpha[1], pv_f[2]);
      o_f[3] = fmaf(o_f[3], alpha[1], pv_f[3]);
    };
    const auto split_p = [&](int n) {
      const uint32_t p_frag[4] = {__float_as_uint(s[n][0]), __float_as_uint(s[n][2]),
                                  __float_as_uint(s[n][1]), __float_as_uint(s[n][3])};
      return SplitA(p_frag);
    };
    if constexpr (kN / 8 * 8 < D / 8 * 4) {
      SplitA pa[kN / 8];
#pragma unroll
      for (int n = 0; n < kN / 8; ++n) pa[n] = split_p(n);
#pragma unroll
      for (int f = 0; f < D / 8; ++f) {
        float pv[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
        for (int n = 0; n < kN / 8; ++n) {
          const float* v_rows = v_tile + (n * 8 + 2 * t) * kLd + g + f * 8;
          Mma3xTf32(pv, pa[n], __float_as_uint(v_rows[0]), __float_as_uint(v_rows[kLd]));
        }
        add_to_o(o[f], pv);
      }
    } else {
      float pv[D / 8][4];
#pragma unroll
      for (int f = 0; f < D / 8; ++f) pv[f][0] = pv[f][1] = pv[f][2] = pv[f][3] = 0.0f;
#pragma unroll
      for (int n = 0; n < kN / 8; ++n) {
        const SplitA pa = split_p(n);
        const float* v_rows = v_tile + (n * 8 + 2 * t) * kLd + g;
#pragma unroll
        for (int f = 0; f < D / 8; ++f) {
          Mma3xTf32(pv[f], pa, __float_as_uint(v_rows[f * 8]),
                    __float_as_uint(v_rows[kLd + f * 8]));
        }
      }
#pragma unroll
      for (int f = 0; f < D / 8; ++f) add_to_o(o[f], pv[f]);
    }
  }
  flash::WaitCopies();  // with no key tile, Q's copy is still in flight

  // Normalise and store. l == 0 only for rows that saw no key: zeros.
  float inv_l[2];
  rows.Normalizers(inv_l);
  flash::StoreRows<float, D>(a, rows, o, inv_l, b, h, t);
}

template <int D, bool kCausal>
cudaError_t Launch(const AttentionParams& a, cudaStream_t stream) {
  constexpr int kShared = SharedBytes<D>();
  if (kShared > 48 * 1024) {
    const cudaError_t err = cudaFuncSetAttribute(FlashAttentionFp32Kernel<D, kCausal>,
                                                 cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                 kShared);
    if (err != cudaSuccess) return err;
  }
  const int64_t q_tiles = (a.q_len + kBlockM - 1) / kBlockM;
  const int64_t blocks = q_tiles * a.num_heads * a.batch;
  if (blocks > INT32_MAX) return cudaErrorInvalidConfiguration;
  ATTNSERVE_LAUNCH((FlashAttentionFp32Kernel<D, kCausal>), static_cast<unsigned>(blocks), kThreads,
                   kShared, stream, a, q_tiles);
  return cudaGetLastError();
}

}  // namespace

int FlashAttentionFp32SharedBytes(int64_t head_dim) {
  if (head_dim == 64) return SharedBytes<64>();
  if (head_dim == 128) return SharedBytes<128>();
  return 0;
}

bool FlashAttentionFp32Supports(const AttentionParams& a, int max_shared_bytes) {
  if (a.dtype != DType::kFloat32) return false;
  if (a.head_dim != a.head_dim_v || (a.head_dim != 64 && a.head_dim != 128)) return false;
  if (FlashAttentionFp32SharedBytes(a.head_dim) > max_shared_bytes) return false;
  if (a.weights != nullptr || a.k_blocks != nullptr) return false;
  return flash::RowsAligned16(a);
}

// The variants: {64, 128} x {causal, not}.
cudaError_t LaunchFlashAttentionFp32(const AttentionParams& args, int max_shared_bytes,
                                     cudaStream_t stream) {
  if (!FlashAttentionFp32Supports(args, max_shared_bytes)) return cudaErrorInvalidValue;
  return ATTNSERVE_HEAD_DIM_SWITCH(args.head_dim, kHeadDim, [&] {
    return ATTNSERVE_BOOL_SWITCH(args.causal, kCausal,
                                 [&] { return Launch<kHeadDim, kCausal>(args, stream); });
  });
}

}  // namespace attnserve::cuda
