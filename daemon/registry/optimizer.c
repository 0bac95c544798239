/* optimizer.c — optimizers registered over buffers and views: turning a
 * validated plan into per-rank shards and segments, their state regions,
 * lookup, holds by steps, and unregistering. */
#include "dtype.h"
#include "registry.h"
#include "registry_int.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- optimizers ------------------------------------------------------- */

void shardd__optim_plan_free(shardd__optim_plan *plan) {
  free(plan->name);
  free(plan->groups);
  free(plan->refs);
  free(plan->spec);
  memset(plan, 0, sizeof *plan);
}

static void optim_free_shards(shardd__registry *reg, shardd__optim *o) {
  for (size_t i = 0; i < o->nshards; i++) {
    shardd__optim_shard *s = &o->shards[i];
    shardd__optim_shard_unseed(reg, s);
    if (s->state)
      shardd__optim_state_free(reg, s);
    free(s->segs);
  }
  free(o->shards);
  o->shards = NULL;
  o->nshards = 0;
}

void shardd__optim_state_free(shardd__registry *reg, shardd__optim_shard *sh) {
  shardd__job *job = sh->buf->hdr.job;
  job->bytes -= sh->state->bytes;
  shardd__region_uncount(reg, job, sh->state);
  reg->backend->ops->free(reg->backend, sh->state);
  sh->state = NULL;
}

void shardd__optim_destroy(shardd__registry *reg, shardd__optim *o) {
  for (size_t i = 0; i < o->nrefs; i++) {
    shardd__obj *r = o->refs[i];
    if (r->kind == SHARDD__OBJ_VIEW) {
      shardd__view *v = (shardd__view *)r;
      shardd__buffer_held_del(v);
      v->owner = NULL;
      v->buf->nowned--;
    } else {
      shardd__buffer *b = (shardd__buffer *)r;
      b->owner = NULL;
      b->nowned--;
    }
  }
  if (o->hdr.name)
    shardd__map_del_str(&o->hdr.job->optims, o->hdr.name);
  optim_free_shards(reg, o);
  shardd__obj_fini(reg, &o->hdr);
  free(o->refs);
  free(o->ref_steps);
  free(o->ref_scatters);
  free(o->groups);
  free(o->spec);
  free(o);
}

uint64_t shardd__ref_steps(const shardd__obj *o) {
  if (o->kind == SHARDD__OBJ_VIEW) {
    const shardd__view *v = (const shardd__view *)o;
    return v->owner ? v->owner->ref_steps[v->owner_ref] : 0;
  }
  if (o->kind == SHARDD__OBJ_BUFFER) {
    const shardd__optim *w = ((const shardd__buffer *)o)->owner;
    for (size_t i = 0; w && i < w->nrefs; i++)
      if (w->refs[i] == o)
        return w->ref_steps[i];
  }
  return 0;
}

/* Finds or appends the optimizer shard of (buf, rank). Plans are small
 * relative to their data, and refs of one buffer arrive together, so the
 * search starts from the end. */
static shardd__optim_shard *shard_for(shardd__optim *o, size_t *cap,
                                      shardd__buffer *buf, uint32_t rank) {
  for (size_t i = o->nshards; i-- > 0;) {
    if (o->shards[i].buf == buf && o->shards[i].rank == rank)
      return &o->shards[i];
    if (o->shards[i].buf != buf)
      break;
  }
  if (o->nshards == *cap) {
    size_t ncap = *cap ? *cap * 2 : 8;
    shardd__optim_shard *p = realloc(o->shards, ncap * sizeof *p);
    if (p == NULL)
      return NULL;
    o->shards = p;
    *cap = ncap;
  }
  shardd__optim_shard *s = &o->shards[o->nshards++];
  memset(s, 0, sizeof *s);
  s->buf = buf;
  s->rank = rank;
  return s;
}

static int cmp_plan_ref(const void *a, const void *b) {
  const shardd__plan_ref *x = a, *y = b;
  if (x->buf->hdr.id != y->buf->hdr.id)
    return x->buf->hdr.id < y->buf->hdr.id ? -1 : 1;
  return x->offset < y->offset ? -1 : x->offset > y->offset;
}

