/* jobspec.c — --job-spec files (see jobspec.h). */
#include "jobspec.h"

#include <ctype.h>
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static char *trim(char *s) {
  while (isspace((unsigned char)*s))
    s++;
  char *e = s + strlen(s);
  while (e > s && isspace((unsigned char)e[-1]))
    *--e = '\0';
  return s;
}

static int parse_u32(const char *v, uint32_t max, uint32_t *out) {
  char *end;
  errno = 0;
  unsigned long x = strtoul(v, &end, 10);
  if (errno || end == v || *end || x > max || v[0] == '-')
    return -1;
  *out = (uint32_t)x;
  return 0;
}

void shardd__jobspec_free(shardd__jobspec *s) {
  if (s == NULL)
    return;
  free(s->path);
  free(s->job);
  free(s->rendezvous);
  free(s->host);
  memset(s, 0, sizeof *s);
}

/* A spec is a few lines; anything near this is not one. */
#define SPEC_MAX_BYTES (1u << 20)
#define LINE_MAX_LEN 1022

shardd_err shardd__jobspec_load(const char *path, shardd__jobspec *out,
                                char *err, size_t errlen) {
  memset(out, 0, sizeof *out);
  out->uid = -1;
  FILE *f = fopen(path, "r");
  if (f == NULL) {
    snprintf(err, errlen, "%s: %s", path, strerror(errno));
    return SHARDD_E_IO;
  }
  char *text = malloc(SPEC_MAX_BYTES + 1);
  size_t len = text ? fread(text, 1, SPEC_MAX_BYTES + 1, f) : 0;
  int bad = text == NULL || ferror(f);
  int e = errno;
  fclose(f);
  shardd_err rc = SHARDD_E_INVAL;
  if (bad)
    snprintf(err, errlen, "%s: %s", path, text ? strerror(e) : "out of memory");
  else if (len > SPEC_MAX_BYTES)
    snprintf(err, errlen, "%s: longer than %u bytes (not a job spec)", path,
             SPEC_MAX_BYTES);
  else
    rc = shardd__jobspec_parse(path, text, len, out, err, errlen);
  free(text);
  return bad ? SHARDD_E_IO : rc;
}

shardd_err shardd__jobspec_parse(const char *path, const char *text,
                                 size_t len, shardd__jobspec *out, char *err,
                                 size_t errlen) {
  memset(out, 0, sizeof *out);
  out->uid = -1;
  uint32_t local = 0;
  int have_world = 0, have_nodes = 0, have_node = 0;
  char line[LINE_MAX_LEN + 2];
  int ln = 0;
#define BAD(...)                                                              \
  do {                                                                        \
    /* a check of the whole file (ln 0) names no line */                     \
    int k_ = ln ? snprintf(err, errlen, "%s:%d: ", path, ln)                  \
                : snprintf(err, errlen, "%s: ", path);                        \
    if (k_ > 0 && (size_t)k_ < errlen)                                        \
      snprintf(err + k_, errlen - (size_t)k_, __VA_ARGS__);                   \
    goto fail;                                                                \
  } while (0)
  for (size_t at = 0; at < len;) {
    ln++;
    const char *nl = memchr(text + at, '\n', len - at);
    size_t n = (nl ? (size_t)(nl - text) : len) - at;
    if (n > LINE_MAX_LEN)
      BAD("line longer than %d characters", LINE_MAX_LEN);
    if (memchr(text + at, '\0', n))
      BAD("holds a NUL byte (not a job spec)");
    memcpy(line, text + at, n);
    line[n] = '\0';
    at += n + (nl != NULL);
    char *hash = strchr(line, '#');
    if (hash)
      *hash = '\0';
    char *s = trim(line);
    if (*s == '\0')
      continue;
    char *eq = strchr(s, '=');
    if (eq == NULL)
      BAD("expected key = value, got \"%s\"", s);
    *eq = '\0';
    char *k = trim(s), *v = trim(eq + 1);
    if (*v == '\0')
      BAD("%s has no value", k);
    char **str = NULL;
    if (!strcmp(k, "job"))
      str = &out->job;
    else if (!strcmp(k, "rendezvous"))
      str = &out->rendezvous;
    else if (!strcmp(k, "host"))
      str = &out->host;
    if (str) {
      free(*str);
      if ((*str = strdup(v)) == NULL)
        BAD("out of memory");
      continue;
    }
    uint32_t x;
    if (!strcmp(k, "uid")) {
      if (parse_u32(v, UINT32_MAX, &x) != 0)
        BAD("uid = %s: not a uid", v);
      out->uid = x;
      continue;
    }
    if (parse_u32(v, 65536, &x) != 0)
      BAD("%s = %s: not a number in [0, 65536]", k, v);
    if (!strcmp(k, "world"))
      out->world = x, have_world = 1;
    else if (!strcmp(k, "nodes"))
      out->nodes = x, have_nodes = 1;
    else if (!strcmp(k, "node_rank"))
      out->node_rank = x, have_node = 1;
    else if (!strcmp(k, "local_ranks"))
      local = x;
    else
      BAD("unknown key \"%s\" (job, world, nodes, node_rank, local_ranks, "
          "rendezvous, host, uid)", k);
  }
  ln = 0;
  if (out->job == NULL)
    BAD("no job = NAME");
  if (strchr(out->job, '/') != NULL) /* as a Hello would be (registry.h) */
    BAD("job = %s: a job name may not hold a '/' (an admin names uid N's "
        "job NAME as \"N/NAME\")", out->job);
  if (!have_world || !have_nodes || !have_node)
    BAD("world, nodes and node_rank are all required");
  if (out->nodes < 1 || out->world < out->nodes || out->world % out->nodes)
    BAD("world %" PRIu32 " does not split evenly over %" PRIu32 " nodes",
        out->world, out->nodes);
  if (out->node_rank >= out->nodes)
    BAD("node_rank %" PRIu32 " is not below nodes %" PRIu32, out->node_rank,
        out->nodes);
  if (local && local != out->world / out->nodes)
    BAD("local_ranks %" PRIu32 " != world / nodes = %" PRIu32, local,
        out->world / out->nodes);
  if (out->nodes > 1 && out->rendezvous == NULL)
    BAD("a job over %" PRIu32 " nodes needs rendezvous = DIR", out->nodes);
  if (out->host == NULL && (out->host = strdup("127.0.0.1")) == NULL)
    BAD("out of memory");
  if ((out->path = strdup(path)) == NULL)
    BAD("out of memory");
#undef BAD
  return SHARDD_OK;
fail:
  shardd__jobspec_free(out);
  return SHARDD_E_INVAL;
}

const shardd__jobspec *shardd__jobspec_find(const shardd__jobspec *specs,
                                            size_t n, uint32_t uid,
                                            const char *job) {
  const shardd__jobspec *any = NULL;
  for (size_t i = 0; job && i < n; i++) {
    if (strcmp(specs[i].job, job) != 0)
      continue;
    if (specs[i].uid == (int64_t)uid)
      return &specs[i];
    if (specs[i].uid < 0 && any == NULL)
      any = &specs[i];
  }
  return any;
}

int shardd__jobspec_overlap(const shardd__jobspec *a, const shardd__jobspec *b) {
  return strcmp(a->job, b->job) == 0 &&
         (a->uid < 0 || b->uid < 0 || a->uid == b->uid);
}
