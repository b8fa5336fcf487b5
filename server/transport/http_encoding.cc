// zlib's streams, fed at most 1 GiB at a time (its counts are 32-bit), and
// the two headers' grammar (RFC 9110, 8.4 and 12.5.3).
#include "server/transport/http_encoding.h"

#include <zlib.h>

#include <algorithm>
#include <new>
#include <optional>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace attnserve {
namespace {

constexpr size_t kMaxFeed = size_t{1} << 30;  // below uInt's range
constexpr size_t kChunk = size_t{64} << 10;

// gzip, raw deflate or the zlib format, as inflateInit2 and deflateInit2
// take them.
constexpr int kGzipBits = 16 + MAX_WBITS, kZlibBits = MAX_WBITS, kRawBits = -MAX_WBITS;

std::optional<ContentCoding> CodingOf(absl::string_view token) {
  const std::string name = absl::AsciiStrToLower(absl::StripAsciiWhitespace(token));
  if (name.empty() || name == "identity") return ContentCoding::kIdentity;
  if (name == "gzip" || name == "x-gzip") return ContentCoding::kGzip;
  if (name == "deflate") return ContentCoding::kDeflate;
  return std::nullopt;
}

// RFC 1950's two-byte header: deflate (method 8), a check that makes the
// pair a multiple of 31.
bool LooksLikeZlib(absl::string_view body) {
  if (body.size() < 2) return false;
  const auto cmf = static_cast<unsigned char>(body[0]);
  const auto flg = static_cast<unsigned char>(body[1]);
  return (cmf & 0x0F) == 8 && (cmf >> 4) <= 7 && (cmf * 256 + flg) % 31 == 0;
}

class Inflater {
 public:
  explicit Inflater(int bits) { ok_ = inflateInit2(&s_, bits) == Z_OK; }
  ~Inflater() {
    if (ok_) inflateEnd(&s_);
  }
  Inflater(const Inflater&) = delete;
  Inflater& operator=(const Inflater&) = delete;
  bool ok() const { return ok_; }
  z_stream& stream() { return s_; }

 private:
  z_stream s_{};
  bool ok_ = false;
};

}  // namespace

const char* ContentCodingName(ContentCoding coding) {
  switch (coding) {
    case ContentCoding::kGzip: return "gzip";
    case ContentCoding::kDeflate: return "deflate";
    case ContentCoding::kIdentity: break;
  }
  return "identity";
}

absl::StatusOr<ContentCoding> ParseContentEncoding(const char* header) {
  if (header == nullptr) return ContentCoding::kIdentity;
  std::vector<absl::string_view> codings = absl::StrSplit(header, ',', absl::SkipWhitespace());
  if (codings.empty()) return ContentCoding::kIdentity;
  std::optional<ContentCoding> coding = CodingOf(codings[0]);
  if (codings.size() > 1 || !coding.has_value()) {
    return absl::UnimplementedError(absl::StrCat(
        "Content-Encoding: '", header,
        "' is not supported; a request body may be sent as gzip, deflate or identity (one "
        "coding)"));
  }
  return *coding;
}

