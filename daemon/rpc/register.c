/* register.c — registration requests: buffers, views and optimizers one
 * at a time and in batches (a batch all or nothing, its refused entries
 * listed), and their unregistration (see dispatch_int.h). */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dispatch_int.h"
#include "log.h"
#include "optcodec.h"
#include "optreg.h"
#include "varint.h"

/* What registering one buffer changed in a buffer it attached to, so a
 * refused batch can put it back. */
typedef struct {
  shardd__buffer *b;
  int created;
  int touched; /* the checksum fields below were b's before */
  int had_sum;
  uint64_t sum;
  uint32_t rank;
} buf_undo;

/* Creates or attaches to rb's buffer for c's rank, with the initial
 * checksum rule (RegisterBuffer). */
static shardd_err buffer_register_one(shardd__dispatch *d, shardd__conn *c,
                                      const Shardwire__RegisterBuffer *rb,
                                      buf_undo *u, char *err, size_t errlen) {
  uint32_t rank = c->m.rank;
  memset(u, 0, sizeof *u);
  shardd__buffer *b;
  shardd_err rc = shardd__buffer_register(&d->reg, c->m.job, rb->name,
                                          (shardd_dtype)rb->dtype, rb->numel,
                                          &b, &u->created, err, errlen);
  if (rc != SHARDD_OK)
    return rc;
  u->b = b;
  if (rb->has_init_checksum && !b->settled) {
    if (!b->has_init_sum || b->init_rank == rank) {
      /* the first, or that rank again (relaunched, maybe reseeded) */
      u->touched = 1;
      u->had_sum = b->has_init_sum;
      u->sum = b->init_sum;
      u->rank = b->init_rank;
      b->has_init_sum = 1;
      b->init_sum = rb->init_checksum;
      b->init_rank = rank;
    } else if (b->init_sum != rb->init_checksum) {
      snprintf(err, errlen,
               "buffer \"%s\": rank %" PRIu32 "'s initial values differ from "
               "rank %" PRIu32 "'s (checksum %016" PRIx64 " vs %016" PRIx64 "): "
               "every rank must build the model identically (same seed), as "
               "each writes its own slice",
               b->hdr.name, rank, b->init_rank, rb->init_checksum, b->init_sum);
      /* the ranks that registered first are in (or on their way to) a
       * collective: they hear this, not a lost peer once this rank exits */
      shardd__coll_job_break(d->coll, c->m.job, rank, SHARDD_E_MISMATCH, err);
      return SHARDD_E_MISMATCH;
    }
  }
  return SHARDD_OK;
}

static void buffer_undo(shardd__dispatch *d, const buf_undo *u) {
  if (u->b == NULL)
    return;
  if (u->created) {
    shardd__buffer_abandon(&d->reg, u->b);
  } else if (u->touched) {
    u->b->has_init_sum = u->had_sum;
    u->b->init_sum = u->sum;
    u->b->init_rank = u->rank;
  }
}

/* Exports c's rank block of b (a descriptor in *fd, or a CUDA IPC handle
 * in ipc) and fills br, which borrows from b and ipc. borrow: *fd is the
 * block's own memfd, not a duplicate (the caller sends it before anything
 * can free the block, and does not close it). */
