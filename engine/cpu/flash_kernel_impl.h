// The flash attention algorithm, written once over a vector type (`Vec`) and
// a product policy (`Products`: fp32 FMA, vdpbf16ps or AMX), both chosen by
// macros; each engine/cpu/flash_kernel_<isa>.cc instantiates it for one
// instruction set.
//
// Included only from those files, after flash_internal.h, inside an anonymous
// namespace and a `#pragma GCC target` region, with ATTNSERVE_FLASH_VEC_*
// (and ATTNSERVE_FLASH_BF16 / ATTNSERVE_FLASH_AMX) defined. No include guard:
// one inclusion per file, and everything here has internal linkage.
//
// Per work item (<= 256 query rows of one kv head, see flash_internal.h) and
// per block of 256 keys: pack K (transposed, or in bf16 pairs) and V once;
// then per 64-row sub-block: S = Q K^T; per row: t = S*scale*log2(e) + mask,
// running max m, P = 2^(t - m), running sum l, alpha = 2^(m_old - m);
// O = alpha * O + P V.
// Keys beyond a row's causal/key_lengths limit are -inf; whole blocks beyond
// every row's limit are never visited. The output is O / l (0 when l == 0).

#if !defined(ATTNSERVE_FLASH_KERNEL_FILE)
#error "flash_kernel_impl.h is included only by engine/cpu/flash_kernel_<isa>.cc"
#endif

constexpr float kLog2e = 1.44269504088896340736f;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// 2^f on [-0.5, 0.5] with f(0) = 1 exactly (so 2^(-inf) comes out as 0):
// near-minimax fits of relative error 1.9e-7 (degree 5, the fp32 variants)
// and 1.0e-4 (degree 3, the bf16 variants, whose probabilities are rounded
// to bf16's 2^-9 anyway).
template <int kDegree>
struct Exp2Poly;
template <>
struct Exp2Poly<5> {
  static constexpr float c[6] = {1.0f, 6.931470037e-01f, 2.402224243e-01f,
                                 5.550733581e-02f, 9.671512991e-03f, 1.326472266e-03f};
};
template <>
struct Exp2Poly<3> {
  static constexpr float c[4] = {1.0f, 6.932829618e-01f, 2.422109991e-01f, 5.500889197e-02f};
};

// ---- Scalar element access (tails, and the scalar variant) ----

inline float LoadElem(DType dt, const void* base, int64_t i) {
  switch (dt) {
    case DType::kFloat32: return static_cast<const float*>(base)[i];
    case DType::kFloat16: return HalfToFloat(static_cast<const uint16_t*>(base)[i]);
    case DType::kBFloat16: return BFloat16ToFloat(static_cast<const uint16_t*>(base)[i]);
    case DType::kBool: return static_cast<const uint8_t*>(base)[i] != 0 ? 1.0f : 0.0f;
  }
  return 0.0f;
}

inline void StoreElem(DType dt, void* base, int64_t i, float v) {
  switch (dt) {
    case DType::kFloat32: static_cast<float*>(base)[i] = v; return;
    case DType::kFloat16: static_cast<uint16_t*>(base)[i] = FloatToHalf(v); return;
    case DType::kBFloat16: static_cast<uint16_t*>(base)[i] = FloatToBFloat16(v); return;
    case DType::kBool: return;
  }
}

inline int64_t ElemSize(DType dt) { return dt == DType::kFloat32 ? 4 : dt == DType::kBool ? 1 : 2; }
inline const void* ElemPtr(const void* base, DType dt, int64_t i) {
  return static_cast<const char*>(base) + i * ElemSize(dt);
}
inline void* ElemPtr(void* base, DType dt, int64_t i) {
  return static_cast<char*>(base) + i * ElemSize(dt);
}

// Rows this far ahead are prefetched where K/V rows stream from memory
// (decode): the hardware prefetcher alone left read bandwidth unused.
// Prefetches past the end of a block are harmless (no fault, maybe a wasted
// line).
constexpr int64_t kPrefetchRows = 16;
inline void PrefetchRow(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(c + o, 0, 3);
}

inline uint32_t LoadU32(const void* p) {
  uint32_t x;
  std::memcpy(&x, p, sizeof x);
  return x;
}

// ---- Vector types ----
// Each provides: V, W, microkernel tile sizes, arithmetic, reductions,
// Exp2<degree> (for x <= 0; 0 for x < -126, so -inf gives exactly 0),
// LoadConvert/StoreConvert of W elements of a float dtype, BoolBias (0 where
// the mask byte is nonzero, -inf where it is 0) and a kT x kT transpose.

#if defined(ATTNSERVE_FLASH_VEC_SCALAR)
struct Vec {
  using V = float;
  static constexpr int W = 1;
  static constexpr int kQkRows = 4, kQkVecs = 4, kPvRows = 4, kPvVecs = 4;
  static constexpr int kT = 0;  // no vector transpose
  static V Zero() { return 0.0f; }
  static V Set1(float x) { return x; }
  static V Load(const float* p) { return *p; }
  static void Store(float* p, V v) { *p = v; }
  static V Fma(V a, V b, V c) { return a * b + c; }
  static V Mul(V a, V b) { return a * b; }
  static V Add(V a, V b) { return a + b; }
  static V Sub(V a, V b) { return a - b; }
  static V Max(V a, V b) { return a > b ? a : b; }
  static float ReduceMax(V v) { return v; }
  static float ReduceAdd(V v) { return v; }
  template <int kDegree>
  static V Exp2(V x) {
    return x < -126.0f ? 0.0f : std::exp2(x);
  }
  static V LoadConvert(const void* src, DType dt, int64_t i) { return LoadElem(dt, src, i); }
  static void StoreConvert(void* dst, DType dt, int64_t i, V v) { StoreElem(dt, dst, i, v); }
  static V BoolBias(const uint8_t* m) { return *m != 0 ? 0.0f : kNegInf; }
  static void Transpose(const float*, int64_t, float*, int64_t) {}
  // lane k of the result = sum of the lanes of acc[k] (W = 1: itself).
  static V ReduceLanes(V* acc) { return acc[0]; }
};
#endif

#if defined(ATTNSERVE_FLASH_VEC_AVX2)
struct Vec {
  using V = __m256;
  static constexpr int W = 8;
  // 16 ymm registers: 6 x 2 accumulators + 2 loads + 1 broadcast.
  static constexpr int kQkRows = 6, kQkVecs = 2, kPvRows = 6, kPvVecs = 2;
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
  // dst[c * ldd + r] = rows[r][col0 + c] for an 8 x 8 block.
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
#endif

#if defined(ATTNSERVE_FLASH_VEC_AVX512)
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
  static constexpr int kQkRows = 6, kQkVecs = 4, kPvRows = 6, kPvVecs = 4;
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
#endif

// ---- Row helpers over Vec ----

// dst[0, n) = src[0, n) as float.
inline void ConvertRow(const void* src, DType dt, int64_t n, float* dst) {
  int64_t j = 0;
  for (; j + Vec::W <= n; j += Vec::W) Vec::Store(dst + j, Vec::LoadConvert(src, dt, j));
  for (; j < n; ++j) dst[j] = LoadElem(dt, src, j);
}

// dst[0, n) = src[0, n) * mul, rounded to dt.
inline void StoreRowScaled(void* dst, DType dt, const float* src, int64_t n, float mul) {
  const typename Vec::V m = Vec::Set1(mul);
  int64_t j = 0;
  for (; j + Vec::W <= n; j += Vec::W) Vec::StoreConvert(dst, dt, j, Vec::Mul(Vec::Load(src + j), m));
  for (; j < n; ++j) StoreElem(dt, dst, j, src[j] * mul);
}

inline void FillRow(float* dst, int64_t n, float value) {
  const typename Vec::V v = Vec::Set1(value);
  int64_t j = 0;
  for (; j + Vec::W <= n; j += Vec::W) Vec::Store(dst + j, v);
  for (; j < n; ++j) dst[j] = value;
}

// ---- fp32 products (scalar, AVX2, AVX-512) ----
//
// Q: [rows][d] fp32. K block transposed: kt[d][npad] (keys along vectors, so
// one broadcast of Q[r][k] meets a vector of keys). V rows: [n][ld] fp32,
// read in place when already fp32 with a vector-multiple width. P lives in
// the score buffer (in place).
#if defined(ATTNSERVE_FLASH_FP32)
struct Products {
  using QElem = float;
  using KElem = float;
  using VElem = float;
  using PElem = float;
  static constexpr int kRowAlign = 1;
  // Keys of a block are padded to a multiple of this: one AVX-512 vector,
  // so a short key sequence (8 or 16 keys) does not pay for a 64-key tile.
  static constexpr int64_t kKeyAlign = 16;
  static constexpr int kExpDegree = 5;
  static constexpr bool kPInScores = true;
  using V = Vec::V;
  static constexpr int W = Vec::W;
  static_assert(kKeyAlign % W == 0 && flash::kKeyAlign % kKeyAlign == 0);

