// Fuzz target: one serialized KServe v2 ModelInferRequest through the gRPC
// front end's own parse (ParseModelInferRequest on a grpc::ByteBuffer of two
// slices: the raw_input_contents into host buffers), which must agree with
// protobuf's own parse (ParseRequestMessage) on the error or on the message,
// then through DecodeModelInferRequest both ways, which must give the same
// inputs, byte for byte, or the same error. Aborts on a crash, a sanitizer
// report, or any disagreement.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/slice.h"
#include "server/transport/kserve_codec.h"
#include "server/transport/kserve_wire.h"
#include "server/transport/message_codec.h"
#include "server/transport/protobuf_log.h"
#include "tests/unit/server/kserve_request_text.h"

namespace attnserve {
namespace {

[[noreturn]] void Fail(const std::string& what) {
  std::fprintf(stderr, "kserve_grpc_request_fuzzer: %s\n", what.c_str());
  std::abort();
}

// Protobuf's bytes for `m`, map entries in key order.
std::string Canonical(const google::protobuf::Message& m) {
  std::string out;
  if (!kserve_testing::CanonicalBytes(m, &out)) Fail("a parsed request does not serialize");
  return out;
}

// What the request path sees of a request, as text.
std::string Decoded(const inference::ModelInferRequest& request,
                    const std::vector<HostBuffer>& raw_inputs) {
  absl::Status s;
  std::string text = kserve_testing::DecodedText(request, raw_inputs, &s);
  if (!s.ok() && s.message().empty()) Fail("decoding refused without a message");
  return text;
}

void RunOne(const uint8_t* data, size_t size) {
  static const std::shared_ptr<HostBufferPool> pool = [] {
    InstallProtobufLogHandler();  // protobuf's complaints become the error, as in the server
    return HostBufferPool::Ordinary();
  }();
  // As gRPC hands a message over: in slices (two, cut inside the message).
  grpc::Slice head(data, size / 3), tail(data + size / 3, size - size / 3);
  grpc::Slice halves[] = {head, tail};
  inference::ModelInferRequest oracle;
  grpc::ByteBuffer oracle_bytes(halves, 2);
  const absl::Status oracle_status = ParseRequestMessage(&oracle_bytes, "request", 0, &oracle);
  grpc::ByteBuffer bytes(halves, 2);
  inference::ModelInferRequest request;
  std::vector<HostBuffer> raw_inputs;
  static PayloadCopier* const copier = new PayloadCopier(1);
  const absl::Status parsed =
      ParseModelInferRequest(&bytes, "request", 0, *pool, *copier, &request, &raw_inputs);
  if (parsed != oracle_status) {
    Fail("ParseModelInferRequest: " + parsed.ToString() +
         "; protobuf: " + oracle_status.ToString());
  }
  if (!parsed.ok()) {
    if (!raw_inputs.empty() || request.ByteSizeLong() != 0) Fail("a refused parse kept something");
    return;
  }
  if (!raw_inputs.empty() && request.raw_input_contents_size() != 0) {
    Fail("raw contents both in buffers and in the message");
  }
  inference::ModelInferRequest joined = request;
  for (const HostBuffer& b : raw_inputs) joined.add_raw_input_contents(b.data(), b.size());
  if (Canonical(joined) != Canonical(oracle)) {
    Fail("ParseModelInferRequest parsed another message than protobuf");
  }
  if (Decoded(request, raw_inputs) != Decoded(oracle, {})) {
    Fail("the request decodes differently from buffers and from the message");
  }
}

}  // namespace
}  // namespace attnserve

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  attnserve::RunOne(data, size);
  return 0;
}
