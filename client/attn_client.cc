// attn_client: sample command-line client for attnserve. Sends one Attend
// request (random inputs shaped for the model, or .npy files) and prints the
// output shape, a checksum and the latency; `health` and `models` query the server.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "absl/flags/flag.h"
#include "absl/flags/usage.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "attnserve/v1/attention.grpc.pb.h"
#include "client/client_security.h"
#include "client/half.h"
#include "client/npy.h"
#include "client/request_builder.h"
#include "grpc/health/v1/health.grpc.pb.h"

ABSL_FLAG(std::string, target, "127.0.0.1:50051", "Server address, host:port.");
ABSL_FLAG(std::string, model, "", "Model name. Default: the server's default model.");
ABSL_FLAG(int64_t, batch, 1, "Batch size B (random inputs).");
ABSL_FLAG(int64_t, seq, 128, "Query length Lq (random inputs).");
ABSL_FLAG(int64_t, kv_seq, 0,
          "Key/value length Lk (random inputs). Default 0: --seq for sdpa; for projection "
          "models 0 means self-attention (key and value omitted).");
ABSL_FLAG(int64_t, heads, 8, "sdpa: query heads Hq.");
ABSL_FLAG(int64_t, kv_heads, 0, "sdpa: key/value heads Hkv (grouped-query when < Hq). Default 0: --heads.");
ABSL_FLAG(int64_t, head_dim, 64, "sdpa: head dim Dk of query and key.");
ABSL_FLAG(int64_t, value_dim, 0, "sdpa: head dim Dv of value and output. Default 0: --head-dim.");
ABSL_FLAG(std::string, query_npy, "", "Query from this .npy file instead of random data.");
ABSL_FLAG(std::string, key_npy, "", "Key from this .npy file (with --value-npy).");
ABSL_FLAG(std::string, value_npy, "", "Value from this .npy file (with --key-npy).");
ABSL_FLAG(std::string, mask_npy, "",
          "attn_mask from this .npy file: bool (true = may attend) or float (added to the scores).");
ABSL_FLAG(std::vector<std::string>, key_lengths, {},
          "Comma-separated valid key lengths, one per batch element.");
ABSL_FLAG(bool, causal, false, "Causal mask, aligned bottom-right.");
ABSL_FLAG(double, scale, 0, "Score scale. Default 0: 1/sqrt(head_dim).");
ABSL_FLAG(int64_t, window, 0,
          "sdpa: sliding window, query i sees keys i + Lk - Lq - window + 1 onwards. 0: none.");
ABSL_FLAG(double, softcap, 0, "sdpa: logit softcapping, scores c * tanh(s / c). 0: none.");
ABSL_FLAG(std::vector<std::string>, sinks, {},
          "sdpa: comma-separated attention-sink logits, one per query head.");
ABSL_FLAG(std::string, dtype, "",
          "Input dtype: fp32, fp16 or bf16. Default: the query .npy's dtype, else fp32. "
          "Inputs are converted to it.");
ABSL_FLAG(std::string, output_dtype, "", "Output dtype: fp32, fp16 or bf16. Default: the input dtype.");
ABSL_FLAG(bool, need_weights, false, "Also return the attention weights [B, Hq, Lq, Lk].");
ABSL_FLAG(bool, average_weights, false, "Average the returned weights over heads: [B, Lq, Lk].");
ABSL_FLAG(uint64_t, seed, 0, "Seed of the random inputs.");
ABSL_FLAG(std::string, output_npy, "",
          "Write the output here as .npy: float16 stays float16, bfloat16 becomes float32.");
ABSL_FLAG(std::string, weights_npy, "", "Write the weights here as .npy (with --need-weights).");
ABSL_FLAG(std::string, service, "", "health: the service name to check. Default: the whole server.");
ABSL_FLAG(int64_t, timeout_ms, 60000, "Deadline of each RPC in milliseconds.");

