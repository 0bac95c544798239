/* connection.c — libshardd's connection to the daemon: connect and Hello,
 * the synchronous request/response exchange (the receive loop with its
 * liveness Ping), the last error, close. */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "client_int.h"
#include "poison.h"

void shardd__clear_err(shardd_client_t *c) {
  c->err[0] = '\0';
  free(c->err_long);
  c->err_long = NULL;
}

/* Formatted aside first: an argument may be the last error itself. */
shardd_err shardd__set_err(shardd_client_t *c, shardd_err rc, const char *fmt,
                           ...) {
  char small[sizeof c->err];
  char *big = NULL;
  va_list ap, again;
  va_start(ap, fmt);
  va_copy(again, ap);
  int n = vsnprintf(small, sizeof small, fmt, ap);
  va_end(ap);
  if (n < 0) {
    snprintf(small, sizeof small, "%s (and the message could not be formatted)",
             shardd_strerror(rc));
  } else if ((size_t)n >= sizeof small) {
    big = malloc((size_t)n + 1);
    if (big != NULL) {
      vsnprintf(big, (size_t)n + 1, fmt, again);
    } else { /* say that it is cut rather than cut it silently */
      static const char cut[] = "\n... (message cut: out of memory)";
      memcpy(small + sizeof small - sizeof cut, cut, sizeof cut);
    }
  }
  va_end(again);
  free(c->err_long);
  c->err_long = big;
  memcpy(c->err, small, sizeof small);
  return rc;
}

const char *shardd_last_error(const shardd_client_t *c) {
  if (c == NULL)
    return "no client";
  return c->err_long ? c->err_long : c->err;
}

const char *shardd_version(void) { return SHARDD_VERSION; }

const char *shardd_daemon_version(const shardd_client_t *c) {
  return c ? c->version : "";
}

const char *shardd_daemon_backend(const shardd_client_t *c) {
  return c ? c->backend : "";
}

void shardd_free(void *p) { free(p); }

/* A send found the connection closed. The daemon may have refused it (client
 * limit, oversized frame) and closed it before reading our request; its
 * reason, a seq-0 reply, then still waits in the socket. Returns that code
 * with its message in c->err, else rc unchanged. Never blocks. */
static shardd_err closed_reason(shardd_client_t *c, shardd_err rc) {
  int flags = fcntl(c->fd, F_GETFL);
  if (flags < 0 || fcntl(c->fd, F_SETFL, flags | O_NONBLOCK) < 0)
    return rc;
  const uint8_t *payload;
  size_t len;
  int fds[4], nfds = 0;
  char ignored[128];
  if (shardd__frame_recv(c->fd, &c->rd, &payload, &len, fds, 4, &nfds, ignored,
                         sizeof ignored) == SHARDD_OK) {
    Shardwire__Response *resp = shardwire__response__unpack(NULL, len, payload);
    if (resp && resp->seq == 0 && resp->code != SHARDWIRE__STATUS_CODE__OK) {
      rc = (shardd_err)resp->code;
      shardd__set_err(c, rc, "%s",
                      resp->message ? resp->message : shardd_strerror(rc));
    }
    if (resp)
      shardwire__response__free_unpacked(resp, NULL);
  }
  for (int i = 0; i < nfds; i++)
    close(fds[i]);
  fcntl(c->fd, F_SETFL, flags);
  return rc;
}

/* The daemon's end of the connection is gone (EOF, ECONNRESET, EPIPE):
 * unless a last frame of its own says why (closed_reason), it stopped or
 * died, which the trainer must hear as such -- naming the daemon and what
 * to do -- rather than as the socket layer's "recv: Connection reset by
 * peer". */
static shardd_err daemon_gone(shardd_client_t *c, shardd_err rc) {
  char was[128]; /* the socket layer's few words */
  snprintf(was, sizeof was, "%.100s", c->err);
  rc = closed_reason(c, rc);
  if (rc != SHARDD_E_CLOSED)
    return rc;
  /* the frame layer's words for an end of stream repeat what this says */
  if (strcmp(was, "the daemon closed the connection") == 0)
    snprintf(was, sizeof was, "end of stream");
  return shardd__set_err(c, rc, "daemon at %s closed the connection (%s): it stopped "
                 "or died (a stop or restart, a crash, kill -9, the OOM "
                 "killer); the request's outcome is unknown. Find why in its "
                 "log (journalctl -u shardd), then reconnect once it serves "
                 "again: a daemon restarted with --restore brings the job back "
                 "at the step its log names, and relaunched ranks are told it",
                 c->socket_path, was);
}


