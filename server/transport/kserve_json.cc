// The SAX handler that reads an infer request's JSON header, the binary
// part's split among the inputs, and RapidJSON writers for the answers.
#include "server/transport/kserve_json.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "google/protobuf/util/json_util.h"
#include "rapidjson/error/en.h"
#include "rapidjson/reader.h"
#include "rapidjson/stringbuffer.h"
#include "rapidjson/writer.h"

namespace attnserve {
namespace {

using inference::InferParameter;
using inference::ModelInferRequest;

// Bytes of one element of a datatype JSON data may hold; 0 = not in JSON.
size_t JsonElementSize(const std::string& datatype) {
  if (datatype == "FP32" || datatype == "INT32") return 4;
  if (datatype == "INT64") return 8;
  if (datatype == "BOOL") return 1;
  return 0;
}

// One input as the header describes it.
struct Input {
  std::string name, datatype;
  std::vector<int64_t> shape;
  bool has_shape = false;
  int64_t binary_size = -1;  // >= 0: its bytes are in the binary part
  bool has_data = false;
  std::string raw;    // the values, little-endian, as raw_input_contents holds them
  int64_t count = 0;  // values read from "data"
  // "data" read before "datatype": kept as numbers until it is known.
  std::vector<double> pending;
  bool pending_bool = false;
  // Its shared-memory parameters (shared_memory_region, _byte_size,
  // _offset), passed on to the request as they are.
  google::protobuf::Map<std::string, InferParameter> shared_memory;
};

struct Output {
  std::string name;
  bool binary = false, has_binary = false;
  google::protobuf::Map<std::string, InferParameter> shared_memory;  // as Input's
};

bool IsSharedMemoryParameter(const std::string& key) {
  return key == "shared_memory_region" || key == "shared_memory_byte_size" ||
         key == "shared_memory_offset";
}

// Where the reader is. Each Start* pushes, each End* pops.
enum class At {
  kTop,           // the request object
  kParameters,    // "parameters": {...}
  kInputs,        // "inputs": [...]
  kInput,         // one input object
  kShape,         // its "shape": [...]
  kInputParams,   // its "parameters": {...}
  kData,          // its "data", at any depth of nesting
  kOutputs,       // "outputs": [...]
  kOutput,        // one output object
  kOutputParams,  // its "parameters": {...}
};

class Handler : public rapidjson::BaseReaderHandler<rapidjson::UTF8<>, Handler> {
 public:
  ModelInferRequest* request = nullptr;
  size_t json_bytes = 0;  // the JSON header's size
  std::vector<Input> inputs;
  std::vector<Output> outputs;
  bool binary_by_default = false;
  absl::Status error;

  bool StartObject() {
    if (stack_.empty()) return Push(At::kTop);
    switch (Top()) {
      case At::kTop:
        if (key_ == "parameters") return Push(At::kParameters);
        return Fail(absl::StrCat("\"", key_, "\" must not be an object"));
      case At::kInputs:
        inputs.emplace_back();
        return Push(At::kInput);
      case At::kInput:
        if (key_ == "parameters") return Push(At::kInputParams);
        return Fail(InputField(absl::StrCat("\"", key_, "\" must not be an object")));
      case At::kOutputs:
        outputs.emplace_back();
        return Push(At::kOutput);
      case At::kOutput:
        if (key_ == "parameters") return Push(At::kOutputParams);
        return Fail(absl::StrCat("outputs: \"", key_, "\" must not be an object"));
      default:
        return Fail(Where("must not hold an object"));
    }
  }
  bool EndObject(rapidjson::SizeType) { return Pop(); }

  bool StartArray() {
    if (stack_.empty()) return Fail("request body: must be a JSON object, got an array");
    switch (Top()) {
      case At::kTop:
        if (key_ == "inputs") return Push(At::kInputs);
        if (key_ == "outputs") return Push(At::kOutputs);
        return Fail(absl::StrCat("\"", key_, "\" must not be an array"));
      case At::kInput:
        if (key_ == "shape") {
          Current().has_shape = true;
          return Push(At::kShape);
        }
        if (key_ == "data") {
          if (Current().has_data) return Fail(InputField("\"data\" is given twice"));
          Current().has_data = true;
          StartData();
          return Push(At::kData);
        }
        return Fail(InputField(absl::StrCat("\"", key_, "\" must not be an array")));
      case At::kData:
        return Push(At::kData);  // nested rows: flattened row-major
      default:
        return Fail(Where("must not hold an array"));
    }
  }
  bool EndArray(rapidjson::SizeType) { return Pop(); }

