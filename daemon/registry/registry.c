/* registry.c — the registry itself: jobs, the daemon-wide object ids and
 * their lookups, the per-name generations and the ring of freed handles
 * that tells a stale id from a mistyped one, and the memory and region
 * quotas. A job is known by its owner's uid and its name: two users'
 * jobs of one name are two jobs. Buffers are buffer.c's, views views.c's,
 * optimizers optimizer.c's. */
#include "registry.h"
#include "registry_int.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>

#define NAME_MAX_LEN 255

void shardd__registry_init(shardd__registry *reg, shardd__backend *backend) {
  memset(reg, 0, sizeof *reg);
  reg->backend = backend;
  reg->next_id = 1;
  reg->leases_per_rank[SHARDD__AREA_GATHER] = 2;
  reg->leases_per_rank[SHARDD__AREA_GRAD] = 2;
  shardd__map_init(&reg->objects);
  shardd__map_init(&reg->jobs);
  shardd__map_init(&reg->pool_ids);
}

static void collect_job_cb(void *value, void *arg) {
  shardd__job ***cursor = arg;
  *(*cursor)++ = value;
}

void shardd__registry_fit_blocks(shardd__registry *reg, uint64_t keep) {
  struct rlimit nofile;
  if (getrlimit(RLIMIT_NOFILE, &nofile) != 0 || nofile.rlim_cur == RLIM_INFINITY)
    return;
  uint64_t n = nofile.rlim_cur;
  reg->max_blocks = n > 2 * keep ? n - keep : n / 2;
  reg->max_blocks_per_uid = reg->max_blocks / 4;
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
  shardd__map_free(&reg->pool_ids);
}

