/* server.c — the transport of shardd: accept, sessions, writes with
 * backpressure, connection limits and deadlines, the periodic tick and
 * the signals (see server.h; reads.c reads the frames, framebudget.c
 * bounds what partial ones hold). */
#include "server.h"

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <inttypes.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "access.h"
#include "server_int.h"
#include "log.h"

#define TICK_MS 100

double shardd__server_now(const shardd__server *srv) {
  return (double)uv_now(srv->loop) / 1000.0;
}

/* ---- writes ----------------------------------------------------------- */

/* A frame sent as several writes (one per descriptor) shares its bytes:
 * the last write to finish, or to be cancelled, frees them. */
typedef struct {
  char *buf;
  size_t refs;
} shared_buf;

typedef struct {
  uv_write_t req;
  uv_pipe_t *fd_handle; /* wraps the descriptor sent with this write */
  shardd__session *s;
  uv_buf_t buf;
  shared_buf *sb; /* NULL: buf.base - sent is this write's own */
  size_t sent;    /* the frame's first bytes net_send wrote itself */
  uint64_t charged; /* bytes charged to the reply bounds (replybudget.c) */
} write_req;

/* Charges s a write just handed to libuv: its bytes, the request and the
 * descriptor's handle, all held until write_done. Its bytes are the whole
 * frame's, the first ones net_send wrote itself included: their buffer
 * is freed with the rest (counting only the rest hid a socket buffer's
 * worth, about 200 KiB, behind each connection's first unread reply). */
static void write_charge(shardd__session *s, write_req *w) {
  w->charged = w->sent + w->buf.len + sizeof *w +
               (w->fd_handle ? sizeof *w->fd_handle : 0);
  shardd__replies_charge(s, w->charged, w->fd_handle != NULL);
}

void shardd__session_close(shardd__session *s);
static void session_close_later(shardd__session *s);

static void fd_handle_closed(uv_handle_t *h) { free(h); }

static void write_done(uv_write_t *req, int status) {
  write_req *w = (write_req *)req;
  uint64_t charged = w->charged;
  uint32_t fds = w->fd_handle != NULL;
  if (w->fd_handle)
    uv_close((uv_handle_t *)w->fd_handle, fd_handle_closed);
  shardd__session *s = w->s;
  if (w->sb == NULL) {
    free(w->buf.base - w->sent);
  } else if (--w->sb->refs == 0) {
    free(w->sb->buf);
    free(w->sb);
  }
  free(w);
  s->writes--;
  if (status < 0 && status != UV_ECANCELED) {
    shardd__log(3, "session %" PRIu64 ": write: %s", s->conn.id,
                uv_strerror(status));
    session_close_later(s);
  } else if (s->close_after_write &&
             uv_stream_get_write_queue_size((uv_stream_t *)&s->pipe) == 0) {
    shardd__session_close(s);
  }
  /* resumes s, or its uid's sessions, once drained (through a turn: the
   * requests that arrived before the pause are dispatched there) */
  shardd__replies_release(s, charged, fds);
}

#ifdef SHARDD_TEST_HOOKS
void shardd__server_fail_replies(shardd__server *srv, unsigned n) {
  atomic_store(&srv->fail_replies, n);
}

/* Whether the test hook wants this reply to fail. */
static int reply_fault(shardd__server *srv) {
  unsigned n = atomic_load_explicit(&srv->fail_replies, memory_order_relaxed);
  while (n > 0)
    if (atomic_compare_exchange_weak(&srv->fail_replies, &n, n - 1))
      return 1;
  return 0;
}
#else
/* The daemon's build: no reply fails on purpose, and none pays to ask. */
static inline int reply_fault(shardd__server *srv) { return 0; }
#endif

static shardd__session *session_of(shardd__conn *c) {
  return (shardd__session *)((char *)c - offsetof(shardd__session, conn));
}

/* The dispatcher's send hook (dispatch.h): frame has room for the header
 * before the len bytes of payload; NULL when the reply could not be built. */
