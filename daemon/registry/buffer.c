/* buffer.c — flat buffers and the views named inside them: their layout
 * and rank blocks, registration and attach, frozen ranges and the
 * trainable complement, holds by collectives, and listing views. */
#include "registry.h"
#include "registry_int.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAX_NDIM 16
#define MAX_NUMEL ((uint64_t)1 << 40)
#define AREA_ALIGN 4096u

static size_t align_up(size_t n, size_t a) { return (n + a - 1) / a * a; }

/* Where one streamed area ends and the next begins. Large shards have
 * power-of-two sizes, which put param, grad and state at addresses equal in
 * their low bits: the update's streams then fight over the same cache sets
 * (measured 3.9 GB/s instead of 28 for 64M-element AdamW). An odd number of
 * pages between large areas breaks that; small areas stay packed. */
size_t shardd__area_end(size_t start, size_t bytes) {
  size_t gap = bytes >= ((size_t)1 << 20) ? 19 * (size_t)AREA_ALIGN : 0;
  return align_up(start + bytes, AREA_ALIGN) + gap;
}

/* ---- buffers ---------------------------------------------------------- */

static void buffer_free_blocks(shardd__registry *reg, shardd__buffer *b) {
  if (b->blocks == NULL)
    return;
  for (uint32_t r = 0; r < b->world; r++) {
    if (b->blocks[r]) {
      b->hdr.job->bytes -= b->blocks[r]->bytes;
      b->hdr.job->nblocks--;
      reg->nblocks--;
      reg->backend->ops->free(reg->backend, b->blocks[r]);
    }
  }
  free(b->blocks);
  shardd__buffer_seed_drop(reg, b);
  if (b->stage) {
    b->hdr.job->bytes -= b->stage->bytes;
    reg->backend->ops->free(reg->backend, b->stage);
    b->stage = NULL;
  }
  b->blocks = NULL;
}

static void view_destroy(shardd__registry *reg, shardd__view *v) {
  v->buf->hdr.job->nviews--;
  reg->nviews--;
  if (!v->requires_grad)
    v->buf->nfrozen--;
  shardd__record_freed(&v->hdr, v->buf->hdr.name);
  shardd__obj_fini(reg, &v->hdr);
  free(v->shape);
  free(v);
}

void shardd__buffer_destroy(shardd__registry *reg, shardd__buffer *b) {
  shardd__view **views;
  size_t n;
  if (shardd__obj_values(&b->views, (void ***)&views, &n) == SHARDD_OK) {
    for (size_t i = 0; i < n; i++)
      view_destroy(reg, views[i]);
    free(views);
  }
  shardd__map_free(&b->views);
  shardd__map_del_str(&b->hdr.job->buffers, b->hdr.name);
  shardd__areas_unit_removed(b);
  shardd__areas_buffer_fini(b);
  buffer_free_blocks(reg, b);
  shardd__record_freed(&b->hdr, NULL);
  shardd__obj_fini(reg, &b->hdr);
  free(b->frozen_union);
  free(b);
}

