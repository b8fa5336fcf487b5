// RotateRows: float64 angles per row, float rotation of every head.
// NormalizeRows: RMSNorm of every head, float64 mean.
#include "engine/cpu/rotary.h"

#include <algorithm>
#include <vector>

#include "engine/temperature.h"
#include "engine/tensor.h"

#ifdef _OPENMP
#include <omp.h>
#endif

namespace attnserve::cpu {

namespace {

// Rotates every head of one row at the cos/sin given (float, or bf16 values
// through `scratch`).
void RotateRow(const RopeConfig& rope, DType dtype, void* data, int64_t at, int64_t heads,
               int64_t head_dim, const float* cos_f, const float* sin_f, float* scratch) {
  for (int64_t h = 0; h < heads; ++h) {
    const int64_t offset = at + h * head_dim;
    if (dtype == DType::kFloat32) {
      RotateHead(static_cast<float*>(data) + offset, cos_f, sin_f, rope.rotary_dim,
                 rope.interleaved);
    } else {
      uint16_t* x = static_cast<uint16_t*>(data) + offset;
      for (int64_t d = 0; d < rope.rotary_dim; ++d) scratch[d] = BFloat16ToFloat(x[d]);
      RotateHead(scratch, cos_f, sin_f, rope.rotary_dim, rope.interleaved);
      for (int64_t d = 0; d < rope.rotary_dim; ++d) x[d] = FloatToBFloat16(scratch[d]);
    }
  }
}

}  // namespace

void RotateRowPairs(const RopeConfig& rope, const RopeFrequencies& freq, DType dtype, void* a,
                    int64_t a_stride, int64_t a_heads, void* b, int64_t b_stride,
                    int64_t b_heads, int64_t rows, int64_t head_dim, int64_t first_position,
                    const int64_t* positions, int threads) {
  const int64_t half = rope.rotary_dim / 2;
#ifdef _OPENMP
  const int n = threads > 0 ? threads : omp_get_max_threads();
#pragma omp parallel num_threads(n) if (rows > 16)
#endif
  {
    std::vector<double> cos_d(static_cast<size_t>(half)), sin_d(static_cast<size_t>(half));
    std::vector<float> cos_f(static_cast<size_t>(half)), sin_f(static_cast<size_t>(half));
    std::vector<float> scratch(static_cast<size_t>(rope.rotary_dim));
#ifdef _OPENMP
#pragma omp for schedule(static)
#endif
    for (int64_t r = 0; r < rows; ++r) {
      RopeAngles(freq, positions != nullptr ? positions[r] : first_position + r, cos_d.data(),
                 sin_d.data());
      for (int64_t i = 0; i < half; ++i) {
        cos_f[i] = static_cast<float>(cos_d[i]);
        sin_f[i] = static_cast<float>(sin_d[i]);
      }
      RotateRow(rope, dtype, a, r * a_stride, a_heads, head_dim, cos_f.data(), sin_f.data(),
                scratch.data());
      if (b != nullptr) {
        RotateRow(rope, dtype, b, r * b_stride, b_heads, head_dim, cos_f.data(), sin_f.data(),
                  scratch.data());
      }
    }
  }
}

void RotateRows(const RopeConfig& rope, const RopeFrequencies& freq, DType dtype, void* data,
                int64_t rows, int64_t row_stride, int64_t heads, int64_t head_dim,
                int64_t first_position, const int64_t* positions, int threads) {
  RotateRowPairs(rope, freq, dtype, data, row_stride, heads, nullptr, 0, 0, rows, head_dim,
                 first_position, positions, threads);
}

void NormalizeRows(const QkNormConfig& norm, const float* w, DType dtype, void* data,
                   int64_t rows, int64_t row_stride, int64_t heads, int64_t head_dim,
                   int threads) {
#ifdef _OPENMP
  const int n = threads > 0 ? threads : omp_get_max_threads();
#pragma omp parallel num_threads(n) if (rows > 16)
#endif
  {
    std::vector<float> head(static_cast<size_t>(head_dim));
#ifdef _OPENMP
#pragma omp for schedule(static)
#endif
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t h = 0; h < heads; ++h) {
        const int64_t at = r * row_stride + h * head_dim;
        const float* wh = norm.per_head_weights && w != nullptr ? w + h * head_dim : w;
        if (dtype == DType::kFloat32) {
          NormalizeHead(static_cast<float*>(data) + at, wh, head_dim, norm);
        } else {
          uint16_t* x = static_cast<uint16_t*>(data) + at;
          for (int64_t d = 0; d < head_dim; ++d) head[d] = BFloat16ToFloat(x[d]);
          NormalizeHead(head.data(), wh, head_dim, norm);
          for (int64_t d = 0; d < head_dim; ++d) x[d] = FloatToBFloat16(head[d]);
        }
      }
    }
  }
}

void ClipRows(DType dtype, void* data, int64_t rows, int64_t row_stride, int64_t width,
              float limit, int threads) {
#ifdef _OPENMP
  const int n = threads > 0 ? threads : omp_get_max_threads();
#pragma omp parallel for num_threads(n) schedule(static) if (rows > 16)
#endif
  for (int64_t r = 0; r < rows; ++r) {
    if (dtype == DType::kFloat32) {
      float* x = static_cast<float*>(data) + r * row_stride;
      for (int64_t d = 0; d < width; ++d) x[d] = std::clamp(x[d], -limit, limit);
    } else {
      uint16_t* x = static_cast<uint16_t*>(data) + r * row_stride;
      for (int64_t d = 0; d < width; ++d) {
        x[d] = FloatToBFloat16(std::clamp(BFloat16ToFloat(x[d]), -limit, limit));
      }
    }
  }
#ifndef _OPENMP
  (void)threads;
#endif
}

void ScaleQueryRows(const TemperatureTuning& tuning, DType dtype, void* data, int64_t rows,
                    int64_t row_stride, int64_t width, int64_t first_index,
                    const int64_t* positions, int threads) {
#ifdef _OPENMP
  const int n = threads > 0 ? threads : omp_get_max_threads();
#pragma omp parallel for num_threads(n) schedule(static) if (rows > 16)
#endif
  for (int64_t r = 0; r < rows; ++r) {
    const float factor = static_cast<float>(
        QueryTemperature(tuning, positions != nullptr ? positions[r] : first_index + r));
    if (dtype == DType::kFloat32) {
      float* x = static_cast<float*>(data) + r * row_stride;
      for (int64_t d = 0; d < width; ++d) x[d] *= factor;
    } else {
      uint16_t* x = static_cast<uint16_t*>(data) + r * row_stride;
      for (int64_t d = 0; d < width; ++d) x[d] = FloatToBFloat16(BFloat16ToFloat(x[d]) * factor);
    }
  }
#ifndef _OPENMP
  (void)threads;
#endif
}

}  // namespace attnserve::cpu
