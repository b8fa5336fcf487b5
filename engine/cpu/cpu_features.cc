// CPU feature detection for the kernel dispatch: cpuid through the compiler's
// builtins, plus the Linux permission request that AMX tiles need.
#include "engine/cpu/cpu_features.h"

#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace attnserve::cpu {
namespace {

// Linux asks a process to opt in to AMX tile data (8 KiB of extra signal
// frame state) before its first tile instruction; the request is process
// wide and idempotent.
bool RequestAmxPermission() {
#if defined(__linux__) && defined(SYS_arch_prctl)
  constexpr int kArchReqXcompPerm = 0x1023;
  constexpr int kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
#else
  return false;
#endif
}

CpuFeatures Detect() {
  CpuFeatures f;
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  f.avx2_fma = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  f.avx512 = f.avx2_fma && __builtin_cpu_supports("avx512f") &&
             __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
             __builtin_cpu_supports("avx512dq");
  // GCC 12's __builtin_cpu_supports knows avx512bf16 but not the AMX bits,
  // so AMX is read from cpuid leaf 7 directly (EDX bit 22 AMX-BF16, bit 24
  // AMX-TILE).
  f.avx512_bf16 = f.avx512 && __builtin_cpu_supports("avx512bf16");
  unsigned eax = 7, ebx = 0, ecx = 0, edx = 0;
  __asm__ volatile("cpuid" : "+a"(eax), "=b"(ebx), "+c"(ecx), "=d"(edx));
  const bool amx_cpu = (edx >> 22 & 1) && (edx >> 24 & 1);
  f.amx_bf16 = f.avx512_bf16 && amx_cpu && RequestAmxPermission();
#endif
  return f;
}

}  // namespace

const CpuFeatures& GetCpuFeatures() {
  static const CpuFeatures features = Detect();
  return features;
}

std::string_view CpuIsaName(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::kScalar: return "scalar";
    case CpuIsa::kAvx2: return "avx2";
    case CpuIsa::kAvx512: return "avx512";
    case CpuIsa::kAvx512Bf16: return "bf16";
    case CpuIsa::kAmx: return "amx";
  }
  return "?";
}

std::optional<CpuIsa> ParseCpuIsa(std::string_view name) {
  for (CpuIsa isa : {CpuIsa::kScalar, CpuIsa::kAvx2, CpuIsa::kAvx512, CpuIsa::kAvx512Bf16,
                     CpuIsa::kAmx}) {
    if (name == CpuIsaName(isa)) return isa;
  }
  return std::nullopt;
}

bool CpuSupports(CpuIsa isa) {
  const CpuFeatures& f = GetCpuFeatures();
  switch (isa) {
    case CpuIsa::kScalar: return true;
    case CpuIsa::kAvx2: return f.avx2_fma;
    case CpuIsa::kAvx512: return f.avx512;
    case CpuIsa::kAvx512Bf16: return f.avx512_bf16;
    case CpuIsa::kAmx: return f.amx_bf16;
  }
  return false;
}

CpuIsa BestFp32Isa() {
  if (CpuSupports(CpuIsa::kAvx512)) return CpuIsa::kAvx512;
  if (CpuSupports(CpuIsa::kAvx2)) return CpuIsa::kAvx2;
  return CpuIsa::kScalar;
}

std::optional<CpuIsa> BestBf16Isa() {
  if (CpuSupports(CpuIsa::kAmx)) return CpuIsa::kAmx;
  if (CpuSupports(CpuIsa::kAvx512Bf16)) return CpuIsa::kAvx512Bf16;
  return std::nullopt;
}

}  // namespace attnserve::cpu
