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

#include <cstdint>
#include <memory>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "engine/attention_layer.h"
#include "engine/attention_params.h"
#include "engine/attention_task.h"
#include "engine/host_buffer.h"

namespace attnserve {

// Where a server keeps the slabs its session KV-cache blocks are carved from
// (server/sessions/kv_block_pool.h), when the engine reads the blocks from
// memory of its own (a GPU's). The server never dereferences a block of
// such memory: it only carves blocks out of a slab by address arithmetic
// and hands their addresses to the engine (AttentionTask::paged).
//
// Thread-safe: Map and Unmap may be called concurrently from any thread.
class KvSlabMemory {
 public:
  virtual ~KvSlabMemory() = default;
  // `bytes` (> 0) of memory, at least 256-byte aligned, contents
  // unspecified; nullptr when it cannot be had.
  virtual void* Map(int64_t bytes) = 0;
  // Returns a slab from Map(bytes). No task that points into it may be
  // running.
  virtual void Unmap(void* base, int64_t bytes) = 0;
};

// What a session's KV cache holds per token for a projection layer (the
// geometry of its PagedKv blocks): num_kv_heads rows of head_dim key
// features and of head_dim_v value features.
struct KvCacheGeometry {
  int64_t num_kv_heads = 0;
  int64_t head_dim = 0;
  int64_t head_dim_v = 0;
};

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

  // The geometry of the session caches this engine reads for projection
  // layer `layer`: by default its projected keys and values (num_kv_heads,
  // head_dim, ValueHeadDim). An engine may cache something smaller from
  // which it computes the same attention (the cpu engine: a latent layer's
  // compressed latent and rotary key, LatentAttention).
  virtual KvCacheGeometry SessionCacheGeometry(const LayerConfig& layer) const {
    return {layer.num_kv_heads, layer.head_dim, ValueHeadDim(layer)};
  }

  // The memory the blocks of this engine's sessions must live in; nullptr
  // = ordinary host memory (the server maps it itself). Engines that return
  // one keep it usable for as long as anybody holds the pointer.
  virtual std::shared_ptr<KvSlabMemory> kv_slab_memory() const { return nullptr; }

  // The memory a front end should copy requests' tensor bytes into
  // (engine/host_buffer.h), when this engine reads inputs fastest from
  // memory of its own; nullptr = ordinary host memory. Any host memory is
  // still accepted: this is about speed only.
  virtual std::shared_ptr<HostBufferPool> request_memory() const { return nullptr; }

  // Whether Run computes `task` (already valid for `layer`): an engine that
  // lacks one of its options answers Unimplemented naming it, so that a
  // server refuses that one request before it is batched with others.
  // A session request is asked about as the paged task it will be:
  // task.paged.enabled(), its block tables not bound yet (empty; not to be
  // read here). Default: every valid task.
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