static shardd_err add_seg(shardd__optim_shard *s, uint64_t start, uint64_t len,
                          uint32_t group, uint32_t ref) {
  if (s->nsegs > 0) { /* merge adjacent ranges of one ref */
    shardd__seg *last = &s->segs[s->nsegs - 1];
    if (last->group == group && last->ref == ref &&
        last->start + last->len == start) {
      last->len += len;
      return SHARDD_OK;
    }
  }
  shardd__seg *p = realloc(s->segs, (s->nsegs + 1) * sizeof *p);
  if (p == NULL)
    return SHARDD_E_NO_MEMORY;
  s->segs = p;
  s->segs[s->nsegs++] = (shardd__seg){start, len, group, ref};
  return SHARDD_OK;
}

/* With the fd store the host backend keeps sh's new state in a memfd, as
 * a rank block: it counts against the same bounds (max_blocks and the
 * uid's share). Uncounted, one uid's optimizers over one-element views of
 * their own took every descriptor, and every connect then failed. Past a
 * bound the state is freed (sh->state NULL) and E_LIMIT says why. */
static shardd_err state_charge(shardd__registry *reg, shardd__job *job,
                               shardd__optim_shard *sh, char *err,
                               size_t errlen) {
  char what[320];
  snprintf(what, sizeof what, "optimizer state for buffer \"%s\" rank %" PRIu32,
           sh->buf->hdr.name, sh->rank);
  if (!shardd__region_count(reg, job, sh->state, 1, what, err, errlen)) {
    reg->backend->ops->free(reg->backend, sh->state);
    sh->state = NULL;
    return SHARDD_E_LIMIT;
  }
  return SHARDD_OK;
}