absl::StatusOr<std::string> DecodeBody(ContentCoding coding, absl::string_view body,
                                       int64_t limit) {
  if (coding == ContentCoding::kIdentity) return std::string(body);
  const char* name = ContentCodingName(coding);
  const int bits = coding == ContentCoding::kGzip ? kGzipBits
                   : LooksLikeZlib(body)           ? kZlibBits
                                                   : kRawBits;
  Inflater inflater(bits);
  if (!inflater.ok()) {
    return absl::ResourceExhaustedError("request body: no memory to decompress it");
  }
  z_stream& s = inflater.stream();
  size_t fed = 0;  // bytes of `body` handed to zlib so far
  auto feed = [&] {
    const size_t n = std::min(body.size() - fed, kMaxFeed);
    s.next_in = reinterpret_cast<Bytef*>(const_cast<char*>(body.data() + fed));
    s.avail_in = static_cast<uInt>(n);
    fed += n;
  };
  feed();
  std::string out;
  std::vector<char> chunk(kChunk);
  for (;;) {
    s.next_out = reinterpret_cast<Bytef*>(chunk.data());
    s.avail_out = static_cast<uInt>(chunk.size());
    const int ret = inflate(&s, Z_NO_FLUSH);
    const size_t produced = chunk.size() - s.avail_out;
    if (static_cast<int64_t>(out.size() + produced) > limit) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "request body: more than the server's limit of ", limit,
          " bytes once decompressed (Content-Encoding: ", name, "; --http-max-body-bytes)"));
    }
    out.append(chunk.data(), produced);
    const bool input_left = s.avail_in > 0 || fed < body.size();
    if (ret == Z_STREAM_END) {
      if (!input_left) return out;
      if (coding != ContentCoding::kGzip) {
        return absl::InvalidArgumentError(absl::StrCat(
            "request body: ", body.size() - fed + s.avail_in,
            " bytes after the end of the deflate data (Content-Encoding: deflate)"));
      }
      inflateReset(&s);  // the next gzip member
    } else if (ret == Z_BUF_ERROR) {  // no progress without more input
      if (!input_left) {
        return absl::InvalidArgumentError(
            absl::StrCat("request body: the ", name, " data ends early (Content-Encoding: ", name,
                         ")"));
      }
    } else if (ret != Z_OK) {
      if (ret == Z_MEM_ERROR) {
        return absl::ResourceExhaustedError("request body: no memory to decompress it");
      }
      return absl::InvalidArgumentError(
          absl::StrCat("request body: not valid ", name, " data (Content-Encoding: ", name, "): ",
                       s.msg != nullptr ? std::string(s.msg) : absl::StrCat("zlib error ", ret)));
    }
    if (s.avail_in == 0 && fed < body.size()) feed();
  }
}

ContentCoding ChooseResponseCoding(const char* accept_encoding) {
  if (accept_encoding == nullptr) return ContentCoding::kIdentity;
  ContentCoding best = ContentCoding::kIdentity;
  double best_q = 0;
  for (absl::string_view item : absl::StrSplit(accept_encoding, ',', absl::SkipWhitespace())) {
    std::vector<absl::string_view> fields = absl::StrSplit(item, ';');
    std::optional<ContentCoding> coding = CodingOf(fields[0]);
    if (!coding.has_value() || *coding == ContentCoding::kIdentity) continue;
    double q = 1;
    for (size_t i = 1; i < fields.size(); ++i) {
      absl::string_view param = absl::StripAsciiWhitespace(fields[i]);
      if (param.size() < 2 || absl::AsciiStrToLower(param.substr(0, 2)) != "q=") continue;
      if (!absl::SimpleAtod(param.substr(2), &q) || !(q >= 0 && q <= 1)) q = 0;  // unreadable
    }
    // Ties go to the first named, unless gzip comes later.
    if (q > best_q || (q == best_q && q > 0 && *coding == ContentCoding::kGzip)) {
      best = *coding;
      best_q = q;
    }
  }
  return best;
}

std::string EncodeBody(ContentCoding coding, absl::Span<const absl::string_view> parts) {
  z_stream s{};
  const int bits = coding == ContentCoding::kGzip ? kGzipBits : kZlibBits;
  // Only Z_MEM_ERROR is possible with these arguments; an answer that cannot
  // be compressed is an allocation failure like any other.
  if (deflateInit2(&s, Z_BEST_SPEED, Z_DEFLATED, bits, 8, Z_DEFAULT_STRATEGY) != Z_OK) {
    throw std::bad_alloc();
  }
  size_t total = 0;
  for (absl::string_view part : parts) total += part.size();
  std::string out(deflateBound(&s, total) + 64, '\0');
  size_t written = 0;
  auto run = [&](int flush) {
    int ret;
    do {
      if (written == out.size()) out.resize(out.size() * 2);
      const size_t room = std::min(out.size() - written, kMaxFeed);
      s.next_out = reinterpret_cast<Bytef*>(out.data() + written);
      s.avail_out = static_cast<uInt>(room);
      ret = deflate(&s, flush);
      written += room - s.avail_out;
    } while (flush == Z_FINISH ? ret != Z_STREAM_END : (s.avail_in > 0 || s.avail_out == 0));
  };
  for (absl::string_view part : parts) {
    for (size_t at = 0; at < part.size();) {
      const size_t n = std::min(part.size() - at, kMaxFeed);
      s.next_in = reinterpret_cast<Bytef*>(const_cast<char*>(part.data() + at));
      s.avail_in = static_cast<uInt>(n);
      run(Z_NO_FLUSH);
      at += n;
    }
  }
  s.next_in = nullptr;
  s.avail_in = 0;
  run(Z_FINISH);
  deflateEnd(&s);
  out.resize(written);
  return out;
}

}  // namespace attnserve
