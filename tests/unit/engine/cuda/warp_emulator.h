// Runs a CUDA kernel of this project on the CPU, one block at a time, each
// CUDA thread a fiber on the launching thread:
// enough of the CUDA execution model for the
// fused kernels (flash_attention.cu, flash_attention_fp32.cu), the
// sessions' kernels (paged_attention.cu), the unfused path's
// (softmax_rows.cu), the general kernel (attention_general.cu) and QK-norm
// and RoPE (qk_transform.cu) to run unchanged, launchers included, in a
// test on a machine without a GPU. Include it first, then the .cu under
// test; the CUDA runtime calls the launchers make are host stand-ins
// (cuda_runtime_emulator.cc, linked with every emulated test). Test-only;
// written here.
//
// The threads' order: a fiber runs until it waits at a barrier; the threads
// a barrier releases run next, ahead of all others, so a warp released by
// __syncwarp or a shuffle runs ahead of the rest of its block. A missing
// __syncthreads between one warp's write to shared memory and another's
// read (or between a read and the next write) then gives a wrong value
// (warp_emulator_test shows both); under TSan, to which each CUDA thread
// is a thread of its own ordered only by barriers, it is a data race. A
// barrier that not all of a block's threads reach stops the test (it
// hangs a GPU).
//
// What it models: threadIdx/blockIdx/blockDim/gridDim (1-D), launches
// (ATTNSERVE_LAUNCH), a kernel's attributes (cudaFuncSetAttribute accepts
// any), cvt.rna.tf32 (Tf32High), __fmul_rn/__fadd_rn/__fsub_rn (rounded as
// written), __syncwarp (a barrier of the warp's lanes), __syncthreads (a
// barrier of the block's threads), __shfl_xor_sync (float and double) and
// __shfl_sync (a barrier of the warp's lanes around an exchange), static
// and dynamic shared memory, and the warp-wide instructions the kernels
// issue through flash_tile.cuh and their Mma:
//   - ldmatrix .x4 (.b16): lane l receives in r[m] the 32 bits at byte
//     4 (l % 4) of the row whose address lane 8m + l / 4 gave; .trans the
//     transposed 8x8 matrix's;
//   - mma.m16n8k16 with .f16/.bf16 inputs (MmaM16N8K16, below);
//   - mma.m16n8k8 .tf32 with fp32 accumulation, fragments as the PTX ISA
//     lays them out (a0 = A[g][t], a1 = A[g+8][t], a2 = A[g][t+4],
//     a3 = A[g+8][t+4]; b0 = B[t][g], b1 = B[t+4][g]; c0, c1 = C[g][2t..],
//     c2, c3 = C[g+8][2t..]), the inputs' low 13 bits ignored as the tensor
//     cores do, products accumulated in k order, or, under
//     ScopedTf32Accumulation(kTruncated), summed as the tensor cores were
//     measured to sum them (truncated toward zero; below);
//   - cp.async: copied (or zero-filled) at once, so commit and wait are
//     empty.
// Addresses the hardware requires 16-byte aligned (ldmatrix rows, cp.async)
// abort the test when they are not. What it does not model: timing, the
// asynchrony of cp.async (a missing wait may go unnoticed), every order
// the threads may run in (one adversarial order runs; TSan reports what
// the barriers leave unordered in any other), and the fragment layouts
// themselves: they are written here from the same reading of the PTX ISA as
// the kernel, so this catches the kernel's logic (indices, loops, masks,
// tile ranges, the online softmax) and not a misreading of the ISA, which
// only a GPU run shows. (flash_attention.cu, correct on an H100 and an H200,
// passes here too: the model of ldmatrix, its .trans and m16n8k16 agrees
// with the hardware. The .tf32 model has not met a GPU yet; its layouts
// agree with a second, independent reading: CUTLASS's CuTe traits of
// SM80_16x8x8_F32TF32TF32F32_TN, A ((4,8),(2,2)):((16,1),(8,64)) over
// (M16, K8) and B ((4,8),2):((8,1),32) over (N8, K8), both column-major,
// the lane's t = lane % 4 the first mode: the same a0-a3 and b0-b1.)
#ifndef ATTNSERVE_TESTS_UNIT_ENGINE_CUDA_WARP_EMULATOR_H_
#define ATTNSERVE_TESTS_UNIT_ENGINE_CUDA_WARP_EMULATOR_H_

#define ATTNSERVE_CUDA_EMULATION 1
// Before the CUDA headers: host_defines.h keeps a __device__ defined here.
#define __device__

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>
#include <vector_functions.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <memory>
#include <tuple>
#include <vector>

