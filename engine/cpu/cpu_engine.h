// The production CPU backend: oneDNN matmuls for the projections (stacked
// over the batch), the fused flash kernel for the attention core.
#ifndef ATTNSERVE_ENGINE_CPU_CPU_ENGINE_H_
#define ATTNSERVE_ENGINE_CPU_CPU_ENGINE_H_

#include <memory>

#include "absl/status/statusor.h"
#include "engine/attention_engine.h"

namespace attnserve {

// Thread-safe per AttentionEngine's contract.
//
// Run over a projection layer stacks the rows of every task of the batch
// into fixed 32-row chunks, each one single-threaded oneDNN matmul with the
// layer's prepacked weights (one fused [Wq; Wk; Wv] matmul for
// self-attention, bias fused), then computes every task's attention core in
// one call of the flash kernel, then the output projection the same way.
// A task's result is bitwise the same whatever else is in its batch, at
// whatever position, and whatever options.num_threads is.
//
// Precision: fp32 layers compute in fp32. bf16 layers feed bf16 weights and
// activations (inputs, Q/K/V, core output) to the matmuls and the core, with
// fp32 accumulation, on CPUs with AVX512_BF16 or AMX; elsewhere their
// matmuls compute in fp32 on bf16-rounded weights. fp16 layers compute in
// fp32 on weights and biases rounded to fp16 values (inputs not rounded).
//
// Per-layer state (prepacked weights, primitives) is built on the first call
// that needs it and cached by the layer's address and LayerId (a new layer at
// a freed layer's address has another id); later calls create no primitive.
//
// Threads: OpenMP; options.num_threads > 0 sets the OpenMP thread count of
// each calling thread, 0 uses OpenMP's default (every core).
absl::StatusOr<std::unique_ptr<AttentionEngine>> NewCpuEngine(const EngineOptions& options);

}  // namespace attnserve

#endif  // ATTNSERVE_ENGINE_CPU_CPU_ENGINE_H_
