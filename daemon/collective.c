/* collective.c — collectives over the ranks of a job (see collective.h).
 *
 * A collective is created by the first rank that asks for it and joined by
 * the others; a rank joins the oldest collective of the same kind and
 * target it has not joined yet, so a rank that runs ahead queues behind.
 * Once every rank has arrived, it starts when no older collective in the
 * job's queue touches the same buffers, so one buffer's collectives run in
 * submission order. The work is split into tasks (one per rank shard) on
 * libuv's thread pool; tasks only touch region memory, and the completion
 * count is kept on the loop thread (after_work).
 *
 * A job over several nodes (--job-spec) runs two-level collectives: the
 * local part over this daemon's ranks on the pool, then one cross-node
 * exchange (fabric.h) per collective on one of the job's fabric threads,
 * then the local fan-out on the pool:
 *   gather:  local shards -> the first local rank's gather area, at their
 *            place; allgather of the node's contiguous slice across nodes;
 *            copies to the other local gather areas.
 *   scatter: the local ranks' whole gradients summed (fp32, rank order)
 *            into the buffer's staging area; the fabric's reduce-scatter
 *            sums across nodes; each local owner's reduced shard is its
 *            part of the sum, divided for mean.
 *   step:    local, except that with clipping the sums of squares of the
 *            local shards cross nodes (in the exchange's header, below)
 *            before the updates.
 * Cross-node traffic is one copy per node, not per rank.
 *
 * Fabric threads. An exchange waits for the peer daemons, which may be
 * seconds behind (their ranks arrive later) or gone. Run on libuv's pool
 * (4 threads on a small machine), a few exchanges that the nodes reach in
 * different orders -- prefetched gathers of several buffers, or two
 * multi-node jobs between the same daemons -- fill every pool thread on
 * each node with exchanges the other node cannot join, since its own pool
 * is full of the others: everything stalls until the collective timeout.
 * So exchanges never run on the pool. Each job has its own threads, made
 * on demand and kept until the job is freed, and every queued exchange
 * gets a thread at once: there are never fewer threads than exchanges in
 * flight. That is bounded, because every started collective holds each
 * local rank's session, which may have --max-pending collectives at most;
 * so the job's threads are capped at max_pending, which only a rank that
 * reconnects while its old exchanges still run can reach (those end within
 * the timeout and free their threads). The nodes need not agree on an
 * order, and could not: a serial per-job thread would need one, and the
 * ranks of one node may issue their prefetches in another order than the
 * ranks of another. Exchanges are paired across nodes by Gloo's tag
 * instead (from the kind and the target's name; ids differ between
 * daemons, names do not), and a node runs one exchange per tag at a time,
 * so two names that hash alike cannot mix their data. Completion comes
 * back to the loop through a uv_async_t per exchange (held by the
 * collective, closed when it fires).
 *
 * Every exchange first allgathers a small header (kind, name hash, how many
 * exchanges of that kind and target this node made before, element count,
 * bytes, dtype, reduction) and moves data only when every node's header
 * agrees with this node's. A buffer registered with another size or dtype
 * on one node, another reduction, two names sharing a tag that the nodes
 * ran in different orders, or exchange counts out of step fail the
 * collective with SHARDD_E_MISMATCH and a message naming the node and what
 * differs, instead of mixing data silently or tripping Gloo's size checks
 * in its network thread (which would abort the daemon). Every node sees
 * every header, so all decide alike, and the fabric stays up. The step's
 * sums of squares travel in the header: it is the step's whole exchange.
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
#include "collective.h"

#include <inttypes.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fabric.h"
#include "map.h"

typedef struct coll coll;

typedef struct {
  shardd__session *s; /* NULL when not arrived or gone */
  uint64_t seq;
  int arrived;
} waiter;

/* One piece of work on the pool: elements [start, start+len) of unit
 * (a, b): gather: a = destination rank, range in the padded buffer;
 * scatter: a = owner rank, range in its shard; step: a = optimizer shard,
 * b = its segment, range in the segment. Large units are cut in chunks so a
 * big shard uses every worker, not one. */
typedef struct {
  uv_work_t req;
  coll *c;
  size_t a, b;
  uint64_t start, len;
  double sumsq;
  shardd_err rc;
  int fabric; /* the collective's exchange, on a fabric thread */
  int bulk;   /* the whole collective through the backend's comm ops */
} task;

#define CHUNK_ELEMS ((uint64_t)1 << 18)

struct coll {
  coll *next;
  shardd__server *srv;
  shardd__job *job;
  shardd__coll_args args;
  shardd__buffer *buf; /* gather / scatter */
  shardd__optim *opt;  /* step */
  waiter *waiters;     /* [world] */
  uint32_t arrived;
  double deadline;
  int started;
  int phase; /* step: 0 norms, 1 updates */
  size_t ntasks, left;
  task *tasks;
  float grad_scale;
  double total_norm;
  uint64_t step;
  shardd__hp *hp; /* step: groups with any lr override applied */
  shardd_err rc;
  /* set when a rank joined with other arguments: the collective never runs
   * and every rank, including those still to arrive, gets this error */
  shardd_err refused;
  char refused_msg[256];
  /* multi-node: stage 0 local, 1 fabric, 2 local fan-out (gather, scatter);
   * step: 1 while the sum of squares crosses nodes */
  int stage;
  uint64_t name_key; /* fab_key of the kind and the target's name */
  uint32_t tag;      /* Gloo's, from name_key */
  const char *name;  /* the target's (it outlives c: inflight holds it) */
  uint64_t fab_seq;  /* exchanges of this kind and target before this one */
  double sumsq_all;
  char fab_msg[384]; /* written by the fabric thread, read after it */
  /* the exchange in flight: its task, its place in the job's fabric queue
   * and the handle that brings its end back to the loop */
  task *fab_task;
  coll *fab_next;
  uv_async_t fab_async;
  int bulk; /* this phase is one bulk task (decided once, in start_phase) */
};

/* ---- cross-node state of a job ------------------------------------------
 * Created on the loop thread when the job gets its layout; the fabric itself
 * is connected lazily by the first exchange (blocking, on a fabric thread),
 * so the loop never waits for a rendezvous. The mutex guards everything
 * below it up to the counts against the fabric threads and the status
 * reader, and is never held while waiting for a peer. */

enum { FAB_IDLE, FAB_UP, FAB_FAILED };

typedef struct {
  shardd__server *srv;
  pthread_mutex_t mu;
  pthread_cond_t cv; /* queue, running, connecting or stop changed */
  shardd__fabric_opts opts;
  char *rendezvous, *prefix, *host;
  shardd__fabric *f;
  int state;
  int at_rendezvous; /* failed before connecting */
  int connecting;    /* a fabric thread is in shardd__fabric_create */
  shardd_err code;
  char msg[384];
  /* the job's fabric threads (see the top of the file) */
  coll *queue; /* exchanges no thread has taken yet, oldest first */
  uint32_t nqueued;
  uint32_t *running; /* [cap]: the tags being exchanged, one per thread */
  uint32_t nrunning;
  pthread_t *threads; /* [cap] */
  uint32_t nthreads, cap;
  int stop;
  /* loop thread only: exchanges made so far per kind and target, by
   * fab_key (values: malloc'd uint64_t counts) */
  shardd__map counts;
} jobfab;

/* The job's fabric. The first exchange that needs it connects it; the
 * others wait for that one on the condition variable, not on the mutex. */
