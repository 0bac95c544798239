/* test_limits.c — a real shardd's limits: the client and job limits and a
 * second daemon, size flags out of range, the status of many jobs of huge
 * worlds, the memory of a freed region, the frame limit on replies.
 * Expected values come from what the test itself set up (flags,
 * connections), never from the daemon. */
#include <criterion/criterion.h>
#include <criterion/parameterized.h>
#include <dirent.h>
#include <pthread.h>
#include <sys/resource.h>
#include <uv.h>

#include "backend.h"
#include "harness.h"
#include "server_fixture.h"
#include "server.h"

/* The loop-time bounds below tell O(world) work from O(ranks that
 * arrived) by a factor of 3-4; under the sanitizers (make check) the
 * daemon runs 2-3x slower throughout, so the bounds scale with it. */
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define SANITIZED 1
#define SLOWDOWN 4.0
#else
#define SANITIZED 0
#define SLOWDOWN 1.0
#endif

/* ---- limits and a second daemon ----------------------------------------- */

static void start_limited(void) {
  const char *args[] = {"--max-clients", "2", NULL};
  test_daemon_start(&d, args);
}

Test(server, client_limit, .init = start_limited, .fini = stop_daemon) {
  shardd_client_t *a = test_connect(&d, NULL, 0, 1);
  shardd_client_t *b = test_connect(&d, NULL, 0, 1);
  shardd_connect_opts o = SHARDD_CONNECT_OPTS_INIT;
  shardd_client_t *c = NULL;
  char err[512];
  /* root (these tests' uid) gets SHARDD__ADMIN_RESERVE connections past
   * the limit, so an operator is never locked out; past those, refused */
  int root = geteuid() == 0;
  shardd_client_t *extra[SHARDD__ADMIN_RESERVE];
  for (unsigned i = 0; root && i < SHARDD__ADMIN_RESERVE; i++) {
    cr_assert_eq(shardd_connect(d.sock, &o, &extra[i], err, sizeof err), SHARDD_OK,
                 "root's reserved connection %u: %s", i, err);
  }
  shardd_err rc = shardd_connect(d.sock, &o, &c, err, sizeof err);
  cr_assert_eq(rc, SHARDD_E_LIMIT, "client past the limit: %s (%s)", shardd_err_name(rc),
               err);
  cr_assert_not_null(strstr(err, "2"), "%s", err);
  for (unsigned i = 0; root && i < SHARDD__ADMIN_RESERVE; i++)
    shardd_close(extra[i]);
  shardd_close(a);
  /* a slot frees up once a client leaves */
  for (double end = test_mono_s() + TEST_HANG_S;;) {
    rc = shardd_connect(d.sock, &o, &c, err, sizeof err);
    if (rc == SHARDD_OK)
      break;
    cr_assert_eq(rc, SHARDD_E_LIMIT, "%s", err);
    cr_assert_lt(test_mono_s(), end, "no slot freed after a client left");
    test_sleep_ms(10);
  }
  cr_assert_eq(shardd_ping(b), SHARDD_OK);
  shardd_close(b);
  shardd_close(c);
}

Test(server, second_daemon_on_a_live_socket_refuses, .init = start_default,
     .fini = stop_daemon) {
  char cmd[512];
  snprintf(cmd, sizeof cmd, "%s --socket %s 2>%s/second.log",
           test_bin("SHARDD_BIN", "build/shardd"), d.sock, d.dir);
  int st = system(cmd);
  cr_assert(WIFEXITED(st));
  cr_assert_eq(WEXITSTATUS(st), 1, "a second daemon exited %d", WEXITSTATUS(st));
  char log[128];
  snprintf(log, sizeof log, "%s/second.log", d.dir);
  char *text = test_slurp(log);
  unlink(log);
  cr_assert_not_null(strstr(text, d.sock), "its error does not name the socket: %s", text);
  free(text);
  /* the first one still serves on its socket */
  expect_served();
}

Test(server, stale_socket_file_is_replaced) {
  /* a socket file nobody listens on, as a crashed daemon leaves */
  char dir[] = "/tmp/shardd-stale-XXXXXX";
  cr_assert_not_null(mkdtemp(dir));
  char path[64];
  snprintf(path, sizeof path, "%s/s.sock", dir);
  int fd = socket(AF_UNIX, SOCK_STREAM, 0);
  struct sockaddr_un sa = {.sun_family = AF_UNIX};
  snprintf(sa.sun_path, sizeof sa.sun_path, "%s", path);
  cr_assert_eq(bind(fd, (struct sockaddr *)&sa, sizeof sa), 0);
  close(fd);
  pid_t pid = fork();
  cr_assert(pid >= 0);
  if (pid == 0) {
    int nul = open("/dev/null", O_WRONLY);
    dup2(nul, 2);
    execl(test_bin("SHARDD_BIN", "build/shardd"), "shardd", "--socket", path, (char *)NULL);
    _exit(127);
  }
  int up = 0;
  for (double end = test_mono_s() + TEST_HANG_S; !up && test_mono_s() < end;) {
    up = test_can_connect(path);
    if (!up)
      test_sleep_ms(10);
  }
  kill(pid, SIGTERM);
  int st;
  waitpid(pid, &st, 0);
  unlink(path);
  rmdir(dir);
  cr_assert(up, "shardd did not take over a stale socket file");
  cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == 0);
}

/* A job outlives its clients for --job-linger seconds (ranks may come back
 * to their shards), then goes with all its memory. Coming back is tested
 * under a linger no test run outlasts, going away under one of 1 s, so
 * neither depends on how fast the test gets back. */
static void start_long_linger(void) {
  const char *args[] = {"--job-linger", "600", NULL};
  test_daemon_start(&d, args);
}

static void start_linger(void) {
  const char *args[] = {"--job-linger", "1", NULL};
  test_daemon_start(&d, args);
}

static size_t job_count(void) {
  tj *st = shardctl_status();
  size_t n = tj_need(st, "jobs", TJ_ARR)->n;
  tj_free(st);
  return n;
}

Test(server, lingering_job_is_reattached, .init = start_long_linger, .fini = stop_daemon) {
  shardd_client_t *c = test_connect(&d, "linger", 0, 1);
  shardd_buffer_info b;
  cr_assert_eq(shardd_buffer_register(c, "p", SHARDD_DTYPE_FP32, 8, &b), SHARDD_OK);
  ((float *)b.shard)[3] = 42.0f;
  uint64_t id = b.id;
  shardd_close(c);

  /* Back within the linger time: same buffer, same bytes. */
  cr_assert_eq(job_count(), 1);
  c = test_connect(&d, "linger", 0, 1);
  cr_assert_eq(shardd_buffer_register(c, "p", SHARDD_DTYPE_FP32, 8, &b), SHARDD_OK);
  cr_assert_eq(b.created, 0);
  cr_assert_eq(b.id, id);
  cr_assert_eq(((float *)b.shard)[3], 42.0f);
  shardd_close(c);
  cr_assert_eq(job_count(), 1, "the job went although --job-linger is 600 s");
}

