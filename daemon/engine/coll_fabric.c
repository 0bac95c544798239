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
 * Stop. A stopping daemon must not wait for a peer that never answers (up
 * to the collective timeout, past the unit's stop timeout, so systemd's
 * SIGKILL would skip --checkpoint-on-exit): shardd__coll_fab_abort aborts
 * the job's fabric (its waits end at once, fabric.h), fails what is queued
 * and every later exchange with SHARDD_E_SHUTDOWN, and waits a bounded time
 * for the fabric threads to leave their exchanges, so the engine can answer
 * those collectives before the sessions close (coll.c).
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
  /* loop thread only: exchanges made so far per kind and target, by
   * fab_key (values: malloc'd uint64_t counts) */
  shardd__map counts;
};

static shardd_err fab_join(coll_fab *jf, const coll *c, shardd__fabric *f,
                           uint64_t lineage, int rejoining, uint64_t *out,
                           char *err, size_t errlen);

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
  else if ((rc = fab_join(jf, c, f, had, rejoining, &lineage, why,
                          sizeof why)) != SHARDD_OK) {
    shardd__fabric_destroy(f);
    f = NULL;
  }
  if (rc == SHARDD_OK)
    snprintf(err, errlen, "%s", "");
  else if (reform && at_rdv && rc == SHARDD_E_PEER_LOST)
    snprintf(err, errlen, "re-forming the fabric of job \"%.32s\": %.200s "
             "(restart its daemon with --restore of its exit checkpoint, then "
             "relaunch its ranks)", c->job->name, why);
  else
    snprintf(err, errlen, "%.380s", why);
  pthread_mutex_lock(&jf->mu);
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
  int v = jf->aborting;
  pthread_mutex_unlock(&jf->mu);
  return v;
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
typedef struct {
  uint32_t magic, kind; /* kind | FAB_KIND_REFUSED: refused on that node */
  uint64_t name;  /* fab_key */
  uint64_t seq;   /* exchanges of this kind and target the node made before */
  uint64_t numel; /* the buffer's (0 for step) */
  uint64_t bytes; /* payload per node */
  uint32_t dtype, op;
  /* scatter: the buffer's views, whose gradient flags follow the data
   * (UINT64_MAX: this node could not list them) */
  uint64_t nviews;
  /* step: every parameter a node could disagree on (-1: no lr given) */
  double lr, max_norm;
  uint64_t hp_digest; /* the groups' hyperparameters and the norm-only flag */
  /* the job-level checkpoint the node's job was restored from (its seal,
   * job->origin; 0 none): nodes that restored different checkpoints, or
   * one restored and one fresh, fail their first exchange instead of
   * training on mixed state */
  uint64_t origin;
  double value; /* step: the node's sum of squares; not compared */
} fab_hdr;

#define FAB_MAGIC 0x53484635u /* "SHF5": bump when the header changes */
#define FAB_KIND_REFUSED 0x10000u

_Static_assert(sizeof(fab_hdr) == 96, "fab_hdr must have no padding");

/* FNV-1a over a step's resolved hyperparameters, field by field (a struct's
 * padding bytes are not its value). */
static uint64_t step_digest(const coll *c) {
  uint64_t h = SHARDD__FNV1A_BASIS;
  int flag = c->args.norm_only;
  h = shardd__fnv1a(h, &flag, sizeof flag);
  for (size_t g = 0; c->hp && g < c->opt->ngroups; g++) {
    const shardd__hp *p = &c->hp[g];
    int ints[4] = {(int)p->kind, p->nesterov, p->maximize, p->amsgrad};
    double d[7] = {p->lr, p->momentum, p->dampening, p->weight_decay,
                   p->beta1, p->beta2, p->eps};
    h = shardd__fnv1a(h, ints, sizeof ints);
    h = shardd__fnv1a(h, d, sizeof d);
  }
  return h;
}

