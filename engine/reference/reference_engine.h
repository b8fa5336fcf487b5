// The reference backend: plain loops with double accumulation everywhere
// (projections, scores, softmax, P*V, out projection). Slow on purpose; it is
// the oracle the other backends are tested against.
#ifndef ATTNSERVE_ENGINE_REFERENCE_REFERENCE_ENGINE_H_
#define ATTNSERVE_ENGINE_REFERENCE_REFERENCE_ENGINE_H_

#include <memory>

#include "engine/attention_engine.h"

namespace attnserve {

// Thread-safe and stateless: every call works on its own scratch.
//
// Run checks each task itself (InvalidArgument naming the field) and shares
// no checking, dims or mask code with the engines it is the oracle of. The
// layer's precision is not applied: weights are used as stored (FLOAT32)
// and inputs as sent; a test of a bf16/fp16 layer rounds the weights (and
// inputs) it hands the reference. Results are rounded once, to the output
// and weights dtypes.
std::unique_ptr<AttentionEngine> NewReferenceEngine();

}  // namespace attnserve

#endif  // ATTNSERVE_ENGINE_REFERENCE_REFERENCE_ENGINE_H_
