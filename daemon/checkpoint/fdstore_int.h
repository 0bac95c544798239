/* fdstore_int.h — what fdstore.c (descriptions, the journal) and
 * fdstore_adopt.c (adoption at start, torn jobs) share: the layout of a
 * description's memfds, the store's state, and the helpers both use. No
 * other module includes it. Loop thread only, as the store. */
#ifndef SHARDD_FDSTORE_INT_H
#define SHARDD_FDSTORE_INT_H

#include <stdint.h>

#include "fdstore.h"
#include "manifest.h"

#define META_PREFIX "shardd-m"
/* A slot's magic is its format. 1: its manifest's step counts are the
 * job's (every step rewrote it); what a daemon before the journal's step
 * counts wrote, still adopted. 2: the journal's step counts (below) come
 * over the manifest's when they are of its generation; a daemon that
 * reads only 1 finds no whole slot in it rather than stale counts. */
#define SLOT_MAGIC_V1 "SHDMETA1"
#define SLOT_MAGIC "SHDMETA2"
#define JRNL_MAGIC "SHDJRNL1"
#define STEPS_MAGIC "SHDSTEP1"
#define SLOT_TEXT_OFF 4096
#define JRNL_BYTES 4096
#define JRNL_RECS 31
/* region lines and the manifest: a slot's text is bounded as a manifest
 * is, twice over */
#define SLOT_TEXT_MAX (2 * SHARDD__MANIFEST_MAX)

typedef struct {
  char magic[8];
  uint64_t gen; /* 0: never written */
  uint64_t len;
  uint32_t crc;
  uint32_t pad;
} slot_hdr;

/* A step in progress: step1 is its step count + 1, 0 a free record. The
 * name is written first, step1 last (release), and cleared first. */
typedef struct {
  _Atomic uint64_t step1;
  char name[112];
} jrec;

typedef struct {
  char magic[8];
  /* steps in progress past the records (named by none) */
  _Atomic uint64_t overflow;
  jrec rec[JRNL_RECS];
} jrnl;

_Static_assert(sizeof(jrnl) <= JRNL_BYTES, "the journal fits its page");

/* The committed step counts, in the journal's memfd past its page
 * (JRNL_BYTES on): written whole with each description (gen set last),
 * then one optimizer's entry in place at the end of each of its steps,
 * before its record is cleared. After the header, one entry per optimizer
 * in the manifest's order: its step count, its refs' count, and each
 * ref's step count in the manifest's order (uint64_t each). */
typedef struct {
  char magic[8];
  /* the generation of the slot these counts go with; 0 while the section
   * is rewritten. Counts of another generation than the newest slot's are
   * not used: that slot, written after them, has the current ones. */
  _Atomic uint64_t gen;
  uint64_t nopt;
  uint64_t bytes; /* the section's, this header included */
} steps_hdr;

typedef struct {
  char *key; /* "UID/NAME" */
  shardd__job *job;
  char base[64]; /* shardd-m<prefix>-<n>; the fds are BASE-a, -b, -j */
  int fd[3];     /* slot a, slot b, journal */
  jrnl *j;       /* fd[2] mapped, jlen bytes: the page, the step counts */
  size_t jlen;
  uint64_t gen;  /* of the newest slot written */
  int active;    /* that slot, -1 none */
  int dirty;
  uint64_t seen; /* the scan that last found its job */
  shardd__optim *rec_opt[JRNL_RECS];
  int warned; /* a description that could not be written was logged */
  /* the step counts' layout the newest slot was written with (nlay 0:
   * none; a step's end then rewrites the description): per optimizer, its
   * entry's offset in the journal memfd, its refs, and whether a shard of
   * it was described before its master copy was taken (its next step
   * changes that in the manifest: rewritten whole) */
  size_t nlay;
  uint64_t *lay_id; /* the optimizer's */
  size_t *lay_off, *lay_nrefs;
  unsigned char *lay_mv;
} fs_job;

typedef struct torn {
  struct torn *next;
  char *key, *name, *hint;
  uint64_t step;
  char opt[112];
  int anonymous; /* only the overflow counter says a step ran */
  /* not torn by a step: its description could not be adopted (why) */
  char *why;
  shardd__fdstore_fd *fds; /* its memory, kept in the store until forgotten */
  char **names;
  size_t nfds;
} torn;

struct shardd__fdstore {
  uv_loop_t *loop;
  shardd__registry *reg;
  int (*skip)(void *arg, shardd__job *job);
  void *skip_arg;
  uv_prepare_t prep;
  shardd__map jobs; /* key -> fs_job */
  shardd__map held; /* keys the store held at start */
  int touched;
  int closing; /* stop closed the handle: no scan, no removal from here */
  uint64_t epoch, next_id;
  char prefix[32];
  torn *torn;
  /* $SHARDD_TEST_STEP_PAUSE_MS, read once: tests hold each step this long
   * with its journal record set, to kill the daemon inside it; 0 (unset)
   * in production */
  unsigned pause_ms;
};

/* "UID/NAME", malloc'd. */
char *shardd__fdstore_key_of(uint32_t uid, const char *name);
/* Hands fd to systemd's store under name (FDSTORE=1), or takes name out
 * of it (FDSTOREREMOVE=1); a refusal is logged, not returned. */
void shardd__fdstore_store_fd(int fd, const char *name);
void shardd__fdstore_unstore_fd(const char *name);
/* The name of e's descriptor k (0 slot a, 1 slot b, 2 the journal). */
void shardd__fdstore_fd_name(const fs_job *e, int k, char *out, size_t len);
/* Closes and frees e (NULL is a no-op), first taking its descriptors out
 * of the store when unstore. */
void shardd__fdstore_entry_free(fs_job *e, int unstore);
/* Maps e's journal (fd[2]), all of it (at least its page), at e->j. */
shardd_err shardd__fdstore_map_journal(fs_job *e);
/* Writes e's job's description into the slot not holding the newest one. */
shardd_err shardd__fdstore_sync_entry(shardd__fdstore *fs, fs_job *e);
/* Closes what t kept and frees it. */
void shardd__fdstore_free_torn(torn *t);

#endif /* SHARDD_FDSTORE_INT_H */
