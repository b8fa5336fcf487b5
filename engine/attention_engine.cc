// CreateEngine: picks a backend by name.
#include "engine/attention_engine.h"

#include "absl/strings/str_cat.h"
#include "engine/cpu/cpu_engine.h"
#include "engine/cuda/cuda_loader.h"
#include "engine/reference/reference_engine.h"

namespace attnserve {

absl::StatusOr<std::unique_ptr<AttentionEngine>> CreateEngine(std::string_view name,
                                                              const EngineOptions& options) {
  if (name == "cuda") return LoadCudaEngine(options);
  if (name == "reference") return NewReferenceEngine();
  if (name == "auto") {
    // cuda when the module loads and a GPU is usable; any failure means cpu.
    if (absl::StatusOr<std::unique_ptr<AttentionEngine>> cuda = LoadCudaEngine(options); cuda.ok()) {
      return cuda;
    }
    return NewCpuEngine(options);
  }
  if (name == "cpu") return NewCpuEngine(options);
  return absl::NotFoundError(absl::StrCat("engine '", std::string(name),
                                          "': unknown; expected cpu, reference, cuda or auto"));
}

}  // namespace attnserve
