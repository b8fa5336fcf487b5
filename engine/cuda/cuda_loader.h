// Loads the CUDA backend at run time. The backend lives in a module,
// libattnserve_cuda.so, that alone links the CUDA runtime and cuBLAS(Lt):
// one attnserve binary then runs on machines with and without a GPU (or
// even without the CUDA libraries), and cuBLASLt's large static TLS never
// enters a process that does not use it (see DESIGN.md section 4).
//
// Plain C++: no CUDA header is needed to build or call this.
#ifndef ATTNSERVE_ENGINE_CUDA_CUDA_LOADER_H_
#define ATTNSERVE_ENGINE_CUDA_CUDA_LOADER_H_

#include <memory>
#include <string_view>

#include "absl/status/statusor.h"
#include "engine/attention_engine.h"

namespace attnserve {

// A new CUDA engine. The module is looked for, in order:
//   1. next to the running executable (the directory of /proc/self/exe),
//   2. $ATTNSERVE_CUDA_MODULE (the module's path, or a directory holding it),
//   3. the dynamic loader's search path (LD_LIBRARY_PATH, ld.so.cache, RUNPATH),
//   4. where this build tree put it (CudaModuleBuildPath), if anywhere.
// The module stays loaded for the life of the process. Unavailable, with the
// reason, when the module is missing or fails to load ("CUDA module ...") or
// when there is no usable GPU ("no CUDA device: cudaGetDeviceCount: ...").
// Never crashes for want of a GPU. Thread-safe.
absl::StatusOr<std::unique_ptr<AttentionEngine>> LoadCudaEngine(const EngineOptions& options = {});

// Where this build wrote the module; empty when it was built without CUDA
// (ATTNSERVE_CUDA=OFF, or AUTO without nvcc).
std::string_view CudaModuleBuildPath();

}  // namespace attnserve

#endif  // ATTNSERVE_ENGINE_CUDA_CUDA_LOADER_H_
