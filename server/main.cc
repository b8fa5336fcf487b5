// attnserve: the gRPC attention server. Parses flags, starts an AttnServer,
// and shuts it down cleanly (exit code 0) on SIGTERM or SIGINT; a second
// signal exits at once (code 128 + signal).
#include <chrono>
#include <csignal>
#include <algorithm>
#include <cstdio>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <pthread.h>
#include <sched.h>
#include <unistd.h>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/time/time.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/match.h"
#include "absl/synchronization/mutex.h"
#include "grpc/grpc.h"
#include "server/attn_server.h"
#include "server/cpu_limit.h"
#include "server/fd_limit.h"
#include "server/memory_trim.h"
#include "server/server_options.h"

namespace {
const attnserve::ServerOptions kDefaults;

// The engine's OpenMP workers share the cores with gRPC's threads (and often
// with other processes), so a worker that has finished its part of a
// parallel region spins only briefly before it sleeps: libgomp's
// OMP_WAIT_POLICY=active with GOMP_SPINCOUNT=1000, about 30 us on the 2-vCPU
// development machines, which covers the gaps between the parallel regions
// of one batch (projections, core, output projection) but not an idle
// server's. (The count must come with the active policy: without it libgomp
// spins at most 100 times, about 3 us, whenever more threads have joined
// its teams than there are CPUs, which a server's load and batch threads
// do.) Unbounded spinning (active alone) stalls every region whose spinning
// partner is descheduled: a demo-mha call (B2 L128) took 36-46 ms instead of
// 3.1-3.4 ms on a 2-vCPU host with one other busy process. Sleeping at once
// (OMP_WAIT_POLICY=passive, the default before) pays a wake-up per region:
// 27-60 us each on a KVM guest whose idle vCPU halts, where a lone demo-mha
// B1 L16 request computed in 336 instead of 175 us (docs/PERFORMANCE.md).
// libgomp reads its settings once, when it is loaded (before main), so the
// default is set by re-executing once. An operator's own OMP_WAIT_POLICY or
// GOMP_SPINCOUNT is left alone.
void DefaultToShortOpenMpSpins(char** argv) {
  if (getenv("OMP_WAIT_POLICY") != nullptr || getenv("GOMP_SPINCOUNT") != nullptr) return;
  setenv("OMP_WAIT_POLICY", "active", 1);
  setenv("GOMP_SPINCOUNT", "1000", 1);
  execv("/proc/self/exe", argv);
  // exec failed (no /proc?): run on with libgomp's default spinning.
}
// --threads 0: one engine thread per CPU the process may use. OpenMP counts
// the CPUs of the affinity mask, which in a container is the node's; a
// cgroup CPU quota (docker --cpus, Kubernetes limits.cpu) is the real
// budget. 0 (OpenMP's count) when there is no quota. `log`: say so (for
// the engine threads).
int ThreadsForContainer(bool log) {
  absl::StatusOr<std::optional<attnserve::CpuLimit>> limit = attnserve::ReadCpuLimit();
  if (!limit.ok()) {
    if (log) {
      std::fprintf(stderr, "attnserve: warning: cannot read the cgroup CPU limit (%s); --threads "
                   "0 uses one thread per CPU\n", std::string(limit.status().message()).c_str());
    }
    return 0;
  }
  if (!limit->has_value()) return 0;
  cpu_set_t cpus;
  const int available = sched_getaffinity(0, sizeof(cpus), &cpus) == 0 ? CPU_COUNT(&cpus) : 0;
  const int threads = attnserve::ThreadsForCpuLimit((*limit)->cpus, available);
  if (log) {
    std::fprintf(stderr, "attnserve: engine threads %d (CPU limit %.2f from %s)\n", threads,
                 (*limit)->cpus, (*limit)->source.c_str());
  }
  return threads;
}
}  // namespace

ABSL_FLAG(std::string, address, kDefaults.address,
          "gRPC listening address host:port; port 0 picks a free port (the log line "
          "'attnserve listening on HOST:PORT' shows it)");
ABSL_FLAG(std::string, metrics_address, kDefaults.metrics_address,
          "Prometheus metrics endpoint host:port, path /metrics; port 0 picks a free port "
          "(the log line 'attnserve metrics on HOST:PORT' shows it)");
