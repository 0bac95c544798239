/* optim.c — the host optimizer kernels (SGD, Adam, AdamW) and the array
 * helpers around a step: gradient sum of squares and bf16/fp16 conversion.
 *
 * Bit-for-bit goal: torch.optim 1.13, single-tensor path, on torch's
 * AVX2 / AVX-512 CPU kernels (what torch runs on any x86 CPU with AVX2).
 * Each torch tensor op is one float operation here, with its scalar
 * argument computed in double and rounded to float exactly where torch
 * hands a Python float to a float tensor op, and each op whose torch kernel
 * is a multiply-add is one fmaf (one rounding):
 *   - add / add_ with alpha, self + alpha*other: the vectorised loop is
 *     vec::fmadd(other, alpha, self);
 *   - addcmul_, self + value*t1*t2: fma(value*t1, t2, self);
 * and nothing else (mul_, addcdiv_, sqrt, div by a scalar and add_ of eps
 * are single operations, and a multiply-add with alpha 1 rounds as the add).
 * torch fuses in the scalar tail of its loops too, not only in the vector
 * body: those kernel files are C++ built with -mavx2 -mfma (-mavx512f...)
 * and GCC's default -ffp-contract=fast for C++, so the tail's
 * `self + alpha*other` becomes an FMA as well. Measured with Debian's torch
 * 1.13 (GCC 12): every element of every tensor size, SGD (momentum,
 * dampening, nesterov, weight decay), Adam, AdamW, amsgrad, ATEN_CPU_-
 * CAPABILITY avx2 and avx512, 1 and 2 threads: identical bits; no element
 * depends on its place in the tensor, so a shard cut anywhere in a
 * parameter is updated as torch updates the whole parameter.
 * torch's non-SIMD kernels (ATEN_CPU_CAPABILITY=default, or a CPU without
 * AVX2) round every operation; against those we differ by an ULP or so per
 * fused operation. Every path here fuses the same operations whatever the
 * host CPU, so results never depend on it (see struct optim_path).
 *
 * The element loops are instantiated once per flag combination (the flags,
 * the 16-bit narrowing included, are compile-time constants of an
 * always-inline body) so that each loop is branch-free and vectorizes, and
 * once more per instruction set (see struct optim_path). Adam's sqrtf
 * vectorizes only without errno
 * (-fno-math-errno, set for this file in the Makefile): with errno GCC keeps
 * a libm call for negative inputs, which ours never are.
 */
#include "optim.h"

#include <math.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>

#include "dtype.h"

/* The fused operations are the explicit fmaf calls; contracting any other
 * a*b+c into an FMA would change results (and make them depend on the host
 * CPU). GCC contracts in its gnu dialects (-std=c11 turns that off, this
 * keeps it off in a gnu11 build), clang within an expression. */
#if defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

#define OPTIM_INLINE static inline __attribute__((always_inline))

void shardd__hp_defaults(shardd_optim_kind kind, shardd__hp *hp) {
  *hp = (shardd__hp){0};
  hp->kind = kind;
  hp->lr = 1e-3;
  if (kind == SHARDD_OPTIM_ADAM || kind == SHARDD_OPTIM_ADAMW) {
    hp->beta1 = 0.9;
    hp->beta2 = 0.999;
    hp->eps = 1e-8;
    hp->weight_decay = kind == SHARDD_OPTIM_ADAMW ? 1e-2 : 0.0;
  }
}

/* Fills err with "NAME = VALUE is out of range RANGE" and returns E_RANGE. */
static shardd_err out_of_range(char *err, size_t errlen, const char *name,
                               double v, const char *range) {
  if (err && errlen > 0)
    snprintf(err, errlen, "%s = %g is out of range %s", name, v, range);
  return SHARDD_E_RANGE;
}

