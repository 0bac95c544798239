/* checkpoint.c — job checkpoints to a directory and their restore (see
 * checkpoint.h). Headers and the manifest are little-endian and text
 * respectively; names in the manifest are percent-encoded so any byte
 * string survives the space-separated format. */
#include "checkpoint.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <dirent.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "optcodec.h"
#include "optreg.h"
#include "strbuf.h"

#define MAGIC "SHRDCKPT"
#define HEADER_BYTES 64
#define MANIFEST "manifest"

/* The longest manifest line restore reads (and write produces). The
 * longest one is an optimizer's: its RegisterOptimizer in hex, with its
 * name and step count. A client's registration fits one frame, but a
 * restored one is repacked with new ids and generations (longer varints),
 * so the cap allows a spec of two frames; write refuses past it rather than
 * leave a checkpoint restore would refuse. The manifest comes from a
 * directory the client names, and getline grew its buffer to whatever one
 * line held: a planted manifest without newlines cost its size in memory. */
#define MANIFEST_LINE_MAX ((size_t)4 * SHARDD_MAX_FRAME + 4096)

/* ---- CRC32C ----------------------------------------------------------- */

static uint32_t crc_table[8][256];

static void crc_init(void) {
  for (uint32_t i = 0; i < 256; i++) {
    uint32_t c = i;
    for (int k = 0; k < 8; k++)
      c = c & 1 ? (c >> 1) ^ 0x82f63b78u : c >> 1;
    crc_table[0][i] = c;
  }
  for (uint32_t i = 0; i < 256; i++)
    for (int t = 1; t < 8; t++)
      crc_table[t][i] = (crc_table[t - 1][i] >> 8) ^
                        crc_table[0][crc_table[t - 1][i] & 0xff];
}

#if defined(__x86_64__)
__attribute__((target("sse4.2"))) static uint32_t crc_hw(uint32_t crc,
                                                         const uint8_t *p,
                                                         size_t n) {
  uint64_t c = crc;
  for (; n >= 8; n -= 8, p += 8) {
    uint64_t w;
    memcpy(&w, p, 8);
    c = __builtin_ia32_crc32di(c, w);
  }
  uint32_t c32 = (uint32_t)c;
  for (; n > 0; n--, p++)
    c32 = __builtin_ia32_crc32qi(c32, *p);
  return c32;
}
#endif

/* Slicing-by-8 where the CPU has no crc32 instruction. */
static uint32_t crc_sw(uint32_t crc, const uint8_t *p, size_t n) {
  static int ready;
  if (!ready) {
    crc_init();
    ready = 1;
  }
  for (; n >= 8; n -= 8, p += 8) {
    uint32_t lo, hi;
    memcpy(&lo, p, 4);
    memcpy(&hi, p + 4, 4);
    lo ^= crc;
    crc = crc_table[7][lo & 0xff] ^ crc_table[6][(lo >> 8) & 0xff] ^
          crc_table[5][(lo >> 16) & 0xff] ^ crc_table[4][lo >> 24] ^
          crc_table[3][hi & 0xff] ^ crc_table[2][(hi >> 8) & 0xff] ^
          crc_table[1][(hi >> 16) & 0xff] ^ crc_table[0][hi >> 24];
  }
  for (; n > 0; n--, p++)
    crc = (crc >> 8) ^ crc_table[0][(crc ^ *p) & 0xff];
  return crc;
}

uint32_t shardd__crc32c(uint32_t crc, const void *data, size_t n) {
  crc = ~crc;
#if defined(__x86_64__)
  if (__builtin_cpu_supports("sse4.2"))
    return ~crc_hw(crc, data, n);
#endif
  return ~crc_sw(crc, data, n);
}

/* ---- little helpers --------------------------------------------------- */

static void put_u32(uint8_t *p, uint32_t v) {
  for (int i = 0; i < 4; i++)
    p[i] = (uint8_t)(v >> (8 * i));
}

static void put_u64(uint8_t *p, uint64_t v) {
  for (int i = 0; i < 8; i++)
    p[i] = (uint8_t)(v >> (8 * i));
}

static uint32_t get_u32(const uint8_t *p) {
  uint32_t v = 0;
  for (int i = 0; i < 4; i++)
    v |= (uint32_t)p[i] << (8 * i);
  return v;
}

static uint64_t get_u64(const uint8_t *p) {
  uint64_t v = 0;
  for (int i = 0; i < 8; i++)
    v |= (uint64_t)p[i] << (8 * i);
  return v;
}

static void enc_name(shardd__sb *sb, const char *s) {
  for (const unsigned char *p = (const unsigned char *)s; *p; p++) {
    if (*p <= 0x20 || *p >= 0x7f || *p == '%')
      shardd__sb_printf(sb, "%%%02x", *p);
    else
      shardd__sb_printf(sb, "%c", *p);
  }
}

