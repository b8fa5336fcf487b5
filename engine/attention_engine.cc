// CreateEngine: picks a backend by name.
#include "engine/attention_engine.h"

#include "absl/strings/str_cat.h"

namespace attnserve {

absl::StatusOr<std::unique_ptr<AttentionEngine>> CreateEngine(std::string_view name,
                                                              const EngineOptions& options) {
  if (name == "cuda") {
    return absl::UnavailableError("engine 'cuda': not built into this binary yet");
  }
  if (name == "reference" || name == "cpu" || name == "auto") {
    return absl::UnimplementedError(absl::StrCat("engine '", std::string(name), "': not implemented yet"));
  }
  return absl::NotFoundError(absl::StrCat("engine '", std::string(name),
                                          "': unknown; expected cpu, reference, cuda or auto"));
}

}  // namespace attnserve
