/* coll_fabric.c — the cross-node part of the engine's collectives.
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
 *            part of the sum, divided for mean. Then an allgather of each
 *            node's flags of which views had a gradient on some local rank
 *            (the step skips a view no node had one for).
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
 * A collective a node refused locally (a step's invalid per-group override
 * or lr, its ranks disagreeing with each other) still sends its header,
 * marked refused, and moves nothing: its ranks have their refusal, the
 * other nodes' fail with SHARDD_E_MISMATCH naming the node, instead of
 * waiting in the exchange until the timeout loses the fabric.
 *
 * Recovery. A fabric error leaves the fabric unusable (fabric.h), and the
 * job's collectives made before it fail with its reason when they reach
 * their exchange, even after a re-forming: they are the iteration it
 * broke (a bucket's later entries, a prefetch). The first exchange of a
 * collective made after it -- a trainer's retry -- re-forms the fabric: the dead one is aborted and
 * destroyed once no exchange is inside it, and a new one is made, which
 * waits at most the collective timeout for every node (a node whose
 * daemon restarted joins with its first exchange; one that does not come
 * back is named: E_PEER_LOST). Each failure starts a new epoch, and the
 * header's exchange counts restart with it on every node, as they start
 * at 0 on a restarted daemon. Every new fabric first allgathers a join
 * header (fab_join): the job's fabric lineage (node 0's random proposal
 * when the job's first fabric forms, kept by every later one and recorded
 * in each node's checkpoint part), whether the node rejoins from its own
 * exit part (restore.c), and a summary of its state (buffers: name, numel,
 * dtype; optimizers: name, step count) taken on the loop thread when the
 * exchange was submitted. The lineages must agree, and where any node has
 * one or rejoins, so must the states: a node restored from a part of
 * another step, or fresh, or of another run of the job, fails the join
 * with SHARDD_E_MISMATCH on every node, naming it, before anything moves.
 * A step one node applied and the other did not (steps without clipping
 * are node-local) is refused the same way: the other node lost the reduced
 * gradient it would need, so training on would mix two steps' parameters.
 *
 * Abandoned. Every rank of this node gone for --peer-grace (its trainers
 * stopped after a peer node's daemon was killed, so that the job can be
 * released and restored) leaves nobody waiting for the exchange or
 * re-forming in flight, which would otherwise hold the job (and refuse
 * its release) up to the collective timeout for a node that cannot come
 * back: shardd__coll_fab_cancel ends it at once with SHARDD_E_PEER_LOST,
 * the fabric stays failed, and a rank that comes back re-forms it.
 *
 * Stop. A stopping daemon must not wait for a peer that never answers (up
 * to the collective timeout, past the unit's stop timeout, so systemd's
 * SIGKILL would skip --checkpoint-on-exit): shardd__coll_fab_abort aborts
 * the job's fabric (its waits end at once, fabric.h), fails what is queued
 * and every later exchange with SHARDD_E_SHUTDOWN, and waits a bounded time
 * for the fabric threads to leave their exchanges, so the engine can answer
 * those collectives before the sessions close (coll.c).
 *
 * This file keeps the job's fabric state and its threads; the exchange (its
 * header, the checks, the data) is coll_exchange.c's, the join of a formed
 * fabric (lineage and states compared) coll_join.c's.
 */
#include "coll_int.h"

#include <errno.h>
#include <math.h>
#include <inttypes.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "fabric.h"
#include "hash.h"
#include "log.h"

/* ---- cross-node state of a job ------------------------------------------
 * Created on the loop thread when the job gets its layout; the fabric itself
 * is connected lazily by the first exchange (blocking, on a fabric thread),
 * so the loop never waits for a rendezvous. The mutex guards everything
 * below it up to the counts against the fabric threads and the status
 * reader, and is never held while waiting for a peer. */

enum { FAB_IDLE, FAB_UP, FAB_FAILED };

