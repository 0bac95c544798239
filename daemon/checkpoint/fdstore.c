/* fdstore.c — owns the fd-store protocol's descriptions of jobs (the
 * metadata memfds and the step journal): writing them as jobs change, the
 * journal around each step, their removal; see fdstore.h. Their adoption at
 * start is fdstore_adopt.c. The regions' own FDSTORE/FDSTOREREMOVE are the
 * backend's. */
#include "fdstore.h"
#include "fdstore_int.h"

#include <errno.h>
#include <inttypes.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "checkpoint.h"
#include "log.h"
#include "manifest.h"
#include "sdnotify.h"
#include "strbuf.h"

char *shardd__fdstore_key_of(uint32_t uid, const char *name) {
  shardd__sb sb;
  shardd__sb_init(&sb);
  shardd__sb_printf(&sb, "%" PRIu32 "/%s", uid, name);
  return shardd__sb_take(&sb);
}

void shardd__fdstore_store_fd(int fd, const char *name) {
  char state[128], err[256];
  if (!shardd__sd_fdname_valid(name)) { /* systemd would refuse it */
    shardd__log(1, "fd store: \"%s\" is no valid FDNAME; not stored", name);
    return;
  }
  snprintf(state, sizeof state, "FDSTORE=1\nFDNAME=%s", name);
  if (shardd__sd_notify_fd(state, fd, err, sizeof err) != SHARDD_OK)
    shardd__log(1, "fd store: %s not stored: %s", name, err);
}

void shardd__fdstore_unstore_fd(const char *name) {
  char state[128], err[256];
  snprintf(state, sizeof state, "FDSTOREREMOVE=1\nFDNAME=%s", name);
  if (shardd__sd_notify(state, err, sizeof err) != SHARDD_OK)
    shardd__log(1, "fd store: %s", err);
}

void shardd__fdstore_fd_name(const fs_job *e, int k, char *out, size_t len) {
  snprintf(out, len, "%s-%c", e->base, "abj"[k]);
}

void shardd__fdstore_entry_free(fs_job *e, int unstore) {
  if (e == NULL)
    return;
  for (int k = 0; k < 3; k++) {
    if (e->fd[k] < 0)
      continue;
    if (unstore) {
      char name[80];
      shardd__fdstore_fd_name(e, k, name, sizeof name);
      shardd__fdstore_unstore_fd(name);
    }
    close(e->fd[k]);
  }
  if (e->j)
    munmap(e->j, e->jlen);
  free(e->lay_id);
  free(e->lay_off);
  free(e->lay_nrefs);
  free(e->lay_mv);
  free(e->key);
  free(e);
}

shardd_err shardd__fdstore_map_journal(fs_job *e) {
  struct stat st;
  if (fstat(e->fd[2], &st) != 0 || st.st_size < JRNL_BYTES)
    return SHARDD_E_IO; /* mapped past its end, a read would fault */
  void *p = mmap(NULL, (size_t)st.st_size, PROT_READ | PROT_WRITE, MAP_SHARED,
                 e->fd[2], 0);
  if (p == MAP_FAILED)
    return SHARDD_E_IO;
  e->j = p;
  e->jlen = (size_t)st.st_size;
  return SHARDD_OK;
}

/* A new job's description: three memfds, stored. */
static fs_job *entry_new(shardd__fdstore *fs, shardd__job *job, char *key) {
  fs_job *e = calloc(1, sizeof *e);
  if (e == NULL) {
    free(key);
    return NULL;
  }
  e->key = key;
  e->job = job;
  e->active = -1;
  e->dirty = 1;
  e->fd[0] = e->fd[1] = e->fd[2] = -1;
  snprintf(e->base, sizeof e->base, META_PREFIX "%s-%" PRIx64, fs->prefix,
           ++fs->next_id);
  for (int k = 0; k < 3; k++) {
    char name[80];
    shardd__fdstore_fd_name(e, k, name, sizeof name);
    e->fd[k] = memfd_create(name, MFD_CLOEXEC);
    if (e->fd[k] < 0 ||
        ftruncate(e->fd[k], k == 2 ? JRNL_BYTES : SLOT_TEXT_OFF) != 0)
      goto fail;
  }
  if (shardd__fdstore_map_journal(e) != SHARDD_OK)
    goto fail;
  memcpy(e->j->magic, JRNL_MAGIC, 8);
  for (int k = 0; k < 3; k++) {
    char name[80];
    shardd__fdstore_fd_name(e, k, name, sizeof name);
    shardd__fdstore_store_fd(e->fd[k], name);
  }
  return e;
fail:
  shardd__log(1, "fd store: job \"%s\": its description: %s", job->name,
              strerror(errno));
  shardd__fdstore_entry_free(e, 0);
  return NULL;
}

