/* optim_cuda.h — the CUDA kernels of the cuda backend (optim_cuda.cu),
 * behind plain C launch wrappers: gradient reduction, sum of squares, the
 * fused SGD / Adam / AdamW update and the 16-bit -> fp32 widening.
 *
 * Numerics are those of optim.c (the host reference): per-step scalars are
 * computed on the host in double and rounded to float once
 * (shardd__cuda_fill_upd, optim_cuda_host.c, fills shardd__cuda_upd exactly
 * as optim.c fills its sgd_k / adam_k), and every per-element operation is
 * one IEEE float operation in optim.c's order: separately rounded, or one
 * fused multiply-add where optim.c has fmaf (torch's CPU kernels fuse
 * those). That
 * element arithmetic lives in optim_elem.h, which builds for the host too,
 * so test_optim_cuda.c checks it against optim.c bit for bit where no
 * GPU is; bf16/fp16 conversions are dtype.h's own code.
 *
 * Every wrapper enqueues on the given stream (a cudaStream_t passed as void *,
 * so this header needs no CUDA header) on the current device, and returns
 * the cudaError_t of the launch as an int (0: enqueued). Pointers are device
 * pointers the current device can access. Wrappers choose 16-byte vector
 * loads when every pointer is aligned for them and fall back to scalar code
 * otherwise. The module owns no memory. */
#ifndef SHARDD_OPTIM_CUDA_H
#define SHARDD_OPTIM_CUDA_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#include "optim.h"

/* Most sources one reduce launch sums; more are done in several launches. */
#define SHARDD__CUDA_REDUCE_MAX_SRC 8
/* Blocks of the sum-of-squares kernel: one double partial each. */
#define SHARDD__CUDA_SUMSQ_BLOCKS 256

enum { SHARDD__CUDA_SGD = 0, SHARDD__CUDA_ADAM = 1 };
enum {
  SHARDD__CUDA_DECAY_NONE = 0,
  SHARDD__CUDA_DECAY_L2 = 1,
  SHARDD__CUDA_DECAY_DECOUPLED = 2
};

/* One update's resolved per-step scalars and flags (see optim.c). */
typedef struct {
  int kind; /* SHARDD__CUDA_SGD or SHARDD__CUDA_ADAM (Adam and AdamW) */
  float scale; /* grad_scale, negated for maximize */
  /* SGD */
  float wd, mom, damp1, neg_lr;
  int has_wd, has_mom, first, nesterov;
  /* Adam / AdamW (wd above is Adam's L2 coefficient) */
  float keep, b1, omb1, b2, omb2, bc2_sqrt, eps, neg_step;
  int decay, amsgrad;
} shardd__cuda_upd;

/* k = the scalars and flags of step (1-based) of hp, with each gradient
 * element multiplied by grad_scale first: optim.c's sgd_update /
 * adam_update formulas. hp must pass shardd__hp_check(). Host code, built
 * with or without CUDA. */
void shardd__cuda_fill_upd(const shardd__hp *hp, uint64_t step,
                           float grad_scale, shardd__cuda_upd *k);

/* acc[0..n) (fp32) = (first ? 0-th source : acc) + the remaining sources
 * (dtype elements: 1 fp32, 2 bf16, 3 fp16 as shardd_dtype), added in order
 * in fp32; then divided by divisor when do_div. 1 <= nsrc <=
 * SHARDD__CUDA_REDUCE_MAX_SRC. */
int shardd__cuda_reduce(int dtype, float *acc, const void *const *srcs,
                        int nsrc, int first, int do_div, float divisor,
                        size_t n, void *stream);

/* partials[b] = sum of squares (in double) of the part of x[0..n) block b
 * covers, for SHARDD__CUDA_SUMSQ_BLOCKS blocks; the caller adds the partials
 * in index order. */
int shardd__cuda_sumsq(const float *x, size_t n, double *partials,
                       void *stream);

/* One update of n fp32 elements of p (the param or the master copy) from g;
 * m (SGD momentum buffer / exp_avg), v (exp_avg_sq) and vmax (max_exp_avg_sq)
 * as the kind needs them, NULL otherwise. When param16 is not NULL, each
 * updated p[i] is also written to param16[i] as dtype (2 bf16, 3 fp16). */
int shardd__cuda_update(const shardd__cuda_upd *k, float *p, const float *g,
                        float *m, float *v, float *vmax, int dtype,
                        void *param16, size_t n, void *stream);

/* acc[0..n) += x[0..n), each an fp32 addition (an accumulating scatter's
 * second half: x holds the new gradients' reduced sum). */
int shardd__cuda_add(float *acc, const float *x, size_t n, void *stream);

/* master[i] = param16[i] widened wherever param16[i] (dtype 2 bf16, 3 fp16)
 * is not master[i]'s rounding: the trainer's write since the last step is
 * adopted (shardd__elem_adopt). */
int shardd__cuda_adopt(int dtype, float *master, const void *param16,
                       size_t n, void *stream);

/* dst[0..n) (fp32) = src (dtype, widened exactly). */
int shardd__cuda_widen(int dtype, float *dst, const void *src, size_t n,
                       void *stream);

#ifdef __cplusplus
}
#endif

#endif /* SHARDD_OPTIM_CUDA_H */
