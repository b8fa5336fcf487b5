// The AVX-512 `Vec` (see common.h): 16 floats per __m512; also the 16 x 16
// transpose that the bf16 packing reuses.

#if !defined(ATTNSERVE_FLASH_KERNEL_FILE)
#error "engine/cpu/flash_kernel/ is included only by engine/cpu/flash_kernel_<isa>.cc"
#endif

// 16 x 16 transpose of 32-bit elements: afterwards r[c] holds column c of
// the 16 input rows. Fully unrolled so the arrays live in registers.
__attribute__((always_inline)) inline void Transpose16x16(__m512 r[16]) {
  __m512 t[16];
#pragma GCC unroll 16
  for (int k = 0; k < 16; k += 2) {
    t[k] = _mm512_unpacklo_ps(r[k], r[k + 1]);
    t[k + 1] = _mm512_unpackhi_ps(r[k], r[k + 1]);
  }
#pragma GCC unroll 16
  for (int k = 0; k < 16; k += 4) {
    r[k] = _mm512_shuffle_ps(t[k], t[k + 2], 0x44);
    r[k + 1] = _mm512_shuffle_ps(t[k], t[k + 2], 0xEE);
    r[k + 2] = _mm512_shuffle_ps(t[k + 1], t[k + 3], 0x44);
    r[k + 3] = _mm512_shuffle_ps(t[k + 1], t[k + 3], 0xEE);
  }
#pragma GCC unroll 16
  for (int h = 0; h < 16; h += 8) {
#pragma GCC unroll 4
    for (int k = 0; k < 4; ++k) {
      t[h + k] = _mm512_shuffle_f32x4(r[h + k], r[h + k + 4], 0x88);
      t[h + k + 4] = _mm512_shuffle_f32x4(r[h + k], r[h + k + 4], 0xDD);
    }
  }
#pragma GCC unroll 8
  for (int k = 0; k < 8; ++k) {
    r[k] = _mm512_shuffle_f32x4(t[k], t[k + 8], 0x88);
    r[k + 8] = _mm512_shuffle_f32x4(t[k], t[k + 8], 0xDD);
  }
}

struct Vec {
  using V = __m512;
  static constexpr int W = 16;
  // 32 zmm registers: 6 x 4 accumulators + 4 loads + 1 broadcast.
  static constexpr int kQkVecs = 4, kPvRows = 6, kPvVecs = 4;
  // Rows of a Q K^T tile N vectors wide: N x rows accumulators, N loads and
  // a broadcast in 32 zmm; at least 12 accumulators (FMA latency x 2 ports
  // and then some), so one vector of keys takes 16 rows.
  static constexpr int QkRows(int n) { return n >= 4 ? 6 : n == 3 ? 8 : n == 2 ? 12 : 16; }
  static constexpr int kT = 16;
  static V Zero() { return _mm512_setzero_ps(); }
  static V Set1(float x) { return _mm512_set1_ps(x); }
  static V Load(const float* p) { return _mm512_loadu_ps(p); }
  static void Store(float* p, V v) { _mm512_storeu_ps(p, v); }
  static V Fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V Mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V Add(V a, V b) { return _mm512_add_ps(a, b); }
  static V Sub(V a, V b) { return _mm512_sub_ps(a, b); }
  static V Max(V a, V b) { return _mm512_max_ps(a, b); }
  static float First(V v) { return _mm512_cvtss_f32(v); }  // lane 0
  static float ReduceMax(V v) { return _mm512_reduce_max_ps(v); }
  static float ReduceAdd(V v) { return _mm512_reduce_add_ps(v); }
  template <int kDegree>
  static V Exp2(V x) {
    const V lo = Set1(-126.0f);
    const __mmask16 keep = _mm512_cmp_ps_mask(x, lo, _CMP_GE_OQ);
    const V xc = _mm512_max_ps(x, lo);
    const V n = _mm512_roundscale_ps(xc, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const V f = Sub(xc, n);
    constexpr const float* c = Exp2Poly<kDegree>::c;
    V p = Set1(c[kDegree]);
#pragma GCC unroll 8
    for (int k = kDegree - 1; k >= 0; --k) p = Fma(p, f, Set1(c[k]));
    return _mm512_maskz_scalef_ps(keep, p, n);
  }
  static V LoadConvert(const void* src, DType dt, int64_t i) {
    switch (dt) {
      case DType::kFloat32: return Load(static_cast<const float*>(src) + i);
      case DType::kFloat16:
        return _mm512_cvtph_ps(_mm256_loadu_si256(
            reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(src) + i)));
      case DType::kBFloat16:
        return _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256(
                reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(src) + i))),
            16));
      default: return Zero();
    }
  }
  // Round to nearest even, as FloatToBFloat16 does (NaN inputs aside).
  static __m256i ToBf16(V v) {
    const __m512i x = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(x, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_add_epi32(_mm512_add_epi32(x, _mm512_set1_epi32(0x7FFF)), odd);
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16));
  }
  static void StoreConvert(void* dst, DType dt, int64_t i, V v) {
    switch (dt) {
      case DType::kFloat32: Store(static_cast<float*>(dst) + i, v); return;
      case DType::kFloat16:
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(dst) + i),
                            _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        return;
      case DType::kBFloat16:
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(dst) + i), ToBf16(v));
        return;
      default: return;
    }
  }
  static V BoolBias(const uint8_t* m) {
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(m)));
    const __mmask16 zero = _mm512_cmpeq_epi32_mask(b, _mm512_setzero_si512());
    return _mm512_maskz_mov_ps(zero, Set1(kNegInf));
  }
  // lane k of the result = sum of the lanes of acc[k], for k < 16.
  __attribute__((always_inline)) static V ReduceLanes(V* acc) {
    Transpose16x16(acc);
    V sum = acc[0];
#pragma GCC unroll 16
    for (int k = 1; k < 16; ++k) sum = Add(sum, acc[k]);
    return sum;
  }
  // dst[c * ldd + k] = src[k * lds + c] for a 16 x 16 block.
  __attribute__((always_inline)) static void Transpose(const float* src, int64_t lds, float* dst,
                                                       int64_t ldd) {
    V r[16];
#pragma GCC unroll 16
    for (int k = 0; k < 16; ++k) r[k] = Load(src + k * lds);
    Transpose16x16(r);
#pragma GCC unroll 16
    for (int k = 0; k < 16; ++k) Store(dst + k * ldd, r[k]);
  }
};
