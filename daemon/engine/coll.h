/* coll.h — the collective engine: gather, scatter and step as collectives
 * over the ranks of a job. Each rank's request waits until every local rank
 * made the same call, then the work runs on libuv's thread pool (the
 * cross-node exchange of a multi-node job on the job's own fabric threads,
 * coll_fabric.c says why) and every waiting rank is answered through the
 * done hook. Work on a buffer runs in submission order; work on disjoint
 * buffers may overlap.
 *
 * The engine knows nothing of connections or the wire: a rank is a
 * shardd__coll_member the caller embeds in whatever stands for it, and
 * everything the engine has to say goes out through the hooks given at
 * creation (the way libuv hands completion to callbacks).
 *
 * Ownership: the engine owns its per-job state (queues, communicators,
 * fabric threads), kept by job and freed with shardd__coll_job_free before
 * the registry releases that job. A queued collective borrows its members:
 * shardd__coll_member_lost must be called before a member is freed. Loop
 * thread only. */
#ifndef SHARDD_COLL_H
#define SHARDD_COLL_H

#include <stddef.h>
#include <stdint.h>
#include <uv.h>

#include "optspec.h"
#include "registry.h"

typedef enum {
  SHARDD__COLL_GATHER = 1,
  SHARDD__COLL_SCATTER = 2,
  SHARDD__COLL_STEP = 3,
  /* a few scalars over the job's ranks (target: how many; 0 a barrier) */
  SHARDD__COLL_ALL_REDUCE = 4
} shardd__coll_kind;

typedef struct {
  shardd__coll_kind kind;
  uint64_t target; /* buffer (gather, scatter) or optimizer (step) */
  shardd_reduce_op op;
  int has_lr;
  double lr;
  double max_norm;
  uint64_t generation; /* gather, scatter: the buffer's, 0 unchecked */
  /* gather in a transient job: this rank also leases its gradient area
   * (a rank's own choice: not compared between ranks) */
  int want_grad;
  /* scatter: add to the reduced gradient of the scatters since the last
   * step (a later backward of one step's gradient accumulation) instead of
   * replacing it */
  int accumulate;
  /* step: compute the global gradient norm only (FSDP's clip_grad_norm_):
   * no update, the step count stays; with max_norm > 0 the next step
   * scales the gradients by min(1, max_norm / (norm + 1e-6)) */
  int norm_only;
  /* step: ngroup_hp overrides, one per param group of the optimizer (or
   * none), overlaid on the group's registered values after lr; read
   * during submit only (the engine keeps the resolved values) */
  const shardd__optspec_hp *group_hp;
  size_t ngroup_hp;
  /* all_reduce: this rank's values ([target], borrowed for the submit;
   * SHARDD_ALL_REDUCE_MAX at most); op any of sum, mean, max, min */
  const double *values;
  /* scatter: the views of the buffer that got no gradient on this rank
   * (borrowed for the call; the engine copies them), or with no_grad_all
   * the whole buffer. A rank's own: not compared between ranks. Neither
   * set (an old client): every view had one. After the scatter a view
   * has a gradient when some rank sent one for it, and a step skips the
   * views held without one (torch skips a parameter whose .grad is None).
   * In a multi-node job each node's flags cross the fabric with the
   * exchange (every node must hold the same views of the buffer). */
  const uint64_t *no_grad;
  size_t nno_grad;
  int no_grad_all;
  /* gather, scatter: one entry of a bucket (several collectives a rank
   * sent in one request, all submitted with its seq): bucket identifies
   * the bucket's list (kind and buffers, in order; 0: not in a bucket),
   * bucket_n its entries, bucket_index this one's place. Ranks must agree
   * on it: a rank whose bucket differs from the ranks before it fails the
   * collective and every unstarted one the ranks involved sent with those
   * buckets, at once (E_MISMATCH), so no bucket waits for an entry that
   * another rank never sends. A bucket counts as one gather against
   * max_inflight_gathers (its first entry is the one checked). */
  uint64_t bucket;
  uint32_t bucket_n, bucket_index;
  /* gather, scatter: the target already resolved by the caller, in this
   * loop turn, exactly as submit would (shardd__registry_resolve_gen with
   * target, generation and SHARDD__OBJ_BUFFER, in the submitting rank's
   * job), or NULL for submit to resolve it. A bucket's handler checks
   * every entry before submitting any: a second lookup each was a cost of
   * its own. Never kept past the submit (the collective holds its own). */
  shardd__obj *resolved;
} shardd__coll_args;