shardd_err shardd__hp_check(const shardd__hp *hp, char *err, size_t errlen) {
  if (err && errlen > 0)
    err[0] = '\0';
  if (hp->kind != SHARDD_OPTIM_SGD && hp->kind != SHARDD_OPTIM_ADAM &&
      hp->kind != SHARDD_OPTIM_ADAMW) {
    if (err && errlen > 0)
      snprintf(err, errlen, "kind = %d is not a known optimizer",
               (int)hp->kind);
    return SHARDD_E_RANGE;
  }
  /* Written as !(ok) so NaN fails every test. */
  if (!(hp->lr >= 0 && isfinite(hp->lr)))
    return out_of_range(err, errlen, "lr", hp->lr, "[0, inf)");
  if (!(hp->weight_decay >= 0 && isfinite(hp->weight_decay)))
    return out_of_range(err, errlen, "weight_decay", hp->weight_decay,
                        "[0, inf)");
  if (hp->kind == SHARDD_OPTIM_SGD) {
    if (!(hp->momentum >= 0 && isfinite(hp->momentum)))
      return out_of_range(err, errlen, "momentum", hp->momentum, "[0, inf)");
    if (!isfinite(hp->dampening))
      return out_of_range(err, errlen, "dampening", hp->dampening,
                          "(-inf, inf)");
    if (hp->nesterov && !(hp->momentum > 0 && hp->dampening == 0)) {
      if (err && errlen > 0)
        snprintf(err, errlen,
                 "nesterov requires momentum > 0 and dampening = 0 "
                 "(momentum = %g, dampening = %g)",
                 hp->momentum, hp->dampening);
      return SHARDD_E_RANGE;
    }
    return SHARDD_OK;
  }
  if (!(hp->beta1 >= 0 && hp->beta1 < 1))
    return out_of_range(err, errlen, "beta1", hp->beta1, "[0, 1)");
  if (!(hp->beta2 >= 0 && hp->beta2 < 1))
    return out_of_range(err, errlen, "beta2", hp->beta2, "[0, 1)");
  if (!(hp->eps > 0 && isfinite(hp->eps)))
    return out_of_range(err, errlen, "eps", hp->eps, "(0, inf)");
  return SHARDD_OK;
}

int shardd__optim_supports(shardd_optim_kind kind, shardd_dtype dtype) {
  if (kind != SHARDD_OPTIM_SGD && kind != SHARDD_OPTIM_ADAM &&
      kind != SHARDD_OPTIM_ADAMW)
    return 0;
  return dtype == SHARDD_DTYPE_FP32 || dtype == SHARDD_DTYPE_BF16 ||
         dtype == SHARDD_DTYPE_FP16;
}

int shardd__optim_state_count(const shardd__hp *hp) {
  switch (hp->kind) {
  case SHARDD_OPTIM_SGD:
    return hp->momentum != 0 ? 1 : 0;
  case SHARDD_OPTIM_ADAM:
  case SHARDD_OPTIM_ADAMW:
    return hp->amsgrad ? 3 : 2;
  }
  return 0;
}

/* ---- element conversions ---------------------------------------------- */

OPTIM_INLINE float bits_f32(uint32_t u) {
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

OPTIM_INLINE uint32_t f32_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  return u;
}

/* dtype.h's fp16 conversions branch per element (a normalising loop for
 * subnormals), which keeps the array loops scalar. These are the branch-free
 * forms torch itself uses (c10 fp16_ieee_to_fp32_value / _from_fp32_value);
 * they equal dtype.h's on every non-NaN input (NaN stays NaN, its payload may
 * differ) and no intermediate is a subnormal float, so FTZ/DAZ modes do not
 * change them. */
OPTIM_INLINE float f16_to_f32(uint16_t h) {
  uint32_t w = (uint32_t)h << 16;
  uint32_t sign = w & 0x80000000u;
  uint32_t two_w = w + w;
  /* normals (and inf/NaN): rebias the exponent by 0xe0 then scale by 2^-112 */
  float normal = bits_f32((two_w >> 4) + (0xe0u << 23)) * 0x1.0p-112f;
  /* subnormals: the mantissa under the exponent of 0.5, minus 0.5 */
  float denormal = bits_f32((two_w >> 17) | (126u << 23)) - 0.5f;
  /* a mask, not ?:, so GCC does not sink either float op into a branch
   * (it may not speculate a float op under -ftrapping-math) */
  uint32_t is_den = 0u - (uint32_t)(two_w < (1u << 27));
  uint32_t mag = (f32_bits(denormal) & is_den) | (f32_bits(normal) & ~is_den);
  return bits_f32(sign | mag);
}

