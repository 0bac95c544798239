/* jobs.c — job lifetime (see jobs.h): rank claims, leaving, linger and
 * release, pins. Checkpoints and restores of jobs are jobs_ckpt.c. */
#include "jobs.h"
#include "jobs_int.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "checkpoint.h"
#include "fabric.h"
#include "log.h"
#include "lowest.h"

slot *shardd__jobs_slot_get(const shardd__jobs *j, const shardd__job *job) {
  return shardd__map_get_id(&j->slots, shardd__jobs_key(job));
}

slot *shardd__jobs_slot_make(shardd__jobs *j, shardd__job *job) {
  slot *s = shardd__jobs_slot_get(j, job);
  if (s)
    return s;
  if ((s = calloc(1, sizeof *s)) == NULL ||
      (s->owners = calloc(job->world, sizeof *s->owners)) == NULL ||
      (s->bye = calloc(job->world, 1)) == NULL) {
    if (s)
      free(s->owners);
    free(s);
    return NULL;
  }
  s->job = job;
  s->empty_since = -1;
  if (shardd__map_put_id(&j->slots, shardd__jobs_key(job), s) != SHARDD_OK) {
    free(s->owners);
    free(s->bye);
    free(s);
    return NULL;
  }
  return s;
}

void shardd__jobs_slot_free(slot *s) {
  if (s) {
    free(s->resume_dir);
    free(s->held);
    free(s->owners);
    free(s->bye);
    free(s);
  }
}

void shardd__jobs_init(shardd__jobs *j, uv_loop_t *loop, shardd__registry *reg,
                       shardd__coll_engine *coll, double linger,
                       const shardd__jobspec *specs, size_t nspecs,
                       shardd__jobs_released released, void *released_arg) {
  memset(j, 0, sizeof *j);
  j->released = released;
  j->released_arg = released_arg;
  j->loop = loop;
  j->reg = reg;
  j->coll = coll;
  j->linger = linger;
  j->specs = specs;
  j->nspecs = nspecs;
  shardd__map_init(&j->slots);
}

static void free_slot_cb(void *value, void *arg) { shardd__jobs_slot_free(value); }

void shardd__jobs_free(shardd__jobs *j) {
  /* none is left once the loop has run dry; any still queued is dropped
   * unwritten, its hook never called */
  while (j->ck_first) {
    shardd__jobs_ckpt *k = j->ck_first;
    j->ck_first = k->next;
    shardd__checkpoint_wfree(k->w);
    free(k);
  }
  j->ck_last = NULL;
  while (j->restores) { /* likewise: dropped, its job released */
    shardd__jobs_restore *k = j->restores;
    j->restores = k->next;
    shardd__checkpoint_restore_free(k->r);
    free(k->dir);
    free(k);
  }
  shardd__map_each(&j->slots, free_slot_cb, NULL);
  shardd__map_free(&j->slots);
}

static void release(shardd__jobs *j, shardd__job *job) {
  if (j->released)
    j->released(j->released_arg, job);
  shardd__jobs_slot_free(shardd__map_del_id(&j->slots, shardd__jobs_key(job)));
  shardd__coll_job_free(j->coll, job);
  shardd__job_release(j->reg, job);
}

/* Another uid's job of job's name that spans nodes (took a spec's layout). */
void shardd__jobs_find_spanning(shardd__job *other, void *arg) {
  spanning_arg *a = arg;
  if (other != a->job && other->uid != a->job->uid && other->nodes > 1 &&
      strcmp(other->name, a->job->name) == 0)
    a->other = other;
}

