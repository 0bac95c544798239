/* test_server.c — the daemon's loop against a real shardd on a temporary
 * socket: status over shardctl --json, clean SIGTERM shutdown, a missing
 * socket directory; and, with the server in this process, replies that
 * cannot be sent (this binary links the server built with its fault hook).
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

/* ---- status and shutdown ---------------------------------------------- */

Test(server, status_json_then_sigterm, .init = start_default, .fini = stop_daemon) {
  tj *j = shardctl_status();
  cr_assert_eq(j->kind, TJ_OBJ);
  cr_assert_str_eq(tj_need(j, "version", TJ_STR)->str, SHARDD_VERSION);
  cr_assert_eq(tj_need(j, "protocol", TJ_NUM)->num, SHARDD_PROTOCOL_VERSION);
  cr_assert_eq(tj_need(j, "pid", TJ_NUM)->num, (double)d.pid);
  cr_assert_str_eq(tj_need(j, "backend", TJ_STR)->str, "host");
  cr_assert_str_eq(tj_need(j, "socket", TJ_STR)->str, d.sock);
  cr_assert_geq(tj_need(j, "uptime_s", TJ_NUM)->num, 0.0);
  /* shardctl's own session is the one client */
  cr_assert_eq(tj_need(j, "clients", TJ_NUM)->num, 1.0);
  const tj *devs = tj_need(j, "devices", TJ_ARR);
  cr_assert_eq(devs->n, 3, "--devices 3 but %zu devices listed", devs->n);
  for (size_t i = 0; i < devs->n; i++) {
    const tj *dv = devs->kids[i];
    cr_assert_eq(tj_need(dv, "index", TJ_NUM)->num, (double)i);
    double cap = tj_need(dv, "capacity_bytes", TJ_NUM)->num;
    double used = tj_need(dv, "used_bytes", TJ_NUM)->num;
    double fr = tj_need(dv, "free_bytes", TJ_NUM)->num;
    cr_assert_eq(used, 0.0, "device %zu has %g bytes used with no job", i, used);
    cr_assert_gt(cap, 0.0);
    cr_assert_eq(fr, cap - used);
    tj_need(dv, "name", TJ_STR);
  }
  cr_assert_eq(tj_need(j, "jobs", TJ_ARR)->n, 0);
  tj_free(j);

  /* One job with two ranks connected and one buffer of 1000 fp32. */
  shardd_client_t *r0 = test_connect(&d, "alpha", 0, 2);
  shardd_client_t *r1 = test_connect(&d, "alpha", 1, 2);
  shardd_buffer_info b0, b1;
  cr_assert_eq(shardd_buffer_register(r0, "w", SHARDD_DTYPE_FP32, 1000, &b0),
               SHARDD_OK, "%s", shardd_last_error(r0));
  cr_assert_eq(shardd_buffer_register(r1, "w", SHARDD_DTYPE_FP32, 1000, &b1),
               SHARDD_OK, "%s", shardd_last_error(r1));
  cr_assert(b0.created && !b1.created);
  j = shardctl_status();
  cr_assert_eq(tj_need(j, "clients", TJ_NUM)->num, 3.0);
  const tj *jobs = tj_need(j, "jobs", TJ_ARR);
  cr_assert_eq(jobs->n, 1);
  const tj *job = jobs->kids[0];
  cr_assert_str_eq(tj_need(job, "name", TJ_STR)->str, "alpha");
  cr_assert_eq(tj_need(job, "world", TJ_NUM)->num, 2.0);
  cr_assert_eq(tj_need(job, "clients", TJ_NUM)->num, 2.0);
  cr_assert_eq(tj_need(job, "buffers", TJ_NUM)->num, 1.0);
  cr_assert_eq(tj_need(job, "views", TJ_NUM)->num, 0.0);
  cr_assert_eq(tj_need(job, "collectives_in_flight", TJ_NUM)->num, 0.0);
  cr_assert_geq(tj_need(job, "bytes", TJ_NUM)->num, 2 * 500 * 4 * 3.0,
                "two ranks' shard + gather + grad areas are resident");
  cr_assert_eq(tj_need(job, "optimizers", TJ_ARR)->n, 0);
  /* ranks 0 and 1 live on devices 0 and 1; device 2 holds nothing */
  devs = tj_need(j, "devices", TJ_ARR);
  cr_assert_gt(tj_need(devs->kids[0], "used_bytes", TJ_NUM)->num, 0.0);
  cr_assert_gt(tj_need(devs->kids[1], "used_bytes", TJ_NUM)->num, 0.0);
  cr_assert_eq(tj_need(devs->kids[2], "used_bytes", TJ_NUM)->num, 0.0);
  for (size_t i = 0; i < devs->n; i++)
    cr_assert_geq(tj_need(devs->kids[i], "peak_bytes", TJ_NUM)->num,
                  tj_need(devs->kids[i], "used_bytes", TJ_NUM)->num,
                  "a device's peak is never below what it holds");
  tj_free(j);

  /* The text form is key: value lines. */
  char args[256], *out;
  snprintf(args, sizeof args, "--socket %s status", d.sock);
  cr_assert_eq(test_shardctl(NULL, args, &out, NULL), 0);
  cr_assert_not_null(strstr(out, "version: " SHARDD_VERSION "\n"), "%s", out);
  cr_assert_not_null(strstr(out, "backend: host\n"), "%s", out);
  cr_assert_not_null(strstr(out, "devices: 3\n"), "%s", out);
  cr_assert_not_null(strstr(out, "job alpha: world 2 clients 2 buffers 1"), "%s", out);
  free(out);

  shardd_close(r0);
  shardd_close(r1);
  struct stat st;
  cr_assert_eq(stat(d.sock, &st), 0);
  int code = test_daemon_terminate(&d);
  cr_assert_eq(code, 0, "shardd exited %d on SIGTERM", code);
  cr_assert_neq(stat(d.sock, &st), 0, "socket %s still exists after SIGTERM", d.sock);
  cr_assert_eq(errno, ENOENT);
}

