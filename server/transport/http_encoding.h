// HTTP content codings (RFC 9110, 8.4) of the KServe REST front end's
// bodies, as Triton's HTTP endpoint and tritonclient.http use them: a
// request body sent with `Content-Encoding: gzip` or `deflate`, and an
// inference answer compressed when the request's `Accept-Encoding` asks for
// it. The compression itself is zlib's.
#ifndef ATTNSERVE_SERVER_TRANSPORT_HTTP_ENCODING_H_
#define ATTNSERVE_SERVER_TRANSPORT_HTTP_ENCODING_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace attnserve {

enum class ContentCoding { kIdentity, kGzip, kDeflate };

// The name a Content-Encoding header gives `coding` ("identity", "gzip",
// "deflate").
const char* ContentCodingName(ContentCoding coding);

// The coding of a request body from its Content-Encoding header (nullptr or
// empty: identity). Takes "identity", "gzip" (also "x-gzip") and "deflate",
// in any case, spaces around them ignored. Any other coding, or several
// codings applied in turn ("gzip, gzip"), is Unimplemented with a message
// that names the header and what it said: HTTP 415.
absl::StatusOr<ContentCoding> ParseContentEncoding(const char* header);

// `body` decoded from `coding`: gzip as RFC 1952 (members one after the
// other decode to their concatenation), deflate as RFC 9110 means it (the
// zlib format of RFC 1950), and also a raw deflate stream, which some
// clients send under that name. At most `limit` bytes come out: a body that
// decodes to more is ResourceExhausted (HTTP 413) once the limit is passed,
// so a few kilobytes on the wire cannot make the server write gigabytes.
// Data that is not valid for its coding, truncated data, or bytes after its
// end are InvalidArgument, naming the coding. Identity returns `body`.
absl::StatusOr<std::string> DecodeBody(ContentCoding coding, absl::string_view body,
                                       int64_t limit);

// The coding to answer a request in, from its Accept-Encoding header
// (nullptr: identity): gzip or deflate when the header lists it with a
// q-value above 0 (the higher q-value first; gzip on a tie), else identity.
// "*" does not choose a compression: compressing costs the server CPU, so
// only a client that names a coding gets it.
ContentCoding ChooseResponseCoding(const char* accept_encoding);

// `parts`, one after the other, compressed with `coding` (gzip or deflate,
// as DecodeBody reads them) at zlib's fastest level: tensors of floats
// compress little, and an answer should not wait long for it.
std::string EncodeBody(ContentCoding coding, absl::Span<const absl::string_view> parts);

}  // namespace attnserve

#endif  // ATTNSERVE_SERVER_TRANSPORT_HTTP_ENCODING_H_