static shardd_err buffer_reply_fill(shardd__dispatch *d, shardd__conn *c,
                                    shardd__buffer *b, int created, int borrow,
                                    Shardwire__BufferReply *br, uint8_t ipc[64],
                                    int *fd, char *err, size_t errlen) {
  shardd__backend *be = d->backend;
  uint32_t rank = c->m.rank;
  size_t ipc_len = 0;
  shardd_err rc;
  *fd = -1;
  const shardd__region *blk = b->blocks[rank];
  if (blk->slab && !c->at_offsets) {
    /* mapped at offset 0 it would be another buffer's block */
    snprintf(err, errlen, "buffer \"%s\": its rank %" PRIu32 " block shares "
             "a memfd with the other blocks of the batch that made it, and "
             "this client maps a block only at the start of a descriptor of "
             "its own (its Hello did not say blocks_at_offsets: an older "
             "libshardd)", b->hdr.name, rank);
    return SHARDD_E_STATE;
  }
  if (be->ops->export_ipc) { /* cuda: a handle, no descriptor */
    rc = be->ops->export_ipc(be, b->blocks[rank], ipc, 64, &ipc_len);
    if (rc != SHARDD_OK) {
      snprintf(err, errlen,
               "exporting rank %" PRIu32 "'s block as a CUDA IPC handle: %s",
               rank, shardd_strerror(rc));
      return rc;
    }
  } else {
    /* as export_fd's refusal of a block with no descriptor */
    rc = !borrow ? be->ops->export_fd(be, b->blocks[rank], fd)
         : (*fd = b->blocks[rank]->fd) >= 0 ? SHARDD_OK : SHARDD_E_INVAL;
    if (rc != SHARDD_OK) {
      snprintf(err, errlen, "exporting rank %" PRIu32 "'s block: %s",
               rank, shardd_strerror(rc));
      return rc;
    }
  }
  shardwire__buffer_reply__init(br);
  if (ipc_len > 0) {
    br->has_cuda_ipc_handle = 1;
    br->cuda_ipc_handle.data = ipc;
    br->cuda_ipc_handle.len = ipc_len;
  }
  br->id = b->hdr.id;
  br->name = b->hdr.name;
  br->dtype = (Shardwire__DType)b->dtype;
  br->numel = b->numel;
  br->padded_numel = b->padded_numel;
  br->shard_numel = b->shard_numel;
  br->world = b->world;
  br->rank = rank;
  br->device = (uint32_t)shardd__rank_device(&d->reg, rank);
  br->block_bytes = b->blocks[rank]->bytes;
  br->shard_offset = b->shard_off;
  br->gather_offset = b->gather_off;
  br->grad_offset = b->grad_off;
  br->has_reduced_offset = 1;
  br->reduced_offset = b->reduced_off;
  br->created = created;
  if (c->at_offsets && *fd >= 0) {
    br->has_block_offset = 1;
    br->block_offset = blk->off;
  }
  br->has_existing = 1;
  br->existing = b->settled != 0;
  br->has_generation = 1;
  br->generation = b->hdr.generation;
  if (b->hdr.job->transient) {
    br->has_transient = 1;
    br->transient = 1;
  }
  return SHARDD_OK;
}

static void log_created(const shardd__conn *c, const shardd__buffer *b) {
  shardd__log(3, "job \"%s\": buffer %" PRIu64 " \"%s\" %s[%" PRIu64 "]",
              c->m.job->name, b->hdr.id, b->hdr.name,
              shardd_dtype_name(b->dtype), b->numel);
}

void shardd__on_register_buffer(shardd__dispatch *d, shardd__conn *c,
                                uint64_t seq, const Shardwire__Request *req) {
  char err[ERRLEN];
  buf_undo u;
  shardd_err rc = buffer_register_one(d, c, req->register_buffer, &u, err,
                                      sizeof err);
  if (rc != SHARDD_OK) {
    shardd__reply(d, c, seq, rc, err);
    return;
  }
  int fd;
  uint8_t ipc[64];
  Shardwire__BufferReply br;
  rc = buffer_reply_fill(d, c, u.b, u.created, 0, &br, ipc, &fd, err,
                         sizeof err);
  if (rc != SHARDD_OK) {
    shardd__reply(d, c, seq, rc, err);
    return;
  }
  Shardwire__Response resp = ok_resp(seq, SHARDWIRE__RESPONSE__BODY_BUFFER);
  resp.buffer = &br;
  shardd__send_resp(d, c, &resp, fd);
  if (u.created)
    log_created(c, u.b);
}

void shardd__on_register_view(shardd__dispatch *d, shardd__conn *c,
                              uint64_t seq, const Shardwire__Request *req) {
  const Shardwire__RegisterView *rv = req->register_view;
  char err[ERRLEN];
  shardd__view *v;
  int created;
  if (rv->n_shape > 64) {
    shardd__reply(d, c, seq, SHARDD_E_RANGE, "view has over 64 dimensions");
    return;
  }
  shardd_err rc = shardd__view_register_ex(
      &d->reg, c->m.job, rv->buffer,
      rv->has_buffer_generation ? rv->buffer_generation : 0, rv->name,
      rv->offset, rv->numel, rv->shape, (int)rv->n_shape,
      rv->has_requires_grad ? rv->requires_grad : 1, &v, &created, err,
      sizeof err);
  if (rc != SHARDD_OK) {
    shardd__reply(d, c, seq, rc, err);
    return;
  }
  Shardwire__Response resp = ok_resp(seq, SHARDWIRE__RESPONSE__BODY_VIEW);
  Shardwire__ViewReply vr = SHARDWIRE__VIEW_REPLY__INIT;
  vr.id = v->hdr.id;
  vr.created = created;
  vr.has_generation = 1;
  vr.generation = v->hdr.generation;
  resp.view = &vr;
  shardd__send_resp(d, c, &resp, -1);
}

