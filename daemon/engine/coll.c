/* coll.c — the collective engine (see coll.h): the engine and its jobs'
 * queues, a collective's lifetime and its answers, the order in which
 * queued collectives start.
 *
 * A collective is created by the first rank that asks for it and joined by
 * the others (coll_submit.c); a rank joins the oldest collective of the
 * same kind and target it has not joined yet, so a rank that runs ahead
 * queues behind. Once every rank has arrived, it starts when no older
 * collective in the job's queue touches the same buffers, so one buffer's
 * collectives run in submission order (shardd__coll_schedule). Its phases
 * (coll_phase.c) are split into tasks (chunks of the rank shards) that
 * libuv's pool turns claim one by one, and for a small collective on host
 * memory the loop thread too, or alone, completing it on the same loop
 * turn (coll_run.c); tasks only touch region memory,
 * and the completion count is kept on the loop thread
 * (shardd__coll_task_done). Ranks lost, the grace, timeouts and the stop
 * are coll_members.c's.
 *
 * coll_work.c plans and runs the tasks, coll_bulk.c runs a whole
 * collective through the backend, coll_fabric.c crosses nodes. */
#include "coll_int.h"

#include <sched.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

coll_job *shardd__coll_job_of(shardd__coll_engine *e, shardd__job *job,
                              int create) {
  coll_job *cj = shardd__map_get_id(&e->jobs, shardd__coll_job_key(job));
  if (cj || !create)
    return cj;
  if ((cj = calloc(1, sizeof *cj)) == NULL)
    return NULL;
  cj->e = e;
  cj->job = job;
  pthread_mutex_init(&cj->bulk_mu, NULL);
  atomic_init(&cj->bulk_state, BULK_NONE);
  if (shardd__map_put_id(&e->jobs, shardd__coll_job_key(job), cj) != SHARDD_OK) {
    pthread_mutex_destroy(&cj->bulk_mu);
    free(cj);
    return NULL;
  }
  return cj;
}

shardd_err shardd__coll_engine_create(const shardd__coll_config *cfg,
                                      shardd__coll_engine **out) {
  shardd__coll_engine *e = calloc(1, sizeof *e);
  *out = e;
  if (e == NULL)
    return SHARDD_E_NO_MEMORY;
  e->cfg = *cfg;
  e->be = cfg->reg->backend;
  /* the CPUs this process may run on, and the pool's threads as libuv
   * counts them (atoi of UV_THREADPOOL_SIZE, 0 as 1, at most 1024;
   * unset: 4) */
  cpu_set_t set;
  int cpus = sched_getaffinity(0, sizeof set, &set) == 0 ? CPU_COUNT(&set) : 0;
  if (cpus < 1)
    cpus = (int)sysconf(_SC_NPROCESSORS_ONLN);
  const char *tp = getenv("UV_THREADPOOL_SIZE");
  int pool = tp ? atoi(tp) : 4;
  e->cpus = (size_t)(cpus < 1 ? 1 : cpus);
  e->workers = (size_t)(pool < 1 ? 1 : pool > 1024 ? 1024 : pool);
  shardd__map_init(&e->jobs);
  e->fin_tailp = &e->fin_head;
  /* with a second CPU, a thread to split big buckets with the loop
   * (coll_helper.c); without it, pool turns do */
  if (e->cpus > 1 && getenv("SHARDD_NO_HELPER") == NULL)
    (void)shardd__coll_helper_start(cfg->loop, &e->helper);
  return SHARDD_OK;
}

void shardd__coll_engine_stop(shardd__coll_engine *e) { e->stopping = 1; }

static void free_job_cb(void *value, void *arg) {
  coll_job *cj = value;
  shardd__coll_engine *e = arg;
  if (e->sched_due == cj)
    e->sched_due = NULL;
  shardd__coll_bulk_free(cj);
  shardd__coll_fab_free(e, cj->fab);
  free(cj->lost_at);
  free(cj->lost_epoch);
  free(cj->lost_told);
  free(cj->lost_ranks);
  free(cj->lost_pos);
  free(cj->unjoined);
  free(cj);
}

