/* collective.h — gather, scatter and step as collectives over the ranks of a
 * job: each request waits until every rank made the same call, then the work
 * runs on libuv's thread pool and every waiting rank is answered. Work on a
 * buffer runs in submission order; work on disjoint buffers may overlap.
 * The cross-node exchange of a multi-node job's collective, which waits for
 * the other daemons, runs on the job's own fabric threads, never on the
 * pool (collective.c says why).
 *
 * Ownership: the per-job queue (job->coll) is this module's; a queued
 * collective borrows its sessions, and shardd__coll_session_lost must be
 * called before a session is freed. */
#ifndef SHARDD_COLLECTIVE_H
#define SHARDD_COLLECTIVE_H

#include "server.h"

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
} shardd__coll_args;

/* Queues s's part of a collective; the reply comes when it completes or
 * fails. Refusals that need no waiting are answered at once. */
void shardd__coll_submit(shardd__server *srv, shardd__session *s, uint64_t seq,
                         const shardd__coll_args *args);

/* s is going away: every collective of its job still waiting for ranks
 * fails with SHARDD_E_PEER_LOST; running ones forget s. */
void shardd__coll_session_lost(shardd__server *srv, shardd__session *s);

/* Fails collectives that waited past the timeout. */
void shardd__coll_tick(shardd__server *srv, double now);

/* Applies the --job-spec naming job, if any, when rank says Hello: gives a
 * new job its node layout and cross-node fabric state, and refuses (with
 * the node that holds it) a rank this daemon does not hold, a world other
 * than the spec's, or a multi-node job this build cannot serve. */
shardd_err shardd__coll_job_layout(shardd__server *srv, shardd__job *job,
                                   uint32_t rank, char *err, size_t errlen);

/* For status: node n's state in a multi-node job ("this daemon", "not
 * contacted", "up", "unreachable", "lost"), and the fabric's engine and last
 * error (msg may be ""). */
void shardd__coll_node_state(shardd__job *job, uint32_t n, char *state,
                             size_t len);
void shardd__coll_fabric_state(shardd__job *job, char *engine, size_t elen,
                               char *msg, size_t mlen);

/* Collectives queued or running in job (0 before it may be released). */
uint32_t shardd__coll_inflight(const shardd__job *job);
/* Frees the job's (empty) queue state. */
void shardd__coll_job_free(shardd__job *job);

#endif /* SHARDD_COLLECTIVE_H */
