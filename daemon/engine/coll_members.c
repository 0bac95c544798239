/* coll_members.c — the ranks of a collective coming and going: a member
 * lost and its grace (--peer-grace), one that joined again, the ranks
 * missing past the grace that doom the collectives they never sent, the
 * timeouts and stuck ranks (the tick), a job broken, the daemon's stop. */
#include "coll_int.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>

#include "log.h"
#include "lowest.h"

/* The missing rank that dooms unstarted c at now, or -1: a rank lost past
 * the grace that had not submitted c, while a rank waiting in c joined
 * before that loss (it was the lost one's peer, so it will not be back
 * for c). Ranks that joined after the loss (a job relaunched rank by rank)
 * wait for it as at the job's start. */
int64_t shardd__coll_doomed_by(const coll *c, double now) {
  const coll_job *q = c->cj;
  if (c->started || q->lost_at == NULL)
    return -1;
  double grace = c->e->cfg.peer_grace;
  int64_t doom = -1; /* the lowest such rank, as a walk of them all found */
  for (uint32_t k = 0; k < q->nlost; k++) {
    uint32_t r = q->lost_ranks[k];
    if ((doom >= 0 && r >= doom) || c->waiters[r].arrived ||
        now < q->lost_at[r] + grace)
      continue;
    for (uint32_t i = 0; i < c->arrived; i++) { /* the local ranks there */
      const shardd__coll_member *m = c->waiters[c->order[i]].m;
      if (m && m->joined < q->lost_epoch[r]) {
        doom = r;
        break;
      }
    }
  }
  return doom;
}

/* Fails c, which rank r dooms, naming r; the first failure of each loss is
 * logged (a loss that fails nothing, a job's ranks leaving at its end, is
 * only the session's line). */
void shardd__coll_fail_doomed_one(coll *c, uint32_t r, double now) {
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
  shardd__coll_finish(c, SHARDD_E_PEER_LOST, msg);
}

/* Fails every waiting collective of q a missing rank dooms; 1 if any. */
static int fail_doomed(coll_job *q, double now) {
  if (q->lost_at == NULL)
    return 0;
  int any = 0;
  for (coll *c = q->head, *next; c; c = next) {
    next = c->next;
    int64_t r = shardd__coll_doomed_by(c, now);
    if (r < 0)
      continue;
    shardd__coll_fail_doomed_one(c, (uint32_t)r,
                                 now); /* unlinks c only; next stays */
    any = 1;
  }
  if (any)
    shardd__coll_schedule(q);
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
  shardd__log(SHARDD__LOG_INFO,
              "job \"%s\": rank %" PRIu32 " is back after "
              "%.1f s",
              m->job->name, m->rank,
              shardd__coll_loop_now(e) - q->lost_at[m->rank]);
  q->lost_at[m->rank] = -1;
  uint32_t i = q->lost_pos[m->rank], last = q->lost_ranks[--q->nlost];
  q->lost_ranks[i] = last;
  q->lost_pos[last] = i;
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
    q->lost_ranks = malloc(w * sizeof *q->lost_ranks);
    q->lost_pos = malloc(w * sizeof *q->lost_pos);
    q->nlost = 0;
    if (q->lost_at == NULL || q->lost_epoch == NULL || q->lost_told == NULL ||
        q->lost_ranks == NULL || q->lost_pos == NULL) {
      free(q->lost_at);
      free(q->lost_epoch);
      free(q->lost_told);
      free(q->lost_ranks);
      free(q->lost_pos);
      q->lost_at = NULL;
      q->lost_epoch = NULL;
      q->lost_told = NULL;
      q->lost_ranks = NULL;
      q->lost_pos = NULL;
      shardd__log(SHARDD__LOG_ERROR, "job \"%s\": out of memory noting that "
                  "rank %" PRIu32 " left; its peers wait up to the collective "
                  "timeout", q->job->name, m->rank);
      return;
    }
    for (uint32_t r = 0; r < w; r++)
      q->lost_at[r] = -1;
  }
  if (q->lost_at[m->rank] < 0) {
    q->lost_pos[m->rank] = q->nlost;
    q->lost_ranks[q->nlost++] = m->rank;
  }
  q->lost_at[m->rank] = q->last_lost_at = shardd__coll_loop_now(e);
  q->lost_epoch[m->rank] = q->last_lost_epoch = ++e->epoch;
  q->lost_told[m->rank] = 0;
}

double shardd__coll_rank_missing_s(const shardd__coll_engine *e,
                                   const shardd__job *job, uint32_t rank) {
  const coll_job *q = shardd__map_get_id(&e->jobs, shardd__coll_job_key(job));
  if (q == NULL || q->lost_at == NULL || rank >= job->world || q->lost_at[rank] < 0)
    return -1;
  return shardd__coll_loop_now(e) - q->lost_at[rank];
}

/* The i-th collective of job's queue, its kind, target, name and wait in
 * *out; NULL when there are fewer. */
static const coll *describe_head(const shardd__coll_engine *e,
                                 const shardd__job *job, size_t i,
                                 shardd__coll_info *out) {
  const coll_job *q = shardd__map_get_id(&e->jobs, shardd__coll_job_key(job));
  const coll *c = q ? q->head : NULL;
  for (; c && i > 0; i--)
    c = c->next;
  if (c == NULL)
    return NULL;
  out->kind = c->args.kind;
  out->target = c->args.target;
  out->name = c->name;
  out->running = c->started;
  /* (arrival + timeout) - timeout may round above arrival: never below 0 */
  out->waited_s = shardd__coll_loop_now(e) - (c->deadline - e->cfg.timeout);
  if (!(out->waited_s > 0))
    out->waited_s = 0;
  return c;
}

