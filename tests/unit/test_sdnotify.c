/* test_sdnotify.c — suite sdnotify: the notify datagram as a real receiver
 * sees it (filesystem and abstract addresses, and the failure reasons), and
 * socket-activation parsing. Criterion runs each test in its own process, so
 * setenv() here does not leak between tests; tests that need fds at 3.. run
 * in a forked child, because the worker's own fds may sit there. */
#include <criterion/criterion.h>
#include <criterion/parameterized.h>

#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "sdnotify.h"

static char tmpdir[64];
static char sockpath[128];
static int rx = -1;

static void fixture_init(void) {
  strcpy(tmpdir, "/tmp/shardd-sdnotify-XXXXXX");
  cr_assert_not_null(mkdtemp(tmpdir), "mkdtemp: %s", strerror(errno));
  snprintf(sockpath, sizeof sockpath, "%s/notify", tmpdir);
  unsetenv("NOTIFY_SOCKET");
}

static void fixture_fini(void) {
  if (rx >= 0)
    close(rx);
  rx = -1;
  unlink(sockpath);
  rmdir(tmpdir);
}

/* A receiver like systemd's: a bound datagram socket. addrlen is computed
 * here, independently of the code under test. */
static int bind_dgram(const char *name, int abstract) {
  struct sockaddr_un sa;
  socklen_t len;
  int fd = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);

  cr_assert_geq(fd, 0, "socket: %s", strerror(errno));
  memset(&sa, 0, sizeof sa);
  sa.sun_family = AF_UNIX;
  if (abstract) {
    memcpy(sa.sun_path + 1, name, strlen(name));
    len = (socklen_t)(offsetof(struct sockaddr_un, sun_path) + 1 + strlen(name));
  } else {
    strcpy(sa.sun_path, name);
    len = (socklen_t)sizeof sa;
  }
  cr_assert_eq(bind(fd, (struct sockaddr *)&sa, len), 0, "bind %s: %s", name,
               strerror(errno));
  return fd;
}

/* Receives one datagram (waits at most 2 s) into buf; returns its length. */
static ssize_t recv_one(int fd, char *buf, size_t cap) {
  struct pollfd p = {.fd = fd, .events = POLLIN};
  cr_assert_eq(poll(&p, 1, 2000), 1, "no datagram arrived");
  return recv(fd, buf, cap, MSG_DONTWAIT);
}

static void assert_nothing_more(int fd) {
  char c;
  ssize_t n = recv(fd, &c, 1, MSG_DONTWAIT);
  cr_assert(n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK),
            "more than one datagram was sent");
}

TestSuite(sdnotify, .init = fixture_init, .fini = fixture_fini);

Test(sdnotify, path_receives_exact_bytes) {
  static const char msg[] = "READY=1\nSTATUS=serving";
  char buf[256];
  char err[256] = "";
  ssize_t n;

  rx = bind_dgram(sockpath, 0);
  cr_assert_eq(setenv("NOTIFY_SOCKET", sockpath, 1), 0);
  cr_assert_eq(shardd__sd_notify(msg, err, sizeof err), SHARDD_OK, "%s", err);
  n = recv_one(rx, buf, sizeof buf);
  cr_assert_eq(n, (ssize_t)(sizeof msg - 1));
  cr_assert_eq(memcmp(buf, msg, sizeof msg - 1), 0);
  assert_nothing_more(rx);
  cr_assert_str_eq(getenv("NOTIFY_SOCKET"), sockpath, "env must be kept");
}

Test(sdnotify, abstract_namespace) {
  static const char msg[] = "STOPPING=1";
  char name[96];
  char env[100];
  char buf[64];
  char err[256] = "";
  ssize_t n;

  /* The pid and the temp dir's random suffix keep parallel runs apart. */
  snprintf(name, sizeof name, "shardd-test-%ld-%s", (long)getpid(),
           tmpdir + strlen("/tmp/shardd-sdnotify-"));
  snprintf(env, sizeof env, "@%s", name);
  rx = bind_dgram(name, 1);
  cr_assert_eq(setenv("NOTIFY_SOCKET", env, 1), 0);
  cr_assert_eq(shardd__sd_notify(msg, err, sizeof err), SHARDD_OK, "%s", err);
  n = recv_one(rx, buf, sizeof buf);
  cr_assert_eq(n, (ssize_t)(sizeof msg - 1));
  cr_assert_eq(memcmp(buf, msg, sizeof msg - 1), 0);
  assert_nothing_more(rx);
}

