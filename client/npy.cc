// .npy reader/writer; see npy.h. The header is a Python dict literal, parsed
// just far enough for the three keys NumPy always writes.
#include "client/npy.h"

#include <cctype>
#include <cstring>
#include <fstream>
#include <iterator>
#include <limits>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"

namespace attnserve::client {
namespace {

constexpr char kMagic[] = "\x93NUMPY";
constexpr size_t kMagicLen = 6;

// The text after `'key':` in the header dict, with leading spaces skipped.
absl::StatusOr<absl::string_view> ValueOf(absl::string_view header, absl::string_view key) {
  for (const char quote : {'\'', '"'}) {
    const std::string needle = absl::StrCat(std::string(1, quote), key, std::string(1, quote));
    size_t pos = header.find(needle);
    if (pos == absl::string_view::npos) continue;
    pos = header.find(':', pos + needle.size());
    if (pos == absl::string_view::npos) break;
    absl::string_view rest = header.substr(pos + 1);
    while (!rest.empty() && std::isspace(static_cast<unsigned char>(rest.front()))) rest.remove_prefix(1);
    return rest;
  }
  return absl::InvalidArgumentError(absl::StrCat("npy header has no '", key, "': ", header));
}

absl::StatusOr<std::vector<int64_t>> ParseShape(absl::string_view v) {
  if (v.empty() || v.front() != '(') return absl::InvalidArgumentError("npy shape is not a tuple");
  const size_t close = v.find(')');
  if (close == absl::string_view::npos) return absl::InvalidArgumentError("npy shape tuple not closed");
  std::vector<int64_t> shape;
  for (absl::string_view part : absl::StrSplit(v.substr(1, close - 1), ',')) {
    std::string s(absl::StripAsciiWhitespace(part));
    if (s.empty()) continue;  // "(3,)" and "()"
    if (!s.empty() && s.back() == 'L') s.pop_back();  // Python 2 longs
    int64_t d;
    if (!absl::SimpleAtoi(s, &d) || d < 0) {
      return absl::InvalidArgumentError(absl::StrCat("npy shape has a bad dim '", s, "'"));
    }
    shape.push_back(d);
  }
  return shape;
}

}  // namespace

int64_t NpyArray::num_elements() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

int NpyItemSize(const std::string& descr) {
  if (descr == "<f4") return 4;
  if (descr == "<f2" || descr == "<u2") return 2;
  if (descr == "|b1") return 1;
  return 0;
}

absl::StatusOr<NpyArray> ReadNpy(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open ", path));
  const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  return ParseNpy(bytes, path);
}

absl::StatusOr<NpyArray> ParseNpy(absl::string_view bytes, const std::string& path) {
  auto bad = [&](absl::string_view why) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": ", why));
  };
  if (bytes.size() < kMagicLen + 4 || std::memcmp(bytes.data(), kMagic, kMagicLen) != 0) {
    return bad("not a .npy file (bad magic)");
  }
  const auto major = static_cast<unsigned char>(bytes[6]);
  size_t header_len = 0;
  size_t offset = 0;
  auto byte = [&](size_t i) { return static_cast<size_t>(static_cast<unsigned char>(bytes[i])); };
  if (major == 1) {
    header_len = byte(8) | (byte(9) << 8);
    offset = 10;
  } else if (major == 2 || major == 3) {
    if (bytes.size() < 12) return bad("truncated header");
    header_len = byte(8) | (byte(9) << 8) | (byte(10) << 16) | (byte(11) << 24);
    offset = 12;
  } else {
    return bad(absl::StrCat("unsupported .npy version ", major));
  }
  if (bytes.size() < offset + header_len) return bad("truncated header");
  const absl::string_view header(bytes.data() + offset, header_len);

  NpyArray array;
  auto descr = ValueOf(header, "descr");
  if (!descr.ok()) return descr.status();
  if (descr->size() < 2 || ((*descr)[0] != '\'' && (*descr)[0] != '"')) return bad("bad descr");
  const size_t end = descr->find((*descr)[0], 1);
  if (end == absl::string_view::npos) return bad("bad descr");
  array.descr = std::string(descr->substr(1, end - 1));
  // NumPy writes "|b1" for bool but accepts "<b1"/"=b1"; native order is little-endian here.
  if (array.descr == "<b1" || array.descr == "=b1") array.descr = "|b1";
  if (array.descr.size() == 3 && array.descr[0] == '=') array.descr[0] = '<';
  if (NpyItemSize(array.descr) == 0) {
    return bad(absl::StrCat("dtype '", array.descr,
                            "' is not supported (want <f4, <f2, <u2 as bfloat16 bits, or |b1)"));
  }

  auto fortran = ValueOf(header, "fortran_order");
  if (!fortran.ok()) return fortran.status();
  if (absl::StartsWith(*fortran, "True")) return bad("Fortran-order arrays are not supported; save a C-order copy");

  auto shape_text = ValueOf(header, "shape");
  if (!shape_text.ok()) return shape_text.status();
  auto shape = ParseShape(*shape_text);
  if (!shape.ok()) return bad(shape.status().message());
  array.shape = *std::move(shape);

  // The element count must fit in int64 however the dims are multiplied
  // (num_elements() goes left to right): the product of the nonzero dims
  // bounds every partial product, also when a later dim is 0 (fuzzing
  // found (2^56, 200, 0) accepted as empty and overflowing num_elements()).
  const int64_t item = NpyItemSize(array.descr);
  int64_t nonzero_bytes = item;
  bool empty = false;
  for (int64_t d : array.shape) {
    if (d == 0) {
      empty = true;
      continue;
    }
    if (nonzero_bytes > std::numeric_limits<int64_t>::max() / d) {
      return bad(absl::StrCat("shape (", absl::StrJoin(array.shape, ", "),
                              ") has more bytes than fit in int64"));
    }
    nonzero_bytes *= d;
  }
  const size_t want = empty ? 0 : static_cast<size_t>(nonzero_bytes);
  const size_t data_at = offset + header_len;
  if (bytes.size() - data_at < want) {
    return bad(absl::StrCat("data holds ", bytes.size() - data_at, " bytes, shape needs ", want));
  }
  array.data = std::string(bytes.substr(data_at, want));
  return array;
}

