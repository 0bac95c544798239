/* jobs_ckpt.c — checkpoints and restores of jobs (see jobs.h): who may
 * checkpoint when, the writes queued on the pool between steps, the exit
 * checkpoint's resume marker, and restores read and loaded off the loop. */
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

/* What refuses a checkpoint of job now, into err; SHARDD_OK when none. */
static shardd_err may_checkpoint(const shardd__jobs *j, const shardd__job *job,
                                 char *err, size_t errlen) {
  if (job->nodes > SHARDD__CKJOB_MAX_NODES) {
    snprintf(err, errlen,
             "job \"%s\" spans %" PRIu32 " nodes; checkpoints of jobs over "
             "more than %d nodes are not supported",
             job->name, job->nodes, SHARDD__CKJOB_MAX_NODES);
    return SHARDD_E_LIMIT;
  }
  if (shardd__jobs_checkpointing(j, job)) {
    snprintf(err, errlen, "job \"%s\" is being checkpointed", job->name);
    return SHARDD_E_BUSY;
  }
  if (shardd__jobs_restoring(j, job)) {
    snprintf(err, errlen, "job \"%s\" is being restored", job->name);
    return SHARDD_E_BUSY;
  }
  uint32_t n = shardd__coll_inflight(j->coll, job);
  if (n > 0) {
    snprintf(err, errlen,
             "job \"%s\" has %" PRIu32 " collective(s) in flight; checkpoint "
             "between steps",
             job->name, n);
    return SHARDD_E_BUSY;
  }
  return SHARDD_OK;
}

/* The log line of a checkpoint that one daemon wrote alone, between steps. */
static void log_written(const shardd__job *job, const char *dir) {
  if (job->nodes > 1)
    /* the other nodes cannot take part (this is the daemon's own exit, or
     * a blocking caller): the part alone, which only this node's daemon
     * restores (its job spec says which part is its own), to rejoin the
     * live nodes of the job; anywhere else it is refused for want of the
     * job manifest */
    shardd__log(2, "job \"%s\": node %" PRIu32 "'s part written to "
                "%s/node-%" PRIu32 " without a job manifest (only a collective "
                "checkpoint writes one): a daemon of this node started with the "
                "job's --job-spec and --restore %s restores it to rejoin the "
                "job's live nodes",
                job->name, job->node_rank, dir, job->node_rank, dir);
  else
    shardd__log(2, "job \"%s\" checkpointed to %s", job->name, dir);
}

shardd_err shardd__jobs_checkpoint(shardd__jobs *j, shardd__job *job,
                                   const char *dir, int64_t as_uid,
                                   const char *home, char *err, size_t errlen) {
  shardd_err rc = may_checkpoint(j, job, err, errlen);
  if (rc != SHARDD_OK)
    return rc;
  if (job->nodes > 1) /* its part records the lineage (registry.h) */
    job->lineage = shardd__coll_job_lineage(j->coll, job);
  rc = shardd__checkpoint_write_in(j->reg, job, dir, as_uid, home, err, errlen);
  if (rc == SHARDD_OK)
    log_written(job, dir);
  return rc;
}

