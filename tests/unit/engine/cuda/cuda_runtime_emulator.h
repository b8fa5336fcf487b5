// Host stand-ins for the CUDA runtime (cuda_runtime_emulator.cc), for code
// compiled on warp_emulator.h: one sm_90 device whose memory is the host's.
//
// Streams model CUDA's ordering rules and nothing stronger, so that code
// which leaves out an event or a synchronisation gives a wrong result here
// rather than only sometimes on a GPU:
//   - work on a created stream (a copy, a memset, a kernel, a cuBLAS call)
//     runs only when the host has to see it: a stream, event or device
//     synchronisation, cudaFree/cudaFreeHost, a stream's destruction, or a
//     copy into pageable memory;
//   - then, of the streams whose next operation may run (a wait on an event
//     holds a stream until the event's record has run), it always runs the
//     one enqueued last: work that does not wait for what another stream
//     writes or still reads runs before it, wherever nothing enqueued
//     earlier on its own stream holds it back (a heuristic: one order, not
//     every order CUDA allows);
//   - copies read page-locked host memory (cudaHostAlloc) when they run, and
//     pageable memory when called, as CUDA does; fresh device and
//     page-locked memory holds 0xff bytes (NaN as floats);
//   - the legacy default stream (a null stream) runs its work at once,
//     after the blocking streams' (those created without
//     cudaStreamNonBlocking).
// Test-only; written here.
#ifndef ATTNSERVE_TESTS_UNIT_ENGINE_CUDA_CUDA_RUNTIME_EMULATOR_H_
#define ATTNSERVE_TESTS_UNIT_ENGINE_CUDA_CUDA_RUNTIME_EMULATOR_H_

#include <cuda_runtime_api.h>

#include <functional>

namespace attnserve::emu {

// The device's opt-in shared memory per block (cudaDevAttrMaxSharedMemoryPerBlockOptin),
// 227 KiB unless a test sets it before the code under test first asks.
int& MaxSharedOptin();

// Appends `work` to `stream` (a kernel launch, a library call): it runs as
// the rules above say; on the null stream, before this returns.
void Enqueue(cudaStream_t stream, std::function<void()> work);

}  // namespace attnserve::emu

#endif  // ATTNSERVE_TESTS_UNIT_ENGINE_CUDA_CUDA_RUNTIME_EMULATOR_H_
