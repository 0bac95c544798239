/* jobs.h — job lifetime: which rank of a job is claimed by whom, the
 * --job-spec layout a job gets when its first rank says Hello, when a job
 * nobody holds is released (--job-linger), and checkpoints taken between
 * steps.
 *
 * Ownership: the lifetime state of each job (who claimed each rank, as an
 * id and a pid, and its linger clock) is kept here by job, from its first
 * claim (or mark) until this module releases the job; the jobs themselves
 * belong to the registry. Loop thread only (checkpoint files are written,
 * and restored ones read, on libuv's pool). */
#ifndef SHARDD_JOBS_H
#define SHARDD_JOBS_H

#include <stddef.h>
#include <stdint.h>
#include <uv.h>

#include "coll.h"
#include "jobspec.h"
#include "map.h"
#include "registry.h"

typedef struct shardd__jobs_ckpt shardd__jobs_ckpt;
typedef struct shardd__jobs_restore shardd__jobs_restore;

/* Told on the loop thread as this module releases job, before the job is
 * freed: what an upper layer keeps by job (its address) must go with it,
 * or a later job allocated at that address would find it. */
typedef void (*shardd__jobs_released)(void *arg, shardd__job *job);

typedef struct {
  /* read-only after init */
  uv_loop_t *loop;
  shardd__registry *reg;
  shardd__coll_engine *coll;
  double linger; /* seconds a job outlives its last client; < 0 never */
  const shardd__jobspec *specs;
  size_t nspecs;
  shardd__jobs_released released; /* NULL: nobody to tell */
  void *released_arg;
  /* public: set once the daemon stops (no job is released from then on) */
  int stopping;
  /* private */
  shardd__map slots; /* job address -> lifetime state */
  /* checkpoints started and not done, in order; the first is being
   * written on libuv's pool, one at a time (two jobs written into one
   * directory at once would each remove the other's data files) */
  shardd__jobs_ckpt *ck_first, *ck_last;
  /* restores being loaded on libuv's pool (any number at once) */
  shardd__jobs_restore *restores;
} shardd__jobs;

/* released (may be NULL) is called with released_arg for every job this
 * module releases. */
void shardd__jobs_init(shardd__jobs *j, uv_loop_t *loop, shardd__registry *reg,
                       shardd__coll_engine *coll, double linger,
                       const shardd__jobspec *specs, size_t nspecs,
                       shardd__jobs_released released, void *released_arg);
/* Frees the lifetime state; the jobs stay the registry's. The loop has
 * run dry first (no checkpoint is being written). */
void shardd__jobs_free(shardd__jobs *j);

/* Applies the --job-spec naming job, if any, when rank says Hello: gives a
 * new job its node layout and cross-node fabric state, and refuses (with
 * the node that holds it) a rank this daemon does not hold, a world other
 * than the spec's, or a multi-node job this build cannot serve. */
shardd_err shardd__jobs_layout(shardd__jobs *j, shardd__job *job, uint32_t rank,
                               char *err, size_t errlen);

/* Claims rank of job for owner (a nonzero id of the caller's choosing) of
 * process pid; SHARDD_E_STATE when another holds it (*holder_pid says
 * which process), SHARDD_E_NO_MEMORY. */
shardd_err shardd__jobs_claim(shardd__jobs *j, shardd__job *job, uint32_t rank,
                              uint64_t owner, int32_t pid, int32_t *holder_pid);
/* The owner holding rank of job, 0 when none does. */
uint64_t shardd__jobs_holder(const shardd__jobs *j, const shardd__job *job,
                             uint32_t rank);
/* owner lets go of rank; finished: it said Goodbye first (a clean close)
 * instead of dropping its connection. Once every local rank's last client
 * finished and none holds the job, it is released at once (a finished run
 * is never resumed: its name starts fresh), at the latest when its
 * collectives, checkpoints and pins end; otherwise under --job-linger 0. */
void shardd__jobs_leave(shardd__jobs *j, shardd__job *job, uint32_t rank,
                        uint64_t owner, double now, int finished);