static shardd_err jf_get(jobfab *jf, shardd__fabric **out, char *err,
                         size_t errlen) {
  pthread_mutex_lock(&jf->mu);
  while (jf->connecting)
    pthread_cond_wait(&jf->cv, &jf->mu);
  shardd_err rc = SHARDD_OK;
  if (jf->state == FAB_FAILED) {
    rc = jf->code;
    snprintf(err, errlen, "%s", jf->msg);
  } else if (jf->f == NULL) {
    jf->connecting = 1;
    pthread_mutex_unlock(&jf->mu);
    shardd__fabric *f = NULL;
    rc = shardd__fabric_create(&jf->opts, &f, err, errlen);
    pthread_mutex_lock(&jf->mu);
    jf->connecting = 0;
    if (rc != SHARDD_OK) {
      jf->state = FAB_FAILED;
      jf->at_rendezvous = 1;
      jf->code = rc;
      snprintf(jf->msg, sizeof jf->msg, "%s", err);
    } else {
      jf->f = f;
      jf->state = FAB_UP;
    }
    pthread_cond_broadcast(&jf->cv);
  }
  *out = jf->f;
  pthread_mutex_unlock(&jf->mu);
  return rc;
}

/* A fabric error latches: Gloo's connections do not recover, so every
 * later collective of the job fails at once with the first reason. */
static void jf_broken(jobfab *jf, shardd_err code, const char *msg) {
  pthread_mutex_lock(&jf->mu);
  if (jf->state != FAB_FAILED) {
    jf->state = FAB_FAILED;
    jf->code = code;
    snprintf(jf->msg, sizeof jf->msg, "%s", msg);
  }
  pthread_mutex_unlock(&jf->mu);
}

static void free_value(void *value, void *arg) { free(value); }

static void jf_release(jobfab *jf) {
  shardd__fabric_destroy(jf->f);
  pthread_cond_destroy(&jf->cv);
  pthread_mutex_destroy(&jf->mu);
  free(jf->threads);
  free(jf->running);
  shardd__map_each(&jf->counts, free_value, NULL);
  shardd__map_free(&jf->counts);
  free(jf->rendezvous);
  free(jf->prefix);
  free(jf->host);
  free(jf);
}

static void jf_release_work(uv_work_t *req) {
  jobfab *jf = req->data;
  shardd__fabric_destroy(jf->f);
  jf->f = NULL;
}

static void jf_release_done(uv_work_t *req, int status) {
  jobfab *jf = req->data;
  free(req);
  jf_release(jf);
}

static void jf_free(jobfab *jf) {
  if (jf == NULL)
    return;
  shardd__server *srv = jf->srv;
  /* The job has no collective left, so no exchange is queued or running
   * and every thread is idle: they see stop and end at once. */
  pthread_mutex_lock(&jf->mu);
  jf->stop = 1;
  pthread_cond_broadcast(&jf->cv);
  pthread_mutex_unlock(&jf->mu);
  for (uint32_t i = 0; i < jf->nthreads; i++)
    pthread_join(jf->threads[i], NULL);
  jf->nthreads = 0;
  /* Closing the fabric waits for Gloo's network thread to let go of the
   * sockets (some 20 ms), never for a peer: on the pool while the loop
   * serves others, inline once the daemon stops (the loop has ended). */
  uv_work_t *req = jf->f && srv && !srv->stopping ? malloc(sizeof *req) : NULL;
  if (req) {
    req->data = jf;
    if (uv_queue_work(srv->loop, req, jf_release_work, jf_release_done) == 0)
      return;
    free(req);
  }
  jf_release(jf);
}

/* FNV-1a 64 over the kind and the name: what names an exchange across
 * nodes (the header's name, and the tag folded from it). */
static uint64_t fab_key(shardd__coll_kind kind, const char *name) {
  uint64_t h = 14695981039346656037ull;
  h ^= (uint64_t)kind;
  h *= 1099511628211ull;
  for (const char *p = name ? name : ""; *p; p++) {
    h ^= (unsigned char)*p;
    h *= 1099511628211ull;
  }
  return h;
}

static uint32_t fab_tag(uint64_t key) {
  return (uint32_t)(key ^ (key >> 32)) & 0x7fffffffu;
}

/* How many exchanges of key this node made before this one (loop thread);
 * -1 when out of memory. */
static int64_t fab_next_seq(jobfab *jf, uint64_t key) {
  uint64_t *n = shardd__map_get_id(&jf->counts, key);
  if (n == NULL) {
    if ((n = calloc(1, sizeof *n)) == NULL)
      return -1;
    if (shardd__map_put_id(&jf->counts, key, n) != SHARDD_OK) {
      free(n);
      return -1;
    }
  }
  return (int64_t)(*n)++;
}

shardd_err shardd__coll_job_layout(shardd__server *srv, shardd__job *job,
                                   uint32_t rank, char *err, size_t errlen) {
  const shardd__jobspec *sp =
      shardd__jobspec_find(srv->opts.jobspecs, srv->opts.njobspecs, job->name);
  if (sp == NULL)
    return SHARDD_OK;
  if (sp->world != job->world) {
    snprintf(err, errlen,
             "job \"%s\" has world %" PRIu32 " in its job spec %s, not %" PRIu32,
             job->name, sp->world, sp->path, job->world);
    return SHARDD_E_MISMATCH;
  }
  if (sp->nodes > 1 && job->nodes == 1) {
    if (strcmp(srv->backend->name, "host") != 0) {
      snprintf(err, errlen,
               "job \"%s\" spans %" PRIu32 " nodes, but cross-node collectives "
               "on the %s backend need the NCCL fabric, which this shardd "
               "does not have; use --backend host",
               job->name, sp->nodes, srv->backend->name);
      return SHARDD_E_STATE;
    }
    if (shardd__fabric_engine() == NULL) {
      snprintf(err, errlen,
               "job \"%s\" spans %" PRIu32 " nodes, but this shardd was built "
               "without Gloo (install libgloo-dev and rebuild)",
               job->name, sp->nodes);
      return SHARDD_E_STATE;
    }
    /* one thread per exchange in flight, and a started collective holds
     * every local rank's session, each in max_pending collectives at most */
    uint32_t cap = srv->opts.max_pending ? srv->opts.max_pending : 1;
    jobfab *jf = calloc(1, sizeof *jf);
    if (jf == NULL || (jf->rendezvous = strdup(sp->rendezvous)) == NULL ||
        (jf->prefix = strdup(job->name)) == NULL ||
        (jf->host = strdup(sp->host)) == NULL ||
        (jf->running = calloc(cap, sizeof *jf->running)) == NULL ||
        (jf->threads = calloc(cap, sizeof *jf->threads)) == NULL) {
      if (jf) {
        free(jf->rendezvous);
        free(jf->prefix);
        free(jf->host);
        free(jf->running);
      }
      free(jf);
      snprintf(err, errlen, "out of memory");
      return SHARDD_E_NO_MEMORY;
    }
    shardd_err rc = shardd__job_set_layout(job, sp->nodes, sp->node_rank, err, errlen);
    if (rc != SHARDD_OK) {
      free(jf->rendezvous);
      free(jf->prefix);
      free(jf->host);
      free(jf->running);
      free(jf->threads);
      free(jf);
      return rc;
    }
    jf->srv = srv;
    jf->cap = cap;
    pthread_mutex_init(&jf->mu, NULL);
    pthread_cond_init(&jf->cv, NULL);
    shardd__map_init(&jf->counts);
    shardd__fabric_opts o = SHARDD__FABRIC_OPTS_INIT;
    o.rendezvous = jf->rendezvous;
    o.prefix = jf->prefix;
    o.host = jf->host;
    o.nodes = sp->nodes;
    o.node_rank = sp->node_rank;
    o.timeout_s = srv->opts.collective_timeout;
    jf->opts = o;
    job->fabric = jf;
    shardd__log(srv, 2,
                "job \"%s\": node %" PRIu32 " of %" PRIu32 ", ranks %" PRIu32
                "..%" PRIu32 " of %" PRIu32 ", rendezvous %s (%s)",
                job->name, job->node_rank, job->nodes, job->local_first,
                job->local_first + job->local_ranks - 1, job->world,
                sp->rendezvous, shardd__fabric_engine());
  }
  if (rank < job->world && !shardd__job_rank_local(job, rank)) {
    uint32_t node = rank / job->local_ranks;
    snprintf(err, errlen,
             "rank %" PRIu32 " of job \"%s\" belongs to node %" PRIu32
             " (ranks %" PRIu32 "..%" PRIu32 "); this daemon is node %" PRIu32
             " of %" PRIu32 " and holds ranks %" PRIu32 "..%" PRIu32,
             rank, job->name, node, node * job->local_ranks,
             (node + 1) * job->local_ranks - 1, job->node_rank, job->nodes,
             job->local_first, job->local_first + job->local_ranks - 1);
    return SHARDD_E_RANGE;
  }
  return SHARDD_OK;
}

