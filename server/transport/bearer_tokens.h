// Bearer-token authentication at the transport edge (--auth-token-file): the
// table of accepted tokens, each allowed every model or only some, and the
// check of one call's `authorization: Bearer <token>` header. What it yields
// is a ModelAccess (server/request/model_access.h): the request path below
// transport learns which models the call may use, never who made it.
#ifndef ATTNSERVE_SERVER_TRANSPORT_BEARER_TOKENS_H_
#define ATTNSERVE_SERVER_TRANSPORT_BEARER_TOKENS_H_

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "grpcpp/server_context.h"
#include "grpcpp/support/string_ref.h"
#include "server/request/model_access.h"

namespace attnserve {

// Shortest token the table accepts, in characters: 16 characters of the
// token alphabet carry at least 96 bits when generated at random
// (`openssl rand -hex 32` gives 64 characters).
inline constexpr size_t kMinBearerTokenLength = 16;

// Immutable once built; thread-safe. Tokens are kept only here: no message,
// log line or metric this class produces contains one.
class BearerTokens {
 public:
  // Parses the text of a token file. One token per line, optionally followed
  // by the models it may use, separated by spaces or tabs:
  //
  //   # comment; blank lines are ignored
  //   3f1c...9a                     <- any model
  //   77be...01  demo-mha sdpa      <- only these two
  //
  // A token is at least kMinBearerTokenLength characters of RFC 6750's
  // b64token alphabet (A-Z a-z 0-9 - . _ ~ + /, then any '='). Errors are
  // InvalidArgument naming `source` and the line number, never the token:
  // a malformed or short token, a token listed twice, or no token at all.
  static absl::StatusOr<BearerTokens> Parse(absl::string_view text, absl::string_view source);
  // Parse() of the file's contents; NotFound / PermissionDenied when it
  // cannot be read.
  static absl::StatusOr<BearerTokens> FromFile(const std::string& path);

  // Every model name any token is restricted to (to check them against the
  // served models at startup).
  std::vector<std::string> RestrictedModels() const;

  // The call's access from its `authorization` header value ("Bearer
  // <token>", scheme case-insensitive). Unauthenticated, with a message that
  // does not echo the header, when it is missing, not a Bearer header, or
  // not a token in the table. Each table entry is compared in time that
  // depends only on the presented token's length, and every entry is
  // compared (no early exit), so the timing does not tell how close a guess
  // was or which entry it matched.
  absl::StatusOr<ModelAccess> Authenticate(absl::string_view authorization) const;
  // The same, from a gRPC call's client metadata; more than one
  // `authorization` header is Unauthenticated.
  absl::StatusOr<ModelAccess> Authenticate(
      const std::multimap<grpc::string_ref, grpc::string_ref>& metadata) const;

  size_t size() const { return entries_.size(); }

 private:
  struct Entry {
    std::string token;
    ModelAccess access;
    std::vector<std::string> models;  // empty = every model
  };
  std::vector<Entry> entries_;
};

// What every front end's handler calls first: the models one call may use.
// Every model when `tokens` is null (authentication off); otherwise
// tokens->Authenticate of the call's metadata (Unauthenticated on failure).
absl::StatusOr<ModelAccess> CallAccess(const BearerTokens* tokens,
                                       const grpc::ServerContextBase& context);

// a == b, in time that depends only on a.size() (a: the presented secret).
bool ConstantTimeEquals(absl::string_view a, absl::string_view b);

}  // namespace attnserve

#endif  // ATTNSERVE_SERVER_TRANSPORT_BEARER_TOKENS_H_
