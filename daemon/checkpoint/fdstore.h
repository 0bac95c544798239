/* fdstore.h — the daemon's memory kept by the service manager across a
 * restart (systemd's file descriptor store), host backend, single-node
 * jobs.
 *
 * Every region of a job is a memfd the backend hands to the store when it
 * allocates it (backend.h, SHARDD__PERSIST_ON). This module owns the rest
 * of the protocol: per job, a description in three memfds of its own,
 * stored beside the regions:
 *   shardd-m<ID>-a, shardd-m<ID>-b  two slots, written in turn; each a
 *       32-byte header (magic "SHDMETA2", generation, length, CRC32C of
 *       the text) and at 4096 the text: one line per region,
 *         region buffer NAME RANK FDNAME [OFFSET]
 *         region state OPTIMIZER BUFFER RANK FDNAME
 *       (OFFSET: the block is at that byte of FDNAME, a slab several
 *       blocks share, mapped once at adoption)
 *       (names as a manifest encodes them), a line "manifest", and the
 *       job's checkpoint manifest (checkpoint.h) with its data files'
 *       CRCs 0. The text goes in first, the header last: a kill between
 *       leaves the other slot, whole, the newest valid one. Rewritten
 *       when the job changes (a registration, an optimizer's first step),
 *       not at every step.
 *   shardd-m<ID>-j  the step journal: one record per optimizer step
 *       running ("step N of optimizer NAME in progress"), set before its
 *       first update changes a byte and cleared after its last, once the
 *       new step counts are committed; past its page, the step counts
 *       (each optimizer's and its refs') of the newest slot's generation,
 *       written whole after each slot and one optimizer's in place at the
 *       end of each of its steps (fdstore_int.h).
 * A restart is handed every stored fd back (LISTEN_FDS/LISTEN_FDNAMES):
 * adopt rebuilds each job from its newest slot, its step counts taken
 * from the journal where they are of that slot's generation, through the
 * restore's own apply, and swaps the adopted memfds in for the regions
 * apply made (no byte copied). A slot "SHDMETA1" (a daemon before the
 * journal's counts, which rewrote it at every step) is adopted with its
 * own counts, then cleared once a slot of this format is written (an
 * older daemon finds no whole slot rather than stale counts). A job whose journal holds a record is torn: its memory
 * may hold half of that step, so it is not adopted and any attach is
 * refused naming the step; a damaged journal (its page's magic, counts
 * of a later generation or not fitting the slot's manifest) refuses the
 * job as a description that cannot be adopted does.
 *
 * Loop thread only. Multi-node jobs are not kept (their exit checkpoint
 * and rejoin are the path there). */
#ifndef SHARDD_FDSTORE_H
#define SHARDD_FDSTORE_H

#include <stddef.h>
#include <stdint.h>
#include <uv.h>

#include "registry.h"

typedef struct shardd__fdstore shardd__fdstore;

/* skip(arg, job): 1 for a job whose state must not be described now
 * (being restored: its memory is still being loaded); NULL none. The
 * backend must be in SHARDD__PERSIST_ON. */
shardd_err shardd__fdstore_create(uv_loop_t *loop, shardd__registry *reg,
                                  int (*skip)(void *arg, shardd__job *job),
                                  void *skip_arg, shardd__fdstore **out);
/* Something of job (NULL: of some job, or a job made) may have changed:
 * its description is rewritten before the loop next waits. */
void shardd__fdstore_touch(shardd__fdstore *fs, shardd__job *job);
/* job is being released: its description leaves the store now. */
void shardd__fdstore_job_gone(shardd__fdstore *fs, shardd__job *job);
/* The coll engine's step hooks (coll.h). */
void shardd__fdstore_step_begin(shardd__fdstore *fs, shardd__job *job,
                                shardd__optim *opt, uint64_t step);
void shardd__fdstore_step_end(shardd__fdstore *fs, shardd__job *job,
                              shardd__optim *opt, uint64_t step,
                              shardd_err code);
/* The daemon stops: what was touched is described now, and from here no
 * job leaves the store (every description stays for the next start);
 * steps still draining keep theirs current. Closes its loop handle. */
void shardd__fdstore_stop(shardd__fdstore *fs);
/* Frees fs (after stop and the loop's end; without stop, once the loop
 * runs again). The store's contents are left as they are. */
void shardd__fdstore_free(shardd__fdstore *fs);

/* One descriptor handed back by the service manager. */
typedef struct {
  int fd;
  const char *name; /* its FDNAME; borrowed */
} shardd__fdstore_fd;

/* Adopts what a previous daemon stored: takes every fd in fds (each is
 * used, kept for a torn job, or closed and removed from the store); for
 * each job rebuilt, adopted(arg, job, step) with the most steps one of
 * its optimizers took. Each job refused (torn, a damaged description) is
 * logged; returns how many were. */
int shardd__fdstore_adopt(shardd__fdstore *fs, shardd__fdstore_fd *fds,
                          size_t n,
                          void (*adopted)(void *arg, shardd__job *job,
                                          uint64_t step),
                          void *arg);
/* Whether the store held uid's job name at start (adopted or torn): an
 * exit checkpoint of it is then not restored. */
int shardd__fdstore_held(const shardd__fdstore *fs, uint32_t uid,
                         const char *name);
/* The checkpoint to name in a torn job's refusal (dir/JOB, borrowed
 * until free; NULL none). */
void shardd__fdstore_set_hint(shardd__fdstore *fs, uint32_t uid,
                              const char *name, const char *checkpoint);
/* When uid's job name is torn: 1 and *msg says why an attach is refused
 * (the step it was killed in, the checkpoint to restore). */
int shardd__fdstore_torn(const shardd__fdstore *fs, uint32_t uid,
                         const char *name, char *msg, size_t len);
/* Forgets a torn job (shardctl release of it): its memory leaves the
 * store; a new job of that name starts fresh. 1 when there was one. */
int shardd__fdstore_forget_torn(shardd__fdstore *fs, uint32_t uid,
                                const char *name);

#endif
