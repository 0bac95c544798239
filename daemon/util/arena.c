/* arena.c — a bump allocator rewound to marks (see arena.h). */
#include "arena.h"

#include <stdint.h>
#include <stdlib.h>

#define ALIGN _Alignof(max_align_t)

struct shardd__arena_big {
  union {
    struct shardd__arena_big *next;
    max_align_t align; /* what follows is aligned as malloc's own */
  } h;
};

/* Under AddressSanitizer every allocation is malloc's own, freed at its
 * rewind: a pointer kept past the rewind is then a use after free it
 * reports, not a silent read of the next request's bytes. */
#if defined(__SANITIZE_ADDRESS__)
#define ARENA_SANITIZED 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define ARENA_SANITIZED 1
#endif
#endif

void shardd__arena_init(shardd__arena *a, size_t cap) {
#ifdef ARENA_SANITIZED
  cap = 0;
#endif
  a->block = NULL;
  a->cap = cap;
  a->used = 0;
  a->big = NULL;
}

void *shardd__arena_alloc(shardd__arena *a, size_t n) {
  size_t need = (n + ALIGN - 1) & ~(size_t)(ALIGN - 1);
  if (need < n)
    return NULL;
  if (a->block == NULL && a->cap > 0 && need <= a->cap)
    a->block = malloc(a->cap); /* stays NULL when out of memory: big below */
  if (a->block && need <= a->cap - a->used) {
    void *p = a->block + a->used;
    a->used += need;
    return p;
  }
  if (n > SIZE_MAX - sizeof(struct shardd__arena_big))
    return NULL;
  struct shardd__arena_big *b = malloc(sizeof *b + n);
  if (b == NULL)
    return NULL;
  b->h.next = a->big;
  a->big = b;
  return b + 1;
}

shardd__arena_mark shardd__arena_mark_now(const shardd__arena *a) {
  return (shardd__arena_mark){a->used, a->big};
}

void shardd__arena_rewind(shardd__arena *a, shardd__arena_mark m) {
  while (a->big != m.big) {
    struct shardd__arena_big *b = a->big;
    a->big = b->h.next;
    free(b);
  }
  a->used = m.used;
}

void shardd__arena_free(shardd__arena *a) {
  shardd__arena_rewind(a, (shardd__arena_mark){0, NULL});
  free(a->block);
  a->block = NULL;
}