Test(sdnotify, unset_is_noop) {
  char err[32] = "untouched";
  cr_assert_eq(shardd__sd_notify("READY=1", err, sizeof err), SHARDD_OK);
  cr_assert_str_eq(err, "untouched");
  cr_assert_eq(setenv("NOTIFY_SOCKET", "", 1), 0);
  cr_assert_eq(shardd__sd_notify("READY=1", err, sizeof err), SHARDD_OK);
  cr_assert_str_eq(err, "untouched");
  /* NULL err is allowed everywhere. */
  cr_assert_eq(shardd__sd_notify("READY=1", NULL, 0), SHARDD_OK);
}

Test(sdnotify, missing_socket_is_io_error_naming_path) {
  char err[512] = "";
  cr_assert_eq(setenv("NOTIFY_SOCKET", sockpath, 1), 0); /* never bound */
  cr_assert_eq(shardd__sd_notify("READY=1", err, sizeof err), SHARDD_E_IO);
  cr_assert_not_null(strstr(err, sockpath), "err: %s", err);
  cr_assert_not_null(strstr(err, strerror(ENOENT)), "err: %s", err);
  cr_assert_eq(shardd__sd_notify("READY=1", NULL, 0), SHARDD_E_IO);
}

Test(sdnotify, closed_receiver_is_io_error) {
  char err[512] = "";
  rx = bind_dgram(sockpath, 0);
  close(rx); /* the file stays; nobody reads it */
  rx = -1;
  cr_assert_eq(setenv("NOTIFY_SOCKET", sockpath, 1), 0);
  cr_assert_eq(shardd__sd_notify("READY=1", err, sizeof err), SHARDD_E_IO);
  cr_assert_not_null(strstr(err, sockpath), "err: %s", err);
  cr_assert_not_null(strstr(err, strerror(ECONNREFUSED)), "err: %s", err);
}

Test(sdnotify, err_is_truncated_to_errlen) {
  char err[8];
  memset(err, 'x', sizeof err);
  cr_assert_eq(setenv("NOTIFY_SOCKET", sockpath, 1), 0);
  cr_assert_eq(shardd__sd_notify("READY=1", err, 4), SHARDD_E_IO);
  cr_assert_eq(strlen(err), 3);
  cr_assert_eq(err[4], 'x', "wrote past errlen");
}

Test(sdnotify, null_state_is_inval) {
  cr_assert_eq(shardd__sd_notify(NULL, NULL, 0), SHARDD_E_INVAL);
}

/* Criterion runs each parameter in a re-executed worker, where pointers
 * into this process's data are meaningless; parameters are copied by value,
 * so strings travel inside the struct. */
struct str_param {
  char s[160];
};

#define A32 "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa"

/* Addresses that cannot name an AF_UNIX socket. */
ParameterizedTestParameters(sdnotify, bad_address) {
  static struct str_param bad[] = {
      {"relative/path"},
      {"@"},
      {"vsock:2:1234"}, /* systemd's vsock form, not supported here */
      /* 108 bytes: no room for the NUL in sun_path[108] */
      {"/" A32 A32 A32 "aaaaaaaaaaa"},
      /* '@' plus 108: one more than sun_path holds after its leading NUL */
      {"@" A32 A32 A32 "aaaaaaaaaaaa"},
  };
  return cr_make_param_array(struct str_param, bad, sizeof bad / sizeof bad[0]);
}

ParameterizedTest(struct str_param *addr, sdnotify, bad_address) {
  char err[512] = "";
  cr_assert_eq(setenv("NOTIFY_SOCKET", addr->s, 1), 0);
  cr_assert_eq(shardd__sd_notify("READY=1", err, sizeof err), SHARDD_E_INVAL);
  cr_assert_not_null(strstr(err, "NOTIFY_SOCKET"), "err: %s", err);
}