struct coll_fab {
  shardd__coll_engine *e;
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
  /* Recovery (see the top of the file). epoch: +1 each time the fabric
   * fails (an operation, or a (re)forming); an exchange submitted in the
   * current epoch of a failed fabric re-forms it, one made before
   * fails with the failure. gen: +1 at each fabric formed; a failure of an
   * exchange of an older fabric does not fail the new one. inuse:
   * exchanges inside an operation of f (a re-forming waits for them after
   * aborting f). formed: fabrics formed so far. lineage: the one the
   * nodes agreed on (0 none yet); rejoining: the job was restored from
   * this node's exit part (registry.h). */
  uint64_t epoch, gen;
  uint32_t inuse;
  uint64_t formed;
  uint64_t lineage;
  int rejoining;
  /* loop thread only: the epoch the counts below belong to */
  uint64_t counts_epoch;
  /* the job's fabric threads (see the top of the file) */
  coll *queue; /* exchanges no thread has taken yet, oldest first */
  uint32_t nqueued;
  uint32_t *running; /* [cap]: the tags being exchanged, one per thread */
  uint32_t nrunning;
  pthread_t *threads; /* [cap] */
  uint32_t nthreads, cap;
  int stop;
  /* the daemon is stopping: the fabric is aborted, exchanges fail with
   * SHARDD_E_SHUTDOWN and why */
  int aborting;
  char why[128];
  /* this node's ranks of the job all left (shardd__coll_fab_cancel): what
   * the fabric is doing now -- a re-forming's rendezvous waiting for a
   * node that was killed, an exchange waiting for a dead peer -- is
   * abandoned with SHARDD_E_PEER_LOST and why; cleared once no exchange
   * is queued or running, so a rank that comes back re-forms it */
  int cancel;
  char cancel_why[160];
  /* loop thread only: exchanges made so far per kind and target, by
   * fab_key (values: malloc'd uint64_t counts) */
  shardd__map counts;
};

/* Forms the job's fabric, or re-forms it after a failure: the dead one is
 * aborted (its exchanges, all of an older epoch, end at once), waited for
 * and destroyed; then a new one is created (a fresh namespace in the
 * rendezvous directory, fabric_gloo.cc) and the nodes compare their
 * states (fab_join). Called and returns under mu, with connecting clear;
 * sets it meanwhile, so other exchanges wait on the condition. */
static shardd_err jf_connect(coll_fab *jf, const coll *c, char *err,
                             size_t errlen) {
  shardd__fabric *old = jf->f;
  int reform = jf->formed > 0, rejoining = jf->rejoining;
  uint64_t had = jf->lineage;
  jf->f = NULL;
  jf->connecting = 1;
  if (old) {
    shardd__fabric_abort(old, "the job's fabric failed and is being re-formed");
    while (jf->inuse > 0)
      pthread_cond_wait(&jf->cv, &jf->mu);
  }
  pthread_mutex_unlock(&jf->mu);
  shardd__fabric_destroy(old);
  shardd__fabric *f = NULL;
  uint64_t lineage = 0;
  int at_rdv = 0;
  char why[640];
  shardd_err rc = shardd__fabric_create(&jf->opts, &f, why, sizeof why);
  if (rc != SHARDD_OK)
    at_rdv = 1;
  else if ((rc = shardd__coll_fab_join(jf, c, f, had, rejoining, &lineage, why,
                                       sizeof why)) != SHARDD_OK) {
    shardd__fabric_destroy(f);
    f = NULL;
  }
  pthread_mutex_lock(&jf->mu);
  if (rc != SHARDD_OK && jf->cancel && !jf->aborting) {
    rc = SHARDD_E_PEER_LOST;
    snprintf(err, errlen, "%s the fabric of job \"%.32s\" abandoned: %.200s",
             reform ? "re-forming" : "forming", c->job->name, jf->cancel_why);
  } else if (rc == SHARDD_OK)
    snprintf(err, errlen, "%s", "");
  else if (reform && at_rdv && rc == SHARDD_E_PEER_LOST)
    snprintf(err, errlen, "re-forming the fabric of job \"%.32s\": %.200s "
             "(restart its daemon with --restore of its exit checkpoint, then "
             "relaunch its ranks)", c->job->name, why);
  else
    snprintf(err, errlen, "%.380s", why);
  jf->connecting = 0;
  if (rc != SHARDD_OK) {
    jf->state = FAB_FAILED;
    jf->at_rendezvous = at_rdv;
    jf->code = rc;
    jf->epoch++;
    snprintf(jf->msg, sizeof jf->msg, "%s", err);
  } else {
    jf->f = f;
    jf->state = FAB_UP;
    jf->gen++;
    jf->formed++;
    jf->lineage = lineage;
    if (reform)
      shardd__log(2, "job \"%s\": fabric re-formed (fabric %" PRIu64 ", lineage "
                  "%016" PRIx64 ")", c->job->name, jf->formed, lineage);
    if (jf->aborting) /* the stop came while it connected */
      shardd__fabric_abort(f, jf->why);
  }
  pthread_cond_broadcast(&jf->cv);
  return rc;
}

