// ModelInferRequest -> AttendInputs, and outputs -> ModelInferResponse.
#include "server/transport/kserve_codec.h"

#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstring>
#include <string>

#include "absl/container/inlined_vector.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace attnserve {
namespace {

using inference::InferParameter;
using inference::ModelInferRequest;

constexpr const char* kInputNames =
    "query, key, value, attn_mask, key_lengths, positions, sinks";
constexpr const char* kParameterNames =
    "causal, scale, window, softcap, need_weights, average_weights, session_id, timeout, "
    "priority";

// A request's raw_input_contents: taken out of the message into host
// buffers (kserve_wire.h) or, when there are none, the message's own.
class RawContents {
 public:
  RawContents(const ModelInferRequest& request, absl::Span<const HostBuffer> buffers)
      : request_(request), buffers_(buffers) {}
  int size() const {
    return buffers_.empty() ? request_.raw_input_contents_size()
                            : static_cast<int>(buffers_.size());
  }
  absl::string_view operator[](int i) const {
    if (buffers_.empty()) return request_.raw_input_contents(i);
    return absl::string_view(buffers_[i].data(), buffers_[i].size());
  }

 private:
  const ModelInferRequest& request_;
  const absl::Span<const HostBuffer> buffers_;
};

// The datatype of a float or mask input; anything else is the tensor's
// decode_error (reported by validation in its usual order).
absl::Status TensorDType(const ModelInferRequest::InferInputTensor& tensor, bool mask,
                         DType* dtype) {
  const std::string& t = tensor.datatype();
  if (t == "FP32") {
    *dtype = DType::kFloat32;
  } else if (t == "FP16") {
    *dtype = DType::kFloat16;
  } else if (t == "BF16") {
    *dtype = DType::kBFloat16;
  } else if (t == "BOOL" && mask) {
    *dtype = DType::kBool;
  } else {
    return absl::InvalidArgumentError(absl::StrCat(
        "input '", tensor.name(), "': datatype must be ",
        mask ? "BOOL, FP32, FP16 or BF16" : "FP32, FP16 or BF16", ", got '", t, "'"));
  }
  return absl::OkStatus();
}

// The bytes of input `index`: `raw` (its raw_input_contents entry or its
// shared-memory bytes) when not null, else its typed contents where they are
// laid out as the raw bytes would be (fp32, bool).
absl::Status TensorBytes(const ModelInferRequest& request, const absl::string_view* raw,
                         int index, DType dtype, absl::string_view* data) {
  const auto& tensor = request.inputs(index);
  if (raw != nullptr) {
    *data = *raw;
    return absl::OkStatus();
  }
  const inference::InferTensorContents& c = tensor.contents();
  switch (dtype) {
    case DType::kFloat32:
      *data = absl::string_view(reinterpret_cast<const char*>(c.fp32_contents().data()),
                                c.fp32_contents_size() * sizeof(float));
      return absl::OkStatus();
    case DType::kBool:
      static_assert(sizeof(bool) == 1);
      *data = absl::string_view(reinterpret_cast<const char*>(c.bool_contents().data()),
                                c.bool_contents_size());
      return absl::OkStatus();
    default:  // as Triton: FP16 and BF16 have no typed contents
      return absl::InvalidArgumentError(absl::StrCat(
          "input '", tensor.name(), "': ", KServeDatatype(dtype),
          " data must be sent in raw_input_contents (the protocol has no typed contents for it)"));
  }
}

// An integer input (key_lengths [B], positions [B, Lk]) of rank `rank`,
// widened to int64.
absl::Status DecodeIntegers(const ModelInferRequest& request, const absl::string_view* raw_bytes,
                            int index, int rank, const char* layout, std::vector<int64_t>* out) {
  const auto& tensor = request.inputs(index);
  const std::string& name = tensor.name();
  const std::string& t = tensor.datatype();
  if (t != "INT32" && t != "INT64") {
    return absl::InvalidArgumentError(absl::StrCat(
        "input '", name, "': datatype must be INT32 or INT64, got '", t, "'"));
  }
  if (tensor.shape_size() != rank) {
    return absl::InvalidArgumentError(absl::StrCat("input '", name, "': shape must be ", layout,
                                                   ", got rank ", tensor.shape_size()));
  }
  int64_t n = 1;
  for (int64_t d : tensor.shape()) {
    if (d < 0 || (d > 0 && n > INT64_MAX / 8 / d)) {
      return absl::InvalidArgumentError(absl::StrCat("input '", name, "': shape [",
                                                     absl::StrJoin(tensor.shape(), ", "),
                                                     "] is not a valid size"));
    }
    n *= d;
  }
  const bool wide = t == "INT64";
  if (raw_bytes != nullptr) {
    const absl::string_view raw = *raw_bytes;
    const size_t width = wide ? 8 : 4;
    if (raw.size() != static_cast<size_t>(n) * width) {
      return absl::InvalidArgumentError(absl::StrCat(
          "input '", name, "': expected ", n, " x ", width, " bytes for shape [",
          absl::StrJoin(tensor.shape(), ", "), "] ", t, ", got ", raw.size()));
    }
    out->resize(n);
    for (int64_t i = 0; i < n; ++i) {
      if (wide) {
        std::memcpy(&(*out)[i], raw.data() + 8 * i, 8);
      } else {
        int32_t v;
        std::memcpy(&v, raw.data() + 4 * i, 4);
        (*out)[i] = v;
      }
    }
  } else if (wide) {
    out->assign(tensor.contents().int64_contents().begin(),
                tensor.contents().int64_contents().end());
  } else {
    out->assign(tensor.contents().int_contents().begin(), tensor.contents().int_contents().end());
  }
  if (static_cast<int64_t>(out->size()) != n) {
    return absl::InvalidArgumentError(absl::StrCat("input '", name, "': shape [",
                                                   absl::StrJoin(tensor.shape(), ", "), "] but ",
                                                   out->size(), " values"));
  }
  return absl::OkStatus();
}

absl::Status BoolParameter(const std::string& name, const InferParameter& p, bool* out) {
  if (p.parameter_choice_case() != InferParameter::kBoolParam) {
    return absl::InvalidArgumentError(
        absl::StrCat("parameter '", name, "': must be a bool (bool_param)"));
  }
  *out = p.bool_param();
  return absl::OkStatus();
}

// A float parameter (scale, softcap): double_param or int64_param.
absl::Status NumberParameter(const std::string& name, const InferParameter& p, float* out) {
  if (p.parameter_choice_case() == InferParameter::kDoubleParam) {
    *out = static_cast<float>(p.double_param());
  } else if (p.parameter_choice_case() == InferParameter::kInt64Param) {
    *out = static_cast<float>(p.int64_param());
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("parameter '", name, "': must be a number (double_param or int64_param)"));
  }
  return absl::OkStatus();
}