/* SIGTERM while ranks are connected and one waits in a collective. */
Test(server, sigterm_with_clients_and_pending_collective, .init = start_default,
     .fini = stop_daemon) {
  test_raw r;
  test_raw_open(&d, &r);
  test_raw_hello(&r, "busy", 0, 2);
  shardd_buffer_info b;
  test_raw_register_buffer(&r, "x", SHARDD_DTYPE_FP32, 64, &b);
  test_raw_send_gather(&r, b.id);
  test_raw_sync(&r);
  shardd_client_t *c = test_connect(&d, NULL, 0, 1);
  int code = test_daemon_terminate(&d);
  cr_assert_eq(code, 0, "shardd exited %d on SIGTERM", code);
  struct stat st;
  cr_assert_neq(stat(d.sock, &st), 0, "socket file left behind");
  shardd_close(c);
  test_raw_close(&r);
}

/* Ranks waiting in a gather when SIGTERM arrives were told
 * "rank 1 disconnected" (the stop closes the sessions one by one, and the
 * first closed failed the others' collectives as a lost peer). Each waiter
 * must get E_SHUTDOWN naming the stop, whichever session closes first: two
 * waiters, one on each side of the idle rank in the session list. */
Test(server, sigterm_fails_waiting_gather_with_e_shutdown, .init = start_default,
     .fini = stop_daemon) {
  test_raw w[2];
  uint64_t seq[2];
  shardd_client_t *idle = NULL;
  for (int i = 0; i < 2; i++) {
    test_raw_open(&d, &w[i]);
    test_raw_hello(&w[i], "stopjob", (uint32_t)(i * 2), 3);
    if (i == 0) /* rank 1 joins between the two waiters, and never gathers */
      idle = test_connect(&d, "stopjob", 1, 3);
    shardd_buffer_info b;
    test_raw_register_buffer(&w[i], "x", SHARDD_DTYPE_FP32, 64, &b);
    seq[i] = test_raw_send_gather(&w[i], b.id);
    test_raw_sync(&w[i]);
  }
  int code = test_daemon_terminate(&d);
  cr_assert_eq(code, 0, "shardd exited %d on SIGTERM", code);
  shardd_close(idle);
  for (int i = 0; i < 2; i++) {
    Shardwire__Response *resp = test_raw_expect(&w[i], seq[i], SHARDD_E_SHUTDOWN);
    const char *msg = resp->message ? resp->message : "";
    cr_assert_not_null(strstr(msg, "daemon stopping (SIGTERM)"), "rank %d: %s", i * 2, msg);
    cr_assert_not_null(strstr(msg, "gather of buffer"), "rank %d: %s", i * 2, msg);
    cr_assert_null(strstr(msg, "disconnected"), "rank %d: %s", i * 2, msg);
    shardwire__response__free_unpacked(resp, NULL);
    test_raw_close(&w[i]);
  }
}

