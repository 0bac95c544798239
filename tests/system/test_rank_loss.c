/* test_rank_loss.c — a rank lost to a job: mid-collective, between
 * collectives (--peer-grace), SIGKILLed mid-gather, mid-scatter or
 * mid-step; its peers are told which rank, no byte of a shard or state
 * changes, and the relaunched rank continues. Ranks are libshardd clients
 * on threads, or raw wire clients in child processes where a test kills
 * one. */
#include <criterion/criterion.h>
#include <criterion/parameterized.h>
#include <float.h>
#include <math.h>
#include <pthread.h>

#include "harness.h"
#include "collective_fixture.h"

/* ---- what the tests share ------------------------------------------------ */

/* A rank's shard, reduced shard and gather area, as they were. */
typedef struct {
  unsigned char *shard, *reduced, *gather;
  size_t sb, gb;
} saved_areas;

static void areas_save(saved_areas *a, const shardd_buffer_info *b) {
  a->sb = b->shard_numel * 4;
  a->gb = b->padded_numel * 4;
  a->shard = malloc(a->sb);
  a->reduced = malloc(a->sb);
  a->gather = malloc(a->gb);
  memcpy(a->shard, b->shard, a->sb);
  memcpy(a->reduced, b->reduced, a->sb);
  memcpy(a->gather, b->gather, a->gb);
}

/* No byte of who's areas changed since areas_save; a is freed. */
static void areas_expect_kept(saved_areas *a, const shardd_buffer_info *b, const char *who) {
  cr_assert_eq(memcmp(a->shard, b->shard, a->sb), 0, "%s's shard changed", who);
  cr_assert_eq(memcmp(a->reduced, b->reduced, a->sb), 0, "%s's reduced shard changed", who);
  cr_assert_eq(memcmp(a->gather, b->gather, a->gb), 0, "%s's gather area changed", who);
  free(a->shard);
  free(a->reduced);
  free(a->gather);
}

/* A libshardd client of rank of job, connecting again until the daemon
 * lets a lost one's rank go. */
static shardd_client_t *connect_rank(const char *job, uint32_t rank, uint32_t world) {
  for (double end = test_mono_s() + TEST_HANG_S;;) {
    shardd_connect_opts o = SHARDD_CONNECT_OPTS_INIT;
    o.job = job;
    o.rank = rank;
    o.world = world;
    shardd_client_t *c;
    char err[256];
    if (shardd_connect(d.sock, &o, &c, err, sizeof err) == SHARDD_OK)
      return c;
    cr_assert_lt(test_mono_s(), end, "rank %u of %s cannot connect: %s", rank, job, err);
    test_sleep_ms(10);
  }
}

/* ---- a rank lost mid-collective ----------------------------------------- */

#define LOST_NUMEL 4099

static void child_rank3(const char *sock, int ready, int go, int kind) {
  shardd_connect_opts o = SHARDD_CONNECT_OPTS_INIT;
  o.job = "lost";
  o.rank = 3;
  o.world = 4;
  shardd_client_t *c;
  char err[256], ch = 0;
  if (shardd_connect(sock, &o, &c, err, sizeof err) != SHARDD_OK)
    _exit(10);
  shardd_buffer_info b;
  if (shardd_buffer_register(c, "g", SHARDD_DTYPE_FP32, LOST_NUMEL, &b) != SHARDD_OK)
    _exit(11);
  for (size_t i = 0; i < b.shard_numel; i++)
    ((float *)b.shard)[i] = (float)(3000000 + i);
  for (size_t j = 0; j < b.padded_numel; j++)
    put_grid(SHARDD_DTYPE_FP32, b.grad, j, grad_hash(3, j, 1));
  if (write(ready, "r", 1) != 1)
    _exit(12);
  shardd_err rc = kind == OP_GATHER ? shardd_gather(c, b.id)
                                    : shardd_scatter(c, b.id, SHARDD_REDUCE_SUM);
  if (rc != SHARDD_OK)
    _exit(13);
  if (write(ready, "s", 1) != 1)
    _exit(14);
  if (read(go, &ch, 1) != 1)
    _exit(15);
  _exit(0); /* gone without a word, mid-collective for the others */
}

typedef struct {
  int kind;
} lost_case;

ParameterizedTestParameters(collective, rank_lost_mid_collective) {
  static lost_case cases[] = {{OP_SCATTER}, {OP_GATHER}};
  return cr_make_param_array(lost_case, cases, 2);
}

