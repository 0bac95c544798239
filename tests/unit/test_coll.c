/* test_coll.c — the collective engine (engine/coll.h) driven in process:
 * a loop of the test's own, a host backend, a registry, a job of world W
 * and an array of shardd__coll_member standing for its ranks. No socket,
 * no server, no dispatch: the done hook records every answer, the
 * job_quiet hook counts calls, and the test runs the loop until the
 * answers it expects have come. Values are written into the shard and
 * gradient areas through the host backend's mappings and every expected
 * result (concatenations, exact fp32 sums and means, an SGD update) is
 * computed here from the layout's definition, not with the engine's code. */
#include <criterion/criterion.h>
#include <criterion/logging.h>
#include <inttypes.h>
#include <math.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <uv.h>

#include "backend.h"
#include "coll.h"
#include "log.h"
#include "optreg.h"
#include "optspec.h"
#include "registry.h"

#define W 3
#define NDEV 2
#define CAPACITY (256ull << 20)
#define TIMEOUT 5.0
#define MAX_PENDING 4
#define MAX_REPLIES 256

typedef struct {
  shardd__coll_member *m;
  uint64_t seq;
  shardd_err code;
  int has_msg;
  char msg[512];
  int has_res;
  shardd__coll_result res;
} reply;

static uv_loop_t loop;
static shardd__backend *be;
static shardd__registry reg;
static shardd__job *job;
static shardd__coll_engine *eng;
static shardd__coll_member mem[W];
static reply replies[MAX_REPLIES];
static size_t nreplies;
static unsigned nquiet;
static shardd__job *quiet_job;
static char err[512];
static double grace; /* the engine's peer_grace; 0 unless a test sets it */

/* ---- hooks ------------------------------------------------------------ */

static void on_done(void *ctx, shardd__coll_member *m, uint64_t seq,
                    shardd_err code, const char *msg,
                    const shardd__coll_result *res) {
  cr_assert_eq(ctx, &replies, "the hooks' ctx is passed through");
  cr_assert_lt(nreplies, MAX_REPLIES, "too many replies");
  reply *r = &replies[nreplies++];
  memset(r, 0, sizeof *r);
  r->m = m;
  r->seq = seq;
  r->code = code;
  if (msg) {
    r->has_msg = 1;
    snprintf(r->msg, sizeof r->msg, "%s", msg);
  }
  if (res) {
    r->has_res = 1;
    r->res = *res;
  }
}

static void on_quiet(void *ctx, shardd__job *j) {
  cr_assert_eq(ctx, &replies);
  nquiet++;
  quiet_job = j;
}

/* ---- fixture ---------------------------------------------------------- */

static void make_engine(uint32_t max_pending, uint32_t max_inflight_gathers) {
  shardd__coll_config cfg = {
      .loop = &loop,
      .reg = &reg,
      .timeout = TIMEOUT,
      .peer_grace = grace,
      .max_pending = max_pending,
      .max_inflight_gathers = max_inflight_gathers,
      .hooks = {.ctx = &replies, .done = on_done, .job_quiet = on_quiet},
  };
  cr_assert_eq(shardd__coll_engine_create(&cfg, &eng), SHARDD_OK);
  cr_assert_not_null(eng);
}

static void setup(void) {
  grace = 0;
  nreplies = 0;
  nquiet = 0;
  quiet_job = NULL;
  cr_assert_eq(uv_loop_init(&loop), 0);
  cr_assert_eq(shardd__backend_host_create(NDEV, CAPACITY, &be, err, sizeof err),
               SHARDD_OK, "%s", err);
  shardd__registry_init(&reg, be);
  cr_assert_eq(shardd__job_get(&reg, "job", W, 1000, &job, err, sizeof err),
               SHARDD_OK, "%s", err);
  cr_assert_eq(job->local_ranks, W);
  for (uint32_t r = 0; r < W; r++)
    mem[r] = (shardd__coll_member){.job = job, .rank = r};
  make_engine(MAX_PENDING, 0);
}

/* Fails what still waits, lets what runs finish, then frees everything in
 * the order the daemon does (engine state of the job before the job). */
static void teardown(void) {
  if (eng) {
    for (uint32_t r = 0; r < W; r++)
      shardd__coll_member_lost(eng, &mem[r]);
    uv_run(&loop, UV_RUN_DEFAULT);
    cr_expect_eq(shardd__coll_inflight(eng, job), 0);
    shardd__coll_job_free(eng, job);
    shardd__coll_engine_stop(eng);
    shardd__coll_engine_destroy(eng);
    eng = NULL;
  }
  shardd__registry_free(&reg);
  if (be) {
    be->ops->destroy(be);
    be = NULL;
  }
  cr_expect_eq(uv_loop_close(&loop), 0, "the engine leaves no handle open");
}

TestSuite(coll, .init = setup, .fini = teardown, .timeout = 30);

/* ---- helpers ---------------------------------------------------------- */

static shardd__buffer *buf_new(const char *name, uint64_t numel) {
  shardd__buffer *b = NULL;
  int created = -1;
  shardd_err rc = shardd__buffer_register(&reg, job, name, SHARDD_DTYPE_FP32,
                                          numel, &b, &created, err, sizeof err);
  cr_assert_eq(rc, SHARDD_OK, "register %s: %s (%s)", name, shardd_err_name(rc),
               err);
  cr_assert_eq(created, 1);
  return b;
}

static float *shard_of(shardd__buffer *b, uint32_t r) {
  return (float *)((char *)b->blocks[r]->ptr + b->shard_off);
}
static float *gather_of(shardd__buffer *b, uint32_t r) {
  return (float *)((char *)b->blocks[r]->ptr + b->gather_off);
}
static float *grad_of(shardd__buffer *b, uint32_t r) {
  return (float *)((char *)b->blocks[r]->ptr + b->grad_off);
}
static float *reduced_of(shardd__buffer *b, uint32_t r) {
  return (float *)((char *)b->blocks[r]->ptr + b->reduced_off);
}

/* Shard value of rank r, element i, in round k: distinct per (k, r, i) and
 * exact in fp32 for the sizes used here. */
static float shard_val(int k, uint32_t r, uint64_t i) {
  return (float)(k * 4000000 + (int64_t)r * 1000000 + (int64_t)i) + 0.5f;
}

static void fill_shards(shardd__buffer *b, int k) {
  for (uint32_t r = 0; r < W; r++) {
    float *p = shard_of(b, r);
    for (uint64_t i = 0; i < b->shard_numel; i++)
      p[i] = shard_val(k, r, i);
  }
}

/* Every rank's gather area holds the shards in rank order. */
static void check_gathered(shardd__buffer *b, int k) {
  uint64_t s = b->shard_numel;
  for (uint32_t d = 0; d < W; d++) {
    const float *g = gather_of(b, d);
    for (uint64_t j = 0; j < b->padded_numel; j++) {
      float want = shard_val(k, (uint32_t)(j / s), j % s);
      if (g[j] != want)
        cr_assert_fail("rank %" PRIu32 " gather[%" PRIu64 "] = %.1f, want %.1f "
                       "(rank %" PRIu64 "'s shard element %" PRIu64 ")",
                       d, j, g[j], want, j / s, j % s);
    }
  }
}

/* Gradient of rank r at element j of the padded buffer: small integers so
 * sums and means over W ranks are exact in fp32. */
static float grad_val(uint32_t r, uint64_t j) {
  return (float)(j % 97) + (float)(r * 256) + (float)(r + 1) * 0.25f;
}

static void fill_grads(shardd__buffer *b) {
  for (uint32_t r = 0; r < W; r++) {
    float *g = grad_of(b, r);
    for (uint64_t j = 0; j < b->padded_numel; j++)
      g[j] = grad_val(r, j);
  }
}

/* Rank a's reduced shard = the sum (or mean) over ranks of their
 * gradients' elements [a*s, (a+1)*s). */
static void check_reduced(shardd__buffer *b, shardd_reduce_op op) {
  uint64_t s = b->shard_numel;
  for (uint32_t a = 0; a < W; a++) {
    const float *red = reduced_of(b, a);
    for (uint64_t i = 0; i < s; i++) {
      double sum = 0;
      for (uint32_t r = 0; r < W; r++)
        sum += grad_val(r, a * s + i);
      double want = op == SHARDD_REDUCE_MEAN ? sum / W : sum;
      if (fabs(red[i] - want) > 1e-6 * fabs(want))
        cr_assert_fail("%s: rank %" PRIu32 " reduced[%" PRIu64 "] = %f, want %f",
                       op == SHARDD_REDUCE_MEAN ? "mean" : "sum", a, i,
                       (double)red[i], want);
    }
  }
}

static shardd__coll_args gather_args(const shardd__buffer *b) {
  return (shardd__coll_args){.kind = SHARDD__COLL_GATHER,
                             .target = b->hdr.id,
                             .generation = b->hdr.generation};
}

static shardd__coll_args scatter_args(const shardd__buffer *b,
                                      shardd_reduce_op op) {
  return (shardd__coll_args){.kind = SHARDD__COLL_SCATTER,
                             .target = b->hdr.id,
                             .op = op,
                             .generation = b->hdr.generation};
}

static void submit(uint32_t rank, uint64_t seq, shardd__coll_args a) {
  shardd__coll_submit(eng, &mem[rank], seq, &a);
}

/* Runs the loop until n replies in all have come (the work goes to the
 * pool and completes on the loop); fails when the loop has nothing left. */
static void run_until(size_t n) {
  while (nreplies < n) {
    int more = uv_run(&loop, UV_RUN_ONCE);
    if (!more && nreplies < n)
      cr_assert_fail("loop ran dry with %zu replies of %zu expected", nreplies,
                     n);
  }
}

/* Runs the loop until nothing is left to run. */
static void run_idle(void) { uv_run(&loop, UV_RUN_DEFAULT); }

static const reply *find_reply(uint32_t rank, uint64_t seq) {
  const reply *found = NULL;
  for (size_t i = 0; i < nreplies; i++)
    if (replies[i].m == &mem[rank] && replies[i].seq == seq) {
      cr_assert_null(found, "rank %" PRIu32 " seq %" PRIu64 " answered twice",
                     rank, seq);
      found = &replies[i];
    }
  return found;
}

static size_t find_index(uint32_t rank, uint64_t seq) {
  for (size_t i = 0; i < nreplies; i++)
    if (replies[i].m == &mem[rank] && replies[i].seq == seq)
      return i;
  cr_assert_fail("no reply for rank %" PRIu32 " seq %" PRIu64, rank, seq);
  return 0;
}

static const reply *expect_reply(uint32_t rank, uint64_t seq, shardd_err code) {
  const reply *r = find_reply(rank, seq);
  cr_assert_not_null(r, "rank %" PRIu32 " seq %" PRIu64 " answered", rank, seq);
  cr_assert_eq(r->code, code, "rank %" PRIu32 " seq %" PRIu64 ": %s (%s), want %s",
               rank, seq, shardd_err_name(r->code), r->has_msg ? r->msg : "",
               shardd_err_name(code));
  if (code == SHARDD_OK)
    cr_assert(!r->has_msg, "a plain OK has no message: %s", r->msg);
  else
    cr_assert(r->has_msg && r->msg[0], "an error comes with a message");
  return r;
}

static void expect_msg(const reply *r, const char *part) {
  cr_assert(strstr(r->msg, part) != NULL, "message \"%s\" contains \"%s\"",
            r->msg, part);
}

static void expect_pending_zero(void) {
  for (uint32_t r = 0; r < W; r++)
    cr_assert_eq(mem[r].pending, 0, "rank %" PRIu32 " pending %" PRIu32, r,
                 mem[r].pending);
}

static double loop_s(void) { return (double)uv_now(&loop) / 1000.0; }

/* ---- matching ---------------------------------------------------------- */

/* 1,000,001 elements over 3 ranks: a padded last shard, and per-rank gather
 * units of more than one chunk (CHUNK_ELEMS 2^18). */
Test(coll, gather_waits_for_every_rank_then_concatenates) {
  shardd__buffer *b = buf_new("w", 1000001);
  cr_assert_eq(b->shard_numel, 333334);
  cr_assert_eq(b->padded_numel, 1000002);
  fill_shards(b, 0);
  submit(0, 10, gather_args(b));
  submit(1, 20, gather_args(b));
  run_idle();
  cr_assert_eq(nreplies, 0, "nothing answered before the last rank came");
  cr_assert_eq(shardd__coll_inflight(eng, job), 1);
  cr_assert_eq(mem[0].pending, 1);
  cr_assert_eq(mem[1].pending, 1);
  cr_assert_eq(mem[2].pending, 0);
  cr_assert_eq(gather_of(b, 0)[0], 0.0f, "no copy before the last rank came");
  submit(2, 30, gather_args(b));
  run_until(W);
  run_idle();
  cr_assert_eq(nreplies, W, "one reply per rank");
  for (uint32_t r = 0; r < W; r++) {
    const reply *rp = expect_reply(r, 10 * (r + 1), SHARDD_OK);
    cr_assert(!rp->has_res, "no step result for a gather");
  }
  check_gathered(b, 0);
  cr_assert_eq(b->gathers, 1);
  cr_assert_eq(shardd__coll_inflight(eng, job), 0);
  expect_pending_zero();
}

/* Requests libuv's pool holds for the loop (queued work, its completion
 * not yet delivered): a field of uv_loop_t's public struct, counted by
 * uv_queue_work until its after-work callback has run. */
static unsigned pool_requests(void) { return loop.active_reqs.count; }

/* A small gather on host memory is run whole by the loop thread during the
 * last rank's submit: no pool turn is queued for it (a worker's wake-up,
 * then the loop's through libuv's async), yet its answers still come after
 * the submit returns, on that very loop turn. */
Test(coll, small_gather_runs_on_the_loop_without_a_pool_turn) {
  shardd__buffer *b = buf_new("small", 300);
  fill_shards(b, 0);
  submit(0, 1, gather_args(b));
  submit(1, 1, gather_args(b));
  submit(2, 1, gather_args(b));
  cr_assert_eq(nreplies, 0, "never answered inside the submit");
  check_gathered(b, 0); /* the loop thread copied it in the submit */
  cr_assert_eq(pool_requests(), 0, "no pool work queued for a small gather");
  uv_run(&loop, UV_RUN_NOWAIT);
  cr_assert_eq(nreplies, W, "answered on the same loop turn");
  for (uint32_t r = 0; r < W; r++)
    expect_reply(r, 1, SHARDD_OK);
  cr_assert_eq(b->gathers, 1);
  cr_assert_eq(shardd__coll_inflight(eng, job), 0);
  expect_pending_zero();
  run_idle(); /* the engine's handles close once nothing is due */
}

/* Every rank submits gathers of b[0..n) as one bucket (one batch each). */
static void gather_bucket(shardd__buffer **b, uint32_t n, uint64_t seq) {
  for (uint32_t r = 0; r < W; r++) {
    shardd__coll_batch_begin(eng);
    for (uint32_t k = 0; k < n; k++) {
      shardd__coll_args a = gather_args(b[k]);
      a.bucket = 0xb0c;
      a.bucket_n = n;
      a.bucket_index = k;
      submit(r, seq, a);
    }
    shardd__coll_batch_end(eng);
  }
}

/* A bucket of small buffers (each rank's entries submitted between
 * batch_begin and batch_end, as one request) is, all ranks' sides
 * together, no bigger than one small collective: the loop thread runs
 * every entry at the last rank's batch_end, with no pool turn queued, and
 * each entry is answered after it, in order. */
Test(coll, small_bucket_runs_on_the_loop_without_a_pool_turn) {
  shardd__buffer *b[3] = {buf_new("n0", 96), buf_new("n1", 30), buf_new("n2", 300)};
  for (int k = 0; k < 3; k++)
    fill_shards(b[k], k);
  gather_bucket(b, 3, 5);
  cr_assert_eq(nreplies, 0, "never answered inside the submit");
  for (int k = 0; k < 3; k++)
    check_gathered(b[k], k);
  cr_assert_eq(pool_requests(), 0, "no pool work queued for a small bucket");
  uv_run(&loop, UV_RUN_NOWAIT);
  cr_assert_eq(nreplies, 3 * W, "every entry answered on the same loop turn");
  for (size_t i = 0; i < nreplies; i++) {
    cr_assert_eq(replies[i].code, SHARDD_OK);
    cr_assert(replies[i].has_res, "a bucket's entry has its result");
    cr_assert_eq(replies[i].res.target, b[i / W]->hdr.id,
                 "entries answered in start order");
  }
  expect_pending_zero();
  run_idle();
}

