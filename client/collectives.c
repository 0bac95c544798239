/* collectives.c — a rank's collectives: gather (its areas), release,
 * scatter, buckets of gathers or scatters, the scalar all-reduce and the
 * barrier. */
#include <inttypes.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include "client_int.h"

shardd_err shardd_gather(shardd_client_t *c, uint64_t buffer) {
  if (c == NULL)
    return SHARDD_E_INVAL; /* no client to hold a message */

  return shardd_gather_checked(c, buffer, 0);
}

shardd_err shardd_gather_checked(shardd_client_t *c, uint64_t buffer,
                                 uint64_t generation) {
  if (c == NULL)
    return SHARDD_E_INVAL; /* no client to hold a message */

  Shardwire__Request req = SHARDWIRE__REQUEST__INIT;
  Shardwire__Gather g = SHARDWIRE__GATHER__INIT;
  g.buffer = buffer;
  if (generation) {
    g.has_generation = 1;
    g.generation = generation;
  }
  req.body_case = SHARDWIRE__REQUEST__BODY_GATHER;
  req.gather = &g;
  return shardd__call_status_only(c, &req);
}

shardd_err shardd_gather_area(shardd_client_t *c, uint64_t buffer,
                              int want_grad, shardd_area *out) {
  if (c == NULL)
    return SHARDD_E_INVAL; /* no client to hold a message */
  if (out == NULL)
    return shardd__set_err(c, SHARDD_E_INVAL,
                           "shardd_gather_area: out is NULL");

  memset(out, 0, sizeof *out);
  Shardwire__Request req = SHARDWIRE__REQUEST__INIT;
  Shardwire__Gather g = SHARDWIRE__GATHER__INIT;
  g.buffer = buffer;
  if (want_grad) {
    g.has_want_grad = 1;
    g.want_grad = 1;
  }
  req.body_case = SHARDWIRE__REQUEST__BODY_GATHER;
  req.gather = &g;
  Shardwire__Response *resp;
  shardd_err rc = shardd__call(c, &req, &resp, NULL);
  if (rc == SHARDD_OK) {
    if (resp->body_case == SHARDWIRE__RESPONSE__BODY_GATHER)
      rc = shardd__area_fill(c, buffer, resp->gather, want_grad, out);
    else if (resp->body_case == SHARDWIRE__RESPONSE__BODY__NOT_SET)
      rc = shardd__area_fill(c, buffer, NULL, want_grad, out);
    else
      rc = shardd__set_err(c, SHARDD_E_PROTOCOL,
                           "the daemon answered a gather with body %d",
                           (int)resp->body_case);
    if (rc != SHARDD_OK)
      memset(out, 0, sizeof *out);
  }
  if (resp)
    shardwire__response__free_unpacked(resp, NULL);
  return rc;
}

static shardd_err release_req(shardd_client_t *c, uint64_t buffer, int grad) {
  if (c == NULL)
    return SHARDD_E_INVAL; /* no client to hold a message */

  Shardwire__Request req = SHARDWIRE__REQUEST__INIT;
  Shardwire__Release r = SHARDWIRE__RELEASE__INIT;
  r.buffer = buffer;
  if (grad) {
    r.has_grad = 1;
    r.grad = 1;
  }
  req.body_case = SHARDWIRE__REQUEST__BODY_RELEASE;
  req.release = &r;
  return shardd__call_status_only(c, &req);
}

shardd_err shardd_release(shardd_client_t *c, uint64_t buffer) {
  return release_req(c, buffer, 0);
}

shardd_err shardd_release_all(shardd_client_t *c, uint64_t buffer) {
  return release_req(c, buffer, 1);
}

shardd_err shardd_scatter(shardd_client_t *c, uint64_t buffer,
                          shardd_reduce_op op) {
  if (c == NULL)
    return SHARDD_E_INVAL; /* no client to hold a message */

  return shardd_scatter_checked(c, buffer, 0, op);
}

