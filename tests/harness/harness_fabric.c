/* harness_fabric.c — what the multi-node tests share (test_fabric.c,
 * test_fabric_rendezvous.c, test_node_loss.c): scratch directories and job
 * specs, pairs of daemons that are two nodes of one job, ranks on threads,
 * and a training run with the values it must produce. */
#include <criterion/criterion.h>
#include <dirent.h>
#include <inttypes.h>
#include <math.h>
#include <pthread.h>

#include "fabric.h"
#include "fabric_fixture.h"
#include "harness.h"

#define W 4

#define STEPS 20

#define N_BIG 1030 /* shards of 258, 2 padding */

#define N_SMALL 6  /* shards of 2, 2 padding */

void need_gloo(void) {
  if (shardd__fabric_engine() == NULL)
    cr_skip_test("shardd built without Gloo (install libgloo-dev): "
                 "multi-node tests skipped");
}

void scratch_make(scratch *s) {
  snprintf(s->dir, sizeof s->dir, "/tmp/shardd-fabric-XXXXXX");
  cr_assert_not_null(mkdtemp(s->dir));
  snprintf(s->rdv, sizeof s->rdv, "%s/rdv", s->dir);
  cr_assert_eq(mkdir(s->rdv, 0700), 0);
}

void scratch_remove(scratch *s) {
  char cmd[160];
  snprintf(cmd, sizeof cmd, "rm -rf '%s'", s->dir);
  cr_expect_eq(system(cmd), 0);
}

/* Writes the spec of job for node and returns its path in out. */
void write_spec(const scratch *s, const char *job, int node, char *out,
                       size_t len) {
  snprintf(out, len, "%s/%s.node%d.spec", s->dir, job, node);
  FILE *f = fopen(out, "w");
  cr_assert_not_null(f);
  fprintf(f, "# test layout\njob = %s\nworld = %d\nnodes = 2\nnode_rank = %d\n"
             "local_ranks = %d\nrendezvous = %s\nhost = 127.0.0.1\n",
          job, W, node, W / 2, s->rdv);
  fclose(f);
}

/* Starts the two daemons of a 2-node layout serving jobs[0..njobs), node
 * 0's with the extra arguments extra0 (NULL-terminated; NULL: none). */
void start_pair_each(test_daemon d[2], const scratch *s, const char *const *jobs,
                            int njobs, const char *timeout, const char *const *extra0,
                            const char *const *extra1) {
  static char specs[2][4][256];
  for (int n = 0; n < 2; n++) {
    const char *args[28];
    int k = 0;
    args[k++] = "--backend";
    args[k++] = "host";
    args[k++] = "--devices";
    args[k++] = "2";
    args[k++] = "--collective-timeout";
    args[k++] = timeout;
    args[k++] = "--job-linger";
    args[k++] = "0";
    for (int j = 0; j < njobs; j++) {
      write_spec(s, jobs[j], n, specs[n][j], sizeof specs[n][j]);
      args[k++] = "--job-spec";
      args[k++] = specs[n][j];
    }
    for (const char *const *x = n == 0 ? extra0 : extra1; x && *x && k < 27; x++)
      args[k++] = *x;
    args[k] = NULL;
    test_daemon_start(&d[n], args);
  }
}

void start_pair_ex(test_daemon d[2], const scratch *s, const char *const *jobs,
                          int njobs, const char *timeout, const char *const *extra0) {
  start_pair_each(d, s, jobs, njobs, timeout, extra0, NULL);
}

void start_pair(test_daemon d[2], const scratch *s, const char *const *jobs,
                       int njobs, const char *timeout) {
  start_pair_ex(d, s, jobs, njobs, timeout, NULL);
}

void *fabric_call_main(void *p) {
  call *k = p;
  if (k->kind == OP_GATHER)
    k->rc = shardd_gather(k->c, k->id);
  else if (k->kind == OP_SCATTER) {
    shardd_scatter_opts o = SHARDD_SCATTER_OPTS_INIT;
    o.op = k->sum ? SHARDD_REDUCE_SUM : SHARDD_REDUCE_MEAN;
    o.no_grad = k->no_grad;
    o.nno_grad = k->nno_grad;
    k->rc = shardd_scatter_ex(k->c, k->id, &o);
  }
  else if (k->kind == OP_CHECKPOINT)
    k->rc = shardd_checkpoint_collective(k->c, k->dir);
  else
    k->rc = shardd_step(k->c, k->id, &k->so, &k->res);
  snprintf(k->msg, sizeof k->msg, "%s", k->rc ? shardd_last_error(k->c) : "");
  return NULL;
}

