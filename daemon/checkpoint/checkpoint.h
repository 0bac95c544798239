/* checkpoint.h — writes a job (registry, every buffer shard, optimizer
 * state and step counts) to a directory, and restores it.
 *
 * Layout of DIR: one file per buffer shard and per optimizer shard state,
 * each with a header (format version, dtype, numel, element offset, CRC32C
 * of the payload, the buffer's name), written to a temporary name,
 * fsync'ed and renamed; then `manifest`, written last the same way, and the
 * directory fsync'ed. A checkpoint without a manifest is incomplete.
 *
 * Restore replays the registration (buffers, views, then the optimizer's
 * own RegisterOptimizer with ids remapped, through the normal validation)
 * into a new job, loads every payload into the new memory while checking
 * header and CRC, and on any mismatch releases that new job again: a live
 * job's memory is never touched. The refusal names the bad file. A
 * manifest is refused as corrupt or truncated, by its path (and line), when
 * a line is longer than any shardd writes, holds a NUL byte, or a buffer it
 * lists lacks the shard of some rank (restoring it gave zeros).
 *
 * A write comes in two halves: prepare, on the loop thread, takes what the
 * registry says (the manifest's text, where each payload lies) and run,
 * on any thread, does the file I/O, so a daemon can write a 1.6 GB job
 * without freezing its clients (jobs.c runs it on libuv's pool). A restore
 * comes in four: read, on any thread, reads the manifest (bounded by
 * SHARDD__MANIFEST_MAX, manifest.h), checks its seal, splits its lines and
 * checks its job line against who asks; apply, on the loop thread,
 * replays the registrations and plans the payload loads; run, on any
 * thread, loads them; finish, on the loop thread, sets what the loads
 * vouched for and hands the job over. A 1.5 GB manifest read and checked
 * on the loop thread froze every client for 4-6 s.
 * Host backend only (payloads are read and written through the daemon's
 * own mapping).
 *
 * Write is checkpoint.c, restore restore.c; beneath both, manifest.h (the
 * manifest's text) and ckfile.h (directory, files, data file headers).
 * What those two own and callers use too is declared there and reaches
 * callers through this header: CRC32C, the data files' version and the
 * --checkpoint-root directory (ckfile.h), what a job manifest says
 * (shardd__ckjob, manifest.h). */
#ifndef SHARDD_CHECKPOINT_H
#define SHARDD_CHECKPOINT_H

#include <stddef.h>
#include <stdint.h>
#include <uv.h>

#include "ckfile.h"
#include "manifest.h"
#include "registry.h"

/* The job must have no collective in flight (the caller checks). as_uid is
 * who asks: < 0 the daemon itself (--checkpoint-on-exit), 0 root; any other
 * uid may write only into a directory of its own, or make one inside a
 * directory of its own (SHARDD_E_PERMISSION otherwise). No path component
 * may be a symlink. The previous checkpoint in dir stays restorable until
 * the new manifest replaces it. */
/* prepare, run and wfree in one call, on the loop thread (blocking it):
 * --checkpoint-on-exit, where the loop has stopped, and tests. */
shardd_err shardd__checkpoint_write(shardd__registry *reg, shardd__job *job,
                                    const char *dir, int64_t as_uid, char *err,
                                    size_t errlen);
/* As checkpoint_write for a client confined to home, its own directory
 * under --checkpoint-root (see shardd__checkpoint_user_dir), which dir is
 * below (the caller checked): there, directories the daemon made count as
 * the client's at any depth, as a daemon that is not root cannot hand
 * them over with chown. home NULL: checkpoint_write. */
shardd_err shardd__checkpoint_write_in(shardd__registry *reg, shardd__job *job,
                                       const char *dir, int64_t as_uid,
                                       const char *home, char *err,
                                       size_t errlen);

/* A checkpoint being written: what prepare took from the registry. */
typedef struct shardd__ckwrite shardd__ckwrite;

