// Client-side TLS and bearer-token flags.
#include "client/client_security.h"

#include <fstream>
#include <sstream>
#include <string>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "absl/strings/ascii.h"

ABSL_FLAG(std::string, tls_ca_file, "",
          "PEM CA bundle that signed the server's certificate; any --tls-* flag turns TLS on "
          "(default roots: the system's)");
ABSL_FLAG(std::string, tls_cert_file, "",
          "PEM client certificate chain, for a server that requires client certificates "
          "(mutual TLS); with --tls-key-file");
ABSL_FLAG(std::string, tls_key_file, "", "PEM private key of --tls-cert-file");
ABSL_FLAG(std::string, tls_server_name, "",
          "name to check the server's certificate against, when the target's host is not in "
          "it (e.g. an IP address)");
ABSL_FLAG(std::string, token, "",
          "bearer token sent as 'authorization: Bearer TOKEN' (visible in the process list: "
          "prefer --token-file)");
ABSL_FLAG(std::string, token_file, "", "file whose first line is the bearer token");

namespace attnserve::client {
namespace {

std::string& Token() {
  static std::string* token = new std::string;
  return *token;
}

absl::StatusOr<std::string> ReadFile(const std::string& path, const char* flag) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::InvalidArgumentError(absl::StrCat("--", flag, ": cannot read ", path));
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

}  // namespace

absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> ChannelCredentialsFromFlags(
    grpc::ChannelArguments* args) {
  const std::string ca = absl::GetFlag(FLAGS_tls_ca_file);
  const std::string cert = absl::GetFlag(FLAGS_tls_cert_file);
  const std::string key = absl::GetFlag(FLAGS_tls_key_file);
  const std::string server_name = absl::GetFlag(FLAGS_tls_server_name);
  if (ca.empty() && cert.empty() && key.empty() && server_name.empty()) {
    return grpc::InsecureChannelCredentials();
  }
  if (cert.empty() != key.empty()) {
    return absl::InvalidArgumentError("--tls-cert-file and --tls-key-file go together");
  }
  grpc::SslCredentialsOptions ssl;
  if (!ca.empty()) {
    absl::StatusOr<std::string> pem = ReadFile(ca, "tls-ca-file");
    if (!pem.ok()) return pem.status();
    ssl.pem_root_certs = *std::move(pem);
  }
  if (!cert.empty()) {
    absl::StatusOr<std::string> chain = ReadFile(cert, "tls-cert-file");
    if (!chain.ok()) return chain.status();
    absl::StatusOr<std::string> private_key = ReadFile(key, "tls-key-file");
    if (!private_key.ok()) return private_key.status();
    ssl.pem_cert_chain = *std::move(chain);
    ssl.pem_private_key = *std::move(private_key);
  }
  if (!server_name.empty()) args->SetSslTargetNameOverride(server_name);
  return grpc::SslCredentials(ssl);
}

absl::Status LoadTokenFromFlags() {
  const std::string token = absl::GetFlag(FLAGS_token);
  const std::string file = absl::GetFlag(FLAGS_token_file);
  if (!token.empty() && !file.empty()) {
    return absl::InvalidArgumentError("--token and --token-file: set one, not both");
  }
  if (!file.empty()) {
    absl::StatusOr<std::string> text = ReadFile(file, "token-file");
    if (!text.ok()) return text.status();
    absl::string_view first = *text;
    first = first.substr(0, first.find('\n'));
    Token() = std::string(absl::StripAsciiWhitespace(first));
    if (Token().empty()) {
      return absl::InvalidArgumentError(absl::StrCat("--token-file: ", file, " is empty"));
    }
  } else {
    Token() = token;
  }
  return absl::OkStatus();
}

void AddAuthorization(grpc::ClientContext* context) {
  if (!Token().empty()) context->AddMetadata("authorization", absl::StrCat("Bearer ", Token()));
}

}  // namespace attnserve::client
