/* server.c — the libuv loop of shardd: accept, sessions, framing, request
 * dispatch, replies and the periodic tick (see server.h). */
#include "server.h"

#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "checkpoint.h"
#include "collective.h"
#include "optcodec.h"
#include "optreg.h"
#include "status.h"
#include "validate.h"

#define TICK_MS 100

void shardd__log(const shardd__server *srv, int level, const char *fmt, ...) {
  static const char *names[] = {"error", "warn", "info", "debug"};
  if (srv && level > srv->opts.log_level)
    return;
  char line[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(line, sizeof line, fmt, ap);
  va_end(ap);
  /* The journal stamps time itself; a priority prefix lets it filter. */
  fprintf(stderr, "<%d>shardd: %s: %s\n", level == 0 ? 3 : level == 1 ? 4 : level == 2 ? 6 : 7,
          names[level < 0 ? 0 : level > 3 ? 3 : level], line);
}

double shardd__server_now(const shardd__server *srv) {
  return (double)uv_now(srv->loop) / 1000.0;
}

/* ---- writes ----------------------------------------------------------- */

typedef struct {
  uv_write_t req;
  uv_pipe_t *fd_handle; /* wraps the descriptor sent with this write */
  shardd__session *s;
  uv_buf_t buf;
} write_req;

static void session_close(shardd__session *s);
static void session_close_later(shardd__session *s);
static void read_frames(shardd__session *s);
static void alloc_cb(uv_handle_t *h, size_t suggested, uv_buf_t *buf);
static void read_cb(uv_stream_t *stream, ssize_t nread, const uv_buf_t *buf);

/* Backpressure. A client that sends requests and never reads the replies
 * made the daemon queue them without end: a Ping echoes up to 16 MiB, and
 * every RegisterBuffer reply holds a descriptor until written, so one
 * client could exhaust the daemon's memory or descriptors for everyone.
 * Past the high marks the session is not read (its requests wait in the
 * kernel, then in the client) until its replies drain below the low ones. */
#define WQ_HIGH_BYTES ((size_t)64 << 20)
#define WQ_LOW_BYTES ((size_t)16 << 20)
#define WQ_HIGH_WRITES 64u
#define WQ_LOW_WRITES 16u

static int write_backlog(shardd__session *s, int high) {
  size_t bytes = uv_stream_get_write_queue_size((uv_stream_t *)&s->pipe);
  if (high)
    return s->writes >= WQ_HIGH_WRITES || bytes >= WQ_HIGH_BYTES;
  return s->writes > WQ_LOW_WRITES || bytes > WQ_LOW_BYTES;
}

static void fd_handle_closed(uv_handle_t *h) { free(h); }

static void write_done(uv_write_t *req, int status) {
  write_req *w = (write_req *)req;
  if (w->fd_handle)
    uv_close((uv_handle_t *)w->fd_handle, fd_handle_closed);
  shardd__session *s = w->s;
  free(w->buf.base);
  free(w);
  s->writes--;
  if (status < 0 && status != UV_ECANCELED) {
    shardd__log(s->srv, 3, "session %" PRIu64 ": write: %s", s->id,
                uv_strerror(status));
    session_close_later(s);
  } else if (s->close_after_write &&
             uv_stream_get_write_queue_size((uv_stream_t *)&s->pipe) == 0) {
    session_close(s);
  } else if (s->read_paused && !s->closing && !s->close_after_write &&
             !s->close_deferred && !write_backlog(s, 0)) {
    s->read_paused = 0;
    shardd__log(s->srv, 3, "session %" PRIu64 ": replies drained; reading again",
                s->id);
    uv_read_start((uv_stream_t *)&s->pipe, alloc_cb, read_cb);
    read_frames(s); /* requests that arrived before the pause */
  }
}

void shardd__server_fail_replies(shardd__server *srv, unsigned n) {
  atomic_store(&srv->fail_replies, n);
}

/* Whether the test hook wants this reply to fail (one relaxed load when
 * it is off). */
static int reply_fault(shardd__server *srv) {
  unsigned n = atomic_load_explicit(&srv->fail_replies, memory_order_relaxed);
  while (n > 0)
    if (atomic_compare_exchange_weak(&srv->fail_replies, &n, n - 1))
      return 1;
  return 0;
}

void shardd__session_send(shardd__session *s, Shardd__Response *resp, int fd) {
  /* A session whose earlier reply was lost gets none after it: the client
   * matches replies in order and would take them for the lost one's. */
  if (s->closing || s->close_deferred) {
    if (fd >= 0)
      close(fd);
    return;
  }
  size_t n = shardd__response__get_packed_size(resp);
  if (n > SHARDD_MAX_FRAME) {
    /* The client refuses a frame past the limit and drops the connection:
     * status with ~60k optimizers failed even for root, inspect of a
     * buffer with 200k views for its owner. Say so instead. */
    if (fd >= 0)
      close(fd);
    char msg[256];
    snprintf(msg, sizeof msg, "the reply would be %zu bytes, over the %u-byte "
             "frame limit; ask for less (one job's status, one buffer)", n,
             SHARDD_MAX_FRAME);
    shardd__log(s->srv, 1, "session %" PRIu64 ": %s", s->id, msg);
    shardd__session_reply(s, resp->seq, SHARDD_E_LIMIT, msg);
    return;
  }
  write_req *w = NULL;
  char *buf = NULL;
  if (!reply_fault(s->srv)) {
    w = calloc(1, sizeof *w);
    buf = malloc(SHARDD_FRAME_HEADER + n);
  }
  if (w == NULL || buf == NULL)
    goto fail;
  shardd__frame_put_header((uint8_t *)buf, (uint32_t)n);
  shardd__response__pack(resp, (uint8_t *)buf + SHARDD_FRAME_HEADER);
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
      shardd__log(s->srv, 0, "wrapping a descriptor: %s", uv_strerror(e));
      goto fail;
    }
    fd = -1; /* the handle owns it now */
    e = uv_write2(&w->req, (uv_stream_t *)&s->pipe, &w->buf, 1,
                  (uv_stream_t *)w->fd_handle, write_done);
  } else {
    e = uv_write(&w->req, (uv_stream_t *)&s->pipe, &w->buf, 1, write_done);
  }
  if (e == 0) {
    s->writes++;
  } else {
    shardd__log(s->srv, 3, "session %" PRIu64 ": write: %s", s->id,
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
  shardd__log(s->srv, 0, "session %" PRIu64 ": out of memory replying; closing it",
              s->id);
  session_close_later(s);
}

void shardd__session_reply(shardd__session *s, uint64_t seq, shardd_err code,
                           const char *msg) {
  Shardd__Response resp = SHARDD__RESPONSE__INIT;
  resp.seq = seq;
  resp.code = (Shardd__StatusCode)code;
  resp.message = (char *)(msg ? msg : shardd_strerror(code));
  shardd__session_send(s, &resp, -1);
}

/* ---- session lifetime ------------------------------------------------- */

static void session_freed(uv_handle_t *h) {
  shardd__session *s = (shardd__session *)h;
  shardd__frame_reader_free(&s->rd);
  free(s);
}

static void session_detach(shardd__session *s) {
  shardd__server *srv = s->srv;
  shardd__job *job = s->job;
  if (job == NULL)
    return;
  shardd__coll_session_lost(srv, s);
  if (job->rank_sessions[s->rank] == s)
    job->rank_sessions[s->rank] = NULL;
  if (--job->nclients == 0)
    job->empty_since = shardd__server_now(srv);
  shardd__log(srv, 2, "session %" PRIu64 ": rank %" PRIu32 " of job \"%s\" left",
              s->id, s->rank, job->name);
  s->job = NULL;
  shardd__server_job_idle(srv, job);
}

void shardd__server_job_idle(shardd__server *srv, shardd__job *job) {
  /* --job-linger 0: a job ends with its last client (or with the last
   * collective that outlived it), not at the next tick. */
  if (job->nclients == 0 && srv->opts.job_linger == 0 && !srv->stopping &&
      shardd__coll_inflight(job) == 0) {
    shardd__log(srv, 2, "job \"%s\" released (last client left)", job->name);
    shardd__coll_job_free(job);
    shardd__job_release(&srv->reg, job);
  }
}

static void session_close(shardd__session *s) {
  if (s->closing)
    return;
  s->closing = 1;
  shardd__server *srv = s->srv;
  session_detach(s);
  if (s->prev)
    s->prev->next = s->next;
  else
    srv->sessions = s->next;
  if (s->next)
    s->next->prev = s->prev;
  srv->nclients--;
  uv_close((uv_handle_t *)&s->pipe, session_freed);
}

/* Replies are sent from inside walks over shared state: a collective
 * answering its waiters, fail_waiting answering every collective of a job.
 * Closing there re-entered shardd__coll_session_lost, which may free the
 * collectives (and, at --job-linger 0, the job) that walk stands on. So a
 * failed reply only marks s: it reads no more and is answered no more, and
 * on_reap closes it once the loop is back at the top. */
static void on_reap(uv_idle_t *h);

static void session_close_later(shardd__session *s) {
  if (s->closing || s->close_deferred)
    return;
  s->close_deferred = 1;
  uv_read_stop((uv_stream_t *)&s->pipe);
  if (!s->srv->stopping) /* else server_stop closes every session itself */
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
    shardd__log(srv, 3, "session %" PRIu64 ": closed after a failed reply", s->id);
    session_close(s);
  }
}

