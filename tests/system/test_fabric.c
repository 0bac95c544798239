/* test_fabric.c — jobs over several nodes, on loopback: two shardd
 * (--backend host --devices 2 each, one --job-spec per job naming its node)
 * form one world of 4 ranks through Gloo, and must agree with one shardd
 * running --devices 4 for the same 4 ranks: gather bit for bit, scatter and
 * 20 AdamW steps (with gradient clipping, whose norm crosses nodes) within
 * fp32 rounding, and two runs of the two-node layout bit for bit. Killing
 * one daemon fails the other node's pending collectives with
 * SHARDD_E_PEER_LOST under an hour's collective timeout, and the survivor
 * keeps serving other jobs. Many exchanges in flight at once, reached in
 * opposite orders by the two nodes and in two jobs, complete (they once
 * stalled the daemons' pools until the timeout); nodes that disagree on a
 * buffer's size or a reduction fail that collective with E_MISMATCH and
 * keep the fabric. SIGTERM while an exchange waits for a peer that never
 * answers, or while the rendezvous waits for a node that never comes, stops
 * the daemon at once (its ranks get E_SHUTDOWN, --checkpoint-on-exit runs;
 * the peer's ranks get E_PEER_LOST, not at the timeout). The fabric itself,
 * nodes on threads of this process: the ring reduce-scatter exact over
 * several segments, two at once, a second meeting in a rendezvous directory
 * that holds the first one's files, and an abort ending a wait at once.
 * Across uids: a job spec goes to its uid's job only, a restored exit part
 * included; two uids' jobs of one name never meet in one rendezvous
 * directory; and a rendezvous directory another uid can write (or a
 * symlink) is refused before the daemon touches a file in it.
 * Ranks are libshardd clients on threads. Skipped (visibly) when the daemon
 * was built without Gloo. */
#include <criterion/criterion.h>
#include <dirent.h>
#include <inttypes.h>
#include <math.h>
#include <pthread.h>
#include <sys/socket.h>
#include <sys/un.h>

#include "backend.h"
#include "checkpoint.h"
#include "fabric.h"
#include "harness.h"
#include "registry.h"

#define W 4
#define STEPS 20
#define N_BIG 1030 /* shards of 258, 2 padding */
#define N_SMALL 6  /* shards of 2, 2 padding */

