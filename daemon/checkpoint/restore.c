/* restore.c — restores a job from a checkpoint directory (see
 * checkpoint.h), in four phases: read, on any thread, opens the directory,
 * reads the manifest whole (bounded by its size), checks its seal, splits
 * its lines and checks its job line against who asks, touching no
 * registry struct; apply, on the loop thread, replays the lines into a new
 * job (buffers, views, then each optimizer through the registration use
 * case) and lists every payload load; run, on any thread, loads and checks
 * the payloads, touching only the new job's region memory and the files;
 * finish, on the loop thread again, sets what the loads vouched for
 * (master_valid, step counts) and hands the job over. Any failure releases
 * the new job. The loads apply plans, and the optimizers registered again,
 * are restore_plan.c's; the manifest's lines are parsed by manifest.c and
 * replayed into the new job by restore_lines.c. */
#include "checkpoint.h"

#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "ckfile.h"
#include "manifest.h"
#include "restore_int.h"

/* Opens the checkpoint directory (no symlink on the way; for a client, one
 * it or the daemon owns) and the manifest in it. On failure nothing stays
 * open and err says why; the code follows errno as the callers expect. */
static shardd_err open_manifest(restore *c) {
  snprintf(c->path, sizeof c->path, "%s/%s", c->dir, SHARDD__MANIFEST_FILE);
  c->dd = (shardd__ckdir){-1, c->dir, c->as_uid};
  c->dd.fd = shardd__ck_open_dir(c->dir, c->err, c->errlen);
  if (c->dd.fd < 0)
    return errno == ELOOP || errno == ENOTDIR ? SHARDD_E_PERMISSION : SHARDD_E_IO;
  struct stat dst;
  if (c->as_uid > 0 &&
      (fstat(c->dd.fd, &dst) != 0 ||
       (dst.st_uid != (uid_t)c->as_uid && dst.st_uid != geteuid()))) {
    snprintf(c->err, c->errlen, "%s: the directory is neither yours nor the "
             "daemon's; restore from a directory you own", c->dir);
    close(c->dd.fd);
    return SHARDD_E_PERMISSION;
  }
  int mfd = shardd__ck_open_regular(&c->dd, SHARDD__MANIFEST_FILE, c->err,
                                    c->errlen);
  /* bounded before a byte is read: restore holds the text and what its
   * lines plan (manifest.h) */
  struct stat mst;
  if (mfd >= 0 && fstat(mfd, &mst) == 0 &&
      (uint64_t)mst.st_size > SHARDD__MANIFEST_MAX) {
    snprintf(c->err, c->errlen, "%s: %jd bytes, more than the %zu MiB a "
             "manifest may have (shardd writes none larger); refused unread",
             c->path, (intmax_t)mst.st_size, SHARDD__MANIFEST_MAX >> 20);
    close(mfd);
    close(c->dd.fd);
    return SHARDD_E_LIMIT;
  }
  c->f = mfd >= 0 ? fdopen(mfd, "r") : NULL;
  if (c->f == NULL) {
    int e = errno;
    if (mfd >= 0) {
      snprintf(c->err, c->errlen, "%s: %s", c->path, strerror(e));
      close(mfd);
    } else if (e == ENOENT) {
      snprintf(c->err, c->errlen,
               "%s: %s (an incomplete checkpoint has no manifest; a "
               "multi-node job's checkpoint not taken collectively -- "
               "--checkpoint-on-exit -- has only node parts, node-N, and no "
               "job manifest to vouch for them: only a daemon with the job's "
               "--job-spec restores its node's part, to rejoin the live job)",
               c->path, strerror(e));
    }
    close(c->dd.fd);
    return e == EPERM || e == ELOOP ? SHARDD_E_PERMISSION : SHARDD_E_IO;
  }
  return SHARDD_OK;
}