shardd_err shardd__buffer_register(shardd__registry *reg, shardd__job *job,
                                   const char *name, shardd_dtype dtype,
                                   uint64_t numel, shardd__buffer **out,
                                   int *created, char *err, size_t errlen) {
  *out = NULL;
  *created = 0;
  if (!shardd__name_ok(name, "buffer", err, errlen))
    return SHARDD_E_INVAL;
  size_t esz = shardd_dtype_size(dtype);
  if (esz == 0) {
    snprintf(err, errlen, "buffer \"%s\": dtype %d is not fp32, bf16 or fp16",
             name, (int)dtype);
    return SHARDD_E_DTYPE;
  }
  if (numel == 0 || numel > MAX_NUMEL) {
    snprintf(err, errlen,
             "buffer \"%s\": numel %" PRIu64 " is out of range [1, 2^40]", name,
             numel);
    return SHARDD_E_RANGE;
  }
  shardd__buffer *b = shardd__map_get_str(&job->buffers, name);
  if (b) {
    if (b->dtype != dtype || b->numel != numel) {
      snprintf(err, errlen,
               "buffer \"%s\" exists as %s[%" PRIu64 "], not %s[%" PRIu64 "]",
               name, shardd_dtype_name(b->dtype), b->numel,
               shardd_dtype_name(dtype), numel);
      return SHARDD_E_MISMATCH;
    }
    *out = b;
    return SHARDD_OK;
  }

  b = calloc(1, sizeof *b);
  if (b == NULL) {
    snprintf(err, errlen, "out of memory");
    return SHARDD_E_NO_MEMORY;
  }
  b->dtype = dtype;
  b->numel = numel;
  b->grad_seen = 1;
  b->world = job->world;
  b->shard_numel = (numel + job->world - 1) / job->world;
  b->padded_numel = b->shard_numel * job->world;
  b->shard_off = 0;
  b->reduced_off = shardd__area_end(b->shard_off, b->shard_numel * esz);
  if (job->transient) {
    /* the gather and gradient areas are leased (areas.c) */
    b->block_bytes = align_up(b->reduced_off + b->shard_numel * 4, AREA_ALIGN);
  } else {
    b->gather_off = shardd__area_end(b->reduced_off, b->shard_numel * 4);
    b->grad_off = shardd__area_end(b->gather_off, b->padded_numel * esz);
    b->block_bytes = align_up(b->grad_off + b->padded_numel * esz, AREA_ALIGN);
  }
  b->hdr.job = job;
  shardd__map_init(&b->views);

  shardd_err rc = SHARDD_E_NO_MEMORY;
  char *gkey = NULL;
  uint64_t gprev = 0;
  if (job->transient && shardd__areas_buffer_init(b) != SHARDD_OK) {
    snprintf(err, errlen, "out of memory");
    goto fail;
  }
  /* its rank blocks, and what its unit adds to the pools of transient
   * areas: reserved now, so a limit is met here, not at a first gather */
  uint64_t blocks = (uint64_t)job->local_ranks * b->block_bytes;
  uint64_t pools = shardd__areas_reserve(job, b) - shardd__areas_reserve(job, NULL);
  if (!shardd__within_quota(reg, job, blocks + pools, err, errlen)) {
    size_t used = strlen(err);
    if (used < errlen)
      snprintf(err + used, errlen - used, "; buffer \"%s\" would take %" PRIu64
               " bytes of rank blocks", name, blocks);
    if (pools && (used = strlen(err)) < errlen)
      snprintf(err + used, errlen - used, " and reserve %" PRIu64 " for its "
               "gather and gradient areas", pools);
    goto fail;
  }
  if (!shardd__within_blocks(reg, job, job->local_ranks, err, errlen)) {
    rc = SHARDD_E_LIMIT;
    goto fail;
  }
  b->blocks = calloc(job->world, sizeof *b->blocks);
  if (b->blocks == NULL) {
    snprintf(err, errlen, "out of memory");
    goto fail;
  }
  for (uint32_t r = job->local_first; r < job->local_first + job->local_ranks; r++) {
    char label[64];
    snprintf(label, sizeof label, "shardd:%.40s:%" PRIu32, name, r);
    char why[256];
    rc = reg->backend->ops->alloc(reg->backend, shardd__rank_device(reg, r),
                                  b->block_bytes, label, &b->blocks[r], why,
                                  sizeof why);
    if (rc != SHARDD_OK) {
      snprintf(err, errlen, "buffer \"%s\" rank %" PRIu32 ": %s", name, r,
               why);
      goto fail;
    }
    job->bytes += b->blocks[r]->bytes;
    job->nblocks++;
    reg->nblocks++;
  }
  gkey = shardd__gen_key(name, NULL);
  if (gkey == NULL || (gprev = shardd__gen_get(job, gkey),
                       shardd__gen_put(job, gkey, gprev + 1)) != SHARDD_OK) {
    rc = SHARDD_E_NO_MEMORY;
    snprintf(err, errlen, "out of memory");
    goto fail;
  }
  b->hdr.generation = gprev + 1;
  if (shardd__obj_init(reg, &b->hdr, SHARDD__OBJ_BUFFER, name, job) !=
          SHARDD_OK ||
      shardd__map_put_str(&job->buffers, name, b) != SHARDD_OK) {
    rc = SHARDD_E_NO_MEMORY;
    snprintf(err, errlen, "out of memory");
    shardd__gen_put(job, gkey, gprev); /* replaces or deletes: cannot fail */
    goto fail;
  }
  free(gkey);
  if (job->transient)
    shardd__areas_unit_added(b);
  *out = b;
  *created = 1;
  return SHARDD_OK;

fail:
  free(gkey);
  buffer_free_blocks(reg, b);
  shardd__obj_fini(reg, &b->hdr);
  shardd__map_free(&b->views);
  free(b->lease);
  free(b->lease_left);
  free(b);
  return rc;
}

shardd_err shardd__buffer_unregister(shardd__registry *reg, shardd__job *job,
                                     uint64_t id, char *err, size_t errlen) {
  shardd_err rc = shardd__buffer_unregister_check(reg, job, id, err, errlen);
  if (rc != SHARDD_OK)
    return rc;
  shardd__obj *o;
  shardd__registry_resolve(reg, job, id, SHARDD__OBJ_BUFFER, &o, err, errlen);
  shardd__buffer_destroy(reg, (shardd__buffer *)o);
  return SHARDD_OK;
}

shardd_err shardd__buffer_unregister_check(shardd__registry *reg,
                                           shardd__job *job, uint64_t id,
                                           char *err, size_t errlen) {
  shardd__obj *o;
  shardd_err rc = shardd__registry_resolve(reg, job, id, SHARDD__OBJ_BUFFER, &o,
                                           err, errlen);
  if (rc != SHARDD_OK)
    return rc;
  shardd__buffer *b = (shardd__buffer *)o;
  if (b->nowned > 0) {
    snprintf(err, errlen,
             "buffer %" PRIu64 " (\"%s\") is referenced by an optimizer; "
             "unregister the optimizer first",
             id, o->name);
    return SHARDD_E_BUSY;
  }
  if (b->inflight > 0) {
    snprintf(err, errlen,
             "buffer %" PRIu64 " (\"%s\") has %" PRIu32
             " collective(s) in flight",
             id, o->name, b->inflight);
    return SHARDD_E_BUSY;
  }
  return SHARDD_OK;
}

void shardd__buffer_abandon(shardd__registry *reg, shardd__buffer *b) {
  shardd__job *job = b->hdr.job;
  char *gkey = shardd__gen_key(b->hdr.name, NULL);
  /* the registration put the key, so this replaces or deletes */
  if (gkey)
    shardd__gen_put(job, gkey, b->hdr.generation - 1);
  free(gkey);
  shardd__map_free(&b->views); /* a buffer just created has none */
  shardd__map_del_str(&job->buffers, b->hdr.name);
  shardd__areas_unit_removed(b);
  shardd__areas_buffer_fini(b);
  buffer_free_blocks(reg, b);
  shardd__obj_fini(reg, &b->hdr);
  free(b->frozen_union);
  free(b);
}

void shardd__buffer_hold(shardd__buffer *b) { b->inflight++; }

void shardd__buffer_release_hold(shardd__buffer *b) { b->inflight--; }

/* ---- views ------------------------------------------------------------ */

static int same_shape(const shardd__view *v, const int64_t *shape, int ndim) {
  if (v->ndim != ndim)
    return 0;
  for (int i = 0; i < ndim; i++)
    if (v->shape[i] != shape[i])
      return 0;
  return 1;
}

