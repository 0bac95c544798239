/* status.c — Status and Inspect replies. Everything a reply points to is
 * allocated from the report's arena, so freeing is one walk. */
#include "status.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "access.h"
#include "coll.h"
#include "jobs.h"

typedef struct chunk {
  struct chunk *next;
  max_align_t data[];
} chunk;

struct shardd__report {
  chunk *chunks;
  int failed;
};

static void *ar_alloc(shardd__report *r, size_t n) {
  chunk *c = calloc(1, sizeof *c + (n ? n : 1));
  if (c == NULL) {
    r->failed = 1;
    return NULL;
  }
  c->next = r->chunks;
  r->chunks = c;
  return c->data;
}

static char *ar_strdup(shardd__report *r, const char *s) {
  size_t n = strlen(s ? s : "") + 1;
  char *p = ar_alloc(r, n);
  if (p)
    memcpy(p, s ? s : "", n);
  return p;
}

void shardd__report_free(shardd__report *r) {
  if (r == NULL)
    return;
  for (chunk *c = r->chunks, *next; c; c = next) {
    next = c->next;
    free(c);
  }
  free(r);
}

static Shardwire__DType wire_dtype(shardd_dtype d) { return (Shardwire__DType)d; }

/* What a report lists is bounded, and its cost follows what it lists: one
 * status of 512 jobs of world 65536 built per-rank arrays of every job
 * (13.5 GB, the loop frozen for a minute) to send a reply the client would
 * refuse anyway. Past these, lists are cut and a _more field counts the
 * rest. Collectives listed per job: a stuck job shows what it waits on
 * without a deep pipeline of prefetched gathers filling the reply. */
#define MAX_STATUS_COLLECTIVES 32
#define MAX_STATUS_RANKS 64  /* in each list of ranks */
#define MAX_STATUS_OPTIMIZERS 64
#define MAX_STATUS_CHECKPOINTS 16
/* jobs per reply (StatusRequest.first_job pages on), and about the bytes
 * they may take: half the frame limit */
#define MAX_STATUS_JOBS 256
#define MAX_STATUS_JOB_BYTES ((size_t)8 << 20)
/* collectives described per reply: each reads its world's arrivals */
#define MAX_STATUS_DESCRIBED 1024
#define MAX_INSPECT_SHARDS 64
#define MAX_INSPECT_VIEWS 1024

/* This daemon's ranks of job, held and not (with how long each has been
 * gone), so an operator sees who is missing when collectives wait; the
 * first MAX_STATUS_RANKS of each, the rest counted. */
static void rank_states(const shardd__status_ctx *ctx, shardd__report *r,
                        shardd__job *job, Shardwire__JobStatus *js) {
  uint32_t n = job->local_ranks;
  size_t max = n < MAX_STATUS_RANKS ? n : MAX_STATUS_RANKS;
  js->connected_ranks = ar_alloc(r, max * sizeof *js->connected_ranks);
  js->missing_ranks = ar_alloc(r, max * sizeof *js->missing_ranks);
  js->missing_for_s = ar_alloc(r, max * sizeof *js->missing_for_s);
  if (!js->connected_ranks || !js->missing_ranks || !js->missing_for_s)
    return;
  uint32_t held = shardd__jobs_ranks(ctx->jobs, job, js->connected_ranks,
                                     js->missing_ranks, max,
                                     &js->n_connected_ranks, &js->n_missing_ranks);
  if (held > n)
    held = n;
  for (size_t k = 0; k < js->n_missing_ranks; k++)
    js->missing_for_s[js->n_missing_for_s++] =
        shardd__coll_rank_missing_s(ctx->coll, job, js->missing_ranks[k]);
  if (held > js->n_connected_ranks) {
    js->has_connected_ranks_more = 1;
    js->connected_ranks_more = held - (uint32_t)js->n_connected_ranks;
  }
  if (n - held > js->n_missing_ranks) {
    js->has_missing_ranks_more = 1;
    js->missing_ranks_more = n - held - (uint32_t)js->n_missing_ranks;
  }
}

