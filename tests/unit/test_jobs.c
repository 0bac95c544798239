/* test_jobs.c — job lifetime (jobs/jobs.h) driven in process: a loop, a
 * host backend, a registry and a collective engine of the test's own. The
 * released hook is told of every job jobs.c releases, while the job is
 * still there, whichever way it goes (the last client leaving under
 * --job-linger 0, the linger running out, shardctl release), and of no
 * job a release refuses: the dispatcher frees what it keeps by a job's
 * address there, so a later job at that address never finds it. */
#include <criterion/criterion.h>
#include <stdio.h>
#include <string.h>
#include <uv.h>

#include "backend.h"
#include "coll.h"
#include "jobs.h"
#include "registry.h"

#define MAX_TOLD 8

static uv_loop_t loop;
static shardd__backend *be;
static shardd__registry reg;
static shardd__coll_engine *eng;
static shardd__jobs jobs;
static int jobs_made;
static char err[512];

static shardd__job *told[MAX_TOLD];
static char told_name[MAX_TOLD][64];
static int ntold;

static void on_done(void *ctx, shardd__coll_member *m, uint64_t seq,
                    shardd_err code, const char *msg,
                    const shardd__coll_result *res) {}
static void on_quiet(void *ctx, shardd__job *j) {}

static void on_released(void *arg, shardd__job *job) {
  cr_assert_eq(arg, &jobs, "the hook's arg is passed through");
  cr_assert_lt(ntold, MAX_TOLD);
  /* read through the pointer: the job must still be there */
  snprintf(told_name[ntold], sizeof told_name[ntold], "%s", job->name);
  told[ntold++] = job;
}

static void setup(void) {
  ntold = 0;
  cr_assert_eq(uv_loop_init(&loop), 0);
  cr_assert_eq(shardd__backend_host_create(1, 64u << 20, &be, err, sizeof err),
               SHARDD_OK, "%s", err);
  shardd__registry_init(&reg, be);
  shardd__coll_config cfg = {.loop = &loop,
                             .reg = &reg,
                             .timeout = 5,
                             .max_pending = 4,
                             .hooks = {.ctx = NULL, .done = on_done,
                                       .job_quiet = on_quiet}};
  cr_assert_eq(shardd__coll_engine_create(&cfg, &eng), SHARDD_OK);
}

static void make_jobs(double linger) {
  shardd__jobs_init(&jobs, &loop, &reg, eng, linger, NULL, 0, on_released, &jobs);
  jobs_made = 1;
}

static void teardown(void) {
  if (jobs_made)
    shardd__jobs_free(&jobs);
  jobs_made = 0;
  shardd__coll_engine_stop(eng);
  shardd__coll_engine_destroy(eng);
  shardd__registry_free(&reg);
  be->ops->destroy(be);
  uv_loop_close(&loop);
}

TestSuite(jobs, .init = setup, .fini = teardown);

static shardd__job *job_of(const char *name, uint32_t world) {
  shardd__job *job;
  cr_assert_eq(shardd__job_get(&reg, name, world, 1000, &job, err, sizeof err),
               SHARDD_OK, "%s", err);
  return job;
}

static void claim(shardd__job *job, uint32_t rank, uint64_t owner) {
  int32_t holder;
  cr_assert_eq(shardd__jobs_claim(&jobs, job, rank, owner, 1, &holder), SHARDD_OK);
}

Test(jobs, the_last_client_leaving_under_linger_0_tells_the_released_hook) {
  make_jobs(0);
  shardd__job *job = job_of("a", 2);
  claim(job, 0, 11);
  claim(job, 1, 12);
  shardd__jobs_leave(&jobs, job, 0, 11, 1.0, 0);
  cr_assert_eq(ntold, 0, "released while rank 1 holds it");
  shardd__jobs_leave(&jobs, job, 1, 12, 1.0, 0);
  cr_assert_eq(ntold, 1, "the release was not told");
  cr_expect_eq(told[0], job);
  cr_expect_str_eq(told_name[0], "a");
}

