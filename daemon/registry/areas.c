/* areas.c — transient gather and gradient areas (see registry.h): the
 * per-device pools of a transient job and the leases of their slots.
 *
 * Why fixed slots, as large as the job's largest unit: the daemon knows
 * every unit's size at registration, so one region per device, carved in
 * equal slots, serves every gather and gradient of the job with no
 * allocator call after the first lease (peak bytes at step 1000 are those
 * of step 1) and no fragmentation, which is what FSDP's users fight in the
 * caching allocator (pytorch#65078). The bound stays FSDP's: per rank
 * leases_per_rank units gathered and as many of gradient; on the host
 * backend the gathered ones are the node's, one read-only copy of a unit
 * that every local rank maps (see registry.h for the pool's size). */
#include "registry.h"
#include "registry_int.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define SLOT_ALIGN 4096u

typedef struct {
  shardd__buffer *buf; /* NULL: free */
  uint32_t rank;       /* per-rank pools: the holder */
  int kind;
  uint32_t refs;       /* the shared gather pool: the local ranks holding it */
} slot;

struct shardd__pool {
  shardd__region *region;
  uint64_t id;
  size_t slot_bytes;
  uint32_t nslots, nused;
  slot *slots;
};


static const char *kind_word(int kind) {
  return kind == SHARDD__AREA_GATHER ? "gather" : "gradient";
}

/* Whether the job's gather areas are the node's (one shared, read-only
 * copy of a unit for every local rank): where trainers map host memory. */
static int shared_gather(const shardd__job *job) {
  return (job->reg->backend->caps & SHARDD__BACKEND_CAP_HOST_MAPPED) != 0;
}

/* The ranks below x on dev (shardd__rank_device: rank modulo the devices). */
static uint64_t ranks_below_on(const shardd__registry *reg, uint64_t x,
                               int dev) {
  uint64_t nd = (uint64_t)reg->backend->ndevices;
  return x / nd + (x % nd > (uint64_t)dev ? 1 : 0);
}

/* The job's local ranks on dev, counted, not walked: status and every
 * registration's quota check ask per device, and walking 65536 ranks each
 * time was most of their cost on a wide job. */
static uint32_t dev_ranks(const shardd__job *job, int dev) {
  uint64_t first = job->local_first;
  return (uint32_t)(ranks_below_on(job->reg, first + job->local_ranks, dev) -
                    ranks_below_on(job->reg, first, dev));
}

/* The slots of a pool: dev's gradient pool (and, unshared, gather) pool,
 * or (dev -1) the node's gather pool. */
static uint32_t pool_slots(const shardd__job *job, int dev) {
  const shardd__registry *reg = job->reg;
  uint32_t lg = reg->leases_per_rank[SHARDD__AREA_GATHER];
  if (dev < 0) /* see registry.h: why no more are ever held */
    return lg == 0 ? 0 : job->local_ranks * (lg - 1) + 1;
  return dev_ranks(job, dev) * (reg->leases_per_rank[SHARDD__AREA_GRAD] +
                                (shared_gather(job) ? 0 : lg));
}

/* The pool of dev (-1: the node's gather pool), where it is kept. */
static struct shardd__pool **pool_at(shardd__job *job, int dev) {
  return dev < 0 ? &job->gpool : &job->pools[dev];
}

static const struct shardd__pool *pool_of(const shardd__job *job, int dev) {
  return dev < 0 ? job->gpool : job->pools[dev];
}

/* Where rank's areas of kind are leased: its device's pool, or -1. */
static int pool_dev(const shardd__job *job, uint32_t rank,
                    shardd__area_kind kind) {
  if (kind == SHARDD__AREA_GATHER && shared_gather(job))
    return -1;
  return shardd__rank_device(job->reg, rank);
}

static size_t unit_bytes(const shardd__buffer *b) {
  size_t n = (size_t)b->padded_numel * shardd_dtype_size(b->dtype);
  return (n + SLOT_ALIGN - 1) / SLOT_ALIGN * SLOT_ALIGN;
}

