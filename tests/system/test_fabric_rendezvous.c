/* test_fabric_rendezvous.c — who joins a multi-node job and how a
 * rendezvous ends: a job spec is its uid's only, restored or not; a
 * stopping daemon aborts the fabric; the rendezvous directory is the
 * daemon's alone. */
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
#include "fabric_fixture.h"
#include "registry.h"

TestSuite(fabric, .init = fabric_setup, .fini = fabric_teardown);

/* A child process (0 in it), or the test fails. */
static pid_t fork_or_fail(void) {
  pid_t pid = fork();
  cr_assert(pid >= 0);
  return pid;
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
  if (geteuid() != 0)
    cr_skip_test("needs root to act as two uids");
  cr_assert_eq(chmod(scr.dir, 0755), 0);
  char att[128], spec_vj[256], spec_open[256];
  snprintf(att, sizeof att, "%s/att", scr.dir);
  cr_assert_eq(mkdir(att, 0700), 0);
  cr_assert_eq(chown(att, 1001, 1001), 0);
  write_own_part(att, "vj", 1001);
  write_own_part(att, "open", 1001);
  write_spec_uid(&scr, "vj", 1002, spec_vj, sizeof spec_vj);
  write_spec_uid(&scr, "open", -1, spec_open, sizeof spec_open);
  test_daemon d;
  test_daemon_start(&d, (const char *const[]){"--backend", "host", "--devices", "2",
                                              "--job-linger", "0", "--job-spec", spec_vj,
                                              "--job-spec", spec_open, NULL});
  test_daemon_open_to_all(&d);

  pid_t pid = fork_or_fail();
  if (pid == 0)
    _exit(attacker_restore(d.sock, att, "vj", SHARDD_E_PERMISSION, "for uid 1002's job"));
  expect_child(pid, "uid 1001 restoring \"vj\" under uid 1002's spec");
  if ((pid = fork_or_fail()) == 0)
    _exit(attacker_hello(d.sock));
  expect_child(pid, "uid 1001's Hello of \"vj\", which uid 1002's spec does not lay out");

  int ready[2], go[2];
  pid_t victim = test_fork_with_pipes(ready, go);
  if (victim == 0)
    _exit(victim_holds(d.sock, ready[1], go[0]));
  char b;
  cr_assert_eq(read(ready[0], &b, 1), 1, "the victim never joined \"open\"");
  if ((pid = fork_or_fail()) == 0)
    _exit(attacker_restore(d.sock, att, "open", SHARDD_E_BUSY, "gives no uid"));
  expect_child(pid, "uid 1001 restoring \"open\" while uid 1002's holds its spec");
  cr_assert_eq(write(go[1], &b, 1), 1);
  expect_child(victim, "the victim");
  close(ready[0]);
  close(go[1]);

  /* the daemon kept none of the attacker's jobs */
  shardd_client_t *ctl = test_connect(&d, NULL, 0, 0);
  char *text = NULL;
  cr_assert_eq(shardd_status_text(ctl, &text), SHARDD_OK);
  cr_expect(strstr(text, "uid 1001") == NULL, "%s", text);
  shardd_free(text);
  shardd_close(ctl);
  test_daemon_finish(&d);
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
  if (geteuid() != 0)
    cr_skip_test("needs root to act as two uids");
  cr_assert_eq(chmod(scr.dir, 0755), 0);
  test_daemon d[2];
  static char spec[2][2][256];
  for (int n = 0; n < 2; n++) {
    write_x_spec(&scr, n, 1001, spec[n][0], sizeof spec[n][0]);
    write_x_spec(&scr, n, 1002, spec[n][1], sizeof spec[n][1]);
    test_daemon_start(&d[n], (const char *const[]){
                                 "--backend", "host", "--devices", "2",
                                 "--collective-timeout", "2", "--job-linger", "0",
                                 "--job-spec", spec[n][0], "--job-spec", spec[n][1], NULL});
    test_daemon_open_to_all(&d[n]);
  }
  pid_t a = fork_or_fail();
  if (a == 0)
    _exit(x_ranks(d[0].sock, 1001, 0, 1.0f, 2.0f));
  pid_t v = fork_or_fail();
  if (v == 0)
    _exit(x_ranks(d[1].sock, 1002, 1, 2.0f, 1.0f));
  expect_child(a, "uid 1001's \"x\" on node 0");
  expect_child(v, "uid 1002's \"x\" on node 1");
  test_daemon_finish(&d[0]);
  test_daemon_finish(&d[1]);
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

/* Waits until node 0 has begun the rendezvous. */
static void wait_announced(void) {
  for (double end = test_mono_s() + TEST_HANG_S; !announced(scr.rdv, 0);) {
    cr_assert_lt(test_mono_s(), end, "node 0 never began the rendezvous in %s", scr.rdv);
    test_sleep_ms(10);
  }
}

/* Node 0's daemon of job (node 1's never starts), under timeout, and its
 * ranks 0 and 1, each with "w" of 100 floats. */
static void lone_node(test_daemon *d, const char *job, const char *timeout,
                      shardd_client_t *c[2], shardd_buffer_info info[2]) {
  char spec[256];
  write_spec(&scr, job, 0, spec, sizeof spec);
  const char *args[] = {"--backend", "host", "--devices", "2", "--collective-timeout",
                        timeout, "--job-spec", spec, NULL};
  test_daemon_start(d, args);
  join_ranks_w(d, job, 2, 100, c, info);
}

/* Ranks 0 and 1 gather; ranks 2 and 3 (node 1) never come, and node 1's
 * daemon never joins: the collective fails at the rendezvous timeout with
 * the missing node named, and the daemon answers status meanwhile. */
Test(fabric, missing_node_named_at_rendezvous_timeout, .timeout = 60) {
  /* 5 s: the test waits for it; a status must come back within it, which
   * is far from what a status takes even on a loaded machine */
  test_daemon d;
  shardd_client_t *c[2];
  shardd_buffer_info info[2];
  lone_node(&d, "lonely", "5", c, info);
  call calls[2];
  double t0 = test_mono_s();
  calls_start(calls, 2, c, OP_GATHER, info, NULL);
  /* status answers while the rendezvous waits (it once waited with it):
   * asked once the rendezvous is under way, it must still show the gather
   * in flight and node 1 not contacted, i.e. answer before the rendezvous
   * failed, not after */
  wait_announced();
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
  calls_join(calls, 2);
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
}

/* The collective timeout is an hour: the pending gathers can only fail by
 * the survivor noticing its dead peer, and the test's timeout is the hang
 * guard. */
Test(fabric, killed_daemon_fails_pending_collectives_survivor_serves, .timeout = 60) {
  test_daemon pair[2];
  const char *jobs[] = {"doomed"};
  start_pair(pair, &scr, jobs, 1, "3600");
  shardd_client_t *c[W];
  shardd_buffer_info info[W];
  join_ranks_w(pair, "doomed", W, 4000, c, info);
  all_ranks(c, OP_GATHER, info[0].id, 0, NULL); /* the fabric is up */

  /* node 0's ranks gather; node 1's daemon dies before its ranks do */
  call calls[2];
  calls_start(calls, 2, c, OP_GATHER, info, NULL);
  test_sleep_ms(300);
  double t0 = test_mono_s();
  kill_node1(pair);
  calls_join(calls, 2);
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
  calls_start(calls, 2, o, OP_GATHER, oi, NULL);
  calls_join(calls, 2);
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
}

/* ---- aborting the fabric (a stopping daemon) ------------------------------ */

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

/* Both nodes' fabrics formed in rdv, each created on its own thread. */
static void anodes_create(anode a[2], const char *rdv) {
  memset(a, 0, 2 * sizeof *a);
  for (uint32_t k = 0; k < 2; k++) {
    a[k].rdv = rdv;
    a[k].node = k;
    cr_assert_eq(pthread_create(&a[k].th, NULL, anode_create, &a[k]), 0);
  }
  for (uint32_t k = 0; k < 2; k++) {
    pthread_join(a[k].th, NULL);
    cr_assert_eq(a[k].rc, SHARDD_OK, "node %u: %s", k, a[k].msg);
  }
}

/* Node 0 waits in an allgather its peer never makes; the abort ends it
 * with E_SHUTDOWN and the reason, far inside the 30 s timeout, and every
 * later operation (allgather, reduce-scatter) fails at once alike. The
 * peer, waiting in an operation of its own, gets E_PEER_LOST when node 0's
 * fabric is destroyed. */
Test(fabric, abort_ends_waiting_operations_at_once, .timeout = 60) {
  anode a[2];
  anodes_create(a, scr.rdv);
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
}

/* SIGTERM while the rendezvous waits for a node that never comes: the
 * daemon stops at once (not at the 30 s timeout) and its ranks hear why. */
Test(fabric, sigterm_during_the_rendezvous_exits_at_once, .timeout = 60) {
  test_daemon d;
  shardd_client_t *c[2];
  shardd_buffer_info info[2];
  lone_node(&d, "alone", "30", c, info);
  call calls[2];
  calls_start(calls, 2, c, OP_GATHER, info, NULL);
  wait_announced();
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
  if (geteuid() != 0)
    cr_skip_test("needs root to stand for the daemon and another uid");
  cr_assert_eq(chmod(scr.dir, 0755), 0);
  char precious[128], msg[512];
  snprintf(precious, sizeof precious, "%s/precious", scr.dir);
  FILE *pf = fopen(precious, "w");
  cr_assert_not_null(pf);
  fputs("root's own\n", pf);
  fclose(pf);
  const mode_t modes[] = {0777, 01777};
  for (size_t m = 0; m < 2; m++) {
    char cmd[320];
    snprintf(cmd, sizeof cmd, "rm -rf '%s' && mkdir '%s'", scr.rdv, scr.rdv);
    cr_assert_eq(system(cmd), 0);
    cr_assert_eq(chmod(scr.rdv, modes[m]), 0);
    pid_t me = getpid(), pid = fork_or_fail();
    if (pid == 0)
      _exit(plant(scr.rdv, precious, me));
    int st;
    cr_assert(test_wait_exit(pid, &st));
    cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == 0, "planting failed: %d",
              WIFEXITED(st) ? WEXITSTATUS(st) : -1);
    shardd__fabric *f;
    shardd_err rc = node0_create(scr.rdv, &f, msg, sizeof msg);
    if (f)
      shardd__fabric_destroy(f);
    char *text = test_slurp(precious);
    cr_assert_not_null(text);
    cr_expect_str_eq(text, "root's own\n", "mode %04o: the planted symlink was followed",
                     (unsigned)modes[m]);
    free(text);
    cr_assert_eq(rc, SHARDD_E_PERMISSION, "mode %04o: %s: %s", (unsigned)modes[m],
                 shardd_err_name(rc), msg);
    cr_assert(strstr(msg, scr.rdv) && strstr(msg, "group or others") &&
                  strstr(msg, "refused"),
              "%s", msg);
  }
  cr_log_info("fabric: a world-writable rendezvous directory: %s", msg);
  char cmd[320];
  snprintf(cmd, sizeof cmd, "rm -rf '%s' && mkdir -m 0755 '%s'", scr.rdv, scr.rdv);
  cr_assert_eq(system(cmd), 0);
  shardd__fabric *f;
  cr_assert_eq(chown(scr.rdv, 1001, 1001), 0); /* another uid's, not writable by us all */
  cr_assert_eq(node0_create(scr.rdv, &f, msg, sizeof msg), SHARDD_E_PERMISSION, "%s", msg);
  cr_assert(strstr(msg, "its owner"), "%s", msg);
  cr_assert_eq(chown(scr.rdv, 0, 0), 0);
  char link[160];
  snprintf(link, sizeof link, "%s/via", scr.dir);
  cr_assert_eq(symlink(scr.rdv, link), 0);
  cr_assert_eq(node0_create(link, &f, msg, sizeof msg), SHARDD_E_PERMISSION, "%s", msg);
  cr_assert(strstr(msg, "symlink"), "%s", msg);

  /* the daemon's own directory: two nodes meet, and take their keys away */
  cr_assert_eq(chmod(scr.rdv, 0700), 0);
  anode a[2];
  anodes_create(a, scr.rdv);
  for (uint32_t k = 0; k < 2; k++)
    shardd__fabric_destroy(a[k].f);
  DIR *d = opendir(scr.rdv);
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
}
