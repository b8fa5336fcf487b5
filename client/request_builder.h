// The request flags that attn_client and attn_bench share, and the one place
// that reads them and builds an AttendRequest with random inputs from them.
#ifndef ATTNSERVE_CLIENT_REQUEST_BUILDER_H_
#define ATTNSERVE_CLIENT_REQUEST_BUILDER_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/flags/declare.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "attnserve/v1/attention.pb.h"

// Read here (RequestSpecFromFlags), defined by each binary that links this
// library: the two tools give them different defaults and help (attn_client
// sends one 128-token request, attn_bench many 16-token ones). A binary
// includes this header before its ABSL_FLAG lines, so the compiler checks
// each definition against these types; a missing one fails to link.
ABSL_DECLARE_FLAG(std::string, model);
ABSL_DECLARE_FLAG(int64_t, batch);
ABSL_DECLARE_FLAG(int64_t, seq);
ABSL_DECLARE_FLAG(int64_t, kv_seq);
ABSL_DECLARE_FLAG(int64_t, heads);
ABSL_DECLARE_FLAG(int64_t, kv_heads);
ABSL_DECLARE_FLAG(int64_t, head_dim);
ABSL_DECLARE_FLAG(std::string, dtype);
ABSL_DECLARE_FLAG(bool, causal);
ABSL_DECLARE_FLAG(uint64_t, seed);

namespace attnserve::client {

// What the flags above ask for. Plain data; a zero "or" field takes the
// fallback named on it.
struct RequestSpec {
  std::string model;      // --model; empty = the server's default model
  int64_t batch = 0;      // --batch: B
  int64_t seq = 0;        // --seq: query length Lq
  int64_t kv_seq = 0;     // --kv-seq: Lk; 0 = seq (sdpa), self-attention (mha)
  int64_t heads = 0;      // --heads: query heads Hq (sdpa)
  int64_t kv_heads = 0;   // --kv-heads: Hkv (sdpa); 0 = heads
  int64_t head_dim = 0;   // --head-dim: Dk of query and key (sdpa)
  int64_t value_dim = 0;  // Dv of value and output (sdpa); 0 = head_dim. No
                          // shared flag: attn_client's --value-dim sets it.
  std::optional<v1::DataType> dtype;  // --dtype; unset when the flag is empty
  bool causal = false;    // --causal
  uint64_t seed = 0;      // --seed of the random inputs
};

// Reads the flags. Error: InvalidArgument when --dtype is not empty and not
// fp32, fp16 or bf16.
absl::StatusOr<RequestSpec> RequestSpecFromFlags();

// "fp32"/"float32", "fp16"/"float16", "bf16"/"bfloat16". Error:
// InvalidArgument naming the accepted spellings and `name`.
absl::StatusOr<v1::DataType> ParseDType(const std::string& name);

// How a model takes its inputs.
struct InputLayout {
  enum class Kind {
    kSdpa,  // heads: query [B, Hq, Lq, Dk], key/value [B, Hkv, Lk, Dk|Dv]
    kMha,   // projection: rows [B, L, dim] of the dims below
  };
  Kind kind = Kind::kSdpa;
  int64_t query_dim = 0;  // kMha only
  int64_t key_dim = 0;
  int64_t value_dim = 0;
};

// The layout of a model as GetModel/ListModels report it; unset dims default
// as model_config.proto says. Error: FailedPrecondition for a kind other than
// "sdpa" and "mha", or an "mha" model with no query_dim/embed_dim.
absl::StatusOr<InputLayout> InputLayoutOf(const v1::ModelConfig& config);

// A request for `spec.model` with `spec.causal`, and query, key and value
// drawn from N(0, 1) with `spec.seed`, in that order, encoded as `spec.dtype`
// (FLOAT32 when unset): the same spec and layout give the same bytes on every
// run. kMha with kv_seq 0 leaves key and value out (self-attention). Every
// other field (masks, weights, scale, ...) is the caller's. Error:
// InvalidArgument naming the flags when batch, seq (or, for kSdpa, heads,
// head_dim) is < 1 or kv_seq < 0.
absl::StatusOr<v1::AttendRequest> BuildRequest(const RequestSpec& spec, const InputLayout& layout);

// `values` as the little-endian bytes of a FLOAT32, FLOAT16 or BFLOAT16
// tensor (rounded to nearest even), replacing `*out`.
void EncodeFloats(absl::Span<const float> values, v1::DataType dtype, std::string* out);

// absl::ParseCommandLine, with flag names taken with dashes as well as with
// Abseil's underscores (--kv-seq = --kv_seq). Returns the positional
// arguments, argv[0] first; exits with status 1 on a bad flag, as Abseil does.
std::vector<std::string> ParseCommandLine(int argc, char** argv);

}  // namespace attnserve::client

#endif  // ATTNSERVE_CLIENT_REQUEST_BUILDER_H_
