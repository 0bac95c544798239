/* log.c — log lines (see log.h). */
#include "log.h"

#include <stdarg.h>
#include <stdio.h>

static int log_level = SHARDD__LOG_INFO;

void shardd__log_set_level(int level) { log_level = level; }

size_t shardd__log_escape(const char *in, char *out, size_t outlen) {
  static const char hex[] = "0123456789abcdef";
  size_t n = 0;
  if (outlen == 0)
    return 0;
  for (const unsigned char *p = (const unsigned char *)in; *p; p++) {
    int plain = *p >= 0x20 && *p != 0x7f && *p != '\\';
    size_t need = plain ? 1 : 4;
    if (n + need >= outlen)
      break; /* cut at a whole character, never inside an escape */
    if (plain) {
      out[n++] = (char)*p;
    } else {
      out[n++] = '\\';
      out[n++] = 'x';
      out[n++] = hex[*p >> 4];
      out[n++] = hex[*p & 15];
    }
  }
  out[n] = '\0';
  return n;
}

void shardd__log(int level, const char *fmt, ...) {
  static const char *names[] = {"error", "warn", "info", "debug"};
  static const int prio[] = {3, 4, 6, 7};
  if (level > log_level)
    return;
  char line[1024], esc[4 * sizeof line];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(line, sizeof line, fmt, ap);
  va_end(ap);
  /* The arguments hold what clients chose (job, buffer and view names,
   * paths, messages quoting them): escaped here, once for every caller, so
   * none can end the line and start one of its own. */
  shardd__log_escape(line, esc, sizeof esc);
  int k = level < 0 ? 0 : level > 3 ? 3 : level;
  fprintf(stderr, "<%d>shardd: %s: %s\n", prio[k], names[k], esc);
}