static shardd_err scatter_req(shardd_client_t *c, uint64_t buffer,
                              uint64_t generation, shardd_reduce_op op,
                              int accumulate) {
  if (c == NULL)
    return SHARDD_E_INVAL; /* no client to hold a message */

  shardd_scatter_opts o = SHARDD_SCATTER_OPTS_INIT;
  o.op = op;
  o.generation = generation;
  o.accumulate = accumulate;
  return shardd_scatter_ex(c, buffer, &o);
}

shardd_err shardd_scatter_ex(shardd_client_t *c, uint64_t buffer,
                             const shardd_scatter_opts *opts) {
  if (c == NULL)
    return SHARDD_E_INVAL; /* no client to hold a message */

  shardd_scatter_opts o = SHARDD_SCATTER_OPTS_INIT;
  if (opts) { /* an older caller's smaller struct keeps the defaults after it */
    size_t n = opts->size < sizeof o ? opts->size : sizeof o;
    memcpy(&o, opts, n);
    o.size = sizeof o;
  }
  if (o.nno_grad > 0 && o.no_grad == NULL)
    return shardd__set_err(c, SHARDD_E_INVAL,
                           "scatter: nno_grad without no_grad");
  Shardwire__Request req = SHARDWIRE__REQUEST__INIT;
  Shardwire__Scatter s = SHARDWIRE__SCATTER__INIT;
  s.buffer = buffer;
  s.has_op = 1;
  s.op = (Shardwire__ReduceOp)o.op;
  if (o.generation) {
    s.has_generation = 1;
    s.generation = o.generation;
  }
  s.n_no_grad = o.nno_grad;
  s.no_grad = (uint64_t *)o.no_grad;
  if (o.no_grad_all) {
    s.has_no_grad_all = 1;
    s.no_grad_all = 1;
  }
  if (o.accumulate) {
    s.has_accumulate = 1;
    s.accumulate = 1;
  }
  req.body_case = SHARDWIRE__REQUEST__BODY_SCATTER;
  req.scatter = &s;
  return shardd__call_status_only(c, &req);
}

shardd_err shardd_scatter_checked(shardd_client_t *c, uint64_t buffer,
                                  uint64_t generation, shardd_reduce_op op) {
  return scatter_req(c, buffer, generation, op, 0);
}

shardd_err shardd_scatter_accumulate(shardd_client_t *c, uint64_t buffer,
                                     shardd_reduce_op op) {
  return scatter_req(c, buffer, 0, op, 1);
}

/* ---- buckets ------------------------------------------------------------ */

/* A bucket request's packed bytes stay under this (scatter entries carry
 * their no_grad lists): a quarter of the frame limit, as for views. */
#define BUCKET_REQ_BYTES (SHARDD_MAX_FRAME / 4)