static void need_gloo(void) {
  if (shardd__fabric_engine() == NULL)
    cr_skip_test("shardd built without Gloo (install libgloo-dev): "
                 "multi-node tests skipped");
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

/* Starts the two daemons of a 2-node layout serving jobs[0..njobs), node
 * 0's with the extra arguments extra0 (NULL-terminated; NULL: none). */
static void start_pair_each(test_daemon d[2], const scratch *s, const char *const *jobs,
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

static void start_pair_ex(test_daemon d[2], const scratch *s, const char *const *jobs,
                          int njobs, const char *timeout, const char *const *extra0) {
  start_pair_each(d, s, jobs, njobs, timeout, extra0, NULL);
}

static void start_pair(test_daemon d[2], const scratch *s, const char *const *jobs,
                       int njobs, const char *timeout) {
  start_pair_ex(d, s, jobs, njobs, timeout, NULL);
}

/* ---- ranks on threads --------------------------------------------------- */

enum { OP_GATHER, OP_SCATTER, OP_STEP, OP_CHECKPOINT };

typedef struct {
  shardd_client_t *c;
  int kind;
  uint64_t id;
  shardd_step_opts so;
  shardd_step_result res;
  int sum; /* scatter with SHARDD_REDUCE_SUM instead of MEAN */
  const uint64_t *no_grad; /* scatter: this rank's views without a gradient */
  size_t nno_grad;
  const char *dir; /* checkpoint */
  shardd_err rc;
  char msg[1024];
  pthread_t th;
} call;

static void *call_main(void *p) {
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
  double t0 = test_mono_s();
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
              worst_scatter, STEPS, worst_param, worst_norm, test_mono_s() - t0);
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

/* Job names are per uid (issue 20, item 8). A spec without `uid =` would
 * otherwise lay out two users' jobs of its name over one fabric: while
 * root's "job" holds the spec's layout, uid 4242's "job" is refused,
 * naming the spec, and not spread over the nodes. */
static int other_uid_hello(const char *sock) {
  if (setgid(4242) != 0 || setuid(4242) != 0)
    return 10;
  shardd_connect_opts o = SHARDD_CONNECT_OPTS_INIT;
  o.job = "job";
  o.rank = 0;
  o.world = W;
  shardd_client_t *c = NULL;
  char err[512];
  shardd_err rc = shardd_connect(sock, &o, &c, err, sizeof err);
  if (c)
    shardd_close(c);
  if (rc != SHARDD_E_BUSY)
    return 11;
  return strstr(err, "gives no uid") && strstr(err, ".spec") ? 0 : 12;
}

Test(fabric, a_spec_without_uid_lays_out_one_users_job, .timeout = 60) {
  need_gloo();
  if (geteuid() != 0)
    cr_skip_test("needs root to act as a second uid");
  scratch s;
  scratch_make(&s);
  test_daemon pair[2];
  const char *jobs[] = {"job"};
  start_pair(pair, &s, jobs, 1, "5");
  shardd_client_t *c = test_connect(&pair[0], "job", 0, W);
  cr_assert_eq(chmod(pair[0].dir, 0755), 0);
  cr_assert_eq(chmod(pair[0].sock, 0666), 0);
  pid_t pid = fork();
  cr_assert(pid >= 0);
  if (pid == 0)
    _exit(other_uid_hello(pair[0].sock));
  int st;
  cr_assert(test_wait_exit(pid, &st));
  cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == 0, "step %d failed",
            WIFEXITED(st) ? WEXITSTATUS(st) : -1);
  shardd_close(c);
  test_daemon_finish(&pair[0]);
  test_daemon_finish(&pair[1]);
  scratch_remove(&s);
}

/* ---- a job spec is its uid's only, restored or not ----------------------- */

/* Node 0's spec of job for uid (< 0: none given), its path in out. */
static void write_spec_uid(const scratch *s, const char *job, int uid, char *out,
                           size_t len) {
  write_spec(s, job, 0, out, len);
  if (uid >= 0) {
    FILE *f = fopen(out, "a");
    cr_assert_not_null(f);
    fprintf(f, "uid = %d\n", uid);
    fclose(f);
  }
}

/* What an attacker can hold: a genuine exit part (DIR/job/node-0, with
 * its lineage) of its own job of that name, laid out as node 0 of 2 like
 * the spec's, written for uid into dir. */
static void write_own_part(const char *dir, const char *job, uint32_t uid) {
  char err[512];
  shardd__backend *be;
  cr_assert_eq(shardd__backend_host_create(2, 16u << 20, &be, err, sizeof err), SHARDD_OK,
               "%s", err);
  shardd__registry reg;
  shardd__registry_init(&reg, be);
  shardd__job *j;
  cr_assert_eq(shardd__job_get(&reg, job, W, uid, &j, err, sizeof err), SHARDD_OK, "%s",
               err);
  cr_assert_eq(shardd__job_set_layout(j, 2, 0, err, sizeof err), SHARDD_OK, "%s", err);
  j->lineage = 0x5eed;
  shardd__buffer *b;
  int created;
  cr_assert_eq(shardd__buffer_register(&reg, j, "w", SHARDD_DTYPE_FP32, 64, &b, &created,
                                       err, sizeof err),
               SHARDD_OK, "%s", err);
  char path[256];
  snprintf(path, sizeof path, "%s/%s", dir, job);
  cr_assert_eq(shardd__checkpoint_write(&reg, j, path, uid, err, sizeof err), SHARDD_OK,
               "%s", err);
  shardd__job_release(&reg, j);
  shardd__registry_free(&reg);
  be->ops->destroy(be);
}

/* Uid 1001 asks node 0's daemon (sock) to restore its part of job from
 * dir; 0 when refused with want and a message holding needle. */
static int attacker_restore(const char *sock, const char *dir, const char *job,
                            shardd_err want, const char *needle) {
  if (setgid(1001) != 0 || setuid(1001) != 0)
    return 10;
  shardd_client_t *c = NULL;
  shardd_connect_opts o = SHARDD_CONNECT_OPTS_INIT;
  char err[512], path[256];
  if (shardd_connect(sock, &o, &c, err, sizeof err) != SHARDD_OK)
    return 11;
  snprintf(path, sizeof path, "%s/%s", dir, job);
  shardd_err rc = shardd_restore(c, path, 0, NULL, 0);
  int bad = rc != want ? 12 : strstr(shardd_last_error(c), needle) ? 0 : 13;
  if (bad)
    fprintf(stderr, "attacker's restore of %s: %s: %s\n", path, shardd_err_name(rc),
            shardd_last_error(c));
  shardd_close(c);
  return bad;
}

/* Uid 1001's Hello of "vj" rank 2 (node 1's under the spec) on node 0: its
 * own job, which the spec does not lay out, so the rank is node 0's; 0 if
 * so. */
static int attacker_hello(const char *sock) {
  if (setgid(1001) != 0 || setuid(1001) != 0)
    return 10;
  shardd_connect_opts o = SHARDD_CONNECT_OPTS_INIT;
  o.job = "vj";
  o.rank = 2;
  o.world = W;
  shardd_client_t *c = NULL;
  char err[512];
  shardd_err rc = shardd_connect(sock, &o, &c, err, sizeof err);
  if (rc != SHARDD_OK)
    fprintf(stderr, "attacker's Hello: %s: %s\n", shardd_err_name(rc), err);
  if (c)
    shardd_close(c);
  return rc == SHARDD_OK ? 0 : 11;
}

static void expect_child(pid_t pid, const char *what) {
  int st;
  cr_assert(test_wait_exit(pid, &st), "%s hangs", what);
  cr_expect(WIFEXITED(st) && WEXITSTATUS(st) == 0, "%s: step %d failed", what,
            WIFEXITED(st) ? WEXITSTATUS(st) : -1);
}

/* The victim, uid 1002, holds rank 0 of job "open" (spec without a uid) on
 * node 0 until a byte comes on go; a byte on ready once it does. */
static int victim_holds(const char *sock, int ready, int go) {
  if (setgid(1002) != 0 || setuid(1002) != 0)
    return 10;
  shardd_connect_opts o = SHARDD_CONNECT_OPTS_INIT;
  o.job = "open";
  o.rank = 0;
  o.world = W;
  shardd_client_t *c = NULL;
  char err[512], b = 1;
  if (shardd_connect(sock, &o, &c, err, sizeof err) != SHARDD_OK) {
    fprintf(stderr, "victim: %s\n", err);
    return 11;
  }
  if (write(ready, &b, 1) != 1 || read(go, &b, 1) != 1)
    return 12;
  shardd_close(c);
  return 0;
}

/* A job spec that names uid 1002 lays out (and joins over the fabric, by
 * the job's name) uid 1002's job only. Uid 1001 holds an exit part of its
 * own job "vj" (node 0 of 2, world 4, as the spec says) and asks node 0's
 * daemon to restore it: the daemon once gave that job the spec's layout,
 * so it met the victim's node 1 in the rendezvous, its gathers read the
 * victim's shards and the victim's gather areas got its values. Refused
 * now, naming the spec (as its Hello of "vj" gets a job of its own that
 * the spec does not lay out); and a spec without a uid is taken by a restore as
 * by a Hello, one uid's job at a time: while uid 1002's "open" holds it,
 * uid 1001's restored "open" is refused. */
Test(fabric, a_restore_gets_a_job_spec_only_for_the_specs_uid, .timeout = 60) {
  need_gloo();
  if (geteuid() != 0)
    cr_skip_test("needs root to act as two uids");
  scratch s;
  scratch_make(&s);
  cr_assert_eq(chmod(s.dir, 0755), 0);
  char att[128], spec_vj[256], spec_open[256];
  snprintf(att, sizeof att, "%s/att", s.dir);
  cr_assert_eq(mkdir(att, 0700), 0);
  cr_assert_eq(chown(att, 1001, 1001), 0);
  write_own_part(att, "vj", 1001);
  write_own_part(att, "open", 1001);
  write_spec_uid(&s, "vj", 1002, spec_vj, sizeof spec_vj);
  write_spec_uid(&s, "open", -1, spec_open, sizeof spec_open);
  test_daemon d;
  test_daemon_start(&d, (const char *const[]){"--backend", "host", "--devices", "2",
                                              "--job-linger", "0", "--job-spec", spec_vj,
                                              "--job-spec", spec_open, NULL});
  cr_assert_eq(chmod(d.dir, 0755), 0);
  cr_assert_eq(chmod(d.sock, 0666), 0);

  pid_t pid = fork();
  cr_assert(pid >= 0);
  if (pid == 0)
    _exit(attacker_restore(d.sock, att, "vj", SHARDD_E_PERMISSION, "for uid 1002's job"));
  expect_child(pid, "uid 1001 restoring \"vj\" under uid 1002's spec");
  pid = fork();
  cr_assert(pid >= 0);
  if (pid == 0)
    _exit(attacker_hello(d.sock));
  expect_child(pid, "uid 1001's Hello of \"vj\", which uid 1002's spec does not lay out");

  int ready[2], go[2];
  cr_assert_eq(pipe(ready), 0);
  cr_assert_eq(pipe(go), 0);
  pid_t victim = fork();
  cr_assert(victim >= 0);
  if (victim == 0)
    _exit(victim_holds(d.sock, ready[1], go[0]));
  char b;
  cr_assert_eq(read(ready[0], &b, 1), 1, "the victim never joined \"open\"");
  pid = fork();
  cr_assert(pid >= 0);
  if (pid == 0)
    _exit(attacker_restore(d.sock, att, "open", SHARDD_E_BUSY, "gives no uid"));
  expect_child(pid, "uid 1001 restoring \"open\" while uid 1002's holds its spec");
  cr_assert_eq(write(go[1], &b, 1), 1);
  expect_child(victim, "the victim");
  close(ready[0]);
  close(ready[1]);
  close(go[0]);
  close(go[1]);

  /* the daemon kept none of the attacker's jobs */
  shardd_client_t *ctl = test_connect(&d, NULL, 0, 0);
  char *text = NULL;
  cr_assert_eq(shardd_status_text(ctl, &text), SHARDD_OK);
  cr_expect(strstr(text, "uid 1001") == NULL, "%s", text);
  shardd_free(text);
  shardd_close(ctl);
  test_daemon_finish(&d);
  scratch_remove(&s);
}

/* Node node's spec of job x for uid, its path in out (one file per uid). */
static void write_x_spec(const scratch *s, int node, int uid, char *out, size_t len) {
  snprintf(out, len, "%s/x.%d.node%d.spec", s->dir, uid, node);
  FILE *f = fopen(out, "w");
  cr_assert_not_null(f);
  fprintf(f, "job = x\nworld = %d\nnodes = 2\nnode_rank = %d\nlocal_ranks = %d\n"
             "rendezvous = %s\nhost = 127.0.0.1\nuid = %d\n",
          W, node, W / 2, s->rdv, uid);
  fclose(f);
}

/* Uid uid's two ranks of its job "x" on node (sock): each shard holds
 * mark, and both gather. 0 when the gather never met another node (E_PEER_LOST
 * at the collective timeout); 20 when it met the other uid's job (the
 * other node's part holds other), 21 when it met something else. */
static int x_ranks(const char *sock, uid_t uid, int node, float mark, float other) {
  if (setgid(uid) != 0 || setuid(uid) != 0)
    return 10;
  shardd_client_t *c[2];
  shardd_buffer_info b[2];
  for (int k = 0; k < 2; k++) {
    shardd_connect_opts o = SHARDD_CONNECT_OPTS_INIT;
    o.job = "x";
    o.rank = (uint32_t)(2 * node + k);
    o.world = W;
    char err[512];
    if (shardd_connect(sock, &o, &c[k], err, sizeof err) != SHARDD_OK) {
      fprintf(stderr, "uid %d: %s\n", (int)uid, err);
      return 11;
    }
    if (shardd_buffer_register(c[k], "w", SHARDD_DTYPE_FP32, 8, &b[k]) != SHARDD_OK)
      return 12;
    for (size_t j = 0; j < b[k].shard_numel; j++)
      ((float *)b[k].shard)[j] = mark;
  }
  shardd_ticket t[2];
  for (int k = 0; k < 2; k++)
    if (shardd_gather_async(c[k], b[k].id, &t[k]) != SHARDD_OK)
      return 13;
  shardd_err rc[2];
  for (int k = 0; k < 2; k++)
    rc[k] = shardd_wait(c[k], t[k]);
  int out = 0;
  if (rc[0] == SHARDD_OK) {
    float seen = ((float *)b[0].gather)[node == 0 ? 4 : 0]; /* the other node's part */
    fprintf(stderr, "uid %d's gather met another node: it holds %g\n", (int)uid, seen);
    out = seen == other ? 20 : 21;
  } else if (rc[0] != SHARDD_E_PEER_LOST) {
    fprintf(stderr, "uid %d: %s: %s\n", (int)uid, shardd_err_name(rc[0]),
            shardd_last_error(c[0]));
    out = 22;
  }
  for (int k = 0; k < 2; k++)
    shardd_close(c[k]);
  return out;
}

/* Job names are per uid, so two specs may name one job for two uids, and
 * share a rendezvous directory. Uid 1001's "x" on node 0 and uid 1002's
 * "x" on node 1 once met there (the files were named by the job's name
 * alone): one fabric, each gather returning the other user's shards. Now
 * the files are named by uid and name: neither finds a peer, and each
 * gather fails at the collective timeout. */
Test(fabric, two_uids_jobs_of_one_name_never_meet_in_a_rendezvous, .timeout = 60) {
  need_gloo();
  if (geteuid() != 0)
    cr_skip_test("needs root to act as two uids");
  scratch s;
  scratch_make(&s);
  cr_assert_eq(chmod(s.dir, 0755), 0);
  test_daemon d[2];
  static char spec[2][2][256];
  for (int n = 0; n < 2; n++) {
    write_x_spec(&s, n, 1001, spec[n][0], sizeof spec[n][0]);
    write_x_spec(&s, n, 1002, spec[n][1], sizeof spec[n][1]);
    test_daemon_start(&d[n], (const char *const[]){
                                 "--backend", "host", "--devices", "2",
                                 "--collective-timeout", "2", "--job-linger", "0",
                                 "--job-spec", spec[n][0], "--job-spec", spec[n][1], NULL});
    cr_assert_eq(chmod(d[n].dir, 0755), 0);
    cr_assert_eq(chmod(d[n].sock, 0666), 0);
  }
  pid_t a = fork();
  cr_assert(a >= 0);
  if (a == 0)
    _exit(x_ranks(d[0].sock, 1001, 0, 1.0f, 2.0f));
  pid_t v = fork();
  cr_assert(v >= 0);
  if (v == 0)
    _exit(x_ranks(d[1].sock, 1002, 1, 2.0f, 1.0f));
  expect_child(a, "uid 1001's \"x\" on node 0");
  expect_child(v, "uid 1002's \"x\" on node 1");
  test_daemon_finish(&d[0]);
  test_daemon_finish(&d[1]);
  scratch_remove(&s);
}

/* Whether node's announcement is in the rendezvous directory: its daemon
 * has begun the rendezvous (fabric_gloo.cc writes shardd-*.node<N>). */
static int announced(const char *rdv, int node) {
  char suffix[16];
  snprintf(suffix, sizeof suffix, ".node%d", node);
  DIR *dir = opendir(rdv);
  cr_assert_not_null(dir, "%s: %s", rdv, strerror(errno));
  int hit = 0;
  for (struct dirent *e; !hit && (e = readdir(dir)) != NULL;) {
    size_t n = strlen(e->d_name), k = strlen(suffix);
    hit = !strncmp(e->d_name, "shardd-", 7) && n > k && !strcmp(e->d_name + n - k, suffix);
  }
  closedir(dir);
  return hit;
}

/* Ranks 0 and 1 gather; ranks 2 and 3 (node 1) never come, and node 1's
 * daemon never joins: the collective fails at the rendezvous timeout with
 * the missing node named, and the daemon answers status meanwhile. */
Test(fabric, missing_node_named_at_rendezvous_timeout, .timeout = 60) {
  need_gloo();
  scratch s;
  scratch_make(&s);
  char spec[256];
  write_spec(&s, "lonely", 0, spec, sizeof spec);
  /* 5 s: the test waits for it; a status must come back within it, which
   * is far from what a status takes even on a loaded machine */
  const char *args[] = {"--backend", "host", "--devices", "2", "--collective-timeout",
                        "5", "--job-spec", spec, NULL};
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
  double t0 = test_mono_s();
  for (int r = 0; r < 2; r++) {
    calls[r].c = c[r];
    calls[r].kind = OP_GATHER;
    calls[r].id = info[0].id;
    pthread_create(&calls[r].th, NULL, call_main, &calls[r]);
  }
  /* status answers while the rendezvous waits (it once waited with it):
   * asked once the rendezvous is under way, it must still show the gather
   * in flight and node 1 not contacted, i.e. answer before the rendezvous
   * failed, not after */
  for (double end = test_mono_s() + TEST_HANG_S; !announced(s.rdv, 0);) {
    cr_assert_lt(test_mono_s(), end, "node 0 never began the rendezvous in %s", s.rdv);
    test_sleep_ms(10);
  }
  shardd_client_t *ctl = test_connect(&d, NULL, 0, 0);
  char *text = NULL;
  cr_expect_eq(shardd_status_text(ctl, &text), SHARDD_OK);
  cr_expect(text && strstr(text, "job lonely: world 4 clients 2 ") != NULL,
            "status during the rendezvous: %s", text ? text : "(none)");
  cr_expect(text && strstr(text, "collectives_in_flight 1\n") != NULL,
            "status does not show the rendezvous under way: %s", text ? text : "(none)");
  cr_expect(text && strstr(text, "node 1: ranks 2..3 not contacted") != NULL,
            "status does not show the rendezvous under way: %s", text ? text : "(none)");
  shardd_free(text);
  shardd_close(ctl);
  for (int r = 0; r < 2; r++)
    pthread_join(calls[r].th, NULL);
  double took = test_mono_s() - t0;
  for (int r = 0; r < 2; r++) {
    cr_expect_eq(calls[r].rc, SHARDD_E_PEER_LOST, "rank %d: %s", r, shardd_err_name(calls[r].rc));
    cr_expect(strstr(calls[r].msg, "node 1 of 2 did not join the rendezvous") != NULL,
              "rank %d: %s", r, calls[r].msg);
  }
  /* not before the timeout (an upper bound would measure the machine) */
  cr_expect_gt(took, 4.5, "failed after %.1f s (timeout 5 s)", took);
  for (int r = 0; r < 2; r++)
    shardd_close(c[r]);
  test_daemon_finish(&d);
  scratch_remove(&s);
}

/* The collective timeout is an hour: the pending gathers can only fail by
 * the survivor noticing its dead peer, and the test's timeout is the hang
 * guard. */
Test(fabric, killed_daemon_fails_pending_collectives_survivor_serves, .timeout = 60) {
  need_gloo();
  scratch s;
  scratch_make(&s);
  test_daemon pair[2];
  const char *jobs[] = {"doomed"};
  start_pair(pair, &s, jobs, 1, "3600");
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
  double t0 = test_mono_s();
  kill(pair[1].pid, SIGKILL);
  waitpid(pair[1].pid, NULL, 0);
  pair[1].pid = 0;
  for (int r = 0; r < 2; r++)
    pthread_join(calls[r].th, NULL);
  double took = test_mono_s() - t0;
  for (int r = 0; r < 2; r++) {
    cr_expect_eq(calls[r].rc, SHARDD_E_PEER_LOST, "rank %d: %s: %s", r,
                 shardd_err_name(calls[r].rc), calls[r].msg);
    cr_expect(strstr(calls[r].msg, "failed across the nodes of job \"doomed\"") != NULL,
              "rank %d: %s", r, calls[r].msg);
  }
  cr_log_info("fabric: pending gather failed %.3f s after the peer daemon died: %s", took,
              calls[0].msg);

  /* (its next collective would wait up to the timeout for node 1 to come
   * back and re-form the fabric: a_node_that_rejoins_with_other_state_or_
   * never_is_named) */

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

/* ---- stopping a daemon inside an exchange (issue 21) ---------------------- */

/* Waits until node d's status shows buffer name's collective running (every
 * local rank arrived: it is past its local part, in its exchange or about
 * to be). */
static void wait_running(const test_daemon *d, const char *name) {
  char needle[96];
  snprintf(needle, sizeof needle, "(%s): running", name);
  shardd_client_t *ctl = test_connect(d, NULL, 0, 0);
  for (double end = test_mono_s() + TEST_HANG_S;;) {
    char *text = NULL;
    cr_assert_eq(shardd_status_text(ctl, &text), SHARDD_OK);
    int hit = strstr(text, needle) != NULL;
    shardd_free(text);
    if (hit)
      break;
    cr_assert(test_mono_s() < end, "%s never ran on %s", name, d->sock);
    test_sleep_ms(20);
  }
  shardd_close(ctl);
}

/* ---- a node's daemon killed: its survivors' jobs released --------------- */

/* Closes every connection this process holds to the daemon at sock
 * (shutdown: the daemon reads EOF at once, a thread blocked in a call on
 * it returns), as killing the trainers of that node would. */
static int cut_connections_to(const char *sock) {
  int n = 0;
  for (int fd = 3; fd < 4096; fd++) {
    struct sockaddr_un sa;
    socklen_t len = sizeof sa;
    memset(&sa, 0, sizeof sa);
    if (getpeername(fd, (struct sockaddr *)&sa, &len) == 0 &&
        sa.sun_family == AF_UNIX && strcmp(sa.sun_path, sock) == 0) {
      shutdown(fd, SHUT_RDWR);
      n++;
    }
  }
  return n;
}

/* `shardctl release job` on d, again every 100 ms while it is refused,
 * for at most max_s: the seconds it took until the release went through,
 * or -1 (the last refusal in last). */
static double release_within(const test_daemon *d, const char *job, double max_s,
                             char *first, char *last, size_t lastlen) {
  char cmd[300];
  snprintf(cmd, sizeof cmd, "--socket %s release %s", d->sock, job);
  double t0 = test_mono_s();
  first[0] = '\0';
  for (;;) {
    char *out = NULL, *errs = NULL;
    int rc = test_shardctl(NULL, cmd, &out, &errs);
    snprintf(last, lastlen, "%s%s", out ? out : "", errs ? errs : "");
    if (!first[0])
      snprintf(first, lastlen, "%s", last);
    free(out);
    free(errs);
    if (rc == 0)
      return test_mono_s() - t0;
    if (test_mono_s() - t0 > max_s)
      return -1;
    test_sleep_ms(100);
  }
}

/* kill -9 of node 1's daemon while the job trains (the OOM killer, a
 * crash, power loss): node 1's shards are gone, so the job cannot go on
 * and must be released on the survivors and restored from a collective
 * checkpoint. Node 0's ranks get E_PEER_LOST and retry (as a trainer
 * does), which re-forms the fabric, a wait for node 1 of up to the
 * collective timeout (60 s here). The operator then stops node 0's
 * trainers: with them gone for --peer-grace (1 s), the re-forming nobody
 * waits for any more is abandoned, and `shardctl release` goes through
 * within the grace, not at the collective timeout. */
Test(fabric, a_killed_nodes_survivor_releases_its_job_within_the_peer_grace,
     .timeout = 120) {
  need_gloo();
  scratch s;
  scratch_make(&s);
  test_daemon pair[2];
  const char *jobs[] = {"kj"};
  const char *linger[] = {"--job-linger", "600", NULL};
  start_pair_each(pair, &s, jobs, 1, "60", linger, linger);
  shardd_client_t *c[W];
  shardd_buffer_info info[W];
  for (int r = 0; r < W; r++) {
    c[r] = test_connect(&pair[r / 2], "kj", (uint32_t)r, W);
    cr_assert_eq(shardd_buffer_register(c[r], "w", SHARDD_DTYPE_FP32, 4000, &info[r]),
                 SHARDD_OK);
  }
  all_ranks(c, OP_GATHER, info[0].id, 0, NULL); /* the fabric is up */
  kill(pair[1].pid, SIGKILL);
  waitpid(pair[1].pid, NULL, 0);
  pair[1].pid = 0;

  /* node 0's ranks: the next gather fails on the dead fabric; the retry
   * re-forms it and waits for node 1 */
  call calls[2];
  for (int attempt = 0; attempt < 2; attempt++) {
    memset(calls, 0, sizeof calls);
    for (int r = 0; r < 2; r++) {
      calls[r].c = c[r];
      calls[r].kind = OP_GATHER;
      calls[r].id = info[0].id;
      pthread_create(&calls[r].th, NULL, call_main, &calls[r]);
    }
    if (attempt == 1)
      break;
    for (int r = 0; r < 2; r++) {
      pthread_join(calls[r].th, NULL);
      cr_assert_eq(calls[r].rc, SHARDD_E_PEER_LOST, "rank %d: %s: %s", r,
                   shardd_err_name(calls[r].rc), calls[r].msg);
    }
  }
  wait_running(&pair[0], "w");
  test_sleep_ms(300); /* inside the re-forming's rendezvous */

  /* the operator stops node 0's trainers, then releases the job */
  double t0 = test_mono_s();
  cr_assert_eq(cut_connections_to(pair[0].sock), 2);
  for (int r = 0; r < 2; r++)
    pthread_join(calls[r].th, NULL);
  char first[1024], last[1024];
  double took = release_within(&pair[0], "kj", 50, first, last, sizeof last);
  cr_log_info("fabric: node 1 killed: node 0's job released %.2f s after its "
              "trainers stopped (--peer-grace 1 s, collective timeout 60 s)",
              test_mono_s() - t0);
  cr_assert(took >= 0, "node 0 still refuses the release after 50 s: %s", last);
  cr_expect_lt(test_mono_s() - t0, 1 + 4, "released %.1f s after the trainers "
               "stopped (--peer-grace 1 s): %s", test_mono_s() - t0, last);
  cr_expect(test_daemon_log_has(&pair[0], "abandoned"),
            "the log does not say the re-forming was abandoned");
  /* the refusal before the grace ran out says when to try again */
  cr_expect(strstr(first, "released") != NULL ||
                strstr(first, "abandoned --peer-grace after this node's last "
                              "rank of the job left") != NULL,
            "first refusal: %s", first);
  cr_log_info("fabric: the release refused within the grace: %s", first);
  for (int r = 0; r < W; r++)
    shardd_close(c[r]);
  test_daemon_finish(&pair[0]);
  test_daemon_stop(&pair[1]);
  scratch_remove(&s);
}

static float stop_val(int rank, size_t j) { return (float)(rank * 10000 + (int)j); }

/* Node 0's ranks gather "w" while node 1's ranks gather "v" instead: each
 * node's exchange waits for a peer that never answers it. SIGTERM node 0
 * (--checkpoint-on-exit): its ranks get E_SHUTDOWN naming the stop (not
 * E_PEER_LOST), it runs --checkpoint-on-exit and exits well inside the
 * collective timeout (30 s here; the promise is 5 s); node 1's ranks get
 * E_PEER_LOST at once, not at the timeout, and later collectives of the job
 * fail at once too. Node 0 also serves a one-node job, whose exit
 * checkpoint restores into a fresh daemon with the values written before;
 * the multi-node job's own checkpoint is written where multi-node
 * checkpoints are supported, else refused with that reason (the exit
 * status says so). */
Test(fabric, sigterm_inside_an_exchange_aborts_it_checkpoints_and_exits, .timeout = 60) {
  need_gloo();
  scratch s;
  scratch_make(&s);
  char ck[128];
  snprintf(ck, sizeof ck, "%s/exit", s.dir);
  test_daemon pair[2];
  const char *jobs[] = {"halt"};
  const char *extra0[] = {"--checkpoint-on-exit", ck, NULL};
  start_pair_ex(pair, &s, jobs, 1, "30", extra0);
  shardd_client_t *c[W];
  shardd_buffer_info w[W], v[W];
  for (int r = 0; r < W; r++) {
    c[r] = test_connect(&pair[r / 2], "halt", (uint32_t)r, W);
    cr_assert_eq(shardd_buffer_register(c[r], "w", SHARDD_DTYPE_FP32, 4000, &w[r]), SHARDD_OK);
    cr_assert_eq(shardd_buffer_register(c[r], "v", SHARDD_DTYPE_FP32, 4000, &v[r]), SHARDD_OK);
    for (size_t j = 0; j < w[r].shard_numel; j++)
      ((float *)w[r].shard)[j] = stop_val(r, j);
  }
  shardd_client_t *solo[2];
  shardd_buffer_info so[2];
  for (int r = 0; r < 2; r++) {
    solo[r] = test_connect(&pair[0], "solo", (uint32_t)r, 2);
    cr_assert_eq(shardd_buffer_register(solo[r], "p", SHARDD_DTYPE_FP32, 2000, &so[r]),
                 SHARDD_OK);
    for (size_t j = 0; j < so[r].shard_numel; j++)
      ((float *)so[r].shard)[j] = stop_val(r + 7, j);
  }
  all_ranks(c, OP_GATHER, w[0].id, 0, NULL); /* the fabric is up */
  for (int r = 0; r < W; r++)
    cr_assert_eq(((float *)w[r].gather)[1000 + 3], stop_val(1, 3), "rank %d", r);

  call calls[W];
  memset(calls, 0, sizeof calls);
  for (int r = 0; r < W; r++) {
    calls[r].c = c[r];
    calls[r].kind = OP_GATHER;
    calls[r].id = r < 2 ? w[r].id : v[r].id;
    cr_assert_eq(pthread_create(&calls[r].th, NULL, call_main, &calls[r]), 0);
  }
  wait_running(&pair[0], "w");
  wait_running(&pair[1], "v");

  double t0 = test_mono_s();
  kill(pair[0].pid, SIGTERM);
  int status = -1;
  cr_assert(test_wait_exit(pair[0].pid, &status), "node 0 did not exit within %.0f s",
            TEST_HANG_S);
  double exit_s = test_mono_s() - t0;
  pair[0].pid = 0;
  for (int r = 0; r < W; r++)
    pthread_join(calls[r].th, NULL);
  double peer_s = test_mono_s() - t0;
  cr_log_info("fabric: node 0 exited %.3f s after SIGTERM inside an exchange "
              "(promise: 5 s; collective timeout 30 s); node 1's ranks answered "
              "within %.3f s", exit_s, peer_s);
  /* --checkpoint-on-exit ran: exit 0 when every job's checkpoint was
   * written, 1 when one was refused (logged) */
  /* the multi-node job: node 0's part alone (the other node cannot take
   * part in a daemon's exit), and no job manifest, which is logged */
  char manifest[200];
  snprintf(manifest, sizeof manifest, "%s/halt/node-0/manifest", ck);
  cr_expect_eq(access(manifest, R_OK), 0, "no %s", manifest);
  snprintf(manifest, sizeof manifest, "%s/halt/manifest", ck);
  cr_expect_neq(access(manifest, F_OK), 0, "%s written by one node's exit", manifest);
  cr_expect(test_daemon_log_has(&pair[0], "part written to ") &&
                test_daemon_log_has(&pair[0], "without a job manifest"),
            "the part without a job manifest is not logged");
  cr_expect(WIFEXITED(status) && WEXITSTATUS(status) == 0, "node 0 exit status %d",
            status);
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0)
    test_daemon_dump_log(&pair[0]);
  cr_expect_lt(exit_s, 15.0, "node 0 took %.1f s to stop", exit_s);
  for (int r = 0; r < 2; r++) {
    cr_expect_eq(calls[r].rc, SHARDD_E_SHUTDOWN, "rank %d: %s: %s", r,
                 shardd_err_name(calls[r].rc), calls[r].msg);
    cr_expect(strstr(calls[r].msg, "daemon stopping (SIGTERM)") != NULL, "rank %d: %s", r,
              calls[r].msg);
    cr_expect(strstr(calls[r].msg, "failed across the nodes of job \"halt\"") != NULL,
              "rank %d: %s", r, calls[r].msg);
  }
  cr_log_info("fabric: node 0's rank heard: %s", calls[0].msg);
  for (int r = 2; r < W; r++) {
    cr_expect_eq(calls[r].rc, SHARDD_E_PEER_LOST, "rank %d: %s: %s", r,
                 shardd_err_name(calls[r].rc), calls[r].msg);
    cr_expect(strstr(calls[r].msg, "failed across the nodes of job \"halt\"") != NULL,
              "rank %d: %s", r, calls[r].msg);
  }
  cr_expect_lt(peer_s, 15.0, "node 1's ranks waited %.1f s", peer_s);
  cr_log_info("fabric: node 1's rank heard: %s", calls[2].msg);

  /* node 1 keeps serving; the job's next collective would wait for node
   * 0's daemon to come back (a_node_daemon_restart_rejoins_the_job_bit_for_bit) */
  for (int r = 0; r < W; r++)
    shardd_close(c[r]);
  for (int r = 0; r < 2; r++)
    shardd_close(solo[r]);

  /* the one-node job's exit checkpoint is whole and restores its shards */
  char solo_dir[160];
  snprintf(solo_dir, sizeof solo_dir, "%s/solo", ck);
  snprintf(manifest, sizeof manifest, "%s/manifest", solo_dir);
  cr_assert_eq(access(manifest, R_OK), 0, "no %s", manifest);
  test_daemon back;
  test_daemon_start(&back, (const char *const[]){"--backend", "host", "--devices", "2",
                                                 "--restore", solo_dir, NULL});
  { /* the multi-node job's part alone is refused by a daemon without the
     * job's spec, saying what is missing (one with it rejoins the job) */
    char halt_dir[160];
    snprintf(halt_dir, sizeof halt_dir, "%s/halt", ck);
    shardd_client_t *ctl = test_connect(&back, NULL, 0, 0);
    cr_expect_eq(shardd_restore(ctl, halt_dir, 0, NULL, 0), SHARDD_E_IO);
    cr_expect(strstr(shardd_last_error(ctl), "no job manifest") != NULL, "%s",
              shardd_last_error(ctl));
    cr_log_info("fabric: restoring the exit part alone: %s", shardd_last_error(ctl));
    shardd_close(ctl);
  }
  for (int r = 0; r < 2; r++) {
    shardd_client_t *b = test_connect(&back, "solo", (uint32_t)r, 2);
    shardd_buffer_info bi;
    cr_assert_eq(shardd_buffer_register(b, "p", SHARDD_DTYPE_FP32, 2000, &bi), SHARDD_OK,
                 "%s", shardd_last_error(b));
    cr_assert_eq(bi.shard_numel, 1000);
    for (size_t j = 0; j < bi.shard_numel; j++)
      cr_assert_eq(((float *)bi.shard)[j], stop_val(r + 7, j), "restored rank %d [%zu]", r, j);
    shardd_close(b);
  }
  test_daemon_finish(&back);
  test_daemon_stop(&pair[0]);
  test_daemon_finish(&pair[1]);
  scratch_remove(&s);
}

/* ---- many cross-node collectives in flight at once ------------------------ */

#define NB 8 /* buffers gathered at once: twice a pool of 4 */

typedef struct {
  shardd_client_t *c;
  const shardd_buffer_info *info; /* [NB] */
  int reverse;                    /* issue the gathers from the last buffer */
  shardd_err rc;
  char msg[1024];
  pthread_t th;
} prefetch_rank;

static void *prefetch_main(void *p) {
  prefetch_rank *k = p;
  shardd_ticket t[NB];
  int n = 0;
  for (; n < NB; n++) {
    int b = k->reverse ? NB - 1 - n : n;
    if ((k->rc = shardd_gather_async(k->c, k->info[b].id, &t[n])) != SHARDD_OK)
      break;
  }
  for (int i = 0; i < n; i++) {
    shardd_err rc = shardd_wait(k->c, t[i]);
    if (rc != SHARDD_OK && k->rc == SHARDD_OK)
      k->rc = rc;
  }
  snprintf(k->msg, sizeof k->msg, "%s", k->rc ? shardd_last_error(k->c) : "");
  return NULL;
}

/* Node 0's ranks prefetch NB buffers first to last, node 1's last to first,
 * so each node has every cross-node exchange ready at once, in the other
 * order, in two jobs between the same daemons at once. A daemon that ran
 * the exchanges on its pool of 4 threads, each waiting for its peer, filled
 * the pool with exchanges the other node could not join (its own pool full
 * of the others) and stalled until the collective timeout (10 s here),
 * which then failed the jobs. */
#define NJOBS 2
Test(fabric, many_inflight_gathers_in_opposite_orders_do_not_stall, .timeout = 60) {
  need_gloo();
  setenv("UV_THREADPOOL_SIZE", "4", 1); /* inherited by both daemons */
  scratch s;
  scratch_make(&s);
  test_daemon pair[2];
  const char *jobs[NJOBS] = {"prefetch-a", "prefetch-b"};
  start_pair(pair, &s, jobs, NJOBS, "10");
  shardd_client_t *c[NJOBS][W];
  static shardd_buffer_info info[NJOBS][W][NB];
  for (int j = 0; j < NJOBS; j++)
    for (int r = 0; r < W; r++) {
      shardd_connect_opts o = SHARDD_CONNECT_OPTS_INIT;
      o.job = jobs[j];
      o.rank = (uint32_t)r;
      o.world = W;
      o.max_inflight_gathers = NB;
      char err[512];
      cr_assert_eq(shardd_connect(pair[r / 2].sock, &o, &c[j][r], err, sizeof err),
                   SHARDD_OK, "%s", err);
      for (int b = 0; b < NB; b++) {
        char name[16];
        snprintf(name, sizeof name, "b%d", b);
        cr_assert_eq(shardd_buffer_register(c[j][r], name, SHARDD_DTYPE_FP32,
                                            (uint64_t)(1000 + 40 * b), &info[j][r][b]),
                     SHARDD_OK, "%s", shardd_last_error(c[j][r]));
        float *sh = info[j][r][b].shard;
        size_t sn = info[j][r][b].shard_numel;
        for (size_t e = 0; e < sn; e++)
          sh[e] = (float)(j * 1000000 + b * 100000 + r * (int)sn + (int)e);
      }
    }
  for (int round = 0; round < 3; round++) {
    prefetch_rank k[NJOBS][W];
    memset(k, 0, sizeof k);
    double t0 = test_mono_s();
    for (int j = 0; j < NJOBS; j++)
      for (int r = 0; r < W; r++) {
        k[j][r].c = c[j][r];
        k[j][r].info = info[j][r];
        k[j][r].reverse = r >= 2;
        cr_assert_eq(pthread_create(&k[j][r].th, NULL, prefetch_main, &k[j][r]), 0);
      }
    for (int j = 0; j < NJOBS; j++)
      for (int r = 0; r < W; r++)
        pthread_join(k[j][r].th, NULL);
    double took = test_mono_s() - t0;
    for (int j = 0; j < NJOBS; j++)
      for (int r = 0; r < W; r++)
        cr_assert_eq(k[j][r].rc, SHARDD_OK, "round %d job %s rank %d after %.1f s: %s: %s",
                     round, jobs[j], r, took, shardd_err_name(k[j][r].rc), k[j][r].msg);
    cr_log_info("fabric: %d jobs x %d gathers in flight per rank, opposite orders on "
                "the two nodes: round %d took %.3f s",
                NJOBS, NB, round, took);
    for (int j = 0; j < NJOBS; j++)
      for (int r = 0; r < W; r++)
        for (int b = 0; b < NB; b++) {
          const float *g = info[j][r][b].gather;
          for (size_t e = 0; e < info[j][r][b].padded_numel; e++)
            cr_assert_eq(g[e], (float)(j * 1000000 + b * 100000 + (int)e),
                         "job %d rank %d buffer %d gather[%zu]", j, r, b, e);
        }
  }
  for (int j = 0; j < NJOBS; j++)
    for (int r = 0; r < W; r++)
      shardd_close(c[j][r]);
  test_daemon_finish(&pair[0]);
  test_daemon_finish(&pair[1]);
  scratch_remove(&s);
}

/* ---- what the nodes disagree on fails loudly, and only that -------------- */

static void run_calls(call *k, shardd_client_t **c, int n, int kind, uint64_t const *ids,
                      const int *sum) {
  memset(k, 0, (size_t)n * sizeof *k);
  for (int r = 0; r < n; r++) {
    k[r].c = c[r];
    k[r].kind = kind;
    k[r].id = ids[r];
    k[r].sum = sum ? sum[r] : 0;
    cr_assert_eq(pthread_create(&k[r].th, NULL, call_main, &k[r]), 0);
  }
  for (int r = 0; r < n; r++)
    pthread_join(k[r].th, NULL);
}

/* Node 1's ranks register "w" with 1004 elements where node 0's have 1000,
 * and later scatter with another reduction: each collective fails on every
 * rank, quickly, saying what differs, without touching a shard; the
 * fabric stays up and the job's agreeing collectives go on. */
Test(fabric, disagreeing_nodes_fail_with_mismatch_and_fabric_stays_up, .timeout = 60) {
  need_gloo();
  scratch s;
  scratch_make(&s);
  test_daemon pair[2];
  const char *jobs[] = {"mix"};
  start_pair(pair, &s, jobs, 1, "10");
  shardd_client_t *c[W];
  shardd_buffer_info w[W], ok[W];
  uint64_t wid[W], okid[W];
  for (int r = 0; r < W; r++) {
    c[r] = test_connect(&pair[r / 2], "mix", (uint32_t)r, W);
    cr_assert_eq(shardd_buffer_register(c[r], "w", SHARDD_DTYPE_FP32, r < 2 ? 1000 : 1004,
                                        &w[r]), SHARDD_OK, "%s", shardd_last_error(c[r]));
    cr_assert_eq(shardd_buffer_register(c[r], "ok", SHARDD_DTYPE_FP32, 100, &ok[r]),
                 SHARDD_OK, "%s", shardd_last_error(c[r]));
    for (size_t j = 0; j < ok[r].shard_numel; j++)
      ((float *)ok[r].shard)[j] = (float)(r * 25 + (int)j);
    for (size_t j = 0; j < ok[r].padded_numel; j++)
      ((float *)ok[r].grad)[j] = (float)(r + 1);
    wid[r] = w[r].id;
    okid[r] = ok[r].id;
  }
  call k[W];
  double t0 = test_mono_s();
  run_calls(k, c, W, OP_GATHER, wid, NULL);
  for (int r = 0; r < W; r++) {
    cr_expect_eq(k[r].rc, SHARDD_E_MISMATCH, "rank %d: %s: %s", r, shardd_err_name(k[r].rc),
                 k[r].msg);
    const char *want = r < 2 ? "node 1 has buffer \"w\" as 1004 fp32 elements (2008 bytes "
                               "per node), this node as 1000 fp32 (2000)"
                             : "node 0 has buffer \"w\" as 1000 fp32 elements (2000 bytes "
                               "per node), this node as 1004 fp32 (2008)";
    cr_expect(strstr(k[r].msg, want) != NULL, "rank %d: %s", r, k[r].msg);
  }
  /* the message says what differs: the nodes compared, no timeout ended it */
  cr_log_info("fabric: mismatched registration, %.3f s: %s", test_mono_s() - t0, k[0].msg);

  /* the fabric is up: an agreeing gather goes through */
  run_calls(k, c, W, OP_GATHER, okid, NULL);
  for (int r = 0; r < W; r++) {
    cr_assert_eq(k[r].rc, SHARDD_OK, "rank %d: %s", r, k[r].msg);
    for (size_t j = 0; j < 100; j++)
      cr_expect_eq(((float *)ok[r].gather)[j], (float)j, "rank %d gather[%zu]", r, j);
  }

  /* node 0 sums where node 1 averages: refused, reduced shards untouched */
  float before[W][25];
  for (int r = 0; r < W; r++)
    memcpy(before[r], ok[r].reduced, sizeof before[r]);
  int sum[W] = {1, 1, 0, 0};
  run_calls(k, c, W, OP_SCATTER, okid, sum);
  for (int r = 0; r < W; r++) {
    cr_expect_eq(k[r].rc, SHARDD_E_MISMATCH, "rank %d: %s: %s", r, shardd_err_name(k[r].rc),
                 k[r].msg);
    cr_expect(strstr(k[r].msg, r < 2 ? "node 1 reduces buffer \"ok\" by mean, this node by sum"
                                     : "node 0 reduces buffer \"ok\" by sum, this node by mean")
                  != NULL, "rank %d: %s", r, k[r].msg);
    cr_expect(memcmp(before[r], ok[r].reduced, sizeof before[r]) == 0,
              "rank %d: a refused scatter changed the reduced shard", r);
  }
  run_calls(k, c, W, OP_SCATTER, okid, NULL);
  for (int r = 0; r < W; r++) {
    cr_assert_eq(k[r].rc, SHARDD_OK, "rank %d: %s", r, k[r].msg);
    for (size_t j = 0; j < 25; j++)
      cr_expect_eq(((float *)ok[r].reduced)[j], 2.5f, "rank %d reduced[%zu]", r, j);
  }
  /* node 1 steps with another lr (no clipping, so no norm crosses nodes):
   * refused naming the node and the field, no shard changed; then the
   * per-group hyperparameters differ; then node 0 refuses the step itself
   * (a momentum override the SGD group was not registered with): its ranks
   * hear why, node 1's get E_MISMATCH naming node 0 at once (they used to
   * wait in the exchange until the timeout lost the fabric); then node 0's
   * two ranks disagree with each other on lr, alike; then they agree */
  uint64_t opt[W];
  for (int r = 0; r < W; r++) {
    shardd_param_ref ref = {okid[r], "ok"};
    shardd_param_group g = {&ref, 1, {0}};
    shardd_hparams hp = {SHARDD_HP_LR, 0.5, 0, 0, 0, 0, 0, 0, 0, 0, 0};
    cr_assert_eq(shardd_optimizer_register(c[r], "sgd", SHARDD_OPTIM_SGD, &hp, &g, 1, &opt[r]),
                 SHARDD_OK, "%s", shardd_last_error(c[r]));
  }
  for (int r = 0; r < W; r++)
    memcpy(before[r], ok[r].shard, sizeof before[r]);
  for (int round = 0; round < 5; round++) {
    shardd_hparams g1 = {SHARDD_HP_WEIGHT_DECAY, 0, 0, 0, 0.01, 0, 0, 0, 0, 0, 0};
    shardd_hparams bad = {SHARDD_HP_MOMENTUM, 0, 0.9, 0, 0, 0, 0, 0, 0, 0, 0};
    t0 = test_mono_s();
    memset(k, 0, sizeof k);
    for (int r = 0; r < W; r++) {
      k[r].c = c[r];
      k[r].kind = OP_STEP;
      k[r].id = opt[r];
      shardd_step_opts so = SHARDD_STEP_OPTS_INIT;
      so.lr = (round == 0 && r >= 2) || (round == 3 && r == 1) ? 0.25 : 0.125;
      if (round == 1 && r >= 2) {
        so.groups = &g1;
        so.ngroups = 1;
      }
      if (round == 2 && r < 2) {
        so.groups = &bad;
        so.ngroups = 1;
      }
      k[r].so = so;
      cr_assert_eq(pthread_create(&k[r].th, NULL, call_main, &k[r]), 0);
    }
    for (int r = 0; r < W; r++)
      pthread_join(k[r].th, NULL);
    if (round == 2)
      cr_log_info("fabric: a step refused on node 0, answered on node 1 in %.3f s: %s",
                  test_mono_s() - t0, k[2].msg);
    for (int r = 0; r < W; r++) {
      if (round == 4) {
        cr_assert_eq(k[r].rc, SHARDD_OK, "rank %d: %s", r, k[r].msg);
        continue;
      }
      if (round == 2 || round == 3) {
        shardd_err want_rc = r >= 2 ? SHARDD_E_MISMATCH : round == 2 ? SHARDD_E_INVAL
                                                                     : SHARDD_E_MISMATCH;
        const char *want = r >= 2      ? "node 0 refused step of optimizer \"sgd\" locally"
                           : round == 2 ? "param group 0: momentum 0.9 where the group "
                                          "was registered with 0"
                                        : "with other arguments than the ranks before it";
        cr_expect_eq(k[r].rc, want_rc, "round %d rank %d: %s: %s", round, r,
                     shardd_err_name(k[r].rc), k[r].msg);
        cr_expect(strstr(k[r].msg, want) != NULL, "round %d rank %d: %s", round, r, k[r].msg);
        cr_expect(memcmp(before[r], ok[r].shard, sizeof before[r]) == 0,
                  "rank %d: a refused step changed the shard", r);
        continue;
      }
      cr_expect_eq(k[r].rc, SHARDD_E_MISMATCH, "round %d rank %d: %s: %s", round, r,
                   shardd_err_name(k[r].rc), k[r].msg);
      const char *want = round == 0 ? (r < 2 ? "node 1 steps optimizer \"sgd\" with lr 0.25, "
                                               "this node with 0.125"
                                             : "node 0 steps optimizer \"sgd\" with lr 0.125, "
                                               "this node with 0.25")
                                    : "other per-group hyperparameters";
      cr_expect(strstr(k[r].msg, want) != NULL, "round %d rank %d: %s", round, r, k[r].msg);
      cr_expect(memcmp(before[r], ok[r].shard, sizeof before[r]) == 0,
                "rank %d: a refused step changed the shard", r);
    }
  }
  for (int r = 0; r < W; r++) /* the agreed step: 0.125 * the mean gradient 2.5 */
    cr_expect_eq(((float *)ok[r].shard)[0], before[r][0] - 0.3125f, "rank %d", r);
  shardd_client_t *ctl = test_connect(&pair[0], NULL, 0, 0);
  char *text = NULL;
  cr_assert_eq(shardd_status_text(ctl, &text), SHARDD_OK);
  cr_expect(strstr(text, "node 1: ranks 2..3 up") != NULL, "%s", text);
  shardd_free(text);
  shardd_close(ctl);
  for (int r = 0; r < W; r++)
    shardd_close(c[r]);
  test_daemon_finish(&pair[0]);
  test_daemon_finish(&pair[1]);
  scratch_remove(&s);
}

/* ---- the fabric itself, three nodes on threads of this process ---------- */

#define FNODES 3
/* more floats per node than one 4 MiB segment of the ring, not a multiple */
#define FCOUNT (((size_t)1 << 20) + ((size_t)1 << 18) + 7)

typedef struct {
  const char *rdv;
  uint32_t node;
  int incarnation;
  float *buf[2]; /* [FNODES * FCOUNT] each: two reduce-scatters at once */
  shardd__fabric *f;
  shardd_err rc;
  char msg[512];
  pthread_t th;
} fnode;

static float fval(uint32_t node, size_t i) {
  return (float)((node + 1) * (uint32_t)(i % 1000));
}

typedef struct {
  fnode *n;
  int which;
  shardd_err rc;
  char msg[512];
} fop;

static void *fop_main(void *p) {
  fop *o = p;
  o->rc = shardd__fabric_reduce_scatter_f32(o->n->f, o->n->buf[o->which], FCOUNT,
                                            100u + (uint32_t)o->which, o->msg, sizeof o->msg);
  return NULL;
}

static void *fnode_main(void *p) {
  fnode *n = p;
  shardd__fabric_opts o = SHARDD__FABRIC_OPTS_INIT;
  o.rendezvous = n->rdv;
  o.prefix = "direct";
  o.nodes = FNODES;
  o.node_rank = n->node;
  o.timeout_s = 20;
  n->rc = shardd__fabric_create(&o, &n->f, n->msg, sizeof n->msg);
  if (n->rc != SHARDD_OK)
    return NULL;
  /* allgather: every node's slice lands everywhere */
  uint64_t g[FNODES] = {0};
  g[n->node] = 1000u + n->node + 10u * (uint32_t)n->incarnation;
  n->rc = shardd__fabric_allgather(n->f, g, sizeof g[0], 7, n->msg, sizeof n->msg);
  for (uint32_t k = 0; k < FNODES && n->rc == SHARDD_OK; k++)
    if (g[k] != 1000u + k + 10u * (uint32_t)n->incarnation) {
      n->rc = SHARDD_E_INTERNAL;
      snprintf(n->msg, sizeof n->msg, "allgather[%u] = %llu", k, (unsigned long long)g[k]);
    }
  if (n->rc == SHARDD_OK && n->incarnation == 0) {
    /* two reduce-scatters at once, on two tags, from two threads */
    for (int b = 0; b < 2; b++)
      for (size_t i = 0; i < FNODES * FCOUNT; i++)
        n->buf[b][i] = fval(n->node, i) * (float)(b + 1);
    fop ops[2] = {{n, 0, SHARDD_OK, ""}, {n, 1, SHARDD_OK, ""}};
    pthread_t th;
    pthread_create(&th, NULL, fop_main, &ops[1]);
    fop_main(&ops[0]);
    pthread_join(th, NULL);
    for (int b = 0; b < 2 && n->rc == SHARDD_OK; b++) {
      if (ops[b].rc != SHARDD_OK) {
        n->rc = ops[b].rc;
        snprintf(n->msg, sizeof n->msg, "%s", ops[b].msg);
        break;
      }
      /* exact: small integers, and 1 + 2 + 3 = 6 */
      const float *mine = n->buf[b] + (size_t)n->node * FCOUNT;
      for (size_t i = 0; i < FCOUNT; i++) {
        size_t gi = (size_t)n->node * FCOUNT + i;
        float want = 6.0f * (float)(gi % 1000) * (float)(b + 1);
        if (mine[i] != want) {
          n->rc = SHARDD_E_INTERNAL;
          snprintf(n->msg, sizeof n->msg, "reduce-scatter %d [%zu] = %g, want %g", b, i,
                   mine[i], want);
          break;
        }
      }
    }
  }
  shardd__fabric_destroy(n->f);
  n->f = NULL;
  return NULL;
}

/* torch's skip semantics across nodes: each node's flags of which views had
 * a gradient cross the fabric. "a" [0,4) gets one only from rank 2 (node
 * 1), "b" [4,8) from no rank: the step moves a (SGD, the sum of the one
 * gradient) and leaves b bit-identical, on both nodes' shards. */
Test(fabric, views_without_a_gradient_on_any_node_are_skipped, .timeout = 60) {
  need_gloo();
  scratch s;
  scratch_make(&s);
  test_daemon pair[2];
  const char *jobs[] = {"skip"};
  start_pair(pair, &s, jobs, 1, "10");
  shardd_client_t *c[W];
  shardd_buffer_info b[W];
  uint64_t bid[W], va[W], vb[W], opt[W];
  int64_t shape[1] = {4};
  for (int r = 0; r < W; r++) {
    c[r] = test_connect(&pair[r / 2], "skip", (uint32_t)r, W);
    cr_assert_eq(shardd_buffer_register(c[r], "w", SHARDD_DTYPE_FP32, 8, &b[r]), SHARDD_OK,
                 "%s", shardd_last_error(c[r]));
    cr_assert_eq(shardd_view_register(c[r], b[r].id, "a", 0, 4, shape, 1, &va[r]), SHARDD_OK);
    cr_assert_eq(shardd_view_register(c[r], b[r].id, "b", 4, 4, shape, 1, &vb[r]), SHARDD_OK);
    shardd_param_ref refs[2] = {{va[r], "a"}, {vb[r], "b"}};
    shardd_param_group g = {refs, 2, {0}};
    shardd_hparams hp = {0};
    hp.set = SHARDD_HP_LR;
    hp.lr = 0.5;
    cr_assert_eq(shardd_optimizer_register(c[r], "sgd", SHARDD_OPTIM_SGD, &hp, &g, 1, &opt[r]),
                 SHARDD_OK, "%s", shardd_last_error(c[r]));
    for (size_t j = 0; j < b[r].shard_numel; j++)
      ((float *)b[r].shard)[j] = 10.0f;
    for (size_t j = 0; j < b[r].padded_numel; j++) /* zeros where .grad is None */
      ((float *)b[r].grad)[j] = r == 2 && j < 4 ? 2.0f : 0.0f;
    bid[r] = b[r].id;
  }
  call k[W];
  memset(k, 0, sizeof k);
  uint64_t none[W][2];
  for (int r = 0; r < W; r++) {
    none[r][0] = vb[r];
    none[r][1] = va[r];
    k[r] = (call){.c = c[r], .kind = OP_SCATTER, .id = bid[r], .sum = 1,
                  .no_grad = none[r], .nno_grad = r == 2 ? 1 : 2};
    cr_assert_eq(pthread_create(&k[r].th, NULL, call_main, &k[r]), 0);
  }
  for (int r = 0; r < W; r++)
    pthread_join(k[r].th, NULL);
  for (int r = 0; r < W; r++)
    cr_assert_eq(k[r].rc, SHARDD_OK, "rank %d: %s", r, k[r].msg);
  for (int r = 0; r < W; r++)
    for (size_t j = 0; j < 2; j++)
      cr_expect_eq(((float *)b[r].reduced)[j], r < 2 ? 2.0f : 0.0f, "rank %d reduced[%zu]",
                   r, j);
  for (int r = 1; r < W; r++) /* both nodes registered alike: the same ids */
    cr_assert_eq(opt[r], opt[0]);
  all_ranks(c, OP_STEP, opt[0], 0, NULL);
  /* shards of 2: ranks 0-1 hold a, ranks 2-3 hold b */
  for (int r = 0; r < W; r++)
    for (size_t j = 0; j < 2; j++) {
      float got = ((float *)b[r].shard)[j];
      float want = r < 2 ? 10.0f - 0.5f * 2.0f : 10.0f;
      cr_expect_eq(got, want, "rank %d shard[%zu] = %g, want %g (%s)", r, j, got, want,
                   r < 2 ? "a: rank 2's gradient" : "b: no gradient anywhere");
    }
  for (int n = 0; n < 2; n++) {
    char *js = NULL;
    cr_assert_eq(shardd_inspect_json(c[2 * n], vb[2 * n], NULL, &js), SHARDD_OK);
    cr_expect(strstr(js, "\"steps\":0") != NULL, "node %d: b took no step: %s", n, js);
    shardd_free(js);
  }
  for (int r = 0; r < W; r++)
    shardd_close(c[r]);
  test_daemon_finish(&pair[0]);
  test_daemon_finish(&pair[1]);
  scratch_remove(&s);
}

/* Three nodes: an allgather and two concurrent ring reduce-scatters of
 * more than one segment, exact; then the same job meets again in the same
 * rendezvous directory, which holds the first meeting's files, and must
 * connect as well. */
Test(fabric, three_nodes_ring_reduce_scatter_and_second_incarnation, .timeout = 60) {
  need_gloo();
  scratch s;
  scratch_make(&s);
  fnode n[FNODES];
  memset(n, 0, sizeof n);
  for (int inc = 0; inc < 2; inc++) {
    double t0 = test_mono_s();
    for (uint32_t k = 0; k < FNODES; k++) {
      n[k].rdv = s.rdv;
      n[k].node = k;
      n[k].incarnation = inc;
      for (int b = 0; b < 2 && inc == 0; b++)
        cr_assert_not_null(n[k].buf[b] = malloc(FNODES * FCOUNT * sizeof(float)));
      cr_assert_eq(pthread_create(&n[k].th, NULL, fnode_main, &n[k]), 0);
    }
    for (uint32_t k = 0; k < FNODES; k++)
      pthread_join(n[k].th, NULL);
    for (uint32_t k = 0; k < FNODES; k++)
      cr_assert_eq(n[k].rc, SHARDD_OK, "incarnation %d node %u: %s: %s", inc, k,
                   shardd_err_name(n[k].rc), n[k].msg);
    cr_log_info("fabric: 3 nodes, incarnation %d: %.3f s", inc + 1, test_mono_s() - t0);
  }
  for (uint32_t k = 0; k < FNODES; k++)
    for (int b = 0; b < 2; b++)
      free(n[k].buf[b]);
  scratch_remove(&s);
}

/* ---- aborting the fabric (issue 21: a stopping daemon) ------------------- */

typedef struct {
  const char *rdv;
  uint32_t node;
  shardd__fabric *f;
  shardd_err rc;
  char msg[512];
  pthread_t th;
} anode;

static void *anode_create(void *p) {
  anode *a = p;
  shardd__fabric_opts o = SHARDD__FABRIC_OPTS_INIT;
  o.rendezvous = a->rdv;
  o.prefix = "abort";
  o.nodes = 2;
  o.node_rank = a->node;
  o.timeout_s = 30;
  a->rc = shardd__fabric_create(&o, &a->f, a->msg, sizeof a->msg);
  return NULL;
}

static void *anode_wait(void *p) { /* each node's tag: the other never joins */
  anode *a = p;
  float g[2 * 1000] = {0};
  a->rc = shardd__fabric_allgather(a->f, g, 1000 * sizeof(float), 11 + a->node, a->msg,
                                   sizeof a->msg);
  return NULL;
}

/* Node 0 waits in an allgather its peer never makes; the abort ends it
 * with E_SHUTDOWN and the reason, far inside the 30 s timeout, and every
 * later operation (allgather, reduce-scatter) fails at once alike. The
 * peer, waiting in an operation of its own, gets E_PEER_LOST when node 0's
 * fabric is destroyed. */
Test(fabric, abort_ends_waiting_operations_at_once, .timeout = 60) {
  need_gloo();
  scratch s;
  scratch_make(&s);
  anode a[2];
  memset(a, 0, sizeof a);
  for (uint32_t k = 0; k < 2; k++) {
    a[k].rdv = s.rdv;
    a[k].node = k;
    cr_assert_eq(pthread_create(&a[k].th, NULL, anode_create, &a[k]), 0);
  }
  for (uint32_t k = 0; k < 2; k++) {
    pthread_join(a[k].th, NULL);
    cr_assert_eq(a[k].rc, SHARDD_OK, "node %u: %s", k, a[k].msg);
  }
  /* node 1 waits too, on another tag, so it has an operation to fail */
  for (uint32_t k = 0; k < 2; k++)
    cr_assert_eq(pthread_create(&a[k].th, NULL, anode_wait, &a[k]), 0);
  test_sleep_ms(200); /* inside its wait, most likely; either way it must end */
  double t0 = test_mono_s();
  shardd__fabric_abort(a[0].f, "daemon stopping (test)");
  shardd__fabric_abort(a[0].f, "a second abort changes nothing");
  pthread_join(a[0].th, NULL);
  double took = test_mono_s() - t0;
  cr_expect_eq(a[0].rc, SHARDD_E_SHUTDOWN, "%s: %s", shardd_err_name(a[0].rc), a[0].msg);
  cr_expect_str_eq(a[0].msg, "fabric allgather: daemon stopping (test)");
  cr_expect_lt(took, 10.0, "the aborted wait took %.1f s", took);
  cr_log_info("fabric: an aborted allgather returned %.6f s after the abort", took);

  char msg[256];
  float buf[4] = {0};
  cr_expect_eq(shardd__fabric_allgather(a[0].f, buf, sizeof(float), 12, msg, sizeof msg),
               SHARDD_E_SHUTDOWN, "%s", msg);
  cr_expect_eq(shardd__fabric_reduce_scatter_f32(a[0].f, buf, 2, 13, msg, sizeof msg),
               SHARDD_E_SHUTDOWN, "%s", msg);
  cr_expect_str_eq(msg, "fabric reduce-scatter: daemon stopping (test)");

  t0 = test_mono_s();
  shardd__fabric_destroy(a[0].f);
  pthread_join(a[1].th, NULL);
  cr_expect_eq(a[1].rc, SHARDD_E_PEER_LOST, "%s: %s", shardd_err_name(a[1].rc), a[1].msg);
  cr_expect_lt(test_mono_s() - t0, 10.0);
  cr_log_info("fabric: the peer heard: %s", a[1].msg);
  shardd__fabric_destroy(a[1].f);
  scratch_remove(&s);
}

/* SIGTERM while the rendezvous waits for a node that never comes: the
 * daemon stops at once (not at the 30 s timeout) and its ranks hear why. */
Test(fabric, sigterm_during_the_rendezvous_exits_at_once, .timeout = 60) {
  need_gloo();
  scratch s;
  scratch_make(&s);
  char spec[256];
  write_spec(&s, "alone", 0, spec, sizeof spec);
  const char *args[] = {"--backend", "host", "--devices", "2", "--collective-timeout",
                        "30", "--job-spec", spec, NULL};
  test_daemon d;
  test_daemon_start(&d, args);
  shardd_client_t *c[2];
  shardd_buffer_info info[2];
  for (int r = 0; r < 2; r++) {
    c[r] = test_connect(&d, "alone", (uint32_t)r, W);
    cr_assert_eq(shardd_buffer_register(c[r], "w", SHARDD_DTYPE_FP32, 100, &info[r]), SHARDD_OK);
  }
  call calls[2];
  memset(calls, 0, sizeof calls);
  for (int r = 0; r < 2; r++) {
    calls[r].c = c[r];
    calls[r].kind = OP_GATHER;
    calls[r].id = info[0].id;
    cr_assert_eq(pthread_create(&calls[r].th, NULL, call_main, &calls[r]), 0);
  }
  for (double end = test_mono_s() + TEST_HANG_S; !announced(s.rdv, 0);) {
    cr_assert_lt(test_mono_s(), end, "node 0 never began the rendezvous in %s", s.rdv);
    test_sleep_ms(10);
  }
  double t0 = test_mono_s();
  kill(d.pid, SIGTERM);
  int status = -1;
  cr_assert(test_wait_exit(d.pid, &status), "no exit within %.0f s", TEST_HANG_S);
  double took = test_mono_s() - t0;
  d.pid = 0;
  cr_expect(WIFEXITED(status) && WEXITSTATUS(status) == 0, "exit status %d", status);
  cr_expect_lt(took, 15.0, "stopped after %.1f s", took);
  cr_log_info("fabric: stopped %.3f s after SIGTERM during the rendezvous", took);
  for (int r = 0; r < 2; r++) {
    pthread_join(calls[r].th, NULL);
    cr_expect_eq(calls[r].rc, SHARDD_E_SHUTDOWN, "rank %d: %s: %s", r,
                 shardd_err_name(calls[r].rc), calls[r].msg);
    cr_expect(strstr(calls[r].msg, "daemon stopping (SIGTERM)") != NULL, "rank %d: %s", r,
              calls[r].msg);
    shardd_close(c[r]);
  }
  test_daemon_stop(&d);
  scratch_remove(&s);
}

/* ---- the rendezvous directory is the daemon's alone ----------------------- */

/* fabric_gloo.cc's name for a job's files: shardd-PREFIX-FNV32 (prefix
 * plain here). */
static void rdv_base(const char *prefix, char *out, size_t len) {
  uint64_t h = 14695981039346656037ull;
  for (const unsigned char *p = (const unsigned char *)prefix; *p; p++) {
    h ^= *p;
    h *= 1099511628211ull;
  }
  snprintf(out, len, "shardd-%s-%08x", prefix, (unsigned)(h & 0xffffffffu));
}

/* Uid 1001 plants, in rdv, a symlink to target at node 0's announcement
 * (and at its temporary name for pid) and a directory at node 1's. */
static int plant(const char *rdv, const char *target, pid_t pid) {
  if (setgid(1001) != 0 || setuid(1001) != 0)
    return 10;
  char base[64], path[512];
  rdv_base("job", base, sizeof base);
  snprintf(path, sizeof path, "%s/%s.node0.tmp%d", rdv, base, (int)pid);
  if (symlink(target, path) != 0)
    return 11;
  snprintf(path, sizeof path, "%s/%s.node0", rdv, base);
  if (symlink(target, path) != 0)
    return 12;
  snprintf(path, sizeof path, "%s/%s.node1", rdv, base);
  return mkdir(path, 0755) == 0 ? 0 : 13;
}

static shardd_err node0_create(const char *rdv, shardd__fabric **f, char *msg,
                               size_t len) {
  shardd__fabric_opts o = SHARDD__FABRIC_OPTS_INIT;
  o.rendezvous = rdv;
  o.prefix = "job";
  o.nodes = 2;
  o.node_rank = 0;
  o.timeout_s = 1;
  *f = NULL;
  return shardd__fabric_create(&o, f, msg, len);
}

/* The daemon (root) writes and reads files in the rendezvous directory. In
 * one uid 1001 may write (world-writable, sticky or not), uid 1001 planted
 * a symlink where the daemon writes node 0's announcement, and the daemon
 * truncated and overwrote the root-owned file it named; a directory it
 * planted at node 1's blocked the rendezvous. Such a directory -- or one
 * another uid owns, or a symlink to a good one -- is refused now before
 * any file is touched, naming it; the daemon's own directory (mode 0700)
 * still forms the fabric, and leaves no key file behind. */
Test(fabric, a_rendezvous_directory_another_uid_can_write_is_refused, .timeout = 60) {
  need_gloo();
  if (geteuid() != 0)
    cr_skip_test("needs root to stand for the daemon and another uid");
  scratch s;
  scratch_make(&s);
  cr_assert_eq(chmod(s.dir, 0755), 0);
  char precious[128], msg[512];
  snprintf(precious, sizeof precious, "%s/precious", s.dir);
  FILE *pf = fopen(precious, "w");
  cr_assert_not_null(pf);
  fputs("root's own\n", pf);
  fclose(pf);
  const mode_t modes[] = {0777, 01777};
  for (size_t m = 0; m < 2; m++) {
    char cmd[320];
    snprintf(cmd, sizeof cmd, "rm -rf '%s' && mkdir '%s'", s.rdv, s.rdv);
    cr_assert_eq(system(cmd), 0);
    cr_assert_eq(chmod(s.rdv, modes[m]), 0);
    pid_t me = getpid(), pid = fork();
    cr_assert(pid >= 0);
    if (pid == 0)
      _exit(plant(s.rdv, precious, me));
    int st;
    cr_assert(test_wait_exit(pid, &st));
    cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == 0, "planting failed: %d",
              WIFEXITED(st) ? WEXITSTATUS(st) : -1);
    shardd__fabric *f;
    shardd_err rc = node0_create(s.rdv, &f, msg, sizeof msg);
    if (f)
      shardd__fabric_destroy(f);
    char *text = test_slurp(precious);
    cr_assert_not_null(text);
    cr_expect_str_eq(text, "root's own\n", "mode %04o: the planted symlink was followed",
                     (unsigned)modes[m]);
    free(text);
    cr_assert_eq(rc, SHARDD_E_PERMISSION, "mode %04o: %s: %s", (unsigned)modes[m],
                 shardd_err_name(rc), msg);
    cr_assert(strstr(msg, s.rdv) && strstr(msg, "group or others") &&
                  strstr(msg, "refused"),
              "%s", msg);
  }
  cr_log_info("fabric: a world-writable rendezvous directory: %s", msg);
  char cmd[320];
  snprintf(cmd, sizeof cmd, "rm -rf '%s' && mkdir -m 0755 '%s'", s.rdv, s.rdv);
  cr_assert_eq(system(cmd), 0);
  shardd__fabric *f;
  cr_assert_eq(chown(s.rdv, 1001, 1001), 0); /* another uid's, not writable by us all */
  cr_assert_eq(node0_create(s.rdv, &f, msg, sizeof msg), SHARDD_E_PERMISSION, "%s", msg);
  cr_assert(strstr(msg, "its owner"), "%s", msg);
  cr_assert_eq(chown(s.rdv, 0, 0), 0);
  char link[160];
  snprintf(link, sizeof link, "%s/via", s.dir);
  cr_assert_eq(symlink(s.rdv, link), 0);
  cr_assert_eq(node0_create(link, &f, msg, sizeof msg), SHARDD_E_PERMISSION, "%s", msg);
  cr_assert(strstr(msg, "symlink"), "%s", msg);

  /* the daemon's own directory: two nodes meet, and take their keys away */
  cr_assert_eq(chmod(s.rdv, 0700), 0);
  anode a[2];
  memset(a, 0, sizeof a);
  for (uint32_t k = 0; k < 2; k++) {
    a[k].rdv = s.rdv;
    a[k].node = k;
    cr_assert_eq(pthread_create(&a[k].th, NULL, anode_create, &a[k]), 0);
  }
  for (uint32_t k = 0; k < 2; k++) {
    pthread_join(a[k].th, NULL);
    cr_assert_eq(a[k].rc, SHARDD_OK, "node %u: %s", k, a[k].msg);
  }
  for (uint32_t k = 0; k < 2; k++)
    shardd__fabric_destroy(a[k].f);
  DIR *d = opendir(s.rdv);
  cr_assert_not_null(d);
  int files = 0;
  for (struct dirent *e; (e = readdir(d)) != NULL;) {
    if (e->d_name[0] == '.')
      continue;
    files++;
    cr_expect(strncmp(e->d_name, "shardd-kv-", 10) != 0, "left behind: %s", e->d_name);
  }
  closedir(d);
  cr_expect_eq(files, 4, "the two nodes' announcements and .seen files");
  scratch_remove(&s);
}

