// Relative position embeddings in the scores (AttentionParams::relative_key,
// relative_query: DeBERTa's disentangled attention), written over `Vec`:
// for rows of a sub-block and keys [kb, kb + n) of a block,
//   s[r][j] += Q_r . RK[:, c] + K_j . RQ[:, c],  c = clamp(kb + j - p_r, -D, D) + D,
// RK and RQ the row's head's tables ([head_dim][2D + 1], the distance
// contiguous), in fp32, added to the raw scores before the driver scales
// them. A key block is prepared once for its sub-blocks (its keys by feature,
// and per head the keys' terms at the tables' two ends); each row's query in
// fp32 once per item.
//
// Keys are a vector at a time, so a vector's columns are consecutive. Tiles
// of 4 rows x 4 vectors whose columns all lie inside the tables read them in
// place, 32 FMAs per feature from 4 key loads and 32 table loads (the rows'
// columns overlap, so the loads hit the same few lines); any other vector of
// a row lies wholly below or above the tables (two precomputed terms: the
// query's against the end column, the keys' against it), or straddles an end
// (its lanes gathered).
//
// Written by hand: no library computes a score term that gathers a table
// column per (query, key) distance inside a fused attention kernel.

#if !defined(ATTNSERVE_FLASH_KERNEL_FILE)
#error "engine/cpu/flash_kernel/ is included only by engine/cpu/flash_kernel_<isa>.cc"
#endif

class RelativeEmbeddings {
  using V = Vec::V;
  static constexpr int W = Vec::W;

 public:
  static bool Enabled(const AttentionParams& p) {
    return p.relative_key != nullptr || p.relative_query != nullptr;
  }

  // Floats of scratch a key block needs for a group of `heads` heads:
  // keys by feature, the end terms, and their flags.
  static size_t BlockFloats(int64_t head_dim, int64_t block_keys, int64_t heads) {
    return static_cast<size_t>(head_dim * block_keys + 2 * heads * block_keys + heads);
  }

  // One key block's prepared keys, for the query heads [head0, head0 +
  // heads): kt[f * npad + j], key kb + j's feature f in fp32 (zero from n to
  // npad), and the keys' terms at the tables' ends, computed when a row of
  // that head first needs them.
  struct Block {
    const AttentionParams* p;
    int64_t kb, n, npad;
    float* kt;     // [head_dim][npad]
    float* ends;   // [heads][2][npad]: K_j . RQ[h][:, 0], K_j . RQ[h][:, 2D]
    float* ready;  // [heads]: 1 once ends holds that head's
    int64_t head0, heads;
  };

  // Prepares keys [kb, kb + n) of kv head `hkv` (rows `ld` elements apart
  // in each run that `row_of` gives: row_of(j, &run) is key kb + j's row and
  // how many keys from it lie in its run) into `scratch` (BlockFloats).
  template <typename RowOf>
  static Block Prepare(const AttentionParams& p, int64_t kb, int64_t n, int64_t npad, int64_t ld,
                       RowOf row_of, int64_t head0, int64_t heads, float* scratch) {
    const int64_t dim = p.head_dim;
    Block blk{&p, kb, n, npad, scratch, scratch + dim * npad,
              scratch + dim * npad + 2 * heads * npad, head0, heads};
    for (int64_t j = 0, run = 0; j < n; j += run) {
      const void* base = row_of(j, &run);
      for (int64_t t = 0; t < run; ++t) {
        for (int64_t f = 0; f < dim; ++f) blk.kt[f * npad + j + t] = LoadElem(p.dtype, base, t * ld + f);
      }
    }
    for (int64_t f = 0; f < dim; ++f) FillRow(blk.kt + f * npad + n, npad - n, 0.0f);
    FillRow(blk.ready, heads, 0.0f);
    return blk;
  }

