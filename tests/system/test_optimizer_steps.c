/* test_optimizer_steps.c — the optimizer step across the ranks of a job
 * against a real shardd, checked against a reference written from
 * torch.optim's formulas (not kernels/optim.c); and a step a trainer can
 * retry. */
#include <criterion/criterion.h>
#include <criterion/parameterized.h>
#include <float.h>
#include <math.h>
#include <pthread.h>

#include "harness.h"
#include "collective_fixture.h"

/* ---- optimizer reference (torch.optim formulas, in float) ---------------- */

typedef struct {
  float *p, *buf, *m, *v, *vmax;
  size_t n;
} ref_state;

/* torch.optim.SGD, one element, step t (1-based). */
static void ref_sgd(const ref_hp *h, int t, float *p, float g, float *buf) {
  float dp = h->maximize ? -g : g;
  if (h->wd != 0)
    dp = dp + (float)h->wd * *p;
  if (h->momentum != 0) {
    if (t == 1)
      *buf = dp;
    else
      *buf = *buf * (float)h->momentum + (float)(1 - h->dampening) * dp;
    dp = h->nesterov ? dp + (float)h->momentum * *buf : *buf;
  }
  *p = *p - (float)h->lr * dp;
}

/* torch.optim.Adam / AdamW (torch 2.x single-tensor form: lerp for the
 * first moment), one element, step t. */
static void ref_adam(const ref_hp *h, int t, float *p, float g, float *m, float *v,
                     float *vmax) {
  if (h->maximize)
    g = -g;
  if (h->kind == SHARDD_OPTIM_ADAMW)
    *p = *p * (float)(1 - h->lr * h->wd);
  else if (h->wd != 0)
    g = g + (float)h->wd * *p;
  *m = *m + (float)(1 - h->beta1) * (g - *m);
  *v = *v * (float)h->beta2 + (float)(1 - h->beta2) * g * g;
  double bc1 = 1 - pow(h->beta1, t), bc2 = 1 - pow(h->beta2, t);
  double step_size = h->lr / bc1;
  float s = *v;
  if (h->amsgrad) {
    *vmax = fmaxf(*vmax, *v);
    s = *vmax;
  }
  float denom = sqrtf(s) / (float)sqrt(bc2) + (float)h->eps;
  *p = *p - (float)step_size * (*m / denom);
}

typedef struct {
  const char *name;
  uint64_t off, numel;
  int64_t shape[2];
  int ndim;
  int group;
} view_spec;

static float step_grad(int r, int t, size_t j) {
  return (float)((int)((j * 31 + (size_t)r * 17 + (size_t)t * 7) % 64) - 32) / 256.0f;
}

/* The mean over 4 ranks, exact. */
static float mean_grad(int t, size_t j) {
  double s = 0;
  for (int r = 0; r < 4; r++)
    s += step_grad(r, t, j);
  return (float)(s / 4);
}

static void write_params(const shardd_buffer_info *b) {
  for (int r = 0; r < 4; r++)
    for (size_t i = 0; i < b[r].shard_numel; i++)
      ((float *)b[r].shard)[i] = init_param((size_t)r * b[r].shard_numel + i);
}

static void write_step_grads(const shardd_buffer_info *b, int t) {
  for (int r = 0; r < 4; r++)
    for (size_t j = 0; j < b[r].padded_numel; j++)
      ((float *)b[r].grad)[j] = step_grad(r, t, j);
}

static double rel_err(float got, float want) {
  return fabs((double)got - (double)want) / fmax(fabs((double)want), 1e-30);
}

/* Every rank's gather area against the reference; elements outside any view
 * must be bit-identical to their initial values. */
static void check_params(const shardd_buffer_info *b, const float *want, const char *what) {
  double worst = 0;
  size_t worst_j = 0;
  for (int r = 0; r < 4; r++)
    for (size_t j = 0; j < b[r].padded_numel; j++) {
      float got = f32_at(b[r].gather, j);
      cr_assert(isfinite(got), "%s: rank %d element %zu = %g", what, r, j, (double)got);
      double e = rel_err(got, want[j]);
      if (e > worst) {
        worst = e;
        worst_j = j;
      }
    }
  cr_assert_leq(worst, 1e-6, "%s: element %zu off by %.3g relative (got %.9g, want %.9g)",
                what, worst_j, worst, (double)f32_at(b[0].gather, worst_j),
                (double)want[worst_j]);
  /* shards agree with the gathered copy */
  size_t s = b[0].shard_numel;
  for (int r = 0; r < 4; r++)
    cr_assert_eq(memcmp(b[r].shard, (float *)b[0].gather + (size_t)r * s, s * 4), 0);
}

