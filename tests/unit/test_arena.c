/* test_arena.c — the request arena (util/arena): what a request decodes
 * into is taken back at once at its rewind and reused by the next, marks
 * nest, and what does not fit the block is malloc's, freed at its rewind.
 * Under ASan (make check) the same chunk code runs with what no live piece
 * holds poisoned: an overflow past a piece and a read after a rewind are
 * reported. */
#include <criterion/criterion.h>
#include <stdint.h>
#include <string.h>

#include "arena.h"
#include "poison.h"

static int aligned(const void *p) {
  return ((uintptr_t)p % _Alignof(max_align_t)) == 0;
}

Test(arena, pieces_are_aligned_apart_and_reused_after_a_rewind) {
  shardd__arena a;
  shardd__arena_init(&a, 1024);
  shardd__arena_mark m = shardd__arena_mark_now(&a);
  char *x = shardd__arena_alloc(&a, 3);
  char *y = shardd__arena_alloc(&a, 40);
  cr_assert(x && y);
  cr_expect(aligned(x) && aligned(y));
  cr_expect(y >= x + 3, "the pieces overlap");
  memset(x, 'x', 3);
  memset(y, 'y', 40);
  cr_expect_eq(x[2], 'x', "a later piece wrote over an earlier one");
  /* the next request's pieces take the same bytes: nothing of the first
   * may be read after its rewind (the rule the dispatcher relies on) */
  shardd__arena_rewind(&a, m);
  char *z = shardd__arena_alloc(&a, 3);
  cr_assert_not_null(z);
  cr_expect_eq(z, x, "a rewound arena did not reuse its block");
  shardd__arena_free(&a);
}

Test(arena, an_inner_rewind_keeps_the_outer_pieces) {
  shardd__arena a;
  shardd__arena_init(&a, 256);
  shardd__arena_mark outer = shardd__arena_mark_now(&a);
  unsigned char *o = shardd__arena_alloc(&a, 100);
  unsigned char *ob = shardd__arena_alloc(&a, 1000); /* past the block */
  cr_assert(o && ob);
  memset(o, 0xaa, 100);
  memset(ob, 0xbb, 1000);
  /* a held frame replayed inside a handler: decoded above, rewound alone */
  shardd__arena_mark inner = shardd__arena_mark_now(&a);
  unsigned char *i1 = shardd__arena_alloc(&a, 100);
  unsigned char *i2 = shardd__arena_alloc(&a, 5000);
  cr_assert(i1 && i2);
  cr_expect(i1 >= o + 100 || i1 + 100 <= o, "inner piece inside an outer one");
  memset(i1, 0x11, 100);
  memset(i2, 0x22, 5000);
  shardd__arena_rewind(&a, inner);
  for (int k = 0; k < 100; k++)
    cr_assert_eq(o[k], 0xaa, "outer byte %d changed", k);
  for (int k = 0; k < 1000; k++)
    cr_assert_eq(ob[k], 0xbb, "outer large byte %d changed", k);
  cr_expect_eq(a.big, inner.big, "the inner large piece was not freed");
  shardd__arena_rewind(&a, outer);
  cr_expect_eq(a.big, NULL, "a large piece outlived its rewind");
  cr_expect_eq(a.used, 0);
  shardd__arena_free(&a);
}

Test(arena, pieces_larger_than_the_block_come_from_malloc) {
  shardd__arena a;
  shardd__arena_init(&a, 64);
  shardd__arena_mark m = shardd__arena_mark_now(&a);
  /* a batch of registrations: more than the block, still whole */
  unsigned char *p = shardd__arena_alloc(&a, 1 << 20);
  cr_assert_not_null(p);
  cr_expect(aligned(p));
  memset(p, 7, 1 << 20);
  cr_expect_null(shardd__arena_alloc(&a, SIZE_MAX - 4), "an impossible size");
  shardd__arena_rewind(&a, m);
  cr_expect_null(a.big);
  /* usable again after free */
  shardd__arena_free(&a);
  cr_expect_not_null(shardd__arena_alloc(&a, 8));
  shardd__arena_free(&a);
}

