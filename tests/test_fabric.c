/* test_fabric.c — jobs over several nodes, on loopback: two shardd
 * (--backend host --devices 2 each, one --job-spec per job naming its node)
 * form one world of 4 ranks through Gloo, and must agree with one shardd
 * running --devices 4 for the same 4 ranks: gather bit for bit, scatter and
 * 20 AdamW steps (with gradient clipping, whose norm crosses nodes) within
 * fp32 rounding, and two runs of the two-node layout bit for bit. Killing
 * one daemon fails the other node's pending collectives with
 * SHARDD_E_PEER_LOST well within the collective timeout, and the survivor
 * keeps serving other jobs. Ranks are libshardd clients on threads.
 * Skipped (visibly) when the daemon was built without Gloo. */
#include <criterion/criterion.h>
#include <math.h>
#include <pthread.h>

#include "fabric.h"
#include "harness.h"

#define W 4
#define STEPS 20
#define N_BIG 1030 /* shards of 258, 2 padding */
#define N_SMALL 6  /* shards of 2, 2 padding */

static void need_gloo(void) {
  if (shardd__fabric_engine() == NULL)
    cr_skip_test("shardd built without Gloo (install libgloo-dev): "
                 "multi-node tests skipped");
}

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* ---- layouts ------------------------------------------------------------ */

typedef struct {
  char dir[64]; /* holds the specs and the rendezvous directory */
  char rdv[128];
} scratch;

static void scratch_make(scratch *s) {
  snprintf(s->dir, sizeof s->dir, "/tmp/shardd-fabric-XXXXXX");
  cr_assert_not_null(mkdtemp(s->dir));
  snprintf(s->rdv, sizeof s->rdv, "%s/rdv", s->dir);
  cr_assert_eq(mkdir(s->rdv, 0700), 0);
}

static void scratch_remove(scratch *s) {
  char cmd[160];
  snprintf(cmd, sizeof cmd, "rm -rf '%s'", s->dir);
  cr_expect_eq(system(cmd), 0);
}

/* Writes the spec of job for node and returns its path in out. */
static void write_spec(const scratch *s, const char *job, int node, char *out,
                       size_t len) {
  snprintf(out, len, "%s/%s.node%d.spec", s->dir, job, node);
  FILE *f = fopen(out, "w");
  cr_assert_not_null(f);
  fprintf(f, "# test layout\njob = %s\nworld = %d\nnodes = 2\nnode_rank = %d\n"
             "local_ranks = %d\nrendezvous = %s\nhost = 127.0.0.1\n",
          job, W, node, W / 2, s->rdv);
  fclose(f);
}

/* Starts the two daemons of a 2-node layout serving jobs[0..njobs). */
static void start_pair(test_daemon d[2], const scratch *s, const char *const *jobs,
                       int njobs, const char *timeout) {
  static char specs[2][4][256];
  for (int n = 0; n < 2; n++) {
    const char *args[24];
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
    args[k] = NULL;
    test_daemon_start(&d[n], args);
  }
}

/* ---- ranks on threads --------------------------------------------------- */

enum { OP_GATHER, OP_SCATTER, OP_STEP };

typedef struct {
  shardd_client_t *c;
  int kind;
  uint64_t id;
  shardd_step_opts so;
  shardd_step_result res;
  shardd_err rc;
  char msg[1024];
  pthread_t th;
} call;

static void *call_main(void *p) {
  call *k = p;
  if (k->kind == OP_GATHER)
    k->rc = shardd_gather(k->c, k->id);
  else if (k->kind == OP_SCATTER)
    k->rc = shardd_scatter(k->c, k->id, SHARDD_REDUCE_MEAN);
  else
    k->rc = shardd_step(k->c, k->id, &k->so, &k->res);
  snprintf(k->msg, sizeof k->msg, "%s", k->rc ? shardd_last_error(k->c) : "");
  return NULL;
}