/* ---- request handlers ------------------------------------------------- */

#define ERRLEN 512

static int need_job(shardd__session *s, uint64_t seq) {
  if (!s->hello_done) {
    shardd__session_reply(s, seq, SHARDD_E_STATE,
                          "the first request must be Hello");
    return 0;
  }
  if (s->job == NULL) {
    shardd__session_reply(s, seq, SHARDD_E_STATE,
                          "this is a control session (Hello without a job); "
                          "it cannot register or train");
    return 0;
  }
  return 1;
}

static void on_hello(shardd__session *s, uint64_t seq, const Shardd__Hello *h) {
  shardd__server *srv = s->srv;
  char err[ERRLEN];
  if (s->hello_done) {
    shardd__session_reply(s, seq, SHARDD_E_STATE, "Hello was already sent");
    return;
  }
  if (h->protocol_version != SHARDD_PROTOCOL_VERSION) {
    snprintf(err, sizeof err, "client speaks protocol %" PRIu32
             ", this daemon speaks %d", h->protocol_version,
             SHARDD_PROTOCOL_VERSION);
    shardd__session_reply(s, seq, SHARDD_E_VERSION, err);
    return;
  }
  if (h->job && h->job[0]) {
    shardd__job *job = shardd__job_find(&srv->reg, h->job);
    /* A job is its creator's: another user may not join (root may). */
    if (job && job->uid != s->cred.uid && s->cred.uid != 0) {
      /* which uid owns it is not the asker's to learn */
      snprintf(err, sizeof err, "job \"%s\" belongs to another user; uid %d "
               "may not join it", job->name, (int)s->cred.uid);
      shardd__session_reply(s, seq, SHARDD_E_PERMISSION, err);
      return;
    }
    uint32_t world = h->has_world ? h->world : 1;
    shardd_err rc = shardd__job_get(&srv->reg, h->job, world, s->cred.uid, &job,
                                    err, sizeof err);
    if (rc != SHARDD_OK) {
      shardd__session_reply(s, seq, rc, err);
      return;
    }
    uint32_t rank = h->has_rank ? h->rank : 0;
    shardd__session *other = NULL;
    /* --job-spec: a multi-node job holds its node's ranks only */
    rc = shardd__coll_job_layout(srv, job, rank, err, sizeof err);
    if (rc == SHARDD_OK && rank >= job->world) {
      snprintf(err, sizeof err, "rank %" PRIu32 " is outside world %" PRIu32,
               rank, job->world);
      rc = SHARDD_E_RANGE;
    }
    if (rc == SHARDD_OK && (other = job->rank_sessions[rank]) != NULL) {
      snprintf(err, sizeof err,
               "rank %" PRIu32 " of job \"%s\" is already connected (pid %d)",
               rank, job->name, (int)other->cred.pid);
      rc = SHARDD_E_STATE;
    }
    if (rc != SHARDD_OK) {
      shardd__session_reply(s, seq, rc, err);
      /* A job this refused Hello created has no client to wait for. */
      if (job->nclients == 0 && job->empty_since < 0) {
        shardd__job_mark_idle(srv, job);
        shardd__server_job_idle(srv, job);
      }
      return;
    }
    job->rank_sessions[rank] = s;
    job->nclients++;
    job->empty_since = -1;
    s->job = job;
    s->rank = rank;
    shardd__log(srv, 2,
                "session %" PRIu64 ": rank %" PRIu32 "/%" PRIu32
                " of job \"%s\" (pid %d uid %d)",
                s->id, rank, job->world, job->name, (int)s->cred.pid,
                (int)s->cred.uid);
  }
  s->hello_done = 1;
  Shardd__Response resp = SHARDD__RESPONSE__INIT;
  Shardd__HelloReply hr = SHARDD__HELLO_REPLY__INIT;
  hr.protocol_version = SHARDD_PROTOCOL_VERSION;
  hr.daemon_version = SHARDD_VERSION;
  hr.session_id = s->id;
  hr.backend = (char *)srv->backend->name;
  hr.devices = (uint32_t)srv->backend->ndevices;
  resp.seq = seq;
  resp.code = SHARDD__STATUS_CODE__OK;
  resp.body_case = SHARDD__RESPONSE__BODY_HELLO;
  resp.hello = &hr;
  shardd__session_send(s, &resp, -1);
}

