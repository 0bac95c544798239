/* coll_phase.c — a started collective's phases: the areas and masks it
 * needs, each phase's tasks started (start) and what follows when the last
 * one ended (after), the scalar all-reduce's values, the gradient mask of
 * a scatter's views. */
#include "coll_int.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "log.h"


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


/* What a rank hears of c failing in its cross-node exchange for why. */
void shardd__coll_fabric_failure(const coll *c, const char *why, char *msg,
                                 size_t len) {
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
      shardd__coll_fabric_failure(c, c->fab_msg, msg, sizeof msg);
    else
      snprintf(msg, sizeof msg, "%s of %s %" PRIu64 " failed in the backend: %s",
               shardd__coll_kind_word(c->args.kind), shardd__coll_target_word(c->args.kind),
               c->args.target, shardd_strerror(c->rc));
    coll_job *q = c->cj;
    shardd__coll_finish(c, c->rc, msg);
    shardd__coll_schedule(q);
    shardd__coll_job_maybe_quiet(q);
    return;
  }
  if (shardd__coll_multi(c) && c->args.kind != SHARDD__COLL_STEP &&
      c->args.kind != SHARDD__COLL_ALL_REDUCE && c->stage < 2) {
    c->stage++;
    coll_job *q = c->cj; /* c may be freed by start_phase */
    shardd__coll_start_phase(c);
    shardd__coll_job_maybe_quiet(q);
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
        shardd__coll_start_phase(c);
        shardd__coll_job_maybe_quiet(q);
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
      shardd__coll_finish(c, SHARDD_OK, NULL);
      shardd__coll_schedule(q);
      shardd__coll_job_maybe_quiet(q);
      return;
    }
    c->phase = 1;
    coll_job *q = c->cj; /* c may be freed by start_phase */
    shardd__coll_start_phase(c);
    shardd__coll_job_maybe_quiet(q);
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
  shardd__coll_finish(c, SHARDD_OK, NULL);
  shardd__coll_schedule(q);
  shardd__coll_job_maybe_quiet(q);
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
  c->areas_set = 1; /* the arrays came with c (submit_new) */
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
  /* the node's one read-only copy: copied into once, not once per rank */
  uint32_t lo = job->local_first;
  c->one_area = gather && job->transient;
  for (uint32_t r = lo + 1; c->one_area && r < lo + job->local_ranks; r++)
    c->one_area = c->area_reg[r] == c->area_reg[lo] &&
                  c->area_off[r] == c->area_off[lo];
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

void shardd__coll_start_phase(coll *c) {
  if (c->refused != SHARDD_OK) {
    /* multi-node, refused here (single-node refusals end at arrival): it
     * still takes part in the exchange's header, marked refused, so the
     * other nodes fail it naming this node instead of waiting for it */
    c->stage = 1;
    shardd__coll_run_phase(c);
    return;
  }
  if (c->args.kind == SHARDD__COLL_ALL_REDUCE && c->reduced == NULL &&
      reduce_values(c) != SHARDD_OK) {
    coll_job *q = c->cj;
    shardd__coll_finish(c, SHARDD_E_NO_MEMORY,
                        "out of memory starting a collective");
    shardd__coll_schedule(q);
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
      shardd__coll_finish(c, SHARDD_E_NO_MEMORY,
                          "out of memory starting a step");
      shardd__coll_schedule(q);
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
      shardd__coll_finish(c, rc, msg);
      shardd__coll_schedule(q);
      return;
    }
  }
  if (shardd__coll_multi(c) && c->args.kind == SHARDD__COLL_SCATTER &&
      c->stage == 1 && c->fab_mask == NULL && shardd__coll_mask_row(c) != SHARDD_OK) {
    /* the exchange's header says so, and every node fails it alike */
    free(c->fab_mask);
    c->fab_mask = NULL;
  }
  if (c->buf && !c->areas_set) {
    char msg[512];
    shardd_err rc = set_areas(c, msg, sizeof msg);
    if (rc != SHARDD_OK) {
      coll_job *q = c->cj;
      shardd__coll_finish(c, rc, msg);
      shardd__coll_schedule(q);
      return;
    }
    if (c->job->transient) {
      shardd__areas_busy(c->buf);
      c->areas_busy = 1;
    }
  }
  shardd__coll_run_phase(c);
}
