// The backend interface: every engine (reference, cpu, cuda) computes the
// same function over the same inputs; only speed differs.
//
// Thread safety: an AttentionEngine is thread-safe. Run may be called
// concurrently from any number of threads; each call's results
// depend only on its own arguments (not on other calls, nor on the other
// tasks of its batch: batch invariance).
//
// Ownership: the caller owns every buffer a task points to and keeps it
// alive and unmodified (inputs) / untouched (outputs) until the call
// returns. The engine keeps no pointer into them after returning. The layer
// must outlive every call that uses it; an engine may cache per-layer state
// (converted or device-resident weights) keyed by the layer's address and
// checked against its LayerId (an address can be reused; an id cannot).
#ifndef ATTNSERVE_ENGINE_ATTENTION_ENGINE_H_
#define ATTNSERVE_ENGINE_ATTENTION_ENGINE_H_

#include <memory>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "engine/attention_layer.h"
#include "engine/attention_params.h"
#include "engine/attention_task.h"

namespace attnserve {

class AttentionEngine {
 public:
  virtual ~AttentionEngine() = default;

  // "reference", "cpu", "cuda".
  virtual std::string_view name() const = 0;

  // Runs a layer (projections if any, then attention) over a group of
  // requests computed together (a server batch; each task's own B is its
  // batch size): each task has its own lengths, masks and options. On error
  // no output should be trusted.
  virtual absl::Status Run(const AttentionLayer& layer,
                           absl::Span<const AttentionTask> tasks) = 0;

  // Whether Run accepts tasks with a paged K/V cache (AttentionTask::paged,
  // server-side sessions). Others answer such a task Unimplemented.
  virtual bool SupportsSessions() const { return false; }

  // Whether Run computes `task` (already valid for `layer`): an engine that
  // lacks one of its options answers Unimplemented naming it, so that a
  // server refuses that one request before it is batched with others.
  // Default: every valid task.
  virtual absl::Status Accepts(const LayerConfig& layer, const AttentionTask& task) const {
    (void)layer;
    (void)task;
    return absl::OkStatus();
  }
};

struct EngineOptions {
  // Worker threads used inside one call. 0 = the number of cores.
  int num_threads = 0;
};

// Factories. CreateEngine("cpu" | "reference" | "cuda" | "auto"): "auto" is
// cuda when a GPU is usable, else cpu. NotFound for an unknown name,
// Unavailable for cuda without a GPU.
absl::StatusOr<std::unique_ptr<AttentionEngine>> CreateEngine(
    std::string_view name, const EngineOptions& options = {});

}  // namespace attnserve

#endif  // ATTNSERVE_ENGINE_ATTENTION_ENGINE_H_
