// DecodeJsonInferRequest and EncodeJsonInferResponse: JSON values into the
// exact little-endian bytes the gRPC form carries (the oracle: the values
// written with memcpy here), nested and flat data, data before its
// datatype, the binary split, and each refusal naming its field.
#include "server/transport/kserve_json.h"

#include <cstring>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace attnserve {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

template <typename T>
std::string Bytes(std::vector<T> values) {
  std::string out(values.size() * sizeof(T), '\0');
  std::memcpy(out.data(), values.data(), out.size());
  return out;
}

absl::Status Decode(std::string body, JsonInferRequest* out, int64_t header_length = -1) {
  return DecodeJsonInferRequest(&body, header_length, "sdpa", "1", out);
}

TEST(KServeJsonTest, JsonValuesBecomeTheRawBytesOfEachInput) {
  JsonInferRequest r;
  ASSERT_TRUE(Decode(R"({"id": "a", "parameters": {"causal": true, "scale": 0.5, "window": 3,
      "session_id": "s", "binary_data_output": true},
    "inputs": [
      {"name": "query", "shape": [1, 2, 2], "datatype": "FP32", "data": [[[1.5, -2], [3, 4e-3]]]},
      {"data": [7, 9], "name": "key_lengths", "shape": [2], "datatype": "INT64"},
      {"name": "attn_mask", "shape": [3], "datatype": "BOOL", "data": [true, false, true]},
      {"name": "positions", "shape": [1, 2], "datatype": "INT32", "data": [0, 2147483647]}],
    "outputs": [{"name": "weights", "parameters": {"binary_data": false}}]})",
                     &r)
                  .ok());
  const inference::ModelInferRequest& m = r.request;
  EXPECT_EQ(m.model_name(), "sdpa");
  EXPECT_EQ(m.model_version(), "1");
  EXPECT_EQ(m.id(), "a");
  EXPECT_TRUE(m.parameters().at("causal").bool_param());
  EXPECT_DOUBLE_EQ(m.parameters().at("scale").double_param(), 0.5);
  EXPECT_EQ(m.parameters().at("window").int64_param(), 3);
  EXPECT_EQ(m.parameters().at("session_id").string_param(), "s");
  EXPECT_EQ(m.parameters().count("binary_data_output"), 0u);  // HTTP's own
  ASSERT_EQ(m.inputs_size(), 4);
  ASSERT_EQ(m.raw_input_contents_size(), 4);
  EXPECT_EQ(m.raw_input_contents(0), Bytes<float>({1.5f, -2.0f, 3.0f, 4e-3f}));
  EXPECT_EQ(m.raw_input_contents(1), Bytes<int64_t>({7, 9}));  // data before datatype
  EXPECT_EQ(m.raw_input_contents(2), std::string("\1\0\1", 3));
  EXPECT_EQ(m.raw_input_contents(3), Bytes<int32_t>({0, 2147483647}));
  EXPECT_EQ(m.inputs(0).shape_size(), 3);
  EXPECT_TRUE(r.binary_by_default);
  ASSERT_EQ(m.outputs_size(), 1);
  EXPECT_FALSE(r.binary_output.at("weights"));
}

TEST(KServeJsonTest, BinaryDataFollowsTheHeaderInInputOrder) {
  const std::string header =
      R"({"inputs": [{"name": "query", "shape": [2], "datatype": "FP16",
                      "parameters": {"binary_data_size": 4}},
                     {"name": "key", "shape": [1], "datatype": "FP32", "data": [2]},
                     {"name": "value", "shape": [1], "datatype": "BF16",
                      "parameters": {"binary_data_size": 2}}]})";
  JsonInferRequest r;
  const absl::Status s =
      Decode(header + std::string("\x00\x3c\x00\x40\x80\x3f", 6), &r, header.size());
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ(r.request.raw_input_contents(0), std::string("\x00\x3c\x00\x40", 4));
  EXPECT_EQ(r.request.raw_input_contents(1), Bytes<float>({2.0f}));
  EXPECT_EQ(r.request.raw_input_contents(2), std::string("\x80\x3f", 2));
}