void shardd__coll_node_state(shardd__job *job, uint32_t n, char *state,
                             size_t len) {
  jobfab *jf = job->fabric;
  const char *w = "up";
  if (n == job->node_rank)
    w = "this daemon";
  else if (jf) {
    pthread_mutex_lock(&jf->mu);
    w = jf->state == FAB_IDLE ? "not contacted"
        : jf->state == FAB_UP ? "up"
        : jf->at_rendezvous   ? "unreachable"
                              : "lost";
    pthread_mutex_unlock(&jf->mu);
  }
  snprintf(state, len, "%s", w);
}

void shardd__coll_fabric_state(shardd__job *job, char *engine, size_t elen,
                               char *msg, size_t mlen) {
  jobfab *jf = job->fabric;
  const char *e = shardd__fabric_engine();
  snprintf(engine, elen, "%s", jf && e ? e : "none");
  msg[0] = '\0';
  if (jf) {
    pthread_mutex_lock(&jf->mu);
    if (jf->state == FAB_FAILED)
      snprintf(msg, mlen, "%s", jf->msg);
    pthread_mutex_unlock(&jf->mu);
  }
}

enum { BULK_NONE, BULK_UP, BULK_FAILED };

typedef struct {
  coll *head;
  uint32_t count;
  /* the backend communicator of the job (comm_create). Only pool threads
   * take the mutex (creation may block for seconds); the loop reads the
   * state atomically, so it never waits for a communicator. */
  pthread_mutex_t bulk_mu;
  void *bulk_comm;
  atomic_int bulk_state;
} coll_queue;

static coll_queue *queue_of(shardd__job *job) {
  if (job->coll == NULL) {
    coll_queue *q = calloc(1, sizeof(coll_queue));
    if (q) {
      pthread_mutex_init(&q->bulk_mu, NULL);
      atomic_init(&q->bulk_state, BULK_NONE);
    }
    job->coll = q;
  }
  return job->coll;
}

uint32_t shardd__coll_inflight(const shardd__job *job) {
  const coll_queue *q = job->coll;
  return q ? q->count : 0;
}

void shardd__coll_job_free(shardd__job *job) {
  coll_queue *q = job->coll;
  if (q) {
    /* no collective runs (the caller checked coll_inflight), so no task
     * holds the communicator */
    shardd__backend *be = job->reg->backend;
    if (q->bulk_comm && be->ops->comm_destroy)
      be->ops->comm_destroy(be, q->bulk_comm);
    q->bulk_comm = NULL;
    pthread_mutex_destroy(&q->bulk_mu);
  }
  free(job->coll);
  job->coll = NULL;
  jf_free(job->fabric);
  job->fabric = NULL;
}

static const char *kind_word(shardd__coll_kind k) {
  switch (k) {
  case SHARDD__COLL_GATHER:
    return "gather";
  case SHARDD__COLL_SCATTER:
    return "scatter";
  case SHARDD__COLL_STEP:
    return "step";
  }
  return "collective";
}

static const char *target_word(shardd__coll_kind k) {
  return k == SHARDD__COLL_STEP ? "optimizer" : "buffer";
}

/* ---- lifetime --------------------------------------------------------- */

static void coll_unlink(coll *c) {
  coll_queue *q = c->job->coll;
  for (coll **pp = &q->head; *pp; pp = &(*pp)->next) {
    if (*pp == c) {
      *pp = c->next;
      q->count--;
      break;
    }
  }
  if (c->buf)
    c->buf->inflight--;
  if (c->opt) {
    c->opt->inflight--;
    for (size_t i = 0; i < c->opt->nshards; i++)
      c->opt->shards[i].buf->inflight--;
  }
}

static void coll_free(coll *c) {
  for (uint32_t r = 0; r < c->job->world; r++)
    if (c->waiters[r].s)
      c->waiters[r].s->pending--;
  free(c->waiters);
  free(c->tasks);
  free(c->hp);
  free(c);
}

/* Answers every rank still there with code/msg and forgets the collective. */
static void coll_finish(coll *c, shardd_err code, const char *msg) {
  coll_unlink(c);
  for (uint32_t r = 0; r < c->job->world; r++) {
    waiter *w = &c->waiters[r];
    if (w->s == NULL)
      continue;
    if (code == SHARDD_OK && c->args.kind == SHARDD__COLL_STEP) {
      Shardd__Response resp = SHARDD__RESPONSE__INIT;
      Shardd__StepReply sr = SHARDD__STEP_REPLY__INIT;
      resp.seq = w->seq;
      resp.code = SHARDD__STATUS_CODE__OK;
      sr.step = c->step;
      if (c->args.max_norm > 0) {
        sr.has_total_norm = 1;
        sr.total_norm = c->total_norm;
      }
      resp.body_case = SHARDD__RESPONSE__BODY_STEP;
      resp.step = &sr;
      shardd__session_send(w->s, &resp, -1);
    } else {
      shardd__session_reply(w->s, w->seq, code, msg);
    }
  }
  coll_free(c);
}

/* ---- conflicts and start ---------------------------------------------- */

static int coll_touches(const coll *c, const shardd__buffer *b) {
  if (c->buf)
    return c->buf == b;
  for (size_t i = 0; i < c->opt->nshards; i++)
    if (c->opt->shards[i].buf == b)
      return 1;
  return 0;
}

static int coll_conflict(const coll *older, const coll *c) {
  if (c->buf)
    return coll_touches(older, c->buf);
  for (size_t i = 0; i < c->opt->nshards; i++)
    if (coll_touches(older, c->opt->shards[i].buf))
      return 1;
  return 0;
}

static void start_phase(coll *c);

static void schedule(shardd__job *job) {
  coll_queue *q = job->coll;
  if (q == NULL)
    return;
  /* start_phase may finish and free c (and others) before it returns, so
   * after each start the scan begins again from the head. */
  for (int again = 1; again;) {
    again = 0;
    for (coll *c = q->head; c; c = c->next) {
      if (c->started || c->arrived < job->local_ranks)
        continue;
      int blocked = 0;
      for (coll *o = q->head; o != c; o = o->next)
        if (coll_conflict(o, c)) {
          blocked = 1;
          break;
        }
      if (!blocked) {
        c->started = 1;
        start_phase(c);
        again = 1;
        break;
      }
    }
  }
}