  static void Begin() {}
  static void End() {}
  static int64_t QStride(int64_t d) { return d; }
  static size_t KElems(int64_t d, int64_t npad) { return static_cast<size_t>(d * npad); }
  static size_t VElems(int64_t npad, int64_t dv_pad) { return static_cast<size_t>(npad * dv_pad); }
  static size_t ConvElems(int64_t d) { return static_cast<size_t>(16 * d); }

  static void PackQ(float* q, const void* const* rows, int64_t r_count, int64_t r_pad, DType dt,
                    int64_t d) {
    for (int64_t r = 0; r < r_count; ++r) ConvertRow(rows[r], dt, d, q + r * d);
    for (int64_t r = r_count; r < r_pad; ++r) FillRow(q + r * d, d, 0.0f);
  }

  // kt[k][j] = K[j][k] for j < n, 0 for n <= j < npad. `kbase` points at
  // key 0 of the block, rows `ld` elements apart; conv: 16 * d floats.
  static void PackK(float* kt, const void* kbase, DType dt, int64_t ld, int64_t n, int64_t npad,
                    int64_t d, float* conv) {
    int64_t j0 = 0;
    if constexpr (Vec::kT > 0) {
      constexpr int T = Vec::kT > 0 ? Vec::kT : 1;
      for (; j0 + T <= n; j0 += T) {
        // T rows, `lds` apart: K itself when fp32, else converted copies.
        const float* rows = static_cast<const float*>(ElemPtr(kbase, dt, j0 * ld));
        int64_t lds = ld;
        if (dt != DType::kFloat32) {
          for (int jj = 0; jj < T; ++jj) ConvertRow(ElemPtr(kbase, dt, (j0 + jj) * ld), dt, d, conv + jj * d);
          rows = conv;
          lds = d;
        }
        int64_t k0 = 0;
        for (; k0 + T <= d; k0 += T) Vec::Transpose(rows + k0, lds, kt + k0 * npad + j0, npad);
        for (int64_t k = k0; k < d; ++k)
          for (int jj = 0; jj < T; ++jj) kt[k * npad + j0 + jj] = rows[jj * lds + k];
      }
    }
    for (int64_t j = j0; j < n; ++j) {
      ConvertRow(ElemPtr(kbase, dt, j * ld), dt, d, conv);
      for (int64_t k = 0; k < d; ++k) kt[k * npad + j] = conv[k];
    }
    for (int64_t k = 0; k < d; ++k) FillRow(kt + k * npad + n, npad - n, 0.0f);
  }

  // Few rows (decode): Q K^T as dot products straight from the K rows, W
  // keys at a time reduced across lanes, instead of transposing K for a
  // broadcast GEMM that would use one row of it. Needs d % W == 0 and fp32
  // K rows (conv is not used).
  static bool UseDirectK(int64_t rows, int64_t d, DType dt) { return rows <= 4 && d % W == 0; }
  static void QKDirect(float* s, int64_t lds, const float* q, int64_t ldq, const void* kbase,
                       DType dt, int64_t ld, int64_t rows, int64_t n, int64_t d) {
    for (int64_t j0 = 0; j0 < n; j0 += W) {
      const int64_t nk = std::min<int64_t>(W, n - j0);
      for (int64_t r = 0; r < rows; ++r) {
        const float* qr = q + r * ldq;
        V acc[W];
#pragma GCC unroll 16
        for (int jj = 0; jj < W; ++jj) {
          acc[jj] = Vec::Zero();
          if (jj < nk) {
            const void* kr = ElemPtr(kbase, dt, (j0 + jj) * ld);
            if (r == 0) PrefetchRow(ElemPtr(kr, dt, kPrefetchRows * ld), d * ElemSize(dt));
            for (int64_t c = 0; c < d; c += W)
              acc[jj] = Vec::Fma(Vec::Load(qr + c), Vec::LoadConvert(kr, dt, c), acc[jj]);
          }
        }
        Vec::Store(s + r * lds + j0, Vec::ReduceLanes(acc));
      }
    }
  }

  // Returns V rows (and their stride): in place when possible, else
  // converted into vb [n][dv_pad] with zero columns past dv.
  static const float* PackV(float* vb, const void* vbase, DType dt, int64_t ld, int64_t n,
                            int64_t npad, int64_t dv, int64_t dv_pad, float* /*conv*/,
                            int64_t* ldv) {
    if (dt == DType::kFloat32 && dv == dv_pad) {
      *ldv = ld;
      return static_cast<const float*>(vbase);
    }
    for (int64_t j = 0; j < n; ++j) {
      ConvertRow(ElemPtr(vbase, dt, j * ld), dt, dv, vb + j * dv_pad);
      FillRow(vb + j * dv_pad + dv, dv_pad - dv, 0.0f);
    }
    *ldv = dv_pad;
    return vb;
  }