  bool Key(const char* str, rapidjson::SizeType length, bool) {
    key_.assign(str, length);
    switch (Top()) {
      case At::kTop:
        if (key_ == "id" || key_ == "parameters" || key_ == "inputs" || key_ == "outputs") {
          return true;
        }
        return Fail(absl::StrCat("\"", key_,
                                 "\" is not a field of an infer request; fields are id, "
                                 "parameters, inputs, outputs"));
      case At::kInput:
        if (key_ == "name" || key_ == "shape" || key_ == "datatype" || key_ == "data" ||
            key_ == "parameters") {
          return true;
        }
        return Fail(InputField(absl::StrCat("\"", key_,
                                            "\" is not a field of an input; fields are name, "
                                            "shape, datatype, parameters, data")));
      case At::kOutput:
        if (key_ == "name" || key_ == "parameters") return true;
        return Fail(absl::StrCat("outputs: \"", key_,
                                 "\" is not a field of an output; fields are name, parameters"));
      case At::kInputParams:
        if (key_ == "binary_data_size" || IsSharedMemoryParameter(key_)) return true;
        return Fail(InputField(absl::StrCat(
            "parameter '", key_,
            "' is not supported; input parameters are binary_data_size, shared_memory_region, "
            "shared_memory_byte_size, shared_memory_offset")));
      case At::kOutputParams:
        if (key_ == "binary_data" || IsSharedMemoryParameter(key_)) return true;
        return Fail(absl::StrCat("outputs: parameter '", key_,
                                 "' is not supported; output parameters are binary_data, "
                                 "shared_memory_region, shared_memory_byte_size, "
                                 "shared_memory_offset (no classification)"));
      default:
        return true;
    }
  }

  bool String(const char* str, rapidjson::SizeType length, bool) {
    const std::string value(str, length);
    switch (Top()) {
      case At::kTop:
        if (key_ == "id") {
          request->set_id(value);
          return true;
        }
        break;
      case At::kParameters:
        (*request->mutable_parameters())[key_].set_string_param(value);
        return true;
      case At::kInput:
        if (key_ == "name") {
          Current().name = value;
          return true;
        }
        if (key_ == "datatype") {
          Current().datatype = value;
          return true;
        }
        break;
      case At::kOutput:
        if (key_ == "name") {
          outputs.back().name = value;
          return true;
        }
        break;
      case At::kInputParams:
      case At::kOutputParams:
        if (key_ == "shared_memory_region") {
          (Top() == At::kInputParams ? Current().shared_memory : outputs.back().shared_memory)
              [key_].set_string_param(value);
          return true;
        }
        break;
      default:
        break;
    }
    return Fail(Where("must not be a string"));
  }

  bool Bool(bool b) {
    switch (Top()) {
      case At::kParameters:
        if (key_ == "binary_data_output") {
          binary_by_default = b;
        } else {
          (*request->mutable_parameters())[key_].set_bool_param(b);
        }
        return true;
      case At::kOutputParams:  // binary_data: Key() refuses every other key
        outputs.back().binary = b;
        outputs.back().has_binary = true;
        return true;
      case At::kData:
        return DataBool(b);
      default:
        return Fail(Where("must not be true or false"));
    }
  }

  bool Int(int i) { return Integer(i); }
  bool Uint(unsigned u) { return Integer(u); }
  bool Int64(int64_t i) { return Integer(i); }
  bool Uint64(uint64_t u) {
    if (u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      if (Top() == At::kData) return DataNumber(static_cast<double>(u), false);
      return Fail(Where(absl::StrCat("must fit in int64, got ", u)));
    }
    return Integer(static_cast<int64_t>(u));
  }
  bool Double(double d) {
    switch (Top()) {
      case At::kParameters:
        (*request->mutable_parameters())[key_].set_double_param(d);
        return true;
      case At::kData:
        return DataNumber(d, false);
      default:
        return Fail(Where(absl::StrCat("must be an integer, got ", d)));
    }
  }
  bool Null() { return Fail(Where("must not be null")); }

  // After the parse: every input's datatype known, pending data converted.
  bool Finish() {
    for (Input& in : inputs) {
      if (!in.pending.empty() && !WritePending(in)) return false;
    }
    return true;
  }

 private:
  At Top() const { return stack_.empty() ? At::kTop : stack_.back(); }
  bool Push(At at) {
    // RapidJSON recurses per level: deep nesting would exhaust the stack.
    if (stack_.size() >= kMaxDepth) {
      return Fail(absl::StrCat("request body: JSON nested deeper than ", kMaxDepth,
                               " levels (a tensor's \"data\" nests once per dim)"));
    }
    stack_.push_back(at);
    return true;
  }
  static constexpr size_t kMaxDepth = 40;
  bool Pop() {
    stack_.pop_back();
    return true;
  }
  Input& Current() { return inputs.back(); }