// CUDA threads as Boost.Context fibers, announced to the sanitizers: under
// ASan each switch of stacks (Debian's Boost.Context is built for fcontext,
// whose fibers do not announce themselves), under TSan each fiber as a
// thread of its own (below, "TSan").
#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#endif
#if defined(__SANITIZE_THREAD__)
#include <sanitizer/tsan_interface.h>
// libtsan's, not declared by its header: ignore the calling thread's (here
// fiber's) reads and writes until the matching end.
extern "C" void __tsan_ignore_thread_begin();
extern "C" void __tsan_ignore_thread_end();
#endif
#include <sys/mman.h>

#include <boost/context/fiber.hpp>
#include <boost/context/stack_context.hpp>
#include <boost/context/stack_traits.hpp>

#include "tests/unit/engine/cuda/cuda_runtime_emulator.h"

#undef __global__
#define __global__
#undef __launch_bounds__
#define __launch_bounds__(...)
#undef __forceinline__
#define __forceinline__ inline
// Blocks run one after another: a function's static array is its block's.
#undef __shared__
#define __shared__ static
// The kernel's dynamic shared memory: its block's buffer.
#define ATTNSERVE_DYNAMIC_SHARED(name) unsigned char* name = ::attnserve::emu::SharedMemory()

namespace attnserve::emu {

struct Dim3 {
  unsigned x = 0, y = 0, z = 0;
};
inline thread_local Dim3 thread_idx;
inline thread_local Dim3 block_idx;
inline thread_local Dim3 block_dim;
inline thread_local Dim3 grid_dim;

constexpr int kWarpSize = 32;

// TSan: each CUDA thread is a TSan fiber, a thread of its own to TSan, and
// switches between them establish no order (__tsan_switch_to_fiber_no_sync):
// what orders two CUDA threads' accesses is what orders them on a GPU, a
// barrier (Barrier: every arrival releases into it, every thread it lets go
// acquires from it), the launch (the launching thread's writes before it)
// and its end (the fibers' writes before the launching thread goes on). A
// missing __syncthreads between two threads' accesses to shared memory is
// then a data race to TSan. The emulator's own bookkeeping, which the
// fibers share with the scheduler and each other (the ready queue, the
// barriers' lists, the thread_local indices the scheduler saves and
// restores on the launching thread), is ordered by the one OS thread that
// runs them all, which TSan does not see: it ignores those accesses
// (IgnoreAccesses). Nothing of this without TSan.
#if defined(__SANITIZE_THREAD__)
inline void IgnoreBegin() { __tsan_ignore_thread_begin(); }
inline void IgnoreEnd() { __tsan_ignore_thread_end(); }
inline void Release(void* sync) { __tsan_release(sync); }
inline void Acquire(void* sync) { __tsan_acquire(sync); }
inline void* CreateTsanFiber() { return __tsan_create_fiber(0); }
inline void* CurrentTsanFiber() { return __tsan_get_current_fiber(); }
inline void DestroyTsanFiber(void* fiber) { __tsan_destroy_fiber(fiber); }
// Inlined, so that no function's entry is TSan's before and its exit after.
__attribute__((always_inline)) inline void SwitchTsanFiber(void* fiber) {
  __tsan_switch_to_fiber(fiber, __tsan_switch_to_fiber_no_sync);
}
#else
inline void IgnoreBegin() {}
inline void IgnoreEnd() {}
inline void Release(void*) {}
inline void Acquire(void*) {}
inline void* CreateTsanFiber() { return nullptr; }
inline void* CurrentTsanFiber() { return nullptr; }
inline void DestroyTsanFiber(void*) {}
inline void SwitchTsanFiber(void*) {}
#endif
// The running fiber's (or the launching thread's) accesses ignored by TSan
// for a scope.
struct IgnoreAccesses {
  IgnoreAccesses() { IgnoreBegin(); }
  ~IgnoreAccesses() { IgnoreEnd(); }
  IgnoreAccesses(const IgnoreAccesses&) = delete;
  IgnoreAccesses& operator=(const IgnoreAccesses&) = delete;
};

// The CUDA threads are fibers on the launching thread, switched at their
// barriers: no OS thread per CUDA thread, no futex per barrier. Each runs
// one launch's body at a time and is kept for the launching thread's next
// launch (Workers, below): to TSan a new fiber is a new thread, which costs
// far more than the launch.
struct Fiber {
  boost::context::fiber context;    // the fiber, while the scheduler runs
  boost::context::fiber scheduler;  // the scheduler, while the fiber runs
  Dim3 thread_idx, block_idx;       // its own, restored when it resumes
  const std::function<void()>* body = nullptr;  // its launch's; null: return
  bool done = false;                // the launch's body has returned
  bool returned = false;            // the fiber has returned (Workers' end)
  char* stack = nullptr;            // its stack's lowest byte (for ASan)
  void* fake_stack = nullptr;       // ASan's, while it is switched out
  void* tsan = nullptr;             // TSan's fiber
};
// One launch's threads and their order.
struct Scheduler {
  std::vector<Fiber*> fibers;  // by threadIdx.x
  std::deque<int> ready;       // the fibers that may run, the next first
  int current = 0;
  char started = 0, finished = 0;  // TSan's order: the launch, and its end
};
inline thread_local Scheduler* scheduler = nullptr;
// The launching thread's stack (for ASan) and TSan's name for it.
struct MainContext {
  const void* stack = nullptr;
  size_t stack_bytes = 0;
  void* tsan = nullptr;
};
inline thread_local MainContext main_context;

// ASan's announcements around a switch of stacks (nothing without ASan):
// before it, the stack switched to; after it, on the new stack, the fake
// stack saved when this one was left (null: the first switch to a fiber,
// which learns the launching thread's stack).
inline void StartSwitch(void** fake_stack_save, const void* bottom, size_t bytes) {
#if defined(__SANITIZE_ADDRESS__)
  __sanitizer_start_switch_fiber(fake_stack_save, bottom, bytes);
#else
  (void)fake_stack_save, (void)bottom, (void)bytes;
#endif
}
inline void FinishSwitch(void* fake_stack, const void** bottom_old, size_t* bytes_old) {
#if defined(__SANITIZE_ADDRESS__)
  __sanitizer_finish_switch_fiber(fake_stack, bottom_old, bytes_old);
#else
  (void)fake_stack, (void)bottom_old, (void)bytes_old;
#endif
}

// Switches from the running fiber to the scheduler, until it resumes it
// (called with the fiber's accesses ignored).
inline void SwitchToScheduler(Fiber& f) {
  StartSwitch(&f.fake_stack, main_context.stack, main_context.stack_bytes);
  SwitchTsanFiber(main_context.tsan);
  f.scheduler = std::move(f.scheduler).resume();
  FinishSwitch(f.fake_stack, nullptr, nullptr);
}

// std::barrier's arrive_and_wait for fibers: the last to arrive runs the
// completion and goes on; the others run next, ahead of every fiber that
// was already waiting to run, so the threads a warp barrier releases race
// ahead of the rest of the block (a missing __syncthreads between one
// warp's write and another's read shows as a wrong value). To TSan, what
// each thread did before it arrived (and the completion) happens before
// what any does after it: every arrival releases into the phase's sync
// object, every departure acquires from it. Two objects alternate: a
// thread that has gone on cannot arrive two phases later before every
// thread of this phase has left.
struct Barrier {
  explicit Barrier(int expected, std::function<void()> completion = {})
      : expected(expected), completion(std::move(completion)) {}
  void arrive_and_wait() {
    char* sync = nullptr;
    bool last = false;
    {
      IgnoreAccesses ignore;
      sync = &phase_sync[phase % 2];
      Release(sync);
      last = static_cast<int>(waiting.size()) + 1 == expected;
      if (last) {
        ++phase;
        for (auto it = waiting.rbegin(); it != waiting.rend(); ++it) {
          scheduler->ready.push_front(*it);
        }
        waiting.clear();
      } else {
        waiting.push_back(scheduler->current);
        SwitchToScheduler(*scheduler->fibers[static_cast<size_t>(scheduler->current)]);
      }
    }
    Acquire(sync);
    if (last && completion) {
      completion();  // before any of the released threads runs
      Release(sync);
    }
  }
  const int expected;
  const std::function<void()> completion;
  std::vector<int> waiting;  // fibers, in the order they arrived
  int phase = 0;
  char phase_sync[2] = {};   // TSan's sync objects (their addresses)
};

// One warp's exchange slots and barrier.
struct Warp {
  Barrier sync{kWarpSize};
  const void* address[kWarpSize];
  uint32_t words[kWarpSize][10];
};

struct Block {
  explicit Block(int threads, size_t shared_bytes)
      : sync(threads), shared(shared_bytes), warps(threads / kWarpSize) {
    for (auto& w : warps) w = std::make_unique<Warp>();
  }
  Barrier sync;
  std::vector<unsigned char> shared;
  std::vector<std::unique_ptr<Warp>> warps;
};
inline thread_local Block* block = nullptr;

inline unsigned char* SharedMemory() { return block->shared.data(); }
inline int Lane() { return static_cast<int>(thread_idx.x) % kWarpSize; }
inline Warp& MyWarp() { return *block->warps[thread_idx.x / kWarpSize]; }

// Boost.Context's stack allocator concept over stacks kept for reuse:
// 256 KiB each above a guard page, so an overflow faults instead of
// corrupting.
class CachedStacks {
 public:
  static constexpr size_t kBytes = 256 * 1024;
  boost::context::stack_context allocate() {
    char* base = nullptr;
    if (free_.empty()) {
      const size_t page = boost::context::stack_traits::page_size();
      void* p = mmap(nullptr, kBytes + page, PROT_READ | PROT_WRITE,
                     MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
      if (p == MAP_FAILED) {
        std::perror("warp_emulator: mmap of a fiber stack");
        std::abort();
      }
      mprotect(p, page, PROT_NONE);
      base = static_cast<char*>(p) + page;
      all_.push_back(base);
    } else {
      base = free_.back();
      free_.pop_back();
    }
#if defined(__SANITIZE_ADDRESS__)
    ASAN_UNPOISON_MEMORY_REGION(base, kBytes);  // a previous fiber's redzones
#endif
    boost::context::stack_context stack;
    stack.size = kBytes;
    stack.sp = base + kBytes;  // the top: stacks grow down
    return stack;
  }
  void deallocate(boost::context::stack_context& stack) {
    free_.push_back(static_cast<char*>(stack.sp) - kBytes);
  }
  ~CachedStacks() {
    const size_t page = boost::context::stack_traits::page_size();
    for (char* base : all_) munmap(base - page, kBytes + page);
  }

 private:
  std::vector<char*> all_, free_;
};

// Boost.Context takes its allocator by value: this one hands out stacks of
// a cache, and tells the fiber which.
struct StackOf {
  boost::context::stack_context allocate() {
    boost::context::stack_context stack = cache->allocate();
    fiber->stack = static_cast<char*>(stack.sp) - CachedStacks::kBytes;
    return stack;
  }
  void deallocate(boost::context::stack_context& stack) { cache->deallocate(stack); }
  CachedStacks* cache;
  Fiber* fiber;
};

// The fibers of one launching thread, made as its launches need them and
// kept for its next: each waits for a launch (Fiber::body), runs its body,
// and waits again; at the thread's end each is resumed to return.
class Workers {
 public:
  Workers() { main_context.tsan = CurrentTsanFiber(); }  // on the launching thread
  Workers(const Workers&) = delete;
  Workers& operator=(const Workers&) = delete;
  ~Workers() {
    IgnoreAccesses ignore;  // the launching thread's bookkeeping, to TSan
    for (auto& f : fibers_) {
      f->body = nullptr;
      Resume(*f);
      DestroyTsanFiber(f->tsan);
    }
    fibers_.clear();  // before the stacks
  }