/* A bucket of 64 small scatters (each under the 256 KiB of one small
 * collective, 1.5 MiB over the ranks together), submitted as one request
 * by each rank: their bytes fit what the loop may copy for the request and
 * are too few to pay for waking a pool thread, so the loop thread reduces
 * every entry at the last rank's batch_end and no pool turn is queued
 * (waking one cost the loop more than such a bucket's reductions); every
 * entry is answered on that loop turn, its sum exact. A bucket of 3 MiB
 * or more (coll_run.c's BATCH_SPLIT_BYTES) within the budget may get a
 * pool turn beside the loop when there is a CPU to spare; one over the
 * budget goes to the pool; each as exact. */
#define NLOOP 64
static void scatter_bucket(shardd__buffer **b, uint64_t seq) {
  for (uint32_t r = 0; r < W; r++) {
    shardd__coll_batch_begin(eng);
    for (uint32_t k = 0; k < NLOOP; k++) {
      shardd__coll_args a = scatter_args(b[k], SHARDD_REDUCE_SUM);
      a.bucket = 0x5ca7 + seq;
      a.bucket_n = NLOOP;
      a.bucket_index = k;
      submit(r, seq, a);
    }
    shardd__coll_batch_end(eng);
  }
}

/* NLOOP buffers of numel each, named prefix<k>, their gradients filled;
 * the bucket's bytes over the ranks */
static uint64_t loop_bufs(shardd__buffer **b, const char *prefix,
                          uint64_t numel) {
  uint64_t bytes = 0;
  for (int k = 0; k < NLOOP; k++) {
    char name[16];
    snprintf(name, sizeof name, "%s%d", prefix, k);
    b[k] = buf_new(name, numel);
    fill_grads(b[k]);
    bytes += b[k]->padded_numel * 4 * W;
  }
  return bytes;
}

static void expect_bucket_answered(shardd__buffer **b) {
  for (int k = 0; k < NLOOP; k++)
    check_reduced(b[k], SHARDD_REDUCE_SUM);
  cr_assert_eq(nreplies, NLOOP * W, "every entry answered");
  for (size_t i = 0; i < nreplies; i++) {
    cr_assert_eq(replies[i].code, SHARDD_OK);
    cr_assert(replies[i].has_res, "a bucket's entry has its result");
  }
  expect_pending_zero();
}

Test(coll, bucket_within_the_loops_budget_runs_on_the_loop_without_a_pool_turn) {
  shardd__coll_engine_destroy(eng);
  make_engine(NLOOP, 0);
  shardd__buffer *b[NLOOP], *big[NLOOP];
  uint64_t bytes = loop_bufs(b, "l", 2048);
  cr_assert_gt(bytes, 256u << 10, "more than one small collective's bytes");
  cr_assert_lt(bytes, 3u << 20, "under the size that gets a turn beside the loop");
  scatter_bucket(b, 3);
  cr_assert_eq(nreplies, 0, "never answered inside the submit");
  cr_assert_eq(pool_requests(), 0, "no pool work queued for the bucket");
  for (int k = 0; k < NLOOP; k++)
    check_reduced(b[k], SHARDD_REDUCE_SUM); /* reduced in the submit */
  uv_run(&loop, UV_RUN_NOWAIT);
  cr_assert_eq(nreplies, NLOOP * W, "every entry answered on the same loop turn");
  expect_bucket_answered(b);
  run_idle();
  /* over the budget (15 MiB over the ranks): the pool's turns */
  nreplies = 0;
  loop_bufs(big, "g", 20000);
  scatter_bucket(big, 4);
  cr_assert_gt(pool_requests(), 0, "a bucket over the budget goes to the pool");
  run_until(NLOOP * W);
  expect_bucket_answered(big);
  run_idle();
}

/* A bucket within the loop's budget and big enough (3.8 MiB over the
 * ranks) gets a turn beside the loop thread on a machine with a CPU to
 * spare (the first such bucket: later ones go whichever way took the
 * loop less time): the engine's helper thread's (coll_helper.c), or, with
 * none (SHARDD_NO_HELPER), a pool turn; the loop claims the bucket's
 * collectives with it, each run once by whichever thread claimed it, and
 * every entry's sum is exact; the next such bucket runs on the loop alone,
 * to time that way too. With one CPU the loop runs them alone (a turn
 * would only take turns with it). */
static void big_bucket_split(int helper) {
  shardd__coll_engine_destroy(eng);
  if (!helper)
    setenv("SHARDD_NO_HELPER", "1", 1);
  make_engine(NLOOP, 0);
  unsetenv("SHARDD_NO_HELPER");
  cpu_set_t set;
  cr_assert_eq(sched_getaffinity(0, sizeof set, &set), 0);
  int spare = CPU_COUNT(&set) > 1;
  shardd__buffer *b[NLOOP];
  uint64_t bytes = loop_bufs(b, "s", 5000);
  cr_assert_geq(bytes, 3u << 20, "big enough for a turn beside the loop");
  cr_assert_leq(bytes, 4u << 20, "within the loop's budget for a request");
  shardd__coll_counters before, after;
  shardd__coll_get_counters(eng, &before);
  scatter_bucket(b, 3);
  shardd__coll_get_counters(eng, &after);
  cr_assert_eq(nreplies, 0, "never answered inside the submit");
  cr_assert_eq(after.split - before.split, spare ? 1u : 0u,
               "a turn beside the loop with a CPU to spare, none without");
  if (!helper)
    cr_assert_eq(pool_requests() > 0, spare,
                 "the turn queued (its end, or its cancelling, comes back)");
  run_until(NLOOP * W);
  expect_bucket_answered(b);
  run_idle();
  cr_assert_eq(pool_requests(), 0, "the turn's end came back");
  /* the next one is timed the other way: the loop alone, on its turn */
  nreplies = 0;
  scatter_bucket(b, 4);
  shardd__coll_get_counters(eng, &before);
  cr_assert_eq(before.split, after.split, "the second bucket is not split");
  cr_assert_eq(pool_requests(), 0, "no pool work queued for it");
  uv_run(&loop, UV_RUN_NOWAIT);
  expect_bucket_answered(b);
  run_idle();
}

Test(coll, big_bucket_within_the_budget_gets_the_helper_beside_the_loop) {
  big_bucket_split(1);
}

Test(coll, big_bucket_within_the_budget_gets_a_pool_turn_without_the_helper) {
  big_bucket_split(0);
}

/* A split bucket whose ranks are all lost before the loop turns again
 * (their sessions closed right after sending it): the collectives the
 * loop completed on its turn and the turn's end (the helper's or the
 * pool's), which may come back after, each happen once, and nothing of
 * the bucket is left. */
static void split_bucket_lost_at_once(int helper) {
  shardd__coll_engine_destroy(eng);
  if (!helper)
    setenv("SHARDD_NO_HELPER", "1", 1);
  make_engine(NLOOP, 0);
  unsetenv("SHARDD_NO_HELPER");
  cpu_set_t set;
  cr_assert_eq(sched_getaffinity(0, sizeof set, &set), 0);
  if (CPU_COUNT(&set) < 2)
    cr_skip_test("one CPU: no bucket is split");
  shardd__buffer *b[NLOOP];
  loop_bufs(b, "s", 5000);
  shardd__coll_counters before, after;
  shardd__coll_get_counters(eng, &before);
  scatter_bucket(b, 3);
  shardd__coll_get_counters(eng, &after);
  cr_assert_eq(after.split - before.split, 1u, "the bucket was split");
  if (!helper)
    cr_assert_gt(pool_requests(), 0, "its turn's end is still to come");
  for (uint32_t r = 0; r < W; r++)
    shardd__coll_member_lost(eng, &mem[r]);
  run_idle();
  cr_assert_eq(pool_requests(), 0);
  cr_expect_eq(shardd__coll_inflight(eng, job), 0);
  for (int k = 0; k < NLOOP; k++)
    check_reduced(b[k], SHARDD_REDUCE_SUM); /* run whole, once */
  expect_pending_zero();
}

Test(coll, a_split_bucket_whose_ranks_are_lost_at_once_ends_once) {
  split_bucket_lost_at_once(1);
}

Test(coll, a_split_bucket_whose_ranks_are_lost_at_once_ends_once_on_the_pool) {
  split_bucket_lost_at_once(0);
}

/* A bucket's entries each make a collective, but the engine's work per
 * entry stays constant: a rank's entry is matched by looking at one queued
 * collective (its oldest unjoined one), not at every entry before it, and
 * the entries the last rank completes start in one scheduling pass (and
 * what their completions make ready in one more at most), not a pass over
 * the queue per entry each way. The results and the answers per entry are
 * those of the entries alone. */
#define NBUCKET 16
Test(coll, bucket_entries_are_matched_and_started_in_one_pass) {
  shardd__coll_engine_destroy(eng);
  make_engine(NBUCKET, 0);
  shardd__buffer *b[NBUCKET];
  for (int k = 0; k < NBUCKET; k++) {
    char name[16];
    snprintf(name, sizeof name, "u%d", k);
    b[k] = buf_new(name, 30 + 7 * (uint64_t)k);
    fill_shards(b[k], k);
  }
  shardd__coll_counters before, after;
  shardd__coll_get_counters(eng, &before);
  gather_bucket(b, NBUCKET, 9);
  run_until(NBUCKET * W);
  shardd__coll_get_counters(eng, &after);
  cr_assert_eq(after.made - before.made, NBUCKET, "one collective per entry");
  cr_assert_eq(after.matched - before.matched, (W - 1) * NBUCKET,
               "each later rank's entry looked at one queued collective, not "
               "the entries before it: %" PRIu64,
               after.matched - before.matched);
  cr_assert_leq(after.sched_passes - before.sched_passes, 2,
                "the entries start in one scheduling pass, not one each: %" PRIu64,
                after.sched_passes - before.sched_passes);
  cr_assert_leq(after.sched_visits - before.sched_visits, 2 * NBUCKET,
                "a pass looks at each entry once: %" PRIu64,
                after.sched_visits - before.sched_visits);
  for (int k = 0; k < NBUCKET; k++) {
    check_gathered(b[k], k);
    cr_assert_eq(b[k]->gathers, 1);
  }
  cr_assert_eq(nreplies, NBUCKET * W);
  for (size_t i = 0; i < nreplies; i++) {
    cr_assert_eq(replies[i].code, SHARDD_OK);
    cr_assert(replies[i].has_res, "a bucket's entry has its result");
  }
  expect_pending_zero();
  run_idle();
}

/* A rank's second bucket over the same buffers, sent before its first
 * ended, waits for it entry by entry: with a long queue (more than a few
 * collectives) the scheduling pass finds an older collective of a buffer
 * by a table of the buffers before, not by comparing each pair, and must
 * still find every one. The gathers of bucket 1 start and run on the loop
 * (their completion due later in the turn); the scatters of bucket 2 stay
 * queued, unstarted, until then; both are exact and in order after. */
Test(coll, a_second_bucket_over_the_same_buffers_waits_for_the_first) {
  shardd__coll_engine_destroy(eng);
  make_engine(2 * NBUCKET, 0);
  shardd__buffer *b[NBUCKET];
  for (int k = 0; k < NBUCKET; k++) {
    char name[16];
    snprintf(name, sizeof name, "u%d", k);
    b[k] = buf_new(name, 30 + 7 * (uint64_t)k);
    fill_shards(b[k], k);
    fill_grads(b[k]);
  }
  for (uint32_t r = 0; r < W; r++)
    for (uint64_t seq = 1; seq <= 2; seq++) {
      shardd__coll_batch_begin(eng);
      for (uint32_t k = 0; k < NBUCKET; k++) {
        shardd__coll_args a = seq == 1 ? gather_args(b[k])
                                       : scatter_args(b[k], SHARDD_REDUCE_SUM);
        a.bucket = 0xb0c + seq;
        a.bucket_n = NBUCKET;
        a.bucket_index = k;
        submit(r, seq, a);
      }
      shardd__coll_batch_end(eng);
    }
  cr_assert_eq(shardd__coll_inflight(eng, job), 2 * NBUCKET);
  for (int k = 0; k < NBUCKET; k++)
    for (uint32_t r = 0; r < W; r++)
      cr_assert_eq(shardd__coll_scattering(eng, b[k], r), 1,
                   "the scatter of buffer %d started beside its gather", k);
  cr_assert_eq(nreplies, 0);
  run_until(2 * NBUCKET * W);
  for (int k = 0; k < NBUCKET; k++) {
    check_gathered(b[k], k);
    check_reduced(b[k], SHARDD_REDUCE_SUM);
  }
  for (uint32_t r = 0; r < W; r++) {
    size_t last1 = 0, first2 = SIZE_MAX;
    for (size_t i = 0; i < nreplies; i++) {
      cr_assert_eq(replies[i].code, SHARDD_OK, "%s", replies[i].msg);
      if (replies[i].m == &mem[r] && replies[i].seq == 1)
        last1 = i;
      if (replies[i].m == &mem[r] && replies[i].seq == 2 && i < first2)
        first2 = i;
    }
    cr_assert_lt(last1, first2, "rank %u: a scatter answered before a gather", r);
  }
  expect_pending_zero();
  run_idle();
}

/* A bucket's collectives take the memory of those that ended before them
 * (a freed collective's block is kept for the next one of its size, not
 * given back to malloc and asked for again, once per entry), and nothing
 * of an ended one leaks into the next: a bucket of scatters (masks,
 * accumulation) then one of gathers, each exact, answered once per entry,
 * every later collective on a reused block. */
static shardd__view *view_new(shardd__buffer *b, const char *name, uint64_t off,
                              uint64_t n);
Test(coll, bucket_collectives_reuse_the_memory_of_ended_ones) {
  shardd__coll_engine_destroy(eng);
  make_engine(NBUCKET, 0);
  shardd__buffer *b[NBUCKET];
  for (int k = 0; k < NBUCKET; k++) {
    char name[16];
    snprintf(name, sizeof name, "m%d", k);
    b[k] = buf_new(name, 30 + 7 * (uint64_t)k);
    fill_grads(b[k]);
  }
  /* rank 0 sends no gradient for the first entry's one view */
  uint64_t none = view_new(b[0], "mv", 0, b[0]->numel)->hdr.id;
  for (uint32_t r = 0; r < W; r++) {
    shardd__coll_batch_begin(eng);
    for (uint32_t k = 0; k < NBUCKET; k++) {
      shardd__coll_args a = scatter_args(b[k], SHARDD_REDUCE_SUM);
      a.bucket = 0x5eed;
      a.bucket_n = NBUCKET;
      a.bucket_index = k;
      if (r == 0 && k == 0) {
        a.no_grad = &none;
        a.nno_grad = 1;
      }
      submit(r, 3, a);
    }
    shardd__coll_batch_end(eng);
  }
  run_until(NBUCKET * W);
  for (int k = 1; k < NBUCKET; k++)
    check_reduced(b[k], SHARDD_REDUCE_SUM);
  shardd__coll_counters before, after;
  shardd__coll_get_counters(eng, &before);
  size_t first = nreplies;
  for (int k = 0; k < NBUCKET; k++)
    fill_shards(b[k], k + 7);
  gather_bucket(b, NBUCKET, 4);
  run_until(first + NBUCKET * W);
  shardd__coll_get_counters(eng, &after);
  cr_assert_eq(after.made - before.made, NBUCKET, "one collective per entry");
#if defined(__SANITIZE_ADDRESS__)
  /* none is kept under AddressSanitizer (coll_int.h's COLL_SPARE_BYTES), so
   * it still sees a freed collective's use: the rest of the test holds */
  const uint64_t want_reused = 0;
#else
  const uint64_t want_reused = NBUCKET;
#endif
  cr_assert_eq(after.reused - before.reused, want_reused,
               "each on an ended collective's memory: %" PRIu64 " of %" PRIu64,
               after.reused - before.reused, want_reused);
  for (int k = 0; k < NBUCKET; k++)
    check_gathered(b[k], k + 7);
  cr_assert_eq(nreplies, first + NBUCKET * W, "each entry answered once");
  for (size_t i = first; i < nreplies; i++) {
    cr_assert_eq(replies[i].code, SHARDD_OK);
    cr_assert(replies[i].has_res, "a bucket's entry has its result");
    cr_assert_eq(replies[i].seq, 4);
  }
  expect_pending_zero();
  run_idle();
}

/* The reply of rank's entry for target in its request seq. */
static const reply *entry_reply(uint32_t rank, uint64_t seq, uint64_t target) {
  const reply *found = NULL;
  for (size_t i = 0; i < nreplies; i++)
    if (replies[i].m == &mem[rank] && replies[i].seq == seq &&
        replies[i].has_res && replies[i].res.target == target) {
      cr_assert_null(found, "rank %" PRIu32 " seq %" PRIu64 " entry %" PRIu64
                     " answered twice", rank, seq, target);
      found = &replies[i];
    }
  return found;
}