/* ---- batches of views ------------------------------------------------- */

/* Every entry is tried in order, so each is checked against the registry
 * and the entries before it exactly as n single requests would be; when
 * any is refused the ones this request created are abandoned, newest
 * first, and nothing is left of the batch. */
static void views_register(shardd__dispatch *d, shardd__conn *c, uint64_t seq,
                           const Shardwire__RegisterViews *rq) {
  size_t n = rq->n_views;
  char err[ERRLEN];
  batch_errs be;
  shardd__view **vs = shardd__req_scratch(d, n, sizeof *vs);
  Shardwire__ViewReply *vr = shardd__req_scratch(d, n, sizeof *vr);
  char *created = shardd__req_scratch(d, n, 1);
  if (vs == NULL || vr == NULL || created == NULL) {
    shardd__reply(d, c, seq, SHARDD_E_NO_MEMORY, "out of memory");
    return;
  }
  shardd__batch_errs_init(&be, n, rq->has_first_index ? rq->first_index : 0);
  for (size_t i = 0; i < n; i++) {
    const Shardwire__RegisterView *rv = rq->views[i];
    shardd_err rc;
    int cr = 0;
    if (rv->n_shape > 64) {
      rc = SHARDD_E_RANGE;
      snprintf(err, sizeof err, "view \"%s\" has over 64 dimensions", rv->name);
    } else {
      rc = shardd__view_register_ex(
          &d->reg, c->m.job, rv->buffer,
          rv->has_buffer_generation ? rv->buffer_generation : 0, rv->name,
          rv->offset, rv->numel, rv->shape, (int)rv->n_shape,
          rv->has_requires_grad ? rv->requires_grad : 1, &vs[i], &cr, err,
          sizeof err);
    }
    if (rc != SHARDD_OK)
      shardd__batch_err_add(&be, i, rc, err);
    created[i] = (char)cr;
  }
  if (be.total > 0) {
    for (size_t i = n; i-- > 0;)
      if (created[i])
        shardd__view_abandon(&d->reg, vs[i]);
    shardd__batch_refuse(d, c, seq, n, &be, "views");
  } else {
    for (size_t i = 0; i < n; i++) {
      shardwire__view_reply__init(&vr[i]);
      vr[i].id = vs[i]->hdr.id;
      vr[i].created = created[i];
      vr[i].has_generation = 1;
      vr[i].generation = vs[i]->hdr.generation;
    }
    shardd__send_views_reply(d, c, seq, vr, n);
  }
  shardd__batch_errs_free(&be);
}

/* What unregistering a batch of views and one of buffers differ in. */
typedef struct unreg_kind {
  const char *one;  /* "view", "buffer" */
  const char *what; /* the refusal's word for the entries */
  shardd_err (*check)(shardd__registry *reg, shardd__job *job, uint64_t id,
                      char *err, size_t errlen);
  shardd_err (*unregister)(shardd__registry *reg, shardd__job *job,
                           uint64_t id, char *err, size_t errlen);
  Shardwire__Response__BodyCase body;
} unreg_kind;

static const unreg_kind views_unreg = {
    "view", "view unregistrations", shardd__view_unregister_check,
    shardd__view_unregister, SHARDWIRE__RESPONSE__BODY_VIEWS_BATCH};

static const unreg_kind buffers_unreg = {
    "buffer", "buffer unregistrations", shardd__buffer_unregister_check,
    shardd__buffer_unregister, SHARDWIRE__RESPONSE__BODY_BUFFERS_BATCH};

/* Unregisters the n ids of a batch (gens: each one's generation, 0:
 * unchecked; first: the request's first index). Every id is checked before
 * any goes: registered, held by nothing that keeps it (k->check), its
 * generation current, named once; any refusal refuses the batch. */