Test(jobs, a_linger_running_out_tells_the_released_hook) {
  make_jobs(600);
  shardd__job *job = job_of("b", 1);
  claim(job, 0, 21);
  shardd__jobs_leave(&jobs, job, 0, 21, 10.0, 0);
  shardd__jobs_expire(&jobs, 609.0);
  cr_assert_eq(ntold, 0, "released before its linger ran out");
  shardd__jobs_expire(&jobs, 611.0);
  cr_assert_eq(ntold, 1, "the release was not told");
  cr_expect_eq(told[0], job);
  cr_expect_str_eq(told_name[0], "b");
}

Test(jobs, release_now_tells_the_released_hook_and_a_refused_one_does_not) {
  make_jobs(600);
  shardd__job *job = job_of("c", 1);
  claim(job, 0, 31);
  cr_assert_eq(shardd__jobs_release_now(&jobs, job, err, sizeof err), SHARDD_E_BUSY);
  cr_assert_eq(ntold, 0, "a refused release was told");
  shardd__jobs_leave(&jobs, job, 0, 31, 1.0, 0);
  cr_assert_eq(shardd__jobs_release_now(&jobs, job, err, sizeof err), SHARDD_OK, "%s",
               err);
  cr_assert_eq(ntold, 1, "the release was not told");
  cr_expect_eq(told[0], job);
  cr_expect_str_eq(told_name[0], "c");
}

/* The ranks status lists come from the ranks held (claimed in any order,
 * some gone again), not from a walk of the world: the lowest 64 held and
 * the lowest 64 others, each ascending, and the count of those held.
 * Expected lists are computed here from the claims the test made. */
Test(jobs, ranks_lists_the_lowest_held_and_missing_whatever_the_claim_order) {
  make_jobs(600);
  enum { W = 1000, MAX = 64 };
  shardd__job *job = job_of("r", W);
  static int held[W];
  memset(held, 0, sizeof held);
  /* 300 ranks claimed in a scrambled order (37 is prime to 1000) */
  for (uint32_t i = 0; i < 300; i++) {
    uint32_t r = (i * 37 + 11) % W;
    claim(job, r, 1000 + r);
    held[r] = 1;
  }
  /* every third of them leaves, out of order too */
  for (uint32_t i = 0; i < 300; i += 3) {
    uint32_t r = (i * 37 + 11) % W;
    shardd__jobs_leave(&jobs, job, r, 1000 + r, 1.0, 0);
    held[r] = 0;
  }
  uint32_t h[MAX], m[MAX], want_h[MAX], want_m[MAX];
  size_t nh = 0, nm = 0, wh = 0, wm = 0;
  uint32_t total = 0;
  for (uint32_t r = 0; r < W; r++) {
    total += (uint32_t)held[r];
    if (held[r] && wh < MAX)
      want_h[wh++] = r;
    else if (!held[r] && wm < MAX)
      want_m[wm++] = r;
  }
  cr_assert_eq(shardd__jobs_ranks(&jobs, job, h, m, MAX, &nh, &nm), total);
  cr_assert_eq(total, 200u);
  cr_assert_eq(nh, wh);
  cr_assert_eq(nm, wm);
  for (size_t i = 0; i < nh; i++)
    cr_assert_eq(h[i], want_h[i], "held[%zu] = %u, wanted %u", i, h[i], want_h[i]);
  for (size_t i = 0; i < nm; i++)
    cr_assert_eq(m[i], want_m[i], "missing[%zu] = %u, wanted %u", i, m[i], want_m[i]);
  /* fewer than max of either: all of them */
  uint32_t h3[3], m3[3];
  shardd__jobs_ranks(&jobs, job, h3, m3, 3, &nh, &nm);
  cr_assert_eq(nh, 3u);
  cr_assert_eq(nm, 3u);
  for (size_t i = 0; i < 3; i++) {
    cr_assert_eq(h3[i], want_h[i]);
    cr_assert_eq(m3[i], want_m[i]);
  }
  /* all leave: none held, the lowest 64 of the world missing */
  for (uint32_t r = 0; r < W; r++)
    if (held[r])
      shardd__jobs_leave(&jobs, job, r, 1000 + r, 2.0, 0);
  cr_assert_eq(shardd__jobs_ranks(&jobs, job, h, m, MAX, &nh, &nm), 0u);
  cr_assert_eq(nh, 0u);
  cr_assert_eq(nm, (size_t)MAX);
  for (size_t i = 0; i < nm; i++)
    cr_assert_eq(m[i], (uint32_t)i);
}
