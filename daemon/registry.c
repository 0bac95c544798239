/* registry.c — jobs, flat buffers, views and optimizers, and the backend
 * memory behind them. */
#include "registry.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define NAME_MAX_LEN 255
#define MAX_NDIM 16
#define MAX_NUMEL ((uint64_t)1 << 40)
#define AREA_ALIGN 4096u

static size_t align_up(size_t n, size_t a) { return (n + a - 1) / a * a; }

/* Where one streamed area ends and the next begins. Large shards have
 * power-of-two sizes, which put param, grad and state at addresses equal in
 * their low bits: the update's streams then fight over the same cache sets
 * (measured 3.9 GB/s instead of 28 for 64M-element AdamW). An odd number of
 * pages between large areas breaks that; small areas stay packed. */
static size_t area_end(size_t start, size_t bytes) {
  size_t gap = bytes >= ((size_t)1 << 20) ? 19 * (size_t)AREA_ALIGN : 0;
  return align_up(start + bytes, AREA_ALIGN) + gap;
}

void shardd__registry_init(shardd__registry *reg, shardd__backend *backend) {
  memset(reg, 0, sizeof *reg);
  reg->backend = backend;
  reg->next_id = 1;
  shardd__map_init(&reg->objects);
  shardd__map_init(&reg->jobs);
}

static void collect_job_cb(void *value, void *arg) {
  shardd__job ***cursor = arg;
  *(*cursor)++ = value;
}

void shardd__registry_free(shardd__registry *reg) {
  size_t n = shardd__map_count(&reg->jobs);
  shardd__job **jobs = malloc((n ? n : 1) * sizeof *jobs);
  if (jobs) {
    /* Collected first: releasing a job edits the map being walked. */
    shardd__job **cursor = jobs;
    shardd__map_each(&reg->jobs, collect_job_cb, &cursor);
    for (size_t i = 0; i < n; i++)
      shardd__job_release(reg, jobs[i]);
    free(jobs);
  }
  shardd__map_free(&reg->objects);
  shardd__map_free(&reg->jobs);
}

static int name_ok(const char *name, const char *what, char *err,
                   size_t errlen) {
  if (name == NULL || name[0] == '\0') {
    snprintf(err, errlen, "%s name is empty", what);
    return 0;
  }
  if (strlen(name) > NAME_MAX_LEN) {
    snprintf(err, errlen, "%s name is longer than %d bytes", what,
             NAME_MAX_LEN);
    return 0;
  }
  return 1;
}

shardd__job *shardd__job_find(shardd__registry *reg, const char *name) {
  return name ? shardd__map_get_str(&reg->jobs, name) : NULL;
}

typedef struct {
  uint32_t uid;
  size_t n;
} uid_jobs;

static void count_uid_jobs(shardd__job *job, void *arg) {
  uid_jobs *a = arg;
  a->n += job->uid == a->uid;
}

shardd_err shardd__job_get(shardd__registry *reg, const char *name,
                           uint32_t world, uint32_t uid, shardd__job **out,
                           char *err, size_t errlen) {
  *out = NULL;
  if (!name_ok(name, "job", err, errlen))
    return SHARDD_E_INVAL;
  if (world < 1 || world > 65536) {
    snprintf(err, errlen, "world %" PRIu32 " is out of range [1, 65536]",
             world);
    return SHARDD_E_RANGE;
  }
  shardd__job *job = shardd__map_get_str(&reg->jobs, name);
  if (job) {
    if (job->world != world) {
      snprintf(err, errlen,
               "job \"%s\" has world %" PRIu32 ", not %" PRIu32, name,
               job->world, world);
      return SHARDD_E_MISMATCH;
    }
    *out = job;
    return SHARDD_OK;
  }
  /* Every new name lingers after its clients: without a cap a client that
   * reconnects under fresh names grows the daemon without bound. */
  if (reg->max_jobs && shardd__map_count(&reg->jobs) >= reg->max_jobs) {
    snprintf(err, errlen, "the daemon holds %zu jobs, its limit (--max-jobs)",
             shardd__map_count(&reg->jobs));
    return SHARDD_E_LIMIT;
  }
  if (uid != 0 && reg->max_jobs_per_uid) {
    uid_jobs a = {uid, 0};
    shardd__registry_each_job(reg, count_uid_jobs, &a);
    if (a.n >= reg->max_jobs_per_uid) {
      snprintf(err, errlen, "uid %" PRIu32 " holds %zu jobs, the most one user "
               "may (--max-jobs-per-uid)", uid, a.n);
      return SHARDD_E_LIMIT;
    }
  }
  job = calloc(1, sizeof *job);
  if (job == NULL || (job->name = strdup(name)) == NULL ||
      (job->rank_sessions = calloc(world, sizeof(void *))) == NULL)
    goto nomem;
  job->world = world;
  job->nodes = 1;
  job->local_ranks = world;
  job->uid = uid;
  job->reg = reg;
  job->empty_since = -1;
  shardd__map_init(&job->buffers);
  shardd__map_init(&job->optims);
  shardd__map_init(&job->gens);
  shardd__map_init(&job->freed);
  if (shardd__map_put_str(&reg->jobs, name, job) != SHARDD_OK)
    goto nomem;
  *out = job;
  return SHARDD_OK;

nomem:
  if (job) {
    free(job->name);
    free(job->rank_sessions);
    free(job);
  }
  snprintf(err, errlen, "out of memory creating job");
  return SHARDD_E_NO_MEMORY;
}