ParameterizedTest(lost_case *lc, collective, rank_lost_mid_collective, .init = start4,
                  .fini = stop_daemon, .timeout = 60) {
  int ready[2], go[2];
  pid_t child = test_fork_with_pipes(ready, go);
  if (child == 0)
    child_rank3(d.sock, ready[1], go[0], lc->kind);

  test_raw r[3];
  shardd_buffer_info b[4];
  for (int k = 0; k < 3; k++) {
    test_raw_open(&d, &r[k]);
    test_raw_hello(&r[k], "lost", (uint32_t)k, 4);
    test_raw_register_buffer(&r[k], "g", SHARDD_DTYPE_FP32, LOST_NUMEL, &b[k]);
    for (size_t i = 0; i < b[k].shard_numel; i++)
      ((float *)b[k].shard)[i] = (float)(1000000 * k + (int)i);
    for (size_t j = 0; j < b[k].padded_numel; j++)
      put_grid(SHARDD_DTYPE_FP32, b[k].grad, j, grad_hash(k, j, 1));
  }
  char ch;
  cr_assert_eq(read(ready[0], &ch, 1), 1, "rank 3 did not get ready");
  /* one complete collective with rank 3, so the areas hold known data */
  uint64_t seq[3];
  for (int k = 0; k < 3; k++)
    seq[k] = lc->kind == OP_GATHER ? test_raw_send_gather(&r[k], b[0].id)
                                   : test_raw_send_scatter(&r[k], b[0].id, SHARDD_REDUCE_SUM);
  for (int k = 0; k < 3; k++)
    shardwire__response__free_unpacked(test_raw_expect(&r[k], seq[k], SHARDD_OK), NULL);
  cr_assert_eq(read(ready[0], &ch, 1), 1, "rank 3's first collective failed");
  uint64_t s = b[0].shard_numel;
  if (lc->kind == OP_SCATTER) {
    for (int k = 0; k < 3; k++)
      for (size_t i = 0; i < s; i++)
        cr_assert_eq(f32_at(b[k].reduced, i),
                     expected_reduced(4, (size_t)k * s + i, 1, SHARDD_REDUCE_SUM));
  } else {
    for (size_t j = 0; j < b[0].padded_numel; j++) {
      size_t q = j / s, i = j % s;
      cr_assert_eq(f32_at(b[1].gather, j), (float)(1000000 * (int)q + (int)i));
    }
  }

  /* New inputs, then the state right before the collective that will fail. */
  for (int k = 0; k < 3; k++) {
    for (size_t i = 0; i < s; i++)
      ((float *)b[k].shard)[i] = -(float)(1000000 * k + (int)i);
    for (size_t j = 0; j < b[k].padded_numel; j++)
      put_grid(SHARDD_DTYPE_FP32, b[k].grad, j, grad_hash(k, j, 9));
  }
  saved_areas sv[3];
  for (int k = 0; k < 3; k++)
    areas_save(&sv[k], &b[k]);
  /* ranks 0-2 submit and are known to be queued (the Pong comes after) */
  for (int k = 0; k < 3; k++) {
    seq[k] = lc->kind == OP_GATHER ? test_raw_send_gather(&r[k], b[0].id)
                                   : test_raw_send_scatter(&r[k], b[0].id, SHARDD_REDUCE_SUM);
    test_raw_sync(&r[k]);
  }
  /* rank 3 dies */
  cr_assert_eq(write(go[1], "g", 1), 1);
  int st;
  cr_assert_eq(waitpid(child, &st, 0), child);
  cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == 0, "rank 3 child exited %d",
            WIFEXITED(st) ? WEXITSTATUS(st) : -1);
  close(ready[0]);
  close(go[1]);
  for (int k = 0; k < 3; k++) {
    Shardwire__Response *resp = test_raw_expect(&r[k], seq[k], SHARDD_E_PEER_LOST);
    cr_assert_not_null(strstr(resp->message, "rank 3"), "rank %d: \"%s\" does not name rank 3",
                       k, resp->message);
    shardwire__response__free_unpacked(resp, NULL);
  }
  for (int k = 0; k < 3; k++) {
    char who[32];
    snprintf(who, sizeof who, "rank %d", k);
    areas_expect_kept(&sv[k], &b[k], who);
  }
  /* rank 3's block is intact too: a new rank 3 attaches and looks */
  shardd_client_t *c3 = connect_rank("lost", 3, 4);
  shardd_buffer_info b3;
  cr_assert_eq(shardd_buffer_register(c3, "g", SHARDD_DTYPE_FP32, LOST_NUMEL, &b3), SHARDD_OK);
  cr_assert(!b3.created);
  for (size_t i = 0; i < s; i++) {
    cr_assert_eq(f32_at(b3.shard, i), (float)(3000000 + i), "rank 3 shard[%zu]", i);
    if (lc->kind == OP_SCATTER)
      cr_assert_eq(f32_at(b3.reduced, i),
                   expected_reduced(4, 3 * s + i, 1, SHARDD_REDUCE_SUM), "rank 3 reduced[%zu]", i);
  }
  /* and the job trains on: a full collective with the new rank 3 */
  for (int k = 0; k < 3; k++)
    seq[k] = test_raw_send_gather(&r[k], b[0].id);
  cr_assert_eq(shardd_gather(c3, b3.id), SHARDD_OK, "%s", shardd_last_error(c3));
  for (int k = 0; k < 3; k++)
    shardwire__response__free_unpacked(test_raw_expect(&r[k], seq[k], SHARDD_OK), NULL);
  for (size_t i = 0; i < s; i++)
    cr_assert_eq(f32_at(b3.gather, i), -(float)i);
  shardd_client_t *ctl = test_connect(&d, NULL, 0, 1);
  char *js;
  cr_assert_eq(shardd_status_json(ctl, &js), SHARDD_OK);
  tj *j = tj_parse(js);
  cr_assert_not_null(j);
  const tj *jobs = tj_need(j, "jobs", TJ_ARR);
  cr_assert_eq(jobs->n, 1);
  cr_assert_eq(tj_need(jobs->kids[0], "collectives_in_flight", TJ_NUM)->num, 0.0);
  tj_free(j);
  shardd_free(js);
  shardd_close(ctl);
  shardd_close(c3);
  for (int k = 0; k < 3; k++)
    test_raw_close(&r[k]);
}