shardd_err shardd__optim_create(shardd__registry *reg, shardd__job *job,
                                shardd__optim_plan *plan, shardd__optim **out,
                                char *err, size_t errlen) {
  *out = NULL;
  /* The name map must not silently replace a live optimizer: the old one
   * would become unreachable by name, leak at job release (which walks that
   * map) and, when unregistered, delete the new one's name entry. The
   * server checks first; this keeps the registry consistent on its own. */
  shardd__optim *dup =
      plan->name ? shardd__map_get_str(&job->optims, plan->name) : NULL;
  if (dup != NULL) {
    snprintf(err, errlen,
             "optimizer \"%s\" exists in job \"%s\" (id %" PRIu64 ")",
             plan->name, job->name, dup->hdr.id);
    return SHARDD_E_MISMATCH;
  }
  shardd__optim *o = calloc(1, sizeof *o);
  size_t cap = 0;
  shardd_err rc = SHARDD_E_NO_MEMORY;
  if (o == NULL)
    goto nomem;
  o->hdr.job = job;
  o->kind = plan->kind;

  qsort(plan->refs, plan->nrefs, sizeof *plan->refs, cmp_plan_ref);
  for (size_t i = 0; i < plan->nrefs; i++) {
    shardd__plan_ref *r = &plan->refs[i];
    uint64_t s = r->buf->shard_numel;
    uint64_t end = r->offset + r->numel;
    for (uint64_t pos = r->offset; pos < end;) {
      uint32_t rank = (uint32_t)(pos / s);
      uint64_t shard_end = (uint64_t)(rank + 1) * s;
      uint64_t len = (end < shard_end ? end : shard_end) - pos;
      if (!shardd__job_rank_local(job, rank)) { /* another node's shard */
        pos += len;
        continue;
      }
      shardd__optim_shard *sh = shard_for(o, &cap, r->buf, rank);
      if (sh == NULL || add_seg(sh, pos - (uint64_t)rank * s, len, r->group,
                                (uint32_t)i) != SHARDD_OK)
        goto nomem;
      pos += len;
    }
  }

  for (size_t i = 0; i < o->nshards; i++) {
    shardd__optim_shard *sh = &o->shards[i];
    int k = 0;
    for (size_t j = 0; j < sh->nsegs; j++) {
      int c = shardd__optim_state_count(&plan->groups[sh->segs[j].group]);
      k = c > k ? c : k;
    }
    sh->nstate = k;
    size_t off = shardd__optim_state_layout(sh->buf->dtype, sh->buf->shard_numel,
                                            k, &sh->master_off, sh->state_offs);
    if (off == 0)
      continue; /* plain SGD on fp32 keeps no state */
    /* a 16-bit shard's seed moves into its master: never both held */
    int parked = shardd__optim_shard_seed_park(reg, sh);
    if (!shardd__within_quota(reg, job, off, err, errlen)) {
      if (parked)
        shardd__optim_shard_seed_unpark(reg, sh);
      rc = SHARDD_E_NO_MEMORY;
      goto fail;
    }
    char label[64], why[256];
    snprintf(label, sizeof label, "shardd:optim:%.40s:%" PRIu32,
             sh->buf->hdr.name, sh->rank);
    const shardd__backend_ops *ops = reg->backend->ops;
    rc = (ops->alloc_private ? ops->alloc_private : ops->alloc)(
        reg->backend, shardd__rank_device(reg, sh->rank), off, label, &sh->state,
        why, sizeof why);
    if (rc != SHARDD_OK) {
      if (parked)
        shardd__optim_shard_seed_unpark(reg, sh);
      snprintf(err, errlen, "optimizer state for buffer \"%s\" rank %" PRIu32 ": %s",
               sh->buf->hdr.name, sh->rank, why);
      goto fail;
    }
    if ((rc = state_charge(reg, job, sh, err, errlen)) != SHARDD_OK) {
      if (parked)
        shardd__optim_shard_seed_unpark(reg, sh);
      goto fail;
    }
    job->bytes += sh->state->bytes;
    /* exact fp32 initial values a trainer gave before this registration */
    if ((rc = shardd__optim_shard_seed(reg, sh, parked)) != SHARDD_OK) {
      snprintf(err, errlen, "seeding the master of buffer \"%s\" rank %" PRIu32,
               sh->buf->hdr.name, sh->rank);
      goto fail;
    }
  }

  o->refs = malloc((plan->nrefs ? plan->nrefs : 1) * sizeof *o->refs);
  o->ref_steps = calloc(plan->nrefs ? plan->nrefs : 1, sizeof *o->ref_steps);
  o->ref_scatters = calloc(plan->nrefs ? plan->nrefs : 1, sizeof *o->ref_scatters);
  if (o->refs == NULL || o->ref_steps == NULL || o->ref_scatters == NULL)
    goto nomem;
  if (shardd__obj_init(reg, &o->hdr, SHARDD__OBJ_OPTIM, plan->name, job) !=
      SHARDD_OK)
    goto nomem;
  if (shardd__map_put_str(&job->optims, plan->name, o) != SHARDD_OK) {
    shardd__obj_fini(reg, &o->hdr);
    o->hdr.name = NULL;
    goto nomem;
  }
  for (size_t i = 0; i < plan->nrefs; i++) {
    shardd__obj *r = plan->refs[i].obj;
    if (r->kind == SHARDD__OBJ_VIEW) {
      ((shardd__view *)r)->owner = o;
      ((shardd__view *)r)->owner_ref = (uint32_t)o->nrefs;
      shardd__buffer_held_add((shardd__view *)r);
    } else
      ((shardd__buffer *)r)->owner = o;
    o->refs[o->nrefs++] = r;
    plan->refs[i].buf->nowned++;
  }
  o->groups = plan->groups;
  o->ngroups = plan->ngroups;
  o->spec = plan->spec;
  o->spec_len = plan->spec_len;
  plan->groups = NULL;
  plan->spec = NULL;
  *out = o;
  return SHARDD_OK;

nomem:
  rc = SHARDD_E_NO_MEMORY;
  snprintf(err, errlen, "out of memory registering optimizer");
fail:
  if (o) {
    optim_free_shards(reg, o);
    free(o->refs);
    free(o->ref_steps);
    free(o->ref_scatters);
    free(o);
  }
  return rc;
}

size_t shardd__optim_state_layout(shardd_dtype dtype, uint64_t shard_numel,
                                  int nstate, size_t *master_off,
                                  size_t state_offs[3]) {
  size_t arr = shard_numel * sizeof(float);
  size_t off = 0;
  *master_off = 0;
  if (dtype != SHARDD_DTYPE_FP32) {
    off = nstate > 0 ? shardd__area_end(0, arr) : arr;
  }
  for (int j = 0; j < nstate; j++) {
    state_offs[j] = off;
    off = j + 1 < nstate ? shardd__area_end(off, arr) : off + arr;
  }
  return off;
}

shardd__optim *shardd__optim_find(shardd__job *job, const char *name) {
  return shardd__map_get_str(&job->optims, name);
}

