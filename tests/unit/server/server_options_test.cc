// ServerOptions: range checks and the dash/underscore flag spelling.
#include "server/server_options.h"

#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace attnserve {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

TEST(ServerOptionsTest, DefaultsAreValid) {
  ServerOptions options;
  EXPECT_TRUE(CheckServerOptions(options).ok());
  EXPECT_EQ(options.address, "127.0.0.1:50051");
  EXPECT_EQ(options.metrics_address, "127.0.0.1:9464");
  EXPECT_EQ(options.default_model, "demo-mha");
  EXPECT_EQ(options.max_message_bytes, 64 << 20);
  EXPECT_EQ(options.backend, "auto");
}

TEST(ServerOptionsTest, RejectsBadValuesNamingTheFlag) {
  auto message = [](ServerOptions o) { return std::string(CheckServerOptions(o).message()); };
  ServerOptions o;
  o.address = "localhost";
  EXPECT_THAT(message(o), HasSubstr("--address"));
  o = {};
  o.address = "127.0.0.1:70000";
  EXPECT_THAT(message(o), HasSubstr("--address"));
  o = {};
  o.metrics_address = "x:y";
  EXPECT_THAT(message(o), HasSubstr("--metrics-address"));
  o = {};
  o.metrics_threads = 0;
  EXPECT_THAT(message(o), HasSubstr("--metrics-threads"));
  o = {};
  o.metrics_request_timeout = std::chrono::milliseconds(0);
  EXPECT_THAT(message(o), HasSubstr("--metrics-request-timeout"));
  o = {};
  o.malloc_trim_interval = std::chrono::milliseconds(-1);
  EXPECT_THAT(message(o), HasSubstr("--malloc-trim-interval: must be >= 0"));
  o = {};
  o.malloc_arena_max = -1;
  EXPECT_THAT(message(o), HasSubstr("--malloc-arena-max: must be in [0, 1024]"));
  o = {};
  o.malloc_mmap_threshold = int64_t{64} << 20;
  EXPECT_THAT(message(o), HasSubstr("--malloc-mmap-threshold: must be in [0, 33554432]"));
  o = {};
  o.malloc_trim_threshold = (int64_t{1} << 30) + 1;
  EXPECT_THAT(message(o), HasSubstr("--malloc-trim-threshold: must be in [0, 1073741824]"));
  o.malloc_trim_threshold = -1;
  EXPECT_THAT(message(o), HasSubstr("--malloc-trim-threshold: must be in [0, 1073741824]"));
  o = {};
  o.payload_copy_threads = -2;
  EXPECT_THAT(message(o), HasSubstr("--payload-copy-threads: must be in [-1, 64]"));
  o.payload_copy_threads = 65;
  EXPECT_THAT(message(o), HasSubstr("--payload-copy-threads: must be in [-1, 64]"));
  o = {};
  o.validation.max_attention_scores = 0;
  EXPECT_THAT(message(o), HasSubstr("--max-attention-scores"));
  o = {};
  o.backend = "tpu";
  EXPECT_THAT(message(o), HasSubstr("--backend"));
  o = {};
  o.engine_threads = -1;
  EXPECT_THAT(message(o), HasSubstr("--threads"));
  o = {};
  o.max_message_bytes = 0;
  EXPECT_THAT(message(o), HasSubstr("--max-message-bytes"));
  o = {};
  o.max_message_bytes = int64_t{1} << 40;
  EXPECT_THAT(message(o), HasSubstr("--max-message-bytes"));
  o = {};
  o.validation.max_attention_scores = 0;
  EXPECT_THAT(message(o), HasSubstr("--max-attention-scores: must be >= 1, got 0"));
  o = {};
  o.validation.max_multiply_adds = -5;
  EXPECT_THAT(message(o), HasSubstr("--max-multiply-adds: must be >= 1, got -5"));
  o = {};
  o.address = "[::1]:0";
  EXPECT_TRUE(CheckServerOptions(o).ok());
}

