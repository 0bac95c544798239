/* buffer.c — flat buffers: their layout and rank blocks, registration and
 * attach, holds by collectives, and the staging area. Their views are
 * views.c, the index of held views held.c, fp32 masters from exact values
 * seed.c. */
#include "registry.h"
#include "registry_int.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define AREA_ALIGN 4096u

static size_t align_up(size_t n, size_t a) { return (n + a - 1) / a * a; }

/* Where one streamed area ends and the next begins. Large shards have
 * power-of-two sizes, which put param, grad and state at addresses equal in
 * their low bits: the update's streams then fight over the same cache sets
 * (measured 3.9 GB/s instead of 28 for 64M-element AdamW). An odd number of
 * pages between large areas breaks that; small areas stay packed. */
size_t shardd__area_end(size_t start, size_t bytes) {
  size_t gap = bytes >= ((size_t)1 << 20) ? 19 * (size_t)AREA_ALIGN : 0;
  return align_up(start + bytes, AREA_ALIGN) + gap;
}

/* ---- buffers ---------------------------------------------------------- */

/* b's element counts and the layout of its rank blocks in job. */
static void buffer_layout(shardd__buffer *b, const shardd__job *job,
                          shardd_dtype dtype, uint64_t numel) {
  size_t esz = shardd_dtype_size(dtype);
  b->dtype = dtype;
  b->numel = numel;
  b->world = job->world;
  b->shard_numel = (numel + job->world - 1) / job->world;
  b->padded_numel = b->shard_numel * job->world;
  b->shard_off = 0;
  b->reduced_off = shardd__area_end(b->shard_off, b->shard_numel * esz);
  if (job->transient) {
    /* the gather and gradient areas are leased (areas.c) */
    b->block_bytes = align_up(b->reduced_off + b->shard_numel * 4, AREA_ALIGN);
  } else {
    b->gather_off = shardd__area_end(b->reduced_off, b->shard_numel * 4);
    b->grad_off = shardd__area_end(b->gather_off, b->padded_numel * esz);
    b->block_bytes = align_up(b->grad_off + b->padded_numel * esz, AREA_ALIGN);
  }
}

uint64_t shardd__buffer_block_bytes(const shardd__job *job, shardd_dtype dtype,
                                    uint64_t numel) {
  if (shardd_dtype_size(dtype) == 0 || numel == 0 ||
      numel > SHARDD__MAX_NUMEL)
    return 0;
  shardd__buffer b;
  buffer_layout(&b, job, dtype, numel);
  return b.block_bytes;
}

/* The open slab rank r's blocks of job come from, NULL none. */
static shardd__slab *open_slab(const shardd__registry *reg,
                               const shardd__job *job, uint32_t r) {
  return reg->slabs && reg->slab_job == job ? reg->slabs[r - job->local_first]
                                            : NULL;
}

shardd_err shardd__buffer_slabs_begin(shardd__registry *reg, shardd__job *job,
                                      uint64_t bytes, size_t nblocks,
                                      char *err, size_t errlen) {
  shardd__backend *be = reg->backend;
  if (be->ops->slab_open == NULL || nblocks == 0 || reg->slabs)
    return SHARDD_OK;
  if (!shardd__within_blocks(reg, job, job->local_ranks, err, errlen))
    return SHARDD_E_LIMIT;
  reg->slabs = calloc(job->local_ranks, sizeof *reg->slabs);
  if (reg->slabs == NULL) {
    snprintf(err, errlen, "out of memory");
    return SHARDD_E_NO_MEMORY;
  }
  reg->slab_job = job;
  for (uint32_t i = 0; i < job->local_ranks; i++) {
    uint32_t r = job->local_first + i;
    char label[64];
    snprintf(label, sizeof label, "shardd:%.40s:%" PRIu32, job->name, r);
    shardd_err rc = be->ops->slab_open(be, shardd__rank_device(reg, r), bytes,
                                       nblocks, label, &reg->slabs[i], err,
                                       errlen);
    if (rc != SHARDD_OK) {
      char why[256];
      shardd__buffer_slabs_end(reg, why, sizeof why); /* none taken: cannot fail */
      return rc;
    }
  }
  return SHARDD_OK;
}

