// The scan loops, vectorised (value_scan.h).
#include "server/request/value_scan.h"

#include <cstring>

namespace attnserve {
namespace {

// GCC vectorises loops only from -O3 (or with -ftree-vectorize); this loop
// is the whole cost of the values rules, and vectorised it reads at memory
// speed (docs/OPERATIONS.md has the measurement against memcpy). Clang vectorises
// at -O2. On x86-64 the loop is also built for AVX2, picked at load time where
// the CPU has it: baseline x86-64 (SSE2) has a 16-bit integer max but no
// 32-bit one, so the fp32 scan emulated it in four instructions and ran at a
// third of the fp16 scan's speed. (Clang 14 multiversions no templates: the
// clones are the two functions below, the loop inlined into each.) Not
// under ThreadSanitizer: the loader calls a clone's resolver before TSan's
// runtime has started, and TSan instruments the resolver (a segfault at load).
#if defined(__GNUC__) && !defined(__clang__)
#define ATTNSERVE_VECTORIZE_LOOP __attribute__((optimize("tree-vectorize")))
#else
#define ATTNSERVE_VECTORIZE_LOOP
#endif
#if defined(__x86_64__) && !defined(__SANITIZE_THREAD__)
#define ATTNSERVE_VECTORIZE \
  ATTNSERVE_VECTORIZE_LOOP __attribute__((target_clones("avx2", "default")))
#else
#define ATTNSERVE_VECTORIZE ATTNSERVE_VECTORIZE_LOOP
#endif

// The values as patterns of `Bits` (memcpy: the data need not be aligned,
// and compilers turn it into a plain load).
template <typename Bits>
[[gnu::always_inline]] inline void ScanBits(const char* p, int64_t n, Bits abs_mask,
                                            ValueScan* scan) {
  Bits max_abs = 0, max_positive = 0;
  for (int64_t i = 0; i < n; ++i) {
    Bits b;
    std::memcpy(&b, p + i * static_cast<int64_t>(sizeof(Bits)), sizeof(Bits));
    max_abs = std::max<Bits>(max_abs, static_cast<Bits>(b & abs_mask));
    max_positive = std::max<Bits>(max_positive, b);
  }
  scan->max_abs_bits = max_abs;
  scan->max_positive_bits = max_positive;
}

ATTNSERVE_VECTORIZE void Scan32(const char* data, int64_t n, ValueScan* scan) {
  ScanBits<int32_t>(data, n, 0x7fffffff, scan);
}

ATTNSERVE_VECTORIZE void Scan16(const char* data, int64_t n, ValueScan* scan) {
  ScanBits<int16_t>(data, n, 0x7fff, scan);
}

}  // namespace

ValueScan ScanValues(const void* data, int64_t n, int width) {
  ValueScan scan;
  scan.width = width;
  if (width == 4) {
    Scan32(static_cast<const char*>(data), n, &scan);
  } else if (width == 2) {
    Scan16(static_cast<const char*>(data), n, &scan);
  }
  return scan;
}

}  // namespace attnserve