  template <int M, int N>
  static void QkTile(const float* q, int64_t ldq, const float* kt, int64_t ldk, int64_t d,
                     float* s, int64_t lds) {
    V acc[M][N];
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m)
#pragma GCC unroll 4
      for (int n = 0; n < N; ++n) acc[m][n] = Vec::Zero();
    for (int64_t k = 0; k < d; ++k) {
      V kv[N];
#pragma GCC unroll 4
      for (int n = 0; n < N; ++n) kv[n] = Vec::Load(kt + k * ldk + n * W);
#pragma GCC unroll 8
      for (int m = 0; m < M; ++m) {
        const V qb = Vec::Set1(q[m * ldq + k]);
#pragma GCC unroll 4
        for (int n = 0; n < N; ++n) acc[m][n] = Vec::Fma(qb, kv[n], acc[m][n]);
      }
    }
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m)
#pragma GCC unroll 4
      for (int n = 0; n < N; ++n) Vec::Store(s + m * lds + n * W, acc[m][n]);
  }

  // Scores of rows [0, rows) for the N * W keys from column j0.
  template <int N>
  static void QkRows(float* s, int64_t lds, const float* q, int64_t ldq, const float* kt,
                     int64_t ldk, int64_t rows, int64_t j0, int64_t d) {
    constexpr int M = Vec::kQkRows;
    int64_t r0 = 0;
    for (; r0 + M <= rows; r0 += M) QkTile<M, N>(q + r0 * ldq, ldq, kt + j0, ldk, d, s + r0 * lds + j0, lds);
    const float* qr = q + r0 * ldq;
    float* sr = s + r0 * lds + j0;
    switch (rows - r0) {
      case 0: break;
      case 1: QkTile<1, N>(qr, ldq, kt + j0, ldk, d, sr, lds); break;
      case 2: QkTile<2, N>(qr, ldq, kt + j0, ldk, d, sr, lds); break;
      case 3: QkTile<3, N>(qr, ldq, kt + j0, ldk, d, sr, lds); break;
      case 4: if constexpr (M > 4) QkTile<4, N>(qr, ldq, kt + j0, ldk, d, sr, lds); break;
      case 5: if constexpr (M > 5) QkTile<5, N>(qr, ldq, kt + j0, ldk, d, sr, lds); break;
    }
  }

  // s[r][j] = sum_k q[r][k] kt[k][j] for r < rows, j < ncols (a multiple of
  // kKeyAlign): kQkVecs vectors of keys at a time, then the 1..kQkVecs-1
  // left. Every score is the same k-ordered sum whatever the tile width.
  static void QK(float* s, int64_t lds, const float* q, int64_t ldq, const float* kt, int64_t ldk,
                 int64_t rows, int64_t ncols, int64_t d) {
    constexpr int N = Vec::kQkVecs;
    int64_t j0 = 0;
    for (; j0 + N * W <= ncols; j0 += N * W) QkRows<N>(s, lds, q, ldq, kt, ldk, rows, j0, d);
    if constexpr (N > 1) {
      switch ((ncols - j0) / W) {
        case 0: break;
        case 1: QkRows<1>(s, lds, q, ldq, kt, ldk, rows, j0, d); break;
        case 2: if constexpr (N > 2) QkRows<2>(s, lds, q, ldq, kt, ldk, rows, j0, d); break;
        case 3: if constexpr (N > 3) QkRows<3>(s, lds, q, ldq, kt, ldk, rows, j0, d); break;
      }
    }
  }

  // Where P V reads V rows: packed/in-place fp32, or (decode) any float
  // dtype straight from the input, widened in registers.
  struct Fp32VRows {
    const float* v;
    int64_t ld;
    V Load(int64_t j, int64_t c) const { return Vec::Load(v + j * ld + c); }
    void Prefetch(int64_t j, int64_t cols) const { PrefetchRow(v + j * ld, cols * 4); }
    Fp32VRows Columns(int64_t c0) const { return {v + c0, ld}; }
  };
  struct InputVRows {
    const void* v;
    DType dt;
    int64_t ld, c0;
    V Load(int64_t j, int64_t c) const { return Vec::LoadConvert(ElemPtr(v, dt, j * ld), dt, c0 + c); }
    void Prefetch(int64_t j, int64_t cols) const { PrefetchRow(ElemPtr(v, dt, j * ld + c0), cols * ElemSize(dt)); }
    InputVRows Columns(int64_t c) const { return {v, dt, ld, c0 + c}; }
  };

  template <int M, int N, typename VRows>
  static void PvTile(float* o, int64_t ldo, const float* alpha, const float* p, int64_t ldp,
                     const VRows& vr, int64_t n) {
    V acc[M][N];
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) {
      const V a = Vec::Set1(alpha[m]);
#pragma GCC unroll 4
      for (int c = 0; c < N; ++c) acc[m][c] = Vec::Mul(Vec::Load(o + m * ldo + c * W), a);
    }
    for (int64_t j = 0; j < n; ++j) {
      vr.Prefetch(j + kPrefetchRows, N * W);
      V vv[N];
#pragma GCC unroll 4
      for (int c = 0; c < N; ++c) vv[c] = vr.Load(j, c * W);
#pragma GCC unroll 8
      for (int m = 0; m < M; ++m) {
        const V pb = Vec::Set1(p[m * ldp + j]);
#pragma GCC unroll 4
        for (int c = 0; c < N; ++c) acc[m][c] = Vec::Fma(pb, vv[c], acc[m][c]);
      }
    }
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m)
#pragma GCC unroll 4
      for (int c = 0; c < N; ++c) Vec::Store(o + m * ldo + c * W, acc[m][c]);
  }

  template <int N, typename VRows>
  static void PvRows(float* o, int64_t ldo, const float* alpha, const float* p, int64_t ldp,
                     const VRows& vr, int64_t rows, int64_t n) {
    constexpr int M = Vec::kPvRows;
    int64_t r0 = 0;
    for (; r0 + M <= rows; r0 += M)
      PvTile<M, N>(o + r0 * ldo, ldo, alpha + r0, p + r0 * ldp, ldp, vr, n);
    float* orow = o + r0 * ldo;
    const float* prow = p + r0 * ldp;
    switch (rows - r0) {
      case 0: break;
      case 1: PvTile<1, N>(orow, ldo, alpha + r0, prow, ldp, vr, n); break;
      case 2: PvTile<2, N>(orow, ldo, alpha + r0, prow, ldp, vr, n); break;
      case 3: PvTile<3, N>(orow, ldo, alpha + r0, prow, ldp, vr, n); break;
      case 4: if constexpr (M > 4) PvTile<4, N>(orow, ldo, alpha + r0, prow, ldp, vr, n); break;
      case 5: if constexpr (M > 5) PvTile<5, N>(orow, ldo, alpha + r0, prow, ldp, vr, n); break;
    }
  }

  // o[r] = alpha[r] * o[r] + sum_{j < n} p[r][j] v[j] for r < rows, over
  // dv_pad columns (a multiple of 16).
  template <typename VRows>
  static void PvColumns(float* o, int64_t ldo, const float* alpha, const float* p, int64_t ldp,
                        const VRows& vr, int64_t rows, int64_t n, int64_t dv_pad) {
    constexpr int N = Vec::kPvVecs;
    int64_t c0 = 0;
    for (; c0 + N * W <= dv_pad; c0 += N * W) PvRows<N>(o + c0, ldo, alpha, p, ldp, vr.Columns(c0), rows, n);
    if constexpr (N > 1) {
      switch ((dv_pad - c0) / W) {
        case 0: break;
        case 1: PvRows<1>(o + c0, ldo, alpha, p, ldp, vr.Columns(c0), rows, n); break;
        case 2: if constexpr (N > 2) PvRows<2>(o + c0, ldo, alpha, p, ldp, vr.Columns(c0), rows, n); break;
        case 3: if constexpr (N > 3) PvRows<3>(o + c0, ldo, alpha, p, ldp, vr.Columns(c0), rows, n); break;
      }
    }
  }

  static void PV(float* o, int64_t ldo, const float* alpha, const float* p, int64_t ldp,
                 const float* v, int64_t ldv, int64_t rows, int64_t n, int64_t dv_pad, float*) {
    PvColumns(o, ldo, alpha, p, ldp, Fp32VRows{v, ldv}, rows, n, dv_pad);
  }

  // Decode: V rows read in place whatever their dtype (dv must equal dv_pad).
  static bool UseDirectV(int64_t rows, int64_t dv, int64_t dv_pad) { return rows <= 4 && dv == dv_pad; }
  static void PVDirect(float* o, int64_t ldo, const float* alpha, const float* p, int64_t ldp,
                       const void* vbase, DType dt, int64_t ldv, int64_t rows, int64_t n, int64_t dv_pad) {
    PvColumns(o, ldo, alpha, p, ldp, InputVRows{vbase, dt, ldv, 0}, rows, n, dv_pad);
  }

  static void StoreP(float* dst, V p) { Vec::Store(dst, p); }
};
#endif  // ATTNSERVE_FLASH_FP32

// ---- bf16 products (AVX512_BF16 dot products, or AMX tiles) ----
//
// Q: [rows][d_pad] bf16 with d_pad = d rounded up to 32. K block in "VNNI"
// pairs: k2[d_pad/2][npad] u32, each u32 = (K[j][2p], K[j][2p+1]); V block
// likewise over key pairs: v2[npad/2][dv_pad] u32 = (V[2q][c], V[2q+1][c]).
// P: [rows][npad] bf16. Both layouts are what vdpbf16ps (a pair per 32-bit
// lane) and AMX's B operand expect.
#if defined(ATTNSERVE_FLASH_BF16) || defined(ATTNSERVE_FLASH_AMX)
struct Bf16Packing {
  using QElem = uint16_t;
  using KElem = uint32_t;
  using VElem = uint32_t;
  using PElem = uint16_t;
  // Keys of a block are padded to a multiple of this (the 64-key tiles of
  // both bf16 product kernels).
  static constexpr int64_t kKeyAlign = flash::kKeyAlign;
  static constexpr int kExpDegree = 3;
  static constexpr bool kPInScores = false;
  using V = Vec::V;

