// Fuzz target: bytes as a .npy file through attn_client's reader (ParseNpy,
// what ReadNpy runs on a file's contents). Aborts on a crash or sanitizer
// report, an error without a message, or an accepted array whose data size
// disagrees with its shape and dtype.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "absl/strings/string_view.h"
#include "client/npy.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using attnserve::client::NpyArray;
  absl::StatusOr<NpyArray> array = attnserve::client::ParseNpy(
      absl::string_view(reinterpret_cast<const char*>(data), size), "input.npy");
  if (!array.ok()) {
    if (array.status().message().empty()) {
      std::fprintf(stderr, "npy_fuzzer: refused without a message\n");
      std::abort();
    }
    return 0;
  }
  // num_elements() multiplies left to right in int64: no partial product of
  // an accepted shape may overflow (checked here without relying on UBSan,
  // so the ordinary build's replay catches it too).
  int64_t n = 1;
  for (int64_t d : array->shape) {
    if (__builtin_mul_overflow(n, d, &n)) {
      std::fprintf(stderr, "npy_fuzzer: accepted a shape whose element count overflows int64\n");
      std::abort();
    }
  }
  const int item = attnserve::client::NpyItemSize(array->descr);
  if (item == 0 || array->data.size() != static_cast<size_t>(array->num_elements()) * item ||
      array->data.size() > size) {
    std::fprintf(stderr, "npy_fuzzer: accepted '%s' with %zu data bytes for %lld elements\n",
                 array->descr.c_str(), array->data.size(),
                 static_cast<long long>(array->num_elements()));
    std::abort();
  }
  return 0;
}
