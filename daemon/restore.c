/* restore.c — restores a job from a checkpoint directory (see
 * checkpoint.h): the manifest is checked, parsed and replayed into a new
 * job (buffers, views, then each optimizer through the registration use
 * case), every payload loaded and checked; any failure releases the new
 * job. */
#include "checkpoint.h"

#include <errno.h>
#include <inttypes.h>
#include <stdarg.h>
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

/* One state file of the same world: it covers its rank's shard region for
 * region, and no other file may have covered it already. */
static shardd_err load_state_same(const shardd__ckdir *dir, shardd__buffer *b,
                                  const pending_optim *p,
                                  const pending_state *ps, char *err,
                                  size_t errlen) {
  shardd__optim_shard *sh = find_shard(p->created, b, ps->rank);
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
  return SHARDD_OK;
}

/* One state file of another world: its elements go to the new shards that
 * hold them, array by array (master copy, then the arrays both layouts
 * have). */
static shardd_err load_state_resharded(const shardd__ckdir *dir,
                                       shardd__buffer *b, uint32_t old_world,
                                       const pending_optim *p,
                                       const pending_state *ps, char *err,
                                       size_t errlen) {
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
    shardd__optim_shard *sh = find_shard(p->created, b, q);
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
  return rc;
}

/* Loads every recorded state into the registered optimizer. Same world:
 * each shard that keeps state is covered by exactly one file, region for
 * region. Another world: each file's elements go to the new shards that
 * hold them, and every new shard that keeps state must receive some. */