/* The text a slot holds for job: its regions' store names, then its
 * manifest. SHARDD_E_INVAL (err says why) when a region is not stored.
 * *optsp: the job's optimizers in the manifest's order (the caller frees
 * it, also on failure). */
static shardd_err build_text(shardd__fdstore *fs, shardd__job *job,
                             shardd__sb *sb, shardd__optim ***optsp,
                             size_t *nop, char *err, size_t errlen) {
  shardd__buffer **bufs = NULL;
  shardd__optim **opts = NULL;
  size_t nb = 0, no = 0;
  shardd_err rc = SHARDD_E_NO_MEMORY;
  snprintf(err, errlen, "out of memory");
  *optsp = NULL;
  *nop = 0;
  if (shardd__job_buffers(job, &bufs, &nb) != SHARDD_OK ||
      shardd__job_optims(job, &opts, &no) != SHARDD_OK)
    goto done;
  /* the manifest's order: checkpoint_prepare lists them as job_optims
   * does, by id */
  *optsp = opts;
  *nop = no;
  for (size_t i = 0; i < nb; i++) {
    shardd__buffer *b = bufs[i];
    for (uint32_t r = job->local_first; r < job->local_first + job->local_ranks;
         r++) {
      const shardd__region *blk = b->blocks[r];
      const char *n = shardd__backend_region_store_name(blk);
      if (n == NULL) {
        snprintf(err, errlen, "buffer \"%s\" rank %" PRIu32 " is not in the "
                 "store", b->hdr.name, r);
        rc = SHARDD_E_INVAL;
        goto done;
      }
      shardd__sb_printf(sb, "region buffer ");
      shardd__manifest_enc_name(sb, b->hdr.name);
      shardd__sb_printf(sb, " %" PRIu32 " %s", r, n);
      /* a block of a slab: where it starts in the file it shares */
      if (blk->slab)
        shardd__sb_printf(sb, " %zu", blk->off);
      shardd__sb_printf(sb, "\n");
    }
  }
  for (size_t i = 0; i < no; i++) {
    shardd__optim *o = opts[i];
    for (size_t k = 0; k < o->nshards; k++) {
      shardd__optim_shard *sh = &o->shards[k];
      if (sh->state == NULL)
        continue;
      const char *n = shardd__backend_region_store_name(sh->state);
      if (n == NULL) {
        snprintf(err, errlen, "optimizer \"%s\" state of rank %" PRIu32
                 " is not in the store", o->hdr.name, sh->rank);
        rc = SHARDD_E_INVAL;
        goto done;
      }
      shardd__sb_printf(sb, "region state ");
      shardd__manifest_enc_name(sb, o->hdr.name);
      shardd__sb_printf(sb, " ");
      shardd__manifest_enc_name(sb, sh->buf->hdr.name);
      shardd__sb_printf(sb, " %" PRIu32 " %s\n", sh->rank, n);
    }
  }
  shardd__sb_printf(sb, "manifest\n");
  shardd__ckwrite *w;
  rc = shardd__checkpoint_prepare(fs->reg, job, "fd-store", -1, NULL, &w, err,
                                  errlen);
  if (rc != SHARDD_OK)
    goto done;
  size_t mlen;
  const char *m = shardd__checkpoint_wmanifest(w, &mlen);
  if (m)
    shardd__sb_printf(sb, "%.*s", (int)mlen, m);
  shardd__checkpoint_wfree(w);
  rc = m == NULL || sb->failed ? SHARDD_E_NO_MEMORY : SHARDD_OK;
  if (rc != SHARDD_OK)
    snprintf(err, errlen, "out of memory");
done:
  free(bufs);
  return rc;
}

static int pwrite_all(int fd, const void *p, size_t n, off_t off) {
  const char *c = p;
  while (n > 0) {
    ssize_t w = pwrite(fd, c, n, off);
    if (w < 0 && errno == EINTR)
      continue;
    if (w <= 0)
      return -1;
    c += w;
    n -= (size_t)w;
    off += w;
  }
  return 0;
}

/* The step counts of the slot just written (generation e->gen) into the
 * journal past its page, and their layout into e's lay_ arrays. Until the
 * generation is set last, the counts are not used (that slot's are); on a
 * failure they stay unused, and e->nlay 0 makes each step's end rewrite
 * the description whole. */