/* Decodes in place; returns 0 on a malformed escape. */
static int dec_name(char *s) {
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

static shardd_err write_all(int fd, const void *buf, size_t n) {
  const char *p = buf;
  while (n > 0) {
    ssize_t w = write(fd, p, n);
    if (w < 0) {
      if (errno == EINTR)
        continue;
      return SHARDD_E_IO;
    }
    p += w;
    n -= (size_t)w;
  }
  return SHARDD_OK;
}

static shardd_err read_all(int fd, void *buf, size_t n) {
  char *p = buf;
  while (n > 0) {
    ssize_t r = read(fd, p, n);
    if (r < 0 && errno == EINTR)
      continue;
    if (r <= 0)
      return SHARDD_E_IO;
    p += r;
    n -= (size_t)r;
  }
  return SHARDD_OK;
}

/* The directory a checkpoint lives in, opened once: every file below it is
 * opened relative to fd with O_NOFOLLOW, so no symlink planted in a
 * client's directory (or on the way to it) redirects the daemon's own
 * rights to another user's file. path is for messages only. as_uid is who
 * asks (< 0 the daemon itself, 0 root). */
typedef struct {
  int fd;
  const char *path;
  int64_t as_uid;
} ckdir;

/* Opens path as a directory, walking it one component at a time with
 * O_NOFOLLOW: a string check of the path cannot see a symlink inside
 * --checkpoint-root that points out of it; this walk refuses it.
 * -1 with err and errno set. */
static int open_dir_nofollow(const char *path, char *err, size_t errlen) {
  char *copy = strdup(path);
  if (copy == NULL) {
    snprintf(err, errlen, "out of memory");
    errno = ENOMEM;
    return -1;
  }
  int fd = open(path[0] == '/' ? "/" : ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  char *save = NULL;
  for (char *comp = strtok_r(copy, "/", &save); fd >= 0 && comp != NULL;
       comp = strtok_r(NULL, "/", &save)) {
    int nfd = openat(fd, comp, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (nfd < 0) {
      int e = errno;
      if (e == ELOOP || e == ENOTDIR)
        snprintf(err, errlen, "%s: \"%s\" is a symlink or not a directory "
                 "(checkpoint paths may hold no symlink)", path, comp);
      else
        snprintf(err, errlen, "%s: %s", path, strerror(e));
      close(fd);
      free(copy);
      errno = e;
      return -1;
    }
    close(fd);
    fd = nfd;
  }
  free(copy);
  if (fd < 0) {
    int e = errno;
    snprintf(err, errlen, "%s: %s", path, strerror(e));
    errno = e;
    return -1;
  }
  return fd;
}

/* Whether uid (a client, not root) may write a checkpoint into the
 * directory st describes, whose parent is pst: its own directory, or one
 * the daemon made (owned by the daemon) inside a directory of its own.
 * Anything else is another user's namespace: an attacker's checkpoint of
 * its own job into a victim's directory replaced the victim's files. */
static int dir_writable_by(const struct stat *st, const struct stat *pst,
                           uint32_t uid) {
  return st->st_uid == uid ||
         (st->st_uid == geteuid() && pst != NULL && pst->st_uid == uid);
}

/* Opens (making it when missing) the directory a checkpoint is written
 * into, for as_uid (see ckdir). A missing directory is made only inside
 * one the client owns, and handed to it (chown, when the daemon may). */
static shardd_err open_write_dir(const char *dir, int64_t as_uid, int *out,
                                 char *err, size_t errlen) {
  *out = -1;
  size_t n = strlen(dir);
  while (n > 1 && dir[n - 1] == '/')
    n--;
  size_t cut = n;
  while (cut > 0 && dir[cut - 1] != '/')
    cut--;
  /* dir[0, cut) is the parent with its slash, dir[cut, n) the last name */
  char parent[4096], base_copy[256];
  if (cut >= sizeof parent || n - cut >= sizeof base_copy || n == cut) {
    snprintf(err, errlen, "%s: not a directory name to checkpoint into", dir);
    return SHARDD_E_INVAL;
  }
  memcpy(parent, dir, cut);
  parent[cut > 1 ? cut - 1 : cut] = '\0';
  if (cut == 0)
    snprintf(parent, sizeof parent, ".");
  memcpy(base_copy, dir + cut, n - cut);
  base_copy[n - cut] = '\0';
  shardd_err rc = SHARDD_E_IO;
  int pfd = open_dir_nofollow(parent, err, errlen);
  struct stat pst, st;
  if (pfd < 0) {
    rc = errno == ELOOP || errno == ENOTDIR ? SHARDD_E_PERMISSION : SHARDD_E_IO;
    goto done;
  }
  if (base_copy[0] == '\0' || fstat(pfd, &pst) != 0) {
    snprintf(err, errlen, "%s: not a directory to checkpoint into", dir);
    goto done;
  }
  if (mkdirat(pfd, base_copy, 0750) == 0) {
    if (as_uid > 0 && pst.st_uid != (uint32_t)as_uid) {
      unlinkat(pfd, base_copy, AT_REMOVEDIR);
      snprintf(err, errlen, "%s: its parent directory is not yours; checkpoint "
               "into a directory you own", dir);
      rc = SHARDD_E_PERMISSION;
      goto done;
    }
    if (as_uid > 0 && geteuid() == 0)
      (void)!fchownat(pfd, base_copy, (uid_t)as_uid, (gid_t)-1,
                      AT_SYMLINK_NOFOLLOW);
  } else if (errno != EEXIST) {
    snprintf(err, errlen, "mkdir %s: %s", dir, strerror(errno));
    goto done;
  }
  int fd = openat(pfd, base_copy, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  if (fd < 0) {
    if (errno == ELOOP || errno == ENOTDIR) {
      snprintf(err, errlen, "%s is a symlink or not a directory (checkpoint "
               "paths may hold no symlink)", dir);
      rc = SHARDD_E_PERMISSION;
    } else {
      snprintf(err, errlen, "%s: %s", dir, strerror(errno));
    }
    goto done;
  }
  if (as_uid > 0 && (fstat(fd, &st) != 0 ||
                     !dir_writable_by(&st, &pst, (uint32_t)as_uid))) {
    close(fd);
    snprintf(err, errlen, "%s: the directory is not yours; checkpoint into a "
             "directory you own", dir);
    rc = SHARDD_E_PERMISSION;
    goto done;
  }
  *out = fd;
  rc = SHARDD_OK;
done:
  if (pfd >= 0)
    close(pfd);
  return rc;
}

static shardd_err fsync_dirfd(const ckdir *d, char *err, size_t errlen) {
  if (fsync(d->fd) != 0) {
    snprintf(err, errlen, "fsync %s: %s", d->path, strerror(errno));
    return SHARDD_E_IO;
  }
  return SHARDD_OK;
}

/* Writes d/fname through a temporary name: head (may be NULL), then
 * payload, fsync, rename. */
static shardd_err write_file(const ckdir *d, const char *fname,
                             const void *head, size_t head_len,
                             const void *payload, size_t bytes, char *err,
                             size_t errlen) {
  char tmp[256];
  snprintf(tmp, sizeof tmp, ".%s.tmp", fname);
  /* The directory may be the client's and the daemon writes with its own
   * rights: a symlink planted at the temporary name must not make it
   * truncate and write whatever the link names. A stale temporary (a
   * crash mid-write) is removed, then the name is created anew. */
  if (unlinkat(d->fd, tmp, 0) != 0 && errno != ENOENT) {
    snprintf(err, errlen, "unlink %s/%s: %s", d->path, tmp, strerror(errno));
    return SHARDD_E_IO;
  }
  int fd = openat(d->fd, tmp, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC,
                  0640);
  if (fd < 0) {
    snprintf(err, errlen, "create %s/%s: %s", d->path, tmp, strerror(errno));
    return SHARDD_E_IO;
  }
  shardd_err rc = SHARDD_OK;
  if ((head && write_all(fd, head, head_len) != SHARDD_OK) ||
      write_all(fd, payload, bytes) != SHARDD_OK || fsync(fd) != 0) {
    snprintf(err, errlen, "write %s/%s: %s", d->path, tmp, strerror(errno));
    rc = SHARDD_E_IO;
  }
  if (close(fd) != 0 && rc == SHARDD_OK) {
    snprintf(err, errlen, "close %s/%s: %s", d->path, tmp, strerror(errno));
    rc = SHARDD_E_IO;
  }
  if (rc == SHARDD_OK && renameat(d->fd, tmp, d->fd, fname) != 0) {
    snprintf(err, errlen, "rename %s/%s: %s", d->path, fname, strerror(errno));
    rc = SHARDD_E_IO;
  }
  if (rc != SHARDD_OK)
    unlinkat(d->fd, tmp, 0);
  return rc;
}

/* A data file: header (64 bytes), the buffer's name, the payload. */
static shardd_err write_data(const ckdir *dir, const char *fname,
                             uint32_t dtype, uint64_t numel, uint64_t offset,
                             const char *name, const void *payload,
                             size_t bytes, uint32_t *crc, char *err,
                             size_t errlen) {
  size_t nlen = strlen(name);
  uint8_t *head = calloc(1, HEADER_BYTES + nlen);
  if (head == NULL) {
    snprintf(err, errlen, "out of memory");
    return SHARDD_E_NO_MEMORY;
  }
  *crc = shardd__crc32c(0, payload, bytes);
  memcpy(head, MAGIC, 8);
  put_u32(head + 8, SHARDD_CHECKPOINT_VERSION);
  put_u32(head + 12, dtype);
  put_u64(head + 16, numel);
  put_u64(head + 24, offset);
  put_u64(head + 32, bytes);
  put_u32(head + 40, *crc);
  put_u32(head + 44, (uint32_t)nlen);
  memcpy(head + HEADER_BYTES, name, nlen);
  shardd_err rc = write_file(dir, fname, head, HEADER_BYTES + nlen, payload,
                             bytes, err, errlen);
  free(head);
  return rc;
}

/* ---- write ------------------------------------------------------------ */

static size_t buffer_index(shardd__buffer **bufs, size_t n,
                           const shardd__buffer *b) {
  for (size_t i = 0; i < n; i++)
    if (bufs[i] == b)
      return i;
  return n;
}

static int hexval(char c);

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
      if (hexval(p[k]) < 0)
        return 0;
    p += 9;
  }
  return strcmp(p, ext) == 0;
}

/* Removes the data files of d whose name holds (keep == 0) or does not hold
 * (keep == 1) "-TAG.": after a new manifest is in place, the previous
 * generation's files; after a failed write, the new generation's. */
static void remove_generation(const ckdir *d, const char *tag, int keep) {
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
    if (!is_data_name(e->d_name) || (strstr(e->d_name, needle) != NULL) == keep)
      continue;
    struct stat st;
    if (fstatat(d->fd, e->d_name, &st, AT_SYMLINK_NOFOLLOW) == 0 &&
        (S_ISREG(st.st_mode) || S_ISLNK(st.st_mode)))
      unlinkat(d->fd, e->d_name, 0);
  }
  closedir(dh);
}

shardd_err shardd__checkpoint_write(shardd__registry *reg, shardd__job *job,
                                    const char *dirpath, int64_t as_uid,
                                    char *err, size_t errlen) {
  /* payloads are read and written through the daemon's own mapping */
  if (!(reg->backend->caps & SHARDD__BACKEND_CAP_HOST_MAPPED)) {
    snprintf(err, errlen, "checkpoints support the host backend only");
    return SHARDD_E_INVAL;
  }
  ckdir dd = {-1, dirpath, as_uid};
  const ckdir *dir = &dd;
  shardd_err orc = open_write_dir(dirpath, as_uid, &dd.fd, err, errlen);
  if (orc != SHARDD_OK)
    return orc;
  /* Every data file of this checkpoint carries a tag of its own; the files
   * of the previous one stay until the new manifest has replaced its
   * manifest (one rename), so a write that fails (ENOSPC, kill -9) leaves
   * the last good checkpoint whole. */
  static unsigned counter;
  struct timespec now;
  clock_gettime(CLOCK_REALTIME, &now);
  uint64_t seed[3] = {(uint64_t)now.tv_sec, (uint64_t)now.tv_nsec,
                      (uint64_t)getpid() << 32 | ++counter};
  char tag[16];
  snprintf(tag, sizeof tag, "%08" PRIx32, shardd__crc32c(0, seed, sizeof seed));

  shardd__buffer **bufs = NULL;
  shardd__optim **opts = NULL;
  size_t nb = 0, no = 0;
  int manifest_in = 0;
  shardd__sb m;
  shardd__sb_init(&m);
  shardd_err rc = SHARDD_E_NO_MEMORY;
  if (shardd__job_buffers(job, &bufs, &nb) != SHARDD_OK ||
      shardd__job_optims(job, &opts, &no) != SHARDD_OK) {
    snprintf(err, errlen, "out of memory");
    goto done;
  }
  shardd__sb_printf(&m, "shardd-checkpoint %d\njob ", SHARDD_MANIFEST_VERSION);
  enc_name(&m, job->name);
  shardd__sb_printf(&m, " %" PRIu32 " %" PRIu32 "\n", job->world, job->uid);

  char fname[128];
  for (size_t i = 0; i < nb; i++) {
    shardd__buffer *b = bufs[i];
    size_t esz = shardd_dtype_size(b->dtype);
    shardd__sb_printf(&m, "buffer ");
    enc_name(&m, b->hdr.name);
    shardd__sb_printf(&m, " %d %" PRIu64 " %" PRIu64 "\n", (int)b->dtype,
                      b->numel, b->hdr.generation);
    for (uint32_t r = 0; r < b->world; r++) {
      uint32_t crc;
      snprintf(fname, sizeof fname, "b%zu-r%" PRIu32 "-%s.shard", i, r, tag);
      rc = write_data(dir, fname, (uint32_t)b->dtype, b->shard_numel,
                      (uint64_t)r * b->shard_numel, b->hdr.name,
                      (const char *)b->blocks[r]->ptr + b->shard_off,
                      b->shard_numel * esz, &crc, err, errlen);
      if (rc != SHARDD_OK)
        goto done;
      shardd__sb_printf(&m, "shard %zu %" PRIu32 " %s %08" PRIx32 "\n", i, r,
                        fname, crc);
    }
    shardd__view **views;
    size_t nv;
    if (shardd__buffer_views(b, &views, &nv) != SHARDD_OK) {
      rc = SHARDD_E_NO_MEMORY;
      snprintf(err, errlen, "out of memory");
      goto done;
    }
    for (size_t k = 0; k < nv; k++) {
      shardd__view *v = views[k];
      shardd__sb_printf(&m, "view %zu ", i);
      enc_name(&m, v->hdr.name);
      shardd__sb_printf(&m, " %" PRIu64 " %" PRIu64 " %d", v->offset, v->numel,
                        v->ndim);
      for (int d = 0; d < v->ndim; d++)
        shardd__sb_printf(&m, " %" PRId64, v->shape[d]);
      shardd__sb_printf(&m, " %" PRIu64 " %d\n", v->hdr.generation,
                        v->requires_grad);
    }
    free(views);
  }

  for (size_t i = 0; i < no; i++) {
    shardd__optim *o = opts[i];
    /* name: 3 bytes a byte at most when encoded; index and steps: 40 */
    if (o->spec_len > (MANIFEST_LINE_MAX - 3 * strlen(o->hdr.name) - 64) / 2) {
      snprintf(err, errlen, "optimizer \"%s\": its registration (%zu bytes) "
               "does not fit a manifest line (%zu bytes)", o->hdr.name,
               o->spec_len, MANIFEST_LINE_MAX);
      rc = SHARDD_E_LIMIT;
      goto done;
    }
    shardd__sb_printf(&m, "optimizer %zu ", i);
    enc_name(&m, o->hdr.name);
    shardd__sb_printf(&m, " %" PRIu64 " ", o->steps);
    for (size_t k = 0; k < o->spec_len; k++)
      shardd__sb_printf(&m, "%02x", o->spec[k]);
    shardd__sb_printf(&m, "\n");
    for (size_t k = 0; k < o->nrefs; k++) {
      shardd__obj *r = o->refs[k];
      if (r->kind == SHARDD__OBJ_VIEW) {
        shardd__view *v = (shardd__view *)r;
        shardd__sb_printf(&m, "ref %zu %" PRIu64 " view %zu ", i, r->id,
                          buffer_index(bufs, nb, v->buf));
        enc_name(&m, r->name);
        shardd__sb_printf(&m, "\n");
      } else {
        shardd__sb_printf(&m, "ref %zu %" PRIu64 " buffer %zu\n", i, r->id,
                          buffer_index(bufs, nb, (shardd__buffer *)r));
      }
    }
    for (size_t k = 0; k < o->nshards; k++) {
      shardd__optim_shard *sh = &o->shards[k];
      if (sh->state == NULL)
        continue;
      size_t bi = buffer_index(bufs, nb, sh->buf);
      uint32_t crc;
      snprintf(fname, sizeof fname, "o%zu-b%zu-r%" PRIu32 "-%s.state", i, bi,
               sh->rank, tag);
      rc = write_data(dir, fname, SHARDD_DTYPE_FP32, sh->state->bytes / 4,
                      (uint64_t)sh->rank * sh->buf->shard_numel, sh->buf->hdr.name,
                      sh->state->ptr, sh->state->bytes, &crc, err, errlen);
      if (rc != SHARDD_OK)
        goto done;
      shardd__sb_printf(&m, "state %zu %zu %" PRIu32 " %d %s %08" PRIx32 " %zu %d\n",
                        i, bi, sh->rank, sh->master_valid, fname, crc,
                        sh->state->bytes, sh->nstate);
    }
  }
  /* The checksum seals every byte before it: an edited step count,
   * master_valid or owner was accepted, and an edited offset surfaced only
   * when ranks re-attached, blaming the trainers. */
  if (!m.failed)
    shardd__sb_printf(&m, "end %08" PRIx32 "\n", shardd__crc32c(0, m.s, m.len));
  if (m.failed) {
    rc = SHARDD_E_NO_MEMORY;
    snprintf(err, errlen, "out of memory");
    goto done;
  }
  /* Data files must be durable before the manifest vouches for them. */
  if ((rc = fsync_dirfd(dir, err, errlen)) != SHARDD_OK ||
      (rc = write_file(dir, MANIFEST, NULL, 0, m.s, m.len, err, errlen)) !=
          SHARDD_OK)
    goto done;
  manifest_in = 1; /* from here the new files are the checkpoint */
  if ((rc = fsync_dirfd(dir, err, errlen)) != SHARDD_OK)
    goto done;
  rc = SHARDD_OK;

done:
  remove_generation(dir, tag, manifest_in);
  close(dd.fd);
  shardd__sb_free(&m);
  free(bufs);
  free(opts);
  return rc;
}

/* ---- restore ---------------------------------------------------------- */

/* Opens path for reading if it is a regular file; else -1 with err set.
 * Restore runs on the loop thread: a FIFO (or a device) planted in the
 * client's checkpoint directory blocked open(2) or read(2), and with them
 * the whole daemon, forever. O_NONBLOCK makes the open return; the check
 * refuses the file; then reads block normally again. */
static int open_regular(const ckdir *d, const char *fname, char *err,
                        size_t errlen) {
  if (strchr(fname, '/') != NULL) {
    snprintf(err, errlen, "%s: file name leaves the checkpoint directory", fname);
    errno = EINVAL;
    return -1;
  }
  int fd = openat(d->fd, fname, O_RDONLY | O_NONBLOCK | O_NOFOLLOW | O_CLOEXEC);
  if (fd < 0) {
    int e = errno;
    if (e == ELOOP)
      snprintf(err, errlen, "%s/%s: a symlink (refused)", d->path, fname);
    else
      snprintf(err, errlen, "%s/%s: %s", d->path, fname, strerror(e));
    errno = e; /* the caller may tell a missing file apart */
    return -1;
  }
  struct stat st;
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    snprintf(err, errlen, "%s/%s: not a regular file", d->path, fname);
    close(fd);
    errno = EINVAL;
    return -1;
  }
  /* A hard link to another user's file, or a file some other uid put in
   * the client's directory, would be read with the daemon's rights and its
   * contents told back through the header and CRC messages. */
  if (d->as_uid > 0 &&
      (st.st_nlink != 1 ||
       (st.st_uid != (uid_t)d->as_uid && st.st_uid != geteuid()))) {
    snprintf(err, errlen, "%s/%s: not a file of yours or of the daemon's with "
             "one link (refused)", d->path, fname);
    close(fd);
    errno = EPERM;
    return -1;
  }
  int fl = fcntl(fd, F_GETFL);
  if (fl != -1)
    fcntl(fd, F_SETFL, fl & ~O_NONBLOCK);
  return fd;
}

