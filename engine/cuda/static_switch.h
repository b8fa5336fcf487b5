// Turns runtime values into compile-time template arguments, so that each
// kernel family instantiates a small, explicit set of variants (the habit of
// flash-attention's static_switch.h). Use inside a function returning the
// lambda's type:
//   return ATTNSERVE_BOOL_SWITCH(args.causal, kCausal, [&] { return Launch<kCausal>(args); });
#ifndef ATTNSERVE_ENGINE_CUDA_STATIC_SWITCH_H_
#define ATTNSERVE_ENGINE_CUDA_STATIC_SWITCH_H_

#define ATTNSERVE_BOOL_SWITCH(COND, NAME, ...) \
  [&] {                                        \
    if (COND) {                                \
      constexpr bool NAME = true;              \
      return __VA_ARGS__();                    \
    } else {                                   \
      constexpr bool NAME = false;             \
      return __VA_ARGS__();                    \
    }                                          \
  }()

// HEAD_DIM must be 64 or 128 (the caller checks); any other value would run
// the 128 variant.
#define ATTNSERVE_HEAD_DIM_SWITCH(HEAD_DIM, NAME, ...) \
  [&] {                                                \
    if ((HEAD_DIM) == 64) {                            \
      constexpr int NAME = 64;                         \
      return __VA_ARGS__();                            \
    } else {                                           \
      constexpr int NAME = 128;                        \
      return __VA_ARGS__();                            \
    }                                                  \
  }()

#endif  // ATTNSERVE_ENGINE_CUDA_STATIC_SWITCH_H_
