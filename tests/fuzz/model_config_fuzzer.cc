// Fuzz target: the model repository loader (LoadModelFolder, the function
// --model-repository runs per folder) on one folder written from the input:
// the bytes up to a line "#--weights--" are config.pbtxt, the rest (if any)
// weights.safetensors. Aborts on a crash or sanitizer report, on a failed
// load without a reason, or on a loaded model whose layer check fails.
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <string_view>

#include "engine/attention_layer.h"
#include "server/models/model_repository.h"

namespace attnserve {
namespace {

[[noreturn]] void Fail(const std::string& what) {
  std::fprintf(stderr, "model_config_fuzzer: %s\n", what.c_str());
  std::abort();
}

constexpr std::string_view kSeparator = "\n#--weights--\n";

void WriteFile(const std::filesystem::path& path, std::string_view bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  if (!out) Fail("cannot write " + path.string());
}

// A folder of this process's own under $TMPDIR (tmpfs in CI is fastest).
const std::filesystem::path& Folder() {
  static const std::filesystem::path* folder = [] {
    const char* tmp = std::getenv("TMPDIR");
    auto* p = new std::filesystem::path(std::filesystem::path(tmp ? tmp : "/tmp") /
                                        ("attnserve-fuzz-" + std::to_string(getpid())) /
                                        "model");
    std::filesystem::create_directories(*p);
    std::atexit([] {
      std::error_code ec;
      std::filesystem::remove_all(Folder().parent_path(), ec);
    });
    return p;
  }();
  return *folder;
}

void RunOne(const uint8_t* data, size_t size) {
  const std::string_view input(reinterpret_cast<const char*>(data), size);
  const size_t cut = input.find(kSeparator);
  const std::filesystem::path& folder = Folder();
  std::error_code ec;
  WriteFile(folder / "config.pbtxt", input.substr(0, cut));
  if (cut == std::string_view::npos) {
    std::filesystem::remove(folder / "weights.safetensors", ec);
  } else {
    WriteFile(folder / "weights.safetensors", input.substr(cut + kSeparator.size()));
  }
  const RepositoryModel model = LoadModelFolder(folder.string());
  if (!model.status.ok()) {
    if (model.status.message().empty()) Fail("failed without a reason");
    if (model.layer != nullptr) Fail("failed but carries a layer");
    return;
  }
  if (model.layer == nullptr) Fail("loaded without a layer");
  if (absl::Status s = ValidateLayer(*model.layer); !s.ok()) {
    Fail("loaded a layer its check refuses: " + s.ToString());
  }
  (void)MeasureWeightBounds(model.layer->weights);
}

}  // namespace
}  // namespace attnserve

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  attnserve::RunOne(data, size);
  return 0;
}
