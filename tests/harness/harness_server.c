/* harness_server.c — the daemon and helpers the transport's system tests
 * share (test_server.c, test_connections.c, test_limits.c,
 * test_backpressure.c, test_uid_isolation.c): one daemon per test, started
 * with the flags each test names, and what they read of it. */
#include <criterion/criterion.h>

#include "harness.h"
#include "server_fixture.h"

void start_default(void) {
  const char *args[] = {"--devices", "3", NULL};
  test_daemon_start(&d, args);
}

/* A libshardd control session must get a status reply now. */
void expect_served(void) {
  shardd_client_t *c = test_connect(&d, NULL, 0, 1);
  char *s = NULL;
  cr_assert_eq(shardd_status_json(c, &s), SHARDD_OK, "%s", shardd_last_error(c));
  tj *j = tj_parse(s);
  cr_assert_not_null(j, "status is not JSON: %s", s);
  tj_free(j);
  shardd_free(s);
  shardd_close(c);
}

tj *shardctl_status(void) {
  char args[256], *out, *err;
  snprintf(args, sizeof args, "--socket %s status --json", d.sock);
  int rc = test_shardctl(NULL, args, &out, &err);
  cr_assert_eq(rc, 0, "shardctl status exited %d: %s", rc, err);
  tj *j = tj_parse(out);
  cr_assert_not_null(j, "shardctl status --json printed no valid JSON: %s", out);
  free(out);
  free(err);
  return j;
}

void start_linger0(void) {
  const char *args[] = {"--job-linger", "0", NULL};
  test_daemon_start(&d, args);
}

void start_one_device(void) {
  const char *args[] = {"--devices", "1", NULL};
  test_daemon_start(&d, args);
}

/* A raw connection from this process; -1 if connect failed. */
int raw_connect(const char *sock) {
  int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  struct sockaddr_un sa = {.sun_family = AF_UNIX};
  size_t n = strlen(sock);
  memcpy(sa.sun_path, sock, n < sizeof sa.sun_path ? n : sizeof sa.sun_path - 1);
  if (fd < 0 || connect(fd, (struct sockaddr *)&sa, sizeof sa) != 0) {
    if (fd >= 0)
      close(fd);
    return -1;
  }
  struct timeval tv = {(time_t)TEST_HANG_S, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  return fd;
}

/* Opens d's socket to every uid, runs fn(socket) in a child (which turns
 * itself into uid 4242 first) and asserts it exited 0; its exit code
 * otherwise names the step that failed. */
void run_as_other_uid(int (*fn)(const char *sock), const char *who) {
  test_daemon_open_to_all(&d);
  pid_t pid = fork();
  cr_assert(pid >= 0);
  if (pid == 0)
    _exit(fn(d.sock));
  test_expect_child_ok(pid, who);
}

/* The daemon's resident memory, KiB (VmRSS). */
long daemon_rss_kib(pid_t pid) {
  char path[64], line[256];
  snprintf(path, sizeof path, "/proc/%d/status", (int)pid);
  FILE *f = fopen(path, "r");
  cr_assert_not_null(f, "%s: %s", path, strerror(errno));
  long kib = -1;
  while (fgets(line, sizeof line, f))
    if (sscanf(line, "VmRSS: %ld kB", &kib) == 1)
      break;
  fclose(f);
  cr_assert_geq(kib, 0, "no VmRSS in %s", path);
  return kib;
}

double status_partial_bytes(void) {
  tj *j = shardctl_status();
  double n = tj_need(j, "partial_frame_bytes", TJ_NUM)->num;
  tj_free(j);
  return n;
}
