/* decode_pool.h — what the tests of the requests decoded by hand share
 * (test_buckets.c, test_register.c): the pieces' allocator, a bump of
 * malloc'd blocks freed together, each block its own (ASan sees a read
 * past any piece), and a small random generator. */
#ifndef SHARDD_TEST_DECODE_POOL_H
#define SHARDD_TEST_DECODE_POOL_H

#include <criterion/criterion.h>
#include <stdint.h>
#include <stdlib.h>

typedef struct {
  void *blocks[16384];
  size_t n;
} pool;

static void *pool_alloc(void *ctx, size_t n) {
  pool *p = ctx;
  cr_assert_lt(p->n, 16384);
  return p->blocks[p->n++] = calloc(1, n ? n : 1);
}

static void pool_free(pool *p) {
  while (p->n)
    free(p->blocks[--p->n]);
}

static uint64_t rnd(uint64_t *s) {
  *s ^= *s << 13;
  *s ^= *s >> 7;
  *s ^= *s << 17;
  return *s;
}

#endif