Test(server, job_lingers_then_is_released, .init = start_linger, .fini = stop_daemon) {
  shardd_client_t *c = test_connect(&d, "linger", 0, 1);
  shardd_buffer_info b;
  cr_assert_eq(shardd_buffer_register(c, "p", SHARDD_DTYPE_FP32, 8, &b), SHARDD_OK);
  ((float *)b.shard)[3] = 42.0f;
  shardd_close(c);

  /* Gone for longer: released, memory and all. */
  int released = 0;
  for (double end = test_mono_s() + TEST_HANG_S; !released;) {
    released = job_count() == 0;
    if (!released) {
      cr_assert_lt(test_mono_s(), end, "the job outlived --job-linger 1 by %.0f s",
                   TEST_HANG_S);
      test_sleep_ms(100);
    }
  }
  tj *st = shardctl_status();
  const tj *devs = tj_need(st, "devices", TJ_ARR);
  for (size_t i = 0; i < devs->n; i++)
    cr_assert_eq(tj_need(devs->kids[i], "used_bytes", TJ_NUM)->num, 0);
  tj_free(st);
}

/* One rank of a world-1 job "name" that trains `steps` SGD steps on a
 * buffer "p" (shard 1.0, gradient 0.5, lr 1): the client, still open. */
static shardd_client_t *trained(const char *name, int steps) {
  shardd_client_t *c = test_connect(&d, name, 0, 1);
  shardd_buffer_info b;
  cr_assert_eq(shardd_buffer_register(c, "p", SHARDD_DTYPE_FP32, 8, &b), SHARDD_OK);
  shardd_param_ref ref = {b.id, "p"};
  shardd_param_group g = {&ref, 1, {0}};
  shardd_hparams hp = {.set = SHARDD_HP_LR, .lr = 1.0};
  uint64_t opt;
  cr_assert_eq(shardd_optimizer_register(c, "sgd", SHARDD_OPTIM_SGD, &hp, &g, 1, &opt),
               SHARDD_OK, "%s", shardd_last_error(c));
  if (b.created)
    for (uint64_t i = 0; i < b.shard_numel; i++)
      ((float *)b.shard)[i] = 1.0f;
  for (int s = 0; s < steps; s++) {
    for (uint64_t i = 0; i < b.padded_numel; i++)
      ((float *)b.grad)[i] = 0.5f;
    cr_assert_eq(shardd_scatter(c, b.id, SHARDD_REDUCE_MEAN), SHARDD_OK);
    cr_assert_eq(shardd_step(c, opt, NULL, NULL), SHARDD_OK);
  }
  return c;
}

/* The job count once it settles (a close is read after its last reply). */
static size_t job_count_becomes(size_t want) {
  size_t n = job_count();
  for (double end = test_mono_s() + 5; n != want && test_mono_s() < end;) {
    test_sleep_ms(20);
    n = job_count();
  }
  return n;
}

/* A job whose ranks all finished (shardd_finish: a Goodbye, then the close)
 * is done: released at once under a long --job-linger, memory back, and a
 * new run of its name starts fresh, not resuming the finished one. */
Test(server, finished_job_is_released_at_once_and_its_name_starts_fresh,
     .init = start_long_linger, .fini = stop_daemon) {
  cr_assert_eq(shardd_finish(trained("fin", 2)), SHARDD_OK);
  cr_assert_eq(job_count_becomes(0), 0, "a finished job lingered");
  tj *st = shardctl_status();
  const tj *devs = tj_need(st, "devices", TJ_ARR);
  for (size_t i = 0; i < devs->n; i++)
    cr_assert_eq(tj_need(devs->kids[i], "used_bytes", TJ_NUM)->num, 0);
  tj_free(st);
  shardd_client_t *c = test_connect(&d, "fin", 0, 1);
  uint64_t step = 99;
  cr_assert_eq(shardd_resumed(c, &step), 0, "a new run is told it resumes");
  cr_assert_eq(step, 0);
  shardd_buffer_info b;
  cr_assert_eq(shardd_buffer_register(c, "p", SHARDD_DTYPE_FP32, 8, &b), SHARDD_OK);
  cr_assert_eq(b.created, 1, "the new run attached to the finished run's buffer");
  cr_assert_eq(shardd_finish(c), SHARDD_OK);

  /* two ranks: one finishing is not enough, the job waits for the other */
  shardd_client_t *r0 = test_connect(&d, "fin2", 0, 2), *r1 = test_connect(&d, "fin2", 1, 2);
  cr_assert_eq(shardd_finish(r0), SHARDD_OK);
  shardd_close(r1); /* it died: the job lingers for a relaunch */
  test_sleep_ms(200);
  cr_assert_eq(job_count_becomes(1), 1);
  r1 = test_connect(&d, "fin2", 1, 2);
  r0 = test_connect(&d, "fin2", 0, 2);
  cr_assert_eq(shardd_finish(r1), SHARDD_OK);
  cr_assert_eq(shardd_finish(r0), SHARDD_OK);
  cr_assert_eq(job_count_becomes(0), 0, "every rank finished: released");
}

/* A job whose rank died (its connection closed without a Goodbye) lingers,
 * and the relaunch is told it resumes it and at which step. */
Test(server, died_job_lingers_and_the_relaunch_is_told_it_resumes,
     .init = start_long_linger, .fini = stop_daemon) {
  shardd_close(trained("died", 3));
  test_sleep_ms(200);
  cr_assert_eq(job_count_becomes(1), 1, "the job of a rank that died went");
  shardd_client_t *c = test_connect(&d, "died", 0, 1);
  uint64_t step = 0;
  cr_assert_eq(shardd_resumed(c, &step), 1, "the relaunch is not told it resumes");
  cr_assert_eq(step, 3);
  shardd_buffer_info b;
  cr_assert_eq(shardd_buffer_register(c, "p", SHARDD_DTYPE_FP32, 8, &b), SHARDD_OK);
  cr_assert_eq(b.created, 0);
  cr_assert_eq(b.existing, 1);
  cr_assert_eq(((float *)b.shard)[0], 1.0f - 3 * 0.5f);
  cr_assert_eq(shardd_finish(c), SHARDD_OK);
  cr_assert_eq(job_count_becomes(0), 0);
}

/* A client that pipelines collectives nobody else joins is held to the
 * per-session limit (64): the rest are refused at once with E_LIMIT
 * instead of queueing without bound. */
Test(server, pipelined_collectives_are_bounded, .init = start_default, .fini = stop_daemon) {
  test_raw r;
  test_raw_open(&d, &r);
  test_raw_hello(&r, "bounded", 0, 2); /* rank 1 never comes */
  shardd_buffer_info b;
  test_raw_register_buffer(&r, "p", SHARDD_DTYPE_FP32, 16, &b);
  uint64_t seqs[80];
  for (int i = 0; i < 80; i++)
    seqs[i] = test_raw_send_scatter(&r, b.id, SHARDD_REDUCE_SUM);
  /* The 16 over the limit are answered now; the 64 queued ones are not. */
  for (int i = 64; i < 80; i++) {
    Shardwire__Response *resp = test_raw_recv(&r);
    cr_assert_not_null(resp);
    cr_assert_eq(resp->seq, seqs[i]);
    cr_assert_eq(resp->code, SHARDWIRE__STATUS_CODE__E_LIMIT, "%s",
                 resp->message ? resp->message : "");
    cr_assert(strstr(resp->message, "(--max-pending 64)") != NULL, "%s", resp->message);
    shardwire__response__free_unpacked(resp, NULL);
  }
  tj *st = shardctl_status();
  const tj *jobs = tj_need(st, "jobs", TJ_ARR);
  cr_assert_eq(jobs->n, 1);
  cr_assert_eq(tj_need(jobs->kids[0], "collectives_in_flight", TJ_NUM)->num, 64);
  tj_free(st);
  test_raw_close(&r);
}

/* A Hello refused after it created its job leaves nothing behind: the
 * empty job is released like one whose clients left. */