/* Reads the manifest whole into c->text (its size was bounded when it was
 * opened), ends each line with a NUL where its newline was, and checks the
 * seal (the CRC32C on its "end" line, of every byte before it) as
 * shardd__manifest_verify_seal does: a mismatch refuses the manifest
 * before any line is acted upon. A line the line reader would refuse (too
 * long, a NUL byte) stops the split: apply reports it when it gets there,
 * after the lines above it, as a reader line by line would. Touches no
 * registry struct (any thread). */
static shardd_err read_text(restore *c) {
  struct stat st;
  if (fstat(fileno(c->f), &st) != 0) {
    snprintf(c->err, c->errlen, "%s: %s", c->path, strerror(errno));
    return SHARDD_E_IO;
  }
  size_t want = (size_t)st.st_size; /* <= SHARDD__MANIFEST_MAX (open) */
  if ((c->text = malloc(want + 2)) == NULL) {
    snprintf(c->err, c->errlen, "%s: out of memory reading %zu bytes", c->path,
             want);
    return SHARDD_E_NO_MEMORY;
  }
  /* one byte more than its size: a file grown since is not read past */
  size_t n = fread(c->text, 1, want + 1, c->f);
  if (ferror(c->f) || n > want) {
    snprintf(c->err, c->errlen, "%s: %s", c->path,
             ferror(c->f) ? strerror(errno) : "changed while being read");
    return SHARDD_E_IO;
  }
  c->text[n] = '\0';
  c->text_len = n;
  return shardd__manifest_split_text(c->text, n, c->path, &c->stop_line,
                                     &c->stop_rc, &c->seal_line, c->err,
                                     c->errlen);
}

/* Calls fn on each line of the text with words, in order, up to the first
 * the reader refused (its error then); blank lines are skipped. fn's
 * first failure ends it. The words are split in place. */
static shardd_err each_line(restore *c,
                            shardd_err (*fn)(restore *c, char **tok, int nt)) {
  size_t pos = 0;
  for (c->lineno = 1; pos < c->text_len; c->lineno++) {
    if (c->lineno == c->stop_line)
      return shardd__restore_line_error(c, c->stop_rc);
    char *line = c->text + pos;
    pos += strlen(line) + 1;
    char *tok[SHARDD__MANIFEST_MAX_TOK];
    int nt = shardd__manifest_split_words(line, tok);
    if (nt == 0)
      continue;
    shardd_err rc = fn(c, tok, nt);
    if (rc != SHARDD_OK)
      return rc;
  }
  return SHARDD_OK; /* a refused line holds a byte: the loop met it */
}

/* Checks the header and the job line against who asks and what the caller
 * wants, from the text alone, before any registry struct is touched
 * (jobs.c tries each candidate part off the loop: another job's part is
 * SHARDD_E_NOT_FOUND). Whatever else is wrong there apply reports, as it
 * would have. Splits copies of the lines: apply splits the text itself. */
static shardd_err precheck(restore *c) {
  size_t pos = 0;
  shardd_err rc = SHARDD_OK;
  for (c->lineno = 1; pos < c->text_len && c->lineno != c->stop_line;
       c->lineno++) {
    const char *line = c->text + pos;
    size_t len = strlen(line);
    pos += len + 1;
    char *copy = malloc(len + 1), *tok[SHARDD__MANIFEST_MAX_TOK];
    if (copy == NULL) {
      snprintf(c->err, c->errlen, "out of memory");
      rc = SHARDD_E_NO_MEMORY;
      break;
    }
    memcpy(copy, line, len + 1);
    int nt = shardd__manifest_split_words(copy, tok);
    if (nt > 0 && c->lineno == 1) {
      rc = shardd__restore_line_header(c, tok, nt);
      free(copy);
      if (rc != SHARDD_OK)
        break;
      continue;
    }
    if (nt > 0) {
      shardd__mline ml;
      shardd__manifest_parse(tok, nt, 0, &ml);
      if (ml.kind == SHARDD__ML_JOB && ml.u.job.name_ok)
        rc = shardd__restore_job_check(c, &ml);
    }
    free(copy);
    if (nt > 0)
      break; /* only the first line after the header may be the job's */
  }
  c->lineno = 0;
  c->mversion = 0;
  return rc;
}

