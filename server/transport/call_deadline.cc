// gRPC deadline (wall time) -> the server clock's time.
#include "server/transport/call_deadline.h"

#include <chrono>

namespace attnserve {

absl::Time ServerDeadline(const grpc::ServerContextBase& context, const Clock& clock) {
  // gRPC states deadlines in wall time: this is the one place that reads it.
  const auto wall_deadline = context.deadline();
  const auto wall_now = std::chrono::system_clock::now();
  if (wall_deadline >= wall_now + std::chrono::hours(24 * 365)) return absl::InfiniteFuture();
  return clock.Now() + absl::FromChrono(wall_deadline - wall_now);
}

}  // namespace attnserve