void shardd__jobs_checkpoint_many(shardd__jobs *j, shardd__job **jobs,
                                  char **dirs, size_t n, shardd_err *rcs,
                                  char *errs, size_t errlen, uint64_t *bytes) {
  struct timespec t0, t1;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  *bytes = 0;
  shardd__ckwrite **ws = calloc(n ? n : 1, sizeof *ws);
  size_t *at = calloc(n ? n : 1, sizeof *at); /* ws[i] is jobs[at[i]]'s */
  shardd_err *wrc = calloc(n ? n : 1, sizeof *wrc);
  char *werr = calloc(n ? n : 1, errlen);
  size_t nw = 0, ok = 0;
  for (size_t k = 0; k < n; k++) {
    char *err = errs + k * errlen;
    err[0] = '\0';
    if (ws == NULL || at == NULL || wrc == NULL || werr == NULL) {
      rcs[k] = SHARDD_E_NO_MEMORY;
      snprintf(err, errlen, "out of memory");
      continue;
    }
    rcs[k] = may_checkpoint(j, jobs[k], err, errlen);
    if (rcs[k] != SHARDD_OK)
      continue;
    if (jobs[k]->nodes > 1) /* its part records the lineage (registry.h) */
      jobs[k]->lineage = shardd__coll_job_lineage(j->coll, jobs[k]);
    rcs[k] = shardd__checkpoint_prepare(j->reg, jobs[k], dirs[k], -1, NULL,
                                        &ws[nw], err, errlen);
    if (rcs[k] == SHARDD_OK)
      at[nw++] = k;
  }
  if (nw > 0)
    shardd__checkpoint_run_many(j->loop, ws, nw, wrc, werr, errlen);
  for (size_t i = 0; i < nw; i++) {
    size_t k = at[i];
    rcs[k] = wrc[i];
    memcpy(errs + k * errlen, werr + i * errlen, errlen);
    if (rcs[k] == SHARDD_OK) {
      ok++;
      *bytes += shardd__checkpoint_wbytes(ws[i]);
      log_written(jobs[k], dirs[k]);
    }
    shardd__checkpoint_wfree(ws[i]);
  }
  clock_gettime(CLOCK_MONOTONIC, &t1);
  double s = (double)(t1.tv_sec - t0.tv_sec) + (double)(t1.tv_nsec - t0.tv_nsec) * 1e-9;
  if (n > 0)
    shardd__log(2, "exit checkpoint: %zu of %zu job%s written, %.1f MiB in "
                "%.2f s (%.0f MiB/s)", ok, n, n == 1 ? "" : "s",
                (double)*bytes / 1048576.0, s,
                s > 0 ? (double)*bytes / 1048576.0 / s : 0.0);
  free(ws);
  free(at);
  free(wrc);
  free(werr);
}

uint64_t shardd__jobs_step(shardd__job *job) {
  shardd__optim **opts;
  size_t n;
  uint64_t step = 0;
  if (shardd__job_optims(job, &opts, &n) != SHARDD_OK)
    return 0;
  for (size_t i = 0; i < n; i++)
    if (opts[i]->steps > step)
      step = opts[i]->steps;
  free(opts);
  return step;
}

shardd_err shardd__jobs_resumed(shardd__jobs *j, shardd__job *job,
                                const char *dir, const char *part,
                                uint32_t seal) {
  slot *s = shardd__jobs_slot_make(j, job);
  char *d = s ? strdup(dir) : NULL;
  if (d == NULL)
    return SHARDD_E_NO_MEMORY;
  free(s->resume_dir);
  s->resume_dir = d;
  snprintf(s->resume.job, sizeof s->resume.job, "%s", job->name);
  snprintf(s->resume.part, sizeof s->resume.part, "%s", part);
  s->resume.seal = seal;
  s->resume.step = shardd__jobs_step(job);
  return SHARDD_OK;
}

void shardd__jobs_advancing(shardd__jobs *j, shardd__job *job) {
  slot *s = shardd__jobs_slot_get(j, job);
  if (s == NULL || s->resume_dir == NULL)
    return;
  char err[1024];
  /* Written before the step runs: a kill -9 between the step and the
   * marker would otherwise bring the checkpoint back one step behind
   * the trainers, unannounced. Blocks the loop for one small file, once
   * per restored job. */
  if (shardd__checkpoint_supersede(s->resume_dir, &s->resume, err, sizeof err) ==
      SHARDD_OK)
    shardd__log(2, "job \"%s\" steps past step %" PRIu64 ": its exit checkpoint "
                "in %s is marked superseded (%s/%s); a restart restores it only "
                "once a newer exit checkpoint replaces it",
                job->name, s->resume.step, s->resume_dir, s->resume_dir,
                SHARDD__SUPERSEDED_FILE);
  else
    shardd__log(0, "job \"%s\" steps past its exit checkpoint in %s (step %"
                PRIu64 "), which could not be marked superseded: %s; a restart "
                "after a crash would restore it and roll the job back",
                job->name, s->resume_dir, s->resume.step, err);
  free(s->resume_dir); /* tried once: the step goes on either way */
  s->resume_dir = NULL;
}

