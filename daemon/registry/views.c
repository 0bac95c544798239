/* views.c — the views named inside a buffer: registration and attach,
 * the index of views by kind (frozen, trainable), frozen ranges and the
 * trainable complement, requires_grad changes. */
#include "registry.h"
#include "registry_int.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void shardd__view_destroy(shardd__registry *reg, shardd__view *v) {
  v->buf->hdr.job->nviews--;
  reg->nviews--;
  if (!v->requires_grad)
    v->buf->nfrozen--;
  shardd__record_freed(&v->hdr, v->buf->hdr.name);
  shardd__obj_fini(reg, &v->hdr);
  free(v); /* and its shape and name, in the same allocation */
}

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
  if (shardd__held_hash(x->hdr.id) > shardd__held_hash(y->hdr.id)) {
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
  if (t == NULL || shardd__held_hash(v->hdr.id) > shardd__held_hash(t->hdr.id)) {
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

/* A new or repeated view's elements lie inside its buffer and its shape
 * (at most SHARDD__MAX_NDIM dimensions, none negative, no overflow) has
 * numel elements. */
static shardd_err view_geometry(const shardd__buffer *b, uint64_t buffer,
                                const char *name, uint64_t offset,
                                uint64_t numel, const int64_t *shape, int ndim,
                                char *err, size_t errlen) {
  if (numel == 0 || offset > b->numel || numel > b->numel - offset) {
    snprintf(err, errlen,
             "view \"%s\": elements [%" PRIu64 ", %" PRIu64
             ") are outside buffer %" PRIu64 " (\"%s\", numel %" PRIu64 ")",
             name, offset, offset + numel, buffer, b->hdr.name, b->numel);
    return SHARDD_E_RANGE;
  }
  if (ndim < 0 || ndim > SHARDD__MAX_NDIM) {
    snprintf(err, errlen, "view \"%s\": %d dimensions (at most %d)", name, ndim,
             SHARDD__MAX_NDIM);
    return SHARDD_E_RANGE;
  }
  uint64_t prod = 1;
  for (int i = 0; i < ndim; i++) {
    if (shape[i] < 0 ||
        (shape[i] > 0 && prod > SHARDD__MAX_NUMEL / (uint64_t)shape[i])) {
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
  return SHARDD_OK;
}

/* The view name (of buffer b, o its header) does not name yet, checked
 * against b's other views and the limits and made, with its generation
 * and id; not yet in b's map of views (the caller's slot). */
static shardd_err view_new(shardd__registry *reg, shardd__job *job,
                           shardd__buffer *b, uint64_t buffer,
                           const char *name, uint64_t offset, uint64_t numel,
                           const int64_t *shape, int ndim, int requires_grad,
                           shardd__view **out, char *err, size_t errlen) {
  shardd__obj *o = &b->hdr;
  char *gkey = NULL, kbuf[256];
  uint64_t gprev = 0;
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
  /* the shape right after the view, then its name: one allocation
   * (sizeof *v is a multiple of its alignment, which int64_t's does not
   * exceed) */
  size_t nlen = strlen(name) + 1;
  shardd__view *v = calloc(1, sizeof *v + (size_t)ndim * sizeof *shape + nlen);
  if (v == NULL)
    goto nomem;
  if (ndim > 0) {
    v->shape = (int64_t *)(v + 1);
    memcpy(v->shape, shape, (size_t)ndim * sizeof *shape);
  }
  char *vname = (char *)((int64_t *)(v + 1) + ndim);
  memcpy(vname, name, nlen);
  v->ndim = ndim;
  v->buf = b;
  v->offset = offset;
  v->numel = numel;
  v->requires_grad = requires_grad;
  v->grad_seen = 1;
  gkey = shardd__gen_key_in(kbuf, sizeof kbuf, o->name, name);
  if (gkey == NULL || shardd__gen_next(job, gkey, &gprev) != SHARDD_OK)
    goto nomem;
  v->hdr.generation = gprev + 1;
  if (shardd__obj_init_inline(reg, &v->hdr, SHARDD__OBJ_VIEW, vname, job) !=
      SHARDD_OK) {
    shardd__gen_put(job, gkey, gprev);
    goto nomem;
  }
  if (gkey != kbuf)
    free(gkey);
  *out = v;
  return SHARDD_OK;

nomem:
  if (gkey != kbuf)
    free(gkey);
  free(v);
  snprintf(err, errlen, "out of memory");
  return SHARDD_E_NO_MEMORY;
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
  shardd_err rc = shardd__registry_resolve_gen(reg, job, buffer, buffer_gen,
                                               SHARDD__OBJ_BUFFER, &o, err,
                                               errlen);
  if (rc != SHARDD_OK)
    return rc;
  shardd__buffer *b = (shardd__buffer *)o;
  if (!shardd__name_ok(name, "view", err, errlen))
    return SHARDD_E_INVAL;
  rc = view_geometry(b, buffer, name, offset, numel, shape, ndim, err, errlen);
  if (rc != SHARDD_OK)
    return rc;
  /* one hash and one search of the name: the slot is filled below, or
   * taken out again when the view is refused */
  void **slot = shardd__map_slot_str(&b->views, name);
  if (slot == NULL) {
    snprintf(err, errlen, "out of memory");
    return SHARDD_E_NO_MEMORY;
  }
  shardd__view *v = *slot;
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
  rc = view_new(reg, job, b, buffer, name, offset, numel, shape, ndim,
                requires_grad, &v, err, errlen);
  if (rc != SHARDD_OK) {
    shardd__map_del_str(&b->views, name);
    return rc;
  }
  *slot = v;
  kind_add(v);
  if (!requires_grad)
    b->nfrozen++;
  job->nviews++;
  reg->nviews++;
  *out = v;
  *created = 1;
  return SHARDD_OK;
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
  shardd__view_destroy(reg, v);
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
  free(v); /* and its shape and name */
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