Test(arena, small_pieces_past_the_block_share_one_chunk) {
  shardd__arena a;
  shardd__arena_init(&a, 256);
  shardd__arena_mark m = shardd__arena_mark_now(&a);
  /* a batch of 4096 registrations decodes into many small pieces beyond
   * the block: bumped out of one chunk, not a malloc each */
  for (int k = 0; k < 4; k++)
    cr_assert_not_null(shardd__arena_alloc(&a, 64));
  unsigned char *p = shardd__arena_alloc(&a, 48);
  unsigned char *q = shardd__arena_alloc(&a, 48);
  unsigned char *r = shardd__arena_alloc(&a, 48);
  cr_assert(p && q && r);
  /* (under ASan each piece is followed by its redzone) */
  size_t step = (48 + SHARDD__REDZONE + _Alignof(max_align_t) - 1) /
                _Alignof(max_align_t) * _Alignof(max_align_t);
  cr_expect_eq(q, p + step, "the second piece past the block is not the next "
               "in a chunk");
  cr_expect_eq(r, q + step);
  memset(p, 1, 48);
  memset(q, 2, 48);
  memset(r, 3, 48);
  cr_expect_eq(p[47], 1);
  cr_expect_eq(q[47], 2);
  /* an inner mark inside the chunk: its rewind keeps what came before */
  shardd__arena_mark in = shardd__arena_mark_now(&a);
  unsigned char *s = shardd__arena_alloc(&a, 48);
  cr_assert_not_null(s);
  memset(s, 4, 48);
  shardd__arena_rewind(&a, in);
  cr_expect_eq(r[47], 3);
  unsigned char *t = shardd__arena_alloc(&a, 48);
  cr_assert_not_null(t);
  cr_expect_eq(t, s, "the inner rewind did not give its bytes back");
  shardd__arena_rewind(&a, m);
  cr_expect_null(a.big);
  cr_expect_eq(a.used, 0);
  shardd__arena_free(&a);
}

/* Requests of every shape, nested as held frames replayed from a handler
 * are: pieces in the block, in chunks, a spare chunk taken again, pieces
 * past the chunk limit, marks inside a chunk. Every piece still live
 * keeps its bytes whatever came and was rewound after it (under ASan,
 * every access is also checked to be inside a live piece). */
Test(arena, live_pieces_keep_their_bytes_through_nested_requests) {
  enum { OPS = 6000, LIVE = 4096, DEPTH = 16 };
  static struct {
    unsigned char *p;
    size_t n;
    unsigned char v;
  } live[LIVE];
  shardd__arena_mark marks[DEPTH];
  size_t at_mark[DEPTH];
  uint64_t x = 88172645463325252u; /* xorshift: the same run each time */
  for (int round = 0; round < 4; round++) {
    shardd__arena a;
    shardd__arena_init(&a, 1024 << round);
    size_t nlive = 0;
    int depth = 0;
    for (int op = 0; op < OPS; op++) {
      x ^= x << 13, x ^= x >> 7, x ^= x << 17;
      unsigned r = (unsigned)(x % 100);
      if (r < 80 && nlive < LIVE) {
        size_t n = x % 10 == 0 ? (size_t)(x >> 20) % (600u << 10)
                               : 1 + (size_t)(x >> 20) % 300;
        if (x % 1000 == 7)
          n = ((size_t)4 << 20) + (size_t)(x >> 40) % 4096; /* past a chunk */
        unsigned char *p = shardd__arena_alloc(&a, n);
        cr_assert_not_null(p);
        cr_assert(aligned(p));
        unsigned char v = (unsigned char)(1 + (x >> 8) % 255);
        memset(p, v, n);
        live[nlive].p = p;
        live[nlive].n = n;
        live[nlive].v = v;
        nlive++;
      } else if (r < 90 && depth < DEPTH) {
        at_mark[depth] = nlive;
        marks[depth++] = shardd__arena_mark_now(&a);
      } else if (depth > 0) {
        shardd__arena_rewind(&a, marks[--depth]);
        nlive = at_mark[depth];
      }
      if (r < 80 && op % 64 != 0)
        continue;
      for (size_t i = 0; i < nlive; i++) {
        size_t n = live[i].n;
        if (n == 0)
          continue;
        cr_assert(live[i].p[0] == live[i].v && live[i].p[n / 2] == live[i].v &&
                      live[i].p[n - 1] == live[i].v,
                  "round %d op %d: piece %zu of %zu bytes was written over",
                  round, op, i, n);
      }
    }
    shardd__arena_free(&a);
  }
}

#ifdef SHARDD__ASAN
#include "asan_death.h"