// A tensor's parameters: only the shared-memory ones (Triton's
// extension). `who` names the tensor in errors; checked in name order, as
// the request's parameters, so that the first bad one is the same every time.
absl::Status TensorParameters(const google::protobuf::Map<std::string, InferParameter>& params,
                              const std::string& who, SharedMemoryTensor* shm) {
  bool has_size = false, has_offset = false;
  absl::InlinedVector<const google::protobuf::MapPair<std::string, InferParameter>*, 4> entries;
  for (const auto& entry : params) entries.push_back(&entry);
  std::sort(entries.begin(), entries.end(),
            [](const auto* a, const auto* b) { return a->first < b->first; });
  for (const auto* entry : entries) {
    const std::string& name = entry->first;
    const InferParameter& p = entry->second;
    const bool is_integer = p.parameter_choice_case() == InferParameter::kInt64Param ||
                            p.parameter_choice_case() == InferParameter::kUint64Param;
    const int64_t value =
        p.parameter_choice_case() == InferParameter::kInt64Param
            ? p.int64_param()
            : static_cast<int64_t>(std::min<uint64_t>(p.uint64_param(), INT64_MAX));
    if (name == "shared_memory_region") {
      if (p.parameter_choice_case() != InferParameter::kStringParam || p.string_param().empty()) {
        return absl::InvalidArgumentError(absl::StrCat(
            who, ": parameter 'shared_memory_region' must be a region's name (string_param)"));
      }
      shm->region = p.string_param();
    } else if (name == "shared_memory_byte_size" || name == "shared_memory_offset") {
      if (!is_integer || value < 0) {
        return absl::InvalidArgumentError(absl::StrCat(
            who, ": parameter '", name, "' must be an integer >= 0 (int64_param)"));
      }
      (name == "shared_memory_offset" ? shm->offset : shm->byte_size) = value;
      (name == "shared_memory_offset" ? has_offset : has_size) = true;
    } else {
      return absl::InvalidArgumentError(absl::StrCat(
          who, ": parameter '", name, "' is not supported; a tensor's parameters are "
          "shared_memory_region, shared_memory_byte_size, shared_memory_offset"));
    }
  }
  if (!shm->region.empty() && !has_size) {
    return absl::InvalidArgumentError(
        absl::StrCat(who, ": shared_memory_region needs shared_memory_byte_size"));
  }
  if (shm->region.empty() && (has_size || has_offset)) {
    return absl::InvalidArgumentError(absl::StrCat(
        who, ": shared_memory_", has_size ? "byte_size" : "offset",
        " needs shared_memory_region"));
  }
  return absl::OkStatus();
}