/* ---- replies that cannot be sent -----------------------------------------
 * A reply whose buffer cannot be allocated (or whose write fails at once)
 * closed its session on the spot, inside whoever was answering: a
 * collective walking its waiters, fail_waiting walking a job's queue. The
 * close re-entered shardd__coll_session_lost, which freed collectives that
 * walk stood on, and at --job-linger 0 the job itself. Now the session is
 * closed on the next loop turn and answered no more meanwhile.
 *
 * These run the server in this process, on a loop thread, so that
 * shardd__server_fail_replies can make exactly the reply they pick fail;
 * the clients are the same raw wire clients as above, by socket path.
 * Under SAN=1 a use-after-free is an ASan report that ends the test. */

typedef struct {
  uv_loop_t loop;
  shardd__server srv;
  uv_async_t stop;
  pthread_t th;
  test_daemon d; /* dir and sock only, for test_raw_open / test_connect */
} inproc;

static void inproc_stop_cb(uv_async_t *a) {
  inproc *p = a->data;
  shardd__server_stop(&p->srv);
  uv_close((uv_handle_t *)a, NULL);
}

static void *inproc_main(void *arg) {
  inproc *p = arg;
  uv_run(&p->loop, UV_RUN_DEFAULT);
  return NULL;
}

static void inproc_start(inproc *p, double linger) {
  memset(p, 0, sizeof *p);
  /* a reply written to a client that is gone must be an EPIPE, as in
   * shardd's main, not the end of the test process */
  signal(SIGPIPE, SIG_IGN);
  snprintf(p->d.dir, sizeof p->d.dir, "/tmp/shardd-inproc-XXXXXX");
  cr_assert_not_null(mkdtemp(p->d.dir));
  snprintf(p->d.sock, sizeof p->d.sock, "%s/shardd.sock", p->d.dir);
  cr_assert_eq(uv_loop_init(&p->loop), 0);
  char err[256];
  shardd__backend *be;
  cr_assert_eq(shardd__backend_host_create(3, 16u << 20, &be, err, sizeof err),
               SHARDD_OK, "%s", err);
  shardd__server_opts o = SHARDD__SERVER_OPTS_INIT;
  o.socket_path = p->d.sock;
  o.job_linger = linger;
  o.log_level = 1;
  cr_assert_eq(shardd__server_init(&p->srv, &p->loop, be, &o, err, sizeof err),
               SHARDD_OK, "%s", err);
  cr_assert_eq(uv_async_init(&p->loop, &p->stop, inproc_stop_cb), 0);
  p->stop.data = p;
  cr_assert_eq(pthread_create(&p->th, NULL, inproc_main, p), 0);
}

static void inproc_finish(inproc *p) {
  uv_async_send(&p->stop);
  pthread_join(p->th, NULL);
  shardd__server_free(&p->srv);
  cr_expect_eq(uv_loop_close(&p->loop), 0, "a handle outlived the server");
  rmdir(p->d.dir);
}

static size_t inproc_jobs(inproc *p) {
  shardd_client_t *c = test_connect(&p->d, NULL, 0, 1);
  char *s = NULL;
  cr_assert_eq(shardd_status_json(c, &s), SHARDD_OK, "%s", shardd_last_error(c));
  tj *j = tj_parse(s);
  cr_assert_not_null(j, "status is not JSON: %s", s);
  size_t n = tj_need(j, "jobs", TJ_ARR)->n;
  tj_free(j);
  shardd_free(s);
  shardd_close(c);
  return n;
}

/* The daemon closed r without sending it anything more. */
static void expect_closed_unanswered(test_raw *r, const char *who) {
  Shardwire__Response *resp = test_raw_recv(r);
  cr_assert_null(resp, "%s got reply %llu (%s) after its reply was lost", who,
                 resp ? (unsigned long long)resp->seq : 0ull,
                 resp && resp->message ? resp->message : "");
}

/* The gather's fan-out answers rank 0 first; that reply fails. Rank 0's
 * session goes, rank 1 gets its reply, and everyone else goes on. */