static void net_send(void *ctx, shardd__conn *c, uint8_t *frame, size_t n,
                     int fd) {
  shardd__session *s = session_of(c);
  char *buf = (char *)frame;
  /* A session whose earlier reply was lost gets none after it: the client
   * matches replies in order and would take them for the lost one's. */
  if (s->closing || s->close_deferred) {
    if (fd >= 0)
      close(fd);
    free(buf);
    return;
  }
  write_req *w = NULL;
  if (!reply_fault(s->srv))
    w = calloc(1, sizeof *w);
  if (w == NULL || buf == NULL)
    goto fail;
  shardd__frame_put_header((uint8_t *)buf, (uint32_t)n);
  w->s = s;
  w->buf = uv_buf_init(buf, (unsigned)(SHARDD_FRAME_HEADER + n));
  int e;
  if (fd >= 0) {
    w->fd_handle = malloc(sizeof *w->fd_handle);
    if (w->fd_handle == NULL)
      goto fail;
    uv_pipe_init(s->srv->loop, w->fd_handle, 0);
    if ((e = uv_pipe_open(w->fd_handle, fd)) != 0) {
      free(w->fd_handle);
      w->fd_handle = NULL;
      shardd__log(0, "wrapping a descriptor: %s", uv_strerror(e));
      goto fail;
    }
    fd = -1; /* the handle owns it now */
    e = uv_write2(&w->req, (uv_stream_t *)&s->pipe, &w->buf, 1,
                  (uv_stream_t *)w->fd_handle, write_done);
  } else {
    /* Written at once when nothing is queued before it (uv_try_write
     * refuses otherwise, so replies keep their order): no request, no
     * write_done on a later turn, and no epoll_ctl re-arming the socket
     * after it. Not for a session to be closed once its replies are out
     * (close_after_write, set before the reply that ends it): its closing
     * is write_done's. A part written is skipped by the uv_write of the
     * rest; an error (UV_EAGAIN, or the peer gone) leaves it all to
     * uv_write, which reports it as before. */
    if (!s->close_after_write) {
      int k = uv_try_write((uv_stream_t *)&s->pipe, &w->buf, 1);
      if (k >= 0 && (size_t)k == w->buf.len) {
        free(buf);
        free(w);
        return;
      }
      if (k > 0) {
        w->sent = (size_t)k;
        w->buf.base += k;
        w->buf.len -= (size_t)k;
      }
    }
    e = uv_write(&w->req, (uv_stream_t *)&s->pipe, &w->buf, 1, write_done);
  }
  if (e == 0) {
    s->writes++;
    write_charge(s, w);
  } else {
    shardd__log(3, "session %" PRIu64 ": write: %s", s->conn.id,
                uv_strerror(e));
    if (w->fd_handle)
      uv_close((uv_handle_t *)w->fd_handle, fd_handle_closed);
    free(buf);
    free(w);
    session_close_later(s);
  }
  return;

fail:
  if (fd >= 0)
    close(fd);
  free(buf);
  free(w);
  shardd__log(0, "session %" PRIu64 ": out of memory replying; closing it",
              s->conn.id);
  session_close_later(s);
}

/* Writes what it can of a frame and its nfds descriptors at once, while
 * nothing is queued before it (as net_send's uv_try_write): groups of
 * SHARDD_FRAME_FDS_PER_READ descriptors, one sendmsg each with one byte of
 * the frame (the last group with the rest). A libuv write carries one
 * descriptor, wrapped in a handle of its own: an fcntl, an ioctl, a
 * failing epoll_ctl, a sendmsg and a close each, the most of the daemon's
 * time in registering 10,000 buffers in batches. The descriptors sent are
 * closed and set to -1 unless borrowed (the caller's); returns how many
 * went and *off how many bytes. Stops at the first write that does not go
 * whole (the socket is full, an error): libuv writes the rest and reports
 * an error as it did. */