ABSL_FLAG(std::string, http_address, "127.0.0.1:8000",
          "KServe v2 HTTP/REST endpoint host:port (Triton's port 8000); empty turns it off; "
          "port 0 picks a free port (the log line 'attnserve http on HOST:PORT' shows it)");
ABSL_FLAG(int, http_threads, kDefaults.http.threads,
          "HTTP connections served at once (each holds a worker thread while open, "
          "keep-alive included); more wait in the listen queue");
ABSL_FLAG(int64_t, http_max_body_bytes, kDefaults.http.max_body_bytes,
          "largest HTTP request body; a larger Content-Length is answered 413 unread");
ABSL_FLAG(int64_t, http_max_header_bytes, kDefaults.http.max_header_bytes,
          "largest HTTP request line plus headers");
ABSL_FLAG(absl::Duration, http_request_timeout, kDefaults.http.request_timeout,
          "an HTTP client that takes longer to send its request is disconnected");
ABSL_FLAG(bool, model_warmup, kDefaults.model_warmup,
          "compute a warm-up batch on every model before serving, so that no client request "
          "pays the engine's first-call costs");
ABSL_FLAG(int, threads, kDefaults.engine_threads,
          "threads inside one engine call; 0 = one per CPU the process may use (the cgroup "
          "CPU quota when one is set, e.g. docker --cpus or Kubernetes limits.cpu)");
ABSL_FLAG(std::string, default_model, kDefaults.default_model,
          "model for requests that name none (built-ins: demo-mha, sdpa)");
ABSL_FLAG(int64_t, max_message_bytes, kDefaults.max_message_bytes,
          "largest request message in bytes; larger requests get RESOURCE_EXHAUSTED");
ABSL_FLAG(std::string, backend, kDefaults.backend,
          "engine backend: auto (cuda when its module loads and a GPU is usable, else cpu), cpu, "
          "reference, cuda (exits with UNAVAILABLE and the reason when it cannot load)");
ABSL_FLAG(std::string, model_repository, kDefaults.model_repository,
          "directory with one folder per model (config.pbtxt + weights.safetensors)");
ABSL_FLAG(std::string, model_control_mode, "none",
          "none: the repository is read once at startup; poll: re-read every "
          "--repository-poll-secs (new models loaded, changed ones reloaded without downtime, "
          "removed ones unloaded); explicit: RepositoryModelLoad/Unload (gRPC and HTTP), "
          "--load-model at startup");
ABSL_FLAG(int, repository_poll_secs, 15,
          "poll mode: seconds between two reads of the model repository");
ABSL_FLAG(std::vector<std::string>, load_model, {},
          "explicit mode: a model to load at startup (repeatable; '*' = every model)");
ABSL_FLAG(int, max_batch_requests, kDefaults.batching.max_batch_requests,
          "most requests in one batch (1 = batching off); default for every model, "
          "config.pbtxt batching overrides");
ABSL_FLAG(int64_t, max_batch_tokens, kDefaults.batching.max_batch_tokens,
          "most query tokens (batch x query length, summed) in one batch; 0 = no limit; a "
          "larger single request runs alone");
ABSL_FLAG(int64_t, max_queue_delay_us, kDefaults.batching.max_queue_delay_us,
          "microseconds the oldest queued request may wait for others to join its batch; "
          "0 = dispatch as soon as a worker is free");
ABSL_FLAG(int, max_queue_size, kDefaults.batching.max_queue_size,
          "most requests waiting per model; beyond it requests get RESOURCE_EXHAUSTED at once");
ABSL_FLAG(int, instances, kDefaults.batching.instances,
          "engine workers per model, each computing one batch at a time");
ABSL_FLAG(int64_t, idle_spin_us, kDefaults.batching.idle_spin_us,
          "after two lone requests in a row, how long (us) a worker polls the empty queue "
          "before sleeping (a sleeping worker's wake-up cost 55-80 us on a VM); 0 = never");
ABSL_FLAG(int64_t, session_wait_us, kDefaults.batching.session_wait_us,
          "after a batch that answered session requests (decode steps), how long (us) the next "
          "batch may wait for those sessions' next steps (at most that batch's own time), so "
          "that the steps of many sessions compute together; 0 = no wait");
