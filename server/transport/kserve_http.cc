// civetweb request handler: routes, authentication, body limits, and the
// one inference path through KServeCore.
#include "server/transport/kserve_http.h"

#include <arpa/inet.h>
#include <civetweb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <ctime>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/notification.h"
#include "absl/types/span.h"
#include "server/transport/http_encoding.h"
#include "server/transport/kserve_json.h"

// civetweb 1.15 as Debian builds it formats every response's Date header
// with gmtime(), whose result lives in one static buffer: two workers (or a
// worker and the /metrics endpoint, also civetweb) answering at once race on
// it (ThreadSanitizer saw it). This definition preempts libc's for the whole
// process (the executable's symbols come first in the dynamic lookup) and
// gives each thread its own buffer, as gmtime_r does.
extern "C" struct tm* gmtime(const time_t* t) {
  thread_local struct tm result;
  return gmtime_r(t, &result);
}

namespace attnserve {
namespace {

constexpr char kJson[] = "application/json";

// Sends `body` with `status` (keep-alive as the client asked), followed by
// `binary` (an infer answer's binary outputs, written from where they lie;
// Inference-Header-Content-Length then gives the size of `body`), all of it
// compressed as one with `coding` unless that is identity.
int Reply(mg_connection* conn, int status, absl::string_view body, const char* content_type = kJson,
          bool close = false, absl::Span<const absl::string_view> binary = {},
          ContentCoding coding = ContentCoding::kIdentity) {
  // What goes on the wire: `body` then `binary`, or the two compressed as one.
  std::string compressed;
  absl::string_view head = body;
  absl::Span<const absl::string_view> tail = binary;
  if (coding != ContentCoding::kIdentity) {
    std::vector<absl::string_view> parts = {body};
    parts.insert(parts.end(), binary.begin(), binary.end());
    compressed = EncodeBody(coding, parts);
    head = compressed;
    tail = {};
  }
  size_t total = head.size();
  for (absl::string_view part : tail) total += part.size();
  mg_response_header_start(conn, status);
  mg_response_header_add(conn, "Content-Type", content_type, -1);
  const std::string length = absl::StrCat(total);
  mg_response_header_add(conn, "Content-Length", length.c_str(), -1);
  if (coding != ContentCoding::kIdentity) {
    mg_response_header_add(conn, "Content-Encoding", ContentCodingName(coding), -1);
    mg_response_header_add(conn, "Vary", "Accept-Encoding", -1);
  }
  if (!binary.empty()) {  // the JSON's length before any compression, as Triton sends it
    const std::string header = absl::StrCat(body.size());
    mg_response_header_add(conn, "Inference-Header-Content-Length", header.c_str(), -1);
  }
  if (close) mg_response_header_add(conn, "Connection", "close", -1);
  mg_response_header_send(conn);
  if (!head.empty()) mg_write(conn, head.data(), head.size());
  for (absl::string_view part : tail) {
    if (!part.empty()) mg_write(conn, part.data(), part.size());
  }
  return status;
}

int ReplyError(mg_connection* conn, const absl::Status& status, bool close = false) {
  return Reply(conn, HttpStatusOf(status.code()), ErrorJson(status.message()), kJson, close);
}

// A body that could not be read: 413 when it is over the limit (the
// connection closes: the rest of it is never read).
int ReplyBodyError(mg_connection* conn, const absl::Status& status) {
  if (status.code() == absl::StatusCode::kResourceExhausted) {
    return Reply(conn, 413, ErrorJson(status.message()), kJson, /*close=*/true);
  }
  if (status.code() == absl::StatusCode::kUnimplemented) {  // a Content-Encoding we lack
    return Reply(conn, 415, ErrorJson(status.message()), kJson, /*close=*/true);
  }
  return ReplyError(conn, status, /*close=*/true);
}

// The request body as sent, at most `limit` bytes (Content-Length checked
// before reading; chunked bodies as they arrive), and its Content-Encoding
// (checked first: a coding the server lacks is refused before the body is
// read).
absl::StatusOr<std::string> ReadRawBody(mg_connection* conn, const mg_request_info* info,
                                        int64_t limit, ContentCoding* coding) {
  absl::StatusOr<ContentCoding> c = ParseContentEncoding(mg_get_header(conn, "Content-Encoding"));
  if (!c.ok()) return c.status();
  *coding = *c;
  std::string body;
  if (info->content_length > limit) {
    return absl::ResourceExhaustedError(
        absl::StrCat("request body: Content-Length ", info->content_length,
                     " is over the server's limit of ", limit, " bytes (--http-max-body-bytes)"));
  }
  if (info->content_length >= 0) {
    body.resize(static_cast<size_t>(info->content_length));
    size_t got = 0;
    while (got < body.size()) {
      const int n = mg_read(conn, body.data() + got, body.size() - got);
      if (n <= 0) {
        return absl::InvalidArgumentError(absl::StrCat("request body: the connection ended after ",
                                                       got, " of the ", body.size(),
                                                       " bytes Content-Length announced"));
      }
      got += static_cast<size_t>(n);
    }
    return body;
  }
  char chunk[16384];
  for (;;) {
    const int n = mg_read(conn, chunk, sizeof chunk);
    if (n <= 0) break;
    if (static_cast<int64_t>(body.size()) + n > limit) {
      return absl::ResourceExhaustedError(
          absl::StrCat("request body: more than the server's limit of ", limit,
                       " bytes (--http-max-body-bytes)"));
    }
    body.append(chunk, static_cast<size_t>(n));
  }
  return body;
}

// The request body, decoded from its Content-Encoding: at most `limit`
// bytes both as sent and decoded.
absl::StatusOr<std::string> ReadBody(mg_connection* conn, const mg_request_info* info,
                                     int64_t limit) {
  ContentCoding coding;
  absl::StatusOr<std::string> body = ReadRawBody(conn, info, limit, &coding);
  if (!body.ok() || coding == ContentCoding::kIdentity) return body;
  return DecodeBody(coding, *body, limit);
}

}  // namespace

int HttpStatusOf(absl::StatusCode code) {
  switch (code) {
    case absl::StatusCode::kOk:
      return 200;
    case absl::StatusCode::kUnauthenticated:
      return 401;
    case absl::StatusCode::kPermissionDenied:
      return 403;
    case absl::StatusCode::kNotFound:
      return 404;
    case absl::StatusCode::kAborted:
      return 409;
    case absl::StatusCode::kResourceExhausted:
      return 429;
    case absl::StatusCode::kInternal:
    case absl::StatusCode::kUnknown:
    case absl::StatusCode::kDataLoss:
      return 500;
    case absl::StatusCode::kUnimplemented:
      return 501;
    case absl::StatusCode::kUnavailable:
      return 503;
    case absl::StatusCode::kDeadlineExceeded:
      return 504;
    default:
      return 400;
  }
}

KServeHttpServer::KServeHttpServer(const HttpOptions& options, const KServeCore* core,
                                   const BearerTokens* tokens)
    : options_(options), core_(core), tokens_(tokens) {}

KServeHttpServer::~KServeHttpServer() { Stop(); }

absl::StatusOr<std::unique_ptr<KServeHttpServer>> KServeHttpServer::Start(
    const HttpOptions& options, const KServeCore* core, const BearerTokens* tokens) {
  if (options.threads < 1 || options.max_body_bytes < 1 || options.max_header_bytes < 1024 ||
      options.request_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--http-threads must be >= 1, --http-max-body-bytes >= 1, --http-max-header-bytes >= "
        "1024 and --http-request-timeout > 0; got ",
        options.threads, ", ", options.max_body_bytes, ", ", options.max_header_bytes, ", ",
        absl::FormatDuration(options.request_timeout)));
  }
  const size_t colon = options.address.rfind(':');
  if (colon == std::string::npos || colon == 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--http-address: expected host:port (IPv4: this civetweb has no IPv6), got '",
        options.address, "'"));
  }
  std::unique_ptr<KServeHttpServer> server(new KServeHttpServer(options, core, tokens));
  std::string listening = options.address;
  if (options.tls.enabled()) {
    if (absl::Status s = LoadCivetwebTls(); !s.ok()) return s;
    absl::StatusOr<std::unique_ptr<HttpTls>> tls = HttpTls::Create(options.tls);
    if (!tls.ok()) return tls.status();
    server->tls_ = *std::move(tls);
    listening += "s";  // civetweb: an HTTPS port
  }
  const std::string threads = absl::StrCat(options.threads);
  const std::string timeout = absl::StrCat(absl::ToInt64Milliseconds(options.request_timeout));
  const std::string keep_alive =
      absl::StrCat(absl::ToInt64Milliseconds(options.keep_alive_timeout));
  const std::string header_bytes = absl::StrCat(options.max_header_bytes);
  const char* mg_options[] = {"listening_ports", listening.c_str(), "num_threads",
                              threads.c_str(), "request_timeout_ms", timeout.c_str(),
                              "keep_alive_timeout_ms", keep_alive.c_str(), "enable_keep_alive",
                              "yes", "max_request_size", header_bytes.c_str(),
                              // Headers and body are two writes: without it
                              // Nagle holds the body for the client's
                              // delayed ACK (40 ms a small answer).
                              "tcp_nodelay", "1", nullptr};
  mg_callbacks callbacks{};
  // civetweb logs every failure to stderr by itself; the status says it.
  callbacks.log_message = [](const mg_connection*, const char*) { return 1; };
  // HTTPS: the context civetweb creates is set up here, from the flags'
  // files (civetweb then loads no certificate itself).
  callbacks.init_ssl = [](void* ssl_ctx, void* self) {
    HttpTls* tls = static_cast<KServeHttpServer*>(self)->tls_.get();
    return tls != nullptr ? tls->SetUpCivetwebContext(static_cast<SSL_CTX*>(ssl_ctx)) : 0;
  };
  server->context_ = mg_start(&callbacks, server.get(), mg_options);
  if (server->context_ == nullptr) {
    return absl::UnavailableError(
        absl::StrCat("--http-address: cannot listen on ", options.address));
  }
  mg_set_request_handler(server->context_, "/v2", &KServeHttpServer::Handle, server.get());
  mg_server_port port{};
  if (mg_get_server_ports(server->context_, 1, &port) < 1) {
    return absl::UnavailableError(
        absl::StrCat("--http-address: no port bound for ", options.address));
  }
  server->address_ = absl::StrCat(options.address.substr(0, colon), ":", port.port);
  return server;
}

