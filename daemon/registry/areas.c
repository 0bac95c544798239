/* areas.c — transient gather and gradient areas (see registry.h): the
 * per-device pools of a transient job and the leases of their slots.
 *
 * Why slots, and no allocator call after warm-up: the daemon knows every
 * unit's size at registration, so a pool of a bounded count of slots
 * serves every gather and gradient of the job (peak bytes at step 1000 are
 * those of step 1), which is what FSDP's users fight in the caching
 * allocator (pytorch#65078). The count is FSDP's bound: per rank
 * leases_per_rank units gathered and as many of gradient; on the host
 * backend the gathered ones are the node's, one read-only copy of a unit
 * that every local rank maps (see registry.h for the pool's count).
 *
 * Where trainers map host memory, each slot is a region of its own,
 * sized to the unit it holds (FSDP2's all-gather output is sized to its
 * group, not to the largest one) and made at the first lease that needs
 * it: a lease takes the smallest free slot that holds its unit (best fit,
 * as a caching allocator reuses blocks), else grows the largest free one
 * (made anew at its unit's size), else makes one. So the slots made are
 * as many as the units held at once, each as large as the largest unit it
 * held: a loop holding the root unit and one other at a time makes two,
 * not the count's worst case of the largest unit each, which the job
 * still reserves against its memory limits. Slots only grow, so they
 * settle in the first step.
 * Elsewhere (cuda: a trainer opens one IPC handle per pool) a pool is one
 * region carved in equal slots as large as the job's largest unit. */
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
  /* a pool of slots of their own: this slot's region (NULL: not made
   * yet) and its pool id, which trainers map it by */
  shardd__region *region;
  uint64_t id;
} slot;

