// The CUDA backend against the reference engine's Run, reached as production
// reaches it: LoadCudaEngine, which dlopens libattnserve_cuda.so, then Run.
// Bare attention runs as tasks on the sdpa layer (head layout); the token
// layout [B, L, H * D] runs on projection layers whose projections are
// identities, which compute exactly that attention. The comparisons run over
// seeded random cases (every mask kind, GQA, cross attention, Dv != Dk,
// ragged batches, each dtype, head dims served by the fused kernel and by the
// general one, need_weights) and need a GPU: without one each is skipped with
// the loader's reason. The loader tests run everywhere.
//
// Tolerances (absolute + relative to the float64 reference, inputs in
// [-1, 1]): FLOAT32 1e-4 + 1e-4; FLOAT16 4e-3 + 1e-2 (P is rounded to
// fp16 before P V on the tensor cores, outputs to fp16); BFLOAT16 2e-2 +
// 2e-2 (8-bit mantissa). Projection layers computing in bf16/fp16 round
// weights and activations as well: 6e-2 + 6e-2 and 1.5e-2 + 2e-2.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "engine/attention_engine.h"
#include "engine/attention_layer.h"
#include "engine/attention_task.h"
#include "engine/cuda/cuda_loader.h"
#include "engine/model/builtin_models.h"
#include "engine/paged_kv.h"
#include "engine/qk_norm.h"
#include "engine/tensor.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/unit/engine/test_latent_layer.h"