ABSL_FLAG(bool, refill_wait, kDefaults.batching.refill_wait,
          "after a batch at least half full, the next batch waits (at most that batch's own "
          "time) for as many requests as it answered, which clients in a closed loop send again "
          "at once; a wait that runs out puts it off for the next 2, 4, ... 64 such batches");
ABSL_FLAG(int, metrics_threads, kDefaults.metrics_threads,
          "HTTP worker threads of the metrics endpoint, each serving one connection at a "
          "time");
ABSL_FLAG(absl::Duration, metrics_request_timeout,
          absl::FromChrono(kDefaults.metrics_request_timeout),
          "how long the metrics endpoint waits for a request to arrive in full (or a "
          "response write to progress) before dropping the connection (e.g. 5s, 500ms)");
ABSL_FLAG(int64_t, max_attention_scores, kDefaults.validation.max_attention_scores,
          "most attention scores (B x Hq x Lq x Lk) one request may ask for; larger requests "
          "get RESOURCE_EXHAUSTED before any compute (the default is about 1 s of a core at "
          "head_dim 64)");
ABSL_FLAG(absl::Duration, malloc_trim_interval,
          absl::FromChrono(kDefaults.malloc_trim_interval),
          "how often freed heap memory is returned to the OS with malloc_trim (e.g. 10s; 0 = "
          "never): glibc's per-thread arenas otherwise keep it, and RSS creeps up under "
          "mixed request sizes");
ABSL_FLAG(int, malloc_arena_max, kDefaults.malloc_arena_max,
          "most glibc malloc arenas (0 = glibc's default, 8 per core): fewer arenas hold less "
          "freed memory under requests of mixed sizes on many threads");
ABSL_FLAG(int64_t, malloc_mmap_threshold, kDefaults.malloc_mmap_threshold,
          "blocks of at least this many bytes are mmapped and go back to the OS when freed "
          "(0 = glibc's default, which rises up to 32 MiB as large blocks are freed); at most "
          "33554432");
ABSL_FLAG(int64_t, malloc_trim_threshold, kDefaults.malloc_trim_threshold,
          "an arena's free memory at its top goes back to the OS at a free only past this many "
          "bytes; below it, --malloc-trim-interval's trims give it back (0 = glibc's default, "
          "128 KiB, with which each large request's freed receive buffers are unmapped and "
          "faulted in again by the next); at most 1073741824");
ABSL_FLAG(int, payload_copy_threads, kDefaults.payload_copy_threads,
          "threads that help copy a request tensor of 1 MiB or more off the wire and scan its "
          "values, beside the thread that received it (-1 = one per CPU beyond the first, counting "
          "a cgroup CPU quota's CPUs where there is one, at most 7; 0 = none); at most 64");
ABSL_FLAG(absl::Duration, shutdown_grace, absl::FromChrono(kDefaults.shutdown_grace),
          "on SIGTERM/SIGINT, how long accepted requests may take to complete (e.g. 8s, "
          "500ms); requests still queued after it get UNAVAILABLE; the default fits inside "
          "docker stop's 10 s; a second signal exits at once");
ABSL_FLAG(bool, strict_model_loading, kDefaults.strict_model_loading,
          "true: exit non-zero if any repository model fails to load; false: serve the "
          "others and report the bad one FAILED in ListModels/GetModel");
// Client abuse (issue 14): work per request (with --max-attention-scores) and
// non-finite inputs.
ABSL_FLAG(int64_t, max_multiply_adds, kDefaults.validation.max_multiply_adds,
          "most multiply-adds of one request's matrix products: attention "
          "B*Hq*Lq*Lk*(Dk+Dv) plus a projection model's Q, K, V and output projections; "
          "larger requests get RESOURCE_EXHAUSTED before any compute");
ABSL_FLAG(std::string, nonfinite_inputs, "reject",
          "NaN/Inf in query, key, value, NaN/+inf in a float attn_mask, and inputs whose "
          "scores could overflow float32: reject (INVALID_ARGUMENT naming the tensor and "
          "element; the only mode implemented)");

