// OpenSSL 3 under civetweb: the compatibility libraries, and the contexts of
// one HTTPS endpoint.
#include "server/transport/civetweb_tls.h"

#include <dlfcn.h>
#include <openssl/err.h>
#include <openssl/ssl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace attnserve {
namespace {

namespace fs = std::filesystem;

// OpenSSL's error queue as text (and cleared).
std::string OpenSslErrors() {
  std::vector<std::string> errors;
  while (unsigned long e = ERR_get_error()) {
    char buf[256];
    ERR_error_string_n(e, buf, sizeof buf);
    errors.emplace_back(buf);
  }
  return errors.empty() ? "unknown OpenSSL error" : absl::StrJoin(errors, "; ");
}

absl::Status Load(const std::string& dir) {
  // libcrypto first: libssl's compatibility library needs nothing from it,
  // but civetweb opens both and either may come first.
  for (const char* name : {"libcrypto.so", "libssl.so"}) {
    const std::string path = (fs::path(dir) / name).string();
    if (dlopen(path.c_str(), RTLD_NOW | RTLD_GLOBAL) == nullptr) {
      const char* why = dlerror();
      return absl::FailedPreconditionError(absl::StrCat(path, ": ", why != nullptr ? why : ""));
    }
  }
  return absl::OkStatus();
}

absl::Status LoadOnce() {
  std::vector<std::string> tried;
  char exe[4096];
  const ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
  if (n > 0) {
    exe[n] = '\0';
    tried.push_back(
        (fs::path(exe).parent_path().parent_path() / "lib" / "attnserve" / "civetweb-tls")
            .string());
  }
  tried.push_back(ATTNSERVE_CIVETWEB_TLS_BUILD_DIR);
  std::vector<std::string> errors;
  for (const std::string& dir : tried) {
    std::error_code ec;
    if (!fs::exists(fs::path(dir) / "libssl.so", ec)) {
      errors.push_back(absl::StrCat(dir, ": not there"));
      continue;
    }
    absl::Status s = Load(dir);
    if (s.ok()) return s;
    errors.emplace_back(s.message());
  }
  return absl::FailedPreconditionError(absl::StrCat(
      "HTTPS needs attnserve's OpenSSL 3 compatibility libraries for civetweb (libssl.so, "
      "libcrypto.so), installed with the binary (or turn the HTTP endpoint off: "
      "--http-address=): ", absl::StrJoin(errors, "; ")));
}

}  // namespace

absl::Status LoadCivetwebTls() {
  static const absl::Status* loaded = new absl::Status(LoadOnce());
  return *loaded;
}

absl::StatusOr<std::unique_ptr<HttpTls>> HttpTls::Create(const TlsOptions& options) {
  std::unique_ptr<HttpTls> tls(new HttpTls(options));
  absl::StatusOr<SSL_CTX*> ctx = tls->BuildContext();
  if (!ctx.ok()) return ctx.status();
  absl::MutexLock lock(&tls->mu_);
  tls->current_ = *ctx;
  tls->stamp_ = tls->FilesStamp();
  tls->next_check_ = absl::Now() + absl::FromChrono(options.reload_interval);
  return tls;
}

HttpTls::~HttpTls() {
  absl::MutexLock lock(&mu_);
  SSL_CTX_free(current_);
}

absl::Status HttpTls::Configure(SSL_CTX* ctx) const {
  auto fail = [](const char* flag, const std::string& file) {
    return absl::InvalidArgumentError(
        absl::StrCat(flag, " ", file, ": not usable for HTTPS: ", OpenSslErrors()));
  };
  SSL_CTX_set_min_proto_version(ctx, TLS1_2_VERSION);
  if (SSL_CTX_use_certificate_chain_file(ctx, options_.cert_file.c_str()) != 1) {
    return fail("--tls-cert-file", options_.cert_file);
  }
  if (SSL_CTX_use_PrivateKey_file(ctx, options_.key_file.c_str(), SSL_FILETYPE_PEM) != 1) {
    return fail("--tls-key-file", options_.key_file);
  }
  if (SSL_CTX_check_private_key(ctx) != 1) return fail("--tls-key-file", options_.key_file);
  if (!options_.client_ca_file.empty()) {
    if (SSL_CTX_load_verify_locations(ctx, options_.client_ca_file.c_str(), nullptr) != 1) {
      return fail("--tls-client-ca-file", options_.client_ca_file);
    }
    STACK_OF(X509_NAME)* names = SSL_load_client_CA_file(options_.client_ca_file.c_str());
    if (names == nullptr) return fail("--tls-client-ca-file", options_.client_ca_file);
    SSL_CTX_set_client_CA_list(ctx, names);
    SSL_CTX_set_verify(ctx, SSL_VERIFY_PEER | SSL_VERIFY_FAIL_IF_NO_PEER_CERT, nullptr);
  } else {
    SSL_CTX_set_verify(ctx, SSL_VERIFY_NONE, nullptr);
  }
  return absl::OkStatus();
}

