// TLS / mTLS server credentials from gRPC's file-watching certificate
// provider.
#include "server/transport/tls_credentials.h"

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "grpc/grpc_security_constants.h"
#include "grpcpp/security/tls_certificate_provider.h"
#include "grpcpp/security/tls_credentials_options.h"

namespace attnserve {
namespace {

// The file must be readable and hold a PEM block whose label contains
// `label` ("CERTIFICATE", "PRIVATE KEY": also matches "RSA PRIVATE KEY",
// "EC PRIVATE KEY").
absl::Status CheckPemFile(const std::string& path, absl::string_view flag,
                          absl::string_view label) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return absl::InvalidArgumentError(
        absl::StrCat(flag, ": cannot read ", path, ": ", std::strerror(errno)));
  }
  std::ostringstream text;
  text << in.rdbuf();
  const std::string pem = text.str();
  const size_t begin = pem.find("-----BEGIN ");
  const size_t end = begin == std::string::npos ? begin : pem.find("-----", begin + 11);
  if (begin == std::string::npos || end == std::string::npos ||
      !absl::StrContains(absl::string_view(pem).substr(begin, end - begin), label)) {
    return absl::InvalidArgumentError(
        absl::StrCat(flag, ": ", path, " holds no PEM ", label, " block"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status CheckTlsOptions(const TlsOptions& options) {
  if (!options.enabled()) {
    if (!options.client_ca_file.empty()) {
      return absl::InvalidArgumentError(
          "--tls-client-ca-file needs --tls-cert-file and --tls-key-file (mutual TLS is TLS "
          "with client certificates)");
    }
    return absl::OkStatus();
  }
  if (options.cert_file.empty() || options.key_file.empty()) {
    return absl::InvalidArgumentError(
        "--tls-cert-file and --tls-key-file go together: set both (TLS) or neither "
        "(plaintext)");
  }
  if (options.reload_interval < std::chrono::seconds(1)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--tls-reload-interval: must be >= 1s, got ", options.reload_interval.count(), "s"));
  }
  if (absl::Status s = CheckPemFile(options.cert_file, "--tls-cert-file", "CERTIFICATE");
      !s.ok()) {
    return s;
  }
  if (absl::Status s = CheckPemFile(options.key_file, "--tls-key-file", "PRIVATE KEY");
      !s.ok()) {
    return s;
  }
  if (!options.client_ca_file.empty()) {
    if (absl::Status s =
            CheckPemFile(options.client_ca_file, "--tls-client-ca-file", "CERTIFICATE");
        !s.ok()) {
      return s;
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeServerCredentials(
    const TlsOptions& options) {
  if (absl::Status s = CheckTlsOptions(options); !s.ok()) return s;
  if (!options.enabled()) return grpc::InsecureServerCredentials();
  // The provider re-reads the files every reload_interval and hands changed
  // contents to gRPC's TLS stack, which uses them for the next handshakes;
  // open connections are not touched. It reads the key and the certificate
  // separately: replace both atomically (rename, or a Kubernetes secret's
  // symlink swap) so that it never pairs an old key with a new certificate.
  const auto interval = static_cast<unsigned int>(options.reload_interval.count());
  auto provider = std::make_shared<grpc::experimental::FileWatcherCertificateProvider>(
      options.key_file, options.cert_file, options.client_ca_file, interval);
  grpc::experimental::TlsServerCredentialsOptions tls(provider);
  tls.watch_identity_key_cert_pairs();
  if (options.client_ca_file.empty()) {
    tls.set_cert_request_type(GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE);
  } else {
    tls.watch_root_certs();
    tls.set_cert_request_type(GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
  }
  return grpc::experimental::TlsServerCredentials(tls);
}

}  // namespace attnserve
