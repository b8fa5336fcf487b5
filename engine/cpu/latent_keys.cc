// AssembleLatentKeys: row copies, rows shared by the threads.
#include "engine/cpu/latent_keys.h"

#include <cstring>

#ifdef _OPENMP
#include <omp.h>
#endif

namespace attnserve::cpu {

void AssembleLatentKeys(DType dtype, void* key, int64_t key_stride, const void* nope,
                        int64_t nope_stride, const void* rope, int64_t rope_stride,
                        int64_t rows, int64_t heads, int64_t nope_dim, int64_t rope_dim,
                        int threads) {
  const size_t es = DTypeSize(dtype);
  const int64_t head_dim = nope_dim + rope_dim;
  const size_t nope_bytes = static_cast<size_t>(nope_dim) * es;
  const size_t rope_bytes = static_cast<size_t>(rope_dim) * es;
#ifdef _OPENMP
  const int n = threads > 0 ? threads : omp_get_max_threads();
#pragma omp parallel for num_threads(n) schedule(static) if (rows > 16)
#endif
  for (int64_t r = 0; r < rows; ++r) {
    char* k = static_cast<char*>(key) + static_cast<size_t>(r * key_stride) * es;
    const char* kn = static_cast<const char*>(nope) + static_cast<size_t>(r * nope_stride) * es;
    const char* kr = static_cast<const char*>(rope) + static_cast<size_t>(r * rope_stride) * es;
    for (int64_t h = 0; h < heads; ++h) {
      std::memcpy(k + static_cast<size_t>(h * head_dim) * es, kn + h * nope_bytes, nope_bytes);
      std::memcpy(k + static_cast<size_t>(h * head_dim) * es + nope_bytes, kr, rope_bytes);
    }
  }
#ifndef _OPENMP
  (void)threads;
#endif
}

}  // namespace attnserve::cpu
