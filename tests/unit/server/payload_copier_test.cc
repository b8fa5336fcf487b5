// PayloadCopier against memcpy and ScanValues over the whole (the oracles):
// tensors cut into pieces of every kind (empty, one byte, values and 64-byte
// blocks split across pieces, chunk boundaries inside a piece), into aligned
// memory (streaming stores) and not, alone and with helpers,
// from many threads at once (the helpers then serve several copies; run
// under ThreadSanitizer by scripts/sanitize.sh tsan).
#include "server/transport/payload_copier.h"

#include <cstdint>
#include <cstring>
#include <new>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "server/request/value_scan.h"

namespace attnserve {
namespace {

// `n` random bytes.
std::string RandomBytes(size_t n, std::mt19937& rng) {
  std::string bytes(n, '\0');
  for (char& c : bytes) c = static_cast<char>(rng());
  return bytes;
}

// `bytes` cut at random points into pieces, some empty.
std::vector<absl::string_view> Cut(const std::string& bytes, std::mt19937& rng) {
  std::vector<absl::string_view> pieces;
  size_t at = 0;
  while (at < bytes.size()) {
    const size_t kind = rng() % 4;
    const size_t len = kind == 0 ? 0 : kind == 1 ? 1 + rng() % 3 : 1 + rng() % 300000;
    const size_t take = std::min(len, bytes.size() - at);
    pieces.emplace_back(bytes.data() + at, take);
    at += take;
  }
  pieces.emplace_back(bytes.data() + at, 0);
  return pieces;
}

// A destination at `offset` bytes past a 64-byte boundary: 0 streams
// (a tensor of 1 MiB or more, copy_scan.h), others take memcpy.
struct Destination {
  explicit Destination(size_t n, size_t offset)
      : base(static_cast<char*>(::operator new(n + 64, std::align_val_t{64}))),
        data(base + offset),
        size(n) {}
  ~Destination() { ::operator delete(base, std::align_val_t{64}); }
  std::string str() const { return std::string(data, size); }
  char* const base;
  char* const data;
  const size_t size;
};

void ExpectCopied(PayloadCopier& copier, const std::string& bytes, int width,
                  std::mt19937& rng, size_t offset = 0) {
  const std::vector<absl::string_view> pieces = Cut(bytes, rng);
  Destination dst(bytes.size(), offset);
  const ValueScan got = copier.Copy(pieces, dst.data, width);
  ASSERT_EQ(dst.str(), bytes) << "width " << width << ", " << pieces.size() << " pieces";
  if (width != 2 && width != 4) {
    EXPECT_EQ(got.width, 0);
    return;
  }
  const ValueScan want =
      ScanValues(bytes.data(), static_cast<int64_t>(bytes.size()) / width, width);
  EXPECT_EQ(got.width, width);
  EXPECT_EQ(got.max_abs_bits, want.max_abs_bits) << bytes.size() << " bytes";
  EXPECT_EQ(got.max_positive_bits, want.max_positive_bits) << bytes.size() << " bytes";
}

TEST(PayloadCopierTest, CopiesAndScansLikeMemcpyAndOneScan) {
  std::mt19937 rng(11);
  for (int helpers : {0, 1, 3}) {
    PayloadCopier copier(helpers);
    EXPECT_EQ(copier.helpers(), helpers);
    for (size_t n : {size_t{0}, size_t{1}, size_t{6}, PayloadCopier::kChunkBytes - 2,
                     PayloadCopier::kChunkBytes + 2, PayloadCopier::kMinParallelBytes - 4,
                     PayloadCopier::kMinParallelBytes + 6, size_t{5} << 20}) {
      for (int width : {0, 1, 2, 4}) {
        for (size_t offset : {0, 4}) {
          SCOPED_TRACE(testing::Message() << helpers << " helpers, " << n << " bytes at offset "
                                          << offset);
          ExpectCopied(copier, RandomBytes(n, rng), width, rng, offset);
        }
      }
    }
  }
}

// The largest values in one chunk only, at either end of the tensor: each
// chunk's scan reaches the merged result, whoever copied it.
TEST(PayloadCopierTest, EveryChunksScanReachesTheResult) {
  PayloadCopier copier(2);
  std::mt19937 rng(12);
  const size_t n = size_t{3} << 20;
  for (size_t at : {size_t{0}, n / 2 + 8, n - 4}) {  // value-aligned
    std::string bytes(n, '\0');  // zeros: +0.0
    const uint32_t nan = 0x7fc00001;
    std::memcpy(bytes.data() + at, &nan, 4);
    Destination dst(n, 0);
    const std::vector<absl::string_view> pieces = Cut(bytes, rng);
    const ValueScan scan = copier.Copy(pieces, dst.data, 4);
    EXPECT_EQ(scan.max_abs_bits, 0x7fc00001) << at;
    EXPECT_EQ(scan.max_positive_bits, 0x7fc00001) << at;
    ASSERT_EQ(dst.str(), bytes);
  }
}

// Eight threads copy at once through two helpers: every copy whole and its
// own scan, however the helpers' work interleaves.
TEST(PayloadCopierTest, ConcurrentCopiesShareTheHelpers) {
  PayloadCopier copier(2);
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&copier, t] {
      std::mt19937 rng(100 + t);
      for (int i = 0; i < 6; ++i) {
        const size_t n = (size_t{1} << 20) + rng() % (size_t{2} << 20);
        ExpectCopied(copier, RandomBytes(n, rng), (t % 2 == 0) ? 2 : 4, rng);
      }
    });
  }
  for (std::thread& t : threads) t.join();
}

TEST(PayloadCopierTest, DefaultHelpersAreAtMostSeven) {
  EXPECT_GE(PayloadCopier::DefaultHelpers(), 0);
  EXPECT_LE(PayloadCopier::DefaultHelpers(), 7);
}

}  // namespace
}  // namespace attnserve
