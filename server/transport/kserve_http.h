// KServe v2 over HTTP/1.1 (the REST form Triton serves on port 8000): health,
// server and model metadata, readiness, config, statistics, the repository
// index and inference with JSON tensors or Triton's binary tensor data
// extension, gzip or deflate bodies both ways (http_encoding.h), and Triton's
// system shared memory. Every operation is KServeCore's, so HTTP answers
// exactly as the gRPC front end does: the same validation and messages, batching,
// deadlines (the `timeout` parameter), queue bounds, sessions (`session_id`
// parameter), metrics and bearer tokens (`Authorization: Bearer`).
//
// The HTTP server is civetweb (already in the binary for /metrics, through
// prometheus-cpp; Debian's libcivetweb): a pool of worker threads, one
// connection each, a request's worker waiting for its answer while the
// request is batched. docs/ARCHITECTURE.md says why.
#ifndef ATTNSERVE_SERVER_TRANSPORT_KSERVE_HTTP_H_
#define ATTNSERVE_SERVER_TRANSPORT_KSERVE_HTTP_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "server/transport/bearer_tokens.h"
#include "server/transport/call_tracker.h"
#include "server/transport/civetweb_tls.h"
#include "server/transport/kserve_core.h"

struct mg_context;
struct mg_connection;

namespace attnserve {

struct HttpOptions {
  // host:port, IPv4 (Debian's civetweb is built without IPv6); port 0 picks
  // a free port. Empty: no HTTP endpoint.
  std::string address;
  // Connections served at once (each holds a worker thread while open,
  // keep-alive included); more wait in the listen queue. Default: 64.
  int threads = 64;
  // Largest request body; a bigger Content-Length is answered 413 before
  // the body is read, and a gzip or deflate body once it decompresses past
  // it. Default: 64 MiB (the gRPC receive limit's default).
  int64_t max_body_bytes = int64_t{64} << 20;
  // Largest request line plus headers (civetweb answers 413/431 beyond it).
  // Default: 16 KiB.
  int64_t max_header_bytes = int64_t{16} << 10;
  // A client that sends a request more slowly than this is disconnected
  // (slowloris); also how long an idle keep-alive connection stays open.
  // Default: 30 s.
  absl::Duration request_timeout = absl::Seconds(30);
  absl::Duration keep_alive_timeout = absl::Seconds(5);
  // HTTPS with the gRPC port's certificate flags (--tls-cert-file,
  // --tls-key-file, --tls-client-ca-file for mutual TLS,
  // --tls-reload-interval): civetweb_tls.h. Default: plain HTTP.
  TlsOptions tls;
};

// The HTTP status of a request-path status, as Triton maps its errors:
// InvalidArgument/FailedPrecondition/OutOfRange/Cancelled 400,
// Unauthenticated 401, PermissionDenied 403, NotFound 404, Aborted 409,
// ResourceExhausted 429, Internal/Unknown/DataLoss 500, Unimplemented 501,
// Unavailable 503, DeadlineExceeded 504.
int HttpStatusOf(absl::StatusCode code);

// Thread-safe.
class KServeHttpServer {
 public:
  // Binds options.address and starts serving. `core` and `tokens`
  // (nullable: no authentication) must outlive the server. Unavailable when
  // the address cannot be bound; InvalidArgument for bad options.
  static absl::StatusOr<std::unique_ptr<KServeHttpServer>> Start(const HttpOptions& options,
                                                                 const KServeCore* core,
                                                                 const BearerTokens* tokens);
  ~KServeHttpServer();
  KServeHttpServer(const KServeHttpServer&) = delete;
  KServeHttpServer& operator=(const KServeHttpServer&) = delete;

  // The address bound, port 0 resolved ("127.0.0.1:40123").
  const std::string& address() const { return address_; }

  // As the gRPC services: ready turns false, new inferences get 503, those
  // accepted are answered.
  void BeginShutdown() { calls_.BeginShutdown(); }
  bool WaitForNoCalls(absl::Duration timeout) { return calls_.WaitForNoCalls(timeout); }
  // Closes every connection and joins the workers. Idempotent.
  void Stop();

 private:
  KServeHttpServer(const HttpOptions& options, const KServeCore* core, const BearerTokens* tokens);
  static int Handle(mg_connection* conn, void* self);
  int Serve(mg_connection* conn);

  const HttpOptions options_;
  const KServeCore* const core_;
  const BearerTokens* const tokens_;
  std::unique_ptr<HttpTls> tls_;  // null: plain HTTP
  CallTracker calls_;
  mg_context* context_ = nullptr;
  std::string address_;
};

}  // namespace attnserve

#endif  // ATTNSERVE_SERVER_TRANSPORT_KSERVE_HTTP_H_
