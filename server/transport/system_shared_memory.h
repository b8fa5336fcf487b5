// Triton's system shared-memory extension (KServe v2, both protocols): a
// client on the server's host writes tensors into a POSIX shared-memory
// object (shm_open), registers a byte range of it under a name, and names
// the region in an input's or requested output's parameters
// (shared_memory_region, shared_memory_byte_size, shared_memory_offset)
// instead of sending the bytes. The engine reads such inputs and writes such
// outputs in place: no copy on either side.
//
// This class is the server's table of registered regions; the front ends
// (kserve_core.h) decide who may use it (--allow-client-shm, tokens).
//
// What mapping a client's memory means for the server: the client can
// change the bytes while a request reads them (its own answer is then
// undefined, nobody else's), and a client that shrinks the object under a
// registered region makes the server's next access to the lost pages fault
// (SIGBUS). Every use checks that the object still covers the region, which
// leaves only a shrink during the request itself; so the extension is off
// unless the operator turns it on, for clients the operator trusts
// (docs/SECURITY.md).
#ifndef ATTNSERVE_SERVER_TRANSPORT_SYSTEM_SHARED_MEMORY_H_
#define ATTNSERVE_SERVER_TRANSPORT_SYSTEM_SHARED_MEMORY_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"

namespace attnserve {

// Thread-safe.
class SystemSharedMemory {
 public:
  // At most this many regions at once (each holds a descriptor and a
  // mapping).
  static constexpr int kMaxRegions = 1024;

  struct RegionStatus {
    std::string name;
    std::string key;
    uint64_t offset = 0;
    uint64_t byte_size = 0;
  };

  // One registered mapping; unmapped when the region is unregistered and no
  // request holds it any more.
  class Mapping;

  // Bytes of a region, valid while `mapping` is held.
  struct Span {
    std::shared_ptr<const Mapping> mapping;
    char* data = nullptr;
    size_t size = 0;
  };

  SystemSharedMemory() = default;
  SystemSharedMemory(const SystemSharedMemory&) = delete;
  SystemSharedMemory& operator=(const SystemSharedMemory&) = delete;

  // Maps bytes [offset, offset + byte_size) of the shared-memory object
  // `key` (as shm_open names it) read-write under `name`. InvalidArgument:
  // an empty name, byte_size 0, a range past the object's end, a key
  // shm_open cannot open (with its error); AlreadyExists: `name` is
  // registered (unregister it first, as Triton asks); ResourceExhausted:
  // kMaxRegions.
  absl::Status Register(const std::string& name, const std::string& key, uint64_t offset,
                        uint64_t byte_size);

  // Unregisters region `name`, or every region when `name` is empty.
  // Requests that use a region keep its bytes until they are answered.
  // NotFound: no region `name`.
  absl::Status Unregister(const std::string& name);

  // Region `name`, or every region (by name) when `name` is empty.
  // NotFound: no region `name`.
  absl::StatusOr<std::vector<RegionStatus>> Status(const std::string& name) const;

  // Bytes [offset, offset + byte_size) of region `name`, for the tensor
  // `who` names in errors. InvalidArgument: no region `name` (not
  // registered), a range outside the region; FailedPrecondition: the
  // object no longer covers the region (it was shrunk since it was
  // registered).
  absl::StatusOr<Span> Find(absl::string_view who, const std::string& name, int64_t offset,
                            int64_t byte_size) const;

  int size() const;

 private:
  mutable absl::Mutex mu_;
  std::map<std::string, std::shared_ptr<const Mapping>, std::less<>> regions_ ABSL_GUARDED_BY(mu_);
};

}  // namespace attnserve

#endif  // ATTNSERVE_SERVER_TRANSPORT_SYSTEM_SHARED_MEMORY_H_
