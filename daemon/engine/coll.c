/* coll.c — the collective engine (see coll.h): queue, matching, phases,
 * timeouts and completion.
 *
 * A collective is created by the first rank that asks for it and joined by
 * the others; a rank joins the oldest collective of the same kind and
 * target it has not joined yet, so a rank that runs ahead queues behind.
 * Once every rank has arrived, it starts when no older collective in the
 * job's queue touches the same buffers, so one buffer's collectives run in
 * submission order. The work is split into tasks (chunks of the rank
 * shards) that libuv's pool turns claim one by one, and for a small
 * collective on host memory the loop thread too (run_claimed); tasks only
 * touch region memory, and the completion count is kept on the loop thread
 * (shardd__coll_task_done).
 *
 * coll_work.c plans and runs the tasks, coll_bulk.c runs a whole
 * collective through the backend, coll_fabric.c crosses nodes. */
#include "coll_int.h"

#include <inttypes.h>
#include <math.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "log.h"
#include "validate.h"

/* Jobs are kept by address: the engine's state of a job lives from its
 * first collective (or span) to shardd__coll_job_free, which the owner of
 * the job calls before every release, so an address is never reused while
 * its entry exists. */
static uint64_t job_key(const shardd__job *job) {
  return (uint64_t)(uintptr_t)job;
}

coll_job *shardd__coll_job_of(shardd__coll_engine *e, shardd__job *job,
                              int create) {
  coll_job *cj = shardd__map_get_id(&e->jobs, job_key(job));
  if (cj || !create)
    return cj;
  if ((cj = calloc(1, sizeof *cj)) == NULL)
    return NULL;
  cj->e = e;
  cj->job = job;
  pthread_mutex_init(&cj->bulk_mu, NULL);
  atomic_init(&cj->bulk_state, BULK_NONE);
  if (shardd__map_put_id(&e->jobs, job_key(job), cj) != SHARDD_OK) {
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
  return SHARDD_OK;
}

void shardd__coll_engine_stop(shardd__coll_engine *e) { e->stopping = 1; }

static void free_job_cb(void *value, void *arg) {
  coll_job *cj = value;
  shardd__coll_engine *e = arg;
  shardd__coll_bulk_free(cj);
  shardd__coll_fab_free(e, cj->fab);
  free(cj->lost_at);
  free(cj->lost_epoch);
  free(cj->lost_told);
  free(cj);
}

void shardd__coll_engine_destroy(shardd__coll_engine *e) {
  if (e == NULL)
    return;
  shardd__map_each(&e->jobs, free_job_cb, e);
  shardd__map_free(&e->jobs);
  free(e);
}

uint32_t shardd__coll_inflight(const shardd__coll_engine *e,
                               const shardd__job *job) {
  const coll_job *cj = shardd__map_get_id(&e->jobs, job_key(job));
  return cj ? cj->count : 0;
}

int shardd__coll_gathering(const shardd__coll_engine *e,
                           const shardd__buffer *b) {
  const coll_job *cj = shardd__map_get_id(&e->jobs, job_key(b->hdr.job));
  for (const coll *c = cj ? cj->head : NULL; c; c = c->next)
    if (c->started && c->buf == b && c->args.kind == SHARDD__COLL_GATHER)
      return 1;
  return 0;
}

int shardd__coll_member_waits(const shardd__coll_engine *e,
                              const shardd__coll_member *m, uint64_t seq) {
  const coll_job *cj = m->job ? shardd__map_get_id(&e->jobs, job_key(m->job)) : NULL;
  for (const coll *c = cj ? cj->head : NULL; c; c = c->next)
    if (c->waiters[m->rank].m == m && c->waiters[m->rank].seq == seq)
      return 1;
  return 0;
}

void shardd__coll_job_free(shardd__coll_engine *e, shardd__job *job) {
  coll_job *cj = shardd__map_del_id(&e->jobs, job_key(job));
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
      break;
    }
  }
  if (c->buf)
    shardd__buffer_release_hold(c->buf);
  if (c->opt)
    shardd__optim_release_hold(c->opt);
}

static void coll_free(coll *c) {
  for (uint32_t r = 0; r < c->job->world; r++) {
    if (c->waiters[r].m)
      c->waiters[r].m->pending--;
    free(c->waiters[r].vals);
    free(c->waiters[r].no_grad);
  }
  free(c->waiters);
  free(c->reduced);
  free(c->ref_step);
  free(c->fab_mask);
  free(c->fab_mask_ids);
  free(c->tasks);
  free(c->hp);
  free(c->area_reg);
  free(c->area_off);
  free(c->took);
  free(c);
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
    if (c->args.kind == SHARDD__COLL_GATHER && code != SHARDD_OK && c->took) {
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
static void coll_finish(coll *c, shardd_err code, const char *msg) {
  coll_unlink(c);
  for (uint32_t r = 0; r < c->job->world; r++) {
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
      h->done(h->ctx, w->m, w->seq, code, msg, c->args.bucket ? &res : NULL);
    }
  }
  if (c->buf && c->job->transient)
    settle_areas(c, code);
  if (c->areas_busy) /* its tasks ended: a rank that left gets its areas */
    shardd__areas_idle(c->buf);
  coll_free(c);
}

/* ---- conflicts and start ---------------------------------------------- */

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

static void start_phase(coll *c);

static void schedule(coll_job *q) {
  shardd__job *job = q->job;
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
        /* fixed here, as a step queued before may consume what is held */
        if (c->args.kind == SHARDD__COLL_SCATTER)
          c->adding = c->args.accumulate && c->buf->reduced_live;
        start_phase(c);
        again = 1;
        break;
      }
    }
  }
}

/* Tells the owner of q's job that its last collective ended (completed,
 * failed, refused, timed out or lost); called last by each entry point, as
 * the hook may release the job, and never inside a walk over the queue. */
static void job_maybe_quiet(coll_job *q) {
  if (q->count == 0 && q->quiet_due) {
    q->quiet_due = 0;
    const shardd__coll_hooks *h = &q->e->cfg.hooks;
    if (h->job_quiet)
      h->job_quiet(h->ctx, q->job);
  }
}

/* Whether rank r's scatter brought a gradient for view id (its mask is
 * sorted). */
static int rank_had(const waiter *w, uint64_t id) {
  if (w->none_all)
    return 0;
  size_t lo = 0, hi = w->nno_grad;
  while (lo < hi) {
    size_t mid = lo + (hi - lo) / 2;
    if (w->no_grad[mid] < id)
      lo = mid + 1;
    else
      hi = mid;
  }
  return !(lo < w->nno_grad && w->no_grad[lo] == id);
}

/* Whether some local rank sent a mask with its scatter. */
static int any_mask(const coll *c) {
  const shardd__job *job = c->job;
  for (uint32_t r = job->local_first; r < job->local_first + job->local_ranks; r++)
    if (c->waiters[r].none_all || c->waiters[r].nno_grad)
      return 1;
  return 0;
}

/* Multi-node scatter, before its exchange: this node's row of c->fab_mask,
 * each view (and last the buffer) 1 when a local rank had its gradient. */
shardd_err shardd__coll_mask_row(coll *c) {
  shardd__buffer *b = c->buf;
  shardd__job *job = c->job;
  shardd__view **vs;
  size_t nv;
  if (shardd__buffer_views(b, &vs, &nv) != SHARDD_OK)
    return SHARDD_E_NO_MEMORY;
  c->nmask = nv;
  c->fab_mask = calloc((size_t)job->nodes * (nv + 1), 1);
  c->fab_mask_ids = malloc((nv ? nv : 1) * sizeof *c->fab_mask_ids);
  if (c->fab_mask == NULL || c->fab_mask_ids == NULL) {
    free(vs);
    return SHARDD_E_NO_MEMORY;
  }
  uint8_t *row = c->fab_mask + (size_t)job->node_rank * (nv + 1);
  int masked = any_mask(c);
  uint32_t lo = job->local_first, hi = lo + job->local_ranks;
  for (size_t k = 0; k <= nv; k++) {
    if (k < nv)
      c->fab_mask_ids[k] = vs[k]->hdr.id;
    int had = !masked;
    for (uint32_t r = lo; r < hi && !had; r++)
      had = k < nv ? rank_had(&c->waiters[r], vs[k]->hdr.id) : !c->waiters[r].none_all;
    row[k] = (uint8_t)had;
  }
  free(vs);
  return SHARDD_OK;
}

typedef struct {
  const coll *c;
  int masked; /* some local rank sent a mask */
  int adding; /* an accumulating scatter: what earlier ones saw stays seen */
} mask_arg;

static void mask_view_cb(void *value, void *arg) {
  shardd__view *v = value;
  const mask_arg *a = arg;
  const shardd__job *job = a->c->job;
  int had = !a->masked;
  for (uint32_t r = job->local_first;
       r < job->local_first + job->local_ranks && !had; r++)
    had = rank_had(&a->c->waiters[r], v->hdr.id);
  v->grad_seen = had || (a->adding && v->grad_seen);
  v->buf->masked |= !v->grad_seen;
}

/* After a scatter of c's buffer: which of its views (and the buffer, for a
 * whole-buffer ref) had a gradient on some rank, of this node from each
 * rank's mask, of the other nodes from the rows their exchange brought. */
