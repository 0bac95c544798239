/* test_liveness.c — a daemon that stops answering (SIGSTOP: stopped, hung,
 * swapped out) against a real shardd: a call fails within the client's
 * deadline with SHARDD_E_TIMEOUT naming the socket instead of blocking
 * forever, the client serves again once the daemon does (SIGCONT); a
 * collective that legitimately waits for a slow peer longer than the
 * deadline is not failed (the client's Ping is answered meanwhile); and a
 * collective the daemon's own stall overran is not blamed on a rank. */
#include <criterion/criterion.h>
#include <errno.h>
#include <pthread.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>

#include "harness.h"

static test_daemon d;

static void start(void) {
  const char *args[] = {"--devices", "2", NULL};
  test_daemon_start(&d, args);
}

/* A collective timeout shorter than the stall the test makes. */
static void start_short_timeout(void) {
  const char *args[] = {"--devices", "2", "--collective-timeout", "1", NULL};
  test_daemon_start(&d, args);
}

static void stop(void) {
  if (d.pid > 0)
    kill(d.pid, SIGCONT); /* a failed assertion may leave it stopped */
  test_daemon_finish(&d);
}

static shardd_client_t *connect_within(const char *job, uint32_t rank,
                                       uint32_t world, double timeout_s) {
  shardd_connect_opts o = SHARDD_CONNECT_OPTS_INIT;
  o.job = job;
  o.rank = rank;
  o.world = world;
  o.timeout_s = timeout_s;
  shardd_client_t *c = NULL;
  char err[512];
  shardd_err rc = shardd_connect(d.sock, &o, &c, err, sizeof err);
  cr_assert_eq(rc, SHARDD_OK, "connect: %s", err);
  return c;
}

static void expect_timeout_message(const char *msg) {
  char want[256];
  snprintf(want, sizeof want, "daemon at %s did not answer for 1 s", d.sock);
  cr_assert_not_null(strstr(msg, want), "message: %s", msg);
}

Test(liveness, stopped_daemon_fails_a_call_naming_the_socket, .init = start,
     .fini = stop, .timeout = 60) {
  shardd_client_t *c = connect_within(NULL, 0, 1, 1.0);
  cr_assert_eq(shardd_ping(c), SHARDD_OK, "%s", shardd_last_error(c));
  cr_assert_eq(kill(d.pid, SIGSTOP), 0);
  double t0 = test_mono_s();
  char *out = NULL;
  shardd_err rc = shardd_status_json(c, &out);
  double took = test_mono_s() - t0;
  cr_assert_eq(rc, SHARDD_E_TIMEOUT, "%s: %s", shardd_err_name(rc),
               shardd_last_error(c));
  expect_timeout_message(shardd_last_error(c));
  cr_assert(took >= 0.9 && took < 20, "failed after %.2f s", took);
  cr_assert_eq(kill(d.pid, SIGCONT), 0);
  /* the same client serves again (the late reply to the status is dropped) */
  cr_assert_eq(shardd_ping(c), SHARDD_OK, "%s", shardd_last_error(c));
  rc = shardd_status_json(c, &out);
  cr_assert_eq(rc, SHARDD_OK, "%s", shardd_last_error(c));
  cr_assert_not_null(strstr(out, "\"backend\""), "%s", out);
  shardd_free(out);
  shardd_close(c);
}

typedef struct {
  shardd_client_t *c;
  uint64_t id;
  shardd_err rc;
  char msg[1024];
} death_arg;

static void *death_gather(void *p) {
  death_arg *a = p;
  a->rc = shardd_gather(a->c, a->id);
  snprintf(a->msg, sizeof a->msg, "%s", shardd_last_error(a->c));
  return NULL;
}

static void expect_death_message(const char *msg) {
  char want[256];
  snprintf(want, sizeof want, "daemon at %s closed the connection", d.sock);
  cr_assert_not_null(strstr(msg, want), "message: %s", msg);
  cr_assert_not_null(strstr(msg, "stopped or died"), "message: %s", msg);
  cr_assert_not_null(strstr(msg, "reconnect"), "message: %s", msg);
}

/* A daemon killed (kill -9, the OOM killer, a crash) under a trainer: the
 * call waiting in it, and the next call of an idle client, fail with
 * E_CLOSED saying which daemon went and what to do -- not a bare "recv:
 * Connection reset by peer". */