namespace attnserve {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

constexpr float kInf = std::numeric_limits<float>::infinity();

// The CUDA engine, loaded once per process (loading cuBLAS takes a moment),
// or why there is none. Never destroyed: tearing CUDA down inside exit()
// races the runtime's own teardown.
struct CudaOrReason {
  AttentionEngine* engine = nullptr;
  std::string reason;
};

const CudaOrReason& Cuda() {
  static const CudaOrReason* cuda = [] {
    auto* c = new CudaOrReason;
    absl::StatusOr<std::unique_ptr<AttentionEngine>> engine = LoadCudaEngine();
    if (engine.ok()) {
      c->engine = engine->release();
    } else {
      c->reason = std::string(engine.status().message());
    }
    return c;
  }();
  return *cuda;
}

AttentionEngine& Reference() {
  static AttentionEngine* reference = [] {
    absl::StatusOr<std::unique_ptr<AttentionEngine>> engine = CreateEngine("reference");
    if (!engine.ok()) {
      ADD_FAILURE() << "reference engine: " << engine.status();
      return static_cast<AttentionEngine*>(nullptr);
    }
    return engine->release();
  }();
  return *reference;
}

// An engine made with the environment variables `env` (name, value) set,
// loaded once; null when it cannot be made, with the reason in *why.
using Environment = std::vector<std::pair<std::string, std::string>>;
AttentionEngine* EngineWith(const Environment& env, std::string* why = nullptr) {
  static auto* engines = new std::map<std::string, std::pair<AttentionEngine*, std::string>>;
  std::string key;
  for (const auto& [name, value] : env) key += name + "=" + value + " ";
  auto [it, inserted] = engines->try_emplace(key);
  if (inserted) {
    for (const auto& [name, value] : env) setenv(name.c_str(), value.c_str(), 1);
    absl::StatusOr<std::unique_ptr<AttentionEngine>> engine = LoadCudaEngine();
    for (const auto& [name, value] : env) unsetenv(name.c_str());
    if (engine.ok()) {
      it->second.first = engine->release();
    } else {
      it->second.second = std::string(engine.status().message());
    }
  }
  if (why != nullptr) *why = it->second.second;
  return it->second.first;
}

// An engine whose fused attention comes from one source (cudnn_sdpa.h:
// "cudnn" = cuDNN only, "kernels" = the kernels written here); null when it
// cannot be made (no cuDNN), with the reason in *why.
AttentionEngine* EngineFrom(const std::string& source, std::string* why = nullptr) {
  return EngineWith({{"ATTNSERVE_CUDA_ATTENTION", source}}, why);
}

// The engine whose fused kernels also serve what no GPU run has verified
// yet (ATTNSERVE_CUDA_EXPERIMENTAL_FUSED=1: the fused fp32 kernel; windows,
// softcapping and sinks on both fused kernels), with `source` as above.
AttentionEngine* ExperimentalEngine(const std::string& source, std::string* why) {
  return EngineWith(
      {{"ATTNSERVE_CUDA_ATTENTION", source}, {"ATTNSERVE_CUDA_EXPERIMENTAL_FUSED", "1"}}, why);
}

#define REQUIRE_GPU()                                                                  \
  do {                                                                                 \
    if (Cuda().engine == nullptr) GTEST_SKIP() << "no CUDA engine: " << Cuda().reason; \
  } while (0)

// ---------------------------------------------------------------- loader

TEST(CudaLoaderTest, GivesAnEngineOrUnavailableNeverACrash) {
  absl::StatusOr<std::unique_ptr<AttentionEngine>> engine = LoadCudaEngine();
  if (engine.ok()) {
    EXPECT_EQ((*engine)->name(), "cuda");
    return;
  }
  EXPECT_EQ(engine.status().code(), absl::StatusCode::kUnavailable) << engine.status();
  EXPECT_FALSE(engine.status().message().empty());
}

TEST(CudaLoaderTest, FindsTheModuleThisBuildMade) {
  if (CudaModuleBuildPath().empty()) {
    GTEST_SKIP() << "this build has no CUDA backend (ATTNSERVE_CUDA=OFF, or AUTO without nvcc)";
  }
  absl::StatusOr<std::unique_ptr<AttentionEngine>> engine = LoadCudaEngine();
  if (engine.ok()) return;  // module and GPU both found
  // The module loaded and its factory ran; only a usable GPU is missing.
  EXPECT_EQ(engine.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(engine.status().message(), HasSubstr("CUDA device")) << engine.status();
  EXPECT_THAT(engine.status().message(), Not(HasSubstr("could not be loaded")));
}

TEST(CudaLoaderTest, CreateEngineCudaIsTheCudaEngineOrUnavailable) {
  absl::StatusOr<std::unique_ptr<AttentionEngine>> engine = CreateEngine("cuda");
  if (engine.ok()) {
    EXPECT_EQ((*engine)->name(), "cuda");
  } else {
    EXPECT_EQ(engine.status().code(), absl::StatusCode::kUnavailable) << engine.status();
  }
}

// DESIGN.md section 4: cuBLASLt carries ~94 KiB of TLS; linked into the
// process it leaves no room in the 100 KiB stacks of civetweb's threads (the
// metrics endpoint). Loaded with dlopen its TLS is allocated lazily, so such
// threads still start once the module (and cuBLAS) is in the process.
TEST(CudaLoaderTest, SmallStackThreadsStartAfterTheModuleLoads) {
  (void)LoadCudaEngine();
  pthread_attr_t attr;
  ASSERT_EQ(pthread_attr_init(&attr), 0);
  ASSERT_EQ(pthread_attr_setstacksize(&attr, 100 * 1024), 0);
  pthread_t thread;
  const int rc = pthread_create(
      &thread, &attr, [](void*) -> void* { return nullptr; }, nullptr);
  pthread_attr_destroy(&attr);
  ASSERT_EQ(rc, 0) << "pthread_create with a 100 KiB stack: " << std::strerror(rc);
  pthread_join(thread, nullptr);
}

// ---------------------------------------------------------------- cases

Tensor RandomTensor(DType dtype, Shape shape, std::mt19937& rng, float scale = 1.0f) {
  Tensor t(dtype, std::move(shape));
  std::uniform_real_distribution<float> dist(-scale, scale);
  std::vector<float> values(static_cast<size_t>(t.num_elements()));
  for (float& x : values) x = dist(rng);
  ConvertFromFloat(values.data(), t.num_elements(), dtype, t.data());
  return t;
}

struct Tolerance {
  double atol, rtol;
};

Tolerance ToleranceFor(DType dtype) {
  switch (dtype) {
    case DType::kFloat16:
      return {4e-3, 1e-2};
    case DType::kBFloat16:
      return {2e-2, 2e-2};
    default:
      return {1e-4, 1e-4};
  }
}

// Every element within atol + rtol * |want|; reports the count and the worst.
void ExpectClose(const Tensor& got, const Tensor& want, Tolerance tol, const std::string& what) {
  ASSERT_EQ(got.shape(), want.shape()) << what;
  int64_t bad = 0, worst = -1;
  double worst_excess = 0;
  for (int64_t i = 0; i < want.num_elements(); ++i) {
    const double g = LoadAsFloat(got.dtype(), got.data(), i);
    const double w = LoadAsFloat(want.dtype(), want.data(), i);
    const double excess = std::abs(g - w) - (tol.atol + tol.rtol * std::abs(w));
    if (!(excess <= 0)) {  // NaN counts as a mismatch
      ++bad;
      if (worst < 0 || !(excess <= worst_excess)) {
        worst = i;
        worst_excess = excess;
      }
    }
  }
  if (bad > 0) {
    ADD_FAILURE() << what << ": " << bad << " of " << want.num_elements()
                  << " elements differ; worst at " << worst << ": got "
                  << LoadAsFloat(got.dtype(), got.data(), worst) << ", want "
                  << LoadAsFloat(want.dtype(), want.data(), worst);
  }
}

void ExpectIdentical(const Tensor& a, const Tensor& b, const std::string& what) {
  ASSERT_EQ(a.shape(), b.shape()) << what;
  ASSERT_EQ(a.byte_size(), b.byte_size()) << what;
  EXPECT_EQ(std::memcmp(a.data(), b.data(), a.byte_size()), 0) << what << ": not bit-identical";
}

enum class MaskChoice { kNone, kBool, kAdditive };

Precision PrecisionOf(DType dtype) {
  switch (dtype) {
    case DType::kFloat16:
      return Precision::kFloat16;
    case DType::kBFloat16:
      return Precision::kBFloat16;
    default:
      return Precision::kFloat32;
  }
}

Tensor Identity(int64_t n) {
  Tensor t(DType::kFloat32, {n, n});
  for (int64_t i = 0; i < n; ++i) t.data_as<float>()[i * n + i] = 1.0f;
  return t;
}

// A projection layer whose projections are identities without biases, in the
// precision of `dtype` (so the inputs convert exactly): it computes attention
// over token-layout inputs [B, L, H * D], the strides only a projection layer
// hands the kernels. One per shape, alive for the process: the CUDA engine
// caches device weights by the layer's address. Not thread-safe.
const AttentionLayer& IdentityProjectionLayer(int64_t heads, int64_t kv_heads, int64_t head_dim,
                                              DType dtype) {
  using Key = std::tuple<int64_t, int64_t, int64_t, DType>;
  static auto* layers = new std::map<Key, std::unique_ptr<AttentionLayer>>;
  std::unique_ptr<AttentionLayer>& layer = (*layers)[Key{heads, kv_heads, head_dim, dtype}];
  if (layer == nullptr) {
    layer = std::make_unique<AttentionLayer>();
    LayerConfig& c = layer->config;
    c.name = "identity-projections";
    c.has_projections = true;
    c.embed_dim = heads * head_dim;
    c.num_heads = heads;
    c.num_kv_heads = kv_heads;
    c.head_dim = head_dim;
    c.query_dim = c.out_dim = heads * head_dim;
    c.key_dim = c.value_dim = kv_heads * head_dim;
    c.precision = PrecisionOf(dtype);
    LayerWeights& w = layer->weights;
    w.wq = Identity(heads * head_dim);
    w.wk = Identity(kv_heads * head_dim);
    w.wv = Identity(kv_heads * head_dim);
    w.wo = Identity(heads * head_dim);
    EXPECT_TRUE(ValidateLayer(*layer).ok()) << ValidateLayer(*layer);
  }
  return *layer;
}

const AttentionLayer& SdpaLayer() {
  static const std::shared_ptr<const AttentionLayer> layer = MakeSdpaLayer();
  return *layer;
}

// One request: owns its inputs and outputs; Task() points into them. In head
// layout it runs on the sdpa layer; in token layout (Dv == Dk) on an
// identity projection layer.
struct AttendCase {
  DType dtype = DType::kFloat32, out_dtype = DType::kFloat32, weights_dtype = DType::kFloat32;
  int64_t batch = 1, heads = 1, kv_heads = 1, q_len = 1, kv_len = 1, dk = 64, dv = 64;
  bool causal = false, token_layout = false, need_weights = false, average = false;
  bool with_lengths = false;
  MaskChoice mask_choice = MaskChoice::kNone;
  Shape mask_shape;
  float scale = 0.125f;
  // Per-request options of the sdpa layer (head layout only).
  int64_t window = 0;
  float softcap = 0.0f;
  std::vector<float> sinks;

  Tensor q, k, v, mask, out, weights;
  std::vector<int64_t> lengths;
  const AttentionLayer* layer = nullptr;  // set by Fill

  std::string Describe() const {
    std::ostringstream s;
    s << DTypeName(dtype) << "->" << DTypeName(out_dtype) << " B" << batch << " Hq" << heads
      << " Hkv" << kv_heads << " Lq" << q_len << " Lk" << kv_len << " Dk" << dk << " Dv" << dv
      << (causal ? " causal" : "") << (token_layout ? " token-layout" : "")
      << (with_lengths ? " key_lengths" : "")
      << (mask_choice == MaskChoice::kBool       ? " bool-mask"
          : mask_choice == MaskChoice::kAdditive ? " additive-mask"
                                                 : "")
      << (mask_choice != MaskChoice::kNone ? ShapeString(mask_shape) : "")
      << (need_weights ? (average ? " avg-weights" : " weights") : "")
      << (window > 0 ? absl::StrCat(" window ", window) : "")
      << (softcap > 0 ? absl::StrCat(" softcap ", softcap) : "") << (sinks.empty() ? "" : " sinks");
    return s.str();
  }

  // Allocates and fills inputs (from `rng`) and zeroed outputs; picks the layer.
  void Fill(std::mt19937& rng) {
    const Shape q_shape =
        token_layout ? Shape{batch, q_len, heads * dk} : Shape{batch, heads, q_len, dk};
    const Shape k_shape =
        token_layout ? Shape{batch, kv_len, kv_heads * dk} : Shape{batch, kv_heads, kv_len, dk};
    const Shape v_shape =
        token_layout ? Shape{batch, kv_len, kv_heads * dv} : Shape{batch, kv_heads, kv_len, dv};
    const Shape o_shape =
        token_layout ? Shape{batch, q_len, heads * dv} : Shape{batch, heads, q_len, dv};
    q = RandomTensor(dtype, q_shape, rng, 2.0f);  // wider scores than U(-1, 1) alone
    k = RandomTensor(dtype, k_shape, rng);
    v = RandomTensor(dtype, v_shape, rng);
    out = Tensor(out_dtype, o_shape);
    if (need_weights) {
      weights = Tensor(weights_dtype,
                       average ? Shape{batch, q_len, kv_len} : Shape{batch, heads, q_len, kv_len});
    }
    if (with_lengths) {
      std::uniform_int_distribution<int64_t> len(0, kv_len);
      lengths.resize(static_cast<size_t>(batch));
      for (int64_t& l : lengths) l = len(rng);
    }
    if (mask_choice == MaskChoice::kBool) {
      mask = Tensor(DType::kBool, mask_shape);
      std::bernoulli_distribution allowed(0.8);
      for (int64_t i = 0; i < mask.num_elements(); ++i) {
        mask.data_as<uint8_t>()[i] = allowed(rng) ? 1 : 0;
      }
    } else if (mask_choice == MaskChoice::kAdditive) {
      std::vector<DType> types = {DType::kFloat32, DType::kFloat16, DType::kBFloat16};
      const DType mask_dtype = types[rng() % types.size()];
      std::vector<float> values(static_cast<size_t>(NumElements(mask_shape).value()));
      std::normal_distribution<float> bias(0.0f, 2.0f);
      std::bernoulli_distribution blocked(0.1);
      for (float& x : values) x = blocked(rng) ? -kInf : bias(rng);
      mask = Tensor(mask_dtype, mask_shape);
      ConvertFromFloat(values.data(), static_cast<int64_t>(values.size()), mask_dtype, mask.data());
    }
    if (token_layout) {
      EXPECT_EQ(dk, dv) << "a projection layer has one head dim";
      layer = &IdentityProjectionLayer(heads, kv_heads, dk, dtype);
    } else {
      layer = &SdpaLayer();
    }
  }

  // A task over this case's inputs, writing to `o` and `w` (null: no weights).
  AttentionTask Task(Tensor& o, Tensor* w) const {
    AttentionTask t;
    t.query = q.view();
    t.key = k.view();
    t.value = v.view();
    t.output = o.mutable_view();
    t.causal = causal;
    t.scale = scale;
    if (with_lengths) t.key_lengths = lengths;
    if (mask_choice != MaskChoice::kNone) t.attn_mask = mask.view();
    if (w != nullptr && need_weights) {
      t.weights = w->mutable_view();
      t.average_weights = average;
    }
    t.window = window;
    t.softcap = softcap;
    t.sinks = sinks;
    return t;
  }

  AttentionTask Task() { return Task(out, &weights); }
};

template <typename T>
T Pick(std::mt19937& rng, std::initializer_list<T> choices) {
  return *(choices.begin() + rng() % choices.size());
}

// With `token_layout`, a quarter of the cases are in token layout (Dv == Dk).
AttendCase RandomCase(std::mt19937& rng, bool token_layout = true) {
  AttendCase c;
  c.dtype = Pick(rng, {DType::kFloat32, DType::kFloat16, DType::kBFloat16});
  c.out_dtype =
      rng() % 4 == 0 ? Pick(rng, {DType::kFloat32, DType::kFloat16, DType::kBFloat16}) : c.dtype;
  c.dk = Pick<int64_t>(rng, {64, 128, 64, 128, 32, 80, 40});
  c.dv = rng() % 4 == 0 ? Pick<int64_t>(rng, {16, 64, 72, 128}) : c.dk;
  c.kv_heads = Pick<int64_t>(rng, {1, 2, 3});
  c.heads = c.kv_heads * Pick<int64_t>(rng, {1, 2, 4});
  c.batch = Pick<int64_t>(rng, {1, 2, 3});
  c.q_len = Pick<int64_t>(rng, {1, 7, 63, 64, 65, 100});
  c.kv_len = rng() % 2 == 0 ? c.q_len : Pick<int64_t>(rng, {1, 5, 64, 97, 130});
  c.causal = rng() % 3 == 0;
  c.with_lengths = rng() % 3 == 0;
  c.token_layout = token_layout && rng() % 4 == 0;
  if (c.token_layout) c.dv = c.dk;
  c.mask_choice =
      Pick(rng, {MaskChoice::kNone, MaskChoice::kNone, MaskChoice::kBool, MaskChoice::kAdditive});
  const int64_t b = c.batch, h = c.heads, lq = c.q_len, lk = c.kv_len;
  c.mask_shape = Pick<Shape>(rng, {{lq, lk},
                                   {b, 1, lq, lk},
                                   {1, h, lq, lk},
                                   {b, h, lq, lk},
                                   {1, lk},
                                   {b, 1, 1, lk},
                                   {h, lq, lk}});
  c.need_weights = rng() % 4 == 0;
  c.average = rng() % 2 == 0;
  c.weights_dtype = Pick(rng, {DType::kFloat32, DType::kFloat16, DType::kBFloat16});
  c.scale = rng() % 2 == 0 ? static_cast<float>(1.0 / std::sqrt(static_cast<double>(c.dk)))
                           : std::uniform_real_distribution<float>(0.05f, 0.4f)(rng);
  c.Fill(rng);
  return c;
}

// The looser of the tolerances of the input and output dtypes.
Tolerance CaseTolerance(const AttendCase& c, DType result_dtype) {
  const Tolerance a = ToleranceFor(c.dtype), b = ToleranceFor(result_dtype);
  return {std::max(a.atol, b.atol), std::max(a.rtol, b.rtol)};
}

// Runs `c` on the reference and on CUDA (the default engine, or `engine`),
// and compares output and weights (within `tol`, else the case's dtypes'
// tolerance).
void CompareWithReference(AttendCase& c, AttentionEngine* engine = nullptr,
                          std::optional<Tolerance> tol = std::nullopt) {
  SCOPED_TRACE(c.Describe());
  Tensor ref_out(c.out.dtype(), c.out.shape());
  Tensor ref_weights = c.need_weights ? Tensor(c.weights.dtype(), c.weights.shape()) : Tensor();
  const AttentionTask ref = c.Task(ref_out, c.need_weights ? &ref_weights : nullptr);
  const absl::Status ref_status = Reference().Run(*c.layer, {&ref, 1});
  ASSERT_TRUE(ref_status.ok()) << ref_status;
  const AttentionTask gpu = c.Task();
  AttentionEngine* run_on = engine != nullptr ? engine : Cuda().engine;
  const absl::Status status = run_on->Run(*c.layer, {&gpu, 1});
  ASSERT_TRUE(status.ok()) << status;
  ExpectClose(c.out, ref_out, tol.value_or(CaseTolerance(c, c.out_dtype)), "output");
  if (c.need_weights) {
    ExpectClose(c.weights, ref_weights, tol.value_or(CaseTolerance(c, c.weights_dtype)),
                "weights");
  }
}

// ---------------------------------------------------------------- attention

TEST(CudaEngineTest, RandomCasesMatchReference) {
  REQUIRE_GPU();
  std::mt19937 rng(20240611);
  for (int i = 0; i < 200; ++i) {
    AttendCase c = RandomCase(rng);
    SCOPED_TRACE("case " + std::to_string(i));
    CompareWithReference(c);
    if (HasFatalFailure()) return;
  }
}

// The same kind of cases on the kernels written here alone (the default
// engine serves what cuDNN takes with cuDNN).
TEST(CudaEngineTest, RandomCasesMatchReferenceOnOwnKernels) {
  REQUIRE_GPU();
  std::string why;
  AttentionEngine* kernels = EngineFrom("kernels", &why);
  ASSERT_NE(kernels, nullptr) << why;
  std::mt19937 rng(20240612);
  for (int i = 0; i < 120; ++i) {
    AttendCase c = RandomCase(rng);
    SCOPED_TRACE("case " + std::to_string(i));
    CompareWithReference(c, kernels);
    if (HasFatalFailure()) return;
  }
}

// The engine made with cuDNN only (ATTNSERVE_CUDA_ATTENTION=cudnn): where
// cuDNN is not there, skipped (a failure under ATTNSERVE_REQUIRE_CUDNN=1).
AttentionEngine* CudnnOnlyOrSkip(std::string* skip) {
  std::string why;
  AttentionEngine* engine = EngineFrom("cudnn", &why);
  if (engine == nullptr) {
    const char* required = std::getenv("ATTNSERVE_REQUIRE_CUDNN");
    if (required != nullptr && std::string(required) == "1") {
      ADD_FAILURE() << "ATTNSERVE_REQUIRE_CUDNN=1 but: " << why;
    }
    *skip = why;
  }
  return engine;
}

// Every key column 0 visible, so that no row of a random mask sees nothing
// (those rows go to our kernels).
void OpenFirstKey(AttendCase& c) {
  if (c.mask_choice == MaskChoice::kNone) return;
  const int64_t lk = c.mask_shape.back();
  for (int64_t at = 0; at < c.mask.num_elements(); at += lk) {
    if (c.mask_choice == MaskChoice::kBool) {
      c.mask.data_as<uint8_t>()[at] = 1;
    } else {
      StoreFromFloat(c.mask.dtype(), c.mask.data(), at, 0.5f);
    }
  }
}

// cuDNN's SDPA computes exactly what the reference does on what it takes:
// both dtypes, head dims 64/128, causal (bottom-right; with a mask or key
// lengths, the shifted top-left diagonal), GQA, Lq != Lk, a decode row,
// lengths off the buckets (padded, with cuDNN's sequence lengths), key
// lengths, bool and additive masks broadcast several ways, the token layout
// (one sequence at its bucket's rows, several at exact rows), another output
// dtype. Cases marked optional may be declined by cuDNN
// (other head dims, Dv != Dk, fp32 bias, sliding windows, sinks): each is
// reported, and when served must be right.
TEST(CudaEngineTest, CudnnServesItsCasesExactly) {
  REQUIRE_GPU();
  std::string skip;
  AttentionEngine* cudnn = CudnnOnlyOrSkip(&skip);
  if (cudnn == nullptr) GTEST_SKIP() << skip;
  std::mt19937 rng(41);
  struct Case {
    AttendCase c;
    bool optional = false;
  };
  std::vector<Case> cases;
  auto base = [](DType dtype, int64_t dim, bool causal, int64_t lq, int64_t lk) {
    AttendCase c;
    c.dtype = c.out_dtype = dtype;
    c.dk = c.dv = dim;
    c.batch = 2;
    c.heads = 4;
    c.kv_heads = 2;
    c.q_len = lq;
    c.kv_len = lk;
    c.causal = causal;
    c.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(dim)));
    return c;
  };
  for (DType dtype : {DType::kFloat16, DType::kBFloat16})
    for (int64_t dim : {64, 128})
      for (bool causal : {false, true})
        for (auto [lq, lk] : {std::pair<int64_t, int64_t>{128, 128},
                              {100, 100},
                              {1, 300},
                              {64, 200},
                              {333, 1000}}) {
          cases.push_back({base(dtype, dim, causal, lq, lk)});
        }
  for (bool causal : {false, true}) {
    const DType bf16 = DType::kBFloat16;
    AttendCase lengths = base(bf16, 128, causal, 100, 300);
    lengths.with_lengths = true;
    cases.push_back({lengths});
    for (Shape shape : {Shape{2, 1, 100, 300}, Shape{100, 300}, Shape{2, 4, 100, 300},
                        Shape{2, 1, 1, 300}}) {
      AttendCase bool_mask = base(bf16, 128, causal, 100, 300);
      bool_mask.mask_choice = MaskChoice::kBool;
      bool_mask.mask_shape = shape;
      bool_mask.with_lengths = shape.size() == 2;
      cases.push_back({bool_mask});
      AttendCase additive = bool_mask;
      additive.mask_choice = MaskChoice::kAdditive;  // random dtype: fp32 ones optional
      cases.push_back({additive, true});
    }
    AttendCase token = base(DType::kFloat16, 64, causal, 100, 100);
    token.token_layout = true;
    cases.push_back({token});  // two sequences: exact rows
    AttendCase token_one = token;
    token_one.batch = 1;
    cases.push_back({token_one});  // one sequence: the bucket's rows, tail zeroed
    AttendCase token_lengths = base(DType::kBFloat16, 128, causal, 1, 77);
    token_lengths.token_layout = true;
    token_lengths.with_lengths = true;
    cases.push_back({token_lengths});
    AttendCase fp32_out = base(bf16, 64, causal, 70, 70);
    fp32_out.out_dtype = DType::kFloat32;
    cases.push_back({fp32_out});
    AttendCase dv = base(bf16, 128, causal, 64, 64);
    dv.dv = 64;
    cases.push_back({dv, true});
    for (int64_t dim : {32, 96, 256}) cases.push_back({base(bf16, dim, causal, 200, 200), true});
    // Sinks (cuDNN's sink token, 9.13 and newer), with and without a window.
    AttendCase sinks = base(bf16, 64, causal, 100, 300);
    sinks.sinks = {0.5f, -1.0f, 2.0f, 0.0f};
    cases.push_back({sinks, true});
    if (causal) {
      sinks.window = 40;
      cases.push_back({sinks, true});
    }
  }
  // need_weights: cuDNN's row statistics and one GEMM of the scores
  // (UnfusedAttention::EnqueueWeights), per head and averaged, in the
  // weights' dtypes; with masks, key lengths, GQA, a window, the token
  // layout, and a causal request past 512 rows (the GEMM by row blocks).
  for (bool causal : {false, true}) {
    for (DType dtype : {DType::kFloat16, DType::kBFloat16}) {
      AttendCase w = base(dtype, 64, causal, 100, 300);
      w.need_weights = true;
      cases.push_back({w});
      w.average = true;
      w.weights_dtype = dtype;
      cases.push_back({w});
    }
    AttendCase lengths = base(DType::kBFloat16, 128, causal, 77, 200);
    lengths.need_weights = true;
    lengths.with_lengths = true;
    cases.push_back({lengths});
    AttendCase masked = base(DType::kFloat16, 64, causal, 100, 300);
    masked.need_weights = true;
    masked.mask_choice = MaskChoice::kBool;
    masked.mask_shape = Shape{2, 4, 100, 300};
    cases.push_back({masked});
    masked.mask_choice = MaskChoice::kAdditive;
    masked.mask_shape = Shape{2, 1, 100, 300};
    cases.push_back({masked, true});
    AttendCase token = base(DType::kBFloat16, 64, causal, 100, 100);
    token.token_layout = true;
    token.batch = 1;
    token.need_weights = true;
    cases.push_back({token});
    AttendCase long_rows = base(DType::kBFloat16, 64, causal, 600, 700);
    long_rows.need_weights = true;
    cases.push_back({long_rows});
  }
  AttendCase window_weights = base(DType::kFloat16, 128, true, 200, 300);
  window_weights.window = 50;
  window_weights.need_weights = true;
  cases.push_back({window_weights, true});
  // Sliding windows with bottom-right causal (cuDNN's diagonal band), on and
  // off the buckets, wider than the keys too.
  for (DType dtype : {DType::kFloat16, DType::kBFloat16}) {
    for (auto [lq, lk, window] : {std::tuple<int64_t, int64_t, int64_t>{128, 128, 1},
                                  {100, 100, 16},
                                  {1, 300, 50},
                                  {333, 1000, 256},
                                  {200, 200, 500}}) {
      AttendCase w = base(dtype, 128, true, lq, lk);
      w.window = window;
      cases.push_back({w, true});
    }
  }
  std::vector<std::string> declined;
  for (size_t n = 0; n < cases.size(); ++n) {
    AttendCase& c = cases[n].c;
    c.Fill(rng);
    OpenFirstKey(c);
    if (c.with_lengths) c.lengths = {c.kv_len, c.kv_len / 2 + 1};
    SCOPED_TRACE(c.Describe());
    if (cases[n].optional) {
      const AttentionTask probe = c.Task();
      const absl::Status status = cudnn->Run(*c.layer, {&probe, 1});
      if (absl::IsUnimplemented(status)) {
        declined.push_back(c.Describe() + " (mask dtype " +
                           std::string(DTypeName(c.mask.dtype())) + "): " +
                           std::string(status.message()));
        continue;
      }
    }
    CompareWithReference(c, cudnn);
    if (HasFatalFailure()) return;
  }
  for (const std::string& d : declined) std::cout << "cuDNN declined: " << d << "\n";
  RecordProperty("cudnn_declined", static_cast<int>(declined.size()));
}