shardd_err shardd__job_set_transient(shardd__job *job, int on, char *err,
                                     size_t errlen) {
  on = on != 0;
  if (job->transient == on)
    return SHARDD_OK;
  if (shardd__map_count(&job->buffers) > 0) {
    snprintf(err, errlen, "job \"%s\" has %s areas; a rank cannot ask for %s "
             "ones once it has buffers",
             job->name, job->transient ? "transient" : "resident",
             on ? "transient" : "resident");
    return SHARDD_E_MISMATCH;
  }
  const shardd__backend *be = job->reg->backend;
  if (on && !(be->caps & SHARDD__BACKEND_CAP_HOST_MAPPED) && be->ops->export_ipc == NULL) {
    /* a trainer maps a pool once: by descriptor (host) or IPC handle (cuda) */
    snprintf(err, errlen, "transient areas need a backend whose pools trainers "
             "can map (the %s backend keeps resident areas)", be->name);
    return SHARDD_E_STATE;
  }
  if (on && job->nodes > 1) {
    snprintf(err, errlen, "job \"%s\" spans %" PRIu32 " nodes; transient areas "
             "are single-node for now", job->name, job->nodes);
    return SHARDD_E_STATE;
  }
  if (on) {
    int nd = job->reg->backend->ndevices;
    job->pools = calloc((size_t)nd, sizeof *job->pools);
    job->nleased = calloc(job->world, sizeof *job->nleased);
    if (job->pools == NULL || job->nleased == NULL) {
      free(job->pools);
      free(job->nleased);
      job->pools = NULL;
      job->nleased = NULL;
      snprintf(err, errlen, "out of memory");
      return SHARDD_E_NO_MEMORY;
    }
  }
  job->transient = on;
  return SHARDD_OK;
}

static void pool_free(shardd__registry *reg, shardd__job *job,
                      struct shardd__pool *p) {
  if (p == NULL)
    return;
  job->bytes -= p->region->bytes;
  shardd__region_uncount(reg, job, p->region);
  reg->backend->ops->free(reg->backend, p->region);
  free(p->slots);
  free(p);
}

void shardd__areas_free(shardd__registry *reg, shardd__job *job) {
  if (job->pools)
    for (int d = 0; d < reg->backend->ndevices; d++)
      pool_free(reg, job, job->pools[d]);
  pool_free(reg, job, job->gpool);
  job->gpool = NULL;
  free(job->pools);
  free(job->nleased);
  job->pools = NULL;
  job->nleased = NULL;
}

typedef struct {
  size_t max;
} max_arg;

static void max_unit(void *value, void *arg) {
  max_arg *a = arg;
  size_t n = unit_bytes(value);
  if (n > a->max)
    a->max = n;
}

static size_t job_max_unit(shardd__job *job);
static uint64_t dev_reserve(const shardd__job *job, int dev, size_t unit);

/* The pool of device dev (-1: the node's gather pool, on the device of the
 * first local rank), sized for every unit registered now. */
static shardd_err pool_make(shardd__registry *reg, shardd__job *job, int dev,
                            size_t need, char *err, size_t errlen) {
  max_arg a = {need};
  shardd__map_each(&job->buffers, max_unit, &a);
  int at = dev < 0 ? shardd__rank_device(reg, job->local_first) : dev;
  struct shardd__pool *p = calloc(1, sizeof *p);
  uint32_t n = pool_slots(job, dev);
  if (p == NULL || (p->slots = calloc(n ? n : 1, sizeof *p->slots)) == NULL) {
    free(p);
    snprintf(err, errlen, "out of memory");
    return SHARDD_E_NO_MEMORY;
  }
  /* Pool ids tell a client's mappings apart, so they are never reused
   * within a uid; counted per uid, they say nothing of other uids' jobs. */
  uint64_t pid = (uint64_t)(uintptr_t)shardd__map_get_id(&reg->pool_ids, job->uid) + 1;
  if (shardd__map_put_id(&reg->pool_ids, job->uid, (void *)(uintptr_t)pid) !=
      SHARDD_OK) {
    free(p->slots);
    free(p);
    snprintf(err, errlen, "out of memory");
    return SHARDD_E_NO_MEMORY;
  }
  p->slot_bytes = a.max;
  p->nslots = n;
  size_t bytes = (size_t)n * a.max;
  /* the registrations reserved it: only what they did not is checked */
  uint64_t reserved = dev_reserve(job, dev, job_max_unit(job));
  if (!shardd__within_quota(reg, job, bytes > reserved ? bytes - reserved : 0,
                            err, errlen)) {
    free(p->slots);
    free(p);
    return SHARDD_E_NO_MEMORY;
  }
  char label[64], why[256];
  if (dev < 0)
    snprintf(label, sizeof label, "shardd:%.40s:gathered", job->name);
  else
    snprintf(label, sizeof label, "shardd:%.40s:pool%d", job->name, dev);
  shardd_err rc = reg->backend->ops->alloc(reg->backend, at, bytes, label,
                                           &p->region, why, sizeof why);
  if (rc != SHARDD_OK) {
    snprintf(err, errlen, "%s of %" PRIu32 " %zu-byte areas on device %d: %s",
             dev < 0 ? "gather pool" : "pool", n, a.max, at, why);
    free(p->slots);
    free(p);
    return rc;
  }
  /* a memfd (the host backend's): it counts against the bounds on memory
   * regions as a rank block does; uncounted, a uid's transient jobs held
   * a pool descriptor each beyond their share */
  if (dev < 0)
    snprintf(why, sizeof why, "the job's node gather pool");
  else
    snprintf(why, sizeof why, "the job's pool of transient areas on device %d", dev);
  if (!shardd__region_count(reg, job, p->region, 1, why, err, errlen)) {
    reg->backend->ops->free(reg->backend, p->region);
    free(p->slots);
    free(p);
    return SHARDD_E_LIMIT;
  }
  p->id = pid;
  job->bytes += p->region->bytes;
  *pool_at(job, dev) = p;
  return SHARDD_OK;
}

