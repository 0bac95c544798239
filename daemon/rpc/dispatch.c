/* dispatch.c — the command table from a Request's body to its handler,
 * the connections' hooks, the collective engine's hooks (its replies), and
 * building and freeing the core (see dispatch.h). The handlers live in
 * the files dispatch_int.h lists, one per kind of request. */
#include "dispatch.h"
#include "dispatch_int.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "frame.h"
#include "log.h"
#include "proto/shardd.pb-c.h"

/* ---- frames held while their job is checkpointed ------------------------
 * While a checkpoint's files are written, a step (which would change them)
 * is held with everything its rank sends behind it, and dispatched in
 * order when the checkpoint ends (see ckpt_operator.c). */
#define HELD_MAX_BYTES ((size_t)4 << 20) /* per connection */

typedef struct shardd__held_frame {
  struct shardd__held_frame *next;
  size_t len;
  uint8_t data[];
} held_frame;

static void held_unlist(shardd__dispatch *d, shardd__conn *c) {
  for (size_t i = 0; i < d->nheld_conns; i++)
    if (d->held_conns[i] == c) {
      d->held_conns[i] = d->held_conns[--d->nheld_conns];
      break;
    }
  c->held_listed = 0;
}

/* Keeps a copy of c's frame for later; 0 when it cannot (over the bound,
 * out of memory): the caller refuses it then. */
static int held_push(shardd__dispatch *d, shardd__conn *c,
                     const uint8_t *payload, size_t len) {
  if (c->held_bytes + len > HELD_MAX_BYTES)
    return 0;
  if (!c->held_listed) {
    if (d->nheld_conns == d->cap_held_conns) {
      size_t cap = d->cap_held_conns ? 2 * d->cap_held_conns : 8;
      shardd__conn **a = realloc(d->held_conns, cap * sizeof *a);
      if (a == NULL)
        return 0;
      d->held_conns = a;
      d->cap_held_conns = cap;
    }
    d->held_conns[d->nheld_conns++] = c;
    c->held_listed = 1;
  }
  held_frame *f = malloc(sizeof *f + len);
  if (f == NULL)
    return 0;
  f->next = NULL;
  f->len = len;
  memcpy(f->data, payload, len);
  if (c->held_last)
    c->held_last->next = f;
  else
    c->held_first = f;
  c->held_last = f;
  c->held_bytes += len;
  return 1;
}

static void held_drop(shardd__dispatch *d, shardd__conn *c) {
  while (c->held_first) {
    held_frame *f = c->held_first;
    c->held_first = f->next;
    free(f);
  }
  c->held_last = NULL;
  c->held_bytes = 0;
  if (c->held_listed)
    held_unlist(d, c);
}

/* job's checkpoint ended: its ranks' held frames are dispatched, in order
 * per rank, until one (a collective checkpoint) starts another. */
static void held_replay(shardd__dispatch *d, shardd__job *job) {
  for (;;) {
    shardd__conn *c = NULL;
    for (size_t i = 0; i < d->nheld_conns && c == NULL; i++)
      if (d->held_conns[i]->m.job == job)
        c = d->held_conns[i];
    if (c == NULL)
      return;
    while (c->held_first && !shardd__jobs_checkpointing(&d->jobs, job)) {
      held_frame *f = c->held_first;
      if ((c->held_first = f->next) == NULL)
        c->held_last = NULL;
      c->held_bytes -= f->len;
      shardd__dispatch_one(d, c, f->data, f->len);
      free(f);
    }
    if (c->held_first)
      return; /* held again until that one ends */
    held_unlist(d, c);
  }
}

/* The dispatcher's ckpt_ended hook: a checkpoint of job ended (job NULL:
 * none), so its held frames go on, then an operator's checkpoint waiting
 * for the job may start. */
static void ckpt_ended(shardd__dispatch *d, shardd__job *job) {
  if (job == NULL)
    return;
  held_replay(d, job);
  shardd__ckpt_pends_kick(d, job);
}

