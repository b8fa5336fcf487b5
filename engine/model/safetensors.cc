// safetensors parsing: every length, offset and size in the header is checked
// against the file before a tensor byte is touched.
#include "engine/model/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstring>
#include <set>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "nlohmann/json.hpp"

namespace attnserve {
namespace {

// safetensors is little-endian on disk; the tensor bytes are used as they lie.
static_assert(std::endian::native == std::endian::little,
              "attnserve reads safetensors bytes in place and needs a little-endian host");

using Json = nlohmann::json;

absl::Status Corrupt(absl::string_view path, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat(path, ": ", what));
}

absl::Status TensorError(absl::string_view path, absl::string_view tensor, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat(path, ": tensor '", tensor, "': ", what));
}

// Dtypes the safetensors format defines; only the first three are loadable.
// Naming the rest lets the error say "unsupported" rather than "unknown".
constexpr std::string_view kKnownUnsupportedDTypes[] = {
    "F64", "I64", "I32", "I16", "I8", "U64", "U32", "U16", "U8", "BOOL",
    "F8_E4M3", "F8_E5M2", "F8_E8M0", "F6_E2M3", "F6_E3M2", "F4", "C64"};

absl::StatusOr<DType> ParseDType(absl::string_view path, absl::string_view tensor,
                                 const std::string& name) {
  if (name == "F32") return DType::kFloat32;
  if (name == "F16") return DType::kFloat16;
  if (name == "BF16") return DType::kBFloat16;
  bool known = std::find(std::begin(kKnownUnsupportedDTypes), std::end(kKnownUnsupportedDTypes),
                         name) != std::end(kKnownUnsupportedDTypes);
  return TensorError(path, tensor,
                     absl::StrCat(known ? "unsupported" : "unknown", " dtype \"", name,
                                  "\"; expected one of F32, F16, BF16"));
}

// A JSON value that must be a non-negative integer (shape dims, offsets).
absl::StatusOr<uint64_t> NonNegativeInt(absl::string_view path, absl::string_view tensor,
                                        absl::string_view field, const Json& value) {
  if (value.is_number_unsigned()) return value.get<uint64_t>();
  if (value.is_number_integer()) {
    return TensorError(path, tensor,
                       absl::StrCat(field, " holds ", value.get<int64_t>(),
                                    "; expected a non-negative integer"));
  }
  return TensorError(path, tensor,
                     absl::StrCat(field, " holds ", value.dump(),
                                  "; expected a non-negative integer"));
}

}  // namespace

const char* SafetensorsDTypeName(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return "F32";
    case DType::kFloat16: return "F16";
    case DType::kBFloat16: return "BF16";
    case DType::kBool: return "BOOL";
  }
  return "?";
}

absl::StatusOr<std::unique_ptr<SafetensorsFile>> SafetensorsFile::Open(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    int err = errno;
    std::string msg = absl::StrCat(path, ": cannot open: ", std::strerror(err));
    return err == ENOENT ? absl::NotFoundError(msg) : absl::InvalidArgumentError(msg);
  }
  struct stat st;
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    return Corrupt(path, "not a regular file");
  }
  std::unique_ptr<SafetensorsFile> file(new SafetensorsFile());
  file->path_ = path;
  file->file_size_ = static_cast<uint64_t>(st.st_size);
  if (file->file_size_ < 8) {
    ::close(fd);
    return Corrupt(path, absl::StrCat("truncated: the file is ", file->file_size_,
                                      " bytes, expected at least 8 (the header length)"));
  }
  void* mapped = ::mmap(nullptr, static_cast<size_t>(st.st_size), PROT_READ, MAP_PRIVATE, fd, 0);
  int err = errno;
  ::close(fd);  // the mapping keeps the file alive
  if (mapped == MAP_FAILED) {
    return Corrupt(path, absl::StrCat("mmap failed: ", std::strerror(err)));
  }
  file->mapped_ = mapped;
  file->mapped_size_ = static_cast<size_t>(st.st_size);
  file->file_bytes_ = static_cast<const unsigned char*>(mapped);
  if (absl::Status s = file->Parse(); !s.ok()) return s;
  return file;
}

