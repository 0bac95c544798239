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
#include <pthread.h>
#include <stdatomic.h>
#include <unistd.h>
#include <uv.h>

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
  int fd; /* dir's, while run writes (run_open to run_end) */
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

/* Appends a data file; its manifest line's CRC is at crc_at in the
 * manifest (written as 00000000 until the file is). */
static shardd_err add_file(shardd__ckwrite *w, const char *fname,
                           uint32_t dtype, uint64_t numel, uint64_t offset,
                           const char *name, const void *data, size_t bytes,
                           size_t crc_at) {
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
  f->crc_at = crc_at;
  return SHARDD_OK;
}

/* A writer for job's checkpoint into dirpath (a node's part: DIR/node-N)
 * with a fresh tag for its data files; NULL with *rc and err on failure. */
static shardd__ckwrite *ckwrite_new(const shardd__job *job,
                                    const char *dirpath, int64_t as_uid,
                                    const char *home, shardd_err *rc,
                                    char *err, size_t errlen) {
  /* A multi-node job: this node writes its ranks' part into DIR/node-N,
   * its manifest saying which node of how many it is; the job-level
   * manifest in DIR (shardd__checkpoint_write_job) vouches for every part
   * once all are written. */
  char part[4096];
  int multi = job->nodes > 1;
  if (multi && (size_t)snprintf(part, sizeof part, "%s/node-%" PRIu32, dirpath,
                                job->node_rank) >= sizeof part) {
    snprintf(err, errlen, "%s: path too long", dirpath);
    *rc = SHARDD_E_INVAL;
    return NULL;
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
    *rc = SHARDD_E_NO_MEMORY;
    return NULL;
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
  return w;
}

/* The buffers' lines (each buffer, its local ranks' shards with their data
 * files, its views). SHARDD_E_NO_MEMORY leaves err to the caller. */
static shardd_err put_buffers(shardd__registry *reg, shardd__ckwrite *w,
                              const shardd__job *job, shardd__buffer **bufs,
                              size_t nb, char *err, size_t errlen) {
  shardd__sb *m = &w->m;
  char fname[128];
  for (size_t i = 0; i < nb; i++) {
    shardd__buffer *b = bufs[i];
    size_t esz = shardd_dtype_size(b->dtype);
    shardd__manifest_put_buffer(m, b->hdr.name, (int)b->dtype, b->numel,
                                b->hdr.generation);
    for (uint32_t r = job->local_first; r < job->local_first + job->local_ranks;
         r++) {
      snprintf(fname, sizeof fname, "b%zu-r%" PRIu32 "-%s.shard", i, r,
               w->tag);
      const char *base = host_view(reg, w, b->blocks[r], err, errlen);
      if (base == NULL)
        return SHARDD_E_IO;
      size_t crc_at = shardd__manifest_put_shard(m, i, r, fname);
      if (add_file(w, fname, (uint32_t)b->dtype, b->shard_numel,
                   (uint64_t)r * b->shard_numel, b->hdr.name, base + b->shard_off,
                   b->shard_numel * esz, crc_at) != SHARDD_OK)
        return SHARDD_E_NO_MEMORY;
    }
    shardd__view **views;
    size_t nv;
    if (shardd__buffer_views(b, &views, &nv) != SHARDD_OK)
      return SHARDD_E_NO_MEMORY;
    for (size_t k = 0; k < nv; k++) {
      shardd__view *v = views[k];
      shardd__manifest_put_view(m, i, v->hdr.name, v->offset, v->numel,
                                v->ndim, v->shape, v->hdr.generation,
                                v->requires_grad);
    }
    free(views);
  }
  return SHARDD_OK;
}

/* The optimizers' lines (each optimizer, its refs, its shards' states with
 * their data files). SHARDD_E_NO_MEMORY leaves err to the caller. */
static shardd_err put_optimizers(shardd__registry *reg, shardd__ckwrite *w,
                                 shardd__optim **opts, size_t no,
                                 shardd__buffer **bufs, size_t nb, char *err,
                                 size_t errlen) {
  shardd__sb *m = &w->m;
  char fname[128];
  for (size_t i = 0; i < no; i++) {
    shardd__optim *o = opts[i];
    /* name: 3 bytes a byte at most when encoded; index and steps: 40 */
    if (o->spec_len >
        (SHARDD__MANIFEST_LINE_MAX - 3 * strlen(o->hdr.name) - 64) / 2) {
      snprintf(err, errlen,
               "optimizer \"%s\": its registration (%zu bytes) "
               "does not fit a manifest line (%zu bytes)",
               o->hdr.name, o->spec_len, SHARDD__MANIFEST_LINE_MAX);
      return SHARDD_E_LIMIT;
    }
    shardd__manifest_put_optimizer(m, i, o->hdr.name, o->steps, o->spec,
                                   o->spec_len);
    for (size_t k = 0; k < o->nrefs; k++) {
      shardd__obj *r = o->refs[k];
      if (r->kind == SHARDD__OBJ_VIEW)
        shardd__manifest_put_ref(
            m, i, r->id, buffer_index(bufs, nb, ((shardd__view *)r)->buf),
            r->name, o->ref_steps[k]);
      else
        shardd__manifest_put_ref(m, i, r->id,
                                 buffer_index(bufs, nb, (shardd__buffer *)r),
                                 NULL, o->ref_steps[k]);
    }
    for (size_t k = 0; k < o->nshards; k++) {
      shardd__optim_shard *sh = &o->shards[k];
      if (sh->state == NULL)
        continue;
      size_t bi = buffer_index(bufs, nb, sh->buf);
      snprintf(fname, sizeof fname, "o%zu-b%zu-r%" PRIu32 "-%s.state", i, bi,
               sh->rank, w->tag);
      const char *st = host_view(reg, w, sh->state, err, errlen);
      if (st == NULL)
        return SHARDD_E_IO;
      size_t crc_at = shardd__manifest_put_state(m, i, bi, sh->rank,
                                                 sh->master_valid, fname,
                                                 sh->state->bytes, sh->nstate);
      if (add_file(w, fname, SHARDD_DTYPE_FP32, sh->state->bytes / 4,
                   (uint64_t)sh->rank * sh->buf->shard_numel,
                   sh->buf->hdr.name, st, sh->state->bytes,
                   crc_at) != SHARDD_OK)
        return SHARDD_E_NO_MEMORY;
    }
  }
  return SHARDD_OK;
}

shardd_err shardd__checkpoint_prepare(shardd__registry *reg, shardd__job *job,
                                      const char *dirpath, int64_t as_uid,
                                      const char *home, shardd__ckwrite **out,
                                      char *err, size_t errlen) {
  *out = NULL;
  shardd_err rc;
  shardd__ckwrite *w =
      ckwrite_new(job, dirpath, as_uid, home, &rc, err, errlen);
  if (w == NULL)
    return rc;
  int multi = job->nodes > 1;
  shardd__sb *m = &w->m;

  shardd__buffer **bufs = NULL;
  shardd__optim **opts = NULL;
  size_t nb = 0, no = 0;
  if (shardd__job_buffers(job, &bufs, &nb) != SHARDD_OK ||
      shardd__job_optims(job, &opts, &no) != SHARDD_OK)
    goto nomem;
  shardd__manifest_put_head(
      m, multi ? SHARDD_MANIFEST_VERSION : SHARDD_MANIFEST_VERSION_SINGLE,
      job->name, job->world, job->uid);
  /* a node's part: only this node's ranks have shard and state lines */
  if (multi)
    shardd__manifest_put_node(m, job->node_rank, job->nodes);
  /* and the job's fabric lineage and origin: what a restart of this daemon
   * from this part alone (its --checkpoint-on-exit part, without a job
   * manifest) needs to rejoin the live nodes of the job (restore.c) */
  if (multi)
    shardd__manifest_put_lineage(m, job->lineage, job->origin);
  /* restored so: its trainers ask for the same areas again */
  if (job->transient)
    shardd__manifest_put_transient(m);
  rc = put_buffers(reg, w, job, bufs, nb, err, errlen);
  if (rc == SHARDD_OK)
    rc = put_optimizers(reg, w, opts, no, bufs, nb, err, errlen);
  if (rc == SHARDD_E_NO_MEMORY)
    goto nomem;
  if (rc != SHARDD_OK)
    goto fail;
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

/* run, in three parts so that run_many can write the files of several
 * checkpoints at once: open (the directories), one data file each (any
 * thread, several at once: each writes its own file and its own CRC's
 * place in the manifest text), end (the seal, the manifest, the previous
 * generation's files). */
static shardd_err run_open(shardd__ckwrite *w, char *err, size_t errlen) {
  w->fd = -1;
  if (w->jobdir) { /* DIR first, under the same rules; any node may make it */
    int jfd;
    shardd_err rc = shardd__ck_open_write_dir(w->jobdir, w->as_uid, w->home,
                                              &jfd, err, errlen);
    if (rc != SHARDD_OK)
      return rc;
    close(jfd);
  }
  return shardd__ck_open_write_dir(w->dir, w->as_uid, w->home, &w->fd, err,
                                   errlen);
}

/* staged: only written to its temporary name, its write-back started
 * (run_commit makes it durable and renames it) */
static shardd_err run_file(shardd__ckwrite *w, size_t i, int staged, char *err,
                           size_t errlen) {
  shardd__ckdir dir = {w->fd, w->dir, w->as_uid};
  const ck_file *f = &w->files[i];
  uint32_t crc;
  shardd_err rc = (staged ? shardd__ck_stage_data : shardd__ck_write_data)(
      &dir, f->fname, f->dtype, f->numel, f->offset, f->name, f->data,
      f->bytes, &crc, err, errlen);
  if (rc == SHARDD_OK) {
    char hex[9];
    snprintf(hex, sizeof hex, "%08" PRIx32, crc);
    memcpy(w->m.s + f->crc_at, hex, 8);
  }
  return rc;
}

static shardd_err run_commit(shardd__ckwrite *w, size_t i, char *err,
                             size_t errlen) {
  shardd__ckdir dir = {w->fd, w->dir, w->as_uid};
  return shardd__ck_commit_data(&dir, w->files[i].fname, err, errlen);
}

/* rc: how the files went; the manifest is written only after all of them
 * were. Closes what open opened. */
static shardd_err run_end(shardd__ckwrite *w, shardd_err rc, char *err,
                          size_t errlen) {
  shardd__ckdir dd = {w->fd, w->dir, w->as_uid};
  const shardd__ckdir *dir = &dd;
  int manifest_in = 0;
  shardd__sb *m = &w->m;
  if (rc != SHARDD_OK)
    goto done;
  /* The checksum seals every byte before it: an edited step count,
   * master_valid or owner was accepted, and an edited offset surfaced only
   * when ranks re-attached, blaming the trainers. */
  w->seal = shardd__crc32c(0, m->s, m->len);
  shardd__manifest_put_end(m, w->seal);
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
  close(w->fd);
  w->fd = -1;
  return rc;
}

shardd_err shardd__checkpoint_run(shardd__ckwrite *w, char *err,
                                  size_t errlen) {
  shardd_err rc = run_open(w, err, errlen);
  if (rc != SHARDD_OK)
    return rc;
  for (size_t i = 0; i < w->nfiles && rc == SHARDD_OK; i++)
    rc = run_file(w, i, 0, err, errlen);
  return run_end(w, rc, err, errlen);
}

uint64_t shardd__checkpoint_wbytes(const shardd__ckwrite *w) {
  uint64_t n = w->m.len;
  for (size_t i = 0; i < w->nfiles; i++)
    n += w->files[i].bytes;
  return n;
}

/* ---- several checkpoints at once ---------------------------------------
 * One checkpoint's files written one after another went at the pace of one
 * thread's write(2) and fsync(2): 180-230 MiB/s, so a node's exit
 * checkpoint outran TimeoutStopSec past ~5 GiB. Here every data file of
 * every checkpoint is one task, taken by as many of libuv's pool threads
 * as there are (their CRCs, copies into the page cache and fsyncs
 * overlap), in the order one thread would write them: checkpoint after
 * checkpoint, so the threads fill one directory at a time (taken largest
 * first across directories, one thread's writes were 2x slower on a
 * rotational disk). */

typedef struct {
  uint32_t w;
  uint32_t f;
} many_task;

typedef struct {
  shardd__ckwrite **ws;
  size_t n;
  shardd_err *rcs; /* [n], set under mu */
  char *errs;      /* [n][errlen] */
  size_t errlen;
  many_task *tasks;
  size_t ntasks;
  atomic_size_t next;
  int commit; /* the second pass: fsync and rename what the first wrote */
  pthread_mutex_t mu;
  int outstanding; /* loop thread only */
} many;

typedef struct {
  uv_work_t req;
  many *m;
} many_worker;

static void many_work(uv_work_t *req) {
  many *m = ((many_worker *)req)->m;
  char err[1024];
  for (;;) {
    size_t i = atomic_fetch_add(&m->next, 1);
    if (i >= m->ntasks)
      return;
    many_task *t = &m->tasks[i];
    pthread_mutex_lock(&m->mu);
    int failed = m->rcs[t->w] != SHARDD_OK;
    pthread_mutex_unlock(&m->mu);
    if (failed) /* that checkpoint is lost already: its other files wait */
      continue;
    shardd_err rc = m->commit ? run_commit(m->ws[t->w], t->f, err, sizeof err)
                              : run_file(m->ws[t->w], t->f, 1, err, sizeof err);
    if (rc != SHARDD_OK) {
      pthread_mutex_lock(&m->mu);
      if (m->rcs[t->w] == SHARDD_OK) {
        m->rcs[t->w] = rc;
        snprintf(m->errs + t->w * m->errlen, m->errlen, "%s", err);
      }
      pthread_mutex_unlock(&m->mu);
    }
  }
}

static void many_after(uv_work_t *req, int status) {
  (void)status;
  ((many_worker *)req)->m->outstanding--;
}

/* The threads libuv's pool has (UV_THREADPOOL_SIZE, 4 by default). */
static size_t pool_threads(void) {
  const char *e = getenv("UV_THREADPOOL_SIZE");
  long n = e ? strtol(e, NULL, 10) : 0;
  return n > 0 ? (size_t)n : 4;
}

void shardd__checkpoint_run_many(uv_loop_t *loop, shardd__ckwrite **ws,
                                 size_t n, shardd_err *rcs, char *errs,
                                 size_t errlen) {
  many m = {.ws = ws, .n = n, .rcs = rcs, .errs = errs, .errlen = errlen};
  atomic_init(&m.next, 0);
  pthread_mutex_init(&m.mu, NULL);
  size_t total = 0;
  for (size_t k = 0; k < n; k++) {
    errs[k * errlen] = '\0';
    rcs[k] = run_open(ws[k], errs + k * errlen, errlen);
    if (rcs[k] == SHARDD_OK)
      total += ws[k]->nfiles;
  }
  m.tasks = calloc(total ? total : 1, sizeof *m.tasks);
  size_t nworkers = total < pool_threads() ? total : pool_threads();
  many_worker *workers = calloc(nworkers ? nworkers : 1, sizeof *workers);
  if (m.tasks == NULL || workers == NULL) {
    /* out of memory: each one on this thread, as run does */
    for (size_t k = 0; k < n; k++)
      for (size_t i = 0; rcs[k] == SHARDD_OK && i < ws[k]->nfiles; i++)
        rcs[k] = run_file(ws[k], i, 0, errs + k * errlen, errlen);
  } else {
    for (size_t k = 0; k < n; k++)
      for (size_t i = 0; rcs[k] == SHARDD_OK && i < ws[k]->nfiles; i++)
        m.tasks[m.ntasks++] = (many_task){(uint32_t)k, (uint32_t)i};
    /* two passes: every file written (the kernel writes them back
     * meanwhile), then every file fsync'ed and renamed. An fsync right
     * after each write made each thread wait for the disk with data it
     * could have queued: 2x slower than a dd of the same bytes. */
    for (m.commit = 0; m.commit < 2; m.commit++) {
      atomic_store(&m.next, 0);
      for (size_t t = 0; t < nworkers; t++) {
        workers[t].m = &m;
        if (uv_queue_work(loop, &workers[t].req, many_work, many_after) == 0)
          m.outstanding++;
      }
      if (m.outstanding == 0 && nworkers > 0) /* no pool: this thread */
        many_work(&workers[0].req);
      while (m.outstanding > 0)
        uv_run(loop, UV_RUN_ONCE);
    }
  }
  for (size_t k = 0; k < n; k++)
    if (ws[k]->fd >= 0)
      rcs[k] = run_end(ws[k], rcs[k], errs + k * errlen, errlen);
  free(workers);
  free(m.tasks);
  pthread_mutex_destroy(&m.mu);
}

const char *shardd__checkpoint_wmanifest(shardd__ckwrite *w, size_t *len) {
  w->seal = shardd__crc32c(0, w->m.s, w->m.len);
  shardd__manifest_put_end(&w->m, w->seal);
  *len = w->m.len;
  return w->m.failed ? NULL : w->m.s;
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
  uint32_t crc = shardd__manifest_put_job(&m, job->name, job->world, job->uid,
                                          job->nodes, seals);
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