Test(collective, rank_never_arrives_times_out, .init = start4_timeout, .fini = stop_daemon, .timeout = 60) {
  team t;
  team_open(&t, "slow", 4);
  shardd_buffer_info b[MAXW];
  team_buffer(&t, "g", SHARDD_DTYPE_FP32, 1000, b);
  fill_shards(b, 4, 3);
  fill_grads(b, 4, 3);
  unsigned char *sv[MAXW];
  for (int r = 0; r < 4; r++) {
    sv[r] = malloc(b[r].shard_numel * 4);
    memcpy(sv[r], b[r].reduced, b[r].shard_numel * 4);
  }
  call calls[MAXW];
  memset(calls, 0, sizeof calls);
  for (int r = 0; r < 3; r++) { /* rank 3 is connected but never calls */
    calls[r].c = t.c[r];
    calls[r].kind = OP_SCATTER;
    calls[r].id = b[0].id;
  }
  run_calls(calls, 3);
  for (int r = 0; r < 3; r++) {
    cr_assert_eq(calls[r].rc, SHARDD_E_PEER_LOST, "rank %d: %s: %s", r,
                 shardd_err_name(calls[r].rc), calls[r].msg);
    cr_assert_not_null(strstr(calls[r].msg, "timed out"), "rank %d: \"%s\"", r, calls[r].msg);
    cr_assert_not_null(strstr(calls[r].msg, "rank 3"), "rank %d: \"%s\"", r, calls[r].msg);
  }
  for (int r = 0; r < 4; r++) {
    cr_assert_eq(memcmp(sv[r], b[r].reduced, b[r].shard_numel * 4), 0);
    free(sv[r]);
  }
  for (int r = 0; r < 4; r++)
    cr_assert_eq(shardd_ping(t.c[r]), SHARDD_OK);
  team_close(&t);
}

/* ---- a rank killed between collectives (--peer-grace) ------------------- */

#define PEER_NUMEL 1001

static void start_grace1(void) {
  const char *args[] = {"--devices", "4", "--peer-grace", "1", NULL};
  test_daemon_start(&d, args);
}

static void start_grace3(void) {
  const char *args[] = {"--devices", "4", "--peer-grace", "3", NULL};
  test_daemon_start(&d, args);
}

/* Rank 1 of job "between" (world 2) in a process of its own: it registers
 * "p", writes 'r', gathers once with rank 0 when gather_once, writes 'g',
 * then waits to be killed. A relaunch (gather_once 0) connects as soon as
 * the daemon has let the dead one's rank go, attaches, writes 'r', and on
 * 'g' from go gathers and checks the bytes: exit 0 when all held. */
