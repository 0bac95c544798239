/* optim_cuda_host.c — the host half of optim_cuda (see optim_cuda.h): the
 * per-step scalars of a kernel update. Plain C with no CUDA dependency, so
 * it builds, and tests/unit/test_optim_cuda.c checks it, without CUDA too. */
#include <math.h>
#include <string.h>

#include "optim_cuda.h"

/* optim.c's sgd_update / adam_update scalars, each computed in double and
 * rounded to float once where they round it. */
void shardd__cuda_fill_upd(const shardd__hp *hp, uint64_t step,
                           float grad_scale, shardd__cuda_upd *k) {
  memset(k, 0, sizeof *k);
  k->scale = hp->maximize ? -grad_scale : grad_scale;
  if (hp->kind == SHARDD_OPTIM_SGD) {
    k->kind = SHARDD__CUDA_SGD;
    k->wd = (float)hp->weight_decay;
    k->mom = (float)hp->momentum;
    k->damp1 = (float)(1.0 - hp->dampening);
    k->neg_lr = (float)-hp->lr;
    /* optim.c skips each op whose coefficient is 0 */
    k->has_wd = hp->weight_decay != 0;
    k->has_mom = hp->momentum != 0;
    k->first = step <= 1;
    k->nesterov = hp->nesterov != 0;
    return;
  }
  double t = (double)step;
  double bc1 = 1.0 - pow(hp->beta1, t);
  double bc2 = 1.0 - pow(hp->beta2, t);
  double step_size = hp->lr / bc1;
  k->kind = SHARDD__CUDA_ADAM;
  k->wd = (float)hp->weight_decay;
  k->keep = (float)(1.0 - hp->lr * hp->weight_decay);
  k->b1 = (float)hp->beta1;
  k->omb1 = (float)(1.0 - hp->beta1);
  k->b2 = (float)hp->beta2;
  k->omb2 = (float)(1.0 - hp->beta2);
  k->bc2_sqrt = (float)sqrt(bc2);
  k->eps = (float)hp->eps;
  k->neg_step = (float)-step_size;
  k->decay = SHARDD__CUDA_DECAY_NONE;
  if (hp->weight_decay != 0)
    k->decay = hp->kind == SHARDD_OPTIM_ADAMW ? SHARDD__CUDA_DECAY_DECOUPLED
                                              : SHARDD__CUDA_DECAY_L2;
  k->amsgrad = hp->amsgrad != 0;
}