/* Checkpoint: an operator's (ckpt_operator.c), or a collective one asked
 * for by every rank (ckpt_collective.c). */
static void on_checkpoint(shardd__dispatch *d, shardd__conn *c, uint64_t seq,
                          const Shardwire__Request *req) {
  if (req->checkpoint->has_collective && req->checkpoint->collective)
    shardd__on_checkpoint_collective(d, c, seq, req);
  else
    shardd__on_checkpoint(d, c, seq, req);
}

/* ---- the command table ------------------------------------------------- */

static const struct {
  Shardwire__Request__BodyCase body;
  int needs_job; /* only a rank of a job (not a control session) may ask */
  /* it changes what a checkpoint writes (the registry, shards, optimizer
   * state, step counts): refused while the job is being checkpointed.
   * Gathers and scatters write only the gather and reduced areas, which
   * are not written, so training's next forward and backward go on. */
  int changes_ckpt;
  handler fn;
} commands[] = {
    {SHARDWIRE__REQUEST__BODY_HELLO, 0, 0, shardd__on_hello},
    {SHARDWIRE__REQUEST__BODY_STATUS, 0, 0, shardd__on_status},
    {SHARDWIRE__REQUEST__BODY_INSPECT, 0, 0, shardd__on_inspect},
    {SHARDWIRE__REQUEST__BODY_PING, 0, 0, shardd__on_ping},
    {SHARDWIRE__REQUEST__BODY_CHECKPOINT, 0, 0, on_checkpoint},
    {SHARDWIRE__REQUEST__BODY_RESTORE, 0, 0, shardd__on_restore},
    {SHARDWIRE__REQUEST__BODY_REGISTER_BUFFER, 1, 1, shardd__on_register_buffer},
    {SHARDWIRE__REQUEST__BODY_UNREGISTER_BUFFER, 1, 1, shardd__on_unregister_buffer},
    {SHARDWIRE__REQUEST__BODY_REGISTER_VIEW, 1, 1, shardd__on_register_view},
    {SHARDWIRE__REQUEST__BODY_UNREGISTER_VIEW, 1, 1, shardd__on_unregister_view},
    {SHARDWIRE__REQUEST__BODY_VIEWS_BATCH, 1, 1, shardd__on_views_batch},
    {SHARDWIRE__REQUEST__BODY_BUFFERS_BATCH, 1, 1, shardd__on_buffers_batch},
    {SHARDWIRE__REQUEST__BODY_REGISTER_OPTIMIZER, 1, 1, shardd__on_register_optimizer},
    {SHARDWIRE__REQUEST__BODY_UNREGISTER_OPTIMIZER, 1, 1, shardd__on_unregister_optimizer},
    {SHARDWIRE__REQUEST__BODY_GATHER, 1, 0, shardd__on_gather},
    {SHARDWIRE__REQUEST__BODY_SCATTER, 1, 0, shardd__on_scatter},
    {SHARDWIRE__REQUEST__BODY_BUCKET, 1, 0, shardd__on_bucket},
    {SHARDWIRE__REQUEST__BODY_STEP, 1, 1, shardd__on_step},
    {SHARDWIRE__REQUEST__BODY_SET_REQUIRES_GRAD, 1, 1, shardd__on_set_requires_grad},
    {SHARDWIRE__REQUEST__BODY_RELEASE, 1, 0, shardd__on_release},
    {SHARDWIRE__REQUEST__BODY_ALL_REDUCE, 1, 0, shardd__on_all_reduce},
    {SHARDWIRE__REQUEST__BODY_SEED_MASTER, 1, 1, shardd__on_seed_master},
    {SHARDWIRE__REQUEST__BODY_OPTIM_STATE, 1, 1, shardd__on_optim_state},
    {SHARDWIRE__REQUEST__BODY_RELEASE_JOB, 0, 0, shardd__on_release_job},
    {SHARDWIRE__REQUEST__BODY_GOODBYE, 0, 0, shardd__on_goodbye},
};