static void child_rank1(const char *sock, int ready, int go, int first) {
  shardd_connect_opts o = SHARDD_CONNECT_OPTS_INIT;
  o.job = "between";
  o.rank = 1;
  o.world = 2;
  shardd_client_t *c = NULL;
  char err[256], ch = 0;
  for (double end = test_mono_s() + TEST_HANG_S;;) {
    if (shardd_connect(sock, &o, &c, err, sizeof err) == SHARDD_OK)
      break;
    if (test_mono_s() > end)
      _exit(10);
    test_sleep_ms(5);
  }
  shardd_buffer_info b;
  if (shardd_buffer_register(c, "p", SHARDD_DTYPE_FP32, PEER_NUMEL, &b) != SHARDD_OK)
    _exit(11);
  if (b.created != first)
    _exit(12);
  for (size_t i = 0; i < b.shard_numel; i++)
    ((float *)b.shard)[i] = (float)(1000000 + i);
  if (write(ready, "r", 1) != 1)
    _exit(13);
  if (first) {
    if (shardd_gather(c, b.id) != SHARDD_OK)
      _exit(14);
    if (write(ready, "g", 1) != 1)
      _exit(15);
    for (;;)
      pause(); /* SIGKILL: gone between collectives */
  }
  if (read(go, &ch, 1) != 1)
    _exit(16);
  if (shardd_gather(c, b.id) != SHARDD_OK)
    _exit(17);
  for (size_t j = 0; j < b.padded_numel; j++) {
    size_t s = b.shard_numel;
    float want = j < s ? (float)j : (float)(1000000 + (j - s));
    if (f32_at(b.gather, j) != want)
      _exit(18);
  }
  _exit(0);
}

static pid_t spawn_rank1(int ready[2], int go[2], int first) {
  pid_t pid = test_fork_with_pipes(ready, go);
  if (pid == 0)
    child_rank1(d.sock, ready[1], go[0], first);
  return pid;
}

static void close_pipes(int ready[2], int go[2]) {
  close(ready[0]);
  close(go[1]);
}

/* Rank 0 as a raw client (so it can see a reply come or not), its shard
 * 0, 1, 2, ...; and a first gather with the first rank 1. */
static void rank0_and_a_live_rank1(test_raw *r0, shardd_buffer_info *b0,
                                   int ready[2], int go[2], pid_t *child) {
  *child = spawn_rank1(ready, go, 1);
  char ch;
  cr_assert_eq(read(ready[0], &ch, 1), 1, "rank 1 did not get ready");
  test_raw_open(&d, r0);
  test_raw_hello(r0, "between", 0, 2);
  test_raw_register_buffer(r0, "p", SHARDD_DTYPE_FP32, PEER_NUMEL, b0);
  for (size_t i = 0; i < b0->shard_numel; i++)
    ((float *)b0->shard)[i] = (float)i;
  uint64_t seq = test_raw_send_gather(r0, b0->id);
  shardwire__response__free_unpacked(test_raw_expect(r0, seq, SHARDD_OK), NULL);
  cr_assert_eq(read(ready[0], &ch, 1), 1, "rank 1's gather failed");
}

static void kill_rank(pid_t child) {
  cr_assert_eq(kill(child, SIGKILL), 0);
  int st;
  cr_assert_eq(waitpid(child, &st, 0), child);
}

/* rank0_and_a_live_rank1, then rank 1 SIGKILLed between collectives:
 * when it was killed. */
static double rank1_killed_after_a_gather(test_raw *r0, shardd_buffer_info *b0,
                                          int ready[2], int go[2]) {
  pid_t child;
  rank0_and_a_live_rank1(r0, b0, ready, go, &child);
  kill_rank(child);
  double t0 = test_mono_s();
  close_pipes(ready, go);
  return t0;
}

/* Rank 1 relaunched (attaching to its buffer), ready to gather on 'g'. */
static pid_t relaunch_rank1(int ready[2], int go[2]) {
  pid_t child = spawn_rank1(ready, go, 0);
  char ch;
  cr_assert_eq(read(ready[0], &ch, 1), 1, "the relaunched rank 1 did not get ready");
  return child;
}

/* The relaunched rank 1 (child) gathers: rank 0's gather seq completes
 * with both ranks' bytes, rank 1's checks held, and rank 0 closes. */
static void gather_with_the_relaunched_rank1(test_raw *r0, const shardd_buffer_info *b0,
                                             uint64_t seq, pid_t child, int ready[2],
                                             int go[2]) {
  cr_assert_eq(write(go[1], "g", 1), 1);
  shardwire__response__free_unpacked(test_raw_expect(r0, seq, SHARDD_OK), NULL);
  for (size_t j = 0; j < b0->padded_numel; j++) {
    size_t s = b0->shard_numel;
    cr_assert_eq(f32_at(b0->gather, j), j < s ? (float)j : (float)(1000000 + (j - s)));
  }
  int st;
  cr_assert_eq(waitpid(child, &st, 0), child);
  cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == 0, "relaunched rank 1 exited %d",
            WIFEXITED(st) ? WEXITSTATUS(st) : -1);
  close_pipes(ready, go);
  test_raw_close(r0);
}