Test(server, refused_hello_leaves_no_job, .init = start_linger0, .fini = stop_daemon) {
  shardd_connect_opts o = SHARDD_CONNECT_OPTS_INIT;
  o.job = "never";
  o.rank = 5;
  o.world = 2;
  shardd_client_t *c = NULL;
  char err[256];
  cr_assert_eq(shardd_connect(d.sock, &o, &c, err, sizeof err), SHARDD_E_RANGE, "%s", err);
  cr_assert_eq(job_count(), 0);
}

/* New job names are capped (--max-jobs): lingering jobs count, so a client
 * reconnecting under fresh names cannot grow the daemon without bound. */
static void start_max_jobs(void) {
  const char *args[] = {"--max-jobs", "3", NULL};
  test_daemon_start(&d, args);
}

Test(server, job_count_is_capped, .init = start_max_jobs, .fini = stop_daemon) {
  char err[256];
  for (int i = 0; i < 3; i++) {
    char job[16];
    snprintf(job, sizeof job, "j%d", i);
    shardd_client_t *c = test_connect(&d, job, 0, 1);
    shardd_close(c); /* the job lingers */
  }
  shardd_connect_opts o = SHARDD_CONNECT_OPTS_INIT;
  o.job = "one-too-many";
  shardd_client_t *c = NULL;
  cr_assert_eq(shardd_connect(d.sock, &o, &c, err, sizeof err), SHARDD_E_LIMIT, "%s", err);
  cr_assert(strstr(err, "--max-jobs") != NULL, "%s", err);
  o.job = "j1"; /* an existing job can still be joined */
  cr_assert_eq(shardd_connect(d.sock, &o, &c, err, sizeof err), SHARDD_OK, "%s", err);
  shardd_close(c);
}

/* ---- size flags ----------------------------------------------------------
 * --device-memory and --job-memory-limit take sizes like 8G. A number past
 * 2^64 bytes (1e30, 1e400, inf) was converted to uint64_t anyway, which is
 * undefined behaviour (x86 gives 2^63; the daemon then ran with whatever
 * it got). It must exit 2 at once, naming the flag, the value and why. */

typedef struct {
  char flag[32];
  char value[24];
  char why[24];
} bad_size;

ParameterizedTestParameters(server, size_flag_refused) {
  static bad_size cases[] = {
      {"--device-memory", "1e30", "out of range"},
      {"--job-memory-limit", "1e30", "out of range"},
      {"--job-memory-limit", "1e400", "out of range"},
      {"--device-memory", "16777216T", "out of range"}, /* 2^64 exactly */
      {"--job-memory-limit", "18446744073709551616", "out of range"},
      {"--device-memory", "inf", "out of range"},
      {"--job-memory-limit", "nan", "not a size"},
      {"--job-memory-limit", "-1", "not a size"},
      {"--device-memory", "8X", "not a size"},
      {"--device-memory", "0", "at least 1 byte"},
      {"--job-memory-limit", "0.5", "at least 1 byte"},
      /* not sizes, refused the same way: a grace that is no duration */
      {"--peer-grace", "-1", "must be 0..86400"},
      {"--peer-grace", "nan", "must be 0..86400"},
      {"--peer-grace", "1e9", "must be 0..86400"},
      /* the bounds on unread replies */
      {"--max-reply-bytes", "0", "at least 1 byte"},
      {"--max-reply-bytes-per-uid", "1e30", "out of range"},
      {"--max-reply-fds", "0", "must be 1..1000000"},
      {"--max-reply-fds-per-uid", "-3", "must be 1..1000000"},
  };
  return cr_make_param_array(bad_size, cases, sizeof cases / sizeof cases[0]);
}

ParameterizedTest(bad_size *bs, server, size_flag_refused) {
  char dir[] = "/tmp/shardd-size-XXXXXX";
  cr_assert_not_null(mkdtemp(dir));
  char sock[64], log[64];
  snprintf(sock, sizeof sock, "%s/s.sock", dir);
  snprintf(log, sizeof log, "%s/err", dir);
  pid_t pid = fork();
  cr_assert(pid >= 0);
  if (pid == 0) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (freopen(log, "w", stderr) == NULL)
      _exit(126);
    execl(test_bin("SHARDD_BIN", "build/shardd"), "shardd", "--socket", sock,
          bs->flag, bs->value, (char *)NULL);
    _exit(127);
  }
  /* Until it exits or serves (then it took the size); the deadline only
   * guards against a daemon that does neither. */
  int st = 0, done = 0, serves = 0;
  for (double end = test_mono_s() + TEST_HANG_S; !done && !serves;) {
    done = waitpid(pid, &st, WNOHANG) == pid;
    if (!done)
      serves = test_can_connect(sock);
    if (!done && !serves) {
      if (test_mono_s() > end)
        break;
      test_sleep_ms(10);
    }
  }
  if (!done) {
    kill(pid, SIGKILL);
    waitpid(pid, &st, 0);
  }
  char *text = test_slurp(log);
  unlink(log);
  unlink(sock);
  rmdir(dir);
  cr_assert(!serves, "shardd %s %s accepted the size: it serves on its socket",
            bs->flag, bs->value);
  cr_assert(done, "shardd %s %s neither exited nor served within %.0f s", bs->flag,
            bs->value, TEST_HANG_S);
  cr_assert(WIFEXITED(st), "shardd %s %s died of signal %d", bs->flag, bs->value,
            WIFSIGNALED(st) ? WTERMSIG(st) : 0);
  cr_assert_eq(WEXITSTATUS(st), 2, "shardd %s %s exited %d: %s", bs->flag,
               bs->value, WEXITSTATUS(st), text);
  char want[64];
  snprintf(want, sizeof want, "%s %s: ", bs->flag, bs->value);
  cr_assert(strstr(text, want) != NULL, "stderr does not name \"%s\": %s", want, text);
  cr_assert(strstr(text, bs->why) != NULL, "stderr does not say \"%s\": %s", bs->why,
            text);
  free(text);
}

/* The largest sizes below 2^64 are still sizes. */
static void start_huge_limit(void) {
  const char *args[] = {"--job-memory-limit", "16777215T", NULL};
  test_daemon_start(&d, args);
}

Test(server, size_flag_just_below_two_to_the_64_is_taken, .init = start_huge_limit,
     .fini = stop_daemon) {
  shardd_client_t *c = test_connect(&d, "big", 0, 1);
  shardd_buffer_info b;
  cr_assert_eq(shardd_buffer_register(c, "w", SHARDD_DTYPE_FP32, 1024, &b), SHARDD_OK,
               "%s", shardd_last_error(c));
  shardd_close(c);
}

/* ---- status of many jobs of huge worlds ---------------------------------
 * One status listed every rank of every job: 512 jobs of world 65536 froze
 * the daemon for a minute and took it to 13.5 GB, for a reply past the
 * frame limit. A status now lists at most 256 jobs (jobs_more counts the
 * rest; first_job pages on) and 64 ranks of each kind per job (the _more
 * fields count the rest), so its cost follows what it shows. */

#define HUGE_WORLD 65536
#define HUGE_JOBS 40
#define SMALL_JOBS 230 /* with the huge ones, past the 256 of one status */