static void on_status(shardd__session *s, uint64_t seq) {
  shardd__report *r;
  Shardd__StatusReply *st;
  shardd_err rc = shardd__status_build(s->srv, s, &r, &st);
  if (rc != SHARDD_OK) {
    shardd__session_reply(s, seq, rc, "out of memory building status");
  } else {
    Shardd__Response resp = SHARDD__RESPONSE__INIT;
    resp.seq = seq;
    resp.code = SHARDD__STATUS_CODE__OK;
    resp.body_case = SHARDD__RESPONSE__BODY_STATUS;
    resp.status = st;
    shardd__session_send(s, &resp, -1);
  }
  shardd__report_free(r);
}

static void on_inspect(shardd__session *s, uint64_t seq,
                       const Shardd__Inspect *in) {
  char err[ERRLEN];
  shardd__report *r;
  Shardd__InspectReply *ir;
  shardd_err rc = shardd__inspect_build(s->srv, s, in->has_id ? in->id : 0,
                                        in->name, &r, &ir, err, sizeof err);
  if (rc != SHARDD_OK) {
    shardd__session_reply(s, seq, rc, err);
  } else {
    Shardd__Response resp = SHARDD__RESPONSE__INIT;
    resp.seq = seq;
    resp.code = SHARDD__STATUS_CODE__OK;
    resp.body_case = SHARDD__RESPONSE__BODY_INSPECT;
    resp.inspect = ir;
    shardd__session_send(s, &resp, -1);
  }
  shardd__report_free(r);
}