/* A request is decoded into d's arena (protobuf-c's pieces one bump each,
 * where malloc and free of a bucket's 64 entries were a third of its
 * decoding); the caller rewinds it to a mark taken before, which takes
 * back every piece at once, so the allocator's free does nothing. */
static void *req_alloc(void *arena, size_t n) {
  return shardd__arena_alloc(arena, n);
}

static void req_free(void *arena, void *p) {
  (void)arena;
  (void)p;
}

static Shardwire__Request *req_unpack(shardd__dispatch *d, const uint8_t *payload,
                                      size_t len) {
  /* a bucket's and a views batch's, the requests whose decoding cost
   * counted (a bucket's is on its collective's path, a view's was as much
   * as registering it) */
  Shardwire__Request *req = shardd__bucket_decode(req_alloc, &d->req_arena,
                                                  payload, len);
  if (req == NULL)
    req = shardd__views_decode(req_alloc, &d->req_arena, payload, len);
  if (req != NULL)
    return req;
  ProtobufCAllocator a = {req_alloc, req_free, &d->req_arena};
  return shardwire__request__unpack(&a, len, payload);
}

void *shardd__req_scratch(shardd__dispatch *d, size_t n, size_t size) {
  if (n == 0)
    n = 1;
  if (size != 0 && n > SIZE_MAX / size)
    return NULL;
  void *p = shardd__arena_alloc(&d->req_arena, n * size);
  if (p)
    memset(p, 0, n * size);
  return p;
}

/* Refuses a frame that cannot be held behind c's held ones. */
static void refuse_unheld(shardd__dispatch *d, shardd__conn *c,
                          const uint8_t *payload, size_t len) {
  shardd__arena_mark mark = shardd__arena_mark_now(&d->req_arena);
  Shardwire__Request *req = req_unpack(d, payload, len);
  char msg[ERRLEN];
  snprintf(msg, sizeof msg, "job \"%s\" is being checkpointed and this "
           "rank's requests behind its step are held; no room for more",
           c->m.job ? c->m.job->name : "");
  shardd__reply(d, c, req ? req->seq : 0, req ? SHARDD_E_BUSY : SHARDD_E_PROTOCOL,
                req ? msg : "a frame is not a valid Request");
  shardd__arena_rewind(&d->req_arena, mark);
}

void shardd__dispatch_frame(shardd__dispatch *d, shardd__conn *c,
                            const uint8_t *payload, size_t len) {
  /* behind a held step: held too, so the rank's order stays */
  if (c->held_first) {
    if (!held_push(d, c, payload, len))
      refuse_unheld(d, c, payload, len);
    return;
  }
  shardd__dispatch_one(d, c, payload, len);
}