/* A bucket whose entry meets a collective sent otherwise (ranks 0 and 1
 * gathered b alone first, rank 2 sends its bucket [a, b] first) fails
 * that collective for every rank and the entries of the disagreeing
 * requests that had not started; an entry the last rank completed before
 * (a) started at its arrival and runs, as it did when each entry was
 * scheduled on its own, though the bucket's starts now wait for its end. */
Test(coll, bucket_mismatch_spares_the_entries_that_started_before_it) {
  shardd__buffer *a = buf_new("a", 300), *b = buf_new("b", 300);
  fill_shards(a, 1);
  uint64_t sig = 0xfeed;
  for (uint32_t r = 0; r < 2; r++) {
    submit(r, 1, gather_args(b)); /* alone */
    shardd__coll_batch_begin(eng);
    for (uint32_t k = 0; k < 2; k++) {
      shardd__coll_args g = gather_args(k == 0 ? a : b);
      g.bucket = sig;
      g.bucket_n = 2;
      g.bucket_index = k;
      submit(r, 2, g);
    }
    shardd__coll_batch_end(eng);
  }
  cr_assert_eq(nreplies, 0);
  shardd__coll_batch_begin(eng);
  for (uint32_t k = 0; k < 2; k++) {
    shardd__coll_args g = gather_args(k == 0 ? a : b);
    g.bucket = sig;
    g.bucket_n = 2;
    g.bucket_index = k;
    submit(2, 1, g);
  }
  shardd__coll_batch_end(eng);
  run_until(5);
  /* b alone met rank 2's entry b: every rank's fails */
  for (uint32_t r = 0; r < W; r++) {
    /* ranks 0 and 1 sent b alone: their answer has no entry's result;
     * rank 2's entry b has its own, though the collective it failed with
     * was made by a request alone */
    const reply *rp = r < 2 ? find_reply(r, 1) : entry_reply(r, 1, b->hdr.id);
    cr_assert_not_null(rp, "rank %" PRIu32 "'s b alone / entry b answered", r);
    cr_assert_eq(rp->has_res, r == 2, "rank %" PRIu32 ": an entry's result "
                 "goes with a bucket's entry, none with a request alone", r);
    cr_assert_eq(rp->code, SHARDD_E_MISMATCH, "rank %" PRIu32 ": %s", r,
                 shardd_err_name(rp->code));
    expect_msg(rp, "every rank must send the same buffers in the same order");
  }
  /* entry a: every rank had sent it and it had started: it ran */
  for (uint32_t r = 0; r < W; r++) {
    const reply *rp = entry_reply(r, r < 2 ? 2 : 1, a->hdr.id);
    cr_assert_not_null(rp, "rank %" PRIu32 "'s entry a answered", r);
    cr_assert_eq(rp->code, SHARDD_OK, "rank %" PRIu32 "'s entry a: %s (%s)", r,
                 shardd_err_name(rp->code), rp->has_msg ? rp->msg : "");
  }
  check_gathered(a, 1);
  cr_assert_eq(a->gathers, 1);
  cr_assert_eq(b->gathers, 0);
}

/* A gather sent alone that meets the collective the ranks before it made
 * from their buckets fails with them, and its answer is a request's, not
 * an entry's: the dispatcher takes an answer with a gather's result for a
 * completed gather (it read the gather area from it and crashed on the
 * empty one). Each rank's entry keeps its own result. */
Test(coll, gather_alone_meeting_a_bucket_fails_without_an_entry_result) {
  shardd__buffer *a = buf_new("a", 300);
  for (uint32_t r = 0; r < 2; r++) {
    shardd__coll_args g = gather_args(a);
    g.bucket = 0xabc;
    g.bucket_n = 1;
    g.bucket_index = 0;
    shardd__coll_batch_begin(eng);
    submit(r, 4, g);
    shardd__coll_batch_end(eng);
  }
  submit(2, 4, gather_args(a));
  run_until(W);
  for (uint32_t r = 0; r < W; r++) {
    const reply *rp = expect_reply(r, 4, SHARDD_E_MISMATCH);
    cr_assert_eq(rp->has_res, r < 2, "rank %" PRIu32 ": an entry's result only "
                 "for a bucket's entry", r);
    if (r < 2)
      cr_assert_eq(rp->res.target, a->hdr.id);
  }
  cr_assert_eq(a->gathers, 0);
  expect_pending_zero();
}

static shardd__buffer *check_buf;
static int check_calls, timer_fired;
static uv_idle_t first_turn; /* only so the first poll does not block */

static void on_first_turn(uv_idle_t *h) { (void)h; }

static void submit_in_check(uv_check_t *h) {
  if (check_calls++ > 0)
    return;
  uv_check_stop(h);
  uv_idle_stop(&first_turn);
  for (uint32_t r = 0; r < W; r++)
    submit(r, 7, gather_args(check_buf));
}

static void on_long_timer(uv_timer_t *t) {
  timer_fired = 1;
  uv_timer_stop(t);
}

/* The server's fair turns dispatch requests from a check callback: a small
 * collective submitted there still completes on the next loop turn, and
 * that turn's poll does not wait for unrelated I/O (here a timer due in
 * 3 s) first. */
Test(coll, small_gather_submitted_in_a_check_callback_completes_at_once, .timeout = 10) {
  check_buf = buf_new("small", 300);
  fill_shards(check_buf, 1);
  check_calls = timer_fired = 0;
  uv_check_t chk;
  uv_timer_t tm;
  uv_check_init(&loop, &chk);
  uv_timer_init(&loop, &tm);
  uv_idle_init(&loop, &first_turn);
  uv_check_start(&chk, submit_in_check);
  uv_idle_start(&first_turn, on_first_turn);
  uv_timer_start(&tm, on_long_timer, 3000, 0);
  for (int i = 0; i < 4 && nreplies < W; i++)
    uv_run(&loop, UV_RUN_ONCE);
  cr_assert_eq(timer_fired, 0, "the answers did not wait for the timer");
  cr_assert_eq(nreplies, W, "answered within a few loop turns");
  for (uint32_t r = 0; r < W; r++)
    expect_reply(r, 7, SHARDD_OK);
  check_gathered(check_buf, 1);
  uv_close((uv_handle_t *)&chk, NULL);
  uv_close((uv_handle_t *)&tm, NULL);
  uv_close((uv_handle_t *)&first_turn, NULL);
  run_idle();
}

Test(coll, scatter_sum_then_mean) {
  /* shard 333334: two scatter chunks per owner */
  shardd__buffer *b = buf_new("g", 1000001);
  fill_grads(b);
  for (uint32_t r = 0; r < W; r++)
    submit(r, 1, scatter_args(b, SHARDD_REDUCE_SUM));
  run_until(W);
  for (uint32_t r = 0; r < W; r++)
    expect_reply(r, 1, SHARDD_OK);
  check_reduced(b, SHARDD_REDUCE_SUM);
  cr_assert_eq(b->scatters, 1);

  for (uint32_t r = 0; r < W; r++)
    submit(W - 1 - r, 2, scatter_args(b, SHARDD_REDUCE_MEAN));
  run_until(2 * W);
  for (uint32_t r = 0; r < W; r++)
    expect_reply(r, 2, SHARDD_OK);
  check_reduced(b, SHARDD_REDUCE_MEAN);
  cr_assert_eq(b->scatters, 2);
  cr_assert_eq(b->gathers, 0);
  expect_pending_zero();
}

/* Rank 0 asks twice before anyone else asks once: its second request joins
 * the second collective, not the first, so the first completes with the
 * first round's data and the second with the second round's. */
Test(coll, rank_ahead_queues_behind) {
  shardd__buffer *b = buf_new("w", 1000);
  fill_shards(b, 1);
  submit(0, 1, gather_args(b));
  submit(0, 2, gather_args(b));
  cr_assert_eq(shardd__coll_inflight(eng, job), 2, "two collectives queued");
  cr_assert_eq(mem[0].pending, 2);
  submit(1, 1, gather_args(b));
  run_idle();
  cr_assert_eq(nreplies, 0);
  submit(2, 1, gather_args(b));
  run_until(W);
  run_idle();
  cr_assert_eq(nreplies, W, "only the first collective completed");
  for (uint32_t r = 0; r < W; r++)
    expect_reply(r, 1, SHARDD_OK);
  cr_assert_null(find_reply(0, 2), "rank 0's second gather still waits");
  cr_assert_eq(mem[0].pending, 1);
  check_gathered(b, 1);
  cr_assert_eq(shardd__coll_inflight(eng, job), 1);

  fill_shards(b, 2);
  submit(2, 2, gather_args(b));
  submit(1, 2, gather_args(b));
  run_until(2 * W);
  for (uint32_t r = 0; r < W; r++) {
    expect_reply(r, 2, SHARDD_OK);
    cr_assert_lt(find_index(r, 1), find_index(r, 2), "in submission order");
  }
  check_gathered(b, 2);
  cr_assert_eq(b->gathers, 2);
  expect_pending_zero();
}

/* Ranks that ask for two buffers in opposite orders are matched by target,
 * not by arrival: both collectives complete. */
Test(coll, matched_by_target_not_order) {
  shardd__buffer *a = buf_new("a", 600), *b = buf_new("b", 900);
  fill_shards(a, 1);
  fill_shards(b, 2);
  submit(0, 1, gather_args(a));
  submit(0, 2, gather_args(b));
  submit(1, 1, gather_args(b));
  submit(1, 2, gather_args(a));
  submit(2, 1, gather_args(a));
  submit(2, 2, gather_args(b));
  run_until(2 * W);
  for (uint32_t r = 0; r < W; r++) {
    expect_reply(r, 1, SHARDD_OK);
    expect_reply(r, 2, SHARDD_OK);
  }
  check_gathered(a, 1);
  check_gathered(b, 2);
  expect_pending_zero();
}

/* ---- conflicts --------------------------------------------------------- */

Test(coll, scatter_with_other_op_fails_every_rank) {
  shardd__buffer *b = buf_new("g", 999);
  fill_grads(b);
  submit(0, 5, scatter_args(b, SHARDD_REDUCE_SUM));
  submit(1, 6, scatter_args(b, SHARDD_REDUCE_MEAN));
  run_idle();
  cr_assert_eq(nreplies, 0, "the refusal waits for every rank");
  submit(2, 7, scatter_args(b, SHARDD_REDUCE_SUM));
  run_idle();
  cr_assert_eq(nreplies, W);
  for (uint32_t r = 0; r < W; r++) {
    const reply *rp = expect_reply(r, 5 + r, SHARDD_E_MISMATCH);
    expect_msg(rp, "rank 1");
    expect_msg(rp, "with other arguments");
    expect_msg(rp, "scatter");
  }
  for (uint32_t a = 0; a < W; a++)
    for (uint64_t i = 0; i < b->shard_numel; i++)
      cr_assert_eq(reduced_of(b, a)[i], 0.0f, "no shard was changed");
  cr_assert_eq(b->scatters, 0);
  cr_assert_eq(shardd__coll_inflight(eng, job), 0);
  expect_pending_zero();

  /* the queue is not stuck: agreeing ranks scatter next */
  for (uint32_t r = 0; r < W; r++)
    submit(r, 8, scatter_args(b, SHARDD_REDUCE_MEAN));
  run_until(2 * W);
  for (uint32_t r = 0; r < W; r++)
    expect_reply(r, 8, SHARDD_OK);
  check_reduced(b, SHARDD_REDUCE_MEAN);
}

/* ---- timeout and lost members ----------------------------------------- */

Test(coll, timeout_names_the_missing_rank) {
  shardd__buffer *b = buf_new("w", 300);
  double t0 = loop_s();
  submit(0, 1, gather_args(b));
  submit(2, 3, gather_args(b));
  shardd__coll_tick(eng, t0 + TIMEOUT - 1);
  cr_assert_eq(nreplies, 0, "nothing fails before the timeout");
  shardd__coll_tick(eng, t0 + TIMEOUT + 1);
  cr_assert_eq(nreplies, W - 1);
  for (uint32_t r = 0; r < W; r += 2) {
    const reply *rp = expect_reply(r, r + 1, SHARDD_E_PEER_LOST);
    expect_msg(rp, "timed out");
    expect_msg(rp, "waiting for rank 1");
    cr_assert_null(strstr(rp->msg, "rank 0"), "names only the missing: %s",
                   rp->msg);
    cr_assert_null(strstr(rp->msg, "rank 2"), "names only the missing: %s",
                   rp->msg);
  }
  cr_assert_eq(shardd__coll_inflight(eng, job), 0);
  expect_pending_zero();
  run_idle();
  cr_assert_eq(nreplies, W - 1, "nothing more comes");
  /* the hold is gone */
  cr_assert_eq(shardd__buffer_unregister(&reg, job, b->hdr.id, err, sizeof err),
               SHARDD_OK, "%s", err);
}

Test(coll, timeout_names_every_missing_rank) {
  shardd__buffer *b = buf_new("w", 300);
  double t0 = loop_s();
  submit(1, 1, gather_args(b));
  shardd__coll_tick(eng, t0 + TIMEOUT + 1);
  const reply *rp = expect_reply(1, 1, SHARDD_E_PEER_LOST);
  expect_msg(rp, "waiting for ranks 0, 2");
  cr_assert_eq(shardd__coll_inflight(eng, job), 0);
  expect_pending_zero();
}

Test(coll, member_lost_fails_the_waiting) {
  shardd__buffer *b = buf_new("w", 300);
  fill_shards(b, 0);
  submit(0, 1, gather_args(b));
  submit(1, 2, gather_args(b));
  shardd__coll_member_lost(eng, &mem[1]);
  const reply *rp = expect_reply(0, 1, SHARDD_E_PEER_LOST);
  expect_msg(rp, "rank 1");
  expect_msg(rp, "disconnected before");
  expect_msg(rp, "gather");
  cr_assert_null(find_reply(2, 0), "a rank that never asked is not answered");
  /* (the lost rank's own request: see lost_rank_own_request_answered) */
  cr_assert_eq(shardd__coll_inflight(eng, job), 0);
  expect_pending_zero();
  run_idle();
  for (uint64_t i = 0; i < b->padded_numel; i++)
    cr_assert_eq(gather_of(b, 0)[i], 0.0f, "nothing was copied");
  cr_assert_eq(b->gathers, 0);
  cr_assert_eq(shardd__buffer_unregister(&reg, job, b->hdr.id, err, sizeof err),
               SHARDD_OK, "%s", err);
}

/* The lost rank itself is not answered (it is going away; answering it
 * would reach into whatever freed it), yet its pending count returns to 0
 * and the ranks that stay are failed. */
Test(coll, lost_rank_own_request_not_answered) {
  shardd__buffer *b = buf_new("w", 300);
  submit(0, 1, gather_args(b));
  submit(1, 2, gather_args(b));
  shardd__coll_member_lost(eng, &mem[1]);
  cr_assert_null(find_reply(1, 2), "the lost member is not answered");
  expect_reply(0, 1, SHARDD_E_PEER_LOST);
  expect_pending_zero();
}

/* A collective already running when a rank goes away completes; the
 * others are answered, the lost one is forgotten. */
Test(coll, member_lost_while_running_is_forgotten) {
  shardd__buffer *b = buf_new("w", 1000001);
  fill_shards(b, 3);
  for (uint32_t r = 0; r < W; r++)
    submit(r, 1, gather_args(b));
  cr_assert_eq(nreplies, 0, "started, not done");
  shardd__coll_member_lost(eng, &mem[1]);
  cr_assert_eq(mem[1].pending, 0);
  cr_assert_eq(nreplies, 0, "a running collective is not failed");
  run_until(W - 1);
  run_idle();
  cr_assert_eq(nreplies, W - 1);
  expect_reply(0, 1, SHARDD_OK);
  expect_reply(2, 1, SHARDD_OK);
  cr_assert_null(find_reply(1, 1), "the lost member is not answered");
  check_gathered(b, 3);
  cr_assert_eq(shardd__coll_inflight(eng, job), 0);
  expect_pending_zero();
}

/* ---- limits and refusals ---------------------------------------------- */

Test(coll, max_pending_refused) {
  shardd__buffer *b = buf_new("w", 300);
  for (uint64_t s = 1; s <= MAX_PENDING; s++)
    submit(0, s, gather_args(b));
  cr_assert_eq(nreplies, 0);
  cr_assert_eq(mem[0].pending, MAX_PENDING);
  submit(0, 99, scatter_args(b, SHARDD_REDUCE_SUM));
  cr_assert_eq(nreplies, 1, "answered at once");
  const reply *rp = expect_reply(0, 99, SHARDD_E_LIMIT);
  expect_msg(rp, "(--max-pending 4)");
  cr_assert_eq(mem[0].pending, MAX_PENDING, "a refusal is not pending");
  cr_assert_eq(shardd__coll_inflight(eng, job), MAX_PENDING);
  /* the others are not limited by rank 0's queue, and the queued ones
   * complete once everyone came */
  for (uint64_t s = 1; s <= MAX_PENDING; s++) {
    submit(1, s, gather_args(b));
    submit(2, s, gather_args(b));
  }
  run_until(1 + W * MAX_PENDING);
  for (uint32_t r = 0; r < W; r++)
    for (uint64_t s = 1; s <= MAX_PENDING; s++)
      expect_reply(r, s, SHARDD_OK);
  expect_pending_zero();
}

