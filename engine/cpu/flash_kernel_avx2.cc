// AVX2 + FMA fp32 instantiation of the flash attention kernel
// (engine/cpu/flash_kernel/).
// Compiled for its instruction set through a target pragma, so the library
// still runs on CPUs without it (the dispatcher checks cpuid first).
#include <immintrin.h>

#include "engine/cpu/flash_internal.h"

#pragma GCC push_options
// GCC 12's AVX-512 intrinsics trip a false -Wmaybe-uninitialized
// (_mm512_undefined_*) once inlined.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC target("avx2,fma,f16c")
#if defined(__clang__)  // clang ignores GCC's target pragma (the fuzz build)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#endif
#define ATTNSERVE_FLASH_KERNEL_FILE 1

namespace attnserve::cpu::flash {
namespace {
#include "engine/cpu/flash_kernel/common.h"
#include "engine/cpu/flash_kernel/vec_avx2.h"
#include "engine/cpu/flash_kernel/vec_rows.h"
#include "engine/cpu/flash_kernel/fp32_products.h"
#include "engine/cpu/flash_kernel/relative_embeddings.h"
#include "engine/cpu/flash_kernel/driver.h"
}  // namespace

bool RunItemAvx2(const WorkItem& item) { return Kernel::Run(item); }

}  // namespace attnserve::cpu::flash
#if defined(__clang__)
#pragma clang attribute pop
#endif
#pragma GCC diagnostic pop
#pragma GCC pop_options
