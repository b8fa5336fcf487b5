// The KServe REST front end's content codings. The compressed inputs are
// Python's (gzip.compress, zlib.compress, a raw zlib.compressobj stream),
// written out byte for byte, so the decoder is checked against another
// implementation than the zlib it uses; what the server compresses is
// decoded by Python in tests/kserve/test_kserve_http.py.
#include "server/transport/http_encoding.h"

#include <string>

#include "absl/status/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace attnserve {
namespace {

using ::testing::HasSubstr;

const std::string kText = "attention over gzip\n";
// gzip.compress(kText, mtime=0)
const std::string kGzip(
    "\x1f\x8b\x08\x00\x00\x00\x00\x00\x02\x03\x4b\x2c\x29\x49\xcd\x2b\xc9\xcc\xcf\x53\xc8\x2f\x4b"
    "\x2d\x52\x48\xaf\xca\x2c\xe0\x02\x00\x45\x8b\xf6\xa8\x14\x00\x00\x00",
    40);
// zlib.compress(kText): the zlib format, what "deflate" means in HTTP.
const std::string kZlib(
    "\x78\x9c\x4b\x2c\x29\x49\xcd\x2b\xc9\xcc\xcf\x53\xc8\x2f\x4b\x2d\x52\x48\xaf\xca\x2c\xe0\x02"
    "\x00\x54\x48\x07\x97",
    28);
// A raw deflate stream (zlib.compressobj(6, zlib.DEFLATED, -15)).
const std::string kRawDeflate(
    "\x4b\x2c\x29\x49\xcd\x2b\xc9\xcc\xcf\x53\xc8\x2f\x4b\x2d\x52\x48\xaf\xca\x2c\xe0\x02\x00", 22);
// gzip.compress(b"first ") + gzip.compress(b"second"): two members.
const std::string kTwoMembers(
    "\x1f\x8b\x08\x00\x00\x00\x00\x00\x02\x03\x4b\xcb\x2c\x2a\x2e\x51\x00\x00\xfc\x7a\xf1\x1c\x06"
    "\x00\x00\x00\x1f\x8b\x08\x00\x00\x00\x00\x00\x02\x03\x2b\x4e\x4d\xce\xcf\x4b\x01\x00\x69\x11"
    "\x1f\xb6\x06\x00\x00\x00",
    52);

constexpr int64_t kLimit = 1 << 20;

TEST(HttpEncodingTest, DecodesWhatPythonCompressed) {
  EXPECT_EQ(DecodeBody(ContentCoding::kGzip, kGzip, kLimit).value(), kText);
  EXPECT_EQ(DecodeBody(ContentCoding::kDeflate, kZlib, kLimit).value(), kText);
  EXPECT_EQ(DecodeBody(ContentCoding::kDeflate, kRawDeflate, kLimit).value(), kText);
  EXPECT_EQ(DecodeBody(ContentCoding::kGzip, kTwoMembers, kLimit).value(), "first second");
  EXPECT_EQ(DecodeBody(ContentCoding::kIdentity, kGzip, kLimit).value(), kGzip);
}

TEST(HttpEncodingTest, RefusesBadTruncatedAndTrailingDataNamingTheCoding) {
  absl::StatusOr<std::string> cut = DecodeBody(ContentCoding::kGzip, kGzip.substr(0, 20), kLimit);
  EXPECT_EQ(cut.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(cut.status().message(), HasSubstr("gzip data ends early"));

  std::string corrupt = kZlib;
  corrupt[5] = static_cast<char>(corrupt[5] ^ 0x40);  // the Adler-32 check fails, or the data
  absl::StatusOr<std::string> bad = DecodeBody(ContentCoding::kDeflate, corrupt, kLimit);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad.status().message(), HasSubstr("Content-Encoding: deflate"));

  absl::StatusOr<std::string> trailing =
      DecodeBody(ContentCoding::kDeflate, kZlib + "junk", kLimit);
  EXPECT_EQ(trailing.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(trailing.status().message(), HasSubstr("4 bytes after the end of the deflate data"));

  // After a gzip member only another member may follow.
  absl::StatusOr<std::string> junk = DecodeBody(ContentCoding::kGzip, kGzip + "junk", kLimit);
  EXPECT_EQ(junk.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(junk.status().message(), HasSubstr("not valid gzip data"));

  EXPECT_EQ(DecodeBody(ContentCoding::kGzip, "", kLimit).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(HttpEncodingTest, StopsAtTheLimitOfDecodedBytes) {
  EXPECT_EQ(DecodeBody(ContentCoding::kGzip, kGzip, kText.size()).value(), kText);
  absl::StatusOr<std::string> over = DecodeBody(ContentCoding::kGzip, kGzip, kText.size() - 1);
  EXPECT_EQ(over.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(over.status().message(), HasSubstr("--http-max-body-bytes"));
  // A bomb: 64 MiB of zeros in a few kilobytes stops at the limit, not after.
  const std::string zeros(64 << 20, '\0');
  const std::string bomb = EncodeBody(ContentCoding::kGzip, {zeros});
  ASSERT_LT(bomb.size(), size_t{1} << 20);
  EXPECT_EQ(DecodeBody(ContentCoding::kGzip, bomb, kLimit).status().code(),
            absl::StatusCode::kResourceExhausted);
}

TEST(HttpEncodingTest, EncodesPartsAsOneBodyInBothCodings) {
  std::string big;
  for (int i = 0; i < 200000; ++i) big += static_cast<char>((i * 7919) >> 3);
  for (ContentCoding coding : {ContentCoding::kGzip, ContentCoding::kDeflate}) {
    const std::string encoded = EncodeBody(coding, {"{\"json\":1}", "", big, "tail"});
    EXPECT_EQ(DecodeBody(coding, encoded, kLimit).value(), "{\"json\":1}" + big + "tail");
    EXPECT_EQ(DecodeBody(coding, EncodeBody(coding, {}), kLimit).value(), "");
  }
  // The gzip format's magic, and the zlib format's header, as clients expect them.
  EXPECT_EQ(EncodeBody(ContentCoding::kGzip, {"x"}).substr(0, 2), "\x1f\x8b");
  EXPECT_EQ(EncodeBody(ContentCoding::kDeflate, {"x"})[0], '\x78');
}

TEST(HttpEncodingTest, ParsesContentEncoding) {
  EXPECT_EQ(ParseContentEncoding(nullptr).value(), ContentCoding::kIdentity);
  EXPECT_EQ(ParseContentEncoding("").value(), ContentCoding::kIdentity);
  EXPECT_EQ(ParseContentEncoding("identity").value(), ContentCoding::kIdentity);
  EXPECT_EQ(ParseContentEncoding(" GZip ").value(), ContentCoding::kGzip);
  EXPECT_EQ(ParseContentEncoding("x-gzip").value(), ContentCoding::kGzip);
  EXPECT_EQ(ParseContentEncoding("deflate").value(), ContentCoding::kDeflate);
  for (const char* refused : {"br", "compress", "gzip, gzip", "deflate,gzip", "zstd"}) {
    absl::StatusOr<ContentCoding> c = ParseContentEncoding(refused);
    EXPECT_EQ(c.status().code(), absl::StatusCode::kUnimplemented) << refused;
    EXPECT_THAT(c.status().message(), HasSubstr(std::string("Content-Encoding: '") + refused));
  }
}

TEST(HttpEncodingTest, ChoosesTheAnswersCodingByQValue) {
  EXPECT_EQ(ChooseResponseCoding(nullptr), ContentCoding::kIdentity);
  EXPECT_EQ(ChooseResponseCoding("gzip"), ContentCoding::kGzip);
  EXPECT_EQ(ChooseResponseCoding("deflate"), ContentCoding::kDeflate);
  EXPECT_EQ(ChooseResponseCoding("deflate, gzip"), ContentCoding::kGzip);  // a tie: gzip
  EXPECT_EQ(ChooseResponseCoding("gzip;q=0.5, deflate"), ContentCoding::kDeflate);
  EXPECT_EQ(ChooseResponseCoding("GZIP;Q=0.9, deflate;q=0.3"), ContentCoding::kGzip);
  EXPECT_EQ(ChooseResponseCoding("gzip;q=0"), ContentCoding::kIdentity);
  EXPECT_EQ(ChooseResponseCoding("deflate;q=nope"), ContentCoding::kIdentity);
  EXPECT_EQ(ChooseResponseCoding("*"), ContentCoding::kIdentity);
  EXPECT_EQ(ChooseResponseCoding("br, identity"), ContentCoding::kIdentity);
  EXPECT_EQ(ChooseResponseCoding("br;q=1, x-gzip;q=0.1"), ContentCoding::kGzip);
}

}  // namespace
}  // namespace attnserve
