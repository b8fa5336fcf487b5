// BearerTokens: token file parsing and the constant-time header check.
#include "server/transport/bearer_tokens.h"

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace attnserve {
namespace {

constexpr char kUnauthenticated[] =
    "missing or invalid credentials: send the header 'authorization: Bearer <token>' with a "
    "token the server accepts";

bool IsTokenChar(char c) {
  return absl::ascii_isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '.' ||
         c == '_' || c == '~' || c == '+' || c == '/';
}

// RFC 6750 b64token: 1*( ALPHA / DIGIT / "-" / "." / "_" / "~" / "+" / "/" ) *"="
bool IsB64Token(absl::string_view t) {
  size_t i = 0;
  while (i < t.size() && IsTokenChar(t[i])) ++i;
  if (i == 0) return false;
  while (i < t.size() && t[i] == '=') ++i;
  return i == t.size();
}

}  // namespace

bool ConstantTimeEquals(absl::string_view a, absl::string_view b) {
  // Walks a (the presented value) in full whatever b holds; b is read at
  // i % b.size() so that its length shows only through the result.
  unsigned char diff = a.size() == b.size() ? 0 : 1;
  if (b.empty()) return a.empty();
  for (size_t i = 0; i < a.size(); ++i) {
    diff |= static_cast<unsigned char>(a[i]) ^ static_cast<unsigned char>(b[i % b.size()]);
  }
  return diff == 0;
}

absl::StatusOr<BearerTokens> BearerTokens::Parse(absl::string_view text,
                                                 absl::string_view source) {
  BearerTokens tokens;
  absl::flat_hash_set<std::string> seen;
  int line_number = 0;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    ++line_number;
    line = absl::StripAsciiWhitespace(line);
    if (line.empty() || line[0] == '#') continue;
    std::vector<absl::string_view> fields =
        absl::StrSplit(line, absl::ByAnyChar(" \t"), absl::SkipEmpty());
    const absl::string_view token = fields[0];
    const std::string where = absl::StrCat(source, " line ", line_number, ": ");
    if (!IsB64Token(token)) {
      return absl::InvalidArgumentError(absl::StrCat(
          where, "the token has a character outside A-Z a-z 0-9 - . _ ~ + / (and trailing =)"));
    }
    if (token.size() < kMinBearerTokenLength) {
      return absl::InvalidArgumentError(absl::StrCat(where, "the token has ", token.size(),
                                                     " characters; at least ",
                                                     kMinBearerTokenLength, " are required"));
    }
    if (!seen.insert(std::string(token)).second) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, "the token is listed twice (on an earlier line too)"));
    }
    Entry entry;
    entry.token = std::string(token);
    if (fields.size() > 1) {
      absl::flat_hash_set<std::string> models;
      for (size_t i = 1; i < fields.size(); ++i) {
        entry.models.emplace_back(fields[i]);
        models.emplace(fields[i]);
      }
      entry.access = ModelAccess::Only(std::move(models));
    }
    tokens.entries_.push_back(std::move(entry));
  }
  if (tokens.entries_.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(source, ": no token (every line is blank or a # comment)"));
  }
  return tokens;
}

absl::StatusOr<BearerTokens> BearerTokens::FromFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    const int err = errno;
    const std::string message = absl::StrCat(path, ": cannot read: ", std::strerror(err));
    return err == EACCES ? absl::PermissionDeniedError(message) : absl::NotFoundError(message);
  }
  std::ostringstream text;
  text << in.rdbuf();
  return Parse(text.str(), path);
}

std::vector<std::string> BearerTokens::RestrictedModels() const {
  std::vector<std::string> out;
  for (const Entry& e : entries_) out.insert(out.end(), e.models.begin(), e.models.end());
  return out;
}

absl::StatusOr<ModelAccess> BearerTokens::Authenticate(absl::string_view authorization) const {
  // "Bearer" <one or more spaces> token (RFC 6750 section 2.1; the scheme is
  // case-insensitive, RFC 7235 section 2.1).
  constexpr absl::string_view kScheme = "bearer";
  if (authorization.size() <= kScheme.size() ||
      !absl::EqualsIgnoreCase(authorization.substr(0, kScheme.size()), kScheme) ||
      authorization[kScheme.size()] != ' ') {
    return absl::UnauthenticatedError(kUnauthenticated);
  }
  const absl::string_view presented =
      absl::StripAsciiWhitespace(authorization.substr(kScheme.size()));
  const ModelAccess* match = nullptr;
  for (const Entry& e : entries_) {
    // Every entry is compared: no early exit on a match.
    if (ConstantTimeEquals(presented, e.token)) match = &e.access;
  }
  if (match == nullptr) return absl::UnauthenticatedError(kUnauthenticated);
  return *match;
}

absl::StatusOr<ModelAccess> BearerTokens::Authenticate(
    const std::multimap<grpc::string_ref, grpc::string_ref>& metadata) const {
  auto [begin, end] = metadata.equal_range("authorization");
  if (begin == end || std::next(begin) != end) {
    return absl::UnauthenticatedError(kUnauthenticated);
  }
  return Authenticate(absl::string_view(begin->second.data(), begin->second.size()));
}

absl::StatusOr<ModelAccess> CallAccess(const BearerTokens* tokens,
                                       const grpc::ServerContextBase& context) {
  if (tokens == nullptr) return ModelAccess::All();
  return tokens->Authenticate(context.client_metadata());
}

}  // namespace attnserve
