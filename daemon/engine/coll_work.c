/* coll_work.c — the work of a collective: the tasks it is cut into and
 * what a pool thread does for each (per-rank copies, reductions, norms and
 * optimizer updates; the local stages of a multi-node collective). */
#include "coll_int.h"

#include <stdlib.h>

/* ---- work ------------------------------------------------------------- */

void shardd__coll_gather_unit(coll *c, task *t) {
  shardd__backend *be = c->e->be;
  shardd__buffer *b = c->buf;
  size_t esz = shardd_dtype_size(b->dtype);
  uint64_t s = b->shard_numel;
  for (uint64_t pos = t->start, end = t->start + t->len;
       pos < end && t->rc == SHARDD_OK;) {
    uint64_t q = pos / s, off = pos % s;
    uint64_t n = s - off < end - pos ? s - off : end - pos;
    t->rc = be->ops->copy(be, c->area_reg[t->a], c->area_off[t->a] + pos * esz,
                          b->blocks[q], b->shard_off + off * esz, n * esz);
    pos += n;
  }
}

void shardd__coll_scatter_unit(coll *c, task *t) {
  shardd__backend *be = c->e->be;
  shardd__buffer *b = c->buf;
  size_t esz = shardd_dtype_size(b->dtype);
  uint32_t w = b->world;
  /* a few ranks' offsets on the stack: a bucket's entries are many small
   * tasks, and a malloc each was a cost of its own */
  size_t few[16];
  size_t *offs = w <= 16 ? few : malloc(w * sizeof *offs);
  if (offs == NULL) {
    t->rc = SHARDD_E_NO_MEMORY;
    return;
  }
  uint64_t first = t->b + t->start; /* element in the shard (b: the
                                       trainable range's start) */
  for (uint32_t r = 0; r < w; r++)
    offs[r] = c->area_off[r] + (t->a * b->shard_numel + first) * esz;
  float div = c->args.op == SHARDD_REDUCE_MEAN ? (float)w : 1.0f;
  t->rc = (c->adding ? be->ops->reduce_add : be->ops->reduce)(
      be, b->dtype, div, b->blocks[t->a], b->reduced_off + first * 4,
      c->area_reg, offs, (int)w, t->len);
  if (offs != few)
    free(offs);
}

static void norm_task(coll *c, task *t) {
  shardd__backend *be = c->e->be;
  shardd__optim_shard *sh = &c->opt->shards[t->a];
  const shardd__seg *sg = &sh->segs[t->b];
  t->rc = be->ops->sumsq(be, sh->buf->blocks[sh->rank],
                         sh->buf->reduced_off + (sg->start + t->start) * 4,
                         t->len, &t->sumsq);
}

static void update_task(coll *c, task *t) {
  shardd__backend *be = c->e->be;
  shardd__optim_shard *sh = &c->opt->shards[t->a];
  const shardd__seg *sg = &sh->segs[t->b];
  shardd__buffer *b = sh->buf;
  shardd__region *blk = b->blocks[sh->rank];
  size_t esz = shardd_dtype_size(b->dtype);
  int wide = b->dtype != SHARDD_DTYPE_FP32;
  uint64_t first = sg->start + t->start; /* element index in the shard */
  uint64_t step = c->ref_step[sg->ref];
  if (wide && !sh->master_valid) {
    /* The trainer writes initial values into its shard after registering,
     * so the fp32 master copy is taken at the first step. */
    t->rc = be->ops->widen(be, b->dtype, sh->state, sh->master_off + first * 4,
                           blk, b->shard_off + first * esz, t->len);
    if (t->rc != SHARDD_OK)
      return;
  } else if (wide && be->ops->adopt) {
    /* a trainer's write to the shard since the last step stays */
    t->rc = be->ops->adopt(be, b->dtype, sh->state, sh->master_off + first * 4,
                           blk, b->shard_off + first * esz, t->len);
    if (t->rc != SHARDD_OK)
      return;
  }
  if (step == 0)
    return; /* skipped: only its master copy taken, for when it is stepped */
  size_t offs[3];
  for (int k = 0; k < 3; k++)
    offs[k] = sh->state_offs[k] + first * 4;
  t->rc = be->ops->update(be, &c->hp[sg->group], step, b->dtype, blk,
                          b->shard_off + first * esz, wide ? sh->state : NULL,
                          sh->master_off + first * 4, blk,
                          b->reduced_off + first * 4, c->grad_scale, sh->state,
                          offs, t->len);
}

/* ---- the local stages of a multi-node collective (coll_fabric.c) ------ */

/* gather stage 0: local shard a -> its place in the first local rank's
 * gather area */