/* One rank of a job as the engine sees it. The caller sets job and rank
 * before its first submit and keeps them until member_lost; pending is the
 * engine's (collectives it waits in, for --max-pending), and so is joined
 * (when shardd__coll_member_joined last saw it; 0 never). */
typedef struct {
  shardd__job *job;
  uint32_t rank;
  uint32_t pending;
  uint64_t joined;
} shardd__coll_member;

/* What a completed collective reports beyond its code: a step its count
 * and norm; a gather of a transient job where the member's leased areas
 * are (its gradient area too when it asked for one). */
typedef struct {
  shardd__coll_kind kind;
  uint64_t step;
  int has_total_norm;
  double total_norm;
  shardd__area gather;
  int has_grad;
  shardd__area grad;
  /* all_reduce: the reduction ([nvalues], borrowed for the hook's call) */
  const double *values;
  uint32_t nvalues;
  uint64_t target; /* the buffer or optimizer (an entry of a bucket) */
} shardd__coll_result;

typedef struct {
  void *ctx;
  /* m's request seq ended: code (and msg, NULL for a plain OK), res for a
   * successful step or transient gather (else NULL); an entry of a bucket
   * (args.bucket set in m's own submit) always has res, its kind and
   * target telling the entries of one seq apart; a request sent alone
   * never has it on failure, whoever made the collective it failed in. Called from inside submit, member_lost,
   * tick and completions; it must not free m or call into the engine
   * (queue what it needs for later). */
  void (*done)(void *ctx, shardd__coll_member *m, uint64_t seq,
               shardd_err code, const char *msg,
               const shardd__coll_result *res);
  /* job's last collective ended: nothing of the engine holds it now. Called
   * last, so the hook may release the job (after shardd__coll_job_free). */
  void (*job_quiet)(void *ctx, shardd__job *job);
  /* A step of opt is about to change its first byte (its updates are
   * planned, none has run): step is the count it will reach. Loop
   * thread; must not call into the engine. NULL: nobody asks. */
  void (*step_begin)(void *ctx, shardd__job *job, shardd__optim *opt,
                     uint64_t step);
  /* That step ended, before any rank hears of it: code SHARDD_OK when
   * every update ran (opt's step count is step now), else the error it
   * failed with (some updates may have run). Paired with each
   * step_begin. NULL: nobody asks. */
  void (*step_end)(void *ctx, shardd__job *job, shardd__optim *opt,
                   uint64_t step, shardd_err code);
} shardd__coll_hooks;

typedef struct {
  uv_loop_t *loop;
  shardd__registry *reg;
  double timeout;                /* seconds a collective waits for all ranks */
  /* seconds a lost rank has to come back before the collectives of the
   * ranks that were its peers fail (0: at once) */
  double peer_grace;
  uint32_t max_pending;          /* collectives one member may wait in */
  uint32_t max_inflight_gathers; /* gathers one member may have queued; 0 any */
  shardd__coll_hooks hooks;
} shardd__coll_config;

typedef struct shardd__coll_engine shardd__coll_engine;

shardd_err shardd__coll_engine_create(const shardd__coll_config *cfg,
                                      shardd__coll_engine **out);
/* The loop is ending: from here fabrics are closed inline, not on the pool. */
void shardd__coll_engine_stop(shardd__coll_engine *e);
/* The daemon is stopping: every collective still waiting for ranks fails
 * with SHARDD_E_SHUTDOWN and a message starting with why (borrowed), so a
 * waiting rank hears of the stop, not of the ranks the stop then
 * disconnects. A multi-node job's fabric is aborted: collectives inside a
 * cross-node exchange fail too (E_SHUTDOWN, their message naming why) and
 * are answered now, without waiting for a peer (a bounded wait of the
 * loop, milliseconds). Other running ones are left to finish (local work).
 * Returns how many failed. */
