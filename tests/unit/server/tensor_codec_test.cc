// tensor_codec: dtype mapping, zero-copy input views (decoded here, checked
// by the request path's ViewInput), in-place output buffers.
#include "server/transport/tensor_codec.h"

#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/request/validation.h"

namespace attnserve {
namespace {

using ::testing::HasSubstr;

absl::StatusOr<TensorView> ViewTensor(const v1::Tensor& t, absl::string_view field,
                                      int64_t max_elements = INT64_MAX) {
  return ViewInput(DecodeTensor(t, /*has=*/true, field), field, max_elements);
}

TEST(TensorCodecTest, DTypeRoundTrip) {
  for (DType dtype : {DType::kFloat32, DType::kFloat16, DType::kBFloat16, DType::kBool}) {
    absl::StatusOr<DType> back = DTypeFromProto(DTypeToProto(dtype), "x");
    ASSERT_TRUE(back.ok());
    EXPECT_EQ(*back, dtype);
    EXPECT_EQ(ProtoDTypeName(DTypeToProto(dtype)), std::string(DTypeName(dtype)));
  }
  EXPECT_EQ(ProtoDTypeName(42), "42");
  absl::StatusOr<DType> unset = DTypeFromProto(v1::DATA_TYPE_UNSPECIFIED, "query.dtype");
  EXPECT_EQ(unset.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(unset.status().message()), HasSubstr("query.dtype"));
}

TEST(TensorCodecTest, ViewPointsIntoTheMessage) {
  v1::Tensor t;
  t.set_dtype(v1::FLOAT16);
  t.add_shape(3);
  t.add_shape(5);
  t.set_data(std::string(30, 'a'));
  absl::StatusOr<TensorView> view = ViewTensor(t, "key");
  ASSERT_TRUE(view.ok()) << view.status();
  EXPECT_EQ(view->data, static_cast<const void*>(t.data().data()));
  EXPECT_EQ(view->dtype, DType::kFloat16);
  EXPECT_EQ(view->shape, (Shape{3, 5}));
  EXPECT_EQ(view->byte_size(), 30u);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(view->data) % 2, 0u);
}

TEST(TensorCodecTest, ViewRejectsWithField) {
  v1::Tensor t;
  t.set_dtype(v1::FLOAT32);
  t.add_shape(2);
  t.set_data("1234567");
  absl::StatusOr<TensorView> view = ViewTensor(t, "value");
  EXPECT_EQ(view.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(view.status().message()),
              HasSubstr("value.data: expected 8 bytes (shape [2] x FLOAT32 4 bytes), got 7"));

  t.set_data("12345678");
  view = ViewTensor(t, "value", /*max_elements=*/1);
  EXPECT_EQ(view.status().code(), absl::StatusCode::kResourceExhausted);
}

TEST(TensorCodecTest, ScalarIsOneElement) {
  // Rank 0 is a valid tensor here (one element); models reject it by rank.
  v1::Tensor t;
  t.set_dtype(v1::BOOL);
  t.set_data("x");
  absl::StatusOr<TensorView> view = ViewTensor(t, "m");
  ASSERT_TRUE(view.ok()) << view.status();
  EXPECT_EQ(view->rank(), 0);
}

TEST(TensorCodecTest, AllocateWritesInPlace) {
  v1::Tensor t;
  MutableTensorView out = AllocateTensor(DType::kBFloat16, {2, 3, 4}, &t);
  EXPECT_EQ(t.dtype(), v1::BFLOAT16);
  EXPECT_THAT(t.shape(), ::testing::ElementsAre(2, 3, 4));
  ASSERT_EQ(t.data().size(), 48u);
  EXPECT_EQ(out.data, static_cast<void*>(t.mutable_data()->data()));
  static_cast<unsigned char*>(out.data)[47] = 7;
  EXPECT_EQ(t.data()[47], 7);
}

TEST(TensorCodecTest, EmptyTensor) {
  v1::Tensor t;
  EXPECT_TRUE(IsEmptyTensor(t));
  EXPECT_FALSE(DecodeTensor(t, /*has=*/true, "attn_mask").present);
  t.add_shape(1);
  EXPECT_FALSE(IsEmptyTensor(t));
  EXPECT_TRUE(DecodeTensor(t, /*has=*/true, "attn_mask").present);
  EXPECT_FALSE(DecodeTensor(t, /*has=*/false, "attn_mask").present);
}

TEST(TensorCodecTest, UnknownDTypeIsADecodeErrorNamingTheField) {
  v1::Tensor t;
  t.set_dtype(static_cast<v1::DataType>(42));
  t.add_shape(1);
  const InputTensor in = DecodeTensor(t, /*has=*/true, "key");
  EXPECT_TRUE(in.present);
  EXPECT_EQ(in.decode_error.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(in.decode_error.message()), HasSubstr("key.dtype: unknown dtype value 42"));
}

}  // namespace
}  // namespace attnserve
