// ValidateAttendInputs, fed as the attnserve.v1 front end feeds it (an
// AttendRequest decoded by attend_codec): one table row per rule (status
// code + the words the message must contain), and valid requests whose task
// dims are checked.
#include "server/request/validation.h"

#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "engine/model/builtin_models.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/transport/attend_codec.h"
#include "server/transport/tensor_codec.h"

namespace attnserve {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

absl::StatusOr<ValidatedRequest> ValidateAttendRequest(const v1::AttendRequest& request,
                                                       const LayerConfig& layer,
                                                       const ValidationOptions& options = {}) {
  return ValidateAttendInputs(DecodeAttendRequest(request), layer, options);
}

v1::Tensor MakeTensor(v1::DataType dtype, std::vector<int64_t> shape) {
  v1::Tensor t;
  t.set_dtype(dtype);
  int64_t n = 1;
  for (int64_t d : shape) {
    t.add_shape(d);
    n *= d;
  }
  const int64_t size = dtype == v1::FLOAT32 ? 4 : dtype == v1::BOOL ? 1 : 2;
  t.set_data(std::string(static_cast<size_t>(n * size), '\0'));
  return t;
}

const LayerConfig& SdpaLayer() {
  static const auto keep = MakeSdpaLayer();
  return keep->config;
}
const LayerConfig& MhaLayer() {
  static const auto keep = MakeDemoMhaLayer();
  return keep->config;
}

// sdpa: B=2, Hq=4, Hkv=2, Lq=5, Lk=7, Dk=8, Dv=6 (GQA, cross, Dv != Dk).
v1::AttendRequest ValidSdpa() {
  v1::AttendRequest r;
  r.set_model("sdpa");
  *r.mutable_query() = MakeTensor(v1::FLOAT32, {2, 4, 5, 8});
  *r.mutable_key() = MakeTensor(v1::FLOAT32, {2, 2, 7, 8});
  *r.mutable_value() = MakeTensor(v1::FLOAT32, {2, 2, 7, 6});
  return r;
}

// demo-mha self-attention: query [2, 5, 512].
v1::AttendRequest ValidMha() {
  v1::AttendRequest r;
  *r.mutable_query() = MakeTensor(v1::FLOAT32, {2, 5, 512});
  return r;
}

// demo-mha cross attention: key/value [2, 7, 512].
v1::AttendRequest ValidMhaCross() {
  v1::AttendRequest r = ValidMha();
  *r.mutable_key() = MakeTensor(v1::FLOAT32, {2, 7, 512});
  *r.mutable_value() = MakeTensor(v1::FLOAT32, {2, 7, 512});
  return r;
}

// Sets element `i` (row-major) of a tensor to a raw bit pattern: fp32 takes
// 32 bits, fp16/bf16 16, so NaN and Inf encodings are exactly what is sent.
template <typename Bits>
void SetBits(v1::Tensor* t, int64_t i, Bits bits) {
  ASSERT_LE((i + 1) * static_cast<int64_t>(sizeof bits), static_cast<int64_t>(t->data().size()));
  std::memcpy(t->mutable_data()->data() + i * static_cast<int64_t>(sizeof bits), &bits,
              sizeof bits);
}
void SetFloat(v1::Tensor* t, int64_t i, float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  SetBits(t, i, bits);
}
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();

// ValidSdpa with query, key and value in `dtype` (zeros).
v1::AttendRequest ValidSdpaAs(v1::DataType dtype) {
  v1::AttendRequest r = ValidSdpa();
  *r.mutable_query() = MakeTensor(dtype, {2, 4, 5, 8});
  *r.mutable_key() = MakeTensor(dtype, {2, 2, 7, 8});
  *r.mutable_value() = MakeTensor(dtype, {2, 2, 7, 6});
  return r;
}

struct Case {
  std::string name;
  std::function<v1::AttendRequest()> request;
  absl::StatusCode code;
  std::vector<std::string> words;  // each must appear in the message
  bool mha = false;                // validate against demo-mha instead of sdpa
  ValidationOptions options = {};
};

void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

template <typename F>
std::function<v1::AttendRequest()> Sdpa(F mutate) {
  return [mutate] {
    v1::AttendRequest r = ValidSdpa();
    mutate(r);
    return r;
  };
}
template <typename F>
std::function<v1::AttendRequest()> SdpaAs(v1::DataType dtype, F mutate) {
  return [dtype, mutate] {
    v1::AttendRequest r = ValidSdpaAs(dtype);
    mutate(r);
    return r;
  };
}
template <typename F>
std::function<v1::AttendRequest()> Mha(F mutate, bool cross = false) {
  return [mutate, cross] {
    v1::AttendRequest r = cross ? ValidMhaCross() : ValidMha();
    mutate(r);
    return r;
  };
}

constexpr absl::StatusCode kInvalid = absl::StatusCode::kInvalidArgument;
constexpr absl::StatusCode kExhausted = absl::StatusCode::kResourceExhausted;

std::vector<Case> Cases() {
  std::vector<Case> c;
  // Presence.
  c.push_back({"QueryMissing", Sdpa([](auto& r) { r.clear_query(); }), kInvalid,
               {"query:", "required"}});
  c.push_back({"KeyWithoutValue", Sdpa([](auto& r) { r.clear_value(); }), kInvalid,
               {"value:", "required because key is given"}});
  c.push_back({"ValueWithoutKey", Sdpa([](auto& r) { r.clear_key(); }), kInvalid,
               {"key:", "required because value is given"}});
  c.push_back({"KeyValueOmittedOnSdpa", Sdpa([](auto& r) {
                 r.clear_key();
                 r.clear_value();
               }),
               kInvalid, {"key:", "required by model 'sdpa'"}});
  c.push_back({"MhaKeyWithoutValue", Mha([](auto& r) { r.clear_value(); }, true), kInvalid,
               {"value:", "required because key is given"}, true});
  // dtypes.
  c.push_back({"DTypeUnset", Sdpa([](auto& r) { r.mutable_query()->set_dtype(v1::DATA_TYPE_UNSPECIFIED); }),
               kInvalid, {"query.dtype", "must be set", "DATA_TYPE_UNSPECIFIED"}});
  c.push_back({"DTypeUnknownValue",
               Sdpa([](auto& r) { r.mutable_key()->set_dtype(static_cast<v1::DataType>(17)); }),
               kInvalid, {"key.dtype", "unknown dtype value 17"}});
  c.push_back({"DTypeBoolInput", Sdpa([](auto& r) {
                 *r.mutable_value() = MakeTensor(v1::BOOL, {2, 2, 7, 6});
               }),
               kInvalid, {"value.dtype", "FLOAT32, FLOAT16 or BFLOAT16", "got BOOL"}});
  c.push_back({"DTypeMixed", Sdpa([](auto& r) {
                 *r.mutable_key() = MakeTensor(v1::FLOAT16, {2, 2, 7, 8});
               }),
               kInvalid, {"key.dtype", "must match query.dtype (FLOAT32)", "got FLOAT16"}});
  // Bytes.
  c.push_back({"ByteSizeMismatch", Sdpa([](auto& r) {
                 r.mutable_query()->set_data(std::string(100, '\0'));
               }),
               kInvalid,
               {"query.data: expected 1280 bytes (shape [2, 4, 5, 8] x FLOAT32 4 bytes), got 100"}});
  c.push_back({"ByteSizeMismatchHalf", Sdpa([](auto& r) {
                 *r.mutable_query() = MakeTensor(v1::BFLOAT16, {2, 4, 5, 8});
                 *r.mutable_key() = MakeTensor(v1::BFLOAT16, {2, 2, 7, 8});
                 *r.mutable_value() = MakeTensor(v1::BFLOAT16, {2, 2, 7, 6});
                 r.mutable_value()->mutable_data()->push_back('\0');
               }),
               kInvalid, {"value.data", "expected 336 bytes", "BFLOAT16 2 bytes", "got 337"}});
  // Ranks.
  c.push_back({"RankSdpa", Sdpa([](auto& r) {
                 *r.mutable_query() = MakeTensor(v1::FLOAT32, {2, 5, 8});
               }),
               kInvalid, {"query.shape", "expected rank 4", "got rank 3", "[2, 5, 8]"}});
  c.push_back({"RankSdpaKey", Sdpa([](auto& r) {
                 *r.mutable_key() = MakeTensor(v1::FLOAT32, {2, 2, 7, 8, 1});
               }),
               kInvalid, {"key.shape", "expected rank 4", "got rank 5"}});
  c.push_back({"RankMha", Mha([](auto& r) {
                 *r.mutable_query() = MakeTensor(v1::FLOAT32, {2, 1, 5, 512});
               }),
               kInvalid, {"query.shape", "expected rank 3 [B, Lq, query_dim]", "got rank 4"}, true});
  // Dims.
  c.push_back({"ZeroDim", Sdpa([](auto& r) {
                 r.mutable_query()->set_shape(2, 0);
                 r.mutable_query()->clear_data();
               }),
               kInvalid, {"query.shape", "every dim must be >= 1", "got 0 at dim 2"}});
  c.push_back({"NegativeDim", Sdpa([](auto& r) { r.mutable_value()->set_shape(3, -6); }),
               kInvalid, {"value.shape", ">= 1", "got -6 at dim 3"}});
  c.push_back({"ShapeOverflow", Sdpa([](auto& r) {
                 r.mutable_query()->set_shape(0, int64_t{1} << 40);
                 r.mutable_query()->set_shape(1, int64_t{1} << 40);
               }),
               kInvalid, {"query.shape", "overflows int64"}});
  {
    Case limit{"InputOverLimit", Sdpa([](auto&) {}), kExhausted,
               {"query.shape", "320 elements", "limit of 100"}};
    limit.options.max_input_elements = 100;
    c.push_back(limit);
  }
  // Cross-tensor dims (head layout).
  c.push_back({"HqNotMultipleOfHkv", Sdpa([](auto& r) {
                 *r.mutable_key() = MakeTensor(v1::FLOAT32, {2, 3, 7, 8});
                 *r.mutable_value() = MakeTensor(v1::FLOAT32, {2, 3, 7, 6});
               }),
               kInvalid, {"query.shape", "multiple", "Hq=4", "Hkv=3"}});
  c.push_back({"KeyBatchMismatch", Sdpa([](auto& r) {
                 *r.mutable_key() = MakeTensor(v1::FLOAT32, {3, 2, 7, 8});
               }),
               kInvalid, {"key.shape", "dim 0 (batch)", "query's 2", "got 3"}});
  c.push_back({"ValueBatchMismatch", Sdpa([](auto& r) {
                 *r.mutable_value() = MakeTensor(v1::FLOAT32, {1, 2, 7, 6});
               }),
               kInvalid, {"value.shape", "batch", "got 1"}});
  c.push_back({"KeyValueLengthMismatch", Sdpa([](auto& r) {
                 *r.mutable_value() = MakeTensor(v1::FLOAT32, {2, 2, 9, 6});
               }),
               kInvalid, {"value.shape", "key length", "key's 7", "got 9"}});
  c.push_back({"KeyValueHeadsMismatch", Sdpa([](auto& r) {
                 *r.mutable_value() = MakeTensor(v1::FLOAT32, {2, 4, 7, 6});
               }),
               kInvalid, {"value.shape", "kv heads", "key's 2", "got 4"}});
  c.push_back({"HeadDimMismatch", Sdpa([](auto& r) {
                 *r.mutable_key() = MakeTensor(v1::FLOAT32, {2, 2, 7, 16});
               }),
               kInvalid, {"key.shape", "head_dim", "query's 8", "got 16"}});
  // Cross-tensor dims (projection layout).
  c.push_back({"QueryWidthNotQueryDim", Mha([](auto& r) {
                 *r.mutable_query() = MakeTensor(v1::FLOAT32, {2, 5, 64});
               }),
               kInvalid, {"query.shape", "query_dim", "512", "got 64"}, true});
  c.push_back({"KeyWidthNotKeyDim", Mha([](auto& r) {
                 *r.mutable_key() = MakeTensor(v1::FLOAT32, {2, 7, 256});
               }, true),
               kInvalid, {"key.shape", "key_dim", "got 256"}, true});
  c.push_back({"MhaKeyValueLengthMismatch", Mha([](auto& r) {
                 *r.mutable_value() = MakeTensor(v1::FLOAT32, {2, 8, 512});
               }, true),
               kInvalid, {"value.shape", "key length", "key's 7", "got 8"}, true});
  c.push_back({"MhaBatchMismatch", Mha([](auto& r) {
                 *r.mutable_key() = MakeTensor(v1::FLOAT32, {1, 7, 512});
               }, true),
               kInvalid, {"key.shape", "batch", "query's 2", "got 1"}, true});
  // Mask.
  c.push_back({"MaskNotBroadcastable", Sdpa([](auto& r) {
                 *r.mutable_attn_mask() = MakeTensor(v1::BOOL, {3, 7});
               }),
               kInvalid,
               {"attn_mask.shape", "[3, 7] does not broadcast", "[2, 4, 5, 7]", "Lq=5"}});
  c.push_back({"MaskHeadsNotBroadcastable", Sdpa([](auto& r) {
                 *r.mutable_attn_mask() = MakeTensor(v1::FLOAT32, {2, 3, 5, 7});
               }),
               kInvalid, {"attn_mask.shape", "does not broadcast", "Hq=4"}});
  c.push_back({"MaskRank", Sdpa([](auto& r) {
                 *r.mutable_attn_mask() = MakeTensor(v1::BOOL, {7});
               }),
               kInvalid, {"attn_mask.shape", "rank 2 to 4", "got rank 1"}});
  c.push_back({"MaskDTypeUnset", Sdpa([](auto& r) {
                 *r.mutable_attn_mask() = MakeTensor(v1::BOOL, {5, 7});
                 r.mutable_attn_mask()->set_dtype(v1::DATA_TYPE_UNSPECIFIED);
               }),
               kInvalid, {"attn_mask.dtype", "must be set"}});
  c.push_back({"MaskBytes", Sdpa([](auto& r) {
                 *r.mutable_attn_mask() = MakeTensor(v1::FLOAT16, {5, 7});
                 r.mutable_attn_mask()->set_data(std::string(35, '\0'));
               }),
               kInvalid, {"attn_mask.data", "expected 70 bytes", "got 35"}});
  // key_lengths.
  c.push_back({"KeyLengthsCount", Sdpa([](auto& r) {
                 for (int i = 0; i < 3; ++i) r.add_key_lengths(1);
               }),
               kInvalid, {"key_lengths", "one value per batch element (B=2)", "got 3"}});
  c.push_back({"KeyLengthsTooLong", Sdpa([](auto& r) {
                 r.add_key_lengths(7);
                 r.add_key_lengths(8);
               }),
               kInvalid, {"key_lengths[1]", "[0, Lk=7]", "got 8"}});
  c.push_back({"KeyLengthsNegative", Sdpa([](auto& r) {
                 r.add_key_lengths(-1);
                 r.add_key_lengths(3);
               }),
               kInvalid, {"key_lengths[0]", "[0, Lk=7]", "got -1"}});
  c.push_back({"MhaKeyLengthsSelfAttention", Mha([](auto& r) {
                 r.add_key_lengths(5);
                 r.add_key_lengths(6);
               }),
               kInvalid, {"key_lengths[1]", "[0, Lk=5]", "got 6"}, true});
  // Scale.
  c.push_back({"ScaleNaN", Sdpa([](auto& r) {
                 r.set_scale(std::numeric_limits<float>::quiet_NaN());
               }),
               kInvalid, {"scale", "finite and >= 0", "nan"}});
  c.push_back({"ScaleInf", Sdpa([](auto& r) {
                 r.set_scale(std::numeric_limits<float>::infinity());
               }),
               kInvalid, {"scale", "finite", "inf"}});
  c.push_back({"ScaleNegative", Sdpa([](auto& r) { r.set_scale(-0.5f); }), kInvalid,
               {"scale", ">= 0", "got -0.5"}});
  // Output dtype.
  c.push_back({"OutputDTypeBool", Sdpa([](auto& r) { r.set_output_dtype(v1::BOOL); }),
               kInvalid, {"output_dtype", "got BOOL"}});
  c.push_back({"OutputDTypeUnknown",
               Sdpa([](auto& r) { r.set_output_dtype(static_cast<v1::DataType>(9)); }),
               kInvalid, {"output_dtype", "got 9"}});
  // Server limits.
  {
    Case weights{"WeightsOverLimit", Sdpa([](auto& r) { r.set_need_weights(true); }), kExhausted,
                 {"weights", "[2, 4, 5, 7]", "limit of 1000 bytes"}};
    weights.options.max_output_bytes = 1000;  // output 960 bytes fits, weights 1120 do not
    c.push_back(weights);
    Case output{"OutputOverLimit", Sdpa([](auto&) {}), kExhausted,
                {"output", "[2, 4, 5, 6]", "limit of 900 bytes"}};
    output.options.max_output_bytes = 900;
    c.push_back(output);
    Case scores{"ScoresOverLimit", Sdpa([](auto&) {}), kExhausted,
                {"attention scores", "[2, 4, 5, 7] = 280", "limit of 100",
                 "(--max-attention-scores)"}};
    scores.options.max_attention_scores = 100;
    c.push_back(scores);
    // 2*4*5*7 scores * (Dk 8 + Dv 6).
    Case macs{"MultiplyAddsOverLimit", Sdpa([](auto&) {}), kExhausted,
              {"3920 multiply-adds", "attention B*Hq*Lq*Lk*(Dk+Dv) = 3920", "projections 0",
               "limit of 1000", "(--max-multiply-adds)"}};
    macs.options.max_multiply_adds = 1000;
    c.push_back(macs);
    // demo-mha B2 L5: Q, K, V, O projections of 512 x 512 for 10 tokens each.
    Case projections{"ProjectionWorkOverLimit", Mha([](auto&) {}), kExhausted,
                     {"projections 10485760", "limit of 10000000", "(--max-multiply-adds)"},
                     true};
    projections.options.max_multiply_adds = 10000000;
    c.push_back(projections);
  }
  // The request: 1.5 MB buying 2^34 scores is refused by default.
  c.push_back({"IssueRequestOverDefaultLimits", Sdpa([](auto& r) {
                 *r.mutable_query() = MakeTensor(v1::FLOAT32, {1, 1, 131072, 1});
                 *r.mutable_key() = MakeTensor(v1::FLOAT32, {1, 1, 131072, 1});
                 *r.mutable_value() = MakeTensor(v1::FLOAT32, {1, 1, 131072, 1});
               }),
               kExhausted,
               {"[1, 1, 131072, 131072] = 17179869184 attention scores", "limit of 268435456",
                "--max-attention-scores"}});
  // Non-finite inputs (NonfiniteInputs::kReject, the default). query
  // [2, 4, 5, 8]: element [0, 1, 3, 7] is 71; key [2, 2, 7, 8]: [1, 0, 2, 5]
  // is 133; value [2, 2, 7, 6]: [1, 1, 6, 5] is 167.
  const std::string refused = "non-finite inputs are refused (--nonfinite-inputs=reject)";
  c.push_back({"QueryNaN", Sdpa([](auto& r) { SetFloat(r.mutable_query(), 71, kNaN); }),
               kInvalid, {"query.data: element [0, 1, 3, 7] is NaN; " + refused}});
  c.push_back({"QueryNegativeNaN", Sdpa([](auto& r) { SetFloat(r.mutable_query(), 71, -kNaN); }),
               kInvalid, {"query.data: element [0, 1, 3, 7] is NaN"}});
  c.push_back({"KeyPositiveInf", Sdpa([](auto& r) { SetFloat(r.mutable_key(), 133, kInf); }),
               kInvalid, {"key.data: element [1, 0, 2, 5] is +inf", refused}});
  c.push_back({"KeyNegativeInf", Sdpa([](auto& r) { SetFloat(r.mutable_key(), 133, -kInf); }),
               kInvalid, {"key.data: element [1, 0, 2, 5] is -inf", refused}});
  c.push_back({"KeyNaN", Sdpa([](auto& r) { SetFloat(r.mutable_key(), 133, kNaN); }), kInvalid,
               {"key.data: element [1, 0, 2, 5] is NaN"}});
  c.push_back({"ValueNaN", Sdpa([](auto& r) { SetFloat(r.mutable_value(), 167, kNaN); }),
               kInvalid, {"value.data: element [1, 1, 6, 5] is NaN"}});
  c.push_back({"FirstOffenderIsNamed", Sdpa([](auto& r) {
                 SetFloat(r.mutable_query(), 80, kInf);
                 SetFloat(r.mutable_query(), 71, kNaN);
               }),
               kInvalid, {"query.data: element [0, 1, 3, 7] is NaN"}});
  // fp16: exponent 0x7c00 all ones; bf16: 0x7f80.
  c.push_back({"QueryNaNFloat16",
               SdpaAs(v1::FLOAT16, [](auto& r) { SetBits<uint16_t>(r.mutable_query(), 71, 0x7e00); }),
               kInvalid, {"query.data: element [0, 1, 3, 7] is NaN", refused}});
  c.push_back({"KeyInfFloat16",
               SdpaAs(v1::FLOAT16, [](auto& r) { SetBits<uint16_t>(r.mutable_key(), 133, 0x7c00); }),
               kInvalid, {"key.data: element [1, 0, 2, 5] is +inf"}});
  c.push_back({"ValueNegativeNaNFloat16",
               SdpaAs(v1::FLOAT16, [](auto& r) { SetBits<uint16_t>(r.mutable_value(), 167, 0xfc01); }),
               kInvalid, {"value.data: element [1, 1, 6, 5] is NaN"}});
  c.push_back({"QueryNaNBFloat16",
               SdpaAs(v1::BFLOAT16, [](auto& r) { SetBits<uint16_t>(r.mutable_query(), 71, 0x7fc1); }),
               kInvalid, {"query.data: element [0, 1, 3, 7] is NaN", refused}});
  c.push_back({"KeyNegativeInfBFloat16",
               SdpaAs(v1::BFLOAT16, [](auto& r) { SetBits<uint16_t>(r.mutable_key(), 133, 0xff80); }),
               kInvalid, {"key.data: element [1, 0, 2, 5] is -inf"}});
  c.push_back({"ValueInfBFloat16",
               SdpaAs(v1::BFLOAT16, [](auto& r) { SetBits<uint16_t>(r.mutable_value(), 167, 0x7f80); }),
               kInvalid, {"value.data: element [1, 1, 6, 5] is +inf"}});
  c.push_back({"MhaQueryInf", Mha([](auto& r) { SetFloat(r.mutable_query(), 600, kInf); }),
               kInvalid, {"query.data: element [0, 1, 88] is +inf", refused}, true});
  c.push_back({"MhaValueNaN", Mha([](auto& r) { SetFloat(r.mutable_value(), 0, kNaN); }, true),
               kInvalid, {"value.data: element [0, 0, 0] is NaN"}, true});
  // Float masks: -inf is "masked" (accepted, see below); NaN and +inf are not.
  const std::string mask_rule = "a float mask may hold -inf (masked) but not NaN or +inf";
  c.push_back({"MaskNaN", Sdpa([](auto& r) {
                 *r.mutable_attn_mask() = MakeTensor(v1::FLOAT32, {5, 7});
                 SetFloat(r.mutable_attn_mask(), 0, -kInf);
                 SetFloat(r.mutable_attn_mask(), 9, kNaN);
               }),
               kInvalid, {"attn_mask.data: element [1, 2] is NaN; " + mask_rule, refused}});
  c.push_back({"MaskPositiveInf", Sdpa([](auto& r) {
                 *r.mutable_attn_mask() = MakeTensor(v1::FLOAT32, {2, 1, 5, 7});
                 SetFloat(r.mutable_attn_mask(), 40, kInf);
               }),
               kInvalid, {"attn_mask.data: element [1, 0, 0, 5] is +inf", mask_rule}});
  c.push_back({"MaskNegativeNaN", Sdpa([](auto& r) {
                 *r.mutable_attn_mask() = MakeTensor(v1::FLOAT32, {5, 7});
                 SetFloat(r.mutable_attn_mask(), 3, -kNaN);
               }),
               kInvalid, {"attn_mask.data: element [0, 3] is NaN"}});
  c.push_back({"MaskPositiveInfFloat16", Sdpa([](auto& r) {
                 *r.mutable_attn_mask() = MakeTensor(v1::FLOAT16, {5, 7});
                 SetBits<uint16_t>(r.mutable_attn_mask(), 34, 0x7c00);
               }),
               kInvalid, {"attn_mask.data: element [4, 6] is +inf", mask_rule}});
  c.push_back({"MaskNaNBFloat16", Sdpa([](auto& r) {
                 *r.mutable_attn_mask() = MakeTensor(v1::BFLOAT16, {5, 7});
                 SetBits<uint16_t>(r.mutable_attn_mask(), 34, 0xffc0);
               }),
               kInvalid, {"attn_mask.data: element [4, 6] is NaN", mask_rule}});
  // Finite inputs whose scores or sums overflow float32.
  c.push_back({"ScoresOverflowLargeValues", Sdpa([](auto& r) {
                 SetFloat(r.mutable_query(), 71, 1e30f);
                 SetFloat(r.mutable_key(), 133, -1e30f);
               }),
               kInvalid,
               {"query/key/scale: scores may overflow float32", "max|query| 1e+30",
                "max|key| 1e+30", "head_dim 8", "exceeds FLT_MAX", "--nonfinite-inputs=reject"}});
  c.push_back({"ScoresOverflowScale", Sdpa([](auto& r) {
                 SetFloat(r.mutable_query(), 0, 1.0f);
                 SetFloat(r.mutable_key(), 0, 1.0f);
                 r.set_scale(3e38f);
               }),
               kInvalid, {"query/key/scale", "max(1, scale 3e+38)", "exceeds FLT_MAX"}});
  c.push_back({"ScoresPlusMaskOverflow", Sdpa([](auto& r) {
                 SetFloat(r.mutable_query(), 0, 1e18f);
                 SetFloat(r.mutable_key(), 0, 1e18f);
                 *r.mutable_attn_mask() = MakeTensor(v1::FLOAT32, {5, 7});
                 SetFloat(r.mutable_attn_mask(), 1, 3.4e38f);
               }),
               kInvalid, {"query/key/scale", "+ max attn_mask 3.4e+38", "exceeds FLT_MAX"}});
  // Per-request window, softcap and sinks (models without projections).
  c.push_back({"WindowNegative", Sdpa([](auto& r) { r.set_window(-3); }), kInvalid,
               {"window: must be >= 0", "got -3"}});
  c.push_back({"SoftcapNaN", Sdpa([](auto& r) { r.set_softcap(kNaN); }), kInvalid,
               {"softcap: must be finite and >= 0", "nan"}});
  c.push_back({"SoftcapNegative", Sdpa([](auto& r) { r.set_softcap(-1.0f); }), kInvalid,
               {"softcap: must be finite and >= 0", "got -1"}});
  c.push_back({"SinksNotOnePerHead", Sdpa([](auto& r) {
                 for (int h = 0; h < 3; ++h) r.add_sinks(0.5f);
               }),
               kInvalid, {"sinks.shape: must be [Hq] = [4], got [3]"}});
  c.push_back({"SinksInfinite", Sdpa([](auto& r) {
                 for (int h = 0; h < 4; ++h) r.add_sinks(h == 2 ? -kInf : 0.0f);
               }),
               kInvalid, {"sinks.data: must be finite", "-inf at head 2"}});
  c.push_back({"WindowOnAProjectionModel", Mha([](auto& r) { r.set_window(16); }), kInvalid,
               {"window: per request only for models without projections",
                "model 'demo-mha' has projections"},
               /*mha=*/true});
  c.push_back({"SinksOnAProjectionModel", Mha([](auto& r) { r.add_sinks(1.0f); }), kInvalid,
               {"sinks: per request only for models without projections"}, /*mha=*/true});
  c.push_back({"PositionsWithoutRope", Mha([](auto& r) {
                 for (int i = 0; i < 10; ++i) r.add_positions(i);
               }),
               kInvalid, {"positions: model 'demo-mha' has no rotary embedding"}, /*mha=*/true});
  c.push_back({"PositionsOnSdpa", Sdpa([](auto& r) { r.add_positions(0); }), kInvalid,
               {"positions: model 'sdpa' has no rotary embedding"}});
  c.push_back({"ValueSumsOverflow", Sdpa([](auto& r) { SetFloat(r.mutable_value(), 5, 3e38f); }),
               kInvalid, {"value.data: weighted sums may overflow", "max|value| 3e+38", "Lk 7"}});
  return c;
}

class ValidationTableTest : public ::testing::TestWithParam<Case> {};

TEST_P(ValidationTableTest, RejectsWithFieldRuleAndValues) {
  const Case& c = GetParam();
  const v1::AttendRequest request = c.request();
  absl::StatusOr<ValidatedRequest> result =
      ValidateAttendRequest(request, c.mha ? MhaLayer() : SdpaLayer(), c.options);
  ASSERT_FALSE(result.ok()) << c.name;
  EXPECT_EQ(result.status().code(), c.code) << result.status();
  for (const std::string& word : c.words) {
    EXPECT_THAT(std::string(result.status().message()), HasSubstr(word));
  }
}

INSTANTIATE_TEST_SUITE_P(EveryRule, ValidationTableTest, ::testing::ValuesIn(Cases()),
                         [](const ::testing::TestParamInfo<Case>& info) { return info.param.name; });

// A front end's scan of the bytes (InputTensor::scan, made as it copied
// them) stands for validation's own pass: a scan claiming 1e30 in query
// and key (whose bytes hold zeros) gets the overflow refusal the values
// would; one read at another width than the dtype's is ignored.
TEST(ValidationTest, TheFrontEndsScanStandsForTheValuesPass) {
  const v1::AttendRequest r = ValidSdpa();  // zeros
  auto bits = [](float f) {
    int32_t b;
    std::memcpy(&b, &f, sizeof b);
    return b;
  };
  const ValueScan large{4, bits(1e30f), bits(1e30f)};
  AttendInputs in = DecodeAttendRequest(r);
  in.query.scan = large;
  in.key.scan = large;
  absl::StatusOr<ValidatedRequest> v = ValidateAttendInputs(in, SdpaLayer(), {});
  ASSERT_EQ(v.status().code(), absl::StatusCode::kInvalidArgument) << v.status();
  EXPECT_THAT(std::string(v.status().message()),
              AllOf(HasSubstr("scores may overflow float32"), HasSubstr("max|query| 1e+30")));
  // Patterns that would read as NaN at FLOAT32's width, but claimed for 16-bit values.
  in.query.scan = ValueScan{2, 0x7fc00000, 0x7fc00000};
  in.key.scan = ValueScan{2, 0x7fc00000, 0x7fc00000};
  v = ValidateAttendInputs(in, SdpaLayer(), {});
  EXPECT_TRUE(v.ok()) << v.status();
}

TEST(ValidationTest, SdpaGqaCrossAttentionDims) {
  v1::AttendRequest r = ValidSdpa();
  r.set_need_weights(true);
  r.add_key_lengths(7);
  r.add_key_lengths(0);  // a fully masked batch element is valid
  *r.mutable_attn_mask() = MakeTensor(v1::BOOL, {2, 1, 5, 7});
  absl::StatusOr<ValidatedRequest> v = ValidateAttendRequest(r, SdpaLayer());
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(v->dims.batch, 2);
  EXPECT_EQ(v->dims.num_heads, 4);
  EXPECT_EQ(v->dims.num_kv_heads, 2);
  EXPECT_EQ(v->dims.q_len, 5);
  EXPECT_EQ(v->dims.kv_len, 7);
  EXPECT_EQ(v->dims.head_dim, 8);
  EXPECT_EQ(v->dims.head_dim_v, 6);
  EXPECT_EQ(v->output_shape, (Shape{2, 4, 5, 6}));
  EXPECT_EQ(v->weights_shape, (Shape{2, 4, 5, 7}));
  EXPECT_EQ(v->output_dtype, DType::kFloat32);
  EXPECT_FLOAT_EQ(v->task.scale, 1.0f / std::sqrt(8.0f));
  EXPECT_FALSE(v->task.causal);
  EXPECT_FALSE(v->task.average_weights);
  ASSERT_EQ(v->task.key_lengths.size(), 2u);
  EXPECT_EQ(v->task.key_lengths[1], 0);
  EXPECT_EQ(v->task.attn_mask.dtype, DType::kBool);
  EXPECT_EQ(v->task.attn_mask.shape, (Shape{2, 1, 5, 7}));
  // Zero copy: the views point into the request.
  EXPECT_EQ(v->task.query.data, r.query().data().data());
  EXPECT_EQ(v->task.key.data, r.key().data().data());
  EXPECT_EQ(v->task.value.data, r.value().data().data());
  EXPECT_EQ(v->task.key_lengths.data(), r.key_lengths().data());
  // Outputs are the caller's to allocate.
  EXPECT_TRUE(v->task.output.empty());
}

TEST(ValidationTest, SdpaOptionsResolved) {
  v1::AttendRequest r = ValidSdpa();
  *r.mutable_query() = MakeTensor(v1::FLOAT16, {2, 4, 5, 8});
  *r.mutable_key() = MakeTensor(v1::FLOAT16, {2, 2, 7, 8});
  *r.mutable_value() = MakeTensor(v1::FLOAT16, {2, 2, 7, 6});
  r.set_scale(0.25f);
  r.set_causal(true);
  r.set_need_weights(true);
  r.set_average_weights(true);
  r.set_output_dtype(v1::FLOAT32);
  *r.mutable_attn_mask() = MakeTensor(v1::FLOAT32, {5, 7});  // additive, [Lq, Lk]
  absl::StatusOr<ValidatedRequest> v = ValidateAttendRequest(r, SdpaLayer());
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(v->task.query.dtype, DType::kFloat16);
  EXPECT_EQ(v->output_dtype, DType::kFloat32);
  EXPECT_FLOAT_EQ(v->task.scale, 0.25f);
  EXPECT_TRUE(v->task.causal);
  EXPECT_TRUE(v->task.average_weights);
  EXPECT_EQ(v->weights_shape, (Shape{2, 5, 7}));
}

TEST(ValidationTest, SdpaPerRequestWindowSoftcapAndSinks) {
  v1::AttendRequest r = ValidSdpa();
  r.set_window(3);
  r.set_softcap(30.0f);
  for (int h = 0; h < 4; ++h) r.add_sinks(0.25f * h);
  absl::StatusOr<ValidatedRequest> v = ValidateAttendRequest(r, SdpaLayer());
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(v->task.window, 3);
  EXPECT_FLOAT_EQ(v->task.softcap, 30.0f);
  ASSERT_EQ(v->task.sinks.size(), 4u);
  EXPECT_EQ(v->task.sinks.data(), r.sinks().data());  // not copied
  // A session request may not change a windowed model's window.
  LayerConfig windowed = SdpaLayer();
  windowed.sliding_window = 8;
  r.clear_sinks();
  r.set_session_id("s1");
  *r.mutable_query() = MakeTensor(v1::FLOAT32, {1, 4, 1, 8});
  *r.mutable_key() = MakeTensor(v1::FLOAT32, {1, 2, 1, 8});
  *r.mutable_value() = MakeTensor(v1::FLOAT32, {1, 2, 1, 6});
  absl::StatusOr<ValidatedRequest> s = ValidateAttendRequest(r, windowed);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.status().message()),
              HasSubstr("window: model 'sdpa' has sliding_window 8"));
  r.set_window(8);
  EXPECT_TRUE(ValidateAttendRequest(r, windowed).ok());
}