Test(server, status_of_many_huge_jobs_is_summarized_and_paged, .timeout = 120) {
  test_daemon_start(&d, (const char *const[]){"--devices", "1", NULL});
  for (int i = 0; i < HUGE_JOBS + SMALL_JOBS; i++) {
    char name[32];
    /* "a-" sorts the huge jobs first, into the first page */
    snprintf(name, sizeof name, i < HUGE_JOBS ? "a-huge-%03d" : "b-small-%03d", i);
    shardd_client_t *c = test_connect(&d, name, 0, i < HUGE_JOBS ? HUGE_WORLD : 1);
    shardd_close(c); /* the job lingers, every rank missing */
  }
  long rss0 = daemon_rss_kib(d.pid);
  shardd_client_t *c = test_connect(&d, NULL, 0, 1);
  char *s = NULL;
  double t0 = test_mono_s();
  cr_assert_eq(shardd_status_json(c, &s), SHARDD_OK, "%s", shardd_last_error(c));
  double took = test_mono_s() - t0;
  long grew = daemon_rss_kib(d.pid) - rss0;
  cr_assert_lt(took, 2.0 * SLOWDOWN, "one status took %.2f s", took);
  cr_assert_lt(grew, 64L << 10, "one status grew the daemon by %ld KiB", grew);
  cr_assert_lt(strlen(s), (size_t)4 << 20, "status is %zu bytes", strlen(s));
  tj *j = tj_parse(s);
  cr_assert_not_null(j);
  const tj *jobs = tj_need(j, "jobs", TJ_ARR);
  cr_assert_eq(jobs->n, 256u);
  cr_assert_eq(tj_need(j, "jobs_more", TJ_NUM)->num,
               (double)(HUGE_JOBS + SMALL_JOBS - 256));
  for (size_t i = 0; i < HUGE_JOBS; i++) {
    const tj *job = jobs->kids[i];
    cr_assert_eq(tj_need(job, "world", TJ_NUM)->num, (double)HUGE_WORLD);
    size_t listed = tj_need(job, "missing_ranks", TJ_ARR)->n;
    cr_assert_leq(listed, 64u);
    cr_assert_eq(tj_need(job, "connected_ranks", TJ_ARR)->n, 0u);
    cr_assert_eq(listed + tj_need(job, "missing_ranks_more", TJ_NUM)->num,
                 (double)HUGE_WORLD, "the ranks not listed are not counted");
    cr_assert_eq(tj_get(job, "connected_ranks_more"), NULL);
  }
  tj_free(j);
  shardd_free(s);

  /* the next page: the rest, and nothing after it */
  cr_assert_eq(shardd_status_json_from(c, 256, &s), SHARDD_OK, "%s",
               shardd_last_error(c));
  j = tj_parse(s);
  cr_assert_not_null(j);
  jobs = tj_need(j, "jobs", TJ_ARR);
  cr_assert_eq(jobs->n, (size_t)(HUGE_JOBS + SMALL_JOBS - 256));
  cr_assert_eq(tj_need(j, "first_job", TJ_NUM)->num, 256.0);
  cr_assert_eq(tj_get(j, "jobs_more"), NULL);
  cr_assert_str_eq(tj_need(jobs->kids[jobs->n - 1], "name", TJ_STR)->str,
                   "b-small-269");
  tj_free(j);
  shardd_free(s);
  char args[256], *out, *err;
  snprintf(args, sizeof args, "--socket %s status --from 266 --json", d.sock);
  cr_assert_eq(test_shardctl(NULL, args, &out, &err), 0, "%s", err);
  j = tj_parse(out);
  cr_assert_not_null(j, "%s", out);
  cr_assert_eq(tj_need(j, "jobs", TJ_ARR)->n, 4u);
  tj_free(j);
  free(out);
  free(err);

  /* text says what it left out, and how to see it */
  cr_assert_eq(shardd_status_text(c, &s), SHARDD_OK);
  cr_assert(strstr(s, "(and 65472 more)") != NULL, "%.400s", s);
  cr_assert(strstr(s, "and 14 more jobs: shardctl status --from 256") != NULL);
  shardd_free(s);
  shardd_close(c);
  test_daemon_finish(&d);
}

/* CPU seconds the process has used (utime + stime). */
static double process_cpu_s(pid_t pid) {
  char path[64], buf[1024];
  snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
  FILE *f = fopen(path, "r");
  cr_assert_not_null(f, "%s: %s", path, strerror(errno));
  size_t n = fread(buf, 1, sizeof buf - 1, f);
  fclose(f);
  buf[n] = '\0';
  unsigned long ut = 0, st = 0;
  const char *p = strrchr(buf, ')'); /* the name may hold spaces */
  cr_assert(p && sscanf(p + 2, "%*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %lu %lu",
                        &ut, &st) == 2, "%s", buf);
  return (double)(ut + st) / (double)sysconf(_SC_CLK_TCK);
}

/* Ten statuses in a row (*s the last reply, freed before each) use less
 * than 0.3 s of the daemon's CPU: the steady cost, not the client's
 * decoding nor a busy machine's. */
static void expect_10_statuses_are_quick(shardd_client_t *c, char **s) {
  double cpu0 = process_cpu_s(d.pid);
  for (int pass = 0; pass < 10; pass++) {
    shardd_free(*s);
    *s = NULL;
    cr_assert_eq(shardd_status_json(c, s), SHARDD_OK, "%s", shardd_last_error(c));
  }
  double used = process_cpu_s(d.pid) - cpu0;
  cr_assert_lt(used, 0.3 * SLOWDOWN, "10 statuses used %.2f s of the daemon's CPU", used);
}

/* A collective's waiters are as many as its job's world, and walks over
 * all of them read every page of them: 32 jobs of world 65536, each with
 * 32 barriers its one rank left waiting (one uid, well inside its limits),
 * took one status 12-22 s of the loop the first time (5 MB of waiters
 * never touched, per collective) and 1.1 s each time after, and their
 * rank's close as long again. The walks now read the ranks that
 * arrived. Status still cleared and walked a world-sized map of arrivals
 * per collective: 0.13 s each time after the first; it now lists the
 * lowest ranks that arrived and the first that did not, at their cost. */
#define WIDE_JOBS 32
#define WIDE_BARRIERS 32

/* The last rank of job (world HUGE_WORLD) on a new raw client r, left
 * waiting in WIDE_BARRIERS barriers (a walk for the arrived ranks goes the
 * whole world); they are queued when it returns. */
static void last_rank_waits_in_barriers(test_raw *r, const char *job) {
  test_raw_open(&d, r);
  test_raw_hello(r, job, HUGE_WORLD - 1, HUGE_WORLD);
  for (int i = 0; i < WIDE_BARRIERS; i++) {
    Shardwire__Request req = SHARDWIRE__REQUEST__INIT;
    Shardwire__AllReduce ar = SHARDWIRE__ALL_REDUCE__INIT;
    req.body_case = SHARDWIRE__REQUEST__BODY_ALL_REDUCE;
    req.all_reduce = &ar;
    test_raw_send(r, &req);
  }
  test_raw_sync(r);
}

/* Every one of status's WIDE_JOBS jobs still waits in its barriers. */
static void expect_every_barrier_waits(const tj *jobs) {
  cr_assert_eq(jobs->n, (size_t)WIDE_JOBS);
  for (size_t i = 0; i < jobs->n; i++)
    cr_assert_eq(tj_need(jobs->kids[i], "collectives_in_flight", TJ_NUM)->num,
                 (double)WIDE_BARRIERS);
}