void shardd__coll_engine_destroy(shardd__coll_engine *e) {
  if (e == NULL)
    return;
  shardd__coll_helper_stop(e->helper);
  e->helper = NULL;
  shardd__map_each(&e->jobs, free_job_cb, e);
  shardd__map_free(&e->jobs);
  while (e->spare) {
    void *next = *(void **)e->spare;
    free(e->spare);
    e->spare = next;
  }
  free(e);
}

uint32_t shardd__coll_inflight(const shardd__coll_engine *e,
                               const shardd__job *job) {
  const coll_job *cj = shardd__map_get_id(&e->jobs, shardd__coll_job_key(job));
  return cj ? cj->count : 0;
}

int shardd__coll_gathering(const shardd__coll_engine *e,
                           const shardd__buffer *b) {
  const coll_job *cj = shardd__map_get_id(&e->jobs, shardd__coll_job_key(b->hdr.job));
  for (const coll *c = cj ? cj->head : NULL; c; c = c->next)
    if (c->started && c->buf == b && c->args.kind == SHARDD__COLL_GATHER)
      return 1;
  return 0;
}

int shardd__coll_scattering(const shardd__coll_engine *e,
                             const shardd__buffer *b, uint32_t rank) {
  const coll_job *cj = shardd__map_get_id(&e->jobs, shardd__coll_job_key(b->hdr.job));
  for (const coll *c = cj ? cj->head : NULL; c; c = c->next)
    if (c->buf == b && c->args.kind == SHARDD__COLL_SCATTER &&
        rank < c->job->world && c->waiters[rank].arrived)
      return c->started ? 2 : 1;
  return 0;
}

int shardd__coll_member_waits(const shardd__coll_engine *e,
                              const shardd__coll_member *m, uint64_t seq) {
  const coll_job *cj = m->job ? shardd__map_get_id(&e->jobs, shardd__coll_job_key(m->job)) : NULL;
  for (const coll *c = cj ? cj->head : NULL; c; c = c->next)
    if (c->waiters[m->rank].m == m && c->waiters[m->rank].seq == seq)
      return 1;
  return 0;
}

void shardd__coll_job_free(shardd__coll_engine *e, shardd__job *job) {
  coll_job *cj = shardd__map_del_id(&e->jobs, shardd__coll_job_key(job));
  if (cj && e->batch_cj == cj) {
    e->batch_job = NULL;
    e->batch_cj = NULL;
  }
  if (cj)
    free_job_cb(cj, e);
}

const char *shardd__coll_kind_word(shardd__coll_kind k) {
  switch (k) {
  case SHARDD__COLL_GATHER:
    return "gather";
  case SHARDD__COLL_SCATTER:
    return "scatter";
  case SHARDD__COLL_STEP:
    return "step";
  case SHARDD__COLL_ALL_REDUCE:
    return "all_reduce";
  }
  return "collective";
}

const char *shardd__coll_target_word(shardd__coll_kind k) {
  if (k == SHARDD__COLL_ALL_REDUCE)
    return "values, count"; /* "all_reduce of values, count 3" */
  return k == SHARDD__COLL_STEP ? "optimizer" : "buffer";
}

/* ---- lifetime --------------------------------------------------------- */

static void coll_unlink(coll *c) {
  coll_job *q = c->cj;
  for (coll **pp = &q->head; *pp; pp = &(*pp)->next) {
    if (*pp == c) {
      *pp = c->next;
      if (q->tailp == &c->next)
        q->tailp = pp;
      if (--q->count == 0)
        q->quiet_due = 1;
      q->unlinked++;
      for (uint32_t r = 0; q->unjoined && r < c->job->world; r++)
        if (q->unjoined[r] == c)
          q->unjoined[r] = c->next;
      break;
    }
  }
  if (c->buf)
    shardd__buffer_release_hold(c->buf);
  if (c->opt)
    shardd__optim_release_hold(c->opt);
}

static int cmp_rank(const void *a, const void *b) {
  uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;
  return (x > y) - (x < y);
}

/* c's arrived ranks in rank order: they are answered in it, as when every
 * waiter was walked. */
