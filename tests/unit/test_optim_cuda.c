/* test_optim_cuda.c — the cuda kernels' per-element arithmetic, run on the
 * host against the host kernels bit for bit. optim_elem.h and dtype.h are
 * the very code optim_cuda.cu runs per element (hostdev.h maps its rounding
 * intrinsics to the same IEEE operations here), so this checks the kernels'
 * numerics on machines without a GPU: every optimizer kind and flag
 * combination, fp32/bf16/fp16 params over several steps against optim.c,
 * reduce against backend_host, widening and narrowing against optim.c's
 * array conversions, special values included.
 *
 * The "kernel" loops below are the kernels' loops with the CUDA parts taken
 * out: vector groups (V elements, 16-bit words unpacked and packed as the
 * vector loads do) then a scalar tail, each element through the shared
 * functions. What this cannot check: NaN payloads out of float arithmetic,
 * which sm_90 canonicalises (see hostdev.h), and the memory plumbing of the
 * kernels (tests/unit/test_backend_cuda.c does that on a GPU). */

/* As optim.c: contracting any a*b+c into an FMA here would test other
 * numerics than the device's intrinsics (separately rounded, and
 * __fmaf_rn exactly where the host has fmaf). Before the includes so the
 * inline element functions are covered. */
#if defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

#include <criterion/criterion.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "dtype.h"
#include "optim.h"
#include "optim_cuda.h"
#include "optim_elem.h"

/* One value for every test of this binary (house rule). */
#define TMO 60


/* xorshift64*: the same data on every run and machine */
static uint64_t rng_state;

static void rng_seed(uint64_t s) { rng_state = s * 0x9e3779b97f4a7c15ull + 1; }

static uint32_t rng32(void) {
  rng_state ^= rng_state >> 12;
  rng_state ^= rng_state << 25;
  rng_state ^= rng_state >> 27;
  return (uint32_t)((rng_state * 0x2545f4914f6cdd1dull) >> 32);
}

/* A non-zero finite float, random sign and mantissa, exponent in
 * [2^lo, 2^hi): full mantissas make every operation round. */
static float rnd(int lo, int hi) {
  uint32_t e = (uint32_t)(127 + lo + (int)(rng32() % (uint32_t)(hi - lo)));
  return shardd__bits_f32((rng32() & 0x80000000u) | (e << 23) | (rng32() & 0x7fffffu));
}

static const char *dt_name(int dt) {
  return dt == SHARDD__ELEM_F32 ? "fp32" : dt == SHARDD__ELEM_BF16 ? "bf16"
                                                                 : "fp16";
}

/* ---- the kernels' loops over the shared element functions -------------- */

/* widen_kernel: dst (fp32) = src (16-bit), 8 elements (four 32-bit words)
 * per vector group. */
static void kern_widen(int dt, float *dst, const void *src, size_t n) {
  size_t nvec = n / 8;
  for (size_t j = 0; j < nvec; j++)
    for (int q = 0; q < 4; q++) {
      uint32_t w;
      memcpy(&w, (const char *)src + (j * 4 + (size_t)q) * 4, 4);
      shardd__elem_unpack2(dt, w, &dst[j * 8 + 2 * (size_t)q],
                           &dst[j * 8 + 2 * (size_t)q + 1]);
    }
  for (size_t i = nvec * 8; i < n; i++)
    dst[i] = shardd__elem_load(dt, src, i);
}

/* Group j of V elements of a dtype array, as loadv reads it. */
static void kern_loadv(int dt, const void *base, size_t j, float *out) {
  if (dt == SHARDD__ELEM_F32) {
    for (int e = 0; e < 4; e++)
      out[e] = shardd__elem_load(dt, base, j * 4 + (size_t)e);
    return;
  }
  for (int q = 0; q < 4; q++) {
    uint32_t w;
    memcpy(&w, (const char *)base + (j * 4 + (size_t)q) * 4, 4);
    shardd__elem_unpack2(dt, w, &out[2 * q], &out[2 * q + 1]);
  }
}

/* One reduce_kernel launch (shardd__cuda_reduce's contract). */
static void kern_reduce(int dt, float *acc, const void *const *srcs, int nsrc,
                        int first, int do_div, float divisor, size_t n) {
  const size_t V = dt == SHARDD__ELEM_F32 ? 4 : 8;
  const int k0 = first ? 1 : 0;
  size_t nvec = n / V;
  for (size_t j = 0; j < nvec; j++) {
    float a[8], t[8];
    if (first)
      kern_loadv(dt, srcs[0], j, a);
    else
      memcpy(a, acc + j * V, V * sizeof *a);
    for (int k = k0; k < nsrc; k++) {
      kern_loadv(dt, srcs[k], j, t);
      for (size_t e = 0; e < V; e++)
        a[e] = shardd__elem_acc(a[e], t[e]);
    }
    if (do_div)
      for (size_t e = 0; e < V; e++)
        a[e] = shardd__elem_div(a[e], divisor);
    memcpy(acc + j * V, a, V * sizeof *a);
  }
  for (size_t i = nvec * V; i < n; i++) {
    float a = first ? shardd__elem_load(dt, srcs[0], i) : acc[i];
    for (int k = k0; k < nsrc; k++)
      a = shardd__elem_acc(a, shardd__elem_load(dt, srcs[k], i));
    if (do_div)
      a = shardd__elem_div(a, divisor);
    acc[i] = a;
  }
}