/* The job's collectives, oldest first, each with the ranks that arrived
 * and those it waits on (the first MAX_STATUS_RANKS of each); *budget
 * counts down the collectives this report may still describe. */
static void coll_states(const shardd__status_ctx *ctx, shardd__report *r,
                        shardd__job *job, Shardwire__JobStatus *js,
                        size_t *budget) {
  uint32_t n = shardd__coll_inflight(ctx->coll, job);
  if (n == 0)
    return;
  if (n > MAX_STATUS_COLLECTIVES)
    n = MAX_STATUS_COLLECTIVES;
  if (n > *budget)
    n = (uint32_t)*budget;
  if (n == 0)
    return;
  js->collectives = ar_alloc(r, n * sizeof *js->collectives);
  if (js->collectives == NULL)
    return;
  uint32_t lr = job->local_ranks;
  size_t max = lr < MAX_STATUS_RANKS ? lr : MAX_STATUS_RANKS;
  shardd__coll_info info;
  for (size_t i = 0; i < n; i++) {
    Shardwire__CollectiveStatus *cs = ar_alloc(r, sizeof *cs);
    uint32_t *in = ar_alloc(r, max * sizeof *in), *out = ar_alloc(r, max * sizeof *out);
    if (cs == NULL || in == NULL || out == NULL)
      break;
    shardd__coll_ranks rk = {.max = max, .arrived = in, .waiting = out};
    if (shardd__coll_describe_ranks(ctx->coll, job, i, &info, &rk) != SHARDD_OK)
      break;
    --*budget;
    shardwire__collective_status__init(cs);
    cs->kind = ar_strdup(r, shardd__coll_kind_word(info.kind));
    cs->target = info.target;
    cs->name = ar_strdup(r, info.name);
    cs->running = info.running;
    cs->waited_s = info.waited_s;
    cs->arrived = in;
    cs->n_arrived = rk.n_arrived;
    cs->waiting_for = out;
    cs->n_waiting_for = rk.n_waiting;
    if (rk.arrived_all > cs->n_arrived) {
      cs->has_arrived_more = 1;
      cs->arrived_more = rk.arrived_all - (uint32_t)cs->n_arrived;
    }
    if (rk.waiting_all > cs->n_waiting_for) {
      cs->has_waiting_for_more = 1;
      cs->waiting_for_more = rk.waiting_all - (uint32_t)cs->n_waiting_for;
    }
    js->collectives[js->n_collectives++] = cs;
  }
}

/* What an operator's waiting checkpoint waits for shows next to the
 * collectives that keep the job from its quiescent point. */
static void pending_checkpoints(const shardd__status_ctx *ctx, shardd__report *r,
                                shardd__job *job, Shardwire__JobStatus *js) {
  const char *dir;
  double waited, wait;
  size_t n = 0;
  while (n < MAX_STATUS_CHECKPOINTS && ctx->pending_checkpoint &&
         ctx->pending_checkpoint(ctx->pending_arg, job, n, &dir, &waited, &wait))
    n++;
  if (n == 0 || (js->pending_checkpoints = ar_alloc(r, n * sizeof *js->pending_checkpoints)) == NULL)
    return;
  for (size_t i = 0; i < n &&
                     ctx->pending_checkpoint(ctx->pending_arg, job, i, &dir, &waited, &wait);
       i++) {
    Shardwire__PendingCheckpoint *pc = ar_alloc(r, sizeof *pc);
    if (pc == NULL)
      return;
    shardwire__pending_checkpoint__init(pc);
    pc->dir = ar_strdup(r, dir);
    pc->waited_s = waited;
    pc->wait_s = wait;
    if (pc->dir == NULL)
      return;
    js->pending_checkpoints[js->n_pending_checkpoints++] = pc;
  }
}

