// GateRows: one elementwise pass, rows shared by the threads.
#include "engine/cpu/output_gate.h"

#include "engine/output_gate.h"
#include "engine/tensor.h"

#ifdef _OPENMP
#include <omp.h>
#endif

namespace attnserve::cpu {

void GateRows(DType dtype, void* core, int64_t core_stride, const void* gate,
              int64_t gate_stride, int64_t rows, int64_t width, int threads) {
#ifdef _OPENMP
  const int n = threads > 0 ? threads : omp_get_max_threads();
#pragma omp parallel for num_threads(n) schedule(static) if (rows > 16)
#endif
  for (int64_t r = 0; r < rows; ++r) {
    if (dtype == DType::kFloat32) {
      float* x = static_cast<float*>(core) + r * core_stride;
      const float* g = static_cast<const float*>(gate) + r * gate_stride;
      for (int64_t j = 0; j < width; ++j) x[j] *= Sigmoid(g[j]);
    } else {
      uint16_t* x = static_cast<uint16_t*>(core) + r * core_stride;
      const uint16_t* g = static_cast<const uint16_t*>(gate) + r * gate_stride;
      for (int64_t j = 0; j < width; ++j) {
        const float s = BFloat16ToFloat(FloatToBFloat16(Sigmoid(BFloat16ToFloat(g[j]))));
        x[j] = FloatToBFloat16(BFloat16ToFloat(x[j]) * s);
      }
    }
  }
#ifndef _OPENMP
  (void)threads;
#endif
}

}  // namespace attnserve::cpu
