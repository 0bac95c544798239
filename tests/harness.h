/* harness.h — test helpers: start a real shardd on a temporary socket, wait
 * until it accepts, stop it with SIGTERM and collect its exit status. The
 * binary is $SHARDD_BIN (set by scripts/run_tests.sh), else build/shardd. */
#ifndef SHARDD_TEST_HARNESS_H
#define SHARDD_TEST_HARNESS_H

#include <criterion/criterion.h>
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "shardd.h"

typedef struct {
  pid_t pid;
  char dir[64];
  char sock[128];
  char log[128];
} test_daemon;

static inline const char *test_bin(const char *env, const char *dflt) {
  const char *p = getenv(env);
  return p && p[0] ? p : dflt;
}

static inline int test_can_connect(const char *path) {
  int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  struct sockaddr_un sa = {.sun_family = AF_UNIX};
  snprintf(sa.sun_path, sizeof sa.sun_path, "%s", path);
  int ok = fd >= 0 && connect(fd, (struct sockaddr *)&sa, sizeof sa) == 0;
  if (fd >= 0)
    close(fd);
  return ok;
}

static inline void test_sleep_ms(int ms) {
  struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
  nanosleep(&ts, NULL);
}

/* Starts shardd with extra args (NULL-terminated list). */
static inline void test_daemon_start(test_daemon *d, const char *const *extra) {
  memset(d, 0, sizeof *d);
  snprintf(d->dir, sizeof d->dir, "/tmp/shardd-test-XXXXXX");
  cr_assert_not_null(mkdtemp(d->dir), "mkdtemp: %s", strerror(errno));
  snprintf(d->sock, sizeof d->sock, "%s/shardd.sock", d->dir);
  snprintf(d->log, sizeof d->log, "%s/shardd.log", d->dir);
  const char *argv[32];
  int n = 0;
  argv[n++] = test_bin("SHARDD_BIN", "build/shardd");
  argv[n++] = "--socket";
  argv[n++] = d->sock;
  argv[n++] = "--log-level";
  argv[n++] = "debug";
  for (; extra && *extra && n < 30; extra++)
    argv[n++] = *extra;
  argv[n] = NULL;
  d->pid = fork();
  cr_assert(d->pid >= 0);
  if (d->pid == 0) {
    FILE *f = freopen(d->log, "w", stderr);
    (void)f;
    execv(argv[0], (char *const *)argv);
    fprintf(stderr, "exec %s: %s\n", argv[0], strerror(errno));
    _exit(127);
  }
  for (int i = 0; i < 500; i++) {
    if (test_can_connect(d->sock))
      return;
    int st;
    if (waitpid(d->pid, &st, WNOHANG) == d->pid) {
      d->pid = 0;
      cr_assert_fail("shardd exited at start (see %s)", d->log);
    }
    test_sleep_ms(10);
  }
  cr_assert_fail("shardd did not listen on %s within 5 s", d->sock);
}

static inline void test_daemon_dump_log(const test_daemon *d) {
  FILE *f = fopen(d->log, "r");
  if (f == NULL)
    return;
  char line[1024];
  while (fgets(line, sizeof line, f))
    cr_log_info("daemon: %s", line);
  fclose(f);
}

/* SIGTERM, then waits up to 10 s; returns the exit status (-1 if killed). */
static inline int test_daemon_stop(test_daemon *d) {
  int status = -1;
  if (d->pid > 0) {
    kill(d->pid, SIGTERM);
    for (int i = 0; i < 1000; i++) {
      if (waitpid(d->pid, &status, WNOHANG) == d->pid)
        break;
      test_sleep_ms(10);
      if (i == 999) {
        kill(d->pid, SIGKILL);
        waitpid(d->pid, &status, 0);
        status = -1;
      }
    }
    d->pid = 0;
  }
  unlink(d->sock);
  unlink(d->log);
  rmdir(d->dir);
  if (status == -1)
    return -1;
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

/* Whether the daemon process is still running. */
static inline int test_daemon_alive(const test_daemon *d) {
  int st;
  return d->pid > 0 && waitpid(d->pid, &st, WNOHANG) == 0;
}

static inline shardd_client_t *test_connect(const test_daemon *d,
                                            const char *job, uint32_t rank,
                                            uint32_t world) {
  shardd_connect_opts o = SHARDD_CONNECT_OPTS_INIT;
  o.job = job;
  o.rank = rank;
  o.world = world;
  shardd_client_t *c = NULL;
  char err[512];
  shardd_err rc = shardd_connect(d->sock, &o, &c, err, sizeof err);
  cr_assert_eq(rc, SHARDD_OK, "connect %s rank %u: %s", job ? job : "(control)",
               rank, err);
  return c;
}

#endif /* SHARDD_TEST_HARNESS_H */