void KServeHttpServer::Stop() {
  if (context_ == nullptr) return;
  // civetweb's listener sees the stop flag only when its poll returns: a
  // second or two when nobody connects. A connection to our own port wakes
  // it, so that stopping an idle server takes milliseconds.
  std::atomic<bool> stopped{false};
  std::thread stopper([this, &stopped] {
    mg_stop(context_);
    stopped.store(true);
  });
  const size_t colon = address_.rfind(':');
  std::string host = address_.substr(0, colon);
  if (host == "0.0.0.0" || host.empty()) host = "127.0.0.1";
  sockaddr_in to{};
  to.sin_family = AF_INET;
  to.sin_port = htons(static_cast<uint16_t>(std::atoi(address_.c_str() + colon + 1)));
  const bool can_wake = inet_pton(AF_INET, host.c_str(), &to.sin_addr) == 1;
  while (!stopped.load()) {
    if (can_wake) {
      const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
      if (fd >= 0) {
        (void)connect(fd, reinterpret_cast<const sockaddr*>(&to), sizeof to);
        close(fd);
      }
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  stopper.join();
  context_ = nullptr;
}

int KServeHttpServer::Handle(mg_connection* conn, void* self) {
  return static_cast<KServeHttpServer*>(self)->Serve(conn);
}

int KServeHttpServer::Serve(mg_connection* conn) {
  const mg_request_info* info = mg_get_request_info(conn);
  const std::string method = info->request_method != nullptr ? info->request_method : "";
  const std::vector<std::string> path =
      absl::StrSplit(info->local_uri != nullptr ? info->local_uri : "", '/', absl::SkipEmpty());
  // path[0] == "v2" (the handler's prefix).
  const bool get = method == "GET", post = method == "POST";
  auto no_such_endpoint = [&] {
    return ReplyError(conn,
                      absl::NotFoundError(absl::StrCat("no such endpoint: ", info->local_uri)));
  };
  auto method_not_allowed = [&](const char* allowed) {
    return Reply(conn, 405,
                 ErrorJson(absl::StrCat("method ", method, " not allowed here; use ", allowed)));
  };

  // Health needs no token: probes call it (as the gRPC health service).
  if (path.size() == 3 && path[1] == "health") {
    if (!get) return method_not_allowed("GET");
    if (path[2] == "live") return Reply(conn, 200, "");
    if (path[2] == "ready") return Reply(conn, calls_.shutting_down() ? 400 : 200, "");
    return no_such_endpoint();
  }

  ModelAccess access;
  if (tokens_ != nullptr) {
    const char* header = mg_get_header(conn, "Authorization");
    absl::StatusOr<ModelAccess> a = tokens_->Authenticate(header != nullptr ? header : "");
    if (!a.ok()) return ReplyError(conn, a.status());
    access = *std::move(a);
  }

  if (path.size() == 1) {  // GET /v2
    if (!get) return method_not_allowed("GET");
    inference::ServerMetadataResponse m;
    core_->ServerMetadata(&m);
    return Reply(conn, 200, ServerMetadataJson(m));
  }
  if (path.size() == 3 && path[1] == "repository" && path[2] == "index") {
    if (!post) return method_not_allowed("POST");
    absl::StatusOr<std::string> body = ReadBody(conn, info, options_.max_body_bytes);
    if (!body.ok()) return ReplyBodyError(conn, body.status());
    absl::StatusOr<bool> ready_only = DecodeIndexRequest(&*body);
    if (!ready_only.ok()) return ReplyError(conn, ready_only.status());
    inference::RepositoryIndexResponse index;
    core_->RepositoryIndex(*ready_only, access, &index);
    return Reply(conn, 200, RepositoryIndexJson(index));
  }
  // POST /v2/repository/models/{model}/load | unload (Triton's model
  // repository extension); answered once the change is made.
  if (path.size() == 5 && path[1] == "repository" && path[2] == "models" &&
      (path[4] == "load" || path[4] == "unload")) {
    if (!post) return method_not_allowed("POST");
    const bool unload = path[4] == "unload";
    // The body is read whatever the answer, so that the connection stays
    // usable; the caller's right to change the repository is checked first.
    absl::StatusOr<std::string> body = ReadBody(conn, info, options_.max_body_bytes);
    if (!body.ok()) return ReplyBodyError(conn, body.status());
    if (absl::Status s = KServeCore::CheckRepositoryControl(
            unload ? "RepositoryModelUnload" : "RepositoryModelLoad", access);
        !s.ok()) {
      return ReplyError(conn, s);
    }
    if (absl::Status s = DecodeModelRepositoryRequest(&*body, unload); !s.ok()) {
      return ReplyError(conn, s);
    }
    absl::Notification finished;
    absl::Status result;
    auto done = [&](absl::Status s) {
      result = std::move(s);
      finished.Notify();
    };
    if (!unload) {
      core_->LoadModel(path[3], access, done);
    } else {
      core_->UnloadModel(path[3], access, done);
    }
    finished.WaitForNotification();
    if (!result.ok()) return ReplyError(conn, result);
    return Reply(conn, 200, "");
  }
  // Triton's system shared-memory extension:
  // GET  /v2/systemsharedmemory[/region/{name}]/status
  // POST /v2/systemsharedmemory/region/{name}/register
  // POST /v2/systemsharedmemory[/region/{name}]/unregister
  // and CUDA shared memory's paths, refused with the reason.
  if (path.size() >= 3 && (path[1] == "systemsharedmemory" || path[1] == "cudasharedmemory")) {
    const bool named = path.size() == 5 && path[2] == "region";
    if (path.size() != 3 && !named) return no_such_endpoint();
    const std::string name = named ? path[3] : "";
    const std::string& op = path.back();
    if (op != "status" && op != "register" && op != "unregister") return no_such_endpoint();
    if (op == "register" && !named) return no_such_endpoint();
    if (op == "status" ? !get : !post) return method_not_allowed(op == "status" ? "GET" : "POST");
    std::string body;
    if (post) {  // read whatever the answer, so that the connection stays usable
      absl::StatusOr<std::string> read = ReadBody(conn, info, options_.max_body_bytes);
      if (!read.ok()) return ReplyBodyError(conn, read.status());
      body = *std::move(read);
    }
    if (path[1] == "cudasharedmemory") {
      return ReplyError(conn, absl::UnimplementedError(
                                  "attnserve has no CUDA shared memory; send tensors in the "
                                  "request or, from the server's host, in system shared memory"));
    }
    if (op == "status") {
      inference::SystemSharedMemoryStatusResponse regions;
      if (absl::Status s = core_->SystemSharedMemoryStatus(name, access, &regions); !s.ok()) {
        return ReplyError(conn, s);
      }
      return Reply(conn, 200, SystemSharedMemoryStatusJson(regions));
    }
    absl::Status s;
    if (op == "unregister") {
      s = body.find_first_not_of(" \t\r\n") == std::string::npos
              ? core_->UnregisterSystemSharedMemory(name, access)
              : absl::InvalidArgumentError("request body: must be empty for unregister");
    } else if (s = core_->CheckSharedMemory("SystemSharedMemoryRegister", access); s.ok()) {
      absl::StatusOr<SharedMemoryRegistration> r = DecodeSharedMemoryRegisterRequest(&body);
      s = r.ok() ? core_->RegisterSystemSharedMemory(name, r->key, r->offset, r->byte_size,
                                                      access)
                 : r.status();
    }
    if (!s.ok()) return ReplyError(conn, s);
    return Reply(conn, 200, "");
  }
  if (path.size() == 3 && path[1] == "models" && path[2] == "stats") {  // every model
    if (!get) return method_not_allowed("GET");
    inference::ModelStatisticsResponse stats;
    if (absl::Status s = core_->ModelStatistics("", "", access, &stats); !s.ok()) {
      return ReplyError(conn, s);
    }
    return Reply(conn, 200, ModelStatisticsJson(stats));
  }
  if (path.size() < 3 || path[1] != "models") {
    return no_such_endpoint();
  }

  // /v2/models/{model}[/versions/{version}][/{action}]
  const std::string& model = path[2];
  size_t next = 3;
  std::string version;
  if (path.size() >= 5 && path[3] == "versions") {
    version = path[4];
    next = 5;
  }
  if (path.size() > next + 1) {
    return no_such_endpoint();
  }
  const std::string action = path.size() == next + 1 ? path[next] : "";
  if (absl::Status s = access.Check(model, [] { return std::string(); }); !s.ok()) {
    return ReplyError(conn, s);
  }
  if (action.empty()) {
    if (!get) return method_not_allowed("GET");
    inference::ModelMetadataResponse m;
    if (absl::Status s = core_->ModelMetadata(model, version, &m); !s.ok())
      return ReplyError(conn, s);
    return Reply(conn, 200, ModelMetadataJson(m));
  }
  if (action == "ready") {
    if (!get) return method_not_allowed("GET");
    const bool ready = core_->ModelReady(model, version) && !calls_.shutting_down();
    return Reply(conn, ready ? 200 : 400, "");
  }
  if (action == "config") {
    if (!get) return method_not_allowed("GET");
    inference::ModelConfigResponse c;
    if (absl::Status s = core_->ModelConfig(model, version, &c); !s.ok())
      return ReplyError(conn, s);
    return Reply(conn, 200, ModelConfigJson(c));
  }
  if (action == "stats") {
    if (!get) return method_not_allowed("GET");
    inference::ModelStatisticsResponse stats;
    if (absl::Status s = core_->ModelStatistics(model, version, access, &stats); !s.ok()) {
      return ReplyError(conn, s);
    }
    return Reply(conn, 200, ModelStatisticsJson(stats));
  }
  if (action != "infer") {
    return no_such_endpoint();
  }
  if (!post) return method_not_allowed("POST");

  // Inference: counted for graceful shutdown from here to its answer.
  const bool counted = calls_.CallStarted();
  ContentCoding coding = ContentCoding::kIdentity;
  absl::StatusOr<std::string> body = ReadRawBody(conn, info, options_.max_body_bytes, &coding);
  // The body is read; from here the request's time is the server's
  // (decompression included).
  const absl::Time received = core_->dispatcher()->clock()->Now();
  if (body.ok() && coding != ContentCoding::kIdentity) {
    body = DecodeBody(coding, *body, options_.max_body_bytes);
  }
  if (!body.ok()) {
    if (counted) calls_.CallDone();
    return ReplyBodyError(conn, body.status());
  }
  int64_t header_length = -1;
  if (const char* h = mg_get_header(conn, "Inference-Header-Content-Length"); h != nullptr) {
    if (!absl::SimpleAtoi(h, &header_length) || header_length < 0) {
      if (counted) calls_.CallDone();
      return ReplyError(
          conn, absl::InvalidArgumentError(absl::StrCat(
                    "Inference-Header-Content-Length: must be a byte count, got '", h, "'")));
    }
  }
  JsonInferRequest request;
  const absl::Status parsed =
      DecodeJsonInferRequest(&*body, header_length, model, version, &request);
  body->clear();
  body->shrink_to_fit();  // the inputs are in the request now
  KServeRequest decoded;
  inference::ModelInferResponse response;
  KServeCore::Call call;
  call.received = received;
  call.access = access;
  call.shutting_down = !counted;
  absl::Notification answered;
  absl::Status result;
  core_->StartInfer(call, parsed, request.request, &decoded, &response, [&](absl::Status status) {
    result = std::move(status);
    answered.Notify();
  });
  answered.WaitForNotification();
  request.request.Clear();  // free the inputs before writing the answer
  int status;
  if (!result.ok()) {
    status = ReplyError(conn, result);
  } else {
    std::vector<absl::string_view> binary;
    const std::string json = EncodeJsonInferResponse(response, request, &binary);
    status = Reply(conn, 200, json, binary.empty() ? kJson : "application/octet-stream",
                   /*close=*/false, binary,
                   ChooseResponseCoding(mg_get_header(conn, "Accept-Encoding")));
  }
  if (counted) calls_.CallDone();
  return status;
}

}  // namespace attnserve