/* A job nobody has claimed (a restore, a refused Hello that created it)
 * starts its linger clock now; with release_now, one that was not
 * lingering yet is released at once under --job-linger 0 (job may be
 * freed). Out of memory to track it, the job is released (it could never
 * expire) and SHARDD_E_NO_MEMORY returned. */
shardd_err shardd__jobs_unclaimed(shardd__jobs *j, shardd__job *job, double now,
                                  int release_now);
/* job may have become idle (its last collective ended): released at once
 * under --job-linger 0 when nobody holds it. job may be freed. */
void shardd__jobs_idle(shardd__jobs *j, shardd__job *job);
/* Releases every job nobody has held for --job-linger seconds. */
void shardd__jobs_expire(shardd__jobs *j, double now);

/* Someone waits to use job (an operator's checkpoint waiting for it to go
 * quiet): not released until every pin is let go; unpin may release it
 * (--job-linger 0, nobody holds it). SHARDD_E_NO_MEMORY. */
shardd_err shardd__jobs_pin(shardd__jobs *j, shardd__job *job);
void shardd__jobs_unpin(shardd__jobs *j, shardd__job *job);
int shardd__jobs_pinned(const shardd__jobs *j, const shardd__job *job);

/* Releases job now (`shardctl release`): SHARDD_E_BUSY, naming what holds
 * it, while a client holds one of its ranks, or it is being checkpointed,
 * restored, waited for, or has collectives in flight. On SHARDD_OK job is
 * freed. */
shardd_err shardd__jobs_release_now(shardd__jobs *j, shardd__job *job,
                                    char *err, size_t errlen);

uint32_t shardd__jobs_clients(const shardd__jobs *j, const shardd__job *job);
/* Whether a client holds rank of job now. */
int shardd__jobs_rank_held(const shardd__jobs *j, const shardd__job *job,
                           uint32_t rank);
/* This daemon's ranks of job, lowest first: the first max held ones into
 * held (*nheld of them), the first max others into missing (*nmissing);
 * returns how many are held in all. Costs O(ranks held * log max + max),
 * not the world's size (status of huge worlds). */
uint32_t shardd__jobs_ranks(const shardd__jobs *j, const shardd__job *job,
                            uint32_t *held, uint32_t *missing, size_t max,
                            size_t *nheld, size_t *nmissing);

/* Checkpoints job to dir between steps (SHARDD_E_BUSY with collectives in
 * flight or while it is being checkpointed or restored, SHARDD_E_STATE for a
 * multi-node job); as_uid and home (may be NULL) as in
 * shardd__checkpoint_write_in. Blocks the loop for the I/O: for
 * --checkpoint-on-exit, where the loop has stopped. */
shardd_err shardd__jobs_checkpoint(shardd__jobs *j, shardd__job *job,
                                   const char *dir, int64_t as_uid,
                                   const char *home, char *err, size_t errlen);

/* As shardd__jobs_checkpoint for n jobs (as_uid -1, no home: the
 * daemon's own), jobs[k] to dirs[k], with every data file of every job
 * written at once on libuv's pool (shardd__checkpoint_run_many): the
 * --checkpoint-on-exit of a stopped daemon, where the loop has stopped.
 * rcs[k] and errs + k * errlen say how jobs[k] went (each also logged as
 * jobs_checkpoint logs it), and one line logs the whole: jobs, MiB,
 * seconds and MiB/s, what TimeoutStopSec must cover. *bytes: what was
 * written in all. */
void shardd__jobs_checkpoint_many(shardd__jobs *j, shardd__job **jobs,
                                  char **dirs, size_t n, shardd_err *rcs,
                                  char *errs, size_t errlen, uint64_t *bytes);

/* The step job is at: the highest step count of its optimizers (0 with
 * none), as a restore and the log report it. */
uint64_t shardd__jobs_step(shardd__job *job);

/* job was restored at start (--restore) from its exit checkpoint in dir
 * (--checkpoint-on-exit wrote it there; part as in shardd__cksuperseded,
 * seal its manifest's): the first step of job marks that checkpoint
 * superseded (shardd__jobs_advancing). SHARDD_E_NO_MEMORY. */
shardd_err shardd__jobs_resumed(shardd__jobs *j, shardd__job *job,
                                const char *dir, const char *part,
                                uint32_t seal);
