// Tests of the KServe v2 gRPC results in host buffers (kserve_wire.h): the
// answer's bytes are what protobuf serializes for the response with the
// outputs' bytes in raw_output_contents (the oracle), unary and streamed,
// whichever outputs went to buffers and whichever did not.
#include "server/transport/kserve_wire.h"

#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "gtest/gtest.h"
#include "grpcpp/support/slice.h"
#include "server/transport/kserve_codec.h"

namespace attnserve {
namespace {

// Ordinary memory, or none at all (`fail`).
struct Pool {
  bool fail = false;
  std::shared_ptr<HostBufferPool> pool = std::make_shared<HostBufferPool>(
      HostBufferPool::Backing{
          [this](size_t n) -> void* { return fail ? nullptr : std::aligned_alloc(64, n); },
          [](void* p, size_t) { std::free(p); }},
      1 << 20, 1 << 20);
};

std::string Flatten(const grpc::ByteBuffer& bytes) {
  std::vector<grpc::Slice> slices;
  EXPECT_TRUE(bytes.Dump(&slices).ok());
  std::string flat;
  for (const grpc::Slice& s : slices) flat.append(reinterpret_cast<const char*>(s.begin()), s.size());
  return flat;
}

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