OPTIM_INLINE uint16_t f32_to_f16(float f) {
  /* scaling by 2^112 then 2^-110 rounds away the bits fp16 cannot hold
   * (overflowing to inf where fp16 would) */
  float base = (fabsf(f) * 0x1.0p+112f) * 0x1.0p-110f;
  uint32_t w = f32_bits(f);
  uint32_t shl1_w = w + w;
  uint32_t sign = w & 0x80000000u;
  uint32_t bias = shl1_w & 0xff000000u;
  bias = bias < 0x71000000u ? 0x71000000u : bias;
  base = bits_f32((bias >> 1) + 0x07800000u) + base;
  uint32_t bits = f32_bits(base);
  uint32_t exp_bits = (bits >> 13) & 0x7c00u;
  uint32_t mantissa_bits = bits & 0x0fffu;
  uint32_t nonsign = exp_bits + mantissa_bits;
  uint32_t is_nan = 0u - (uint32_t)(shl1_w > 0xff000000u); /* mask: see above */
  return (uint16_t)((sign >> 16) | (0x7e00u & is_nan) | (nonsign & ~is_nan));
}

/* What a loop writes besides the fp32 parameter: nothing, or the same
 * value narrowed into a bf16/fp16 parameter (as shardd__from_f32 would). */
enum { NARROW_NONE = 0, NARROW_BF16 = 1, NARROW_FP16 = 2 };

OPTIM_INLINE void narrow_store(uint16_t *restrict p16, size_t i, float x,
                               const int narrow) {
  if (narrow == NARROW_BF16)
    p16[i] = shardd__f32_to_bf16(x);
  if (narrow == NARROW_FP16)
    p16[i] = f32_to_f16(x);
}

/* ---- SGD ---------------------------------------------------------------- */

/* Per-step float scalars, each rounded from double once as torch does. */
typedef struct {
  float scale;  /* grad_scale, negated for maximize: -(g*s) == g*(-s) */
  float wd;     /* weight_decay */
  float mom;    /* momentum */
  float damp1;  /* 1 - dampening */
  float neg_lr; /* -lr */
} sgd_k;

/* torch: d_p = grad (negated if maximize); d_p = d_p.add(param, alpha=wd);
 * buf = d_p on the first step, else buf.mul_(mom).add_(d_p, alpha=1-damp);
 * d_p = nesterov ? d_p.add(buf, alpha=mom) : buf;
 * param.add_(d_p, alpha=-lr). Each add with alpha is one fmaf. */
OPTIM_INLINE void sgd_loop(size_t n, float *restrict p,
                           const float *restrict g, float *restrict buf,
                           uint16_t *restrict p16, sgd_k k, const int has_wd,
                           const int has_mom, const int first,
                           const int nesterov, const int narrow) {
  for (size_t i = 0; i < n; i++) {
    float d = g[i] * k.scale;
    if (has_wd)
      d = fmaf(k.wd, p[i], d);
    if (has_mom) {
      float b = first ? d : fmaf(k.damp1, d, buf[i] * k.mom);
      buf[i] = b;
      d = nesterov ? fmaf(k.mom, b, d) : b;
    }
    float np = fmaf(k.neg_lr, d, p[i]);
    p[i] = np;
    narrow_store(p16, i, np, narrow);
  }
}

/* Every SGD loop variant: bit 3 momentum, bit 2 weight decay, bit 1 first
 * step (buffer is None), bit 0 nesterov (bits 1-0 unused without momentum).
 * Inlined into each instruction-set path, which instantiates all of them. */
#define SGD_LOOPS(base, wd, mom, first, nest)                                  \
  case (base) * 3 + NARROW_NONE:                                               \
    sgd_loop(n, p, g, buf, p16, k, wd, mom, first, nest, NARROW_NONE);         \
    break;                                                                     \
  case (base) * 3 + NARROW_BF16:                                               \
    sgd_loop(n, p, g, buf, p16, k, wd, mom, first, nest, NARROW_BF16);         \
    break;                                                                     \
  case (base) * 3 + NARROW_FP16:                                               \
    sgd_loop(n, p, g, buf, p16, k, wd, mom, first, nest, NARROW_FP16);         \
    break;

