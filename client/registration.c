/* registration.c — what a rank registers: buffers (their blocks mapped by
 * mappings.c), views and optimizers, one at a time and in batches (all or
 * nothing: a refused batch undoes what earlier requests of the call made),
 * and their unregistration. */
#include <inttypes.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "client_int.h"
#include "varint.h"

shardd_err shardd_buffer_register(shardd_client_t *c, const char *name,
                                  shardd_dtype dtype, uint64_t numel,
                                  shardd_buffer_info *out) {
  return shardd_buffer_register_opts(c, name, dtype, numel, NULL, out);
}

shardd_err shardd_buffer_register_opts(shardd_client_t *c, const char *name,
                                       shardd_dtype dtype, uint64_t numel,
                                       const shardd_buffer_opts *opts,
                                       shardd_buffer_info *out) {
  if (c == NULL)
    return SHARDD_E_INVAL; /* no client to hold a message */
  if (out == NULL)
    return shardd__set_err(c, SHARDD_E_INVAL,
                           "shardd_buffer_register: out is NULL");

  memset(out, 0, sizeof *out);
  if (name == NULL)
    return shardd__set_err(c, SHARDD_E_INVAL, "buffer name is NULL");
  Shardwire__Request req = SHARDWIRE__REQUEST__INIT;
  Shardwire__RegisterBuffer rb = SHARDWIRE__REGISTER_BUFFER__INIT;
  rb.name = (char *)name;
  rb.dtype = (Shardwire__DType)dtype;
  rb.numel = numel;
  if (opts && opts->size >= offsetof(shardd_buffer_opts, init_checksum) +
                                sizeof opts->init_checksum &&
      opts->has_init_checksum) {
    rb.has_init_checksum = 1;
    rb.init_checksum = opts->init_checksum;
  }
  req.body_case = SHARDWIRE__REQUEST__BODY_REGISTER_BUFFER;
  req.register_buffer = &rb;
  Shardwire__Response *resp;
  int fd;
  shardd_err rc = shardd__call_expect(c, &req, SHARDWIRE__RESPONSE__BODY_BUFFER,
                                      &resp, &fd);
  if (rc != SHARDD_OK) {
    if (resp)
      shardwire__response__free_unpacked(resp, NULL);
    return rc;
  }
  rc = shardd__buffer_adopt(c, resp->buffer, fd, NULL, out);
  if (rc != SHARDD_OK)
    memset(out, 0, sizeof *out);
  if (fd >= 0)
    close(fd);
  shardwire__response__free_unpacked(resp, NULL);
  return rc;
}

shardd_err shardd_buffer_unregister(shardd_client_t *c, uint64_t buffer) {
  if (c == NULL)
    return SHARDD_E_INVAL; /* no client to hold a message */

  Shardwire__Request req = SHARDWIRE__REQUEST__INIT;
  Shardwire__UnregisterBuffer ub = SHARDWIRE__UNREGISTER_BUFFER__INIT;
  ub.id = buffer;
  req.body_case = SHARDWIRE__REQUEST__BODY_UNREGISTER_BUFFER;
  req.unregister_buffer = &ub;
  shardd_err rc = shardd__call_status_only(c, &req);
  if (rc == SHARDD_OK)
    shardd__unmap_buffer(c, buffer);
  return rc;
}

shardd_err shardd_view_register(shardd_client_t *c, uint64_t buffer,
                                const char *name, uint64_t offset,
                                uint64_t numel, const int64_t *shape, int ndim,
                                uint64_t *out_id) {
  if (c == NULL)
    return SHARDD_E_INVAL; /* no client to hold a message */

  if (out_id)
    *out_id = 0;
  if (name == NULL || ndim < 0 || (ndim > 0 && shape == NULL))
    return shardd__set_err(c, SHARDD_E_INVAL, "view: NULL name or shape");
  Shardwire__Request req = SHARDWIRE__REQUEST__INIT;
  Shardwire__RegisterView rv = SHARDWIRE__REGISTER_VIEW__INIT;
  rv.buffer = buffer;
  rv.name = (char *)name;
  rv.offset = offset;
  rv.numel = numel;
  rv.n_shape = (size_t)ndim;
  rv.shape = (int64_t *)shape;
  req.body_case = SHARDWIRE__REQUEST__BODY_REGISTER_VIEW;
  req.register_view = &rv;
  Shardwire__Response *resp;
  shardd_err rc =
      shardd__call_expect(c, &req, SHARDWIRE__RESPONSE__BODY_VIEW, &resp, NULL);
  if (rc == SHARDD_OK && out_id)
    *out_id = resp->view->id;
  if (resp)
    shardwire__response__free_unpacked(resp, NULL);
  return rc;
}