/* ---- work ------------------------------------------------------------- */

static void gather_task(coll *c, task *t) {
  shardd__backend *be = c->srv->backend;
  shardd__buffer *b = c->buf;
  size_t esz = shardd_dtype_size(b->dtype);
  uint64_t s = b->shard_numel;
  for (uint64_t pos = t->start, end = t->start + t->len;
       pos < end && t->rc == SHARDD_OK;) {
    uint64_t q = pos / s, off = pos % s;
    uint64_t n = s - off < end - pos ? s - off : end - pos;
    t->rc = be->ops->copy(be, b->blocks[t->a], b->gather_off + pos * esz,
                          b->blocks[q], b->shard_off + off * esz, n * esz);
    pos += n;
  }
}

static void scatter_task(coll *c, task *t) {
  shardd__backend *be = c->srv->backend;
  shardd__buffer *b = c->buf;
  size_t esz = shardd_dtype_size(b->dtype);
  uint32_t w = b->world;
  size_t *offs = malloc(w * sizeof *offs);
  if (offs == NULL) {
    t->rc = SHARDD_E_NO_MEMORY;
    return;
  }
  uint64_t first = t->b + t->start; /* element in the shard (b: the
                                       trainable range's start) */
  for (uint32_t r = 0; r < w; r++)
    offs[r] = b->grad_off + (t->a * b->shard_numel + first) * esz;
  float div = c->args.op == SHARDD_REDUCE_MEAN ? (float)w : 1.0f;
  t->rc = be->ops->reduce(be, b->dtype, div, b->blocks[t->a],
                          b->reduced_off + first * 4, b->blocks, offs,
                          (int)w, t->len);
  free(offs);
}

static void norm_task(coll *c, task *t) {
  shardd__backend *be = c->srv->backend;
  shardd__optim_shard *sh = &c->opt->shards[t->a];
  const shardd__seg *sg = &sh->segs[t->b];
  t->rc = be->ops->sumsq(be, sh->buf->blocks[sh->rank],
                         sh->buf->reduced_off + (sg->start + t->start) * 4,
                         t->len, &t->sumsq);
}

static void update_task(coll *c, task *t) {
  shardd__backend *be = c->srv->backend;
  shardd__optim_shard *sh = &c->opt->shards[t->a];
  const shardd__seg *sg = &sh->segs[t->b];
  shardd__buffer *b = sh->buf;
  shardd__region *blk = b->blocks[sh->rank];
  size_t esz = shardd_dtype_size(b->dtype);
  int wide = b->dtype != SHARDD_DTYPE_FP32;
  uint64_t first = sg->start + t->start; /* element index in the shard */
  if (wide && !sh->master_valid) {
    /* The trainer writes initial values into its shard after registering,
     * so the fp32 master copy is taken at the first step. */
    t->rc = be->ops->widen(be, b->dtype, sh->state, sh->master_off + first * 4,
                           blk, b->shard_off + first * esz, t->len);
    if (t->rc != SHARDD_OK)
      return;
  }
  size_t offs[3];
  for (int k = 0; k < 3; k++)
    offs[k] = sh->state_offs[k] + first * 4;
  t->rc = be->ops->update(be, &c->hp[sg->group], c->step, b->dtype, blk,
                          b->shard_off + first * esz, wide ? sh->state : NULL,
                          sh->master_off + first * 4, blk,
                          b->reduced_off + first * 4, c->grad_scale, sh->state,
                          offs, t->len);
}

/* ---- multi-node work (see the top of the file) ------------------------ */

static int multi(const coll *c) { return c->job->nodes > 1; }

/* gather stage 0: local shard a -> its place in the first local rank's
 * gather area */
static void mgather_pack(coll *c, task *t) {
  shardd__backend *be = c->srv->backend;
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
  shardd__backend *be = c->srv->backend;
  shardd__buffer *b = c->buf;
  size_t esz = shardd_dtype_size(b->dtype);
  uint32_t lo = c->job->local_first;
  t->rc = be->ops->copy(be, b->blocks[t->a], b->gather_off + t->start * esz,
                        b->blocks[lo], b->gather_off + t->start * esz,
                        t->len * esz);
}

/* scatter stage 0: staging = sum over local ranks' gradients (rank order) */
static void mscatter_sum(coll *c, task *t) {
  shardd__backend *be = c->srv->backend;
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
  shardd__backend *be = c->srv->backend;
  shardd__buffer *b = c->buf;
  float div = c->args.op == SHARDD_REDUCE_MEAN ? (float)b->world : 1.0f;
  uint64_t first = t->b + t->start; /* as in scatter_task */
  size_t off = (t->a * b->shard_numel + first) * 4;
  shardd__region *src = b->stage;
  t->rc = be->ops->reduce(be, SHARDD_DTYPE_FP32, div, b->blocks[t->a],
                          b->reduced_off + first * 4, &src, &off, 1, t->len);
}

/* What a node is about to exchange; every node's is allgathered first and
 * data moves only when all agree (see the top of the file). Fixed-width
 * fields and no padding, so the bytes compare as they are. */
typedef struct {
  uint32_t magic, kind;
  uint64_t name;  /* fab_key */
  uint64_t seq;   /* exchanges of this kind and target the node made before */
  uint64_t numel; /* the buffer's (0 for step) */
  uint64_t bytes; /* payload per node */
  uint32_t dtype, op;
  double value; /* step: the node's sum of squares; not compared */
} fab_hdr;

#define FAB_MAGIC 0x53484631u /* "SHF1": bump when the header changes */

_Static_assert(sizeof(fab_hdr) == 56, "fab_hdr must have no padding");

static const char *dtype_word(uint32_t dt) {
  const char *n = shardd_dtype_name((shardd_dtype)dt);
  return n ? n : "?";
}

static const char *op_word(uint32_t op) {
  return op == SHARDD_REDUCE_MEAN ? "mean" : op == SHARDD_REDUCE_SUM ? "sum" : "?";
}

/* 0 when every node's header matches this node's; else -1 and msg says
 * what the first node that differs has instead. */
static int fab_check(const coll *c, const fab_hdr *h, uint32_t nodes,
                     uint32_t me, char *msg, size_t len) {
  const fab_hdr *m = &h[me];
  const char *kw = kind_word(c->args.kind), *tw = target_word(c->args.kind);
  for (uint32_t n = 0; n < nodes; n++) {
    const fab_hdr *o = &h[n];
    if (n == me || memcmp(o, m, offsetof(fab_hdr, value)) == 0)
      continue;
    if (o->magic != m->magic)
      snprintf(msg, len,
               "node %" PRIu32 " speaks another version of the fabric protocol "
               "(header %#" PRIx32 ", this node %#" PRIx32 "): run the same "
               "shardd on every node",
               n, o->magic, m->magic);
    else if (o->kind != m->kind || o->name != m->name)
      snprintf(msg, len,
               "node %" PRIu32 " exchanged %s of another target where this node "
               "exchanged %s of %s \"%s\": two names share fabric tag %" PRIu32
               " and the nodes ran them in different orders",
               n, kind_word((shardd__coll_kind)o->kind), kw, tw, c->name, c->tag);
    else if (o->seq != m->seq)
      snprintf(msg, len,
               "node %" PRIu32 " is at its %s #%" PRIu64 " of %s \"%s\", this "
               "node at #%" PRIu64 ": the nodes' exchanges of it are out of "
               "step (one node skipped one), so they would pair the wrong "
               "calls; restart the job",
               n, kw, o->seq + 1, tw, c->name, m->seq + 1);
    else if (o->numel != m->numel || o->dtype != m->dtype || o->bytes != m->bytes)
      snprintf(msg, len,
               "node %" PRIu32 " has %s \"%s\" as %" PRIu64 " %s elements (%" PRIu64
               " bytes per node), this node as %" PRIu64 " %s (%" PRIu64 "): "
               "register it alike on every node",
               n, tw, c->name, o->numel, dtype_word(o->dtype), o->bytes, m->numel,
               dtype_word(m->dtype), m->bytes);
    else
      snprintf(msg, len,
               "node %" PRIu32 " reduces %s \"%s\" by %s, this node by %s: every "
               "rank must pass the same reduction",
               n, tw, c->name, op_word(o->op), op_word(m->op));
    return -1;
  }
  return 0;
}