static Shardwire__JobStatus *job_status(const shardd__status_ctx *ctx,
                                     shardd__report *r, shardd__job *job,
                                     size_t *described) {
  Shardwire__JobStatus *js = ar_alloc(r, sizeof *js);
  if (js == NULL)
    return NULL;
  shardwire__job_status__init(js);
  js->name = ar_strdup(r, job->name);
  js->has_owner_uid = 1;
  js->owner_uid = job->uid;
  js->world = job->world;
  js->clients = shardd__jobs_clients(ctx->jobs, job);
  js->views = job->nviews;
  js->bytes = job->bytes;
  if (job->transient) {
    js->has_transient = 1;
    js->transient = 1;
    js->has_pool_bytes = 1;
    js->pool_bytes = shardd__job_pool_bytes(job);
    js->has_pool_reserved_bytes = 1;
    js->pool_reserved_bytes = shardd__areas_reserve(job, NULL);
    shardd__gather_usage gu;
    shardd__job_gather_usage(job, &gu);
    js->has_gather_pool_bytes = js->has_gathered_bytes = 1;
    js->has_gathered_units = js->has_gather_shared = 1;
    js->gather_pool_bytes = gu.pool_bytes;
    js->gathered_bytes = gu.held_bytes;
    js->gathered_units = gu.held;
    js->gather_shared = gu.shared != 0;
  }
  js->collectives_in_flight = shardd__coll_inflight(ctx->coll, job);
  rank_states(ctx, r, job, js);
  coll_states(ctx, r, job, js, described);
  pending_checkpoints(ctx, r, job, js);
  js->buffers = (uint32_t)shardd__map_count(&job->buffers);
  shardd__optim **opts;
  size_t no;
  if (shardd__job_optims(job, &opts, &no) == SHARDD_OK) {
    size_t listed = no < MAX_STATUS_OPTIMIZERS ? no : MAX_STATUS_OPTIMIZERS;
    if (no > listed) {
      js->has_optimizers_more = 1;
      js->optimizers_more = (uint32_t)(no - listed);
    }
    js->optimizers = ar_alloc(r, (listed ? listed : 1) * sizeof *js->optimizers);
    for (size_t i = 0; js->optimizers && i < listed; i++) {
      Shardwire__OptimizerStatus *os = ar_alloc(r, sizeof *os);
      if (os == NULL)
        break;
      shardwire__optimizer_status__init(os);
      os->id = opts[i]->hdr.id;
      os->name = ar_strdup(r, opts[i]->hdr.name);
      os->kind = (Shardwire__OptimKind)opts[i]->kind;
      os->steps = opts[i]->steps;
      os->params = (uint32_t)opts[i]->nrefs;
      js->optimizers[js->n_optimizers++] = os;
    }
    free(opts);
  }
  if (job->nodes > 1) {
    js->has_nodes = 1;
    js->nodes = job->nodes;
    js->has_node_rank = 1;
    js->node_rank = job->node_rank;
    js->node_states = ar_alloc(r, job->nodes * sizeof *js->node_states);
    for (uint32_t n = 0; js->node_states && n < job->nodes; n++) {
      Shardwire__NodeStatus *ns = ar_alloc(r, sizeof *ns);
      if (ns == NULL)
        break;
      shardwire__node_status__init(ns);
      char state[32];
      shardd__coll_node_state(ctx->coll, job, n, state, sizeof state);
      ns->node = n;
      ns->first_rank = n * job->local_ranks;
      ns->ranks = job->local_ranks;
      ns->state = ar_strdup(r, state);
      js->node_states[js->n_node_states++] = ns;
    }
    char engine[32], msg[400];
    shardd__coll_fabric_state(ctx->coll, job, engine, sizeof engine, msg, sizeof msg);
    js->fabric = ar_strdup(r, engine);
    if (msg[0])
      js->fabric_error = ar_strdup(r, msg);
  }
  return js;
}

typedef struct {
  shardd__job **jobs;
  size_t n, cap;
  const shardd__peer *viewer;
} jobs_arg;

static void add_job(shardd__job *job, void *arg) {
  jobs_arg *a = arg;
  if (a->viewer && !shardd__access_may_see(a->viewer, job))
    return;
  if (a->n < a->cap)
    a->jobs[a->n++] = job;
}