/* ---- socket activation ---- */

static void set_pid(long pid) {
  char s[32];
  snprintf(s, sizeof s, "%ld", pid);
  cr_assert_eq(setenv("LISTEN_PID", s, 1), 0);
}

static void assert_env_gone(void) {
  cr_assert_null(getenv("LISTEN_PID"));
  cr_assert_null(getenv("LISTEN_FDS"));
  cr_assert_null(getenv("LISTEN_FDNAMES"));
}

Test(sdnotify, listen_unset_is_zero) {
  unsetenv("LISTEN_PID");
  unsetenv("LISTEN_FDS");
  cr_assert_eq(shardd__sd_listen_fds(0), 0);
}

Test(sdnotify, listen_wrong_pid_is_zero) {
  /* Meant for another process; even fd counts that would be invalid here
   * are not looked at. */
  set_pid((long)getpid() + 1);
  cr_assert_eq(setenv("LISTEN_FDS", "100000", 1), 0);
  cr_assert_eq(shardd__sd_listen_fds(0), 0);
  cr_assert_not_null(getenv("LISTEN_PID"), "kept without unset_env");
  cr_assert_eq(setenv("LISTEN_FDNAMES", "shardd.socket", 1), 0);
  cr_assert_eq(shardd__sd_listen_fds(1), 0);
  assert_env_gone();
}

Test(sdnotify, listen_zero_fds) {
  set_pid((long)getpid());
  cr_assert_eq(setenv("LISTEN_FDS", "0", 1), 0);
  cr_assert_eq(shardd__sd_listen_fds(1), 0);
  assert_env_gone();
}

ParameterizedTestParameters(sdnotify, listen_fds_malformed) {
  static struct str_param bad[] = {{""}, {"two"}, {"-1"}, {"+1"}, {" 1"},
                                   {"1 "}, {"1x"}, {"0x1"},
                                   {"99999999999999999999"}, {"2147483647"}};
  return cr_make_param_array(struct str_param, bad, sizeof bad / sizeof bad[0]);
}

ParameterizedTest(struct str_param *fds, sdnotify, listen_fds_malformed) {
  set_pid((long)getpid());
  cr_assert_eq(setenv("LISTEN_FDS", fds->s, 1), 0);
  cr_assert_eq(shardd__sd_listen_fds(1), -1, "LISTEN_FDS=\"%s\"", fds->s);
  assert_env_gone(); /* unset whatever the result */
}

ParameterizedTestParameters(sdnotify, listen_pid_malformed) {
  static struct str_param bad[] = {{""},  {"0"},   {"abc"},
                                   {"-5"}, {"12a"}, {"99999999999"}};
  return cr_make_param_array(struct str_param, bad, sizeof bad / sizeof bad[0]);
}

ParameterizedTest(struct str_param *pid, sdnotify, listen_pid_malformed) {
  cr_assert_eq(setenv("LISTEN_PID", pid->s, 1), 0);
  cr_assert_eq(setenv("LISTEN_FDS", "1", 1), 0);
  cr_assert_eq(shardd__sd_listen_fds(0), -1, "LISTEN_PID=\"%s\"", pid->s);
}

static int unix_listener(const char *path) {
  struct sockaddr_un sa;
  int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0)
    return -1;
  memset(&sa, 0, sizeof sa);
  sa.sun_family = AF_UNIX;
  strcpy(sa.sun_path, path);
  if (bind(fd, (struct sockaddr *)&sa, sizeof sa) < 0 || listen(fd, 4) < 0) {
    close(fd);
    return -1;
  }
  return fd;
}

/* What systemd does before exec: the passed sockets at 3.. without
 * FD_CLOEXEC (dup2 clears it), LISTEN_PID = the new process. Runs in a child
 * because 3 and 4 may be the Criterion worker's own fds; the child reports
 * the first failed check as its exit status and never returns into
 * Criterion. */
