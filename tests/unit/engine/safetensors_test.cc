// SafetensorsFile on files this test writes: good ones in every loadable
// dtype, and each way a file can be truncated, corrupt or lie about itself.
#include "engine/model/safetensors.h"

#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace attnserve {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

std::string LengthPrefix(uint64_t n) {
  std::string out(8, '\0');
  std::memcpy(out.data(), &n, 8);
  return out;
}

// A file from a raw JSON header and a data section.
std::string RawFile(const std::string& header, const std::string& data) {
  return LengthPrefix(header.size()) + header + data;
}

std::string FloatBytes(const std::vector<float>& v) {
  std::string out(v.size() * 4, '\0');
  std::memcpy(out.data(), v.data(), out.size());
  return out;
}

std::string U16Bytes(const std::vector<uint16_t>& v) {
  std::string out(v.size() * 2, '\0');
  std::memcpy(out.data(), v.data(), out.size());
  return out;
}

std::string Write(const std::string& bytes) {
  char tmpl[] = "/tmp/safetensors_test_XXXXXX";
  int fd = ::mkstemp(tmpl);
  EXPECT_GE(fd, 0);
  ::close(fd);
  std::ofstream(tmpl, std::ios::binary).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  return tmpl;
}

// Two tensors and metadata, as torch/safetensors would write them.
std::string GoodFile() {
  std::string a = FloatBytes({1.0f, -2.5f, 3.25f, 0.0f, 1e-3f, 7.0f});  // [2, 3] F32
  std::string b = U16Bytes({0x3C00, 0xC000});                            // [2] F16: 1, -2
  std::string c = U16Bytes({0x3F80, 0x4040, 0xBF00});                    // [3] BF16: 1, 3, -0.5
  std::string header =
      R"({"__metadata__":{"format":"pt"},)"
      R"("a":{"dtype":"F32","shape":[2,3],"data_offsets":[0,24]},)"
      R"("b":{"dtype":"F16","shape":[2],"data_offsets":[24,28]},)"
      R"("c":{"dtype":"BF16","shape":[3],"data_offsets":[28,34]},)"
      R"("empty":{"dtype":"F32","shape":[0,4],"data_offsets":[34,34]}})";
  // Writers pad the header with spaces to 8 bytes; the parser must accept it.
  while ((header.size() + 8) % 8 != 0) header += ' ';
  return RawFile(header, a + b + c);
}

absl::Status ParseError(const std::string& bytes) {
  auto file = SafetensorsFile::FromBytes(bytes, "model/weights.safetensors");
  EXPECT_FALSE(file.ok()) << "parsed a bad file";
  return file.ok() ? absl::OkStatus() : file.status();
}

TEST(SafetensorsTest, ReadsEveryLoadableDTypeFromAMappedFile) {
  const std::string path = Write(GoodFile());
  auto file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status();
  const SafetensorsFile& f = **file;
  EXPECT_EQ(f.path(), path);
  EXPECT_EQ(f.entries().size(), 4u);
  EXPECT_EQ(f.metadata().at("format"), "pt");

  const SafetensorsEntry* a = f.Find("a");
  ASSERT_NE(a, nullptr);
  EXPECT_EQ(a->dtype, DType::kFloat32);
  EXPECT_EQ(a->shape, (Shape{2, 3}));
  EXPECT_EQ(a->num_elements, 6);
  EXPECT_EQ(f.ReadAsFloat(*a), (std::vector<float>{1.0f, -2.5f, 3.25f, 0.0f, 1e-3f, 7.0f}));

  const SafetensorsEntry* b = f.Find("b");
  ASSERT_NE(b, nullptr);
  EXPECT_EQ(b->dtype, DType::kFloat16);
  EXPECT_EQ(f.ReadAsFloat(*b), (std::vector<float>{1.0f, -2.0f}));

  const SafetensorsEntry* c = f.Find("c");
  ASSERT_NE(c, nullptr);
  EXPECT_EQ(c->dtype, DType::kBFloat16);
  EXPECT_EQ(f.ReadAsFloat(*c), (std::vector<float>{1.0f, 3.0f, -0.5f}));

  const SafetensorsEntry* empty = f.Find("empty");
  ASSERT_NE(empty, nullptr);
  EXPECT_EQ(empty->num_elements, 0);
  EXPECT_TRUE(f.ReadAsFloat(*empty).empty());

  EXPECT_EQ(f.Find("missing"), nullptr);
  file->reset();
  std::remove(path.c_str());
}