/* The exchange of c, on a fabric thread: header, check, data. */
static void fabric_task(coll *c, task *t) {
  jobfab *jf = c->job->fabric;
  shardd__job *job = c->job;
  shardd__fabric *f;
  t->rc = jf_get(jf, &f, c->fab_msg, sizeof c->fab_msg);
  if (t->rc != SHARDD_OK)
    return;
  shardd__buffer *b = c->buf;
  uint64_t part = b ? (uint64_t)job->local_ranks * b->shard_numel : 0;
  fab_hdr *h = calloc(job->nodes, sizeof *h);
  if (h == NULL) {
    /* the peers wait for this node's header in vain: the fabric is lost */
    t->rc = SHARDD_E_NO_MEMORY;
    snprintf(c->fab_msg, sizeof c->fab_msg, "out of memory for the exchange header");
    jf_broken(jf, t->rc, c->fab_msg);
    return;
  }
  fab_hdr *m = &h[job->node_rank];
  m->magic = FAB_MAGIC;
  m->kind = (uint32_t)c->args.kind;
  m->name = c->name_key;
  m->seq = c->fab_seq;
  if (b) {
    m->numel = b->numel;
    m->dtype = (uint32_t)b->dtype;
    m->bytes = part * (c->args.kind == SHARDD__COLL_SCATTER
                           ? 4 /* the fp32 staging area */
                           : shardd_dtype_size(b->dtype));
    m->op = c->args.kind == SHARDD__COLL_SCATTER ? (uint32_t)c->args.op : 0;
  } else {
    m->value = c->sumsq_all;
  }
  t->rc = shardd__fabric_allgather(f, h, sizeof *h, c->tag, c->fab_msg,
                                   sizeof c->fab_msg);
  if (t->rc == SHARDD_OK &&
      fab_check(c, h, job->nodes, job->node_rank, c->fab_msg, sizeof c->fab_msg)) {
    /* every node saw the same headers and fails this one alike; the
     * connections are fine, so the fabric stays up */
    t->rc = SHARDD_E_MISMATCH;
    free(h);
    return;
  }
  if (t->rc == SHARDD_OK) {
    switch (c->args.kind) {
    case SHARDD__COLL_GATHER: {
      shardd__region *r = b->blocks[job->local_first];
      t->rc = shardd__fabric_allgather(f, (char *)r->ptr + b->gather_off,
                                       part * shardd_dtype_size(b->dtype), c->tag,
                                       c->fab_msg, sizeof c->fab_msg);
      break;
    }
    case SHARDD__COLL_SCATTER:
      t->rc = shardd__fabric_reduce_scatter_f32(f, (float *)b->stage->ptr, part,
                                                c->tag, c->fab_msg,
                                                sizeof c->fab_msg);
      break;
    case SHARDD__COLL_STEP: {
      /* in node order on every node, so all get the same bits */
      double sum = 0;
      for (uint32_t n = 0; n < job->nodes; n++)
        sum += h[n].value;
      c->sumsq_all = sum;
      break;
    }
    }
  }
  free(h);
  if (t->rc != SHARDD_OK)
    jf_broken(jf, t->rc, c->fab_msg);
}

/* ---- fabric threads (see the top of the file) ------------------------- */

static void after_work_cb(uv_work_t *req, int status);

static void fab_closed_cb(uv_handle_t *h) {
  coll *c = h->data;
  after_work_cb(&c->fab_task->req, 0);
}

static void fab_async_cb(uv_async_t *h) {
  uv_close((uv_handle_t *)h, fab_closed_cb);
}

/* The oldest queued exchange whose tag no thread is exchanging; under mu. */
static coll *fab_pick(jobfab *jf) {
  for (coll **pp = &jf->queue; *pp; pp = &(*pp)->fab_next) {
    coll *c = *pp;
    int busy = 0;
    for (uint32_t i = 0; i < jf->nrunning && !busy; i++)
      busy = jf->running[i] == c->tag;
    if (busy)
      continue;
    *pp = c->fab_next;
    c->fab_next = NULL;
    jf->nqueued--;
    return c;
  }
  return NULL;
}

static void *fab_thread(void *arg) {
  jobfab *jf = arg;
  pthread_mutex_lock(&jf->mu);
  for (;;) {
    coll *c = fab_pick(jf);
    if (c == NULL) {
      if (jf->stop)
        break;
      pthread_cond_wait(&jf->cv, &jf->mu);
      continue;
    }
    uint32_t tag = c->tag;
    jf->running[jf->nrunning++] = tag;
    pthread_mutex_unlock(&jf->mu);
    fabric_task(c, c->fab_task);
    pthread_mutex_lock(&jf->mu);
    for (uint32_t i = 0; i < jf->nrunning; i++)
      if (jf->running[i] == tag) {
        jf->running[i] = jf->running[--jf->nrunning];
        break;
      }
    pthread_cond_broadcast(&jf->cv); /* one of the same tag may go now */
    /* the last touch of c: from here the loop may free it */
    uv_async_send(&c->fab_async);
  }
  pthread_mutex_unlock(&jf->mu);
  return NULL;
}

/* Queues c's exchange (task t) for the job's fabric threads; loop thread.
 * The end always comes back through c->fab_async, failures too. */
static void fab_submit(coll *c, task *t) {
  jobfab *jf = c->job->fabric;
  c->fab_task = t;
  c->fab_async.data = c;
  int e = uv_async_init(c->srv->loop, &c->fab_async, fab_async_cb);
  if (e != 0) { /* cannot happen for a valid loop; fail it inline then */
    t->rc = SHARDD_E_INTERNAL;
    snprintf(c->fab_msg, sizeof c->fab_msg, "uv_async_init: %s", uv_strerror(e));
    after_work_cb(&t->req, 0);
    return;
  }
  int64_t seq = fab_next_seq(jf, c->name_key);
  if (seq < 0) {
    t->rc = SHARDD_E_NO_MEMORY;
    snprintf(c->fab_msg, sizeof c->fab_msg, "out of memory queueing the exchange");
    uv_async_send(&c->fab_async);
    return;
  }
  c->fab_seq = (uint64_t)seq;
  pthread_mutex_lock(&jf->mu);
  coll **tail = &jf->queue;
  while (*tail)
    tail = &(*tail)->fab_next;
  *tail = c;
  jf->nqueued++;
  /* a thread for every exchange, so none waits for another to end */
  if (jf->nthreads - jf->nrunning < jf->nqueued && jf->nthreads < jf->cap) {
    e = pthread_create(&jf->threads[jf->nthreads], NULL, fab_thread, jf);
    if (e == 0) {
      pthread_setname_np(jf->threads[jf->nthreads], "shardd-fabric");
      jf->nthreads++;
    } else if (jf->nthreads == 0) {
      *tail = NULL;
      jf->nqueued--;
      pthread_mutex_unlock(&jf->mu);
      t->rc = SHARDD_E_NO_MEMORY;
      snprintf(c->fab_msg, sizeof c->fab_msg, "cannot start a fabric thread: %s",
               strerror(e));
      uv_async_send(&c->fab_async);
      return;
    } else {
      shardd__log(c->srv, 1, "job \"%s\": cannot start fabric thread %" PRIu32
                  " (%s); the exchange waits for a busy one", c->job->name,
                  jf->nthreads + 1, strerror(e));
    }
  }
  pthread_cond_broadcast(&jf->cv);
  pthread_mutex_unlock(&jf->mu);
}

