// The KServe v2 (Open Inference Protocol) operations, whatever carries them:
// readiness, metadata, config, statistics, the repository index, model
// control, system shared memory and inference through the shared request
// path. The gRPC service
// (kserve_service.h) and the HTTP/REST endpoint (kserve_http.h) are thin
// adapters over one KServeCore, so both answer with the same values, the
// same errors and the same messages.
#ifndef ATTNSERVE_SERVER_TRANSPORT_KSERVE_CORE_H_
#define ATTNSERVE_SERVER_TRANSPORT_KSERVE_CORE_H_

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/functional/any_invocable.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "engine/host_buffer.h"
#include "inference/grpc_service.pb.h"
#include "server/dispatch/request_dispatcher.h"
#include "server/metrics/metrics.h"
#include "server/models/model_manager.h"
#include "server/models/model_registry.h"
#include "server/request/model_access.h"
#include "server/transport/kserve_codec.h"
#include "server/transport/system_shared_memory.h"

namespace attnserve {

// Thread-safe. Does not own the registry, the dispatcher, the metrics
// (nullable), the model manager (nullable: no model control) or the
// shared-memory regions (nullable: clients may not use shared memory,
// --allow-client-shm off); all must outlive it.
class KServeCore {
 public:
  KServeCore(const ModelRegistry* registry, RequestDispatcher* dispatcher, const Metrics* metrics,
             ModelManager* models = nullptr, SystemSharedMemory* shared_memory = nullptr);

  RequestDispatcher* dispatcher() const { return dispatcher_; }

  // A model's version as the protocol names it: "" or "1"; NotFound for
  // any other.
  static absl::Status CheckVersion(const std::string& model, const std::string& version);

  // Model `name` at `version` when known and ready: NotFound (unknown model
  // or version) or Unavailable (not ready, with its reason) otherwise.
  absl::StatusOr<std::shared_ptr<const ServedModel>> FindReady(const std::string& name,
                                                               const std::string& version) const;

  // Whether model `name` (version "" or "1") is known and ready.
  bool ModelReady(const std::string& name, const std::string& version) const;

  // name, version, extensions.
  void ServerMetadata(inference::ServerMetadataResponse* response) const;

  // Every input and output with its datatype and shape (-1 for dims a
  // request chooses). NotFound (unknown model or version), Unavailable
  // (not ready).
  absl::Status ModelMetadata(const std::string& name, const std::string& version,
                             inference::ModelMetadataResponse* response) const;

  // Triton's ModelConfig of the model; errors as ModelMetadata.
  absl::Status ModelConfig(const std::string& name, const std::string& version,
                           inference::ModelConfigResponse* response) const;

  // Statistics of model `name`, or of every model `access` allows when
  // `name` is empty. NotFound as ModelMetadata.
  absl::Status ModelStatistics(const std::string& name, const std::string& version,
                               const ModelAccess& access,
                               inference::ModelStatisticsResponse* response) const;

  // Every model `access` allows (only the ready ones when `ready_only`),
  // READY or UNAVAILABLE with its reason.
  void RepositoryIndex(bool ready_only, const ModelAccess& access,
                       inference::RepositoryIndexResponse* response) const;

  // RepositoryModelLoad / RepositoryModelUnload (ModelManager::Load,
  // Unload): `done` runs once, when the change is made or refused. Only a
  // caller whose credentials are not restricted to some models may change
  // the repository (PermissionDenied); FailedPrecondition without model
  // control.
  // PermissionDenied (naming `op`) when `access` is restricted to models.
  static absl::Status CheckRepositoryControl(const char* op, const ModelAccess& access);
  void LoadModel(const std::string& name, const ModelAccess& access,
                 absl::AnyInvocable<void(absl::Status)> done) const;
  void UnloadModel(const std::string& name, const ModelAccess& access,
                   absl::AnyInvocable<void(absl::Status)> done) const;

  // Triton's system shared-memory extension: Register, Unregister ("" =
  // every region) and Status ("" = every region) of system_shared_memory.h
  // with its errors, once CheckSharedMemory allows the caller.
  absl::Status RegisterSystemSharedMemory(const std::string& name, const std::string& key,
                                          uint64_t offset, uint64_t byte_size,
                                          const ModelAccess& access) const;
  absl::Status UnregisterSystemSharedMemory(const std::string& name,
                                            const ModelAccess& access) const;
  absl::Status SystemSharedMemoryStatus(
      const std::string& name, const ModelAccess& access,
      inference::SystemSharedMemoryStatusResponse* response) const;

  // Whether the caller may use shared memory (register, name a region in a
  // request): FailedPrecondition when the server was started without
  // --allow-client-shm; PermissionDenied (naming `op`) when `access` is
  // restricted to models, since every caller shares the regions.
  absl::Status CheckSharedMemory(const char* op, const ModelAccess& access) const;

  // How one inference call arrived.
  struct Call {
    // When the front end had the call's message, before it parsed it (the
    // start of the request's total time). InfinitePast: when StartInfer is
    // called.
    absl::Time received = absl::InfinitePast();
    // The transport's own deadline (InfiniteFuture: none); the request's
    // `timeout` parameter may shorten it.
    absl::Time deadline = absl::InfiniteFuture();
    // Optional: true once the caller has gone.
    std::function<bool()> is_cancelled;
    ModelAccess access;
    // The front end is shutting down: refused UNAVAILABLE, counted.
    bool shutting_down = false;
    // Where the results' bytes go: null, into the response's
    // raw_output_contents; else into buffers from result_memory, appended
    // to *result_buffers in step with raw_output_contents, whose entries
    // stay empty (kserve_wire.h). Both or neither; not owned.
    HostBufferPool* result_memory = nullptr;
    std::vector<HostBuffer>* result_buffers = nullptr;
    // The request's raw_input_contents when the front end took them out of
    // the message (ParseModelInferRequest, kserve_wire.h); empty: the
    // message's own. Must stay valid until `done` has run.
    absl::Span<const HostBuffer> raw_inputs;
  };

  // One inference: `parsed` says whether `request` could be read (not OK:
  // refused through the dispatcher, counted under the model it names).
  // `done` runs exactly once with the final status, `response` filled when
  // OK (the outputs the client asked for; session_length for session
  // requests). `request`, `decoded` and `response` must stay valid until
  // `done` has run.
  void StartInfer(const Call& call, const absl::Status& parsed,
                  const inference::ModelInferRequest& request, KServeRequest* decoded,
                  inference::ModelInferResponse* response,
                  absl::AnyInvocable<void(absl::Status)> done) const;

 private:
  // LoadModel and UnloadModel: the caller's rights, then `change`.
  void ChangeModel(
      const char* op,
      void (ModelManager::*change)(const std::string&, absl::AnyInvocable<void(absl::Status)>),
      const std::string& name, const ModelAccess& access,
      absl::AnyInvocable<void(absl::Status)> done) const;

  const ModelRegistry* const registry_;
  RequestDispatcher* const dispatcher_;
  const Metrics* const metrics_;
  ModelManager* const models_;
  SystemSharedMemory* const shared_memory_;
  // What an inference that names a region gets when its caller may not use
  // shared memory (the extension off, or a restricted token): made once, not
  // per request.
  const absl::Status infer_shm_refusal_;
};

}  // namespace attnserve

#endif  // ATTNSERVE_SERVER_TRANSPORT_KSERVE_CORE_H_