// Looks up `shm`'s bytes in `access.regions`.
absl::Status FindSharedMemory(const SharedMemoryAccess& access, const std::string& who,
                              SharedMemoryTensor* shm) {
  if (access.regions == nullptr) {
    return access.refusal.ok()
               ? absl::InvalidArgumentError(absl::StrCat(
                     who, ": this server takes no tensors in shared memory"))
               : absl::Status(access.refusal.code(),
                              absl::StrCat(who, ": ", access.refusal.message()));
  }
  absl::StatusOr<SystemSharedMemory::Span> span =
      access.regions->Find(who, shm->region, shm->offset, shm->byte_size);
  if (!span.ok()) return span.status();
  shm->span = *std::move(span);
  return absl::OkStatus();
}

bool Overlap(const SystemSharedMemory::Span& a, const SystemSharedMemory::Span& b) {
  const auto a0 = reinterpret_cast<uintptr_t>(a.data);
  const auto b0 = reinterpret_cast<uintptr_t>(b.data);
  return a.size > 0 && b.size > 0 && a0 < b0 + b.size && b0 < a0 + a.size;
}

absl::Status DecodeParameters(const ModelInferRequest& request, KServeRequest* decoded) {
  AttendInputs& in = decoded->inputs;
  // In name order: a protobuf map iterates in an order of its own, which
  // two copies of one request need not share, and the first bad parameter
  // must be the same one every time.
  absl::InlinedVector<const google::protobuf::MapPair<std::string, InferParameter>*, 8> entries;
  for (const auto& entry : request.parameters()) entries.push_back(&entry);
  std::sort(entries.begin(), entries.end(),
            [](const auto* a, const auto* b) { return a->first < b->first; });
  for (const auto* entry : entries) {
    const std::string& name = entry->first;
    const InferParameter& p = entry->second;
    absl::Status s;
    if (name == "causal") {
      s = BoolParameter(name, p, &in.causal);
    } else if (name == "need_weights") {
      s = BoolParameter(name, p, &in.need_weights);
    } else if (name == "average_weights") {
      s = BoolParameter(name, p, &in.average_weights);
    } else if (name == "scale") {
      s = NumberParameter(name, p, &in.scale);
    } else if (name == "window") {
      if (p.parameter_choice_case() == InferParameter::kInt64Param) {
        in.window = p.int64_param();
      } else if (p.parameter_choice_case() == InferParameter::kUint64Param) {
        in.window = static_cast<int64_t>(std::min<uint64_t>(p.uint64_param(), INT64_MAX));
      } else {
        s = absl::InvalidArgumentError("parameter 'window': must be an integer (int64_param)");
      }
    } else if (name == "softcap") {
      s = NumberParameter(name, p, &in.softcap);
    } else if (name == "session_id") {
      if (p.parameter_choice_case() != InferParameter::kStringParam) {
        s = absl::InvalidArgumentError("parameter 'session_id': must be a string (string_param)");
      } else {
        in.session_id = p.string_param();
      }
    } else if (name == "triton_enable_empty_final_response") {
      // Triton's directive for decoupled models (a final empty response on a
      // stream); perf_analyzer sends it on every request. Every attnserve
      // model answers each request with exactly one response, as Triton's
      // non-decoupled models do, which also ignore it.
      bool unused;
      s = BoolParameter(name, p, &unused);
    } else if (name == "priority") {
      // Triton's request priority (tritonclient's `priority=`): accepted and
      // without effect, as on a Triton model without priority levels;
      // attnserve's queues have one level.
    } else if (name == "timeout") {
      // Triton's request timeout, in microseconds.
      if (p.parameter_choice_case() == InferParameter::kInt64Param && p.int64_param() >= 0) {
        decoded->timeout_us = p.int64_param();
      } else if (p.parameter_choice_case() == InferParameter::kUint64Param) {
        decoded->timeout_us = static_cast<int64_t>(std::min<uint64_t>(p.uint64_param(), INT64_MAX));
      } else {
        s = absl::InvalidArgumentError(
            "parameter 'timeout': must be a non-negative integer (microseconds)");
      }
    } else {
      s = absl::InvalidArgumentError(absl::StrCat("parameter '", name,
                                                  "' is not supported; parameters are ",
                                                  kParameterNames));
    }
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

}  // namespace

const char* KServeDatatype(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return "FP32";
    case DType::kFloat16: return "FP16";
    case DType::kBFloat16: return "BF16";
    case DType::kBool: return "BOOL";
  }
  return "FP32";
}

