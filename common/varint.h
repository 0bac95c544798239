/* varint.h — protobuf's base-128 varint, for the two messages packed by
 * hand (a views batch request in the client, its reply in the daemon):
 * each sizes an entry once where protobuf-c's pack sizes it again at every
 * level above it. Bytes as protobuf-c writes them (tests compare). And the
 * wire reader of the requests the daemon decodes by hand (a bucket, a
 * views batch): it reads only the plain shapes, and says 0 for anything
 * else, which protobuf-c then decodes. Header-only: each side inlines it
 * in its loops. */
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

/* Bytes [p, end) of a message being read. */
typedef struct {
  const uint8_t *p, *end;
} shardd__wire;

/* A varint of at most max bytes; 0 when truncated or longer. */
static inline int shardd__wire_varint_n(shardd__wire *w, uint64_t *v, int max) {
  uint64_t r = 0;
  for (int s = 0; s < 7 * max && w->p < w->end; s += 7) {
    uint8_t b = *w->p++;
    r |= (uint64_t)(b & 0x7f) << s;
    if (!(b & 0x80)) {
      *v = r;
      return 1;
    }
  }
  return 0;
}

/* A field's value: 0 on a truncated or 10-byte varint (past 63 bits, left
 * to protobuf-c). */
static inline int shardd__wire_varint(shardd__wire *w, uint64_t *v) {
  return shardd__wire_varint_n(w, v, 9);
}

/* The next field's number and wire type, its value for a varint (wire
 * type 0), its bytes (sub, inside w) for a length-delimited one (2); 0 at
 * the end, when malformed, or for any other wire type. A key or a length
 * takes at most 5 bytes, a length at most INT_MAX, as protobuf-c reads
 * them (it refuses a longer one, however padded). */
static inline int shardd__wire_field(shardd__wire *w, uint32_t *field,
                                     uint32_t *wt, uint64_t *val,
                                     shardd__wire *sub) {
  uint64_t key, n;
  if (w->p >= w->end || !shardd__wire_varint_n(w, &key, 5) ||
      (key >> 3) == 0 || (key >> 3) > 0x1fffffff)
    return 0;
  *field = (uint32_t)(key >> 3);
  *wt = (uint32_t)(key & 7);
  if (*wt == 0)
    return shardd__wire_varint(w, val);
  if (*wt != 2 || !shardd__wire_varint_n(w, &n, 5) || n > 0x7fffffff ||
      n > (uint64_t)(w->end - w->p))
    return 0;
  sub->p = w->p;
  sub->end = w->p + n;
  w->p += n;
  return 1;
}

/* A message of exactly two fields, each once, in either order: varint
 * field 1 (*v: a Request's seq) and length-delimited field body (*sub: the
 * Request's one body); 0 for any other. */
static inline int shardd__wire_seq_body(const uint8_t *payload, size_t len,
                                        uint32_t body, uint64_t *v,
                                        shardd__wire *sub) {
  shardd__wire w = {payload, payload + len};
  uint64_t x = 0;
  uint32_t field, wt;
  int has_v = 0, has_body = 0;
  while (w.p < w.end) {
    if (!shardd__wire_field(&w, &field, &wt, &x, sub))
      return 0;
    if (field == 1 && wt == 0 && !has_v) {
      has_v = 1;
      *v = x;
    } else if (field == body && wt == 2 && !has_body) {
      has_body = 1; /* its bytes stay in sub: no later field sets it */
    } else {
      return 0;
    }
  }
  return has_v && has_body;
}

#endif