void shardd__dispatch_one(shardd__dispatch *d, shardd__conn *c,
                          const uint8_t *payload, size_t len) {
  /* a held frame replayed from inside a handler decodes above the outer
   * request, and rewinds only its own */
  shardd__arena_mark mark = shardd__arena_mark_now(&d->req_arena);
  Shardwire__Request *req = req_unpack(d, payload, len);
  if (req == NULL) {
    shardd__arena_rewind(&d->req_arena, mark);
    char msg[128];
    snprintf(msg, sizeof msg, "a %zu-byte frame is not a valid Request", len);
    shardd__log(1, "session %" PRIu64 ": %s", c->id, msg);
    shardd__reply(d, c, 0, SHARDD_E_PROTOCOL, msg);
    return;
  }
  uint64_t seq = req->seq;
  size_t i = 0, n = sizeof commands / sizeof commands[0];
  while (i < n && commands[i].body != req->body_case)
    i++;
  if (req->body_case != SHARDWIRE__REQUEST__BODY_HELLO && !c->hello_done)
    shardd__reply(d, c, seq, SHARDD_E_STATE, "the first request must be Hello");
  else if (c->ckc_dir && seq == c->ckc_seq)
    shardd__seq_refuse(d, c, seq, "collective checkpoint, still being taken");
  else if (d->buckets && shardd__bucket_find(d, c, seq))
    shardd__seq_refuse(d, c, seq, "bucket, still running");
  else if ((i == n || commands[i].needs_job) && c->m.job == NULL)
    shardd__reply(d, c, seq, SHARDD_E_STATE,
                  "this is a control session (Hello without a job); it cannot "
                  "register or train");
  else if (i == n)
    shardd__reply(d, c, seq, SHARDD_E_PROTOCOL, "request has no body this daemon knows");
  else if (commands[i].changes_ckpt &&
           shardd__jobs_checkpointing(&d->jobs, c->m.job) &&
           req->body_case == SHARDWIRE__REQUEST__BODY_STEP &&
           held_push(d, c, payload, len)) {
    /* A step is held (and every frame its rank sends behind it, so a
     * pipelined gather cannot overtake it) until the files are written:
     * an operator's checkpoint of a live job then never fails training. */
  } else if (commands[i].changes_ckpt &&
             shardd__jobs_checkpointing(&d->jobs, c->m.job)) {
    /* Refused, not held: registrations and the like are not part of a
     * training step, and their caller can say what to do. */
    char msg[ERRLEN];
    snprintf(msg, sizeof msg, "job \"%s\" is being checkpointed",
             c->m.job->name);
    shardd__reply(d, c, seq, SHARDD_E_BUSY, msg);
  } else if (c->m.job && shardd__jobs_restoring(&d->jobs, c->m.job)) {
    /* cannot happen (nobody joins a job being restored); kept so no
     * request ever reaches memory the pool is loading */
    char msg[ERRLEN];
    snprintf(msg, sizeof msg, "job \"%s\" is being restored", c->m.job->name);
    shardd__reply(d, c, seq, SHARDD_E_BUSY, msg);
  } else {
    /* the job's description in the fd store is rewritten before the loop
     * waits again; a Hello or restore may make a job, a release end one
     * (every job is looked at then); a step's own hooks describe it, and
     * gathers, scatters and reports change nothing described */
    Shardwire__Request__BodyCase b = req->body_case;
    if (d->fdstore && commands[i].changes_ckpt &&
        b != SHARDWIRE__REQUEST__BODY_STEP)
      shardd__fdstore_touch(d->fdstore, c->m.job);
    else if (d->fdstore && (b == SHARDWIRE__REQUEST__BODY_HELLO ||
                            b == SHARDWIRE__REQUEST__BODY_RESTORE ||
                            b == SHARDWIRE__REQUEST__BODY_RELEASE ||
                            b == SHARDWIRE__REQUEST__BODY_RELEASE_JOB))
      shardd__fdstore_touch(d->fdstore, NULL);
    commands[i].fn(d, c, seq, req);
  }
  shardd__arena_rewind(&d->req_arena, mark);
}

/* ---- connections and the engine's hooks -------------------------------- */

void shardd__dispatch_opened(shardd__dispatch *d, shardd__conn *c,
                             uint64_t id, const shardd__peer *peer) {
  memset(c, 0, sizeof *c);
  c->id = id;
  c->peer = *peer;
}

void shardd__dispatch_closed(shardd__dispatch *d, shardd__conn *c) {
  shardd__ckpt_closed(d, c);
  held_drop(d, c); /* a closed rank's steps would fail anyway */
  free(c->pools_sent);
  c->pools_sent = NULL;
  c->npools_sent = 0;
  shardd__ckpt_collective_closed(d, c);
  shardd__job *job = c->m.job;
  if (job == NULL)
    return;
  shardd__coll_member_lost(d->coll, &c->m);
  /* its buckets' waiting entries were answered just now; running ones
   * forget c: nobody is left to answer */
  shardd__buckets_closed(d, c);
  /* its areas, at once or when the collective using them ends */
  shardd__area_return_rank(job, c->m.rank);
  shardd__log(2, "session %" PRIu64 ": rank %" PRIu32 " of job \"%s\" left",
              c->id, c->m.rank, job->name);
  c->m.job = NULL;
  shardd__jobs_leave(&d->jobs, job, c->m.rank, c->id, now_s(d), c->bye);
}

