/* restore_plan.c — the loads a restore plans as its lines are applied
 * (restore.c): each shard's payload, and each optimizer state's once its
 * optimizer is registered again, read into the new job's regions,
 * resharded where the world changed (a new rank's shard copied from the
 * old ranks' files that hold its elements); the recorded optimizers
 * registered again with the restored objects' ids. Loop thread. */
#include "restore_int.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "optcodec.h"
#include "optreg.h"

static int cmp_id_map(const void *a, const void *b) {
  const id_map *x = a, *y = b;
  return x->old_id < y->old_id ? -1 : x->old_id > y->old_id;
}

/* Registers a recorded optimizer: its own registration with every ref id
 * replaced by the restored object's, through the same use case a client's
 * registration takes (optreg.h). */
shardd_err shardd__restore_register_pending(shardd__registry *reg,
                                            shardd__job *job, pending_optim *p,
                                            char *err, size_t errlen) {
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
      id_map key = {ref->id, NULL, 0};
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
  return rc; /* steps are set by finish, once the state is loaded */
}

/* Elements [lo, hi) of buffer b, as rank `rank` of a world of `world`
 * holds them: its shard's slice of the unpadded range. */
void shardd__restore_old_range(const shardd__buffer *b, uint32_t world,
                               uint32_t rank, uint64_t *lo, uint64_t *hi,
                               uint64_t *old_s) {
  *old_s = (b->numel + world - 1) / world;
  *lo = (uint64_t)rank * *old_s;
  *hi = *lo + *old_s < b->numel ? *lo + *old_s : b->numel;
  if (*lo > *hi)
    *lo = *hi;
}

static shardd__optim_shard *find_shard(shardd__optim *o, const shardd__buffer *b,
                                       uint32_t rank) {
  for (size_t k = 0; k < o->nshards; k++)
    if (o->shards[k].buf == b && o->shards[k].rank == rank)
      return &o->shards[k];
  return NULL;
}


/* Where a load into region r goes in host memory: r itself where the
 * daemon maps it, else r's host copy (made zeroed at first use, as r's
 * memory starts). NULL when out of memory (c->err says so). */
static char *host_base(restore *c, shardd__region *r) {
  if (c->reg->backend->ops->write == NULL)
    return r->ptr;
  for (size_t i = 0; i < c->nshadows; i++)
    if (c->shadows[i].r == r)
      return c->shadows[i].host;
  void *ns = realloc(c->shadows, (c->nshadows + 1) * sizeof *c->shadows);
  char *host = ns ? calloc(1, r->bytes ? r->bytes : 1) : NULL;
  if (ns)
    c->shadows = ns;
  if (host == NULL) {
    snprintf(c->err, c->errlen, "out of memory staging %zu bytes for device %d",
             r->bytes, r->device);
    return NULL;
  }
  c->shadows[c->nshadows].r = r;
  c->shadows[c->nshadows++].host = host;
  return host;
}

/* Appends a load of file (copied) for a payload of buffer bi; NULL out of
 * memory (err says so). */
static ld *add_load(restore *c, const char *file, uint32_t crc, size_t bi,
                    uint32_t dtype, uint64_t numel, uint64_t offset,
                    size_t bytes, char *direct) {
  if (c->nloads == c->capl) {
    size_t ncap = c->capl ? c->capl * 2 : 16;
    ld *nl = realloc(c->loads, ncap * sizeof *nl);
    if (nl == NULL)
      goto nomem;
    c->loads = nl;
    c->capl = ncap;
  }
  ld *l = &c->loads[c->nloads];
  memset(l, 0, sizeof *l);
  if ((l->file = strdup(file)) == NULL)
    goto nomem;
  c->nloads++;
  l->name = c->bnames[bi];
  l->crc = crc;
  l->dtype = dtype;
  l->numel = numel;
  l->offset = offset;
  l->bytes = bytes;
  l->direct = direct;
  return l;
nomem:
  snprintf(c->err, c->errlen, "out of memory");
  return NULL;
}

static shardd_err add_copy(restore *c, ld *l, char *dst, size_t src, size_t n) {
  ld_copy *nc = realloc(l->copies, (l->ncopies + 1) * sizeof *nc);
  if (nc == NULL) {
    snprintf(c->err, c->errlen, "out of memory");
    return SHARDD_E_NO_MEMORY;
  }
  l->copies = nc;
  l->copies[l->ncopies++] = (ld_copy){dst, src, n};
  return SHARDD_OK;
}