static const char *dtype_word(uint32_t dt) {
  const char *n = shardd_dtype_name((shardd_dtype)dt);
  return n ? n : "?";
}

/* a scatter header's op: the reduce op, FAB_OP_ADDING set when it adds to
 * the reduced gradient held */
#define FAB_OP_ADDING 0x100u

static const char *op_word(uint32_t op) {
  switch (op) {
  case SHARDD_REDUCE_MEAN: return "mean";
  case SHARDD_REDUCE_SUM: return "sum";
  case SHARDD_REDUCE_MEAN | FAB_OP_ADDING: return "mean, accumulating";
  case SHARDD_REDUCE_SUM | FAB_OP_ADDING: return "sum, accumulating";
  case SHARDD_REDUCE_MAX: return "max";
  case SHARDD_REDUCE_MIN: return "min";
  default: return "the daemon's own (a collective checkpoint)";
  }
}

/* 0 when every node's header matches this node's; else -1 and msg says
 * what the first node that differs has instead. */
static int fab_check(const coll *c, const fab_hdr *h, uint32_t nodes,
                     uint32_t me, char *msg, size_t len) {
  const fab_hdr *m = &h[me];
  const char *kw = shardd__coll_kind_word(c->args.kind), *tw = shardd__coll_target_word(c->args.kind);
  for (uint32_t n = 0; n < nodes; n++) {
    const fab_hdr *o = &h[n];
    if (n == me || memcmp(o, m, offsetof(fab_hdr, value)) == 0)
      continue;
    if (o->magic == m->magic && (o->kind & FAB_KIND_REFUSED))
      snprintf(msg, len,
               "node %" PRIu32 " refused %s of %s \"%s\" locally (its ranks "
               "were told why: an argument invalid there, or its ranks "
               "disagreeing); nothing moved, and the fabric stays up",
               n, shardd__coll_kind_word((shardd__coll_kind)(o->kind & ~FAB_KIND_REFUSED)),
               tw, c->name);
    else if (o->magic != m->magic)
      snprintf(msg, len,
               "node %" PRIu32 " speaks another version of the fabric protocol "
               "(header %#" PRIx32 ", this node %#" PRIx32 "): run the same "
               "shardd on every node",
               n, o->magic, m->magic);
    else if (o->origin != m->origin)
      snprintf(msg, len,
               "node %" PRIu32 " restored job \"%s\" from %s%08" PRIx64 "%s, "
               "this node from %s%08" PRIx64 "%s: every node must restore its "
               "part of the same job checkpoint (release the job and restore "
               "it again on every node)",
               n, c->job->name, o->origin ? "the checkpoint sealed " : "",
               o->origin & 0xffffffffu, o->origin ? "" : " (no checkpoint: a fresh job)",
               m->origin ? "the checkpoint sealed " : "", m->origin & 0xffffffffu,
               m->origin ? "" : " (no checkpoint: a fresh job)");
    else if (o->kind != m->kind || o->name != m->name)
      snprintf(msg, len,
               "node %" PRIu32 " exchanged %s of another target where this node "
               "exchanged %s of %s \"%s\": two names share fabric tag %" PRIu32
               " and the nodes ran them in different orders",
               n, shardd__coll_kind_word((shardd__coll_kind)o->kind), kw, tw, c->name, c->tag);
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
    else if (o->op != m->op)
      snprintf(msg, len,
               "node %" PRIu32 " reduces %s \"%s\" by %s, this node by %s: every "
               "rank must pass the same reduction",
               n, tw, c->name, op_word(o->op), op_word(m->op));
    else if (o->lr != m->lr)
      snprintf(msg, len,
               "node %" PRIu32 " steps %s \"%s\" with lr %g, this node with %g "
               "(-1: the registered rates): every rank must pass the same",
               n, tw, c->name, o->lr, m->lr);
    else if (o->max_norm != m->max_norm)
      snprintf(msg, len,
               "node %" PRIu32 " steps %s \"%s\" with max_norm %g, this node "
               "with %g: every rank must clip alike",
               n, tw, c->name, o->max_norm, m->max_norm);
    else if (o->hp_digest != m->hp_digest)
      snprintf(msg, len,
               "node %" PRIu32 " steps %s \"%s\" with other per-group "
               "hyperparameters (lr, betas, eps, weight_decay, momentum... of "
               "some param group, as a scheduler set them) or a norm-only step "
               "where this node steps: every rank must pass the same",
               n, tw, c->name);
    else if (o->nviews == UINT64_MAX || m->nviews == UINT64_MAX)
      snprintf(msg, len, "node %" PRIu32 " could not list the views of %s \"%s\" "
               "(out of memory)", o->nviews == UINT64_MAX ? n : me, tw, c->name);
    else
      snprintf(msg, len,
               "node %" PRIu32 " has %" PRIu64 " views of %s \"%s\", this node %"
               PRIu64 ": register them alike on every node",
               n, o->nviews, tw, c->name, m->nviews);
    return -1;
  }
  return 0;
}