// What cuDNN cannot compute exactly is named, on the cuDNN-only engine (the
// default engine serves these on the kernels written here: see
// FullyMaskedRowsAreZeros and the random cases).
TEST(CudaEngineTest, CudnnOnlyNamesWhatCudnnCannotServe) {
  REQUIRE_GPU();
  std::string skip;
  AttentionEngine* cudnn = CudnnOnlyOrSkip(&skip);
  if (cudnn == nullptr) GTEST_SKIP() << skip;
  std::mt19937 rng(43);
  auto expect_refused = [&](AttendCase c, const std::string& reason) {
    c.Fill(rng);
    if (c.with_lengths) c.lengths = {0, c.kv_len};
    const AttentionTask task = c.Task();
    const absl::Status status = cudnn->Run(*c.layer, {&task, 1});
    EXPECT_EQ(status.code(), absl::StatusCode::kUnimplemented) << c.Describe() << ": " << status;
    EXPECT_THAT(std::string(status.message()), HasSubstr(reason)) << c.Describe();
  };
  AttendCase fp32;
  fp32.batch = 2;
  fp32.heads = fp32.kv_heads = 2;
  fp32.q_len = fp32.kv_len = 64;
  expect_refused(fp32, "fp16/bf16");
  AttendCase weights = fp32;
  weights.dtype = weights.out_dtype = DType::kFloat16;
  weights.need_weights = true;
  weights.sinks = {0.5f, -1.0f};
  expect_refused(weights, "need_weights with attention sinks");
  AttendCase empty = fp32;
  empty.dtype = empty.out_dtype = DType::kBFloat16;
  empty.with_lengths = true;
  expect_refused(empty, "sees no key");
  AttendCase short_keys = empty;
  short_keys.with_lengths = false;
  short_keys.causal = true;
  short_keys.q_len = 80;
  expect_refused(short_keys, "sees no key");
}

// The fused kernel's own grid: both dtypes, both head dims, causal or not,
// lengths that end inside and exactly on the 64-row tiles, GQA, Lq != Lk.
TEST(CudaEngineTest, FusedKernelShapesMatchReference) {
  REQUIRE_GPU();
  std::mt19937 rng(7);
  for (DType dtype : {DType::kFloat16, DType::kBFloat16}) {
    for (int64_t dim : {64, 128}) {
      for (bool causal : {false, true}) {
        for (auto [lq, lk] : {std::pair<int64_t, int64_t>{1, 1},
                              {63, 63},
                              {64, 64},
                              {65, 65},
                              {200, 200},
                              {17, 150},
                              {150, 17},
                              {128, 257}}) {
          AttendCase c;
          c.dtype = c.out_dtype = dtype;
          c.dk = c.dv = dim;
          c.batch = 2;
          c.kv_heads = 2;
          c.heads = 4;
          c.q_len = lq;
          c.kv_len = lk;
          c.causal = causal;
          c.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(dim)));
          c.Fill(rng);
          CompareWithReference(c);
          if (HasFatalFailure()) return;
        }
      }
    }
  }
}

// Rows that see no key: key length 0, causal with Lq > Lk, a bool mask row
// of false, an additive row of -inf. Zeros (output and weights), never NaN,
// on the fused path (no weights) and on the general one (weights).
TEST(CudaEngineTest, FullyMaskedRowsAreZeros) {
  REQUIRE_GPU();
  std::mt19937 rng(11);
  for (bool need_weights : {false, true}) {
    for (int variant = 0; variant < 4; ++variant) {
      AttendCase c;
      c.dtype = c.out_dtype = DType::kFloat16;
      c.dk = c.dv = 64;
      c.batch = 2;
      c.heads = c.kv_heads = 2;
      c.q_len = 70;
      c.kv_len = variant == 1 ? 40 : 70;
      c.causal = variant == 1;
      c.with_lengths = variant == 0;
      c.mask_choice = variant == 2   ? MaskChoice::kBool
                      : variant == 3 ? MaskChoice::kAdditive
                                     : MaskChoice::kNone;
      c.mask_shape = {c.batch, c.heads, c.q_len, c.kv_len};
      c.need_weights = need_weights;
      c.Fill(rng);
      if (variant == 0) c.lengths = {0, 33};
      int64_t blocked_row = 5;
      for (int64_t b = 0; b < c.batch; ++b)
        for (int64_t h = 0; h < c.heads; ++h)
          for (int64_t j = 0; j < c.kv_len; ++j) {
            const int64_t at = ((b * c.heads + h) * c.q_len + blocked_row) * c.kv_len + j;
            if (variant == 2) c.mask.data_as<uint8_t>()[at] = 0;
            if (variant == 3) StoreFromFloat(c.mask.dtype(), c.mask.data(), at, -kInf);
          }
      CompareWithReference(c);
      if (HasFatalFailure()) return;
      for (int64_t i = 0; i < c.out.num_elements(); ++i) {
        ASSERT_FALSE(std::isnan(LoadAsFloat(c.out.dtype(), c.out.data(), i))) << "element " << i;
      }
    }
  }
}

// A request's result does not depend on the other requests of its batch:
// each request alone and inside a mixed ragged batch give the same bits. (A
// batch runs on one layer: all cases here are sdpa tasks in head layout.)
TEST(CudaEngineTest, RaggedBatchesAreBatchInvariant) {
  REQUIRE_GPU();
  std::mt19937 rng(99);
  std::vector<AttendCase> cases;
  for (int i = 0; i < 6; ++i) cases.push_back(RandomCase(rng, /*token_layout=*/false));
  std::vector<Tensor> alone_out, alone_weights;
  for (AttendCase& c : cases) {
    const AttentionTask task = c.Task();
    ASSERT_TRUE(Cuda().engine->Run(SdpaLayer(), {&task, 1}).ok()) << c.Describe();
    alone_out.push_back(c.out);
    alone_weights.push_back(c.weights);
  }
  for (const std::vector<int>& order :
       {std::vector<int>{0, 1, 2, 3, 4, 5}, std::vector<int>{5, 3, 1, 0, 2, 4},
        std::vector<int>{2, 2, 4}}) {
    std::vector<Tensor> outs, weights;
    std::vector<AttentionTask> batch;
    outs.reserve(order.size());
    weights.reserve(order.size());
    for (int i : order) {
      outs.emplace_back(cases[i].out.dtype(), cases[i].out.shape());
      weights.push_back(cases[i].need_weights
                            ? Tensor(cases[i].weights.dtype(), cases[i].weights.shape())
                            : Tensor());
      batch.push_back(cases[i].Task(outs.back(), &weights.back()));
    }
    const absl::Status status = Cuda().engine->Run(SdpaLayer(), batch);
    ASSERT_TRUE(status.ok()) << status;
    for (size_t n = 0; n < order.size(); ++n) {
      const int i = order[n];
      ExpectIdentical(outs[n], alone_out[i], cases[i].Describe() + " output");
      if (cases[i].need_weights) {
        ExpectIdentical(weights[n], alone_weights[i], cases[i].Describe() + " weights");
      }
    }
  }
}

TEST(CudaEngineTest, ConcurrentCallsGiveTheSameResults) {
  REQUIRE_GPU();
  std::mt19937 rng(5);
  std::vector<AttendCase> cases;
  for (int i = 0; i < 4; ++i) cases.push_back(RandomCase(rng));
  std::vector<Tensor> expected;
  for (AttendCase& c : cases) {
    const AttentionTask task = c.Task();
    ASSERT_TRUE(Cuda().engine->Run(*c.layer, {&task, 1}).ok()) << c.Describe();
    expected.push_back(c.out);
  }
#if defined(__SANITIZE_THREAD__)
  // TSan (scripts/sanitize.sh tsan-cuda) needs the calls to overlap, not
  // many of them: each is some twenty times slower there.
  constexpr int kThreads = 4, kRounds = 2;
#else
  constexpr int kThreads = 8, kRounds = 5;
#endif
  std::vector<std::vector<Tensor>> got(kThreads);
  std::vector<std::thread> threads;
  for (size_t t = 0; t < got.size(); ++t) {
    threads.emplace_back([&, t] {
      for (int round = 0; round < kRounds; ++round) {
        for (AttendCase& c : cases) {
          Tensor out(c.out.dtype(), c.out.shape());
          Tensor w = c.need_weights ? Tensor(c.weights.dtype(), c.weights.shape()) : Tensor();
          const AttentionTask task = c.Task(out, &w);
          if (!Cuda().engine->Run(*c.layer, {&task, 1}).ok()) return;
          if (round == kRounds - 1) got[t].push_back(std::move(out));
        }
      }
    });
  }
  for (std::thread& t : threads) t.join();
  for (size_t t = 0; t < got.size(); ++t) {
    ASSERT_EQ(got[t].size(), cases.size()) << "thread " << t << " failed a call";
    for (size_t i = 0; i < cases.size(); ++i) {
      ExpectIdentical(got[t][i], expected[i], "thread " + std::to_string(t));
    }
  }
}

// An fp32 request of 2 sequences, 4 query heads over 2 kv heads, scale
// 1 / sqrt(dim); key lengths when lq is 700.
AttendCase Fp32Case(int64_t lq, int64_t lk, int64_t dim, bool causal) {
  AttendCase c;
  c.dtype = c.out_dtype = c.weights_dtype = DType::kFloat32;
  c.batch = 2;
  c.heads = 4;
  c.kv_heads = 2;
  c.q_len = lq;
  c.kv_len = lk;
  c.dk = c.dv = dim;
  c.causal = causal;
  c.with_lengths = lq == 700;
  c.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(dim)));
  return c;
}

// fp32 inputs run on the unfused path's 3xTF32 GEMMs (unfused_attention.h):
// exact, within 1e-5 of the float64 reference in absolute terms, output and
// weights, at lengths where K = 3 D and K = Lk sums are long.
TEST(CudaEngineTest, Fp32IsWithinOneInOneHundredThousandOfFloat64) {
  REQUIRE_GPU();
  std::mt19937 rng(99);
  for (bool causal : {false, true}) {
    // From 512 causal query rows the GEMMs go by row blocks that skip the
    // keys past each block's diagonal (unfused_attention.cc): Lq = Lk,
    // Lq < Lk, and Lq > Lk (the first rows see no key), one with key lengths.
    for (auto [lq, lk, dim] : {std::tuple<int64_t, int64_t, int64_t>{300, 700, 128},
                               {1, 2048, 64},
                               {513, 513, 80},
                               {700, 1500, 64},
                               {600, 520, 64}}) {
      AttendCase c = Fp32Case(lq, lk, dim, causal);
      c.need_weights = true;
      c.Fill(rng);
      CompareWithReference(c, nullptr, Tolerance{1e-5, 0.0});
      if (HasFatalFailure()) return;
    }
  }
}

// The same on the engine that routes the fp32 requests it can to the fused
// fp32 kernel (ATTNSERVE_CUDA_EXPERIMENTAL_FUSED=1; flash_attention_fp32.cu,
// whose own test runs it directly): the shapes above without weights (those
// stay on the unfused path), at head dims 64 and 128, the kernel's, and 80,
// the unfused path's; masks and key lengths through the engine's uploads.
TEST(CudaEngineTest, FusedFp32KernelIsWithinOneInOneHundredThousandOfFloat64) {
  REQUIRE_GPU();
  std::string why;
  AttentionEngine* fused = ExperimentalEngine("auto", &why);
  ASSERT_NE(fused, nullptr) << why;
  std::mt19937 rng(100);
  int n = 0;
  for (bool causal : {false, true}) {
    for (auto [lq, lk, dim] : {std::tuple<int64_t, int64_t, int64_t>{300, 700, 128},
                               {1, 2048, 64},
                               {513, 513, 128},
                               {200, 130, 80},
                               {700, 1500, 64},
                               {600, 520, 64}}) {
      AttendCase c = Fp32Case(lq, lk, dim, causal);
      c.token_layout = n % 3 == 1;
      c.mask_choice = n % 4 == 2 ? MaskChoice::kBool : n % 4 == 3 ? MaskChoice::kAdditive
                                                                  : MaskChoice::kNone;
      c.mask_shape = n % 2 == 0 ? Shape{c.batch, 1, lq, lk} : Shape{1, c.heads, lq, lk};
      c.Fill(rng);
      CompareWithReference(c, fused, Tolerance{1e-5, 0.0});
      if (HasFatalFailure()) return;
      ++n;
    }
  }
  // The random cases too (every dtype: fp16/bf16 requests are unaffected).
  for (int i = 0; i < 80; ++i) {
    AttendCase c = RandomCase(rng);
    SCOPED_TRACE("case " + std::to_string(i));
    CompareWithReference(c, fused);
    if (HasFatalFailure()) return;
  }
}

TEST(CudaEngineTest, ExperimentalFusedIsCheckedWhenTheEngineIsMade) {
  REQUIRE_GPU();
  std::string why;
  EXPECT_EQ(EngineWith({{"ATTNSERVE_CUDA_EXPERIMENTAL_FUSED", "yes"}}, &why), nullptr);
  EXPECT_NE(why.find("ATTNSERVE_CUDA_EXPERIMENTAL_FUSED: 'yes' is not 0 or 1"), std::string::npos)
      << why;
  EXPECT_NE(EngineWith({{"ATTNSERVE_CUDA_EXPERIMENTAL_FUSED", "0"}}, &why), nullptr) << why;
}

// 80 random requests with a sliding window, logit softcapping or sinks
// (per request, on the sdpa layer), on `engine` (null: the default one)
// against the reference.
void WindowSoftcapAndSinksCases(AttentionEngine* engine, uint32_t seed) {
  std::mt19937 rng(seed);
  for (int i = 0; i < 80; ++i) {
    AttendCase c = RandomCase(rng, /*token_layout=*/false);
    if (rng() % 2 == 0) c.window = Pick<int64_t>(rng, {1, 3, 16, 50});
    if (rng() % 2 == 0) c.softcap = Pick(rng, {5.0f, 30.0f, 50.0f});
    if (rng() % 2 == 0 || (c.window == 0 && c.softcap == 0.0f)) {
      std::normal_distribution<float> sink(0.0f, 2.0f);
      c.sinks.resize(static_cast<size_t>(c.heads));
      for (float& x : c.sinks) x = sink(rng);
    }
    SCOPED_TRACE("case " + std::to_string(i));
    CompareWithReference(c, engine);
    if (::testing::Test::HasFatalFailure()) return;
  }
}