void shardd__dispatch_timeouts(shardd__dispatch *d, double now) {
  shardd__coll_tick(d->coll, now);
  shardd__ckpt_pends_expire(d, now);
}

void shardd__dispatch_expire(shardd__dispatch *d, double now) {
  shardd__jobs_expire(&d->jobs, now);
}

/* Whether connection c was sent pool id's descriptor (or IPC handle). */
static int pool_sent(const shardd__conn *c, uint64_t id) {
  for (size_t i = 0; i < c->npools_sent; i++)
    if (c->pools_sent[i] == id)
      return 1;
  return 0;
}

/* Exports a's pool for c unless it was sent before: a descriptor (*fd, -1
 * none; read-only for the node's gathered copies) or a CUDA IPC handle
 * (*ipc_len bytes at ipc), the pool then counted as sent. */
static shardd_err pool_export(shardd__dispatch *d, shardd__conn *c,
                              const shardd__area *a, int *fd, uint8_t *ipc,
                              size_t cap, size_t *ipc_len) {
  *fd = -1;
  *ipc_len = 0;
  if (pool_sent(c, a->pool_id))
    return SHARDD_OK;
  uint64_t *p = realloc(c->pools_sent, (c->npools_sent + 1) * sizeof *p);
  if (p == NULL)
    return SHARDD_E_NO_MEMORY;
  c->pools_sent = p;
  shardd__backend *be = d->backend;
  shardd_err rc;
  if (be->ops->export_ipc)
    rc = be->ops->export_ipc(be, a->pool, ipc, cap, ipc_len);
  else if (a->readonly && be->ops->export_fd_ro)
    rc = be->ops->export_fd_ro(be, a->pool, fd);
  else if (a->readonly) /* never handed out writable */
    rc = SHARDD_E_INTERNAL;
  else
    rc = be->ops->export_fd(be, a->pool, fd);
  if (rc == SHARDD_OK)
    c->pools_sent[c->npools_sent++] = a->pool_id;
  return rc;
}

/* A transient gather's reply: where this rank's areas are, with each
 * pool's descriptor the first time this connection hears of that pool
 * (the gather pool's first, then the gradient pool's). */
static void reply_gather(shardd__dispatch *d, shardd__conn *c, uint64_t seq,
                         const shardd__coll_result *res) {
  Shardwire__Response resp = ok_resp(seq, SHARDWIRE__RESPONSE__BODY_GATHER);
  Shardwire__GatherReply gr = SHARDWIRE__GATHER_REPLY__INIT;
  gr.pool = res->gather.pool_id;
  gr.pool_bytes = res->gather.pool->bytes;
  gr.gather_offset = res->gather.off;
  gr.has_device = 1;
  gr.device = (uint32_t)res->gather.pool->device;
  resp.gather = &gr;
  size_t sent = c->npools_sent; /* what the client has, if this fails */
  int fds[2], nfds = 0, fd;
  uint8_t ipc[64];
  size_t ipc_len;
  shardd_err rc = pool_export(d, c, &res->gather, &fd, ipc, sizeof ipc, &ipc_len);
  if (rc == SHARDD_OK && ipc_len > 0) {
    gr.has_cuda_ipc_handle = 1;
    gr.cuda_ipc_handle.data = ipc;
    gr.cuda_ipc_handle.len = ipc_len;
  }
  if (fd >= 0)
    fds[nfds++] = fd;
  if (rc == SHARDD_OK && res->has_grad) {
    gr.has_grad_offset = 1;
    gr.grad_offset = res->grad.off;
    if (res->grad.pool_id != res->gather.pool_id) {
      /* the gather area is the node's copy: the gradient is this rank's,
       * in its device's pool (host backend: descriptors, no IPC) */
      gr.has_grad_pool = gr.has_grad_pool_bytes = 1;
      gr.grad_pool = res->grad.pool_id;
      gr.grad_pool_bytes = res->grad.pool->bytes;
      uint8_t gipc[64];
      size_t gipc_len;
      rc = pool_export(d, c, &res->grad, &fd, gipc, sizeof gipc, &gipc_len);
      if (rc == SHARDD_OK && gipc_len > 0)
        rc = SHARDD_E_INTERNAL; /* a cuda daemon shares no gather pool */
      if (fd >= 0) {
        gr.has_grad_pool_fd = gr.grad_pool_fd = 1;
        fds[nfds++] = fd;
      }
    }
  }
  if (rc != SHARDD_OK) {
    for (int i = 0; i < nfds; i++)
      close(fds[i]);
    c->npools_sent = sent;
    shardd__reply(d, c, seq, rc, "exporting the area pool's descriptor failed");
    return;
  }
  shardd__send_resp_fds(d, c, &resp, fds, (size_t)nfds, 0);
}