/* An all_reduce across nodes: each node's local reduction (c->reduced;
 * a mean is already divided by the whole world) is allgathered and
 * combined in node order, so every node gets the same bits. A barrier
 * (no values) is its header alone. */
static shardd_err fab_all_reduce(coll *c, shardd__fabric *f, char *msg,
                                 size_t len) {
  size_t n = (size_t)c->args.target;
  if (n == 0)
    return SHARDD_OK;
  const shardd__job *job = c->job;
  double *all = calloc((size_t)job->nodes * n, sizeof *all);
  if (all == NULL) {
    snprintf(msg, len, "out of memory for the all_reduce exchange");
    return SHARDD_E_NO_MEMORY;
  }
  memcpy(all + (size_t)job->node_rank * n, c->reduced, n * sizeof *all);
  shardd_err rc = shardd__fabric_allgather(f, all, n * sizeof *all, c->tag, msg, len);
  if (rc == SHARDD_OK)
    for (size_t i = 0; i < n; i++) {
      double acc = all[i];
      for (uint32_t k = 1; k < job->nodes; k++)
        acc = shardd__coll_combine((int)c->args.op, acc, all[(size_t)k * n + i]);
      c->reduced[i] = acc;
    }
  free(all);
  return rc;
}

/* ---- forming and re-forming: the join (see the top of the file) ------- */

/* What each node says when a fabric (re)forms, allgathered once on it
 * before any exchange: fixed-width fields, no padding. */
typedef struct {
  uint32_t magic, flags;
  uint64_t lineage;  /* the job's (0: never formed, not restored so) */
  uint64_t proposal; /* a new lineage, taken from node 0 when all are 0 */
  uint64_t origin;   /* job->origin, for the message only */
  /* the node's state when the exchange was submitted (coll.fab_state) */
  uint64_t nbufs, bufs_digest, nopts, opts_digest, steps_min, steps_max;
} fab_join_hdr;

#define FAB_JOIN_MAGIC 0x53484a31u /* "SHJ1": bump when it changes */
#define FAB_JOIN_REJOINING 1u
/* the join runs before any exchange of the new fabric on either node, so
 * a tag an exchange may also fold to is no conflict */
#define FAB_JOIN_TAG 0x7fffffffu

_Static_assert(sizeof(fab_join_hdr) == 80, "fab_join_hdr must have no padding");

/* c->fab_state: this node's buffers (name, numel, dtype) and optimizers
 * (name, step count), summed as hashes so that the order of ids (which
 * differs between a survivor and a restored node) does not count. Loop
 * thread; c->fab_join_ok says whether it could be listed. */