static void activation_child(const char *path) {
  int l = unix_listener(path);
  int d = socket(AF_UNIX, SOCK_DGRAM, 0);
  char s[32];

  if (l < 0 || d < 0)
    _exit(10);
  if (dup2(l, 3) != 3 || dup2(d, 4) != 4)
    _exit(11);
  if (l != 3 && l != 4)
    close(l);
  if (d != 3 && d != 4)
    close(d);
  if (fcntl(3, F_GETFD) & FD_CLOEXEC || fcntl(4, F_GETFD) & FD_CLOEXEC)
    _exit(12);
  snprintf(s, sizeof s, "%ld", (long)getpid());
  setenv("LISTEN_PID", s, 1);
  setenv("LISTEN_FDS", "2", 1);
  setenv("LISTEN_FDNAMES", "shardd.socket:other", 1);
  if (shardd__sd_listen_fds(1) != 2)
    _exit(13);
  if (getenv("LISTEN_PID") || getenv("LISTEN_FDS") || getenv("LISTEN_FDNAMES"))
    _exit(14);
  if (!(fcntl(3, F_GETFD) & FD_CLOEXEC) || !(fcntl(4, F_GETFD) & FD_CLOEXEC))
    _exit(15);
  if (shardd__sd_is_unix_listener(3) != 1 || shardd__sd_is_unix_listener(4))
    _exit(16);
  /* A count beyond what was passed names a closed fd. */
  close(5);
  setenv("LISTEN_PID", s, 1);
  setenv("LISTEN_FDS", "3", 1);
  if (shardd__sd_listen_fds(0) != -1)
    _exit(17);
  _exit(0);
}

Test(sdnotify, listen_valid_fds) {
  char path[160];
  int status;
  pid_t pid;

  snprintf(path, sizeof path, "%s/listen", tmpdir);
  pid = fork();
  cr_assert_geq(pid, 0, "fork: %s", strerror(errno));
  if (pid == 0)
    activation_child(path);
  cr_assert_eq(waitpid(pid, &status, 0), pid);
  unlink(path);
  cr_assert(WIFEXITED(status), "child died (status 0x%x)", status);
  cr_assert_eq(WEXITSTATUS(status), 0,
               "activation check %d failed (see activation_child)",
               WEXITSTATUS(status));
}

/* ---- is_unix_listener ---- */

Test(sdnotify, unix_listener_true) {
  int fd = unix_listener(sockpath);
  cr_assert_geq(fd, 0, "listener: %s", strerror(errno));
  cr_assert_eq(shardd__sd_is_unix_listener(fd), 1);
  close(fd);
}

Test(sdnotify, unix_listener_false) {
  struct sockaddr_un sa;
  struct sockaddr_in in;
  int p[2];
  int fd;

  cr_assert_eq(shardd__sd_is_unix_listener(-1), 0);

  /* Bound but not listening. */
  fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  cr_assert_geq(fd, 0);
  memset(&sa, 0, sizeof sa);
  sa.sun_family = AF_UNIX;
  strcpy(sa.sun_path, sockpath);
  cr_assert_eq(bind(fd, (struct sockaddr *)&sa, sizeof sa), 0);
  cr_assert_eq(shardd__sd_is_unix_listener(fd), 0);
  close(fd);

  /* Datagram. */
  fd = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  cr_assert_geq(fd, 0);
  cr_assert_eq(shardd__sd_is_unix_listener(fd), 0);
  close(fd);

  /* A pipe is not a socket at all. */
  cr_assert_eq(pipe(p), 0);
  cr_assert_eq(shardd__sd_is_unix_listener(p[0]), 0);
  close(p[0]);
  close(p[1]);
  cr_assert_eq(shardd__sd_is_unix_listener(p[0]), 0, "closed fd");

  /* Listening, but TCP. Loopback may be missing in odd sandboxes; the check
   * only runs where the listener could be made. */
  fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd >= 0) {
    memset(&in, 0, sizeof in);
    in.sin_family = AF_INET;
    in.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (bind(fd, (struct sockaddr *)&in, sizeof in) == 0 && listen(fd, 1) == 0)
      cr_assert_eq(shardd__sd_is_unix_listener(fd), 0);
    close(fd);
  }
}

/* ---- the file descriptor store ---- */

/* FDSTORE=1 carries the fd in the same datagram (SCM_RIGHTS), as systemd
 * reads it: the receiver gets the bytes and a descriptor of the same
 * file. */
