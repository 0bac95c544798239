/* registration.c — what a rank registers: buffers (their blocks mapped by
 * mappings.c), views and optimizers, one at a time and in batches (all or
 * nothing: a refused batch undoes what earlier requests of the call made),
 * and their unregistration. */
#include <inttypes.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "client_int.h"

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
  rc = shardd__buffer_adopt(c, resp->buffer, fd, out);
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

/* ---- batches of views ------------------------------------------------- */

/* A request's share of the frame: a quarter of the limit, so the largest
 * names and shapes still fit (256 views of 255-byte names and 64
 * dimensions are ~0.3 MiB; the count, not the bytes, cuts in practice). */
#define VIEWS_REQ_BYTES (SHARDD_MAX_FRAME / 4)

/* Entries [lo, *hi) of one request: at most SHARDD_VIEWS_PER_REQUEST, at
 * most VIEWS_REQ_BYTES packed (at least one). */
static size_t views_chunk_end(Shardwire__RegisterView *rv, size_t lo, size_t n) {
  size_t hi = lo, bytes = 0;
  while (hi < n && hi - lo < SHARDD_VIEWS_PER_REQUEST) {
    size_t b = shardwire__register_view__get_packed_size(&rv[hi]) + 8;
    if (hi > lo && bytes + b > VIEWS_REQ_BYTES)
      break;
    bytes += b;
    hi++;
  }
  return hi;
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

shardd_err shardd_views_register(shardd_client_t *c, size_t n,
                                 const shardd_view_spec *specs,
                                 shardd_view_info *out, shardd_err *errs) {
  if (c == NULL)
    return SHARDD_E_INVAL; /* no client to hold a message */
  if (out)
    memset(out, 0, n * sizeof *out);
  if (errs)
    for (size_t i = 0; i < n; i++)
      errs[i] = SHARDD_OK;
  if (n == 0)
    return SHARDD_OK;
  if (specs == NULL)
    return shardd__set_err(c, SHARDD_E_INVAL,
                           "shardd_views_register: specs is NULL");
  if (n > UINT32_MAX) /* the wire's entry indices */
    return shardd__set_err(c, SHARDD_E_RANGE,
                           "shardd_views_register: %zu views, at "
                           "most %" PRIu32 " per call",
                           n, UINT32_MAX);
  size_t stride = specs->size;
  if (stride < offsetof(shardd_view_spec, requires_grad) + sizeof(int))
    return shardd__set_err(
        c, SHARDD_E_INVAL,
        "shardd_views_register: specs[0].size %zu is too small "
        "(use SHARDD_VIEW_SPEC_INIT)",
        stride);
  Shardwire__RegisterView *rv = calloc(n, sizeof *rv);
  Shardwire__RegisterView **rvp = calloc(n, sizeof *rvp);
  /* the views created so far, for the undo of a later refusal */
  uint64_t *made = malloc(n * sizeof *made);
  shardd_err rc = SHARDD_OK;
  size_t nmade = 0;
  if (rv == NULL || rvp == NULL || made == NULL) {
    rc = shardd__set_err(c, SHARDD_E_NO_MEMORY, "out of memory");
    goto done;
  }
  for (size_t i = 0; i < n; i++) {
    shardd_view_spec e = SHARDD_VIEW_SPEC_INIT;
    const shardd_view_spec *sp =
        (const shardd_view_spec *)((const char *)specs + i * stride);
    memcpy(&e, sp, stride < sizeof e ? stride : sizeof e);
    if (e.size != stride) {
      rc = shardd__set_err(c, SHARDD_E_INVAL,
                           "views: entry %zu has size %zu, entry 0 "
                           "%zu (every entry the same)",
                           i, e.size, stride);
      goto done;
    }
    if (e.name == NULL || e.ndim < 0 || (e.ndim > 0 && e.shape == NULL)) {
      if (errs)
        errs[i] = SHARDD_E_INVAL;
      rc = shardd__set_err(c, SHARDD_E_INVAL,
                           "views: entry %zu has a NULL name or "
                           "shape; nothing was sent",
                           i);
      goto done;
    }
    shardwire__register_view__init(&rv[i]);
    rv[i].buffer = e.buffer;
    rv[i].name = (char *)e.name;
    rv[i].offset = e.offset;
    rv[i].numel = e.numel;
    rv[i].n_shape = (size_t)e.ndim;
    rv[i].shape = (int64_t *)e.shape;
    if (!e.requires_grad) {
      rv[i].has_requires_grad = 1;
      rv[i].requires_grad = 0;
    }
    if (e.buffer_generation) {
      rv[i].has_buffer_generation = 1;
      rv[i].buffer_generation = e.buffer_generation;
    }
    rvp[i] = &rv[i];
  }
  for (size_t lo = 0; lo < n;) {
    size_t hi = views_chunk_end(rv, lo, n);
    Shardwire__Request req = SHARDWIRE__REQUEST__INIT;
    Shardwire__ViewsBatch vb = SHARDWIRE__VIEWS_BATCH__INIT;
    Shardwire__RegisterViews rq = SHARDWIRE__REGISTER_VIEWS__INIT;
    rq.n_views = hi - lo;
    rq.views = rvp + lo;
    rq.has_first_index = lo > 0;
    rq.first_index = (uint32_t)lo;
    vb.op_case = SHARDWIRE__VIEWS_BATCH__OP_REGISTER;
    vb.register_ = &rq;
    req.body_case = SHARDWIRE__REQUEST__BODY_VIEWS_BATCH;
    req.views_batch = &vb;
    Shardwire__Response *resp;
    rc = shardd__call_expect(c, &req, SHARDWIRE__RESPONSE__BODY_VIEWS_BATCH,
                             &resp, NULL);
    if (rc == SHARDD_OK && resp->views_batch->n_views != hi - lo) {
      rc = shardd__set_err(c, SHARDD_E_PROTOCOL,
                           "the daemon answered %zu views for a "
                           "request of %zu",
                           resp->views_batch->n_views, hi - lo);
      /* what it did create is unknown: nothing to undo by id */
    } else if (rc == SHARDD_OK) {
      for (size_t i = lo; i < hi; i++) {
        const Shardwire__ViewReply *r = resp->views_batch->views[i - lo];
        if (out) {
          out[i].id = r->id;
          out[i].generation = r->has_generation ? r->generation : 0;
          out[i].created = r->created;
        }
        if (r->created)
          made[nmade++] = r->id;
      }
    } else {
      shardd__batch_fail(c, rc, resp, lo, hi, n, errs,
                         "not checked (no view of this call was kept)");
    }
    if (resp)
      shardwire__response__free_unpacked(resp, NULL);
    if (rc != SHARDD_OK)
      break;
    lo = hi;
  }
  if (rc != SHARDD_OK && nmade > 0) {
    /* the refusal's message is the call's error, not the undo's */
    size_t ml = strlen(shardd_last_error(c));
    char *msg = malloc(ml + 1);
    if (msg)
      memcpy(msg, shardd_last_error(c), ml + 1);
    shardd_err urc = shardd_views_unregister(c, nmade, made, NULL, NULL);
    if (msg && urc == SHARDD_OK)
      shardd__set_err(c, rc, "%s", msg);
    else if (msg)
      shardd__set_err(c, rc,
                      "%s; undoing the %zu views created by earlier requests "
                      "failed too: %s",
                      msg, nmade, shardd_last_error(c));
    free(msg);
  }
  if (rc != SHARDD_OK && out)
    memset(out, 0, n * sizeof *out);

done:
  free(rv);
  free(rvp);
  free(made);
  return rc;
}

shardd_err shardd_views_unregister(shardd_client_t *c, size_t n,
                                   const uint64_t *views,
                                   const uint64_t *generations,
                                   shardd_err *errs) {
  if (c == NULL)
    return SHARDD_E_INVAL; /* no client to hold a message */
  if (errs)
    for (size_t i = 0; i < n; i++)
      errs[i] = SHARDD_OK;
  if (n == 0)
    return SHARDD_OK;
  if (views == NULL)
    return shardd__set_err(c, SHARDD_E_INVAL,
                           "shardd_views_unregister: views is NULL");
  if (n > UINT32_MAX)
    return shardd__set_err(c, SHARDD_E_RANGE,
                           "shardd_views_unregister: %zu views, at "
                           "most %" PRIu32 " per call",
                           n, UINT32_MAX);
  size_t per = SHARDD_VIEWS_PER_REQUEST;
  Shardwire__UnregisterView *uv = calloc(per, sizeof *uv);
  Shardwire__UnregisterView **uvp = calloc(per, sizeof *uvp);
  shardd_err rc = SHARDD_OK;
  if (uv == NULL || uvp == NULL) {
    rc = shardd__set_err(c, SHARDD_E_NO_MEMORY, "out of memory");
    goto done;
  }
  for (size_t lo = 0; lo < n; lo += per) {
    size_t hi = n - lo < per ? n : lo + per;
    for (size_t i = lo; i < hi; i++) {
      Shardwire__UnregisterView *u = &uv[i - lo];
      shardwire__unregister_view__init(u);
      u->id = views[i];
      if (generations && generations[i]) {
        u->has_generation = 1;
        u->generation = generations[i];
      }
      uvp[i - lo] = u;
    }
    Shardwire__Request req = SHARDWIRE__REQUEST__INIT;
    Shardwire__ViewsBatch vb = SHARDWIRE__VIEWS_BATCH__INIT;
    Shardwire__UnregisterViews rq = SHARDWIRE__UNREGISTER_VIEWS__INIT;
    rq.n_views = hi - lo;
    rq.views = uvp;
    rq.has_first_index = lo > 0;
    rq.first_index = (uint32_t)lo;
    vb.op_case = SHARDWIRE__VIEWS_BATCH__OP_UNREGISTER;
    vb.unregister = &rq;
    req.body_case = SHARDWIRE__REQUEST__BODY_VIEWS_BATCH;
    req.views_batch = &vb;
    Shardwire__Response *resp;
    rc = shardd__call_expect(c, &req, SHARDWIRE__RESPONSE__BODY_VIEWS_BATCH,
                             &resp, NULL);
    if (rc != SHARDD_OK) {
      shardd__batch_fail(
          c, rc, resp, lo, hi, n, errs,
          "not checked (the views of the entries before these are "
          "unregistered)");
    }
    if (resp)
      shardwire__response__free_unpacked(resp, NULL);
    if (rc != SHARDD_OK)
      break;
  }

done:
  free(uv);
  free(uvp);
  return rc;
}

/* ---- batches of buffers ----------------------------------------------- */

shardd_err shardd_buffers_register(shardd_client_t *c, size_t n,
                                   const shardd_buffer_spec *specs,
                                   shardd_buffer_info *out, shardd_err *errs) {
  if (c == NULL)
    return SHARDD_E_INVAL; /* no client to hold a message */
  if (out)
    memset(out, 0, n * sizeof *out);
  if (errs)
    for (size_t i = 0; i < n; i++)
      errs[i] = SHARDD_OK;
  if (n == 0)
    return SHARDD_OK;
  if (specs == NULL || out == NULL)
    return shardd__set_err(c, SHARDD_E_INVAL,
                           "shardd_buffers_register: specs or out is NULL");
  if (n > UINT32_MAX)
    return shardd__set_err(c, SHARDD_E_RANGE,
                           "shardd_buffers_register: %zu buffers, "
                           "at most %" PRIu32 " per call",
                           n, UINT32_MAX);
  size_t stride = specs->size;
  if (stride < offsetof(shardd_buffer_spec, init_checksum) + sizeof(uint64_t))
    return shardd__set_err(
        c, SHARDD_E_INVAL,
        "shardd_buffers_register: specs[0].size %zu is too small "
        "(use SHARDD_BUFFER_SPEC_INIT)",
        stride);
  Shardwire__RegisterBuffer *rb = calloc(n, sizeof *rb);
  Shardwire__RegisterBuffer **rbp = calloc(n, sizeof *rbp);
  uint64_t *made = malloc(n * sizeof *made); /* for the undo */
  int fds[SHARDD_BUFFERS_PER_REQUEST];
  shardd_err rc = SHARDD_OK;
  size_t nmade = 0;
  if (rb == NULL || rbp == NULL || made == NULL) {
    rc = shardd__set_err(c, SHARDD_E_NO_MEMORY, "out of memory");
    goto done;
  }
  for (size_t i = 0; i < n; i++) {
    shardd_buffer_spec e = SHARDD_BUFFER_SPEC_INIT;
    const shardd_buffer_spec *sp =
        (const shardd_buffer_spec *)((const char *)specs + i * stride);
    memcpy(&e, sp, stride < sizeof e ? stride : sizeof e);
    if (e.size != stride) {
      rc = shardd__set_err(c, SHARDD_E_INVAL,
                           "buffers: entry %zu has size %zu, entry "
                           "0 %zu (every entry the same)",
                           i, e.size, stride);
      goto done;
    }
    if (e.name == NULL) {
      if (errs)
        errs[i] = SHARDD_E_INVAL;
      rc = shardd__set_err(c, SHARDD_E_INVAL,
                           "buffers: entry %zu has a NULL name; "
                           "nothing was sent",
                           i);
      goto done;
    }
    shardwire__register_buffer__init(&rb[i]);
    rb[i].name = (char *)e.name;
    rb[i].dtype = (Shardwire__DType)e.dtype;
    rb[i].numel = e.numel;
    if (e.has_init_checksum) {
      rb[i].has_init_checksum = 1;
      rb[i].init_checksum = e.init_checksum;
    }
    rbp[i] = &rb[i];
  }
  for (size_t lo = 0; lo < n && rc == SHARDD_OK;) {
    size_t hi = n - lo < SHARDD_BUFFERS_PER_REQUEST ? n
                                                    : lo + SHARDD_BUFFERS_PER_REQUEST;
    Shardwire__Request req = SHARDWIRE__REQUEST__INIT;
    Shardwire__BuffersBatch bb = SHARDWIRE__BUFFERS_BATCH__INIT;
    Shardwire__RegisterBuffers rq = SHARDWIRE__REGISTER_BUFFERS__INIT;
    rq.n_buffers = hi - lo;
    rq.buffers = rbp + lo;
    rq.has_first_index = lo > 0;
    rq.first_index = (uint32_t)lo;
    bb.op_case = SHARDWIRE__BUFFERS_BATCH__OP_REGISTER;
    bb.register_ = &rq;
    req.body_case = SHARDWIRE__REQUEST__BODY_BUFFERS_BATCH;
    req.buffers_batch = &bb;
    Shardwire__Response *resp = NULL;
    int nfds = 0;
    shardd__clear_err(c);
    rc = shardd__send_req(c, &req);
    if (rc == SHARDD_OK)
      rc = shardd__recv_for_many(c, req.seq, &resp, NULL, fds,
                                 SHARDD_BUFFERS_PER_REQUEST, &nfds);
    if (rc == SHARDD_OK &&
        resp->body_case != SHARDWIRE__RESPONSE__BODY_BUFFERS_BATCH)
      rc = shardd__set_err(c, SHARDD_E_PROTOCOL,
                           "the daemon answered with body %d to "
                           "a batch of buffers",
                           (int)resp->body_case);
    else if (rc == SHARDD_OK && resp->buffers_batch->n_buffers != hi - lo)
      rc = shardd__set_err(c, SHARDD_E_PROTOCOL,
                           "the daemon answered %zu buffers for "
                           "a request of %zu",
                           resp->buffers_batch->n_buffers, hi - lo);
    else if (rc == SHARDD_OK && nfds != 0 && (size_t)nfds != hi - lo)
      rc = shardd__set_err(c, SHARDD_E_PROTOCOL,
                           "the daemon sent %d descriptors for "
                           "%zu buffers",
                           nfds, hi - lo);
    if (rc == SHARDD_OK) {
      for (size_t i = lo; i < hi; i++) {
        const Shardwire__BufferReply *br = resp->buffers_batch->buffers[i - lo];
        if (br->created)
          made[nmade++] = br->id;
      }
      for (size_t i = lo; i < hi && rc == SHARDD_OK; i++)
        rc = shardd__buffer_adopt(c, resp->buffers_batch->buffers[i - lo],
                                  nfds ? fds[i - lo] : -1, &out[i]);
    } else {
      shardd__batch_fail(c, rc, resp, lo, hi, n, errs,
                         "not checked (no buffer of this call was kept)");
    }
    for (int k = 0; k < nfds; k++)
      close(fds[k]);
    if (resp)
      shardwire__response__free_unpacked(resp, NULL);
    lo = hi;
  }
  if (rc != SHARDD_OK && nmade > 0) {
    /* the refusal's message is the call's error, not the undo's */
    char *msg = strdup(shardd_last_error(c));
    shardd_err urc = shardd_buffers_unregister(c, nmade, made, NULL, NULL);
    if (msg && urc == SHARDD_OK)
      shardd__set_err(c, rc, "%s", msg);
    else if (msg)
      shardd__set_err(c, rc,
                      "%s; undoing the %zu buffers created by earlier requests "
                      "failed too: %s",
                      msg, nmade, shardd_last_error(c));
    free(msg);
  }
  if (rc != SHARDD_OK)
    memset(out, 0, n * sizeof *out);

done:
  free(rb);
  free(rbp);
  free(made);
  return rc;
}

shardd_err shardd_buffers_unregister(shardd_client_t *c, size_t n,
                                     const uint64_t *buffers,
                                     const uint64_t *generations,
                                     shardd_err *errs) {
  if (c == NULL)
    return SHARDD_E_INVAL; /* no client to hold a message */
  if (errs)
    for (size_t i = 0; i < n; i++)
      errs[i] = SHARDD_OK;
  if (n == 0)
    return SHARDD_OK;
  if (buffers == NULL)
    return shardd__set_err(c, SHARDD_E_INVAL,
                           "shardd_buffers_unregister: buffers is NULL");
  if (n > UINT32_MAX)
    return shardd__set_err(c, SHARDD_E_RANGE,
                           "shardd_buffers_unregister: %zu buffers, "
                           "at most %" PRIu32 " per call",
                           n, UINT32_MAX);
  size_t per = SHARDD_BUFFERS_PER_REQUEST;
  Shardwire__UnregisterBuffer ub[SHARDD_BUFFERS_PER_REQUEST];
  Shardwire__UnregisterBuffer *ubp[SHARDD_BUFFERS_PER_REQUEST];
  shardd_err rc = SHARDD_OK;
  for (size_t lo = 0; lo < n; lo += per) {
    size_t hi = n - lo < per ? n : lo + per;
    for (size_t i = lo; i < hi; i++) {
      Shardwire__UnregisterBuffer *u = &ub[i - lo];
      shardwire__unregister_buffer__init(u);
      u->id = buffers[i];
      if (generations && generations[i]) {
        u->has_generation = 1;
        u->generation = generations[i];
      }
      ubp[i - lo] = u;
    }
    Shardwire__Request req = SHARDWIRE__REQUEST__INIT;
    Shardwire__BuffersBatch bb = SHARDWIRE__BUFFERS_BATCH__INIT;
    Shardwire__UnregisterBuffers rq = SHARDWIRE__UNREGISTER_BUFFERS__INIT;
    rq.n_buffers = hi - lo;
    rq.buffers = ubp;
    rq.has_first_index = lo > 0;
    rq.first_index = (uint32_t)lo;
    bb.op_case = SHARDWIRE__BUFFERS_BATCH__OP_UNREGISTER;
    bb.unregister = &rq;
    req.body_case = SHARDWIRE__REQUEST__BODY_BUFFERS_BATCH;
    req.buffers_batch = &bb;
    Shardwire__Response *resp;
    rc = shardd__call_expect(c, &req, SHARDWIRE__RESPONSE__BODY_BUFFERS_BATCH,
                             &resp, NULL);
    if (rc == SHARDD_OK) {
      for (size_t i = lo; i < hi; i++)
        shardd__unmap_buffer(c, buffers[i]);
    } else {
      shardd__batch_fail(
          c, rc, resp, lo, hi, n, errs,
          "not checked (the buffers of the entries before these are "
          "unregistered)");
    }
    if (resp)
      shardwire__response__free_unpacked(resp, NULL);
    if (rc != SHARDD_OK)
      break;
  }
  return rc;
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
