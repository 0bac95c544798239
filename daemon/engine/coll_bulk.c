/* coll_bulk.c — whole collectives through the backend's communicator.
 *
 * A backend with whole-collective ops (cuda: NCCL, see backend.h) runs a
 * single-node gather or scatter as one task instead of per-rank chunks:
 * the job's communicator is created by the first such task (blocking, on
 * the pool, never on the loop) and destroyed with the job's queue state
 * (shardd__coll_job_free, called before every job release); the task runs
 * the NCCL group and waits for its streams on its worker thread, like every
 * other backend op, and completes through after_work as usual. It is used
 * when every rank has its own device (world <= devices) and, for scatter,
 * the buffer has no frozen ranges (those keep their reduced elements
 * untouched, which a whole reduce-scatter would not). When the communicator
 * cannot be made or an op fails, the task does that collective rank by rank
 * instead (the inputs are intact: outputs are other areas) and the job
 * keeps the per-rank path from then on. */
#include "coll_int.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>

#include "log.h"

/* ---- whole collectives through the backend (see the top) ----------- */

/* Whether c runs as one bulk task; loop thread, when planning. */
int shardd__coll_bulk_ok(const coll *c) {
  const shardd__backend *be = c->e->be;
  const shardd__buffer *b = c->buf;
  if (b == NULL || shardd__coll_multi(c) || c->job->transient || c->adding ||
      be->ops->comm_create == NULL ||
      b->world != c->job->world || b->world < 2 ||
      b->world > (uint32_t)be->ndevices)
    return 0; /* world <= ndevices: rank r alone on device r */
  if (c->args.kind == SHARDD__COLL_GATHER ? be->ops->allgather == NULL
                                          : be->ops->reduce_scatter == NULL ||
                                                b->nfrozen != 0)
    return 0;
  coll_job *q = c->cj;
  return atomic_load(&q->bulk_state) != BULK_FAILED;
}

/* The job's communicator, created at its first bulk task; NULL (and err
 * set) when it cannot be or an op failed on it before. */
static void *bulk_comm(coll *c, char *err, size_t errlen) {
  shardd__backend *be = c->e->be;
  coll_job *q = c->cj;
  uint32_t w = c->buf->world;
  void *comm = NULL;
  pthread_mutex_lock(&q->bulk_mu);
  if (atomic_load(&q->bulk_state) == BULK_NONE) {
    int *devs = malloc(w * sizeof *devs);
    shardd_err rc = SHARDD_E_NO_MEMORY;
    snprintf(err, errlen, "out of memory");
    if (devs) {
      for (uint32_t r = 0; r < w; r++)
        devs[r] = shardd__rank_device(c->e->cfg.reg, r);
      rc = be->ops->comm_create(be, devs, (int)w, &q->bulk_comm, err, errlen);
      free(devs);
    }
    atomic_store(&q->bulk_state, rc == SHARDD_OK ? BULK_UP : BULK_FAILED);
    if (rc == SHARDD_OK)
      shardd__log(2, "job \"%s\": %s communicator over %" PRIu32
                  " devices", c->job->name, be->name, w);
  } else if (atomic_load(&q->bulk_state) == BULK_FAILED) {
    snprintf(err, errlen, "communicator failed before");
  }
  if (atomic_load(&q->bulk_state) == BULK_UP)
    comm = q->bulk_comm;
  pthread_mutex_unlock(&q->bulk_mu);
  return comm;
}

void shardd__coll_bulk_task(coll *c, task *t) {
  shardd__backend *be = c->e->be;
  shardd__buffer *b = c->buf;
  coll_job *q = c->cj;
  char err[384];
  err[0] = '\0';
  void *comm = bulk_comm(c, err, sizeof err);
  if (comm) {
    if (c->args.kind == SHARDD__COLL_GATHER) {
      t->rc = be->ops->allgather(be, comm, b->blocks, b->shard_off, b->blocks,
                                 b->gather_off,
                                 b->shard_numel * shardd_dtype_size(b->dtype),
                                 err, sizeof err);
    } else {
      float div = c->args.op == SHARDD_REDUCE_MEAN ? (float)b->world : 1.0f;
      t->rc = be->ops->reduce_scatter(be, comm, b->dtype, div, b->blocks,
                                      b->grad_off, b->blocks, b->reduced_off,
                                      b->shard_numel, err, sizeof err);
    }
    if (t->rc == SHARDD_OK)
      return;
    /* the communicator is freed with the job, not here: another task may
     * hold it */
    atomic_store(&q->bulk_state, BULK_FAILED);
  }
  shardd__log(1, "job \"%s\": %s of buffer %" PRIu64 " without the "
              "%s communicator (%s); copying rank by rank from now on",
              c->job->name, shardd__coll_kind_word(c->args.kind), c->args.target, be->name,
              err);
  /* the same work as the per-rank tasks, one unit after the other */
  t->rc = SHARDD_OK;
  for (uint32_t r = 0; r < b->world && t->rc == SHARDD_OK; r++) {
    task u = *t;
    u.a = r;
    u.b = 0;
    u.start = 0;
    u.len = c->args.kind == SHARDD__COLL_GATHER ? b->padded_numel
                                                : b->shard_numel;
    if (c->args.kind == SHARDD__COLL_GATHER)
      shardd__coll_gather_unit(c, &u);
    else
      shardd__coll_scatter_unit(c, &u);
    t->rc = u.rc;
  }
}

void shardd__coll_bulk_free(coll_job *cj) {
  /* no collective runs (the caller checked inflight), so no task holds the
   * communicator */
  shardd__backend *be = cj->e->be;
  if (cj->bulk_comm && be->ops->comm_destroy)
    be->ops->comm_destroy(be, cj->bulk_comm);
  cj->bulk_comm = NULL;
  pthread_mutex_destroy(&cj->bulk_mu);
}
