/* test_frozen.c — frozen ranges and stale handles (issue 9) against a real
 * shardd with --devices 4, through libshardd: a LoRA-like buffer with
 * frozen base views and trainable adapter views; scatter leaves frozen
 * reduced-gradient elements untouched while trainable ones reduce exactly;
 * steps change only trainable elements (frozen ones stay bit-identical);
 * stale ids and generations are refused with E_STALE naming the current
 * handle; inspect shows generations and frozen ranges, as text and JSON.
 * Expected values are computed here from the definitions. */
#include <criterion/criterion.h>
#include <inttypes.h>
#include <math.h>
#include <pthread.h>

#include "harness.h"

#define W 4
#define NUMEL 62 /* shard 16, padded 64 */
#define SENTINEL (-7.0f)

static test_daemon d;

static void start4(void) {
  const char *args[] = {"--devices", "4", NULL};
  test_daemon_start(&d, args);
}

static void stop_daemon(void) { test_daemon_finish(&d); }

TestSuite(frozen, .init = start4, .fini = stop_daemon);

typedef struct {
  shardd_client_t *c;
  int kind; /* 0 scatter, 1 step */
  uint64_t id;
  shardd_err rc;
  pthread_t th;
} call;

static void *call_main(void *p) {
  call *k = p;
  shardd_step_opts so = SHARDD_STEP_OPTS_INIT;
  k->rc = k->kind == 0 ? shardd_scatter(k->c, k->id, SHARDD_REDUCE_SUM)
                       : shardd_step(k->c, k->id, &so, NULL);
  return NULL;
}

static void all(shardd_client_t **c, int kind, uint64_t id) {
  call k[W];
  for (int r = 0; r < W; r++) {
    k[r] = (call){c[r], kind, id, SHARDD_OK, 0};
    cr_assert_eq(pthread_create(&k[r].th, NULL, call_main, &k[r]), 0);
  }
  for (int r = 0; r < W; r++)
    pthread_join(k[r].th, NULL);
  for (int r = 0; r < W; r++)
    cr_assert_eq(k[r].rc, SHARDD_OK, "rank %d: %s", r, shardd_last_error(c[r]));
}

/* The LoRA layout: base.weight [0,24) and base.bias [40,48) frozen,
 * lora_A [24,40) and lora_B [48,62) trainable. Rank 0's shard [0,16) is
 * wholly frozen, rank 3's [48,64) wholly trainable. */
static int is_frozen(uint64_t i) { return i < 24 || (i >= 40 && i < 48); }

typedef struct {
  shardd_client_t *c[W];
  shardd_buffer_info b[W];
  shardd_view_info base, bias, la, lb;
} lora;

static void view_all(lora *L, const char *name, uint64_t off, uint64_t n,
                     int requires_grad, shardd_view_info *out) {
  int64_t shape[1] = {(int64_t)n};
  shardd_view_opts o = SHARDD_VIEW_OPTS_INIT;
  o.requires_grad = requires_grad;
  o.buffer_generation = L->b[0].generation;
  for (int r = 0; r < W; r++) {
    shardd_view_info vi;
    cr_assert_eq(shardd_view_register_ex(L->c[r], L->b[0].id, name, off, n, shape,
                                         1, &o, &vi),
                 SHARDD_OK, "rank %d view %s: %s", r, name,
                 shardd_last_error(L->c[r]));
    cr_assert_eq(vi.created, r == 0);
    if (r == 0)
      *out = vi;
    cr_assert_eq(vi.id, out->id);
  }
  cr_expect_eq(out->generation, 1);
}

static void lora_open(lora *L, const char *job) {
  memset(L, 0, sizeof *L);
  for (int r = 0; r < W; r++) {
    L->c[r] = test_connect(&d, job, (uint32_t)r, W);
    cr_assert_eq(shardd_buffer_register(L->c[r], "block0", SHARDD_DTYPE_FP32, NUMEL,
                                        &L->b[r]),
                 SHARDD_OK, "%s", shardd_last_error(L->c[r]));
    cr_assert_eq(L->b[r].generation, 1);
  }
  cr_assert_eq(L->b[0].shard_numel, 16);
  view_all(L, "base.weight", 0, 24, 0, &L->base);
  view_all(L, "lora_A", 24, 16, 1, &L->la);
  view_all(L, "base.bias", 40, 8, 0, &L->bias);
  view_all(L, "lora_B", 48, 14, 1, &L->lb);
}