static double mono_now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + (double)t.tv_nsec / 1e9;
}

/* c->timeout in ms for the frame layer (-1: none). */
static int timeout_ms(const shardd_client_t *c) {
  if (!(c->timeout > 0))
    return -1;
  return c->timeout >= INT_MAX / 1000 ? INT_MAX : (int)(c->timeout * 1000.0 + 0.5);
}

/* The liveness probe: a Ping sent while a call waits. The daemon answers a
 * session's requests as each completes, not in order, so its Pong comes
 * back while a collective of the session still waits for a slow peer: it
 * proves the daemon alive without failing the collective. Returns its seq,
 * 0 when it could not be sent (the wait goes on; a daemon that is gone
 * shows as the connection closing). */
static uint64_t send_probe(shardd_client_t *c) {
  Shardwire__Request req = SHARDWIRE__REQUEST__INIT;
  Shardwire__Ping ping = SHARDWIRE__PING__INIT;
  req.body_case = SHARDWIRE__REQUEST__BODY_PING;
  req.ping = &ping;
  req.seq = ++c->seq;
  uint8_t buf[64];
  size_t n = shardwire__request__get_packed_size(&req);
  if (n > sizeof buf)
    return 0;
  shardwire__request__pack(&req, buf);
  char why[128];
  /* a tiny frame: a socket buffer with no room for it means the daemon has
   * read nothing for a while, and the wait below decides */
  shardd_err rc = shardd__frame_send_within(c->fd, buf, n, 0, why, sizeof why);
  if (rc == SHARDD_E_TIMEOUT) {
    /* nothing of it was written (a socket write of a few bytes is whole
     * or nothing), so the stream is intact */
    return 0;
  }
  return rc == SHARDD_OK ? req.seq : 0;
}

/* Sends req with the next seq. */
shardd_err shardd__send_req(shardd_client_t *c, Shardwire__Request *req) {
  if (c->fd < 0)
    return shardd__set_err(c, SHARDD_E_CLOSED,
                           "the connection was closed earlier");
  uint8_t *buf;
  size_t n;
  shardd_err rc = shardd__req_pack(c, req, &buf, &n);
  return rc != SHARDD_OK ? rc : shardd__send_packed(c, buf, n);
}

shardd_err shardd__req_pack(shardd_client_t *c, Shardwire__Request *req,
                            uint8_t **buf, size_t *n) {
  *buf = NULL;
  req->seq = ++c->seq;
  *n = shardwire__request__get_packed_size(req);
  if (*n > SHARDD_MAX_FRAME)
    return shardd__set_err(
        c, SHARDD_E_FRAME_TOO_LARGE,
        "request of %zu bytes exceeds the %u-byte frame limit", *n,
        SHARDD_MAX_FRAME);
  if ((*buf = malloc(*n ? *n : 1)) == NULL)
    return shardd__set_err(c, SHARDD_E_NO_MEMORY, "out of memory");
  shardwire__request__pack(req, *buf);
  return SHARDD_OK;
}

shardd_err shardd__send_packed(shardd_client_t *c, uint8_t *buf, size_t n) {
  if (c->fd < 0) {
    free(buf);
    return shardd__set_err(c, SHARDD_E_CLOSED,
                           "the connection was closed earlier");
  }
  shardd_err rc = shardd__frame_send_within(c->fd, buf, n, timeout_ms(c),
                                            c->err, sizeof c->err);
  free(buf);
  if (rc != SHARDD_OK) { /* the reason is the frame layer's, in err */
    free(c->err_long);
    c->err_long = NULL;
  }
  if (rc == SHARDD_E_TIMEOUT) {
    /* part of the frame may be written: the stream cannot go on */
    close(c->fd);
    c->fd = -1;
    return shardd__set_err(
        c, rc,
        "daemon at %s did not answer for %g s: it read "
        "none of a request for that long (stopped or hung?); "
        "the connection is closed",
        c->socket_path, c->timeout);
  }
  if (rc == SHARDD_E_CLOSED)
    rc = daemon_gone(c, rc);
  return rc;
}

/* ---- the batch replies' arena ------------------------------------------ */

