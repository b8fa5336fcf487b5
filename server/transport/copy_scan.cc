// AVX2 streaming copy with the scan's two max reductions (copy_scan.h),
// picked at run time; memcpy and ScanValues elsewhere.
#include "server/transport/copy_scan.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <iterator>
#include <type_traits>

#if defined(__x86_64__) && !defined(__SANITIZE_THREAD__) && !defined(__SANITIZE_ADDRESS__)
#define ATTNSERVE_COPY_SCAN_AVX2 1
#include <immintrin.h>
#endif

namespace attnserve {
namespace {

void PortableCopyAndScan(char* dst, const char* src, size_t bytes, int width, ValueScan* scan) {
  std::memcpy(dst, src, bytes);
  if (width == 2 || width == 4) {
    scan->Merge(ScanValues(dst, static_cast<int64_t>(bytes) / width, width));
  }
}

#ifdef ATTNSERVE_COPY_SCAN_AVX2

// The signed max of 16-bit (kWidth 2, and 0, unused) or 32-bit lanes.
template <int kWidth>
__attribute__((target("avx2"), always_inline)) inline __m256i Max(__m256i a, __m256i b) {
  return kWidth == 4 ? _mm256_max_epi32(a, b) : _mm256_max_epi16(a, b);
}

// Two 32-byte lanes per 64-byte block: loaded unaligned, streamed to the
// aligned destination, and for the scan masked (sign cleared) and maxed as
// signed integers of the value's width, as ScanBits does one by one.
template <int kWidth>
__attribute__((target("avx2"))) void StreamBlocks(char* dst, const char* src, size_t bytes,
                                                  ValueScan* scan) {
  const __m256i abs_mask =
      kWidth == 4 ? _mm256_set1_epi32(0x7fffffff) : _mm256_set1_epi16(0x7fff);
  __m256i max_abs = _mm256_setzero_si256(), max_positive = _mm256_setzero_si256();
  for (size_t i = 0; i < bytes; i += kCopyBlockBytes) {
    const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i));
    const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i + 32));
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i), x0);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i + 32), x1);
    if constexpr (kWidth != 0) {
      max_abs = Max<kWidth>(
          max_abs, Max<kWidth>(_mm256_and_si256(x0, abs_mask), _mm256_and_si256(x1, abs_mask)));
      max_positive = Max<kWidth>(max_positive, Max<kWidth>(x0, x1));
    }
  }
  if constexpr (kWidth != 0) {
    // The lanes' maxima, reduced as the scalar scan would.
    using Bits = std::conditional_t<kWidth == 4, int32_t, int16_t>;
    Bits abs_lanes[32 / sizeof(Bits)], positive_lanes[32 / sizeof(Bits)];
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(abs_lanes), max_abs);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(positive_lanes), max_positive);
    ValueScan run;
    run.width = kWidth;
    run.max_abs_bits = *std::max_element(std::begin(abs_lanes), std::end(abs_lanes));
    run.max_positive_bits =
        *std::max_element(std::begin(positive_lanes), std::end(positive_lanes));
    scan->Merge(run);
  }
}

bool HasAvx2() {
  static const bool has = __builtin_cpu_supports("avx2");
  return has;
}

#endif  // ATTNSERVE_COPY_SCAN_AVX2

}  // namespace

void CopyAndScanBlocks(char* dst, const char* src, size_t bytes, int width, ValueScan* scan) {
#ifdef ATTNSERVE_COPY_SCAN_AVX2
  if (HasAvx2()) {
    switch (width) {
      case 2: return StreamBlocks<2>(dst, src, bytes, scan);
      case 4: return StreamBlocks<4>(dst, src, bytes, scan);
      default: return StreamBlocks<0>(dst, src, bytes, scan);
    }
  }
#endif
  PortableCopyAndScan(dst, src, bytes, width, scan);
}

void FinishCopies() {
#ifdef ATTNSERVE_COPY_SCAN_AVX2
  if (HasAvx2()) _mm_sfence();
#endif
}

}  // namespace attnserve