/* The member is the first field of its connection. */
static void coll_done(void *ctx, shardd__coll_member *m, uint64_t seq,
                      shardd_err code, const char *msg,
                      const shardd__coll_result *res) {
  shardd__dispatch *d = ctx;
  shardd__conn *c = (shardd__conn *)m;
  if (c->ckc_dir && seq == c->ckc_seq) {
    shardd__ckpt_collective_done(d, c, seq, code, msg, res);
    return;
  }
  struct shardd__bucket_wait *w;
  if (d->buckets && (w = shardd__bucket_find(d, c, seq)) != NULL) {
    shardd__bucket_note(d, w, code, msg, res);
    return;
  }
  if (res == NULL) {
    shardd__reply(d, c, seq, code, msg);
    return;
  }
  if (res->kind == SHARDD__COLL_GATHER) {
    reply_gather(d, c, seq, res);
    return;
  }
  if (res->kind == SHARDD__COLL_ALL_REDUCE) {
    Shardwire__Response resp = ok_resp(seq, SHARDWIRE__RESPONSE__BODY_ALL_REDUCE);
    Shardwire__AllReduceReply ar = SHARDWIRE__ALL_REDUCE_REPLY__INIT;
    ar.n_values = res->nvalues;
    ar.values = (double *)res->values;
    resp.all_reduce = &ar;
    shardd__send_resp(d, c, &resp, -1);
    return;
  }
  Shardwire__Response resp = ok_resp(seq, SHARDWIRE__RESPONSE__BODY_STEP);
  Shardwire__StepReply sr = SHARDWIRE__STEP_REPLY__INIT;
  sr.step = res->step;
  sr.has_total_norm = res->has_total_norm;
  sr.total_norm = res->has_total_norm ? res->total_norm : 0;
  resp.step = &sr;
  shardd__send_resp(d, c, &resp, -1);
}

static void coll_quiet(void *ctx, shardd__job *job) {
  shardd__dispatch *d = ctx;
  shardd__ckpt_pends_kick(d, job); /* the quiescent point an operator's checkpoint waits for */
  shardd__jobs_idle(&d->jobs, job);
}

static void coll_step_begin(void *ctx, shardd__job *job, shardd__optim *opt,
                            uint64_t step) {
  shardd__dispatch *d = ctx;
  shardd__fdstore_step_begin(d->fdstore, job, opt, step);
}

static void coll_step_end(void *ctx, shardd__job *job, shardd__optim *opt,
                          uint64_t step, shardd_err code) {
  shardd__dispatch *d = ctx;
  shardd__fdstore_step_end(d->fdstore, job, opt, step, code);
}

/* A job being restored is not described: its memory is still loading. */
static int fdstore_skip(void *arg, shardd__job *job) {
  shardd__dispatch *d = arg;
  return shardd__jobs_restoring(&d->jobs, job);
}

static void job_released(void *arg, shardd__job *job) {
  shardd__dispatch *d = arg;
  shardd__fdstore_job_gone(d->fdstore, job);
  shardd__ckpt_collective_released(arg, job);
}

/* ---- init / free ------------------------------------------------------- */