shardd_err shardd_view_register_ex(shardd_client_t *c, uint64_t buffer,
                                   const char *name, uint64_t offset,
                                   uint64_t numel, const int64_t *shape,
                                   int ndim, const shardd_view_opts *opts,
                                   shardd_view_info *out) {
  if (c == NULL)
    return SHARDD_E_INVAL; /* no client to hold a message */

  if (out)
    memset(out, 0, sizeof *out);
  if (name == NULL || ndim < 0 || (ndim > 0 && shape == NULL))
    return shardd__set_err(c, SHARDD_E_INVAL, "view: NULL name or shape");
  shardd_view_opts o = SHARDD_VIEW_OPTS_INIT;
  if (opts) { /* an older caller's smaller struct keeps the defaults after it */
    size_t n = opts->size < sizeof o ? opts->size : sizeof o;
    memcpy(&o, opts, n);
    o.size = sizeof o;
  }
  Shardwire__Request req = SHARDWIRE__REQUEST__INIT;
  Shardwire__RegisterView rv = SHARDWIRE__REGISTER_VIEW__INIT;
  rv.buffer = buffer;
  rv.name = (char *)name;
  rv.offset = offset;
  rv.numel = numel;
  rv.n_shape = (size_t)ndim;
  rv.shape = (int64_t *)shape;
  if (!o.requires_grad) {
    rv.has_requires_grad = 1;
    rv.requires_grad = 0;
  }
  if (o.buffer_generation) {
    rv.has_buffer_generation = 1;
    rv.buffer_generation = o.buffer_generation;
  }
  req.body_case = SHARDWIRE__REQUEST__BODY_REGISTER_VIEW;
  req.register_view = &rv;
  Shardwire__Response *resp;
  shardd_err rc =
      shardd__call_expect(c, &req, SHARDWIRE__RESPONSE__BODY_VIEW, &resp, NULL);
  if (rc == SHARDD_OK && out) {
    out->id = resp->view->id;
    out->generation = resp->view->has_generation ? resp->view->generation : 0;
    out->created = resp->view->created;
  }
  if (resp)
    shardwire__response__free_unpacked(resp, NULL);
  return rc;
}

shardd_err shardd_view_unregister(shardd_client_t *c, uint64_t view) {
  if (c == NULL)
    return SHARDD_E_INVAL; /* no client to hold a message */

  Shardwire__Request req = SHARDWIRE__REQUEST__INIT;
  Shardwire__UnregisterView uv = SHARDWIRE__UNREGISTER_VIEW__INIT;
  uv.id = view;
  req.body_case = SHARDWIRE__REQUEST__BODY_UNREGISTER_VIEW;
  req.unregister_view = &uv;
  return shardd__call_status_only(c, &req);
}

/* The refused (or, for a bucket, failed) entries' codes from a batch
 * reply of any kind: views, buffers or bucket (indices count from the
 * call's first entry; only those of [lo, hi), the request's, are taken). */
static void batch_errs_fill(const Shardwire__Response *resp, size_t lo,
                            size_t hi, shardd_err *errs) {
  if (errs == NULL || resp == NULL)
    return;
  size_t n = 0;
  Shardwire__BatchError **e = NULL;
  switch (resp->body_case) {
  case SHARDWIRE__RESPONSE__BODY_VIEWS_BATCH:
    n = resp->views_batch->n_errors;
    e = resp->views_batch->errors;
    break;
  case SHARDWIRE__RESPONSE__BODY_BUFFERS_BATCH:
    n = resp->buffers_batch->n_errors;
    e = resp->buffers_batch->errors;
    break;
  case SHARDWIRE__RESPONSE__BODY_BUCKET:
    n = resp->bucket->n_errors;
    e = resp->bucket->errors;
    break;
  default:
    return;
  }
  for (size_t k = 0; k < n; k++)
    if (e[k]->index >= lo && e[k]->index < hi)
      errs[e[k]->index] = (shardd_err)e[k]->code;
}

/* A request of [lo, hi) of a call of n entries failed with rc (resp: its
 * reply, or NULL): errs gets the daemon's per-entry codes and E_STATE for
 * the entries after the request (never sent), and last_error, which lists
 * the daemon's refusals (indices from the call's first entry), says what
 * became of those: "and N entries after them <after>". */
void shardd__batch_fail(shardd_client_t *c, shardd_err rc,
                        const Shardwire__Response *resp, size_t lo, size_t hi,
                        size_t n, shardd_err *errs, const char *after) {
  batch_errs_fill(resp, lo, hi, errs);
  if (errs)
    for (size_t i = hi; i < n; i++)
      errs[i] = SHARDD_E_STATE;
  if (hi == n)
    return;
  char *copy = strdup(shardd_last_error(c));
  if (copy == NULL)
    return;
  shardd__set_err(c, rc, "%s; and %zu entries after them %s", copy, n - hi,
                  after);
  free(copy);
}

/* ---- batches of buffers and of views: one runner ---------------------- */

/* A request's share of the frame for views: a quarter of the limit, so the
 * largest names and shapes still fit (256 views of 255-byte names and 64
 * dimensions are ~0.3 MiB; the count, not the bytes, cuts in practice). */
#define VIEWS_REQ_BYTES (SHARDD_MAX_FRAME / 4)

/* The wire messages of one batch request, on the runner's stack. */
typedef struct batch_msg {
  Shardwire__Request req;
  Shardwire__ViewsBatch vb;
  Shardwire__RegisterViews rv;
  Shardwire__UnregisterViews uv;
  Shardwire__BuffersBatch bb;
  Shardwire__RegisterBuffers rb;
  Shardwire__UnregisterBuffers ub;
} batch_msg;

/* What a batch of buffers and one of views differ in; batch_register and
 * batch_unregister do the rest for both. */