/* ---- the index of views by kind --------------------------------------
 * Each buffer keeps its frozen and its trainable views in two treaps keyed
 * by (offset, id), priorities hashed from the id as in the held index
 * below, each node knowing the furthest end under it: whether a range
 * meets a view of one kind is then O(log n), and the merged frozen ranges
 * come out of one in-order pass. Registering a batch or restoring n frozen
 * views used to list every view and sort every frozen range per view:
 * O(n^2 log n) in one request (a 290 KB ViewsBatch held the loop 51 s).
 * Recursive: a treap over hashed ids is O(log n) deep. */

static uint64_t held_hash(uint64_t x);

static uint64_t view_end(const shardd__view *v) { return v->offset + v->numel; }

static int kind_before(const shardd__view *a, const shardd__view *b) {
  return a->offset != b->offset ? a->offset < b->offset
                                : a->hdr.id < b->hdr.id;
}

static void kind_pull(shardd__view *t) {
  uint64_t m = view_end(t);
  if (t->kind_l && t->kind_l->kind_max > m)
    m = t->kind_l->kind_max;
  if (t->kind_r && t->kind_r->kind_max > m)
    m = t->kind_r->kind_max;
  t->kind_max = m;
}

/* Splits t into the nodes before v (*l) and the rest (*r). */
static void kind_split(shardd__buffer *b, shardd__view *t,
                       const shardd__view *v, shardd__view **l,
                       shardd__view **r) {
  if (t == NULL) {
    *l = *r = NULL;
    return;
  }
  b->frozen_probes++;
  if (kind_before(t, v)) {
    kind_split(b, t->kind_r, v, &t->kind_r, r);
    *l = t;
  } else {
    kind_split(b, t->kind_l, v, l, &t->kind_l);
    *r = t;
  }
  kind_pull(t);
}

/* Joins x and y, every node of x before every node of y. */
static shardd__view *kind_merge(shardd__buffer *b, shardd__view *x,
                                shardd__view *y) {
  if (x == NULL)
    return y;
  if (y == NULL)
    return x;
  b->frozen_probes++;
  if (held_hash(x->hdr.id) > held_hash(y->hdr.id)) {
    x->kind_r = kind_merge(b, x->kind_r, y);
    kind_pull(x);
    return x;
  }
  y->kind_l = kind_merge(b, x, y->kind_l);
  kind_pull(y);
  return y;
}

static shardd__view *kind_insert(shardd__buffer *b, shardd__view *t,
                                 shardd__view *v) {
  if (t == NULL || held_hash(v->hdr.id) > held_hash(t->hdr.id)) {
    kind_split(b, t, v, &v->kind_l, &v->kind_r);
    kind_pull(v);
    return v;
  }
  b->frozen_probes++;
  if (kind_before(v, t))
    t->kind_l = kind_insert(b, t->kind_l, v);
  else
    t->kind_r = kind_insert(b, t->kind_r, v);
  kind_pull(t);
  return t;
}

static shardd__view *kind_remove(shardd__buffer *b, shardd__view *t,
                                 shardd__view *v) {
  if (t == NULL)
    return NULL;
  b->frozen_probes++;
  if (t == v) {
    shardd__view *rest = kind_merge(b, v->kind_l, v->kind_r);
    v->kind_l = v->kind_r = NULL;
    return rest;
  }
  if (kind_before(v, t))
    t->kind_l = kind_remove(b, t->kind_l, v);
  else
    t->kind_r = kind_remove(b, t->kind_r, v);
  kind_pull(t);
  return t;
}

/* Lists v in its buffer's index of its kind (requires_grad as set). */
static void kind_add(shardd__view *v) {
  shardd__buffer *b = v->buf;
  int k = v->requires_grad;
  b->kind_root[k] = kind_insert(b, b->kind_root[k], v);
  if (!k)
    b->frozen_stale = 1;
}

static void kind_del(shardd__view *v) {
  shardd__buffer *b = v->buf;
  int k = v->requires_grad;
  b->kind_root[k] = kind_remove(b, b->kind_root[k], v);
  if (!k)
    b->frozen_stale = 1;
}

/* A view of kind k (requires_grad) of b meeting [start, end); NULL none. */
static const shardd__view *kind_meet(shardd__buffer *b, int k, uint64_t start,
                                     uint64_t end) {
  for (const shardd__view *t = b->kind_root[k]; t;) {
    b->frozen_probes++;
    if (t->offset < end && view_end(t) > start)
      return t;
    /* the left nodes start at or before t: one ending after start meets */
    if (t->kind_l && t->kind_l->kind_max > start)
      t = t->kind_l;
    else if (t->offset < end)
      t = t->kind_r;
    else
      return NULL; /* the right nodes start at or after end */
  }
  return NULL;
}

/* Room for one more frozen range in b->frozen_union, so reading the
 * merged ranges never allocates. */
static shardd_err frozen_reserve(shardd__buffer *b) {
  if (b->frozen_cap > b->nfrozen)
    return SHARDD_OK;
  size_t cap = b->frozen_cap ? 2 * b->frozen_cap : 16;
  uint64_t(*r)[2] = realloc(b->frozen_union, cap * sizeof *r);
  if (r == NULL)
    return SHARDD_E_NO_MEMORY;
  b->frozen_union = r;
  b->frozen_cap = cap;
  return SHARDD_OK;
}

/* In offset order, each range joins the last one when it starts at or
 * before its end. */
static void frozen_collect(shardd__buffer *b, const shardd__view *t,
                           size_t *m) {
  if (t == NULL)
    return;
  b->frozen_probes++;
  frozen_collect(b, t->kind_l, m);
  uint64_t(*r)[2] = b->frozen_union;
  if (*m > 0 && t->offset <= r[*m - 1][0] + r[*m - 1][1]) {
    if (view_end(t) > r[*m - 1][0] + r[*m - 1][1])
      r[*m - 1][1] = view_end(t) - r[*m - 1][0];
  } else {
    r[*m][0] = t->offset;
    r[*m][1] = t->numel;
    (*m)++;
  }
  frozen_collect(b, t->kind_r, m);
}

