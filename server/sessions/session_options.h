// The server's session settings (--kv-cache-bytes, --kv-block-tokens,
// --session-ttl, --session-max-tokens, --max-sessions): one struct, so that
// ServerOptions carries them without the session table.
#ifndef ATTNSERVE_SERVER_SESSIONS_SESSION_OPTIONS_H_
#define ATTNSERVE_SERVER_SESSIONS_SESSION_OPTIONS_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/time/time.h"

namespace attnserve {

struct SessionOptions {
  // Bytes of K/V cache per model (--kv-cache-bytes). Default: 1 GiB.
  int64_t kv_cache_bytes = int64_t{1} << 30;
  // Tokens per cache block (--kv-block-tokens); a multiple of 16
  // (kPagedBlockTokensMultiple). Default: 16.
  int64_t block_tokens = 16;
  // Idle time after which a session is closed (--session-ttl); OpenSession
  // may ask for another one, up to max_ttl. Default: 10 min.
  absl::Duration ttl = absl::Minutes(10);
  // Longest TTL OpenSession may ask for. Default: 24 h.
  absl::Duration max_ttl = absl::Hours(24);
  // Most tokens one session may cache (--session-max-tokens); OpenSession
  // may ask for fewer. Default: 32768.
  int64_t max_tokens = 32768;
  // Most open sessions, all models together (--max-sessions). Default: 65536.
  int64_t max_sessions = 65536;
  // Requests of one session waiting behind the one in flight; more are
  // refused RESOURCE_EXHAUSTED. Default: 64.
  int64_t max_queued_per_session = 64;
};

// InvalidArgument naming the flag when a value is out of range.
absl::Status CheckSessionOptions(const SessionOptions& options);

}  // namespace attnserve

#endif  // ATTNSERVE_SERVER_SESSIONS_SESSION_OPTIONS_H_