/* Killed between collectives, under the default --collective-timeout of
 * 300 s: rank 0's next gather fails E_PEER_LOST naming rank 1 once the 1 s
 * grace is over (not before, and within 2 s past it), the one after that
 * at once, and the loss is logged. A relaunched rank 1, back long after
 * the grace, trains on with rank 0. */
Test(collective, rank_killed_between_collectives_fails_the_next_fast,
     .init = start_grace1, .fini = stop_daemon, .timeout = 60) {
  int ready[2], go[2];
  test_raw r0;
  shardd_buffer_info b0;
  double t0 = rank1_killed_after_a_gather(&r0, &b0, ready, go);
  uint64_t seq = test_raw_send_gather(&r0, b0.id);
  Shardwire__Response *resp = test_raw_expect(&r0, seq, SHARDD_E_PEER_LOST);
  double took = test_mono_s() - t0;
  cr_log_info("pending gather failed %.3f s after the kill (grace 1 s)", took);
  cr_assert_not_null(strstr(resp->message, "rank 1 of job \"between\" disconnected"),
                     "%s", resp->message);
  cr_assert_not_null(strstr(resp->message, "--peer-grace"), "%s", resp->message);
  shardwire__response__free_unpacked(resp, NULL);
  cr_assert_geq(took, 0.9, "failed %.3f s after the kill, inside the 1 s grace", took);
  cr_assert_lt(took, 1.0 + 2.0, "failed %.3f s after the kill (grace 1 s)", took);
  /* past the grace the next one fails at once */
  t0 = test_mono_s();
  seq = test_raw_send_gather(&r0, b0.id);
  shardwire__response__free_unpacked(test_raw_expect(&r0, seq, SHARDD_E_PEER_LOST), NULL);
  took = test_mono_s() - t0;
  cr_log_info("next gather failed after %.3f s", took);
  cr_assert_lt(took, 2.0, "the next collective failed after %.3f s", took);
  cr_assert(test_daemon_log_has(&d, "peer lost"), "the loss is not in the log");
  /* a relaunched rank 1 rejoins: the job trains again */
  pid_t child = relaunch_rank1(ready, go);
  seq = test_raw_send_gather(&r0, b0.id);
  gather_with_the_relaunched_rank1(&r0, &b0, seq, child, ready, go);
}

/* Killed, then relaunched within the 3 s grace: rank 0's gather, waiting
 * meanwhile, is not failed even once the grace is over, and completes with
 * both ranks' bytes when the new rank 1 gathers. While it waits, status
 * shows rank 1 missing and the gather's arrivals. */