static void apply_grad_mask(coll *c) {
  shardd__buffer *b = c->buf;
  shardd__job *job = c->job;
  uint32_t lo = job->local_first, hi = lo + job->local_ranks;
  if (shardd__coll_multi(c)) {
    size_t n = c->nmask;
    int was_seen = b->grad_seen;
    b->masked = 0;
    b->grad_seen = 0;
    for (size_t k = 0; c->fab_mask && k <= n; k++) {
      int had = 0;
      for (uint32_t node = 0; node < job->nodes; node++)
        had |= c->fab_mask[(size_t)node * (n + 1) + k];
      if (k == n) {
        b->grad_seen = had || (c->adding && was_seen);
        break;
      }
      /* a view unregistered since is gone; one registered since had none
       * of the exchange and keeps what it had */
      shardd__obj *o = shardd__registry_get(c->e->cfg.reg, c->fab_mask_ids[k]);
      if (o && o->kind == SHARDD__OBJ_VIEW && ((shardd__view *)o)->buf == b) {
        shardd__view *v = (shardd__view *)o;
        v->grad_seen = had || (c->adding && v->grad_seen);
        b->masked |= !v->grad_seen;
      }
    }
    if (c->fab_mask == NULL)
      b->grad_seen = 1;
    return;
  }
  int masked = any_mask(c);
  uint32_t none_all = 0;
  for (uint32_t r = lo; r < hi; r++)
    none_all += c->waiters[r].none_all != 0;
  b->grad_seen = !masked || none_all < job->local_ranks ||
                 (c->adding && b->grad_seen);
  if (!masked && !b->masked)
    return; /* every view had one before and has one now */
  b->masked = 0;
  mask_arg a = {c, masked, c->adding};
  shardd__map_each(&b->views, mask_view_cb, &a);
}

/* Answers every rank of c still there with code/msg now and forgets them
 * (as if they left), while c itself goes on: its exchange still runs for
 * the other nodes' sake. How many were answered. */
static uint32_t answer_now(coll *c, shardd_err code, const char *msg) {
  const shardd__coll_hooks *h = &c->e->cfg.hooks;
  uint32_t n = 0;
  for (uint32_t r = 0; r < c->job->world; r++) {
    waiter *w = &c->waiters[r];
    if (w->m == NULL)
      continue;
    shardd__coll_result res;
    memset(&res, 0, sizeof res);
    res.kind = c->args.kind;
    res.target = c->args.target;
    h->done(h->ctx, w->m, w->seq, code, msg, c->args.bucket ? &res : NULL);
    w->m->pending--; /* coll_free must not count it again */
    w->m = NULL;
    n++;
  }
  return n;
}

/* What a rank hears of c failing in its cross-node exchange for why. */
static void fabric_failure(const coll *c, const char *why, char *msg, size_t len) {
  snprintf(msg, len,
           "%s of %s %" PRIu64 " failed across the nodes of job \"%s\" "
           "(this daemon is node %" PRIu32 " of %" PRIu32 "): %s",
           shardd__coll_kind_word(c->args.kind), shardd__coll_target_word(c->args.kind),
           c->args.target, c->job->name, c->job->node_rank, c->job->nodes, why);
}

static void after_phase(coll *c) {
  for (size_t i = 0; i < c->ntasks; i++)
    if (c->tasks[i].rc != SHARDD_OK && c->rc == SHARDD_OK)
      c->rc = c->tasks[i].rc;
  if (c->rc != SHARDD_OK) {
    char msg[512];
    if (c->fab_msg[0])
      fabric_failure(c, c->fab_msg, msg, sizeof msg);
    else
      snprintf(msg, sizeof msg, "%s of %s %" PRIu64 " failed in the backend: %s",
               shardd__coll_kind_word(c->args.kind), shardd__coll_target_word(c->args.kind),
               c->args.target, shardd_strerror(c->rc));
    coll_job *q = c->cj;
    coll_finish(c, c->rc, msg);
    schedule(q);
    job_maybe_quiet(q);
    return;
  }
  if (shardd__coll_multi(c) && c->args.kind != SHARDD__COLL_STEP &&
      c->args.kind != SHARDD__COLL_ALL_REDUCE && c->stage < 2) {
    c->stage++;
    coll_job *q = c->cj; /* c may be freed by start_phase */
    start_phase(c);
    job_maybe_quiet(q);
    return;
  }
  if (c->args.kind == SHARDD__COLL_STEP && c->phase == 0) {
    double sum = 0;
    for (size_t i = 0; i < c->ntasks; i++)
      sum += c->tasks[i].sumsq;
    if (shardd__coll_multi(c)) {
      if (c->stage == 0) { /* the local sum of squares crosses nodes */
        c->sumsq_all = sum;
        c->stage = 1;
        coll_job *q = c->cj;
        start_phase(c);
        job_maybe_quiet(q);
        return;
      }
      sum = c->sumsq_all;
      c->stage = 0;
    }
    /* the norm of the gradients as a pending clip left them */
    c->total_norm = sqrt(sum) * (double)c->grad_scale;
    /* As torch.nn.utils.clip_grad_norm_: coef clamped to 1, applied always;
     * a second clip multiplies the first's. */
    if (c->args.max_norm > 0) {
      double coef = c->args.max_norm / (c->total_norm + 1e-6);
      c->grad_scale *= (float)(coef < 1.0 ? coef : 1.0);
    }
    if (c->args.norm_only) {
      if (c->args.max_norm > 0) {
        c->opt->clip_pending = 1;
        c->opt->clip_scale = c->grad_scale;
      }
      coll_job *q = c->cj;
      coll_finish(c, SHARDD_OK, NULL);
      schedule(q);
      job_maybe_quiet(q);
      return;
    }
    c->phase = 1;
    coll_job *q = c->cj; /* c may be freed by start_phase */
    start_phase(c);
    job_maybe_quiet(q);
    return;
  }
  if (c->args.kind == SHARDD__COLL_ALL_REDUCE) {
    /* computed at the start; nothing of the registry changes */
  } else if (c->args.kind == SHARDD__COLL_GATHER) {
    c->buf->gathers++;
  } else if (c->args.kind == SHARDD__COLL_SCATTER) {
    c->buf->scatters++;
    apply_grad_mask(c);
    c->buf->reduced_live = 1;
  } else {
    c->opt->clip_pending = 0;
    for (size_t i = 0; i < c->opt->nshards; i++) {
      c->opt->shards[i].master_valid = 1;
      c->opt->shards[i].buf->settled = 1;
      shardd__buffer_seed_drop(c->e->cfg.reg, c->opt->shards[i].buf);
      c->opt->shards[i].buf->reduced_live = 0;
    }
    for (size_t i = 0; i < c->opt->nrefs; i++) {
      const shardd__obj *r = c->opt->refs[i];
      if (c->ref_step[i])
        c->opt->ref_steps[i] = c->ref_step[i];
      /* consumed: the next step applies only a newer scatter's gradient */
      c->opt->ref_scatters[i] = r->kind == SHARDD__OBJ_VIEW
                                    ? ((const shardd__view *)r)->buf->scatters
                                    : ((const shardd__buffer *)r)->scatters;
    }
    c->opt->steps = c->step;
  }
  coll_job *q = c->cj;
  coll_finish(c, SHARDD_OK, NULL);
  schedule(q);
  job_maybe_quiet(q);
}

void shardd__coll_task_done(uv_work_t *req, int status) {
  task *t = req->data;
  coll *c = t->c;
  /* a claiming turn the loop cancelled found every task claimed (run_claimed) */
  if (status != 0 && !(c->claiming && status == UV_ECANCELED) &&
      t->rc == SHARDD_OK)
    t->rc = SHARDD_E_INTERNAL;
  if (--c->left == 0)
    after_phase(c);
}

/* Where each rank's side of c's buffer is: the resident areas of its
 * block, or (transient job) the areas it leases now, for a gather, or
 * holds, for a scatter. A rank over its leases fails the whole gather
 * (what this one leased is given back when it ends). */
static shardd_err set_areas(coll *c, char *msg, size_t len) {
  shardd__buffer *b = c->buf;
  shardd__job *job = c->job;
  uint32_t w = job->world;
  c->area_reg = calloc(w, sizeof *c->area_reg);
  c->area_off = calloc(w, sizeof *c->area_off);
  c->took = calloc(w, sizeof *c->took);
  if (c->area_reg == NULL || c->area_off == NULL || c->took == NULL) {
    snprintf(msg, len, "out of memory starting a collective");
    return SHARDD_E_NO_MEMORY;
  }
  int gather = c->args.kind == SHARDD__COLL_GATHER;
  for (uint32_t r = job->local_first; r < job->local_first + job->local_ranks; r++) {
    if (!job->transient) {
      c->area_reg[r] = b->blocks[r];
      c->area_off[r] = gather ? b->gather_off : b->grad_off;
      continue;
    }
    shardd__area a;
    char why[384];
    int took = 0;
    shardd_err rc = SHARDD_OK;
    if (gather) {
      rc = shardd__area_lease(c->e->cfg.reg, b, r, SHARDD__AREA_GATHER, &a,
                              &took, why, sizeof why);
      c->took[r] |= took ? 1 : 0;
      shardd__area g;
      if (rc == SHARDD_OK && c->waiters[r].want_grad) {
        rc = shardd__area_lease(c->e->cfg.reg, b, r, SHARDD__AREA_GRAD, &g,
                                &took, why, sizeof why);
        c->took[r] |= took ? 2 : 0;
      }
    } else if (!shardd__area_held(b, r, SHARDD__AREA_GRAD, &a)) {
      snprintf(why, sizeof why, "rank %" PRIu32 " holds no gradient area of "
               "it: gather it with want_grad first", r);
      rc = SHARDD_E_STATE;
    }
    if (rc != SHARDD_OK) {
      snprintf(msg, len, "%s of buffer %" PRIu64 " (\"%s\"): %s",
               shardd__coll_kind_word(c->args.kind), c->args.target,
               b->hdr.name, why);
      return rc;
    }
    c->area_reg[r] = a.pool;
    c->area_off[r] = a.off;
  }
  return SHARDD_OK;
}

