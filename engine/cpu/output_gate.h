// The cpu backend's output gate (engine/output_gate.h): the core output of
// a batch's rows times sigmoid of their projected gate, in place. Internal
// to engine/cpu.
#ifndef ATTNSERVE_ENGINE_CPU_OUTPUT_GATE_H_
#define ATTNSERVE_ENGINE_CPU_OUTPUT_GATE_H_

#include <cstdint>

#include "engine/dtype.h"

namespace attnserve::cpu {

// core[r][j] *= sigmoid(gate[r][j]) for r < rows, j < width; rows are
// `core_stride` and `gate_stride` elements apart, both of `dtype` (FLOAT32,
// or BFLOAT16 activations: then, as PyTorch computes a bf16 layer, the
// sigmoid is rounded to bf16 before the product, and the product again).
void GateRows(DType dtype, void* core, int64_t core_stride, const void* gate,
              int64_t gate_stride, int64_t rows, int64_t width, int threads);

}  // namespace attnserve::cpu

#endif  // ATTNSERVE_ENGINE_CPU_OUTPUT_GATE_H_
