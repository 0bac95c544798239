/* fdstore.c — owns the fd-store protocol's descriptions of jobs (the
 * metadata memfds and the step journal) and their adoption at start; see
 * fdstore.h. The regions' own FDSTORE/FDSTOREREMOVE are the backend's. */
#include "fdstore.h"

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

#define META_PREFIX "shardd-m"
#define SLOT_MAGIC "SHDMETA1"
#define JRNL_MAGIC "SHDJRNL1"
#define SLOT_TEXT_OFF 4096
#define JRNL_BYTES 4096
#define JRNL_RECS 31
/* region lines and the manifest: a slot's text is bounded as a manifest
 * is, twice over */
#define SLOT_TEXT_MAX (2 * SHARDD__MANIFEST_MAX)

typedef struct {
  char magic[8];
  uint64_t gen; /* 0: never written */
  uint64_t len;
  uint32_t crc;
  uint32_t pad;
} slot_hdr;

/* A step in progress: step1 is its step count + 1, 0 a free record. The
 * name is written first, step1 last (release), and cleared first. */
typedef struct {
  _Atomic uint64_t step1;
  char name[112];
} jrec;

typedef struct {
  char magic[8];
  /* steps in progress past the records (named by none) */
  _Atomic uint64_t overflow;
  jrec rec[JRNL_RECS];
} jrnl;

_Static_assert(sizeof(jrnl) <= JRNL_BYTES, "the journal fits its page");

typedef struct {
  char *key; /* "UID/NAME" */
  shardd__job *job;
  char base[64]; /* shardd-m<prefix>-<n>; the fds are BASE-a, -b, -j */
  int fd[3];     /* slot a, slot b, journal */
  jrnl *j;       /* fd[2] mapped */
  uint64_t gen;  /* of the newest slot written */
  int active;    /* that slot, -1 none */
  int dirty;
  uint64_t seen; /* the scan that last found its job */
  shardd__optim *rec_opt[JRNL_RECS];
  int warned; /* a description that could not be written was logged */
} fs_job;

typedef struct torn {
  struct torn *next;
  char *key, *name, *hint;
  uint64_t step;
  char opt[112];
  int anonymous; /* only the overflow counter says a step ran */
  /* not torn by a step: its description could not be adopted (why) */
  char *why;
  shardd__fdstore_fd *fds; /* its memory, kept in the store until forgotten */
  char **names;
  size_t nfds;
} torn;

struct shardd__fdstore {
  uv_loop_t *loop;
  shardd__registry *reg;
  int (*skip)(void *arg, shardd__job *job);
  void *skip_arg;
  uv_prepare_t prep;
  shardd__map jobs; /* key -> fs_job */
  shardd__map held; /* keys the store held at start */
  int touched;
  int closing; /* stop closed the handle: no scan, no removal from here */
  uint64_t epoch, next_id;
  char prefix[32];
  torn *torn;
  /* $SHARDD_TEST_STEP_PAUSE_MS, read once: tests hold each step this long
   * with its journal record set, to kill the daemon inside it; 0 (unset)
   * in production */
  unsigned pause_ms;
};

static char *key_of(uint32_t uid, const char *name) {
  shardd__sb sb;
  shardd__sb_init(&sb);
  shardd__sb_printf(&sb, "%" PRIu32 "/%s", uid, name);
  return shardd__sb_take(&sb);
}

static void store_fd(int fd, const char *name) {
  char state[128], err[256];
  if (!shardd__sd_fdname_valid(name)) { /* systemd would refuse it */
    shardd__log(1, "fd store: \"%s\" is no valid FDNAME; not stored", name);
    return;
  }
  snprintf(state, sizeof state, "FDSTORE=1\nFDNAME=%s", name);
  if (shardd__sd_notify_fd(state, fd, err, sizeof err) != SHARDD_OK)
    shardd__log(1, "fd store: %s not stored: %s", name, err);
}

static void unstore_fd(const char *name) {
  char state[128], err[256];
  snprintf(state, sizeof state, "FDSTOREREMOVE=1\nFDNAME=%s", name);
  if (shardd__sd_notify(state, err, sizeof err) != SHARDD_OK)
    shardd__log(1, "fd store: %s", err);
}