static int cmp_job(const void *x, const void *y) {
  const shardd__job *a = *(shardd__job *const *)x;
  const shardd__job *b = *(shardd__job *const *)y;
  int k = strcmp(a->name, b->name);
  return k ? k : (a->uid > b->uid) - (a->uid < b->uid);
}

/* The jobs viewer may see, sorted by name then owner; from the first_job-th
 * on, as many as fit MAX_STATUS_JOBS and MAX_STATUS_JOB_BYTES are listed,
 * the rest counted in jobs_more. Only listed jobs cost more than a
 * pointer and a comparison. */
static void list_jobs(const shardd__status_ctx *ctx, shardd__report *r,
                      Shardwire__StatusReply *st, const shardd__peer *viewer,
                      uint32_t first_job) {
  jobs_arg a = {NULL, 0, shardd__map_count(&ctx->reg->jobs), viewer};
  a.jobs = malloc((a.cap ? a.cap : 1) * sizeof *a.jobs);
  st->jobs = ar_alloc(r, MAX_STATUS_JOBS * sizeof *st->jobs);
  if (a.jobs == NULL || st->jobs == NULL) {
    r->failed = 1;
    free(a.jobs);
    return;
  }
  shardd__registry_each_job(ctx->reg, add_job, &a);
  qsort(a.jobs, a.n, sizeof *a.jobs, cmp_job);
  size_t i = first_job < a.n ? first_job : a.n, bytes = 0;
  size_t described = MAX_STATUS_DESCRIBED;
  if (first_job > 0) {
    st->has_first_job = 1;
    st->first_job = (uint32_t)i;
  }
  for (; i < a.n && st->n_jobs < MAX_STATUS_JOBS && bytes < MAX_STATUS_JOB_BYTES; i++) {
    Shardwire__JobStatus *js = job_status(ctx, r, a.jobs[i], &described);
    if (js == NULL)
      break;
    bytes += shardwire__job_status__get_packed_size(js);
    st->jobs[st->n_jobs++] = js;
  }
  if (i < a.n) {
    st->has_jobs_more = 1;
    st->jobs_more = (uint32_t)(a.n - i);
  }
  free(a.jobs);
}

shardd_err shardd__status_build(const shardd__status_ctx *ctx,
                                const shardd__peer *viewer, uint32_t first_job,
                                shardd__report **out,
                                Shardwire__StatusReply **reply) {
  shardd__report *r = calloc(1, sizeof *r);
  *out = r;
  *reply = NULL;
  if (r == NULL)
    return SHARDD_E_NO_MEMORY;
  Shardwire__StatusReply *st = ar_alloc(r, sizeof *st);
  if (st == NULL)
    return SHARDD_E_NO_MEMORY;
  shardwire__status_reply__init(st);
  st->daemon_version = ar_strdup(r, SHARDD_VERSION);
  st->protocol_version = SHARDD_PROTOCOL_VERSION;
  st->pid = (uint64_t)getpid();
  st->uptime_s = ctx->uptime_s;
  st->backend = ar_strdup(r, ctx->reg->backend->name);
  st->socket_path = ar_strdup(r, ctx->socket_path);
  st->clients = ctx->clients;
  st->has_partial_frame_bytes = 1;
  st->partial_frame_bytes = ctx->partial_frame_bytes;
  if (ctx->has_unread_replies) {
    st->has_unread_reply_bytes = st->has_unread_reply_fds = 1;
    st->unread_reply_bytes = ctx->unread_reply_bytes;
    st->unread_reply_fds = ctx->unread_reply_fds;
  }

  shardd__backend *be = ctx->reg->backend;
  int nd = be->ndevices;
  st->devices = ar_alloc(r, (size_t)nd * sizeof *st->devices);
  for (int d = 0; st->devices && d < nd; d++) {
    Shardwire__DeviceStatus *ds = ar_alloc(r, sizeof *ds);
    if (ds == NULL)
      break;
    shardwire__device_status__init(ds);
    shardd__device_info info;
    be->ops->device_info(be, d, &info);
    ds->index = (uint32_t)d;
    ds->name = ar_strdup(r, info.name);
    ds->capacity_bytes = info.capacity_bytes;
    ds->used_bytes = info.used_bytes;
    ds->has_free_bytes = 1;
    ds->free_bytes = info.free_bytes;
    ds->has_peak_bytes = 1;
    ds->peak_bytes = info.peak_bytes;
    ds->has_allocs = 1;
    ds->allocs = info.allocs;
    st->devices[st->n_devices++] = ds;
  }

  list_jobs(ctx, r, st, viewer, first_job);
  if (r->failed)
    return SHARDD_E_NO_MEMORY;
  *reply = st;
  return SHARDD_OK;
}