uint32_t shardd__jobs_last_seal(const shardd__jobs *j, const shardd__job *job) {
  const slot *s = shardd__jobs_slot_get(j, job);
  return s ? s->last_seal : 0;
}

shardd_err shardd__jobs_checkpoint_job(shardd__jobs *j, shardd__job *job,
                                       const char *dir, int64_t as_uid,
                                       const char *home, const uint32_t *seals,
                                       char *err, size_t errlen) {
  uint32_t seal;
  shardd_err rc = shardd__checkpoint_write_job(dir, as_uid, home, job, seals,
                                               &seal, err, errlen);
  if (rc == SHARDD_OK)
    shardd__log(2, "job \"%s\" checkpointed to %s (node %" PRIu32 " of %" PRIu32
                ", job manifest sealed %08" PRIx32 ")",
                job->name, dir, job->node_rank, job->nodes, seal);
  return rc;
}

int shardd__jobs_checkpointing(const shardd__jobs *j, const shardd__job *job) {
  const slot *s = shardd__jobs_slot_get(j, job);
  return s != NULL && s->checkpointing;
}

/* On a pool thread: the files. Reads the job's memory, no registry
 * struct (see shardd__checkpoint_run). */
static void ckpt_work(uv_work_t *req) {
  shardd__jobs *j = req->data;
  shardd__jobs_ckpt *k = j->ck_first;
  k->rc = shardd__checkpoint_run(k->w, k->err, sizeof k->err);
}

static void ckpt_after(uv_work_t *req, int status);

/* Starts writing the first queued checkpoint on the pool (once); 0, or
 * uv_queue_work's error (it fails only on bad arguments). */
static int ckpt_kick(shardd__jobs *j) {
  shardd__jobs_ckpt *k = j->ck_first;
  if (k->kicked) /* a done hook started it (an operator's waiting one) */
    return 0;
  k->req.data = j;
  int e = uv_queue_work(j->loop, &k->req, ckpt_work, ckpt_after);
  k->kicked = e == 0;
  return e;
}

/* Takes the first checkpoint off the queue: the job is the registry's to
 * change again and its caller hears how it went. Returns the job. */
static shardd__job *ckpt_finish(shardd__jobs *j) {
  shardd__jobs_ckpt *k = j->ck_first;
  j->ck_first = k->next;
  if (j->ck_first == NULL)
    j->ck_last = NULL;
  shardd__job *job = k->job;
  slot *s = shardd__jobs_slot_get(j, job);
  if (s) {
    s->checkpointing = 0;
    s->last_seal = k->rc == SHARDD_OK ? shardd__checkpoint_wseal(k->w) : 0;
  }
  if (k->rc == SHARDD_OK && job->nodes > 1)
    shardd__log(2, "job \"%s\": node %" PRIu32 "'s part written to %s/node-%"
                PRIu32, job->name, job->node_rank, shardd__checkpoint_wdir(k->w),
                job->node_rank);
  else if (k->rc == SHARDD_OK)
    shardd__log(2, "job \"%s\" checkpointed to %s", job->name,
                shardd__checkpoint_wdir(k->w));
  else /* the asker hears it too, but an operator reads the log */
    shardd__log(1, "checkpoint of job \"%s\" to %s failed: %s", job->name,
                shardd__checkpoint_wdir(k->w), k->err);
  k->done(k->arg, job, k->rc, k->err);
  shardd__checkpoint_wfree(k->w);
  free(k);
  return job;
}

/* On the loop thread, once the files are written: the caller hears, the
 * next checkpoint starts, and a job nobody holds any more may go. */
