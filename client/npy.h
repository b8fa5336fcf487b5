// Reads and writes NumPy .npy files (format versions 1.0 to 3.0), so the sample
// client can take inputs from and hand outputs to NumPy/PyTorch users.
#ifndef ATTNSERVE_CLIENT_NPY_H_
#define ATTNSERVE_CLIENT_NPY_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace attnserve::client {

// A row-major (C order), little-endian array as stored in a .npy file.
struct NpyArray {
  // NumPy type string: "<f4", "<f2", "<u2" or "|b1" (the only ones the
  // attention API has a use for; "<u2" carries bfloat16 bits).
  std::string descr;
  std::vector<int64_t> shape;  // empty = a scalar
  std::string data;            // prod(shape) * itemsize bytes

  int64_t num_elements() const;
};

// Bytes per element of `descr`, or 0 if it is not one of the types above.
int NpyItemSize(const std::string& descr);

// Errors: NotFound (cannot open), InvalidArgument (not an .npy file, Fortran
// order, big-endian or unsupported type, truncated data).
absl::StatusOr<NpyArray> ReadNpy(const std::string& path);
// ReadNpy's parse of a file's bytes already in memory; `path` only labels
// the messages.
absl::StatusOr<NpyArray> ParseNpy(absl::string_view bytes, const std::string& path);
absl::Status WriteNpy(const std::string& path, const NpyArray& array);

}  // namespace attnserve::client

#endif  // ATTNSERVE_CLIENT_NPY_H_