static void sort_order(coll *c) {
  if (c->arrived > 16) {
    qsort(c->order, c->arrived, sizeof *c->order, cmp_rank);
    return;
  }
  /* a few ranks (each entry of a bucket sorts its own): in place, without
   * qsort's calls through a comparison function */
  for (uint32_t i = 1; i < c->arrived; i++) {
    uint32_t r = c->order[i], j = i;
    for (; j > 0 && c->order[j - 1] > r; j--)
      c->order[j] = c->order[j - 1];
    c->order[j] = r;
  }
}

static void coll_free(coll *c) {
  for (uint32_t i = 0; i < c->arrived; i++) { /* no other waiter is set */
    waiter *w = &c->waiters[c->order[i]];
    if (w->m)
      w->m->pending--;
    free(w->vals);
    free(w->no_grad);
  }
  free(c->reduced);
  free(c->ref_step);
  free(c->fab_mask);
  free(c->fab_mask_ids);
  if (c->tasks != c->few_tasks)
    free(c->tasks);
  free(c->hp);
  /* and its waiters and area arrays (submit_new), kept for the next */
  shardd__coll_engine *e = c->e;
  size_t bytes = c->alloc_bytes;
  if (bytes >= COLL_MAP_BYTES) {
    munmap(c, bytes);
    return;
  }
  if (bytes > COLL_SPARE_BYTES ||
      (e->nspare >= COLL_SPARE_MAX && e->spare_size == bytes)) {
    free(c);
    return;
  }
  if (e->spare_size != bytes) { /* another world's: the newest size stays */
    while (e->spare) {
      void *next = *(void **)e->spare;
      free(e->spare);
      e->spare = next;
    }
    e->nspare = 0;
    e->spare_size = bytes;
  }
  *(void **)c = e->spare;
  e->spare = c;
  e->nspare++;
}

void *shardd__coll_block_get(shardd__coll_engine *e, size_t bytes, int *zeroed) {
  *zeroed = 0;
  if (bytes >= COLL_MAP_BYTES) {
    void *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED)
      return NULL;
    *zeroed = 1;
    return p;
  }
  if (e->spare == NULL || e->spare_size != bytes)
    return malloc(bytes);
  void *p = e->spare;
  e->spare = *(void **)p;
  e->nspare--;
  e->counters.reused++;
  return p;
}

/* Transient areas after c ended: a failed gather gives back what it leased;
 * a scatter that ran consumed the gradients; a rank that left mid-way has
 * its areas of the buffer back (dispatch returns the rest when it leaves,
 * but a collective held this buffer then). */
static void settle_areas(coll *c, shardd_err code) {
  shardd__job *job = c->job;
  if (c->refused != SHARDD_OK) /* it ran the exchange's header at most */
    return;
  for (uint32_t r = job->local_first; r < job->local_first + job->local_ranks; r++) {
    const waiter *w = &c->waiters[r];
    if (c->args.kind == SHARDD__COLL_GATHER && code != SHARDD_OK) {
      if (c->took[r] & 1)
        shardd__area_return(c->buf, r, SHARDD__AREA_GATHER);
      if (c->took[r] & 2)
        shardd__area_return(c->buf, r, SHARDD__AREA_GRAD);
    }
    if (c->args.kind == SHARDD__COLL_SCATTER && code == SHARDD_OK && c->started)
      shardd__area_return(c->buf, r, SHARDD__AREA_GRAD);
    if (w->arrived && w->m == NULL && c->started) {
      shardd__area_return(c->buf, r, SHARDD__AREA_GATHER);
      shardd__area_return(c->buf, r, SHARDD__AREA_GRAD);
    }
  }
}