static void lora_close(lora *L) {
  for (int r = 0; r < W; r++)
    shardd_close(L->c[r]);
}

static void write_grads(lora *L, int step) {
  for (int r = 0; r < W; r++) {
    float *g = L->b[r].grad;
    for (uint64_t i = 0; i < L->b[r].padded_numel; i++)
      g[i] = (float)(r + 1) * (float)(i + 1) * 0.5f * (float)step;
  }
}

Test(frozen, scatter_leaves_frozen_elements_and_reduces_trainable_exactly) {
  lora L;
  lora_open(&L, "lora-scatter");
  write_grads(&L, 1);
  for (int r = 0; r < W; r++) {
    float *red = L.b[r].reduced;
    for (uint64_t k = 0; k < 16; k++)
      red[k] = SENTINEL;
  }
  all(L.c, 0, L.b[0].id);
  for (int r = 0; r < W; r++) {
    const float *red = L.b[r].reduced;
    for (uint64_t k = 0; k < 16; k++) {
      uint64_t i = (uint64_t)r * 16 + k;
      /* sum over ranks of (r+1)(i+1)/2 = 5(i+1), exact in fp32 */
      float want = is_frozen(i) ? SENTINEL : 5.0f * (float)(i + 1);
      cr_expect_eq(red[k], want, "rank %d element %" PRIu64 ": %g, want %g (%s)", r,
                   i, red[k], want, is_frozen(i) ? "frozen: untouched" : "reduced");
    }
  }
  lora_close(&L);
}

Test(frozen, steps_change_only_trainable_elements) {
  lora L;
  lora_open(&L, "lora-step");
  float before[W][16];
  for (int r = 0; r < W; r++) {
    float *p = L.b[r].shard;
    for (uint64_t k = 0; k < 16; k++)
      p[k] = 1.0f + 0.25f * (float)(r * 16 + k);
    memcpy(before[r], p, sizeof before[r]);
  }
  shardd_param_ref refs[2] = {{L.la.id, "lora_A"}, {L.lb.id, "lora_B"}};
  shardd_param_group grp = {refs, 2, {0}};
  shardd_hparams hp = {0};
  hp.set = SHARDD_HP_LR | SHARDD_HP_WEIGHT_DECAY;
  hp.lr = 0.5;
  hp.weight_decay = 0.1;
  uint64_t opt = 0;
  for (int r = 0; r < W; r++) {
    uint64_t got;
    cr_assert_eq(shardd_optimizer_register(L.c[r], "peft", SHARDD_OPTIM_SGD, &hp, &grp,
                                           1, &got),
                 SHARDD_OK, "%s", shardd_last_error(L.c[r]));
    opt = got;
  }
  /* reference: SGD with weight decay, p -= lr * (g + wd * p), fp32 */
  float ref[W][16];
  memcpy(ref, before, sizeof ref);
  for (int step = 1; step <= 2; step++) {
    write_grads(&L, step);
    all(L.c, 0, L.b[0].id);
    all(L.c, 1, opt);
    for (int r = 0; r < W; r++)
      for (uint64_t k = 0; k < 16; k++) {
        uint64_t i = (uint64_t)r * 16 + k;
        if (is_frozen(i) || i >= NUMEL)
          continue;
        float g = 5.0f * (float)(i + 1) * (float)step;
        ref[r][k] = ref[r][k] - 0.5f * (g + 0.1f * ref[r][k]);
      }
  }
  for (int r = 0; r < W; r++) {
    const float *p = L.b[r].shard;
    for (uint64_t k = 0; k < 16; k++) {
      uint64_t i = (uint64_t)r * 16 + k;
      if (is_frozen(i) || i >= NUMEL) {
        cr_expect(memcmp(&p[k], &before[r][k], sizeof(float)) == 0,
                  "element %" PRIu64 " (frozen or padding) changed: %g -> %g", i,
                  before[r][k], p[k]);
      } else {
        cr_expect(fabsf(p[k] - ref[r][k]) <= 1e-5f * fabsf(ref[r][k]) + 1e-5f,
                  "element %" PRIu64 ": %g, want %g", i, p[k], ref[r][k]);
        cr_expect(p[k] != before[r][k], "trainable element %" PRIu64 " moved", i);
      }
    }
  }
  lora_close(&L);
}