struct reply_chunk {
  union {
    struct {
      reply_chunk *next;
      size_t cap, used; /* bytes after the header */
    } s;
    max_align_t align; /* what follows is aligned as malloc's own */
  } h;
};

#define REPLY_CHUNK_MIN ((size_t)64 << 10)
#define REPLY_CHUNK_KEEP ((size_t)4 << 20)

/* Under AddressSanitizer what no live piece holds is poisoned (poison.h):
 * a reply read past its piece or after the reset is reported. */
static void *reply_bytes(reply_chunk *k) { return k + 1; }

static void reply_chunk_free(reply_chunk *k) {
  if (k)
    SHARDD__UNPOISON(reply_bytes(k), k->h.s.cap);
  free(k);
}

static void *reply_alloc(void *data, size_t n) {
  reply_arena *ra = data;
  size_t need = (n + SHARDD__REDZONE + _Alignof(max_align_t) - 1) &
                ~(size_t)(_Alignof(max_align_t) - 1);
  if (need < n)
    return NULL;
  reply_chunk *k = ra->chunks;
  if (k == NULL || need > k->h.s.cap - k->h.s.used) {
    size_t cap = k ? 2 * k->h.s.cap : REPLY_CHUNK_MIN;
    if (cap < need)
      cap = need;
    if (cap > SIZE_MAX - sizeof *k || (k = malloc(sizeof *k + cap)) == NULL)
      return NULL;
    k->h.s.cap = cap;
    k->h.s.used = 0;
    k->h.s.next = ra->chunks;
    ra->chunks = k;
    SHARDD__POISON(reply_bytes(k), cap);
  }
  void *p = (unsigned char *)reply_bytes(k) + k->h.s.used;
  k->h.s.used += need;
  SHARDD__UNPOISON(p, n);
  return p;
}

static void reply_free(void *data, void *p) {
  (void)data; /* taken back with the arena */
  (void)p;
}

void shardd__reply_arena_use(shardd_client_t *c) {
  c->batch_replies.a.alloc = reply_alloc;
  c->batch_replies.a.free = reply_free;
  c->batch_replies.a.allocator_data = &c->batch_replies;
  c->reply_in = &c->batch_replies;
}

/* Keeps the newest chunk (the largest) for the next reply when it is not
 * too large to keep. */
void shardd__reply_arena_reset(shardd_client_t *c) {
  reply_chunk *k = c->batch_replies.chunks;
  if (k == NULL)
    return;
  while (k->h.s.next) {
    reply_chunk *old = k->h.s.next;
    k->h.s.next = old->h.s.next;
    reply_chunk_free(old);
  }
  if (k->h.s.cap > REPLY_CHUNK_KEEP) {
    reply_chunk_free(k);
    k = NULL;
  } else {
    SHARDD__POISON(reply_bytes(k), k->h.s.used);
    k->h.s.used = 0;
  }
  c->batch_replies.chunks = k;
}

void shardd__reply_arena_stop(shardd_client_t *c) { c->reply_in = NULL; }

void shardd__reply_arena_free(shardd_client_t *c) {
  shardd__reply_arena_reset(c);
  reply_chunk_free(c->batch_replies.chunks);
  c->batch_replies.chunks = NULL;
  c->reply_in = NULL;
}

/* Reads responses until the one to seq. Replies to outstanding async
 * requests that arrive first are kept for shardd_wait; others (to requests
 * nobody waits for any more) are dropped, but a pool descriptor any gather
 * reply brings is mapped (shardd__pool_adopt). On SHARDD_OK *out is the
 * response (caller frees with shardwire__response__free_unpacked); a daemon
 * error code, or the reason a gather reply's pool could not be mapped, is
 * returned with its message in c->err and *out still set. A descriptor
 * that came with the reply is returned in *fd (else -1); a gather reply's
 * is the pool's and is never returned. */
/* With many set, the descriptors of the reply to seq (at most maxmany) are
 * returned there in order, counted in *nmany, instead of in *fd. */