/* ---- whole collectives through the backend (see the top) ----------- */

/* Whether c runs as one bulk task; loop thread, when planning. */
static int bulk_ok(const coll *c) {
  const shardd__backend *be = c->srv->backend;
  const shardd__buffer *b = c->buf;
  if (b == NULL || multi(c) || be->ops->comm_create == NULL ||
      b->world != c->job->world || b->world < 2 ||
      b->world > (uint32_t)be->ndevices)
    return 0; /* world <= ndevices: rank r alone on device r */
  if (c->args.kind == SHARDD__COLL_GATHER ? be->ops->allgather == NULL
                                          : be->ops->reduce_scatter == NULL ||
                                                b->nfrozen_ranges != 0)
    return 0;
  coll_queue *q = c->job->coll;
  return atomic_load(&q->bulk_state) != BULK_FAILED;
}

/* The job's communicator, created at its first bulk task; NULL (and err
 * set) when it cannot be or an op failed on it before. */
static void *bulk_comm(coll *c, char *err, size_t errlen) {
  shardd__backend *be = c->srv->backend;
  coll_queue *q = c->job->coll;
  uint32_t w = c->buf->world;
  void *comm = NULL;
  pthread_mutex_lock(&q->bulk_mu);
  if (atomic_load(&q->bulk_state) == BULK_NONE) {
    int *devs = malloc(w * sizeof *devs);
    shardd_err rc = SHARDD_E_NO_MEMORY;
    snprintf(err, errlen, "out of memory");
    if (devs) {
      for (uint32_t r = 0; r < w; r++)
        devs[r] = shardd__rank_device(&c->srv->reg, r);
      rc = be->ops->comm_create(be, devs, (int)w, &q->bulk_comm, err, errlen);
      free(devs);
    }
    atomic_store(&q->bulk_state, rc == SHARDD_OK ? BULK_UP : BULK_FAILED);
    if (rc == SHARDD_OK)
      shardd__log(c->srv, 2, "job \"%s\": %s communicator over %" PRIu32
                  " devices", c->job->name, be->name, w);
  } else if (atomic_load(&q->bulk_state) == BULK_FAILED) {
    snprintf(err, errlen, "communicator failed before");
  }
  if (atomic_load(&q->bulk_state) == BULK_UP)
    comm = q->bulk_comm;
  pthread_mutex_unlock(&q->bulk_mu);
  return comm;
}

static void bulk_task(coll *c, task *t) {
  shardd__backend *be = c->srv->backend;
  shardd__buffer *b = c->buf;
  coll_queue *q = c->job->coll;
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
  shardd__log(c->srv, 1, "job \"%s\": %s of buffer %" PRIu64 " without the "
              "%s communicator (%s); copying rank by rank from now on",
              c->job->name, kind_word(c->args.kind), c->args.target, be->name,
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
      gather_task(c, &u);
    else
      scatter_task(c, &u);
    t->rc = u.rc;
  }
}

static void work_cb(uv_work_t *req) {
  task *t = req->data;
  coll *c = t->c;
  if (c->ntasks == 0) /* the empty task of a collective with no work */
    return;
  if (t->bulk) {
    bulk_task(c, t);
    return;
  }
  if (multi(c) && c->args.kind == SHARDD__COLL_GATHER) {
    if (c->stage == 0)
      mgather_pack(c, t);
    else
      mgather_fan(c, t);
    return;
  }
  if (multi(c) && c->args.kind == SHARDD__COLL_SCATTER) {
    if (c->stage == 0)
      mscatter_sum(c, t);
    else
      mscatter_own(c, t);
    return;
  }
  switch (c->args.kind) {
  case SHARDD__COLL_GATHER:
    gather_task(c, t);
    break;
  case SHARDD__COLL_SCATTER:
    scatter_task(c, t);
    break;
  case SHARDD__COLL_STEP:
    if (c->phase == 0)
      norm_task(c, t);
    else
      update_task(c, t);
    break;
  }
}

static void after_phase(coll *c) {
  for (size_t i = 0; i < c->ntasks; i++)
    if (c->tasks[i].rc != SHARDD_OK && c->rc == SHARDD_OK)
      c->rc = c->tasks[i].rc;
  shardd__job *job = c->job;
  if (c->rc != SHARDD_OK) {
    char msg[512];
    if (c->fab_msg[0])
      snprintf(msg, sizeof msg,
               "%s of %s %" PRIu64 " failed across the nodes of job \"%s\" "
               "(this daemon is node %" PRIu32 " of %" PRIu32 "): %s",
               kind_word(c->args.kind), target_word(c->args.kind),
               c->args.target, job->name, job->node_rank, job->nodes,
               c->fab_msg);
    else
      snprintf(msg, sizeof msg, "%s of %s %" PRIu64 " failed in the backend: %s",
               kind_word(c->args.kind), target_word(c->args.kind),
               c->args.target, shardd_strerror(c->rc));
    shardd__server *srv = c->srv;
    coll_finish(c, c->rc, msg);
    schedule(job);
    if (job->nclients == 0)
      shardd__server_job_idle(srv, job);
    return;
  }
  if (multi(c) && c->args.kind != SHARDD__COLL_STEP && c->stage < 2) {
    c->stage++;
    start_phase(c);
    return;
  }
  if (c->args.kind == SHARDD__COLL_STEP && c->phase == 0) {
    double sum = 0;
    for (size_t i = 0; i < c->ntasks; i++)
      sum += c->tasks[i].sumsq;
    if (multi(c)) {
      if (c->stage == 0) { /* the local sum of squares crosses nodes */
        c->sumsq_all = sum;
        c->stage = 1;
        start_phase(c);
        return;
      }
      sum = c->sumsq_all;
      c->stage = 0;
    }
    c->total_norm = sqrt(sum);
    /* As torch.nn.utils.clip_grad_norm_: coef clamped to 1, applied always. */
    double coef = c->args.max_norm / (c->total_norm + 1e-6);
    c->grad_scale = (float)(coef < 1.0 ? coef : 1.0);
    c->phase = 1;
    start_phase(c);
    return;
  }
  if (c->args.kind == SHARDD__COLL_GATHER) {
    c->buf->gathers++;
  } else if (c->args.kind == SHARDD__COLL_SCATTER) {
    c->buf->scatters++;
  } else {
    for (size_t i = 0; i < c->opt->nshards; i++)
      c->opt->shards[i].master_valid = 1;
    c->opt->steps = c->step;
  }
  shardd__server *srv = c->srv;
  coll_finish(c, SHARDD_OK, NULL);
  schedule(job);
  if (job->nclients == 0)
    shardd__server_job_idle(srv, job);
}