  // q[r * head_dim + f] = row r's query feature f in fp32, for `count` rows
  // (each row's query, in p.dtype, at qrows[r]).
  static void QueriesToFloat(const AttentionParams& p, const void* const* qrows, int64_t count,
                             float* q) {
    for (int64_t r = 0; r < count; ++r) {
      for (int64_t f = 0; f < p.head_dim; ++f) q[r * p.head_dim + f] = LoadElem(p.dtype, qrows[r], f);
    }
  }

  // s[r][j] (rows npad apart) += the terms for rows [0, count): row r is
  // query position `position[r]` of head `head[r]` with its query at q +
  // r * head_dim.
  static void Add(const Block& blk, const int64_t* position, const int64_t* head,
                  const float* q, int64_t count, float* s) {
    const AttentionParams& p = *blk.p;
    const bool key = p.relative_key != nullptr, query = p.relative_query != nullptr;
    if (key && query) AddRows<true, true>(blk, position, head, q, count, s);
    else if (key) AddRows<true, false>(blk, position, head, q, count, s);
    else AddRows<false, true>(blk, position, head, q, count, s);
  }

 private:
  static constexpr int kTileRows = 4, kTileVectors = 4;

  struct RowTables {
    const float* rk[kTileRows];
    const float* rq[kTileRows];
    const float* q[kTileRows];
    int64_t c[kTileRows];  // the row's column of key kb, unclamped
    float* s[kTileRows];
  };

