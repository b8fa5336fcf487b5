// The CUDA backend against the reference engine, reached as production
// reaches it: LoadCudaEngine, which dlopens libattnserve_cuda.so. The
// comparisons run over seeded random cases (every mask kind, GQA, cross
// attention, Dv != Dk, ragged batches, each dtype, head dims served by the
// fused kernel and by the general one, need_weights) and need a GPU: without
// one each is skipped with the loader's reason. The loader tests run
// everywhere.
//
// Tolerances (absolute + relative to the float64 reference, inputs in
// [-1, 1]): FLOAT32 1e-4 + 1e-4; FLOAT16 4e-3 + 1e-2 (P is rounded to
// fp16 before P V on the tensor cores, outputs to fp16); BFLOAT16 2e-2 +
// 2e-2 (8-bit mantissa). Projection layers computing in bf16/fp16 round
// weights and activations as well: 6e-2 + 6e-2 and 1.5e-2 + 2e-2.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "engine/attention_engine.h"
#include "engine/attention_layer.h"
#include "engine/attention_params.h"
#include "engine/attention_task.h"
#include "engine/cuda/cuda_loader.h"
#include "engine/tensor.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

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

// One Attend request: owns its inputs and outputs; params() points into them.
struct AttendCase {
  DType dtype = DType::kFloat32, out_dtype = DType::kFloat32, weights_dtype = DType::kFloat32;
  int64_t batch = 1, heads = 1, kv_heads = 1, q_len = 1, kv_len = 1, dk = 64, dv = 64;
  bool causal = false, token_layout = false, need_weights = false, average = false;
  bool with_lengths = false;
  MaskChoice mask_choice = MaskChoice::kNone;
  Shape mask_shape;
  float scale = 0.125f;

  Tensor q, k, v, mask, out, weights;
  std::vector<int64_t> lengths;

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
      << (need_weights ? (average ? " avg-weights" : " weights") : "");
    return s.str();
  }

  // Allocates and fills inputs (from `rng`) and zeroed outputs.
  void Fill(std::mt19937& rng) {
    const Shape q_shape =
        token_layout ? Shape{batch, q_len, heads, dk} : Shape{batch, heads, q_len, dk};
    const Shape k_shape =
        token_layout ? Shape{batch, kv_len, kv_heads, dk} : Shape{batch, kv_heads, kv_len, dk};
    const Shape v_shape =
        token_layout ? Shape{batch, kv_len, kv_heads, dv} : Shape{batch, kv_heads, kv_len, dv};
    const Shape o_shape =
        token_layout ? Shape{batch, q_len, heads, dv} : Shape{batch, heads, q_len, dv};
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
  }

  // Params over this case's buffers, writing to `o` and `w`.
  AttentionParams Params(Tensor& o, Tensor* w) const {
    AttentionParams p;
    p.batch = batch;
    p.num_heads = heads;
    p.num_kv_heads = kv_heads;
    p.head_dim = dk;
    p.head_dim_v = dv;
    p.q_len = q_len;
    p.kv_len = kv_len;
    p.dtype = dtype;
    p.q = q.data();
    p.k = k.data();
    p.v = v.data();
    p.out = o.data();
    p.out_dtype = out_dtype;
    auto strides = token_layout ? TokenLayoutStrides : HeadLayoutStrides;
    strides(heads, q_len, dk, &p.q_stride_b, &p.q_stride_h, &p.q_stride_row);
    strides(kv_heads, kv_len, dk, &p.k_stride_b, &p.k_stride_h, &p.k_stride_row);
    strides(kv_heads, kv_len, dv, &p.v_stride_b, &p.v_stride_h, &p.v_stride_row);
    strides(heads, q_len, dv, &p.o_stride_b, &p.o_stride_h, &p.o_stride_row);
    p.causal = causal;
    p.key_lengths = with_lengths ? lengths.data() : nullptr;
    if (mask_choice != MaskChoice::kNone) {
      absl::StatusOr<MaskParams> m = MakeMaskParams(mask.view(), batch, heads, q_len, kv_len);
      EXPECT_TRUE(m.ok()) << m.status();
      if (m.ok()) p.mask = *m;
    }
    p.scale = scale;
    if (w != nullptr && need_weights) {
      p.weights = w->data();
      p.weights_dtype = weights_dtype;
      p.average_weights = average;
    }
    return p;
  }

  AttentionParams Params() { return Params(out, &weights); }
};

template <typename T>
T Pick(std::mt19937& rng, std::initializer_list<T> choices) {
  return *(choices.begin() + rng() % choices.size());
}