/* Replays the lines: the job, buffers and views are registered and each
 * shard's load planned as its line comes; optimizers are only collected. */
static shardd_err parse_manifest(restore *c) {
  return each_line(c, shardd__restore_apply_line);
}

/* What a whole manifest must have: an "end" line, a job line, and a shard
 * line for every rank of every buffer. */
static shardd_err check_complete(restore *c) {
  if (!c->ended) {
    snprintf(c->err, c->errlen, "%s: no \"end\" line (truncated manifest)",
             c->path);
    return SHARDD_E_INVAL;
  }
  if (c->job == NULL) {
    /* "shardd-checkpoint 2" + "end" restored nothing and returned OK: the
     * callers took the NULL job and the daemon died with every shard. */
    snprintf(c->err, c->errlen,
             "%s: no \"job\" line (not a checkpoint shardd wrote)", c->path);
    return SHARDD_E_INVAL;
  }
  if (c->nb > 0 && c->nshard_lines == 0) {
    snprintf(c->err, c->errlen, "%s: names %zu buffer%s but no shard of any "
             "(a corrupt or truncated manifest)", c->path, c->nb,
             c->nb == 1 ? "" : "s");
    return SHARDD_E_INVAL;
  }
  if (c->nodes > 1 && !c->node_seen) {
    snprintf(c->err, c->errlen, "%s: no \"node\" line (not a node's part "
             "of a multi-node checkpoint)", c->path);
    return SHARDD_E_INVAL;
  }
  if (c->exit_name && !c->lineage_seen) {
    snprintf(c->err, c->errlen, "%s: no \"lineage\" line (written by a "
             "shardd that could not rejoin a live job with it): restore a "
             "collective checkpoint on every node", c->path);
    return SHARDD_E_INVAL;
  }
  /* a node's part holds its own ranks' shards only */
  uint32_t lo = c->nodes > 1 ? c->job->local_first : 0,
           hi = c->nodes > 1 ? lo + c->job->local_ranks : c->old_world;
  for (size_t i = 0; i < c->nb; i++)
    for (uint32_t r = lo; r < hi; r++)
      if (!(c->seen[i][r / 8] & (1u << (r % 8)))) {
        snprintf(c->err, c->errlen, "%s: no shard of buffer \"%s\" rank %" PRIu32
                 " (a corrupt or truncated manifest)", c->path,
                 c->bufs[i]->hdr.name, r);
        return SHARDD_E_INVAL;
      }
  return SHARDD_OK;
}

/* Registers each collected optimizer, in manifest order, and plans the
 * loads of its state files. */
static shardd_err restore_optimizers(restore *c) {
  for (size_t i = 0; i < c->npo; i++) {
    shardd_err rc = shardd__restore_register_pending(c->reg, c->job, &c->po[i],
                                                     c->err, c->errlen);
    if (rc == SHARDD_OK)
      rc = shardd__restore_plan_states(c, &c->po[i]);
    if (rc != SHARDD_OK)
      return rc;
  }
  return SHARDD_OK;
}