/* The job's fabric for c's exchange, counted in inuse until jf_put. The
 * first exchange that needs it connects it; the others wait for that one
 * on the condition variable, not on the mutex. A failed fabric is
 * re-formed by the exchange of a collective made after the failure (a
 * retry); those made before fail with its reason. */
static shardd_err jf_get(coll_fab *jf, const coll *c, shardd__fabric **out,
                         uint64_t *gen, char *err, size_t errlen) {
  pthread_mutex_lock(&jf->mu);
  while (jf->connecting)
    pthread_cond_wait(&jf->cv, &jf->mu);
  shardd_err rc = SHARDD_OK;
  if (jf->aborting) {
    rc = SHARDD_E_SHUTDOWN;
    snprintf(err, errlen, "fabric: %s", jf->why);
  } else if (c->fab_epoch != jf->epoch) {
    /* made before the last failure (the fabric may be up again since) */
    rc = jf->code;
    snprintf(err, errlen, "%s", jf->msg);
  } else if (jf->state != FAB_UP && !c->fab_join_ok) {
    rc = SHARDD_E_NO_MEMORY;
    snprintf(err, errlen, "out of memory listing the job's state for the "
             "fabric's join");
  } else if (jf->state != FAB_UP) {
    rc = jf_connect(jf, c, err, errlen);
  }
  if (rc == SHARDD_OK) {
    *out = jf->f;
    *gen = jf->gen;
    jf->inuse++;
  }
  pthread_mutex_unlock(&jf->mu);
  return rc;
}

static void jf_put(coll_fab *jf) {
  pthread_mutex_lock(&jf->mu);
  jf->inuse--;
  pthread_cond_broadcast(&jf->cv);
  pthread_mutex_unlock(&jf->mu);
}

/* A fabric error latches: Gloo's connections do not recover, so every
 * collective made before it fails at once with the first reason, and
 * the next one re-forms the fabric (jf_get). An exchange of an older
 * fabric (gen) that fails after the re-forming aborted it leaves the new
 * one alone, and its ranks get the old failure instead of the abort's
 * SHARDD_E_SHUTDOWN (the daemon is not stopping). */
static void jf_broken(coll_fab *jf, uint64_t gen, shardd_err *code, char *msg,
                      size_t len) {
  pthread_mutex_lock(&jf->mu);
  if (jf->cancel && !jf->aborting && *code == SHARDD_E_SHUTDOWN) {
    *code = SHARDD_E_PEER_LOST;
    snprintf(msg, len, "the cross-node exchange was abandoned: %s",
             jf->cancel_why);
  }
  if (gen == jf->gen && jf->state == FAB_UP) {
    jf->state = FAB_FAILED;
    jf->at_rendezvous = 0;
    jf->code = *code;
    jf->epoch++;
    snprintf(jf->msg, sizeof jf->msg, "%s", msg);
  } else if (gen != jf->gen || (!jf->aborting && *code == SHARDD_E_SHUTDOWN)) {
    *code = SHARDD_E_PEER_LOST;
    snprintf(msg, len, "the job's fabric failed while this exchange ran "
             "(it is being re-formed): retry");
  }
  pthread_mutex_unlock(&jf->mu);
}