static void mgather_pack(coll *c, task *t) {
  shardd__backend *be = c->e->be;
  shardd__buffer *b = c->buf;
  size_t esz = shardd_dtype_size(b->dtype);
  uint32_t lo = c->job->local_first;
  t->rc = be->ops->copy(be, b->blocks[lo],
                        b->gather_off + (t->a * b->shard_numel + t->start) * esz,
                        b->blocks[t->a], b->shard_off + t->start * esz,
                        t->len * esz);
}

/* gather stage 2: the whole buffer from the first local rank to rank a */
static void mgather_fan(coll *c, task *t) {
  shardd__backend *be = c->e->be;
  shardd__buffer *b = c->buf;
  size_t esz = shardd_dtype_size(b->dtype);
  uint32_t lo = c->job->local_first;
  t->rc = be->ops->copy(be, b->blocks[t->a], b->gather_off + t->start * esz,
                        b->blocks[lo], b->gather_off + t->start * esz,
                        t->len * esz);
}

/* scatter stage 0: staging = sum over local ranks' gradients (rank order) */
static void mscatter_sum(coll *c, task *t) {
  shardd__backend *be = c->e->be;
  shardd__buffer *b = c->buf;
  size_t esz = shardd_dtype_size(b->dtype);
  uint32_t lo = c->job->local_first, n = c->job->local_ranks;
  size_t *offs = malloc(n * sizeof *offs);
  if (offs == NULL) {
    t->rc = SHARDD_E_NO_MEMORY;
    return;
  }
  for (uint32_t i = 0; i < n; i++)
    offs[i] = b->grad_off + t->start * esz;
  t->rc = be->ops->reduce(be, b->dtype, 1.0f, b->stage, t->start * 4,
                          b->blocks + lo, offs, (int)n, t->len);
  free(offs);
}

/* scatter stage 2: owner a's reduced shard = its part of the staged sum */
static void mscatter_own(coll *c, task *t) {
  shardd__backend *be = c->e->be;
  shardd__buffer *b = c->buf;
  float div = c->args.op == SHARDD_REDUCE_MEAN ? (float)b->world : 1.0f;
  uint64_t first = t->b + t->start; /* as in scatter_task */
  size_t off = (t->a * b->shard_numel + first) * 4;
  shardd__region *src = b->stage;
  t->rc = (c->adding ? be->ops->reduce_add : be->ops->reduce)(
      be, SHARDD_DTYPE_FP32, div, b->blocks[t->a], b->reduced_off + first * 4,
      &src, &off, 1, t->len);
}

static void work_one(task *t);

void shardd__coll_claim_run(coll *c) {
  size_t i;
  while ((i = atomic_fetch_add_explicit(&c->claim, 1, memory_order_relaxed)) <
         c->ntasks)
    work_one(&c->tasks[i]);
}

void shardd__coll_work(uv_work_t *req) {
  task *t = req->data;
  coll *c = t->c;
  if (c->ntasks == 0) /* the empty task of a collective with no work */
    return;
  if (c->claiming) {
    shardd__coll_claim_run(c);
    return;
  }
  if (t->group > 1) {
    for (size_t i = 0; i < t->group; i++)
      work_one(&c->tasks[i]);
    return;
  }
  work_one(t);
}

static void work_one(task *t) {
  coll *c = t->c;
  if (t->bulk) {
    shardd__coll_bulk_task(c, t);
    return;
  }
  if (shardd__coll_multi(c) && c->args.kind == SHARDD__COLL_GATHER) {
    if (c->stage == 0)
      mgather_pack(c, t);
    else
      mgather_fan(c, t);
    return;
  }
  if (shardd__coll_multi(c) && c->args.kind == SHARDD__COLL_SCATTER) {
    if (c->stage == 0)
      mscatter_sum(c, t);
    else
      mscatter_own(c, t);
    return;
  }
  switch (c->args.kind) {
  case SHARDD__COLL_GATHER:
    shardd__coll_gather_unit(c, t);
    break;
  case SHARDD__COLL_SCATTER:
    shardd__coll_scatter_unit(c, t);
    break;
  case SHARDD__COLL_STEP:
    if (c->phase == 0)
      norm_task(c, t);
    else
      update_task(c, t);
    break;
  case SHARDD__COLL_ALL_REDUCE:
    break; /* reduced on the loop; only its empty task runs */
  }
}

/* Cuts unit (ua, ub) of len elements into chunk tasks; with out NULL only
 * counts them. */
static size_t add_unit_by(task *out, size_t n, size_t ua, size_t ub,
                          uint64_t len, uint64_t chunk) {
  for (uint64_t st = 0; st < len; st += chunk, n++) {
    if (out) {
      out[n].a = ua;
      out[n].b = ub;
      out[n].start = st;
      out[n].len = len - st < chunk ? len - st : chunk;
    }
  }
  return n;
}