shardd_err shardd__recv_for_many(shardd_client_t *c, uint64_t seq,
                                 Shardwire__Response **out, int *fd, int *many,
                                 int maxmany, int *nmany) {
  *out = NULL;
  if (fd)
    *fd = -1;
  if (nmany)
    *nmany = 0;
  int local[4];
  int *fds = many ? many : local;
  int maxfds = many ? maxmany : 4;
  if (c->fd < 0)
    return shardd__set_err(c, SHARDD_E_CLOSED,
                           "the connection was closed earlier");
  /* Liveness: after half the timeout without a frame, a Ping goes out;
   * silence for the whole timeout (the Ping unanswered for at least half
   * of it) fails the call. Any frame restarts the clock, so a collective
   * waiting on a slow peer for as long as --collective-timeout lasts. */
  double heard = mono_now();
  uint64_t probe = 0; /* the Ping's seq while its Pong is awaited */
  int pinged = 0;     /* a Ping went out (or could not) since the last Pong */
  for (;;) {
    const uint8_t *payload;
    size_t len;
    int nfds = 0;
    int wait_ms = -1;
    if (c->timeout > 0) {
      double left = heard + (pinged ? c->timeout : c->timeout / 2) - mono_now();
      wait_ms = left <= 0 ? 0 : left >= INT_MAX / 1000 ? INT_MAX
                                                       : (int)(left * 1000.0) + 1;
    }
    shardd_err rc = shardd__frame_recv_within(c->fd, &c->rd, &payload, &len, fds,
                                              maxfds, &nfds, wait_ms, c->err,
                                              sizeof c->err);
    if (rc == SHARDD_E_TIMEOUT) {
      for (int i = 0; i < nfds; i++)
        close(fds[i]);
      if (!pinged) {
        pinged = 1;
        probe = send_probe(c);
        continue;
      }
      if (mono_now() - heard < c->timeout)
        continue;
      /* the request stays outstanding: a reply that comes later is
       * dropped as one nobody waits for, so the connection stays usable */
      return shardd__set_err(c, SHARDD_E_TIMEOUT,
                             "daemon at %s did not answer for "
                             "%g s (%s: is it stopped or hung?); the request's "
                             "outcome is unknown",
                             c->socket_path, c->timeout,
                             probe ? "a Ping went unanswered too"
                                   : "it did not read a Ping either");
    }
    if (rc != SHARDD_OK) {
      free(c->err_long); /* the reason is the frame layer's, in err */
      c->err_long = NULL;
      /* descriptors of a frame that never completed belong to no reply */
      for (int i = 0; i < nfds; i++)
        close(fds[i]);
      /* An oversized header cannot be skipped: every later read would hit
       * it again, so the connection is given up (mappings stay valid). */
      if (rc == SHARDD_E_FRAME_TOO_LARGE) {
        close(c->fd);
        c->fd = -1;
      }
      return rc == SHARDD_E_CLOSED ? daemon_gone(c, rc) : rc;
    }
    heard = mono_now();
    /* a batch's replies into its arena (shardd__reply_arena_use); an
     * async reply read meanwhile is noted (copied) and freed below */
    ProtobufCAllocator *ra = c->reply_in ? &c->reply_in->a : NULL;
    Shardwire__Response *resp = shardwire__response__unpack(ra, len, payload);
    /* the payload is decoded (copied): the reader gives back what a big
     * reply grew it to, as the daemon's do (a trainer that once got a
     * large status or refusal kept that memory for the connection's life) */
    shardd__frame_reader_trim(&c->rd);
    if (resp == NULL) {
      for (int i = 0; i < nfds; i++)
        close(fds[i]);
      return shardd__set_err(c, SHARDD_E_PROTOCOL,
                             "the daemon's %zu-byte reply could not be decoded",
                             len);
    }
    if (probe != 0 && resp->seq == probe)
      probe = 0, pinged = 0; /* the daemon lives: the next silence pings */
    /* A gather's reply may bring a pool's descriptor, its only one: mapped
     * here for every reply, the one waited for or not. */
    shardd_err pool_rc = SHARDD_OK;
    char why[512] = "";
    if (resp->code == SHARDWIRE__STATUS_CODE__OK &&
        resp->body_case == SHARDWIRE__RESPONSE__BODY_GATHER) {
      pool_rc = shardd__pool_adopt(c, resp->gather, fds, nfds, why,
                                   sizeof why);
      for (int i = 0; i < nfds; i++)
        close(fds[i]);
      nfds = 0;
    }
    /* seq 0 is the daemon speaking about the connection itself. */
    if (resp->seq != seq && resp->seq != 0) {
      shardd__async_reply(c, resp, pool_rc, why);
      for (int i = 0; i < nfds; i++)
        close(fds[i]);
      shardwire__response__free_unpacked(resp, ra);
      continue;
    }
    if (pool_rc != SHARDD_OK) {
      *out = resp;
      return shardd__set_err(c, pool_rc, "%s", why);
    }
    *out = resp;
    rc = (shardd_err)resp->code;
    if (many) {
      if (rc != SHARDD_OK) {
        for (int i = 0; i < nfds; i++)
          close(fds[i]);
        nfds = 0;
      }
      *nmany = nfds;
    } else {
      for (int i = 0; i < nfds; i++) {
        if (fd && *fd < 0 && rc == SHARDD_OK)
          *fd = fds[i];
        else
          close(fds[i]);
      }
    }
    if (rc != SHARDD_OK)
      shardd__set_err(c, rc, "%s",
                      resp->message ? resp->message : shardd_strerror(rc));
    return rc;
  }
}

