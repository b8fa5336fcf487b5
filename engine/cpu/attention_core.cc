// Attention core on oneDNN: S = Q K^T and O = P V as batched matmuls over
// (batch, kv head, query head in group), with the masked softmax in between
// as a plain fp32 loop. Grouped-query heads are a broadcast batch dim of K
// and V, so no K/V copy is made per query head.
#include "engine/cpu/attention_core.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace attnserve::cpu {
namespace {

// Below this many score elements a parallel region costs more than it saves
// (and on an oversubscribed machine a lot more).
constexpr int64_t kMinParallelElements = 1 << 14;

// Scales, masks and softmaxes the rows of s = [bc, Hq, tq, Lk] (batch
// elements b0.., query rows i0..) in place into probabilities.
void MaskedSoftmax(const AttentionParams& p, int64_t b0, int64_t bc, int64_t i0, int64_t tq,
                   float* s) {
  const int64_t lk = p.kv_len;
  const int64_t rows = bc * p.num_heads * tq;
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const MaskParams& m = p.mask;
#pragma omp parallel for schedule(static) if (rows * lk >= kMinParallelElements)
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t ii = r % tq;
    const int64_t h = (r / tq) % p.num_heads;
    const int64_t b = b0 + r / (tq * p.num_heads);
    const int64_t i = i0 + ii;
    float* row = s + r * lk;
    // Keys at j >= end are masked by causality or padding.
    int64_t end = lk;
    if (p.causal) end = std::min(end, std::max<int64_t>(0, i + (lk - p.q_len) + 1));
    if (p.key_lengths != nullptr) end = std::clamp<int64_t>(p.key_lengths[b], 0, end);

    const int64_t mask_base = b * m.stride_b + h * m.stride_h + i * m.stride_q;
    float row_max = neg_inf;
    for (int64_t j = 0; j < end; ++j) {
      float v = row[j] * p.scale;
      if (m.kind == MaskParams::Kind::kBool) {
        if (static_cast<const uint8_t*>(m.data)[mask_base + j * m.stride_k] == 0) v = neg_inf;
      } else if (m.kind == MaskParams::Kind::kAdditive) {
        v += LoadAsFloat(m.dtype, m.data, mask_base + j * m.stride_k);
      }
      row[j] = v;
      row_max = v > row_max ? v : row_max;
    }
    // Every key masked (or masked to -inf by an additive mask): zeros.
    if (row_max == neg_inf) {
      std::fill(row, row + lk, 0.0f);
      continue;
    }
    float sum = 0.0f;
    for (int64_t j = 0; j < end; ++j) {
      const float e = std::exp(row[j] - row_max);
      row[j] = e;
      sum += e;
    }
    const float inv = 1.0f / sum;
    for (int64_t j = 0; j < end; ++j) row[j] *= inv;
    std::fill(row + end, row + lk, 0.0f);
  }
}

// Copies the probabilities of the chunk to p.weights: per head, or the mean
// over heads (summed in head order, so the result is reproducible).
void StoreWeights(const AttentionParams& p, int64_t b0, int64_t bc, int64_t i0, int64_t tq,
                  const float* probs) {
  const int64_t lk = p.kv_len;
  const size_t elem = DTypeSize(p.weights_dtype);
  auto* out = static_cast<unsigned char*>(p.weights);
  if (!p.average_weights) {
    for (int64_t bb = 0; bb < bc; ++bb)
      for (int64_t h = 0; h < p.num_heads; ++h) {
        const int64_t dst_row = ((b0 + bb) * p.num_heads + h) * p.q_len + i0;
        const float* src = probs + (bb * p.num_heads + h) * tq * lk;
        ConvertFromFloat(src, tq * lk, p.weights_dtype,
                         out + static_cast<size_t>(dst_row * lk) * elem);
      }
    return;
  }
  const float inv_heads = 1.0f / static_cast<float>(p.num_heads);
#pragma omp parallel for schedule(static) \
    if (bc * tq * p.num_heads * lk >= kMinParallelElements)
  for (int64_t r = 0; r < bc * tq; ++r) {
    const int64_t bb = r / tq, ii = r % tq;
    std::vector<float> acc(static_cast<size_t>(lk), 0.0f);
    for (int64_t h = 0; h < p.num_heads; ++h) {
      const float* src = probs + ((bb * p.num_heads + h) * tq + ii) * lk;
      for (int64_t j = 0; j < lk; ++j) acc[j] += src[j];
    }
    for (int64_t j = 0; j < lk; ++j) acc[j] *= inv_heads;
    const int64_t dst_row = (b0 + bb) * p.q_len + i0 + ii;
    ConvertFromFloat(acc.data(), lk, p.weights_dtype,
                     out + static_cast<size_t>(dst_row * lk) * elem);
  }
}

}  // namespace