/* One bucket call: gathers (sc NULL) or scatters (sc[i] each entry's). */
static shardd_err bucket_call(shardd_client_t *c, size_t n,
                              const uint64_t *buffers,
                              Shardwire__Scatter *sc, shardd_err *errs,
                              const char *fn) {
  if (errs)
    for (size_t i = 0; i < n; i++)
      errs[i] = SHARDD_OK;
  if (n == 0)
    return SHARDD_OK;
  if (buffers == NULL)
    return shardd__set_err(c, SHARDD_E_INVAL, "%s: buffers is NULL", fn);
  if (n > UINT32_MAX)
    return shardd__set_err(c, SHARDD_E_RANGE,
                           "%s: %zu buffers, at most %" PRIu32 " per call", fn,
                           n, UINT32_MAX);
  Shardwire__Gather *g = NULL;
  void **ptrs = calloc(n, sizeof *ptrs);
  if (ptrs == NULL || (sc == NULL && (g = calloc(n, sizeof *g)) == NULL)) {
    free(ptrs);
    return shardd__set_err(c, SHARDD_E_NO_MEMORY, "out of memory");
  }
  for (size_t i = 0; i < n; i++) {
    if (sc) {
      ptrs[i] = &sc[i];
    } else {
      shardwire__gather__init(&g[i]);
      g[i].buffer = buffers[i];
      ptrs[i] = &g[i];
    }
  }
  shardd_err rc = SHARDD_OK;
  for (size_t lo = 0; lo < n && rc == SHARDD_OK;) {
    /* [lo, hi): at most SHARDD_BUCKET_PER_REQUEST entries (fewer under
     * a daemon's smaller --max-pending, which every rank of the node
     * shares) and BUCKET_REQ_BYTES packed (at least one); every rank cuts
     * the same list the same way */
    size_t hi = lo, bytes = 0;
    while (hi < n && hi - lo < c->bucket_max) {
      size_t b = (sc ? shardwire__scatter__get_packed_size(&sc[hi])
                     : shardwire__gather__get_packed_size(&g[hi])) + 8;
      if (hi > lo && bytes + b > BUCKET_REQ_BYTES)
        break;
      bytes += b;
      hi++;
    }
    Shardwire__Request req = SHARDWIRE__REQUEST__INIT;
    Shardwire__Bucket bk = SHARDWIRE__BUCKET__INIT;
    Shardwire__GatherMany gm = SHARDWIRE__GATHER_MANY__INIT;
    Shardwire__ScatterMany sm = SHARDWIRE__SCATTER_MANY__INIT;
    if (sc) {
      sm.n_scatters = hi - lo;
      sm.scatters = (Shardwire__Scatter **)ptrs + lo;
      sm.has_first_index = lo > 0;
      sm.first_index = (uint32_t)lo;
      bk.op_case = SHARDWIRE__BUCKET__OP_SCATTER;
      bk.scatter = &sm;
    } else {
      gm.n_gathers = hi - lo;
      gm.gathers = (Shardwire__Gather **)ptrs + lo;
      gm.has_first_index = lo > 0;
      gm.first_index = (uint32_t)lo;
      bk.op_case = SHARDWIRE__BUCKET__OP_GATHER;
      bk.gather = &gm;
    }
    req.body_case = SHARDWIRE__REQUEST__BODY_BUCKET;
    req.bucket = &bk;
    Shardwire__Response *resp = NULL;
    rc = shardd__call(c, &req, &resp, NULL);
    if (rc == SHARDD_OK && resp->body_case != SHARDWIRE__RESPONSE__BODY_BUCKET)
      rc = shardd__set_err(c, SHARDD_E_PROTOCOL,
                           "the daemon answered with body %d to "
                           "a bucket",
                           (int)resp->body_case);
    if (rc != SHARDD_OK) {
      shardd__batch_fail(c, rc, resp, lo, hi, n, errs, "were not sent");
    }
    if (resp)
      shardwire__response__free_unpacked(resp, NULL);
    lo = hi;
  }
  free(g);
  free(ptrs);
  return rc;
}

shardd_err shardd_gather_many(shardd_client_t *c, size_t n,
                              const uint64_t *buffers, shardd_err *errs) {
  if (c == NULL)
    return SHARDD_E_INVAL; /* no client to hold a message */
  return bucket_call(c, n, buffers, NULL, errs, "shardd_gather_many");
}

shardd_err shardd_scatter_many(shardd_client_t *c, size_t n,
                               const uint64_t *buffers, shardd_reduce_op op,
                               shardd_err *errs) {
  if (c == NULL)
    return SHARDD_E_INVAL; /* no client to hold a message */
  shardd_scatter_opts o = SHARDD_SCATTER_OPTS_INIT;
  o.op = op;
  o.size = 0; /* the same options for every entry: a stride of 0 */
  return shardd_scatter_many_ex(c, n, buffers, &o, errs);
}

