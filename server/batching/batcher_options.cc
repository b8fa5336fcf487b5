// Range checks for BatcherOptions (flags and config.pbtxt feed them).
#include "server/batching/batcher_options.h"

#include "absl/strings/str_cat.h"

namespace attnserve {

absl::Status ValidateBatcherOptions(const BatcherOptions& o) {
  if (o.max_batch_requests < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "max_batch_requests must be >= 1 (1 = batching off), got ",
        o.max_batch_requests));
  }
  if (o.max_batch_tokens < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "max_batch_tokens must be >= 0 (0 = no limit), got ",
        o.max_batch_tokens));
  }
  if (o.max_queue_delay_us < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "max_queue_delay_us must be >= 0, got ", o.max_queue_delay_us));
  }
  if (o.max_queue_size < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "max_queue_size must be >= 1, got ", o.max_queue_size));
  }
  if (o.max_queue_bytes < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "max_queue_bytes must be >= 1, got ", o.max_queue_bytes));
  }
  if (o.idle_spin_us < 0 || o.idle_spin_us > 10000) {
    return absl::InvalidArgumentError(absl::StrCat(
        "idle_spin_us must be in [0, 10000] (0 = never poll), got ", o.idle_spin_us));
  }
  if (o.session_wait_us < 0 || o.session_wait_us > 1000000) {
    return absl::InvalidArgumentError(absl::StrCat(
        "session_wait_us must be in [0, 1000000] (0 = no wait), got ", o.session_wait_us));
  }
  if (o.instances < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "instances must be >= 0 (0 = manual mode), got ", o.instances));
  }
  return absl::OkStatus();
}

}  // namespace attnserve
