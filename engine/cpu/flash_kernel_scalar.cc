// Portable fp32 instantiation of the flash attention kernel
// (flash_kernel_impl.h): plain C++ for the baseline target, the fallback.
#include "engine/cpu/flash_internal.h"

#define ATTNSERVE_FLASH_KERNEL_FILE 1
#define ATTNSERVE_FLASH_VEC_SCALAR 1
#define ATTNSERVE_FLASH_FP32 1

namespace attnserve::cpu::flash {
namespace {
#include "engine/cpu/flash_kernel_impl.h"
}  // namespace

bool RunItemScalar(const WorkItem& item) { return Kernel::Run(item); }

}  // namespace attnserve::cpu::flash