/* ---- collective checkpoints of a multi-node job -------------------------- */

#define CK_AT 3 /* the checkpoint is taken after this step */
#define CK_N 6  /* steps in all */

typedef struct {
  shardd_client_t *c[W];
  shardd_buffer_info info[2][W];
  uint64_t opt;
  uint64_t opt_of[2]; /* each node's id of it (rj_attach) */
} ck_job;

/* Connects the ranks of job to the pair (ranks 0-1 node 0, 2-3 node 1) and
 * registers train()'s buffers and AdamW; fresh: each rank writes its shard
 * of the initial values (a restored job keeps the restored ones). */
static void ck_attach(const test_daemon *d, const char *job, int fresh, ck_job *j) {
  memset(j, 0, sizeof *j);
  const uint64_t numel[2] = {N_BIG, N_SMALL};
  const char *names[2] = {"big", "small"};
  for (int r = 0; r < W; r++)
    j->c[r] = test_connect(&d[r / 2], job, (uint32_t)r, W);
  for (int b = 0; b < 2; b++)
    for (int r = 0; r < W; r++) {
      shardd_buffer_info *in = &j->info[b][r];
      cr_assert_eq(shardd_buffer_register(j->c[r], names[b], SHARDD_DTYPE_FP32,
                                          numel[b], in),
                   SHARDD_OK, "rank %d: register %s: %s", r, names[b],
                   shardd_last_error(j->c[r]));
      for (size_t k = 0; fresh && k < in->shard_numel; k++) {
        size_t g = (size_t)r * in->shard_numel + k;
        ((float *)in->shard)[k] = g < numel[b] ? init_param(b, g) : 0.0f;
      }
    }
  shardd_hparams hp = {0};
  hp.set = SHARDD_HP_LR | SHARDD_HP_WEIGHT_DECAY;
  hp.lr = 0.01;
  hp.weight_decay = 0.05;
  shardd_param_ref refs[2] = {{j->info[0][0].id, "big"}, {j->info[1][0].id, "small"}};
  shardd_param_group g = {refs, 2, {0}};
  for (int r = 0; r < W; r++) {
    uint64_t id;
    cr_assert_eq(shardd_optimizer_register(j->c[r], "adamw", SHARDD_OPTIM_ADAMW, &hp,
                                           &g, 1, &id),
                 SHARDD_OK, "rank %d: optimizer: %s", r, shardd_last_error(j->c[r]));
    j->opt = id;
  }
}