/* backend_cuda's cuda_reduce: launches of up to MAX_SRC sources, the first
 * from source 0, the division (when divisor != 1) in the last. */
static void drive_reduce(int dt, float *acc, const void *const *srcs, int nsrc,
                         float divisor, size_t n) {
  int do_div = divisor != 1.0f;
  for (int g = 0; g < nsrc; g += SHARDD__CUDA_REDUCE_MAX_SRC) {
    int k = nsrc - g < SHARDD__CUDA_REDUCE_MAX_SRC ? nsrc - g
                                                   : SHARDD__CUDA_REDUCE_MAX_SRC;
    kern_reduce(dt, acc, srcs + g, k, g == 0, g + k >= nsrc && do_div,
                divisor, n);
  }
}

/* update_kernel: 4 elements per vector group, the 16-bit param (PDT != 0)
 * written two per 32-bit word; absent state reads as 0 and is not stored. */
static void kern_update(const shardd__cuda_upd *k, float *p, const float *g,
                        float *m, float *v, float *vmax, int pdt, void *p16,
                        size_t n) {
  size_t nvec = n / 4;
  for (size_t j = 0; j < nvec; j++) {
    float P[4], G[4], M[4] = {0, 0, 0, 0}, S[4] = {0, 0, 0, 0},
                      X[4] = {0, 0, 0, 0};
    memcpy(P, p + j * 4, sizeof P);
    memcpy(G, g + j * 4, sizeof G);
    if (m)
      memcpy(M, m + j * 4, sizeof M);
    if (v)
      memcpy(S, v + j * 4, sizeof S);
    if (vmax)
      memcpy(X, vmax + j * 4, sizeof X);
    for (int e = 0; e < 4; e++)
      shardd__elem_update(k, &P[e], G[e], &M[e], &S[e], &X[e]);
    memcpy(p + j * 4, P, sizeof P);
    if (m)
      memcpy(m + j * 4, M, sizeof M);
    if (v)
      memcpy(v + j * 4, S, sizeof S);
    if (vmax)
      memcpy(vmax + j * 4, X, sizeof X);
    if (pdt) {
      uint32_t o[2] = {shardd__elem_pack2(pdt, P[0], P[1]),
                       shardd__elem_pack2(pdt, P[2], P[3])};
      memcpy((char *)p16 + j * 8, o, sizeof o);
    }
  }
  for (size_t i = nvec * 4; i < n; i++)
    shardd__elem_update_at(k, i, p, g, m, v, vmax, pdt, p16);
}

/* ---- comparisons -------------------------------------------------------- */

static void same_f32(const float *got, const float *want, size_t n,
                     const char *what, const char *cfg) {
  for (size_t i = 0; i < n; i++)
    cr_assert_eq(shardd__f32_bits(got[i]), shardd__f32_bits(want[i]),
                 "%s: %s[%zu] = %a (0x%08x), host kernels %a (0x%08x)", cfg,
                 what, i, (double)got[i], shardd__f32_bits(got[i]), (double)want[i],
                 shardd__f32_bits(want[i]));
}

/* As same_f32, but any NaN matches any NaN: which operand's payload (and
 * sign) a float operation on two NaNs returns depends on the operand order
 * the compiler picked, on the host as on the device. */
static void same_f32_or_nan(const float *got, const float *want, size_t n,
                            const char *what, const char *cfg) {
  for (size_t i = 0; i < n; i++)
    cr_assert(shardd__f32_bits(got[i]) == shardd__f32_bits(want[i]) || (isnan(got[i]) && isnan(want[i])),
              "%s: %s[%zu] = %a (0x%08x), host kernels %a (0x%08x)", cfg, what,
              i, (double)got[i], shardd__f32_bits(got[i]), (double)want[i], shardd__f32_bits(want[i]));
}

static void same_u16(const uint16_t *got, const uint16_t *want, size_t n,
                     const char *what, const char *cfg) {
  for (size_t i = 0; i < n; i++)
    cr_assert_eq(got[i], want[i], "%s: %s[%zu] = 0x%04x, host kernels 0x%04x",
                 cfg, what, i, got[i], want[i]);
}

/* ---- the separately rounded operations ---------------------------------- */