struct shardd__pool {
  /* one region carved in nslots equal slots of slot_bytes; NULL: a
   * region per slot (slot.region) */
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

/* Whether the job's pools are made a slot at a time, each slot a region
 * of its own sized to its unit: where trainers map each region by its
 * descriptor (a cuda trainer opens one IPC handle per pool, so its pools
 * stay one region of equal slots). */
static int slot_regions(const shardd__job *job) {
  return shared_gather(job);
}

static void region_drop(shardd__registry *reg, shardd__job *job,
                        shardd__region *r) {
  job->bytes -= r->bytes;
  shardd__region_uncount(reg, job, r);
  reg->backend->ops->free(reg->backend, r);
}

static void pool_free(shardd__registry *reg, shardd__job *job,
                      struct shardd__pool *p) {
  if (p == NULL)
    return;
  if (p->region)
    region_drop(reg, job, p->region);
  for (uint32_t i = 0; p->region == NULL && i < p->nslots; i++)
    if (p->slots[i].region)
      region_drop(reg, job, p->slots[i].region);
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

/* A region of bytes for dev's pool (-1: the node's gather pool, on the
 * device of the first local rank) and its new pool id, counted in the
 * job's bytes and regions; reserved: what the registrations reserved of
 * it, so only the rest is checked against the memory limits. */
static shardd_err region_make(shardd__registry *reg, shardd__job *job, int dev,
                              size_t bytes, uint64_t reserved,
                              shardd__region **out, uint64_t *id, char *err,
                              size_t errlen) {
  if (!shardd__within_quota(reg, job, bytes > reserved ? bytes - reserved : 0,
                            err, errlen))
    return SHARDD_E_NO_MEMORY;
  /* Pool ids tell a client's mappings apart, so they are never reused
   * within a uid; counted per uid, they say nothing of other uids' jobs. */
  uint64_t pid = (uint64_t)(uintptr_t)shardd__map_get_id(&reg->pool_ids, job->uid) + 1;
  if (shardd__map_put_id(&reg->pool_ids, job->uid, (void *)(uintptr_t)pid) !=
      SHARDD_OK) {
    snprintf(err, errlen, "out of memory");
    return SHARDD_E_NO_MEMORY;
  }
  int at = dev < 0 ? shardd__rank_device(reg, job->local_first) : dev;
  char label[64], why[256];
  if (dev < 0)
    snprintf(label, sizeof label, "shardd:%.40s:gathered", job->name);
  else
    snprintf(label, sizeof label, "shardd:%.40s:pool%d", job->name, dev);
  shardd_err rc = reg->backend->ops->alloc(reg->backend, at, bytes, label, out,
                                           why, sizeof why);
  if (rc != SHARDD_OK) {
    snprintf(err, errlen, "%s of %zu bytes on device %d: %s",
             dev < 0 ? "gather pool" : "pool", bytes, at, why);
    return rc;
  }
  /* a memfd (the host backend's): it counts against the bounds on memory
   * regions as a rank block does; uncounted, a uid's transient jobs held
   * a pool descriptor each beyond their share */
  if (dev < 0)
    snprintf(why, sizeof why, "the job's node gather pool");
  else
    snprintf(why, sizeof why, "the job's pool of transient areas on device %d", dev);
  if (!shardd__region_count(reg, job, *out, 1, why, err, errlen)) {
    reg->backend->ops->free(reg->backend, *out);
    *out = NULL;
    return SHARDD_E_LIMIT;
  }
  *id = pid;
  job->bytes += (*out)->bytes;
  return SHARDD_OK;
}

/* The pool of device dev (-1: the node's gather pool): its slots, and
 * where they are not regions of their own, its one region sized for
 * every unit registered now (need: the leasing unit's bytes). */
static shardd_err pool_make(shardd__registry *reg, shardd__job *job, int dev,
                            size_t need, char *err, size_t errlen) {
  max_arg a = {need};
  shardd__map_each(&job->buffers, max_unit, &a);
  struct shardd__pool *p = calloc(1, sizeof *p);
  uint32_t n = pool_slots(job, dev);
  if (p == NULL || (p->slots = calloc(n ? n : 1, sizeof *p->slots)) == NULL) {
    free(p);
    snprintf(err, errlen, "out of memory");
    return SHARDD_E_NO_MEMORY;
  }
  p->nslots = n;
  if (!slot_regions(job)) {
    p->slot_bytes = a.max;
    /* the registrations reserved it: only what they did not is checked */
    shardd_err rc = region_make(reg, job, dev, (size_t)n * a.max,
                                dev_reserve(job, dev, job_max_unit(job)),
                                &p->region, &p->id, err, errlen);
    if (rc != SHARDD_OK) {
      free(p->slots);
      free(p);
      return rc;
    }
  }
  *pool_at(job, dev) = p;
  return SHARDD_OK;
}

/* A free slot of p for a unit of need bytes: the smallest made one that
 * holds it, else the largest free one made anew at need bytes, else one
 * made (see the top of the file); *at its index. */
static shardd_err slot_take(shardd__registry *reg, shardd__job *job, int dev,
                            struct shardd__pool *p, size_t need, int32_t *at,
                            char *err, size_t errlen) {
  int32_t fit = -1, unmade = -1, largest = -1;
  for (uint32_t i = 0; i < p->nslots; i++) {
    const slot *s = &p->slots[i];
    if (s->buf != NULL)
      continue;
    if (p->region != NULL || (s->region && s->region->bytes >= need)) {
      if (fit < 0 || (p->region == NULL && s->region->bytes <
                                               p->slots[fit].region->bytes))
        fit = (int32_t)i;
    } else if (s->region == NULL) {
      if (unmade < 0)
        unmade = (int32_t)i;
    } else if (largest < 0 || s->region->bytes > p->slots[largest].region->bytes) {
      largest = (int32_t)i;
    }
  }
  /* growing a free slot before making another keeps the slots made as
   * few as the units held at once */
  *at = fit >= 0 ? fit : largest >= 0 ? largest : unmade;
  if (*at < 0) { /* the per-rank limits make this unreachable */
    snprintf(err, errlen, "the %s is full",
             dev < 0 ? "node's gather pool" : "pool of its device");
    return SHARDD_E_INTERNAL;
  }
  slot *s = &p->slots[*at];
  if (fit >= 0)
    return SHARDD_OK;
  if (s->region) { /* too small: made anew, larger (slots only grow) */
    region_drop(reg, job, s->region);
    s->region = NULL;
  }
  return region_make(reg, job, dev, need, dev_reserve(job, dev, job_max_unit(job)),
                     &s->region, &s->id, err, errlen);
}

static void fill(const shardd__job *job, const struct shardd__pool *p,
                 int32_t i, shardd__area *out) {
  out->pool = p->region ? p->region : p->slots[i].region;
  out->pool_id = p->region ? p->id : p->slots[i].id;
  out->off = p->region ? (size_t)i * p->slot_bytes : 0;
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

/* dev's pool (-1: the node's gather pool), made if need be, with room for
 * a unit of need bytes: a pool of equal slots too small is made anew,
 * larger, when nothing of it is leased. */
static shardd_err pool_ready(shardd__registry *reg, shardd__job *job,
                             const shardd__buffer *b, int dev, size_t need,
                             char *err, size_t errlen) {
  struct shardd__pool *p = *pool_at(job, dev);
  if (p && p->region && p->slot_bytes < need) {
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
  return p ? SHARDD_OK : pool_make(reg, job, dev, need, err, errlen);
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
  int32_t i;
  shardd_err rc = pool_ready(reg, job, b, dev, need, err, errlen);
  if (rc != SHARDD_OK ||
      (rc = slot_take(reg, job, dev, p = *pool_at(job, dev), need, &i, err,
                      errlen)) != SHARDD_OK)
    return rc;
  shardd__region *r = p->slots[i].region;
  uint64_t id = p->slots[i].id;
  p->slots[i] = (slot){b, rank, kind, 1, r, id};
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

/* The bytes of p's region, or of the slots made. */
static uint64_t pool_bytes(const struct shardd__pool *p) {
  if (p == NULL)
    return 0;
  if (p->region)
    return p->region->bytes;
  uint64_t n = 0;
  for (uint32_t i = 0; i < p->nslots; i++)
    n += p->slots[i].region ? p->slots[i].region->bytes : 0;
  return n;
}

/* The bytes of p's slot i. */
static uint64_t slot_size(const struct shardd__pool *p, uint32_t i) {
  return p->region ? p->slot_bytes : p->slots[i].region->bytes;
}

uint64_t shardd__job_pool_bytes(const shardd__job *job) {
  uint64_t n = pool_bytes(job->gpool);
  if (job->pools)
    for (int d = 0; d < job->reg->backend->ndevices; d++)
      n += pool_bytes(job->pools[d]);
  return n;
}

void shardd__job_gather_usage(const shardd__job *job, shardd__gather_usage *out) {
  memset(out, 0, sizeof *out);
  out->shared = (uint32_t)shared_gather(job);
  const struct shardd__pool *g = job->gpool;
  if (g) {
    out->pool_bytes = pool_bytes(g);
    out->held = g->nused;
    for (uint32_t i = 0; i < g->nslots; i++)
      if (g->slots[i].buf)
        out->held_bytes += slot_size(g, i);
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

/* What dev's pool (-1: the node's gather pool) may take beyond what it
 * holds, once its slots are all made, each of unit bytes at most (a pool
 * of equal slots too small is freed before it is made anew). */
static uint64_t dev_reserve(const shardd__job *job, int dev, size_t unit) {
  uint64_t want = (uint64_t)pool_slots(job, dev) * unit;
  const struct shardd__pool *p = pool_of(job, dev);
  if (p == NULL)
    return want; /* made at the next lease */
  if (p->region && p->slot_bytes >= unit)
    return 0;
  /* slots not made yet, or made smaller; an equal-slot pool made anew at
   * the next lease, once the smaller one is freed */
  uint64_t have = pool_bytes(p);
  return want > have ? want - have : 0;
}

uint64_t shardd__areas_reserve(shardd__job *job, const shardd__buffer *b) {
  if (!job->transient || job->pools == NULL)
    return 0;
  size_t unit = job_max_unit(job);
  if (b && unit_bytes(b) > unit)
    unit = unit_bytes(b);
  if (unit == 0)
    return 0;
  /* over the devices, each device's ranks counted (quotas sum it over
   * every job of a uid at each registration) */
  uint64_t n = 0;
  for (int d = 0; d < job->reg->backend->ndevices; d++)
    n += dev_reserve(job, d, unit);
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