void all_ranks(shardd_client_t **c, int kind, uint64_t id,
                      double max_norm, shardd_step_result *res) {
  call calls[W];
  memset(calls, 0, sizeof calls);
  for (int r = 0; r < W; r++) {
    calls[r].c = c[r];
    calls[r].kind = kind;
    calls[r].id = id;
    shardd_step_opts so = SHARDD_STEP_OPTS_INIT;
    so.max_norm = max_norm;
    calls[r].so = so;
    cr_assert_eq(pthread_create(&calls[r].th, NULL, fabric_call_main, &calls[r]), 0);
  }
  for (int r = 0; r < W; r++)
    pthread_join(calls[r].th, NULL);
  for (int r = 0; r < W; r++) {
    cr_assert_eq(calls[r].rc, SHARDD_OK, "rank %d: collective %d: %s: %s", r, kind,
                 shardd_err_name(calls[r].rc), calls[r].msg);
    if (res)
      res[r] = calls[r].res;
  }
}

uint32_t fabric_mix(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  x ^= x >> 16;
  return x;
}

float unit(uint32_t a, uint32_t b, uint32_t c) {
  return (float)(fabric_mix(a * 0x9e3779b9u ^ fabric_mix(b * 0x85ebca6bu ^ fabric_mix(c + 17))) >> 8) /
         (float)(1u << 24);
}

/* magnitude in [0.5, 1.5), random sign: 20 steps of lr 0.01 move a parameter
 * by at most ~0.2, so none comes near 0, where a relative difference would
 * measure cancellation in p - lr*u rather than fp32 rounding */
float fabric_init_param(int buf, size_t j) {
  float m = 0.5f + unit(1000u + buf, (uint32_t)j, 7);
  return fabric_mix((uint32_t)j * 31u + (uint32_t)buf) & 1 ? -m : m;
}

/* positive, so a sum has no cancellation and fp32 rounding stays relative */
float grad_of(int buf, int step, int rank, size_t j) {
  return 0.25f + unit(buf * 64u + step, (uint32_t)rank, (uint32_t)j);
}

float *copy_floats(const void *p, size_t n) {
  float *f = malloc(n * sizeof *f);
  cr_assert_not_null(f);
  memcpy(f, p, n * sizeof *f);
  return f;
}

void result_free(run_result *r) {
  for (int b = 0; b < 2; b++)
    for (int k = 0; k < W; k++) {
      free(r->init_gather[b][k]);
      free(r->reduced[b][k]);
      free(r->final_gather[b][k]);
    }
}