static shardd_err load_states(const shardd__ckdir *dir, shardd__buffer **bufs,
                              uint32_t old_world, pending_optim *p, char *err,
                              size_t errlen) {
  shardd__optim *o = p->created;
  for (size_t k = 0; k < o->nshards; k++)
    o->shards[k].master_valid = -1; /* not yet seen */
  for (size_t i = 0; i < p->nstates; i++) {
    pending_state *ps = &p->states[i];
    shardd__buffer *b = bufs[ps->buf];
    shardd_err rc =
        old_world == b->world
            ? load_state_same(dir, b, p, ps, err, errlen)
            : load_state_resharded(dir, b, old_world, p, ps, err, errlen);
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

/* One restore in progress: the manifest being read and what its lines have
 * named so far. Everything here is the restore's own and freed by
 * restore_free, job included until it is handed to the caller (a failed
 * restore releases it); reg, dir and err are borrowed from the caller. */
typedef struct {
  shardd__registry *reg;
  const char *dir;
  int64_t as_uid;   /* who asks; see shardd__checkpoint_restore */
  uint32_t world;   /* the new job's; 0: the checkpoint's */
  char *err;
  size_t errlen;
  char path[4096];  /* the manifest's, as messages name it */
  shardd__ckdir dd; /* fd -1 until opened */
  FILE *f;          /* the manifest; owns its descriptor */
  char *line;
  size_t cap;
  int lineno, mversion, ended;
  uint32_t old_world;
  shardd__job *job; /* created by the job line */
  shardd__buffer **bufs; /* borrowed from job; the array is ours */
  size_t nb;
  /* seen[i]: bit r set once buffer i's shard of old rank r was loaded. A
   * buffer line registers zeroed memory; only its shard lines fill it, so
   * one without them restored zeros as if they were the checkpoint. */
  uint8_t **seen;
  size_t nshard_lines;
  pending_optim *po;
  size_t npo;
  /* a registration's reason; kept across lines, as one buffer was */
  char sub[512];
} restore;

/* Fails the current line: "PATH line N: WHY" in err, WHY cut at 511 bytes.
 * Returns rc where a call beneath already failed with it, else
 * SHARDD_E_INVAL (the line itself is wrong). */
static shardd_err bad(restore *c, shardd_err rc, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

static shardd_err bad(restore *c, shardd_err rc, const char *fmt, ...) {
  char why[512];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(why, sizeof why, fmt, ap);
  va_end(ap);
  snprintf(c->err, c->errlen, "%s line %d: %s", c->path, c->lineno, why);
  return rc == SHARDD_OK ? SHARDD_E_INVAL : rc;
}

/* Opens the checkpoint directory (no symlink on the way; for a client, one
 * it or the daemon owns) and the manifest in it. On failure nothing stays
 * open and err says why; the code follows errno as the callers expect. */
static shardd_err open_manifest(restore *c) {
  snprintf(c->path, sizeof c->path, "%s/%s", c->dir, SHARDD__MANIFEST_FILE);
  c->dd = (shardd__ckdir){-1, c->dir, c->as_uid};
  c->dd.fd = shardd__ck_open_dir(c->dir, c->err, c->errlen);
  if (c->dd.fd < 0)
    return errno == ELOOP || errno == ENOTDIR ? SHARDD_E_PERMISSION : SHARDD_E_IO;
  struct stat dst;
  if (c->as_uid > 0 &&
      (fstat(c->dd.fd, &dst) != 0 ||
       (dst.st_uid != (uid_t)c->as_uid && dst.st_uid != geteuid()))) {
    snprintf(c->err, c->errlen, "%s: the directory is neither yours nor the "
             "daemon's; restore from a directory you own", c->dir);
    close(c->dd.fd);
    return SHARDD_E_PERMISSION;
  }
  int mfd = shardd__ck_open_regular(&c->dd, SHARDD__MANIFEST_FILE, c->err,
                                    c->errlen);
  c->f = mfd >= 0 ? fdopen(mfd, "r") : NULL;
  if (c->f == NULL) {
    int e = errno;
    if (mfd >= 0) {
      snprintf(c->err, c->errlen, "%s: %s", c->path, strerror(e));
      close(mfd);
    } else if (e == ENOENT) {
      snprintf(c->err, c->errlen,
               "%s: %s (an incomplete checkpoint has no manifest)", c->path,
               strerror(e));
    }
    close(c->dd.fd);
    return e == EPERM || e == ELOOP ? SHARDD_E_PERMISSION : SHARDD_E_IO;
  }
  return SHARDD_OK;
}

/* A line the reader refused (too long, a NUL, no memory, a read error). */
static shardd_err line_error(restore *c, shardd__line_rc lr) {
  if (lr == SHARDD__LINE_LONG)
    snprintf(c->err, c->errlen,
             "%s line %d: longer than %zu bytes (not a "
             "manifest shardd wrote); not reading further",
             c->path, c->lineno, SHARDD__MANIFEST_LINE_MAX);
  else if (lr == SHARDD__LINE_NUL)
    snprintf(c->err, c->errlen, "%s line %d: holds a NUL byte (not a manifest "
             "shardd wrote)", c->path, c->lineno);
  else if (lr == SHARDD__LINE_NOMEM)
    snprintf(c->err, c->errlen, "%s line %d: out of memory", c->path,
             c->lineno);
  else
    snprintf(c->err, c->errlen, "%s line %d: %s", c->path, c->lineno,
             strerror(errno));
  return lr == SHARDD__LINE_NOMEM ? SHARDD_E_NO_MEMORY
         : lr == SHARDD__LINE_IO  ? SHARDD_E_IO
                                  : SHARDD_E_INVAL;
}

static shardd_err line_header(restore *c, char **tok, int nt) {
  if (nt != 2 || strcmp(tok[0], "shardd-checkpoint") ||
      (c->mversion = atoi(tok[1])) < 1 || c->mversion > SHARDD_MANIFEST_VERSION)
    return bad(c, SHARDD_E_INVAL,
               "not a shardd checkpoint manifest of version 1 to %d",
               SHARDD_MANIFEST_VERSION);
  return SHARDD_OK;
}

/* "job NAME WORLD OWNER": creates the new job. A job of that name that is
 * live already is refused, never touched. */
static shardd_err line_job(restore *c, char **tok) {
  if (!shardd__manifest_dec_name(tok[1]))
    return bad(c, SHARDD_E_INVAL, "bad job name");
  uint32_t owner = (uint32_t)strtoul(tok[3], NULL, 10);
  if (c->as_uid > 0 && (uint32_t)c->as_uid != owner) {
    snprintf(c->err, c->errlen, "job \"%s\" in %s belongs to another user; "
             "only it or root may restore it", tok[1], c->dir);
    return SHARDD_E_PERMISSION;
  }
  if (shardd__job_find(c->reg, owner, tok[1])) {
    snprintf(c->err, c->errlen,
             "job \"%s\" of uid %" PRIu32 " exists already; release it "
             "before restoring", tok[1], owner);
    return SHARDD_E_BUSY;
  }
  c->old_world = (uint32_t)strtoul(tok[2], NULL, 10);
  if (c->old_world == 0)
    return bad(c, SHARDD_E_INVAL, "world 0");
  shardd_err rc = shardd__job_get(c->reg, tok[1],
                                  c->world ? c->world : c->old_world, owner,
                                  &c->job, c->sub, sizeof c->sub);
  if (rc != SHARDD_OK)
    return bad(c, rc, "%s", c->sub);
  return SHARDD_OK;
}

/* "buffer NAME DTYPE NUMEL [GEN]": registers it, zeroed until its shards. */
static shardd_err line_buffer(restore *c, char **tok) {
  shardd__buffer *b;
  int created;
  if (!shardd__manifest_dec_name(tok[1]))
    return bad(c, SHARDD_E_INVAL, "bad buffer name");
  shardd_err rc = shardd__buffer_register(
      c->reg, c->job, tok[1], (shardd_dtype)atoi(tok[2]),
      strtoull(tok[3], NULL, 10), &b, &created, c->sub, sizeof c->sub);
  if (rc != SHARDD_OK)
    return bad(c, rc, "%s", c->sub);
  if (!created)
    return bad(c, SHARDD_E_INVAL, "buffer \"%s\" listed twice", tok[1]);
  /* A restored handle is a new generation: one kept from before the
   * checkpoint is refused as stale (version 1 recorded none: 1). */
  uint64_t gen = c->mversion >= 2 ? strtoull(tok[4], NULL, 10) : 1;
  shardd__obj_set_generation(&b->hdr, gen + 1);
  shardd__buffer **nbufs = realloc(c->bufs, (c->nb + 1) * sizeof *c->bufs);
  if (nbufs == NULL)
    return bad(c, SHARDD_E_INVAL, "out of memory");
  c->bufs = nbufs;
  uint8_t **nseen = realloc(c->seen, (c->nb + 1) * sizeof *c->seen);
  if (nseen == NULL)
    return bad(c, SHARDD_E_INVAL, "out of memory");
  c->seen = nseen;
  if ((c->seen[c->nb] = calloc((c->old_world + 7) / 8, 1)) == NULL)
    return bad(c, SHARDD_E_INVAL, "out of memory");
  c->bufs[c->nb++] = b;
  return SHARDD_OK;
}

/* "shard BUF RANK FILE CRC": loads the payload now, into the buffer the
 * lines above registered. */
static shardd_err line_shard(restore *c, char **tok) {
  size_t bi = strtoul(tok[1], NULL, 10);
  uint32_t r = (uint32_t)strtoul(tok[2], NULL, 10);
  if (bi >= c->nb || r >= c->old_world || strchr(tok[3], '/'))
    return bad(c, SHARDD_E_INVAL, "shard of unknown buffer %zu rank %" PRIu32,
               bi, r);
  if (c->seen[bi][r / 8] & (1u << (r % 8)))
    return bad(c, SHARDD_E_INVAL,
               "shard of buffer %zu rank %" PRIu32 " listed twice", bi, r);
  c->seen[bi][r / 8] |= (uint8_t)(1u << (r % 8));
  c->nshard_lines++;
  return load_shard(&c->dd, tok[3], (uint32_t)strtoul(tok[4], NULL, 16),
                    c->bufs[bi], c->old_world, r, c->err, c->errlen);
}

/* "view BUF NAME OFFSET NUMEL NDIM DIM... [GEN REQUIRES_GRAD]". */
static shardd_err line_view(restore *c, char **tok, int nt) {
  size_t bi = strtoul(tok[1], NULL, 10);
  int ndim = atoi(tok[5]);
  int extra = c->mversion >= 2 ? 2 : 0; /* generation, requires_grad */
  if (bi >= c->nb || ndim < 0 || ndim > 16 || nt != 6 + ndim + extra ||
      !shardd__manifest_dec_name(tok[2]))
    return bad(c, SHARDD_E_INVAL, "malformed view");
  int64_t shape[16];
  for (int d = 0; d < ndim; d++)
    shape[d] = strtoll(tok[6 + d], NULL, 10);
  uint64_t gen = extra ? strtoull(tok[6 + ndim], NULL, 10) : 1;
  int requires_grad = extra ? atoi(tok[7 + ndim]) != 0 : 1;
  shardd__view *v;
  int created;
  shardd_err rc = shardd__view_register_ex(
      c->reg, c->job, c->bufs[bi]->hdr.id, 0, tok[2],
      strtoull(tok[3], NULL, 10), strtoull(tok[4], NULL, 10), shape, ndim,
      requires_grad, &v, &created, c->sub, sizeof c->sub);
  if (rc != SHARDD_OK)
    return bad(c, rc, "%s", c->sub);
  shardd__obj_set_generation(&v->hdr, gen + 1);
  return SHARDD_OK;
}

/* "optimizer INDEX NAME STEPS SPEC_HEX": pending until every ref and state
 * line is read; registered after the last line. */
static shardd_err line_optimizer(restore *c, char **tok) {
  if ((size_t)strtoul(tok[1], NULL, 10) != c->npo ||
      !shardd__manifest_dec_name(tok[2]))
    return bad(c, SHARDD_E_INVAL, "optimizers out of order");
  pending_optim *np = realloc(c->po, (c->npo + 1) * sizeof *c->po);
  if (np == NULL)
    return bad(c, SHARDD_E_INVAL, "out of memory");
  c->po = np;
  pending_optim *p = &c->po[c->npo++];
  memset(p, 0, sizeof *p);
  p->name = strdup(tok[2]);
  p->steps = strtoull(tok[3], NULL, 10);
  size_t hl = strlen(tok[4]);
  p->spec = malloc(hl / 2 + 1);
  if (p->name == NULL || p->spec == NULL || hl % 2)
    return bad(c, SHARDD_E_INVAL, "bad optimizer spec");
  for (size_t k = 0; k < hl / 2; k++) {
    int hi = shardd__manifest_hexval(tok[4][2 * k]),
        lo = shardd__manifest_hexval(tok[4][2 * k + 1]);
    if (hi < 0 || lo < 0)
      return bad(c, SHARDD_E_INVAL, "bad optimizer spec");
    p->spec[k] = (uint8_t)(hi << 4 | lo);
  }
  p->spec_len = hl / 2;
  return SHARDD_OK;
}

/* "ref OPT OLD_ID buffer BUF" or "ref OPT OLD_ID view BUF NAME": maps an
 * id in the optimizer's recorded spec to the restored object. */
static shardd_err line_ref(restore *c, char **tok, int nt) {
  size_t oi = strtoul(tok[1], NULL, 10);
  size_t bi = strtoul(tok[4], NULL, 10);
  if (oi >= c->npo || bi >= c->nb)
    return bad(c, SHARDD_E_INVAL, "ref to unknown optimizer or buffer");
  shardd__obj *o = &c->bufs[bi]->hdr;
  if (!strcmp(tok[3], "view")) {
    if (nt != 6 || !shardd__manifest_dec_name(tok[5]) ||
        (o = shardd__map_get_str(&c->bufs[bi]->views, tok[5])) == NULL)
      return bad(c, SHARDD_E_INVAL, "ref to unknown view");
  } else if (strcmp(tok[3], "buffer") || nt != 5) {
    return bad(c, SHARDD_E_INVAL, "malformed ref");
  }
  pending_optim *p = &c->po[oi];
  id_map *ni = realloc(p->ids, (p->nids + 1) * sizeof *ni);
  if (ni == NULL)
    return bad(c, SHARDD_E_INVAL, "out of memory");
  p->ids = ni;
  p->ids[p->nids++] = (id_map){strtoull(tok[2], NULL, 10), o};
  return SHARDD_OK;
}

/* "state OPT BUF RANK MASTER_VALID FILE CRC BYTES NSTATE": a payload
 * loaded once its optimizer is registered. */
static shardd_err line_state(restore *c, char **tok) {
  size_t oi = strtoul(tok[1], NULL, 10);
  size_t bi = strtoul(tok[2], NULL, 10);
  if (oi >= c->npo || bi >= c->nb || strchr(tok[5], '/'))
    return bad(c, SHARDD_E_INVAL, "state of unknown optimizer or buffer");
  pending_optim *p = &c->po[oi];
  pending_state *ns = realloc(p->states, (p->nstates + 1) * sizeof *ns);
  if (ns == NULL)
    return bad(c, SHARDD_E_INVAL, "out of memory");
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
    return bad(c, SHARDD_E_INVAL, "bad state count");
  if ((ps->file = strdup(tok[5])) == NULL)
    return bad(c, SHARDD_E_INVAL, "out of memory");
  return SHARDD_OK;
}

/* One manifest line, split into words: the header first, then nothing but
 * the job line until it came, nothing at all after "end". */
static shardd_err parse_line(restore *c, char **tok, int nt) {
  if (c->lineno == 1)
    return line_header(c, tok, nt);
  if (c->ended)
    return bad(c, SHARDD_E_INVAL, "text after \"end\"");
  if (!strcmp(tok[0], "end")) {
    if (nt != (c->mversion >= 3 ? 2 : 1))
      return bad(c, SHARDD_E_INVAL, "malformed \"end\" line");
    c->ended = 1;
    return SHARDD_OK;
  }
  if (!strcmp(tok[0], "job") && nt == 4 && c->job == NULL)
    return line_job(c, tok);
  if (c->job == NULL)
    return bad(c, SHARDD_E_INVAL, "\"%s\" before the job line", tok[0]);
  if (!strcmp(tok[0], "buffer") && nt == (c->mversion >= 2 ? 5 : 4))
    return line_buffer(c, tok);
  if (!strcmp(tok[0], "shard") && nt == 5)
    return line_shard(c, tok);
  if (!strcmp(tok[0], "view") && nt >= 6)
    return line_view(c, tok, nt);
  if (!strcmp(tok[0], "optimizer") && nt == 5)
    return line_optimizer(c, tok);
  if (!strcmp(tok[0], "ref") && (nt == 5 || nt == 6))
    return line_ref(c, tok, nt);
  if (!strcmp(tok[0], "state") && nt == 9)
    return line_state(c, tok);
  return bad(c, SHARDD_E_INVAL, "unknown or malformed line \"%s\"", tok[0]);
}

/* Reads the manifest to its end, line by line: the job, buffers and views
 * are registered and each shard loaded as its line comes; optimizers are
 * only collected. Words past the MAX_TOK-th are not looked at. */
static shardd_err parse_manifest(restore *c) {
  for (;;) {
    shardd__line_rc lr = shardd__manifest_read_line(c->f, &c->line, &c->cap,
                                                    SHARDD__MANIFEST_LINE_MAX);
    if (lr == SHARDD__LINE_EOF)
      return SHARDD_OK;
    c->lineno++;
    if (lr != SHARDD__LINE_OK)
      return line_error(c, lr);
    char *tok[MAX_TOK];
    int nt = 0;
    for (char *save, *t = strtok_r(c->line, " ", &save); t && nt < MAX_TOK;
         t = strtok_r(NULL, " ", &save))
      tok[nt++] = t;
    if (nt == 0)
      continue;
    shardd_err rc = parse_line(c, tok, nt);
    if (rc != SHARDD_OK)
      return rc;
  }
}

/* What a whole manifest must have: an "end" line, a job line, and a shard
 * line for every rank of every buffer. */
static shardd_err check_complete(restore *c) {
  if (!c->ended) {
    snprintf(c->err, c->errlen, "%s: no \"end\" line (truncated manifest)",
             c->path);
    return SHARDD_E_INVAL;
  }
  if (c->job == NULL) {
    /* "shardd-checkpoint 2" + "end" restored nothing and returned OK: the
     * callers took the NULL job and the daemon died with every shard. */
    snprintf(c->err, c->errlen,
             "%s: no \"job\" line (not a checkpoint shardd wrote)", c->path);
    return SHARDD_E_INVAL;
  }
  if (c->nb > 0 && c->nshard_lines == 0) {
    snprintf(c->err, c->errlen, "%s: names %zu buffer%s but no shard of any "
             "(a corrupt or truncated manifest)", c->path, c->nb,
             c->nb == 1 ? "" : "s");
    return SHARDD_E_INVAL;
  }
  for (size_t i = 0; i < c->nb; i++)
    for (uint32_t r = 0; r < c->old_world; r++)
      if (!(c->seen[i][r / 8] & (1u << (r % 8)))) {
        snprintf(c->err, c->errlen, "%s: no shard of buffer \"%s\" rank %" PRIu32
                 " (a corrupt or truncated manifest)", c->path,
                 c->bufs[i]->hdr.name, r);
        return SHARDD_E_INVAL;
      }
  return SHARDD_OK;
}

/* Registers each collected optimizer, in manifest order, and loads its
 * state files. */
static shardd_err restore_optimizers(restore *c) {
  for (size_t i = 0; i < c->npo; i++) {
    shardd_err rc = register_pending(c->reg, c->job, &c->po[i], c->err,
                                     c->errlen);
    if (rc == SHARDD_OK)
      rc = load_states(&c->dd, c->bufs, c->old_world, &c->po[i], c->err,
                       c->errlen);
    if (rc != SHARDD_OK)
      return rc;
  }
  return SHARDD_OK;
}

/* Frees what the restore holds, after open_manifest succeeded; a job still
 * here (the restore failed) is released. */
static void restore_free(restore *c) {
  if (c->job)
    shardd__job_release(c->reg, c->job);
  for (size_t i = 0; i < c->npo; i++) {
    free(c->po[i].name);
    free(c->po[i].spec);
    free(c->po[i].ids);
    for (size_t k = 0; k < c->po[i].nstates; k++)
      free(c->po[i].states[k].file);
    free(c->po[i].states);
  }
  free(c->po);
  for (size_t i = 0; i < c->nb; i++)
    free(c->seen[i]);
  free(c->seen);
  free(c->bufs);
  free(c->line);
  fclose(c->f);
  close(c->dd.fd);
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
  restore c = {.reg = reg, .dir = dir, .as_uid = as_uid, .world = world,
               .err = err, .errlen = errlen};
  shardd_err rc = open_manifest(&c);
  if (rc != SHARDD_OK)
    return rc;
  if ((rc = shardd__manifest_verify(c.f, c.path, err, errlen)) == SHARDD_OK &&
      (rc = parse_manifest(&c)) == SHARDD_OK &&
      (rc = check_complete(&c)) == SHARDD_OK &&
      (rc = restore_optimizers(&c)) == SHARDD_OK) {
    *out = c.job; /* the caller's now; restore_free must not release it */
    c.job = NULL;
  }
  restore_free(&c);
  return rc;
}
