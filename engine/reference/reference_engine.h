// The reference backend: plain loops with double accumulation everywhere
// (projections, scores, softmax, P*V, out projection). Slow on purpose; it is
// the oracle the other backends are tested against.
#ifndef ATTNSERVE_ENGINE_REFERENCE_REFERENCE_ENGINE_H_
#define ATTNSERVE_ENGINE_REFERENCE_REFERENCE_ENGINE_H_

#include <memory>

#include "engine/attention_engine.h"

namespace attnserve {

// Thread-safe and stateless: every call works on its own scratch.
std::unique_ptr<AttentionEngine> NewReferenceEngine();

}  // namespace attnserve

#endif  // ATTNSERVE_ENGINE_REFERENCE_REFERENCE_ENGINE_H_