static void batch_unregister(shardd__dispatch *d, shardd__conn *c,
                             uint64_t seq, const unreg_kind *k, size_t n,
                             uint32_t first, const uint64_t *ids,
                             const uint64_t *gens) {
  char err[ERRLEN];
  batch_errs be;
  shardd__batch_errs_init(&be, n, first);
  shardd__registry *reg = &d->reg;
  shardd__job *job = c->m.job;
  for (size_t i = 0; i < n; i++) {
    shardd_err rc;
    if (gens[i] != 0 &&
        shardd__registry_stale(reg, job, ids[i], gens[i], err, sizeof err))
      rc = SHARDD_E_STALE;
    else
      rc = k->check(reg, job, ids[i], err, sizeof err);
    if (rc != SHARDD_OK)
      shardd__batch_err_add(&be, i, rc, err);
  }
  if (be.total == 0 && n > 1) {
    /* every id resolved: the entries after the first naming one are
     * refused */
    uint64_t mark = shardd__registry_new_mark(reg);
    for (size_t i = 0; i < n; i++)
      if (!shardd__registry_mark_once(shardd__registry_get(reg, ids[i]), mark)) {
        snprintf(err, sizeof err, "%s %" PRIu64 " is named twice", k->one,
                 ids[i]);
        shardd__batch_err_add(&be, i, SHARDD_E_INVAL, err);
      }
  }
  if (be.total > 0) {
    shardd__batch_refuse(d, c, seq, n, &be, k->what);
  } else {
    for (size_t i = 0; i < n; i++)
      if (k->unregister(reg, job, ids[i], err, sizeof err) != SHARDD_OK)
        /* checked above and nothing ran between: a bug, said loudly */
        shardd__log(1, "job \"%s\": %s %" PRIu64 " passed its check but: %s",
                    job->name, k->one, ids[i], err);
    Shardwire__Response resp = ok_resp(seq, k->body);
    Shardwire__ViewsBatchReply vb = SHARDWIRE__VIEWS_BATCH_REPLY__INIT;
    Shardwire__BuffersBatchReply bb = SHARDWIRE__BUFFERS_BATCH_REPLY__INIT;
    if (k->body == SHARDWIRE__RESPONSE__BODY_VIEWS_BATCH)
      resp.views_batch = &vb;
    else
      resp.buffers_batch = &bb;
    shardd__send_resp(d, c, &resp, -1);
  }
  shardd__batch_errs_free(&be);
}

/* The ids and generations of a batch's entries, in two arrays of n (one
 * allocation, the request's: ids, then gens), or NULL when out of memory. */
static uint64_t *unreg_arrays(shardd__dispatch *d, size_t n) {
  return n > SIZE_MAX / 2 ? NULL
                          : shardd__req_scratch(d, 2 * (n ? n : 1), sizeof(uint64_t));
}

static void views_unregister(shardd__dispatch *d, shardd__conn *c, uint64_t seq,
                             const Shardwire__UnregisterViews *rq) {
  size_t n = rq->n_views;
  uint64_t *ids = unreg_arrays(d, n);
  if (ids == NULL) {
    shardd__reply(d, c, seq, SHARDD_E_NO_MEMORY, "out of memory");
    return;
  }
  for (size_t i = 0; i < n; i++) {
    const Shardwire__UnregisterView *uv = rq->views[i];
    ids[i] = uv->id;
    ids[n + i] = uv->has_generation ? uv->generation : 0;
  }
  batch_unregister(d, c, seq, &views_unreg, n,
                   rq->has_first_index ? rq->first_index : 0, ids, ids + n);
}

void shardd__on_views_batch(shardd__dispatch *d, shardd__conn *c, uint64_t seq,
                            const Shardwire__Request *req) {
  const Shardwire__ViewsBatch *vb = req->views_batch;
  if (vb->op_case == SHARDWIRE__VIEWS_BATCH__OP_REGISTER)
    views_register(d, c, seq, vb->register_);
  else if (vb->op_case == SHARDWIRE__VIEWS_BATCH__OP_UNREGISTER)
    views_unregister(d, c, seq, vb->unregister);
  else
    shardd__reply(d, c, seq, SHARDD_E_INVAL, "ViewsBatch names no operation");
}

/* ---- batches of buffers ----------------------------------------------- */

/* At most this many entries per request: the reply brings a descriptor per
 * entry, and a client may pass them on in one message (SCM_MAX_FD 253). */
#define BUFFERS_PER_REQUEST 250