// On the default engine: cuDNN takes the windows and sinks it can; the
// rest (softcapping, windows with masks or key lengths, weights) runs on the
// unfused path (its weights too), in every dtype.
TEST(CudaEngineTest, WindowSoftcapAndSinksMatchReference) {
  REQUIRE_GPU();
  WindowSoftcapAndSinksCases(nullptr, 20261126);
}

// On the fused kernels written here (ATTNSERVE_CUDA_ATTENTION=kernels with
// ATTNSERVE_CUDA_EXPERIMENTAL_FUSED=1): every case at head dim 64 or 128
// without weights runs on flash_attention.cu or flash_attention_fp32.cu.
TEST(CudaEngineTest, FusedKernelsServeWindowSoftcapAndSinksExactly) {
  REQUIRE_GPU();
  std::string why;
  AttentionEngine* engine = ExperimentalEngine("kernels", &why);
  ASSERT_NE(engine, nullptr) << why;
  WindowSoftcapAndSinksCases(engine, 20261127);
}

// BLOOM's ALiBi slopes for `heads` heads, 2^(-8 (h + 1) / heads): each
// head's own, the steepest leaving keys far from the query negligible.
std::vector<float> AlibiSlopes(int64_t heads) {
  std::vector<float> slopes;
  for (int64_t h = 0; h < heads; ++h) {
    slopes.push_back(std::exp2(-8.0f * static_cast<float>(h + 1) / static_cast<float>(heads)));
  }
  return slopes;
}

// 60 random requests (RandomCase in head layout: GQA, causal and not, Lq !=
// Lk, masks, key lengths, weights; some with a window or sinks) on a bare
// layer with ALiBi slopes for their heads (LayerConfig::alibi_slopes), on
// `engine` (null: the default one) against the reference.
void AlibiCases(AttentionEngine* engine, uint32_t seed) {
  std::mt19937 rng(seed);
  std::map<int64_t, AttentionLayer> layers;  // by query heads; kept for the whole run
  for (int i = 0; i < 60; ++i) {
    AttendCase c = RandomCase(rng, /*token_layout=*/false);
    if (rng() % 3 == 0) c.window = Pick<int64_t>(rng, {1, 3, 16, 50});
    if (rng() % 4 == 0) {
      std::normal_distribution<float> sink(0.0f, 2.0f);
      c.sinks.resize(static_cast<size_t>(c.heads));
      for (float& x : c.sinks) x = sink(rng);
    }
    auto [it, fresh] = layers.try_emplace(c.heads, SdpaLayer());
    if (fresh) it->second.config.alibi_slopes = AlibiSlopes(c.heads);
    c.layer = &it->second;
    SCOPED_TRACE(absl::StrCat("case ", i, " alibi"));
    CompareWithReference(c, engine);
    if (::testing::Test::HasFatalFailure()) return;
  }
}

// On the default engine: cuDNN refuses ALiBi (its alibi mask has fixed
// slopes), so the unfused path and the general kernel serve it, in every
// dtype, weights too.
TEST(CudaEngineTest, AlibiMatchesReference) {
  REQUIRE_GPU();
  AlibiCases(nullptr, 20260301);
}

// On the fused kernels written here (ATTNSERVE_CUDA_EXPERIMENTAL_FUSED=1):
// every case at head dim 64 or 128 without weights runs on
// flash_attention.cu or flash_attention_fp32.cu.
TEST(CudaEngineTest, FusedKernelsServeAlibiExactly) {
  REQUIRE_GPU();
  std::string why;
  AttentionEngine* engine = ExperimentalEngine("kernels", &why);
  ASSERT_NE(engine, nullptr) << why;
  AlibiCases(engine, 20260302);
}

// The engine refuses an invalid task before touching any memory, and with it
// the whole batch.
TEST(CudaEngineTest, RejectsInvalidTasks) {
  REQUIRE_GPU();
  std::mt19937 rng(3);
  AttendCase c;
  c.heads = 3;
  c.kv_heads = 2;  // not a divisor
  c.Fill(rng);
  const AttentionTask uneven_heads = c.Task();
  EXPECT_EQ(Cuda().engine->Run(SdpaLayer(), {&uneven_heads, 1}).code(),
            absl::StatusCode::kInvalidArgument);

  AttendCase d;
  d.heads = d.kv_heads = 2;
  d.Fill(rng);
  AttentionTask short_output = d.Task();
  short_output.output.shape = {1, 2, 1, 32};
  EXPECT_EQ(Cuda().engine->Run(SdpaLayer(), {&short_output, 1}).code(),
            absl::StatusCode::kInvalidArgument);
  const AttentionTask mixed[] = {d.Task(), uneven_heads};
  EXPECT_EQ(Cuda().engine->Run(SdpaLayer(), mixed).code(), absl::StatusCode::kInvalidArgument);
}

// ---------------------------------------------------------------- Run

// A task with its buffers.
struct TaskBuffers {
  Tensor query, key, value, mask, output, weights;
  std::vector<int64_t> lengths;
  std::vector<int64_t> positions;
  AttentionTask task;
};

std::unique_ptr<TaskBuffers> RandomTask(const LayerConfig& config, std::mt19937& rng, DType dtype,
                                        bool self_attention) {
  auto t = std::make_unique<TaskBuffers>();
  const int64_t b = Pick<int64_t>(rng, {1, 2});
  const int64_t lq = Pick<int64_t>(rng, {1, 9, 64, 77});
  int64_t lk = self_attention ? lq : Pick<int64_t>(rng, {5, 64, 90});
  // The queries' temperature is defined at indexes Lk - Lq + i >= 0 only.
  if (config.temperature_tuning.enabled) lk = std::max(lk, lq);
  const int64_t hq = config.has_projections ? config.num_heads : 4;
  const int64_t hkv = config.has_projections ? config.num_kv_heads : 2;
  const int64_t dk = config.has_projections ? config.head_dim : 64;
  if (config.has_projections) {
    t->query = RandomTensor(dtype, {b, lq, config.query_dim}, rng);
    if (!self_attention) {
      t->key = RandomTensor(dtype, {b, lk, config.key_dim}, rng);
      t->value = RandomTensor(dtype, {b, lk, config.value_dim}, rng);
    }
    t->output = Tensor(dtype, {b, lq, config.out_dim});
  } else {
    t->query = RandomTensor(dtype, {b, hq, lq, dk}, rng, 2.0f);
    t->key = RandomTensor(dtype, {b, hkv, lk, dk}, rng);
    t->value = RandomTensor(dtype, {b, hkv, lk, dk}, rng);
    t->output = Tensor(dtype, {b, hq, lq, dk});
  }
  t->task.query = t->query.view();
  if (!self_attention || !config.has_projections) {
    t->task.key = t->key.view();
    t->task.value = t->value.view();
  }
  t->task.output = t->output.mutable_view();
  t->task.causal = config.causal || rng() % 3 == 0;
  t->task.scale = ResolveScale(config, 0.0f, dk);
  if (rng() % 3 == 0) {
    std::uniform_int_distribution<int64_t> len(0, lk);
    t->lengths.resize(static_cast<size_t>(b));
    for (int64_t& l : t->lengths) l = len(rng);
    t->task.key_lengths = t->lengths;
  }
  if (rng() % 3 == 0) {
    t->mask = Tensor(DType::kBool, {b, 1, lq, lk});
    for (int64_t i = 0; i < t->mask.num_elements(); ++i)
      t->mask.data_as<uint8_t>()[i] = rng() % 5 != 0;
    t->task.attn_mask = t->mask.view();
  }
  if (rng() % 3 == 0) {
    t->task.average_weights = rng() % 2 == 0;
    t->weights =
        Tensor(DType::kFloat32, t->task.average_weights ? Shape{b, lq, lk} : Shape{b, hq, lq, lk});
    t->task.weights = t->weights.mutable_view();
  }
  return t;
}

// Runs the tasks as one batch on CUDA (`engine`, the default engine when
// null) and one by one on the reference.
void CompareRun(const AttentionLayer& layer, std::vector<std::unique_ptr<TaskBuffers>>& tasks,
                Tolerance tol, AttentionEngine* engine = nullptr) {
  if (engine == nullptr) engine = Cuda().engine;
  std::vector<AttentionTask> batch;
  for (auto& t : tasks) batch.push_back(t->task);
  const absl::Status status = engine->Run(layer, batch);
  ASSERT_TRUE(status.ok()) << status;
  for (size_t i = 0; i < tasks.size(); ++i) {
    SCOPED_TRACE("task " + std::to_string(i));
    TaskBuffers& t = *tasks[i];
    Tensor ref_out(t.output.dtype(), t.output.shape());
    Tensor ref_weights =
        t.weights.byte_size() > 0 ? Tensor(t.weights.dtype(), t.weights.shape()) : Tensor();
    AttentionTask ref = t.task;
    ref.output = ref_out.mutable_view();
    if (ref_weights.byte_size() > 0) ref.weights = ref_weights.mutable_view();
    const absl::Status ref_status = Reference().Run(layer, {&ref, 1});
    ASSERT_TRUE(ref_status.ok()) << ref_status;
    ExpectClose(t.output, ref_out, tol, "output");
    if (ref_weights.byte_size() > 0) ExpectClose(t.weights, ref_weights, tol, "weights");
  }
}

TEST(CudaEngineTest, RunSdpaLayerMatchesReference) {
  REQUIRE_GPU();
  std::mt19937 rng(21);
  const AttentionLayer& layer = SdpaLayer();
  for (DType dtype : {DType::kFloat32, DType::kFloat16, DType::kBFloat16}) {
    SCOPED_TRACE(std::string(DTypeName(dtype)));
    std::vector<std::unique_ptr<TaskBuffers>> tasks;
    for (int i = 0; i < 5; ++i) tasks.push_back(RandomTask(layer.config, rng, dtype, false));
    CompareRun(layer, tasks, ToleranceFor(dtype));
  }
}

AttentionLayer ProjectionLayer(int64_t embed, int64_t heads, int64_t kv_heads, int64_t kdim,
                               int64_t vdim, bool biases, Precision precision, std::mt19937& rng) {
  AttentionLayer layer;
  LayerConfig& c = layer.config;
  c.name = "test-mha";
  c.has_projections = true;
  c.embed_dim = embed;
  c.num_heads = heads;
  c.num_kv_heads = kv_heads;
  c.head_dim = embed / heads;
  c.query_dim = embed;
  c.key_dim = kdim;
  c.value_dim = vdim;
  c.out_dim = embed;
  c.precision = precision;
  const float bound_q = 1.0f / std::sqrt(static_cast<float>(embed));
  const int64_t kv_features = kv_heads * c.head_dim;
  LayerWeights& w = layer.weights;
  w.wq = RandomTensor(DType::kFloat32, {embed, embed}, rng, bound_q);
  w.wk = RandomTensor(DType::kFloat32, {kv_features, kdim}, rng, 1.0f / std::sqrt(float(kdim)));
  w.wv = RandomTensor(DType::kFloat32, {kv_features, vdim}, rng, 1.0f / std::sqrt(float(vdim)));
  w.wo = RandomTensor(DType::kFloat32, {embed, embed}, rng, bound_q);
  if (biases) {
    w.bq = RandomTensor(DType::kFloat32, {embed}, rng, 0.1f);
    w.bk = RandomTensor(DType::kFloat32, {kv_features}, rng, 0.1f);
    w.bv = RandomTensor(DType::kFloat32, {kv_features}, rng, 0.1f);
    w.bo = RandomTensor(DType::kFloat32, {embed}, rng, 0.1f);
  }
  return layer;
}

TEST(CudaEngineTest, RunProjectionLayersMatchReference) {
  REQUIRE_GPU();
  std::mt19937 rng(42);
  struct Variant {
    int64_t embed, heads, kv_heads, kdim, vdim;
    bool biases;
    Precision precision;
    Tolerance tol;
  };
  const Variant variants[] = {
      {128, 4, 4, 128, 128, true, Precision::kFloat32, {1e-4, 1e-4}},    // general kernel, fp32
      {96, 4, 4, 96, 96, false, Precision::kFloat32, {1e-4, 1e-4}},      // no biases
      {96, 4, 2, 96, 96, true, Precision::kFloat32, {1e-4, 1e-4}},       // GQA, general kernel
      {96, 4, 4, 80, 48, true, Precision::kFloat32, {1e-4, 1e-4}},       // kdim != vdim != embed
      {96, 4, 2, 80, 48, false, Precision::kFloat32, {1e-4, 1e-4}},      // all three at once
      {256, 4, 4, 256, 256, true, Precision::kBFloat16, {6e-2, 6e-2}},   // fused, head_dim 64
      {512, 4, 2, 512, 512, true, Precision::kFloat16, {1.5e-2, 2e-2}},  // fused, head_dim 128, GQA
      {120, 5, 5, 120, 120, true, Precision::kBFloat16, {6e-2, 6e-2}},   // general kernel, bf16
  };
  for (const Variant& v : variants) {
    AttentionLayer layer =
        ProjectionLayer(v.embed, v.heads, v.kv_heads, v.kdim, v.vdim, v.biases, v.precision, rng);
    ASSERT_TRUE(ValidateLayer(layer).ok()) << ValidateLayer(layer);
    SCOPED_TRACE(absl::StrCat("embed ", v.embed, " heads ", v.heads, " kv_heads ", v.kv_heads,
                              " kdim ", v.kdim, " vdim ", v.vdim, v.biases ? " biases" : "",
                              " precision ", static_cast<int>(v.precision)));
    for (DType dtype : {DType::kFloat32, DType::kBFloat16}) {
      const bool self_ok = v.kdim == v.embed && v.vdim == v.embed;
      std::vector<std::unique_ptr<TaskBuffers>> tasks;
      for (int i = 0; i < 4; ++i) {
        tasks.push_back(RandomTask(layer.config, rng, dtype, self_ok && i % 2 == 0));
      }
      const Tolerance io = ToleranceFor(dtype);
      CompareRun(layer, tasks, {std::max(v.tol.atol, io.atol), std::max(v.tol.rtol, io.rtol)});
      if (HasFatalFailure()) return;
    }
  }
}

