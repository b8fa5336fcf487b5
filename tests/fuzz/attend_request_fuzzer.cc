// Fuzz target: one serialized AttendRequest through the server's own parse
// (ParseAttendRequest on a grpc::ByteBuffer of two slices, which must agree
// with protobuf's own, ParseRequestMessage), decode and validation, then,
// when valid, through the reference and cpu engines, whose outputs must
// agree where the inputs are numerically tame. Work bounds keep every
// accepted shape tiny. Models by name: "" or "sdpa" (bare attention), "mha",
// "mha-self", "mha-bf16" (small projection layers, see MakeSmallMha).
// Anything else aborts: a crash, a sanitizer report, a refusal with a code
// validation never uses, a task the engine's own check refuses, an engine
// error or output disagreement.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>

#include "absl/strings/match.h"
#include "engine/attention_engine.h"
#include "engine/attention_layer.h"
#include "engine/model/builtin_models.h"
#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/slice.h"
#include "server/request/validation.h"
#include "server/request/value_scan.h"
#include "server/transport/attend_codec.h"
#include "server/transport/attend_wire.h"
#include "server/transport/message_codec.h"
#include "server/transport/protobuf_log.h"

namespace attnserve {
namespace {

// FUZZ_VERBOSE=1: one line per input saying how far it got (to check what
// a corpus covers).
void Note(const std::string& what) {
  static const bool verbose = std::getenv("FUZZ_VERBOSE") != nullptr;
  if (verbose) std::fprintf(stderr, "  -> %s\n", what.c_str());
}

[[noreturn]] void Fail(const std::string& what) {
  std::fprintf(stderr, "attend_request_fuzzer: %s\n", what.c_str());
  std::abort();
}

// Small projection layers with seeded weights: "mha" is cross-attention
// only (query/key/value dims 6/5/3, 4 query heads over 2 kv heads), "mha-self"
// and "mha-bf16" take self-attention (dims 6, 2 heads of 3), fp32 and bf16.
std::shared_ptr<const AttentionLayer> MakeSmallMha(const std::string& name) {
  const bool cross = name == "mha";
  auto layer = std::make_shared<AttentionLayer>();
  LayerConfig& c = layer->config;
  c.name = name;
  c.has_projections = true;
  c.num_heads = cross ? 4 : 2;
  c.num_kv_heads = 2;
  c.head_dim = cross ? 4 : 3;
  c.embed_dim = c.num_heads * c.head_dim;
  c.query_dim = 6;
  c.key_dim = cross ? 5 : 6;
  c.value_dim = cross ? 3 : 6;
  c.out_dim = cross ? 7 : 6;
  c.precision = name == "mha-bf16" ? Precision::kBFloat16 : Precision::kFloat32;
  const int64_t q = c.num_heads * c.head_dim, kv = c.num_kv_heads * c.head_dim;
  LayerWeights& w = layer->weights;
  auto tensor = [&c](Shape shape, uint64_t seed) {
    Tensor t = SeededUniformTensor(std::move(shape), seed, 0.3f);
    float* p = t.data_as<float>();
    for (int64_t i = 0; i < t.num_elements(); ++i) p[i] = RoundTo(c.precision, p[i]);
    return t;
  };
  w.wq = tensor({q, c.query_dim}, 1);
  w.bq = tensor({q}, 2);
  w.wk = tensor({kv, c.key_dim}, 3);
  w.bk = tensor({kv}, 4);
  w.wv = tensor({kv, c.value_dim}, 5);
  w.bv = tensor({kv}, 6);
  w.wo = tensor({c.out_dim, q}, 7);
  if (!cross) w.bo = tensor({c.out_dim}, 8);  // one layer without an output bias
  if (absl::Status s = ValidateLayer(*layer); !s.ok()) Fail(std::string(s.message()));
  return layer;
}

struct Fixture {
  Fixture() {
    InstallProtobufLogHandler();
    sdpa = MakeSdpaLayer();
    mha = MakeSmallMha("mha");
    mha_self = MakeSmallMha("mha-self");
    mha_bf16 = MakeSmallMha("mha-bf16");
    EngineOptions one_thread;
    one_thread.num_threads = 1;
    reference = *CreateEngine("reference", one_thread);
    cpu = *CreateEngine("cpu", one_thread);
    // Tiny: at most a few thousand elements, scores and multiply-adds.
    options.max_input_elements = 4096;
    options.max_output_bytes = 1 << 16;
    options.max_attention_scores = 4096;
    options.max_multiply_adds = 1 << 17;
  }
  std::shared_ptr<const AttentionLayer> sdpa, mha, mha_self, mha_bf16;
  std::unique_ptr<AttentionEngine> reference, cpu;
  ValidationOptions options;
  std::shared_ptr<HostBufferPool> request_memory = HostBufferPool::Ordinary();
  std::shared_ptr<PayloadCopier> payload_copier = std::make_shared<PayloadCopier>(1);
};

double MaxAbs(const TensorView& t) {
  double m = 0;
  if (t.empty() || t.dtype == DType::kBool) return 0;
  for (int64_t i = 0; i < t.num_elements(); ++i) {
    const double a = std::fabs(static_cast<double>(LoadAsFloat(t.dtype, t.data, i)));
    if (a > m) m = a;
  }
  return m;
}

// Largest |finite value| of a float mask (0 for none or bool).
double MaskMagnitude(const TensorView& t) {
  double m = 0;
  if (t.empty() || t.dtype == DType::kBool) return 0;
  for (int64_t i = 0; i < t.num_elements(); ++i) {
    const double a = std::fabs(static_cast<double>(LoadAsFloat(t.dtype, t.data, i)));
    if (std::isfinite(a) && a > m) m = a;
  }
  return m;
}

// The magnitude from which a value rounds to infinity in `dtype` (the
// largest finite value plus half its last place).
double OverflowThreshold(DType dtype) {
  switch (dtype) {
    case DType::kFloat16: return 65520.0;
    case DType::kBFloat16: return 3.3961775292304904e38;
    default: return 3.4028235677973366e38;
  }
}

void Compare(const char* what, const Tensor& ref, const Tensor& got, double atol) {
  for (int64_t i = 0; i < ref.num_elements(); ++i) {
    const double r = LoadAsFloat(ref.dtype(), ref.data(), i);
    const double g = LoadAsFloat(got.dtype(), got.data(), i);
    // A reference that overflowed the output dtype (inputs near the float
    // maximum): fp32 arithmetic in another order overflows too, to either
    // sign. Nothing finite is accepted for it.
    if (std::isinf(r) && std::isinf(g)) continue;
    // One side infinite, the other finite: accepted when a value within
    // atol of the finite one rounds to that infinity in the output dtype.
    // Large inputs whose contributions cancel make atol wider than the
    // format, and then either sign is in reach (a fuzzed fp16 output: the
    // reference -13120, the cpu engine's sum in another order past +65520).
    if (std::isinf(r) != std::isinf(g)) {
      const double finite = std::isinf(r) ? g : r;
      const double infinite = std::isinf(r) ? r : g;
      const double reach = std::signbit(infinite) ? -(finite - atol) : finite + atol;
      if (!std::isnan(finite) && reach >= OverflowThreshold(got.dtype())) continue;
    }
    if (std::isnan(r) != std::isnan(g) || !(std::fabs(r - g) <= atol || r == g)) {
      char buf[200];
      std::snprintf(buf, sizeof buf, "%s element %lld: reference %.9g, cpu %.9g (atol %.3g)", what,
                    static_cast<long long>(i), r, g, atol);
      Fail(buf);
    }
  }
}

// The server's parse (ParseAttendRequest: the tensors' bytes into host
// buffers) must give what protobuf's own parse gives, error or message.
void CheckWireParseAgrees(const absl::Status& parsed, const v1::AttendRequest& request,
                          const absl::Status& oracle_status, const v1::AttendRequest& oracle,
                          const AttendPayloads& payloads) {
  if (parsed != oracle_status) {
    Fail("ParseAttendRequest: " + parsed.ToString() + "; protobuf: " + oracle_status.ToString());
  }
  v1::AttendRequest joined = request;
  auto put = [](const std::optional<AttendPayload>& payload, v1::Tensor* tensor) {
    if (payload.has_value()) {
      tensor->set_data(std::string(payload->bytes.data(), payload->bytes.size()));
    }
  };
  put(payloads.query, joined.mutable_query());
  put(payloads.key, joined.mutable_key());
  put(payloads.value, joined.mutable_value());
  put(payloads.attn_mask, joined.mutable_attn_mask());
  // A copy's scan is the scan of the bytes it copied.
  for (const std::optional<AttendPayload>* payload :
       {&payloads.query, &payloads.key, &payloads.value, &payloads.attn_mask}) {
    if (!payload->has_value() || !(*payload)->scan.has_value()) continue;
    const ValueScan& got = *(*payload)->scan;
    const HostBuffer& bytes = (*payload)->bytes;
    if (got.width != 2 && got.width != 4) Fail("a scan of width other than 2 or 4");
    const ValueScan want =
        ScanValues(bytes.data(), static_cast<int64_t>(bytes.size()) / got.width, got.width);
    if (got.max_abs_bits != want.max_abs_bits || got.max_positive_bits != want.max_positive_bits) {
      Fail("the copy's scan differs from a scan of the copied bytes");
    }
  }
  if (!request.has_query()) joined.clear_query();
  if (!request.has_key()) joined.clear_key();
  if (!request.has_value()) joined.clear_value();
  if (!request.has_attn_mask()) joined.clear_attn_mask();
  if (joined.SerializeAsString() != oracle.SerializeAsString()) {
    Fail("ParseAttendRequest parsed another message than protobuf");
  }
}

void RunOne(const Fixture& f, const uint8_t* data, size_t size) {
  // As gRPC hands a message over: in slices (here two, the cut inside the
  // message). Both parses read the same slices: protobuf's own error for a
  // truncated message can depend on where its input is cut.
  grpc::Slice head(data, size / 3), tail(data + size / 3, size - size / 3);
  grpc::Slice halves[] = {head, tail};
  v1::AttendRequest oracle;
  grpc::ByteBuffer oracle_bytes(halves, 2);
  const absl::Status oracle_status = ParseRequestMessage(&oracle_bytes, "request", 0, &oracle);
  grpc::ByteBuffer bytes(halves, 2);
  v1::AttendRequest request;
  AttendPayloads payloads;
  const absl::Status parsed = ParseAttendRequest(&bytes, "request", 0, *f.request_memory,
                                                 *f.payload_copier, &request, &payloads);
  CheckWireParseAgrees(parsed, request, oracle_status, oracle, payloads);
  if (!parsed.ok()) {
    if (parsed.code() != absl::StatusCode::kInvalidArgument ||
        !absl::StartsWith(parsed.message(),
                          "request could not be parsed as attnserve.v1.AttendRequest: ")) {
      Fail("parse error with the wrong code or message: " + parsed.ToString());
    }
    Note("unparseable");
    return;
  }
  const AttendInputs inputs = DecodeAttendRequest(request, &payloads);
  const AttentionLayer* layer = nullptr;
  if (inputs.model.empty() || inputs.model == "sdpa") {
    layer = f.sdpa.get();
  } else if (inputs.model == "mha") {
    layer = f.mha.get();
  } else if (inputs.model == "mha-self") {
    layer = f.mha_self.get();
  } else if (inputs.model == "mha-bf16") {
    layer = f.mha_bf16.get();
  } else {
    Note("unknown model");
    return;  // the registry answers NOT_FOUND before validation
  }
  const LayerWeightBounds bounds = MeasureWeightBounds(layer->weights);
  absl::StatusOr<ValidatedRequest> v =
      ValidateAttendInputs(inputs, layer->config, f.options, &bounds);
  if (!v.ok()) {
    const absl::StatusCode code = v.status().code();
    if (code != absl::StatusCode::kInvalidArgument &&
        code != absl::StatusCode::kResourceExhausted) {
      Fail("validation refused with an unexpected code: " + v.status().ToString());
    }
    if (v.status().message().empty()) Fail("validation refused without a message");
    Note("refused: " + v.status().ToString());
    return;
  }

  // Both engines, each into its own outputs.
  Tensor outputs[2], weights[2];
  AttentionEngine* engines[2] = {f.reference.get(), f.cpu.get()};
  for (int e = 0; e < 2; ++e) {
    AttentionTask task = v->task;
    outputs[e] = Tensor(v->output_dtype, v->output_shape);
    task.output = outputs[e].mutable_view();
    if (!v->weights_shape.empty()) {
      weights[e] = Tensor(v->output_dtype, v->weights_shape);
      task.weights = weights[e].mutable_view();
    }
    if (absl::Status s = CheckTask(layer->config, task); !s.ok()) {
      Fail("validation accepted a task the engine check refuses: " + s.ToString());
    }
    if (absl::Status s = engines[e]->Run(*layer, {&task, 1}); !s.ok()) {
      Fail(std::string(engines[e]->name()) + " failed on a valid request: " + s.ToString());
    }
  }

  // Compare where float32 arithmetic and double agree closely: scores of
  // moderate size (rounding in exp() grows with them) and float masks too
  // small to swallow the scores.
  const AttentionTask& t = v->task;
  double q = MaxAbs(t.query), k = t.key.empty() ? q : MaxAbs(t.key),
         val = t.value.empty() ? q : MaxAbs(t.value);
  double out_scale = val;
  if (layer->config.has_projections) {
    q = bounds.q.Apply(q);
    k = bounds.k.Apply(k);
    val = bounds.v.Apply(val);
    out_scale = bounds.o.Apply(val);
  }
  const double score = q * k * static_cast<double>(v->dims.head_dim) *
                       std::max(1.0, static_cast<double>(t.scale));
  if (score > 80 || MaskMagnitude(t.attn_mask) > 80) {
    Note("ran both engines; not compared (scores or mask too large)");
    return;
  }
  const bool low_precision = v->output_dtype != DType::kFloat32 ||
                             layer->config.precision != Precision::kFloat32 ||
                             t.query.dtype != DType::kFloat32;
  const double rtol = low_precision ? 3e-2 : 2e-3;
  Compare("output", outputs[0], outputs[1], rtol * std::max(out_scale, 1e-30) + 1e-30);
  if (!v->weights_shape.empty()) Compare("weights", weights[0], weights[1], rtol);
  Note("ran both engines; outputs agree");
}

}  // namespace
}  // namespace attnserve

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const attnserve::Fixture* fixture = new attnserve::Fixture;
  attnserve::RunOne(*fixture, data, size);
  return 0;
}