/* Every SGD loop variant: v's bit 3 momentum, bit 2 weight decay, bit 1
 * first step (buffer is None), bit 0 nesterov (bits 1-0 unused without
 * momentum), times each narrowing. Inlined into each instruction-set path,
 * which instantiates all of them. */
OPTIM_INLINE void sgd_run(int v, int narrow, size_t n, float *restrict p,
                          const float *restrict g, float *restrict buf,
                          uint16_t *restrict p16, sgd_k k) {
  if (!(v & 8))
    v &= 4; /* without momentum only weight decay tells loops apart */
  switch (v * 3 + narrow) {
    SGD_LOOPS(0, 0, 0, 0, 0)
    SGD_LOOPS(4, 1, 0, 0, 0)
    SGD_LOOPS(8, 0, 1, 0, 0)
    SGD_LOOPS(9, 0, 1, 0, 1)
    SGD_LOOPS(10, 0, 1, 1, 0)
    SGD_LOOPS(11, 0, 1, 1, 1)
    SGD_LOOPS(12, 1, 1, 0, 0)
    SGD_LOOPS(13, 1, 1, 0, 1)
    SGD_LOOPS(14, 1, 1, 1, 0)
    SGD_LOOPS(15, 1, 1, 1, 1)
  default:
    break; /* not a variant step_prepare makes */
  }
}

/* ---- Adam / AdamW ------------------------------------------------------- */

enum { DECAY_NONE = 0, DECAY_L2 = 1, DECAY_DECOUPLED = 2 };

typedef struct {
  float scale;    /* grad_scale, negated for maximize */
  float wd;       /* Adam: weight_decay, added to the gradient (L2) */
  float keep;     /* AdamW: 1 - lr*weight_decay, multiplied into param */
  float b1, omb1; /* beta1, 1 - beta1 */
  float b2, omb2; /* beta2, 1 - beta2 */
  float bc2_sqrt; /* sqrt(1 - beta2^step) */
  float eps;
  float neg_step; /* -lr / (1 - beta1^step) */
} adam_k;

/* torch: grad (negated if maximize); Adam: grad = grad.add(param, alpha=wd)
 * (one fmaf); AdamW: param.mul_(1 - lr*wd);
 * m.mul_(b1).add_(grad, alpha=1-b1) (one fmaf);
 * v.mul_(b2).addcmul_(grad, grad, value=1-b2): fmaf((1-b2)*grad, grad, v*b2);
 * vmax = maximum(vmax, v) (amsgrad); denom = sqrt(v or vmax)/bc2_sqrt + eps;
 * param.addcdiv_(m, denom, value=-step_size): param + (-step_size*m)/denom. */
OPTIM_INLINE void adam_loop(size_t n, float *restrict p,
                            const float *restrict g, float *restrict m,
                            float *restrict v, float *restrict vmax,
                            uint16_t *restrict p16, adam_k k, const int decay,
                            const int amsgrad, const int narrow) {
  for (size_t i = 0; i < n; i++) {
    float gi = g[i] * k.scale;
    float pi = p[i];
    if (decay == DECAY_L2)
      gi = fmaf(k.wd, pi, gi);
    if (decay == DECAY_DECOUPLED)
      pi = pi * k.keep;
    float mi = fmaf(k.omb1, gi, m[i] * k.b1);
    float vi = fmaf(k.omb2 * gi, gi, v[i] * k.b2);
    m[i] = mi;
    v[i] = vi;
    float s = vi;
    if (amsgrad) {
      /* torch.maximum propagates NaN; a NaN vi fails the compare and wins */
      float mx = vmax[i] >= vi ? vmax[i] : vi;
      vmax[i] = mx;
      s = mx;
    }
    float denom = sqrtf(s) / k.bc2_sqrt + k.eps;
    float np = pi + k.neg_step * mi / denom;
    p[i] = np;
    narrow_store(p16, i, np, narrow);
  }
}