/* The all_reduce of c's values, element-wise over the local ranks in rank
 * order, so every rank gets the same bits (a NaN anywhere stays NaN, as in
 * torch.distributed). A few scalars: done on the loop. */
static shardd_err reduce_values(coll *c) {
  uint32_t n = (uint32_t)c->args.target;
  const shardd__job *job = c->job;
  c->reduced = malloc((n ? n : 1) * sizeof *c->reduced);
  if (c->reduced == NULL)
    return SHARDD_E_NO_MEMORY;
  for (uint32_t i = 0; i < n; i++) {
    double acc = 0;
    for (uint32_t r = job->local_first; r < job->local_first + job->local_ranks; r++) {
      double v = c->waiters[r].vals[i];
      acc = r == job->local_first ? v
                                  : shardd__coll_combine((int)c->args.op, acc, v);
    }
    if (c->args.op == SHARDD_REDUCE_MEAN)
      acc /= (double)job->world;
    c->reduced[i] = acc;
  }
  return SHARDD_OK;
}

static void run_phase(coll *c);

static void start_phase(coll *c) {
  if (c->refused != SHARDD_OK) {
    /* multi-node, refused here (single-node refusals end at arrival): it
     * still takes part in the exchange's header, marked refused, so the
     * other nodes fail it naming this node instead of waiting for it */
    c->stage = 1;
    run_phase(c);
    return;
  }
  if (c->args.kind == SHARDD__COLL_ALL_REDUCE && c->reduced == NULL &&
      reduce_values(c) != SHARDD_OK) {
    coll_job *q = c->cj;
    coll_finish(c, SHARDD_E_NO_MEMORY, "out of memory starting a collective");
    schedule(q);
    return;
  }
  /* multi-node: the local reduction is this node's part of the exchange,
   * which is all there is to do (no fan-out: the result is c->reduced) */
  if (c->args.kind == SHARDD__COLL_ALL_REDUCE && shardd__coll_multi(c))
    c->stage = 1;
  if (c->args.kind == SHARDD__COLL_STEP && c->phase == 0 && c->ref_step == NULL) {
    shardd__optim *o = c->opt;
    c->ref_step = calloc(o->nrefs ? o->nrefs : 1, sizeof *c->ref_step);
    if (c->ref_step == NULL) {
      coll_job *q = c->cj;
      coll_finish(c, SHARDD_E_NO_MEMORY, "out of memory starting a step");
      schedule(q);
      return;
    }
    for (size_t i = 0; i < o->nrefs; i++) {
      const shardd__obj *r = o->refs[i];
      const shardd__buffer *b = r->kind == SHARDD__OBJ_VIEW
                                    ? ((const shardd__view *)r)->buf
                                    : (const shardd__buffer *)r;
      int on = r->kind == SHARDD__OBJ_VIEW
                   ? ((const shardd__view *)r)->requires_grad &&
                         ((const shardd__view *)r)->grad_seen
                   : b->grad_seen;
      /* no scatter since its last step: its reduced gradient was applied
       * already (torch: .grad is None after zero_grad) */
      on = on && b->scatters != o->ref_scatters[i];
      c->ref_step[i] = on ? o->ref_steps[i] + 1 : 0;
    }
  }
  if (c->args.kind == SHARDD__COLL_STEP && c->phase == 0 && c->stage == 0) {
    c->step = c->opt->steps + (c->args.norm_only ? 0 : 1);
    /* a clip since the last step scales this one's gradients */
    c->grad_scale = c->opt->clip_pending ? c->opt->clip_scale : 1.0f;
    /* a multi-node step always exchanges its header (the parameters each
     * node steps with are compared), with the norms only when clipping */
    if (!(c->args.max_norm > 0) && !c->args.norm_only && !shardd__coll_multi(c))
      c->phase = 1;
  }
  if (shardd__coll_multi(c) && c->args.kind == SHARDD__COLL_SCATTER && c->stage == 0 &&
      c->buf->stage == NULL) {
    char why[256];
    shardd_err rc = shardd__buffer_stage(c->e->cfg.reg, c->buf, why, sizeof why);
    if (rc != SHARDD_OK) {
      coll_job *q = c->cj;
      char msg[400];
      snprintf(msg, sizeof msg, "scatter of buffer %" PRIu64
               ": staging area for the cross-node sum: %s", c->args.target, why);
      coll_finish(c, rc, msg);
      schedule(q);
      return;
    }
  }
  if (shardd__coll_multi(c) && c->args.kind == SHARDD__COLL_SCATTER &&
      c->stage == 1 && c->fab_mask == NULL && shardd__coll_mask_row(c) != SHARDD_OK) {
    /* the exchange's header says so, and every node fails it alike */
    free(c->fab_mask);
    c->fab_mask = NULL;
  }
  if (c->buf && c->area_reg == NULL) {
    char msg[512];
    shardd_err rc = set_areas(c, msg, sizeof msg);
    if (rc != SHARDD_OK) {
      coll_job *q = c->cj;
      coll_finish(c, rc, msg);
      schedule(q);
      return;
    }
    if (c->job->transient) {
      shardd__areas_busy(c->buf);
      c->areas_busy = 1;
    }
  }
  run_phase(c);
}

/* ---- running the tasks ------------------------------------------------ */

/* Bytes a collective may move and still run as one pool task: below it
 * the per-task cost (a pool wake-up and a loop wake-up each) outweighs
 * spreading the copies over the workers. */
#define SMALL_COLL_BYTES ((uint64_t)256 << 10)

/* Bytes up to which the loop thread claims a collective's tasks too, on a
 * backend whose memory it can touch: it is awake when the last rank
 * arrives, while a pool thread takes a wake-up (tens of microseconds on a
 * virtual machine, as long as copying a few hundred KiB) to start, and
 * the loop another to hear it ended. Bounded, as the loop serves every
 * other session meanwhile: about 0.2 ms of copying. */
#define LOOP_HELP_BYTES ((uint64_t)4 << 20)

/* The bytes c's gather or scatter moves over all its ranks; 0 otherwise. */
static uint64_t coll_bytes(const coll *c) {
  if (c->buf == NULL || shardd__coll_multi(c) || c->bulk ||
      (c->args.kind != SHARDD__COLL_GATHER && c->args.kind != SHARDD__COLL_SCATTER))
    return 0;
  return c->buf->padded_numel * shardd_dtype_size(c->buf->dtype) * c->job->world;
}

/* Whether c is a single-node gather or scatter of a small buffer (every
 * rank's side of it together under SMALL_COLL_BYTES). */
static int small_coll(const coll *c) {
  uint64_t bytes = coll_bytes(c);
  return bytes > 0 && bytes <= SMALL_COLL_BYTES;
}

/* Whether the loop thread claims tasks of a collective of bytes, taking
 * them from its budget: LOOP_HELP_BYTES for the request being submitted
 * (the last rank's arrival starts the collective), over every collective
 * it starts, a bucket's entries included (64 entries of 4 MiB would
 * otherwise copy hundreds of MiB there while every other session waits).
 * Collectives started by another's completion get none: the pool runs
 * them, as their ranks are not the ones waiting on this callback. */
static int loop_helps(shardd__coll_engine *e, uint64_t bytes) {
  if (!(e->be->caps & SHARDD__BACKEND_CAP_HOST_MAPPED) || bytes == 0 ||
      bytes > e->help_left)
    return 0;
  e->help_left -= bytes;
  return 1;
}

/* Starts c's tasks as claims: `turns` pool turns (queued on the reqs of
 * tasks[0..turns)) each run the next unclaimed task until none is left,
 * and so does the loop thread first when help is set; the turns no pool
 * thread had started by then are cancelled (their after-work callback
 * comes on the next loop turn, UV_ECANCELED). Completion stays on a later
 * loop turn, never inside schedule(). */
static void run_claimed(coll *c, size_t turns, int help) {
  c->claiming = 1;
  atomic_store(&c->claim, 0);
  c->left = turns;
  for (size_t i = 0; i < turns; i++)
    /* fails only without a work callback (UV_EINVAL) */
    (void)uv_queue_work(c->e->cfg.loop, &c->tasks[i].req, shardd__coll_work,
                        shardd__coll_task_done);
  if (!help)
    return;
  shardd__coll_claim_run(c);
  /* UV_EBUSY for a turn a pool thread took: it finds no task left */
  for (size_t i = 0; i < turns; i++)
    (void)uv_cancel((uv_req_t *)&c->tasks[i].req);
}

/* A bucket's small collectives, started together (shardd__coll_batch_end):
 * like one collective's claimed tasks, each turn runs the next unclaimed
 * collective's tasks until none is left; the collectives complete when
 * every turn has ended (or was cancelled). */
#define BATCH_TURNS 4

static void batch_start(shardd__coll_engine *e);

typedef struct {
  uv_work_t turns[BATCH_TURNS];
  size_t nturns, left, n;
  atomic_size_t claim;
  coll *colls[]; /* [n], in start order */
} coll_batch;

static void batch_run(coll_batch *b) {
  size_t i;
  while ((i = atomic_fetch_add_explicit(&b->claim, 1, memory_order_relaxed)) < b->n)
    shardd__coll_work(&b->colls[i]->tasks[0].req);
}

static void batch_work(uv_work_t *req) { batch_run(req->data); }