static size_t send_fds_now(shardd__session *s, const uint8_t *frame,
                           size_t total, int *fds, size_t nfds, int borrowed,
                           size_t *off) {
  int sock;
  *off = 0;
  if (s->close_after_write ||
      uv_stream_get_write_queue_size((uv_stream_t *)&s->pipe) != 0 ||
      uv_fileno((uv_handle_t *)&s->pipe, &sock) != 0)
    return 0;
  size_t k = 0;
  while (k < nfds) {
    size_t n = nfds - k < SHARDD_FRAME_FDS_PER_READ ? nfds - k
                                                    : SHARDD_FRAME_FDS_PER_READ;
    size_t len = k + n < nfds ? 1 : total - *off;
    union {
      struct cmsghdr align;
      char space[CMSG_SPACE(sizeof(int) * SHARDD_FRAME_FDS_PER_READ)];
    } ctl;
    memset(&ctl, 0, sizeof ctl);
    struct iovec iov = {(void *)(frame + *off), len};
    struct msghdr msg = {0};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = ctl.space;
    msg.msg_controllen = CMSG_SPACE(n * sizeof(int));
    struct cmsghdr *cm = CMSG_FIRSTHDR(&msg);
    cm->cmsg_level = SOL_SOCKET;
    cm->cmsg_type = SCM_RIGHTS;
    cm->cmsg_len = CMSG_LEN(n * sizeof(int));
    memcpy(CMSG_DATA(cm), fds + k, n * sizeof(int));
    ssize_t w;
    do
      w = sendmsg(sock, &msg, MSG_DONTWAIT | MSG_NOSIGNAL);
    while (w < 0 && errno == EINTR);
    if (w <= 0)
      break;
    for (size_t j = k; j < k + n && !borrowed; j++) {
      close(fds[j]);
      fds[j] = -1;
    }
    k += n;
    *off += (size_t)w;
    if ((size_t)w < len)
      break; /* the last group, in part: the rest carries no descriptor */
  }
  return k;
}

/* The dispatcher's send_fds hook. What send_fds_now leaves goes as libuv
 * writes of one descriptor each (uv_write2; a borrowed one duplicated for
 * the handle that closes it), descriptor k with the next byte and the
 * last with the rest. Every write is queued (or made) back
 * to back, so nothing comes between them in the stream; the kernel never
 * merges two writes' descriptors into one read, and the client reads up
 * to the frame's end, so every descriptor reaches the frame they were
 * sent with, in order. */