shardd_err shardd__job_set_layout(shardd__job *job, uint32_t nodes,
                                  uint32_t node_rank, char *err,
                                  size_t errlen) {
  if (nodes < 1 || node_rank >= nodes || job->world % nodes != 0) {
    snprintf(err, errlen,
             "job \"%s\": world %" PRIu32 " over %" PRIu32
             " nodes (this one %" PRIu32 ") is not an even split",
             job->name, job->world, nodes, node_rank);
    return SHARDD_E_RANGE;
  }
  if (shardd__map_count(&job->buffers) > 0) {
    snprintf(err, errlen, "job \"%s\" has buffers; its layout is fixed",
             job->name);
    return SHARDD_E_STATE;
  }
  job->nodes = nodes;
  job->node_rank = node_rank;
  job->local_ranks = job->world / nodes;
  job->local_first = node_rank * job->local_ranks;
  return SHARDD_OK;
}

shardd__obj *shardd__registry_get(const shardd__registry *reg, uint64_t id) {
  return shardd__map_get_id(&reg->objects, id);
}

int shardd__registry_issued(const shardd__registry *reg, uint64_t id) {
  return id > 0 && id < reg->next_id;
}

static const char *kind_name(shardd__obj_kind kind) {
  switch (kind) {
  case SHARDD__OBJ_BUFFER:
    return "buffer";
  case SHARDD__OBJ_VIEW:
    return "view";
  case SHARDD__OBJ_OPTIM:
    return "optimizer";
  }
  return "object";
}

shardd_err shardd__registry_resolve(const shardd__registry *reg,
                                    const shardd__job *job, uint64_t id,
                                    shardd__obj_kind kind, shardd__obj **out,
                                    char *err, size_t errlen) {
  *out = NULL;
  shardd__obj *o = shardd__registry_get(reg, id);
  if (o == NULL) {
    if (shardd__registry_stale(reg, job, id, 0, err, errlen))
      return SHARDD_E_STALE;
    if (shardd__registry_issued(reg, id))
      snprintf(err, errlen, "%s %" PRIu64 " no longer exists (unregistered)",
               kind_name(kind), id);
    else
      snprintf(err, errlen, "no %s has id %" PRIu64, kind_name(kind), id);
    return SHARDD_E_NOT_FOUND;
  }
  if (o->job != job) {
    snprintf(err, errlen, "%s %" PRIu64 " is not owned by job \"%s\"",
             kind_name(o->kind), id, job ? job->name : "");
    return SHARDD_E_NOT_OWNED;
  }
  if (o->kind != kind) {
    snprintf(err, errlen, "id %" PRIu64 " (\"%s\") is a %s, not a %s", id,
             o->name, kind_name(o->kind), kind_name(kind));
    return SHARDD_E_INVAL;
  }
  *out = o;
  return SHARDD_OK;
}

shardd_err shardd__registry_resolve_gen(const shardd__registry *reg,
                                        const shardd__job *job, uint64_t id,
                                        uint64_t generation,
                                        shardd__obj_kind kind,
                                        shardd__obj **out, char *err,
                                        size_t errlen) {
  *out = NULL;
  if (generation != 0 && shardd__registry_stale(reg, job, id, generation, err, errlen))
    return SHARDD_E_STALE;
  return shardd__registry_resolve(reg, job, id, kind, out, err, errlen);
}

/* ---- generations and freed handles ------------------------------------ */

/* The gens key of a buffer name (view_name NULL) or of a view of it;
 * caller frees. The length prefix keeps ("a", "bc") and ("ab", "c") apart. */
static char *gen_key(const char *buf_name, const char *view_name) {
  size_t n = strlen(buf_name) + (view_name ? strlen(view_name) : 0) + 32;
  char *k = malloc(n);
  if (k == NULL)
    return NULL;
  if (view_name)
    snprintf(k, n, "v%zu:%s%s", strlen(buf_name), buf_name, view_name);
  else
    snprintf(k, n, "b:%s", buf_name);
  return k;
}

static uint64_t gen_get(const shardd__job *job, const char *key) {
  return (uint64_t)(uintptr_t)shardd__map_get_str(&job->gens, key);
}

static shardd_err gen_put(shardd__job *job, const char *key, uint64_t g) {
  if (g == 0) {
    shardd__map_del_str(&job->gens, key);
    return SHARDD_OK;
  }
  return shardd__map_put_str(&job->gens, key, (void *)(uintptr_t)g);
}