shardd_err shardd__recv_for(shardd_client_t *c, uint64_t seq,
                            Shardwire__Response **out, int *fd) {
  return shardd__recv_for_many(c, seq, out, fd, NULL, 0, NULL);
}

/* Sends req and waits for the response to it (see shardd__recv_for). */
shardd_err shardd__call(shardd_client_t *c, Shardwire__Request *req,
                        Shardwire__Response **out, int *fd) {
  *out = NULL;
  if (fd)
    *fd = -1;
  shardd__clear_err(
      c); /* the last error is the last failed call's, not older */
  shardd_err rc = shardd__send_req(c, req);
  if (rc != SHARDD_OK)
    return rc;
  return shardd__recv_for(c, req->seq, out, fd);
}

/* A call whose reply body must be of one kind. */
shardd_err shardd__call_expect(shardd_client_t *c, Shardwire__Request *req,
                               Shardwire__Response__BodyCase want,
                               Shardwire__Response **out, int *fd) {
  shardd_err rc = shardd__call(c, req, out, fd);
  if (rc == SHARDD_OK && (*out)->body_case != want) {
    int got = (int)(*out)->body_case;
    shardwire__response__free_unpacked(*out, NULL);
    *out = NULL;
    if (fd && *fd >= 0) {
      close(*fd);
      *fd = -1;
    }
    return shardd__set_err(c, SHARDD_E_PROTOCOL,
                           "the daemon answered with body %d, expected %d", got,
                           (int)want);
  }
  return rc;
}

shardd_err shardd__call_status_only(shardd_client_t *c,
                                    Shardwire__Request *req) {
  Shardwire__Response *resp;
  shardd_err rc = shardd__call(c, req, &resp, NULL);
  if (resp)
    shardwire__response__free_unpacked(resp, NULL);
  return rc;
}

/* The connect error for socket_path, naming what is missing or refused:
 * ENOENT was the same "No such file or directory" for a daemon that is not
 * running and for a socket directory that does not exist. */
static shardd_err connect_error(shardd_client_t *c, const char *socket_path,
                                int e) {
  char dir[sizeof ((struct sockaddr_un *)0)->sun_path];
  snprintf(dir, sizeof dir, "%s", socket_path);
  char *slash = strrchr(dir, '/');
  if (slash == dir)
    slash[1] = '\0';
  else if (slash)
    *slash = '\0';
  else
    snprintf(dir, sizeof dir, ".");
  struct stat st;
  const char *pre = "cannot connect to shardd at";
  if (e == ENOENT && stat(dir, &st) != 0 && (errno == ENOENT || errno == ENOTDIR))
    return shardd__set_err(c, SHARDD_E_CONNECT,
                           "%s %s: directory %s does not exist "
                           "(is shardd installed and started?)",
                           pre, socket_path, dir);
  if (e == ENOENT)
    return shardd__set_err(c, SHARDD_E_CONNECT,
                           "%s %s: no socket there (is shardd "
                           "running? --socket or SHARDD_SOCKET name another)",
                           pre, socket_path);
  if (e == EACCES)
    return shardd__set_err(
        c, SHARDD_E_CONNECT,
        "%s %s: permission denied (this user "
        "may not open the socket or search %s; the packaged socket "
        "is for group shardd)",
        pre, socket_path, dir);
  if (e == ECONNREFUSED)
    return shardd__set_err(c, SHARDD_E_CONNECT,
                           "%s %s: connection refused (a socket "
                           "file no daemon listens on)",
                           pre, socket_path);
  return shardd__set_err(c, SHARDD_E_CONNECT, "%s %s: %s", pre, socket_path,
                         strerror(e));
}

