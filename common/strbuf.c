/* strbuf.c — growable strings. */
#include "strbuf.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "escape.h"

void shardd__sb_init(shardd__sb *sb) { memset(sb, 0, sizeof *sb); }

static int sb_reserve(shardd__sb *sb, size_t extra) {
  if (sb->failed)
    return 0;
  if (sb->len + extra + 1 <= sb->cap)
    return 1;
  size_t cap = sb->cap ? sb->cap : 128;
  while (cap < sb->len + extra + 1)
    cap *= 2;
  char *p = realloc(sb->s, cap);
  if (p == NULL) {
    sb->failed = 1;
    return 0;
  }
  sb->s = p;
  sb->cap = cap;
  return 1;
}

void shardd__sb_printf(shardd__sb *sb, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  int n = vsnprintf(NULL, 0, fmt, ap);
  va_end(ap);
  if (n < 0 || !sb_reserve(sb, (size_t)n))
    return;
  va_start(ap, fmt);
  vsnprintf(sb->s + sb->len, (size_t)n + 1, fmt, ap);
  va_end(ap);
  sb->len += (size_t)n;
}

void shardd__sb_json_str(shardd__sb *sb, const char *s) {
  for (const unsigned char *p = (const unsigned char *)(s ? s : ""); *p; p++) {
    switch (*p) {
    case '"':
      shardd__sb_printf(sb, "\\\"");
      break;
    case '\\':
      shardd__sb_printf(sb, "\\\\");
      break;
    case '\n':
      shardd__sb_printf(sb, "\\n");
      break;
    case '\t':
      shardd__sb_printf(sb, "\\t");
      break;
    case '\r':
      shardd__sb_printf(sb, "\\r");
      break;
    default:
      if (*p < 0x20) {
        shardd__sb_printf(sb, "\\u%04x", *p);
      } else if (*p < 0x80) {
        shardd__sb_printf(sb, "%c", *p);
      } else {
        /* Names are any bytes but NUL, and JSON text must be UTF-8: a
         * strict reader (Python's json.loads of the bytes) refused the
         * whole status for one such name. What starts no character is
         * U+FFFD, as a UTF-8 decoder's "replace" does: a character cut
         * short one, any other byte one each. */
        size_t k = shardd__utf8_len((const char *)p);
        if (k == 0) {
          shardd__sb_printf(sb, "\\ufffd");
          k = shardd__utf8_bad_len((const char *)p);
        } else {
          shardd__sb_printf(sb, "%.*s", (int)k, (const char *)p);
        }
        p += k - 1;
      }
    }
  }
}

char *shardd__sb_take(shardd__sb *sb) {
  if (sb->failed || !sb_reserve(sb, 0)) {
    shardd__sb_free(sb);
    return NULL;
  }
  sb->s[sb->len] = '\0';
  char *s = sb->s;
  memset(sb, 0, sizeof *sb);
  return s;
}

void shardd__sb_free(shardd__sb *sb) {
  free(sb->s);
  memset(sb, 0, sizeof *sb);
}
