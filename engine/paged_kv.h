// A session's paged K/V cache as one engine task sees it (server-side
// sessions, server/sessions/), and the engine-side helpers every backend
// shares: append a task's new K/V rows into the cache's blocks, point the
// attention params at the blocks, and, for a kernel that reads only
// contiguous K/V (and as the tests' oracle), gather them into scratch. The
// cpu flash kernel reads the blocks in place.
#ifndef ATTNSERVE_ENGINE_PAGED_KV_H_
#define ATTNSERVE_ENGINE_PAGED_KV_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "engine/attention_params.h"
#include "engine/dtype.h"

namespace attnserve {

// The block table of one session plus the geometry of its blocks. Block i
// holds tokens [i * block_tokens, (i + 1) * block_tokens): its K part is
// [num_kv_heads][block_tokens][head_dim] and its V part
// [num_kv_heads][block_tokens][head_dim_v], both `dtype` (the layout
// AttentionParams::k_blocks / v_blocks reads).
//
// Ownership: the server owns the blocks and the tables; they stay valid and
// are touched by nobody else while a task that points at them runs (a
// session has at most one request in flight).
struct PagedKv {
  DType dtype = DType::kFloat32;
  int64_t num_kv_heads = 0;
  int64_t head_dim = 0;
  int64_t head_dim_v = 0;
  // 0 = no cache (a stateless task). A multiple of kPagedBlockTokensMultiple.
  int64_t block_tokens = 0;
  // Tokens already cached before this task's rows.
  int64_t cached_len = 0;
  // Enough blocks for cached_len + the task's new rows.
  absl::Span<void* const> k_blocks;
  absl::Span<void* const> v_blocks;

  bool enabled() const { return block_tokens > 0; }
};

// The engine invariants of a paged task whose new rows are `new_rows` (the
// task's own key/value, already projected): geometry and dtype agree with
// `p` (the core params over the new rows), batch == 1, no key_lengths, no
// mask, no weights, and the tables hold enough blocks for
// cached_len + p.kv_len tokens, none null but those wholly before the first
// query's sliding window (FirstWindowKey). InvalidArgument naming the rule.
absl::Status CheckPagedKv(const PagedKv& cache, const AttentionParams& p);

// Copies `p`'s K/V rows (batch 0, p.kv_len rows, read through p's pointers
// and strides, p.dtype) into the cache at token positions
// [cached_len, cached_len + p.kv_len), converting to cache.dtype. Call
// CheckPagedKv first.
void AppendPagedRows(const PagedKv& cache, const AttentionParams& p);

// Turns `p` (core params over the new rows) into params over the whole
// cache: kv_len = cached_len + p->kv_len, K/V read from the blocks (k, v and
// their strides cleared). Requires p->dtype == cache.dtype.
void PointAtPagedKv(const PagedKv& cache, AttentionParams* p);

// Gather fallback for kernels that read only contiguous K/V: when
// p->k_blocks is set, copies the blocks into `scratch` as contiguous head
// layout [1, Hkv, kv_len, D] and rewrites `p` to read from there (k_blocks
// cleared); released (null) blocks read as zeros. No-op otherwise.
// `scratch` must outlive the use of `p`.
void GatherPagedKv(AttentionParams* p, std::vector<char>* scratch);

}  // namespace attnserve

#endif  // ATTNSERVE_ENGINE_PAGED_KV_H_
