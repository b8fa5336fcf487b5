// warp_emulator.h's fiber switch (fiber_switch.h): the System V x86-64
// calling convention's callee-saved state, pushed and popped around a
// change of stack pointer. Test-only; written here.
#include "tests/unit/engine/cuda/fiber_switch.h"

#include <cstdint>
#include <cstring>

#if !defined(__x86_64__)
#error "warp_emulator.h's fibers are written for x86-64"
#endif

// rdi = save, rsi = resume. The frame it leaves, from the saved stack
// pointer up: MXCSR (4 bytes), x87 control word (4), r15, r14, r13, r12,
// rbx, rbp, return address.
asm(R"(
  .pushsection .text
  .globl attnserve_emu_fiber_switch
  .type attnserve_emu_fiber_switch, @function
attnserve_emu_fiber_switch:
  .cfi_startproc
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $8, %rsp
  stmxcsr (%rsp)
  fnstcw 4(%rsp)
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  ldmxcsr (%rsp)
  fldcw 4(%rsp)
  addq $8, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .cfi_endproc
  .size attnserve_emu_fiber_switch, .-attnserve_emu_fiber_switch
  .popsection
)");

namespace attnserve::emu {

void* NewFiber(char* stack, size_t bytes, void (*entry)()) {
  // The top, 16-byte aligned; below it a null return address for entry
  // (so entry starts with the stack aligned as after a call), entry itself
  // for the switch's ret, six zeroed registers and the default MXCSR and
  // x87 control word.
  auto top = reinterpret_cast<uintptr_t>(stack + bytes) & ~uintptr_t{15};
  auto* frame = reinterpret_cast<uint64_t*>(top) - 9;
  std::memset(frame, 0, 9 * sizeof(uint64_t));
  const uint32_t mxcsr = 0x1f80, fpu_control = 0x037f;
  std::memcpy(frame, &mxcsr, 4);
  std::memcpy(reinterpret_cast<char*>(frame) + 4, &fpu_control, 4);
  frame[7] = reinterpret_cast<uint64_t>(entry);  // popped by ret
  frame[8] = 0;                                  // entry's return address
  return frame;
}

}  // namespace attnserve::emu