/* Reads dir/fname into dst after checking its header and size against what
 * the manifest says, then checks the CRC of what it read. dst is memory of
 * the job being restored, which no client sees before the restore
 * succeeds, so reading straight into it costs no second pass. */
static shardd_err load_data(const ckdir *dir, const char *fname,
                            uint32_t dtype, uint64_t numel, uint64_t offset,
                            const char *name, uint32_t crc, void *dst,
                            size_t bytes, char *err, size_t errlen) {
  char path[4096];
  snprintf(path, sizeof path, "%s/%s", dir->path, fname);
  int fd = open_regular(dir, fname, err, errlen);
  if (fd < 0)
    return errno == EPERM || errno == ELOOP ? SHARDD_E_PERMISSION
           : errno == EINVAL && strchr(fname, '/') ? SHARDD_E_INVAL
                                                   : SHARDD_E_IO;
  shardd_err rc = SHARDD_E_IO;
  uint8_t head[HEADER_BYTES];
  size_t nlen = strlen(name);
  char *fname_in = malloc(nlen + 1);
  struct stat st;
  if (fname_in == NULL || fstat(fd, &st) != 0) {
    snprintf(err, errlen, "%s: %s", path, strerror(errno));
    goto done;
  }
  if (read_all(fd, head, sizeof head) != SHARDD_OK ||
      memcmp(head, MAGIC, 8) != 0) {
    snprintf(err, errlen, "%s: not a shardd checkpoint file", path);
    goto done;
  }
  if (get_u32(head + 8) != SHARDD_CHECKPOINT_VERSION) {
    snprintf(err, errlen, "%s: format version %" PRIu32 ", expected %d", path,
             get_u32(head + 8), SHARDD_CHECKPOINT_VERSION);
    goto done;
  }
  if (get_u32(head + 12) != dtype || get_u64(head + 16) != numel ||
      get_u64(head + 24) != offset || get_u64(head + 32) != bytes ||
      get_u32(head + 44) != nlen) {
    snprintf(err, errlen,
             "%s: header (dtype %" PRIu32 ", numel %" PRIu64 ", offset %" PRIu64
             ", %" PRIu64 " bytes) does not match the manifest (dtype %" PRIu32
             ", numel %" PRIu64 ", offset %" PRIu64 ", %zu bytes)",
             path, get_u32(head + 12), get_u64(head + 16), get_u64(head + 24),
             get_u64(head + 32), dtype, numel, offset, bytes);
    goto done;
  }
  if ((uint64_t)st.st_size != HEADER_BYTES + nlen + bytes) {
    snprintf(err, errlen, "%s: %lld bytes, expected %zu (truncated or padded)",
             path, (long long)st.st_size, HEADER_BYTES + nlen + bytes);
    goto done;
  }
  if (read_all(fd, fname_in, nlen) != SHARDD_OK ||
      (fname_in[nlen] = '\0', strcmp(fname_in, name) != 0)) {
    snprintf(err, errlen, "%s: holds buffer \"%s\", the manifest says \"%s\"",
             path, fname_in, name);
    goto done;
  }
  if (read_all(fd, dst, bytes) != SHARDD_OK) {
    snprintf(err, errlen, "%s: short read", path);
    goto done;
  }
  uint32_t got = shardd__crc32c(0, dst, bytes);
  if (got != crc || get_u32(head + 40) != crc) {
    snprintf(err, errlen,
             "%s: CRC32C %08" PRIx32 " of the data, header says %08" PRIx32
             ", manifest %08" PRIx32,
             path, got, get_u32(head + 40), crc);
    goto done;
  }
  rc = SHARDD_OK;
done:
  free(fname_in);
  close(fd);
  return rc;
}