Test(collective, rank_back_within_the_grace_fails_nobody, .init = start_grace3,
     .fini = stop_daemon, .timeout = 60) {
  int ready[2], go[2];
  test_raw r0;
  shardd_buffer_info b0;
  double t0 = rank1_killed_after_a_gather(&r0, &b0, ready, go);
  uint64_t seq = test_raw_send_gather(&r0, b0.id);
  Shardwire__Response *early;
  test_raw_sync_keep(&r0, &early);
  cr_assert_null(early, "the gather was answered inside the grace");

  /* status: who is missing, what the gather waits on (the close came on
   * another socket than the gather, so it may be read a little later) */
  shardd_client_t *ctl = test_connect(&d, NULL, 0, 1);
  tj *j = NULL;
  const tj *job = NULL;
  for (double end = test_mono_s() + 2.0;;) {
    char *js;
    cr_assert_eq(shardd_status_json(ctl, &js), SHARDD_OK);
    tj_free(j);
    j = tj_parse(js);
    shardd_free(js);
    cr_assert_not_null(j);
    job = tj_need(j, "jobs", TJ_ARR)->kids[0];
    if (tj_need(job, "missing_ranks", TJ_ARR)->n == 1)
      break;
    cr_assert_lt(test_mono_s(), end, "status never showed rank 1 missing");
    test_sleep_ms(10);
  }
  const tj *conn = tj_need(job, "connected_ranks", TJ_ARR);
  cr_assert_eq(conn->n, 1);
  cr_assert_eq(conn->kids[0]->num, 0.0);
  cr_assert_eq(tj_need(job, "missing_ranks", TJ_ARR)->kids[0]->num, 1.0);
  double gone = tj_need(job, "missing_for_s", TJ_ARR)->kids[0]->num;
  cr_assert(gone >= 0 && gone < 3.0, "rank 1 gone for %.3f s", gone);
  const tj *colls = tj_need(job, "collectives", TJ_ARR);
  cr_assert_eq(colls->n, 1);
  const tj *c0 = colls->kids[0];
  cr_assert_str_eq(tj_need(c0, "kind", TJ_STR)->str, "gather");
  cr_assert_eq(tj_need(c0, "target", TJ_NUM)->num, (double)b0.id);
  cr_assert_str_eq(tj_need(c0, "name", TJ_STR)->str, "p");
  cr_assert_eq(tj_need(c0, "running", TJ_BOOL)->boolean, 0);
  const tj *arr = tj_need(c0, "arrived", TJ_ARR), *wf = tj_need(c0, "waiting_for", TJ_ARR);
  cr_assert_eq(arr->n, 1);
  cr_assert_eq(arr->kids[0]->num, 0.0);
  cr_assert_eq(wf->n, 1);
  cr_assert_eq(wf->kids[0]->num, 1.0);
  tj_free(j);
  char *text;
  cr_assert_eq(shardd_status_text(ctl, &text), SHARDD_OK);
  cr_assert_not_null(strstr(text, "ranks connected: 0 missing: 1"), "%s", text);
  cr_assert_not_null(strstr(text, "rank 1: disconnected"), "%s", text);
  cr_assert_not_null(strstr(text, "collective gather buffer"), "%s", text);
  cr_assert_not_null(strstr(text, "arrived 0, waiting for 1"), "%s", text);
  shardd_free(text);

  /* the relaunch, inside the grace */
  pid_t child = relaunch_rank1(ready, go);
  double back = test_mono_s() - t0;
  cr_log_info("rank 1 back %.3f s after the kill (grace 3 s)", back);
  cr_assert_lt(back, 3.0, "the relaunch took %.3f s, past the grace", back);
  /* past the grace: nothing failed, rank 1 shows connected again */
  while (test_mono_s() < t0 + 4.0)
    test_sleep_ms(50);
  char *js;
  cr_assert_eq(shardd_status_json(ctl, &js), SHARDD_OK);
  j = tj_parse(js);
  shardd_free(js);
  job = tj_need(j, "jobs", TJ_ARR)->kids[0];
  cr_assert_eq(tj_need(job, "connected_ranks", TJ_ARR)->n, 2);
  cr_assert_eq(tj_need(job, "missing_ranks", TJ_ARR)->n, 0);
  cr_assert_eq(tj_need(job, "collectives", TJ_ARR)->n, 1, "the gather still waits");
  tj_free(j);
  shardd_close(ctl);
  gather_with_the_relaunched_rank1(&r0, &b0, seq, child, ready, go);
}

/* ---- a trainer SIGKILLed mid-gather, mid-scatter, mid-step ---------------
 * Job "killed", world 3: ranks 0 and 1 are raw clients of this process,
 * rank 2 a process of its own, SIGKILLed mid-collective in one of two
 * orders, both arranged without timing:
 *  - victim_waits: rank 2 sends the collective and blocks in it; the
 *    daemon's status shows it in flight; SIGKILL; then ranks 0 and 1
 *    send theirs.
 *  - others_wait: ranks 0 and 1 send theirs and are known queued (the
 *    Pong after them); rank 2, connected and idle, is SIGKILLed.
 * Ranks 0 and 1 get E_PEER_LOST naming rank 2; no byte of any rank's
 * shard, reduced or gather area and no optimizer state or step count
 * changes; another job is served meanwhile; a relaunched rank 2 finds its
 * shard intact and the job runs the collective with it. */

#define KILL_NUMEL 3001

typedef struct {
  int kind;
  int victim_waits;
} kill_case;

/* rank 2: attach, say 'r'; on 'g' run the collective (blocks: the others
 * have not sent theirs); killed before it returns */
static void victim(int ready, int go, int kind, uint64_t opt) {
  shardd_client_t *c = connect_rank("killed", 2, 3);
  shardd_buffer_info b;
  if (shardd_buffer_register(c, "P", SHARDD_DTYPE_FP32, KILL_NUMEL, &b) != SHARDD_OK)
    _exit(11);
  char ch;
  if (write(ready, "r", 1) != 1 || read(go, &ch, 1) != 1)
    _exit(12);
  shardd_err rc = kind == OP_GATHER    ? shardd_gather(c, b.id)
                  : kind == OP_SCATTER ? shardd_scatter(c, b.id, SHARDD_REDUCE_MEAN)
                                       : shardd_step(c, opt, NULL, NULL);
  _exit(rc == SHARDD_OK ? 13 : 14); /* it must not come back: killed inside */
}

