// The context switch of warp_emulator.h's fibers (fiber_switch.cc): x86-64
// only, no system call (glibc's swapcontext makes one per switch to save
// the signal mask, which the emulation's barriers do not need). Test-only;
// written here.
#ifndef ATTNSERVE_TESTS_UNIT_ENGINE_CUDA_FIBER_SWITCH_H_
#define ATTNSERVE_TESTS_UNIT_ENGINE_CUDA_FIBER_SWITCH_H_

#include <cstddef>

namespace attnserve::emu {

// Saves the running context's callee-saved registers, MXCSR and x87
// control word on its stack and its stack pointer in *save, then resumes
// the context whose stack pointer is `resume` (saved by an earlier switch,
// or made by NewFiber). Returns when something switches back to *save.
extern "C" void attnserve_emu_fiber_switch(void** save, void* resume);

// The stack pointer of a fiber that starts by calling entry() on the
// `bytes` of `stack` (entry must never return: it switches away at its end).
void* NewFiber(char* stack, size_t bytes, void (*entry)());

}  // namespace attnserve::emu

#endif  // ATTNSERVE_TESTS_UNIT_ENGINE_CUDA_FIBER_SWITCH_H_