// Security (issue 15): transport security, authentication, and the limits
// that bound what one client can hold. docs/SECURITY.md has the threat model.
ABSL_FLAG(std::string, tls_cert_file, "",
          "PEM certificate chain of the gRPC port; with --tls-key-file turns TLS on "
          "(default: plaintext)");
ABSL_FLAG(std::string, tls_key_file, "", "PEM private key of --tls-cert-file");
ABSL_FLAG(std::string, tls_client_ca_file, "",
          "PEM CA bundle; set: clients must present a certificate signed by one of these "
          "CAs (mutual TLS), else the handshake fails");
ABSL_FLAG(absl::Duration, tls_reload_interval, absl::Seconds(kDefaults.tls.reload_interval.count()),
          "how often the three TLS files are re-read; new handshakes use changed files, open "
          "connections keep theirs (replace the files atomically)");
ABSL_FLAG(std::string, auth_token_file, kDefaults.auth_token_file,
          "file of accepted bearer tokens, one per line, optionally followed by the models it "
          "may use ('TOKEN model1 model2'); set: every call but health needs "
          "'authorization: Bearer TOKEN' (UNAUTHENTICATED without, PERMISSION_DENIED for a "
          "model the token may not use)");
ABSL_FLAG(bool, allow_client_shm, kDefaults.allow_client_shm,
          "let KServe v2 clients register system shared-memory regions and pass tensors in them "
          "(Triton's flag; for trusted clients on this host only: docs/SECURITY.md)");
ABSL_FLAG(bool, reflection, kDefaults.reflection,
          "serve gRPC server reflection (not behind --auth-token-file: it describes the API, "
          "not the models)");
ABSL_FLAG(int, max_concurrent_streams, kDefaults.connections.max_concurrent_streams,
          "most calls open at once on one client connection; further calls wait in the client");
ABSL_FLAG(absl::Duration, keepalive_time, absl::FromChrono(kDefaults.connections.keepalive_time),
          "after this long without activity the server pings the client");
ABSL_FLAG(absl::Duration, keepalive_timeout,
          absl::FromChrono(kDefaults.connections.keepalive_timeout),
          "how long the server waits for a keepalive ping's answer before closing the "
          "connection");
ABSL_FLAG(absl::Duration, max_connection_idle,
          absl::FromChrono(kDefaults.connections.max_connection_idle),
          "close a connection with no open call after this long (GOAWAY); 0 = never");
ABSL_FLAG(absl::Duration, max_connection_age,
          absl::FromChrono(kDefaults.connections.max_connection_age),
          "send GOAWAY to connections this old, so clients reconnect (re-balancing, rotated "
          "certificates); 0 = never");
ABSL_FLAG(absl::Duration, max_connection_age_grace,
          absl::FromChrono(kDefaults.connections.max_connection_age_grace),
          "after --max-connection-age, how long open calls may take before the connection "
          "is closed");
ABSL_FLAG(std::string, grpc_response_compression_level, "none",
          "compress the gRPC port's answers: none, low, medium or high (gRPC's levels; gzip "
          "or deflate, as each client accepts). Compressed requests are taken whatever this "
          "says");
ABSL_FLAG(std::string, metrics_auth_file, kDefaults.metrics_auth_file,
          "file of 'user:password' lines; set: /metrics needs HTTP basic authentication "
          "(401 without). Plaintext HTTP: keep the port on loopback or behind a TLS side-car "
          "(default: open)");
ABSL_FLAG(int64_t, max_queue_bytes, kDefaults.batching.max_queue_bytes,
          "most bytes of requests (inputs plus allocated outputs) waiting in one model's "
          "queue; requests past it get RESOURCE_EXHAUSTED at once (a request into an empty "
          "queue is always taken)");
ABSL_FLAG(int64_t, max_tensor_elements, kDefaults.validation.max_input_elements,
          "most elements of one input tensor (query, key, value, attn_mask), checked on the "
          "declared shape; larger requests get RESOURCE_EXHAUSTED");
ABSL_FLAG(int64_t, max_returned_weights, kDefaults.validation.max_returned_weights,
          "most attention weights (B x Hq x Lq x Lk, or B x Lq x Lk averaged) one request may "
          "ask to get back with need_weights; larger requests get RESOURCE_EXHAUSTED");
