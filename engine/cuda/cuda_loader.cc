// dlopen of libattnserve_cuda.so and a call of its factory. Compiled into
// attnserve_engine whether or not CUDA is built, so the search and its
// error messages behave the same everywhere.
#include "engine/cuda/cuda_loader.h"

#include <dlfcn.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "engine/cuda/cuda_module_abi.h"

#ifndef ATTNSERVE_CUDA_MODULE_BUILD_PATH
#define ATTNSERVE_CUDA_MODULE_BUILD_PATH ""
#endif

namespace attnserve {
namespace {

bool IsFile(const std::string& path) { return access(path.c_str(), F_OK) == 0; }

std::string ExecutableDir() {
  std::string path(4096, '\0');
  const ssize_t n = readlink("/proc/self/exe", path.data(), path.size());
  if (n <= 0 || static_cast<size_t>(n) >= path.size()) return "";
  path.resize(static_cast<size_t>(n));
  const size_t slash = path.rfind('/');
  return slash == std::string::npos ? "" : path.substr(0, slash);
}

// The outcome of the one search per process: a factory, or why there is none.
struct Module {
  AttnserveCudaFactory factory = nullptr;
  std::string error;
};

// dlopen of `what` (a path, or a bare name for the loader's search). On
// failure appends to `tried` and returns null.
void* Open(const std::string& what, std::vector<std::string>& tried) {
  void* handle = dlopen(what.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) {
    const char* reason = dlerror();
    tried.push_back(absl::StrCat(what, ": ", reason != nullptr ? reason : "dlopen failed"));
  }
  return handle;
}

Module FindModule() {
  Module module;
  std::vector<std::string> tried;
  void* handle = nullptr;

  // Explicit paths that do not exist are skipped quietly; one that exists
  // but fails to load (missing libcudart, wrong architecture) is an error
  // worth reporting, so it stays in `tried`.
  std::vector<std::string> paths;
  if (const std::string dir = ExecutableDir(); !dir.empty()) {
    paths.push_back(absl::StrCat(dir, "/", ATTNSERVE_CUDA_MODULE_NAME));
  }
  if (const char* env = std::getenv("ATTNSERVE_CUDA_MODULE"); env != nullptr && *env != '\0') {
    std::string path = env;
    struct stat st {};
    if (stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode)) {
      path = absl::StrCat(path, "/", ATTNSERVE_CUDA_MODULE_NAME);
    }
    if (!IsFile(path)) {
      tried.push_back(absl::StrCat(path, " (from $ATTNSERVE_CUDA_MODULE): no such file"));
    }
    paths.push_back(path);
  }
  for (const std::string& path : paths) {
    if (!IsFile(path)) continue;
    if ((handle = Open(path, tried)) != nullptr) break;
  }
  if (handle == nullptr) handle = Open(ATTNSERVE_CUDA_MODULE_NAME, tried);
  if (handle == nullptr && IsFile(ATTNSERVE_CUDA_MODULE_BUILD_PATH)) {
    handle = Open(ATTNSERVE_CUDA_MODULE_BUILD_PATH, tried);
  }
  if (handle == nullptr) {
    module.error = absl::StrCat(
        "CUDA module ", ATTNSERVE_CUDA_MODULE_NAME, " could not be loaded",
        *ATTNSERVE_CUDA_MODULE_BUILD_PATH == '\0' ? " (this build has no CUDA backend)" : "",
        "; tried: ", absl::StrJoin(tried, "; "));
    return module;
  }
  // Never dlclose: engines made by the module hold code and vtables in it.
  void* symbol = dlsym(handle, ATTNSERVE_CUDA_FACTORY_SYMBOL);
  if (symbol == nullptr) {
    module.error =
        absl::StrCat("CUDA module ", ATTNSERVE_CUDA_MODULE_NAME, " has no ",
                     ATTNSERVE_CUDA_FACTORY_SYMBOL, " (built from a different attnserve version?)");
    return module;
  }
  module.factory = reinterpret_cast<AttnserveCudaFactory>(symbol);
  return module;
}

const Module& GetModule() {
  static const Module* module = new Module(FindModule());
  return *module;
}

}  // namespace

absl::StatusOr<std::unique_ptr<AttentionEngine>> LoadCudaEngine(const EngineOptions& options) {
  const Module& module = GetModule();
  if (module.factory == nullptr) return absl::UnavailableError(module.error);
  char error[1024] = {0};
  AttentionEngine* engine = module.factory(&options, error, sizeof(error));
  if (engine == nullptr) {
    return absl::UnavailableError(error[0] != '\0' ? error : "CUDA backend: no usable GPU");
  }
  return std::unique_ptr<AttentionEngine>(engine);
}

std::string_view CudaModuleBuildPath() { return ATTNSERVE_CUDA_MODULE_BUILD_PATH; }

}  // namespace attnserve