int shardd__name_ok(const char *name, const char *what, char *err,
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

/* The jobs map's key of uid's job name: "UID/NAME". The uid comes first
 * and has no '/', so no two (uid, name) pairs share a key. 0 when name is
 * too long to be a job's. */
static int job_key(uint32_t uid, const char *name, char *key, size_t n) {
  int k = snprintf(key, n, "%" PRIu32 "/%s", uid, name);
  return k > 0 && (size_t)k < n;
}

#define JOB_KEY_LEN (NAME_MAX_LEN + 16)

shardd__job *shardd__job_find(shardd__registry *reg, uint32_t uid,
                              const char *name) {
  char key[JOB_KEY_LEN];
  if (name == NULL || !job_key(uid, name, key, sizeof key))
    return NULL;
  return shardd__map_get_str(&reg->jobs, key);
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
  if (!shardd__name_ok(name, "job", err, errlen))
    return SHARDD_E_INVAL;
  /* Root and the admin group name uid N's job NAME as "N/NAME": uid 1001's
   * job called "1002/vj" read as uid 1002's "vj", and root's release of it
   * released the victim's. No job name holds a '/', so each such string
   * names one job. */
  if (strchr(name, '/') != NULL) {
    snprintf(err, errlen, "job name \"%s\" holds a '/': job names may not "
             "(an admin names uid N's job NAME as \"N/NAME\")", name);
    return SHARDD_E_INVAL;
  }
  if (world < 1 || world > SHARDD__WORLD_MAX) {
    snprintf(err, errlen, "world %" PRIu32 " is out of range [1, %u]", world,
             SHARDD__WORLD_MAX);
    return SHARDD_E_RANGE;
  }
  shardd__job *job = shardd__job_find(reg, uid, name);
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
  if (job == NULL || (job->name = strdup(name)) == NULL)
    goto nomem;
  job->world = world;
  job->nodes = 1;
  job->local_ranks = world;
  job->uid = uid;
  job->reg = reg;
  shardd__map_init(&job->buffers);
  shardd__map_init(&job->optims);
  shardd__map_init(&job->gens);
  shardd__map_init(&job->freed);
  char key[JOB_KEY_LEN];
  job_key(uid, name, key, sizeof key); /* name_ok bounded its length */
  if (shardd__map_put_str(&reg->jobs, key, job) != SHARDD_OK)
    goto nomem;
  *out = job;
  return SHARDD_OK;

nomem:
  if (job) {
    free(job->name);
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

int shardd__registry_visible(const shardd__job *job, const shardd__obj *o) {
  return job && o->job && (job->uid == 0 || o->job->uid == job->uid);
}

int shardd__registry_known_freed(const shardd__registry *reg,
                                 const shardd__job *job, uint64_t id) {
  if (job == NULL || shardd__registry_get(reg, id))
    return 0;
  if (job->uid == 0)
    return shardd__registry_issued(reg, id);
  return shardd__map_get_id(&job->freed, id) != NULL;
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
  if (o && !shardd__registry_visible(job, o))
    o = NULL;
  if (o == NULL) {
    if (shardd__registry_stale(reg, job, id, 0, err, errlen))
      return SHARDD_E_STALE;
    if (shardd__registry_known_freed(reg, job, id))
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
    const char *want = kind_name(kind);
    snprintf(err, errlen, "id %" PRIu64 " (\"%s\") is a %s, not %s %s", id,
             o->name, kind_name(o->kind), want[0] == 'o' ? "an" : "a", want);
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

/* The gens key of (buf_name, view_name) into dst where it fits in cap
 * bytes (its NUL included), its length in *len always (dst NULL: *len
 * alone). "v<len>:<buf><view>" or "b:<buf>", put together by hand:
 * snprintf was a quarter of a view's registration (gen_key runs at each
 * registration and each unregistration). */
static void gen_key_write(char *dst, size_t cap, const char *buf_name,
                          const char *view_name, size_t *len) {
  size_t nb = strlen(buf_name), nv = view_name ? strlen(view_name) : 0;
  char digits[24];
  size_t nd = 0;
  if (view_name) {
    size_t x = nb;
    do
      digits[nd++] = (char)('0' + x % 10);
    while ((x /= 10) != 0);
  }
  *len = nd + nb + nv + 2;
  if (dst == NULL || *len >= cap)
    return;
  char *p = dst;
  *p++ = view_name ? 'v' : 'b';
  while (nd > 0)
    *p++ = digits[--nd];
  *p++ = ':';
  memcpy(p, buf_name, nb);
  p += nb;
  if (nv)
    memcpy(p, view_name, nv);
  p[nv] = '\0';
}

/* As shardd__gen_key, with extra bytes allocated after the key's NUL;
 * *len gets the key's length. */
static char *gen_key_extra(const char *buf_name, const char *view_name,
                           size_t extra, size_t *len) {
  gen_key_write(NULL, 0, buf_name, view_name, len);
  char *k = malloc(*len + 1 + extra);
  if (k != NULL)
    gen_key_write(k, *len + 1, buf_name, view_name, len);
  return k;
}

/* The gens key of a buffer name (view_name NULL) or of a view of it;
 * caller frees. The length prefix keeps ("a", "bc") and ("ab", "c") apart. */
char *shardd__gen_key(const char *buf_name, const char *view_name) {
  size_t len;
  return gen_key_extra(buf_name, view_name, 0, &len);
}

char *shardd__gen_key_in(char *buf, size_t cap, const char *buf_name,
                         const char *view_name) {
  size_t len;
  gen_key_write(buf, cap, buf_name, view_name, &len); /* when it fits */
  if (len < cap)
    return buf;
  return gen_key_extra(buf_name, view_name, 0, &len);
}

uint64_t shardd__gen_get(const shardd__job *job, const char *key) {
  return (uint64_t)(uintptr_t)shardd__map_get_str(&job->gens, key);
}

shardd_err shardd__gen_next(shardd__job *job, const char *key, uint64_t *prev) {
  void **slot = shardd__map_slot_str(&job->gens, key);
  if (slot == NULL)
    return SHARDD_E_NO_MEMORY;
  *prev = (uint64_t)(uintptr_t)*slot;
  *slot = (void *)(uintptr_t)(*prev + 1);
  return SHARDD_OK;
}

shardd_err shardd__gen_put(shardd__job *job, const char *key, uint64_t g) {
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
  char *key =
      shardd__gen_key(bname, o->kind == SHARDD__OBJ_VIEW ? o->name : NULL);
  o->generation = generation;
  if (key && shardd__gen_get(job, key) < generation)
    /* replaces: the key exists already */
    shardd__gen_put(job, key, generation);
  free(key);
}

static void freed_clear(shardd__freed *f) {
  free(f->key); /* and name and buf_name, in the same allocation */
  memset(f, 0, sizeof *f);
}

/* Remembers that o is freed (best effort: out of memory forgets it, and
 * the id then reads as plainly unregistered). */
void shardd__record_freed(shardd__obj *o, const char *buf_name) {
  shardd__job *job = o->job;
  if (job == NULL || job->releasing || o->kind == SHARDD__OBJ_OPTIM)
    return;
  if (job->freed_ring == NULL) {
    job->freed_ring = calloc(SHARDD__FREED_MAX, sizeof *job->freed_ring);
    if (job->freed_ring == NULL)
      return;
  }
  size_t slot = (job->freed_head + job->freed_count) % SHARDD__FREED_MAX;
  shardd__freed *f = &job->freed_ring[slot];
  char *room = NULL; /* the oldest's allocation, for this one's */
  size_t room_cap = 0;
  if (job->freed_count == SHARDD__FREED_MAX) { /* the oldest makes room */
    shardd__map_del_id(&job->freed, f->id);
    room = f->key;
    room_cap = f->cap;
    job->freed_head = (job->freed_head + 1) % SHARDD__FREED_MAX;
    job->freed_count--;
  }
  f->id = o->id;
  f->generation = o->generation;
  f->kind = o->kind;
  /* the key, then the name and the buffer's name: one allocation (three
   * strdups and three frees were a fifth of a view's unregistration),
   * the evicted record's when it is large enough (a malloc and a free
   * less per unregistration once the ring is full) */
  const char *kbuf = buf_name ? buf_name : o->name;
  const char *kview = o->kind == SHARDD__OBJ_VIEW ? o->name : NULL;
  size_t nn = strlen(o->name) + 1, nbn = buf_name ? strlen(buf_name) + 1 : 0;
  size_t kl;
  gen_key_write(NULL, 0, kbuf, kview, &kl);
  size_t need = kl + 1 + nn + nbn;
  if (room == NULL || room_cap < need) {
    free(room);
    room = malloc(need);
    room_cap = need;
  }
  f->key = room;
  f->cap = room ? room_cap : 0;
  f->name = f->buf_name = NULL;
  if (f->key) {
    gen_key_write(f->key, kl + 1, kbuf, kview, &kl);
    f->name = f->key + kl + 1;
    memcpy(f->name, o->name, nn);
    if (buf_name) {
      f->buf_name = f->name + nn;
      memcpy(f->buf_name, buf_name, nbn);
    }
  }
  if (f->key == NULL ||
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
  uint64_t cur = shardd__gen_get(job, f->key);
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

uint64_t shardd__registry_new_mark(shardd__registry *reg) {
  return ++reg->next_mark; /* from 1: an object starts unmarked (0) */
}

int shardd__registry_mark_once(shardd__obj *o, uint64_t mark) {
  if (o->mark == mark)
    return 0;
  o->mark = mark;
  return 1;
}

/* o gets an id and its place in the objects map; name is o's own
 * (inline) or copied. */
static shardd_err obj_init(shardd__registry *reg, shardd__obj *o,
                           shardd__obj_kind kind, char *name, int inline_name,
                           shardd__job *job) {
  o->kind = kind;
  o->job = job;
  o->name_inline = (unsigned char)inline_name;
  if ((o->name = inline_name ? name : strdup(name)) == NULL)
    return SHARDD_E_NO_MEMORY;
  o->id = reg->next_id;
  if (shardd__map_put_id(&reg->objects, o->id, o) != SHARDD_OK) {
    if (!inline_name)
      free(o->name);
    o->name = NULL;
    return SHARDD_E_NO_MEMORY;
  }
  reg->next_id++;
  return SHARDD_OK;
}

shardd_err shardd__obj_init(shardd__registry *reg, shardd__obj *o,
                            shardd__obj_kind kind, const char *name,
                            shardd__job *job) {
  return obj_init(reg, o, kind, (char *)name, 0, job);
}

shardd_err shardd__obj_init_inline(shardd__registry *reg, shardd__obj *o,
                                   shardd__obj_kind kind, char *name,
                                   shardd__job *job) {
  return obj_init(reg, o, kind, name, 1, job);
}

void shardd__obj_fini(shardd__registry *reg, shardd__obj *o) {
  if (o->name)
    shardd__map_del_id(&reg->objects, o->id);
  if (!o->name_inline)
    free(o->name);
}

/* ---- quotas ----------------------------------------------------------- */

typedef struct {
  uint32_t uid;
  uint64_t bytes, reserved;
} uid_bytes;

static void count_uid_bytes(void *value, void *arg) {
  shardd__job *job = value;
  uid_bytes *a = arg;
  if (job->uid == a->uid) {
    uint64_t r = shardd__areas_reserve(job, NULL);
    a->bytes += job->bytes + r;
    a->reserved += r;
  }
}

/* --job-memory-limit: what the job holds plus what it asks for; and
 * --uid-memory-limit: the same over every job of its owner (not root). */
int shardd__within_quota(const shardd__registry *reg, shardd__job *job,
                         uint64_t more, char *err, size_t errlen) {
  uint64_t lim = reg->job_memory_limit;
  uint64_t reserved = shardd__areas_reserve(job, NULL);
  uint64_t have = job->bytes + reserved;
  char pool[128] = "";
  if (reserved)
    snprintf(pool, sizeof pool, " (%" PRIu64 " of them reserved for its "
             "transient areas' pools)", reserved);
  if (lim != 0 && !(have <= lim && more <= lim - have)) {
    snprintf(err, errlen,
             "job \"%s\" would hold %" PRIu64 " bytes%s, over its limit of %" PRIu64
             " (--job-memory-limit)",
             job->name, have + more, pool, lim);
    return 0;
  }
  lim = reg->uid_memory_limit;
  if (lim == 0 || job->uid == 0)
    return 1;
  uid_bytes a = {job->uid, 0, 0};
  shardd__map_each(&reg->jobs, count_uid_bytes, &a);
  if (a.bytes <= lim && more <= lim - a.bytes)
    return 1;
  pool[0] = 0;
  if (a.reserved)
    snprintf(pool, sizeof pool, " (%" PRIu64 " of them reserved for their "
             "transient areas' pools)", a.reserved);
  snprintf(err, errlen,
           "uid %" PRIu32 " would hold %" PRIu64 " bytes over all its jobs%s, over "
           "its limit of %" PRIu64 " (--uid-memory-limit)",
           job->uid, a.bytes + more, pool, lim);
  return 0;
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
int shardd__within_blocks(shardd__registry *reg, shardd__job *job,
                          uint64_t need, char *err, size_t errlen) {
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

int shardd__region_count(shardd__registry *reg, shardd__job *job,
                         const shardd__region *r, int check, const char *what,
                         char *err, size_t errlen) {
  if (r->fd < 0)
    return 1;
  if (check && !shardd__within_blocks(reg, job, 1, err, errlen)) {
    size_t used = strlen(err);
    if (used < errlen)
      snprintf(err + used, errlen - used, " (%s would be one more)", what);
    return 0;
  }
  job->nblocks++;
  reg->nblocks++;
  return 1;
}

void shardd__registry_regions_merged(shardd__registry *reg, shardd__job *job,
                                     uint64_t k) {
  job->nblocks -= k;
  reg->nblocks -= k;
}

void shardd__region_uncount(shardd__registry *reg, shardd__job *job,
                            const shardd__region *r) {
  if (r->fd >= 0) {
    job->nblocks--;
    reg->nblocks--;
  }
}

static void count_uid_views(shardd__job *job, void *arg) {
  uid_blocks *a = arg;
  if (job->uid == a->uid)
    a->n += job->nviews;
}

int shardd__within_views(shardd__registry *reg, shardd__job *job, char *err,
                         size_t errlen) {
  if (reg->max_views && reg->nviews >= reg->max_views) {
    snprintf(err, errlen, "the daemon holds %" PRIu64 " views, its limit "
             "(--max-views)", reg->nviews);
    return 0;
  }
  /* a uid holds no more than the daemon does: below the share in all, no
   * walk over the jobs is needed (it would make each registration cost
   * every job) */
  if (job->uid != 0 && reg->max_views_per_uid &&
      reg->nviews >= reg->max_views_per_uid) {
    uid_blocks a = {job->uid, 0};
    shardd__registry_each_job(reg, count_uid_views, &a);
    if (a.n >= reg->max_views_per_uid) {
      snprintf(err, errlen, "uid %" PRIu32 " holds %" PRIu64 " views, the "
               "most one user may (--max-views-per-uid)", job->uid, a.n);
      return 0;
    }
  }
  return 1;
}

/* ---- listing and release ---------------------------------------------- */

static void collect_cb(void *value, void *arg) {
  void ***cursor = arg;
  *(*cursor)++ = value;
}

static int cmp_obj_id(const void *a, const void *b) {
  const shardd__obj *x = *(shardd__obj *const *)a;
  const shardd__obj *y = *(shardd__obj *const *)b;
  return x->id < y->id ? -1 : x->id > y->id;
}

shardd_err shardd__obj_values(const shardd__map *m, void ***out, size_t *n) {
  *n = shardd__map_count(m);
  *out = malloc((*n ? *n : 1) * sizeof(void *));
  if (*out == NULL)
    return SHARDD_E_NO_MEMORY;
  void **cursor = *out;
  shardd__map_each(m, collect_cb, &cursor);
  qsort(*out, *n, sizeof(void *), cmp_obj_id);
  return SHARDD_OK;
}

shardd_err shardd__job_buffers(shardd__job *job, shardd__buffer ***out,
                               size_t *n) {
  return shardd__obj_values(&job->buffers, (void ***)out, n);
}

shardd_err shardd__job_optims(shardd__job *job, shardd__optim ***out,
                              size_t *n) {
  return shardd__obj_values(&job->optims, (void ***)out, n);
}

void shardd__job_release(shardd__registry *reg, shardd__job *job) {
  shardd__optim **opts;
  shardd__buffer **bufs;
  size_t n;
  job->releasing = 1;
  if (shardd__job_optims(job, &opts, &n) == SHARDD_OK) {
    for (size_t i = 0; i < n; i++)
      shardd__optim_destroy(reg, opts[i]);
    free(opts);
  }
  if (shardd__job_buffers(job, &bufs, &n) == SHARDD_OK) {
    for (size_t i = 0; i < n; i++)
      shardd__buffer_destroy(reg, bufs[i]);
    free(bufs);
  }
  shardd__map_free(&job->buffers);
  shardd__map_free(&job->optims);
  shardd__areas_free(reg, job); /* every lease was returned with its buffer */
  freed_release(job);
  char key[JOB_KEY_LEN];
  job_key(job->uid, job->name, key, sizeof key);
  shardd__map_del_str(&reg->jobs, key);
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
