/* ckpt_collective.c — collective checkpoints: every rank of a job asks,
 * a barrier of the engine orders the request after the rank's earlier
 * collectives, the checkpoint is taken when every local rank's barrier
 * ended; a multi-node job's adds each node's part and the exchange of the
 * parts' seals, so every node writes the same job manifest, or none (see
 * dispatch_int.h). */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "checkpoint.h"
#include "dispatch_int.h"
#include "hash.h"
#include "log.h"

/* ---- collective checkpoints --------------------------------------------
 * Each rank's request is a barrier of the engine (an all_reduce of no
 * values, with an op of its own so a plain barrier() does not pair with
 * it), so it comes after the collectives the rank sent before it. When
 * the barrier ends for every local rank, their replies are held and the
 * checkpoint starts (the ranks wait for it: nothing of theirs runs); every
 * rank is answered when its files are written. */
#define CKPT_BARRIER_OP 0x636b /* "ck": no reduce op of the wire */
/* A multi-node job's collective checkpoint has a second exchange, after
 * each node wrote its part: every node's part seal (or that it failed),
 * so each node writes the same job manifest, or none. Each local rank
 * submits it (the engine pairs collectives by rank), with the values
 * [nodes]: this node's slot holds seal + 1 (0: its part failed) from its
 * first local rank, 0 elsewhere, and the engine adds them up (an op of the
 * daemon's own adds), so every slot ends as its node's word. */
#define CKPT_SEAL_OP 0x636c

typedef struct shardd__ckpt_group {
  shardd__dispatch *d;
  /* the job it belongs to: it is failed and freed as the job is released
   * (shardd__ckpt_collective_released), so no later job at that address finds it */
  shardd__job *job;
  uint32_t world; /* job's, the length of conns and seqs */
  uint32_t arrived;
  int mismatch;
  uint32_t other_dir; /* multi-node: 1 + a node that named another dir; 0 none */
  shardd__conn **conns; /* [world]: the held ranks (NULL once closed) */
  uint64_t *seqs;
  char *dir; /* the first rank's (the group's) */
  /* multi-node: 1 once this node's part is written (or failed) and the
   * seal exchange runs; what the job manifest needs then */
  int phase;
  uint32_t expect; /* ranks that submitted the seal exchange, less those
                     that closed before its end reached them */
  uint8_t *seal_in; /* [world]: that rank's end of it came */
  shardd_err part_rc; /* this node's part */
  char part_err[ERRLEN];
  shardd_err seal_rc; /* the exchange's first failure */
  char seal_err[ERRLEN];
  double seals[SHARDD_ALL_REDUCE_MAX];
  int64_t as_uid;
  char *home; /* NULL: none */
  /* a part refused before it started, from inside the engine's done hook
   * (which must not call the engine): the seal exchange starts a loop turn
   * later, through an empty work item */
  uv_work_t defer;
  int deferring; /* the job is pinned until it ran */
  struct shardd__ckpt_group *next;
} ckpt_group;

/* A collective checkpoint directory's fingerprint across nodes: FNV-1a
 * folded to 32 bits, + 1 (0 is "no word from that node"); exact as a
 * double. */
static double dir_print(const char *dir) {
  uint64_t h = shardd__fnv1a_str(SHARDD__FNV1A_BASIS, dir);
  return (double)(uint32_t)(h ^ (h >> 32)) + 1.0;
}

static void ckpt_group_free(ckpt_group *g) {
  for (ckpt_group **p = &g->d->ckpt_groups; *p; p = &(*p)->next)
    if (*p == g) {
      *p = g->next;
      break;
    }
  for (uint32_t r = 0; r < g->world; r++)
    if (g->conns[r]) {
      free(g->conns[r]->ckc_dir);
      g->conns[r]->ckc_dir = NULL;
    }
  free(g->conns);
  free(g->seqs);
  free(g->seal_in);
  free(g->dir);
  free(g->home);
  free(g);
}