Test(collective, steps_sgd_momentum_and_adamw_over_views, .init = start4, .fini = stop_daemon, .timeout = 60) {
  team t;
  team_open(&t, "train", 4);
  /* buffer S: 1030 fp32 -> shards of 258 (0, 258, 516, 774), 2 padding */
  shardd_buffer_info bs[MAXW], ba[MAXW];
  team_buffer(&t, "S", SHARDD_DTYPE_FP32, 1030, bs);
  /* buffer A: 999 fp32 -> shards of 250, 1 padding */
  team_buffer(&t, "A", SHARDD_DTYPE_FP32, 999, ba);
  const view_spec sv[] = {
      {"l1.weight", 0, 600, {20, 30}, 2, 0}, /* crosses shards 0|1|2 */
      {"l1.bias", 600, 20, {20, 0}, 1, 0},
      {"l2.weight", 700, 300, {10, 30}, 2, 1}, /* crosses 2|3 */
  };
  const view_spec av[] = {
      {"a.w", 0, 400, {20, 20}, 2, 0}, /* crosses 0|1 */
      {"a.b", 400, 10, {10, 0}, 1, 0},
      {"a.v", 500, 499, {499, 0}, 1, 1}, /* crosses 2|3, ends at numel */
  };
  uint64_t sid[3], aid[3];
  for (int i = 0; i < 3; i++) {
    team_view(&t, bs[0].id, sv[i].name, sv[i].off, sv[i].numel, sv[i].shape, sv[i].ndim, &sid[i]);
    team_view(&t, ba[0].id, av[i].name, av[i].off, av[i].numel, av[i].shape, av[i].ndim, &aid[i]);
  }
  ref_hp sgd0 = {SHARDD_OPTIM_SGD, 0.1, 0.9, 0.1, 0.01, 0, 0, 0, 0, 0, 0};
  ref_hp sgd1 = sgd0;
  sgd1.lr = 0.05;
  sgd1.nesterov = 1;
  sgd1.dampening = 0;
  ref_hp adw0 = {SHARDD_OPTIM_ADAMW, 0.01, 0, 0, 0.05, 0.9, 0.99, 1e-8, 0, 0, 0};
  ref_hp adw1 = adw0;
  adw1.lr = 0.02;
  adw1.wd = 0;
  adw1.amsgrad = 1;

  shardd_hparams top;
  hp_set(&top, &sgd0);
  shardd_param_ref sg0[] = {{sid[0], "l1.weight"}, {sid[1], "l1.bias"}};
  shardd_param_ref sg1[] = {{sid[2], "l2.weight"}};
  shardd_param_group sgroups[2] = {{sg0, 2, {0}}, {sg1, 1, {0}}};
  sgroups[1].overrides.set = SHARDD_HP_LR | SHARDD_HP_NESTEROV | SHARDD_HP_DAMPENING;
  sgroups[1].overrides.lr = sgd1.lr;
  sgroups[1].overrides.nesterov = 1;
  sgroups[1].overrides.dampening = 0;
  uint64_t osgd, oadw;
  team_optimizer(&t, "sgd", SHARDD_OPTIM_SGD, &top, sgroups, 2, &osgd);

  hp_set(&top, &adw0);
  shardd_param_ref ag0[] = {{aid[0], "a.w"}, {aid[1], "a.b"}};
  shardd_param_ref ag1[] = {{aid[2], "a.v"}};
  shardd_param_group agroups[2] = {{ag0, 2, {0}}, {ag1, 1, {0}}};
  agroups[1].overrides.set = SHARDD_HP_LR | SHARDD_HP_WEIGHT_DECAY | SHARDD_HP_AMSGRAD;
  agroups[1].overrides.lr = adw1.lr;
  agroups[1].overrides.weight_decay = 0;
  agroups[1].overrides.amsgrad = 1;
  team_optimizer(&t, "adamw", SHARDD_OPTIM_ADAMW, &top, agroups, 2, &oadw);

  /* reference state over the padded arrays; group -1 = not in a view */
  size_t ns = bs[0].padded_numel, na = ba[0].padded_numel;
  float *ps = calloc(ns, 4), *buf = calloc(ns, 4);
  float *pa = calloc(na, 4), *m = calloc(na, 4), *v = calloc(na, 4), *vmax = calloc(na, 4);
  int *gs = malloc(ns * sizeof(int)), *ga = malloc(na * sizeof(int));
  for (size_t j = 0; j < ns; j++) {
    ps[j] = init_param(j);
    gs[j] = -1;
  }
  for (size_t j = 0; j < na; j++) {
    pa[j] = init_param(j);
    ga[j] = -1;
  }
  for (int i = 0; i < 3; i++) {
    for (uint64_t j = sv[i].off; j < sv[i].off + sv[i].numel; j++)
      gs[j] = sv[i].group;
    for (uint64_t j = av[i].off; j < av[i].off + av[i].numel; j++)
      ga[j] = av[i].group;
  }
  write_params(bs);
  write_params(ba);

  for (int step = 1; step <= 3; step++) {
    write_step_grads(bs, step);
    write_step_grads(ba, step);
    team_all(&t, OP_SCATTER, bs[0].id, SHARDD_REDUCE_MEAN);
    team_all(&t, OP_SCATTER, ba[0].id, SHARDD_REDUCE_MEAN);
    shardd_step_result res[MAXW];
    team_all_res(&t, OP_STEP, osgd, 0, NULL, res);
    for (int r = 0; r < 4; r++)
      cr_assert_eq(res[r].step, (uint64_t)step, "rank %d: sgd step count %llu", r,
                   (unsigned long long)res[r].step);
    team_all_res(&t, OP_STEP, oadw, 0, NULL, res);
    for (int r = 0; r < 4; r++)
      cr_assert_eq(res[r].step, (uint64_t)step);
    for (size_t j = 0; j < ns; j++)
      if (gs[j] >= 0)
        ref_sgd(gs[j] ? &sgd1 : &sgd0, step, &ps[j], mean_grad(step, j), &buf[j]);
    for (size_t j = 0; j < na; j++)
      if (ga[j] >= 0)
        ref_adam(ga[j] ? &adw1 : &adw0, step, &pa[j], mean_grad(step, j), &m[j], &v[j],
                 &vmax[j]);
    team_all(&t, OP_GATHER, bs[0].id, 0);
    team_all(&t, OP_GATHER, ba[0].id, 0);
    char what[64];
    snprintf(what, sizeof what, "SGD after step %d", step);
    check_params(bs, ps, what);
    snprintf(what, sizeof what, "AdamW after step %d", step);
    check_params(ba, pa, what);
  }
  /* outside the views nothing moved, bit for bit */
  for (size_t j = 0; j < ns; j++)
    if (gs[j] < 0)
      cr_assert_eq(f32_bits(f32_at(bs[2].gather, j)), f32_bits(init_param(j)), "S[%zu]", j);
  for (size_t j = 0; j < na; j++)
    if (ga[j] < 0)
      cr_assert_eq(f32_bits(f32_at(ba[1].gather, j)), f32_bits(init_param(j)), "A[%zu]", j);

  double steps = -1;
  cr_assert(status_steps("train", "sgd", &steps), "optimizer sgd not in status");
  cr_assert_eq(steps, 3.0, "status says sgd did %g steps", steps);
  cr_assert(status_steps("train", "adamw", &steps), "optimizer adamw not in status");
  cr_assert_eq(steps, 3.0, "status says adamw did %g steps", steps);

  free(ps);
  free(buf);
  free(pa);
  free(m);
  free(v);
  free(vmax);
  free(gs);
  free(ga);
  team_close(&t);
}