/* One shard file of a world of old_world ranks into buffer bi: straight
 * into the rank's block when the world is the same, else element ranges
 * copied to whichever new rank holds them (shards are keyed by element
 * offset, so a checkpoint of W ranks restores into W'). */
shardd_err shardd__restore_plan_shard(restore *c, const char *file,
                                      uint32_t crc, size_t bi, uint32_t r) {
  shardd__buffer *b = c->bufs[bi];
  size_t esz = shardd_dtype_size(b->dtype);
  uint64_t lo, hi, old_s;
  shardd__restore_old_range(b, c->old_world, r, &lo, &hi, &old_s);
  if (c->old_world == b->world) {
    char *base = host_base(c, b->blocks[r]);
    return base && add_load(c, file, crc, bi, (uint32_t)b->dtype, b->shard_numel,
                            (uint64_t)r * b->shard_numel, b->shard_numel * esz,
                            base + b->shard_off)
               ? SHARDD_OK
               : SHARDD_E_NO_MEMORY;
  }
  ld *l = add_load(c, file, crc, bi, (uint32_t)b->dtype, old_s,
                   (uint64_t)r * old_s, old_s * esz, NULL);
  if (l == NULL)
    return SHARDD_E_NO_MEMORY;
  for (uint64_t e = lo; e < hi;) {
    uint64_t q = e / b->shard_numel, off = e % b->shard_numel;
    uint64_t n = b->shard_numel - off < hi - e ? b->shard_numel - off : hi - e;
    char *base = host_base(c, b->blocks[q]);
    if (base == NULL ||
        add_copy(c, l, base + b->shard_off + off * esz, (e - lo) * esz, n * esz) !=
            SHARDD_OK)
      return SHARDD_E_NO_MEMORY;
    e += n;
  }
  return SHARDD_OK;
}

static size_t shard_index(const shardd__optim *o, const shardd__optim_shard *sh) {
  return (size_t)(sh - o->shards);
}

/* One state file of the same world: it covers its rank's shard region for
 * region, and no other file may have covered it already. */
static shardd_err plan_state_resharded(restore *c, shardd__buffer *b,
                                       pending_optim *p,
                                       const pending_state *ps);

static shardd_err plan_state_same(restore *c, shardd__buffer *b,
                                  pending_optim *p, const pending_state *ps) {
  shardd__optim_shard *sh = find_shard(p->created, b, ps->rank);
  /* A file records its region's allocated size, which backends round
   * differently (cuda to its grain): written by one and restored into the
   * other, the arrays are copied one by one from the file's layout. */
  if (sh != NULL && sh->state != NULL && sh->state->bytes != ps->bytes &&
      p->mv[shard_index(p->created, sh)] == -1)
    return plan_state_resharded(c, b, p, ps);
  if (sh == NULL || sh->state == NULL || sh->state->bytes != ps->bytes ||
      p->mv[shard_index(p->created, sh)] != -1) {
    snprintf(c->err, c->errlen, "%s/%s: does not fit optimizer \"%s\"",
             c->dd.path, ps->file, p->name);
    return SHARDD_E_INVAL;
  }
  char *st = host_base(c, sh->state);
  if (st == NULL ||
      add_load(c, ps->file, ps->crc, ps->buf, SHARDD_DTYPE_FP32, ps->bytes / 4,
               (uint64_t)ps->rank * b->shard_numel, ps->bytes, st) == NULL)
    return SHARDD_E_NO_MEMORY;
  p->mv[shard_index(p->created, sh)] = ps->master_valid;
  return SHARDD_OK;
}

/* One state file of another world: its elements go to the new shards that
 * hold them, array by array (master copy, then the arrays both layouts
 * have). */