TEST(SafetensorsTest, MissingFileIsNotFoundAndNamesThePath) {
  auto file = SafetensorsFile::Open("/nonexistent/dir/weights.safetensors");
  ASSERT_FALSE(file.ok());
  EXPECT_EQ(file.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(file.status().message(), HasSubstr("/nonexistent/dir/weights.safetensors"));
}

TEST(SafetensorsTest, FileShorterThanTheLengthPrefix) {
  const std::string path = Write("abc");
  auto file = SafetensorsFile::Open(path);
  ASSERT_FALSE(file.ok());
  EXPECT_THAT(file.status().message(),
              AllOf(HasSubstr(path), HasSubstr("truncated"), HasSubstr("is 3 bytes"),
                    HasSubstr("at least 8")));
  std::remove(path.c_str());
}

TEST(SafetensorsTest, EmptyFileIsTruncated) {
  const std::string path = Write("");
  auto file = SafetensorsFile::Open(path);
  ASSERT_FALSE(file.ok());
  EXPECT_THAT(file.status().message(), AllOf(HasSubstr("truncated"), HasSubstr("is 0 bytes")));
  std::remove(path.c_str());
}

TEST(SafetensorsTest, HugeHeaderLengthIsRejectedBeforeReading) {
  absl::Status s = ParseError(LengthPrefix(uint64_t{1} << 62) + "{}");
  EXPECT_THAT(s.message(), AllOf(HasSubstr("model/weights.safetensors"),
                                 HasSubstr("header length 4611686018427387904"),
                                 HasSubstr("exceeds the file"), HasSubstr("at most 2")));
  // Also at the very top of the range (no overflow in the check).
  s = ParseError(LengthPrefix(UINT64_MAX) + "{}");
  EXPECT_THAT(s.message(), HasSubstr("exceeds the file"));
}

TEST(SafetensorsTest, HeaderLengthOverTheLimitEvenIfTheFileIsThatBig) {
  std::string header = "{}" + std::string(kMaxSafetensorsHeaderBytes, ' ');
  absl::Status s = ParseError(RawFile(header, ""));
  EXPECT_THAT(s.message(), HasSubstr("exceeds the limit"));
}

TEST(SafetensorsTest, HeaderCutShortIsTruncated) {
  std::string file = GoodFile();
  // Keep the length prefix and half the header.
  absl::Status s = ParseError(file.substr(0, 40));
  EXPECT_THAT(s.message(), AllOf(HasSubstr("header length"), HasSubstr("exceeds the file"),
                                 HasSubstr("truncated")));
}

TEST(SafetensorsTest, DataCutShortNamesTheTensor) {
  std::string file = GoodFile();
  absl::Status s = ParseError(file.substr(0, file.size() - 4));  // lose half of "c"
  EXPECT_THAT(s.message(),
              AllOf(HasSubstr("model/weights.safetensors"), HasSubstr("tensor 'c'"),
                    HasSubstr("end 34 exceeds the data section of 30 bytes"),
                    HasSubstr("truncated")));
}

TEST(SafetensorsTest, HeaderIsNotJson) {
  absl::Status s = ParseError(RawFile("{\"a\": ", "xxxx"));
  EXPECT_THAT(s.message(), HasSubstr("header is not valid JSON"));
}

TEST(SafetensorsTest, HeaderIsNotAnObject) {
  absl::Status s = ParseError(RawFile("[1, 2]", ""));
  EXPECT_THAT(s.message(), AllOf(HasSubstr("header is a JSON array"), HasSubstr("expected an object")));
}

TEST(SafetensorsTest, DuplicateTensorNameIsRejected) {
  absl::Status s = ParseError(RawFile(
      R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
      R"("w":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
      FloatBytes({1, 2})));
  EXPECT_THAT(s.message(), HasSubstr("names \"w\" more than once"));
}

TEST(SafetensorsTest, OffsetsSpanningTheWrongNumberOfBytes) {
  absl::Status s = ParseError(RawFile(
      R"({"w":{"dtype":"F32","shape":[2,3],"data_offsets":[0,20]}})", FloatBytes({1, 2, 3, 4, 5, 6})));
  EXPECT_THAT(s.message(), AllOf(HasSubstr("tensor 'w'"), HasSubstr("span 20 bytes"),
                                 HasSubstr("expected 24"), HasSubstr("F32 shape [2, 3]")));
}

TEST(SafetensorsTest, OffsetsPastTheEndOfTheFile) {
  absl::Status s = ParseError(RawFile(
      R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[1000,1008]}})", FloatBytes({1, 2})));
  EXPECT_THAT(s.message(), AllOf(HasSubstr("tensor 'w'"), HasSubstr("[1000, 1008]"),
                                 HasSubstr("exceeds the data section of 8 bytes")));
}

