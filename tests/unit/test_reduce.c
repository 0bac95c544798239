/* test_reduce.c — kernels/reduce.h and the host backend's reduce ops over
 * it: every sum is the bits of adding the ranks' widened values one after
 * the other in rank order, whatever the number of sources (one pass per
 * four), the dtype, the length or the alignment; an accumulating reduce
 * goes on from the values there; the host backend's reduce divides the
 * sum, its reduce_add adds the divided sum. The expected values are
 * computed here one addition at a time. */
#include <criterion/criterion.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "dtype.h"
#include "optim.h"
#include "reduce.h"

#define MAXSRC 11

static uint32_t rng = 12345;

static uint32_t next(void) {
  rng = rng * 1664525u + 1013904223u;
  return rng >> 8;
}

/* values of very different sizes and signs, so that the order of the
 * additions shows in the rounding */
static float value(void) {
  float v = (float)(next() % 20001) / 64.0f - 156.0f;
  switch (next() % 4) {
  case 0:
    return v * 1e-4f;
  case 1:
    return v * 3e3f;
  default:
    return v;
  }
}

static float widen(shardd_dtype dt, const void *p, size_t i) {
  if (dt == SHARDD_DTYPE_FP32)
    return ((const float *)p)[i];
  uint16_t h = ((const uint16_t *)p)[i];
  return dt == SHARDD_DTYPE_BF16 ? shardd__bf16_to_f32(h) : shardd__f16_to_f32(h);
}

static void fill(shardd_dtype dt, void *p, size_t n) {
  for (size_t i = 0; i < n; i++) {
    float v = value();
    if (dt == SHARDD_DTYPE_FP32)
      ((float *)p)[i] = v;
    else if (dt == SHARDD_DTYPE_BF16)
      ((uint16_t *)p)[i] = shardd__f32_to_bf16(v);
    else
      ((uint16_t *)p)[i] = shardd__f32_to_f16(v / 16.0f);
  }
}

/* one addition at a time, in rank order */
static void reference(shardd_dtype dt, float *out, const float *start,
                      void *const *src, int nsrc, size_t n) {
  for (size_t i = 0; i < n; i++) {
    volatile float acc = start ? start[i] : widen(dt, src[0], i);
    for (int k = start ? 0 : 1; k < nsrc; k++)
      acc = acc + widen(dt, src[k], i);
    out[i] = acc;
  }
}

static void check_kernel(shardd_dtype dt, int nsrc, size_t n, size_t skew,
                         int add) {
  size_t esz = shardd_dtype_size(dt);
  void *src[MAXSRC];
  const void *csrc[MAXSRC];
  /* page-aligned sources, as a rank's areas are, plus a skew */
  for (int k = 0; k < nsrc; k++) {
    src[k] = aligned_alloc(4096, ((n + skew) * esz + 4095) / 4096 * 4096);
    cr_assert_not_null(src[k]);
    src[k] = (char *)src[k] + skew * esz;
    fill(dt, src[k], n);
    csrc[k] = src[k];
  }
  float *acc = malloc((n ? n : 1) * sizeof *acc);
  float *start = malloc((n ? n : 1) * sizeof *start);
  float *want = malloc((n ? n : 1) * sizeof *want);
  for (size_t i = 0; i < n; i++)
    acc[i] = start[i] = value();
  reference(dt, want, add ? start : NULL, src, nsrc, n);
  shardd__reduce_sum(dt, acc, csrc, nsrc, n, add);
  for (size_t i = 0; i < n; i++)
    cr_assert(memcmp(&acc[i], &want[i], sizeof acc[i]) == 0,
              "dtype %d, %d sources, n %zu, skew %zu, add %d: element %zu is "
              "%.9g, adding in rank order gives %.9g", (int)dt, nsrc, n, skew,
              add, i, (double)acc[i], (double)want[i]);
  for (int k = 0; k < nsrc; k++)
    free((char *)src[k] - skew * esz);
  free(acc);
  free(start);
  free(want);
}

static void check_every_sum(void) {
  static const shardd_dtype dts[] = {SHARDD_DTYPE_FP32, SHARDD_DTYPE_BF16,
                                     SHARDD_DTYPE_FP16};
  static const size_t ns[] = {1, 3, 4, 17, 1024, 4099};
  for (size_t d = 0; d < 3; d++)
    for (int nsrc = 1; nsrc <= MAXSRC; nsrc++)
      for (size_t j = 0; j < sizeof ns / sizeof ns[0]; j++)
        for (int add = 0; add < 2; add++)
          check_kernel(dts[d], nsrc, ns[j], (size_t)(nsrc + j) % 3, add);
}

Test(reduce, sums_in_rank_order_for_any_number_of_sources) { check_every_sum(); }

/* The kernel's loops are compiled for each instruction set the optimizer's
 * kernels have (optim.h) and run on the path those use: every path this
 * CPU runs gives the bits of adding one rank after the other, NaN and
 * infinities as well (the wider paths add 8 or 16 lanes at once, each the
 * same fp32 addition). */
