/* seed.c — fp32 masters from exact values: seeds, where they live, and
 * moving them into and out of an optimizer shard's master. */
#include "registry.h"
#include "registry_int.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- fp32 masters from exact values ------------------------------------ */

shardd_err shardd__region_zero(shardd__backend *be, shardd__region *r,
                               size_t off, size_t bytes) {
  if (be->ops->write == NULL) { /* host memory the daemon maps */
    memset((char *)r->ptr + off, 0, bytes);
    return SHARDD_OK;
  }
  static const char zeros[65536];
  for (size_t done = 0; done < bytes;) {
    size_t n = bytes - done < sizeof zeros ? bytes - done : sizeof zeros;
    shardd_err rc = be->ops->write(be, r, off + done, zeros, n);
    if (rc != SHARDD_OK)
      return rc;
    done += n;
  }
  return SHARDD_OK;
}

/* Seeds (see the buffer's seed and seed_holder) live in one place at a
 * time. Moving one between a region of its own and an optimizer shard's
 * master goes through the rank's reduced-gradient area when no gradient
 * lives there (before the buffer's first step nothing reads it then), so
 * the seed and the state it moves into are never allocated together: the
 * daemon's peak stays the bound of shard, reduced gradient and state. */

static size_t seed_bytes(const shardd__buffer *b) {
  return b->shard_numel * sizeof(float);
}

static shardd_err seed_arrays(shardd__buffer *b) {
  if (b->seed == NULL && (b->seed = calloc(b->world, sizeof *b->seed)) == NULL)
    return SHARDD_E_NO_MEMORY;
  if (b->seed_holder == NULL &&
      (b->seed_holder = calloc(b->world, sizeof *b->seed_holder)) == NULL)
    return SHARDD_E_NO_MEMORY;
  return SHARDD_OK;
}

static void seed_free(shardd__registry *reg, shardd__buffer *b, uint32_t rank) {
  if (b->seed == NULL || b->seed[rank] == NULL)
    return;
  b->hdr.job->bytes -= b->seed[rank]->bytes;
  shardd__region_uncount(reg, b->hdr.job, b->seed[rank]);
  reg->backend->ops->free(reg->backend, b->seed[rank]);
  b->seed[rank] = NULL;
}

/* (b, rank)'s seed in a region of its own, copied from (src, off). quota:
 * whether the job's limits apply (not to a seed going back from a master,
 * which gives back more than it takes). */
static shardd_err seed_region(shardd__registry *reg, shardd__buffer *b,
                              uint32_t rank, shardd__region *src, size_t off,
                              int quota, char *err, size_t errlen) {
  shardd__job *job = b->hdr.job;
  shardd__backend *be = reg->backend;
  size_t bytes = seed_bytes(b);
  if (quota && !shardd__within_quota(reg, job, bytes, err, errlen))
    return SHARDD_E_NO_MEMORY;
  char label[64];
  snprintf(label, sizeof label, "shardd:seed:%.40s:%" PRIu32, b->hdr.name, rank);
  shardd__region *r = NULL;
  shardd_err rc = (be->ops->alloc_private ? be->ops->alloc_private : be->ops->alloc)(
      be, shardd__rank_device(reg, rank), bytes, label, &r, err, errlen);
  if (rc != SHARDD_OK)
    return rc;
  /* with the fd store a seed is a memfd: it counts against the bounds on
   * memory regions as a rank block does (a seed going back from a master
   * is counted, not refused: the master's state it leaves counted more) */
  char what[320];
  snprintf(what, sizeof what, "the fp32 seed of buffer \"%s\" rank %" PRIu32,
           b->hdr.name, rank);
  if (!shardd__region_count(reg, job, r, quota, what, err, errlen)) {
    be->ops->free(be, r);
    return SHARDD_E_LIMIT;
  }
  rc = be->ops->copy(be, r, 0, src, off, bytes);
  if (rc != SHARDD_OK) {
    shardd__region_uncount(reg, job, r);
    be->ops->free(be, r);
    snprintf(err, errlen, "copying the seed: %s", shardd_strerror(rc));
    return rc;
  }
  job->bytes += r->bytes;
  b->seed[rank] = r;
  return SHARDD_OK;
}

