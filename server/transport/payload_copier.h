// Copies a request tensor's bytes from gRPC's slices into the host buffer the
// engine reads them from (attend_wire.h, kserve_wire.h), and scans the values
// as each chunk lands (value_scan.h), so that validation need not read the
// bytes a second time. A large tensor is copied in chunks by the calling
// thread together with whichever of a few helper threads are free: one
// thread copied about 6 GB/s of gRPC's slices with memcpy, a 12 MiB request
// took 2 ms, several times what the GPU takes to upload it (docs/CUDA.md,
// "the served path"). A large tensor's chunks are copied with streaming
// stores and scanned on the way (copy_scan.h). The caller always copies
// too, so a busy pool only means the caller does more of the chunks itself.
//
// Written here: neither gRPC nor abseil has a public thread pool, and the
// task is a parallel memcpy with a scan, not a general executor.
#ifndef ATTNSERVE_SERVER_TRANSPORT_PAYLOAD_COPIER_H_
#define ATTNSERVE_SERVER_TRANSPORT_PAYLOAD_COPIER_H_

#include <cstddef>
#include <deque>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "server/request/value_scan.h"

namespace attnserve {

// Thread-safe: any number of threads may Copy at once.
class PayloadCopier {
 public:
  // Bytes per chunk: a multiple of every value width, and small enough to be
  // scanned from the core's cache right after it is copied.
  static constexpr size_t kChunkBytes = size_t{256} << 10;
  // Tensors smaller than this are copied by the caller alone (waking a
  // helper costs more than it saves), with memcpy, and scanned from the
  // cache after each chunk (the engine reads a small tensor next, from the
  // cache); from this size on, into a 64-byte aligned buffer, with
  // streaming stores (copy_scan.h).
  static constexpr size_t kMinParallelBytes = size_t{1} << 20;

  // Starts `helpers` threads (0: the caller copies every chunk).
  explicit PayloadCopier(int helpers);
  // Stops and joins the helpers. No Copy may be running.
  ~PayloadCopier();
  PayloadCopier(const PayloadCopier&) = delete;
  PayloadCopier& operator=(const PayloadCopier&) = delete;

  // One helper per hardware thread beyond the first, at most 7 (the
  // server's default where no CPU quota says fewer: server/main.cc).
  static int DefaultHelpers();

  int helpers() const { return static_cast<int>(threads_.size()); }

  // Copies `pieces` (the tensor's bytes, in order) to `dst` (their total
  // size, not overlapping them). With `width` 2 or 4, also returns the scan
  // of the copied bytes as values of that width (a last partial value is
  // not scanned); else a scan of width 0.
  ValueScan Copy(absl::Span<const absl::string_view> pieces, char* dst, int width);

 private:
  struct Job;
  // Copies and scans chunks of `job` until none is left; returns their scan.
  static ValueScan RunChunks(Job& job);
  // Copies bytes [begin, end) of `job`'s tensor and merges their scan into
  // `*scan`.
  static void CopyChunk(const Job& job, size_t begin, size_t end, ValueScan* scan);
  void HelperLoop();

  absl::Mutex mu_;
  std::deque<Job*> jobs_ ABSL_GUARDED_BY(mu_);  // jobs that may still have chunks
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> threads_;
};

}  // namespace attnserve

#endif  // ATTNSERVE_SERVER_TRANSPORT_PAYLOAD_COPIER_H_