shardd_err shardd__jobs_layout(shardd__jobs *j, shardd__job *job, uint32_t rank,
                               char *err, size_t errlen) {
  const shardd__jobspec *sp =
      shardd__jobspec_find(j->specs, j->nspecs, job->uid, job->name);
  if (sp == NULL)
    return SHARDD_OK;
  if (sp->uid < 0 && sp->nodes > 1 && job->nodes == 1) {
    /* A spec without a uid joins one job over the fabric, never two
     * users' jobs of one name. */
    spanning_arg a = {job, NULL};
    shardd__registry_each_job(j->reg, shardd__jobs_find_spanning, &a);
    if (a.other) {
      snprintf(err, errlen,
               "job spec %s for \"%s\" gives no uid and another user's job "
               "of that name holds it; an admin can give the spec a uid",
               sp->path, job->name);
      return SHARDD_E_BUSY;
    }
  }
  if (sp->world != job->world) {
    snprintf(err, errlen,
             "job \"%s\" has world %" PRIu32 " in its job spec %s, not %" PRIu32,
             job->name, sp->world, sp->path, job->world);
    return SHARDD_E_MISMATCH;
  }
  if (sp->nodes > 1 && job->nodes == 1) {
    const shardd__backend *be = j->reg->backend;
    if (!(be->caps & SHARDD__BACKEND_CAP_HOST_MAPPED)) {
      snprintf(err, errlen,
               "job \"%s\" spans %" PRIu32 " nodes, but cross-node collectives "
               "on the %s backend need the NCCL fabric, which this shardd "
               "does not have; use --backend host",
               job->name, sp->nodes, be->name);
      return SHARDD_E_STATE;
    }
    if (shardd__fabric_engine() == NULL) {
      snprintf(err, errlen,
               "job \"%s\" spans %" PRIu32 " nodes, but this shardd was built "
               "without Gloo (install libgloo-dev and rebuild)",
               job->name, sp->nodes);
      return SHARDD_E_STATE;
    }
    shardd_err rc = shardd__coll_job_span(j->coll, job, sp->nodes, sp->node_rank,
                                          sp->rendezvous, sp->host, err, errlen);
    if (rc != SHARDD_OK)
      return rc;
  }
  if (rank < job->world && !shardd__job_rank_local(job, rank)) {
    uint32_t node = rank / job->local_ranks;
    snprintf(err, errlen,
             "rank %" PRIu32 " of job \"%s\" belongs to node %" PRIu32
             " (ranks %" PRIu32 "..%" PRIu32 "); this daemon is node %" PRIu32
             " of %" PRIu32 " and holds ranks %" PRIu32 "..%" PRIu32,
             rank, job->name, node, node * job->local_ranks,
             (node + 1) * job->local_ranks - 1, job->node_rank, job->nodes,
             job->local_first, job->local_first + job->local_ranks - 1);
    return SHARDD_E_RANGE;
  }
  return SHARDD_OK;
}

shardd_err shardd__jobs_claim(shardd__jobs *j, shardd__job *job, uint32_t rank,
                              uint64_t owner, int32_t pid, int32_t *holder_pid) {
  *holder_pid = 0;
  slot *s = shardd__jobs_slot_make(j, job);
  if (s == NULL)
    return SHARDD_E_NO_MEMORY;
  if (s->owners[rank].owner != 0) {
    *holder_pid = s->owners[rank].pid;
    return SHARDD_E_STATE;
  }
  if (s->nheld == s->held_cap) {
    uint32_t cap = s->held_cap ? 2 * s->held_cap : 4;
    uint32_t *h = realloc(s->held, cap * sizeof *h);
    if (h == NULL)
      return SHARDD_E_NO_MEMORY;
    s->held = h;
    s->held_cap = cap;
  }
  s->owners[rank].owner = owner;
  s->owners[rank].pid = pid;
  s->owners[rank].at = s->nheld;
  s->held[s->nheld++] = rank;
  s->nclients++;
  s->empty_since = -1;
  if (s->bye[rank]) { /* a rank rejoining: not finished after all */
    s->bye[rank] = 0;
    s->nbye--;
  }
  s->finished = 0;
  return SHARDD_OK;
}

uint64_t shardd__jobs_holder(const shardd__jobs *j, const shardd__job *job,
                             uint32_t rank) {
  const slot *s = shardd__jobs_slot_get(j, job);
  return s && rank < job->world ? s->owners[rank].owner : 0;
}

