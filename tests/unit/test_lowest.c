/* test_lowest.c — the lowest ranks of a set read in no order (util/lowest):
 * what status lists of the ranks held and the ranks that arrived. The
 * expected lists are the set's lowest, found here by marking each rank. */
#include <criterion/criterion.h>
#include <string.h>

#include "lowest.h"

/* Adds the n ranks of in, checks that the lowest max of them come out,
 * ascending. */
static void expect_lowest(const uint32_t *in, size_t n, size_t max) {
  uint32_t slots[64];
  cr_assert_leq(max, 64u);
  shardd__lowest l;
  shardd__lowest_init(&l, slots, max);
  static unsigned char seen[4096];
  memset(seen, 0, sizeof seen);
  for (size_t i = 0; i < n; i++) {
    shardd__lowest_add(&l, in[i]);
    seen[in[i]] = 1;
  }
  size_t got = shardd__lowest_finish(&l);
  size_t want = 0;
  for (uint32_t r = 0; r < sizeof seen && want < max; r++)
    if (seen[r]) {
      cr_assert_lt(want, got, "only %zu came out", got);
      cr_assert_eq(slots[want], r, "[%zu] = %u, wanted %u", want, slots[want], r);
      want++;
    }
  cr_assert_eq(got, want);
}

Test(lowest, fewer_than_max_all_ascending) {
  const uint32_t in[] = {40, 3, 17, 0, 9};
  expect_lowest(in, 5, 8);
  expect_lowest(in, 5, 5);
  expect_lowest(in, 0, 8);
}

Test(lowest, more_than_max_the_lowest) {
  uint32_t in[1000];
  for (uint32_t i = 0; i < 1000; i++)
    in[i] = (i * 37 + 11) % 4000; /* distinct, in no order */
  expect_lowest(in, 1000, 64);
  expect_lowest(in, 1000, 1);
  /* ascending and descending input, the heap's worst orders */
  for (uint32_t i = 0; i < 1000; i++)
    in[i] = i;
  expect_lowest(in, 1000, 64);
  for (uint32_t i = 0; i < 1000; i++)
    in[i] = 3999 - i;
  expect_lowest(in, 1000, 64);
}

Test(lowest, max_zero_keeps_nothing) {
  uint32_t slot = 77;
  shardd__lowest l;
  shardd__lowest_init(&l, &slot, 0);
  shardd__lowest_add(&l, 5);
  cr_assert_eq(shardd__lowest_finish(&l), 0u);
  cr_assert_eq(slot, 77u, "nothing written");
}