void shardd__obj_set_generation(shardd__obj *o, uint64_t generation) {
  shardd__job *job = o->job;
  const char *bname = o->kind == SHARDD__OBJ_VIEW
                          ? ((shardd__view *)o)->buf->hdr.name
                          : o->name;
  char *key = gen_key(bname, o->kind == SHARDD__OBJ_VIEW ? o->name : NULL);
  o->generation = generation;
  if (key && gen_get(job, key) < generation)
    gen_put(job, key, generation); /* replaces: the key exists already */
  free(key);
}

static void freed_clear(shardd__freed *f) {
  free(f->key);
  free(f->name);
  free(f->buf_name);
  memset(f, 0, sizeof *f);
}

/* Remembers that o is freed (best effort: out of memory forgets it, and
 * the id then reads as plainly unregistered). */
static void record_freed(shardd__obj *o, const char *buf_name) {
  shardd__job *job = o->job;
  if (job == NULL || job->releasing || o->kind == SHARDD__OBJ_OPTIM)
    return;
  if (job->freed_ring == NULL) {
    job->freed_ring = calloc(SHARDD__FREED_MAX, sizeof *job->freed_ring);
    if (job->freed_ring == NULL)
      return;
  }
  size_t slot = (job->freed_head + job->freed_count) % SHARDD__FREED_MAX;
  if (job->freed_count == SHARDD__FREED_MAX) { /* the oldest makes room */
    shardd__map_del_id(&job->freed, job->freed_ring[slot].id);
    freed_clear(&job->freed_ring[slot]);
    job->freed_head = (job->freed_head + 1) % SHARDD__FREED_MAX;
    job->freed_count--;
  }
  shardd__freed *f = &job->freed_ring[slot];
  f->id = o->id;
  f->generation = o->generation;
  f->kind = o->kind;
  f->name = strdup(o->name);
  f->buf_name = buf_name ? strdup(buf_name) : NULL;
  f->key = gen_key(buf_name ? buf_name : o->name,
                   o->kind == SHARDD__OBJ_VIEW ? o->name : NULL);
  if (f->name == NULL || f->key == NULL || (buf_name && f->buf_name == NULL) ||
      shardd__map_put_id(&job->freed, f->id, (void *)(uintptr_t)(slot + 1)) !=
          SHARDD_OK) {
    freed_clear(f);
    return;
  }
  job->freed_count++;
}

static void freed_release(shardd__job *job) {
  if (job->freed_ring) {
    for (size_t i = 0; i < SHARDD__FREED_MAX; i++)
      freed_clear(&job->freed_ring[i]);
    free(job->freed_ring);
    job->freed_ring = NULL;
  }
  job->freed_count = job->freed_head = 0;
  shardd__map_free(&job->freed);
  shardd__map_free(&job->gens);
}

int shardd__registry_stale(const shardd__registry *reg, const shardd__job *job,
                           uint64_t id, uint64_t generation, char *err,
                           size_t errlen) {
  const shardd__obj *o = shardd__registry_get(reg, id);
  if (o) {
    if (o->job != job || generation == 0 || o->kind == SHARDD__OBJ_OPTIM ||
        o->generation == generation)
      return 0;
    snprintf(err, errlen,
             "%s %" PRIu64 " (\"%s\") is stale: generation %" PRIu64
             ", current is %s %" PRIu64 " generation %" PRIu64,
             kind_name(o->kind), id, o->name, generation, kind_name(o->kind),
             id, o->generation);
    return 1;
  }
  if (job == NULL)
    return 0;
  uintptr_t slot = (uintptr_t)shardd__map_get_id(&job->freed, id);
  if (slot == 0)
    return 0;
  const shardd__freed *f = &job->freed_ring[slot - 1];
  uint64_t cur = gen_get(job, f->key);
  if (cur <= f->generation && (generation == 0 || generation == f->generation))
    return 0; /* plainly unregistered: nothing took its name since */
  const shardd__obj *now = NULL;
  if (f->kind == SHARDD__OBJ_BUFFER) {
    now = shardd__map_get_str(&job->buffers, f->name);
  } else {
    const shardd__buffer *b = shardd__map_get_str(&job->buffers, f->buf_name);
    now = b ? shardd__map_get_str(&b->views, f->name) : NULL;
  }
  if (now)
    snprintf(err, errlen,
             "%s %" PRIu64 " (\"%s\") is stale: generation %" PRIu64
             ", current is %s %" PRIu64 " generation %" PRIu64,
             kind_name(f->kind), id, f->name, f->generation,
             kind_name(f->kind), now->id, now->generation);
  else
    snprintf(err, errlen,
             "%s %" PRIu64 " (\"%s\") is stale: generation %" PRIu64
             " was unregistered, and generation %" PRIu64
             " of that name was registered and unregistered since",
             kind_name(f->kind), id, f->name, f->generation, cur);
  return 1;
}

static shardd_err obj_init(shardd__registry *reg, shardd__obj *o,
                           shardd__obj_kind kind, const char *name,
                           shardd__job *job) {
  o->kind = kind;
  o->job = job;
  if ((o->name = strdup(name)) == NULL)
    return SHARDD_E_NO_MEMORY;
  o->id = reg->next_id;
  if (shardd__map_put_id(&reg->objects, o->id, o) != SHARDD_OK) {
    free(o->name);
    o->name = NULL;
    return SHARDD_E_NO_MEMORY;
  }
  reg->next_id++;
  return SHARDD_OK;
}

