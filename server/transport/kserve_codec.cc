// ModelInferRequest -> KServeInferInputs, and result tensors -> ModelInferResponse.
#include "server/transport/kserve_codec.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <utility>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"

namespace attnserve {
namespace {

using inference::InferParameter;
using inference::InferTensorContents;
using inference::ModelInferRequest;

constexpr char kInputNames[] = "query, key, value, attn_mask, key_lengths";
// Request parameters attnserve reads; the one list every "unknown
// parameter" message quotes. A new parameter is a row here and a branch in
// ApplyParameter.
constexpr const char* kParameterNames[] = {
    "causal", "scale", "need_weights", "average_weights", "timeout", "priority",
    "triton_enable_empty_final_response"};

// ---------------------------------------------------------------- parameters

const char* ParameterKind(const InferParameter& p) {
  switch (p.parameter_choice_case()) {
    case InferParameter::kBoolParam: return "bool_param";
    case InferParameter::kInt64Param: return "int64_param";
    case InferParameter::kStringParam: return "string_param";
    case InferParameter::kDoubleParam: return "double_param";
    case InferParameter::kUint64Param: return "uint64_param";
    case InferParameter::PARAMETER_CHOICE_NOT_SET: break;
  }
  return "no value";
}

absl::StatusOr<bool> BoolParameter(const std::string& key, const InferParameter& p) {
  if (p.parameter_choice_case() == InferParameter::kBoolParam) return p.bool_param();
  return absl::InvalidArgumentError(absl::StrCat("parameters['", key,
                                                 "']: must be a bool (bool_param), got ",
                                                 ParameterKind(p)));
}

// double_param, or an integer (clients send 1 for 1.0).
absl::StatusOr<double> NumberParameter(const std::string& key, const InferParameter& p) {
  switch (p.parameter_choice_case()) {
    case InferParameter::kDoubleParam: return p.double_param();
    case InferParameter::kInt64Param: return static_cast<double>(p.int64_param());
    case InferParameter::kUint64Param: return static_cast<double>(p.uint64_param());
    default: break;
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "parameters['", key, "']: must be a number (double_param, int64_param or uint64_param), got ",
      ParameterKind(p)));
}

absl::Status ApplyParameter(const std::string& key, const InferParameter& p,
                            KServeInferInputs* out) {
  AttendInputs& in = out->inputs;
  auto set_bool = [&](bool* field) -> absl::Status {
    absl::StatusOr<bool> v = BoolParameter(key, p);
    if (!v.ok()) return v.status();
    *field = *v;
    return absl::OkStatus();
  };
  if (key == "causal") return set_bool(&in.causal);
  if (key == "need_weights") return set_bool(&in.need_weights);
  if (key == "average_weights") return set_bool(&in.average_weights);
  if (key == "triton_enable_empty_final_response") return set_bool(&out->flag_final_response);
  if (key == "scale") {
    absl::StatusOr<double> v = NumberParameter(key, p);
    if (!v.ok()) return v.status();
    // Out of float range becomes inf, which validation refuses by name.
    in.scale = static_cast<float>(*v);
    return absl::OkStatus();
  }
  if (key == "timeout") {
    // Triton's queue timeout, in microseconds; 0 = none.
    int64_t us = 0;
    if (p.parameter_choice_case() == InferParameter::kInt64Param) {
      us = p.int64_param();
    } else if (p.parameter_choice_case() == InferParameter::kUint64Param) {
      us = static_cast<int64_t>(std::min<uint64_t>(p.uint64_param(), INT64_MAX));
    } else {
      return absl::InvalidArgumentError(absl::StrCat(
          "parameters['timeout']: must be an integer number of microseconds (int64_param or "
          "uint64_param), got ",
          ParameterKind(p)));
    }
    if (us < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("parameters['timeout']: must be >= 0 microseconds (0 = none), got ", us));
    }
    if (us > 0) out->timeout = absl::Microseconds(us);
    return absl::OkStatus();
  }
  // Accepted and ignored: there is one priority level.
  if (key == "priority") return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat("parameters: unknown parameter '", key,
                                                 "' (attnserve takes ",
                                                 absl::StrJoin(kParameterNames, ", "), ")"));
}

