/* restore_int.h — what restore.c, restore_lines.c and restore_plan.c
 * share and nothing outside the checkpoint module sees: one restore in
 * progress and the plans its lines make. */
#ifndef SHARDD_RESTORE_INT_H
#define SHARDD_RESTORE_INT_H

#include <stddef.h>
#include <stdint.h>

#include "checkpoint.h"
#include "ckfile.h"
#include "manifest.h"

typedef struct {
  uint64_t old_id;
  shardd__obj *obj;
  uint64_t steps; /* the ref's own step count */
} id_map;

typedef struct {
  size_t buf;
  uint32_t rank;
  int master_valid;
  char *file;
  uint32_t crc;
  size_t bytes;
  int nstate;
  int loaded;
} pending_state;

typedef struct {
  char *name;
  uint64_t steps;
  uint8_t *spec;
  size_t spec_len;
  id_map *ids;
  size_t nids;
  pending_state *states;
  size_t nstates;
  /* (buffer, old rank) of each state line, once: key buf << 17 | rank */
  shardd__map state_seen;
  /* the buffers its ref lines named (themselves or a view of them), key
   * index + 1: a state line must be of one of them */
  shardd__map bufs_reffed;
  shardd__optim *created;
  /* master_valid of each of created's shards once its state is loaded;
   * set on them by finish */
  int *mv;
  /* each of created's refs' step count (in its refs' order), from the
   * ref lines; set on it by finish */
  uint64_t *ref_steps;
} pending_optim;

/* One part of a payload copied from where its file was read to where it
 * goes. */
typedef struct {
  char *dst;  /* region memory of the new job */
  size_t src; /* offset in the file's payload */
  size_t n;
} ld_copy;

/* One payload load, as prepare planned it: the file and what its header
 * must say, read straight into region memory (direct) or into a buffer of
 * its own and copied from there. Touches no registry struct. */
typedef struct {
  char *file;
  const char *name; /* the buffer's, a copy the restore owns */
  uint32_t crc, dtype;
  uint64_t numel, offset;
  size_t bytes;
  char *direct; /* NULL: read into a temporary, then the copies */
  ld_copy *copies;
  size_t ncopies;
} ld;

/* The recorded registrations of one manifest's optimizers, together: a
 * client sends each in one frame (restore repacks it with longer ids, so
 * one may reach two); eight frames' worth is more than any job keeps, and
 * a manifest of nothing but optimizer lines held one copy of every line
 * until the last was read. */
#define SPECS_MAX ((size_t)8 * SHARDD_MAX_FRAME)

/* One restore in progress: the manifest being read, what its lines have
 * named so far and the payload loads they planned. Everything here is the
 * restore's own and freed by shardd__checkpoint_restore_free, job included
 * until finish hands it over (a failed restore releases it); reg is
 * borrowed from the caller, and err during prepare only. */
