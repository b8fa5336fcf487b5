// QK-norm, QKV clipping, RoPE and the queries' temperature on the projected
// Q and K (attention_kernels.h), computed
// as the cpu engine computes them (engine/cpu/rotary.cc): the float64 parts
// (the norm's mean, the angles, cos and sin) in float64, the rest in float
// with every product rounded as written (no fused multiply-adds), so that
// both engines give the same values up to float64's last bits.
#include <cstdint>

#include "engine/cuda/attention_kernels.h"
#include "engine/cuda/device_utils.cuh"

namespace attnserve::cuda {
namespace {

constexpr int kWarpSize = 32;
constexpr int kNormWarps = 8;
constexpr int kRotaryThreads = 128;

// The sum over a warp's lanes, the same in every lane.
__device__ __forceinline__ double WarpSum(double v) {
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
    v += __shfl_xor_sync(0xffffffffu, v, offset);
  }
  return v;
}

// One warp per (row, head) vector; head h's weights at w + h * weight_stride.
__global__ void QkNormKernel(void* x, DType type, int64_t rows, int64_t row_stride,
                             int64_t heads, int64_t head_dim, const float* w, double eps,
                             bool weight_offset, bool subtract_mean, int64_t weight_stride) {
  const int64_t vector = blockIdx.x * int64_t{kNormWarps} + threadIdx.x / kWarpSize;
  const int lane = static_cast<int>(threadIdx.x) % kWarpSize;
  if (vector >= rows * heads) return;  // whole warps leave together
  const int64_t at = (vector / heads) * row_stride + (vector % heads) * head_dim;
  const float* wh = w != nullptr ? w + (vector % heads) * weight_stride : nullptr;
  double mean = 0.0;
  if (subtract_mean) {
    for (int64_t d = lane; d < head_dim; d += kWarpSize) mean += LoadElement(x, type, at + d);
    mean = WarpSum(mean) / static_cast<double>(head_dim);
  }
  double sum = 0.0;
  for (int64_t d = lane; d < head_dim; d += kWarpSize) {
    const double v = static_cast<double>(LoadElement(x, type, at + d)) - mean;
    sum += v * v;
  }
  sum = WarpSum(sum);
  const float inv = static_cast<float>(1.0 / sqrt(sum / static_cast<double>(head_dim) + eps));
  const float shift = static_cast<float>(mean);
  for (int64_t d = lane; d < head_dim; d += kWarpSize) {
    const float weight = wh == nullptr ? 1.0f : weight_offset ? __fadd_rn(1.0f, wh[d]) : wh[d];
    const float value = LoadElement(x, type, at + d);
    const float centred = subtract_mean ? __fsub_rn(value, shift) : value;
    StoreElement(x, type, at + d, __fmul_rn(__fmul_rn(centred, inv), weight));
  }
}

// One block per row: each thread takes pairs i (angle computed once per row
// and pair) and rotates that pair in every head.
__global__ void RotaryKernel(void* x, DType type, int64_t seq_len, int64_t row_stride,
                             int64_t heads, int64_t head_dim, RotaryArgs r) {
  const int64_t row = blockIdx.x;
  const int64_t b = row / seq_len, t = row % seq_len;
  const int64_t position =
      r.positions != nullptr ? r.positions[b * r.positions_stride + r.first + t] : r.first + t;
  const int64_t half = r.rotary_dim / 2;
  for (int64_t i = threadIdx.x; i < half; i += blockDim.x) {
    const double angle = static_cast<double>(position) * r.inv_freq[i];
    const float c = static_cast<float>(cos(angle) * r.attention_factor);
    const float s = static_cast<float>(sin(angle) * r.attention_factor);
    const int64_t first = r.interleaved ? 2 * i : i;
    const int64_t second = r.interleaved ? 2 * i + 1 : i + half;
    for (int64_t h = 0; h < heads; ++h) {
      const int64_t at = row * row_stride + h * head_dim;
      const float x1 = LoadElement(x, type, at + first);
      const float x2 = LoadElement(x, type, at + second);
      StoreElement(x, type, at + first, __fsub_rn(__fmul_rn(x1, c), __fmul_rn(x2, s)));
      StoreElement(x, type, at + second, __fadd_rn(__fmul_rn(x2, c), __fmul_rn(x1, s)));
    }
  }
}

// One block per row: its factor (engine/temperature.h) in float64, rounded
// to float once, times each of its features.
__global__ void QueryTemperatureKernel(void* x, DType type, int64_t seq_len, int64_t row_stride,
                                       int64_t width, TemperatureArgs a) {
  const int64_t row = blockIdx.x;
  const int64_t b = row / seq_len, t = row % seq_len;
  const int64_t p =
      a.positions != nullptr ? a.positions[b * a.positions_stride + a.first + t] : a.first + t;
  const double shifted = static_cast<double>(p) + (a.by_position ? 0.0 : 1.0);
  const float factor =
      static_cast<float>(log1p(floor(shifted / a.floor_scale)) * a.attn_scale + 1.0);
  for (int64_t d = threadIdx.x; d < width; d += blockDim.x) {
    const int64_t at = row * row_stride + d;
    StoreElement(x, type, at, __fmul_rn(LoadElement(x, type, at), factor));
  }
}

// One block per row: its first `width` features clamped.
__global__ void ClipKernel(void* x, DType type, int64_t row_stride, int64_t width, float limit) {
  const int64_t row = blockIdx.x;
  for (int64_t d = threadIdx.x; d < width; d += blockDim.x) {
    const int64_t at = row * row_stride + d;
    StoreElement(x, type, at, fminf(fmaxf(LoadElement(x, type, at), -limit), limit));
  }
}

}  // namespace