Test(coll, max_inflight_gathers_refused) {
  shardd__coll_engine_destroy(eng);
  make_engine(MAX_PENDING, 2);
  shardd__buffer *a = buf_new("a", 300), *b = buf_new("b", 300);
  submit(0, 1, gather_args(a));
  submit(0, 2, gather_args(b));
  submit(0, 3, gather_args(a));
  cr_assert_eq(nreplies, 1);
  const reply *rp = expect_reply(0, 3, SHARDD_E_LIMIT);
  expect_msg(rp, "rank 0");
  expect_msg(rp, "--max-inflight-gathers 2");
  /* a scatter is not a gather, and another rank has its own count */
  submit(0, 4, scatter_args(a, SHARDD_REDUCE_SUM));
  submit(1, 1, gather_args(a));
  cr_assert_eq(nreplies, 1, "neither is refused");
  cr_assert_eq(mem[0].pending, 3);
  cr_assert_eq(mem[1].pending, 1);
  /* a bucket is one request: its 3 entries count once (checked at its
   * first), so rank 2 holds 2 and a third gather is refused */
  shardd__buffer *bk[3] = {buf_new("c", 300), buf_new("d", 300), buf_new("e", 300)};
  for (uint32_t i = 0; i < 3; i++) {
    shardd__coll_args g = gather_args(bk[i]);
    g.bucket = 0x5eed;
    g.bucket_n = 3;
    g.bucket_index = i;
    submit(2, 1, g);
  }
  shardd__buffer *f = buf_new("f", 300);
  submit(2, 2, gather_args(f));
  cr_assert_eq(nreplies, 1, "the bucket and one gather fit 2");
  submit(2, 3, gather_args(f));
  expect_msg(expect_reply(2, 3, SHARDD_E_LIMIT), "rank 2 has 2 gathers in flight");
}

Test(coll, unknown_and_wrong_targets_refused) {
  shardd__buffer *b = buf_new("w", 300);
  shardd__job *other = NULL;
  cr_assert_eq(shardd__job_get(&reg, "other", W, 1000, &other, err, sizeof err),
               SHARDD_OK, "%s", err);
  shardd__buffer *ob = NULL;
  int created;
  cr_assert_eq(shardd__buffer_register(&reg, other, "x", SHARDD_DTYPE_FP32, 30,
                                       &ob, &created, err, sizeof err),
               SHARDD_OK, "%s", err);
  shardd__view *v = NULL;
  int64_t shape[1] = {10};
  cr_assert_eq(shardd__view_register_ex(&reg, job, b->hdr.id, 0, "v", 0, 10,
                                        shape, 1, 1, &v, &created, err,
                                        sizeof err),
               SHARDD_OK, "%s", err);

  char never[32];
  snprintf(never, sizeof never, "%" PRIu64, (uint64_t)999999);
  struct {
    shardd__coll_args a;
    shardd_err code;
    const char *part;
  } cases[] = {
      {{.kind = SHARDD__COLL_GATHER, .target = 999999}, SHARDD_E_NOT_FOUND,
       "no buffer has id 999999"},
      {{.kind = SHARDD__COLL_SCATTER, .target = 999999}, SHARDD_E_NOT_FOUND,
       "999999"},
      {{.kind = SHARDD__COLL_STEP, .target = 999999}, SHARDD_E_NOT_FOUND,
       "no optimizer has id 999999"},
      {{.kind = SHARDD__COLL_GATHER, .target = ob->hdr.id}, SHARDD_E_NOT_OWNED,
       "not owned by job \"job\""},
      {{.kind = SHARDD__COLL_GATHER, .target = v->hdr.id}, SHARDD_E_INVAL,
       "is a view, not a buffer"},
      {{.kind = SHARDD__COLL_STEP, .target = b->hdr.id}, SHARDD_E_INVAL,
       "not an optimizer"},
      {{.kind = SHARDD__COLL_GATHER, .target = b->hdr.id,
        .generation = b->hdr.generation + 1},
       SHARDD_E_STALE, "stale"},
  };
  size_t n = sizeof cases / sizeof cases[0];
  for (size_t i = 0; i < n; i++) {
    submit(0, 100 + i, cases[i].a);
    cr_assert_eq(nreplies, i + 1, "case %zu answered at once", i);
    const reply *rp = expect_reply(0, 100 + i, cases[i].code);
    expect_msg(rp, cases[i].part);
  }
  cr_assert_eq(mem[0].pending, 0);
  cr_assert_eq(shardd__coll_inflight(eng, job), 0);
  run_idle();
  cr_assert_eq(nreplies, n);
  cr_assert_eq(nquiet, 0, "no collective existed");
}

/* An unregistered buffer's id: unknown; once its name is registered again:
 * stale, naming the current handle. */
Test(coll, freed_and_reregistered_ids) {
  shardd__buffer *b = buf_new("w", 300);
  uint64_t old = b->hdr.id, gen = b->hdr.generation;
  cr_assert_eq(shardd__buffer_unregister(&reg, job, old, err, sizeof err),
               SHARDD_OK, "%s", err);
  submit(0, 1, (shardd__coll_args){.kind = SHARDD__COLL_GATHER, .target = old});
  expect_msg(expect_reply(0, 1, SHARDD_E_NOT_FOUND), "no longer exists");
  shardd__buffer *b2 = buf_new("w", 300);
  cr_assert_neq(b2->hdr.id, old);
  submit(0, 2, (shardd__coll_args){.kind = SHARDD__COLL_GATHER, .target = old,
                                   .generation = gen});
  const reply *rp = expect_reply(0, 2, SHARDD_E_STALE);
  char cur[64];
  snprintf(cur, sizeof cur, "buffer %" PRIu64, b2->hdr.id);
  expect_msg(rp, cur);
  /* the current handle with its generation works */
  fill_shards(b2, 0);
  for (uint32_t r = 0; r < W; r++)
    submit(r, 3, gather_args(b2));
  run_until(2 + W);
  for (uint32_t r = 0; r < W; r++)
    expect_reply(r, 3, SHARDD_OK);
  check_gathered(b2, 0);
}

/* ---- holds -------------------------------------------------------------- */

Test(coll, queued_gather_holds_the_buffer) {
  shardd__buffer *b = buf_new("w", 300);
  uint64_t id = b->hdr.id;
  submit(0, 1, gather_args(b));
  submit(1, 1, gather_args(b));
  err[0] = 0;
  cr_assert_eq(shardd__buffer_unregister(&reg, job, id, err, sizeof err),
               SHARDD_E_BUSY);
  cr_assert(strstr(err, "in flight"), "%s", err);
  submit(2, 1, gather_args(b));
  /* running: still held */
  cr_assert_eq(shardd__buffer_unregister(&reg, job, id, err, sizeof err),
               SHARDD_E_BUSY);
  run_until(W);
  for (uint32_t r = 0; r < W; r++)
    expect_reply(r, 1, SHARDD_OK);
  cr_assert_eq(shardd__buffer_unregister(&reg, job, id, err, sizeof err),
               SHARDD_OK, "%s", err);
}

/* ---- job_quiet ---------------------------------------------------------- */

Test(coll, job_quiet_after_the_last_collective) {
  shardd__buffer *a = buf_new("a", 300), *b = buf_new("b", 300);
  for (uint32_t r = 0; r < W; r++)
    submit(r, 1, gather_args(a));
  submit(0, 2, gather_args(b));
  run_until(W);
  run_idle();
  cr_assert_eq(nquiet, 0, "b's gather still waits");
  cr_assert_eq(shardd__coll_inflight(eng, job), 1);
  submit(1, 2, gather_args(b));
  submit(2, 2, gather_args(b));
  run_until(2 * W);
  run_idle();
  cr_assert_eq(nquiet, 1, "called once, after the last");
  cr_assert_eq(quiet_job, job);
  cr_assert_eq(shardd__coll_inflight(eng, job), 0);
  /* and again after the next quiet period */
  for (uint32_t r = 0; r < W; r++)
    submit(r, 3, scatter_args(a, SHARDD_REDUCE_SUM));
  run_until(3 * W);
  run_idle();
  cr_assert_eq(nquiet, 2);
}

/* job_quiet comes when the job's last collective ended, whichever way it
 * ended: a timeout, a lost member and a mismatch refusal end it too (they
 * did not call the hook at first, and an owner waiting for quiet to
 * release the job never heard). */
Test(coll, job_quiet_after_timeout) {
  shardd__buffer *b = buf_new("w", 300);
  submit(0, 1, gather_args(b));
  shardd__coll_tick(eng, loop_s() + TIMEOUT + 1);
  expect_reply(0, 1, SHARDD_E_PEER_LOST);
  cr_assert_eq(shardd__coll_inflight(eng, job), 0);
  run_idle();
  cr_expect_eq(nquiet, 1, "job_quiet not called when the last "
                          "collective of the job timed out");
}

Test(coll, job_quiet_after_member_lost) {
  shardd__buffer *b = buf_new("w", 300);
  submit(0, 1, gather_args(b));
  submit(1, 1, gather_args(b));
  shardd__coll_member_lost(eng, &mem[1]);
  expect_reply(0, 1, SHARDD_E_PEER_LOST);
  cr_assert_eq(shardd__coll_inflight(eng, job), 0);
  run_idle();
  cr_expect_eq(nquiet, 1, "job_quiet not called when the last "
                          "collective of the job failed on member_lost");
}

Test(coll, job_quiet_after_mismatch) {
  shardd__buffer *b = buf_new("w", 300);
  submit(0, 1, scatter_args(b, SHARDD_REDUCE_SUM));
  submit(1, 1, scatter_args(b, SHARDD_REDUCE_MEAN));
  submit(2, 1, scatter_args(b, SHARDD_REDUCE_SUM));
  cr_assert_eq(nreplies, W);
  cr_assert_eq(shardd__coll_inflight(eng, job), 0);
  run_idle();
  cr_expect_eq(nquiet, 1, "job_quiet not called when the last "
                          "collective of the job was refused as a mismatch");
}

/* ---- a rank lost between collectives (--peer-grace) -------------------- */

/* A new engine with peer_grace g (the fixture's has 0). */
static void use_grace(double g) {
  shardd__coll_engine_destroy(eng);
  grace = g;
  make_engine(MAX_PENDING, 0);
}

/* rank stands for a relaunched trainer: a new member claims it. */
static void rejoin(uint32_t rank) {
  mem[rank] = (shardd__coll_member){.job = job, .rank = rank};
  shardd__coll_member_joined(eng, &mem[rank]);
}

/* Grace 0: a rank that left while nobody waited fails the next collective
 * its peers submit at once, naming it, instead of after the timeout. */
Test(coll, lost_between_collectives_fails_the_next_at_once) {
  shardd__buffer *b = buf_new("w", 300);
  shardd__coll_member_lost(eng, &mem[1]);
  cr_assert_eq(nreplies, 0, "nothing was waiting");
  submit(0, 1, gather_args(b));
  const reply *rp = expect_reply(0, 1, SHARDD_E_PEER_LOST);
  expect_msg(rp, "rank 1 of job \"job\" disconnected");
  expect_msg(rp, "--peer-grace");
  expect_msg(rp, "gather of buffer");
  cr_assert_null(strstr(rp->msg, "rank 2"), "names only the lost rank: %s", rp->msg);
  submit(2, 1, scatter_args(b, SHARDD_REDUCE_SUM));
  expect_reply(2, 1, SHARDD_E_PEER_LOST);
  cr_assert_eq(shardd__coll_inflight(eng, job), 0);
  expect_pending_zero();
  run_idle();
  cr_assert_eq(b->gathers, 0);
}

/* Rank 0 calls a collective the others never make (state_dict() on rank 0
 * only) while they wait in their next one: past the grace both sides fail
 * with E_MISMATCH, each naming the ranks that did not call theirs, instead
 * of waiting for the collective timeout. */
Test(coll, collective_some_ranks_skipped_fails_within_the_grace_naming_them) {
  use_grace(1.0);
  shardd__buffer *a = buf_new("a", 300), *b = buf_new("b", 300);
  double t0 = loop_s();
  submit(0, 1, gather_args(a));
  submit(1, 1, gather_args(b));
  submit(2, 1, gather_args(b));
  shardd__coll_tick(eng, t0 + 0.5);
  cr_assert_eq(nreplies, 0, "inside the grace nothing fails");
  shardd__coll_tick(eng, t0 + 1.5);
  cr_assert_eq(nreplies, W);
  const reply *rp = expect_reply(0, 1, SHARDD_E_MISMATCH);
  expect_msg(rp, "gather of buffer");
  expect_msg(rp, "(\"a\") was called by rank(s) 0 ");
  expect_msg(rp, "not by rank(s) 1, 2");
  expect_msg(rp, "rank 1 waits in gather of buffer");
  for (uint32_t r = 1; r < W; r++) {
    rp = expect_reply(r, 1, SHARDD_E_MISMATCH);
    expect_msg(rp, "(\"b\") was called by rank(s) 1, 2 ");
    expect_msg(rp, "not by rank(s) 0,");
  }
  cr_assert_eq(shardd__coll_inflight(eng, job), 0);
  expect_pending_zero();
}

/* A rank with nothing queued may be computing (a slow rank): what waits
 * for it is never failed early, even while another rank waits elsewhere,
 * only at the collective timeout. */
Test(coll, a_rank_with_nothing_queued_is_never_failed_early) {
  use_grace(0.2);
  shardd__buffer *a = buf_new("a", 300), *b = buf_new("b", 300);
  double t0 = loop_s();
  submit(0, 1, gather_args(a));
  submit(1, 1, gather_args(b));
  shardd__coll_tick(eng, t0 + 1.0);
  shardd__coll_tick(eng, t0 + TIMEOUT - 1);
  cr_assert_eq(nreplies, 0, "rank 2 may be computing: nothing fails early");
  shardd__coll_tick(eng, t0 + TIMEOUT + 1);
  expect_msg(expect_reply(0, 1, SHARDD_E_PEER_LOST), "timed out");
  expect_msg(expect_reply(1, 1, SHARDD_E_PEER_LOST), "timed out");
  expect_pending_zero();
}

/* A rank refused for something every collective depends on (its initial
 * values): the ranks already waiting fail with that refusal at once, and
 * the job's later collectives too, until the rank joins again. */
Test(coll, a_broken_job_fails_every_rank_with_the_refusal) {
  shardd__buffer *b = buf_new("w", 300);
  submit(0, 1, gather_args(b));
  shardd__coll_job_break(eng, job, 1, SHARDD_E_MISMATCH, "rank 1's initial values differ");
  expect_msg(expect_reply(0, 1, SHARDD_E_MISMATCH), "rank 1's initial values differ");
  submit(2, 1, gather_args(b));
  expect_msg(expect_reply(2, 1, SHARDD_E_MISMATCH), "rank 1's initial values differ");
  expect_pending_zero();
  /* a relaunch: its members joined after the refusal and are not refused
   * (the one of rank 1 last, after the others submitted) */
  rejoin(0);
  rejoin(2);
  submit(0, 2, gather_args(b));
  cr_assert_eq(nreplies, 2, "a relaunched rank is not refused");
  rejoin(1);
  for (uint32_t r = 1; r < W; r++)
    submit(r, 2, gather_args(b));
  run_until(nreplies + W);
  for (uint32_t r = 0; r < W; r++)
    expect_reply(r, 2, SHARDD_OK);
}

/* Grace 2 s: what waits when the rank goes, and what is submitted in the
 * grace, fails at the first tick past it, not before. */
Test(coll, lost_rank_fails_its_peers_past_the_grace) {
  use_grace(2.0);
  shardd__buffer *b = buf_new("w", 300);
  double t0 = loop_s();
  submit(0, 1, gather_args(b));
  shardd__coll_member_lost(eng, &mem[1]);
  submit(2, 1, gather_args(b));
  cr_assert_eq(nreplies, 0, "inside the grace nothing fails");
  shardd__coll_tick(eng, t0 + 1.0);
  cr_assert_eq(nreplies, 0, "inside the grace nothing fails");
  shardd__coll_tick(eng, t0 + 2.5);
  cr_assert_eq(nreplies, 2);
  for (uint32_t r = 0; r < W; r += 2) {
    const reply *rp = expect_reply(r, 1, SHARDD_E_PEER_LOST);
    expect_msg(rp, "rank 1 of job \"job\" disconnected");
    expect_msg(rp, "did not come back within --peer-grace 2 s");
  }
  cr_assert_eq(shardd__coll_inflight(eng, job), 0);
  expect_pending_zero();
  run_idle();
  cr_assert_eq(nquiet, 1, "the job went quiet");
}

