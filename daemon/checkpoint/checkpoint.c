/* checkpoint.c — writes a job to a checkpoint directory (see
 * checkpoint.h): the data files of this checkpoint's generation, then the
 * sealed manifest, then the previous generation's files removed. The file
 * layer is ckfile.c, the manifest's text manifest.c, restore restore.c. */
#include "checkpoint.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "ckfile.h"
#include "manifest.h"
#include "strbuf.h"

/* ---- write ------------------------------------------------------------ */

static size_t buffer_index(shardd__buffer **bufs, size_t n,
                           const shardd__buffer *b) {
  for (size_t i = 0; i < n; i++)
    if (bufs[i] == b)
      return i;
  return n;
}

/* Skips "<letter><digits>" at *p; 0 when it is not there. */
static int skip_num(const char **p, char letter) {
  if (**p != letter || !((*p)[1] >= '0' && (*p)[1] <= '9'))
    return 0;
  for (++*p; **p >= '0' && **p <= '9'; ++*p)
    ;
  return 1;
}

/* Whether fname is a data file some checkpoint wrote, of any generation:
 * b<i>-r<r>[-TAG].shard or o<i>-b<j>-r<r>[-TAG].state. Only these are
 * removed from a client's directory: its own files stay whatever they are
 * called. */
static int is_data_name(const char *fname) {
  const char *p = fname, *ext = ".shard";
  if (*p == 'o') {
    if (!skip_num(&p, 'o') || *p++ != '-')
      return 0;
    ext = ".state";
  }
  if (!skip_num(&p, 'b') || *p++ != '-' || !skip_num(&p, 'r'))
    return 0;
  if (*p == '-') { /* the tag: 8 hex digits */
    for (int k = 1; k <= 8; k++)
      if (shardd__manifest_hexval(p[k]) < 0)
        return 0;
    p += 9;
  }
  return strcmp(p, ext) == 0;
}

/* Whether fname is ".NAME.tmp" for a data file NAME (ckfile.c's
 * temporary name). */
static int is_data_temp(const char *fname) {
  size_t n = strlen(fname);
  char inner[256];
  if (fname[0] != '.' || n < 6 || n - 5 >= sizeof inner ||
      strcmp(fname + n - 4, ".tmp") != 0)
    return 0;
  memcpy(inner, fname + 1, n - 5);
  inner[n - 5] = '\0';
  return is_data_name(inner);
}

/* Removes the data files of d whose name holds (keep == 0) or does not hold
 * (keep == 1) "-TAG.": after a new manifest is in place, the previous
 * generation's files; after a failed write, the new generation's; either
 * way every stale temporary of a data file. */
static void remove_generation(const shardd__ckdir *d, const char *tag,
                              int keep) {
  int fd = dup(d->fd);
  DIR *dh = fd >= 0 ? fdopendir(fd) : NULL;
  if (dh == NULL) {
    if (fd >= 0)
      close(fd);
    return;
  }
  char needle[32];
  snprintf(needle, sizeof needle, "-%s.", tag);
  for (struct dirent *e; (e = readdir(dh)) != NULL;) {
    /* and the temporaries of a data file a killed write left (".NAME.tmp",
     * any generation: checkpoints into one directory are written one at
     * a time, and this one's are renamed or removed by now) */
    if (is_data_temp(e->d_name)) {
      unlinkat(d->fd, e->d_name, 0);
      continue;
    }
    if (!is_data_name(e->d_name) || (strstr(e->d_name, needle) != NULL) == keep)
      continue;
    struct stat st;
    if (fstatat(d->fd, e->d_name, &st, AT_SYMLINK_NOFOLLOW) == 0 &&
        (S_ISREG(st.st_mode) || S_ISLNK(st.st_mode)))
      unlinkat(d->fd, e->d_name, 0);
  }
  closedir(dh);
}

/* One data file of a checkpoint being written: what goes in it, and where
 * in the manifest text its CRC goes once it is known. */
