/* test_areas_shared.c — the node's gathered copy (host backend): a real
 * shardd, the two ranks of a transient job as two connections of this
 * thread (a gather is sent async on one and completed on the other, so no
 * thread waits on another). Both ranks' gathers of a buffer name one area,
 * the same bytes of one memfd, mapped read-only (a write faults; the
 * mapping cannot be made writable); the daemon holds one unit for it
 * (status: gathered_units, gathered_bytes); the copy lives until the last
 * local rank releases it, whatever order the ranks release in, and a rank
 * that disconnects gives back only its own reference. Values are computed
 * here from what the ranks wrote, never read back from the code under
 * test. */
#include <criterion/criterion.h>
#include <errno.h>
#include <inttypes.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include "harness.h"

#define WORLD 2
#define NBUF 3
#define NUMEL 65536u
#define SHARD (NUMEL / WORLD)
#define UNIT_BYTES (NUMEL * 4u) /* a whole fp32 buffer, page aligned */
/* the node's gather pool: WORLD * (2 leases - 1) + 1 slots */
#define GATHER_SLOTS (WORLD * (2u - 1u) + 1u)

static test_daemon d;

static void start(void) {
  const char *args[] = {"--devices", "2", NULL};
  test_daemon_start(&d, args);
}

static void stop(void) { test_daemon_finish(&d); }

typedef struct {
  shardd_client_t *c[WORLD];
  shardd_buffer_info b[WORLD][NBUF];
} job_t;

static float param(int b, uint64_t i) { return (float)(b * 100000 + (int)i) + 0.5f; }

/* Rank r connects to job and registers s0.. with its shard's values. */
static void rank_join(job_t *j, uint32_t r, const char *job) {
  shardd_connect_opts o = SHARDD_CONNECT_OPTS_INIT;
  o.job = job;
  o.rank = r;
  o.world = WORLD;
  o.transient_areas = 1;
  char err[512] = "";
  cr_assert_eq(shardd_connect(d.sock, &o, &j->c[r], err, sizeof err), SHARDD_OK,
               "rank %u: %s", r, err);
  for (int b = 0; b < NBUF; b++) {
    char name[16];
    snprintf(name, sizeof name, "s%d", b);
    shardd_buffer_info *bi = &j->b[r][b];
    cr_assert_eq(shardd_buffer_register(j->c[r], name, SHARDD_DTYPE_FP32, NUMEL, bi),
                 SHARDD_OK, "%s", shardd_last_error(j->c[r]));
    float *s = bi->shard;
    for (uint64_t k = 0; k < SHARD; k++)
      s[k] = param(b, r * SHARD + k);
  }
}

/* Both ranks gather buffer b: rank 0's is sent async, rank 1's completes
 * it (a collective), then rank 0's reply is read. */
static void gather2(job_t *j, int b, shardd_area a[WORLD]) {
  shardd_ticket t;
  cr_assert_eq(shardd_gather_async(j->c[0], j->b[0][b].id, &t), SHARDD_OK, "%s",
               shardd_last_error(j->c[0]));
  cr_assert_eq(shardd_gather_area(j->c[1], j->b[1][b].id, 0, &a[1]), SHARDD_OK, "%s",
               shardd_last_error(j->c[1]));
  cr_assert_eq(shardd_wait_area(j->c[0], t, &a[0]), SHARDD_OK, "%s",
               shardd_last_error(j->c[0]));
}

static void release(job_t *j, uint32_t r, int b) {
  cr_assert_eq(shardd_release(j->c[r], j->b[r][b].id), SHARDD_OK, "rank %u s%d: %s", r,
               b, shardd_last_error(j->c[r]));
}

static void expect_values(const void *area, int b, const char *who) {
  const float *g = area;
  for (uint64_t i = 0; i < NUMEL; i++)
    cr_assert_eq(g[i], param(b, i), "%s: s%d[%" PRIu64 "] = %g, wanted %g", who, b, i,
                 (double)g[i], (double)param(b, i));
}

/* Where p lies in this process's mappings: the file's inode, the byte of
 * the file and the mapping's permissions. */
typedef struct {
  unsigned long inode, off;
  char perms[8];
} where_t;

