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

#include "registry.h"

typedef enum {
  SHARDD__COLL_GATHER = 1,
  SHARDD__COLL_SCATTER = 2,
  SHARDD__COLL_STEP = 3
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
} shardd__coll_args;

/* One rank of a job as the engine sees it. The caller sets job and rank
 * before its first submit and keeps them until member_lost; pending is the
 * engine's (collectives it waits in, for --max-pending). */
typedef struct {
  shardd__job *job;
  uint32_t rank;
  uint32_t pending;
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
} shardd__coll_result;

typedef struct {
  void *ctx;
  /* m's request seq ended: code (and msg, NULL for a plain OK), res for a
   * successful step or transient gather (else NULL). Called from inside submit, member_lost,
   * tick and completions; it must not free m or call into the engine
   * (queue what it needs for later). */
  void (*done)(void *ctx, shardd__coll_member *m, uint64_t seq,
               shardd_err code, const char *msg,
               const shardd__coll_result *res);
  /* job's last collective ended: nothing of the engine holds it now. Called
   * last, so the hook may release the job (after shardd__coll_job_free). */
  void (*job_quiet)(void *ctx, shardd__job *job);
} shardd__coll_hooks;

typedef struct {
  uv_loop_t *loop;
  shardd__registry *reg;
  double timeout;                /* seconds a collective waits for all ranks */
  uint32_t max_pending;          /* collectives one member may wait in */
  uint32_t max_inflight_gathers; /* gathers one member may have queued; 0 any */
  shardd__coll_hooks hooks;
} shardd__coll_config;

typedef struct shardd__coll_engine shardd__coll_engine;

shardd_err shardd__coll_engine_create(const shardd__coll_config *cfg,
                                      shardd__coll_engine **out);
/* The loop is ending: from here fabrics are closed inline, not on the pool. */
void shardd__coll_engine_stop(shardd__coll_engine *e);
/* Frees the state of every job still known (none may have a collective in
 * flight) and the engine. */
void shardd__coll_engine_destroy(shardd__coll_engine *e);

/* Queues m's part of a collective; done comes when it completes or fails.
 * Refusals that need no waiting are answered at once (still through done). */
void shardd__coll_submit(shardd__coll_engine *e, shardd__coll_member *m,
                         uint64_t seq, const shardd__coll_args *args);

/* m is going away: every collective of its job still waiting for ranks
 * fails with SHARDD_E_PEER_LOST; running ones forget m. */
void shardd__coll_member_lost(shardd__coll_engine *e, shardd__coll_member *m);

/* Fails collectives that waited past the timeout (now: loop seconds). */
void shardd__coll_tick(shardd__coll_engine *e, double now);

/* Makes job span sp->nodes daemons, this one node sp->node_rank
 * (shardd__job_set_layout), with the cross-node fabric state its
 * collectives need; the fabric connects at the first exchange. Only for a
 * job that has no layout yet. */
shardd_err shardd__coll_job_span(shardd__coll_engine *e, shardd__job *job,
                                 uint32_t nodes, uint32_t node_rank,
                                 const char *rendezvous, const char *host,
                                 char *err, size_t errlen);

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

/* Collectives queued or running in job (0 before it may be released). */
uint32_t shardd__coll_inflight(const shardd__coll_engine *e,
                               const shardd__job *job);
/* Frees the job's (idle) engine state; call before releasing the job. */
void shardd__coll_job_free(shardd__coll_engine *e, shardd__job *job);

#endif /* SHARDD_COLL_H */
