// One pass over a float tensor's values read as bit patterns: what the values
// rules of validation.h need (any NaN or Inf, the largest magnitude, the
// largest positive value), in a form that chunks of one tensor, scanned apart
// and merged, give exactly as one scan of the whole. A front end that copies
// a tensor's bytes off the wire scans each chunk as it lands
// (InputTensor::scan), so that validation need not read the bytes again.
#ifndef ATTNSERVE_SERVER_REQUEST_VALUE_SCAN_H_
#define ATTNSERVE_SERVER_REQUEST_VALUE_SCAN_H_

#include <algorithm>
#include <cstdint>

namespace attnserve {

// The bit layout of a float dtype read as a signed integer of its width: with
// the sign cleared, a pattern above +Inf (exponent all ones, mantissa zero) is
// NaN and finite magnitudes order as their patterns do; read signed, every
// negative float is below every positive one. So two integer max reductions
// find the largest |x|, the largest positive x, and any NaN or Inf.
struct ValueScan {
  // Bytes per value the patterns were read as: 2 (FLOAT16, BFLOAT16, which
  // share the sign bit) or 4 (FLOAT32).
  int width = 0;
  // Largest magnitude pattern (sign cleared): above the dtype's +Inf
  // pattern: a NaN exists; equal: an Inf and no NaN.
  int32_t max_abs_bits = 0;
  // Largest pattern among values with the sign bit clear (NaN above +Inf
  // above every finite value); 0 when none is positive.
  int32_t max_positive_bits = 0;

  // This scan and `other` (of the same width) as one scan of both.
  void Merge(const ValueScan& other) {
    max_abs_bits = std::max(max_abs_bits, other.max_abs_bits);
    max_positive_bits = std::max(max_positive_bits, other.max_positive_bits);
  }
};

// The scan of the `n` values of `width` bytes (2 or 4) at `data`, which need
// not be aligned. Reads at memory speed (vectorised; value_scan.cc).
ValueScan ScanValues(const void* data, int64_t n, int width);

}  // namespace attnserve

#endif  // ATTNSERVE_SERVER_REQUEST_VALUE_SCAN_H_
