// Per-thread slots: each holds one aligned block and its size; a borrowed
// slot is marked busy until its ThreadBuffer ends.
#include "engine/cpu/thread_buffer.h"

#include <cstdio>
#include <cstdlib>
#include <new>

namespace attnserve::cpu {
namespace {

struct Slot {
  unsigned char* data = nullptr;
  size_t size = 0;
  bool busy = false;
};

}  // namespace

struct ThreadBuffer::Slots {
  Slot slot[static_cast<int>(BufferSlot::kCount)];
  ~Slots() {
    for (Slot& s : slot) std::free(s.data);
  }
  size_t Kept() const {
    size_t total = 0;
    for (const Slot& s : slot) total += s.size;
    return total;
  }
};

ThreadBuffer::Slots& ThreadBuffer::ThisThread() {
  thread_local Slots slots;
  return slots;
}

ThreadBuffer::ThreadBuffer(BufferSlot slot, size_t bytes)
    : slots_(&ThisThread()), slot_(static_cast<int>(slot)) {
  Slot& s = slots_->slot[slot_];
  if (s.busy) {
    std::fprintf(stderr, "ThreadBuffer: slot %d borrowed twice on one thread\n",
                 slot_);
    std::abort();
  }
  if (bytes == 0) bytes = 1;
  if (bytes > s.size) {
    std::free(s.data);
    s.data = nullptr;
    s.size = 0;
    const size_t rounded = (bytes + 63) / 64 * 64;
    s.data = static_cast<unsigned char*>(std::aligned_alloc(64, rounded));
    if (s.data == nullptr) throw std::bad_alloc();
    s.size = rounded;
  }
  s.busy = true;
  data_ = s.data;
}

ThreadBuffer::~ThreadBuffer() {
  Slot& s = slots_->slot[slot_];
  s.busy = false;
  if (slots_->Kept() > kThreadBufferKeepBytes) {
    std::free(s.data);
    s.data = nullptr;
    s.size = 0;
  }
}

size_t ThreadBuffer::KeptBytes() { return ThisThread().Kept(); }

}  // namespace attnserve::cpu
