// The CPU limit of the container this process runs in (its cgroup's CFS
// quota), so that "one engine thread per core" means the cores the process
// may use, not the node's.
#ifndef ATTNSERVE_SERVER_CPU_LIMIT_H_
#define ATTNSERVE_SERVER_CPU_LIMIT_H_

#include <optional>
#include <string>

#include "absl/status/statusor.h"

namespace attnserve {

struct CpuLimit {
  // CPUs per period the cgroup may use: quota / period (e.g. 1.5 for a
  // Kubernetes `limits.cpu: 1500m`).
  double cpus = 0;
  // The file that set it (the smallest limit of the cgroup and its
  // ancestors), e.g. "/sys/fs/cgroup/cpu.max".
  std::string source;
};

// Reads the limit from cgroup v2 (cpu.max: "QUOTA PERIOD" or "max PERIOD")
// or, when the process has no v2 cpu controller, cgroup v1
// (cpu.cfs_quota_us, -1 = none, and cpu.cfs_period_us), for the process's
// own cgroup (/proc/self/cgroup, located through /proc/self/mountinfo) and
// every ancestor visible to it; the smallest wins. std::nullopt when no
// limit is set or there is no cgroup cpu controller to read. Every path is
// read under `root` (tests pass a directory of fake files; "/" is the
// machine). InvalidArgument naming the file when a limit file is malformed.
absl::StatusOr<std::optional<CpuLimit>> ReadCpuLimit(const std::string& root = "/");

// Engine threads for a limit of `cpus`: floor(cpus), at least 1, at most
// `available` (the CPUs the process may run on). Rounding down: an OpenMP
// team waits at every barrier for its slowest thread, and one more thread
// than the quota covers gets throttled in every period.
int ThreadsForCpuLimit(double cpus, int available);

}  // namespace attnserve

#endif  // ATTNSERVE_SERVER_CPU_LIMIT_H_
