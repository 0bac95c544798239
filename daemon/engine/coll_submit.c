/* coll_submit.c — a rank's collective submitted: its arguments checked,
 * admitted to its job's queue, matched to the collective the other ranks
 * sent (or a new one), its arrival recorded; ranks that disagree (other
 * arguments, other buckets) fail the collective together. */
#include "coll_int.h"

#include <inttypes.h>
#include <math.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "validate.h"

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
  shardd__coll_answer_now(c, c->refused, c->refused_msg);
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
    shardd__coll_finish(it, SHARDD_E_MISMATCH,
                        msg); /* unlinks it only; next stays */
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

/* One rank's request on its way through submit's four steps: its
 * arguments checked, admitted to the job's queue, matched to a collective
 * (or one made for it), its arrival recorded. vals, hp and mask are its
 * own until a waiter or the collective takes them. */
typedef struct {
  shardd__coll_engine *e;
  shardd__coll_member *m;
  uint64_t seq;
  const shardd__coll_args *args;
  shardd__job *job;
  shardd__obj *o; /* the target: a buffer, an optimizer; NULL: scalars */
  int scalars;    /* an all_reduce */
  /* A step refused here, in a multi-node job, is answered at once but still
   * joins its collective, refused: the other nodes' ranks issued it too
   * and wait in its exchange, whose header must come from this node. */
  int multi;
  shardd_err local;
  coll_job *q;
  double *vals;
  shardd__hp *hp; /* a step's, until c owns it */
  uint64_t *mask;
  size_t nmask;
  /* local's message, written when local is set (last: submit zeroes all
   * before it, not these 256 bytes for each of a bucket's entries) */
  char local_msg[256];
} submission;

/* Answers s's rank with code and msg and drops what s holds. */
static void submit_refuse(submission *s, shardd_err code, const char *msg) {
  free(s->vals);
  free(s->hp);
  free(s->mask);
  s->vals = NULL;
  s->hp = NULL;
  s->mask = NULL;
  refuse(s->e, s->m, s->seq, s->args, code, msg);
}

/* The arguments on their own: the target resolved (or the values'
 * count), a step's lr and max_norm, an accumulating scatter's backend.
 * 0 to go on; -1 when refused (answered). */
static int submit_check(submission *s) {
  const shardd__coll_args *args = s->args;
  shardd__coll_engine *e = s->e;
  char err[256];
  shardd__obj_kind want = args->kind == SHARDD__COLL_STEP ? SHARDD__OBJ_OPTIM
                                                          : SHARDD__OBJ_BUFFER;
  shardd_err rc = SHARDD_OK;
  /* In a multi-node job an all_reduce (a barrier: no values) reduces over
   * the local ranks, then crosses nodes in its exchange (coll_fabric.c). */
  if (s->scalars && (args->target > SHARDD_ALL_REDUCE_MAX ||
                     (args->target > 0 && args->values == NULL))) {
    snprintf(err, sizeof err, "all_reduce of %" PRIu64 " values: at most %d",
             args->target, SHARDD_ALL_REDUCE_MAX);
    rc = SHARDD_E_RANGE;
  } else if (!s->scalars && args->resolved && want == SHARDD__OBJ_BUFFER) {
    s->o = args->resolved; /* resolved by the caller as below, this turn */
  } else if (!s->scalars) {
    rc = shardd__registry_resolve_gen(e->cfg.reg, s->job, args->target,
                                      args->kind == SHARDD__COLL_STEP
                                          ? 0
                                          : args->generation,
                                      want, &s->o, err, sizeof err);
  }
  if (rc != SHARDD_OK) {
    submit_refuse(s, rc, err);
    return -1;
  }
  if (s->scalars &&
      (s->vals = malloc((args->target ? args->target : 1) * sizeof *s->vals)) ==
          NULL) {
    submit_refuse(s, SHARDD_E_NO_MEMORY, "out of memory");
    return -1;
  }
  if (s->vals && args->target)
    memcpy(s->vals, args->values, args->target * sizeof *s->vals);
  s->multi = s->job->nodes > 1 && args->kind == SHARDD__COLL_STEP;
  if (args->kind == SHARDD__COLL_STEP &&
      ((args->has_lr && !(args->lr >= 0 && isfinite(args->lr))) ||
       !(args->max_norm >= 0))) {
    /* max_norm inf: the norm is reported, the coefficient clamps to 1 */
    free(s->vals);
    s->vals = NULL;
    s->local = SHARDD_E_RANGE;
    snprintf(s->local_msg, sizeof s->local_msg,
             "step: lr must be >= 0 and finite, max_norm >= 0 (inf: report the "
             "norm only)");
    if (!s->multi) {
      submit_refuse(s, s->local, s->local_msg);
      return -1;
    }
  }
  if (args->kind == SHARDD__COLL_SCATTER && args->accumulate &&
      e->be->ops->reduce_add == NULL) {
    snprintf(err, sizeof err,
             "scatter: the %s backend cannot add to a reduced gradient "
             "(accumulating scatter): scatter once per step",
             e->be->name);
    submit_refuse(s, SHARDD_E_INVAL, err);
    return -1;
  }
  return 0;
}

