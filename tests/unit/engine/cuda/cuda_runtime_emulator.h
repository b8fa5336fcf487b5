// Host stand-ins for the CUDA runtime (cuda_runtime_emulator.cc: one sm_90
// device, host memory, streams and events that run nothing), for code
// compiled on warp_emulator.h. What a test may change of the emulated device.
// Test-only; written here.
#ifndef ATTNSERVE_TESTS_UNIT_ENGINE_CUDA_CUDA_RUNTIME_EMULATOR_H_
#define ATTNSERVE_TESTS_UNIT_ENGINE_CUDA_CUDA_RUNTIME_EMULATOR_H_

namespace attnserve::emu {

// The device's opt-in shared memory per block (cudaDevAttrMaxSharedMemoryPerBlockOptin),
// 227 KiB unless a test sets it before the code under test first asks.
int& MaxSharedOptin();

}  // namespace attnserve::emu

#endif  // ATTNSERVE_TESTS_UNIT_ENGINE_CUDA_CUDA_RUNTIME_EMULATOR_H_