static void net_send_fds(void *ctx, shardd__conn *c, uint8_t *frame, size_t n,
                         int *fds, size_t nfds, int borrowed) {
  if (nfds <= 1) { /* the dispatcher borrows only two or more */
    net_send(ctx, c, frame, n, nfds == 1 ? fds[0] : -1);
    return;
  }
  shardd__session *s = session_of(c);
  size_t total = SHARDD_FRAME_HEADER + n;
  size_t k = 0, first = 0, off = 0;
  shared_buf *sb = NULL;
  write_req **ws = NULL;
  if (s->closing || s->close_deferred)
    goto drop;
  if (frame == NULL || total < nfds || reply_fault(s->srv))
    goto oom;
  shardd__frame_put_header(frame, (uint32_t)n);
  first = send_fds_now(s, frame, total, fds, nfds, borrowed, &off);
  if (first == nfds) {
    if (off == total) {
      free(frame);
      return;
    }
    /* the rest of the frame, as net_send's after a part written */
    write_req *w = calloc(1, sizeof *w);
    if (w == NULL)
      goto oom;
    w->s = s;
    w->sent = off;
    w->buf = uv_buf_init((char *)frame + off, (unsigned)(total - off));
    int e = uv_write(&w->req, (uv_stream_t *)&s->pipe, &w->buf, 1, write_done);
    if (e != 0) {
      shardd__log(3, "session %" PRIu64 ": write: %s", s->conn.id,
                  uv_strerror(e));
      free(frame);
      free(w);
      session_close_later(s);
      return;
    }
    s->writes++;
    write_charge(s, w);
    return;
  }
  size_t left = nfds - first;
  if ((sb = calloc(1, sizeof *sb)) == NULL ||
      (ws = calloc(left, sizeof *ws)) == NULL)
    goto oom;
  for (k = 0; k < left; k++) {
    if ((ws[k] = calloc(1, sizeof *ws[k])) == NULL ||
        (ws[k]->fd_handle = malloc(sizeof *ws[k]->fd_handle)) == NULL)
      goto oom;
    int fd = borrowed ? fcntl(fds[first + k], F_DUPFD_CLOEXEC, 0)
                      : fds[first + k];
    if (fd < 0) {
      free(ws[k]->fd_handle);
      ws[k]->fd_handle = NULL;
      shardd__log(0, "duplicating a descriptor: %s", strerror(errno));
      goto oom;
    }
    uv_pipe_init(s->srv->loop, ws[k]->fd_handle, 0);
    int e = uv_pipe_open(ws[k]->fd_handle, fd);
    if (e != 0) {
      /* not opened: the handle needs no close, the descriptor is ours */
      if (borrowed)
        close(fd);
      free(ws[k]->fd_handle);
      ws[k]->fd_handle = NULL;
      shardd__log(0, "wrapping a descriptor: %s", uv_strerror(e));
      goto oom;
    }
    if (!borrowed)
      fds[first + k] = -1; /* the handle owns it now */
  }
  sb->buf = (char *)frame;
  sb->refs = left;
  frame = NULL;
  for (k = 0; k < left; k++) {
    write_req *w = ws[k];
    w->s = s;
    w->sb = sb;
    /* each write at least a byte: total >= nfds, and the groups sent
     * took one byte each for SHARDD_FRAME_FDS_PER_READ descriptors */
    w->buf = uv_buf_init(sb->buf + off + k,
                         (unsigned)(k + 1 < left ? 1 : total - off - k));
    int e = uv_write2(&w->req, (uv_stream_t *)&s->pipe, &w->buf, 1,
                      (uv_stream_t *)w->fd_handle, write_done);
    if (e != 0) {
      /* the queued writes hold the bytes; the rest are dropped here */
      shardd__log(3, "session %" PRIu64 ": write: %s", s->conn.id,
                  uv_strerror(e));
      for (size_t j = k; j < left; j++) {
        uv_close((uv_handle_t *)ws[j]->fd_handle, fd_handle_closed);
        free(ws[j]);
        if (--sb->refs == 0) {
          free(sb->buf);
          free(sb);
        }
      }
      free(ws);
      session_close_later(s);
      return;
    }
    s->writes++;
    write_charge(s, w);
  }
  free(ws);
  return;

oom:
  shardd__log(0, "session %" PRIu64 ": out of memory replying; closing it",
              s->conn.id);
  session_close_later(s);
  if (ws)
    for (size_t j = 0; j < nfds - first; j++)
      if (ws[j]) {
        if (ws[j]->fd_handle)
          uv_close((uv_handle_t *)ws[j]->fd_handle, fd_handle_closed);
        free(ws[j]);
      }
  free(ws);
  free(sb);
drop:
  for (size_t j = 0; j < nfds && !borrowed; j++)
    if (fds[j] >= 0)
      close(fds[j]);
  free(frame);
}

static uint32_t net_clients(void *ctx) {
  const shardd__server *srv = ctx;
  return srv->nclients;
}

static int net_live(void *ctx, const shardd__conn *c) {
  const shardd__session *s =
      (const shardd__session *)((const char *)c - offsetof(shardd__session, conn));
  return !s->closing && !s->close_deferred;
}

/* Whether s's client has closed its end, with nothing unread behind it:
 * the end of a session libuv is not reading now (its turn, its replies or
 * the frame budget hold it back) waits in the socket. */
static int peer_gone(shardd__session *s) {
  uv_os_fd_t fd;
  if (uv_fileno((const uv_handle_t *)&s->pipe, &fd) != 0)
    return 0;
  char b;
  ssize_t n = recv(fd, &b, 1, MSG_PEEK | MSG_DONTWAIT);
  return n == 0 || (n < 0 && (errno == ECONNRESET || errno == EPIPE));
}

/* The dispatcher's reclaim hook (dispatch.h). One already marked to close
 * goes now instead of next turn (its frames are dropped either way). A
 * session that may hold whole frames still to dispatch keeps its rank:
 * they were sent before the close and are served (a Step among them is
 * applied) as they would have been; one waiting for the frame budget holds
 * a partial frame only (whole ones would have made it wait its turn). */
static int net_reclaim(void *ctx, uint64_t id) {
  shardd__server *srv = ctx;
  if (srv->stopping)
    return 0;
  shardd__session *s = srv->sessions;
  while (s && s->conn.id != id)
    s = s->next;
  if (s == NULL || s->closing)
    return 0;
  if (!s->close_deferred &&
      (s->deferred ||
       (shardd__frame_reader_pending(&s->rd) > 0 && !s->budget_wait) ||
       !peer_gone(s)))
    return 0;
  shardd__log(3, "session %" PRIu64 ": closed for a new claim of its rank "
              "(its client had gone)", s->conn.id);
  shardd__session_close(s);
  return 1;
}