typedef struct {
  char fname[128];
  uint32_t dtype;
  uint64_t numel, offset;
  const char *name;   /* the buffer's; borrowed, as data */
  const void *data;   /* the region's memory; borrowed */
  size_t bytes;
  size_t crc_at;      /* offset of its 8 hex digits in the manifest */
} ck_file;

struct shardd__ckwrite {
  char *dir; /* where the files go: DIR/node-N for a node's part */
  char *jobdir; /* a node's part: DIR (made first); NULL otherwise */
  uint32_t seal; /* the manifest's, once run wrote it */
  int64_t as_uid;
  char *home; /* the client's ROOT/UID it is confined to; NULL none */
  char tag[16];
  /* the manifest, whole but for the data files' CRCs (written as 8 zeros
   * at each crc_at) and the sealed "end" line */
  shardd__sb m;
  ck_file *files;
  size_t nfiles, cap;
  /* a backend whose memory the daemon cannot read directly (cuda): host
   * copies of the regions, read at prepare (the loop thread, so they are
   * the state between steps), written from by run; owned */
  void **copies;
  size_t ncopies;
};

void shardd__checkpoint_wfree(shardd__ckwrite *w) {
  if (w == NULL)
    return;
  free(w->dir);
  free(w->jobdir);
  free(w->home);
  shardd__sb_free(&w->m);
  free(w->files);
  for (size_t i = 0; i < w->ncopies; i++)
    free(w->copies[i]);
  free(w->copies);
  free(w);
}

/* Where the payload of region r starts in host memory: r itself where the
 * daemon maps it, else a host copy taken now (device -> host staging).
 * NULL when out of memory or the read failed (err says which). */
static const char *host_view(shardd__registry *reg, shardd__ckwrite *w,
                             shardd__region *r, char *err, size_t errlen) {
  shardd__backend *be = reg->backend;
  if (be->ops->read == NULL)
    return r->ptr;
  void **nc = realloc(w->copies, (w->ncopies + 1) * sizeof *nc);
  char *copy = nc ? malloc(r->bytes ? r->bytes : 1) : NULL;
  if (nc)
    w->copies = nc;
  if (copy == NULL) {
    snprintf(err, errlen, "out of memory staging %zu bytes of device memory",
             r->bytes);
    return NULL;
  }
  w->copies[w->ncopies++] = copy;
  shardd_err rc = be->ops->read(be, r, 0, copy, r->bytes);
  if (rc != SHARDD_OK) {
    snprintf(err, errlen, "reading %zu bytes of device %d: %s", r->bytes,
             r->device, shardd_strerror(rc));
    return NULL;
  }
  return copy;
}

const char *shardd__checkpoint_wdir(const shardd__ckwrite *w) {
  return w->jobdir ? w->jobdir : w->dir;
}

uint32_t shardd__checkpoint_wseal(const shardd__ckwrite *w) { return w->seal; }

/* Appends a data file; its manifest line is the text written so far up to
 * "... FNAME " and then the CRC, which the caller's next text follows. */
static shardd_err add_file(shardd__ckwrite *w, const char *fname,
                           uint32_t dtype, uint64_t numel, uint64_t offset,
                           const char *name, const void *data, size_t bytes) {
  if (w->nfiles == w->cap) {
    size_t ncap = w->cap ? w->cap * 2 : 16;
    ck_file *p = realloc(w->files, ncap * sizeof *p);
    if (p == NULL)
      return SHARDD_E_NO_MEMORY;
    w->files = p;
    w->cap = ncap;
  }
  ck_file *f = &w->files[w->nfiles++];
  snprintf(f->fname, sizeof f->fname, "%s", fname);
  f->dtype = dtype;
  f->numel = numel;
  f->offset = offset;
  f->name = name;
  f->data = data;
  f->bytes = bytes;
  f->crc_at = w->m.len;
  shardd__sb_printf(&w->m, "00000000");
  return SHARDD_OK;
}