shardd_err shardd__buffer_slabs_end(shardd__registry *reg, char *err,
                                    size_t errlen) {
  shardd_err rc = SHARDD_OK;
  if (reg->slabs == NULL)
    return SHARDD_OK;
  for (uint32_t i = 0; i < reg->slab_job->local_ranks; i++) {
    char why[256];
    if (reg->slabs[i] &&
        reg->backend->ops->slab_close(reg->backend, reg->slabs[i], why,
                                      sizeof why) != SHARDD_OK &&
        rc == SHARDD_OK) {
      rc = SHARDD_E_IO;
      snprintf(err, errlen, "rank %" PRIu32 "'s blocks: %s",
               reg->slab_job->local_first + i, why);
    }
  }
  free(reg->slabs);
  reg->slabs = NULL;
  reg->slab_job = NULL;
  return rc;
}

static void buffer_free_blocks(shardd__registry *reg, shardd__buffer *b) {
  if (b->blocks == NULL)
    return;
  for (uint32_t r = 0; r < b->world; r++) {
    if (b->blocks[r]) {
      /* a block of a slab gives back its slab's bytes and descriptor
       * with the slab's last block */
      uint64_t bytes;
      int n;
      shardd__backend_region_gives(b->blocks[r], &bytes, &n);
      b->hdr.job->bytes -= bytes;
      b->hdr.job->nblocks -= (uint64_t)n;
      reg->nblocks -= (uint64_t)n;
      reg->backend->ops->free(reg->backend, b->blocks[r]);
    }
  }
  free(b->blocks);
  shardd__buffer_seed_drop(reg, b);
  if (b->stage) {
    b->hdr.job->bytes -= b->stage->bytes;
    shardd__region_uncount(reg, b->hdr.job, b->stage);
    reg->backend->ops->free(reg->backend, b->stage);
    b->stage = NULL;
  }
  b->blocks = NULL;
}

void shardd__buffer_destroy(shardd__registry *reg, shardd__buffer *b) {
  shardd__view **views;
  size_t n;
  if (shardd__obj_values(&b->views, (void ***)&views, &n) == SHARDD_OK) {
    for (size_t i = 0; i < n; i++)
      shardd__view_destroy(reg, views[i]);
    free(views);
  }
  shardd__map_free(&b->views);
  shardd__map_del_str(&b->hdr.job->buffers, b->hdr.name);
  shardd__areas_unit_removed(b);
  shardd__areas_buffer_fini(b);
  buffer_free_blocks(reg, b);
  shardd__record_freed(&b->hdr, NULL);
  shardd__obj_fini(reg, &b->hdr);
  free(b->frozen_union);
  free(b);
}