static void batch_done(uv_work_t *req, int status) {
  coll_batch *b = req->data;
  (void)status; /* a cancelled turn found every collective claimed */
  if (--b->left > 0)
    return;
  /* each completion may free its coll and start others: b is the list */
  for (size_t i = 0; i < b->n; i++)
    shardd__coll_task_done(&b->colls[i]->tasks[0].req, 0);
  free(b);
}

void shardd__coll_batch_begin(shardd__coll_engine *e) {
  if (e->batching++ == 0)
    e->help_left = LOOP_HELP_BYTES; /* the bucket's request's budget */
}

void shardd__coll_batch_end(shardd__coll_engine *e) {
  if (e->batching == 0 || --e->batching > 0)
    return;
  batch_start(e);
  e->help_left = 0;
}

/* Starts the small collectives listed while batching (their request's
 * budget still set). */
static void batch_start(shardd__coll_engine *e) {
  if (e->batch_head == NULL)
    return;
  size_t n = e->nbatch;
  coll *list = e->batch_head;
  e->batch_head = NULL;
  e->nbatch = 0;
  coll_batch *b = malloc(sizeof *b + n * sizeof(coll *));
  if (b == NULL) {
    /* out of memory: each alone, its tasks grouped on tasks[0] */
    for (coll *c = list; c; c = c->batch_next)
      (void)uv_queue_work(e->cfg.loop, &c->tasks[0].req, shardd__coll_work,
                          shardd__coll_task_done);
    return;
  }
  /* in start order (the list is newest first) */
  uint64_t bytes = 0;
  size_t i = n;
  for (coll *c = list; c; c = c->batch_next) {
    b->colls[--i] = c;
    bytes += coll_bytes(c);
  }
  b->n = n;
  atomic_init(&b->claim, 0);
  b->nturns = n < BATCH_TURNS ? n : BATCH_TURNS;
  if (b->nturns > e->cpus)
    b->nturns = e->cpus;
  b->left = b->nturns;
  for (size_t k = 0; k < b->nturns; k++) {
    b->turns[k].data = b;
    /* fails only without a work callback (UV_EINVAL) */
    (void)uv_queue_work(e->cfg.loop, &b->turns[k], batch_work, batch_done);
  }
  if (!loop_helps(e, bytes))
    return;
  batch_run(b);
  /* UV_EBUSY for a turn a pool thread took: it finds nothing left */
  for (size_t k = 0; k < b->nturns; k++)
    (void)uv_cancel((uv_req_t *)&b->turns[k]);
}

/* Plans c's phase and starts its tasks (on the pool, or the exchange on a
 * fabric thread). */
static void run_phase(coll *c) {
  c->bulk = c->args.kind != SHARDD__COLL_STEP && c->refused == SHARDD_OK &&
            shardd__coll_bulk_ok(c);
  c->claiming = 0;
  int planned = c->args.kind != SHARDD__COLL_ALL_REDUCE || shardd__coll_multi(c);
  size_t n = planned ? shardd__coll_plan(c, NULL) : 0;
  free(c->tasks);
  c->tasks = calloc(n ? n : 1, sizeof *c->tasks);
  if (c->tasks == NULL) {
    coll_job *q = c->cj;
    coll_finish(c, SHARDD_E_NO_MEMORY, "out of memory starting a collective");
    schedule(q);
    return;
  }
  if (planned)
    shardd__coll_plan(c, c->tasks);
  c->ntasks = n;
  c->left = n;
  if (n == 0) {
    /* Nothing to run (a wholly frozen scatter, an all_reduce): one empty task still goes
     * through the pool, so completion (which may free c, and release the
     * job) happens on a later loop turn, never inside schedule(). */
    c->left = 1;
    c->tasks[0].c = c;
    c->tasks[0].req.data = &c->tasks[0];
    if (uv_queue_work(c->e->cfg.loop, &c->tasks[0].req, shardd__coll_work,
                      shardd__coll_task_done) != 0)
      shardd__coll_task_done(&c->tasks[0].req, 0);
    return;
  }
  for (size_t i = 0; i < n; i++) {
    c->tasks[i].c = c;
    c->tasks[i].req.data = &c->tasks[i];
  }
  if (small_coll(c) && c->e->batching) {
    /* a bucket's entry: it runs with the bucket's other small collectives
     * (shardd__coll_batch_end), its tasks grouped on tasks[0] */
    c->left = 1;
    c->tasks[0].group = n;
    c->batch_next = c->e->batch_head;
    c->e->batch_head = c;
    c->e->nbatch++;
    return;
  }
  if (!shardd__coll_multi(c) && !c->bulk) {
    /* one claiming turn for a small buffer (the pool's round trip per
     * task cost more than its copies), else one per worker */
    int help = loop_helps(c->e, coll_bytes(c));
    size_t turns = small_coll(c) ? 1 : help ? c->e->cpus : c->e->workers;
    run_claimed(c, n < turns ? n : turns, help);
    return;
  }
  for (size_t i = 0; i < n; i++) {
    task *t = &c->tasks[i];
    if (t->fabric) {
      shardd__coll_fab_submit(c, t);
      continue;
    }
    if (uv_queue_work(c->e->cfg.loop, &t->req, shardd__coll_work,
                      shardd__coll_task_done) != 0) {
      /* cannot happen for a valid loop; run inline then */
      shardd__coll_work(&t->req);
      shardd__coll_task_done(&t->req, 0);
    }
  }
}

/* ---- lost ranks ------------------------------------------------------- */

static double loop_now(const shardd__coll_engine *e);

/* The missing rank that dooms unstarted c at now, or -1: a rank lost past
 * the grace that had not submitted c, while a rank waiting in c joined
 * before that loss (it was the lost one's peer, so it will not be back
 * for c). Ranks that joined after the loss (a job relaunched rank by rank)
 * wait for it as at the job's start. */
static int64_t doomed_by(const coll *c, double now) {
  const coll_job *q = c->cj;
  const shardd__job *job = c->job;
  if (c->started || q->lost_at == NULL)
    return -1;
  double grace = c->e->cfg.peer_grace;
  for (uint32_t r = job->local_first; r < job->local_first + job->local_ranks; r++) {
    if (q->lost_at[r] < 0 || c->waiters[r].arrived || now < q->lost_at[r] + grace)
      continue;
    for (uint32_t k = job->local_first; k < job->local_first + job->local_ranks; k++) {
      const shardd__coll_member *m = c->waiters[k].m;
      if (m && m->joined < q->lost_epoch[r])
        return r;
    }
  }
  return -1;
}

/* Fails c, which rank r dooms, naming r; the first failure of each loss is
 * logged (a loss that fails nothing, a job's ranks leaving at its end, is
 * only the session's line). */
static void fail_doomed_one(coll *c, uint32_t r, double now) {
  coll_job *q = c->cj;
  double gone = now - q->lost_at[r];
  char msg[512];
  snprintf(msg, sizeof msg,
           "rank %" PRIu32 " of job \"%s\" disconnected %.1f s ago and did "
           "not come back within --peer-grace %g s: %s of %s %" PRIu64
           " (\"%s\") cannot complete; no shard was changed",
           r, c->job->name, gone, c->e->cfg.peer_grace,
           shardd__coll_kind_word(c->args.kind),
           shardd__coll_target_word(c->args.kind), c->args.target, c->name);
  if (!q->lost_told[r]) {
    q->lost_told[r] = 1;
    shardd__log(SHARDD__LOG_WARN, "job \"%s\": peer lost: %s (and so every "
                "collective of its peers until it reconnects)", c->job->name, msg);
  }
  coll_finish(c, SHARDD_E_PEER_LOST, msg);
}

/* Fails every waiting collective of q a missing rank dooms; 1 if any. */
static int fail_doomed(coll_job *q, double now) {
  if (q->lost_at == NULL)
    return 0;
  int any = 0;
  for (coll *c = q->head, *next; c; c = next) {
    next = c->next;
    int64_t r = doomed_by(c, now);
    if (r < 0)
      continue;
    fail_doomed_one(c, (uint32_t)r, now); /* unlinks c only; next stays */
    any = 1;
  }
  if (any)
    schedule(q);
  return any;
}

void shardd__coll_member_joined(shardd__coll_engine *e, shardd__coll_member *m) {
  m->joined = ++e->epoch;
  coll_job *q = m->job ? shardd__coll_job_of(e, m->job, 0) : NULL;
  if (q && q->broken != SHARDD_OK && q->broken_rank == m->rank) {
    shardd__log(SHARDD__LOG_INFO, "job \"%s\": rank %" PRIu32 " joined again; "
                "its collectives are no longer refused", m->job->name, m->rank);
    q->broken = SHARDD_OK;
  }
  if (q == NULL || q->lost_at == NULL || q->lost_at[m->rank] < 0)
    return;
  shardd__log(SHARDD__LOG_INFO, "job \"%s\": rank %" PRIu32 " is back after "
              "%.1f s", m->job->name, m->rank, loop_now(e) - q->lost_at[m->rank]);
  q->lost_at[m->rank] = -1;
}

/* Records that m's rank is missing from now (a job's first loss makes the
 * job's arrays); out of memory, the loss is only logged and the waiting
 * ends at the collective timeout, as it always did. */