// ---------------------------------------------------------------- tensors

// The typed content fields that hold values, by name.
std::vector<const char*> FilledContents(const InferTensorContents& c) {
  std::vector<const char*> filled;
  if (c.bool_contents_size() > 0) filled.push_back("bool_contents");
  if (c.int_contents_size() > 0) filled.push_back("int_contents");
  if (c.int64_contents_size() > 0) filled.push_back("int64_contents");
  if (c.uint_contents_size() > 0) filled.push_back("uint_contents");
  if (c.uint64_contents_size() > 0) filled.push_back("uint64_contents");
  if (c.fp32_contents_size() > 0) filled.push_back("fp32_contents");
  if (c.fp64_contents_size() > 0) filled.push_back("fp64_contents");
  if (c.bytes_contents_size() > 0) filled.push_back("bytes_contents");
  return filled;
}

// The typed contents field of `datatype`, or nullptr when it has none that
// attnserve reads (FP16, BF16 travel raw).
const char* ContentsField(absl::string_view datatype) {
  if (datatype == "FP32") return "fp32_contents";
  if (datatype == "BOOL") return "bool_contents";
  if (datatype == "INT32") return "int_contents";
  if (datatype == "INT64") return "int64_contents";
  return nullptr;
}

// The typed contents of one input: only the field of its datatype, holding
// exactly one value per element (when the shape is valid; a bad shape is
// validation's to report).
absl::Status CheckTypedContents(const ModelInferRequest::InferInputTensor& t,
                                int64_t values_in_field) {
  const char* field = ContentsField(t.datatype());
  const std::vector<const char*> filled = FilledContents(t.contents());
  if (field == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        t.name(), ": ", t.datatype(),
        " data must be sent in raw_input_contents (the typed contents have no field for it)"));
  }
  for (const char* f : filled) {
    if (std::strcmp(f, field) != 0) {
      return absl::InvalidArgumentError(absl::StrCat(t.name(), ".contents: ", t.datatype(),
                                                     " values go in ", field, ", got ", f));
    }
  }
  absl::StatusOr<int64_t> elements = NumElements(t.shape());
  if (elements.ok() && *elements != values_in_field) {
    return absl::InvalidArgumentError(
        absl::StrCat(t.name(), ".contents.", field, ": expected ", *elements, " values for shape ",
                     ShapeString(t.shape()), ", got ", values_in_field));
  }
  return absl::OkStatus();
}

// Raw bytes of one input: exactly elements * element size (when the shape is
// valid).
absl::Status CheckRawSize(const ModelInferRequest::InferInputTensor& t, int index,
                          size_t element_size, size_t bytes) {
  absl::StatusOr<int64_t> elements = NumElements(t.shape());
  if (!elements.ok()) return absl::OkStatus();
  const double expected = static_cast<double>(*elements) * static_cast<double>(element_size);
  if (expected == static_cast<double>(bytes)) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      "raw_input_contents[", index, "] (", t.name(), "): expected ", *elements, " x ",
      element_size, " = ", absl::StrFormat("%.0f", expected), " bytes for ", t.datatype(), " ",
      ShapeString(t.shape()), ", got ", bytes));
}

absl::StatusOr<DType> TensorDType(const ModelInferRequest::InferInputTensor& t) {
  const std::string& d = t.datatype();
  if (d == "FP32") return DType::kFloat32;
  if (d == "FP16") return DType::kFloat16;
  if (d == "BF16") return DType::kBFloat16;
  if (d == "BOOL") return DType::kBool;
  return absl::InvalidArgumentError(absl::StrCat(
      t.name(), ".datatype: must be FP32, FP16 or BF16 (attn_mask: BOOL or the query's type), ",
      "got '", d, "'"));
}