/* Answers every rank still there with code/msg and forgets the collective. */
void shardd__coll_finish(coll *c, shardd_err code, const char *msg) {
  if (c->step_begun && c->e->cfg.hooks.step_end) {
    c->step_begun = 0;
    c->e->cfg.hooks.step_end(c->e->cfg.hooks.ctx, c->job, c->opt, c->step,
                             code);
  }
  coll_unlink(c);
  sort_order(c);
  for (uint32_t i = 0; i < c->arrived; i++) {
    uint32_t r = c->order[i];
    waiter *w = &c->waiters[r];
    if (w->m == NULL)
      continue;
    const shardd__coll_hooks *h = &c->e->cfg.hooks;
    shardd__coll_result res;
    memset(&res, 0, sizeof res);
    res.kind = c->args.kind;
    res.target = c->args.target;
    if (code == SHARDD_OK && c->args.kind == SHARDD__COLL_ALL_REDUCE) {
      res.values = c->reduced;
      res.nvalues = (uint32_t)c->args.target;
      h->done(h->ctx, w->m, w->seq, code, NULL, &res);
    } else if (code == SHARDD_OK && c->args.kind == SHARDD__COLL_STEP) {
      res.step = c->step;
      res.has_total_norm = c->args.max_norm > 0 || c->args.norm_only;
      res.total_norm = c->total_norm;
      h->done(h->ctx, w->m, w->seq, code, NULL, &res);
    } else if (code == SHARDD_OK && c->args.kind == SHARDD__COLL_GATHER &&
               c->job->transient &&
               shardd__area_held(c->buf, r, SHARDD__AREA_GATHER, &res.gather)) {
      res.has_grad = shardd__area_held(c->buf, r, SHARDD__AREA_GRAD, &res.grad);
      h->done(h->ctx, w->m, w->seq, code, NULL, &res);
    } else {
      h->done(h->ctx, w->m, w->seq, code, msg, w->in_bucket ? &res : NULL);
    }
  }
  if (c->buf && c->job->transient)
    settle_areas(c, code);
  if (c->areas_busy) /* its tasks ended: a rank that left gets its areas */
    shardd__areas_idle(c->buf);
  coll_free(c);
}

/* ---- conflicts and the start order ------------------------------------ */

/* An all_reduce touches no buffer: it waits for nothing older and holds
 * nothing back. */
static int coll_touches(const coll *c, const shardd__buffer *b) {
  if (c->buf)
    return c->buf == b;
  if (c->opt == NULL)
    return 0;
  for (size_t i = 0; i < c->opt->nshards; i++)
    if (c->opt->shards[i].buf == b)
      return 1;
  return 0;
}

static int coll_conflict(const coll *older, const coll *c) {
  if (c->buf)
    return coll_touches(older, c->buf);
  if (c->opt == NULL)
    return 0;
  for (size_t i = 0; i < c->opt->nshards; i++)
    if (coll_touches(older, c->opt->shards[i].buf))
      return 1;
  return 0;
}

/* The buffers the collectives before the one being looked at touch, for
 * schedule_run: one lookup where comparing with each older one was a
 * pass over the queue per collective (a bucket's 64 entries, 2016 pairs).
 * Open addressing by address; past half full it gives up (full) and the
 * pass compares pairs, as it always did. */
#define SEEN_SLOTS 256

typedef struct {
  const shardd__buffer *slot[SEEN_SLOTS];
  size_t n;
  int full;
} seen_bufs;

static size_t seen_at(const seen_bufs *s, const shardd__buffer *b) {
  uint64_t h = (uint64_t)(uintptr_t)b * 0x9e3779b97f4a7c15ull;
  size_t i = (size_t)(h >> 56); /* SEEN_SLOTS = 2^8 */
  while (s->slot[i] && s->slot[i] != b)
    i = (i + 1) % SEEN_SLOTS;
  return i;
}

static void seen_add(seen_bufs *s, const shardd__buffer *b) {
  if (s->full)
    return;
  size_t i = seen_at(s, b);
  if (s->slot[i])
    return;
  if (s->n >= SEEN_SLOTS / 2) {
    s->full = 1;
    return;
  }
  s->slot[i] = b;
  s->n++;
}

/* What coll_touches says of b for some collective added. */
static void seen_add_coll(seen_bufs *s, const coll *c) {
  if (c->buf)
    seen_add(s, c->buf);
  else if (c->opt)
    for (size_t i = 0; i < c->opt->nshards; i++)
      seen_add(s, c->opt->shards[i].buf);
}

/* Whether a collective before c conflicts with it (coll_conflict with
 * each), the older ones being those added to s. */
static int seen_blocks(const seen_bufs *s, const coll_job *q, const coll *c) {
  if (s->full) {
    for (const coll *o = q->head; o != c; o = o->next)
      if (coll_conflict(o, c))
        return 1;
    return 0;
  }
  if (c->buf)
    return s->slot[seen_at(s, c->buf)] != NULL;
  for (size_t i = 0; c->opt && i < c->opt->nshards; i++)
    if (s->slot[seen_at(s, c->opt->shards[i].buf)])
      return 1;
  return 0;
}