static void fill(const shardd__job *job, const struct shardd__pool *p,
                 int32_t i, shardd__area *out) {
  out->pool = p->region;
  out->pool_id = p->id;
  out->off = (size_t)i * p->slot_bytes;
  out->readonly = p == job->gpool;
}

int shardd__area_held(const shardd__buffer *b, uint32_t rank,
                      shardd__area_kind kind, shardd__area *out) {
  if (b->lease == NULL || b->lease[rank][kind] < 0)
    return 0;
  const shardd__job *job = b->hdr.job;
  if (out)
    fill(job, pool_of(job, pool_dev(job, rank, kind)), b->lease[rank][kind],
         out);
  return 1;
}

typedef struct {
  uint32_t rank;
  int kind;
  char *list;
  size_t len, used;
} held_arg;

static void list_held(void *value, void *arg) {
  const shardd__buffer *b = value;
  held_arg *a = arg;
  if (b->lease && b->lease[a->rank][a->kind] >= 0 && a->used < a->len)
    a->used += (size_t)snprintf(a->list + a->used, a->len - a->used, "%s\"%s\"",
                                a->used ? ", " : "", b->hdr.name);
}

/* Whether rank holds as many areas of kind as it may (err says which). */
static int at_limit(const shardd__job *job, uint32_t rank, int kind, char *err,
                    size_t errlen) {
  if (job->nleased[rank][kind] < job->reg->leases_per_rank[kind])
    return 0;
  char list[256] = "";
  held_arg a = {rank, kind, list, sizeof list, 0};
  shardd__map_each(&job->buffers, list_held, &a);
  snprintf(err, errlen,
           "rank %" PRIu32 " holds %" PRIu32 " %s areas (%s), the most one "
           "rank may lease at once; release one first",
           rank, job->nleased[rank][kind], kind_word(kind), list);
  return 1;
}

shardd_err shardd__area_lease(shardd__registry *reg, shardd__buffer *b,
                              uint32_t rank, shardd__area_kind kind,
                              shardd__area *out, int *took, char *err,
                              size_t errlen) {
  shardd__job *job = b->hdr.job;
  *took = 0;
  if (!job->transient) {
    snprintf(err, errlen, "job \"%s\" has resident areas", job->name);
    return SHARDD_E_STATE;
  }
  if (shardd__area_held(b, rank, kind, out))
    return SHARDD_OK;
  if (at_limit(job, rank, kind, err, errlen))
    return SHARDD_E_LIMIT;
  int dev = pool_dev(job, rank, kind);
  struct shardd__pool *p = *pool_at(job, dev);
  /* A new copy for the node: the gather leases it for every local rank,
   * and the pool has room for it only when none of them is at its limit
   * (registry.h); a full pool means one is, so the gather is refused as
   * that rank's, whichever rank leases first. */
  for (uint32_t r = job->local_first;
       dev < 0 && b->gslot < 0 && r < job->local_first + job->local_ranks; r++)
    if (at_limit(job, r, kind, err, errlen))
      return SHARDD_E_LIMIT;
  if (dev < 0 && b->gslot >= 0) {
    /* gathered for another local rank: one more reference to that copy */
    p->slots[b->gslot].refs++;
    b->lease[rank][kind] = b->gslot;
    job->nleased[rank][kind]++;
    fill(job, p, b->gslot, out);
    *took = 1;
    return SHARDD_OK;
  }
  size_t need = unit_bytes(b);
  if (p && p->slot_bytes < need) {
    if (p->nused > 0) {
      snprintf(err, errlen,
               "buffer \"%s\" needs %zu-byte areas, more than the %zu of the "
               "%s, whose areas are leased: register every unit before "
               "training, or release them all first",
               b->hdr.name, need, p->slot_bytes,
               dev < 0 ? "node's gather pool" : "pool of its device");
      return SHARDD_E_BUSY;
    }
    pool_free(reg, job, p); /* remade larger below, under another id */
    *pool_at(job, dev) = p = NULL;
  }
  shardd_err rc;
  if (p == NULL && (rc = pool_make(reg, job, dev, need, err, errlen)) != SHARDD_OK)
    return rc;
  p = *pool_at(job, dev);
  int32_t i = 0;
  while ((uint32_t)i < p->nslots && p->slots[i].buf != NULL)
    i++;
  if ((uint32_t)i == p->nslots) { /* the per-rank limits make this unreachable */
    snprintf(err, errlen, "the %s is full",
             dev < 0 ? "node's gather pool" : "pool of its device");
    return SHARDD_E_INTERNAL;
  }
  p->slots[i] = (slot){b, rank, kind, 1};
  p->nused++;
  if (dev < 0)
    b->gslot = i;
  b->lease[rank][kind] = i;
  job->nleased[rank][kind]++;
  fill(job, p, i, out);
  *took = 1;
  if (kind == SHARDD__AREA_GRAD) { /* a gradient starts at zero, as torch's */
    shardd_err zrc = shardd__region_zero(reg->backend, out->pool, out->off, need);
    if (zrc != SHARDD_OK) {
      snprintf(err, errlen, "zeroing a gradient area on device %d: %s", dev,
               shardd_strerror(zrc));
      return zrc;
    }
  }
  return SHARDD_OK;
}