size_t shardd__buffer_frozen(shardd__buffer *buf, uint64_t (**ranges)[2]) {
  if (buf->frozen_stale) {
    size_t m = 0; /* at most nfrozen <= frozen_cap */
    frozen_collect(buf, buf->kind_root[0], &m);
    buf->nfrozen_union = m;
    buf->frozen_stale = 0;
  }
  *ranges = buf->frozen_union;
  return buf->nfrozen_union;
}

size_t shardd__buffer_trainable(shardd__buffer *buf, uint64_t lo,
                                uint64_t hi, uint64_t (*out)[2], size_t cap) {
  size_t n = 0;
  uint64_t pos = lo;
  uint64_t(*fr)[2];
  size_t nfr = shardd__buffer_frozen(buf, &fr);
  /* first frozen range ending after lo */
  size_t a = 0, z = nfr;
  while (a < z) {
    size_t mid = a + (z - a) / 2;
    if (fr[mid][0] + fr[mid][1] <= lo)
      a = mid + 1;
    else
      z = mid;
  }
  for (size_t i = a; i < nfr && pos < hi; i++) {
    uint64_t fs = fr[i][0], fe = fs + fr[i][1];
    if (fs > pos) {
      uint64_t end = fs < hi ? fs : hi;
      if (n < cap) {
        out[n][0] = pos;
        out[n][1] = end - pos;
      }
      n++;
    }
    if (fe > pos)
      pos = fe;
  }
  if (pos < hi) {
    if (n < cap) {
      out[n][0] = pos;
      out[n][1] = hi - pos;
    }
    n++;
  }
  return n;
}

shardd_err shardd__view_register(shardd__registry *reg, shardd__job *job,
                                 uint64_t buffer, const char *name,
                                 uint64_t offset, uint64_t numel,
                                 const int64_t *shape, int ndim,
                                 shardd__view **out, int *created, char *err,
                                 size_t errlen) {
  return shardd__view_register_ex(reg, job, buffer, 0, name, offset, numel,
                                  shape, ndim, 1, out, created, err, errlen);
}

shardd_err shardd__view_register_ex(shardd__registry *reg, shardd__job *job,
                                    uint64_t buffer, uint64_t buffer_gen,
                                    const char *name, uint64_t offset,
                                    uint64_t numel, const int64_t *shape,
                                    int ndim, int requires_grad,
                                    shardd__view **out, int *created,
                                    char *err, size_t errlen) {
  *out = NULL;
  *created = 0;
  requires_grad = requires_grad != 0;
  shardd__obj *o;
  char *gkey = NULL;
  uint64_t gprev = 0;
  shardd_err rc = shardd__registry_resolve_gen(reg, job, buffer, buffer_gen,
                                               SHARDD__OBJ_BUFFER, &o, err,
                                               errlen);
  if (rc != SHARDD_OK)
    return rc;
  shardd__buffer *b = (shardd__buffer *)o;
  if (!shardd__name_ok(name, "view", err, errlen))
    return SHARDD_E_INVAL;
  if (numel == 0 || offset > b->numel || numel > b->numel - offset) {
    snprintf(err, errlen,
             "view \"%s\": elements [%" PRIu64 ", %" PRIu64
             ") are outside buffer %" PRIu64 " (\"%s\", numel %" PRIu64 ")",
             name, offset, offset + numel, buffer, o->name, b->numel);
    return SHARDD_E_RANGE;
  }
  if (ndim < 0 || ndim > MAX_NDIM) {
    snprintf(err, errlen, "view \"%s\": %d dimensions (at most %d)", name, ndim,
             MAX_NDIM);
    return SHARDD_E_RANGE;
  }
  uint64_t prod = 1;
  for (int i = 0; i < ndim; i++) {
    if (shape[i] < 0 || (shape[i] > 0 && prod > MAX_NUMEL / (uint64_t)shape[i])) {
      snprintf(err, errlen, "view \"%s\": dimension %d is %" PRId64, name, i,
               shape[i]);
      return SHARDD_E_RANGE;
    }
    prod *= (uint64_t)shape[i];
  }
  if (prod != numel) {
    snprintf(err, errlen,
             "view \"%s\": shape has %" PRIu64 " elements, numel is %" PRIu64,
             name, prod, numel);
    return SHARDD_E_MISMATCH;
  }
  shardd__view *v = shardd__map_get_str(&b->views, name);
  if (v) {
    if (v->offset != offset || v->numel != numel || !same_shape(v, shape, ndim)) {
      snprintf(err, errlen,
               "view \"%s\" of buffer %" PRIu64 " exists with offset %" PRIu64
               " numel %" PRIu64 " and another shape",
               name, buffer, v->offset, v->numel);
      return SHARDD_E_MISMATCH;
    }
    if (v->requires_grad != requires_grad) {
      snprintf(err, errlen,
               "view %" PRIu64 " (\"%s\") of buffer %" PRIu64
               " exists with requires_grad=%s, not %s",
               v->hdr.id, name, buffer, v->requires_grad ? "true" : "false",
               requires_grad ? "true" : "false");
      return SHARDD_E_MISMATCH;
    }
    *out = v;
    return SHARDD_OK;
  }
  /* Frozen and trainable elements never mix, so "the elements an
   * optimizer may update" stays one well-defined set. */
  if (!requires_grad && b->owner) {
    snprintf(err, errlen,
             "view \"%s\": buffer %" PRIu64 " (\"%s\") is held whole by "
             "optimizer %" PRIu64 " (\"%s\"); a frozen view cannot be added to it",
             name, buffer, o->name, b->owner->hdr.id, b->owner->hdr.name);
    return SHARDD_E_BUSY;
  }
  if (!requires_grad) {
    const shardd__view *hit = kind_meet(b, 1, offset, offset + numel);
    if (hit) {
      snprintf(err, errlen,
               "frozen view \"%s\" [%" PRIu64 ", %" PRIu64
               ") overlaps trainable view %" PRIu64 " (\"%s\") [%" PRIu64
               ", %" PRIu64 ") of buffer %" PRIu64,
               name, offset, offset + numel, hit->hdr.id, hit->hdr.name,
               hit->offset, view_end(hit), buffer);
      return SHARDD_E_OVERLAP;
    }
    if (frozen_reserve(b) != SHARDD_OK) {
      snprintf(err, errlen, "out of memory");
      return SHARDD_E_NO_MEMORY;
    }
  } else {
    if (kind_meet(b, 0, offset, offset + numel)) {
      snprintf(err, errlen,
               "view \"%s\" [%" PRIu64 ", %" PRIu64
               ") overlaps frozen elements of buffer %" PRIu64
               " (\"%s\"); register it with requires_grad=false or move it",
               name, offset, offset + numel, buffer, o->name);
      return SHARDD_E_OVERLAP;
    }
  }
  if (!shardd__within_views(reg, job, err, errlen))
    return SHARDD_E_LIMIT;
  v = calloc(1, sizeof *v);
  if (v == NULL || (ndim > 0 && (v->shape = malloc((size_t)ndim * sizeof *shape)) == NULL))
    goto nomem;
  if (ndim > 0)
    memcpy(v->shape, shape, (size_t)ndim * sizeof *shape);
  v->ndim = ndim;
  v->buf = b;
  v->offset = offset;
  v->numel = numel;
  v->requires_grad = requires_grad;
  v->grad_seen = 1;
  gkey = shardd__gen_key(o->name, name);
  if (gkey == NULL || (gprev = shardd__gen_get(job, gkey),
                       shardd__gen_put(job, gkey, gprev + 1)) != SHARDD_OK)
    goto nomem;
  v->hdr.generation = gprev + 1;
  if (shardd__obj_init(reg, &v->hdr, SHARDD__OBJ_VIEW, name, job) !=
      SHARDD_OK) {
    shardd__gen_put(job, gkey, gprev);
    goto nomem;
  }
  if (shardd__map_put_str(&b->views, name, v) != SHARDD_OK) {
    shardd__obj_fini(reg, &v->hdr);
    shardd__gen_put(job, gkey, gprev);
    goto nomem;
  }
  kind_add(v);
  if (!requires_grad)
    b->nfrozen++;
  free(gkey);
  job->nviews++;
  reg->nviews++;
  *out = v;
  *created = 1;
  return SHARDD_OK;

nomem:
  free(gkey);
  if (v)
    free(v->shape);
  free(v);
  snprintf(err, errlen, "out of memory");
  return SHARDD_E_NO_MEMORY;
}

