/* optim.h — the host optimizer kernels: hyperparameter defaults and range
 * checks, and the per-shard update of SGD, Adam and AdamW over contiguous
 * fp32 arrays, plus the array helpers a step needs around it (gradient sum of
 * squares for norm clipping, bf16/fp16 <-> fp32 conversion of parameters).
 *
 * Numerics follow torch.optim 1.13's single-tensor (foreach=False) path:
 * per-step scalars are computed in double and rounded to float once, every
 * per-element operation is one float operation in torch's order, and the
 * ones torch's AVX2/AVX-512 CPU kernels fuse (add with alpha, addcmul_) are
 * one fused multiply-add on every path and CPU (see optim.c), so results
 * match torch.optim on such a CPU bit for bit. The module owns no memory;
 * the caller owns parameters, gradients and state.
 */
#ifndef SHARDD_OPTIM_H
#define SHARDD_OPTIM_H

#include <stddef.h>
#include <stdint.h>

#include "shardd.h"

/* Hyperparameters of one param group, resolved (no "unset"). Fields the kind
 * does not use are ignored (and not range-checked). */
typedef struct {
  shardd_optim_kind kind;
  double lr, momentum, dampening, weight_decay;
  double beta1, beta2, eps;
  int nesterov, maximize, amsgrad;
} shardd__hp;

/* torch.optim's defaults for kind: SGD lr=1e-3 (torch has no default lr;
 * ours is 1e-3), momentum 0, dampening 0, weight_decay 0; Adam lr 1e-3,
 * betas (0.9, 0.999), eps 1e-8, weight_decay 0; AdamW the same with
 * weight_decay 1e-2. Flags all off; fields the kind does not use are 0. */
void shardd__hp_defaults(shardd_optim_kind kind, shardd__hp *hp);

/* Range checks as torch does them, plus: every value used by the kind is
 * finite, lr >= 0, momentum >= 0, weight_decay >= 0, 0 <= beta1 < 1,
 * 0 <= beta2 < 1, eps > 0, nesterov needs momentum > 0 and dampening == 0,
 * kind is known. Returns SHARDD_OK, or SHARDD_E_RANGE with a message naming
 * the field in err ("beta2 = 1 is out of range [0, 1)") when err is not NULL
 * and errlen > 0. */
shardd_err shardd__hp_check(const shardd__hp *hp, char *err, size_t errlen);

/* Whether parameters of dtype can be optimized by kind: every kind takes
 * fp32, bf16 and fp16 (the 16-bit ones through an fp32 master copy). */
int shardd__optim_supports(shardd_optim_kind kind, shardd_dtype dtype);

/* Number of fp32 state arrays of n elements each the kind needs. SGD: 1
 * (momentum buffer) when momentum != 0, else 0. Adam/AdamW: 2 (exp_avg,
 * exp_avg_sq), 3 with amsgrad (then max_exp_avg_sq), in that order. */
int shardd__optim_state_count(const shardd__hp *hp);

/* One optimizer step over n contiguous fp32 elements.
 * param: the fp32 parameter, or the fp32 master copy of a bf16/fp16 one.
 * grad: the reduced gradient; each element is first multiplied by grad_scale
 *   (in float, as clip_grad_norm_'s mul_ does; 1.0f for none).
 * state: shardd__optim_state_count(hp) arrays. Adam/AdamW state must be zero
 *   before step 1; SGD's momentum buffer is set from the gradient on step 1
 *   (torch's "buffer is None") and may hold anything before.
 * step: the 1-based count of this update. hp must pass shardd__hp_check().
 * No array may overlap another. */
void shardd__optim_update(const shardd__hp *hp, uint64_t step, float *param,
                          const float *grad, float grad_scale,
                          float *const *state, size_t n);

/* shardd__optim_update on the fp32 master copy of a bf16/fp16 parameter,
 * then param (n elements of dtype) = master rounded as shardd__from_f32
 * does; the same bits as those two calls, in one pass (each new value is
 * narrowed in the update's loop, the master is not read back). dtype fp32
 * updates master and then copies it to param. Same requirements as shardd__optim_update, and param overlaps no
 * other array. An unknown dtype or kind does nothing. */
/* For the n elements of a bf16/fp16 param and its fp32 master: where
 * param's bits are not master's rounding (the trainer wrote the shard since
 * the last step), master takes param's value, exactly; elsewhere master is
 * left as it is. dtype fp32 (or unknown) does nothing. The same bits on
 * every instruction-set path. */
void shardd__optim_adopt(shardd_dtype dtype, float *master, const void *param,
                         size_t n);

void shardd__optim_update_narrow(const shardd__hp *hp, uint64_t step,
                                 shardd_dtype dtype, void *param,
                                 float *master, const float *grad,
                                 float grad_scale, float *const *state,
                                 size_t n);

/* Sum of squares of grad[0..n), accumulated in double. */
double shardd__sumsq_f32(const float *grad, size_t n);

/* Converts n elements of dtype at src to fp32 at dst, and back (rounding to
 * nearest even, as torch's .to()). dst and src do not alias. An unknown
 * dtype converts nothing. */
void shardd__to_f32(shardd_dtype dtype, float *dst, const void *src, size_t n);
void shardd__from_f32(shardd_dtype dtype, void *dst, const float *src,
                      size_t n);

/* The instruction-set paths of the kernels above (shardd__optim_update, the
 * conversions and sumsq). Every path gives the bits SHARDD__ISA_SCALAR, the
 * portable build, gives; the wider ones are only faster. AVX2 and AVX-512
 * also need the CPU's FMA extension. */
typedef enum {
  SHARDD__ISA_SCALAR = 0, /* the build's baseline ISA (SSE2 on x86-64) */
  SHARDD__ISA_AVX2 = 1,
  SHARDD__ISA_AVX512 = 2, /* F, BW, DQ, VL */
  SHARDD__ISA_COUNT
} shardd__isa;

/* "scalar", "avx2", "avx512"; "unknown" for anything else. */
const char *shardd__isa_name(shardd__isa isa);

/* Whether this build has the path and this CPU (and OS) can run it. */
int shardd__isa_runnable(shardd__isa isa);

/* The path the kernels use: the widest runnable one, chosen on first use,
 * unless shardd__optim_use_isa() chose another. */
shardd__isa shardd__optim_isa(void);

/* Makes every later kernel call, in every thread, use isa (for tests and
 * benches, which compare the paths). SHARDD_E_INVAL when isa is not
 * runnable here; the path in use is then unchanged. */
shardd_err shardd__optim_use_isa(shardd__isa isa);

#endif /* SHARDD_OPTIM_H */