static void ckpt_after(uv_work_t *req, int status) {
  shardd__jobs *j = req->data;
  shardd__job *job = ckpt_finish(j);
  int e;
  while (j->ck_first && (e = ckpt_kick(j)) != 0) {
    j->ck_first->rc = SHARDD_E_INVAL;
    snprintf(j->ck_first->err, sizeof j->ck_first->err,
             "cannot start the checkpoint: %s", uv_strerror(e));
    shardd__jobs_idle(j, ckpt_finish(j));
  }
  shardd__jobs_idle(j, job); /* may free job */
}

shardd_err shardd__jobs_checkpoint_start(shardd__jobs *j, shardd__job *job,
                                         const char *dir, int64_t as_uid,
                                         const char *home,
                                         shardd__jobs_ckpt_done done,
                                         void *arg, char *err, size_t errlen) {
  shardd_err rc = may_checkpoint(j, job, err, errlen);
  if (rc != SHARDD_OK)
    return rc;
  shardd__jobs_ckpt *k = calloc(1, sizeof *k);
  slot *s = k ? shardd__jobs_slot_make(j, job) : NULL;
  if (s == NULL) {
    free(k);
    snprintf(err, errlen, "out of memory");
    return SHARDD_E_NO_MEMORY;
  }
  if (job->nodes > 1) /* its part records the lineage (registry.h) */
    job->lineage = shardd__coll_job_lineage(j->coll, job);
  rc = shardd__checkpoint_prepare(j->reg, job, dir, as_uid, home, &k->w, err,
                                  errlen);
  if (rc != SHARDD_OK) {
    free(k);
    return rc;
  }
  k->job = job;
  k->done = done;
  k->arg = arg;
  if (j->ck_first == NULL) {
    j->ck_first = j->ck_last = k;
    int e = ckpt_kick(j);
    if (e != 0) {
      j->ck_first = j->ck_last = NULL;
      shardd__checkpoint_wfree(k->w);
      free(k);
      snprintf(err, errlen, "cannot start the checkpoint: %s", uv_strerror(e));
      return SHARDD_E_INVAL;
    }
  } else { /* written once those before it are */
    j->ck_last->next = k;
    j->ck_last = k;
  }
  s->checkpointing = 1;
  return SHARDD_OK;
}

int shardd__jobs_restoring(const shardd__jobs *j, const shardd__job *job) {
  const slot *s = shardd__jobs_slot_get(j, job);
  return s != NULL && s->restoring;
}

/* On a pool thread: the data files, into the new job's memory only (see
 * shardd__checkpoint_restore_run). */
static void restore_work(uv_work_t *req) {
  shardd__jobs_restore *k = req->data;
  /* $SHARDD_TEST_RESTORE_PAUSE_MS: tests hold the load this long (on the
   * pool, never the loop) so what is refused while a job loads is seen
   * whatever the page cache makes a load's own time */
  const char *pause = getenv("SHARDD_TEST_RESTORE_PAUSE_MS");
  if (pause != NULL)
    usleep((useconds_t)strtoul(pause, NULL, 10) * 1000);
  k->rc = shardd__checkpoint_restore_run(k->r, k->err, sizeof k->err);
}

static shardd_err restore_span(shardd__jobs *j, shardd__job *job,
                               const shardd__jobspec *sp, char *err,
                               size_t errlen);

/* On the loop thread, once the files are read: the job is handed over
 * and lingers like one whose clients left, or a failed one is released;
 * the caller hears. A stopping daemon ran the loop until here. */