void shardd__jobs_leave(shardd__jobs *j, shardd__job *job, uint32_t rank,
                        uint64_t owner, double now, int finished) {
  slot *s = shardd__jobs_slot_get(j, job);
  if (s == NULL)
    return;
  if (s->owners[rank].owner == owner) {
    s->owners[rank].owner = 0;
    uint32_t at = s->owners[rank].at, last = s->held[--s->nheld];
    s->held[at] = last; /* the last one takes its place */
    s->owners[last].at = at;
    if (finished && !s->bye[rank]) {
      s->bye[rank] = 1;
      s->nbye++;
    }
  }
  if (--s->nclients == 0) {
    s->empty_since = now;
    s->finished = s->nbye == job->local_ranks;
  }
  shardd__jobs_idle(j, job);
}

shardd_err shardd__jobs_unclaimed(shardd__jobs *j, shardd__job *job, double now,
                                  int release_now) {
  slot *s = shardd__jobs_slot_make(j, job);
  if (s == NULL) {
    shardd__log(0, "job \"%s\" released: out of memory tracking it", job->name);
    release(j, job);
    return SHARDD_E_NO_MEMORY;
  }
  if (s->nclients > 0)
    return SHARDD_OK;
  if (!release_now) {
    /* A restored job lingers like one whose clients left, so it is
     * released if nobody comes back. */
    s->empty_since = now;
  } else if (s->empty_since < 0) {
    /* A job a refused Hello created has no client to wait for. */
    s->empty_since = now;
    shardd__jobs_idle(j, job);
  }
  return SHARDD_OK;
}

void shardd__jobs_idle(shardd__jobs *j, shardd__job *job) {
  /* --job-linger 0, or a finished job (every rank said Goodbye): a job
   * ends with its last client (or with the last collective that outlived
   * it), not at the next tick. */
  const slot *s = shardd__jobs_slot_get(j, job);
  int finished = s != NULL && s->finished;
  if (shardd__jobs_clients(j, job) == 0 && (j->linger == 0 || finished) &&
      !j->stopping && shardd__coll_inflight(j->coll, job) == 0 &&
      !shardd__jobs_checkpointing(j, job) && !shardd__jobs_restoring(j, job) &&
      !shardd__jobs_pinned(j, job)) {
    shardd__log(2, "job \"%s\" released (%s)", job->name,
                finished ? "every rank finished" : "last client left");
    release(j, job);
  }
}

typedef struct {
  shardd__jobs *j;
  double now;
  shardd__job **expired;
  size_t n, cap;
} linger_arg;

/* In the registry's order, as before the lifetime state moved here, so
 * the release lines of one tick come out alike. */
static void find_lingering(shardd__job *job, void *arg) {
  linger_arg *a = arg;
  slot *s = shardd__jobs_slot_get(a->j, job);
  if (s && s->nclients == 0 && s->empty_since >= 0 && a->j->linger >= 0 &&
      a->now - s->empty_since >= a->j->linger && !s->checkpointing &&
      !s->restoring && s->pins == 0 &&
      shardd__coll_inflight(a->j->coll, s->job) == 0 && a->n < a->cap)
    a->expired[a->n++] = s->job;
}

void shardd__jobs_expire(shardd__jobs *j, double now) {
  size_t cap = shardd__map_count(&j->slots);
  if (cap == 0)
    return;
  linger_arg a = {j, now, malloc(cap * sizeof(shardd__job *)), 0, cap};
  if (a.expired == NULL)
    return;
  shardd__registry_each_job(j->reg, find_lingering, &a);
  for (size_t i = 0; i < a.n; i++) {
    shardd__log(2, "job \"%s\" released (no client for %.0f s)",
                a.expired[i]->name, j->linger);
    release(j, a.expired[i]);
  }
  free(a.expired);
}

shardd_err shardd__jobs_pin(shardd__jobs *j, shardd__job *job) {
  slot *s = shardd__jobs_slot_make(j, job);
  if (s == NULL)
    return SHARDD_E_NO_MEMORY;
  s->pins++;
  return SHARDD_OK;
}