static void note_lost(coll_job *q, const shardd__coll_member *m) {
  shardd__coll_engine *e = q->e;
  uint32_t w = q->job->world;
  if (q->lost_at == NULL) {
    q->lost_at = malloc(w * sizeof *q->lost_at);
    q->lost_epoch = calloc(w, sizeof *q->lost_epoch);
    q->lost_told = calloc(w, 1);
    if (q->lost_at == NULL || q->lost_epoch == NULL || q->lost_told == NULL) {
      free(q->lost_at);
      free(q->lost_epoch);
      free(q->lost_told);
      q->lost_at = NULL;
      q->lost_epoch = NULL;
      q->lost_told = NULL;
      shardd__log(SHARDD__LOG_ERROR, "job \"%s\": out of memory noting that "
                  "rank %" PRIu32 " left; its peers wait up to the collective "
                  "timeout", q->job->name, m->rank);
      return;
    }
    for (uint32_t r = 0; r < w; r++)
      q->lost_at[r] = -1;
  }
  q->lost_at[m->rank] = loop_now(e);
  q->lost_epoch[m->rank] = ++e->epoch;
  q->lost_told[m->rank] = 0;
}

double shardd__coll_rank_missing_s(const shardd__coll_engine *e,
                                   const shardd__job *job, uint32_t rank) {
  const coll_job *q = shardd__map_get_id(&e->jobs, job_key(job));
  if (q == NULL || q->lost_at == NULL || rank >= job->world || q->lost_at[rank] < 0)
    return -1;
  return loop_now(e) - q->lost_at[rank];
}

shardd_err shardd__coll_describe(const shardd__coll_engine *e,
                                 const shardd__job *job, size_t i,
                                 shardd__coll_info *out, uint8_t *arrived) {
  const coll_job *q = shardd__map_get_id(&e->jobs, job_key(job));
  const coll *c = q ? q->head : NULL;
  for (; c && i > 0; i--)
    c = c->next;
  if (c == NULL)
    return SHARDD_E_NOT_FOUND;
  out->kind = c->args.kind;
  out->target = c->args.target;
  out->name = c->name;
  out->running = c->started;
  /* (arrival + timeout) - timeout may round above arrival: never below 0 */
  out->waited_s = loop_now(e) - (c->deadline - e->cfg.timeout);
  if (!(out->waited_s > 0))
    out->waited_s = 0;
  for (uint32_t r = 0; r < job->world; r++)
    arrived[r] = c->waiters[r].arrived != 0;
  return SHARDD_OK;
}

/* ---- submission ------------------------------------------------------- */

static int args_equal(const shardd__coll_args *a, const shardd__coll_args *b) {
  return a->kind == b->kind && a->target == b->target && a->op == b->op &&
         a->has_lr == b->has_lr && (!a->has_lr || a->lr == b->lr) &&
         a->max_norm == b->max_norm && a->accumulate == b->accumulate &&
         a->norm_only == b->norm_only && a->bucket == b->bucket &&
         a->bucket_n == b->bucket_n;
}

static int hp_equal(const shardd__hp *a, const shardd__hp *b) {
  return a->kind == b->kind && a->lr == b->lr && a->momentum == b->momentum &&
         a->dampening == b->dampening && a->weight_decay == b->weight_decay &&
         a->beta1 == b->beta1 && a->beta2 == b->beta2 && a->eps == b->eps &&
         a->nesterov == b->nesterov && a->maximize == b->maximize &&
         a->amsgrad == b->amsgrad;
}

/* A step's hyperparameters per group: the registered ones, args' lr, then
 * args' per-group overrides, each checked as at registration. *out is
 * malloc'ed (the caller's) on SHARDD_OK. amsgrad and the kind stay: the
 * state laid out at registration depends on them. */
static shardd_err step_hp(const shardd__optim *o, const shardd__coll_args *args,
                          shardd__hp **out, char *err, size_t errlen) {
  *out = NULL;
  if (args->ngroup_hp != 0 && args->ngroup_hp != o->ngroups) {
    snprintf(err, errlen, "step: %zu groups of hyperparameters for optimizer "
             "\"%s\", which has %zu param groups", args->ngroup_hp,
             o->hdr.name, o->ngroups);
    return SHARDD_E_INVAL;
  }
  shardd__hp *hp = malloc((o->ngroups ? o->ngroups : 1) * sizeof *hp);
  if (hp == NULL) {
    snprintf(err, errlen, "out of memory");
    return SHARDD_E_NO_MEMORY;
  }
  for (size_t g = 0; g < o->ngroups; g++) {
    hp[g] = o->groups[g];
    if (args->has_lr)
      hp[g].lr = args->lr;
    if (args->ngroup_hp == 0)
      continue;
    shardd__hp_overlay(&hp[g], &args->group_hp[g]);
    char why[200];
    shardd_err rc = shardd__hp_check(&hp[g], why, sizeof why);
    if (rc == SHARDD_OK && hp[g].amsgrad != o->groups[g].amsgrad) {
      snprintf(why, sizeof why, "amsgrad cannot change after registration "
               "(its state is laid out then)");
      rc = SHARDD_E_INVAL;
    } else if (rc == SHARDD_OK && shardd__optim_state_count(&hp[g]) !=
                                      shardd__optim_state_count(&o->groups[g])) {
      /* SGD keeps a momentum buffer only when registered with momentum */
      snprintf(why, sizeof why, "momentum %g where the group was registered with "
               "%g: SGD's momentum buffer exists only when registered with "
               "momentum, so it cannot turn on or off after registration",
               hp[g].momentum, o->groups[g].momentum);
      rc = SHARDD_E_INVAL;
    }
    if (rc != SHARDD_OK) {
      snprintf(err, errlen, "step of optimizer \"%s\": param group %zu: %s",
               o->hdr.name, g, why);
      free(hp);
      return rc;
    }
  }
  *out = hp;
  return SHARDD_OK;
}

/* c's ranks disagree on their buckets: answers every rank waiting in c now
 * (a later one as it arrives: c stays queued, refused, until all have) and,
 * on one node, fails every unstarted collective holding an entry of those
 * ranks' buckets (their seq), so no bucket waits for an entry the
 * disagreeing rank never sends. */
static void bucket_fail(coll *c) {
  coll_job *q = c->cj;
  uint32_t world = c->job->world, n = 0;
  /* out of memory: c's ranks are still answered; their other entries
   * then wait for the timeout */
  uint64_t *seqs = malloc(world * sizeof *seqs);
  shardd__coll_member **ms = malloc(world * sizeof *ms);
  for (uint32_t r = 0; r < world && seqs && ms; r++)
    if (c->waiters[r].m) {
      ms[n] = c->waiters[r].m;
      seqs[n++] = c->waiters[r].seq;
    }
  answer_now(c, c->refused, c->refused_msg);
  if (shardd__coll_multi(c)) {
    /* every entry must still cross the nodes (a refused one as a header
     * that fails it there too), or the other nodes' exchanges of it wait
     * until the fabric times out and is lost: each rank sends its whole
     * bucket (dispatch), and the entries that disagree are refused one by
     * one as they meet */
    free(seqs);
    free(ms);
    return;
  }
  char msg[384];
  for (coll *it = q->head, *next; it; it = next) {
    next = it->next;
    if (it == c || it->started || it->args.bucket == 0)
      continue;
    int hit = 0;
    for (uint32_t r = 0; r < world && !hit; r++)
      for (uint32_t k = 0; k < n && !hit; k++)
        hit = it->waiters[r].m == ms[k] && it->waiters[r].seq == seqs[k];
    if (!hit)
      continue;
    snprintf(msg, sizeof msg, "%s of buffer %" PRIu64 " (\"%s\") did not run: "
             "its bucket failed at buffer %" PRIu64 ": %s",
             shardd__coll_kind_word(it->args.kind), it->args.target, it->name,
             c->args.target, c->refused_msg);
    coll_finish(it, SHARDD_E_MISMATCH, msg); /* unlinks it only; next stays */
  }
  free(seqs);
  free(ms);
}

/* How a rank sent a collective, for a bucket mismatch's message. */
static void bucket_word(const shardd__coll_args *a, char *out, size_t len) {
  if (a->bucket == 0)
    snprintf(out, len, "alone");
  else
    snprintf(out, len, "as entry %" PRIu32 " of a bucket of %" PRIu32
             " (list %016" PRIx64 ")", a->bucket_index, a->bucket_n, a->bucket);
}

static void refuse(shardd__coll_engine *e, shardd__coll_member *m,
                   uint64_t seq, const shardd__coll_args *args,
                   shardd_err code, const char *msg) {
  shardd__coll_result res;
  memset(&res, 0, sizeof res);
  res.kind = args->kind;
  res.target = args->target;
  e->cfg.hooks.done(e->cfg.hooks.ctx, m, seq, code, msg,
                    args->bucket ? &res : NULL);
}

static double loop_now(const shardd__coll_engine *e) {
  return (double)uv_now(e->cfg.loop) / 1000.0;
}

static int cmp_u64(const void *a, const void *b) {
  uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
  return x < y ? -1 : x > y;
}

/* A scatter's no-gradient views, checked (each a view of b) and copied
 * sorted without repeats. */
static shardd_err copy_mask(shardd__coll_engine *e, const shardd__buffer *b,
                            const shardd__coll_args *args, uint64_t **out,
                            size_t *nout, char *err, size_t errlen) {
  for (size_t k = 0; k < args->nno_grad; k++) {
    const shardd__obj *v = shardd__registry_get(e->cfg.reg, args->no_grad[k]);
    if (v == NULL || v->kind != SHARDD__OBJ_VIEW ||
        ((const shardd__view *)v)->buf != b) {
      snprintf(err, errlen,
               "scatter of buffer %" PRIu64 " (\"%s\"): no-gradient entry %zu "
               "(id %" PRIu64 ") is not a view of it",
               b->hdr.id, b->hdr.name, k, args->no_grad[k]);
      return SHARDD_E_NOT_FOUND;
    }
  }
  uint64_t *m = malloc(args->nno_grad * sizeof *m);
  if (m == NULL) {
    snprintf(err, errlen, "out of memory");
    return SHARDD_E_NO_MEMORY;
  }
  memcpy(m, args->no_grad, args->nno_grad * sizeof *m);
  qsort(m, args->nno_grad, sizeof *m, cmp_u64);
  size_t n = 0;
  for (size_t k = 0; k < args->nno_grad; k++)
    if (n == 0 || m[n - 1] != m[k])
      m[n++] = m[k];
  *out = m;
  *nout = n;
  return SHARDD_OK;
}