/* For a client that maps blocks at offsets (Hello.blocks_at_offsets), the
 * blocks the batch makes come from one memfd per local rank (a slab), sized
 * for every entry that names no buffer of the job yet: five system calls
 * per rank for the batch, where a memfd per block took five each (and the
 * client four more for each descriptor). Unsized entries (a name twice)
 * only leave room the slab's close cuts away. */
static shardd_err batch_slabs_begin(shardd__dispatch *d, shardd__conn *c,
                                    const Shardwire__RegisterBuffers *rq,
                                    char *err, size_t errlen) {
  shardd__job *job = c->m.job;
  if (!c->at_offsets || rq->n_buffers < 2 || job == NULL)
    return SHARDD_OK;
  uint64_t bytes = 0;
  size_t nblocks = 0;
  for (size_t i = 0; i < rq->n_buffers; i++) {
    const Shardwire__RegisterBuffer *rb = rq->buffers[i];
    uint64_t b = shardd__buffer_block_bytes(job, (shardd_dtype)rb->dtype,
                                            rb->numel);
    if (b == 0 || shardd__map_get_str(&job->buffers, rb->name) != NULL)
      continue; /* refused or attached: no block */
    if (bytes > UINT64_MAX / 4 - b) /* past any device: alloc refuses it */
      return SHARDD_OK;
    bytes += b;
    nblocks++;
  }
  return shardd__buffer_slabs_begin(&d->reg, job, bytes, nblocks, err, errlen);
}

/* Where fd goes in a batch reply's descriptors fds[0..nfds): for a client
 * mapping at offsets once per file (br names its index), else once per
 * entry. Returns how many it added (0 or 1). */
static size_t fd_slot(const shardd__conn *c, int borrow, int *fds,
                      size_t nfds, int fd, Shardwire__BufferReply *br) {
  size_t k = 0;
  if (c->at_offsets) {
    while (k < nfds && fds[k] != fd)
      k++;
    br->has_fd_index = 1;
    br->fd_index = (uint32_t)k;
    if (k < nfds) {
      if (!borrow) /* a duplicate of one already listed */
        close(fd);
      return 0;
    }
  }
  fds[nfds] = fd;
  return 1;
}

/* Every entry is tried in order, as that many RegisterBuffer requests
 * would be; when any is refused (or a block cannot be exported) what the
 * request did is undone, newest first, and nothing is left of it. */
