// attnserve.v1.AttentionService on gRPC's callback API. Handlers return at
// once: Attend validates, binds the outputs into the response and hands the
// work to an AttendScheduler, whose completion finishes the RPC.
#ifndef ATTNSERVE_SERVER_ATTENTION_SERVICE_H_
#define ATTNSERVE_SERVER_ATTENTION_SERVICE_H_

#include "absl/status/status.h"
#include "attnserve/v1/attention.grpc.pb.h"
#include "server/attend_scheduler.h"
#include "server/model_registry.h"
#include "server/validation.h"

namespace attnserve {

struct AttentionServiceOptions {
  // Size limits applied to every Attend request. Default: ValidationOptions{}.
  ValidationOptions validation;
};

// Thread-safe (gRPC calls handlers concurrently). Does not own the registry
// or the scheduler; both must outlive the grpc::Server this is registered
// with (i.e. until its Shutdown() has returned). AttendStream is not
// implemented yet (the generated default answers UNIMPLEMENTED).
class AttentionServiceImpl final : public v1::AttentionService::CallbackService {
 public:
  AttentionServiceImpl(const ModelRegistry* registry, AttendScheduler* scheduler,
                       AttentionServiceOptions options = {});

  grpc::ServerUnaryReactor* Attend(grpc::CallbackServerContext* context,
                                   const v1::AttendRequest* request,
                                   v1::AttendResponse* response) override;
  grpc::ServerUnaryReactor* ListModels(grpc::CallbackServerContext* context,
                                       const v1::ListModelsRequest* request,
                                       v1::ListModelsResponse* response) override;
  grpc::ServerUnaryReactor* GetModel(grpc::CallbackServerContext* context,
                                     const v1::GetModelRequest* request,
                                     v1::ModelStatus* response) override;

 private:
  // Everything up to handing the work over. On error the RPC is not yet
  // finished and the caller finishes it with the status.
  absl::Status StartAttend(grpc::CallbackServerContext* context, const v1::AttendRequest* request,
                           v1::AttendResponse* response, grpc::ServerUnaryReactor* reactor,
                           SteadyClock::time_point received);
  v1::ModelStatus ToModelStatus(const ServedModel& model, const std::string& default_name) const;

  const ModelRegistry* const registry_;
  AttendScheduler* const scheduler_;
  const AttentionServiceOptions options_;
};

}  // namespace attnserve

#endif  // ATTNSERVE_SERVER_ATTENTION_SERVICE_H_