// Explicit rotary positions on a RoPE projection model: [B, Lk] values in
// range, Lq <= Lk, never with a session; the task points at the request's.
TEST(ValidationTest, ExplicitPositionsOnARopeModel) {
  LayerConfig rope = MhaLayer();
  rope.name = "rope-mha";
  rope.rope.type = RopeConfig::Type::kDefault;
  rope.rope.theta = 10000.0;
  rope.rope.rotary_dim = rope.head_dim;
  v1::AttendRequest r = ValidMhaCross();  // B 2, Lq 5, Lk 7
  for (int64_t i = 0; i < 14; ++i) r.add_positions(i % 7 + 100);
  absl::StatusOr<ValidatedRequest> v = ValidateAttendRequest(r, rope);
  ASSERT_TRUE(v.ok()) << v.status();
  ASSERT_EQ(v->task.positions.size(), 14u);
  EXPECT_EQ(v->task.positions.data(), r.positions().data());

  auto refused = [&](const v1::AttendRequest& bad, const std::string& words) {
    absl::StatusOr<ValidatedRequest> got = ValidateAttendRequest(bad, rope);
    EXPECT_EQ(got.status().code(), absl::StatusCode::kInvalidArgument) << words;
    EXPECT_THAT(std::string(got.status().message()), HasSubstr(words));
  };
  v1::AttendRequest short_positions = r;
  short_positions.mutable_positions()->RemoveLast();
  refused(short_positions, "positions: must hold one position per key token, [B, Lk] = [2, 7]");
  v1::AttendRequest negative = r;
  negative.set_positions(8, -1);
  refused(negative, "positions[1, 1]: must be in [0, 2147483647], got -1");
  v1::AttendRequest backwards = r;
  backwards.set_positions(10, 3);  // sequence 1: 100, 101, 102, 3
  refused(backwards, "positions[1, 3]: 3 after 102: positions must not decrease along a sequence");
  v1::AttendRequest huge = r;
  huge.set_positions(0, int64_t{1} << 40);
  refused(huge, "positions[0, 0]: must be in [0, 2147483647]");
  v1::AttendRequest more_queries = r;
  *more_queries.mutable_query() = MakeTensor(v1::FLOAT32, {2, 9, 512});
  refused(more_queries, "positions: need Lq <= Lk");
  v1::AttendRequest session = ValidMha();
  *session.mutable_query() = MakeTensor(v1::FLOAT32, {1, 2, 512});
  session.add_positions(4);
  session.add_positions(5);
  session.set_session_id("s1");
  refused(session, "positions: not supported with session_id");
}