#define ADAM_LOOPS(decay, ams)                                                 \
  case ((decay) * 2 + (ams)) * 3 + NARROW_NONE:                                \
    adam_loop(n, p, g, m, v, vmax, p16, k, decay, ams, NARROW_NONE);           \
    break;                                                                     \
  case ((decay) * 2 + (ams)) * 3 + NARROW_BF16:                                \
    adam_loop(n, p, g, m, v, vmax, p16, k, decay, ams, NARROW_BF16);           \
    break;                                                                     \
  case ((decay) * 2 + (ams)) * 3 + NARROW_FP16:                                \
    adam_loop(n, p, g, m, v, vmax, p16, k, decay, ams, NARROW_FP16);           \
    break;

/* Every Adam loop variant (decay * 2 + amsgrad) times each narrowing. */
OPTIM_INLINE void adam_run(int variant, int narrow, size_t n,
                           float *restrict p, const float *restrict g,
                           float *restrict m, float *restrict v,
                           float *restrict vmax, uint16_t *restrict p16,
                           adam_k k) {
  switch (variant * 3 + narrow) {
    ADAM_LOOPS(DECAY_NONE, 0)
    ADAM_LOOPS(DECAY_NONE, 1)
    ADAM_LOOPS(DECAY_L2, 0)
    ADAM_LOOPS(DECAY_L2, 1)
    ADAM_LOOPS(DECAY_DECOUPLED, 0)
    ADAM_LOOPS(DECAY_DECOUPLED, 1)
  default:
    break; /* not a variant step_prepare makes */
  }
}

/* Each path is the same C above, inlined into functions compiled for one
 * instruction set (GCC's target attribute), so the binary stays portable
 * (no -march) and the wider paths are picked at run time from cpuid. The
 * paths give identical bits by construction: vectorizing keeps every float
 * operation and its order (no -ffast-math; vsqrtps/vdivps round correctly
 * as sqrtf and / do), fmaf is the one correctly rounded a*b+c everywhere
 * (vfmadd on the AVX2 and AVX-512 paths, which therefore also need the FMA
 * extension; on the baseline path a libm call, glibc's own FMA or its exact
 * software fma on a CPU without one: slower, not vectorized, the same
 * bits), and nothing else may contract a*b+c into an FMA: -std=c11 and the
 * pragma at the top keep contraction off (tests/unit/test_optim.c checks every
 * path the machine runs against the scalar one). bf16/fp16 narrowing
 * is done by the integer forms above on every path, not by AVX512_BF16's
 * vcvtneps2bf16 or F16C's vcvtps2ph: the former flushes subnormals, the
 * latter quiets NaNs differently. */
struct optim_path {
  void (*sgd)(int v, int narrow, size_t n, float *restrict p,
              const float *restrict g, float *restrict buf,
              uint16_t *restrict p16, sgd_k k);
  void (*adam)(int variant, int narrow, size_t n, float *restrict p,
               const float *restrict g, float *restrict m, float *restrict v,
               float *restrict vmax, uint16_t *restrict p16, adam_k k);
  double (*sumsq)(const float *restrict grad, size_t n);
  void (*to_f32)(shardd_dtype dtype, float *restrict dst,
                 const void *restrict src, size_t n);
  void (*from_f32)(shardd_dtype dtype, void *restrict dst,
                   const float *restrict src, size_t n);
  void (*adopt)(shardd_dtype dtype, float *restrict master,
                const uint16_t *restrict p16, size_t n);
};

static const struct optim_path *optim_path(void);

/* One step's per-step scalars and loop variant, computed once per call
 * (pow, sqrt) however many blocks the elements are then run in. */
typedef struct {
  int adam;    /* Adam/AdamW, else SGD */
  int variant; /* sgd_run's v or adam_run's variant */
  sgd_k sk;
  adam_k ak;
} step_k;

