/* reduce.c — the host reduction kernel (reduce.h). Each loop is a straight
 * loop over restrict pointers with one fixed number of sources and one
 * dtype, so the compiler vectorizes it (built at -O3, see the Makefile);
 * the additions stay in rank order, so no reassociation changes a bit.
 * Like optim.c's kernels the loops are compiled once per instruction set
 * (GCC's target attribute) and the path optim.c chose from cpuid
 * (shardd__optim_isa) runs: the portable build's SSE2 adds 4 floats an
 * instruction where the CPU may add 8 or 16, and a bucket's reductions are
 * a scatter's work on the loop thread. Only additions and integer widening
 * are vectorized, each lane the same fp32 addition as the scalar one, so
 * every path gives the same bits. */
#include "reduce.h"

#include <stdint.h>
#include <string.h>

#include "dtype.h"
#include "optim.h"

#define WIDEN_FP32(p, i) (((const float *)(p))[i])
#define WIDEN_BF16(p, i) shardd__bf16_to_f32(((const uint16_t *)(p))[i])
#define WIDEN_FP16(p, i) shardd__f16_to_f32(((const uint16_t *)(p))[i])

/* The sum of k (1..4) sources s[0..k) in order, from acc's values when
 * add is set, into acc. */
#define SUM_GROUP(NAME, T, WIDEN, ATTR)                                       \
  ATTR static void NAME(float *restrict acc, const void *const *s, int k,     \
                        size_t n, int add) {                                  \
    const T *restrict a = s[0];                                               \
    const T *restrict b = k > 1 ? s[1] : NULL;                                \
    const T *restrict c = k > 2 ? s[2] : NULL;                                \
    const T *restrict d = k > 3 ? s[3] : NULL;                                \
    switch (k * 2 + (add != 0)) {                                             \
    case 2:                                                                   \
      for (size_t i = 0; i < n; i++)                                          \
        acc[i] = WIDEN(a, i);                                                 \
      break;                                                                  \
    case 3:                                                                   \
      for (size_t i = 0; i < n; i++)                                          \
        acc[i] = acc[i] + WIDEN(a, i);                                        \
      break;                                                                  \
    case 4:                                                                   \
      for (size_t i = 0; i < n; i++)                                          \
        acc[i] = WIDEN(a, i) + WIDEN(b, i);                                   \
      break;                                                                  \
    case 5:                                                                   \
      for (size_t i = 0; i < n; i++)                                          \
        acc[i] = (acc[i] + WIDEN(a, i)) + WIDEN(b, i);                        \
      break;                                                                  \
    case 6:                                                                   \
      for (size_t i = 0; i < n; i++)                                          \
        acc[i] = (WIDEN(a, i) + WIDEN(b, i)) + WIDEN(c, i);                   \
      break;                                                                  \
    case 7:                                                                   \
      for (size_t i = 0; i < n; i++)                                          \
        acc[i] = ((acc[i] + WIDEN(a, i)) + WIDEN(b, i)) + WIDEN(c, i);        \
      break;                                                                  \
    case 8:                                                                   \
      for (size_t i = 0; i < n; i++)                                          \
        acc[i] = ((WIDEN(a, i) + WIDEN(b, i)) + WIDEN(c, i)) + WIDEN(d, i);   \
      break;                                                                  \
    default:                                                                  \
      for (size_t i = 0; i < n; i++)                                          \
        acc[i] = (((acc[i] + WIDEN(a, i)) + WIDEN(b, i)) + WIDEN(c, i)) +     \
                 WIDEN(d, i);                                                 \
      break;                                                                  \
    }                                                                         \
  }

typedef void (*sum_fn)(float *restrict, const void *const *, int, size_t,
                       int);

/* one path: the three dtypes' loops compiled for one instruction set */
#define SUM_PATH(SFX, ATTR)                                                   \
  SUM_GROUP(sum_fp32_##SFX, float, WIDEN_FP32, ATTR)                          \
  SUM_GROUP(sum_bf16_##SFX, uint16_t, WIDEN_BF16, ATTR)                       \
  SUM_GROUP(sum_fp16_##SFX, uint16_t, WIDEN_FP16, ATTR)                       \
  static const sum_fn sum_path_##SFX[3] = {sum_fp32_##SFX, sum_bf16_##SFX,    \
                                           sum_fp16_##SFX};

SUM_PATH(scalar, )
#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
#define REDUCE_X86 1
SUM_PATH(avx2, __attribute__((target("avx2"))))
SUM_PATH(avx512, __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl"))))
#endif

/* the loops of the path optim.c's kernels use (the widest this CPU runs,
 * or the one a test chose), in dtype order fp32, bf16, fp16 */
static const sum_fn *sum_path(void) {
  switch (shardd__optim_isa()) {
#if REDUCE_X86
  case SHARDD__ISA_AVX2: return sum_path_avx2;
  case SHARDD__ISA_AVX512: return sum_path_avx512;
#endif
  default: return sum_path_scalar;
  }
}

void shardd__reduce_sum(shardd_dtype dtype, float *acc,
                        const void *const *srcs, int nsrc, size_t n, int add) {
  const sum_fn *path = sum_path();
  sum_fn group = dtype == SHARDD_DTYPE_FP32   ? path[0]
                 : dtype == SHARDD_DTYPE_BF16 ? path[1]
                                              : path[2];
  /* more than four sources: the next four go on from acc's sum, in order */
  for (int i = 0; i < nsrc; i += 4)
    group(acc, srcs + i, nsrc - i < 4 ? nsrc - i : 4, n, add || i > 0);
}