// Inputs in the engine's page-locked request memory (what the server's
// front end copies a request's tensors into) are uploaded in place, and
// results there are downloaded in place over whatever the buffers held; the
// results are bitwise those of the same inputs in ordinary memory.
TEST(CudaEngineTest, InputsInRequestMemoryGiveTheSameResultsBitwise) {
  REQUIRE_GPU();
  std::shared_ptr<HostBufferPool> memory = Cuda().engine->request_memory();
  ASSERT_NE(memory, nullptr) << "the CUDA engine offers page-locked request memory";
  std::mt19937 rng(77);
  const AttentionLayer projected =
      ProjectionLayer(256, 4, 2, 256, 256, true, Precision::kBFloat16, rng);
  for (const AttentionLayer* layer : {&SdpaLayer(), &projected}) {
    for (DType dtype : {DType::kFloat32, DType::kFloat16}) {
      SCOPED_TRACE(absl::StrCat(layer->config.name, " ", std::string(DTypeName(dtype))));
      std::vector<std::unique_ptr<TaskBuffers>> tasks;
      for (int i = 0; i < 4; ++i) {
        tasks.push_back(RandomTask(layer->config, rng, dtype, layer == &projected && i % 2 == 0));
      }
      std::vector<AttentionTask> batch;
      for (auto& t : tasks) batch.push_back(t->task);
      ASSERT_TRUE(Cuda().engine->Run(*layer, batch).ok());
      // The same inputs again, copied into request memory, and the results
      // there too, over stale bytes (downloaded in place, every byte written).
      std::vector<HostBuffer> held;
      std::vector<std::pair<const HostBuffer*, Shape>> outputs;
      auto move_in = [&](TensorView& view) {
        if (view.empty()) return;
        absl::StatusOr<HostBuffer> buffer = memory->Allocate(view.byte_size());
        ASSERT_TRUE(buffer.ok()) << buffer.status();
        std::memcpy(buffer->data(), view.data, view.byte_size());
        ASSERT_TRUE(memory->Contains(buffer->data(), view.byte_size()));
        view.data = buffer->data();
        held.push_back(*std::move(buffer));
      };
      held.reserve(batch.size() * 6);  // pointers into it stay valid
      auto result_in = [&](MutableTensorView& view) {
        if (view.empty()) return;
        absl::StatusOr<HostBuffer> buffer = memory->Allocate(view.byte_size());
        ASSERT_TRUE(buffer.ok()) << buffer.status();
        std::memset(buffer->data(), 0xFF, view.byte_size());
        view.data = buffer->data();
        held.push_back(*std::move(buffer));
        outputs.emplace_back(&held.back(), view.shape);
      };
      for (AttentionTask& task : batch) {
        move_in(task.query);
        move_in(task.key);
        move_in(task.value);
        move_in(task.attn_mask);
        result_in(task.output);
        result_in(task.weights);
      }
      ASSERT_TRUE(Cuda().engine->Run(*layer, batch).ok());
      size_t o = 0;
      auto expect_same = [&](const Tensor& want, const std::string& what) {
        const HostBuffer& got = *outputs[o++].first;
        ASSERT_EQ(got.size(), want.byte_size()) << what;
        EXPECT_EQ(std::memcmp(got.data(), want.data(), got.size()), 0)
            << what << ": not bit-identical";
      };
      for (size_t i = 0; i < tasks.size(); ++i) {
        expect_same(tasks[i]->output, absl::StrCat("task ", i, " output"));
        if (!tasks[i]->task.weights.empty()) {
          expect_same(tasks[i]->weights, absl::StrCat("task ", i, " weights"));
        }
      }
    }
  }
}

// The layers of today's LLMs (engine/attention_layer.h): RoPE of every
// scaling type, QK-norm, sliding windows, softcapping and sinks, alone and
// as the models combine them, with implicit and explicit positions, against
// the reference engine. RoPE and QK-norm alone keep a bf16/fp16 layer on
// cuDNN (head dim 64); the rest run on the unfused path.
TEST(CudaEngineTest, LlmLayerFeaturesMatchReference) {
  REQUIRE_GPU();
  std::mt19937 rng(7);
  struct Variant {
    const char* name;
    void (*set)(LayerConfig&);
    bool qk_norm = false, norm_offset = false, sinks = false, gate = false;
  };
  const Variant variants[] = {
      {"llama rope", [](LayerConfig& c) {
         c.rope.type = RopeConfig::Type::kDefault;
         c.rope.theta = 500000.0;
         c.rope.rotary_dim = c.head_dim;
       }},
      {"gpt-j rope: linear, interleaved, partial", [](LayerConfig& c) {
         c.rope.type = RopeConfig::Type::kLinear;
         c.rope.factor = 2.0;
         c.rope.rotary_dim = c.head_dim / 2;
         c.rope.interleaved = true;
       }},
      {"llama3 rope", [](LayerConfig& c) {
         c.rope.type = RopeConfig::Type::kLlama3;
         c.rope.theta = 500000.0;
         c.rope.rotary_dim = c.head_dim;
         c.rope.factor = 8.0;
         c.rope.low_freq_factor = 1.0;
         c.rope.high_freq_factor = 4.0;
         c.rope.original_max_position_embeddings = 8192;
       }},
      {"qwen3: qk-norm, rope", [](LayerConfig& c) {
         c.rope.type = RopeConfig::Type::kDefault;
         c.rope.theta = 1000000.0;
         c.rope.rotary_dim = c.head_dim;
         c.qk_norm.enabled = true;
         c.qk_norm.eps = 1e-6;
       }, true},
      {"mistral: rope, causal sliding window", [](LayerConfig& c) {
         c.rope.type = RopeConfig::Type::kDefault;
         c.rope.rotary_dim = c.head_dim;
         c.causal = true;
         c.sliding_window = 16;
       }},
      {"gemma2: softcap, window", [](LayerConfig& c) {
         c.rope.type = RopeConfig::Type::kDefault;
         c.rope.rotary_dim = c.head_dim;
         c.softcap = 50.0f;
         c.sliding_window = 8;
       }},
      {"gemma3: qk-norm (1 + w), rope, window", [](LayerConfig& c) {
         c.rope.type = RopeConfig::Type::kLinear;
         c.rope.factor = 8.0;
         c.rope.rotary_dim = c.head_dim;
         c.qk_norm.enabled = true;
         c.qk_norm.weight_offset = true;
         c.sliding_window = 12;
       }, true, true},
      {"gpt-oss: yarn, sinks, window", [](LayerConfig& c) {
         c.rope.type = RopeConfig::Type::kYarn;
         c.rope.theta = 150000.0;
         c.rope.rotary_dim = c.head_dim;
         c.rope.factor = 32.0;
         c.rope.original_max_position_embeddings = 4096;
         c.rope.beta_fast = 32.0;
         c.rope.beta_slow = 1.0;
         c.rope.attention_factor = 0.1 * std::log(32.0) + 1.0;
         c.sliding_window = 10;
       }, false, false, true},
      {"olmo-2: qk-norm over the whole projection, rope", [](LayerConfig& c) {
         c.rope.type = RopeConfig::Type::kDefault;
         c.rope.theta = 500000.0;
         c.rope.rotary_dim = c.head_dim;
         c.qk_norm.enabled = true;
         c.qk_norm.eps = 1e-6;
         c.qk_norm.whole_projection = true;
       }, true},
      {"hunyuan: qk-norm after rope", [](LayerConfig& c) {
         c.rope.type = RopeConfig::Type::kDefault;
         c.rope.theta = 10000.0 * 1000.0;
         c.rope.rotary_dim = c.head_dim;
         c.qk_norm.enabled = true;
         c.qk_norm.eps = 1e-5;
         c.qk_norm.after_rope = true;
       }, true},
      {"phi-4-mini: longrope, partial", [](LayerConfig& c) {
         // Requests past 16 positions (the far explicit ones among them)
         // take the long factors, the others the short ones.
         c.rope.type = RopeConfig::Type::kLongRope;
         c.rope.rotary_dim = c.head_dim * 3 / 4;
         c.rope.factor = 32.0;
         c.rope.original_max_position_embeddings = 16;
         c.rope.attention_factor = 1.19;
         for (int64_t i = 0; i < c.rope.rotary_dim / 2; ++i) {
           c.rope.short_factor.push_back(1.0 + 0.1 * static_cast<double>(i % 5));
           c.rope.long_factor.push_back(1.0 + 2.0 * static_cast<double>(i));
         }
       }},
      {"qwen3-next: output gate, qk-norm (1 + w), partial rope", [](LayerConfig& c) {
         c.rope.type = RopeConfig::Type::kDefault;
         c.rope.theta = 10000000.0;
         c.rope.rotary_dim = c.head_dim / 4;
         c.qk_norm.enabled = true;
         c.qk_norm.weight_offset = true;
       }, true, true, false, true},
      {"llama 4 rope layer: chunked attention, interleaved llama3 rope, L2 norm after it",
       [](LayerConfig& c) {
         c.rope.type = RopeConfig::Type::kLlama3;
         c.rope.theta = 500000.0;
         c.rope.rotary_dim = c.head_dim;
         c.rope.interleaved = true;
         c.rope.factor = 16.0;
         c.rope.low_freq_factor = 1.0;
         c.rope.high_freq_factor = 1.0 + 1.0 / 8;
         c.rope.original_max_position_embeddings = 8192;
         c.qk_norm.enabled = true;
         c.qk_norm.eps = 1e-5;
         c.qk_norm.after_rope = true;
         c.causal = true;
         c.attention_chunk = 16;
       }, true},
      {"cohere: layer-norm qk-norm with weights per head, interleaved rope", [](LayerConfig& c) {
         c.rope.type = RopeConfig::Type::kDefault;
         c.rope.theta = 75000000.0;
         c.rope.rotary_dim = c.head_dim;
         c.rope.interleaved = true;
         c.qk_norm.enabled = true;
         c.qk_norm.eps = 1e-5;
         c.qk_norm.subtract_mean = true;
         c.qk_norm.per_head_weights = true;
       }, true},
      {"ministral 3: yarn rope, temperature by position", [](LayerConfig& c) {
         c.rope.type = RopeConfig::Type::kYarn;
         c.rope.theta = 1000000.0;
         c.rope.rotary_dim = c.head_dim;
         c.rope.factor = 16.0;
         c.rope.original_max_position_embeddings = 64;
         c.rope.beta_fast = 32.0;
         c.rope.beta_slow = 1.0;
         c.rope.attention_factor = 1.0;
         c.temperature_tuning = {true, 32.0, 0.1, true};
       }},
      {"olmo: clip_qkv, rope", [](LayerConfig& c) {
         c.rope.type = RopeConfig::Type::kDefault;
         c.rope.rotary_dim = c.head_dim;
         c.causal = true;
         c.clip_qkv = 0.25f;
       }},
      {"gemma 4: qk-norm, v_norm, partial rope, window, scale 1", [](LayerConfig& c) {
         c.rope.type = RopeConfig::Type::kDefault;
         c.rope.theta = 31.6;
         c.rope.rotary_dim = c.head_dim / 4;
         c.qk_norm.enabled = true;
         c.qk_norm.eps = 1e-6;
         c.v_norm_eps = 1e-6;
         c.scale = 1.0f;
         c.causal = true;
         c.sliding_window = 12;
       }, true},
      {"llama 4 layer without rope: temperature tuning", [](LayerConfig& c) {
         c.causal = true;
         c.temperature_tuning.enabled = true;
         c.temperature_tuning.floor_scale = 4.0;
         c.temperature_tuning.attn_scale = 0.1;
       }},
  };
  for (const Variant& v : variants) {
    for (Precision precision : {Precision::kFloat32, Precision::kBFloat16, Precision::kFloat16}) {
      AttentionLayer layer = ProjectionLayer(256, 4, 2, 256, 256, true, precision, rng);
      v.set(layer.config);
      if (v.qk_norm) {
        const LayerConfig& c = layer.config;
        layer.weights.q_norm = RandomTensor(
            DType::kFloat32, {QkNormWeightCount(c.qk_norm, c.num_heads, c.head_dim)}, rng, 0.5f);
        layer.weights.k_norm = RandomTensor(
            DType::kFloat32, {QkNormWeightCount(c.qk_norm, c.num_kv_heads, c.head_dim)}, rng,
            0.5f);
        if (!v.norm_offset) {  // around 1, as trained RMSNorm weights are
          for (Tensor* t : {&layer.weights.q_norm, &layer.weights.k_norm}) {
            for (int64_t d = 0; d < t->num_elements(); ++d) t->data_as<float>()[d] += 1.0f;
          }
        }
      }
      if (v.sinks) {
        layer.config.sinks = true;
        layer.weights.sinks = RandomTensor(DType::kFloat32, {layer.config.num_heads}, rng, 3.0f);
      }
      if (v.gate) {  // gates spread over sigmoid's curve, not only its middle
        const LayerConfig& c = layer.config;
        layer.config.output_gate = true;
        layer.weights.wg = RandomTensor(DType::kFloat32, {c.num_heads * c.head_dim, c.query_dim},
                                        rng, 3.0f / std::sqrt(static_cast<float>(c.query_dim)));
        layer.weights.bg = RandomTensor(DType::kFloat32, {c.num_heads * c.head_dim}, rng, 0.5f);
      }
      ASSERT_TRUE(ValidateLayer(layer).ok()) << v.name << ": " << ValidateLayer(layer);
      SCOPED_TRACE(absl::StrCat(v.name, ", precision ", static_cast<int>(precision)));
      std::vector<std::unique_ptr<TaskBuffers>> tasks;
      for (int i = 0; i < 4; ++i) {
        tasks.push_back(RandomTask(layer.config, rng, DType::kFloat32, i % 2 == 0));
        TaskBuffers& t = *tasks.back();
        const int64_t b = t.query.shape()[0], lq = t.query.shape()[1];
        const int64_t lk = t.task.key.empty() ? lq : t.key.shape()[1];
        if (i >= 2 && lq <= lk && layer.config.rope.type != RopeConfig::Type::kNone &&
            layer.config.attention_chunk == 0) {  // explicit positions: left padding, far ones
          std::uniform_int_distribution<int64_t> start(0, 5000);
          t.positions.resize(static_cast<size_t>(b * lk));
          for (int64_t s = 0; s < b; ++s) {
            const int64_t first = start(rng);
            for (int64_t j = 0; j < lk; ++j) t.positions[s * lk + j] = first + j;
          }
          t.task.positions = t.positions;
        }
      }
      const Tolerance tol = precision == Precision::kFloat32   ? Tolerance{1e-4, 1e-4}
                            : precision == Precision::kFloat16 ? Tolerance{1.5e-2, 2e-2}
                                                               : Tolerance{6e-2, 6e-2};
      CompareRun(layer, tasks, tol);
      if (HasFatalFailure()) return;
    }
  }
}

// ---------------------------------------------------------------- sessions

// A session's paged K/V cache in the CUDA engine's memory (kv_slab_memory():
// device memory, never dereferenced here): one slab holding every block,
// each block its K part then its V part, as the server's pool lays them out.
class DeviceCache {
 public:
  DeviceCache(AttentionEngine& engine, DType dtype, int64_t kv_heads, int64_t dk, int64_t dv,
              int64_t block_tokens, int64_t max_tokens)
      : memory_(engine.kv_slab_memory()), dtype_(dtype), kv_heads_(kv_heads), dk_(dk), dv_(dv),
        block_tokens_(block_tokens) {
    const int64_t blocks = (max_tokens + block_tokens - 1) / block_tokens;
    const int64_t k_bytes = block_tokens * kv_heads * dk * static_cast<int64_t>(DTypeSize(dtype));
    const int64_t block_bytes =
        k_bytes + block_tokens * kv_heads * dv * static_cast<int64_t>(DTypeSize(dtype));
    bytes_ = blocks * block_bytes;
    if (memory_ == nullptr) return;
    base_ = static_cast<char*>(memory_->Map(bytes_));
    if (base_ == nullptr) return;
    for (int64_t i = 0; i < blocks; ++i) {
      k_blocks_.push_back(base_ + i * block_bytes);
      v_blocks_.push_back(base_ + i * block_bytes + k_bytes);
    }
  }
  ~DeviceCache() {
    if (base_ != nullptr) memory_->Unmap(base_, bytes_);
  }
  bool ok() const { return base_ != nullptr; }