/* Steps from..to of train()'s recipe (clipping every other step); each
 * step's count must be the loop's: a restore brought the count back. */
static void ck_steps(ck_job *j, int from, int to) {
  const uint64_t numel[2] = {N_BIG, N_SMALL};
  for (int step = from; step <= to; step++) {
    for (int b = 0; b < 2; b++) {
      for (int r = 0; r < W; r++) {
        float *gr = j->info[b][r].grad;
        for (size_t k = 0; k < j->info[b][r].padded_numel; k++)
          gr[k] = k < numel[b] ? grad_of(b, step, r, k) : 0.0f;
      }
      all_ranks(j->c, OP_SCATTER, j->info[b][0].id, 0, NULL);
    }
    shardd_step_result res[W];
    all_ranks(j->c, OP_STEP, j->opt, step % 2 ? 10.0 : 0.0, res);
    for (int r = 0; r < W; r++)
      cr_assert_eq(res[r].step, (uint64_t)step, "rank %d", r);
  }
}

/* sm.checkpoint(dir) on every rank, each on its own thread. */
static void ck_collective(ck_job *j, const char *dir) {
  call calls[W];
  memset(calls, 0, sizeof calls);
  for (int r = 0; r < W; r++) {
    calls[r].c = j->c[r];
    calls[r].kind = OP_CHECKPOINT;
    calls[r].dir = dir;
    cr_assert_eq(pthread_create(&calls[r].th, NULL, call_main, &calls[r]), 0);
  }
  for (int r = 0; r < W; r++)
    pthread_join(calls[r].th, NULL);
  for (int r = 0; r < W; r++)
    cr_assert_eq(calls[r].rc, SHARDD_OK, "rank %d: checkpoint: %s: %s", r,
                 shardd_err_name(calls[r].rc), calls[r].msg);
}

