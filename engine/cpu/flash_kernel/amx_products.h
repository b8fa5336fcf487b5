// AMX products (`Products`): tdpbf16ps tile products, bf16 in, fp32
// accumulation, over the operands bf16_packing.h lays out.

#if !defined(ATTNSERVE_FLASH_KERNEL_FILE)
#error "engine/cpu/flash_kernel/ is included only by engine/cpu/flash_kernel_<isa>.cc"
#endif

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
