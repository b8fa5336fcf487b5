// Read-only access to a .safetensors file (8-byte little-endian header length,
// a JSON header, then raw tensor bytes), checked against the file before use.
#ifndef ATTNSERVE_ENGINE_MODEL_SAFETENSORS_H_
#define ATTNSERVE_ENGINE_MODEL_SAFETENSORS_H_

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/tensor.h"

namespace attnserve {

// One tensor of the file as its header describes it, after every check.
struct SafetensorsEntry {
  std::string name;
  DType dtype = DType::kFloat32;  // FLOAT32, FLOAT16 or BFLOAT16
  Shape shape;                    // may be empty (a scalar) or hold zeros
  int64_t num_elements = 0;
  // Byte range inside the data section (after the header), as the header
  // says: end - begin == num_elements * DTypeSize(dtype).
  uint64_t begin = 0;
  uint64_t end = 0;
};

// The header never exceeds this many bytes (the limit of the reference
// implementation); a larger length is a corrupt or hostile file.
inline constexpr uint64_t kMaxSafetensorsHeaderBytes = uint64_t{100} << 20;

// A parsed, validated safetensors file. The tensor bytes are memory-mapped
// (read-only) for the lifetime of the object, so views stay valid until it is
// destroyed. Immutable after Open: every const method is thread-safe.
//
// Open checks, before any tensor byte is read:
//   - the file holds at least 8 bytes and the header length fits in the file
//     and under kMaxSafetensorsHeaderBytes;
//   - the header is a JSON object without duplicate names; each tensor has
//     "dtype" (F32, F16 or BF16; other dtypes are rejected by name), "shape"
//     (non-negative ints) and "data_offsets" [begin, end];
//   - begin <= end <= size of the data section, end - begin equals
//     prod(shape) * element size (no overflow), and no two tensors overlap.
// Every error names the file, the tensor and the expected vs actual value.
class SafetensorsFile {
 public:
  static absl::StatusOr<std::unique_ptr<SafetensorsFile>> Open(const std::string& path);
  // Parses bytes already in memory (copied); `path` only labels messages.
  static absl::StatusOr<std::unique_ptr<SafetensorsFile>> FromBytes(std::string_view bytes,
                                                                   std::string path);

  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::string& path() const { return path_; }
  // Tensors ordered by name.
  const std::map<std::string, SafetensorsEntry, std::less<>>& entries() const { return entries_; }
  // nullptr when absent.
  const SafetensorsEntry* Find(std::string_view name) const;
  // The "__metadata__" string map (empty when absent).
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

  // The raw bytes of a tensor (little-endian; not necessarily aligned).
  const unsigned char* data(const SafetensorsEntry& entry) const {
    return data_section_ + entry.begin;
  }
  // The tensor converted to float32 (exact for F16 and BF16).
  std::vector<float> ReadAsFloat(const SafetensorsEntry& entry) const;

 private:
  SafetensorsFile() = default;
  absl::Status Parse();

  std::string path_;
  // Either a mapping (mapped_ / mapped_size_) or an owned copy (owned_).
  void* mapped_ = nullptr;
  size_t mapped_size_ = 0;
  std::string owned_;
  const unsigned char* file_bytes_ = nullptr;
  uint64_t file_size_ = 0;
  const unsigned char* data_section_ = nullptr;
  std::map<std::string, SafetensorsEntry, std::less<>> entries_;
  std::map<std::string, std::string> metadata_;
};

// "F32", "F16", "BF16" (the safetensors dtype names).
const char* SafetensorsDTypeName(DType dtype);

}  // namespace attnserve

#endif  // ATTNSERVE_ENGINE_MODEL_SAFETENSORS_H_