shardd_err shardd__dispatch_init(shardd__dispatch *d, uv_loop_t *loop,
                                 shardd__backend *backend,
                                 const shardd__server_opts *opts,
                                 const char *socket_path,
                                 const shardd__dispatch_io *io, char *err,
                                 size_t errlen) {
  memset(d, 0, sizeof *d);
  d->opts = *opts;
  d->backend = backend;
  d->io = *io;
  d->loop = loop;
  d->socket_path = socket_path;
  d->started = now_s(d);
  d->ckpt_ended = ckpt_ended;
  /* a bucket of 64 scatters decodes into about 10 KiB; a larger request
   * (a batch of registrations) takes what does not fit from malloc */
  shardd__arena_init(&d->req_arena, 64 * 1024);
  shardd__registry_init(&d->reg, backend);
  d->reg.job_memory_limit = opts->job_memory_limit;
  d->reg.uid_memory_limit = opts->uid_memory_limit;
  if (opts->uid_memory_limit == SHARDD__UID_MEMORY_DEFAULT) {
    /* a quarter of every device's memory: no one user takes it all */
    uint64_t total = 0;
    for (int dev = 0; dev < backend->ndevices; dev++) {
      shardd__device_info info;
      backend->ops->device_info(backend, dev, &info);
      total += info.capacity_bytes;
    }
    d->reg.uid_memory_limit = total / 4;
  }
  d->reg.max_jobs = opts->max_jobs;
  d->reg.max_jobs_per_uid = opts->max_jobs_per_uid;
  d->reg.max_views = opts->max_views;
  d->reg.max_views_per_uid =
      opts->max_views_per_uid ? opts->max_views_per_uid : opts->max_views / 4;
  /* connections, the listener, checkpoint files and libraries keep theirs */
  shardd__registry_fit_blocks(&d->reg,
                              (uint64_t)opts->max_clients + SHARDD__ADMIN_RESERVE + 128);
  shardd__coll_config cc = {.loop = loop,
                            .reg = &d->reg,
                            .timeout = opts->collective_timeout,
                            .peer_grace = opts->peer_grace,
                            .max_pending = opts->max_pending,
                            .max_inflight_gathers = opts->max_inflight_gathers,
                            .hooks = {d, coll_done, coll_quiet,
                                      opts->fd_store ? coll_step_begin : NULL,
                                      opts->fd_store ? coll_step_end : NULL}};
  if (shardd__coll_engine_create(&cc, &d->coll) != SHARDD_OK) {
    shardd__registry_free(&d->reg);
    snprintf(err, errlen, "out of memory");
    return SHARDD_E_NO_MEMORY;
  }
  shardd__jobs_init(&d->jobs, loop, &d->reg, d->coll, opts->job_linger,
                    opts->jobspecs, opts->njobspecs, job_released, d);
  if (opts->fd_store &&
      shardd__fdstore_create(loop, &d->reg, fdstore_skip, d, &d->fdstore) !=
          SHARDD_OK) {
    shardd__dispatch_free(d);
    snprintf(err, errlen, "out of memory");
    return SHARDD_E_NO_MEMORY;
  }
  return SHARDD_OK;
}

void shardd__dispatch_stop(shardd__dispatch *d, const char *why) {
  d->jobs.stopping = 1;
  shardd__fdstore_stop(d->fdstore);
  shardd__coll_engine_stop(d->coll);
  /* before the transport closes the sessions: else the first rank closed
   * fails the others' collectives as a lost peer */
  shardd__coll_stop_waiting(d->coll, why);
}

void shardd__dispatch_free(shardd__dispatch *d) {
  if (d->coll == NULL) /* never initialised, or freed */
    return;
  shardd__coll_engine_destroy(d->coll);
  d->coll = NULL;
  shardd__jobs_free(&d->jobs);
  shardd__ckpt_free(d);
  shardd__ckpt_collective_free(d);
  shardd__buckets_free(d);
  free(d->held_conns);
  d->held_conns = NULL;
  shardd__registry_free(&d->reg);
  shardd__fdstore_free(d->fdstore);
  d->fdstore = NULL;
  shardd__arena_free(&d->req_arena);
}
