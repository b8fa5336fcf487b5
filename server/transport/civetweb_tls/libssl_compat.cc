// The libssl Debian 12's civetweb (1.15) can load: civetweb opens OpenSSL at
// run time as dlopen("libssl.so") and looks up every function by its OpenSSL
// 1.1 name. OpenSSL 3 exports all of them but one: SSL_get_peer_certificate
// became a macro for SSL_get1_peer_certificate (same semantics: the caller
// owns a reference). This library's soname is "libssl.so"; once the server
// has loaded it (civetweb_tls.h), civetweb's dlopen("libssl.so") finds it by
// that name, and its lookups find the one missing function here and every
// other one in libssl.so.3, which this library depends on.
#include <openssl/ssl.h>

#undef SSL_get_peer_certificate
extern "C" X509* SSL_get_peer_certificate(const SSL* ssl) {
  return SSL_get1_peer_certificate(ssl);
}