void shardd__jobs_unpin(shardd__jobs *j, shardd__job *job) {
  slot *s = shardd__jobs_slot_get(j, job);
  if (s && s->pins > 0 && --s->pins == 0)
    shardd__jobs_idle(j, job);
}

int shardd__jobs_pinned(const shardd__jobs *j, const shardd__job *job) {
  const slot *s = shardd__jobs_slot_get(j, job);
  return s != NULL && s->pins > 0;
}

shardd_err shardd__jobs_release_now(shardd__jobs *j, shardd__job *job,
                                    char *err, size_t errlen) {
  uint32_t n = shardd__jobs_clients(j, job);
  if (n > 0) {
    /* the ranks' handles, mappings and pending collectives would outlive
     * the job under them; ending a trainer is its launcher's business */
    char ranks[256] = "";
    size_t len = 0;
    const slot *s = shardd__jobs_slot_get(j, job);
    for (uint32_t r = 0; r < job->world && len + 16 < sizeof ranks; r++)
      if (s->owners[r].owner != 0)
        len += (size_t)snprintf(ranks + len, sizeof ranks - len, "%s%" PRIu32
                                " (pid %" PRId32 ")", len ? ", " : "", r,
                                s->owners[r].pid);
    snprintf(err, errlen,
             "job \"%s\" has %" PRIu32 " connected rank(s): %s; stop its "
             "trainers first (release never ends a connected rank)",
             job->name, n, ranks);
    return SHARDD_E_BUSY;
  }
  const char *what = NULL;
  if (shardd__jobs_checkpointing(j, job))
    what = "is being checkpointed";
  else if (shardd__jobs_restoring(j, job))
    what = "is being restored";
  else if (shardd__jobs_pinned(j, job))
    what = "has a checkpoint waiting for it";
  else if (shardd__coll_inflight(j->coll, job) > 0 && job->nodes > 1)
    /* the wait of a re-forming for a dead node ends with the ranks gone */
    what = "has collectives in flight (a cross-node exchange or fabric "
           "re-forming is abandoned --peer-grace after this node's last rank "
           "of the job left: retry then)";
  else if (shardd__coll_inflight(j->coll, job) > 0)
    what = "has collectives in flight";
  if (what) {
    snprintf(err, errlen, "job \"%s\" %s; release it after that ends",
             job->name, what);
    return SHARDD_E_BUSY;
  }
  release(j, job);
  return SHARDD_OK;
}

int shardd__jobs_rank_held(const shardd__jobs *j, const shardd__job *job,
                           uint32_t rank) {
  const slot *s = shardd__jobs_slot_get(j, job);
  return s && rank < job->world && s->owners[rank].owner != 0;
}

uint32_t shardd__jobs_clients(const shardd__jobs *j, const shardd__job *job) {
  const slot *s = shardd__jobs_slot_get(j, job);
  return s ? s->nclients : 0;
}

uint32_t shardd__jobs_ranks(const shardd__jobs *j, const shardd__job *job,
                            uint32_t *held, uint32_t *missing, size_t max,
                            size_t *nheld, size_t *nmissing) {
  const slot *s = shardd__jobs_slot_get(j, job);
  uint32_t first = job->local_first, end = first + job->local_ranks;
  uint32_t nh = s ? s->nheld : 0, clients = s ? s->nclients : 0;
  *nheld = *nmissing = 0;
  shardd__lowest low;
  shardd__lowest_init(&low, held, max);
  for (uint32_t i = 0; i < nh; i++)
    shardd__lowest_add(&low, s->held[i]);
  *nheld = shardd__lowest_finish(&low);
  /* the lowest others: each step lists one or passes a held rank, so this
   * costs at most max + the ranks held, whatever the world */
  for (uint32_t k = first; k < end && *nmissing < max; k++)
    if (s == NULL || s->owners[k].owner == 0)
      missing[(*nmissing)++] = k;
  return nh > clients ? nh : clients;
}
