// fp32 products (`Products`, with vec_scalar.h, vec_avx2.h or vec_avx512.h):
// Q K^T and P V as FMA microkernels over the Vec in scope.
//
// Q: [rows][d] fp32. K block transposed: kt[d][npad] (keys along vectors, so
// one broadcast of Q[r][k] meets a vector of keys). V rows: [n][ld] fp32,
// read in place when already fp32 with a vector-multiple width. P lives in
// the score buffer (in place).

#if !defined(ATTNSERVE_FLASH_KERNEL_FILE)
#error "engine/cpu/flash_kernel/ is included only by engine/cpu/flash_kernel_<isa>.cc"
#endif

struct Products {
  using QElem = float;
  using KElem = float;
  using VElem = float;
  using PElem = float;
  static constexpr int kRowAlign = 1;
  // PV takes a null alpha as "O starts from zero" (the driver then skips
  // zeroing O and the products skip reading it).
  static constexpr bool kPvFromZero = true;
  // Keys of a block are padded to a multiple of this: one AVX-512 vector,
  // so a short key sequence (8 or 16 keys) does not pay for a 64-key tile.
  static constexpr int64_t kKeyAlign = 16;
  static constexpr int kExpDegree = 5;
  static constexpr bool kPInScores = true;
  using V = Vec::V;
  static constexpr int W = Vec::W;
  static_assert(kKeyAlign % W == 0 && flash::kKeyAlign % kKeyAlign == 0);
  static_assert(flash::kDirectMaxRows == 7, "QKDirectRows and PvDirectRows dispatch up to 7 rows");

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

  // Q read in place: fp32 rows, none padded, contiguous (one head's
  // consecutive positions in head layout), so QStride(d) apart. nullptr
  // otherwise: the caller packs them. Rows further apart are packed even
  // when evenly spaced: at the engine's fused-projection stride (3E floats,
  // a multiple of 4 KiB at E = 1024) a sub-block's rows share a few L1 sets,
  // and the Q K^T tiles ran 15% slower reading them in place.
  static const float* InPlaceQ(const void* const* rows, int64_t r_count, int64_t r_pad, DType dt,
                               int64_t d) {
    if (dt != DType::kFloat32 || r_count != r_pad || r_count < 1) return nullptr;
    const float* q0 = static_cast<const float*>(rows[0]);
    for (int64_t r = 1; r < r_count; ++r) {
      if (static_cast<const float*>(rows[r]) != q0 + r * d) return nullptr;
    }
    return q0;
  }

