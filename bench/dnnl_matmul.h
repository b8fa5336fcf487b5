// oneDNN fp32 matmuls over caller-owned strided buffers, with the primitives
// built once per shape and kept in a bounded cache: the per-request GEMMs
// that bench/stacked_gemm_probe compares chunked stacking against.
#ifndef ATTNSERVE_BENCH_DNNL_MATMUL_H_
#define ATTNSERVE_BENCH_DNNL_MATMUL_H_

#include <cstddef>
#include <cstdint>
#include <list>
#include <map>
#include <memory>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "oneapi/dnnl/dnnl.hpp"

namespace attnserve::bench {

// dst = src x wei (+ bias), all FLOAT32. Dims follow oneDNN matmul: src
// [..., M, K], wei [..., K, N], dst [..., M, N] with equal ranks (2..5);
// a batch dim of wei may be 1 to broadcast it. Strides are in elements and
// may describe any non-overlapping layout (transposed weights, heads inside
// a token-layout row, ...). bias, when present, is [N] contiguous.
struct MatmulShape {
  std::vector<int64_t> src_dims, src_strides;
  std::vector<int64_t> wei_dims, wei_strides;
  std::vector<int64_t> dst_dims, dst_strides;
  bool has_bias = false;

  // Flattened, for the cache key.
  std::vector<int64_t> Key() const;
};

// A process-lifetime set of fp32 matmul primitives keyed by MatmulShape.
//
// Thread safety: Execute may be called concurrently. The cache is guarded by
// a mutex held only for look-up and insertion; primitives are created
// outside it, and each execution gets its own scratchpad, so concurrent
// executions of one primitive never share memory.
class MatmulCache {
 public:
  // `capacity`: primitives kept; the least recently used one is dropped
  // beyond it (a request shape not seen for a long time is rebuilt).
  explicit MatmulCache(size_t capacity = 1024);

  // Runs the matmul on `stream` and waits for it. Errors (Internal) carry
  // oneDNN's message; nothing is thrown.
  absl::Status Execute(const MatmulShape& shape, const float* src, const float* wei,
                       const float* bias, float* dst, dnnl::stream& stream);

  const dnnl::engine& engine() const { return engine_; }
  // Primitives currently cached (for tests and metrics).
  size_t size() const;

 private:
  struct Entry {
    dnnl::matmul primitive;
    dnnl::memory::desc src, wei, bias, dst, scratchpad;
    size_t scratchpad_bytes = 0;
  };
  using Key = std::vector<int64_t>;

  std::shared_ptr<const Entry> Lookup(const Key& key);
  std::shared_ptr<const Entry> Create(const MatmulShape& shape);  // may throw dnnl::error

  const size_t capacity_;
  dnnl::engine engine_;
  mutable absl::Mutex mu_;
  // Most recently used at the front.
  std::list<std::pair<Key, std::shared_ptr<const Entry>>> lru_ ABSL_GUARDED_BY(mu_);
  std::map<Key, decltype(lru_)::iterator> index_ ABSL_GUARDED_BY(mu_);
};

}  // namespace attnserve::bench

#endif  // ATTNSERVE_BENCH_DNNL_MATMUL_H_
