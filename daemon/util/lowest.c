/* lowest.c — the lowest ranks of a set (see lowest.h): a bounded max-heap,
 * its largest replaced by anything lower, heap-sorted at the end. */
#include "lowest.h"

static void swap(uint32_t *a, uint32_t *b) {
  uint32_t t = *a;
  *a = *b;
  *b = t;
}

/* v[0..n) a max-heap but for v[i]: moves v[i] down to its place. */
static void sift_down(uint32_t *v, size_t n, size_t i) {
  for (;;) {
    size_t c = 2 * i + 1;
    if (c >= n)
      return;
    if (c + 1 < n && v[c + 1] > v[c])
      c++;
    if (v[i] >= v[c])
      return;
    swap(&v[i], &v[c]);
    i = c;
  }
}

void shardd__lowest_init(shardd__lowest *l, uint32_t *slots, size_t max) {
  l->v = slots;
  l->n = 0;
  l->max = max;
}

void shardd__lowest_add(shardd__lowest *l, uint32_t x) {
  if (l->n < l->max) {
    size_t c = l->n++;
    l->v[c] = x;
    for (; c > 0 && l->v[(c - 1) / 2] < l->v[c]; c = (c - 1) / 2)
      swap(&l->v[c], &l->v[(c - 1) / 2]);
  } else if (l->max > 0 && x < l->v[0]) {
    l->v[0] = x;
    sift_down(l->v, l->n, 0);
  }
}

size_t shardd__lowest_finish(shardd__lowest *l) {
  for (size_t m = l->n; m > 1; m--) { /* the largest left to the end */
    swap(&l->v[0], &l->v[m - 1]);
    sift_down(l->v, m - 1, 0);
  }
  return l->n;
}