Test(frozen, whole_buffers_holding_frozen_views_are_refused_through_the_client) {
  lora L;
  lora_open(&L, "lora-refuse");
  shardd_param_ref refs[3] = {{L.base.id, "base.weight"},
                              {L.la.id, "lora_A"},
                              {L.b[0].id, "block0"}};
  shardd_param_group g[2] = {{refs, 2, {0}}, {refs + 2, 1, {0}}};
  uint64_t id = 99;
  cr_assert_eq(shardd_optimizer_register(L.c[0], NULL, SHARDD_OPTIM_ADAM, NULL, g, 2, &id),
               SHARDD_E_INVAL);
  cr_expect_eq(id, 0);
  const char *e = shardd_last_error(L.c[0]);
  /* the frozen view itself is accepted (torch accepts it, and skips it) */
  cr_expect(strstr(e, "base.weight\"): view") == NULL, "%s", e);
  cr_expect(strstr(e, "param group 1, ref 0 (\"block0\"): buffer") != NULL, "%s", e);
  cr_expect(strstr(e, "holds frozen views (requires_grad=false)") != NULL, "%s", e);
  lora_close(&L);
}

/* ---- torch's skip semantics (issue 18) ------------------------------------
 * Reference: torch.optim.AdamW 1.13 single-tensor, per parameter, computed
 * here in double: a parameter whose grad is None (frozen, or no rank had
 * one) is skipped whole and its own step count stays. */

#define LR 0.01
#define WD 0.1
#define B1 0.9
#define B2 0.999
#define EPS 1e-8

typedef struct {
  double p[64], m[64], v[64];
  int t[64]; /* each element's parameter's step count */
} adamw_ref;

static void adamw_elem(adamw_ref *R, uint64_t i, double g) {
  int t = ++R->t[i];
  R->p[i] *= 1.0 - LR * WD;
  R->m[i] = B1 * R->m[i] + (1 - B1) * g;
  R->v[i] = B2 * R->v[i] + (1 - B2) * g * g;
  double bc1 = 1 - pow(B1, t), bc2 = 1 - pow(B2, t);
  R->p[i] -= LR / bc1 * R->m[i] / (sqrt(R->v[i]) / sqrt(bc2) + EPS);
}

static uint64_t register_all_views(lora *L, const char *name) {
  shardd_param_ref refs[4] = {{L->base.id, "base.weight"},
                              {L->la.id, "lora_A"},
                              {L->bias.id, "base.bias"},
                              {L->lb.id, "lora_B"}};
  shardd_param_group grp = {refs, 4, {0}};
  shardd_hparams hp = {0};
  hp.set = SHARDD_HP_LR | SHARDD_HP_WEIGHT_DECAY;
  hp.lr = LR;
  hp.weight_decay = WD;
  uint64_t opt = 0;
  for (int r = 0; r < W; r++)
    cr_assert_eq(shardd_optimizer_register(L->c[r], name, SHARDD_OPTIM_ADAMW, &hp,
                                           &grp, 1, &opt),
                 SHARDD_OK, "%s", shardd_last_error(L->c[r]));
  return opt;
}

static void seed_shards(lora *L, adamw_ref *R) {
  memset(R, 0, sizeof *R);
  for (int r = 0; r < W; r++) {
    float *p = L->b[r].shard;
    for (uint64_t k = 0; k < 16; k++) {
      p[k] = 1.0f + 0.25f * (float)(r * 16 + k);
      R->p[r * 16 + k] = p[k];
    }
  }
}

