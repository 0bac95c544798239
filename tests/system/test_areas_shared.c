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
 * test. A trainer of another uid than the daemon's, or of the daemon's
 * (the unit runs it as user shardd), cannot reopen the copy's descriptor
 * for writing through /proc/self/fd. */
#include <criterion/criterion.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <linux/capability.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
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

/* Rank r connects to job and registers s0.. of numel[b] elements (NULL:
 * NUMEL each) with its shard's values. */
static void rank_join_sized(job_t *j, uint32_t r, const char *job,
                            const uint64_t *numel) {
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
    uint64_t n = numel ? numel[b] : NUMEL, shard = n / WORLD;
    cr_assert_eq(shardd_buffer_register(j->c[r], name, SHARDD_DTYPE_FP32, n, bi),
                 SHARDD_OK, "%s", shardd_last_error(j->c[r]));
    float *s = bi->shard;
    for (uint64_t k = 0; k < shard; k++)
      s[k] = param(b, r * shard + k);
  }
}

static void rank_join(job_t *j, uint32_t r, const char *job) {
  rank_join_sized(j, r, job, NULL);
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

static void expect_values_n(const void *area, int b, uint64_t n, const char *who) {
  const float *g = area;
  for (uint64_t i = 0; i < n; i++)
    cr_assert_eq(g[i], param(b, i), "%s: s%d[%" PRIu64 "] = %g, wanted %g", who, b, i,
                 (double)g[i], (double)param(b, i));
}

static void expect_values(const void *area, int b, const char *who) {
  expect_values_n(area, b, NUMEL, who);
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

/* Whether p and q are the same byte of the same file (each slot of the
 * host's pools is a memfd of its own). */
static int same_byte(const void *p, const void *q) {
  where_t a = where(p), b = where(q);
  return a.inode == b.inode && a.off == b.off;
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
  /* the pool's slots are made as they are first needed: one so far */
  cr_expect_eq(g.pool, (double)UNIT_BYTES);

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
  cr_expect(!same_byte(a[1][0].gather, a[0][1].gather),
            "s1 was gathered over s0, which rank 1 still holds");
  gather2(&j, 2, a[2]);
  gathered_t g = gathered(&j, 0, "order");
  cr_expect_eq(g.units, (double)GATHER_SLOTS, "units held: rank 0 s1, rank 1 s0, both s2");
  cr_expect_eq(g.pool, (double)GATHER_SLOTS * UNIT_BYTES, "every slot made");
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
  cr_expect(!same_byte(a2[1].gather, a0[1].gather),
            "s2 was gathered over s0, which rank 1 still holds");
  release(&j, 1, 0);
  release(&j, 0, 2);
  release(&j, 1, 2);
  close_all(&j);
}

/* Each slot is as large as the unit it was made for, not the job's
 * largest: a small unit's slot, then a large unit's beside it; a lease
 * takes the smallest free slot that holds its unit; one that finds only
 * smaller free slots grows one (slots only grow); and no slot is made
 * while a free one serves. Values stay each unit's throughout. */
Test(areas_shared, slots_are_sized_to_their_units, .init = start, .fini = stop,
     .timeout = 60) {
  const uint64_t numel[NBUF] = {NUMEL / 4, NUMEL, NUMEL};
  const double small = NUMEL, large = UNIT_BYTES; /* fp32 bytes, whole pages */
  job_t j;
  memset(&j, 0, sizeof j);
  for (uint32_t r = 0; r < WORLD; r++)
    rank_join_sized(&j, r, "sized", numel);
  shardd_area a0[WORLD], a1[WORLD], a2[WORLD];
  gather2(&j, 0, a0);
  gathered_t g = gathered(&j, 0, "sized");
  cr_expect_eq(g.pool, small, "one small unit gathered: a pool of %.0f bytes", g.pool);
  gather2(&j, 1, a1); /* beside it */
  g = gathered(&j, 0, "sized");
  cr_expect_eq(g.pool, small + large, "a small and a large unit: %.0f bytes", g.pool);
  cr_expect_eq(g.bytes, small + large, "gathered bytes %.0f", g.bytes);
  for (uint32_t r = 0; r < WORLD; r++) {
    release(&j, r, 0);
    release(&j, r, 1);
  }
  /* in the other order, each takes the slot that holds it */
  gather2(&j, 1, a1);
  gather2(&j, 0, a0);
  g = gathered(&j, 0, "sized");
  cr_expect_eq(g.pool, small + large, "the same units again: %.0f bytes", g.pool);
  expect_values_n(a1[0].gather, 1, NUMEL, "rank 0, s1");
  expect_values_n(a0[1].gather, 0, NUMEL / 4, "rank 1, s0");
  /* a second large unit beside the first: the small slot, free, grows */
  release(&j, 0, 0);
  release(&j, 1, 0);
  gather2(&j, 2, a2);
  g = gathered(&j, 0, "sized");
  cr_expect_eq(g.pool, 2 * large, "two large units: %.0f bytes", g.pool);
  expect_values_n(a2[0].gather, 2, NUMEL, "rank 0, s2");
  expect_values_n(a2[1].gather, 2, NUMEL, "rank 1, s2");
  expect_values_n(a1[1].gather, 1, NUMEL, "rank 1, s1 beside s2");
  /* the small unit again: a grown slot serves it, nothing is made */
  release(&j, 0, 1);
  release(&j, 1, 1);
  gather2(&j, 0, a0);
  g = gathered(&j, 0, "sized");
  cr_expect_eq(g.pool, 2 * large, "slots only grow: %.0f bytes", g.pool);
  expect_values_n(a0[0].gather, 0, NUMEL / 4, "rank 0, s0 in a large slot");
  close_all(&j);
}

/* ---- the copy's descriptor cannot be reopened for writing ---------------- */

/* Sends req on fd and reads its reply (the next one: nothing else is in
 * flight), keeping the first descriptor that came with it in *got (-1:
 * none). NULL when the daemon closed, the reply does not decode or is not
 * OK. No assertion: this runs in a forked child. */
static Shardwire__Response *child_rpc(int fd, shardd__frame_reader *rd,
                                      Shardwire__Request *req, int *got) {
  static uint64_t seq;
  req->seq = ++seq;
  *got = -1;
  size_t n = shardwire__request__get_packed_size(req);
  uint8_t *buf = malloc(n);
  if (buf == NULL)
    return NULL;
  shardwire__request__pack(req, buf);
  char err[256];
  shardd_err rc = shardd__frame_send(fd, buf, n, err, sizeof err);
  free(buf);
  if (rc != SHARDD_OK)
    return NULL;
  const uint8_t *payload;
  size_t len;
  int fds[4], nfds = 0;
  rc = shardd__frame_recv(fd, rd, &payload, &len, fds, 4, &nfds, err, sizeof err);
  for (int i = 0; i < nfds; i++) {
    if (*got < 0)
      *got = fds[i];
    else
      close(fds[i]);
  }
  Shardwire__Response *resp =
      rc == SHARDD_OK ? shardwire__response__unpack(NULL, len, payload) : NULL;
  if (resp && (resp->seq != req->seq || resp->code != SHARDWIRE__STATUS_CODE__OK)) {
    shardwire__response__free_unpacked(resp, NULL);
    resp = NULL;
  }
  return resp;
}

/* Takes CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH and CAP_FOWNER out of this
 * process's effective set: root then opens a file as its owner uid does,
 * as the daemon's uid does when the unit runs it as user shardd. */
static int drop_dac_override(void) {
  struct __user_cap_header_struct h = {_LINUX_CAPABILITY_VERSION_3, 0};
  struct __user_cap_data_struct c[_LINUX_CAPABILITY_U32S_3];
  if (syscall(SYS_capget, &h, c) != 0)
    return -1;
  const int drop[] = {CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH, CAP_FOWNER};
  for (size_t i = 0; i < sizeof drop / sizeof drop[0]; i++)
    c[drop[i] / 32].effective &= ~(1u << (drop[i] % 32));
  return syscall(SYS_capset, &h, c) == 0 ? 0 : -1;
}

/* As uid (another than the daemon's; the daemon's own when uid is this
 * process's, root without its override of file modes): the one rank of a
 * transient job, over its own connection, gathers a buffer and gets the
 * node's gather pool's descriptor, read-only; reopening it through
 * /proc/self/fd for writing must fail (EACCES). Exit code: 0 as expected,
 * else the step that failed. */
static int reopen_copy_writable(const char *sock, uid_t uid) {
  if (uid != geteuid() && (setgid(uid) != 0 || setuid(uid) != 0))
    return 10;
  if (uid == 0 && drop_dac_override() != 0)
    return 11;
  int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  struct sockaddr_un sa = {.sun_family = AF_UNIX};
  if (strlen(sock) >= sizeof sa.sun_path)
    return 12;
  memcpy(sa.sun_path, sock, strlen(sock) + 1);
  if (fd < 0 || connect(fd, (struct sockaddr *)&sa, sizeof sa) != 0)
    return 12;
  struct timeval tv = {(time_t)TEST_HANG_S, 0}; /* a hang fails the step */
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  shardd__frame_reader rd;
  shardd__frame_reader_init(&rd, SHARDD_MAX_FRAME);
  int got;
  Shardwire__Request req = SHARDWIRE__REQUEST__INIT;
  Shardwire__Hello h = SHARDWIRE__HELLO__INIT;
  h.protocol_version = SHARDD_PROTOCOL_VERSION;
  h.job = "ro";
  h.has_rank = h.has_world = h.has_transient_areas = 1;
  h.rank = 0;
  h.world = 1;
  h.transient_areas = 1;
  req.body_case = SHARDWIRE__REQUEST__BODY_HELLO;
  req.hello = &h;
  Shardwire__Response *resp = child_rpc(fd, &rd, &req, &got);
  if (resp == NULL)
    return 13;
  shardwire__response__free_unpacked(resp, NULL);
  Shardwire__RegisterBuffer rb = SHARDWIRE__REGISTER_BUFFER__INIT;
  rb.name = "w";
  rb.dtype = SHARDWIRE__DTYPE__FP32;
  rb.numel = NUMEL;
  req = (Shardwire__Request)SHARDWIRE__REQUEST__INIT;
  req.body_case = SHARDWIRE__REQUEST__BODY_REGISTER_BUFFER;
  req.register_buffer = &rb;
  resp = child_rpc(fd, &rd, &req, &got);
  if (resp == NULL || resp->body_case != SHARDWIRE__RESPONSE__BODY_BUFFER)
    return 14;
  if (got >= 0)
    close(got);
  Shardwire__Gather g = SHARDWIRE__GATHER__INIT;
  g.buffer = resp->buffer->id;
  shardwire__response__free_unpacked(resp, NULL);
  req = (Shardwire__Request)SHARDWIRE__REQUEST__INIT;
  req.body_case = SHARDWIRE__REQUEST__BODY_GATHER;
  req.gather = &g;
  resp = child_rpc(fd, &rd, &req, &got);
  if (resp == NULL || resp->body_case != SHARDWIRE__RESPONSE__BODY_GATHER)
    return 15;
  if (got < 0)
    return 16; /* no descriptor came with the pool */
  size_t pool_bytes = (size_t)resp->gather->pool_bytes;
  shardwire__response__free_unpacked(resp, NULL);
  int acc = fcntl(got, F_GETFL);
  if (acc < 0 || (acc & O_ACCMODE) != O_RDONLY)
    return 17; /* handed out writable */
  void *m = mmap(NULL, pool_bytes, PROT_READ, MAP_SHARED, got, 0);
  if (m == MAP_FAILED)
    return 18; /* not the pool */
  munmap(m, pool_bytes);
  char path[64];
  snprintf(path, sizeof path, "/proc/self/fd/%d", got);
  int w = open(path, O_RDWR | O_CLOEXEC);
  if (w >= 0)
    return 19; /* reopened writable */
  if (errno != EACCES)
    return 20;
  close(got);
  close(fd);
  shardd__frame_reader_free(&rd);
  return 0;
}

/* Runs reopen_copy_writable as uid in a child; asserts it exited 0. */
static void expect_no_writable_reopen(uid_t uid) {
  test_daemon_open_to_all(&d);
  pid_t pid = fork();
  cr_assert_geq(pid, 0);
  if (pid == 0)
    _exit(reopen_copy_writable(d.sock, uid));
  int st;
  cr_assert(test_wait_exit(pid, &st), "uid %d's trainer did not finish", (int)uid);
  cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == 0,
            "uid %d's trainer: step %d failed (19: it reopened the gathered copy "
            "for writing)", (int)uid, WIFEXITED(st) ? WEXITSTATUS(st) : -1);
  /* and the daemon serves on */
  shardd_client_t *c = test_connect(&d, NULL, 0, 1);
  cr_assert_eq(shardd_ping(c), SHARDD_OK);
  shardd_close(c);
}

Test(areas_shared, another_uid_cannot_reopen_its_copy_writable, .init = start,
     .fini = stop, .timeout = 60) {
  if (geteuid() != 0)
    cr_skip_test("needs root to act as a second uid");
  expect_no_writable_reopen(4242);
}

/* The daemon's own uid (root: without the override of file modes that
 * lets root write any file) reopens it no more. */
Test(areas_shared, the_daemons_uid_cannot_reopen_the_copy_writable, .init = start,
     .fini = stop, .timeout = 60) {
  expect_no_writable_reopen(geteuid());
}