static uint64_t kill_send(test_raw *r, int kind, uint64_t buf, uint64_t opt) {
  return kind == OP_GATHER    ? test_raw_send_gather(r, buf)
         : kind == OP_SCATTER ? test_raw_send_scatter(r, buf, SHARDD_REDUCE_MEAN)
                              : test_raw_send_step(r, opt);
}

ParameterizedTestParameters(collective, rank_sigkilled_mid_collective) {
  static kill_case cases[] = {{OP_GATHER, 1}, {OP_SCATTER, 1}, {OP_STEP, 1},
                              {OP_GATHER, 0}, {OP_SCATTER, 0}, {OP_STEP, 0}};
  return cr_make_param_array(kill_case, cases, sizeof cases / sizeof cases[0]);
}

ParameterizedTest(kill_case *kc, collective, rank_sigkilled_mid_collective,
                  .init = start_grace1, .fini = stop_daemon, .timeout = 60) {
  const char *what = kc->kind == OP_GATHER ? "gather" : kc->kind == OP_SCATTER ? "scatter" : "step";
  /* a trained job: one scatter, SGD-momentum step and gather by all three */
  team t;
  team_open(&t, "killed", 3);
  shardd_buffer_info tb[MAXW];
  team_buffer(&t, "P", SHARDD_DTYPE_FP32, KILL_NUMEL, tb);
  ref_hp h = {SHARDD_OPTIM_SGD, 0.25, 0.5, 0, 0, 0, 0, 0, 0, 0, 0};
  shardd_hparams top;
  hp_set(&top, &h);
  shardd_param_ref refs[] = {{tb[0].id, "P"}};
  shardd_param_group g = {refs, 1, {0}};
  uint64_t opt, buf = tb[0].id;
  team_optimizer(&t, "o", SHARDD_OPTIM_SGD, &top, &g, 1, &opt);
  for (int r = 0; r < 3; r++)
    for (size_t i = 0; i < tb[r].shard_numel; i++)
      ((float *)tb[r].shard)[i] = init_param((size_t)r * tb[r].shard_numel + i);
  for (int r = 0; r < 3; r++)
    for (size_t j = 0; j < tb[r].padded_numel; j++)
      ((float *)tb[r].grad)[j] = (float)grid_value(grad_hash(r, j, 1));
  team_all(&t, OP_SCATTER, buf, SHARDD_REDUCE_MEAN);
  team_all(&t, OP_STEP, opt, 0);
  team_all(&t, OP_GATHER, buf, 0);
  float *mom0 = malloc(KILL_NUMEL * 4), *mom1 = malloc(KILL_NUMEL * 4);
  cr_assert_eq(shardd_optim_state_get(t.c[0], opt, buf, 0, 0, KILL_NUMEL, mom0, NULL),
               SHARDD_OK, "%s", shardd_last_error(t.c[0]));
  team_close(&t);

  int ready[2], go[2];
  pid_t child = test_fork_with_pipes(ready, go);
  if (child == 0)
    victim(ready[1], go[0], kc->kind, opt);
  test_raw r[2];
  shardd_buffer_info b[2];
  for (int k = 0; k < 2; k++) {
    raw_hello_when_free(&r[k], "killed", (uint32_t)k, 3); /* the team's rank left */
    test_raw_register_buffer(&r[k], "P", SHARDD_DTYPE_FP32, KILL_NUMEL, &b[k]);
  }
  char ch;
  cr_assert_eq(read(ready[0], &ch, 1), 1, "rank 2 did not get ready");
  /* new gradients, so a scatter or step that ran would change something */
  for (int k = 0; k < 2; k++)
    for (size_t j = 0; j < b[k].padded_numel; j++)
      ((float *)b[k].grad)[j] = (float)grid_value(grad_hash(k, j, 2));
  size_t sb = b[0].shard_numel * 4;
  saved_areas sv[2];
  for (int k = 0; k < 2; k++)
    areas_save(&sv[k], &b[k]);
  double steps0 = -1;
  cr_assert(status_steps("killed", "o", &steps0));
  cr_assert_eq(steps0, 1.0);

  uint64_t seq[2];
  if (kc->victim_waits) {
    cr_assert_eq(write(go[1], "g", 1), 1);
    for (double end = test_mono_s() + TEST_HANG_S; job_inflight("killed") < 1;) {
      cr_assert_lt(test_mono_s(), end, "rank 2's %s never reached the daemon", what);
      test_sleep_ms(5);
    }
    cr_assert_eq(kill(child, SIGKILL), 0); /* inside its call, waiting for 0 and 1 */
    int st;
    cr_assert_eq(waitpid(child, &st, 0), child);
    cr_assert(WIFSIGNALED(st) && WTERMSIG(st) == SIGKILL, "rank 2 returned from its %s", what);
    for (int k = 0; k < 2; k++)
      seq[k] = kill_send(&r[k], kc->kind, buf, opt);
  } else {
    for (int k = 0; k < 2; k++) {
      seq[k] = kill_send(&r[k], kc->kind, buf, opt);
      test_raw_sync(&r[k]); /* queued: the Pong comes after */
    }
    cr_assert_eq(job_inflight("killed"), 1);
    cr_assert_eq(kill(child, SIGKILL), 0);
    int st;
    cr_assert_eq(waitpid(child, &st, 0), child);
    cr_assert(WIFSIGNALED(st), "rank 2 exited on its own");
  }
  close(ready[0]);
  close(go[1]);
  for (int k = 0; k < 2; k++) {
    Shardwire__Response *resp = test_raw_expect(&r[k], seq[k], SHARDD_E_PEER_LOST);
    cr_log_info("%s, %s: rank %d: %s", what, kc->victim_waits ? "victim waited" : "others waited",
                k, resp->message);
    cr_assert_not_null(strstr(resp->message, "rank 2"), "rank %d: \"%s\" does not name rank 2",
                       k, resp->message);
    shardwire__response__free_unpacked(resp, NULL);
  }
  for (int k = 0; k < 2; k++) {
    char who[32];
    snprintf(who, sizeof who, "%s: rank %d", what, k);
    areas_expect_kept(&sv[k], &b[k], who);
  }
  double steps = -1;
  cr_assert(status_steps("killed", "o", &steps));
  cr_assert_eq(steps, 1.0, "%s: the step count moved", what);

  /* another job is served meanwhile */
  shardd_client_t *other = test_connect(&d, "bystander", 0, 1);
  shardd_buffer_info ob;
  cr_assert_eq(shardd_buffer_register(other, "q", SHARDD_DTYPE_FP32, 100, &ob), SHARDD_OK);
  ((float *)ob.shard)[7] = 7.0f;
  cr_assert_eq(shardd_gather(other, ob.id), SHARDD_OK, "%s", shardd_last_error(other));
  cr_assert_eq(((float *)ob.gather)[7], 7.0f);
  shardd_close(other);

  /* rank 2 relaunched: its shard and the optimizer state are as they were */
  shardd_client_t *c2 = connect_rank("killed", 2, 3);
  shardd_buffer_info b2;
  cr_assert_eq(shardd_buffer_register(c2, "P", SHARDD_DTYPE_FP32, KILL_NUMEL, &b2), SHARDD_OK);
  cr_assert(!b2.created);
  cr_assert_eq(memcmp(b2.shard, (const float *)b[0].gather + 2 * b[0].shard_numel, sb), 0,
               "%s: rank 2's shard changed", what);
  cr_assert_eq(shardd_optim_state_get(c2, opt, buf, 0, 0, KILL_NUMEL, mom1, NULL), SHARDD_OK,
               "%s", shardd_last_error(c2));
  cr_assert_eq(memcmp(mom0, mom1, KILL_NUMEL * 4), 0, "%s: the momentum changed", what);
  /* and the job runs the collective with it */
  for (int k = 0; k < 2; k++)
    seq[k] = kill_send(&r[k], kc->kind, buf, opt);
  shardd_err rc = kc->kind == OP_GATHER    ? shardd_gather(c2, b2.id)
                  : kc->kind == OP_SCATTER ? shardd_scatter(c2, b2.id, SHARDD_REDUCE_MEAN)
                                           : shardd_step(c2, opt, NULL, NULL);
  cr_assert_eq(rc, SHARDD_OK, "%s with the relaunched rank 2: %s", what, shardd_last_error(c2));
  for (int k = 0; k < 2; k++)
    shardwire__response__free_unpacked(test_raw_expect(&r[k], seq[k], SHARDD_OK), NULL);
  cr_assert(status_steps("killed", "o", &steps));
  cr_assert_eq(steps, kc->kind == OP_STEP ? 2.0 : 1.0);
  free(mom0);
  free(mom1);
  shardd_close(c2);
  for (int k = 0; k < 2; k++)
    test_raw_close(&r[k]);
}
