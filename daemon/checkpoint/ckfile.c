/* ckfile.c — the checkpoint module's file layer (see ckfile.h): CRC32C,
 * the no-follow directory walk, owner checks, atomic file writes and data
 * files with their little-endian headers. */
#include "ckfile.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "access.h"

#define MAGIC "SHRDCKPT"
#define HEADER_BYTES 64

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

/* Opens path as a directory, walking it one component at a time with
 * O_NOFOLLOW: a string check of the path cannot see a symlink inside
 * --checkpoint-root that points out of it; this walk refuses it.
 * -1 with err and errno set. */
int shardd__ck_open_dir(const char *path, char *err, size_t errlen) {
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
 * into, for as_uid (see shardd__ckdir). A missing directory is made only inside
 * one the client owns, and handed to it (chown, when the daemon may). */
shardd_err shardd__ck_open_write_dir(const char *dir, int64_t as_uid,
                                     const char *home, int *out, char *err,
                                     size_t errlen) {
  *out = -1;
  /* below the client's own directory under --checkpoint-root, what the
   * daemon made is the client's too (a daemon that is not root cannot
   * chown it) */
  size_t hn = home ? strlen(home) : 0;
  int confined = as_uid > 0 && home && strncmp(dir, home, hn) == 0 &&
                 dir[hn] == '/';
  uid_t me = geteuid();
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
  int pfd = shardd__ck_open_dir(parent, err, errlen);
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
    if (as_uid > 0 && pst.st_uid != (uint32_t)as_uid &&
        !(confined && pst.st_uid == me)) {
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
  if (as_uid > 0 &&
      (fstat(fd, &st) != 0 ||
       !(dir_writable_by(&st, &pst, (uint32_t)as_uid) ||
         (confined && (st.st_uid == (uid_t)as_uid || st.st_uid == me))))) {
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

shardd_err shardd__checkpoint_user_dir(const char *root, uint32_t uid,
                                       int create, char *err, size_t errlen) {
  int rfd = shardd__ck_open_dir(root, err, errlen);
  if (rfd < 0)
    return errno == ELOOP || errno == ENOTDIR ? SHARDD_E_PERMISSION
                                              : SHARDD_E_IO;
  char name[16];
  snprintf(name, sizeof name, "%" PRIu32, uid);
  size_t n = shardd__access_root_len(root);
  shardd_err rc = SHARDD_E_IO;
  int fd = -1;
  if (create && mkdirat(rfd, name, 0700) == 0) {
    if (geteuid() == 0 &&
        fchownat(rfd, name, (uid_t)uid, (gid_t)-1, AT_SYMLINK_NOFOLLOW) != 0) {
      int e = errno;
      unlinkat(rfd, name, AT_REMOVEDIR);
      snprintf(err, errlen, "chown %.*s/%s: %s", (int)n, root, name, strerror(e));
      goto done;
    }
  } else if (create && errno != EEXIST) {
    snprintf(err, errlen, "mkdir %.*s/%s: %s", (int)n, root, name, strerror(errno));
    goto done;
  }
  fd = openat(rfd, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  struct stat st;
  if (fd < 0) {
    if (errno == ENOENT && !create) {
      rc = SHARDD_OK; /* nothing there to trust or distrust */
    } else if (errno == ELOOP || errno == ENOTDIR) {
      snprintf(err, errlen, "%.*s/%s, uid %s's checkpoint directory, is a "
               "symlink or not a directory; refused", (int)n, root, name, name);
      rc = SHARDD_E_PERMISSION;
    } else {
      snprintf(err, errlen, "%.*s/%s: %s", (int)n, root, name, strerror(errno));
    }
    goto done;
  }
  if (fstat(fd, &st) != 0) {
    snprintf(err, errlen, "%.*s/%s: %s", (int)n, root, name, strerror(errno));
    goto done;
  }
  if (st.st_uid != (uid_t)uid && !(st.st_uid == geteuid() && geteuid() != 0)) {
    snprintf(err, errlen, "%.*s/%s, uid %s's checkpoint directory, belongs to "
             "uid %u; refused (an admin should remove or chown it)", (int)n,
             root, name, name, (unsigned)st.st_uid);
    rc = SHARDD_E_PERMISSION;
    goto done;
  }
  rc = SHARDD_OK;
done:
  if (fd >= 0)
    close(fd);
  close(rfd);
  return rc;
}

shardd_err shardd__ck_fsync_dir(const shardd__ckdir *d, char *err,
                                size_t errlen) {
  if (fsync(d->fd) != 0) {
    snprintf(err, errlen, "fsync %s: %s", d->path, strerror(errno));
    return SHARDD_E_IO;
  }
  return SHARDD_OK;
}

/* Writes d/.fname.tmp: head (may be NULL), then payload; with sync
 * fsync'ed too. Removed again on failure. */
static shardd_err write_temp(const shardd__ckdir *d, const char *fname,
                             const void *head, size_t head_len,
                             const void *payload, size_t bytes, int sync,
                             char *err, size_t errlen) {
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
      write_all(fd, payload, bytes) != SHARDD_OK || (sync && fsync(fd) != 0)) {
    snprintf(err, errlen, "write %s/%s: %s", d->path, tmp, strerror(errno));
    rc = SHARDD_E_IO;
  }
  if (rc == SHARDD_OK && !sync)
    /* start the write-back now, without waiting for it: the commit's
     * fsync then finds most of it done */
    sync_file_range(fd, 0, 0, SYNC_FILE_RANGE_WRITE);
  if (close(fd) != 0 && rc == SHARDD_OK) {
    snprintf(err, errlen, "close %s/%s: %s", d->path, tmp, strerror(errno));
    rc = SHARDD_E_IO;
  }
  if (rc != SHARDD_OK)
    unlinkat(d->fd, tmp, 0);
  return rc;
}

/* Renames d/.fname.tmp to fname; removes it on failure. */
static shardd_err rename_temp(const shardd__ckdir *d, const char *fname,
                              char *err, size_t errlen) {
  char tmp[256];
  snprintf(tmp, sizeof tmp, ".%s.tmp", fname);
  if (renameat(d->fd, tmp, d->fd, fname) != 0) {
    snprintf(err, errlen, "rename %s/%s: %s", d->path, fname, strerror(errno));
    unlinkat(d->fd, tmp, 0);
    return SHARDD_E_IO;
  }
  return SHARDD_OK;
}

/* Writes d/fname through a temporary name: head (may be NULL), then
 * payload, fsync, rename. */
shardd_err shardd__ck_write_file(const shardd__ckdir *d, const char *fname,
                                 const void *head, size_t head_len,
                                 const void *payload, size_t bytes, char *err,
                                 size_t errlen) {
  shardd_err rc = write_temp(d, fname, head, head_len, payload, bytes, 1, err,
                             errlen);
  return rc == SHARDD_OK ? rename_temp(d, fname, err, errlen) : rc;
}

shardd_err shardd__ck_commit_data(const shardd__ckdir *d, const char *fname,
                                  char *err, size_t errlen) {
  char tmp[256];
  snprintf(tmp, sizeof tmp, ".%s.tmp", fname);
  /* the daemon's own file, just written: opened without following links */
  int fd = openat(d->fd, tmp, O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
  if (fd < 0) {
    snprintf(err, errlen, "open %s/%s: %s", d->path, tmp, strerror(errno));
    return SHARDD_E_IO;
  }
  int bad = fsync(fd) != 0;
  int e = errno;
  close(fd);
  if (bad) {
    snprintf(err, errlen, "fsync %s/%s: %s", d->path, tmp, strerror(e));
    unlinkat(d->fd, tmp, 0);
    return SHARDD_E_IO;
  }
  return rename_temp(d, fname, err, errlen);
}

/* A data file: header (64 bytes), the buffer's name, the payload. */
static shardd_err write_data(const shardd__ckdir *dir, const char *fname,
                             uint32_t dtype, uint64_t numel, uint64_t offset,
                             const char *name, const void *payload,
                             size_t bytes, uint32_t *crc, int staged, char *err,
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
  shardd_err rc = staged ? write_temp(dir, fname, head, HEADER_BYTES + nlen,
                                       payload, bytes, 0, err, errlen)
                         : shardd__ck_write_file(dir, fname, head,
                                                 HEADER_BYTES + nlen, payload,
                                                 bytes, err, errlen);
  free(head);
  return rc;
}

shardd_err shardd__ck_write_data(const shardd__ckdir *dir, const char *fname,
                                 uint32_t dtype, uint64_t numel,
                                 uint64_t offset, const char *name,
                                 const void *payload, size_t bytes,
                                 uint32_t *crc, char *err, size_t errlen) {
  return write_data(dir, fname, dtype, numel, offset, name, payload, bytes,
                    crc, 0, err, errlen);
}

shardd_err shardd__ck_stage_data(const shardd__ckdir *dir, const char *fname,
                                 uint32_t dtype, uint64_t numel,
                                 uint64_t offset, const char *name,
                                 const void *payload, size_t bytes,
                                 uint32_t *crc, char *err, size_t errlen) {
  return write_data(dir, fname, dtype, numel, offset, name, payload, bytes,
                    crc, 1, err, errlen);
}

/* Opens path for reading if it is a regular file; else -1 with err set.
 * Restore runs on the loop thread: a FIFO (or a device) planted in the
 * client's checkpoint directory blocked open(2) or read(2), and with them
 * the whole daemon, forever. O_NONBLOCK makes the open return; the check
 * refuses the file; then reads block normally again. */
int shardd__ck_open_regular(const shardd__ckdir *d, const char *fname,
                            char *err, size_t errlen) {
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
shardd_err shardd__ck_load_data(const shardd__ckdir *dir, const char *fname,
                                uint32_t dtype, uint64_t numel, uint64_t offset,
                                const char *name, uint32_t crc, void *dst,
                                size_t bytes, char *err, size_t errlen) {
  char path[4096];
  snprintf(path, sizeof path, "%s/%s", dir->path, fname);
  int fd = shardd__ck_open_regular(dir, fname, err, errlen);
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