static void on_register_buffer(shardd__session *s, uint64_t seq,
                               const Shardd__RegisterBuffer *rb) {
  shardd__server *srv = s->srv;
  char err[ERRLEN];
  shardd__buffer *b;
  int created;
  shardd_err rc = shardd__buffer_register(&srv->reg, s->job, rb->name,
                                          (shardd_dtype)rb->dtype, rb->numel,
                                          &b, &created, err, sizeof err);
  if (rc != SHARDD_OK) {
    shardd__session_reply(s, seq, rc, err);
    return;
  }
  int fd = -1;
  uint8_t ipc[64];
  size_t ipc_len = 0;
  if (srv->backend->ops->export_ipc) { /* cuda: a handle, no descriptor */
    rc = srv->backend->ops->export_ipc(srv->backend, b->blocks[s->rank], ipc,
                                       sizeof ipc, &ipc_len);
    if (rc != SHARDD_OK) {
      snprintf(err, sizeof err,
               "exporting rank %" PRIu32 "'s block as a CUDA IPC handle: %s",
               s->rank, shardd_strerror(rc));
      shardd__session_reply(s, seq, rc, err);
      return;
    }
  } else {
    rc = srv->backend->ops->export_fd(srv->backend, b->blocks[s->rank], &fd);
    if (rc != SHARDD_OK) {
      snprintf(err, sizeof err, "exporting rank %" PRIu32 "'s block: %s",
               s->rank, shardd_strerror(rc));
      shardd__session_reply(s, seq, rc, err);
      return;
    }
  }
  Shardd__Response resp = SHARDD__RESPONSE__INIT;
  Shardd__BufferReply br = SHARDD__BUFFER_REPLY__INIT;
  if (ipc_len > 0) {
    br.has_cuda_ipc_handle = 1;
    br.cuda_ipc_handle.data = ipc;
    br.cuda_ipc_handle.len = ipc_len;
  }
  br.id = b->hdr.id;
  br.name = b->hdr.name;
  br.dtype = (Shardd__DType)b->dtype;
  br.numel = b->numel;
  br.padded_numel = b->padded_numel;
  br.shard_numel = b->shard_numel;
  br.world = b->world;
  br.rank = s->rank;
  br.device = (uint32_t)shardd__rank_device(&srv->reg, s->rank);
  br.block_bytes = b->blocks[s->rank]->bytes;
  br.shard_offset = b->shard_off;
  br.gather_offset = b->gather_off;
  br.grad_offset = b->grad_off;
  br.has_reduced_offset = 1;
  br.reduced_offset = b->reduced_off;
  br.created = created;
  br.has_generation = 1;
  br.generation = b->hdr.generation;
  resp.seq = seq;
  resp.code = SHARDD__STATUS_CODE__OK;
  resp.body_case = SHARDD__RESPONSE__BODY_BUFFER;
  resp.buffer = &br;
  shardd__session_send(s, &resp, fd);
  if (created)
    shardd__log(srv, 3, "job \"%s\": buffer %" PRIu64 " \"%s\" %s[%" PRIu64 "]",
                s->job->name, b->hdr.id, b->hdr.name,
                shardd_dtype_name(b->dtype), b->numel);
}

static void on_register_view(shardd__session *s, uint64_t seq,
                             const Shardd__RegisterView *rv) {
  char err[ERRLEN];
  shardd__view *v;
  int created;
  if (rv->n_shape > 64) {
    shardd__session_reply(s, seq, SHARDD_E_RANGE, "view has over 64 dimensions");
    return;
  }
  shardd_err rc = shardd__view_register_ex(
      &s->srv->reg, s->job, rv->buffer,
      rv->has_buffer_generation ? rv->buffer_generation : 0, rv->name,
      rv->offset, rv->numel, rv->shape, (int)rv->n_shape,
      rv->has_requires_grad ? rv->requires_grad : 1, &v, &created, err,
      sizeof err);
  if (rc != SHARDD_OK) {
    shardd__session_reply(s, seq, rc, err);
    return;
  }
  Shardd__Response resp = SHARDD__RESPONSE__INIT;
  Shardd__ViewReply vr = SHARDD__VIEW_REPLY__INIT;
  vr.id = v->hdr.id;
  vr.created = created;
  vr.has_generation = 1;
  vr.generation = v->hdr.generation;
  resp.seq = seq;
  resp.code = SHARDD__STATUS_CODE__OK;
  resp.body_case = SHARDD__RESPONSE__BODY_VIEW;
  resp.view = &vr;
  shardd__session_send(s, &resp, -1);
}

static void reply_optimizer(shardd__session *s, uint64_t seq, uint64_t id,
                            int created) {
  Shardd__Response resp = SHARDD__RESPONSE__INIT;
  Shardd__OptimizerReply orp = SHARDD__OPTIMIZER_REPLY__INIT;
  orp.id = id;
  orp.created = created;
  resp.seq = seq;
  resp.code = SHARDD__STATUS_CODE__OK;
  resp.body_case = SHARDD__RESPONSE__BODY_OPTIMIZER;
  resp.optimizer = &orp;
  shardd__session_send(s, &resp, -1);
}

static void on_register_optimizer(shardd__session *s, uint64_t seq,
                                  const Shardd__RegisterOptimizer *ro) {
  shardd__server *srv = s->srv;
  char err[ERRLEN];
  shardd__optspec spec;
  if (shardd__optspec_from_wire(ro, &spec) != SHARDD_OK) {
    shardd__session_reply(s, seq, SHARDD_E_NO_MEMORY, "out of memory");
    return;
  }
  shardd__optreg_result res;
  shardd_err rc = shardd__optreg_register(&srv->reg, s->job, &spec,
                                          SHARDD__OPTREG_ATTACH, &res, err,
                                          sizeof err);
  shardd__optspec_free(&spec);
  if (rc == SHARDD_OK) {
    reply_optimizer(s, seq, res.optim->hdr.id, res.created);
  } else if (res.refused) {
    shardd__session_reply(s, seq, rc, res.list ? res.list : "optimizer refused");
    shardd__log(srv, 3, "job \"%s\": optimizer refused: %s", s->job->name,
                res.list ? res.list : "");
  } else {
    shardd__session_reply(s, seq, rc, err);
  }
  free(res.list);
}

static void on_unregister(shardd__session *s, uint64_t seq,
                          shardd__obj_kind kind, uint64_t id, uint64_t gen) {
  char err[ERRLEN];
  shardd_err rc;
  shardd__registry *reg = &s->srv->reg;
  if (gen != 0 && shardd__registry_stale(reg, s->job, id, gen, err, sizeof err))
    rc = SHARDD_E_STALE;
  else if (kind == SHARDD__OBJ_BUFFER)
    rc = shardd__buffer_unregister(reg, s->job, id, err, sizeof err);
  else if (kind == SHARDD__OBJ_VIEW)
    rc = shardd__view_unregister(reg, s->job, id, err, sizeof err);
  else
    rc = shardd__optim_unregister(reg, s->job, id, err, sizeof err);
  shardd__session_reply(s, seq, rc, rc == SHARDD_OK ? NULL : err);
}