/* Admission to the job's queue: a job broken since the rank joined, the
 * rank's gathers in flight, the session's pending collectives; then what
 * the admitted request brings resolved (a step's hyperparameters, a
 * scatter's no-gradient views). 0 to go on; -1 when refused. */
static int submit_admit(submission *s) {
  const shardd__coll_args *args = s->args;
  shardd__coll_engine *e = s->e;
  shardd__coll_member *m = s->m;
  char err[256];
  shardd_err rc;
  coll_job *q = e->batching && e->batch_job == s->job
                    ? e->batch_cj
                    : shardd__coll_job_of(e, s->job, 0);
  if (q && q->broken != SHARDD_OK && m->joined <= q->broken_epoch) {
    submit_refuse(s, q->broken, q->broken_msg);
    return -1;
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
      submit_refuse(s, SHARDD_E_LIMIT, err);
      return -1;
    }
  }
  if (m->pending >= e->cfg.max_pending) {
    snprintf(err, sizeof err,
             "session has %" PRIu32 " collectives queued (--max-pending %" PRIu32 ")",
             m->pending, e->cfg.max_pending);
    submit_refuse(s, SHARDD_E_LIMIT, err);
    return -1;
  }
  if (q == NULL && (q = shardd__coll_job_of(e, s->job, 1)) == NULL) {
    submit_refuse(s, SHARDD_E_NO_MEMORY, "out of memory");
    return -1;
  }
  s->q = q;
  if (e->batching) {
    e->batch_job = s->job;
    e->batch_cj = q;
  }
  if (q->unjoined == NULL && q->head == NULL)
    /* made while the queue is empty, so NULL (none unjoined) is true for
     * every rank; out of memory: matching walks from the head */
    q->unjoined = calloc(s->job->world, sizeof *q->unjoined);
  q->last_submit = shardd__coll_loop_now(e);
  if (args->kind == SHARDD__COLL_STEP && s->local == SHARDD_OK &&
      (rc = step_hp((const shardd__optim *)s->o, args, &s->hp, err,
                    sizeof err)) != SHARDD_OK) {
    free(s->vals);
    s->vals = NULL;
    if (!s->multi) {
      submit_refuse(s, rc, err);
      return -1;
    }
    s->local = rc;
    snprintf(s->local_msg, sizeof s->local_msg, "%s", err);
  }
  if (args->kind == SHARDD__COLL_SCATTER && args->nno_grad > 0 &&
      !args->no_grad_all) {
    if ((rc = copy_mask(e, (const shardd__buffer *)s->o, args, &s->mask,
                        &s->nmask, err, sizeof err)) != SHARDD_OK) {
      submit_refuse(s, rc, err);
      return -1;
    }
  }
  return 0;
}

/* A new collective for s, queued at the tail of its job's; NULL when out
 * of memory (s refused). */