static void restore_after(uv_work_t *req, int status) {
  shardd__jobs_restore *k = req->data;
  shardd__jobs *j = k->j;
  for (shardd__jobs_restore **p = &j->restores; *p; p = &(*p)->next)
    if (*p == k) {
      *p = k->next;
      break;
    }
  if (status != 0 && k->rc == SHARDD_OK) { /* cancelled: never loaded */
    k->rc = SHARDD_E_INVAL;
    snprintf(k->err, sizeof k->err, "the restore was cancelled: %s",
             uv_strerror(status));
  }
  shardd__job *job = NULL;
  if (k->rc == SHARDD_OK &&
      (k->rc = restore_span(j, k->job, k->sp, k->err, sizeof k->err)) != SHARDD_OK)
    shardd__coll_job_free(j->coll, k->job);
  if (k->rc == SHARDD_OK) {
    job = shardd__checkpoint_restore_finish(k->r);
    shardd__jobs_slot_get(j, job)->restoring = 0;
    /* a restored job lingers like one whose clients left (it has a slot:
     * this cannot fail) */
    shardd__jobs_unclaimed(j, job, (double)uv_now(j->loop) / 1000.0, 0);
  } else {
    shardd__jobs_slot_free(shardd__map_del_id(&j->slots, shardd__jobs_key(k->job)));
  }
  shardd__checkpoint_restore_free(k->r); /* releases a failed one's job */
  k->done(k->arg, job, k->rc, k->err);
  free(k->dir);
  free(k);
}

/* dir without a manifest of its own: this node's exit part of a live
 * multi-node job (dir/node-N, --checkpoint-on-exit), for the spec whose
 * job and node it is, and whose uid (where it gives one) owns the part:
 * a part of another uid's job of the name is refused, whoever asks, so no
 * forged part joins a user's fabric. A spec refusing it does not stop the
 * search (two specs may name one job for two uids); the first refusal is
 * reported when no spec takes it. *found 0: no spec has a part there (the
 * caller goes on, and refuses the directory for its missing manifest). */
static shardd_err restore_read_exit(shardd__jobs *j, const char *dir,
                                       int64_t as_uid, uint32_t world,
                                       shardd__ckrestore **out,
                                       const shardd__jobspec **sp, int *found,
                                       char *err, size_t errlen) {
  *found = 0;
  char path[4096];
  if ((size_t)snprintf(path, sizeof path, "%s/manifest", dir) >= sizeof path ||
      access(path, F_OK) == 0)
    return SHARDD_OK;
  shardd_err refused = SHARDD_OK;
  for (size_t i = 0; i < j->nspecs; i++) {
    const shardd__jobspec *s = &j->specs[i];
    snprintf(path, sizeof path, "%s/node-%" PRIu32 "/manifest", dir, s->node_rank);
    if (s->nodes < 2 || access(path, F_OK) != 0)
      continue;
    if (world != 0 && world != s->world) {
      *found = 1;
      snprintf(err, errlen, "%s: this node's part of job \"%s\" restores into "
               "its own world (%" PRIu32 ") only, not %" PRIu32, dir, s->job,
               s->world, world);
      return SHARDD_E_RANGE;
    }
    char why[1024];
    shardd_err rc = shardd__checkpoint_restore_read_exit_part(
        j->reg, dir, as_uid, s->job, s->world, s->nodes, s->node_rank, s->uid,
        s->path, out, why, sizeof why);
    if (rc == SHARDD_E_NOT_FOUND) /* another job's part */
      continue;
    if (rc == SHARDD_E_PERMISSION) { /* maybe another spec's uid's */
      if (refused == SHARDD_OK) {
        refused = rc;
        snprintf(err, errlen, "%s", why);
      }
      continue;
    }
    *found = 1;
    if (rc == SHARDD_OK)
      *sp = s;
    else
      snprintf(err, errlen, "%s", why);
    return rc;
  }
  *found = refused != SHARDD_OK;
  return refused;
}

/* Reads the restore of dir: an ordinary checkpoint, this node's exit
 * part, or this node's part of a multi-node job's collective checkpoint
 * (which needs the job's --job-spec here, with the recorded nodes and
 * world: the spec says which node this daemon is), its manifests read and
 * their seals checked. Any thread: it reads the specs (fixed since init)
 * and the files, no registry struct; the loop applies *out.
 * *sp: the spec for a multi-node one (its fabric state is made once the
 * restore succeeded), NULL otherwise. */
