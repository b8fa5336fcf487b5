// status_util: codes carried over unchanged, messages bounded.
#include "server/transport/status_util.h"

#include <string>

#include "gtest/gtest.h"

namespace attnserve {
namespace {

TEST(StatusUtilTest, KeepsCodeAndMessage) {
  EXPECT_TRUE(ToGrpcStatus(absl::OkStatus()).ok());
  grpc::Status s = ToGrpcStatus(absl::InvalidArgumentError("query.data: bad"));
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(s.error_message(), "query.data: bad");
  EXPECT_EQ(ToGrpcStatus(absl::NotFoundError("x")).error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(ToGrpcStatus(absl::ResourceExhaustedError("x")).error_code(),
            grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_EQ(ToGrpcStatus(absl::DeadlineExceededError("x")).error_code(),
            grpc::StatusCode::DEADLINE_EXCEEDED);
  EXPECT_EQ(ToGrpcStatus(absl::UnavailableError("x")).error_code(),
            grpc::StatusCode::UNAVAILABLE);
}

TEST(StatusUtilTest, TruncatesLongMessages) {
  grpc::Status s = ToGrpcStatus(absl::InvalidArgumentError(std::string(10000, 'x')), 100);
  EXPECT_EQ(s.error_message().size(), 100u);
  EXPECT_NE(s.error_message().find("[truncated]"), std::string::npos);
}

TEST(StatusUtilTest, DoesNotSplitUtf8) {
  // "é" is two bytes; a cut between them would leave invalid UTF-8.
  std::string message;
  for (int i = 0; i < 100; ++i) message += "\xc3\xa9";
  grpc::Status s = ToGrpcStatus(absl::InvalidArgumentError(message), 41);
  const std::string& out = s.error_message();
  const size_t kept = out.find(" ... [truncated]");
  ASSERT_NE(kept, std::string::npos);
  EXPECT_EQ(kept % 2, 0u);
}

}  // namespace
}  // namespace attnserve
