// ServerDeadline: gRPC's wall-clock deadline converted once to the server's
// monotonic clock.
#include "server/transport/server_deadline.h"

#include <chrono>

namespace attnserve {

absl::Time ServerDeadline(const grpc::CallbackServerContext& context, const Clock& clock) {
  const auto wall_deadline = context.deadline();
  const auto wall_now = std::chrono::system_clock::now();
  if (wall_deadline >= wall_now + std::chrono::hours(24 * 365)) return absl::InfiniteFuture();
  return clock.Now() + absl::FromChrono(wall_deadline - wall_now);
}

}  // namespace attnserve
