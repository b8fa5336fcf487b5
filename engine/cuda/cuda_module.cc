// The module's only exported symbol: the factory that cuda_loader.cc finds
// with dlsym. Everything else in libattnserve_cuda.so has hidden visibility.
#include <cstdio>
#include <string>
#include <type_traits>

#include "engine/cuda/cuda_engine.h"
#include "engine/cuda/cuda_module_abi.h"

extern "C" __attribute__((visibility("default"))) attnserve::AttentionEngine*
attnserve_cuda_create_engine_v2(const attnserve::EngineOptions* options, char* error,
                                size_t error_size) {
  absl::StatusOr<std::unique_ptr<attnserve::AttentionEngine>> engine =
      attnserve::cuda::NewCudaEngine(options != nullptr ? *options : attnserve::EngineOptions{});
  if (!engine.ok()) {
    if (error != nullptr && error_size > 0) {
      std::snprintf(error, error_size, "%s", std::string(engine.status().message()).c_str());
    }
    return nullptr;
  }
  return engine->release();
}

// The entry point has exactly the type the loader calls it through.
static_assert(std::is_same_v<decltype(&attnserve_cuda_create_engine_v2), AttnserveCudaFactory>);