typedef struct batch_kind {
  const char *noun, *one; /* "views", "view": in messages */
  const char *reg_fn, *unreg_fn, *spec_init;
  size_t min_spec; /* a spec's size up to the last field read */
  size_t out_size; /* one entry of out */
  int needs_out;   /* out may not be NULL (buffers: their mappings) */
  int takes_fds;   /* the reply to a registration brings descriptors */
  size_t per_request;
  size_t reg_size, unreg_size; /* one wire entry */
  Shardwire__Response__BodyCase body;
  /* Checks spec entry i (a copy of the caller's, sp) and fills w. */
  shardd_err (*reg_entry)(shardd_client_t *c, const void *sp, size_t stride,
                          size_t i, void *w, shardd_err *errs);
  /* one wire entry's packed bytes, where requests are bounded in bytes */
  size_t (*reg_packed)(const void *w);
  void (*unreg_entry)(void *w, uint64_t id, uint64_t generation);
  /* The request of [lo, hi): wp its entries' pointers. */
  void (*request)(batch_msg *m, int reg, void **wp, size_t lo, size_t hi);
  size_t (*reply_count)(const Shardwire__Response *resp);
  /* Takes a registration reply's entries [lo, hi) (fds: nfds descriptors,
   * one per entry, or none): out[i], and the ids created into made. */
  shardd_err (*take)(shardd_client_t *c, const Shardwire__Response *resp,
                     size_t lo, size_t hi, const int *fds, int nfds,
                     void *out, uint64_t *made, size_t *nmade);
  /* after a request unregistering ids [lo, hi) succeeded, or NULL */
  void (*unregistered)(shardd_client_t *c, const uint64_t *ids, size_t lo,
                       size_t hi);
} batch_kind;

static shardd_err view_entry(shardd_client_t *c, const void *sp,
                             size_t stride, size_t i, void *w,
                             shardd_err *errs) {
  shardd_view_spec e = SHARDD_VIEW_SPEC_INIT;
  memcpy(&e, sp, stride < sizeof e ? stride : sizeof e);
  if (e.name == NULL || e.ndim < 0 || (e.ndim > 0 && e.shape == NULL)) {
    if (errs)
      errs[i] = SHARDD_E_INVAL;
    return shardd__set_err(c, SHARDD_E_INVAL,
                           "views: entry %zu has a NULL name or "
                           "shape; nothing was sent",
                           i);
  }
  Shardwire__RegisterView *rv = w;
  shardwire__register_view__init(rv);
  rv->buffer = e.buffer;
  rv->name = (char *)e.name;
  rv->offset = e.offset;
  rv->numel = e.numel;
  rv->n_shape = (size_t)e.ndim;
  rv->shape = (int64_t *)e.shape;
  if (!e.requires_grad) {
    rv->has_requires_grad = 1;
    rv->requires_grad = 0;
  }
  if (e.buffer_generation) {
    rv->has_buffer_generation = 1;
    rv->buffer_generation = e.buffer_generation;
  }
  return SHARDD_OK;
}

static shardd_err buffer_entry(shardd_client_t *c, const void *sp,
                               size_t stride, size_t i, void *w,
                               shardd_err *errs) {
  shardd_buffer_spec e = SHARDD_BUFFER_SPEC_INIT;
  memcpy(&e, sp, stride < sizeof e ? stride : sizeof e);
  if (e.name == NULL) {
    if (errs)
      errs[i] = SHARDD_E_INVAL;
    return shardd__set_err(c, SHARDD_E_INVAL,
                           "buffers: entry %zu has a NULL name; "
                           "nothing was sent",
                           i);
  }
  Shardwire__RegisterBuffer *rb = w;
  shardwire__register_buffer__init(rb);
  rb->name = (char *)e.name;
  rb->dtype = (Shardwire__DType)e.dtype;
  rb->numel = e.numel;
  if (e.has_init_checksum) {
    rb->has_init_checksum = 1;
    rb->init_checksum = e.init_checksum;
  }
  return SHARDD_OK;
}

static size_t view_packed(const void *w) {
  return shardwire__register_view__get_packed_size(w);
}

static void view_unentry(void *w, uint64_t id, uint64_t generation) {
  Shardwire__UnregisterView *u = w;
  shardwire__unregister_view__init(u);
  u->id = id;
  if (generation) {
    u->has_generation = 1;
    u->generation = generation;
  }
}

static void buffer_unentry(void *w, uint64_t id, uint64_t generation) {
  Shardwire__UnregisterBuffer *u = w;
  shardwire__unregister_buffer__init(u);
  u->id = id;
  if (generation) {
    u->has_generation = 1;
    u->generation = generation;
  }
}

static void views_request(batch_msg *m, int reg, void **wp, size_t lo,
                          size_t hi) {
  shardwire__views_batch__init(&m->vb);
  if (reg) {
    shardwire__register_views__init(&m->rv);
    m->rv.n_views = hi - lo;
    m->rv.views = (Shardwire__RegisterView **)wp;
    m->rv.has_first_index = lo > 0;
    m->rv.first_index = (uint32_t)lo;
    m->vb.op_case = SHARDWIRE__VIEWS_BATCH__OP_REGISTER;
    m->vb.register_ = &m->rv;
  } else {
    shardwire__unregister_views__init(&m->uv);
    m->uv.n_views = hi - lo;
    m->uv.views = (Shardwire__UnregisterView **)wp;
    m->uv.has_first_index = lo > 0;
    m->uv.first_index = (uint32_t)lo;
    m->vb.op_case = SHARDWIRE__VIEWS_BATCH__OP_UNREGISTER;
    m->vb.unregister = &m->uv;
  }
  m->req.body_case = SHARDWIRE__REQUEST__BODY_VIEWS_BATCH;
  m->req.views_batch = &m->vb;
}