shardd_err shardd__view_unregister(shardd__registry *reg, shardd__job *job,
                                   uint64_t id, char *err, size_t errlen) {
  shardd_err rc = shardd__view_unregister_check(reg, job, id, err, errlen);
  if (rc != SHARDD_OK)
    return rc;
  shardd__obj *o;
  shardd__registry_resolve(reg, job, id, SHARDD__OBJ_VIEW, &o, err, errlen);
  shardd__view *v = (shardd__view *)o;
  shardd__buffer *b = v->buf;
  kind_del(v);
  shardd__map_del_str(&b->views, o->name);
  view_destroy(reg, v);
  return SHARDD_OK;
}

shardd_err shardd__view_unregister_check(shardd__registry *reg,
                                         shardd__job *job, uint64_t id,
                                         char *err, size_t errlen) {
  shardd__obj *o;
  shardd_err rc = shardd__registry_resolve(reg, job, id, SHARDD__OBJ_VIEW, &o,
                                           err, errlen);
  if (rc != SHARDD_OK)
    return rc;
  shardd__view *v = (shardd__view *)o;
  if (v->owner) {
    snprintf(err, errlen,
             "view %" PRIu64 " (\"%s\") is referenced by optimizer %" PRIu64,
             id, o->name, v->owner->hdr.id);
    return SHARDD_E_BUSY;
  }
  return SHARDD_OK;
}

void shardd__view_abandon(shardd__registry *reg, shardd__view *v) {
  shardd__buffer *b = v->buf;
  shardd__job *job = b->hdr.job;
  char *gkey = shardd__gen_key(b->hdr.name, v->hdr.name);
  /* the key exists (the registration put it), so this replaces or
   * deletes and allocates nothing */
  if (gkey)
    shardd__gen_put(job, gkey, v->hdr.generation - 1);
  free(gkey);
  kind_del(v);
  shardd__map_del_str(&b->views, v->hdr.name);
  job->nviews--;
  reg->nviews--;
  if (!v->requires_grad)
    b->nfrozen--;
  shardd__obj_fini(reg, &v->hdr);
  free(v->shape);
  free(v);
}