/* One training run of job over 4 ranks; rank r talks to d[r / per_daemon]. */
void train(const test_daemon *d, int per_daemon, const char *job,
                  run_result *out) {
  memset(out, 0, sizeof *out);
  shardd_client_t *c[W];
  for (int r = 0; r < W; r++)
    c[r] = test_connect(&d[r / per_daemon], job, (uint32_t)r, W);
  const uint64_t numel[2] = {N_BIG, N_SMALL};
  const char *names[2] = {"big", "small"};
  shardd_buffer_info info[2][W];
  for (int b = 0; b < 2; b++)
    for (int r = 0; r < W; r++) {
      shardd_err rc = shardd_buffer_register(c[r], names[b], SHARDD_DTYPE_FP32,
                                             numel[b], &info[b][r]);
      cr_assert_eq(rc, SHARDD_OK, "rank %d: register %s: %s", r, names[b],
                   shardd_last_error(c[r]));
      cr_assert_eq(info[b][r].world, W);
      cr_assert_eq(info[b][r].rank, (uint32_t)r);
    }
  for (int b = 0; b < 2; b++) {
    out->padded[b] = info[b][0].padded_numel;
    out->shard[b] = info[b][0].shard_numel;
  }
  /* every rank writes its own shard of the initial parameters */
  for (int b = 0; b < 2; b++)
    for (int r = 0; r < W; r++) {
      float *sh = info[b][r].shard;
      for (size_t j = 0; j < out->shard[b]; j++) {
        size_t g = (size_t)r * out->shard[b] + j;
        sh[j] = g < numel[b] ? fabric_init_param(b, g) : 0.0f;
      }
    }
  shardd_hparams hp = {0};
  hp.set = SHARDD_HP_LR | SHARDD_HP_WEIGHT_DECAY;
  hp.lr = 0.01;
  hp.weight_decay = 0.05;
  shardd_param_ref refs[2] = {{info[0][0].id, "big"}, {info[1][0].id, "small"}};
  shardd_param_group g = {refs, 2, {0}};
  uint64_t opt = 0;
  for (int r = 0; r < W; r++) {
    uint64_t id;
    shardd_err rc = shardd_optimizer_register(c[r], "adamw", SHARDD_OPTIM_ADAMW,
                                              &hp, &g, 1, &id);
    cr_assert_eq(rc, SHARDD_OK, "rank %d: optimizer: %s", r, shardd_last_error(c[r]));
    if (r == 0)
      opt = id;
    cr_assert_eq(id, opt);
  }

  for (int b = 0; b < 2; b++) {
    all_ranks(c, OP_GATHER, info[b][0].id, 0, NULL);
    for (int r = 0; r < W; r++)
      out->init_gather[b][r] = copy_floats(info[b][r].gather, out->padded[b]);
  }
  for (int step = 1; step <= STEPS; step++) {
    for (int b = 0; b < 2; b++) {
      for (int r = 0; r < W; r++) {
        float *gr = info[b][r].grad;
        for (size_t j = 0; j < out->padded[b]; j++)
          gr[j] = j < numel[b] ? grad_of(b, step, r, j) : 0.0f;
      }
      all_ranks(c, OP_SCATTER, info[b][0].id, 0, NULL);
      if (step == 1)
        for (int r = 0; r < W; r++)
          out->reduced[b][r] = copy_floats(info[b][r].reduced, out->shard[b]);
    }
    shardd_step_result res[W];
    /* clip every other step (the norm of the mean gradient is ~24) */
    all_ranks(c, OP_STEP, opt, step % 2 ? 10.0 : 0.0, res);
    for (int r = 0; r < W; r++) {
      cr_assert_eq(res[r].step, (uint64_t)step);
      cr_assert_eq(res[r].total_norm, res[0].total_norm, "rank %d's norm differs", r);
    }
    out->norms[step - 1] = res[0].total_norm;
  }
  for (int b = 0; b < 2; b++) {
    all_ranks(c, OP_GATHER, info[b][0].id, 0, NULL);
    for (int r = 0; r < W; r++)
      out->final_gather[b][r] = copy_floats(info[b][r].gather, out->padded[b]);
  }
  for (int r = 0; r < W; r++)
    shardd_close(c[r]);
}

double rel_diff(double a, double b) {
  double m = fmax(fabs(a), fabs(b));
  return m == 0 ? 0 : fabs(a - b) / m;
}

uint32_t bits(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
}

double compare(const float *a, const float *b, size_t n, int exact,
                      const char *what) {
  double worst = 0;
  for (size_t j = 0; j < n; j++) {
    if (exact)
      cr_assert_eq(bits(a[j]), bits(b[j]), "%s[%zu]: %.9g vs %.9g", what, j, a[j], b[j]);
    double d = rel_diff(a[j], b[j]);
    if (d > worst && getenv("FABRIC_DEBUG"))
      cr_log_info("%s[%zu]: %.9g vs %.9g (%.3g)", what, j, a[j], b[j], d);
    worst = d > worst ? d : worst;
  }
  return worst;
}

scratch scr;

void fabric_setup(void) {
  memset(&scr, 0, sizeof scr);
  need_gloo();
  scratch_make(&scr);
}

void fabric_teardown(void) {
  if (scr.dir[0])
    scratch_remove(&scr);
}

void join_ranks_w(const test_daemon *d, const char *job, int n, uint64_t numel,
                  shardd_client_t **c, shardd_buffer_info *info) {
  for (int r = 0; r < n; r++) {
    c[r] = test_connect(&d[r / 2], job, (uint32_t)r, W);
    cr_assert_eq(shardd_buffer_register(c[r], "w", SHARDD_DTYPE_FP32, numel, &info[r]),
                 SHARDD_OK);
  }
}

void calls_start(call *k, int n, shardd_client_t *const *c, int kind,
                 const shardd_buffer_info *bufs, const char *const *dirs) {
  memset(k, 0, (size_t)n * sizeof *k);
  for (int r = 0; r < n; r++) {
    k[r].c = c[r];
    k[r].kind = kind;
    if (bufs)
      k[r].id = bufs[r].id;
    if (dirs)
      k[r].dir = dirs[r / 2];
    cr_assert_eq(pthread_create(&k[r].th, NULL, fabric_call_main, &k[r]), 0);
  }
}

void calls_join(call *k, int n) {
  for (int r = 0; r < n; r++)
    pthread_join(k[r].th, NULL);
}

void kill_node1(test_daemon pair[2]) {
  kill(pair[1].pid, SIGKILL);
  waitpid(pair[1].pid, NULL, 0);
  pair[1].pid = 0;
}