static uint64_t net_partial_bytes(void *ctx) {
  const shardd__server *srv = ctx;
  return srv->partial_bytes;
}

static void net_unread_replies(void *ctx, uint64_t *bytes, uint64_t *fds) {
  const shardd__server *srv = ctx;
  *bytes = srv->reply_bytes;
  *fds = srv->reply_fds;
}

/* A status-only reply from the transport itself. */
void shardd__session_refuse(shardd__session *s, shardd_err code, const char *msg) {
  shardd__dispatch_refuse(&s->srv->d, &s->conn, code, msg);
}

/* ---- session lifetime ------------------------------------------------- */

static void session_freed(uv_handle_t *h) {
  shardd__session *s = (shardd__session *)h;
  shardd__replies_leave(s); /* every write has called back by now */
  shardd__frame_reader_free(&s->rd);
  free(s);
}

void shardd__session_close(shardd__session *s) {
  if (s->closing)
    return;
  s->closing = 1;
  shardd__server *srv = s->srv;
  if (s->deferred)
    shardd__turn_unlink(s); /* its frames are dropped with it; no turn touches it */
  shardd__dispatch_closed(&srv->d, &s->conn);
  shardd__replies_closed(s); /* its writes give their charges back as libuv cancels them */
  int released = shardd__budget_account(s); /* closing: gives its charge back */
  if (s->prev)
    s->prev->next = s->next;
  else
    srv->sessions = s->next;
  if (s->next)
    s->next->prev = s->prev;
  srv->nclients--;
  uv_close((uv_handle_t *)&s->pipe, session_freed);
  /* a stopping server kept the reaper for sessions kept for a reply */
  if (srv->stopping && srv->sessions == NULL && srv->reaper.data == srv &&
      !uv_is_closing((uv_handle_t *)&srv->reaper))
    uv_close((uv_handle_t *)&srv->reaper, NULL);
  if (released && srv->budget_waiters > 0)
    shardd__budget_resume(srv);
}

/* Replies are sent from inside walks over shared state: a collective
 * answering its waiters, fail_waiting answering every collective of a job.
 * Closing there re-entered shardd__coll_member_lost, which may free the
 * collectives (and, at --job-linger 0, the job) that walk stands on. So a
 * failed reply only marks s: it reads no more and is answered no more, and
 * on_reap closes it once the loop is back at the top. */
static void on_reap(uv_idle_t *h);

static void session_close_later(shardd__session *s) {
  if (s->closing || s->close_deferred)
    return;
  s->close_deferred = 1;
  uv_read_stop((uv_stream_t *)&s->pipe);
  /* a stopping server closes every session itself, except those kept for
   * a checkpoint's reply: the reaper stays for them */
  if (!uv_is_closing((uv_handle_t *)&s->srv->reaper))
    uv_idle_start(&s->srv->reaper, on_reap);
}

static void on_reap(uv_idle_t *h) {
  shardd__server *srv = h->data;
  uv_idle_stop(h);
  /* Closing one session answers the collectives it leaves; a reply that
   * fails there marks another, so the scan starts over until none is left.
   * Nothing walks a waiter list here, so closing at once is safe. */
  for (;;) {
    shardd__session *s = srv->sessions;
    while (s && !s->close_deferred)
      s = s->next;
    if (s == NULL)
      break;
    shardd__log(3, "session %" PRIu64 ": closed after a failed reply", s->conn.id);
    shardd__session_close(s);
  }
}

static void session_begin(shardd__server *srv, shardd__session *s);

static void on_connection(uv_stream_t *server, int status) {
  shardd__server *srv = server->data;
  if (status < 0) {
    shardd__log(1, "accept: %s", uv_strerror(status));
    return;
  }
  shardd__session *s = calloc(1, sizeof *s);
  if (s == NULL) {
    shardd__log(0, "out of memory accepting a client");
    return;
  }
  /* ipc = 1 so replies can carry descriptors (uv_write2). */
  uv_pipe_init(srv->loop, &s->pipe, 1);
  if (uv_accept(server, (uv_stream_t *)&s->pipe) != 0) {
    uv_close((uv_handle_t *)&s->pipe, session_freed);
    return;
  }
  session_begin(srv, s);
}