  bool Fail(std::string message) {
    if (error.ok()) error = absl::InvalidArgumentError(std::move(message));
    return false;
  }
  // "input 'query': <what>" (or the input's position while it has no name).
  std::string InputField(absl::string_view what) {
    const Input& in = inputs.back();
    const std::string who = in.name.empty() ? absl::StrCat("inputs[", inputs.size() - 1, "]")
                                            : absl::StrCat("input '", in.name, "'");
    return absl::StrCat(who, ": ", what);
  }
  std::string Where(absl::string_view what) {
    switch (Top()) {
      case At::kParameters:
        return absl::StrCat("parameter '", key_, "': ", what);
      case At::kInput:
      case At::kInputParams:
        return InputField(absl::StrCat("\"", key_, "\" ", what));
      case At::kShape:
        return InputField(absl::StrCat("shape ", what));
      case At::kData:
        return InputField(absl::StrCat("data ", what));
      case At::kOutput:
      case At::kOutputParams:
        return absl::StrCat("outputs: \"", key_, "\" ", what);
      default:
        return absl::StrCat("\"", key_, "\" ", what);
    }
  }

  bool Integer(int64_t i) {
    switch (Top()) {
      case At::kParameters:
        (*request->mutable_parameters())[key_].set_int64_param(i);
        return true;
      case At::kShape:
        Current().shape.push_back(i);
        return true;
      case At::kInputParams:  // Key() refuses every other key
        if (IsSharedMemoryParameter(key_)) {
          Current().shared_memory[key_].set_int64_param(i);  // checked by the codec
          return true;
        }
        if (i < 0) {
          return Fail(InputField(absl::StrCat("binary_data_size must be >= 0, got ", i)));
        }
        Current().binary_size = i;
        return true;
      case At::kOutputParams:
        if (IsSharedMemoryParameter(key_)) {
          outputs.back().shared_memory[key_].set_int64_param(i);
          return true;
        }
        break;
      case At::kData:
        return DataNumber(static_cast<double>(i), true, i);
      default:
        break;
    }
    return Fail(Where(absl::StrCat("must not be a number, got ", i)));
  }

  // The first value of an input's "data": reserve its bytes when the shape
  // and datatype are already known.
  void StartData() {
    Input& in = Current();
    const size_t size = JsonElementSize(in.datatype);
    if (size == 0 || !in.has_shape) return;
    int64_t n = 1;
    for (int64_t d : in.shape) {
      if (d < 0 || (d > 0 && n > (int64_t{1} << 40) / d)) return;  // validation reports it
      n *= d;
    }
    // A shape may claim more values than the JSON can hold (two bytes each,
    // a digit and a comma): never reserve for more than that.
    n = std::min<int64_t>(n, static_cast<int64_t>(json_bytes / 2 + 1));
    in.raw.reserve(static_cast<size_t>(n) * size);
  }

  bool DataBool(bool b) {
    Input& in = Current();
    if (in.datatype.empty()) {
      in.pending.push_back(b ? 1.0 : 0.0);
      in.pending_bool = true;
      return true;
    }
    if (in.datatype != "BOOL") {
      return Fail(InputField(absl::StrCat("data holds true/false, datatype is ", in.datatype)));
    }
    in.raw.push_back(b ? 1 : 0);
    ++in.count;
    return true;
  }

  // One number of "data" (integral: `exact` holds it exactly).
  bool DataNumber(double d, bool integral, int64_t exact = 0) {
    Input& in = Current();
    if (in.datatype.empty()) {
      in.pending.push_back(d);
      return true;
    }
    return Append(in, d, integral, exact);
  }

  bool Append(Input& in, double d, bool integral, int64_t exact) {
    ++in.count;
    if (in.datatype == "FP32") {
      if (!(std::fabs(d) <= std::numeric_limits<float>::max())) {
        return Fail(InputField(absl::StrCat("data value ", d, " is beyond FP32's range")));
      }
      const float f = static_cast<float>(d);
      in.raw.append(reinterpret_cast<const char*>(&f), sizeof f);
      return true;
    }
    if (in.datatype == "INT32" || in.datatype == "INT64") {
      if (!integral) {
        return Fail(
            InputField(absl::StrCat("data must hold integers for ", in.datatype, ", got ", d)));
      }
      if (in.datatype == "INT32") {
        if (exact < std::numeric_limits<int32_t>::min() ||
            exact > std::numeric_limits<int32_t>::max()) {
          return Fail(InputField(absl::StrCat("data value ", exact, " does not fit INT32")));
        }
        const int32_t v = static_cast<int32_t>(exact);
        in.raw.append(reinterpret_cast<const char*>(&v), sizeof v);
      } else {
        in.raw.append(reinterpret_cast<const char*>(&exact), sizeof exact);
      }
      return true;
    }
    if (in.datatype == "BOOL") {
      return Fail(InputField("data must hold true/false for BOOL"));
    }
    if (in.datatype == "FP16" || in.datatype == "BF16") {
      return Fail(InputField(absl::StrCat(in.datatype,
                                          " data must be sent as binary data "
                                          "(\"parameters\": {\"binary_data_size\": n}), as in "
                                          "Triton: JSON has no such numbers")));
    }
    return Fail(
        InputField(absl::StrCat("datatype must be FP32, FP16, BF16, BOOL, INT32 or "
                                "INT64, got '",
                                in.datatype, "'")));
  }