TEST(ValidationTest, EveryAcceptedMaskShapeBroadcasts) {
  for (const std::vector<int64_t>& shape : std::vector<std::vector<int64_t>>{
           {5, 7}, {2, 1, 5, 7}, {1, 4, 5, 7}, {2, 4, 5, 7}, {1, 1, 1, 7}, {4, 5, 7}}) {
    v1::AttendRequest r = ValidSdpa();
    *r.mutable_attn_mask() = MakeTensor(v1::BOOL, shape);
    absl::StatusOr<ValidatedRequest> v = ValidateAttendRequest(r, SdpaLayer());
    EXPECT_TRUE(v.ok()) << ShapeString(shape) << ": " << v.status();
  }
}

TEST(ValidationTest, EmptyOptionalTensorsCountAsAbsent) {
  v1::AttendRequest r = ValidSdpa();
  r.mutable_attn_mask();  // present but empty, as `"attn_mask": {}` in JSON
  absl::StatusOr<ValidatedRequest> v = ValidateAttendRequest(r, SdpaLayer());
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_TRUE(v->task.attn_mask.empty());

  v1::AttendRequest mha = ValidMha();
  mha.mutable_key();
  mha.mutable_value();
  v = ValidateAttendRequest(mha, MhaLayer());
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_TRUE(v->task.key.empty());
}