static float *shard_of(lora *L, int r) { return (float *)L->b[r].shard; }
static float shard_at(lora *L, uint64_t i) { return shard_of(L, (int)(i / 16))[i % 16]; }

static void expect_ref(lora *L, const adamw_ref *R, const char *when) {
  for (uint64_t i = 0; i < NUMEL; i++) {
    double got = shard_at(L, i), want = R->p[i];
    cr_expect(fabs(got - want) <= 1e-5 * fabs(want),
              "%s: element %" PRIu64 " = %.9g, want %.9g (step %d)", when, i, got,
              want, R->t[i]);
  }
}

static uint64_t view_steps(lora *L, uint64_t view) {
  char *js = NULL;
  cr_assert_eq(shardd_inspect_json(L->c[0], view, NULL, &js), SHARDD_OK);
  tj *j = tj_parse(js);
  cr_assert_not_null(j, "%s", js);
  uint64_t n = (uint64_t)tj_need(j, "steps", TJ_NUM)->num;
  tj_free(j);
  shardd_free(js);
  return n;
}

Test(frozen, frozen_views_in_an_optimizer_are_skipped_until_unfrozen) {
  lora L;
  lora_open(&L, "lora-skip");
  adamw_ref R;
  seed_shards(&L, &R);
  uint64_t opt = register_all_views(&L, "all");
  float base0[W][16];
  for (int r = 0; r < W; r++)
    memcpy(base0[r], L.b[r].shard, sizeof base0[r]);
  for (int step = 1; step <= 4; step++) {
    if (step == 3) /* gradual unfreezing: one rank says it for the job */
      cr_assert_eq(shardd_view_set_requires_grad(L.c[1], L.base.id, 1), SHARDD_OK,
                   "%s", shardd_last_error(L.c[1]));
    write_grads(&L, step);
    all(L.c, 0, L.b[0].id);
    all(L.c, 1, opt);
    for (uint64_t i = 0; i < NUMEL; i++) {
      int frozen = (i >= 40 && i < 48) || (i < 24 && step < 3);
      if (!frozen)
        adamw_elem(&R, i, 5.0 * (double)(i + 1) * 0.5 * step * 2);
    }
    if (step == 2)
      for (int r = 0; r < W; r++)
        for (uint64_t k = 0; k < 16; k++) {
          uint64_t i = (uint64_t)r * 16 + k;
          if (is_frozen(i))
            cr_expect(memcmp(&shard_of(&L, r)[k], &base0[r][k], sizeof(float)) == 0,
                      "frozen element %" PRIu64 " changed", i);
        }
  }
  expect_ref(&L, &R, "after 4 steps");
  /* bias.weight stayed frozen: bit-identical; base.weight took 2 steps of
   * its own (bias correction from 1), the adapters 4 */
  for (uint64_t i = 40; i < 48; i++)
    cr_expect(memcmp(&shard_of(&L, (int)(i / 16))[i % 16], &base0[i / 16][i % 16],
                     sizeof(float)) == 0, "frozen bias element %" PRIu64 " changed", i);
  cr_expect_eq(view_steps(&L, L.base.id), 2);
  cr_expect_eq(view_steps(&L, L.bias.id), 0);
  cr_expect_eq(view_steps(&L, L.la.id), 4);
  /* frozen again: refused where it would meet a trainable view, never
   * half-applied; allowed otherwise */
  cr_expect_eq(shardd_view_set_requires_grad(L.c[0], L.base.id, 0), SHARDD_OK, "%s",
               shardd_last_error(L.c[0]));
  lora_close(&L);
}

typedef struct {
  shardd_client_t *c;
  uint64_t buf;
  const uint64_t *no_grad;
  size_t n;
  int all;
  shardd_err rc;
  pthread_t th;
} mcall;

