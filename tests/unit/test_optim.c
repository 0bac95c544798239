/* test_optim.c — the optimizer kernels against torch.optim 1.13 golden
 * vectors (tests/unit/optim_golden.h, from tests/gen/optim_golden.py), bit for
 * bit on every instruction-set path, the
 * bf16/fp16 conversions against torch's bit patterns, and the
 * hyperparameter defaults and range checks. */
#include <criterion/criterion.h>
#include <criterion/logging.h>
#include <criterion/parameterized.h>
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dtype.h"
#include "optim.h"
#include "optim_golden.h"

#define N OPTIM_GOLDEN_N

static float f32(uint32_t u) {
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

static uint32_t u32(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  return u;
}

/* Distance in representable floats; sign-magnitude mapped onto a line. */
static int64_t ulps(float a, float b) {
  int64_t x = (int32_t)u32(a), y = (int32_t)u32(b);
  if (x < 0)
    x = INT32_MIN - x;
  if (y < 0)
    y = INT32_MIN - y;
  return x > y ? x - y : y - x;
}

typedef struct {
  double rel;
  int64_t ulp;
} diff;

static void diff_add(diff *d, float got, float want) {
  cr_assert(isfinite(want));
  cr_assert(isfinite(got), "got %g, want %g", (double)got, (double)want);
  double rel = fabs((double)got - (double)want) /
               fmax(fabs((double)want), (double)FLT_MIN);
  if (rel > d->rel)
    d->rel = rel;
  int64_t u = ulps(got, want);
  if (u > d->ulp)
    d->ulp = u;
}

static shardd__hp case_hp(const optim_golden_case *c) {
  shardd__hp hp = {
      .kind = c->kind,
      .lr = c->lr,
      .momentum = c->momentum,
      .dampening = c->dampening,
      .weight_decay = c->weight_decay,
      .beta1 = c->beta1,
      .beta2 = c->beta2,
      .eps = c->eps,
      .nesterov = c->nesterov,
      .maximize = c->maximize,
      .amsgrad = c->amsgrad,
  };
  return hp;
}

/* Runs every step of case c, updating the array in pieces of chunk elements;
 * per_step (when not NULL) collects the distance to torch after each step. */
static void run_case(const optim_golden_case *c, float *param,
                     float state[3][N], size_t chunk, diff *per_step) {
  shardd__hp hp = case_hp(c);
  for (size_t i = 0; i < N; i++)
    param[i] = f32(optim_golden_param0[i]);
  for (int s = 0; s < 3; s++)
    for (size_t i = 0; i < N; i++)
      /* SGD's buffer must be ignored on step 1; Adam's starts at zero. */
      state[s][i] = c->kind == SHARDD_OPTIM_SGD ? NAN : 0.0f;
  float grad[N];
  for (int step = 0; step < OPTIM_GOLDEN_STEPS; step++) {
    for (size_t i = 0; i < N; i++)
      grad[i] = f32(optim_golden_grad[step][i]);
    for (size_t lo = 0; lo < N; lo += chunk) {
      size_t n = N - lo < chunk ? N - lo : chunk;
      float *st[3] = {state[0] + lo, state[1] + lo, state[2] + lo};
      shardd__optim_update(&hp, (uint64_t)step + 1, param + lo, grad + lo,
                           f32(c->grad_scale), st, n);
    }
    if (per_step)
      for (size_t i = 0; i < N; i++)
        diff_add(per_step, param[i], f32(c->param[step][i]));
  }
}

ParameterizedTestParameters(optim, golden) {
  static size_t idx[OPTIM_GOLDEN_NCASES];
  for (size_t i = 0; i < OPTIM_GOLDEN_NCASES; i++)
    idx[i] = i;
  return cr_make_param_array(size_t, idx, OPTIM_GOLDEN_NCASES);
}

ParameterizedTest(size_t *ci, optim, golden) {
  const optim_golden_case *c = &optim_golden_cases[*ci];
  shardd__hp hp = case_hp(c);
  char err[128];
  cr_assert_eq(shardd__hp_check(&hp, err, sizeof err), SHARDD_OK, "%s: %s",
               c->name, err);
  cr_assert_eq(shardd__optim_state_count(&hp), c->nstate, "%s", c->name);

  /* Bit for bit, on every path: the golden values are torch's AVX2
   * kernels', which fuse exactly the multiply-adds optim.c fuses (see
   * tests/gen/optim_golden.py); a path that rounded one of them twice, or
   * contracted another, is off by an ULP somewhere in 5 steps of 37. */
  shardd__isa was = shardd__optim_isa();
  for (int isa = 0; isa < SHARDD__ISA_COUNT; isa++) {
    if (!shardd__isa_runnable((shardd__isa)isa))
      continue;
    cr_assert_eq(shardd__optim_use_isa((shardd__isa)isa), SHARDD_OK);
    float param[N], state[3][N];
    diff dp = {0}, ds = {0};
    run_case(c, param, state, N, &dp);
    for (int s = 0; s < c->nstate; s++)
      for (size_t i = 0; i < N; i++)
        diff_add(&ds, state[s][i], f32(c->state[s][i]));
    cr_log_info("%-24s %-6s param max rel diff %.3g (%lld ulp), state %.3g "
                "(%lld ulp)",
                c->name, shardd__isa_name((shardd__isa)isa), dp.rel,
                (long long)dp.ulp, ds.rel, (long long)ds.ulp);
    cr_expect_eq(dp.ulp, 0, "%s (%s): param %lld ulp from torch (rel %g)",
                 c->name, shardd__isa_name((shardd__isa)isa),
                 (long long)dp.ulp, dp.rel);
    cr_expect_eq(ds.ulp, 0, "%s (%s): state %lld ulp from torch (rel %g)",
                 c->name, shardd__isa_name((shardd__isa)isa),
                 (long long)ds.ulp, ds.rel);
  }
  cr_assert_eq(shardd__optim_use_isa(was), SHARDD_OK);
}

/* A shard is updated in pieces of any length (threads, the vector loop's
 * tail): the pieces must agree bit for bit with one pass. */
ParameterizedTestParameters(optim, chunking_is_bit_exact) {
  static size_t idx[OPTIM_GOLDEN_NCASES];
  for (size_t i = 0; i < OPTIM_GOLDEN_NCASES; i++)
    idx[i] = i;
  return cr_make_param_array(size_t, idx, OPTIM_GOLDEN_NCASES);
}

ParameterizedTest(size_t *ci, optim, chunking_is_bit_exact) {
  const optim_golden_case *c = &optim_golden_cases[*ci];
  float whole[N], wstate[3][N];
  run_case(c, whole, wstate, N, NULL);
  static const size_t chunks[] = {1, 3, 5, 16};
  for (size_t k = 0; k < sizeof chunks / sizeof chunks[0]; k++) {
    float part[N], pstate[3][N];
    run_case(c, part, pstate, chunks[k], NULL);
    cr_assert_arr_eq(part, whole, sizeof part, "%s chunk %zu", c->name,
                     chunks[k]);
    for (int s = 0; s < c->nstate; s++)
      cr_assert_arr_eq(pstate[s], wstate[s], sizeof pstate[s],
                       "%s chunk %zu state %d", c->name, chunks[k], s);
  }
}

Test(optim, zero_length_is_a_noop) {
  shardd__hp hp;
  shardd__hp_defaults(SHARDD_OPTIM_ADAM, &hp);
  float *st[3] = {NULL, NULL, NULL};
  shardd__optim_update(&hp, 1, NULL, NULL, 1.0f, st, 0);
}

Test(optim, defaults_match_torch) {
  for (size_t i = 0; i < 3; i++) {
    const optim_golden_defaults *t = &optim_golden_default_hp[i];
    shardd__hp hp;
    memset(&hp, 0x5a, sizeof hp);
    shardd__hp_defaults(t->kind, &hp);
    cr_assert_eq(hp.kind, t->kind);
    cr_assert_eq(hp.lr, t->lr, "kind %d", t->kind);
    cr_assert_eq(hp.momentum, t->momentum, "kind %d", t->kind);
    cr_assert_eq(hp.dampening, t->dampening, "kind %d", t->kind);
    cr_assert_eq(hp.weight_decay, t->weight_decay, "kind %d", t->kind);
    cr_assert_eq(hp.beta1, t->beta1, "kind %d", t->kind);
    cr_assert_eq(hp.beta2, t->beta2, "kind %d", t->kind);
    cr_assert_eq(hp.eps, t->eps, "kind %d", t->kind);
    cr_assert_eq(hp.nesterov, t->nesterov, "kind %d", t->kind);
    cr_assert_eq(hp.maximize, t->maximize, "kind %d", t->kind);
    cr_assert_eq(hp.amsgrad, t->amsgrad, "kind %d", t->kind);
    cr_assert_eq(shardd__hp_check(&hp, NULL, 0), SHARDD_OK);
  }
}

typedef struct {
  shardd_optim_kind kind;
  /* Arrays, not pointers: Criterion may run each parameter in a fresh
   * process, where a pointer into this one's data means nothing. */
  char field[16]; /* which hp field gets value */
  double value;
  char want[48]; /* substring the message must hold */
} bad_hp;

static void set_field(shardd__hp *hp, const char *field, double v) {
  if (!strcmp(field, "lr"))
    hp->lr = v;
  else if (!strcmp(field, "momentum"))
    hp->momentum = v;
  else if (!strcmp(field, "dampening"))
    hp->dampening = v;
  else if (!strcmp(field, "weight_decay"))
    hp->weight_decay = v;
  else if (!strcmp(field, "beta1"))
    hp->beta1 = v;
  else if (!strcmp(field, "beta2"))
    hp->beta2 = v;
  else if (!strcmp(field, "eps"))
    hp->eps = v;
  else if (!strcmp(field, "nesterov"))
    hp->nesterov = (int)v;
  else if (!strcmp(field, "kind"))
    hp->kind = (shardd_optim_kind)(int)v;
  else
    cr_assert_fail("no field %s", field);
}

ParameterizedTestParameters(optim, hp_check_refuses) {
  static bad_hp t[] = {
      {SHARDD_OPTIM_SGD, "lr", -1.0, "lr = -1 is out of range [0, inf)"},
      {SHARDD_OPTIM_SGD, "lr", NAN, "lr = nan"},
      {SHARDD_OPTIM_ADAM, "lr", INFINITY, "lr = inf"},
      {SHARDD_OPTIM_ADAMW, "lr", -1e-9, "lr = -1e-09"},
      {SHARDD_OPTIM_SGD, "momentum", -0.1, "momentum = -0.1"},
      {SHARDD_OPTIM_SGD, "momentum", INFINITY, "momentum = inf"},
      {SHARDD_OPTIM_SGD, "dampening", NAN, "dampening = nan"},
      {SHARDD_OPTIM_SGD, "weight_decay", -1e-3, "weight_decay = -0.001"},
      {SHARDD_OPTIM_ADAM, "weight_decay", -1.0, "weight_decay = -1"},
      {SHARDD_OPTIM_ADAMW, "weight_decay", NAN, "weight_decay = nan"},
      {SHARDD_OPTIM_ADAM, "beta1", -0.1, "beta1 = -0.1 is out of range [0, 1)"},
      {SHARDD_OPTIM_ADAM, "beta1", 1.0, "beta1 = 1 is out of range [0, 1)"},
      {SHARDD_OPTIM_ADAMW, "beta1", NAN, "beta1 = nan"},
      {SHARDD_OPTIM_ADAM, "beta2", 1.0, "beta2 = 1 is out of range [0, 1)"},
      {SHARDD_OPTIM_ADAMW, "beta2", 1.5, "beta2 = 1.5"},
      {SHARDD_OPTIM_ADAM, "beta2", -INFINITY, "beta2 = -inf"},
      {SHARDD_OPTIM_ADAM, "eps", 0.0, "eps = 0 is out of range (0, inf)"},
      {SHARDD_OPTIM_ADAMW, "eps", -1e-8, "eps = -1e-08"},
      {SHARDD_OPTIM_ADAM, "eps", INFINITY, "eps = inf"},
      {SHARDD_OPTIM_ADAM, "eps", NAN, "eps = nan"},
      /* defaults have momentum 0: nesterov alone is refused */
      {SHARDD_OPTIM_SGD, "nesterov", 1, "nesterov requires momentum > 0"},
      {SHARDD_OPTIM_SGD, "kind", 0, "kind = 0"},
      {SHARDD_OPTIM_SGD, "kind", 99, "kind = 99"},
  };
  return cr_make_param_array(bad_hp, t, sizeof t / sizeof t[0]);
}

ParameterizedTest(bad_hp *b, optim, hp_check_refuses) {
  shardd__hp hp;
  shardd__hp_defaults(b->kind, &hp);
  set_field(&hp, b->field, b->value);
  char err[128];
  cr_assert_eq(shardd__hp_check(&hp, err, sizeof err), SHARDD_E_RANGE,
               "%s = %g accepted", b->field, b->value);
  cr_assert(strstr(err, b->want), "message \"%s\" lacks \"%s\"", err, b->want);
  cr_assert(strstr(err, b->field), "message \"%s\" does not name %s", err,
            b->field);
  /* No buffer, and a buffer too short for the message, are both safe. */
  cr_assert_eq(shardd__hp_check(&hp, NULL, 0), SHARDD_E_RANGE);
  char tiny[4];
  cr_assert_eq(shardd__hp_check(&hp, tiny, sizeof tiny), SHARDD_E_RANGE);
  cr_assert_eq(strlen(tiny), 3);
}

Test(optim, nesterov_needs_zero_dampening) {
  shardd__hp hp;
  shardd__hp_defaults(SHARDD_OPTIM_SGD, &hp);
  hp.nesterov = 1;
  hp.momentum = 0.9;
  cr_assert_eq(shardd__hp_check(&hp, NULL, 0), SHARDD_OK);
  hp.dampening = 0.1;
  char err[128];
  cr_assert_eq(shardd__hp_check(&hp, err, sizeof err), SHARDD_E_RANGE);
  cr_assert(strstr(err, "dampening = 0.1"), "%s", err);
}

Test(optim, hp_check_accepts_bounds) {
  shardd__hp hp;
  shardd__hp_defaults(SHARDD_OPTIM_ADAM, &hp);
  hp.lr = 0;
  hp.beta1 = 0;
  hp.beta2 = 0;
  hp.weight_decay = 0;
  hp.eps = 1e-300;
  char err[128] = "junk";
  cr_assert_eq(shardd__hp_check(&hp, err, sizeof err), SHARDD_OK, "%s", err);
  cr_assert_str_empty(err);
  /* SGD ignores the Adam fields; Adam ignores momentum and nesterov */
  shardd__hp_defaults(SHARDD_OPTIM_SGD, &hp);
  hp.eps = 0;
  hp.beta2 = 1;
  hp.dampening = -0.5; /* torch allows any dampening */
  cr_assert_eq(shardd__hp_check(&hp, err, sizeof err), SHARDD_OK, "%s", err);
}

Test(optim, supports_and_state_count) {
  static const shardd_optim_kind kinds[] = {
      SHARDD_OPTIM_SGD, SHARDD_OPTIM_ADAM, SHARDD_OPTIM_ADAMW};
  static const shardd_dtype dtypes[] = {SHARDD_DTYPE_FP32, SHARDD_DTYPE_BF16,
                                        SHARDD_DTYPE_FP16};
  for (size_t k = 0; k < 3; k++) {
    for (size_t d = 0; d < 3; d++)
      cr_assert(shardd__optim_supports(kinds[k], dtypes[d]));
    cr_assert_not(shardd__optim_supports(kinds[k], (shardd_dtype)0));
    cr_assert_not(shardd__optim_supports(kinds[k], (shardd_dtype)4));
  }
  cr_assert_not(shardd__optim_supports((shardd_optim_kind)0,
                                       SHARDD_DTYPE_FP32));
  shardd__hp hp;
  shardd__hp_defaults(SHARDD_OPTIM_SGD, &hp);
  cr_assert_eq(shardd__optim_state_count(&hp), 0);
  hp.momentum = 0.9;
  cr_assert_eq(shardd__optim_state_count(&hp), 1);
  shardd__hp_defaults(SHARDD_OPTIM_ADAM, &hp);
  cr_assert_eq(shardd__optim_state_count(&hp), 2);
  hp.amsgrad = 1;
  cr_assert_eq(shardd__optim_state_count(&hp), 3);
  shardd__hp_defaults(SHARDD_OPTIM_ADAMW, &hp);
  cr_assert_eq(shardd__optim_state_count(&hp), 2);
  hp.amsgrad = 1;
  cr_assert_eq(shardd__optim_state_count(&hp), 3);
}

Test(optim, sumsq) {
  cr_assert_eq(shardd__sumsq_f32(NULL, 0), 0.0);
  /* small integers: every partial sum is exact, whatever the order */
  float g[23];
  for (size_t n = 1; n <= 23; n++) {
    double want = 0;
    for (size_t i = 0; i < n; i++) {
      g[i] = (float)((int)i - 11);
      want += (double)(((int)i - 11) * ((int)i - 11));
    }
    cr_assert_eq(shardd__sumsq_f32(g, n), want, "n %zu", n);
  }
  /* addends float accumulation would lose entirely (1 + 1e-10 == 1 in
   * float); double keeps them to ~1e-14 */
  static float big[1001];
  big[0] = 1.0f;
  for (size_t i = 1; i < 1001; i++)
    big[i] = 1e-5f;
  double want = 1.0 + 1000.0 * (double)1e-5f * (double)1e-5f;
  cr_assert_float_eq(shardd__sumsq_f32(big, 1001), want, 1e-12);
}

static int bf16_is_nan(uint16_t h) {
  return (h & 0x7f80u) == 0x7f80u && (h & 0x7fu) != 0;
}
static int fp16_is_nan(uint16_t h) {
  return (h & 0x7c00u) == 0x7c00u && (h & 0x3ffu) != 0;
}

Test(optim, conversions_match_torch) {
  enum { M = OPTIM_GOLDEN_NCONV };
  float src[M], back[M];
  uint16_t h[M];
  for (size_t i = 0; i < M; i++)
    src[i] = f32(optim_golden_conv_f32[i]);

  shardd__from_f32(SHARDD_DTYPE_BF16, h, src, M);
  for (size_t i = 0; i < M; i++) {
    if (isnan(src[i]))
      cr_assert(bf16_is_nan(h[i]), "bf16 of NaN 0x%08x is 0x%04x",
                optim_golden_conv_f32[i], h[i]);
    else
      cr_assert_eq(h[i], optim_golden_conv_bf16[i],
                   "bf16 of 0x%08x: 0x%04x, torch 0x%04x",
                   optim_golden_conv_f32[i], h[i], optim_golden_conv_bf16[i]);
  }
  shardd__to_f32(SHARDD_DTYPE_BF16, back, optim_golden_conv_bf16, M);
  for (size_t i = 0; i < M; i++) {
    if (isnan(src[i]))
      cr_assert(isnan(back[i]));
    else
      cr_assert_eq(u32(back[i]), optim_golden_conv_bf16_f32[i],
                   "fp32 of bf16 0x%04x", optim_golden_conv_bf16[i]);
  }

  shardd__from_f32(SHARDD_DTYPE_FP16, h, src, M);
  for (size_t i = 0; i < M; i++) {
    if (isnan(src[i]))
      cr_assert(fp16_is_nan(h[i]), "fp16 of NaN 0x%08x is 0x%04x",
                optim_golden_conv_f32[i], h[i]);
    else
      cr_assert_eq(h[i], optim_golden_conv_fp16[i],
                   "fp16 of 0x%08x: 0x%04x, torch 0x%04x",
                   optim_golden_conv_f32[i], h[i], optim_golden_conv_fp16[i]);
  }
  shardd__to_f32(SHARDD_DTYPE_FP16, back, optim_golden_conv_fp16, M);
  for (size_t i = 0; i < M; i++) {
    if (isnan(src[i]))
      cr_assert(isnan(back[i]));
    else
      cr_assert_eq(u32(back[i]), optim_golden_conv_fp16_f32[i],
                   "fp32 of fp16 0x%04x", optim_golden_conv_fp16[i]);
  }

  shardd__to_f32(SHARDD_DTYPE_FP32, back, src, M);
  cr_assert_arr_eq(back, src, sizeof src);
  shardd__from_f32(SHARDD_DTYPE_FP32, back, src, M);
  cr_assert_arr_eq(back, src, sizeof src);
}

/* Every 16-bit pattern survives the trip through fp32 (NaN stays NaN). */
Test(optim, all_16bit_patterns_round_trip) {
  enum { M = 65536 };
  static uint16_t in[M], out[M];
  static float mid[M];
  for (size_t i = 0; i < M; i++)
    in[i] = (uint16_t)i;
  static const shardd_dtype dt[] = {SHARDD_DTYPE_BF16, SHARDD_DTYPE_FP16};
  for (size_t d = 0; d < 2; d++) {
    shardd__to_f32(dt[d], mid, in, M);
    shardd__from_f32(dt[d], out, mid, M);
    for (size_t i = 0; i < M; i++) {
      int nan = dt[d] == SHARDD_DTYPE_BF16 ? bf16_is_nan(in[i])
                                           : fp16_is_nan(in[i]);
      if (nan) {
        cr_assert(isnan(mid[i]));
        cr_assert(dt[d] == SHARDD_DTYPE_BF16 ? bf16_is_nan(out[i])
                                             : fp16_is_nan(out[i]));
      } else {
        cr_assert_eq(out[i], in[i], "dtype %d 0x%04zx -> %a -> 0x%04x",
                     dt[d], i, (double)mid[i], out[i]);
      }
    }
  }
}

/* The array conversions agree with dtype.h's scalar ones over a sweep of
 * fp32 patterns spread across every exponent (the full 2^32 agreed when
 * checked by hand; this keeps a cheap version of that). */
Test(optim, conversions_match_dtype_h) {
  enum { M = 1 << 16 };
  static float src[M];
  static uint16_t h[M];
  uint32_t u = 12345u;
  for (int round = 0; round < 64; round++) {
    for (size_t i = 0; i < M; i++, u += 1021u) /* 2^22 patterns, 1021 apart */
      src[i] = f32(u);
    shardd__from_f32(SHARDD_DTYPE_FP16, h, src, M);
    for (size_t i = 0; i < M; i++) {
      if (isnan(src[i]))
        cr_assert(fp16_is_nan(h[i]));
      else
        cr_assert_eq(h[i], shardd__f32_to_f16(src[i]), "fp16 of 0x%08x",
                     u32(src[i]));
    }
    shardd__from_f32(SHARDD_DTYPE_BF16, h, src, M);
    for (size_t i = 0; i < M; i++)
      cr_assert_eq(h[i], shardd__f32_to_bf16(src[i]), "bf16 of 0x%08x",
                   u32(src[i]));
  }
  static uint16_t all[M];
  static float f[M];
  for (size_t i = 0; i < M; i++)
    all[i] = (uint16_t)i;
  shardd__to_f32(SHARDD_DTYPE_FP16, f, all, M);
  for (size_t i = 0; i < M; i++) {
    float want = shardd__f16_to_f32(all[i]);
    if (isnan(want))
      cr_assert(isnan(f[i]));
    else
      cr_assert_eq(u32(f[i]), u32(want), "fp32 of fp16 0x%04zx", i);
  }
}

/* ---- instruction-set paths ---------------------------------------------- */

/* Every path must give the scalar path's bits on every input: these run the
 * same arrays through SHARDD__ISA_SCALAR and the path under test and compare
 * with memcmp (NaN payloads included). A path this machine cannot run is
 * skipped, not passed. */

static uint64_t rng_state;

static uint32_t rng32(void) {
  /* xorshift64*: a fixed sequence, so a failure reproduces */
  rng_state ^= rng_state >> 12;
  rng_state ^= rng_state << 25;
  rng_state ^= rng_state >> 27;
  return (uint32_t)((rng_state * 0x2545F4914F6CDD1DULL) >> 32);
}

static float rng_uniform(float lo, float hi) {
  return lo + (hi - lo) * (float)(rng32() >> 8) * 0x1.0p-24f;
}

/* The input classes: NaNs (quiet and signalling, both signs, payloads),
 * infinities, signed zeros, subnormals, the float extremes, and values
 * whose bf16 or fp16 rounding is an exact tie (to even, either way) or
 * lands on fp16's overflow or subnormal edges. */
static const uint32_t special_bits[] = {
    0x7fc00000u, 0xffc00000u, 0x7fc12345u, 0xff812345u, 0x7f800001u,
    0xff800001u, 0x7fbfffffu, 0x7f800000u, 0xff800000u, 0x00000000u,
    0x80000000u, 0x00000001u, 0x80000001u, 0x007fffffu, 0x807fffffu,
    0x00400000u, 0x00800000u, 0x80800000u, 0x7f7fffffu, 0xff7fffffu,
    0x3f808000u, 0x3f818000u, 0xbf808000u, 0x3f807fffu, 0x3f808001u,
    0x7f7f8000u, 0x00008000u, 0x00018000u, 0x3f801000u, 0x3f803000u,
    0x477ff000u, 0x477fefffu, 0xc77ff000u, 0x477fe000u, 0x33000000u,
    0x33400000u, 0x33c00000u, 0x387fc000u, 0x38800000u, 0x337fffffu,
};
#define NSPECIAL (sizeof special_bits / sizeof special_bits[0])

/* Mostly ordinary values of magnitude ~scale, one in four from the classes
 * above, one in sixteen random bits. */
static void fill_mixed(float *a, size_t n, float scale, int nonneg) {
  for (size_t i = 0; i < n; i++) {
    uint32_t r = rng32() & 15;
    if (r < 4)
      a[i] = f32(special_bits[rng32() % NSPECIAL]);
    else if (r == 4)
      a[i] = f32(rng32());
    else
      a[i] = rng_uniform(nonneg ? 0.0f : -scale, scale);
  }
}

static void use_isa_or_skip(shardd__isa isa) {
  if (!shardd__isa_runnable(isa))
    cr_skip_test("this build or CPU cannot run the %s path",
                 shardd__isa_name(isa));
  cr_assert_eq(shardd__optim_use_isa(isa), SHARDD_OK);
}

#define PN 1031 /* not a multiple of any vector width: epilogues run */

typedef struct {
  float p[PN], g[PN], st[3][PN];
} optim_arrays;

/* Whether element i of a step's inputs holds a NaN or an infinity. */
static int nonfinite_input(const optim_arrays *in, size_t i) {
  if (!isfinite(in->p[i]) || !isfinite(in->g[i]))
    return 1;
  for (int s = 0; s < 3; s++)
    if (!isfinite(in->st[s][i]))
      return 1;
  return 0;
}

/* got must equal want bit for bit, with one exception IEEE 754 leaves open:
 * where an element's inputs hold a NaN or an infinity, two NaNs (given, or
 * made from inf - inf) can meet in one operation, and which one comes out
 * depends on the operand order the compiler picked for that commutative
 * operation, so both results must be NaN but their payloads may differ.
 * The scalar path already does this to itself: Adam with p = a qNaN and
 * g = an sNaN gives p's payload in its SSE2 loop body and g's in its scalar
 * epilogue. */
static void check_same(shardd__isa isa, const char *what, uint64_t step,
                       int s, const float *got, const float *want,
                       const optim_arrays *in) {
  for (size_t i = 0; i < PN; i++) {
    if (u32(got[i]) == u32(want[i]))
      continue;
    int nan_pair = isnan(got[i]) && isnan(want[i]) && nonfinite_input(in, i);
    cr_assert(nan_pair,
              "%s %s step %d %s%d[%zu]: 0x%08x, scalar 0x%08x (%g)",
              shardd__isa_name(isa), what, (int)step,
              s < 0 ? "param" : "state", s, i, u32(got[i]), u32(want[i]),
              (double)want[i]);
  }
}

/* Three steps of hp on the same arrays, over [off, off + n), through the
 * scalar path and through isa; every array compared after each step. */
static void compare_steps(shardd__isa isa, const shardd__hp *hp, size_t off,
                          size_t n, const char *what) {
  static optim_arrays ref, got;
  int ns = shardd__optim_state_count(hp);
  fill_mixed(ref.p, PN, 1.0f, 0);
  for (int s = 0; s < 3; s++)
    fill_mixed(ref.st[s], PN, 1e-2f, s > 0);
  got = ref;
  static optim_arrays in; /* the inputs of the step being compared */
  in = ref;
  static const float scales[3] = {1.0f, 0.5f, 3.0f};
  for (uint64_t step = 1; step <= 3; step++) {
    fill_mixed(ref.g, PN, 1e-2f, 0);
    memcpy(got.g, ref.g, sizeof ref.g);
    memcpy(in.g, ref.g, sizeof ref.g);
    float *rs[3] = {ref.st[0] + off, ref.st[1] + off, ref.st[2] + off};
    float *gs[3] = {got.st[0] + off, got.st[1] + off, got.st[2] + off};
    cr_assert_eq(shardd__optim_use_isa(SHARDD__ISA_SCALAR), SHARDD_OK);
    shardd__optim_update(hp, step, ref.p + off, ref.g + off,
                         scales[step - 1], rs, n);
    cr_assert_eq(shardd__optim_use_isa(isa), SHARDD_OK);
    shardd__optim_update(hp, step, got.p + off, got.g + off,
                         scales[step - 1], gs, n);
    check_same(isa, what, step, -1, got.p, ref.p, &in);
    for (int s = 0; s < ns; s++)
      check_same(isa, what, step, s, got.st[s], ref.st[s], &in);
    in = ref;
  }
}

static void compare_all_optimizers(shardd__isa isa) {
  use_isa_or_skip(isa);
  rng_state = 0x9e3779b97f4a7c15ULL + (uint64_t)isa;
  /* momentum, dampening, weight_decay, nesterov */
  static const double sgd[][4] = {
      {0, 0, 0, 0},    {0, 0, 1e-2, 0},    {0.9, 0, 0, 0},
      {0.9, 0.1, 1e-2, 0}, {0.9, 0, 0, 1}, {0.9, 0, 1e-2, 1},
  };
  char what[128];
  for (int maximize = 0; maximize <= 1; maximize++) {
    for (size_t c = 0; c < sizeof sgd / sizeof sgd[0]; c++) {
      shardd__hp hp;
      shardd__hp_defaults(SHARDD_OPTIM_SGD, &hp);
      hp.lr = 0.1;
      hp.momentum = sgd[c][0];
      hp.dampening = sgd[c][1];
      hp.weight_decay = sgd[c][2];
      hp.nesterov = (int)sgd[c][3];
      hp.maximize = maximize;
      cr_assert_eq(shardd__hp_check(&hp, NULL, 0), SHARDD_OK);
      snprintf(what, sizeof what, "sgd m=%g d=%g wd=%g nesterov=%d max=%d",
               hp.momentum, hp.dampening, hp.weight_decay, hp.nesterov,
               maximize);
      compare_steps(isa, &hp, 0, PN, what);
      compare_steps(isa, &hp, 3, PN - 7, what); /* unaligned starts */
    }
    static const shardd_optim_kind adam[] = {SHARDD_OPTIM_ADAM,
                                             SHARDD_OPTIM_ADAMW};
    for (int a = 0; a < 2; a++)
      for (int wd = 0; wd <= 1; wd++)
        for (int ams = 0; ams <= 1; ams++) {
          shardd__hp hp;
          shardd__hp_defaults(adam[a], &hp);
          hp.lr = 1e-2;
          hp.weight_decay = wd ? 0.1 : 0.0;
          hp.amsgrad = ams;
          hp.maximize = maximize;
          snprintf(what, sizeof what, "%s wd=%g amsgrad=%d max=%d",
                   a ? "adamw" : "adam", hp.weight_decay, ams, maximize);
          compare_steps(isa, &hp, 0, PN, what);
          compare_steps(isa, &hp, 3, PN - 7, what);
        }
  }
}

/* Widening every 16-bit pattern; narrowing every float whose low bits make
 * a bf16 tie, or an fp16 tie or its neighbours (all exponents and signs, so
 * subnormal, overflow and NaN edges too), then random floats. */
static void compare_conversions(shardd__isa isa) {
  use_isa_or_skip(isa);
  static const shardd_dtype dts[] = {SHARDD_DTYPE_FP32, SHARDD_DTYPE_BF16,
                                     SHARDD_DTYPE_FP16};
  size_t n16 = 65536 + 5;
  uint16_t *h = malloc(n16 * 2);
  float *w[2] = {malloc(n16 * 4), malloc(n16 * 4)};
  cr_assert(h && w[0] && w[1]);
  for (size_t i = 0; i < n16; i++)
    h[i] = (uint16_t)i;
  for (int d = 1; d < 3; d++) {
    for (int k = 0; k < 2; k++) {
      cr_assert_eq(shardd__optim_use_isa(k ? isa : SHARDD__ISA_SCALAR),
                   SHARDD_OK);
      shardd__to_f32(dts[d], w[k], h, n16);
    }
    cr_assert_arr_eq(w[1], w[0], n16 * 4, "%s widening %s",
                     shardd__isa_name(isa), shardd_dtype_name(dts[d]));
  }
  static const uint32_t bf16_low[] = {0x0000, 0x0001, 0x7fff, 0x8000,
                                      0x8001, 0xffff};
  static const uint32_t fp16_low[] = {0x0000, 0x0fff, 0x1000, 0x1001};
  size_t nb = 65536 * 6, nh = ((size_t)1 << 19) * 4, nr = (size_t)1 << 18;
  size_t nf = nb + nh + nr;
  float *f = malloc(nf * 4);
  uint32_t *out[2] = {malloc(nf * 4), malloc(nf * 4)};
  cr_assert(f && out[0] && out[1]);
  size_t j = 0;
  for (uint32_t hi = 0; hi < 65536; hi++)
    for (size_t l = 0; l < 6; l++)
      f[j++] = f32(hi << 16 | bf16_low[l]);
  for (uint32_t hi = 0; hi < (1u << 19); hi++)
    for (size_t l = 0; l < 4; l++)
      f[j++] = f32(hi << 13 | fp16_low[l]);
  rng_state = 0x243f6a8885a308d3ULL;
  while (j < nf)
    f[j++] = f32(rng32());
  for (int d = 0; d < 3; d++) {
    size_t esz = shardd_dtype_size(dts[d]);
    for (int k = 0; k < 2; k++) {
      cr_assert_eq(shardd__optim_use_isa(k ? isa : SHARDD__ISA_SCALAR),
                   SHARDD_OK);
      memset(out[k], 0xa5, nf * 4);
      /* an odd start and length, so peeled and epilogue elements run */
      shardd__from_f32(dts[d], (char *)out[k] + esz, f + 1, nf - 2);
    }
    cr_assert_arr_eq(out[1], out[0], nf * 4, "%s narrowing to %s",
                     shardd__isa_name(isa), shardd_dtype_name(dts[d]));
  }
  free(f);
  free(out[0]);
  free(out[1]);
  free(h);
  free(w[0]);
  free(w[1]);
}

static void compare_sumsq(shardd__isa isa) {
  use_isa_or_skip(isa);
  static float g[PN];
  rng_state = 0x13198a2e03707344ULL;
  for (int rep = 0; rep < 4; rep++) {
    /* rep 0 ordinary values only; later ones add every class above */
    for (size_t i = 0; i < PN; i++)
      g[i] = rng_uniform(-1e-2f, 1e-2f);
    if (rep > 0)
      fill_mixed(g, PN, 1e-2f, 0);
    for (size_t off = 0; off < 9; off++)
      for (size_t n = 0; n + off <= PN; n += n < 40 ? 1 : 97) {
        cr_assert_eq(shardd__optim_use_isa(SHARDD__ISA_SCALAR), SHARDD_OK);
        double want = shardd__sumsq_f32(g + off, n);
        cr_assert_eq(shardd__optim_use_isa(isa), SHARDD_OK);
        double got = shardd__sumsq_f32(g + off, n);
        /* a NaN sum only comes from a NaN input; which of several NaNs
         * survives is open, as in check_same (seen at -O1) */
        cr_assert(memcmp(&got, &want, sizeof got) == 0 ||
                      (isnan(got) && isnan(want)),
                  "%s sumsq rep %d off %zu n %zu: %a, scalar %a",
                  shardd__isa_name(isa), rep, off, n, got, want);
      }
  }
}

#define NN (2 * 2048 + 45) /* blocks of shardd__optim_update_narrow, and a tail */

typedef struct {
  float p[NN], g[NN], st[3][NN];
  uint32_t p16[NN]; /* the parameter, room for any dtype */
} narrow_arrays;

/* shardd__optim_update_narrow on isa against shardd__optim_update then
 * shardd__from_f32 on the scalar path, over 3 steps: the master and state
 * as check_same compares them, the 16-bit parameter as exactly the
 * narrowing of the master it came with. */
static void compare_narrow(shardd__isa isa) {
  use_isa_or_skip(isa);
  rng_state = 0xa4093822299f31d0ULL + (uint64_t)isa;
  static narrow_arrays ref, got, in;
  static uint32_t want16[NN];
  static const shardd_dtype dts[] = {SHARDD_DTYPE_BF16, SHARDD_DTYPE_FP16,
                                     SHARDD_DTYPE_FP32};
  static const shardd_optim_kind kinds_[] = {SHARDD_OPTIM_SGD,
                                             SHARDD_OPTIM_ADAMW};
  for (int d = 0; d < 3; d++)
    for (int kk = 0; kk < 2; kk++) {
      shardd__hp hp;
      shardd__hp_defaults(kinds_[kk], &hp);
      hp.momentum = kk ? 0 : 0.9;
      hp.amsgrad = kk;
      hp.weight_decay = 1e-2;
      int ns = shardd__optim_state_count(&hp);
      fill_mixed(ref.p, NN, 1.0f, 0);
      for (int s = 0; s < 3; s++)
        fill_mixed(ref.st[s], NN, 1e-2f, s > 0);
      memset(ref.p16, 0, sizeof ref.p16);
      got = ref;
      for (uint64_t step = 1; step <= 3; step++) {
        fill_mixed(ref.g, NN, 1e-2f, 0);
        memcpy(got.g, ref.g, sizeof ref.g);
        in = ref;
        size_t off = step - 1, n = NN - 2 * off; /* starts 0, 1, 2 */
        float *rs[3] = {ref.st[0] + off, ref.st[1] + off, ref.st[2] + off};
        float *gs[3] = {got.st[0] + off, got.st[1] + off, got.st[2] + off};
        size_t esz = shardd_dtype_size(dts[d]);
        cr_assert_eq(shardd__optim_use_isa(SHARDD__ISA_SCALAR), SHARDD_OK);
        shardd__optim_update(&hp, step, ref.p + off, ref.g + off, 0.5f, rs, n);
        cr_assert_eq(shardd__optim_use_isa(isa), SHARDD_OK);
        shardd__optim_update_narrow(&hp, step, dts[d],
                                    (char *)got.p16 + off * esz, got.p + off,
                                    got.g + off, 0.5f, gs, n);
        cr_assert_eq(shardd__optim_use_isa(SHARDD__ISA_SCALAR), SHARDD_OK);
        memcpy(want16, got.p16, sizeof want16); /* outside the window */
        shardd__from_f32(dts[d], (char *)want16 + off * esz, got.p + off, n);
        cr_assert_arr_eq(got.p16, want16, sizeof want16,
                         "%s narrow %s kind %d step %d: param is not the "
                         "narrowed master", shardd__isa_name(isa),
                         shardd_dtype_name(dts[d]), (int)kinds_[kk], (int)step);
        /* check_same's inputs are optim_arrays of PN elements: compare the
         * NN elements in windows of PN */
        for (size_t w = 0; w < NN; w += PN) {
          static optim_arrays wi;
          size_t len = NN - w < PN ? NN - w : PN;
          memset(&wi, 0, sizeof wi);
          memcpy(wi.p, in.p + w, len * 4);
          memcpy(wi.g, in.g + w, len * 4);
          for (int s = 0; s < 3; s++)
            memcpy(wi.st[s], in.st[s] + w, len * 4);
          static float gw[PN], rw[PN];
          memset(gw, 0, sizeof gw);
          memset(rw, 0, sizeof rw);
          memcpy(gw, got.p + w, len * 4);
          memcpy(rw, ref.p + w, len * 4);
          check_same(isa, "narrow", step, -1, gw, rw, &wi);
          for (int s = 0; s < ns; s++) {
            memcpy(gw, got.st[s] + w, len * 4);
            memcpy(rw, ref.st[s] + w, len * 4);
            check_same(isa, "narrow", step, s, gw, rw, &wi);
          }
        }
      }
    }
}

/* shardd__optim_adopt on isa against the rule written with dtype.h's own
 * conversions: where the 16-bit param is not the master's rounding (every
 * fifth element here, any bit pattern, NaNs included) the master becomes
 * the param widened; elsewhere it keeps its bits, special values included. */
static void compare_adopt(shardd__isa isa) {
  use_isa_or_skip(isa);
  rng_state = 0x6c8e9cf570932bd5ULL + (uint64_t)isa;
  enum { AN = 4099 };
  static float m[AN], want[AN];
  static uint16_t p16[AN];
  static const float special[] = {INFINITY, -INFINITY, NAN, 0x1p-149f, -0.0f,
                                  3.0e38f, 0x1p-126f, 65520.0f, 1.0f + 0x1p-8f};
  static const shardd_dtype dts[] = {SHARDD_DTYPE_BF16, SHARDD_DTYPE_FP16};
  for (int d = 0; d < 2; d++)
    for (size_t off = 0; off < 3; off++) {
      size_t adopted = 0, n = AN - 2 * off;
      for (size_t i = 0; i < AN; i++) {
        m[i] = i % 97 < 9 ? special[i % 97] : rng_uniform(-4.0f, 4.0f);
        uint16_t own = dts[d] == SHARDD_DTYPE_BF16 ? shardd__f32_to_bf16(m[i])
                                                   : shardd__f32_to_f16(m[i]);
        p16[i] = i % 5 == 2 ? (uint16_t)rng32() : own;
        float w = dts[d] == SHARDD_DTYPE_BF16 ? shardd__bf16_to_f32(p16[i])
                                              : shardd__f16_to_f32(p16[i]);
        int in = i >= off && i < off + n;
        want[i] = in && p16[i] != own ? w : m[i];
        adopted += in && p16[i] != own;
      }
      shardd__optim_adopt(dts[d], m + off, p16 + off, n);
      for (size_t i = 0; i < AN; i++) {
        uint32_t a, b;
        memcpy(&a, &m[i], 4);
        memcpy(&b, &want[i], 4);
        cr_assert_eq(a, b, "%s adopt %s off %zu [%zu]: 0x%08x, want 0x%08x",
                     shardd__isa_name(isa), shardd_dtype_name(dts[d]), off, i,
                     a, b);
      }
      cr_assert(adopted > n / 8, "only %zu adopted", adopted);
    }
  cr_assert_eq(shardd__optim_use_isa(SHARDD__ISA_SCALAR), SHARDD_OK);
}

Test(optim_isa, scalar_adopt_matches_rule) { compare_adopt(SHARDD__ISA_SCALAR); }

Test(optim_isa, scalar_narrow_matches_update) {
  compare_narrow(SHARDD__ISA_SCALAR);
}

#define ISA_TESTS(name, isa)                                                  \
  Test(optim_isa, name##_optimizers_match_scalar) {                           \
    compare_all_optimizers(isa);                                              \
  }                                                                           \
  Test(optim_isa, name##_conversions_match_scalar) {                          \
    compare_conversions(isa);                                                 \
  }                                                                           \
  Test(optim_isa, name##_sumsq_matches_scalar) { compare_sumsq(isa); }     \
  Test(optim_isa, name##_narrow_matches_scalar) { compare_narrow(isa); }      \
  Test(optim_isa, name##_adopt_matches_rule) { compare_adopt(isa); }

ISA_TESTS(avx2, SHARDD__ISA_AVX2)
ISA_TESTS(avx512, SHARDD__ISA_AVX512)

Test(optim_isa, dispatch_picks_widest_runnable) {
  cr_assert(shardd__isa_runnable(SHARDD__ISA_SCALAR));
  shardd__isa best = SHARDD__ISA_SCALAR;
  for (int i = 0; i < SHARDD__ISA_COUNT; i++)
    if (shardd__isa_runnable((shardd__isa)i))
      best = (shardd__isa)i;
  cr_assert_eq(shardd__optim_isa(), best, "in use %s, widest %s",
               shardd__isa_name(shardd__optim_isa()), shardd__isa_name(best));
  cr_assert_eq(shardd__optim_use_isa(SHARDD__ISA_COUNT), SHARDD_E_INVAL);
  cr_assert_eq(shardd__optim_use_isa((shardd__isa)-1), SHARDD_E_INVAL);
  cr_assert_eq(shardd__optim_isa(), best);
  for (int i = 0; i < SHARDD__ISA_COUNT; i++)
    if (!shardd__isa_runnable((shardd__isa)i))
      cr_assert_eq(shardd__optim_use_isa((shardd__isa)i), SHARDD_E_INVAL);
  cr_assert_eq(shardd__optim_use_isa(SHARDD__ISA_SCALAR), SHARDD_OK);
  cr_assert_eq(shardd__optim_isa(), SHARDD__ISA_SCALAR);
  cr_assert_str_eq(shardd__isa_name(SHARDD__ISA_AVX512), "avx512");
  cr_assert_str_eq(shardd__isa_name(SHARDD__ISA_COUNT), "unknown");
}