AttendCase RandomCase(std::mt19937& rng) {
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
  c.token_layout = rng() % 4 == 0;
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

// Runs `c` on the reference and on CUDA, and compares output and weights.
void CompareWithReference(AttendCase& c) {
  SCOPED_TRACE(c.Describe());
  Tensor ref_out(c.out.dtype(), c.out.shape());
  Tensor ref_weights = c.need_weights ? Tensor(c.weights.dtype(), c.weights.shape()) : Tensor();
  const AttentionParams ref = c.Params(ref_out, c.need_weights ? &ref_weights : nullptr);
  ASSERT_TRUE(Reference().Attend({&ref, 1}).ok());
  const AttentionParams gpu = c.Params();
  const absl::Status status = Cuda().engine->Attend({&gpu, 1});
  ASSERT_TRUE(status.ok()) << status;
  ExpectClose(c.out, ref_out, CaseTolerance(c, c.out_dtype), "output");
  if (c.need_weights)
    ExpectClose(c.weights, ref_weights, CaseTolerance(c, c.weights_dtype), "weights");
}

// ---------------------------------------------------------------- Attend

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
// each request alone and inside a mixed ragged batch give the same bits.
TEST(CudaEngineTest, RaggedBatchesAreBatchInvariant) {
  REQUIRE_GPU();
  std::mt19937 rng(99);
  std::vector<AttendCase> cases;
  for (int i = 0; i < 6; ++i) cases.push_back(RandomCase(rng));
  std::vector<Tensor> alone_out, alone_weights;
  for (AttendCase& c : cases) {
    const AttentionParams p = c.Params();
    ASSERT_TRUE(Cuda().engine->Attend({&p, 1}).ok()) << c.Describe();
    alone_out.push_back(c.out);
    alone_weights.push_back(c.weights);
  }
  for (const std::vector<int>& order :
       {std::vector<int>{0, 1, 2, 3, 4, 5}, std::vector<int>{5, 3, 1, 0, 2, 4},
        std::vector<int>{2, 2, 4}}) {
    std::vector<Tensor> outs, weights;
    std::vector<AttentionParams> batch;
    outs.reserve(order.size());
    weights.reserve(order.size());
    for (int i : order) {
      outs.emplace_back(cases[i].out.dtype(), cases[i].out.shape());
      weights.push_back(cases[i].need_weights
                            ? Tensor(cases[i].weights.dtype(), cases[i].weights.shape())
                            : Tensor());
      batch.push_back(cases[i].Params(outs.back(), &weights.back()));
    }
    const absl::Status status = Cuda().engine->Attend(batch);
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
    const AttentionParams p = c.Params();
    ASSERT_TRUE(Cuda().engine->Attend({&p, 1}).ok());
    expected.push_back(c.out);
  }
  std::vector<std::vector<Tensor>> got(8);
  std::vector<std::thread> threads;
  for (size_t t = 0; t < got.size(); ++t) {
    threads.emplace_back([&, t] {
      for (int round = 0; round < 5; ++round) {
        for (AttendCase& c : cases) {
          Tensor out(c.out.dtype(), c.out.shape());
          Tensor w = c.need_weights ? Tensor(c.weights.dtype(), c.weights.shape()) : Tensor();
          const AttentionParams p = c.Params(out, &w);
          if (!Cuda().engine->Attend({&p, 1}).ok()) return;
          if (round == 4) got[t].push_back(std::move(out));
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

TEST(CudaEngineTest, RejectsInconsistentParams) {
  REQUIRE_GPU();
  std::mt19937 rng(3);
  AttendCase c;
  c.heads = 3;
  c.kv_heads = 2;  // not a divisor
  c.Fill(rng);
  const AttentionParams p = c.Params();
  EXPECT_EQ(Cuda().engine->Attend({&p, 1}).code(), absl::StatusCode::kInvalidArgument);
}

// ---------------------------------------------------------------- Run

// A task with its buffers.
struct TaskBuffers {
  Tensor query, key, value, mask, output, weights;
  std::vector<int64_t> lengths;
  AttentionTask task;
};

std::unique_ptr<TaskBuffers> RandomTask(const LayerConfig& config, std::mt19937& rng, DType dtype,
                                        bool self_attention) {
  auto t = std::make_unique<TaskBuffers>();
  const int64_t b = Pick<int64_t>(rng, {1, 2});
  const int64_t lq = Pick<int64_t>(rng, {1, 9, 64, 77});
  const int64_t lk = self_attention ? lq : Pick<int64_t>(rng, {5, 64, 90});
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

// Runs the tasks as one batch on CUDA and one by one on the reference.
void CompareRun(const AttentionLayer& layer, std::vector<std::unique_ptr<TaskBuffers>>& tasks,
                Tolerance tol) {
  std::vector<AttentionTask> batch;
  for (auto& t : tasks) batch.push_back(t->task);
  const absl::Status status = Cuda().engine->Run(layer, batch);
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
  AttentionLayer layer;
  layer.config.name = "sdpa";
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
      {96, 4, 2, 80, 48, false, Precision::kFloat32, {1e-4, 1e-4}},      // GQA, kdim != vdim
      {256, 4, 4, 256, 256, true, Precision::kBFloat16, {6e-2, 6e-2}},   // fused, head_dim 64
      {512, 4, 2, 512, 512, true, Precision::kFloat16, {1.5e-2, 2e-2}},  // fused, head_dim 128, GQA
      {120, 5, 5, 120, 120, true, Precision::kBFloat16, {6e-2, 6e-2}},   // general kernel, bf16
  };
  for (const Variant& v : variants) {
    AttentionLayer layer =
        ProjectionLayer(v.embed, v.heads, v.kv_heads, v.kdim, v.vdim, v.biases, v.precision, rng);
    ASSERT_TRUE(ValidateLayer(layer).ok()) << ValidateLayer(layer);
    SCOPED_TRACE("embed " + std::to_string(v.embed) + " heads " + std::to_string(v.heads));
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

}  // namespace
}  // namespace attnserve
