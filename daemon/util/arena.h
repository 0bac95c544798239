/* arena.h — memory handed out by bumping a pointer and taken back all at
 * once to a mark: what a request's decoded message is made of for the one
 * dispatch that reads it (protobuf-c allocates a bucket's 64 entries one
 * piece at a time; malloc and free of each were a third of its cost).
 *
 * Lifetime: what alloc returns lives until the arena is rewound to a mark
 * taken before it, then is reused by the next allocation; nothing may keep
 * a pointer into it past that (copy what outlives the request). Marks nest
 * (a dispatch inside another rewinds to its own), and must be rewound in
 * the reverse order of taking them. Under AddressSanitizer the same code
 * runs with what no live piece holds poisoned (common/poison.h), so an
 * access past a piece or after its rewind is reported. */
#ifndef SHARDD_ARENA_H
#define SHARDD_ARENA_H

#include <stddef.h>

/* A chunk for what did not fit the block: malloc'ed, pieces bumped out of
 * it, freed at rewind (the largest kept as a spare). */
struct shardd__arena_big;

typedef struct {
  unsigned char *block; /* cap bytes, malloc'ed at the first alloc */
  size_t cap, used;
  struct shardd__arena_big *big; /* newest first; pieces come from it once
                                    there is one */
  struct shardd__arena_big *spare; /* freed chunk kept for reuse, or NULL */
} shardd__arena;

typedef struct {
  size_t used;
  struct shardd__arena_big *big;
  size_t big_used; /* what big had handed out */
} shardd__arena_mark;

/* An empty arena whose block will hold cap bytes (allocates nothing yet). */
void shardd__arena_init(shardd__arena *a, size_t cap);
/* n bytes aligned for any type, or NULL when out of memory. */
void *shardd__arena_alloc(shardd__arena *a, size_t n);
shardd__arena_mark shardd__arena_mark_now(const shardd__arena *a);
/* Takes back everything allocated since m was taken. */
void shardd__arena_rewind(shardd__arena *a, shardd__arena_mark m);
/* Frees the block and every allocation; a is empty (and usable) after. */
void shardd__arena_free(shardd__arena *a);

#endif /* SHARDD_ARENA_H */
