// A gRPC call's deadline on the server's clock: the one place the transport
// reads gRPC's wall-clock deadline.
#ifndef ATTNSERVE_SERVER_TRANSPORT_SERVER_DEADLINE_H_
#define ATTNSERVE_SERVER_TRANSPORT_SERVER_DEADLINE_H_

#include "absl/time/time.h"
#include "grpcpp/server_context.h"
#include "server/request/clock.h"

namespace attnserve {

// InfiniteFuture when the call has none (gRPC reports "none" as a far-future
// wall time).
absl::Time ServerDeadline(const grpc::CallbackServerContext& context, const Clock& clock);

}  // namespace attnserve

#endif  // ATTNSERVE_SERVER_TRANSPORT_SERVER_DEADLINE_H_