Test(server, status_of_many_wide_collectives_is_quick, .timeout = 120) {
  test_daemon_start(&d, (const char *const[]){"--collective-timeout", "600", NULL});
  static test_raw r[WIDE_JOBS];
  for (int k = 0; k < WIDE_JOBS; k++) {
    char name[32];
    snprintf(name, sizeof name, "wide-%02d", k);
    last_rank_waits_in_barriers(&r[k], name);
  }
  shardd_client_t *c = test_connect(&d, NULL, 0, 1);
  char *s = NULL;
  /* the first reads every described collective's arrays for the first
   * time (pages never touched); the next 10 are the steady cost, as the
   * daemon's CPU time (the client's decoding and a busy machine are not
   * the daemon's loop) */
  double first = test_mono_s();
  cr_assert_eq(shardd_status_json(c, &s), SHARDD_OK, "%s", shardd_last_error(c));
  first = test_mono_s() - first;
  cr_assert_lt(first, 5.0 * SLOWDOWN, "the first status took %.2f s", first);
  expect_10_statuses_are_quick(c, &s);
  tj *j = tj_parse(s);
  cr_assert_not_null(j);
  const tj *jobs = tj_need(j, "jobs", TJ_ARR);
  cr_assert_eq(jobs->n, (size_t)WIDE_JOBS);
  /* described with the one rank that arrived; every job counts its own */
  const tj *colls = tj_need(jobs->kids[0], "collectives", TJ_ARR);
  cr_assert_gt(colls->n, 0u);
  const tj *arrived = tj_need(colls->kids[0], "arrived", TJ_ARR);
  cr_assert_eq(arrived->n, 1u);
  cr_assert_eq(arrived->kids[0]->num, (double)(HUGE_WORLD - 1));
  cr_assert_null(tj_get(colls->kids[0], "arrived_more"));
  /* and waits for the first 64 others, the rest counted */
  const tj *waiting = tj_need(colls->kids[0], "waiting_for", TJ_ARR);
  cr_assert_eq(waiting->n, 64u);
  for (size_t m = 0; m < waiting->n; m++)
    cr_assert_eq(waiting->kids[m]->num, (double)m);
  cr_assert_eq(tj_need(colls->kids[0], "waiting_for_more", TJ_NUM)->num,
               (double)(HUGE_WORLD - 1 - 64));
  expect_every_barrier_waits(jobs);
  tj_free(j);
  shardd_free(s);
  /* their ranks close: every barrier fails and is freed, and the daemon
   * answers a ping behind that at once: within 2 s of its CPU (measured
   * 0.7 s; the walk over every world this bounds held the loop 9-22 s;
   * wall time on a loaded machine took 1.06 s once, preempted) */
  double cpu0 = process_cpu_s(d.pid), t0 = test_mono_s();
  for (int k = 0; k < WIDE_JOBS; k++)
    test_raw_close(&r[k]);
  cr_assert_eq(shardd_ping(c), SHARDD_OK);
  double used = process_cpu_s(d.pid) - cpu0, wall = test_mono_s() - t0;
  cr_log_info("the closes and a ping behind them: %.2f s of the daemon's CPU, "
              "%.2f s wall", used, wall);
  /* (under ASan, freeing the 1,024 world-sized waiter arrays poisons
   * about 640 MB of shadow memory: seconds that measure ASan, not the daemon) */
  if (!SANITIZED)
    cr_assert_lt(used, 2.0, "the closes and a ping behind them used %.2f s of "
                 "the daemon's CPU (%.2f s wall)", used, wall);
  cr_assert_lt(wall, TEST_HANG_S, "a ping behind the closes took %.2f s", wall);
  shardd_close(c);
  test_daemon_finish(&d);
}

/* A collective keeps 85 bytes per rank of its job's world (its waiters),
 * whatever ranks this node holds: one Hello may declare a world of 65536,
 * so each all_reduce its rank 0 queued cost 5.5 MiB, zeroed on the loop
 * (35 ms each here), and one uid's 256 connections 64 each (--max-pending):
 * 90 GB. Measured: 4 such jobs' 256 all_reduces grew the daemon by 1.4
 * GiB while another client's pings waited up to 250 ms. Such blocks are
 * now mapped fresh, so they cost the pages of the ranks that arrive. */
/* under the sanitizers such blocks are allocated and zeroed as before
 * (coll_int.h: AddressSanitizer sees allocations only): one job's, and no
 * bound on the growth */
#define WIDE_CONNS (SANITIZED ? 1 : 4)

static int wide_all_reduces(const char *sock) {
  if (geteuid() == 0 && (setgid(4242) != 0 || setuid(4242) != 0))
    return 10;
  for (int k = 0; k < WIDE_CONNS; k++) {
    int fd = raw_connect(sock);
    if (fd < 0)
      return 11;
    char job[32];
    snprintf(job, sizeof job, "wide-ar-%d", k);
    Shardwire__Request req = SHARDWIRE__REQUEST__INIT;
    Shardwire__Hello h = SHARDWIRE__HELLO__INIT;
    h.protocol_version = SHARDD_PROTOCOL_VERSION;
    h.job = job;
    h.has_world = 1;
    h.world = HUGE_WORLD;
    h.has_rank = 1;
    h.rank = 0;
    req.seq = 1;
    req.body_case = SHARDWIRE__REQUEST__BODY_HELLO;
    req.hello = &h;
    uint8_t buf[256];
    size_t n = shardwire__request__pack(&req, buf);
    if (shardd__frame_send(fd, buf, n, NULL, 0) != SHARDD_OK)
      return 12;
    for (int i = 0; i < 64; i++) { /* --max-pending: every one queued */
      Shardwire__Request q = SHARDWIRE__REQUEST__INIT;
      Shardwire__AllReduce ar = SHARDWIRE__ALL_REDUCE__INIT;
      q.seq = 2 + (uint64_t)i;
      q.body_case = SHARDWIRE__REQUEST__BODY_ALL_REDUCE;
      q.all_reduce = &ar;
      n = shardwire__request__pack(&q, buf);
      if (shardd__frame_send(fd, buf, n, NULL, 0) != SHARDD_OK)
        return 13;
    }
    /* left open: the test's end (its exit) closes them */
  }
  return 0;
}

/* The collectives in flight over every job Status lists. */
static double status_collectives(void) {
  tj *st = shardctl_status();
  const tj *jobs = tj_need(st, "jobs", TJ_ARR);
  double n = 0;
  for (size_t i = 0; i < jobs->n; i++)
    n += tj_need(jobs->kids[i], "collectives_in_flight", TJ_NUM)->num;
  tj_free(st);
  return n;
}