static void *mcall_main(void *p) {
  mcall *k = p;
  shardd_scatter_opts so = SHARDD_SCATTER_OPTS_INIT;
  so.no_grad = k->no_grad;
  so.nno_grad = k->n;
  so.no_grad_all = k->all;
  k->rc = shardd_scatter_ex(k->c, k->buf, &so);
  return NULL;
}

/* Every rank scatters with its own mask: masks[r] (n[r] ids), all[r]. */
static void scatter_masked(lora *L, const uint64_t *const *masks, const size_t *n,
                           const int *all_none) {
  mcall k[W];
  for (int r = 0; r < W; r++) {
    k[r] = (mcall){L->c[r], L->b[0].id, masks[r], n[r], all_none[r], SHARDD_OK, 0};
    cr_assert_eq(pthread_create(&k[r].th, NULL, mcall_main, &k[r]), 0);
  }
  for (int r = 0; r < W; r++)
    pthread_join(k[r].th, NULL);
  for (int r = 0; r < W; r++)
    cr_assert_eq(k[r].rc, SHARDD_OK, "rank %d: %s", r, shardd_last_error(L->c[r]));
}

/* A lora job with nothing frozen (the base views unfrozen), its shards
 * seeded (R the reference) and one optimizer over every view: its id. */
static uint64_t lora_open_trainable(lora *L, const char *job, adamw_ref *R) {
  lora_open(L, job);
  cr_assert_eq(shardd_view_set_requires_grad(L->c[0], L->base.id, 1), SHARDD_OK);
  cr_assert_eq(shardd_view_set_requires_grad(L->c[0], L->bias.id, 1), SHARDD_OK);
  seed_shards(L, R);
  return register_all_views(L, "all");
}

Test(frozen, views_without_a_gradient_on_every_rank_are_skipped) {
  lora L;
  adamw_ref R;
  uint64_t opt = lora_open_trainable(&L, "lora-nograd", &R);
  /* step 1: every view has a gradient everywhere (old clients' scatter);
   * steps 2-3: lora_A none on any rank (the whole buffer none on rank 0),
   * lora_B only on rank 3; step 4: lora_A again, everywhere */
  for (int step = 1; step <= 4; step++) {
    write_grads(&L, step);
    int masked = step == 2 || step == 3;
    for (int r = 0; r < W && masked; r++) {
      float *g = L.b[r].grad; /* the trainer's zeros where .grad is None */
      for (uint64_t i = 0; i < NUMEL; i++)
        if ((i >= 24 && i < 40) || r == 0 || (i >= 48 && r != 3))
          g[i] = 0;
    }
    uint64_t la_lb[2] = {L.la.id, L.lb.id}, la_only[1] = {L.la.id};
    const uint64_t *masks[W] = {NULL, la_lb, la_lb, la_only};
    size_t n[W] = {0, 2, 2, 1};
    int none[W] = {1, 0, 0, 0};
    if (masked)
      scatter_masked(&L, masks, n, none);
    else
      all(L.c, 0, L.b[0].id);
    all(L.c, 1, opt);
    for (uint64_t i = 0; i < NUMEL; i++) {
      double g = 0;
      for (int r = 0; r < W; r++)
        g += (double)((float *)L.b[r].grad)[i];
      if (masked && i >= 24 && i < 40)
        continue; /* no gradient anywhere: skipped */
      adamw_elem(&R, i, g);
    }
    expect_ref(&L, &R, step == 2 ? "step 2" : step == 3 ? "step 3" : "step 1 or 4");
  }
  cr_expect_eq(view_steps(&L, L.la.id), 2);
  cr_expect_eq(view_steps(&L, L.lb.id), 4);
  cr_expect_eq(view_steps(&L, L.base.id), 4);
  /* a mask naming what is not a view of the buffer is refused at once */
  uint64_t bad[1] = {L.b[0].id};
  shardd_scatter_opts so = SHARDD_SCATTER_OPTS_INIT;
  so.no_grad = bad;
  so.nno_grad = 1;
  cr_expect_eq(shardd_scatter_ex(L.c[0], L.b[0].id, &so), SHARDD_E_NOT_FOUND);
  cr_expect(strstr(shardd_last_error(L.c[0]), "is not a view of it") != NULL, "%s",
            shardd_last_error(L.c[0]));
  lora_close(&L);
}

