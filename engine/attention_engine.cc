// CreateEngine: picks a backend by name.
#include "engine/attention_engine.h"

#include "absl/strings/str_cat.h"
#include "engine/cpu/cpu_engine.h"
#include "engine/reference/reference_engine.h"

namespace attnserve {

absl::StatusOr<std::unique_ptr<AttentionEngine>> CreateEngine(std::string_view name,
                                                              const EngineOptions& options) {
  if (name == "cuda") {
    return absl::UnavailableError("engine 'cuda': not built into this binary yet");
  }
  if (name == "reference") return NewReferenceEngine();
  // "auto" would prefer cuda; until that backend lands it is always cpu.
  if (name == "cpu" || name == "auto") return NewCpuEngine(options);
  return absl::NotFoundError(absl::StrCat("engine '", std::string(name),
                                          "': unknown; expected cpu, reference, cuda or auto"));
}

}  // namespace attnserve