shardd_err shardd__coll_describe_ranks(const shardd__coll_engine *e,
                                       const shardd__job *job, size_t i,
                                       shardd__coll_info *out,
                                       shardd__coll_ranks *rk) {
  const coll *c = describe_head(e, job, i, out);
  if (c == NULL)
    return SHARDD_E_NOT_FOUND;
  uint32_t first = job->local_first, end = first + job->local_ranks;
  shardd__lowest low;
  shardd__lowest_init(&low, rk->arrived, rk->max);
  rk->arrived_all = 0;
  for (uint32_t k = 0; k < c->arrived; k++)
    if (c->order[k] >= first && c->order[k] < end) {
      shardd__lowest_add(&low, c->order[k]);
      rk->arrived_all++;
    }
  rk->n_arrived = shardd__lowest_finish(&low);
  rk->n_waiting = 0;
  rk->waiting_all = c->started ? 0 : job->local_ranks - rk->arrived_all;
  /* each step lists one or passes a rank that arrived: at most max + those */
  for (uint32_t k = first; !c->started && k < end && rk->n_waiting < rk->max; k++)
    if (!c->waiters[k].arrived)
      rk->waiting[rk->n_waiting++] = k;
  return SHARDD_OK;
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
    shardd__coll_finish(c, code, msg);
    /* coll_finish may only unlink c; `next` stays valid. */
  }
  shardd__coll_schedule(q);
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
  fail_doomed(
      q, shardd__coll_loop_now(e)); /* --peer-grace 0: the rest too, at once */
  shardd__coll_job_maybe_quiet(q);
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
  coll_job *cj = shardd__map_get_id(&a->e->jobs, shardd__coll_job_key(job));
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
    shardd__coll_fabric_failure(
        c, rc != SHARDD_E_SHUTDOWN && c->fab_msg[0] ? c->fab_msg : detail, msg,
        sizeof msg);
    c->rc = rc;
    if (shardd__coll_answer_now(c, rc, msg) > 0 && n++ == 0 && first)
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
    shardd__coll_job_maybe_quiet(a.jobs[i]);
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
  shardd__coll_job_maybe_quiet(q);
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
    shardd__coll_finish(hit[i], SHARDD_E_MISMATCH, msgs[i]);
  }
  free(hit);
  free(msgs);
  if (k > 0)
    shardd__coll_schedule(q);
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
    if (q->lost_at) {
      for (uint32_t k = 0; k < q->nlost; k++)
        q->lost_at[q->lost_ranks[k]] += stall;
      q->last_lost_at += stall;
    }
    q->last_submit += stall;
  }
}

/* A multi-node job all of whose ranks on this node left (trainers
 * stopped, typically to release the job after a peer node's daemon was
 * killed) and stayed away for --peer-grace: nobody waits for the
 * exchange or fabric re-forming its started collectives are in, which
 * could wait for a dead node up to the collective timeout and hold the
 * job (refusing `shardctl release`) all that time. It is abandoned (once
 * per such loss); the collectives end with E_PEER_LOST. */
static void abandon_fabric(coll_job *q, double now) {
  const shardd__job *job = q->job;
  /* Every local rank lost (only this node's ranks are members here) and
   * the last of them past the grace. This read every local rank, every
   * tick, for as long as such a job lingered: ticks over jobs of 32768
   * local ranks each held the loop in proportion, for nothing. */
  if (q->fab == NULL || q->lost_at == NULL || q->nlost < job->local_ranks)
    return; /* a rank is here */
  if (now < q->last_lost_at + q->e->cfg.peer_grace)
    return; /* the last may still come back */
  uint64_t latest = q->last_lost_epoch;
  if (latest == q->fab_abandoned)
    return;
  int started = 0;
  for (coll *c = q->head; c && !started; c = c->next)
    started = c->started && before_fanout(c);
  if (!started)
    return;
  q->fab_abandoned = latest;
  char why[160];
  snprintf(why, sizeof why, "every rank of job \"%.64s\" on this node left "
           "(over --peer-grace %g s ago)", job->name, q->e->cfg.peer_grace);
  if (shardd__coll_fab_cancel(q->fab, why))
    shardd__log(SHARDD__LOG_WARN, "job \"%s\": its cross-node exchange or "
                "fabric re-forming abandoned: %s; nobody waits for it, and it "
                "held the job (no release) up to the collective timeout",
                job->name, why);
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
    abandon_fabric(a.jobs[i], now);
    char first[512];
    uint32_t n = fail_waiting(a.jobs[i], SHARDD_E_PEER_LOST, pick_expired, &t,
                              describe_expired, first, sizeof first);
    if (n > 0)
      shardd__log(SHARDD__LOG_WARN, "job \"%s\": %" PRIu32 " collective(s) "
                  "timed out (--collective-timeout): %s%s",
                  a.jobs[i]->job->name, n, first, n > 1 ? " (and others)" : "");
    shardd__coll_job_maybe_quiet(a.jobs[i]);
  }
  free(a.jobs);
}