static void buffers_request(batch_msg *m, int reg, void **wp, size_t lo,
                            size_t hi) {
  shardwire__buffers_batch__init(&m->bb);
  if (reg) {
    shardwire__register_buffers__init(&m->rb);
    m->rb.n_buffers = hi - lo;
    m->rb.buffers = (Shardwire__RegisterBuffer **)wp;
    m->rb.has_first_index = lo > 0;
    m->rb.first_index = (uint32_t)lo;
    m->bb.op_case = SHARDWIRE__BUFFERS_BATCH__OP_REGISTER;
    m->bb.register_ = &m->rb;
  } else {
    shardwire__unregister_buffers__init(&m->ub);
    m->ub.n_buffers = hi - lo;
    m->ub.buffers = (Shardwire__UnregisterBuffer **)wp;
    m->ub.has_first_index = lo > 0;
    m->ub.first_index = (uint32_t)lo;
    m->bb.op_case = SHARDWIRE__BUFFERS_BATCH__OP_UNREGISTER;
    m->bb.unregister = &m->ub;
  }
  m->req.body_case = SHARDWIRE__REQUEST__BODY_BUFFERS_BATCH;
  m->req.buffers_batch = &m->bb;
}

static size_t views_count(const Shardwire__Response *resp) {
  return resp->views_batch->n_views;
}

static size_t buffers_count(const Shardwire__Response *resp) {
  return resp->buffers_batch->n_buffers;
}

static shardd_err views_take(shardd_client_t *c,
                             const Shardwire__Response *resp, size_t lo,
                             size_t hi, const int *fds, int nfds, void *out,
                             uint64_t *made, size_t *nmade) {
  shardd_view_info *vi = out;
  for (size_t i = lo; i < hi; i++) {
    const Shardwire__ViewReply *r = resp->views_batch->views[i - lo];
    if (vi) {
      vi[i].id = r->id;
      vi[i].generation = r->has_generation ? r->generation : 0;
      vi[i].created = r->created;
    }
    if (r->created)
      made[(*nmade)++] = r->id;
  }
  return SHARDD_OK;
}

static shardd_err buffers_take(shardd_client_t *c,
                               const Shardwire__Response *resp, size_t lo,
                               size_t hi, const int *fds, int nfds, void *out,
                               uint64_t *made, size_t *nmade) {
  for (size_t i = lo; i < hi; i++) {
    const Shardwire__BufferReply *br = resp->buffers_batch->buffers[i - lo];
    if (br->created)
      made[(*nmade)++] = br->id;
  }
  shardd_err rc = SHARDD_OK;
  /* each descriptor's checks once, for every block it holds */
  shardd__fd_fit *fit = nfds > 0 ? malloc((size_t)nfds * sizeof *fit) : NULL;
  if (nfds > 0 && fit == NULL)
    return shardd__set_err(c, SHARDD_E_NO_MEMORY, "out of memory");
  for (int k = 0; k < nfds; k++)
    fit[k].size = -1;
  for (size_t i = lo; i < hi && rc == SHARDD_OK; i++) {
    const Shardwire__BufferReply *br = resp->buffers_batch->buffers[i - lo];
    /* one descriptor per entry, or (blocks at offsets) the one it names */
    size_t k = br->has_fd_index ? br->fd_index : i - lo;
    if (nfds > 0 && k >= (size_t)nfds)
      rc = shardd__set_err(c, SHARDD_E_PROTOCOL, "buffer %" PRIu64 ": its "
                           "block in descriptor %zu of the %d the reply "
                           "brought", br->id, k, nfds);
    else
      rc = shardd__buffer_adopt(c, br, nfds ? fds[k] : -1, nfds ? &fit[k] : NULL,
                                &((shardd_buffer_info *)out)[i]);
  }
  free(fit);
  return rc;
}

static void buffers_unregistered(shardd_client_t *c, const uint64_t *ids,
                                 size_t lo, size_t hi) {
  for (size_t i = lo; i < hi; i++)
    shardd__unmap_buffer(c, ids[i]);
}

static const batch_kind views_kind = {
    .noun = "views",
    .one = "view",
    .reg_fn = "shardd_views_register",
    .unreg_fn = "shardd_views_unregister",
    .spec_init = "SHARDD_VIEW_SPEC_INIT",
    .min_spec = offsetof(shardd_view_spec, requires_grad) + sizeof(int),
    .out_size = sizeof(shardd_view_info),
    .per_request = SHARDD_VIEWS_PER_REQUEST,
    .reg_size = sizeof(Shardwire__RegisterView),
    .unreg_size = sizeof(Shardwire__UnregisterView),
    .body = SHARDWIRE__RESPONSE__BODY_VIEWS_BATCH,
    .reg_entry = view_entry,
    .reg_packed = view_packed,
    .unreg_entry = view_unentry,
    .request = views_request,
    .reply_count = views_count,
    .take = views_take,
};

static const batch_kind buffers_kind = {
    .noun = "buffers",
    .one = "buffer",
    .reg_fn = "shardd_buffers_register",
    .unreg_fn = "shardd_buffers_unregister",
    .spec_init = "SHARDD_BUFFER_SPEC_INIT",
    .min_spec = offsetof(shardd_buffer_spec, init_checksum) + sizeof(uint64_t),
    .out_size = sizeof(shardd_buffer_info),
    .needs_out = 1,
    .takes_fds = 1,
    .per_request = SHARDD_BUFFERS_PER_REQUEST,
    .reg_size = sizeof(Shardwire__RegisterBuffer),
    .unreg_size = sizeof(Shardwire__UnregisterBuffer),
    .body = SHARDWIRE__RESPONSE__BODY_BUFFERS_BATCH,
    .reg_entry = buffer_entry,
    .unreg_entry = buffer_unentry,
    .request = buffers_request,
    .reply_count = buffers_count,
    .take = buffers_take,
    .unregistered = buffers_unregistered,
};