void shardd__checkpoint_restore_free(shardd__ckrestore *c) {
  if (c == NULL)
    return;
  if (c->job) /* not handed over: the restore failed */
    shardd__job_release(c->reg, c->job);
  for (size_t i = 0; i < c->npo; i++) {
    free(c->po[i].name);
    free(c->po[i].spec);
    free(c->po[i].ids);
    free(c->po[i].mv);
    free(c->po[i].ref_steps);
    for (size_t k = 0; k < c->po[i].nstates; k++)
      free(c->po[i].states[k].file);
    free(c->po[i].states);
    shardd__map_free(&c->po[i].state_seen);
    shardd__map_free(&c->po[i].bufs_reffed);
  }
  free(c->po);
  shardd__map_free(&c->reffed);
  for (size_t i = 0; i < c->nloads; i++) {
    free(c->loads[i].file);
    free(c->loads[i].copies);
  }
  free(c->loads);
  for (size_t i = 0; i < c->nb; i++) {
    free(c->seen[i]);
    free(c->bnames[i]);
  }
  free(c->seen);
  free(c->bnames);
  free(c->bufs);
  for (size_t i = 0; i < c->nshadows; i++)
    free(c->shadows[i].host);
  free(c->shadows);
  free(c->text);
  if (c->f)
    fclose(c->f);
  if (c->dd.fd >= 0)
    close(c->dd.fd);
  free(c->dir);
  free(c);
}

static shardd_err read_restore(shardd__registry *reg, const char *dir,
                          int64_t as_uid, uint32_t world, uint32_t nodes,
                          uint32_t node_rank, uint64_t origin,
                          const char *exit_name, int64_t want_uid,
                          const char *spec_path, shardd__ckrestore **out,
                          char *err, size_t errlen) {
  *out = NULL;
  /* a request's path may be as long as its frame: messages and the
   * part names below are built in fixed buffers, and a cut one named
   * another directory */
  size_t longest = sizeof ((restore *)0)->path - sizeof "/" SHARDD__MANIFEST_FILE;
  if (strlen(dir) > longest) {
    snprintf(err, errlen, "%.256s...: path longer than %zu bytes", dir, longest);
    return SHARDD_E_INVAL;
  }
  restore *c = calloc(1, sizeof *c);
  if (c == NULL || (c->dir = strdup(dir)) == NULL) {
    free(c);
    snprintf(err, errlen, "out of memory");
    return SHARDD_E_NO_MEMORY;
  }
  c->reg = reg;
  c->as_uid = as_uid;
  c->world = world;
  c->nodes = nodes;
  c->node_rank = node_rank;
  c->origin = origin;
  c->exit_name = exit_name;
  c->exit_world = world;
  c->want_uid = want_uid;
  c->spec_path = spec_path;
  c->err = err;
  c->errlen = errlen;
  c->dd.fd = -1;
  shardd_err rc = open_manifest(c);
  if (rc != SHARDD_OK) {
    c->f = NULL; /* open_manifest closed what it opened */
    c->dd.fd = -1;
    shardd__checkpoint_restore_free(c);
    return rc;
  }
  if ((rc = read_text(c)) == SHARDD_OK)
    rc = precheck(c);
  c->err = NULL; /* the caller's, during each phase only */
  c->errlen = 0;
  if (rc != SHARDD_OK) {
    shardd__checkpoint_restore_free(c);
    return rc;
  }
  *out = c;
  return SHARDD_OK;
}

shardd_err shardd__checkpoint_restore_apply(shardd__ckrestore *c, char *err,
                                            size_t errlen) {
  c->err = err;
  c->errlen = errlen;
  shardd_err rc;
  if ((rc = parse_manifest(c)) == SHARDD_OK &&
      (rc = check_complete(c)) == SHARDD_OK)
    rc = restore_optimizers(c);
  c->err = NULL;
  c->errlen = 0;
  /* the manifest is applied: only the directory stays open, for run */
  free(c->text);
  c->text = NULL;
  if (c->f) /* none for a manifest given as text */
    fclose(c->f);
  c->f = NULL;
  return rc;
}

/* read, then apply: the loop-thread restore of before (tests, the fuzzer) */
static shardd_err prepare(shardd__ckrestore *c, shardd__ckrestore **out,
                          char *err, size_t errlen) {
  shardd_err rc = shardd__checkpoint_restore_apply(c, err, errlen);
  if (rc != SHARDD_OK) {
    shardd__checkpoint_restore_free(c);
    return rc;
  }
  *out = c;
  return SHARDD_OK;
}

