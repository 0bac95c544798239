/* harness_collective.c — what the collective tests share
 * (test_collective.c, test_optimizer_steps.c, test_rank_loss.c): a daemon
 * with --devices 4 per test, a team of libshardd ranks (one thread each per
 * collective), the exact values shards and gradients are filled with and
 * what gathers and scatters must give back, and the status a test reads. */
#include <criterion/criterion.h>
#include <float.h>
#include <math.h>
#include <pthread.h>

#include "collective_fixture.h"
#include "harness.h"

void start4(void) {
  const char *args[] = {"--devices", "4", NULL};
  test_daemon_start(&d, args);
}

/* The test that waits for the timeout on purpose takes this long; 5 s, so
 * that a rank thread that starts late on a loaded machine still arrives
 * before the timeout (the message must name only the rank never called). */
void start4_timeout(void) {
  const char *args[] = {"--devices", "4", "--collective-timeout", "5", NULL};
  test_daemon_start(&d, args);
}

void team_open(team *t, const char *job, int world) {
  memset(t, 0, sizeof *t);
  t->world = world;
  for (int r = 0; r < world; r++)
    t->c[r] = test_connect(&d, job, (uint32_t)r, (uint32_t)world);
}

void team_close(team *t) {
  for (int r = 0; r < t->world; r++)
    shardd_close(t->c[r]);
  memset(t, 0, sizeof *t);
}

void team_buffer(team *t, const char *name, shardd_dtype dt, uint64_t numel,
                        shardd_buffer_info *out) {
  for (int r = 0; r < t->world; r++) {
    shardd_err rc = shardd_buffer_register(t->c[r], name, dt, numel, &out[r]);
    cr_assert_eq(rc, SHARDD_OK, "rank %d: register %s: %s", r, name,
                 shardd_last_error(t->c[r]));
    cr_assert_eq(out[r].id, out[0].id);
    cr_assert_eq(out[r].created, r == 0);
  }
}

void team_view(team *t, uint64_t buf, const char *name, uint64_t off,
                      uint64_t numel, const int64_t *shape, int ndim, uint64_t *id) {
  for (int r = 0; r < t->world; r++) {
    uint64_t got;
    shardd_err rc = shardd_view_register(t->c[r], buf, name, off, numel, shape, ndim, &got);
    cr_assert_eq(rc, SHARDD_OK, "rank %d: view %s: %s", r, name, shardd_last_error(t->c[r]));
    if (r == 0)
      *id = got;
    cr_assert_eq(got, *id);
  }
}

void team_optimizer(team *t, const char *name, shardd_optim_kind kind,
                           const shardd_hparams *hp, const shardd_param_group *g,
                           size_t ng, uint64_t *id) {
  for (int r = 0; r < t->world; r++) {
    uint64_t got;
    shardd_err rc = shardd_optimizer_register(t->c[r], name, kind, hp, g, ng, &got);
    cr_assert_eq(rc, SHARDD_OK, "rank %d: optimizer %s: %s", r, name,
                 shardd_last_error(t->c[r]));
    if (r == 0)
      *id = got;
    cr_assert_eq(got, *id);
  }
}

void *call_main(void *p) {
  call *k = p;
  switch (k->kind) {
  case OP_GATHER:
    k->rc = shardd_gather(k->c, k->id);
    break;
  case OP_SCATTER:
    k->rc = shardd_scatter(k->c, k->id, k->op);
    break;
  default:
    k->rc = shardd_step(k->c, k->id, &k->so, &k->res);
    break;
  }
  snprintf(k->msg, sizeof k->msg, "%s", k->rc ? shardd_last_error(k->c) : "");
  return NULL;
}

/* Runs calls[r] on ranks where calls[r].c is set, all at once; joins. */
void run_calls(call *calls, int n) {
  for (int r = 0; r < n; r++)
    if (calls[r].c)
      cr_assert_eq(pthread_create(&calls[r].th, NULL, call_main, &calls[r]), 0);
  for (int r = 0; r < n; r++)
    if (calls[r].c)
      pthread_join(calls[r].th, NULL);
}