Test(server, collectives_of_a_huge_world_cost_the_ranks_that_arrive,
     .timeout = 120) {
  test_daemon_start(&d, NULL);
  test_daemon_open_to_all(&d);
  shardd_client_t *c = test_connect(&d, NULL, 0, 1);
  long rss0 = daemon_rss_kib(d.pid);
  int ready[2], go[2];
  pid_t pid = test_fork_with_pipes(ready, go);
  if (pid == 0) {
    int rc = wide_all_reduces(d.sock);
    unsigned char b = (unsigned char)rc;
    if (write(ready[1], &b, 1) != 1 || read(go[0], &b, 1) != 1)
      _exit(20);
    _exit(rc);
  }
  /* another client pings while they are queued */
  double worst = 0, queued = 0;
  for (double end = test_mono_s() + 60;
       (queued = status_collectives()) < WIDE_CONNS * 64 && test_mono_s() < end;) {
    double t = test_mono_s();
    cr_assert_eq(shardd_ping(c), SHARDD_OK);
    t = test_mono_s() - t;
    worst = t > worst ? t : worst;
    test_sleep_ms(20);
  }
  long grew = daemon_rss_kib(d.pid) - rss0;
  cr_log_info("%.0f all_reduces of %d jobs of world %d queued: the daemon "
              "grew by %ld MiB, another client's slowest ping %.1f ms",
              queued, WIDE_CONNS, HUGE_WORLD, grew >> 10, worst * 1e3);
  cr_assert_eq(queued, (double)(WIDE_CONNS * 64));
  if (!SANITIZED)
    cr_assert_lt(grew, 64L << 10, "%d collectives of a world of %d grew the "
                 "daemon by %ld MiB", WIDE_CONNS * 64, HUGE_WORLD, grew >> 10);
  cr_assert_lt(worst, 0.5 * SLOWDOWN, "another client's ping waited %.0f ms",
               worst * 1e3);
  unsigned char b;
  cr_assert_eq(read(ready[0], &b, 1), 1);
  cr_assert_eq(b, 0, "the wide jobs' client failed at step %d", b);
  cr_assert_eq(write(go[1], "g", 1), 1);
  test_expect_child_ok(pid, "wide jobs' client");
  close(ready[0]);
  close(go[1]);
  shardd_close(c);
  test_daemon_finish(&d);
}

/* An operator's checkpoint that timed out told what its job waited on
 * from a world-sized map of arrivals per collective (cleared and walked
 * twice): 1024 of them of a job of world 65536 used 0.22 s of the
 * daemon's CPU, and the message was cut off inside its first collective.
 * It now lists the first few ranks of each as status does, the rest
 * counted, at their cost (0.02 s). Root's sessions (no bound per uid), 16
 * each, the bound per session. */
#define PEND_SESSIONS 64
#define PEND_EACH 16

Test(server, timed_out_checkpoints_of_a_wide_job_are_quick, .timeout = 120) {
  if (geteuid() != 0)
    cr_skip_test("needs root: another uid's waiting checkpoints stop at 64");
  test_daemon_start(&d, (const char *const[]){"--collective-timeout", "600", NULL});
  test_raw job;
  last_rank_waits_in_barriers(&job, "wide");
  char ck[256];
  snprintf(ck, sizeof ck, "%s/ck", d.dir);
  static test_raw s[PEND_SESSIONS];
  /* long enough for every one to be asked before the first times out */
  for (int k = 0; k < PEND_SESSIONS; k++) {
    test_raw_open(&d, &s[k]);
    test_raw_hello(&s[k], NULL, 0, 0);
    for (int i = 0; i < PEND_EACH; i++)
      test_raw_send_checkpoint_wait(&s[k], "wide", ck, 2.0);
    test_raw_sync(&s[k]);
  }
  double cpu0 = process_cpu_s(d.pid);
  /* (a session's time out together, answered in no particular order) */
  for (int k = 0; k < PEND_SESSIONS; k++)
    for (int i = 0; i < PEND_EACH; i++) {
      Shardwire__Response *resp = test_raw_recv(&s[k]);
      cr_assert_not_null(resp);
      const char *m = resp->message ? resp->message : "";
      cr_assert_eq(resp->code, SHARDWIRE__STATUS_CODE__E_TIMEOUT, "%s", m);
      if (k == 0 && i == 0) {
        /* the rank that arrived, the first 8 waiting, the rest counted,
         * for four collectives, and the message whole */
        cr_expect(strstr(m, "arrived: rank 65535, waiting for: rank 0 (not "
                         "connected), rank 1 (not connected)"), "%s", m);
        cr_expect(strstr(m, "rank 7 (not connected) and 65527 more; "), "%s", m);
        cr_expect(strstr(m, "; and 28 more ("), "%s", m);
        cr_expect(strstr(m, "checkpoints with sm.checkpoint)"), "%s", m);
      }
      shardwire__response__free_unpacked(resp, NULL);
    }
  double used = process_cpu_s(d.pid) - cpu0;
  cr_log_info("%d timed-out checkpoints: %.2f s of the daemon's CPU",
              PEND_SESSIONS * PEND_EACH, used);
  cr_assert_lt(used, 0.1 * SLOWDOWN, "%d timed-out checkpoints used %.2f s of "
               "the daemon's CPU", PEND_SESSIONS * PEND_EACH, used);
  for (int k = 0; k < PEND_SESSIONS; k++)
    test_raw_close(&s[k]);
  test_raw_close(&job);
  test_daemon_finish(&d);
}

/* Status found each job's connected ranks by walking its world until it
 * had seen them all: a job whose one connected rank is its last walked
 * every claim of its 65536, 0.12 s of the loop for 250 such jobs, every
 * status. It reads the ranks held and as many others as it lists. */
#define HELD_LAST_JOBS 250

Test(server, status_of_wide_jobs_holding_their_last_rank_is_quick, .timeout = 120) {
  test_daemon_start(&d, NULL);
  static test_raw r[HELD_LAST_JOBS];
  for (int k = 0; k < HELD_LAST_JOBS; k++) {
    char name[32];
    snprintf(name, sizeof name, "last-%03d", k);
    test_raw_open(&d, &r[k]);
    test_raw_hello(&r[k], name, HUGE_WORLD - 1, HUGE_WORLD);
  }
  shardd_client_t *c = test_connect(&d, NULL, 0, 1);
  char *s = NULL;
  /* the daemon's CPU time (not the client's decoding, nor a busy machine) */
  expect_10_statuses_are_quick(c, &s);
  /* what it lists is as before: the held rank, the first 64 others */
  tj *j = tj_parse(s);
  cr_assert_not_null(j);
  const tj *jobs = tj_need(j, "jobs", TJ_ARR);
  cr_assert_eq(jobs->n, (size_t)HELD_LAST_JOBS);
  for (size_t i = 0; i < jobs->n; i++) {
    const tj *held = tj_need(jobs->kids[i], "connected_ranks", TJ_ARR);
    cr_assert_eq(held->n, 1u);
    cr_assert_eq(held->kids[0]->num, (double)(HUGE_WORLD - 1));
    const tj *missing = tj_need(jobs->kids[i], "missing_ranks", TJ_ARR);
    cr_assert_eq(missing->n, 64u);
    for (size_t m = 0; m < missing->n; m++)
      cr_assert_eq(missing->kids[m]->num, (double)m);
    cr_assert_eq(tj_need(jobs->kids[i], "missing_ranks_more", TJ_NUM)->num,
                 (double)(HUGE_WORLD - 1 - 64));
  }
  tj_free(j);
  shardd_free(s);
  shardd_close(c);
  for (int k = 0; k < HELD_LAST_JOBS; k++)
    test_raw_close(&r[k]);
  test_daemon_finish(&d);
}

/* Whether the daemon has seen rank 0 of job leave (status gives it a
 * missing_for_s, -1 for a rank never there). */
static int rank0_lost(shardd_client_t *c, const char *job) {
  char *s = NULL;
  cr_assert_eq(shardd_status_json(c, &s), SHARDD_OK, "%s", shardd_last_error(c));
  tj *j = tj_parse(s);
  cr_assert_not_null(j);
  const tj *jobs = tj_need(j, "jobs", TJ_ARR);
  int lost = 0;
  for (size_t i = 0; i < jobs->n; i++)
    if (strcmp(tj_need(jobs->kids[i], "name", TJ_STR)->str, job) == 0)
      lost = tj_need(jobs->kids[i], "missing_for_s", TJ_ARR)->kids[0]->num >= 0;
  tj_free(j);
  shardd_free(s);
  return lost;
}

