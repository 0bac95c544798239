/* test_areas.c — transient areas end to end (issue 16): a real shardd, the
 * ranks of a job created with transient_areas on threads of this process,
 * each with its own connection. The rank blocks hold only the shard and the
 * reduced shard; gathers lease areas from the per-device pools, which are
 * mapped once per connection; scatters consume the gradient areas and
 * releases return the gather areas; the lease limit refuses a third
 * gather (asked by every rank) with E_LIMIT naming what each holds; a rank
 * killed while its peer waits in a gather of a buffer it holds gets its
 * areas back, so its relaunch has all its leases; shardctl status shows
 * the persistent bytes, the pools on top, and no growth in steady state.
 * Values are computed here from the formulas the ranks wrote, never read
 * back from the code under test. */
#include <criterion/criterion.h>
#include <dirent.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "harness.h"

#define WORLD 2
#define NBUF 4
#define NUMEL 65536u
#define SHARD (NUMEL / WORLD)
/* bytes of one rank block: the fp32 shard and the fp32 reduced shard */
#define BLOCK_BYTES (2u * SHARD * 4u)
/* one leased area, whole buffer, fp32 (already page aligned) */
#define UNIT_BYTES (NUMEL * 4u)
/* FSDP's bound on the areas: per rank 2 units gathered and 2 of gradient */
#define LEASES 2u

static test_daemon d;

static void start(void) {
  /* one device per rank: one pool per rank */
  const char *args[] = {"--devices", "2", NULL};
  test_daemon_start(&d, args);
}

static void stop(void) { test_daemon_finish(&d); }

/* ---- ranks on threads ----------------------------------------------------
 * A rank thread cannot fail a Criterion assertion itself: it records the
 * first failure, closes its connection (so a peer blocked in a collective
 * is told the rank was lost) and keeps meeting the barriers, so the main
 * thread reports the failure instead of hanging. */

typedef struct {
  uint32_t rank;
  const char *job;
  pthread_barrier_t *bar;
  int nsync; /* barriers this rank meets in all */
  int synced;
  shardd_client_t *c;
  shardd_buffer_info b[NBUF];
  char fail[1024];
} rank_ctx;