void team_all_res(team *t, int kind, uint64_t id, shardd_reduce_op op,
                         const shardd_step_opts *so, shardd_step_result *res) {
  call calls[MAXW];
  memset(calls, 0, sizeof calls);
  for (int r = 0; r < t->world; r++) {
    calls[r].c = t->c[r];
    calls[r].kind = kind;
    calls[r].id = id;
    calls[r].op = op;
    shardd_step_opts dflt = SHARDD_STEP_OPTS_INIT;
    calls[r].so = so ? *so : dflt;
  }
  run_calls(calls, t->world);
  for (int r = 0; r < t->world; r++) {
    cr_assert_eq(calls[r].rc, SHARDD_OK, "rank %d: collective %d on %llu: %s: %s", r,
                 kind, (unsigned long long)id, shardd_err_name(calls[r].rc),
                 calls[r].msg);
    if (res)
      res[r] = calls[r].res;
  }
}

void team_all(team *t, int kind, uint64_t id, shardd_reduce_op op) {
  team_all_res(t, kind, id, op, NULL, NULL);
}

uint32_t mix(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  x ^= x >> 16;
  return x;
}

size_t esize(shardd_dtype dt) { return dt == SHARDD_DTYPE_FP32 ? 4 : 2; }

/* A value +-(1 + m/128) * 2^e, e in [-2, 2]: exact in bf16, fp16 and fp32,
 * and sums of up to four of them are exact in fp32 (at most 12 significant
 * bits), while most are not representable in bf16. */
double grid_value(uint32_t h) {
  int m = (int)(h & 127u);
  int e = (int)((h >> 7) % 5u) - 2;
  double v = ldexp(1.0 + m / 128.0, e);
  return (h >> 12) & 1u ? -v : v;
}

/* The bit pattern of a grid value, encoded by hand for each format. */
void put_grid(shardd_dtype dt, void *base, size_t i, uint32_t h) {
  uint32_t m = h & 127u;
  int e = (int)((h >> 7) % 5u) - 2;
  uint32_t sign = (h >> 12) & 1u;
  if (dt == SHARDD_DTYPE_FP32) {
    uint32_t u = sign << 31 | (uint32_t)(e + 127) << 23 | m << 16;
    memcpy((char *)base + 4 * i, &u, 4);
  } else if (dt == SHARDD_DTYPE_BF16) {
    uint16_t u = (uint16_t)(sign << 15 | (uint32_t)(e + 127) << 7 | m);
    memcpy((char *)base + 2 * i, &u, 2);
  } else {
    uint16_t u = (uint16_t)(sign << 15 | (uint32_t)(e + 15) << 10 | m << 3);
    memcpy((char *)base + 2 * i, &u, 2);
  }
}

float f32_at(const void *base, size_t i) {
  float f;
  memcpy(&f, (const char *)base + 4 * i, 4);
  return f;
}

uint32_t f32_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
}

/* bf16 round-to-nearest-even of a finite float, by the definition: the
 * nearer of the two neighbours with 8 significant bits, even on a tie. */
int representable_bf16(double v) {
  if (v == 0)
    return 1;
  int e;
  double m = frexp(fabs(v), &e); /* [0.5, 1) */
  double scaled = ldexp(m, 8);   /* 8 significant bits */
  return scaled == floor(scaled);
}

void fill_shards(const shardd_buffer_info *b, int world, uint32_t salt) {
  for (int r = 0; r < world; r++) {
    size_t bytes = b[r].shard_numel * esize(b[r].dtype);
    unsigned char *p = b[r].shard;
    for (size_t k = 0; k < bytes; k++)
      p[k] = (unsigned char)mix(salt * 977u + (uint32_t)r * 100003u + (uint32_t)k);
  }
}

uint32_t grad_hash(int r, size_t j, uint32_t salt) {
  return mix((uint32_t)j * 2654435761u ^ (uint32_t)r * 40503u ^ salt);
}

void fill_grads(const shardd_buffer_info *b, int world, uint32_t salt) {
  for (int r = 0; r < world; r++)
    for (size_t j = 0; j < b[r].padded_numel; j++)
      put_grid(b[r].dtype, b[r].grad, j, grad_hash(r, j, salt));
}