shardd_err shardd__checkpoint_restore_read(shardd__registry *reg,
                                           const char *dir, int64_t as_uid,
                                           uint32_t world,
                                           shardd__ckrestore **out, char *err,
                                           size_t errlen) {
  return read_restore(reg, dir, as_uid, world, 0, 0, 0, NULL, -1, NULL, out,
                      err, errlen);
}

shardd_err shardd__checkpoint_restore_prepare(shardd__registry *reg,
                                              const char *dir, int64_t as_uid,
                                              uint32_t world,
                                              shardd__ckrestore **out,
                                              char *err, size_t errlen) {
  shardd__ckrestore *c;
  *out = NULL;
  shardd_err rc = shardd__checkpoint_restore_read(reg, dir, as_uid, world, &c,
                                                  err, errlen);
  return rc == SHARDD_OK ? prepare(c, out, err, errlen) : rc;
}

/* Opens dir/manifest as restore does (no symlink, the asker's or the
 * daemon's directory and file) and checks its seal into *seal. *f is the
 * caller's to fclose; so is *dirfd, the directory, where dirfd is not NULL
 * (else it is closed). */
static shardd_err open_sealed(const char *dir, int64_t as_uid, FILE **f,
                              int *dirfd, uint32_t *seal, int *end_line, char *err,
                              size_t errlen) {
  restore c = {0};
  c.dir = (char *)dir;
  c.as_uid = as_uid;
  c.err = err;
  c.errlen = errlen;
  shardd_err rc = open_manifest(&c);
  if (rc != SHARDD_OK)
    return rc;
  rc = shardd__manifest_verify_seal(c.f, c.path, seal, end_line, err, errlen);
  if (rc != SHARDD_OK || dirfd == NULL)
    close(c.dd.fd);
  if (rc != SHARDD_OK) {
    fclose(c.f);
    return rc;
  }
  if (dirfd)
    *dirfd = c.dd.fd;
  *f = c.f;
  return SHARDD_OK;
}

shardd_err shardd__checkpoint_read_job(const char *dir, int64_t as_uid,
                                       shardd__ckjob *out, char *err,
                                       size_t errlen) {
  memset(out, 0, sizeof *out);
  FILE *f;
  uint32_t seal;
  int dfd, end_line;
  shardd_err rc = open_sealed(dir, as_uid, &f, &dfd, &seal, &end_line, err, errlen);
  if (rc != SHARDD_OK)
    return rc;
  int lineno;
  int kind = shardd__manifest_read_job(f, end_line, out, &lineno);
  if (kind == 0) /* an ordinary checkpoint */
    goto done;
  if (kind < 0)
    goto malformed;
  if (as_uid > 0 && (uint32_t)as_uid != out->uid) {
    snprintf(err, errlen, "job \"%s\" in %s belongs to another user; only it "
             "or root may restore it", out->name, dir);
    rc = SHARDD_E_PERMISSION;
    goto done;
  }
  char path[4096];
  snprintf(path, sizeof path, "%s/%s", dir, SHARDD__MANIFEST_FILE);
  if ((rc = shardd__restore_vouched(dfd, fileno(f), out->uid, path, out->name, err, errlen)) !=
      SHARDD_OK)
    goto done;
  out->seal = seal;
  goto done;
malformed:
  snprintf(err, errlen, "%s/%s line %d: not a job manifest shardd wrote "
           "(malformed or incomplete)", dir, SHARDD__MANIFEST_FILE, lineno);
  rc = SHARDD_E_INVAL;
done:
  fclose(f);
  close(dfd);
  return rc;
}

