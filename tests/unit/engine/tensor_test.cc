// Tests for engine/tensor.h (sizes, fp16/bf16 bit patterns derived from the
// IEEE 754 binary16 and bfloat16 definitions) and MakeMaskParams broadcasting.
#include "engine/tensor.h"

#include <cmath>
#include <cstring>
#include <limits>

#include "engine/mask_broadcast.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace attnserve {
namespace {

using ::testing::HasSubstr;

float Bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

TEST(DTypeTest, SizesAndNames) {
  EXPECT_EQ(DTypeSize(DType::kFloat32), 4u);
  EXPECT_EQ(DTypeSize(DType::kFloat16), 2u);
  EXPECT_EQ(DTypeSize(DType::kBFloat16), 2u);
  EXPECT_EQ(DTypeSize(DType::kBool), 1u);
  EXPECT_EQ(DTypeName(DType::kFloat32), "FLOAT32");
  EXPECT_EQ(DTypeName(DType::kFloat16), "FLOAT16");
  EXPECT_EQ(DTypeName(DType::kBFloat16), "BFLOAT16");
  EXPECT_EQ(DTypeName(DType::kBool), "BOOL");
}

TEST(NumElementsTest, Products) {
  EXPECT_EQ(*NumElements(Shape{2, 3, 4}), 24);
  EXPECT_EQ(*NumElements(Shape{}), 1);  // a scalar
  EXPECT_EQ(*NumElements(Shape{7}, 7), 7);  // the limit is inclusive
}

TEST(NumElementsTest, ZeroAndNegativeDims) {
  absl::StatusOr<int64_t> n = NumElements(Shape{2, 0, 3});
  ASSERT_FALSE(n.ok());
  EXPECT_EQ(n.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(n.status().message()), HasSubstr("dim 1 is 0"));
  EXPECT_THAT(std::string(n.status().message()), HasSubstr("[2, 0, 3]"));

  n = NumElements(Shape{-4});
  ASSERT_FALSE(n.ok());
  EXPECT_THAT(std::string(n.status().message()), HasSubstr("dim 0 is -4"));

  // A zero dim is reported as such even when the other dims overflow.
  n = NumElements(Shape{int64_t{1} << 40, int64_t{1} << 40, 0});
  ASSERT_FALSE(n.ok());
  EXPECT_THAT(std::string(n.status().message()), HasSubstr("dim 2 is 0"));
}

TEST(NumElementsTest, Overflow) {
  absl::StatusOr<int64_t> n = NumElements(Shape{int64_t{1} << 32, int64_t{1} << 31});
  ASSERT_FALSE(n.ok());
  EXPECT_EQ(n.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(n.status().message()), HasSubstr("overflows"));
  // 2^62 * 2 = 2^63 is one past INT64_MAX.
  EXPECT_FALSE(NumElements(Shape{int64_t{1} << 62, 2}).ok());
  EXPECT_EQ(*NumElements(Shape{int64_t{1} << 62, 1}), int64_t{1} << 62);
}

TEST(NumElementsTest, Limit) {
  absl::StatusOr<int64_t> n = NumElements(Shape{10, 10}, 99);
  ASSERT_FALSE(n.ok());
  EXPECT_THAT(std::string(n.status().message()), HasSubstr("100 elements"));
  EXPECT_THAT(std::string(n.status().message()), HasSubstr("limit of 99"));
}

TEST(ShapeStringTest, Formats) {
  EXPECT_EQ(ShapeString(Shape{2, 8, 128, 64}), "[2, 8, 128, 64]");
  EXPECT_EQ(ShapeString(Shape{}), "[]");
}

TEST(TensorTest, OwnsZeroedBytes) {
  Tensor t(DType::kFloat16, {3, 5});
  EXPECT_EQ(t.num_elements(), 15);
  EXPECT_EQ(t.byte_size(), 30u);
  for (int i = 0; i < 15; ++i) EXPECT_EQ(t.data_as<uint16_t>()[i], 0);
  EXPECT_EQ(t.view().byte_size(), 30u);
  EXPECT_EQ(t.mutable_view().num_elements(), 15);
}

// binary16: 1 sign, 5 exponent (bias 15), 10 mantissa bits.
TEST(HalfTest, KnownEncodings) {
  EXPECT_EQ(FloatToHalf(1.0f), 0x3C00);
  EXPECT_EQ(FloatToHalf(-2.0f), 0xC000);
  EXPECT_EQ(FloatToHalf(0.5f), 0x3800);
  EXPECT_EQ(FloatToHalf(0.0f), 0x0000);
  EXPECT_EQ(FloatToHalf(-0.0f), 0x8000);
  EXPECT_EQ(FloatToHalf(65504.0f), 0x7BFF);               // largest finite
  EXPECT_EQ(FloatToHalf(std::ldexp(1.0f, -14)), 0x0400);  // smallest normal
  EXPECT_EQ(FloatToHalf(std::ldexp(1.0f, -24)), 0x0001);  // smallest subnormal
  EXPECT_EQ(FloatToHalf(std::ldexp(1023.0f, -24)), 0x03FF);  // largest subnormal
  EXPECT_EQ(FloatToHalf(std::numeric_limits<float>::infinity()), 0x7C00);
  EXPECT_EQ(FloatToHalf(-std::numeric_limits<float>::infinity()), 0xFC00);
  EXPECT_EQ(FloatToHalf(1e10f), 0x7C00);
}

TEST(HalfTest, RoundsToNearestEven) {
  // 1 + 2^-11 lies halfway between 1 (0x3C00, even) and 1 + 2^-10 (0x3C01).
  EXPECT_EQ(FloatToHalf(1.0f + std::ldexp(1.0f, -11)), 0x3C00);
  // 1 + 3 * 2^-11 lies halfway between 0x3C01 (odd) and 0x3C02 (even).
  EXPECT_EQ(FloatToHalf(1.0f + 3 * std::ldexp(1.0f, -11)), 0x3C02);
  // Just above the midpoint rounds up.
  EXPECT_EQ(FloatToHalf(1.0f + std::ldexp(1.0f, -11) + std::ldexp(1.0f, -20)), 0x3C01);
  // Spacing is 2 in [2048, 4096): 2049 -> 2048 (0x6800), 2051 -> 2052 (0x6802).
  EXPECT_EQ(FloatToHalf(2049.0f), 0x6800);
  EXPECT_EQ(FloatToHalf(2051.0f), 0x6802);
  // 65520 is halfway between 65504 (odd mantissa) and 2^16: goes to inf.
  EXPECT_EQ(FloatToHalf(65519.996f), 0x7BFF);
  EXPECT_EQ(FloatToHalf(65520.0f), 0x7C00);
  // Subnormals: 2^-25 is halfway between 0 and 2^-24 -> 0; 3 * 2^-25 is
  // halfway between 1 and 2 ulps -> 2; a hair above 2^-25 -> 1 ulp.
  EXPECT_EQ(FloatToHalf(std::ldexp(1.0f, -25)), 0x0000);
  EXPECT_EQ(FloatToHalf(3 * std::ldexp(1.0f, -25)), 0x0002);
  EXPECT_EQ(FloatToHalf(std::nextafter(std::ldexp(1.0f, -25), 1.0f)), 0x0001);
  EXPECT_EQ(FloatToHalf(-std::ldexp(1.0f, -26)), 0x8000);
  // The largest subnormal plus half an ulp rounds (to even) into the normals.
  EXPECT_EQ(FloatToHalf(std::ldexp(2047.0f, -25)), 0x0400);
}

TEST(HalfTest, DecodesKnownPatterns) {
  EXPECT_EQ(HalfToFloat(0x3C00), 1.0f);
  EXPECT_EQ(HalfToFloat(0xC000), -2.0f);
  EXPECT_EQ(HalfToFloat(0x7BFF), 65504.0f);
  EXPECT_EQ(HalfToFloat(0x0001), std::ldexp(1.0f, -24));
  EXPECT_EQ(HalfToFloat(0x03FF), std::ldexp(1023.0f, -24));
  EXPECT_EQ(HalfToFloat(0x3555), 0.333251953125f);  // 1365/4096
  EXPECT_TRUE(std::isinf(HalfToFloat(0xFC00)) && HalfToFloat(0xFC00) < 0);
  EXPECT_TRUE(std::isnan(HalfToFloat(0x7E00)));
  EXPECT_TRUE(std::signbit(HalfToFloat(0x8000)));
}

TEST(HalfTest, EveryHalfRoundTrips) {
  for (uint32_t h = 0; h <= 0xFFFF; ++h) {
    const float f = HalfToFloat(static_cast<uint16_t>(h));
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(HalfToFloat(FloatToHalf(f)))) << std::hex << h;
      continue;
    }
    EXPECT_EQ(FloatToHalf(f), h) << std::hex << h;
  }
}

