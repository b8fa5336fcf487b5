// bf16 operand packing shared by the AVX512_BF16 and AMX product policies
// (bf16_products.h, amx_products.h); needs vec_avx512.h.
//
// Q: [rows][d_pad] bf16 with d_pad = d rounded up to 32. K block in "VNNI"
// pairs: k2[d_pad/2][npad] u32, each u32 = (K[j][2p], K[j][2p+1]); V block
// likewise over key pairs: v2[npad/2][dv_pad] u32 = (V[2q][c], V[2q+1][c]).
// P: [rows][npad] bf16. Both layouts are what vdpbf16ps (a pair per 32-bit
// lane) and AMX's B operand expect.

#if !defined(ATTNSERVE_FLASH_KERNEL_FILE)
#error "engine/cpu/flash_kernel/ is included only by engine/cpu/flash_kernel_<isa>.cc"
#endif

struct Bf16Packing {
  using QElem = uint16_t;
  using KElem = uint32_t;
  using VElem = uint32_t;
  using PElem = uint16_t;
  // Keys of a block are padded to a multiple of this: AMX's 64-key tiles
  // (amx_products.h); the AVX512_BF16 products pad to 16 (bf16_products.h).
  static constexpr int64_t kKeyAlign = flash::kKeyAlign;
  static constexpr int kExpDegree = 3;
  static constexpr bool kPInScores = false;
  // Whether PV takes a null alpha (O from zero): the AVX512_BF16 products
  // do; AMX's keeps O's multiply-add.
  static constexpr bool kPvFromZero = false;
  using V = Vec::V;

  static int64_t QStride(int64_t d) { return RoundUp(d, 32); }
  // Q is always packed (bf16 pairs, padded rows).
  static const QElem* InPlaceQ(const void* const*, int64_t, int64_t, DType, int64_t) {
    return nullptr;
  }
  static size_t KElems(int64_t d, int64_t npad) { return static_cast<size_t>(RoundUp(d, 32) / 2 * npad); }
  static size_t VElems(int64_t npad, int64_t dv_pad) { return static_cast<size_t>(npad / 2 * dv_pad); }
  // 16 rows of d_pad bf16 (as floats' worth of space) plus a converted row.
  static size_t ConvElems(int64_t d) { return static_cast<size_t>(16 * RoundUp(d, 32) + RoundUp(d, 32) + 16); }

  static __m256i ToBf16(V v) { return (__m256i)_mm512_cvtneps_pbh(v); }

  // K and V are always packed (AMX and vdpbf16ps both want pair layouts).
  static bool UseDirectK(int64_t, int64_t, DType) { return false; }
  static bool UseDirectV(int64_t, int64_t, int64_t) { return false; }
  static void PVDirect(float*, int64_t, const float*, const uint16_t*, int64_t, const void* const*, DType,
                       int64_t, int64_t, int64_t) {}
  static void QKDirect(float*, int64_t, const uint16_t*, int64_t, const void* const*, DType, int64_t,
                       int64_t, int64_t, const RowPrefetch&) {}

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

  // Keys [0, n) into columns [0, RoundUp(n, 16)) of k2 (`ldk` u32 apart),
  // zero past n; PadK zeroes the rest of the tile. A paged tile is packed
  // run by run at column offsets; every run but the last is a multiple of
  // 16 keys (AttentionParams::block_tokens), so runs never overlap.
  static void PackK(uint32_t* k2, int64_t ldk, const void* kbase, DType dt, int64_t ld, int64_t n,
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
          _mm512_storeu_ps(reinterpret_cast<float*>(k2 + (p0 + pp) * ldk + j0), r[pp]);
      }
    }
  }

  // Columns [n, npad) of every pair row = 0.
  static void PadK(uint32_t* k2, int64_t ldk, int64_t n, int64_t npad, int64_t d) {
    if (n >= npad) return;
    for (int64_t p = 0; p < QStride(d) / 2; ++p)
      std::memset(k2 + p * ldk + n, 0, static_cast<size_t>(npad - n) * 4);
  }

  // Pairs of V rows interleaved; key pairs up to RoundUp(n, 32) / 2 are
  // written (zeros past n), which covers every product loop. A paged tile
  // is packed run by run in key order, run j0 (even) at v2 + VOffset(j0):
  // a run's zeros past its end are overwritten by the next run, the last
  // may write up to 31 keys past the tile (GetBuffers allows for them), and
  // PadV then zeroes the pairs the products read past the tile's n keys.
  static const uint32_t* PackV(uint32_t* v2, const void* vbase, DType dt, int64_t ld, int64_t n,
                               int64_t dv, int64_t dv_pad, float* conv_f, int64_t* ldv,
                               bool /*may_alias: always packed*/) {
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

  static int64_t VOffset(int64_t j, int64_t dv_pad) { return j / 2 * dv_pad; }
  // Zero pairs from key n (rounded up to a pair; an odd n's last pair was
  // completed by PackV) up to RoundUp(n, 32) / 2.
  static void PadV(uint32_t* v2, int64_t n, int64_t dv_pad) {
    const int64_t q0 = (n + 1) / 2, q1 = RoundUp(n, 32) / 2;
    if (q1 > q0) std::memset(v2 + q0 * dv_pad, 0, static_cast<size_t>((q1 - q0) * dv_pad) * 4);
  }

  static void StoreP(uint16_t* dst, V p) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), ToBf16(p));
  }
};