TEST(ValidationTest, FloatMaskMayHoldNegativeInfinity) {
  // -inf is how SDPA users say "masked", in every float dtype; a large
  // finite negative value is fine too.
  struct MaskCase {
    v1::DataType dtype;
    std::function<void(v1::Tensor*)> set;
  };
  const MaskCase cases[] = {
      {v1::FLOAT32, [](v1::Tensor* m) { SetFloat(m, 3, -kInf); SetFloat(m, 4, -3e38f); }},
      {v1::FLOAT16, [](v1::Tensor* m) { SetBits<uint16_t>(m, 3, 0xfc00); }},
      {v1::BFLOAT16, [](v1::Tensor* m) { SetBits<uint16_t>(m, 3, 0xff80); }},
  };
  for (const MaskCase& mc : cases) {
    v1::AttendRequest r = ValidSdpa();
    *r.mutable_attn_mask() = MakeTensor(mc.dtype, {5, 7});
    mc.set(r.mutable_attn_mask());
    absl::StatusOr<ValidatedRequest> v = ValidateAttendRequest(r, SdpaLayer());
    EXPECT_TRUE(v.ok()) << v1::DataType_Name(mc.dtype) << ": " << v.status();
  }
}

TEST(ValidationTest, LargeFiniteInputsUnderTheOverflowBoundPass) {
  // 1e18 * 1e18 * 8 * max(1, 1/sqrt(8)) = 8e36 <= FLT_MAX; fp16's largest
  // value 65504 anywhere; value 3e38 with Lk = 1.
  v1::AttendRequest r = ValidSdpa();
  SetFloat(r.mutable_query(), 71, -1e18f);
  SetFloat(r.mutable_key(), 133, 1e18f);
  EXPECT_TRUE(ValidateAttendRequest(r, SdpaLayer()).ok());

  v1::AttendRequest half = ValidSdpaAs(v1::FLOAT16);
  SetBits<uint16_t>(half.mutable_query(), 0, 0x7bff);
  SetBits<uint16_t>(half.mutable_value(), 0, 0xfbff);
  EXPECT_TRUE(ValidateAttendRequest(half, SdpaLayer()).ok());

  v1::AttendRequest one_key = ValidSdpa();
  *one_key.mutable_key() = MakeTensor(v1::FLOAT32, {2, 2, 1, 8});
  *one_key.mutable_value() = MakeTensor(v1::FLOAT32, {2, 2, 1, 6});
  SetFloat(one_key.mutable_value(), 0, 3e38f);
  EXPECT_TRUE(ValidateAttendRequest(one_key, SdpaLayer()).ok());

  // Projection models without their weights' bounds: only NaN/Inf are
  // refused (ProjectionModelScoresAreBoundedByTheirWeights has the rest).
  v1::AttendRequest mha = ValidMha();
  SetFloat(mha.mutable_query(), 7, 3e38f);
  EXPECT_TRUE(ValidateAttendRequest(mha, MhaLayer()).ok());
}

