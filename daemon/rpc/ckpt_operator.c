/* ckpt_operator.c — checkpoint and restore requests whose replies wait
 * for their files (written or read on libuv's pool by jobs.c); operators'
 * checkpoints of a live job, waiting for its next quiescent point (the
 * steps held while one is written are dispatch.c's); see dispatch_int.h. */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "checkpoint.h"
#include "dispatch_int.h"
#include "log.h"

void shardd__reply_checkpoint(shardd__dispatch *d, shardd__conn *c,
                              uint64_t seq, shardd__job *job, const char *dir) {
  Shardwire__Response resp = ok_resp(seq, SHARDWIRE__RESPONSE__BODY_CHECKPOINT);
  Shardwire__CheckpointReply cr = SHARDWIRE__CHECKPOINT_REPLY__INIT;
  /* the name the asker would use for it: root restoring uid 1000's
   * checkpoint gets "1000/NAME" */
  char qualified[300];
  cr.job = job->name;
  if (job->uid != c->peer.uid) {
    snprintf(qualified, sizeof qualified, "%" PRIu32 "/%s", job->uid, job->name);
    cr.job = qualified;
  }
  cr.dir = (char *)dir;
  cr.buffers = (uint32_t)shardd__map_count(&job->buffers);
  cr.optimizers = (uint32_t)shardd__map_count(&job->optims);
  /* a restore's asker learns where the job resumes without a trainer */
  shardd__optim **opts;
  size_t no;
  if (shardd__job_optims(job, &opts, &no) == SHARDD_OK) {
    cr.has_step = 1;
    for (size_t i = 0; i < no; i++)
      if (opts[i]->steps > cr.step)
        cr.step = opts[i]->steps;
    free(opts);
  }
  resp.checkpoint = &cr;
  shardd__send_resp(d, c, &resp, -1);
}

/* A checkpoint or restore whose reply waits for its files (written or
 * read on libuv's pool by jobs.c): the request's seq and dir, and its
 * connection until that closes -- the reply is then dropped, as the engine
 * drops a collective's. */
typedef struct shardd__ckpt_wait {
  shardd__dispatch *d;
  shardd__conn *c; /* NULL once closed */
  uint64_t seq;
  char *dir;
  struct shardd__ckpt_wait *next;
} ckpt_wait;

/* Takes w off the waiting list. */
static void ckpt_unwait(ckpt_wait *w) {
  for (ckpt_wait **p = &w->d->ckpt_waits; *p; p = &(*p)->next)
    if (*p == w) {
      *p = w->next;
      break;
    }
}

/* A waiting reply for c's request seq about dir; NULL (and c answered)
 * when out of memory. */
static ckpt_wait *ckpt_wait_new(shardd__dispatch *d, shardd__conn *c,
                                uint64_t seq, const char *dir) {
  ckpt_wait *w = calloc(1, sizeof *w);
  if (w == NULL || (w->dir = strdup(dir)) == NULL) {
    free(w);
    shardd__reply(d, c, seq, SHARDD_E_NO_MEMORY, "out of memory");
    return NULL;
  }
  w->d = d;
  w->c = c;
  w->seq = seq;
  return w;
}

/* After the start of w's work: waits for it when rc is OK, else answers
 * the refusal and drops w (its done hook is never called then). */
static void ckpt_wait_started(ckpt_wait *w, shardd_err rc, const char *err) {
  if (rc != SHARDD_OK) {
    shardd__reply(w->d, w->c, w->seq, rc, err);
    free(w->dir);
    free(w);
    return;
  }
  w->next = w->d->ckpt_waits;
  w->d->ckpt_waits = w;
}

static void ckpt_done(void *arg, shardd__job *job, shardd_err rc,
                      const char *err) {
  ckpt_wait *w = arg;
  shardd__dispatch *d = w->d;
  ckpt_unwait(w);
  if (w->c && rc == SHARDD_OK)
    shardd__reply_checkpoint(d, w->c, w->seq, job, w->dir);
  else if (w->c)
    shardd__reply(d, w->c, w->seq, rc, err);
  free(w->dir);
  free(w);
}

/* A checkpoint (not a restore) ended: the job's held frames go on. */
static void ckpt_done_job(void *arg, shardd__job *job, shardd_err rc,
                          const char *err) {
  shardd__dispatch *d = ((ckpt_wait *)arg)->d;
  ckpt_done(arg, job, rc, err);
  shardd__ckpt_after(d, job);
}