typedef struct {
  uint64_t old_id;
  shardd__obj *obj;
} id_map;

typedef struct {
  size_t buf;
  uint32_t rank;
  int master_valid;
  char *file;
  uint32_t crc;
  size_t bytes;
  int nstate;
  int loaded;
} pending_state;

typedef struct {
  char *name;
  uint64_t steps;
  uint8_t *spec;
  size_t spec_len;
  id_map *ids;
  size_t nids;
  pending_state *states;
  size_t nstates;
  shardd__optim *created;
} pending_optim;

static int hexval(char c) {
  if (c >= '0' && c <= '9')
    return c - '0';
  if (c >= 'a' && c <= 'f')
    return c - 'a' + 10;
  return -1;
}

static int cmp_id_map(const void *a, const void *b) {
  const id_map *x = a, *y = b;
  return x->old_id < y->old_id ? -1 : x->old_id > y->old_id;
}

/* Registers a recorded optimizer: its own registration with every ref id
 * replaced by the restored object's, through the same use case a client's
 * registration takes (optreg.h). */
static shardd_err register_pending(shardd__registry *reg, shardd__job *job,
                                   pending_optim *p, char *err, size_t errlen) {
  shardd__optspec spec;
  shardd_err rc = shardd__optspec_decode(p->spec, p->spec_len, &spec);
  if (rc != SHARDD_OK) {
    if (rc == SHARDD_E_NO_MEMORY)
      snprintf(err, errlen, "out of memory");
    else
      snprintf(err, errlen, "optimizer \"%s\": spec does not decode", p->name);
    return rc;
  }
  /* sorted for lookup: a scan per ref was quadratic, and 200k refs in a
   * manifest held the loop thread for minutes */
  if (p->nids > 0) /* qsort(NULL, 0) is undefined */
    qsort(p->ids, p->nids, sizeof *p->ids, cmp_id_map);
  for (size_t g = 0; g < spec.ngroups && rc == SHARDD_OK; g++) {
    for (size_t i = 0; i < spec.groups[g].nrefs; i++) {
      shardd__optspec_ref *ref = &spec.groups[g].refs[i];
      uint64_t id = 0, gen = 0;
      id_map key = {ref->id, NULL};
      const id_map *hit = p->nids ? bsearch(&key, p->ids, p->nids, sizeof *p->ids,
                                            cmp_id_map)
                                  : NULL;
      if (hit) {
        id = hit->obj->id;
        gen = hit->obj->generation;
      }
      if (id == 0) {
        snprintf(err, errlen, "optimizer \"%s\": ref %" PRIu64 " has no ref line",
                 p->name, ref->id);
        rc = SHARDD_E_INVAL;
        break;
      }
      ref->id = id;
      if (ref->has_generation) /* the handle the trainer registers anew */
        ref->generation = gen;
    }
  }
  if (rc == SHARDD_OK) {
    shardd__optreg_result res;
    rc = shardd__optreg_register(reg, job, &spec, 0, &res, err, errlen);
    if (rc != SHARDD_OK && res.refused)
      snprintf(err, errlen, "optimizer \"%s\" refused: %s", p->name,
               res.list ? res.list : shardd_strerror(rc));
    free(res.list);
    p->created = res.optim;
  }
  shardd__optspec_free(&spec);
  if (rc == SHARDD_OK)
    p->created->steps = p->steps;
  return rc;
}