/* c->timeout from opts (when the caller's struct reaches the field), else
 * $SHARDD_TIMEOUT, else the default. */
static shardd_err pick_timeout(shardd_client_t *c,
                               const shardd_connect_opts *opts) {
  c->timeout = SHARDD_DEFAULT_TIMEOUT;
  if (opts && opts->size >= offsetof(shardd_connect_opts, timeout_s) +
                                sizeof opts->timeout_s &&
      opts->timeout_s != 0) {
    if (isnan(opts->timeout_s))
      return shardd__set_err(c, SHARDD_E_INVAL, "timeout_s is NaN");
    c->timeout = opts->timeout_s;
    return SHARDD_OK;
  }
  const char *env = getenv("SHARDD_TIMEOUT");
  if (env && env[0]) {
    char *end;
    errno = 0;
    double v = strtod(env, &end);
    if (errno != 0 || *end != '\0' || end == env || isnan(v) || v < 0)
      return shardd__set_err(c, SHARDD_E_INVAL,
                             "SHARDD_TIMEOUT=%s is not a number of "
                             "seconds (0: no timeout)",
                             env);
    c->timeout = v == 0 ? -1 : v;
  }
  return SHARDD_OK;
}

shardd_err shardd_connect(const char *socket_path,
                          const shardd_connect_opts *opts,
                          shardd_client_t **out, char *errbuf, size_t errlen) {
  if (out == NULL) {
    if (errbuf && errlen)
      snprintf(errbuf, errlen, "shardd_connect: out is NULL");
    return SHARDD_E_INVAL;
  }
  *out = NULL;
  if (socket_path == NULL || socket_path[0] == '\0') {
    socket_path = getenv("SHARDD_SOCKET");
    if (socket_path == NULL || socket_path[0] == '\0')
      socket_path = SHARDD_DEFAULT_SOCKET;
  }
  shardd_client_t *c = calloc(1, sizeof *c);
  if (c == NULL) {
    if (errbuf)
      snprintf(errbuf, errlen, "out of memory");
    return SHARDD_E_NO_MEMORY;
  }
  c->fd = -1; /* calloc's 0 is stdin, which the failure path would close */
  shardd__frame_reader_init(&c->rd, SHARDD_MAX_FRAME);
  struct sockaddr_un sa = {.sun_family = AF_UNIX};
  shardd_err rc;
  if (strlen(socket_path) >= sizeof sa.sun_path) {
    rc = shardd__set_err(c, SHARDD_E_INVAL, "socket path %s is too long",
                         socket_path);
    goto fail;
  }
  snprintf(sa.sun_path, sizeof sa.sun_path, "%s", socket_path);
  snprintf(c->socket_path, sizeof c->socket_path, "%s", socket_path);
  rc = pick_timeout(c, opts);
  if (rc != SHARDD_OK)
    goto fail;
  c->fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (c->fd < 0) {
    rc = shardd__set_err(c, SHARDD_E_IO, "socket: %s", strerror(errno));
    goto fail;
  }
  if (connect(c->fd, (struct sockaddr *)&sa, sizeof sa) != 0) {
    rc = connect_error(c, socket_path, errno);
    goto fail;
  }

  Shardwire__Request req = SHARDWIRE__REQUEST__INIT;
  Shardwire__Hello hello = SHARDWIRE__HELLO__INIT;
  hello.protocol_version = SHARDD_PROTOCOL_VERSION;
  if (opts && opts->job && opts->job[0]) {
    hello.job = (char *)opts->job;
    hello.has_rank = 1;
    hello.rank = opts->rank;
    hello.has_world = 1;
    hello.world = opts->world;
  }
  if (opts && opts->client_name)
    hello.client_name = (char *)opts->client_name;
  /* Read only when the caller's struct reaches it: one built against an
   * older header ends before, and what lies there is not ours. Sent only
   * when asked, so a plain Hello stays what older daemons know. */
  if (opts && opts->size >= offsetof(shardd_connect_opts, transient_areas) +
                                sizeof opts->transient_areas &&
      opts->transient_areas) {
    hello.has_transient_areas = 1;
    hello.transient_areas = 1;
  }
  /* a batch's blocks may then come in one memfd per rank (a slab) */
  hello.has_blocks_at_offsets = 1;
  hello.blocks_at_offsets = 1;
  req.body_case = SHARDWIRE__REQUEST__BODY_HELLO;
  req.hello = &hello;
  Shardwire__Response *resp;
  rc = shardd__call_expect(c, &req, SHARDWIRE__RESPONSE__BODY_HELLO, &resp,
                           NULL);
  if (rc != SHARDD_OK) {
    if (resp)
      shardwire__response__free_unpacked(resp, NULL);
    goto fail;
  }
  /* A daemon of another protocol may read these messages differently:
   * refusing here beats a wrong answer later. */
  if (resp->hello->protocol_version != SHARDD_PROTOCOL_VERSION) {
    rc = shardd__set_err(
        c, SHARDD_E_VERSION,
        "protocol version mismatch: the daemon at %s (shardd %s) "
        "speaks protocol %" PRIu32 ", this client (libshardd %s) "
        "speaks protocol %d; use a libshardd of the daemon's version",
        socket_path, resp->hello->daemon_version, resp->hello->protocol_version,
        SHARDD_VERSION, SHARDD_PROTOCOL_VERSION);
    shardwire__response__free_unpacked(resp, NULL);
    goto fail;
  }
  c->max_async = opts && opts->size >= offsetof(shardd_connect_opts, max_inflight_gathers) +
                                        sizeof opts->max_inflight_gathers &&
                          opts->max_inflight_gathers
                      ? opts->max_inflight_gathers
                      : 2;
  snprintf(c->version, sizeof c->version, "%s", resp->hello->daemon_version);
  snprintf(c->backend, sizeof c->backend, "%s", resp->hello->backend);
  c->bucket_max = SHARDD_BUCKET_PER_REQUEST;
  if (resp->hello->has_max_pending && resp->hello->max_pending > 0 &&
      resp->hello->max_pending < c->bucket_max)
    c->bucket_max = resp->hello->max_pending;
  c->resumed = resp->hello->has_resumed && resp->hello->resumed;
  c->resumed_step = resp->hello->resumed_step;
  shardwire__response__free_unpacked(resp, NULL);
  shardd__clear_err(c);
  *out = c;
  return SHARDD_OK;

fail:
  if (errbuf)
    snprintf(errbuf, errlen, "%s", shardd_last_error(c));
  if (c->fd >= 0)
    close(c->fd);
  shardd__frame_reader_free(&c->rd);
  free(c->err_long);
  free(c);
  return rc;
}