void shardd__area_return(shardd__buffer *b, uint32_t rank,
                         shardd__area_kind kind) {
  if (b->lease == NULL || b->lease[rank][kind] < 0)
    return;
  shardd__job *job = b->hdr.job;
  int dev = pool_dev(job, rank, kind);
  struct shardd__pool *p = *pool_at(job, dev);
  slot *s = &p->slots[b->lease[rank][kind]];
  b->lease[rank][kind] = -1;
  job->nleased[rank][kind]--;
  if (--s->refs > 0) /* other local ranks still read the copy */
    return;
  s->buf = NULL;
  p->nused--;
  if (dev < 0)
    b->gslot = -1;
}

typedef struct {
  uint32_t rank;
} rank_arg;

/* Queued collectives (b->inflight counts them too) lease when they start,
 * so only a running one keeps a departed rank's areas booked. */
static void return_rank(void *value, void *arg) {
  shardd__buffer *b = value;
  const rank_arg *a = arg;
  if (b->lease == NULL)
    return;
  if (b->areas_busy > 0) {
    b->lease_left[a->rank] = 1;
    return;
  }
  shardd__area_return(b, a->rank, SHARDD__AREA_GATHER);
  shardd__area_return(b, a->rank, SHARDD__AREA_GRAD);
}

void shardd__areas_busy(shardd__buffer *b) { b->areas_busy++; }

void shardd__areas_idle(shardd__buffer *b) {
  if (--b->areas_busy > 0 || b->lease == NULL)
    return;
  for (uint32_t r = 0; r < b->world; r++)
    if (b->lease_left[r]) {
      b->lease_left[r] = 0;
      shardd__area_return(b, r, SHARDD__AREA_GATHER);
      shardd__area_return(b, r, SHARDD__AREA_GRAD);
    }
}

void shardd__area_return_rank(shardd__job *job, uint32_t rank) {
  if (!job->transient)
    return;
  rank_arg a = {rank};
  shardd__map_each(&job->buffers, return_rank, &a);
}

uint64_t shardd__job_pool_bytes(const shardd__job *job) {
  uint64_t n = job->gpool ? job->gpool->region->bytes : 0;
  if (job->pools)
    for (int d = 0; d < job->reg->backend->ndevices; d++)
      if (job->pools[d])
        n += job->pools[d]->region->bytes;
  return n;
}

void shardd__job_gather_usage(const shardd__job *job, shardd__gather_usage *out) {
  memset(out, 0, sizeof *out);
  out->shared = (uint32_t)shared_gather(job);
  if (job->gpool) {
    out->pool_bytes = job->gpool->region->bytes;
    out->held = job->gpool->nused;
    out->held_bytes = (uint64_t)job->gpool->nused * job->gpool->slot_bytes;
  }
  if (job->pools == NULL || out->shared)
    return;
  const shardd__registry *reg = job->reg;
  for (int d = 0; d < reg->backend->ndevices; d++) {
    const struct shardd__pool *p = job->pools[d];
    if (p == NULL || p->nslots == 0)
      continue;
    /* per rank leases_per_rank[GATHER] of the pool's slots */
    uint32_t per = reg->leases_per_rank[0] + reg->leases_per_rank[1];
    out->pool_bytes += (uint64_t)p->nslots / per * reg->leases_per_rank[0] *
                       p->slot_bytes;
    for (uint32_t i = 0; i < p->nslots; i++)
      if (p->slots[i].buf && p->slots[i].kind == SHARDD__AREA_GATHER) {
        out->held++;
        out->held_bytes += p->slot_bytes;
      }
  }
}

