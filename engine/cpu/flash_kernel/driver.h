// The flash attention driver (class Kernel): the algorithm, written once over
// the `Vec` and `Products` that the including file defined before it (see
// common.h for the composition).
//
// Per work item (<= 256 query rows of one kv head, see flash_internal.h) and
// per block of 256 keys: pack K (transposed, or in bf16 pairs) and V once;
// then per 64-row sub-block: S = Q K^T (plus the relative position
// embeddings' terms, relative_embeddings.h); per row: t = S*scale*log2(e) + mask,
// running max m, P = 2^(t - m), running sum l, alpha = 2^(m_old - m);
// O = alpha * O + P V.
// Keys beyond a row's causal/key_lengths limit are -inf; whole blocks beyond
// every row's limit are never visited. The output is O / l (0 when l == 0).
//
// Paged K/V (AttentionParams::k_blocks): the 256-key blocks are the same as
// for contiguous K/V; a block that spans several cache blocks is read as
// "runs" of rows `head_dim` apart, one per cache block, packed run by run
// into the same packed block. Decode reads K and V rows in place through a
// table of row pointers built per block (from the block table when paged),
// which also drives its prefetching. Every value and every operation is the
// one the contiguous layout gives, so a paged request is bitwise equal to
// the same request with contiguous K/V.

#if !defined(ATTNSERVE_FLASH_KERNEL_FILE)
#error "engine/cpu/flash_kernel/ is included only by engine/cpu/flash_kernel_<isa>.cc"
#endif

class Kernel {
  using V = Vec::V;
  static constexpr int W = Vec::W;
  using QElem = Products::QElem;
  using KElem = Products::KElem;
  using VElem = Products::VElem;
  using PElem = Products::PElem;

  // No member initializers: the drivers set every field of the rows they
  // use, and an item's array holds kItemRows of them (12 KiB that zeroing
  // cost 6% of a short-sequence core).
  struct Row {
    int64_t i, h;
    int64_t start;  // keys before it are outside the sliding window
    int64_t limit;  // keys [start, limit) may be visible (also <= item key1)
    int64_t mask_offset;
    void* out;
  };

  // Per-thread buffers, reused across items and calls.
  struct Scratch {
    ScratchBuffer q, k, v, s, p, o, stats, bias, conv, tmp, avg, rel;
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

  // The running sum after a block: one expression for both softmax paths,
  // so the compiler contracts it (or not) alike in each.
  static float RunningSum(float l, float alpha, float block_sum) { return l * alpha + block_sum; }

  // Scores of one row of one key block -> probabilities. s: the row's raw
  // Q.K (npad entries, overwritten with t and, in kFinal, fp32 P); prow:
  // P as PElem. n keys are valid in the block; row.limit - kb are visible.
  template <Mode kMode>
  static void SoftmaxBlock(const RequestPlan& plan, const Row& row, int64_t kb, int64_t n,
                           int64_t npad, float* s, PElem* prow, float* bias, float* m, float* l,
                           float* alpha) {
    const AttentionParams& p = *plan.p;
    const int64_t visible = std::min(row.limit - kb, n);
    const int64_t before = std::max<int64_t>(row.start - kb, 0);  // outside the window
    if (visible <= 0 || before >= visible) {
      *alpha = 1.0f;
      if constexpr (kMode != Mode::kStats) std::memset(prow, 0, static_cast<size_t>(npad) * sizeof(PElem));
      if constexpr (kMode == Mode::kFinal) FillRow(s, n, 0.0f);
      return;
    }
    const int64_t jv = RoundUp(visible, W);
    FillRow(s + visible, jv - visible, kNegInf);
    FillRow(s, before, kNegInf);
    if (p.softcap > 0) {
      // s -> softcap * tanh(s * scale / softcap) / scale: what follows scales
      // it back, so the capped score is what the exponent and the mask see.
      const float cap = p.softcap, scale = p.scale;
      for (int64_t j = before; j < visible; ++j) s[j] = cap * std::tanh(s[j] * scale / cap) / scale;
    }
    // Without a mask or a position bias (ALiBi, a relative bias) the scores
    // stay raw and the scale folds into the exponent's FMA (2^(s*c - m));
    // with any, t = s*c + bias is stored.
    const bool masked = p.mask.kind != MaskParams::Kind::kNone || p.alibi_slopes != nullptr ||
                        p.relative_bias != nullptr;
    const V c = Vec::Set1(plan.score_scale);
    V mx = Vec::Set1(kNegInf);
    if (!masked) {
      for (int64_t j = 0; j < jv; j += W) mx = Vec::Max(mx, Vec::Load(s + j));
    } else {
      const bool mask = p.mask.kind != MaskParams::Kind::kNone;
      if (mask) BuildBias(p.mask, row.mask_offset + kb * p.mask.stride_k, visible, jv, bias);
      const int64_t first = kb - (row.i + plan.causal_offset);  // key kb's j - p
      if (p.alibi_slopes != nullptr) AlibiBias(p.alibi_slopes[row.h], first, jv, mask, bias);
      if (p.relative_bias != nullptr) {
        const int64_t d = p.relative_bias_distance;
        RelativeBias(p.relative_bias + row.h * (2 * d + 1), d, first, jv,
                     mask || p.alibi_slopes != nullptr, bias);
      }
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
      // The rescale factor on the vector unit (degree 5 whatever kDeg: O
      // and l carry it from block to block), not a libm call per row.
      const float a = *m == kNegInf ? 0.0f : Vec::First(Vec::template Exp2<5>(Vec::Set1(*m - m_new)));
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
      *l = RunningSum(*l, a, Vec::ReduceAdd(sum));
      *m = m_new;
      *alpha = a;
    }
  }