TEST(KServeJsonTest, SharedMemoryParametersReachTheRequestWithoutBytes) {
  const std::string header =
      R"({"inputs": [{"name": "query", "shape": [2], "datatype": "FP32",
                      "parameters": {"shared_memory_region": "in", "shared_memory_byte_size": 8,
                                     "shared_memory_offset": 16}},
                     {"name": "key", "shape": [1], "datatype": "FP32", "data": [2]}],
          "outputs": [{"name": "output",
                       "parameters": {"binary_data": true, "shared_memory_region": "out",
                                      "shared_memory_byte_size": 64}}]})";
  JsonInferRequest r;
  const absl::Status s = Decode(header, &r, -1);
  ASSERT_TRUE(s.ok()) << s;
  // Only the input in the message has a raw entry (as in Triton's gRPC form).
  ASSERT_EQ(r.request.raw_input_contents_size(), 1);
  EXPECT_EQ(r.request.raw_input_contents(0), Bytes<float>({2.0f}));
  const auto& in = r.request.inputs(0).parameters();
  EXPECT_EQ(in.at("shared_memory_region").string_param(), "in");
  EXPECT_EQ(in.at("shared_memory_byte_size").int64_param(), 8);
  EXPECT_EQ(in.at("shared_memory_offset").int64_param(), 16);
  EXPECT_TRUE(r.request.inputs(1).parameters().empty());
  const auto& out = r.request.outputs(0).parameters();
  EXPECT_EQ(out.size(), 2u);  // binary_data is the HTTP front end's own
  EXPECT_EQ(out.at("shared_memory_region").string_param(), "out");

  // The answer names the region and carries neither data nor binary bytes.
  inference::ModelInferResponse response;
  response.set_model_name("sdpa");
  auto* o = response.add_outputs();
  o->set_name("output");
  o->set_datatype("FP32");
  o->add_shape(2);
  (*o->mutable_parameters())["shared_memory_region"].set_string_param("out");
  (*o->mutable_parameters())["shared_memory_byte_size"].set_int64_param(8);
  response.add_raw_output_contents();
  std::vector<absl::string_view> binary;
  const std::string json = EncodeJsonInferResponse(response, r, &binary);
  EXPECT_TRUE(binary.empty());
  EXPECT_THAT(json, HasSubstr(R"("parameters":{"shared_memory_region":"out",)"
                              R"("shared_memory_byte_size":8})"));
  EXPECT_THAT(json, Not(HasSubstr(R"("data")")));
  EXPECT_THAT(json, Not(HasSubstr("binary_data_size")));
}

TEST(KServeJsonTest, RefusalsNameTheFieldAndTheRule) {
  const struct {
    std::string body;
    int64_t header_length;
    std::string words;
  } cases[] = {
      {R"({"inputs": [)", -1, "malformed JSON at offset"},
      {R"({"model": "x"})", -1, "\"model\" is not a field of an infer request"},
      {R"({"inputs": [{"name": "q", "colour": 1}]})", -1, "input 'q': \"colour\" is not a field"},
      {R"({"inputs": [{"name": "q", "shape": [2], "datatype": "FP32", "data": [1]}]})", -1,
       "input 'q': shape holds 2 elements, \"data\" has 1"},
      {R"({"inputs": [{"name": "q", "shape": [1], "datatype": "FP16", "data": [1]}]})", -1,
       "FP16 data must be sent as binary data"},
      {R"({"inputs": [{"name": "q", "shape": [1], "datatype": "INT64", "data": [1.5]}]})", -1,
       "data must hold integers for INT64"},
      {R"({"inputs": [{"name": "q", "shape": [1], "datatype": "INT32", "data": [3000000000]}]})",
       -1, "does not fit INT32"},
      {R"({"inputs": [{"name": "q", "shape": [1], "datatype": "FP32", "data": [1e300]}]})", -1,
       "beyond FP32's range"},
      {R"({"inputs": [{"name": "q", "shape": [1], "datatype": "FP32"}]})", -1,
       "input 'q': no values"},
      {R"({"inputs": [{"name": "q", "shape": [1], "datatype": "FP32",
           "parameters": {"binary_data_size": 8}}]})",
       -2, "runs past the binary data"},
      {R"({"inputs": [{"name": "q", "shape": [1], "datatype": "FP32",
           "parameters": {"classification": 3}}]})",
       -1, "input 'q': parameter 'classification' is not supported"},
      {R"({"inputs": [{"name": "q", "shape": [1], "datatype": "FP32", "data": [1],
           "parameters": {"shared_memory_region": "r", "shared_memory_byte_size": 4}}]})",
       -1, "input 'q': both \"data\" and shared memory parameters are given"},

      {R"({"inputs": []})", 100, "Inference-Header-Content-Length: 100 is more than"},
      {std::string(50, '[') + std::string(50, ']'), -1, "must be a JSON object"},
      {R"({"inputs": [{"name": "q", "data": )" + std::string(50, '['), -1, "nested deeper than"},
      {R"({"outputs": [{"name": "output", "parameters": {"classification": 3}}]})", -1,
       "outputs: parameter 'classification' is not supported"},
  };
  for (const auto& c : cases) {
    JsonInferRequest r;
    std::string body = c.body;
    int64_t header_length = c.header_length;
    if (header_length == -2) {  // the whole JSON as header, 4 binary bytes after it
      header_length = static_cast<int64_t>(body.size());
      body += std::string(4, '\0');
    }
    const absl::Status s = DecodeJsonInferRequest(&body, header_length, "sdpa", "", &r);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << c.body;
    EXPECT_THAT(std::string(s.message()), HasSubstr(c.words)) << c.body;
  }
}