absl::Status DecodeModelInferRequest(const ModelInferRequest& request, KServeRequest* decoded,
                                     absl::Span<const HostBuffer> raw_inputs,
                                     const SharedMemoryAccess& shm) {
  const RawContents raw(request, raw_inputs);
  AttendInputs& in = decoded->inputs;
  in.model = request.model_name();
  if (!request.model_version().empty() && request.model_version() != "1") {
    // NOT_FOUND, as ModelReady/ModelMetadata answer an unknown version.
    return absl::NotFoundError(absl::StrCat(
        "model_version: model '", request.model_name(), "' has only version \"1\" (or \"\"), got \"",
        request.model_version(), "\""));
  }
  // Each input's shared-memory parameters; raw_input_contents entries go,
  // in order, to the inputs that are not in shared memory.
  absl::InlinedVector<SharedMemoryTensor, 8> shared(request.inputs_size());
  int raw_expected = 0;
  for (int i = 0; i < request.inputs_size(); ++i) {
    const auto& tensor = request.inputs(i);
    if (!tensor.parameters().empty()) {
      if (absl::Status s = TensorParameters(tensor.parameters(),
                                            absl::StrCat("input '", tensor.name(), "'"),
                                            &shared[i]);
          !s.ok()) {
        return s;
      }
    }
    if (shared[i].region.empty()) {
      ++raw_expected;
    } else if (tensor.has_contents()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "input '", tensor.name(), "': contents and shared_memory_region are both set; send one"));
    }
  }
  if (raw.size() > 0 && raw.size() != raw_expected) {
    return absl::InvalidArgumentError(absl::StrCat(
        "raw_input_contents: expected one entry per input not in shared memory (", raw_expected,
        "), got ", raw.size()));
  }
  if (absl::Status s = DecodeParameters(request, decoded); !s.ok()) return s;

  bool seen_key_lengths = false, seen_positions = false;
  int raw_index = 0;
  for (int i = 0; i < request.inputs_size(); ++i) {
    const auto& tensor = request.inputs(i);
    const std::string& name = tensor.name();
    // The input's bytes when they are not its typed contents.
    absl::string_view bytes;
    const absl::string_view* raw_bytes = nullptr;
    if (!shared[i].region.empty()) {
      if (absl::Status s = FindSharedMemory(shm, absl::StrCat("input '", name, "'"), &shared[i]);
          !s.ok()) {
        return s;
      }
      bytes = absl::string_view(shared[i].span.data, shared[i].span.size);
      raw_bytes = &bytes;
      decoded->shared_inputs.push_back(std::move(shared[i]));
    } else if (raw.size() > 0) {
      if (tensor.has_contents()) {
        return absl::InvalidArgumentError(absl::StrCat(
            "input '", name, "': contents and raw_input_contents are both set; send one"));
      }
      bytes = raw[raw_index++];
      raw_bytes = &bytes;
    }
    if (name == "key_lengths" || name == "positions") {
      const bool lengths = name == "key_lengths";
      bool& seen = lengths ? seen_key_lengths : seen_positions;
      if (seen) {
        return absl::InvalidArgumentError(absl::StrCat("input '", name,
                                                       "' is given more than once"));
      }
      seen = true;
      std::vector<int64_t>& values = lengths ? decoded->key_lengths : decoded->positions;
      absl::Status s = lengths ? DecodeIntegers(request, raw_bytes, i, 1,
                                                "[B] (one length per batch element)", &values)
                               : DecodeIntegers(request, raw_bytes, i, 2,
                                                "[B, Lk] (the position of every key token)",
                                                &values);
      if (!s.ok()) return s;
      (lengths ? in.key_lengths : in.positions) = values;
      continue;
    }
    InputTensor* target = name == "query"       ? &in.query
                          : name == "key"       ? &in.key
                          : name == "value"     ? &in.value
                          : name == "attn_mask" ? &in.attn_mask
                          : name == "sinks"     ? &in.sinks
                                                : nullptr;
    if (target == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat("input '", name, "' is not an input of attention; inputs are ", kInputNames));
    }
    if (target->present) {
      return absl::InvalidArgumentError(absl::StrCat("input '", name, "' is given more than once"));
    }
    target->present = true;
    target->shape.assign(tensor.shape().begin(), tensor.shape().end());
    absl::Status s = TensorDType(tensor, target == &in.attn_mask, &target->dtype);
    if (s.ok()) s = TensorBytes(request, raw_bytes, i, target->dtype, &target->data);
    target->decode_error = s;
  }

  if (request.outputs_size() > 0) {
    decoded->return_output = false;
    decoded->return_weights = false;
    for (const auto& out : request.outputs()) {
      const bool is_output = out.name() == "output";
      if (!is_output && out.name() != "weights") {
        return absl::InvalidArgumentError(absl::StrCat(
            "requested output '", out.name(), "' is not an output of attention; outputs are "
            "output, weights"));
      }
      bool& wanted = is_output ? decoded->return_output : decoded->return_weights;
      if (wanted) {
        return absl::InvalidArgumentError(
            absl::StrCat("requested output '", out.name(), "' is given more than once"));
      }
      wanted = true;
      if (!is_output) in.need_weights = true;  // asking for the output is asking for it computed
      if (out.parameters().empty()) continue;
      const std::string who = absl::StrCat("requested output '", out.name(), "'");
      SharedMemoryTensor& target = is_output ? decoded->shared_output : decoded->shared_weights;
      if (absl::Status s = TensorParameters(out.parameters(), who, &target); !s.ok()) return s;
      if (target.region.empty()) continue;
      if (absl::Status s = FindSharedMemory(shm, who, &target); !s.ok()) return s;
      // The engine reads the inputs while it writes the outputs.
      for (const SharedMemoryTensor& input : decoded->shared_inputs) {
        if (Overlap(target.span, input.span)) {
          return absl::InvalidArgumentError(absl::StrCat(
              who, ": its shared memory overlaps the bytes of an input (region '", input.region,
              "'); give the outputs bytes of their own"));
        }
      }
    }
    if (Overlap(decoded->shared_output.span, decoded->shared_weights.span)) {
      return absl::InvalidArgumentError(
          "requested outputs 'output' and 'weights': their shared memory overlaps; give each "
          "bytes of its own");
    }
  } else {
    decoded->return_weights = in.need_weights;
  }
  return absl::OkStatus();
}

