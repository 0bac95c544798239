/* strbuf.h — (shared by daemon and libshardd) a growable NUL-terminated string for messages and reports.
 * The buffer owns its bytes; shardd__sb_take hands them to the caller. An
 * allocation failure is sticky and makes take return NULL. */
#ifndef SHARDD_STRBUF_H
#define SHARDD_STRBUF_H

#include <stddef.h>

typedef struct {
  char *s;
  size_t len, cap;
  int failed;
} shardd__sb;

void shardd__sb_init(shardd__sb *sb);
void shardd__sb_printf(shardd__sb *sb, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
/* Appends s as the inside of a JSON string (quotes not included). */
void shardd__sb_json_str(shardd__sb *sb, const char *s);
/* Caller frees the result with free(); NULL after a failed allocation. */
char *shardd__sb_take(shardd__sb *sb);
void shardd__sb_free(shardd__sb *sb);

#endif /* SHARDD_STRBUF_H */