Test(collective, step_max_norm_clips_and_reports_total_norm, .init = start4,
     .fini = stop_daemon, .timeout = 60) {
  team t;
  team_open(&t, "clip", 4);
  shardd_buffer_info b1[MAXW], b2[MAXW];
  team_buffer(&t, "C1", SHARDD_DTYPE_FP32, 1030, b1);
  team_buffer(&t, "C2", SHARDD_DTYPE_FP32, 203, b2); /* shards of 51, 1 padding */
  uint64_t v1, v2;
  int64_t sh1[1] = {300}, sh2[1] = {200};
  team_view(&t, b1[0].id, "w", 100, 300, sh1, 1, &v1); /* crosses 0|1 */
  team_view(&t, b1[0].id, "u", 700, 200, sh2, 1, &v2); /* crosses 2|3 */
  ref_hp h = {SHARDD_OPTIM_SGD, 0.5, 0, 0, 0, 0, 0, 0, 0, 0, 0};
  shardd_hparams top;
  hp_set(&top, &h);
  /* views of C1 and C2 whole (FSDP1 style): the norm spans both */
  shardd_param_ref refs[] = {{v1, "w"}, {v2, "u"}, {b2[0].id, "C2"}};
  shardd_param_group g = {refs, 3, {0}};
  uint64_t opt;
  team_optimizer(&t, "clipped", SHARDD_OPTIM_SGD, &top, &g, 1, &opt);
  write_params(b1);
  write_params(b2);
  float *p1 = malloc(b1[0].padded_numel * 4), *p2 = malloc(b2[0].padded_numel * 4);
  for (size_t j = 0; j < b1[0].padded_numel; j++)
    p1[j] = init_param(j);
  for (size_t j = 0; j < b2[0].padded_numel; j++)
    p2[j] = init_param(j);
  const double max_norms[] = {0.05, 1e9};
  for (int step = 1; step <= 2; step++) {
    /* gradients everywhere, padding and gaps included: only the
     * optimizer's elements may count */
    write_step_grads(b1, step);
    write_step_grads(b2, step);
    team_all(&t, OP_SCATTER, b1[0].id, SHARDD_REDUCE_MEAN);
    team_all(&t, OP_SCATTER, b2[0].id, SHARDD_REDUCE_MEAN);
    double sumsq = 0;
    for (size_t j = 100; j < 400; j++)
      sumsq += (double)mean_grad(step, j) * mean_grad(step, j);
    for (size_t j = 700; j < 900; j++)
      sumsq += (double)mean_grad(step, j) * mean_grad(step, j);
    for (size_t j = 0; j < 203; j++)
      sumsq += (double)mean_grad(step, j) * mean_grad(step, j);
    double want_norm = sqrt(sumsq);
    shardd_step_opts so = SHARDD_STEP_OPTS_INIT;
    so.max_norm = max_norms[step - 1];
    shardd_step_result res[MAXW];
    team_all_res(&t, OP_STEP, opt, 0, &so, res);
    for (int r = 0; r < 4; r++) {
      cr_assert_eq(res[r].step, (uint64_t)step);
      cr_assert_leq(fabs(res[r].total_norm - want_norm), 1e-6 * want_norm,
                    "rank %d: total_norm %.9g, want %.9g", r, res[r].total_norm, want_norm);
    }
    /* torch.nn.utils.clip_grad_norm_: coef = max_norm / (norm + 1e-6), clamped to 1 */
    double coef = so.max_norm / (want_norm + 1e-6);
    float c = (float)(coef < 1 ? coef : 1);
    if (step == 1)
      cr_assert_lt(coef, 0.5, "test must clip");
    for (size_t j = 0; j < b1[0].padded_numel; j++)
      if ((j >= 100 && j < 400) || (j >= 700 && j < 900))
        ref_sgd(&h, step, &p1[j], mean_grad(step, j) * c, NULL);
    for (size_t j = 0; j < 203; j++)
      ref_sgd(&h, step, &p2[j], mean_grad(step, j) * c, NULL);
    team_all(&t, OP_GATHER, b1[0].id, 0);
    team_all(&t, OP_GATHER, b2[0].id, 0);
    check_params(b1, p1, "clipped C1");
    check_params(b2, p2, "clipped C2");
  }
  /* without max_norm no norm is reported */
  shardd_step_result res[MAXW];
  team_all_res(&t, OP_STEP, opt, 0, NULL, res);
  for (int r = 0; r < 4; r++) {
    cr_assert_eq(res[r].step, 3);
    cr_assert_eq(res[r].total_norm, 0.0);
  }
  free(p1);
  free(p2);
  team_close(&t);
}