/* opts.stop: the rendezvous of a stopping daemon ends (any thread). */
static int jf_stopping(void *arg) {
  coll_fab *jf = arg;
  pthread_mutex_lock(&jf->mu);
  int v = jf->aborting || jf->cancel;
  pthread_mutex_unlock(&jf->mu);
  return v;
}

/* Never waits for the fabric threads: it held the loop (every client of
 * the daemon) up to a second for a thread stuck where no abort reaches
 * (Gloo's connect after the rendezvous), and nothing on the loop needs
 * them gone, as the abandoned collectives end through their fab_async like
 * any other. The last thread to leave clears cancel (fab_thread). */
int shardd__coll_fab_cancel(coll_fab *jf, const char *why) {
  pthread_mutex_lock(&jf->mu);
  if (jf->aborting || (jf->nrunning == 0 && jf->nqueued == 0)) {
    pthread_mutex_unlock(&jf->mu);
    return 0;
  }
  jf->cancel = 1;
  snprintf(jf->cancel_why, sizeof jf->cancel_why, "%s", why);
  if (jf->f)
    shardd__fabric_abort(jf->f, jf->cancel_why);
  pthread_cond_broadcast(&jf->cv);
  pthread_mutex_unlock(&jf->mu);
  return 1;
}

int shardd__coll_fab_abort(coll_fab *jf, const char *why, double max_s) {
  pthread_mutex_lock(&jf->mu);
  if (!jf->aborting) {
    jf->aborting = 1;
    snprintf(jf->why, sizeof jf->why, "%s", why ? why : "daemon stopping");
    if (jf->f)
      shardd__fabric_abort(jf->f, jf->why);
    pthread_cond_broadcast(&jf->cv);
  }
  /* Aborted waits end in microseconds; the bound only keeps a thread stuck
   * where no abort reaches (Gloo's connect after the rendezvous, which
   * every peer had reached) from holding the loop. */
  struct timespec until;
  clock_gettime(CLOCK_REALTIME, &until);
  double end = (double)until.tv_sec + (double)until.tv_nsec / 1e9 + max_s;
  until.tv_sec = (time_t)end;
  until.tv_nsec = (long)((end - (double)until.tv_sec) * 1e9);
  int quiet = 1;
  while (jf->nrunning > 0 || jf->nqueued > 0) {
    if (pthread_cond_timedwait(&jf->cv, &jf->mu, &until) == ETIMEDOUT) {
      quiet = jf->nrunning == 0 && jf->nqueued == 0;
      break;
    }
  }
  pthread_mutex_unlock(&jf->mu);
  return quiet;
}

static void free_value(void *value, void *arg) { free(value); }

static void jf_release(coll_fab *jf) {
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
  coll_fab *jf = req->data;
  shardd__fabric_destroy(jf->f);
  jf->f = NULL;
}

static void jf_release_done(uv_work_t *req, int status) {
  coll_fab *jf = req->data;
  free(req);
  jf_release(jf);
}

void shardd__coll_fab_free(shardd__coll_engine *e, coll_fab *jf) {
  if (jf == NULL)
    return;
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
  uv_work_t *req = jf->f && !e->stopping ? malloc(sizeof *req) : NULL;
  if (req) {
    req->data = jf;
    if (uv_queue_work(e->cfg.loop, req, jf_release_work, jf_release_done) == 0)
      return;
    free(req);
  }
  jf_release(jf);
}

/* FNV-1a 64 over the kind and the name: what names an exchange across
 * nodes (the header's name, and the tag folded from it). */
uint64_t shardd__coll_fab_key(shardd__coll_kind kind, const char *name) {
  /* the kind folded in as one word, as it always was: the key is on the
   * wire, so nodes of older versions must compute the same */
  uint64_t h = (SHARDD__FNV1A_BASIS ^ (uint64_t)kind) * SHARDD__FNV1A_PRIME;
  return shardd__fnv1a_str(h, name ? name : "");
}

uint32_t shardd__coll_fab_tag(uint64_t key) {
  return (uint32_t)(key ^ (key >> 32)) & 0x7fffffffu;
}

/* How many exchanges of key this node made before this one (loop thread);
 * -1 when out of memory. */
