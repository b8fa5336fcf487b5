// cuDNN's SDPA through the cuDNN frontend (header-only, built with its
// dynamic loading: libcudnn.so.9 is dlopened here, never linked). A plan per
// shape bucket, built on first use and kept in a bounded LRU cache per
// workspace; the caller lays the data out at the bucket's rows, and the
// exact lengths reach cuDNN as its sequence lengths.
#include "engine/cuda/cudnn_sdpa.h"

#include <dlfcn.h>
#include <stdlib.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <exception>
#include <limits>
#include <list>
#include <map>
#include <mutex>
#include <unordered_map>
#include <utility>

#include <cudnn_frontend.h>

#include "absl/strings/str_cat.h"
#include "engine/cuda/attention_kernels.h"
#include "engine/cuda/cuda_status.h"
#include "engine/tensor.h"

// The frontend's dynamic loading reads cuDNN's symbols through this handle,
// which the embedding program opens (CudnnAvailable).
namespace cudnn_frontend {
void* cudnn_dlhandle = nullptr;
}  // namespace cudnn_frontend

namespace attnserve::cuda {
namespace {

namespace fe = cudnn_frontend;

constexpr int64_t kUidQ = 1, kUidK = 2, kUidV = 3, kUidO = 4, kUidBias = 5, kUidSeqQ = 6,
                  kUidSeqKv = 7, kUidScale = 8, kUidSinks = 9, kUidStats = 10;

fe::DataType_t FeType(DType t) {
  switch (t) {
    case DType::kFloat16:
      return fe::DataType_t::HALF;
    case DType::kBFloat16:
      return fe::DataType_t::BFLOAT16;
    default:
      return fe::DataType_t::FLOAT;
  }
}

// How causal masking is told to cuDNN. Bottom-right alignment follows the
// sequence lengths cuDNN is given (exact ones, or key_lengths), so it is
// used only where those give attention_params.h's offset Lk - Lq: no key
// lengths and no bias (cuDNN takes bottom-right only without a bias). Else
// top-left alignment with the diagonal shifted right by Lk - Lq, which
// ignores sequence lengths.
enum class CausalMode : int64_t { kNone, kBottomRight, kShifted };

// A plan's identity: everything the graph is built from.
struct PlanKey {
  DType dtype;
  int64_t batch, heads, kv_heads, head_dim, head_dim_v, q_rows, kv_rows;
  bool token_layout, padded;
  CausalMode causal;
  int64_t shift;  // kShifted: Lk - Lq
  MaskParams::Kind mask;
  DType bias_dtype;
  bool mask_per_batch, mask_per_head;
  int64_t window;  // > 0: the band's left bound (bottom-right causal)
  bool sinks;
  bool stats;

