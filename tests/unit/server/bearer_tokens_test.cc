// BearerTokens: the token file's rules, the header check, and that no error
// message carries a token.
#include "server/transport/bearer_tokens.h"

#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace attnserve {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

constexpr char kAll[] = "all-0123456789abcdef";
constexpr char kSdpa[] = "sdpa-0123456789abcdef";

BearerTokens Table() {
  absl::StatusOr<BearerTokens> t = BearerTokens::Parse(
      absl::StrCat("# comment\n\n", kAll, "\n  ", kSdpa, " \tsdpa  other\n"), "tokens");
  EXPECT_TRUE(t.ok()) << t.status();
  return *std::move(t);
}

TEST(BearerTokensTest, ParsesTokensAndRestrictions) {
  BearerTokens t = Table();
  EXPECT_EQ(t.size(), 2u);
  EXPECT_THAT(t.RestrictedModels(), ::testing::ElementsAre("sdpa", "other"));
  absl::StatusOr<ModelAccess> all = t.Authenticate(absl::StrCat("Bearer ", kAll));
  ASSERT_TRUE(all.ok());
  EXPECT_FALSE(all->restricted());
  absl::StatusOr<ModelAccess> sdpa = t.Authenticate(absl::StrCat("bearer   ", kSdpa));
  ASSERT_TRUE(sdpa.ok());
  EXPECT_TRUE(sdpa->Allows("sdpa"));
  EXPECT_FALSE(sdpa->Allows("demo-mha"));
  EXPECT_EQ(sdpa->Check("demo-mha", [] { return std::string(); }).code(),
            absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(sdpa->Check("", [] { return std::string("demo-mha"); }).code(),
            absl::StatusCode::kPermissionDenied);
  EXPECT_TRUE(sdpa->Check("", [] { return std::string("sdpa"); }).ok());
}

TEST(BearerTokensTest, RefusesBadHeadersWithoutEchoingThem) {
  BearerTokens t = Table();
  const std::string all = kAll;
  for (const std::string& header :
       std::vector<std::string>{std::string(), all, "Basic " + all, "Bearer" + all, "Bearer ",
                                "Bearer " + all + "x", "Bearer " + all.substr(0, all.size() - 1),
                                "Bearer x" + all}) {
    absl::StatusOr<ModelAccess> a = t.Authenticate(header);
    ASSERT_FALSE(a.ok()) << header;
    EXPECT_EQ(a.status().code(), absl::StatusCode::kUnauthenticated);
    EXPECT_THAT(a.status().message(), Not(HasSubstr("0123456789")));
  }
}

TEST(BearerTokensTest, FileErrorsNameTheLineNotTheToken) {
  struct Case {
    std::string text;
    std::string expected;
  };
  for (const Case& c : std::vector<Case>{
           {"short-token\n", "line 1: the token has 11 characters; at least 16"},
           {"# x\nbad\"character-0123456789\n", "line 2: the token has a character outside"},
           {"dup-0123456789abcdef\ndup-0123456789abcdef\n", "line 2: the token is listed twice"},
           {"# only comments\n\n", "no token"}}) {
    absl::StatusOr<BearerTokens> t = BearerTokens::Parse(c.text, "tokens.txt");
    ASSERT_FALSE(t.ok()) << c.text;
    EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(t.status().message(), HasSubstr("tokens.txt"));
    EXPECT_THAT(t.status().message(), HasSubstr(c.expected));
    EXPECT_THAT(t.status().message(), Not(HasSubstr("0123456789")));
  }
  EXPECT_EQ(BearerTokens::FromFile("/nonexistent/tokens").status().code(),
            absl::StatusCode::kNotFound);
}

TEST(BearerTokensTest, ConstantTimeEquals) {
  EXPECT_TRUE(ConstantTimeEquals("abcdef", "abcdef"));
  EXPECT_FALSE(ConstantTimeEquals("abcdeX", "abcdef"));
  EXPECT_FALSE(ConstantTimeEquals("abc", "abcdef"));     // a prefix
  EXPECT_FALSE(ConstantTimeEquals("abcabc", "abc"));     // b repeated
  EXPECT_FALSE(ConstantTimeEquals("", "abc"));
  EXPECT_FALSE(ConstantTimeEquals("abc", ""));
  EXPECT_TRUE(ConstantTimeEquals("", ""));
}

}  // namespace
}  // namespace attnserve