absl::StatusOr<MutableTensorView> AddSharedMemoryOutput(inference::ModelInferResponse* response,
                                                        OutputName name, DType dtype,
                                                        const Shape& shape,
                                                        const SharedMemoryTensor& target) {
  MutableTensorView view = AddKServeOutput(response, name, dtype, shape);
  if (view.byte_size() > target.span.size) {
    return absl::InvalidArgumentError(absl::StrCat(
        "requested output '", response->outputs(response->outputs_size() - 1).name(),
        "': shared_memory_byte_size ", target.byte_size, " is too small for the result (",
        view.byte_size(), " bytes)"));
  }
  auto& params = *response->mutable_outputs(response->outputs_size() - 1)->mutable_parameters();
  params["shared_memory_region"].set_string_param(target.region);
  params["shared_memory_byte_size"].set_int64_param(static_cast<int64_t>(view.byte_size()));
  if (target.offset != 0) params["shared_memory_offset"].set_int64_param(target.offset);
  view.data = target.span.data;
  return view;
}

MutableTensorView AddKServeOutput(inference::ModelInferResponse* response, OutputName name,
                                  DType dtype, const Shape& shape) {
  auto* out = response->add_outputs();
  out->set_name(name == OutputName::kOutput ? "output" : "weights");
  out->set_datatype(KServeDatatype(dtype));
  out->mutable_shape()->Assign(shape.begin(), shape.end());
  response->add_raw_output_contents();
  return MutableTensorView{dtype, shape, nullptr};
}

MutableTensorView AllocateKServeOutput(inference::ModelInferResponse* response, OutputName name,
                                       DType dtype, const Shape& shape) {
  MutableTensorView view = AddKServeOutput(response, name, dtype, shape);
  std::string* data =
      response->mutable_raw_output_contents(response->raw_output_contents_size() - 1);
  data->resize(view.byte_size());
  view.data = data->data();
  return view;
}

std::vector<int> KeepRequestedOutputs(const KServeRequest& decoded,
                                      inference::ModelInferResponse* response) {
  std::vector<int> removed;
  for (int i = response->outputs_size() - 1; i >= 0; --i) {
    const bool keep = response->outputs(i).name() == "output" ? decoded.return_output
                                                              : decoded.return_weights;
    if (keep) continue;
    response->mutable_outputs()->DeleteSubrange(i, 1);
    response->mutable_raw_output_contents()->DeleteSubrange(i, 1);
    removed.push_back(i);
  }
  return removed;
}

}  // namespace attnserve