static void all_ranks(shardd_client_t **c, int kind, uint64_t id,
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
    cr_assert_eq(pthread_create(&calls[r].th, NULL, call_main, &calls[r]), 0);
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

/* ---- the training run --------------------------------------------------- */

static uint32_t mix(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  x ^= x >> 16;
  return x;
}

static float unit(uint32_t a, uint32_t b, uint32_t c) {
  return (float)(mix(a * 0x9e3779b9u ^ mix(b * 0x85ebca6bu ^ mix(c + 17))) >> 8) /
         (float)(1u << 24);
}

/* magnitude in [0.5, 1.5), random sign: 20 steps of lr 0.01 move a parameter
 * by at most ~0.2, so none comes near 0, where a relative difference would
 * measure cancellation in p - lr*u rather than fp32 rounding */
static float init_param(int buf, size_t j) {
  float m = 0.5f + unit(1000u + buf, (uint32_t)j, 7);
  return mix((uint32_t)j * 31u + (uint32_t)buf) & 1 ? -m : m;
}
/* positive, so a sum has no cancellation and fp32 rounding stays relative */
static float grad_of(int buf, int step, int rank, size_t j) {
  return 0.25f + unit(buf * 64u + step, (uint32_t)rank, (uint32_t)j);
}

typedef struct {
  size_t padded[2], shard[2];
  float *init_gather[2][W]; /* each rank's gather area after the first gather */
  float *reduced[2][W];     /* each rank's reduced shard after the first scatter */
  float *final_gather[2][W];
  double norms[STEPS];
} run_result;

static float *copy_floats(const void *p, size_t n) {
  float *f = malloc(n * sizeof *f);
  cr_assert_not_null(f);
  memcpy(f, p, n * sizeof *f);
  return f;
}

static void result_free(run_result *r) {
  for (int b = 0; b < 2; b++)
    for (int k = 0; k < W; k++) {
      free(r->init_gather[b][k]);
      free(r->reduced[b][k]);
      free(r->final_gather[b][k]);
    }
}

/* One training run of job over 4 ranks; rank r talks to d[r / per_daemon]. */
static void train(const test_daemon *d, int per_daemon, const char *job,
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
        sh[j] = g < numel[b] ? init_param(b, g) : 0.0f;
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

static double rel_diff(double a, double b) {
  double m = fmax(fabs(a), fabs(b));
  return m == 0 ? 0 : fabs(a - b) / m;
}

static uint32_t bits(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
}

static double compare(const float *a, const float *b, size_t n, int exact,
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

/* ---- tests -------------------------------------------------------------- */

Test(fabric, two_nodes_match_one_node_and_repeat_bit_for_bit, .timeout = 60) {
  need_gloo();
  double t0 = now_s();
  scratch s;
  scratch_make(&s);
  test_daemon pair[2], one[1];
  const char *jobs[] = {"fab-a", "fab-b"};
  start_pair(pair, &s, jobs, 2, "20");
  const char *args1[] = {"--backend", "host", "--devices", "4", NULL};
  test_daemon_start(&one[0], args1);

  run_result ra, rb, r1;
  train(pair, 2, "fab-a", &ra);
  train(one, 4, "fab-1", &r1);
  train(pair, 2, "fab-b", &rb);

  double worst_scatter = 0, worst_param = 0, worst_norm = 0;
  char what[64];
  for (int b = 0; b < 2; b++) {
    /* expected initial gather, from the formula */
    size_t numel = b ? N_SMALL : N_BIG;
    for (int r = 0; r < W; r++) {
      for (size_t j = 0; j < ra.padded[b]; j++)
        cr_assert_eq(bits(ra.init_gather[b][r][j]), bits(j < numel ? init_param(b, j) : 0.0f),
                     "2 nodes: buffer %d rank %d gather[%zu]", b, r, j);
      snprintf(what, sizeof what, "gather b%d r%d", b, r);
      compare(ra.init_gather[b][r], r1.init_gather[b][r], ra.padded[b], 1, what);
      /* the reduced mean, against an fp64 sum here */
      for (size_t j = 0; j < ra.shard[b]; j++) {
        size_t gj = (size_t)r * ra.shard[b] + j;
        double want = 0;
        for (int k = 0; k < W; k++)
          want += gj < numel ? grad_of(b, 1, k, gj) : 0.0;
        want /= W;
        cr_assert_leq(rel_diff(ra.reduced[b][r][j], want), 1e-6,
                      "2 nodes: reduced b%d r%d [%zu] %.9g, want %.9g", b, r, j,
                      ra.reduced[b][r][j], want);
      }
      snprintf(what, sizeof what, "reduced b%d r%d", b, r);
      double d = compare(ra.reduced[b][r], r1.reduced[b][r], ra.shard[b], 0, what);
      worst_scatter = d > worst_scatter ? d : worst_scatter;
      compare(ra.reduced[b][r], rb.reduced[b][r], ra.shard[b], 1, what);
      snprintf(what, sizeof what, "params after %d steps b%d r%d", STEPS, b, r);
      d = compare(ra.final_gather[b][r], r1.final_gather[b][r], ra.padded[b], 0, what);
      worst_param = d > worst_param ? d : worst_param;
      compare(ra.final_gather[b][r], rb.final_gather[b][r], ra.padded[b], 1, what);
      /* every rank of a run sees the same parameters */
      compare(ra.final_gather[b][r], ra.final_gather[b][0], ra.padded[b], 1, what);
    }
  }
  for (int k = 0; k < STEPS; k++) {
    if (k % 2 == 0) {
      cr_assert_gt(ra.norms[k], 10.0, "step %d: norm %g should clip", k + 1, ra.norms[k]);
      double d = rel_diff(ra.norms[k], r1.norms[k]);
      worst_norm = d > worst_norm ? d : worst_norm;
      cr_assert_eq(ra.norms[k], rb.norms[k], "step %d: norms of two runs differ", k + 1);
    }
  }
  cr_log_info("fabric: 2 nodes vs 1: max rel diff scatter %.3g, params after %d "
              "AdamW steps %.3g, clip norm %.3g; 2 runs bit-identical; %.1f s",
              worst_scatter, STEPS, worst_param, worst_norm, now_s() - t0);
  cr_expect_leq(worst_scatter, 1e-6);
  cr_expect_leq(worst_param, 1e-6);
  cr_expect_leq(worst_norm, 1e-6);

  /* status on node 0 names the nodes and their state */
  shardd_client_t *ctl = test_connect(&pair[0], NULL, 0, 0);
  shardd_client_t *keep = test_connect(&pair[0], "fab-a", 0, W);
  char *text = NULL;
  cr_assert_eq(shardd_status_text(ctl, &text), SHARDD_OK);
  cr_expect(strstr(text, "nodes 2 (this daemon: node 0) fabric gloo") != NULL, "%s", text);
  cr_expect(strstr(text, "node 0: ranks 0..1 this daemon") != NULL, "%s", text);
  cr_expect(strstr(text, "node 1: ranks 2..3") != NULL, "%s", text);
  shardd_free(text);
  char *json = NULL;
  cr_assert_eq(shardd_status_json(ctl, &json), SHARDD_OK);
  cr_expect(strstr(json, "\"node_states\":[{\"node\":0") != NULL, "%s", json);
  shardd_free(json);
  shardd_close(keep);
  shardd_close(ctl);

  result_free(&ra);
  result_free(&rb);
  result_free(&r1);
  test_daemon_finish(&pair[0]);
  test_daemon_finish(&pair[1]);
  test_daemon_finish(&one[0]);
  scratch_remove(&s);
  cr_expect_lt(now_s() - t0, 45.0, "took %.1f s", now_s() - t0);
}

Test(fabric, rank_of_another_node_is_refused, .timeout = 60) {
  need_gloo();
  scratch s;
  scratch_make(&s);
  test_daemon pair[2];
  const char *jobs[] = {"job"};
  start_pair(pair, &s, jobs, 1, "5");
  shardd_connect_opts o = SHARDD_CONNECT_OPTS_INIT;
  o.job = "job";
  o.rank = 2;
  o.world = W;
  shardd_client_t *c = NULL;
  char err[512];
  shardd_err rc = shardd_connect(pair[0].sock, &o, &c, err, sizeof err);
  cr_assert_eq(rc, SHARDD_E_RANGE, "%s", err);
  cr_expect(strstr(err, "rank 2 of job \"job\" belongs to node 1 (ranks 2..3); this "
                        "daemon is node 0 of 2 and holds ranks 0..1") != NULL, "%s", err);
  o.world = 8; /* the spec says 4 */
  o.rank = 0;
  rc = shardd_connect(pair[0].sock, &o, &c, err, sizeof err);
  cr_assert_eq(rc, SHARDD_E_MISMATCH, "%s", err);
  test_daemon_finish(&pair[0]);
  test_daemon_finish(&pair[1]);
  scratch_remove(&s);
}

/* Ranks 0 and 1 gather; ranks 2 and 3 (node 1) never come, and node 1's
 * daemon never joins: the collective fails at the rendezvous timeout with
 * the missing node named. */
Test(fabric, missing_node_named_at_rendezvous_timeout, .timeout = 60) {
  need_gloo();
  scratch s;
  scratch_make(&s);
  char spec[256];
  write_spec(&s, "lonely", 0, spec, sizeof spec);
  const char *args[] = {"--backend", "host", "--devices", "2", "--collective-timeout",
                        "2", "--job-spec", spec, NULL};
  test_daemon d;
  test_daemon_start(&d, args);
  shardd_client_t *c[2];
  shardd_buffer_info info[2];
  for (int r = 0; r < 2; r++) {
    c[r] = test_connect(&d, "lonely", (uint32_t)r, W);
    cr_assert_eq(shardd_buffer_register(c[r], "w", SHARDD_DTYPE_FP32, 100, &info[r]), SHARDD_OK);
  }
  call calls[2];
  memset(calls, 0, sizeof calls);
  double t0 = now_s();
  for (int r = 0; r < 2; r++) {
    calls[r].c = c[r];
    calls[r].kind = OP_GATHER;
    calls[r].id = info[0].id;
    pthread_create(&calls[r].th, NULL, call_main, &calls[r]);
  }
  for (int r = 0; r < 2; r++)
    pthread_join(calls[r].th, NULL);
  double took = now_s() - t0;
  for (int r = 0; r < 2; r++) {
    cr_expect_eq(calls[r].rc, SHARDD_E_PEER_LOST, "rank %d: %s", r, shardd_err_name(calls[r].rc));
    cr_expect(strstr(calls[r].msg, "node 1 of 2 did not join the rendezvous") != NULL,
              "rank %d: %s", r, calls[r].msg);
  }
  cr_expect(took > 1.5 && took < 6.0, "failed after %.1f s (timeout 2 s)", took);
  for (int r = 0; r < 2; r++)
    shardd_close(c[r]);
  test_daemon_finish(&d);
  scratch_remove(&s);
}

Test(fabric, killed_daemon_fails_pending_collectives_survivor_serves, .timeout = 60) {
  need_gloo();
  scratch s;
  scratch_make(&s);
  test_daemon pair[2];
  const char *jobs[] = {"doomed"};
  const double timeout = 10;
  start_pair(pair, &s, jobs, 1, "10");
  shardd_client_t *c[W];
  shardd_buffer_info info[W];
  for (int r = 0; r < W; r++) {
    c[r] = test_connect(&pair[r / 2], "doomed", (uint32_t)r, W);
    cr_assert_eq(shardd_buffer_register(c[r], "w", SHARDD_DTYPE_FP32, 4000, &info[r]),
                 SHARDD_OK);
  }
  all_ranks(c, OP_GATHER, info[0].id, 0, NULL); /* the fabric is up */

  /* node 0's ranks gather; node 1's daemon dies before its ranks do */
  call calls[2];
  memset(calls, 0, sizeof calls);
  for (int r = 0; r < 2; r++) {
    calls[r].c = c[r];
    calls[r].kind = OP_GATHER;
    calls[r].id = info[0].id;
    pthread_create(&calls[r].th, NULL, call_main, &calls[r]);
  }
  test_sleep_ms(300);
  double t0 = now_s();
  kill(pair[1].pid, SIGKILL);
  waitpid(pair[1].pid, NULL, 0);
  pair[1].pid = 0;
  for (int r = 0; r < 2; r++)
    pthread_join(calls[r].th, NULL);
  double took = now_s() - t0;
  for (int r = 0; r < 2; r++) {
    cr_expect_eq(calls[r].rc, SHARDD_E_PEER_LOST, "rank %d: %s: %s", r,
                 shardd_err_name(calls[r].rc), calls[r].msg);
    cr_expect(strstr(calls[r].msg, "failed across the nodes of job \"doomed\"") != NULL,
              "rank %d: %s", r, calls[r].msg);
  }
  cr_log_info("fabric: pending gather failed %.3f s after the peer daemon died: %s", took,
              calls[0].msg);
  cr_expect_lt(took, timeout, "failed after %.1f s, timeout %.0f s", took, timeout);

  /* the job stays failed, at once, with the same reason */
  t0 = now_s();
  memset(calls, 0, sizeof calls);
  for (int r = 0; r < 2; r++) {
    calls[r].c = c[r];
    calls[r].kind = OP_GATHER;
    calls[r].id = info[0].id;
    pthread_create(&calls[r].th, NULL, call_main, &calls[r]);
  }
  for (int r = 0; r < 2; r++)
    pthread_join(calls[r].th, NULL);
  for (int r = 0; r < 2; r++)
    cr_expect_eq(calls[r].rc, SHARDD_E_PEER_LOST, "rank %d again: %s", r, calls[r].msg);
  cr_expect_lt(now_s() - t0, 2.0);

  /* status shows node 1 lost */
  shardd_client_t *ctl = test_connect(&pair[0], NULL, 0, 0);
  char *text = NULL;
  cr_assert_eq(shardd_status_text(ctl, &text), SHARDD_OK);
  cr_expect(strstr(text, "node 1: ranks 2..3 lost") != NULL, "%s", text);
  cr_expect(strstr(text, "fabric_error: ") != NULL, "%s", text);
  shardd_free(text);
  shardd_close(ctl);

  /* the survivor serves another job: 2 ranks, single node */
  shardd_client_t *o[2];
  shardd_buffer_info oi[2];
  for (int r = 0; r < 2; r++) {
    o[r] = test_connect(&pair[0], "other", (uint32_t)r, 2);
    cr_assert_eq(shardd_buffer_register(o[r], "w", SHARDD_DTYPE_FP32, 10, &oi[r]), SHARDD_OK);
    for (size_t j = 0; j < oi[r].shard_numel; j++)
      ((float *)oi[r].shard)[j] = (float)(r * 100 + (int)j);
  }
  memset(calls, 0, sizeof calls);
  for (int r = 0; r < 2; r++) {
    calls[r].c = o[r];
    calls[r].kind = OP_GATHER;
    calls[r].id = oi[0].id;
    pthread_create(&calls[r].th, NULL, call_main, &calls[r]);
  }
  for (int r = 0; r < 2; r++)
    pthread_join(calls[r].th, NULL);
  for (int r = 0; r < 2; r++) {
    cr_assert_eq(calls[r].rc, SHARDD_OK, "other job rank %d: %s", r, calls[r].msg);
    for (size_t j = 0; j < 10; j++)
      cr_expect_eq(((float *)oi[r].gather)[j],
                   (float)((j / 5) * 100 + j % 5), "other job gather[%zu]", j);
  }
  for (int r = 0; r < 2; r++)
    shardd_close(o[r]);
  for (int r = 0; r < W; r++)
    shardd_close(c[r]);
  test_daemon_finish(&pair[0]);
  test_daemon_stop(&pair[1]);
  scratch_remove(&s);
}