  static int64_t QStride(int64_t d) { return RoundUp(d, 32); }
  static size_t KElems(int64_t d, int64_t npad) { return static_cast<size_t>(RoundUp(d, 32) / 2 * npad); }
  static size_t VElems(int64_t npad, int64_t dv_pad) { return static_cast<size_t>(npad / 2 * dv_pad); }
  // 16 rows of d_pad bf16 (as floats' worth of space) plus a converted row.
  static size_t ConvElems(int64_t d) { return static_cast<size_t>(16 * RoundUp(d, 32) + RoundUp(d, 32) + 16); }

  static __m256i ToBf16(V v) { return (__m256i)_mm512_cvtneps_pbh(v); }

  // K and V are always packed (AMX and vdpbf16ps both want pair layouts).
  static bool UseDirectK(int64_t, int64_t, DType) { return false; }
  static bool UseDirectV(int64_t, int64_t, int64_t) { return false; }
  static void PVDirect(float*, int64_t, const float*, const uint16_t*, int64_t, const void*, DType,
                       int64_t, int64_t, int64_t, int64_t) {}
  static void QKDirect(float*, int64_t, const uint16_t*, int64_t, const void*, DType, int64_t,
                       int64_t, int64_t, int64_t) {}

  // dst[0, n) = bf16(src[0, n)), dst[n, npad) = 0.
  static void RowToBf16(uint16_t* dst, const void* src, DType dt, int64_t n, int64_t npad) {
    int64_t j = 0;
    if (dt == DType::kBFloat16) {
      std::memcpy(dst, src, static_cast<size_t>(n) * 2);
      j = n;
    } else {
      for (; j + 16 <= n; j += 16)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + j), ToBf16(Vec::LoadConvert(src, dt, j)));
      for (; j < n; ++j) dst[j] = FloatToBFloat16(LoadElem(dt, src, j));
    }
    for (; j < npad; ++j) dst[j] = 0;
  }

  static void PackQ(uint16_t* q, const void* const* rows, int64_t r_count, int64_t r_pad, DType dt,
                    int64_t d) {
    const int64_t ldq = QStride(d);
    for (int64_t r = 0; r < r_count; ++r) RowToBf16(q + r * ldq, rows[r], dt, d, ldq);
    std::memset(q + r_count * ldq, 0, static_cast<size_t>((r_pad - r_count) * ldq) * 2);
  }

  static void PackK(uint32_t* k2, const void* kbase, DType dt, int64_t ld, int64_t n, int64_t npad,
                    int64_t d, float* conv_f) {
    const int64_t dpad = QStride(d);
    const int64_t pairs = dpad / 2;
    uint16_t* conv = reinterpret_cast<uint16_t*>(conv_f);
    const int64_t nfull = RoundUp(n, 16);
    for (int64_t j0 = 0; j0 < nfull; j0 += 16) {
      for (int jj = 0; jj < 16; ++jj) {
        if (j0 + jj < n) {
          RowToBf16(conv + jj * dpad, ElemPtr(kbase, dt, (j0 + jj) * ld), dt, d, dpad);
        } else {
          std::memset(conv + jj * dpad, 0, static_cast<size_t>(dpad) * 2);
        }
      }
      for (int64_t p0 = 0; p0 < pairs; p0 += 16) {
        __m512 r[16];
#pragma GCC unroll 16
        for (int jj = 0; jj < 16; ++jj)
          r[jj] = _mm512_loadu_ps(reinterpret_cast<const float*>(conv + jj * dpad) + p0);
        Transpose16x16(r);
#pragma GCC unroll 16
        for (int pp = 0; pp < 16; ++pp)
          _mm512_storeu_ps(reinterpret_cast<float*>(k2 + (p0 + pp) * npad + j0), r[pp]);
      }
    }
    if (nfull < npad)
      for (int64_t p = 0; p < pairs; ++p)
        std::memset(k2 + p * npad + nfull, 0, static_cast<size_t>(npad - nfull) * 4);
  }

  // Pairs of V rows interleaved; key pairs up to RoundUp(n, 32) / 2 are
  // written (zeros past n), which covers every product loop.
  static const uint32_t* PackV(uint32_t* v2, const void* vbase, DType dt, int64_t ld, int64_t n,
                               int64_t npad, int64_t dv, int64_t dv_pad, float* conv_f,
                               int64_t* ldv) {
    *ldv = dv_pad;
    uint16_t* a = reinterpret_cast<uint16_t*>(conv_f);
    uint16_t* b = a + dv_pad;
    const int64_t pairs = RoundUp(n, 32) / 2;
    for (int64_t q = 0; q < pairs; ++q) {
      uint32_t* out = v2 + q * dv_pad;
      const int64_t j = 2 * q;
      if (j >= n) {
        std::memset(out, 0, static_cast<size_t>(dv_pad) * 4);
        continue;
      }
      RowToBf16(a, ElemPtr(vbase, dt, j * ld), dt, dv, dv_pad);
      if (j + 1 < n) {
        RowToBf16(b, ElemPtr(vbase, dt, (j + 1) * ld), dt, dv, dv_pad);
      } else {
        std::memset(b, 0, static_cast<size_t>(dv_pad) * 2);
      }
      for (int64_t c = 0; c < dv_pad; c += 16) {
        const __m512i lo = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + c)));
        const __m512i hi = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + c)));
        _mm512_storeu_si512(out + c, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
      }
    }
    return v2;
  }

  static void StoreP(uint16_t* dst, V p) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), ToBf16(p));
  }
};
#endif

#if defined(ATTNSERVE_FLASH_BF16)
struct Products : Bf16Packing {
  static constexpr int kRowAlign = 1;
  static void Begin() {}
  static void End() {}