static where_t where(const void *p) {
  FILE *f = fopen("/proc/self/maps", "r");
  cr_assert_not_null(f);
  char line[512];
  where_t w = {0, 0, ""};
  unsigned long a = (unsigned long)(uintptr_t)p;
  while (fgets(line, sizeof line, f)) {
    unsigned long lo, hi, off, inode;
    char perms[8];
    if (sscanf(line, "%lx-%lx %7s %lx %*s %lu", &lo, &hi, perms, &off, &inode) == 5 &&
        a >= lo && a < hi) {
      w.inode = inode;
      w.off = off + (a - lo);
      snprintf(w.perms, sizeof w.perms, "%s", perms);
      break;
    }
  }
  fclose(f);
  cr_assert_neq(w.inode, 0ul, "%p is in no file mapping", p);
  return w;
}

/* The job's gathered copies as status reports them (on rank r's
 * connection). */
typedef struct {
  double units, bytes, pool;
  int shared;
} gathered_t;

static gathered_t gathered(job_t *j, uint32_t r, const char *job) {
  char *st = NULL;
  cr_assert_eq(shardd_status_json(j->c[r], &st), SHARDD_OK, "%s",
               shardd_last_error(j->c[r]));
  tj *t = tj_parse(st);
  cr_assert_not_null(t, "status --json is not JSON: %s", st);
  const tj *jobs = tj_need(t, "jobs", TJ_ARR);
  gathered_t g = {-1, -1, -1, 0};
  for (size_t i = 0; i < jobs->n; i++) {
    const tj *jb = jobs->kids[i];
    if (strcmp(tj_need(jb, "name", TJ_STR)->str, job) != 0)
      continue;
    g.units = tj_need(jb, "gathered_units", TJ_NUM)->num;
    g.bytes = tj_need(jb, "gathered_bytes", TJ_NUM)->num;
    g.pool = tj_need(jb, "gather_pool_bytes", TJ_NUM)->num;
    g.shared = tj_need(jb, "gather_shared", TJ_BOOL)->boolean;
  }
  cr_assert_geq(g.units, 0, "job %s not in status: %s", job, st);
  tj_free(t);
  shardd_free(st);
  return g;
}

static void close_all(job_t *j) {
  for (uint32_t r = 0; r < WORLD; r++)
    shardd_close(j->c[r]);
}

Test(areas_shared, two_ranks_read_one_read_only_copy, .init = start, .fini = stop,
     .timeout = 60) {
  job_t j;
  memset(&j, 0, sizeof j);
  for (uint32_t r = 0; r < WORLD; r++)
    rank_join(&j, r, "one");
  gathered_t g = gathered(&j, 0, "one");
  cr_expect_eq(g.units, 0.0);
  shardd_area a[WORLD];
  gather2(&j, 0, a);
  expect_values(a[0].gather, 0, "rank 0");
  expect_values(a[1].gather, 0, "rank 1");
  /* two mappings (a connection maps its pools), one area: the same byte
   * of the same memfd, mapped read-only and shared */
  where_t w0 = where(a[0].gather), w1 = where(a[1].gather);
  cr_expect_eq(w0.inode, w1.inode, "the ranks' gather areas are different files");
  cr_expect_eq(w0.off, w1.off, "the ranks' gather areas are at bytes %lu and %lu",
               w0.off, w1.off);
  cr_expect_str_eq(w0.perms, "r--s");
  cr_expect_str_eq(w1.perms, "r--s");
  cr_expect_eq(a[0].pool, a[1].pool);
  /* the daemon holds one unit for both */
  g = gathered(&j, 1, "one");
  cr_expect(g.shared);
  cr_expect_eq(g.units, 1.0, "gathered units %.0f", g.units);
  cr_expect_eq(g.bytes, (double)UNIT_BYTES, "gathered bytes %.0f", g.bytes);
  cr_expect_eq(g.pool, (double)GATHER_SLOTS * UNIT_BYTES);

  /* a trainer cannot write the copy its peers read: a store faults ... */
  pid_t pid = fork();
  cr_assert_geq(pid, 0);
  if (pid == 0) {
    signal(SIGSEGV, SIG_DFL);
    *(volatile float *)a[0].gather = -1.0f;
    _exit(0); /* the write went through */
  }
  int status = 0;
  cr_assert_eq(waitpid(pid, &status, 0), pid);
  cr_expect(WIFSIGNALED(status) && WTERMSIG(status) == SIGSEGV,
            "a write to the gathered copy did not fault (status %#x)", status);
  /* ... and the mapping cannot be made writable: its descriptor is
   * read-only */
  long page = sysconf(_SC_PAGESIZE);
  void *pg = (void *)((uintptr_t)a[1].gather & ~(uintptr_t)(page - 1));
  errno = 0;
  cr_expect_eq(mprotect(pg, (size_t)page, PROT_READ | PROT_WRITE), -1,
               "mprotect made the gathered copy writable");
  cr_expect_eq(errno, EACCES, "mprotect: %s", strerror(errno));
  expect_values(a[0].gather, 0, "rank 0 after the writes");
  release(&j, 0, 0);
  release(&j, 1, 0);
  g = gathered(&j, 0, "one");
  cr_expect_eq(g.units, 0.0, "released by both: %.0f units held", g.units);
  close_all(&j);
}