Test(collective, same_buffer_runs_in_submission_order, .init = start4, .fini = stop_daemon, .timeout = 60) {
  /* each rank pipelines scatter -> step -> gather on one buffer; the gather
   * must see the stepped values and the replies come in that order */
  team t;
  team_open(&t, "order", 4);
  shardd_buffer_info b[MAXW];
  team_buffer(&t, "P", SHARDD_DTYPE_FP32, 4099, b);
  ref_hp h = {SHARDD_OPTIM_SGD, 0.25, 0, 0, 0, 0, 0, 0, 0, 0, 0};
  shardd_hparams top;
  hp_set(&top, &h);
  shardd_param_ref refs[] = {{b[0].id, "P"}};
  shardd_param_group g = {refs, 1, {0}};
  uint64_t opt;
  team_optimizer(&t, "o", SHARDD_OPTIM_SGD, &top, &g, 1, &opt);
  team_close(&t); /* the raw clients take the ranks over */

  test_raw r[4];
  shardd_buffer_info rb[4];
  for (int k = 0; k < 4; k++) {
    raw_hello_when_free(&r[k], "order", (uint32_t)k, 4); /* the team's rank closed */
    test_raw_register_buffer(&r[k], "P", SHARDD_DTYPE_FP32, 4099, &rb[k]);
  }
  write_params(rb);
  write_step_grads(rb, 1);
  uint64_t s1[4], s2[4], s3[4];
  for (int k = 0; k < 4; k++) {
    s1[k] = test_raw_send_scatter(&r[k], rb[0].id, SHARDD_REDUCE_MEAN);
    s2[k] = test_raw_send_step(&r[k], opt);
    s3[k] = test_raw_send_gather(&r[k], rb[0].id);
  }
  for (int k = 0; k < 4; k++) {
    shardwire__response__free_unpacked(test_raw_expect(&r[k], s1[k], SHARDD_OK), NULL);
    Shardwire__Response *resp = test_raw_expect(&r[k], s2[k], SHARDD_OK);
    cr_assert_eq(resp->body_case, SHARDWIRE__RESPONSE__BODY_STEP);
    cr_assert_eq(resp->step->step, 1);
    shardwire__response__free_unpacked(resp, NULL);
    shardwire__response__free_unpacked(test_raw_expect(&r[k], s3[k], SHARDD_OK), NULL);
  }
  float *want = malloc(rb[0].padded_numel * 4);
  for (size_t j = 0; j < rb[0].padded_numel; j++) {
    want[j] = init_param(j);
    if (j < 4099)
      ref_sgd(&h, 1, &want[j], mean_grad(1, j), NULL);
  }
  check_params(rb, want, "gather after a pipelined step");
  free(want);
  for (int k = 0; k < 4; k++)
    test_raw_close(&r[k]);
}

