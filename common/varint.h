/* varint.h — protobuf's base-128 varint, for the two messages packed by
 * hand (a views batch request in the client, its reply in the daemon):
 * each sizes an entry once where protobuf-c's pack sizes it again at every
 * level above it. Bytes as protobuf-c writes them (tests compare). Header-
 * only: both sides inline it in their packing loops. */
#ifndef SHARDD_VARINT_H
#define SHARDD_VARINT_H

#include <stddef.h>
#include <stdint.h>

/* Bytes v takes as a varint (1 to 10). */
static inline size_t shardd__varint_len(uint64_t v) {
  size_t n = 1;
  while (v >= 0x80) {
    v >>= 7;
    n++;
  }
  return n;
}

/* v written at p as a varint -> the byte after it. */
static inline uint8_t *shardd__varint_put(uint8_t *p, uint64_t v) {
  while (v >= 0x80) {
    *p++ = (uint8_t)(v | 0x80);
    v >>= 7;
  }
  *p++ = (uint8_t)v;
  return p;
}

#endif
