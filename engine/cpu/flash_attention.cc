// The flash attention dispatcher: checks each request, picks its kernel
// variant, cuts the ragged batch into work items, runs them on OpenMP
// threads, and combines the key-split partials of decode requests.
#include "engine/cpu/flash_attention.h"

#if defined(_OPENMP)
#include <omp.h>
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <memory>
#include <numeric>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "engine/cpu/flash_internal.h"

namespace attnserve::cpu {
namespace {

using flash::ItemKind;
using flash::kBlockRows;
using flash::kSplitChunkKeys;
using flash::RequestPlan;
using flash::RoundUp;
using flash::WorkItem;

using RunItemFn = bool (*)(const WorkItem&);

RunItemFn KernelFor(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::kScalar: return flash::RunItemScalar;
    case CpuIsa::kAvx2: return flash::RunItemAvx2;
    case CpuIsa::kAvx512: return flash::RunItemAvx512;
    case CpuIsa::kAvx512Bf16: return flash::RunItemAvx512Bf16;
    case CpuIsa::kAmx: return flash::RunItemAmx;
  }
  return flash::RunItemScalar;
}


absl::Status CheckRequest(const AttentionParams& p, size_t index) {
  auto bad = [&](auto&&... parts) {
    return absl::InvalidArgumentError(absl::StrCat("FlashAttention: request ", index, ": ", parts...));
  };
  if (p.batch < 1 || p.num_heads < 1 || p.num_kv_heads < 1 || p.head_dim < 1 ||
      p.head_dim_v < 1 || p.q_len < 1 || p.kv_len < 1) {
    return bad("dims must be >= 1 (batch ", p.batch, ", heads ", p.num_heads, "/", p.num_kv_heads,
               ", head_dim ", p.head_dim, "/", p.head_dim_v, ", q_len ", p.q_len, ", kv_len ",
               p.kv_len, ")");
  }
  if (p.num_heads % p.num_kv_heads != 0) {
    return bad("num_heads (", p.num_heads, ") must be a multiple of num_kv_heads (",
               p.num_kv_heads, ")");
  }
  const bool paged = p.k_blocks != nullptr || p.v_blocks != nullptr;
  if (p.q == nullptr || p.out == nullptr || (!paged && (p.k == nullptr || p.v == nullptr))) {
    return bad("q, k, v (or k_blocks and v_blocks) and out must be set");
  }
  if (paged) {
    if (p.k_blocks == nullptr || p.v_blocks == nullptr) {
      return bad("paged K/V needs both k_blocks and v_blocks");
    }
    if (p.block_tokens < kPagedBlockTokensMultiple || p.block_tokens % kPagedBlockTokensMultiple != 0) {
      return bad("block_tokens (", p.block_tokens, ") must be a positive multiple of ",
                 kPagedBlockTokensMultiple);
    }
    if (p.batch != 1) return bad("paged K/V holds one sequence: batch must be 1 (got ", p.batch, ")");
    const int64_t blocks = (p.kv_len + p.block_tokens - 1) / p.block_tokens;
    // Blocks wholly outside every row's window or chunk may have been released.
    const int64_t first = p.weights != nullptr
                              ? 0
                              : FirstWindowKey(p.kv_len - p.q_len, p.window, p.chunk) /
                                    p.block_tokens;
    for (int64_t i = first; i < blocks; ++i) {
      if (p.k_blocks[i] == nullptr || p.v_blocks[i] == nullptr) {
        return bad("k_blocks[", i, "] and v_blocks[", i, "] must be set (kv_len ", p.kv_len,
                   " needs ", blocks, " blocks of ", p.block_tokens, " tokens)");
      }
    }
  }
  if (!IsFloat(p.dtype) || !IsFloat(p.out_dtype) || (p.weights != nullptr && !IsFloat(p.weights_dtype))) {
    return bad("inputs, output and weights must be FLOAT32, FLOAT16 or BFLOAT16 (got ",
               std::string(DTypeName(p.dtype)), ", ", std::string(DTypeName(p.out_dtype)), ", ",
               std::string(DTypeName(p.weights_dtype)), ")");
  }
  if (p.mask.kind != MaskParams::Kind::kNone) {
    if (p.mask.data == nullptr) return bad("mask has a kind but no data");
    if (p.mask.kind == MaskParams::Kind::kAdditive && !IsFloat(p.mask.dtype)) {
      return bad("an additive mask must be a float dtype (got ", std::string(DTypeName(p.mask.dtype)), ")");
    }
  }
  if (!std::isfinite(p.scale) || p.scale <= 0.0f) return bad("scale must be finite and > 0");
  return absl::OkStatus();
}

// One (request, batch element, kv head) whose keys were split into chunks:
// its partials, chunk-major: [chunk][row][m, l, acc...].
struct SplitGroup {
  const RequestPlan* plan;
  int64_t b, hkv, rows, chunks;
  float* partial;
};

// Merges the chunks of one split group in chunk order (fixed, so the result
// does not depend on which thread ran which chunk) and writes the output.
void CombineSplit(const SplitGroup& sg, std::vector<float>& acc) {
  const RequestPlan& plan = *sg.plan;
  const AttentionParams& p = *plan.p;
  const int64_t stride = flash::PartialStride(plan);
  const int64_t dv = p.head_dim_v;
  acc.resize(static_cast<size_t>(dv));
  for (int64_t v = 0; v < sg.rows; ++v) {
    const int64_t i = v / plan.group, h = sg.hkv * plan.group + v % plan.group;
    float m = -std::numeric_limits<float>::infinity();
    for (int64_t c = 0; c < sg.chunks; ++c) m = std::max(m, sg.partial[(c * sg.rows + v) * stride]);
    // The sink joins once, here: a key of its own logit with no value row.
    constexpr float kLog2e = 1.44269504088896340736f;  // the kernels' base-2 units
    const float sink = p.sinks != nullptr ? p.sinks[h] * kLog2e
                                          : -std::numeric_limits<float>::infinity();
    m = std::max(m, sink);
    std::fill(acc.begin(), acc.end(), 0.0f);
    float l = p.sinks != nullptr ? std::exp2(sink - m) : 0.0f;
    if (m != -std::numeric_limits<float>::infinity()) {
      for (int64_t c = 0; c < sg.chunks; ++c) {
        const float* part = sg.partial + (c * sg.rows + v) * stride;
        if (part[1] == 0.0f) continue;  // chunk saw no key of this row
        const float w = std::exp2(part[0] - m);
        l += part[1] * w;
        for (int64_t d = 0; d < dv; ++d) acc[static_cast<size_t>(d)] += part[2 + d] * w;
      }
    }
    const float inv = l > 0.0f ? 1.0f / l : 0.0f;
    for (float& x : acc) x *= inv;
    void* out = static_cast<char*>(p.out) +
                (sg.b * p.o_stride_b + h * p.o_stride_h + i * p.o_stride_row) *
                    static_cast<int64_t>(DTypeSize(p.out_dtype));
    ConvertFromFloat(acc.data(), dv, p.out_dtype, out);
  }
}

// Least ItemCost work per thread (about 2 MFLOP, tens of microseconds) for
// which waking another thread pays; on a busy host a woken thread may first
// wait for a core.
constexpr double kMinCostPerThread = 1 << 20;

// Relative cost of an item (multiply-adds plus packing), to start the
// biggest items first, and to size the thread team; only affects speed,
// never results.
double ItemCost(const WorkItem& it) {
  const AttentionParams& p = *it.plan->p;
  const double dk = static_cast<double>(p.head_dim + p.head_dim_v);
  const int64_t rows = it.row1 - it.row0;
  if (it.kind == ItemKind::kWeights) {
    const double heads = static_cast<double>(it.head_end - it.head);
    return heads * rows * p.kv_len * (dk + p.head_dim + 4);
  }
  const int64_t g = it.plan->group;
  const int64_t first = std::min(flash::VisibleKeys(*it.plan, it.b, it.row0 / g), it.key1);
  const int64_t last = std::min(flash::VisibleKeys(*it.plan, it.b, (it.row1 - 1) / g), it.key1);
  const double keys = std::max<double>(0.0, 0.5 * (first + last) - it.key0);
  return rows * keys * dk + std::max<int64_t>(0, last - it.key0) * dk * 8;
}

// ResolveFlashIsa, also saying whether the variant was forced.
absl::StatusOr<CpuIsa> ResolveIsa(DType dtype, const FlashOptions& options, bool* was_forced) {
  std::optional<CpuIsa> forced = options.isa;
  if (!forced) {
    const char* env = std::getenv(kCpuIsaEnv);
    if (env != nullptr && env[0] != '\0') {
      forced = ParseCpuIsa(env);
      if (!forced) {
        return absl::FailedPreconditionError(absl::StrCat(
            kCpuIsaEnv, "=", env, " is not one of scalar, avx2, avx512, bf16, amx"));
      }
    }
  }
  *was_forced = forced.has_value();
  if (forced) {
    if (!CpuSupports(*forced)) {
      return absl::FailedPreconditionError(absl::StrCat(
          "the CPU kernel variant '", std::string(CpuIsaName(*forced)), "' is not supported by this CPU"));
    }
    return *forced;
  }
  const bool bf16 = options.precision == FlashPrecision::kBFloat16 ||
                    (options.precision == FlashPrecision::kAuto && dtype == DType::kBFloat16);
  if (bf16) {
    if (std::optional<CpuIsa> isa = BestBf16Isa()) return *isa;
  }
  return BestFp32Isa();
}

}  // namespace

