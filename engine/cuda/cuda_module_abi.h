// The contract between the engine library (cuda_loader.cc) and the module
// libattnserve_cuda.so (cuda_module.cc): one C entry point, versioned by its
// name. Bump the version whenever AttentionEngine or EngineOptions change
// layout, so that a stale module is refused rather than misused.
#ifndef ATTNSERVE_ENGINE_CUDA_CUDA_MODULE_ABI_H_
#define ATTNSERVE_ENGINE_CUDA_CUDA_MODULE_ABI_H_

#include <cstddef>

#include "engine/attention_engine.h"

// File name of the module.
#define ATTNSERVE_CUDA_MODULE_NAME "libattnserve_cuda.so"
// Name of the entry point.
#define ATTNSERVE_CUDA_FACTORY_SYMBOL "attnserve_cuda_create_engine_v2"

// Returns a new engine that the caller owns (delete it through the
// AttentionEngine pointer; the module must stay loaded), or null with a
// NUL-terminated reason of at most error_size bytes in `error` (no usable GPU).
using AttnserveCudaFactory =
    attnserve::AttentionEngine* (*)(const attnserve::EngineOptions* options, char* error,
                                    size_t error_size);

#endif  // ATTNSERVE_ENGINE_CUDA_CUDA_MODULE_ABI_H_
