/* backend_host.c — the host backend: each virtual device is an arena of
 * memfd regions with a byte capacity. Regions are sealed against resizing
 * (a client holding the fd cannot shrink memory the daemon has mapped) and
 * mapped shared by the daemon and by the clients they are handed to. */
#include "backend.h"

#include <errno.h>
#include <inttypes.h>
#include <sys/stat.h>
#include <time.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "dtype.h"
#include "log.h"
#include "reduce.h"
#include "sdnotify.h"

typedef struct {
  pthread_mutex_t lock;
  uint64_t capacity;
  uint64_t *used; /* per device */
  uint64_t *peak; /* per device: the high-water of used */
  uint64_t *allocs; /* per device: regions allocated */
  /* SHARDD__PERSIST_*: read by alloc and free, set on the loop thread
   * while no region is being allocated or freed */
  int persist;
  /* names given to regions in the fd store: prefix (unique to this
   * process's start) and a counter, under lock */
  char store_prefix[32];
  uint64_t stored;
} host_priv;

/* Hands memfd fd (bytes long) to the service manager's fd store under a
 * name of its own, returned (malloc'd; NULL: not stored). A refusal costs
 * the region its survival of a restart, not its use: logged. */
static char *store_fd(host_priv *hp, int fd, size_t bytes) {
  char name[64], state[128], err[256];
  pthread_mutex_lock(&hp->lock);
  uint64_t n = ++hp->stored;
  pthread_mutex_unlock(&hp->lock);
  snprintf(name, sizeof name, "%s%s-%" PRIx64, SHARDD__STORE_REGION_PREFIX,
           hp->store_prefix, n);
  snprintf(state, sizeof state, "FDSTORE=1\nFDNAME=%s", name);
  if (!shardd__sd_fdname_valid(name))
    snprintf(err, sizeof err, "\"%s\" is no valid FDNAME", name);
  if (!shardd__sd_fdname_valid(name) ||
      shardd__sd_notify_fd(state, fd, err, sizeof err) != SHARDD_OK) {
    shardd__log(1, "fd store: region of %zu bytes not stored (it will not "
                "outlive this daemon): %s", bytes, err);
    return NULL;
  }
  return strdup(name);
}

static void store_region(host_priv *hp, shardd__region *r) {
  r->priv = store_fd(hp, r->fd, r->bytes);
}

/* Takes name out of the fd store (while persisting) and frees it. */
static void unstore_name(host_priv *hp, char *name) {
  char state[128], err[256];
  if (name == NULL)
    return;
  if (hp->persist == SHARDD__PERSIST_ON) {
    snprintf(state, sizeof state, "FDSTOREREMOVE=1\nFDNAME=%s", name);
    if (shardd__sd_notify(state, err, sizeof err) != SHARDD_OK)
      shardd__log(1, "fd store: %s", err);
  }
  free(name);
}

static void unstore_region(host_priv *hp, shardd__region *r) {
  unstore_name(hp, r->priv);
  r->priv = NULL;
}

/* A memfd is made mode 0777, and whoever holds a descriptor of it may
 * open /proc/self/fd/N anew with any access the mode allows: a trainer
 * handed the node's gathered copy read-only (host_export_fd_ro) reopened
 * it for writing and changed what every other local rank reads. Readable
 * by the daemon's uid only, a reopen for writing fails for every other
 * uid and for the daemon's own when it runs as user shardd (root's
 * capabilities pass any mode); the daemon's own read-only reopen (as
 * user shardd: the owner's read bit) still works, and descriptors already
 * open keep their access. */
#define MEMFD_MODE S_IRUSR

static size_t page_round(size_t n) {
  size_t pg = (size_t)sysconf(_SC_PAGESIZE);
  return (n + pg - 1) / pg * pg;
}

/* A memfd of sz bytes (mode MEMFD_MODE), sealed against resizing when
 * seal, mapped shared at *p. */
