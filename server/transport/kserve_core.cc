// KServe v2 operations over the registry, the metrics and the request
// path; the gRPC and HTTP front ends adapt them to their transports.
#include "server/transport/kserve_core.h"

#include <algorithm>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "engine/rope.h"
#include "server/transport/kserve_wire.h"

#ifndef ATTNSERVE_VERSION
#define ATTNSERVE_VERSION "unknown"
#endif

namespace attnserve {
namespace {

// Why a caller may not use shared memory for `op`: the extension is off
// (`enabled` false), or, when it is on, the caller's token is restricted to
// models.
absl::Status SharedMemoryRefusal(const char* op, bool enabled) {
  if (!enabled) {
    return absl::FailedPreconditionError(absl::StrCat(
        op, ": this server takes no tensors in shared memory; start it with --allow-client-shm "
        "(clients on its host only; docs/SECURITY.md)"));
  }
  return absl::PermissionDeniedError(absl::StrCat(
      op, ": the caller's credentials are restricted to some models; shared-memory regions "
      "are shared by every caller and need a token without a model list"));
}

void AddTensor(
    google::protobuf::RepeatedPtrField<inference::ModelMetadataResponse::TensorMetadata>* to,
    const char* name, const char* datatype, std::initializer_list<int64_t> shape) {
  auto* t = to->Add();
  t->set_name(name);
  t->set_datatype(datatype);
  for (int64_t d : shape) t->add_shape(d);
}

// Inputs and outputs as ModelMetadata reports them: -1 for every dim a
// request chooses. The float inputs accept FP32, FP16 and BF16 alike; the
// metadata names FP32.
void DescribeTensors(const LayerConfig& layer, inference::ModelMetadataResponse* m) {
  if (layer.has_projections) {
    AddTensor(m->mutable_inputs(), "query", "FP32", {-1, -1, layer.query_dim});
    if (!layer.latent.enabled) {  // a latent layer's keys and values are the query's tokens
      AddTensor(m->mutable_inputs(), "key", "FP32", {-1, -1, layer.key_dim});
      AddTensor(m->mutable_inputs(), "value", "FP32", {-1, -1, layer.value_dim});
    }
    AddTensor(m->mutable_outputs(), "output", "FP32", {-1, -1, layer.out_dim});
  } else {
    AddTensor(m->mutable_inputs(), "query", "FP32", {-1, -1, -1, -1});
    AddTensor(m->mutable_inputs(), "key", "FP32", {-1, -1, -1, -1});
    AddTensor(m->mutable_inputs(), "value", "FP32", {-1, -1, -1, -1});
    AddTensor(m->mutable_outputs(), "output", "FP32", {-1, -1, -1, -1});
  }
  AddTensor(m->mutable_inputs(), "attn_mask", "BOOL", {-1, -1, -1, -1});
  AddTensor(m->mutable_inputs(), "key_lengths", "INT64", {-1});
  if (layer.rope.type != RopeConfig::Type::kNone) {
    AddTensor(m->mutable_inputs(), "positions", "INT64", {-1, -1});
  }
  if (!layer.has_projections) AddTensor(m->mutable_inputs(), "sinks", "FP32", {-1});
  AddTensor(m->mutable_outputs(), "weights", "FP32", {-1, -1, -1, -1});
}

inference::DataType ConfigDataType(const std::string& datatype) {
  if (datatype == "BOOL") return inference::TYPE_BOOL;
  if (datatype == "INT64") return inference::TYPE_INT64;
  return inference::TYPE_FP32;
}

void SetDuration(inference::StatisticDuration* d, uint64_t count, uint64_t ns) {
  d->set_count(count);
  d->set_ns(ns);
}


}  // namespace

KServeCore::KServeCore(const ModelRegistry* registry, RequestDispatcher* dispatcher,
                       const Metrics* metrics, ModelManager* models,
                       SystemSharedMemory* shared_memory)
    : registry_(registry),
      dispatcher_(dispatcher),
      metrics_(metrics),
      models_(models),
      shared_memory_(shared_memory),
      infer_shm_refusal_(SharedMemoryRefusal("shared_memory_region", shared_memory != nullptr)) {}

absl::Status KServeCore::CheckVersion(const std::string& model, const std::string& version) {
  if (version.empty() || version == "1") return absl::OkStatus();
  return absl::NotFoundError(absl::StrCat("model '", model, "' has no version \"", version,
                                          "\"; attnserve serves version \"1\" of each model"));
}

absl::StatusOr<std::shared_ptr<const ServedModel>> KServeCore::FindReady(
    const std::string& name, const std::string& version) const {
  absl::StatusOr<std::shared_ptr<const ServedModel>> model = registry_->Find(name);
  if (!model.ok()) return model.status();
  if (absl::Status s = CheckVersion((*model)->name, version); !s.ok()) return s;
  if (!(*model)->ready()) {
    return absl::UnavailableError(
        absl::StrCat("model '", (*model)->name, "' is not ready: ", (*model)->reason));
  }
  return model;
}

bool KServeCore::ModelReady(const std::string& name, const std::string& version) const {
  return FindReady(name, version).ok();
}

void KServeCore::ServerMetadata(inference::ServerMetadataResponse* response) const {
  response->set_name("attnserve");
  response->set_version(ATTNSERVE_VERSION);
  // Triton's names for what both front ends implement: the repository's
  // index, load and unload; binary tensor data (HTTP; gRPC's raw contents
  // are the same thing); configs, parameters and statistics.
  for (const char* e : {"model_repository", "model_configuration", "binary_tensor_data",
                        "parameters", "statistics"}) {
    response->add_extensions(e);
  }
  // Only where clients may use it (--allow-client-shm).
  if (shared_memory_ != nullptr) response->add_extensions("system_shared_memory");
}

absl::Status KServeCore::ModelMetadata(const std::string& name, const std::string& version,
                                       inference::ModelMetadataResponse* response) const {
  absl::StatusOr<std::shared_ptr<const ServedModel>> model = FindReady(name, version);
  if (!model.ok()) return model.status();
  response->set_name((*model)->name);
  response->add_versions("1");
  response->set_platform("attnserve");
  DescribeTensors((*model)->layer->config, response);
  return absl::OkStatus();
}

absl::Status KServeCore::ModelConfig(const std::string& name, const std::string& version,
                                     inference::ModelConfigResponse* response) const {
  absl::StatusOr<std::shared_ptr<const ServedModel>> model = FindReady(name, version);
  if (!model.ok()) return model.status();
  const LayerConfig& layer = (*model)->layer->config;
  inference::ModelConfig* c = response->mutable_config();
  c->set_name((*model)->name);
  c->set_platform("attnserve");
  c->set_backend(std::string((*model)->engine->name()));
  // 0: the batch dimension is part of each input's shape (B), not Triton's
  // implicit one; the server batches whole requests on its own.
  c->set_max_batch_size(0);
  inference::ModelMetadataResponse m;
  DescribeTensors(layer, &m);
  for (const auto& t : m.inputs()) {
    auto* in = c->add_input();
    in->set_name(t.name());
    in->set_data_type(ConfigDataType(t.datatype()));
    in->mutable_dims()->CopyFrom(t.shape());
    // key and value: omitted for self-attention, unless the layer's keys and
    // values are another layer's (kv_source), whose input they carry.
    const bool carries_kv = t.name() == "key" || t.name() == "value";
    in->set_optional(t.name() != "query" && !(carries_kv && !layer.kv_source.empty()));
  }
  for (const auto& t : m.outputs()) {
    auto* out = c->add_output();
    out->set_name(t.name());
    out->set_data_type(ConfigDataType(t.datatype()));
    out->mutable_dims()->CopyFrom(t.shape());
  }
  c->mutable_dynamic_batching()->set_max_queue_delay_microseconds(
      static_cast<uint64_t>(std::max<int64_t>(0, (*model)->batching.max_queue_delay_us)));
  auto& params = *c->mutable_parameters();
  params["kind"].set_string_value(layer.has_projections ? "projection" : "sdpa");
  if (layer.has_projections) {
    params["num_heads"].set_string_value(absl::StrCat(layer.num_heads));
    params["num_kv_heads"].set_string_value(absl::StrCat(layer.num_kv_heads));
    params["head_dim"].set_string_value(absl::StrCat(layer.head_dim));
  }
  params["causal"].set_string_value(layer.causal ? "true" : "false");
  if (layer.rope.type != RopeConfig::Type::kNone) {
    params["rope_type"].set_string_value(RopeTypeName(layer.rope.type));
    params["rope_theta"].set_string_value(absl::StrCat(layer.rope.theta));
    params["rotary_dim"].set_string_value(absl::StrCat(layer.rope.rotary_dim));
  }
  if (layer.sliding_window > 0) {
    params["sliding_window"].set_string_value(absl::StrCat(layer.sliding_window));
  }
  if (layer.softcap > 0) params["softcap"].set_string_value(absl::StrCat(layer.softcap));
  if (layer.qk_norm.enabled) params["qk_norm"].set_string_value("true");
  if (layer.sinks) params["sinks"].set_string_value("true");
  if (!layer.alibi_slopes.empty()) params["alibi"].set_string_value("true");
  if (layer.relative_bias_distance > 0) {
    params["relative_bias_distance"].set_string_value(absl::StrCat(layer.relative_bias_distance));
  }
  if (layer.relative_embeddings.distance > 0) {
    params["relative_embedding_distance"].set_string_value(
        absl::StrCat(layer.relative_embeddings.distance));
  }
  if (layer.output_gate) params["output_gate"].set_string_value("true");
  if (layer.attention_chunk > 0) {
    params["attention_chunk"].set_string_value(absl::StrCat(layer.attention_chunk));
  }
  if (layer.temperature_tuning.enabled) params["temperature_tuning"].set_string_value("true");
  if (layer.clip_qkv > 0) params["clip_qkv"].set_string_value(absl::StrCat(layer.clip_qkv));
  if (layer.v_norm_eps > 0) params["v_norm"].set_string_value("true");
  if (!layer.kv_source.empty()) params["kv_source"].set_string_value(layer.kv_source);
  if (layer.sparse_index_topk > 0) {
    params["sparse_index_topk"].set_string_value(absl::StrCat(layer.sparse_index_topk));
  }
  if (layer.latent.enabled) {
    params["latent_attention"].set_string_value("true");
    params["kv_lora_rank"].set_string_value(absl::StrCat(layer.latent.kv_lora_rank));
    params["v_head_dim"].set_string_value(absl::StrCat(layer.latent.v_head_dim));
  }
  return absl::OkStatus();
}

absl::Status KServeCore::ModelStatistics(const std::string& name, const std::string& version,
                                         const ModelAccess& access,
                                         inference::ModelStatisticsResponse* response) const {
  std::vector<std::shared_ptr<const ServedModel>> models;
  if (name.empty()) {
    for (auto& model : registry_->List()) {
      if (access.Allows(model->name)) models.push_back(std::move(model));
    }
  } else {
    auto model = registry_->Find(name);
    if (!model.ok()) return model.status();
    if (absl::Status s = CheckVersion((*model)->name, version); !s.ok()) return s;
    models.push_back(*model);
  }
  for (const auto& model : models) {
    inference::ModelStatistics* st = response->add_model_stats();
    st->set_name(model->name);
    st->set_version("1");
    const ModelMetrics* mm = metrics_ != nullptr ? metrics_->FindModel(model->name) : nullptr;
    const ModelStatsSnapshot s = mm != nullptr ? mm->Stats() : ModelStatsSnapshot{};
    st->set_last_inference(s.last_inference_ms);
    st->set_inference_count(s.inference_count);
    st->set_execution_count(s.execution_count);
    inference::InferStatistics* is = st->mutable_inference_stats();
    SetDuration(is->mutable_success(), s.success_count, s.success_ns);
    SetDuration(is->mutable_fail(), s.fail_count, s.fail_ns);
    SetDuration(is->mutable_queue(), s.queue_count, s.queue_ns);
    // As Triton: compute_* per computed request (each request's batch's
    // engine time). attnserve decodes inputs before queueing and writes
    // outputs in place, so there is no separate input or output step: 0 ns.
    SetDuration(is->mutable_compute_input(), s.inference_count, 0);
    SetDuration(is->mutable_compute_infer(), s.inference_count, s.compute_request_ns);
    SetDuration(is->mutable_compute_output(), s.inference_count, 0);
  }
  return absl::OkStatus();
}

void KServeCore::RepositoryIndex(bool ready_only, const ModelAccess& access,
                                 inference::RepositoryIndexResponse* response) const {
  std::map<std::string, inference::RepositoryIndexResponse::ModelIndex> index;
  for (const auto& model : registry_->List()) {
    if (ready_only && !model->ready()) continue;
    if (!access.Allows(model->name)) continue;
    auto& m = index[model->name];
    m.set_name(model->name);
    m.set_version("1");
    m.set_state(model->ready() ? "READY" : "UNAVAILABLE");
    // A ready model's reason: its latest load failed, this version serves.
    m.set_reason(model->ready() ? registry_->LoadError(model->name) : model->reason);
  }
  // Explicit model control: folders added to the repository since startup
  // are listed too, as Triton lists every model its repository holds.
  if (!ready_only && models_ != nullptr) {
    for (const std::string& name : models_->RepositoryModelNames()) {
      // A registered name is in `index` already, or left out by `access`.
      if (index.contains(name) || !access.Allows(name)) continue;
      auto& m = index[name];
      m.set_name(name);
      m.set_version("1");
      m.set_state("UNAVAILABLE");
      m.set_reason("not loaded (--model-control-mode=explicit: load it with RepositoryModelLoad)");
    }
  }
  for (auto& [name, m] : index) *response->add_models() = std::move(m);
}

// Repository control changes what every caller is served: not for
// credentials restricted to some models.
absl::Status KServeCore::CheckRepositoryControl(const char* op, const ModelAccess& access) {
  if (!access.restricted()) return absl::OkStatus();
  return absl::PermissionDeniedError(absl::StrCat(
      op, ": the caller's credentials are restricted to some models; loading and unloading "
      "models needs a token without a model list"));
}

void KServeCore::LoadModel(const std::string& name, const ModelAccess& access,
                           absl::AnyInvocable<void(absl::Status)> done) const {
  ChangeModel("RepositoryModelLoad", &ModelManager::Load, name, access, std::move(done));
}

void KServeCore::UnloadModel(const std::string& name, const ModelAccess& access,
                             absl::AnyInvocable<void(absl::Status)> done) const {
  ChangeModel("RepositoryModelUnload", &ModelManager::Unload, name, access, std::move(done));
}

void KServeCore::ChangeModel(
    const char* op,
    void (ModelManager::*change)(const std::string&, absl::AnyInvocable<void(absl::Status)>),
    const std::string& name, const ModelAccess& access,
    absl::AnyInvocable<void(absl::Status)> done) const {
  if (absl::Status s = CheckRepositoryControl(op, access); !s.ok()) {
    done(std::move(s));
  } else if (models_ == nullptr) {
    done(absl::FailedPreconditionError(
        absl::StrCat(op, ": this server has no model control; start it with "
                         "--model-repository DIR --model-control-mode=explicit")));
  } else {
    (models_->*change)(name, std::move(done));
  }
}

absl::Status KServeCore::CheckSharedMemory(const char* op, const ModelAccess& access) const {
  if (shared_memory_ != nullptr && !access.restricted()) return absl::OkStatus();
  return SharedMemoryRefusal(op, shared_memory_ != nullptr);
}

absl::Status KServeCore::RegisterSystemSharedMemory(const std::string& name,
                                                    const std::string& key, uint64_t offset,
                                                    uint64_t byte_size,
                                                    const ModelAccess& access) const {
  if (absl::Status s = CheckSharedMemory("SystemSharedMemoryRegister", access); !s.ok()) return s;
  return shared_memory_->Register(name, key, offset, byte_size);
}

absl::Status KServeCore::UnregisterSystemSharedMemory(const std::string& name,
                                                      const ModelAccess& access) const {
  if (absl::Status s = CheckSharedMemory("SystemSharedMemoryUnregister", access); !s.ok()) {
    return s;
  }
  return shared_memory_->Unregister(name);
}

absl::Status KServeCore::SystemSharedMemoryStatus(
    const std::string& name, const ModelAccess& access,
    inference::SystemSharedMemoryStatusResponse* response) const {
  if (absl::Status s = CheckSharedMemory("SystemSharedMemoryStatus", access); !s.ok()) return s;
  absl::StatusOr<std::vector<SystemSharedMemory::RegionStatus>> regions =
      shared_memory_->Status(name);
  if (!regions.ok()) return regions.status();
  for (const SystemSharedMemory::RegionStatus& r : *regions) {
    auto& entry = (*response->mutable_regions())[r.name];
    entry.set_name(r.name);
    entry.set_key(r.key);
    entry.set_offset(r.offset);
    entry.set_byte_size(r.byte_size);
  }
  return absl::OkStatus();
}

void KServeCore::StartInfer(const Call& call, const absl::Status& parsed,
                            const inference::ModelInferRequest& request, KServeRequest* decoded,
                            inference::ModelInferResponse* response,
                            absl::AnyInvocable<void(absl::Status)> done) const {
  Clock* const clock = dispatcher_->clock();
  auto r = std::make_unique<InferenceRequest>();
  r->id = request.id();
  r->received = call.received == absl::InfinitePast() ? clock->Now() : call.received;
  r->deadline = call.deadline;
  r->is_cancelled = call.is_cancelled;
  r->access = call.access;
  response->set_id(request.id());
  response->set_model_name(request.model_name());
  response->set_model_version("1");
  std::vector<HostBuffer>* const buffers = call.result_buffers;
  r->done = [done = std::move(done), response, decoded, buffers](
                absl::Status status, const InferenceRequest& r) mutable {
    if (status.ok()) {
      for (int i : KeepRequestedOutputs(*decoded, response)) {
        if (buffers != nullptr) buffers->erase(buffers->begin() + i);
      }
      if (!r.session_id.empty()) {
        (*response->mutable_parameters())["session_length"].set_int64_param(r.session_length);
      }
      if (response->model_name().empty() && r.model != nullptr) {
        response->set_model_name(r.model->name);
      }
    }
    done(std::move(status));
  };
  if (call.shutting_down) {
    dispatcher_->Reject(std::move(r),
                        absl::UnavailableError("server is shutting down; not accepting requests"));
    return;
  }
  if (!parsed.ok()) {
    dispatcher_->Reject(std::move(r), parsed);
    return;
  }
  // A request the mapping cannot express goes through the request path all
  // the same: the model lookup answers first (an unknown model is NOT_FOUND
  // whatever else is wrong, as Triton answers), then validation reports it.
  SharedMemoryAccess shm;
  if (shared_memory_ != nullptr && !call.access.restricted()) {
    shm.regions = shared_memory_;
  } else {
    shm.refusal = infer_shm_refusal_;  // shares the message: no allocation
  }
  decoded->inputs.decode_error = DecodeModelInferRequest(request, decoded, call.raw_inputs, shm);
  if (decoded->timeout_us > 0) {
    r->deadline = std::min(r->deadline, r->received + absl::Microseconds(decoded->timeout_us));
  }
  HostBufferPool* const memory = call.result_memory;
  dispatcher_->Submit(
      std::move(r), decoded->inputs,
      [response, memory, buffers, decoded](
          OutputName name, DType dtype, const Shape& shape) -> absl::StatusOr<MutableTensorView> {
        const SharedMemoryTensor& shared =
            name == OutputName::kOutput ? decoded->shared_output : decoded->shared_weights;
        if (!shared.region.empty()) {
          // Written into the client's region; its raw_output_contents entry
          // stays empty (and its buffer, in step, too).
          if (buffers != nullptr) buffers->emplace_back();
          return AddSharedMemoryOutput(response, name, dtype, shape, shared);
        }
        return memory != nullptr && buffers != nullptr
                   ? AllocateKServeResult(*memory, response, name, dtype, shape, buffers)
                   : AllocateKServeOutput(response, name, dtype, shape);
      });
}

}  // namespace attnserve