Test(frozen, freezing_and_unfreezing_keep_frozen_and_trainable_apart) {
  lora L;
  lora_open(&L, "lora-flip");
  int64_t shape[1] = {8};
  shardd_view_opts o = SHARDD_VIEW_OPTS_INIT;
  o.requires_grad = 0;
  shardd_view_info inner;
  /* a second frozen view inside base.weight: unfreezing either alone would
   * leave frozen elements inside a trainable view */
  cr_assert_eq(shardd_view_register_ex(L.c[0], L.b[0].id, "base.inner", 8, 8, shape, 1,
                                       &o, &inner),
               SHARDD_OK, "%s", shardd_last_error(L.c[0]));
  cr_expect_eq(shardd_view_set_requires_grad(L.c[0], L.base.id, 1), SHARDD_E_OVERLAP);
  cr_expect(strstr(shardd_last_error(L.c[0]), "overlaps frozen view") != NULL, "%s",
            shardd_last_error(L.c[0]));
  cr_assert_eq(shardd_view_unregister(L.c[0], inner.id), SHARDD_OK);
  cr_expect_eq(shardd_view_set_requires_grad(L.c[0], L.base.id, 1), SHARDD_OK, "%s",
               shardd_last_error(L.c[0]));
  /* now scatter reduces its elements; inspect shows it trainable */
  char *text = NULL;
  cr_assert_eq(shardd_inspect_text(L.c[0], L.b[0].id, NULL, &text), SHARDD_OK);
  cr_expect(strstr(text, "frozen: 1 range, 8 elements\n") != NULL, "%s", text);
  shardd_free(text);
  write_grads(&L, 1);
  all(L.c, 0, L.b[0].id);
  cr_expect_eq(((float *)L.b[0].reduced)[3], 5.0f * 4.0f, "base.weight element 3 reduced");
  /* a trainable view inside a frozen one cannot be frozen... the other
   * way: freezing lora_A while a trainable view overlaps it is refused */
  shardd_view_info over;
  int64_t s4[1] = {4};
  cr_assert_eq(shardd_view_register_ex(L.c[0], L.b[0].id, "lora_A.part", 30, 4, s4, 1,
                                       NULL, &over),
               SHARDD_OK, "%s", shardd_last_error(L.c[0]));
  cr_expect_eq(shardd_view_set_requires_grad(L.c[0], L.la.id, 0), SHARDD_E_OVERLAP);
  cr_expect(strstr(shardd_last_error(L.c[0]), "overlaps trainable view") != NULL, "%s",
            shardd_last_error(L.c[0]));
  lora_close(&L);
}