  // kt[k][j] = K[j][k] for j < n (columns `ldk` apart; PadK zeroes the
  // rest). `kbase` points at key 0, rows `ld` elements apart; conv: 16 * d
  // floats. A paged tile is packed run by run (engine/cpu/flash_kernel/
  // driver.h), each at its column offset: the values are the same as for
  // one contiguous run.
  static void PackK(float* kt, int64_t ldk, const void* kbase, DType dt, int64_t ld, int64_t n,
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
        for (; k0 + T <= d; k0 += T) Vec::Transpose(rows + k0, lds, kt + k0 * ldk + j0, ldk);
        for (int64_t k = k0; k < d; ++k)
          for (int jj = 0; jj < T; ++jj) kt[k * ldk + j0 + jj] = rows[jj * lds + k];
      }
    }
    for (int64_t j = j0; j < n; ++j) {
      ConvertRow(ElemPtr(kbase, dt, j * ld), dt, d, conv);
      for (int64_t k = 0; k < d; ++k) kt[k * ldk + j] = conv[k];
    }
  }

  // kt[k][j] = 0 for n <= j < npad.
  static void PadK(float* kt, int64_t ldk, int64_t n, int64_t npad, int64_t d) {
    for (int64_t k = 0; k < d; ++k) FillRow(kt + k * ldk + n, npad - n, 0.0f);
  }

  // Few rows (decode, up to flash::kDirectMaxRows): Q K^T as dot products
  // straight from the K rows (krows[j]: key j's row, wherever it lives:
  // contiguous or a paged cache's blocks), W keys at a time reduced across
  // lanes, instead of transposing K for a broadcast GEMM that would use a
  // few rows of it. Needs d % W == 0 (conv is not used). `pf` says what to
  // prefetch per key.
  static bool UseDirectK(int64_t rows, int64_t d, DType) {
    return rows <= flash::kDirectMaxRows && d % W == 0;
  }
  static void QKDirect(float* s, int64_t lds, const float* q, int64_t ldq, const void* const* krows,
                       DType dt, int64_t rows, int64_t n, int64_t d, const RowPrefetch& pf) {
    switch (dt) {
      case DType::kFloat16: return QKDirectRows<DType::kFloat16>(s, lds, q, ldq, krows, rows, n, d, pf);
      case DType::kBFloat16: return QKDirectRows<DType::kBFloat16>(s, lds, q, ldq, krows, rows, n, d, pf);
      default: return QKDirectRows<DType::kFloat32>(s, lds, q, ldq, krows, rows, n, d, pf);
    }
  }
  template <DType kDt>
  static void QKDirectRows(float* s, int64_t lds, const float* q, int64_t ldq, const void* const* krows,
                           int64_t rows, int64_t n, int64_t d, const RowPrefetch& pf) {
    switch (rows) {
      case 1: return QKDirectTile<1, kDt>(s, lds, q, ldq, krows, n, d, pf);
      case 2: return QKDirectTile<2, kDt>(s, lds, q, ldq, krows, n, d, pf);
      case 3: return QKDirectTile<3, kDt>(s, lds, q, ldq, krows, n, d, pf);
      case 4: return QKDirectTile<4, kDt>(s, lds, q, ldq, krows, n, d, pf);
      case 5: return QKDirectTile<5, kDt>(s, lds, q, ldq, krows, n, d, pf);
      case 6: return QKDirectTile<6, kDt>(s, lds, q, ldq, krows, n, d, pf);
      default: return QKDirectTile<7, kDt>(s, lds, q, ldq, krows, n, d, pf);
    }
  }

  // Keys whose dot products with R rows run side by side: R x K
  // accumulators in about half the vector registers (a power of two <= W).
  static constexpr int DirectKeys(int rows) {
    int k = 1;
    while (2 * k <= W && 2 * k * rows <= (W >= 16 ? 16 : 8)) k *= 2;
    return k;
  }

  // acc[r][k] += q[r] . K row kr[k] over d, one vector of columns at a
  // time: each K vector is widened once for all R rows. Every acc[r][k] is
  // the same c-ordered FMA chain in either loop order:
  // - key by key, each K row read front to back, the Q vectors from L1 again
  //   for every key: for one or two rows (MHA decode), whose arithmetic is
  //   short next to the read, this is the order the hardware prefetcher
  //   follows; reading the K rows side by side left a third to half of
  //   the memory bandwidth unused (docs/PERFORMANCE.md, "Paged decode");
  // - vector by vector, each Q vector loaded once for all K keys: for more
  //   rows (GQA), where the arithmetic is as long as the read and the loads
  //   of Q would be the bottleneck.
  template <int R, int K, DType kDt>
  __attribute__((always_inline)) static void DotKeys(const float* q, int64_t ldq, const void* const* kr,
                                                     int64_t d, V (*acc)[K]) {
    if constexpr (R <= 2) {
#pragma GCC unroll 16
      for (int k = 0; k < K; ++k) {
        const void* row = kr[k];
        for (int64_t c = 0; c < d; c += W) {
          const V kv = Vec::LoadConvert(row, kDt, c);
#pragma GCC unroll 8
          for (int r = 0; r < R; ++r) acc[r][k] = Vec::Fma(Vec::Load(q + r * ldq + c), kv, acc[r][k]);
        }
      }
    } else {
      for (int64_t c = 0; c < d; c += W) {
        V qv[R];
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) qv[r] = Vec::Load(q + r * ldq + c);
#pragma GCC unroll 16
        for (int k = 0; k < K; ++k) {
          const V kv = Vec::LoadConvert(kr[k], kDt, c);
#pragma GCC unroll 8
          for (int r = 0; r < R; ++r) acc[r][k] = Vec::Fma(qv[r], kv, acc[r][k]);
        }
      }
    }
  }

  // s[r][j] for R rows and keys [0, n): per (row, key) one c-ordered FMA
  // chain, then the lane reduction of W keys (lanes of missing keys are 0).
  template <int R, DType kDt>
  static void QKDirectTile(float* s, int64_t lds, const float* q, int64_t ldq, const void* const* krows,
                           int64_t n, int64_t d, const RowPrefetch& pf) {
    constexpr int K = DirectKeys(R);
    V part[R][W];  // the W keys' accumulators of each row
    for (int64_t j0 = 0; j0 < n; j0 += W) {
      for (int k0 = 0; k0 < W; k0 += K) {
        const int64_t key0 = j0 + k0;
        V acc[R][K];
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
          for (int k = 0; k < K; ++k) acc[r][k] = Vec::Zero();
        if (key0 + K <= n) {
#pragma GCC unroll 16
          for (int k = 0; k < K; ++k) pf.At(key0 + k);
          DotKeys<R, K, kDt>(q, ldq, krows + key0, d, acc);
        } else {
          for (int k = 0; k < K && key0 + k < n; ++k) {  // the last keys, one at a time
            pf.At(key0 + k);
            V a[R][1];
            for (int r = 0; r < R; ++r) a[r][0] = Vec::Zero();
            DotKeys<R, 1, kDt>(q, ldq, krows + key0 + k, d, a);
            for (int r = 0; r < R; ++r) acc[r][k] = a[r][0];
          }
        }
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
          for (int k = 0; k < K; ++k) part[r][k0 + k] = acc[r][k];
      }
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) Vec::Store(s + r * lds + j0, Vec::ReduceLanes(part[r]));
    }
  }

  // Returns V rows (and their stride): in place when possible and
  // `may_alias`, else converted into vb [n][dv_pad] with zero columns past
  // dv. A paged tile is packed run by run (may_alias false), run j0 at
  // vb + VOffset(j0, dv_pad).
  //
  // In place when the rows are contiguous (head layout) or the block is
  // short (<= kInPlaceVKeys keys: it stays in L1 at any stride). Otherwise
  // P V, which reads the block's rows again for every tile of rows, would
  // meet rows far apart (3E floats in the engine's fused projection: 12 KiB
  // at E = 1024, each row on its own page and in the same few L1 sets)
  // coming from L2 each time. Copying them, one pass per block, made the
  // fused-layout core 1.13-1.15x faster at L >= 512 and 1.05x at L = 64;
  // at L = 16 it cost 2-8%, hence the short-block exception
  // (docs/PERFORMANCE.md, "The attention core against OpenVINO and
  // PyTorch 2.15").
  static constexpr int64_t kInPlaceVKeys = 32;
  static const float* PackV(float* vb, const void* vbase, DType dt, int64_t ld, int64_t n,
                            int64_t dv, int64_t dv_pad, float* /*conv*/, int64_t* ldv,
                            bool may_alias) {
    if (may_alias && dt == DType::kFloat32 && dv == dv_pad && (ld == dv_pad || n <= kInPlaceVKeys)) {
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
  static int64_t VOffset(int64_t j, int64_t dv_pad) { return j * dv_pad; }
  // P V reads rows j < n only: nothing to pad.
  static void PadV(float*, int64_t, int64_t) {}

  template <int M, int N>
  static void QkTile(const float* q, int64_t ldq, const float* kt, int64_t ldk, int64_t d,
                     float* s, int64_t lds) {
    V acc[M][N];
#pragma GCC unroll 16
    for (int m = 0; m < M; ++m)
#pragma GCC unroll 4
      for (int n = 0; n < N; ++n) acc[m][n] = Vec::Zero();
    for (int64_t k = 0; k < d; ++k) {
      V kv[N];
#pragma GCC unroll 4
      for (int n = 0; n < N; ++n) kv[n] = Vec::Load(kt + k * ldk + n * W);
#pragma GCC unroll 16
      for (int m = 0; m < M; ++m) {
        const V qb = Vec::Set1(q[m * ldq + k]);
#pragma GCC unroll 4
        for (int n = 0; n < N; ++n) acc[m][n] = Vec::Fma(qb, kv[n], acc[m][n]);
      }
    }
#pragma GCC unroll 16
    for (int m = 0; m < M; ++m)
#pragma GCC unroll 4
      for (int n = 0; n < N; ++n) Vec::Store(s + m * lds + n * W, acc[m][n]);
  }

  // Scores of rows [0, rows) for the N * W keys from column j0, in tiles of
  // Vec::QkRows(N) rows: taller for narrow tiles, so that enough independent
  // FMA chains hide the FMA latency.
  template <int N>
  static void QkRows(float* s, int64_t lds, const float* q, int64_t ldq, const float* kt,
                     int64_t ldk, int64_t rows, int64_t j0, int64_t d) {
    ForRowTiles<Vec::QkRows(N)>(rows, [&]<int M>(int64_t r0) {
      QkTile<M, N>(q + r0 * ldq, ldq, kt + j0, ldk, d, s + r0 * lds + j0, lds);
    });
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
  template <int M, int N, typename VRows>
  static void PvTile(float* o, int64_t ldo, const float* alpha, const float* p, int64_t ldp,
                     const VRows& vr, int64_t n) {
    V acc[M][N];
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) {
      const V a = alpha != nullptr ? Vec::Set1(alpha[m]) : Vec::Zero();
#pragma GCC unroll 4
      for (int c = 0; c < N; ++c)
        acc[m][c] = alpha != nullptr ? Vec::Mul(Vec::Load(o + m * ldo + c * W), a) : Vec::Zero();
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
    ForRowTiles<Vec::kPvRows>(rows, [&]<int M>(int64_t r0) {
      PvTile<M, N>(o + r0 * ldo, ldo, alpha != nullptr ? alpha + r0 : nullptr, p + r0 * ldp, ldp, vr, n);
    });
  }

  // o[r] = alpha[r] * o[r] + sum_{j < n} p[r][j] v[j] for r < rows, over
  // dv_pad columns (a multiple of 16); alpha null: o starts from zero (its
  // old contents are neither read nor needed).
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

  // Decode: o[r] = alpha[r] * o[r] + sum_{j < n} p[r][j] V[j] for r < rows
  // (<= flash::kDirectMaxRows), V rows read in place through vrows[j]
  // (contiguous or in a paged cache's blocks; null for the kPrefetchRows
  // entries past the item's keys), whatever their dtype (dv must equal dv_pad). Each output element
  // is the j-ordered FMA chain of PV; the column passes are as wide as the
  // registers allow, and the first prefetches whole rows ahead.
  static bool UseDirectV(int64_t rows, int64_t dv, int64_t dv_pad) {
    return rows <= flash::kDirectMaxRows && dv == dv_pad;
  }
  static void PVDirect(float* o, int64_t ldo, const float* alpha, const float* p, int64_t ldp,
                       const void* const* vrows, DType dt, int64_t rows, int64_t n, int64_t dv_pad) {
    switch (dt) {
      case DType::kFloat16: return PvDirectRows<DType::kFloat16>(o, ldo, alpha, p, ldp, vrows, rows, n, dv_pad);
      case DType::kBFloat16: return PvDirectRows<DType::kBFloat16>(o, ldo, alpha, p, ldp, vrows, rows, n, dv_pad);
      default: return PvDirectRows<DType::kFloat32>(o, ldo, alpha, p, ldp, vrows, rows, n, dv_pad);
    }
  }
  template <DType kDt>
  static void PvDirectRows(float* o, int64_t ldo, const float* alpha, const float* p, int64_t ldp,
                           const void* const* vrows, int64_t rows, int64_t n, int64_t dv_pad) {
    switch (rows) {
      case 1: return PvDirectColumns<1, kDt>(o, ldo, alpha, p, ldp, vrows, n, dv_pad);
      case 2: return PvDirectColumns<2, kDt>(o, ldo, alpha, p, ldp, vrows, n, dv_pad);
      case 3: return PvDirectColumns<3, kDt>(o, ldo, alpha, p, ldp, vrows, n, dv_pad);
      case 4: return PvDirectColumns<4, kDt>(o, ldo, alpha, p, ldp, vrows, n, dv_pad);
      case 5: return PvDirectColumns<5, kDt>(o, ldo, alpha, p, ldp, vrows, n, dv_pad);
      case 6: return PvDirectColumns<6, kDt>(o, ldo, alpha, p, ldp, vrows, n, dv_pad);
      default: return PvDirectColumns<7, kDt>(o, ldo, alpha, p, ldp, vrows, n, dv_pad);
    }
  }
  // Vectors of columns per pass for M rows: M x N accumulators, M
  // broadcasts of P and one V vector in the registers. One row (MHA
  // decode) takes a whole V row of up to 16 vectors per pass, so each V row
  // is read once, front to back, as the hardware prefetcher follows best
  // (with 16 ymm that spills a register or two, and is still faster than two
  // passes over rows read half at a time).
  static constexpr int DirectColumns(int rows) {
    if (rows == 1) return 16;
    const int regs = W >= 16 ? 30 : 14;
    int n = 1;
    while (2 * n <= 8 && rows * 2 * n + rows + 1 <= regs) n *= 2;
    return n;
  }
  template <int M, DType kDt>
  static void PvDirectColumns(float* o, int64_t ldo, const float* alpha, const float* p, int64_t ldp,
                              const void* const* vrows, int64_t n, int64_t dv_pad) {
    PvDirectPasses<M, DirectColumns(M), kDt>(o, ldo, alpha, p, ldp, vrows, n, dv_pad / W, 0);
  }
  // Passes of N vectors over columns [c, vecs) while they fill them, then
  // of N / 2, ...
  template <int M, int N, DType kDt>
  static void PvDirectPasses(float* o, int64_t ldo, const float* alpha, const float* p, int64_t ldp,
                             const void* const* vrows, int64_t n, int64_t vecs, int64_t c) {
    const int64_t row_bytes = vecs * W * ElemSize(kDt);
    for (; c + N <= vecs; c += N)
      PvDirectTile<M, N, kDt>(o + c * W, ldo, alpha, p, ldp, vrows, n, c * W, c == 0, row_bytes);
    if constexpr (N > 1) {
      if (c < vecs) PvDirectPasses<M, N / 2, kDt>(o, ldo, alpha, p, ldp, vrows, n, vecs, c);
    }
  }
  template <int M, int N, DType kDt>
  static void PvDirectTile(float* o, int64_t ldo, const float* alpha, const float* p, int64_t ldp,
                           const void* const* vrows, int64_t n, int64_t c0, bool prefetch,
                           int64_t row_bytes) {
    V acc[M][N];
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) {
      const V a = Vec::Set1(alpha[m]);
#pragma GCC unroll 16
      for (int c = 0; c < N; ++c) acc[m][c] = Vec::Mul(Vec::Load(o + m * ldo + c * W), a);
    }
    for (int64_t j = 0; j < n; ++j) {
      if (prefetch && vrows[j + kPrefetchRows] != nullptr) PrefetchRow(vrows[j + kPrefetchRows], row_bytes);
      const void* vr = ElemPtr(vrows[j], kDt, c0);
      V pb[M];
#pragma GCC unroll 8
      for (int m = 0; m < M; ++m) pb[m] = Vec::Set1(p[m * ldp + j]);
#pragma GCC unroll 16
      for (int c = 0; c < N; ++c) {
        const V vv = Vec::LoadConvert(vr, kDt, c * W);
#pragma GCC unroll 8
        for (int m = 0; m < M; ++m) acc[m][c] = Vec::Fma(pb[m], vv, acc[m][c]);
      }
    }
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m)
#pragma GCC unroll 16
      for (int c = 0; c < N; ++c) Vec::Store(o + m * ldo + c * W, acc[m][c]);
  }

  static void StoreP(float* dst, V p) { Vec::Store(dst, p); }
};
