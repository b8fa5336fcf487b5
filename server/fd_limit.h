// The process's file-descriptor budget: raising RLIMIT_NOFILE at start, and
// keeping the gRPC listener alive when the budget runs out anyway.
#ifndef ATTNSERVE_SERVER_FD_LIMIT_H_
#define ATTNSERVE_SERVER_FD_LIMIT_H_

#include <cstdint>

#include "absl/status/statusor.h"

namespace attnserve {

struct OpenFileLimit {
  uint64_t before = 0;  // soft RLIMIT_NOFILE found at start
  uint64_t after = 0;   // soft limit now (the hard limit when raised)
  uint64_t hard = 0;
};

// Raises the soft RLIMIT_NOFILE to the hard limit (every connection costs
// one descriptor; distributions default the soft limit to 1024). Internal
// when getrlimit/setrlimit fail.
absl::StatusOr<OpenFileLimit> RaiseOpenFileLimit();

// gRPC 1.51's listener (tcp_server_posix.cc) stops accepting for good on
// any accept4() error but EAGAIN/ECONNABORTED/EINTR, EMFILE included: once
// the process ran out of descriptors it never accepted again. From the
// first call on, accept4() on a non-blocking listening socket in this
// process (this library defines accept4, which the executable exports and
// the dynamic linker binds gRPC's call to) handles EMFILE/ENFILE itself: it
// closes a reserved descriptor, accepts one pending connection and closes
// it at once, re-reserves, and repeats until the backlog is empty; then it
// reports EAGAIN, which makes gRPC wait for the next connection instead of
// giving up. Connections that arrive while no descriptor is free are thus
// closed (the client sees the connection reset and retries), and accepting
// resumes as soon as descriptors are free again. A rate-limited line on
// stderr says how many were closed. Idempotent and thread-safe.
void KeepAcceptingWhenOutOfFds();

// Whether gRPC's accept4 calls reach the one of KeepAcceptingWhenOutOfFds:
// false when the executable does not export accept4 (link it with
// -Wl,--export-dynamic-symbol=accept4), or a library bound it otherwise.
bool AcceptGuardIsBound();

// Connections closed because no descriptor was free, since the process
// started.
int64_t ConnectionsShedForFds();

}  // namespace attnserve

#endif  // ATTNSERVE_SERVER_FD_LIMIT_H_
