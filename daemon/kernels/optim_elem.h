/* optim_elem.h — the per-element arithmetic of the cuda backend's kernels
 * (optim_cuda.cu): the SGD / Adam / AdamW element update, one reduce step,
 * widening and narrowing of 16-bit elements and their packing in 32-bit
 * words. The kernels call exactly these inside their grid-stride and
 * vector-load loops; tests/unit/test_optim_cuda.c runs them on the host against
 * optim.c's kernels, which are the reference (see hostdev.h for why host and
 * device compute the same bits).
 *
 * Each update is optim.c's sgd_loop / adam_loop body, operation by
 * operation and in its order, with a fused multiply-add (shardd__ffma, one
 * rounding) exactly where optim.c has fmaf (see optim.c for why those),
 * driven by the shardd__cuda_upd that
 * shardd__cuda_fill_upd() computes as optim.c computes its sgd_k / adam_k.
 * The flags are tested per element: uniform over a launch, so they cost the
 * device a predictable branch rather than one kernel per combination. */
#ifndef SHARDD_OPTIM_ELEM_H
#define SHARDD_OPTIM_ELEM_H

#include <stddef.h>
#include <stdint.h>

#include "dtype.h"
#include "hostdev.h"
#include "optim_cuda.h"

/* shardd_dtype's values (shardd.h), which nvcc need not see. */
enum {
  SHARDD__ELEM_F32 = 1,
  SHARDD__ELEM_BF16 = 2,
  SHARDD__ELEM_F16 = 3
};

/* A 16-bit element (the low half of h) of dtype dt, as fp32, exactly. */
SHARDD_HD float shardd__elem_widen(int dt, uint32_t h) {
  return dt == SHARDD__ELEM_BF16 ? shardd__bf16_to_f32((uint16_t)h)
                                 : shardd__f16_to_f32((uint16_t)h);
}

/* f rounded to the 16-bit dtype dt (nearest even). */
SHARDD_HD uint32_t shardd__elem_narrow(int dt, float f) {
  return dt == SHARDD__ELEM_BF16 ? shardd__f32_to_bf16(f)
                                 : shardd__f32_to_f16(f);
}

/* Element i of a dtype dt array, as fp32. */
SHARDD_HD float shardd__elem_load(int dt, const void *base, size_t i) {
  if (dt == SHARDD__ELEM_F32)
    return ((const float *)base)[i];
  return shardd__elem_widen(dt, ((const uint16_t *)base)[i]);
}

/* The two 16-bit elements of a little-endian 32-bit word, lower address
 * (low half) first, as the vector loops read them. */
SHARDD_HD void shardd__elem_unpack2(int dt, uint32_t w, float *lo, float *hi) {
  *lo = shardd__elem_widen(dt, w & 0xffffu);
  *hi = shardd__elem_widen(dt, w >> 16);
}

SHARDD_HD uint32_t shardd__elem_pack2(int dt, float lo, float hi) {
  return shardd__elem_narrow(dt, lo) | (shardd__elem_narrow(dt, hi) << 16);
}

/* Reduce: one more source added to the running fp32 sum (rank order), and
 * the division of the finished sum when the divisor is not 1 (backend_host
 * divides only then, and so must the device: x / 1 quiets a signalling
 * NaN and may canonicalise its payload). */
SHARDD_HD float shardd__elem_acc(float a, float x) { return shardd__fadd(a, x); }

SHARDD_HD float shardd__elem_div(float a, float divisor) {
  return shardd__fdiv(a, divisor);
}

/* Adopt: the fp32 master m keeps its value where the 16-bit param p (dtype
 * dt, in the low half) is m's rounding; elsewhere the trainer wrote p since
 * the last step and the master takes it, exactly (backend_host's adopt). */
SHARDD_HD float shardd__elem_adopt(int dt, float m, uint32_t p) {
  return shardd__elem_narrow(dt, m) == p ? m : shardd__elem_widen(dt, p);
}

/* One element of an update: p is the fp32 param or master copy, g the
 * reduced gradient; m, v, vmax the state the kind uses (SGD's momentum
 * buffer, Adam's exp_avg, exp_avg_sq, max_exp_avg_sq); the others are
 * neither read nor written, so they may point at a dummy. */
SHARDD_HD void shardd__elem_update(const shardd__cuda_upd *k, float *p,
                                   float g, float *m, float *v, float *vmax) {
  if (k->kind == SHARDD__CUDA_SGD) {
    float d = shardd__fmul(g, k->scale);
    if (k->has_wd)
      d = shardd__ffma(k->wd, *p, d);
    if (k->has_mom) {
      float b =
          k->first ? d : shardd__ffma(k->damp1, d, shardd__fmul(*m, k->mom));
      *m = b;
      d = k->nesterov ? shardd__ffma(k->mom, b, d) : b;
    }
    *p = shardd__ffma(k->neg_lr, d, *p);
    return;
  }
  float gi = shardd__fmul(g, k->scale);
  float pi = *p;
  if (k->decay == SHARDD__CUDA_DECAY_L2)
    gi = shardd__ffma(k->wd, pi, gi);
  if (k->decay == SHARDD__CUDA_DECAY_DECOUPLED)
    pi = shardd__fmul(pi, k->keep);
  float mi = shardd__ffma(k->omb1, gi, shardd__fmul(*m, k->b1));
  float vi = shardd__ffma(shardd__fmul(k->omb2, gi), gi, shardd__fmul(*v, k->b2));
  *m = mi;
  *v = vi;
  float s = vi;
  if (k->amsgrad) {
    /* torch.maximum propagates NaN; a NaN vi fails the compare and wins */
    float mx = *vmax >= vi ? *vmax : vi;
    *vmax = mx;
    s = mx;
  }
  float denom =
      shardd__fadd(shardd__fdiv(shardd__fsqrt(s), k->bc2_sqrt), k->eps);
  *p = shardd__fadd(pi, shardd__fdiv(shardd__fmul(k->neg_step, mi), denom));
}

/* Element i of an update in place, as the kernels do it outside their
 * 4-element groups: absent state (NULL) reads as 0 and is not stored; a
 * 16-bit pdt rewrites p16[i] from the updated master p[i]. */
SHARDD_HD void shardd__elem_update_at(const shardd__cuda_upd *k, size_t i,
                                      float *p, const float *g, float *m,
                                      float *v, float *vmax, int pdt,
                                      uint16_t *p16) {
  float P = p[i], M = m ? m[i] : 0.0f, S = v ? v[i] : 0.0f,
        X = vmax ? vmax[i] : 0.0f;
  shardd__elem_update(k, &P, g[i], &M, &S, &X);
  p[i] = P;
  if (m)
    m[i] = M;
  if (v)
    v[i] = S;
  if (vmax)
    vmax[i] = X;
  if (pdt)
    p16[i] = (uint16_t)shardd__elem_narrow(pdt, P);
}

#endif /* SHARDD_OPTIM_ELEM_H */