/* Past the grace, a submit fails at once (no tick needed). */
Test(coll, lost_rank_past_the_grace_fails_a_submit_at_once) {
  use_grace(0.2);
  shardd__buffer *b = buf_new("w", 300);
  shardd__coll_member_lost(eng, &mem[2]);
  usleep(300 * 1000);
  uv_update_time(&loop);
  submit(0, 1, gather_args(b));
  expect_msg(expect_reply(0, 1, SHARDD_E_PEER_LOST), "rank 2 of job");
  expect_pending_zero();
}

/* A rank that comes back within the grace fails nobody: the collective
 * its peers wait in completes once it submits, with the right bytes. */
Test(coll, rank_back_within_the_grace_fails_nothing) {
  use_grace(2.0);
  shardd__buffer *b = buf_new("w", 300);
  fill_shards(b, 4);
  double t0 = loop_s();
  submit(0, 1, gather_args(b));
  shardd__coll_member_lost(eng, &mem[1]);
  cr_assert_gt(shardd__coll_rank_missing_s(eng, job, 1), -0.5);
  cr_assert_lt(shardd__coll_rank_missing_s(eng, job, 0), 0, "rank 0 is held");
  rejoin(1);
  cr_assert_lt(shardd__coll_rank_missing_s(eng, job, 1), 0, "rank 1 is back");
  shardd__coll_tick(eng, t0 + 3.0);
  cr_assert_eq(nreplies, 0, "a rank that came back fails nothing");
  submit(1, 1, gather_args(b));
  submit(2, 1, gather_args(b));
  run_until(W);
  for (uint32_t r = 0; r < W; r++)
    expect_reply(r, 1, SHARDD_OK);
  check_gathered(b, 4);
  expect_pending_zero();
}

/* Back after the grace (a relaunched trainer): the peers failed once, and
 * the collectives after its return work again. */
Test(coll, rank_back_after_the_grace_trains_again) {
  shardd__buffer *b = buf_new("w", 300);
  fill_shards(b, 5);
  shardd__coll_member_lost(eng, &mem[1]);
  submit(0, 1, gather_args(b));
  expect_reply(0, 1, SHARDD_E_PEER_LOST);
  rejoin(1);
  for (uint32_t r = 0; r < W; r++)
    submit(r, 2, gather_args(b));
  run_until(1 + W);
  for (uint32_t r = 0; r < W; r++)
    expect_reply(r, 2, SHARDD_OK);
  check_gathered(b, 5);
}

/* A job relaunched rank by rank: a rank that joined after another was lost
 * waits for it as at the job's start (up to the timeout), whatever the
 * grace, or a relaunch would fail on whichever rank started last. */
Test(coll, relaunched_ranks_wait_for_the_ones_still_starting) {
  shardd__buffer *b = buf_new("w", 300);
  fill_shards(b, 6);
  for (uint32_t r = 0; r < W; r++)
    shardd__coll_member_lost(eng, &mem[r]);
  double t0 = loop_s();
  rejoin(2);
  submit(2, 1, gather_args(b));
  rejoin(0);
  submit(0, 1, gather_args(b));
  shardd__coll_tick(eng, t0 + TIMEOUT - 1);
  cr_assert_eq(nreplies, 0, "relaunched ranks wait for rank 1");
  rejoin(1);
  submit(1, 1, gather_args(b));
  run_until(W);
  for (uint32_t r = 0; r < W; r++)
    expect_reply(r, 1, SHARDD_OK);
  check_gathered(b, 6);
}

/* Lost inside a collective it had submitted: its peers fail at once, the
 * grace notwithstanding (no return can complete it). */
Test(coll, lost_inside_a_collective_fails_at_once_under_a_grace) {
  use_grace(30.0);
  shardd__buffer *b = buf_new("w", 300);
  submit(0, 1, gather_args(b));
  submit(1, 1, gather_args(b));
  shardd__coll_member_lost(eng, &mem[1]);
  expect_msg(expect_reply(0, 1, SHARDD_E_PEER_LOST), "disconnected before");
  expect_pending_zero();
}

/* A multi-node job all of whose ranks on this node left (trainers stopped
 * to release it after a peer node died, or lingering): the tick's check
 * whether to abandon its fabric read every local rank's loss, every tick
 * (100 ms), as long as the job lasted, and found nothing to do. 16 jobs of
 * world 65536 over 2 nodes, 32768 ranks each here, all gone: 1000 ticks
 * (100 s of the daemon's life) are timed, and must cost what ticks of
 * jobs with nothing queued cost, not a billion reads. */
#define SPAN_JOBS 16
#define SPAN_WORLD 65536u
Test(coll, ticks_over_jobs_whose_ranks_on_this_node_all_left_are_quick) {
  static shardd__coll_member m[SPAN_WORLD / 2];
  char rdv[] = "/tmp/shardd-test-coll-XXXXXX";
  cr_assert_not_null(mkdtemp(rdv));
  shardd__job *jobs[SPAN_JOBS];
  for (int j = 0; j < SPAN_JOBS; j++) {
    char name[32];
    snprintf(name, sizeof name, "span-%02d", j);
    cr_assert_eq(shardd__job_get(&reg, name, SPAN_WORLD, 1000, &jobs[j], err, sizeof err),
                 SHARDD_OK, "%s", err);
    cr_assert_eq(shardd__coll_job_span(eng, jobs[j], 2, 0, rdv, "127.0.0.1", err,
                                       sizeof err),
                 SHARDD_OK, "%s", err);
    cr_assert_eq(jobs[j]->local_ranks, SPAN_WORLD / 2);
    /* every local rank joins, and leaves: nothing was queued */
    for (uint32_t r = 0; r < jobs[j]->local_ranks; r++) {
      m[r] = (shardd__coll_member){.job = jobs[j], .rank = jobs[j]->local_first + r};
      shardd__coll_member_joined(eng, &m[r]);
    }
    for (uint32_t r = 0; r < jobs[j]->local_ranks; r++)
      shardd__coll_member_lost(eng, &m[r]);
  }
  /* this thread's CPU time: a loaded machine's preemption is not the tick's */
  struct timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  double t0 = loop_s(), c0 = (double)ts.tv_sec + ts.tv_nsec / 1e9;
  for (int i = 1; i <= 1000; i++)
    shardd__coll_tick(eng, t0 + 0.1 * i);
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  double took = (double)ts.tv_sec + ts.tv_nsec / 1e9 - c0;
  /* walking the ranks: about 1 s unsanitized; now microseconds */
  cr_assert_lt(took, 0.1, "1000 ticks took %.3f s of CPU", took);
  cr_assert_eq(nreplies, 0);
  for (int j = 0; j < SPAN_JOBS; j++) {
    cr_assert_eq(shardd__coll_inflight(eng, jobs[j]), 0);
    shardd__coll_job_free(eng, jobs[j]);
  }
  rmdir(rdv);
}

/* Relaunching a wide job after all its ranks left: each rank's Hello
 * looked for it in the job's list of lost ranks, from the front, and the
 * swap-remove that took it out left the next rank one place further: 65536
 * rejoins cost 2^31 comparisons (about 30 us each, 1-2 s of the loop). Now
 * each rank knows its place in the list. */
#define REJOIN_WORLD 65536u
Test(coll, ranks_rejoining_a_wide_job_all_of_whose_ranks_left_are_quick) {
  static shardd__coll_member m[REJOIN_WORLD];
  shardd__job *wide;
  cr_assert_eq(shardd__job_get(&reg, "wide", REJOIN_WORLD, 1000, &wide, err,
                               sizeof err), SHARDD_OK, "%s", err);
  cr_assert_eq(wide->local_ranks, REJOIN_WORLD);
  shardd__log_set_level(SHARDD__LOG_WARN); /* not 65536 "is back" lines */
  for (uint32_t r = 0; r < REJOIN_WORLD; r++) {
    m[r] = (shardd__coll_member){.job = wide, .rank = r};
    shardd__coll_member_joined(eng, &m[r]);
  }
  for (uint32_t r = 0; r < REJOIN_WORLD; r++)
    shardd__coll_member_lost(eng, &m[r]);
  cr_assert_geq(shardd__coll_rank_missing_s(eng, wide, 0), 0);
  cr_assert_geq(shardd__coll_rank_missing_s(eng, wide, REJOIN_WORLD - 1), 0);
  /* this thread's CPU time: a loaded machine's preemption is not ours */
  struct timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  double c0 = (double)ts.tv_sec + ts.tv_nsec / 1e9;
  for (uint32_t r = 0; r < REJOIN_WORLD; r++) {
    m[r] = (shardd__coll_member){.job = wide, .rank = r};
    shardd__coll_member_joined(eng, &m[r]);
  }
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  double took = (double)ts.tv_sec + ts.tv_nsec / 1e9 - c0;
  shardd__log_set_level(SHARDD__LOG_INFO);
  /* the linear search: 1-2 s unsanitized; now milliseconds */
  cr_expect_lt(took, 0.1, "%u rejoins took %.3f s of CPU", REJOIN_WORLD, took);
  for (uint32_t r = 0; r < REJOIN_WORLD; r += 4099)
    cr_expect_lt(shardd__coll_rank_missing_s(eng, wide, r), 0,
                 "rank %u is still counted lost after it joined", r);
  cr_expect_lt(shardd__coll_rank_missing_s(eng, wide, REJOIN_WORLD - 1), 0);
  /* the bookkeeping still works: a rank lost again, and back */
  shardd__coll_member_lost(eng, &m[7]);
  cr_expect_geq(shardd__coll_rank_missing_s(eng, wide, 7), 0);
  cr_expect_lt(shardd__coll_rank_missing_s(eng, wide, 8), 0);
  shardd__coll_member_joined(eng, &m[7]);
  cr_expect_lt(shardd__coll_rank_missing_s(eng, wide, 7), 0);
  for (uint32_t r = 0; r < REJOIN_WORLD; r++)
    shardd__coll_member_lost(eng, &m[r]);
  shardd__coll_job_free(eng, wide);
}

/* What status reads: each queued collective, who has submitted it and who
 * not, as many of each as the caller has room for and the rest counted. */
Test(coll, describe_lists_arrivals) {
  shardd__buffer *a = buf_new("a", 300), *b = buf_new("b", 300);
  submit(0, 1, gather_args(a));
  submit(2, 2, gather_args(a));
  submit(1, 3, scatter_args(b, SHARDD_REDUCE_SUM));
  shardd__coll_info info;
  uint32_t in[W], out[W];
  shardd__coll_ranks rk = {.max = W, .arrived = in, .waiting = out};
  cr_assert_eq(shardd__coll_describe_ranks(eng, job, 0, &info, &rk), SHARDD_OK);
  cr_assert_eq(info.kind, SHARDD__COLL_GATHER);
  cr_assert_eq(info.target, a->hdr.id);
  cr_assert_str_eq(info.name, "a");
  cr_assert(!info.running);
  cr_assert_geq(info.waited_s, 0);
  cr_assert_eq(rk.n_arrived, 2u);
  cr_assert(in[0] == 0 && in[1] == 2);
  cr_assert_eq(rk.n_waiting, 1u);
  cr_assert_eq(out[0], 1u);
  cr_assert(rk.arrived_all == 2 && rk.waiting_all == 1);
  cr_assert_eq(shardd__coll_describe_ranks(eng, job, 1, &info, &rk), SHARDD_OK);
  cr_assert_eq(info.kind, SHARDD__COLL_SCATTER);
  cr_assert_str_eq(info.name, "b");
  cr_assert(rk.n_arrived == 1 && in[0] == 1);
  cr_assert(rk.n_waiting == 2 && out[0] == 0 && out[1] == 2);
  /* room for one of each: the lowest, the others counted */
  rk.max = 1;
  cr_assert_eq(shardd__coll_describe_ranks(eng, job, 0, &info, &rk), SHARDD_OK);
  cr_assert(rk.n_arrived == 1 && in[0] == 0 && rk.arrived_all == 2);
  cr_assert_eq(shardd__coll_describe_ranks(eng, job, 1, &info, &rk), SHARDD_OK);
  cr_assert(rk.n_waiting == 1 && out[0] == 0 && rk.waiting_all == 2);
  cr_assert_eq(shardd__coll_describe_ranks(eng, job, 2, &info, &rk), SHARDD_E_NOT_FOUND);
}

/* ---- all_reduce and barrier --------------------------------------------- */

static shardd__coll_args allreduce_args(const double *v, uint32_t n,
                                        shardd_reduce_op op) {
  return (shardd__coll_args){.kind = SHARDD__COLL_ALL_REDUCE,
                             .target = n,
                             .op = op,
                             .values = v};
}

/* Each rank's values; the expected results are folded here in rank order
 * (the documented order, so every rank gets the same bits). */
static const double ar_in[W][4] = {
    {1.0, -2.5, 1e-17, 7.0},
    {0.1, 3.25, 1.0, -7.0},
    {0.2, -0.75, -1.0, 7.5},
};

/* The values themselves, copied in the hook's call (they are borrowed). */
static double got_vals[W][4];
static void on_done_copy(void *ctx, shardd__coll_member *m, uint64_t seq,
                         shardd_err code, const char *msg,
                         const shardd__coll_result *res) {
  on_done(ctx, m, seq, code, msg, res);
  if (res && res->kind == SHARDD__COLL_ALL_REDUCE)
    memcpy(got_vals[m->rank], res->values, res->nvalues * sizeof(double));
}

/* sum, mean, max, min of 4 values over 3 ranks: every rank gets the
 * rank-order fold, bit for bit. */
Test(coll, all_reduce_values_in_rank_order_same_bits) {
  shardd__coll_engine_destroy(eng);
  shardd__coll_config cfg = {.loop = &loop, .reg = &reg, .timeout = TIMEOUT,
                             .max_pending = MAX_PENDING,
                             .hooks = {.ctx = &replies, .done = on_done_copy,
                                       .job_quiet = on_quiet}};
  cr_assert_eq(shardd__coll_engine_create(&cfg, &eng), SHARDD_OK);
  shardd_reduce_op ops[] = {SHARDD_REDUCE_SUM, SHARDD_REDUCE_MEAN,
                            SHARDD_REDUCE_MAX, SHARDD_REDUCE_MIN};
  for (uint64_t k = 0; k < 4; k++) {
    memset(got_vals, 0, sizeof got_vals);
    size_t before = nreplies;
    /* arrival order 2, 0, 1: the fold is still in rank order */
    submit(2, 20 + k, allreduce_args(ar_in[2], 4, ops[k]));
    submit(0, 20 + k, allreduce_args(ar_in[0], 4, ops[k]));
    submit(1, 20 + k, allreduce_args(ar_in[1], 4, ops[k]));
    run_until(before + W);
    for (uint32_t i = 0; i < 4; i++) {
      double want = ar_in[0][i];
      for (uint32_t r = 1; r < W; r++) {
        double v = ar_in[r][i];
        if (ops[k] == SHARDD_REDUCE_MAX)
          want = v > want ? v : want;
        else if (ops[k] == SHARDD_REDUCE_MIN)
          want = v < want ? v : want;
        else
          want = want + v;
      }
      if (ops[k] == SHARDD_REDUCE_MEAN)
        want /= W;
      for (uint32_t r = 0; r < W; r++) {
        expect_reply(r, 20 + k, SHARDD_OK);
        cr_assert(memcmp(&got_vals[r][i], &want, sizeof want) == 0,
                  "op %d value %u rank %u: %.17g, want %.17g", (int)ops[k], i, r,
                  got_vals[r][i], want);
      }
    }
  }
  /* a NaN stays NaN for max and min too (fmax would drop it) */
  double nan_in[W] = {1.0, NAN, 2.0};
  size_t before = nreplies;
  for (uint32_t r = 0; r < W; r++)
    submit(r, 30, allreduce_args(&nan_in[r], 1, SHARDD_REDUCE_MAX));
  run_until(before + W);
  for (uint32_t r = 0; r < W; r++) {
    expect_reply(r, 30, SHARDD_OK);
    cr_assert(isnan(got_vals[r][0]), "max with a NaN: %g", got_vals[r][0]);
  }
  expect_pending_zero();
}