/* Entries [lo, end) of one request: at most k->per_request, and where k
 * bounds requests in bytes at most VIEWS_REQ_BYTES packed (at least one). */
static size_t batch_chunk_end(const batch_kind *k, const size_t *sizes,
                              size_t lo, size_t n) {
  size_t hi = lo, bytes = 0;
  while (hi < n && hi - lo < k->per_request) {
    if (sizes) {
      size_t b = sizes[hi] + 8;
      if (hi > lo && bytes + b > VIEWS_REQ_BYTES)
        break;
      bytes += b;
    }
    hi++;
  }
  return hi;
}

shardd_err shardd__views_request_pack(uint64_t seq,
                                      Shardwire__RegisterView *const *views,
                                      const size_t *sizes, size_t n,
                                      uint32_t first_index, uint8_t **buf,
                                      size_t *len) {
  /* Request { seq = 1; views_batch = 32 { register = 1 { views = 1 ...;
   * first_index = 2 } } }, in field order as protobuf-c writes it */
  size_t rv = 0;
  for (size_t i = 0; i < n; i++)
    rv += 1 + shardd__varint_len(sizes[i]) + sizes[i];
  if (first_index > 0)
    rv += 1 + shardd__varint_len(first_index);
  size_t vb = 1 + shardd__varint_len(rv) + rv;
  *len = 1 + shardd__varint_len(seq) + 2 + shardd__varint_len(vb) + vb;
  *buf = NULL;
  if (*len > SHARDD_MAX_FRAME)
    return SHARDD_E_FRAME_TOO_LARGE;
  uint8_t *p = *buf = malloc(*len);
  if (p == NULL)
    return SHARDD_E_NO_MEMORY;
  *p++ = 0x08; /* 1, varint */
  p = shardd__varint_put(p, seq);
  *p++ = 0x82; /* 32, length-delimited */
  *p++ = 0x02;
  p = shardd__varint_put(p, vb);
  *p++ = 0x0a; /* 1, length-delimited */
  p = shardd__varint_put(p, rv);
  for (size_t i = 0; i < n; i++) {
    *p++ = 0x0a;
    p = shardd__varint_put(p, sizes[i]);
    p += shardwire__register_view__pack(views[i], p);
  }
  if (first_index > 0) {
    *p++ = 0x10; /* 2, varint */
    p = shardd__varint_put(p, first_index);
  }
  if ((size_t)(p - *buf) != *len) { /* sizes[] not the entries' */
    free(*buf);
    *buf = NULL;
    return SHARDD_E_INTERNAL;
  }
  return SHARDD_OK;
}

/* One request of a batch ([lo, hi) of its entries), packed. */
typedef struct batch_req {
  uint8_t *buf; /* the packed request until it is sent (then NULL) */
  size_t n;
  uint64_t seq;
  size_t lo, hi;
  /* every entry's packed size (borrowed), where requests are bounded in
   * bytes and packed by hand; NULL: protobuf-c packs them */
  const size_t *sizes;
} batch_req;

/* Packs the request of entries [lo, hi) (wp their pointers) into q. */
static shardd_err batch_pack(shardd_client_t *c, const batch_kind *k, int reg,
                             void **wp, size_t lo, size_t hi, batch_req *q) {
  q->lo = lo;
  q->hi = hi;
  if (reg && q->sizes) {
    /* views: the envelope written here around each entry packed once,
     * with the sizes taken for the request bounds (protobuf-c's pack
     * sized every entry again at each of the four levels above it) */
    q->seq = ++c->seq;
    shardd_err rc = shardd__views_request_pack(
        q->seq, (Shardwire__RegisterView *const *)wp, q->sizes + lo, hi - lo,
        (uint32_t)lo, &q->buf, &q->n);
    if (rc == SHARDD_E_FRAME_TOO_LARGE)
      return shardd__set_err(c, rc, "request of %zu bytes exceeds the %u-byte "
                             "frame limit", q->n, SHARDD_MAX_FRAME);
    if (rc != SHARDD_OK)
      return shardd__set_err(c, rc, "packing a request of %zu views: %s",
                             hi - lo, shardd_strerror(rc));
    return SHARDD_OK;
  }
  batch_msg m;
  shardwire__request__init(&m.req);
  k->request(&m, reg, wp, lo, hi);
  q->lo = lo;
  q->hi = hi;
  shardd_err rc = shardd__req_pack(c, &m.req, &q->buf, &q->n);
  q->seq = m.req.seq;
  return rc;
}

static shardd_err batch_send(shardd_client_t *c, batch_req *q) {
  uint8_t *buf = q->buf;
  q->buf = NULL;
  return shardd__send_packed(c, buf, q->n);
}

/* Reads the reply to q (sent), its body and (for a registration) its
 * entries checked; a registration reply's descriptors come in fds
 * (*nfds, one per entry). */