/* ---- inspect ---------------------------------------------------------- */

typedef struct {
  const char *name;
  shardd__obj *found;
  int matches;
  char jobs[256];
  const shardd__peer *viewer;
} find_arg;

static void find_in_job(shardd__job *job, void *arg) {
  find_arg *f = arg;
  if (!shardd__access_may_see(f->viewer, job))
    return;
  shardd__buffer **bufs;
  size_t nb;
  if (shardd__job_buffers(job, &bufs, &nb) != SHARDD_OK)
    return;
  for (size_t i = 0; i < nb; i++) {
    shardd__obj *hit = NULL;
    if (strcmp(bufs[i]->hdr.name, f->name) == 0)
      hit = &bufs[i]->hdr;
    else
      hit = shardd__map_get_str(&bufs[i]->views, f->name);
    if (hit) {
      if (f->matches++ == 0)
        f->found = hit;
      size_t used = strlen(f->jobs);
      if (job->uid == f->viewer->uid)
        snprintf(f->jobs + used, sizeof f->jobs - used, "%s\"%s\" (id %" PRIu64 ")",
                 used ? ", " : "", job->name, hit->id);
      else
        snprintf(f->jobs + used, sizeof f->jobs - used,
                 "%s\"%" PRIu32 "/%s\" (id %" PRIu64 ")", used ? ", " : "",
                 job->uid, job->name, hit->id);
    }
  }
  free(bufs);
}

/* What the daemon holds for each rank's shard of b (see ShardInfo.bytes):
 * its block, its seed and every optimizer's state over it; per[world].
 * One pass over the optimizers' shards: a walk of them per rank was
 * world x shards, half a second of the loop for one inspect of a buffer of
 * world 16384 under an optimizer. */
static void shard_bytes(shardd__buffer *b, shardd__optim **opts, size_t no,
                        uint64_t *per) {
  for (uint32_t k = 0; k < b->world; k++) {
    per[k] = b->blocks[k] ? b->blocks[k]->bytes : 0;
    if (b->seed && b->seed[k])
      per[k] += b->seed[k]->bytes;
  }
  for (size_t i = 0; i < no; i++)
    for (size_t j = 0; j < opts[i]->nshards; j++) {
      const shardd__optim_shard *sh = &opts[i]->shards[j];
      if (sh->buf == b && sh->rank < b->world && sh->state)
        per[sh->rank] += sh->state->bytes;
    }
}