shardd_err shardd__buffer_register(shardd__registry *reg, shardd__job *job,
                                   const char *name, shardd_dtype dtype,
                                   uint64_t numel, shardd__buffer **out,
                                   int *created, char *err, size_t errlen) {
  *out = NULL;
  *created = 0;
  if (!shardd__name_ok(name, "buffer", err, errlen))
    return SHARDD_E_INVAL;
  size_t esz = shardd_dtype_size(dtype);
  if (esz == 0) {
    snprintf(err, errlen, "buffer \"%s\": dtype %d is not fp32, bf16 or fp16",
             name, (int)dtype);
    return SHARDD_E_DTYPE;
  }
  if (numel == 0 || numel > SHARDD__MAX_NUMEL) {
    snprintf(err, errlen,
             "buffer \"%s\": numel %" PRIu64 " is out of range [1, 2^40]", name,
             numel);
    return SHARDD_E_RANGE;
  }
  shardd__buffer *b = shardd__map_get_str(&job->buffers, name);
  if (b) {
    if (b->dtype != dtype || b->numel != numel) {
      snprintf(err, errlen,
               "buffer \"%s\" exists as %s[%" PRIu64 "], not %s[%" PRIu64 "]",
               name, shardd_dtype_name(b->dtype), b->numel,
               shardd_dtype_name(dtype), numel);
      return SHARDD_E_MISMATCH;
    }
    *out = b;
    return SHARDD_OK;
  }

  b = calloc(1, sizeof *b);
  if (b == NULL) {
    snprintf(err, errlen, "out of memory");
    return SHARDD_E_NO_MEMORY;
  }
  buffer_layout(b, job, dtype, numel);
  b->grad_seen = 1;
  b->hdr.job = job;
  shardd__map_init(&b->views);

  shardd_err rc = SHARDD_E_NO_MEMORY;
  char *gkey = NULL;
  uint64_t gprev = 0;
  if (job->transient && shardd__areas_buffer_init(b) != SHARDD_OK) {
    snprintf(err, errlen, "out of memory");
    goto fail;
  }
  /* its rank blocks, and what its unit adds to the pools of transient
   * areas: reserved now, so a limit is met here, not at a first gather */
  uint64_t blocks = (uint64_t)job->local_ranks * b->block_bytes;
  uint64_t pools = shardd__areas_reserve(job, b) - shardd__areas_reserve(job, NULL);
  if (!shardd__within_quota(reg, job, blocks + pools, err, errlen)) {
    size_t used = strlen(err);
    if (used < errlen)
      snprintf(err + used, errlen - used, "; buffer \"%s\" would take %" PRIu64
               " bytes of rank blocks", name, blocks);
    if (pools && (used = strlen(err)) < errlen)
      snprintf(err + used, errlen - used, " and reserve %" PRIu64 " for its "
               "gather and gradient areas", pools);
    goto fail;
  }
  /* a batch's slabs were counted when it opened them */
  if (open_slab(reg, job, job->local_first) == NULL &&
      !shardd__within_blocks(reg, job, job->local_ranks, err, errlen)) {
    rc = SHARDD_E_LIMIT;
    goto fail;
  }
  b->blocks = calloc(job->world, sizeof *b->blocks);
  if (b->blocks == NULL) {
    snprintf(err, errlen, "out of memory");
    goto fail;
  }
  for (uint32_t r = job->local_first; r < job->local_first + job->local_ranks; r++) {
    char label[64];
    snprintf(label, sizeof label, "shardd:%.40s:%" PRIu32, name, r);
    char why[256];
    shardd__slab *sl = open_slab(reg, job, r);
    shardd__backend *be = reg->backend;
    rc = sl ? be->ops->slab_take(be, sl, b->block_bytes, &b->blocks[r], why,
                                 sizeof why)
            : be->ops->alloc(be, shardd__rank_device(reg, r), b->block_bytes,
                             label, &b->blocks[r], why, sizeof why);
    if (rc != SHARDD_OK) {
      snprintf(err, errlen, "buffer \"%s\" rank %" PRIu32 ": %s", name, r,
               why);
      goto fail;
    }
    uint64_t taken;
    int n;
    shardd__backend_region_taken(b->blocks[r], &taken, &n);
    job->bytes += taken;
    job->nblocks += (uint64_t)n;
    reg->nblocks += (uint64_t)n;
  }
  gkey = shardd__gen_key(name, NULL);
  if (gkey == NULL || shardd__gen_next(job, gkey, &gprev) != SHARDD_OK) {
    rc = SHARDD_E_NO_MEMORY;
    snprintf(err, errlen, "out of memory");
    goto fail;
  }
  b->hdr.generation = gprev + 1;
  if (shardd__obj_init(reg, &b->hdr, SHARDD__OBJ_BUFFER, name, job) !=
          SHARDD_OK ||
      shardd__map_put_str(&job->buffers, name, b) != SHARDD_OK) {
    rc = SHARDD_E_NO_MEMORY;
    snprintf(err, errlen, "out of memory");
    shardd__gen_put(job, gkey, gprev); /* replaces or deletes: cannot fail */
    goto fail;
  }
  free(gkey);
  if (job->transient)
    shardd__areas_unit_added(b);
  *out = b;
  *created = 1;
  return SHARDD_OK;

fail:
  free(gkey);
  buffer_free_blocks(reg, b);
  shardd__obj_fini(reg, &b->hdr);
  shardd__map_free(&b->views);
  free(b->lease);
  free(b->lease_left);
  free(b);
  return rc;
}