Test(collective, bf16_adam_keeps_an_fp32_master, .init = start4, .fini = stop_daemon, .timeout = 60) {
  team t;
  team_open(&t, "half", 4);
  shardd_buffer_info b[MAXW];
  team_buffer(&t, "H", SHARDD_DTYPE_BF16, 1001, b);
  ref_hp h = {SHARDD_OPTIM_ADAM, 1e-3, 0, 0, 0, 0.9, 0.999, 1e-8, 0, 0, 0};
  shardd_hparams top;
  hp_set(&top, &h);
  shardd_param_ref refs[] = {{b[0].id, "H"}};
  shardd_param_group g = {refs, 1, {0}};
  uint64_t opt;
  team_optimizer(&t, "adam16", SHARDD_OPTIM_ADAM, &top, &g, 1, &opt);
  size_t n = b[0].padded_numel, s = b[0].shard_numel;
  float *master = malloc(n * 4), *m = calloc(n, 4), *v = calloc(n, 4);
  for (int r = 0; r < 4; r++)
    for (size_t i = 0; i < s; i++)
      put_grid(SHARDD_DTYPE_BF16, b[r].shard, i, grad_hash(r, i, 77));
  for (size_t j = 0; j < n; j++)
    master[j] = (float)grid_value(grad_hash((int)(j / s), j % s, 77));
  for (int step = 1; step <= 5; step++) {
    for (int r = 0; r < 4; r++)
      for (size_t j = 0; j < n; j++)
        put_grid(SHARDD_DTYPE_BF16, b[r].grad, j, grad_hash(r, j, 100 + (uint32_t)step));
    team_all(&t, OP_SCATTER, b[0].id, SHARDD_REDUCE_SUM);
    team_all(&t, OP_STEP, opt, 0);
    for (size_t j = 0; j < 1001; j++)
      ref_adam(&h, step, &master[j], expected_reduced(4, j, 100 + (uint32_t)step, 0), &m[j],
               &v[j], NULL);
  }
  team_all(&t, OP_GATHER, b[0].id, 0);
  /* lr 1e-3 over 5 steps moves a value far less than a bf16 ulp sometimes:
   * only an fp32 master keeps those moves; the shard is the master rounded */
  for (size_t j = 0; j < n; j++) {
    uint16_t got;
    memcpy(&got, (char *)b[0].gather + 2 * j, 2);
    uint32_t u = (uint32_t)got << 16;
    float gf;
    memcpy(&gf, &u, 4);
    float want = j < 1001 ? master[j] : (float)grid_value(grad_hash((int)(j / s), j % s, 77));
    /* within one bf16 ulp of the reference master (rounding of a value
     * that itself may differ from ours in its last float bits) */
    double ulp = ldexp(1.0, ilogb(want) - 7);
    cr_assert_leq(fabs((double)gf - want), ulp, "H[%zu] = %.9g, reference master %.9g", j,
                  (double)gf, (double)want);
  }
  /* the master itself, read back (a state dict of a bf16 run needs it):
   * the reference's to float rounding, and the shard its bf16 rounding */
  float *got = malloc(1001 * 4);
  cr_assert_eq(shardd_optim_state_get(t.c[0], opt, b[0].id, SHARDD_OPTIM_MASTER, 0, 1001,
                                      got, NULL), SHARDD_OK, "%s", shardd_last_error(t.c[0]));
  for (size_t j = 0; j < 1001; j++) {
    cr_assert_leq(fabs((double)got[j] - master[j]), 1e-6 * fabs(master[j]) + 1e-12,
                  "master[%zu] = %.9g, reference %.9g", j, (double)got[j], (double)master[j]);
    uint16_t sh;
    memcpy(&sh, (char *)b[0].gather + 2 * j, 2);
    uint32_t u;
    memcpy(&u, &got[j], 4);
    cr_assert_eq(sh, (uint16_t)((u + 0x7fff + ((u >> 16) & 1)) >> 16), "shard[%zu]", j);
  }
  /* a written master (across the shards of ranks 0 and 1) rounds into the
   * shards too and is what is read back */
  float w[8] = {0.1f, -0.2f, 0.3f, 1.0f / 3, 7.77f, -1e-3f, 42.5f, 0.0f};
  size_t at = s - 4;
  cr_assert_eq(shardd_optim_state_set(t.c[1], opt, b[0].id, SHARDD_OPTIM_MASTER, at, 8, w),
               SHARDD_OK, "%s", shardd_last_error(t.c[1]));
  cr_assert_eq(shardd_optim_state_get(t.c[2], opt, b[0].id, SHARDD_OPTIM_MASTER, at, 8,
                                      got, NULL), SHARDD_OK);
  cr_assert_eq(memcmp(got, w, sizeof w), 0);
  for (int k = 0; k < 8; k++) {
    int r = (int)((at + k) / s);
    uint16_t sh;
    memcpy(&sh, (char *)b[r].shard + 2 * ((at + k) % s), 2);
    uint32_t u;
    memcpy(&u, &w[k], 4);
    cr_assert_eq(sh, (uint16_t)((u + 0x7fff + ((u >> 16) & 1)) >> 16), "shard at %zu",
                 at + k);
  }
  free(got);
  free(master);
  free(m);
  free(v);
  team_close(&t);
}