static void submit(shardd__coll_engine *e, shardd__coll_member *m, uint64_t seq,
                   const shardd__coll_args *args);

void shardd__coll_submit(shardd__coll_engine *e, shardd__coll_member *m,
                         uint64_t seq, const shardd__coll_args *args) {
  /* the loop's copying budget for this request (loop_helps); a bucket's
   * entries share their request's */
  if (!e->batching)
    e->help_left = LOOP_HELP_BYTES;
  submit(e, m, seq, args);
  if (!e->batching)
    e->help_left = 0;
}

static void submit(shardd__coll_engine *e, shardd__coll_member *m, uint64_t seq,
                   const shardd__coll_args *args) {
  shardd__job *job = m->job;
  char err[256];
  shardd__obj *o = NULL;
  int scalars = args->kind == SHARDD__COLL_ALL_REDUCE;
  shardd__obj_kind want = args->kind == SHARDD__COLL_STEP ? SHARDD__OBJ_OPTIM
                                                          : SHARDD__OBJ_BUFFER;
  shardd_err rc = SHARDD_OK;
  /* In a multi-node job an all_reduce (a barrier: no values) reduces over
   * the local ranks, then crosses nodes in its exchange (coll_fabric.c). */
  if (scalars && (args->target > SHARDD_ALL_REDUCE_MAX ||
                         (args->target > 0 && args->values == NULL))) {
    snprintf(err, sizeof err, "all_reduce of %" PRIu64 " values: at most %d",
             args->target, SHARDD_ALL_REDUCE_MAX);
    rc = SHARDD_E_RANGE;
  } else if (!scalars) {
    rc = shardd__registry_resolve_gen(e->cfg.reg, job, args->target,
                                      args->kind == SHARDD__COLL_STEP ? 0
                                                                      : args->generation,
                                      want, &o, err, sizeof err);
  }
  if (rc != SHARDD_OK) {
    refuse(e, m, seq, args, rc, err);
    return;
  }
  double *vals = NULL;
  if (scalars &&
      (vals = malloc((args->target ? args->target : 1) * sizeof *vals)) == NULL) {
    refuse(e, m, seq, args, SHARDD_E_NO_MEMORY, "out of memory");
    return;
  }
  if (vals && args->target)
    memcpy(vals, args->values, args->target * sizeof *vals);
  /* A step refused here, in a multi-node job, is answered at once but still
   * joins its collective, refused: the other nodes' ranks issued it too
   * and wait in its exchange, whose header must come from this node. */
  int multi = job->nodes > 1 && args->kind == SHARDD__COLL_STEP;
  shardd_err local = SHARDD_OK;
  char local_msg[256] = "";
  if (args->kind == SHARDD__COLL_STEP &&
      ((args->has_lr && !(args->lr >= 0 && isfinite(args->lr))) ||
       !(args->max_norm >= 0))) {
    /* max_norm inf: the norm is reported, the coefficient clamps to 1 */
    free(vals);
    vals = NULL;
    local = SHARDD_E_RANGE;
    snprintf(local_msg, sizeof local_msg,
             "step: lr must be >= 0 and finite, max_norm >= 0 (inf: report the "
             "norm only)");
    if (!multi) {
      refuse(e, m, seq, args, local, local_msg);
      return;
    }
  }
  if (args->kind == SHARDD__COLL_SCATTER && args->accumulate &&
      e->be->ops->reduce_add == NULL) {
    snprintf(err, sizeof err,
             "scatter: the %s backend cannot add to a reduced gradient "
             "(accumulating scatter): scatter once per step",
             e->be->name);
    refuse(e, m, seq, args, SHARDD_E_INVAL, err);
    return;
  }
  coll_job *q = shardd__coll_job_of(e, job, 0);
  if (q && q->broken != SHARDD_OK && m->joined <= q->broken_epoch) {
    free(vals);
    refuse(e, m, seq, args, q->broken, q->broken_msg);
    return;
  }
  /* a bucket is one request (and one round trip): it counts once, checked
   * at its first entry (not for each: that walked the queue 64 times) */
  if (args->kind == SHARDD__COLL_GATHER && e->cfg.max_inflight_gathers > 0 &&
      args->bucket_index == 0) {
    uint32_t n = 0;
    for (coll *it = q ? q->head : NULL; it; it = it->next)
      n += it->args.kind == SHARDD__COLL_GATHER && it->waiters[m->rank].m == m &&
           it->args.bucket_index == 0;
    if (n >= e->cfg.max_inflight_gathers) {
      snprintf(err, sizeof err,
               "rank %" PRIu32 " has %" PRIu32 " gathers in flight "
               "(--max-inflight-gathers %" PRIu32 ")",
               m->rank, n, e->cfg.max_inflight_gathers);
      free(vals);
      refuse(e, m, seq, args, SHARDD_E_LIMIT, err);
      return;
    }
  }
  if (m->pending >= e->cfg.max_pending) {
    snprintf(err, sizeof err,
             "session has %" PRIu32 " collectives queued (limit %" PRIu32 ")",
             m->pending, e->cfg.max_pending);
    free(vals);
    refuse(e, m, seq, args, SHARDD_E_LIMIT, err);
    return;
  }
  if (q == NULL && (q = shardd__coll_job_of(e, job, 1)) == NULL) {
    free(vals);
    refuse(e, m, seq, args, SHARDD_E_NO_MEMORY, "out of memory");
    return;
  }
  q->last_submit = loop_now(e);
  shardd__hp *hp = NULL; /* a step's, until c owns it */
  if (args->kind == SHARDD__COLL_STEP && local == SHARDD_OK &&
      (rc = step_hp((const shardd__optim *)o, args, &hp, err, sizeof err)) != SHARDD_OK) {
    free(vals);
    vals = NULL;
    if (!multi) {
      refuse(e, m, seq, args, rc, err);
      return;
    }
    local = rc;
    snprintf(local_msg, sizeof local_msg, "%s", err);
  }

  uint64_t *mask = NULL;
  size_t nmask = 0;
  if (args->kind == SHARDD__COLL_SCATTER && args->nno_grad > 0 &&
      !args->no_grad_all) {
    if ((rc = copy_mask(e, (const shardd__buffer *)o, args, &mask, &nmask, err,
                        sizeof err)) != SHARDD_OK) {
      refuse(e, m, seq, args, rc, err);
      return;
    }
  }
  coll *c = NULL;
  for (coll *it = q->head; it; it = it->next) {
    /* all_reduces match whatever their count: one of another count is a
     * mismatch that fails them all, not a collective of its own to wait
     * for ranks that never come */
    if (it->args.kind == args->kind && (scalars || it->args.target == args->target) &&
        !it->started && !it->waiters[m->rank].arrived) {
      c = it;
      break;
    }
  }
  int same = c == NULL || args_equal(&c->args, args);
  for (size_t g = 0; c && same && hp && c->hp && g < c->opt->ngroups; g++)
    same = hp_equal(&c->hp[g], &hp[g]);
  if (c && c->refused == SHARDD_OK && local == SHARDD_OK && !same &&
      (c->args.bucket != args->bucket || c->args.bucket_n != args->bucket_n)) {
    char mine[64], theirs[64];
    bucket_word(args, mine, sizeof mine);
    bucket_word(&c->args, theirs, sizeof theirs);
    snprintf(c->refused_msg, sizeof c->refused_msg,
             "rank %" PRIu32 " sent %s of buffer %" PRIu64 " %s, the ranks "
             "before it %s: every rank must send the same buffers in the same "
             "order", m->rank, shardd__coll_kind_word(args->kind), args->target,
             mine, theirs);
    c->refused = SHARDD_E_MISMATCH;
    c->bucket_bad = 1;
  } else if (c && c->refused == SHARDD_OK && local == SHARDD_OK && !same) {
    snprintf(c->refused_msg, sizeof c->refused_msg,
             "rank %" PRIu32 " called %s on %s %" PRIu64
             " with other arguments than the ranks before it",
             m->rank, shardd__coll_kind_word(args->kind),
             shardd__coll_target_word(args->kind), args->target);
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
      free(hp);
      free(vals);
      free(mask);
      refuse(e, m, seq, args, SHARDD_E_NO_MEMORY, "out of memory");
      return;
    }
    c->e = e;
    c->job = job;
    c->cj = q;
    c->args = *args;
    c->args.group_hp = NULL; /* the caller's: resolved into c->hp */
    c->args.ngroup_hp = 0;
    c->args.values = NULL; /* borrowed for the submit only: each waiter has its copy */
    c->args.no_grad = NULL; /* each rank's mask is its waiter's */
    c->args.nno_grad = 0;
    c->args.no_grad_all = 0;
    c->deadline = loop_now(e) + e->cfg.timeout;
    c->name = o ? o->name : (args->target ? "scalars" : "barrier");
    c->name_key = shardd__coll_fab_key(args->kind, c->name);
    c->tag = shardd__coll_fab_tag(c->name_key);
    /* made before a fabric failure: of the iteration it broke, so it must
     * fail, not re-form the fabric (coll_fabric.c) */
    if (q->fab)
      c->fab_epoch = shardd__coll_fab_epoch(q->fab);
    if (scalars) {
      /* no registry object to hold */
    } else if (args->kind == SHARDD__COLL_STEP) {
      c->opt = (shardd__optim *)o;
      c->hp = hp;
      hp = NULL;
      shardd__optim_hold(c->opt);
    } else {
      c->buf = (shardd__buffer *)o;
      shardd__buffer_hold(c->buf);
    }
    /* appended in O(1): a bucket's 64 entries make as many collectives */
    if (q->tailp == NULL)
      for (q->tailp = &q->head; *q->tailp; q->tailp = &(*q->tailp)->next)
        ;
    *q->tailp = c;
    q->tailp = &c->next;
    q->count++;
  }
  free(hp); /* a later rank's, compared above */
  waiter *w = &c->waiters[m->rank];
  w->m = m;
  w->seq = seq;
  w->arrived = 1;
  w->want_grad = args->want_grad;
  w->vals = vals;
  w->none_all = args->no_grad_all;
  w->no_grad = mask;
  w->nno_grad = nmask;
  mask = NULL;
  m->pending++;
  c->arrived++;
  if (local != SHARDD_OK) {
    /* answered now, as on one node; its peers here learn of it with the
     * others when every local rank arrived */
    if (c->refused == SHARDD_OK) {
      c->refused = local;
      snprintf(c->refused_msg, sizeof c->refused_msg, "rank %" PRIu32 "'s %s was "
               "refused: %.200s", m->rank, shardd__coll_kind_word(args->kind), local_msg);
    }
    refuse(e, m, seq, args, local, local_msg);
    w->m = NULL;
    m->pending--;
  }
  if (c->bucket_bad)
    bucket_fail(c);
  int64_t doom;
  if (c->arrived == job->local_ranks) {
    if (c->refused != SHARDD_OK && shardd__coll_multi(c))
      /* answered now; the exchange's header still runs when schedule
       * starts it (start_phase), so the other nodes hear of the refusal */
      answer_now(c, c->refused, c->refused_msg);
    else if (c->refused != SHARDD_OK)
      coll_finish(c, c->refused, c->refused_msg); /* it may have held back newer ones */
    schedule(q);
    job_maybe_quiet(q);
  } else if ((doom = doomed_by(c, loop_now(e))) >= 0) {
    /* a rank gone past the grace will not submit it: say so now, not at
     * the timeout */
    fail_doomed_one(c, (uint32_t)doom, loop_now(e));
    schedule(q);
    job_maybe_quiet(q);
  }
}

