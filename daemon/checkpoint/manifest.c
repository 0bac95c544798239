/* manifest.c — a checkpoint manifest's text (see manifest.h). */
#include "manifest.h"

#include <errno.h>
#include <inttypes.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "checkpoint.h"

void shardd__manifest_enc_name(shardd__sb *sb, const char *s) {
  for (const unsigned char *p = (const unsigned char *)s; *p; p++) {
    if (*p <= 0x20 || *p >= 0x7f || *p == '%')
      shardd__sb_printf(sb, "%%%02x", *p);
    else
      shardd__sb_printf(sb, "%c", *p);
  }
}

/* Decodes in place; returns 0 on a malformed escape. */
int shardd__manifest_dec_name(char *s) {
  char *w = s;
  for (char *r = s; *r; r++) {
    if (*r == '%') {
      unsigned v;
      if (!r[1] || !r[2] || sscanf(r + 1, "%2x", &v) != 1 || v == 0)
        return 0;
      *w++ = (char)v;
      r += 2;
    } else {
      *w++ = *r;
    }
  }
  *w = '\0';
  return 1;
}

int shardd__manifest_hexval(char c) {
  if (c >= '0' && c <= '9')
    return c - '0';
  if (c >= 'a' && c <= 'f')
    return c - 'a' + 10;
  return -1;
}

/* Reads the next line of f, without its newline, into *buf (grown, to at
 * most max + 1 bytes). A NUL byte is refused: the tokenizer would silently
 * end the line there. */
shardd__line_rc shardd__manifest_read_line(FILE *f, char **buf, size_t *cap,
                                           size_t max) {
  if (*cap == 0) {
    if ((*buf = malloc(256)) == NULL)
      return SHARDD__LINE_NOMEM;
    *cap = 256;
  }
  size_t n = 0;
  int c;
  while ((c = getc_unlocked(f)) != EOF && c != '\n') {
    if (n == max)
      return SHARDD__LINE_LONG;
    if (c == '\0')
      return SHARDD__LINE_NUL;
    if (n + 1 >= *cap) {
      size_t ncap = *cap * 2 < max + 1 ? *cap * 2 : max + 1;
      char *nb = realloc(*buf, ncap);
      if (nb == NULL)
        return SHARDD__LINE_NOMEM;
      *buf = nb;
      *cap = ncap;
    }
    (*buf)[n++] = (char)c;
  }
  if (c == EOF && ferror(f))
    return SHARDD__LINE_IO;
  if (c == EOF && n == 0)
    return SHARDD__LINE_EOF;
  (*buf)[n] = '\0';
  return SHARDD__LINE_OK;
}

/* Checks the checksum on the "end" line of a sealed manifest (version 3
 * on, or a job manifest) against the bytes before it, before any line is
 * acted upon; rewinds f. An unsealed one (older, or without the line) is
 * told by *end_line 0: the parser refuses it, naming why. Lines too long or
 * with a NUL byte are left to the parser, which names them. */
shardd_err shardd__manifest_verify_seal(FILE *f, const char *path,
                                        uint32_t *seal, int *end_line,
                                        char *err, size_t errlen) {
  *seal = 0;
  *end_line = 0;
  char *line = NULL;
  size_t cap = 0;
  uint32_t crc = 0;
  int lineno = 0, version = 0;
  shardd_err rc = SHARDD_OK;
  for (;;) {
    shardd__line_rc lr =
        shardd__manifest_read_line(f, &line, &cap, SHARDD__MANIFEST_LINE_MAX);
    if (lr != SHARDD__LINE_OK)
      break;
    lineno++;
    /* a job-level manifest (several nodes) is sealed from its version 1 */
    if (lineno == 1 && sscanf(line, SHARDD__MANIFEST_MAGIC " %d", &version) != 1) {
      if (sscanf(line, SHARDD__JOB_MANIFEST_MAGIC " %d", &version) != 1)
        break;
      version = 3;
    }
    if (version < 3)
      break;
    unsigned want;
    char extra;
    if (!strncmp(line, "end", 3) && (line[3] == ' ' || line[3] == '\0')) {
      if (sscanf(line, "end %8x%c", &want, &extra) != 1 || (uint32_t)want != crc) {
        snprintf(err, errlen, "%s line %d: checksum %s, the manifest's bytes "
                 "give %08" PRIx32 " (edited or corrupt)", path, lineno,
                 line[3] ? line + 4 : "missing", crc);
        rc = SHARDD_E_INVAL;
      } else {
        *seal = crc;
        *end_line = lineno;
      }
      break;
    }
    crc = shardd__crc32c(crc, line, strlen(line));
    crc = shardd__crc32c(crc, "\n", 1);
  }
  /* no end line: the parser reports the truncation */
  free(line);
  rewind(f);
  return rc;
}

/* Splits line (NUL-ended) into its words, at most SHARDD__MANIFEST_MAX_TOK of them (words
 * past the SHARDD__MANIFEST_MAX_TOK-th are not looked at); the number of words. */