  template <int M, int N>
  static void QkTile(const uint16_t* q, int64_t ldq, const uint32_t* k2, int64_t ldk,
                     int64_t pairs, float* s, int64_t lds) {
    __m512 acc[M][N];
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m)
#pragma GCC unroll 4
      for (int n = 0; n < N; ++n) acc[m][n] = _mm512_setzero_ps();
    for (int64_t p = 0; p < pairs; ++p) {
      __m512bh kv[N];
#pragma GCC unroll 4
      for (int n = 0; n < N; ++n) kv[n] = (__m512bh)_mm512_loadu_si512(k2 + p * ldk + n * 16);
#pragma GCC unroll 8
      for (int m = 0; m < M; ++m) {
        const __m512bh qb = (__m512bh)_mm512_set1_epi32(static_cast<int>(LoadU32(q + m * ldq + 2 * p)));
#pragma GCC unroll 4
        for (int n = 0; n < N; ++n) acc[m][n] = _mm512_dpbf16_ps(acc[m][n], qb, kv[n]);
      }
    }
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m)
#pragma GCC unroll 4
      for (int n = 0; n < N; ++n) _mm512_storeu_ps(s + m * lds + n * 16, acc[m][n]);
  }

  static void QK(float* s, int64_t lds, const uint16_t* q, int64_t ldq, const uint32_t* k2,
                 int64_t ldk, int64_t rows, int64_t ncols, int64_t d) {
    constexpr int M = 6, N = 4;
    const int64_t pairs = (d + 1) / 2;
    for (int64_t j0 = 0; j0 < ncols; j0 += N * 16) {
      int64_t r0 = 0;
      for (; r0 + M <= rows; r0 += M)
        QkTile<M, N>(q + r0 * ldq, ldq, k2 + j0, ldk, pairs, s + r0 * lds + j0, lds);
      const uint16_t* qr = q + r0 * ldq;
      float* sr = s + r0 * lds + j0;
      switch (rows - r0) {
        case 0: break;
        case 1: QkTile<1, N>(qr, ldq, k2 + j0, ldk, pairs, sr, lds); break;
        case 2: QkTile<2, N>(qr, ldq, k2 + j0, ldk, pairs, sr, lds); break;
        case 3: QkTile<3, N>(qr, ldq, k2 + j0, ldk, pairs, sr, lds); break;
        case 4: QkTile<4, N>(qr, ldq, k2 + j0, ldk, pairs, sr, lds); break;
        case 5: QkTile<5, N>(qr, ldq, k2 + j0, ldk, pairs, sr, lds); break;
      }
    }
  }

  template <int M, int N>
  static void PvTile(float* o, int64_t ldo, const float* alpha, const uint16_t* p, int64_t ldp,
                     const uint32_t* v2, int64_t ldv, int64_t pairs) {
    __m512 acc[M][N];
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) {
      const __m512 a = _mm512_set1_ps(alpha[m]);
#pragma GCC unroll 4
      for (int c = 0; c < N; ++c) acc[m][c] = _mm512_mul_ps(_mm512_loadu_ps(o + m * ldo + c * 16), a);
    }
    for (int64_t q = 0; q < pairs; ++q) {
      __m512bh vv[N];
#pragma GCC unroll 4
      for (int c = 0; c < N; ++c) vv[c] = (__m512bh)_mm512_loadu_si512(v2 + q * ldv + c * 16);
#pragma GCC unroll 8
      for (int m = 0; m < M; ++m) {
        const __m512bh pb = (__m512bh)_mm512_set1_epi32(static_cast<int>(LoadU32(p + m * ldp + 2 * q)));
#pragma GCC unroll 4
        for (int c = 0; c < N; ++c) acc[m][c] = _mm512_dpbf16_ps(acc[m][c], pb, vv[c]);
      }
    }
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m)
#pragma GCC unroll 4
      for (int c = 0; c < N; ++c) _mm512_storeu_ps(o + m * ldo + c * 16, acc[m][c]);
  }

  template <int N>
  static void PvRows(float* o, int64_t ldo, const float* alpha, const uint16_t* p, int64_t ldp,
                     const uint32_t* v2, int64_t ldv, int64_t rows, int64_t pairs) {
    constexpr int M = 6;
    int64_t r0 = 0;
    for (; r0 + M <= rows; r0 += M)
      PvTile<M, N>(o + r0 * ldo, ldo, alpha + r0, p + r0 * ldp, ldp, v2, ldv, pairs);
    float* orow = o + r0 * ldo;
    const uint16_t* prow = p + r0 * ldp;
    switch (rows - r0) {
      case 0: break;
      case 1: PvTile<1, N>(orow, ldo, alpha + r0, prow, ldp, v2, ldv, pairs); break;
      case 2: PvTile<2, N>(orow, ldo, alpha + r0, prow, ldp, v2, ldv, pairs); break;
      case 3: PvTile<3, N>(orow, ldo, alpha + r0, prow, ldp, v2, ldv, pairs); break;
      case 4: PvTile<4, N>(orow, ldo, alpha + r0, prow, ldp, v2, ldv, pairs); break;
      case 5: PvTile<5, N>(orow, ldo, alpha + r0, prow, ldp, v2, ldv, pairs); break;
    }
  }

  static void PV(float* o, int64_t ldo, const float* alpha, const uint16_t* p, int64_t ldp,
                 const uint32_t* v2, int64_t ldv, int64_t rows, int64_t n, int64_t dv_pad, float*) {
    const int64_t pairs = (n + 1) / 2;
    int64_t c0 = 0;
    for (; c0 + 64 <= dv_pad; c0 += 64) PvRows<4>(o + c0, ldo, alpha, p, ldp, v2 + c0, ldv, rows, pairs);
    switch ((dv_pad - c0) / 16) {
      case 0: break;
      case 1: PvRows<1>(o + c0, ldo, alpha, p, ldp, v2 + c0, ldv, rows, pairs); break;
      case 2: PvRows<2>(o + c0, ldo, alpha, p, ldp, v2 + c0, ldv, rows, pairs); break;
      case 3: PvRows<3>(o + c0, ldo, alpha, p, ldp, v2 + c0, ldv, rows, pairs); break;
    }
  }
};
#endif  // ATTNSERVE_FLASH_BF16

#if defined(ATTNSERVE_FLASH_AMX)
// Tiles 0-3 accumulate a 32 x 32 fp32 block, 4-5 hold A (16 rows x 32
// bf16), 6-7 hold B (16 pair-rows x 16 columns). All are 16 x 64 bytes.
struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// c[32 x 32] (fp32, or the 16-row / 16-column part when !kTwoRows /
// !kTwoCols) = a[rows x 32*ksteps] (bf16, lda bytes apart) x b (VNNI pairs,
// 16 pair-rows per k step, ldb bytes apart).
template <bool kTwoRows, bool kTwoCols>
inline void AmxBlock(float* c, int64_t ldc, const uint16_t* a, int64_t lda, const uint32_t* b,
                     int64_t ldb, int64_t ksteps) {
  const char* ab = reinterpret_cast<const char*>(a);
  const char* bb = reinterpret_cast<const char*>(b);
  char* cb = reinterpret_cast<char*>(c);
  _tile_zero(0);
  if constexpr (kTwoCols) _tile_zero(1);
  if constexpr (kTwoRows) _tile_zero(2);
  if constexpr (kTwoRows && kTwoCols) _tile_zero(3);
  for (int64_t k = 0; k < ksteps; ++k) {
    _tile_loadd(4, ab + k * 64, lda);
    if constexpr (kTwoRows) _tile_loadd(5, ab + 16 * lda + k * 64, lda);
    _tile_loadd(6, bb + k * 16 * ldb, ldb);
    if constexpr (kTwoCols) _tile_loadd(7, bb + k * 16 * ldb + 64, ldb);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (kTwoCols) _tile_dpbf16ps(1, 4, 7);
    if constexpr (kTwoRows) _tile_dpbf16ps(2, 5, 6);
    if constexpr (kTwoRows && kTwoCols) _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, cb, ldc);
  if constexpr (kTwoCols) _tile_stored(1, cb + 64, ldc);
  if constexpr (kTwoRows) _tile_stored(2, cb + 16 * ldc, ldc);
  if constexpr (kTwoRows && kTwoCols) _tile_stored(3, cb + 16 * ldc + 64, ldc);
}

// c = a x b over rows (a multiple of 16) and cols (a multiple of 16), byte
// strides.
inline void AmxGemm(float* c, int64_t ldc, const uint16_t* a, int64_t lda, const uint32_t* b,
                    int64_t ldb, int64_t rows, int64_t cols, int64_t ksteps) {
  for (int64_t r0 = 0; r0 < rows; r0 += 32) {
    const bool two_rows = rows - r0 >= 32;
    for (int64_t c0 = 0; c0 < cols; c0 += 32) {
      const bool two_cols = cols - c0 >= 32;
      float* cc = reinterpret_cast<float*>(reinterpret_cast<char*>(c) + r0 * ldc) + c0;
      const uint16_t* aa = reinterpret_cast<const uint16_t*>(reinterpret_cast<const char*>(a) + r0 * lda);
      const uint32_t* bb = b + c0;
      if (two_rows && two_cols) AmxBlock<true, true>(cc, ldc, aa, lda, bb, ldb, ksteps);
      else if (two_rows) AmxBlock<true, false>(cc, ldc, aa, lda, bb, ldb, ksteps);
      else if (two_cols) AmxBlock<false, true>(cc, ldc, aa, lda, bb, ldb, ksteps);
      else AmxBlock<false, false>(cc, ldc, aa, lda, bb, ldb, ksteps);
    }
  }
}

