// absl::Status -> grpc::Status with a bounded message.
#include "server/transport/status_util.h"

#include <string>

#include "absl/strings/string_view.h"

namespace attnserve {

grpc::Status ToGrpcStatus(const absl::Status& status, size_t max_message_bytes) {
  if (status.ok()) return grpc::Status::OK;
  absl::string_view message = status.message();
  std::string text;
  if (message.size() <= max_message_bytes) {
    text = std::string(message);
  } else {
    constexpr absl::string_view kMarker = " ... [truncated]";
    size_t keep = max_message_bytes > kMarker.size() ? max_message_bytes - kMarker.size() : 0;
    // Do not cut a UTF-8 sequence in half: gRPC clients decode the message
    // as UTF-8 and some reject invalid sequences.
    while (keep > 0 && (static_cast<unsigned char>(message[keep]) & 0xC0) == 0x80) --keep;
    text = std::string(message.substr(0, keep));
    text.append(kMarker.data(), kMarker.size());
  }
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()), std::move(text));
}

}  // namespace attnserve