  std::array<int64_t, 19> Tuple() const {
    return {static_cast<int64_t>(dtype), batch,  heads,     kv_heads,
            head_dim,                    head_dim_v, q_rows, kv_rows,
            token_layout,                padded, static_cast<int64_t>(causal), shift,
            static_cast<int64_t>(mask),  static_cast<int64_t>(bias_dtype), mask_per_batch,
            mask_per_head,               window, sinks, stats};
  }
  bool operator<(const PlanKey& o) const { return Tuple() < o.Tuple(); }
};

PlanKey KeyFor(const SdpaShape& s) {
  PlanKey k{};
  k.dtype = s.dtype;
  k.batch = s.batch;
  k.heads = s.heads;
  k.kv_heads = s.kv_heads;
  k.head_dim = s.head_dim;
  k.head_dim_v = s.head_dim_v;
  k.q_rows = s.q_rows;
  k.kv_rows = s.kv_rows;
  k.token_layout = s.token_layout;
  k.padded = CudnnSdpa::NeedsSequenceLengths(s);
  k.mask = s.mask;
  // A bool mask is 0 / -inf, exact in any dtype; an additive mask keeps its
  // values: in the inputs' dtype when it has it, else in fp32.
  k.bias_dtype = (s.mask == MaskParams::Kind::kBool || s.mask_dtype == s.dtype) ? s.dtype
                                                                                 : DType::kFloat32;
  k.mask_per_batch = s.mask != MaskParams::Kind::kNone && s.mask_per_batch;
  k.mask_per_head = s.mask != MaskParams::Kind::kNone && s.mask_per_head;
  k.window = s.window;
  k.sinks = s.sinks;
  k.stats = s.stats;
  if (s.causal) {
    if (s.mask == MaskParams::Kind::kNone && !s.has_key_lengths) {
      k.causal = CausalMode::kBottomRight;
    } else {
      k.causal = CausalMode::kShifted;
      k.shift = s.kv_len - s.q_len;
    }
  }
  return k;
}

// Element strides [b, h, row, d] of contiguous data in the key's layout at
// length `len` (attention_params.h's layouts).
std::vector<int64_t> Strides(bool token_layout, int64_t heads, int64_t len, int64_t dim) {
  int64_t b = 0, h = 0, row = 0;
  (token_layout ? TokenLayoutStrides : HeadLayoutStrides)(heads, len, dim, &b, &h, &row);
  return {b, h, row, 1};
}

std::string FeMessage(fe::error_t e) {
  return absl::StrCat(e.get_message(), " (cudnn_frontend error ", static_cast<int>(e.get_code()),
                      ")");
}

// Builds the graph of `k`; Unimplemented with cuDNN's reason when it declines.
absl::StatusOr<std::shared_ptr<fe::graph::Graph>> BuildGraph(const PlanKey& k,
                                                            cudnnHandle_t handle) {
  auto graph = std::make_shared<fe::graph::Graph>();
  graph->set_io_data_type(FeType(k.dtype))
      .set_intermediate_data_type(fe::DataType_t::FLOAT)
      .set_compute_data_type(fe::DataType_t::FLOAT);
  auto tensor = [&](const char* name, int64_t uid, int64_t heads, int64_t len, int64_t dim) {
    return graph->tensor(fe::graph::Tensor_attributes()
                             .set_name(name)
                             .set_uid(uid)
                             .set_dim({k.batch, heads, len, dim})
                             .set_stride(Strides(k.token_layout, heads, len, dim)));
  };
  auto q = tensor("Q", kUidQ, k.heads, k.q_rows, k.head_dim);
  auto key = tensor("K", kUidK, k.kv_heads, k.kv_rows, k.head_dim);
  auto v = tensor("V", kUidV, k.kv_heads, k.kv_rows, k.head_dim_v);
  auto scale = graph->tensor(fe::graph::Tensor_attributes()
                                 .set_name("scale")
                                 .set_uid(kUidScale)
                                 .set_dim({1, 1, 1, 1})
                                 .set_stride({1, 1, 1, 1})
                                 .set_is_pass_by_value(true)
                                 .set_data_type(fe::DataType_t::FLOAT));
  auto options =
      fe::graph::SDPA_attributes().set_name("sdpa").set_generate_stats(k.stats).set_attn_scale(
          scale);
  if (k.causal == CausalMode::kBottomRight) {
    options.set_diagonal_alignment(fe::DiagonalAlignment_t::BOTTOM_RIGHT)
        .set_diagonal_band_right_bound(0);
  } else if (k.causal == CausalMode::kShifted) {
    options.set_diagonal_alignment(fe::DiagonalAlignment_t::TOP_LEFT)
        .set_diagonal_band_right_bound(static_cast<int>(k.shift));
  }
  if (k.window > 0) {
    // Key j is in query i's band iff j + window > i + (Lk - Lq): Hugging
    // Face's window, aligned bottom-right as the causal diagonal is.
    options.set_diagonal_band_left_bound(static_cast<int>(k.window));
  }
  if (k.sinks) {
    options.set_sink_token(graph->tensor(fe::graph::Tensor_attributes()
                                             .set_name("sinks")
                                             .set_uid(kUidSinks)
                                             .set_dim({1, k.heads, 1, 1})
                                             .set_stride({k.heads, 1, 1, 1})
                                             .set_data_type(fe::DataType_t::FLOAT)));
  }
  if (k.mask != MaskParams::Kind::kNone) {
    const int64_t mb = k.mask_per_batch ? k.batch : 1;
    const int64_t mh = k.mask_per_head ? k.heads : 1;
    auto bias = graph->tensor(fe::graph::Tensor_attributes()
                                  .set_name("bias")
                                  .set_uid(kUidBias)
                                  .set_data_type(FeType(k.bias_dtype))
                                  .set_dim({mb, mh, k.q_rows, k.kv_rows})
                                  .set_stride({mh * k.q_rows * k.kv_rows,
                                               k.q_rows * k.kv_rows, k.kv_rows, 1}));
    options.set_bias(bias);
  }
  if (k.padded) {
    auto seq = [&](const char* name, int64_t uid) {
      return graph->tensor(fe::graph::Tensor_attributes()
                               .set_name(name)
                               .set_uid(uid)
                               .set_dim({k.batch, 1, 1, 1})
                               .set_stride({1, 1, 1, 1})
                               .set_data_type(fe::DataType_t::INT32));
    };
    options.set_padding_mask(true)
        .set_seq_len_q(seq("seq_q", kUidSeqQ))
        .set_seq_len_kv(seq("seq_kv", kUidSeqKv));
  }
  auto [o, stats] = graph->sdpa(q, key, v, options);
  o->set_output(true)
      .set_uid(kUidO)
      .set_dim({k.batch, k.heads, k.q_rows, k.head_dim_v})
      .set_stride(Strides(k.token_layout, k.heads, k.q_rows, k.head_dim_v));
  if (k.stats) {
    // Natural-log log-sum-exp per row (stats_use_log2 stays off), fp32.
    stats->set_output(true)
        .set_uid(kUidStats)
        .set_data_type(fe::DataType_t::FLOAT)
        .set_dim({k.batch, k.heads, k.q_rows, 1})
        .set_stride({k.heads * k.q_rows, k.q_rows, 1, 1});
  }

  // Any step's failure is cuDNN declining this graph: the caller falls back.
  fe::error_t e = graph->validate();
  if (e.is_good()) e = graph->build_operation_graph(handle);
  if (e.is_good()) e = graph->create_execution_plans({fe::HeurMode_t::A, fe::HeurMode_t::FALLBACK});
  if (e.is_good()) e = graph->check_support(handle);
  if (e.is_good()) e = graph->build_plans(fe::BuildPlanPolicy_t::HEURISTICS_CHOICE);
  if (!e.is_good()) return absl::UnimplementedError(FeMessage(e));
  return graph;
}

}  // namespace

absl::StatusOr<AttentionSource> ParseAttentionSource(const std::string& name) {
  if (name.empty() || name == "auto") return AttentionSource::kAuto;
  if (name == "cudnn") return AttentionSource::kCudnn;
  if (name == "kernels") return AttentionSource::kKernels;
  return absl::InvalidArgumentError(absl::StrCat(
      "ATTNSERVE_CUDA_ATTENTION: '", name, "' is not one of auto, cudnn, kernels"));
}

absl::Status CudnnAvailable() {
  static const absl::Status* status = [] {
    // RTLD_LOCAL: cuDNN's symbols stay out of the process's global scope.
    void* handle = dlopen("libcudnn.so.9", RTLD_NOW | RTLD_LOCAL);
    if (handle == nullptr) {
      const char* why = dlerror();
      return new absl::Status(absl::UnavailableError(absl::StrCat(
          "cuDNN unavailable: dlopen libcudnn.so.9: ", why != nullptr ? why : "unknown error")));
    }
    fe::cudnn_dlhandle = handle;
    // The frontend also opens a CUDA runtime, the first of libcudart.so.12
    // and .13 it finds: make it the one this module runs on.
    setenv("CUDNN_FRONTEND_CUDART_LIB_NAME",
           absl::StrCat("libcudart.so.", CUDART_VERSION / 1000).c_str(), /*overwrite=*/0);
    try {
      const size_t version = fe::detail::get_backend_version();
      if (version < 90000) {
        return new absl::Status(absl::UnavailableError(
            absl::StrCat("cuDNN unavailable: libcudnn.so.9 reports version ", version,
                         "; cuDNN 9.0 or newer is needed")));
      }
    } catch (const std::exception& e) {
      return new absl::Status(
          absl::UnavailableError(absl::StrCat("cuDNN unavailable: ", e.what())));
    }
    return new absl::Status();
  }();
  return *status;
}

int64_t SdpaBucketLength(int64_t len) {
  if (len <= 1) return len;
  int64_t pow2 = 1;
  while (pow2 < len) pow2 *= 2;
  if (pow2 <= 64) return pow2;
  const int64_t step = pow2 / 8;  // a quarter of the power of two below len
  return (len + step - 1) / step * step;
}

bool SomeRowSeesNoKey(const AttentionParams& p) {
  const int64_t offset = p.kv_len - p.q_len;
  if (p.causal && offset < 0) return true;  // rows 0..-offset-1 see nothing
  if (p.key_lengths != nullptr) {
    for (int64_t b = 0; b < p.batch; ++b) {
      if (p.key_lengths[b] <= 0) return true;
    }
  }
  if (p.kv_len <= 0) return true;
  const MaskParams& m = p.mask;
  if (m.kind == MaskParams::Kind::kNone) return false;
  // Only the distinct mask rows need a look: a broadcast dim is scanned once
  // (over batch still when key lengths differ per batch element). Under a
  // causal mask a row that broadcasts over queries is tightest at i = 0.
  const int64_t batches = (m.stride_b != 0 || p.key_lengths != nullptr) ? p.batch : 1;
  const int64_t heads = m.stride_h != 0 ? p.num_heads : 1;
  const int64_t rows = m.stride_q != 0 ? p.q_len : 1;
  for (int64_t b = 0; b < batches; ++b) {
    const int64_t length = p.key_lengths != nullptr ? p.key_lengths[b] : p.kv_len;
    for (int64_t h = 0; h < heads; ++h) {
      for (int64_t i = 0; i < rows; ++i) {
        const int64_t end = p.causal ? std::min(length, i + offset + 1) : length;
        const int64_t base = b * m.stride_b + h * m.stride_h + i * m.stride_q;
        bool sees = false;
        for (int64_t j = 0; j < end && !sees; ++j) {
          const int64_t at = base + j * m.stride_k;
          if (m.kind == MaskParams::Kind::kBool) {
            sees = static_cast<const uint8_t*>(m.data)[at] != 0;
          } else {
            sees = LoadAsFloat(m.dtype, m.data, at) != -std::numeric_limits<float>::infinity();
          }
        }
        if (!sees) return true;
      }
    }
  }
  return false;
}

std::optional<std::string> SdpaRefusal(const AttentionParams& p, DType compute) {
  if (compute != DType::kFloat16 && compute != DType::kBFloat16) {
    return absl::StrCat("cuDNN's SDPA computes in fp16/bf16, the request in ",
                        std::string(DTypeName(compute)));
  }
  if (p.weights != nullptr && p.sinks != nullptr) {
    return std::string("need_weights with attention sinks (cuDNN's row statistics with a sink "
                       "token are not promised to include it)");
  }
  if (p.k_blocks != nullptr) return std::string("paged K/V");
  if (p.softcap > 0.0f) return std::string("logit softcapping (served by the kernels written here)");
  // cuDNN's own alibi mask has its fixed slopes, not the layer's.
  if (p.alibi_slopes != nullptr) {
    return std::string("ALiBi slopes (served by the kernels written here)");
  }
  // cuDNN takes no bias table, only a bias tensor the size of the scores.
  if (p.relative_bias != nullptr) {
    return std::string("a relative position bias (served by the kernels written here)");
  }
  // Nor terms of the scores from per-distance tables.
  if (p.relative_key != nullptr || p.relative_query != nullptr) {
    return std::string("relative position embeddings (served by the kernels written here)");
  }
  if (p.chunk > 0) return std::string("chunked attention (served by the kernels written here)");
  if (p.window > 0 &&
      (!p.causal || p.key_lengths != nullptr || p.mask.kind != MaskParams::Kind::kNone)) {
    return std::string(
        "a sliding window without causal, or with key lengths or a mask (cuDNN's band is aligned "
        "bottom-right only without them)");
  }
  if (p.sinks != nullptr && p.mask.kind != MaskParams::Kind::kNone) {
    return std::string("attention sinks with a mask");
  }
  if (p.head_dim % 8 != 0 || p.head_dim_v % 8 != 0) {
    return absl::StrCat("head dims ", p.head_dim, "/", p.head_dim_v,
                        " (cuDNN needs multiples of 8)");
  }
  if (p.q_len > std::numeric_limits<int32_t>::max() ||
      p.kv_len > std::numeric_limits<int32_t>::max()) {
    return std::string("sequence lengths beyond int32");
  }
  if (SomeRowSeesNoKey(p)) {
    return std::string("a query row that sees no key (answered with zeros, which cuDNN does not "
                       "promise)");
  }
  return std::nullopt;
}

bool CudnnSdpa::NeedsSequenceLengths(const SdpaShape& s) {
  return s.has_key_lengths || s.q_rows != s.q_len || s.kv_rows != s.kv_len;
}

struct CudnnSdpa::Impl {
  struct Entry {
    std::shared_ptr<fe::graph::Graph> graph;  // null: refused
    std::string refusal;
    int64_t workspace_bytes = 0;
    std::list<PlanKey>::iterator lru;
  };