static shardd_err reduced_zero(shardd__registry *reg, shardd__buffer *b,
                               uint32_t rank) {
  return shardd__region_zero(reg->backend, b->blocks[rank], b->reduced_off,
                             seed_bytes(b));
}

int shardd__optim_shard_seed_park(shardd__registry *reg,
                                  shardd__optim_shard *sh) {
  shardd__buffer *b = sh->buf;
  uint32_t r = sh->rank;
  if (b->seed == NULL || b->seed[r] == NULL || b->reduced_live)
    return 0;
  shardd__backend *be = reg->backend;
  if (be->ops->copy(be, b->blocks[r], b->reduced_off, b->seed[r], 0,
                    seed_bytes(b)) != SHARDD_OK)
    return 0; /* the seed stays where it is */
  seed_free(reg, b, r);
  return 1;
}

void shardd__optim_shard_seed_unpark(shardd__registry *reg,
                                     shardd__optim_shard *sh) {
  shardd__buffer *b = sh->buf;
  char why[256];
  /* it fits: the state that failed to come is not held, the seed was */
  seed_region(reg, b, sh->rank, b->blocks[sh->rank], b->reduced_off, 0, why,
              sizeof why);
  reduced_zero(reg, b, sh->rank);
}

shardd_err shardd__optim_shard_seed(shardd__registry *reg,
                                    shardd__optim_shard *sh, int parked) {
  shardd__buffer *b = sh->buf;
  uint32_t r = sh->rank;
  if (sh->state == NULL || b->dtype == SHARDD_DTYPE_FP32)
    return SHARDD_OK;
  shardd__backend *be = reg->backend;
  size_t bytes = seed_bytes(b);
  shardd_err rc;
  if (parked) {
    rc = be->ops->copy(be, sh->state, sh->master_off, b->blocks[r],
                       b->reduced_off, bytes);
    if (rc != SHARDD_OK) {
      shardd__optim_shard_seed_unpark(reg, sh);
      return rc;
    }
    reduced_zero(reg, b, r);
  } else if (b->seed && b->seed[r]) {
    rc = be->ops->copy(be, sh->state, sh->master_off, b->seed[r], 0, bytes);
    if (rc != SHARDD_OK)
      return rc;
    seed_free(reg, b, r);
  } else if (b->seed_holder && b->seed_holder[r]) {
    const shardd__optim_shard *h = b->seed_holder[r];
    rc = be->ops->copy(be, sh->state, sh->master_off, h->state, h->master_off,
                       bytes);
    if (rc != SHARDD_OK)
      return rc;
  } else {
    return SHARDD_OK;
  }
  sh->master_valid = 1;
  if (b->seed_holder && b->seed_holder[r] == NULL)
    b->seed_holder[r] = sh;
  return SHARDD_OK;
}

void shardd__optim_shard_unseed(shardd__registry *reg, shardd__optim_shard *sh) {
  shardd__buffer *b = sh->buf;
  uint32_t r = sh->rank;
  if (b->seed_holder == NULL || b->seed_holder[r] != sh)
    return;
  b->seed_holder[r] = NULL;
  shardd__job *job = b->hdr.job;
  if (job->releasing || sh->state == NULL)
    return;
  /* another optimizer's shard over (b, rank) took it too (sh's optimizer
   * is out of the job's map by now) */
  shardd__optim **opts;
  size_t no;
  if (shardd__job_optims(job, &opts, &no) == SHARDD_OK) {
    for (size_t i = 0; i < no && b->seed_holder[r] == NULL; i++)
      for (size_t k = 0; k < opts[i]->nshards; k++) {
        shardd__optim_shard *o = &opts[i]->shards[k];
        if (o != sh && o->buf == b && o->rank == r && o->state && o->master_valid) {
          b->seed_holder[r] = o;
          break;
        }
      }
    free(opts);
    if (b->seed_holder[r])
      return;
  }
  /* none: back into a region of its own, through the reduced area once
   * sh's state is freed. Should that fail, the master is widened from
   * the 16-bit shard at the first step, as without a seed. */
  shardd__backend *be = reg->backend;
  char why[256];
  if (!b->reduced_live &&
      be->ops->copy(be, b->blocks[r], b->reduced_off, sh->state, sh->master_off,
                    seed_bytes(b)) == SHARDD_OK) {
    shardd__optim_state_free(reg, sh);
    seed_region(reg, b, r, b->blocks[r], b->reduced_off, 0, why, sizeof why);
    reduced_zero(reg, b, r);
    return;
  }
  seed_region(reg, b, r, sh->state, sh->master_off, 0, why, sizeof why);
}