static shardd_err batch_reply(shardd_client_t *c, const batch_kind *k, int reg,
                              const batch_req *q, Shardwire__Response **resp,
                              int *fds, int *nfds) {
  size_t lo = q->lo, hi = q->hi;
  shardd_err rc = shardd__recv_for_many(c, q->seq, resp, NULL, fds,
                                        SHARDD_BUFFERS_PER_REQUEST, nfds);
  if (rc != SHARDD_OK)
    return rc;
  if ((*resp)->body_case != k->body)
    return shardd__set_err(c, SHARDD_E_PROTOCOL,
                           "the daemon answered with body %d to "
                           "a batch of %s",
                           (int)(*resp)->body_case, k->noun);
  if (reg && k->reply_count(*resp) != hi - lo)
    return shardd__set_err(c, SHARDD_E_PROTOCOL,
                           "the daemon answered %zu %s for "
                           "a request of %zu",
                           k->reply_count(*resp), k->noun, hi - lo);
  /* one per entry, or (its blocks in slabs) each entry's named by index:
   * buffers_take checks each index */
  if (reg && k->takes_fds && *nfds != 0 && (size_t)*nfds != hi - lo &&
      !(hi > lo && (*resp)->buffers_batch->buffers[0]->has_fd_index))
    return shardd__set_err(c, SHARDD_E_PROTOCOL,
                           "the daemon sent %d descriptors for "
                           "%zu %s",
                           *nfds, hi - lo, k->noun);
  return SHARDD_OK;
}

/* Sends one request of a batch ([lo, hi) of entries wp) and reads its
 * reply (batch_reply). */
static shardd_err batch_exchange(shardd_client_t *c, const batch_kind *k,
                                 int reg, void **wp, size_t lo, size_t hi,
                                 Shardwire__Response **resp, int *fds,
                                 int *nfds) {
  batch_req q;
  *resp = NULL;
  *nfds = 0;
  shardd__clear_err(c);
  if (c->fd < 0) /* as shardd__send_req: before a seq is taken */
    return shardd__set_err(c, SHARDD_E_CLOSED,
                           "the connection was closed earlier");
  q.sizes = NULL;
  shardd_err rc = batch_pack(c, k, reg, wp, lo, hi, &q);
  if (rc == SHARDD_OK)
    rc = batch_send(c, &q);
  if (rc == SHARDD_OK)
    rc = batch_reply(c, k, reg, &q, resp, fds, nfds);
  return rc;
}

static shardd_err batch_unregister(shardd_client_t *c, const batch_kind *k,
                                   size_t n, const uint64_t *ids,
                                   const uint64_t *generations,
                                   shardd_err *errs);

/* Registers n entries of specs (every one of specs[0].size bytes) in as
 * few requests as the limits allow, all or nothing: a refused request
 * undoes what earlier ones created. out gets one k->out_size entry each. */
static shardd_err batch_register(shardd_client_t *c, const batch_kind *k,
                                 size_t n, const void *specs, void *out,
                                 shardd_err *errs) {
  if (c == NULL)
    return SHARDD_E_INVAL; /* no client to hold a message */
  if (out)
    memset(out, 0, n * k->out_size);
  if (errs)
    for (size_t i = 0; i < n; i++)
      errs[i] = SHARDD_OK;
  if (n == 0)
    return SHARDD_OK;
  if (specs == NULL || (k->needs_out && out == NULL))
    return shardd__set_err(c, SHARDD_E_INVAL, "%s: %s is NULL", k->reg_fn,
                           k->needs_out ? "specs or out" : "specs");
  if (n > UINT32_MAX) /* the wire's entry indices */
    return shardd__set_err(c, SHARDD_E_RANGE,
                           "%s: %zu %s, at most %" PRIu32 " per call",
                           k->reg_fn, n, k->noun, UINT32_MAX);
  size_t stride;
  memcpy(&stride, specs, sizeof stride); /* every spec starts with its size */
  if (stride < k->min_spec)
    return shardd__set_err(c, SHARDD_E_INVAL,
                           "%s: specs[0].size %zu is too small (use %s)",
                           k->reg_fn, stride, k->spec_init);
  char *w = calloc(n, k->reg_size);
  void **wp = calloc(n, sizeof *wp);
  /* the entries created so far, for the undo of a later refusal */
  uint64_t *made = malloc(n * sizeof *made);
  /* each entry's packed size, where requests are bounded in bytes */
  size_t *psz = k->reg_packed ? malloc(n * sizeof *psz) : NULL;
  int fds[SHARDD_BUFFERS_PER_REQUEST];
  shardd_err rc = SHARDD_OK;
  size_t nmade = 0;
  if (w == NULL || wp == NULL || made == NULL ||
      (k->reg_packed && psz == NULL)) {
    rc = shardd__set_err(c, SHARDD_E_NO_MEMORY, "out of memory");
    goto done;
  }
  for (size_t i = 0; i < n; i++) {
    const char *sp = (const char *)specs + i * stride;
    size_t size;
    memcpy(&size, sp, sizeof size);
    if (size != stride) {
      rc = shardd__set_err(c, SHARDD_E_INVAL,
                           "%s: entry %zu has size %zu, entry 0 %zu (every "
                           "entry the same)",
                           k->noun, i, size, stride);
      goto done;
    }
    rc = k->reg_entry(c, sp, stride, i, w + i * k->reg_size, errs);
    if (rc != SHARDD_OK)
      goto done;
    wp[i] = w + i * k->reg_size;
    if (psz)
      psz[i] = k->reg_packed(wp[i]);
  }
  char after[64];
  snprintf(after, sizeof after, "not checked (no %s of this call was kept)",
           k->one);
  /* Each request after the first is packed while the daemon works on the
   * one before it (packing was half of this side's work), and sent only
   * once that one's reply is taken: a refused request still leaves the
   * rest unsent. */
  batch_req cur = {.sizes = psz}, nxt = {.sizes = psz};
  int have_nxt = 0;
  for (size_t lo = 0; lo < n && rc == SHARDD_OK;) {
    size_t hi;
    Shardwire__Response *resp = NULL;
    int nfds = 0;
    shardd__clear_err(c);
    if (c->fd < 0) {
      rc = shardd__set_err(c, SHARDD_E_CLOSED,
                           "the connection was closed earlier");
    } else if (have_nxt) {
      cur = nxt;
      have_nxt = 0;
    } else {
      rc = batch_pack(c, k, 1, wp + lo, lo, batch_chunk_end(k, psz, lo, n),
                      &cur);
    }
    hi = rc == SHARDD_OK ? cur.hi : batch_chunk_end(k, psz, lo, n);
    if (rc == SHARDD_OK)
      rc = batch_send(c, &cur);
    if (rc == SHARDD_OK && hi < n) {
      have_nxt = batch_pack(c, k, 1, wp + hi, hi, batch_chunk_end(k, psz, hi, n),
                            &nxt) == SHARDD_OK;
      if (!have_nxt) { /* packed again, and refused, in its turn */
        free(nxt.buf);
        nxt.buf = NULL;
        shardd__clear_err(c);
      }
    }
    if (rc == SHARDD_OK) {
      /* decoded into one arena, taken back once read (below) */
      shardd__reply_arena_use(c);
      rc = batch_reply(c, k, 1, &cur, &resp, fds, &nfds);
      shardd__reply_arena_stop(c);
    }
    if (rc == SHARDD_OK)
      rc = k->take(c, resp, lo, hi, fds, nfds, out, made, &nmade);
    else
      shardd__batch_fail(c, rc, resp, lo, hi, n, errs, after);
    for (int f = 0; f < nfds; f++)
      close(fds[f]);
    shardd__reply_arena_reset(c); /* resp's pieces */
    lo = hi;
  }
  if (have_nxt)
    free(nxt.buf);
  if (rc != SHARDD_OK && nmade > 0) {
    /* the refusal's message is the call's error, not the undo's */
    char *msg = strdup(shardd_last_error(c));
    shardd_err urc = batch_unregister(c, k, nmade, made, NULL, NULL);
    if (msg && urc == SHARDD_OK)
      shardd__set_err(c, rc, "%s", msg);
    else if (msg)
      shardd__set_err(c, rc,
                      "%s; undoing the %zu %s created by earlier requests "
                      "failed too: %s",
                      msg, nmade, k->noun, shardd_last_error(c));
    free(msg);
  }
  if (rc != SHARDD_OK && out)
    memset(out, 0, n * k->out_size);

done:
  free(w);
  free(wp);
  free(made);
  free(psz);
  return rc;
}