static void fd_name(const fs_job *e, int k, char *out, size_t len) {
  snprintf(out, len, "%s-%c", e->base, "abj"[k]);
}

static void entry_free(fs_job *e, int unstore) {
  if (e == NULL)
    return;
  for (int k = 0; k < 3; k++) {
    if (e->fd[k] < 0)
      continue;
    if (unstore) {
      char name[80];
      fd_name(e, k, name, sizeof name);
      unstore_fd(name);
    }
    close(e->fd[k]);
  }
  if (e->j)
    munmap(e->j, JRNL_BYTES);
  free(e->key);
  free(e);
}

static shardd_err map_journal(fs_job *e) {
  void *p = mmap(NULL, JRNL_BYTES, PROT_READ | PROT_WRITE, MAP_SHARED,
                 e->fd[2], 0);
  if (p == MAP_FAILED)
    return SHARDD_E_IO;
  e->j = p;
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
    fd_name(e, k, name, sizeof name);
    e->fd[k] = memfd_create(name, MFD_CLOEXEC);
    if (e->fd[k] < 0 ||
        ftruncate(e->fd[k], k == 2 ? JRNL_BYTES : SLOT_TEXT_OFF) != 0)
      goto fail;
  }
  if (map_journal(e) != SHARDD_OK)
    goto fail;
  memcpy(e->j->magic, JRNL_MAGIC, 8);
  for (int k = 0; k < 3; k++) {
    char name[80];
    fd_name(e, k, name, sizeof name);
    store_fd(e->fd[k], name);
  }
  return e;
fail:
  shardd__log(1, "fd store: job \"%s\": its description: %s", job->name,
              strerror(errno));
  entry_free(e, 0);
  return NULL;
}

/* The text a slot holds for job: its regions' store names, then its
 * manifest. SHARDD_E_INVAL (err says why) when a region is not stored. */
static shardd_err build_text(shardd__fdstore *fs, shardd__job *job,
                             shardd__sb *sb, char *err, size_t errlen) {
  shardd__buffer **bufs = NULL;
  shardd__optim **opts = NULL;
  size_t nb = 0, no = 0;
  shardd_err rc = SHARDD_E_NO_MEMORY;
  snprintf(err, errlen, "out of memory");
  if (shardd__job_buffers(job, &bufs, &nb) != SHARDD_OK ||
      shardd__job_optims(job, &opts, &no) != SHARDD_OK)
    goto done;
  for (size_t i = 0; i < nb; i++) {
    shardd__buffer *b = bufs[i];
    for (uint32_t r = job->local_first; r < job->local_first + job->local_ranks;
         r++) {
      const char *n = shardd__backend_region_store_name(b->blocks[r]);
      if (n == NULL) {
        snprintf(err, errlen, "buffer \"%s\" rank %" PRIu32 " is not in the "
                 "store", b->hdr.name, r);
        rc = SHARDD_E_INVAL;
        goto done;
      }
      shardd__sb_printf(sb, "region buffer ");
      shardd__manifest_enc_name(sb, b->hdr.name);
      shardd__sb_printf(sb, " %" PRIu32 " %s\n", r, n);
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
  free(opts);
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

/* Writes job's description into the slot not holding the newest one:
 * text first, header last, so the newest valid slot is whole whenever
 * the process dies. */
static shardd_err sync_entry(shardd__fdstore *fs, fs_job *e) {
  char err[512];
  shardd__sb sb;
  shardd__sb_init(&sb);
  shardd_err rc = build_text(fs, e->job, &sb, err, sizeof err);
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
    }
  }
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
  char *key = key_of(job->uid, job->name);
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
    entry_free(e, 1);
    return NULL;
  }
  return e;
}