static void step_prepare(const shardd__hp *hp, uint64_t step,
                         float grad_scale, step_k *s) {
  memset(s, 0, sizeof *s);
  if (hp->kind == SHARDD_OPTIM_SGD) {
    s->sk = (sgd_k){
        .scale = hp->maximize ? -grad_scale : grad_scale,
        .wd = (float)hp->weight_decay,
        .mom = (float)hp->momentum,
        .damp1 = (float)(1.0 - hp->dampening),
        .neg_lr = (float)-hp->lr,
    };
    /* torch skips each op whose coefficient is 0; doing it anyway would
     * differ for signed zeros and non-finite parameters. */
    s->variant = ((hp->momentum != 0) << 3) |
                 ((hp->weight_decay != 0) << 2) | ((step <= 1) << 1) |
                 (hp->nesterov != 0);
    return;
  }
  s->adam = 1;
  double t = (double)step;
  double bc1 = 1.0 - pow(hp->beta1, t);
  double bc2 = 1.0 - pow(hp->beta2, t);
  double step_size = hp->lr / bc1;
  adam_k k = {
      .scale = hp->maximize ? -grad_scale : grad_scale,
      .wd = (float)hp->weight_decay,
      .keep = (float)(1.0 - hp->lr * hp->weight_decay),
      .b1 = (float)hp->beta1,
      .omb1 = (float)(1.0 - hp->beta1),
      .b2 = (float)hp->beta2,
      .omb2 = (float)(1.0 - hp->beta2),
      .bc2_sqrt = (float)sqrt(bc2),
      .eps = (float)hp->eps,
      .neg_step = (float)-step_size,
  };
  int decay = DECAY_NONE;
  if (hp->weight_decay != 0)
    decay = hp->kind == SHARDD_OPTIM_ADAMW ? DECAY_DECOUPLED : DECAY_L2;
  s->ak = k;
  s->variant = decay * 2 + (hp->amsgrad != 0);
}

/* One prepared step on path pp; with narrow, p16 gets each new parameter
 * narrowed in the same pass. */
static void step_run(const struct optim_path *pp, const step_k *s, float *p,
                     const float *g, float *const *state, int narrow,
                     uint16_t *p16, size_t n) {
  if (s->adam)
    pp->adam(s->variant, narrow, n, p, g, state[0], state[1],
             s->variant & 1 ? state[2] : NULL, p16, s->ak);
  else
    pp->sgd(s->variant, narrow, n, p, g, s->variant & 8 ? state[0] : NULL,
            p16, s->sk);
}

void shardd__optim_update(const shardd__hp *hp, uint64_t step, float *param,
                          const float *grad, float grad_scale,
                          float *const *state, size_t n) {
  if (n == 0 || !shardd__optim_supports(hp->kind, SHARDD_DTYPE_FP32))
    return;
  step_k s;
  step_prepare(hp, step, grad_scale, &s);
  step_run(optim_path(), &s, param, grad, state, NARROW_NONE, NULL, n);
}

void shardd__optim_update_narrow(const shardd__hp *hp, uint64_t step,
                                 shardd_dtype dtype, void *param,
                                 float *master, const float *grad,
                                 float grad_scale, float *const *state,
                                 size_t n) {
  if (n == 0 || !shardd__optim_supports(hp->kind, dtype))
    return;
  step_k s;
  step_prepare(hp, step, grad_scale, &s);
  const struct optim_path *pp = optim_path();
  /* the narrowing is one more store in the update's own loop: the new
   * value is still in a register, and the master is not read back */
  if (dtype == SHARDD_DTYPE_BF16 || dtype == SHARDD_DTYPE_FP16) {
    step_run(pp, &s, master, grad, state,
             dtype == SHARDD_DTYPE_BF16 ? NARROW_BF16 : NARROW_FP16, param, n);
    return;
  }
  step_run(pp, &s, master, grad, state, NARROW_NONE, NULL, n);
  memcpy(param, master, n * sizeof(float));
}


/* ---- array helpers ------------------------------------------------------ */

/* Eight independent partial sums: a fixed summation order the compiler may
 * vectorize without reassociating (it may not reorder one running sum). The
 * products are exact in double. */
#define SUMSQ_LANES 8

OPTIM_INLINE double sumsq_run(const float *restrict grad, size_t n) {
  double acc[SUMSQ_LANES] = {0};
  size_t i = 0;
  for (; i + SUMSQ_LANES <= n; i += SUMSQ_LANES)
    for (size_t j = 0; j < SUMSQ_LANES; j++)
      acc[j] += (double)grad[i + j] * (double)grad[i + j];
  for (size_t j = 0; i < n; i++, j++)
    acc[j] += (double)grad[i] * (double)grad[i];
  return ((acc[0] + acc[4]) + (acc[1] + acc[5])) +
         ((acc[2] + acc[6]) + (acc[3] + acc[7]));
}