Test(liveness, killed_daemon_fails_calls_naming_the_socket_and_what_to_do,
     .init = start, .fini = stop, .timeout = 60) {
  shardd_client_t *idle = connect_within(NULL, 0, 1, 0);
  shardd_client_t *c = connect_within("gone", 0, 2, 0);
  shardd_buffer_info info;
  cr_assert_eq(shardd_buffer_register(c, "w", SHARDD_DTYPE_FP32, 64, &info),
               SHARDD_OK, "%s", shardd_last_error(c));
  death_arg a = {c, info.id, SHARDD_OK, ""};
  pthread_t th;
  cr_assert_eq(pthread_create(&th, NULL, death_gather, &a), 0);
  test_sleep_ms(300); /* the gather waits for rank 1 */
  cr_assert_eq(kill(d.pid, SIGKILL), 0);
  waitpid(d.pid, NULL, 0);
  d.pid = 0;
  pthread_join(th, NULL);
  cr_assert_eq(a.rc, SHARDD_E_CLOSED, "%s: %s", shardd_err_name(a.rc), a.msg);
  expect_death_message(a.msg);
  cr_log_info("liveness: a call waiting in a killed daemon: %s", a.msg);
  shardd_err rc = shardd_ping(idle);
  cr_assert_eq(rc, SHARDD_E_CLOSED, "%s: %s", shardd_err_name(rc),
               shardd_last_error(idle));
  expect_death_message(shardd_last_error(idle));
  cr_log_info("liveness: an idle client's next call: %s", shardd_last_error(idle));
  shardd_close(c);
  shardd_close(idle);
}

Test(liveness, stopped_daemon_fails_the_connect, .init = start, .fini = stop,
     .timeout = 60) {
  cr_assert_eq(kill(d.pid, SIGSTOP), 0);
  shardd_connect_opts o = SHARDD_CONNECT_OPTS_INIT;
  o.timeout_s = 1.0;
  shardd_client_t *c = NULL;
  char err[512];
  double t0 = test_mono_s();
  shardd_err rc = shardd_connect(d.sock, &o, &c, err, sizeof err);
  double took = test_mono_s() - t0;
  cr_assert_eq(rc, SHARDD_E_TIMEOUT, "%s: %s", shardd_err_name(rc), err);
  cr_assert_null(c);
  expect_timeout_message(err);
  cr_assert(took < 20, "failed after %.2f s", took);
  cr_assert_eq(kill(d.pid, SIGCONT), 0);
  c = connect_within(NULL, 0, 1, 1.0);
  cr_assert_eq(shardd_ping(c), SHARDD_OK, "%s", shardd_last_error(c));
  shardd_close(c);
}

Test(liveness, timeout_from_the_environment, .init = start, .fini = stop,
     .timeout = 60) {
  setenv("SHARDD_TIMEOUT", "1", 1);
  shardd_client_t *c = connect_within(NULL, 0, 1, 0);
  unsetenv("SHARDD_TIMEOUT");
  cr_assert_eq(kill(d.pid, SIGSTOP), 0);
  shardd_err rc = shardd_ping(c);
  cr_assert_eq(rc, SHARDD_E_TIMEOUT, "%s", shardd_last_error(c));
  expect_timeout_message(shardd_last_error(c));
  cr_assert_eq(kill(d.pid, SIGCONT), 0);
  shardd_close(c);
  setenv("SHARDD_TIMEOUT", "soon", 1);
  shardd_connect_opts o = SHARDD_CONNECT_OPTS_INIT;
  char err[512];
  rc = shardd_connect(d.sock, &o, &c, err, sizeof err);
  unsetenv("SHARDD_TIMEOUT");
  cr_assert_eq(rc, SHARDD_E_INVAL, "%s", err);
  cr_assert_not_null(strstr(err, "SHARDD_TIMEOUT=soon"), "%s", err);
}

typedef struct {
  shardd_client_t *c;
  uint64_t buf;
  shardd_err rc;
  char msg[512];
  pthread_t th;
} gather_call;

static void *gather_main(void *p) {
  gather_call *g = p;
  g->rc = shardd_gather(g->c, g->buf);
  snprintf(g->msg, sizeof g->msg, "%s", g->rc ? shardd_last_error(g->c) : "");
  return NULL;
}

static void two_ranks(shardd_client_t **c, double timeout_s, uint64_t *buf) {
  for (uint32_t r = 0; r < 2; r++) {
    c[r] = connect_within("live", r, 2, timeout_s);
    shardd_buffer_info bi;
    cr_assert_eq(shardd_buffer_register(c[r], "w", SHARDD_DTYPE_FP32, 64, &bi),
                 SHARDD_OK, "%s", shardd_last_error(c[r]));
    float *shard = bi.shard;
    for (uint64_t i = 0; i < bi.shard_numel; i++)
      shard[i] = (float)(r * 100 + i);
    *buf = bi.id;
  }
}

/* Rank 0 waits in a gather for 3 s, three times its client's deadline:
 * the daemon answers its Pings meanwhile, so the gather completes. */