static size_t add_unit(task *out, size_t n, size_t ua, size_t ub, uint64_t len) {
  return add_unit_by(out, n, ua, ub, len, CHUNK_ELEMS);
}

/* Scatter units of owner rank r: its shard's trainable ranges (unit b =
 * the range's first element in the shard). Frozen elements get no work,
 * and a wholly frozen shard none at all. */
static size_t add_trainable_units(task *out, size_t n, shardd__buffer *b,
                                  uint32_t r, uint64_t chunk) {
  uint64_t lo = (uint64_t)r * b->shard_numel, hi = lo + b->shard_numel;
  if (b->nfrozen == 0)
    return add_unit_by(out, n, r, 0, b->shard_numel, chunk);
  uint64_t rs[64][2];
  for (uint64_t pos = lo; pos < hi;) {
    size_t k = shardd__buffer_trainable(b, pos, hi, rs, 64);
    size_t m = k < 64 ? k : 64;
    for (size_t i = 0; i < m; i++)
      n = add_unit_by(out, n, r, rs[i][0] - lo, rs[i][1], chunk);
    if (k <= 64)
      break;
    pos = rs[63][0] + rs[63][1];
  }
  return n;
}

size_t shardd__coll_plan(coll *c, task *out) {
  size_t n = 0;
  if (shardd__coll_multi(c) && c->stage == 1) {
    if (out)
      out[0].fabric = 1;
    return 1;
  }
  if (shardd__coll_multi(c) && c->args.kind != SHARDD__COLL_STEP) {
    shardd__buffer *b = c->buf;
    uint32_t lo = c->job->local_first, hi = lo + c->job->local_ranks;
    if (c->args.kind == SHARDD__COLL_SCATTER && c->stage == 0)
      return add_unit(out, n, 0, 0, b->padded_numel);
    for (uint32_t r = lo; r < hi; r++) {
      if (c->args.kind == SHARDD__COLL_GATHER && c->stage == 2)
        n = r == lo ? n : add_unit(out, n, r, 0, b->padded_numel);
      else if (c->args.kind == SHARDD__COLL_SCATTER)
        n = add_trainable_units(out, n, b, r, CHUNK_ELEMS);
      else
        n = add_unit(out, n, r, 0, b->shard_numel);
    }
    return n;
  }
  if (c->args.kind == SHARDD__COLL_STEP && c->phase == 0 &&
      !(c->args.max_norm > 0) && !c->args.norm_only)
    return 0; /* multi-node, no clipping: only the header crosses nodes */
  if (c->args.kind == SHARDD__COLL_STEP) {
    /* A skipped ref has no norm and no update; at the first step of a
     * 16-bit shard it still has its master copy taken (a frozen view has
     * one when it is unfrozen, from the values it had then: the trainer's
     * initial ones, which no step changed). */
    for (size_t i = 0; i < c->opt->nshards; i++) {
      const shardd__optim_shard *sh = &c->opt->shards[i];
      int widen = c->phase == 1 && sh->buf->dtype != SHARDD_DTYPE_FP32 &&
                  !sh->master_valid;
      const shardd__seg *sg = sh->segs;
      for (size_t j = 0; j < sh->nsegs;) {
        uint64_t step = c->ref_step[sg[j].ref];
        if (!step && !widen) {
          j++;
          continue;
        }
        /* Adjacent refs of one group that this step gives one count are
         * one run of work (a task reads its first segment's group and
         * count), so a shard of many small views is not many small tasks. */
        size_t k = j + 1;
        uint64_t len = sg[j].len;
        while (k < sh->nsegs && sg[k].group == sg[j].group &&
               sg[k].start == sg[k - 1].start + sg[k - 1].len &&
               c->ref_step[sg[k].ref] == step)
          len += sg[k++].len;
        n = add_unit(out, n, i, j, len);
        j = k;
      }
    }
  } else if (c->bulk) {
    if (out)
      out[0].bulk = 1;
    return 1;
  } else {
    shardd__buffer *b = c->buf;
    /* claimed tasks (coll.c's run_claimed) cost an atomic each, not a
     * pool round trip: cut finer, the threads that happen to be awake
     * share the copies evenly (host memory: a device copy costs a call) */
    uint64_t chunk = c->e->be->caps & SHARDD__BACKEND_CAP_HOST_MAPPED
                         ? COPY_CHUNK_ELEMS : CHUNK_ELEMS;
    /* one shared area (the node's gathered copy): the first rank's only */
    uint32_t nr = c->one_area ? 1 : b->world;
    for (uint32_t r = 0; r < nr; r++)
      n = c->args.kind == SHARDD__COLL_GATHER
              ? add_unit_by(out, n, r, 0, b->padded_numel, chunk)
              : add_trainable_units(out, n, b, r, chunk);
  }
  return n;
}