TEST(KServeJsonTest, IndexRequestsSayWhetherOnlyReadyModels) {
  for (const auto& [body, ready] : {std::pair<std::string, bool>{"", false},
                                    {"{}", false},
                                    {R"({"ready": true})", true},
                                    {R"( {"ready": false} )", false}}) {
    std::string text = body;
    absl::StatusOr<bool> got = DecodeIndexRequest(&text);
    ASSERT_TRUE(got.ok()) << body << ": " << got.status();
    EXPECT_EQ(*got, ready) << body;
  }
  for (std::string bad : {R"({"ready": "yes"})", R"({"colour": true})", "[true]", "{"}) {
    EXPECT_EQ(DecodeIndexRequest(&bad).status().code(), absl::StatusCode::kInvalidArgument) << bad;
  }
}

TEST(KServeJsonTest, ModelLoadAndUnloadBodies) {
  // What tritonclient.http sends: load {} (or config/file parameters),
  // unload {"parameters": {"unload_dependents": false}}.
  for (std::string ok : {"", " ", "{}", R"({"parameters": {}})"}) {
    EXPECT_TRUE(DecodeModelRepositoryRequest(&ok, /*unload=*/false).ok()) << ok;
  }
  for (std::string ok : {R"({"parameters": {"unload_dependents": false}})",
                         R"({"parameters": {"unload_dependents": true}})", "{}"}) {
    EXPECT_TRUE(DecodeModelRepositoryRequest(&ok, /*unload=*/true).ok()) << ok;
  }
  struct Bad {
    std::string body;
    bool unload;
    const char* message;
  };
  for (Bad bad : {Bad{R"({"parameters": {"config": "{}"}})", false, "\"config\" is not supported"},
                  Bad{R"({"parameters": {"unload_dependents": true}})", false,
                      "\"unload_dependents\" is not supported"},
                  Bad{R"({"parameters": {"unload_dependents": 1}})", true, "must be a bool"},
                  Bad{R"({"parameters": {"file:1/x": "AA=="}})", true, "only \"unload_dependents\""},
                  Bad{R"({"colour": 1})", false, "unknown field \"colour\""},
                  Bad{R"({"parameters": []})", false, "must be a JSON object"},
                  Bad{"[1]", true, "must be a JSON object"},
                  Bad{"{", false, "malformed JSON"}}) {
    absl::Status s = DecodeModelRepositoryRequest(&bad.body, bad.unload);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << bad.body;
    EXPECT_THAT(std::string(s.message()), ::testing::HasSubstr(bad.message)) << bad.body;
  }
}

TEST(KServeJsonTest, AnswersCarryJsonOrBinaryOutputsAsAsked) {
  inference::ModelInferResponse response;
  response.set_model_name("sdpa");
  response.set_model_version("1");
  response.set_id("r");
  (*response.mutable_parameters())["session_length"].set_int64_param(5);
  auto add = [&](const char* name, const char* datatype, const std::string& raw) {
    auto* o = response.add_outputs();
    o->set_name(name);
    o->set_datatype(datatype);
    o->add_shape(static_cast<int64_t>(raw.size() / (std::string(datatype) == "FP32" ? 4 : 2)));
    *response.add_raw_output_contents() = raw;
  };
  add("output", "FP32", Bytes<float>({0.5f, -1.0f}));
  add("weights", "FP16", std::string("\x00\x3c", 2));
  JsonInferRequest request;
  std::vector<absl::string_view> binary;
  const std::string json = EncodeJsonInferResponse(response, request, &binary);
  EXPECT_THAT(json, HasSubstr(R"("model_name":"sdpa","model_version":"1","id":"r")"));
  EXPECT_THAT(json, HasSubstr(R"("parameters":{"session_length":5})"));
  EXPECT_THAT(json,
              HasSubstr(R"({"name":"output","datatype":"FP32","shape":[2],"data":[0.5,-1.0]})"));
  // FP16 is binary whatever was asked: JSON has no such numbers.
  EXPECT_THAT(json, HasSubstr(R"("parameters":{"binary_data_size":2})"));
  ASSERT_EQ(binary.size(), 1u);
  EXPECT_EQ(binary[0], std::string("\x00\x3c", 2));
  // Views of the response's own bytes: nothing copied.
  EXPECT_EQ(binary[0].data(), response.raw_output_contents(1).data());
  request.binary_by_default = true;
  EncodeJsonInferResponse(response, request, &binary);
  ASSERT_EQ(binary.size(), 2u);
  EXPECT_EQ(std::string(binary[0]) + std::string(binary[1]),
            Bytes<float>({0.5f, -1.0f}) + std::string("\x00\x3c", 2));
  EXPECT_EQ(ErrorJson("a \"quoted\" word"), R"({"error":"a \"quoted\" word"})");
}

}  // namespace
}  // namespace attnserve