shardd_err shardd__checkpoint_prepare(shardd__registry *reg, shardd__job *job,
                                      const char *dirpath, int64_t as_uid,
                                      const char *home, shardd__ckwrite **out,
                                      char *err, size_t errlen) {
  *out = NULL;
  /* A multi-node job: this node writes its ranks' part into DIR/node-N,
   * its manifest saying which node of how many it is; the job-level
   * manifest in DIR (shardd__checkpoint_write_job) vouches for every part
   * once all are written. */
  char part[4096];
  int multi = job->nodes > 1;
  if (multi && (size_t)snprintf(part, sizeof part, "%s/node-%" PRIu32, dirpath,
                                job->node_rank) >= sizeof part) {
    snprintf(err, errlen, "%s: path too long", dirpath);
    return SHARDD_E_INVAL;
  }
  shardd__ckwrite *w = calloc(1, sizeof *w);
  if (w == NULL || (w->dir = strdup(multi ? part : dirpath)) == NULL ||
      (multi && (w->jobdir = strdup(dirpath)) == NULL) ||
      (home && (w->home = strdup(home)) == NULL)) {
    if (w) {
      free(w->dir);
      free(w->jobdir);
    }
    free(w);
    snprintf(err, errlen, "out of memory");
    return SHARDD_E_NO_MEMORY;
  }
  w->as_uid = as_uid;
  shardd__sb_init(&w->m);
  /* Every data file of this checkpoint carries a tag of its own; the files
   * of the previous one stay until the new manifest has replaced its
   * manifest (one rename), so a write that fails (ENOSPC, kill -9) leaves
   * the last good checkpoint whole. */
  static unsigned counter; /* loop thread only, as prepare */
  struct timespec now;
  clock_gettime(CLOCK_REALTIME, &now);
  uint64_t seed[3] = {(uint64_t)now.tv_sec, (uint64_t)now.tv_nsec,
                      (uint64_t)getpid() << 32 | ++counter};
  snprintf(w->tag, sizeof w->tag, "%08" PRIx32,
           shardd__crc32c(0, seed, sizeof seed));
  const char *tag = w->tag;
  shardd__sb *m = &w->m;

  shardd__buffer **bufs = NULL;
  shardd__optim **opts = NULL;
  size_t nb = 0, no = 0;
  shardd_err rc = SHARDD_E_NO_MEMORY;
  if (shardd__job_buffers(job, &bufs, &nb) != SHARDD_OK ||
      shardd__job_optims(job, &opts, &no) != SHARDD_OK)
    goto nomem;
  shardd__sb_printf(m, SHARDD__MANIFEST_MAGIC " %d\njob ",
                    multi ? SHARDD_MANIFEST_VERSION : SHARDD_MANIFEST_VERSION_SINGLE);
  shardd__manifest_enc_name(m, job->name);
  shardd__sb_printf(m, " %" PRIu32 " %" PRIu32 "\n", job->world, job->uid);
  /* a node's part: only this node's ranks have shard and state lines */
  if (multi)
    shardd__sb_printf(m, "node %" PRIu32 " %" PRIu32 "\n", job->node_rank,
                      job->nodes);
  /* and the job's fabric lineage and origin: what a restart of this daemon
   * from this part alone (its --checkpoint-on-exit part, without a job
   * manifest) needs to rejoin the live nodes of the job (restore.c) */
  if (multi)
    shardd__sb_printf(m, "lineage %016" PRIx64 " %016" PRIx64 "\n",
                      job->lineage, job->origin);
  /* restored so: its trainers ask for the same areas again */
  if (job->transient)
    shardd__sb_printf(m, "areas transient\n");

  char fname[128];
  for (size_t i = 0; i < nb; i++) {
    shardd__buffer *b = bufs[i];
    size_t esz = shardd_dtype_size(b->dtype);
    shardd__sb_printf(m, "buffer ");
    shardd__manifest_enc_name(m, b->hdr.name);
    shardd__sb_printf(m, " %d %" PRIu64 " %" PRIu64 "\n", (int)b->dtype,
                      b->numel, b->hdr.generation);
    for (uint32_t r = job->local_first; r < job->local_first + job->local_ranks;
         r++) {
      snprintf(fname, sizeof fname, "b%zu-r%" PRIu32 "-%s.shard", i, r, tag);
      shardd__sb_printf(m, "shard %zu %" PRIu32 " %s ", i, r, fname);
      const char *base = host_view(reg, w, b->blocks[r], err, errlen);
      if (base == NULL) {
        rc = SHARDD_E_IO;
        goto fail;
      }
      if (add_file(w, fname, (uint32_t)b->dtype, b->shard_numel,
                   (uint64_t)r * b->shard_numel, b->hdr.name, base + b->shard_off,
                   b->shard_numel * esz) != SHARDD_OK)
        goto nomem;
      shardd__sb_printf(m, "\n");
    }
    shardd__view **views;
    size_t nv;
    if (shardd__buffer_views(b, &views, &nv) != SHARDD_OK)
      goto nomem;
    for (size_t k = 0; k < nv; k++) {
      shardd__view *v = views[k];
      shardd__sb_printf(m, "view %zu ", i);
      shardd__manifest_enc_name(m, v->hdr.name);
      shardd__sb_printf(m, " %" PRIu64 " %" PRIu64 " %d", v->offset, v->numel,
                        v->ndim);
      for (int d = 0; d < v->ndim; d++)
        shardd__sb_printf(m, " %" PRId64, v->shape[d]);
      shardd__sb_printf(m, " %" PRIu64 " %d\n", v->hdr.generation,
                        v->requires_grad);
    }
    free(views);
  }

  for (size_t i = 0; i < no; i++) {
    shardd__optim *o = opts[i];
    /* name: 3 bytes a byte at most when encoded; index and steps: 40 */
    if (o->spec_len >
        (SHARDD__MANIFEST_LINE_MAX - 3 * strlen(o->hdr.name) - 64) / 2) {
      snprintf(err, errlen,
               "optimizer \"%s\": its registration (%zu bytes) "
               "does not fit a manifest line (%zu bytes)",
               o->hdr.name, o->spec_len, SHARDD__MANIFEST_LINE_MAX);
      rc = SHARDD_E_LIMIT;
      goto fail;
    }
    shardd__sb_printf(m, "optimizer %zu ", i);
    shardd__manifest_enc_name(m, o->hdr.name);
    shardd__sb_printf(m, " %" PRIu64 " ", o->steps);
    for (size_t k = 0; k < o->spec_len; k++)
      shardd__sb_printf(m, "%02x", o->spec[k]);
    shardd__sb_printf(m, "\n");
    for (size_t k = 0; k < o->nrefs; k++) {
      shardd__obj *r = o->refs[k];
      if (r->kind == SHARDD__OBJ_VIEW) {
        shardd__view *v = (shardd__view *)r;
        shardd__sb_printf(m, "ref %zu %" PRIu64 " view %zu ", i, r->id,
                          buffer_index(bufs, nb, v->buf));
        shardd__manifest_enc_name(m, r->name);
        shardd__sb_printf(m, " %" PRIu64 "\n", o->ref_steps[k]);
      } else {
        shardd__sb_printf(m, "ref %zu %" PRIu64 " buffer %zu %" PRIu64 "\n", i,
                          r->id, buffer_index(bufs, nb, (shardd__buffer *)r),
                          o->ref_steps[k]);
      }
    }
    for (size_t k = 0; k < o->nshards; k++) {
      shardd__optim_shard *sh = &o->shards[k];
      if (sh->state == NULL)
        continue;
      size_t bi = buffer_index(bufs, nb, sh->buf);
      snprintf(fname, sizeof fname, "o%zu-b%zu-r%" PRIu32 "-%s.state", i, bi,
               sh->rank, tag);
      shardd__sb_printf(m, "state %zu %zu %" PRIu32 " %d %s ", i, bi, sh->rank,
                        sh->master_valid, fname);
      const char *st = host_view(reg, w, sh->state, err, errlen);
      if (st == NULL) {
        rc = SHARDD_E_IO;
        goto fail;
      }
      if (add_file(w, fname, SHARDD_DTYPE_FP32, sh->state->bytes / 4,
                   (uint64_t)sh->rank * sh->buf->shard_numel,
                   sh->buf->hdr.name, st, sh->state->bytes) != SHARDD_OK)
        goto nomem;
      shardd__sb_printf(m, " %zu %d\n", sh->state->bytes, sh->nstate);
    }
  }
  if (m->failed)
    goto nomem;
  /* with its "end" line: no checkpoint restore would refuse on its size */
  if (m->len > SHARDD__MANIFEST_MAX - 64) {
    snprintf(err, errlen, "job \"%s\": its manifest would be %zu bytes, more "
             "than the %zu MiB restore reads; not written", job->name, m->len,
             SHARDD__MANIFEST_MAX >> 20);
    rc = SHARDD_E_LIMIT;
    goto fail;
  }
  free(bufs);
  free(opts);
  *out = w;
  return SHARDD_OK;

nomem:
  rc = SHARDD_E_NO_MEMORY;
  snprintf(err, errlen, "out of memory");
fail:
  free(bufs);
  free(opts);
  shardd__checkpoint_wfree(w);
  return rc;
}

