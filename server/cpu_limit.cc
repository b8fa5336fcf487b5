// cgroup v2 / v1 CPU quota lookup (see cpu_limit.h).
#include "server/cpu_limit.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <sstream>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace attnserve {
namespace {

// The file's contents, or nullopt when it cannot be opened.
std::optional<std::string> ReadFile(const std::string& path) {
  std::ifstream in(path);
  if (!in) return std::nullopt;
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

std::string UnderRoot(const std::string& root, const std::string& path) {
  if (root.empty() || root == "/") return path;
  return absl::StrCat(absl::StripSuffix(root, "/"), path);
}

struct Mount {
  std::string root;         // the part of the hierarchy mounted, e.g. "/" or "/docker/ID"
  std::string mount_point;  // e.g. "/sys/fs/cgroup/cpu,cpuacct"
  std::string fstype;       // "cgroup2" or "cgroup"
  std::vector<std::string> super_options;
};

// /proc/self/mountinfo: "ID PARENT MAJ:MIN ROOT MOUNT_POINT OPTS... - FSTYPE SOURCE SUPER_OPTS".
std::vector<Mount> CgroupMounts(const std::string& mountinfo) {
  std::vector<Mount> mounts;
  for (absl::string_view line : absl::StrSplit(mountinfo, '\n', absl::SkipEmpty())) {
    std::vector<std::string> halves = absl::StrSplit(line, " - ");
    if (halves.size() != 2) continue;
    std::vector<std::string> left = absl::StrSplit(halves[0], ' ', absl::SkipEmpty());
    std::vector<std::string> right = absl::StrSplit(halves[1], ' ', absl::SkipEmpty());
    if (left.size() < 5 || right.size() < 3) continue;
    if (right[0] != "cgroup2" && right[0] != "cgroup") continue;
    mounts.push_back({left[3], left[4], right[0], absl::StrSplit(right[2], ',')});
  }
  return mounts;
}

// The directories to read for `cgroup_path` under `mount`: the process's own
// cgroup and each ancestor up to the mount point.
std::vector<std::string> CgroupDirs(const std::string& root, const Mount& mount,
                                    const std::string& cgroup_path) {
  std::string rel = cgroup_path;
  if (mount.root != "/" && absl::StartsWith(rel, mount.root)) rel = rel.substr(mount.root.size());
  if (!absl::StartsWith(rel, "/")) rel = "/" + rel;
  std::vector<std::string> dirs;
  while (true) {
    dirs.push_back(UnderRoot(root, absl::StrCat(absl::StripSuffix(mount.mount_point, "/"),
                                                rel == "/" ? "" : rel)));
    if (rel == "/" || rel.empty()) break;
    rel = rel.substr(0, rel.rfind('/'));
    if (rel.empty()) rel = "/";
  }
  return dirs;
}

absl::Status Malformed(const std::string& path, absl::string_view text, absl::string_view rule) {
  return absl::InvalidArgumentError(absl::StrCat(path, ": expected ", rule, ", got \"",
                                                 absl::StripAsciiWhitespace(text), "\""));
}

// cpu.max: "max PERIOD" (no limit) or "QUOTA PERIOD", in microseconds.
absl::StatusOr<std::optional<double>> ReadCpuMax(const std::string& path, bool* found) {
  std::optional<std::string> text = ReadFile(path);
  if (!text) return std::nullopt;
  *found = true;
  std::vector<absl::string_view> fields =
      absl::StrSplit(absl::StripAsciiWhitespace(*text), ' ', absl::SkipEmpty());
  int64_t quota = 0, period = 0;
  if (fields.size() != 2 || !absl::SimpleAtoi(fields[1], &period) || period <= 0 ||
      (fields[0] != "max" && (!absl::SimpleAtoi(fields[0], &quota) || quota <= 0))) {
    return Malformed(path, *text, "\"max PERIOD\" or \"QUOTA PERIOD\" (positive integers)");
  }
  if (fields[0] == "max") return std::nullopt;
  return static_cast<double>(quota) / static_cast<double>(period);
}

// cpu.cfs_quota_us (-1 = no limit) and cpu.cfs_period_us, in microseconds.
absl::StatusOr<std::optional<double>> ReadCfsQuota(const std::string& dir, bool* found) {
  const std::string quota_path = dir + "/cpu.cfs_quota_us";
  const std::string period_path = dir + "/cpu.cfs_period_us";
  std::optional<std::string> quota_text = ReadFile(quota_path);
  if (!quota_text) return std::nullopt;
  *found = true;
  int64_t quota = 0;
  if (!absl::SimpleAtoi(absl::StripAsciiWhitespace(*quota_text), &quota) || quota == 0 ||
      quota < -1) {
    return Malformed(quota_path, *quota_text, "-1 or a positive integer");
  }
  if (quota == -1) return std::nullopt;
  std::optional<std::string> period_text = ReadFile(period_path);
  int64_t period = 0;
  if (!period_text || !absl::SimpleAtoi(absl::StripAsciiWhitespace(*period_text), &period) ||
      period <= 0) {
    return Malformed(period_path, period_text.value_or(""), "a positive integer");
  }
  return static_cast<double>(quota) / static_cast<double>(period);
}

}  // namespace

absl::StatusOr<std::optional<CpuLimit>> ReadCpuLimit(const std::string& root) {
  std::optional<std::string> cgroups = ReadFile(UnderRoot(root, "/proc/self/cgroup"));
  std::optional<std::string> mountinfo = ReadFile(UnderRoot(root, "/proc/self/mountinfo"));
  if (!cgroups || !mountinfo) return std::nullopt;  // not Linux, or no /proc
  const std::vector<Mount> mounts = CgroupMounts(*mountinfo);

  // "HIERARCHY:CONTROLLERS:PATH"; v2 is hierarchy 0 with no controllers.
  std::optional<std::string> v2_path, v1_cpu_path;
  for (absl::string_view line : absl::StrSplit(*cgroups, '\n', absl::SkipEmpty())) {
    std::vector<std::string> f = absl::StrSplit(line, absl::MaxSplits(':', 2));
    if (f.size() != 3) continue;
    if (f[0] == "0" && f[1].empty()) v2_path = f[2];
    for (absl::string_view c : absl::StrSplit(f[1], ',')) {
      if (c == "cpu") v1_cpu_path = f[2];
    }
  }

  std::optional<CpuLimit> best;
  auto consider = [&best](std::optional<double> cpus, const std::string& source) {
    if (cpus && (!best || *cpus < best->cpus)) best = CpuLimit{*cpus, source};
  };
  // v2 first: on a hybrid host the v2 hierarchy may lack the cpu controller
  // (no cpu.max anywhere), and then v1 holds the quota.
  bool found_v2 = false;
  if (v2_path) {
    for (const Mount& m : mounts) {
      if (m.fstype != "cgroup2") continue;
      for (const std::string& dir : CgroupDirs(root, m, *v2_path)) {
        const std::string path = dir + "/cpu.max";
        absl::StatusOr<std::optional<double>> cpus = ReadCpuMax(path, &found_v2);
        if (!cpus.ok()) return cpus.status();
        consider(*cpus, path);
      }
    }
  }
  if (found_v2) return best;
  if (v1_cpu_path) {
    for (const Mount& m : mounts) {
      if (m.fstype != "cgroup" ||
          std::find(m.super_options.begin(), m.super_options.end(), "cpu") ==
              m.super_options.end()) {
        continue;
      }
      bool found_v1 = false;
      for (const std::string& dir : CgroupDirs(root, m, *v1_cpu_path)) {
        absl::StatusOr<std::optional<double>> cpus = ReadCfsQuota(dir, &found_v1);
        if (!cpus.ok()) return cpus.status();
        consider(*cpus, dir + "/cpu.cfs_quota_us");
      }
    }
  }
  return best;
}

int ThreadsForCpuLimit(double cpus, int available) {
  const int threads = std::max(1, static_cast<int>(std::floor(cpus + 1e-9)));
  return available > 0 ? std::min(threads, available) : threads;
}

}  // namespace attnserve