static void schedule_run(coll_job *q) {
  shardd__job *job = q->job;
  shardd__coll_counters *n = &q->e->counters;
  n->sched_passes++;
  /* start_phase may finish and free c (and others) before it returns:
   * then the scan begins again from the head. When nothing left the
   * queue meanwhile, c is still there and the scan goes on after it
   * (starting c, newer than the ones before it, unblocks none of them):
   * a bucket's entries start in one pass, not one from the head each. */
  seen_bufs seen;
  for (int again = 1; again;) {
    again = 0;
    /* a short queue compares its few pairs (no table to clear) */
    if (q->count > 8)
      memset(&seen, 0, sizeof seen);
    else
      seen.full = 1;
    for (coll *c = q->head; c; c = c->next) {
      n->sched_visits++;
      if (c->started || c->arrived < job->local_ranks) {
        seen_add_coll(&seen, c);
        continue;
      }
      int blocked = seen_blocks(&seen, q, c);
      seen_add_coll(&seen, c);
      if (!blocked) {
        c->started = 1;
        /* fixed here, as a step queued before may consume what is held */
        if (c->args.kind == SHARDD__COLL_SCATTER)
          c->adding = c->args.accumulate && c->buf->reduced_live;
        uint64_t unlinked = q->unlinked;
        shardd__coll_start_phase(c);
        if (q->unlinked != unlinked) {
          again = 1;
          break;
        }
      }
    }
  }
}

void shardd__coll_schedule(coll_job *q) {
  shardd__coll_engine *e = q->e;
  if (e->sched_hold > 0 && (e->sched_due == NULL || e->sched_due == q)) {
    e->sched_due = q;
    return;
  }
  schedule_run(q);
}

void shardd__coll_sched_hold(shardd__coll_engine *e) { e->sched_hold++; }

void shardd__coll_sched_flush(shardd__coll_engine *e) {
  coll_job *q = e->sched_due;
  e->sched_due = NULL;
  if (q)
    schedule_run(q);
}

void shardd__coll_sched_release(shardd__coll_engine *e) {
  if (e->sched_hold == 0 || --e->sched_hold > 0)
    return;
  coll_job *q = e->sched_due;
  shardd__coll_sched_flush(e);
  if (q)
    shardd__coll_job_maybe_quiet(q);
}

void shardd__coll_get_counters(const shardd__coll_engine *e,
                               shardd__coll_counters *out) {
  *out = e->counters;
}

/* Tells the owner of q's job that its last collective ended (completed,
 * failed, refused, timed out or lost); called last by each entry point, as
 * the hook may release the job, and never inside a walk over the queue. */
void shardd__coll_job_maybe_quiet(coll_job *q) {
  if (q->count == 0 && q->e->sched_due == q)
    q->e->sched_due = NULL; /* an empty queue has nothing to start */
  if (q->count == 0 && q->quiet_due) {
    q->quiet_due = 0;
    const shardd__coll_hooks *h = &q->e->cfg.hooks;
    if (h->job_quiet)
      h->job_quiet(h->ctx, q->job);
  }
}

/* Answers every rank of c still there with code/msg now and forgets them
 * (as if they left), while c itself goes on: its exchange still runs for
 * the other nodes' sake. How many were answered. */
uint32_t shardd__coll_answer_now(coll *c, shardd_err code, const char *msg) {
  const shardd__coll_hooks *h = &c->e->cfg.hooks;
  uint32_t n = 0;
  sort_order(c);
  for (uint32_t i = 0; i < c->arrived; i++) {
    waiter *w = &c->waiters[c->order[i]];
    if (w->m == NULL)
      continue;
    shardd__coll_result res;
    memset(&res, 0, sizeof res);
    res.kind = c->args.kind;
    res.target = c->args.target;
    h->done(h->ctx, w->m, w->seq, code, msg, w->in_bucket ? &res : NULL);
    w->m->pending--; /* coll_free must not count it again */
    w->m = NULL;
    n++;
  }
  return n;
}

double shardd__coll_loop_now(const shardd__coll_engine *e) {
  return (double)uv_now(e->cfg.loop) / 1000.0;
}
