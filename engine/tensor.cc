// Element types, checked shape arithmetic and the fp16/bf16 conversions every
// backend uses at its edges. The conversions are integer-only so that they
// give the same bits on every machine and compiler.
#include "engine/tensor.h"

#include <cmath>
#include <limits>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace attnserve {

std::string_view DTypeName(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return "FLOAT32";
    case DType::kFloat16: return "FLOAT16";
    case DType::kBFloat16: return "BFLOAT16";
    case DType::kBool: return "BOOL";
  }
  return "UNKNOWN";
}

absl::StatusOr<int64_t> NumElements(absl::Span<const int64_t> shape, int64_t limit) {
  // Check every dim first so that a zero dim is reported as such rather than
  // hidden behind an overflow found earlier in the product.
  for (size_t i = 0; i < shape.size(); ++i) {
    if (shape[i] < 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("shape ", ShapeString(shape), ": dim ", i, " is ", shape[i],
                       "; every dim must be >= 1"));
    }
  }
  int64_t product = 1;
  for (int64_t d : shape) {
    if (__builtin_mul_overflow(product, d, &product)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "shape ", ShapeString(shape), ": the number of elements overflows int64"));
    }
  }
  if (product > limit) {
    return absl::InvalidArgumentError(absl::StrCat("shape ", ShapeString(shape), " has ",
                                                   product, " elements, over the limit of ",
                                                   limit));
  }
  return product;
}

std::string ShapeString(absl::Span<const int64_t> shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

namespace {
int64_t Product(const Shape& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}
}  // namespace

int64_t TensorView::num_elements() const { return Product(shape); }
int64_t MutableTensorView::num_elements() const { return Product(shape); }

Tensor::Tensor(DType dtype, Shape shape)
    : dtype_(dtype),
      shape_(std::move(shape)),
      bytes_(static_cast<size_t>(Product(shape_)) * DTypeSize(dtype), 0) {}

int64_t Tensor::num_elements() const { return Product(shape_); }

float HalfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1Fu;
  const uint32_t mant = h & 0x3FFu;
  uint32_t bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {
      // Subnormal half: mant * 2^-24, exactly representable as a float.
      float f = std::ldexp(static_cast<float>(mant), -24);
      return sign ? -f : f;
    }
  } else if (exp == 0x1F) {
    bits = sign | 0x7F800000u | (mant << 13);  // inf, or NaN with its payload
  } else {
    bits = sign | ((exp + (127 - 15)) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

uint16_t FloatToHalf(float f) {
  uint32_t x;
  std::memcpy(&x, &f, sizeof x);
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  const uint32_t abs = x & 0x7FFFFFFFu;
  if (abs > 0x7F800000u) {  // NaN: keep it quiet and keep the top payload bits
    return static_cast<uint16_t>(sign | 0x7E00u | ((abs >> 13) & 0x3FFu));
  }
  // 65520 (0x477FF000) is the midpoint between 65504 (max half, odd mantissa)
  // and 2^16; ties go to even, i.e. to infinity.
  if (abs >= 0x477FF000u) return static_cast<uint16_t>(sign | 0x7C00u);
  if (abs >= 0x38800000u) {  // normal half (>= 2^-14)
    const uint32_t odd = (abs >> 13) & 1u;
    // Rebias the exponent (127 -> 15) and round the 13 dropped bits to
    // nearest even; a carry out of the mantissa correctly bumps the exponent.
    return static_cast<uint16_t>(sign | ((abs - 0x38000000u + 0xFFFu + odd) >> 13));
  }
  // Subnormal half: value = q * 2^-24.
  const uint32_t exp = abs >> 23;
  if (exp < 102) return sign;  // below 2^-25: rounds to zero
  const uint32_t mant = (abs & 0x7FFFFFu) | 0x800000u;
  const uint32_t shift = 126 - exp;  // in [14, 24]
  uint32_t q = mant >> shift;
  const uint32_t rem = mant & ((1u << shift) - 1u);
  const uint32_t halfway = 1u << (shift - 1);
  if (rem > halfway || (rem == halfway && (q & 1u))) ++q;
  return static_cast<uint16_t>(sign | q);
}

uint16_t FloatToBFloat16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, sizeof x);
  if ((x & 0x7FFFFFFFu) > 0x7F800000u) {
    return static_cast<uint16_t>((x >> 16) | 0x0040u);  // quiet NaN
  }
  const uint32_t odd = (x >> 16) & 1u;
  return static_cast<uint16_t>((x + 0x7FFFu + odd) >> 16);
}

float LoadAsFloat(DType dtype, const void* data, int64_t i) {
  switch (dtype) {
    case DType::kFloat32: return static_cast<const float*>(data)[i];
    case DType::kFloat16: return HalfToFloat(static_cast<const uint16_t*>(data)[i]);
    case DType::kBFloat16: return BFloat16ToFloat(static_cast<const uint16_t*>(data)[i]);
    case DType::kBool: return static_cast<const uint8_t*>(data)[i] != 0 ? 1.0f : 0.0f;
  }
  return 0.0f;
}

void StoreFromFloat(DType dtype, void* data, int64_t i, float value) {
  switch (dtype) {
    case DType::kFloat32: static_cast<float*>(data)[i] = value; return;
    case DType::kFloat16: static_cast<uint16_t*>(data)[i] = FloatToHalf(value); return;
    case DType::kBFloat16: static_cast<uint16_t*>(data)[i] = FloatToBFloat16(value); return;
    case DType::kBool: static_cast<uint8_t*>(data)[i] = value != 0.0f ? 1 : 0; return;
  }
}

void ConvertToFloat(DType dtype, const void* src, int64_t n, float* dst) {
  switch (dtype) {
    case DType::kFloat32:
      std::memcpy(dst, src, static_cast<size_t>(n) * sizeof(float));
      return;
    case DType::kFloat16: {
      const auto* s = static_cast<const uint16_t*>(src);
      for (int64_t i = 0; i < n; ++i) dst[i] = HalfToFloat(s[i]);
      return;
    }
    case DType::kBFloat16: {
      const auto* s = static_cast<const uint16_t*>(src);
      for (int64_t i = 0; i < n; ++i) dst[i] = BFloat16ToFloat(s[i]);
      return;
    }
    case DType::kBool: {
      const auto* s = static_cast<const uint8_t*>(src);
      for (int64_t i = 0; i < n; ++i) dst[i] = s[i] != 0 ? 1.0f : 0.0f;
      return;
    }
  }
}

void ConvertFromFloat(const float* src, int64_t n, DType dtype, void* dst) {
  switch (dtype) {
    case DType::kFloat32:
      std::memcpy(dst, src, static_cast<size_t>(n) * sizeof(float));
      return;
    case DType::kFloat16: {
      auto* d = static_cast<uint16_t*>(dst);
      for (int64_t i = 0; i < n; ++i) d[i] = FloatToHalf(src[i]);
      return;
    }
    case DType::kBFloat16: {
      auto* d = static_cast<uint16_t*>(dst);
      for (int64_t i = 0; i < n; ++i) d[i] = FloatToBFloat16(src[i]);
      return;
    }
    case DType::kBool: {
      auto* d = static_cast<uint8_t*>(dst);
      for (int64_t i = 0; i < n; ++i) d[i] = src[i] != 0.0f ? 1 : 0;
      return;
    }
  }
}

}  // namespace attnserve
