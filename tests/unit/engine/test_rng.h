// Seeded random draws for the engine tests that give the same values with
// every standard library: mt19937's sequence is fixed by the standard, the
// std:: distributions are implementation-defined, so these map its output.
#ifndef ATTNSERVE_TESTS_UNIT_ENGINE_TEST_RNG_H_
#define ATTNSERVE_TESTS_UNIT_ENGINE_TEST_RNG_H_

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

namespace attnserve::testutil {

// Not thread-safe (one per test or thread).
class Rng {
 public:
  explicit Rng(uint32_t seed) : gen_(seed) {}
  int64_t Int(int64_t lo, int64_t hi) {  // [lo, hi]
    return lo + static_cast<int64_t>(gen_() % static_cast<uint32_t>(hi - lo + 1));
  }
  float Uniform(float lo, float hi) {
    return lo + (hi - lo) * static_cast<float>(gen_() >> 8) * 0x1.0p-24f;
  }
  float Normal() {  // Box-Muller
    const float u = Uniform(1e-7f, 1.0f), v = Uniform(0.0f, 1.0f);
    return std::sqrt(-2.0f * std::log(u)) * std::cos(6.2831853f * v);
  }
  bool Chance(double p) { return static_cast<double>(gen_() >> 8) * 0x1.0p-24 < p; }
  template <typename T>
  const T& Pick(const std::vector<T>& v) {
    return v[static_cast<size_t>(Int(0, static_cast<int64_t>(v.size()) - 1))];
  }

 private:
  std::mt19937 gen_;
};

}  // namespace attnserve::testutil

#endif  // ATTNSERVE_TESTS_UNIT_ENGINE_TEST_RNG_H_