shardd_err shardd_scatter_many_ex(shardd_client_t *c, size_t n,
                                  const uint64_t *buffers,
                                  const shardd_scatter_opts *opts,
                                  shardd_err *errs) {
  if (c == NULL)
    return SHARDD_E_INVAL; /* no client to hold a message */
  /* opts->size 0 (shardd_scatter_many's): one struct for all entries */
  size_t stride = opts ? opts->size : 0;
  if (opts && stride != 0 &&
      stride < offsetof(shardd_scatter_opts, no_grad_all) + sizeof(int))
    return shardd__set_err(c, SHARDD_E_INVAL,
                           "shardd_scatter_many_ex: opts[0].size "
                           "%zu is too small (use SHARDD_SCATTER_OPTS_INIT)",
                           stride);
  Shardwire__Scatter *sc = calloc(n ? n : 1, sizeof *sc);
  if (sc == NULL)
    return shardd__set_err(c, SHARDD_E_NO_MEMORY, "out of memory");
  for (size_t i = 0; i < n; i++) {
    shardd_scatter_opts o = SHARDD_SCATTER_OPTS_INIT;
    if (opts) {
      const shardd_scatter_opts *e =
          (const shardd_scatter_opts *)((const char *)opts + i * stride);
      size_t k = stride ? stride : sizeof o;
      memcpy(&o, e, k < sizeof o ? k : sizeof o);
      if (stride && e->size != stride) {
        free(sc);
        return shardd__set_err(
            c, SHARDD_E_INVAL,
            "shardd_scatter_many_ex: entry %zu "
            "has size %zu, entry 0 %zu (every entry the same)",
            i, e->size, stride);
      }
    }
    if (o.nno_grad > 0 && o.no_grad == NULL) {
      free(sc);
      return shardd__set_err(c, SHARDD_E_INVAL,
                             "shardd_scatter_many_ex: entry %zu: "
                             "nno_grad without no_grad",
                             i);
    }
    shardwire__scatter__init(&sc[i]);
    sc[i].buffer = buffers ? buffers[i] : 0;
    sc[i].has_op = 1;
    sc[i].op = (Shardwire__ReduceOp)o.op;
    if (o.generation) {
      sc[i].has_generation = 1;
      sc[i].generation = o.generation;
    }
    sc[i].n_no_grad = o.nno_grad;
    sc[i].no_grad = (uint64_t *)o.no_grad;
    if (o.no_grad_all) {
      sc[i].has_no_grad_all = 1;
      sc[i].no_grad_all = 1;
    }
    if (o.accumulate) {
      sc[i].has_accumulate = 1;
      sc[i].accumulate = 1;
    }
  }
  shardd_err rc = bucket_call(c, n, buffers, sc, errs, "shardd_scatter_many");
  free(sc);
  return rc;
}

shardd_err shardd_all_reduce(shardd_client_t *c, double *values, size_t n,
                             shardd_reduce_op op) {
  if (c == NULL)
    return SHARDD_E_INVAL; /* no client to hold a message */

  if (n > SHARDD_ALL_REDUCE_MAX)
    return shardd__set_err(c, SHARDD_E_RANGE,
                           "all_reduce of %zu values: at most %d", n,
                           SHARDD_ALL_REDUCE_MAX);
  if (n > 0 && values == NULL)
    return shardd__set_err(c, SHARDD_E_INVAL, "all_reduce: values is NULL");
  Shardwire__Request req = SHARDWIRE__REQUEST__INIT;
  Shardwire__AllReduce ar = SHARDWIRE__ALL_REDUCE__INIT;
  ar.has_op = 1;
  ar.op = (Shardwire__ReduceOp)op;
  ar.n_values = n;
  ar.values = values;
  req.body_case = SHARDWIRE__REQUEST__BODY_ALL_REDUCE;
  req.all_reduce = &ar;
  Shardwire__Response *resp;
  shardd_err rc = shardd__call_expect(
      c, &req, SHARDWIRE__RESPONSE__BODY_ALL_REDUCE, &resp, NULL);
  if (rc == SHARDD_OK && resp->all_reduce->n_values != n)
    rc = shardd__set_err(c, SHARDD_E_PROTOCOL,
                         "all_reduce: %zu values came back for %zu",
                         resp->all_reduce->n_values, n);
  else if (rc == SHARDD_OK && n > 0)
    memcpy(values, resp->all_reduce->values, n * sizeof *values);
  if (resp)
    shardwire__response__free_unpacked(resp, NULL);
  return rc;
}

shardd_err shardd_barrier(shardd_client_t *c) {
  return shardd_all_reduce(c, NULL, 0, SHARDD_REDUCE_SUM);
}