  // The table for a task whose first new row goes to `cached`.
  PagedKv At(int64_t cached) const {
    PagedKv p;
    p.dtype = dtype_;
    p.num_kv_heads = kv_heads_;
    p.head_dim = dk_;
    p.head_dim_v = dv_;
    p.block_tokens = block_tokens_;
    p.cached_len = cached;
    p.k_blocks = k_blocks_;
    p.v_blocks = v_blocks_;
    return p;
  }

  // Forgets the blocks wholly before token `first` (a session releasing
  // what its sliding window no longer sees): the engine must not touch them.
  void Release(int64_t first) {
    for (int64_t i = 0; i < first / block_tokens_ && i < static_cast<int64_t>(k_blocks_.size());
         ++i) {
      k_blocks_[i] = v_blocks_[i] = nullptr;
    }
  }

 private:
  std::shared_ptr<KvSlabMemory> memory_;
  DType dtype_;
  int64_t kv_heads_, dk_, dv_, block_tokens_, bytes_ = 0;
  char* base_ = nullptr;
  std::vector<void*> k_blocks_, v_blocks_;
};

// Rows [r0, r0 + n) of axis `axis` (the length axis) of a contiguous tensor.
Tensor SliceRows(const Tensor& t, int axis, int64_t r0, int64_t n) {
  Shape shape = t.shape();
  const int64_t len = shape[axis];
  int64_t outer = 1, inner = static_cast<int64_t>(DTypeSize(t.dtype()));
  for (int a = 0; a < axis; ++a) outer *= shape[a];
  for (size_t a = axis + 1; a < shape.size(); ++a) inner *= shape[a];
  shape[axis] = n;
  Tensor out(t.dtype(), shape);
  for (int64_t o = 0; o < outer; ++o) {
    std::memcpy(static_cast<char*>(out.data()) + o * n * inner,
                static_cast<const char*>(t.data()) + (o * len + r0) * inner,
                static_cast<size_t>(n * inner));
  }
  return out;
}

// What a session's steps run against: one request over the whole sequence.
struct SessionOptionsForTest {
  int64_t window = 0;
  float softcap = 0.0f;
  bool sinks = false;
  int64_t chunk = 0;  // the layer's attention_chunk (a causal layer)
  bool alibi = false;  // the layer's ALiBi slopes (AlibiSlopes)
};

// An sdpa session fed `steps` new tokens at a time equals one causal request
// over all of them, step by step (the reference engine on the full request);
// with a window, blocks before each step's FirstWindowKey are released
// (null) first. The last step, run again, gives the same bits. On `engine`
// (the default engine when null).
void CheckSdpaSession(DType dtype, int64_t hq, int64_t hkv, int64_t dk, int64_t dv,
                      int64_t block_tokens, const std::vector<int64_t>& steps,
                      SessionOptionsForTest opt, uint32_t seed,
                      AttentionEngine* engine = nullptr) {
  if (engine == nullptr) engine = Cuda().engine;
  SCOPED_TRACE(absl::StrCat(DTypeName(dtype).data(), " Hq", hq, " Hkv", hkv, " Dk", dk, " Dv",
                            dv, " block_tokens ", block_tokens, " window ", opt.window,
                            " softcap ", opt.softcap, opt.sinks ? " sinks" : "", " chunk ",
                            opt.chunk, opt.alibi ? " alibi" : ""));
  std::mt19937 rng(seed);
  int64_t len = 0;
  for (int64_t s : steps) len += s;
  const Tensor q = RandomTensor(dtype, {1, hq, len, dk}, rng, 2.0f);
  const Tensor k = RandomTensor(dtype, {1, hkv, len, dk}, rng);
  const Tensor v = RandomTensor(dtype, {1, hkv, len, dv}, rng);
  std::vector<float> sinks;
  if (opt.sinks) {
    std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
    for (int64_t h = 0; h < hq; ++h) sinks.push_back(dist(rng));
  }
  AttentionLayer layer = SdpaLayer();
  if (opt.chunk > 0) {  // Llama 4's chunked attention
    layer.config.causal = true;
    layer.config.attention_chunk = opt.chunk;
  }
  if (opt.alibi) layer.config.alibi_slopes = AlibiSlopes(hq);

  Tensor want(DType::kFloat32, {1, hq, len, dv});
  AttentionTask full;
  full.query = q.view();
  full.key = k.view();
  full.value = v.view();
  full.causal = true;
  full.scale = ResolveScale(layer.config, 0.0f, dk);
  full.window = opt.window;
  full.softcap = opt.softcap;
  full.sinks = sinks;
  full.output = want.mutable_view();
  ASSERT_TRUE(Reference().Run(layer, {&full, 1}).ok());

  DeviceCache cache(*engine, dtype, hkv, dk, dv, block_tokens, len);
  ASSERT_TRUE(cache.ok()) << "kv_slab_memory() gave no memory";
  int64_t cached = 0;
  for (size_t n = 0; n < steps.size(); ++n) {
    const int64_t step = steps[n];
    const Tensor qs = SliceRows(q, 2, cached, step);
    const Tensor ks = SliceRows(k, 2, cached, step);
    const Tensor vs = SliceRows(v, 2, cached, step);
    Tensor got(dtype, {1, hq, step, dv});
    AttentionTask t = full;
    t.query = qs.view();
    t.key = ks.view();
    t.value = vs.view();
    t.output = got.mutable_view();
    if (opt.window > 0 || opt.chunk > 0) {
      cache.Release(FirstWindowKey(cached, opt.window, opt.chunk));
    }
    t.paged = cache.At(cached);
    const absl::Status status = engine->Run(layer, {&t, 1});
    ASSERT_TRUE(status.ok()) << status << " at " << cached;
    ExpectClose(got, SliceRows(want, 2, cached, step), ToleranceFor(dtype),
                absl::StrCat("step of ", step, " at ", cached));
    if (n + 1 == steps.size()) {
      Tensor again(dtype, {1, hq, step, dv});
      t.output = again.mutable_view();
      ASSERT_TRUE(engine->Run(layer, {&t, 1}).ok());
      ExpectIdentical(got, again, "the last step run again");
    }
    if (::testing::Test::HasFailure()) return;
    cached += step;
  }
}

// A prefill of 37 tokens (gathered, then the core kernels), 20 decode steps
// and a 5-token append (the split-KV decode).
std::vector<int64_t> SessionSteps() {
  std::vector<int64_t> steps = {37};
  for (int i = 0; i < 20; ++i) steps.push_back(1);
  steps.push_back(5);
  return steps;
}

// A projection layer's session fed `steps` new tokens at a time equals one
// causal request over all of them (the reference engine), step by step, on
// `engine` (the default engine when null).
void CheckProjectionSession(const AttentionLayer& layer, DType dtype, Tolerance tol,
                            const std::vector<int64_t>& steps, std::mt19937& rng,
                            AttentionEngine* engine = nullptr) {
  if (engine == nullptr) engine = Cuda().engine;
  const LayerConfig& c = layer.config;
  int64_t len = 0;
  for (int64_t s : steps) len += s;
  const Tensor x = RandomTensor(dtype, {1, len, c.query_dim}, rng);
  Tensor want(DType::kFloat32, {1, len, c.out_dim});
  AttentionTask full;
  full.query = x.view();
  full.causal = true;
  full.scale = ResolveScale(c, 0.0f, c.head_dim);
  full.output = want.mutable_view();
  ASSERT_TRUE(Reference().Run(layer, {&full, 1}).ok());

  const KvCacheGeometry g = engine->SessionCacheGeometry(c);
  DeviceCache cache(*engine, DType::kFloat32, g.num_kv_heads, g.head_dim, g.head_dim_v, 16, len);
  ASSERT_TRUE(cache.ok());
  int64_t cached = 0;
  for (int64_t step : steps) {
    const Tensor xs = SliceRows(x, 1, cached, step);
    Tensor got(dtype, {1, step, c.out_dim});
    AttentionTask t = full;
    t.query = xs.view();
    t.output = got.mutable_view();
    t.paged = cache.At(cached);
    const absl::Status status = engine->Run(layer, {&t, 1});
    ASSERT_TRUE(status.ok()) << status << " at " << cached;
    const Tolerance io = ToleranceFor(dtype);
    ExpectClose(got, SliceRows(want, 1, cached, step),
                {std::max(tol.atol, io.atol), std::max(tol.rtol, io.rtol)},
                absl::StrCat("step of ", step, " at ", cached));
    if (::testing::Test::HasFailure()) return;
    cached += step;
  }
}

TEST(CudaEngineTest, ServesSessionsInDeviceMemory) {
  REQUIRE_GPU();
  EXPECT_TRUE(Cuda().engine->SupportsSessions());
  std::shared_ptr<KvSlabMemory> memory = Cuda().engine->kv_slab_memory();
  ASSERT_NE(memory, nullptr);
  void* slab = memory->Map(int64_t{2} << 20);
  ASSERT_NE(slab, nullptr);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(slab) % 256, 0u);
  memory->Unmap(slab, int64_t{2} << 20);
}

TEST(CudaEngineTest, SdpaSessionStepsEqualOneCausalRequest) {
  REQUIRE_GPU();
  uint32_t seed = 100;
  for (DType dtype : {DType::kFloat32, DType::kFloat16, DType::kBFloat16}) {
    for (int64_t block_tokens : {16, 64}) {
      for (int64_t d : {64, 128}) {
        CheckSdpaSession(dtype, 8, 2, d, d, block_tokens, SessionSteps(), {}, ++seed);
        if (HasFailure()) return;
      }
    }
    CheckSdpaSession(dtype, 4, 4, 40, 24, 16, SessionSteps(), {}, ++seed);  // Dv != Dk, MHA
    if (HasFailure()) return;
  }
}

TEST(CudaEngineTest, SdpaSessionWindowSoftcapSinksEqualOneRequest) {
  REQUIRE_GPU();
  uint32_t seed = 200;
  for (DType dtype : {DType::kFloat32, DType::kFloat16, DType::kBFloat16}) {
    CheckSdpaSession(dtype, 8, 2, 64, 64, 16, SessionSteps(), {.window = 9}, ++seed);
    CheckSdpaSession(dtype, 8, 2, 64, 64, 16, SessionSteps(), {.softcap = 0.5f}, ++seed);
    CheckSdpaSession(dtype, 8, 2, 64, 64, 64, SessionSteps(), {.sinks = true}, ++seed);
    CheckSdpaSession(dtype, 8, 2, 128, 128, 16, SessionSteps(),
                     {.window = 20, .softcap = 1.0f, .sinks = true}, ++seed);
    if (HasFailure()) return;
  }
  // Past the 256-token grain of FirstWindowKey: the blocks before each
  // step's window are null (released) and must never be read or written.
  std::vector<int64_t> long_steps = {290};
  for (int i = 0; i < 12; ++i) long_steps.push_back(1);
  long_steps.push_back(7);
  CheckSdpaSession(DType::kFloat32, 4, 2, 64, 64, 16, long_steps, {.window = 24}, 300);
  CheckSdpaSession(DType::kBFloat16, 4, 1, 64, 32, 16, long_steps,
                   {.window = 30, .softcap = 2.0f, .sinks = true}, 301);
  // Chunked attention (Llama 4): steps that cross chunks of 16 and of 48;
  // past 256 tokens, the blocks before the step's chunk are released.
  for (DType dtype : {DType::kFloat32, DType::kFloat16, DType::kBFloat16}) {
    CheckSdpaSession(dtype, 8, 2, 64, 64, 16, SessionSteps(), {.chunk = 16}, ++seed);
    if (HasFailure()) return;
  }
  CheckSdpaSession(DType::kBFloat16, 4, 2, 64, 64, 16, long_steps, {.chunk = 48}, 302);
  CheckSdpaSession(DType::kFloat32, 4, 2, 64, 64, 16, long_steps,
                   {.window = 20, .chunk = 48}, 303);
}

// Long contexts through the split-KV decode (paged_attention.h): several
// key chunks, row tiles that span heads (a group of 8, up to 16 query rows),
// head dims of 256 (eight features per lane) and K rows that are not
// 16-byte multiples (read element by element).
TEST(CudaEngineTest, SdpaSessionDecodeTilesAndChunks) {
  REQUIRE_GPU();
  const std::vector<int64_t> steps = {700, 1, 1, 9, 16, 1};
  CheckSdpaSession(DType::kFloat16, 16, 2, 128, 128, 64, steps, {}, 400);
  if (HasFailure()) return;
  CheckSdpaSession(DType::kBFloat16, 8, 8, 256, 256, 16, steps, {}, 401);
  if (HasFailure()) return;
  CheckSdpaSession(DType::kFloat16, 6, 3, 36, 20, 16, steps, {.window = 300, .sinks = true}, 402);
}

// ALiBi over sessions, whose rows sit after the cached tokens (the bias
// counts from each row's position in the whole sequence): a bare layer's
// prefill (gathered, then the core kernels), decode steps and an append
// (the split-KV decode, its tiles spanning a group's heads), with a window
// and sinks too, in every dtype; then a projection layer with ALiBi, its
// stateless requests and a session, in every precision.
TEST(CudaEngineTest, AlibiSessionsAndProjectionLayersMatchReference) {
  REQUIRE_GPU();
  uint32_t seed = 700;
  for (DType dtype : {DType::kFloat32, DType::kFloat16, DType::kBFloat16}) {
    CheckSdpaSession(dtype, 8, 2, 64, 64, 16, SessionSteps(), {.alibi = true}, ++seed);
    CheckSdpaSession(dtype, 6, 3, 36, 20, 64, SessionSteps(),
                     {.window = 9, .sinks = true, .alibi = true}, ++seed);
    if (HasFailure()) return;
  }
  std::mt19937 rng(710);
  for (Precision precision : {Precision::kFloat32, Precision::kBFloat16, Precision::kFloat16}) {
    SCOPED_TRACE(absl::StrCat("alibi projection layer, precision ", static_cast<int>(precision)));
    AttentionLayer layer = ProjectionLayer(256, 4, 2, 256, 256, true, precision, rng);
    layer.config.alibi_slopes = AlibiSlopes(4);
    ASSERT_TRUE(ValidateLayer(layer).ok()) << ValidateLayer(layer);
    std::vector<std::unique_ptr<TaskBuffers>> tasks;
    for (int i = 0; i < 4; ++i) {
      tasks.push_back(RandomTask(layer.config, rng, DType::kFloat32, i % 2 == 0));
    }
    const Tolerance tol = precision == Precision::kFloat32   ? Tolerance{1e-4, 1e-4}
                          : precision == Precision::kFloat16 ? Tolerance{1.5e-2, 2e-2}
                                                             : Tolerance{6e-2, 6e-2};
    CompareRun(layer, tasks, tol);
    if (HasFatalFailure()) return;
    const DType dtype = precision == Precision::kFloat32   ? DType::kFloat32
                        : precision == Precision::kFloat16 ? DType::kFloat16
                                                           : DType::kBFloat16;
    CheckProjectionSession(layer, dtype, tol, SessionSteps(), rng);
    if (HasFailure()) return;
  }
}

