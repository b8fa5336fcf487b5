// The gRPC listening port's transport security: plaintext, TLS, or mutual
// TLS, with certificates re-read from their files while the server runs
// (gRPC's FileWatcherCertificateProvider). No crypto of our own: gRPC's TLS
// stack does the handshakes and the client-certificate verification.
#ifndef ATTNSERVE_SERVER_TRANSPORT_TLS_CREDENTIALS_H_
#define ATTNSERVE_SERVER_TRANSPORT_TLS_CREDENTIALS_H_

#include <chrono>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "grpcpp/security/server_credentials.h"

namespace attnserve {

struct TlsOptions {
  // PEM certificate chain the server presents (--tls-cert-file), and its
  // PEM private key (--tls-key-file). Both or neither; neither = plaintext.
  // Default: none.
  std::string cert_file;
  std::string key_file;
  // PEM bundle of the CAs that sign client certificates
  // (--tls-client-ca-file). Set: every client must present a certificate
  // that chains to one of them (mutual TLS); the handshake fails otherwise.
  // Needs cert_file and key_file. Default: none (clients are not asked for
  // a certificate).
  std::string client_ca_file;
  // How often the three files are re-read (--tls-reload-interval). A
  // changed certificate is used for handshakes from then on; established
  // connections keep the keys they negotiated. Must be >= 1 s.
  // Default: 60 s.
  std::chrono::seconds reload_interval{60};

  bool enabled() const { return !cert_file.empty() || !key_file.empty(); }
};

// InvalidArgument naming the flag when the combination is incomplete
// (a certificate without a key, a client CA without a server certificate)
// or a file cannot be read or holds no PEM block of the expected kind. The
// files are read once here so that a typo stops startup instead of failing
// every handshake.
absl::Status CheckTlsOptions(const TlsOptions& options);

// The credentials for grpc::ServerBuilder::AddListeningPort: insecure when
// !options.enabled(), else TLS (or mTLS) backed by a file watcher. Runs
// CheckTlsOptions first.
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeServerCredentials(
    const TlsOptions& options);

}  // namespace attnserve

#endif  // ATTNSERVE_SERVER_TRANSPORT_TLS_CREDENTIALS_H_
