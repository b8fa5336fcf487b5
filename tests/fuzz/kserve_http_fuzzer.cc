// Fuzz target: bytes as a KServe v2 HTTP infer request body through
// DecodeJsonInferRequest (the JSON header, Triton's binary data split), then
// the KServe decoding the gRPC front end also runs. The first two bytes
// choose the Inference-Header-Content-Length (0xFFFF: none, all JSON). The
// same body also goes through the other JSON bodies a client sends: the
// repository index request, the model load and unload requests and the
// shared-memory register request, and
// through the Content-Encoding decoders (gzip, deflate) with a 1 MiB limit:
// what decodes must stay within the limit and come back the same through
// the server's own encoder.
// Aborts on a crash or sanitizer report, an error without a message, or an
// accepted request whose inputs and raw contents disagree.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "absl/strings/string_view.h"
#include "server/transport/http_encoding.h"
#include "server/transport/kserve_codec.h"
#include "server/transport/kserve_json.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 2) return 0;
  const int64_t chosen = static_cast<int64_t>(data[0]) | (static_cast<int64_t>(data[1]) << 8);
  std::string body(reinterpret_cast<const char*>(data) + 2, size - 2);
  const int64_t header_length = chosen == 0xFFFF ? -1 : chosen;
  for (attnserve::ContentCoding coding :
       {attnserve::ContentCoding::kGzip, attnserve::ContentCoding::kDeflate}) {
    constexpr int64_t kLimit = int64_t{1} << 20;
    const absl::StatusOr<std::string> decoded = attnserve::DecodeBody(coding, body, kLimit);
    if (!decoded.ok()) {
      if (decoded.status().message().empty()) {
        std::fprintf(stderr, "kserve_http_fuzzer: %s body refused without a message\n",
                     attnserve::ContentCodingName(coding));
        std::abort();
      }
      continue;
    }
    const std::string again = attnserve::EncodeBody(coding, {*decoded});
    const absl::StatusOr<std::string> round = attnserve::DecodeBody(coding, again, kLimit);
    if (static_cast<int64_t>(decoded->size()) > kLimit || !round.ok() || *round != *decoded) {
      std::fprintf(stderr, "kserve_http_fuzzer: %s: %zu bytes decoded, not kept by a round trip\n",
                   attnserve::ContentCodingName(coding), decoded->size());
      std::abort();
    }
  }
  for (bool unload : {false, true}) {
    std::string copy = body;  // parsed in place
    const absl::Status s = attnserve::DecodeModelRepositoryRequest(&copy, unload);
    if (!s.ok() && s.message().empty()) {
      std::fprintf(stderr, "kserve_http_fuzzer: load/unload body refused without a message\n");
      std::abort();
    }
  }
  {
    std::string copy = body;
    const auto registration = attnserve::DecodeSharedMemoryRegisterRequest(&copy);
    if (!registration.ok() && registration.status().message().empty()) {
      std::fprintf(stderr, "kserve_http_fuzzer: shared memory body refused without a message\n");
      std::abort();
    }
  }
  {
    std::string copy = body;
    const absl::StatusOr<bool> ready = attnserve::DecodeIndexRequest(&copy);
    if (!ready.ok() && ready.status().message().empty()) {
      std::fprintf(stderr, "kserve_http_fuzzer: index body refused without a message\n");
      std::abort();
    }
  }
  attnserve::JsonInferRequest request;
  const absl::Status s =
      attnserve::DecodeJsonInferRequest(&body, header_length, "sdpa", "", &request);
  if (!s.ok()) {
    if (s.message().empty()) {
      std::fprintf(stderr, "kserve_http_fuzzer: refused without a message\n");
      std::abort();
    }
    return 0;
  }
  const auto& r = request.request;
  // One raw entry per input that is not in shared memory: one without
  // shared_memory_* parameters (the codec refuses incomplete ones).
  int in_message = 0;
  for (const auto& input : r.inputs()) {
    in_message += input.parameters().empty() ? 1 : 0;
  }
  if (r.raw_input_contents_size() != in_message) {
    std::fprintf(stderr, "kserve_http_fuzzer: %d inputs in the message but %d raw contents\n",
                 in_message, r.raw_input_contents_size());
    std::abort();
  }
  size_t total = 0;
  for (const std::string& raw : r.raw_input_contents()) total += raw.size();
  // JSON values take at least one byte each and widen to at most 8.
  if (total > 8 * body.size()) {
    std::fprintf(stderr, "kserve_http_fuzzer: %zu input bytes from a %zu-byte body\n", total,
                 body.size());
    std::abort();
  }
  attnserve::KServeRequest decoded;
  const absl::Status d = attnserve::DecodeModelInferRequest(r, &decoded);
  if (!d.ok() && d.message().empty()) {
    std::fprintf(stderr, "kserve_http_fuzzer: decoding refused without a message\n");
    std::abort();
  }
  return 0;
}
