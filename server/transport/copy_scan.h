// The inner loop of PayloadCopier (payload_copier.h): a run of a tensor's
// bytes copied into its buffer with streaming stores, and scanned as values
// (value_scan.h) from the registers that carry them, in one read of the
// source. Streaming stores skip the cache (the bytes go to the engine, or to
// the GPU, not back to this core) and so do not first read each destination
// line as ordinary stores do: half the memory traffic of a memcpy made of
// gRPC's 16 KiB slices, and no second pass for the scan.
#ifndef ATTNSERVE_SERVER_TRANSPORT_COPY_SCAN_H_
#define ATTNSERVE_SERVER_TRANSPORT_COPY_SCAN_H_

#include <cstddef>

#include "server/request/value_scan.h"

namespace attnserve {

// The byte multiple CopyAndScanBlocks works in, and its destination's
// alignment.
inline constexpr size_t kCopyBlockBytes = 64;

// Copies `bytes` (a multiple of kCopyBlockBytes) from `src` (any alignment)
// to `dst` (aligned to kCopyBlockBytes), and with `width` 2 or 4 merges the
// scan of those bytes as values of that width into `*scan`. With AVX2 the
// stores stream (then FinishCopies before another thread reads `dst`);
// without it, or under a sanitizer, it is memcpy and ScanValues.
void CopyAndScanBlocks(char* dst, const char* src, size_t bytes, int width, ValueScan* scan);

// Makes this thread's streaming stores visible before its later stores (a
// store fence): call after CopyAndScanBlocks, before handing `dst` on.
void FinishCopies();

}  // namespace attnserve

#endif  // ATTNSERVE_SERVER_TRANSPORT_COPY_SCAN_H_