  // Fiber t, made if it is the first launch with so many threads.
  Fiber& operator[](int t) {
    while (static_cast<int>(fibers_.size()) <= t) Add();
    return *fibers_[static_cast<size_t>(t)];
  }

  // Runs f until it waits at a barrier, finishes its launch or returns.
  void Resume(Fiber& f) {
    thread_idx = f.thread_idx;
    block_idx = f.block_idx;
    void* fake_stack = nullptr;
    StartSwitch(&fake_stack, f.stack, CachedStacks::kBytes);
    SwitchTsanFiber(f.tsan);
    f.context = std::move(f.context).resume();
    if (f.returned) {  // it returned here as itself, its accesses ignored
      void* const main_tsan = main_context.tsan;  // read while ignored
      IgnoreEnd();
      SwitchTsanFiber(main_tsan);
    }
    FinishSwitch(fake_stack, nullptr, nullptr);
    f.thread_idx = thread_idx;
    f.block_idx = block_idx;
  }

 private:
  void Add() {
    fibers_.push_back(std::make_unique<Fiber>());
    Fiber& f = *fibers_.back();
    // Boost enters a fiber once as it makes it (and leaves it at once): as
    // the fiber to TSan, so that the function that entry leaves unfinished
    // is on the fiber's shadow stack, not the launching thread's.
    f.tsan = CreateTsanFiber();
    SwitchTsanFiber(f.tsan);
    IgnoreBegin();
    f.context = boost::context::fiber(
        std::allocator_arg, StackOf{&stacks_, &f}, [&f](boost::context::fiber&& caller) {
          FinishSwitch(nullptr, &main_context.stack, &main_context.stack_bytes);
          {
            IgnoreAccesses ignore;
            f.scheduler = std::move(caller);
          }
          for (;;) {
            const std::function<void()>* body = nullptr;
            Scheduler* s = nullptr;
            {
              IgnoreAccesses ignore;
              body = f.body;
              s = scheduler;
            }
            if (body == nullptr) break;
            Acquire(&s->started);
            (*body)();
            Release(&s->finished);
            IgnoreAccesses ignore;
            f.done = true;
            SwitchToScheduler(f);  // until its next launch
          }
          // Ignored to its end: Boost's teardown of the fiber runs as it
          // (Resume ends the ignore and switches TSan back once the fiber
          // has returned).
          IgnoreBegin();
          f.returned = true;
          StartSwitch(nullptr, main_context.stack, main_context.stack_bytes);  // its fake stack goes
          return std::move(f.scheduler);
        });
    IgnoreEnd();
    SwitchTsanFiber(main_context.tsan);
  }

