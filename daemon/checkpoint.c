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

/* Removes the data files of d whose name holds (keep == 0) or does not hold
 * (keep == 1) "-TAG.": after a new manifest is in place, the previous
 * generation's files; after a failed write, the new generation's. */
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
  return shardd__checkpoint_write_in(reg, job, dirpath, as_uid, NULL, err,
                                     errlen);
}

shardd_err shardd__checkpoint_write_in(shardd__registry *reg, shardd__job *job,
                                       const char *dirpath, int64_t as_uid,
                                       const char *home, char *err,
                                       size_t errlen) {
  /* payloads are read and written through the daemon's own mapping */
  if (!(reg->backend->caps & SHARDD__BACKEND_CAP_HOST_MAPPED)) {
    snprintf(err, errlen, "checkpoints support the host backend only");
    return SHARDD_E_INVAL;
  }
  shardd__ckdir dd = {-1, dirpath, as_uid};
  const shardd__ckdir *dir = &dd;
  shardd_err orc =
      shardd__ck_open_write_dir(dirpath, as_uid, home, &dd.fd, err, errlen);
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
  shardd__manifest_enc_name(&m, job->name);
  shardd__sb_printf(&m, " %" PRIu32 " %" PRIu32 "\n", job->world, job->uid);

  char fname[128];
  for (size_t i = 0; i < nb; i++) {
    shardd__buffer *b = bufs[i];
    size_t esz = shardd_dtype_size(b->dtype);
    shardd__sb_printf(&m, "buffer ");
    shardd__manifest_enc_name(&m, b->hdr.name);
    shardd__sb_printf(&m, " %d %" PRIu64 " %" PRIu64 "\n", (int)b->dtype,
                      b->numel, b->hdr.generation);
    for (uint32_t r = 0; r < b->world; r++) {
      uint32_t crc;
      snprintf(fname, sizeof fname, "b%zu-r%" PRIu32 "-%s.shard", i, r, tag);
      rc = shardd__ck_write_data(dir, fname, (uint32_t)b->dtype, b->shard_numel,
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
      shardd__manifest_enc_name(&m, v->hdr.name);
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
    if (o->spec_len >
        (SHARDD__MANIFEST_LINE_MAX - 3 * strlen(o->hdr.name) - 64) / 2) {
      snprintf(err, errlen,
               "optimizer \"%s\": its registration (%zu bytes) "
               "does not fit a manifest line (%zu bytes)",
               o->hdr.name, o->spec_len, SHARDD__MANIFEST_LINE_MAX);
      rc = SHARDD_E_LIMIT;
      goto done;
    }
    shardd__sb_printf(&m, "optimizer %zu ", i);
    shardd__manifest_enc_name(&m, o->hdr.name);
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
        shardd__manifest_enc_name(&m, r->name);
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
      rc = shardd__ck_write_data(
          dir, fname, SHARDD_DTYPE_FP32, sh->state->bytes / 4,
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
  if ((rc = shardd__ck_fsync_dir(dir, err, errlen)) != SHARDD_OK ||
      (rc = shardd__ck_write_file(dir, SHARDD__MANIFEST_FILE, NULL, 0, m.s,
                                  m.len, err, errlen)) != SHARDD_OK)
    goto done;
  manifest_in = 1; /* from here the new files are the checkpoint */
  if ((rc = shardd__ck_fsync_dir(dir, err, errlen)) != SHARDD_OK)
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