/* --checkpoint-root: a client other than root names directories below
 * its own root/UID only; that directory is checked (and, with create,
 * made) before anything in it is touched, and its path left in home
 * (empty when the client is not confined to one). */
shardd_err shardd__checkpoint_dir_ok(shardd__dispatch *d, const shardd__conn *c,
                                     const char *dir, int create, char *home,
                                     size_t homelen, char *err, size_t errlen) {
  const char *root = d->opts.checkpoint_root;
  home[0] = '\0';
  shardd_err rc = shardd__access_checkpoint_dir(root, (uint32_t)c->peer.uid,
                                                dir, err, errlen);
  if (rc != SHARDD_OK || root == NULL || c->peer.uid == 0)
    return rc;
  rc = shardd__checkpoint_user_dir(root, (uint32_t)c->peer.uid, create, err,
                                   errlen);
  if (rc == SHARDD_OK)
    snprintf(home, homelen, "%.*s/%" PRIu32, (int)shardd__access_root_len(root),
             root, (uint32_t)c->peer.uid);
  return rc;
}

/* ---- operators' checkpoints of a live job ------------------------------
 * `shardctl checkpoint` of a job whose ranks are training: collectives are
 * in flight nearly always, and refusing with E_BUSY meant never. The
 * request waits (a bounded wait the asker gives) for the job's next
 * quiescent point, the moment its queue empties (between a step's reply
 * and the next gather), and the checkpoint is taken right there, on the
 * loop thread, before any later frame is read. Nothing is held while it
 * waits: holding new collectives could hold the rank a queued one waits
 * for. While the files are written, a step (which would change them) is
 * held with everything its rank sends behind it, and dispatched in order
 * when the checkpoint ends: training waits those milliseconds, is never
 * refused, and computes what it would have without the checkpoint. */
#define CKPT_WAIT_MAX 86400
/* Waiting checkpoints each hold their paths (PATH_MAX at most) and a pin
 * of their job, and they used to pile up without a bound: one connection's
 * OOM-killed the daemon. A job's are taken one after another, so a few
 * are all an operator needs; past these, E_LIMIT (docs/security.md). */
#define CKPT_PENDS_PER_SESSION 16
#define CKPT_PENDS_PER_UID 64 /* uids other than root */

typedef struct shardd__ckpt_pend {
  shardd__conn *c;
  uint64_t seq;
  shardd__job *job; /* pinned until the pend ends */
  char *dir, *home; /* owned; home NULL when the asker is not confined */
  int64_t as_uid;
  double since, wait_s;
  struct shardd__ckpt_pend *next;
} ckpt_pend;

/* Whether job is at a point a checkpoint can start at. */
static int pend_may_start(shardd__dispatch *d, const shardd__job *job) {
  return shardd__coll_inflight(d->coll, job) == 0 &&
         !shardd__jobs_checkpointing(&d->jobs, job);
}

static void pend_add(shardd__dispatch *d, shardd__conn *c, uint64_t seq,
                     shardd__job *job, const char *dir, const char *home,
                     double wait_s) {
  /* a walk over every wait: they are few (the bounds), and one is added
   * only by an operator's request */
  uint32_t mine = 0, uids = 0;
  for (const ckpt_pend *q = d->ckpt_pends; q; q = q->next) {
    mine += q->c == c;
    uids += q->as_uid == (int64_t)c->peer.uid;
  }
  char err[ERRLEN];
  if (mine >= CKPT_PENDS_PER_SESSION) {
    snprintf(err, sizeof err, "this session has %d checkpoints waiting for "
             "their job's quiescent point, the bound per session; ask again "
             "once one has ended", CKPT_PENDS_PER_SESSION);
    shardd__reply(d, c, seq, SHARDD_E_LIMIT, err);
    return;
  }
  if (c->peer.uid != 0 && uids >= CKPT_PENDS_PER_UID) {
    snprintf(err, sizeof err, "uid %" PRIu32 " has %d checkpoints waiting for "
             "their job's quiescent point, the bound per uid; ask again once "
             "one has ended", (uint32_t)c->peer.uid, CKPT_PENDS_PER_UID);
    shardd__reply(d, c, seq, SHARDD_E_LIMIT, err);
    return;
  }
  ckpt_pend *p = calloc(1, sizeof *p);
  if (p == NULL || (p->dir = strdup(dir)) == NULL ||
      (home && (p->home = strdup(home)) == NULL) ||
      shardd__jobs_pin(&d->jobs, job) != SHARDD_OK) {
    if (p) {
      free(p->dir);
      free(p->home);
    }
    free(p);
    shardd__reply(d, c, seq, SHARDD_E_NO_MEMORY, "out of memory");
    return;
  }
  p->c = c;
  p->seq = seq;
  p->job = job;
  p->as_uid = (int64_t)c->peer.uid;
  p->since = now_s(d);
  p->wait_s = wait_s;
  p->next = d->ckpt_pends;
  d->ckpt_pends = p;
  shardd__log(2, "session %" PRIu64 ": checkpoint of job \"%s\" waits up to "
              "%.1f s for its ranks' next quiescent point", c->id, job->name,
              wait_s);
}

