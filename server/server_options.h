// Everything that configures one attnserve process, with defaults; main()
// fills it from flags, tests fill it directly.
#ifndef ATTNSERVE_SERVER_SERVER_OPTIONS_H_
#define ATTNSERVE_SERVER_SERVER_OPTIONS_H_

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "server/batching/batcher_options.h"
#include "server/models/model_manager.h"
#include "server/request/clock.h"
#include "server/request/validation.h"
#include "server/transport/kserve_http.h"
#include "server/transport/tls_credentials.h"
#include "server/sessions/session_options.h"

namespace attnserve {

// Per-connection limits of the gRPC port, as gRPC channel arguments. A
// duration of 0 turns that limit off.
struct ConnectionLimits {
  // Most streams (calls) open at once on one HTTP/2 connection
  // (--max-concurrent-streams); a client's further calls wait in the
  // client until one ends. Default: 100 (HTTP/2's recommended minimum).
  int max_concurrent_streams = 100;
  // Idle time after which the server pings a client to check the
  // connection is alive (--keepalive-time), and how long it waits for the
  // answer before closing it (--keepalive-timeout). Defaults: 2 h, 20 s
  // (gRPC's).
  std::chrono::milliseconds keepalive_time{2 * 3600 * 1000};
  std::chrono::milliseconds keepalive_timeout{20000};
  // A connection with no call open for this long is closed with GOAWAY
  // (--max-connection-idle); clients reconnect on their next call.
  // Default: 0 = never.
  std::chrono::milliseconds max_connection_idle{0};
  // A connection this old is sent GOAWAY (--max-connection-age): clients
  // reconnect, which re-spreads them over replicas and makes them take a
  // rotated certificate; calls open then get --max-connection-age-grace to
  // finish before the connection is closed. Defaults: 0 = never; 30 s.
  std::chrono::milliseconds max_connection_age{0};
  std::chrono::milliseconds max_connection_age_grace{30000};
};

// How the gRPC port compresses its answers: not at all, or at one of gRPC's
// levels, for which gRPC picks gzip or deflate among what each client says
// it accepts (grpc-accept-encoding; a client that accepts neither gets
// uncompressed answers). Requests are decompressed whatever this says.
enum class ResponseCompression { kNone, kLow, kMedium, kHigh };

struct ServerOptions {
  // gRPC listening address, host:port; port 0 picks a free port (see
  // AttnServer::address()). Default: 127.0.0.1:50051.
  std::string address = "127.0.0.1:50051";
  // Prometheus endpoint (/metrics), host:port; port 0 picks a free port
  // (see AttnServer::metrics_address()). Default: 127.0.0.1:9464.
  std::string metrics_address = "127.0.0.1:9464";
  // Engine backend: "auto" (cuda when usable, else cpu), "cpu", "reference",
  // "cuda". Default: auto.
  std::string backend = "auto";
  // Threads inside one engine call; 0 = one per core (OpenMP's count; main()
  // first turns 0 into the cgroup CPU quota when one is set). Default: 0.
  int engine_threads = 0;
  // Model for requests that name none. Default: demo-mha.
  std::string default_model = "demo-mha";
  // A model repository: one folder per model (config.pbtxt +
  // weights.safetensors), served next to the built-ins. Default: none.
  std::string model_repository;
  // true: any bad model in the repository stops startup with its error.
  // false: the others serve, the bad one is listed FAILED. Default: true.
  bool strict_model_loading = true;
  // Model control, as Triton's (server/models/model_manager.h):
  // --model-control-mode none (the repository is read once), poll (re-read
  // every --repository-poll-secs; changed models reloaded without
  // downtime) or explicit (RepositoryModelLoad/Unload; --load-model NAME,
  // repeatable, "*" = all, at startup). Defaults: none, 15 s, none.
  ModelControlMode model_control_mode = ModelControlMode::kNone;
  std::chrono::seconds repository_poll_interval{15};
  std::vector<std::string> load_models;
  // Largest request message in bytes; larger ones get RESOURCE_EXHAUSTED
  // from gRPC before any parsing. Default: 64 MiB.
  int64_t max_message_bytes = int64_t{64} << 20;
  // How long Shutdown() lets accepted requests finish; requests still queued
  // after it are answered UNAVAILABLE. Fits inside `docker stop`'s default
  // 10 s before SIGKILL, with room for the exit itself. Default: 8 s.
  std::chrono::milliseconds shutdown_grace{8000};
  // Dynamic batching of every model: one queue per model, `instances`
  // engine workers each. A repository model's config.pbtxt (batching,
  // instances) overrides these field by field. Default: BatcherOptions{}.
  BatcherOptions batching;
  // Worker threads of the metrics endpoint; each serves one HTTP connection
  // at a time. Default: 8.
  int metrics_threads = 8;
  // How long the metrics endpoint waits for a request to arrive in full (and
  // for a response write to progress) before it drops the connection; bounds
  // how long a slow client holds a metrics thread. Default: 5 s.
  std::chrono::milliseconds metrics_request_timeout{5000};
  // HTTP basic authentication of /metrics (--metrics-auth-file): a file of
  // `user:password` lines (ReadBasicAuthFile). Read once at startup.
  // Default: none = the endpoint is open (keep it on loopback or behind a
  // side-car; docs/SECURITY.md).
  std::string metrics_auth_file;
  // How often freed heap memory is handed back to the OS (malloc_trim; see
  // server/memory_trim.h); 0 = never. Default: 10 s.
  std::chrono::milliseconds malloc_trim_interval{10000};
  // glibc's allocator (ConfigureMalloc in server/memory_trim.h): at most this
  // many arenas (0 = glibc's default, 8 per core). Default: 2.
  int malloc_arena_max = 2;
  // Blocks of at least this many bytes are mmapped, so a freed tensor goes
  // back to the OS at once (0 = glibc's default: a threshold that rises to
  // 32 MiB as large blocks are freed). At most 32 MiB. Default: 1 MiB.
  int64_t malloc_mmap_threshold = int64_t{1} << 20;
  // An arena's free top goes back to the OS at a free only past this many
  // bytes; below it, the trimmer above gives it back (0 = glibc's default,
  // 128 KiB once the mmap threshold is fixed: every request's freed receive
  // buffers were unmapped and faulted in again by the next). At most 1 GiB.
  // Default: 64 MiB.
  int64_t malloc_trim_threshold = int64_t{64} << 20;
  // Threads that help copy a large request tensor off the wire (and scan
  // its values) beside the thread that received it
  // (server/transport/payload_copier.h); -1 = one per CPU beyond the first
  // (main.cc counts a cgroup CPU quota's CPUs where there is one), at most
  // 7; 0 = none. At most 64. Default: -1.
  int payload_copy_threads = -1;
  // Per-request size and work limits (--max-attention-scores,
  // --max-multiply-adds) and what is done with non-finite inputs
  // (--nonfinite-inputs). Default: ValidationOptions{}.
  ValidationOptions validation;
  // Compression of the gRPC port's answers (--grpc-response-compression-level,
  // Triton's --grpc-infer-response-compression-level): worth it for large
  // answers over slow links; it costs the server CPU, and float tensors
  // compress little. Default: none.
  ResponseCompression grpc_response_compression = ResponseCompression::kNone;
  // Transport security of the gRPC port: TLS (--tls-cert-file,
  // --tls-key-file), mutual TLS (--tls-client-ca-file), reloaded every
  // --tls-reload-interval. Default: plaintext.
  TlsOptions tls;
  // KServe v2 over HTTP/REST (--http-address and the --http-* limits).
  // Default: off (address ""); the attnserve binary's flag defaults to
  // 127.0.0.1:8000, Triton's port.
  HttpOptions http;
  // Compute a warm-up batch on every ready model before serving
  // (--model-warmup; server/models/warmup.h), so that no client request is
  // the engine's first. Default: true.
  bool model_warmup = true;
  // Bearer tokens every call except health must present
  // (--auth-token-file; format in server/transport/bearer_tokens.h). Read
  // once at startup. Default: none = no authentication.
  std::string auth_token_file;
  // Clients may register system shared-memory regions and name them in
  // KServe v2 requests instead of sending tensors (--allow-client-shm, as
  // Triton's; server/transport/system_shared_memory.h): for clients on the
  // server's host the operator trusts (docs/SECURITY.md). Default: false.
  bool allow_client_shm = false;
  // Serve gRPC server reflection (--reflection). Reflection is not behind
  // the tokens: it describes the API (public in proto/), not the models.
  // Default: true.
  bool reflection = true;
  ConnectionLimits connections;
  // Server-side attention sessions: KV cache per model, block size, idle
  // TTL, per-session token limit, session count (--kv-cache-bytes,
  // --kv-block-tokens, --session-ttl, --session-max-tokens, --max-sessions).
  // Default: SessionOptions{}.
  SessionOptions sessions;
  // The time source of every timing rule (deadlines, batching, shutdown
  // grace); must outlive the server. Tests inject a FakeClock. Default:
  // nullptr = MonotonicClock.
  Clock* clock = nullptr;
};

// InvalidArgument naming the option (as its flag) when a value is out of
// range or malformed.
absl::Status CheckServerOptions(const ServerOptions& options);

// Flags are spelled with dashes (--max-message-bytes) as in the docs; absl
// flag names are identifiers (max_message_bytes). Rewrites the name part of
// every "--name[=value]" argument before the first bare "--"; values and
// positional arguments are untouched.
std::vector<std::string> NormalizeFlagNames(const std::vector<std::string>& args);

// Every value of a flag that may be repeated (--load-model a --load-model
// b, or --load-model=a,b), in order, from arguments NormalizeFlagNames has
// rewritten; `name` as an identifier (load_model). absl keeps only the last
// occurrence of a repeated flag.
std::vector<std::string> RepeatedFlagValues(const std::vector<std::string>& args,
                                            const std::string& name);

// --nonfinite-inputs: "reject" (the only mode implemented; see
// NonfiniteInputs). Anything else is InvalidArgument naming the flag;
// "propagate" says why it is not available.
absl::StatusOr<NonfiniteInputs> ParseNonfiniteInputs(const std::string& value);

// --grpc-response-compression-level: none, low, medium (or Triton's "med"),
// high. Anything else is InvalidArgument naming the flag and the values.
absl::StatusOr<ResponseCompression> ParseResponseCompression(const std::string& value);

}  // namespace attnserve

#endif  // ATTNSERVE_SERVER_SERVER_OPTIONS_H_
