/* arena.c — a bump allocator rewound to marks (see arena.h). */
#include "arena.h"

#include <stdint.h>
#include <stdlib.h>

#include "poison.h"

#define ALIGN _Alignof(max_align_t)

/* Chunks past the first block grow to this at most; a spare kept for the
 * next request is at most this too (what an idle daemon keeps). */
#define CHUNK_MAX ((size_t)4 << 20)

struct shardd__arena_big {
  union {
    struct {
      struct shardd__arena_big *next;
      size_t cap, used; /* bytes after the header */
    } s;
    max_align_t align; /* what follows is aligned as malloc's own */
  } h;
};

/* Under AddressSanitizer the same code runs, with what no live piece
 * holds poisoned (poison.h): a piece's overflow into its redzone or the
 * next piece, or a pointer kept past its rewind, is reported, not a
 * silent read of the next request's bytes. */
static void *chunk_bytes(struct shardd__arena_big *b) { return b + 1; }

/* A chunk handed back to malloc: unpoisoned first, as malloc handed it
 * out. */
static void chunk_free(struct shardd__arena_big *b) {
  if (b)
    SHARDD__UNPOISON(chunk_bytes(b), b->h.s.cap);
  free(b);
}

void shardd__arena_init(shardd__arena *a, size_t cap) {
  a->block = NULL;
  a->cap = cap;
  a->used = 0;
  a->big = NULL;
  a->spare = NULL;
}

/* A chunk of at least need bytes after the block and the chunks so far:
 * the spare when it holds need, else twice the newest (or the block's
 * size), up to CHUNK_MAX or need. Pieces are bumped out of it, so a
 * request larger than the block (a batch of 4096 registrations) costs a
 * few mallocs, not one per piece (33,000 per 10,000 views before). */
static struct shardd__arena_big *chunk_new(shardd__arena *a, size_t need) {
  struct shardd__arena_big *b = a->spare;
  if (b && b->h.s.cap >= need) {
    a->spare = NULL;
    return b;
  }
  size_t cap = a->big ? 2 * a->big->h.s.cap : 2 * a->cap;
  if (cap > CHUNK_MAX)
    cap = CHUNK_MAX;
  if (cap < need)
    cap = need;
  if (cap > SIZE_MAX - sizeof *b)
    return NULL;
  b = malloc(sizeof *b + cap);
  if (b) {
    b->h.s.cap = cap;
    SHARDD__POISON(chunk_bytes(b), cap); /* a spare is poisoned already */
  }
  return b;
}

void *shardd__arena_alloc(shardd__arena *a, size_t n) {
  size_t need = (n + SHARDD__REDZONE + ALIGN - 1) & ~(size_t)(ALIGN - 1);
  if (need < n)
    return NULL;
  if (a->block == NULL && a->cap > 0 && need <= a->cap) {
    a->block = malloc(a->cap); /* stays NULL when out of memory: big below */
    if (a->block)
      SHARDD__POISON(a->block, a->cap);
  }
  if (a->big == NULL && a->block && need <= a->cap - a->used) {
    void *p = a->block + a->used;
    a->used += need;
    SHARDD__UNPOISON(p, n);
    return p;
  }
  struct shardd__arena_big *b = a->big;
  if (b == NULL || need > b->h.s.cap - b->h.s.used) {
    if ((b = chunk_new(a, need)) == NULL)
      return NULL;
    b->h.s.used = 0;
    b->h.s.next = a->big;
    a->big = b;
  }
  void *p = (unsigned char *)chunk_bytes(b) + b->h.s.used;
  b->h.s.used += need;
  SHARDD__UNPOISON(p, n);
  return p;
}

shardd__arena_mark shardd__arena_mark_now(const shardd__arena *a) {
  return (shardd__arena_mark){a->used, a->big, a->big ? a->big->h.s.used : 0};
}

void shardd__arena_rewind(shardd__arena *a, shardd__arena_mark m) {
  while (a->big != m.big) {
    struct shardd__arena_big *b = a->big;
    a->big = b->h.s.next;
    /* the largest chunk stays for the next large request */
    if (b->h.s.cap <= CHUNK_MAX &&
        (a->spare == NULL || a->spare->h.s.cap < b->h.s.cap)) {
      chunk_free(a->spare);
      SHARDD__POISON(chunk_bytes(b), b->h.s.cap);
      a->spare = b;
      continue;
    }
    chunk_free(b);
  }
  if (a->big) {
    SHARDD__POISON((unsigned char *)chunk_bytes(a->big) + m.big_used,
                   a->big->h.s.used - m.big_used);
    a->big->h.s.used = m.big_used;
  }
  if (a->block)
    SHARDD__POISON(a->block + m.used, a->used - m.used);
  a->used = m.used;
}

void shardd__arena_free(shardd__arena *a) {
  shardd__arena_rewind(a, (shardd__arena_mark){0, NULL, 0});
  chunk_free(a->spare);
  a->spare = NULL;
  if (a->block)
    SHARDD__UNPOISON(a->block, a->cap);
  free(a->block);
  a->block = NULL;
}