static shardd_err restore_read(shardd__jobs *j, const char *dir,
                                  int64_t as_uid, uint32_t world,
                                  shardd__ckrestore **out,
                                  const shardd__jobspec **sp, char *err,
                                  size_t errlen) {
  *sp = NULL;
  int found;
  shardd_err rc = restore_read_exit(j, dir, as_uid, world, out, sp, &found,
                                       err, errlen);
  if (found)
    return rc;
  shardd__ckjob cj;
  rc = shardd__checkpoint_read_job(dir, as_uid, &cj, err, errlen);
  if (rc != SHARDD_OK)
    return rc;
  if (cj.nodes == 0)
    return shardd__checkpoint_restore_read(j->reg, dir, as_uid, world, out,
                                           err, errlen);
  const shardd__jobspec *s = shardd__jobspec_find(j->specs, j->nspecs, cj.uid,
                                                  cj.name);
  if (s == NULL || s->nodes != cj.nodes || s->world != cj.world) {
    char have[160] = "no --job-spec for it";
    if (s)
      snprintf(have, sizeof have, "its job spec %s says world %" PRIu32
               " over %" PRIu32 " nodes", s->path, s->world, s->nodes);
    snprintf(err, errlen,
             "%s is a checkpoint of job \"%s\" over %" PRIu32 " nodes (world %"
             PRIu32 "), but this daemon has %s: restore it on every node, each "
             "daemon started with the job's spec", dir, cj.name, cj.nodes,
             cj.world, have);
    return SHARDD_E_MISMATCH;
  }
  if (world != 0 && world != cj.world) {
    snprintf(err, errlen, "%s: a checkpoint of job \"%s\" over %" PRIu32
             " nodes restores into its own world (%" PRIu32 ") only, not %"
             PRIu32, dir, cj.name, cj.nodes, cj.world, world);
    return SHARDD_E_RANGE;
  }
  rc = shardd__checkpoint_restore_read_part(j->reg, dir, as_uid, &cj,
                                            s->node_rank, out, err, errlen);
  if (rc == SHARDD_OK)
    *sp = s;
  return rc;
}

/* restore_read, then the registrations it read applied (the loop thread):
 * what both restores share once the manifest is read. */
static shardd_err restore_apply(shardd__ckrestore **r, char *err,
                                size_t errlen) {
  shardd_err rc = shardd__checkpoint_restore_apply(*r, err, errlen);
  if (rc != SHARDD_OK) {
    shardd__checkpoint_restore_free(*r); /* releases the job */
    *r = NULL;
  }
  return rc;
}

/* A restored part's job gets the cross-node state a Hello under its spec
 * gives (the layout it has already). */
