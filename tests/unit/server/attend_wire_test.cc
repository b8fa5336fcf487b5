// ParseAttendRequest against protobuf's own parse (ParseRequestMessage, the
// oracle): for random requests cut into random slices, for the encodings
// protobuf merges (repeated occurrences, unknown fields, a field of the
// wrong wire type) and for malformed bytes, the same message and the same
// error; the tensors' bytes land in the pool, and nothing on the wire makes
// the parse ask the pool for more than the wire holds.
#include "server/transport/attend_wire.h"

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "grpcpp/support/slice.h"
#include "gtest/gtest.h"
#include "server/request/value_scan.h"
#include "server/transport/attend_codec.h"
#include "server/transport/message_codec.h"
#include "server/transport/protobuf_log.h"
#include "tests/unit/server/wire_testing.h"

namespace attnserve {
namespace {

using wire_testing::Buffer;
using wire_testing::Bytes;
using wire_testing::Flatten;
using wire_testing::Pool;
using wire_testing::Tag;
using wire_testing::Varint;


struct Parsed {
  absl::Status status;
  v1::AttendRequest request;
  AttendPayloads payloads;
};

// Two helpers: tensors of 1 MiB and more are copied by several threads.
PayloadCopier& Copier() {
  static PayloadCopier* copier = new PayloadCopier(2);
  return *copier;
}

Parsed ParseWire(const std::string& wire, HostBufferPool& pool, std::vector<size_t> cuts = {}) {
  InstallProtobufLogHandler();  // protobuf's complaints become the error, as in the server
  Parsed p;
  grpc::ByteBuffer bytes = Buffer(wire, std::move(cuts));
  p.status = ParseAttendRequest(&bytes, "request", 0, pool, Copier(), &p.request, &p.payloads);
  EXPECT_EQ(bytes.Length(), 0u) << "the bytes are released after the parse";
  return p;
}

// Protobuf's own parse of the same slices (its error for a truncated message
// can depend on where the input is cut).
Parsed ParseOracle(const std::string& wire, std::vector<size_t> cuts = {}) {
  InstallProtobufLogHandler();
  Parsed p;
  grpc::ByteBuffer bytes = Buffer(wire, std::move(cuts));
  p.status = ParseRequestMessage(&bytes, "request", 0, &p.request);
  return p;
}

// The request with the payloads put back where the wire had them.
v1::AttendRequest Joined(const Parsed& p) {
  v1::AttendRequest r = p.request;
  auto put = [](const std::optional<AttendPayload>& payload, v1::Tensor* tensor) {
    if (payload.has_value()) {
      tensor->set_data(std::string(payload->bytes.data(), payload->bytes.size()));
    }
  };
  put(p.payloads.query, r.mutable_query());
  put(p.payloads.key, r.mutable_key());
  put(p.payloads.value, r.mutable_value());
  put(p.payloads.attn_mask, r.mutable_attn_mask());
  // Presence as parsed: put() must not create a field the wire did not have.
  if (!p.request.has_query()) r.clear_query();
  if (!p.request.has_key()) r.clear_key();
  if (!p.request.has_value()) r.clear_value();
  if (!p.request.has_attn_mask()) r.clear_attn_mask();
  return r;
}

// Returns what ParseAttendRequest gave.
Parsed ExpectSameAsOracle(const std::string& wire, HostBufferPool& pool,
                          std::vector<size_t> cuts = {}) {
  const Parsed oracle = ParseOracle(wire, cuts);
  Parsed got = ParseWire(wire, pool, std::move(cuts));
  EXPECT_EQ(got.status, oracle.status);
  EXPECT_EQ(Joined(got).SerializeAsString(), oracle.request.SerializeAsString());
  // The inputs the request path sees are the same, byte for byte.
  const AttendInputs a = DecodeAttendRequest(got.request, &got.payloads);
  const AttendInputs b = DecodeAttendRequest(oracle.request);
  for (auto [x, y] : {std::pair{&a.query, &b.query}, {&a.key, &b.key}, {&a.value, &b.value},
                      {&a.attn_mask, &b.attn_mask}}) {
    EXPECT_EQ(x->present, y->present);
    EXPECT_EQ(x->data, y->data);
    EXPECT_EQ(x->shape, y->shape);
  }
  return got;
}

void RandomTensor(std::mt19937& rng, v1::Tensor* t) {
  t->set_dtype(static_cast<v1::DataType>(rng() % 6));
  const int dims = static_cast<int>(rng() % 5);
  for (int d = 0; d < dims; ++d) t->add_shape(static_cast<int64_t>(rng() % 9) - 1);
  std::string data(rng() % 3 == 0 ? 0 : rng() % 70000, '\0');
  for (char& c : data) c = static_cast<char>(rng());
  t->set_data(std::move(data));
}

v1::AttendRequest RandomRequest(std::mt19937& rng) {
  v1::AttendRequest r;
  if (rng() % 2) r.set_model(rng() % 2 ? "demo-mha" : "sdpa");
  if (rng() % 2) r.set_id(std::to_string(rng()));
  if (rng() % 4) RandomTensor(rng, r.mutable_query());
  if (rng() % 2) RandomTensor(rng, r.mutable_key());
  if (rng() % 2) RandomTensor(rng, r.mutable_value());
  if (rng() % 3 == 0) RandomTensor(rng, r.mutable_attn_mask());
  if (rng() % 2) r.set_causal(true);
  for (int i = static_cast<int>(rng() % 4); i > 0; --i) r.add_key_lengths(rng() % 100);
  if (rng() % 2) r.set_scale(0.125f);
  if (rng() % 3 == 0) r.set_need_weights(true);
  if (rng() % 3 == 0) r.set_output_dtype(v1::BFLOAT16);
  if (rng() % 4 == 0) r.set_session_id("s-1");
  for (int i = static_cast<int>(rng() % 3); i > 0; --i) r.add_positions(rng() % 1000);
  if (rng() % 3 == 0) r.set_window(static_cast<int64_t>(rng() % 64));
  if (rng() % 3 == 0) r.set_softcap(30.0f);
  for (int i = static_cast<int>(rng() % 3); i > 0; --i) r.add_sinks(0.5f * static_cast<float>(i));
  return r;
}

TEST(AttendWireTest, RandomRequestsInRandomSlicesParseAsProtobufParsesThem) {
  Pool pool;
  std::mt19937 rng(20261126);
  for (int i = 0; i < 300; ++i) {
    const std::string wire = RandomRequest(rng).SerializeAsString();
    std::vector<size_t> cuts;
    for (int c = static_cast<int>(rng() % 6); c > 0; --c) cuts.push_back(rng() % (wire.size() + 1));
    std::sort(cuts.begin(), cuts.end());
    SCOPED_TRACE(i);
    const v1::AttendRequest r = ParseOracle(wire).request;
    const Parsed got = ExpectSameAsOracle(wire, *pool.pool, cuts);
    // Canonical encodings take the fast path: every non-empty data is a payload.
    EXPECT_EQ(got.payloads.query.has_value(), !r.query().data().empty());
    EXPECT_EQ(got.payloads.key.has_value(), !r.key().data().empty());
    EXPECT_EQ(got.payloads.value.has_value(), !r.value().data().empty());
    EXPECT_EQ(got.payloads.attn_mask.has_value(), !r.attn_mask().data().empty());
  }
}

TEST(AttendWireTest, TheTensorsBytesLandInThePoolAndNotInTheMessage) {
  Pool pool;
  v1::AttendRequest r;
  r.mutable_query()->set_dtype(v1::FLOAT32);
  r.mutable_query()->add_shape(2);
  r.mutable_query()->set_data(std::string(8, 'q'));
  r.mutable_attn_mask()->set_data(std::string(3, 'm'));  // data alone
  Parsed p = ParseWire(r.SerializeAsString(), *pool.pool, {5});
  ASSERT_TRUE(p.status.ok());
  ASSERT_TRUE(p.payloads.query.has_value());
  EXPECT_EQ(std::string(p.payloads.query->bytes.data(), 8), "qqqqqqqq");
  EXPECT_TRUE(pool.pool->Contains(p.payloads.query->bytes.data(), 8));
  EXPECT_TRUE(p.request.query().data().empty());
  EXPECT_EQ(p.request.query().shape_size(), 1);
  ASSERT_TRUE(p.payloads.attn_mask.has_value());
  EXPECT_TRUE(p.request.has_attn_mask()) << "a tensor of data alone stays present";
  EXPECT_FALSE(p.payloads.key.has_value());
  const AttendInputs in = DecodeAttendRequest(p.request, &p.payloads);
  EXPECT_TRUE(in.query.present);
  EXPECT_EQ(in.query.data.data(), p.payloads.query->bytes.data()) << "read in place";
  EXPECT_TRUE(in.attn_mask.present);
  EXPECT_FALSE(in.key.present);
}

// Each tensor's bytes are scanned as they are copied, at the width of the
// dtype its Tensor gave before them; the scan is the one ScanValues makes of
// the copied bytes (the oracle), and reaches the decoded inputs.
TEST(AttendWireTest, TheCopyScansTheValuesAtTheDtypeSentBeforeThem) {
  Pool pool;
  std::mt19937 rng(7);
  // 3 MiB of fp16 (in chunks across threads) and 12 bytes of fp32.
  std::string big(size_t{3} << 20, '\0');
  for (char& c : big) c = static_cast<char>(rng());
  v1::AttendRequest r;
  r.mutable_query()->set_dtype(v1::FLOAT16);
  r.mutable_query()->set_data(big);
  r.mutable_key()->set_dtype(v1::FLOAT32);
  // 1.0, NaN, -2.0
  r.mutable_key()->set_data(
      std::string("\x00\x00\x80\x3f\x00\x00\xc0\x7f\x00\x00\x00\xc0", 12));
  r.mutable_attn_mask()->set_dtype(v1::BOOL);
  r.mutable_attn_mask()->set_data(std::string(6, '\x01'));
  std::vector<size_t> cuts;
  for (size_t at = 1; at < big.size(); at += 4093 + rng() % 70000) cuts.push_back(at);
  Parsed p = ParseWire(r.SerializeAsString(), *pool.pool, cuts);
  ASSERT_TRUE(p.status.ok()) << p.status;
  ASSERT_TRUE(p.payloads.query.has_value());
  ASSERT_EQ(std::string(p.payloads.query->bytes.data(), p.payloads.query->bytes.size()), big);
  ASSERT_TRUE(p.payloads.query->scan.has_value());
  const ValueScan want = ScanValues(big.data(), static_cast<int64_t>(big.size() / 2), 2);
  EXPECT_EQ(p.payloads.query->scan->width, 2);
  EXPECT_EQ(p.payloads.query->scan->max_abs_bits, want.max_abs_bits);
  EXPECT_EQ(p.payloads.query->scan->max_positive_bits, want.max_positive_bits);
  ASSERT_TRUE(p.payloads.key->scan.has_value());
  EXPECT_EQ(p.payloads.key->scan->width, 4);
  EXPECT_EQ(p.payloads.key->scan->max_abs_bits, 0x7fc00000) << "the NaN";
  EXPECT_EQ(p.payloads.key->scan->max_positive_bits, 0x7fc00000);
  EXPECT_FALSE(p.payloads.attn_mask->scan.has_value()) << "BOOL is not scanned";
  const AttendInputs in = DecodeAttendRequest(p.request, &p.payloads);
  ASSERT_TRUE(in.query.scan.has_value());
  EXPECT_EQ(in.query.scan->max_abs_bits, want.max_abs_bits);
  EXPECT_FALSE(in.attn_mask.scan.has_value());

  // Data before its dtype: not scanned (validation reads the bytes itself).
  v1::Tensor data_first;
  data_first.set_data(std::string(4, '\x01'));
  v1::Tensor dtype_after;
  dtype_after.set_dtype(v1::FLOAT32);
  const std::string tensor = data_first.SerializeAsString() + dtype_after.SerializeAsString();
  const std::string wire =
      Tag(v1::AttendRequest::kQueryFieldNumber, 2) + Varint(tensor.size()) + tensor;
  Parsed late = ParseWire(wire, *pool.pool);
  ASSERT_TRUE(late.status.ok()) << late.status;
  ASSERT_TRUE(late.payloads.query.has_value());
  EXPECT_EQ(late.request.query().dtype(), v1::FLOAT32);
  EXPECT_FALSE(late.payloads.query->scan.has_value());
}

TEST(AttendWireTest, EncodingsProtobufMergesParseAsProtobufParsesThem) {
  Pool pool;
  v1::AttendRequest a, b;
  a.set_model("sdpa");
  a.mutable_query()->set_dtype(v1::FLOAT16);
  a.mutable_query()->add_shape(4);
  a.mutable_query()->set_data("first");
  a.mutable_key()->set_data("key-a");
  b.mutable_query()->add_shape(5);
  b.mutable_query()->set_data("second");
  b.mutable_value()->set_data("value-b");
  const std::string sa = a.SerializeAsString(), sb = b.SerializeAsString();
  std::vector<std::string> cases = {
      // Two messages back to back merge: shapes append, the last data wins.
      sa + sb,
      sb + sa,
      // A Tensor with `data` twice, and with an empty last `data`.
      Bytes(3, Bytes(3, "one") + Bytes(3, "two")),
      Bytes(3, Bytes(3, "one") + Bytes(3, "")),
      // The same tensor field twice, the second without data.
      Bytes(4, Bytes(3, "kept") + Tag(1, 0) + Varint(1)) + Bytes(4, Tag(2, 0) + Varint(7)),
      // Unknown fields of every wire type, at the top and inside a Tensor.
      Tag(99, 0) + Varint(300) + Tag(98, 1) + std::string(8, 'x') + Tag(97, 5) +
          std::string(4, 'y') + Bytes(96, "unknown") +
          Bytes(3, Tag(50, 0) + Varint(5) + Bytes(3, "q") + Bytes(51, "z")),
      // A tensor field, and Tensor.data, of the wrong wire type: unknown
      // fields to protobuf.
      Tag(3, 0) + Varint(12) + Bytes(5, Tag(3, 0) + Varint(1)),
      // Groups of unknown fields (deprecated, but valid): protobuf's to parse.
      Tag(60, 3) + Tag(1, 0) + Varint(2) + Tag(60, 4) + Bytes(3, Tag(61, 3) + Tag(61, 4)),
      Tag(7, 3) + Tag(7, 4),  // a known field (key_lengths) as a group
      // Non-canonical varints.
      Tag(6, 0) + std::string("\x81\x80\x80\x00", 4) + Bytes(3, Tag(1, 0) + "\x82\x00"),
      // Tags and lengths in more bytes than they need (protobuf reads tags in
      // at most 5 bytes, lengths in at most 5 and below 2^31).
      std::string("\x9a\x00", 2) + Varint(3) + Bytes(3, "abc"),
      std::string("\x9a\x80\x80\x80\x00", 5) + Varint(5) + Bytes(3, "abc"),
      std::string("\x9a\x80\x80\x80\x80\x00", 6) + Varint(5) + Bytes(3, "abc"),
      Tag(3, 2) + std::string("\x85\x80\x80\x80\x00", 5) + Bytes(3, "abc"),
      Tag(3, 2) + std::string("\x85\x80\x80\x80\x80\x00", 6) + Bytes(3, "abc"),
      Bytes(3, Tag(3, 2) + std::string("\x83\x80\x00", 3) + "abc"),
      Bytes(3, Tag(3, 2) + std::string("\x83\x80\x80\x80\x80\x00", 6) + "abc"),
      // A 10-byte varint with bits past 64, and one of 11 bytes.
      Tag(6, 0) + std::string(9, '\xff') + "\x7f",
      Tag(6, 0) + std::string(10, '\xff') + "\x01",
      // Wire types 6 and 7, field number 0 inside a Tensor.
      Tag(6, 6) + Varint(1),
      Bytes(3, Tag(0, 0) + Varint(1) + Bytes(3, "q")),
      // Nothing at all.
      "",
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    SCOPED_TRACE(i);
    ExpectSameAsOracle(cases[i], *pool.pool);
    ExpectSameAsOracle(cases[i], *pool.pool, {1, 2, 3, 7});
  }
}

TEST(AttendWireTest, MalformedBytesGetProtobufsOwnError) {
  Pool pool;
  v1::AttendRequest r;
  r.set_model("sdpa");
  r.mutable_query()->set_data(std::string(100, 'q'));
  const std::string good = r.SerializeAsString();
  std::vector<std::string> cases = {
      good.substr(0, good.size() - 1),                    // truncated data
      good.substr(0, 3),                                  // truncated string
      Tag(3, 2) + Varint(10) + Bytes(3, "ab"),            // a Tensor longer than its bytes
      // Data one byte past its Tensor, the bytes after it a valid field.
      Tag(3, 2) + Varint(4) + Tag(3, 2) + Varint(3) + "ab" + "c" + Tag(6, 0) + Varint(1),
      Tag(3, 2) + Varint(6) + Tag(1, 0) + Varint(1) + Tag(3, 2) + Varint(3) + "ab" + "c" +
          Tag(6, 0) + Varint(1),
      Bytes(3, Tag(3, 2) + Varint(1u << 30)),             // data claiming 1 GiB
      Tag(3, 2) + Varint(0xFFFFFFFFu) + "x",               // a length past 2^31
      Tag(0, 0) + Varint(1),                              // field number 0
      std::string("\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff", 11),  // a bad tag
      std::string("\xff\xff\xff", 3),                   // a truncated tag
      Bytes(3, Bytes(3, "q")) + "\x80",                    // a truncated tag after a tensor
      Bytes(1, "\xc3\x28"),                               // model: invalid UTF-8
      Tag(2, 2) + Varint(3) + "\xe2\x82",                 // id: invalid UTF-8, truncated
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    SCOPED_TRACE(i);
    const Parsed oracle = ParseOracle(cases[i], {2});
    const Parsed got = ParseWire(cases[i], *pool.pool, {2});
    EXPECT_FALSE(oracle.status.ok());
    EXPECT_EQ(got.status, oracle.status);
    EXPECT_EQ(got.request.ByteSizeLong(), 0u);
    EXPECT_FALSE(got.payloads.query.has_value());
  }
  EXPECT_LE(pool.largest, HostBufferPool::SizeClass(100)) << "the wire's claims were believed";
}

TEST(AttendWireTest, APoolWithoutMemoryLeavesTheBytesToProtobuf) {
  Pool pool;
  pool.fail = true;
  v1::AttendRequest r;
  r.mutable_query()->set_dtype(v1::FLOAT32);
  r.mutable_query()->set_data(std::string(64, 'q'));
  const Parsed p = ParseWire(r.SerializeAsString(), *pool.pool);
  ASSERT_TRUE(p.status.ok());
  EXPECT_FALSE(p.payloads.query.has_value());
  EXPECT_EQ(p.request.query().data(), std::string(64, 'q'));
  EXPECT_EQ(DecodeAttendRequest(p.request, &p.payloads).query.data, std::string(64, 'q'));
}

}  // namespace
}  // namespace attnserve