  CachedStacks stacks_;  // before the fibers: they return before it goes
  std::vector<std::unique_ptr<Fiber>> fibers_;
};

// Runs body() on `threads` of the launching thread's fibers (threadIdx.x =
// 0 ..), each until it waits at a barrier, in the order Barrier says, until
// every one has finished it. A barrier that not every thread reaches hangs
// a GPU; here it stops the test. One launch at a time per thread.
inline void RunThreads(int threads, const std::function<void()>& body) {
  IgnoreAccesses ignore;  // the launching thread's bookkeeping, to TSan
  static thread_local Workers workers;
  if (scheduler != nullptr) {
    std::fprintf(stderr, "warp_emulator: a launch from inside a launch\n");
    std::abort();
  }
  Scheduler s;
  for (int t = 0; t < threads; ++t) {
    Fiber& f = workers[t];
    f.thread_idx = Dim3{static_cast<unsigned>(t), 0, 0};
    f.block_idx = Dim3{};
    f.body = &body;
    f.done = false;
    s.fibers.push_back(&f);
    s.ready.push_back(t);
  }
  scheduler = &s;
  Release(&s.started);
  while (!s.ready.empty()) {
    s.current = s.ready.front();
    s.ready.pop_front();
    workers.Resume(*s.fibers[static_cast<size_t>(s.current)]);
  }
  scheduler = nullptr;
  for (Fiber* f : s.fibers) {
    if (!f->done) {
      std::fprintf(stderr, "warp_emulator: every live thread waits at a barrier that not all "
                           "of its threads reach (a hang on a GPU)\n");
      std::abort();
    }
  }
  Acquire(&s.finished);
}

// Runs kernel() for every block of `blocks` (blockIdx.x) with `threads`
// threads each and `shared_bytes` of dynamic shared memory. The blocks run
// one after another on one set of `threads` CUDA threads (RunThreads);
// between two blocks every thread has finished the first, and the dynamic
// shared memory is refilled with 0xff bytes (NaN as floats), as a new block
// finds it uninitialised on a GPU.
inline void Launch(int64_t blocks, int threads, size_t shared_bytes,
                   const std::function<void()>& kernel) {
  if (blocks <= 0) return;
  Block blk(threads, shared_bytes);
  const auto poison = [&blk] {
    if (!blk.shared.empty()) std::memset(blk.shared.data(), 0xff, blk.shared.size());
  };
  poison();
  Barrier block_done(threads, poison);
  RunThreads(threads, [&] {
    {
      IgnoreAccesses ignore;  // the emulator's, not the kernel's (TSan above)
      block_dim.x = static_cast<unsigned>(threads);
      grid_dim.x = static_cast<unsigned>(blocks);
      block = &blk;
    }
    for (int64_t b = 0; b < blocks; ++b) {
      {
        IgnoreAccesses ignore;
        block_idx.x = static_cast<unsigned>(b);
      }
      kernel();
      block_done.arrive_and_wait();
    }
  });
}

// Launch() on `stream`'s turn (cuda_runtime_emulator.h).
inline void LaunchOn(cudaStream_t stream, int64_t blocks, int threads, size_t shared_bytes,
                     std::function<void()> kernel) {
  Enqueue(stream, [blocks, threads, shared_bytes, kernel = std::move(kernel)] {
    Launch(blocks, threads, shared_bytes, kernel);
  });
}

inline float Tf32Input(uint32_t bits) { return std::bit_cast<float>(bits & 0xffffe000u); }

// The alignment the hardware requires of an address (ldmatrix rows and
// cp.async operands: 16 bytes); a misaligned one is a kernel bug that
// faults on a GPU, so the emulation stops there too.
inline void RequireAligned(const void* p, const char* what) {
  if (reinterpret_cast<uintptr_t>(p) % 16 != 0) {
    std::fprintf(stderr, "warp_emulator: %s address %p is not 16-byte aligned\n", what, p);
    std::abort();
  }
}

// A 16-bit float's value.
inline float HalfBits(uint16_t h) { return __half2float(std::bit_cast<__half>(h)); }
inline float Bfloat16Bits(uint16_t h) { return std::bit_cast<float>(uint32_t{h} << 16); }

// acc + sum_k a[k] b[k] as one fp32 fma per product, in k order, each
// rounded to nearest.
struct FusedSum {
  template <int K>
  float operator()(float acc, const float (&a)[K], const float (&b)[K]) const {
    for (int k = 0; k < K; ++k) acc = std::fma(a[k], b[k], acc);
    return acc;
  }
};

// d += A B for one m16n8 tile with fp32 accumulation, K deep: every lane
// deposits its registers (words 0-3: a, 4-5: b), then computes its four
// outputs (c0, c1 = C[g][2t..2t+1], c2, c3 = C[g+8][2t..]) from the warp's
// as sum(its accumulator, the row's K elements of A, the column's of B);
// a(words, row, k) and b(words, k, col) read one element each from the
// deposited registers, as the instruction's layout places it.
using Words = uint32_t (*)[10];
template <int K, typename ReadA, typename ReadB, typename Sum = FusedSum>
inline void WarpMma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1,
                    ReadA read_a, ReadB read_b, Sum sum = {}) {
  Warp& w = MyWarp();
  const int lane = Lane();
  uint32_t* mine = w.words[lane];
  for (int i = 0; i < 4; ++i) mine[i] = a[i];
  mine[4] = b0;
  mine[5] = b1;
  w.sync.arrive_and_wait();
  const int g = lane / 4, t = lane % 4;
  float out[4];
  for (int i = 0; i < 4; ++i) {
    const int row = g + (i >= 2 ? 8 : 0), col = 2 * t + (i % 2);
    float a_row[K], b_col[K];
    for (int k = 0; k < K; ++k) {
      a_row[k] = read_a(w.words, row, k);
      b_col[k] = read_b(w.words, k, col);
    }
    out[i] = sum.template operator()<K>(d[i], a_row, b_col);
  }
  w.sync.arrive_and_wait();
  for (int i = 0; i < 4; ++i) d[i] = out[i];
}

// mma.m16n8k16 with 16-bit inputs (`value` reads one): register i holds two
// elements, the lower-indexed in its low 16 bits: a0 = A[g][2t..],
// a1 = A[g+8][2t..], a2 = A[g][2t+8..], a3 = A[g+8][2t+8..];
// b0 = B[2t..][g], b1 = B[2t+8..][g].
inline void MmaM16N8K16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1,
                        float (*value)(uint16_t)) {
  auto half_of = [value](uint32_t word, int k) {
    return value(static_cast<uint16_t>(k % 2 == 0 ? word & 0xffffu : word >> 16));
  };
  WarpMma<16>(
      d, a, b0, b1,
      [&](Words words, int row, int k) {
        return half_of(words[(row % 8) * 4 + (k % 8) / 2][(row >= 8 ? 1 : 0) + (k >= 8 ? 2 : 0)],
                       k);
      },
      [&](Words words, int k, int col) {
        return half_of(words[col * 4 + (k % 8) / 2][4 + (k >= 8)], k);
      });
}