shardd_err shardd__view_set_requires_grad(shardd__registry *reg,
                                          shardd__job *job, uint64_t id,
                                          uint64_t generation,
                                          int requires_grad, char *err,
                                          size_t errlen) {
  shardd__obj *o;
  shardd_err rc = shardd__registry_resolve_gen(reg, job, id, generation,
                                               SHARDD__OBJ_VIEW, &o, err,
                                               errlen);
  if (rc != SHARDD_OK)
    return rc;
  shardd__view *v = (shardd__view *)o;
  shardd__buffer *b = v->buf;
  requires_grad = requires_grad != 0;
  if (v->requires_grad == requires_grad)
    return SHARDD_OK;
  if (!requires_grad && b->owner) {
    snprintf(err, errlen,
             "view %" PRIu64 " (\"%s\"): buffer %" PRIu64 " (\"%s\") is held "
             "whole by optimizer %" PRIu64 " (\"%s\"); a view of it cannot be "
             "frozen",
             id, o->name, b->hdr.id, b->hdr.name, b->owner->hdr.id,
             b->owner->hdr.name);
    return SHARDD_E_BUSY;
  }
  if (!requires_grad && frozen_reserve(b) != SHARDD_OK) {
    snprintf(err, errlen, "out of memory");
    return SHARDD_E_NO_MEMORY;
  }
  /* Frozen and trainable elements never mix: freezing must meet no other
   * trainable view, unfreezing no other frozen one. */
  int stale = b->frozen_stale;
  kind_del(v);
  const shardd__view *hit = kind_meet(b, v->requires_grad, v->offset,
                                      view_end(v));
  if (hit) {
    kind_add(v);
    b->frozen_stale = stale; /* the ranges are as they were */
    snprintf(err, errlen,
             "view %" PRIu64 " (\"%s\") [%" PRIu64 ", %" PRIu64
             ") overlaps %s view %" PRIu64 " (\"%s\") [%" PRIu64 ", %" PRIu64
             ") of buffer %" PRIu64 "; it cannot be %s alone",
             id, o->name, v->offset, view_end(v),
             requires_grad ? "frozen" : "trainable", hit->hdr.id,
             hit->hdr.name, hit->offset, view_end(hit), b->hdr.id,
             requires_grad ? "unfrozen" : "frozen");
    return SHARDD_E_OVERLAP;
  }
  v->requires_grad = requires_grad;
  kind_add(v);
  b->nfrozen += requires_grad ? (uint32_t)-1 : 1u;
  return SHARDD_OK;
}

/* ---- the index of held views ------------------------------------------
 * A treap keyed by (offset, id) with priorities hashed from the view's id:
 * deterministic, and expected O(log n) deep whatever order optimizers are
 * registered in (trainers register in memory order, which would make a
 * plain search tree a list). */