/* Every rank's gathered copy of both buffers, then the ranks close. */
static void ck_final(ck_job *j, float *out[2][W]) {
  for (int b = 0; b < 2; b++) {
    all_ranks(j->c, OP_GATHER, j->info[b][0].id, 0, NULL);
    for (int r = 0; r < W; r++)
      out[b][r] = copy_floats(j->info[b][r].gather, j->info[b][r].padded_numel);
  }
  for (int r = 0; r < W; r++)
    shardd_close(j->c[r]);
}

static void ck_sh(const char *cmd) { cr_assert_eq(system(cmd), 0, "%s", cmd); }

/* A restored job lingers like one whose clients left: under the pair's
 * --job-linger 0 the daemon's next tick (100 ms) releases it before the
 * relaunched ranks attach whenever they are slower than that (a loaded
 * machine), and they get a fresh job instead. Daemons that restore a job
 * keep it until its ranks come (the last --job-linger given counts). */
#define KEEP_RESTORED "--job-linger", "600"

/* Issue 19 (c) on 2 nodes x 2 ranks: sm.checkpoint every so often while
 * training (step 3, and step 6 into another directory), each node writing
 * its part and the job manifest over both; then fresh daemons --restore
 * the step-3 checkpoint on both nodes, the ranks relaunch from step 4 and
 * end bit for bit where the uninterrupted run ended (the reference is that
 * run, continued past its checkpoint). Refused before anything loads: a
 * node's part missing, the parts swapped, a part restored alone; and nodes
 * that restored different checkpoints fail their first collective with
 * E_MISMATCH naming the other node. */