shardd_err shardd__checkpoint_run(shardd__ckwrite *w, char *err,
                                  size_t errlen) {
  shardd__ckdir dd = {-1, w->dir, w->as_uid};
  const shardd__ckdir *dir = &dd;
  shardd_err rc;
  if (w->jobdir) { /* DIR first, under the same rules; any node may make it */
    int jfd;
    rc = shardd__ck_open_write_dir(w->jobdir, w->as_uid, w->home, &jfd, err,
                                   errlen);
    if (rc != SHARDD_OK)
      return rc;
    close(jfd);
  }
  rc = shardd__ck_open_write_dir(w->dir, w->as_uid, w->home, &dd.fd, err, errlen);
  if (rc != SHARDD_OK)
    return rc;
  int manifest_in = 0;
  shardd__sb *m = &w->m;
  for (size_t i = 0; i < w->nfiles; i++) {
    const ck_file *f = &w->files[i];
    uint32_t crc;
    rc = shardd__ck_write_data(dir, f->fname, f->dtype, f->numel, f->offset,
                               f->name, f->data, f->bytes, &crc, err, errlen);
    if (rc != SHARDD_OK)
      goto done;
    char hex[9];
    snprintf(hex, sizeof hex, "%08" PRIx32, crc);
    memcpy(m->s + f->crc_at, hex, 8);
  }
  /* The checksum seals every byte before it: an edited step count,
   * master_valid or owner was accepted, and an edited offset surfaced only
   * when ranks re-attached, blaming the trainers. */
  w->seal = shardd__crc32c(0, m->s, m->len);
  shardd__sb_printf(m, "end %08" PRIx32 "\n", w->seal);
  if (m->failed) {
    rc = SHARDD_E_NO_MEMORY;
    snprintf(err, errlen, "out of memory");
    goto done;
  }
  /* Data files must be durable before the manifest vouches for them. */
  if ((rc = shardd__ck_fsync_dir(dir, err, errlen)) != SHARDD_OK ||
      (rc = shardd__ck_write_file(dir, SHARDD__MANIFEST_FILE, NULL, 0, m->s,
                                  m->len, err, errlen)) != SHARDD_OK)
    goto done;
  manifest_in = 1; /* from here the new files are the checkpoint */
  if ((rc = shardd__ck_fsync_dir(dir, err, errlen)) != SHARDD_OK)
    goto done;
  rc = SHARDD_OK;

done:
  remove_generation(dir, w->tag, manifest_in);
  close(dd.fd);
  return rc;
}

