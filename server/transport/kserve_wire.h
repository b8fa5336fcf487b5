// KServe v2 (gRPC) results out of host buffers of the engine's choosing
// (engine/host_buffer.h: page-locked memory for the CUDA engine), with no
// copy: the engine writes each output into a buffer, and the answer's bytes
// reference it where raw_output_contents would hold a copy. The HTTP front
// end keeps the response's own raw_output_contents (kserve_codec.h).
#ifndef ATTNSERVE_SERVER_TRANSPORT_KSERVE_WIRE_H_
#define ATTNSERVE_SERVER_TRANSPORT_KSERVE_WIRE_H_

#include <vector>

#include "absl/status/status.h"
#include "engine/host_buffer.h"
#include "engine/tensor.h"
#include "grpcpp/support/byte_buffer.h"
#include "inference/grpc_service.pb.h"
#include "server/dispatch/request_dispatcher.h"

namespace attnserve {

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