/* Unregisters n ids (generations: each one's, 0 or NULL: unchecked) in
 * requests of k->per_request, stopping at the first refused. */
static shardd_err batch_unregister(shardd_client_t *c, const batch_kind *k,
                                   size_t n, const uint64_t *ids,
                                   const uint64_t *generations,
                                   shardd_err *errs) {
  if (c == NULL)
    return SHARDD_E_INVAL; /* no client to hold a message */
  if (errs)
    for (size_t i = 0; i < n; i++)
      errs[i] = SHARDD_OK;
  if (n == 0)
    return SHARDD_OK;
  if (ids == NULL)
    return shardd__set_err(c, SHARDD_E_INVAL, "%s: %s is NULL", k->unreg_fn,
                           k->noun);
  if (n > UINT32_MAX)
    return shardd__set_err(c, SHARDD_E_RANGE,
                           "%s: %zu %s, at most %" PRIu32 " per call",
                           k->unreg_fn, n, k->noun, UINT32_MAX);
  size_t per = k->per_request;
  char *w = calloc(per, k->unreg_size);
  void **wp = calloc(per, sizeof *wp);
  int fds[SHARDD_BUFFERS_PER_REQUEST];
  shardd_err rc = SHARDD_OK;
  if (w == NULL || wp == NULL) {
    rc = shardd__set_err(c, SHARDD_E_NO_MEMORY, "out of memory");
    goto done;
  }
  char after[96];
  snprintf(after, sizeof after,
           "not checked (the %s of the entries before these are "
           "unregistered)",
           k->noun);
  for (size_t lo = 0; lo < n && rc == SHARDD_OK; lo += per) {
    size_t hi = n - lo < per ? n : lo + per;
    for (size_t i = lo; i < hi; i++) {
      k->unreg_entry(w + (i - lo) * k->unreg_size, ids[i],
                     generations ? generations[i] : 0);
      wp[i - lo] = w + (i - lo) * k->unreg_size;
    }
    Shardwire__Response *resp;
    int nfds;
    rc = batch_exchange(c, k, 0, wp, lo, hi, &resp, fds, &nfds);
    if (rc == SHARDD_OK && k->unregistered)
      k->unregistered(c, ids, lo, hi);
    else if (rc != SHARDD_OK)
      shardd__batch_fail(c, rc, resp, lo, hi, n, errs, after);
    for (int f = 0; f < nfds; f++)
      close(fds[f]);
    if (resp)
      shardwire__response__free_unpacked(resp, NULL);
  }

done:
  free(w);
  free(wp);
  return rc;
}

shardd_err shardd_views_register(shardd_client_t *c, size_t n,
                                 const shardd_view_spec *specs,
                                 shardd_view_info *out, shardd_err *errs) {
  return batch_register(c, &views_kind, n, specs, out, errs);
}

shardd_err shardd_views_unregister(shardd_client_t *c, size_t n,
                                   const uint64_t *views,
                                   const uint64_t *generations,
                                   shardd_err *errs) {
  return batch_unregister(c, &views_kind, n, views, generations, errs);
}

