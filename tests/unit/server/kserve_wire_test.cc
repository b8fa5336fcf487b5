// Tests of the KServe v2 gRPC tensors in host buffers (kserve_wire.h).
// In: ParseModelInferRequest against protobuf's own parse
// (ParseRequestMessage, the oracle) for random requests cut into random
// slices, for the encodings protobuf merges and for malformed bytes: the
// same message, the same error and the same decoded inputs; the raw
// contents land in the pool, and nothing on the wire makes the parse ask
// the pool for more than the wire holds. Out: the answer's bytes are what
// protobuf serializes for the response with the outputs' bytes in
// raw_output_contents (the oracle), unary and streamed, whichever outputs
// went to buffers and whichever did not.
#include "server/transport/kserve_wire.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "grpcpp/support/slice.h"
#include "server/transport/kserve_codec.h"
#include "server/transport/message_codec.h"
#include "server/transport/protobuf_log.h"
#include "tests/unit/server/kserve_request_text.h"
#include "tests/unit/server/wire_testing.h"

namespace attnserve {
namespace {

using wire_testing::Buffer;
using wire_testing::Bytes;
using wire_testing::Flatten;
using wire_testing::Pool;
using wire_testing::Tag;
using wire_testing::Varint;


// ---------------------------------------------------------------- requests

struct Parsed {
  absl::Status status;
  inference::ModelInferRequest request;
  std::vector<HostBuffer> raw_inputs;
};

Parsed ParseWire(const std::string& wire, HostBufferPool& pool, std::vector<size_t> cuts = {}) {
  InstallProtobufLogHandler();  // protobuf's complaints become the error, as in the server
  Parsed p;
  grpc::ByteBuffer bytes = Buffer(wire, std::move(cuts));
  static PayloadCopier* copier = new PayloadCopier(2);  // entries of 1 MiB on: shared copies
  p.status =
      ParseModelInferRequest(&bytes, "request", 0, pool, *copier, &p.request, &p.raw_inputs);
  EXPECT_EQ(bytes.Length(), 0u) << "the bytes are released after the parse";
  return p;
}

// Protobuf's own parse of the same slices.
Parsed ParseOracle(const std::string& wire, std::vector<size_t> cuts = {}) {
  InstallProtobufLogHandler();
  Parsed p;
  grpc::ByteBuffer bytes = Buffer(wire, std::move(cuts));
  p.status = ParseRequestMessage(&bytes, "request", 0, &p.request);
  return p;
}

// Protobuf's bytes for `m`, map entries in key order.
std::string Canonical(const google::protobuf::Message& m) {
  std::string out;
  EXPECT_TRUE(kserve_testing::CanonicalBytes(m, &out));
  return out;
}

// The request with the raw contents put back.
inference::ModelInferRequest Joined(const Parsed& p) {
  inference::ModelInferRequest r = p.request;
  if (!p.raw_inputs.empty()) {
    EXPECT_EQ(r.raw_input_contents_size(), 0) << "raw contents both in buffers and the message";
  }
  for (const HostBuffer& b : p.raw_inputs) r.add_raw_input_contents(b.data(), b.size());
  return r;
}

// What the request path sees of a request, as text.
std::string Decoded(const Parsed& p) {
  return kserve_testing::DecodedText(p.request, p.raw_inputs);
}

// Returns what ParseModelInferRequest gave.
Parsed ExpectSameAsOracle(const std::string& wire, HostBufferPool& pool,
                          std::vector<size_t> cuts = {}) {
  const Parsed oracle = ParseOracle(wire, cuts);
  Parsed got = ParseWire(wire, pool, std::move(cuts));
  EXPECT_EQ(got.status, oracle.status);
  EXPECT_EQ(Canonical(Joined(got)), Canonical(oracle.request));
  if (oracle.status.ok()) {
    EXPECT_EQ(Decoded(got), Decoded(oracle));
  }
  return got;
}

void AddInput(std::mt19937& rng, const char* name, const char* datatype,
              inference::ModelInferRequest* r, bool raw) {
  auto* t = r->add_inputs();
  t->set_name(name);
  t->set_datatype(datatype);
  const int dims = 1 + static_cast<int>(rng() % 4);
  int64_t n = 1;
  for (int d = 0; d < dims; ++d) {
    const int64_t dim = 1 + static_cast<int64_t>(rng() % 6);
    t->add_shape(dim);
    n *= dim;
  }
  const size_t width = std::string(datatype) == "FP32" || std::string(datatype) == "INT32" ? 4
                       : std::string(datatype) == "INT64"                                  ? 8
                       : std::string(datatype) == "BOOL"                                   ? 1
                                                                                           : 2;
  // Now and then the wrong size, which the decode refuses.
  std::string bytes(static_cast<size_t>(n) * width + (rng() % 8 == 0 ? 1 : 0), '\0');
  for (char& c : bytes) c = static_cast<char>(rng());
  if (raw) {
    r->add_raw_input_contents(std::move(bytes));
  } else if (std::string(datatype) == "FP32") {
    for (int64_t i = 0; i < n; ++i) t->mutable_contents()->add_fp32_contents(0.5f * i);
  }
}

inference::ModelInferRequest RandomInferRequest(std::mt19937& rng) {
  inference::ModelInferRequest r;
  if (rng() % 4) r.set_model_name(rng() % 2 ? "demo-mha" : "sdpa");
  if (rng() % 3 == 0) r.set_model_version(rng() % 2 ? "1" : "2");
  if (rng() % 2) r.set_id(std::to_string(rng()));
  const bool raw = rng() % 5 != 0;  // else typed contents (fp32)
  const char* float_types[] = {"FP32", "FP16", "BF16"};
  if (rng() % 6) AddInput(rng, "query", float_types[rng() % 3], &r, raw);
  if (rng() % 2) AddInput(rng, "key", float_types[rng() % 3], &r, raw);
  if (rng() % 2) AddInput(rng, "value", float_types[rng() % 3], &r, raw);
  if (rng() % 4 == 0) AddInput(rng, "attn_mask", rng() % 2 ? "BOOL" : "FP32", &r, raw);
  if (rng() % 4 == 0) AddInput(rng, "key_lengths", rng() % 2 ? "INT32" : "INT64", &r, raw);
  if (rng() % 8 == 0) AddInput(rng, "unknown", "FP32", &r, raw);
  if (raw && rng() % 10 == 0) r.add_raw_input_contents("extra");  // one entry too many
  if (rng() % 3 == 0) (*r.mutable_parameters())["causal"].set_bool_param(true);
  if (rng() % 4 == 0) (*r.mutable_parameters())["timeout"].set_int64_param(1000);
  if (rng() % 3 == 0) r.add_outputs()->set_name(rng() % 2 ? "output" : "weights");
  return r;
}

TEST(KServeWireTest, RandomRequestsInRandomSlicesParseAsProtobufParsesThem) {
  Pool pool;
  std::mt19937 rng(5);
  for (int i = 0; i < 400; ++i) {
    SCOPED_TRACE(i);
    const std::string wire = RandomInferRequest(rng).SerializeAsString();
    std::vector<size_t> cuts;
    for (int c = static_cast<int>(rng() % 5); c > 0; --c) cuts.push_back(rng() % (wire.size() + 1));
    std::sort(cuts.begin(), cuts.end());
    ExpectSameAsOracle(wire, *pool.pool, cuts);
  }
}

TEST(KServeWireTest, TheRawContentsLandInThePoolAndNotInTheMessage) {
  Pool pool;
  std::mt19937 rng(6);
  inference::ModelInferRequest r;
  r.set_model_name("sdpa");
  AddInput(rng, "query", "FP32", &r, true);
  AddInput(rng, "key", "FP32", &r, true);
  r.add_raw_input_contents("");  // an empty entry is an entry
  r.add_inputs()->set_name("value");
  const Parsed p = ExpectSameAsOracle(r.SerializeAsString(), *pool.pool, {5, 9});
  ASSERT_TRUE(p.status.ok());
  EXPECT_EQ(p.request.raw_input_contents_size(), 0);
  ASSERT_EQ(p.raw_inputs.size(), 3u);
  EXPECT_EQ(p.raw_inputs[2].size(), 0u);
  for (int i = 0; i < 2; ++i) {
    EXPECT_EQ(std::string(p.raw_inputs[i].data(), p.raw_inputs[i].size()),
              r.raw_input_contents(i));
    EXPECT_TRUE(pool.pool->Contains(p.raw_inputs[i].data(), p.raw_inputs[i].size()));
  }
  // The decoded tensors read the pool's buffers, where the engine finds them.
  KServeRequest d;
  ASSERT_TRUE(DecodeModelInferRequest(p.request, &d, p.raw_inputs).ok());
  EXPECT_EQ(d.inputs.query.data.data(), p.raw_inputs[0].data());
  EXPECT_EQ(d.inputs.key.data.data(), p.raw_inputs[1].data());
}

TEST(KServeWireTest, EncodingsProtobufMergesParseAsProtobufParsesThem) {
  Pool pool;
  inference::ModelInferRequest a, b;
  a.set_model_name("sdpa");
  a.add_inputs()->set_name("query");
  a.add_raw_input_contents("first");
  b.set_model_name("demo-mha");
  b.add_inputs()->set_name("key");
  b.add_raw_input_contents("second");
  const std::string sa = a.SerializeAsString(), sb = b.SerializeAsString();
  constexpr uint32_t kRaw = inference::ModelInferRequest::kRawInputContentsFieldNumber;
  std::vector<std::string> cases = {
      // Two messages back to back merge: repeated fields append in order.
      sa + sb,
      sb + sa,
      // Raw contents between, before and after the other fields.
      Bytes(kRaw, "r0") + Bytes(1, "sdpa") + Bytes(kRaw, "r1") + Bytes(5, Bytes(1, "query")) +
          Bytes(kRaw, ""),
      // raw_input_contents of the wrong wire type: an unknown field to protobuf.
      Tag(kRaw, 0) + Varint(12) + Bytes(kRaw, "kept"),
      Tag(kRaw, 5) + std::string(4, 'x'),
      // Unknown fields of every wire type.
      Tag(99, 0) + Varint(300) + Tag(98, 1) + std::string(8, 'x') + Tag(97, 5) +
          std::string(4, 'y') + Bytes(96, "unknown") + Bytes(kRaw, "r"),
      // A group of unknown fields, and a known field as a group.
      Tag(60, 3) + Tag(1, 0) + Varint(2) + Tag(60, 4) + Bytes(kRaw, "r"),
      Tag(kRaw, 3) + Tag(kRaw, 4),
      // Tags and lengths in more bytes than they need.
      std::string("\xba\x00", 2) + Varint(3) + "abc",
      std::string("\xba\x80\x80\x80\x00", 5) + Varint(3) + "abc",
      std::string("\xba\x80\x80\x80\x80\x00", 6) + Varint(3) + "abc",
      Tag(kRaw, 2) + std::string("\x83\x80\x80\x80\x00", 5) + "abc",
      Tag(kRaw, 2) + std::string("\x83\x80\x80\x80\x80\x00", 6) + "abc",
      // Nothing at all.
      "",
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    SCOPED_TRACE(i);
    ExpectSameAsOracle(cases[i], *pool.pool);
    ExpectSameAsOracle(cases[i], *pool.pool, {1, 2, 3, 7});
  }
}

TEST(KServeWireTest, MalformedBytesGetProtobufsOwnError) {
  Pool pool;
  inference::ModelInferRequest r;
  r.set_model_name("sdpa");
  r.add_raw_input_contents(std::string(100, 'q'));
  const std::string good = r.SerializeAsString();
  constexpr uint32_t kRaw = inference::ModelInferRequest::kRawInputContentsFieldNumber;
  std::vector<std::string> cases = {
      good.substr(0, good.size() - 1),                 // truncated contents
      good.substr(0, 3),                               // truncated string
      Tag(kRaw, 2) + Varint(10) + "ab",                // contents longer than the bytes
      Tag(kRaw, 2) + Varint(1u << 30) + "x",           // contents claiming 1 GiB
      Tag(kRaw, 2) + Varint(0xFFFFFFFFu) + "x",        // a length past 2^31
      Bytes(kRaw, "ok") + Tag(0, 0) + Varint(1),       // field number 0
      Bytes(kRaw, "ok") + std::string("\xff\xff\xff", 3),  // a truncated tag
      Bytes(kRaw, "ok") + Bytes(1, "\xc3\x28"),       // model_name: invalid UTF-8
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    SCOPED_TRACE(i);
    const Parsed oracle = ParseOracle(cases[i], {2});
    const Parsed got = ParseWire(cases[i], *pool.pool, {2});
    EXPECT_FALSE(oracle.status.ok());
    EXPECT_EQ(got.status, oracle.status);
    EXPECT_EQ(got.request.ByteSizeLong(), 0u);
    EXPECT_TRUE(got.raw_inputs.empty());
  }
  EXPECT_LE(pool.largest, HostBufferPool::SizeClass(100)) << "the wire's claims were believed";
}

// A message of many tiny entries (3 bytes each on the wire, a few KiB each
// in buffers) is protobuf's to parse past 64 entries.
TEST(KServeWireTest, ManyRawEntriesAreLeftToProtobuf) {
  for (int entries : {64, 65, 5000}) {
    SCOPED_TRACE(entries);
    Pool pool;
    inference::ModelInferRequest r;
    r.set_model_name("sdpa");
    for (int i = 0; i < entries; ++i) r.add_raw_input_contents("x");
    const Parsed p = ExpectSameAsOracle(r.SerializeAsString(), *pool.pool);
    ASSERT_TRUE(p.status.ok());
    EXPECT_EQ(p.raw_inputs.size(), entries <= 64 ? 64u : 0u);
    EXPECT_EQ(p.request.raw_input_contents_size(), entries <= 64 ? 0 : entries);
    EXPECT_LE(pool.allocations, 64u);
  }
}

TEST(KServeWireTest, APoolWithoutMemoryLeavesTheBytesToProtobuf) {
  Pool pool;
  pool.fail = true;
  inference::ModelInferRequest r;
  r.add_inputs()->set_name("query");
  r.add_raw_input_contents(std::string(64, 'q'));
  const Parsed p = ParseWire(r.SerializeAsString(), *pool.pool);
  ASSERT_TRUE(p.status.ok());
  EXPECT_TRUE(p.raw_inputs.empty());
  EXPECT_EQ(p.request.raw_input_contents(0), std::string(64, 'q'));
}

// The decode's verdict on a request is one thing, however its parameter
// map happens to iterate: of several bad parameters, the first by name.
TEST(KServeWireTest, TheFirstBadParameterByNameIsTheOneReported) {
  const std::vector<std::string> names = {"zeta", "timeout", "alpha", "mu", "causal"};
  for (int order = 0; order < 20; ++order) {
    SCOPED_TRACE(order);
    inference::ModelInferRequest r;
    std::vector<std::string> shuffled = names;
    std::shuffle(shuffled.begin(), shuffled.end(), std::mt19937(order));
    for (const std::string& name : shuffled) {
      if (name == "timeout") {
        (*r.mutable_parameters())[name].set_int64_param(7);
      } else {
        (*r.mutable_parameters())[name].set_bool_param(true);
      }
    }
    const inference::ModelInferRequest copy = r;  // another map, another order
    const inference::ModelInferRequest* both[] = {&r, &copy};
    for (const inference::ModelInferRequest* m : both) {
      KServeRequest d;
      const absl::Status s = DecodeModelInferRequest(*m, &d);
      EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
      EXPECT_THAT(std::string(s.message()),
                  ::testing::StartsWith("parameter 'alpha' is not supported"));
    }
  }
}

// ----------------------------------------------------------------- answers

void FillRandom(std::mt19937& rng, const MutableTensorView& view) {
  for (size_t b = 0; b < view.byte_size(); ++b) static_cast<char*>(view.data)[b] = char(rng());
}

TEST(KServeWireTest, AnswersSerializeAsProtobufSerializesThemWithTheBytesInPlace) {
  Pool pool, empty;  // `empty` never has memory (and so never keeps any)
  empty.fail = true;
  std::mt19937 rng(11);
  for (int i = 0; i < 200; ++i) {
    SCOPED_TRACE(i);
    inference::ModelInferResponse response;
    if (rng() % 2) response.set_model_name("demo-mha");
    response.set_model_version("1");
    if (rng() % 2) response.set_id(std::to_string(rng()));
    if (rng() % 3 == 0) (*response.mutable_parameters())["session_length"].set_int64_param(rng() % 99);
    std::vector<HostBuffer> buffers;
    // What protobuf serializes: the same response with every output's bytes
    // in raw_output_contents.
    std::vector<std::string> expected_bytes;
    const int outputs = static_cast<int>(rng() % 3);
    for (int o = 0; o < outputs; ++o) {
      const bool no_memory = rng() % 4 == 0;  // then the response's own bytes
      const int64_t n = rng() % 4 == 0 ? 0 : 1 + rng() % 30000;
      MutableTensorView view = AllocateKServeResult(
          no_memory ? *empty.pool : *pool.pool, &response,
          o == 0 ? OutputName::kOutput : OutputName::kWeights, DType::kFloat32, {1, n}, &buffers);
      ASSERT_EQ(buffers.size(), static_cast<size_t>(o + 1)) << "one buffer per output";
      ASSERT_EQ(response.raw_output_contents_size(), o + 1);
      FillRandom(rng, view);
      const bool in_buffer = buffers.back().size() > 0;
      EXPECT_EQ(in_buffer, !no_memory && n > 0);
      EXPECT_EQ(response.raw_output_contents(o).size(), in_buffer ? 0u : view.byte_size());
      expected_bytes.emplace_back(static_cast<const char*>(view.data), view.byte_size());
    }
    inference::ModelInferResponse full = response;
    for (int o = 0; o < outputs; ++o) *full.mutable_raw_output_contents(o) = expected_bytes[o];
    EXPECT_EQ(full.outputs_size(), outputs);

    // The same buffers again for the stream answer.
    std::vector<HostBuffer> again;
    for (const HostBuffer& b : buffers) {
      if (b.size() == 0) {
        again.emplace_back();
        continue;
      }
      absl::StatusOr<HostBuffer> c = pool.pool->Allocate(b.size());
      ASSERT_TRUE(c.ok());
      std::memcpy(c->data(), b.data(), b.size());
      again.push_back(*std::move(c));
    }
    const char* first = !buffers.empty() && buffers[0].size() > 0 ? buffers[0].data() : nullptr;
    {
      grpc::ByteBuffer bytes;
      ASSERT_TRUE(SerializeModelInferResponse(response, std::move(buffers), &bytes).ok());
      const std::string flat = Flatten(bytes);
      EXPECT_EQ(flat, full.SerializeAsString());
      inference::ModelInferResponse parsed;
      ASSERT_TRUE(parsed.ParseFromString(flat));
      EXPECT_EQ(parsed.raw_output_contents_size(), outputs);
      if (first != nullptr) {
        EXPECT_TRUE(pool.pool->Contains(first, 1)) << "the answer owns the output until sent";
      }
    }
    if (first != nullptr) {
      EXPECT_FALSE(pool.pool->Contains(first, 1)) << "the output is freed with the answer";
    }

    inference::ModelStreamInferResponse answer, full_answer;
    if (rng() % 4 == 0) answer.set_error_message("e");
    full_answer = answer;
    *answer.mutable_infer_response() = response;
    *full_answer.mutable_infer_response() = full;
    grpc::ByteBuffer bytes;
    ASSERT_TRUE(SerializeModelStreamInferResponse(answer, std::move(again), &bytes).ok());
    EXPECT_EQ(Flatten(bytes), full_answer.SerializeAsString());
  }
}

TEST(KServeWireTest, WithoutBuffersTheAnswerIsTheResponsesOwnSerialization) {
  inference::ModelInferResponse response;
  response.set_model_name("m");
  MutableTensorView view = AllocateKServeOutput(&response, OutputName::kOutput, DType::kFloat16,
                                                {2, 3});
  std::memset(view.data, 7, view.byte_size());
  grpc::ByteBuffer bytes;
  ASSERT_TRUE(SerializeModelInferResponse(response, {}, &bytes).ok());
  EXPECT_EQ(Flatten(bytes), response.SerializeAsString());
  EXPECT_EQ(response.raw_output_contents(0).size(), 12u);
}

// KeepRequestedOutputs says which entries it removed, so that the buffers
// kept in step with raw_output_contents can follow.
TEST(KServeWireTest, KeepRequestedOutputsNamesWhatItRemoved) {
  Pool pool;
  inference::ModelInferResponse response;
  std::vector<HostBuffer> buffers;
  AllocateKServeResult(*pool.pool, &response, OutputName::kOutput, DType::kFloat32, {4},
                       &buffers);
  MutableTensorView weights = AllocateKServeResult(*pool.pool, &response, OutputName::kWeights,
                                                   DType::kFloat32, {2}, &buffers);
  std::memset(weights.data, 1, weights.byte_size());
  KServeRequest decoded;
  decoded.return_output = false;
  decoded.return_weights = true;
  EXPECT_EQ(KeepRequestedOutputs(decoded, &response), std::vector<int>{0});
  ASSERT_EQ(response.outputs_size(), 1);
  EXPECT_EQ(response.outputs(0).name(), "weights");
  EXPECT_EQ(response.raw_output_contents_size(), 1);
}

}  // namespace
}  // namespace attnserve
