// Protobuf's process-wide log output, tamed for a server that parses
// hostile bytes: what protobuf logs about a client's message becomes that
// client's error message instead of a log line, and every other protobuf log
// line is rate-limited, so no client can flood the server's log.
#ifndef ATTNSERVE_SERVER_TRANSPORT_PROTOBUF_LOG_H_
#define ATTNSERVE_SERVER_TRANSPORT_PROTOBUF_LOG_H_

#include <string>

#include "absl/time/time.h"

namespace attnserve {

// At most one protobuf log line per this interval reaches stderr; the next
// one that does says how many were suppressed in between. FATAL lines are
// never suppressed. Default: 10 s.
inline constexpr absl::Duration kProtobufLogInterval = absl::Seconds(10);

// Replaces protobuf's log handler (google::protobuf::SetLogHandler) with the
// capturing, rate-limited one; the handler it replaces still writes the lines
// that pass. Idempotent and thread-safe; call it before the server serves
// (the handler pointer protobuf reads is not atomic).
void InstallProtobufLogHandler();

// While alive, what protobuf logs on this thread (below FATAL) is appended to
// captured() instead of logged: it describes the bytes being parsed here, so
// the caller answers it to whoever sent them. Scopes do not nest; a scope
// belongs to the thread that made it. Works only once
// InstallProtobufLogHandler has run (otherwise captured() stays empty and
// protobuf logs as usual).
class ScopedProtobufLogCapture {
 public:
  ScopedProtobufLogCapture();
  ~ScopedProtobufLogCapture();
  ScopedProtobufLogCapture(const ScopedProtobufLogCapture&) = delete;
  ScopedProtobufLogCapture& operator=(const ScopedProtobufLogCapture&) = delete;

  // The messages protobuf logged in this scope, "; "-separated.
  const std::string& captured() const { return captured_; }

 private:
  std::string captured_;
};

}  // namespace attnserve

#endif  // ATTNSERVE_SERVER_TRANSPORT_PROTOBUF_LOG_H_