// How the emulated tf32 mma adds its products to the accumulator.
// kFused: an fp32 fma per product, in k order, each rounded to nearest.
// kTruncated: as Fasi, Higham, Mikaitis and Pranesh measured NVIDIA's tensor
// cores ("Numerical behavior of NVIDIA tensor cores", PeerJ CS 2021): the
// products (exact: two 11-bit significands) and the accumulator aligned to
// the largest exponent among them, each cut to 24 bits below that
// exponent's leading bit (tf32_accumulation_bits) toward zero, summed, and
// the sum cut to fp32 toward zero. Each mma then errs toward zero by up to an ulp of its
// result, and a long chain of mma into one accumulator adds those errors
// up instead of letting them cancel.
enum class Tf32Accumulation { kFused, kTruncated };
inline std::atomic<Tf32Accumulation> tf32_accumulation{Tf32Accumulation::kFused};

// kTruncated's bits kept below the largest addend's leading bit (its own
// included): 24, fp32's significand, in the paper's measurements of the
// V100, T4 and A100; fewer where a GPU keeps fewer.
inline std::atomic<int> tf32_accumulation_bits{24};

// Sets tf32_accumulation (and the bits it keeps) for a scope (a test).
class ScopedTf32Accumulation {
 public:
  explicit ScopedTf32Accumulation(Tf32Accumulation mode, int bits = 24)
      : old_(tf32_accumulation.load()), old_bits_(tf32_accumulation_bits.load()) {
    tf32_accumulation = mode;
    tf32_accumulation_bits = bits;
  }
  ~ScopedTf32Accumulation() {
    tf32_accumulation = old_;
    tf32_accumulation_bits = old_bits_;
  }

