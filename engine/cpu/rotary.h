// What happens to the cpu engine's projected Q and K rows, in place,
// between the projections and the attention core: QK-norm (engine/qk_norm.h),
// QKV clipping (V's rows too) and RoPE (engine/rope.h has the frequencies),
// then the queries' temperature (engine/temperature.h). Internal to engine/cpu.
#ifndef ATTNSERVE_ENGINE_CPU_ROTARY_H_
#define ATTNSERVE_ENGINE_CPU_ROTARY_H_

#include <cstdint>

#include "engine/attention_layer.h"
#include "engine/dtype.h"
#include "engine/qk_norm.h"
#include "engine/rope.h"

namespace attnserve::cpu {

// Rows r < `rows` of a [rows, heads * head_dim] matrix of `dtype` (FLOAT32 or
// BFLOAT16) at data + r * row_stride elements: every head of row r rotates
// at position first_position + r, or positions[r] when `positions` is not
// null. cos and sin are computed in float64 once
// per row and rounded to float; bf16 values rotate in float and round back.
// Runs on up to `threads` OpenMP threads (0 = the default).
void RotateRows(const RopeConfig& rope, const RopeFrequencies& freq, DType dtype, void* data,
                int64_t rows, int64_t row_stride, int64_t heads, int64_t head_dim,
                int64_t first_position, const int64_t* positions, int threads);

// The same for two matrices whose row r sits at the same position (the Q
// and K of self-attention), the angles computed once per row for both.
void RotateRowPairs(const RopeConfig& rope, const RopeFrequencies& freq, DType dtype, void* a,
                    int64_t a_stride, int64_t a_heads, void* b, int64_t b_stride,
                    int64_t b_heads, int64_t rows, int64_t head_dim, int64_t first_position,
                    const int64_t* positions, int threads);

// QK-norm of every head of rows r < `rows` (same layout as RotateRows) with
// the weights w[head_dim] (head h's at w + h * head_dim with
// norm.per_head_weights; nullptr: weights of 1, the value norm).
void NormalizeRows(const QkNormConfig& norm, const float* w, DType dtype, void* data,
                   int64_t rows, int64_t row_stride, int64_t heads, int64_t head_dim,
                   int threads);

// QKV clipping (clip_qkv): the first `width` features of rows r < `rows`
// (of `dtype`, FLOAT32 or BFLOAT16, at data + r * row_stride elements)
// clamped to [-limit, limit].
void ClipRows(DType dtype, void* data, int64_t rows, int64_t row_stride, int64_t width,
              float limit, int threads);

// Attention temperature tuning: row r < `rows` (its `width` features, of
// `dtype`, at data + r * row_stride elements) times
// QueryTemperature(tuning, positions[r]), or QueryTemperature(tuning,
// first_index + r) when `positions` is null, rounded to float once.
void ScaleQueryRows(const TemperatureTuning& tuning, DType dtype, void* data, int64_t rows,
                    int64_t row_stride, int64_t width, int64_t first_index,
                    const int64_t* positions, int threads);

}  // namespace attnserve::cpu

#endif  // ATTNSERVE_ENGINE_CPU_ROTARY_H_
