// Which SIMD instruction sets this CPU (and OS) offers, and which kernel
// variant ("ISA") the CPU attention kernels run: detected once, forceable.
#ifndef ATTNSERVE_ENGINE_CPU_CPU_FEATURES_H_
#define ATTNSERVE_ENGINE_CPU_CPU_FEATURES_H_

#include <optional>
#include <string_view>

namespace attnserve::cpu {

struct CpuFeatures {
  bool avx2_fma = false;    // AVX2 + FMA + F16C
  bool avx512 = false;      // AVX-512 F, BW, VL, DQ
  bool avx512_bf16 = false; // AVX512_BF16 (vdpbf16ps, vcvtne2ps2bf16)
  // AMX-TILE + AMX-BF16, and the kernel granted this process the tile data
  // state (arch_prctl ARCH_REQ_XCOMP_PERM); without the grant the first tile
  // instruction would fault.
  bool amx_bf16 = false;
};

// Detected on first use (cpuid via __builtin_cpu_supports; the AMX grant is
// requested then, once per process). Thread-safe.
const CpuFeatures& GetCpuFeatures();

// A kernel variant. The order is "better" last among the fp32 ones and among
// the bf16 ones; kAvx512Bf16 and kAmx compute in bf16 (fp32 accumulation).
enum class CpuIsa {
  kScalar,      // portable C++, any x86-64 (the baseline and fallback)
  kAvx2,        // AVX2 + FMA, fp32
  kAvx512,      // AVX-512, fp32
  kAvx512Bf16,  // AVX-512 with vdpbf16ps dot products on bf16 inputs
  kAmx,         // AMX tiles (tdpbf16ps) for the products, AVX-512 for softmax
};

// "scalar", "avx2", "avx512", "bf16", "amx".
std::string_view CpuIsaName(CpuIsa isa);
// Inverse of CpuIsaName (exact, lower case); nullopt for anything else.
std::optional<CpuIsa> ParseCpuIsa(std::string_view name);
// True when `isa` computes the products in bf16.
inline bool IsBf16Isa(CpuIsa isa) { return isa == CpuIsa::kAvx512Bf16 || isa == CpuIsa::kAmx; }
// True when this CPU can run `isa`.
bool CpuSupports(CpuIsa isa);
// The fastest fp32 variant and the fastest bf16 variant (nullopt: no bf16
// instructions) this CPU supports.
CpuIsa BestFp32Isa();
std::optional<CpuIsa> BestBf16Isa();

// The environment variable that forces a variant for every kernel call that
// does not force one itself: ATTNSERVE_CPU_ISA=scalar|avx2|avx512|bf16|amx.
inline constexpr char kCpuIsaEnv[] = "ATTNSERVE_CPU_ISA";

}  // namespace attnserve::cpu

#endif  // ATTNSERVE_ENGINE_CPU_CPU_FEATURES_H_