// A projection layer of `precision` (256 wide, 4 query heads over 2 kv
// heads: head dim 64) with a learned relative position bias of `distance`
// (LayerWeights::relative_bias: entries in [-2, 2], distinct on each side,
// so a lookup at the wrong distance shows), and ALiBi's slopes too when
// asked.
AttentionLayer RelativeBiasLayer(Precision precision, int64_t distance, bool alibi,
                                 std::mt19937& rng) {
  AttentionLayer layer = ProjectionLayer(256, 4, 2, 256, 256, true, precision, rng);
  layer.config.relative_bias_distance = distance;
  layer.weights.relative_bias = RandomTensor(DType::kFloat32, {4, 2 * distance + 1}, rng, 2.0f);
  if (alibi) layer.config.alibi_slopes = AlibiSlopes(4);
  return layer;
}

// `layer` on `engine` (null: the default one) against the reference: four
// random requests (self- and cross-attention, masks, key lengths, weights),
// then a session in the layer's precision, within that precision's
// tolerance.
void RequestsAndSession(const AttentionLayer& layer, std::mt19937& rng, AttentionEngine* engine) {
  ASSERT_TRUE(ValidateLayer(layer).ok()) << ValidateLayer(layer);
  std::vector<std::unique_ptr<TaskBuffers>> tasks;
  for (int i = 0; i < 4; ++i) {
    tasks.push_back(RandomTask(layer.config, rng, DType::kFloat32, i % 2 == 0));
  }
  const Precision precision = layer.config.precision;
  const Tolerance tol = precision == Precision::kFloat32   ? Tolerance{1e-4, 1e-4}
                        : precision == Precision::kFloat16 ? Tolerance{1.5e-2, 2e-2}
                                                           : Tolerance{6e-2, 6e-2};
  CompareRun(layer, tasks, tol, engine);
  if (::testing::Test::HasFatalFailure()) return;
  const DType dtype = precision == Precision::kFloat32   ? DType::kFloat32
                      : precision == Precision::kFloat16 ? DType::kFloat16
                                                         : DType::kBFloat16;
  CheckProjectionSession(layer, dtype, tol, SessionSteps(), rng, engine);
}

// Projection layers with a relative position bias (T5, MPNet) on `engine`
// (null: the default one), in every precision: distances 3 and 5, which
// requests of up to 90 keys and the sessions' 62 tokens pass on both sides
// (causal and not), and 128, past them all; ALiBi beside the table on one.
// Four random requests each (self- and cross-attention, masks, key
// lengths, weights), then a session (a prefill through the core kernels,
// decode steps and an append through the split-KV decode, each row's
// distances counted from its position in the whole sequence).
void RelativeBiasCases(AttentionEngine* engine, uint32_t seed) {
  std::mt19937 rng(seed);
  struct Variant {
    Precision precision;
    int64_t distance;
    bool alibi;
  };
  for (const Variant& v : {Variant{Precision::kFloat32, 3, false},
                           Variant{Precision::kBFloat16, 5, false},
                           Variant{Precision::kFloat16, 3, true},
                           Variant{Precision::kFloat32, 128, false}}) {
    SCOPED_TRACE(absl::StrCat("relative bias ", v.distance, v.alibi ? " alibi" : "",
                              " precision ", static_cast<int>(v.precision)));
    RequestsAndSession(RelativeBiasLayer(v.precision, v.distance, v.alibi, rng), rng, engine);
    if (::testing::Test::HasFailure()) return;
  }
}

// On the default engine: cuDNN refuses the table (it takes no bias table),
// so the unfused path and the general kernel serve it, weights too, and the
// split-KV decode a session's steps.
TEST(CudaEngineTest, RelativeBiasProjectionLayersAndSessionsMatchReference) {
  REQUIRE_GPU();
  RelativeBiasCases(nullptr, 720);
}

// On the fused kernels written here (ATTNSERVE_CUDA_EXPERIMENTAL_FUSED=1):
// the requests without weights and the sessions' prefills run on
// flash_attention.cu or flash_attention_fp32.cu.
TEST(CudaEngineTest, FusedKernelsServeRelativeBiasExactly) {
  REQUIRE_GPU();
  std::string why;
  AttentionEngine* engine = ExperimentalEngine("kernels", &why);
  ASSERT_NE(engine, nullptr) << why;
  RelativeBiasCases(engine, 721);
}

// A projection layer of `precision` (256 wide, 4 query heads over 2 kv
// heads: head dim 64) with relative position embeddings of `distance`
// (DeBERTa's disentangled attention, LayerWeights::relative_key and
// relative_query as `c2p` and `p2c` say: entries in [-scale, scale], by
// default large enough that each score's terms move its probability and a
// column at the wrong distance shows), a relative bias table and ALiBi's
// slopes too when `biases`.
AttentionLayer RelativeEmbeddingLayer(Precision precision, int64_t distance, bool c2p, bool p2c,
                                      bool biases, std::mt19937& rng, float scale = 2.0f) {
  AttentionLayer layer = ProjectionLayer(256, 4, 2, 256, 256, true, precision, rng);
  RelativeEmbeddings& r = layer.config.relative_embeddings;
  r.distance = distance;
  r.content_to_position = c2p;
  r.position_to_content = p2c;
  const Shape table{4, 64, 2 * distance + 1};
  if (c2p) layer.weights.relative_key = RandomTensor(DType::kFloat32, table, rng, scale);
  if (p2c) layer.weights.relative_query = RandomTensor(DType::kFloat32, table, rng, scale);
  if (biases) {
    layer.config.relative_bias_distance = 4;
    layer.weights.relative_bias = RandomTensor(DType::kFloat32, {4, 9}, rng, 2.0f);
    layer.config.alibi_slopes = AlibiSlopes(4);
  }
  return layer;
}

// Projection layers with relative position embeddings (DeBERTa) on
// `engine` (null: the default one), in every precision: both tables and
// each alone, distances 3 and 5, which requests of up to 90 keys and the
// sessions' 62 tokens pass on both sides (causal and not), and 128, past
// them all; a relative bias table and ALiBi beside them on one. Four random
// requests each (self- and cross-attention, masks, key lengths, weights),
// then a session (a prefill through the core kernels, decode steps and an
// append through the split-KV decode, each row's distances counted from its
// position in the whole sequence, each key's terms from its cached row).
void RelativeEmbeddingCases(AttentionEngine* engine, uint32_t seed) {
  std::mt19937 rng(seed);
  struct Variant {
    Precision precision;
    int64_t distance;
    bool c2p, p2c, biases;
  };
  for (const Variant& v : {Variant{Precision::kFloat32, 3, true, true, false},
                           Variant{Precision::kBFloat16, 5, true, false, false},
                           Variant{Precision::kFloat16, 3, false, true, true},
                           Variant{Precision::kFloat32, 5, false, true, false},
                           Variant{Precision::kFloat16, 128, true, true, false}}) {
    SCOPED_TRACE(absl::StrCat("relative embeddings ", v.distance, v.c2p ? " c2p" : "",
                              v.p2c ? " p2c" : "", v.biases ? " biases" : "", " precision ",
                              static_cast<int>(v.precision)));
    RequestsAndSession(
        RelativeEmbeddingLayer(v.precision, v.distance, v.c2p, v.p2c, v.biases, rng), rng,
        engine);
    if (::testing::Test::HasFailure()) return;
  }
}

// On the default engine: cuDNN refuses the embeddings (it takes no terms
// from tables), so the unfused path and the general kernel serve them,
// weights too, and the split-KV decode a session's steps.
TEST(CudaEngineTest, RelativeEmbeddingProjectionLayersAndSessionsMatchReference) {
  REQUIRE_GPU();
  RelativeEmbeddingCases(nullptr, 730);
}

// On the fused kernels written here (ATTNSERVE_CUDA_EXPERIMENTAL_FUSED=1):
// the requests without weights and the sessions' prefills run on
// flash_attention.cu or flash_attention_fp32.cu, their terms from the
// shared-memory tiles.
TEST(CudaEngineTest, FusedKernelsServeRelativeEmbeddingsExactly) {
  REQUIRE_GPU();
  std::string why;
  AttentionEngine* engine = ExperimentalEngine("kernels", &why);
  ASSERT_NE(engine, nullptr) << why;
  RelativeEmbeddingCases(engine, 731);
}

// How many elements of `got` are off `want` by more than `tol` (NaN counts).
int64_t CountOff(const Tensor& got, const Tensor& want, Tolerance tol) {
  int64_t off = 0;
  for (int64_t i = 0; i < want.num_elements(); ++i) {
    const double g = LoadAsFloat(got.dtype(), got.data(), i);
    const double w = LoadAsFloat(want.dtype(), want.data(), i);
    if (!(std::abs(g - w) <= tol.atol + tol.rtol * std::abs(w))) ++off;
  }
  return off;
}

// No path that serves a layer with relative position embeddings leaves
// their terms out: on the default engine and the fused kernels, in each
// precision, a causal request of 38 tokens without and with weights, and a
// session of the same tokens (a prefill of 37 through the core kernels, a
// decode step through the split-KV decode), each matches the reference and
// is off the reference of the same layer with tables of zeros (what a path
// that dropped them would compute) by more than the tolerance. Tables of
// entries in [-6, 6]: terms that move a score's logit by about one, so that
// even the decode step's one row is off by more than bf16's tolerance.
TEST(CudaEngineTest, NoPathIgnoresRelativeEmbeddings) {
  REQUIRE_GPU();
  std::string why;
  AttentionEngine* fused = ExperimentalEngine("kernels", &why);
  ASSERT_NE(fused, nullptr) << why;
  std::mt19937 rng(732);
  constexpr int64_t kLen = 38, kPrefill = 37;
  for (const Precision precision :
       {Precision::kFloat32, Precision::kFloat16, Precision::kBFloat16}) {
    SCOPED_TRACE(absl::StrCat("precision ", static_cast<int>(precision)));
    const AttentionLayer layer =
        RelativeEmbeddingLayer(precision, 2, true, true, false, rng, /*scale=*/6.0f);
    AttentionLayer zero = layer;  // its own id: the engine uploads its tables anew
    for (Tensor* table : {&zero.weights.relative_key, &zero.weights.relative_query}) {
      std::memset(table->data(), 0, table->byte_size());
    }
    ASSERT_TRUE(ValidateLayer(layer).ok() && ValidateLayer(zero).ok());
    const DType dtype = precision == Precision::kFloat32   ? DType::kFloat32
                        : precision == Precision::kFloat16 ? DType::kFloat16
                                                           : DType::kBFloat16;
    const Tolerance tol = precision == Precision::kFloat32   ? Tolerance{1e-4, 1e-4}
                          : precision == Precision::kFloat16 ? Tolerance{1.5e-2, 2e-2}
                                                             : Tolerance{6e-2, 6e-2};
    const Tensor x = RandomTensor(dtype, {1, kLen, 256}, rng);
    AttentionTask request;
    request.query = x.view();
    request.causal = true;
    request.scale = ResolveScale(layer.config, 0.0f, 64);
    // The reference's outputs and weights, with the tables and with zeros.
    Tensor want(DType::kFloat32, {1, kLen, 256}), want_zero(DType::kFloat32, {1, kLen, 256});
    Tensor want_p(DType::kFloat32, {1, 4, kLen, kLen});
    Tensor want_p_zero(DType::kFloat32, {1, 4, kLen, kLen});
    for (auto [l, out, probs] :
         {std::tuple<const AttentionLayer*, Tensor*, Tensor*>{&layer, &want, &want_p},
          {&zero, &want_zero, &want_p_zero}}) {
      AttentionTask t = request;
      t.output = out->mutable_view();
      t.weights = probs->mutable_view();
      ASSERT_TRUE(Reference().Run(*l, {&t, 1}).ok());
    }
    // `got` matches `expected` and is off `dropped` (what = the path's name).
    auto check = [&](const Tensor& got, const Tensor& expected, const Tensor& dropped,
                     const std::string& what) {
      ExpectClose(got, expected, tol, what);
      EXPECT_GT(CountOff(got, dropped, tol), 0) << what << ": the tables changed nothing";
    };
    for (AttentionEngine* engine : {Cuda().engine, fused}) {
      const std::string name = engine == fused ? "fused kernels " : "default engine ";
      for (const bool weights : {false, true}) {
        Tensor got(dtype, {1, kLen, 256});
        Tensor probs(DType::kFloat32, {1, 4, kLen, kLen});
        AttentionTask t = request;
        t.output = got.mutable_view();
        if (weights) t.weights = probs.mutable_view();
        const absl::Status status = engine->Run(layer, {&t, 1});
        ASSERT_TRUE(status.ok()) << status;
        check(got, want, want_zero, name + (weights ? "request with weights" : "request"));
        if (weights) check(probs, want_p, want_p_zero, name + "weights");
      }
      const KvCacheGeometry g = engine->SessionCacheGeometry(layer.config);
      DeviceCache cache(*engine, DType::kFloat32, g.num_kv_heads, g.head_dim, g.head_dim_v, 16,
                        kLen);
      ASSERT_TRUE(cache.ok());
      for (auto [cached, step] : {std::pair<int64_t, int64_t>{0, kPrefill}, {kPrefill, 1}}) {
        const Tensor xs = SliceRows(x, 1, cached, step);
        Tensor got(dtype, {1, step, 256});
        AttentionTask t = request;
        t.query = xs.view();
        t.output = got.mutable_view();
        t.paged = cache.At(cached);
        const absl::Status status = engine->Run(layer, {&t, 1});
        ASSERT_TRUE(status.ok()) << status;
        check(got, SliceRows(want, 1, cached, step), SliceRows(want_zero, 1, cached, step),
              name + (step == 1 ? "session decode step" : "session prefill"));
      }
    }
  }
}

// Sessions stepped from several threads at once, as the server's batchers
// step theirs: each call on its own workspace and stream, each session on
// its own blocks of the engine's one device pool, each equal step by step
// to its own causal request (a prefill, decodes, an append; on one, a
// window past FirstWindowKey's grain, so that its first blocks are released
// while the others run). Under scripts/sanitize.sh tsan-cuda, TSan watches
// the engine's shared state between them.
TEST(CudaEngineTest, ConcurrentSessionsEachEqualOneCausalRequest) {
  REQUIRE_GPU();
  const DType dtypes[] = {DType::kFloat32, DType::kFloat16, DType::kBFloat16, DType::kFloat16};
  std::vector<std::thread> threads;
  for (int i = 0; i < 4; ++i) {
    threads.emplace_back([&, i] {
      const bool window = i == 3;
      const std::vector<int64_t> steps = {window ? 270 : 19, 1, 1, 4, 1, 1};
      const SessionOptionsForTest opt = window ? SessionOptionsForTest{.window = 9}
                                               : SessionOptionsForTest{};
      CheckSdpaSession(dtypes[i], 4, 2, 64, 64, 16, steps, opt, 600 + static_cast<uint32_t>(i));
    });
  }
  for (std::thread& t : threads) t.join();
}