OPTIM_INLINE void to_f32_run(shardd_dtype dtype, float *restrict dst,
                             const void *restrict src, size_t n) {
  switch (dtype) {
  case SHARDD_DTYPE_FP32: {
    const float *restrict s = src;
    for (size_t i = 0; i < n; i++)
      dst[i] = s[i];
    break;
  }
  case SHARDD_DTYPE_BF16: {
    const uint16_t *restrict s = src;
    for (size_t i = 0; i < n; i++)
      dst[i] = shardd__bf16_to_f32(s[i]);
    break;
  }
  case SHARDD_DTYPE_FP16: {
    const uint16_t *restrict s = src;
    for (size_t i = 0; i < n; i++)
      dst[i] = f16_to_f32(s[i]);
    break;
  }
  }
}

OPTIM_INLINE void from_f32_run(shardd_dtype dtype, void *restrict dst,
                               const float *restrict src, size_t n) {
  switch (dtype) {
  case SHARDD_DTYPE_FP32: {
    float *restrict d = dst;
    for (size_t i = 0; i < n; i++)
      d[i] = src[i];
    break;
  }
  case SHARDD_DTYPE_BF16: {
    uint16_t *restrict d = dst;
    for (size_t i = 0; i < n; i++)
      d[i] = shardd__f32_to_bf16(src[i]);
    break;
  }
  case SHARDD_DTYPE_FP16: {
    uint16_t *restrict d = dst;
    for (size_t i = 0; i < n; i++)
      d[i] = f32_to_f16(src[i]);
    break;
  }
  }
}

/* A 16-bit parameter whose bits are not its master's rounding was written
 * by the trainer since the last step: the master takes its value. A select,
 * not a branch, so it vectorizes like the narrowing it repeats (the same
 * integer forms narrow_store uses, hence the same bits as
 * shardd__from_f32). */
OPTIM_INLINE void adopt_run(shardd_dtype dtype, float *restrict m,
                            const uint16_t *restrict p16, size_t n) {
  if (dtype == SHARDD_DTYPE_BF16) {
    for (size_t i = 0; i < n; i++) {
      float w = shardd__bf16_to_f32(p16[i]);
      m[i] = shardd__f32_to_bf16(m[i]) == p16[i] ? m[i] : w;
    }
  } else if (dtype == SHARDD_DTYPE_FP16) {
    for (size_t i = 0; i < n; i++) {
      float w = f16_to_f32(p16[i]);
      m[i] = f32_to_f16(m[i]) == p16[i] ? m[i] : w;
    }
  }
}

/* ---- instruction-set paths and their dispatch --------------------------- */

#define OPTIM_PATH(sfx, attr)                                                 \
  attr static void sgd_##sfx(int v, int narrow, size_t n, float *restrict p,  \
                             const float *restrict g, float *restrict buf,    \
                             uint16_t *restrict p16, sgd_k k) {               \
    sgd_run(v, narrow, n, p, g, buf, p16, k);                                 \
  }                                                                           \
  attr static void adam_##sfx(int variant, int narrow, size_t n,              \
                              float *restrict p, const float *restrict g,     \
                              float *restrict m, float *restrict v,           \
                              float *restrict vmax, uint16_t *restrict p16,   \
                              adam_k k) {                                     \
    adam_run(variant, narrow, n, p, g, m, v, vmax, p16, k);                   \
  }                                                                           \
  attr static double sumsq_##sfx(const float *restrict grad, size_t n) {      \
    return sumsq_run(grad, n);                                                \
  }                                                                           \
  attr static void to_f32_##sfx(shardd_dtype dtype, float *restrict dst,      \
                                const void *restrict src, size_t n) {         \
    to_f32_run(dtype, dst, src, n);                                           \
  }                                                                           \
  attr static void from_f32_##sfx(shardd_dtype dtype, void *restrict dst,     \
                                  const float *restrict src, size_t n) {      \
    from_f32_run(dtype, dst, src, n);                                         \
  }                                                                           \
  attr static void adopt_##sfx(shardd_dtype dtype, float *restrict m,         \
                               const uint16_t *restrict p16, size_t n) {      \
    adopt_run(dtype, m, p16, n);                                              \
  }                                                                           \
  static const struct optim_path path_##sfx = {                               \
      sgd_##sfx,    adam_##sfx,     sumsq_##sfx,                              \
      to_f32_##sfx, from_f32_##sfx, adopt_##sfx};