struct Products : Bf16Packing {
  static constexpr int kRowAlign = 16;

  static void Begin() {
    TileConfig cfg;
    for (int t = 0; t < 8; ++t) {
      cfg.colsb[t] = 64;
      cfg.rows[t] = 16;
    }
    _tile_loadconfig(&cfg);
  }
  static void End() { _tile_release(); }

  static void QK(float* s, int64_t lds, const uint16_t* q, int64_t ldq, const uint32_t* k2,
                 int64_t ldk, int64_t rows, int64_t ncols, int64_t d) {
    AmxGemm(s, lds * 4, q, ldq * 2, k2, ldk * 4, rows, ncols, QStride(d) / 32);
  }

  // tmp: rows x dv_pad floats.
  static void PV(float* o, int64_t ldo, const float* alpha, const uint16_t* p, int64_t ldp,
                 const uint32_t* v2, int64_t ldv, int64_t rows, int64_t n, int64_t dv_pad,
                 float* tmp) {
    AmxGemm(tmp, dv_pad * 4, p, ldp * 2, v2, ldv * 4, rows, dv_pad, RoundUp(n, 32) / 32);
    for (int64_t r = 0; r < rows; ++r) {
      const __m512 a = _mm512_set1_ps(alpha[r]);
      float* orow = o + r * ldo;
      const float* trow = tmp + r * dv_pad;
      for (int64_t c = 0; c < dv_pad; c += 16)
        _mm512_storeu_ps(orow + c, _mm512_fmadd_ps(_mm512_loadu_ps(orow + c), a, _mm512_loadu_ps(trow + c)));
    }
  }
};
#endif  // ATTNSERVE_FLASH_AMX

// ---- The driver ----

class Kernel {
  using V = Vec::V;
  static constexpr int W = Vec::W;
  using QElem = Products::QElem;
  using KElem = Products::KElem;
  using VElem = Products::VElem;
  using PElem = Products::PElem;

  struct Row {
    int64_t i = 0, h = 0;
    int64_t limit = 0;  // keys [0, limit) may be visible (also <= item key1)
    int64_t mask_offset = 0;
    void* out = nullptr;
  };

  // Per-thread buffers, reused across items and calls.
  struct Scratch {
    ScratchBuffer q, k, v, s, p, o, stats, bias, conv, tmp, avg;
  };
  static Scratch& ThreadScratch() {
    static thread_local Scratch scratch;
    return scratch;
  }

  enum class Mode {
    kOnline,  // running max/sum, P for this block, alpha to rescale O
    kStats,   // running max/sum only (weights pass 1)
    kFinal,   // P = 2^(t - m) / l with the final m, l (weights pass 2)
  };

  // Scores of one row of one key block -> probabilities. s: the row's raw
  // Q.K (npad entries, overwritten with t and, in kFinal, fp32 P); prow:
  // P as PElem. n keys are valid in the block; row.limit - kb are visible.
  template <Mode kMode>
  static void SoftmaxBlock(const RequestPlan& plan, const Row& row, int64_t kb, int64_t n,
                           int64_t npad, float* s, PElem* prow, float* bias, float* m, float* l,
                           float* alpha) {
    const AttentionParams& p = *plan.p;
    const int64_t visible = std::min(row.limit - kb, n);
    if (visible <= 0) {
      *alpha = 1.0f;
      if constexpr (kMode != Mode::kStats) std::memset(prow, 0, static_cast<size_t>(npad) * sizeof(PElem));
      if constexpr (kMode == Mode::kFinal) FillRow(s, n, 0.0f);
      return;
    }
    const int64_t jv = RoundUp(visible, W);
    FillRow(s + visible, jv - visible, kNegInf);
    // Without a mask the scores stay raw and the scale folds into the
    // exponent's FMA (2^(s*c - m)); with one, t = s*c + bias is stored.
    const bool masked = p.mask.kind != MaskParams::Kind::kNone;
    const V c = Vec::Set1(plan.score_scale);
    V mx = Vec::Set1(kNegInf);
    if (!masked) {
      for (int64_t j = 0; j < jv; j += W) mx = Vec::Max(mx, Vec::Load(s + j));
    } else {
      BuildBias(p.mask, row.mask_offset + kb * p.mask.stride_k, visible, jv, bias);
      for (int64_t j = 0; j < jv; j += W) {
        const V t = Vec::Fma(Vec::Load(s + j), c, Vec::Load(bias + j));
        Vec::Store(s + j, t);
        mx = Vec::Max(mx, t);
      }
    }
    // c > 0, so max(s) * c == max(s * c) exactly (rounding is monotonic).
    const float block_max = masked ? Vec::ReduceMax(mx) : Vec::ReduceMax(mx) * plan.score_scale;
    // 2^(t_j - m) for the vector at j.
    auto exp_arg = [&](int64_t j, V neg_m) {
      return masked ? Vec::Add(Vec::Load(s + j), neg_m) : Vec::Fma(Vec::Load(s + j), c, neg_m);
    };
    constexpr int kDeg = Products::kExpDegree;
    if constexpr (kMode == Mode::kFinal) {
      // m, l are final; l == 0 means the row saw no key at all.
      const float inv_l = *l > 0.0f ? 1.0f / *l : 0.0f;
      const V neg_m = Vec::Set1(*m == kNegInf ? 0.0f : -*m);
      const V il = Vec::Set1(inv_l);
      for (int64_t j = 0; j < jv; j += W) {
        const V pv = Vec::Mul(Vec::template Exp2<kDeg>(exp_arg(j, neg_m)), il);
        Vec::Store(s + j, pv);
        if constexpr (!Products::kPInScores) Products::StoreP(prow + j, pv);
      }
      FillRow(s + jv, npad - jv, 0.0f);
      if constexpr (!Products::kPInScores) std::memset(prow + jv, 0, static_cast<size_t>(npad - jv) * sizeof(PElem));
      *alpha = 1.0f;
    } else {
      const float m_new = std::max(*m, block_max);
      if (m_new == kNegInf) {  // every visible key masked to -inf so far
        *alpha = 1.0f;
        if constexpr (kMode == Mode::kOnline) std::memset(prow, 0, static_cast<size_t>(npad) * sizeof(PElem));
        return;
      }
      const float a = *m == kNegInf ? 0.0f : std::exp2(*m - m_new);
      const V neg_m = Vec::Set1(-m_new);
      V sum = Vec::Zero();
      for (int64_t j = 0; j < jv; j += W) {
        const V pv = Vec::template Exp2<kDeg>(exp_arg(j, neg_m));
        if constexpr (kMode == Mode::kOnline) Products::StoreP(prow + j, pv);
        sum = Vec::Add(sum, pv);
      }
      if constexpr (kMode == Mode::kOnline) {
        if constexpr (Products::kPInScores) FillRow(reinterpret_cast<float*>(prow) + jv, npad - jv, 0.0f);
        else std::memset(prow + jv, 0, static_cast<size_t>(npad - jv) * sizeof(PElem));
      }
      *l = *l * a + Vec::ReduceAdd(sum);
      *m = m_new;
      *alpha = a;
    }
  }