/* Ranks release in different orders, each keeping a different unit (one
 * rank lagging): the next gather needs WORLD + 1 copies, all the pool
 * has, and every rank reads the right values throughout. */
Test(areas_shared, out_of_order_releases_keep_each_copy, .init = start, .fini = stop,
     .timeout = 60) {
  job_t j;
  memset(&j, 0, sizeof j);
  for (uint32_t r = 0; r < WORLD; r++)
    rank_join(&j, r, "order");
  shardd_area a[NBUF][WORLD];
  gather2(&j, 0, a[0]);
  release(&j, 0, 0); /* rank 0 first: rank 1 still reads it */
  expect_values(a[0][1].gather, 0, "rank 1, s0 after rank 0's release");
  gather2(&j, 1, a[1]);
  release(&j, 1, 1); /* rank 1 releases s1, rank 0 keeps it */
  cr_expect_neq(where(a[1][0].gather).off, where(a[0][1].gather).off,
                "s1 was gathered over s0, which rank 1 still holds");
  gather2(&j, 2, a[2]);
  gathered_t g = gathered(&j, 0, "order");
  cr_expect_eq(g.units, (double)GATHER_SLOTS, "units held: rank 0 s1, rank 1 s0, both s2");
  expect_values(a[1][0].gather, 1, "rank 0, s1");
  expect_values(a[0][1].gather, 0, "rank 1, s0");
  expect_values(a[2][0].gather, 2, "rank 0, s2");
  expect_values(a[2][1].gather, 2, "rank 1, s2");
  release(&j, 1, 2);
  release(&j, 0, 1);
  expect_values(a[2][0].gather, 2, "rank 0, s2 after rank 1's release");
  expect_values(a[0][1].gather, 0, "rank 1, s0 after rank 0 released s1");
  release(&j, 1, 0);
  release(&j, 0, 2);
  g = gathered(&j, 0, "order");
  cr_expect_eq(g.units, 0.0);
  close_all(&j);
}

/* A rank that disconnects holding copies gives back its references only:
 * the copy its peer holds stays (the next gather lands elsewhere), the one
 * only it held is free again. */
Test(areas_shared, a_lost_rank_leaves_its_peers_copy, .init = start, .fini = stop,
     .timeout = 60) {
  job_t j;
  memset(&j, 0, sizeof j);
  for (uint32_t r = 0; r < WORLD; r++)
    rank_join(&j, r, "lost");
  shardd_area a0[WORLD], a1[WORLD], a2[WORLD];
  gather2(&j, 0, a0); /* both keep s0 */
  gather2(&j, 1, a1);
  release(&j, 1, 1); /* only rank 0 holds s1 */
  shardd_close(j.c[0]); /* rank 0 leaves holding s0 and s1 */
  j.c[0] = NULL;
  gathered_t g;
  double end = test_mono_s() + TEST_HANG_S;
  do { /* its session's end is the daemon's to notice */
    g = gathered(&j, 1, "lost");
    if (g.units == 1.0)
      break;
    test_sleep_ms(5);
  } while (test_mono_s() < end);
  cr_expect_eq(g.units, 1.0, "after rank 0 left: %.0f units held, wanted rank 1's s0",
               g.units);
  expect_values(a0[1].gather, 0, "rank 1, s0 after rank 0 left");
  rank_join(&j, 0, "lost"); /* the relaunch */
  gather2(&j, 2, a2);
  expect_values(a0[1].gather, 0, "rank 1, s0 after the relaunch's gather");
  expect_values(a2[0].gather, 2, "rank 0, s2");
  expect_values(a2[1].gather, 2, "rank 1, s2");
  cr_expect_neq(where(a2[1].gather).off, where(a0[1].gather).off,
                "s2 was gathered over s0, which rank 1 still holds");
  release(&j, 1, 0);
  release(&j, 0, 2);
  release(&j, 1, 2);
  close_all(&j);
}