/* The status context's view of the waits: the list is newest first, so the
 * i-th oldest is counted from its end. */
int shardd__ckpt_pending(void *arg, const shardd__job *job, size_t i,
                         const char **dir, double *waited_s, double *wait_s) {
  shardd__dispatch *d = arg;
  size_t n = 0;
  for (const ckpt_pend *p = d->ckpt_pends; p; p = p->next)
    n += p->job == job;
  if (i >= n)
    return 0;
  size_t want = n - 1 - i;
  for (const ckpt_pend *p = d->ckpt_pends; p; p = p->next)
    if (p->job == job && want-- == 0) {
      *dir = p->dir;
      *waited_s = now_s(d) - p->since;
      *wait_s = p->wait_s;
      return 1;
    }
  return 0;
}

/* Takes p off the list and frees it; its job may be released. */
static void pend_end(shardd__dispatch *d, ckpt_pend *p) {
  for (ckpt_pend **q = &d->ckpt_pends; *q; q = &(*q)->next)
    if (*q == p) {
      *q = p->next;
      break;
    }
  shardd__job *job = p->job;
  free(p->dir);
  free(p->home);
  free(p);
  shardd__jobs_unpin(&d->jobs, job);
}

/* Starts the waiting checkpoints of job that can start now (one; the
 * others wait for it to end, as they would for any checkpoint). */
void shardd__ckpt_pends_kick(shardd__dispatch *d, shardd__job *job) {
  for (ckpt_pend *p = d->ckpt_pends, *next; p; p = next) {
    next = p->next;
    if (p->job != job)
      continue;
    if (!pend_may_start(d, job))
      return;
    char err[ERRLEN];
    ckpt_wait *w = ckpt_wait_new(d, p->c, p->seq, p->dir);
    if (w) {
      shardd_err rc = shardd__jobs_checkpoint_start(&d->jobs, job, p->dir,
                                                    p->as_uid, p->home,
                                                    ckpt_done_job, w, err,
                                                    sizeof err);
      if (rc == SHARDD_OK)
        shardd__log(2, "job \"%s\" quiescent after %.3f s: checkpoint to %s "
                    "started", job->name, now_s(d) - p->since, p->dir);
      ckpt_wait_started(w, rc, err);
    }
    pend_end(d, p); /* job stays: it is being checkpointed, or has clients */
  }
}

/* Ranks pend_describe lists per collective, arrived and waiting each; the
 * rest are counted: four collectives' fit its message (2 KiB) whole. */
#define PEND_RANKS 8

/* What p still waits on, for its timeout's message: the job's collectives
 * (kind, target, how long, which ranks arrived and which did not, and
 * whether those are connected), or the checkpoint being written. Costs
 * the ranks that arrived and those it lists, not the job's world (a
 * world-sized map per collective walked 64 Ki ranks for each). */