static void obj_fini(shardd__registry *reg, shardd__obj *o) {
  if (o->name)
    shardd__map_del_id(&reg->objects, o->id);
  free(o->name);
}

/* ---- buffers ---------------------------------------------------------- */

/* --job-memory-limit: what the job holds plus what it asks for. */
static int within_quota(const shardd__registry *reg, const shardd__job *job,
                        uint64_t more, char *err, size_t errlen) {
  uint64_t lim = reg->job_memory_limit;
  if (lim == 0 || (job->bytes <= lim && more <= lim - job->bytes))
    return 1;
  snprintf(err, errlen,
           "job \"%s\" would hold %" PRIu64 " bytes, over its limit of %" PRIu64
           " (--job-memory-limit)",
           job->name, job->bytes + more, lim);
  return 0;
}

static void buffer_free_blocks(shardd__registry *reg, shardd__buffer *b) {
  if (b->blocks == NULL)
    return;
  for (uint32_t r = 0; r < b->world; r++) {
    if (b->blocks[r]) {
      b->hdr.job->bytes -= b->blocks[r]->bytes;
      b->hdr.job->nblocks--;
      reg->nblocks--;
      reg->backend->ops->free(reg->backend, b->blocks[r]);
    }
  }
  free(b->blocks);
  if (b->stage) {
    b->hdr.job->bytes -= b->stage->bytes;
    reg->backend->ops->free(reg->backend, b->stage);
    b->stage = NULL;
  }
  b->blocks = NULL;
}

static void view_destroy(shardd__registry *reg, shardd__view *v) {
  v->buf->hdr.job->nviews--;
  if (!v->requires_grad)
    v->buf->nfrozen--;
  record_freed(&v->hdr, v->buf->hdr.name);
  obj_fini(reg, &v->hdr);
  free(v->shape);
  free(v);
}

static void collect_cb(void *value, void *arg) {
  void ***cursor = arg;
  *(*cursor)++ = value;
}

static int cmp_obj_id(const void *a, const void *b) {
  const shardd__obj *x = *(shardd__obj *const *)a;
  const shardd__obj *y = *(shardd__obj *const *)b;
  return x->id < y->id ? -1 : x->id > y->id;
}

static shardd_err map_values(const shardd__map *m, void ***out, size_t *n) {
  *n = shardd__map_count(m);
  *out = malloc((*n ? *n : 1) * sizeof(void *));
  if (*out == NULL)
    return SHARDD_E_NO_MEMORY;
  void **cursor = *out;
  shardd__map_each(m, collect_cb, &cursor);
  qsort(*out, *n, sizeof(void *), cmp_obj_id);
  return SHARDD_OK;
}

static void buffer_destroy(shardd__registry *reg, shardd__buffer *b) {
  shardd__view **views;
  size_t n;
  if (map_values(&b->views, (void ***)&views, &n) == SHARDD_OK) {
    for (size_t i = 0; i < n; i++)
      view_destroy(reg, views[i]);
    free(views);
  }
  shardd__map_free(&b->views);
  shardd__map_del_str(&b->hdr.job->buffers, b->hdr.name);
  buffer_free_blocks(reg, b);
  record_freed(&b->hdr, NULL);
  obj_fini(reg, &b->hdr);
  free(b->frozen);
  free(b);
}

typedef struct {
  uint32_t uid;
  uint64_t n;
} uid_blocks;

static void count_uid_blocks(shardd__job *job, void *arg) {
  uid_blocks *a = arg;
  if (job->uid == a->uid)
    a->n += job->nblocks;
}

/* Whether job may take need more rank blocks (see max_blocks); else err. */
static int within_blocks(shardd__registry *reg, shardd__job *job, uint64_t need,
                         char *err, size_t errlen) {
  if (reg->max_blocks && reg->nblocks + need > reg->max_blocks) {
    snprintf(err, errlen, "the daemon holds %" PRIu64 " memory regions of its "
             "%" PRIu64 " (descriptors); this buffer needs %" PRIu64 " more",
             reg->nblocks, reg->max_blocks, need);
    return 0;
  }
  if (job->uid != 0 && reg->max_blocks_per_uid) {
    uid_blocks a = {job->uid, 0};
    shardd__registry_each_job(reg, count_uid_blocks, &a);
    if (a.n + need > reg->max_blocks_per_uid) {
      snprintf(err, errlen, "uid %" PRIu32 " holds %" PRIu64 " memory regions "
               "(descriptors), %" PRIu64 " more would pass its share of %" PRIu64,
               job->uid, a.n, need, reg->max_blocks_per_uid);
      return 0;
    }
  }
  return 1;
}