uint32_t shardd__coll_stop_waiting(shardd__coll_engine *e, const char *why);
/* Frees the state of every job still known (none may have a collective in
 * flight) and the engine. The engine's own handles (coll_run.c: a small
 * collective's completion on the loop turn it ran) are open only while a
 * completion is due and closed on that same turn, so once the loop has run
 * past the last completion none is left for uv_loop_close. */
void shardd__coll_engine_destroy(shardd__coll_engine *e);

/* Queues m's part of a collective; done comes when it completes or fails.
 * Refusals that need no waiting are answered at once (still through done). */
void shardd__coll_submit(shardd__coll_engine *e, shardd__coll_member *m,
                         uint64_t seq, const shardd__coll_args *args);

/* Several submits in a row (a bucket's entries): the small collectives
 * they start (a buffer of at most 256 KiB over all ranks) run together at
 * _end, by the loop thread when their bytes fit what it may copy for the
 * request (LOOP_HELP_BYTES, 4 MiB over all ranks): alone, or from 3 MiB
 * with pool turns beside it when that took the loop less time lately (a
 * CPU idle); else split over a few pool turns, instead of one pool turn
 * each: with many small buffers the wake-ups, not the copies, were the
 * cost. Nests; completion is unchanged (done hooks after the submit
 * returned, never inside it). */
void shardd__coll_batch_begin(shardd__coll_engine *e);
void shardd__coll_batch_end(shardd__coll_engine *e);

/* m (its job and rank set) now holds its rank: a rank lost before is back,
 * and the collectives still waiting for it wait on. Call before m's first
 * submit after each claim of the rank. */
void shardd__coll_member_joined(shardd__coll_engine *e, shardd__coll_member *m);

/* m is going away: running collectives forget m; waiting ones m had joined
 * fail with SHARDD_E_PEER_LOST at once (m's part of them is gone). Its rank
 * is then missing: unless a member joins for it within peer_grace, every
 * other waiting collective of the job, and every one submitted later, that
 * a rank joined before m left is waiting in fails with SHARDD_E_PEER_LOST
 * naming the rank (at the tick past the grace, or at submit). Members that
 * joined after the loss (a relaunched job) wait for it as at the start,
 * up to the timeout. */
void shardd__coll_member_lost(shardd__coll_engine *e, shardd__coll_member *m);

/* A refusal every collective of job depends on, of rank's (its initial
 * values differ from the other ranks', so each rank trains another model):
 * every collective of the job still waiting fails with code and msg now,
 * and each submitted later by a member that joined before this is refused
 * with them at once (until a member joins for rank again); a relaunch's
 * members, joining after, are not. So the ranks already waiting hear the
 * real cause, not a lost peer once the refused rank exits. */
void shardd__coll_job_break(shardd__coll_engine *e, shardd__job *job,
                            uint32_t rank, shardd_err code, const char *msg);

/* Fails collectives that waited past the timeout, and those a rank missing
 * past peer_grace dooms (now: loop seconds). Both are logged. A waiting
 * collective whose missing ranks are all stuck in other collectives of the
 * job that wait for one of its own ranks (no rank can move), while no rank
 * submitted anything for peer_grace, fails with SHARDD_E_MISMATCH naming
 * the ranks that did not call it and what they wait in instead; a rank
 * with no collective queued (computing) or one running is never stuck. */
void shardd__coll_tick(shardd__coll_engine *e, double now);

/* Makes job span sp->nodes daemons, this one node sp->node_rank
 * (shardd__job_set_layout), with the cross-node fabric state its
 * collectives need; the fabric connects at the first exchange. Only for a
 * job that has no layout yet. */
shardd_err shardd__coll_job_span(shardd__coll_engine *e, shardd__job *job,
                                 uint32_t nodes, uint32_t node_rank,
                                 const char *rendezvous, const char *host,
                                 char *err, size_t errlen);

/* The job's fabric lineage (registry.h: shardd__job.lineage): the one its
 * fabric formed with, or job->lineage when none formed since it was
 * made; 0 for a single-node job. Loop thread. */
uint64_t shardd__coll_job_lineage(shardd__coll_engine *e,
                                  const shardd__job *job);