// A session's prefills and long appends (more query rows than the split-KV
// decode takes) go to cuDNN over the gathered cache, at its buckets'
// rows (the gather's zero tail, the query uploaded at the bucket): on the
// cuDNN-only engine they are served, exactly, only if cuDNN serves them
// (lengths on and off the buckets, GQA, Dv != Dk, a window with released
// blocks, sinks, a bf16 projection layer's FLOAT32 cache; decode steps
// between them stay on the engine's decode).
// What cuDNN cannot compute (softcapping) is refused there naming it, and
// the default engine serves it on the kernels written here
// (SdpaSessionWindowSoftcapSinksEqualOneRequest).
TEST(CudaEngineTest, SessionPrefillsGoToCudnn) {
  REQUIRE_GPU();
  std::string skip;
  AttentionEngine* cudnn = CudnnOnlyOrSkip(&skip);
  if (cudnn == nullptr) GTEST_SKIP() << skip;
  const std::vector<int64_t> steps = {300, 1, 40, 1, 17, 256};
  uint32_t seed = 500;
  for (DType dtype : {DType::kFloat16, DType::kBFloat16}) {
    CheckSdpaSession(dtype, 8, 2, 128, 128, 16, steps, {}, ++seed, cudnn);
    CheckSdpaSession(dtype, 4, 4, 64, 32, 64, steps, {}, ++seed, cudnn);
    CheckSdpaSession(dtype, 8, 2, 64, 64, 16, steps, {.window = 100}, ++seed, cudnn);
    CheckSdpaSession(dtype, 8, 2, 64, 64, 16, steps, {.sinks = true}, ++seed, cudnn);
    if (HasFailure()) return;
  }

  // A projection layer in bf16 precision: its FLOAT32 cache gathered into
  // bf16 in the token layout of its projections (exact: the cache holds
  // what the bf16 projections computed).
  std::mt19937 layer_rng(509);
  AttentionLayer projected = ProjectionLayer(256, 4, 2, 256, 256, true, Precision::kBFloat16,
                                             layer_rng);
  ASSERT_TRUE(ValidateLayer(projected).ok()) << ValidateLayer(projected);
  CheckProjectionSession(projected, DType::kBFloat16, {6e-2, 6e-2}, steps, layer_rng, cudnn);
  if (HasFailure()) return;

  // Softcapping: the prefill is refused on the cuDNN-only engine, naming it.
  const AttentionLayer& layer = SdpaLayer();
  std::mt19937 rng(510);
  const Tensor q = RandomTensor(DType::kBFloat16, {1, 4, 40, 64}, rng);
  const Tensor k = RandomTensor(DType::kBFloat16, {1, 2, 40, 64}, rng);
  const Tensor v = RandomTensor(DType::kBFloat16, {1, 2, 40, 64}, rng);
  Tensor out(DType::kBFloat16, {1, 4, 40, 64});
  DeviceCache cache(*cudnn, DType::kBFloat16, 2, 64, 64, 16, 40);
  ASSERT_TRUE(cache.ok());
  AttentionTask t;
  t.query = q.view();
  t.key = k.view();
  t.value = v.view();
  t.causal = true;
  t.scale = ResolveScale(layer.config, 0.0f, 64);
  t.softcap = 30.0f;
  t.output = out.mutable_view();
  t.paged = cache.At(0);
  const absl::Status status = cudnn->Run(layer, {&t, 1});
  EXPECT_EQ(status.code(), absl::StatusCode::kUnimplemented) << status;
  EXPECT_THAT(std::string(status.message()), HasSubstr("softcap")) << status;
}

// One Run of many sessions' steps: the decode steps (up to 16 query rows)
// share one launch per cache dtype (dispatch.h's PagedDecodes), the others
// gather. Every step equals the reference engine on one causal request
// over its session, and equals the same step run alone, bitwise: sharing a
// launch changes no request's arithmetic. The batch mixes dtypes, MHA and
// GQA, head dims of 40 to 256 (the launch's widest and fullest tiles set
// its kernel for all), block sizes, window, softcap and sinks.
TEST(CudaEngineTest, SessionStepsOfABatchShareOneDecodeLaunchBitwise) {
  REQUIRE_GPU();
  struct Session {
    DType dtype;
    int64_t hq, hkv, dk, dv, block_tokens, cached, step;
    SessionOptionsForTest opt;
  };
  const std::vector<Session> sessions = {
      {DType::kBFloat16, 32, 8, 128, 128, 16, 300, 1, {}},
      {DType::kFloat16, 8, 2, 64, 64, 64, 37, 3, {}},
      {DType::kFloat32, 4, 4, 40, 24, 16, 150, 1, {}},
      {DType::kBFloat16, 8, 8, 256, 256, 16, 700, 1, {}},
      {DType::kBFloat16, 8, 2, 64, 64, 16, 290, 2, {.window = 24, .softcap = 2.0f, .sinks = true}},
      {DType::kFloat16, 16, 2, 128, 128, 64, 500, 16, {}},
      {DType::kFloat32, 8, 2, 64, 64, 16, 50, 20, {}},  // more than 16 rows: gathered
      {DType::kFloat32, 6, 3, 36, 20, 16, 400, 1, {.window = 300, .sinks = true}},
  };
  const AttentionLayer& layer = SdpaLayer();
  std::mt19937 rng(500);
  struct State {
    Tensor q, k, v, want, got, alone;
    std::vector<float> sinks;
    std::unique_ptr<DeviceCache> cache;
    AttentionTask step;
  };
  std::vector<State> states(sessions.size());
  std::vector<AttentionTask> steps;
  for (size_t n = 0; n < sessions.size(); ++n) {
    const Session& x = sessions[n];
    State& st = states[n];
    SCOPED_TRACE(absl::StrCat("session ", n));
    const int64_t len = x.cached + x.step;
    st.q = RandomTensor(x.dtype, {1, x.hq, len, x.dk}, rng, 2.0f);
    st.k = RandomTensor(x.dtype, {1, x.hkv, len, x.dk}, rng);
    st.v = RandomTensor(x.dtype, {1, x.hkv, len, x.dv}, rng);
    if (x.opt.sinks) {
      std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
      for (int64_t h = 0; h < x.hq; ++h) st.sinks.push_back(dist(rng));
    }
    st.want = Tensor(DType::kFloat32, {1, x.hq, len, x.dv});
    AttentionTask full;
    full.query = st.q.view();
    full.key = st.k.view();
    full.value = st.v.view();
    full.causal = true;
    full.scale = ResolveScale(layer.config, 0.0f, x.dk);
    full.window = x.opt.window;
    full.softcap = x.opt.softcap;
    full.sinks = st.sinks;
    full.output = st.want.mutable_view();
    ASSERT_TRUE(Reference().Run(layer, {&full, 1}).ok());

    // The prefill, alone.
    st.cache = std::make_unique<DeviceCache>(*Cuda().engine, x.dtype, x.hkv, x.dk, x.dv,
                                             x.block_tokens, len);
    ASSERT_TRUE(st.cache->ok());
    const Tensor qp = SliceRows(st.q, 2, 0, x.cached);
    const Tensor kp = SliceRows(st.k, 2, 0, x.cached);
    const Tensor vp = SliceRows(st.v, 2, 0, x.cached);
    Tensor prefill_out(x.dtype, {1, x.hq, x.cached, x.dv});
    AttentionTask prefill = full;
    prefill.query = qp.view();
    prefill.key = kp.view();
    prefill.value = vp.view();
    prefill.output = prefill_out.mutable_view();
    prefill.paged = st.cache->At(0);
    ASSERT_TRUE(Cuda().engine->Run(layer, {&prefill, 1}).ok());

    // The step, kept for the batch (its slices live in the state).
    if (x.opt.window > 0) st.cache->Release(FirstWindowKey(x.cached, x.opt.window, 0));
    st.got = Tensor(x.dtype, {1, x.hq, x.step, x.dv});
    st.alone = Tensor(x.dtype, {1, x.hq, x.step, x.dv});
    st.step = full;
    st.step.paged = st.cache->At(x.cached);
    st.step.output = st.got.mutable_view();
  }
  // Slices outlive the tasks that view them.
  std::vector<Tensor> slices;
  slices.reserve(3 * sessions.size());
  for (size_t n = 0; n < sessions.size(); ++n) {
    const Session& x = sessions[n];
    State& st = states[n];
    slices.push_back(SliceRows(st.q, 2, x.cached, x.step));
    st.step.query = slices.back().view();
    slices.push_back(SliceRows(st.k, 2, x.cached, x.step));
    st.step.key = slices.back().view();
    slices.push_back(SliceRows(st.v, 2, x.cached, x.step));
    st.step.value = slices.back().view();
    steps.push_back(st.step);
  }
  const absl::Status batch = Cuda().engine->Run(layer, steps);
  ASSERT_TRUE(batch.ok()) << batch;
  for (size_t n = 0; n < sessions.size(); ++n) {
    const Session& x = sessions[n];
    State& st = states[n];
    SCOPED_TRACE(absl::StrCat("session ", n, " (", DTypeName(x.dtype).data(), " Hq", x.hq,
                              " Hkv", x.hkv, " Dk", x.dk, " Dv", x.dv, " step ", x.step, ")"));
    ExpectClose(st.got, SliceRows(st.want, 2, x.cached, x.step), ToleranceFor(x.dtype),
                "the step in the batch");
    // Alone: the same rows appended again at the same positions (the same
    // bits), the same attention.
    AttentionTask alone = steps[n];
    alone.output = st.alone.mutable_view();
    ASSERT_TRUE(Cuda().engine->Run(layer, {&alone, 1}).ok());
    ExpectIdentical(st.got, st.alone, "the step in the batch against the step alone");
  }
}

// A projection layer's session (its cache FLOAT32 whatever the precision):
// self-attention step by step equals one causal request over the sequence.
TEST(CudaEngineTest, ProjectionSessionStepsEqualOneCausalRequest) {
  REQUIRE_GPU();
  std::mt19937 rng(7);
  struct Variant {
    int64_t embed, heads, kv_heads;
    Precision precision;
    DType dtype;
    Tolerance tol;
  };
  const Variant variants[] = {
      {96, 4, 2, Precision::kFloat32, DType::kFloat32, {1e-4, 1e-4}},
      {256, 4, 4, Precision::kFloat32, DType::kFloat32, {1e-4, 1e-4}},
      {256, 4, 2, Precision::kBFloat16, DType::kBFloat16, {6e-2, 6e-2}},
  };
  for (const Variant& var : variants) {
    AttentionLayer layer = ProjectionLayer(var.embed, var.heads, var.kv_heads, var.embed,
                                           var.embed, true, var.precision, rng);
    ASSERT_TRUE(ValidateLayer(layer).ok()) << ValidateLayer(layer);
    SCOPED_TRACE(absl::StrCat("embed ", var.embed, " heads ", var.heads, " kv_heads ",
                              var.kv_heads, " ", DTypeName(var.dtype).data()));
    CheckProjectionSession(layer, var.dtype, var.tol, SessionSteps(), rng);
    if (HasFailure()) return;
  }
}

// Multi-head latent attention (DeepSeek-V2/V3), with and without the
// query's latent (with it, Mistral 4's temperature by position), YaRN RoPE
// on the last features of each head (DeepSeek-V3's interleaved pairs) with
// its mscale in the scale, in each precision:
// stateless batches against the reference, then sessions step by step
// against one causal request.
TEST(CudaEngineTest, LatentAttentionMatchesReference) {
  REQUIRE_GPU();
  std::mt19937 rng(11);
  std::uniform_real_distribution<float> unit(0.0f, 1.0f);
  auto uniform = [&](float lo, float hi) { return lo + (hi - lo) * unit(rng); };
  for (const int64_t q_lora_rank : {int64_t{0}, int64_t{48}}) {
    for (Precision precision : {Precision::kFloat32, Precision::kBFloat16, Precision::kFloat16}) {
      testutil::LatentShape shape;
      shape.heads = 4;
      shape.nope = 48;
      shape.rope = 16;
      shape.v_head_dim = 32;
      shape.q_lora_rank = q_lora_rank;
      shape.kv_lora_rank = 64;
      shape.embed = shape.out = 128;
      shape.biases = q_lora_rank > 0;
      std::shared_ptr<AttentionLayer> layer =
          testutil::RandomLatentLayer(shape, precision, uniform);
      LayerConfig& c = layer->config;
      c.causal = true;
      c.rope.type = RopeConfig::Type::kYarn;
      c.rope.theta = 10000.0;
      c.rope.rotary_dim = shape.rope;
      c.rope.interleaved = true;
      c.rope.factor = 40.0;
      c.rope.original_max_position_embeddings = 64;
      c.rope.beta_fast = 32.0;
      c.rope.beta_slow = 1.0;
      c.rope.attention_factor = 1.0;
      c.scale = static_cast<float>(std::pow(0.1 * std::log(40.0) + 1.0, 2) / 8.0);
      // Mistral 4 (a query latent): every query feature scaled by its
      // position's band, after RoPE.
      if (q_lora_rank > 0) c.temperature_tuning = {true, 16.0, 0.7, true};
      ASSERT_TRUE(ValidateLayer(*layer).ok()) << ValidateLayer(*layer);
      SCOPED_TRACE(absl::StrCat("q_lora_rank ", q_lora_rank, ", precision ",
                                static_cast<int>(precision)));
      std::vector<std::unique_ptr<TaskBuffers>> tasks;
      for (int i = 0; i < 4; ++i) tasks.push_back(RandomTask(c, rng, DType::kFloat32, true));
      const Tolerance tol = precision == Precision::kFloat32   ? Tolerance{1e-4, 1e-4}
                            : precision == Precision::kFloat16 ? Tolerance{1.5e-2, 2e-2}
                                                               : Tolerance{6e-2, 6e-2};
      CompareRun(*layer, tasks, tol);
      if (HasFatalFailure()) return;
      if (precision != Precision::kFloat16) {
        CheckProjectionSession(
            *layer, precision == Precision::kBFloat16 ? DType::kBFloat16 : DType::kFloat32, tol,
            SessionSteps(), rng);
        if (HasFailure()) return;
      }
    }
  }
}

TEST(CudaEngineTest, RefusesPagedTasksItsChecksRefuse) {
  REQUIRE_GPU();
  std::mt19937 rng(9);
  const Tensor q = RandomTensor(DType::kFloat32, {1, 2, 1, 64}, rng);
  const Tensor k = RandomTensor(DType::kFloat32, {1, 2, 1, 64}, rng);
  Tensor out(DType::kFloat32, {1, 2, 1, 64});
  DeviceCache cache(*Cuda().engine, DType::kFloat32, 2, 64, 64, 16, 16);
  ASSERT_TRUE(cache.ok());
  AttentionTask t;
  t.query = q.view();
  t.key = k.view();
  t.value = k.view();
  t.scale = 0.125f;
  t.output = out.mutable_view();
  t.paged = cache.At(16);  // a 17th token in a one-block table
  EXPECT_EQ(Cuda().engine->Run(SdpaLayer(), {&t, 1}).code(), absl::StatusCode::kInvalidArgument);
  t.paged = cache.At(0);
  t.paged.head_dim = 32;  // the cache's geometry is not the rows'
  EXPECT_EQ(Cuda().engine->Run(SdpaLayer(), {&t, 1}).code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace attnserve