static void buffers_register(shardd__dispatch *d, shardd__conn *c, uint64_t seq,
                             const Shardwire__RegisterBuffers *rq) {
  size_t n = rq->n_buffers;
  char err[ERRLEN];
  if (n > BUFFERS_PER_REQUEST) {
    snprintf(err, sizeof err, "%zu buffers in one request, at most %d", n,
             BUFFERS_PER_REQUEST);
    shardd__reply(d, c, seq, SHARDD_E_LIMIT, err);
    return;
  }
  batch_errs be;
  buf_undo *u = calloc(n ? n : 1, sizeof *u);
  Shardwire__BufferReply *br = calloc(n ? n : 1, sizeof *br);
  Shardwire__BufferReply **brp = calloc(n ? n : 1, sizeof *brp);
  uint8_t *ipc = malloc((n ? n : 1) * 64);
  int *fds = malloc((n ? n : 1) * sizeof *fds);
  if (u == NULL || br == NULL || brp == NULL || ipc == NULL || fds == NULL) {
    free(u);
    free(br);
    free(brp);
    free(ipc);
    free(fds);
    shardd__reply(d, c, seq, SHARDD_E_NO_MEMORY, "out of memory");
    return;
  }
  shardd__batch_errs_init(&be, n, rq->has_first_index ? rq->first_index : 0);
  shardd_err src = batch_slabs_begin(d, c, rq, err, sizeof err);
  if (src != SHARDD_OK)
    shardd__batch_err_add(&be, 0, src, err);
  for (size_t i = 0; i < n && src == SHARDD_OK; i++) {
    shardd_err rc = buffer_register_one(d, c, rq->buffers[i], &u[i], err,
                                        sizeof err);
    if (rc != SHARDD_OK)
      shardd__batch_err_add(&be, i, rc, err);
  }
  /* sealed before any descriptor of them is sent */
  if (shardd__buffer_slabs_end(&d->reg, err, sizeof err) != SHARDD_OK &&
      be.total == 0)
    shardd__batch_err_add(&be, 0, SHARDD_E_IO, err);
  size_t nfds = 0;
  /* two or more: the blocks' own descriptors, sent before this returns or
   * duplicated by the transport (a duplicate and its close were two of
   * the daemon's seven system calls per buffer); one goes as a single
   * reply's, which owns its descriptor */
  int borrow = n > 1;
  for (size_t i = 0; i < n && be.total == 0; i++) {
    int fd;
    shardd_err rc = buffer_reply_fill(d, c, u[i].b, u[i].created, borrow,
                                      &br[i], ipc + 64 * i, &fd, err,
                                      sizeof err);
    if (rc != SHARDD_OK)
      shardd__batch_err_add(&be, i, rc, err);
    else if (fd >= 0)
      nfds += fd_slot(c, borrow, fds, nfds, fd, &br[i]);
    brp[i] = &br[i];
  }
  if (be.total > 0) {
    for (size_t i = 0; i < nfds && !borrow; i++)
      close(fds[i]);
    for (size_t i = n; i-- > 0;)
      buffer_undo(d, &u[i]);
    shardd__batch_refuse(d, c, seq, n, &be, "buffers");
  } else if (nfds != 0 && nfds != n && !c->at_offsets) {
    /* a backend exports every block alike: a bug, said loudly */
    for (size_t i = 0; i < nfds && !borrow; i++)
      close(fds[i]);
    for (size_t i = n; i-- > 0;)
      buffer_undo(d, &u[i]);
    shardd__reply(d, c, seq, SHARDD_E_INTERNAL, "some blocks exported a descriptor, "
                  "some not");
  } else {
    Shardwire__Response resp = ok_resp(seq, SHARDWIRE__RESPONSE__BODY_BUFFERS_BATCH);
    Shardwire__BuffersBatchReply bb = SHARDWIRE__BUFFERS_BATCH_REPLY__INIT;
    bb.n_buffers = n;
    bb.buffers = brp;
    resp.buffers_batch = &bb;
    shardd__send_resp_fds(d, c, &resp, fds, nfds, borrow);
    for (size_t i = 0; i < n; i++)
      if (u[i].created)
        log_created(c, u[i].b);
  }
  shardd__batch_errs_free(&be);
  free(u);
  free(br);
  free(brp);
  free(ipc);
  free(fds);
}

static void buffers_unregister(shardd__dispatch *d, shardd__conn *c,
                               uint64_t seq,
                               const Shardwire__UnregisterBuffers *rq) {
  size_t n = rq->n_buffers;
  uint64_t *ids = unreg_arrays(d, n);
  if (ids == NULL) {
    shardd__reply(d, c, seq, SHARDD_E_NO_MEMORY, "out of memory");
    return;
  }
  for (size_t i = 0; i < n; i++) {
    const Shardwire__UnregisterBuffer *ub = rq->buffers[i];
    ids[i] = ub->id;
    ids[n + i] = ub->has_generation ? ub->generation : 0;
  }
  batch_unregister(d, c, seq, &buffers_unreg, n,
                   rq->has_first_index ? rq->first_index : 0, ids, ids + n);
}

void shardd__on_buffers_batch(shardd__dispatch *d, shardd__conn *c,
                              uint64_t seq, const Shardwire__Request *req) {
  const Shardwire__BuffersBatch *bb = req->buffers_batch;
  if (bb->op_case == SHARDWIRE__BUFFERS_BATCH__OP_REGISTER)
    buffers_register(d, c, seq, bb->register_);
  else if (bb->op_case == SHARDWIRE__BUFFERS_BATCH__OP_UNREGISTER)
    buffers_unregister(d, c, seq, bb->unregister);
  else
    shardd__reply(d, c, seq, SHARDD_E_INVAL, "BuffersBatch names no operation");
}