absl::StatusOr<std::unique_ptr<SafetensorsFile>> SafetensorsFile::FromBytes(std::string_view bytes,
                                                                           std::string path) {
  std::unique_ptr<SafetensorsFile> file(new SafetensorsFile());
  file->path_ = std::move(path);
  file->owned_.assign(bytes.data(), bytes.size());
  file->file_bytes_ = reinterpret_cast<const unsigned char*>(file->owned_.data());
  file->file_size_ = file->owned_.size();
  if (file->file_size_ < 8) {
    return Corrupt(file->path_, absl::StrCat("truncated: the file is ", file->file_size_,
                                             " bytes, expected at least 8 (the header length)"));
  }
  if (absl::Status s = file->Parse(); !s.ok()) return s;
  return file;
}

SafetensorsFile::~SafetensorsFile() {
  if (mapped_ != nullptr) ::munmap(mapped_, mapped_size_);
}

absl::Status SafetensorsFile::Parse() {
  uint64_t header_len = 0;
  std::memcpy(&header_len, file_bytes_, 8);
  if (header_len > file_size_ - 8) {
    return Corrupt(path_, absl::StrCat("header length ", header_len,
                                       " exceeds the file: expected at most ", file_size_ - 8,
                                       " (file is ", file_size_, " bytes; truncated or corrupt)"));
  }
  if (header_len > kMaxSafetensorsHeaderBytes) {
    return Corrupt(path_, absl::StrCat("header length ", header_len, " exceeds the limit of ",
                                       kMaxSafetensorsHeaderBytes, " bytes"));
  }
  if (header_len < 2) {
    return Corrupt(path_, absl::StrCat("header length ", header_len,
                                       " is too short for a JSON object"));
  }
  const char* header = reinterpret_cast<const char*>(file_bytes_ + 8);
  data_section_ = file_bytes_ + 8 + header_len;
  const uint64_t data_size = file_size_ - 8 - header_len;

  // Duplicate names would let a header say two things about one tensor;
  // nlohmann keeps the last silently, so the parser callback tracks keys per
  // object.
  std::vector<std::set<std::string>> open_objects;
  std::string duplicate;
  auto callback = [&](int /*depth*/, Json::parse_event_t event, Json& parsed) {
    switch (event) {
      case Json::parse_event_t::object_start:
        open_objects.emplace_back();
        break;
      case Json::parse_event_t::object_end:
        if (!open_objects.empty()) open_objects.pop_back();
        break;
      case Json::parse_event_t::key:
        if (!open_objects.empty() && parsed.is_string() &&
            !open_objects.back().insert(parsed.get<std::string>()).second && duplicate.empty()) {
          duplicate = parsed.get<std::string>();
        }
        break;
      default:
        break;
    }
    return true;
  };
  Json root;
  try {
    root = Json::parse(header, header + header_len, callback);
  } catch (const Json::exception& e) {
    return Corrupt(path_, absl::StrCat("header is not valid JSON: ", e.what()));
  }
  if (!duplicate.empty()) {
    return Corrupt(path_, absl::StrCat("header names \"", duplicate, "\" more than once"));
  }
  if (!root.is_object()) {
    return Corrupt(path_, absl::StrCat("header is a JSON ", root.type_name(),
                                       "; expected an object"));
  }

  for (const auto& [name, info] : root.items()) {
    if (name == "__metadata__") {
      if (!info.is_object()) {
        return Corrupt(path_, "__metadata__ is not an object of strings");
      }
      for (const auto& [key, value] : info.items()) {
        if (!value.is_string()) {
          return Corrupt(path_, absl::StrCat("__metadata__ entry '", key, "' is a ",
                                             value.type_name(), "; expected a string"));
        }
        metadata_[key] = value.get<std::string>();
      }
      continue;
    }
    if (!info.is_object()) {
      return TensorError(path_, name, absl::StrCat("header entry is a ", info.type_name(),
                                                   "; expected an object"));
    }
    for (const char* field : {"dtype", "shape", "data_offsets"}) {
      if (!info.contains(field)) {
        return TensorError(path_, name, absl::StrCat("header entry lacks \"", field, "\""));
      }
    }
    SafetensorsEntry entry;
    entry.name = name;
    const Json& dtype = info["dtype"];
    if (!dtype.is_string()) {
      return TensorError(path_, name, absl::StrCat("dtype is ", dtype.dump(), "; expected a string"));
    }
    absl::StatusOr<DType> parsed_dtype = ParseDType(path_, name, dtype.get<std::string>());
    if (!parsed_dtype.ok()) return parsed_dtype.status();
    entry.dtype = *parsed_dtype;

    const Json& shape = info["shape"];
    if (!shape.is_array()) {
      return TensorError(path_, name, absl::StrCat("shape is ", shape.dump(), "; expected an array"));
    }
    uint64_t elements = 1;
    bool overflow = false;
    for (const Json& dim : shape) {
      absl::StatusOr<uint64_t> d = NonNegativeInt(path_, name, "shape", dim);
      if (!d.ok()) return d.status();
      if (*d > static_cast<uint64_t>(INT64_MAX)) overflow = true;
      entry.shape.push_back(static_cast<int64_t>(*d));
      overflow = overflow || __builtin_mul_overflow(elements, *d, &elements);
    }
    uint64_t bytes = 0;
    if (overflow || elements > static_cast<uint64_t>(INT64_MAX) ||
        __builtin_mul_overflow(elements, uint64_t{DTypeSize(entry.dtype)}, &bytes)) {
      return TensorError(path_, name, absl::StrCat("shape ", ShapeString(entry.shape),
                                                   " overflows 64-bit sizes"));
    }
    entry.num_elements = static_cast<int64_t>(elements);

    const Json& offsets = info["data_offsets"];
    if (!offsets.is_array() || offsets.size() != 2) {
      return TensorError(path_, name, absl::StrCat("data_offsets is ", offsets.dump(),
                                                   "; expected [begin, end]"));
    }
    absl::StatusOr<uint64_t> begin = NonNegativeInt(path_, name, "data_offsets", offsets[0]);
    if (!begin.ok()) return begin.status();
    absl::StatusOr<uint64_t> end = NonNegativeInt(path_, name, "data_offsets", offsets[1]);
    if (!end.ok()) return end.status();
    entry.begin = *begin;
    entry.end = *end;
    if (entry.begin > entry.end) {
      return TensorError(path_, name, absl::StrCat("data_offsets [", entry.begin, ", ", entry.end,
                                                   "]: begin exceeds end"));
    }
    if (entry.end > data_size) {
      return TensorError(path_, name,
                         absl::StrCat("data_offsets [", entry.begin, ", ", entry.end,
                                      "] end ", entry.end, " exceeds the data section of ",
                                      data_size, " bytes (file is ", file_size_,
                                      " bytes; truncated, or the header lies)"));
    }
    if (entry.end - entry.begin != bytes) {
      return TensorError(path_, name,
                         absl::StrCat("data_offsets [", entry.begin, ", ", entry.end, "] span ",
                                      entry.end - entry.begin, " bytes; expected ", bytes,
                                      " for dtype ", SafetensorsDTypeName(entry.dtype), " shape ",
                                      ShapeString(entry.shape)));
    }
    entries_.emplace(name, std::move(entry));
  }

  // Overlapping ranges mean the header describes bytes twice: corrupt.
  std::vector<const SafetensorsEntry*> by_offset;
  for (const auto& [name, entry] : entries_) {
    if (entry.end > entry.begin) by_offset.push_back(&entry);
  }
  std::sort(by_offset.begin(), by_offset.end(),
            [](const SafetensorsEntry* a, const SafetensorsEntry* b) { return a->begin < b->begin; });
  for (size_t i = 1; i < by_offset.size(); ++i) {
    const SafetensorsEntry& prev = *by_offset[i - 1];
    const SafetensorsEntry& cur = *by_offset[i];
    if (cur.begin < prev.end) {
      return TensorError(path_, cur.name,
                         absl::StrCat("data_offsets [", cur.begin, ", ", cur.end,
                                      "] overlap tensor '", prev.name, "' at [", prev.begin, ", ",
                                      prev.end, "]"));
    }
  }
  return absl::OkStatus();
}

const SafetensorsEntry* SafetensorsFile::Find(std::string_view name) const {
  auto it = entries_.find(name);
  return it == entries_.end() ? nullptr : &it->second;
}

std::vector<float> SafetensorsFile::ReadAsFloat(const SafetensorsEntry& entry) const {
  std::vector<float> out(static_cast<size_t>(entry.num_elements));
  const unsigned char* src = data(entry);
  // memcpy per element: the bytes need not be aligned inside the mapping.
  switch (entry.dtype) {
    case DType::kFloat32:
      if (!out.empty()) std::memcpy(out.data(), src, out.size() * sizeof(float));
      break;
    case DType::kFloat16:
    case DType::kBFloat16:
      for (size_t i = 0; i < out.size(); ++i) {
        uint16_t h;
        std::memcpy(&h, src + 2 * i, 2);
        out[i] = entry.dtype == DType::kFloat16 ? HalfToFloat(h) : BFloat16ToFloat(h);
      }
      break;
    case DType::kBool:
      break;  // never produced by Parse
  }
  return out;
}

}  // namespace attnserve