static int64_t fab_next_seq(coll_fab *jf, uint64_t key) {
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

shardd_err shardd__coll_job_span(shardd__coll_engine *e, shardd__job *job,
                                 uint32_t nodes, uint32_t node_rank,
                                 const char *rendezvous, const char *host,
                                 char *err, size_t errlen) {
  coll_job *cj = shardd__coll_job_of(e, job, 1);
  /* one thread per exchange in flight, and a started collective holds
   * every local rank's member, each in max_pending collectives at most */
  uint32_t cap = e->cfg.max_pending ? e->cfg.max_pending : 1;
  /* the files' namespace in the rendezvous directory: job names are per
   * uid, and two uids' jobs of one name (two specs giving uids, one
   * directory) must never meet there */
  char prefix[300];
  snprintf(prefix, sizeof prefix, "%" PRIu32 ".%s", job->uid, job->name);
  coll_fab *jf = cj ? calloc(1, sizeof *jf) : NULL;
  if (jf == NULL || (jf->rendezvous = strdup(rendezvous)) == NULL ||
      (jf->prefix = strdup(prefix)) == NULL ||
      (jf->host = strdup(host)) == NULL ||
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
  /* a restored part was laid out by restore (before its buffers) */
  shardd_err rc = job->nodes == nodes && job->node_rank == node_rank
                      ? SHARDD_OK
                      : shardd__job_set_layout(job, nodes, node_rank, err, errlen);
  if (rc != SHARDD_OK) {
    free(jf->rendezvous);
    free(jf->prefix);
    free(jf->host);
    free(jf->running);
    free(jf->threads);
    free(jf);
    return rc;
  }
  jf->e = e;
  jf->cap = cap;
  pthread_mutex_init(&jf->mu, NULL);
  pthread_cond_init(&jf->cv, NULL);
  shardd__map_init(&jf->counts);
  shardd__fabric_opts o = SHARDD__FABRIC_OPTS_INIT;
  o.rendezvous = jf->rendezvous;
  o.prefix = jf->prefix;
  o.host = jf->host;
  o.nodes = nodes;
  o.node_rank = node_rank;
  o.timeout_s = e->cfg.timeout;
  o.stop = jf_stopping;
  o.stop_arg = jf;
  jf->opts = o;
  jf->lineage = job->lineage;
  jf->rejoining = job->rejoining;
  cj->fab = jf;
  shardd__log(2,
              "job \"%s\": node %" PRIu32 " of %" PRIu32 ", ranks %" PRIu32
              "..%" PRIu32 " of %" PRIu32 ", rendezvous %s (%s)",
              job->name, job->node_rank, job->nodes, job->local_first,
              job->local_first + job->local_ranks - 1, job->world, rendezvous,
              shardd__fabric_engine());
  return SHARDD_OK;
}

static coll_fab *fab_of(shardd__coll_engine *e, const shardd__job *job) {
  coll_job *cj = shardd__coll_job_of(e, (shardd__job *)job, 0);
  return cj ? cj->fab : NULL;
}

uint64_t shardd__coll_fab_epoch(coll_fab *jf) {
  pthread_mutex_lock(&jf->mu);
  uint64_t v = jf->epoch;
  pthread_mutex_unlock(&jf->mu);
  return v;
}

uint64_t shardd__coll_job_lineage(shardd__coll_engine *e,
                                  const shardd__job *job) {
  coll_fab *jf = fab_of(e, job);
  if (jf == NULL)
    return job->lineage;
  pthread_mutex_lock(&jf->mu);
  uint64_t l = jf->lineage;
  pthread_mutex_unlock(&jf->mu);
  return l;
}

void shardd__coll_node_state(shardd__coll_engine *e, const shardd__job *job,
                             uint32_t n, char *state, size_t len) {
  coll_fab *jf = fab_of(e, job);
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

void shardd__coll_fabric_state(shardd__coll_engine *e, const shardd__job *job,
                               char *engine, size_t elen, char *msg,
                               size_t mlen) {
  coll_fab *jf = fab_of(e, job);
  const char *fe = shardd__fabric_engine();
  snprintf(engine, elen, "%s", jf && fe ? fe : "none");
  msg[0] = '\0';
  if (jf) {
    pthread_mutex_lock(&jf->mu);
    if (jf->state == FAB_FAILED)
      snprintf(msg, mlen, "%s", jf->msg);
    pthread_mutex_unlock(&jf->mu);
  }
}

/* What a node is about to exchange; every node's is allgathered first and
 * data moves only when all agree (see the top of the file). Fixed-width
 * fields and no padding, so the bytes compare as they are. */

static void fabric_task(coll *c, task *t) {
  coll_fab *jf = c->cj->fab;
  shardd__fabric *f;
  uint64_t gen;
  t->rc = jf_get(jf, c, &f, &gen, c->fab_msg, sizeof c->fab_msg);
  if (t->rc != SHARDD_OK)
    return;
  int lost = 0;
  shardd__coll_fab_exchange(c, t, f, &lost);
  if (lost)
    jf_broken(jf, gen, &t->rc, c->fab_msg, sizeof c->fab_msg);
  jf_put(jf);
}

/* ---- fabric threads (see the top of the file) ------------------------- */

static void fab_closed_cb(uv_handle_t *h) {
  coll *c = h->data;
  c->fab_busy = 0;
  shardd__coll_task_done(&c->fab_task->req, 0);
}

static void fab_async_cb(uv_async_t *h) {
  uv_close((uv_handle_t *)h, fab_closed_cb);
}

/* The oldest queued exchange whose tag no thread is exchanging; under mu. */
static coll *fab_pick(coll_fab *jf) {
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
  coll_fab *jf = arg;
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
    if (jf->nrunning == 0 && jf->nqueued == 0)
      jf->cancel = 0; /* what it abandoned has ended */
    pthread_cond_broadcast(&jf->cv); /* one of the same tag may go now */
    /* the last touch of c: from here the loop may free it */
    uv_async_send(&c->fab_async);
  }
  pthread_mutex_unlock(&jf->mu);
  return NULL;
}

/* Queues c's exchange (task t) for the job's fabric threads; loop thread.
 * The end always comes back through c->fab_async, failures too. */
void shardd__coll_fab_submit(coll *c, task *t) {
  coll_fab *jf = c->cj->fab;
  c->fab_task = t;
  c->fab_async.data = c;
  c->fab_busy = 0;
  int e = uv_async_init(c->e->cfg.loop, &c->fab_async, fab_async_cb);
  if (e != 0) { /* cannot happen for a valid loop; fail it inline then */
    t->rc = SHARDD_E_INTERNAL;
    snprintf(c->fab_msg, sizeof c->fab_msg, "uv_async_init: %s", uv_strerror(e));
    shardd__coll_task_done(&t->req, 0);
    return;
  }
  c->fab_busy = 1; /* until fab_closed_cb */
  /* while the fabric is not up, the state its (re)forming compares;
   * counts restart with each epoch on every node (a restarted node's start
   * at 0, as the survivor's do after the failure). A collective made
   * before the failure takes no count of the new epoch: it fails in
   * jf_get, and a count taken would put the retry's out of step. */
  pthread_mutex_lock(&jf->mu);
  uint64_t now = jf->epoch;
  int up = jf->state == FAB_UP;
  pthread_mutex_unlock(&jf->mu);
  if (jf->counts_epoch != now) {
    shardd__map_each(&jf->counts, free_value, NULL);
    shardd__map_free(&jf->counts);
    shardd__map_init(&jf->counts);
    jf->counts_epoch = now;
  }
  c->fab_join_ok = 0;
  if (!up && c->fab_epoch == now)
    shardd__coll_fab_state_of(c);
  int64_t seq = c->fab_epoch == now ? fab_next_seq(jf, c->name_key) : 0;
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
      shardd__log(1, "job \"%s\": cannot start fabric thread %" PRIu32
                  " (%s); the exchange waits for a busy one", c->job->name,
                  jf->nthreads + 1, strerror(e));
    }
  }
  pthread_cond_broadcast(&jf->cv);
  pthread_mutex_unlock(&jf->mu);
}