static void fab_state_of(coll *c) {
  shardd__buffer **bufs = NULL;
  shardd__optim **opts = NULL;
  size_t nb = 0, no = 0;
  memset(&c->fab_state, 0, sizeof c->fab_state);
  c->fab_join_ok = 0;
  if (shardd__job_buffers(c->job, &bufs, &nb) != SHARDD_OK ||
      shardd__job_optims(c->job, &opts, &no) != SHARDD_OK) {
    free(bufs);
    return;
  }
  c->fab_state.nbufs = nb;
  for (size_t i = 0; i < nb; i++) {
    uint64_t h = shardd__fnv1a(SHARDD__FNV1A_BASIS, bufs[i]->hdr.name,
                               strlen(bufs[i]->hdr.name) + 1);
    uint64_t nd[2] = {bufs[i]->numel, (uint64_t)bufs[i]->dtype};
    c->fab_state.bufs_digest += shardd__fnv1a(h, nd, sizeof nd);
  }
  c->fab_state.nopts = no;
  c->fab_state.steps_min = no ? UINT64_MAX : 0;
  for (size_t i = 0; i < no; i++) {
    uint64_t h = shardd__fnv1a(SHARDD__FNV1A_BASIS, opts[i]->hdr.name,
                               strlen(opts[i]->hdr.name) + 1);
    c->fab_state.opts_digest +=
        shardd__fnv1a(h, &opts[i]->steps, sizeof opts[i]->steps);
    if (opts[i]->steps < c->fab_state.steps_min)
      c->fab_state.steps_min = opts[i]->steps;
    if (opts[i]->steps > c->fab_state.steps_max)
      c->fab_state.steps_max = opts[i]->steps;
  }
  free(bufs);
  free(opts);
  c->fab_join_ok = 1;
}

static uint64_t fresh_lineage(void) {
  struct timespec now;
  clock_gettime(CLOCK_REALTIME, &now);
  uint64_t seed[3] = {(uint64_t)now.tv_sec, (uint64_t)now.tv_nsec,
                      (uint64_t)getpid() << 32 ^ (uint64_t)(uintptr_t)&now};
  uint64_t h = shardd__fnv1a(SHARDD__FNV1A_BASIS, seed, sizeof seed);
  return h ? h : 1;
}

static void steps_words(const fab_join_hdr *h, char *out, size_t len) {
  if (h->nopts == 0)
    snprintf(out, len, "no optimizer");
  else if (h->steps_min == h->steps_max)
    snprintf(out, len, "%" PRIu64 " optimizer%s at step %" PRIu64, h->nopts,
             h->nopts == 1 ? "" : "s", h->steps_min);
  else
    snprintf(out, len, "%" PRIu64 " optimizers at steps %" PRIu64 "..%" PRIu64,
             h->nopts, h->steps_min, h->steps_max);
}

static const char *lineage_words(const fab_join_hdr *h) {
  return h->flags & FAB_JOIN_REJOINING ? "restored from its exit checkpoint"
         : h->lineage                  ? "live state"
                                       : "a fresh job";
}

/* 0 when every node's join header fits this node's; else -1, msg naming
 * the first node that differs and what. */
