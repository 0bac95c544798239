/* reduce.c — the host reduction kernel (reduce.h). Each loop is a straight
 * loop over restrict pointers with one fixed number of sources and one
 * dtype, so the compiler vectorizes it (built at -O3, see the Makefile);
 * the additions stay in rank order, so no reassociation changes a bit. */
#include "reduce.h"

#include <stdint.h>
#include <string.h>

#include "dtype.h"

#define WIDEN_FP32(p, i) (((const float *)(p))[i])
#define WIDEN_BF16(p, i) shardd__bf16_to_f32(((const uint16_t *)(p))[i])
#define WIDEN_FP16(p, i) shardd__f16_to_f32(((const uint16_t *)(p))[i])

/* The sum of k (1..4) sources s[0..k) in order, from acc's values when
 * add is set, into acc. */
#define SUM_GROUP(NAME, T, WIDEN)                                             \
  static void NAME(float *restrict acc, const void *const *s, int k,          \
                   size_t n, int add) {                                       \
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

SUM_GROUP(sum_fp32, float, WIDEN_FP32)
SUM_GROUP(sum_bf16, uint16_t, WIDEN_BF16)
SUM_GROUP(sum_fp16, uint16_t, WIDEN_FP16)

void shardd__reduce_sum(shardd_dtype dtype, float *acc,
                        const void *const *srcs, int nsrc, size_t n, int add) {
  void (*group)(float *restrict, const void *const *, int, size_t, int) =
      dtype == SHARDD_DTYPE_FP32   ? sum_fp32
      : dtype == SHARDD_DTYPE_BF16 ? sum_bf16
                                   : sum_fp16;
  /* more than four sources: the next four go on from acc's sum, in order */
  for (int i = 0; i < nsrc; i += 4)
    group(acc, srcs + i, nsrc - i < 4 ? nsrc - i : 4, n, add || i > 0);
}