// bfloat16: the top 16 bits of a binary32.
TEST(BFloat16Test, KnownEncodingsAndRounding) {
  EXPECT_EQ(FloatToBFloat16(1.0f), 0x3F80);
  EXPECT_EQ(FloatToBFloat16(-2.0f), 0xC000);
  EXPECT_EQ(BFloat16ToFloat(0x3F80), 1.0f);
  // 1 + 2^-8 is halfway between 0x3F80 (even) and 0x3F81.
  EXPECT_EQ(FloatToBFloat16(Bits(0x3F808000)), 0x3F80);
  // 1 + 3 * 2^-8 is halfway between 0x3F81 (odd) and 0x3F82.
  EXPECT_EQ(FloatToBFloat16(Bits(0x3F818000)), 0x3F82);
  EXPECT_EQ(FloatToBFloat16(Bits(0x3F808001)), 0x3F81);
  // The largest float rounds up to infinity.
  EXPECT_EQ(FloatToBFloat16(Bits(0x7F7FFFFF)), 0x7F80);
  EXPECT_EQ(FloatToBFloat16(std::numeric_limits<float>::infinity()), 0x7F80);
  EXPECT_TRUE(std::isnan(BFloat16ToFloat(FloatToBFloat16(std::nanf("")))));
  // A NaN whose payload sits only in the low bits stays NaN (not inf).
  EXPECT_TRUE(std::isnan(BFloat16ToFloat(FloatToBFloat16(Bits(0x7F800001)))));
}