absl::Status AttentionCoreF32(const AttentionParams& p, MatmulCache& matmuls,
                              dnnl::stream& stream, int64_t scores_budget) {
  const int64_t hq = p.num_heads, g = p.num_kv_heads, group = hq / g;
  const int64_t lk = p.kv_len, d = p.head_dim, dv = p.head_dim_v;

  // Whole request in one go when its scores fit the budget; otherwise one
  // batch element and as many query rows as fit.
  int64_t bc = p.batch, rows_per_block = p.q_len;
  if (p.batch * hq * p.q_len * lk > scores_budget) {
    bc = 1;
    rows_per_block = std::clamp<int64_t>(scores_budget / (hq * lk), 1, p.q_len);
  }
  std::vector<float> scores(static_cast<size_t>(bc * hq * rows_per_block * lk));

  const auto* q = static_cast<const float*>(p.q);
  const auto* k = static_cast<const float*>(p.k);
  const auto* v = static_cast<const float*>(p.v);
  auto* o = static_cast<float*>(p.out);
  for (int64_t b0 = 0; b0 < p.batch; b0 += bc) {
    for (int64_t i0 = 0; i0 < p.q_len; i0 += rows_per_block) {
      const int64_t tq = std::min(rows_per_block, p.q_len - i0);
      // Dims [batch, kv head, query head within the group, rows, cols]; K and
      // V have 1 in the group dim and are broadcast across it. The stride of
      // that size-1 dim is irrelevant but must be nonzero, or oneDNN falls
      // back to its reference implementation.
      MatmulShape qk;
      qk.src_dims = {bc, g, group, tq, d};
      qk.src_strides = {p.q_stride_b, group * p.q_stride_h, p.q_stride_h, p.q_stride_row, 1};
      qk.wei_dims = {bc, g, 1, d, lk};
      qk.wei_strides = {p.k_stride_b, p.k_stride_h, 1, 1, p.k_stride_row};
      qk.dst_dims = {bc, g, group, tq, lk};
      qk.dst_strides = {g * group * tq * lk, group * tq * lk, tq * lk, lk, 1};
      const float* q_chunk = q + b0 * p.q_stride_b + i0 * p.q_stride_row;
      const float* k_chunk = k + b0 * p.k_stride_b;
      if (absl::Status s = matmuls.Execute(qk, q_chunk, k_chunk, nullptr, scores.data(), stream);
          !s.ok()) {
        return s;
      }

      MaskedSoftmax(p, b0, bc, i0, tq, scores.data());
      if (p.weights != nullptr) StoreWeights(p, b0, bc, i0, tq, scores.data());

      MatmulShape pv;
      pv.src_dims = qk.dst_dims;
      pv.src_strides = qk.dst_strides;
      pv.wei_dims = {bc, g, 1, lk, dv};
      pv.wei_strides = {p.v_stride_b, p.v_stride_h, 1, p.v_stride_row, 1};
      pv.dst_dims = {bc, g, group, tq, dv};
      pv.dst_strides = {p.o_stride_b, group * p.o_stride_h, p.o_stride_h, p.o_stride_row, 1};
      const float* v_chunk = v + b0 * p.v_stride_b;
      float* o_chunk = o + b0 * p.o_stride_b + i0 * p.o_stride_row;
      if (absl::Status s = matmuls.Execute(pv, scores.data(), v_chunk, nullptr, o_chunk, stream);
          !s.ok()) {
        return s;
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace attnserve::cpu
