// civetweb's dlopen("libcrypto.so") by that name: a library with that soname
// and nothing of its own but a dependency on libcrypto.so.3, whose functions
// civetweb's lookups then find (a runtime image has no unversioned
// libcrypto.so link; see libssl_compat.cc).
extern "C" int attnserve_libcrypto_compat;
int attnserve_libcrypto_compat = 0;