absl::StatusOr<CpuIsa> ResolveFlashIsa(DType dtype, const FlashOptions& options) {
  bool forced = false;
  return ResolveIsa(dtype, options, &forced);
}

absl::StatusOr<CpuIsa> FlashIsaFor(const AttentionParams& p, const FlashOptions& options) {
  bool forced = false;
  absl::StatusOr<CpuIsa> isa = ResolveIsa(p.dtype, options, &forced);
  if (!isa.ok()) return isa;
  // Decode (a few query rows per kv head) is bound by reading K and V, not
  // by products: the AVX-512 fp32 kernel reads bf16 K/V as few bytes, skips
  // the pair packing the bf16 kernels need, and its products of bf16 inputs
  // are exact. Only when the variant was not forced.
  if (!forced && IsBf16Isa(*isa) && p.num_kv_heads > 0 &&
      p.num_heads / p.num_kv_heads * p.q_len <= flash::kDirectMaxRows &&
      CpuSupports(CpuIsa::kAvx512)) {
    return CpuIsa::kAvx512;
  }
  return isa;
}

absl::Status FlashAttention(absl::Span<const AttentionParams> batch, const FlashOptions& options) {
  std::vector<RequestPlan> plans(batch.size());
  std::vector<RunItemFn> kernels(batch.size());
  for (size_t r = 0; r < batch.size(); ++r) {
    const AttentionParams& p = batch[r];
    if (absl::Status s = CheckRequest(p, r); !s.ok()) return s;
    absl::StatusOr<CpuIsa> isa = FlashIsaFor(p, options);
    if (!isa.ok()) return isa.status();
    kernels[r] = KernelFor(*isa);
    RequestPlan& plan = plans[r];
    plan.p = &p;
    plan.group = p.num_heads / p.num_kv_heads;
    plan.score_scale = p.scale * 1.44269504088896340736f;
    plan.causal_offset = p.kv_len - p.q_len;
    plan.dv_pad = RoundUp(p.head_dim_v, 16);
  }

#if defined(_OPENMP)
  int threads = options.num_threads > 0 ? options.num_threads : omp_get_max_threads();
#else
  int threads = 1;  // built without OpenMP: one thread
#endif
  threads = std::max(threads, 1);

  // Work items. Which keys a row sees and in which blocks depends only on
  // its request, so a request is computed the same way whatever shares its
  // batch; how rows are grouped into items (here also by thread count)
  // changes no result.
  //
  // Decode: when all query rows of a kv head fit one item and the request
  // has few (sequence, kv head) pairs, parallelism (and bandwidth) has to
  // come from splitting the keys into fixed chunks.
  auto is_split = [&](const RequestPlan& plan) {
    const AttentionParams& p = *plan.p;
    return p.weights == nullptr && plan.group * p.q_len <= kBlockRows &&
           p.kv_len > kSplitChunkKeys && p.batch * p.num_kv_heads < flash::kSplitMaxPairs;
  };
  // The key chunks of a split request: from the one that holds the first
  // key its first row's window or chunk reaches (chunks before it would see
  // no key).
  auto first_chunk = [](const AttentionParams& p) {
    return FirstWindowKey(p.kv_len - p.q_len, p.window, p.chunk) / kSplitChunkKeys;
  };
  auto split_chunks = [&](const AttentionParams& p) {
    return (p.kv_len + kSplitChunkKeys - 1) / kSplitChunkKeys - first_chunk(p);
  };
  size_t partial_floats = 0;
  for (const RequestPlan& plan : plans) {
    if (!is_split(plan)) continue;
    const AttentionParams& p = *plan.p;
    const int64_t chunks = split_chunks(p);
    partial_floats += static_cast<size_t>(p.batch * p.num_kv_heads * chunks * plan.group *
                                          p.q_len * flash::PartialStride(plan));
  }
  std::unique_ptr<float[]> partials;
  if (partial_floats > 0) {
    partials.reset(new (std::nothrow) float[partial_floats]);
    if (partials == nullptr) {
      return absl::ResourceExhaustedError("FlashAttention: no memory for decode partials");
    }
  }

  std::vector<WorkItem> items;
  std::vector<size_t> item_request;
  std::vector<SplitGroup> splits;
  float* next_partial = partials.get();
  auto add = [&](size_t r, const WorkItem& it) {
    items.push_back(it);
    item_request.push_back(r);
  };
  for (size_t r = 0; r < batch.size(); ++r) {
    const RequestPlan& plan = plans[r];
    const AttentionParams& p = *plan.p;
    WorkItem it;
    it.plan = &plan;
    if (p.weights != nullptr) {
      // Averaged weights sum over heads in head order inside one item.
      const int64_t heads_per_item = p.average_weights ? p.num_heads : 1;
      it.kind = ItemKind::kWeights;
      it.key0 = 0;
      it.key1 = p.kv_len;
      for (it.b = 0; it.b < p.batch; ++it.b)
        for (it.head = 0; it.head < p.num_heads; it.head += heads_per_item)
          for (it.row0 = 0; it.row0 < p.q_len; it.row0 += kBlockRows) {
            it.head_end = it.head + heads_per_item;
            it.row1 = std::min(p.q_len, it.row0 + kBlockRows);
            add(r, it);
          }
      continue;
    }
    const int64_t vrows = plan.group * p.q_len;
    if (is_split(plan)) {
      const int64_t chunks = split_chunks(p);
      const int64_t chunk0 = first_chunk(p);
      const int64_t chunk_floats = vrows * flash::PartialStride(plan);
      it.kind = ItemKind::kSplit;
      it.row0 = 0;
      it.row1 = vrows;
      for (it.b = 0; it.b < p.batch; ++it.b)
        for (it.head = 0; it.head < p.num_kv_heads; ++it.head) {
          splits.push_back(SplitGroup{&plan, it.b, it.head, vrows, chunks, next_partial});
          for (int64_t c = 0; c < chunks; ++c) {
            it.key0 = (chunk0 + c) * kSplitChunkKeys;
            it.key1 = std::min(p.kv_len, it.key0 + kSplitChunkKeys);
            it.partial = next_partial + c * chunk_floats;
            add(r, it);
          }
          next_partial += chunks * chunk_floats;
        }
      continue;
    }
    it.kind = ItemKind::kFlash;
    it.key0 = 0;
    it.key1 = p.kv_len;
    // Big items amortise K/V packing; smaller ones keep every thread busy.
    int64_t item_rows = flash::kItemRows;
    auto count = [&](int64_t rows_per_item) {
      return p.batch * p.num_kv_heads * ((vrows + rows_per_item - 1) / rows_per_item);
    };
    while (item_rows > kBlockRows && count(item_rows) < 4 * threads) item_rows -= kBlockRows;
    for (it.b = 0; it.b < p.batch; ++it.b)
      for (it.head = 0; it.head < p.num_kv_heads; ++it.head)
        for (it.row0 = 0; it.row0 < vrows; it.row0 += item_rows) {
          it.row1 = std::min(vrows, it.row0 + item_rows);
          add(r, it);
        }
  }
  if (items.empty()) return absl::OkStatus();

  // Biggest first, then whichever thread is free takes the next. Among
  // items of equal cost, head by head: threads that run at the same time
  // then work on different rows (other requests or batch entries) instead
  // of neighbouring heads of the same rows, whose outputs are adjacent
  // slices of the same output rows (token layout). With neighbouring heads
  // side by side, two threads ran 20% slower on 32 x 16-token requests
  // (engine_bench CoreFusedQkv/short_B32_L16_H8_D64, 2 threads).
  std::vector<size_t> order(items.size());
  std::iota(order.begin(), order.end(), size_t{0});
  for (WorkItem& it : items) it.cost = ItemCost(it);
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    if (items[a].cost != items[b].cost) return items[a].cost > items[b].cost;
    return items[a].head < items[b].head;
  });

  // A thread joins only for enough work to pay for waking it (a small
  // request alone, e.g. 16 tokens x 8 heads, runs on the caller's thread).
  double total_cost = 0;
  for (const WorkItem& it : items) total_cost += it.cost;
  const double worth = std::max(1.0, std::floor(total_cost / kMinCostPerThread));
  threads = static_cast<int>(std::min<double>({static_cast<double>(threads),
                                              static_cast<double>(items.size()), worth}));
  std::atomic<bool> ok{true};
  const int64_t n_items = static_cast<int64_t>(items.size());
  const int64_t n_splits = static_cast<int64_t>(splits.size());
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
#pragma omp for schedule(dynamic, 1)
    for (int64_t k = 0; k < n_items; ++k) {
      const size_t idx = order[static_cast<size_t>(k)];
      if (!kernels[item_request[idx]](items[idx])) ok.store(false, std::memory_order_relaxed);
    }
    // (implicit barrier: every partial is written before any is combined)
    std::vector<float> acc;
#pragma omp for schedule(dynamic, 4)
    for (int64_t s = 0; s < n_splits; ++s) CombineSplit(splits[static_cast<size_t>(s)], acc);
  }
  if (!ok.load()) return absl::ResourceExhaustedError("FlashAttention: no memory for kernel scratch");
  return absl::OkStatus();
}

}  // namespace attnserve::cpu
