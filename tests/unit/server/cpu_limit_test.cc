// ReadCpuLimit against fake /proc and cgroup trees (v2, v1, hybrid, nested
// limits, malformed files) and the thread rule.
#include "server/cpu_limit.h"

#include <filesystem>
#include <fstream>
#include <string>

#include <unistd.h>

#include "gtest/gtest.h"

namespace attnserve {
namespace {

namespace fs = std::filesystem;

class FakeRoot {
 public:
  FakeRoot() {
    const ::testing::TestInfo* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ = fs::temp_directory_path() /
           (std::string("cpu_limit_test_") + info->name() + "_" + std::to_string(getpid()));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  ~FakeRoot() { fs::remove_all(dir_); }
  void Write(const std::string& path, const std::string& text) {
    const fs::path p = dir_ / path.substr(1);
    fs::create_directories(p.parent_path());
    std::ofstream(p) << text;
  }
  std::string root() const { return dir_.string(); }

 private:
  fs::path dir_;
};

constexpr char kV2Mountinfo[] =
    "24 30 0:22 / /proc rw,nosuid - proc proc rw\n"
    "35 24 0:30 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime - cgroup2 cgroup2 "
    "rw,nsdelegate\n";

// A container with its own cgroup namespace: it sees its cgroup as "/".
TEST(ReadCpuLimitTest, CgroupV2QuotaOverPeriod) {
  FakeRoot r;
  r.Write("/proc/self/cgroup", "0::/\n");
  r.Write("/proc/self/mountinfo", kV2Mountinfo);
  r.Write("/sys/fs/cgroup/cpu.max", "150000 100000\n");
  absl::StatusOr<std::optional<CpuLimit>> limit = ReadCpuLimit(r.root());
  ASSERT_TRUE(limit.ok()) << limit.status();
  ASSERT_TRUE(limit->has_value());
  EXPECT_DOUBLE_EQ((*limit)->cpus, 1.5);
  EXPECT_EQ((*limit)->source, r.root() + "/sys/fs/cgroup/cpu.max");
}

TEST(ReadCpuLimitTest, CgroupV2MaxIsNoLimit) {
  FakeRoot r;
  r.Write("/proc/self/cgroup", "0::/\n");
  r.Write("/proc/self/mountinfo", kV2Mountinfo);
  r.Write("/sys/fs/cgroup/cpu.max", "max 100000\n");
  absl::StatusOr<std::optional<CpuLimit>> limit = ReadCpuLimit(r.root());
  ASSERT_TRUE(limit.ok()) << limit.status();
  EXPECT_FALSE(limit->has_value());
}

// Without a cgroup namespace the process sees the whole tree: a pod-level
// parent may hold a smaller limit than the container's own cgroup.
TEST(ReadCpuLimitTest, CgroupV2SmallestLimitOfTheCgroupAndItsAncestors) {
  FakeRoot r;
  r.Write("/proc/self/cgroup", "0::/kubepods/pod1/ctr\n");
  r.Write("/proc/self/mountinfo", kV2Mountinfo);
  r.Write("/sys/fs/cgroup/cpu.max", "max 100000\n");
  r.Write("/sys/fs/cgroup/kubepods/cpu.max", "max 100000\n");
  r.Write("/sys/fs/cgroup/kubepods/pod1/cpu.max", "200000 100000\n");
  r.Write("/sys/fs/cgroup/kubepods/pod1/ctr/cpu.max", "400000 100000\n");
  absl::StatusOr<std::optional<CpuLimit>> limit = ReadCpuLimit(r.root());
  ASSERT_TRUE(limit.ok()) << limit.status();
  ASSERT_TRUE(limit->has_value());
  EXPECT_DOUBLE_EQ((*limit)->cpus, 2.0);
  EXPECT_EQ((*limit)->source, r.root() + "/sys/fs/cgroup/kubepods/pod1/cpu.max");
}

// Docker on a cgroup v1 host (this development machine's kind): the cpu
// hierarchy is mounted at the container's own cgroup.
TEST(ReadCpuLimitTest, CgroupV1CfsQuotaAndPeriod) {
  FakeRoot r;
  r.Write("/proc/self/cgroup",
          "12:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc\n1:name=systemd:/docker/abc\n");
  r.Write("/proc/self/mountinfo",
          "40 31 0:33 /docker/abc /sys/fs/cgroup/cpu,cpuacct ro,nosuid - cgroup cgroup "
          "rw,cpu,cpuacct\n"
          "41 31 0:34 /docker/abc /sys/fs/cgroup/memory ro,nosuid - cgroup cgroup rw,memory\n");
  r.Write("/sys/fs/cgroup/cpu,cpuacct/cpu.cfs_quota_us", "250000\n");
  r.Write("/sys/fs/cgroup/cpu,cpuacct/cpu.cfs_period_us", "100000\n");
  absl::StatusOr<std::optional<CpuLimit>> limit = ReadCpuLimit(r.root());
  ASSERT_TRUE(limit.ok()) << limit.status();
  ASSERT_TRUE(limit->has_value());
  EXPECT_DOUBLE_EQ((*limit)->cpus, 2.5);
  EXPECT_EQ((*limit)->source, r.root() + "/sys/fs/cgroup/cpu,cpuacct/cpu.cfs_quota_us");
}

TEST(ReadCpuLimitTest, CgroupV1MinusOneIsNoLimit) {
  FakeRoot r;
  r.Write("/proc/self/cgroup", "1:cpu:/\n");
  r.Write("/proc/self/mountinfo",
          "32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu\n");
  r.Write("/sys/fs/cgroup/cpu/cpu.cfs_quota_us", "-1\n");
  r.Write("/sys/fs/cgroup/cpu/cpu.cfs_period_us", "100000\n");
  absl::StatusOr<std::optional<CpuLimit>> limit = ReadCpuLimit(r.root());
  ASSERT_TRUE(limit.ok()) << limit.status();
  EXPECT_FALSE(limit->has_value());
}

// Hybrid host: a v2 hierarchy without the cpu controller, the quota in v1.
TEST(ReadCpuLimitTest, HybridFallsBackToV1WhenV2HasNoCpuController) {
  FakeRoot r;
  r.Write("/proc/self/cgroup", "3:cpu,cpuacct:/\n0::/\n");
  r.Write("/proc/self/mountinfo",
          "35 31 0:30 / /sys/fs/cgroup/unified rw - cgroup2 cgroup2 rw\n"
          "36 31 0:31 / /sys/fs/cgroup/cpu,cpuacct rw - cgroup cgroup rw,cpu,cpuacct\n");
  r.Write("/sys/fs/cgroup/unified/cgroup.procs", "1\n");
  r.Write("/sys/fs/cgroup/cpu,cpuacct/cpu.cfs_quota_us", "50000\n");
  r.Write("/sys/fs/cgroup/cpu,cpuacct/cpu.cfs_period_us", "100000\n");
  absl::StatusOr<std::optional<CpuLimit>> limit = ReadCpuLimit(r.root());
  ASSERT_TRUE(limit.ok()) << limit.status();
  ASSERT_TRUE(limit->has_value());
  EXPECT_DOUBLE_EQ((*limit)->cpus, 0.5);
}

TEST(ReadCpuLimitTest, NoCgroupFilesMeansNoLimit) {
  FakeRoot r;
  absl::StatusOr<std::optional<CpuLimit>> limit = ReadCpuLimit(r.root());
  ASSERT_TRUE(limit.ok()) << limit.status();
  EXPECT_FALSE(limit->has_value());
}

TEST(ReadCpuLimitTest, MalformedFileIsAnErrorNamingIt) {
  FakeRoot r;
  r.Write("/proc/self/cgroup", "0::/\n");
  r.Write("/proc/self/mountinfo", kV2Mountinfo);
  r.Write("/sys/fs/cgroup/cpu.max", "lots\n");
  absl::StatusOr<std::optional<CpuLimit>> limit = ReadCpuLimit(r.root());
  ASSERT_FALSE(limit.ok());
  EXPECT_EQ(limit.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(limit.status().message().find("/sys/fs/cgroup/cpu.max"), std::string::npos)
      << limit.status();
  EXPECT_NE(limit.status().message().find("\"lots\""), std::string::npos) << limit.status();
}

// The machine running the test: whatever it has, the call succeeds.
TEST(ReadCpuLimitTest, ThisMachineReads) {
  absl::StatusOr<std::optional<CpuLimit>> limit = ReadCpuLimit();
  ASSERT_TRUE(limit.ok()) << limit.status();
  if (limit->has_value()) {
    EXPECT_GT((*limit)->cpus, 0);
  }
}

TEST(ThreadsForCpuLimitTest, RoundsDownAtLeastOneAtMostAvailable) {
  EXPECT_EQ(ThreadsForCpuLimit(0.5, 16), 1);
  EXPECT_EQ(ThreadsForCpuLimit(1.0, 16), 1);
  EXPECT_EQ(ThreadsForCpuLimit(1.5, 16), 1);
  EXPECT_EQ(ThreadsForCpuLimit(2.0, 16), 2);
  EXPECT_EQ(ThreadsForCpuLimit(3.99, 16), 3);
  EXPECT_EQ(ThreadsForCpuLimit(8.0, 4), 4);
  EXPECT_EQ(ThreadsForCpuLimit(2.0, 0), 2);
}

}  // namespace
}  // namespace attnserve
