// Registered POSIX shared-memory regions: shm_open + mmap, checked by fstat.
#include "server/transport/system_shared_memory.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"

namespace attnserve {

// The descriptor stays open so that every use can check the object's size
// (fstat) against the region.
class SystemSharedMemory::Mapping {
 public:
  Mapping(RegionStatus status, int fd, void* base, size_t length, char* data)
      : status_(std::move(status)), fd_(fd), base_(base), length_(length), data_(data) {}
  ~Mapping() {
    munmap(base_, length_);
    close(fd_);
  }
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;

  const RegionStatus& status() const { return status_; }
  char* data() const { return data_; }
  // The object's size now, or -1 with errno.
  int64_t ObjectSize() const {
    struct stat st;
    if (fstat(fd_, &st) != 0) return -1;
    return st.st_size;
  }

 private:
  const RegionStatus status_;
  const int fd_;
  void* const base_;     // page-aligned start of the mapping
  const size_t length_;  // of the mapping
  char* const data_;     // the region's first byte (base_ + offset's page remainder)
};

namespace {

std::string Errno(int e) { return std::strerror(e); }

}  // namespace

absl::Status SystemSharedMemory::Register(const std::string& name, const std::string& key,
                                          uint64_t offset, uint64_t byte_size) {
  if (name.empty()) return absl::InvalidArgumentError("name: must not be empty");
  if (key.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("shared memory region '", name, "': key must not be empty"));
  }
  if (byte_size == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("shared memory region '", name, "': byte_size must be > 0"));
  }
  if (offset > static_cast<uint64_t>(INT64_MAX) ||
      byte_size > static_cast<uint64_t>(INT64_MAX) - offset) {
    return absl::InvalidArgumentError(absl::StrCat("shared memory region '", name, "': offset ",
                                                   offset, " + byte_size ", byte_size,
                                                   " is not a valid range"));
  }
  {
    absl::MutexLock lock(&mu_);
    if (regions_.contains(name)) {
      return absl::AlreadyExistsError(absl::StrCat("shared memory region '", name,
                                                   "' is already registered; unregister it "
                                                   "first"));
    }
  }
  const int fd = shm_open(key.c_str(), O_RDWR | O_CLOEXEC, 0);
  if (fd < 0) {
    return absl::InvalidArgumentError(absl::StrCat("shared memory region '", name,
                                                   "': cannot open key '", key,
                                                   "' (shm_open: ", Errno(errno), ")"));
  }
  struct stat st;
  if (fstat(fd, &st) != 0) {
    const int e = errno;
    close(fd);
    return absl::InternalError(absl::StrCat("shared memory region '", name, "': fstat of key '",
                                            key, "': ", Errno(e)));
  }
  if (!S_ISREG(st.st_mode)) {
    close(fd);
    return absl::InvalidArgumentError(absl::StrCat("shared memory region '", name, "': key '",
                                                   key, "' is not a shared-memory object"));
  }
  if (static_cast<uint64_t>(st.st_size) < offset + byte_size) {
    close(fd);
    return absl::InvalidArgumentError(absl::StrCat(
        "shared memory region '", name, "': offset ", offset, " + byte_size ", byte_size,
        " runs past the end of key '", key, "' (", st.st_size, " bytes)"));
  }
  const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  const uint64_t start = offset / page * page;
  const size_t length = static_cast<size_t>(offset + byte_size - start);
  void* base = mmap(nullptr, length, PROT_READ | PROT_WRITE, MAP_SHARED, fd,
                    static_cast<off_t>(start));
  if (base == MAP_FAILED) {
    const int e = errno;
    close(fd);
    return absl::InvalidArgumentError(absl::StrCat("shared memory region '", name,
                                                   "': cannot map key '", key, "' (mmap: ",
                                                   Errno(e), ")"));
  }
  auto mapping = std::make_shared<const Mapping>(RegionStatus{name, key, offset, byte_size}, fd,
                                                 base, length,
                                                 static_cast<char*>(base) + (offset - start));
  absl::MutexLock lock(&mu_);
  // Checked again: another call may have registered the name meanwhile (the
  // mapping is undone by its destructor).
  if (regions_.contains(name)) {
    return absl::AlreadyExistsError(absl::StrCat("shared memory region '", name,
                                                 "' is already registered; unregister it "
                                                 "first"));
  }
  if (static_cast<int>(regions_.size()) >= kMaxRegions) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "shared memory region '", name, "': ", kMaxRegions,
        " regions are registered, the most this server keeps; unregister some first"));
  }
  regions_.emplace(name, std::move(mapping));
  return absl::OkStatus();
}

absl::Status SystemSharedMemory::Unregister(const std::string& name) {
  // Mappings are released outside the lock (munmap can take a while).
  std::map<std::string, std::shared_ptr<const Mapping>, std::less<>> released;
  absl::MutexLock lock(&mu_);
  if (name.empty()) {
    released.swap(regions_);
    return absl::OkStatus();
  }
  auto it = regions_.find(name);
  if (it == regions_.end()) {
    return absl::NotFoundError(
        absl::StrCat("shared memory region '", name, "' is not registered"));
  }
  released.insert(regions_.extract(it));
  return absl::OkStatus();
}

absl::StatusOr<std::vector<SystemSharedMemory::RegionStatus>> SystemSharedMemory::Status(
    const std::string& name) const {
  std::vector<RegionStatus> out;
  absl::MutexLock lock(&mu_);
  if (name.empty()) {
    for (const auto& [unused, mapping] : regions_) out.push_back(mapping->status());
    return out;
  }
  auto it = regions_.find(name);
  if (it == regions_.end()) {
    return absl::NotFoundError(
        absl::StrCat("shared memory region '", name, "' is not registered"));
  }
  out.push_back(it->second->status());
  return out;
}

absl::StatusOr<SystemSharedMemory::Span> SystemSharedMemory::Find(absl::string_view who,
                                                                  const std::string& name,
                                                                  int64_t offset,
                                                                  int64_t byte_size) const {
  std::shared_ptr<const Mapping> mapping;
  {
    absl::MutexLock lock(&mu_);
    auto it = regions_.find(name);
    if (it == regions_.end()) {
      return absl::InvalidArgumentError(absl::StrCat(
          who, ": shared memory region '", name,
          "' is not registered (SystemSharedMemoryRegister it first)"));
    }
    mapping = it->second;
  }
  const RegionStatus& region = mapping->status();
  if (offset < 0 || byte_size < 0 || static_cast<uint64_t>(offset) > region.byte_size ||
      static_cast<uint64_t>(byte_size) > region.byte_size - static_cast<uint64_t>(offset)) {
    return absl::InvalidArgumentError(absl::StrCat(
        who, ": shared_memory_offset ", offset, " + shared_memory_byte_size ", byte_size,
        " is outside shared memory region '", name, "' (", region.byte_size, " bytes)"));
  }
  const int64_t now = mapping->ObjectSize();
  if (now < 0 || static_cast<uint64_t>(now) < region.offset + region.byte_size) {
    return absl::FailedPreconditionError(absl::StrCat(
        who, ": shared memory region '", name, "': key '", region.key, "' is now ",
        now < 0 ? std::string("unreadable") : absl::StrCat(now, " bytes"),
        ", shorter than the region registered on it; register it again"));
  }
  Span span;
  span.data = mapping->data() + offset;
  span.size = static_cast<size_t>(byte_size);
  span.mapping = std::move(mapping);
  return span;
}

int SystemSharedMemory::size() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int>(regions_.size());
}

}  // namespace attnserve
