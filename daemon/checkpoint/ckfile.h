/* ckfile.h — the file layer under checkpoint write and restore (inside
 * the checkpoint module; checkpoint.h is its public interface): the
 * directory opened without following symlinks, who may write into or read
 * from it, files written atomically (temporary name, fsync, rename) and
 * data files (header, buffer name, payload) written and checked on the way
 * back, with their CRC32C; and each uid's --checkpoint-root directory.
 *
 * Errors fill the caller's err with the path that failed. */
#ifndef SHARDD_CKFILE_H
#define SHARDD_CKFILE_H

#include <stddef.h>
#include <stdint.h>

#include "shardd.h"

/* The data files' header version (the manifest's are manifest.h's). */
#define SHARDD_CHECKPOINT_VERSION 1

/* CRC32C (Castagnoli) of n bytes, continuing from crc (0 to start). */
uint32_t shardd__crc32c(uint32_t crc, const void *data, size_t n);

/* The directory a checkpoint lives in, opened once: every file below it is
 * opened relative to fd with O_NOFOLLOW, so no symlink planted in a
 * client's directory (or on the way to it) redirects the daemon's own
 * rights to another user's file. path is for messages only. as_uid is who
 * asks (< 0 the daemon itself, 0 root); a restore for the daemon or root
 * sets it to the job's recorded owner once that is known (restore.c), so
 * its data files too must be that owner's or the daemon's. */
typedef struct {
  int fd;
  const char *path;
  int64_t as_uid;
} shardd__ckdir;

/* Opens path as a directory, one component at a time with O_NOFOLLOW. The
 * descriptor is the caller's; -1 with err and errno set (ELOOP or ENOTDIR:
 * a symlink or a non-directory on the way). */
int shardd__ck_open_dir(const char *path, char *err, size_t errlen);

/* Opens, making it when missing, the directory a checkpoint of as_uid is
 * written into; *out is the caller's to close. SHARDD_E_PERMISSION when it
 * is not as_uid's to write into (see checkpoint.h). home: as_uid's own
 * directory under --checkpoint-root, which dir is below, or NULL (see
 * shardd__checkpoint_write_in). */
shardd_err shardd__ck_open_write_dir(const char *dir, int64_t as_uid,
                                     const char *home, int *out, char *err,
                                     size_t errlen);

shardd_err shardd__ck_fsync_dir(const shardd__ckdir *d, char *err,
                                size_t errlen);

/* Writes d/fname atomically: head (may be NULL), then payload. */
shardd_err shardd__ck_write_file(const shardd__ckdir *d, const char *fname,
                                 const void *head, size_t head_len,
                                 const void *payload, size_t bytes, char *err,
                                 size_t errlen);

/* Writes a data file of bytes of payload, the header saying dtype, numel,
 * element offset and the buffer's name; *crc is the payload's CRC32C. */
shardd_err shardd__ck_write_data(const shardd__ckdir *dir, const char *fname,
                                 uint32_t dtype, uint64_t numel,
                                 uint64_t offset, const char *name,
                                 const void *payload, size_t bytes,
                                 uint32_t *crc, char *err, size_t errlen);

/* As ck_write_data in two halves, so that many files' write-back overlaps
 * (checkpoint_run_many): stage writes d/.fname.tmp and starts its
 * write-back without waiting for it; commit fsyncs it and renames it to
 * fname. A temporary either fails is removed. */
shardd_err shardd__ck_stage_data(const shardd__ckdir *dir, const char *fname,
                                 uint32_t dtype, uint64_t numel,
                                 uint64_t offset, const char *name,
                                 const void *payload, size_t bytes,
                                 uint32_t *crc, char *err, size_t errlen);
shardd_err shardd__ck_commit_data(const shardd__ckdir *d, const char *fname,
                                  char *err, size_t errlen);

/* Opens d/fname for reading if it is a regular file the asker may have
 * read (one link, its own or the daemon's); the descriptor is the
 * caller's. -1 with err and errno set: EPERM or ELOOP refused, EINVAL not
 * a plain file name or not a regular file, else the open's errno. */
int shardd__ck_open_regular(const shardd__ckdir *d, const char *fname,
                            char *err, size_t errlen);

/* Reads data file dir/fname into dst (bytes) once its header matches dtype,
 * numel, offset and name, and checks the payload against crc. */
shardd_err shardd__ck_load_data(const shardd__ckdir *dir, const char *fname,
                                uint32_t dtype, uint64_t numel,
                                uint64_t offset, const char *name,
                                uint32_t crc, void *dst, size_t bytes,
                                char *err, size_t errlen);

/* --checkpoint-root: uid's own directory root/UID, where all its
 * checkpoints go. With create it is made when missing (mode 0700, handed
 * to uid with chown when the daemon runs as root, else the daemon's own);
 * without, a missing one is no error. One that exists must be a directory
 * (not a symlink) owned by uid or, when the daemon is not root, by the
 * daemon: SHARDD_E_PERMISSION otherwise, naming it. */
shardd_err shardd__checkpoint_user_dir(const char *root, uint32_t uid,
                                       int create, char *err, size_t errlen);

#endif /* SHARDD_CKFILE_H */