static void on_ping(shardd__session *s, uint64_t seq, const Shardd__Ping *p) {
  Shardd__Response resp = SHARDD__RESPONSE__INIT;
  Shardd__Pong pong = SHARDD__PONG__INIT;
  if (p->has_payload) {
    pong.has_payload = 1;
    pong.payload = p->payload;
  }
  resp.seq = seq;
  resp.code = SHARDD__STATUS_CODE__OK;
  resp.body_case = SHARDD__RESPONSE__BODY_PONG;
  resp.pong = &pong;
  shardd__session_send(s, &resp, -1);
}

static void reply_checkpoint(shardd__session *s, uint64_t seq,
                             shardd__job *job, const char *dir) {
  Shardd__Response resp = SHARDD__RESPONSE__INIT;
  Shardd__CheckpointReply cr = SHARDD__CHECKPOINT_REPLY__INIT;
  cr.job = job->name;
  cr.dir = (char *)dir;
  cr.buffers = (uint32_t)shardd__map_count(&job->buffers);
  cr.optimizers = (uint32_t)shardd__map_count(&job->optims);
  resp.seq = seq;
  resp.code = SHARDD__STATUS_CODE__OK;
  resp.body_case = SHARDD__RESPONSE__BODY_CHECKPOINT;
  resp.checkpoint = &cr;
  shardd__session_send(s, &resp, -1);
}

shardd_err shardd__server_checkpoint(shardd__server *srv, shardd__job *job,
                                     const char *dir, int64_t as_uid, char *err,
                                     size_t errlen) {
  if (job->nodes > 1) {
    snprintf(err, errlen,
             "job \"%s\" spans %" PRIu32 " nodes; checkpoints of multi-node "
             "jobs are not supported yet",
             job->name, job->nodes);
    return SHARDD_E_STATE;
  }
  if (shardd__coll_inflight(job) > 0) {
    snprintf(err, errlen,
             "job \"%s\" has %" PRIu32 " collective(s) in flight; checkpoint "
             "between steps",
             job->name, shardd__coll_inflight(job));
    return SHARDD_E_BUSY;
  }
  shardd_err rc = shardd__checkpoint_write(&srv->reg, job, dir, as_uid, err, errlen);
  if (rc == SHARDD_OK)
    shardd__log(srv, 2, "job \"%s\" checkpointed to %s", job->name, dir);
  return rc;
}

/* A client names the directory, the daemon writes or reads it with its own
 * rights: only absolute paths without "." or ".." parts, below
 * --checkpoint-root when one is set. */
static int checkpoint_dir_ok(const shardd__server *srv, const char *dir,
                             char *err, size_t errlen) {
  const char *root = srv->opts.checkpoint_root;
  if (dir == NULL || dir[0] != '/') {
    snprintf(err, errlen, "checkpoint directory \"%s\" is not an absolute path",
             dir ? dir : "");
    return 0;
  }
  for (const char *p = dir; (p = strchr(p, '/')) != NULL; p++) {
    if ((p[1] == '.' && (p[2] == '/' || p[2] == '\0')) ||
        (p[1] == '.' && p[2] == '.' && (p[3] == '/' || p[3] == '\0'))) {
      snprintf(err, errlen, "checkpoint directory %s has a . or .. part", dir);
      return 0;
    }
  }
  size_t n = root ? strlen(root) : 0;
  while (n > 1 && root[n - 1] == '/')
    n--;
  if (root && !(strncmp(dir, root, n) == 0 && dir[n] == '/' && dir[n + 1])) {
    snprintf(err, errlen, "checkpoint directory %s is not below %.*s "
             "(--checkpoint-root)", dir, (int)n, root);
    return 0;
  }
  return 1;
}

static void on_checkpoint(shardd__session *s, uint64_t seq,
                          const Shardd__Checkpoint *cp) {
  char err[ERRLEN];
  if (!checkpoint_dir_ok(s->srv, cp->dir, err, sizeof err)) {
    shardd__session_reply(s, seq, SHARDD_E_PERMISSION, err);
    return;
  }
  shardd__job *job = s->job;
  if (job == NULL) {
    job = shardd__job_find(&s->srv->reg, cp->job);
    if (job == NULL) {
      snprintf(err, sizeof err, "no job \"%s\"", cp->job ? cp->job : "");
      shardd__session_reply(s, seq, SHARDD_E_NOT_FOUND, err);
      return;
    }
    if (job->uid != s->cred.uid && s->cred.uid != 0) {
      snprintf(err, sizeof err, "job \"%s\" belongs to another user; only "
               "it or root may checkpoint it", job->name);
      shardd__session_reply(s, seq, SHARDD_E_PERMISSION, err);
      return;
    }
  } else if (cp->job && cp->job[0] && strcmp(cp->job, job->name) != 0) {
    snprintf(err, sizeof err, "a session of job \"%s\" cannot checkpoint job \"%s\"",
             job->name, cp->job);
    shardd__session_reply(s, seq, SHARDD_E_NOT_OWNED, err);
    return;
  }
  shardd_err rc = shardd__server_checkpoint(s->srv, job, cp->dir, (int64_t)s->cred.uid,
                                            err, sizeof err);
  if (rc != SHARDD_OK)
    shardd__session_reply(s, seq, rc, err);
  else
    reply_checkpoint(s, seq, job, cp->dir);
}