shardd_err shardd__buffer_seed(shardd__registry *reg, shardd__buffer *b,
                               uint32_t rank, char *err, size_t errlen) {
  shardd__job *job = b->hdr.job;
  shardd__backend *be = reg->backend;
  if (b->dtype == SHARDD_DTYPE_FP32) {
    snprintf(err, errlen, "buffer \"%s\" is fp32: its shard is its own master",
             b->hdr.name);
    return SHARDD_E_INVAL;
  }
  if (b->inflight) {
    snprintf(err, errlen, "buffer \"%s\" is in use by a collective or step",
             b->hdr.name);
    return SHARDD_E_BUSY;
  }
  if (rank >= b->world || b->blocks[rank] == NULL) {
    snprintf(err, errlen, "rank %" PRIu32 " has no shard of buffer \"%s\" here",
             rank, b->hdr.name);
    return SHARDD_E_RANGE;
  }
  size_t bytes = seed_bytes(b);
  if (seed_arrays(b) != SHARDD_OK) {
    snprintf(err, errlen, "out of memory");
    return SHARDD_E_NO_MEMORY;
  }
  /* into the master of every optimizer shard over (b, rank) now; a seed
   * of its own only while there is none */
  shardd__optim **opts;
  size_t no;
  int took = 0;
  shardd_err rc = shardd__job_optims(job, &opts, &no);
  if (rc == SHARDD_OK) {
    for (size_t i = 0; i < no && rc == SHARDD_OK; i++)
      for (size_t k = 0; k < opts[i]->nshards && rc == SHARDD_OK; k++) {
        shardd__optim_shard *sh = &opts[i]->shards[k];
        if (sh->buf != b || sh->rank != rank || sh->state == NULL)
          continue;
        rc = be->ops->copy(be, sh->state, sh->master_off, b->blocks[rank],
                           b->reduced_off, bytes);
        if (rc == SHARDD_OK) {
          sh->master_valid = 1;
          if (!took++)
            b->seed_holder[rank] = sh;
        }
      }
    free(opts);
  }
  if (rc == SHARDD_OK && took)
    seed_free(reg, b, rank); /* the masters hold the new values */
  else if (rc == SHARDD_OK && b->seed[rank])
    rc = be->ops->copy(be, b->seed[rank], 0, b->blocks[rank], b->reduced_off,
                       bytes);
  else if (rc == SHARDD_OK) {
    rc = seed_region(reg, b, rank, b->blocks[rank], b->reduced_off, 1, err,
                     errlen);
    if (rc != SHARDD_OK)
      return rc; /* err says why */
  }
  if (rc == SHARDD_OK)
    rc = reduced_zero(reg, b, rank);
  b->reduced_live = 0;
  if (rc != SHARDD_OK)
    snprintf(err, errlen, "seeding the master of buffer \"%s\" rank %" PRIu32
             ": %s", b->hdr.name, rank, shardd_strerror(rc));
  return rc;
}

void shardd__buffer_seed_drop(shardd__registry *reg, shardd__buffer *b) {
  if (b->seed)
    for (uint32_t r = 0; r < b->world; r++)
      seed_free(reg, b, r);
  free(b->seed);
  free(b->seed_holder);
  b->seed = NULL;
  b->seed_holder = NULL;
}