shardd_err shardd__optim_unregister(shardd__registry *reg, shardd__job *job,
                                    uint64_t id, char *err, size_t errlen) {
  shardd__obj *o;
  shardd_err rc = shardd__registry_resolve(reg, job, id, SHARDD__OBJ_OPTIM, &o,
                                           err, errlen);
  if (rc != SHARDD_OK)
    return rc;
  shardd__optim *opt = (shardd__optim *)o;
  if (opt->inflight > 0) {
    snprintf(err, errlen, "optimizer %" PRIu64 " has a step in flight", id);
    return SHARDD_E_BUSY;
  }
  shardd__optim_destroy(reg, opt);
  return SHARDD_OK;
}

void shardd__optim_hold(shardd__optim *o) {
  o->inflight++;
  for (size_t i = 0; i < o->nshards; i++)
    shardd__buffer_hold(o->shards[i].buf);
}

void shardd__optim_release_hold(shardd__optim *o) {
  o->inflight--;
  for (size_t i = 0; i < o->nshards; i++)
    shardd__buffer_release_hold(o->shards[i].buf);
}

/* ---- torch's per-parameter state ---------------------------------------- */

/* A written master's rounding into rank's 16-bit shard from element
 * first: the shard then agrees with it, so the next step's adoption of
 * trainer writes (a shard that is not the master's rounding) keeps the
 * written master instead of taking the shard's old value back. */
static shardd_err narrow_into_shard(shardd__backend *be, shardd__buffer *b,
                                    uint32_t rank, uint64_t first,
                                    const float *m, uint64_t n) {
  uint16_t tmp[1024];
  for (uint64_t i = 0; i < n;) {
    uint64_t k = n - i < 1024 ? n - i : 1024;
    for (uint64_t j = 0; j < k; j++)
      tmp[j] = b->dtype == SHARDD_DTYPE_BF16 ? shardd__f32_to_bf16(m[i + j])
                                             : shardd__f32_to_f16(m[i + j]);
    size_t off = b->shard_off + (size_t)(first + i) * 2;
    if (be->ops->write == NULL)
      memcpy((char *)b->blocks[rank]->ptr + off, tmp, k * 2);
    else {
      shardd_err rc = be->ops->write(be, b->blocks[rank], off, tmp, k * 2);
      if (rc != SHARDD_OK)
        return rc;
    }
    i += k;
  }
  return SHARDD_OK;
}