static uint64_t held_hash(uint64_t x) { /* splitmix64's finaliser */
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

static int held_before(const shardd__view *a, const shardd__view *b) {
  return a->offset != b->offset ? a->offset < b->offset
                                : a->hdr.id < b->hdr.id;
}

/* Splits t into the nodes before v (*l) and the rest (*r). */
static void held_split(shardd__buffer *b, shardd__view *t,
                       const shardd__view *v, shardd__view **l,
                       shardd__view **r) {
  while (t) {
    b->held_probes++;
    if (held_before(t, v)) {
      *l = t;
      l = &t->held_r;
      t = t->held_r;
    } else {
      *r = t;
      r = &t->held_l;
      t = t->held_l;
    }
  }
  *l = *r = NULL;
}

/* Joins x and y, every node of x before every node of y. */
static shardd__view *held_merge(shardd__buffer *b, shardd__view *x,
                                shardd__view *y) {
  shardd__view *root = NULL, **at = &root;
  while (x && y) {
    b->held_probes++;
    if (x->held_prio > y->held_prio) {
      *at = x;
      at = &x->held_r;
      x = x->held_r;
    } else {
      *at = y;
      at = &y->held_l;
      y = y->held_l;
    }
  }
  *at = x ? x : y;
  return root;
}

void shardd__buffer_held_add(shardd__view *v) {
  shardd__buffer *b = v->buf;
  v->held_prio = held_hash(v->hdr.id);
  shardd__view **at = &b->held_root;
  while (*at && (*at)->held_prio > v->held_prio) {
    b->held_probes++;
    at = held_before(v, *at) ? &(*at)->held_l : &(*at)->held_r;
  }
  held_split(b, *at, v, &v->held_l, &v->held_r);
  *at = v;
  b->nheld++;
}

void shardd__buffer_held_del(shardd__view *v) {
  shardd__buffer *b = v->buf;
  shardd__view **at = &b->held_root;
  while (*at && *at != v) {
    b->held_probes++;
    at = held_before(v, *at) ? &(*at)->held_l : &(*at)->held_r;
  }
  if (*at == NULL)
    return; /* never listed: nothing to undo */
  *at = held_merge(b, v->held_l, v->held_r);
  v->held_l = v->held_r = NULL;
  b->nheld--;
}

const shardd__view *shardd__buffer_held_from(shardd__buffer *buf,
                                             uint64_t start) {
  /* held views do not overlap, so ends ascend with offsets: the first one
   * ending after start is a lower bound on the end */
  const shardd__view *best = NULL;
  for (const shardd__view *t = buf->held_root; t;) {
    buf->held_probes++;
    if (t->offset + t->numel > start) {
      best = t;
      t = t->held_l;
    } else {
      t = t->held_r;
    }
  }
  return best;
}

static int cmp_view_offset(const void *a, const void *b) {
  const shardd__view *x = *(shardd__view *const *)a;
  const shardd__view *y = *(shardd__view *const *)b;
  if (x->offset != y->offset)
    return x->offset < y->offset ? -1 : 1;
  return x->hdr.id < y->hdr.id ? -1 : x->hdr.id > y->hdr.id;
}

shardd_err shardd__buffer_views(shardd__buffer *buf, shardd__view ***out,
                                size_t *n) {
  shardd_err rc = shardd__obj_values(&buf->views, (void ***)out, n);
  if (rc == SHARDD_OK)
    qsort(*out, *n, sizeof **out, cmp_view_offset);
  return rc;
}

shardd_err shardd__buffer_stage(shardd__registry *reg, shardd__buffer *b,
                                char *err, size_t errlen) {
  if (b->stage)
    return SHARDD_OK;
  shardd__job *job = b->hdr.job;
  shardd_err rc = reg->backend->ops->alloc(
      reg->backend, shardd__rank_device(reg, job->local_first),
      b->padded_numel * 4, "shardd:stage", &b->stage, err, errlen);
  if (rc == SHARDD_OK)
    job->bytes += b->stage->bytes;
  return rc;
}

/* ---- fp32 masters from exact values ------------------------------------ */

shardd_err shardd__region_zero(shardd__backend *be, shardd__region *r,
                               size_t off, size_t bytes) {
  if (be->ops->write == NULL) { /* host memory the daemon maps */
    memset((char *)r->ptr + off, 0, bytes);
    return SHARDD_OK;
  }
  static const char zeros[65536];
  for (size_t done = 0; done < bytes;) {
    size_t n = bytes - done < sizeof zeros ? bytes - done : sizeof zeros;
    shardd_err rc = be->ops->write(be, r, off + done, zeros, n);
    if (rc != SHARDD_OK)
      return rc;
    done += n;
  }
  return SHARDD_OK;
}

/* Seeds (see the buffer's seed and seed_holder) live in one place at a
 * time. Moving one between a region of its own and an optimizer shard's
 * master goes through the rank's reduced-gradient area when no gradient
 * lives there (before the buffer's first step nothing reads it then), so
 * the seed and the state it moves into are never allocated together: the
 * daemon's peak stays the bound of shard, reduced gradient and state. */

static size_t seed_bytes(const shardd__buffer *b) {
  return b->shard_numel * sizeof(float);
}

static shardd_err seed_arrays(shardd__buffer *b) {
  if (b->seed == NULL && (b->seed = calloc(b->world, sizeof *b->seed)) == NULL)
    return SHARDD_E_NO_MEMORY;
  if (b->seed_holder == NULL &&
      (b->seed_holder = calloc(b->world, sizeof *b->seed_holder)) == NULL)
    return SHARDD_E_NO_MEMORY;
  return SHARDD_OK;
}

static void seed_free(shardd__registry *reg, shardd__buffer *b, uint32_t rank) {
  if (b->seed == NULL || b->seed[rank] == NULL)
    return;
  b->hdr.job->bytes -= b->seed[rank]->bytes;
  reg->backend->ops->free(reg->backend, b->seed[rank]);
  b->seed[rank] = NULL;
}

/* (b, rank)'s seed in a region of its own, copied from (src, off). quota:
 * whether the job's limits apply (not to a seed going back from a master,
 * which gives back more than it takes). */
static shardd_err seed_region(shardd__registry *reg, shardd__buffer *b,
                              uint32_t rank, shardd__region *src, size_t off,
                              int quota, char *err, size_t errlen) {
  shardd__job *job = b->hdr.job;
  shardd__backend *be = reg->backend;
  size_t bytes = seed_bytes(b);
  if (quota && !shardd__within_quota(reg, job, bytes, err, errlen))
    return SHARDD_E_NO_MEMORY;
  char label[64];
  snprintf(label, sizeof label, "shardd:seed:%.40s:%" PRIu32, b->hdr.name, rank);
  shardd__region *r = NULL;
  shardd_err rc = (be->ops->alloc_private ? be->ops->alloc_private : be->ops->alloc)(
      be, shardd__rank_device(reg, rank), bytes, label, &r, err, errlen);
  if (rc != SHARDD_OK)
    return rc;
  rc = be->ops->copy(be, r, 0, src, off, bytes);
  if (rc != SHARDD_OK) {
    be->ops->free(be, r);
    snprintf(err, errlen, "copying the seed: %s", shardd_strerror(rc));
    return rc;
  }
  job->bytes += r->bytes;
  b->seed[rank] = r;
  return SHARDD_OK;
}

static shardd_err reduced_zero(shardd__registry *reg, shardd__buffer *b,
                               uint32_t rank) {
  return shardd__region_zero(reg->backend, b->blocks[rank], b->reduced_off,
                             seed_bytes(b));
}

int shardd__optim_shard_seed_park(shardd__registry *reg,
                                  shardd__optim_shard *sh) {
  shardd__buffer *b = sh->buf;
  uint32_t r = sh->rank;
  if (b->seed == NULL || b->seed[r] == NULL || b->reduced_live)
    return 0;
  shardd__backend *be = reg->backend;
  if (be->ops->copy(be, b->blocks[r], b->reduced_off, b->seed[r], 0,
                    seed_bytes(b)) != SHARDD_OK)
    return 0; /* the seed stays where it is */
  seed_free(reg, b, r);
  return 1;
}

void shardd__optim_shard_seed_unpark(shardd__registry *reg,
                                     shardd__optim_shard *sh) {
  shardd__buffer *b = sh->buf;
  char why[256];
  /* it fits: the state that failed to come is not held, the seed was */
  seed_region(reg, b, sh->rank, b->blocks[sh->rank], b->reduced_off, 0, why,
              sizeof why);
  reduced_zero(reg, b, sh->rank);
}

shardd_err shardd__optim_shard_seed(shardd__registry *reg,
                                    shardd__optim_shard *sh, int parked) {
  shardd__buffer *b = sh->buf;
  uint32_t r = sh->rank;
  if (sh->state == NULL || b->dtype == SHARDD_DTYPE_FP32)
    return SHARDD_OK;
  shardd__backend *be = reg->backend;
  size_t bytes = seed_bytes(b);
  shardd_err rc;
  if (parked) {
    rc = be->ops->copy(be, sh->state, sh->master_off, b->blocks[r],
                       b->reduced_off, bytes);
    if (rc != SHARDD_OK) {
      shardd__optim_shard_seed_unpark(reg, sh);
      return rc;
    }
    reduced_zero(reg, b, r);
  } else if (b->seed && b->seed[r]) {
    rc = be->ops->copy(be, sh->state, sh->master_off, b->seed[r], 0, bytes);
    if (rc != SHARDD_OK)
      return rc;
    seed_free(reg, b, r);
  } else if (b->seed_holder && b->seed_holder[r]) {
    const shardd__optim_shard *h = b->seed_holder[r];
    rc = be->ops->copy(be, sh->state, sh->master_off, h->state, h->master_off,
                       bytes);
    if (rc != SHARDD_OK)
      return rc;
  } else {
    return SHARDD_OK;
  }
  sh->master_valid = 1;
  if (b->seed_holder && b->seed_holder[r] == NULL)
    b->seed_holder[r] = sh;
  return SHARDD_OK;
}

void shardd__optim_shard_unseed(shardd__registry *reg, shardd__optim_shard *sh) {
  shardd__buffer *b = sh->buf;
  uint32_t r = sh->rank;
  if (b->seed_holder == NULL || b->seed_holder[r] != sh)
    return;
  b->seed_holder[r] = NULL;
  shardd__job *job = b->hdr.job;
  if (job->releasing || sh->state == NULL)
    return;
  /* another optimizer's shard over (b, rank) took it too (sh's optimizer
   * is out of the job's map by now) */
  shardd__optim **opts;
  size_t no;
  if (shardd__job_optims(job, &opts, &no) == SHARDD_OK) {
    for (size_t i = 0; i < no && b->seed_holder[r] == NULL; i++)
      for (size_t k = 0; k < opts[i]->nshards; k++) {
        shardd__optim_shard *o = &opts[i]->shards[k];
        if (o != sh && o->buf == b && o->rank == r && o->state && o->master_valid) {
          b->seed_holder[r] = o;
          break;
        }
      }
    free(opts);
    if (b->seed_holder[r])
      return;
  }
  /* none: back into a region of its own, through the reduced area once
   * sh's state is freed. Should that fail, the master is widened from
   * the 16-bit shard at the first step, as without a seed. */
  shardd__backend *be = reg->backend;
  char why[256];
  if (!b->reduced_live &&
      be->ops->copy(be, b->blocks[r], b->reduced_off, sh->state, sh->master_off,
                    seed_bytes(b)) == SHARDD_OK) {
    job->bytes -= sh->state->bytes;
    be->ops->free(be, sh->state);
    sh->state = NULL;
    seed_region(reg, b, r, b->blocks[r], b->reduced_off, 0, why, sizeof why);
    reduced_zero(reg, b, r);
    return;
  }
  seed_region(reg, b, r, sh->state, sh->master_off, 0, why, sizeof why);
}

shardd_err shardd__buffer_seed(shardd__registry *reg, shardd__buffer *b,
                               uint32_t rank, char *err, size_t errlen) {
  shardd__job *job = b->hdr.job;
  shardd__backend *be = reg->backend;
  if (b->dtype == SHARDD_DTYPE_FP32) {
    snprintf(err, errlen, "buffer \"%s\" is fp32: its shard is its own master",
             b->hdr.name);
    return SHARDD_E_INVAL;
  }
  if (b->inflight) {
    snprintf(err, errlen, "buffer \"%s\" is in use by a collective or step",
             b->hdr.name);
    return SHARDD_E_BUSY;
  }
  if (rank >= b->world || b->blocks[rank] == NULL) {
    snprintf(err, errlen, "rank %" PRIu32 " has no shard of buffer \"%s\" here",
             rank, b->hdr.name);
    return SHARDD_E_RANGE;
  }
  size_t bytes = seed_bytes(b);
  if (seed_arrays(b) != SHARDD_OK) {
    snprintf(err, errlen, "out of memory");
    return SHARDD_E_NO_MEMORY;
  }
  /* into the master of every optimizer shard over (b, rank) now; a seed
   * of its own only while there is none */
  shardd__optim **opts;
  size_t no;
  int took = 0;
  shardd_err rc = shardd__job_optims(job, &opts, &no);
  if (rc == SHARDD_OK) {
    for (size_t i = 0; i < no && rc == SHARDD_OK; i++)
      for (size_t k = 0; k < opts[i]->nshards && rc == SHARDD_OK; k++) {
        shardd__optim_shard *sh = &opts[i]->shards[k];
        if (sh->buf != b || sh->rank != rank || sh->state == NULL)
          continue;
        rc = be->ops->copy(be, sh->state, sh->master_off, b->blocks[rank],
                           b->reduced_off, bytes);
        if (rc == SHARDD_OK) {
          sh->master_valid = 1;
          if (!took++)
            b->seed_holder[rank] = sh;
        }
      }
    free(opts);
  }
  if (rc == SHARDD_OK && took)
    seed_free(reg, b, rank); /* the masters hold the new values */
  else if (rc == SHARDD_OK && b->seed[rank])
    rc = be->ops->copy(be, b->seed[rank], 0, b->blocks[rank], b->reduced_off,
                       bytes);
  else if (rc == SHARDD_OK) {
    rc = seed_region(reg, b, rank, b->blocks[rank], b->reduced_off, 1, err,
                     errlen);
    if (rc != SHARDD_OK)
      return rc; /* err says why */
  }
  if (rc == SHARDD_OK)
    rc = reduced_zero(reg, b, rank);
  b->reduced_live = 0;
  if (rc != SHARDD_OK)
    snprintf(err, errlen, "seeding the master of buffer \"%s\" rank %" PRIu32
             ": %s", b->hdr.name, rank, shardd_strerror(rc));
  return rc;
}

void shardd__buffer_seed_drop(shardd__registry *reg, shardd__buffer *b) {
  if (b->seed)
    for (uint32_t r = 0; r < b->world; r++)
      seed_free(reg, b, r);
  free(b->seed);
  free(b->seed_holder);
  b->seed = NULL;
  b->seed_holder = NULL;
}