  // bias[j] = mask(j) * log2(e) (additive) or 0 / -inf (bool) for j <
  // visible; 0 for visible <= j < jv (those scores are already -inf).
  static void BuildBias(const MaskParams& mk, int64_t offset, int64_t visible, int64_t jv,
                        float* bias) {
    const int64_t sk = mk.stride_k;
    int64_t j = 0;
    if (mk.kind == MaskParams::Kind::kBool) {
      const uint8_t* mp = static_cast<const uint8_t*>(mk.data) + offset;
      if (sk == 1) {
        for (; j + W <= visible; j += W) Vec::Store(bias + j, Vec::BoolBias(mp + j));
      }
      for (; j < visible; ++j) bias[j] = mp[j * sk] != 0 ? 0.0f : kNegInf;
    } else {
      if (sk == 1) {
        const V l2e = Vec::Set1(kLog2e);
        const void* base = ElemPtr(mk.data, mk.dtype, offset);
        for (; j + W <= visible; j += W) Vec::Store(bias + j, Vec::Mul(Vec::LoadConvert(base, mk.dtype, j), l2e));
      }
      for (; j < visible; ++j) bias[j] = LoadElem(mk.dtype, mk.data, offset + j * sk) * kLog2e;
    }
    FillRow(bias + visible, jv - visible, 0.0f);
  }

  struct Buffers {
    QElem* q;
    KElem* k;
    VElem* v;
    float* s;
    PElem* p;
    float* o;
    float* m;
    float* l;
    float* alpha;
    float* bias;
    float* conv;
    float* tmp;
  };

  static bool GetBuffers(const RequestPlan& plan, int64_t r_pad, Buffers* bufs) {
    const AttentionParams& p = *plan.p;
    Scratch& sc = ThreadScratch();
    const int64_t dmax = std::max(p.head_dim, plan.dv_pad);
    bufs->q = sc.q.Get<QElem>(static_cast<size_t>(r_pad * Products::QStride(p.head_dim)));
    bufs->k = sc.k.Get<KElem>(Products::KElems(p.head_dim, kBlockKeys));
    bufs->v = sc.v.Get<VElem>(Products::VElems(kBlockKeys, plan.dv_pad));
    bufs->s = sc.s.Get<float>(static_cast<size_t>(kBlockRows * kBlockKeys));
    bufs->p = Products::kPInScores ? reinterpret_cast<PElem*>(bufs->s)
                                   : sc.p.Get<PElem>(static_cast<size_t>(kBlockRows * kBlockKeys));
    bufs->o = sc.o.Get<float>(static_cast<size_t>(r_pad * plan.dv_pad));
    float* stats = sc.stats.Get<float>(static_cast<size_t>(3 * r_pad));
    bufs->bias = sc.bias.Get<float>(static_cast<size_t>(kBlockKeys));
    bufs->conv = sc.conv.Get<float>(Products::ConvElems(dmax));
    bufs->tmp = sc.tmp.Get<float>(static_cast<size_t>(kBlockRows * plan.dv_pad));
    if (!bufs->q || !bufs->k || !bufs->v || !bufs->s || !bufs->p || !bufs->o || !stats ||
        !bufs->bias || !bufs->conv || !bufs->tmp)
      return false;
    bufs->m = stats;
    bufs->l = stats + r_pad;
    bufs->alpha = stats + 2 * r_pad;
    return true;
  }

  static const void* QRow(const AttentionParams& p, int64_t b, int64_t h, int64_t i) {
    return ElemPtr(p.q, p.dtype, b * p.q_stride_b + h * p.q_stride_h + i * p.q_stride_row);
  }
  static void* ORow(const AttentionParams& p, int64_t b, int64_t h, int64_t i) {
    return ElemPtr(p.out, p.out_dtype, b * p.o_stride_b + h * p.o_stride_h + i * p.o_stride_row);
  }
  static int64_t MaskOffset(const AttentionParams& p, int64_t b, int64_t h, int64_t i) {
    return b * p.mask.stride_b + h * p.mask.stride_h + i * p.mask.stride_q;
  }

  // Packs K and V for keys [kb, kb + n) of kv head `hkv`.
  static const void* KBlock(const AttentionParams& p, int64_t b, int64_t hkv, int64_t kb) {
    return ElemPtr(p.k, p.dtype, b * p.k_stride_b + hkv * p.k_stride_h + kb * p.k_stride_row);
  }

  // Packs K (unless `direct_k`: QKDirect reads it in place) and V for keys
  // [kb, kb + n) of kv head `hkv`.
  static const void* VBlock(const AttentionParams& p, int64_t b, int64_t hkv, int64_t kb) {
    return ElemPtr(p.v, p.dtype, b * p.v_stride_b + hkv * p.v_stride_h + kb * p.v_stride_row);
  }

  static void PackKV(const AttentionParams& p, const RequestPlan& plan, int64_t b, int64_t hkv,
                     int64_t kb, int64_t n, int64_t npad, const Buffers& bf, bool with_v,
                     const VElem** v, int64_t* ldv, bool direct_k = false) {
    if (!direct_k) Products::PackK(bf.k, KBlock(p, b, hkv, kb), p.dtype, p.k_stride_row, n, npad, p.head_dim, bf.conv);
    if (!with_v) return;
    const void* vbase = VBlock(p, b, hkv, kb);
    *v = Products::PackV(bf.v, vbase, p.dtype, p.v_stride_row, n, npad, p.head_dim_v, plan.dv_pad,
                         bf.conv, ldv);
  }

 public:
  // kFlash / kSplit items: up to kItemRows rows, computed as sub-blocks of
  // kBlockRows that share each packed K/V block. A row's arithmetic does not
  // depend on which rows share its item or sub-block.
  static bool RunFlash(const WorkItem& item) {
    const RequestPlan& plan = *item.plan;
    const AttentionParams& p = *plan.p;
    const int64_t g = plan.group, b = item.b, hkv = item.head;
    const int64_t rows = item.row1 - item.row0;
    const int64_t r_pad = RoundUp(rows, Products::kRowAlign);
    const int64_t dvp = plan.dv_pad;
    Buffers bf;
    if (!GetBuffers(plan, r_pad, &bf)) return false;

    Row row[kItemRows];
    const void* qrows[kItemRows];
    constexpr int64_t kMaxSub = kItemRows / kBlockRows;
    int64_t sub_end[kMaxSub];  // keys a sub-block may see: max of its rows' limits
    const int64_t subs = (rows + kBlockRows - 1) / kBlockRows;
    int64_t kend = item.key0;
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t v = item.row0 + r;
      Row& rw = row[r];
      rw.i = v / g;
      rw.h = hkv * g + v % g;
      rw.limit = std::min(VisibleKeys(plan, b, rw.i), item.key1);
      rw.mask_offset = MaskOffset(p, b, rw.h, rw.i);
      rw.out = ORow(p, b, rw.h, rw.i);
      qrows[r] = QRow(p, b, rw.h, rw.i);
      if (r % kBlockRows == 0) sub_end[r / kBlockRows] = item.key0;
      sub_end[r / kBlockRows] = std::max(sub_end[r / kBlockRows], rw.limit);
      kend = std::max(kend, rw.limit);
    }
    FillRow(bf.m, r_pad, kNegInf);
    FillRow(bf.l, r_pad, 0.0f);
    FillRow(bf.alpha, r_pad, 1.0f);
    FillRow(bf.o, r_pad * dvp, 0.0f);