shardd_err shardd__checkpoint_restore_read_part(
    shardd__registry *reg, const char *dir, int64_t as_uid,
    const shardd__ckjob *job, uint32_t node_rank, shardd__ckrestore **out,
    char *err, size_t errlen) {
  *out = NULL;
  char part[4096];
  if (node_rank >= job->nodes) {
    snprintf(err, errlen, "%s: a checkpoint of job \"%s\" over %" PRIu32
             " nodes has no part for node %" PRIu32, dir, job->name, job->nodes,
             node_rank);
    return SHARDD_E_MISMATCH;
  }
  /* Every node's part, not only this one: a part missing or replaced by a
   * later checkpoint's is found here, on every node, before any of them
   * loads anything, and named. */
  for (uint32_t n = 0; n < job->nodes; n++) {
    if ((size_t)snprintf(part, sizeof part, "%s/node-%" PRIu32, dir, n) >=
        sizeof part) {
      snprintf(err, errlen, "%.256s...: path too long", dir);
      return SHARDD_E_INVAL;
    }
    FILE *f;
    uint32_t seal;
    int end_line;
    char why[768];
    shardd_err rc = open_sealed(part, as_uid, &f, NULL, &seal, &end_line, why,
                                sizeof why);
    if (rc == SHARDD_OK)
      fclose(f);
    if (rc != SHARDD_OK) {
      snprintf(err, errlen, "job checkpoint %s: node %" PRIu32 "'s part is "
               "missing or unreadable: %s", dir, n, why);
      return rc == SHARDD_E_PERMISSION ? rc : SHARDD_E_MISMATCH;
    }
    if (seal != job->seals[n]) {
      snprintf(err, errlen, "job checkpoint %s: node %" PRIu32 "'s part %s is "
               "sealed %08" PRIx32 ", the job manifest says %08" PRIx32 " (a "
               "part of another checkpoint, or one rewritten since)",
               dir, n, part, seal, job->seals[n]);
      return SHARDD_E_MISMATCH;
    }
  }
  snprintf(part, sizeof part, "%s/node-%" PRIu32, dir, node_rank);
  /* origin: nonzero even where the CRC is 0, so "restored" stays apart
   * from "fresh" in the exchange header */
  return read_restore(reg, part, as_uid, 0, job->nodes, node_rank,
                      (uint64_t)job->seal | 1ull << 32, NULL, job->uid, NULL,
                      out, err, errlen);
}

shardd_err shardd__checkpoint_restore_read_exit_part(
    shardd__registry *reg, const char *dir, int64_t as_uid, const char *name,
    uint32_t world, uint32_t nodes, uint32_t node_rank, int64_t spec_uid,
    const char *spec_path, shardd__ckrestore **out, char *err, size_t errlen) {
  *out = NULL;
  char part[4096];
  if ((size_t)snprintf(part, sizeof part, "%s/node-%" PRIu32, dir, node_rank) >=
      sizeof part) {
    snprintf(err, errlen, "%s: path too long", dir);
    return SHARDD_E_INVAL;
  }
  /* world: the spec's, which the part must have (line_job); a restore into
   * it is no resharding */
  return read_restore(reg, part, as_uid, world, nodes, node_rank, 0, name,
                      spec_uid, spec_path, out, err, errlen);
}

shardd_err shardd__checkpoint_restore_read_text(shardd__registry *reg,
                                                const char *label,
                                                const char *text, size_t len,
                                                shardd__ckrestore **out,
                                                char *err, size_t errlen) {
  *out = NULL;
  if (len > SHARDD__MANIFEST_MAX) {
    snprintf(err, errlen, "%s: %zu bytes, more than the %zu MiB a manifest "
             "may have", label, len, SHARDD__MANIFEST_MAX >> 20);
    return SHARDD_E_LIMIT;
  }
  restore *c = calloc(1, sizeof *c);
  if (c == NULL || (c->dir = strdup(label)) == NULL ||
      (c->text = malloc(len + 2)) == NULL) {
    if (c)
      free(c->dir);
    free(c);
    snprintf(err, errlen, "out of memory");
    return SHARDD_E_NO_MEMORY;
  }
  c->reg = reg;
  c->as_uid = -1;
  c->want_uid = -1;
  c->dd = (shardd__ckdir){-1, c->dir, -1};
  /* the daemon's own record: no file whose owner could vouch for it */
  c->job_checked = 1;
  snprintf(c->path, sizeof c->path, "%s", label);
  memcpy(c->text, text, len);
  c->text[len] = '\0';
  c->text_len = len;
  shardd_err rc = shardd__manifest_split_text(c->text, len, c->path,
                                              &c->stop_line, &c->stop_rc,
                                              &c->seal_line, err, errlen);
  if (rc != SHARDD_OK) {
    shardd__checkpoint_restore_free(c);
    return rc;
  }
  *out = c;
  return SHARDD_OK;
}