absl::StatusOr<SSL_CTX*> HttpTls::BuildContext() const {
  SSL_CTX* ctx = SSL_CTX_new(TLS_server_method());
  if (ctx == nullptr) {
    return absl::InternalError(absl::StrCat("HTTPS: SSL_CTX_new: ", OpenSslErrors()));
  }
  if (absl::Status s = Configure(ctx); !s.ok()) {
    SSL_CTX_free(ctx);
    return s;
  }
  return ctx;
}

std::string HttpTls::FilesStamp() const {
  std::string stamp;
  for (const std::string* file :
       {&options_.cert_file, &options_.key_file, &options_.client_ca_file}) {
    struct stat st;
    if (file->empty() || ::stat(file->c_str(), &st) != 0) {
      absl::StrAppend(&stamp, "-;");
      continue;
    }
    absl::StrAppend(&stamp, st.st_size, ":", st.st_mtim.tv_sec, ".", st.st_mtim.tv_nsec, ":",
                    st.st_ino, ";");
  }
  return stamp;
}

int HttpTls::SetUpCivetwebContext(SSL_CTX* ctx) {
  if (absl::Status s = Configure(ctx); !s.ok()) {
    std::fprintf(stderr, "attnserve: HTTPS: %s\n", std::string(s.message()).c_str());
    return -1;
  }
  SSL_CTX_set_client_hello_cb(ctx, &HttpTls::OnClientHello, this);
  return 1;
}

int HttpTls::OnClientHello(SSL* ssl, int* alert, void* arg) {
  auto* self = static_cast<HttpTls*>(arg);

  SSL_CTX* ctx = nullptr;
  {
    absl::MutexLock lock(&self->mu_);
    const absl::Time now = absl::Now();
    if (now >= self->next_check_) {
      self->next_check_ = now + absl::FromChrono(self->options_.reload_interval);
      std::string stamp = self->FilesStamp();
      if (stamp != self->stamp_) {
        absl::StatusOr<SSL_CTX*> fresh = self->BuildContext();
        if (fresh.ok()) {
          SSL_CTX_free(self->current_);
          self->current_ = *fresh;
          self->stamp_ = std::move(stamp);
        } else {
          // The previous certificate serves on; the next interval retries.
          std::fprintf(stderr, "attnserve: HTTPS: keeping the previous certificate: %s\n",
                       std::string(fresh.status().message()).c_str());
        }
      }
    }
    ctx = self->current_;
    SSL_CTX_up_ref(ctx);
  }
  // The certificate, key and client verification of the latest files for
  // this connection (its own copies: the context may be replaced while the
  // handshake runs).
  X509* cert = SSL_CTX_get0_certificate(ctx);
  EVP_PKEY* key = SSL_CTX_get0_privatekey(ctx);
  STACK_OF(X509)* chain = nullptr;
  SSL_CTX_get0_chain_certs(ctx, &chain);
  bool ok = cert != nullptr && key != nullptr && SSL_use_certificate(ssl, cert) == 1 &&
            SSL_use_PrivateKey(ssl, key) == 1 && SSL_set1_chain(ssl, chain) == 1;
  if (ok && !self->options_.client_ca_file.empty()) {
    STACK_OF(X509_NAME)* names = SSL_dup_CA_list(SSL_CTX_get_client_CA_list(ctx));
    ok = names != nullptr && SSL_set1_verify_cert_store(ssl, SSL_CTX_get_cert_store(ctx)) == 1;
    if (names != nullptr) SSL_set_client_CA_list(ssl, names);
  }
  SSL_CTX_free(ctx);
  if (!ok) {
    *alert = SSL_AD_INTERNAL_ERROR;
    return SSL_CLIENT_HELLO_ERROR;
  }
  return SSL_CLIENT_HELLO_SUCCESS;
}

}  // namespace attnserve