Test(sdnotify, fdstore_datagram_carries_the_fd) {
  static const char msg[] = "FDSTORE=1\nFDNAME=shardd-r1";
  char buf[256], err[256] = "";
  union {
    char b[CMSG_SPACE(sizeof(int))];
    struct cmsghdr align;
  } ctl;
  struct iovec iov = {buf, sizeof buf};
  struct msghdr mh;
  struct stat a, b;
  int mfd, got = -1;

  rx = bind_dgram(sockpath, 0);
  cr_assert_eq(setenv("NOTIFY_SOCKET", sockpath, 1), 0);
  mfd = memfd_create("sdnotify-test", MFD_CLOEXEC);
  cr_assert_geq(mfd, 0, "memfd_create: %s", strerror(errno));
  cr_assert_eq(shardd__sd_notify_fd(msg, mfd, err, sizeof err), SHARDD_OK,
               "%s", err);
  memset(&mh, 0, sizeof mh);
  mh.msg_iov = &iov;
  mh.msg_iovlen = 1;
  mh.msg_control = ctl.b;
  mh.msg_controllen = sizeof ctl.b;
  ssize_t n = recvmsg(rx, &mh, MSG_CMSG_CLOEXEC | MSG_DONTWAIT);
  cr_assert_eq(n, (ssize_t)(sizeof msg - 1), "datagram: %zd", n);
  cr_assert_eq(memcmp(buf, msg, sizeof msg - 1), 0);
  for (struct cmsghdr *cm = CMSG_FIRSTHDR(&mh); cm; cm = CMSG_NXTHDR(&mh, cm))
    if (cm->cmsg_level == SOL_SOCKET && cm->cmsg_type == SCM_RIGHTS)
      memcpy(&got, CMSG_DATA(cm), sizeof got);
  cr_assert_geq(got, 0, "no descriptor came with the datagram");
  cr_assert_eq(fstat(mfd, &a), 0);
  cr_assert_eq(fstat(got, &b), 0);
  cr_assert(a.st_ino == b.st_ino && a.st_dev == b.st_dev,
            "the descriptor is not of the file sent");
  close(got);
  close(mfd);
  assert_nothing_more(rx);
}

Test(sdnotify, fdstore_without_notify_socket_sends_nothing) {
  char err[64] = "";
  unsetenv("NOTIFY_SOCKET");
  cr_assert_eq(shardd__sd_notify_fd("FDSTORE=1\nFDNAME=x", 0, err, sizeof err),
               SHARDD_OK);
}

Test(sdnotify, fdname_rules) {
  char longest[257];
  memset(longest, 'a', 255);
  longest[255] = '\0';
  cr_assert(shardd__sd_fdname_valid("shardd-r1a2b-3"));
  cr_assert(shardd__sd_fdname_valid(longest));
  longest[255] = 'a';
  longest[256] = '\0';
  cr_assert_not(shardd__sd_fdname_valid(longest), "256 bytes");
  cr_assert_not(shardd__sd_fdname_valid(""));
  cr_assert_not(shardd__sd_fdname_valid("a:b"), "':' separates LISTEN_FDNAMES");
  cr_assert_not(shardd__sd_fdname_valid("a\nb"));
}

/* The names come back in LISTEN_FDNAMES' order, read before the
 * variables are unset; one missing reads "unknown". In a child: fds at
 * 3.. (see activation_child). */
static void names_child(void) {
  char s[32], **names = NULL;
  for (int fd = 3; fd < 6; fd++) {
    int m = memfd_create("names", 0);
    if (m < 0 || (m != fd && dup2(m, fd) != fd))
      _exit(10);
    if (m != fd)
      close(m);
  }
  snprintf(s, sizeof s, "%ld", (long)getpid());
  setenv("LISTEN_PID", s, 1);
  setenv("LISTEN_FDS", "3", 1);
  setenv("LISTEN_FDNAMES", "shardd.socket:shardd-m1-j", 1);
  if (shardd__sd_listen_fds_names(1, &names) != 3 || names == NULL)
    _exit(11);
  if (strcmp(names[0], "shardd.socket") || strcmp(names[1], "shardd-m1-j") ||
      strcmp(names[2], "unknown"))
    _exit(12);
  if (getenv("LISTEN_FDNAMES"))
    _exit(13);
  for (int i = 0; i < 3; i++)
    free(names[i]);
  free(names);
  _exit(0);
}