static void write_steps(fs_job *e, shardd__optim **opts, size_t no) {
  e->nlay = 0;
  size_t bytes = sizeof(steps_hdr);
  for (size_t i = 0; i < no; i++)
    bytes += (2 + opts[i]->nrefs) * sizeof(uint64_t);
  size_t need = JRNL_BYTES + bytes;
  if (need > e->jlen) { /* grown; never shrunk while mapped */
    if (ftruncate(e->fd[2], (off_t)need) != 0)
      return;
    void *p = mremap(e->j, e->jlen, need, MREMAP_MAYMOVE);
    if (p == MAP_FAILED)
      return; /* the old mapping stands */
    e->j = p;
    e->jlen = need;
  }
  size_t cap = no ? no : 1;
  uint64_t *id = realloc(e->lay_id, cap * sizeof *id);
  if (id)
    e->lay_id = id;
  size_t *off = realloc(e->lay_off, cap * sizeof *off);
  if (off)
    e->lay_off = off;
  size_t *nr = realloc(e->lay_nrefs, cap * sizeof *nr);
  if (nr)
    e->lay_nrefs = nr;
  unsigned char *mv = realloc(e->lay_mv, cap);
  if (mv)
    e->lay_mv = mv;
  if (!id || !off || !nr || !mv)
    return;
  steps_hdr *h = (steps_hdr *)((char *)e->j + JRNL_BYTES);
  atomic_store(&h->gen, 0);
  memcpy(h->magic, STEPS_MAGIC, 8);
  h->nopt = no;
  h->bytes = bytes;
  uint64_t *q = (uint64_t *)(h + 1);
  for (size_t i = 0; i < no; i++) {
    const shardd__optim *o = opts[i];
    id[i] = o->hdr.id;
    off[i] = (size_t)((char *)q - (char *)e->j);
    nr[i] = o->nrefs;
    mv[i] = 0;
    for (size_t k = 0; k < o->nshards; k++)
      if (o->shards[k].state && !o->shards[k].master_valid)
        mv[i] = 1;
    q[0] = o->steps;
    q[1] = o->nrefs;
    if (o->nrefs)
      memcpy(q + 2, o->ref_steps, o->nrefs * sizeof *q);
    q += 2 + o->nrefs;
  }
  atomic_store_explicit(&h->gen, e->gen, memory_order_release);
  e->nlay = no;
}

/* Writes job's description into the slot not holding the newest one:
 * text first, header last, so the newest valid slot is whole whenever
 * the process dies; then the step counts of that generation. */
shardd_err shardd__fdstore_sync_entry(shardd__fdstore *fs, fs_job *e) {
  char err[512];
  shardd__sb sb;
  shardd__sb_init(&sb);
  shardd__optim **opts;
  size_t no;
  shardd_err rc = build_text(fs, e->job, &sb, &opts, &no, err, sizeof err);
  if (rc == SHARDD_OK && sb.len > SLOT_TEXT_MAX) {
    snprintf(err, sizeof err, "%zu bytes of description, more than %zu",
             sb.len, (size_t)SLOT_TEXT_MAX);
    rc = SHARDD_E_LIMIT;
  }
  if (rc == SHARDD_OK) {
    int k = e->active == 0 ? 1 : 0;
    slot_hdr h;
    memset(&h, 0, sizeof h);
    memcpy(h.magic, SLOT_MAGIC, 8);
    h.gen = e->gen + 1;
    h.len = sb.len;
    h.crc = shardd__crc32c(0, sb.s, sb.len);
    /* the old header first invalidates this slot while its text changes */
    slot_hdr zero;
    memset(&zero, 0, sizeof zero);
    if (pwrite_all(e->fd[k], &zero, sizeof zero, 0) != 0 ||
        pwrite_all(e->fd[k], sb.s, sb.len, SLOT_TEXT_OFF) != 0 ||
        pwrite_all(e->fd[k], &h, sizeof h, 0) != 0) {
      snprintf(err, sizeof err, "writing its description: %s",
               strerror(errno));
      rc = SHARDD_E_IO;
    } else {
      e->gen = h.gen;
      e->active = k;
      e->dirty = 0;
      e->warned = 0;
      write_steps(e, opts, no);
    }
  }
  free(opts);
  shardd__sb_free(&sb);
  if (rc != SHARDD_OK && !e->warned) {
    e->warned = 1;
    shardd__log(1, "fd store: job \"%s\" not described (a restart would not "
                "resume it from the store): %s", e->job->name, err);
  }
  return rc;
}

static int keepable(shardd__fdstore *fs, shardd__job *job) {
  return job->nodes <= 1 &&
         !(fs->skip && fs->skip(fs->skip_arg, job));
}