/* Elements [lo, hi) of buffer b, as rank `rank` of a world of `world`
 * holds them: its shard's slice of the unpadded range. */
static void old_range(const shardd__buffer *b, uint32_t world, uint32_t rank,
                      uint64_t *lo, uint64_t *hi, uint64_t *old_s) {
  *old_s = (b->numel + world - 1) / world;
  *lo = (uint64_t)rank * *old_s;
  *hi = *lo + *old_s < b->numel ? *lo + *old_s : b->numel;
  if (*lo > *hi)
    *lo = *hi;
}

/* One shard file of a world of old_world ranks into buffer b: straight into
 * the rank's block when the world is the same, else element ranges copied
 * to whichever new rank holds them (shards are keyed by element offset, so
 * a checkpoint of W ranks restores into W'). */
static shardd_err load_shard(const ckdir *dir, const char *file, uint32_t crc,
                             shardd__buffer *b, uint32_t old_world,
                             uint32_t r, char *err, size_t errlen) {
  size_t esz = shardd_dtype_size(b->dtype);
  uint64_t lo, hi, old_s;
  old_range(b, old_world, r, &lo, &hi, &old_s);
  if (old_world == b->world)
    return load_data(dir, file, (uint32_t)b->dtype, b->shard_numel,
                     (uint64_t)r * b->shard_numel, b->hdr.name, crc,
                     (char *)b->blocks[r]->ptr + b->shard_off,
                     b->shard_numel * esz, err, errlen);
  char *tmp = malloc(old_s > 0 ? old_s * esz : 1);
  if (tmp == NULL) {
    snprintf(err, errlen, "out of memory");
    return SHARDD_E_NO_MEMORY;
  }
  shardd_err rc = load_data(dir, file, (uint32_t)b->dtype, old_s,
                            (uint64_t)r * old_s, b->hdr.name, crc, tmp,
                            old_s * esz, err, errlen);
  for (uint64_t e = lo; rc == SHARDD_OK && e < hi;) {
    uint64_t q = e / b->shard_numel, off = e % b->shard_numel;
    uint64_t n = b->shard_numel - off < hi - e ? b->shard_numel - off : hi - e;
    memcpy((char *)b->blocks[q]->ptr + b->shard_off + off * esz,
           tmp + (e - lo) * esz, n * esz);
    e += n;
  }
  free(tmp);
  return rc;
}

static shardd__optim_shard *find_shard(shardd__optim *o, const shardd__buffer *b,
                                       uint32_t rank) {
  for (size_t k = 0; k < o->nshards; k++)
    if (o->shards[k].buf == b && o->shards[k].rank == rank)
      return &o->shards[k];
  return NULL;
}