void shardd_set_timeout(shardd_client_t *c, double timeout_s) {
  if (c == NULL || isnan(timeout_s))
    return;
  c->timeout = timeout_s == 0 ? SHARDD_DEFAULT_TIMEOUT : timeout_s;
}

void shardd_close(shardd_client_t *c) {
  if (c == NULL)
    return;
  shardd__async_free(c);
  shardd__mappings_free(c);
  shardd__reply_arena_free(c);
  if (c->fd >= 0)
    close(c->fd);
  shardd__frame_reader_free(&c->rd);
  free(c->err_long);
  free(c);
}

shardd_err shardd_finish(shardd_client_t *c) {
  if (c == NULL)
    return SHARDD_OK;
  Shardwire__Request req = SHARDWIRE__REQUEST__INIT;
  Shardwire__Goodbye bye = SHARDWIRE__GOODBYE__INIT;
  req.body_case = SHARDWIRE__REQUEST__BODY_GOODBYE;
  req.goodbye = &bye;
  /* answered: the daemon has read it before the close it precedes */
  shardd_err rc = shardd__call_status_only(c, &req);
  shardd_close(c);
  return rc;
}

int shardd_resumed(const shardd_client_t *c, uint64_t *step) {
  if (step)
    *step = c && c->resumed ? c->resumed_step : 0;
  return c != NULL && c->resumed;
}

shardd_err shardd_ping(shardd_client_t *c) {
  if (c == NULL)
    return SHARDD_E_INVAL; /* no client to hold a message */

  Shardwire__Request req = SHARDWIRE__REQUEST__INIT;
  Shardwire__Ping ping = SHARDWIRE__PING__INIT;
  req.body_case = SHARDWIRE__REQUEST__BODY_PING;
  req.ping = &ping;
  return shardd__call_status_only(c, &req);
}