Test(sdnotify, listen_fds_names) {
  int status;
  pid_t pid = fork();
  cr_assert_geq(pid, 0, "fork: %s", strerror(errno));
  if (pid == 0)
    names_child();
  cr_assert_eq(waitpid(pid, &status, 0), pid);
  cr_assert(WIFEXITED(status), "child died (status 0x%x)", status);
  cr_assert_eq(WEXITSTATUS(status), 0, "names check %d failed (see names_child)",
               WEXITSTATUS(status));
}

/* A manager that reads nothing: its queue fills, the next message waits
 * 1 s for room, and every later one is dropped at once as E_BUSY naming
 * the socket (the send used to wait for room, on the daemon's loop
 * thread, forever). Plain messages and FDSTORE=1 ones alike. */
Test(sdnotify, a_manager_that_reads_nothing_costs_one_wait_then_drops,
     .timeout = 10) {
  char err[256] = "";
  rx = bind_dgram(sockpath, 0);
  cr_assert_eq(setenv("NOTIFY_SOCKET", sockpath, 1), 0);
  int mfd = memfd_create("sdnotify-test", MFD_CLOEXEC);
  cr_assert_geq(mfd, 0);
  struct timespec t0, t1;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  int busy = 0;
  for (int i = 0; i < 1000 && busy < 20; i++) {
    shardd_err rc = i % 2 ? shardd__sd_notify("STATUS=serving", err, sizeof err)
                          : shardd__sd_notify_fd("FDSTORE=1\nFDNAME=r", mfd, err,
                                                 sizeof err);
    cr_assert(rc == SHARDD_OK || rc == SHARDD_E_BUSY, "message %d: %s (%s)", i,
              shardd_err_name(rc), err);
    if (rc == SHARDD_E_BUSY) {
      busy++;
      cr_assert(strstr(err, sockpath) && strstr(err, "full"), "%s", err);
    }
  }
  clock_gettime(CLOCK_MONOTONIC, &t1);
  double s = (double)(t1.tv_sec - t0.tv_sec) + (double)(t1.tv_nsec - t0.tv_nsec) / 1e9;
  cr_assert_eq(busy, 20, "the queue never filled");
  cr_assert(s >= 0.9 && s < 3.0, "20 messages dropped in %.2f s: one wait of 1 s "
            "expected, not one each", s);
  close(mfd);
}

/* A manager that reads, every 10 ms as a busy one might, and a burst of
 * messages far past its queue (a buffer of many ranks is a FDSTORE=1
 * message each): none is dropped, each waits its turn. */
static void *slow_reader(void *arg) {
  int *got = arg;
  char buf[256];
  while (*got < 200) {
    struct pollfd p = {.fd = rx, .events = POLLIN};
    if (poll(&p, 1, 5000) != 1)
      break;
    usleep(10000);
    while (recv(rx, buf, sizeof buf, MSG_DONTWAIT) > 0)
      ++*got;
  }
  return NULL;
}

Test(sdnotify, a_burst_to_a_manager_that_reads_loses_nothing, .timeout = 30) {
  char err[256] = "";
  int got = 0;
  pthread_t th;
  rx = bind_dgram(sockpath, 0);
  cr_assert_eq(setenv("NOTIFY_SOCKET", sockpath, 1), 0);
  int mfd = memfd_create("sdnotify-test", MFD_CLOEXEC);
  cr_assert_geq(mfd, 0);
  cr_assert_eq(pthread_create(&th, NULL, slow_reader, &got), 0);
  for (int i = 0; i < 200; i++)
    cr_assert_eq(shardd__sd_notify_fd("FDSTORE=1\nFDNAME=r", mfd, err, sizeof err),
                 SHARDD_OK, "message %d: %s", i, err);
  pthread_join(th, NULL);
  cr_assert_eq(got, 200, "the manager read %d of 200", got);
  close(mfd);
}
