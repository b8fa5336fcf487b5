// AttentionService handlers: the transport edge (proto <-> engine task,
// absl::Status -> grpc::Status).
#include "server/attention_service.h"

#include <chrono>
#include <memory>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "server/status_util.h"
#include "server/tensor_codec.h"

namespace attnserve {
namespace {

int64_t Micros(SteadyClock::duration d) {
  return std::chrono::duration_cast<std::chrono::microseconds>(d).count();
}

// The call's deadline on the steady clock; max() when there is none (gRPC
// reports "none" as a far-future system time).
SteadyClock::time_point SteadyDeadline(const grpc::CallbackServerContext& context) {
  const auto system_deadline = context.deadline();
  const auto system_now = std::chrono::system_clock::now();
  if (system_deadline >= system_now + std::chrono::hours(24 * 365)) {
    return SteadyClock::time_point::max();
  }
  return SteadyClock::now() +
         std::chrono::duration_cast<SteadyClock::duration>(system_deadline - system_now);
}

}  // namespace

AttentionServiceImpl::AttentionServiceImpl(const ModelRegistry* registry,
                                           AttendScheduler* scheduler,
                                           AttentionServiceOptions options)
    : registry_(registry), scheduler_(scheduler), options_(std::move(options)) {}

grpc::ServerUnaryReactor* AttentionServiceImpl::Attend(grpc::CallbackServerContext* context,
                                                       const v1::AttendRequest* request,
                                                       v1::AttendResponse* response) {
  const SteadyClock::time_point received = SteadyClock::now();
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  absl::Status status = StartAttend(context, request, response, reactor, received);
  if (!status.ok()) reactor->Finish(ToGrpcStatus(status));
  return reactor;
}

absl::Status AttentionServiceImpl::StartAttend(grpc::CallbackServerContext* context,
                                               const v1::AttendRequest* request,
                                               v1::AttendResponse* response,
                                               grpc::ServerUnaryReactor* reactor,
                                               SteadyClock::time_point received) {
  absl::StatusOr<std::shared_ptr<const ServedModel>> model = registry_->Find(request->model());
  if (!model.ok()) return model.status();
  if (!(*model)->ready()) {
    return absl::UnavailableError(
        absl::StrCat("model: '", (*model)->name, "' is not ready: ", (*model)->reason));
  }
  absl::StatusOr<ValidatedRequest> validated =
      ValidateAttendRequest(*request, (*model)->layer->config, options_.validation);
  if (!validated.ok()) return validated.status();

  auto work = std::make_unique<AttendWork>();
  work->model = *std::move(model);
  work->task = std::move(validated->task);
  // The engine writes straight into the response's buffers.
  response->set_id(request->id());
  work->task.output =
      AllocateTensor(validated->output_dtype, validated->output_shape, response->mutable_output());
  if (!validated->weights_shape.empty()) {
    work->task.weights = AllocateTensor(validated->output_dtype, validated->weights_shape,
                                        response->mutable_weights());
  }
  work->deadline = SteadyDeadline(*context);
  work->is_cancelled = [context] { return context->IsCancelled(); };
  // request, response and context stay valid until Finish(): gRPC frees
  // them only after the reactor is done.
  work->done = [reactor, response, received](absl::Status status, const WorkTiming& timing) {
    if (status.ok()) {
      v1::Timing* t = response->mutable_timing();
      t->set_queue_us(Micros(timing.queue));
      t->set_compute_us(Micros(timing.compute));
      t->set_total_us(Micros(SteadyClock::now() - received));
      t->set_batch_requests(timing.batch_requests);
    }
    reactor->Finish(ToGrpcStatus(status));
  };
  work->scheduled_at = SteadyClock::now();
  // On failure the work (and its `done`) stays ours and is dropped; the
  // caller finishes the RPC with the status.
  return scheduler_->Schedule(&work);
}

v1::ModelStatus AttentionServiceImpl::ToModelStatus(const ServedModel& model,
                                                    const std::string& default_name) const {
  v1::ModelStatus status;
  status.set_name(model.name);
  *status.mutable_config() = model.config;
  status.set_state(model.state);
  status.set_reason(model.reason);
  if (model.engine != nullptr) status.set_backend(std::string(model.engine->name()));
  status.set_is_default(model.name == default_name);
  return status;
}

grpc::ServerUnaryReactor* AttentionServiceImpl::ListModels(grpc::CallbackServerContext* context,
                                                           const v1::ListModelsRequest* request,
                                                           v1::ListModelsResponse* response) {
  const std::string default_name = registry_->default_model();
  for (const auto& model : registry_->List()) {
    *response->add_models() = ToModelStatus(*model, default_name);
  }
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

grpc::ServerUnaryReactor* AttentionServiceImpl::GetModel(grpc::CallbackServerContext* context,
                                                         const v1::GetModelRequest* request,
                                                         v1::ModelStatus* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  absl::StatusOr<std::shared_ptr<const ServedModel>> model = registry_->Find(request->name());
  if (!model.ok()) {
    reactor->Finish(ToGrpcStatus(model.status()));
  } else {
    *response = ToModelStatus(**model, registry_->default_model());
    reactor->Finish(grpc::Status::OK);
  }
  return reactor;
}

}  // namespace attnserve