/* a*b + c where an FMA differs from two roundings: (1+2^-12)^2 = 1 + 2^-11
 * + 2^-24, whose 2^-24 is a tie that rounds away, so (a*b) + c = 2^-11
 * while fma = 2^-11 + 2^-24. Volatile so nothing folds at compile time. */
Test(optim_cuda, host_ops_round_each_operation, .timeout = TMO) {
  volatile float a = 1.0f + 0x1p-12f, b = 1.0f + 0x1p-12f, c = -1.0f;
  cr_assert_eq(shardd__f32_bits(shardd__ffma(a, b, c)),
               shardd__f32_bits(0x1p-11f + 0x1p-24f));
  cr_assert_eq(shardd__f32_bits(shardd__fadd(shardd__fmul(a, b), c)), shardd__f32_bits(0x1p-11f));
  /* and through an element update: SGD's param.add_(d_p, alpha=-lr) is
   * one FMA, as torch's CPU kernel (optim.c) */
  shardd__cuda_upd k = {.kind = SHARDD__CUDA_SGD, .scale = 1.0f, .neg_lr = a};
  float p = c, dummy = 0;
  shardd__elem_update(&k, &p, b, &dummy, &dummy, &dummy);
  cr_assert_eq(shardd__f32_bits(p), shardd__f32_bits(0x1p-11f + 0x1p-24f),
               "got %a", (double)p);
  /* sqrt and div are the correctly rounded ones */
  volatile float two = 2.0f, three = 3.0f;
  cr_assert_eq(shardd__f32_bits(shardd__fsqrt(two)), shardd__f32_bits((float)sqrt(2.0)));
  cr_assert_eq(shardd__f32_bits(shardd__fdiv(two, three)), shardd__f32_bits((float)(2.0 / 3.0)));
}

/* ---- updates against optim.c -------------------------------------------- */

#define NEL 1037 /* odd: vector groups and a scalar tail */

static const uint64_t steps[] = {1, 2, 3, 4, 5, 1000, 1u << 20};
#define NSTEPS (sizeof steps / sizeof steps[0])

static void cfg_name(char *buf, size_t len, const shardd__hp *hp, int dt,
                     float scale, uint64_t step) {
  snprintf(buf, len,
           "%s %s lr=%g mom=%g damp=%g nesterov=%d wd=%g betas=(%g,%g) "
           "eps=%g amsgrad=%d maximize=%d grad_scale=%g step %llu",
           hp->kind == SHARDD_OPTIM_SGD    ? "SGD"
           : hp->kind == SHARDD_OPTIM_ADAM ? "Adam"
                                           : "AdamW",
           dt_name(dt), hp->lr, hp->momentum, hp->dampening, hp->nesterov,
           hp->weight_decay, hp->beta1, hp->beta2, hp->eps, hp->amsgrad,
           hp->maximize, (double)scale, (unsigned long long)step);
}

/* Runs every step of hp on dtype dt both ways (kernel loops over the
 * element functions with shardd__cuda_fill_upd's scalars; optim.c as
 * backend_host drives it) from the same data, comparing param, master copy
 * and state bits after the widening and after every step. */
static void run_update(const shardd__hp *hp, int dt, float scale,
                       uint64_t seed) {
  char err[256];
  cr_assert_eq(shardd__hp_check(hp, err, sizeof err), SHARDD_OK, "%s", err);
  static float kp[NEL], hpar[NEL], g[NEL], kst[3][NEL], hst[3][NEL];
  static uint16_t k16[NEL], h16[NEL];
  char cfg[320];
  rng_seed(seed);
  int ns = shardd__optim_state_count(hp);
  for (size_t i = 0; i < NEL; i++) {
    float x = rnd(-10, 2);
    if (dt == SHARDD__ELEM_F32) {
      kp[i] = hpar[i] = x;
    } else {
      k16[i] = h16[i] = (uint16_t)shardd__elem_narrow(dt, x);
    }
    /* Adam's state starts at zero; SGD's buffer may hold anything before
     * step 1, which must then ignore it */
    for (int s = 0; s < 3; s++)
      kst[s][i] = hst[s][i] = hp->kind == SHARDD_OPTIM_SGD ? rnd(-4, 4) : 0;
  }
  if (dt != SHARDD__ELEM_F32) {
    cfg_name(cfg, sizeof cfg, hp, dt, scale, 0);
    kern_widen(dt, kp, k16, NEL);
    shardd__to_f32((shardd_dtype)dt, hpar, h16, NEL);
    same_f32(kp, hpar, NEL, "widened master", cfg);
  }
  float *kstp[3] = {kst[0], kst[1], kst[2]}, *hstp[3] = {hst[0], hst[1], hst[2]};
  for (size_t si = 0; si < NSTEPS; si++) {
    uint64_t step = steps[si];
    cfg_name(cfg, sizeof cfg, hp, dt, scale, step);
    for (size_t i = 0; i < NEL; i++)
      g[i] = rnd(-12, 3);
    shardd__cuda_upd k;
    shardd__cuda_fill_upd(hp, step, scale, &k);
    /* as backend_cuda's cuda_update hands the state to the kernel */
    kern_update(&k, kp, g, ns > 0 ? kst[0] : NULL, ns > 1 ? kst[1] : NULL,
                ns > 2 ? kst[2] : NULL, dt == SHARDD__ELEM_F32 ? 0 : dt, k16,
                NEL);
    shardd__optim_update(hp, step, hpar, g, scale, hstp, NEL);
    if (dt != SHARDD__ELEM_F32)
      shardd__from_f32((shardd_dtype)dt, h16, hpar, NEL);
    same_f32(kp, hpar, NEL, dt == SHARDD__ELEM_F32 ? "param" : "master", cfg);
    static const char *const sname[2][3] = {
        {"momentum_buffer", "", ""},
        {"exp_avg", "exp_avg_sq", "max_exp_avg_sq"}};
    for (int s = 0; s < ns; s++)
      same_f32(kstp[s], hstp[s], NEL,
               sname[hp->kind != SHARDD_OPTIM_SGD][s], cfg);
    if (dt != SHARDD__ELEM_F32)
      same_u16(k16, h16, NEL, "param", cfg);
  }
}