 private:
  Tf32Accumulation old_;
  int old_bits_;
};

// x toward zero to a multiple of 2^exponent.
inline double TruncateTo(double x, int exponent) {
  return std::trunc(std::ldexp(x, -exponent)) * std::ldexp(1.0, exponent);
}

// acc + sum_k a[k] b[k] as kTruncated sums them (the products exact).
struct TruncatedSum {
  template <int K>
  float operator()(float acc, const float (&a)[K], const float (&b)[K]) const {
    double products[K];
    int top = INT32_MIN;
    if (acc != 0.0f) top = std::ilogb(acc);
    for (int k = 0; k < K; ++k) {
      products[k] = static_cast<double>(a[k]) * b[k];
      if (products[k] != 0.0) top = std::max(top, std::ilogb(products[k]));
    }
    if (top == INT32_MIN) return 0.0f * acc;  // every addend zero
    const int unit = top - (tf32_accumulation_bits.load() - 1);
    double sum = TruncateTo(acc, unit);
    for (int k = 0; k < K; ++k) sum += TruncateTo(products[k], unit);
    if (sum == 0.0 || !std::isfinite(sum)) return static_cast<float>(sum);
    return static_cast<float>(TruncateTo(sum, std::ilogb(sum) - 23));
  }
};

// mma.m16n8k8 .tf32 (layouts at the top).
inline void MmaM16N8K8Tf32(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  const auto read_a = [](Words words, int row, int k) {
    return Tf32Input(words[(row % 8) * 4 + k % 4][(row >= 8 ? 1 : 0) + (k >= 4 ? 2 : 0)]);
  };
  const auto read_b = [](Words words, int k, int col) {
    return Tf32Input(words[col * 4 + k % 4][4 + (k >= 4)]);
  };
  if (tf32_accumulation.load() == Tf32Accumulation::kFused) {
    WarpMma<8>(d, a, b0, b1, read_a, read_b);
  } else {
    WarpMma<8>(d, a, b0, b1, read_a, read_b, TruncatedSum{});
  }
}

}  // namespace attnserve::emu