void shardd__on_register_optimizer(shardd__dispatch *d, shardd__conn *c,
                                   uint64_t seq,
                                   const Shardwire__Request *req) {
  char err[ERRLEN];
  shardd__optspec spec;
  if (shardd__optspec_from_wire(req->register_optimizer, &spec) != SHARDD_OK) {
    shardd__reply(d, c, seq, SHARDD_E_NO_MEMORY, "out of memory");
    return;
  }
  shardd__optreg_result res;
  shardd_err rc = shardd__optreg_register(&d->reg, c->m.job, &spec,
                                          SHARDD__OPTREG_ATTACH, &res, err,
                                          sizeof err);
  shardd__optspec_free(&spec);
  if (rc == SHARDD_OK) {
    Shardwire__Response resp = ok_resp(seq, SHARDWIRE__RESPONSE__BODY_OPTIMIZER);
    Shardwire__OptimizerReply orp = SHARDWIRE__OPTIMIZER_REPLY__INIT;
    orp.id = res.optim->hdr.id;
    orp.created = res.created;
    resp.optimizer = &orp;
    shardd__send_resp(d, c, &resp, -1);
  } else if (res.refused) {
    shardd__reply(d, c, seq, rc, res.list ? res.list : "optimizer refused");
    shardd__log(3, "job \"%s\": optimizer refused: %s", c->m.job->name,
                res.list ? res.list : "");
  } else {
    shardd__reply(d, c, seq, rc, err);
  }
  free(res.list);
}

static void unregister(shardd__dispatch *d, shardd__conn *c, uint64_t seq,
                       shardd__obj_kind kind, uint64_t id, uint64_t gen) {
  char err[ERRLEN];
  shardd_err rc;
  shardd__registry *reg = &d->reg;
  shardd__job *job = c->m.job;
  if (gen != 0 && shardd__registry_stale(reg, job, id, gen, err, sizeof err))
    rc = SHARDD_E_STALE;
  else if (kind == SHARDD__OBJ_BUFFER)
    rc = shardd__buffer_unregister(reg, job, id, err, sizeof err);
  else if (kind == SHARDD__OBJ_VIEW)
    rc = shardd__view_unregister(reg, job, id, err, sizeof err);
  else
    rc = shardd__optim_unregister(reg, job, id, err, sizeof err);
  shardd__reply(d, c, seq, rc, rc == SHARDD_OK ? NULL : err);
}

void shardd__on_unregister_buffer(shardd__dispatch *d, shardd__conn *c,
                                  uint64_t seq, const Shardwire__Request *req) {
  unregister(d, c, seq, SHARDD__OBJ_BUFFER, req->unregister_buffer->id,
             req->unregister_buffer->generation);
}

void shardd__on_unregister_view(shardd__dispatch *d, shardd__conn *c,
                                uint64_t seq, const Shardwire__Request *req) {
  unregister(d, c, seq, SHARDD__OBJ_VIEW, req->unregister_view->id,
             req->unregister_view->generation);
}

void shardd__on_unregister_optimizer(shardd__dispatch *d, shardd__conn *c,
                                     uint64_t seq,
                                     const Shardwire__Request *req) {
  unregister(d, c, seq, SHARDD__OBJ_OPTIM, req->unregister_optimizer->id, 0);
}

/* ---- a views batch registration decoded by hand -----------------------
 *
 * protobuf-c decoded a views batch at about 1.9k instructions a view (a
 * descriptor walk, a field lookup per field, a malloc'd scan list per
 * message), as much as registering the view. The shape every client sends
 * (seq, then a ViewsBatch whose RegisterViews lists entries of the plain
 * fields, shape unpacked) is read here into the same structures protobuf-c
 * would fill; anything else (an unknown or repeated field, a packed shape
 * or over 64 dimensions, a varint past 63 bits, a required field missing,
 * an unregistration) returns NULL and protobuf-c decodes it, so what a
 * request means never depends on the path. Every piece is bounded by the
 * frame: the entries are counted before their list is allocated, a name
 * takes its bytes and one, a shape its dimensions. */