static const int dts[] = {SHARDD__ELEM_F32, SHARDD__ELEM_BF16,
                          SHARDD__ELEM_F16};
static const float scales[] = {1.0f, 0.37f};

Test(optim_cuda, sgd_matches_optim_c, .timeout = TMO) {
  static const struct {
    double mom, damp;
    int nesterov;
  } m[] = {{0, 0, 0}, {0.9, 0, 0}, {0.9, 0, 1}, {0.9, 0.25, 0}, {0.5, 1.5, 0}};
  int runs = 0;
  for (size_t mi = 0; mi < sizeof m / sizeof m[0]; mi++)
    for (int wd = 0; wd < 2; wd++)
      for (int max = 0; max < 2; max++)
        for (size_t si = 0; si < 2; si++)
          for (size_t di = 0; di < 3; di++) {
            shardd__hp hp;
            shardd__hp_defaults(SHARDD_OPTIM_SGD, &hp);
            hp.lr = 0.05;
            hp.momentum = m[mi].mom;
            hp.dampening = m[mi].damp;
            hp.nesterov = m[mi].nesterov;
            hp.weight_decay = wd ? 0.01 : 0;
            hp.maximize = max;
            run_update(&hp, dts[di], scales[si], (uint64_t)++runs);
          }
  cr_assert_eq(runs, 5 * 2 * 2 * 2 * 3);
}

static void adam_family(shardd_optim_kind kind) {
  static const double betas[][2] = {{0.9, 0.999}, {0.5, 0.75}};
  static const double eps[] = {1e-8, 1e-3};
  int runs = 0;
  for (int wd = 0; wd < 2; wd++)
    for (int ams = 0; ams < 2; ams++)
      for (int max = 0; max < 2; max++)
        for (size_t bi = 0; bi < 2; bi++)
          for (size_t si = 0; si < 2; si++)
            for (size_t di = 0; di < 3; di++) {
              shardd__hp hp;
              shardd__hp_defaults(kind, &hp);
              hp.lr = 0.03;
              hp.weight_decay = wd ? 0.05 : 0;
              hp.amsgrad = ams;
              hp.maximize = max;
              hp.beta1 = betas[bi][0];
              hp.beta2 = betas[bi][1];
              hp.eps = eps[bi];
              run_update(&hp, dts[di], scales[si],
                         (uint64_t)kind * 1000 + (uint64_t)++runs);
            }
  cr_assert_eq(runs, 2 * 2 * 2 * 2 * 2 * 3);
}

Test(optim_cuda, adam_matches_optim_c, .timeout = TMO) {
  adam_family(SHARDD_OPTIM_ADAM);
}

Test(optim_cuda, adamw_matches_optim_c, .timeout = TMO) {
  adam_family(SHARDD_OPTIM_ADAMW);
}

/* Non-finite gradients and parameters give the same results both ways,
 * where a NaN is just a NaN (see same_f32_or_nan; sm_90 returns its
 * canonical NaN besides). */