/* The loop-thread half of checkpoint_write (same rules, same refusals):
 * the job's manifest and the places of its payloads, into *out (freed with
 * shardd__checkpoint_wfree). It keeps pointers into the job's memory and
 * names: until wfree, the job must not change -- no collective, no
 * (un)registration, no release (jobs.c holds it so). Touches no file. */
/* home as in checkpoint_write_in (NULL: none). */
shardd_err shardd__checkpoint_prepare(shardd__registry *reg, shardd__job *job,
                                      const char *dir, int64_t as_uid,
                                      const char *home, shardd__ckwrite **out,
                                      char *err, size_t errlen);
/* The I/O half: opens dir (checking it as checkpoint_write does), writes
 * the data files and then the sealed manifest. Any thread; it reads the
 * job's payloads but no registry struct. Once per w. */
shardd_err shardd__checkpoint_run(shardd__ckwrite *w, char *err,
                                  size_t errlen);
void shardd__checkpoint_wfree(shardd__ckwrite *w);
/* The directory w writes into, as it was asked for; borrowed from w. */
const char *shardd__checkpoint_wdir(const shardd__ckwrite *w);
/* The bytes w writes: its data files' payloads and the manifest. */
uint64_t shardd__checkpoint_wbytes(const shardd__ckwrite *w);
/* run for n checkpoints at once (each into a directory of its own), on the
 * thread that runs loop (blocking it: --checkpoint-on-exit, where the loop
 * has stopped, and the bench): every data file of every one is a task for
 * libuv's pool, in ws's order, written in one pass (their write-back
 * started) and fsync'ed and renamed in a second, so the files' writes and
 * the disk's overlap on all of the pool's threads; then, on this thread,
 * each manifest once
 * its own files are all written. rcs[k] and errs + k * errlen (n of each)
 * say how ws[k] went, as run would have; one failing leaves the others be.
 * Other callbacks of loop may run meanwhile. */
void shardd__checkpoint_run_many(uv_loop_t *loop, shardd__ckwrite **ws,
                                 size_t n, shardd_err *rcs, char *errs,
                                 size_t errlen);
/* After a successful run: the seal (CRC32C on the "end" line) of the
 * manifest w wrote; 0 before. */
uint32_t shardd__checkpoint_wseal(const shardd__ckwrite *w);

typedef struct shardd__ckrestore shardd__ckrestore;

/* Multi-node jobs. A checkpoint of a job over several nodes is DIR/node-N
 * for each node N (written by prepare and run on that node: an ordinary
 * manifest with a "node N NODES" line and the shard and state lines of
 * that node's ranks only) and the job-level manifest DIR/manifest:
 *   shardd-job-checkpoint 1
 *   job NAME WORLD UID
 *   nodes N
 *   part K node-K SEAL     (one per node: its part manifest's seal)
 *   end CRC
 * written by write_job once every node's part is sealed (the seals are
 * exchanged across the nodes first). A part without the job manifest, or
 * one whose seal is not the job manifest's, is refused at restore, naming
 * the node. seals: [job->nodes]; *seal: the job manifest's own, which the
 * restored job keeps as its origin. Blocking, small: one file. */
shardd_err shardd__checkpoint_write_job(const char *dir, int64_t as_uid,
                                        const char *home, const shardd__job *job,
                                        const uint32_t *seals, uint32_t *seal,
                                        char *err, size_t errlen);

/* Reads and checks (seal, owner: as restore does) the manifest in dir; a
 * job-level one fills *out, an ordinary one gives nodes 0. */
shardd_err shardd__checkpoint_read_job(const char *dir, int64_t as_uid,
                                       shardd__ckjob *out, char *err,
                                       size_t errlen);

/* Node node_rank's part of the job checkpoint in dir, described by job (from
 * read_job): every node's part must be there, sealed as job says (refused
 * naming the node otherwise), and this node's is read as
 * checkpoint_restore_read does, to be applied into a new job laid out over
 * job->nodes (world as recorded), holding this node's ranks, with origin
 * job->seal. Any thread, as read_job. */
