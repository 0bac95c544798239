/* jobs_int.h — what jobs.c (lifetime) and jobs_ckpt.c (checkpoints and
 * restores) share: the per-job slot, the queued checkpoints and restores,
 * and the slot helpers. No other module includes it. Loop thread only. */
#ifndef SHARDD_JOBS_INT_H
#define SHARDD_JOBS_INT_H

#include <stdint.h>

#include "checkpoint.h"
#include "jobs.h"

typedef struct {
  uint64_t owner; /* 0: not claimed */
  int32_t pid;
  uint32_t at; /* while claimed: where the rank is in its slot's held */
} claim;

typedef struct {
  shardd__job *job;
  claim *owners; /* [world] */
  /* the ranks claimed, in no order (nheld of them, room for held_cap):
   * status lists them at the cost of the ranks held, not of the world */
  uint32_t *held;
  uint32_t nheld, held_cap;
  uint32_t nclients;
  double empty_since; /* loop time the last client left; < 0 while held */
  int checkpointing;  /* a checkpoint of it is started and not done */
  int restoring;      /* it is being restored: its payloads are loading */
  uint32_t pins;      /* shardd__jobs_pin: someone waits to use it */
  uint32_t last_seal; /* the seal of its last checkpoint written here */
  uint8_t *bye;       /* [world]: the rank's last client said Goodbye */
  uint32_t nbye;
  int finished;       /* every local rank said Goodbye and none holds it */
  /* restored at start from its exit checkpoint (shardd__jobs_resumed) and
   * not stepped since: that checkpoint's marker, written before the first
   * step; NULL once written, or for any other job */
  char *resume_dir;
  shardd__cksuperseded resume;
} slot;

/* A checkpoint started and not done: what prepare took, and whom to tell. */
struct shardd__jobs_ckpt {
  uv_work_t req; /* req.data: the jobs */
  shardd__job *job;
  shardd__ckwrite *w;
  shardd__jobs_ckpt_done done;
  void *arg;
  shardd_err rc;
  char err[512];
  int kicked; /* queued on the pool */
  shardd__jobs_ckpt *next;
};

/* A restore being read or loaded: what was asked, the plan, and whom to
 * tell. */
struct shardd__jobs_restore {
  uv_work_t req; /* req.data: this */
  shardd__jobs *j;
  /* asked for; read on the pool (dir is the restore's own) */
  char *dir;
  int64_t as_uid;
  uint32_t world;
  shardd__ckrestore *r;
  shardd__job *job; /* r's until finish; NULL while the manifest is read */
  shardd__jobs_restore_done done;
  void *arg;
  const shardd__jobspec *sp; /* a node's part: the job's spec */
  shardd_err rc;
  char err[512];
  shardd__jobs_restore *next;
};

/* By address, as the engine keeps its state: an entry lives until release()
 * frees the job, so no address is reused under it. */
static inline uint64_t shardd__jobs_key(const shardd__job *job) {
  return (uint64_t)(uintptr_t)job;
}

/* job's slot, or NULL; slot_make makes it (NULL: out of memory). */
slot *shardd__jobs_slot_get(const shardd__jobs *j, const shardd__job *job);
slot *shardd__jobs_slot_make(shardd__jobs *j, shardd__job *job);
/* Frees s (NULL is a no-op). */
void shardd__jobs_slot_free(slot *s);

typedef struct {
  const shardd__job *job;
  const shardd__job *other;
} spanning_arg;

/* A registry job walk: sets a->other to another uid's job of a->job's
 * name that spans nodes (took a spec's layout). */
void shardd__jobs_find_spanning(shardd__job *other, void *arg);

#endif /* SHARDD_JOBS_INT_H */