Test(fabric, collective_checkpoint_of_two_nodes_restores_bit_for_bit, .timeout = 120) {
  need_gloo();
  scratch s;
  scratch_make(&s);
  char cka[160], ckb[160];
  snprintf(cka, sizeof cka, "%s/ck-a", s.dir);
  snprintf(ckb, sizeof ckb, "%s/ck-b", s.dir);
  const char *jobs[] = {"ck"};
  test_daemon pair[2];
  start_pair(pair, &s, jobs, 1, "30");
  ck_job j;
  ck_attach(pair, "ck", 1, &j);
  ck_steps(&j, 1, CK_AT);
  ck_collective(&j, cka);
  ck_steps(&j, CK_AT + 1, CK_N);
  ck_collective(&j, ckb);
  float *ref[2][W];
  ck_final(&j, ref);
  test_daemon_finish(&pair[0]);
  test_daemon_finish(&pair[1]);

  /* the layout: a part per node and the job manifest naming both */
  char path[300];
  for (int n = 0; n < 2; n++) {
    snprintf(path, sizeof path, "%s/node-%d/manifest", cka, n);
    char *part = test_slurp(path);
    cr_assert_not_null(part, "no %s", path);
    /* version 5: a daemon that reads up to 4 refuses a node's part at
     * its header, not at its "node" line */
    cr_expect(strncmp(part, "shardd-checkpoint 5\n", 20) == 0, "%.60s", part);
    free(part);
  }
  snprintf(path, sizeof path, "%s/manifest", cka);
  char *top = test_slurp(path);
  cr_assert_not_null(top, "no %s", path);
  cr_expect(strncmp(top, "shardd-job-checkpoint 1\njob ck 4 ", 33) == 0, "%s", top);
  cr_expect(strstr(top, "\nnodes 2\npart 0 node-0 ") && strstr(top, "\npart 1 node-1 "),
            "%s", top);
  free(top);

  /* fresh daemons restore it at start; the relaunch continues at step 4 */
  const char *rest[] = {KEEP_RESTORED, "--restore", cka, NULL};
  start_pair_each(pair, &s, jobs, 1, "30", rest, rest);
  ck_attach(pair, "ck", 0, &j);
  ck_steps(&j, CK_AT + 1, CK_N);
  float *got[2][W];
  ck_final(&j, got);
  for (int b = 0; b < 2; b++)
    for (int r = 0; r < W; r++) {
      char what[64];
      snprintf(what, sizeof what, "restored buffer %d rank %d", b, r);
      compare(ref[b][r], got[b][r], j.info[b][r].padded_numel, 1, what);
      free(got[b][r]);
    }
  cr_log_info("fabric: 2 nodes x 2 ranks, checkpoint at step %d restored into fresh "
              "daemons, steps %d..%d bit for bit", CK_AT, CK_AT + 1, CK_N);
  test_daemon_finish(&pair[0]);
  test_daemon_finish(&pair[1]);

  /* refusals, before any job exists */
  const char *keep[] = {KEEP_RESTORED, NULL};
  start_pair_each(pair, &s, jobs, 1, "30", keep, keep);
  shardd_client_t *ctl[2] = {test_connect(&pair[0], NULL, 0, 0),
                             test_connect(&pair[1], NULL, 0, 0)};
  char sw[160], miss[160];
  snprintf(sw, sizeof sw, "%s/swapped", s.dir);
  snprintf(miss, sizeof miss, "%s/missing", s.dir);
  char cmd[900];
  snprintf(cmd, sizeof cmd, "cp -a '%s' '%s' && cd '%s' && mv node-0 x && "
           "mv node-1 node-0 && mv x node-1", cka, sw, sw);
  ck_sh(cmd);
  snprintf(cmd, sizeof cmd, "cp -a '%s' '%s' && rm -rf '%s/node-1'", cka, miss, miss);
  ck_sh(cmd);
  cr_expect_eq(shardd_restore(ctl[0], sw, 0, NULL, 0), SHARDD_E_MISMATCH);
  const char *e = shardd_last_error(ctl[0]);
  cr_expect(strstr(e, "node 0's part") && strstr(e, "the job manifest says"), "%s", e);
  cr_log_info("fabric: swapped parts: %s", e);
  cr_expect_eq(shardd_restore(ctl[1], miss, 0, NULL, 0), SHARDD_E_MISMATCH);
  e = shardd_last_error(ctl[1]);
  cr_expect(strstr(e, "node 1's part is missing") != NULL, "%s", e);
  cr_log_info("fabric: a missing part: %s", e);
  snprintf(path, sizeof path, "%s/node-0", cka);
  cr_expect_eq(shardd_restore(ctl[0], path, 0, NULL, 0), SHARDD_E_INVAL);
  e = shardd_last_error(ctl[0]);
  cr_expect(strstr(e, "restore the job checkpoint above it") != NULL, "%s", e);

  /* node 0 restores step 3, node 1 step 6: the first exchange says so */
  char job[64];
  cr_assert_eq(shardd_restore(ctl[0], cka, 0, job, sizeof job), SHARDD_OK, "%s",
               shardd_last_error(ctl[0]));
  cr_assert_eq(shardd_restore(ctl[1], ckb, 0, job, sizeof job), SHARDD_OK, "%s",
               shardd_last_error(ctl[1]));
  ck_attach(pair, "ck", 0, &j);
  call calls[W];
  memset(calls, 0, sizeof calls);
  for (int r = 0; r < W; r++) {
    calls[r].c = j.c[r];
    calls[r].kind = OP_GATHER;
    calls[r].id = j.info[0][r].id;
    cr_assert_eq(pthread_create(&calls[r].th, NULL, call_main, &calls[r]), 0);
  }
  for (int r = 0; r < W; r++)
    pthread_join(calls[r].th, NULL);
  for (int r = 0; r < W; r++) {
    cr_expect_eq(calls[r].rc, SHARDD_E_MISMATCH, "rank %d: %s: %s", r,
                 shardd_err_name(calls[r].rc), calls[r].msg);
    char want[64];
    snprintf(want, sizeof want, "node %d restored job \"ck\" from the checkpoint sealed",
             r < 2 ? 1 : 0);
    cr_expect(strstr(calls[r].msg, want) != NULL, "rank %d: %s", r, calls[r].msg);
  }
  cr_log_info("fabric: different checkpoints on the nodes: %s", calls[0].msg);
  for (int r = 0; r < W; r++)
    shardd_close(j.c[r]);
  shardd_close(ctl[0]);
  shardd_close(ctl[1]);
  for (int b = 0; b < 2; b++)
    for (int r = 0; r < W; r++)
      free(ref[b][r]);
  test_daemon_finish(&pair[0]);
  test_daemon_finish(&pair[1]);
  scratch_remove(&s);
}

/* Each rank's sm.checkpoint into dirs[rank / 2] (node 0's, node 1's),
 * on threads; the calls' results in k. */
static void ck_collective_into(ck_job *j, const char *const dirs[2], call k[W]) {
  memset(k, 0, W * sizeof *k);
  for (int r = 0; r < W; r++) {
    k[r].c = j->c[r];
    k[r].kind = OP_CHECKPOINT;
    k[r].dir = dirs[r / 2];
    cr_assert_eq(pthread_create(&k[r].th, NULL, call_main, &k[r]), 0);
  }
  for (int r = 0; r < W; r++)
    pthread_join(k[r].th, NULL);
}

/* A collective checkpoint of a multi-node job that cannot be whole writes
 * no job manifest, every rank hears which node is at fault, and the job
 * trains and checkpoints on: the nodes' ranks naming two directories
 * (compared across nodes by the barrier), and node 1 unable to write its
 * part (DIR/node-1 is a file). */
Test(fabric, collective_checkpoint_that_cannot_be_whole_names_the_node, .timeout = 120) {
  need_gloo();
  scratch s;
  scratch_make(&s);
  const char *jobs[] = {"ckf"};
  test_daemon pair[2];
  start_pair(pair, &s, jobs, 1, "30");
  ck_job j;
  ck_attach(pair, "ckf", 1, &j);
  ck_steps(&j, 1, 1);

  char da[160], db[160], path[300];
  snprintf(da, sizeof da, "%s/a", s.dir);
  snprintf(db, sizeof db, "%s/b", s.dir);
  call k[W];
  ck_collective_into(&j, (const char *const[]){da, db}, k);
  for (int r = 0; r < W; r++) {
    cr_expect_eq(k[r].rc, SHARDD_E_MISMATCH, "rank %d: %s: %s", r,
                 shardd_err_name(k[r].rc), k[r].msg);
    char want[64];
    snprintf(want, sizeof want, "the ranks of node %d of job \"ckf\"", r < 2 ? 1 : 0);
    cr_expect(strstr(k[r].msg, want) != NULL, "rank %d: %s", r, k[r].msg);
  }
  cr_log_info("fabric: two directories: %s", k[0].msg);
  snprintf(path, sizeof path, "%s/manifest", da);
  cr_expect_neq(access(path, F_OK), 0, "%s written", path);
  snprintf(path, sizeof path, "%s/manifest", db);
  cr_expect_neq(access(path, F_OK), 0, "%s written", path);

  char dc[160];
  snprintf(dc, sizeof dc, "%s/c", s.dir);
  cr_assert_eq(mkdir(dc, 0700), 0);
  snprintf(path, sizeof path, "%s/node-1", dc);
  FILE *f = fopen(path, "w"); /* node 1's part cannot be a directory */
  cr_assert_not_null(f);
  fclose(f);
  ck_collective_into(&j, (const char *const[]){dc, dc}, k);
  for (int r = 0; r < W; r++)
    cr_expect_neq(k[r].rc, SHARDD_OK, "rank %d", r);
  for (int r = 0; r < 2; r++) {
    cr_expect_eq(k[r].rc, SHARDD_E_IO, "rank %d: %s", r, shardd_err_name(k[r].rc));
    cr_expect(strstr(k[r].msg, "node 1 could not write its part") != NULL, "rank %d: %s",
              r, k[r].msg);
  }
  for (int r = 2; r < W; r++)
    cr_expect(strstr(k[r].msg, "node 1's part of the checkpoint") != NULL, "rank %d: %s",
              r, k[r].msg);
  cr_log_info("fabric: node 1 cannot write: node 0 hears: %s", k[0].msg);
  cr_log_info("fabric: node 1 cannot write: node 1 hears: %s", k[2].msg);
  snprintf(path, sizeof path, "%s/manifest", dc);
  cr_expect_neq(access(path, F_OK), 0, "%s written", path);

  /* an operator's checkpoint on one node cannot vouch for the other's */
  shardd_client_t *ctl = test_connect(&pair[0], NULL, 0, 0);
  cr_expect_eq(shardd_checkpoint(ctl, "ckf", da), SHARDD_E_STATE);
  cr_expect(strstr(shardd_last_error(ctl), "checkpointed collectively") != NULL, "%s",
            shardd_last_error(ctl));
  shardd_close(ctl);

  /* the job goes on: a step, then a whole checkpoint */
  ck_steps(&j, 2, 2);
  ck_collective_into(&j, (const char *const[]){da, da}, k);
  for (int r = 0; r < W; r++)
    cr_expect_eq(k[r].rc, SHARDD_OK, "rank %d: %s: %s", r, shardd_err_name(k[r].rc),
                 k[r].msg);
  snprintf(path, sizeof path, "%s/manifest", da);
  cr_expect_eq(access(path, R_OK), 0, "no %s", path);
  for (int r = 0; r < W; r++)
    shardd_close(j.c[r]);
  test_daemon_finish(&pair[0]);
  test_daemon_finish(&pair[1]);
  scratch_remove(&s);
}