Test(optim_cuda, nonfinite_values_match_optim_c, .timeout = TMO) {
  static const float sp[] = {INFINITY, -INFINITY, NAN, -NAN, 0.0f, -0.0f,
                             0x1p-149f, -0x1p-140f, 3.0e38f, -3.0e38f};
  enum { NS = sizeof sp / sizeof sp[0], M = NS * NS };
  static const shardd_optim_kind kinds[] = {SHARDD_OPTIM_SGD, SHARDD_OPTIM_ADAM,
                                            SHARDD_OPTIM_ADAMW};
  for (size_t ki = 0; ki < 3; ki++)
    for (int ams = 0; ams < 2; ams++) {
      shardd__hp hp;
      shardd__hp_defaults(kinds[ki], &hp);
      hp.amsgrad = ams && kinds[ki] != SHARDD_OPTIM_SGD;
      hp.momentum = kinds[ki] == SHARDD_OPTIM_SGD ? 0.9 : 0;
      hp.nesterov = ams && kinds[ki] == SHARDD_OPTIM_SGD;
      hp.weight_decay = 0.01;
      float kp[M], hpp[M], g[M], kst[3][M], hst[3][M];
      for (size_t i = 0; i < M; i++) {
        kp[i] = hpp[i] = sp[i / NS];
        g[i] = sp[i % NS];
        for (int s = 0; s < 3; s++)
          kst[s][i] = hst[s][i] = 0;
      }
      float *kstp[3] = {kst[0], kst[1], kst[2]};
      float *hstp[3] = {hst[0], hst[1], hst[2]};
      int ns = shardd__optim_state_count(&hp);
      for (uint64_t step = 1; step <= 3; step++) {
        char cfg[320];
        cfg_name(cfg, sizeof cfg, &hp, SHARDD__ELEM_F32, 1.0f, step);
        shardd__cuda_upd k;
        shardd__cuda_fill_upd(&hp, step, 1.0f, &k);
        kern_update(&k, kp, g, ns > 0 ? kst[0] : NULL, ns > 1 ? kst[1] : NULL,
                    ns > 2 ? kst[2] : NULL, 0, NULL, M);
        shardd__optim_update(&hp, step, hpp, g, 1.0f, hstp, M);
        same_f32_or_nan(kp, hpp, M, "param", cfg);
        static const char *const sname[3] = {"state[0]", "state[1]",
                                             "state[2]"};
        for (int s = 0; s < ns; s++)
          same_f32_or_nan(kstp[s], hstp[s], M, sname[s], cfg);
      }
    }
}

/* ---- reduce against backend_host ---------------------------------------- */

Test(optim_cuda, reduce_matches_backend_host, .timeout = TMO) {
  enum { RN = 2053, MAXS = 19 };
  char err[256];
  shardd__backend *b = NULL;
  cr_assert_eq(shardd__backend_host_create(1, 64u << 20, &b, err, sizeof err),
               SHARDD_OK, "%s", err);
  shardd__region *dst = NULL, *src[MAXS];
  cr_assert_eq(b->ops->alloc(b, 0, RN * sizeof(float), "acc", &dst, err,
                             sizeof err),
               SHARDD_OK, "%s", err);
  for (int s = 0; s < MAXS; s++)
    cr_assert_eq(b->ops->alloc(b, 0, RN * sizeof(float), "src", &src[s], err,
                               sizeof err),
                 SHARDD_OK, "%s", err);
  static float acc[RN];
  static const int nsrcs[] = {1, 2, 3, 8, 9, 17, MAXS};
  static const float divisors[] = {1.0f, 2.0f, 3.0f, 7.0f, 19.0f};
  static const float special[] = {INFINITY, -INFINITY, NAN, 0x1p-149f,
                                  -0.0f,    3.0e38f,   0x1p-126f};
  size_t offs[MAXS] = {0};
  rng_seed(7);
  for (size_t di = 0; di < 3; di++) {
    int dt = dts[di];
    for (int s = 0; s < MAXS; s++)
      for (size_t i = 0; i < RN; i++) {
        /* a few sources carry special values here and there */
        float x = (i % 97 == (size_t)s && s < 7) ? special[s] : rnd(-30, 10);
        if (dt == SHARDD__ELEM_F32)
          ((float *)src[s]->ptr)[i] = x;
        else
          ((uint16_t *)src[s]->ptr)[i] =
              i % 101 == (size_t)s ? (uint16_t)rng32() /* any pattern */
                                   : (uint16_t)shardd__elem_narrow(dt, x);
      }
    for (size_t ni = 0; ni < sizeof nsrcs / sizeof nsrcs[0]; ni++)
      for (size_t vi = 0; vi < sizeof divisors / sizeof divisors[0]; vi++) {
        int nsrc = nsrcs[ni];
        float divisor = divisors[vi];
        const void *ptrs[MAXS];
        for (int s = 0; s < nsrc; s++)
          ptrs[s] = src[s]->ptr;
        for (size_t i = 0; i < RN; i++)
          acc[i] = rnd(-4, 4); /* stale contents the reduce must overwrite */
        drive_reduce(dt, acc, ptrs, nsrc, divisor, RN);
        cr_assert_eq(b->ops->reduce(b, (shardd_dtype)dt, divisor, dst, 0, src,
                                    offs, nsrc, RN),
                     SHARDD_OK);
        char cfg[96];
        snprintf(cfg, sizeof cfg, "reduce %s of %d sources / %g", dt_name(dt),
                 nsrc, (double)divisor);
        same_f32_or_nan(acc, dst->ptr, RN, "acc", cfg);
      }
  }
  for (int s = 0; s < MAXS; s++)
    b->ops->free(b, src[s]);
  b->ops->free(b, dst);
  b->ops->destroy(b);
}