static fs_job *find(const shardd__fdstore *fs, shardd__job *job) {
  char *key = key_of(job->uid, job->name);
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
    sync_entry(fs, e);
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
  entry_free(e, 1);
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
    sync_entry(fs, e);
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
  /* the new step count described first: only then is the mark cleared;
   * a description that could not be written leaves it (torn on a crash) */
  if (sync_entry(fs, e) != SHARDD_OK)
    return;
  for (int i = 0; i < JRNL_RECS; i++) {
    if (e->rec_opt[i] == opt) {
      e->rec_opt[i] = NULL;
      atomic_store_explicit(&e->j->rec[i].step1, 0, memory_order_release);
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

static void free_torn(torn *t) {
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
  entry_free(value, 0);
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
    free_torn(t);
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

/* ---- adopt ------------------------------------------------------------- */

typedef struct {
  shardd__fdstore_fd *fds;
  size_t n;
  /* [n]: 1 a region swapped in (through a descriptor of its own), 2 a
   * description's, owned by its entry */
  uint8_t *taken;
  uint8_t *kept;  /* [n]: kept open for a torn job */
} pool;

static ssize_t pool_find(const pool *p, const char *name) {
  for (size_t i = 0; i < p->n; i++)
    if (!p->taken[i] && !p->kept[i] && strcmp(p->fds[i].name, name) == 0)
      return (ssize_t)i;
  return -1;
}

/* Reads slot fd's text (malloc'd, NUL-ended) when its header is whole and
 * its CRC holds; NULL otherwise. */
static char *read_slot(int fd, uint64_t *gen, size_t *len) {
  slot_hdr h;
  if (fd < 0 || pread(fd, &h, sizeof h, 0) != (ssize_t)sizeof h ||
      memcmp(h.magic, SLOT_MAGIC, 8) != 0 || h.gen == 0 ||
      h.len > SLOT_TEXT_MAX)
    return NULL;
  char *t = malloc(h.len + 1);
  if (t == NULL || pread(fd, t, h.len, SLOT_TEXT_OFF) != (ssize_t)h.len ||
      shardd__crc32c(0, t, h.len) != h.crc) {
    free(t);
    return NULL;
  }
  t[h.len] = '\0';
  *gen = h.gen;
  *len = h.len;
  return t;
}

/* The job line of the manifest in text: name (decoded) and uid. */
static int job_of(const char *manifest, char *name, size_t len,
                  uint32_t *uid) {
  const char *p = strstr(manifest, "\njob ");
  char tok[1024];
  unsigned world, u;
  if (p == NULL || sscanf(p + 5, "%1023s %u %u", tok, &world, &u) != 3 ||
      !shardd__manifest_dec_name(tok) || strlen(tok) >= len)
    return 0;
  memcpy(name, tok, strlen(tok) + 1);
  *uid = u;
  return 1;
}

/* Puts the adopted memfd named store_name in place of *slot (a region
 * apply made, of the same size), which is freed. */
static shardd_err swap_in(shardd__fdstore *fs, pool *p, shardd__region **slot,
                          const char *store_name, char *err, size_t errlen) {
  shardd__backend *be = fs->reg->backend;
  ssize_t i = pool_find(p, store_name);
  if (i < 0) {
    snprintf(err, errlen, "region %s was not handed back", store_name);
    return SHARDD_E_NOT_FOUND;
  }
  struct stat st;
  if (fstat(p->fds[i].fd, &st) != 0 || (size_t)st.st_size != (*slot)->bytes) {
    snprintf(err, errlen, "region %s holds %jd bytes, not %zu", store_name,
             (intmax_t)st.st_size, (*slot)->bytes);
    return SHARDD_E_MISMATCH;
  }
  int dup_fd = fcntl(p->fds[i].fd, F_DUPFD_CLOEXEC, 0);
  shardd__region *nr;
  shardd_err rc = dup_fd < 0 ? SHARDD_E_IO
                             : be->ops->wrap_fd(be, (*slot)->device, dup_fd,
                                                store_name, &nr, err, errlen);
  if (rc != SHARDD_OK)
    return rc;
  be->ops->free(be, *slot);
  *slot = nr;
  p->taken[i] = 1;
  return SHARDD_OK;
}

/* The region lines of text (up to "manifest"), each swapped in. */
static shardd_err swap_regions(shardd__fdstore *fs, pool *p, shardd__job *job,
                               char *text, char *err, size_t errlen) {
  char *save = NULL;
  for (char *line = strtok_r(text, "\n", &save); line;
       line = strtok_r(NULL, "\n", &save)) {
    if (strcmp(line, "manifest") == 0)
      return SHARDD_OK;
    char *tok[8];
    int nt = shardd__manifest_split_words(line, tok);
    shardd_err rc;
    if (nt == 5 && !strcmp(tok[0], "region") && !strcmp(tok[1], "buffer") &&
        shardd__manifest_dec_name(tok[2])) {
      shardd__buffer *b = shardd__map_get_str(&job->buffers, tok[2]);
      uint32_t r = (uint32_t)strtoul(tok[3], NULL, 10);
      if (b == NULL || !shardd__job_rank_local(job, r) || r >= job->world ||
          b->blocks[r] == NULL) {
        snprintf(err, errlen, "a region of buffer \"%s\" rank %s the "
                 "manifest does not have", tok[2], tok[3]);
        return SHARDD_E_INVAL;
      }
      rc = swap_in(fs, p, &b->blocks[r], tok[4], err, errlen);
    } else if (nt == 6 && !strcmp(tok[0], "region") &&
               !strcmp(tok[1], "state") && shardd__manifest_dec_name(tok[2]) &&
               shardd__manifest_dec_name(tok[3])) {
      shardd__optim *o = shardd__optim_find(job, tok[2]);
      shardd__buffer *b = shardd__map_get_str(&job->buffers, tok[3]);
      uint32_t r = (uint32_t)strtoul(tok[4], NULL, 10);
      shardd__optim_shard *sh = NULL;
      for (size_t k = 0; o && k < o->nshards && !sh; k++)
        if (o->shards[k].buf == b && o->shards[k].rank == r)
          sh = &o->shards[k];
      if (sh == NULL || sh->state == NULL) {
        snprintf(err, errlen, "a state region of optimizer \"%s\" the "
                 "manifest does not have", tok[2]);
        return SHARDD_E_INVAL;
      }
      rc = swap_in(fs, p, &sh->state, tok[5], err, errlen);
    } else {
      snprintf(err, errlen, "a malformed region line");
      return SHARDD_E_INVAL;
    }
    if (rc != SHARDD_OK)
      return rc;
  }
  snprintf(err, errlen, "no manifest");
  return SHARDD_E_INVAL;
}

/* How far job got: the most steps one of its optimizers took. */
static uint64_t job_step(shardd__job *job) {
  shardd__optim **opts;
  size_t no;
  uint64_t s = 0;
  if (shardd__job_optims(job, &opts, &no) != SHARDD_OK)
    return 0;
  for (size_t i = 0; i < no; i++)
    if (opts[i]->steps > s)
      s = opts[i]->steps;
  free(opts);
  return s;
}

/* Keeps the fds of a torn job open, in the store, until it is forgotten:
 * the description's three and every region its text names. */
static void keep_torn(shardd__fdstore *fs, pool *p, const char *base,
                      const char *text, torn *t) {
  for (size_t i = 0; i < p->n; i++) {
    const char *n = p->fds[i].name;
    int mine = strncmp(n, base, strlen(base)) == 0 &&
               strlen(n) == strlen(base) + 2;
    if (!mine && !p->taken[i] && !p->kept[i]) {
      /* a region its text names: " NAME\n" */
      const char *hit = strstr(text, n);
      size_t l = strlen(n);
      mine = hit && hit > text && hit[-1] == ' ' && hit[l] == '\n';
    }
    if (!mine || p->taken[i] || p->kept[i])
      continue;
    shardd__fdstore_fd *nf = realloc(t->fds, (t->nfds + 1) * sizeof *nf);
    char **nn = nf ? realloc(t->names, (t->nfds + 1) * sizeof *nn) : NULL;
    if (nf)
      t->fds = nf;
    if (nn)
      t->names = nn;
    char *dup = nn ? strdup(n) : NULL;
    if (dup == NULL)
      continue; /* closed and removed with the unused: the memory goes */
    t->fds[t->nfds] = (shardd__fdstore_fd){p->fds[i].fd, dup};
    t->names[t->nfds++] = dup;
    p->kept[i] = 1;
  }
  (void)fs;
}

/* Marks uid's job jname torn (why NULL: killed in step in_step of
 * optimizer in_opt, 0 an unnamed one; else its description could not be
 * adopted, for that reason), keeping its fds in the store. */
static void add_torn(shardd__fdstore *fs, pool *p, const char *base,
                     const char *text, uint32_t uid, const char *jname,
                     uint64_t in_step, const char *in_opt, const char *why) {
  torn *tn = calloc(1, sizeof *tn);
  if (tn && (tn->key = key_of(uid, jname)) && (tn->name = strdup(jname)) &&
      (why == NULL || (tn->why = strdup(why)))) {
    tn->step = in_step;
    tn->anonymous = in_step == 0;
    snprintf(tn->opt, sizeof tn->opt, "%s", in_opt ? in_opt : "");
    keep_torn(fs, p, base, text, tn);
    tn->next = fs->torn;
    fs->torn = tn;
  } else if (tn) {
    free(tn->key);
    free(tn->name);
    free(tn);
  }
}

/* One job's description (its three fds, any of them missing): adopted,
 * torn or refused. 0 adopted, 1 refused (logged). */
static int adopt_one(shardd__fdstore *fs, pool *p, const char *base,
                     void (*adopted)(void *, shardd__job *, uint64_t),
                     void *arg) {
  char name[80], err[1024];
  ssize_t idx[3];
  for (int k = 0; k < 3; k++) {
    snprintf(name, sizeof name, "%s-%c", base, "abj"[k]);
    idx[k] = pool_find(p, name);
  }
  uint64_t gen[2] = {0, 0};
  size_t len[2] = {0, 0};
  char *text[2] = {NULL, NULL};
  for (int k = 0; k < 2; k++)
    if (idx[k] >= 0)
      text[k] = read_slot(p->fds[idx[k]].fd, &gen[k], &len[k]);
  int k = text[0] && (!text[1] || gen[0] > gen[1]) ? 0 : 1;
  char *t = text[k];
  free(text[1 - k]);
  if (t == NULL || idx[2] < 0) {
    shardd__log(0, "fd store: description %s: %s; its job is not resumed",
                base, idx[2] < 0 ? "no step journal" : "no whole slot");
    free(t);
    return 1;
  }
  const char *manifest = strstr(t, "\nmanifest\n");
  manifest = manifest ? manifest + 10
                      : (strncmp(t, "manifest\n", 9) == 0 ? t + 9 : NULL);
  char jname[256];
  uint32_t uid = 0;
  if (manifest == NULL || !job_of(manifest, jname, sizeof jname, &uid)) {
    shardd__log(0, "fd store: description %s: no job line; not resumed", base);
    free(t);
    return 1;
  }
  char *key = key_of(uid, jname);
  if (key) /* the map copies its keys; any non-NULL value marks one */
    shardd__map_put_str(&fs->held, key, fs);
  free(key);

  /* the journal: a step in progress makes the job torn */
  const jrnl *j = mmap(NULL, JRNL_BYTES, PROT_READ, MAP_SHARED,
                       p->fds[idx[2]].fd, 0);
  uint64_t in_step = 0, overflow = 0;
  char in_opt[112] = "";
  if (j != MAP_FAILED) {
    overflow = atomic_load(&j->overflow);
    for (int i = 0; i < JRNL_RECS && in_step == 0; i++) {
      uint64_t s1 = atomic_load_explicit(&j->rec[i].step1, memory_order_acquire);
      if (s1) {
        in_step = s1 - 1;
        memcpy(in_opt, j->rec[i].name, sizeof in_opt);
        in_opt[sizeof in_opt - 1] = '\0';
      }
    }
    munmap((void *)j, JRNL_BYTES);
  }
  if (in_step || overflow) {
    add_torn(fs, p, base, t, uid, jname, in_step, in_opt, NULL);
    if (in_step)
      shardd__log(0, "fd store: job \"%s\" (uid %" PRIu32 ") is torn: the "
                  "daemon died during step %" PRIu64 " of optimizer \"%s\", "
                  "and its memory may hold half of it; not resumed, and "
                  "every attach is refused until it is released (shardctl "
                  "release) or restored from a checkpoint", jname, uid,
                  in_step, in_opt);
    else
      shardd__log(0, "fd store: job \"%s\" (uid %" PRIu32 ") is torn: the "
                  "daemon died during one of its steps; not resumed", jname,
                  uid);
    free(t);
    return 1;
  }

  /* rebuilt through the restore's apply, then the memory swapped in */
  shardd__ckrestore *r = NULL;
  char label[300];
  snprintf(label, sizeof label, "fd store %s", base);
  shardd_err rc = shardd__checkpoint_restore_read_text(
      fs->reg, label, manifest, strlen(manifest), &r, err, sizeof err);
  if (rc == SHARDD_OK)
    rc = shardd__checkpoint_restore_apply(r, err, sizeof err);
  shardd__job *job = NULL;
  if (rc == SHARDD_OK) {
    job = shardd__checkpoint_restore_finish(r);
    rc = swap_regions(fs, p, job, t, err, sizeof err);
    if (rc != SHARDD_OK) {
      shardd__job_release(fs->reg, job);
      job = NULL;
    }
  }
  shardd__checkpoint_restore_free(r);
  if (rc != SHARDD_OK) {
    /* refused as a torn job is: a relaunch must not start it afresh in
     * silence (a kill between a buffer's free and its description's
     * rewrite leaves a description naming memory no longer stored) */
    shardd__log(0, "fd store: job \"%s\" (uid %" PRIu32 ") not resumed: %s; "
                "every attach is refused until it is released (shardctl "
                "release) or restored from a checkpoint", jname, uid, err);
    add_torn(fs, p, base, t, uid, jname, 0, NULL, err);
    free(t);
    return 1;
  }
  free(t);
  /* the description goes on in the same three memfds */
  fs_job *e = calloc(1, sizeof *e);
  char *ekey = key_of(uid, jname);
  if (e && ekey && shardd__map_put_str(&fs->jobs, ekey, e) == SHARDD_OK) {
    e->key = ekey;
    e->job = job;
    snprintf(e->base, sizeof e->base, "%s", base);
    for (int q = 0; q < 3; q++) {
      e->fd[q] = idx[q] >= 0 ? p->fds[idx[q]].fd : -1;
      if (idx[q] >= 0)
        p->taken[idx[q]] = 2; /* the entry's own from here */
    }
    if (e->fd[1 - k] < 0) { /* a slot lost: a new one, stored */
      fd_name(e, 1 - k, name, sizeof name);
      e->fd[1 - k] = memfd_create(name, MFD_CLOEXEC);
      if (e->fd[1 - k] >= 0)
        store_fd(e->fd[1 - k], name);
    }
    e->gen = gen[k];
    e->active = k;
    e->dirty = 1;
    if (e->fd[1 - k] < 0 || map_journal(e) != SHARDD_OK) {
      shardd__map_del_str(&fs->jobs, e->key);
      entry_free(e, 0);
    } else {
      sync_entry(fs, e); /* the new generations of its handles */
    }
  } else {
    free(e);
    free(ekey);
  }
  adopted(arg, job, job_step(job));
  return 0;
}

int shardd__fdstore_adopt(shardd__fdstore *fs, shardd__fdstore_fd *fds,
                          size_t n,
                          void (*adopted)(void *arg, shardd__job *job,
                                          uint64_t step),
                          void *arg) {
  pool p = {fds, n, calloc(n ? n : 1, 1), calloc(n ? n : 1, 1)};
  int refused = 0;
  if (p.taken == NULL || p.kept == NULL) {
    shardd__log(0, "fd store: out of memory adopting %zu descriptors", n);
    refused = 1;
    n = 0;
  }
  for (size_t i = 0; i < n; i++) {
    const char *nm = fds[i].name;
    size_t l = strlen(nm);
    /* each description once, by its journal */
    if (p.taken[i] || p.kept[i] || strncmp(nm, META_PREFIX, 8) != 0 || l < 3 ||
        strcmp(nm + l - 2, "-j") != 0)
      continue;
    char base[80];
    if (l - 2 >= sizeof base)
      continue;
    memcpy(base, nm, l - 2);
    base[l - 2] = '\0';
    refused += adopt_one(fs, &p, base, adopted, arg);
  }
  /* what no job took: out of the store; a region taken is mapped through
   * a descriptor of its own, so the one handed back is closed too */
  size_t dropped = 0;
  for (size_t i = 0; i < p.n; i++) {
    if (p.taken && p.kept && (p.taken[i] == 2 || p.kept[i]))
      continue;
    if (p.taken && !p.taken[i]) {
      unstore_fd(fds[i].name);
      dropped++;
    }
    close(fds[i].fd);
  }
  if (dropped)
    shardd__log(2, "fd store: %zu descriptor%s no job holds removed", dropped,
                dropped == 1 ? "" : "s");
  free(p.taken);
  free(p.kept);
  return refused;
}

int shardd__fdstore_held(const shardd__fdstore *fs, uint32_t uid,
                         const char *name) {
  char *key = key_of(uid, name);
  int held = key && shardd__map_get_str(&fs->held, key) != NULL;
  free(key);
  return held;
}

static torn *find_torn(const shardd__fdstore *fs, uint32_t uid,
                       const char *name) {
  for (torn *t = fs->torn; t; t = t->next)
    if (!strcmp(t->name, name) &&
        strtoul(t->key, NULL, 10) == (unsigned long)uid)
      return t;
  return NULL;
}

void shardd__fdstore_set_hint(shardd__fdstore *fs, uint32_t uid,
                              const char *name, const char *checkpoint) {
  torn *t = find_torn(fs, uid, name);
  if (t) {
    free(t->hint);
    t->hint = checkpoint ? strdup(checkpoint) : NULL;
  }
}

int shardd__fdstore_torn(const shardd__fdstore *fs, uint32_t uid,
                         const char *name, char *msg, size_t len) {
  const torn *t = fs ? find_torn(fs, uid, name) : NULL;
  if (t == NULL)
    return 0;
  char where[4200];
  if (t->hint)
    snprintf(where, sizeof where, "its newest checkpoint is %s: `shardctl "
             "release %s` then `shardctl restore %s`", t->hint, name, t->hint);
  else
    snprintf(where, sizeof where, "no checkpoint of it is known to this "
             "daemon: restore one you wrote after `shardctl release %s`, or "
             "release it to start afresh", name);
  if (t->why)
    snprintf(msg, len, "job \"%s\" could not be resumed from the fd store "
             "(%s); not resumed. %s", name, t->why, where);
  else if (t->anonymous)
    snprintf(msg, len, "job \"%s\" is torn: the daemon died during one of "
             "its steps, and its memory may hold half of it; not resumed. %s",
             name, where);
  else
    snprintf(msg, len, "job \"%s\" is torn: the daemon died during step %"
             PRIu64 " of optimizer \"%s\", and its memory may hold half of "
             "that step; not resumed. %s", name, t->step, t->opt, where);
  return 1;
}

int shardd__fdstore_forget_torn(shardd__fdstore *fs, uint32_t uid,
                                const char *name) {
  if (fs == NULL)
    return 0;
  for (torn **pp = &fs->torn; *pp; pp = &(*pp)->next) {
    torn *t = *pp;
    if (strcmp(t->name, name) || strtoul(t->key, NULL, 10) != (unsigned long)uid)
      continue;
    *pp = t->next;
    for (size_t i = 0; i < t->nfds; i++)
      unstore_fd(t->names[i]);
    shardd__log(2, "fd store: torn job \"%s\" released; its memory is out of "
                "the store", name);
    free_torn(t);
    return 1;
  }
  return 0;
}