TEST(ValidationTest, WeightBoundsAreTheLargestRowSumAndBias) {
  // wq [2, 3]: rows sum |w| to 6 and 7.5; bq max |b| 4; no K/V/O.
  LayerWeights w;
  w.wq = Tensor(DType::kFloat32, {2, 3});
  const float wq[] = {1, -2, 3, 0.5f, -7, 0};
  std::memcpy(w.wq.data(), wq, sizeof wq);
  w.bq = Tensor(DType::kFloat32, {2});
  const float bq[] = {-4, 2};
  std::memcpy(w.bq.data(), bq, sizeof bq);
  LayerWeightBounds b = MeasureWeightBounds(w);
  EXPECT_DOUBLE_EQ(b.q.gain, 7.5);
  EXPECT_DOUBLE_EQ(b.q.bias, 4);
  EXPECT_DOUBLE_EQ(b.q.Apply(2), 19);
  EXPECT_EQ(b.k.gain, 0);
  EXPECT_EQ(b.o.bias, 0);
  // A non-finite weight makes its bound infinite: every request refused.
  w.wq.data_as<float>()[4] = kNaN;
  w.bq.data_as<float>()[1] = kInf;
  b = MeasureWeightBounds(w);
  EXPECT_TRUE(std::isinf(b.q.gain));
  EXPECT_TRUE(std::isinf(b.q.bias));
  // The QK-norm weights' largest |w|.
  EXPECT_EQ(b.q_norm, 0);
  w.q_norm = Tensor(DType::kFloat32, {2});
  const float q_norm[] = {-2.5f, 1};
  std::memcpy(w.q_norm.data(), q_norm, sizeof q_norm);
  EXPECT_DOUBLE_EQ(MeasureWeightBounds(w).q_norm, 2.5);
}

