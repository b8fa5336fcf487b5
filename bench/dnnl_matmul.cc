// The matmul primitive cache: build once per shape, execute many times with
// a per-execution (user-mode) scratchpad.
#include "bench/dnnl_matmul.h"

#include <unordered_map>

#include "absl/strings/str_cat.h"

namespace attnserve::bench {

std::vector<int64_t> MatmulShape::Key() const {
  std::vector<int64_t> key;
  key.reserve(6 * src_dims.size() + 2);
  for (const auto* v : {&src_dims, &src_strides, &wei_dims, &wei_strides, &dst_dims,
                        &dst_strides}) {
    key.push_back(static_cast<int64_t>(v->size()));
    key.insert(key.end(), v->begin(), v->end());
  }
  key.push_back(has_bias ? 1 : 0);
  return key;
}

MatmulCache::MatmulCache(size_t capacity)
    : capacity_(capacity), engine_(dnnl::engine::kind::cpu, 0) {}

size_t MatmulCache::size() const {
  absl::MutexLock lock(&mu_);
  return lru_.size();
}

std::shared_ptr<const MatmulCache::Entry> MatmulCache::Lookup(const Key& key) {
  absl::MutexLock lock(&mu_);
  auto it = index_.find(key);
  if (it == index_.end()) return nullptr;
  lru_.splice(lru_.begin(), lru_, it->second);
  return it->second->second;
}

std::shared_ptr<const MatmulCache::Entry> MatmulCache::Create(const MatmulShape& shape) {
  using dt = dnnl::memory::data_type;
  auto entry = std::make_shared<Entry>();
  entry->src = dnnl::memory::desc(shape.src_dims, dt::f32, shape.src_strides);
  entry->wei = dnnl::memory::desc(shape.wei_dims, dt::f32, shape.wei_strides);
  entry->dst = dnnl::memory::desc(shape.dst_dims, dt::f32, shape.dst_strides);
  if (shape.has_bias) {
    // Bias [1, ..., 1, N] broadcasts over every dim but N.
    const size_t rank = shape.dst_dims.size();
    const int64_t n = shape.dst_dims[rank - 1];
    dnnl::memory::dims bias_dims(rank, 1), bias_strides(rank, n);
    bias_dims[rank - 1] = n;
    bias_strides[rank - 1] = 1;
    entry->bias = dnnl::memory::desc(bias_dims, dt::f32, bias_strides);
  }
  dnnl::primitive_attr attr;
  // Each execution brings its own scratchpad, so one primitive can run on
  // several threads at once without sharing scratch memory.
  attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
  dnnl::matmul::desc desc = shape.has_bias
                                ? dnnl::matmul::desc(entry->src, entry->wei, entry->bias,
                                                     entry->dst)
                                : dnnl::matmul::desc(entry->src, entry->wei, entry->dst);
  dnnl::matmul::primitive_desc pd(desc, attr, engine_);
  entry->scratchpad = pd.scratchpad_desc();
  entry->scratchpad_bytes = entry->scratchpad.get_size();
  entry->primitive = dnnl::matmul(pd);
  return entry;
}

absl::Status MatmulCache::Execute(const MatmulShape& shape, const float* src,
                                  const float* wei, const float* bias, float* dst,
                                  dnnl::stream& stream) {
  const size_t rank = shape.dst_dims.size();
  if (rank < 2 || shape.src_dims.size() != rank || shape.wei_dims.size() != rank ||
      shape.src_strides.size() != rank || shape.wei_strides.size() != rank ||
      shape.dst_strides.size() != rank) {
    return absl::InternalError("MatmulCache: dims and strides must share one rank >= 2");
  }
  try {
    const Key key = shape.Key();
    std::shared_ptr<const Entry> entry = Lookup(key);
    if (entry == nullptr) {
      // Built outside the lock: two threads may race to build the same shape;
      // the second insertion is simply dropped.
      entry = Create(shape);
      absl::MutexLock lock(&mu_);
      if (index_.find(key) == index_.end()) {
        lru_.emplace_front(key, entry);
        index_[key] = lru_.begin();
        if (lru_.size() > capacity_) {
          index_.erase(lru_.back().first);
          lru_.pop_back();
        }
      }
    }
    // oneDNN takes non-const handles; it only reads src, wei and bias.
    dnnl::memory src_mem(entry->src, engine_, const_cast<float*>(src));
    dnnl::memory wei_mem(entry->wei, engine_, const_cast<float*>(wei));
    dnnl::memory dst_mem(entry->dst, engine_, dst);
    std::unordered_map<int, dnnl::memory> args = {
        {DNNL_ARG_SRC, src_mem}, {DNNL_ARG_WEIGHTS, wei_mem}, {DNNL_ARG_DST, dst_mem}};
    std::vector<unsigned char> scratch(entry->scratchpad_bytes);
    if (!scratch.empty()) {
      args.emplace(DNNL_ARG_SCRATCHPAD,
                   dnnl::memory(entry->scratchpad, engine_, scratch.data()));
    }
    if (shape.has_bias) {
      args.emplace(DNNL_ARG_BIAS,
                   dnnl::memory(entry->bias, engine_, const_cast<float*>(bias)));
    }
    entry->primitive.execute(stream, args);
    stream.wait();
  } catch (const dnnl::error& e) {
    return absl::InternalError(
        absl::StrCat("oneDNN matmul failed (status ", static_cast<int>(e.status), "): ",
                     e.what()));
  } catch (const std::exception& e) {
    return absl::InternalError(absl::StrCat("oneDNN matmul failed: ", e.what()));
  }
  return absl::OkStatus();
}

}  // namespace attnserve::bench