shardd__job *shardd__checkpoint_restore_job(const shardd__ckrestore *c) {
  return c->job;
}

shardd_err shardd__checkpoint_restore_run(shardd__ckrestore *c, char *err,
                                          size_t errlen) {
  for (size_t i = 0; i < c->nloads; i++) {
    const ld *l = &c->loads[i];
    char *tmp = NULL, *dst = l->direct;
    if (dst == NULL && (dst = tmp = malloc(l->bytes ? l->bytes : 1)) == NULL) {
      snprintf(err, errlen, "out of memory");
      return SHARDD_E_NO_MEMORY;
    }
    shardd_err rc = shardd__ck_load_data(&c->dd, l->file, l->dtype, l->numel,
                                         l->offset, l->name, l->crc, dst,
                                         l->bytes, err, errlen);
    for (size_t k = 0; rc == SHARDD_OK && k < l->ncopies; k++)
      memcpy(l->copies[k].dst, tmp + l->copies[k].src, l->copies[k].n);
    free(tmp);
    if (rc != SHARDD_OK)
      return rc;
  }
  /* host -> device: the staged regions, whole (what no file filled is the
   * zeros the region started with) */
  shardd__backend *be = c->reg->backend;
  for (size_t i = 0; i < c->nshadows; i++) {
    shardd__region *r = c->shadows[i].r;
    shardd_err rc = be->ops->write(be, r, 0, c->shadows[i].host, r->bytes);
    if (rc != SHARDD_OK) {
      snprintf(err, errlen, "writing %zu restored bytes to device %d: %s",
               r->bytes, r->device, shardd_strerror(rc));
      return rc;
    }
  }
  return SHARDD_OK;
}

shardd__job *shardd__checkpoint_restore_finish(shardd__ckrestore *c) {
  for (size_t i = 0; i < c->npo; i++) {
    shardd__optim *o = c->po[i].created;
    for (size_t k = 0; k < o->nshards; k++)
      o->shards[k].master_valid = c->po[i].mv[k];
    o->steps = c->po[i].steps;
    for (size_t k = 0; k < o->nrefs; k++)
      o->ref_steps[k] = c->po[i].ref_steps ? c->po[i].ref_steps[k] : o->steps;
  }
  shardd__job *job = c->job; /* the caller's now; free must not release it */
  c->job = NULL;
  return job;
}

shardd_err shardd__checkpoint_restore(shardd__registry *reg, const char *dir,
                                      int64_t as_uid, uint32_t world,
                                      shardd__job **out, char *err,
                                      size_t errlen) {
  *out = NULL;
  shardd__ckrestore *c;
  shardd_err rc = shardd__checkpoint_restore_prepare(reg, dir, as_uid, world,
                                                     &c, err, errlen);
  if (rc != SHARDD_OK)
    return rc;
  if ((rc = shardd__checkpoint_restore_run(c, err, errlen)) == SHARDD_OK)
    *out = shardd__checkpoint_restore_finish(c);
  shardd__checkpoint_restore_free(c);
  return rc;
}

shardd_err shardd__checkpoint_seal(const char *dir, uint32_t *seal, char *err,
                                   size_t errlen) {
  FILE *f;
  int end_line;
  shardd_err rc = open_sealed(dir, -1, &f, NULL, seal, &end_line, err, errlen);
  if (rc == SHARDD_OK)
    fclose(f);
  return rc;
}