#define threadIdx (::attnserve::emu::thread_idx)
#define blockIdx (::attnserve::emu::block_idx)
#define blockDim (::attnserve::emu::block_dim)
#define gridDim (::attnserve::emu::grid_dim)
// kernel<<<grid, block, shared, stream>>>(...) (engine/cuda/device_utils.cuh)
// The arguments are evaluated and copied when it is called, as CUDA copies
// a kernel's parameters; the launch runs when its stream's turn comes
// (cuda_runtime_emulator.h).
#define ATTNSERVE_LAUNCH(kernel, grid, block, shared, stream, ...)    \
  ::attnserve::emu::LaunchOn(stream, grid, block, shared,             \
                             [args = std::make_tuple(__VA_ARGS__)] { \
                               std::apply(kernel, args);             \
                             })

inline void __syncthreads() { ::attnserve::emu::block->sync.arrive_and_wait(); }
inline void __syncwarp(unsigned /*mask*/ = 0xffffffffu) {
  ::attnserve::emu::MyWarp().sync.arrive_and_wait();
}

inline float __shfl_xor_sync(unsigned /*mask*/, float value, int lane_mask) {
  using namespace ::attnserve::emu;
  Warp& w = MyWarp();
  const int lane = Lane();
  w.words[lane][0] = std::bit_cast<uint32_t>(value);
  w.sync.arrive_and_wait();
  const float other = std::bit_cast<float>(w.words[lane ^ lane_mask][0]);
  w.sync.arrive_and_wait();
  return other;
}

inline double __shfl_xor_sync(unsigned /*mask*/, double value, int lane_mask) {
  using namespace ::attnserve::emu;
  Warp& w = MyWarp();
  const int lane = Lane();
  std::memcpy(w.words[lane], &value, sizeof(value));
  w.sync.arrive_and_wait();
  double other;
  std::memcpy(&other, w.words[lane ^ lane_mask], sizeof(other));
  w.sync.arrive_and_wait();
  return other;
}

inline float __shfl_sync(unsigned /*mask*/, float value, int src_lane) {
  using namespace ::attnserve::emu;
  Warp& w = MyWarp();
  const int lane = Lane();
  w.words[lane][0] = std::bit_cast<uint32_t>(value);
  w.sync.arrive_and_wait();
  const float other = std::bit_cast<float>(w.words[src_lane % kWarpSize][0]);
  w.sync.arrive_and_wait();
  return other;
}