  bool WritePending(Input& in) {
    std::vector<double> values = std::move(in.pending);
    in.pending.clear();
    for (double d : values) {
      if (in.pending_bool && in.datatype == "BOOL") {
        in.raw.push_back(d != 0 ? 1 : 0);
        ++in.count;
        continue;
      }
      // Kept as doubles: integers are exact only up to 2^53.
      constexpr double kExact = 9007199254740992.0;
      const bool integral = std::isfinite(d) && std::trunc(d) == d;
      if (integral && std::fabs(d) > kExact && in.datatype.rfind("INT", 0) == 0) {
        return Fail(
            InputField(absl::StrCat("data value ", d,
                                    " came before \"datatype\" and is beyond 2^53, where it may "
                                    "have been rounded: give \"datatype\" before \"data\"")));
      }
      const int64_t exact = integral && std::fabs(d) <= kExact ? static_cast<int64_t>(d) : 0;
      if (!Append(in, d, integral && std::fabs(d) <= kExact, exact)) return false;
    }
    return true;
  }

  std::vector<At> stack_;
  std::string key_;
};

// "key": value, for a string field.
void Field(rapidjson::Writer<rapidjson::StringBuffer>& w, const char* key,
           const std::string& value) {
  w.Key(key);
  w.String(value.data(), static_cast<rapidjson::SizeType>(value.size()));
}

void WriteShape(rapidjson::Writer<rapidjson::StringBuffer>& w,
                const google::protobuf::RepeatedField<int64_t>& shape) {
  w.Key("shape");
  w.StartArray();
  for (int64_t d : shape) w.Int64(d);
  w.EndArray();
}

template <typename T>
void WriteValues(rapidjson::Writer<rapidjson::StringBuffer>& w, const std::string& raw) {
  const size_t n = raw.size() / sizeof(T);
  for (size_t i = 0; i < n; ++i) {
    T v;
    std::memcpy(&v, raw.data() + i * sizeof(T), sizeof(T));
    if constexpr (std::is_same_v<T, float>) {
      w.Double(static_cast<double>(v));
    } else if constexpr (std::is_same_v<T, uint8_t>) {
      w.Bool(v != 0);
    } else {
      w.Int64(static_cast<int64_t>(v));
    }
  }
}

}  // namespace

absl::Status DecodeJsonInferRequest(std::string* body_text, int64_t header_length,
                                    const std::string& model, const std::string& version,
                                    JsonInferRequest* out) {
  std::string& body = *body_text;
  if (header_length > static_cast<int64_t>(body.size())) {
    return absl::InvalidArgumentError(
        absl::StrCat("Inference-Header-Content-Length: ", header_length,
                     " is more than the body's ", body.size(), " bytes"));
  }
  const size_t json_size = header_length < 0 ? body.size() : static_cast<size_t>(header_length);
  if (body.find('\0') < json_size) {
    return absl::InvalidArgumentError(absl::StrCat(
        "request body: a NUL byte at offset ", body.find('\0'), " of the JSON header",
        header_length < 0 ? " (binary data needs the Inference-Header-Content-Length header)"
                          : ""));
  }
  ModelInferRequest& request = out->request;
  request.set_model_name(model);
  request.set_model_version(version);

  // In situ: strings are decoded in the body's own bytes, so RapidJSON
  // needs no stack of its own (1.1.0's first push does pointer arithmetic on
  // null, which UBSan reports). The JSON part ends with a NUL for the
  // parse: the byte after it is set aside and put back.
  const char after = body[json_size];  // '\0' past the end of a std::string
  body[json_size] = '\0';
  Handler handler;
  handler.request = &request;
  handler.json_bytes = json_size;
  rapidjson::Reader reader;
  rapidjson::InsituStringStream stream(body.data());
  const rapidjson::ParseResult parsed =
      reader.Parse<rapidjson::kParseInsituFlag | rapidjson::kParseStopWhenDoneFlag>(stream,
                                                                                    handler);
  const size_t consumed = stream.Tell();
  body[json_size] = after;
  const absl::string_view json(body.data(), json_size);
  const absl::string_view binary = absl::string_view(body).substr(json_size);
  if (!handler.error.ok()) return handler.error;
  if (parsed.IsError()) {
    return absl::InvalidArgumentError(absl::StrCat("request body: malformed JSON at offset ",
                                                   parsed.Offset(), ": ",
                                                   rapidjson::GetParseError_En(parsed.Code())));
  }
  if (consumed < json.size()) {
    // Whitespace may follow the object; anything else is not JSON.
    for (size_t i = consumed; i < json.size(); ++i) {
      const char c = json[i];
      if (c != ' ' && c != '\n' && c != '\r' && c != '\t') {
        return absl::InvalidArgumentError(absl::StrCat(
            "request body: unexpected bytes after the JSON object at offset ", i,
            header_length < 0 ? " (binary data needs the Inference-Header-Content-Length header)"
                              : ""));
      }
    }
  }
  if (!handler.Finish()) return handler.error;

  size_t offset = 0;
  for (Input& in : handler.inputs) {
    if (in.name.empty()) return absl::InvalidArgumentError("inputs: every input needs a \"name\"");
    const std::string who = absl::StrCat("input '", in.name, "'");
    if (in.datatype.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(who, ": \"datatype\" is required"));
    }
    if (!in.has_shape)
      return absl::InvalidArgumentError(absl::StrCat(who, ": \"shape\" is required"));
    auto* tensor = request.add_inputs();
    tensor->set_name(in.name);
    tensor->set_datatype(in.datatype);
    tensor->mutable_shape()->Assign(in.shape.begin(), in.shape.end());
    if (!in.shared_memory.empty()) {
      // Its bytes are in shared memory: no raw_input_contents entry (the
      // codec checks the parameters themselves).
      if (in.has_data || in.binary_size >= 0) {
        return absl::InvalidArgumentError(absl::StrCat(
            who, ": both ", in.has_data ? "\"data\"" : "binary_data_size",
            " and shared memory parameters are given; send one"));
      }
      *tensor->mutable_parameters() = std::move(in.shared_memory);
      continue;
    }
    if (in.binary_size >= 0) {
      if (in.has_data) {
        return absl::InvalidArgumentError(
            absl::StrCat(who, ": both \"data\" and binary_data_size are given; send one"));
      }
      if (offset + static_cast<uint64_t>(in.binary_size) > binary.size()) {
        return absl::InvalidArgumentError(
            absl::StrCat(who, ": binary_data_size ", in.binary_size, " runs past the binary data (",
                         binary.size() - offset, " bytes left of ", binary.size(), ")"));
      }
      request.add_raw_input_contents()->assign(binary.data() + offset,
                                               static_cast<size_t>(in.binary_size));
      offset += static_cast<size_t>(in.binary_size);
      continue;
    }
    if (!in.has_data) {
      return absl::InvalidArgumentError(absl::StrCat(
          who, ": no values: give \"data\" or \"parameters\": {\"binary_data_size\": n}"));
    }
    int64_t elements = 1;
    bool valid = true;
    for (int64_t d : in.shape) {
      if (d < 0 || (d > 0 && elements > std::numeric_limits<int64_t>::max() / d)) valid = false;
      if (valid) elements *= d;
    }
    if (valid && elements != in.count) {
      return absl::InvalidArgumentError(
          absl::StrCat(who, ": shape holds ", elements, " elements, \"data\" has ", in.count));
    }
    *request.add_raw_input_contents() = std::move(in.raw);
  }
  if (offset != binary.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("binary data: the inputs' binary_data_size add up to ", offset,
                     " bytes, the body has ", binary.size(), " after the JSON header"));
  }
  out->binary_by_default = handler.binary_by_default;
  for (const Output& o : handler.outputs) {
    if (o.name.empty()) return absl::InvalidArgumentError("outputs: every output needs a \"name\"");
    auto* requested = request.add_outputs();
    requested->set_name(o.name);
    *requested->mutable_parameters() = o.shared_memory;
    if (o.has_binary) out->binary_output[o.name] = o.binary;
  }
  return absl::OkStatus();
}

