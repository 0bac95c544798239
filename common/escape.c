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