// Float arithmetic rounded as written (what the kernels ask for where a
// fused multiply-add would change the bits): volatile keeps the compiler
// from contracting them.
inline float __fmul_rn(float a, float b) {
  volatile float r = a * b;
  return r;
}
inline float __fadd_rn(float a, float b) {
  volatile float r = a + b;
  return r;
}
inline float __fsub_rn(float a, float b) {
  volatile float r = a - b;
  return r;
}
inline uint32_t __float_as_uint(float x) { return std::bit_cast<uint32_t>(x); }
inline float __uint_as_float(uint32_t x) { return std::bit_cast<float>(x); }
// CUDA's device min/max overloads for 64-bit integers.
inline int64_t min(int64_t a, int64_t b) { return a < b ? a : b; }
inline int64_t max(int64_t a, int64_t b) { return a > b ? a : b; }

namespace attnserve::cuda::flash {

inline void LoadMatrices(uint32_t (&r)[4], const void* row_address) {
  using namespace ::attnserve::emu;
  Warp& w = MyWarp();
  const int lane = Lane();
  RequireAligned(row_address, "ldmatrix row");
  w.address[lane] = row_address;
  w.sync.arrive_and_wait();
  for (int m = 0; m < 4; ++m) {
    std::memcpy(&r[m], static_cast<const unsigned char*>(w.address[8 * m + lane / 4]) +
                           4 * (lane % 4), 4);
  }
  w.sync.arrive_and_wait();
}

// .trans: matrix m read as 8x8 16-bit elements M[r][c] (row r from lane
// 8m + r, element c at byte 2c); lane l receives M[2 (l % 4)][l / 4] in the
// low half of r[m] and M[2 (l % 4) + 1][l / 4] in the high half.
inline void LoadMatricesTransposed(uint32_t (&r)[4], const void* row_address) {
  using namespace ::attnserve::emu;
  Warp& w = MyWarp();
  const int lane = Lane();
  RequireAligned(row_address, "ldmatrix.trans row");
  w.address[lane] = row_address;
  w.sync.arrive_and_wait();
  for (int m = 0; m < 4; ++m) {
    uint16_t lo, hi;
    const int row = 2 * (lane % 4), col = lane / 4;
    std::memcpy(&lo, static_cast<const unsigned char*>(w.address[8 * m + row]) + 2 * col, 2);
    std::memcpy(&hi, static_cast<const unsigned char*>(w.address[8 * m + row + 1]) + 2 * col, 2);
    r[m] = uint32_t{lo} | (uint32_t{hi} << 16);
  }
  w.sync.arrive_and_wait();
}

inline void CopyAsync16(void* dst, const void* src, bool valid) {
  ::attnserve::emu::RequireAligned(dst, "cp.async destination");
  if (valid) {
    ::attnserve::emu::RequireAligned(src, "cp.async source");
    std::memcpy(dst, src, 16);
  } else {
    std::memset(dst, 0, 16);
  }
}
inline void CommitCopies() {}
inline void WaitCopies() {}

}  // namespace attnserve::cuda::flash

namespace attnserve::cuda {
namespace {

// d += a * b (flash_attention_fp32.cu's MmaTf32 on a GPU).
inline void MmaTf32(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  ::attnserve::emu::MmaM16N8K8Tf32(d, a, b0, b1);
}

}  // namespace

// device_utils.cuh's Tf32High: cvt.rna.tf32.f32 (10 explicit mantissa bits,
// nearest, ties away from zero: add half of the dropped 13 bits' unit to
// the magnitude, then drop them), a finite x that would round to infinity
// truncated instead.
inline float Tf32High(float x) {
  const uint32_t bits = std::bit_cast<uint32_t>(x);
  if (std::isnan(x)) return x;
  const float hi = std::bit_cast<float>((bits + 0x1000u) & 0xffffe000u);
  if (std::isinf(hi) && !std::isinf(x)) return std::bit_cast<float>(bits & 0xffffe000u);
  return hi;
}

}  // namespace attnserve::cuda

// cuda_runtime.h's template overload, for a kernel's attributes (the
// emulation has no limits to raise).
template <typename Kernel>
inline cudaError_t cudaFuncSetAttribute(Kernel* /*kernel*/, cudaFuncAttribute /*attr*/,
                                        int /*value*/) {
  return cudaSuccess;
}

#endif  // ATTNSERVE_TESTS_UNIT_ENGINE_CUDA_WARP_EMULATOR_H_
