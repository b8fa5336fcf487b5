// Internal to the flash attention kernel: the work decomposition shared by
// the dispatcher (flash_attention.cc) and the per-ISA kernel files
// (flash_kernel_*.cc), which all include this before their target pragma.
#ifndef ATTNSERVE_ENGINE_CPU_FLASH_INTERNAL_H_
#define ATTNSERVE_ENGINE_CPU_FLASH_INTERNAL_H_

// Everything the kernel template (engine/cpu/flash_kernel/) uses is included
// here, outside any `#pragma GCC target` region: library code compiled inside
// such a region could be merged by the linker with the baseline copy (ODR),
// and then run AVX-512 instructions on a CPU without them.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <utility>

#include "engine/attention_params.h"
#include "engine/tensor.h"

namespace attnserve::cpu::flash {

// Virtual query rows per work item (see RequestPlan). 64 rows amortise the
// packing of each key block over enough rows, and keep an item's Q, S and O
// blocks (64 x 64 x 4 B each at head_dim 64) in L1/L2.
inline constexpr int64_t kBlockRows = 64;
// Most rows of one kFlash/kSplit item: its kBlockRows sub-blocks share each
// packed K/V block, which amortises the packing (a transpose) over up to 256
// rows. Items get fewer rows when a request would otherwise leave threads
// idle.
inline constexpr int64_t kItemRows = 256;
static_assert(kItemRows % kBlockRows == 0);
// Keys per inner block: the unit of online-softmax rescaling, K/V packing and
// causal skipping. Its score block (64 x 256 fp32 = 64 KiB) stays in L2.
inline constexpr int64_t kBlockKeys = 256;
// Packed key blocks are padded to a multiple of a kernel's own key alignment
// (Products::kKeyAlign: 16 for fp32 and AVX512_BF16, 64 for AMX), which
// divides this, the widest microkernel tile; padded keys are zero and masked.
inline constexpr int64_t kKeyAlign = 64;
// Most query rows per kv head (grouped heads x query positions) that the
// fp32 products compute straight from the K and V rows (QKDirect,
// PVDirect) instead of packing K transposed: up to 7 the direct path was
// faster (fp16 4k-token decode: 1.33-1.46x at 5 rows, 1.06-1.24x at 7), at
// 8 the packed one (docs/PERFORMANCE.md, "Grouped-query decode"). Also where
// bf16 inputs take the AVX-512 fp32 kernel instead of the bf16 one.
inline constexpr int64_t kDirectMaxRows = 7;
// Keys per chunk when a request's keys are split across threads (decode).
// A constant, so chunk boundaries depend only on the request's own Lk.
inline constexpr int64_t kSplitChunkKeys = 512;
// A request with at least this many (sequence, kv head) pairs is not split:
// it already has several items for each of 16 threads, and a whole row's
// item reads its keys in one pass with nothing to combine (decode B16 H16
// Lk1024: 1.10x at 2 threads, 1.03x at 1). A constant, so the split stays
// a property of the request alone.
inline constexpr int64_t kSplitMaxPairs = 64;
static_assert(kBlockKeys % kKeyAlign == 0 && kSplitChunkKeys % kBlockKeys == 0);
// Key blocks start at multiples of kBlockKeys, so a row's first block starts
// at or after FirstWindowKey (attention_params.h).
static_assert(kWindowGrainTokens % kBlockKeys == 0);

// Per-request constants, computed once by the dispatcher.
//
// "Virtual rows": the query rows of the `group` query heads that share one
// kv head are interleaved as v = i * group + local_head, so one work item
// packs each K/V block once for all of them (GQA without copying K/V), and
// causal limits stay monotone in v.
struct RequestPlan {
  const AttentionParams* p = nullptr;
  int64_t group = 1;           // num_heads / num_kv_heads
  float score_scale = 1.0f;    // scale * log2(e): softmax runs in base 2
  int64_t causal_offset = 0;   // kv_len - q_len
  int64_t dv_pad = 0;          // head_dim_v rounded up to 16
};

enum class ItemKind : uint8_t {
  kFlash,    // rows x all keys, online softmax, writes the output
  kSplit,    // rows x one key chunk, writes a partial (m, l, acc) per row
  kWeights,  // two passes (stats, then probabilities), writes weights + output
};

struct WorkItem {
  const RequestPlan* plan = nullptr;
  ItemKind kind = ItemKind::kFlash;
  int64_t b = 0;
  // kFlash/kSplit: the kv head. kWeights: query heads [head, head_end).
  int64_t head = 0, head_end = 0;
  // kFlash/kSplit: virtual rows [row0, row1). kWeights: query positions.
  int64_t row0 = 0, row1 = 0;
  // kSplit: the key chunk. Otherwise [0, kv_len).
  int64_t key0 = 0, key1 = 0;
  // kSplit: rows x PartialStride(plan) floats: m, l, then dv_pad accumulators.
  float* partial = nullptr;
  double cost = 0;
};

inline int64_t PartialStride(const RequestPlan& plan) { return plan.dv_pad + 2; }

// The per-ISA kernels: run one work item; false when scratch memory could not
// be allocated. Defined in flash_kernel_<isa>.cc.
bool RunItemScalar(const WorkItem& item);
bool RunItemAvx2(const WorkItem& item);
bool RunItemAvx512(const WorkItem& item);
bool RunItemAvx512Bf16(const WorkItem& item);
bool RunItemAmx(const WorkItem& item);

// Query row i sees keys [0, VisibleKeys) (before the bool/additive mask).
inline int64_t VisibleKeys(const RequestPlan& plan, int64_t b, int64_t i) {
  const AttentionParams& p = *plan.p;
  int64_t end = p.kv_len;
  if (p.key_lengths != nullptr) end = std::min(end, p.key_lengths[b]);
  end = std::min(end, KeyEndOfRow(i + plan.causal_offset, p.causal, p.window));
  return std::max<int64_t>(end, 0);
}

// Keys before WindowStart are outside query row i's sliding window or its
// chunk.
inline int64_t WindowStart(const RequestPlan& plan, int64_t i) {
  const AttentionParams& p = *plan.p;
  return FirstVisibleKey(i + plan.causal_offset, p.window, p.chunk);
}

// Scratch memory owned by one thread, grown on demand and reused by later
// calls (OpenMP keeps its worker threads), 64-byte aligned. Get returns
// nullptr when memory runs out (no exceptions inside OpenMP regions).
class ScratchBuffer {
 public:
  template <typename T>
  T* Get(size_t count) {
    const size_t bytes = count * sizeof(T) + 64;
    if (bytes > size_) {
      std::free(data_);
      size_ = std::max(bytes, size_ * 3 / 2);
      data_ = std::aligned_alloc(64, (size_ + 63) / 64 * 64);
      if (data_ == nullptr) {
        size_ = 0;
        return nullptr;
      }
    }
    return static_cast<T*>(data_);
  }
  ~ScratchBuffer() { std::free(data_); }

 private:
  void* data_ = nullptr;
  size_t size_ = 0;
};

inline int64_t RoundUp(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

}  // namespace attnserve::cpu::flash

#endif  // ATTNSERVE_ENGINE_CPU_FLASH_INTERNAL_H_
