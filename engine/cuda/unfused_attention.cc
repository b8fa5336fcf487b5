// UnfusedAttention: per chunk of (b, h) pairs, pointer arrays, S = Q K^T,
// softmax in place, O = P V, scatter into the output.
#include "engine/cuda/unfused_attention.h"

#include <algorithm>
#include <vector>

#include "engine/cuda/attention_kernels.h"
#include "engine/cuda/cuda_status.h"

namespace attnserve::cuda {
namespace {

// Query rows [r0, r0 + rows) with the keys [0, keys) that any of them may
// see: a causal request's GEMMs skip the keys past each block's diagonal
// (its last row's causal end), so they do a little over half the work of
// the whole score matrix. The softmax reads no score past a row's own end,
// and writes zero probabilities there, so P V over a block's `keys` is
// exact.
struct RowBlock {
  int64_t r0, rows, keys;
};

// Up to kMaxRowBlocks blocks of rows (multiples of 64) for a causal request
// of at least 512 query rows; else one block over everything.
constexpr int64_t kMaxRowBlocks = 8;
std::vector<RowBlock> RowBlocks(const AttentionParams& a) {
  if (!a.causal || a.q_len < 512) return {RowBlock{0, a.q_len, a.kv_len}};
  const int64_t step = (a.q_len / kMaxRowBlocks + 63) / 64 * 64;
  std::vector<RowBlock> blocks;
  for (int64_t r0 = 0; r0 < a.q_len; r0 += step) {
    const int64_t rows = std::min(step, a.q_len - r0);
    // Row i sees keys j <= i + (kv_len - q_len); at least one key so that
    // every GEMM has a shape (the rows that see none get zeros).
    const int64_t keys = std::clamp<int64_t>(r0 + rows + (a.kv_len - a.q_len), 1, a.kv_len);
    blocks.push_back(RowBlock{r0, rows, keys});
  }
  return blocks;
}

// How many (b, h) pairs one chunk holds: as many blocks of `scores` fp32
// scores as fit UnfusedAttention::kMaxChunkScoreBytes, at least one, at
// most `pairs`.
int64_t ChunkPairs(int64_t scores, int64_t pairs) {
  const size_t pair_bytes = static_cast<size_t>(std::max<int64_t>(scores, 1)) * 4;
  return std::clamp<int64_t>(
      static_cast<int64_t>(UnfusedAttention::kMaxChunkScoreBytes / pair_bytes), 1, pairs);
}

// The batched GEMMs' pointer arrays for a chunk of `chunk` pairs
// (LaunchPairPointers fills them), in one allocation.
struct PairTables {
  const void** q;
  const void** k;
  const void** v;
  void** s;
  void** o;
  void** lo;  // P's low parts (3xTF32)
};
absl::StatusOr<PairTables> AllocatePairTables(DeviceAllocator alloc, int64_t chunk) {
  absl::StatusOr<void*> ptrs = alloc(static_cast<size_t>(6 * chunk) * sizeof(void*));
  if (!ptrs.ok()) return ptrs.status();
  auto** table = static_cast<void**>(*ptrs);
  return PairTables{const_cast<const void**>(table), const_cast<const void**>(table + chunk),
                    const_cast<const void**>(table + 2 * chunk), table + 3 * chunk,
                    table + 4 * chunk, table + 5 * chunk};
}

}  // namespace

absl::StatusOr<std::unique_ptr<UnfusedAttention>> UnfusedAttention::Create(cudaStream_t stream,
                                                                           Gemm gemm) {
  std::unique_ptr<UnfusedAttention> u(new UnfusedAttention(gemm));
  ATTNSERVE_CUBLAS_CALL(cublasCreate(&u->blas_));
  ATTNSERVE_CUBLAS_CALL(cublasSetStream(u->blas_, stream));
  // No TF32 shortcut but the one asked for per GEMM, whatever the
  // environment says.
  ATTNSERVE_CUBLAS_CALL(cublasSetMathMode(u->blas_, CUBLAS_PEDANTIC_MATH));
  return u;
}

UnfusedAttention::~UnfusedAttention() {
  if (blas_ != nullptr) (void)cublasDestroy(blas_);
}

bool UnfusedAttention::Supports(const AttentionParams& a) {
  return a.dtype == DType::kFloat32 && a.k_blocks == nullptr &&
         static_cast<double>(a.q_len) * static_cast<double>(a.kv_len) * 4.0 <=
             static_cast<double>(kMaxChunkScoreBytes) &&
         a.q_len <= (int64_t{1} << 30) && a.kv_len <= (int64_t{1} << 30) &&
         a.head_dim <= (int64_t{1} << 20) && a.head_dim_v <= (int64_t{1} << 20);
}

bool UnfusedAttention::SupportsWeights(const AttentionParams& a) {
  return (a.dtype == DType::kFloat16 || a.dtype == DType::kBFloat16) && a.k_blocks == nullptr &&
         a.softcap <= 0.0f && a.sinks == nullptr && a.alibi_slopes == nullptr &&
         a.relative_bias == nullptr && a.relative_key == nullptr && a.relative_query == nullptr &&
         static_cast<double>(a.q_len) * static_cast<double>(a.kv_len) * 4.0 <=
             static_cast<double>(kMaxChunkScoreBytes) &&
         a.q_len <= (int64_t{1} << 30) && a.kv_len <= (int64_t{1} << 30) &&
         a.head_dim <= (int64_t{1} << 20);
}

absl::Status UnfusedAttention::EnqueueWeights(const AttentionParams& a, const float* lse,
                                              int64_t lse_rows, DeviceAllocator alloc,
                                              cudaStream_t stream) {
  if (!SupportsWeights(a) || a.weights == nullptr || lse == nullptr) {
    return absl::InternalError("unfused weights: a request it does not support");
  }
  const int64_t pairs = a.batch * a.num_heads;
  if (pairs == 0 || a.q_len == 0 || a.kv_len == 0) return absl::OkStatus();  // no weights
  const int64_t scores = a.q_len * a.kv_len;
  const int64_t chunk = ChunkPairs(scores, pairs);
  absl::StatusOr<void*> s = alloc(static_cast<size_t>(chunk * scores) * 4);
  if (!s.ok()) return s.status();
  absl::StatusOr<PairTables> t = AllocatePairTables(alloc, chunk);
  if (!t.ok()) return t.status();
  float* sf = static_cast<float*>(*s);
  const cudaDataType_t in = a.dtype == DType::kFloat16 ? CUDA_R_16F : CUDA_R_16BF;
  const size_t elem = 2;
  const float one = 1.0f, zero = 0.0f;
  AttentionParams qk = a;
  qk.v = nullptr;  // only Q and K are read
  const std::vector<RowBlock> blocks = RowBlocks(a);
  for (int64_t p0 = 0; p0 < pairs; p0 += chunk) {
    const int64_t count = std::min(chunk, pairs - p0);
    for (const RowBlock& rb : blocks) {
      AttentionParams at = qk;
      at.q = static_cast<const char*>(a.q) + static_cast<size_t>(rb.r0 * a.q_stride_row) * elem;
      // No output here: o's pointers (at sf) go unused.
      ATTNSERVE_CUDA_CALL(LaunchPairPointers(at, p0, count, sf + rb.r0 * a.kv_len, /*lo=*/nullptr,
                                             sf, t->q, t->k, t->v, t->s, /*lo_ptrs=*/nullptr,
                                             t->o, stream));
      // S^T [keys, rows] = K [keys, D] x Q^T [D, rows] per pair, fp32
      // accumulation, into S^T [Lk, Lq].
      ATTNSERVE_CUBLAS_CALL(cublasGemmBatchedEx(
          blas_, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(rb.keys), static_cast<int>(rb.rows),
          static_cast<int>(a.head_dim), &one, t->k, in, static_cast<int>(a.k_stride_row),
          t->q, in, static_cast<int>(a.q_stride_row), &zero, t->s, CUDA_R_32F,
          static_cast<int>(a.kv_len), static_cast<int>(count), CUBLAS_COMPUTE_32F,
          CUBLAS_GEMM_DEFAULT));
    }
    ATTNSERVE_CUDA_CALL(LaunchWeightsFromStats(a, p0, count, sf, lse, lse_rows, stream));
  }
  return absl::OkStatus();
}

absl::Status UnfusedAttention::Enqueue(const AttentionParams& a, DeviceAllocator alloc,
                                       cudaStream_t stream) {
  if (!Supports(a)) {
    return absl::InternalError("unfused attention: a request it does not support");
  }
  const int64_t pairs = a.batch * a.num_heads;
  if (pairs == 0 || a.q_len == 0) return absl::OkStatus();
  const int64_t scores = a.q_len * a.kv_len;
  const int64_t chunk = ChunkPairs(scores, pairs);
  absl::StatusOr<void*> s = alloc(static_cast<size_t>(chunk * std::max<int64_t>(scores, 1)) * 4);
  if (!s.ok()) return s.status();
  // O per pair: [Lq, Dv], or [Lq, 2Dv] with 3xTF32 (below).
  const int64_t o_width = (gemm_ == Gemm::k3xTf32 ? 2 : 1) * a.head_dim_v;
  absl::StatusOr<void*> o = alloc(static_cast<size_t>(chunk * a.q_len * o_width) * 4);
  if (!o.ok()) return o.status();
  // Pointer arrays: Q, K, V, S, O per pair (and P's low parts with 3xTF32).
  absl::StatusOr<PairTables> tables = AllocatePairTables(alloc, chunk);
  if (!tables.ok()) return tables.status();
  const void** q_ptrs = tables->q;
  const void** k_ptrs = tables->k;
  const void** v_ptrs = tables->v;
  void** s_ptrs = tables->s;
  void** o_ptrs = tables->o;
  void** lo_ptrs = tables->lo;
  float* sf = static_cast<float*>(*s);
  float* of = static_cast<float*>(*o);

  const float one = 1.0f, zero = 0.0f;
  const std::vector<RowBlock> blocks = RowBlocks(a);
  // The pointer arrays of a chunk's pairs for the row block `rb` of `params`
  // (FLOAT32 Q, O rows `o_width` wide, P's low parts in `lo` or none): Q,
  // S, the low parts and O start at the block's first row.
  auto block_pointers = [&](const AttentionParams& params, const RowBlock& rb, int64_t p0,
                            int64_t count, float* lo, int64_t o_width) {
    AttentionParams at = params;
    at.q = static_cast<const float*>(params.q) + rb.r0 * params.q_stride_row;
    return LaunchPairPointers(at, p0, count, sf + rb.r0 * a.kv_len,
                              lo == nullptr ? nullptr : lo + rb.r0 * a.kv_len,
                              of + rb.r0 * o_width, q_ptrs, k_ptrs, v_ptrs, s_ptrs,
                              lo == nullptr ? nullptr : lo_ptrs, o_ptrs, stream);
  };
  if (gemm_ == Gemm::kFp32) {
    for (int64_t p0 = 0; p0 < pairs; p0 += chunk) {
      const int64_t count = std::min(chunk, pairs - p0);
      if (a.kv_len > 0) {
        for (const RowBlock& rb : blocks) {
          ATTNSERVE_CUDA_CALL(block_pointers(a, rb, p0, count, /*lo=*/nullptr, a.head_dim_v));
          // Column-major view: S^T [keys, rows] = K [keys, D] x Q^T [D, rows],
          // per pair, into S^T [Lk, Lq] (leading dimension Lk).
          ATTNSERVE_CUBLAS_CALL(cublasGemmBatchedEx(
              blas_, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(rb.keys),
              static_cast<int>(rb.rows), static_cast<int>(a.head_dim), &one, k_ptrs, CUDA_R_32F,
              static_cast<int>(a.k_stride_row), q_ptrs, CUDA_R_32F,
              static_cast<int>(a.q_stride_row), &zero, s_ptrs, CUDA_R_32F,
              static_cast<int>(a.kv_len), static_cast<int>(count), CUBLAS_COMPUTE_32F_PEDANTIC,
              CUBLAS_GEMM_DEFAULT));
        }
      }
      ATTNSERVE_CUDA_CALL(LaunchSoftmaxRows(a, p0, count, sf, /*lo=*/nullptr, stream));
      if (a.kv_len > 0) {
        for (const RowBlock& rb : blocks) {
          ATTNSERVE_CUDA_CALL(block_pointers(a, rb, p0, count, /*lo=*/nullptr, a.head_dim_v));
          // O^T [Dv, rows] = V^T [Dv, keys] x P^T [keys, rows].
          ATTNSERVE_CUBLAS_CALL(cublasGemmBatchedEx(
              blas_, CUBLAS_OP_N, CUBLAS_OP_N, static_cast<int>(a.head_dim_v),
              static_cast<int>(rb.rows), static_cast<int>(rb.keys), &one, v_ptrs, CUDA_R_32F,
              static_cast<int>(a.v_stride_row), const_cast<const void**>(s_ptrs), CUDA_R_32F,
              static_cast<int>(a.kv_len), &zero, o_ptrs, CUDA_R_32F,
              static_cast<int>(a.head_dim_v), static_cast<int>(count),
              CUBLAS_COMPUTE_32F_PEDANTIC, CUBLAS_GEMM_DEFAULT));
        }
      } else {
        ATTNSERVE_CUDA_CALL(cudaMemsetAsync(
            of, 0, static_cast<size_t>(count * a.q_len * a.head_dim_v) * 4, stream));
      }
      ATTNSERVE_CUDA_CALL(LaunchScatterOutput(a, p0, count, of, /*split=*/false, stream));
    }
    return absl::OkStatus();
  }

  // 3xTF32: the split operands of the whole request, contiguous head layout
  // (q3 [B, Hq, Lq, 3D], k3 [B, Hkv, Lk, 3D], v2 [B, Hkv, Lk, 2Dv]), read
  // per pair through `split`'s strides; the probabilities' low parts in `lo`
  // (one chunk, like s: so the scores take twice kMaxChunkScoreBytes);
  // O [chunk, Lq, 2Dv] in `of`.
  const int64_t d3 = 3 * a.head_dim, dv2 = 2 * a.head_dim_v;
  absl::StatusOr<void*> q3 = alloc(static_cast<size_t>(pairs * a.q_len * d3) * 4);
  if (!q3.ok()) return q3.status();
  absl::StatusOr<void*> k3 =
      alloc(static_cast<size_t>(std::max<int64_t>(a.batch * a.num_kv_heads * a.kv_len * d3, 1)) * 4);
  if (!k3.ok()) return k3.status();
  absl::StatusOr<void*> v2 =
      alloc(static_cast<size_t>(std::max<int64_t>(a.batch * a.num_kv_heads * a.kv_len * dv2, 1)) * 4);
  if (!v2.ok()) return v2.status();
  absl::StatusOr<void*> lo = alloc(static_cast<size_t>(chunk * std::max<int64_t>(scores, 1)) * 4);
  if (!lo.ok()) return lo.status();
  ATTNSERVE_CUDA_CALL(LaunchTf32Split(static_cast<const float*>(a.q), a.batch, a.num_heads,
                                      a.q_len, a.head_dim, a.q_stride_b, a.q_stride_h,
                                      a.q_stride_row, Tf32Split::kHhl,
                                      static_cast<float*>(*q3), stream));
  ATTNSERVE_CUDA_CALL(LaunchTf32Split(static_cast<const float*>(a.k), a.batch, a.num_kv_heads,
                                      a.kv_len, a.head_dim, a.k_stride_b, a.k_stride_h,
                                      a.k_stride_row, Tf32Split::kHlh,
                                      static_cast<float*>(*k3), stream));
  ATTNSERVE_CUDA_CALL(LaunchTf32Split(static_cast<const float*>(a.v), a.batch, a.num_kv_heads,
                                      a.kv_len, a.head_dim_v, a.v_stride_b, a.v_stride_h,
                                      a.v_stride_row, Tf32Split::kHl,
                                      static_cast<float*>(*v2), stream));
  AttentionParams split = a;
  split.q = *q3;
  split.k = *k3;
  split.v = *v2;
  HeadLayoutStrides(a.num_heads, a.q_len, d3, &split.q_stride_b, &split.q_stride_h,
                    &split.q_stride_row);
  HeadLayoutStrides(a.num_kv_heads, a.kv_len, d3, &split.k_stride_b, &split.k_stride_h,
                    &split.k_stride_row);
  HeadLayoutStrides(a.num_kv_heads, a.kv_len, dv2, &split.v_stride_b, &split.v_stride_h,
                    &split.v_stride_row);
  split.head_dim_v = dv2;  // o's pair blocks are [Lq, 2Dv]
  float* o2f = of;
  float* lof = static_cast<float*>(*lo);
  for (int64_t p0 = 0; p0 < pairs; p0 += chunk) {
    const int64_t count = std::min(chunk, pairs - p0);
    if (a.kv_len > 0) {
      for (const RowBlock& rb : blocks) {
        ATTNSERVE_CUDA_CALL(block_pointers(split, rb, p0, count, lof, dv2));
        // S^T [keys, rows] = K3 [keys, 3D] x Q3^T [3D, rows], per pair, on
        // TF32 tensor cores, into S^T [Lk, Lq].
        ATTNSERVE_CUBLAS_CALL(cublasGemmBatchedEx(
            blas_, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(rb.keys), static_cast<int>(rb.rows),
            static_cast<int>(d3), &one, k_ptrs, CUDA_R_32F, static_cast<int>(d3), q_ptrs,
            CUDA_R_32F, static_cast<int>(d3), &zero, s_ptrs, CUDA_R_32F,
            static_cast<int>(a.kv_len), static_cast<int>(count), CUBLAS_COMPUTE_32F_FAST_TF32,
            CUBLAS_GEMM_DEFAULT));
      }
    }
    ATTNSERVE_CUDA_CALL(LaunchSoftmaxRows(a, p0, count, sf, lof, stream));
    if (a.kv_len > 0) {
      for (const RowBlock& rb : blocks) {
        ATTNSERVE_CUDA_CALL(block_pointers(split, rb, p0, count, lof, dv2));
        // [P_h V_h | P_h V_l]^T [2Dv, rows] = [V_h | V_l]^T [2Dv, keys] x P_h^T [keys, rows].
        ATTNSERVE_CUBLAS_CALL(cublasGemmBatchedEx(
            blas_, CUBLAS_OP_N, CUBLAS_OP_N, static_cast<int>(dv2), static_cast<int>(rb.rows),
            static_cast<int>(rb.keys), &one, v_ptrs, CUDA_R_32F, static_cast<int>(dv2),
            const_cast<const void**>(s_ptrs), CUDA_R_32F, static_cast<int>(a.kv_len), &zero,
            o_ptrs, CUDA_R_32F, static_cast<int>(dv2), static_cast<int>(count),
            CUBLAS_COMPUTE_32F_FAST_TF32, CUBLAS_GEMM_DEFAULT));
        // First half += P_l V_h.
        ATTNSERVE_CUBLAS_CALL(cublasGemmBatchedEx(
            blas_, CUBLAS_OP_N, CUBLAS_OP_N, static_cast<int>(a.head_dim_v),
            static_cast<int>(rb.rows), static_cast<int>(rb.keys), &one, v_ptrs, CUDA_R_32F,
            static_cast<int>(dv2), const_cast<const void**>(lo_ptrs), CUDA_R_32F,
            static_cast<int>(a.kv_len), &one, o_ptrs, CUDA_R_32F, static_cast<int>(dv2),
            static_cast<int>(count), CUBLAS_COMPUTE_32F_FAST_TF32, CUBLAS_GEMM_DEFAULT));
      }
    } else {
      ATTNSERVE_CUDA_CALL(
          cudaMemsetAsync(o2f, 0, static_cast<size_t>(count * a.q_len * dv2) * 4, stream));
    }
    ATTNSERVE_CUDA_CALL(LaunchScatterOutput(a, p0, count, o2f, /*split=*/true, stream));
  }
  return absl::OkStatus();
}

}  // namespace attnserve::cuda
