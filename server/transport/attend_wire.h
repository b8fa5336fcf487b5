// Attend's tensors between the wire and host buffers of the engine's choosing
// (engine/host_buffer.h: page-locked memory for the CUDA engine), one copy in
// and none out. In: a request's tensors' bytes are copied once, from gRPC's
// slices straight into the buffers (so the GPU uploads from where the wire's
// bytes landed) instead of into the message's strings; protobuf parses
// everything else. Out: the engine writes its results into such buffers,
// which gRPC then sends from.
//
// Written here because protobuf 3.21 has no zero-copy bytes fields for
// open-source builds (ctype=CORD and STRING_PIECE parse into std::string),
// so its parse always copies a tensor into a heap string first.
#ifndef ATTNSERVE_SERVER_TRANSPORT_ATTEND_WIRE_H_
#define ATTNSERVE_SERVER_TRANSPORT_ATTEND_WIRE_H_

#include <cstdint>
#include <optional>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "attnserve/v1/attention.pb.h"
#include "engine/host_buffer.h"
#include "engine/tensor.h"
#include "grpcpp/support/byte_buffer.h"
#include "server/request/value_scan.h"
#include "server/transport/payload_copier.h"

namespace attnserve {

// One tensor's `data` as the wire had it, and what the copy found in it:
// the scan at the width of the dtype its Tensor gave before the data
// (value_scan.h; unset when it gave none, or not FLOAT32, FLOAT16 or
// BFLOAT16).
struct AttendPayload {
  HostBuffer bytes;
  std::optional<ValueScan> scan;
};

// The `data` of the request's query, key, value and attn_mask. Unset: that
// data was not taken out of the message (then the message's own `data`
// field holds it, as protobuf parsed it).
struct AttendPayloads {
  std::optional<AttendPayload> query, key, value, attn_mask;
};

// Parses `bytes` into `request` as ParseRequestMessage(bytes, what, number,
// request) would, with the same result and the same error for any input,
// except that every Tensor's `data` of the four tensor fields is left out of
// `request` and copied into a buffer from `pool` in `payloads` (the last
// occurrence on the wire, as protobuf keeps the last) by `copier`, which also
// scans it (AttendPayload::scan). The fields it leaves
// alone reach protobuf byte for byte. An encoding it does not take (a group,
// a tag or length in more bytes than protobuf reads, a malformed or
// truncated field, a field past the end of its Tensor) or a pool out of
// memory leaves the whole message to ParseRequestMessage, with `payloads`
// unset. Releases `bytes` either way.
absl::Status ParseAttendRequest(grpc::ByteBuffer* bytes, absl::string_view what, int64_t number,
                                HostBufferPool& pool, PayloadCopier& copier,
                                v1::AttendRequest* request, AttendPayloads* payloads);

// The bytes of a response's result tensors (output, weights), in host
// buffers the engine wrote them into, sent from there: gRPC's send path
// references them instead of copying them into its own buffer.
struct AttendResults {
  HostBuffer output, weights;
};

// Sets `tensor`'s dtype and shape and returns a view of `shape`'s bytes for
// the engine to write: a buffer from `pool` kept in `*bytes` (its contents
// uninitialised; engines write every byte), or, when the pool has no memory,
// `tensor`'s own data (AllocateTensor). Precondition: `shape` was validated.
MutableTensorView AllocateResult(HostBufferPool& pool, DType dtype, const Shape& shape,
                                 v1::Tensor* tensor, HostBuffer* bytes);

// The bytes of `response` with each result's data taken from `results`
// where the response's own data is empty: exactly what protobuf would
// serialize for the response with that data set, as gRPC slices that own
// the buffers. For a unary Attend answer.
absl::Status SerializeAttendResponse(const v1::AttendResponse& response, AttendResults results,
                                     grpc::ByteBuffer* bytes);

// The same for an AttendStream answer whose response is `answer.response()`.
absl::Status SerializeAttendStreamResponse(const v1::AttendStreamResponse& answer,
                                           AttendResults results, grpc::ByteBuffer* bytes);

}  // namespace attnserve

#endif  // ATTNSERVE_SERVER_TRANSPORT_ATTEND_WIRE_H_
