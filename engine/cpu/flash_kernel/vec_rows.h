// Row loops over the `Vec` in scope (vec_*.h): widen, store rounded, fill;
// and the row tiling of the products' microkernels. Used by the products and
// the driver.

#if !defined(ATTNSERVE_FLASH_KERNEL_FILE)
#error "engine/cpu/flash_kernel/ is included only by engine/cpu/flash_kernel_<isa>.cc"
#endif

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

// tile.template operator()<R>(r0) for the rows [0, rows) of a microkernel:
// tiles of M rows from r0 = 0, then one tile of the R < M rows left (R a
// compile-time size, so each tile keeps its accumulators in registers).
template <int M, typename Tile>
__attribute__((always_inline)) inline void ForRowTiles(int64_t rows, Tile&& tile) {
  int64_t r0 = 0;
  for (; r0 + M <= rows; r0 += M) tile.template operator()<M>(r0);
  if (r0 == rows) return;
  const int rest = static_cast<int>(rows - r0);
  [&]<int... Ms>(std::integer_sequence<int, Ms...>) {
    ((rest == Ms + 1 ? tile.template operator()<Ms + 1>(r0) : void()), ...);
  }(std::make_integer_sequence<int, M - 1>{});
}