std::string EncodeJsonInferResponse(const inference::ModelInferResponse& response,
                                    const JsonInferRequest& request,
                                    std::vector<absl::string_view>* binary_outputs) {
  rapidjson::StringBuffer buffer;
  rapidjson::Writer<rapidjson::StringBuffer> w(buffer);
  w.StartObject();
  Field(w, "model_name", response.model_name());
  Field(w, "model_version", response.model_version());
  if (!response.id().empty()) {
    Field(w, "id", response.id());
  }
  if (response.parameters_size() > 0) {
    w.Key("parameters");
    w.StartObject();
    for (const auto& [name, p] : response.parameters()) {
      w.Key(name.c_str());
      switch (p.parameter_choice_case()) {
        case InferParameter::kBoolParam:
          w.Bool(p.bool_param());
          break;
        case InferParameter::kInt64Param:
          w.Int64(p.int64_param());
          break;
        case InferParameter::kDoubleParam:
          w.Double(p.double_param());
          break;
        case InferParameter::kUint64Param:
          w.Uint64(p.uint64_param());
          break;
        default:
          w.String(p.string_param().c_str());
          break;
      }
    }
    w.EndObject();
  }
  std::vector<int> binary;
  w.Key("outputs");
  w.StartArray();
  for (int i = 0; i < response.outputs_size(); ++i) {
    const auto& o = response.outputs(i);
    const std::string& raw = response.raw_output_contents(i);
    auto chosen = request.binary_output.find(o.name());
    bool as_binary =
        chosen != request.binary_output.end() ? chosen->second : request.binary_by_default;
    if (o.datatype() == "FP16" || o.datatype() == "BF16") as_binary = true;
    w.StartObject();
    Field(w, "name", o.name());
    Field(w, "datatype", o.datatype());
    WriteShape(w, o.shape());
    if (o.parameters().contains("shared_memory_region")) {
      // Written into the client's shared memory: the region, no data.
      w.Key("parameters");
      w.StartObject();
      for (const char* key :
           {"shared_memory_region", "shared_memory_byte_size", "shared_memory_offset"}) {
        auto p = o.parameters().find(key);
        if (p == o.parameters().end()) continue;
        w.Key(key);
        if (p->second.parameter_choice_case() == InferParameter::kStringParam) {
          w.String(p->second.string_param().c_str());
        } else {
          w.Int64(p->second.int64_param());
        }
      }
      w.EndObject();
    } else if (as_binary) {
      w.Key("parameters");
      w.StartObject();
      w.Key("binary_data_size");
      w.Uint64(raw.size());
      w.EndObject();
      binary.push_back(i);
    } else {
      w.Key("data");
      w.StartArray();
      if (o.datatype() == "FP32") WriteValues<float>(w, raw);
      if (o.datatype() == "BOOL") WriteValues<uint8_t>(w, raw);
      if (o.datatype() == "INT32") WriteValues<int32_t>(w, raw);
      if (o.datatype() == "INT64") WriteValues<int64_t>(w, raw);
      w.EndArray();
    }
    w.EndObject();
  }
  w.EndArray();
  w.EndObject();
  binary_outputs->clear();
  for (int i : binary) binary_outputs->push_back(response.raw_output_contents(i));
  return std::string(buffer.GetString(), buffer.GetSize());
}

