/* sdnotify.c — sd_notify(3) and sd_listen_fds(3), the plain protocols.
 * Owns nothing long-lived: every notification opens, uses and closes its own
 * datagram socket, and activation only inspects and flags fds the service
 * manager already passed. Reference: systemd's sd_notify(3),
 * sd_listen_fds(3) and the "notify socket" / "socket activation" protocol
 * documents; only AF_UNIX notify addresses are supported (no vsock). */
#include "sdnotify.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

/* How long one message may wait for room in the manager's queue. */
#define SD_WAIT_MS 1000

/* A message's wait for room ran out, and none was sent since: the manager
 * reads nothing, so no message waits (loop thread only, as every caller). */
static int sd_stalled;

static void set_err(char *err, size_t errlen, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

static void set_err(char *err, size_t errlen, const char *fmt, ...) {
  va_list ap;
  if (err == NULL || errlen == 0)
    return;
  va_start(ap, fmt);
  vsnprintf(err, errlen, fmt, ap);
  va_end(ap);
}

/* NOTIFY_SOCKET is either a filesystem path (absolute) or '@' plus an
 * abstract name. The abstract address is exactly the name's bytes after a
 * NUL: the length, not a terminator, ends it, so it must not include one. */
static shardd_err notify_addr(const char *env, struct sockaddr_un *sa,
                              socklen_t *salen, char *err, size_t errlen) {
  size_t n = strlen(env);

  memset(sa, 0, sizeof *sa);
  sa->sun_family = AF_UNIX;
  if (env[0] == '@') {
    if (n < 2 || n > sizeof sa->sun_path) {
      set_err(err, errlen, "NOTIFY_SOCKET %s: abstract name length %zu "
              "not in 1..%zu", env, n - 1, sizeof sa->sun_path - 1);
      return SHARDD_E_INVAL;
    }
    memcpy(sa->sun_path + 1, env + 1, n - 1);
    *salen = (socklen_t)(offsetof(struct sockaddr_un, sun_path) + n);
    return SHARDD_OK;
  }
  if (env[0] != '/') {
    set_err(err, errlen, "NOTIFY_SOCKET %s: not an absolute path or "
            "@abstract name", env);
    return SHARDD_E_INVAL;
  }
  if (n >= sizeof sa->sun_path) {
    set_err(err, errlen, "NOTIFY_SOCKET %s: path longer than %zu bytes", env,
            sizeof sa->sun_path - 1);
    return SHARDD_E_INVAL;
  }
  memcpy(sa->sun_path, env, n);
  *salen = (socklen_t)(offsetof(struct sockaddr_un, sun_path) + n + 1);
  return SHARDD_OK;
}

shardd_err shardd__sd_notify(const char *state, char *err, size_t errlen) {
  return shardd__sd_notify_fd(state, -1, err, errlen);
}

shardd_err shardd__sd_notify_fd(const char *state, int pass_fd, char *err,
                                size_t errlen) {
  const char *env;
  struct sockaddr_un sa;
  socklen_t salen;
  size_t len;
  ssize_t sent;
  shardd_err rc;
  int fd = -1;

  if (state == NULL) {
    set_err(err, errlen, "sd_notify: state is NULL");
    return SHARDD_E_INVAL;
  }
  env = getenv("NOTIFY_SOCKET");
  if (env == NULL || env[0] == '\0')
    return SHARDD_OK; /* not started by systemd, or not Type=notify */
  rc = notify_addr(env, &sa, &salen, err, errlen);
  if (rc != SHARDD_OK)
    return rc;

  /* CLOEXEC: a child forked while this is open must not keep it. */
  fd = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  if (fd < 0) {
    set_err(err, errlen, "socket for NOTIFY_SOCKET %s: %s", env,
            strerror(errno));
    rc = SHARDD_E_IO;
    goto fail;
  }
  len = strlen(state);
  /* One datagram: systemd reads each message as one unit of assignments, so
   * it is sent whole or not at all. NOSIGNAL keeps a vanished manager from
   * killing the daemon with SIGPIPE. A descriptor rides in the same
   * datagram (the manager pairs FDSTORE=1 with the fds of its message). */
  struct iovec iov = {(void *)state, len};
  union {
    char buf[CMSG_SPACE(sizeof(int))];
    struct cmsghdr align;
  } ctl;
  struct msghdr mh;
  memset(&mh, 0, sizeof mh);
  mh.msg_iov = &iov;
  mh.msg_iovlen = 1;
  if (pass_fd >= 0) {
    memset(&ctl, 0, sizeof ctl);
    mh.msg_control = ctl.buf;
    mh.msg_controllen = sizeof ctl.buf;
    struct cmsghdr *cm = CMSG_FIRSTHDR(&mh);
    cm->cmsg_level = SOL_SOCKET;
    cm->cmsg_type = SCM_RIGHTS;
    cm->cmsg_len = CMSG_LEN(sizeof(int));
    memcpy(CMSG_DATA(cm), &pass_fd, sizeof(int));
  }
  /* Never an unbounded wait: the daemon sends from its loop thread, and a
   * blocking send to a manager whose queue is full (it reads nothing:
   * hung, or stopped in a debugger) stalled every client with it. A full
   * queue is also what a burst meets with a manager that reads (a buffer
   * of many ranks is a FDSTORE=1 message each; systemd reads them as they
   * come): so the message waits for room, SD_WAIT_MS at most, and only
   * while the manager has not been found stalled; once a wait ran out,
   * every message is dropped at once (SHARDD_E_BUSY: the callers log the
   * loss) until one finds room again. The socket is connected so that
   * poll() says when the manager's queue has room. */
  if (connect(fd, (struct sockaddr *)&sa, salen) != 0) {
    set_err(err, errlen, "send to NOTIFY_SOCKET %s: %s", env, strerror(errno));
    rc = SHARDD_E_IO;
    goto fail;
  }
  struct timespec t0, now;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  for (;;) {
    do {
      sent = sendmsg(fd, &mh, MSG_NOSIGNAL | MSG_DONTWAIT);
    } while (sent < 0 && errno == EINTR);
    if (sent >= 0 || (errno != EAGAIN && errno != EWOULDBLOCK))
      break;
    clock_gettime(CLOCK_MONOTONIC, &now);
    long left = SD_WAIT_MS - (long)((now.tv_sec - t0.tv_sec) * 1000 +
                                    (now.tv_nsec - t0.tv_nsec) / 1000000);
    struct pollfd p = {.fd = fd, .events = POLLOUT};
    if (sd_stalled || left <= 0 ||
        (poll(&p, 1, (int)left) == 0)) {
      sd_stalled = 1;
      set_err(err, errlen, "NOTIFY_SOCKET %s: the service manager's queue is "
              "full and it read nothing for %d ms; message dropped", env,
              SD_WAIT_MS);
      rc = SHARDD_E_BUSY;
      goto fail;
    }
  }
  if (sent >= 0)
    sd_stalled = 0;
  if (sent < 0) {
    set_err(err, errlen, "send to NOTIFY_SOCKET %s: %s", env, strerror(errno));
    rc = SHARDD_E_IO;
    goto fail;
  }
  if ((size_t)sent != len) {
    set_err(err, errlen, "send to NOTIFY_SOCKET %s: short datagram "
            "(%zd of %zu bytes)", env, sent, len);
    rc = SHARDD_E_IO;
    goto fail;
  }
  close(fd);
  return SHARDD_OK;

fail:
  if (fd >= 0)
    close(fd);
  return rc;
}

/* Decimal digits only, 0..max: strtol alone would accept blanks, a sign and
 * trailing junk, and "LISTEN_FDS= 2" is as malformed as "two". */
static int parse_count(const char *s, long max, long *out) {
  long v = 0;

  if (s == NULL || *s == '\0')
    return -1;
  for (; *s != '\0'; s++) {
    if (*s < '0' || *s > '9')
      return -1;
    if (v > (max - (*s - '0')) / 10)
      return -1;
    v = v * 10 + (*s - '0');
  }
  *out = v;
  return 0;
}

int shardd__sd_fdname_valid(const char *name) {
  size_t n = 0;
  for (const unsigned char *p = (const unsigned char *)name; *p; p++, n++)
    if (*p < 0x20 || *p >= 0x7f || *p == ':')
      return 0;
  return n >= 1 && n <= 255;
}

int shardd__sd_listen_fds_names(int unset_env, char ***names) {
  const char *e = getenv("LISTEN_FDNAMES");
  char *copy = e ? strdup(e) : NULL;
  int n = shardd__sd_listen_fds(unset_env);
  char **out = NULL;
  if (names)
    *names = NULL;
  if (names && n > 0 && (out = calloc((size_t)n, sizeof *out)) != NULL) {
    char *save = NULL, *tok = copy ? strtok_r(copy, ":", &save) : NULL;
    int ok = 1;
    for (int i = 0; i < n && ok; i++) {
      /* strtok_r folds empty names away; systemd never writes one */
      out[i] = strdup(tok ? tok : "unknown");
      ok = out[i] != NULL;
      tok = tok ? strtok_r(NULL, ":", &save) : NULL;
    }
    if (!ok) {
      for (int i = 0; i < n; i++)
        free(out[i]);
      free(out);
      out = NULL;
    }
    *names = out;
  }
  free(copy);
  return n;
}

int shardd__sd_listen_fds(int unset_env) {
  const char *e;
  long pid, n;
  int r, fd;

  e = getenv("LISTEN_PID");
  if (e == NULL) {
    r = 0;
    goto done;
  }
  if (parse_count(e, (long)0x7fffffff, &pid) < 0 || pid == 0) {
    r = -1;
    goto done;
  }
  /* The variables survive exec; a child that inherited them from us (or a
   * wrapper between systemd and us) is not the one the fds are for. */
  if ((pid_t)pid != getpid()) {
    r = 0;
    goto done;
  }
  e = getenv("LISTEN_FDS");
  if (e == NULL) {
    r = 0;
    goto done;
  }
  if (parse_count(e, (long)0x7fffffff - SHARDD_SD_LISTEN_FDS_START, &n) < 0) {
    r = -1;
    goto done;
  }
  for (fd = SHARDD_SD_LISTEN_FDS_START;
       fd < SHARDD_SD_LISTEN_FDS_START + (int)n; fd++) {
    int flags = fcntl(fd, F_GETFD);
    if (flags < 0) {
      r = -1; /* a count larger than what was really passed */
      goto done;
    }
    if (!(flags & FD_CLOEXEC) && fcntl(fd, F_SETFD, flags | FD_CLOEXEC) < 0) {
      r = -1;
      goto done;
    }
  }
  r = (int)n;

done:
  if (unset_env) {
    unsetenv("LISTEN_PID");
    unsetenv("LISTEN_FDS");
    unsetenv("LISTEN_FDNAMES");
  }
  return r;
}

int shardd__sd_is_unix_listener(int fd) {
  int v;
  socklen_t len;

  if (fd < 0)
    return 0;
  len = sizeof v;
  if (getsockopt(fd, SOL_SOCKET, SO_DOMAIN, &v, &len) < 0 || v != AF_UNIX)
    return 0; /* ENOTSOCK for files, pipes and closed fds */
  len = sizeof v;
  if (getsockopt(fd, SOL_SOCKET, SO_TYPE, &v, &len) < 0 || v != SOCK_STREAM)
    return 0;
  len = sizeof v;
  if (getsockopt(fd, SOL_SOCKET, SO_ACCEPTCONN, &v, &len) < 0 || v == 0)
    return 0;
  return 1;
}