/* The tick's doom check (a rank lost past --peer-grace fails the
 * collectives its peers wait in) walked every rank of the job for each
 * waiting collective, ten times a second: 32 jobs of world 65536, each
 * with one rank lost and 32 barriers of a rank that joined after it (so
 * not doomed), kept an idle daemon's loop 20% busy, and a uid's 256
 * connections could have kept it busy for good. It walks the lost ranks. */
Test(server, waiting_wide_jobs_with_a_lost_rank_leave_the_loop_idle,
     .timeout = 120 * SLOWDOWN) {
  test_daemon_start(&d, (const char *const[]){"--collective-timeout", "600",
                                              "--peer-grace", "0.5", NULL});
  shardd_client_t *c = test_connect(&d, NULL, 0, 1);
  static test_raw r[WIDE_JOBS];
  for (int k = 0; k < WIDE_JOBS; k++) {
    char name[32];
    snprintf(name, sizeof name, "lost-%02d", k);
    test_raw lost;
    test_raw_open(&d, &lost);
    test_raw_hello(&lost, name, 0, HUGE_WORLD);
    test_raw_close(&lost);
    /* lost before the rank that waits joins: its barriers are not doomed */
    /* a status lists every wide job so far: polled a few ms apart, not
     * back to back (under the sanitizers and a loaded machine the polls
     * alone took the test past its timeout) */
    for (double end = test_mono_s() + TEST_HANG_S; !rank0_lost(c, name);) {
      cr_assert_lt(test_mono_s(), end, "rank 0 of %s never left", name);
      test_sleep_ms(5);
    }
    last_rank_waits_in_barriers(&r[k], name);
  }
  test_sleep_ms(1000); /* past the grace: every tick checks them now */
  double cpu0 = process_cpu_s(d.pid);
  test_sleep_ms(3000);
  double used = process_cpu_s(d.pid) - cpu0;
  cr_assert_lt(used, 0.25 * SLOWDOWN, "an idle daemon used %.2f s of CPU in 3 s", used);
  /* nothing was doomed: every barrier still waits */
  tj *st = shardctl_status();
  expect_every_barrier_waits(tj_need(st, "jobs", TJ_ARR));
  tj_free(st);
  shardd_close(c);
  for (int k = 0; k < WIDE_JOBS; k++)
    test_raw_close(&r[k]);
  test_daemon_finish(&d);
}

/* Inspect of a buffer of a wide job lists 64 shards and counts the rest;
 * its resident bytes still count every block. */
Test(server, inspect_of_a_wide_buffer_lists_64_shards, .timeout = 60) {
  test_daemon_start(&d, (const char *const[]){"--devices", "1", NULL});
  shardd_client_t *c = test_connect(&d, "wide", 0, 100);
  shardd_buffer_info b;
  cr_assert_eq(shardd_buffer_register(c, "w", SHARDD_DTYPE_FP32, 1000, &b),
               SHARDD_OK, "%s", shardd_last_error(c));
  char *s = NULL;
  cr_assert_eq(shardd_inspect_json(c, b.id, NULL, &s), SHARDD_OK, "%s",
               shardd_last_error(c));
  tj *j = tj_parse(s);
  cr_assert_not_null(j, "%s", s);
  const tj *shards = tj_need(j, "shards", TJ_ARR);
  cr_assert_eq(shards->n, 64u);
  cr_assert_eq(tj_need(j, "shards_more", TJ_NUM)->num, 36.0);
  cr_assert_eq(tj_need(shards->kids[63], "rank", TJ_NUM)->num, 63.0);
  /* every rank's block, listed or not, is resident */
  cr_assert_geq(tj_need(j, "resident_bytes", TJ_NUM)->num, 100.0 * 4096);
  tj_free(j);
  shardd_free(s);
  cr_assert_eq(shardd_inspect_text(c, b.id, NULL, &s), SHARDD_OK);
  cr_assert(strstr(s, "and 36 more shards") != NULL, "%s", s);
  shardd_free(s);
  shardd_close(c);
  test_daemon_finish(&d);
}

/* Inspect of a wide buffer under an optimizer walked every optimizer
 * shard of the job for each rank: world 16384 made one inspect hold the
 * loop for half a second, and a uid's connections pipelining them held
 * every other client that long per request. It is one pass now. */
Test(server, inspect_of_a_wide_buffer_under_an_optimizer_is_quick, .timeout = 120) {
  /* as wide as the daemon's descriptors allow it (each rank block is one;
   * it keeps 1160 for the default --max-clients), up to 16384 */
  struct rlimit nofile;
  cr_assert_eq(getrlimit(RLIMIT_NOFILE, &nofile), 0);
  uint64_t world = 16384;
  if (nofile.rlim_max != RLIM_INFINITY && nofile.rlim_max < world + 1400)
    world = nofile.rlim_max > 1400 ? nofile.rlim_max - 1400 : 0;
  if (world < 12000)
    cr_skip_test("the descriptor limit (%ju) allows no job wide enough",
                 (uintmax_t)nofile.rlim_max);
  test_daemon_start(&d, (const char *const[]){"--devices", "1", NULL});
  shardd_client_t *c = test_connect(&d, "wide", 0, (uint32_t)world);
  shardd_buffer_info b;
  cr_assert_eq(shardd_buffer_register(c, "w", SHARDD_DTYPE_FP32, world, &b),
               SHARDD_OK, "%s", shardd_last_error(c));
  shardd_param_ref ref = {b.id, "w"};
  shardd_param_group g = {&ref, 1, {0}};
  shardd_hparams hp = {.set = SHARDD_HP_LR, .lr = 0.1};
  uint64_t opt;
  cr_assert_eq(shardd_optimizer_register(c, "adam", SHARDD_OPTIM_ADAM, &hp, &g, 1,
                                         &opt),
               SHARDD_OK, "%s", shardd_last_error(c));
  char *s = NULL;
  double t0 = test_mono_s();
  cr_assert_eq(shardd_inspect_json(c, b.id, NULL, &s), SHARDD_OK, "%s",
               shardd_last_error(c));
  double took = test_mono_s() - t0;
  cr_assert_lt(took, 0.1 * SLOWDOWN, "one inspect of world %ju took %.3f s",
               (uintmax_t)world, took);
  tj *j = tj_parse(s);
  cr_assert_not_null(j, "%s", s);
  /* each shard's bytes still count its block and its state */
  const tj *shards = tj_need(j, "shards", TJ_ARR);
  double bytes = tj_need(shards->kids[0], "bytes", TJ_NUM)->num;
  cr_assert_gt(bytes, 4096.0, "shard 0 holds %.0f bytes: no state counted", bytes);
  cr_assert_geq(tj_need(j, "resident_bytes", TJ_NUM)->num, bytes * (double)world);
  tj_free(j);
  shardd_free(s);
  shardd_close(c);
  test_daemon_finish(&d);
}

/* ---- memory of a freed region --------------------------------------------
 * A client that kept its mapping of a block after unregistering the
 * buffer kept the block's pages alive while the daemon counted them free,
 * so --uid-memory-limit never applied: register, touch, unregister, again,
 * until the daemon was OOM-killed. The daemon now takes a freed region's
 * pages back from every mapping. */

#define KEPT_NUMEL ((uint64_t)16 << 20) /* 64 MiB of fp32 */

