// Shared by every flash kernel variant: fp32 constants, the exp2 polynomial
// coefficients, scalar element access and prefetch.
//
// engine/cpu/flash_kernel/ holds the flash kernel template, one file per
// piece. Each engine/cpu/flash_kernel_<isa>.cc composes one variant from
// them, in this order: common.h; one vector type `Vec` (vec_scalar.h,
// vec_avx2.h or vec_avx512.h); vec_rows.h; one product policy `Products`
// (fp32_products.h, or bf16_packing.h and then bf16_products.h or
// amx_products.h); relative_embeddings.h, a score term over Vec; driver.h,
// the algorithm over Vec and Products.
//
// The pieces are included after flash_internal.h (which brings every library
// header they use), inside an anonymous namespace and the including file's
// `#pragma GCC target` region. They have no include guards (one inclusion per
// file) and define nothing with external linkage, so the copies compiled for
// different instruction sets never meet at link time (no ODR merging).
//
// A `Vec` provides: V, W, microkernel tile sizes, arithmetic, reductions,
// Exp2<degree> (for x <= 0; 0 for x < -126, so -inf gives exactly 0),
// LoadConvert/StoreConvert of W elements of a float dtype, BoolBias (0 where
// the mask byte is nonzero, -inf where it is 0) and a kT x kT transpose.

#if !defined(ATTNSERVE_FLASH_KERNEL_FILE)
#error "engine/cpu/flash_kernel/ is included only by engine/cpu/flash_kernel_<isa>.cc"
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

// Decode reads K rows straight from memory, one pass: while its Q K^T
// reads key j of a block it prefetches k_ahead[j], the K row kPrefetchRows
// keys on, wherever the paged cache keeps it (null entries are skipped).
// (Prefetching the block's V rows there as well measured no faster.)
struct RowPrefetch {
  const void* const* k_ahead = nullptr;
  int64_t k_bytes = 0;
  void At(int64_t j) const {
    if (k_ahead != nullptr && k_ahead[j] != nullptr) PrefetchRow(k_ahead[j], k_bytes);
  }
};

inline uint32_t LoadU32(const void* p) {
  uint32_t x;
  std::memcpy(&x, p, sizeof x);
  return x;
}