/* A barrier (no values) completes only once every rank has come. */
Test(coll, barrier_waits_for_every_rank) {
  submit(0, 1, allreduce_args(NULL, 0, SHARDD_REDUCE_SUM));
  submit(2, 1, allreduce_args(NULL, 0, SHARDD_REDUCE_SUM));
  run_idle();
  cr_assert_eq(nreplies, 0, "a barrier returned before rank 1 came");
  submit(1, 1, allreduce_args(NULL, 0, SHARDD_REDUCE_SUM));
  run_until(W);
  for (uint32_t r = 0; r < W; r++)
    cr_assert_eq(expect_reply(r, 1, SHARDD_OK)->res.nvalues, 0);
  expect_pending_zero();
}

/* An all_reduce has nothing for the pool to run: it completes on the
 * loop turn of its last rank's submit, with no pool work queued. */
Test(coll, all_reduce_completes_without_a_pool_turn) {
  double v = 2.0;
  for (uint32_t r = 0; r < W; r++)
    submit(r, 1, allreduce_args(&v, 1, SHARDD_REDUCE_SUM));
  cr_assert_eq(nreplies, 0, "never answered inside the submit");
  cr_assert_eq(pool_requests(), 0, "no pool work queued for an all_reduce");
  uv_run(&loop, UV_RUN_NOWAIT);
  cr_assert_eq(nreplies, W);
  for (uint32_t r = 0; r < W; r++) {
    const reply *rp = expect_reply(r, 1, SHARDD_OK);
    cr_assert_eq(rp->res.nvalues, 1);
  }
  expect_pending_zero();
}

/* Ranks that disagree on the count or the op all fail (a silent pick
 * would log mixed metrics); too many values are refused. */
Test(coll, all_reduce_mismatch_and_limits) {
  double v[SHARDD_ALL_REDUCE_MAX + 1] = {0};
  submit(0, 1, allreduce_args(v, 2, SHARDD_REDUCE_SUM));
  submit(1, 1, allreduce_args(v, 3, SHARDD_REDUCE_SUM));
  submit(2, 1, allreduce_args(v, 2, SHARDD_REDUCE_SUM));
  for (uint32_t r = 0; r < W; r++)
    expect_msg(expect_reply(r, 1, SHARDD_E_MISMATCH), "other arguments");
  submit(0, 2, allreduce_args(v, 1, SHARDD_REDUCE_SUM));
  submit(1, 2, allreduce_args(v, 1, SHARDD_REDUCE_MAX));
  submit(2, 2, allreduce_args(v, 1, SHARDD_REDUCE_SUM));
  for (uint32_t r = 0; r < W; r++)
    expect_reply(r, 2, SHARDD_E_MISMATCH);
  submit(0, 3, allreduce_args(v, SHARDD_ALL_REDUCE_MAX + 1, SHARDD_REDUCE_SUM));
  expect_msg(expect_reply(0, 3, SHARDD_E_RANGE), "at most 64");
  cr_assert_eq(shardd__coll_inflight(eng, job), 0);
  expect_pending_zero();
}

/* A rank lost while the others wait in a barrier fails them (it had not
 * come: grace 0 here), naming it. */
Test(coll, barrier_with_a_lost_rank_fails) {
  submit(0, 1, allreduce_args(NULL, 0, SHARDD_REDUCE_SUM));
  submit(1, 1, allreduce_args(NULL, 0, SHARDD_REDUCE_SUM));
  shardd__coll_member_lost(eng, &mem[2]);
  expect_msg(expect_reply(0, 1, SHARDD_E_PEER_LOST), "rank 2");
  expect_reply(1, 1, SHARDD_E_PEER_LOST);
  expect_pending_zero();
}

/* ---- step --------------------------------------------------------------- */

/* An SGD optimizer (lr 0.5, no momentum) over the whole buffer, registered
 * as the request path does (optreg); returns it. */
static shardd__optim *sgd_over(shardd__buffer *b) {
  shardd__optspec_ref ref = {.id = b->hdr.id};
  shardd__optspec_group grp = {.refs = &ref, .nrefs = 1};
  shardd__optspec spec = {.name = "opt",
                          .kind = SHARDD_OPTIM_SGD,
                          .has_hyper = 1,
                          .hyper = {.has_lr = 1, .lr = 0.5},
                          .groups = &grp,
                          .ngroups = 1};
  shardd__optreg_result res;
  memset(&res, 0, sizeof res);
  shardd_err rc = shardd__optreg_register(&reg, job, &spec,
                                          SHARDD__OPTREG_ATTACH, &res, err,
                                          sizeof err);
  cr_assert_eq(rc, SHARDD_OK, "%s: %s %s", shardd_err_name(rc), err,
               res.list ? res.list : "");
  free(res.list);
  cr_assert_not_null(res.optim);
  return res.optim;
}

/* reduced == k times the mean gradient, to fp32 rounding */
static void check_reduced_times(shardd__buffer *b, double k) {
  uint64_t s = b->shard_numel;
  for (uint32_t a = 0; a < W; a++) {
    const float *red = reduced_of(b, a);
    for (uint64_t i = 0; i < s; i++) {
      double sum = 0;
      for (uint32_t r = 0; r < W; r++)
        sum += grad_val(r, a * s + i);
      double want = k * sum / W;
      if (fabs(red[i] - want) > 1e-6 * fabs(want))
        cr_assert_fail("x%g: rank %" PRIu32 " reduced[%" PRIu64 "] = %f, want %f",
                       k, a, i, (double)red[i], want);
    }
  }
}

/* An accumulating scatter (a later backward of gradient accumulation)
 * adds to the reduced gradient until a step consumes it; after the step
 * it replaces it, so no step sees an earlier step's gradient. All ranks
 * must agree on it. */
Test(coll, accumulating_scatter_adds_until_a_step) {
  shardd__buffer *b = buf_new("p", 1000);
  shardd__optim *o = sgd_over(b);
  fill_grads(b);
  shardd__coll_args acc = scatter_args(b, SHARDD_REDUCE_MEAN);
  acc.accumulate = 1;
  for (uint32_t r = 0; r < W; r++)
    submit(r, 1, acc); /* nothing held yet: it replaces */
  run_until(W);
  check_reduced_times(b, 1);
  for (uint32_t r = 0; r < W; r++)
    submit(r, 2, acc);
  run_until(2 * W);
  for (uint32_t r = 0; r < W; r++)
    expect_reply(r, 2, SHARDD_OK);
  check_reduced_times(b, 2);
  /* a plain scatter replaces whatever is held */
  for (uint32_t r = 0; r < W; r++)
    submit(r, 3, scatter_args(b, SHARDD_REDUCE_MEAN));
  run_until(3 * W);
  check_reduced_times(b, 1);
  for (uint32_t r = 0; r < W; r++)
    submit(r, 4, acc);
  run_until(4 * W);
  check_reduced_times(b, 2);
  shardd__coll_args st = {.kind = SHARDD__COLL_STEP, .target = o->hdr.id};
  for (uint32_t r = 0; r < W; r++)
    submit(r, 5, st);
  run_until(5 * W);
  for (uint32_t r = 0; r < W; r++)
    expect_reply(r, 5, SHARDD_OK);
  for (uint32_t r = 0; r < W; r++)
    submit(r, 6, acc); /* the step consumed the sum: replaced, not added */
  run_until(6 * W);
  check_reduced_times(b, 1);
  /* ranks that disagree on it are all refused */
  submit(0, 7, acc);
  submit(1, 7, scatter_args(b, SHARDD_REDUCE_MEAN));
  submit(2, 7, acc);
  run_until(7 * W);
  for (uint32_t r = 0; r < W; r++)
    expect_reply(r, 7, SHARDD_E_MISMATCH);
  check_reduced_times(b, 1);
  expect_pending_zero();
}

/* A backend that cannot add (cuda) refuses the accumulating scatter at
 * once, naming itself, instead of replacing the gradient held. */
Test(coll, accumulating_scatter_refused_without_reduce_add) {
  shardd__buffer *b = buf_new("p", 100);
  shardd__backend_ops ops = *be->ops;
  const shardd__backend_ops *keep = be->ops;
  ops.reduce_add = NULL;
  be->ops = &ops;
  shardd__coll_args acc = scatter_args(b, SHARDD_REDUCE_SUM);
  acc.accumulate = 1;
  submit(0, 1, acc);
  be->ops = keep;
  cr_assert_eq(nreplies, 1, "refused without waiting for the other ranks");
  const reply *rp = expect_reply(0, 1, SHARDD_E_INVAL);
  expect_msg(rp, "host backend cannot add");
  expect_pending_zero();
}

/* A step consumes the reduced gradient: a second step with no scatter
 * since skips the buffer as torch skips a parameter whose .grad is None
 * (no update, its step count stays; the optimizer's count moves), and the
 * next scatter makes it trainable again. */
Test(coll, step_without_a_scatter_since_the_last_changes_nothing) {
  shardd__buffer *b = buf_new("p", 1000);
  shardd__optim *o = sgd_over(b);
  fill_shards(b, 0);
  fill_grads(b);
  uint64_t s = b->shard_numel, seq = 0;
  shardd__coll_args st = {.kind = SHARDD__COLL_STEP, .target = o->hdr.id};
  float *after1 = malloc(W * s * sizeof *after1);
  cr_assert_not_null(after1);
  for (int round = 0; round < 2; round++) {
    seq++;
    for (uint32_t r = 0; r < W; r++)
      submit(r, seq, scatter_args(b, SHARDD_REDUCE_MEAN));
    run_until(nreplies + W);
    seq++;
    for (uint32_t r = 0; r < W; r++)
      submit(r, seq, st);
    run_until(nreplies + W);
    for (uint32_t r = 0; r < W; r++)
      expect_reply(r, seq, SHARDD_OK);
    cr_assert_eq(shardd__ref_steps(&b->hdr), (uint64_t)round + 1);
    for (uint32_t a = 0; a < W; a++)
      memcpy(after1 + a * s, shard_of(b, a), s * sizeof *after1);
    seq++;
    for (uint32_t r = 0; r < W; r++)
      submit(r, seq, st); /* no scatter since the step above */
    run_until(nreplies + W);
    for (uint32_t r = 0; r < W; r++)
      cr_assert_eq(expect_reply(r, seq, SHARDD_OK)->res.step, (uint64_t)round * 2 + 2);
    for (uint32_t a = 0; a < W; a++)
      cr_assert_eq(memcmp(after1 + a * s, shard_of(b, a), s * sizeof *after1), 0,
                   "round %d: rank %" PRIu32 "'s shard changed by a step with "
                   "no fresh gradient", round, a);
    cr_assert_eq(shardd__ref_steps(&b->hdr), (uint64_t)round + 1,
                 "a skipped parameter's step count stays");
  }
  cr_assert_eq(o->steps, 4);
  free(after1);
  expect_pending_zero();
}

/* scatter (mean) then step: every shard is p - lr * g with g the mean
 * gradient; with max_norm below the norm, the update is scaled by
 * max_norm / (norm + 1e-6) and the reported norm is that of the reduced
 * gradients. */
Test(coll, scatter_then_step_updates_shards) {
  shardd__buffer *b = buf_new("p", 1000);
  shardd__optim *o = sgd_over(b);
  fill_shards(b, 0);
  fill_grads(b);
  for (uint32_t r = 0; r < W; r++)
    submit(r, 1, scatter_args(b, SHARDD_REDUCE_MEAN));
  run_until(W);
  double sumsq = 0;
  uint64_t s = b->shard_numel;
  for (uint64_t j = 0; j < b->numel; j++) { /* padding has no gradient */
    double g = 0;
    for (uint32_t r = 0; r < W; r++)
      g += grad_val(r, j);
    g /= W;
    sumsq += g * g;
  }
  double norm = sqrt(sumsq);
  double max_norm = norm / 4;
  double coef = max_norm / (norm + 1e-6);
  shardd__coll_args st = {.kind = SHARDD__COLL_STEP, .target = o->hdr.id,
                          .max_norm = max_norm};
  for (uint32_t r = 0; r < W; r++)
    submit(r, 2, st);
  run_until(2 * W);
  for (uint32_t r = 0; r < W; r++) {
    const reply *rp = expect_reply(r, 2, SHARDD_OK);
    cr_assert(rp->has_res, "a step reports its result");
    cr_assert_eq(rp->res.step, 1);
    cr_assert(rp->res.has_total_norm);
    cr_assert(fabs(rp->res.total_norm - norm) <= 1e-5 * norm,
              "total_norm %f, want %f", rp->res.total_norm, norm);
  }
  for (uint32_t a = 0; a < W; a++) {
    const float *p = shard_of(b, a);
    for (uint64_t i = 0; i < s && a * s + i < b->numel; i++) {
      double g = 0;
      for (uint32_t r = 0; r < W; r++)
        g += grad_val(r, a * s + i);
      g /= W;
      double want = shard_val(0, a, i) - 0.5 * coef * g;
      if (fabs(p[i] - want) > 1e-6 * fabs(want) + 1e-4)
        cr_assert_fail("rank %" PRIu32 " p[%" PRIu64 "] = %f, want %f", a, i,
                       (double)p[i], want);
    }
  }
  cr_assert_eq(o->steps, 1);
  /* a step holds the optimizer while it waits */
  submit(0, 3, st);
  cr_assert_eq(shardd__optim_unregister(&reg, job, o->hdr.id, err, sizeof err),
               SHARDD_E_BUSY);
  shardd__coll_args bad = st;
  bad.has_lr = 1;
  bad.lr = -1;
  submit(1, 4, bad);
  expect_msg(expect_reply(1, 4, SHARDD_E_RANGE), "lr must be >= 0");
}

/* ---- torch's skip semantics ---------------------------------------------- */

static shardd__view *view_new(shardd__buffer *b, const char *name, uint64_t off,
                              uint64_t n) {
  shardd__view *v = NULL;
  int created = -1;
  int64_t shape[1] = {(int64_t)n};
  cr_assert_eq(shardd__view_register(&reg, job, b->hdr.id, name, off, n, shape, 1,
                                     &v, &created, err, sizeof err),
               SHARDD_OK, "%s", err);
  return v;
}

/* Each rank's mask and the OR over ranks: v0 [0,7) has a gradient on no
 * rank (rank 0 and 1 name it, rank 2 names the whole buffer), v1 [7,18)
 * only on rank 1, v2 [18,30) on ranks 0 and 1. The step skips v0 whole (no
 * update, no part of the norm, its step count stays) and steps the others;
 * a scatter without masks then makes every view count again, and a frozen
 * view is skipped the same way. Expected values from SGD's definition. */