/* Resident shared memory of this process, KiB (RssShmem). */
static long self_rss_shmem_kib(void) {
  FILE *f = fopen("/proc/self/status", "r");
  cr_assert_not_null(f);
  char line[256];
  long kib = -1;
  while (fgets(line, sizeof line, f))
    if (sscanf(line, "RssShmem: %ld kB", &kib) == 1)
      break;
  fclose(f);
  cr_assert_geq(kib, 0, "no RssShmem in /proc/self/status");
  return kib;
}

Test(server, a_block_kept_mapped_after_unregister_holds_no_memory,
     .init = start_one_device, .fini = stop_daemon, .timeout = 60) {
  test_raw r;
  test_raw_open(&d, &r);
  test_raw_hello(&r, "kept", 0, 1);
  shardd_buffer_info b;
  test_raw_register_buffer(&r, "big", SHARDD_DTYPE_FP32, KEPT_NUMEL, &b);
  long base = self_rss_shmem_kib();
  memset(b.shard, 0x5a, KEPT_NUMEL * 4);
  long touched = self_rss_shmem_kib();
  cr_assert_geq(touched - base, 60L << 10, "writing the shard made %ld KiB "
                "resident", touched - base);

  Shardwire__Request req = SHARDWIRE__REQUEST__INIT;
  Shardwire__UnregisterBuffer ub = SHARDWIRE__UNREGISTER_BUFFER__INIT;
  ub.id = b.id;
  req.body_case = SHARDWIRE__REQUEST__BODY_UNREGISTER_BUFFER;
  req.unregister_buffer = &ub;
  uint64_t seq = test_raw_send(&r, &req);
  shardwire__response__free_unpacked(test_raw_expect(&r, seq, SHARDD_OK), NULL);
  /* the mapping is still this client's (r.map), its pages are not */
  long kept = self_rss_shmem_kib() - base;
  cr_assert_lt(kept, 4L << 10, "%ld KiB of an unregistered buffer stay "
               "resident in a mapping its client kept", kept);
  cr_assert_eq(((volatile uint8_t *)b.shard)[12345], 0,
               "the kept mapping still reads the buffer's values");
  test_raw_sync(&r);
  test_raw_close(&r);
}

/* Unregistering is the job's, not the asking rank's: rank 0's unregister
 * frees every rank's block, so rank 1's mapping of its gather area reads
 * zeros from then on (the soak test read its last gather after rank 0 had
 * unregistered and saw zeros: a rank must not unregister a buffer other
 * ranks still read). */
Test(server, a_rank_unregistering_a_buffer_zeroes_every_ranks_mapping,
     .init = start_one_device, .fini = stop_daemon, .timeout = 60) {
  test_raw r0, r1;
  test_raw_open(&d, &r0);
  test_raw_hello(&r0, "two", 0, 2);
  test_raw_open(&d, &r1);
  test_raw_hello(&r1, "two", 1, 2);
  shardd_buffer_info b0, b1;
  test_raw_register_buffer(&r0, "w", SHARDD_DTYPE_FP32, 64, &b0);
  test_raw_register_buffer(&r1, "w", SHARDD_DTYPE_FP32, 64, &b1);
  cr_assert_eq(b0.id, b1.id);
  for (uint64_t i = 0; i < b0.shard_numel; i++) {
    ((float *)b0.shard)[i] = 16.0f + (float)i;
    ((float *)b1.shard)[i] = 16.0f + (float)(b1.shard_numel + i);
  }
  uint64_t g0 = test_raw_send_gather(&r0, b0.id);
  uint64_t g1 = test_raw_send_gather(&r1, b1.id);
  shardwire__response__free_unpacked(test_raw_expect(&r0, g0, SHARDD_OK), NULL);
  shardwire__response__free_unpacked(test_raw_expect(&r1, g1, SHARDD_OK), NULL);
  const volatile float *seen = b1.gather;
  for (uint64_t i = 0; i < 64; i++)
    cr_assert_eq(seen[i], 16.0f + (float)i, "rank 1 gathered %g at %llu",
                 (double)seen[i], (unsigned long long)i);

  Shardwire__Request req = SHARDWIRE__REQUEST__INIT;
  Shardwire__UnregisterBuffer ub = SHARDWIRE__UNREGISTER_BUFFER__INIT;
  ub.id = b0.id;
  req.body_case = SHARDWIRE__REQUEST__BODY_UNREGISTER_BUFFER;
  req.unregister_buffer = &ub;
  uint64_t seq = test_raw_send(&r0, &req);
  shardwire__response__free_unpacked(test_raw_expect(&r0, seq, SHARDD_OK), NULL);
  for (uint64_t i = 0; i < 64; i++)
    cr_assert_eq(seen[i], 0.0f, "rank 1's kept mapping still reads %g at %llu "
                 "after rank 0 unregistered the buffer", (double)seen[i],
                 (unsigned long long)i);
  /* and the buffer is gone for rank 1 too */
  g1 = test_raw_send_gather(&r1, b1.id);
  shardwire__response__free_unpacked(test_raw_expect(&r1, g1, SHARDD_E_NOT_FOUND),
                                     NULL);
  test_raw_close(&r0);
  test_raw_close(&r1);
}

/* ---- the frame limit on replies ------------------------------------------ */

/* A reply past the frame limit was built and sent, and the client
 * dropped the connection (status with ~60k optimizers, inspect of a buffer
 * with 200k views). A Ping whose request is exactly the limit has a reply
 * a few bytes over it: refused with E_LIMIT, and the session goes on. */
Test(server, a_reply_past_the_frame_limit_is_refused_not_sent, .timeout = 120) {
  test_daemon_start(&d, NULL);
  test_raw r;
  test_raw_open(&d, &r);
  test_raw_hello(&r, NULL, 0, 1);
  Shardwire__Request req = SHARDWIRE__REQUEST__INIT;
  Shardwire__Ping p = SHARDWIRE__PING__INIT;
  req.body_case = SHARDWIRE__REQUEST__BODY_PING;
  req.ping = &p;
  req.seq = r.seq + 1;
  p.has_payload = 1;
  p.payload.len = SHARDD_MAX_FRAME - 64;
  while (shardwire__request__get_packed_size(&req) < SHARDD_MAX_FRAME)
    p.payload.len++;
  if (shardwire__request__get_packed_size(&req) > SHARDD_MAX_FRAME)
    p.payload.len--;
  cr_assert_eq(shardwire__request__get_packed_size(&req), SHARDD_MAX_FRAME);
  p.payload.data = calloc(1, p.payload.len);
  cr_assert_not_null(p.payload.data);
  Shardwire__Response pong = SHARDWIRE__RESPONSE__INIT;
  Shardwire__Pong pb = SHARDWIRE__PONG__INIT;
  pong.seq = req.seq;
  pong.body_case = SHARDWIRE__RESPONSE__BODY_PONG;
  pong.pong = &pb;
  pb.has_payload = 1;
  pb.payload = p.payload;
  cr_assert_gt(shardwire__response__get_packed_size(&pong), SHARDD_MAX_FRAME,
               "the echo would fit: the test proves nothing");
  uint64_t seq = test_raw_send(&r, &req);
  r.seq = seq;
  free(p.payload.data);
  Shardwire__Response *resp = test_raw_expect(&r, seq, SHARDD_E_LIMIT);
  cr_assert(strstr(resp->message, "frame limit") != NULL, "%s", resp->message);
  shardwire__response__free_unpacked(resp, NULL);
  test_raw_sync(&r); /* the session still serves */
  test_raw_close(&r);
  test_daemon_finish(&d);
}