shardd_err shardd__buffer_register(shardd__registry *reg, shardd__job *job,
                                   const char *name, shardd_dtype dtype,
                                   uint64_t numel, shardd__buffer **out,
                                   int *created, char *err, size_t errlen) {
  *out = NULL;
  *created = 0;
  if (!name_ok(name, "buffer", err, errlen))
    return SHARDD_E_INVAL;
  size_t esz = shardd_dtype_size(dtype);
  if (esz == 0) {
    snprintf(err, errlen, "buffer \"%s\": dtype %d is not fp32, bf16 or fp16",
             name, (int)dtype);
    return SHARDD_E_DTYPE;
  }
  if (numel == 0 || numel > MAX_NUMEL) {
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
  b->dtype = dtype;
  b->numel = numel;
  b->world = job->world;
  b->shard_numel = (numel + job->world - 1) / job->world;
  b->padded_numel = b->shard_numel * job->world;
  b->shard_off = 0;
  b->reduced_off = area_end(b->shard_off, b->shard_numel * esz);
  b->gather_off = area_end(b->reduced_off, b->shard_numel * 4);
  b->grad_off = area_end(b->gather_off, b->padded_numel * esz);
  b->block_bytes = align_up(b->grad_off + b->padded_numel * esz, AREA_ALIGN);
  b->hdr.job = job;
  shardd__map_init(&b->views);

  shardd_err rc = SHARDD_E_NO_MEMORY;
  char *gkey = NULL;
  uint64_t gprev = 0;
  if (!within_quota(reg, job, (uint64_t)job->local_ranks * b->block_bytes, err, errlen))
    goto fail;
  if (!within_blocks(reg, job, job->local_ranks, err, errlen)) {
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
    rc = reg->backend->ops->alloc(reg->backend, shardd__rank_device(reg, r),
                                  b->block_bytes, label, &b->blocks[r], why,
                                  sizeof why);
    if (rc != SHARDD_OK) {
      snprintf(err, errlen, "buffer \"%s\" rank %" PRIu32 ": %s", name, r,
               why);
      goto fail;
    }
    job->bytes += b->blocks[r]->bytes;
    job->nblocks++;
    reg->nblocks++;
  }
  gkey = gen_key(name, NULL);
  if (gkey == NULL || (gprev = gen_get(job, gkey),
                       gen_put(job, gkey, gprev + 1)) != SHARDD_OK) {
    rc = SHARDD_E_NO_MEMORY;
    snprintf(err, errlen, "out of memory");
    goto fail;
  }
  b->hdr.generation = gprev + 1;
  if (obj_init(reg, &b->hdr, SHARDD__OBJ_BUFFER, name, job) != SHARDD_OK ||
      shardd__map_put_str(&job->buffers, name, b) != SHARDD_OK) {
    rc = SHARDD_E_NO_MEMORY;
    snprintf(err, errlen, "out of memory");
    gen_put(job, gkey, gprev); /* replaces or deletes: cannot fail */
    goto fail;
  }
  free(gkey);
  *out = b;
  *created = 1;
  return SHARDD_OK;

fail:
  free(gkey);
  buffer_free_blocks(reg, b);
  obj_fini(reg, &b->hdr);
  shardd__map_free(&b->views);
  free(b);
  return rc;
}

shardd_err shardd__buffer_unregister(shardd__registry *reg, shardd__job *job,
                                     uint64_t id, char *err, size_t errlen) {
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
  buffer_destroy(reg, b);
  return SHARDD_OK;
}

/* ---- views ------------------------------------------------------------ */

static int same_shape(const shardd__view *v, const int64_t *shape, int ndim) {
  if (v->ndim != ndim)
    return 0;
  for (int i = 0; i < ndim; i++)
    if (v->shape[i] != shape[i])
      return 0;
  return 1;
}

static int cmp_range(const void *a, const void *b) {
  const uint64_t *x = a, *y = b;
  return x[0] < y[0] ? -1 : x[0] > y[0];
}

typedef struct {
  uint64_t (*r)[2];
  size_t n;
} range_acc;

static void collect_frozen_cb(void *value, void *arg) {
  shardd__view *v = value;
  range_acc *a = arg;
  if (!v->requires_grad) {
    a->r[a->n][0] = v->offset;
    a->r[a->n][1] = v->numel;
    a->n++;
  }
}

/* Rebuilds b->frozen from its frozen views (b->nfrozen of them). */
static shardd_err frozen_rebuild(shardd__buffer *b) {
  range_acc a = {NULL, 0};
  if (b->nfrozen > 0) {
    a.r = malloc(b->nfrozen * sizeof *a.r);
    if (a.r == NULL)
      return SHARDD_E_NO_MEMORY;
    shardd__map_each(&b->views, collect_frozen_cb, &a);
    qsort(a.r, a.n, sizeof *a.r, cmp_range);
    size_t m = 0;
    for (size_t i = 0; i < a.n; i++) {
      if (m > 0 && a.r[i][0] <= a.r[m - 1][0] + a.r[m - 1][1]) {
        uint64_t end = a.r[i][0] + a.r[i][1];
        if (end > a.r[m - 1][0] + a.r[m - 1][1])
          a.r[m - 1][1] = end - a.r[m - 1][0];
      } else {
        a.r[m][0] = a.r[i][0];
        a.r[m][1] = a.r[i][1];
        m++;
      }
    }
    a.n = m;
  }
  free(b->frozen);
  b->frozen = a.r;
  b->nfrozen_ranges = a.n;
  return SHARDD_OK;
}

size_t shardd__buffer_trainable(const shardd__buffer *buf, uint64_t lo,
                                uint64_t hi, uint64_t (*out)[2], size_t cap) {
  size_t n = 0;
  uint64_t pos = lo;
  /* first frozen range ending after lo */
  size_t a = 0, z = buf->nfrozen_ranges;
  while (a < z) {
    size_t mid = a + (z - a) / 2;
    if (buf->frozen[mid][0] + buf->frozen[mid][1] <= lo)
      a = mid + 1;
    else
      z = mid;
  }
  for (size_t i = a; i < buf->nfrozen_ranges && pos < hi; i++) {
    uint64_t fs = buf->frozen[i][0], fe = fs + buf->frozen[i][1];
    if (fs > pos) {
      uint64_t end = fs < hi ? fs : hi;
      if (n < cap) {
        out[n][0] = pos;
        out[n][1] = end - pos;
      }
      n++;
    }
    if (fe > pos)
      pos = fe;
  }
  if (pos < hi) {
    if (n < cap) {
      out[n][0] = pos;
      out[n][1] = hi - pos;
    }
    n++;
  }
  return n;
}

typedef struct {
  uint64_t start, end;
  const shardd__view *hit; /* a trainable view meeting [start, end) */
} meet_arg;

static void meet_trainable_cb(void *value, void *arg) {
  const shardd__view *v = value;
  meet_arg *m = arg;
  if (m->hit == NULL && v->requires_grad && v->offset < m->end &&
      m->start < v->offset + v->numel)
    m->hit = v;
}

shardd_err shardd__view_register(shardd__registry *reg, shardd__job *job,
                                 uint64_t buffer, const char *name,
                                 uint64_t offset, uint64_t numel,
                                 const int64_t *shape, int ndim,
                                 shardd__view **out, int *created, char *err,
                                 size_t errlen) {
  return shardd__view_register_ex(reg, job, buffer, 0, name, offset, numel,
                                  shape, ndim, 1, out, created, err, errlen);
}

shardd_err shardd__view_register_ex(shardd__registry *reg, shardd__job *job,
                                    uint64_t buffer, uint64_t buffer_gen,
                                    const char *name, uint64_t offset,
                                    uint64_t numel, const int64_t *shape,
                                    int ndim, int requires_grad,
                                    shardd__view **out, int *created,
                                    char *err, size_t errlen) {
  *out = NULL;
  *created = 0;
  requires_grad = requires_grad != 0;
  shardd__obj *o;
  char *gkey = NULL;
  uint64_t gprev = 0;
  shardd_err rc = shardd__registry_resolve_gen(reg, job, buffer, buffer_gen,
                                               SHARDD__OBJ_BUFFER, &o, err,
                                               errlen);
  if (rc != SHARDD_OK)
    return rc;
  shardd__buffer *b = (shardd__buffer *)o;
  if (!name_ok(name, "view", err, errlen))
    return SHARDD_E_INVAL;
  if (numel == 0 || offset > b->numel || numel > b->numel - offset) {
    snprintf(err, errlen,
             "view \"%s\": elements [%" PRIu64 ", %" PRIu64
             ") are outside buffer %" PRIu64 " (\"%s\", numel %" PRIu64 ")",
             name, offset, offset + numel, buffer, o->name, b->numel);
    return SHARDD_E_RANGE;
  }
  if (ndim < 0 || ndim > MAX_NDIM) {
    snprintf(err, errlen, "view \"%s\": %d dimensions (at most %d)", name, ndim,
             MAX_NDIM);
    return SHARDD_E_RANGE;
  }
  uint64_t prod = 1;
  for (int i = 0; i < ndim; i++) {
    if (shape[i] < 0 || (shape[i] > 0 && prod > MAX_NUMEL / (uint64_t)shape[i])) {
      snprintf(err, errlen, "view \"%s\": dimension %d is %" PRId64, name, i,
               shape[i]);
      return SHARDD_E_RANGE;
    }
    prod *= (uint64_t)shape[i];
  }
  if (prod != numel) {
    snprintf(err, errlen,
             "view \"%s\": shape has %" PRIu64 " elements, numel is %" PRIu64,
             name, prod, numel);
    return SHARDD_E_MISMATCH;
  }
  shardd__view *v = shardd__map_get_str(&b->views, name);
  if (v) {
    if (v->offset != offset || v->numel != numel || !same_shape(v, shape, ndim)) {
      snprintf(err, errlen,
               "view \"%s\" of buffer %" PRIu64 " exists with offset %" PRIu64
               " numel %" PRIu64 " and another shape",
               name, buffer, v->offset, v->numel);
      return SHARDD_E_MISMATCH;
    }
    if (v->requires_grad != requires_grad) {
      snprintf(err, errlen,
               "view %" PRIu64 " (\"%s\") of buffer %" PRIu64
               " exists with requires_grad=%s, not %s",
               v->hdr.id, name, buffer, v->requires_grad ? "true" : "false",
               requires_grad ? "true" : "false");
      return SHARDD_E_MISMATCH;
    }
    *out = v;
    return SHARDD_OK;
  }
  /* Frozen and trainable elements never mix, so "the elements an
   * optimizer may update" stays one well-defined set. */
  if (!requires_grad && b->owner) {
    snprintf(err, errlen,
             "view \"%s\": buffer %" PRIu64 " (\"%s\") is held whole by "
             "optimizer %" PRIu64 " (\"%s\"); a frozen view cannot be added to it",
             name, buffer, o->name, b->owner->hdr.id, b->owner->hdr.name);
    return SHARDD_E_BUSY;
  }
  if (!requires_grad) {
    meet_arg m = {offset, offset + numel, NULL};
    shardd__map_each(&b->views, meet_trainable_cb, &m);
    if (m.hit) {
      snprintf(err, errlen,
               "frozen view \"%s\" [%" PRIu64 ", %" PRIu64
               ") overlaps trainable view %" PRIu64 " (\"%s\") [%" PRIu64
               ", %" PRIu64 ") of buffer %" PRIu64,
               name, offset, offset + numel, m.hit->hdr.id, m.hit->hdr.name,
               m.hit->offset, m.hit->offset + m.hit->numel, buffer);
      return SHARDD_E_OVERLAP;
    }
  } else if (b->nfrozen_ranges > 0) {
    uint64_t one[1][2];
    if (shardd__buffer_trainable(b, offset, offset + numel, one, 1) != 1 ||
        one[0][0] != offset || one[0][1] != numel) {
      snprintf(err, errlen,
               "view \"%s\" [%" PRIu64 ", %" PRIu64
               ") overlaps frozen elements of buffer %" PRIu64
               " (\"%s\"); register it with requires_grad=false or move it",
               name, offset, offset + numel, buffer, o->name);
      return SHARDD_E_OVERLAP;
    }
  }
  v = calloc(1, sizeof *v);
  if (v == NULL || (ndim > 0 && (v->shape = malloc((size_t)ndim * sizeof *shape)) == NULL))
    goto nomem;
  if (ndim > 0)
    memcpy(v->shape, shape, (size_t)ndim * sizeof *shape);
  v->ndim = ndim;
  v->buf = b;
  v->offset = offset;
  v->numel = numel;
  v->requires_grad = requires_grad;
  gkey = gen_key(o->name, name);
  if (gkey == NULL || (gprev = gen_get(job, gkey),
                       gen_put(job, gkey, gprev + 1)) != SHARDD_OK)
    goto nomem;
  v->hdr.generation = gprev + 1;
  if (obj_init(reg, &v->hdr, SHARDD__OBJ_VIEW, name, job) != SHARDD_OK) {
    gen_put(job, gkey, gprev);
    goto nomem;
  }
  if (shardd__map_put_str(&b->views, name, v) != SHARDD_OK) {
    obj_fini(reg, &v->hdr);
    gen_put(job, gkey, gprev);
    goto nomem;
  }
  if (!requires_grad) {
    b->nfrozen++;
    if (frozen_rebuild(b) != SHARDD_OK) {
      b->nfrozen--;
      shardd__map_del_str(&b->views, name);
      obj_fini(reg, &v->hdr);
      gen_put(job, gkey, gprev);
      goto nomem;
    }
  }
  free(gkey);
  job->nviews++;
  *out = v;
  *created = 1;
  return SHARDD_OK;

nomem:
  free(gkey);
  if (v)
    free(v->shape);
  free(v);
  snprintf(err, errlen, "out of memory");
  return SHARDD_E_NO_MEMORY;
}

shardd_err shardd__view_unregister(shardd__registry *reg, shardd__job *job,
                                   uint64_t id, char *err, size_t errlen) {
  shardd__obj *o;
  shardd_err rc = shardd__registry_resolve(reg, job, id, SHARDD__OBJ_VIEW, &o,
                                           err, errlen);
  if (rc != SHARDD_OK)
    return rc;
  shardd__view *v = (shardd__view *)o;
  if (v->owner) {
    snprintf(err, errlen,
             "view %" PRIu64 " (\"%s\") is referenced by optimizer %" PRIu64,
             id, o->name, v->owner->hdr.id);
    return SHARDD_E_BUSY;
  }
  shardd__buffer *b = v->buf;
  int frozen = !v->requires_grad;
  shardd__map_del_str(&b->views, o->name);
  view_destroy(reg, v);
  if (frozen && frozen_rebuild(b) != SHARDD_OK) {
    /* Out of memory: the old ranges stay, a superset, so scatter may skip
     * elements that are trainable now, never reduce frozen ones. */
  }
  return SHARDD_OK;
}

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
    if (s->state) {
      o->hdr.job->bytes -= s->state->bytes;
      reg->backend->ops->free(reg->backend, s->state);
    }
    free(s->segs);
  }
  free(o->shards);
  o->shards = NULL;
  o->nshards = 0;
}