TEST(ServerOptionsTest, WorkLimitsAndNonfiniteDefaults) {
  ServerOptions options;
  EXPECT_EQ(options.validation.max_attention_scores, int64_t{1} << 28);
  EXPECT_EQ(options.validation.max_multiply_adds, int64_t{1} << 35);
  EXPECT_EQ(options.validation.nonfinite_inputs, NonfiniteInputs::kReject);
}

TEST(ServerOptionsTest, ParsesNonfiniteInputs) {
  absl::StatusOr<NonfiniteInputs> mode = ParseNonfiniteInputs("reject");
  ASSERT_TRUE(mode.ok()) << mode.status();
  EXPECT_EQ(*mode, NonfiniteInputs::kReject);
  mode = ParseNonfiniteInputs("propagate");
  ASSERT_FALSE(mode.ok());
  EXPECT_THAT(std::string(mode.status().message()),
              HasSubstr("--nonfinite-inputs: 'propagate' (NaN rows as PyTorch gives them) is "
                        "not implemented"));
  mode = ParseNonfiniteInputs("ignore");
  ASSERT_FALSE(mode.ok());
  EXPECT_THAT(std::string(mode.status().message()),
              HasSubstr("--nonfinite-inputs: expected reject, got 'ignore'"));
}

TEST(ServerOptionsTest, ParsesResponseCompressionLevels) {
  EXPECT_EQ(ServerOptions().grpc_response_compression, ResponseCompression::kNone);
  EXPECT_EQ(ParseResponseCompression("none").value(), ResponseCompression::kNone);
  EXPECT_EQ(ParseResponseCompression("low").value(), ResponseCompression::kLow);
  EXPECT_EQ(ParseResponseCompression("medium").value(), ResponseCompression::kMedium);
  EXPECT_EQ(ParseResponseCompression("med").value(), ResponseCompression::kMedium);  // Triton's
  EXPECT_EQ(ParseResponseCompression("high").value(), ResponseCompression::kHigh);
  absl::StatusOr<ResponseCompression> bad = ParseResponseCompression("gzip");
  ASSERT_FALSE(bad.ok());
  EXPECT_THAT(std::string(bad.status().message()),
              HasSubstr("--grpc-response-compression-level: expected none, low, medium or high, "
                        "got 'gzip'"));
}

TEST(ServerOptionsTest, NormalizesFlagNamesOnly) {
  EXPECT_THAT(NormalizeFlagNames({"attnserve", "--max-message-bytes=1", "--default-model",
                                  "demo-mha", "-metrics-address=a:1", "--", "--not-a-flag"}),
              ElementsAre("attnserve", "--max_message_bytes=1", "--default_model", "demo-mha",
                          "-metrics_address=a:1", "--", "--not-a-flag"));
  EXPECT_THAT(NormalizeFlagNames({"/path/to/attn-serve", "--address=host-name:1"}),
              ElementsAre("/path/to/attn-serve", "--address=host-name:1"));
}

TEST(ServerOptionsTest, RepeatedFlagKeepsEveryValueInOrder) {
  // As main() sees them: after NormalizeFlagNames. absl alone keeps the last.
  EXPECT_THAT(RepeatedFlagValues({"attnserve", "--load_model=a", "--threads=2", "--load_model",
                                  "b,c", "-load_model=d", "--load_modelx=e", "--", "--load_model=f"},
                                 "load_model"),
              ElementsAre("a", "b", "c", "d"));
  EXPECT_THAT(RepeatedFlagValues({"attnserve", "--load_model"}, "load_model"), ElementsAre());
}

TEST(ServerOptionsTest, ModelControlModes) {
  EXPECT_EQ(ParseModelControlMode("none").value(), ModelControlMode::kNone);
  EXPECT_EQ(ParseModelControlMode("poll").value(), ModelControlMode::kPoll);
  EXPECT_EQ(ParseModelControlMode("explicit").value(), ModelControlMode::kExplicit);
  absl::StatusOr<ModelControlMode> bad = ParseModelControlMode("POLL");
  ASSERT_FALSE(bad.ok());
  EXPECT_THAT(std::string(bad.status().message()),
              HasSubstr("--model-control-mode: \"POLL\" is not one of none, poll, explicit"));
}

}  // namespace
}  // namespace attnserve