int shardd__manifest_split_words(char *line, char **tok) {
  int nt = 0;
  for (char *save, *t = strtok_r(line, " ", &save); t && nt < SHARDD__MANIFEST_MAX_TOK;
       t = strtok_r(NULL, " ", &save))
    tok[nt++] = t;
  return nt;
}

/* The manifest's text, read whole: each line ended by a NUL where its
 * newline was, and the seal checked as shardd__manifest_verify_seal does. */
shardd_err shardd__manifest_split_text(char *text, size_t n, const char *path,
                                       int *stop_line, shardd__line_rc *stop_rc,
                                       int *seal_line, char *err,
                                       size_t errlen) {
  uint32_t crc = 0;
  int version = 0, sealing = 1;
  for (size_t pos = 0, lineno = 1; pos < n; lineno++) {
    char *line = text + pos;
    char *nl = memchr(line, '\n', n - pos);
    size_t len = nl ? (size_t)(nl - line) : n - pos;
    size_t head = len < SHARDD__MANIFEST_LINE_MAX ? len : SHARDD__MANIFEST_LINE_MAX;
    if (memchr(line, '\0', head) || len > SHARDD__MANIFEST_LINE_MAX) {
      *stop_line = (int)lineno;
      *stop_rc = memchr(line, '\0', head) ? SHARDD__LINE_NUL
                                             : SHARDD__LINE_LONG;
      break;
    }
    line[len] = '\0';
    pos += len + 1;
    if (!sealing)
      continue;
    /* a job-level manifest (several nodes) is sealed from its version 1 */
    if (lineno == 1 && sscanf(line, SHARDD__MANIFEST_MAGIC " %d", &version) != 1) {
      if (sscanf(line, SHARDD__JOB_MANIFEST_MAGIC " %d", &version) != 1)
        version = 0;
      else
        version = 3;
    }
    if (version < 3) { /* unsealed: the header line refuses it */
      sealing = 0;
      continue;
    }
    if (!strncmp(line, "end", 3) && (line[3] == ' ' || line[3] == '\0')) {
      unsigned want_crc;
      char extra;
      if (sscanf(line, "end %8x%c", &want_crc, &extra) != 1 ||
          (uint32_t)want_crc != crc) {
        snprintf(err, errlen, "%s line %zu: checksum %s, the manifest's "
                 "bytes give %08" PRIx32 " (edited or corrupt)", path,
                 lineno, line[3] ? line + 4 : "missing", crc);
        return SHARDD_E_INVAL;
      }
      *seal_line = (int)lineno;
      sealing = 0;
      continue;
    }
    crc = shardd__crc32c(crc, line, len);
    crc = shardd__crc32c(crc, "\n", 1);
  }
  return SHARDD_OK;
}

/* A line the reader refused (too long, a NUL, no memory, a read error). */
shardd_err shardd__manifest_line_error(shardd__line_rc lr, const char *path,
                                       int lineno, char *err, size_t errlen) {
  if (lr == SHARDD__LINE_LONG)
    snprintf(err, errlen,
             "%s line %d: longer than %zu bytes (not a "
             "manifest shardd wrote); not reading further",
             path, lineno, SHARDD__MANIFEST_LINE_MAX);
  else if (lr == SHARDD__LINE_NUL)
    snprintf(err, errlen, "%s line %d: holds a NUL byte (not a manifest "
             "shardd wrote)", path, lineno);
  else if (lr == SHARDD__LINE_NOMEM)
    snprintf(err, errlen, "%s line %d: out of memory", path,
             lineno);
  else
    snprintf(err, errlen, "%s line %d: %s", path, lineno,
             strerror(errno));
  return lr == SHARDD__LINE_NOMEM ? SHARDD_E_NO_MEMORY
         : lr == SHARDD__LINE_IO  ? SHARDD_E_IO
                                  : SHARDD_E_INVAL;
}

shardd_err shardd__manifest_header(char **tok, int nt, int *version, char *why,
                                   size_t whylen) {
  if (nt != 2 || strcmp(tok[0], SHARDD__MANIFEST_MAGIC) ||
      (*version = atoi(tok[1])) < 1 || *version > SHARDD_MANIFEST_VERSION) {
    snprintf(why, whylen, "not a shardd checkpoint manifest of version %d to %d",
             SHARDD_MANIFEST_SEALED, SHARDD_MANIFEST_VERSION);
    return SHARDD_E_INVAL;
  }
  /* Versions 1 and 2 carry no checksum: an edited step count or view
   * offset in one cannot be told from what shardd wrote. */
  if (*version < SHARDD_MANIFEST_SEALED) {
    snprintf(why, whylen,
             "manifest version %d is not sealed (versions before %d carry "
             "no checksum, so an edit cannot be detected); restore refuses "
             "it: take a new checkpoint of the job with a shardd that "
             "writes version %d or later",
             *version, SHARDD_MANIFEST_SEALED, SHARDD_MANIFEST_SEALED);
    return SHARDD_E_INVAL;
  }
  return SHARDD_OK;
}