static void pend_describe(shardd__dispatch *d, const ckpt_pend *p, char *out,
                          size_t n) {
  const shardd__job *job = p->job;
  size_t len = (size_t)snprintf(out, n, "job \"%s\" reached no quiescent point "
                                "(no collective queued or running) within %.1f s; ",
                                job->name, p->wait_s);
#define ADD(...)                                                               \
  do {                                                                         \
    if (len < n)                                                               \
      len += (size_t)snprintf(out + len, n - len, __VA_ARGS__);                \
  } while (0)
  if (shardd__jobs_checkpointing(&d->jobs, job))
    ADD("another checkpoint of it is being written; ");
  uint32_t total = shardd__coll_inflight(d->coll, job);
  ADD("%" PRIu32 " collective(s) in flight", total);
  shardd__coll_info info;
  uint32_t in[PEND_RANKS], waiting[PEND_RANKS];
  shardd__coll_ranks rk = {.max = PEND_RANKS, .arrived = in, .waiting = waiting};
  for (size_t i = 0; i < 4 &&
                     shardd__coll_describe_ranks(d->coll, job, i, &info, &rk) == SHARDD_OK;
       i++) {
    ADD("%s %s", i ? ";" : ":", shardd__coll_kind_word(info.kind));
    if (info.name && info.name[0])
      ADD(" of \"%s\"", info.name);
    if (info.running) {
      ADD(" running for %.1f s", info.waited_s);
      continue;
    }
    ADD(" queued %.1f s, arrived: ", info.waited_s);
    for (size_t k = 0; k < rk.n_arrived; k++)
      ADD("%s%" PRIu32, k ? "," : "rank ", in[k]);
    if (rk.n_arrived == 0)
      ADD("none");
    if (rk.arrived_all > rk.n_arrived)
      ADD(" and %" PRIu32 " more", rk.arrived_all - (uint32_t)rk.n_arrived);
    ADD(", waiting for: ");
    for (size_t k = 0; k < rk.n_waiting; k++)
      ADD("%srank %" PRIu32 "%s", k ? ", " : "", waiting[k],
          shardd__jobs_rank_held(&d->jobs, job, waiting[k]) ? "" : " (not connected)");
    if (rk.waiting_all > rk.n_waiting)
      ADD(" and %" PRIu32 " more", rk.waiting_all - (uint32_t)rk.n_waiting);
  }
  if (total > 4)
    ADD("; and %" PRIu32 " more", total - 4);
  ADD(" (a trainer that never lets its queue empty, e.g. one that sends the "
      "next gather before the step's reply, checkpoints with sm.checkpoint)");
#undef ADD
}

/* The tick: waits past their bound end with what they waited on. */
void shardd__ckpt_pends_expire(shardd__dispatch *d, double now) {
  for (ckpt_pend *p = d->ckpt_pends, *next; p; p = next) {
    next = p->next;
    if (now - p->since < p->wait_s)
      continue;
    char msg[2048];
    pend_describe(d, p, msg, sizeof msg);
    shardd__log(1, "checkpoint of job \"%s\" to %s timed out: %s", p->job->name,
                p->dir, msg);
    shardd__reply(d, p->c, p->seq, SHARDD_E_TIMEOUT, msg);
    pend_end(d, p);
  }
}

/* c closed: its waits end unanswered. */
static void pends_forget(shardd__dispatch *d, const shardd__conn *c) {
  for (ckpt_pend *p = d->ckpt_pends, *next; p; p = next) {
    next = p->next;
    if (p->c == c)
      pend_end(d, p);
  }
}

void shardd__on_checkpoint(shardd__dispatch *d, shardd__conn *c, uint64_t seq,
                           const Shardwire__Request *req) {
  const Shardwire__Checkpoint *cp = req->checkpoint;
  char err[ERRLEN], home[4096];
  shardd_err rc = shardd__checkpoint_dir_ok(d, c, cp->dir, 0, home, sizeof home, err,
                                            sizeof err);
  if (rc != SHARDD_OK) {
    shardd__reply(d, c, seq, rc, err);
    return;
  }
  shardd__job *job = c->m.job;
  if (job == NULL) {
    job = shardd__access_find_job(&d->reg, &c->peer, cp->job);
    if (job == NULL) {
      snprintf(err, sizeof err, "no job \"%s\"", cp->job ? cp->job : "");
      shardd__reply(d, c, seq, SHARDD_E_NOT_FOUND, err);
      return;
    }
    if ((rc = shardd__access_checkpoint(&c->peer, job, err, sizeof err)) !=
        SHARDD_OK) {
      shardd__reply(d, c, seq, rc, err);
      return;
    }
  } else if (cp->job && cp->job[0] && strcmp(cp->job, job->name) != 0 &&
             shardd__access_find_job(&d->reg, &c->peer, cp->job) != job) {
    snprintf(err, sizeof err, "a session of job \"%s\" cannot checkpoint job \"%s\"",
             job->name, cp->job);
    shardd__reply(d, c, seq, SHARDD_E_NOT_OWNED, err);
    return;
  }
  /* One node's daemon cannot vouch for the other nodes' parts: a job
   * manifest needs every node's, which the ranks' collective checkpoint
   * gathers. (--checkpoint-on-exit writes the part alone, and says so.) */
  if (job->nodes > 1) {
    snprintf(err, sizeof err, "job \"%s\" spans %" PRIu32 " nodes: it is "
             "checkpointed collectively, by its ranks (sm.checkpoint(dir), "
             "shardd_checkpoint_collective) on every node, which writes each "
             "node's part and the job manifest over them", job->name, job->nodes);
    shardd__reply(d, c, seq, SHARDD_E_STATE, err);
    return;
  }
  /* the user's directory is made only for a checkpoint it may take */
  if (home[0] && (rc = shardd__checkpoint_dir_ok(d, c, cp->dir, 1, home, sizeof home,
                                                 err, sizeof err)) != SHARDD_OK) {
    shardd__reply(d, c, seq, rc, err);
    return;
  }
  double wait_s = cp->has_wait_s ? cp->wait_s : 0;
  if (!(wait_s >= 0 && wait_s <= CKPT_WAIT_MAX)) { /* NaN too */
    snprintf(err, sizeof err, "checkpoint wait must be 0..%d s", CKPT_WAIT_MAX);
    shardd__reply(d, c, seq, SHARDD_E_RANGE, err);
    return;
  }
  if (wait_s > 0 && job->nodes == 1 && !shardd__jobs_restoring(&d->jobs, job) &&
      !pend_may_start(d, job)) {
    pend_add(d, c, seq, job, cp->dir, home[0] ? home : NULL, wait_s);
    return;
  }
  /* The files are written off the loop thread: a 1.6 GB checkpoint froze
   * every client for 4.9 s and made another job's gather time out. */
  ckpt_wait *w = ckpt_wait_new(d, c, seq, cp->dir);
  if (w == NULL)
    return;
  rc = shardd__jobs_checkpoint_start(&d->jobs, job, cp->dir,
                                     (int64_t)c->peer.uid, home[0] ? home : NULL,
                                     ckpt_done_job, w, err, sizeof err);
  ckpt_wait_started(w, rc, err);
}

