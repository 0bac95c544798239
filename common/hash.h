/* hash.h — the one string and byte hash: 64-bit FNV-1a, for the daemon's
 * maps and for every name or digest nodes compare (the exchange key and the
 * step digest in an exchange's header, a collective checkpoint directory's
 * fingerprint, the rendezvous files' names). Those travel between nodes or
 * name files, so their bytes must not change: the basis and prime are
 * FNV-1a's own and a hash continues from the value it is given, so a caller
 * folds several fields in order. Header-only: map lookups inline it, and
 * fabric_gloo.cc includes it from C++. */
#ifndef SHARDD_HASH_H
#define SHARDD_HASH_H

#include <stddef.h>
#include <stdint.h>

#define SHARDD__FNV1A_BASIS 0xcbf29ce484222325ull
#define SHARDD__FNV1A_PRIME 0x100000001b3ull

/* h continued over n bytes at p (start from SHARDD__FNV1A_BASIS). */
static inline uint64_t shardd__fnv1a(uint64_t h, const void *p, size_t n) {
  const unsigned char *s = (const unsigned char *)p;
  for (size_t i = 0; i < n; i++)
    h = (h ^ s[i]) * SHARDD__FNV1A_PRIME;
  return h;
}

/* h continued over v's 8 bytes, least significant first (as
 * shardd__fnv1a over its little-endian bytes, whatever the host's order). */
static inline uint64_t shardd__fnv1a_u64(uint64_t h, uint64_t v) {
  for (int b = 0; b < 8; b++)
    h = (h ^ (unsigned char)(v >> (8 * b))) * SHARDD__FNV1A_PRIME;
  return h;
}

/* h continued over the bytes of s up to its NUL (not included). */
static inline uint64_t shardd__fnv1a_str(uint64_t h, const char *s) {
  for (; *s; s++)
    h = (h ^ (unsigned char)*s) * SHARDD__FNV1A_PRIME;
  return h;
}

#endif /* SHARDD_HASH_H */