/* Loads every recorded state into the registered optimizer. Same world:
 * each shard that keeps state is covered by exactly one file, region for
 * region. Another world: each file's elements go to the new shards that
 * hold them, array by array (master copy, then the arrays both layouts
 * have), and every new shard that keeps state must receive some. */
static shardd_err load_states(const ckdir *dir, shardd__buffer **bufs,
                              uint32_t old_world, pending_optim *p, char *err,
                              size_t errlen) {
  shardd__optim *o = p->created;
  for (size_t k = 0; k < o->nshards; k++)
    o->shards[k].master_valid = -1; /* not yet seen */
  for (size_t i = 0; i < p->nstates; i++) {
    pending_state *ps = &p->states[i];
    shardd__buffer *b = bufs[ps->buf];
    if (old_world == b->world) {
      shardd__optim_shard *sh = find_shard(o, b, ps->rank);
      if (sh == NULL || sh->state == NULL || sh->state->bytes != ps->bytes ||
          sh->master_valid != -1) {
        snprintf(err, errlen, "%s/%s: does not fit optimizer \"%s\"", dir->path,
                 ps->file, p->name);
        return SHARDD_E_INVAL;
      }
      shardd_err rc = load_data(dir, ps->file, SHARDD_DTYPE_FP32, ps->bytes / 4,
                                (uint64_t)ps->rank * b->shard_numel, b->hdr.name,
                                ps->crc, sh->state->ptr, ps->bytes, err, errlen);
      if (rc != SHARDD_OK)
        return rc;
      sh->master_valid = ps->master_valid;
      continue;
    }
    uint64_t lo, hi, old_s;
    old_range(b, old_world, ps->rank, &lo, &hi, &old_s);
    size_t omaster, ooffs[3] = {0, 0, 0};
    size_t used = shardd__optim_state_layout(b->dtype, old_s, ps->nstate, &omaster, ooffs);
    if (ps->rank >= old_world || used == 0 || used > ps->bytes) {
      snprintf(err, errlen, "%s/%s: does not fit optimizer \"%s\"", dir->path,
               ps->file, p->name);
      return SHARDD_E_INVAL;
    }
    char *tmp = malloc(ps->bytes);
    if (tmp == NULL) {
      snprintf(err, errlen, "out of memory");
      return SHARDD_E_NO_MEMORY;
    }
    shardd_err rc = load_data(dir, ps->file, SHARDD_DTYPE_FP32, ps->bytes / 4,
                              (uint64_t)ps->rank * old_s, b->hdr.name, ps->crc, tmp,
                              ps->bytes, err, errlen);
    int wide = b->dtype != SHARDD_DTYPE_FP32;
    for (uint64_t e = lo; rc == SHARDD_OK && e < hi;) {
      uint32_t q = (uint32_t)(e / b->shard_numel);
      uint64_t off = e % b->shard_numel;
      uint64_t n = b->shard_numel - off < hi - e ? b->shard_numel - off : hi - e;
      shardd__optim_shard *sh = find_shard(o, b, q);
      if (sh && sh->state) {
        size_t src = (e - lo) * 4, dst = off * 4;
        if (wide)
          memcpy((char *)sh->state->ptr + sh->master_off + dst,
                 tmp + omaster + src, n * 4);
        for (int j = 0; j < ps->nstate && j < sh->nstate; j++)
          memcpy((char *)sh->state->ptr + sh->state_offs[j] + dst,
                 tmp + ooffs[j] + src, n * 4);
        sh->master_valid = sh->master_valid == -1
                               ? ps->master_valid
                               : sh->master_valid && ps->master_valid;
      }
      e += n;
    }
    free(tmp);
    if (rc != SHARDD_OK)
      return rc;
  }
  for (size_t k = 0; k < o->nshards; k++) {
    shardd__optim_shard *sh = &o->shards[k];
    if (sh->master_valid == -1) {
      if (sh->state) {
        snprintf(err, errlen,
                 "optimizer \"%s\": no state in the checkpoint for buffer \"%s\" "
                 "rank %" PRIu32, p->name, sh->buf->hdr.name, sh->rank);
        return SHARDD_E_INVAL;
      }
      sh->master_valid = 0;
    }
  }
  return SHARDD_OK;
}

#define MAX_TOK 64

typedef enum { LINE_OK, LINE_EOF, LINE_LONG, LINE_NUL, LINE_NOMEM, LINE_IO } line_rc;

/* Reads the next line of f, without its newline, into *buf (grown, to at
 * most max + 1 bytes). A NUL byte is refused: the tokenizer would silently
 * end the line there. */
static line_rc read_line(FILE *f, char **buf, size_t *cap, size_t max) {
  if (*cap == 0) {
    if ((*buf = malloc(256)) == NULL)
      return LINE_NOMEM;
    *cap = 256;
  }
  size_t n = 0;
  int c;
  while ((c = getc_unlocked(f)) != EOF && c != '\n') {
    if (n == max)
      return LINE_LONG;
    if (c == '\0')
      return LINE_NUL;
    if (n + 1 >= *cap) {
      size_t ncap = *cap * 2 < max + 1 ? *cap * 2 : max + 1;
      char *nb = realloc(*buf, ncap);
      if (nb == NULL)
        return LINE_NOMEM;
      *buf = nb;
      *cap = ncap;
    }
    (*buf)[n++] = (char)c;
  }
  if (c == EOF && ferror(f))
    return LINE_IO;
  if (c == EOF && n == 0)
    return LINE_EOF;
  (*buf)[n] = '\0';
  return LINE_OK;
}

/* Checks the checksum on the "end" line of a version 3 manifest against
 * the bytes before it, before any line is acted upon; rewinds f. Older
 * versions have none. Lines too long or with a NUL byte are left to the
 * parser, which names them. */