shardd_err shardd__checkpoint_restore_read_part(
    shardd__registry *reg, const char *dir, int64_t as_uid,
    const shardd__ckjob *job, uint32_t node_rank, shardd__ckrestore **out,
    char *err, size_t errlen);

/* This node's part of a live multi-node job that one daemon wrote alone
 * (--checkpoint-on-exit: dir/node-N, no job manifest), for a restart of
 * that daemon, read as checkpoint_restore_read does (any thread): the part
 * must be of job name (else SHARDD_E_NOT_FOUND: the
 * caller tries another spec), over nodes, world as the spec says, and
 * carry the job's fabric lineage ("lineage" line). The restored job gets
 * that lineage and origin and is marked rejoining: its fabric's join
 * (coll_fabric.c) lets it meet only the live nodes of that lineage whose
 * states fit; nothing else checks the other nodes here. spec_uid >= 0:
 * the spec (spec_path, for the message) is that uid's job's only, and a
 * part recording another owner is refused (SHARDD_E_PERMISSION). */
shardd_err shardd__checkpoint_restore_read_exit_part(
    shardd__registry *reg, const char *dir, int64_t as_uid, const char *name,
    uint32_t world, uint32_t nodes, uint32_t node_rank, int64_t spec_uid,
    const char *spec_path, shardd__ckrestore **out, char *err, size_t errlen);

/* Creates the job recorded in dir (it must not exist yet), owned by the uid
 * recorded with it. as_uid is who asks: < 0 the daemon itself (--restore),
 * 0 root, else it must be the recorded owner (SHARDD_E_PERMISSION), dir
 * must be its own or the daemon's, and every file in it a regular file of
 * one link owned by it or the daemon, opened without following symlinks: a
 * client cannot make the daemon read another user's file for it. For
 * every asker, root included, the recorded owner is believed only where
 * the directory, the manifest and each data file (one link) belong to that
 * owner or to the daemon: a directory another user wrote cannot make root
 * create the victim's job (SHARDD_E_PERMISSION, naming what belongs to
 * whom). The same holds for a job manifest (read_job) and its parts, whose
 * owner must be the job manifest's. */
/* world 0 keeps the recorded world; another world reshards: shards and
 * optimizer state are keyed by element offset, not by rank. */
/* prepare, run, finish and restore_free in one call, on the loop thread
 * (blocking it): --restore at start, where the loop is not serving yet,
 * and tests. */
shardd_err shardd__checkpoint_restore(shardd__registry *reg, const char *dir,
                                      int64_t as_uid, uint32_t world,
                                      shardd__job **out, char *err,
                                      size_t errlen);

/* The manifest prepare built, sealed as run would seal it but with every
 * data file's CRC left 0 (*len bytes, borrowed from w; NULL out of
 * memory): the description of the job the fd store keeps (fdstore.h),
 * whose payloads are the regions themselves, never files. Instead of
 * run, once per w. */
const char *shardd__checkpoint_wmanifest(shardd__ckwrite *w, size_t *len);

/* As shardd__checkpoint_restore_read, from a manifest given as text (the
 * daemon's own, from the fd store: no owner to vouch, no data file to
 * read; label names it in messages). apply then registers the job; its
 * regions are the caller's to fill or replace before finish (run would
 * read files that do not exist). */
shardd_err shardd__checkpoint_restore_read_text(shardd__registry *reg,
                                                const char *label,
                                                const char *text, size_t len,
                                                shardd__ckrestore **out,
                                                char *err, size_t errlen);

/* A restore being loaded: the new job and the loads prepare planned. */
typedef struct shardd__ckrestore shardd__ckrestore;

/* read then apply, on the loop thread (tests): same rules, same refusals;
 * on failure nothing is left (*out NULL). */
shardd_err shardd__checkpoint_restore_prepare(shardd__registry *reg,
                                              const char *dir, int64_t as_uid,
                                              uint32_t world,
                                              shardd__ckrestore **out,
                                              char *err, size_t errlen);