static void restore_done(void *arg, shardd__job *job, shardd_err rc,
                         const char *err) {
  const ckpt_wait *w = arg;
  if (rc == SHARDD_OK)
    shardd__log(2, "job \"%s\" restored from %s at step %" PRIu64, job->name,
                w->dir, shardd__jobs_step(job));
  if (rc == SHARDD_OK) /* a new job: into the fd store (when in use) */
    shardd__fdstore_touch(w->d->fdstore, NULL);
  ckpt_done(arg, job, rc, err);
}

void shardd__on_restore(shardd__dispatch *d, shardd__conn *c, uint64_t seq,
                        const Shardwire__Request *req) {
  const Shardwire__Restore *rs = req->restore;
  char err[ERRLEN], home[4096];
  shardd_err rc = shardd__checkpoint_dir_ok(d, c, rs->dir, 0, home, sizeof home, err,
                                            sizeof err);
  if (rc != SHARDD_OK) {
    shardd__reply(d, c, seq, rc, err);
    return;
  }
  /* The payloads are read off the loop thread, as a checkpoint's are
   * written: a large restore froze every client. */
  ckpt_wait *w = ckpt_wait_new(d, c, seq, rs->dir);
  if (w == NULL)
    return;
  rc = shardd__jobs_restore_start(&d->jobs, rs->dir, (int64_t)c->peer.uid,
                                  rs->has_world ? rs->world : 0, restore_done,
                                  w, err, sizeof err);
  ckpt_wait_started(w, rc, err);
}

/* c is going away: its waiting checkpoints are forgotten, and the replies
 * its checkpoints and restores still wait for are dropped as they end. */
void shardd__ckpt_closed(shardd__dispatch *d, shardd__conn *c) {
  pends_forget(d, c);
  for (ckpt_wait *w = d->ckpt_waits; w; w = w->next)
    if (w->c == c)
      w->c = NULL; /* its files are still written; the reply is dropped */
}

int shardd__dispatch_awaits_files(const shardd__dispatch *d,
                                  const shardd__conn *c) {
  for (const ckpt_pend *p = d->ckpt_pends; p; p = p->next)
    if (p->c == c) /* waits for a quiet job, which a stop never gives */
      return 0;
  for (const ckpt_wait *w = d->ckpt_waits; w; w = w->next)
    if (w->c == c)
      return 1;
  return 0;
}

/* The dispatcher is freed: what still waits goes. */
void shardd__ckpt_free(shardd__dispatch *d) {
  while (d->ckpt_waits) { /* only if the loop was not run dry */
    ckpt_wait *w = d->ckpt_waits;
    d->ckpt_waits = w->next;
    free(w->dir);
    free(w);
  }
  while (d->ckpt_pends) { /* every connection closed first: none is left */
    ckpt_pend *p = d->ckpt_pends;
    d->ckpt_pends = p->next;
    free(p->dir);
    free(p->home);
    free(p);
  }
}
