// A gRPC call's deadline on the server's clock: shared by every front end so
// that one place converts gRPC's wall-clock deadlines.
#ifndef ATTNSERVE_SERVER_TRANSPORT_CALL_DEADLINE_H_
#define ATTNSERVE_SERVER_TRANSPORT_CALL_DEADLINE_H_

#include "absl/time/time.h"
#include "grpcpp/server_context.h"
#include "server/request/clock.h"

namespace attnserve {

// InfiniteFuture when the call has none (gRPC reports "none" as a far-future
// wall time).
absl::Time ServerDeadline(const grpc::ServerContextBase& context, const Clock& clock);

}  // namespace attnserve

#endif  // ATTNSERVE_SERVER_TRANSPORT_CALL_DEADLINE_H_
