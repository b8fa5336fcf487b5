// What the KServe wire tests compare (kserve_wire_test and
// kserve_grpc_request_fuzzer): a request's bytes in one canonical order, and
// what the request path sees of it after DecodeModelInferRequest, as text.
// Free of gtest, so that the fuzz target can use it.
#ifndef ATTNSERVE_TESTS_UNIT_SERVER_KSERVE_REQUEST_TEXT_H_
#define ATTNSERVE_TESTS_UNIT_SERVER_KSERVE_REQUEST_TEXT_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "engine/host_buffer.h"
#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/io/zero_copy_stream_impl_lite.h"
#include "google/protobuf/message.h"
#include "inference/grpc_service.pb.h"
#include "server/transport/kserve_codec.h"

namespace attnserve::kserve_testing {

// Protobuf's bytes for `m` with map entries in key order (`parameters` is a
// map, which two equal messages may otherwise write in either order). False
// when protobuf cannot serialize it.
inline bool CanonicalBytes(const google::protobuf::Message& m, std::string* out) {
  out->clear();
  google::protobuf::io::StringOutputStream stream(out);
  google::protobuf::io::CodedOutputStream coded(&stream);
  coded.SetSerializationDeterministic(true);
  return m.SerializeToCodedStream(&coded);  // `coded` flushes into `out` when it goes
}

// DecodeModelInferRequest's verdict on `request` (its raw contents in
// `raw_inputs`, or its own when that is empty) and everything it decoded:
// each input's presence, dtype, error, shape and bytes, the integer inputs,
// the outputs asked for and the timeout. `status` (nullable) receives the
// verdict.
inline std::string DecodedText(const inference::ModelInferRequest& request,
                               absl::Span<const HostBuffer> raw_inputs,
                               absl::Status* status = nullptr) {
  KServeRequest d;
  const absl::Status s = DecodeModelInferRequest(request, &d, raw_inputs);
  if (status != nullptr) *status = s;
  std::string out = s.ToString() + "|" + std::string(d.inputs.model);
  for (const InputTensor* t : {&d.inputs.query, &d.inputs.key, &d.inputs.value,
                               &d.inputs.attn_mask}) {
    out += "|" + std::to_string(t->present) + "," + std::to_string(static_cast<int>(t->dtype)) +
           "," + t->decode_error.ToString() + ",";
    for (int64_t n : t->shape) out += std::to_string(n) + "x";
    out += "," + std::string(t->data);
  }
  for (int64_t n : d.key_lengths) out += "|k" + std::to_string(n);
  for (int64_t n : d.positions) out += "|p" + std::to_string(n);
  out += "|" + std::to_string(d.return_output) + std::to_string(d.return_weights) + "|" +
         std::to_string(d.timeout_us);
  return out;
}

}  // namespace attnserve::kserve_testing

#endif  // ATTNSERVE_TESTS_UNIT_SERVER_KSERVE_REQUEST_TEXT_H_
