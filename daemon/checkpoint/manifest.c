/* manifest.c — a checkpoint manifest's text, written and parsed (see
 * manifest.h). */
#include "manifest.h"

#include <errno.h>
#include <inttypes.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ckfile.h"

void shardd__manifest_enc_name(shardd__sb *sb, const char *s) {
  /* encoded into a chunk and printed once per chunk: a printf per byte
   * made a job's description (rewritten at every step with the fd store)
   * cost a millisecond for 64 buffers */
  static const char hex[] = "0123456789abcdef";
  char out[256];
  size_t n = 0;
  for (const unsigned char *p = (const unsigned char *)s; *p; p++) {
    if (n > sizeof out - 4) {
      shardd__sb_printf(sb, "%.*s", (int)n, out);
      n = 0;
    }
    if (*p <= 0x20 || *p >= 0x7f || *p == '%') {
      out[n++] = '%';
      out[n++] = hex[*p >> 4];
      out[n++] = hex[*p & 15];
    } else {
      out[n++] = (char)*p;
    }
  }
  if (n)
    shardd__sb_printf(sb, "%.*s", (int)n, out);
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

/* ---- the lines, written ------------------------------------------------ */

void shardd__manifest_put_head(shardd__sb *sb, int version, const char *job,
                               uint32_t world, uint32_t owner) {
  shardd__sb_printf(sb, SHARDD__MANIFEST_MAGIC " %d\njob ", version);
  shardd__manifest_enc_name(sb, job);
  shardd__sb_printf(sb, " %" PRIu32 " %" PRIu32 "\n", world, owner);
}

void shardd__manifest_put_node(shardd__sb *sb, uint32_t node, uint32_t nodes) {
  shardd__sb_printf(sb, "node %" PRIu32 " %" PRIu32 "\n", node, nodes);
}

void shardd__manifest_put_lineage(shardd__sb *sb, uint64_t lineage,
                                  uint64_t origin) {
  shardd__sb_printf(sb, "lineage %016" PRIx64 " %016" PRIx64 "\n", lineage,
                    origin);
}

void shardd__manifest_put_transient(shardd__sb *sb) {
  shardd__sb_printf(sb, "areas transient\n");
}

void shardd__manifest_put_buffer(shardd__sb *sb, const char *name, int dtype,
                                 uint64_t numel, uint64_t generation) {
  shardd__sb_printf(sb, "buffer ");
  shardd__manifest_enc_name(sb, name);
  shardd__sb_printf(sb, " %d %" PRIu64 " %" PRIu64 "\n", dtype, numel,
                    generation);
}

/* The CRC's 8 digits, to be filled: their offset in sb. */
static size_t put_crc(shardd__sb *sb) {
  size_t at = sb->len;
  shardd__sb_printf(sb, "00000000");
  return at;
}

size_t shardd__manifest_put_shard(shardd__sb *sb, size_t buf, uint32_t rank,
                                  const char *file) {
  shardd__sb_printf(sb, "shard %zu %" PRIu32 " %s ", buf, rank, file);
  size_t at = put_crc(sb);
  shardd__sb_printf(sb, "\n");
  return at;
}

void shardd__manifest_put_view(shardd__sb *sb, size_t buf, const char *name,
                               uint64_t offset, uint64_t numel, int ndim,
                               const int64_t *shape, uint64_t generation,
                               int requires_grad) {
  shardd__sb_printf(sb, "view %zu ", buf);
  shardd__manifest_enc_name(sb, name);
  shardd__sb_printf(sb, " %" PRIu64 " %" PRIu64 " %d", offset, numel, ndim);
  for (int d = 0; d < ndim; d++)
    shardd__sb_printf(sb, " %" PRId64, shape[d]);
  shardd__sb_printf(sb, " %" PRIu64 " %d\n", generation, requires_grad);
}

void shardd__manifest_put_optimizer(shardd__sb *sb, size_t index,
                                    const char *name, uint64_t steps,
                                    const uint8_t *spec, size_t spec_len) {
  shardd__sb_printf(sb, "optimizer %zu ", index);
  shardd__manifest_enc_name(sb, name);
  shardd__sb_printf(sb, " %" PRIu64 " ", steps);
  /* in chunks: a printf per byte cost the fd store's per-step
   * description most of its time */
  for (size_t k = 0; k < spec_len;) {
    static const char hx[] = "0123456789abcdef";
    char chunk[512];
    size_t c = 0;
    for (; k < spec_len && c < sizeof chunk; k++) {
      chunk[c++] = hx[spec[k] >> 4];
      chunk[c++] = hx[spec[k] & 15];
    }
    shardd__sb_printf(sb, "%.*s", (int)c, chunk);
  }
  shardd__sb_printf(sb, "\n");
}

void shardd__manifest_put_ref(shardd__sb *sb, size_t opt, uint64_t old_id,
                              size_t buf, const char *view, uint64_t steps) {
  if (view) {
    shardd__sb_printf(sb, "ref %zu %" PRIu64 " view %zu ", opt, old_id, buf);
    shardd__manifest_enc_name(sb, view);
    shardd__sb_printf(sb, " %" PRIu64 "\n", steps);
  } else {
    shardd__sb_printf(sb, "ref %zu %" PRIu64 " buffer %zu %" PRIu64 "\n", opt,
                      old_id, buf, steps);
  }
}

size_t shardd__manifest_put_state(shardd__sb *sb, size_t opt, size_t buf,
                                  uint32_t rank, int master_valid,
                                  const char *file, size_t bytes, int nstate) {
  shardd__sb_printf(sb, "state %zu %zu %" PRIu32 " %d %s ", opt, buf, rank,
                    master_valid, file);
  size_t at = put_crc(sb);
  shardd__sb_printf(sb, " %zu %d\n", bytes, nstate);
  return at;
}

void shardd__manifest_put_end(shardd__sb *sb, uint32_t seal) {
  shardd__sb_printf(sb, "end %08" PRIx32 "\n", seal);
}

/* ---- the lines, parsed ------------------------------------------------- */

shardd__mline_kind shardd__manifest_kind(char **tok, int nt) {
  const char *w = tok[0];
  if (!strcmp(w, "end"))
    return SHARDD__ML_END;
  if (!strcmp(w, "job") && nt == 4)
    return SHARDD__ML_JOB;
  if (!strcmp(w, "node") && nt == 3)
    return SHARDD__ML_NODE;
  if (!strcmp(w, "lineage") && nt == 3)
    return SHARDD__ML_LINEAGE;
  if (!strcmp(w, "areas") && nt == 2 && !strcmp(tok[1], "transient"))
    return SHARDD__ML_TRANSIENT;
  if (!strcmp(w, "buffer") && nt == 5)
    return SHARDD__ML_BUFFER;
  if (!strcmp(w, "shard") && nt == 5)
    return SHARDD__ML_SHARD;
  if (!strcmp(w, "view") && nt >= 6)
    return SHARDD__ML_VIEW;
  if (!strcmp(w, "optimizer") && nt == 5)
    return SHARDD__ML_OPTIMIZER;
  if (!strcmp(w, "ref") && nt >= 5 && nt <= 7)
    return SHARDD__ML_REF;
  if (!strcmp(w, "state") && nt == 9)
    return SHARDD__ML_STATE;
  return SHARDD__ML_UNKNOWN;
}

void shardd__manifest_parse(char **tok, int nt, int version,
                            shardd__mline *ml) {
  memset(ml, 0, sizeof *ml);
  ml->kind = shardd__manifest_kind(tok, nt);
  switch (ml->kind) {
  case SHARDD__ML_JOB: /* "job NAME WORLD OWNER" */
    ml->u.job.name = tok[1];
    ml->u.job.name_ok = shardd__manifest_dec_name(tok[1]);
    ml->u.job.world_word = tok[2];
    ml->u.job.world = strtoul(tok[2], NULL, 10);
    ml->u.job.owner = (uint32_t)strtoul(tok[3], NULL, 10);
    break;
  case SHARDD__ML_NODE: /* "node N NODES" */
    ml->u.node.node = (uint32_t)strtoul(tok[1], NULL, 10);
    ml->u.node.nodes = (uint32_t)strtoul(tok[2], NULL, 10);
    break;
  case SHARDD__ML_LINEAGE: /* "lineage LINEAGE ORIGIN" */
    ml->u.lineage.lineage = strtoull(tok[1], NULL, 16);
    ml->u.lineage.origin = strtoull(tok[2], NULL, 16);
    break;
  case SHARDD__ML_BUFFER: /* "buffer NAME DTYPE NUMEL GEN" */
    ml->u.buffer.name = tok[1];
    ml->u.buffer.name_ok = shardd__manifest_dec_name(tok[1]);
    ml->u.buffer.dtype = atoi(tok[2]);
    ml->u.buffer.numel = strtoull(tok[3], NULL, 10);
    ml->u.buffer.generation = strtoull(tok[4], NULL, 10);
    break;
  case SHARDD__ML_SHARD: /* "shard BUF RANK FILE CRC" */
    ml->u.shard.buf = strtoul(tok[1], NULL, 10);
    ml->u.shard.rank = (uint32_t)strtoul(tok[2], NULL, 10);
    ml->u.shard.file = tok[3];
    ml->u.shard.file_ok = strchr(tok[3], '/') == NULL;
    ml->u.shard.crc = (uint32_t)strtoul(tok[4], NULL, 16);
    break;
  case SHARDD__ML_VIEW: { /* "view BUF NAME OFFSET NUMEL NDIM DIM... GEN RG" */
    int ndim = atoi(tok[5]);
    ml->u.view.buf = strtoul(tok[1], NULL, 10);
    ml->u.view.ok = ndim >= 0 && ndim <= SHARDD__MANIFEST_VIEW_DIMS &&
                    nt == 8 + ndim && shardd__manifest_dec_name(tok[2]);
    if (!ml->u.view.ok)
      break;
    ml->u.view.name = tok[2];
    ml->u.view.offset = strtoull(tok[3], NULL, 10);
    ml->u.view.numel = strtoull(tok[4], NULL, 10);
    ml->u.view.ndim = ndim;
    for (int d = 0; d < ndim; d++)
      ml->u.view.shape[d] = strtoll(tok[6 + d], NULL, 10);
    ml->u.view.generation = strtoull(tok[6 + ndim], NULL, 10);
    ml->u.view.requires_grad = atoi(tok[7 + ndim]) != 0;
    break;
  }
  case SHARDD__ML_OPTIMIZER: /* "optimizer INDEX NAME STEPS SPEC_HEX" */
    ml->u.optimizer.index = strtoul(tok[1], NULL, 10);
    ml->u.optimizer.name = tok[2];
    ml->u.optimizer.name_ok = shardd__manifest_dec_name(tok[2]);
    ml->u.optimizer.steps = strtoull(tok[3], NULL, 10);
    ml->u.optimizer.spec_hex = tok[4];
    break;
  case SHARDD__ML_REF: { /* "ref OPT OLD_ID buffer BUF [STEPS]" or
                            "ref OPT OLD_ID view BUF NAME [STEPS]" */
    int extra = version >= 4; /* the steps word */
    ml->u.ref.opt = strtoul(tok[1], NULL, 10);
    ml->u.ref.old_id = strtoull(tok[2], NULL, 10);
    ml->u.ref.buf = strtoul(tok[4], NULL, 10);
    ml->u.ref.is_view = !strcmp(tok[3], "view");
    if (ml->u.ref.is_view)
      ml->u.ref.ok = nt == 6 + extra && shardd__manifest_dec_name(tok[5]);
    else
      ml->u.ref.ok = !strcmp(tok[3], "buffer") && nt == 5 + extra;
    if (ml->u.ref.ok && ml->u.ref.is_view)
      ml->u.ref.view = tok[5];
    ml->u.ref.has_steps = extra;
    if (ml->u.ref.ok && extra)
      ml->u.ref.steps = strtoull(tok[nt - 1], NULL, 10);
    break;
  }
  case SHARDD__ML_STATE: /* "state OPT BUF RANK MASTER_VALID FILE CRC BYTES
                            NSTATE" */
    ml->u.state.opt = strtoul(tok[1], NULL, 10);
    ml->u.state.buf = strtoul(tok[2], NULL, 10);
    ml->u.state.rank_word = tok[3];
    ml->u.state.rank = strtoul(tok[3], NULL, 10);
    ml->u.state.master_valid = atoi(tok[4]) != 0;
    ml->u.state.file = tok[5];
    ml->u.state.file_ok = strchr(tok[5], '/') == NULL;
    ml->u.state.crc = (uint32_t)strtoul(tok[6], NULL, 16);
    ml->u.state.bytes_word = tok[7];
    errno = 0;
    ml->u.state.bytes = strtoull(tok[7], NULL, 10);
    ml->u.state.bytes_ok = errno == 0;
    ml->u.state.nstate = atoi(tok[8]);
    break;
  default:
    break;
  }
}

int shardd__manifest_unhex(const char *hex, uint8_t *out) {
  size_t hl = strlen(hex);
  if (hl % 2)
    return 0;
  for (size_t k = 0; k < hl / 2; k++) {
    int hi = shardd__manifest_hexval(hex[2 * k]),
        lo = shardd__manifest_hexval(hex[2 * k + 1]);
    if (hi < 0 || lo < 0)
      return 0;
    out[k] = (uint8_t)(hi << 4 | lo);
  }
  return 1;
}

/* ---- the job manifest -------------------------------------------------- */

uint32_t shardd__manifest_put_job(shardd__sb *sb, const char *name,
                                  uint32_t world, uint32_t owner,
                                  uint32_t nodes, const uint32_t *seals) {
  shardd__sb_printf(sb, "%s %d\njob ", SHARDD__JOB_MANIFEST_MAGIC,
                    SHARDD__JOB_MANIFEST_VERSION);
  shardd__manifest_enc_name(sb, name);
  shardd__sb_printf(sb, " %" PRIu32 " %" PRIu32 "\nnodes %" PRIu32 "\n",
                    world, owner, nodes);
  for (uint32_t n = 0; n < nodes; n++)
    shardd__sb_printf(sb, "part %" PRIu32 " node-%" PRIu32 " %08" PRIx32 "\n",
                      n, n, seals[n]);
  uint32_t crc = shardd__crc32c(0, sb->s, sb->len);
  shardd__manifest_put_end(sb, crc);
  return crc;
}

int shardd__manifest_read_job(FILE *f, int end_line, shardd__ckjob *out,
                              int *lineno) {
  char *line = NULL, *tok[8];
  size_t cap = 0;
  int ended = 0, version = 0, rc = -1;
  uint32_t parts = 0;
  *lineno = 0;
  while (!ended &&
         shardd__manifest_read_line(f, &line, &cap, 4096) == SHARDD__LINE_OK) {
    (*lineno)++;
    int nt = 0;
    for (char *save, *t = strtok_r(line, " ", &save); t && nt < 8;
         t = strtok_r(NULL, " ", &save))
      tok[nt++] = t;
    if (*lineno == 1) {
      if (nt != 2 || strcmp(tok[0], SHARDD__JOB_MANIFEST_MAGIC))
        break; /* an ordinary manifest: nodes stays 0 */
      version = atoi(tok[1]);
      if (version < 1 || version > SHARDD__JOB_MANIFEST_VERSION ||
          end_line == 0)
        goto done;
      continue;
    }
    if (nt == 4 && !strcmp(tok[0], "job") && out->name[0] == '\0' &&
        shardd__manifest_dec_name(tok[1]) && strlen(tok[1]) < sizeof out->name) {
      snprintf(out->name, sizeof out->name, "%s", tok[1]);
      out->world = (uint32_t)strtoul(tok[2], NULL, 10);
      out->uid = (uint32_t)strtoul(tok[3], NULL, 10);
    } else if (nt == 2 && !strcmp(tok[0], "nodes") && out->nodes == 0) {
      out->nodes = (uint32_t)strtoul(tok[1], NULL, 10);
      if (out->nodes < 2 || out->nodes > SHARDD__CKJOB_MAX_NODES)
        goto done;
    } else if (nt == 4 && !strcmp(tok[0], "part") && out->nodes > 0 &&
               (uint32_t)strtoul(tok[1], NULL, 10) == parts &&
               parts < out->nodes) {
      char want[32];
      snprintf(want, sizeof want, "node-%" PRIu32, parts);
      if (strcmp(tok[2], want))
        goto done;
      out->seals[parts++] = (uint32_t)strtoul(tok[3], NULL, 16);
    } else if (nt == 2 && !strcmp(tok[0], "end") && *lineno == end_line) {
      ended = 1;
    } else {
      goto done;
    }
  }
  if (version == 0) { /* an ordinary checkpoint */
    out->nodes = 0;
    rc = 0;
    goto done;
  }
  if (!ended || out->name[0] == '\0' || out->world == 0 || out->nodes == 0 ||
      parts != out->nodes || out->world % out->nodes)
    goto done;
  rc = 1;
done:
  free(line);
  return rc;
}
