/* test_node_loss.c — a node's daemon stopped, killed or restarted under a
 * multi-node job: an exchange it is inside is aborted, its survivors'
 * jobs are released, collective checkpoints of the job, and a restarted
 * node rejoins the job bit for bit. */
#include <criterion/criterion.h>
#include <dirent.h>
#include <inttypes.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <sys/socket.h>
#include <sys/un.h>

#include "backend.h"
#include "checkpoint.h"
#include "fabric.h"
#include "harness.h"
#include "fabric_fixture.h"
#include "registry.h"

TestSuite(fabric, .init = fabric_setup, .fini = fabric_teardown);

/* ---- stopping a daemon inside an exchange ---------------------------------- */

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

/* Another client of a daemon pinging it every 2 ms from a thread until
 * stop: its slowest answer (the longest the loop held everyone), how many
 * came, and the first failure. */
typedef struct {
  const char *sock;
  atomic_int stop;
  double worst;
  int n;
  shardd_err rc;
  pthread_t th;
} pinger;

static void *pinger_main(void *p) {
  pinger *pg = p;
  shardd_connect_opts o = SHARDD_CONNECT_OPTS_INIT;
  shardd_client_t *c;
  char err[256];
  if ((pg->rc = shardd_connect(pg->sock, &o, &c, err, sizeof err)) != SHARDD_OK)
    return NULL;
  while (!atomic_load(&pg->stop)) {
    double t = test_mono_s();
    if ((pg->rc = shardd_ping(c)) != SHARDD_OK)
      break;
    double dt = test_mono_s() - t;
    if (dt > pg->worst)
      pg->worst = dt;
    pg->n++;
    test_sleep_ms(2);
  }
  shardd_close(c);
  return NULL;
}

static void pinger_start(pinger *pg, const char *sock) {
  memset(pg, 0, sizeof *pg);
  pg->sock = sock;
  cr_assert_eq(pthread_create(&pg->th, NULL, pinger_main, pg), 0);
}

