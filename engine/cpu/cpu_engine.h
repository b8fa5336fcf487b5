// The production CPU backend: oneDNN matmuls for the projections and the
// attention core, fp32 accumulation, fp16/bf16 converted at the edges.
#ifndef ATTNSERVE_ENGINE_CPU_CPU_ENGINE_H_
#define ATTNSERVE_ENGINE_CPU_CPU_ENGINE_H_

#include <memory>

#include "absl/status/statusor.h"
#include "engine/attention_engine.h"

namespace attnserve {

// Thread-safe per AttentionEngine's contract. Every task of a Run is computed
// on its own (no GEMM is shared across tasks), so a task's result is bitwise
// the same whatever else is in its batch; it is also bitwise reproducible
// for a fixed thread count. Threads: oneDNN's OpenMP pool; options.num_threads
// > 0 sets the OpenMP thread count of each calling thread.
absl::StatusOr<std::unique_ptr<AttentionEngine>> NewCpuEngine(const EngineOptions& options);

}  // namespace attnserve

#endif  // ATTNSERVE_ENGINE_CPU_CPU_ENGINE_H_