/* Adopt: the element rule the device runs (shardd__elem_adopt) against
 * backend_host's adopt, over masters with special values and params that
 * are the master's rounding, or any other pattern (a trainer's write). */
Test(optim_cuda, adopt_matches_backend_host, .timeout = TMO) {
  enum { AN = 4099 };
  char err[256];
  shardd__backend *b = NULL;
  cr_assert_eq(shardd__backend_host_create(1, 64u << 20, &b, err, sizeof err),
               SHARDD_OK, "%s", err);
  shardd__region *m = NULL, *p = NULL;
  cr_assert_eq(b->ops->alloc(b, 0, AN * sizeof(float), "master", &m, err, sizeof err),
               SHARDD_OK, "%s", err);
  cr_assert_eq(b->ops->alloc(b, 0, AN * sizeof(uint16_t), "param", &p, err, sizeof err),
               SHARDD_OK, "%s", err);
  static const float special[] = {INFINITY, -INFINITY, NAN, 0x1p-149f, -0.0f,
                                  3.0e38f, 0x1p-126f};
  static float want[AN];
  rng_seed(11);
  for (int di = 1; di < 3; di++) { /* bf16, fp16 */
    int dt = dts[di];
    float *mf = m->ptr;
    uint16_t *pu = p->ptr;
    size_t changed = 0;
    for (size_t i = 0; i < AN; i++) {
      mf[i] = i % 89 < 7 ? special[i % 89] : rnd(-30, 16);
      pu[i] = i % 5 == 0 ? (uint16_t)rng32()
                         : (uint16_t)shardd__elem_narrow(dt, mf[i]);
      want[i] = mf[i];
    }
    cr_assert_eq(b->ops->adopt(b, (shardd_dtype)dt, m, 0, p, 0, AN), SHARDD_OK);
    for (size_t i = 0; i < AN; i++) {
      float got = shardd__elem_adopt(dt, want[i], pu[i]);
      changed += shardd__f32_bits(got) != shardd__f32_bits(want[i]);
      want[i] = got;
    }
    char cfg[64];
    snprintf(cfg, sizeof cfg, "adopt %s", dt_name(dt));
    same_f32(want, mf, AN, "master", cfg);
    /* about a fifth of the params were written: the rule did adopt them */
    cr_assert(changed > AN / 8, "%s: only %zu of %d adopted", cfg, changed, AN);
  }
  b->ops->free(b, m);
  b->ops->free(b, p);
  b->ops->destroy(b);
}

/* ---- conversions -------------------------------------------------------- */

/* Every 16-bit pattern widens as optim.c's shardd__to_f32 (backend_host's
 * widen), through the scalar load and the word unpacking, NaNs included. */
Test(optim_cuda, widen_matches_to_f32_for_every_pattern, .timeout = TMO) {
  enum { M = 1 << 16 };
  static uint16_t all[M];
  static float want[M], got[M], got1[M];
  for (size_t i = 0; i < M; i++)
    all[i] = (uint16_t)i;
  for (size_t di = 1; di < 3; di++) {
    int dt = dts[di];
    shardd__to_f32((shardd_dtype)dt, want, all, M);
    kern_widen(dt, got, all, M);
    kern_widen(dt, got1, all + 1, M - 1); /* shifts what is vector, tail */
    char cfg[32];
    snprintf(cfg, sizeof cfg, "widen %s", dt_name(dt));
    same_f32(got, want, M, "fp32 of pattern", cfg);
    same_f32(got1, want + 1, M - 1, "fp32 of pattern", cfg);
  }
  /* fp32 "widening" is a copy, signalling NaN payloads and all */
  static const uint32_t f[] = {0x7f800001u, 0xffbfffffu, 0x7fc00000u,
                               0x00000001u, 0x80000000u, 0x3f800000u};
  float src[6], dst[6];
  for (size_t i = 0; i < 6; i++)
    src[i] = shardd__bits_f32(f[i]);
  for (size_t i = 0; i < 6; i++)
    dst[i] = shardd__elem_load(SHARDD__ELEM_F32, src, i);
  for (size_t i = 0; i < 6; i++)
    cr_assert_eq(shardd__f32_bits(dst[i]), f[i]);
}

/* Fixed points, worked out by hand: signed zeros, infinities, NaNs
 * (quiet and signalling, both signs), subnormals of both sides, and ties
 * on either side of even. */
