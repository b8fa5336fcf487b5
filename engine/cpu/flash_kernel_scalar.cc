// Portable fp32 instantiation of the flash attention kernel
// (engine/cpu/flash_kernel/): plain C++ for the baseline target, the fallback.
#include "engine/cpu/flash_internal.h"

#define ATTNSERVE_FLASH_KERNEL_FILE 1

namespace attnserve::cpu::flash {
namespace {
#include "engine/cpu/flash_kernel/common.h"
#include "engine/cpu/flash_kernel/vec_scalar.h"
#include "engine/cpu/flash_kernel/vec_rows.h"
#include "engine/cpu/flash_kernel/fp32_products.h"
#include "engine/cpu/flash_kernel/relative_embeddings.h"
#include "engine/cpu/flash_kernel/driver.h"
}  // namespace

bool RunItemScalar(const WorkItem& item) { return Kernel::Run(item); }

}  // namespace attnserve::cpu::flash