// A QK-norm layer's scores are bounded by the norm, whatever the
// projections: an fp16 layer takes inputs whose raw projections' bound would
// overflow its scores, and refuses norm weights large enough to overflow.
TEST(ValidationTest, QkNormBoundsTheScoresWhateverTheProjections) {
  static const auto layer = MakeDemoMhaLayer();
  LayerWeightBounds bounds = MeasureWeightBounds(layer->weights);
  bounds.q_norm = bounds.k_norm = 1.5;
  auto validate = [&](const v1::AttendRequest& r, const LayerConfig& config) {
    return ValidateAttendInputs(DecodeAttendRequest(r), config, {}, &bounds);
  };
  LayerConfig half = layer->config;
  half.precision = Precision::kFloat16;
  v1::AttendRequest big = ValidMhaCross();
  SetFloat(big.mutable_query(), 0, static_cast<float>(20000.0 / bounds.q.gain));
  SetFloat(big.mutable_key(), 0, static_cast<float>(20000.0 / bounds.k.gain));
  absl::StatusOr<ValidatedRequest> v = validate(big, half);
  ASSERT_EQ(v.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(v.status().message()),
              HasSubstr("scores may overflow float16: max|projected query|"));
  LayerConfig normed = half;
  normed.qk_norm.enabled = true;
  normed.qk_norm.eps = 1e-6;
  EXPECT_TRUE(validate(big, normed).ok()) << validate(big, normed).status();
  // Norm weights of 1000: each head's query and key up to sqrt(head_dim) *
  // 1000, their products past 65504.
  bounds.q_norm = bounds.k_norm = 1000;
  v = validate(ValidMhaCross(), normed);
  ASSERT_EQ(v.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(v.status().message()),
              AllOf(HasSubstr("query/key/scale: scores may overflow float16: the QK-norm bounds "
                              "each head's query by"),
                    HasSubstr("exceeds 65504")));
}

// Relative position embeddings add each head's query and key against a
// table vector to its scores: an fp16 layer whose plain scores fit refuses
// the same input once the tables' largest value would overflow them, naming
// the embeddings; the bound is measured from the tables.
TEST(ValidationTest, RelativeEmbeddingsJoinTheScoreBound) {
  static const auto layer = MakeDemoMhaLayer();
  LayerConfig half = layer->config;
  half.precision = Precision::kFloat16;
  LayerWeightBounds bounds = MeasureWeightBounds(layer->weights);
  EXPECT_EQ(bounds.relative_key, 0);
  auto validate = [&](const v1::AttendRequest& r) {
    return ValidateAttendInputs(DecodeAttendRequest(r), half, {}, &bounds);
  };
  // Projected queries and keys of about 2: their products stay far below
  // 65504 (2 * 2 * head_dim 32).
  v1::AttendRequest r = ValidMhaCross();
  SetFloat(r.mutable_query(), 0, static_cast<float>(2.0 / bounds.q.gain));
  SetFloat(r.mutable_key(), 0, static_cast<float>(2.0 / bounds.k.gain));
  ASSERT_TRUE(validate(r).ok()) << validate(r).status();
  bounds.relative_key = 2000;  // 2 * 2000 * 32 = 128000 > 65504
  absl::StatusOr<ValidatedRequest> v = validate(r);
  ASSERT_EQ(v.status().code(), absl::StatusCode::kInvalidArgument) << v.status();
  EXPECT_THAT(std::string(v.status().message()),
              AllOf(HasSubstr("scores may overflow float16"),
                    HasSubstr("relative position embeddings' 2000")));
  bounds.relative_key = 0;
  bounds.relative_query = 2000;
  EXPECT_EQ(validate(r).status().code(), absl::StatusCode::kInvalidArgument);
  LayerWeights w = layer->weights;
  w.relative_query = Tensor(DType::kFloat32, {1, 1, 3});
  const float values[] = {0.5f, -7.0f, 3.0f};
  std::memcpy(w.relative_query.data(), values, sizeof values);
  EXPECT_DOUBLE_EQ(MeasureWeightBounds(w).relative_query, 7.0);
  EXPECT_EQ(MeasureWeightBounds(w).relative_key, 0);
}

// Projection models: the score and sum bounds of sdpa, applied to the
// projected values (gain * max|x| + bias per projection, validation.h).
TEST(ValidationTest, ProjectionModelScoresAreBoundedByTheirWeights) {
  static const auto layer = MakeDemoMhaLayer();
  const LayerWeightBounds bounds = MeasureWeightBounds(layer->weights);
  ASSERT_GT(bounds.q.gain, 0);
  ASSERT_GT(bounds.o.gain, 0);
  auto validate = [&](const v1::AttendRequest& r, const LayerConfig& config) {
    return ValidateAttendInputs(DecodeAttendRequest(r), config, {}, &bounds);
  };
  const ::testing::Matcher<const std::string&> refused =
      HasSubstr("such inputs are refused (--nonfinite-inputs=reject)");

  // Typical inputs pass.
  v1::AttendRequest ok = ValidMhaCross();
  SetFloat(ok.mutable_query(), 3, 100.0f);
  SetFloat(ok.mutable_key(), 5, -100.0f);
  EXPECT_TRUE(validate(ok, layer->config).ok()) << validate(ok, layer->config).status();

  // 3e38 in the query: its projection overflows before any score.
  v1::AttendRequest huge = ValidMha();
  SetFloat(huge.mutable_query(), 7, 3e38f);
  absl::StatusOr<ValidatedRequest> v = validate(huge, layer->config);
  ASSERT_EQ(v.status().code(), absl::StatusCode::kInvalidArgument) << v.status();
  EXPECT_THAT(std::string(v.status().message()),
              HasSubstr("query.data: its projection may overflow float32: max|query| 3e+38"));
  EXPECT_THAT(std::string(v.status().message()), refused);

  // Projected values of about 1e20 each: fine alone, but their scores
  // (1e40 * head_dim) overflow. Self-attention: key = query.
  v1::AttendRequest scores = ValidMha();
  SetFloat(scores.mutable_query(), 0, static_cast<float>(1e20 / bounds.q.gain));
  v = validate(scores, layer->config);
  ASSERT_EQ(v.status().code(), absl::StatusCode::kInvalidArgument) << v.status();
  EXPECT_THAT(std::string(v.status().message()),
              HasSubstr("query/key/scale: scores may overflow float32: max|projected query|"));
  // The same request against sdpa-style rules alone (no bounds) passed.
  EXPECT_TRUE(ValidateAttendRequest(scores, layer->config).ok());

  // Cross attention: a large value (key small) overflows the weighted sums
  // over Lk = 7 only.
  v1::AttendRequest sums = ValidMhaCross();
  const double projected_v = 1e38;  // * Lk 7 > FLT_MAX
  SetFloat(sums.mutable_value(), 11,
           static_cast<float>((projected_v - bounds.v.bias) / bounds.v.gain));
  v = validate(sums, layer->config);
  ASSERT_EQ(v.status().code(), absl::StatusCode::kInvalidArgument) << v.status();
  EXPECT_THAT(std::string(v.status().message()),
              HasSubstr("value.data: weighted sums may overflow float32"));
  // With the value norm (Gemma 3n, Gemma 4) each normalised value is at most
  // sqrt(head_dim) whatever its projection: the same sums are bounded.
  LayerConfig v_normed = layer->config;
  v_normed.v_norm_eps = 1e-6;
  EXPECT_TRUE(validate(sums, v_normed).ok()) << validate(sums, v_normed).status();

  // A float16 layer is bounded by 65504, not FLT_MAX.
  LayerConfig half = layer->config;
  half.precision = Precision::kFloat16;
  v1::AttendRequest big = ValidMhaCross();
  SetFloat(big.mutable_key(), 0, static_cast<float>(70000.0 / bounds.k.gain + 1));
  EXPECT_TRUE(validate(big, layer->config).ok());
  v = validate(big, half);
  ASSERT_EQ(v.status().code(), absl::StatusCode::kInvalidArgument) << v.status();
  EXPECT_THAT(std::string(v.status().message()),
              HasSubstr("key.data: its projection may overflow float16"));
  EXPECT_THAT(std::string(v.status().message()), HasSubstr("exceeds 65504"));
}