namespace attnserve::client {
namespace {

namespace pb = ::attnserve::v1;
namespace health = ::grpc::health::v1;

// Distinct exit codes so scripts can tell a server-side failure from a typo.
// Usage errors get 1 because Abseil's flag parser already exits with 1 on an
// unknown flag or a bad flag value.
constexpr int kExitOk = 0;
constexpr int kExitUsage = 1;
constexpr int kExitRpcError = 2;
constexpr int kExitNotServing = 3;

// Requests and responses can be large tensors; gRPC's 4 MiB default receive
// limit would reject ordinary outputs.
constexpr int kMaxMessageBytes = 1 << 30;

int RpcFailed(const char* what, const grpc::Status& status) {
  // gRPC and Abseil number their status codes alike.
  std::fprintf(stderr, "error: %s failed: %s: %s\n", what,
               absl::StatusCodeToString(static_cast<absl::StatusCode>(status.error_code())).c_str(),
               status.error_message().c_str());
  return kExitRpcError;
}

int UsageError(const std::string& message) {
  std::fprintf(stderr, "usage error: %s\n", message.c_str());
  return kExitUsage;
}

std::unique_ptr<grpc::ClientContext> MakeContext() {
  auto ctx = std::make_unique<grpc::ClientContext>();
  ctx->set_deadline(std::chrono::system_clock::now() +
                    std::chrono::milliseconds(absl::GetFlag(FLAGS_timeout_ms)));
  AddAuthorization(ctx.get());
  return ctx;
}

int DTypeSize(pb::DataType dtype) {
  switch (dtype) {
    case pb::FLOAT32: return 4;
    case pb::FLOAT16:
    case pb::BFLOAT16: return 2;
    case pb::BOOL: return 1;
    default: return 0;
  }
}

std::string ShapeString(const google::protobuf::RepeatedField<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

// The dtype a .npy array naturally maps to ("<u2" carries bfloat16 bits).
pb::DataType NpyDType(const NpyArray& a) {
  if (a.descr == "<f4") return pb::FLOAT32;
  if (a.descr == "<f2") return pb::FLOAT16;
  if (a.descr == "<u2") return pb::BFLOAT16;
  return pb::BOOL;
}

float LoadFloat(pb::DataType dtype, const char* data, int64_t i) {
  switch (dtype) {
    case pb::FLOAT32: {
      float f;
      std::memcpy(&f, data + 4 * i, 4);
      return f;
    }
    case pb::FLOAT16:
    case pb::BFLOAT16: {
      uint16_t h;
      std::memcpy(&h, data + 2 * i, 2);
      return dtype == pb::FLOAT16 ? HalfToFloat(h) : BFloat16ToFloat(h);
    }
    default:
      return data[i] != 0 ? 1.0f : 0.0f;
  }
}

// Loads a float .npy into a tensor of `dtype`, converting element by element
// unless the file already holds that dtype.
absl::Status LoadInput(const std::string& path, pb::DataType dtype, pb::Tensor* t) {
  auto array = ReadNpy(path);
  if (!array.ok()) return array.status();
  const pb::DataType from = NpyDType(*array);
  if (from == pb::BOOL) return absl::InvalidArgumentError(absl::StrCat(path, ": inputs must be float, got bool"));
  t->set_dtype(dtype);
  for (int64_t d : array->shape) t->add_shape(d);
  if (from == dtype) {
    *t->mutable_data() = std::move(array->data);
    return absl::OkStatus();
  }
  std::vector<float> values(static_cast<size_t>(array->num_elements()));
  for (size_t i = 0; i < values.size(); ++i) values[i] = LoadFloat(from, array->data.data(), static_cast<int64_t>(i));
  EncodeFloats(values, dtype, t->mutable_data());
  return absl::OkStatus();
}

// Masks keep their own dtype: bool stays BOOL, float16 stays FLOAT16.
absl::Status LoadMask(const std::string& path, pb::Tensor* t) {
  auto array = ReadNpy(path);
  if (!array.ok()) return array.status();
  t->set_dtype(NpyDType(*array));
  for (int64_t d : array->shape) t->add_shape(d);
  *t->mutable_data() = std::move(array->data);
  return absl::OkStatus();
}

absl::Status WriteTensorNpy(const std::string& path, const pb::Tensor& t) {
  NpyArray array;
  array.shape.assign(t.shape().begin(), t.shape().end());
  switch (t.dtype()) {
    case pb::FLOAT32: array.descr = "<f4"; array.data = t.data(); break;
    case pb::FLOAT16: array.descr = "<f2"; array.data = t.data(); break;
    case pb::BFLOAT16: {
      // NumPy has no bfloat16; float32 holds every bfloat16 value exactly.
      array.descr = "<f4";
      const int64_t n = static_cast<int64_t>(t.data().size() / 2);
      array.data.resize(static_cast<size_t>(n) * 4);
      for (int64_t i = 0; i < n; ++i) {
        const float f = LoadFloat(pb::BFLOAT16, t.data().data(), i);
        std::memcpy(array.data.data() + 4 * i, &f, 4);
      }
      break;
    }
    default:
      return absl::InvalidArgumentError("the server returned a tensor of unexpected dtype");
  }
  return WriteNpy(path, array);
}

struct Checksum {
  double sum = 0;
  double abs_sum = 0;
  int64_t non_finite = 0;
};

Checksum ChecksumOf(const pb::Tensor& t) {
  Checksum c;
  const int size = DTypeSize(t.dtype());
  if (size == 0) return c;
  const int64_t n = static_cast<int64_t>(t.data().size()) / size;
  for (int64_t i = 0; i < n; ++i) {
    const double v = LoadFloat(t.dtype(), t.data().data(), i);
    if (!std::isfinite(v)) {
      ++c.non_finite;
      continue;
    }
    c.sum += v;
    c.abs_sum += std::fabs(v);
  }
  return c;
}

// The model's status: by name, or the server's default when --model is empty.
absl::StatusOr<pb::ModelStatus> FindModel(pb::AttentionService::Stub& stub, const std::string& name,
                                          grpc::Status* rpc_status) {
  if (!name.empty()) {
    pb::GetModelRequest req;
    req.set_name(name);
    pb::ModelStatus status;
    *rpc_status = stub.GetModel(MakeContext().get(), req, &status);
    if (!rpc_status->ok()) return absl::UnknownError("GetModel");
    return status;
  }
  pb::ListModelsResponse list;
  *rpc_status = stub.ListModels(MakeContext().get(), pb::ListModelsRequest(), &list);
  if (!rpc_status->ok()) return absl::UnknownError("ListModels");
  for (const auto& m : list.models()) {
    if (m.is_default()) return m;
  }
  return absl::NotFoundError("the server names no default model; pass --model");
}

int RunHealth(const std::shared_ptr<grpc::Channel>& channel) {
  auto stub = health::Health::NewStub(channel);
  health::HealthCheckRequest req;
  req.set_service(absl::GetFlag(FLAGS_service));
  health::HealthCheckResponse resp;
  const grpc::Status s = stub->Check(MakeContext().get(), req, &resp);
  if (!s.ok()) return RpcFailed("Health.Check", s);
  const std::string name = health::HealthCheckResponse::ServingStatus_Name(resp.status());
  std::printf("%s\n", name.c_str());
  return resp.status() == health::HealthCheckResponse::SERVING ? kExitOk : kExitNotServing;
}

int RunModels(pb::AttentionService::Stub& stub) {
  pb::ListModelsResponse list;
  const grpc::Status s = stub.ListModels(MakeContext().get(), pb::ListModelsRequest(), &list);
  if (!s.ok()) return RpcFailed("ListModels", s);
  std::printf("%-20s %-6s %-10s %-8s %s\n", "NAME", "KIND", "BACKEND", "STATE", "DIMS");
  for (const auto& m : list.models()) {
    const pb::ModelConfig& c = m.config();
    std::string dims = c.kind() == "sdpa"
                           ? "any (head layout)"
                           : absl::StrFormat("embed_dim=%d num_heads=%d", c.embed_dim(), c.num_heads());
    if (c.num_kv_heads() > 0 && c.num_kv_heads() != c.num_heads()) {
      absl::StrAppend(&dims, " num_kv_heads=", c.num_kv_heads());
    }
    std::string state = pb::ModelStatus::State_Name(m.state());
    if (!m.reason().empty()) absl::StrAppend(&state, " (", m.reason(), ")");
    std::printf("%-20s %-6s %-10s %-8s %s%s\n", m.name().c_str(), c.kind().c_str(), m.backend().c_str(),
                state.c_str(), dims.c_str(), m.is_default() ? "  [default]" : "");
  }
  return kExitOk;
}

int RunAttend(const std::shared_ptr<grpc::Channel>& channel, pb::AttentionService::Stub& stub) {
  absl::StatusOr<RequestSpec> spec = RequestSpecFromFlags();
  if (!spec.ok()) return UsageError(std::string(spec.status().message()));
  spec->value_dim = absl::GetFlag(FLAGS_value_dim);
  // Flag values first: a typo is a usage error even when the server is down.
  std::vector<int64_t> key_lengths;
  for (const std::string& s : absl::GetFlag(FLAGS_key_lengths)) {
    int64_t len;
    if (!absl::SimpleAtoi(s, &len)) return UsageError(absl::StrCat("--key-lengths: '", s, "' is not an integer"));
    key_lengths.push_back(len);
  }
  std::optional<pb::DataType> output_dtype;
  if (!absl::GetFlag(FLAGS_output_dtype).empty()) {
    auto out = ParseDType(absl::GetFlag(FLAGS_output_dtype));
    if (!out.ok()) return UsageError(absl::StrCat("--output-dtype: ", out.status().message()));
    output_dtype = *out;
  }

  const std::string query_npy = absl::GetFlag(FLAGS_query_npy);
  const std::string key_npy = absl::GetFlag(FLAGS_key_npy);
  const std::string value_npy = absl::GetFlag(FLAGS_value_npy);
  if (key_npy.empty() != value_npy.empty()) return UsageError("--key-npy and --value-npy go together");
  if (query_npy.empty() && !key_npy.empty()) return UsageError("--key-npy/--value-npy need --query-npy");

  pb::AttendRequest req;
  std::string model_label = spec->model.empty() ? "(server default)" : spec->model;
  if (!query_npy.empty()) {
    req.set_model(spec->model);
    req.set_causal(spec->causal);
    pb::DataType dtype;
    if (spec->dtype.has_value()) {
      dtype = *spec->dtype;
    } else {
      auto q = ReadNpy(query_npy);
      if (!q.ok()) return UsageError(std::string(q.status().message()));
      dtype = NpyDType(*q);
    }
    absl::Status st = LoadInput(query_npy, dtype, req.mutable_query());
    if (st.ok() && !key_npy.empty()) st = LoadInput(key_npy, dtype, req.mutable_key());
    if (st.ok() && !value_npy.empty()) st = LoadInput(value_npy, dtype, req.mutable_value());
    if (!st.ok()) return UsageError(std::string(st.message()));
  } else {
    grpc::Status rpc;
    auto model = FindModel(stub, spec->model, &rpc);
    if (!rpc.ok()) return RpcFailed(spec->model.empty() ? "ListModels" : "GetModel", rpc);
    if (!model.ok()) return UsageError(std::string(model.status().message()));
    model_label = absl::StrCat(model->name(), " (", model->config().kind(), ", backend ", model->backend(), ")");
    absl::StatusOr<InputLayout> layout = InputLayoutOf(model->config());
    if (!layout.ok()) return UsageError(absl::StrCat(layout.status().message(), "; pass --query-npy"));
    absl::StatusOr<pb::AttendRequest> random = BuildRequest(*spec, *layout);
    if (!random.ok()) return UsageError(std::string(random.status().message()));
    req = *std::move(random);
  }
  req.set_need_weights(absl::GetFlag(FLAGS_need_weights) || absl::GetFlag(FLAGS_average_weights));
  req.set_average_weights(absl::GetFlag(FLAGS_average_weights));
  req.set_scale(static_cast<float>(absl::GetFlag(FLAGS_scale)));
  req.set_window(absl::GetFlag(FLAGS_window));
  req.set_softcap(static_cast<float>(absl::GetFlag(FLAGS_softcap)));
  for (const std::string& text : absl::GetFlag(FLAGS_sinks)) {
    float sink;
    if (!absl::SimpleAtof(text, &sink)) return UsageError(absl::StrCat("--sinks: '", text, "' is not a number"));
    req.add_sinks(sink);
  }
  for (int64_t len : key_lengths) req.add_key_lengths(len);
  if (output_dtype.has_value()) req.set_output_dtype(*output_dtype);
  if (!absl::GetFlag(FLAGS_mask_npy).empty()) {
    const absl::Status st = LoadMask(absl::GetFlag(FLAGS_mask_npy), req.mutable_attn_mask());
    if (!st.ok()) return UsageError(std::string(st.message()));
  }

  // Connect first, so the latency below is one request, not a TCP handshake.
  if (!channel->WaitForConnected(std::chrono::system_clock::now() + std::chrono::seconds(10))) {
    std::fprintf(stderr, "error: cannot connect to %s: UNAVAILABLE\n", absl::GetFlag(FLAGS_target).c_str());
    return kExitRpcError;
  }
  pb::AttendResponse resp;
  auto ctx = MakeContext();
  const auto start = std::chrono::steady_clock::now();
  const grpc::Status s = stub.Attend(ctx.get(), req, &resp);
  const double latency_ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  if (!s.ok()) return RpcFailed("Attend", s);

  const pb::Tensor& out = resp.output();
  std::printf("model: %s\n", model_label.c_str());
  std::printf("query: %s %s\n", pb::DataType_Name(req.query().dtype()).c_str(), ShapeString(req.query().shape()).c_str());
  std::printf("output: %s %s\n", pb::DataType_Name(out.dtype()).c_str(), ShapeString(out.shape()).c_str());
  if (resp.has_weights()) {
    std::printf("weights: %s %s\n", pb::DataType_Name(resp.weights().dtype()).c_str(),
                ShapeString(resp.weights().shape()).c_str());
  }
  const Checksum c = ChecksumOf(out);
  std::printf("checksum: sum=%.10g abs_sum=%.10g", c.sum, c.abs_sum);
  if (c.non_finite > 0) std::printf(" non_finite=%lld", static_cast<long long>(c.non_finite));
  std::printf("\n");
  const pb::Timing& t = resp.timing();
  std::printf("latency: %.3f ms round trip; server %lld us (queue %lld us, compute %lld us, batch of %d)\n",
              latency_ms, static_cast<long long>(t.total_us()), static_cast<long long>(t.queue_us()),
              static_cast<long long>(t.compute_us()), t.batch_requests());

  if (const std::string path = absl::GetFlag(FLAGS_output_npy); !path.empty()) {
    const absl::Status st = WriteTensorNpy(path, out);
    if (!st.ok()) return UsageError(absl::StrCat("--output-npy: ", st.message()));
    std::printf("wrote output to %s\n", path.c_str());
  }
  if (const std::string path = absl::GetFlag(FLAGS_weights_npy); !path.empty()) {
    if (!resp.has_weights()) return UsageError("--weights-npy needs --need-weights");
    const absl::Status st = WriteTensorNpy(path, resp.weights());
    if (!st.ok()) return UsageError(absl::StrCat("--weights-npy: ", st.message()));
    std::printf("wrote weights to %s\n", path.c_str());
  }
  return kExitOk;
}

int Main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "attn_client [attend|health|models] [--flags]\n"
      "  attend (default): one Attend request; random inputs shaped for --model, or --query-npy ...\n"
      "  health: grpc.health.v1 Check (exit 0 = SERVING, 3 = not serving)\n"
      "  models: list the served models\n"
      "Flags may be spelled with dashes or underscores (--kv-seq = --kv_seq).\n"
      "Exit codes: 0 ok, 1 usage error, 2 RPC failed, 3 not serving.");
  const std::vector<std::string> args = ParseCommandLine(argc, argv);
  if (args.size() > 2) return UsageError("at most one command: attend, health or models");
  const std::string command = args.size() == 2 ? args[1] : "attend";
  if (command != "attend" && command != "health" && command != "models") {
    return UsageError(absl::StrCat("unknown command '", command, "' (want attend, health or models)"));
  }

  grpc::ChannelArguments channel_args;
  channel_args.SetMaxReceiveMessageSize(kMaxMessageBytes);
  channel_args.SetMaxSendMessageSize(kMaxMessageBytes);
  absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> credentials =
      ChannelCredentialsFromFlags(&channel_args);
  if (!credentials.ok()) return UsageError(std::string(credentials.status().message()));
  if (absl::Status s = LoadTokenFromFlags(); !s.ok()) return UsageError(std::string(s.message()));
  auto channel = grpc::CreateCustomChannel(absl::GetFlag(FLAGS_target), *credentials,
                                           channel_args);
  if (command == "health") return RunHealth(channel);
  auto stub = pb::AttentionService::NewStub(channel);
  if (command == "models") return RunModels(*stub);
  return RunAttend(channel, *stub);
}

}  // namespace
}  // namespace attnserve::client

int main(int argc, char** argv) { return attnserve::client::Main(argc, argv); }