  explicit Impl(size_t max) : max_plans(max) {}
  ~Impl() {
    entries.clear();
    if (handle != nullptr) (void)fe::detail::destroy_handle(handle);
  }

  cudnnHandle_t handle = nullptr;
  size_t max_plans;
  std::map<PlanKey, Entry> entries;
  std::list<PlanKey> lru;  // most recently used first
};

CudnnSdpa::CudnnSdpa(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
CudnnSdpa::~CudnnSdpa() = default;

absl::StatusOr<std::unique_ptr<CudnnSdpa>> CudnnSdpa::Create(size_t max_plans) {
  if (absl::Status available = CudnnAvailable(); !available.ok()) return available;
  auto impl = std::make_unique<Impl>(std::max<size_t>(max_plans, 1));
  try {
    if (const cudnnStatus_t s = fe::detail::create_handle(&impl->handle);
        s != CUDNN_STATUS_SUCCESS) {
      return absl::UnavailableError(
          absl::StrCat("cuDNN unavailable: cudnnCreate: ", fe::detail::get_error_string(s)));
    }
  } catch (const std::exception& e) {
    return absl::UnavailableError(absl::StrCat("cuDNN unavailable: ", e.what()));
  }
  return std::unique_ptr<CudnnSdpa>(new CudnnSdpa(std::move(impl)));
}

absl::Status CudnnSdpa::Enqueue(const SdpaArgs& args, DeviceAllocator alloc,
                                cudaStream_t stream) {
  const SdpaShape& s = args.shape;
  const PlanKey key = KeyFor(s);
  Impl& impl = *impl_;

  // The plan: cached, or built now (a refusal is cached as well).
  auto found = impl.entries.find(key);
  if (found == impl.entries.end()) {
    Impl::Entry entry;
    try {
      absl::StatusOr<std::shared_ptr<fe::graph::Graph>> graph = BuildGraph(key, impl.handle);
      if (graph.ok()) {
        entry.graph = *std::move(graph);
        if (fe::error_t e = entry.graph->get_workspace_size(entry.workspace_bytes);
            !e.is_good()) {
          return absl::InternalError(absl::StrCat("cuDNN workspace size: ", FeMessage(e)));
        }
      } else if (absl::IsUnimplemented(graph.status())) {
        entry.refusal = std::string(graph.status().message());
      } else {
        return graph.status();
      }
    } catch (const std::exception& e) {
      return absl::InternalError(absl::StrCat("cuDNN plan build: ", e.what()));
    }
    if (impl.entries.size() >= impl.max_plans) {
      impl.entries.erase(impl.lru.back());
      impl.lru.pop_back();
    }
    impl.lru.push_front(key);
    entry.lru = impl.lru.begin();
    found = impl.entries.emplace(key, std::move(entry)).first;
  } else {
    impl.lru.splice(impl.lru.begin(), impl.lru, found->second.lru);
  }
  const Impl::Entry& plan = found->second;
  if (plan.graph == nullptr) return absl::UnimplementedError(plan.refusal);
  if (key.padded && (args.seq_len_q == nullptr || args.seq_len_kv == nullptr)) {
    return absl::InternalError("cuDNN SDPA: a padded plan without sequence lengths");
  }

  if (s.q_rows < s.q_len || s.kv_rows < s.kv_len) {
    return absl::InternalError("cuDNN SDPA: buffers shorter than the sequences");
  }
  float scale = args.scale;
  std::unordered_map<int64_t, void*> pack = {{kUidQ, const_cast<void*>(args.q)},
                                             {kUidK, const_cast<void*>(args.k)},
                                             {kUidV, const_cast<void*>(args.v)},
                                             {kUidO, args.out},
                                             {kUidScale, &scale}};
  if (key.mask != MaskParams::Kind::kNone) {
    const int64_t mb = key.mask_per_batch ? s.batch : 1;
    const int64_t mh = key.mask_per_head ? s.heads : 1;
    absl::StatusOr<void*> bias = alloc(static_cast<size_t>(mb * mh * key.q_rows * key.kv_rows) *
                                       DTypeSize(key.bias_dtype));
    if (!bias.ok()) return bias.status();
    ATTNSERVE_CUDA_CALL(LaunchExpandMask(args.mask, mb, mh, s.q_len, s.kv_len, key.q_rows,
                                         key.kv_rows, *bias, key.bias_dtype, stream));
    pack[kUidBias] = *bias;
  }
  if (key.sinks) {
    if (args.sinks == nullptr) return absl::InternalError("cuDNN SDPA: a sink plan without sinks");
    pack[kUidSinks] = const_cast<float*>(args.sinks);
  }
  if (key.stats) {
    if (args.stats == nullptr) {
      return absl::InternalError("cuDNN SDPA: a statistics plan without their buffer");
    }
    pack[kUidStats] = args.stats;
  }
  if (key.padded) {
    pack[kUidSeqQ] = const_cast<int32_t*>(args.seq_len_q);
    pack[kUidSeqKv] = const_cast<int32_t*>(args.seq_len_kv);
  }
  void* workspace = nullptr;
  if (plan.workspace_bytes > 0) {
    absl::StatusOr<void*> ws = alloc(static_cast<size_t>(plan.workspace_bytes));
    if (!ws.ok()) return ws.status();
    workspace = *ws;
  }
  try {
    if (const cudnnStatus_t st = fe::detail::set_stream(impl.handle, stream);
        st != CUDNN_STATUS_SUCCESS) {
      return absl::InternalError(
          absl::StrCat("cudnnSetStream: ", fe::detail::get_error_string(st)));
    }
    if (fe::error_t e = plan.graph->execute(impl.handle, pack, workspace); !e.is_good()) {
      return absl::InternalError(absl::StrCat("cuDNN SDPA execute: ", FeMessage(e)));
    }
  } catch (const std::exception& e) {
    return absl::InternalError(absl::StrCat("cuDNN SDPA execute: ", e.what()));
  }
  return absl::OkStatus();
}

}  // namespace attnserve::cuda