static int join_check(const char *job, const fab_join_hdr *h, uint32_t nodes,
                      uint32_t me, char *msg, size_t len) {
  const fab_join_hdr *m = &h[me];
  int check_state = 0;
  for (uint32_t n = 0; n < nodes; n++)
    check_state |= h[n].lineage != 0 || (h[n].flags & FAB_JOIN_REJOINING);
  for (uint32_t n = 0; n < nodes; n++) {
    const fab_join_hdr *o = &h[n];
    if (n == me)
      continue;
    if (o->magic != m->magic) {
      snprintf(msg, len, "node %" PRIu32 " speaks another version of the fabric "
               "protocol (join %#" PRIx32 ", this node %#" PRIx32 "): run the "
               "same shardd on every node", n, o->magic, m->magic);
      return -1;
    }
    if (o->lineage != m->lineage) {
      snprintf(msg, len, "node %" PRIu32 " holds job \"%.32s\" as %s (fabric "
               "lineage %016" PRIx64 "), this node as %s (lineage %016" PRIx64
               "): their states do not belong together. Restart a stopped "
               "node's daemon with --restore of its --checkpoint-on-exit part, "
               "or release the job on every node and restore a collective "
               "checkpoint", n, job, lineage_words(o), o->lineage,
               lineage_words(m), m->lineage);
      return -1;
    }
    if (!check_state)
      continue;
    if (o->nbufs != m->nbufs || o->bufs_digest != m->bufs_digest) {
      snprintf(msg, len, "node %" PRIu32 " holds %" PRIu64 " buffers of job \"%.32s\""
               ", this node %" PRIu64 " (or their names, sizes or dtypes "
               "differ): the nodes' states do not fit together, refusing to "
               "train on them", n, o->nbufs, job, m->nbufs);
      return -1;
    }
    if (o->nopts != m->nopts || o->opts_digest != m->opts_digest) {
      char ow[64], mw[64];
      steps_words(o, ow, sizeof ow);
      steps_words(m, mw, sizeof mw);
      snprintf(msg, len, "node %" PRIu32 " holds job \"%.32s\" with %.60s (%s), "
               "this node with %.60s: a node restored a checkpoint of another "
               "step, or applied a step the other did not; refusing to train "
               "on mixed state (release the job on every node and restore a "
               "collective checkpoint)", n, job, ow, lineage_words(o), mw);
      return -1;
    }
  }
  return 0;
}

/* The first allgather on a new fabric: the nodes' lineages must agree
 * (all 0 the first time: node 0's proposal becomes the job's), and where
 * any node has a lineage or rejoins, their states too. A refusal is
 * SHARDD_E_MISMATCH on every node alike (each sees every header). */
static shardd_err fab_join(coll_fab *jf, const coll *c, shardd__fabric *f,
                           uint64_t lineage, int rejoining, uint64_t *out,
                           char *err, size_t errlen) {
  (void)jf;
  const shardd__job *job = c->job;
  fab_join_hdr *h = calloc(job->nodes, sizeof *h);
  if (h == NULL) {
    snprintf(err, errlen, "out of memory for the fabric's join");
    return SHARDD_E_NO_MEMORY;
  }
  fab_join_hdr *m = &h[job->node_rank];
  m->magic = FAB_JOIN_MAGIC;
  m->flags = rejoining ? FAB_JOIN_REJOINING : 0;
  m->lineage = lineage;
  m->proposal = fresh_lineage();
  m->origin = job->origin;
  m->nbufs = c->fab_state.nbufs;
  m->bufs_digest = c->fab_state.bufs_digest;
  m->nopts = c->fab_state.nopts;
  m->opts_digest = c->fab_state.opts_digest;
  m->steps_min = c->fab_state.steps_min;
  m->steps_max = c->fab_state.steps_max;
  char why[384];
  shardd_err rc = shardd__fabric_allgather(f, h, sizeof *h, FAB_JOIN_TAG, why,
                                           sizeof why);
  if (rc != SHARDD_OK)
    snprintf(err, errlen, "fabric: join: %.300s", why);
  else if (join_check(job->name, h, job->nodes, job->node_rank, err, errlen))
    rc = SHARDD_E_MISMATCH;
  else
    *out = m->lineage ? m->lineage : h[0].proposal;
  free(h);
  return rc;
}

/* The exchange of c on fabric f: header, check, data. A failure that
 * leaves f unusable is t->rc with *lost set. */
