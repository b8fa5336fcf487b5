// The flags attn_client and attn_bench share for a secured server:
// --tls-ca-file / --tls-cert-file / --tls-key-file / --tls-server-name
// (TLS, mutual TLS) and --token / --token-file (bearer token), turned into
// gRPC channel credentials and per-call metadata.
#ifndef ATTNSERVE_CLIENT_CLIENT_SECURITY_H_
#define ATTNSERVE_CLIENT_CLIENT_SECURITY_H_

#include <memory>

#include "absl/status/statusor.h"
#include "grpcpp/client_context.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/support/channel_arguments.h"

namespace attnserve::client {

// Plaintext unless a --tls-* flag is set; then TLS trusting --tls-ca-file
// (default: the system's roots) and presenting --tls-cert-file/--tls-key-file
// when both are set (mutual TLS). --tls-server-name, when set, is the name
// the server's certificate is checked against (instead of the target's host)
// and is added to `args`. InvalidArgument naming the flag when a file cannot
// be read or only one of cert/key is set.
absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> ChannelCredentialsFromFlags(
    grpc::ChannelArguments* args);

// Reads --token or --token-file once (the first line of the file, trimmed).
// InvalidArgument when both are set or the file cannot be read.
absl::Status LoadTokenFromFlags();

// Adds "authorization: Bearer <token>" to the call when a token was loaded.
// Per call rather than as call credentials: gRPC sends call credentials only
// over TLS, and a token over plaintext is legitimate on loopback or behind a
// TLS-terminating proxy.
void AddAuthorization(grpc::ClientContext* context);

}  // namespace attnserve::client

#endif  // ATTNSERVE_CLIENT_CLIENT_SECURITY_H_