/* The job's largest unit's slot bytes, recomputed after the largest was
 * unregistered. */
static size_t job_max_unit(shardd__job *job) {
  if (job->max_unit_stale) {
    max_arg a = {0};
    shardd__map_each(&job->buffers, max_unit, &a);
    job->max_unit = a.max;
    job->max_unit_stale = 0;
  }
  return job->max_unit;
}

/* What dev's pool (-1: the node's gather pool) takes once sized for units
 * of unit bytes, beyond what it holds (a smaller pool is freed before it
 * is made anew). */
static uint64_t dev_reserve(const shardd__job *job, int dev, size_t unit) {
  uint64_t want = (uint64_t)pool_slots(job, dev) * unit;
  const struct shardd__pool *p = pool_of(job, dev);
  if (p == NULL)
    return want; /* made at the next lease */
  if (p->slot_bytes >= unit)
    return 0;
  /* made anew at the next lease, once the smaller one is freed */
  return want > p->region->bytes ? want - p->region->bytes : 0;
}

uint64_t shardd__areas_reserve(shardd__job *job, const shardd__buffer *b) {
  if (!job->transient || job->pools == NULL)
    return 0;
  size_t unit = job_max_unit(job);
  if (b && unit_bytes(b) > unit)
    unit = unit_bytes(b);
  if (unit == 0)
    return 0;
  /* dev_reserve over the devices, each device's ranks counted (quotas sum
   * it over every job of a uid at each registration) */
  const shardd__registry *reg = job->reg;
  uint64_t per_rank = (uint64_t)(reg->leases_per_rank[SHARDD__AREA_GRAD] +
                                 (shared_gather(job)
                                      ? 0 : reg->leases_per_rank[SHARDD__AREA_GATHER])) *
                      unit;
  uint64_t n = 0;
  for (int d = 0; d < reg->backend->ndevices; d++) {
    const struct shardd__pool *p = job->pools[d];
    if (p == NULL || p->slot_bytes < unit)
      n += dev_ranks(job, d) * per_rank;
  }
  for (int d = 0; d < reg->backend->ndevices; d++) {
    const struct shardd__pool *p = job->pools[d];
    if (p && p->slot_bytes < unit) /* made anew once this one is freed */
      n -= p->region->bytes < n ? p->region->bytes : n;
  }
  if (shared_gather(job))
    n += dev_reserve(job, -1, unit);
  return n;
}

void shardd__areas_unit_added(shardd__buffer *b) {
  shardd__job *job = b->hdr.job;
  if (job->transient && !job->max_unit_stale && unit_bytes(b) > job->max_unit)
    job->max_unit = unit_bytes(b);
}

void shardd__areas_unit_removed(shardd__buffer *b) {
  shardd__job *job = b->hdr.job;
  if (job->transient && !job->releasing && unit_bytes(b) >= job->max_unit)
    job->max_unit_stale = 1;
}

/* A transient buffer's lease table, every slot free (buffer.c). */
shardd_err shardd__areas_buffer_init(shardd__buffer *b) {
  b->lease = malloc(b->world * sizeof *b->lease);
  b->lease_left = calloc(b->world, 1);
  if (b->lease == NULL || b->lease_left == NULL) {
    free(b->lease);
    free(b->lease_left);
    b->lease = NULL;
    b->lease_left = NULL;
    return SHARDD_E_NO_MEMORY;
  }
  for (uint32_t r = 0; r < b->world; r++)
    b->lease[r][0] = b->lease[r][1] = -1;
  b->gslot = -1;
  return SHARDD_OK;
}

/* Returns every lease of b and frees its table (buffer.c, at destroy). */
void shardd__areas_buffer_fini(shardd__buffer *b) {
  if (b->lease == NULL)
    return;
  for (uint32_t r = 0; r < b->world; r++) {
    shardd__area_return(b, r, SHARDD__AREA_GATHER);
    shardd__area_return(b, r, SHARDD__AREA_GRAD);
  }
  free(b->lease);
  free(b->lease_left);
  b->lease = NULL;
  b->lease_left = NULL;
}