shardd_err shardd__checkpoint_write(shardd__registry *reg, shardd__job *job,
                                    const char *dirpath, int64_t as_uid,
                                    char *err, size_t errlen) {
  return shardd__checkpoint_write_in(reg, job, dirpath, as_uid, NULL, err,
                                     errlen);
}

shardd_err shardd__checkpoint_write_in(shardd__registry *reg, shardd__job *job,
                                       const char *dirpath, int64_t as_uid,
                                       const char *home, char *err,
                                       size_t errlen) {
  shardd__ckwrite *w;
  shardd_err rc = shardd__checkpoint_prepare(reg, job, dirpath, as_uid, home,
                                             &w, err, errlen);
  if (rc != SHARDD_OK)
    return rc;
  rc = shardd__checkpoint_run(w, err, errlen);
  shardd__checkpoint_wfree(w);
  return rc;
}

/* The job-level manifest of a multi-node checkpoint. Every node writes the
 * same bytes (the seals came from the exchange that follows the parts), each
 * under a name of its own in its own part (a shared temporary name would let
 * one node rename another's half-written file), then renames it over
 * DIR/manifest: whichever rename lands last, DIR/manifest is whole, and it
 * exists before any node's ranks hear their checkpoint is taken. */
shardd_err shardd__checkpoint_write_job(const char *dirpath, int64_t as_uid,
                                        const char *home, const shardd__job *job,
                                        const uint32_t *seals, uint32_t *seal,
                                        char *err, size_t errlen) {
  *seal = 0;
  char part[4096];
  if ((size_t)snprintf(part, sizeof part, "%s/node-%" PRIu32, dirpath,
                       job->node_rank) >= sizeof part) {
    snprintf(err, errlen, "%s: path too long", dirpath);
    return SHARDD_E_INVAL;
  }
  shardd__sb m;
  shardd__sb_init(&m);
  shardd__sb_printf(&m, "%s %d\njob ", SHARDD__JOB_MANIFEST_MAGIC,
                    SHARDD__JOB_MANIFEST_VERSION);
  shardd__manifest_enc_name(&m, job->name);
  shardd__sb_printf(&m, " %" PRIu32 " %" PRIu32 "\nnodes %" PRIu32 "\n",
                    job->world, job->uid, job->nodes);
  for (uint32_t n = 0; n < job->nodes; n++)
    shardd__sb_printf(&m, "part %" PRIu32 " node-%" PRIu32 " %08" PRIx32 "\n", n,
                      n, seals[n]);
  uint32_t crc = shardd__crc32c(0, m.s, m.len);
  shardd__sb_printf(&m, "end %08" PRIx32 "\n", crc);
  if (m.failed) {
    shardd__sb_free(&m);
    snprintf(err, errlen, "out of memory");
    return SHARDD_E_NO_MEMORY;
  }
  int jfd = -1;
  shardd__ckdir pd = {-1, part, as_uid}, jd = {-1, dirpath, as_uid};
  shardd_err rc =
      shardd__ck_open_write_dir(dirpath, as_uid, home, &jfd, err, errlen);
  if (rc == SHARDD_OK)
    rc = shardd__ck_open_write_dir(part, as_uid, home, &pd.fd, err, errlen);
  jd.fd = jfd;
  if (rc == SHARDD_OK)
    rc = shardd__ck_write_file(&pd, "job-manifest", NULL, 0, m.s, m.len, err,
                               errlen);
  if (rc == SHARDD_OK &&
      renameat(pd.fd, "job-manifest", jd.fd, SHARDD__MANIFEST_FILE) != 0) {
    snprintf(err, errlen, "rename %s/job-manifest to %s/%s: %s", part, dirpath,
             SHARDD__MANIFEST_FILE, strerror(errno));
    rc = SHARDD_E_IO;
  }
  if (rc == SHARDD_OK)
    rc = shardd__ck_fsync_dir(&jd, err, errlen);
  if (rc == SHARDD_OK)
    *seal = crc;
  if (pd.fd >= 0)
    close(pd.fd);
  if (jfd >= 0)
    close(jfd);
  shardd__sb_free(&m);
  return rc;
}

