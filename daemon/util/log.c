/* log.c — log lines (see log.h). */
#include "log.h"

#include <stdarg.h>
#include <stdio.h>

#include "escape.h"

static int log_level = SHARDD__LOG_INFO;

void shardd__log_set_level(int level) { log_level = level; }

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
  shardd__escape(line, esc, sizeof esc);
  int k = level < 0 ? 0 : level > 3 ? 3 : level;
  fprintf(stderr, "<%d>shardd: %s: %s\n", prio[k], names[k], esc);
}
