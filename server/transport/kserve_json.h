// KServe v2's REST form (JSON, with Triton's binary tensor data extension)
// <-> the protocol's messages (inference.ModelInferRequest and friends),
// so that the HTTP endpoint takes the same request path as the gRPC one.
//
// An infer request body is a JSON header, optionally followed by binary
// tensor data: the header's length is the `Inference-Header-Content-Length`
// HTTP header (absent = the whole body is JSON). An input carries its
// values in "data" (nested or flat JSON arrays; FP32, BOOL, INT32, INT64)
// or, with "parameters": {"binary_data_size": n}, as the next n bytes of the
// binary part (any datatype; FP16 and BF16 only so, as in Triton). JSON
// values are parsed straight into the request's raw_input_contents bytes
// (RapidJSON's SAX reader: no document, no intermediate array of values).
#ifndef ATTNSERVE_SERVER_TRANSPORT_KSERVE_JSON_H_
#define ATTNSERVE_SERVER_TRANSPORT_KSERVE_JSON_H_

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "inference/grpc_service.pb.h"

namespace attnserve {

// A decoded HTTP infer request.
struct JsonInferRequest {
  // Every input as raw_input_contents (in input order), the parameters, the
  // requested outputs; model_name and model_version from the URL.
  inference::ModelInferRequest request;
  // Outputs to return as binary data: the request's "binary_data_output"
  // parameter, overridden per output by its "binary_data" parameter.
  bool binary_by_default = false;
  std::map<std::string, bool> binary_output;
};

// Decodes `body` (its first `header_length` bytes JSON, the rest binary
// tensor data; header_length < 0: all JSON). The JSON part is parsed in
// place: its bytes are changed (strings unescaped); the binary part is not.
// InvalidArgument naming the field and the rule: malformed JSON (with its
// offset), an unknown key, a value of the wrong type, data that does not
// match its shape, binary sizes that do not add up to the binary part.
absl::Status DecodeJsonInferRequest(std::string* body, int64_t header_length,
                                    const std::string& model, const std::string& version,
                                    JsonInferRequest* out);

// The HTTP body of a successful inference: the JSON header returned, then
// the outputs asked for as binary data, in output order, as views of
// `response`'s raw_output_contents (sent as they are: no copy of the tensor
// bytes). FP16 and BF16 outputs are always binary (JSON has no such numbers;
// as Triton).
std::string EncodeJsonInferResponse(const inference::ModelInferResponse& response,
                                    const JsonInferRequest& request,
                                    std::vector<absl::string_view>* binary_outputs);

// The body of POST /v2/repository/index: {"ready": bool} (empty = {}),
// parsed in place. InvalidArgument for anything else.
absl::StatusOr<bool> DecodeIndexRequest(std::string* body);

// The body of POST /v2/repository/models/{model}/load or /unload (`unload`):
// empty, {} or {"parameters": {...}}, parsed in place. Unload accepts
// Triton's "unload_dependents" (a bool; attnserve has no dependent models,
// so either value unloads just the model). Any other parameter -- load's
// config override and file contents included -- is refused InvalidArgument
// naming it: a model is loaded from the repository's files as they are.
absl::Status DecodeModelRepositoryRequest(std::string* body, bool unload);

// One parameter of a load (`unload` false) or unload request, as above; the
// gRPC front end checks RepositoryModelLoad/UnloadRequest.parameters with it.
absl::Status CheckModelRepositoryParameter(const std::string& name, bool is_bool, bool unload);

// The body of POST /v2/systemsharedmemory/region/{name}/register:
// {"key": string, "offset": number, "byte_size": number} ("offset" may be
// left out: 0), parsed in place. InvalidArgument naming the field.
struct SharedMemoryRegistration {
  std::string key;
  uint64_t offset = 0;
  uint64_t byte_size = 0;
};
absl::StatusOr<SharedMemoryRegistration> DecodeSharedMemoryRegisterRequest(std::string* body);

// {"error": message}
std::string ErrorJson(absl::string_view message);

// GET /v2, /v2/models/{m}, POST /v2/repository/index, GET .../stats, as
// Triton writes them (numbers as JSON numbers).
std::string ServerMetadataJson(const inference::ServerMetadataResponse& m);
std::string ModelMetadataJson(const inference::ModelMetadataResponse& m);
std::string RepositoryIndexJson(const inference::RepositoryIndexResponse& index);
std::string ModelStatisticsJson(const inference::ModelStatisticsResponse& stats);
// GET /v2/systemsharedmemory[/region/{name}]/status: an array of
// {"name", "key", "offset", "byte_size"}, by name.
std::string SystemSharedMemoryStatusJson(
    const inference::SystemSharedMemoryStatusResponse& status);
// GET .../config: the ModelConfig message in protobuf's JSON mapping, as
// Triton returns it.
std::string ModelConfigJson(const inference::ModelConfigResponse& config);

}  // namespace attnserve

#endif  // ATTNSERVE_SERVER_TRANSPORT_KSERVE_JSON_H_
