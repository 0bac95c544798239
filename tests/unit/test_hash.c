/* test_hash.c — common/hash.h is FNV-1a 64 (the published vectors), and
 * the names nodes compare through it keep their values: an exchange's key
 * (shardd__coll_fab_key) pinned to what the hand-written hash gave before
 * the one helper replaced it, since a node of an older version computes it
 * that way. */
#include <criterion/criterion.h>
#include <string.h>

#include "coll_int.h"
#include "hash.h"

Test(hash, fnv1a_published_vectors) {
  cr_expect_eq(shardd__fnv1a_str(SHARDD__FNV1A_BASIS, ""),
               0xcbf29ce484222325ull);
  cr_expect_eq(shardd__fnv1a_str(SHARDD__FNV1A_BASIS, "a"),
               0xaf63dc4c8601ec8cull);
  cr_expect_eq(shardd__fnv1a_str(SHARDD__FNV1A_BASIS, "foobar"),
               0x85944171f73967e8ull);
  cr_expect_eq(shardd__fnv1a(SHARDD__FNV1A_BASIS, "foobar", 6),
               0x85944171f73967e8ull);
}

Test(hash, continues_from_the_value_given) {
  uint64_t h = shardd__fnv1a(SHARDD__FNV1A_BASIS, "foo", 3);
  cr_expect_eq(shardd__fnv1a_str(h, "bar"), 0x85944171f73967e8ull);
  cr_expect_eq(shardd__fnv1a(h, "", 0), h);
}

Test(hash, the_exchange_key_keeps_its_wire_value) {
  cr_expect_eq(shardd__coll_fab_key(SHARDD__COLL_GATHER, "w"),
               0x82f5107b4e8dca1ull);
  cr_expect_eq(shardd__coll_fab_key(SHARDD__COLL_STEP, "layer.0.weight"),
               0x326fc84c570a8c19ull);
  cr_expect_eq(shardd__coll_fab_key(SHARDD__COLL_SCATTER, NULL),
               0xaf63bf4c8601bb45ull);
}

Test(hash, a_words_fold_is_its_little_endian_bytes) {
  const unsigned char le[8] = {0x08, 0x07, 0x06, 0x05, 0x04, 0x03, 0x02, 0x01};
  uint64_t h = shardd__fnv1a(SHARDD__FNV1A_BASIS, "foo", 3);
  cr_expect_eq(shardd__fnv1a_u64(h, 0x0102030405060708ull),
               shardd__fnv1a(h, le, sizeof le));
}
