// The KServe v2 (Open Inference Protocol) front end's translation:
// inference.ModelInferRequest -> the request path's AttendInputs, and results
// -> ModelInferResponse outputs. The mapping (docs/API.md, "KServe v2"):
//   inputs, by name:  query, key, value (FP32 | FP16 | BF16), attn_mask (BOOL
//                     or the query's float type), key_lengths (INT32 | INT64),
//                     positions (INT32 | INT64, [B, Lk]), sinks (FP32, [Hq])
//                     -- the shapes and rules of attnserve.v1's Attend;
//   parameters:       causal (bool), scale (double), window (int64), softcap
//                     (double), need_weights (bool), average_weights (bool),
//                     session_id (string);
//   outputs:          output and, when weights are asked for, weights, as
//                     raw_output_contents;
//   shared memory:    an input's or requested output's parameters
//                     shared_memory_region, shared_memory_byte_size and
//                     (optional) shared_memory_offset put its bytes in a
//                     registered region instead (system_shared_memory.h).
// Everything else about a request (validation, batching, deadlines, metrics,
// shutdown) is the shared request path's.
#ifndef ATTNSERVE_SERVER_TRANSPORT_KSERVE_CODEC_H_
#define ATTNSERVE_SERVER_TRANSPORT_KSERVE_CODEC_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "engine/dtype.h"
#include "engine/host_buffer.h"
#include "engine/tensor.h"
#include "inference/grpc_service.pb.h"
#include "server/dispatch/request_dispatcher.h"
#include "server/request/attend_inputs.h"
#include "server/transport/system_shared_memory.h"

namespace attnserve {

// "FP32", "FP16", "BF16", "BOOL".
const char* KServeDatatype(DType dtype);

// A tensor whose bytes are in a registered shared-memory region: its
// parameters and its bytes, held until the request is answered.
struct SharedMemoryTensor {
  std::string region;  // empty: the tensor is not in shared memory
  int64_t offset = 0;
  int64_t byte_size = 0;
  SystemSharedMemory::Span span;
};

// Where a request's shared-memory tensors are looked up: `regions`, or,
// when it is null, nowhere: a tensor that names a region is refused with
// `refusal` (the extension is off, or the caller may not use it).
struct SharedMemoryAccess {
  const SystemSharedMemory* regions = nullptr;
  absl::Status refusal;
};

// A decoded ModelInferRequest: the inputs, plus what they point to that is
// not in the message itself (key_lengths and positions widened to int64).
struct KServeRequest {
  AttendInputs inputs;
  std::vector<int64_t> key_lengths;
  std::vector<int64_t> positions;
  // Which outputs to return: requested_outputs, or every output the request
  // produces when it names none.
  bool return_output = true;
  bool return_weights = false;
  // Triton's `timeout` parameter, in microseconds; 0 = none (the call's gRPC
  // deadline still applies).
  int64_t timeout_us = 0;
  // The inputs read from shared memory (held for their bytes), and the
  // outputs asked for there.
  std::vector<SharedMemoryTensor> shared_inputs;
  SharedMemoryTensor shared_output;
  SharedMemoryTensor shared_weights;
};

// Decodes `request` into `decoded`. Errors that concern the request as a
// whole (an unknown input or parameter, a parameter of the wrong type, raw
// contents that do not match the inputs, an unknown requested output) are
// returned as INVALID_ARGUMENT naming the field, a model version other than
// "" or "1" as NOT_FOUND; the caller hands them to the request path as
// decoded->inputs.decode_error, so that the model lookup answers first.
// Errors of one tensor (an unsupported datatype) become its decode_error, so
// that validation reports them in its usual order.
//
// `raw_inputs`: the request's raw_input_contents when they were taken out
// of the message (ParseModelInferRequest, kserve_wire.h); empty: the
// message's own. As in Triton, raw_input_contents has one entry per input
// that is neither in shared memory nor sent as typed contents, in input
// order.
//
// Inputs and outputs in shared memory are looked up in `shm.regions`: an
// input's data views its region's bytes (decoded->shared_inputs holds
// them); an output's region (decoded->shared_output, shared_weights) must
// not overlap another tensor's bytes, since the engine would read what it
// writes. Errors name the tensor: an unknown region or parameter, a range
// outside the region, both contents and a region, overlapping outputs
// (InvalidArgument), a region whose object shrank (FailedPrecondition),
// `shm.refusal` when there are no regions to look in.
//
// Lifetime: `decoded.inputs` points into `request`, `raw_inputs` and
// `decoded`; all must outlive it (and must not move).
absl::Status DecodeModelInferRequest(const inference::ModelInferRequest& request,
                                     KServeRequest* decoded,
                                     absl::Span<const HostBuffer> raw_inputs = {},
                                     const SharedMemoryAccess& shm = {});

// The response entry of an output that goes into shared memory: its entry in
// outputs with the region's parameters and an empty raw_output_contents
// entry (as Triton), and a view of the region's bytes. InvalidArgument when
// the region's byte size is smaller than the output.
absl::StatusOr<MutableTensorView> AddSharedMemoryOutput(inference::ModelInferResponse* response,
                                                        OutputName name, DType dtype,
                                                        const Shape& shape,
                                                        const SharedMemoryTensor& target);

// Adds the output tensor `name` to `response`: its entry in outputs and an
// empty raw_output_contents entry for its bytes. Returns a view of `shape`
// with no data yet.
MutableTensorView AddKServeOutput(inference::ModelInferResponse* response, OutputName name,
                                  DType dtype, const Shape& shape);

// Adds the output tensor `name` to `response` (its entry in outputs and its
// raw_output_contents bytes) and returns a writable view of those bytes.
MutableTensorView AllocateKServeOutput(inference::ModelInferResponse* response, OutputName name,
                                       DType dtype, const Shape& shape);

// Removes the outputs the client did not ask for (after the engine wrote
// them), keeping outputs and raw_output_contents in step. Returns the
// indices removed, highest first.
std::vector<int> KeepRequestedOutputs(const KServeRequest& decoded,
                                      inference::ModelInferResponse* response);

}  // namespace attnserve

#endif  // ATTNSERVE_SERVER_TRANSPORT_KSERVE_CODEC_H_