/* job's entry, made when missing; a new job of a released one's name
 * takes the entry over (its description is rewritten). */
static fs_job *ensure(shardd__fdstore *fs, shardd__job *job) {
  char *key = shardd__fdstore_key_of(job->uid, job->name);
  if (key == NULL)
    return NULL;
  fs_job *e = shardd__map_get_str(&fs->jobs, key);
  if (e) {
    free(key);
    if (e->job != job) {
      e->job = job;
      e->dirty = 1;
    }
    return e;
  }
  if ((e = entry_new(fs, job, key)) == NULL)
    return NULL;
  if (shardd__map_put_str(&fs->jobs, e->key, e) != SHARDD_OK) {
    shardd__fdstore_entry_free(e, 1);
    return NULL;
  }
  return e;
}

static fs_job *find(const shardd__fdstore *fs, shardd__job *job) {
  char *key = shardd__fdstore_key_of(job->uid, job->name);
  fs_job *e = key ? shardd__map_get_str(&fs->jobs, key) : NULL;
  free(key);
  return e && e->job == job ? e : NULL;
}

static void scan_job(shardd__job *job, void *arg) {
  shardd__fdstore *fs = arg;
  if (!keepable(fs, job))
    return;
  fs_job *e = ensure(fs, job);
  if (e == NULL)
    return;
  e->seen = fs->epoch;
  if (e->dirty)
    shardd__fdstore_sync_entry(fs, e);
}

typedef struct {
  shardd__fdstore *fs;
  fs_job **gone;
  size_t n;
} gone_list;

static void collect_gone(void *value, void *arg) {
  gone_list *g = arg;
  fs_job *e = value;
  if (e->seen != g->fs->epoch) {
    fs_job **p = realloc(g->gone, (g->n + 1) * sizeof *p);
    if (p) {
      g->gone = p;
      g->gone[g->n++] = e;
    }
  }
}

static void drop_entry(shardd__fdstore *fs, fs_job *e) {
  shardd__map_del_str(&fs->jobs, e->key);
  shardd__fdstore_entry_free(e, 1);
}

/* Before the loop waits: every job touched since is described anew; a
 * job gone (released) leaves the store. */
static void on_prepare(uv_prepare_t *h) {
  shardd__fdstore *fs = h->data;
  if (!fs->touched || fs->closing)
    return;
  fs->touched = 0;
  fs->epoch++;
  shardd__registry_each_job(fs->reg, scan_job, fs);
  gone_list g = {fs, NULL, 0};
  shardd__map_each(&fs->jobs, collect_gone, &g);
  for (size_t i = 0; i < g.n; i++)
    drop_entry(fs, g.gone[i]);
  free(g.gone);
}