static void ckpt_group_answer(ckpt_group *g, shardd_err rc, const char *err) {
  for (uint32_t r = 0; r < g->world; r++) {
    shardd__conn *c = g->conns[r];
    if (c == NULL)
      continue;
    if (rc == SHARDD_OK)
      shardd__reply_checkpoint(g->d, c, g->seqs[r], g->job, g->dir);
    else
      shardd__reply(g->d, c, g->seqs[r], rc, err);
  }
  ckpt_group_free(g);
}

/* jobs.c releases job: its collective checkpoints that never started (some
 * ranks asked, then every rank left) go with it; a rank still held would
 * have kept the job, but is answered if there is one. (None is deferring
 * or being written: either keeps the job.) */
void shardd__ckpt_collective_released(void *arg, shardd__job *job) {
  shardd__dispatch *d = arg;
  for (ckpt_group *g = d->ckpt_groups, *next; g; g = next) {
    next = g->next;
    if (g->job != job)
      continue;
    char err[ERRLEN];
    snprintf(err, sizeof err, "job \"%s\" was released before every rank "
             "asked for its collective checkpoint into %s", job->name, g->dir);
    shardd__log(2, "%s; the checkpoint is dropped", err);
    ckpt_group_answer(g, SHARDD_E_STATE, err);
  }
}

/* A multi-node job's part is written (or failed) here: the seal exchange
 * starts on every local rank still held (see CKPT_SEAL_OP). Its end comes
 * back through coll_done, to ckpt_seal_done. */
static void ckpt_seal_start(ckpt_group *g, shardd_err rc, const char *err) {
  shardd__job *job = g->job;
  shardd__dispatch *d = g->d;
  g->phase = 1;
  g->arrived = 0;
  g->part_rc = rc;
  if (err != g->part_err) /* a deferred start passes the group's own */
    snprintf(g->part_err, sizeof g->part_err, "%s", rc == SHARDD_OK ? "" : err);
  uint32_t seal = shardd__jobs_last_seal(&g->d->jobs, job);
  double vals[SHARDD_ALL_REDUCE_MAX] = {0};
  uint32_t lo = job->local_first, hi = lo + job->local_ranks;
  if (g->seal_in == NULL && (g->seal_in = calloc(job->world, 1)) == NULL) {
    ckpt_group_answer(g, SHARDD_E_NO_MEMORY, "out of memory");
    return; /* the other nodes time out */
  }
  /* copied: a refusal inside submit may end the group (and free g) */
  shardd__conn **held = calloc(job->local_ranks, sizeof *held);
  uint64_t *seqs = calloc(job->local_ranks, sizeof *seqs);
  uint32_t n = 0;
  for (uint32_t r = lo; held && seqs && r < hi; r++)
    if (g->conns[r]) {
      seqs[n] = g->seqs[r];
      held[n++] = g->conns[r];
    }
  g->expect = n;
  if (held == NULL || seqs == NULL) { /* the other nodes time out */
    ckpt_group_answer(g, SHARDD_E_NO_MEMORY, "out of memory");
    n = 0;
  } else if (n == 0) { /* every rank left: nobody to answer, nothing to pair */
    ckpt_group_free(g);
  }
  for (uint32_t k = 0; k < n; k++) {
    shardd__conn *c = held[k];
    vals[job->node_rank] =
        c->m.rank == lo && rc == SHARDD_OK ? (double)seal + 1.0 : 0.0;
    shardd__coll_args ca = {.kind = SHARDD__COLL_ALL_REDUCE,
                            .target = job->nodes,
                            .op = (shardd_reduce_op)CKPT_SEAL_OP,
                            .values = vals};
    shardd__coll_submit(d->coll, &c->m, seqs[k], &ca);
  }
  free(held);
  free(seqs);
}

static void ckpt_defer_work(uv_work_t *req) { (void)req; }