/* Links an accepted or adopted connection in, reads its credentials and
 * starts reading (or refuses it past --max-clients). */
static void session_begin(shardd__server *srv, shardd__session *s) {
  s->srv = srv;
  uint64_t id = ++srv->next_session;
  shardd__frame_reader_init(&s->rd, SHARDD_MAX_FRAME);
  s->next = srv->sessions;
  if (srv->sessions)
    srv->sessions->prev = s;
  srv->sessions = s;
  srv->nclients++;

  uv_os_fd_t fd;
  shardd__peer peer;
  shardd__peer_of_fd(uv_fileno((uv_handle_t *)&s->pipe, &fd) == 0 ? fd : -1,
                     srv->opts.admin_gid, &peer);
  shardd__dispatch_opened(&srv->d, &s->conn, id, &peer);
  s->since = shardd__server_now(srv);
  s->partial_since = -1;
  uint32_t mine = 0;
  if (!s->conn.peer.admin)
    for (shardd__session *o = srv->sessions; o; o = o->next)
      mine += o->conn.peer.uid == s->conn.peer.uid && !o->closing;
  char msg[160] = "";
  shardd_err why = SHARDD_E_LIMIT;
  if (shardd__replies_join(s) != SHARDD_OK)
    why = SHARDD_E_NO_MEMORY, snprintf(msg, sizeof msg, "out of memory");
  else if (srv->nclients > srv->opts.max_clients + (s->conn.peer.admin ? SHARDD__ADMIN_RESERVE : 0))
    snprintf(msg, sizeof msg, "the daemon serves at most %" PRIu32 " clients",
             srv->opts.max_clients);
  else if (!s->conn.peer.admin && mine > srv->opts.max_clients_per_uid)
    snprintf(msg, sizeof msg, "uid %" PRIu32 " holds %" PRIu32 " connections, "
             "the most one user may (--max-clients-per-uid)", (uint32_t)s->conn.peer.uid,
             srv->opts.max_clients_per_uid);
  if (msg[0]) {
    shardd__log(1, "connection of uid %" PRIu32 " pid %" PRId32 " refused: %s",
                (uint32_t)s->conn.peer.uid, (int32_t)s->conn.peer.pid, msg);
    s->close_after_write = 1; /* before the reply: net_send's fast path */
    shardd__session_refuse(s, why, msg);
    return;
  }
  shardd__session_read_start(s);
}

shardd_err shardd__server_adopt(shardd__server *srv, int fd) {
  shardd__session *s = calloc(1, sizeof *s);
  if (s == NULL)
    return SHARDD_E_NO_MEMORY;
  uv_pipe_init(srv->loop, &s->pipe, 1);
  if (uv_pipe_open(&s->pipe, fd) != 0) {
    uv_close((uv_handle_t *)&s->pipe, session_freed);
    return SHARDD_E_IO;
  }
  session_begin(srv, s);
  return SHARDD_OK;
}

/* ---- tick and signals ------------------------------------------------- */

/* Closes connections past the Hello or partial-frame deadline. */
static void reap_idle_sessions(shardd__server *srv, double now) {
  for (shardd__session *s = srv->sessions, *next; s; s = next) {
    next = s->next;
    if (s->closing || s->close_after_write || s->close_deferred)
      continue;
    const char *why = NULL;
    double waited = 0;
    /* a session the daemon does not read (its replies back up, the
     * partial-frame budget is full, or its frames wait for their turn) is
     * not slow: its clock stops */
    if (!s->read_paused && !s->reply_wait && !s->budget_wait && !s->deferred &&
        shardd__frame_reader_pending(&s->rd) > 0) {
      if (s->partial_since < 0)
        s->partial_since = now;
      else if (now - s->partial_since > srv->opts.frame_timeout)
        why = "left a frame unfinished", waited = srv->opts.frame_timeout;
    } else {
      s->partial_since = -1;
    }
    if (why == NULL && !s->conn.hello_done && now - s->since > srv->opts.hello_timeout)
      why = "sent no Hello", waited = srv->opts.hello_timeout;
    if (why == NULL)
      continue;
    shardd__log(1, "session %" PRIu64 " (uid %" PRIu32 " pid %" PRId32
                ") %s for %.1f s; closed", s->conn.id, (uint32_t)s->conn.peer.uid,
                (int32_t)s->conn.peer.pid, why, waited);
    shardd__session_close(s);
  }
}