static void fabric_exchange(coll *c, task *t, shardd__fabric *f, int *lost) {
  shardd__job *job = c->job;
  shardd__buffer *b = c->buf;
  uint64_t part = b ? (uint64_t)job->local_ranks * b->shard_numel : 0;
  fab_hdr *h = calloc(job->nodes, sizeof *h);
  if (h == NULL) {
    /* the peers wait for this node's header in vain: the fabric is lost */
    t->rc = SHARDD_E_NO_MEMORY;
    snprintf(c->fab_msg, sizeof c->fab_msg, "out of memory for the exchange header");
    *lost = 1;
    return;
  }
  fab_hdr *m = &h[job->node_rank];
  m->magic = FAB_MAGIC;
  m->kind = (uint32_t)c->args.kind | (c->refused != SHARDD_OK ? FAB_KIND_REFUSED : 0);
  m->name = c->name_key;
  m->seq = c->fab_seq;
  m->origin = job->origin;
  if (c->args.kind == SHARDD__COLL_ALL_REDUCE) {
    /* the values' count and the op are compared; the checkpoint barrier's
     * op is its own, so it never pairs with a plain barrier */
    m->numel = c->args.target;
    m->bytes = c->args.target * sizeof(double);
    m->op = (uint32_t)c->args.op;
  } else if (b) {
    m->numel = b->numel;
    m->dtype = (uint32_t)b->dtype;
    m->bytes = part * (c->args.kind == SHARDD__COLL_SCATTER
                           ? 4 /* the fp32 staging area */
                           : shardd_dtype_size(b->dtype));
    m->op = c->args.kind == SHARDD__COLL_SCATTER
                ? (uint32_t)c->args.op | (c->adding ? FAB_OP_ADDING : 0)
                : 0;
    if (c->args.kind == SHARDD__COLL_SCATTER)
      m->nviews = c->fab_mask ? c->nmask : UINT64_MAX;
  } else {
    m->value = c->sumsq_all;
    m->lr = c->args.has_lr ? c->args.lr : -1.0;
    m->max_norm = c->args.max_norm;
    m->hp_digest = step_digest(c);
  }
  t->rc = shardd__fabric_allgather(f, h, sizeof *h, c->tag, c->fab_msg,
                                   sizeof c->fab_msg);
  if (t->rc == SHARDD_OK && c->refused != SHARDD_OK) {
    /* the header told the others; the ranks here have their answer */
    t->rc = c->refused;
    snprintf(c->fab_msg, sizeof c->fab_msg, "%s", c->refused_msg);
    free(h);
    return;
  }
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
      if (c->fab_mask == NULL) { /* every node could not list its views */
        t->rc = SHARDD_E_NO_MEMORY;
        snprintf(c->fab_msg, sizeof c->fab_msg, "out of memory listing the views "
                 "of buffer \"%s\"", c->name);
        break;
      }
      t->rc = shardd__fabric_reduce_scatter_f32(f, (float *)b->stage->ptr, part,
                                                c->tag, c->fab_msg,
                                                sizeof c->fab_msg);
      /* which views had a gradient on which node: a view no rank of any
       * node had one for is skipped by the step (coll.c) */
      if (t->rc == SHARDD_OK)
        t->rc = shardd__fabric_allgather(f, c->fab_mask, c->nmask + 1, c->tag,
                                         c->fab_msg, sizeof c->fab_msg);
      break;
    case SHARDD__COLL_STEP: {
      /* in node order on every node, so all get the same bits */
      double sum = 0;
      for (uint32_t n = 0; n < job->nodes; n++)
        sum += h[n].value;
      c->sumsq_all = sum;
      break;
    }
    case SHARDD__COLL_ALL_REDUCE:
      t->rc = fab_all_reduce(c, f, c->fab_msg, sizeof c->fab_msg);
      break;
    }
  }
  free(h);
  if (t->rc != SHARDD_OK)
    *lost = 1;
}

/* The exchange of c, on a fabric thread. */
static void fabric_task(coll *c, task *t) {
  coll_fab *jf = c->cj->fab;
  shardd__fabric *f;
  uint64_t gen;
  t->rc = jf_get(jf, c, &f, &gen, c->fab_msg, sizeof c->fab_msg);
  if (t->rc != SHARDD_OK)
    return;
  int lost = 0;
  fabric_exchange(c, t, f, &lost);
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
    fab_state_of(c);
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
