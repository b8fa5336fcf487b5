// absl::Status -> grpc::Status at the transport edge. Everything inside the
// process speaks absl::Status; only the service and main() see grpc::Status.
#ifndef ATTNSERVE_SERVER_TRANSPORT_STATUS_UTIL_H_
#define ATTNSERVE_SERVER_TRANSPORT_STATUS_UTIL_H_

#include <cstddef>

#include "absl/status/status.h"
#include "grpcpp/support/status.h"

namespace attnserve {

// Longest message sent to a client. Messages echo client-supplied values
// (shapes, names), so they are bounded to keep a hostile request from
// producing a huge trailer. Default: 2048 bytes.
inline constexpr size_t kMaxStatusMessageBytes = 2048;

// Same code (absl and gRPC share the numbering), message truncated to
// `max_message_bytes` with a " ... [truncated]" marker. Payloads are dropped.
grpc::Status ToGrpcStatus(const absl::Status& status,
                          size_t max_message_bytes = kMaxStatusMessageBytes);

}  // namespace attnserve

#endif  // ATTNSERVE_SERVER_TRANSPORT_STATUS_UTIL_H_