Test(liveness, collective_waiting_for_a_slow_peer_is_not_failed, .init = start,
     .fini = stop, .timeout = 60) {
  shardd_client_t *c[2];
  uint64_t buf;
  two_ranks(c, 1.0, &buf);
  gather_call g0 = {.c = c[0], .buf = buf};
  cr_assert_eq(pthread_create(&g0.th, NULL, gather_main, &g0), 0);
  test_sleep_ms(3000);
  shardd_err rc = shardd_gather(c[1], buf);
  pthread_join(g0.th, NULL);
  cr_assert_eq(g0.rc, SHARDD_OK, "rank 0: %s: %s", shardd_err_name(g0.rc), g0.msg);
  cr_assert_eq(rc, SHARDD_OK, "rank 1: %s", shardd_last_error(c[1]));
  shardd_close(c[0]);
  shardd_close(c[1]);
}

/* The daemon is stopped for 3 s while rank 1's gather waits in its socket;
 * rank 0's, queued before, passes its 1 s collective timeout during the
 * stall. Rank 1 was never late: the daemon was; both gathers complete. */
Test(liveness, daemon_stall_is_not_blamed_on_a_rank,
     .init = start_short_timeout, .fini = stop, .timeout = 60) {
  shardd_client_t *c[2];
  uint64_t buf;
  two_ranks(c, 30.0, &buf);
  gather_call g[2] = {{.c = c[0], .buf = buf}, {.c = c[1], .buf = buf}};
  cr_assert_eq(pthread_create(&g[0].th, NULL, gather_main, &g[0]), 0);
  test_sleep_ms(200); /* rank 0's gather reaches the daemon */
  cr_assert_eq(kill(d.pid, SIGSTOP), 0);
  cr_assert_eq(pthread_create(&g[1].th, NULL, gather_main, &g[1]), 0);
  test_sleep_ms(3000);
  cr_assert_eq(kill(d.pid, SIGCONT), 0);
  for (int r = 0; r < 2; r++) {
    pthread_join(g[r].th, NULL);
    cr_expect_eq(g[r].rc, SHARDD_OK, "rank %d: %s: %s", r,
                 shardd_err_name(g[r].rc), g[r].msg);
  }
  cr_assert(test_daemon_log_has(&d, "stalled"),
            "the daemon's log does not name its stall");
  shardd_close(c[0]);
  shardd_close(c[1]);
}

/* A service manager that reads nothing from its notify socket (hung, or
 * stopped in a debugger), with the fd store on: every region the daemon
 * allocates is a FDSTORE=1 message to it, and once its queue was full the
 * daemon's send waited for room on the loop thread, forever; every client
 * with it. Now one message waits 1 s for room, and then they are dropped
 * (logged) until the manager reads again: registrations and pings are
 * answered, and the job works, its memory only kept from the store. */
Test(liveness, a_manager_that_reads_nothing_stalls_no_client, .timeout = 60) {
  char dir[] = "/tmp/shardd-mgr-XXXXXX", path[64];
  cr_assert_not_null(mkdtemp(dir));
  snprintf(path, sizeof path, "%s/notify", dir);
  int mgr = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  cr_assert_geq(mgr, 0);
  int tiny = 1; /* the kernel's minimum */
  cr_assert_eq(setsockopt(mgr, SOL_SOCKET, SO_RCVBUF, &tiny, sizeof tiny), 0);
  struct sockaddr_un sa = {.sun_family = AF_UNIX};
  snprintf(sa.sun_path, sizeof sa.sun_path, "%s", path);
  cr_assert_eq(bind(mgr, (struct sockaddr *)&sa, sizeof sa), 0, "%s",
               strerror(errno));
  setenv("NOTIFY_SOCKET", path, 1);
  setenv("FDSTORE", "4096", 1);
  test_daemon_start(&d, NULL);
  unsetenv("NOTIFY_SOCKET");
  unsetenv("FDSTORE");
  shardd_client_t *c = connect_within("unread-manager", 0, 1, 10.0);
  for (int i = 0; i < 64; i++) {
    char name[32];
    snprintf(name, sizeof name, "w%02d", i);
    shardd_buffer_info b;
    cr_assert_eq(shardd_buffer_register(c, name, SHARDD_DTYPE_FP32, 256, &b),
                 SHARDD_OK, "buffer %d: %s", i, shardd_last_error(c));
    cr_assert_eq(shardd_ping(c), SHARDD_OK, "ping after buffer %d: %s", i,
                 shardd_last_error(c));
  }
  shardd_close(c);
  cr_assert(test_daemon_log_has(&d, "queue is full"),
            "the dropped notifications were not logged");
  test_daemon_finish(&d);
  close(mgr);
  unlink(path);
  rmdir(dir);
}