static void ckpt_defer_after(uv_work_t *req, int status) {
  ckpt_group *g = req->data;
  shardd__dispatch *d = g->d;
  shardd__job *job = g->job;
  g->deferring = 0;
  ckpt_seal_start(g, g->part_rc, g->part_err); /* may free g */
  shardd__jobs_unpin(&d->jobs, job);           /* may release job */
}

/* c's part of the seal exchange ended: once every rank's has, the job
 * manifest is written when every node's part is there, and the ranks are
 * answered. */
static void ckpt_seal_finish(ckpt_group *g);

static void ckpt_seal_done(ckpt_group *g, shardd__conn *c, shardd_err code,
                           const char *msg, const shardd__coll_result *res) {
  shardd__job *job = g->job;
  if (code != SHARDD_OK && g->seal_rc == SHARDD_OK) {
    g->seal_rc = code;
    snprintf(g->seal_err, sizeof g->seal_err, "%s", msg ? msg : "");
  } else if (code == SHARDD_OK && res && res->nvalues == job->nodes) {
    memcpy(g->seals, res->values, job->nodes * sizeof *g->seals);
  }
  g->seal_in[c->m.rank] = 1;
  if (++g->arrived < g->expect)
    return;
  ckpt_seal_finish(g);
}

/* Every rank still held has its end of the seal exchange. */
static void ckpt_seal_finish(ckpt_group *g) {
  shardd__job *job = g->job;
  char err[2 * ERRLEN];
  shardd_err rc = SHARDD_OK;
  if (g->part_rc != SHARDD_OK) {
    rc = g->part_rc;
    snprintf(err, sizeof err, "node %" PRIu32 "'s part of the checkpoint: %s; "
             "no job manifest written", job->node_rank, g->part_err);
  } else if (g->seal_rc != SHARDD_OK) {
    rc = g->seal_rc;
    snprintf(err, sizeof err, "the nodes could not confirm each other's part "
             "of the checkpoint: %s; no job manifest written", g->seal_err);
  } else {
    uint32_t seals[SHARDD__CKJOB_MAX_NODES];
    for (uint32_t n = 0; n < job->nodes && rc == SHARDD_OK; n++) {
      if (!(g->seals[n] >= 1.0)) {
        rc = SHARDD_E_IO;
        snprintf(err, sizeof err, "node %" PRIu32 " could not write its part of "
                 "the checkpoint into %s/node-%" PRIu32 " (its ranks were told "
                 "why); no job manifest written", n, g->dir, n);
      }
      seals[n] = (uint32_t)(g->seals[n] - 1.0);
    }
    if (rc == SHARDD_OK)
      rc = shardd__jobs_checkpoint_job(&g->d->jobs, job, g->dir, g->as_uid,
                                       g->home, seals, err, sizeof err);
  }
  ckpt_group_answer(g, rc, err);
}

static void ckpt_group_done(void *arg, shardd__job *job, shardd_err rc,
                            const char *err) {
  ckpt_group *g = arg;
  shardd__dispatch *d = g->d;
  if (job->nodes > 1)
    ckpt_seal_start(g, rc, err); /* before the held frames: every node's ranks
                                    submit it first */
  else
    ckpt_group_answer(g, rc, err);
  shardd__ckpt_after(d, job);
}

/* c's checkpoint barrier ended with code: held until every local rank's
 * has, then the checkpoint starts. In a multi-node job the barrier crosses
 * nodes, so every rank of every node has asked, and each node writes its
 * part; then the seal exchange (ckpt_seal_start) ends here too. */