shardd_err shardd__optim_state_io(shardd__registry *reg, shardd__optim *o,
                                  uint64_t ref_id, uint32_t array,
                                  uint64_t offset, uint64_t count, float *io,
                                  int write, uint32_t *nstate, uint64_t *numel,
                                  uint64_t **steps, char *err, size_t errlen) {
  size_t i = 0;
  while (i < o->nrefs && o->refs[i]->id != ref_id)
    i++;
  shardd__obj *r = i < o->nrefs ? o->refs[i] : NULL;
  if (r == NULL && array == SHARDD__OPTIM_MASTER && !write) {
    /* The master covers o's whole shards, elements of views it does not
     * hold too (the exact seed, kept): readable through those views, so a
     * re-registration that adds them (add_param_group) keeps it. */
    char ignored[8];
    if (shardd__registry_resolve(reg, o->hdr.job, ref_id, SHARDD__OBJ_VIEW, &r,
                                 ignored, sizeof ignored) != SHARDD_OK &&
        shardd__registry_resolve(reg, o->hdr.job, ref_id, SHARDD__OBJ_BUFFER, &r,
                                 ignored, sizeof ignored) != SHARDD_OK)
      r = NULL;
    const shardd__buffer *rb = r == NULL ? NULL
                               : r->kind == SHARDD__OBJ_VIEW ? ((shardd__view *)r)->buf
                                                             : (shardd__buffer *)r;
    size_t q = 0;
    while (rb != NULL && q < o->nshards && o->shards[q].buf != rb)
      q++;
    if (rb == NULL || q == o->nshards)
      r = NULL;
  }
  if (r == NULL) {
    snprintf(err, errlen, "optimizer \"%s\" holds no parameter %" PRIu64,
             o->hdr.name, ref_id);
    return SHARDD_E_NOT_FOUND;
  }
  if (o->inflight) {
    snprintf(err, errlen, "optimizer \"%s\" has a step queued or running",
             o->hdr.name);
    return SHARDD_E_BUSY;
  }
  shardd__buffer *b;
  uint64_t base, n;
  if (r->kind == SHARDD__OBJ_VIEW) {
    const shardd__view *v = (const shardd__view *)r;
    b = v->buf;
    base = v->offset;
    n = v->numel;
  } else {
    b = (shardd__buffer *)r;
    base = 0;
    n = b->numel;
  }
  /* the parameter's group: of any of its segments (one group per ref) */
  int k = 0;
  for (size_t s = 0; s < o->nshards && k == 0; s++)
    for (size_t j = 0; j < o->shards[s].nsegs; j++)
      if (o->shards[s].segs[j].ref == i) {
        k = shardd__optim_state_count(&o->groups[o->shards[s].segs[j].group]);
        break;
      }
  *nstate = (uint32_t)k;
  *numel = n;
  *steps = i < o->nrefs ? &o->ref_steps[i] : NULL; /* NULL: not held */
  int master = array == SHARDD__OPTIM_MASTER;
  if (master && b->dtype == SHARDD_DTYPE_FP32) {
    snprintf(err, errlen, "parameter %" PRIu64 " of optimizer \"%s\" is fp32: "
             "its shard is its own master", ref_id, o->hdr.name);
    return SHARDD_E_INVAL;
  }
  if (count == 0)
    return SHARDD_OK;
  if ((!master && array >= (uint32_t)k) || offset > n || count > n - offset) {
    snprintf(err, errlen, "parameter %" PRIu64 " of optimizer \"%s\": array %" PRIu32
             " elements [%" PRIu64 ", %" PRIu64 ") is outside its %d arrays of "
             "%" PRIu64, ref_id, o->hdr.name, array, offset, offset + count, k, n);
    return SHARDD_E_RANGE;
  }
  shardd__backend *be = reg->backend;
  uint64_t s = b->shard_numel;
  for (uint64_t e = base + offset, end = base + offset + count; e < end;) {
    uint32_t rank = (uint32_t)(e / s);
    uint64_t len = ((uint64_t)rank + 1) * s - e;
    if (len > end - e)
      len = end - e;
    shardd__optim_shard *sh = NULL;
    for (size_t q = 0; q < o->nshards && sh == NULL; q++)
      if (o->shards[q].buf == b && o->shards[q].rank == rank)
        sh = &o->shards[q];
    if (sh == NULL || sh->state == NULL || (!master && (int)array >= sh->nstate)) {
      snprintf(err, errlen, "rank %" PRIu32 "'s shard of parameter %" PRIu64
               " is not on this node", rank, ref_id);
      return SHARDD_E_STATE;
    }
    if (master && !sh->master_valid && !write) {
      snprintf(err, errlen, "rank %" PRIu32 "'s shard of parameter %" PRIu64
               " has no fp32 master yet (before the first step, not seeded)",
               rank, ref_id);
      return SHARDD_E_STATE;
    }
    if (master && !sh->master_valid) {
      /* the master is taken now from the 16-bit shard, as the first step
       * would (no seed: a seed is copied in at registration), so the
       * elements this write leaves alone keep their values */
      shardd_err wr = be->ops->widen(be, b->dtype, sh->state, sh->master_off,
                                     b->blocks[rank], b->shard_off, s);
      if (wr != SHARDD_OK) {
        snprintf(err, errlen, "fp32 master of rank %" PRIu32 ": %s", rank,
                 shardd_strerror(wr));
        return wr;
      }
      sh->master_valid = 1;
    }
    size_t off = (master ? sh->master_off : sh->state_offs[array]) +
                 (size_t)(e - (uint64_t)rank * s) * 4;
    float *at = io + (e - base - offset);
    shardd_err rc = SHARDD_OK;
    if (be->ops->read == NULL) { /* host: the daemon's own memory */
      char *p = (char *)sh->state->ptr + off;
      if (write)
        memcpy(p, at, len * 4);
      else
        memcpy(at, p, len * 4);
    } else {
      rc = write ? be->ops->write(be, sh->state, off, at, len * 4)
                 : be->ops->read(be, sh->state, off, at, len * 4);
    }
    if (rc == SHARDD_OK && master && write)
      rc = narrow_into_shard(be, b, rank, e - (uint64_t)rank * s, at, len);
    if (rc != SHARDD_OK) {
      snprintf(err, errlen, "optimizer state of rank %" PRIu32 ": %s", rank,
               shardd_strerror(rc));
      return rc;
    }
    e += len;
  }
  return SHARDD_OK;
}
