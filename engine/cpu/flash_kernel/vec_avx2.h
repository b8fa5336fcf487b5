// The AVX2 + FMA `Vec` (see common.h): 8 floats per __m256.

#if !defined(ATTNSERVE_FLASH_KERNEL_FILE)
#error "engine/cpu/flash_kernel/ is included only by engine/cpu/flash_kernel_<isa>.cc"
#endif

struct Vec {
  using V = __m256;
  static constexpr int W = 8;
  // 16 ymm registers: 6 x 2 accumulators + 2 loads + 1 broadcast.
  static constexpr int kQkVecs = 2, kPvRows = 6, kPvVecs = 2;
  // Rows of a Q K^T tile N vectors wide (16 ymm): 6 x 2, or 12 x 1.
  static constexpr int QkRows(int n) { return n >= 2 ? 6 : 12; }
  static constexpr int kT = 8;
  static V Zero() { return _mm256_setzero_ps(); }
  static V Set1(float x) { return _mm256_set1_ps(x); }
  static V Load(const float* p) { return _mm256_loadu_ps(p); }
  static void Store(float* p, V v) { _mm256_storeu_ps(p, v); }
  static V Fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V Mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V Add(V a, V b) { return _mm256_add_ps(a, b); }
  static V Sub(V a, V b) { return _mm256_sub_ps(a, b); }
  static V Max(V a, V b) { return _mm256_max_ps(a, b); }
  static float First(V v) { return _mm256_cvtss_f32(v); }  // lane 0
  static float ReduceMax(V v) {
    __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_max_ps(x, _mm_movehl_ps(x, x));
    x = _mm_max_ss(x, _mm_movehdup_ps(x));
    return _mm_cvtss_f32(x);
  }
  static float ReduceAdd(V v) {
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    x = _mm_add_ss(x, _mm_movehdup_ps(x));
    return _mm_cvtss_f32(x);
  }
  template <int kDegree>
  static V Exp2(V x) {
    const V lo = Set1(-126.0f);
    const V keep = _mm256_cmp_ps(x, lo, _CMP_GE_OQ);
    const V xc = _mm256_max_ps(x, lo);
    const V n = _mm256_round_ps(xc, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const V f = Sub(xc, n);
    constexpr const float* c = Exp2Poly<kDegree>::c;
    V p = Set1(c[kDegree]);
#pragma GCC unroll 8
    for (int k = kDegree - 1; k >= 0; --k) p = Fma(p, f, Set1(c[k]));
    const __m256i e = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_and_ps(Mul(p, _mm256_castsi256_ps(e)), keep);
  }
  static V LoadConvert(const void* src, DType dt, int64_t i) {
    switch (dt) {
      case DType::kFloat32: return Load(static_cast<const float*>(src) + i);
      case DType::kFloat16:
        return _mm256_cvtph_ps(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(src) + i)));
      case DType::kBFloat16:
        return _mm256_castsi256_ps(_mm256_slli_epi32(
            _mm256_cvtepu16_epi32(_mm_loadu_si128(
                reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(src) + i))),
            16));
      default: return Zero();
    }
  }
  static void StoreConvert(void* dst, DType dt, int64_t i, V v) {
    switch (dt) {
      case DType::kFloat32: Store(static_cast<float*>(dst) + i, v); return;
      case DType::kFloat16:
        _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(dst) + i),
                         _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        return;
      default:
        for (int k = 0; k < W; ++k) {
          alignas(32) float tmp[W];
          _mm256_store_ps(tmp, v);
          StoreElem(dt, dst, i + k, tmp[k]);
        }
        return;
    }
  }
  static V BoolBias(const uint8_t* m) {
    const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(m)));
    const __m256i zero = _mm256_cmpeq_epi32(b, _mm256_setzero_si256());
    return _mm256_and_ps(_mm256_castsi256_ps(zero), Set1(kNegInf));
  }
  // lane k of the result = sum of the lanes of acc[k], for k < 8.
  static V ReduceLanes(V* acc) {
    // Pairwise: after each round a vector holds partial sums of 2x the keys.
    V t[4];
#pragma GCC unroll 4
    for (int k = 0; k < 4; ++k) t[k] = _mm256_hadd_ps(acc[2 * k], acc[2 * k + 1]);
    const V u0 = _mm256_hadd_ps(t[0], t[1]), u1 = _mm256_hadd_ps(t[2], t[3]);
    // u0 lanes: [k0 k1 k2 k3 | k0 k1 k2 k3] halves; u1 likewise for k4..k7.
    const V lo = _mm256_permute2f128_ps(u0, u1, 0x20), hi = _mm256_permute2f128_ps(u0, u1, 0x31);
    return Add(lo, hi);
  }
  // dst[c * ldd + k] = src[k * lds + c] for an 8 x 8 block.
  __attribute__((always_inline)) static void Transpose(const float* src, int64_t lds, float* dst,
                                                       int64_t ldd) {
    V r[8], t[8];
#pragma GCC unroll 8
    for (int k = 0; k < 8; ++k) r[k] = Load(src + k * lds);
#pragma GCC unroll 8
    for (int k = 0; k < 8; k += 2) {
      t[k] = _mm256_unpacklo_ps(r[k], r[k + 1]);
      t[k + 1] = _mm256_unpackhi_ps(r[k], r[k + 1]);
    }
#pragma GCC unroll 8
    for (int k = 0; k < 8; k += 4) {
      r[k] = _mm256_shuffle_ps(t[k], t[k + 2], 0x44);
      r[k + 1] = _mm256_shuffle_ps(t[k], t[k + 2], 0xEE);
      r[k + 2] = _mm256_shuffle_ps(t[k + 1], t[k + 3], 0x44);
      r[k + 3] = _mm256_shuffle_ps(t[k + 1], t[k + 3], 0xEE);
    }
#pragma GCC unroll 4
    for (int k = 0; k < 4; ++k) {
      Store(dst + k * ldd, _mm256_permute2f128_ps(r[k], r[k + 4], 0x20));
      Store(dst + (k + 4) * ldd, _mm256_permute2f128_ps(r[k], r[k + 4], 0x31));
    }
  }
};
