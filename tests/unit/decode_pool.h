/* decode_pool.h — what the tests of the requests decoded by hand share
 * (test_buckets.c, test_register.c): the pieces' allocator, a bump of
 * malloc'd blocks freed together, each block its own (ASan sees a read
 * past any piece), a small random generator, and the comparison with
 * protobuf-c's decoding. */
#ifndef SHARDD_TEST_DECODE_POOL_H
#define SHARDD_TEST_DECODE_POOL_H

#include <criterion/criterion.h>
#include <stdint.h>
#include <stdlib.h>

#include "dispatch_int.h"

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

/* decode leaves the frame to protobuf-c (NULL), or reads what protobuf-c
 * reads (same(protobuf-c's, decode's) asserts it): 1 when decode read it */
static int decoded_as_protobuf_c(
    Shardwire__Request *(*decode)(shardd__decode_alloc, void *,
                                  const uint8_t *, size_t),
    void (*same)(const Shardwire__Request *, const Shardwire__Request *),
    const uint8_t *buf, size_t len) {
  pool p = {.n = 0};
  Shardwire__Request *fast = decode(pool_alloc, &p, buf, len);
  Shardwire__Request *slow = shardwire__request__unpack(NULL, len, buf);
  if (fast != NULL) {
    cr_assert_not_null(slow, "a frame protobuf-c refuses is left to it");
    same(slow, fast);
  }
  if (slow)
    shardwire__request__free_unpacked(slow, NULL);
  pool_free(&p);
  return fast != NULL;
}

#endif