/* For status: node n's state in a multi-node job ("this daemon", "not
 * contacted", "up", "unreachable", "lost"), and the fabric's engine and last
 * error (msg may be ""). */
void shardd__coll_node_state(shardd__coll_engine *e, const shardd__job *job,
                             uint32_t n, char *state, size_t len);
void shardd__coll_fabric_state(shardd__coll_engine *e, const shardd__job *job,
                               char *engine, size_t elen, char *msg,
                               size_t mlen);

/* Whether a started gather of b is writing its ranks' gather areas (a
 * transient area must not be given back under it; a queued one leases
 * again when it starts). */
int shardd__coll_gathering(const shardd__coll_engine *e,
                           const shardd__buffer *b);

/* Whether rank sent a scatter of b that has not ended: 1 queued, 2
 * running, 0 none. Either reads the gradient area rank holds (a queued
 * one when it starts), so that area must not be given back meanwhile.
 * O(the job's queue). */
int shardd__coll_scattering(const shardd__coll_engine *e,
                            const shardd__buffer *b, uint32_t rank);

/* Whether m waits in a collective it submitted with seq (queued, or
 * running and not yet answered): the caller keeps state by a request's
 * seq only for seqs no collective of m will also end with. O(the job's
 * queue). */
int shardd__coll_member_waits(const shardd__coll_engine *e,
                              const shardd__coll_member *m, uint64_t seq);

/* What the engine did, counted since it was made (tests, benches):
 * made: collectives created; matched: queue entries looked at to match
 * a rank's request to a collective; sched_passes: scheduling passes over
 * a job's queue; sched_visits: queue entries those passes looked at. */
typedef struct {
  uint64_t made, matched, sched_passes, sched_visits;
  /* of made: those whose memory was a freed collective's (coll_int.h's
   * spare blocks), not a new allocation */
  uint64_t reused;
  /* buckets run by the loop with pool turns beside it (coll_run.c) */
  uint64_t split;
} shardd__coll_counters;

void shardd__coll_get_counters(const shardd__coll_engine *e,
                               shardd__coll_counters *out);

/* "gather", "scatter", "step" (messages, status). */
const char *shardd__coll_kind_word(shardd__coll_kind k);

/* For status: one collective queued or running in a job. */
typedef struct {
  shardd__coll_kind kind;
  uint64_t target;  /* all_reduce: how many values */
  const char *name; /* the target's; borrowed until the engine is next called */
  int running;
  double waited_s; /* since its first rank submitted it */
} shardd__coll_info;

/* For status and an operator's checkpoint that timed out: a collective's
 * local ranks, as lists of the caller's. */
typedef struct {
  size_t max;          /* the room in each list, set by the caller */
  uint32_t *arrived;   /* the lowest that submitted it, ascending */
  uint32_t *waiting;   /* the lowest that did not (none once it runs) */
  size_t n_arrived, n_waiting;
  uint32_t arrived_all, waiting_all; /* how many of each in all */
} shardd__coll_ranks;

/* The i-th collective of job's queue (0 the oldest) into out, and its
 * local ranks into rk; SHARDD_E_NOT_FOUND past the last. Lists instead of
 * a world-sized map: costs the ranks that arrived and max, not the job's
 * world (a status of 1024 collectives of world 65536 walked 64 Mi ranks). */
shardd_err shardd__coll_describe_ranks(const shardd__coll_engine *e,
                                       const shardd__job *job, size_t i,
                                       shardd__coll_info *out,
                                       shardd__coll_ranks *rk);

/* For status: seconds since rank of job was lost and no member joined for
 * it again; < 0 when it is held, or was never lost. */
double shardd__coll_rank_missing_s(const shardd__coll_engine *e,
                                   const shardd__job *job, uint32_t rank);

/* Collectives queued or running in job (0 before it may be released). */
uint32_t shardd__coll_inflight(const shardd__coll_engine *e,
                               const shardd__job *job);
/* Frees the job's (idle) engine state; call before releasing the job. */
void shardd__coll_job_free(shardd__coll_engine *e, shardd__job *job);

#endif /* SHARDD_COLL_H */