static void on_tick(uv_timer_t *t) {
  shardd__server *srv = t->data;
  double now = shardd__server_now(srv);
  shardd__dispatch_timeouts(&srv->d, now);
  reap_idle_sessions(srv, now);
  shardd__dispatch_expire(&srv->d, now);
}

static void on_signal(uv_signal_t *h, int signum) {
  shardd__server *srv = h->data;
  shardd__log(2, "signal %d: shutting down", signum);
  srv->stop_signal = signum;
  shardd__server_stop(srv);
}

/* ---- init / stop ------------------------------------------------------ */

/* Why bind of path failed, for the message. libuv's uv_pipe_bind turns
 * ENOENT into EACCES (for Windows' sake), so a missing /run/shardd read
 * "permission denied"; the directory is looked at again here to tell. */
static void bind_error(const char *path, int e, char *err, size_t errlen) {
  char dir[108];
  snprintf(dir, sizeof dir, "%s", path);
  char *slash = strrchr(dir, '/');
  if (slash == dir)
    slash[1] = '\0'; /* "/x.sock": the root */
  else if (slash)
    *slash = '\0';
  else
    snprintf(dir, sizeof dir, ".");
  struct stat st;
  if (e == UV_EACCES && stat(dir, &st) != 0 && (errno == ENOENT || errno == ENOTDIR))
    snprintf(err, errlen, "bind %s: directory %s does not exist (create it; "
             "shardd.service's RuntimeDirectory=shardd makes /run/shardd)",
             path, dir);
  else if (e == UV_EACCES && stat(dir, &st) == 0 && !S_ISDIR(st.st_mode))
    snprintf(err, errlen, "bind %s: %s is not a directory", path, dir);
  else
    snprintf(err, errlen, "bind %s: %s", path, uv_strerror(e));
}

static shardd_err bind_socket(shardd__server *srv, char *err, size_t errlen) {
  const char *path = srv->socket_path;
  struct stat st;
  /* A socket file left by a crashed daemon blocks bind; remove it only if
   * nobody answers on it, so a second daemon cannot steal a live one. */
  if (stat(path, &st) == 0 && S_ISSOCK(st.st_mode)) {
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    snprintf(sa.sun_path, sizeof sa.sun_path, "%s", path);
    int live = fd >= 0 && connect(fd, (struct sockaddr *)&sa, sizeof sa) == 0;
    if (fd >= 0)
      close(fd);
    if (live) {
      snprintf(err, errlen, "%s: another daemon is serving on it", path);
      return SHARDD_E_BUSY;
    }
    unlink(path);
  }
  int e = uv_pipe_bind(&srv->listener, path);
  if (e != 0) {
    bind_error(path, e, err, errlen);
    return SHARDD_E_IO;
  }
  srv->own_socket_file = 1;
  chmod(path, 0660);
  return SHARDD_OK;
}