  // acc[r][v] = the terms of rows [0, R) for keys j + v * W .. + W - 1,
  // every column inside the tables; added into s.
  template <int R, int NV, bool kKey, bool kQuery>
  static void Tile(const Block& blk, const RowTables& t, int64_t nc, int64_t j) {
    const int64_t dim = blk.p->head_dim, npad = blk.npad;
    V acc[R][NV];
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[r][v] = Vec::Zero();
    }
    for (int64_t f = 0; f < dim; ++f) {
      V k[NV];
      if constexpr (kQuery) {
#pragma GCC unroll 4
        for (int v = 0; v < NV; ++v) k[v] = Vec::Load(blk.kt + f * npad + j + v * W);
      }
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const int64_t at = f * nc + t.c[r] + j;
        if constexpr (kKey) {
          const V qb = Vec::Set1(t.q[r][f]);
#pragma GCC unroll 4
          for (int v = 0; v < NV; ++v) acc[r][v] = Vec::Fma(qb, Vec::Load(t.rk[r] + at + v * W), acc[r][v]);
        }
        if constexpr (kQuery) {
#pragma GCC unroll 4
          for (int v = 0; v < NV; ++v) acc[r][v] = Vec::Fma(k[v], Vec::Load(t.rq[r] + at + v * W), acc[r][v]);
        }
      }
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) {
        float* out = t.s[r] + j + v * W;
        Vec::Store(out, Vec::Add(Vec::Load(out), acc[r][v]));
      }
    }
  }

  // The keys' terms against head h's query table at its two ends.
  static const float* Ends(const Block& blk, int64_t h) {
    const AttentionParams& p = *blk.p;
    const int64_t x = h - blk.head0, dim = p.head_dim, npad = blk.npad;
    const int64_t d = p.relative_embedding_distance, nc = 2 * d + 1;
    float* ends = blk.ends + x * 2 * npad;
    if (blk.ready[x] != 0.0f) return ends;
    const float* rq = p.relative_query + h * dim * nc;
    for (int end = 0; end < 2; ++end) {
      const int64_t at = end == 0 ? 0 : 2 * d;
      for (int64_t j = 0; j < npad; j += W) {
        V acc = Vec::Zero();
        for (int64_t f = 0; f < dim; ++f) {
          acc = Vec::Fma(Vec::Load(blk.kt + f * npad + j), Vec::Set1(rq[f * nc + at]), acc);
        }
        Vec::Store(ends + end * npad + j, acc);
      }
    }
    blk.ready[x] = 1.0f;
    return ends;
  }

  // One vector of one row (row r of t) outside a tile.
  template <bool kKey, bool kQuery>
  static void Vector(const Block& blk, const RowTables& t, int r, int64_t h, float q_low,
                     float q_high, int64_t nc, int64_t j) {
    const int64_t c = t.c[r] + j, dim = blk.p->head_dim, npad = blk.npad;
    if (c >= 0 && c + W <= nc) {
      RowTables one;
      one.rk[0] = t.rk[r], one.rq[0] = t.rq[r], one.q[0] = t.q[r], one.c[0] = t.c[r];
      one.s[0] = t.s[r];
      Tile<1, 1, kKey, kQuery>(blk, one, nc, j);
      return;
    }
    V acc = Vec::Zero();
    if (c + W <= 0 || c >= nc) {  // wholly below or above: the end column's terms
      const bool low = c < 0;
      if constexpr (kKey) acc = Vec::Set1(low ? q_low : q_high);
      if constexpr (kQuery) acc = Vec::Add(acc, Vec::Load(Ends(blk, h) + (low ? 0 : npad) + j));
    } else {  // straddles an end: each lane's clamped column
      alignas(64) float lane_k[W], lane_q[W];
      for (int64_t f = 0; f < dim; ++f) {
        for (int i = 0; i < W; ++i) {
          const int64_t at = f * nc + std::clamp<int64_t>(c + i, 0, nc - 1);
          lane_k[i] = kKey ? t.rk[r][at] : 0.0f;
          lane_q[i] = kQuery ? t.rq[r][at] : 0.0f;
        }
        if constexpr (kKey) acc = Vec::Fma(Vec::Set1(t.q[r][f]), Vec::Load(lane_k), acc);
        if constexpr (kQuery) acc = Vec::Fma(Vec::Load(blk.kt + f * npad + j), Vec::Load(lane_q), acc);
      }
    }
    float* out = t.s[r] + j;
    Vec::Store(out, Vec::Add(Vec::Load(out), acc));
  }

  template <bool kKey, bool kQuery>
  static void AddRows(const Block& blk, const int64_t* position, const int64_t* head,
                      const float* q, int64_t count, float* s) {
    const AttentionParams& p = *blk.p;
    const int64_t d = p.relative_embedding_distance, nc = 2 * d + 1, dim = p.head_dim;
    const int64_t vectors = RoundUp(blk.n, W) / W;
    for (int64_t r0 = 0; r0 < count; r0 += kTileRows) {
      const int rows = static_cast<int>(std::min<int64_t>(kTileRows, count - r0));
      RowTables t;
      float q_low[kTileRows] = {}, q_high[kTileRows] = {};
      for (int r = 0; r < rows; ++r) {
        const int64_t table = head[r0 + r] * dim * nc;
        t.rk[r] = kKey ? p.relative_key + table : nullptr;
        t.rq[r] = kQuery ? p.relative_query + table : nullptr;
        t.q[r] = q + (r0 + r) * dim;
        t.c[r] = blk.kb - position[r0 + r] + d;
        t.s[r] = s + (r0 + r) * blk.npad;
        // The query's terms against the tables' end columns.
        for (int64_t f = 0; kKey && f < dim; ++f) {
          q_low[r] += t.q[r][f] * t.rk[r][f * nc];
          q_high[r] += t.q[r][f] * t.rk[r][f * nc + 2 * d];
        }
      }
      for (int64_t v = 0; v < vectors; v += kTileVectors) {
        const int64_t j = v * W;
        bool inside = rows == kTileRows && v + kTileVectors <= vectors;
        for (int r = 0; inside && r < rows; ++r) {
          inside = t.c[r] + j >= 0 && t.c[r] + j + kTileVectors * W <= nc;
        }
        if (inside) {
          Tile<kTileRows, kTileVectors, kKey, kQuery>(blk, t, nc, j);
          continue;
        }
        const int64_t end = std::min<int64_t>(v + kTileVectors, vectors);
        for (int r = 0; r < rows; ++r) {
          for (int64_t u = v; u < end; ++u) {
            Vector<kKey, kQuery>(blk, t, r, head[r0 + r], q_low[r], q_high[r], nc, u * W);
          }
        }
      }
    }
  }
};