/* The reduced value of element j, in double (exact), then to float. */
float expected_reduced(int world, size_t j, uint32_t salt, int op) {
  double s = 0;
  for (int r = 0; r < world; r++)
    s += grid_value(grad_hash(r, j, salt));
  float f = (float)s;
  cr_assert_eq((double)f, s, "test values must sum exactly in fp32");
  return op == SHARDD_REDUCE_MEAN ? f / (float)world : f;
}

void hp_set(shardd_hparams *o, const ref_hp *h) {
  memset(o, 0, sizeof *o);
  o->set = SHARDD_HP_LR | SHARDD_HP_WEIGHT_DECAY;
  o->lr = h->lr;
  o->weight_decay = h->wd;
  if (h->kind == SHARDD_OPTIM_SGD) {
    o->set |= SHARDD_HP_MOMENTUM | SHARDD_HP_DAMPENING | SHARDD_HP_NESTEROV;
    o->momentum = h->momentum;
    o->dampening = h->dampening;
    o->nesterov = h->nesterov;
  } else {
    o->set |= SHARDD_HP_BETA1 | SHARDD_HP_BETA2 | SHARDD_HP_EPS | SHARDD_HP_AMSGRAD;
    o->beta1 = h->beta1;
    o->beta2 = h->beta2;
    o->eps = h->eps;
    o->amsgrad = h->amsgrad;
  }
  if (h->maximize) {
    o->set |= SHARDD_HP_MAXIMIZE;
    o->maximize = 1;
  }
}

float init_param(size_t j) {
  float mag = 0.5f + (float)((j * 37) % 100) / 100.0f;
  return j % 2 ? mag : -mag;
}

int status_steps(const char *job, const char *opt, double *steps) {
  char args[256], *out;
  snprintf(args, sizeof args, "--socket %s status --json", d.sock);
  int rc = test_shardctl(NULL, args, &out, NULL);
  cr_assert_eq(rc, 0);
  tj *j = tj_parse(out);
  cr_assert_not_null(j, "%s", out);
  int found = 0;
  const tj *jobs = tj_need(j, "jobs", TJ_ARR);
  for (size_t i = 0; i < jobs->n; i++) {
    if (strcmp(tj_need(jobs->kids[i], "name", TJ_STR)->str, job))
      continue;
    const tj *opts = tj_need(jobs->kids[i], "optimizers", TJ_ARR);
    for (size_t k = 0; k < opts->n; k++)
      if (!strcmp(tj_need(opts->kids[k], "name", TJ_STR)->str, opt)) {
        *steps = tj_need(opts->kids[k], "steps", TJ_NUM)->num;
        found = 1;
      }
  }
  tj_free(j);
  free(out);
  return found;
}

int job_inflight(const char *job) {
  shardd_client_t *ctl = test_connect(&d, NULL, 0, 1);
  char *js;
  cr_assert_eq(shardd_status_json(ctl, &js), SHARDD_OK);
  tj *j = tj_parse(js);
  cr_assert_not_null(j);
  int n = -1;
  const tj *jobs = tj_need(j, "jobs", TJ_ARR);
  for (size_t i = 0; i < jobs->n; i++)
    if (!strcmp(tj_need(jobs->kids[i], "name", TJ_STR)->str, job))
      n = (int)tj_need(jobs->kids[i], "collectives_in_flight", TJ_NUM)->num;
  tj_free(j);
  shardd_free(js);
  shardd_close(ctl);
  return n;
}

void raw_hello_when_free(test_raw *r, const char *job, uint32_t rank, uint32_t world) {
  for (double end = test_mono_s() + TEST_HANG_S;;) {
    test_raw_open(&d, r);
    uint64_t seq = test_raw_send_hello(r, SHARDD_PROTOCOL_VERSION, job, rank, world);
    Shardwire__Response *resp = test_raw_recv(r);
    cr_assert_not_null(resp);
    cr_assert_eq(resp->seq, seq);
    int ok = resp->code == SHARDWIRE__STATUS_CODE__OK;
    shardwire__response__free_unpacked(resp, NULL);
    if (ok)
      return;
    test_raw_close(r);
    cr_assert_lt(test_mono_s(), end, "rank %u of %s never freed after its holder left", rank,
                 job);
    test_sleep_ms(10);
  }
}