shardd_err shardd__server_init(shardd__server *srv, uv_loop_t *loop,
                               shardd__backend *backend,
                               const shardd__server_opts *opts, char *err,
                               size_t errlen) {
  memset(srv, 0, sizeof *srv);
  shardd__log_set_level(opts->log_level);
  srv->loop = loop;
  srv->opts = *opts;
  srv->partial_share = opts->max_partial_bytes / 4;
  srv->backend = backend;
  uv_update_time(loop);
  const char *path = opts->socket_path ? opts->socket_path : SHARDD_DEFAULT_SOCKET;
  if (strlen(path) >= sizeof srv->socket_path) {
    snprintf(err, errlen, "socket path %s is longer than %zu bytes", path,
             sizeof srv->socket_path - 1);
    return SHARDD_E_INVAL;
  }
  snprintf(srv->socket_path, sizeof srv->socket_path, "%s", path);
  shardd__dispatch_io io = {srv,      net_send,          net_clients,
                            net_live, net_partial_bytes, net_reclaim,
                            net_send_fds,      net_unread_replies};
  shardd_err rc = shardd__dispatch_init(&srv->d, loop, backend, opts,
                                        srv->socket_path, &io, err, errlen);
  if (rc != SHARDD_OK) {
    srv->stopping = 1;
    return rc;
  }

  uv_pipe_init(loop, &srv->listener, 0);
  srv->listener.data = srv;
  if (opts->listen_fd >= 0) {
    int e = uv_pipe_open(&srv->listener, opts->listen_fd);
    if (e != 0) {
      snprintf(err, errlen, "activated socket fd %d: %s", opts->listen_fd,
               uv_strerror(e));
      rc = SHARDD_E_IO;
      goto fail;
    }
  } else if ((rc = bind_socket(srv, err, errlen)) != SHARDD_OK) {
    goto fail;
  }
  int e = uv_listen((uv_stream_t *)&srv->listener, 512, on_connection);
  if (e != 0) {
    snprintf(err, errlen, "listen %s: %s", srv->socket_path, uv_strerror(e));
    rc = SHARDD_E_IO;
    goto fail;
  }
  uv_timer_init(loop, &srv->tick);
  srv->tick.data = srv;
  uv_timer_start(&srv->tick, on_tick, TICK_MS, TICK_MS);
  uv_idle_init(loop, &srv->reaper);
  srv->reaper.data = srv;
  uv_check_init(loop, &srv->turns);
  srv->turns.data = srv;
  uv_idle_init(loop, &srv->spin);
  srv->spin.data = srv;
  uv_signal_init(loop, &srv->sigterm);
  uv_signal_init(loop, &srv->sigint);
  srv->sigterm.data = srv->sigint.data = srv;
  uv_signal_start(&srv->sigterm, on_signal, SIGTERM);
  uv_signal_start(&srv->sigint, on_signal, SIGINT);
  return SHARDD_OK;

fail:
  uv_close((uv_handle_t *)&srv->listener, NULL);
  srv->stopping = 1;
  return rc;
}

void shardd__server_stop(shardd__server *srv) {
  if (srv->stopping)
    return;
  srv->stopping = 1;
  const char *why = srv->stop_signal == SIGTERM  ? "daemon stopping (SIGTERM)"
                    : srv->stop_signal == SIGINT ? "daemon stopping (SIGINT)"
                                                 : "daemon stopping";
  shardd__dispatch_stop(&srv->d, why);
  /* A session whose checkpoint is being written is answered once the files
   * are (they will be whole: `shardctl checkpoint` printed E_CLOSED for a
   * valid checkpoint), then closed by its write_done; it reads no more. */
  for (;;) {
    shardd__session *s = srv->sessions;
    while (s && (s->kept || (!s->close_deferred &&
                             shardd__dispatch_awaits_files(&srv->d, &s->conn)))) {
      if (!s->kept) {
        s->kept = 1;
        s->close_after_write = 1;
        uv_read_stop((uv_stream_t *)&s->pipe);
      }
      s = s->next;
    }
    if (s == NULL)
      break;
    shardd__session_close(s);
  }
  uv_close((uv_handle_t *)&srv->listener, NULL);
  uv_close((uv_handle_t *)&srv->tick, NULL);
  if (srv->sessions == NULL && !uv_is_closing((uv_handle_t *)&srv->reaper))
    uv_close((uv_handle_t *)&srv->reaper, NULL); /* else the last one's close */
  uv_close((uv_handle_t *)&srv->turns, NULL);
  uv_close((uv_handle_t *)&srv->spin, NULL);
  uv_close((uv_handle_t *)&srv->sigterm, NULL);
  uv_close((uv_handle_t *)&srv->sigint, NULL);
  if (srv->own_socket_file)
    unlink(srv->socket_path);
}

void shardd__server_free(shardd__server *srv) {
  while (srv->reply_uids) { /* none, once every close callback has run */
    shardd__reply_uid *u = srv->reply_uids;
    srv->reply_uids = u->next;
    free(u);
  }
  shardd__dispatch_free(&srv->d);
  if (srv->backend)
    srv->backend->ops->destroy(srv->backend);
  srv->backend = NULL;
}