void shardd__ckpt_collective_done(shardd__dispatch *d, shardd__conn *c,
                                  uint64_t seq, shardd_err code,
                                  const char *msg,
                                  const shardd__coll_result *res) {
  for (ckpt_group *sg = d->ckpt_groups; sg; sg = sg->next)
    if (sg->job == c->m.job && sg->phase == 1) {
      ckpt_seal_done(sg, c, code, msg, res);
      return;
    }
  if (code != SHARDD_OK) {
    free(c->ckc_dir);
    c->ckc_dir = NULL;
    shardd__reply(d, c, seq, code, msg);
    return;
  }
  shardd__job *job = c->m.job;
  ckpt_group *g = d->ckpt_groups;
  while (g && g->job != job)
    g = g->next;
  if (g == NULL) {
    g = calloc(1, sizeof *g);
    if (g == NULL || (g->conns = calloc(job->world, sizeof *g->conns)) == NULL ||
        (g->seqs = calloc(job->world, sizeof *g->seqs)) == NULL ||
        (g->dir = strdup(c->ckc_dir)) == NULL) {
      if (g) {
        free(g->conns);
        free(g->seqs);
        free(g);
      }
      free(c->ckc_dir);
      c->ckc_dir = NULL;
      shardd__reply(d, c, seq, SHARDD_E_NO_MEMORY, "out of memory");
      return;
    }
    g->d = d;
    g->job = job;
    g->world = job->world;
    g->next = d->ckpt_groups;
    d->ckpt_groups = g;
  }
  g->conns[c->m.rank] = c;
  g->seqs[c->m.rank] = seq;
  g->mismatch |= strcmp(g->dir, c->ckc_dir) != 0;
  /* the other nodes' directories (every rank gets the same values) */
  int other = -1;
  if (job->nodes > 1 && res && res->nvalues == job->nodes)
    for (uint32_t n = 0; n < job->nodes && other < 0; n++)
      if (res->values[n] != dir_print(g->dir))
        other = (int)n;
  if (other >= 0 && g->other_dir == 0)
    g->other_dir = 1 + (uint32_t)other;
  if (++g->arrived < job->local_ranks)
    return;
  char err[ERRLEN], home[4096];
  shardd_err rc = SHARDD_OK;
  if (g->other_dir && !g->mismatch) {
    snprintf(err, sizeof err, "the ranks of node %" PRIu32 " of job \"%s\" asked "
             "for a checkpoint into another directory than this node's (%s): "
             "every rank must name the same", g->other_dir - 1, job->name, g->dir);
    rc = SHARDD_E_MISMATCH;
  } else if (g->mismatch) {
    snprintf(err, sizeof err, "the ranks of job \"%s\" asked for a checkpoint "
             "into different directories", job->name);
    rc = SHARDD_E_MISMATCH;
  } else {
    rc = shardd__checkpoint_dir_ok(d, c, g->dir, 1, home, sizeof home, err, sizeof err);
  }
  g->as_uid = (int64_t)c->peer.uid;
  if (rc == SHARDD_OK && home[0] && (g->home = strdup(home)) == NULL) {
    rc = SHARDD_E_NO_MEMORY;
    snprintf(err, sizeof err, "out of memory");
  }
  if (rc == SHARDD_OK)
    rc = shardd__jobs_checkpoint_start(&d->jobs, job, g->dir, (int64_t)c->peer.uid,
                                       home[0] ? home : NULL, ckpt_group_done, g,
                                       err, sizeof err);
  /* multi-node: the other nodes' ranks wait in the seal exchange, which
   * must hear that this node has no part */
  if (rc != SHARDD_OK && job->nodes > 1) {
    g->part_rc = rc;
    snprintf(g->part_err, sizeof g->part_err, "%s", err);
    g->defer.data = g;
    if (shardd__jobs_pin(&d->jobs, job) == SHARDD_OK) {
      if (uv_queue_work(d->jobs.loop, &g->defer, ckpt_defer_work,
                        ckpt_defer_after) == 0) {
        g->deferring = 1;
        return;
      }
      shardd__jobs_unpin(&d->jobs, job);
    }
  }
  if (rc != SHARDD_OK)
    ckpt_group_answer(g, rc, err);
}