// Latent attention (DeepSeek): a normalised latent bounds what comes from
// it whatever the input (each feature of an RMSNorm is at most sqrt(n) *
// max|w|), the rotary key grows with the input; the latent projections are
// bounded themselves; and a key or value is refused by name.
TEST(ValidationTest, LatentAttentionBoundsAndInputs) {
  auto tensor = [](Shape shape, std::vector<float> values) {
    Tensor t(DType::kFloat32, std::move(shape));
    EXPECT_EQ(t.byte_size(), values.size() * sizeof(float));
    std::memcpy(t.data(), values.data(), t.byte_size());
    return t;
  };
  // One head: nope 1, rope 2, v 1; q_lora_rank 2, kv_lora_rank 2, inputs 2.
  LayerConfig c;
  c.name = "latent";
  c.has_projections = true;
  c.num_heads = c.num_kv_heads = 1;
  c.head_dim = 3;
  c.query_dim = c.key_dim = c.value_dim = c.out_dim = 2;
  c.latent = {true, 2, 2, 2, 1, 1e-6, 1e-6};
  LayerWeights w;
  w.wq_a = tensor({2, 2}, {1, -2, 3, 0});           // row sums 3, 3
  w.bq_a = tensor({2}, {0.5f, -1});
  w.q_a_norm = tensor({2}, {2, -0.5f});             // sqrt(2) * 2
  w.wq = tensor({3, 2}, {1, 1, 0, 2, -3, 0});       // gain 3
  w.wkv_a = tensor({4, 2}, {8, 0, 0, 1, 2, 2, -1, 4});  // 8, 1; rope rows 4, 5
  w.bkv_a = tensor({4}, {0, 0, 1, -2});
  w.kv_a_norm = tensor({2}, {1, 3});                // sqrt(2) * 3
  w.wk = tensor({1, 2}, {1, -1});                   // gain 2
  w.wv = tensor({1, 2}, {0.5f, 0.5f});              // gain 1
  w.wo = tensor({2, 1}, {1, 2});
  AttentionLayer layer{c, w, {}};
  ASSERT_TRUE(ValidateLayer(layer).ok()) << ValidateLayer(layer);
  const LayerWeightBounds b = MeasureWeightBounds(w);
  EXPECT_DOUBLE_EQ(b.q.gain, 0);
  EXPECT_DOUBLE_EQ(b.q.bias, 3 * 2 * std::sqrt(2.0));
  EXPECT_DOUBLE_EQ(b.k.gain, 5);
  EXPECT_DOUBLE_EQ(b.k.bias, 2 * 3 * std::sqrt(2.0));
  EXPECT_DOUBLE_EQ(b.v.gain, 0);
  EXPECT_DOUBLE_EQ(b.v.bias, 3 * std::sqrt(2.0));
  EXPECT_DOUBLE_EQ(b.latent.gain, 8);
  EXPECT_DOUBLE_EQ(b.latent.bias, 2);

  auto validate = [&](const v1::AttendRequest& r, const LayerConfig& config) {
    return ValidateAttendInputs(DecodeAttendRequest(r), config, {}, &b);
  };
  v1::AttendRequest ok;
  *ok.mutable_query() = MakeTensor(v1::FLOAT32, {1, 3, 2});
  SetFloat(ok.mutable_query(), 1, 1000.0f);
  EXPECT_TRUE(validate(ok, c).ok()) << validate(ok, c).status();
  // 1e4 * 8 overflows float16's latent (its rotary key, 1e4 * 5, does not),
  // not float32's.
  v1::AttendRequest big = ok;
  SetFloat(big.mutable_query(), 1, 1e4f);
  EXPECT_TRUE(validate(big, c).ok());
  LayerConfig half = c;
  half.precision = Precision::kFloat16;
  absl::StatusOr<ValidatedRequest> v = validate(big, half);
  ASSERT_EQ(v.status().code(), absl::StatusCode::kInvalidArgument) << v.status();
  EXPECT_THAT(std::string(v.status().message()),
              HasSubstr("query.data: its latent projections may overflow float16"));
  v1::AttendRequest cross = ok;
  *cross.mutable_key() = MakeTensor(v1::FLOAT32, {1, 3, 2});
  *cross.mutable_value() = MakeTensor(v1::FLOAT32, {1, 3, 2});
  v = validate(cross, c);
  ASSERT_EQ(v.status().code(), absl::StatusCode::kInvalidArgument) << v.status();
  EXPECT_THAT(std::string(v.status().message()),
              AllOf(HasSubstr("key: not accepted"), HasSubstr("latent attention")));
}

TEST(ValidationTest, DefaultLimitsAdmitTypicalRequests) {
  // sdpa B1 H16 L2048 D64 (2^26 scores, 2^33 multiply-adds) and demo-mha
  // over 4096 tokens (2^32 projection multiply-adds).
  ValidationOptions defaults;
  v1::AttendRequest r = ValidSdpa();
  *r.mutable_query() = MakeTensor(v1::BFLOAT16, {1, 16, 2048, 64});
  *r.mutable_key() = MakeTensor(v1::BFLOAT16, {1, 16, 2048, 64});
  *r.mutable_value() = MakeTensor(v1::BFLOAT16, {1, 16, 2048, 64});
  EXPECT_TRUE(ValidateAttendRequest(r, SdpaLayer(), defaults).ok());
  v1::AttendRequest mha = ValidMha();
  *mha.mutable_query() = MakeTensor(v1::FLOAT32, {1, 4096, 512});
  EXPECT_TRUE(ValidateAttendRequest(mha, MhaLayer(), defaults).ok());
}

TEST(ValidationTest, AverageWeightsWithoutNeedWeightsIsIgnored) {
  v1::AttendRequest r = ValidSdpa();
  r.set_average_weights(true);
  absl::StatusOr<ValidatedRequest> v = ValidateAttendRequest(r, SdpaLayer());
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_TRUE(v->weights_shape.empty());
  EXPECT_FALSE(v->task.average_weights);
}

TEST(ValidationTest, DemoMhaSelfAttentionDims) {
  v1::AttendRequest r = ValidMha();
  *r.mutable_query() = MakeTensor(v1::BFLOAT16, {2, 5, 512});
  r.set_need_weights(true);
  absl::StatusOr<ValidatedRequest> v = ValidateAttendRequest(r, MhaLayer());
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_TRUE(v->task.key.empty());
  EXPECT_TRUE(v->task.value.empty());
  EXPECT_EQ(v->dims.batch, 2);
  EXPECT_EQ(v->dims.q_len, 5);
  EXPECT_EQ(v->dims.kv_len, 5);
  EXPECT_EQ(v->dims.num_heads, 8);
  EXPECT_EQ(v->dims.num_kv_heads, 8);
  EXPECT_EQ(v->dims.head_dim, 64);
  EXPECT_EQ(v->dims.head_dim_v, 64);
  EXPECT_EQ(v->output_shape, (Shape{2, 5, 512}));
  EXPECT_EQ(v->weights_shape, (Shape{2, 8, 5, 5}));
  EXPECT_EQ(v->output_dtype, DType::kBFloat16);
  EXPECT_FLOAT_EQ(v->task.scale, 1.0f / 8.0f);
}

TEST(ValidationTest, DemoMhaCrossAttentionDims) {
  v1::AttendRequest r = ValidMhaCross();
  r.add_key_lengths(7);
  r.add_key_lengths(3);
  r.set_causal(true);
  absl::StatusOr<ValidatedRequest> v = ValidateAttendRequest(r, MhaLayer());
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(v->dims.kv_len, 7);
  EXPECT_EQ(v->task.key.shape, (Shape{2, 7, 512}));
  EXPECT_EQ(v->output_shape, (Shape{2, 5, 512}));
  EXPECT_TRUE(v->task.causal);
}

// A layer whose keys and values are another's (kv_source) takes them only
// from key and value: a self-attention request is refused, naming the source.
TEST(ValidationTest, KvSourceLayerNeedsKeyAndValue) {
  LayerConfig shared = MhaLayer();
  shared.kv_source = "model.layers.3.self_attn";
  v1::AttendRequest r = ValidMha();
  *r.mutable_query() = MakeTensor(v1::FLOAT32, {2, 5, 512});
  absl::StatusOr<ValidatedRequest> v = ValidateAttendRequest(r, shared);
  ASSERT_FALSE(v.ok());
  EXPECT_EQ(v.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(v.status().message()),
              AllOf(HasSubstr("key: required by model"), HasSubstr("model.layers.3.self_attn"),
                    HasSubstr("[B, Lk, 512]")));
  ASSERT_TRUE(ValidateAttendRequest(r, MhaLayer()).ok());  // its own keys: self-attention
  v = ValidateAttendRequest(ValidMhaCross(), shared);
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(v->task.key.shape, (Shape{2, 7, 512}));
}

