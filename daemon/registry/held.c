/* held.c — the index of a buffer's held views (views an optimizer owns),
 * and listing a buffer's views in memory order. */
#include "registry.h"
#include "registry_int.h"

#include <stdlib.h>

/* ---- the index of held views ------------------------------------------
 * A treap keyed by (offset, id) with priorities hashed from the view's id:
 * deterministic, and expected O(log n) deep whatever order optimizers are
 * registered in (trainers register in memory order, which would make a
 * plain search tree a list). */

uint64_t shardd__held_hash(uint64_t x) { /* splitmix64's finaliser */
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
  v->held_prio = shardd__held_hash(v->hdr.id);
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