static shardd_err plan_state_resharded(restore *c, shardd__buffer *b,
                                       pending_optim *p,
                                       const pending_state *ps) {
  uint64_t lo, hi, old_s;
  shardd__restore_old_range(b, c->old_world, ps->rank, &lo, &hi, &old_s);
  size_t omaster, ooffs[3] = {0, 0, 0};
  size_t used = shardd__optim_state_layout(b->dtype, old_s, ps->nstate, &omaster, ooffs);
  if (ps->rank >= c->old_world || used == 0 || used > ps->bytes) {
    snprintf(c->err, c->errlen, "%s/%s: does not fit optimizer \"%s\"",
             c->dd.path, ps->file, p->name);
    return SHARDD_E_INVAL;
  }
  ld *l = add_load(c, ps->file, ps->crc, ps->buf, SHARDD_DTYPE_FP32,
                   ps->bytes / 4, (uint64_t)ps->rank * old_s, ps->bytes, NULL);
  if (l == NULL)
    return SHARDD_E_NO_MEMORY;
  int wide = b->dtype != SHARDD_DTYPE_FP32;
  for (uint64_t e = lo; e < hi;) {
    uint32_t q = (uint32_t)(e / b->shard_numel);
    uint64_t off = e % b->shard_numel;
    uint64_t n = b->shard_numel - off < hi - e ? b->shard_numel - off : hi - e;
    shardd__optim_shard *sh = find_shard(p->created, b, q);
    if (sh && sh->state) {
      size_t src = (e - lo) * 4, dst = off * 4;
      char *base = host_base(c, sh->state);
      if (base == NULL)
        return SHARDD_E_NO_MEMORY;
      if (wide && add_copy(c, l, base + sh->master_off + dst, omaster + src,
                           n * 4) != SHARDD_OK)
        return SHARDD_E_NO_MEMORY;
      for (int j = 0; j < ps->nstate && j < sh->nstate; j++)
        if (add_copy(c, l, base + sh->state_offs[j] + dst, ooffs[j] + src,
                     n * 4) != SHARDD_OK)
          return SHARDD_E_NO_MEMORY;
      int *mv = &p->mv[shard_index(p->created, sh)];
      *mv = *mv == -1 ? ps->master_valid : *mv && ps->master_valid;
    }
    e += n;
  }
  return SHARDD_OK;
}

/* Each of p's created refs' step count, from its ref line (by object: the
 * optimizer's refs are in its own order), into p->ref_steps. */
static shardd_err ref_steps_of(restore *c, pending_optim *p) {
  shardd__optim *o = p->created;
  shardd__map by_obj;
  shardd__map_init(&by_obj);
  p->ref_steps = malloc((o->nrefs ? o->nrefs : 1) * sizeof *p->ref_steps);
  shardd_err rc = p->ref_steps ? SHARDD_OK : SHARDD_E_NO_MEMORY;
  for (size_t j = 0; rc == SHARDD_OK && j < p->nids; j++)
    rc = shardd__map_put_id(&by_obj, p->ids[j].obj->id, &p->ids[j]);
  for (size_t k = 0; rc == SHARDD_OK && k < o->nrefs; k++) {
    const id_map *hit = shardd__map_get_id(&by_obj, o->refs[k]->id);
    p->ref_steps[k] = hit ? hit->steps : p->steps;
  }
  shardd__map_free(&by_obj);
  if (rc != SHARDD_OK)
    snprintf(c->err, c->errlen, "out of memory");
  return rc;
}

/* Plans the load of every recorded state into the registered optimizer.
 * Same world: each shard that keeps state is covered by exactly one file,
 * region for region. Another world: each file's elements go to the new
 * shards that hold them, and every new shard that keeps state must
 * receive some. */
shardd_err shardd__restore_plan_states(restore *c, pending_optim *p) {
  shardd__optim *o = p->created;
  if ((p->mv = malloc((o->nshards ? o->nshards : 1) * sizeof *p->mv)) == NULL) {
    snprintf(c->err, c->errlen, "out of memory");
    return SHARDD_E_NO_MEMORY;
  }
  for (size_t k = 0; k < o->nshards; k++)
    p->mv[k] = -1; /* not yet seen */
  shardd_err rc = ref_steps_of(c, p);
  if (rc != SHARDD_OK)
    return rc;
  for (size_t i = 0; i < p->nstates; i++) {
    pending_state *ps = &p->states[i];
    shardd__buffer *b = c->bufs[ps->buf];
    rc = c->old_world == b->world ? plan_state_same(c, b, p, ps)
                                  : plan_state_resharded(c, b, p, ps);
    if (rc != SHARDD_OK)
      return rc;
  }
  for (size_t k = 0; k < o->nshards; k++) {
    shardd__optim_shard *sh = &o->shards[k];
    if (p->mv[k] == -1) {
      if (sh->state) {
        snprintf(c->err, c->errlen,
                 "optimizer \"%s\": no state in the checkpoint for buffer \"%s\" "
                 "rank %" PRIu32, p->name, sh->buf->hdr.name, sh->rank);
        return SHARDD_E_INVAL;
      }
      p->mv[k] = 0;
    }
  }
  return SHARDD_OK;
}