/* The reading half of prepare, on any thread (it touches no registry
 * struct; reg is kept for apply): opens dir (checked as
 * checkpoint_restore says), refuses a manifest larger than
 * SHARDD__MANIFEST_MAX before reading it (SHARDD_E_LIMIT, naming the
 * bound), reads it whole, checks its seal and its job line against as_uid,
 * into *out (freed with shardd__checkpoint_restore_free; nothing is left
 * on failure). Reads no data file. */
shardd_err shardd__checkpoint_restore_read(shardd__registry *reg,
                                           const char *dir, int64_t as_uid,
                                           uint32_t world,
                                           shardd__ckrestore **out, char *err,
                                           size_t errlen);
/* The loop-thread half: replays r's manifest into a new job (buffers,
 * views, optimizers) and plans every payload load. Refusals that need no
 * payload (a malformed line, a missing shard line, an optimizer refused, a
 * state file that does not fit, a job of that name live already) come from
 * here; on failure the caller frees r, which releases the job. Until free,
 * nobody may use or release the job (jobs.c marks it restoring): the loads
 * write its memory. Once per r, after read. */
shardd_err shardd__checkpoint_restore_apply(shardd__ckrestore *r, char *err,
                                            size_t errlen);
/* The job r creates; r's until finish. */
shardd__job *shardd__checkpoint_restore_job(const shardd__ckrestore *r);
/* The I/O half: reads and checks every data file into the new job's
 * memory; a refusal names the file. Any thread; it touches the region
 * memory and the files only, no registry struct. Once per r. */
shardd_err shardd__checkpoint_restore_run(shardd__ckrestore *r, char *err,
                                          size_t errlen);
/* Loop thread, after run succeeded: sets each restored optimizer's step
 * count and master_valid flags, and hands the job to the caller. */
shardd__job *shardd__checkpoint_restore_finish(shardd__ckrestore *r);
/* Frees r; a job finish did not hand over is released. NULL: nothing. */
void shardd__checkpoint_restore_free(shardd__ckrestore *r);

/* Exit checkpoints superseded (--checkpoint-on-exit DIR --restore DIR).
 * A job restored at start from its exit checkpoint in DIR/JOB and then
 * stepped has moved past it: DIR/JOB/superseded, written before that first
 * step runs, names the manifest it supersedes by its seal, so a restart
 * after a kill -9 (no new exit checkpoint written) refuses to roll the job
 * back in silence. A newer checkpoint in DIR/JOB has another seal: the
 * marker no longer applies to it. Text, one "key value" a line:
 *   shardd-superseded 1
 *   job NAME          (percent-encoded as in a manifest)
 *   part P            (where that manifest is: "." DIR/JOB itself, or this
 *                     node's exit part "node-N" of a multi-node job)
 *   seal XXXXXXXX     (that manifest's seal)
 *   step N            (the step it holds) */
#define SHARDD__SUPERSEDED_FILE "superseded"
typedef struct {
  char job[256];
  char part[64];
  uint32_t seal;
  uint64_t step;
} shardd__cksuperseded;

/* Writes dir/superseded for what m says (atomically: temporary name,
 * fsync, rename, the directory fsync'ed). The daemon's own directory. */
shardd_err shardd__checkpoint_supersede(const char *dir,
                                        const shardd__cksuperseded *m,
                                        char *err, size_t errlen);
/* Reads dir/superseded into *m: SHARDD_OK, SHARDD_E_NOT_FOUND when there
 * is none, SHARDD_E_INVAL (err says why) when it is not one shardd wrote. */
shardd_err shardd__checkpoint_superseded(const char *dir,
                                         shardd__cksuperseded *m, char *err,
                                         size_t errlen);
/* The seal of dir/manifest, checked as restore checks it (the daemon's
 * own files). */
shardd_err shardd__checkpoint_seal(const char *dir, uint32_t *seal, char *err,
                                   size_t errlen);

#endif /* SHARDD_CHECKPOINT_H */