Test(collective, busy_while_in_flight_and_bad_targets, .init = start4, .fini = stop_daemon, .timeout = 60) {
  test_raw r;
  test_raw_open(&d, &r);
  test_raw_hello(&r, "busy", 0, 2);
  shardd_buffer_info b;
  test_raw_register_buffer(&r, "x", SHARDD_DTYPE_FP32, 10, &b);
  uint64_t g = test_raw_send_gather(&r, b.id);
  /* the waiting collective shows in status */
  {
    char args[256], *out;
    snprintf(args, sizeof args, "--socket %s status --json", d.sock);
    cr_assert_eq(test_shardctl(NULL, args, &out, NULL), 0);
    tj *j = tj_parse(out);
    cr_assert_not_null(j, "%s", out);
    const tj *jobs = tj_need(j, "jobs", TJ_ARR);
    cr_assert_eq(jobs->n, 1);
    cr_assert_eq(tj_need(jobs->kids[0], "collectives_in_flight", TJ_NUM)->num, 1.0, "%s", out);
    tj_free(j);
    free(out);
  }
  /* unregistering a buffer a collective waits on is refused */
  Shardwire__Request req = SHARDWIRE__REQUEST__INIT;
  Shardwire__UnregisterBuffer ub = SHARDWIRE__UNREGISTER_BUFFER__INIT;
  ub.id = b.id;
  req.body_case = SHARDWIRE__REQUEST__BODY_UNREGISTER_BUFFER;
  req.unregister_buffer = &ub;
  uint64_t u = test_raw_send(&r, &req);
  shardwire__response__free_unpacked(test_raw_expect(&r, u, SHARDD_E_BUSY), NULL);
  /* unknown ids answer at once, without waiting for rank 1 */
  uint64_t bad = test_raw_send_gather(&r, 999999);
  shardwire__response__free_unpacked(test_raw_expect(&r, bad, SHARDD_E_NOT_FOUND), NULL);
  bad = test_raw_send_step(&r, b.id); /* a buffer is not an optimizer */
  shardwire__response__free_unpacked(test_raw_expect(&r, bad, SHARDD_E_INVAL), NULL);
  /* rank 1 arrives: the gather completes */
  shardd_client_t *c1 = test_connect(&d, "busy", 1, 2);
  shardd_buffer_info b1;
  cr_assert_eq(shardd_buffer_register(c1, "x", SHARDD_DTYPE_FP32, 10, &b1), SHARDD_OK);
  cr_assert_eq(shardd_gather(c1, b1.id), SHARDD_OK, "%s", shardd_last_error(c1));
  shardwire__response__free_unpacked(test_raw_expect(&r, g, SHARDD_OK), NULL);
  shardd_close(c1);
  test_raw_close(&r);
}