Test(coll, steps_skip_views_no_rank_sent_a_gradient_for) {
  shardd__buffer *b = buf_new("p", 30); /* s = 10 */
  shardd__view *v[3] = {view_new(b, "v0", 0, 7), view_new(b, "v1", 7, 11),
                        view_new(b, "v2", 18, 12)};
  shardd__optspec_ref refs[3] = {{.id = v[0]->hdr.id}, {.id = v[1]->hdr.id},
                                 {.id = v[2]->hdr.id}};
  shardd__optspec_group grp = {.refs = refs, .nrefs = 3};
  shardd__optspec spec = {.name = "opt", .kind = SHARDD_OPTIM_SGD, .has_hyper = 1,
                          .hyper = {.has_lr = 1, .lr = 0.5}, .groups = &grp,
                          .ngroups = 1};
  shardd__optreg_result res;
  memset(&res, 0, sizeof res);
  cr_assert_eq(shardd__optreg_register(&reg, job, &spec, SHARDD__OPTREG_ATTACH, &res,
                                       err, sizeof err),
               SHARDD_OK, "%s", err);
  shardd__optim *o = res.optim;
  fill_shards(b, 0);
  fill_grads(b);
  uint64_t m0[2] = {v[1]->hdr.id, v[0]->hdr.id}, m1[2] = {v[0]->hdr.id, v[0]->hdr.id};
  shardd__coll_args sa[W];
  for (uint32_t r = 0; r < W; r++)
    sa[r] = scatter_args(b, SHARDD_REDUCE_MEAN);
  sa[0].no_grad = m0;
  sa[0].nno_grad = 2;
  sa[1].no_grad = m1; /* a repeat counts once */
  sa[1].nno_grad = 2;
  sa[2].no_grad_all = 1;
  for (uint32_t r = 0; r < W; r++)
    submit(r, 1, sa[r]);
  run_until(W);
  for (uint32_t r = 0; r < W; r++)
    expect_reply(r, 1, SHARDD_OK);
  cr_expect_eq(v[0]->grad_seen, 0, "no rank had v0's gradient");
  cr_expect_eq(v[1]->grad_seen, 1, "rank 1 had v1's");
  cr_expect_eq(v[2]->grad_seen, 1);
  cr_expect_eq(b->grad_seen, 1, "ranks 0 and 1 had some of the buffer's");

  /* the norm of the stepped views only */
  double sumsq = 0;
  for (uint64_t j = 7; j < 30; j++) {
    double g = 0;
    for (uint32_t r = 0; r < W; r++)
      g += grad_val(r, j);
    sumsq += (g / W) * (g / W);
  }
  double norm = sqrt(sumsq), max_norm = norm / 2;
  double coef = max_norm / (norm + 1e-6);
  shardd__coll_args st = {.kind = SHARDD__COLL_STEP, .target = o->hdr.id,
                          .max_norm = max_norm};
  for (uint32_t r = 0; r < W; r++)
    submit(r, 2, st);
  run_until(2 * W);
  const reply *rp = expect_reply(0, 2, SHARDD_OK);
  cr_assert(fabs(rp->res.total_norm - norm) <= 1e-5 * norm,
            "total_norm %f, want %f (v0 is not part of it)", rp->res.total_norm, norm);
  uint64_t s = b->shard_numel;
  for (uint64_t j = 0; j < 30; j++) {
    double g = 0;
    for (uint32_t r = 0; r < W; r++)
      g += grad_val(r, j);
    double p0 = shard_val(0, (uint32_t)(j / s), j % s);
    double want = j < 7 ? p0 : p0 - 0.5 * coef * (g / W);
    double got = shard_of(b, (uint32_t)(j / s))[j % s];
    cr_expect(fabs(got - want) <= 1e-6 * fabs(want), "element %" PRIu64 ": %f, want %f",
              j, got, want);
  }
  uint64_t want_steps[3] = {0, 1, 1};
  for (int k = 0; k < 3; k++)
    cr_expect_eq(shardd__ref_steps(&v[k]->hdr), want_steps[k], "v%d", k);
  cr_expect_eq(o->steps, 1, "the optimizer counts every step");

  /* no masks (an older client): every view has a gradient again; v2
   * frozen meanwhile is skipped, its count staying */
  cr_assert_eq(shardd__view_set_requires_grad(&reg, job, v[2]->hdr.id, 0, 0, err,
                                              sizeof err),
               SHARDD_OK, "%s", err);
  for (uint32_t r = 0; r < W; r++)
    submit(r, 3, scatter_args(b, SHARDD_REDUCE_MEAN));
  run_until(3 * W);
  cr_expect_eq(v[0]->grad_seen, 1);
  float before[30];
  for (uint64_t j = 0; j < 30; j++)
    before[j] = shard_of(b, (uint32_t)(j / s))[j % s];
  st.max_norm = 0;
  for (uint32_t r = 0; r < W; r++)
    submit(r, 4, st);
  run_until(4 * W);
  for (uint64_t j = 0; j < 30; j++) {
    float got = shard_of(b, (uint32_t)(j / s))[j % s];
    if (j >= 18)
      cr_expect(memcmp(&got, &before[j], sizeof got) == 0, "frozen v2 element %" PRIu64
                " moved", j);
    else
      cr_expect(got != before[j], "element %" PRIu64 " was stepped", j);
  }
  uint64_t want2[3] = {1, 2, 1};
  for (int k = 0; k < 3; k++)
    cr_expect_eq(shardd__ref_steps(&v[k]->hdr), want2[k], "v%d", k);
  cr_expect_eq(o->steps, 2);
}

/* A 16-bit buffer's fp32 master copy is taken at its first step for every
 * segment, skipped ones too: a view frozen then and unfrozen later is
 * stepped from its own values, not from an untaken master (zeros). bf16
 * values: 4 - 0.5 * 2 = 3, each exact (0x4080, 0x4000, 0x4040). */
Test(coll, a_view_frozen_at_the_first_step_of_a_bf16_buffer_keeps_its_master) {
  shardd__buffer *b = NULL;
  int created;
  cr_assert_eq(shardd__buffer_register(&reg, job, "h", SHARDD_DTYPE_BF16, 30, &b,
                                       &created, err, sizeof err),
               SHARDD_OK, "%s", err);
  shardd__view *v0 = NULL, *v1 = view_new(b, "v1", 15, 15);
  int64_t shape[1] = {15};
  cr_assert_eq(shardd__view_register_ex(&reg, job, b->hdr.id, 0, "v0", 0, 15, shape, 1, 0,
                                        &v0, &created, err, sizeof err),
               SHARDD_OK, "%s", err);
  shardd__optspec_ref refs[2] = {{.id = v0->hdr.id}, {.id = v1->hdr.id}};
  shardd__optspec_group grp = {.refs = refs, .nrefs = 2};
  shardd__optspec spec = {.name = "h", .kind = SHARDD_OPTIM_SGD, .has_hyper = 1,
                          .hyper = {.has_lr = 1, .lr = 0.5}, .groups = &grp,
                          .ngroups = 1};
  shardd__optreg_result res;
  memset(&res, 0, sizeof res);
  cr_assert_eq(shardd__optreg_register(&reg, job, &spec, SHARDD__OPTREG_ATTACH, &res,
                                       err, sizeof err),
               SHARDD_OK, "%s", err);
  shardd__optim *o = res.optim;
  uint64_t s = b->shard_numel;
  for (uint32_t r = 0; r < W; r++) {
    uint16_t *p = (uint16_t *)((char *)b->blocks[r]->ptr + b->shard_off);
    uint16_t *g = (uint16_t *)((char *)b->blocks[r]->ptr + b->grad_off);
    for (uint64_t i = 0; i < s; i++)
      p[i] = 0x4080; /* 4.0 */
    for (uint64_t j = 0; j < b->padded_numel; j++)
      g[j] = 0x4000; /* 2.0 on every rank: the mean is 2 */
  }
  shardd__coll_args st = {.kind = SHARDD__COLL_STEP, .target = o->hdr.id};
  for (int round = 0; round < 2; round++) {
    if (round == 1)
      cr_assert_eq(shardd__view_set_requires_grad(&reg, job, v0->hdr.id, 0, 1, err,
                                                  sizeof err),
                   SHARDD_OK, "%s", err);
    for (uint32_t r = 0; r < W; r++)
      submit(r, (uint64_t)(4 * round + 1), scatter_args(b, SHARDD_REDUCE_MEAN));
    run_until((size_t)(2 * round + 1) * W);
    for (uint32_t r = 0; r < W; r++)
      submit(r, (uint64_t)(4 * round + 2), st);
    run_until((size_t)(2 * round + 2) * W);
    for (uint32_t r = 0; r < W; r++)
      expect_reply(r, (uint64_t)(4 * round + 2), SHARDD_OK);
    for (uint64_t j = 0; j < 30; j++) {
      uint16_t got =
          ((uint16_t *)((char *)b->blocks[j / s]->ptr + b->shard_off))[j % s];
      /* round 0: v0 frozen (4), v1 4 - 1 = 3; round 1: v0 3, v1 2 */
      uint16_t want = j < 15 ? (round == 0 ? 0x4080 : 0x4040)
                             : (round == 0 ? 0x4040 : 0x4000);
      cr_expect_eq(got, want, "round %d element %" PRIu64 ": 0x%04x, want 0x%04x",
                   round, j, got, want);
    }
  }
}

/* A mask naming anything but a view of the scattered buffer is refused at
 * once, for that rank, with the entry named; nothing is queued. */
Test(coll, scatter_mask_of_another_buffers_view_is_refused) {
  shardd__buffer *b = buf_new("p", 30), *c = buf_new("q", 30);
  shardd__view *other = view_new(c, "w", 0, 30);
  uint64_t ids[2] = {b->hdr.id, other->hdr.id};
  for (int k = 0; k < 2; k++) {
    shardd__coll_args a = scatter_args(b, SHARDD_REDUCE_SUM);
    a.no_grad = &ids[k];
    a.nno_grad = 1;
    submit(0, (uint64_t)k + 1, a);
    expect_msg(expect_reply(0, (uint64_t)k + 1, SHARDD_E_NOT_FOUND), "is not a view of it");
  }
  cr_expect_eq(shardd__coll_inflight(eng, job), 0);
  expect_pending_zero();
}

/* ---- transient areas (areas.c; the FSDP-grade memory issue) ------------- */

static uint64_t used_total(void) {
  uint64_t n = 0;
  for (int d = 0; d < be->ndevices; d++) {
    shardd__device_info info;
    be->ops->device_info(be, d, &info);
    n += info.used_bytes;
  }
  return n;
}

static uint64_t peak_total(void) {
  uint64_t n = 0;
  for (int d = 0; d < be->ndevices; d++) {
    shardd__device_info info;
    be->ops->device_info(be, d, &info);
    n += info.peak_bytes;
  }
  return n;
}

static float *area_ptr(const shardd__area *a) {
  return (float *)((char *)a->pool->ptr + a->off);
}

static shardd__coll_args gather_grad_args(const shardd__buffer *b) {
  shardd__coll_args a = gather_args(b);
  a.want_grad = 1;
  return a;
}

/* The backend's copy, counted: the bytes a collective's copies moved. */
static _Atomic uint64_t copied;
static shardd__backend_ops counting_ops;
static const shardd__backend_ops *host_ops;

static shardd_err counting_copy(shardd__backend *b, shardd__region *dst,
                                size_t dst_off, shardd__region *src,
                                size_t src_off, size_t bytes) {
  copied += bytes;
  return host_ops->copy(b, dst, dst_off, src, src_off, bytes);
}

static void count_copies(void) {
  host_ops = be->ops;
  counting_ops = *be->ops;
  counting_ops.copy = counting_copy;
  be->ops = &counting_ops;
  copied = 0;
}

static void uncount_copies(void) { be->ops = host_ops; }

/* Layout and bytes, exact: a transient rank block is the shard and the
 * fp32 reduced shard only (here 400 B each: a page apiece); a gradient
 * pool per device has 2 slots per rank on it (device 0 holds ranks 0
 * and 2, device 1 rank 1), and the node's gather pool 3 * (2 - 1) + 1
 * slots, each a region made at its first lease, as large as its unit (a
 * page here): one gather slot and rank 0's gradient slot. Every rank's
 * gather area is the one copy, filled once. */
Test(coll, transient_gather_leases_its_area) {
  cr_assert_eq(shardd__job_set_transient(job, 1, err, sizeof err), SHARDD_OK, "%s",
               err);
  shardd__buffer *b = buf_new("w", 300);
  cr_assert_eq(b->block_bytes, 8192, "shard page + reduced page");
  cr_assert_eq(b->gather_off, 0);
  cr_assert_eq(used_total(), 3 * 8192, "no area is resident");
  fill_shards(b, 1);
  count_copies();
  submit(0, 1, gather_grad_args(b));
  submit(1, 1, gather_args(b));
  submit(2, 1, gather_args(b));
  run_until(W);
  uncount_copies();
  cr_assert_eq(copied, b->padded_numel * 4, "the unit copied once (W shards), "
               "not once per rank: %lu bytes", (unsigned long)copied);
  /* a slot is made at its first lease; device 1's gradient pool has none */
  cr_assert_eq(shardd__job_pool_bytes(job), 4096 + 4096);
  cr_assert_eq(used_total(), 3 * 8192 + 2 * 4096);
  for (uint32_t r = 0; r < W; r++) {
    const reply *rp = expect_reply(r, 1, SHARDD_OK);
    cr_assert(rp->has_res, "a transient gather says where the area is");
    cr_assert_eq(rp->res.kind, SHARDD__COLL_GATHER);
    cr_assert_eq(rp->res.has_grad, r == 0, "only rank 0 asked for its gradient");
    cr_assert(rp->res.gather.readonly, "the node's copy goes out read-only");
    cr_assert_eq(rp->res.gather.pool, replies[0].res.gather.pool, "rank %u", r);
    cr_assert_eq(rp->res.gather.off, replies[0].res.gather.off, "rank %u", r);
    const float *g = area_ptr(&rp->res.gather);
    for (uint64_t j = 0; j < b->padded_numel; j++)
      cr_assert_eq(g[j], shard_val(1, (uint32_t)(j / b->shard_numel), j % b->shard_numel),
                   "rank %u element %lu", r, (unsigned long)j);
    if (r == 0) {
      cr_assert(!rp->res.grad.readonly);
      cr_assert_neq(rp->res.grad.pool, rp->res.gather.pool, "gradients are per rank");
      const float *gr = area_ptr(&rp->res.grad);
      for (uint64_t j = 0; j < b->padded_numel; j++)
        cr_assert_eq(gr[j], 0.0f, "a gradient area starts at zero");
    }
  }
}

/* The node's copy is refcounted: it stays while any local rank holds it,
 * whatever the order of the releases, and its slot is free after the last. */
Test(coll, transient_gathered_copy_lives_until_the_last_release) {
  cr_assert_eq(shardd__job_set_transient(job, 1, err, sizeof err), SHARDD_OK);
  shardd__buffer *b = buf_new("w", 300);
  fill_shards(b, 1);
  for (uint32_t r = 0; r < W; r++)
    submit(r, 1, gather_args(b));
  run_until(W);
  shardd__area a0;
  cr_assert(shardd__area_held(b, 0, SHARDD__AREA_GATHER, &a0));
  const uint32_t order[W] = {1, 2, 0};
  for (uint32_t k = 0; k < W; k++) {
    shardd__area_return(b, order[k], SHARDD__AREA_GATHER);
    cr_assert_eq(b->gslot >= 0, k + 1 < W, "after %u releases", k + 1);
    for (uint32_t r = 0; r < W; r++) {
      int still = 0;
      for (uint32_t i = k + 1; i < W; i++)
        still |= order[i] == r;
      shardd__area a;
      cr_assert_eq(shardd__area_held(b, r, SHARDD__AREA_GATHER, &a), still);
      if (still) {
        cr_assert_eq(a.off, a0.off);
        cr_assert_eq(area_ptr(&a)[1], shard_val(1, 0, 1), "still the values");
      }
    }
  }
  shardd__area_return(b, 1, SHARDD__AREA_GATHER); /* holds none: nothing */
  cr_assert_eq(b->gslot, -1);
}

/* Sizing the node's gather pool when ranks release out of order: the
 * worst case. Each rank keeps a different unit and releases the newest
 * one; the next gather then needs every rank's kept unit and the new one,
 * W * (2 - 1) + 1 = 4 slots here, all the pool has, and it succeeds where
 * the per-rank pools (2 per rank) succeeded. Then, at random: ranks
 * release in random orders, one often lagging with 2 held; a gather is
 * refused only for a rank at its own limit (E_LIMIT), never for the pool,
 * and every rank reads the values of its gather. */
Test(coll, transient_gather_pool_fits_out_of_order_releases) {
  cr_assert_eq(shardd__job_set_transient(job, 1, err, sizeof err), SHARDD_OK);
  enum { NU = 6 };
  shardd__buffer *u[NU];
  for (int i = 0; i < NU; i++) {
    char name[16];
    snprintf(name, sizeof name, "u%d", i);
    u[i] = buf_new(name, 300);
    fill_shards(u[i], (uint32_t)i + 1);
  }
  uint64_t seq = 0;
  for (uint32_t k = 0; k <= W; k++) {
    seq++;
    for (uint32_t r = 0; r < W; r++)
      submit(r, seq, gather_args(u[k]));
    run_until(seq * W);
    for (uint32_t r = 0; r < W; r++)
      expect_reply(r, seq, SHARDD_OK);
    if (k == W)
      break;
    for (uint32_t r = 0; r < W; r++)
      if (r != k) /* rank k keeps unit k */
        shardd__area_return(u[k], r, SHARDD__AREA_GATHER);
  }
  int distinct = 0;
  for (int i = 0; i < NU; i++)
    distinct += u[i]->gslot >= 0;
  cr_assert_eq(distinct, W + 1, "every slot of the pool is held");
  cr_assert_eq(shardd__job_pool_bytes(job), (W + 1) * 4096, "no gradient pool yet");
  for (uint32_t r = 0; r < W; r++)
    for (uint32_t k = 0; k <= W; k++) {
      shardd__area a;
      if (shardd__area_held(u[k], r, SHARDD__AREA_GATHER, &a))
        cr_assert_eq(area_ptr(&a)[0], shard_val(k + 1, 0, 0));
    }
  /* random rounds (a fixed seed: the same run every time) */
  unsigned x = 12345;
  int refused = 0;
  for (int round = 0; round < 400; round++) {
    x = x * 1103515245u + 12345u;
    int k = (int)((x >> 16) % NU);
    /* the per-rank design's answer: room for every rank */
    int room = 1;
    for (uint32_t r = 0; r < W; r++)
      room &= job->nleased[r][SHARDD__AREA_GATHER] < 2 ||
              shardd__area_held(u[k], r, SHARDD__AREA_GATHER, NULL);
    seq++;
    nreplies = 0;
    for (uint32_t r = 0; r < W; r++)
      submit(r, seq, gather_args(u[k]));
    run_until(W);
    for (uint32_t r = 0; r < W; r++) {
      const reply *rp = find_reply(r, seq);
      cr_assert_not_null(rp);
      cr_assert_eq(rp->code, room ? SHARDD_OK : SHARDD_E_LIMIT, "round %d rank %u: %s",
                   round, r, rp->msg);
      if (rp->code == SHARDD_OK)
        cr_assert_eq(area_ptr(&rp->res.gather)[3], shard_val((uint32_t)k + 1, 0, 3));
    }
    refused += !room;
    /* each rank releases a random one of what it holds, rank 2 (the
     * lagging one) only every fourth round */
    for (uint32_t r = 0; r < W; r++) {
      x = x * 1103515245u + 12345u;
      if (r == 2 && (round & 3) != 0)
        continue;
      int pick = (int)((x >> 16) % NU);
      if ((x >> 8) & 1)
        shardd__area_return(u[pick], r, SHARDD__AREA_GATHER);
    }
    distinct = 0;
    for (int i = 0; i < NU; i++)
      distinct += u[i]->gslot >= 0;
    cr_assert_leq(distinct, W + 1, "round %d", round);
  }
  cr_assert_gt(refused, 0, "some rounds found a rank at its limit");
}

