// RoPE on the cpu engine's projected activations: rotates Q and K rows in
// place between the projections and the attention core (engine/rope.h has
// the frequencies). Internal to engine/cpu.
#ifndef ATTNSERVE_ENGINE_CPU_ROTARY_H_
#define ATTNSERVE_ENGINE_CPU_ROTARY_H_

#include <cstdint>

#include "engine/attention_layer.h"
#include "engine/dtype.h"
#include "engine/rope.h"

namespace attnserve::cpu {

// Rows r < `rows` of a [rows, heads * head_dim] matrix of `dtype` (FLOAT32 or
// BFLOAT16) at data + r * row_stride elements: every head of row r rotates
// at position first_position + r. cos and sin are computed in float64 once
// per row and rounded to float; bf16 values rotate in float and round back.
// Runs on up to `threads` OpenMP threads (0 = the default).
void RotateRows(const RopeConfig& rope, const RopeFrequencies& freq, DType dtype, void* data,
                int64_t rows, int64_t row_stride, int64_t heads, int64_t head_dim,
                int64_t first_position, int threads);

}  // namespace attnserve::cpu

#endif  // ATTNSERVE_ENGINE_CPU_ROTARY_H_