/* A step of job is about to change its state (called before it runs):
 * the first one after shardd__jobs_resumed writes the superseded marker
 * into the exit checkpoint's directory and logs it (a failure to write it
 * is logged too; the step goes on). Once per restore; nothing otherwise. */
void shardd__jobs_advancing(shardd__jobs *j, shardd__job *job);

/* The seal of the last checkpoint of job written here (a multi-node
 * job's: this node's part), 0 when the last one failed or none was. */
uint32_t shardd__jobs_last_seal(const shardd__jobs *j, const shardd__job *job);

/* A multi-node job's collective checkpoint, once every node's part is
 * written: the job-level manifest in dir, from every node's part seal
 * (seals: [job->nodes]), as shardd__checkpoint_write_job. Blocks the loop
 * for one small file. */
shardd_err shardd__jobs_checkpoint_job(shardd__jobs *j, shardd__job *job,
                                       const char *dir, int64_t as_uid,
                                       const char *home, const uint32_t *seals,
                                       char *err, size_t errlen);

/* Told on the loop thread when a checkpoint started by
 * shardd__jobs_checkpoint_start is written (rc OK) or failed (err says
 * why). job is still there; it may be released once the hook returns. */
typedef void (*shardd__jobs_ckpt_done)(void *arg, shardd__job *job,
                                       shardd_err rc, const char *err);

/* As shardd__jobs_checkpoint, with the file I/O on libuv's pool: the
 * job's manifest is taken now, and done(arg, ...) is called once the files
 * are written. Until then the job is being checkpointed: it is not
 * released, and the caller must refuse what would change what is written
 * (steps, registrations, unregistrations; see jobs_checkpointing). A
 * refusal is returned here, and done is then never called. */
shardd_err shardd__jobs_checkpoint_start(shardd__jobs *j, shardd__job *job,
                                         const char *dir, int64_t as_uid,
                                         const char *home,
                                         shardd__jobs_ckpt_done done,
                                         void *arg, char *err, size_t errlen);
/* Whether job is being checkpointed (started and not done). */
int shardd__jobs_checkpointing(const shardd__jobs *j, const shardd__job *job);

/* Told on the loop thread when a restore started by
 * shardd__jobs_restore_start is loaded: rc OK and the new job (lingering
 * like one whose clients left), or a failure with job NULL (it was
 * released) and err saying why. */
typedef void (*shardd__jobs_restore_done)(void *arg, shardd__job *job,
                                          shardd_err rc, const char *err);

/* Restores the job recorded in dir (as shardd__checkpoint_restore, same
 * refusals) with the files read on libuv's pool: the manifests are read,
 * bounded and their seals checked there; back on the loop thread the job
 * is registered from them and its data files are loaded on the pool, and
 * done(arg, ...) is called once they are, or when any of it refused (never
 * from within this call). While loading, the job is being restored: nobody
 * may join, checkpoint or use it (see jobs_restoring) and it is not
 * released; a stopping daemon waits for the load, and refuses a restore
 * whose manifest it had not applied yet (SHARDD_E_SHUTDOWN). A refusal
 * returned here (out of memory) means done is never called. */
shardd_err shardd__jobs_restore_start(shardd__jobs *j, const char *dir,
                                      int64_t as_uid, uint32_t world,
                                      shardd__jobs_restore_done done, void *arg,
                                      char *err, size_t errlen);
/* As restore_start, the same reading, applying and loading all on the
 * calling thread (--restore at start, before the loop serves): the
 * restored job into *out, lingering is the
 * caller's to start. A multi-node job's checkpoint (a job manifest over
 * node parts) restores this node's part, as the job's --job-spec places
 * it, after checking every node's part against the job manifest. */
shardd_err shardd__jobs_restore_now(shardd__jobs *j, const char *dir,
                                int64_t as_uid, uint32_t world,
                                shardd__job **out, char *err, size_t errlen);

/* Whether job is being restored (started and not loaded). */
int shardd__jobs_restoring(const shardd__jobs *j, const shardd__job *job);

#endif /* SHARDD_JOBS_H */