  // SoftmaxBlock<kOnline> for kSoftmaxRows rows at once, in the plain case:
  // no mask, no softcap, and every key of the block visible to every row
  // (PlainRow). A row of a short block is a few vectors whose max, exponent
  // and sum form one dependent chain; one row at a time left that chain's
  // latency exposed (13% of a B32 L64 core, most of it waiting on the
  // reductions). The rows' chains are independent, so interleaving them
  // hides it. Each row's operations, and their order, are SoftmaxBlock's:
  // its values are bitwise the same whichever function computes them.
  static constexpr int kSoftmaxRows = 4;
  static bool PlainRow(const Row& row, int64_t kb, int64_t n) {
    return row.limit - kb >= n && row.start <= kb;
  }
  static void SoftmaxPlainRows(const RequestPlan& plan, int64_t n, int64_t npad, float* s,
                               PElem* prow, float* m, float* l, float* alpha) {
    constexpr int R = kSoftmaxRows;
    constexpr int kDeg = Products::kExpDegree;
    const int64_t jv = RoundUp(n, W);
    const V c = Vec::Set1(plan.score_scale);
    V mx[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      FillRow(s + r * npad + n, jv - n, kNegInf);
      mx[r] = Vec::Set1(kNegInf);
    }
    for (int64_t j = 0; j < jv; j += W) {
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) mx[r] = Vec::Max(mx[r], Vec::Load(s + r * npad + j));
    }
    float block_max[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      // GCC 12 flags the "undefined" register inside _mm512_reduce_max_ps
      // (a self-initialized placeholder) once inlined here.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
      block_max[r] = Vec::ReduceMax(mx[r]) * plan.score_scale;
#pragma GCC diagnostic pop
    }
    V neg_m[R];
    bool live[R];  // false: every key scored -inf so far (SoftmaxBlock's early return)
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const float m_new = std::max(m[r], block_max[r]);
      live[r] = m_new != kNegInf;
      if (!live[r]) {
        alpha[r] = 1.0f;
        neg_m[r] = Vec::Zero();
        continue;
      }
      alpha[r] = m[r] == kNegInf ? 0.0f : Vec::First(Vec::template Exp2<5>(Vec::Set1(m[r] - m_new)));
      m[r] = m_new;
      neg_m[r] = Vec::Set1(-m_new);
    }
    V sum[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) sum[r] = Vec::Zero();
    for (int64_t j = 0; j < jv; j += W) {
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const V pv = Vec::template Exp2<kDeg>(Vec::Fma(Vec::Load(s + r * npad + j), c, neg_m[r]));
        Products::StoreP(prow + r * npad + j, pv);
        sum[r] = Vec::Add(sum[r], pv);
      }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      PElem* pr = prow + r * npad;
      if (!live[r]) {
        std::memset(pr, 0, static_cast<size_t>(npad) * sizeof(PElem));
        continue;
      }
      if constexpr (Products::kPInScores) FillRow(reinterpret_cast<float*>(pr) + jv, npad - jv, 0.0f);
      else std::memset(pr + jv, 0, static_cast<size_t>(npad - jv) * sizeof(PElem));
      l[r] = RunningSum(l[r], alpha[r], Vec::ReduceAdd(sum[r]));
    }
  }

  // The softmax of rows [0, count) of a sub-block for key block kb: runs of
  // kSoftmaxRows plain rows together, the others one by one.
  static void SoftmaxOnline(const RequestPlan& plan, const Row* row, int64_t count, int64_t kb,
                            int64_t n, int64_t npad, float* s, PElem* prow, float* bias, float* m,
                            float* l, float* alpha) {
    const AttentionParams& p = *plan.p;
    const bool plain_request = p.mask.kind == MaskParams::Kind::kNone && !(p.softcap > 0) &&
                               p.alibi_slopes == nullptr && p.relative_bias == nullptr;
    for (int64_t r = 0; r < count;) {
      bool plain = plain_request && r + kSoftmaxRows <= count;
      for (int k = 0; plain && k < kSoftmaxRows; ++k) plain = PlainRow(row[r + k], kb, n);
      if (plain) {
        SoftmaxPlainRows(plan, n, npad, s + r * npad, prow + r * npad, m + r, l + r, alpha + r);
        r += kSoftmaxRows;
      } else {
        SoftmaxBlock<Mode::kOnline>(plan, row[r], kb, n, npad, s + r * npad, prow + r * npad, bias,
                                    m + r, l + r, alpha + r);
        ++r;
      }
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

  // ALiBi: bias[j] (+)= slope * log2(e) * (j + first) for j < jv, `first`
  // being the block's first key minus the row's position
  // (AttentionParams::alibi_slopes); added to the mask's bias when `add`.
  // Keys outside the row's window, its limit or the block are -inf already,
  // whatever their bias. j + first is exact in float (|j + first| < 2^24).
  static void AlibiBias(float slope, int64_t first, int64_t jv, bool add, float* bias) {
    alignas(64) float lane[W];
    for (int i = 0; i < W; ++i) lane[i] = static_cast<float>(i);
    const V iota = Vec::Load(lane), s = Vec::Set1(slope * kLog2e);
    for (int64_t j = 0; j < jv; j += W) {
      const V key = Vec::Add(Vec::Set1(static_cast<float>(j + first)), iota);
      Vec::Store(bias + j, add ? Vec::Fma(key, s, Vec::Load(bias + j)) : Vec::Mul(key, s));
    }
  }

  // A relative position bias: bias[j] (+)= table[clamp(j + first, -d, d) +
  // d] * log2(e) for j < jv (AttentionParams::relative_bias; `table` the
  // row's head's, `first` as for ALiBi): a vector at a time, each one below
  // -d, above d, or within the table's run (a straddling vector lane by lane).
  static void RelativeBias(const float* table, int64_t d, int64_t first, int64_t jv, bool add,
                           float* bias) {
    const int64_t low = std::clamp<int64_t>(-d - first, 0, jv);      // j + first < -d below
    const int64_t high = std::clamp<int64_t>(d + 1 - first, low, jv);  // j + first > d from
    const V l2e = Vec::Set1(kLog2e), below = Vec::Set1(table[0]), above = Vec::Set1(table[2 * d]);
    alignas(64) float lane[W];
    for (int64_t j = 0; j < jv; j += W) {
      V v;
      if (j + W <= low) {
        v = below;
      } else if (j >= high) {
        v = above;
      } else if (j >= low && j + W <= high) {
        v = Vec::Load(table + (j + first + d));
      } else {
        for (int i = 0; i < W; ++i) lane[i] = table[std::clamp<int64_t>(j + i + first, -d, d) + d];
        v = Vec::Load(lane);
      }
      Vec::Store(bias + j, add ? Vec::Fma(v, l2e, Vec::Load(bias + j)) : Vec::Mul(v, l2e));
    }
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
    float* rel;    // relative position embeddings: a key block's scratch
    float* rel_q;  // and the item's queries in fp32
  };

  static bool GetBuffers(const RequestPlan& plan, int64_t r_pad, Buffers* bufs) {
    const AttentionParams& p = *plan.p;
    Scratch& sc = ThreadScratch();
    const int64_t dmax = std::max(p.head_dim, plan.dv_pad);
    bufs->q = sc.q.Get<QElem>(static_cast<size_t>(r_pad * Products::QStride(p.head_dim)));
    bufs->k = sc.k.Get<KElem>(Products::KElems(p.head_dim, kBlockKeys));
    // + kKeyAlign: paged bf16 packing may write up to 31 zero keys past the
    // block (bf16_packing.h, PackV).
    bufs->v = sc.v.Get<VElem>(Products::VElems(kBlockKeys + kKeyAlign, plan.dv_pad));
    bufs->s = sc.s.Get<float>(static_cast<size_t>(kBlockRows * kBlockKeys));
    bufs->p = Products::kPInScores ? reinterpret_cast<PElem*>(bufs->s)
                                   : sc.p.Get<PElem>(static_cast<size_t>(kBlockRows * kBlockKeys));
    bufs->o = sc.o.Get<float>(static_cast<size_t>(r_pad * plan.dv_pad));
    float* stats = sc.stats.Get<float>(static_cast<size_t>(3 * r_pad));
    bufs->bias = sc.bias.Get<float>(static_cast<size_t>(kBlockKeys));
    bufs->conv = sc.conv.Get<float>(Products::ConvElems(dmax));
    bufs->tmp = sc.tmp.Get<float>(static_cast<size_t>(kBlockRows * plan.dv_pad));
    // Relative position embeddings: a key block's prepared keys, then the
    // item's queries in fp32.
    bufs->rel = bufs->rel_q = nullptr;
    if (RelativeEmbeddings::Enabled(p)) {
      const size_t block = RelativeEmbeddings::BlockFloats(p.head_dim, kBlockKeys, plan.group);
      bufs->rel = sc.rel.Get<float>(block + static_cast<size_t>(kItemRows * p.head_dim));
      if (bufs->rel == nullptr) return false;
      bufs->rel_q = bufs->rel + block;
    }
    if (!bufs->q || !bufs->k || !bufs->v || !bufs->s || !bufs->p || !bufs->o || !stats ||
        !bufs->bias || !bufs->conv || !bufs->tmp)
      return false;
    bufs->m = stats;
    bufs->l = stats + r_pad;
    bufs->alpha = stats + 2 * r_pad;
    return true;
  }

  // m = the sink's logit (base 2), l = 1: the softmax state after a key of
  // score `sink` whose value row is zero.
  static void StartWithSinks(const AttentionParams& p, const Row* row, int64_t rows,
                             const Buffers& bf) {
    for (int64_t r = 0; r < rows; ++r) {
      bf.m[r] = p.sinks[row[r].h] * kLog2e;
      bf.l[r] = 1.0f;
    }
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

  // Where key (value) row kb of kv head `hkv` starts in the input, and the
  // stride of the rows that follow it in the same run (RunKeys).
  static const void* KBlock(const AttentionParams& p, int64_t b, int64_t hkv, int64_t kb) {
    if (p.k_blocks != nullptr) {
      const int64_t bt = p.block_tokens;
      return ElemPtr(p.k_blocks[kb / bt], p.dtype, (hkv * bt + kb % bt) * p.head_dim);
    }
    return ElemPtr(p.k, p.dtype, b * p.k_stride_b + hkv * p.k_stride_h + kb * p.k_stride_row);
  }

  static const void* VBlock(const AttentionParams& p, int64_t b, int64_t hkv, int64_t kb) {
    if (p.v_blocks != nullptr) {
      const int64_t bt = p.block_tokens;
      return ElemPtr(p.v_blocks[kb / bt], p.dtype, (hkv * bt + kb % bt) * p.head_dim_v);
    }
    return ElemPtr(p.v, p.dtype, b * p.v_stride_b + hkv * p.v_stride_h + kb * p.v_stride_row);
  }
  static int64_t KLd(const AttentionParams& p) { return p.k_blocks != nullptr ? p.head_dim : p.k_stride_row; }
  static int64_t VLd(const AttentionParams& p) { return p.v_blocks != nullptr ? p.head_dim_v : p.v_stride_row; }

  // Of keys [kb, kb + n), how many from kb lie in one run (rows KLd/VLd
  // apart): all when contiguous, up to the end of kb's cache block when
  // paged (a multiple of 16 keys unless it ends the block at kb + n).
  static int64_t RunKeys(const AttentionParams& p, int64_t kb, int64_t n) {
    return p.k_blocks != nullptr ? std::min(n, p.block_tokens - kb % p.block_tokens) : n;
  }

  // dst[j] = the row of key key0 + j (K, or V when `value`) for j < count.
  static void RowPointers(const AttentionParams& p, int64_t b, int64_t hkv, int64_t key0, int64_t count,
                          bool value, const void** dst) {
    for (int64_t j = 0, run = 0; j < count; j += run) {
      run = RunKeys(p, key0 + j, count - j);
      const void* base = value ? VBlock(p, b, hkv, key0 + j) : KBlock(p, b, hkv, key0 + j);
      const int64_t row_bytes = (value ? VLd(p) : KLd(p)) * ElemSize(p.dtype);
      const char* row = static_cast<const char*>(base);
      for (int64_t t = 0; t < run; ++t, row += row_bytes) dst[j + t] = row;
    }
  }

  // Packs K (unless `direct_k`: QKDirect reads it in place) and, when
  // `with_v`, V for keys [kb, kb + n) of kv head `hkv`.
  static void PackKV(const AttentionParams& p, const RequestPlan& plan, int64_t b, int64_t hkv,
                     int64_t kb, int64_t n, int64_t npad, const Buffers& bf, bool with_v,
                     const VElem** v, int64_t* ldv, bool direct_k = false) {
    if (!direct_k) {
      for (int64_t j = 0, run = 0; j < n; j += run) {
        run = RunKeys(p, kb + j, n - j);
        Products::PackK(bf.k + j, npad, KBlock(p, b, hkv, kb + j), p.dtype, KLd(p), run, p.head_dim,
                        bf.conv);
      }
      Products::PadK(bf.k, npad, n, npad, p.head_dim);
    }
    if (!with_v) return;
    if (RunKeys(p, kb, n) == n) {  // one run: V may be read in place
      *v = Products::PackV(bf.v, VBlock(p, b, hkv, kb), p.dtype, VLd(p), n, p.head_dim_v, plan.dv_pad,
                           bf.conv, ldv, /*may_alias=*/true);
      return;
    }
    for (int64_t j = 0, run = 0; j < n; j += run) {
      run = RunKeys(p, kb + j, n - j);
      Products::PackV(bf.v + Products::VOffset(j, plan.dv_pad), VBlock(p, b, hkv, kb + j), p.dtype,
                      VLd(p), run, p.head_dim_v, plan.dv_pad, bf.conv, ldv, /*may_alias=*/false);
    }
    Products::PadV(bf.v, n, plan.dv_pad);
    *v = bf.v;
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
    int64_t kfirst = item.key1;  // no row sees a key before it
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t v = item.row0 + r;
      Row& rw = row[r];
      rw.i = v / g;
      rw.h = hkv * g + v % g;
      rw.limit = std::min(VisibleKeys(plan, b, rw.i), item.key1);
      rw.start = WindowStart(plan, rw.i);
      kfirst = std::min(kfirst, rw.start);
      rw.mask_offset = MaskOffset(p, b, rw.h, rw.i);
      rw.out = ORow(p, b, rw.h, rw.i);
      qrows[r] = QRow(p, b, rw.h, rw.i);
      if (r % kBlockRows == 0) sub_end[r / kBlockRows] = item.key0;
      sub_end[r / kBlockRows] = std::max(sub_end[r / kBlockRows], rw.limit);
      kend = std::max(kend, rw.limit);
    }
    // Decided per request (not per item), so every row of it is computed
    // the same way however rows are grouped.
    const bool direct_k = Products::UseDirectK(plan.group * p.q_len, p.head_dim, p.dtype);
    const bool direct_v = Products::UseDirectV(plan.group * p.q_len, p.head_dim_v, dvp);
    // O from zero: a sub-block's first P V starts its accumulators at zero
    // (the values O = 0 * alpha + ... gave), so O is neither zeroed here nor
    // read then; a sub-block that no block reaches is zeroed at the end.
    const bool o_from_zero = Products::kPvFromZero && !direct_v;
    bool o_started[kMaxSub] = {};
    // Relative position embeddings: each row's position and head, its query
    // in fp32.
    const bool embedded = RelativeEmbeddings::Enabled(p);
    int64_t positions[kItemRows], heads[kItemRows];
    if (embedded) {
      for (int64_t r = 0; r < rows; ++r) {
        positions[r] = row[r].i + plan.causal_offset;
        heads[r] = row[r].h;
      }
      RelativeEmbeddings::QueriesToFloat(p, qrows, rows, bf.rel_q);
    }

    FillRow(bf.m, r_pad, kNegInf);
    FillRow(bf.l, r_pad, 0.0f);
    FillRow(bf.alpha, r_pad, 1.0f);
    if (!o_from_zero) FillRow(bf.o, r_pad * dvp, 0.0f);
    // A sink starts each row's softmax as a key of its own with no value;
    // a key-split row gets it once, where its chunks are combined.
    if (p.sinks != nullptr && item.kind != ItemKind::kSplit) StartWithSinks(p, row, rows, bf);
    Products::Begin();
    // Q rows are read in place where the products take them as they are
    // (contiguous fp32 rows), else packed once per item.
    const int64_t ldq = Products::QStride(p.head_dim);
    const QElem* q = Products::InPlaceQ(qrows, rows, r_pad, p.dtype, p.head_dim);
    if (q == nullptr) {
      Products::PackQ(bf.q, qrows, rows, r_pad, p.dtype, p.head_dim);
      q = bf.q;
    }
    // Decode: the K and V rows of a block's keys and of the next
    // kPrefetchRows keys (prefetched; null past the item's keys), through
    // the block table when paged.
    const void* k_rows[kBlockKeys + kPrefetchRows];
    const void* v_rows[kBlockKeys + kPrefetchRows];
    RowPrefetch pf;
    if (direct_k) {
      pf.k_ahead = k_rows + kPrefetchRows;
      pf.k_bytes = p.head_dim * ElemSize(p.dtype);
    }
    // Blocks wholly before every row's sliding window are skipped (they would
    // leave m, l and O exactly as they are); the block grid stays aligned.
    const int64_t kskip =
        kfirst > item.key0 ? (kfirst - item.key0) / kBlockKeys * kBlockKeys : 0;
    for (int64_t kb = item.key0 + kskip; kb < kend; kb += kBlockKeys) {
      const int64_t n = std::min(kBlockKeys, kend - kb);
      const int64_t npad = RoundUp(n, Products::kKeyAlign);
      const VElem* v = nullptr;
      int64_t ldv = 0;
      PackKV(p, plan, b, hkv, kb, n, npad, bf, !direct_v, &v, &ldv, direct_k);
      RelativeEmbeddings::Block keys{};
      if (embedded) keys = PrepareEmbeddingKeys(p, b, hkv, kb, n, npad, hkv * g, g, bf);
      const int64_t with_next = std::min(n + kPrefetchRows, kend - kb);
      if (direct_k) {
        RowPointers(p, b, hkv, kb, with_next, false, k_rows);
        std::fill(k_rows + with_next, k_rows + n + kPrefetchRows, nullptr);
      }
      if (direct_v) {
        RowPointers(p, b, hkv, kb, with_next, true, v_rows);
        std::fill(v_rows + with_next, v_rows + n + kPrefetchRows, nullptr);
      }
      for (int64_t sb = 0; sb < subs; ++sb) {
        if (sub_end[sb] <= kb) continue;  // every row of it is past its limit
        const int64_t r0 = sb * kBlockRows;
        const int64_t sr = std::min(kBlockRows, rows - r0);
        const int64_t sr_pad = std::min(kBlockRows, r_pad - r0);
        if (direct_k) {
          Products::QKDirect(bf.s, npad, q + r0 * ldq, ldq, k_rows, p.dtype, sr_pad, n, p.head_dim,
                             sb == 0 ? pf : RowPrefetch{});
        } else {
          Products::QK(bf.s, npad, q + r0 * ldq, ldq, bf.k, npad, sr_pad, npad, p.head_dim);
        }
        if (embedded) {
          RelativeEmbeddings::Add(keys, positions + r0, heads + r0, bf.rel_q + r0 * p.head_dim,
                                  sr, bf.s);
        }
        SoftmaxOnline(plan, row + r0, sr, kb, n, npad, bf.s, bf.p, bf.bias, bf.m + r0, bf.l + r0,
                      bf.alpha + r0);
        if (sr_pad > sr)
          std::memset(bf.p + sr * npad, 0, static_cast<size_t>((sr_pad - sr) * npad) * sizeof(PElem));
        if (direct_v) {
          Products::PVDirect(bf.o + r0 * dvp, dvp, bf.alpha + r0, bf.p, npad, v_rows, p.dtype, sr_pad, n, dvp);
        } else {
          const float* alpha = o_from_zero && !o_started[sb] ? nullptr : bf.alpha + r0;
          Products::PV(bf.o + r0 * dvp, dvp, alpha, bf.p, npad, v, ldv, sr_pad, n, dvp, bf.tmp);
          o_started[sb] = true;
        }
      }
    }
    Products::End();
    if (o_from_zero) {
      for (int64_t sb = 0; sb < subs; ++sb) {
        const int64_t r0 = sb * kBlockRows;
        if (!o_started[sb]) FillRow(bf.o + r0 * dvp, std::min(kBlockRows, r_pad - r0) * dvp, 0.0f);
      }
    }

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

  // Keys [kb, kb + n) of kv head `hkv` prepared for the relative position
  // embeddings of query heads [head0, head0 + heads).
  static RelativeEmbeddings::Block PrepareEmbeddingKeys(const AttentionParams& p, int64_t b,
                                                        int64_t hkv, int64_t kb, int64_t n,
                                                        int64_t npad, int64_t head0,
                                                        int64_t heads, const Buffers& bf) {
    auto row_of = [&](int64_t j, int64_t* run) {
      *run = RunKeys(p, kb + j, n - j);
      return KBlock(p, b, hkv, kb + j);
    };
    return RelativeEmbeddings::Prepare(p, kb, n, npad, KLd(p), row_of, head0, heads, bf.rel);
  }

  // The weights passes' relative position embeddings for one block: rows of
  // head h at `positions`.
  static void AddEmbeddingsForWeights(const AttentionParams& p, int64_t b, int64_t h,
                                      int64_t hkv, const int64_t* positions,
                                      const int64_t* heads, int64_t rows, int64_t kb, int64_t n,
                                      int64_t npad, const Buffers& bf) {
    if (!RelativeEmbeddings::Enabled(p)) return;
    const RelativeEmbeddings::Block keys = PrepareEmbeddingKeys(p, b, hkv, kb, n, npad, h, 1, bf);
    RelativeEmbeddings::Add(keys, positions, heads, bf.rel_q, rows, bf.s);
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
        rw.start = WindowStart(plan, rw.i);
        rw.mask_offset = MaskOffset(p, b, h, rw.i);
        rw.out = ORow(p, b, h, rw.i);
        qrows[r] = QRow(p, b, h, rw.i);
        kend = std::max(kend, rw.limit);
      }
      Products::PackQ(bf.q, qrows, rows, r_pad, p.dtype, p.head_dim);
      int64_t positions[kBlockRows], heads[kBlockRows];
      if (RelativeEmbeddings::Enabled(p)) {
        for (int64_t r = 0; r < rows; ++r) {
          positions[r] = row[r].i + plan.causal_offset;
          heads[r] = h;
        }
        RelativeEmbeddings::QueriesToFloat(p, qrows, rows, bf.rel_q);
      }
      FillRow(bf.m, r_pad, kNegInf);
      FillRow(bf.l, r_pad, 0.0f);
      FillRow(bf.alpha, r_pad, 1.0f);
      FillRow(bf.o, r_pad * dvp, 0.0f);
      if (p.sinks != nullptr) StartWithSinks(p, row, rows, bf);

      for (int64_t kb = 0; kb < kend; kb += kBlockKeys) {  // pass 1: row max and sum
        const int64_t n = std::min(kBlockKeys, kend - kb);
        const int64_t npad = RoundUp(n, Products::kKeyAlign);
        PackKV(p, plan, b, hkv, kb, n, npad, bf, false, nullptr, nullptr);
        Products::QK(bf.s, npad, bf.q, ldq, bf.k, npad, r_pad, npad, p.head_dim);
        AddEmbeddingsForWeights(p, b, h, hkv, positions, heads, rows, kb, n, npad, bf);
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
        AddEmbeddingsForWeights(p, b, h, hkv, positions, heads, rows, kb, n, npad, bf);
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
