// The protobuf log handler (server/transport/protobuf_log.h): a capture
// scope takes protobuf's lines for the client's answer, and every other line
// is rate-limited, so no client can flood the server's log through protobuf.
#include "server/transport/protobuf_log.h"

#include <string>

#include "absl/strings/str_split.h"
#include "google/protobuf/stubs/logging.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace attnserve {
namespace {

using ::testing::HasSubstr;

int CountLines(const std::string& text, const std::string& word) {
  int n = 0;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    if (line.find(word) != absl::string_view::npos) ++n;
  }
  return n;
}

// One test: the limiter's state is process-wide and its interval is 10 s.
TEST(ProtobufLogTest, CapturedLinesAreNotLoggedAndOthersAreRateLimited) {
  InstallProtobufLogHandler();
  InstallProtobufLogHandler();  // idempotent

  testing::internal::CaptureStderr();
  std::string captured;
  {
    ScopedProtobufLogCapture capture;
    GOOGLE_LOG(ERROR) << "first complaint";
    GOOGLE_LOG(WARNING) << "second complaint";
    captured = capture.captured();
  }
  EXPECT_EQ(testing::internal::GetCapturedStderr(), "");
  EXPECT_EQ(captured, "first complaint; second complaint");

  // Outside a scope: 200 lines within the interval write one.
  testing::internal::CaptureStderr();
  for (int i = 0; i < 200; ++i) GOOGLE_LOG(ERROR) << "flood line " << i;
  const std::string logged = testing::internal::GetCapturedStderr();
  EXPECT_EQ(CountLines(logged, "flood line"), 1) << logged;
  EXPECT_THAT(logged, HasSubstr("flood line 0"));
}

}  // namespace
}  // namespace attnserve