shardd_err shardd__fdstore_create(uv_loop_t *loop, shardd__registry *reg,
                                  int (*skip)(void *arg, shardd__job *job),
                                  void *skip_arg, shardd__fdstore **out) {
  shardd__fdstore *fs = calloc(1, sizeof *fs);
  *out = NULL;
  if (fs == NULL)
    return SHARDD_E_NO_MEMORY;
  fs->loop = loop;
  fs->reg = reg;
  fs->skip = skip;
  fs->skip_arg = skip_arg;
  shardd__map_init(&fs->jobs);
  shardd__map_init(&fs->held);
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  /* names unique to this start, as the backend's regions' */
  snprintf(fs->prefix, sizeof fs->prefix, "%" PRIx64 "-%x",
           (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec,
           (unsigned)getpid());
  const char *pause = getenv("SHARDD_TEST_STEP_PAUSE_MS");
  fs->pause_ms = pause ? (unsigned)strtoul(pause, NULL, 10) : 0;
  uv_prepare_init(loop, &fs->prep);
  fs->prep.data = fs;
  uv_prepare_start(&fs->prep, on_prepare);
  uv_unref((uv_handle_t *)&fs->prep); /* never keeps the loop alive */
  *out = fs;
  return SHARDD_OK;
}

void shardd__fdstore_touch(shardd__fdstore *fs, shardd__job *job) {
  if (fs == NULL)
    return;
  fs->touched = 1;
  if (job) {
    fs_job *e = find(fs, job);
    if (e)
      e->dirty = 1;
  }
}

void shardd__fdstore_job_gone(shardd__fdstore *fs, shardd__job *job) {
  if (fs == NULL || fs->closing)
    return; /* stopping: every job's description stays for the next start */
  fs_job *e = find(fs, job);
  if (e)
    drop_entry(fs, e);
}

void shardd__fdstore_step_begin(shardd__fdstore *fs, shardd__job *job,
                                shardd__optim *opt, uint64_t step) {
  if (fs == NULL || !keepable(fs, job))
    return;
  fs_job *e = ensure(fs, job);
  if (e == NULL)
    return;
  /* what the step starts from is described before it changes a byte */
  if (e->dirty)
    shardd__fdstore_sync_entry(fs, e);
  for (int i = 0; i < JRNL_RECS; i++) {
    if (e->rec_opt[i] != NULL)
      continue;
    e->rec_opt[i] = opt;
    snprintf(e->j->rec[i].name, sizeof e->j->rec[i].name, "%s",
             opt->hdr.name);
    /* the name before the mark (release), the mark before the first
     * update (the fence: the loop thread runs small steps' tasks itself,
     * and a release alone lets later stores move above it; the pool's
     * queue orders them for its threads) */
    atomic_store_explicit(&e->j->rec[i].step1, step + 1, memory_order_release);
    atomic_thread_fence(memory_order_seq_cst);
    if (fs->pause_ms)
      usleep(fs->pause_ms * 1000u);
    return;
  }
  atomic_fetch_add_explicit(&e->j->overflow, 1, memory_order_seq_cst);
  if (fs->pause_ms)
    usleep(fs->pause_ms * 1000u);
}

void shardd__fdstore_step_end(shardd__fdstore *fs, shardd__job *job,
                              shardd__optim *opt, uint64_t step,
                              shardd_err code) {
  (void)step;
  (void)code; /* a failed step's memory is what the daemon goes on with */
  if (fs == NULL)
    return;
  fs_job *e = find(fs, job);
  if (e == NULL)
    return;
  /* the new step counts committed first: only then is the mark cleared;
   * a description that could not be written leaves it (torn on a crash).
   * What a step changes of the description is its optimizer's step
   * counts (and, at its first, its shards' master_valid): those go into
   * the journal's counts in place, at a cost that does not grow with the
   * job's buffers; the description is rewritten whole only when the
   * job's structure changed since (dirty) or the layout does not hold
   * this optimizer. */
  size_t i = 0;
  while (i < e->nlay && e->lay_id[i] != opt->hdr.id)
    i++;
  if (!e->dirty && i < e->nlay && !e->lay_mv[i] &&
      e->lay_nrefs[i] == opt->nrefs) {
    uint64_t *q = (uint64_t *)((char *)e->j + e->lay_off[i]);
    q[0] = opt->steps;
    if (opt->nrefs)
      memcpy(q + 2, opt->ref_steps, opt->nrefs * sizeof *q);
  } else if (shardd__fdstore_sync_entry(fs, e) != SHARDD_OK) {
    return;
  }
  for (int r = 0; r < JRNL_RECS; r++) {
    if (e->rec_opt[r] == opt) {
      e->rec_opt[r] = NULL;
      atomic_store_explicit(&e->j->rec[r].step1, 0, memory_order_release);
      return;
    }
  }
  if (atomic_load(&e->j->overflow) > 0)
    atomic_fetch_sub_explicit(&e->j->overflow, 1, memory_order_release);
}

void shardd__fdstore_stop(shardd__fdstore *fs) {
  if (fs == NULL || fs->closing)
    return;
  /* steps still draining are described by their own hooks */
  on_prepare(&fs->prep);
  fs->closing = 1;
  uv_prepare_stop(&fs->prep);
  uv_close((uv_handle_t *)&fs->prep, NULL);
}

void shardd__fdstore_free_torn(torn *t) {
  for (size_t i = 0; i < t->nfds; i++) {
    close(t->fds[i].fd);
    free(t->names[i]);
  }
  free(t->fds);
  free(t->names);
  free(t->key);
  free(t->name);
  free(t->hint);
  free(t->why);
  free(t);
}

static void free_entry_cb(void *value, void *arg) {
  (void)arg;
  shardd__fdstore_entry_free(value, 0);
}

static void on_closed(uv_handle_t *h) { free(h->data); }

void shardd__fdstore_free(shardd__fdstore *fs) {
  if (fs == NULL)
    return;
  shardd__map_each(&fs->jobs, free_entry_cb, NULL);
  shardd__map_free(&fs->jobs);
  shardd__map_free(&fs->held);
  while (fs->torn) {
    torn *t = fs->torn;
    fs->torn = t->next;
    shardd__fdstore_free_torn(t);
  }
  if (fs->closing) { /* closed by stop, its callback run by the loop */
    free(fs);
    return;
  }
  /* the handle's memory must outlive its close: fs is freed by the close
   * callback */
  uv_prepare_stop(&fs->prep);
  uv_close((uv_handle_t *)&fs->prep, on_closed);
}