shardd_err shardd_buffers_register(shardd_client_t *c, size_t n,
                                   const shardd_buffer_spec *specs,
                                   shardd_buffer_info *out, shardd_err *errs) {
  return batch_register(c, &buffers_kind, n, specs, out, errs);
}

shardd_err shardd_buffers_unregister(shardd_client_t *c, size_t n,
                                     const uint64_t *buffers,
                                     const uint64_t *generations,
                                     shardd_err *errs) {
  return batch_unregister(c, &buffers_kind, n, buffers, generations, errs);
}

void shardd__hp_to_wire(const shardd_hparams *h, Shardwire__HyperParams *w) {
  shardwire__hyper_params__init(w);
  if (h == NULL)
    return;
#define HP(bit, field)                 \
  if (h->set & (bit)) {                \
    w->has_##field = 1;                \
    w->field = h->field;               \
  }
  HP(SHARDD_HP_LR, lr)
  HP(SHARDD_HP_MOMENTUM, momentum)
  HP(SHARDD_HP_DAMPENING, dampening)
  HP(SHARDD_HP_WEIGHT_DECAY, weight_decay)
  HP(SHARDD_HP_NESTEROV, nesterov)
  HP(SHARDD_HP_MAXIMIZE, maximize)
  HP(SHARDD_HP_BETA1, beta1)
  HP(SHARDD_HP_BETA2, beta2)
  HP(SHARDD_HP_EPS, eps)
  HP(SHARDD_HP_AMSGRAD, amsgrad)
#undef HP
}

shardd_err shardd_optimizer_register(shardd_client_t *c, const char *name,
                                     shardd_optim_kind kind,
                                     const shardd_hparams *hyper,
                                     const shardd_param_group *groups,
                                     size_t ngroups, uint64_t *out_id) {
  if (c == NULL)
    return SHARDD_E_INVAL; /* no client to hold a message */

  if (out_id)
    *out_id = 0;
  if (ngroups > 0 && groups == NULL)
    return shardd__set_err(c, SHARDD_E_INVAL, "optimizer: NULL groups");
  size_t nrefs = 0;
  for (size_t g = 0; g < ngroups; g++) {
    /* a wrapped sum would size the arrays below smaller than the loop */
    if (groups[g].nrefs > SIZE_MAX - nrefs)
      return shardd__set_err(c, SHARDD_E_INVAL, "optimizer: too many refs");
    nrefs += groups[g].nrefs;
  }
  Shardwire__ParamGroup *pg = calloc(ngroups ? ngroups : 1, sizeof *pg);
  Shardwire__ParamGroup **pgp = calloc(ngroups ? ngroups : 1, sizeof *pgp);
  Shardwire__HyperParams *ov = calloc(ngroups ? ngroups : 1, sizeof *ov);
  Shardwire__ParamRef *refs = calloc(nrefs ? nrefs : 1, sizeof *refs);
  Shardwire__ParamRef **refp = calloc(nrefs ? nrefs : 1, sizeof *refp);
  shardd_err rc;
  if (pg == NULL || pgp == NULL || ov == NULL || refs == NULL || refp == NULL) {
    rc = shardd__set_err(c, SHARDD_E_NO_MEMORY, "out of memory");
    goto done;
  }
  size_t k = 0;
  for (size_t g = 0; g < ngroups; g++) {
    shardwire__param_group__init(&pg[g]);
    shardd__hp_to_wire(&groups[g].overrides, &ov[g]);
    if (groups[g].overrides.set)
      pg[g].overrides = &ov[g];
    pg[g].refs = &refp[k];
    pg[g].n_refs = groups[g].nrefs;
    for (size_t i = 0; i < groups[g].nrefs; i++, k++) {
      shardwire__param_ref__init(&refs[k]);
      refs[k].id = groups[g].refs[i].id;
      refs[k].name = (char *)groups[g].refs[i].name;
      refp[k] = &refs[k];
    }
    pgp[g] = &pg[g];
  }
  Shardwire__Request req = SHARDWIRE__REQUEST__INIT;
  Shardwire__RegisterOptimizer ro = SHARDWIRE__REGISTER_OPTIMIZER__INIT;
  Shardwire__HyperParams top;
  shardd__hp_to_wire(hyper, &top);
  ro.name = (char *)name;
  ro.kind = (Shardwire__OptimKind)kind;
  ro.hyper = &top;
  ro.groups = pgp;
  ro.n_groups = ngroups;
  req.body_case = SHARDWIRE__REQUEST__BODY_REGISTER_OPTIMIZER;
  req.register_optimizer = &ro;
  Shardwire__Response *resp;
  rc = shardd__call_expect(c, &req, SHARDWIRE__RESPONSE__BODY_OPTIMIZER, &resp,
                           NULL);
  if (rc == SHARDD_OK && out_id)
    *out_id = resp->optimizer->id;
  if (resp)
    shardwire__response__free_unpacked(resp, NULL);
done:
  free(pg);
  free(pgp);
  free(ov);
  free(refs);
  free(refp);
  return rc;
}

shardd_err shardd_optimizer_unregister(shardd_client_t *c, uint64_t opt) {
  if (c == NULL)
    return SHARDD_E_INVAL; /* no client to hold a message */

  Shardwire__Request req = SHARDWIRE__REQUEST__INIT;
  Shardwire__UnregisterOptimizer uo = SHARDWIRE__UNREGISTER_OPTIMIZER__INIT;
  uo.id = opt;
  req.body_case = SHARDWIRE__REQUEST__BODY_UNREGISTER_OPTIMIZER;
  req.unregister_optimizer = &uo;
  return shardd__call_status_only(c, &req);
}