/* Where a bad access lands: a piece of n bytes, from the block (the arena's
 * cap holds it) or from a chunk (a cap of 0 has no block). */
typedef struct {
  size_t cap, n;
} where;

static void overflow_into_the_next_piece(void *arg) {
  const where *w = arg;
  shardd__arena a;
  shardd__arena_init(&a, w->cap);
  unsigned char *p = shardd__arena_alloc(&a, w->n);
  unsigned char *q = shardd__arena_alloc(&a, w->n);
  if (p == NULL || q == NULL)
    _exit(3);
  /* a decoder writing one piece's bytes and going on past its end (where
   * the next piece starts, when it is in the same block or chunk) */
  for (volatile unsigned char *b = p; b < p + w->n + SHARDD__REDZONE + 16; b++)
    *b = 1;
}

/* A read of p in a function of its own: GCC drops a check of an address
 * it checked before in the same function, even across a call (the
 * rewind), which would hide the read below. */
__attribute__((noinline)) static unsigned char read_byte(
    volatile unsigned char *p) {
  return *p;
}

static void read_after_the_rewind(void *arg) {
  const where *w = arg;
  shardd__arena a;
  shardd__arena_init(&a, w->cap);
  shardd__arena_mark m = shardd__arena_mark_now(&a);
  volatile unsigned char *p = shardd__arena_alloc(&a, w->n);
  if (p == NULL)
    _exit(3);
  p[0] = 7;
  shardd__arena_rewind(&a, m);
  /* a pointer into the last request kept by its handler */
  if (read_byte(p) == 42)
    _exit(4);
}

static void use_after_free(void *arg) {
  (void)arg;
  shardd__arena a;
  shardd__arena_init(&a, 256);
  volatile unsigned char *p = shardd__arena_alloc(&a, 100);
  volatile unsigned char *q = shardd__arena_alloc(&a, 1000);
  if (p == NULL || q == NULL)
    _exit(3);
  shardd__arena_free(&a);
  read_byte(p); /* the block given back to malloc */
}

Test(arena, an_overflow_past_a_piece_is_reported_in_the_block_and_a_chunk) {
  /* pieces of a multiple of the alignment: only the redzone is between */
  where cases[] = {{1024, 48}, {1024, 40}, {0, 48}, {0, 5}, {64, 1000}};
  char report[8192];
  for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++)
    cr_expect(asan_reports(overflow_into_the_next_piece, &cases[k],
                           "use-after-poison", report, sizeof report),
              "an overflow of a %zu-byte piece (block %zu) went unseen: %s",
              cases[k].n, cases[k].cap, report);
}

Test(arena, a_read_after_the_rewind_is_reported) {
  /* the block, a chunk that stays (the spare), a chunk past the largest
   * kept (freed) */
  where cases[] = {{1024, 48}, {0, 48}, {0, (size_t)8 << 20}};
  char report[8192];
  for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++)
    cr_expect(asan_reports(read_after_the_rewind, &cases[k],
                           cases[k].n > ((size_t)4 << 20) ? "heap-use-after-free"
                                                         : "use-after-poison",
                           report, sizeof report),
              "a read of a %zu-byte piece (block %zu) after its rewind went "
              "unseen: %s",
              cases[k].n, cases[k].cap, report);
  cr_expect(asan_reports(use_after_free, NULL, "heap-use-after-free", report,
                         sizeof report),
            "a use after the arena's free went unseen: %s", report);
}

static void in_bounds_use(void *arg) {
  (void)arg;
  shardd__arena a;
  shardd__arena_init(&a, 256);
  for (int round = 0; round < 3; round++) {
    shardd__arena_mark m = shardd__arena_mark_now(&a);
    for (size_t n = 0; n < 3000; n += 37) {
      unsigned char *p = shardd__arena_alloc(&a, n);
      if (p == NULL)
        _exit(3);
      memset(p, (int)n, n);
    }
    shardd__arena_rewind(&a, m);
  }
  shardd__arena_free(&a);
}

Test(arena, every_byte_of_a_live_piece_is_usable_under_asan) {
  char report[8192];
  cr_expect_not(asan_reports(in_bounds_use, NULL, "AddressSanitizer", report,
                             sizeof report),
                "a write inside live pieces was reported: %s", report);
  in_bounds_use(NULL); /* and in this process: the poisoning is exact */
}
#endif /* SHARDD__ASAN */
