// Request flags -> AttendRequest for attn_client and attn_bench (see the header).
#include "client/request_builder.h"

#include <algorithm>
#include <cstring>
#include <random>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "client/half.h"

namespace attnserve::client {
namespace {

namespace pb = ::attnserve::v1;

int64_t OrDefault(int64_t v, int64_t fallback) { return v > 0 ? v : fallback; }

void FillRandom(pb::Tensor* t, pb::DataType dtype, const std::vector<int64_t>& shape, std::mt19937_64& rng) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> values(static_cast<size_t>(n));
  for (float& v : values) v = dist(rng);
  t->set_dtype(dtype);
  for (int64_t d : shape) t->add_shape(d);
  EncodeFloats(values, dtype, t->mutable_data());
}

}  // namespace

absl::StatusOr<RequestSpec> RequestSpecFromFlags() {
  RequestSpec spec;
  spec.model = absl::GetFlag(FLAGS_model);
  spec.batch = absl::GetFlag(FLAGS_batch);
  spec.seq = absl::GetFlag(FLAGS_seq);
  spec.kv_seq = absl::GetFlag(FLAGS_kv_seq);
  spec.heads = absl::GetFlag(FLAGS_heads);
  spec.kv_heads = absl::GetFlag(FLAGS_kv_heads);
  spec.head_dim = absl::GetFlag(FLAGS_head_dim);
  if (const std::string dtype = absl::GetFlag(FLAGS_dtype); !dtype.empty()) {
    absl::StatusOr<pb::DataType> d = ParseDType(dtype);
    if (!d.ok()) return absl::InvalidArgumentError(absl::StrCat("--dtype: ", d.status().message()));
    spec.dtype = *d;
  }
  spec.causal = absl::GetFlag(FLAGS_causal);
  spec.seed = absl::GetFlag(FLAGS_seed);
  return spec;
}

absl::StatusOr<pb::DataType> ParseDType(const std::string& name) {
  if (name == "fp32" || name == "float32") return pb::FLOAT32;
  if (name == "fp16" || name == "float16") return pb::FLOAT16;
  if (name == "bf16" || name == "bfloat16") return pb::BFLOAT16;
  return absl::InvalidArgumentError(absl::StrCat("dtype must be fp32, fp16 or bf16, got '", name, "'"));
}

absl::StatusOr<InputLayout> InputLayoutOf(const pb::ModelConfig& c) {
  if (c.kind() == "sdpa") return InputLayout{InputLayout::Kind::kSdpa};
  if (c.kind() == "mha") {
    InputLayout layout{InputLayout::Kind::kMha, OrDefault(c.query_dim(), c.embed_dim()),
                       OrDefault(c.key_dim(), c.embed_dim()), OrDefault(c.value_dim(), c.embed_dim())};
    if (layout.query_dim < 1) return absl::FailedPreconditionError("the model config has no query_dim/embed_dim");
    return layout;
  }
  return absl::FailedPreconditionError(
      absl::StrCat("model kind '", c.kind(), "' is unknown to this client"));
}

absl::StatusOr<pb::AttendRequest> BuildRequest(const RequestSpec& spec, const InputLayout& layout) {
  const int64_t b = spec.batch;
  const int64_t lq = spec.seq;
  if (b < 1 || lq < 1 || spec.kv_seq < 0) {
    return absl::InvalidArgumentError(absl::StrCat("--batch and --seq must be >= 1 and --kv-seq >= 0, got ",
                                                   b, ", ", lq, ", ", spec.kv_seq));
  }
  const pb::DataType dtype = spec.dtype.value_or(pb::FLOAT32);
  std::mt19937_64 rng(spec.seed);
  pb::AttendRequest req;
  req.set_model(spec.model);
  req.set_causal(spec.causal);
  if (layout.kind == InputLayout::Kind::kSdpa) {
    const int64_t hq = spec.heads;
    const int64_t hkv = OrDefault(spec.kv_heads, hq);
    const int64_t dk = spec.head_dim;
    const int64_t dv = OrDefault(spec.value_dim, dk);
    const int64_t lk = OrDefault(spec.kv_seq, lq);
    if (hq < 1 || dk < 1) return absl::InvalidArgumentError("--heads and --head-dim must be >= 1");
    FillRandom(req.mutable_query(), dtype, {b, hq, lq, dk}, rng);
    FillRandom(req.mutable_key(), dtype, {b, hkv, lk, dk}, rng);
    FillRandom(req.mutable_value(), dtype, {b, hkv, lk, dv}, rng);
    return req;
  }
  FillRandom(req.mutable_query(), dtype, {b, lq, layout.query_dim}, rng);
  if (spec.kv_seq > 0) {
    FillRandom(req.mutable_key(), dtype, {b, spec.kv_seq, layout.key_dim}, rng);
    FillRandom(req.mutable_value(), dtype, {b, spec.kv_seq, layout.value_dim}, rng);
  }
  return req;
}

void EncodeFloats(absl::Span<const float> values, pb::DataType dtype, std::string* out) {
  const size_t size = dtype == pb::FLOAT32 ? 4 : 2;
  out->resize(values.size() * size);
  char* dst = out->data();
  for (size_t i = 0; i < values.size(); ++i) {
    if (dtype == pb::FLOAT32) {
      std::memcpy(dst + 4 * i, &values[i], 4);
    } else {
      const uint16_t h = dtype == pb::FLOAT16 ? FloatToHalf(values[i]) : FloatToBFloat16(values[i]);
      std::memcpy(dst + 2 * i, &h, 2);
    }
  }
}

std::vector<std::string> ParseCommandLine(int argc, char** argv) {
  std::vector<std::string> args(argv, argv + argc);
  for (size_t i = 1; i < args.size(); ++i) {
    std::string& a = args[i];
    if (a == "--") break;  // everything after is positional
    if (a.size() < 3 || a[0] != '-') continue;
    const size_t name_begin = a[1] == '-' ? 2 : 1;
    const size_t name_end = std::min(a.find('='), a.size());
    std::replace(a.begin() + static_cast<std::ptrdiff_t>(name_begin),
                 a.begin() + static_cast<std::ptrdiff_t>(name_end), '-', '_');
  }
  std::vector<char*> ptrs;
  for (std::string& a : args) ptrs.push_back(a.data());
  const std::vector<char*> positional = absl::ParseCommandLine(static_cast<int>(ptrs.size()), ptrs.data());
  return std::vector<std::string>(positional.begin(), positional.end());
}

}  // namespace attnserve::client