Test(collective, step_lr_override_applies_to_every_group, .init = start4, .fini = stop_daemon,
     .timeout = 60) {
  team t;
  team_open(&t, "lr", 4);
  shardd_buffer_info b[MAXW];
  team_buffer(&t, "P", SHARDD_DTYPE_FP32, 777, b);
  uint64_t v0, v1;
  int64_t s0[1] = {300}, s1[1] = {400};
  team_view(&t, b[0].id, "p0", 0, 300, s0, 1, &v0);
  team_view(&t, b[0].id, "p1", 300, 400, s1, 1, &v1);
  ref_hp h = {SHARDD_OPTIM_SGD, 0.25, 0.5, 0, 0, 0, 0, 0, 0, 0, 0};
  shardd_hparams top;
  hp_set(&top, &h);
  shardd_param_ref r0[] = {{v0, "p0"}}, r1[] = {{v1, "p1"}};
  shardd_param_group g[2] = {{r0, 1, {0}}, {r1, 1, {0}}};
  g[1].overrides.set = SHARDD_HP_LR;
  g[1].overrides.lr = 0.125;
  uint64_t opt;
  team_optimizer(&t, "o", SHARDD_OPTIM_SGD, &top, g, 2, &opt);
  write_params(b);
  float *want = malloc(b[0].padded_numel * 4), *buf = calloc(b[0].padded_numel, 4);
  for (size_t j = 0; j < b[0].padded_numel; j++)
    want[j] = init_param(j);
  for (int step = 1; step <= 2; step++) {
    write_step_grads(b, step);
    team_all(&t, OP_SCATTER, b[0].id, SHARDD_REDUCE_MEAN);
    shardd_step_opts so = SHARDD_STEP_OPTS_INIT;
    if (step == 2)
      so.lr = 0.75; /* this step only, every group */
    team_all_res(&t, OP_STEP, opt, 0, &so, NULL);
    ref_hp h0 = h, h1 = h;
    h1.lr = 0.125;
    if (step == 2)
      h0.lr = h1.lr = 0.75;
    for (size_t j = 0; j < 700; j++)
      ref_sgd(j < 300 ? &h0 : &h1, step, &want[j], mean_grad(step, j), &buf[j]);
  }
  team_all(&t, OP_GATHER, b[0].id, 0);
  check_params(b, want, "SGD with an lr override");
  free(want);
  free(buf);
  team_close(&t);
}

/* ---- a step a trainer can retry -------------------------------------------
 * Step.expect_step: a retry of a step that ran (its reply lost) is answered
 * at once on each rank alone, skipped, with the count now, and changes no
 * byte; a count the optimizer is more than one step short of is refused;
 * the next step, sent with its count, runs; in the end the parameters are
 * two SGD steps' worth, not three. */
