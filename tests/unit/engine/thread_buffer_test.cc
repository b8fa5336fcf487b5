// ThreadBuffer: a thread gets its slot's memory back on its next borrow, other
// threads have their own, memory past the keep limit is freed, and a slot
// borrowed twice at once stops the process.
#include "engine/cpu/thread_buffer.h"

#include <cstdint>
#include <cstring>
#include <thread>

#include "gtest/gtest.h"

namespace attnserve::cpu {
namespace {

TEST(ThreadBufferTest, ASlotsMemoryComesBackToTheSameThreadAligned) {
  unsigned char* first = nullptr;
  {
    ThreadBuffer b(BufferSlot::kCoreOutput, 100000);
    first = b.data();
    ASSERT_NE(first, nullptr);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(first) % 64, 0u);
    std::memset(b.data(), 1, 100000);  // the whole size is usable
  }
  {
    ThreadBuffer smaller(BufferSlot::kCoreOutput, 5000);
    EXPECT_EQ(smaller.data(), first) << "a smaller borrow reuses the slot's memory";
    // Another slot is another buffer, alive at the same time.
    ThreadBuffer other(BufferSlot::kQkvActivations, 5000);
    EXPECT_NE(other.data(), smaller.data());
  }
  EXPECT_GE(ThreadBuffer::KeptBytes(), 100000u + 5000u);
  {
    ThreadBuffer larger(BufferSlot::kCoreOutput, 3 << 20);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(larger.data()) % 64, 0u);
    std::memset(larger.data(), 2, 3 << 20);
  }
  EXPECT_GE(ThreadBuffer::KeptBytes(), size_t{3} << 20) << "the grown slot is kept";
}

TEST(ThreadBufferTest, EachThreadHasItsOwnSlots) {
  ThreadBuffer mine(BufferSlot::kChunkSrc, 4096);
  unsigned char* theirs = nullptr;
  size_t theirs_kept_before = 1;
  std::thread([&] {
    theirs_kept_before = ThreadBuffer::KeptBytes();
    ThreadBuffer b(BufferSlot::kChunkSrc, 4096);  // the same slot: no abort
    theirs = b.data();
  }).join();
  EXPECT_EQ(theirs_kept_before, 0u) << "a new thread starts with nothing kept";
  EXPECT_NE(theirs, mine.data());
}

TEST(ThreadBufferTest, AThreadKeepsAtMostTheLimit) {
  std::thread([] {
    const size_t big = kThreadBufferKeepBytes / 2 + (size_t{1} << 20);
    { ThreadBuffer a(BufferSlot::kQActivations, big); }
    EXPECT_GE(ThreadBuffer::KeptBytes(), big);
    { ThreadBuffer b(BufferSlot::kKActivations, big); }  // both would pass the limit
    EXPECT_LE(ThreadBuffer::KeptBytes(), kThreadBufferKeepBytes);
    EXPECT_GE(ThreadBuffer::KeptBytes(), big) << "the first stays";
    { ThreadBuffer huge(BufferSlot::kVActivations, kThreadBufferKeepBytes + 64); }
    EXPECT_LE(ThreadBuffer::KeptBytes(), kThreadBufferKeepBytes);
  }).join();
}

TEST(ThreadBufferDeathTest, BorrowingASlotTwiceOnOneThreadAborts) {
  EXPECT_DEATH(
      {
        ThreadBuffer a(BufferSlot::kStagedRows, 64);
        ThreadBuffer b(BufferSlot::kStagedRows, 64);
      },
      "borrowed twice");
}

}  // namespace
}  // namespace attnserve::cpu