static void after_work_cb(uv_work_t *req, int status) {
  task *t = req->data;
  coll *c = t->c;
  if (status != 0 && t->rc == SHARDD_OK)
    t->rc = SHARDD_E_INTERNAL;
  if (--c->left == 0)
    after_phase(c);
}

/* Cuts unit (ua, ub) of len elements into chunk tasks; with out NULL only
 * counts them. */
static size_t add_unit(task *out, size_t n, size_t ua, size_t ub, uint64_t len) {
  for (uint64_t st = 0; st < len; st += CHUNK_ELEMS, n++) {
    if (out) {
      out[n].a = ua;
      out[n].b = ub;
      out[n].start = st;
      out[n].len = len - st < CHUNK_ELEMS ? len - st : CHUNK_ELEMS;
    }
  }
  return n;
}

/* Scatter units of owner rank r: its shard's trainable ranges (unit b =
 * the range's first element in the shard). Frozen elements get no work,
 * and a wholly frozen shard none at all. */
static size_t add_trainable_units(task *out, size_t n, const shardd__buffer *b,
                                  uint32_t r) {
  uint64_t lo = (uint64_t)r * b->shard_numel, hi = lo + b->shard_numel;
  if (b->nfrozen_ranges == 0)
    return add_unit(out, n, r, 0, b->shard_numel);
  uint64_t rs[64][2];
  for (uint64_t pos = lo; pos < hi;) {
    size_t k = shardd__buffer_trainable(b, pos, hi, rs, 64);
    size_t m = k < 64 ? k : 64;
    for (size_t i = 0; i < m; i++)
      n = add_unit(out, n, r, rs[i][0] - lo, rs[i][1]);
    if (k <= 64)
      break;
    pos = rs[63][0] + rs[63][1];
  }
  return n;
}

static size_t plan_tasks(coll *c, task *out) {
  size_t n = 0;
  if (multi(c) && c->stage == 1) {
    if (out)
      out[0].fabric = 1;
    return 1;
  }
  if (multi(c) && c->args.kind != SHARDD__COLL_STEP) {
    shardd__buffer *b = c->buf;
    uint32_t lo = c->job->local_first, hi = lo + c->job->local_ranks;
    if (c->args.kind == SHARDD__COLL_SCATTER && c->stage == 0)
      return add_unit(out, n, 0, 0, b->padded_numel);
    for (uint32_t r = lo; r < hi; r++) {
      if (c->args.kind == SHARDD__COLL_GATHER && c->stage == 2)
        n = r == lo ? n : add_unit(out, n, r, 0, b->padded_numel);
      else if (c->args.kind == SHARDD__COLL_SCATTER)
        n = add_trainable_units(out, n, b, r);
      else
        n = add_unit(out, n, r, 0, b->shard_numel);
    }
    return n;
  }
  if (c->args.kind == SHARDD__COLL_STEP) {
    for (size_t i = 0; i < c->opt->nshards; i++)
      for (size_t j = 0; j < c->opt->shards[i].nsegs; j++)
        n = add_unit(out, n, i, j, c->opt->shards[i].segs[j].len);
  } else if (c->bulk) {
    if (out)
      out[0].bulk = 1;
    return 1;
  } else {
    shardd__buffer *b = c->buf;
    for (uint32_t r = 0; r < b->world; r++)
      n = c->args.kind == SHARDD__COLL_GATHER
              ? add_unit(out, n, r, 0, b->padded_numel)
              : add_trainable_units(out, n, b, r);
  }
  return n;
}

static void start_phase(coll *c) {
  if (c->args.kind == SHARDD__COLL_STEP && c->phase == 0) {
    c->step = c->opt->steps + 1;
    c->grad_scale = 1.0f;
    if (!(c->args.max_norm > 0))
      c->phase = 1;
  }
  if (multi(c) && c->args.kind == SHARDD__COLL_SCATTER && c->stage == 0 &&
      c->buf->stage == NULL) {
    shardd__buffer *b = c->buf;
    shardd__registry *reg = &c->srv->reg;
    char why[256];
    shardd_err rc = reg->backend->ops->alloc(
        reg->backend, shardd__rank_device(reg, c->job->local_first),
        b->padded_numel * 4, "shardd:stage", &b->stage, why, sizeof why);
    if (rc != SHARDD_OK) {
      shardd__job *job = c->job;
      char msg[400];
      snprintf(msg, sizeof msg, "scatter of buffer %" PRIu64
               ": staging area for the cross-node sum: %s", c->args.target, why);
      coll_finish(c, rc, msg);
      schedule(job);
      return;
    }
    c->job->bytes += b->stage->bytes;
  }
  c->bulk = c->args.kind != SHARDD__COLL_STEP && bulk_ok(c);
  size_t n = plan_tasks(c, NULL);
  free(c->tasks);
  c->tasks = calloc(n ? n : 1, sizeof *c->tasks);
  if (c->tasks == NULL) {
    shardd__job *job = c->job;
    coll_finish(c, SHARDD_E_NO_MEMORY, "out of memory starting a collective");
    schedule(job);
    return;
  }
  plan_tasks(c, c->tasks);
  c->ntasks = n;
  c->left = n;
  if (n == 0) {
    /* Nothing to run (a wholly frozen scatter): one empty task still goes
     * through the pool, so completion (which may free c, and release the
     * job) happens on a later loop turn, never inside schedule(). */
    c->left = 1;
    c->tasks[0].c = c;
    c->tasks[0].req.data = &c->tasks[0];
    if (uv_queue_work(c->srv->loop, &c->tasks[0].req, work_cb, after_work_cb) != 0)
      after_work_cb(&c->tasks[0].req, 0);
    return;
  }
  for (size_t i = 0; i < n; i++) {
    task *t = &c->tasks[i];
    t->c = c;
    t->req.data = t;
    if (t->fabric) {
      fab_submit(c, t);
      continue;
    }
    int e = uv_queue_work(c->srv->loop, &t->req, work_cb, after_work_cb);
    if (e != 0) { /* cannot happen for a valid loop; run inline then */
      work_cb(&t->req);
      after_work_cb(&t->req, 0);
    }
  }
}

/* ---- submission ------------------------------------------------------- */

static int args_equal(const shardd__coll_args *a, const shardd__coll_args *b) {
  return a->kind == b->kind && a->target == b->target && a->op == b->op &&
         a->has_lr == b->has_lr && (!a->has_lr || a->lr == b->lr) &&
         a->max_norm == b->max_norm;
}