// One of query, key, value, attn_mask. `raw`: its raw_input_contents entry, or
// nullptr when the request uses typed contents.
InputTensor DecodeTensor(const ModelInferRequest::InferInputTensor& t, int index,
                         const std::string* raw) {
  InputTensor in;
  in.present = true;
  in.shape.assign(t.shape().begin(), t.shape().end());
  absl::StatusOr<DType> dtype = TensorDType(t);
  if (!dtype.ok()) {
    in.decode_error = dtype.status();
    return in;
  }
  in.dtype = *dtype;
  if (raw != nullptr) {
    in.decode_error = CheckRawSize(t, index, DTypeSize(in.dtype), raw->size());
    in.data = *raw;
    return in;
  }
  const InferTensorContents& c = t.contents();
  if (in.dtype == DType::kFloat32) {
    in.decode_error = CheckTypedContents(t, c.fp32_contents_size());
    // Little-endian IEEE floats, as the raw form: viewed, not copied.
    in.data = absl::string_view(reinterpret_cast<const char*>(c.fp32_contents().data()),
                                sizeof(float) * c.fp32_contents_size());
  } else if (in.dtype == DType::kBool) {
    static_assert(sizeof(bool) == 1, "BOOL tensors are one byte per element");
    in.decode_error = CheckTypedContents(t, c.bool_contents_size());
    in.data = absl::string_view(reinterpret_cast<const char*>(c.bool_contents().data()),
                                c.bool_contents_size());
  } else {
    in.decode_error = CheckTypedContents(t, 0);
  }
  return in;
}

// key_lengths: INT32 or INT64, shape [B], widened into `out`.
absl::Status DecodeKeyLengths(const ModelInferRequest::InferInputTensor& t, int index,
                              const std::string* raw, std::vector<int64_t>* out) {
  const std::string& d = t.datatype();
  if (d != "INT32" && d != "INT64") {
    return absl::InvalidArgumentError(
        absl::StrCat("key_lengths.datatype: must be INT32 or INT64, got '", d, "'"));
  }
  if (t.shape_size() != 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "key_lengths.shape: expected [B] (one length per batch element), got ",
        ShapeString(t.shape())));
  }
  const bool is32 = d == "INT32";
  if (raw != nullptr) {
    const size_t size = is32 ? sizeof(int32_t) : sizeof(int64_t);
    if (absl::Status s = CheckRawSize(t, index, size, raw->size()); !s.ok()) return s;
    out->resize(raw->size() / size);
    for (size_t i = 0; i < out->size(); ++i) {
      if (is32) {
        int32_t v;
        std::memcpy(&v, raw->data() + i * size, size);
        (*out)[i] = v;
      } else {
        std::memcpy(&(*out)[i], raw->data() + i * size, size);
      }
    }
    return absl::OkStatus();
  }
  const InferTensorContents& c = t.contents();
  if (is32) {
    if (absl::Status s = CheckTypedContents(t, c.int_contents_size()); !s.ok()) return s;
    out->assign(c.int_contents().begin(), c.int_contents().end());
  } else {
    if (absl::Status s = CheckTypedContents(t, c.int64_contents_size()); !s.ok()) return s;
    out->assign(c.int64_contents().begin(), c.int64_contents().end());
  }
  return absl::OkStatus();
}

