// The portable `Vec` (see common.h): one float per "vector", plain C++ for the
// baseline target; with fp32_products.h, the fallback variant.

#if !defined(ATTNSERVE_FLASH_KERNEL_FILE)
#error "engine/cpu/flash_kernel/ is included only by engine/cpu/flash_kernel_<isa>.cc"
#endif

struct Vec {
  using V = float;
  static constexpr int W = 1;
  static constexpr int kQkVecs = 4, kPvRows = 4, kPvVecs = 4;
  static constexpr int QkRows(int) { return 4; }
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
  static float First(V v) { return v; }  // lane 0
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
