/* lowest.h — the lowest ranks of a set read in no order (a job's ranks
 * held, the ranks that arrived at a collective), ascending, in max slots
 * of the caller's: what status lists of a set without walking the world
 * for it. O(log max) a rank added. */
#ifndef SHARDD_LOWEST_H
#define SHARDD_LOWEST_H

#include <stddef.h>
#include <stdint.h>

typedef struct {
  uint32_t *v; /* the caller's max slots: a max-heap until finish */
  size_t n, max;
} shardd__lowest;

void shardd__lowest_init(shardd__lowest *l, uint32_t *slots, size_t max);
/* Keeps x if it is among the max lowest added so far. */
void shardd__lowest_add(shardd__lowest *l, uint32_t x);
/* Sorts the ranks kept ascending into the slots; returns how many there are
 * (the fewer of max and those added). Add nothing after. */
size_t shardd__lowest_finish(shardd__lowest *l);

#endif /* SHARDD_LOWEST_H */