// DSA (sparse_index_topk): a request of more keys than the indexer keeps
// is refused naming the limit; one of exactly that many passes.
TEST(ValidationTest, SparseIndexTopkBoundsTheKeys) {
  LayerConfig dsa = MhaLayer();
  dsa.sparse_index_topk = 6;
  v1::AttendRequest r = ValidMhaCross();  // 7 keys
  absl::StatusOr<ValidatedRequest> v = ValidateAttendRequest(r, dsa);
  ASSERT_FALSE(v.ok());
  EXPECT_EQ(v.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(v.status().message()),
              AllOf(HasSubstr("key: 7 keys"), HasSubstr("sparse_index_topk = 6")));
  dsa.sparse_index_topk = 7;
  EXPECT_TRUE(ValidateAttendRequest(r, dsa).ok());
}

// An sdpa model with ALiBi slopes takes requests of as many query heads as
// it has slopes: another count is refused naming it; the right one passes
// the engine's check too.
TEST(ValidationTest, AlibiSlopesFixAnSdpaModelsQueryHeads) {
  LayerConfig alibi = SdpaLayer();
  alibi.alibi_slopes = {0.5f, 0.25f, 0.125f};
  const v1::AttendRequest r = ValidSdpa();  // 4 query heads
  absl::StatusOr<ValidatedRequest> v = ValidateAttendRequest(r, alibi);
  ASSERT_FALSE(v.ok());
  EXPECT_EQ(v.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(v.status().message()),
              AllOf(HasSubstr("query.shape"), HasSubstr("ALiBi slopes for 3 query heads"),
                    HasSubstr("got 4")));
  alibi.alibi_slopes.push_back(0.0625f);
  v = ValidateAttendRequest(r, alibi);
  ASSERT_TRUE(v.ok()) << v.status();
  v1::AttendResponse response;
  v->task.output = AllocateTensor(v->output_dtype, v->output_shape, response.mutable_output());
  EXPECT_TRUE(CheckTask(alibi, v->task).ok()) << CheckTask(alibi, v->task);
  alibi.alibi_slopes.pop_back();
  EXPECT_THAT(std::string(CheckTask(alibi, v->task).message()), HasSubstr("alibi_slopes"));
}

TEST(ValidationTest, ValidatedTaskPassesTheEngineCheck) {
  // The engine re-checks tasks; a validated one with outputs bound must pass.
  for (bool mha : {false, true}) {
    v1::AttendRequest r = mha ? ValidMhaCross() : ValidSdpa();
    r.set_need_weights(true);
    const LayerConfig& layer = mha ? MhaLayer() : SdpaLayer();
    absl::StatusOr<ValidatedRequest> v = ValidateAttendRequest(r, layer);
    ASSERT_TRUE(v.ok()) << v.status();
    v1::AttendResponse response;
    v->task.output = AllocateTensor(v->output_dtype, v->output_shape, response.mutable_output());
    v->task.weights =
        AllocateTensor(v->output_dtype, v->weights_shape, response.mutable_weights());
    EXPECT_TRUE(CheckTask(layer, v->task).ok()) << CheckTask(layer, v->task);
    const TaskDims engine_dims = GetTaskDims(layer, v->task);
    EXPECT_EQ(engine_dims.kv_len, v->dims.kv_len);
    EXPECT_EQ(engine_dims.num_kv_heads, v->dims.num_kv_heads);
    EXPECT_EQ(OutputShape(layer, engine_dims), v->output_shape);
  }
}

// Random, mostly malformed requests: validation never crashes, rejects with
// InvalidArgument or ResourceExhausted only, and whatever it accepts the
// engine's own CheckTask accepts too.
TEST(ValidationTest, RandomRequestsAcceptedOnlyWhenTheEngineAgrees) {
  std::mt19937 rng(1234);
  auto pick = [&rng](int n) { return static_cast<int>(rng() % static_cast<unsigned>(n)); };
  auto dim = [&](int64_t typical) -> int64_t {
    switch (pick(12)) {
      case 0: return 0;
      case 1: return -1;
      case 2: return 1;
      default: return typical;
    }
  };
  const v1::DataType dtypes[] = {v1::FLOAT32, v1::FLOAT16, v1::BFLOAT16, v1::BOOL,
                                 v1::DATA_TYPE_UNSPECIFIED};
  auto tensor = [&](std::vector<int64_t> shape, v1::DataType dtype) {
    if (pick(10) == 0) shape.push_back(dim(2));  // wrong rank
    if (pick(10) == 0) shape.pop_back();
    if (pick(8) == 0) dtype = dtypes[pick(5)];
    v1::Tensor t;
    t.set_dtype(dtype);
    int64_t n = 1;
    for (int64_t d : shape) {
      t.add_shape(d);
      n *= std::max<int64_t>(d, 0);
    }
    const int64_t size = dtype == v1::FLOAT32 ? 4 : dtype == v1::BOOL ? 1 : 2;
    int64_t bytes = n * size;
    if (pick(10) == 0) bytes += pick(3) - 1;
    t.set_data(std::string(static_cast<size_t>(std::max<int64_t>(bytes, 0)), '\1'));
    return t;
  };
  int accepted = 0, rejected = 0;
  for (int iter = 0; iter < 3000; ++iter) {
    const bool mha = pick(2) == 0;
    const LayerConfig& layer = mha ? MhaLayer() : SdpaLayer();
    const int64_t b = dim(2), lq = dim(3), lk = dim(4), hkv = dim(2), hq = hkv * (1 + pick(2)),
                  dk = dim(4), dv = dim(3);
    const v1::DataType dtype = dtypes[pick(3)];
    v1::AttendRequest r;
    const bool with_kv = !mha || pick(2) == 0;
    if (mha) {
      *r.mutable_query() = tensor({b, lq, pick(10) == 0 ? 64 : 512}, dtype);
      if (with_kv) {
        *r.mutable_key() = tensor({b, lk, 512}, dtype);
        *r.mutable_value() = tensor({b, lk, 512}, dtype);
      }
    } else {
      *r.mutable_query() = tensor({b, hq, lq, dk}, dtype);
      *r.mutable_key() = tensor({b, hkv, lk, dk}, dtype);
      *r.mutable_value() = tensor({b, hkv, lk, dv}, dtype);
    }
    if (pick(4) == 0) r.clear_value();
    const int64_t kv_len = with_kv ? lk : lq;
    const int64_t heads = mha ? 8 : hq;
    switch (pick(5)) {
      case 0: *r.mutable_attn_mask() = tensor({lq, kv_len}, pick(2) ? v1::BOOL : v1::FLOAT32); break;
      case 1: *r.mutable_attn_mask() = tensor({b, 1, lq, kv_len}, v1::BOOL); break;
      case 2: *r.mutable_attn_mask() = tensor({1, heads, lq, kv_len}, v1::FLOAT16); break;
      default: break;
    }
    if (pick(3) == 0) {
      for (int64_t i = 0, n = b + pick(3) - 1; i < n; ++i) r.add_key_lengths(pick(static_cast<int>(kv_len) + 3) - 1);
    }
    if (pick(6) == 0) r.set_scale(pick(2) ? -1.0f : std::numeric_limits<float>::quiet_NaN());
    r.set_need_weights(pick(2) == 0);
    r.set_average_weights(pick(2) == 0);
    r.set_causal(pick(2) == 0);
    if (pick(5) == 0) r.set_output_dtype(dtypes[pick(5)]);

    absl::StatusOr<ValidatedRequest> v = ValidateAttendRequest(r, layer);
    if (!v.ok()) {
      ++rejected;
      EXPECT_TRUE(v.status().code() == absl::StatusCode::kInvalidArgument ||
                  v.status().code() == absl::StatusCode::kResourceExhausted)
          << v.status();
      continue;
    }
    ++accepted;
    v1::AttendResponse response;
    v->task.output = AllocateTensor(v->output_dtype, v->output_shape, response.mutable_output());
    if (!v->weights_shape.empty()) {
      v->task.weights =
          AllocateTensor(v->output_dtype, v->weights_shape, response.mutable_weights());
    }
    EXPECT_TRUE(CheckTask(layer, v->task).ok())
        << CheckTask(layer, v->task) << " for " << r.ShortDebugString().substr(0, 400);
  }
  EXPECT_GT(accepted, 100);
  EXPECT_GT(rejected, 100);
}

}  // namespace
}  // namespace attnserve
