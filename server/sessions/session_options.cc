// Range checks of the session flags.
#include "server/sessions/session_options.h"

#include "absl/strings/str_cat.h"
#include "engine/attention_params.h"

namespace attnserve {

absl::Status CheckSessionOptions(const SessionOptions& o) {
  if (o.kv_cache_bytes < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("--kv-cache-bytes: must be >= 1, got ", o.kv_cache_bytes));
  }
  if (o.block_tokens < kPagedBlockTokensMultiple || o.block_tokens % kPagedBlockTokensMultiple != 0 ||
      o.block_tokens > 4096) {
    return absl::InvalidArgumentError(
        absl::StrCat("--kv-block-tokens: must be a multiple of ", kPagedBlockTokensMultiple,
                     " in [", kPagedBlockTokensMultiple, ", 4096], got ", o.block_tokens));
  }
  if (o.ttl <= absl::ZeroDuration() || o.ttl > o.max_ttl) {
    return absl::InvalidArgumentError(absl::StrCat("--session-ttl: must be in (0, ",
                                                   absl::FormatDuration(o.max_ttl), "], got ",
                                                   absl::FormatDuration(o.ttl)));
  }
  if (o.max_tokens < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("--session-max-tokens: must be >= 1, got ", o.max_tokens));
  }
  if (o.max_sessions < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--max-sessions: must be >= 0 (0 = no sessions), got ", o.max_sessions));
  }
  if (o.max_queued_per_session < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "max_queued_per_session: must be >= 0, got ", o.max_queued_per_session));
  }
  return absl::OkStatus();
}

}  // namespace attnserve