TEST(BFloat16Test, EveryBFloat16RoundTrips) {
  for (uint32_t b = 0; b <= 0xFFFF; ++b) {
    const float f = BFloat16ToFloat(static_cast<uint16_t>(b));
    if (std::isnan(f)) continue;
    EXPECT_EQ(FloatToBFloat16(f), b) << std::hex << b;
  }
}

TEST(ConversionTest, ElementAndBulk) {
  const float values[] = {1.0f, -0.5f, 3.14159f, 65504.0f, 1e-6f};
  for (DType dt : {DType::kFloat32, DType::kFloat16, DType::kBFloat16}) {
    Tensor t(dt, {5});
    ConvertFromFloat(values, 5, dt, t.data());
    float back[5];
    ConvertToFloat(dt, t.data(), 5, back);
    for (int i = 0; i < 5; ++i) {
      EXPECT_EQ(back[i], LoadAsFloat(dt, t.data(), i));
      Tensor one(dt, {1});
      StoreFromFloat(dt, one.data(), 0, values[i]);
      EXPECT_EQ(std::memcmp(one.data(), t.data_as<unsigned char>() + i * DTypeSize(dt),
                            DTypeSize(dt)),
                0);
    }
    if (dt == DType::kFloat32) {
      EXPECT_EQ(back[2], 3.14159f);
    }
    EXPECT_EQ(back[0], 1.0f);
  }
  const uint8_t flags[] = {0, 1, 7};
  EXPECT_EQ(LoadAsFloat(DType::kBool, flags, 0), 0.0f);
  EXPECT_EQ(LoadAsFloat(DType::kBool, flags, 2), 1.0f);
}

// --- MakeMaskParams: scores are [B, Hq, Lq, Lk] = [2, 3, 4, 5] below. -----

struct Strides {
  int64_t b, h, q, k;
  bool operator==(const Strides&) const = default;
};
std::ostream& operator<<(std::ostream& os, const Strides& s) {
  return os << "{" << s.b << ", " << s.h << ", " << s.q << ", " << s.k << "}";
}