static void on_restore(shardd__session *s, uint64_t seq,
                       const Shardd__Restore *rs) {
  char err[ERRLEN];
  if (!checkpoint_dir_ok(s->srv, rs->dir, err, sizeof err)) {
    shardd__session_reply(s, seq, SHARDD_E_PERMISSION, err);
    return;
  }
  shardd__job *job;
  shardd_err rc = shardd__checkpoint_restore(&s->srv->reg, rs->dir, (int64_t)s->cred.uid,
                                             rs->has_world ? rs->world : 0,
                                             &job, err, sizeof err);
  if (rc != SHARDD_OK) {
    shardd__session_reply(s, seq, rc, err);
    return;
  }
  shardd__job_mark_idle(s->srv, job);
  shardd__log(s->srv, 2, "job \"%s\" restored from %s", job->name, rs->dir);
  reply_checkpoint(s, seq, job, rs->dir);
}

void shardd__job_mark_idle(shardd__server *srv, shardd__job *job) {
  /* A restored job has no client yet: it lingers like one whose clients
   * left, so it is released if nobody comes back. */
  if (job->nclients == 0)
    job->empty_since = shardd__server_now(srv);
}

static void dispatch(shardd__session *s, const Shardd__Request *req) {
  uint64_t seq = req->seq;
  if (req->body_case != SHARDD__REQUEST__BODY_HELLO && !s->hello_done) {
    shardd__session_reply(s, seq, SHARDD_E_STATE,
                          "the first request must be Hello");
    return;
  }
  shardd__coll_args ca;
  memset(&ca, 0, sizeof ca);
  switch (req->body_case) {
  case SHARDD__REQUEST__BODY_HELLO:
    on_hello(s, seq, req->hello);
    return;
  case SHARDD__REQUEST__BODY_STATUS:
    on_status(s, seq);
    return;
  case SHARDD__REQUEST__BODY_INSPECT:
    on_inspect(s, seq, req->inspect);
    return;
  case SHARDD__REQUEST__BODY_PING:
    on_ping(s, seq, req->ping);
    return;
  case SHARDD__REQUEST__BODY_CHECKPOINT:
    on_checkpoint(s, seq, req->checkpoint);
    return;
  case SHARDD__REQUEST__BODY_RESTORE:
    on_restore(s, seq, req->restore);
    return;
  default:
    break;
  }
  if (!need_job(s, seq))
    return;
  switch (req->body_case) {
  case SHARDD__REQUEST__BODY_REGISTER_BUFFER:
    on_register_buffer(s, seq, req->register_buffer);
    break;
  case SHARDD__REQUEST__BODY_UNREGISTER_BUFFER:
    on_unregister(s, seq, SHARDD__OBJ_BUFFER, req->unregister_buffer->id,
                  req->unregister_buffer->generation);
    break;
  case SHARDD__REQUEST__BODY_REGISTER_VIEW:
    on_register_view(s, seq, req->register_view);
    break;
  case SHARDD__REQUEST__BODY_UNREGISTER_VIEW:
    on_unregister(s, seq, SHARDD__OBJ_VIEW, req->unregister_view->id,
                  req->unregister_view->generation);
    break;
  case SHARDD__REQUEST__BODY_REGISTER_OPTIMIZER:
    on_register_optimizer(s, seq, req->register_optimizer);
    break;
  case SHARDD__REQUEST__BODY_UNREGISTER_OPTIMIZER:
    on_unregister(s, seq, SHARDD__OBJ_OPTIM, req->unregister_optimizer->id, 0);
    break;
  case SHARDD__REQUEST__BODY_GATHER:
    ca.kind = SHARDD__COLL_GATHER;
    ca.target = req->gather->buffer;
    ca.generation = req->gather->generation;
    shardd__coll_submit(s->srv, s, seq, &ca);
    break;
  case SHARDD__REQUEST__BODY_SCATTER:
    ca.kind = SHARDD__COLL_SCATTER;
    ca.target = req->scatter->buffer;
    ca.generation = req->scatter->generation;
    ca.op = (shardd_reduce_op)req->scatter->op;
    if (ca.op != SHARDD_REDUCE_SUM && ca.op != SHARDD_REDUCE_MEAN) {
      shardd__session_reply(s, seq, SHARDD_E_INVAL,
                            "scatter op must be sum or mean");
      break;
    }
    shardd__coll_submit(s->srv, s, seq, &ca);
    break;
  case SHARDD__REQUEST__BODY_STEP:
    ca.kind = SHARDD__COLL_STEP;
    ca.target = req->step->optimizer;
    ca.has_lr = req->step->has_lr;
    ca.lr = req->step->lr;
    ca.max_norm = req->step->has_max_norm ? req->step->max_norm : 0;
    shardd__coll_submit(s->srv, s, seq, &ca);
    break;
  default:
    shardd__session_reply(s, seq, SHARDD_E_PROTOCOL,
                          "request has no body this daemon knows");
  }
}

/* ---- reads ------------------------------------------------------------ */

static void alloc_cb(uv_handle_t *h, size_t suggested, uv_buf_t *buf) {
  static char slab[65536]; /* loop-thread only: consumed before the next read */
  buf->base = slab;
  buf->len = sizeof slab;
}

static void read_cb(uv_stream_t *stream, ssize_t nread, const uv_buf_t *buf) {
  shardd__session *s = (shardd__session *)stream;
  if (nread < 0) {
    if (nread != UV_EOF)
      shardd__log(s->srv, 3, "session %" PRIu64 ": read: %s", s->id,
                  uv_strerror((int)nread));
    session_close(s);
    return;
  }
  if (s->closing || s->close_after_write || s->close_deferred)
    return;
  if (uv_pipe_pending_count(&s->pipe) > 0) {
    shardd__session_reply(s, 0, SHARDD_E_PROTOCOL,
                          "clients may not send descriptors to the daemon");
    s->close_after_write = 1;
    uv_read_stop(stream);
    return;
  }
  if (shardd__frame_reader_feed(&s->rd, buf->base, (size_t)nread) != SHARDD_OK) {
    session_close(s);
    return;
  }
  read_frames(s);
}

