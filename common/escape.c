/* escape.c — names escaped for a line of text (see escape.h). */
#include "escape.h"

#include <string.h>

const char *shardd__escape(const char *in, char *out, size_t outlen) {
  static const char hex[] = "0123456789abcdef";
  size_t n = 0;
  size_t keep = 0; /* where "..." goes on a cut: the end of the last whole
                      character that leaves it room */
  if (outlen == 0)
    return out;
  for (const unsigned char *p = (const unsigned char *)(in ? in : ""); *p; p++) {
    char e[8] = {(char)*p};
    size_t k = 1;
    if (*p < 0x20 || *p == 0x7f) {
      e[0] = '\\';
      e[1] = 'x';
      e[2] = hex[*p >> 4];
      e[3] = hex[*p & 15];
      k = 4;
    } else if (*p == 0xc2 && p[1] >= 0x80 && p[1] <= 0x9f) {
      /* a C1 control (U+0080..U+009F) in UTF-8: terminals that read UTF-8
       * act on it as on its 8-bit form (U+009B is CSI, an escape
       * sequence's start): both bytes as \xNN */
      for (int i = 0; i < 2; i++) {
        e[4 * i] = '\\';
        e[4 * i + 1] = 'x';
        e[4 * i + 2] = hex[p[i] >> 4];
        e[4 * i + 3] = hex[p[i] & 15];
      }
      k = 8;
    } else if (*p == '\\') {
      e[1] = '\\';
      k = 2;
    }
    if (n + k + 1 > outlen) {
      if (outlen < 4)
        out[0] = '\0';
      else
        memcpy(out + keep, "...", 4);
      return out;
    }
    memcpy(out + n, e, k);
    n += k;
    p += k == 8; /* the C1 control's second byte */
    if (n + 4 <= outlen)
      keep = n;
  }
  out[n] = '\0';
  return out;
}

/* Whether b starts a UTF-8 character of more than one byte: its length
 * in *k and the range its second byte must be in (the first byte alone
 * does not rule out an overlong form, a surrogate or past U+10FFFF). */
static int utf8_lead(unsigned b, size_t *k, unsigned *lo, unsigned *hi) {
  *lo = 0x80;
  *hi = 0xbf;
  if (b >= 0xc2 && b <= 0xdf) {
    *k = 2;
  } else if (b >= 0xe0 && b <= 0xef) {
    *k = 3;
    if (b == 0xe0)
      *lo = 0xa0; /* below: overlong */
    else if (b == 0xed)
      *hi = 0x9f; /* above: a surrogate */
  } else if (b >= 0xf0 && b <= 0xf4) {
    *k = 4;
    if (b == 0xf0)
      *lo = 0x90; /* below: overlong */
    else if (b == 0xf4)
      *hi = 0x8f; /* above: past U+10FFFF */
  } else {
    return 0; /* a continuation byte, c0, c1 (overlong) or f5..ff */
  }
  return 1;
}

/* How many bytes from p on form the start of a character (its first i),
 * up to k: a NUL is out of every range, so nothing past it is read. */
static size_t utf8_prefix(const unsigned char *p, size_t k, unsigned lo, unsigned hi) {
  if (p[1] < lo || p[1] > hi)
    return 1;
  size_t i = 2;
  while (i < k && p[i] >= 0x80 && p[i] <= 0xbf)
    i++;
  return i;
}

size_t shardd__utf8_len(const char *s) {
  const unsigned char *p = (const unsigned char *)s;
  size_t k;
  unsigned lo, hi;
  if (p[0] < 0x80)
    return 1;
  if (!utf8_lead(p[0], &k, &lo, &hi))
    return 0;
  return utf8_prefix(p, k, lo, hi) == k ? k : 0;
}

size_t shardd__utf8_bad_len(const char *s) {
  const unsigned char *p = (const unsigned char *)s;
  size_t k;
  unsigned lo, hi;
  if (p[0] < 0x80 || !utf8_lead(p[0], &k, &lo, &hi))
    return 1;
  return utf8_prefix(p, k, lo, hi);
}