static shardd_err fill_buffer(shardd__report *r, const shardd__status_ctx *ctx,
                              shardd__buffer *b, Shardwire__InspectReply *ir) {
  ir->has_dtype = 1;
  ir->dtype = wire_dtype(b->dtype);
  ir->has_numel = 1;
  ir->numel = b->numel;
  ir->has_padded_numel = 1;
  ir->padded_numel = b->padded_numel;
  ir->has_shard_numel = 1;
  ir->shard_numel = b->shard_numel;
  ir->has_world = 1;
  ir->world = b->world;
  ir->has_resident_bytes = 1;
  ir->resident_bytes = 0;
  ir->has_generation = 1;
  ir->generation = b->hdr.generation;
  uint64_t(*fr)[2];
  size_t nfr_all = shardd__buffer_frozen(b, &fr);
  size_t nfr = nfr_all < MAX_INSPECT_VIEWS ? nfr_all : MAX_INSPECT_VIEWS;
  if (nfr_all > nfr) {
    ir->has_frozen_more = 1;
    ir->frozen_more = (uint32_t)(nfr_all - nfr);
  }
  ir->frozen = ar_alloc(r, (nfr ? nfr : 1) * sizeof *ir->frozen);
  for (size_t k = 0; ir->frozen && k < nfr; k++) {
    Shardwire__ElemRange *er = ar_alloc(r, sizeof *er);
    if (er == NULL)
      return SHARDD_E_NO_MEMORY;
    shardwire__elem_range__init(er);
    er->offset = fr[k][0];
    er->numel = fr[k][1];
    ir->frozen[ir->n_frozen++] = er;
  }
  uint32_t nsh = b->world < MAX_INSPECT_SHARDS ? b->world : MAX_INSPECT_SHARDS;
  if (b->world > nsh) {
    ir->has_shards_more = 1;
    ir->shards_more = b->world - nsh;
  }
  /* every optimizer over b counts, not only its owner (another holds
   * views of it), and so do 16-bit seeds */
  shardd__optim **opts = NULL;
  size_t no = 0;
  uint64_t *per = malloc(b->world * sizeof *per);
  if (per == NULL || shardd__job_optims(b->hdr.job, &opts, &no) != SHARDD_OK) {
    free(per);
    return SHARDD_E_NO_MEMORY;
  }
  shard_bytes(b, opts, no, per);
  free(opts);
  for (uint32_t k = 0; k < b->world; k++) /* NULL block: another node's rank */
    if (b->blocks[k])
      ir->resident_bytes += per[k];
  ir->shards = ar_alloc(r, nsh * sizeof *ir->shards);
  for (uint32_t k = 0; ir->shards && k < nsh; k++) {
    Shardwire__ShardInfo *si = ar_alloc(r, sizeof *si);
    if (si == NULL) {
      free(per);
      return SHARDD_E_NO_MEMORY;
    }
    shardwire__shard_info__init(si);
    si->rank = k;
    si->device = (uint32_t)shardd__rank_device(ctx->reg, k);
    si->offset = (uint64_t)k * b->shard_numel;
    si->numel = b->shard_numel;
    if (b->blocks[k]) {
      si->has_bytes = 1;
      si->bytes = per[k];
    }
    ir->shards[ir->n_shards++] = si;
  }
  free(per);
  shardd__optim *owner = b->owner;
  if (owner) {
    ir->has_steps = 1;
    ir->steps = shardd__ref_steps(&b->hdr);
  }
  shardd__view **views;
  size_t nv;
  if (shardd__buffer_views(b, &views, &nv) != SHARDD_OK)
    return SHARDD_E_NO_MEMORY;
  size_t listed = nv < MAX_INSPECT_VIEWS ? nv : MAX_INSPECT_VIEWS;
  if (nv > listed) {
    ir->has_views_more = 1;
    ir->views_more = (uint32_t)(nv - listed);
  }
  /* the owner of a buffer held through its views only is the first such
   * view's, listed or not */
  for (size_t i = listed; owner == NULL && i < nv; i++)
    owner = views[i]->owner;
  ir->views = ar_alloc(r, (listed ? listed : 1) * sizeof *ir->views);
  for (size_t i = 0; ir->views && i < listed; i++) {
    Shardwire__ViewInfo *vi = ar_alloc(r, sizeof *vi);
    if (vi == NULL)
      break;
    shardwire__view_info__init(vi);
    vi->id = views[i]->hdr.id;
    vi->name = ar_strdup(r, views[i]->hdr.name);
    vi->offset = views[i]->offset;
    vi->numel = views[i]->numel;
    vi->has_generation = 1;
    vi->generation = views[i]->hdr.generation;
    vi->has_requires_grad = 1;
    vi->requires_grad = views[i]->requires_grad;
    if (views[i]->owner) {
      vi->has_steps = 1;
      vi->steps = shardd__ref_steps(&views[i]->hdr);
    }
    vi->n_shape = (size_t)views[i]->ndim;
    vi->shape = ar_alloc(r, (vi->n_shape ? vi->n_shape : 1) * sizeof(int64_t));
    if (vi->shape && vi->n_shape)
      memcpy(vi->shape, views[i]->shape, vi->n_shape * sizeof(int64_t));
    ir->views[ir->n_views++] = vi;
    if (owner == NULL)
      owner = views[i]->owner;
  }
  free(views);
  if (b->hdr.job->transient) {
    ir->gather_leases = ar_alloc(r, nsh * sizeof *ir->gather_leases);
    ir->grad_leases = ar_alloc(r, nsh * sizeof *ir->grad_leases);
    uint32_t ngather = 0, ngrad = 0;
    for (uint32_t k = 0; ir->gather_leases && ir->grad_leases && k < b->world; k++) {
      if (shardd__area_held(b, k, SHARDD__AREA_GATHER, NULL) && ngather++ < nsh)
        ir->gather_leases[ir->n_gather_leases++] = k;
      if (shardd__area_held(b, k, SHARDD__AREA_GRAD, NULL) && ngrad++ < nsh)
        ir->grad_leases[ir->n_grad_leases++] = k;
    }
    if (ngather > ir->n_gather_leases) {
      ir->has_gather_leases_more = 1;
      ir->gather_leases_more = ngather - (uint32_t)ir->n_gather_leases;
    }
    if (ngrad > ir->n_grad_leases) {
      ir->has_grad_leases_more = 1;
      ir->grad_leases_more = ngrad - (uint32_t)ir->n_grad_leases;
    }
  }
  if (owner) {
    ir->has_optimizer = 1;
    ir->optimizer = owner->hdr.id;
  }
  return r->failed ? SHARDD_E_NO_MEMORY : SHARDD_OK;
}