/* the portable build: baseline x86-64 (SSE2) or whatever the target has */
OPTIM_PATH(scalar, )

#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
#define OPTIM_X86 1
OPTIM_PATH(avx2, __attribute__((target("avx2,fma"))))
OPTIM_PATH(avx512,
           __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,fma"))))
#endif

static const struct optim_path *path_of(shardd__isa isa) {
  switch (isa) {
  case SHARDD__ISA_SCALAR: return &path_scalar;
#if OPTIM_X86
  case SHARDD__ISA_AVX2: return &path_avx2;
  case SHARDD__ISA_AVX512: return &path_avx512;
#else
  case SHARDD__ISA_AVX2:
  case SHARDD__ISA_AVX512: return NULL;
#endif
  case SHARDD__ISA_COUNT: break;
  }
  return NULL;
}

const char *shardd__isa_name(shardd__isa isa) {
  switch (isa) {
  case SHARDD__ISA_SCALAR: return "scalar";
  case SHARDD__ISA_AVX2: return "avx2";
  case SHARDD__ISA_AVX512: return "avx512";
  case SHARDD__ISA_COUNT: break;
  }
  return "unknown";
}

int shardd__isa_runnable(shardd__isa isa) {
  if (isa == SHARDD__ISA_SCALAR)
    return 1;
#if OPTIM_X86
  /* libgcc's cpuid probe also checks (xgetbv) that the OS saves the wider
   * registers, so a feature bit alone does not enable a path */
  __builtin_cpu_init();
  /* fmaf is vfmadd on both paths: an AVX2 CPU without FMA (none ships,
   * but a hypervisor may hide it) takes the baseline path */
  if (isa == SHARDD__ISA_AVX2)
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if (isa == SHARDD__ISA_AVX512)
    return __builtin_cpu_supports("fma") &&
           __builtin_cpu_supports("avx512f") &&
           __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512dq") &&
           __builtin_cpu_supports("avx512vl");
#endif
  return 0;
}

/* The path in use, as a shardd__isa; -1 until first resolved. Worker
 * threads may race to resolve it: they all store the same value. */
static _Atomic int optim_isa = -1;

shardd__isa shardd__optim_isa(void) {
  int isa = atomic_load_explicit(&optim_isa, memory_order_relaxed);
  if (isa < 0) {
    isa = SHARDD__ISA_SCALAR;
    for (int i = SHARDD__ISA_COUNT - 1; i > SHARDD__ISA_SCALAR; i--)
      if (shardd__isa_runnable((shardd__isa)i)) {
        isa = i;
        break;
      }
    atomic_store_explicit(&optim_isa, isa, memory_order_relaxed);
  }
  return (shardd__isa)isa;
}

shardd_err shardd__optim_use_isa(shardd__isa isa) {
  if ((int)isa < 0 || isa >= SHARDD__ISA_COUNT || !shardd__isa_runnable(isa))
    return SHARDD_E_INVAL;
  atomic_store_explicit(&optim_isa, (int)isa, memory_order_relaxed);
  return SHARDD_OK;
}

static const struct optim_path *optim_path(void) {
  return path_of(shardd__optim_isa());
}

void shardd__optim_adopt(shardd_dtype dtype, float *master, const void *param,
                         size_t n) {
  optim_path()->adopt(dtype, master, param, n);
}

double shardd__sumsq_f32(const float *grad, size_t n) {
  return optim_path()->sumsq(grad, n);
}

void shardd__to_f32(shardd_dtype dtype, float *dst, const void *src,
                    size_t n) {
  optim_path()->to_f32(dtype, dst, src, n);
}

void shardd__from_f32(shardd_dtype dtype, void *dst, const float *src,
                      size_t n) {
  optim_path()->from_f32(dtype, dst, src, n);
}