namespace attnserve {
namespace {

using wire_testing::Flatten;

// `n` random bytes in a buffer of `pool`.
HostBuffer RandomBuffer(std::mt19937& rng, HostBufferPool& pool, size_t n) {
  absl::StatusOr<HostBuffer> b = pool.Allocate(n);
  EXPECT_TRUE(b.ok());
  for (size_t i = 0; i < n; ++i) b->data()[i] = static_cast<char>(rng());
  return *std::move(b);
}

// A copy of `b` in `pool`; empty stays empty.
HostBuffer CopyOf(const HostBuffer& b, HostBufferPool& pool) {
  if (b.size() == 0) return HostBuffer();
  absl::StatusOr<HostBuffer> c = pool.Allocate(b.size());
  EXPECT_TRUE(c.ok());
  std::memcpy(c->data(), b.data(), b.size());
  return *std::move(c);
}

// Serialized by reference, a response is byte for byte what protobuf writes
// for it with its results' data set, unary and in a stream answer.
TEST(AttendWireTest, ResponsesSerializeAsProtobufSerializesThem) {
  Pool pool;
  std::mt19937 rng(7);
  for (int i = 0; i < 200; ++i) {
    SCOPED_TRACE(i);
    v1::AttendResponse response;
    if (rng() % 2) response.set_id(std::to_string(rng()));
    AttendResults results;
    const bool output = rng() % 4 != 0, weights = rng() % 3 == 0;
    if (output) {
      const size_t n = rng() % 3 == 0 ? 0 : 1 + rng() % 100000;
      MutableTensorView view = AllocateResult(*pool.pool, DType::kFloat16,
                                              {1, static_cast<int64_t>(n + 1) / 2},
                                              response.mutable_output(), &results.output);
      for (size_t b = 0; b < view.byte_size(); ++b) static_cast<char*>(view.data)[b] = char(rng());
    }
    if (weights) {
      results.weights = RandomBuffer(rng, *pool.pool, 4 * (1 + rng() % 5000));
      response.mutable_weights()->set_dtype(v1::FLOAT32);
      response.mutable_weights()->add_shape(static_cast<int64_t>(results.weights.size() / 4));
    }
    if (rng() % 2) response.mutable_timing()->set_compute_us(rng() % 1000);
    if (rng() % 3 == 0) response.set_session_length(rng() % 4096);
    v1::AttendResponse full = response;  // what protobuf serializes, data included
    if (output) {
      full.mutable_output()->set_data(std::string(results.output.data(), results.output.size()));
    }
    if (weights) {
      full.mutable_weights()->set_data(std::string(results.weights.data(), results.weights.size()));
    }
    const char* out_data = results.output.data();
    AttendResults for_stream;  // the same results again, for the stream answer
    for_stream.output = CopyOf(results.output, *pool.pool);
    for_stream.weights = CopyOf(results.weights, *pool.pool);
    {
      grpc::ByteBuffer bytes;
      ASSERT_TRUE(SerializeAttendResponse(response, std::move(results), &bytes).ok());
      EXPECT_EQ(Flatten(bytes), full.SerializeAsString());
      if (out_data != nullptr) {
        EXPECT_TRUE(pool.pool->Contains(out_data, 1)) << "the answer owns the output until sent";
      }
    }
    if (out_data != nullptr) {
      EXPECT_FALSE(pool.pool->Contains(out_data, 1)) << "the output is freed with the answer";
    }
    v1::AttendStreamResponse answer, full_answer;
    answer.set_id("s");
    if (rng() % 2) answer.set_code(3);
    if (rng() % 2) answer.set_message("m");
    full_answer = answer;
    *answer.mutable_response() = response;
    *full_answer.mutable_response() = full;
    grpc::ByteBuffer bytes;
    ASSERT_TRUE(SerializeAttendStreamResponse(answer, std::move(for_stream), &bytes).ok());
    EXPECT_EQ(Flatten(bytes), full_answer.SerializeAsString());
  }
}

TEST(AttendWireTest, ResultsGoToTheResponseWhenThePoolHasNoMemory) {
  Pool pool;
  pool.fail = true;
  v1::AttendResponse response;
  HostBuffer bytes;
  MutableTensorView view =
      AllocateResult(*pool.pool, DType::kFloat32, {2, 3}, response.mutable_output(), &bytes);
  EXPECT_EQ(bytes.size(), 0u);
  ASSERT_EQ(response.output().data().size(), 24u);
  EXPECT_EQ(view.data, response.output().data().data());
  EXPECT_EQ(response.output().dtype(), v1::FLOAT32);
  EXPECT_EQ(response.output().shape_size(), 2);
  std::memset(view.data, 5, 24);
  grpc::ByteBuffer serialized;
  ASSERT_TRUE(SerializeAttendResponse(response, AttendResults(), &serialized).ok());
  EXPECT_EQ(Flatten(serialized), response.SerializeAsString());
}

}  // namespace
}  // namespace attnserve