    // Decided per request (not per item), so every row of it is computed
    // the same way however rows are grouped.
    const bool direct_k = Products::UseDirectK(plan.group * p.q_len, p.head_dim, p.dtype);
    const bool direct_v = Products::UseDirectV(plan.group * p.q_len, p.head_dim_v, dvp);
    Products::Begin();
    const int64_t ldq = Products::QStride(p.head_dim);
    Products::PackQ(bf.q, qrows, rows, r_pad, p.dtype, p.head_dim);
    for (int64_t kb = item.key0; kb < kend; kb += kBlockKeys) {
      const int64_t n = std::min(kBlockKeys, kend - kb);
      const int64_t npad = RoundUp(n, Products::kKeyAlign);
      const VElem* v = nullptr;
      int64_t ldv = 0;
      PackKV(p, plan, b, hkv, kb, n, npad, bf, !direct_v, &v, &ldv, direct_k);
      for (int64_t sb = 0; sb < subs; ++sb) {
        if (sub_end[sb] <= kb) continue;  // every row of it is past its limit
        const int64_t r0 = sb * kBlockRows;
        const int64_t sr = std::min(kBlockRows, rows - r0);
        const int64_t sr_pad = std::min(kBlockRows, r_pad - r0);
        if (direct_k) {
          Products::QKDirect(bf.s, npad, bf.q + r0 * ldq, ldq, KBlock(p, b, hkv, kb), p.dtype,
                             p.k_stride_row, sr_pad, n, p.head_dim);
        } else {
          Products::QK(bf.s, npad, bf.q + r0 * ldq, ldq, bf.k, npad, sr_pad, npad, p.head_dim);
        }
        for (int64_t r = 0; r < sr; ++r)
          SoftmaxBlock<Mode::kOnline>(plan, row[r0 + r], kb, n, npad, bf.s + r * npad, bf.p + r * npad,
                                      bf.bias, bf.m + r0 + r, bf.l + r0 + r, bf.alpha + r0 + r);
        if (sr_pad > sr)
          std::memset(bf.p + sr * npad, 0, static_cast<size_t>((sr_pad - sr) * npad) * sizeof(PElem));
        if (direct_v) {
          Products::PVDirect(bf.o + r0 * dvp, dvp, bf.alpha + r0, bf.p, npad, VBlock(p, b, hkv, kb), p.dtype,
                             p.v_stride_row, sr_pad, n, dvp);
        } else {
          Products::PV(bf.o + r0 * dvp, dvp, bf.alpha + r0, bf.p, npad, v, ldv, sr_pad, n, dvp, bf.tmp);
        }
      }
    }
    Products::End();

    if (item.kind == ItemKind::kSplit) {
      const int64_t stride = PartialStride(plan);
      for (int64_t r = 0; r < rows; ++r) {
        float* dst = item.partial + r * stride;
        dst[0] = bf.m[r];
        dst[1] = bf.l[r];
        std::memcpy(dst + 2, bf.o + r * dvp, static_cast<size_t>(dvp) * 4);
      }
    } else {
      for (int64_t r = 0; r < rows; ++r) {
        const float inv = bf.l[r] > 0.0f ? 1.0f / bf.l[r] : 0.0f;
        StoreRowScaled(row[r].out, p.out_dtype, bf.o + r * dvp, p.head_dim_v, inv);
      }
    }
    return true;
  }

  // kWeights items: query heads [head, head_end) x positions [row0, row1),
  // two passes over the keys per head.
  static bool RunWeights(const WorkItem& item) {
    const RequestPlan& plan = *item.plan;
    const AttentionParams& p = *plan.p;
    const int64_t b = item.b, lk = p.kv_len, lq = p.q_len;
    const int64_t rows = item.row1 - item.row0;
    const int64_t r_pad = RoundUp(rows, Products::kRowAlign);
    const int64_t dvp = plan.dv_pad;
    Buffers bf;
    if (!GetBuffers(plan, r_pad, &bf)) return false;
    float* avg = nullptr;
    if (p.average_weights) {
      avg = ThreadScratch().avg.Get<float>(static_cast<size_t>(rows * lk));
      if (avg == nullptr) return false;
      FillRow(avg, rows * lk, 0.0f);
    }
    const int64_t ldq = Products::QStride(p.head_dim);
    Row row[kBlockRows];
    const void* qrows[kBlockRows];

    Products::Begin();
    for (int64_t h = item.head; h < item.head_end; ++h) {
      const int64_t hkv = h / plan.group;
      int64_t kend = 0;
      for (int64_t r = 0; r < rows; ++r) {
        Row& rw = row[r];
        rw.i = item.row0 + r;
        rw.h = h;
        rw.limit = VisibleKeys(plan, b, rw.i);
        rw.mask_offset = MaskOffset(p, b, h, rw.i);
        rw.out = ORow(p, b, h, rw.i);
        qrows[r] = QRow(p, b, h, rw.i);
        kend = std::max(kend, rw.limit);
      }
      Products::PackQ(bf.q, qrows, rows, r_pad, p.dtype, p.head_dim);
      FillRow(bf.m, r_pad, kNegInf);
      FillRow(bf.l, r_pad, 0.0f);
      FillRow(bf.alpha, r_pad, 1.0f);
      FillRow(bf.o, r_pad * dvp, 0.0f);

      for (int64_t kb = 0; kb < kend; kb += kBlockKeys) {  // pass 1: row max and sum
        const int64_t n = std::min(kBlockKeys, kend - kb);
        const int64_t npad = RoundUp(n, Products::kKeyAlign);
        PackKV(p, plan, b, hkv, kb, n, npad, bf, false, nullptr, nullptr);
        Products::QK(bf.s, npad, bf.q, ldq, bf.k, npad, r_pad, npad, p.head_dim);
        for (int64_t r = 0; r < rows; ++r)
          SoftmaxBlock<Mode::kStats>(plan, row[r], kb, n, npad, bf.s + r * npad, nullptr, bf.bias,
                                     bf.m + r, bf.l + r, bf.alpha + r);
      }
      for (int64_t kb = 0; kb < kend; kb += kBlockKeys) {  // pass 2: P, weights, P V
        const int64_t n = std::min(kBlockKeys, kend - kb);
        const int64_t npad = RoundUp(n, Products::kKeyAlign);
        const VElem* v = nullptr;
        int64_t ldv = 0;
        PackKV(p, plan, b, hkv, kb, n, npad, bf, true, &v, &ldv);
        Products::QK(bf.s, npad, bf.q, ldq, bf.k, npad, r_pad, npad, p.head_dim);
        for (int64_t r = 0; r < rows; ++r) {
          float* srow = bf.s + r * npad;
          SoftmaxBlock<Mode::kFinal>(plan, row[r], kb, n, npad, srow, bf.p + r * npad, bf.bias,
                                     bf.m + r, bf.l + r, bf.alpha + r);
          if (avg != nullptr) {
            float* arow = avg + r * lk + kb;
            for (int64_t j = 0; j < n; ++j) arow[j] += srow[j];
          } else {
            void* wrow = ElemPtr(p.weights, p.weights_dtype, ((b * p.num_heads + h) * lq + row[r].i) * lk + kb);
            StoreRowScaled(wrow, p.weights_dtype, srow, n, 1.0f);
          }
        }
        if (r_pad > rows)
          std::memset(bf.p + rows * npad, 0, static_cast<size_t>((r_pad - rows) * npad) * sizeof(PElem));
        Products::PV(bf.o, dvp, bf.alpha, bf.p, npad, v, ldv, r_pad, n, dvp, bf.tmp);
      }
      for (int64_t r = 0; r < rows; ++r) {
        StoreRowScaled(row[r].out, p.out_dtype, bf.o + r * dvp, p.head_dim_v, 1.0f);
        if (avg == nullptr && kend < lk) {
          void* wrow = ElemPtr(p.weights, p.weights_dtype, ((b * p.num_heads + h) * lq + row[r].i) * lk + kend);
          std::memset(wrow, 0, static_cast<size_t>((lk - kend) * ElemSize(p.weights_dtype)));
        }
      }
    }
    Products::End();

    if (avg != nullptr) {
      const float inv_h = 1.0f / static_cast<float>(p.num_heads);
      for (int64_t r = 0; r < rows; ++r) {
        void* wrow = ElemPtr(p.weights, p.weights_dtype, (b * lq + item.row0 + r) * lk);
        StoreRowScaled(wrow, p.weights_dtype, avg + r * lk, lk, inv_h);
      }
    }
    return true;
  }

  static bool Run(const WorkItem& item) {
    return item.kind == ItemKind::kWeights ? RunWeights(item) : RunFlash(item);
  }
};