static shardd_err verify_manifest(FILE *f, const char *path, char *err,
                                  size_t errlen) {
  char *line = NULL;
  size_t cap = 0;
  uint32_t crc = 0;
  int lineno = 0, version = 0;
  shardd_err rc = SHARDD_OK;
  for (;;) {
    line_rc lr = read_line(f, &line, &cap, MANIFEST_LINE_MAX);
    if (lr != LINE_OK)
      break;
    lineno++;
    if (lineno == 1 && sscanf(line, "shardd-checkpoint %d", &version) != 1)
      break;
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

shardd_err shardd__checkpoint_restore(shardd__registry *reg, const char *dir,
                                      int64_t as_uid, uint32_t world,
                                      shardd__job **out, char *err,
                                      size_t errlen) {
  *out = NULL;
  /* payloads are read and written through the daemon's own mapping */
  if (!(reg->backend->caps & SHARDD__BACKEND_CAP_HOST_MAPPED)) {
    snprintf(err, errlen, "checkpoints support the host backend only");
    return SHARDD_E_INVAL;
  }
  char path[4096];
  snprintf(path, sizeof path, "%s/%s", dir, MANIFEST);
  ckdir dd = {-1, dir, as_uid};
  dd.fd = open_dir_nofollow(dir, err, errlen);
  if (dd.fd < 0)
    return errno == ELOOP || errno == ENOTDIR ? SHARDD_E_PERMISSION : SHARDD_E_IO;
  struct stat dst;
  if (as_uid > 0 && (fstat(dd.fd, &dst) != 0 ||
                     (dst.st_uid != (uid_t)as_uid && dst.st_uid != geteuid()))) {
    snprintf(err, errlen, "%s: the directory is neither yours nor the "
             "daemon's; restore from a directory you own", dir);
    close(dd.fd);
    return SHARDD_E_PERMISSION;
  }
  int mfd = open_regular(&dd, MANIFEST, err, errlen);
  FILE *f = mfd >= 0 ? fdopen(mfd, "r") : NULL;
  if (f == NULL) {
    int e = errno;
    if (mfd >= 0) {
      snprintf(err, errlen, "%s: %s", path, strerror(e));
      close(mfd);
    } else if (e == ENOENT) {
      snprintf(err, errlen, "%s: %s (an incomplete checkpoint has no manifest)",
               path, strerror(e));
    }
    close(dd.fd);
    return e == EPERM || e == ELOOP ? SHARDD_E_PERMISSION : SHARDD_E_IO;
  }
  shardd_err rc = verify_manifest(f, path, err, errlen);
  shardd__job *job = NULL;
  shardd__buffer **bufs = NULL;
  size_t nb = 0;
  pending_optim *po = NULL;
  size_t npo = 0;
  int ended = 0, lineno = 0;
  uint32_t old_world = 0;
  int mversion = 0;
  char *line = NULL;
  size_t cap = 0;
  char why[512], sub[512];
  /* seen[i]: bit r set once buffer i's shard of old rank r was loaded. A
   * buffer line registers zeroed memory; only its shard lines fill it, so
   * one without them restored zeros as if they were the checkpoint. */
  uint8_t **seen = NULL;
  size_t nshard_lines = 0;
  if (rc != SHARDD_OK)
    goto fail;

  for (;;) {
    line_rc lr = read_line(f, &line, &cap, MANIFEST_LINE_MAX);
    if (lr == LINE_EOF)
      break;
    lineno++;
    if (lr != LINE_OK) {
      if (lr == LINE_LONG)
        snprintf(err, errlen, "%s line %d: longer than %zu bytes (not a "
                 "manifest shardd wrote); not reading further", path, lineno,
                 MANIFEST_LINE_MAX);
      else if (lr == LINE_NUL)
        snprintf(err, errlen, "%s line %d: holds a NUL byte (not a manifest "
                 "shardd wrote)", path, lineno);
      else if (lr == LINE_NOMEM)
        snprintf(err, errlen, "%s line %d: out of memory", path, lineno);
      else
        snprintf(err, errlen, "%s line %d: %s", path, lineno, strerror(errno));
      rc = lr == LINE_NOMEM ? SHARDD_E_NO_MEMORY
           : lr == LINE_IO  ? SHARDD_E_IO
                            : SHARDD_E_INVAL;
      goto fail;
    }
    char *tok[MAX_TOK];
    int nt = 0;
    for (char *save, *t = strtok_r(line, " ", &save); t && nt < MAX_TOK;
         t = strtok_r(NULL, " ", &save))
      tok[nt++] = t;
    if (nt == 0)
      continue;
#define BAD(...)                                                             \
  do {                                                                       \
    snprintf(why, sizeof why, __VA_ARGS__);                                  \
    snprintf(err, errlen, "%s line %d: %s", path, lineno, why);              \
    if (rc == SHARDD_OK)                                                     \
      rc = SHARDD_E_INVAL;                                                   \
    goto fail;                                                               \
  } while (0)
    rc = SHARDD_E_INVAL;
    if (lineno == 1) {
      if (nt != 2 || strcmp(tok[0], "shardd-checkpoint") ||
          (mversion = atoi(tok[1])) < 1 || mversion > SHARDD_MANIFEST_VERSION)
        BAD("not a shardd checkpoint manifest of version 1 to %d",
            SHARDD_MANIFEST_VERSION);
      continue;
    }
    if (ended)
      BAD("text after \"end\"");
    if (!strcmp(tok[0], "end")) {
      if (nt != (mversion >= 3 ? 2 : 1))
        BAD("malformed \"end\" line");
      ended = 1;
    } else if (!strcmp(tok[0], "job") && nt == 4 && job == NULL) {
      if (!dec_name(tok[1]))
        BAD("bad job name");
      uint32_t owner = (uint32_t)strtoul(tok[3], NULL, 10);
      if (as_uid > 0 && (uint32_t)as_uid != owner) {
        snprintf(err, errlen, "job \"%s\" in %s belongs to another user; "
                 "only it or root may restore it", tok[1], dir);
        rc = SHARDD_E_PERMISSION;
        goto fail;
      }
      if (shardd__job_find(reg, tok[1])) {
        snprintf(err, errlen,
                 "job \"%s\" exists already; release it before restoring",
                 tok[1]);
        rc = SHARDD_E_BUSY;
        goto fail;
      }
      old_world = (uint32_t)strtoul(tok[2], NULL, 10);
      if (old_world == 0)
        BAD("world 0");
      rc = shardd__job_get(reg, tok[1], world ? world : old_world, owner, &job,
                           sub, sizeof sub);
      if (rc != SHARDD_OK)
        BAD("%s", sub);
    } else if (job == NULL) {
      BAD("\"%s\" before the job line", tok[0]);
    } else if (!strcmp(tok[0], "buffer") && nt == (mversion >= 2 ? 5 : 4)) {
      shardd__buffer *b;
      int created;
      if (!dec_name(tok[1]))
        BAD("bad buffer name");
      rc = shardd__buffer_register(reg, job, tok[1], (shardd_dtype)atoi(tok[2]),
                                   strtoull(tok[3], NULL, 10), &b, &created,
                                   sub, sizeof sub);
      if (rc != SHARDD_OK)
        BAD("%s", sub);
      if (!created)
        BAD("buffer \"%s\" listed twice", tok[1]);
      /* A restored handle is a new generation: one kept from before the
       * checkpoint is refused as stale (version 1 recorded none: 1). */
      uint64_t gen = mversion >= 2 ? strtoull(tok[4], NULL, 10) : 1;
      shardd__obj_set_generation(&b->hdr, gen + 1);
      shardd__buffer **nbufs = realloc(bufs, (nb + 1) * sizeof *bufs);
      if (nbufs == NULL)
        BAD("out of memory");
      bufs = nbufs;
      uint8_t **nseen = realloc(seen, (nb + 1) * sizeof *seen);
      if (nseen == NULL)
        BAD("out of memory");
      seen = nseen;
      if ((seen[nb] = calloc((old_world + 7) / 8, 1)) == NULL)
        BAD("out of memory");
      bufs[nb++] = b;
    } else if (!strcmp(tok[0], "shard") && nt == 5) {
      size_t bi = strtoul(tok[1], NULL, 10);
      uint32_t r = (uint32_t)strtoul(tok[2], NULL, 10);
      if (bi >= nb || r >= old_world || strchr(tok[3], '/'))
        BAD("shard of unknown buffer %zu rank %" PRIu32, bi, r);
      if (seen[bi][r / 8] & (1u << (r % 8)))
        BAD("shard of buffer %zu rank %" PRIu32 " listed twice", bi, r);
      seen[bi][r / 8] |= (uint8_t)(1u << (r % 8));
      nshard_lines++;
      rc = load_shard(&dd, tok[3], (uint32_t)strtoul(tok[4], NULL, 16), bufs[bi],
                      old_world, r, err, errlen);
      if (rc != SHARDD_OK)
        goto fail;
    } else if (!strcmp(tok[0], "view") && nt >= 6) {
      size_t bi = strtoul(tok[1], NULL, 10);
      int ndim = atoi(tok[5]);
      int extra = mversion >= 2 ? 2 : 0; /* generation, requires_grad */
      if (bi >= nb || ndim < 0 || ndim > 16 || nt != 6 + ndim + extra ||
          !dec_name(tok[2]))
        BAD("malformed view");
      int64_t shape[16];
      for (int d = 0; d < ndim; d++)
        shape[d] = strtoll(tok[6 + d], NULL, 10);
      uint64_t gen = extra ? strtoull(tok[6 + ndim], NULL, 10) : 1;
      int requires_grad = extra ? atoi(tok[7 + ndim]) != 0 : 1;
      shardd__view *v;
      int created;
      rc = shardd__view_register_ex(reg, job, bufs[bi]->hdr.id, 0, tok[2],
                                    strtoull(tok[3], NULL, 10),
                                    strtoull(tok[4], NULL, 10), shape, ndim,
                                    requires_grad, &v, &created, sub,
                                    sizeof sub);
      if (rc != SHARDD_OK)
        BAD("%s", sub);
      shardd__obj_set_generation(&v->hdr, gen + 1);
    } else if (!strcmp(tok[0], "optimizer") && nt == 5) {
      if ((size_t)strtoul(tok[1], NULL, 10) != npo || !dec_name(tok[2]))
        BAD("optimizers out of order");
      pending_optim *np = realloc(po, (npo + 1) * sizeof *po);
      if (np == NULL)
        BAD("out of memory");
      po = np;
      pending_optim *p = &po[npo++];
      memset(p, 0, sizeof *p);
      p->name = strdup(tok[2]);
      p->steps = strtoull(tok[3], NULL, 10);
      size_t hl = strlen(tok[4]);
      p->spec = malloc(hl / 2 + 1);
      if (p->name == NULL || p->spec == NULL || hl % 2)
        BAD("bad optimizer spec");
      for (size_t k = 0; k < hl / 2; k++) {
        int hi = hexval(tok[4][2 * k]), lo = hexval(tok[4][2 * k + 1]);
        if (hi < 0 || lo < 0)
          BAD("bad optimizer spec");
        p->spec[k] = (uint8_t)(hi << 4 | lo);
      }
      p->spec_len = hl / 2;
    } else if (!strcmp(tok[0], "ref") && (nt == 5 || nt == 6)) {
      size_t oi = strtoul(tok[1], NULL, 10);
      size_t bi = strtoul(tok[4], NULL, 10);
      if (oi >= npo || bi >= nb)
        BAD("ref to unknown optimizer or buffer");
      shardd__obj *o = &bufs[bi]->hdr;
      if (!strcmp(tok[3], "view")) {
        if (nt != 6 || !dec_name(tok[5]) ||
            (o = shardd__map_get_str(&bufs[bi]->views, tok[5])) == NULL)
          BAD("ref to unknown view");
      } else if (strcmp(tok[3], "buffer") || nt != 5) {
        BAD("malformed ref");
      }
      pending_optim *p = &po[oi];
      id_map *ni = realloc(p->ids, (p->nids + 1) * sizeof *ni);
      if (ni == NULL)
        BAD("out of memory");
      p->ids = ni;
      p->ids[p->nids++] = (id_map){strtoull(tok[2], NULL, 10), o};
    } else if (!strcmp(tok[0], "state") && nt == 9) {
      size_t oi = strtoul(tok[1], NULL, 10);
      size_t bi = strtoul(tok[2], NULL, 10);
      if (oi >= npo || bi >= nb || strchr(tok[5], '/'))
        BAD("state of unknown optimizer or buffer");
      pending_optim *p = &po[oi];
      pending_state *ns = realloc(p->states, (p->nstates + 1) * sizeof *ns);
      if (ns == NULL)
        BAD("out of memory");
      p->states = ns;
      pending_state *ps = &p->states[p->nstates++];
      memset(ps, 0, sizeof *ps);
      ps->buf = bi;
      ps->rank = (uint32_t)strtoul(tok[3], NULL, 10);
      ps->master_valid = atoi(tok[4]) != 0;
      ps->crc = (uint32_t)strtoul(tok[6], NULL, 16);
      ps->bytes = strtoul(tok[7], NULL, 10);
      ps->nstate = atoi(tok[8]);
      if (ps->nstate < 0 || ps->nstate > 3)
        BAD("bad state count");
      if ((ps->file = strdup(tok[5])) == NULL)
        BAD("out of memory");
    } else {
      BAD("unknown or malformed line \"%s\"", tok[0]);
    }
#undef BAD
  }
  if (!ended) {
    snprintf(err, errlen, "%s: no \"end\" line (truncated manifest)", path);
    rc = SHARDD_E_INVAL;
    goto fail;
  }
  rc = SHARDD_E_INVAL;
  if (job == NULL) {
    /* "shardd-checkpoint 2" + "end" restored nothing and returned OK: the
     * callers took the NULL job and the daemon died with every shard. */
    snprintf(err, errlen, "%s: no \"job\" line (not a checkpoint shardd wrote)",
             path);
    goto fail;
  }
  if (nb > 0 && nshard_lines == 0) {
    snprintf(err, errlen, "%s: names %zu buffer%s but no shard of any "
             "(a corrupt or truncated manifest)", path, nb, nb == 1 ? "" : "s");
    goto fail;
  }
  for (size_t i = 0; i < nb; i++)
    for (uint32_t r = 0; r < old_world; r++)
      if (!(seen[i][r / 8] & (1u << (r % 8)))) {
        snprintf(err, errlen, "%s: no shard of buffer \"%s\" rank %" PRIu32
                 " (a corrupt or truncated manifest)", path,
                 bufs[i]->hdr.name, r);
        goto fail;
      }
  for (size_t i = 0; i < npo; i++) {
    if ((rc = register_pending(reg, job, &po[i], err, errlen)) != SHARDD_OK ||
        (rc = load_states(&dd, bufs, old_world, &po[i], err, errlen)) != SHARDD_OK)
      goto fail;
  }
  rc = SHARDD_OK;
  *out = job;
  job = NULL;

fail:
  if (job)
    shardd__job_release(reg, job);
  for (size_t i = 0; i < npo; i++) {
    free(po[i].name);
    free(po[i].spec);
    free(po[i].ids);
    for (size_t k = 0; k < po[i].nstates; k++)
      free(po[i].states[k].file);
    free(po[i].states);
  }
  free(po);
  for (size_t i = 0; i < nb; i++)
    free(seen[i]);
  free(seen);
  free(bufs);
  free(line);
  fclose(f);
  close(dd.fd);
  return rc;
}