// Everything that is not one tensor's own business; the first error wins.
absl::Status DecodeRequest(const ModelInferRequest& request, KServeInferInputs* out) {
  AttendInputs& in = out->inputs;
  if (absl::Status s = CheckModelVersion(request.model_name(), request.model_version()); !s.ok()) {
    return s;
  }
  // Parameters, in name order so that the error reported is always the same.
  std::map<std::string, const InferParameter*> parameters;
  for (const auto& [key, value] : request.parameters()) parameters[key] = &value;
  for (const auto& [key, value] : parameters) {
    if (absl::Status s = ApplyParameter(key, *value, out); !s.ok()) return s;
  }

  const bool raw = request.raw_input_contents_size() > 0;
  if (raw && request.raw_input_contents_size() != request.inputs_size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "raw_input_contents: expected one entry per input (", request.inputs_size(),
        " inputs), got ", request.raw_input_contents_size()));
  }
  bool has_key_lengths = false;
  for (int i = 0; i < request.inputs_size(); ++i) {
    const ModelInferRequest::InferInputTensor& t = request.inputs(i);
    const std::string* bytes = raw ? &request.raw_input_contents(i) : nullptr;
    if (raw && !FilledContents(t.contents()).empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("inputs[", i, "] (", t.name(),
                       "): contents must be empty when raw_input_contents is used"));
    }
    if (!raw && FilledContents(t.contents()).empty()) {
      absl::StatusOr<int64_t> elements = NumElements(t.shape());
      if (elements.ok()) {
        return absl::InvalidArgumentError(absl::StrCat(
            "inputs[", i, "] (", t.name(), "): no data (send it in raw_input_contents, or in ",
            "contents.", ContentsField(t.datatype()) ? ContentsField(t.datatype()) : "<field>",
            ")"));
      }
    }
    InputTensor* tensor = nullptr;
    if (t.name() == "query") {
      tensor = &in.query;
    } else if (t.name() == "key") {
      tensor = &in.key;
    } else if (t.name() == "value") {
      tensor = &in.value;
    } else if (t.name() == "attn_mask") {
      tensor = &in.attn_mask;
    } else if (t.name() == "key_lengths") {
      if (has_key_lengths) {
        return absl::InvalidArgumentError(
            absl::StrCat("inputs[", i, "]: input 'key_lengths' is given twice"));
      }
      has_key_lengths = true;
      if (absl::Status s = DecodeKeyLengths(t, i, bytes, &out->key_lengths); !s.ok()) return s;
      continue;
    } else {
      return absl::InvalidArgumentError(absl::StrCat("inputs[", i, "]: unknown input '", t.name(),
                                                     "' (attnserve models take ", kInputNames,
                                                     ")"));
    }
    if (tensor->present) {
      return absl::InvalidArgumentError(
          absl::StrCat("inputs[", i, "]: input '", t.name(), "' is given twice"));
    }
    *tensor = DecodeTensor(t, i, bytes);
  }
  in.key_lengths = out->key_lengths;

  // Outputs: requesting weights asks for them.
  if (request.outputs_size() > 0) {
    out->return_output = false;
    for (int i = 0; i < request.outputs_size(); ++i) {
      const std::string& name = request.outputs(i).name();
      if (name == "output") {
        out->return_output = true;
      } else if (name == "weights") {
        out->return_weights = true;
        in.need_weights = true;
      } else {
        return absl::InvalidArgumentError(absl::StrCat("outputs[", i, "]: unknown output '",
                                                       name, "' (attnserve models have output, "
                                                       "weights)"));
      }
    }
  } else {
    out->return_weights = in.need_weights;
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status CheckModelVersion(absl::string_view model, absl::string_view version) {
  if (version.empty() || version == kKServeModelVersion) return absl::OkStatus();
  return absl::NotFoundError(absl::StrCat("model '", model, "' has no version '", version,
                                          "' (attnserve serves version \"",
                                          kKServeModelVersion,
                                          "\" of each model; an empty version means it)"));
}

const char* KServeDatatype(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return "FP32";
    case DType::kFloat16: return "FP16";
    case DType::kBFloat16: return "BF16";
    case DType::kBool: return "BOOL";
  }
  return "FP32";
}

void DecodeModelInferRequest(const ModelInferRequest& request, KServeInferInputs* out) {
  out->inputs.model = request.model_name();
  out->inputs.decode_error = DecodeRequest(request, out);
}

MutableTensorView AllocateKServeOutput(const KServeInferInputs& decoded,
                                       inference::ModelInferResponse* response,
                                       std::string* scratch, OutputName name, DType dtype,
                                       const Shape& shape) {
  MutableTensorView view{dtype, shape, nullptr};
  const bool returned =
      name == OutputName::kOutput ? decoded.return_output : decoded.return_weights;
  std::string* data = scratch;
  if (returned) {
    inference::ModelInferResponse::InferOutputTensor* t = response->add_outputs();
    t->set_name(name == OutputName::kOutput ? "output" : "weights");
    t->set_datatype(KServeDatatype(dtype));
    t->mutable_shape()->Assign(shape.begin(), shape.end());
    // Entries of a repeated bytes field are separate strings: adding the
    // next one does not move this one's buffer.
    data = response->add_raw_output_contents();
  }
  data->resize(view.byte_size());
  view.data = data->data();
  return view;
}

}  // namespace attnserve