/* one RegisterView's fields (each at most once; shape's in a row or not) */
static int decode_view(shardd__wire *w, shardd__decode_alloc alloc, void *ctx,
                       Shardwire__RegisterView *rv) {
  uint32_t field, wt, seen = 0;
  uint64_t v = 0;
  shardd__wire sub = {NULL, NULL};
  int64_t shape[64];
  size_t nshape = 0;
  while (w->p < w->end) {
    if (!shardd__wire_field(w, &field, &wt, &v, &sub) || field > 7 ||
        (wt == 2) != (field == 2) || (field != 5 && (seen & (1u << field))))
      return 0;
    seen |= 1u << field;
    switch (field) {
    case 1:
      rv->buffer = v;
      break;
    case 2: {
      size_t n = (size_t)(sub.end - sub.p);
      char *s = alloc(ctx, n + 1);
      if (s == NULL)
        return 0;
      memcpy(s, sub.p, n);
      s[n] = '\0';
      rv->name = s;
      break;
    }
    case 3:
      rv->offset = v;
      break;
    case 4:
      rv->numel = v;
      break;
    case 5:
      if (nshape == 64) /* refused after decoding: protobuf-c's */
        return 0;
      shape[nshape++] = (int64_t)v;
      break;
    case 6:
      rv->has_requires_grad = 1;
      rv->requires_grad = v != 0;
      break;
    case 7:
      rv->has_buffer_generation = 1;
      rv->buffer_generation = v;
      break;
    default:
      return 0;
    }
  }
  if ((seen & 0x1e) != 0x1e) /* buffer, name, offset, numel are required */
    return 0;
  if (nshape > 0) {
    rv->shape = alloc(ctx, nshape * sizeof *rv->shape);
    if (rv->shape == NULL)
      return 0;
    memcpy(rv->shape, shape, nshape * sizeof *rv->shape);
    rv->n_shape = nshape;
  }
  return 1;
}

/* a RegisterViews: its entries and first_index */
static int decode_views(shardd__wire *w, shardd__decode_alloc alloc, void *ctx,
                        Shardwire__RegisterViews *rq) {
  uint64_t v = 0;
  uint32_t field, wt;
  shardd__wire sub = {NULL, NULL}, scan = *w;
  size_t n = 0;
  while (scan.p < scan.end) {
    if (!shardd__wire_field(&scan, &field, &wt, &v, &sub))
      return 0;
    n += field == 1 && wt == 2;
  }
  Shardwire__RegisterView **list = NULL, *mem = NULL;
  if (n > 0) {
    list = alloc(ctx, n * sizeof *list);
    mem = alloc(ctx, n * sizeof *mem);
    if (list == NULL || mem == NULL)
      return 0;
  }
  size_t k = 0;
  int has_first = 0;
  uint64_t first = 0;
  while (w->p < w->end) {
    if (!shardd__wire_field(w, &field, &wt, &v, &sub))
      return 0; /* not after the scan: for the compiler */
    if (field == 1 && wt == 2) {
      Shardwire__RegisterView init = SHARDWIRE__REGISTER_VIEW__INIT;
      mem[k] = init;
      if (!decode_view(&sub, alloc, ctx, &mem[k]))
        return 0;
      list[k] = &mem[k];
      k++;
    } else if (field == 2 && wt == 0 && !has_first && v <= UINT32_MAX) {
      has_first = 1;
      first = v;
    } else {
      return 0;
    }
  }
  rq->n_views = n;
  rq->views = list;
  rq->has_first_index = has_first;
  rq->first_index = (uint32_t)first;
  return 1;
}

Shardwire__Request *shardd__views_decode(shardd__decode_alloc alloc, void *ctx,
                                         const uint8_t *payload, size_t len) {
  shardd__wire sub = {NULL, NULL}, reg = {NULL, NULL};
  uint64_t v = 0, seq = 0;
  uint32_t field, wt;
  /* the ViewsBatch: its register list alone */
  if (!shardd__wire_seq_body(payload, len, 32, &seq, &sub) ||
      !shardd__wire_field(&sub, &field, &wt, &v, &reg) || field != 1 ||
      wt != 2 || sub.p != sub.end)
    return NULL;
  Shardwire__Request rinit = SHARDWIRE__REQUEST__INIT;
  Shardwire__ViewsBatch binit = SHARDWIRE__VIEWS_BATCH__INIT;
  Shardwire__RegisterViews vinit = SHARDWIRE__REGISTER_VIEWS__INIT;
  Shardwire__Request *req = alloc(ctx, sizeof *req);
  Shardwire__ViewsBatch *vb = alloc(ctx, sizeof *vb);
  Shardwire__RegisterViews *rq = alloc(ctx, sizeof *rq);
  if (req == NULL || vb == NULL || rq == NULL)
    return NULL;
  *req = rinit;
  *vb = binit;
  *rq = vinit;
  if (!decode_views(&reg, alloc, ctx, rq))
    return NULL;
  vb->op_case = SHARDWIRE__VIEWS_BATCH__OP_REGISTER;
  vb->register_ = rq;
  req->seq = seq;
  req->body_case = SHARDWIRE__REQUEST__BODY_VIEWS_BATCH;
  req->views_batch = vb;
  return req;
}