/* ---- a node's daemon restarted mid-job (issue 21 item 2) ---------------- */

#define RJ_AT 3 /* node 1's daemon stops after this step */
#define RJ_N 6  /* steps in all */

/* Starts node n's daemon of the 2-node layout of job (its spec written
 * again, the same as start_pair_each's), with extra arguments. */
static void start_node(test_daemon *d, const scratch *s, const char *job, int n,
                       const char *timeout, const char *const *extra) {
  static char spec[2][256];
  const char *args[20];
  int k = 0;
  write_spec(s, job, n, spec[n], sizeof spec[n]);
  const char *base[] = {"--backend", "host", "--devices", "2", "--collective-timeout",
                        timeout, "--job-linger", "0", "--job-spec", spec[n]};
  for (size_t i = 0; i < sizeof base / sizeof *base; i++)
    args[k++] = base[i];
  for (const char *const *x = extra; x && *x && k < 19; x++)
    args[k++] = *x;
  args[k] = NULL;
  test_daemon_start(d, args);
}

/* ck_attach for the ranks of one node only (node 0: ranks 0-1, node 1:
 * 2-3), as a relaunch of that node's trainers does: their buffers and
 * optimizer by name (a restored job keeps its values). */
static void rj_attach(const test_daemon *d, const char *job, int fresh, ck_job *j,
                      int node) {
  const uint64_t numel[2] = {N_BIG, N_SMALL};
  const char *names[2] = {"big", "small"};
  int lo = node * 2, hi = lo + 2;
  for (int r = lo; r < hi; r++)
    j->c[r] = test_connect(&d[node], job, (uint32_t)r, W);
  for (int b = 0; b < 2; b++)
    for (int r = lo; r < hi; r++) {
      shardd_buffer_info *in = &j->info[b][r];
      cr_assert_eq(shardd_buffer_register(j->c[r], names[b], SHARDD_DTYPE_FP32,
                                          numel[b], in),
                   SHARDD_OK, "rank %d: register %s: %s", r, names[b],
                   shardd_last_error(j->c[r]));
      for (size_t k = 0; fresh && k < in->shard_numel; k++) {
        size_t g = (size_t)r * in->shard_numel + k;
        ((float *)in->shard)[k] = g < numel[b] ? init_param(b, g) : 0.0f;
      }
    }
  shardd_hparams hp = {0};
  hp.set = SHARDD_HP_LR | SHARDD_HP_WEIGHT_DECAY;
  hp.lr = 0.01;
  hp.weight_decay = 0.05;
  shardd_param_ref refs[2] = {{j->info[0][lo].id, "big"}, {j->info[1][lo].id, "small"}};
  shardd_param_group g = {refs, 2, {0}};
  for (int r = lo; r < hi; r++)
    cr_assert_eq(shardd_optimizer_register(j->c[r], "adamw", SHARDD_OPTIM_ADAMW, &hp,
                                           &g, 1, &j->opt_of[node]),
                 SHARDD_OK, "rank %d: optimizer: %s", r, shardd_last_error(j->c[r]));
}

/* One rank's steps from..to of ck_steps' recipe, on its own thread. An
 * iteration whose collective fails with E_PEER_LOST (the other node's
 * daemon went away) is retried whole, as a trainer does after sm.reset():
 * the retry re-forms the fabric once that node is back. Anything else
 * ends the run with rc and msg. */
typedef struct {
  ck_job *j;
  int rank, from, to;
  int retries, max_retries;
  double lost_at; /* test_mono_s() of the first E_PEER_LOST, 0 none */
  shardd_err rc;
  char msg[1024];
  pthread_t th;
} rj_rank;

static void *rj_rank_main(void *p) {
  rj_rank *k = p;
  ck_job *j = k->j;
  int r = k->rank;
  const uint64_t numel[2] = {N_BIG, N_SMALL};
  double end = test_mono_s() + 60;
  for (int step = k->from; step <= k->to; step++) {
    for (;;) {
      shardd_err rc = SHARDD_OK;
      for (int b = 0; b < 2 && rc == SHARDD_OK; b++) {
        float *gr = j->info[b][r].grad;
        for (size_t i = 0; i < j->info[b][r].padded_numel; i++)
          gr[i] = i < numel[b] ? grad_of(b, step, r, i) : 0.0f;
        shardd_scatter_opts o = SHARDD_SCATTER_OPTS_INIT;
        o.op = SHARDD_REDUCE_MEAN; /* as ck_steps */
        rc = shardd_scatter_ex(j->c[r], j->info[b][r].id, &o);
      }
      shardd_step_result res = {0};
      if (rc == SHARDD_OK) {
        shardd_step_opts so = SHARDD_STEP_OPTS_INIT;
        so.max_norm = step % 2 ? 10.0 : 0.0;
        so.expect_step = (uint64_t)step;
        rc = shardd_step(j->c[r], j->opt_of[r / 2], &so, &res);
      }
      if (rc == SHARDD_OK && res.step != (uint64_t)step) {
        k->rc = SHARDD_E_INTERNAL;
        snprintf(k->msg, sizeof k->msg, "step %d came back as %" PRIu64, step, res.step);
        return NULL;
      }
      if (rc == SHARDD_OK)
        break;
      snprintf(k->msg, sizeof k->msg, "step %d: %s", step, shardd_last_error(j->c[r]));
      if (rc != SHARDD_E_PEER_LOST || k->retries >= k->max_retries ||
          test_mono_s() > end) {
        k->rc = rc;
        return NULL;
      }
      if (k->lost_at == 0)
        k->lost_at = test_mono_s();
      k->retries++;
      test_sleep_ms(10);
    }
  }
  k->rc = SHARDD_OK;
  return NULL;
}

static void rj_start_n(rj_rank *k, ck_job *j, int rank, int from, int to,
                       int max_retries) {
  memset(k, 0, sizeof *k);
  k->max_retries = max_retries;
  k->j = j;
  k->rank = rank;
  k->from = from;
  k->to = to;
  cr_assert_eq(pthread_create(&k->th, NULL, rj_rank_main, k), 0);
}

static void rj_start(rj_rank *k, ck_job *j, int rank, int from, int to) {
  rj_start_n(k, j, rank, from, to, 1000);
}

/* Waits until daemon d's status shows a collective of job running or
 * waiting in it; then node 0's ranks are inside their next iteration. */
static void rj_wait_pending(const test_daemon *d, const char *needle) {
  shardd_client_t *ctl = test_connect(d, NULL, 0, 0);
  for (double end = test_mono_s() + TEST_HANG_S;;) {
    char *text = NULL;
    cr_assert_eq(shardd_status_text(ctl, &text), SHARDD_OK);
    int hit = strstr(text, needle) != NULL;
    shardd_free(text);
    if (hit)
      break;
    cr_assert(test_mono_s() < end, "never saw \"%s\" on %s", needle, d->sock);
    test_sleep_ms(20);
  }
  shardd_close(ctl);
}

/* SIGTERM node 1's daemon (exit 0 and its exit part written), close its
 * ranks; returns when it is gone. wrote_part: it had --checkpoint-on-exit
 * and a job, so it logs its part as what its restart restores, not as
 * unrestorable. */
static void rj_stop_node1_as(test_daemon pair[2], ck_job *j, int wrote_part) {
  cr_assert_eq(test_daemon_terminate(&pair[1]), 0, "node 1's daemon on SIGTERM");
  if (wrote_part) {
    cr_assert(test_daemon_log_has(&pair[1], "restores it to rejoin the job's live nodes"));
    cr_assert_not(test_daemon_log_has(&pair[1], "not restorable"));
  }
  test_daemon_stop(&pair[1]);
  for (int r = 2; r < W; r++) {
    shardd_close(j->c[r]);
    j->c[r] = NULL;
  }
}

static void rj_stop_node1(test_daemon pair[2], ck_job *j) {
  rj_stop_node1_as(pair, j, 0);
}

/* Issue 21 item 2 on 2 nodes x 2 ranks, AdamW with clipping every other
 * step: node 1's daemon is stopped (SIGTERM, --checkpoint-on-exit) after
 * step 3 while node 0's ranks wait in step 4's first scatter; they get
 * E_PEER_LOST and retry the iteration, which waits for the fabric to
 * re-form. Node 1's daemon comes back with --restore of its exit part
 * (DIR/rj/node-1, no job manifest), its ranks relaunch and attach to the
 * restored buffers, and all four train on to step 6: every rank's final
 * parameters equal an uninterrupted 6-step run bit for bit, and so do the
 * optimizer's steps. */
Test(fabric, a_node_daemon_restart_rejoins_the_job_bit_for_bit, .timeout = 120) {
  need_gloo();
  scratch s;
  scratch_make(&s);
  const char *jobs[] = {"rj"};
  test_daemon pair[2];

  /* the reference: an uninterrupted run */
  start_pair(pair, &s, jobs, 1, "30");
  ck_job j;
  ck_attach(pair, "rj", 1, &j);
  ck_steps(&j, 1, RJ_N);
  float *ref[2][W];
  ck_final(&j, ref);
  test_daemon_finish(&pair[0]);
  test_daemon_finish(&pair[1]);

  char ex[160];
  snprintf(ex, sizeof ex, "%s/exit", s.dir);
  const char *exit_args[] = {"--checkpoint-on-exit", ex, NULL};
  start_pair_each(pair, &s, jobs, 1, "30", exit_args, exit_args);
  memset(&j, 0, sizeof j);
  rj_attach(pair, "rj", 1, &j, 0);
  rj_attach(pair, "rj", 1, &j, 1);
  rj_rank k[W];
  for (int r = 0; r < W; r++)
    rj_start(&k[r], &j, r, 1, RJ_AT);
  for (int r = 0; r < W; r++) {
    pthread_join(k[r].th, NULL);
    cr_assert_eq(k[r].rc, SHARDD_OK, "rank %d: %s", r, k[r].msg);
  }
  /* node 0's ranks go on into step 4 and wait there for node 1's */
  for (int r = 0; r < 2; r++)
    rj_start(&k[r], &j, r, RJ_AT + 1, RJ_N);
  rj_wait_pending(&pair[0], "(big): running");
  double t0 = test_mono_s();
  rj_stop_node1_as(pair, &j, 1);
  char path[300];
  snprintf(path, sizeof path, "%s/rj/node-1/manifest", ex);
  cr_assert_eq(access(path, R_OK), 0, "no exit part %s", path);
  snprintf(path, sizeof path, "%s/rj/manifest", ex);
  cr_assert_neq(access(path, F_OK), 0, "a job manifest at %s", path);

  /* node 1's daemon restarts from its exit part; its ranks relaunch */
  const char *back[] = {"--checkpoint-on-exit", ex, KEEP_RESTORED, "--restore", ex,
                        NULL};
  start_node(&pair[1], &s, "rj", 1, "30", back);
  double t_back = test_mono_s();
  rj_attach(pair, "rj", 0, &j, 1);
  for (int r = 2; r < W; r++)
    rj_start(&k[r], &j, r, RJ_AT + 1, RJ_N);
  for (int r = 0; r < W; r++) {
    pthread_join(k[r].th, NULL);
    cr_assert_eq(k[r].rc, SHARDD_OK, "rank %d: %s", r, k[r].msg);
  }
  double done = test_mono_s();
  for (int r = 0; r < 2; r++)
    cr_expect_gt(k[r].retries, 0, "node 0's rank %d never saw the loss", r);
  cr_log_info("fabric: node 1 restarted: node 0's ranks lost it %.3f s after the "
              "SIGTERM, retried %d times, and trained on %.3f s after node 1's "
              "daemon was back (steps %d..%d in %.3f s); last loss: %s",
              k[0].lost_at ? k[0].lost_at - t0 : -1.0, k[0].retries, done - t_back,
              RJ_AT + 1, RJ_N, done - t0, k[0].msg);

  float *got[2][W];
  ck_final(&j, got);
  for (int b = 0; b < 2; b++)
    for (int r = 0; r < W; r++) {
      char what[64];
      snprintf(what, sizeof what, "rejoined buffer %d rank %d", b, r);
      compare(ref[b][r], got[b][r], j.info[b][r].padded_numel, 1, what);
      free(got[b][r]);
      free(ref[b][r]);
    }
  cr_log_info("fabric: 2 nodes x 2 ranks, node 1's daemon restarted after step %d: "
              "steps %d..%d bit for bit with the uninterrupted run", RJ_AT, RJ_AT + 1,
              RJ_N);
  test_daemon_finish(&pair[0]);
  test_daemon_finish(&pair[1]);
  scratch_remove(&s);
}

/* The refusals of a re-forming fabric, with a 4 s collective timeout:
 * node 1 restarted from an exit part of an earlier step (the job's states
 * no longer fit) fails the retried iteration on both nodes with
 * E_MISMATCH naming the other node and the step counts; node 1 restarted
 * without --restore (a fresh job) is refused by its lineage; node 1 that
 * never comes back fails node 0's retry with E_PEER_LOST naming it within
 * the timeout. Also: a restart while node 0's ranks sat idle (their next
 * collective fails on the dead fabric, and its retry re-forms it). */
Test(fabric, a_node_that_rejoins_with_other_state_or_never_is_named, .timeout = 120) {
  need_gloo();
  scratch s;
  scratch_make(&s);
  const char *jobs[] = {"rf"};
  test_daemon pair[2];
  char ex[160], old[160];
  snprintf(ex, sizeof ex, "%s/exit", s.dir);
  snprintf(old, sizeof old, "%s/old", s.dir);
  const char *exit_args[] = {"--checkpoint-on-exit", ex, NULL};
  start_pair_each(pair, &s, jobs, 1, "4", exit_args, exit_args);
  ck_job j;
  memset(&j, 0, sizeof j);
  rj_attach(pair, "rf", 1, &j, 0);
  rj_attach(pair, "rf", 1, &j, 1);
  rj_rank k[W];
  for (int r = 0; r < W; r++)
    rj_start(&k[r], &j, r, 1, 2);
  for (int r = 0; r < W; r++) {
    pthread_join(k[r].th, NULL);
    cr_assert_eq(k[r].rc, SHARDD_OK, "rank %d: %s", r, k[r].msg);
  }

  /* node 1 restarts while every rank is idle: steps 3..4 go on */
  rj_stop_node1(pair, &j);
  char cmd[400];
  snprintf(cmd, sizeof cmd, "cp -a '%s' '%s'", ex, old); /* step 2's part */
  ck_sh(cmd);
  const char *back[] = {"--checkpoint-on-exit", ex, KEEP_RESTORED, "--restore", ex,
                        NULL};
  start_node(&pair[1], &s, "rf", 1, "4", back);
  rj_attach(pair, "rf", 0, &j, 1);
  for (int r = 0; r < W; r++)
    rj_start(&k[r], &j, r, 3, 4);
  for (int r = 0; r < W; r++) {
    pthread_join(k[r].th, NULL);
    cr_assert_eq(k[r].rc, SHARDD_OK, "rank %d: %s", r, k[r].msg);
  }

  /* node 1 restarts from step 2's part while node 0 holds step 4 */
  rj_stop_node1(pair, &j);
  const char *stale[] = {KEEP_RESTORED, "--restore", old, NULL};
  start_node(&pair[1], &s, "rf", 1, "4", stale);
  rj_attach(pair, "rf", 0, &j, 1);
  for (int r = 0; r < W; r++)
    rj_start(&k[r], &j, r, 5, 5);
  for (int r = 0; r < W; r++)
    pthread_join(k[r].th, NULL);
  for (int r = 0; r < W; r++) {
    cr_expect_eq(k[r].rc, SHARDD_E_MISMATCH, "rank %d: %s: %s", r,
                 shardd_err_name(k[r].rc), k[r].msg);
    char want[160];
    snprintf(want, sizeof want, "node %d holds job \"rf\" with 1 optimizer at step %d",
             r < 2 ? 1 : 0, r < 2 ? 2 : 4);
    cr_expect(strstr(k[r].msg, want) != NULL, "rank %d: %s", r, k[r].msg);
  }
  cr_log_info("fabric: node 1 back from an older part: node 0 hears: %s", k[0].msg);
  cr_log_info("fabric: node 1 back from an older part: node 1 hears: %s", k[2].msg);

  /* node 1 restarts without --restore: a fresh job of the name */
  rj_stop_node1(pair, &j);
  start_node(&pair[1], &s, "rf", 1, "4", NULL);
  rj_attach(pair, "rf", 1, &j, 1);
  for (int r = 0; r < W; r++)
    rj_start(&k[r], &j, r, 5, 5);
  for (int r = 0; r < W; r++)
    pthread_join(k[r].th, NULL);
  for (int r = 0; r < W; r++) {
    cr_expect_eq(k[r].rc, SHARDD_E_MISMATCH, "rank %d: %s: %s", r,
                 shardd_err_name(k[r].rc), k[r].msg);
    cr_expect(strstr(k[r].msg, r < 2 ? "node 1 holds job \"rf\" as a fresh job"
                                     : "node 0 holds job \"rf\" as live state") != NULL,
              "rank %d: %s", r, k[r].msg);
  }
  cr_log_info("fabric: node 1 back as a fresh job: node 0 hears: %s", k[0].msg);

  /* node 1 never comes back: node 0's retry fails naming it */
  rj_stop_node1(pair, &j);
  double t0 = test_mono_s();
  for (int r = 0; r < 2; r++)
    rj_start_n(&k[r], &j, r, 5, 5, 0);
  for (int r = 0; r < 2; r++)
    pthread_join(k[r].th, NULL);
  double took = test_mono_s() - t0;
  for (int r = 0; r < 2; r++) {
    cr_expect_eq(k[r].rc, SHARDD_E_PEER_LOST, "rank %d: %s: %s", r,
                 shardd_err_name(k[r].rc), k[r].msg);
    cr_expect(strstr(k[r].msg, "node 1 of 2 did not join") != NULL, "rank %d: %s", r,
              k[r].msg);
  }
  cr_expect(took < 4 + 3, "node 0 waited %.1f s for the missing node (timeout 4 s)", took);
  cr_log_info("fabric: node 1 never back: node 0's retry failed after %.2f s: %s", took,
              k[0].msg);
  for (int r = 0; r < 2; r++)
    shardd_close(j.c[r]);
  test_daemon_finish(&pair[0]);
  scratch_remove(&s);
}