shardd_err shardd__buffer_unregister(shardd__registry *reg, shardd__job *job,
                                     uint64_t id, char *err, size_t errlen) {
  shardd_err rc = shardd__buffer_unregister_check(reg, job, id, err, errlen);
  if (rc != SHARDD_OK)
    return rc;
  shardd__obj *o;
  shardd__registry_resolve(reg, job, id, SHARDD__OBJ_BUFFER, &o, err, errlen);
  shardd__buffer_destroy(reg, (shardd__buffer *)o);
  return SHARDD_OK;
}

shardd_err shardd__buffer_unregister_check(shardd__registry *reg,
                                           shardd__job *job, uint64_t id,
                                           char *err, size_t errlen) {
  shardd__obj *o;
  shardd_err rc = shardd__registry_resolve(reg, job, id, SHARDD__OBJ_BUFFER, &o,
                                           err, errlen);
  if (rc != SHARDD_OK)
    return rc;
  shardd__buffer *b = (shardd__buffer *)o;
  if (b->nowned > 0) {
    snprintf(err, errlen,
             "buffer %" PRIu64 " (\"%s\") is referenced by an optimizer; "
             "unregister the optimizer first",
             id, o->name);
    return SHARDD_E_BUSY;
  }
  if (b->inflight > 0) {
    snprintf(err, errlen,
             "buffer %" PRIu64 " (\"%s\") has %" PRIu32
             " collective(s) in flight",
             id, o->name, b->inflight);
    return SHARDD_E_BUSY;
  }
  return SHARDD_OK;
}

void shardd__buffer_abandon(shardd__registry *reg, shardd__buffer *b) {
  shardd__job *job = b->hdr.job;
  char *gkey = shardd__gen_key(b->hdr.name, NULL);
  /* the registration put the key, so this replaces or deletes */
  if (gkey)
    shardd__gen_put(job, gkey, b->hdr.generation - 1);
  free(gkey);
  shardd__map_free(&b->views); /* a buffer just created has none */
  shardd__map_del_str(&job->buffers, b->hdr.name);
  shardd__areas_unit_removed(b);
  shardd__areas_buffer_fini(b);
  buffer_free_blocks(reg, b);
  shardd__obj_fini(reg, &b->hdr);
  free(b->frozen_union);
  free(b);
}

void shardd__buffer_hold(shardd__buffer *b) { b->inflight++; }

void shardd__buffer_release_hold(shardd__buffer *b) { b->inflight--; }
shardd_err shardd__buffer_stage(shardd__registry *reg, shardd__buffer *b,
                                char *err, size_t errlen) {
  if (b->stage)
    return SHARDD_OK;
  shardd__job *job = b->hdr.job;
  shardd__backend *be = reg->backend;
  size_t bytes = b->padded_numel * 4;
  /* held as long as the buffer: it counts against the job's and its uid's
   * memory limits, as the buffer's rank blocks do; uncounted, every
   * multi-node buffer's first scatter took its padded size again beyond
   * them */
  if (!shardd__within_quota(reg, job, bytes, err, errlen)) {
    size_t used = strlen(err);
    if (used < errlen)
      snprintf(err + used, errlen - used, "; buffer \"%s\"'s staging area for "
               "the cross-node sum would take %zu bytes", b->hdr.name, bytes);
    return SHARDD_E_NO_MEMORY;
  }
  shardd__region *r = NULL;
  /* it never leaves the daemon: no descriptor where the backend can do
   * without one */
  shardd_err rc = (be->ops->alloc_private ? be->ops->alloc_private : be->ops->alloc)(
      be, shardd__rank_device(reg, job->local_first), bytes, "shardd:stage", &r,
      err, errlen);
  if (rc != SHARDD_OK)
    return rc;
  /* a memfd all the same (the fd store's): it counts against the bounds
   * on memory regions as a rank block does */
  char what[320];
  snprintf(what, sizeof what, "buffer \"%s\"'s staging area for the "
           "cross-node sum", b->hdr.name);
  if (!shardd__region_count(reg, job, r, 1, what, err, errlen)) {
    be->ops->free(be, r);
    return SHARDD_E_LIMIT;
  }
  job->bytes += r->bytes;
  b->stage = r;
  return SHARDD_OK;
}