/* ---- superseded exit checkpoints -------------------------------------- */

shardd_err shardd__checkpoint_supersede(const char *dirpath,
                                        const shardd__cksuperseded *m,
                                        char *err, size_t errlen) {
  shardd__sb sb;
  shardd__sb_init(&sb);
  shardd__sb_printf(&sb, "shardd-superseded 1\njob ");
  shardd__manifest_enc_name(&sb, m->job);
  shardd__sb_printf(&sb, "\npart %s\nseal %08" PRIx32 "\nstep %" PRIu64 "\n",
                    m->part, m->seal, m->step);
  if (sb.failed) {
    shardd__sb_free(&sb);
    snprintf(err, errlen, "out of memory");
    return SHARDD_E_NO_MEMORY;
  }
  shardd__ckdir d = {-1, dirpath, -1};
  d.fd = shardd__ck_open_dir(dirpath, err, errlen);
  shardd_err rc = d.fd < 0 ? SHARDD_E_IO : SHARDD_OK;
  if (rc == SHARDD_OK &&
      (rc = shardd__ck_write_file(&d, SHARDD__SUPERSEDED_FILE, NULL, 0, sb.s,
                                  sb.len, err, errlen)) == SHARDD_OK)
    rc = shardd__ck_fsync_dir(&d, err, errlen);
  if (d.fd >= 0)
    close(d.fd);
  shardd__sb_free(&sb);
  return rc;
}

