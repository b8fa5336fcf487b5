// HTTPS for the KServe HTTP endpoint, on Debian 12's civetweb (1.15) and
// OpenSSL 3, with the gRPC port's certificate flags and reload interval.
//
// civetweb loads OpenSSL itself, at run time, by the names of OpenSSL 1.1:
// dlopen("libssl.so"), dlopen("libcrypto.so"), then every function by name.
// OpenSSL 3 lacks one of those names, and a runtime image has no unversioned
// libssl.so, so that civetweb cannot serve TLS as packaged (it crashes when
// asked to). Two small libraries built here (civetweb_tls/*.c) carry those
// sonames and forward to libssl.so.3 and libcrypto.so.3; loading them first
// (LoadCivetwebTls) makes civetweb's dlopen find them by name. Everything
// else -- handshakes, ciphers, certificates -- is OpenSSL 3's own.
#ifndef ATTNSERVE_SERVER_TRANSPORT_CIVETWEB_TLS_H_
#define ATTNSERVE_SERVER_TRANSPORT_CIVETWEB_TLS_H_

#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "server/transport/tls_credentials.h"

typedef struct ssl_ctx_st SSL_CTX;
typedef struct ssl_st SSL;

namespace attnserve {

// Loads the compatibility libraries, once per process: from the folder
// lib/attnserve/civetweb-tls next to the executable's bin/ folder (an
// installed or packaged attnserve), else from the build tree that built
// this binary. FailedPrecondition naming the folders tried.
absl::Status LoadCivetwebTls();

// The TLS settings of one HTTPS endpoint: the certificate chain and key it
// presents and, for mutual TLS, the CAs client certificates must chain to.
// The files are re-read (when their size or modification time changed) at
// most once per reload interval, at a handshake: later handshakes use the
// new certificate, established connections keep theirs. Thread-safe.
class HttpTls {
 public:
  // Reads the files now: InvalidArgument naming the flag and OpenSSL's
  // reason when one cannot be used.
  static absl::StatusOr<std::unique_ptr<HttpTls>> Create(const TlsOptions& options);
  ~HttpTls();
  HttpTls(const HttpTls&) = delete;
  HttpTls& operator=(const HttpTls&) = delete;

  // civetweb's init_ssl callback: sets up the context civetweb made
  // (TLS 1.2 and later, the certificate, client verification) and hooks
  // the handshake so that it uses the latest files. 1 on success (civetweb
  // then loads no certificate of its own), -1 on failure.
  int SetUpCivetwebContext(SSL_CTX* ctx);

 private:
  explicit HttpTls(TlsOptions options) : options_(std::move(options)) {}

  // A fresh context from the files, or the error naming the flag.
  absl::StatusOr<SSL_CTX*> BuildContext() const;
  // Configures `ctx` from the files.
  absl::Status Configure(SSL_CTX* ctx) const;
  // Size and modification time of the three files.
  std::string FilesStamp() const;
  // The handshake hook: switches `ssl` to the current context, re-reading
  // the files first when the interval has passed and they changed.
  static int OnClientHello(SSL* ssl, int* alert, void* self);

  const TlsOptions options_;
  absl::Mutex mu_;
  SSL_CTX* current_ ABSL_GUARDED_BY(mu_) = nullptr;  // owned (one reference)
  std::string stamp_ ABSL_GUARDED_BY(mu_);
  absl::Time next_check_ ABSL_GUARDED_BY(mu_);
};

}  // namespace attnserve

#endif  // ATTNSERVE_SERVER_TRANSPORT_CIVETWEB_TLS_H_