/* Stops pg; asserts every ping was answered, none slower than max_s. */
static void pinger_finish(pinger *pg, double max_s, const char *during) {
  atomic_store(&pg->stop, 1);
  pthread_join(pg->th, NULL);
  cr_log_info("another client's %d pings while %s: the slowest %.1f ms",
              pg->n, during, pg->worst * 1e3);
  cr_assert_eq(pg->rc, SHARDD_OK, "a ping failed: %s", shardd_err_name(pg->rc));
  cr_assert_gt(pg->n, 0);
  cr_assert_lt(pg->worst, max_s, "another client's ping waited %.0f ms while "
               "%s", pg->worst * 1e3, during);
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
  test_daemon pair[2];
  const char *jobs[] = {"kj"};
  const char *linger[] = {"--job-linger", "600", NULL};
  start_pair_each(pair, &scr, jobs, 1, "60", linger, linger);
  shardd_client_t *c[W];
  shardd_buffer_info info[W];
  join_ranks_w(pair, "kj", W, 4000, c, info);
  all_ranks(c, OP_GATHER, info[0].id, 0, NULL); /* the fabric is up */
  kill_node1(pair);

  /* node 0's ranks: the next gather fails on the dead fabric; the retry
   * re-forms it and waits for node 1 */
  call calls[2];
  calls_start(calls, 2, c, OP_GATHER, info, NULL);
  calls_join(calls, 2);
  for (int r = 0; r < 2; r++)
    cr_assert_eq(calls[r].rc, SHARDD_E_PEER_LOST, "rank %d: %s: %s", r,
                 shardd_err_name(calls[r].rc), calls[r].msg);
  calls_start(calls, 2, c, OP_GATHER, info, NULL);
  wait_running(&pair[0], "w");
  test_sleep_ms(300); /* inside the re-forming's rendezvous */

  /* the operator stops node 0's trainers, then releases the job */
  double t0 = test_mono_s();
  cr_assert_eq(cut_connections_to(pair[0].sock), 2);
  /* the abandonment, --peer-grace later, must not hold node 0's loop:
   * another client's pings go on being answered at once meanwhile */
  pinger pg;
  pinger_start(&pg, pair[0].sock);
  calls_join(calls, 2);
  char first[1024], last[1024];
  double took = release_within(&pair[0], "kj", 50, first, last, sizeof last);
  pinger_finish(&pg, 0.25, "node 0 abandoned the re-forming");
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
  char ck[128];
  snprintf(ck, sizeof ck, "%s/exit", scr.dir);
  test_daemon pair[2];
  const char *jobs[] = {"halt"};
  const char *extra0[] = {"--checkpoint-on-exit", ck, NULL};
  start_pair_ex(pair, &scr, jobs, 1, "30", extra0);
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

  /* node 0's ranks gather "w", node 1's "v" */
  const shardd_buffer_info wv[W] = {w[0], w[1], v[2], v[3]};
  call calls[W];
  calls_start(calls, W, c, OP_GATHER, wv, NULL);
  wait_running(&pair[0], "w");
  wait_running(&pair[1], "v");

  double t0 = test_mono_s();
  kill(pair[0].pid, SIGTERM);
  int status = -1;
  cr_assert(test_wait_exit(pair[0].pid, &status), "node 0 did not exit within %.0f s",
            TEST_HANG_S);
  double exit_s = test_mono_s() - t0;
  pair[0].pid = 0;
  calls_join(calls, W);
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

/* Ranks lo..hi-1 of job connect (ranks 0-1 to node 0, 2-3 to node 1)
 * and register train()'s buffers; fresh: each rank writes its shard of the
 * initial values (a restored job keeps the restored ones). */
static void attach_ranks(const test_daemon *d, const char *job, int fresh, ck_job *j,
                         int lo, int hi) {
  const uint64_t numel[2] = {N_BIG, N_SMALL};
  const char *names[2] = {"big", "small"};
  for (int r = lo; r < hi; r++)
    j->c[r] = test_connect(&d[r / 2], job, (uint32_t)r, W);
  for (int b = 0; b < 2; b++)
    for (int r = lo; r < hi; r++) {
      shardd_buffer_info *in = &j->info[b][r];
      cr_assert_eq(shardd_buffer_register(j->c[r], names[b], SHARDD_DTYPE_FP32,
                                          numel[b], in),
                   SHARDD_OK, "rank %d: register %s: %s", r, names[b],
                   shardd_last_error(j->c[r]));
      for (size_t k = 0; fresh && k < in->shard_numel; k++) {
        size_t g = (size_t)r * in->shard_numel + k;
        ((float *)in->shard)[k] = g < numel[b] ? fabric_init_param(b, g) : 0.0f;
      }
    }
}

/* Ranks lo..hi-1 register train()'s AdamW over both buffers (by rank lo's
 * ids of them); the id the last rank got. */
static uint64_t attach_adamw(ck_job *j, int lo, int hi) {
  shardd_hparams hp = {0};
  hp.set = SHARDD_HP_LR | SHARDD_HP_WEIGHT_DECAY;
  hp.lr = 0.01;
  hp.weight_decay = 0.05;
  shardd_param_ref refs[2] = {{j->info[0][lo].id, "big"}, {j->info[1][lo].id, "small"}};
  shardd_param_group g = {refs, 2, {0}};
  uint64_t id = 0;
  for (int r = lo; r < hi; r++)
    cr_assert_eq(shardd_optimizer_register(j->c[r], "adamw", SHARDD_OPTIM_ADAMW, &hp,
                                           &g, 1, &id),
                 SHARDD_OK, "rank %d: optimizer: %s", r, shardd_last_error(j->c[r]));
  return id;
}

/* Connects the ranks of job to the pair (ranks 0-1 node 0, 2-3 node 1) and
 * registers train()'s buffers and AdamW; fresh: each rank writes its shard
 * of the initial values (a restored job keeps the restored ones). */
static void ck_attach(const test_daemon *d, const char *job, int fresh, ck_job *j) {
  memset(j, 0, sizeof *j);
  attach_ranks(d, job, fresh, j, 0, W);
  j->opt = attach_adamw(j, 0, W);
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

/* Each rank's sm.checkpoint into dirs[rank / 2] (node 0's, node 1's),
 * on threads; the calls' results in k. */
static void ck_collective_into(ck_job *j, const char *const dirs[2], call k[W]) {
  calls_start(k, W, j->c, OP_CHECKPOINT, NULL, dirs);
  calls_join(k, W);
}

/* sm.checkpoint(dir) on every rank, each on its own thread. */
static void ck_collective(ck_job *j, const char *dir) {
  call calls[W];
  ck_collective_into(j, (const char *const[]){dir, dir}, calls);
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

/* Every rank's final copy of both buffers (got, freed here) is the
 * reference run's (ref), bit for bit; what names the run. */
static void expect_bit_for_bit(float *ref[2][W], float *got[2][W], const ck_job *j,
                               const char *what) {
  for (int b = 0; b < 2; b++)
    for (int r = 0; r < W; r++) {
      char where[96];
      snprintf(where, sizeof where, "%s buffer %d rank %d", what, b, r);
      compare(ref[b][r], got[b][r], j->info[b][r].padded_numel, 1, where);
      free(got[b][r]);
    }
}

static void free_run(float *p[2][W]) {
  for (int b = 0; b < 2; b++)
    for (int r = 0; r < W; r++)
      free(p[b][r]);
}

static void ck_sh(const char *cmd) { cr_assert_eq(system(cmd), 0, "%s", cmd); }

/* A restored job lingers like one whose clients left: under the pair's
 * --job-linger 0 the daemon's next tick (100 ms) releases it before the
 * relaunched ranks attach whenever they are slower than that (a loaded
 * machine), and they get a fresh job instead. Daemons that restore a job
 * keep it until its ranks come (the last --job-linger given counts). */
#define KEEP_RESTORED "--job-linger", "600"

/* Collective checkpoints on 2 nodes x 2 ranks: sm.checkpoint every so often while
 * training (step 3, and step 6 into another directory), each node writing
 * its part and the job manifest over both; then fresh daemons --restore
 * the step-3 checkpoint on both nodes, the ranks relaunch from step 4 and
 * end bit for bit where the uninterrupted run ended (the reference is that
 * run, continued past its checkpoint). Refused before anything loads: a
 * node's part missing, the parts swapped, a part restored alone; and nodes
 * that restored different checkpoints fail their first collective with
 * E_MISMATCH naming the other node. */
Test(fabric, collective_checkpoint_of_two_nodes_restores_bit_for_bit, .timeout = 120) {
  char cka[160], ckb[160];
  snprintf(cka, sizeof cka, "%s/ck-a", scr.dir);
  snprintf(ckb, sizeof ckb, "%s/ck-b", scr.dir);
  const char *jobs[] = {"ck"};
  test_daemon pair[2];
  start_pair(pair, &scr, jobs, 1, "30");
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
  start_pair_each(pair, &scr, jobs, 1, "30", rest, rest);
  ck_attach(pair, "ck", 0, &j);
  ck_steps(&j, CK_AT + 1, CK_N);
  float *got[2][W];
  ck_final(&j, got);
  expect_bit_for_bit(ref, got, &j, "restored");
  cr_log_info("fabric: 2 nodes x 2 ranks, checkpoint at step %d restored into fresh "
              "daemons, steps %d..%d bit for bit", CK_AT, CK_AT + 1, CK_N);
  test_daemon_finish(&pair[0]);
  test_daemon_finish(&pair[1]);

  /* refusals, before any job exists */
  const char *keep[] = {KEEP_RESTORED, NULL};
  start_pair_each(pair, &scr, jobs, 1, "30", keep, keep);
  shardd_client_t *ctl[2] = {test_connect(&pair[0], NULL, 0, 0),
                             test_connect(&pair[1], NULL, 0, 0)};
  char sw[160], miss[160];
  snprintf(sw, sizeof sw, "%s/swapped", scr.dir);
  snprintf(miss, sizeof miss, "%s/missing", scr.dir);
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
  calls_start(calls, W, j.c, OP_GATHER, j.info[0], NULL);
  calls_join(calls, W);
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
  free_run(ref);
  test_daemon_finish(&pair[0]);
  test_daemon_finish(&pair[1]);
}

/* A collective checkpoint of a multi-node job that cannot be whole writes
 * no job manifest, every rank hears which node is at fault, and the job
 * trains and checkpoints on: the nodes' ranks naming two directories
 * (compared across nodes by the barrier), and node 1 unable to write its
 * part (DIR/node-1 is a file). */
Test(fabric, collective_checkpoint_that_cannot_be_whole_names_the_node, .timeout = 120) {
  const char *jobs[] = {"ckf"};
  test_daemon pair[2];
  start_pair(pair, &scr, jobs, 1, "30");
  ck_job j;
  ck_attach(pair, "ckf", 1, &j);
  ck_steps(&j, 1, 1);

  char da[160], db[160], path[300];
  snprintf(da, sizeof da, "%s/a", scr.dir);
  snprintf(db, sizeof db, "%s/b", scr.dir);
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
  snprintf(dc, sizeof dc, "%s/c", scr.dir);
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
}

/* ---- a node's daemon restarted mid-job ------------------------------------ */

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
  attach_ranks(d, job, fresh, j, node * 2, node * 2 + 2);
  j->opt_of[node] = attach_adamw(j, node * 2, node * 2 + 2);
}

/* rj_attach of both nodes' ranks into a cleared j. */
static void rj_attach_all(const test_daemon *d, const char *job, int fresh, ck_job *j) {
  memset(j, 0, sizeof *j);
  rj_attach(d, job, fresh, j, 0);
  rj_attach(d, job, fresh, j, 1);
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

/* Ranks lo..hi-1 run steps from..to, each on its own thread, retrying
 * an iteration lost to the other node up to max_retries times. */
static void rj_start_n(rj_rank *k, ck_job *j, int lo, int hi, int from, int to,
                       int max_retries) {
  for (int r = lo; r < hi; r++) {
    memset(&k[r], 0, sizeof k[r]);
    k[r].max_retries = max_retries;
    k[r].j = j;
    k[r].rank = r;
    k[r].from = from;
    k[r].to = to;
    cr_assert_eq(pthread_create(&k[r].th, NULL, rj_rank_main, &k[r]), 0);
  }
}

static void rj_start(rj_rank *k, ck_job *j, int lo, int hi, int from, int to) {
  rj_start_n(k, j, lo, hi, from, to, 1000);
}

static void rj_join(rj_rank *k, int lo, int hi) {
  for (int r = lo; r < hi; r++)
    pthread_join(k[r].th, NULL);
}

/* Ranks lo..hi-1 end their steps, every one of them well. */
static void rj_expect_ok(rj_rank *k, int lo, int hi) {
  for (int r = lo; r < hi; r++) {
    pthread_join(k[r].th, NULL);
    cr_assert_eq(k[r].rc, SHARDD_OK, "rank %d: %s", r, k[r].msg);
  }
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

/* Node 1's daemon (stopped) back with extra arguments, its ranks
 * relaunched; fresh: they write their initial values. */
static void rj_restart_node1(test_daemon pair[2], ck_job *j, const char *job,
                             const char *timeout, const char *const *extra, int fresh) {
  start_node(&pair[1], &scr, job, 1, timeout, extra);
  rj_attach(pair, job, fresh, j, 1);
}

/* A node's daemon restarted on 2 nodes x 2 ranks, AdamW with clipping every other
 * step: node 1's daemon is stopped (SIGTERM, --checkpoint-on-exit) after
 * step 3 while node 0's ranks wait in step 4's first scatter; they get
 * E_PEER_LOST and retry the iteration, which waits for the fabric to
 * re-form. Node 1's daemon comes back with --restore of its exit part
 * (DIR/rj/node-1, no job manifest), its ranks relaunch and attach to the
 * restored buffers, and all four train on to step 6: every rank's final
 * parameters equal an uninterrupted 6-step run bit for bit, and so do the
 * optimizer's steps. */
Test(fabric, a_node_daemon_restart_rejoins_the_job_bit_for_bit, .timeout = 120) {
  const char *jobs[] = {"rj"};
  test_daemon pair[2];

  /* the reference: an uninterrupted run */
  start_pair(pair, &scr, jobs, 1, "30");
  ck_job j;
  ck_attach(pair, "rj", 1, &j);
  ck_steps(&j, 1, RJ_N);
  float *ref[2][W];
  ck_final(&j, ref);
  test_daemon_finish(&pair[0]);
  test_daemon_finish(&pair[1]);

  char ex[160];
  snprintf(ex, sizeof ex, "%s/exit", scr.dir);
  const char *exit_args[] = {"--checkpoint-on-exit", ex, NULL};
  start_pair_each(pair, &scr, jobs, 1, "30", exit_args, exit_args);
  rj_attach_all(pair, "rj", 1, &j);
  rj_rank k[W];
  rj_start(k, &j, 0, W, 1, RJ_AT);
  rj_expect_ok(k, 0, W);
  /* node 0's ranks go on into step 4 and wait there for node 1's */
  rj_start(k, &j, 0, 2, RJ_AT + 1, RJ_N);
  wait_running(&pair[0], "big"); /* node 0's ranks are inside step 4 */
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
  start_node(&pair[1], &scr, "rj", 1, "30", back);
  double t_back = test_mono_s();
  rj_attach(pair, "rj", 0, &j, 1);
  rj_start(k, &j, 2, W, RJ_AT + 1, RJ_N);
  rj_expect_ok(k, 0, W);
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
  expect_bit_for_bit(ref, got, &j, "rejoined");
  free_run(ref);
  cr_log_info("fabric: 2 nodes x 2 ranks, node 1's daemon restarted after step %d: "
              "steps %d..%d bit for bit with the uninterrupted run", RJ_AT, RJ_AT + 1,
              RJ_N);
  test_daemon_finish(&pair[0]);
  test_daemon_finish(&pair[1]);
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
  const char *jobs[] = {"rf"};
  test_daemon pair[2];
  char ex[160], old[160];
  snprintf(ex, sizeof ex, "%s/exit", scr.dir);
  snprintf(old, sizeof old, "%s/old", scr.dir);
  const char *exit_args[] = {"--checkpoint-on-exit", ex, NULL};
  start_pair_each(pair, &scr, jobs, 1, "4", exit_args, exit_args);
  ck_job j;
  rj_attach_all(pair, "rf", 1, &j);
  rj_rank k[W];
  rj_start(k, &j, 0, W, 1, 2);
  rj_expect_ok(k, 0, W);

  /* node 1 restarts while every rank is idle: steps 3..4 go on */
  rj_stop_node1(pair, &j);
  char cmd[400];
  snprintf(cmd, sizeof cmd, "cp -a '%s' '%s'", ex, old); /* step 2's part */
  ck_sh(cmd);
  const char *back[] = {"--checkpoint-on-exit", ex, KEEP_RESTORED, "--restore", ex,
                        NULL};
  rj_restart_node1(pair, &j, "rf", "4", back, 0);
  rj_start(k, &j, 0, W, 3, 4);
  rj_expect_ok(k, 0, W);

  /* node 1 restarts from step 2's part while node 0 holds step 4 */
  rj_stop_node1(pair, &j);
  const char *stale[] = {KEEP_RESTORED, "--restore", old, NULL};
  rj_restart_node1(pair, &j, "rf", "4", stale, 0);
  rj_start(k, &j, 0, W, 5, 5);
  rj_join(k, 0, W);
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
  rj_restart_node1(pair, &j, "rf", "4", NULL, 1);
  rj_start(k, &j, 0, W, 5, 5);
  rj_join(k, 0, W);
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
  rj_start_n(k, &j, 0, 2, 5, 5, 0);
  rj_join(k, 0, 2);
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
}

/* docs/multi-node.md "A node's daemon killed", its procedure as scripts/recover_job.sh
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
  char cka[160];
  snprintf(cka, sizeof cka, "%s/ck-a", scr.dir);
  const char *jobs[] = {"ck"};
  const char *keep[] = {KEEP_RESTORED, NULL};
  test_daemon pair[2];
  start_pair_each(pair, &scr, jobs, 1, "60", keep, keep);
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
  kill_node1(pair);
  call calls[2];
  calls_start(calls, 2, j.c, OP_GATHER, j.info[0], NULL);
  calls_join(calls, 2);
  calls_start(calls, 2, j.c, OP_GATHER, j.info[0], NULL);
  wait_running(&pair[0], "big");

  /* node 0's trainers stop; node 1's daemon restarts (Restart=) */
  double t0 = test_mono_s();
  cr_assert_eq(cut_connections_to(pair[0].sock), 2);
  calls_join(calls, 2);
  for (int r = 0; r < W; r++)
    shardd_close(j.c[r]);
  test_daemon_stop(&pair[1]);
  start_node(&pair[1], &scr, "ck", 1, "60", keep);

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
  rj_attach_all(pair, "ck", 0, &j);
  for (int r = 0; r < W; r++) {
    uint64_t at = 0;
    cr_assert(shardd_resumed(j.c[r], &at), "rank %d is not told it resumes", r);
    cr_assert_eq(at, CK_AT, "rank %d told it resumes at step %" PRIu64, r, at);
  }
  rj_rank k[W];
  rj_start_n(k, &j, 0, W, CK_AT + 1, CK_N, 0);
  rj_expect_ok(k, 0, W);
  for (int b = 0; b < 2; b++) {
    call g[W];
    calls_start(g, W, j.c, OP_GATHER, j.info[b], NULL);
    calls_join(g, W);
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
}