static shardd_err memfd_make(const char *label, size_t sz, int seal, int *fdp,
                             void **p, char *err, size_t errlen) {
  shardd_err rc = SHARDD_E_NO_MEMORY;
  int fd = memfd_create(label ? label : "shardd", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  *fdp = -1;
  if (fd < 0) {
    /* Out of descriptors is a limit of the process, not of memory. */
    if (errno == EMFILE || errno == ENFILE)
      rc = SHARDD_E_LIMIT;
    snprintf(err, errlen, "memfd_create: %s%s", strerror(errno),
             rc == SHARDD_E_LIMIT ? " (raise LimitNOFILE / ulimit -n)" : "");
    return rc;
  }
  if (fchmod(fd, MEMFD_MODE) != 0) {
    snprintf(err, errlen, "memfd mode: %s", strerror(errno));
    goto fail;
  }
  if (ftruncate(fd, (off_t)sz) != 0) {
    snprintf(err, errlen, "ftruncate %zu: %s", sz, strerror(errno));
    goto fail;
  }
  if (seal &&
      fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
    snprintf(err, errlen, "memfd seal: %s", strerror(errno));
    goto fail;
  }
  *p = mmap(NULL, sz, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (*p == MAP_FAILED) {
    snprintf(err, errlen, "mmap %zu: %s", sz, strerror(errno));
    goto fail;
  }
  *fdp = fd;
  return SHARDD_OK;
fail:
  close(fd);
  return rc;
}

/* Counts sz more bytes used on device when they fit its capacity; else
 * err says what is free. */
static shardd_err use_bytes(host_priv *hp, int device, size_t sz, char *err,
                            size_t errlen) {
  pthread_mutex_lock(&hp->lock);
  uint64_t used = hp->used[device];
  int fits = sz <= hp->capacity && used <= hp->capacity - sz;
  if (fits) {
    hp->used[device] += sz;
    hp->allocs[device]++;
    if (hp->used[device] > hp->peak[device])
      hp->peak[device] = hp->used[device];
  }
  pthread_mutex_unlock(&hp->lock);
  if (fits)
    return SHARDD_OK;
  snprintf(err, errlen,
           "device %d: %zu bytes requested, %llu of %llu bytes free", device,
           sz, (unsigned long long)(hp->capacity - used),
           (unsigned long long)hp->capacity);
  return SHARDD_E_NO_MEMORY;
}

static void unuse_bytes(host_priv *hp, int device, size_t sz) {
  pthread_mutex_lock(&hp->lock);
  hp->used[device] -= sz;
  pthread_mutex_unlock(&hp->lock);
}

/* exportable: a sealed memfd a client can map; else anonymous memory that
 * costs no descriptor (optimizer state never leaves the daemon). */
static shardd_err host_alloc_impl(shardd__backend *b, int device, size_t bytes,
                                  const char *label, int exportable,
                                  shardd__region **out, char *err,
                                  size_t errlen) {
  host_priv *hp = b->priv;
  *out = NULL;
  if (device < 0 || device >= b->ndevices) {
    snprintf(err, errlen, "no device %d (host backend has %d)", device,
             b->ndevices);
    return SHARDD_E_INVAL;
  }
  size_t sz = page_round(bytes ? bytes : 1);
  shardd_err rc = use_bytes(hp, device, sz, err, errlen);
  if (rc != SHARDD_OK)
    return rc;
  rc = SHARDD_E_NO_MEMORY;
  shardd__region *r = calloc(1, sizeof *r);
  int fd = -1;
  /* kept across a restart, optimizer state must live in a memfd too */
  if (hp->persist == SHARDD__PERSIST_ON)
    exportable = 1;
  if (r != NULL && !exportable) {
    void *p = mmap(NULL, sz, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) {
      snprintf(err, errlen, "mmap %zu: %s", sz, strerror(errno));
      goto fail;
    }
    r->device = device;
    r->bytes = sz;
    r->ptr = p;
    r->fd = -1;
    *out = r;
    return SHARDD_OK;
  }
  if (r == NULL) {
    snprintf(err, errlen, "out of memory");
    goto fail;
  }
  void *p;
  if ((rc = memfd_make(label, sz, 1, &fd, &p, err, errlen)) != SHARDD_OK)
    goto fail;
  r->device = device;
  r->bytes = sz;
  r->ptr = p;
  r->fd = fd;
  if (hp->persist == SHARDD__PERSIST_ON)
    store_region(hp, r);
  *out = r;
  return SHARDD_OK;

fail:
  if (fd >= 0)
    close(fd);
  free(r);
  unuse_bytes(hp, device, sz);
  return rc;
}

static shardd_err host_alloc(shardd__backend *b, int device, size_t bytes,
                             const char *label, shardd__region **out,
                             char *err, size_t errlen) {
  return host_alloc_impl(b, device, bytes, label, 1, out, err, errlen);
}

static shardd_err host_alloc_private(shardd__backend *b, int device,
                                     size_t bytes, const char *label,
                                     shardd__region **out, char *err,
                                     size_t errlen) {
  return host_alloc_impl(b, device, bytes, label, 0, out, err, errlen);
}

/* ---- slabs (backend.h) ------------------------------------------------ */

struct shardd__slab {
  int fd;
  int device;
  void *base;     /* the daemon's mapping of the whole file: cap bytes */
  size_t cap;     /* bytes mapped; the file's size once closed */
  size_t next;    /* where the next block starts */
  size_t charged; /* bytes counted used on device for it */
  size_t live;    /* its blocks not freed */
  int open;       /* blocks may still be taken; not sealed yet */
  char *store_name; /* in the fd store; NULL none */
};

/* s's last block went (or none was taken): its file leaves the store and
 * is closed, its bytes given back. */
static void slab_drop(host_priv *hp, shardd__slab *s) {
  unstore_name(hp, s->store_name);
  munmap(s->base, s->cap);
  close(s->fd);
  unuse_bytes(hp, s->device, s->charged);
  free(s);
}

static shardd_err host_slab_open(shardd__backend *b, int device,
                                 uint64_t bytes, size_t nblocks,
                                 const char *label, shardd__slab **out,
                                 char *err, size_t errlen) {
  *out = NULL;
  if (device < 0 || device >= b->ndevices) {
    snprintf(err, errlen, "no device %d (host backend has %d)", device,
             b->ndevices);
    return SHARDD_E_INVAL;
  }
  size_t pg = (size_t)sysconf(_SC_PAGESIZE);
  /* each block starts on a page: room for each one's rounding */
  if (nblocks == 0 || nblocks > SIZE_MAX / pg || bytes > SIZE_MAX / 2 ||
      (size_t)bytes > SIZE_MAX / 2 - nblocks * pg) {
    snprintf(err, errlen, "a slab of %zu blocks, %" PRIu64 " bytes", nblocks,
             bytes);
    return SHARDD_E_RANGE;
  }
  shardd__slab *s = calloc(1, sizeof *s);
  if (s == NULL) {
    snprintf(err, errlen, "out of memory");
    return SHARDD_E_NO_MEMORY;
  }
  s->cap = page_round((size_t)bytes + nblocks * (pg - 1));
  shardd_err rc = memfd_make(label, s->cap, 0, &s->fd, &s->base, err, errlen);
  if (rc != SHARDD_OK) {
    free(s);
    return rc;
  }
  s->device = device;
  s->open = 1;
  *out = s;
  return SHARDD_OK;
}

static shardd_err host_slab_take(shardd__backend *b, shardd__slab *s,
                                 size_t bytes, shardd__region **out, char *err,
                                 size_t errlen) {
  host_priv *hp = b->priv;
  size_t sz = page_round(bytes ? bytes : 1);
  *out = NULL;
  if (!s->open || sz > s->cap - s->next) {
    snprintf(err, errlen, "a block of %zu bytes past its slab's %zu (%zu "
             "taken)%s", sz, s->cap, s->next, s->open ? "" : ", closed");
    return SHARDD_E_INTERNAL;
  }
  shardd_err rc = use_bytes(hp, s->device, sz, err, errlen);
  if (rc != SHARDD_OK)
    return rc;
  shardd__region *r = calloc(1, sizeof *r);
  if (r == NULL) {
    unuse_bytes(hp, s->device, sz);
    snprintf(err, errlen, "out of memory");
    return SHARDD_E_NO_MEMORY;
  }
  r->device = s->device;
  r->bytes = sz;
  r->ptr = (char *)s->base + s->next;
  r->fd = s->fd;
  r->off = s->next;
  r->slab = s;
  s->next += sz;
  s->charged += sz;
  s->live++;
  *out = r;
  return SHARDD_OK;
}

static shardd_err host_slab_close(shardd__backend *b, shardd__slab *s,
                                  char *err, size_t errlen) {
  host_priv *hp = b->priv;
  shardd_err rc = SHARDD_OK;
  s->open = 0;
  if (s->live == 0) {
    slab_drop(hp, s);
    return SHARDD_OK;
  }
  /* the room no block took goes, so the file holds this rank's blocks
   * and nothing a client could map beyond them */
  if (s->next < s->cap) {
    munmap((char *)s->base + s->next, s->cap - s->next);
    s->cap = s->next;
    if (ftruncate(s->fd, (off_t)s->next) != 0) {
      snprintf(err, errlen, "cutting a slab to %zu bytes: %s", s->next,
               strerror(errno));
      rc = SHARDD_E_IO;
    }
  }
  if (rc == SHARDD_OK &&
      fcntl(s->fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
    snprintf(err, errlen, "memfd seal: %s", strerror(errno));
    rc = SHARDD_E_IO;
  }
  if (rc == SHARDD_OK && hp->persist == SHARDD__PERSIST_ON)
    s->store_name = store_fd(hp, s->fd, s->cap);
  return rc;
}

/* A block of a slab freed: its pages punched out (the daemon's mapping
 * of the file stays whole until the slab goes, so no other mapping can
 * land inside it). While the slab is open nobody else holds its
 * descriptor, and the bytes are given back at once; once handed out,
 * they stay counted until the slab's last block goes. */
static void slab_block_free(host_priv *hp, shardd__region *r) {
  shardd__slab *s = r->slab;
  if (hp->persist != SHARDD__PERSIST_DETACHED &&
      fallocate(s->fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE,
                (off_t)r->off, (off_t)r->bytes) != 0)
    shardd__log(1, "freeing a block: punching out its %zu bytes: %s",
                r->bytes, strerror(errno));
  if (s->open) {
    s->charged -= r->bytes;
    unuse_bytes(hp, s->device, r->bytes);
  }
  s->live--;
  free(r);
  if (s->live == 0 && !s->open)
    slab_drop(hp, s);
}

void shardd__backend_region_taken(const shardd__region *r, uint64_t *bytes,
                                  int *fds) {
  *bytes = r->bytes;
  *fds = r->slab ? r->slab->live == 1 : 1;
}

void shardd__backend_region_gives(const shardd__region *r, uint64_t *bytes,
                                  int *fds) {
  const shardd__slab *s = r->slab;
  if (s == NULL || s->open) {
    *bytes = r->bytes;
    *fds = s ? s->live == 1 : 1;
  } else {
    *bytes = s->live == 1 ? s->charged : 0;
    *fds = s->live == 1;
  }
}

/* Whether fd, a memfd a previous daemon stored under store_name, can be
 * adopted on device: *st its stat; its mode made MEMFD_MODE. */
static int stored_file_ok(shardd__backend *b, int device, int fd,
                          const char *store_name, struct stat *st, char *err,
                          size_t errlen) {
  if (device < 0 || device >= b->ndevices) {
    snprintf(err, errlen, "no device %d (host backend has %d)", device,
             b->ndevices);
    return 0;
  }
  if (fstat(fd, st) != 0 || !S_ISREG(st->st_mode) || st->st_size <= 0) {
    snprintf(err, errlen, "%s: not a memory file", store_name);
    return 0;
  }
  /* a region an older release stored may still be 0777 (MEMFD_MODE) */
  if ((st->st_mode & 07777) != MEMFD_MODE && fchmod(fd, MEMFD_MODE) != 0)
    shardd__log(1, "%s: its mode %04o stays: %s", store_name,
                (unsigned)(st->st_mode & 07777), strerror(errno));
  return 1;
}

/* Adopted memory counts as used on device, past its capacity if need be
 * (it exists already). */
static void count_adopted(host_priv *hp, int device, size_t bytes) {
  pthread_mutex_lock(&hp->lock);
  hp->used[device] += bytes;
  hp->allocs[device]++;
  if (hp->used[device] > hp->peak[device])
    hp->peak[device] = hp->used[device];
  pthread_mutex_unlock(&hp->lock);
}

typedef struct {
  size_t off, bytes;
} span;

static int span_cmp(const void *a, const void *b) {
  const span *x = a, *y = b;
  return x->off < y->off ? -1 : x->off > y->off;
}

/* Whether n blocks fit a file of size bytes, each on a page, none
 * overlapping; then (only then: a refused file's bytes stay the
 * operator's to look at) the ranges between them punched out. */
static int slab_blocks_fit(int fd, size_t size, size_t n, const size_t *offs,
                           const size_t *bytes) {
  size_t pg = (size_t)sysconf(_SC_PAGESIZE);
  span *sp = malloc((n ? n : 1) * sizeof *sp);
  if (sp == NULL)
    return 0;
  for (size_t i = 0; i < n; i++)
    sp[i] = (span){offs[i], bytes[i]};
  qsort(sp, n, sizeof *sp, span_cmp);
  size_t end = 0;
  int ok = 1;
  for (size_t i = 0; i < n && ok; i++) {
    size_t at = sp[i].off;
    /* at > size first: size - at would wrap and pass any block */
    ok = at % pg == 0 && sp[i].bytes != 0 && at >= end && at <= size &&
         sp[i].bytes <= size - at;
    end = at + sp[i].bytes;
  }
  end = 0;
  for (size_t i = 0; i <= n && ok; i++) {
    size_t at = i < n ? sp[i].off : size;
    if (at > end)
      fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, (off_t)end,
                (off_t)(at - end));
    if (i < n)
      end = at + sp[i].bytes;
  }
  free(sp);
  return ok;
}

static shardd_err host_wrap_slab(shardd__backend *b, int device, int fd,
                                 const char *store_name, size_t n,
                                 const size_t *offs, const size_t *bytes,
                                 shardd__region **out, char *err,
                                 size_t errlen) {
  host_priv *hp = b->priv;
  struct stat st;
  shardd__slab *s = calloc(1, sizeof *s);
  shardd__region **rs = calloc(n ? n : 1, sizeof *rs);
  if (s == NULL || rs == NULL || (s->store_name = strdup(store_name)) == NULL) {
    snprintf(err, errlen, "out of memory");
    goto fail;
  }
  if (n == 0) {
    snprintf(err, errlen, "%s: no block", store_name);
    goto fail;
  }
  if (!stored_file_ok(b, device, fd, store_name, &st, err, errlen))
    goto fail;
  if (!slab_blocks_fit(fd, (size_t)st.st_size, n, offs, bytes)) {
    snprintf(err, errlen, "%s: blocks that do not fit its %jd bytes",
             store_name, (intmax_t)st.st_size);
    goto fail;
  }
  s->base = mmap(NULL, (size_t)st.st_size, PROT_READ | PROT_WRITE, MAP_SHARED,
                 fd, 0);
  if (s->base == MAP_FAILED) {
    snprintf(err, errlen, "%s: mmap: %s", store_name, strerror(errno));
    goto fail;
  }
  for (size_t i = 0; i < n; i++) {
    if ((rs[i] = calloc(1, sizeof *rs[i])) == NULL) {
      munmap(s->base, (size_t)st.st_size);
      snprintf(err, errlen, "out of memory");
      goto fail;
    }
    *rs[i] = (shardd__region){.device = device, .bytes = bytes[i],
                              .ptr = (char *)s->base + offs[i], .fd = fd,
                              .off = offs[i], .slab = s};
    s->charged += bytes[i];
  }
  s->fd = fd;
  s->device = device;
  s->cap = s->next = (size_t)st.st_size;
  s->live = n;
  count_adopted(hp, device, s->charged);
  memcpy(out, rs, n * sizeof *rs);
  free(rs);
  return SHARDD_OK;
fail:
  close(fd);
  for (size_t i = 0; rs && i < n; i++)
    free(rs[i]);
  free(rs);
  if (s)
    free(s->store_name);
  free(s);
  return SHARDD_E_INVAL;
}

static void host_free(shardd__backend *b, shardd__region *r) {
  host_priv *hp = b->priv;
  if (r == NULL)
    return;
  if (r->slab) {
    slab_block_free(hp, r);
    return;
  }
  munmap(r->ptr, r->bytes);
  unstore_region(hp, r);
  /* stopping with the fd store: the pages are the next start's */
  if (r->fd >= 0 && hp->persist == SHARDD__PERSIST_DETACHED) {
    close(r->fd);
  } else if (r->fd >= 0) {
    /* A client that keeps its mapping (or its descriptor) after the
     * region is freed kept every page alive, charged to the daemon while
     * it counted them free: registered and unregistered again and again,
     * that escaped --uid-memory-limit until the daemon was OOM-killed.
     * Punching the whole file out takes the pages back now, out of every
     * mapping (a client reading its stale mapping reads zeros; a page it
     * writes there is new memory of its own, charged where it faults). */
    if (fallocate(r->fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 0,
                  (off_t)r->bytes) != 0)
      shardd__log(1, "freeing a region: punching out its %zu bytes: %s",
                  r->bytes, strerror(errno));
    close(r->fd);
  }
  pthread_mutex_lock(&hp->lock);
  hp->used[r->device] -= r->bytes;
  pthread_mutex_unlock(&hp->lock);
  free(r);
}

static shardd_err host_export_fd(shardd__backend *b, shardd__region *r,
                                 int *fd) {
  if (r->fd < 0) { /* a private region is never handed out */
    *fd = -1;
    return SHARDD_E_INVAL;
  }
  *fd = fcntl(r->fd, F_DUPFD_CLOEXEC, 0);
  return *fd < 0 ? SHARDD_E_IO : SHARDD_OK;
}

/* A new open of the memfd, read-only: a MAP_SHARED mapping of it cannot
 * be PROT_WRITE, nor mprotect()ed so (EACCES). */
static shardd_err host_export_fd_ro(shardd__backend *b, shardd__region *r,
                                    int *fd) {
  *fd = -1;
  if (r->fd < 0)
    return SHARDD_E_INVAL;
  char path[64];
  snprintf(path, sizeof path, "/proc/self/fd/%d", r->fd);
  *fd = open(path, O_RDONLY | O_CLOEXEC);
  return *fd < 0 ? SHARDD_E_IO : SHARDD_OK;
}

static shardd_err host_copy(shardd__backend *b, shardd__region *dst,
                            size_t dst_off, shardd__region *src,
                            size_t src_off, size_t bytes) {
  memcpy((char *)dst->ptr + dst_off, (const char *)src->ptr + src_off, bytes);
  return SHARDD_OK;
}

/* The source pointers of a reduction's block handed to the kernel this
 * many at a time (on the stack: no allocation per task); a longer list
 * goes on from the sum so far, in the same rank order. */
#define REDUCE_SRCS 16

/* acc[0..m) = sum over ranks of srcs[i] at src_offs[i] + first elements
 * (with add: acc += that sum), in rank order. */
static void reduce_block(shardd_dtype dtype, float *acc,
                         shardd__region *const *srcs, const size_t *src_offs,
                         int nsrc, size_t first, size_t m, int add) {
  size_t esz = shardd_dtype_size(dtype);
  const void *p[REDUCE_SRCS];
  for (int j = 0; j < nsrc; j += REDUCE_SRCS) {
    int k = nsrc - j < REDUCE_SRCS ? nsrc - j : REDUCE_SRCS;
    for (int i = 0; i < k; i++)
      p[i] = (const char *)srcs[j + i]->ptr + src_offs[j + i] + first * esz;
    shardd__reduce_sum(dtype, acc, p, k, m, add || j > 0);
  }
}

static shardd_err host_reduce(shardd__backend *b, shardd_dtype dtype,
                              float divisor, shardd__region *dst,
                              size_t dst_off, shardd__region *const *srcs,
                              const size_t *src_offs, int nsrc, size_t n) {
  float *acc = (float *)((char *)dst->ptr + dst_off);
  /* Blocks keep the accumulator in L1/L2 while every rank's slice streams
   * through it once. */
  const size_t blk = 8192;
  for (size_t base = 0; base < n; base += blk) {
    size_t m = n - base < blk ? n - base : blk;
    reduce_block(dtype, acc + base, srcs, src_offs, nsrc, base, m, 0);
    if (divisor != 1.0f) {
      float *restrict a = acc + base;
      for (size_t j = 0; j < m; j++)
        a[j] /= divisor;
    }
  }
  if (nsrc == 0)
    memset(acc, 0, n * sizeof *acc);
  return SHARDD_OK;
}

static shardd_err host_reduce_add(shardd__backend *b, shardd_dtype dtype,
                                  float divisor, shardd__region *dst,
                                  size_t dst_off, shardd__region *const *srcs,
                                  const size_t *src_offs, int nsrc, size_t n) {
  float *acc = (float *)((char *)dst->ptr + dst_off);
  /* The block's sum is taken apart from acc, so acc + sum/divisor rounds
   * as the two reductions would one after the other. */
  float tmp[2048];
  const size_t blk = sizeof tmp / sizeof tmp[0];
  if (nsrc == 0)
    return SHARDD_OK;
  for (size_t base = 0; base < n; base += blk) {
    size_t m = n - base < blk ? n - base : blk;
    reduce_block(dtype, tmp, srcs, src_offs, nsrc, base, m, 0);
    float *restrict a = acc + base;
    if (divisor != 1.0f)
      for (size_t j = 0; j < m; j++)
        a[j] += tmp[j] / divisor;
    else
      for (size_t j = 0; j < m; j++)
        a[j] += tmp[j];
  }
  return SHARDD_OK;
}

static shardd_err host_adopt(shardd__backend *b, shardd_dtype dtype,
                             shardd__region *master, size_t master_off,
                             shardd__region *param, size_t param_off, size_t n) {
  shardd__optim_adopt(dtype, (float *)((char *)master->ptr + master_off),
                      (const char *)param->ptr + param_off, n);
  return SHARDD_OK;
}

static shardd_err host_sumsq(shardd__backend *b, shardd__region *r, size_t off,
                             size_t n, double *out) {
  *out = shardd__sumsq_f32((const float *)((char *)r->ptr + off), n);
  return SHARDD_OK;
}

static shardd_err host_update(shardd__backend *b, const shardd__hp *hp,
                              uint64_t step, shardd_dtype dtype,
                              shardd__region *param, size_t param_off,
                              shardd__region *master, size_t master_off,
                              shardd__region *grad, size_t grad_off,
                              float grad_scale, shardd__region *state,
                              const size_t *state_offs, size_t n) {
  float *st[3] = {NULL, NULL, NULL};
  int k = shardd__optim_state_count(hp);
  for (int i = 0; i < k; i++)
    st[i] = (float *)((char *)state->ptr + state_offs[i]);
  const float *g = (const float *)((char *)grad->ptr + grad_off);
  void *p = (char *)param->ptr + param_off;
  if (dtype == SHARDD_DTYPE_FP32) {
    shardd__optim_update(hp, step, p, g, grad_scale, st, n);
    return SHARDD_OK;
  }
  /* 16-bit params: the fp32 master is updated and narrowed into param block
   * by block (see shardd__optim_update_narrow). */
  float *m = (float *)((char *)master->ptr + master_off);
  shardd__optim_update_narrow(hp, step, dtype, p, m, g, grad_scale, st, n);
  return SHARDD_OK;
}

static shardd_err host_widen(shardd__backend *b, shardd_dtype dtype,
                             shardd__region *master, size_t master_off,
                             shardd__region *param, size_t param_off,
                             size_t n) {
  shardd__to_f32(dtype, (float *)((char *)master->ptr + master_off),
                 (const char *)param->ptr + param_off, n);
  return SHARDD_OK;
}

static void host_device_info(shardd__backend *b, int device,
                             shardd__device_info *out) {
  host_priv *hp = b->priv;
  memset(out, 0, sizeof *out);
  snprintf(out->name, sizeof out->name, "host%d", device);
  out->capacity_bytes = hp->capacity;
  pthread_mutex_lock(&hp->lock);
  int ok = device >= 0 && device < b->ndevices;
  out->used_bytes = ok ? hp->used[device] : 0;
  out->peak_bytes = ok ? hp->peak[device] : 0;
  out->allocs = ok ? hp->allocs[device] : 0;
  pthread_mutex_unlock(&hp->lock);
  out->free_bytes = out->capacity_bytes > out->used_bytes
                        ? out->capacity_bytes - out->used_bytes
                        : 0;
}

static void host_destroy(shardd__backend *b) {
  host_priv *hp = b->priv;
  pthread_mutex_destroy(&hp->lock);
  free(hp->used);
  free(hp->peak);
  free(hp->allocs);
  free(hp);
  free(b);
}

static shardd_err host_wrap_fd(shardd__backend *b, int device, int fd,
                               const char *store_name, shardd__region **out,
                               char *err, size_t errlen) {
  host_priv *hp = b->priv;
  struct stat st;
  *out = NULL;
  shardd__region *r = calloc(1, sizeof *r);
  if (r == NULL || (r->priv = strdup(store_name)) == NULL) {
    snprintf(err, errlen, "out of memory");
    goto fail;
  }
  if (!stored_file_ok(b, device, fd, store_name, &st, err, errlen))
    goto fail;
  void *p = mmap(NULL, (size_t)st.st_size, PROT_READ | PROT_WRITE, MAP_SHARED,
                 fd, 0);
  if (p == MAP_FAILED) {
    snprintf(err, errlen, "%s: mmap: %s", store_name, strerror(errno));
    goto fail;
  }
  r->device = device;
  r->bytes = (size_t)st.st_size;
  r->ptr = p;
  r->fd = fd;
  count_adopted(hp, device, r->bytes);
  *out = r;
  return SHARDD_OK;
fail:
  close(fd);
  if (r)
    free(r->priv);
  free(r);
  return SHARDD_E_INVAL;
}

void shardd__backend_host_persist(shardd__backend *b, int mode) {
  if (b->ops->wrap_fd == NULL)
    return; /* not the host backend */
  host_priv *hp = b->priv;
  hp->persist = mode;
}

const char *shardd__backend_region_store_name(const shardd__region *r) {
  if (r->slab)
    return r->slab->store_name;
  return r->fd >= 0 ? r->priv : NULL;
}

static const shardd__backend_ops host_ops = {
    .alloc = host_alloc,
    .alloc_private = host_alloc_private,
    .free = host_free,
    .export_fd = host_export_fd,
    .export_fd_ro = host_export_fd_ro,
    .copy = host_copy,
    .reduce = host_reduce,
    .reduce_add = host_reduce_add,
    .adopt = host_adopt,
    .sumsq = host_sumsq,
    .update = host_update,
    .widen = host_widen,
    .device_info = host_device_info,
    .destroy = host_destroy,
    .wrap_fd = host_wrap_fd,
    .slab_open = host_slab_open,
    .slab_take = host_slab_take,
    .slab_close = host_slab_close,
    .wrap_slab = host_wrap_slab,
};

shardd_err shardd__backend_host_create(int ndevices, uint64_t capacity,
                                       shardd__backend **out, char *err,
                                       size_t errlen) {
  *out = NULL;
  if (ndevices < 1 || ndevices > 1024) {
    snprintf(err, errlen, "--devices %d: must be 1..1024", ndevices);
    return SHARDD_E_RANGE;
  }
  if (capacity == 0) {
    long pages = sysconf(_SC_PHYS_PAGES);
    long pg = sysconf(_SC_PAGESIZE);
    capacity = pages > 0 && pg > 0 ? (uint64_t)pages * (uint64_t)pg / (uint64_t)ndevices
                                   : (uint64_t)1 << 30;
  }
  shardd__backend *b = calloc(1, sizeof *b);
  host_priv *hp = calloc(1, sizeof *hp);
  uint64_t *used = calloc((size_t)ndevices, sizeof *used);
  uint64_t *peak = calloc((size_t)ndevices, sizeof *peak);
  uint64_t *allocs = calloc((size_t)ndevices, sizeof *allocs);
  if (b == NULL || hp == NULL || used == NULL || peak == NULL || allocs == NULL) {
    free(b);
    free(hp);
    free(used);
    free(peak);
    free(allocs);
    snprintf(err, errlen, "out of memory");
    return SHARDD_E_NO_MEMORY;
  }
  pthread_mutex_init(&hp->lock, NULL);
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  /* unique to this start: the names a previous daemon stored are taken
   * over with their regions and must not meet a new one's */
  snprintf(hp->store_prefix, sizeof hp->store_prefix, "%" PRIx64 "-%x",
           (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec,
           (unsigned)getpid());
  hp->capacity = capacity;
  hp->used = used;
  hp->peak = peak;
  hp->allocs = allocs;
  b->ops = &host_ops;
  b->name = "host";
  b->caps = SHARDD__BACKEND_CAP_HOST_MAPPED;
  b->ndevices = ndevices;
  b->priv = hp;
  *out = b;
  return SHARDD_OK;
}

#ifndef SHARDD_HAVE_CUDA
int shardd__cuda_device_count(void) { return 0; }

shardd_err shardd__backend_cuda_create(int ndevices, shardd__backend **out,
                                       char *err, size_t errlen) {
  *out = NULL;
  snprintf(err, errlen, "this shardd was built without CUDA (make CUDA=1)");
  return SHARDD_E_NO_CUDA;
}
#endif