/* Dispatches the whole frames s->rd holds, unless replies back up first. */
static void read_frames(shardd__session *s) {
  uv_stream_t *stream = (uv_stream_t *)&s->pipe;
  for (;;) {
    if (s->closing || s->close_deferred)
      return; /* a reply failed (or the session ended) meanwhile */
    if (write_backlog(s, 1)) {
      if (!s->read_paused)
        shardd__log(s->srv, 3, "session %" PRIu64 ": %" PRIu32 " replies (%zu "
                    "bytes) unread by the client; not reading it until they drain",
                    s->id, s->writes, uv_stream_get_write_queue_size(stream));
      s->read_paused = 1;
      uv_read_stop(stream);
      return;
    }
    const uint8_t *payload;
    size_t len;
    shardd_err rc = shardd__frame_reader_next(&s->rd, &payload, &len);
    if (rc != SHARDD_OK) {
      char msg[128];
      snprintf(msg, sizeof msg, "frame over the %u-byte limit; closing",
               SHARDD_MAX_FRAME);
      shardd__log(s->srv, 1, "session %" PRIu64 ": %s", s->id, msg);
      shardd__session_reply(s, 0, SHARDD_E_FRAME_TOO_LARGE, msg);
      s->close_after_write = 1;
      uv_read_stop(stream);
      return;
    }
    if (payload == NULL)
      return;
    Shardd__Request *req = shardd__request__unpack(NULL, len, payload);
    if (req == NULL) {
      char msg[128];
      snprintf(msg, sizeof msg, "a %zu-byte frame is not a valid Request", len);
      shardd__log(s->srv, 1, "session %" PRIu64 ": %s", s->id, msg);
      shardd__session_reply(s, 0, SHARDD_E_PROTOCOL, msg);
      continue;
    }
    dispatch(s, req);
    shardd__request__free_unpacked(req, NULL);
  }
}

static void session_begin(shardd__server *srv, shardd__session *s);