TEST(SafetensorsTest, OffsetsBeginAfterEnd) {
  absl::Status s = ParseError(RawFile(
      R"({"w":{"dtype":"F32","shape":[0],"data_offsets":[8,0]}})", FloatBytes({1, 2})));
  EXPECT_THAT(s.message(), AllOf(HasSubstr("tensor 'w'"), HasSubstr("begin exceeds end")));
}

TEST(SafetensorsTest, OverlappingTensorsAreRejected) {
  absl::Status s = ParseError(RawFile(
      R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
      R"("b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
      FloatBytes({1, 2, 3})));
  EXPECT_THAT(s.message(), AllOf(HasSubstr("tensor 'b'"), HasSubstr("overlap tensor 'a'")));
}

TEST(SafetensorsTest, NegativeOrFractionalNumbersAreRejected) {
  absl::Status s = ParseError(RawFile(
      R"({"w":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}})", FloatBytes({1})));
  EXPECT_THAT(s.message(), AllOf(HasSubstr("tensor 'w'"), HasSubstr("shape holds -1")));
  s = ParseError(RawFile(R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4.0]}})",
                         FloatBytes({1})));
  EXPECT_THAT(s.message(), AllOf(HasSubstr("data_offsets holds 4.0"),
                                 HasSubstr("non-negative integer")));
}

TEST(SafetensorsTest, ShapeOverflowIsRejected) {
  absl::Status s = ParseError(RawFile(
      R"({"w":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,4]}})",
      FloatBytes({1})));
  EXPECT_THAT(s.message(), AllOf(HasSubstr("tensor 'w'"), HasSubstr("overflows")));
}

TEST(SafetensorsTest, UnsupportedAndUnknownDTypes) {
  absl::Status s = ParseError(RawFile(
      R"({"w":{"dtype":"F64","shape":[1],"data_offsets":[0,8]}})", FloatBytes({1, 2})));
  EXPECT_THAT(s.message(), AllOf(HasSubstr("tensor 'w'"), HasSubstr("unsupported dtype \"F64\""),
                                 HasSubstr("F32, F16, BF16")));
  s = ParseError(RawFile(R"({"w":{"dtype":"Q4","shape":[1],"data_offsets":[0,4]}})",
                         FloatBytes({1})));
  EXPECT_THAT(s.message(), HasSubstr("unknown dtype \"Q4\""));
}

TEST(SafetensorsTest, EntryLackingAField) {
  absl::Status s = ParseError(RawFile(R"({"w":{"dtype":"F32","shape":[1]}})", FloatBytes({1})));
  EXPECT_THAT(s.message(), AllOf(HasSubstr("tensor 'w'"), HasSubstr("lacks \"data_offsets\"")));
}

TEST(SafetensorsTest, MetadataMustHoldStrings) {
  absl::Status s = ParseError(RawFile(R"({"__metadata__":{"n":3}})", ""));
  EXPECT_THAT(s.message(), AllOf(HasSubstr("__metadata__ entry 'n'"), HasSubstr("expected a string")));
}

TEST(SafetensorsTest, UnalignedDataIsReadCorrectly) {
  // A 3-byte header puts F32 data at an odd address in the mapping.
  std::string header = R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";
  while ((header.size() + 8) % 4 == 0) header += ' ';
  auto file = SafetensorsFile::FromBytes(RawFile(header, FloatBytes({0.5f, -8.0f})), "x");
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ((*file)->ReadAsFloat(*(*file)->Find("w")), (std::vector<float>{0.5f, -8.0f}));
}

}  // namespace
}  // namespace attnserve
