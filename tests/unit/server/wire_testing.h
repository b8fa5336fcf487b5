// Helpers of the wire tests (attend_wire_test, kserve_wire_test): protobuf's
// encoding written by hand, so that tests can build the encodings protobuf
// itself never writes, byte buffers cut into slices as gRPC may hand them
// over, and request memory that can run out.
#ifndef ATTNSERVE_TESTS_UNIT_SERVER_WIRE_TESTING_H_
#define ATTNSERVE_TESTS_UNIT_SERVER_WIRE_TESTING_H_

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "engine/host_buffer.h"
#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/slice.h"
#include "gtest/gtest.h"

namespace attnserve::wire_testing {

inline std::string Varint(uint64_t v) {
  std::string s;
  while (v >= 0x80) {
    s.push_back(static_cast<char>(v | 0x80));
    v >>= 7;
  }
  s.push_back(static_cast<char>(v));
  return s;
}
inline std::string Tag(uint32_t field, uint32_t wire_type) {
  return Varint(field << 3 | wire_type);
}
// A length-delimited field.
inline std::string Bytes(uint32_t field, const std::string& value) {
  return Tag(field, 2) + Varint(value.size()) + value;
}

// `wire` as gRPC could hand it over: cut into slices at `cuts`.
inline grpc::ByteBuffer Buffer(const std::string& wire, std::vector<size_t> cuts = {}) {
  std::vector<grpc::Slice> slices;
  size_t at = 0;
  cuts.push_back(wire.size());
  for (size_t cut : cuts) {
    if (cut <= at || cut > wire.size()) continue;
    slices.emplace_back(wire.data() + at, cut - at);
    at = cut;
  }
  if (slices.empty()) slices.emplace_back(wire.data(), 0);
  return grpc::ByteBuffer(slices.data(), slices.size());
}

// All of `bytes` in one string.
inline std::string Flatten(const grpc::ByteBuffer& bytes) {
  std::vector<grpc::Slice> slices;
  EXPECT_TRUE(bytes.Dump(&slices).ok());
  std::string flat;
  for (const grpc::Slice& s : slices) {
    flat.append(reinterpret_cast<const char*>(s.begin()), s.size());
  }
  return flat;
}

// Request memory of ordinary memory, or none at all (`fail`), counted: the
// largest allocation it was asked for, and how many.
struct Pool {
  bool fail = false;
  size_t largest = 0;
  size_t allocations = 0;
  std::shared_ptr<HostBufferPool> pool = std::make_shared<HostBufferPool>(
      HostBufferPool::Backing{[this](size_t n) -> void* {
                                largest = std::max(largest, n);
                                ++allocations;
                                return fail ? nullptr : std::aligned_alloc(64, n);
                              },
                              [](void* p, size_t) { std::free(p); }},
      1 << 20, 1 << 20);
};

}  // namespace attnserve::wire_testing

#endif  // ATTNSERVE_TESTS_UNIT_SERVER_WIRE_TESTING_H_