static void rank_fail(rank_ctx *r, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
static void rank_fail(rank_ctx *r, const char *fmt, ...) {
  if (r->fail[0])
    return;
  int n = snprintf(r->fail, sizeof r->fail, "rank %u: ", r->rank);
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(r->fail + n, sizeof r->fail - (size_t)n, fmt, ap);
  va_end(ap);
}

#define CHECK(r, cond, ...)      \
  do {                           \
    if (!(cond)) {               \
      rank_fail(r, __VA_ARGS__); \
      return 0;                  \
    }                            \
  } while (0)

#define CHECK_OK(r, call)                                                  \
  do {                                                                     \
    shardd_err rc_ = (call);                                               \
    CHECK(r, rc_ == SHARDD_OK, "%s: %s (%s)", #call, shardd_err_name(rc_), \
          shardd_last_error((r)->c));                                      \
  } while (0)

static void sync_point(rank_ctx *r) {
  pthread_barrier_wait(r->bar);
  r->synced++;
}

/* The main thread's side of the barriers. */
typedef struct {
  pthread_barrier_t bar;
  rank_ctx r[WORLD];
  pthread_t th[WORLD];
} ranks;

static void *rank_main(void *arg);
static int (*rank_body)(rank_ctx *r);

static void ranks_start(ranks *rs, const char *job, int nsync, int (*body)(rank_ctx *)) {
  memset(rs, 0, sizeof *rs);
  rank_body = body;
  cr_assert_eq(pthread_barrier_init(&rs->bar, NULL, WORLD + 1), 0);
  for (uint32_t i = 0; i < WORLD; i++) {
    rs->r[i].rank = i;
    rs->r[i].job = job;
    rs->r[i].bar = &rs->bar;
    rs->r[i].nsync = nsync;
    cr_assert_eq(pthread_create(&rs->th[i], NULL, rank_main, &rs->r[i]), 0);
  }
}

static void *rank_main(void *arg) {
  rank_ctx *r = arg;
  rank_body(r);
  if (r->fail[0] && r->c) { /* a peer waiting on this rank learns it is gone */
    shardd_close(r->c);
    r->c = NULL;
  }
  while (r->synced < r->nsync)
    sync_point(r);
  shardd_close(r->c);
  r->c = NULL;
  return NULL;
}

/* The main thread meets the ranks at the next barrier (one fewer *left to
 * meet at the end); 1 when every rank is still fine. */
static int ranks_sync(ranks *rs, int *left) {
  pthread_barrier_wait(&rs->bar);
  --*left;
  for (int i = 0; i < WORLD; i++)
    if (rs->r[i].fail[0])
      return 0;
  return 1;
}

static void ranks_join(ranks *rs, int nsync_left) {
  for (int i = 0; i < nsync_left; i++)
    pthread_barrier_wait(&rs->bar);
  for (int i = 0; i < WORLD; i++)
    pthread_join(rs->th[i], NULL);
  pthread_barrier_destroy(&rs->bar);
  for (int i = 0; i < WORLD; i++)
    cr_expect_eq(rs->r[i].fail[0], '\0', "%s", rs->r[i].fail);
  for (int i = 0; i < WORLD; i++)
    if (rs->r[i].fail[0])
      cr_assert_fail("a rank failed (above)");
}

static shardd_err connect_rank(rank_ctx *r, int transient) {
  shardd_connect_opts o = SHARDD_CONNECT_OPTS_INIT;
  o.job = r->job;
  o.rank = r->rank;
  o.world = WORLD;
  o.transient_areas = transient;
  char err[512] = "";
  shardd_err rc = shardd_connect(d.sock, &o, &r->c, err, sizeof err);
  if (rc != SHARDD_OK)
    rank_fail(r, "connect: %s (%s)", shardd_err_name(rc), err);
  return rc;
}

/* What the ranks write: the parameters, the gradients, and their mean. */
static float param(int b, uint64_t i) { return (float)(b * 100000 + (int)i); }
static float grad(uint32_t rank, int b, uint64_t i) {
  return (float)((rank + 1) * (b + 1)) + 0.25f * (float)i;
}
static float grad_mean(int b, uint64_t i) {
  return 1.5f * (float)(b + 1) + 0.25f * (float)i; /* (1 + 2) / 2 */
}

/* Registers n buffers called prefix0.. and writes each rank's shard. */
static int register_and_fill(rank_ctx *r, const char *prefix, int n) {
  for (int b = 0; b < n; b++) {
    char name[32];
    snprintf(name, sizeof name, "%s%d", prefix, b);
    shardd_buffer_info *bi = &r->b[b];
    CHECK_OK(r, shardd_buffer_register(r->c, name, SHARDD_DTYPE_FP32, NUMEL, bi));
    CHECK(r, bi->transient == 1, "%s: not transient", name);
    CHECK(r, bi->gather == NULL && bi->grad == NULL,
          "%s: a transient block hands out gather/grad pointers", name);
    CHECK(r, bi->shard && bi->reduced, "%s: no shard or reduced pointer", name);
    CHECK(r, bi->shard_numel == SHARD && bi->padded_numel == NUMEL,
          "%s: shard_numel %" PRIu64 " padded %" PRIu64, name, bi->shard_numel,
          bi->padded_numel);
    float *s = bi->shard;
    for (uint64_t k = 0; k < SHARD; k++)
      s[k] = param(b, r->rank * SHARD + k);
  }
  return 1;
}

static int check_gathered(rank_ctx *r, int b, const float *g) {
  for (uint64_t i = 0; i < NUMEL; i++)
    CHECK(r, g[i] == param(b, i), "buffer %d: gathered[%" PRIu64 "] = %g, wanted %g",
          b, i, (double)g[i], (double)param(b, i));
  return 1;
}

/* Gathers buffer b (with a gradient area when grad) into a and checks
 * every gathered element. */
static int gather_checked(rank_ctx *r, int b, int grad, shardd_area *a) {
  CHECK_OK(r, shardd_gather_area(r->c, r->b[b].id, grad, a));
  return check_gathered(r, b, a->gather);
}

/* A transient rank of the job, its n buffers prefix0.. registered and
 * filled. */
static int join_transient(rank_ctx *r, const char *prefix, int n) {
  if (connect_rank(r, 1) != SHARDD_OK)
    return 0;
  return register_and_fill(r, prefix, n);
}

/* The ranks run body through its nsync barriers, which the test only
 * meets; a rank's failure fails the test. */
static void run_ranks(const char *job, int nsync, int (*body)(rank_ctx *)) {
  ranks rs;
  ranks_start(&rs, job, nsync, body);
  ranks_join(&rs, nsync);
}

/* FSDP's forward: gather a unit, use it, reshard. */
static int forward(rank_ctx *r) {
  for (int b = 0; b < NBUF; b++) {
    shardd_area a;
    CHECK_OK(r, shardd_gather_area(r->c, r->b[b].id, 0, &a));
    CHECK(r, a.gather != NULL && a.grad == NULL, "buffer %d: areas %p %p", b,
          a.gather, a.grad);
    CHECK(r, a.pool != 0, "buffer %d: pool 0 from a transient gather", b);
    if (!check_gathered(r, b, a.gather))
      return 0;
    CHECK_OK(r, shardd_release(r->c, r->b[b].id));
  }
  return 1;
}

/* FSDP's backward: re-gather with a gradient area, write the gradient,
 * reduce-scatter it (which consumes the gradient area), reshard. */
static int backward(rank_ctx *r) {
  for (int b = NBUF - 1; b >= 0; b--) {
    shardd_area a;
    CHECK_OK(r, shardd_gather_area(r->c, r->b[b].id, 1, &a));
    CHECK(r, a.gather != NULL && a.grad != NULL, "buffer %d: areas %p %p", b,
          a.gather, a.grad);
    CHECK(r, a.gather != a.grad, "buffer %d: one area for gather and grad", b);
    if (!check_gathered(r, b, a.gather))
      return 0;
    float *g = a.grad;
    for (uint64_t i = 0; i < NUMEL; i++)
      g[i] = grad(r->rank, b, i);
    CHECK_OK(r, shardd_scatter(r->c, r->b[b].id, SHARDD_REDUCE_MEAN));
    const float *red = r->b[b].reduced;
    for (uint64_t k = 0; k < SHARD; k++) {
      uint64_t i = r->rank * SHARD + k;
      CHECK(r, red[k] == grad_mean(b, i),
            "buffer %d: reduced[%" PRIu64 "] = %g, wanted %g", b, k,
            (double)red[k], (double)grad_mean(b, i));
    }
    /* the shard is the parameters still: no optimizer ran */
    const float *s = r->b[b].shard;
    CHECK(r, s[0] == param(b, r->rank * SHARD), "buffer %d: shard changed", b);
    CHECK_OK(r, shardd_release(r->c, r->b[b].id));
  }
  return 1;
}

/* ---- status ---------------------------------------------------------------- */

typedef struct {
  double used, peak;        /* over every device */
  double pool, persistent;  /* the job's, -1 when it is not listed */
} dev_bytes;

/* shardctl status --json: the devices' bytes and those of job (NULL: none). */
static dev_bytes status_bytes(const char *job) {
  char args[256], *out, *err;
  snprintf(args, sizeof args, "--socket %s status --json", d.sock);
  int rc = test_shardctl(NULL, args, &out, &err);
  cr_assert_eq(rc, 0, "shardctl status exited %d: %s", rc, err);
  tj *j = tj_parse(out);
  cr_assert_not_null(j, "shardctl status --json printed no valid JSON: %s", out);
  const tj *devs = tj_need(j, "devices", TJ_ARR);
  dev_bytes b = {0, 0, -1, -1};
  for (size_t i = 0; i < devs->n; i++) {
    b.used += tj_need(devs->kids[i], "used_bytes", TJ_NUM)->num;
    b.peak += tj_need(devs->kids[i], "peak_bytes", TJ_NUM)->num;
  }
  const tj *jobs = tj_need(j, "jobs", TJ_ARR);
  for (size_t i = 0; job && i < jobs->n; i++) {
    const tj *jb = jobs->kids[i];
    if (strcmp(tj_need(jb, "name", TJ_STR)->str, job) != 0)
      continue;
    cr_assert(tj_need(jb, "transient", TJ_BOOL)->boolean, "job %s is not transient", job);
    b.pool = tj_need(jb, "pool_bytes", TJ_NUM)->num;
    b.persistent = tj_need(jb, "persistent_bytes", TJ_NUM)->num;
    cr_assert_eq(tj_need(jb, "bytes", TJ_NUM)->num, b.pool + b.persistent,
                 "a job's bytes are its persistent bytes and its pools");
  }
  cr_log_info("status: used %.0f peak %.0f: %s", b.used, b.peak, out);
  tj_free(j);
  free(out);
  free(err);
  return b;
}

/* ---- the training loop ------------------------------------------------------ */

/* Forward and backward are kept apart by a barrier: a rank that releases
 * the last unit while its peer already re-gathers it for backward is the
 * case of regather_while_a_peer_releases below. */
#define LOOP_SYNCS 5

static int loop_body(rank_ctx *r) {
  if (!join_transient(r, "w", NBUF))
    return 0;
  sync_point(r); /* 1: registered */
  if (!forward(r))
    return 0;
  sync_point(r); /* 2: forward done, pools made */
  if (!backward(r))
    return 0;
  sync_point(r); /* 3: one step */
  if (!forward(r))
    return 0;
  sync_point(r); /* 4 */
  if (!backward(r))
    return 0;
  sync_point(r); /* 5: a second step */
  return 1;
}

/* Device bytes are the job's persistent bytes (exactly the shards and
 * reduced shards: nothing of the whole-buffer areas) and its pools, never
 * more than FSDP's 2 gathered and 2 gradient units per rank. */
static dev_bytes expect_accounting(const char *when) {
  dev_bytes b = status_bytes("areas");
  double persistent = (double)NBUF * WORLD * BLOCK_BYTES;
  double bound = (double)WORLD * 2 * LEASES * UNIT_BYTES;
  cr_expect_eq(b.persistent, persistent,
               "%s: persistent %.0f bytes, wanted %.0f (shard + reduced shard "
               "per rank and buffer)", when, b.persistent, persistent);
  cr_expect_eq(b.used, b.persistent + b.pool,
               "%s: devices use %.0f bytes, the job %.0f persistent + %.0f pools",
               when, b.used, b.persistent, b.pool);
  cr_expect_leq(b.pool, bound, "%s: pools of %.0f bytes, over FSDP's %.0f", when,
                b.pool, bound);
  cr_expect_geq(b.peak, b.used);
  return b;
}

Test(areas, gather_scatter_release_through_the_pools, .init = start, .fini = stop,
     .timeout = 60) {
  dev_bytes b0 = status_bytes(NULL);
  cr_assert_eq(b0.used, 0.0);
  ranks rs;
  ranks_start(&rs, "areas", LOOP_SYNCS, loop_body);
  int left = LOOP_SYNCS;
  if (ranks_sync(&rs, &left)) {
    expect_accounting("registered");
    if (ranks_sync(&rs, &left)) {
      dev_bytes b2 = expect_accounting("after forward");
      /* the ranks go on into backward as this is read: at least the
       * forward's one slot (the node's copy), at most the step's */
      cr_expect_geq(b2.pool, (double)UNIT_BYTES,
                    "pools of %.0f bytes cannot have held a gathered unit", b2.pool);
      cr_expect_leq(b2.pool, (double)(1 + WORLD) * UNIT_BYTES,
                    "pools of %.0f bytes after a forward", b2.pool);
      if (ranks_sync(&rs, &left)) {
        dev_bytes b3 = expect_accounting("after backward");
        /* one gathered unit at a time and per rank one gradient unit
         * beside it: slots are made as they are first needed, no more
         * than are held at once (and never fewer later: they stay) */
        cr_expect_eq(b3.pool, (double)(1 + WORLD) * UNIT_BYTES,
                     "pools of %.0f bytes after a backward that held one "
                     "gathered unit and a gradient unit per rank", b3.pool);
        if (ranks_sync(&rs, &left) && ranks_sync(&rs, &left)) {
          dev_bytes b4 = expect_accounting("step 2");
          cr_expect_eq(b4.used, b3.used, "steady state: used %.0f at step 2, %.0f at step 1",
                       b4.used, b3.used);
          cr_expect_eq(b4.peak, b3.peak, "steady state: peak %.0f at step 2, %.0f at step 1",
                       b4.peak, b3.peak);
        }
      }
    }
  }
  ranks_join(&rs, left);
}

/* ---- the lease limit --------------------------------------------------------- */

#define LIMIT_SYNCS 2

static int limit_body(rank_ctx *r) {
  if (!join_transient(r, "lim", 3))
    return 0;
  shardd_area a;
  for (int b = 0; b < 2; b++) {
    if (!gather_checked(r, b, 0, &a))
      return 0;
  }
  {
    /* holding two, a third would wait for a release this rank can only
     * send after it: refused, naming what it holds. The daemon checks the
     * leases when the collective starts, i.e. once every rank has asked
     * (a gather only one rank sends waits for the others like any
     * collective), and one rank over its limit fails it for all. */
    shardd_err rc = shardd_gather_area(r->c, r->b[2].id, 0, &a);
    const char *msg = shardd_last_error(r->c);
    CHECK(r, rc == SHARDD_E_LIMIT, "third gather: %s (%s), wanted E_LIMIT",
          shardd_err_name(rc), msg);
    CHECK(r, a.gather == NULL, "a refused gather hands out an area");
    for (int b = 0; b < 2; b++) {
      char name[16], id[32];
      snprintf(name, sizeof name, "lim%d", b);
      snprintf(id, sizeof id, "%" PRIu64, r->b[b].id);
      CHECK(r, strstr(msg, name) || strstr(msg, id),
            "E_LIMIT message \"%s\" names neither %s nor id %s", msg, name, id);
    }
    CHECK_OK(r, shardd_ping(r->c));
  }
  sync_point(r); /* 1: both refused */
  /* a release makes room again */
  CHECK_OK(r, shardd_release(r->c, r->b[0].id));
  if (!gather_checked(r, 2, 0, &a))
    return 0;
  CHECK_OK(r, shardd_release(r->c, r->b[1].id));
  CHECK_OK(r, shardd_release(r->c, r->b[2].id));
  /* the gathers go on after the refusal */
  if (!gather_checked(r, 0, 0, &a))
    return 0;
  CHECK_OK(r, shardd_release(r->c, r->b[0].id));
  sync_point(r); /* 2 */
  return 1;
}

Test(areas, a_third_gather_is_refused_naming_the_held_buffers, .init = start,
     .fini = stop, .timeout = 60) {
  run_ranks("limit", LIMIT_SYNCS, limit_body);
}

/* ---- releases sent without waiting for their answers ------------------------ */

#define ASYNC_SYNCS 1

static int async_release_body(rank_ctx *r) {
  if (!join_transient(r, "rel", NBUF))
    return 0;
  shardd_area a;
  shardd_ticket t[NBUF];
  for (int round = 0; round < 3; round++) {
    /* each unit released unanswered before the next is gathered: from the
     * third on the gather would be refused E_LIMIT (2 leases) had the
     * releases not been served before it, in the connection's order */
    for (int b = 0; b < NBUF; b++) {
      if (!gather_checked(r, b, 0, &a))
        return 0;
      CHECK_OK(r, shardd_release_async(r->c, r->b[b].id, &t[b]));
      CHECK(r, t[b] != 0, "round %d buffer %d: ticket 0", round, b);
    }
    for (int b = 0; b < NBUF; b++)
      CHECK_OK(r, shardd_wait(r->c, t[b]));
  }
  /* an async gather is not held up by releases in flight: with more of
   * them than max_inflight_gathers unanswered, it is sent and completes */
  CHECK_OK(r, shardd_gather_area(r->c, r->b[0].id, 0, &a));
  CHECK_OK(r, shardd_gather_area(r->c, r->b[1].id, 0, &a));
  CHECK_OK(r, shardd_release_async(r->c, r->b[0].id, &t[0]));
  CHECK_OK(r, shardd_release_async(r->c, r->b[1].id, &t[1]));
  shardd_ticket g;
  CHECK_OK(r, shardd_gather_async(r->c, r->b[2].id, &g));
  CHECK_OK(r, shardd_wait_area(r->c, g, &a));
  if (!check_gathered(r, 2, a.gather))
    return 0;
  for (int b = 0; b < 2; b++)
    CHECK_OK(r, shardd_wait(r->c, t[b]));
  /* a release's failure comes with its ticket: nothing held, E_STATE */
  CHECK_OK(r, shardd_release_async(r->c, r->b[2].id, &t[2]));
  CHECK_OK(r, shardd_release_async(r->c, r->b[3].id, &t[3]));
  CHECK_OK(r, shardd_wait(r->c, t[2]));
  shardd_err rc = shardd_wait(r->c, t[3]);
  CHECK(r, rc == SHARDD_E_STATE, "release of a buffer not gathered: %s (%s)",
        shardd_err_name(rc), shardd_last_error(r->c));
  CHECK(r, shardd_wait(r->c, t[3]) == SHARDD_E_INVAL, "a ticket waited twice");
  sync_point(r); /* 1 */
  return 1;
}

Test(areas, releases_sent_unanswered_free_their_leases_in_order, .init = start,
     .fini = stop, .timeout = 60) {
  run_ranks("relasync", ASYNC_SYNCS, async_release_body);
}

/* ---- one rank: plain and async gathers on a transient job -------------------- */

static int count_fds(void) {
  DIR *dir = opendir("/proc/self/fd");
  cr_assert_not_null(dir);
  int n = 0;
  for (struct dirent *e; (e = readdir(dir)) != NULL;)
    if (e->d_name[0] != '.')
      n++;
  closedir(dir);
  return n;
}

Test(areas, plain_and_async_gathers_map_the_pool_once, .init = start, .fini = stop,
     .timeout = 60) {
  int before = count_fds();
  shardd_connect_opts o = SHARDD_CONNECT_OPTS_INIT;
  o.job = "single";
  o.world = 1;
  o.transient_areas = 1;
  shardd_client_t *c = NULL;
  char err[512];
  cr_assert_eq(shardd_connect(d.sock, &o, &c, err, sizeof err), SHARDD_OK, "%s", err);
  shardd_buffer_info b;
  cr_assert_eq(shardd_buffer_register(c, "one", SHARDD_DTYPE_FP32, 1000, &b), SHARDD_OK,
               "%s", shardd_last_error(c));
  cr_assert_eq(b.transient, 1);
  cr_assert_null(b.gather);
  float *s = b.shard;
  for (uint64_t i = 0; i < b.shard_numel; i++)
    s[i] = (float)i + 0.5f;
  cr_assert_eq(count_fds(), before + 1, "the socket only");

  /* the first gather's reply brings the pool's descriptor: a plain gather
   * must map it (or later gather_areas find no pool) and leak nothing */
  cr_assert_eq(shardd_gather(c, b.id), SHARDD_OK, "%s", shardd_last_error(c));
  cr_assert_eq(count_fds(), before + 1, "the pool's descriptor leaked");
  shardd_area a;
  cr_assert_eq(shardd_gather_area(c, b.id, 0, &a), SHARDD_OK, "%s", shardd_last_error(c));
  cr_assert_not_null(a.gather);
  const float *g = a.gather;
  for (uint64_t i = 0; i < 1000; i++)
    cr_assert_eq(g[i], (float)i + 0.5f, "gathered[%" PRIu64 "] = %g", i, (double)g[i]);
  /* inspect names the ranks that hold a lease on the buffer */
  char *js = NULL;
  cr_assert_eq(shardd_inspect_json(c, b.id, NULL, &js), SHARDD_OK, "%s",
               shardd_last_error(c));
  cr_expect(strstr(js, "\"gather_leases\":[0],\"grad_leases\":[]") != NULL, "%s", js);
  shardd_free(js);
  cr_assert_eq(shardd_release(c, b.id), SHARDD_OK, "%s", shardd_last_error(c));
  cr_assert_eq(shardd_inspect_json(c, b.id, NULL, &js), SHARDD_OK, "%s",
               shardd_last_error(c));
  cr_expect(strstr(js, "gather_leases") == NULL, "released: %s", js);
  shardd_free(js);

  shardd_ticket t;
  cr_assert_eq(shardd_gather_async(c, b.id, &t), SHARDD_OK, "%s", shardd_last_error(c));
  shardd_area aa;
  cr_assert_eq(shardd_wait_area(c, t, &aa), SHARDD_OK, "%s", shardd_last_error(c));
  cr_assert_eq(aa.pool, a.pool, "one device, one pool");
  g = aa.gather;
  for (uint64_t i = 0; i < 1000; i++)
    cr_assert_eq(g[i], (float)i + 0.5f, "async gathered[%" PRIu64 "] = %g", i, (double)g[i]);
  cr_assert_eq(shardd_release(c, b.id), SHARDD_OK, "%s", shardd_last_error(c));
  cr_assert_eq(count_fds(), before + 1);
  shardd_close(c);
  cr_assert_eq(count_fds(), before);
}

/* Backward prefetch: the unit whose backward comes next is gathered ahead
 * with its gradient area, so its backward needs no second gather. */
Test(areas, an_async_gather_with_want_grad_leases_the_gradient_area_too, .init = start,
     .fini = stop, .timeout = 60) {
  int before = count_fds();
  shardd_connect_opts o = SHARDD_CONNECT_OPTS_INIT;
  o.job = "single";
  o.world = 1;
  o.transient_areas = 1;
  shardd_client_t *c = NULL;
  char err[512];
  cr_assert_eq(shardd_connect(d.sock, &o, &c, err, sizeof err), SHARDD_OK, "%s", err);
  shardd_buffer_info b;
  cr_assert_eq(shardd_buffer_register(c, "one", SHARDD_DTYPE_FP32, 1000, &b), SHARDD_OK,
               "%s", shardd_last_error(c));
  float *s = b.shard;
  for (uint64_t i = 0; i < b.shard_numel; i++)
    s[i] = (float)i + 0.5f;
  shardd_ticket t;
  cr_assert_eq(shardd_gather_area_async(c, b.id, 1, &t), SHARDD_OK, "%s",
               shardd_last_error(c));
  shardd_area a;
  cr_assert_eq(shardd_wait_area(c, t, &a), SHARDD_OK, "%s", shardd_last_error(c));
  cr_assert_not_null(a.gather);
  cr_assert_not_null(a.grad, "want_grad: the gradient area is leased and said");
  const float *g = a.gather;
  float *gr = a.grad;
  for (uint64_t i = 0; i < 1000; i++) {
    cr_assert_eq(g[i], (float)i + 0.5f, "gathered[%" PRIu64 "] = %g", i, (double)g[i]);
    cr_assert_eq(gr[i], 0.0f, "the gradient area starts zeroed: [%" PRIu64 "] = %g", i,
                 (double)gr[i]);
  }
  char *js = NULL;
  cr_assert_eq(shardd_inspect_json(c, b.id, NULL, &js), SHARDD_OK, "%s",
               shardd_last_error(c));
  cr_expect(strstr(js, "\"gather_leases\":[0],\"grad_leases\":[0]") != NULL, "%s", js);
  shardd_free(js);
  /* the area is the one a scatter consumes: what is written there reduces */
  for (uint64_t i = 0; i < 1000; i++)
    gr[i] = 2.0f;
  cr_assert_eq(shardd_scatter(c, b.id, SHARDD_REDUCE_SUM), SHARDD_OK, "%s",
               shardd_last_error(c));
  const float *red = b.reduced;
  for (uint64_t i = 0; i < b.shard_numel; i++)
    cr_assert_eq(red[i], 2.0f, "reduced[%" PRIu64 "] = %g", i, (double)red[i]);
  cr_assert_eq(shardd_release(c, b.id), SHARDD_OK, "%s", shardd_last_error(c));
  /* without want_grad an async gather still leases no gradient area */
  cr_assert_eq(shardd_gather_area_async(c, b.id, 0, &t), SHARDD_OK, "%s",
               shardd_last_error(c));
  cr_assert_eq(shardd_wait_area(c, t, &a), SHARDD_OK, "%s", shardd_last_error(c));
  cr_assert_null(a.grad);
  cr_assert_eq(shardd_release(c, b.id), SHARDD_OK, "%s", shardd_last_error(c));
  shardd_close(c);
  cr_assert_eq(count_fds(), before, "a pool's descriptor leaked");
}

Test(areas, a_resident_rank_cannot_join_a_transient_job, .init = start, .fini = stop,
     .timeout = 60) {
  shardd_connect_opts o = SHARDD_CONNECT_OPTS_INIT;
  o.job = "mixed";
  o.world = 2;
  o.transient_areas = 1;
  shardd_client_t *c0 = NULL, *c1 = NULL;
  char err[512] = "";
  cr_assert_eq(shardd_connect(d.sock, &o, &c0, err, sizeof err), SHARDD_OK, "%s", err);
  shardd_buffer_info b;
  cr_assert_eq(shardd_buffer_register(c0, "x", SHARDD_DTYPE_FP32, 64, &b), SHARDD_OK,
               "%s", shardd_last_error(c0));
  o.rank = 1;
  o.transient_areas = 0;
  shardd_err rc = shardd_connect(d.sock, &o, &c1, err, sizeof err);
  cr_expect_eq(rc, SHARDD_E_MISMATCH, "rank 1 asking for resident areas: %s (%s)",
               shardd_err_name(rc), err);
  cr_expect_null(c1);
  shardd_close(c1);
  shardd_close(c0);
}

/* ---- a peer re-gathers before this rank has released ----------------------
 * FSDP's last unit: one rank releases it after forward and at once gathers
 * it again for backward, while the other has not sent its release yet. The
 * release returns this rank's own lease; the queued gather of the peer
 * must not make it E_BUSY (it did: "has collectives in flight"). */

#define REGATHER_SYNCS 2

/* Polls the job's status on r's connection until a collective is queued. */
static int wait_queued(rank_ctx *r) {
  for (double end = test_mono_s() + TEST_HANG_S; test_mono_s() < end;) {
    char *st = NULL;
    CHECK_OK(r, shardd_status_json(r->c, &st));
    int queued = strstr(st, "\"collectives_in_flight\":1") != NULL;
    shardd_free(st);
    if (queued)
      return 1;
    test_sleep_ms(5);
  }
  CHECK(r, 0, "the peer's gather was never queued");
}

static int regather_body(rank_ctx *r) {
  if (!join_transient(r, "re", 1))
    return 0;
  shardd_area a;
  if (!gather_checked(r, 0, 0, &a))
    return 0;
  sync_point(r); /* 1: both hold the gather area */
  if (r->rank == 1) {
    CHECK_OK(r, shardd_release(r->c, r->b[0].id));
  } else {
    if (!wait_queued(r))
      return 0;
    CHECK_OK(r, shardd_release(r->c, r->b[0].id));
  }
  /* rank 1 sent this before rank 0's release (wait_queued saw it) */
  if (!gather_checked(r, 0, 1, &a))
    return 0;
  float *g = a.grad;
  for (uint64_t i = 0; i < NUMEL; i++)
    g[i] = grad(r->rank, 0, i);
  CHECK_OK(r, shardd_scatter(r->c, r->b[0].id, SHARDD_REDUCE_MEAN));
  const float *red = r->b[0].reduced;
  for (uint64_t k = 0; k < SHARD; k++)
    CHECK(r, red[k] == grad_mean(0, r->rank * SHARD + k), "reduced[%" PRIu64 "] = %g",
          k, (double)red[k]);
  CHECK_OK(r, shardd_release(r->c, r->b[0].id));
  sync_point(r); /* 2 */
  return 1;
}

Test(areas, regather_while_a_peer_releases, .init = start, .fini = stop,
     .timeout = 60) {
  run_ranks("regather", REGATHER_SYNCS, regather_body);
}

/* ---- a rank that leaves holding an area --------------------------------------
 * A trainer killed while it holds a gather area of a buffer on which its
 * peer waits in a gather: its areas go back when it leaves, the queued
 * gather notwithstanding (it leases when it starts). The peer's gather
 * fails at the end of --peer-grace; the relaunched rank gathers two other
 * units first, as a fresh trainer does, and both are within its 2 leases
 * (the dead rank's lease stayed booked, and the second was E_LIMIT "holds 2
 * gather areas"); its gradient area of the unit starts at zero (the booked
 * one, handed back unzeroed, held the dead rank's partial gradient). */

#define LEAVE_SYNCS 4

static int leave_body(rank_ctx *r) {
  if (!join_transient(r, "lv", 3))
    return 0;
  shardd_area a;
  /* rank 0 is in lv0's backward: its gradient area holds a partial sum */
  CHECK_OK(r, shardd_gather_area(r->c, r->b[0].id, r->rank == 0, &a));
  if (r->rank == 0)
    for (uint64_t i = 0; i < NUMEL; i++)
      ((float *)a.grad)[i] = grad(0, 0, i);
  sync_point(r); /* 1: both hold lv0's gather area, rank 0 its gradient area */
  if (r->rank == 1) {
    shardd_err rc = shardd_gather_area(r->c, r->b[0].id, 0, &a);
    CHECK(r, rc == SHARDD_E_PEER_LOST, "gather waiting for the killed rank: %s (%s)",
          shardd_err_name(rc), shardd_last_error(r->c));
    CHECK_OK(r, shardd_release(r->c, r->b[0].id));
  } else {
    if (!wait_queued(r))
      return 0;
    shardd_close(r->c); /* killed: its connection closes under the daemon */
    r->c = NULL;
  }
  sync_point(r); /* 2: the peer's gather failed */
  if (r->rank == 0) { /* the relaunch */
    if (!join_transient(r, "lv", 3))
      return 0;
  }
  sync_point(r); /* 3: rank 0 is back (a gather sent before would be the
                  * peer's, doomed by the rank still missing) */
  for (int b = 1; b < 3; b++) {
    if (!gather_checked(r, b, 0, &a))
      return 0;
  }
  for (int b = 1; b < 3; b++)
    CHECK_OK(r, shardd_release(r->c, r->b[b].id));
  /* the relaunch's backward starts from a zero gradient, not the dead
   * rank's partial one */
  if (!gather_checked(r, 0, r->rank == 0, &a))
    return 0;
  for (uint64_t i = 0; r->rank == 0 && i < NUMEL; i++)
    CHECK(r, ((float *)a.grad)[i] == 0.0f, "lv0's new gradient area[%" PRIu64 "] = %g",
          i, (double)((float *)a.grad)[i]);
  CHECK_OK(r, r->rank == 0 ? shardd_release_all(r->c, r->b[0].id)
                           : shardd_release(r->c, r->b[0].id));
  sync_point(r); /* 4 */
  return 1;
}

Test(areas, a_rank_killed_while_its_peer_waits_returns_its_areas, .init = start,
     .fini = stop, .timeout = 60) {
  run_ranks("leave", LEAVE_SYNCS, leave_body);
}

/* ---- a gradient release sent behind its scatter -----------------------------
 * A client that pipelines (a raw one here: libshardd's scatter waits) may
 * send Release with grad right after its Scatter of the buffer. The
 * scatter reads the rank's gradient area when it runs: given back first,
 * the slot could be leased again and written into the sum (or, queued,
 * the scatter would fail at its start). The release is refused (E_BUSY,
 * naming the scatter) while the rank's scatter is queued, and the scatter
 * then runs with the rank's gradient. */

static void raw_transient_hello(test_raw *r, const char *job, uint32_t rank) {
  Shardwire__Request req = SHARDWIRE__REQUEST__INIT;
  Shardwire__Hello h = SHARDWIRE__HELLO__INIT;
  h.protocol_version = SHARDD_PROTOCOL_VERSION;
  h.job = (char *)job;
  h.has_rank = h.has_world = h.has_transient_areas = 1;
  h.rank = rank;
  h.world = WORLD;
  h.transient_areas = 1;
  req.body_case = SHARDWIRE__REQUEST__BODY_HELLO;
  req.hello = &h;
  uint64_t seq = test_raw_send(r, &req);
  shardwire__response__free_unpacked(test_raw_expect(r, seq, SHARDD_OK), NULL);
}

static uint64_t raw_send_release(test_raw *r, uint64_t buf, int grad) {
  Shardwire__Request req = SHARDWIRE__REQUEST__INIT;
  Shardwire__Release rel = SHARDWIRE__RELEASE__INIT;
  rel.buffer = buf;
  rel.has_grad = grad;
  rel.grad = grad;
  req.body_case = SHARDWIRE__REQUEST__BODY_RELEASE;
  req.release = &rel;
  return test_raw_send(r, &req);
}

/* Gathers buf with a gradient area on both raw ranks; the rank's gradient
 * area (mapped from the reply's gradient pool) is filled with grad(). */
static void raw_gather_grads(test_raw *rr, uint64_t buf) {
  uint64_t seq[WORLD];
  for (uint32_t k = 0; k < WORLD; k++) {
    Shardwire__Request req = SHARDWIRE__REQUEST__INIT;
    Shardwire__Gather g = SHARDWIRE__GATHER__INIT;
    g.buffer = buf;
    g.has_want_grad = g.want_grad = 1;
    req.body_case = SHARDWIRE__REQUEST__BODY_GATHER;
    req.gather = &g;
    seq[k] = test_raw_send(&rr[k], &req);
  }
  for (uint32_t k = 0; k < WORLD; k++) {
    const uint8_t *payload;
    size_t len;
    int fds[4], nfds = 0;
    char err[256];
    cr_assert_eq(shardd__frame_recv(rr[k].fd, &rr[k].rd, &payload, &len, fds, 4,
                                    &nfds, err, sizeof err),
                 SHARDD_OK, "%s", err);
    Shardwire__Response *resp = shardwire__response__unpack(NULL, len, payload);
    cr_assert_not_null(resp);
    cr_assert_eq(resp->seq, seq[k]);
    cr_assert_eq(resp->code, SHARDWIRE__STATUS_CODE__OK, "gather on rank %u: %s",
                 k, resp->message ? resp->message : "");
    const Shardwire__GatherReply *gr = resp->gather;
    cr_assert_not_null(gr);
    cr_assert(gr->has_grad_offset && gr->grad_pool_fd,
              "rank %u: no gradient area, or its pool's descriptor", k);
    int gfd = fds[nfds - 1]; /* the gradient pool's comes last */
    void *pool = mmap(NULL, gr->grad_pool_bytes, PROT_READ | PROT_WRITE,
                      MAP_SHARED, gfd, 0);
    cr_assert(pool != MAP_FAILED, "mmap: %s", strerror(errno));
    float *g = (float *)((char *)pool + gr->grad_offset);
    for (uint64_t i = 0; i < NUMEL; i++)
      g[i] = grad(k, 0, i);
    munmap(pool, gr->grad_pool_bytes);
    for (int i = 0; i < nfds; i++)
      close(fds[i]);
    shardwire__response__free_unpacked(resp, NULL);
  }
}

Test(areas, a_gradient_release_behind_its_scatter_is_refused, .init = start,
     .fini = stop, .timeout = 60) {
  test_raw rr[WORLD];
  shardd_buffer_info bi[WORLD];
  for (uint32_t k = 0; k < WORLD; k++) {
    test_raw_open(&d, &rr[k]);
    raw_transient_hello(&rr[k], "pipelined", k);
    test_raw_register_buffer(&rr[k], "pl0", SHARDD_DTYPE_FP32, NUMEL, &bi[k]);
    float *s = bi[k].shard;
    for (uint64_t j = 0; j < SHARD; j++)
      s[j] = param(0, k * SHARD + j);
  }
  raw_gather_grads(rr, bi[0].id);
  /* rank 0: its scatter (queued: rank 1 has not sent its own), then the
   * release of its areas, gradient included, before the scatter's answer */
  uint64_t sc0 = test_raw_send_scatter(&rr[0], bi[0].id, SHARDD_REDUCE_MEAN);
  uint64_t rel = raw_send_release(&rr[0], bi[0].id, 1);
  Shardwire__Response *resp = test_raw_expect(&rr[0], rel, SHARDD_E_BUSY);
  cr_assert(resp->message && strstr(resp->message, "scatter") &&
                strstr(resp->message, "queued"),
            "the refusal names the scatter: %s", resp->message ? resp->message : "");
  shardwire__response__free_unpacked(resp, NULL);
  uint64_t sc1 = test_raw_send_scatter(&rr[1], bi[1].id, SHARDD_REDUCE_MEAN);
  shardwire__response__free_unpacked(test_raw_expect(&rr[0], sc0, SHARDD_OK), NULL);
  shardwire__response__free_unpacked(test_raw_expect(&rr[1], sc1, SHARDD_OK), NULL);
  for (uint32_t k = 0; k < WORLD; k++) {
    const float *red = bi[k].reduced;
    for (uint64_t j = 0; j < SHARD; j++)
      cr_assert_eq(red[j], grad_mean(0, k * SHARD + j), "rank %u: reduced[%" PRIu64
                   "] = %g", k, j, (double)red[j]);
    /* the scatter consumed the gradient: the gather area goes back now */
    uint64_t s = raw_send_release(&rr[k], bi[k].id, 1);
    shardwire__response__free_unpacked(test_raw_expect(&rr[k], s, SHARDD_OK), NULL);
    test_raw_close(&rr[k]);
  }
}
