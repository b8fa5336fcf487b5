// AVX512_BF16 products (`Products`): vdpbf16ps microkernels, bf16 pairs in,
// fp32 accumulation, over the operands bf16_packing.h lays out.

#if !defined(ATTNSERVE_FLASH_KERNEL_FILE)
#error "engine/cpu/flash_kernel/ is included only by engine/cpu/flash_kernel_<isa>.cc"
#endif

struct Products : Bf16Packing {
  static constexpr int kRowAlign = 1;
  static constexpr bool kPvFromZero = true;
  // Keys of a block are padded to one vector of keys (not to the 64 of
  // Bf16Packing, which AMX's tiles need): Q K^T takes 16, 32 or 48 keys in
  // narrower tiles, so a 16-key block is not computed as 64.
  static constexpr int64_t kKeyAlign = 16;
  static_assert(flash::kKeyAlign % kKeyAlign == 0);
  static void Begin() {}
  static void End() {}

  template <int M, int N>
  static void QkTile(const uint16_t* q, int64_t ldq, const uint32_t* k2, int64_t ldk,
                     int64_t pairs, float* s, int64_t lds) {
    __m512 acc[M][N];
#pragma GCC unroll 16
    for (int m = 0; m < M; ++m)
#pragma GCC unroll 4
      for (int n = 0; n < N; ++n) acc[m][n] = _mm512_setzero_ps();
    for (int64_t p = 0; p < pairs; ++p) {
      __m512bh kv[N];
#pragma GCC unroll 4
      for (int n = 0; n < N; ++n) kv[n] = (__m512bh)_mm512_loadu_si512(k2 + p * ldk + n * 16);
#pragma GCC unroll 16
      for (int m = 0; m < M; ++m) {
        const __m512bh qb = (__m512bh)_mm512_set1_epi32(static_cast<int>(LoadU32(q + m * ldq + 2 * p)));
#pragma GCC unroll 4
        for (int n = 0; n < N; ++n) acc[m][n] = _mm512_dpbf16_ps(acc[m][n], qb, kv[n]);
      }
    }
#pragma GCC unroll 16
    for (int m = 0; m < M; ++m)
#pragma GCC unroll 4
      for (int n = 0; n < N; ++n) _mm512_storeu_ps(s + m * lds + n * 16, acc[m][n]);
  }

  // Scores of rows [0, rows) for the N * 16 keys from column j0, in tiles
  // of Vec::QkRows(N) rows.
  template <int N>
  static void QkRows(float* s, int64_t lds, const uint16_t* q, int64_t ldq, const uint32_t* k2,
                     int64_t ldk, int64_t rows, int64_t j0, int64_t pairs) {
    ForRowTiles<Vec::QkRows(N)>(rows, [&]<int M>(int64_t r0) {
      QkTile<M, N>(q + r0 * ldq, ldq, k2 + j0, ldk, pairs, s + r0 * lds + j0, lds);
    });
  }

  // s[r][j] for r < rows, j < ncols (a multiple of kKeyAlign): 64 keys at a
  // time, then the 16, 32 or 48 left. Every score is the same pair-ordered
  // chain of vdpbf16ps whatever the tile.
  static void QK(float* s, int64_t lds, const uint16_t* q, int64_t ldq, const uint32_t* k2,
                 int64_t ldk, int64_t rows, int64_t ncols, int64_t d) {
    const int64_t pairs = (d + 1) / 2;
    int64_t j0 = 0;
    for (; j0 + 64 <= ncols; j0 += 64) QkRows<4>(s, lds, q, ldq, k2, ldk, rows, j0, pairs);
    switch ((ncols - j0) / 16) {
      case 0: break;
      case 1: QkRows<1>(s, lds, q, ldq, k2, ldk, rows, j0, pairs); break;
      case 2: QkRows<2>(s, lds, q, ldq, k2, ldk, rows, j0, pairs); break;
      case 3: QkRows<3>(s, lds, q, ldq, k2, ldk, rows, j0, pairs); break;
    }
  }

  template <int M, int N>
  static void PvTile(float* o, int64_t ldo, const float* alpha, const uint16_t* p, int64_t ldp,
                     const uint32_t* v2, int64_t ldv, int64_t pairs) {
    __m512 acc[M][N];
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) {
      const __m512 a = alpha != nullptr ? _mm512_set1_ps(alpha[m]) : _mm512_setzero_ps();
#pragma GCC unroll 4
      for (int c = 0; c < N; ++c)
        acc[m][c] = alpha != nullptr ? _mm512_mul_ps(_mm512_loadu_ps(o + m * ldo + c * 16), a)
                                     : _mm512_setzero_ps();
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
    ForRowTiles<6>(rows, [&]<int M>(int64_t r0) {
      PvTile<M, N>(o + r0 * ldo, ldo, alpha != nullptr ? alpha + r0 : nullptr, p + r0 * ldp, ldp, v2,
                   ldv, pairs);
    });
  }

  // o = alpha * o + P V (alpha null: o starts from zero).
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