struct shardd__ckrestore {
  shardd__registry *reg;
  char *dir;
  int64_t as_uid;   /* who asks; see shardd__checkpoint_restore */
  uint32_t world;   /* the new job's; 0: the checkpoint's */
  /* a node's part of a multi-node checkpoint: the layout the new job gets
   * (nodes 0: an ordinary checkpoint), the "node" line seen, the origin */
  uint32_t nodes, node_rank;
  int node_seen;
  uint64_t origin;
  /* this node's exit part of a live job (--checkpoint-on-exit, no job
   * manifest): the job its spec names, with the spec's world; the
   * "lineage" line seen */
  const char *exit_name;
  uint32_t exit_world;
  int lineage_seen;
  /* the owner the job line must name, -1 any: the uid an exit part's job
   * spec gives (spec_path names the spec), or the job manifest's uid for
   * one of its parts (spec_path NULL) */
  int64_t want_uid;
  const char *spec_path;
  char *err;
  size_t errlen;
  char path[4096];  /* the manifest's, as messages name it */
  shardd__ckdir dd; /* fd -1 until opened */
  FILE *f;          /* the manifest; owns its descriptor */
  /* The manifest's text, read whole by read_text, each line ended by a
   * NUL where its newline was (text_len bytes and a NUL); freed once
   * applied. stop_line: the first line the reader refused (too long, a
   * NUL byte: stop_rc), where apply stops with that error; 0 none. */
  char *text;
  size_t text_len;
  int stop_line;
  shardd__line_rc stop_rc;
  /* the job line was checked against who asks (job_check) by read */
  int job_checked;
  int lineno, mversion, ended;
  int seal_line; /* the "end" line whose checksum was checked; 0 none */
  uint32_t old_world;
  /* What the lines have asked to be kept until the optimizers register,
   * bounded by what the daemon registered for the lines above: one ref
   * line per buffer or view (reffed: by object id), at most as many
   * optimizers as buffers and views, their specs SPECS_MAX together. */
  size_t nviews, spec_bytes;
  shardd__map reffed;
  shardd__job *job; /* created by the job line */
  shardd__buffer **bufs; /* borrowed from job; the array is ours */
  size_t nb;
  /* seen[i]: bit r set once buffer i's shard of old rank r was loaded. A
   * buffer line registers zeroed memory; only its shard lines fill it, so
   * one without them restored zeros as if they were the checkpoint. */
  uint8_t **seen;
  size_t nshard_lines;
  char **bnames; /* [nb]: each buffer's name, for the loads' headers */
  pending_optim *po;
  size_t npo;
  ld *loads; /* in manifest order: shards, then each optimizer's states */
  size_t nloads, capl;
  /* a registration's reason; kept across lines, as one buffer was */
  char sub[512];
  /* a backend whose memory the daemon cannot write directly (cuda): the
   * loads land in zeroed host copies of the regions, written to the
   * device at the end of run (host -> device staging); owned */
  struct {
    shardd__region *r;
    char *host;
  } *shadows;
  size_t nshadows;
};
typedef struct shardd__ckrestore restore;

/* restore_lines.c: fails the current line: "PATH line N: WHY" in err, WHY cut at
 * 511 bytes. Returns rc where a call beneath already failed with it, else
 * SHARDD_E_INVAL (the line itself is wrong). */
shardd_err shardd__restore_bad(restore *c, shardd_err rc, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* restore_lines.c: a line the reader refused (too long, a NUL, no memory,
 * a read error); the header line; the job line against who asks (on the
 * reading thread, from the files alone); whether the directory and the
 * manifest may name owner as the job's owner (theirs or the daemon's); and
 * one line applied to the new job (each_line's callback). */
shardd_err shardd__restore_line_error(restore *c, shardd__line_rc lr);
shardd_err shardd__restore_line_header(restore *c, char **tok, int nt);
shardd_err shardd__restore_job_check(restore *c, const shardd__mline *ml);
shardd_err shardd__restore_vouched(int dirfd, int filefd, uint32_t owner,
                                   const char *path, const char *job, char *err,
                                   size_t errlen);
shardd_err shardd__restore_apply_line(restore *c, char **tok, int nt);

/* restore_plan.c: elements [lo, hi) of buffer b, as rank `rank` of a world
 * of `world` holds them (its shard's slice of the unpadded range); *old_s
 * the shard's size then. */
void shardd__restore_old_range(const shardd__buffer *b, uint32_t world,
                               uint32_t rank, uint64_t *lo, uint64_t *hi,
                               uint64_t *old_s);
/* restore_plan.c: plans the load of a shard line's payload (file, crc)
 * into buffer bi, the shard of old rank r, resharded where the world
 * changed. */
shardd_err shardd__restore_plan_shard(restore *c, const char *file,
                                      uint32_t crc, size_t bi, uint32_t r);
/* restore_plan.c: plans the loads of p's state lines into the optimizer
 * registered for it. */
shardd_err shardd__restore_plan_states(restore *c, pending_optim *p);
/* restore_plan.c: registers a recorded optimizer, every ref id replaced by
 * the restored object's, through the registration use case (optreg.h). */
shardd_err shardd__restore_register_pending(shardd__registry *reg,
                                            shardd__job *job, pending_optim *p,
                                            char *err, size_t errlen);

#endif /* SHARDD_RESTORE_INT_H */