static void ckpt_start(shardd__dispatch *d, shardd__conn *c, uint64_t seq,
                       const char *dir) {
  if (c->ckc_dir) {
    shardd__reply(d, c, seq, SHARDD_E_STATE,
                  "this rank's collective checkpoint is still being taken");
    return;
  }
  /* its barrier's end is told apart from the rank's other collectives by
   * the seq: one they will also end with is refused */
  if (shardd__coll_member_waits(d->coll, &c->m, seq)) {
    shardd__seq_refuse(d, c, seq, "collective still in flight");
    return;
  }
  if ((c->ckc_dir = strdup(dir)) == NULL) {
    shardd__reply(d, c, seq, SHARDD_E_NO_MEMORY, "out of memory");
    return;
  }
  c->ckc_seq = seq;
  /* A multi-node job's barrier also compares the directory across nodes
   * (the local ranks' are compared at the barrier's end): [nodes] values,
   * this node's slot its first local rank's fingerprint of dir, as the seal
   * exchange carries seals (see CKPT_SEAL_OP). Parts written into two
   * directories would each lack the other. */
  const shardd__job *job = c->m.job;
  double vals[SHARDD_ALL_REDUCE_MAX] = {0};
  int multi = job->nodes > 1 && job->nodes <= SHARDD_ALL_REDUCE_MAX;
  if (multi && c->m.rank == job->local_first)
    vals[job->node_rank] = dir_print(dir);
  shardd__coll_args ca = {.kind = SHARDD__COLL_ALL_REDUCE,
                          .target = multi ? job->nodes : 0,
                          .op = (shardd_reduce_op)CKPT_BARRIER_OP,
                          .values = multi ? vals : NULL};
  shardd__coll_submit(d->coll, &c->m, seq, &ca);
}

/* c is going away: a group holding it goes on without it. */
void shardd__ckpt_collective_closed(shardd__dispatch *d, shardd__conn *c) {
  for (ckpt_group *g = d->ckpt_groups, *next; g; g = next) {
    next = g->next;
    if (c->m.job != g->job || g->conns[c->m.rank] != c)
      continue;
    g->conns[c->m.rank] = NULL; /* the checkpoint goes on, unanswered */
    /* in the seal exchange, its end will not reach the group (its
     * ckc_dir goes below): the others' will, and decide */
    if (g->phase == 1 && !g->seal_in[c->m.rank]) {
      if (--g->expect == 0)
        ckpt_group_free(g);
      else if (g->arrived >= g->expect)
        ckpt_seal_finish(g);
    }
  }
  free(c->ckc_dir);
  c->ckc_dir = NULL;
}

/* The dispatcher is freed: a group still there (only if the loop was not
 * run dry) goes. */
void shardd__ckpt_collective_free(shardd__dispatch *d) {
  while (d->ckpt_groups)
    ckpt_group_free(d->ckpt_groups);
}

void shardd__on_checkpoint_collective(shardd__dispatch *d, shardd__conn *c,
                                      uint64_t seq,
                                      const Shardwire__Request *req) {
  const Shardwire__Checkpoint *cp = req->checkpoint;
  char err[ERRLEN], home[4096];
  shardd_err rc = shardd__checkpoint_dir_ok(d, c, cp->dir, 0, home, sizeof home, err,
                                            sizeof err);
  if (rc != SHARDD_OK) {
    shardd__reply(d, c, seq, rc, err);
    return;
  }
  if (c->m.job == NULL)
    shardd__reply(d, c, seq, SHARDD_E_STATE, "a collective checkpoint is asked for by "
                  "every rank of a job, not by a control session");
  else if (cp->job && cp->job[0] && strcmp(cp->job, c->m.job->name) != 0)
    shardd__reply(d, c, seq, SHARDD_E_NOT_OWNED, "a collective checkpoint is of the "
                  "rank's own job");
  else
    ckpt_start(d, c, seq, cp->dir);
}