cudaError_t LaunchClip(void* x, DType type, int64_t rows, int64_t row_stride, int64_t width,
                       float limit, cudaStream_t stream) {
  if (rows <= 0 || width <= 0) return cudaSuccess;
  if (rows > INT32_MAX) return cudaErrorInvalidConfiguration;
  ATTNSERVE_LAUNCH(ClipKernel, static_cast<unsigned>(rows), kRotaryThreads, 0, stream, x, type,
                   row_stride, width, limit);
  return cudaGetLastError();
}

cudaError_t LaunchQueryTemperature(void* x, DType type, int64_t rows, int64_t seq_len,
                                   int64_t row_stride, int64_t width, const TemperatureArgs& a,
                                   cudaStream_t stream) {
  if (rows <= 0 || width <= 0) return cudaSuccess;
  if (rows > INT32_MAX || seq_len <= 0) return cudaErrorInvalidConfiguration;
  ATTNSERVE_LAUNCH(QueryTemperatureKernel, static_cast<unsigned>(rows), kRotaryThreads, 0, stream,
                   x, type, seq_len, row_stride, width, a);
  return cudaGetLastError();
}

cudaError_t LaunchQkNorm(void* x, DType type, int64_t rows, int64_t row_stride, int64_t heads,
                         int64_t head_dim, const float* w, double eps, bool weight_offset,
                         bool subtract_mean, int64_t weight_stride, cudaStream_t stream) {
  const int64_t vectors = rows * heads;
  if (vectors <= 0) return cudaSuccess;
  const int64_t blocks = (vectors + kNormWarps - 1) / kNormWarps;
  if (blocks > INT32_MAX) return cudaErrorInvalidConfiguration;
  ATTNSERVE_LAUNCH(QkNormKernel, static_cast<unsigned>(blocks), kNormWarps * kWarpSize, 0, stream,
                   x, type, rows, row_stride, heads, head_dim, w, eps, weight_offset,
                   subtract_mean, weight_stride);
  return cudaGetLastError();
}

cudaError_t LaunchRotary(void* x, DType type, int64_t rows, int64_t seq_len, int64_t row_stride,
                         int64_t heads, int64_t head_dim, const RotaryArgs& rotary,
                         cudaStream_t stream) {
  if (rows <= 0 || rotary.rotary_dim <= 0) return cudaSuccess;
  if (rows > INT32_MAX || seq_len <= 0) return cudaErrorInvalidConfiguration;
  ATTNSERVE_LAUNCH(RotaryKernel, static_cast<unsigned>(rows), kRotaryThreads, 0, stream, x, type,
                   seq_len, row_stride, heads, head_dim, rotary);
  return cudaGetLastError();
}

}  // namespace attnserve::cuda