namespace {

// {"ready": bool}: the one field of a repository index request.
struct IndexHandler : rapidjson::BaseReaderHandler<rapidjson::UTF8<>, IndexHandler> {
  bool ready = false;
  int depth = 0;
  std::string key, error;
  bool Default() {
    error = "must be {\"ready\": true|false}";
    return false;
  }
  bool StartObject() { return ++depth == 1 || Default(); }
  bool EndObject(rapidjson::SizeType) { return --depth >= 0; }
  bool Key(const char* str, rapidjson::SizeType length, bool) {
    key.assign(str, length);
    return key == "ready" || Default();
  }
  bool Bool(bool b) {
    ready = b;
    return true;
  }
};

// The body of a model load or unload request, {"parameters": {NAME: VALUE}},
// read as SAX events in place (a DOM would use RapidJSON's value stack,
// whose first push offsets a null pointer). Each parameter goes through
// CheckModelRepositoryParameter.
struct RepositoryHandler : rapidjson::BaseReaderHandler<rapidjson::UTF8<>, RepositoryHandler> {
  explicit RepositoryHandler(bool unload) : unload(unload) {}
  const bool unload;
  int depth = 0;  // 1: in the body object; 2: in "parameters"
  std::string key;
  absl::Status error;

  bool Fail(absl::Status s) {
    error = std::move(s);
    return false;
  }
  // A value that is not an object where one is read: at depth 0 the body, at
  // depth 1 "parameters"; at depth 2 a parameter's value (is_bool: a bool).
  bool Value(bool is_bool) {
    if (depth == 0) return Fail(absl::InvalidArgumentError("request body: must be a JSON object"));
    if (depth == 1) return Fail(absl::InvalidArgumentError("parameters: must be a JSON object"));
    absl::Status s = CheckModelRepositoryParameter(key, is_bool, unload);
    return s.ok() || Fail(std::move(s));
  }
  bool Default() { return Value(false); }
  bool Bool(bool) { return Value(true); }
  bool StartObject() {
    if (depth == 0 || depth == 1) {  // the body, or "parameters" (the only key allowed)
      ++depth;
      return true;
    }
    return Value(false);
  }
  bool EndObject(rapidjson::SizeType) { return --depth >= 0; }
  bool Key(const char* str, rapidjson::SizeType length, bool) {
    key.assign(str, length);
    if (depth == 1 && key != "parameters") {
      return Fail(absl::InvalidArgumentError(absl::StrCat(
          "request body: unknown field \"", key, "\" (only \"parameters\")")));
    }
    return true;
  }
};

}  // namespace

absl::StatusOr<bool> DecodeIndexRequest(std::string* body) {
  if (body->find_first_not_of(" \t\r\n") == std::string::npos) return false;
  IndexHandler handler;
  rapidjson::Reader reader;
  rapidjson::InsituStringStream stream(body->data());  // std::string ends with a NUL
  const rapidjson::ParseResult parsed = reader.Parse<rapidjson::kParseInsituFlag>(stream, handler);
  if (!handler.error.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("request body: ", handler.error));
  }
  if (parsed.IsError()) {
    return absl::InvalidArgumentError(absl::StrCat("request body: malformed JSON at offset ",
                                                   parsed.Offset(), ": ",
                                                   rapidjson::GetParseError_En(parsed.Code())));
  }
  return handler.ready;
}

