// KServe v2 (gRPC) tensors between the wire and host buffers of the engine's
// choosing (engine/host_buffer.h: page-locked memory for the CUDA engine),
// one copy in and none out, as attend_wire.h does for Attend. In: each
// raw_input_contents entry is copied once, from gRPC's slices straight into
// a buffer, instead of into the message's strings; protobuf parses
// everything else. Out: the engine writes each output into a buffer, and
// the answer's bytes reference it where raw_output_contents would hold a
// copy. The HTTP front end keeps the messages' own contents
// (kserve_codec.h).
#ifndef ATTNSERVE_SERVER_TRANSPORT_KSERVE_WIRE_H_
#define ATTNSERVE_SERVER_TRANSPORT_KSERVE_WIRE_H_

#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "engine/host_buffer.h"
#include "engine/tensor.h"
#include "grpcpp/support/byte_buffer.h"
#include "inference/grpc_service.pb.h"
#include "server/dispatch/request_dispatcher.h"
#include "server/transport/payload_copier.h"

namespace attnserve {

// Parses `bytes` into `request` as ParseRequestMessage(bytes, what, number,
// request) would, with the same result and the same error for any input,
// except that the raw_input_contents entries are left out of `request` and
// copied, in order, into buffers from `pool` appended to `raw_inputs`
// (which must be empty). The fields it leaves alone reach protobuf byte for
// byte. An encoding it does not take (a tag or length in more bytes than
// protobuf reads, a group, a malformed or truncated field) or a pool out of
// memory, or more raw entries than a request can use (64), leaves the whole
// message to ParseRequestMessage, with `raw_inputs` empty. Releases `bytes`
// either way.
//
// So a request's raw contents are `raw_inputs` when it is not empty and
// request->raw_input_contents() otherwise (DecodeModelInferRequest takes
// both).
// The raw entries are copied by `copier` (payload_copier.h; not scanned:
// their datatypes are in `inputs`, which protobuf parses after the split).
absl::Status ParseModelInferRequest(grpc::ByteBuffer* bytes, absl::string_view what,
                                    int64_t number, HostBufferPool& pool, PayloadCopier& copier,
                                    inference::ModelInferRequest* request,
                                    std::vector<HostBuffer>* raw_inputs);

// As AllocateKServeOutput, but the output's bytes go into a buffer from
// `pool`, appended to `buffers` (one per raw_output_contents entry, in
// step), and its raw_output_contents entry stays empty. When the pool has
// no memory, the bytes go into the entry as AllocateKServeOutput puts them,
// with an empty buffer in `buffers`. Precondition: `shape` was validated.
MutableTensorView AllocateKServeResult(HostBufferPool& pool,
                                       inference::ModelInferResponse* response, OutputName name,
                                       DType dtype, const Shape& shape,
                                       std::vector<HostBuffer>* buffers);

// The bytes of `response` with raw_output_contents(i) taken from
// buffers[i] wherever that buffer is not empty (the entry itself is then
// empty): exactly what protobuf serializes for the response with those
// bytes in raw_output_contents, as gRPC slices that own the buffers.
// `buffers` has one entry per raw_output_contents entry, or none.
// InternalError past protobuf's 2 GiB limit.
absl::Status SerializeModelInferResponse(const inference::ModelInferResponse& response,
                                         std::vector<HostBuffer> buffers,
                                         grpc::ByteBuffer* bytes);

// The same for a ModelStreamInfer answer whose response is
// `answer.infer_response()`.
absl::Status SerializeModelStreamInferResponse(const inference::ModelStreamInferResponse& answer,
                                               std::vector<HostBuffer> buffers,
                                               grpc::ByteBuffer* bytes);

}  // namespace attnserve

#endif  // ATTNSERVE_SERVER_TRANSPORT_KSERVE_WIRE_H_