Strides MaskStrides(const Shape& shape, DType dtype = DType::kBool) {
  static const unsigned char kData[256] = {};
  absl::StatusOr<MaskParams> m = MakeMaskParams(TensorView{dtype, shape, kData}, 2, 3, 4, 5);
  EXPECT_TRUE(m.ok()) << m.status();
  if (!m.ok()) return {-1, -1, -1, -1};
  return {m->stride_b, m->stride_h, m->stride_q, m->stride_k};
}

TEST(MaskParamsTest, BroadcastShapes) {
  EXPECT_EQ(MaskStrides({4, 5}), (Strides{0, 0, 5, 1}));
  EXPECT_EQ(MaskStrides({2, 1, 4, 5}), (Strides{20, 0, 5, 1}));
  EXPECT_EQ(MaskStrides({1, 3, 4, 5}), (Strides{0, 20, 5, 1}));
  EXPECT_EQ(MaskStrides({2, 3, 4, 5}), (Strides{60, 20, 5, 1}));
  EXPECT_EQ(MaskStrides({3, 4, 5}), (Strides{0, 20, 5, 1}));
  EXPECT_EQ(MaskStrides({1, 4, 5}), (Strides{0, 0, 5, 1}));
  EXPECT_EQ(MaskStrides({2, 1, 1, 5}), (Strides{5, 0, 0, 1}));
  EXPECT_EQ(MaskStrides({4, 1}), (Strides{0, 0, 1, 0}));
  EXPECT_EQ(MaskStrides({1, 1}), (Strides{0, 0, 0, 0}));
  EXPECT_EQ(MaskStrides({2, 3, 1, 1}), (Strides{3, 1, 0, 0}));
}

TEST(MaskParamsTest, KindFollowsDType) {
  static const unsigned char kData[64] = {};
  EXPECT_EQ(MakeMaskParams(TensorView{}, 2, 3, 4, 5)->kind, MaskParams::Kind::kNone);
  EXPECT_EQ(MakeMaskParams(TensorView{DType::kBool, {4, 5}, kData}, 2, 3, 4, 5)->kind,
            MaskParams::Kind::kBool);
  for (DType dt : {DType::kFloat32, DType::kFloat16, DType::kBFloat16}) {
    absl::StatusOr<MaskParams> m = MakeMaskParams(TensorView{dt, {4, 5}, kData}, 2, 3, 4, 5);
    ASSERT_TRUE(m.ok());
    EXPECT_EQ(m->kind, MaskParams::Kind::kAdditive);
    EXPECT_EQ(m->dtype, dt);
    EXPECT_EQ(m->data, kData);
  }
}

TEST(MaskParamsTest, Rejections) {
  static const unsigned char kData[1024] = {};
  struct Bad {
    Shape shape;
    const char* detail;
  };
  const Bad cases[] = {
      {{5, 4}, "dim 1 is 4 against 5"},        // transposed
      {{2, 4, 5}, "dim 0 is 2 against 3"},     // batch where heads belong
      {{3, 2, 4, 5}, "dim 1 is 2 against 3"},  // batch and heads swapped
      {{2, 3, 4, 6}, "dim 3 is 6 against 5"},
      {{2, 3, 0, 5}, "dim 2 is 0 against 4"},
      {{5}, "rank must be 2, 3 or 4"},
      {{1, 2, 3, 4, 5}, "rank must be 2, 3 or 4"},
  };
  for (const Bad& bad : cases) {
    absl::StatusOr<MaskParams> m =
        MakeMaskParams(TensorView{DType::kBool, bad.shape, kData}, 2, 3, 4, 5);
    ASSERT_FALSE(m.ok()) << ShapeString(bad.shape);
    EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(m.status().message()), HasSubstr("attn_mask"));
    EXPECT_THAT(std::string(m.status().message()), HasSubstr(ShapeString(bad.shape)));
    EXPECT_THAT(std::string(m.status().message()), HasSubstr("[2, 3, 4, 5]"));
    EXPECT_THAT(std::string(m.status().message()), HasSubstr(bad.detail));
  }
  absl::StatusOr<MaskParams> m =
      MakeMaskParams(TensorView{DType::kBool, {5, 4}, kData}, 2, 3, 4, 5);
  EXPECT_THAT(std::string(m.status().message()), HasSubstr("each must equal the target dim or be 1"));
}

}  // namespace
}  // namespace attnserve