Test(server, failed_reply_in_gather_fanout_closes_only_that_session, .timeout = 120) {
  inproc p;
  inproc_start(&p, 600);
  test_raw r0, r1, other;
  test_raw_open(&p.d, &r0);
  test_raw_hello(&r0, "fan", 0, 2);
  test_raw_open(&p.d, &r1);
  test_raw_hello(&r1, "fan", 1, 2);
  test_raw_open(&p.d, &other);
  test_raw_hello(&other, "bystander", 0, 1);
  shardd_buffer_info b0, b1;
  test_raw_register_buffer(&r0, "w", SHARDD_DTYPE_FP32, 64, &b0);
  test_raw_register_buffer(&r1, "w", SHARDD_DTYPE_FP32, 64, &b1);
  test_raw_send_gather(&r0, b0.id);
  test_raw_sync(&r0); /* rank 0 waits in the gather; nothing else is owed */
  shardd__server_fail_replies(&p.srv, 1);
  uint64_t g1 = test_raw_send_gather(&r1, b1.id);
  shardwire__response__free_unpacked(test_raw_expect(&r1, g1, SHARDD_OK), NULL);
  expect_closed_unanswered(&r0, "rank 0");
  test_raw_close(&r0);

  test_raw_sync(&r1);
  test_raw_sync(&other);
  /* rank 0's place is free again and the job collects as before */
  test_raw_open(&p.d, &r0);
  test_raw_hello(&r0, "fan", 0, 2);
  test_raw_register_buffer(&r0, "w", SHARDD_DTYPE_FP32, 64, &b0);
  uint64_t a = test_raw_send_gather(&r0, b0.id);
  uint64_t b = test_raw_send_gather(&r1, b1.id);
  shardwire__response__free_unpacked(test_raw_expect(&r0, a, SHARDD_OK), NULL);
  shardwire__response__free_unpacked(test_raw_expect(&r1, b, SHARDD_OK), NULL);
  test_raw_close(&r0);
  test_raw_close(&r1);
  test_raw_close(&other);
  inproc_finish(&p);
}

/* --job-linger 0 and the last client's reply fails in the fan-out: the
 * synchronous close released the job while the collective still walked
 * it (coll_finish, then schedule). The job must go, but afterwards. */
Test(server, failed_reply_to_the_last_client_of_a_lingerless_job, .timeout = 120) {
  inproc p;
  inproc_start(&p, 0);
  test_raw r;
  test_raw_open(&p.d, &r);
  test_raw_hello(&r, "solo", 0, 1);
  shardd_buffer_info b;
  test_raw_register_buffer(&r, "w", SHARDD_DTYPE_FP32, 64, &b);
  shardd__server_fail_replies(&p.srv, 1);
  test_raw_send_gather(&r, b.id);
  expect_closed_unanswered(&r, "the only rank");
  test_raw_close(&r);
  cr_assert_eq(inproc_jobs(&p), 0, "the job outlived its last client at linger 0");
  /* the name is free: a job of another world may take it */
  test_raw_open(&p.d, &r);
  test_raw_hello(&r, "solo", 0, 2);
  test_raw_sync(&r);
  test_raw_close(&r);
  inproc_finish(&p);
}

/* Rank 0 leaves while rank 1 waits in a gather and a scatter that rank 2
 * never joined: fail_waiting answers both collectives, and the first
 * answer to rank 1 fails. Closing rank 1 there failed (and freed) the
 * scatter, the collective fail_waiting was about to visit. Rank 1 is
 * answered no more; rank 2 and the job carry on. */
Test(server, failed_reply_while_failing_waiting_collectives, .timeout = 120) {
  inproc p;
  inproc_start(&p, 600);
  test_raw r[3];
  shardd_buffer_info b[3];
  for (uint32_t k = 0; k < 3; k++) {
    test_raw_open(&p.d, &r[k]);
    test_raw_hello(&r[k], "three", k, 3);
    test_raw_register_buffer(&r[k], "w", SHARDD_DTYPE_FP32, 96, &b[k]);
  }
  test_raw_send_gather(&r[1], b[1].id);
  test_raw_send_scatter(&r[1], b[1].id, SHARDD_REDUCE_SUM);
  test_raw_sync(&r[1]);
  shardd__server_fail_replies(&p.srv, 1);
  test_raw_close(&r[0]);
  expect_closed_unanswered(&r[1], "rank 1");
  test_raw_close(&r[1]);

  test_raw_sync(&r[2]);
  /* ranks 0 and 1 come back and the three collect together */
  for (uint32_t k = 0; k < 2; k++) {
    test_raw_open(&p.d, &r[k]);
    test_raw_hello(&r[k], "three", k, 3);
    test_raw_register_buffer(&r[k], "w", SHARDD_DTYPE_FP32, 96, &b[k]);
  }
  uint64_t seq[3];
  for (int k = 0; k < 3; k++)
    seq[k] = test_raw_send_gather(&r[k], b[k].id);
  for (int k = 0; k < 3; k++) {
    shardwire__response__free_unpacked(test_raw_expect(&r[k], seq[k], SHARDD_OK), NULL);
    test_raw_close(&r[k]);
  }
  cr_assert_eq(inproc_jobs(&p), 1);
  inproc_finish(&p);
}