shardd_err shardd__checkpoint_superseded(const char *dirpath,
                                         shardd__cksuperseded *m, char *err,
                                         size_t errlen) {
  memset(m, 0, sizeof *m);
  shardd__ckdir d = {-1, dirpath, -1};
  d.fd = shardd__ck_open_dir(dirpath, err, errlen);
  if (d.fd < 0)
    return errno == ENOENT ? SHARDD_E_NOT_FOUND : SHARDD_E_IO;
  int fd = shardd__ck_open_regular(&d, SHARDD__SUPERSEDED_FILE, err, errlen);
  int e = errno;
  close(d.fd);
  if (fd < 0)
    return e == ENOENT ? SHARDD_E_NOT_FOUND : SHARDD_E_IO;
  FILE *f = fdopen(fd, "r");
  if (f == NULL) {
    close(fd);
    snprintf(err, errlen, "%s/%s: %s", dirpath, SHARDD__SUPERSEDED_FILE,
             strerror(errno));
    return SHARDD_E_IO;
  }
  char line[512];
  int have = 0, lineno = 0;
  while (fgets(line, sizeof line, f)) {
    lineno++;
    line[strcspn(line, "\n")] = '\0';
    char val[300];
    unsigned seal;
    unsigned long long step;
    if (lineno == 1) {
      if (strcmp(line, "shardd-superseded 1") != 0)
        break;
      have |= 1;
    } else if (sscanf(line, "job %299s", val) == 1 &&
               shardd__manifest_dec_name(val) && strlen(val) < sizeof m->job) {
      /* the length is checked above (gcc -O1 cannot see it, so no
       * snprintf: it warned of a truncation that cannot happen) */
      memcpy(m->job, val, strlen(val) + 1);
      have |= 2;
    } else if (sscanf(line, "part %63s", m->part) == 1) {
      have |= 4;
    } else if (sscanf(line, "seal %8x", &seal) == 1) {
      m->seal = seal;
      have |= 8;
    } else if (sscanf(line, "step %llu", &step) == 1) {
      m->step = step;
      have |= 16;
    }
  }
  fclose(f);
  /* the part is a path below the directory, one component */
  if (have != 31 || strchr(m->part, '/') || !strcmp(m->part, "..")) {
    snprintf(err, errlen, "%s/%s: not a marker shardd wrote (malformed)",
             dirpath, SHARDD__SUPERSEDED_FILE);
    return SHARDD_E_INVAL;
  }
  return SHARDD_OK;
}