Test(frozen, stale_handles_are_refused_naming_the_current_one) {
  shardd_client_t *c = test_connect(&d, "stale", 0, 1);
  shardd_buffer_info b1, b2;
  cr_assert_eq(shardd_buffer_register(c, "layer0", SHARDD_DTYPE_FP32, 32, &b1), SHARDD_OK);
  cr_expect_eq(b1.generation, 1);
  int64_t shape[1] = {8};
  shardd_view_info v1, v2;
  cr_assert_eq(shardd_view_register_ex(c, b1.id, "w", 0, 8, shape, 1, NULL, &v1), SHARDD_OK);
  cr_expect_eq(v1.generation, 1);
  cr_assert_eq(shardd_buffer_unregister(c, b1.id), SHARDD_OK);
  cr_assert_eq(shardd_buffer_register(c, "layer0", SHARDD_DTYPE_FP32, 32, &b2), SHARDD_OK);
  cr_expect_eq(b2.generation, 2);
  cr_expect_neq(b2.id, b1.id);
  char want[256];
  snprintf(want, sizeof want,
           "buffer %" PRIu64 " (\"layer0\") is stale: generation 1, current is buffer %" PRIu64
           " generation 2",
           b1.id, b2.id);
  /* a freed id whose name was registered again */
  cr_assert_eq(shardd_gather(c, b1.id), SHARDD_E_STALE);
  cr_expect_str_eq(shardd_last_error(c), want);
  cr_assert_eq(shardd_scatter(c, b1.id, SHARDD_REDUCE_SUM), SHARDD_E_STALE);
  cr_expect_str_eq(shardd_last_error(c), want);
  cr_assert_eq(shardd_buffer_unregister(c, b1.id), SHARDD_E_STALE);
  /* a live id with an old generation */
  cr_assert_eq(shardd_gather_checked(c, b2.id, 1), SHARDD_E_STALE);
  cr_expect(strstr(shardd_last_error(c), "is stale: generation 1, current is buffer") != NULL,
            "%s", shardd_last_error(c));
  cr_assert_eq(shardd_scatter_checked(c, b2.id, 1, SHARDD_REDUCE_SUM), SHARDD_E_STALE);
  shardd_view_opts vo = SHARDD_VIEW_OPTS_INIT;
  vo.buffer_generation = 1;
  cr_assert_eq(shardd_view_register_ex(c, b2.id, "w", 0, 8, shape, 1, &vo, &v2),
               SHARDD_E_STALE);
  /* the current generation works */
  cr_assert_eq(shardd_gather_checked(c, b2.id, 2), SHARDD_OK, "%s", shardd_last_error(c));
  cr_assert_eq(shardd_scatter_checked(c, b2.id, 2, SHARDD_REDUCE_SUM), SHARDD_OK);
  vo.buffer_generation = 2;
  cr_assert_eq(shardd_view_register_ex(c, b2.id, "w", 0, 8, shape, 1, &vo, &v2), SHARDD_OK,
               "%s", shardd_last_error(c));
  cr_expect_eq(v2.generation, 2);
  /* an optimizer naming the old view */
  shardd_param_ref refs[1] = {{v1.id, "w"}};
  shardd_param_group g = {refs, 1, {0}};
  uint64_t opt;
  cr_assert_eq(shardd_optimizer_register(c, NULL, SHARDD_OPTIM_SGD, NULL, &g, 1, &opt),
               SHARDD_E_STALE);
  snprintf(want, sizeof want,
           "param group 0, ref 0 (\"w\"): view %" PRIu64
           " (\"w\") is stale: generation 1, current is view %" PRIu64 " generation 2",
           v1.id, v2.id);
  cr_expect_str_eq(shardd_last_error(c), want);
  shardd_close(c);
}