// Server-side attention sessions (issue 17, docs/API.md "Sessions").
ABSL_FLAG(int64_t, kv_cache_bytes, kDefaults.sessions.kv_cache_bytes,
          "bytes of session KV cache per model (blocks of K and V); when full, the least "
          "recently used idle session is evicted (its next request gets ABORTED)");
ABSL_FLAG(int64_t, kv_block_tokens, kDefaults.sessions.block_tokens,
          "tokens per KV-cache block, a multiple of 16: a session grows by one block at a time");
ABSL_FLAG(absl::Duration, session_ttl, kDefaults.sessions.ttl,
          "idle time after which a session is closed (e.g. 10m, 30s); OpenSession may ask "
          "for another TTL up to 24h");
ABSL_FLAG(int64_t, session_max_tokens, kDefaults.sessions.max_tokens,
          "most tokens one session may cache; OpenSession may ask for fewer");
ABSL_FLAG(int64_t, max_sessions, kDefaults.sessions.max_sessions,
          "most sessions open at once, all models together; 0 = no sessions (OpenSession "
          "gets RESOURCE_EXHAUSTED)");

int main(int argc, char** argv) {
  DefaultToShortOpenMpSpins(argv);

  // Debian's abseil is built without NDEBUG, which leaves absl::Mutex's
  // deadlock detection on: every lock and unlock then updates one global
  // lock-order graph under a global lock (GraphCycles: 1.5% of a loaded
  // server's CPU under perf, on the request path's queue and metrics
  // mutexes). The server turns it off; the unit tests keep it.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);

  // Block the stop signals before any thread exists, so every thread
  // inherits the mask and only the sigwait below ever receives them: no
  // async-signal-safety concerns.
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGTERM);
  sigaddset(&stop_signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);

  // --help lists the flags of this file (absl's default looks for a file
  // named after the binary).
  absl::FlagsUsageConfig usage_config;
  usage_config.contains_help_flags = [](absl::string_view path) {
    return absl::EndsWith(path, "server/main.cc");
  };
  absl::SetFlagsUsageConfig(usage_config);
  absl::SetProgramUsageMessage(
      "attnserve [--address=127.0.0.1:50051] [--metrics-address=127.0.0.1:9464] "
      "[--threads=N] [--default-model=demo-mha] [--max-message-bytes=67108864] "
      "[--backend=auto|cpu|reference] [--model-repository=DIR] [--strict-model-loading=true] "
      "[--max-batch-requests=N] [--max-batch-tokens=N] [--max-queue-delay-us=N] "
      "[--max-queue-size=N] [--instances=N] [--idle-spin-us=200] [--session-wait-us=5000] "
      "[--refill-wait=true] "
      "[--metrics-threads=8] "
      "[--metrics-request-timeout=5s] [--shutdown-grace=8s] "
      "[--max-attention-scores=268435456] [--max-multiply-adds=34359738368] "
      "[--nonfinite-inputs=reject] [--tls-cert-file=PEM --tls-key-file=PEM "
      "[--tls-client-ca-file=PEM] [--tls-reload-interval=60s]] [--auth-token-file=FILE] "
      "[--metrics-auth-file=FILE] "
      "[--allow-client-shm=false] "
      "[--reflection=true] [--max-concurrent-streams=100] [--keepalive-time=2h] "
      "[--keepalive-timeout=20s] [--max-connection-idle=0] [--max-connection-age=0] "
      "[--max-connection-age-grace=30s] [--grpc-response-compression-level=none] "
      "[--max-queue-bytes=1073741824] "
      "[--max-tensor-elements=1073741824] [--max-returned-weights=67108864] "
      "[--kv-cache-bytes=1073741824] [--kv-block-tokens=16] "
      "[--session-ttl=10m] [--session-max-tokens=32768] [--max-sessions=65536]\n"
      "Flags may be written with dashes or underscores.");
  std::vector<std::string> args =
      attnserve::NormalizeFlagNames(std::vector<std::string>(argv, argv + argc));
  std::vector<char*> arg_ptrs;
  for (std::string& arg : args) arg_ptrs.push_back(arg.data());
  std::vector<char*> positional =
      absl::ParseCommandLine(static_cast<int>(arg_ptrs.size()), arg_ptrs.data());
  if (positional.size() > 1) {
    std::fprintf(stderr, "attnserve: unexpected argument '%s' (see --help)\n", positional[1]);
    return 2;
  }

  // Every connection costs a descriptor, and the soft limit is often 1024.
  if (absl::StatusOr<attnserve::OpenFileLimit> limit = attnserve::RaiseOpenFileLimit();
      !limit.ok()) {
    std::fprintf(stderr, "attnserve: cannot raise the open files limit: %s\n",
                 limit.status().ToString().c_str());
  } else if (limit->after != limit->before) {
    std::fprintf(stderr, "attnserve: open files limit %llu (raised from %llu)\n",
                 static_cast<unsigned long long>(limit->after),
                 static_cast<unsigned long long>(limit->before));
  } else {
    std::fprintf(stderr, "attnserve: open files limit %llu\n",
                 static_cast<unsigned long long>(limit->after));
  }

  if (!attnserve::AcceptGuardIsBound()) {
    std::fprintf(stderr,
                 "attnserve: warning: accept4 is not interposed; running out of file "
                 "descriptors will stop the gRPC listener for good\n");
  }

  // gRPC's library teardown (grpc_shutdown, run by the last grpc::Server's
  // destructor) joins its executor threads, and one of them can sit in a
  // ~10 s poll while an idle client keeps its connection open after every
  // call is answered: `docker stop` then ran into its SIGKILL. This
  // reference keeps that teardown from running; the process exits with
  // _exit below once every answer has been sent.
  grpc_init();

  attnserve::ServerOptions options;
  options.address = absl::GetFlag(FLAGS_address);
  options.metrics_address = absl::GetFlag(FLAGS_metrics_address);
  options.model_warmup = absl::GetFlag(FLAGS_model_warmup);
  options.http.address = absl::GetFlag(FLAGS_http_address);
  options.http.threads = absl::GetFlag(FLAGS_http_threads);
  options.http.max_body_bytes = absl::GetFlag(FLAGS_http_max_body_bytes);
  options.http.max_header_bytes = absl::GetFlag(FLAGS_http_max_header_bytes);
  options.http.request_timeout = absl::GetFlag(FLAGS_http_request_timeout);
  options.engine_threads = absl::GetFlag(FLAGS_threads);
  options.default_model = absl::GetFlag(FLAGS_default_model);
  options.max_message_bytes = absl::GetFlag(FLAGS_max_message_bytes);
  options.backend = absl::GetFlag(FLAGS_backend);
  options.model_repository = absl::GetFlag(FLAGS_model_repository);
  options.strict_model_loading = absl::GetFlag(FLAGS_strict_model_loading);
  {
    absl::StatusOr<attnserve::ModelControlMode> mode =
        attnserve::ParseModelControlMode(absl::GetFlag(FLAGS_model_control_mode));
    if (!mode.ok()) {
      std::fprintf(stderr, "attnserve: %s\n", std::string(mode.status().message()).c_str());
      return 2;
    }
    options.model_control_mode = *mode;
  }
  options.repository_poll_interval = std::chrono::seconds(absl::GetFlag(FLAGS_repository_poll_secs));
  options.load_models = attnserve::RepeatedFlagValues(args, "load_model");
  options.batching.max_batch_requests = absl::GetFlag(FLAGS_max_batch_requests);
  options.batching.max_batch_tokens = absl::GetFlag(FLAGS_max_batch_tokens);
  options.batching.max_queue_delay_us = absl::GetFlag(FLAGS_max_queue_delay_us);
  options.batching.max_queue_size = absl::GetFlag(FLAGS_max_queue_size);
  options.batching.instances = absl::GetFlag(FLAGS_instances);
  options.batching.idle_spin_us = absl::GetFlag(FLAGS_idle_spin_us);
  options.batching.session_wait_us = absl::GetFlag(FLAGS_session_wait_us);
  options.batching.refill_wait = absl::GetFlag(FLAGS_refill_wait);
  options.validation.max_attention_scores = absl::GetFlag(FLAGS_max_attention_scores);
  options.metrics_threads = absl::GetFlag(FLAGS_metrics_threads);
  options.metrics_request_timeout =
      absl::ToChronoMilliseconds(absl::GetFlag(FLAGS_metrics_request_timeout));
  options.shutdown_grace = absl::ToChronoMilliseconds(absl::GetFlag(FLAGS_shutdown_grace));
  options.malloc_trim_interval =
      absl::ToChronoMilliseconds(absl::GetFlag(FLAGS_malloc_trim_interval));
  options.malloc_arena_max = absl::GetFlag(FLAGS_malloc_arena_max);
  options.malloc_mmap_threshold = absl::GetFlag(FLAGS_malloc_mmap_threshold);
  options.malloc_trim_threshold = absl::GetFlag(FLAGS_malloc_trim_threshold);
  options.payload_copy_threads = absl::GetFlag(FLAGS_payload_copy_threads);
  options.validation.max_multiply_adds = absl::GetFlag(FLAGS_max_multiply_adds);
  absl::StatusOr<attnserve::NonfiniteInputs> nonfinite =
      attnserve::ParseNonfiniteInputs(absl::GetFlag(FLAGS_nonfinite_inputs));
  if (!nonfinite.ok()) {
    std::fprintf(stderr, "attnserve: %s\n", std::string(nonfinite.status().message()).c_str());
    return 2;
  }
  options.validation.nonfinite_inputs = *nonfinite;
  absl::StatusOr<attnserve::ResponseCompression> compression =
      attnserve::ParseResponseCompression(absl::GetFlag(FLAGS_grpc_response_compression_level));
  if (!compression.ok()) {
    std::fprintf(stderr, "attnserve: %s\n", std::string(compression.status().message()).c_str());
    return 2;
  }
  options.grpc_response_compression = *compression;
  options.tls.cert_file = absl::GetFlag(FLAGS_tls_cert_file);
  options.tls.key_file = absl::GetFlag(FLAGS_tls_key_file);
  options.tls.client_ca_file = absl::GetFlag(FLAGS_tls_client_ca_file);
  options.tls.reload_interval = std::chrono::seconds(
      absl::ToInt64Seconds(absl::GetFlag(FLAGS_tls_reload_interval)));
  options.auth_token_file = absl::GetFlag(FLAGS_auth_token_file);
  options.metrics_auth_file = absl::GetFlag(FLAGS_metrics_auth_file);
  options.reflection = absl::GetFlag(FLAGS_reflection);
  options.allow_client_shm = absl::GetFlag(FLAGS_allow_client_shm);
  options.connections.max_concurrent_streams = absl::GetFlag(FLAGS_max_concurrent_streams);
  options.connections.keepalive_time =
      absl::ToChronoMilliseconds(absl::GetFlag(FLAGS_keepalive_time));
  options.connections.keepalive_timeout =
      absl::ToChronoMilliseconds(absl::GetFlag(FLAGS_keepalive_timeout));
  options.connections.max_connection_idle =
      absl::ToChronoMilliseconds(absl::GetFlag(FLAGS_max_connection_idle));
  options.connections.max_connection_age =
      absl::ToChronoMilliseconds(absl::GetFlag(FLAGS_max_connection_age));
  options.connections.max_connection_age_grace =
      absl::ToChronoMilliseconds(absl::GetFlag(FLAGS_max_connection_age_grace));
  options.batching.max_queue_bytes = absl::GetFlag(FLAGS_max_queue_bytes);
  options.validation.max_input_elements = absl::GetFlag(FLAGS_max_tensor_elements);
  options.validation.max_returned_weights = absl::GetFlag(FLAGS_max_returned_weights);
  options.sessions.kv_cache_bytes = absl::GetFlag(FLAGS_kv_cache_bytes);
  options.sessions.block_tokens = absl::GetFlag(FLAGS_kv_block_tokens);
  options.sessions.ttl = absl::GetFlag(FLAGS_session_ttl);
  options.sessions.max_tokens = absl::GetFlag(FLAGS_session_max_tokens);
  options.sessions.max_sessions = absl::GetFlag(FLAGS_max_sessions);

  if (options.engine_threads == 0) options.engine_threads = ThreadsForContainer(/*log=*/true);
  // --payload-copy-threads -1 under a CPU quota: helpers for the CPUs the
  // quota covers beyond the first (PayloadCopier::DefaultHelpers counts the
  // node's).
  if (options.payload_copy_threads == -1) {
    if (const int cpus = ThreadsForContainer(/*log=*/false); cpus > 0) {
      options.payload_copy_threads = std::clamp(cpus - 1, 0, 7);
    }
  }
  // Process-wide, before the server's threads exist; the values are checked
  // first so that a bad flag gets the flag's own message.
  if (absl::Status checked = attnserve::CheckServerOptions(options); !checked.ok()) {
    std::fprintf(stderr, "attnserve: %s\n", checked.ToString().c_str());
    return 1;
  }
  absl::StatusOr<attnserve::MallocConfigured> malloc_set =
      attnserve::ConfigureMalloc({.arena_max = options.malloc_arena_max,
                                  .mmap_threshold = options.malloc_mmap_threshold,
                                  .trim_threshold = options.malloc_trim_threshold});
  if (!malloc_set.ok()) {
    std::fprintf(stderr, "attnserve: %s\n", malloc_set.status().ToString().c_str());
    return 1;
  }
  if (!malloc_set->applied) {
    std::fprintf(stderr,
                 "attnserve: --malloc-arena-max=%d --malloc-mmap-threshold=%lld "
                 "--malloc-trim-threshold=%lld not applied: %s\n",
                 options.malloc_arena_max, static_cast<long long>(options.malloc_mmap_threshold),
                 static_cast<long long>(options.malloc_trim_threshold),
                 malloc_set->reason.c_str());
  }

  absl::StatusOr<std::unique_ptr<attnserve::AttnServer>> server =
      attnserve::AttnServer::Start(options);
  if (!server.ok()) {
    std::fprintf(stderr, "attnserve: %s\n", server.status().ToString().c_str());
    return 1;
  }
  std::fprintf(stderr, "attnserve: transport %s; %s\n",
               !options.tls.enabled() ? "plaintext (no TLS)"
               : options.tls.client_ca_file.empty() ? "TLS"
                                                    : "mutual TLS (client certificates required)",
               options.auth_token_file.empty() ? "no authentication"
                                               : "bearer tokens required (--auth-token-file)");
  // Integration tests parse this exact line to learn the port.
  std::fprintf(stderr, "attnserve metrics on %s\n", (*server)->metrics_address().c_str());
  if (!(*server)->http_address().empty()) {
    std::fprintf(stderr, "attnserve http on %s%s\n", (*server)->http_address().c_str(),
                 options.tls.enabled() ? " (HTTPS)" : "");
  }
  if (!(*server)->warmup_summary().empty()) {
    std::fprintf(stderr, "attnserve: %s\n", (*server)->warmup_summary().c_str());
  }
  std::fprintf(stderr, "attnserve listening on %s\n", (*server)->address().c_str());
  std::fflush(stderr);

  int signal_number = 0;
  while (sigwait(&stop_signals, &signal_number) != 0) {
  }
  std::fprintf(stderr, "attnserve: signal %d, shutting down (a second signal exits at once)\n",
               signal_number);
  std::fflush(stderr);
  // An operator who presses Ctrl-C twice, or an orchestrator that gives up
  // early, wants the process gone now: the drain below may wait up to
  // --shutdown-grace. The signals stay blocked, so this thread is the only
  // receiver; 128 + signal is the shell's code for "ended by that signal".
  std::thread([stop_signals] {
    int second = 0;
    while (sigwait(&stop_signals, &second) != 0) {
    }
    std::fprintf(stderr, "attnserve: second signal %d, exiting without waiting for open requests\n",
                 second);
    std::fflush(stderr);
    _exit(128 + second);
  }).detach();
  // Returns once every accepted request has been answered and its answer
  // handed to the kernel; then our own parts stop (metrics endpoint, batch
  // workers, engine).
  (*server)->Shutdown();
  server->reset();
  std::fprintf(stderr, "attnserve: stopped\n");
  std::fflush(stderr);
  // gRPC's threads still run (see grpc_init above): skip static destructors
  // they could race with. The kernel closes the idle connections.
  _exit(0);
}