/* Fails the waiting collectives of q that pick chooses; how many, and
 * (first, when not NULL) the first one's message. */
static uint32_t fail_waiting(coll_job *q, shardd_err code,
                             int (*pick)(coll *c, void *arg), void *arg,
                             void (*describe)(coll *c, void *arg, char *msg,
                                              size_t len),
                             char *first, size_t firstlen) {
  uint32_t n = 0;
  for (coll *c = q->head, *next; c; c = next) {
    next = c->next;
    if (c->started || !pick(c, arg))
      continue;
    char msg[512];
    describe(c, arg, msg, sizeof msg);
    if (n++ == 0 && first)
      snprintf(first, firstlen, "%s", msg);
    coll_finish(c, code, msg);
    /* coll_finish may only unlink c; `next` stays valid. */
  }
  schedule(q);
  return n;
}

/* Waiting collectives the lost member had submitted (its waiter arrived,
 * now forgotten): nothing can complete them. */
static int pick_joined_by(coll *c, void *arg) {
  const shardd__coll_member *m = arg;
  return c->waiters[m->rank].arrived && c->waiters[m->rank].m == NULL;
}

static void describe_lost(coll *c, void *arg, char *msg, size_t len) {
  const shardd__coll_member *m = arg;
  snprintf(msg, len,
           "rank %" PRIu32 " of job \"%s\" disconnected before %s of %s %" PRIu64
           " completed; no shard was changed",
           m->rank, c->job->name, shardd__coll_kind_word(c->args.kind),
           shardd__coll_target_word(c->args.kind), c->args.target);
}

void shardd__coll_member_lost(shardd__coll_engine *e, shardd__coll_member *m) {
  if (m->job == NULL)
    return;
  coll_job *q = shardd__coll_job_of(e, m->job, 1);
  if (q == NULL) {
    /* no collective of the job can be queued either: there is nothing to
     * fail now, only the loss to remember */
    shardd__log(SHARDD__LOG_ERROR, "job \"%s\": out of memory noting that "
                "rank %" PRIu32 " left", m->job->name, m->rank);
    return;
  }
  /* Running collectives finish (their inputs were complete); they just
   * must not answer a member that is gone. Unstarted ones it had joined can
   * never complete (its request went with it): its own entry goes first,
   * so it is not answered and its pending count returns to zero, then the
   * others in them are failed at once. */
  for (coll *c = q->head; c; c = c->next) {
    if (c->waiters[m->rank].m == m) {
      c->waiters[m->rank].m = NULL;
      m->pending--;
    }
  }
  uint32_t n = fail_waiting(q, SHARDD_E_PEER_LOST, pick_joined_by, m,
                            describe_lost, NULL, 0);
  if (n > 0)
    shardd__log(SHARDD__LOG_WARN, "job \"%s\": peer lost: rank %" PRIu32
                " disconnected inside %" PRIu32 " collective(s); they failed "
                "with E_PEER_LOST", m->job->name, m->rank, n);
  note_lost(q, m);
  fail_doomed(q, loop_now(e)); /* --peer-grace 0: the rest too, at once */
  job_maybe_quiet(q);
}

typedef struct {
  double now;
} tick_arg;

static int pick_any(coll *c, void *arg) {
  (void)c;
  (void)arg;
  return 1;
}

static void describe_stop(coll *c, void *arg, char *msg, size_t len) {
  snprintf(msg, len,
           "%s: %s of %s %" PRIu64 " failed before every rank arrived; no "
           "shard was changed", (const char *)arg,
           shardd__coll_kind_word(c->args.kind),
           shardd__coll_target_word(c->args.kind), c->args.target);
}

static int pick_expired(coll *c, void *arg) {
  const tick_arg *t = arg;
  return c->arrived < c->job->local_ranks && t->now >= c->deadline;
}