/* ---- a missing socket directory ------------------------------------------- *
 * libuv's bind turns ENOENT into EACCES, so a missing /run/shardd was
 * reported as "permission denied" and sent operators after modes and
 * groups. The message now names the directory that does not exist; a
 * directory the daemon may not write still says permission denied. */

/* Runs shardd --socket sock (as uid when uid > 0) with stderr to a file;
 * returns its exit status and *log (caller frees) what it printed. */
/* A copy of the daemon another uid may execute: the checkout may sit in a
 * directory only its owner can enter (mktemp -d makes them 0700). */
static void daemon_copy(char *path, size_t len) {
  const char *bin = test_bin("SHARDD_BIN", "build/shardd");
  snprintf(path, len, "/tmp/shardd-bin-XXXXXX");
  int out = mkstemp(path);
  int in = open(bin, O_RDONLY | O_CLOEXEC);
  cr_assert(out >= 0 && in >= 0, "copying %s: %s", bin, strerror(errno));
  char chunk[65536];
  for (ssize_t n; (n = read(in, chunk, sizeof chunk)) > 0;)
    cr_assert_eq(write(out, chunk, (size_t)n), n);
  close(in);
  cr_assert_eq(fchmod(out, 0755), 0);
  cr_assert_eq(fchown(out, 0, 0), 0);
  close(out);
}

static int shardd_at(const char *sock, uid_t uid, char **log) {
  char path[] = "/tmp/shardd-bindlog-XXXXXX";
  char copy[64] = "";
  if (uid > 0)
    daemon_copy(copy, sizeof copy);
  int fd = mkstemp(path);
  cr_assert(fd >= 0);
  pid_t pid = fork();
  cr_assert(pid >= 0);
  if (pid == 0) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (uid > 0 && (setgid(uid) != 0 || setuid(uid) != 0))
      _exit(120);
    dup2(fd, 2);
    const char *bin = copy[0] ? copy : test_bin("SHARDD_BIN", "build/shardd");
    execl(bin, bin, "--backend", "host", "--socket", sock, (char *)NULL);
    _exit(127);
  }
  close(fd);
  int st;
  if (!test_wait_exit(pid, &st)) {
    kill(pid, SIGKILL);
    waitpid(pid, &st, 0);
    cr_assert_fail("shardd at %s did not exit", sock);
  }
  *log = test_slurp(path);
  unlink(path);
  if (copy[0])
    unlink(copy);
  cr_assert_not_null(*log);
  cr_assert(!(WIFEXITED(st) && WEXITSTATUS(st) == 127), "the daemon did not start: %s",
            *log);
  return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}

Test(server, a_missing_socket_directory_is_named, .timeout = 120) {
  char dir[] = "/tmp/shardd-nodir-XXXXXX", sock[128], want[320];
  cr_assert_not_null(mkdtemp(dir));
  snprintf(sock, sizeof sock, "%s/run/shardd.sock", dir);
  char *log;
  int code = shardd_at(sock, 0, &log);
  cr_assert_neq(code, 0, "shardd started on %s: %s", sock, log);
  snprintf(want, sizeof want, "bind %s: directory %s/run does not exist", sock, dir);
  cr_assert(strstr(log, want) != NULL, "wanted \"%s\" in: %s", want, log);
  cr_assert(strstr(log, "permission denied") == NULL, "%s", log);
  free(log);

  /* one the daemon may not write into is what it says it is */
  if (geteuid() == 0) {
    cr_assert_eq(chmod(dir, 0700), 0);
    snprintf(sock, sizeof sock, "%s/shardd.sock", dir);
    code = shardd_at(sock, 4242, &log);
    cr_assert_neq(code, 0);
    cr_assert(strstr(log, "permission denied") != NULL, "%s", log);
    cr_assert(strstr(log, "does not exist") == NULL, "%s", log);
    free(log);
  }
  rmdir(dir);
}