static coll *submit_new(submission *s) {
  const shardd__coll_args *args = s->args;
  shardd__coll_engine *e = s->e;
  coll_job *q = s->q;
  /* one allocation for c and its per-rank arrays (a bucket makes one
   * collective per entry: five allocations each were a cost of its own) */
  size_t w = s->job->world;
  size_t bytes = sizeof(coll) + w * (sizeof(waiter) + sizeof(shardd__region *) +
                                     sizeof(size_t) + sizeof(uint32_t) +
                                     sizeof(uint8_t));
  int zeroed;
  coll *c = shardd__coll_block_get(e, bytes, &zeroed);
  if (c == NULL) {
    submit_refuse(s, SHARDD_E_NO_MEMORY, "out of memory");
    return NULL;
  }
  /* zeroed but for the tail of struct coll that is written before read
   * (a world-sized block comes zeroed: its pages untouched) */
  if (!zeroed) {
    memset(c, 0, offsetof(coll, few_tasks));
    memset(c + 1, 0, bytes - sizeof *c);
  }
  c->refused_msg[0] = '\0';
  c->fab_msg[0] = '\0';
  c->waiters = (waiter *)(c + 1);
  c->area_reg = (shardd__region **)(c->waiters + w);
  c->area_off = (size_t *)(c->area_reg + w);
  c->order = (uint32_t *)(c->area_off + w);
  c->took = (uint8_t *)(c->order + w);
  c->alloc_bytes = bytes;
  e->counters.made++;
  c->e = e;
  c->job = s->job;
  c->cj = q;
  c->args = *args;
  c->args.resolved = NULL; /* the caller's, for the submit only */
  c->args.group_hp = NULL; /* the caller's: resolved into c->hp */
  c->args.ngroup_hp = 0;
  c->args.values = NULL; /* borrowed for the submit only: each waiter has its copy */
  c->args.no_grad = NULL; /* each rank's mask is its waiter's */
  c->args.nno_grad = 0;
  c->args.no_grad_all = 0;
  c->deadline = shardd__coll_loop_now(e) + e->cfg.timeout;
  c->name = s->o ? s->o->name : (args->target ? "scalars" : "barrier");
  c->name_key = shardd__coll_fab_key(args->kind, c->name);
  c->tag = shardd__coll_fab_tag(c->name_key);
  /* made before a fabric failure: of the iteration it broke, so it must
   * fail, not re-form the fabric (coll_fabric.c) */
  if (q->fab)
    c->fab_epoch = shardd__coll_fab_epoch(q->fab);
  if (s->scalars) {
    /* no registry object to hold */
  } else if (args->kind == SHARDD__COLL_STEP) {
    c->opt = (shardd__optim *)s->o;
    c->hp = s->hp;
    s->hp = NULL;
    shardd__optim_hold(c->opt);
  } else {
    c->buf = (shardd__buffer *)s->o;
    shardd__buffer_hold(c->buf);
    if (e->batching && (args->kind == SHARDD__COLL_GATHER ||
                        args->kind == SHARDD__COLL_SCATTER))
      /* a bucket's first rank: what its entries will move when the
       * others come (coll_run.c's early wake of the helper) */
      e->batch_new_bytes += c->buf->padded_numel *
                            shardd_dtype_size(c->buf->dtype) * s->job->world;
    e->batch_new_kind = args->kind == SHARDD__COLL_SCATTER;
  }
  /* appended in O(1): a bucket's 64 entries make as many collectives */
  if (q->tailp == NULL)
    for (q->tailp = &q->head; *q->tailp; q->tailp = &(*q->tailp)->next)
      ;
  *q->tailp = c;
  q->tailp = &c->next;
  q->count++;
  for (uint32_t r = 0; q->unjoined && r < s->job->world; r++)
    if (q->unjoined[r] == NULL)
      q->unjoined[r] = c;
  return c;
}

/* Matching: the oldest unstarted collective of the same kind and target
 * the rank has not joined, refused when its arguments differ from those
 * the ranks before it sent; else a new one. NULL when refused. */
