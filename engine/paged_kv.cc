// Appending to, pointing at and gathering from a session's paged K/V blocks.
#include "engine/paged_kv.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "engine/tensor.h"

namespace attnserve {
namespace {

// Copies `n` elements from `src` (src_dtype) to `dst` (dst_dtype).
void CopyRow(const char* src, DType src_dtype, char* dst, DType dst_dtype, int64_t n) {
  if (src_dtype == dst_dtype) {
    std::memcpy(dst, src, static_cast<size_t>(n) * DTypeSize(src_dtype));
    return;
  }
  for (int64_t i = 0; i < n; ++i) StoreFromFloat(dst_dtype, dst, i, LoadAsFloat(src_dtype, src, i));
}

// One of K or V: rows [first, first + rows) of every head.
struct Part {
  const void* data;
  int64_t stride_h, stride_row, dim;
  absl::Span<void* const> blocks;
};

}  // namespace

absl::Status CheckPagedKv(const PagedKv& cache, const AttentionParams& p) {
  auto fail = [](auto&&... parts) {
    return absl::InvalidArgumentError(absl::StrCat("paged kv: ", parts...));
  };
  if (cache.block_tokens <= 0 || cache.block_tokens % kPagedBlockTokensMultiple != 0) {
    return fail("block_tokens must be a positive multiple of ", kPagedBlockTokensMultiple,
                ", got ", cache.block_tokens);
  }
  if (p.batch != 1) return fail("batch must be 1, got ", p.batch);
  if (p.num_kv_heads != cache.num_kv_heads || p.head_dim != cache.head_dim ||
      p.head_dim_v != cache.head_dim_v) {
    return fail("new rows have Hkv=", p.num_kv_heads, " Dk=", p.head_dim, " Dv=", p.head_dim_v,
                ", the cache Hkv=", cache.num_kv_heads, " Dk=", cache.head_dim,
                " Dv=", cache.head_dim_v);
  }
  if (p.key_lengths != nullptr || p.mask.kind != MaskParams::Kind::kNone ||
      p.weights != nullptr) {
    return fail("key_lengths, masks and weights are not supported on a session");
  }
  if (cache.cached_len < 0 || p.kv_len < 1) {
    return fail("cached_len must be >= 0 and new rows >= 1, got ", cache.cached_len, " and ",
                p.kv_len);
  }
  const int64_t total = cache.cached_len + p.kv_len;
  const int64_t blocks = (total + cache.block_tokens - 1) / cache.block_tokens;
  if (static_cast<int64_t>(cache.k_blocks.size()) < blocks ||
      static_cast<int64_t>(cache.v_blocks.size()) < blocks) {
    return fail(total, " tokens need ", blocks, " blocks, the table has ", cache.k_blocks.size());
  }
  // Blocks wholly before the first query's window may have been released.
  const int64_t first =
      FirstWindowKey(cache.cached_len + p.kv_len - p.q_len, p.window, p.chunk) /
      cache.block_tokens;
  for (int64_t i = first; i < blocks; ++i) {
    if (cache.k_blocks[i] == nullptr || cache.v_blocks[i] == nullptr) {
      return fail("block ", i, " is null (the first ", first,
                  " may be: released outside the sliding window)");
    }
  }
  return absl::OkStatus();
}

void AppendPagedRows(const PagedKv& cache, const AttentionParams& p) {
  const size_t src_size = DTypeSize(p.dtype), dst_size = DTypeSize(cache.dtype);
  const int64_t bt = cache.block_tokens;
  const Part parts[] = {
      {p.k, p.k_stride_h, p.k_stride_row, cache.head_dim, cache.k_blocks},
      {p.v, p.v_stride_h, p.v_stride_row, cache.head_dim_v, cache.v_blocks},
  };
  for (const Part& part : parts) {
    for (int64_t h = 0; h < cache.num_kv_heads; ++h) {
      for (int64_t r = 0; r < p.kv_len; ++r) {
        const int64_t pos = cache.cached_len + r;
        char* block = static_cast<char*>(part.blocks[pos / bt]);
        char* dst = block + ((h * bt + pos % bt) * part.dim) * static_cast<int64_t>(dst_size);
        const char* src = static_cast<const char*>(part.data) +
                          (h * part.stride_h + r * part.stride_row) * static_cast<int64_t>(src_size);
        CopyRow(src, p.dtype, dst, cache.dtype, part.dim);
      }
    }
  }
}

void PointAtPagedKv(const PagedKv& cache, AttentionParams* p) {
  p->kv_len = cache.cached_len + p->kv_len;
  p->k = p->v = nullptr;
  p->k_stride_b = p->k_stride_h = p->k_stride_row = 0;
  p->v_stride_b = p->v_stride_h = p->v_stride_row = 0;
  p->k_blocks = cache.k_blocks.data();
  p->v_blocks = cache.v_blocks.data();
  p->block_tokens = cache.block_tokens;
}

void GatherPagedKv(AttentionParams* p, std::vector<char>* scratch) {
  if (p->k_blocks == nullptr) return;
  const size_t elem = DTypeSize(p->dtype);
  const int64_t hkv = p->num_kv_heads, len = p->kv_len, bt = p->block_tokens;
  const int64_t k_elems = hkv * len * p->head_dim, v_elems = hkv * len * p->head_dim_v;
  scratch->resize(static_cast<size_t>(k_elems + v_elems) * elem);
  char* k = scratch->data();
  char* v = k + k_elems * static_cast<int64_t>(elem);
  struct Copy {
    const void* const* blocks;
    int64_t dim;
    char* dst;
  };
  for (const Copy& c : {Copy{p->k_blocks, p->head_dim, k}, Copy{p->v_blocks, p->head_dim_v, v}}) {
    const int64_t row_bytes = c.dim * static_cast<int64_t>(elem);
    for (int64_t h = 0; h < hkv; ++h) {
      for (int64_t start = 0; start < len; start += bt) {
        const int64_t rows = std::min(bt, len - start);
        char* dst = c.dst + (h * len + start) * row_bytes;
        if (c.blocks[start / bt] == nullptr) {  // released: outside every window
          std::memset(dst, 0, static_cast<size_t>(rows * row_bytes));
          continue;
        }
        const char* src = static_cast<const char*>(c.blocks[start / bt]) + h * bt * row_bytes;
        std::memcpy(dst, src, static_cast<size_t>(rows * row_bytes));
      }
    }
  }
  p->k = k;
  p->v = v;
  p->k_blocks = p->v_blocks = nullptr;
  p->block_tokens = 0;
  HeadLayoutStrides(hkv, len, p->head_dim, &p->k_stride_b, &p->k_stride_h, &p->k_stride_row);
  HeadLayoutStrides(hkv, len, p->head_dim_v, &p->v_stride_b, &p->v_stride_h, &p->v_stride_row);
}

}  // namespace attnserve