namespace {

// {"key": string, "offset": number, "byte_size": number}: a system
// shared-memory register request's fields, "key" and "byte_size" required.
struct RegisterHandler : rapidjson::BaseReaderHandler<rapidjson::UTF8<>, RegisterHandler> {
  SharedMemoryRegistration* out = nullptr;
  bool has_key = false, has_size = false;
  int depth = 0;
  std::string key;
  absl::Status error;
  bool Fail(std::string message) {
    if (error.ok()) error = absl::InvalidArgumentError(std::move(message));
    return false;
  }
  bool Default() {
    return Fail(depth == 1 ? absl::StrCat("request body: \"", key, "\" has the wrong type")
                           : "request body: must be {\"key\": string, \"offset\": number, "
                             "\"byte_size\": number}");
  }
  bool StartObject() { return ++depth == 1 || Default(); }
  bool EndObject(rapidjson::SizeType) { return --depth >= 0; }
  bool Key(const char* str, rapidjson::SizeType length, bool) {
    key.assign(str, length);
    if (key == "key" || key == "offset" || key == "byte_size") return true;
    return Fail(absl::StrCat("request body: unknown field \"", key,
                             "\" (fields are key, offset, byte_size)"));
  }
  bool String(const char* str, rapidjson::SizeType length, bool) {
    if (key != "key") return Default();
    out->key.assign(str, length);
    has_key = true;
    return true;
  }
  bool Number(uint64_t n) {
    if (key == "key") return Default();
    (key == "offset" ? out->offset : out->byte_size) = n;
    if (key == "byte_size") has_size = true;
    return true;
  }
  bool Uint(unsigned n) { return Number(n); }
  bool Uint64(uint64_t n) { return Number(n); }
  bool Int(int n) { return n >= 0 ? Number(static_cast<uint64_t>(n)) : Negative(); }
  bool Int64(int64_t n) { return n >= 0 ? Number(static_cast<uint64_t>(n)) : Negative(); }
  bool Negative() { return Fail(absl::StrCat("request body: \"", key, "\" must be >= 0")); }
};

// Parses `body` in place with `handler` (SAX, whose `error` holds its own
// refusal): the handler's error first, else RapidJSON's, naming the offset.
template <typename Handler>
absl::Status ParseInPlace(std::string* body, Handler& handler) {
  rapidjson::Reader reader;
  rapidjson::InsituStringStream stream(body->data());  // std::string ends with a NUL
  const rapidjson::ParseResult parsed = reader.Parse<rapidjson::kParseInsituFlag>(stream, handler);
  if (!handler.error.ok()) return handler.error;
  if (parsed.IsError()) {
    return absl::InvalidArgumentError(absl::StrCat("request body: malformed JSON at offset ",
                                                   parsed.Offset(), ": ",
                                                   rapidjson::GetParseError_En(parsed.Code())));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<SharedMemoryRegistration> DecodeSharedMemoryRegisterRequest(std::string* body) {
  SharedMemoryRegistration registration;
  RegisterHandler handler;
  handler.out = &registration;
  if (absl::Status s = ParseInPlace(body, handler); !s.ok()) return s;
  if (!handler.has_key || !handler.has_size) {
    return absl::InvalidArgumentError(absl::StrCat("request body: \"",
                                                   handler.has_key ? "byte_size" : "key",
                                                   "\" is required"));
  }
  return registration;
}

absl::Status DecodeModelRepositoryRequest(std::string* body, bool unload) {
  if (body->find_first_not_of(" \t\r\n") == std::string::npos) return absl::OkStatus();
  RepositoryHandler handler(unload);
  return ParseInPlace(body, handler);
}

absl::Status CheckModelRepositoryParameter(const std::string& name, bool is_bool, bool unload) {
  if (unload && name == "unload_dependents") {
    if (is_bool) return absl::OkStatus();
    return absl::InvalidArgumentError("parameters: \"unload_dependents\" must be a bool");
  }
  if (unload) {
    return absl::InvalidArgumentError(absl::StrCat(
        "parameters: \"", name, "\" is not supported by unload (only \"unload_dependents\")"));
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "parameters: \"", name, "\" is not supported: attnserve loads a model from the "
      "repository's files as they are (change config.pbtxt and weights.safetensors there)"));
}

std::string ErrorJson(absl::string_view message) {
  rapidjson::StringBuffer buffer;
  rapidjson::Writer<rapidjson::StringBuffer> w(buffer);
  w.StartObject();
  w.Key("error");
  w.String(message.data(), static_cast<rapidjson::SizeType>(message.size()));
  w.EndObject();
  return std::string(buffer.GetString(), buffer.GetSize());
}

namespace {

void WriteTensors(
    rapidjson::Writer<rapidjson::StringBuffer>& w, const char* key,
    const google::protobuf::RepeatedPtrField<inference::ModelMetadataResponse::TensorMetadata>&
        tensors) {
  w.Key(key);
  w.StartArray();
  for (const auto& t : tensors) {
    w.StartObject();
    Field(w, "name", t.name());
    Field(w, "datatype", t.datatype());
    WriteShape(w, t.shape());
    w.EndObject();
  }
  w.EndArray();
}

std::string Done(const rapidjson::StringBuffer& buffer) {
  return std::string(buffer.GetString(), buffer.GetSize());
}

void WriteDuration(rapidjson::Writer<rapidjson::StringBuffer>& w, const char* key,
                   const inference::StatisticDuration& d) {
  w.Key(key);
  w.StartObject();
  w.Key("count");
  w.Uint64(d.count());
  w.Key("ns");
  w.Uint64(d.ns());
  w.EndObject();
}

}  // namespace

std::string ServerMetadataJson(const inference::ServerMetadataResponse& m) {
  rapidjson::StringBuffer buffer;
  rapidjson::Writer<rapidjson::StringBuffer> w(buffer);
  w.StartObject();
  Field(w, "name", m.name());
  Field(w, "version", m.version());
  w.Key("extensions");
  w.StartArray();
  for (const auto& e : m.extensions()) w.String(e.c_str());
  w.EndArray();
  w.EndObject();
  return Done(buffer);
}

std::string ModelMetadataJson(const inference::ModelMetadataResponse& m) {
  rapidjson::StringBuffer buffer;
  rapidjson::Writer<rapidjson::StringBuffer> w(buffer);
  w.StartObject();
  Field(w, "name", m.name());
  w.Key("versions");
  w.StartArray();
  for (const auto& v : m.versions()) w.String(v.c_str());
  w.EndArray();
  Field(w, "platform", m.platform());
  WriteTensors(w, "inputs", m.inputs());
  WriteTensors(w, "outputs", m.outputs());
  w.EndObject();
  return Done(buffer);
}

std::string RepositoryIndexJson(const inference::RepositoryIndexResponse& index) {
  rapidjson::StringBuffer buffer;
  rapidjson::Writer<rapidjson::StringBuffer> w(buffer);
  w.StartArray();
  for (const auto& m : index.models()) {
    w.StartObject();
    Field(w, "name", m.name());
    Field(w, "version", m.version());
    Field(w, "state", m.state());
    Field(w, "reason", m.reason());
    w.EndObject();
  }
  w.EndArray();
  return Done(buffer);
}

std::string SystemSharedMemoryStatusJson(
    const inference::SystemSharedMemoryStatusResponse& status) {
  // By name: the protobuf map's own order is its own.
  std::map<std::string, const inference::SystemSharedMemoryStatusResponse::RegionStatus*> regions;
  for (const auto& [name, region] : status.regions()) regions[name] = &region;
  rapidjson::StringBuffer buffer;
  rapidjson::Writer<rapidjson::StringBuffer> w(buffer);
  w.StartArray();
  for (const auto& [name, region] : regions) {
    w.StartObject();
    Field(w, "name", region->name());
    Field(w, "key", region->key());
    w.Key("offset");
    w.Uint64(region->offset());
    w.Key("byte_size");
    w.Uint64(region->byte_size());
    w.EndObject();
  }
  w.EndArray();
  return Done(buffer);
}

std::string ModelStatisticsJson(const inference::ModelStatisticsResponse& stats) {
  rapidjson::StringBuffer buffer;
  rapidjson::Writer<rapidjson::StringBuffer> w(buffer);
  w.StartObject();
  w.Key("model_stats");
  w.StartArray();
  for (const auto& s : stats.model_stats()) {
    w.StartObject();
    Field(w, "name", s.name());
    Field(w, "version", s.version());
    w.Key("last_inference");
    w.Uint64(s.last_inference());
    w.Key("inference_count");
    w.Uint64(s.inference_count());
    w.Key("execution_count");
    w.Uint64(s.execution_count());
    w.Key("inference_stats");
    w.StartObject();
    const auto& is = s.inference_stats();
    WriteDuration(w, "success", is.success());
    WriteDuration(w, "fail", is.fail());
    WriteDuration(w, "queue", is.queue());
    WriteDuration(w, "compute_input", is.compute_input());
    WriteDuration(w, "compute_infer", is.compute_infer());
    WriteDuration(w, "compute_output", is.compute_output());
    w.EndObject();
    w.EndObject();
  }
  w.EndArray();
  w.EndObject();
  return Done(buffer);
}

std::string ModelConfigJson(const inference::ModelConfigResponse& config) {
  std::string json;
  google::protobuf::util::JsonPrintOptions options;
  options.preserve_proto_field_names = true;
  (void)google::protobuf::util::MessageToJsonString(config.config(), &json, options);
  return json;
}

}  // namespace attnserve