Test(frozen, inspect_shows_generations_and_frozen_ranges) {
  lora L;
  lora_open(&L, "lora-inspect");
  char *text = NULL;
  cr_assert_eq(shardd_inspect_text(L.c[0], L.b[0].id, NULL, &text), SHARDD_OK);
  cr_expect(strstr(text, "generation: 1\n") != NULL, "%s", text);
  cr_expect(strstr(text, "frozen: 2 ranges, 32 elements\n") != NULL, "%s", text);
  cr_expect(strstr(text, "frozen range: [0, 24)\nfrozen range: [40, 48)\n") != NULL, "%s",
            text);
  char want[128];
  snprintf(want, sizeof want,
           "view %" PRIu64 " base.weight: [0, 24) shape [24] generation 1 requires_grad false\n",
           L.base.id);
  cr_expect(strstr(text, want) != NULL, "missing %s in\n%s", want, text);
  snprintf(want, sizeof want,
           "view %" PRIu64 " lora_A: [24, 40) shape [16] generation 1 requires_grad true\n",
           L.la.id);
  cr_expect(strstr(text, want) != NULL, "missing %s in\n%s", want, text);
  shardd_free(text);
  cr_assert_eq(shardd_inspect_text(L.c[0], L.bias.id, NULL, &text), SHARDD_OK);
  cr_expect(strstr(text, "requires_grad: false\n") != NULL, "%s", text);
  cr_expect(strstr(text, "generation: 1\n") != NULL, "%s", text);
  shardd_free(text);

  char *js = NULL;
  cr_assert_eq(shardd_inspect_json(L.c[0], L.b[0].id, NULL, &js), SHARDD_OK);
  tj *j = tj_parse(js);
  cr_assert_not_null(j, "%s", js);
  cr_expect_eq(tj_need(j, "generation", TJ_NUM)->num, 1);
  const tj *fr = tj_need(j, "frozen", TJ_ARR);
  cr_assert_eq(fr->n, 2);
  cr_expect_eq(tj_need(fr->kids[0], "offset", TJ_NUM)->num, 0);
  cr_expect_eq(tj_need(fr->kids[0], "numel", TJ_NUM)->num, 24);
  cr_expect_eq(tj_need(fr->kids[1], "offset", TJ_NUM)->num, 40);
  cr_expect_eq(tj_need(fr->kids[1], "numel", TJ_NUM)->num, 8);
  const tj *vs = tj_need(j, "views", TJ_ARR);
  cr_assert_eq(vs->n, 4);
  int want_rg[4] = {0, 1, 0, 1}; /* offset order */
  for (size_t i = 0; i < 4; i++) {
    cr_expect_eq(tj_need(vs->kids[i], "requires_grad", TJ_BOOL)->boolean, want_rg[i],
                 "view %zu", i);
    cr_expect_eq(tj_need(vs->kids[i], "generation", TJ_NUM)->num, 1);
  }
  tj_free(j);
  shardd_free(js);
  cr_assert_eq(shardd_inspect_json(L.c[0], L.base.id, NULL, &js), SHARDD_OK);
  j = tj_parse(js);
  cr_assert_not_null(j, "%s", js);
  cr_expect_eq(tj_need(j, "requires_grad", TJ_BOOL)->boolean, 0);
  cr_expect_eq(tj_need(j, "generation", TJ_NUM)->num, 1);
  tj_free(j);
  shardd_free(js);
  lora_close(&L);
}

typedef struct {
  shardd_client_t *c;
  uint64_t buf;
  shardd_scatter_opts so;
  shardd_err rc;
  pthread_t th;
} bcall;

static void *bcall_main(void *p) {
  bcall *k = p;
  k->rc = shardd_scatter_many_ex(k->c, 1, &k->buf, &k->so, NULL);
  return NULL;
}

/* A request is decoded into memory the next request's decoding reuses
 * (the dispatcher's arena): a queued collective keeps its own copy of
 * what it needs past its request. Ranks 0-2 send a bucket scatter whose
 * mask names lora_A and wait in it; rank 3's, sent last, names lora_B
 * alone, decoded over the bytes the first three were read from. A mask
 * kept by pointer would read lora_B for all four and skip it, though
 * ranks 0-2 brought its gradient. */
Test(frozen, a_queued_bucket_keeps_its_mask_past_the_next_request) {
  lora L;
  adamw_ref R;
  uint64_t opt = lora_open_trainable(&L, "lora-arena", &R);
  write_grads(&L, 1);
  uint64_t la[1] = {L.la.id}, lb[1] = {L.lb.id};
  bcall k[W];
  for (int r = 0; r < W; r++) {
    k[r] = (bcall){.c = L.c[r], .buf = L.b[0].id, .so = SHARDD_SCATTER_OPTS_INIT};
    k[r].so.no_grad = r < 3 ? la : lb;
    k[r].so.nno_grad = 1;
    cr_assert_eq(pthread_create(&k[r].th, NULL, bcall_main, &k[r]), 0);
    usleep(100 * 1000); /* queued before the next rank sends */
  }
  for (int r = 0; r < W; r++) {
    pthread_join(k[r].th, NULL);
    cr_assert_eq(k[r].rc, SHARDD_OK, "rank %d: %s", r, shardd_last_error(L.c[r]));
  }
  all(L.c, 1, opt);
  cr_expect_eq(view_steps(&L, L.la.id), 1, "lora_A had a gradient on rank 3");
  cr_expect_eq(view_steps(&L, L.lb.id), 1, "lora_B had a gradient on ranks 0-2");
  cr_expect_eq(view_steps(&L, L.base.id), 1);
  lora_close(&L);
}