Test(optim_cuda, widen_special_values, .timeout = TMO) {
  static const struct {
    uint16_t h;
    uint32_t f;
  } f16[] = {
      {0x0000, 0x00000000u}, {0x8000, 0x80000000u}, {0x3c00, 0x3f800000u},
      {0x7c00, 0x7f800000u}, {0xfc00, 0xff800000u}, {0x7e00, 0x7fc00000u},
      {0x7c01, 0x7fc02000u}, /* signalling NaN comes back quiet */
      {0xfd55, 0xffeaa000u}, {0x7fff, 0x7fffe000u},
      {0x0001, 0x33800000u}, /* 2^-24, smallest subnormal */
      {0x8001, 0xb3800000u}, {0x0002, 0x34000000u}, {0x0003, 0x34400000u},
      {0x03ff, 0x387fc000u}, /* largest subnormal */
      {0x0200, 0x38000000u}, {0x0400, 0x38800000u}, /* smallest normal */
      {0x7bff, 0x477fe000u}, /* 65504 */
  };
  for (size_t i = 0; i < sizeof f16 / sizeof f16[0]; i++)
    cr_assert_eq(shardd__f32_bits(shardd__elem_widen(SHARDD__ELEM_F16, f16[i].h)), f16[i].f,
                 "fp16 0x%04x -> 0x%08x, want 0x%08x", f16[i].h,
                 shardd__f32_bits(shardd__elem_widen(SHARDD__ELEM_F16, f16[i].h)), f16[i].f);
  static const uint16_t bf[] = {0x0000, 0x8000, 0x0001, 0x807f, 0x7f80,
                                0xff80, 0x7f81, 0x7fc0, 0xffff, 0x3f80};
  for (size_t i = 0; i < sizeof bf / sizeof bf[0]; i++)
    cr_assert_eq(shardd__f32_bits(shardd__elem_widen(SHARDD__ELEM_BF16, bf[i])),
                 (uint32_t)bf[i] << 16, "bf16 0x%04x", bf[i]);
}

Test(optim_cuda, narrow_special_values, .timeout = TMO) {
  static const struct {
    uint32_t f;
    uint16_t bf, h;
  } t[] = {
      {0x00000000u, 0x0000, 0x0000}, {0x80000000u, 0x8000, 0x8000},
      {0x3f800000u, 0x3f80, 0x3c00}, {0x7f800000u, 0x7f80, 0x7c00},
      {0xff800000u, 0xff80, 0xfc00},
      {0x7fc00000u, 0x7fc0, 0x7e00}, /* NaNs: quiet, sign kept */
      {0x7f800001u, 0x7fc0, 0x7e00}, {0xffa00000u, 0xffe0, 0xfe00},
      {0x7fffffffu, 0x7fff, 0x7e00},
      {0x00000001u, 0x0000, 0x0000}, /* fp32 subnormals */
      {0x007fffffu, 0x0080, 0x0000}, {0x80400000u, 0x8040, 0x8000},
      /* bf16 ties: to even down, to even up, just above */
      {0x3f808000u, 0x3f80, 0x3c04}, {0x3f818000u, 0x3f82, 0x3c0c},
      {0x3f808001u, 0x3f81, 0x3c04},
      {0x7f7f8000u, 0x7f80, 0x7c00}, /* bf16 rounds up to inf */
      {0x7f7f7fffu, 0x7f7f, 0x7c00},
      /* fp16 normal ties: 1 + 2^-11 down to 1, 1 + 3*2^-11 up */
      {0x3f801000u, 0x3f80, 0x3c00}, {0x3f803000u, 0x3f80, 0x3c02},
      {0x3f801001u, 0x3f80, 0x3c01},
      /* fp16 top: 65504, just below 65520, 65520 (tie to inf) */
      {0x477fe000u, 0x4780, 0x7bff}, {0x477fefffu, 0x4780, 0x7bff},
      {0x477ff000u, 0x4780, 0x7c00}, {0xc77ff000u, 0xc780, 0xfc00},
      /* fp16 subnormals: 2^-25 (tie to 0), just above, 0.75 and 1.5
       * (tie to 2) times 2^-24, 2^-24, the smallest normal, the tie
       * below it (up to it) and just below that */
      {0x33000000u, 0x3300, 0x0000}, {0x33000001u, 0x3300, 0x0001},
      {0x33400000u, 0x3340, 0x0001}, {0x33c00000u, 0x33c0, 0x0002},
      {0xb3c00000u, 0xb3c0, 0x8002}, {0x33800000u, 0x3380, 0x0001},
      {0x38800000u, 0x3880, 0x0400},
      {0x387fc000u, 0x3880, 0x03ff}, {0x387fe000u, 0x3880, 0x0400},
      {0x387fdfffu, 0x3880, 0x03ff},
  };
  for (size_t i = 0; i < sizeof t / sizeof t[0]; i++) {
    float x = shardd__bits_f32(t[i].f);
    uint16_t hb, hh;
    shardd__from_f32(SHARDD_DTYPE_BF16, &hb, &x, 1);
    shardd__from_f32(SHARDD_DTYPE_FP16, &hh, &x, 1);
    cr_assert_eq(shardd__elem_narrow(SHARDD__ELEM_BF16, x), t[i].bf,
                 "bf16 of 0x%08x: 0x%04x, want 0x%04x", t[i].f,
                 shardd__elem_narrow(SHARDD__ELEM_BF16, x), t[i].bf);
    cr_assert_eq(shardd__elem_narrow(SHARDD__ELEM_F16, x), t[i].h,
                 "fp16 of 0x%08x: 0x%04x, want 0x%04x", t[i].f,
                 shardd__elem_narrow(SHARDD__ELEM_F16, x), t[i].h);
    cr_assert_eq(hb, t[i].bf, "host bf16 of 0x%08x: 0x%04x", t[i].f, hb);
    cr_assert_eq(hh, t[i].h, "host fp16 of 0x%08x: 0x%04x", t[i].f, hh);
  }
}

