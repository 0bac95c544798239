/* restore.c — restores a job from a checkpoint directory (see
 * checkpoint.h): the manifest is checked, parsed and replayed into a new
 * job (buffers, views, then each optimizer through the registration use
 * case), every payload loaded and checked; any failure releases the new
 * job. */
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
#include "optcodec.h"
#include "optreg.h"

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
static shardd_err load_shard(const shardd__ckdir *dir, const char *file,
                             uint32_t crc, shardd__buffer *b,
                             uint32_t old_world, uint32_t r, char *err,
                             size_t errlen) {
  size_t esz = shardd_dtype_size(b->dtype);
  uint64_t lo, hi, old_s;
  old_range(b, old_world, r, &lo, &hi, &old_s);
  if (old_world == b->world)
    return shardd__ck_load_data(dir, file, (uint32_t)b->dtype, b->shard_numel,
                                (uint64_t)r * b->shard_numel, b->hdr.name, crc,
                                (char *)b->blocks[r]->ptr + b->shard_off,
                                b->shard_numel * esz, err, errlen);
  char *tmp = malloc(old_s > 0 ? old_s * esz : 1);
  if (tmp == NULL) {
    snprintf(err, errlen, "out of memory");
    return SHARDD_E_NO_MEMORY;
  }
  shardd_err rc = shardd__ck_load_data(dir, file, (uint32_t)b->dtype, old_s,
                                       (uint64_t)r * old_s, b->hdr.name, crc,
                                       tmp, old_s * esz, err, errlen);
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
static shardd_err load_states(const shardd__ckdir *dir, shardd__buffer **bufs,
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
      shardd_err rc =
          shardd__ck_load_data(dir, ps->file, SHARDD_DTYPE_FP32, ps->bytes / 4,
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
    shardd_err rc =
        shardd__ck_load_data(dir, ps->file, SHARDD_DTYPE_FP32, ps->bytes / 4,
                             (uint64_t)ps->rank * old_s, b->hdr.name, ps->crc,
                             tmp, ps->bytes, err, errlen);
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
  snprintf(path, sizeof path, "%s/%s", dir, SHARDD__MANIFEST_FILE);
  shardd__ckdir dd = {-1, dir, as_uid};
  dd.fd = shardd__ck_open_dir(dir, err, errlen);
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
  int mfd = shardd__ck_open_regular(&dd, SHARDD__MANIFEST_FILE, err, errlen);
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
  shardd_err rc = shardd__manifest_verify(f, path, err, errlen);
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
    shardd__line_rc lr =
        shardd__manifest_read_line(f, &line, &cap, SHARDD__MANIFEST_LINE_MAX);
    if (lr == SHARDD__LINE_EOF)
      break;
    lineno++;
    if (lr != SHARDD__LINE_OK) {
      if (lr == SHARDD__LINE_LONG)
        snprintf(err, errlen,
                 "%s line %d: longer than %zu bytes (not a "
                 "manifest shardd wrote); not reading further",
                 path, lineno, SHARDD__MANIFEST_LINE_MAX);
      else if (lr == SHARDD__LINE_NUL)
        snprintf(err, errlen, "%s line %d: holds a NUL byte (not a manifest "
                 "shardd wrote)", path, lineno);
      else if (lr == SHARDD__LINE_NOMEM)
        snprintf(err, errlen, "%s line %d: out of memory", path, lineno);
      else
        snprintf(err, errlen, "%s line %d: %s", path, lineno, strerror(errno));
      rc = lr == SHARDD__LINE_NOMEM ? SHARDD_E_NO_MEMORY
           : lr == SHARDD__LINE_IO  ? SHARDD_E_IO
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
      if (!shardd__manifest_dec_name(tok[1]))
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
      if (!shardd__manifest_dec_name(tok[1]))
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
          !shardd__manifest_dec_name(tok[2]))
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
      if ((size_t)strtoul(tok[1], NULL, 10) != npo ||
          !shardd__manifest_dec_name(tok[2]))
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
        int hi = shardd__manifest_hexval(tok[4][2 * k]),
            lo = shardd__manifest_hexval(tok[4][2 * k + 1]);
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
        if (nt != 6 || !shardd__manifest_dec_name(tok[5]) ||
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
