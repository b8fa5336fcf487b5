// The cpu backend's keys of multi-head latent attention (LatentAttention in
// engine/attention_layer.h): each head's key assembled from its own nope
// features and the token's one rotary key. Internal to engine/cpu.
#ifndef ATTNSERVE_ENGINE_CPU_LATENT_KEYS_H_
#define ATTNSERVE_ENGINE_CPU_LATENT_KEYS_H_

#include <cstdint>

#include "engine/dtype.h"

namespace attnserve::cpu {

// For r < rows and h < heads: key[r][h] = [nope[r][h] (nope_dim features) |
// rope[r] (rope_dim features)], all of `dtype` (FLOAT32 or BFLOAT16; copied
// bit for bit), rows `key_stride`, `nope_stride` and `rope_stride` elements
// apart, each head of key head_dim = nope_dim + rope_dim features.
void AssembleLatentKeys(DType dtype, void* key, int64_t key_stride, const void* nope,
                        int64_t nope_stride, const void* rope, int64_t rope_stride,
                        int64_t rows, int64_t heads, int64_t nope_dim, int64_t rope_dim,
                        int threads);

}  // namespace attnserve::cpu

#endif  // ATTNSERVE_ENGINE_CPU_LATENT_KEYS_H_