shardd_err shardd__inspect_build(const shardd__status_ctx *ctx,
                                 const shardd__peer *viewer,
                                 shardd__job *own_job, uint64_t id,
                                 const char *name,
                                 shardd__report **out,
                                 Shardwire__InspectReply **reply, char *err,
                                 size_t errlen) {
  *out = NULL;
  *reply = NULL;
  shardd__obj *o = NULL;
  if (id != 0) {
    o = shardd__registry_get(ctx->reg, id);
    if (o && !shardd__access_may_see(viewer, o->job))
      o = NULL; /* another user's id reads as one never issued */
    if (o == NULL) {
      int freed = viewer->admin ? shardd__registry_issued(ctx->reg, id)
                                : shardd__registry_known_freed(ctx->reg,
                                                               own_job, id);
      snprintf(err, errlen,
               freed ? "id %" PRIu64 " no longer exists (unregistered)"
                     : "no buffer or view has id %" PRIu64,
               id);
      return SHARDD_E_NOT_FOUND;
    }
  } else if (name && name[0]) {
    find_arg f = {name, NULL, 0, "", viewer};
    if (own_job)
      find_in_job(own_job, &f);
    if (f.matches == 0)
      shardd__registry_each_job(ctx->reg, find_in_job, &f);
    if (f.matches == 0) {
      snprintf(err, errlen, "no buffer or view is named \"%s\"", name);
      return SHARDD_E_NOT_FOUND;
    }
    if (f.matches > 1) {
      snprintf(err, errlen, "\"%s\" names %d objects, in jobs %s; give the id",
               name, f.matches, f.jobs);
      return SHARDD_E_INVAL;
    }
    o = f.found;
  } else {
    snprintf(err, errlen, "inspect needs an id or a name");
    return SHARDD_E_INVAL;
  }

  if (!shardd__access_may_see(viewer, o->job)) {
    snprintf(err, errlen, "id %" PRIu64 " belongs to a job of another user",
             o->id);
    return SHARDD_E_PERMISSION;
  }
  shardd__report *r = calloc(1, sizeof *r);
  *out = r;
  if (r == NULL)
    return SHARDD_E_NO_MEMORY;
  Shardwire__InspectReply *ir = ar_alloc(r, sizeof *ir);
  if (ir == NULL)
    return SHARDD_E_NO_MEMORY;
  shardwire__inspect_reply__init(ir);
  ir->id = o->id;
  ir->name = ar_strdup(r, o->name);
  ir->job = ar_strdup(r, o->job->name);
  shardd_err rc = SHARDD_OK;
  if (o->kind == SHARDD__OBJ_BUFFER) {
    ir->kind = ar_strdup(r, "buffer");
    rc = fill_buffer(r, ctx, (shardd__buffer *)o, ir);
  } else if (o->kind == SHARDD__OBJ_VIEW) {
    shardd__view *v = (shardd__view *)o;
    ir->kind = ar_strdup(r, "view");
    ir->has_buffer = 1;
    ir->buffer = v->buf->hdr.id;
    ir->has_offset = 1;
    ir->offset = v->offset;
    ir->has_numel = 1;
    ir->numel = v->numel;
    ir->has_dtype = 1;
    ir->dtype = wire_dtype(v->buf->dtype);
    ir->has_generation = 1;
    ir->generation = v->hdr.generation;
    ir->has_requires_grad = 1;
    ir->requires_grad = v->requires_grad;
    ir->n_shape = (size_t)v->ndim;
    ir->shape = ar_alloc(r, (ir->n_shape ? ir->n_shape : 1) * sizeof(int64_t));
    if (ir->shape && ir->n_shape)
      memcpy(ir->shape, v->shape, ir->n_shape * sizeof(int64_t));
    /* held by itself, or through its buffer registered whole (FSDP1
     * style): a view's owner is set only in the first case, and a view
     * that named no optimizer read as free to register */
    const shardd__optim *held = v->owner ? v->owner : v->buf->owner;
    if (held) {
      ir->has_optimizer = 1;
      ir->optimizer = held->hdr.id;
      ir->has_steps = 1;
      ir->steps = shardd__ref_steps(v->owner ? o : &v->buf->hdr);
    }
    /* Which ranks hold it: the shards its range crosses. */
    uint64_t s0 = v->offset / v->buf->shard_numel;
    uint64_t s1 = (v->offset + v->numel - 1) / v->buf->shard_numel;
    if (s1 - s0 >= MAX_INSPECT_SHARDS) {
      ir->has_shards_more = 1;
      ir->shards_more = (uint32_t)(s1 - s0 + 1 - MAX_INSPECT_SHARDS);
      s1 = s0 + MAX_INSPECT_SHARDS - 1;
    }
    ir->shards = ar_alloc(r, (size_t)(s1 - s0 + 1) * sizeof *ir->shards);
    for (uint64_t k = s0; ir->shards && k <= s1; k++) {
      Shardwire__ShardInfo *si = ar_alloc(r, sizeof *si);
      if (si == NULL)
        break;
      shardwire__shard_info__init(si);
      si->rank = (uint32_t)k;
      si->device = (uint32_t)shardd__rank_device(ctx->reg, (uint32_t)k);
      uint64_t lo = k * v->buf->shard_numel, hi = lo + v->buf->shard_numel;
      uint64_t a = v->offset > lo ? v->offset : lo;
      uint64_t b = v->offset + v->numel < hi ? v->offset + v->numel : hi;
      si->offset = a;
      si->numel = b - a;
      ir->shards[ir->n_shards++] = si;
    }
  } else {
    shardd__optim *opt = (shardd__optim *)o;
    ir->kind = ar_strdup(r, "optimizer");
    ir->has_resident_bytes = 1;
    for (size_t i = 0; i < opt->nshards; i++)
      if (opt->shards[i].state)
        ir->resident_bytes += opt->shards[i].state->bytes;
  }
  if (rc == SHARDD_OK && r->failed)
    rc = SHARDD_E_NO_MEMORY;
  if (rc != SHARDD_OK) {
    snprintf(err, errlen, "out of memory building the report");
    return rc;
  }
  *reply = ir;
  return SHARDD_OK;
}