/* Narrowing over fp32 patterns spread across every exponent agrees with
 * optim.c's shardd__from_f32 (backend_host's narrowing) bit for bit, NaNs
 * included, through the scalar path and the word packing. (All 2^32
 * patterns agreed when checked by hand; this keeps a cheap version.) */
Test(optim_cuda, narrow_matches_from_f32, .timeout = TMO) {
  enum { M = 1 << 16 };
  static float src[M];
  static uint16_t want[M], got[M];
  uint32_t u = 777u;
  for (int round = 0; round < 64; round++) {
    for (size_t i = 0; i < M; i++, u += 1021u) /* 2^22 patterns, 1021 apart */
      src[i] = shardd__bits_f32(u);
    for (size_t di = 1; di < 3; di++) {
      int dt = dts[di];
      shardd__from_f32((shardd_dtype)dt, want, src, M);
      for (size_t i = 0; i < M; i += 2) {
        uint32_t w = shardd__elem_pack2(dt, src[i], src[i + 1]);
        got[i] = (uint16_t)(w & 0xffffu);
        got[i + 1] = (uint16_t)(w >> 16);
        cr_assert_eq(shardd__elem_narrow(dt, src[i]), got[i]);
      }
      same_u16(got, want, M, dt == SHARDD__ELEM_BF16 ? "bf16" : "fp16",
               "narrow");
    }
  }
}

/* ---- the per-step scalars ------------------------------------------------ */

/* shardd__cuda_fill_upd's flags, which decide what the element update
 * does; its float scalars are checked through the updates above. */
Test(optim_cuda, fill_upd_flags, .timeout = TMO) {
  shardd__hp hp;
  shardd__cuda_upd k;
  shardd__hp_defaults(SHARDD_OPTIM_SGD, &hp);
  shardd__cuda_fill_upd(&hp, 1, 0.5f, &k);
  cr_assert(k.kind == SHARDD__CUDA_SGD && !k.has_wd && !k.has_mom && k.first);
  cr_assert_eq(k.scale, 0.5f);
  hp.momentum = 0.9;
  hp.nesterov = 1;
  hp.weight_decay = 0.1;
  hp.maximize = 1;
  shardd__cuda_fill_upd(&hp, 2, 0.5f, &k);
  cr_assert(k.has_wd && k.has_mom && !k.first && k.nesterov);
  cr_assert_eq(k.scale, -0.5f);
  cr_assert_eq(k.neg_lr, (float)-1e-3);
  shardd__hp_defaults(SHARDD_OPTIM_ADAM, &hp);
  shardd__cuda_fill_upd(&hp, 1, 1.0f, &k);
  cr_assert(k.kind == SHARDD__CUDA_ADAM &&
            k.decay == SHARDD__CUDA_DECAY_NONE && !k.amsgrad);
  hp.weight_decay = 0.1;
  hp.amsgrad = 1;
  shardd__cuda_fill_upd(&hp, 1, 1.0f, &k);
  cr_assert(k.decay == SHARDD__CUDA_DECAY_L2 && k.amsgrad);
  shardd__hp_defaults(SHARDD_OPTIM_ADAMW, &hp);
  shardd__cuda_fill_upd(&hp, 3, 1.0f, &k);
  cr_assert(k.kind == SHARDD__CUDA_ADAM &&
            k.decay == SHARDD__CUDA_DECAY_DECOUPLED);
  cr_assert_eq(k.keep, (float)(1.0 - 1e-3 * 1e-2));
  cr_assert_eq(k.neg_step, (float)(-1e-3 / (1.0 - pow(0.9, 3.0))));
  cr_assert_eq(k.bc2_sqrt, (float)sqrt(1.0 - pow(0.999, 3.0)));
}