Test(reduce, every_instruction_set_path_gives_the_same_bits) {
  shardd__isa was = shardd__optim_isa();
  int ran = 0;
  for (int isa = 0; isa < SHARDD__ISA_COUNT; isa++) {
    if (!shardd__isa_runnable((shardd__isa)isa))
      continue;
    cr_assert_eq(shardd__optim_use_isa((shardd__isa)isa), SHARDD_OK);
    check_every_sum();
    float a[4] = {1.0f, __builtin_inff(), __builtin_nanf(""), 2.0f};
    float b[4] = {2.0f, -__builtin_inff(), 1.0f, __builtin_inff()};
    const void *s[2] = {a, b};
    float acc[4];
    shardd__reduce_sum(SHARDD_DTYPE_FP32, acc, s, 2, 4, 0);
    cr_assert(acc[0] == 3.0f && __builtin_isnan(acc[1]) &&
                  __builtin_isnan(acc[2]) && acc[3] == __builtin_inff(),
              "path %s", shardd__isa_name((shardd__isa)isa));
    ran++;
  }
  cr_assert_geq(ran, 1, "the portable path at least");
  cr_assert_eq(shardd__optim_use_isa(was), SHARDD_OK);
}

Test(reduce, no_source_leaves_the_accumulator) {
  float acc[3] = {1.5f, -2.0f, 7.0f};
  shardd__reduce_sum(SHARDD_DTYPE_FP32, acc, NULL, 0, 3, 0);
  cr_assert(acc[0] == 1.5f && acc[1] == -2.0f && acc[2] == 7.0f);
}

/* A NaN or an infinity of one rank is in the sum, as one addition at a
 * time has it. */
Test(reduce, nan_and_inf_propagate) {
  float a[4] = {1.0f, __builtin_inff(), __builtin_nanf(""), 2.0f};
  float b[4] = {2.0f, -__builtin_inff(), 1.0f, __builtin_inff()};
  const void *s[2] = {a, b};
  float acc[4];
  shardd__reduce_sum(SHARDD_DTYPE_FP32, acc, s, 2, 4, 0);
  cr_assert(acc[0] == 3.0f);
  cr_assert(__builtin_isnan(acc[1]) && __builtin_isnan(acc[2]));
  cr_assert(acc[3] == __builtin_inff());
}

/* The host backend's reduce (sum / divisor) and reduce_add (acc + sum /
 * divisor) over regions, a scatter's shard slices of 8 ranks: more than
 * one block of the backend's, sources at offsets within their regions. */
static void check_backend(shardd_dtype dt, int nsrc, float divisor, int add) {
  char err[256];
  shardd__backend *be;
  cr_assert_eq(shardd__backend_host_create(1, 64u << 20, &be, err, sizeof err),
               SHARDD_OK, "%s", err);
  size_t n = 20000, esz = shardd_dtype_size(dt), off = 4096 + 12 * esz;
  shardd__region *src[8], *dst;
  size_t offs[8];
  void *raw[8];
  for (int k = 0; k < nsrc; k++) {
    cr_assert_eq(be->ops->alloc(be, 0, off + n * esz, "src", &src[k], err, sizeof err), SHARDD_OK);
    offs[k] = off;
    raw[k] = (char *)src[k]->ptr + off;
    fill(dt, raw[k], n);
  }
  cr_assert_eq(be->ops->alloc(be, 0, 8 + n * 4, "dst", &dst, err, sizeof err), SHARDD_OK);
  float *acc = (float *)((char *)dst->ptr + 8);
  float *start = malloc(n * sizeof *start), *want = malloc(n * sizeof *want);
  for (size_t i = 0; i < n; i++)
    acc[i] = start[i] = value();
  reference(dt, want, NULL, raw, nsrc, n);
  for (size_t i = 0; i < n; i++) {
    volatile float q = want[i] / divisor;
    want[i] = add ? start[i] + q : q;
  }
  cr_assert_eq((add ? be->ops->reduce_add : be->ops->reduce)(
                   be, dt, divisor, dst, 8, src, offs, nsrc, n),
               SHARDD_OK);
  for (size_t i = 0; i < n; i++)
    cr_assert(memcmp(&acc[i], &want[i], 4) == 0,
              "%s of dtype %d, %d sources, divisor %g: element %zu is %.9g, "
              "not %.9g", add ? "reduce_add" : "reduce", (int)dt, nsrc,
              (double)divisor, i, (double)acc[i], (double)want[i]);
  for (int k = 0; k < nsrc; k++)
    be->ops->free(be, src[k]);
  be->ops->free(be, dst);
  free(start);
  free(want);
  be->ops->destroy(be);
}

Test(reduce, host_backend_reduce_and_reduce_add) {
  static const shardd_dtype dts[] = {SHARDD_DTYPE_FP32, SHARDD_DTYPE_BF16,
                                     SHARDD_DTYPE_FP16};
  for (size_t d = 0; d < 3; d++)
    for (int nsrc = 1; nsrc <= 8; nsrc += 3)
      for (int add = 0; add < 2; add++) {
        check_backend(dts[d], nsrc, 1.0f, add);
        check_backend(dts[d], nsrc, (float)nsrc, add);
      }
}