/* The node's gather pool full means some rank is at its own limit (see
 * registry.h), but the first rank in the lease order need not be: rank 0
 * keeps one unit, every other rank two, all W + 1 slots held. A gather of
 * a new unit is refused as the per-rank pools refused it, E_LIMIT naming
 * the rank at its limit, not an internal error of a full pool. */
Test(coll, transient_gather_at_a_later_ranks_limit_is_refused_as_a_limit) {
  cr_assert_eq(shardd__job_set_transient(job, 1, err, sizeof err), SHARDD_OK);
  shardd__buffer *u[W + 2];
  for (int i = 0; i < W + 2; i++) {
    char name[16];
    snprintf(name, sizeof name, "u%d", i);
    u[i] = buf_new(name, 300);
    fill_shards(u[i], (uint32_t)i + 1);
  }
  uint64_t seq = 0;
  for (uint32_t k = 0; k <= W; k++) {
    seq++;
    for (uint32_t r = 0; r < W; r++)
      submit(r, seq, gather_args(u[k]));
    run_until(seq * W);
    for (uint32_t r = 0; r < W; r++)
      expect_reply(r, seq, SHARDD_OK);
    for (uint32_t r = 0; r < W && k < W; r++)
      if (r != k) /* rank k keeps unit k */
        shardd__area_return(u[k], r, SHARDD__AREA_GATHER);
  }
  /* rank 0 gives back the newest: it holds one, the others two each */
  shardd__area_return(u[W], 0, SHARDD__AREA_GATHER);
  int distinct = 0;
  for (int i = 0; i < W + 2; i++)
    distinct += u[i]->gslot >= 0;
  cr_assert_eq(distinct, W + 1, "every slot of the pool is held");
  seq++;
  nreplies = 0;
  for (uint32_t r = 0; r < W; r++)
    submit(r, seq, gather_args(u[W + 1]));
  run_until(W);
  for (uint32_t r = 0; r < W; r++) {
    const reply *rp = find_reply(r, seq);
    cr_assert_not_null(rp);
    cr_assert_eq(rp->code, SHARDD_E_LIMIT, "rank %u: %s", r, rp->msg);
    cr_assert(strstr(rp->msg, "rank 1 holds 2 gather areas") != NULL, "%s", rp->msg);
  }
  cr_assert_eq(u[W + 1]->gslot, -1, "nothing of the refused gather is held");
  cr_assert_eq(job->nleased[0][SHARDD__AREA_GATHER], 1);
  /* rank 1 makes room: the same gather succeeds, every rank reads it */
  shardd__area_return(u[W], 1, SHARDD__AREA_GATHER);
  shardd__area_return(u[W], 2, SHARDD__AREA_GATHER);
  seq++;
  nreplies = 0;
  for (uint32_t r = 0; r < W; r++)
    submit(r, seq, gather_args(u[W + 1]));
  run_until(W);
  for (uint32_t r = 0; r < W; r++) {
    const reply *rp = find_reply(r, seq);
    cr_assert_not_null(rp);
    cr_assert_eq(rp->code, SHARDD_OK, "rank %u: %s", r, rp->msg);
    cr_assert_eq(area_ptr(&rp->res.gather)[2], shard_val(W + 2, 0, 2));
  }
}

/* The node's gather pool is a memfd, one more memory region: at the
 * bound on regions its gather is refused naming that pool, not a device. */
Test(coll, transient_gather_pool_over_the_region_bound_names_the_pool) {
  cr_assert_eq(shardd__job_set_transient(job, 1, err, sizeof err), SHARDD_OK);
  shardd__buffer *b = buf_new("w", 300);
  reg.max_blocks = reg.nblocks; /* no region more */
  for (uint32_t r = 0; r < W; r++)
    submit(r, 1, gather_args(b));
  run_until(W);
  for (uint32_t r = 0; r < W; r++) {
    const reply *rp = find_reply(r, 1);
    cr_assert_not_null(rp);
    cr_assert_eq(rp->code, SHARDD_E_LIMIT, "%s", rp->msg);
    cr_assert(strstr(rp->msg, "the job's node gather pool would be one more") != NULL,
              "%s", rp->msg);
  }
  cr_assert_eq(shardd__job_pool_bytes(job), 0, "no slot made");
  cr_assert_eq(b->gslot, -1);
}

/* FSDP's limit_all_gathers: a rank holds at most 2 gathered units; a third
 * gather fails naming what it holds, and a release makes room. Steady
 * state allocates nothing: the peak after ten rounds is the first's. */
Test(coll, transient_leases_are_bounded_and_reused) {
  cr_assert_eq(shardd__job_set_transient(job, 1, err, sizeof err), SHARDD_OK);
  shardd__buffer *u[3] = {buf_new("u0", 300), buf_new("u1", 300), buf_new("u2", 300)};
  uint64_t seq = 0;
  for (int k = 0; k < 2; k++) {
    seq++;
    for (uint32_t r = 0; r < W; r++)
      submit(r, seq, gather_args(u[k]));
    run_until(seq * W);
  }
  seq++;
  for (uint32_t r = 0; r < W; r++)
    submit(r, seq, gather_args(u[2]));
  run_until(seq * W);
  const reply *rp = expect_reply(0, seq, SHARDD_E_LIMIT);
  expect_msg(rp, "holds 2 gather areas");
  expect_msg(rp, "\"u0\"");
  expect_msg(rp, "\"u1\"");
  for (uint32_t r = 0; r < W; r++)
    cr_assert(!shardd__area_held(u[2], r, SHARDD__AREA_GATHER, NULL),
              "a failed gather leaves no lease behind");
  uint64_t peak = peak_total();
  for (int round = 0; round < 8; round++) { /* u0 out, u2 in and out, u0 in */
    for (uint32_t r = 0; r < W; r++)
      shardd__area_return(u[0], r, SHARDD__AREA_GATHER);
    seq++;
    for (uint32_t r = 0; r < W; r++)
      submit(r, seq, gather_args(u[2]));
    run_until(seq * W);
    expect_reply(0, seq, SHARDD_OK);
    for (uint32_t r = 0; r < W; r++)
      shardd__area_return(u[2], r, SHARDD__AREA_GATHER);
    seq++;
    for (uint32_t r = 0; r < W; r++)
      submit(r, seq, gather_args(u[0]));
    run_until(seq * W);
    expect_reply(2, seq, SHARDD_OK);
  }
  cr_assert_eq(peak_total(), peak, "no allocation after the first round");
}

/* Backward: a gather with want_grad leases the gradient area, the trainer
 * writes its gradient there, the scatter reduces from it and gives it
 * back; a scatter without one is refused, naming the rank. */
Test(coll, transient_scatter_consumes_the_gradients) {
  cr_assert_eq(shardd__job_set_transient(job, 1, err, sizeof err), SHARDD_OK);
  shardd__buffer *b = buf_new("w", 300);
  for (uint32_t r = 0; r < W; r++)
    submit(r, 1, scatter_args(b, SHARDD_REDUCE_MEAN));
  run_until(W);
  const reply *rp = expect_reply(1, 1, SHARDD_E_STATE);
  expect_msg(rp, "holds no gradient area");
  for (uint32_t r = 0; r < W; r++)
    submit(r, 2, gather_grad_args(b));
  run_until(2 * W);
  for (uint32_t r = 0; r < W; r++) {
    rp = expect_reply(r, 2, SHARDD_OK);
    cr_assert(rp->res.has_grad);
    float *g = area_ptr(&rp->res.grad);
    for (uint64_t j = 0; j < b->padded_numel; j++)
      g[j] = grad_val(r, j);
  }
  for (uint32_t r = 0; r < W; r++)
    submit(r, 3, scatter_args(b, SHARDD_REDUCE_MEAN));
  run_until(3 * W);
  for (uint32_t r = 0; r < W; r++) {
    expect_reply(r, 3, SHARDD_OK);
    cr_assert(!shardd__area_held(b, r, SHARDD__AREA_GRAD, NULL),
              "the scatter consumed rank %u's gradient area", r);
    cr_assert(shardd__area_held(b, r, SHARDD__AREA_GATHER, NULL),
              "the gather area stays until released");
  }
  check_reduced(b, SHARDD_REDUCE_MEAN);
}

/* A rank that leaves has its areas back; one that asks for the other
 * kind of areas once the job has buffers is refused. */
Test(coll, transient_areas_of_a_lost_rank_are_returned) {
  cr_assert_eq(shardd__job_set_transient(job, 1, err, sizeof err), SHARDD_OK);
  shardd__buffer *b = buf_new("w", 300);
  cr_assert_eq(shardd__job_set_transient(job, 0, err, sizeof err), SHARDD_E_MISMATCH);
  for (uint32_t r = 0; r < W; r++)
    submit(r, 1, gather_grad_args(b));
  run_until(W);
  cr_assert(shardd__area_held(b, 1, SHARDD__AREA_GATHER, NULL));
  shardd__coll_member_lost(eng, &mem[1]);
  shardd__area_return_rank(job, 1);
  cr_assert(!shardd__area_held(b, 1, SHARDD__AREA_GATHER, NULL));
  cr_assert(!shardd__area_held(b, 1, SHARDD__AREA_GRAD, NULL));
  cr_assert(shardd__area_held(b, 0, SHARDD__AREA_GATHER, NULL), "others keep theirs");
  mem[1] = (shardd__coll_member){.job = job, .rank = 1};
}

/* the mean gradient of element j (every rank's grad_val) */
static double mean_grad(uint64_t j) {
  double g = 0;
  for (uint32_t r = 0; r < W; r++)
    g += grad_val(r, j);
  return g / W;
}

/* Every shard element is init - lr_eff * mean gradient (SGD). */
static void check_sgd(shardd__buffer *b, double lr_eff, const char *what) {
  uint64_t s = b->shard_numel;
  for (uint32_t a = 0; a < W; a++) {
    const float *p = shard_of(b, a);
    for (uint64_t i = 0; i < s && a * s + i < b->numel; i++) {
      double want = shard_val(0, a, i) - lr_eff * mean_grad(a * s + i);
      if (fabs(p[i] - want) > 1e-6 * fabs(want) + 1e-5)
        cr_assert_fail("%s: rank %" PRIu32 " p[%" PRIu64 "] = %f, want %f", what,
                       a, i, (double)p[i], want);
    }
  }
}

/* A step's per-group hyperparameters (what a torch scheduler left in
 * param_groups) replace the registered ones for that step only; a count
 * other than the groups', an out-of-range value, a changed amsgrad and
 * ranks that disagree are refused before anything runs. */
Test(coll, step_group_hyperparameters_apply_to_that_step) {
  shardd__buffer *b = buf_new("p", 1000);
  shardd__optim *o = sgd_over(b); /* lr 0.5 */
  fill_shards(b, 0);
  fill_grads(b);
  for (uint32_t r = 0; r < W; r++)
    submit(r, 1, scatter_args(b, SHARDD_REDUCE_MEAN));
  run_until(W);
  shardd__optspec_hp two[2] = {{.has_lr = 1, .lr = 0.25}, {.has_lr = 1, .lr = 0.25}};
  shardd__coll_args st = {.kind = SHARDD__COLL_STEP, .target = o->hdr.id,
                          .group_hp = two, .ngroup_hp = 2};
  submit(0, 2, st);
  expect_msg(expect_reply(0, 2, SHARDD_E_INVAL), "2 groups of hyperparameters");
  shardd__optspec_hp bad = {.has_momentum = 1, .momentum = -1};
  st.group_hp = &bad;
  st.ngroup_hp = 1;
  submit(0, 3, st);
  expect_msg(expect_reply(0, 3, SHARDD_E_RANGE), "param group 0");
  shardd__optspec_hp ams = {.has_amsgrad = 1, .amsgrad = 1};
  st.group_hp = &ams;
  submit(0, 4, st);
  expect_msg(expect_reply(0, 4, SHARDD_E_INVAL), "amsgrad cannot change");
  /* registered without momentum: no buffer to update */
  shardd__optspec_hp mom = {.has_momentum = 1, .momentum = 0.9};
  st.group_hp = &mom;
  submit(0, 40, st);
  expect_msg(expect_reply(0, 40, SHARDD_E_INVAL), "momentum buffer exists only");
  /* ranks disagree on the lr: every one is refused, nothing changes */
  shardd__optspec_hp q1 = {.has_lr = 1, .lr = 0.25}, q2 = {.has_lr = 1, .lr = 0.125};
  st.group_hp = &q1;
  submit(0, 5, st);
  submit(1, 5, st);
  st.group_hp = &q2;
  submit(2, 5, st);
  run_until(5 + W);
  for (uint32_t r = 0; r < W; r++)
    expect_reply(r, 5, SHARDD_E_MISMATCH);
  cr_assert_eq(o->steps, 0);
  check_sgd(b, 0, "after the refusals");
  /* agreed: lr 0.25 this step (and the override's buffer is not kept) */
  for (uint32_t r = 0; r < W; r++) {
    shardd__optspec_hp mine = {.has_lr = 1, .lr = 0.25};
    shardd__coll_args a = st;
    a.group_hp = &mine;
    submit(r, 6, a);
    mine.lr = 99; /* read during submit only */
  }
  run_until(5 + 2 * W);
  for (uint32_t r = 0; r < W; r++)
    expect_reply(r, 6, SHARDD_OK);
  check_sgd(b, 0.25, "lr 0.25 for one step");
  cr_assert_eq(o->groups[0].lr, 0.5, "the registered lr stays");
}

/* FSDP's clip_grad_norm_: the norm alone (no update, the count stays),
 * then the next step applies the clip; a second step is unclipped. */
Test(coll, norm_only_reports_then_the_next_step_clips) {
  shardd__buffer *b = buf_new("p", 1000);
  shardd__optim *o = sgd_over(b); /* lr 0.5 */
  fill_shards(b, 0);
  fill_grads(b);
  for (uint32_t r = 0; r < W; r++)
    submit(r, 1, scatter_args(b, SHARDD_REDUCE_MEAN));
  run_until(W);
  double sumsq = 0;
  for (uint64_t j = 0; j < b->numel; j++)
    sumsq += mean_grad(j) * mean_grad(j);
  double norm = sqrt(sumsq);
  shardd__coll_args nm = {.kind = SHARDD__COLL_STEP, .target = o->hdr.id,
                          .norm_only = 1};
  for (uint32_t r = 0; r < W; r++)
    submit(r, 2, nm);
  run_until(2 * W);
  for (uint32_t r = 0; r < W; r++) {
    const reply *rp = expect_reply(r, 2, SHARDD_OK);
    cr_assert(rp->res.has_total_norm);
    cr_assert(fabs(rp->res.total_norm - norm) <= 1e-5 * norm);
    cr_assert_eq(rp->res.step, 0, "the count stays");
  }
  check_sgd(b, 0, "a norm changes nothing");
  cr_assert_eq(o->clip_pending, 0, "no max_norm: nothing to clip");
  nm.max_norm = norm / 2;
  for (uint32_t r = 0; r < W; r++)
    submit(r, 3, nm);
  run_until(3 * W);
  cr_assert_eq(o->clip_pending, 1);
  shardd__coll_args st = {.kind = SHARDD__COLL_STEP, .target = o->hdr.id};
  for (uint32_t r = 0; r < W; r++)
    submit(r, 4, st);
  run_until(4 * W);
  double coef = (norm / 2) / (norm + 1e-6);
  check_sgd(b, 0.5 * coef, "clipped step");
  cr_assert_eq(o->steps, 1);
  cr_assert_eq(o->clip_pending, 0, "a clip applies to one step");
}