static shardd_err restore_span(shardd__jobs *j, shardd__job *job,
                               const shardd__jobspec *sp, char *err,
                               size_t errlen) {
  if (sp == NULL)
    return SHARDD_OK;
  if (sp->uid < 0) { /* as a Hello: one uid's job at a time (jobs_layout) */
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
  if (shardd__fabric_engine() == NULL) {
    snprintf(err, errlen, "job \"%s\" spans %" PRIu32 " nodes, but this shardd "
             "was built without Gloo (install libgloo-dev and rebuild)",
             job->name, sp->nodes);
    return SHARDD_E_STATE;
  }
  return shardd__coll_job_span(j->coll, job, sp->nodes, sp->node_rank,
                               sp->rendezvous, sp->host, err, errlen);
}

shardd_err shardd__jobs_restore_now(shardd__jobs *j, const char *dir,
                                int64_t as_uid, uint32_t world,
                                shardd__job **out, char *err, size_t errlen) {
  *out = NULL;
  shardd__ckrestore *r;
  const shardd__jobspec *sp;
  shardd_err rc = restore_read(j, dir, as_uid, world, &r, &sp, err, errlen);
  if (rc == SHARDD_OK)
    rc = restore_apply(&r, err, errlen);
  if (rc != SHARDD_OK)
    return rc;
  if ((rc = shardd__checkpoint_restore_run(r, err, errlen)) == SHARDD_OK &&
      (rc = restore_span(j, shardd__checkpoint_restore_job(r), sp, err,
                         errlen)) == SHARDD_OK)
    *out = shardd__checkpoint_restore_finish(r);
  else if (sp && rc != SHARDD_OK)
    shardd__coll_job_free(j->coll, shardd__checkpoint_restore_job(r));
  shardd__checkpoint_restore_free(r); /* releases the job unless finished */
  return rc;
}

/* On a pool thread: the manifests, read and checked (restore_read). */
static void restore_read_work(uv_work_t *req) {
  shardd__jobs_restore *k = req->data;
  k->rc = restore_read(k->j, k->dir, k->as_uid, k->world, &k->r, &k->sp,
                       k->err, sizeof k->err);
}

/* On the loop thread, once the manifest is read: its registrations are
 * applied (the registry is the loop's) and the payloads queued to load; a
 * refusal is told to the caller. */
static void restore_read_after(uv_work_t *req, int status) {
  shardd__jobs_restore *k = req->data;
  shardd__jobs *j = k->j;
  if (status != 0 && k->rc == SHARDD_OK) { /* cancelled: never read */
    k->rc = SHARDD_E_INVAL;
    snprintf(k->err, sizeof k->err, "the restore was cancelled: %s",
             uv_strerror(status));
  }
  if (k->rc == SHARDD_OK && j->stopping) {
    k->rc = SHARDD_E_SHUTDOWN;
    snprintf(k->err, sizeof k->err, "the daemon is stopping; %s was not "
             "restored", k->dir);
  }
  if (k->rc == SHARDD_OK)
    k->rc = restore_apply(&k->r, k->err, sizeof k->err);
  slot *s = NULL;
  if (k->rc == SHARDD_OK) {
    k->job = shardd__checkpoint_restore_job(k->r);
    /* tracked from now, so linger and joins see it is being restored */
    if ((s = shardd__jobs_slot_make(j, k->job)) == NULL) {
      k->rc = SHARDD_E_NO_MEMORY;
      snprintf(k->err, sizeof k->err, "out of memory tracking the restored job");
    }
  }
  if (k->rc == SHARDD_OK) {
    int e = uv_queue_work(j->loop, &k->req, restore_work, restore_after);
    if (e == 0) {
      s->restoring = 1;
      return; /* restore_after tells the caller */
    }
    shardd__jobs_slot_free(shardd__map_del_id(&j->slots, shardd__jobs_key(k->job)));
    k->rc = SHARDD_E_INVAL;
    snprintf(k->err, sizeof k->err, "cannot start the restore: %s",
             uv_strerror(e));
  }
  for (shardd__jobs_restore **p = &j->restores; *p; p = &(*p)->next)
    if (*p == k) {
      *p = k->next;
      break;
    }
  shardd__checkpoint_restore_free(k->r); /* releases the job, if any */
  k->done(k->arg, NULL, k->rc, k->err);
  free(k->dir);
  free(k);
}

shardd_err shardd__jobs_restore_start(shardd__jobs *j, const char *dir,
                                      int64_t as_uid, uint32_t world,
                                      shardd__jobs_restore_done done, void *arg,
                                      char *err, size_t errlen) {
  shardd__jobs_restore *k = calloc(1, sizeof *k);
  if (k == NULL || (k->dir = strdup(dir)) == NULL) {
    free(k);
    snprintf(err, errlen, "out of memory");
    return SHARDD_E_NO_MEMORY;
  }
  k->j = j;
  k->as_uid = as_uid;
  k->world = world;
  k->done = done;
  k->arg = arg;
  k->req.data = k;
  int e = uv_queue_work(j->loop, &k->req, restore_read_work, restore_read_after);
  if (e != 0) {
    free(k->dir);
    free(k);
    snprintf(err, errlen, "cannot start the restore: %s", uv_strerror(e));
    return SHARDD_E_INVAL;
  }
  k->next = j->restores;
  j->restores = k;
  return SHARDD_OK;
}
