// RLIMIT_NOFILE at start, and the accept4() that sheds connections instead
// of failing when the process is out of descriptors.
#include "server/fd_limit.h"

#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstring>
#include <mutex>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"

namespace attnserve {
namespace {

std::atomic<bool> g_shedding_enabled{false};
std::atomic<int64_t> g_shed_total{0};

// Guards the reserved descriptor and the log rate limit. A std::mutex is
// constant-initialized, so accept4 may run at any time.
std::mutex g_mu;
int g_reserve ABSL_GUARDED_BY(g_mu) = -1;
int64_t g_shed_unlogged ABSL_GUARDED_BY(g_mu) = 0;
double g_last_log_s ABSL_GUARDED_BY(g_mu) = -1e9;

// At most one log line per this many seconds: a flood of connections must
// not become a flood of log lines.
constexpr double kLogIntervalSeconds = 10.0;

int RawAccept4(int fd, sockaddr* addr, socklen_t* len, int flags) {
  return static_cast<int>(syscall(SYS_accept4, fd, addr, len, flags));
}

void ReserveLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(g_mu) {
  if (g_reserve < 0) g_reserve = open("/dev/null", O_RDONLY | O_CLOEXEC);
}

double MonotonicSeconds() {
  timespec ts{};
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<double>(ts.tv_sec) + ts.tv_nsec * 1e-9;
}

// Accepts one pending connection on `fd` into the reserved descriptor's
// slot and closes it. False when nothing was pending, or when no slot could
// be had (another thread took the freed one).
bool ShedOne(int fd) {
  std::lock_guard<std::mutex> lock(g_mu);
  if (g_reserve >= 0) {
    close(g_reserve);
    g_reserve = -1;
  }
  int conn;
  do {
    conn = RawAccept4(fd, nullptr, nullptr, SOCK_CLOEXEC);
  } while (conn < 0 && errno == EINTR);
  const int accept_errno = errno;
  if (conn >= 0) {
    close(conn);
    g_shed_total.fetch_add(1, std::memory_order_relaxed);
    ++g_shed_unlogged;
  }
  ReserveLocked();
  const double now = MonotonicSeconds();
  if (g_shed_unlogged > 0 && now - g_last_log_s >= kLogIntervalSeconds) {
    rlimit limit{};
    getrlimit(RLIMIT_NOFILE, &limit);
    // fprintf needs no descriptor; this line is the operator's only clue.
    std::fprintf(stderr,
                 "attnserve: out of file descriptors (open files limit %llu): closed %lld "
                 "incoming connection(s) to keep accepting\n",
                 static_cast<unsigned long long>(limit.rlim_cur),
                 static_cast<long long>(g_shed_unlogged));
    g_shed_unlogged = 0;
    g_last_log_s = now;
  }
  errno = accept_errno;
  return conn >= 0;
}

bool IsNonBlocking(int fd) {
  const int fl = fcntl(fd, F_GETFL);
  return fl >= 0 && (fl & O_NONBLOCK) != 0;
}

}  // namespace

absl::StatusOr<OpenFileLimit> RaiseOpenFileLimit() {
  rlimit limit{};
  if (getrlimit(RLIMIT_NOFILE, &limit) != 0) {
    return absl::InternalError(absl::StrCat("getrlimit(RLIMIT_NOFILE): ", std::strerror(errno)));
  }
  OpenFileLimit out;
  out.before = limit.rlim_cur;
  out.hard = limit.rlim_max;
  if (limit.rlim_cur < limit.rlim_max) {
    limit.rlim_cur = limit.rlim_max;
    if (setrlimit(RLIMIT_NOFILE, &limit) != 0) {
      return absl::InternalError(absl::StrCat("setrlimit(RLIMIT_NOFILE, ", limit.rlim_max,
                                              "): ", std::strerror(errno)));
    }
  }
  out.after = limit.rlim_cur;
  return out;
}

void KeepAcceptingWhenOutOfFds() {
  std::lock_guard<std::mutex> lock(g_mu);
  ReserveLocked();
  g_shedding_enabled.store(true);
}

bool AcceptGuardIsBound() {
  // What a library's call to accept4 binds to: the first definition in the
  // global scope, the executable's when it exports one.
  return dlsym(RTLD_DEFAULT, "accept4") == reinterpret_cast<void*>(&::accept4);
}

int64_t ConnectionsShedForFds() { return g_shed_total.load(std::memory_order_relaxed); }

}  // namespace attnserve

// Interposes on libc's accept4 for the whole process (see
// KeepAcceptingWhenOutOfFds). Everything but EMFILE/ENFILE on a
// non-blocking socket, and everything before that call, behaves exactly as
// libc's accept4 (the same system call, made directly).
extern "C" int accept4(int fd, sockaddr* addr, socklen_t* len, int flags) {
  for (;;) {
    const int conn = attnserve::RawAccept4(fd, addr, len, flags);
    if (conn >= 0 || (errno != EMFILE && errno != ENFILE) ||
        !attnserve::g_shedding_enabled.load() || !attnserve::IsNonBlocking(fd)) {
      return conn;
    }
    // Out of descriptors with a connection pending. Shed it and look again:
    // the next one may fit (descriptors freed meanwhile) or be shed too,
    // until the backlog is empty.
    if (!attnserve::ShedOne(fd)) {
      // Backlog empty (EAGAIN), or the freed slot was taken. Either way
      // EAGAIN makes the caller wait for the next connection rather than
      // give up on the socket.
      errno = EAGAIN;
      return -1;
    }
  }
}
