// Chunks claimed from an atomic counter by the caller and the helpers; a job
// stays visible to helpers until its chunks run out, and the caller returns
// only once no helper holds it (payload_copier.h).
#include "server/transport/payload_copier.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>

#include "server/transport/copy_scan.h"

namespace attnserve {

struct PayloadCopier::Job {
  absl::Span<const absl::string_view> pieces;
  std::vector<size_t> starts;  // each piece's offset in the tensor
  char* dst = nullptr;
  size_t size = 0;
  int width = 0;
  bool stream = false;  // CopyAndScanBlocks (dst block-aligned, a large tensor)
  size_t chunks = 0;
  std::atomic<size_t> next{0};  // the next chunk to claim
  // Under the copier's mu_:
  int workers = 0;  // helpers inside RunChunks
  ValueScan scan;   // the helpers' chunks, merged
};

PayloadCopier::PayloadCopier(int helpers) {
  threads_.reserve(static_cast<size_t>(std::max(helpers, 0)));
  for (int i = 0; i < helpers; ++i) threads_.emplace_back([this] { HelperLoop(); });
}

PayloadCopier::~PayloadCopier() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  for (std::thread& t : threads_) t.join();
}

int PayloadCopier::DefaultHelpers() {
  const int hardware = static_cast<int>(std::thread::hardware_concurrency());
  return std::clamp(hardware - 1, 0, 7);
}

namespace {

// The index of the piece holding byte `at` of the tensor (the last piece
// starting at or before it, past any empty ones).
size_t PieceAt(const std::vector<size_t>& starts, absl::Span<const absl::string_view> pieces,
               size_t at) {
  size_t p = static_cast<size_t>(std::upper_bound(starts.begin(), starts.end(), at) -
                                 starts.begin() - 1);
  while (at - starts[p] >= pieces[p].size()) ++p;
  return p;
}

}  // namespace

void PayloadCopier::CopyChunk(const Job& job, size_t begin, size_t end, ValueScan* scan) {
  if (!job.stream) {
    // Each piece's part with memcpy (the bytes stay in this core's cache,
    // where a small tensor is read next), then one scan of the chunk.
    for (size_t at = begin, p = PieceAt(job.starts, job.pieces, begin); at < end; ++p) {
      const size_t offset = at - job.starts[p];
      const size_t take = std::min(job.pieces[p].size() - offset, end - at);
      std::memcpy(job.dst + at, job.pieces[p].data() + offset, take);
      at += take;
    }
    if (job.width > 0) {
      scan->Merge(ScanValues(job.dst + begin, static_cast<int64_t>((end - begin) / job.width),
                             job.width));
    }
    return;
  }
  // Runs of whole blocks inside one piece stream straight from it; a block
  // that straddles pieces is gathered first, as is the tensor's last,
  // partial block (copied and scanned plainly). `at` stays block-aligned:
  // chunks start at multiples of the block.
  for (size_t at = begin; at < end;) {
    const size_t p = PieceAt(job.starts, job.pieces, at);
    const size_t offset = at - job.starts[p];
    const size_t blocks =
        std::min(job.pieces[p].size() - offset, end - at) / kCopyBlockBytes * kCopyBlockBytes;
    if (blocks > 0) {
      CopyAndScanBlocks(job.dst + at, job.pieces[p].data() + offset, blocks, job.width, scan);
      at += blocks;
      continue;
    }
    alignas(kCopyBlockBytes) char block[kCopyBlockBytes];
    const size_t size = std::min(kCopyBlockBytes, end - at);
    for (size_t got = 0; got < size;) {
      const size_t q = PieceAt(job.starts, job.pieces, at + got);
      const size_t from = at + got - job.starts[q];
      const size_t take = std::min(job.pieces[q].size() - from, size - got);
      std::memcpy(block + got, job.pieces[q].data() + from, take);
      got += take;
    }
    if (size == kCopyBlockBytes) {
      CopyAndScanBlocks(job.dst + at, block, size, job.width, scan);
    } else {
      std::memcpy(job.dst + at, block, size);
      if (job.width > 0) {
        scan->Merge(ScanValues(block, static_cast<int64_t>(size / job.width), job.width));
      }
    }
    at += size;
  }
}

ValueScan PayloadCopier::RunChunks(Job& job) {
  ValueScan scan;
  scan.width = job.width;
  for (;;) {
    const size_t c = job.next.fetch_add(1, std::memory_order_relaxed);
    if (c >= job.chunks) break;
    const size_t begin = c * kChunkBytes;
    CopyChunk(job, begin, std::min(job.size, begin + kChunkBytes), &scan);
  }
  if (job.stream) FinishCopies();  // before the copies are handed on
  return scan;
}

void PayloadCopier::HelperLoop() {
  absl::MutexLock lock(&mu_);
  for (;;) {
    mu_.Await(absl::Condition(
        +[](PayloadCopier* c) ABSL_EXCLUSIVE_LOCKS_REQUIRED(c->mu_) {
          return c->stopping_ || !c->jobs_.empty();
        },
        this));
    if (stopping_) return;
    Job* job = jobs_.front();
    if (job->next.load(std::memory_order_relaxed) >= job->chunks) {
      jobs_.pop_front();  // every chunk is claimed: nothing here for helpers
      continue;
    }
    ++job->workers;
    mu_.Unlock();
    const ValueScan scan = RunChunks(*job);
    mu_.Lock();
    job->scan.Merge(scan);
    --job->workers;
  }
}

ValueScan PayloadCopier::Copy(absl::Span<const absl::string_view> pieces, char* dst, int width) {
  Job job;
  job.pieces = pieces;
  job.starts.reserve(pieces.size());
  for (const absl::string_view piece : pieces) {
    job.starts.push_back(job.size);
    job.size += piece.size();
  }
  job.dst = dst;
  job.width = width == 2 || width == 4 ? width : 0;
  job.stream = job.size >= kMinParallelBytes &&
               reinterpret_cast<uintptr_t>(dst) % kCopyBlockBytes == 0;
  job.scan.width = job.width;
  job.chunks = (job.size + kChunkBytes - 1) / kChunkBytes;
  const bool shared = !threads_.empty() && job.size >= kMinParallelBytes;
  if (shared) {
    absl::MutexLock lock(&mu_);
    jobs_.push_back(&job);
  }
  ValueScan scan = RunChunks(job);
  if (shared) {
    // Out of the queue, then wait for the helpers still copying its chunks.
    absl::MutexLock lock(&mu_);
    const auto it = std::find(jobs_.begin(), jobs_.end(), &job);
    if (it != jobs_.end()) jobs_.erase(it);
    mu_.Await(absl::Condition(+[](Job* j) { return j->workers == 0; }, &job));
    scan.Merge(job.scan);
  }
  return scan;
}

}  // namespace attnserve