static void optim_destroy(shardd__registry *reg, shardd__optim *o) {
  for (size_t i = 0; i < o->nrefs; i++) {
    shardd__obj *r = o->refs[i];
    if (r->kind == SHARDD__OBJ_VIEW) {
      shardd__view *v = (shardd__view *)r;
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
  obj_fini(reg, &o->hdr);
  free(o->refs);
  free(o->groups);
  free(o->spec);
  free(o);
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
                          uint32_t group) {
  if (s->nsegs > 0) { /* merge adjacent ranges of one group */
    shardd__seg *last = &s->segs[s->nsegs - 1];
    if (last->group == group && last->start + last->len == start) {
      last->len += len;
      return SHARDD_OK;
    }
  }
  shardd__seg *p = realloc(s->segs, (s->nsegs + 1) * sizeof *p);
  if (p == NULL)
    return SHARDD_E_NO_MEMORY;
  s->segs = p;
  s->segs[s->nsegs++] = (shardd__seg){start, len, group};
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
      if (sh == NULL || add_seg(sh, pos - (uint64_t)rank * s, len, r->group) != SHARDD_OK)
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
    if (!within_quota(reg, job, off, err, errlen)) {
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
      snprintf(err, errlen, "optimizer state for buffer \"%s\" rank %" PRIu32 ": %s",
               sh->buf->hdr.name, sh->rank, why);
      goto fail;
    }
    job->bytes += sh->state->bytes;
  }

  o->refs = malloc((plan->nrefs ? plan->nrefs : 1) * sizeof *o->refs);
  if (o->refs == NULL)
    goto nomem;
  if (obj_init(reg, &o->hdr, SHARDD__OBJ_OPTIM, plan->name, job) != SHARDD_OK)
    goto nomem;
  if (shardd__map_put_str(&job->optims, plan->name, o) != SHARDD_OK) {
    obj_fini(reg, &o->hdr);
    o->hdr.name = NULL;
    goto nomem;
  }
  for (size_t i = 0; i < plan->nrefs; i++) {
    shardd__obj *r = plan->refs[i].obj;
    o->refs[o->nrefs++] = r;
    if (r->kind == SHARDD__OBJ_VIEW)
      ((shardd__view *)r)->owner = o;
    else
      ((shardd__buffer *)r)->owner = o;
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
    off = nstate > 0 ? area_end(0, arr) : arr;
  }
  for (int j = 0; j < nstate; j++) {
    state_offs[j] = off;
    off = j + 1 < nstate ? area_end(off, arr) : off + arr;
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
  optim_destroy(reg, opt);
  return SHARDD_OK;
}

/* ---- listing and release ---------------------------------------------- */

shardd_err shardd__job_buffers(shardd__job *job, shardd__buffer ***out,
                               size_t *n) {
  return map_values(&job->buffers, (void ***)out, n);
}

shardd_err shardd__job_optims(shardd__job *job, shardd__optim ***out,
                              size_t *n) {
  return map_values(&job->optims, (void ***)out, n);
}

static int cmp_view_offset(const void *a, const void *b) {
  const shardd__view *x = *(shardd__view *const *)a;
  const shardd__view *y = *(shardd__view *const *)b;
  if (x->offset != y->offset)
    return x->offset < y->offset ? -1 : 1;
  return x->hdr.id < y->hdr.id ? -1 : x->hdr.id > y->hdr.id;
}

shardd_err shardd__buffer_views(shardd__buffer *buf, shardd__view ***out,
                                size_t *n) {
  shardd_err rc = map_values(&buf->views, (void ***)out, n);
  if (rc == SHARDD_OK)
    qsort(*out, *n, sizeof **out, cmp_view_offset);
  return rc;
}

void shardd__job_release(shardd__registry *reg, shardd__job *job) {
  shardd__optim **opts;
  shardd__buffer **bufs;
  size_t n;
  job->releasing = 1;
  if (shardd__job_optims(job, &opts, &n) == SHARDD_OK) {
    for (size_t i = 0; i < n; i++)
      optim_destroy(reg, opts[i]);
    free(opts);
  }
  if (shardd__job_buffers(job, &bufs, &n) == SHARDD_OK) {
    for (size_t i = 0; i < n; i++)
      buffer_destroy(reg, bufs[i]);
    free(bufs);
  }
  shardd__map_free(&job->buffers);
  shardd__map_free(&job->optims);
  freed_release(job);
  shardd__map_del_str(&reg->jobs, job->name);
  free(job->rank_sessions);
  free(job->name);
  free(job);
}

struct each_job_arg {
  void (*fn)(shardd__job *, void *);
  void *arg;
};

static void each_job_cb(void *value, void *arg) {
  struct each_job_arg *a = arg;
  a->fn(value, a->arg);
}

void shardd__registry_each_job(shardd__registry *reg,
                               void (*fn)(shardd__job *job, void *arg),
                               void *arg) {
  struct each_job_arg a = {fn, arg};
  shardd__map_each(&reg->jobs, each_job_cb, &a);
}