absl::Status WriteNpy(const std::string& path, const NpyArray& array) {
  const int item = NpyItemSize(array.descr);
  if (item == 0) return absl::InvalidArgumentError(absl::StrCat("cannot write dtype ", array.descr));
  if (array.data.size() != static_cast<size_t>(array.num_elements()) * static_cast<size_t>(item)) {
    return absl::InvalidArgumentError("npy data size does not match its shape");
  }
  std::string shape = absl::StrJoin(array.shape, ", ");
  if (array.shape.size() == 1) shape += ",";  // a 1-tuple needs its comma
  std::string header = absl::StrCat("{'descr': '", array.descr,
                                    "', 'fortran_order': False, 'shape': (", shape, "), }");
  // NumPy pads the header with spaces so the data starts 64-byte aligned.
  const size_t unpadded = kMagicLen + 2 + 2 + header.size() + 1;
  header.append((64 - unpadded % 64) % 64, ' ');
  header.push_back('\n');
  if (header.size() > 0xffff) return absl::InvalidArgumentError("npy header too long");

  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) return absl::NotFoundError(absl::StrCat("cannot create ", path));
  out.write(kMagic, kMagicLen);
  const char version[2] = {1, 0};
  out.write(version, 2);
  const char len[2] = {static_cast<char>(header.size() & 0xff), static_cast<char>(header.size() >> 8)};
  out.write(len, 2);
  out.write(header.data(), static_cast<std::streamsize>(header.size()));
  out.write(array.data.data(), static_cast<std::streamsize>(array.data.size()));
  out.close();
  if (!out) return absl::InternalError(absl::StrCat("writing ", path, " failed"));
  return absl::OkStatus();
}

}  // namespace attnserve::client