static void describe_expired(coll *c, void *arg, char *msg, size_t len) {
  int n = snprintf(msg, len,
                   "%s of %s %" PRIu64 " timed out after %.0f s waiting for rank",
                   shardd__coll_kind_word(c->args.kind),
                   shardd__coll_target_word(c->args.kind), c->args.target,
                   c->e->cfg.timeout);
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

typedef struct {
  shardd__coll_engine *e;
  coll_job **jobs;
  size_t n, cap;
} jobs_arg;

/* In the registry's order (by job name), as before the queues moved here,
 * so the timeouts of one tick are answered alike. */
static void collect_job(shardd__job *job, void *arg) {
  jobs_arg *a = arg;
  coll_job *cj = shardd__map_get_id(&a->e->jobs, job_key(job));
  if (cj && a->n < a->cap)
    a->jobs[a->n++] = cj;
}

/* The jobs of e that have collective state, in the registry's order; the
 * caller frees a->jobs. Out of memory, none. */
static void collect_jobs(shardd__coll_engine *e, jobs_arg *a) {
  size_t cap = shardd__map_count(&e->jobs);
  *a = (jobs_arg){e, cap ? malloc(cap * sizeof(coll_job *)) : NULL, 0, cap};
  if (a->jobs != NULL)
    shardd__registry_each_job(e->cfg.reg, collect_job, a);
}

/* Whether started c (multi-node) has its exchange still ahead or in
 * flight: gather and scatter before their local fan-out, a step before its
 * updates. */
static int before_fanout(const coll *c) {
  return c->args.kind == SHARDD__COLL_STEP ? c->phase == 0 : c->stage < 2;
}

/* The stop aborts q's fabric. The started collectives whose exchange it
 * ended, or that have theirs still ahead (it will fail at once), are
 * answered now, while their ranks are still connected, and fail when their
 * task comes back (c->rc set here, whatever the task says, so what the rank
 * heard is what happened: a step answered here is never applied). One whose
 * exchange had completed before the abort goes on (its rest is local and
 * bounded). How many were answered. */
static uint32_t abort_exchanges(coll_job *q, const char *why, char *first,
                                size_t firstlen) {
  int quiet = shardd__coll_fab_abort(q->fab, why, 2.0);
  uint32_t n = 0;
  for (coll *c = q->head; c; c = c->next) {
    if (!c->started || !before_fanout(c) || c->rc != SHARDD_OK)
      continue;
    /* quiet: the fabric threads are out, their task rc and fab_msg final */
    shardd_err rc = SHARDD_E_SHUTDOWN;
    if (c->fab_busy && quiet)
      rc = c->fab_task->rc;
    if (rc == SHARDD_OK)
      continue;
    char msg[512], detail[256];
    snprintf(detail, sizeof detail, "%s: the cross-node exchange was aborted", why);
    fabric_failure(c, rc != SHARDD_E_SHUTDOWN && c->fab_msg[0] ? c->fab_msg : detail,
                   msg, sizeof msg);
    c->rc = rc;
    if (answer_now(c, rc, msg) > 0 && n++ == 0 && first)
      snprintf(first, firstlen, "%s", msg);
  }
  return n;
}

uint32_t shardd__coll_stop_waiting(shardd__coll_engine *e, const char *why) {
  jobs_arg a;
  collect_jobs(e, &a);
  uint32_t total = 0;
  for (size_t i = 0; i < a.n; i++) {
    char first[512];
    uint32_t n = fail_waiting(a.jobs[i], SHARDD_E_SHUTDOWN, pick_any,
                              (void *)why, describe_stop, first, sizeof first);
    if (n > 0)
      shardd__log(SHARDD__LOG_WARN, "job \"%s\": %" PRIu32 " waiting "
                  "collective(s) failed with E_SHUTDOWN: %s%s",
                  a.jobs[i]->job->name, n, first, n > 1 ? " (and others)" : "");
    total += n;
    if (a.jobs[i]->fab) {
      uint32_t k = abort_exchanges(a.jobs[i], why, first, sizeof first);
      if (k > 0)
        shardd__log(SHARDD__LOG_WARN, "job \"%s\": %" PRIu32 " collective(s) "
                    "in a cross-node exchange aborted: %s%s",
                    a.jobs[i]->job->name, k, first, k > 1 ? " (and others)" : "");
      total += k;
    }
    job_maybe_quiet(a.jobs[i]);
  }
  free(a.jobs);
  return total;
}

static void describe_broken(coll *c, void *arg, char *msg, size_t len) {
  const coll_job *q = arg;
  snprintf(msg, len, "%s of %s %" PRIu64 " (\"%s\") cannot run: %s",
           shardd__coll_kind_word(c->args.kind),
           shardd__coll_target_word(c->args.kind), c->args.target, c->name,
           q->broken_msg);
}

void shardd__coll_job_break(shardd__coll_engine *e, shardd__job *job,
                            uint32_t rank, shardd_err code, const char *msg) {
  coll_job *q = shardd__coll_job_of(e, job, 1);
  if (q == NULL) /* its ranks hear of it when that rank leaves, as before */
    return;
  q->broken = code;
  q->broken_rank = rank;
  q->broken_epoch = e->epoch; /* a relaunch's members join after it */
  snprintf(q->broken_msg, sizeof q->broken_msg, "%s", msg);
  uint32_t n = fail_waiting(q, code, pick_any, q, describe_broken, NULL, 0);
  shardd__log(SHARDD__LOG_WARN, "job \"%s\": rank %" PRIu32 " was refused "
              "(%s); %" PRIu32 " waiting collective(s) failed with it, and the "
              "job's collectives are refused until that rank joins again",
              job->name, rank, shardd_err_name(code), n);
  job_maybe_quiet(q);
}

/* Whether local rank r of q is stuck for c, which it has not called:
 * connected and waiting only in unstarted collectives, each of which
 * misses a rank that waits in c, so neither can run before the other;
 * *in: the oldest of them. */
static int stuck_for(const coll_job *q, const coll *c, uint32_t r, const coll **in) {
  const shardd__job *job = q->job;
  uint32_t lo = job->local_first, hi = lo + job->local_ranks;
  const shardd__coll_member *m = NULL;
  uint32_t n = 0;
  *in = NULL;
  for (const coll *d = q->head; d; d = d->next) {
    const waiter *w = &d->waiters[r];
    if (!w->arrived)
      continue;
    if (w->m == NULL || d->started)
      return 0;
    int waits = 0;
    for (uint32_t k = lo; k < hi && !waits; k++)
      waits = !d->waiters[k].arrived && c->waiters[k].m != NULL;
    if (!waits)
      return 0;
    m = w->m;
    n++;
    if (*in == NULL)
      *in = d;
  }
  return m != NULL && n == m->pending; /* none running, none elsewhere */
}

/* The message for c when every local rank it misses is stuck in another
 * collective (stuck_for), into msg; 0 when one is not (or is lost: that
 * is the grace's and doomed_by's). */
static int stuck_msg(const coll_job *q, const coll *c, double now, char *msg,
                     size_t len) {
  const shardd__job *job = c->job;
  uint32_t lo = job->local_first, hi = lo + job->local_ranks;
  char called[96] = "", missing[96] = "", where[256] = "";
  size_t nc = 0, nm = 0, nw = 0;
  for (uint32_t r = lo; r < hi; r++) {
    if (c->waiters[r].arrived) {
      if (nc < sizeof called)
        nc += (size_t)snprintf(called + nc, sizeof called - nc, "%s%" PRIu32,
                               nc ? ", " : "", r);
      continue;
    }
    const coll *d;
    if ((q->lost_at && q->lost_at[r] >= 0) || !stuck_for(q, c, r, &d))
      return 0;
    if (nm < sizeof missing)
      nm += (size_t)snprintf(missing + nm, sizeof missing - nm, "%s%" PRIu32,
                             nm ? ", " : "", r);
    if (nw < sizeof where)
      nw += (size_t)snprintf(where + nw, sizeof where - nw,
                             "%srank %" PRIu32 " waits in %s of %s %" PRIu64
                             " (\"%s\")", nw ? "; " : "", r,
                             shardd__coll_kind_word(d->args.kind),
                             shardd__coll_target_word(d->args.kind),
                             d->args.target, d->name);
  }
  if (nm == 0)
    return 0;
  snprintf(msg, len,
           "%s of %s %" PRIu64 " (\"%s\") was called by rank(s) %s of job "
           "\"%s\" but not by rank(s) %s, which wait in other collectives "
           "that wait for it (%s); no rank can go on (no request for %.1f s, "
           "--peer-grace %g s): every rank must make the same collective "
           "calls (e.g. state_dict() on every rank, not rank 0 only); no shard "
           "was changed",
           shardd__coll_kind_word(c->args.kind),
           shardd__coll_target_word(c->args.kind), c->args.target, c->name,
           called, job->name, missing, where, now - q->last_submit,
           q->e->cfg.peer_grace);
  return 1;
}

/* Fails the collectives of q whose missing ranks are all stuck in others
 * (stuck_msg), once no rank submitted anything for the grace: each is
 * judged before any fails, as failing one frees the ranks of the others. */
static void fail_stuck(coll_job *q, double now) {
  if (q->count < 2 || now < q->last_submit + q->e->cfg.peer_grace)
    return;
  size_t n = 0;
  for (coll *c = q->head; c; c = c->next)
    n++;
  coll **hit = malloc(n * sizeof *hit);
  char (*msgs)[768] = malloc(n * sizeof *msgs);
  size_t k = 0;
  for (coll *c = q->head; c && hit && msgs; c = c->next)
    if (!c->started && c->arrived < c->job->local_ranks &&
        stuck_msg(q, c, now, msgs[k], sizeof msgs[k]))
      hit[k++] = c;
  for (size_t i = 0; i < k; i++) {
    if (i == 0)
      shardd__log(SHARDD__LOG_WARN, "job \"%s\": %zu collective(s) failed: "
                  "%s%s", q->job->name, k, msgs[0], k > 1 ? " (and others)" : "");
    coll_finish(hit[i], SHARDD_E_MISMATCH, msgs[i]);
  }
  free(hit);
  free(msgs);
  if (k > 0)
    schedule(q);
}

/* Ticks further apart than this (the server ticks every 100 ms) mean the
 * loop itself did not run: the daemon was stopped (SIGSTOP), swapped out
 * or busy on its loop thread. */
#define STALL_S 2.0

/* The daemon's own stall of stall seconds is nobody's delay: the ranks'
 * requests sent meanwhile wait unread in their sockets, so the clocks the
 * tick judges ranks by (collective deadlines, the peer grace of lost
 * ranks, the stuck check's last submission) are moved on by it. Without
 * this the first tick after the stall failed the collectives with
 * E_PEER_LOST naming ranks that had arrived in time. */
static void forgive_stall(const jobs_arg *a, double stall) {
  for (size_t i = 0; i < a->n; i++) {
    coll_job *q = a->jobs[i];
    for (coll *c = q->head; c; c = c->next)
      c->deadline += stall;
    if (q->lost_at)
      for (uint32_t r = 0; r < q->job->world; r++)
        if (q->lost_at[r] >= 0)
          q->lost_at[r] += stall;
    q->last_submit += stall;
  }
}

void shardd__coll_tick(shardd__coll_engine *e, double now) {
  double real = (double)uv_hrtime() / 1e9;
  double stall = e->last_tick > 0 ? real - e->last_tick : 0;
  e->last_tick = real;
  /* A quiet hook may release its job, and with it the job's entry in
   * e->jobs: the walk collects first, then fails and reports. */
  jobs_arg a;
  collect_jobs(e, &a);
  if (a.jobs == NULL)
    return;
  if (stall > STALL_S && a.n > 0) {
    forgive_stall(&a, stall);
    shardd__log(SHARDD__LOG_WARN, "the daemon's loop stalled for %.1f s "
                "(stopped, swapped out or busy): the collective timeouts of "
                "%zu job(s) are extended by it, no rank is blamed for it",
                stall, a.n);
  }
  tick_arg t = {now};
  for (size_t i = 0; i < a.n; i++) {
    fail_doomed(a.jobs[i], now);
    fail_stuck(a.jobs[i], now);
    char first[512];
    uint32_t n = fail_waiting(a.jobs[i], SHARDD_E_PEER_LOST, pick_expired, &t,
                              describe_expired, first, sizeof first);
    if (n > 0)
      shardd__log(SHARDD__LOG_WARN, "job \"%s\": %" PRIu32 " collective(s) "
                  "timed out (--collective-timeout): %s%s",
                  a.jobs[i]->job->name, n, first, n > 1 ? " (and others)" : "");
    job_maybe_quiet(a.jobs[i]);
  }
  free(a.jobs);
}