void shardd__coll_submit(shardd__server *srv, shardd__session *s, uint64_t seq,
                         const shardd__coll_args *args) {
  shardd__job *job = s->job;
  char err[256];
  shardd__obj *o;
  shardd__obj_kind want = args->kind == SHARDD__COLL_STEP ? SHARDD__OBJ_OPTIM
                                                          : SHARDD__OBJ_BUFFER;
  shardd_err rc = shardd__registry_resolve_gen(&srv->reg, job, args->target,
                                               args->kind == SHARDD__COLL_STEP
                                                   ? 0
                                                   : args->generation,
                                               want, &o, err, sizeof err);
  if (rc != SHARDD_OK) {
    shardd__session_reply(s, seq, rc, err);
    return;
  }
  if (args->kind == SHARDD__COLL_STEP &&
      ((args->has_lr && !(args->lr >= 0 && isfinite(args->lr))) ||
       !(args->max_norm >= 0 && isfinite(args->max_norm)))) {
    shardd__session_reply(s, seq, SHARDD_E_RANGE,
                          "step: lr must be >= 0 and max_norm >= 0, finite");
    return;
  }
  if (args->kind == SHARDD__COLL_GATHER && srv->opts.max_inflight_gathers > 0) {
    uint32_t n = 0;
    for (coll *it = job->coll ? ((coll_queue *)job->coll)->head : NULL; it; it = it->next)
      n += it->args.kind == SHARDD__COLL_GATHER && it->waiters[s->rank].s == s;
    if (n >= srv->opts.max_inflight_gathers) {
      snprintf(err, sizeof err,
               "rank %" PRIu32 " has %" PRIu32 " gathers in flight "
               "(--max-inflight-gathers %" PRIu32 ")",
               s->rank, n, srv->opts.max_inflight_gathers);
      shardd__session_reply(s, seq, SHARDD_E_LIMIT, err);
      return;
    }
  }
  if (s->pending >= srv->opts.max_pending) {
    snprintf(err, sizeof err,
             "session has %" PRIu32 " collectives queued (limit %" PRIu32 ")",
             s->pending, srv->opts.max_pending);
    shardd__session_reply(s, seq, SHARDD_E_LIMIT, err);
    return;
  }
  coll_queue *q = queue_of(job);
  if (q == NULL) {
    shardd__session_reply(s, seq, SHARDD_E_NO_MEMORY, "out of memory");
    return;
  }

  coll *c = NULL;
  for (coll *it = q->head; it; it = it->next) {
    if (it->args.kind == args->kind && it->args.target == args->target &&
        !it->started && !it->waiters[s->rank].arrived) {
      c = it;
      break;
    }
  }
  if (c && c->refused == SHARDD_OK && !args_equal(&c->args, args)) {
    snprintf(c->refused_msg, sizeof c->refused_msg,
             "rank %" PRIu32 " called %s on %s %" PRIu64
             " with other arguments than the ranks before it",
             s->rank, kind_word(args->kind), target_word(args->kind),
             args->target);
    /* The others agree with each other, not with this rank: all fail, as a
     * silent pick of one variant would train on mixed reductions. Ranks
     * still to come join this collective and are refused too once all have
     * arrived; answering only those here would leave the late ones waiting
     * for ranks that already moved on. */
    c->refused = SHARDD_E_MISMATCH;
  }
  if (c == NULL) {
    c = calloc(1, sizeof *c);
    if (c == NULL || (c->waiters = calloc(job->world, sizeof *c->waiters)) == NULL) {
      free(c);
      shardd__session_reply(s, seq, SHARDD_E_NO_MEMORY, "out of memory");
      return;
    }
    c->srv = srv;
    c->job = job;
    c->args = *args;
    c->deadline = shardd__server_now(srv) + srv->opts.collective_timeout;
    c->name_key = fab_key(args->kind, o->name);
    c->tag = fab_tag(c->name_key);
    c->name = o->name;
    if (args->kind == SHARDD__COLL_STEP) {
      c->opt = (shardd__optim *)o;
      c->hp = malloc((c->opt->ngroups ? c->opt->ngroups : 1) * sizeof *c->hp);
      if (c->hp == NULL) {
        free(c->waiters);
        free(c);
        shardd__session_reply(s, seq, SHARDD_E_NO_MEMORY, "out of memory");
        return;
      }
      for (size_t g = 0; g < c->opt->ngroups; g++) {
        c->hp[g] = c->opt->groups[g];
        if (args->has_lr)
          c->hp[g].lr = args->lr;
      }
      c->opt->inflight++;
      for (size_t i = 0; i < c->opt->nshards; i++)
        c->opt->shards[i].buf->inflight++;
    } else {
      c->buf = (shardd__buffer *)o;
      c->buf->inflight++;
    }
    coll **tail = &q->head;
    while (*tail)
      tail = &(*tail)->next;
    *tail = c;
    q->count++;
  }
  waiter *w = &c->waiters[s->rank];
  w->s = s;
  w->seq = seq;
  w->arrived = 1;
  s->pending++;
  c->arrived++;
  if (c->arrived == job->local_ranks) {
    if (c->refused != SHARDD_OK)
      coll_finish(c, c->refused, c->refused_msg); /* it may have held back newer ones */
    schedule(job);
  }
}

static void fail_waiting(shardd__job *job, shardd_err code,
                         int (*pick)(coll *c, void *arg), void *arg,
                         void (*describe)(coll *c, void *arg, char *msg,
                                          size_t len)) {
  coll_queue *q = job->coll;
  if (q == NULL)
    return;
  for (coll *c = q->head, *next; c; c = next) {
    next = c->next;
    if (c->started || !pick(c, arg))
      continue;
    char msg[512];
    describe(c, arg, msg, sizeof msg);
    coll_finish(c, code, msg);
    /* coll_finish may only unlink c; `next` stays valid. */
  }
  schedule(job);
}

static int pick_all(coll *c, void *arg) { return 1; }

static void describe_lost(coll *c, void *arg, char *msg, size_t len) {
  const shardd__session *s = arg;
  snprintf(msg, len,
           "rank %" PRIu32 " of job \"%s\" disconnected before %s of %s %" PRIu64
           " completed; no shard was changed",
           s->rank, c->job->name, kind_word(c->args.kind),
           target_word(c->args.kind), c->args.target);
}

void shardd__coll_session_lost(shardd__server *srv, shardd__session *s) {
  shardd__job *job = s->job;
  if (job == NULL || job->coll == NULL)
    return;
  coll_queue *q = job->coll;
  /* Running collectives finish (their inputs were complete); they just
   * must not answer a session that is gone. */
  for (coll *c = q->head; c; c = c->next) {
    if (c->started && c->waiters[s->rank].s == s) {
      c->waiters[s->rank].s = NULL;
      s->pending--;
    }
  }
  /* Unstarted ones can never complete: this rank will not join them. The
   * lost rank's own request is answered too (harmless on a closing
   * session) so its pending count returns to zero. */
  for (coll *c = q->head; c; c = c->next)
    if (!c->started && c->waiters[s->rank].s == s) {
      c->waiters[s->rank].s = NULL;
      s->pending--;
    }
  fail_waiting(job, SHARDD_E_PEER_LOST, pick_all, s, describe_lost);
}

typedef struct {
  double now;
} tick_arg;

static int pick_expired(coll *c, void *arg) {
  const tick_arg *t = arg;
  return c->arrived < c->job->local_ranks && t->now >= c->deadline;
}

static void describe_expired(coll *c, void *arg, char *msg, size_t len) {
  int n = snprintf(msg, len,
                   "%s of %s %" PRIu64 " timed out after %.0f s waiting for rank",
                   kind_word(c->args.kind), target_word(c->args.kind),
                   c->args.target, c->srv->opts.collective_timeout);
  const char *sep = "s ";
  uint32_t missing = c->job->local_ranks - c->arrived;
  if (missing == 1)
    sep = " ";
  uint32_t lo = c->job->local_first, hi = lo + c->job->local_ranks;
  for (uint32_t r = lo; r < hi && n > 0 && (size_t)n < len; r++) {
    if (c->waiters[r].arrived)
      continue;
    n += snprintf(msg + n, len - (size_t)n, "%s%" PRIu32, sep, r);
    sep = ", ";
  }
}

static void tick_job(shardd__job *job, void *arg) {
  if (job->coll)
    fail_waiting(job, SHARDD_E_PEER_LOST, pick_expired, arg, describe_expired);
}

void shardd__coll_tick(shardd__server *srv, double now) {
  tick_arg t = {now};
  shardd__registry_each_job(&srv->reg, tick_job, &t);
}
