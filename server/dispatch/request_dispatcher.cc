// RequestDispatcher: lookup, validation, output binding, scheduling and the
// request metrics, in that order.
#include "server/dispatch/request_dispatcher.h"

#include <utility>

#include "absl/strings/str_cat.h"

namespace attnserve {
namespace {

// The metrics label of requests whose model is unknown: client-supplied
// names never become label values (unbounded series).
constexpr char kUnknownModelLabel[] = "(unknown)";

}  // namespace

RequestDispatcher::RequestDispatcher(const ModelRegistry* registry, BatchingScheduler* scheduler,
                                     Metrics* metrics, Clock* clock, ValidationOptions validation)
    : registry_(registry),
      scheduler_(scheduler),
      metrics_(metrics),
      clock_(clock),
      validation_(std::move(validation)) {}

void RequestDispatcher::CountAnswer(InferenceRequest& request) {
  // Every answer, whoever gives it, is counted here: the metrics wrap the
  // front end's completion.
  request.done = [this, done = std::move(request.done)](absl::Status status,
                                                        const InferenceRequest& r) mutable {
    RecordAnswer(r, status);
    done(std::move(status), r);
  };
}

void RequestDispatcher::Reject(std::unique_ptr<InferenceRequest> request, absl::Status status) {
  CountAnswer(*request);
  request->Complete(std::move(status));
}

void RequestDispatcher::Submit(std::unique_ptr<InferenceRequest> request,
                               const AttendInputs& inputs, OutputAllocator allocate) {
  CountAnswer(*request);
  absl::Status status = Start(request, inputs, allocate);
  // Refused: the request is still ours, and this is its one answer.
  if (!status.ok()) request->Complete(std::move(status));
}

absl::Status RequestDispatcher::Start(std::unique_ptr<InferenceRequest>& request,
                                      const AttendInputs& inputs, OutputAllocator allocate) {
  absl::StatusOr<std::shared_ptr<const ServedModel>> model = registry_->Find(inputs.model);
  if (!model.ok()) return model.status();
  request->model = *std::move(model);
  const ServedModel& served = *request->model;
  if (!served.ready()) {
    return absl::UnavailableError(
        absl::StrCat("model: '", served.name, "' is not ready: ", served.reason));
  }
  absl::StatusOr<ValidatedRequest> validated =
      ValidateAttendInputs(inputs, served.layer->config, validation_, &served.weight_bounds);
  if (!validated.ok()) return validated.status();

  request->task = std::move(validated->task);
  request->dims = validated->dims;
  // The engine writes straight into the front end's response: the only copy
  // of the output is the transport's serialization.
  request->task.output =
      allocate(OutputName::kOutput, validated->output_dtype, validated->output_shape);
  if (!validated->weights_shape.empty()) {
    request->task.weights =
        allocate(OutputName::kWeights, validated->output_dtype, validated->weights_shape);
  }
  // Counted before Schedule, so that a fast completion never takes the gauge
  // below zero; RecordAnswer takes it back for every request the scheduler
  // accepted (enqueued set).
  ModelMetrics* mm = metrics_ != nullptr ? metrics_->ForModel(served.name) : nullptr;
  if (mm != nullptr) mm->InflightAdd(1);
  absl::Status status = scheduler_->Schedule(&request);
  if (!status.ok() && mm != nullptr) mm->InflightAdd(-1);
  return status;
}

void RequestDispatcher::Cancelled(absl::string_view model) {
  absl::StatusOr<std::shared_ptr<const ServedModel>> served = registry_->Find(model);
  if (served.ok()) scheduler_->Wake((*served)->name);
}

void RequestDispatcher::CancelledOnAnyModel() { scheduler_->WakeAll(); }

void RequestDispatcher::RecordAnswer(const InferenceRequest& request,
                                     const absl::Status& status) {
  if (metrics_ == nullptr) return;
  ModelMetrics* mm =
      metrics_->ForModel(request.model != nullptr ? request.model->name : kUnknownModelLabel);
  if (request.enqueued != absl::InfinitePast()) mm->InflightAdd(-1);
  mm->RequestDone(status.code(), absl::ToDoubleSeconds(clock_->Now() - request.received));
}

}  // namespace attnserve