/* README "A node's daemon killed", its procedure as scripts/recover_job.sh
 * runs it: 2 nodes x 2 ranks train, sm.checkpoint at step 3, on to step 6;
 * the ranks relaunch and gather; node 1's daemon is killed (kill -9) and
 * node 0's ranks retry (a re-forming that waits for node 1). Node 0's
 * trainers are stopped, node 1's daemon comes back (fresh: its shards are
 * gone), and the script runs on each node: node 0's release goes through
 * within --peer-grace of its trainers leaving, node 1 has nothing to
 * release, both restore step 3. The relaunched ranks are told they resume
 * at step 3 and steps 4-6 end bit for bit where the first run did. */
Test(fabric, a_killed_nodes_job_recovers_with_the_scripted_procedure,
     .timeout = 120) {
  need_gloo();
  scratch s;
  scratch_make(&s);
  char cka[160];
  snprintf(cka, sizeof cka, "%s/ck-a", s.dir);
  const char *jobs[] = {"ck"};
  const char *keep[] = {KEEP_RESTORED, NULL};
  test_daemon pair[2];
  start_pair_each(pair, &s, jobs, 1, "60", keep, keep);
  ck_job j;
  ck_attach(pair, "ck", 1, &j);
  ck_steps(&j, 1, CK_AT);
  ck_collective(&j, cka);
  ck_steps(&j, CK_AT + 1, CK_N);
  float *ref[2][W];
  ck_final(&j, ref);

  /* the ranks come back (the job lingered) and the fabric is up again;
   * then node 1's daemon is killed and node 0's ranks retry a gather */
  ck_attach(pair, "ck", 0, &j);
  all_ranks(j.c, OP_GATHER, j.info[0][0].id, 0, NULL);
  kill(pair[1].pid, SIGKILL);
  waitpid(pair[1].pid, NULL, 0);
  pair[1].pid = 0;
  call calls[2];
  for (int attempt = 0; attempt < 2; attempt++) {
    memset(calls, 0, sizeof calls);
    for (int r = 0; r < 2; r++) {
      calls[r].c = j.c[r];
      calls[r].kind = OP_GATHER;
      calls[r].id = j.info[0][r].id;
      pthread_create(&calls[r].th, NULL, call_main, &calls[r]);
    }
    if (attempt == 1)
      break;
    for (int r = 0; r < 2; r++)
      pthread_join(calls[r].th, NULL);
  }
  wait_running(&pair[0], "big");

  /* node 0's trainers stop; node 1's daemon restarts (Restart=) */
  double t0 = test_mono_s();
  cr_assert_eq(cut_connections_to(pair[0].sock), 2);
  for (int r = 0; r < 2; r++)
    pthread_join(calls[r].th, NULL);
  for (int r = 0; r < W; r++)
    shardd_close(j.c[r]);
  test_daemon_stop(&pair[1]);
  start_node(&pair[1], &s, "ck", 1, "60", keep);

  /* the procedure on each node */
  for (int n = 0; n < 2; n++) {
    char cmd[900], *out = NULL;
    snprintf(cmd, sizeof cmd, "SHARDCTL=%s scripts/recover_job.sh --socket %s "
             "ck %s 2>&1", getenv("SHARDCTL_BIN") ? getenv("SHARDCTL_BIN")
                                                   : "build/shardctl",
             pair[n].sock, cka);
    FILE *p = popen(cmd, "r");
    cr_assert_not_null(p);
    char buf[4096];
    size_t len = fread(buf, 1, sizeof buf - 1, p);
    buf[len] = '\0';
    int st = pclose(p);
    out = buf;
    cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == 0, "node %d: %s", n, out);
    cr_assert(strstr(out, n == 0 ? "ck: released" : "no job \"ck\" here") != NULL,
              "node %d: %s", n, out);
    cr_assert(strstr(out, "restored ck: ") != NULL, "node %d: %s", n, out);
    if (n == 0) {
      double took = test_mono_s() - t0;
      cr_log_info("fabric: node 1 killed: recover_job.sh on node 0 done %.2f s "
                  "after its trainers stopped (--peer-grace 1 s, timeout 60 s)",
                  took);
      cr_expect_lt(took, 1 + 4, "node 0's release took %.1f s", took);
    }
  }

  /* the trainers relaunch: told step 3, steps 4-6 as the first run (each
   * node's ids are its own now: node 0's restore numbered anew) */
  memset(&j, 0, sizeof j);
  rj_attach(pair, "ck", 0, &j, 0);
  rj_attach(pair, "ck", 0, &j, 1);
  for (int r = 0; r < W; r++) {
    uint64_t at = 0;
    cr_assert(shardd_resumed(j.c[r], &at), "rank %d is not told it resumes", r);
    cr_assert_eq(at, CK_AT, "rank %d told it resumes at step %" PRIu64, r, at);
  }
  rj_rank k[W];
  for (int r = 0; r < W; r++)
    rj_start_n(&k[r], &j, r, CK_AT + 1, CK_N, 0);
  for (int r = 0; r < W; r++) {
    pthread_join(k[r].th, NULL);
    cr_assert_eq(k[r].rc, SHARDD_OK, "rank %d: %s", r, k[r].msg);
  }
  for (int b = 0; b < 2; b++) {
    call g[W];
    memset(g, 0, sizeof g);
    for (int r = 0; r < W; r++) {
      g[r].c = j.c[r];
      g[r].kind = OP_GATHER;
      g[r].id = j.info[b][r].id;
      pthread_create(&g[r].th, NULL, call_main, &g[r]);
    }
    for (int r = 0; r < W; r++)
      pthread_join(g[r].th, NULL);
    for (int r = 0; r < W; r++) {
      cr_assert_eq(g[r].rc, SHARDD_OK, "rank %d: gather: %s", r, g[r].msg);
      char what[64];
      snprintf(what, sizeof what, "recovered buffer %d rank %d", b, r);
      compare(ref[b][r], j.info[b][r].gather, j.info[b][r].padded_numel, 1, what);
      free(ref[b][r]);
    }
  }
  for (int r = 0; r < W; r++)
    shardd_close(j.c[r]);
  test_daemon_finish(&pair[0]);
  test_daemon_finish(&pair[1]);
  scratch_remove(&s);
}

/* ---- buckets across nodes ---------------------------------------------- */

#define NBF 6

typedef struct {
  shardd_client_t *c;
  int scatter;
  uint64_t ids[NBF];
  size_t n;
  shardd_err errs[NBF];
  shardd_err rc;
  char msg[1024];
  pthread_t th;
} bcall;

static void *bcall_main(void *p) {
  bcall *k = p;
  k->rc = k->scatter ? shardd_scatter_many(k->c, k->n, k->ids, SHARDD_REDUCE_SUM, k->errs)
                     : shardd_gather_many(k->c, k->n, k->ids, k->errs);
  snprintf(k->msg, sizeof k->msg, "%s", k->rc ? shardd_last_error(k->c) : "");
  return NULL;
}

/* every rank's bucket call (k[r], filled in) at once, joined */
static void run_bcalls(bcall k[W]) {
  for (int r = 0; r < W; r++)
    cr_assert_eq(pthread_create(&k[r].th, NULL, bcall_main, &k[r]), 0);
  for (int r = 0; r < W; r++)
    pthread_join(k[r].th, NULL);
}

/* Two node daemons serving job, and its W ranks connected (2 per node). */
typedef struct {
  scratch s;
  test_daemon pair[2];
  shardd_client_t *c[W];
} two_nodes;

static void two_nodes_open(two_nodes *t, const char *job, const char *timeout) {
  need_gloo();
  scratch_make(&t->s);
  const char *jobs[] = {job};
  start_pair(t->pair, &t->s, jobs, 1, timeout);
  for (int r = 0; r < W; r++)
    t->c[r] = test_connect(&t->pair[r / 2], job, (uint32_t)r, W);
}

static void two_nodes_close(two_nodes *t) {
  for (int r = 0; r < W; r++)
    shardd_close(t->c[r]);
  test_daemon_finish(&t->pair[0]);
  test_daemon_finish(&t->pair[1]);
  scratch_remove(&t->s);
}

/* A bucket's entries cross nodes each as its own exchange, paired by the
 * buffer's name: node 0's ranks send the list first to last, node 1's last
 * to first, and every gathered and reduced element is exact. */
Test(fabric, buckets_of_a_two_node_job_gather_and_scatter_exactly, .timeout = 60) {
  two_nodes t;
  two_nodes_open(&t, "bkt", "10");
  shardd_client_t **c = t.c;
  static shardd_buffer_info b[W][NBF];
  for (int r = 0; r < W; r++) {
    for (int i = 0; i < NBF; i++) {
      char name[16];
      snprintf(name, sizeof name, "p%d", i);
      cr_assert_eq(shardd_buffer_register(c[r], name, SHARDD_DTYPE_FP32,
                                          (uint64_t)(40 + 33 * i), &b[r][i]),
                   SHARDD_OK, "%s", shardd_last_error(c[r]));
      float *sh = b[r][i].shard;
      for (size_t e = 0; e < b[r][i].shard_numel; e++)
        sh[e] = (float)(i * 100000 + r * (int)b[r][i].shard_numel + (int)e);
      float *g = b[r][i].grad;
      for (size_t e = 0; e < b[r][i].padded_numel; e++)
        g[e] = (float)((r + 1) * (i + 1)) + (float)e;
    }
  }
  for (int scatter = 0; scatter < 2; scatter++) {
    bcall k[W];
    memset(k, 0, sizeof k);
    for (int r = 0; r < W; r++) {
      k[r].c = c[r];
      k[r].scatter = scatter;
      k[r].n = NBF;
      for (int i = 0; i < NBF; i++)
        k[r].ids[i] = b[r][r < 2 ? i : NBF - 1 - i].id;
    }
    run_bcalls(k);
    for (int r = 0; r < W; r++)
      cr_assert_eq(k[r].rc, SHARDD_OK, "%s rank %d: %s: %s", scatter ? "scatter" : "gather",
                   r, shardd_err_name(k[r].rc), k[r].msg);
  }
  for (int r = 0; r < W; r++)
    for (int i = 0; i < NBF; i++) {
      const shardd_buffer_info *x = &b[r][i];
      const float *g = x->gather, *red = x->reduced;
      for (size_t e = 0; e < x->padded_numel; e++)
        cr_assert_eq(g[e], (float)(i * 100000 + (int)e), "rank %d p%d gather[%zu]", r, i, e);
      /* sum over ranks of (q+1)(i+1) + j, j the element in the buffer */
      for (size_t e = 0; e < x->shard_numel; e++) {
        size_t j = (size_t)r * x->shard_numel + e;
        cr_assert_eq(red[e], (float)(10 * (i + 1)) + 4.0f * (float)j,
                     "rank %d p%d reduced[%zu]", r, i, e);
      }
    }
  two_nodes_close(&t);
}

/* Node 0's two ranks send one bucket in two orders: every rank of both
 * nodes fails (E_MISMATCH on node 0, at once), and the job's next agreeing
 * bucket goes through. */
Test(fabric, a_bucket_node_0_disagrees_on_fails_both_nodes_and_the_next_runs,
     .timeout = 90) {
  two_nodes t;
  two_nodes_open(&t, "bktbad", "5");
  shardd_client_t **c = t.c;
  static shardd_buffer_info b[W][2];
  for (int r = 0; r < W; r++) {
    for (int i = 0; i < 2; i++) {
      char name[16];
      snprintf(name, sizeof name, "q%d", i);
      cr_assert_eq(shardd_buffer_register(c[r], name, SHARDD_DTYPE_FP32, 64, &b[r][i]),
                   SHARDD_OK, "%s", shardd_last_error(c[r]));
    }
  }
  for (int round = 0; round < 2; round++) {
    bcall k[W];
    memset(k, 0, sizeof k);
    double t0 = test_mono_s();
    for (int r = 0; r < W; r++) {
      k[r].c = c[r];
      k[r].n = 2;
      int flip = round == 0 && r == 1;
      k[r].ids[0] = b[r][flip].id;
      k[r].ids[1] = b[r][!flip].id;
    }
    run_bcalls(k);
    double took = test_mono_s() - t0;
    for (int r = 0; r < W; r++) {
      cr_assert_eq(k[r].rc, round == 0 ? SHARDD_E_MISMATCH : SHARDD_OK,
                   "round %d rank %d after %.2f s: %s: %s", round, r, took,
                   shardd_err_name(k[r].rc), k[r].msg);
      if (round > 0)
        continue;
      /* both entries failed by what differs, on node 1 through each
       * exchange's header: not by the fabric timing out (which loses it) */
      cr_assert_eq(k[r].errs[0], SHARDD_E_MISMATCH, "rank %d: %s", r, k[r].msg);
      cr_assert_eq(k[r].errs[1], SHARDD_E_MISMATCH, "rank %d: %s", r, k[r].msg);
      const char *why = r < 2 ? "every rank must send the same buffers in the same order"
                              : "node 0 refused gather of buffer \"q1\" locally";
      cr_assert(strstr(k[r].msg, why) != NULL, "rank %d: %s", r, k[r].msg);
      if (r >= 2)
        cr_assert(strstr(k[r].msg, "node 0 refused gather of buffer \"q0\" locally") != NULL,
                  "rank %d: %s", r, k[r].msg);
    }
    cr_log_info("fabric: a bucket node 0's ranks disagree on, round %d: %.3f s", round, took);
  }
  two_nodes_close(&t);
}