static void on_connection(uv_stream_t *server, int status) {
  shardd__server *srv = server->data;
  if (status < 0) {
    shardd__log(srv, 1, "accept: %s", uv_strerror(status));
    return;
  }
  shardd__session *s = calloc(1, sizeof *s);
  if (s == NULL) {
    shardd__log(srv, 0, "out of memory accepting a client");
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

/* Whether the peer process is in gid, as primary or supplementary group
 * (the latter read from /proc, as SO_PEERCRED carries only the primary). */
static int peer_in_group(const struct ucred *cred, int64_t gid) {
  if (gid < 0)
    return 0;
  if ((int64_t)cred->gid == gid)
    return 1;
  char path[64], line[4096];
  snprintf(path, sizeof path, "/proc/%d/status", (int)cred->pid);
  FILE *f = fopen(path, "r");
  if (f == NULL)
    return 0;
  int found = 0;
  while (!found && fgets(line, sizeof line, f)) {
    if (strncmp(line, "Groups:", 7) != 0)
      continue;
    char *save;
    for (char *t = strtok_r(line + 7, " \t\n", &save); t;
         t = strtok_r(NULL, " \t\n", &save))
      if (strtoll(t, NULL, 10) == gid)
        found = 1;
  }
  fclose(f);
  return found;
}

int shardd__session_may_see(const shardd__session *s, const shardd__job *job) {
  return s->admin || job->uid == s->cred.uid;
}

/* Links an accepted or adopted connection in, reads its credentials and
 * starts reading (or refuses it past --max-clients). */
static void session_begin(shardd__server *srv, shardd__session *s) {
  s->srv = srv;
  s->id = ++srv->next_session;
  shardd__frame_reader_init(&s->rd, SHARDD_MAX_FRAME);
  s->next = srv->sessions;
  if (srv->sessions)
    srv->sessions->prev = s;
  srv->sessions = s;
  srv->nclients++;

  uv_os_fd_t fd;
  socklen_t len = sizeof s->cred;
  if (uv_fileno((uv_handle_t *)&s->pipe, &fd) == 0)
    getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &s->cred, &len);
  s->admin = s->cred.uid == 0 || peer_in_group(&s->cred, srv->opts.admin_gid);
  s->since = shardd__server_now(srv);
  s->partial_since = -1;
  uint32_t mine = 0;
  if (!s->admin)
    for (shardd__session *o = srv->sessions; o; o = o->next)
      mine += o->cred.uid == s->cred.uid && !o->closing;
  char msg[160] = "";
  if (srv->nclients > srv->opts.max_clients + (s->admin ? SHARDD__ADMIN_RESERVE : 0))
    snprintf(msg, sizeof msg, "the daemon serves at most %" PRIu32 " clients",
             srv->opts.max_clients);
  else if (!s->admin && mine > srv->opts.max_clients_per_uid)
    snprintf(msg, sizeof msg, "uid %" PRIu32 " holds %" PRIu32 " connections, "
             "the most one user may (--max-clients-per-uid)", (uint32_t)s->cred.uid,
             srv->opts.max_clients_per_uid);
  if (msg[0]) {
    shardd__log(srv, 1, "connection of uid %" PRIu32 " pid %" PRId32 " refused: %s",
                (uint32_t)s->cred.uid, (int32_t)s->cred.pid, msg);
    shardd__session_reply(s, 0, SHARDD_E_LIMIT, msg);
    s->close_after_write = 1;
    return;
  }
  uv_read_start((uv_stream_t *)&s->pipe, alloc_cb, read_cb);
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

typedef struct {
  shardd__server *srv;
  shardd__job **expired;
  size_t n, cap;
} linger_arg;

static void find_lingering(shardd__job *job, void *arg) {
  linger_arg *a = arg;
  double now = shardd__server_now(a->srv);
  if (job->nclients == 0 && job->empty_since >= 0 &&
      a->srv->opts.job_linger >= 0 &&
      now - job->empty_since >= a->srv->opts.job_linger &&
      shardd__coll_inflight(job) == 0 && a->n < a->cap)
    a->expired[a->n++] = job;
}

/* Closes connections past the Hello or partial-frame deadline. */
static void reap_idle_sessions(shardd__server *srv, double now) {
  for (shardd__session *s = srv->sessions, *next; s; s = next) {
    next = s->next;
    if (s->closing || s->close_after_write || s->close_deferred)
      continue;
    const char *why = NULL;
    double waited = 0;
    if (!s->read_paused && shardd__frame_reader_pending(&s->rd) > 0) {
      if (s->partial_since < 0)
        s->partial_since = now;
      else if (now - s->partial_since > srv->opts.frame_timeout)
        why = "left a frame unfinished", waited = srv->opts.frame_timeout;
    } else {
      s->partial_since = -1;
    }
    if (why == NULL && !s->hello_done && now - s->since > srv->opts.hello_timeout)
      why = "sent no Hello", waited = srv->opts.hello_timeout;
    if (why == NULL)
      continue;
    shardd__log(srv, 1, "session %" PRIu64 " (uid %" PRIu32 " pid %" PRId32
                ") %s for %.1f s; closed", s->id, (uint32_t)s->cred.uid,
                (int32_t)s->cred.pid, why, waited);
    session_close(s);
  }
}

static void on_tick(uv_timer_t *t) {
  shardd__server *srv = t->data;
  shardd__coll_tick(srv, shardd__server_now(srv));
  reap_idle_sessions(srv, shardd__server_now(srv));
  size_t cap = shardd__map_count(&srv->reg.jobs);
  if (cap == 0)
    return;
  linger_arg a = {srv, malloc(cap * sizeof(shardd__job *)), 0, cap};
  if (a.expired == NULL)
    return;
  shardd__registry_each_job(&srv->reg, find_lingering, &a);
  for (size_t i = 0; i < a.n; i++) {
    shardd__log(srv, 2, "job \"%s\" released (no client for %.0f s)",
                a.expired[i]->name, srv->opts.job_linger);
    shardd__coll_job_free(a.expired[i]);
    shardd__job_release(&srv->reg, a.expired[i]);
  }
  free(a.expired);
}

static void on_signal(uv_signal_t *h, int signum) {
  shardd__server *srv = h->data;
  shardd__log(srv, 2, "signal %d: shutting down", signum);
  shardd__server_stop(srv);
}

/* ---- init / stop ------------------------------------------------------ */

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
    snprintf(err, errlen, "bind %s: %s", path, uv_strerror(e));
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
  srv->loop = loop;
  srv->opts = *opts;
  srv->backend = backend;
  shardd__registry_init(&srv->reg, backend);
  srv->reg.job_memory_limit = opts->job_memory_limit;
  srv->reg.max_jobs = opts->max_jobs;
  srv->reg.max_jobs_per_uid = opts->max_jobs_per_uid;
  /* Descriptors: rank blocks get all but what connections, the listener,
   * checkpoint files and libraries need; one uid a quarter of them, so no
   * single user can starve the others (or the accept loop). */
  struct rlimit nofile;
  if (getrlimit(RLIMIT_NOFILE, &nofile) == 0 && nofile.rlim_cur != RLIM_INFINITY) {
    uint64_t n = nofile.rlim_cur;
    uint64_t keep = (uint64_t)opts->max_clients + SHARDD__ADMIN_RESERVE + 128;
    srv->reg.max_blocks = n > 2 * keep ? n - keep : n / 2;
    srv->reg.max_blocks_per_uid = srv->reg.max_blocks / 4;
  }
  uv_update_time(loop);
  srv->started = shardd__server_now(srv);
  const char *path = opts->socket_path ? opts->socket_path : SHARDD_DEFAULT_SOCKET;
  if (strlen(path) >= sizeof srv->socket_path) {
    snprintf(err, errlen, "socket path %s is longer than %zu bytes", path,
             sizeof srv->socket_path - 1);
    return SHARDD_E_INVAL;
  }
  snprintf(srv->socket_path, sizeof srv->socket_path, "%s", path);

  uv_pipe_init(loop, &srv->listener, 0);
  srv->listener.data = srv;
  shardd_err rc;
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
  while (srv->sessions)
    session_close(srv->sessions);
  uv_close((uv_handle_t *)&srv->listener, NULL);
  uv_close((uv_handle_t *)&srv->tick, NULL);
  uv_close((uv_handle_t *)&srv->reaper, NULL);
  uv_close((uv_handle_t *)&srv->sigterm, NULL);
  uv_close((uv_handle_t *)&srv->sigint, NULL);
  if (srv->own_socket_file)
    unlink(srv->socket_path);
}

static void release_all_cb(shardd__job *job, void *arg) {
  shardd__coll_job_free(job);
}

void shardd__server_free(shardd__server *srv) {
  shardd__registry_each_job(&srv->reg, release_all_cb, NULL);
  shardd__registry_free(&srv->reg);
  if (srv->backend)
    srv->backend->ops->destroy(srv->backend);
  srv->backend = NULL;
}
