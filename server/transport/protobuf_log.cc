// The protobuf log handler: per-thread capture for parses of client bytes,
// rate limiting for everything else.
#include "server/transport/protobuf_log.h"

#include <chrono>
#include <cstdint>
#include <mutex>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "google/protobuf/stubs/logging.h"

namespace attnserve {
namespace {

// Protobuf logs one line per offending field and a parse stops at the first;
// the bound only keeps a pathological case from growing without limit.
constexpr size_t kMaxCapturedBytes = 1024;

// The capture of the scope alive on this thread, if any.
thread_local std::string* tls_capture = nullptr;

// The handler InstallProtobufLogHandler replaced (null: protobuf's logging
// was switched off). Written once, before the server serves.
google::protobuf::LogHandler* previous_handler = nullptr;

class RateLimiter {
 public:
  // True when a line may be written now; `*suppressed` is then the number
  // refused since the last one allowed. Log pacing decides nothing a client
  // sees, so it reads the steady clock directly, not the server's Clock.
  bool Allow(int64_t* suppressed) {
    const auto now = std::chrono::steady_clock::now();
    absl::MutexLock lock(&mu_);
    if (now < next_allowed_) {
      ++suppressed_;
      return false;
    }
    next_allowed_ = now + absl::ToChronoNanoseconds(kProtobufLogInterval);
    *suppressed = suppressed_;
    suppressed_ = 0;
    return true;
  }

 private:
  absl::Mutex mu_;
  std::chrono::steady_clock::time_point next_allowed_ ABSL_GUARDED_BY(mu_);
  int64_t suppressed_ ABSL_GUARDED_BY(mu_) = 0;
};

RateLimiter& Limiter() {
  static RateLimiter* limiter = new RateLimiter;  // never destroyed: logging may run at exit
  return *limiter;
}

void HandleProtobufLog(google::protobuf::LogLevel level, const char* filename, int line,
                       const std::string& message) {
  const bool fatal = level == google::protobuf::LOGLEVEL_FATAL;
  if (!fatal && tls_capture != nullptr) {
    if (tls_capture->size() < kMaxCapturedBytes) {
      if (!tls_capture->empty()) tls_capture->append("; ");
      tls_capture->append(message);
    }
    return;
  }
  if (previous_handler == nullptr) return;
  if (fatal) {
    previous_handler(level, filename, line, message);
    return;
  }
  int64_t suppressed = 0;
  if (!Limiter().Allow(&suppressed)) return;
  if (suppressed == 0) {
    previous_handler(level, filename, line, message);
  } else {
    previous_handler(level, filename, line,
                     absl::StrCat(message, " [", suppressed,
                                  " more protobuf log lines suppressed since the last one; at most "
                                  "one is written per ",
                                  absl::FormatDuration(kProtobufLogInterval), "]"));
  }
}

}  // namespace

void InstallProtobufLogHandler() {
  static std::once_flag once;
  std::call_once(once, [] { previous_handler = google::protobuf::SetLogHandler(&HandleProtobufLog); });
}

ScopedProtobufLogCapture::ScopedProtobufLogCapture() { tls_capture = &captured_; }

ScopedProtobufLogCapture::~ScopedProtobufLogCapture() { tls_capture = nullptr; }

}  // namespace attnserve