static coll *submit_match(submission *s) {
  const shardd__coll_args *args = s->args;
  shardd__coll_member *m = s->m;
  coll *c = NULL;
  /* those before the rank's oldest unjoined one it has joined */
  coll *from = s->q->unjoined ? s->q->unjoined[m->rank] : s->q->head;
  for (coll *it = from; it; it = it->next) {
    s->e->counters.matched++;
    /* all_reduces match whatever their count: one of another count is a
     * mismatch that fails them all, not a collective of its own to wait
     * for ranks that never come */
    if (it->args.kind == args->kind &&
        (s->scalars || it->args.target == args->target) && !it->started &&
        !it->waiters[m->rank].arrived) {
      c = it;
      break;
    }
  }
  int same = c == NULL || args_equal(&c->args, args);
  for (size_t g = 0; c && same && s->hp && c->hp && g < c->opt->ngroups; g++)
    same = hp_equal(&c->hp[g], &s->hp[g]);
  if (c && c->refused == SHARDD_OK && s->local == SHARDD_OK && !same &&
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
  } else if (c && c->refused == SHARDD_OK && s->local == SHARDD_OK && !same) {
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
  if (c == NULL)
    c = submit_new(s);
  return c;
}

/* Arrival: s's rank waits in c (a rank refused here answered at once);
 * once every local rank has arrived c is scheduled, or failed now when a
 * rank gone past the grace will never come. */
static void submit_arrive(submission *s, coll *c) {
  const shardd__coll_args *args = s->args;
  shardd__coll_member *m = s->m;
  coll_job *q = s->q;
  /* bucket_fail spares the collectives that started: those the entries
   * before made ready start now, as each would have at its arrival
   * (before this one arrives, so a refused c is not among them) */
  if (c->bucket_bad)
    shardd__coll_sched_flush(s->e);
  free(s->hp); /* a later rank's, compared above */
  s->hp = NULL;
  waiter *w = &c->waiters[m->rank];
  w->m = m;
  w->seq = s->seq;
  w->arrived = 1;
  if (q->unjoined && q->unjoined[m->rank] == c) {
    coll *u = c->next;
    while (u && u->waiters[m->rank].arrived)
      u = u->next;
    q->unjoined[m->rank] = u;
  }
  w->want_grad = args->want_grad;
  w->in_bucket = args->bucket != 0;
  w->vals = s->vals;
  w->none_all = args->no_grad_all;
  w->no_grad = s->mask;
  w->nno_grad = s->nmask;
  s->vals = NULL;
  s->mask = NULL;
  m->pending++;
  c->order[c->arrived++] = m->rank;
  if (s->local != SHARDD_OK) {
    /* answered now, as on one node; its peers here learn of it with the
     * others when every local rank arrived */
    if (c->refused == SHARDD_OK) {
      c->refused = s->local;
      snprintf(c->refused_msg, sizeof c->refused_msg, "rank %" PRIu32 "'s %s was "
               "refused: %.200s", m->rank, shardd__coll_kind_word(args->kind),
               s->local_msg);
    }
    refuse(s->e, m, s->seq, args, s->local, s->local_msg);
    w->m = NULL;
    m->pending--;
  }
  if (c->bucket_bad)
    bucket_fail(c);
  int64_t doom;
  if (c->arrived == s->job->local_ranks) {
    if (c->refused != SHARDD_OK && shardd__coll_multi(c))
      /* answered now; the exchange's header still runs when schedule
       * starts it (start_phase), so the other nodes hear of the refusal */
      shardd__coll_answer_now(c, c->refused, c->refused_msg);
    else if (c->refused != SHARDD_OK)
      shardd__coll_finish(
          c, c->refused, c->refused_msg); /* it may have held back newer ones */
    shardd__coll_schedule(q);
    shardd__coll_job_maybe_quiet(q);
  } else if ((doom = shardd__coll_doomed_by(c, shardd__coll_loop_now(s->e))) >=
             0) {
    /* a rank gone past the grace will not submit it: say so now, not at
     * the timeout */
    shardd__coll_fail_doomed_one(c, (uint32_t)doom,
                                 shardd__coll_loop_now(s->e));
    shardd__coll_schedule(q);
    shardd__coll_job_maybe_quiet(q);
  }
}

static void submit(shardd__coll_engine *e, shardd__coll_member *m, uint64_t seq,
                   const shardd__coll_args *args) {
  submission s;
  memset(&s, 0, offsetof(submission, local_msg));
  s.e = e;
  s.m = m;
  s.seq = seq;
  s.args = args;
  s.job = m->job;
  s.scalars = args->kind == SHARDD__COLL_ALL_REDUCE;
  s.local = SHARDD_OK;
  s.local_msg[0] = '\0';
  if (submit_check(&s) != 0 || submit_admit(&s) != 0)
    return;
  coll *c = submit_match(&s);
  if (c != NULL)
    submit_arrive(&s, c);
}