Test(collective, step_with_expect_step_runs_once, .init = start4, .fini = stop_daemon,
     .timeout = 60) {
  team t;
  team_open(&t, "once", 4);
  shardd_buffer_info b[MAXW];
  team_buffer(&t, "P", SHARDD_DTYPE_FP32, 777, b);
  uint64_t v0;
  int64_t s0[1] = {700};
  team_view(&t, b[0].id, "p0", 0, 700, s0, 1, &v0);
  ref_hp h = {SHARDD_OPTIM_SGD, 0.25, 0.5, 0, 0, 0, 0, 0, 0, 0, 0};
  shardd_hparams top;
  hp_set(&top, &h);
  shardd_param_ref r0[] = {{v0, "p0"}};
  shardd_param_group g[1] = {{r0, 1, {0}}};
  uint64_t opt;
  team_optimizer(&t, "o", SHARDD_OPTIM_SGD, &top, g, 1, &opt);
  write_params(b);
  float *want = malloc(b[0].padded_numel * 4), *buf = calloc(b[0].padded_numel, 4);
  for (size_t j = 0; j < b[0].padded_numel; j++)
    want[j] = init_param(j);
  size_t sb = b[0].shard_numel * 4;
  unsigned char *sv[MAXW];
  for (int step = 1; step <= 2; step++) {
    write_step_grads(b, step);
    team_all(&t, OP_SCATTER, b[0].id, SHARDD_REDUCE_MEAN);
    call calls[MAXW];
    int skipped[MAXW];
    memset(calls, 0, sizeof calls);
    for (int r = 0; r < 4; r++) {
      shardd_step_opts so = SHARDD_STEP_OPTS_INIT;
      so.expect_step = (uint64_t)step;
      skipped[r] = -1;
      so.skipped = &skipped[r];
      calls[r] = (call){.c = t.c[r], .kind = OP_STEP, .id = opt, .so = so};
    }
    run_calls(calls, 4);
    for (int r = 0; r < 4; r++) {
      cr_assert_eq(calls[r].rc, SHARDD_OK, "rank %d step %d: %s", r, step, calls[r].msg);
      cr_assert_eq(skipped[r], 0, "rank %d: step %d was not run", r, step);
      cr_assert_eq(calls[r].res.step, (uint64_t)step);
    }
    for (size_t j = 0; j < 700; j++)
      ref_sgd(&h, step, &want[j], mean_grad(step, j), &buf[j]);
    if (step == 2)
      break;
    /* every rank retries step 1, one after the other: none waits for the
     * others (no collective runs) and no byte changes */
    for (int r = 0; r < 4; r++) {
      sv[r] = malloc(sb);
      memcpy(sv[r], b[r].shard, sb);
    }
    for (int r = 0; r < 4; r++) {
      shardd_step_opts so = SHARDD_STEP_OPTS_INIT;
      shardd_step_result res;
      int sk = -1;
      so.expect_step = 1;
      so.skipped = &sk;
      cr_assert_eq(shardd_step(t.c[r], opt, &so, &res), SHARDD_OK, "rank %d: %s", r,
                   shardd_last_error(t.c[r]));
      cr_assert_eq(sk, 1, "rank %d's retry of step 1 ran", r);
      cr_assert_eq(res.step, 1);
    }
    for (int r = 0; r < 4; r++) {
      cr_assert_eq(memcmp(sv[r], b[r].shard, sb), 0, "rank %d's shard changed", r);
      free(sv[r]);
    }
    /* a trainer two steps ahead of the daemon is told, nothing runs */
    shardd_step_opts so = SHARDD_STEP_OPTS_INIT;
    so.expect_step = 3;
    cr_assert_eq(shardd_step(t.c[0], opt, &so, NULL), SHARDD_E_MISMATCH);
    cr_assert_not_null(strstr(shardd_last_error(t.c[0]), "is at step 1"), "%s",
                       shardd_last_error(t.c[0]));
    double steps = -1;
    cr_assert(status_steps("once", "o", &steps));
    cr_assert_eq(steps, 1.0);
  }
  team_all(&t, OP_GATHER, b[0].id, 0);
  check_params(b, want, "SGD, step 1 retried");
  double steps = -1;
  cr_assert(status_steps("once", "o", &steps));
  cr_assert_eq(steps, 2.0);
  free(want);
  free(buf);
  team_close(&t);
}
