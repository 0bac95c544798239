/* jobs.h — job lifetime: which rank of a job is claimed by whom, the
 * --job-spec layout a job gets when its first rank says Hello, when a job
 * nobody holds is released (--job-linger), and checkpoints taken between
 * steps.
 *
 * Ownership: the lifetime state of each job (its rank owners and linger
 * clock) is kept here by job, from its first claim (or mark) until the job
 * is released through shardd__jobs_release; the jobs themselves belong to
 * the registry and the owners (void *) to the caller. Loop thread only. */
#ifndef SHARDD_JOBS_H
#define SHARDD_JOBS_H

#include <stddef.h>
#include <stdint.h>

#include "coll.h"
#include "jobspec.h"
#include "map.h"
#include "registry.h"

typedef struct {
  /* read-only after init */
  shardd__registry *reg;
  shardd__coll_engine *coll;
  double linger; /* seconds a job outlives its last client; < 0 never */
  const shardd__jobspec *specs;
  size_t nspecs;
  /* public: set once the daemon stops (no job is released from then on) */
  int stopping;
  /* private */
  shardd__map slots; /* job address -> lifetime state */
} shardd__jobs;

void shardd__jobs_init(shardd__jobs *j, shardd__registry *reg,
                       shardd__coll_engine *coll, double linger,
                       const shardd__jobspec *specs, size_t nspecs);
/* Frees the lifetime state; the jobs stay the registry's. */
void shardd__jobs_free(shardd__jobs *j);

/* Applies the --job-spec naming job, if any, when rank says Hello: gives a
 * new job its node layout and cross-node fabric state, and refuses (with
 * the node that holds it) a rank this daemon does not hold, a world other
 * than the spec's, or a multi-node job this build cannot serve. */
shardd_err shardd__jobs_layout(shardd__jobs *j, shardd__job *job, uint32_t rank,
                               char *err, size_t errlen);

/* Claims rank of job for owner; SHARDD_E_STATE when another holds it
 * (*holder says who; err is the caller's to write, as only it knows what an
 * owner is). */
shardd_err shardd__jobs_claim(shardd__jobs *j, shardd__job *job, uint32_t rank,
                              void *owner, void **holder);
/* owner lets go of rank; the job may be released (linger 0). */
void shardd__jobs_leave(shardd__jobs *j, shardd__job *job, uint32_t rank,
                        void *owner, double now);
/* A job nobody has claimed (a restore, a refused Hello that created it)
 * starts its linger clock now; with release, a job that has none left is
 * released at once under --job-linger 0. job may be freed. */
void shardd__jobs_unclaimed(shardd__jobs *j, shardd__job *job, double now,
                            int release);
/* job may have become idle (its last collective ended): released at once
 * under --job-linger 0 when nobody holds it. job may be freed. */
void shardd__jobs_idle(shardd__jobs *j, shardd__job *job);
/* Releases every job nobody has held for --job-linger seconds. */
void shardd__jobs_expire(shardd__jobs *j, double now);

uint32_t shardd__jobs_clients(const shardd__jobs *j, const shardd__job *job);

/* Checkpoints job to dir between steps (SHARDD_E_BUSY with collectives in
 * flight, SHARDD_E_STATE for a multi-node job); as_uid and home (may be
 * NULL) as in shardd__checkpoint_write_in. */
shardd_err shardd__jobs_checkpoint(shardd__jobs *j, shardd__job *job,
                                   const char *dir, int64_t as_uid,
                                   const char *home, char *err, size_t errlen);

#endif /* SHARDD_JOBS_H */
