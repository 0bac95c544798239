/* registry.h — what the daemon owns: jobs, their flat buffers, the views
 * named inside them and the optimizers registered over those. Every object
 * has an id from one daemon-wide counter that is never reused, so an id
 * below the counter that resolves to nothing was freed, not mistyped.
 *
 * Ownership: the registry owns every job, buffer, view and optimizer and
 * the backend regions behind them; pointers it returns are borrowed and
 * valid until the object is unregistered or its job released. Used from the
 * loop thread only (workers touch region memory, never these structs'
 * links).
 *
 * Implemented in the files of daemon/registry/: registry.c (the registry,
 * jobs, ids, resolve, generations, freed handles, quotas), buffer.c
 * (buffers), views.c (views, frozen ranges), held.c (the held-view index),
 * seed.c (fp32 masters from exact values), optimizer.c (optimizers) and
 * areas.c (transient areas); what they share among themselves is in
 * registry_int.h, which no other module includes. */
#ifndef SHARDD_REGISTRY_H
#define SHARDD_REGISTRY_H

#include <stddef.h>
#include <stdint.h>

#include "backend.h"
#include "map.h"
#include "optim.h"
#include "shardd.h"

typedef enum {
  SHARDD__OBJ_BUFFER = 1,
  SHARDD__OBJ_VIEW = 2,
  SHARDD__OBJ_OPTIM = 3
} shardd__obj_kind;

typedef struct shardd__registry shardd__registry;
typedef struct shardd__job shardd__job;
typedef struct shardd__buffer shardd__buffer;
typedef struct shardd__view shardd__view;
typedef struct shardd__optim shardd__optim;

/* First member of every object, so an id lookup can tell what it found. */
typedef struct {
  shardd__obj_kind kind;
  /* name lives in the object's own allocation (a view's), not a strdup */
  unsigned char name_inline;
  uint64_t id;
  /* the last shardd__registry_mark_once that saw it */
  uint64_t mark;
  char *name;
  shardd__job *job;
  /* buffers and views: the generation of this name in the job (1 at the
   * first registration, +1 at each later one and at restore); 0 for
   * optimizers */
  uint64_t generation;
} shardd__obj;

struct shardd__job {
  /* read-only */
  char *name;
  uint32_t world;
  uint32_t uid; /* the uid that created it */
  shardd__registry *reg;
  /* The layers above keep their own state of a job (who holds its ranks:
   * jobs.c; its collectives: coll.c) by job, not in it. */
  /* read-only after shardd__job_set_layout: the job's nodes (--job-spec).
   * This daemon holds ranks [local_first, local_first + local_ranks); a
   * single-node job has nodes 1, local_first 0, local_ranks world. */
  uint32_t nodes, node_rank, local_first, local_ranks;
  /* read-only after a restore: a multi-node job restored from a job-level
   * checkpoint (checkpoint.h) holds that checkpoint's seal, nonzero; 0 a
   * job not restored so. Every cross-node exchange compares it, so nodes
   * that restored different checkpoints never train on mixed state. */
  uint64_t origin;
  /* The fabric lineage: a random id the nodes agree on when a fabric of
   * the job first forms, kept by every re-formed fabric (coll_fabric.c)
   * and recorded in each node's checkpoint part. 0: none yet. jobs.c
   * copies the engine's into it before a checkpoint is written (loop
   * thread); restore sets it from an exit part, with rejoining set: the
   * job was restored from this node's part of a live job (written by
   * --checkpoint-on-exit), and may only rejoin nodes of that lineage
   * whose states fit (step counts, buffers). */
  uint64_t lineage;
  int rejoining;
  /* read-only once the job has a buffer (shardd__job_set_transient):
   * gather and gradient areas are leased from per-device pools (areas.c)
   * instead of resident in every rank block */
  int transient;
  /* private */
  struct shardd__pool **pools; /* [ndevices] when transient; NULL until used */
  /* transient jobs on a host-mapped backend: the node's one pool of
   * gathered copies, every local rank's gather areas (areas.c); NULL until
   * used (and always, with the per-device pools holding them, on another
   * backend) */
  struct shardd__pool *gpool;
  uint32_t (*nleased)[2];      /* [world]: leases per rank, per area kind */
  shardd__map buffers; /* by name */
  shardd__map optims;  /* by name */
  uint64_t bytes;      /* resident, over every region of the job */
  /* transient jobs: the largest unit's slot bytes (areas.c), for the pool
   * memory reserved at registration; recomputed when stale (the largest
   * was unregistered) */
  size_t max_unit;
  int max_unit_stale;
  uint32_t nviews;
  /* generations: the last generation handed out per buffer name ("b:NAME")
   * and per view ("vLEN:BUFNAME" VIEWNAME), values cast from uint64_t; they
   * outlive the objects so a re-registration continues the count */
  shardd__map gens;
  /* handles freed in this job (id -> shardd__freed), the last
   * SHARDD__FREED_MAX of them in a ring, to tell a stale id from a mistyped
   * one */
  shardd__map freed;
  struct shardd__freed *freed_ring;
  size_t freed_head, freed_count;
  int releasing; /* job_release in progress: frees are not recorded */
  /* rank blocks its buffers hold, and the other regions that hold a
   * descriptor: its pools of transient areas, and with the fd store its
   * optimizer state, seeds and multi-node staging areas (see max_blocks) */
  uint64_t nblocks;
};

#define SHARDD__FREED_MAX 4096

typedef struct shardd__freed {
  uint64_t id, generation;
  shardd__obj_kind kind;
  /* one allocation, owned through key: the key, then name and buf_name */
  char *key;  /* the gens key of its name */
  char *name; /* buffer or view name */
  char *buf_name; /* views: the buffer's name */
  size_t cap;     /* bytes key's allocation holds */
} shardd__freed;

struct shardd__buffer {
  shardd__obj hdr;
  /* read-only after register */
  shardd_dtype dtype;
  uint64_t numel, padded_numel, shard_numel;
  uint32_t world;
  /* one block per rank, on device rank % ndevices (NULL for the ranks of
   * other nodes in a multi-node job):
   * [shard (dtype) | reduced grad shard (fp32) | gather (dtype) | grad (dtype)] */
  shardd__region **blocks;
  size_t shard_off, reduced_off, gather_off, grad_off, block_bytes;
  /* transient jobs: the blocks end after the reduced shard (gather_off and
   * grad_off are 0); each rank's leased areas, as slot numbers in the pool
   * of its device, -1 none ([world][kind]; areas.c) */
  int32_t (*lease)[2];
  /* transient jobs with a node-shared gather pool: b's slot in it, which
   * every rank holding a gather lease of b shares, -1 none (areas.c) */
  int32_t gslot;
  /* transient jobs: running collectives that read or write its areas
   * (shardd__areas_busy), and the ranks that left meanwhile, whose areas
   * of it go back when the last of those ends ([world]; areas.c) */
  uint32_t areas_busy;
  uint8_t *lease_left;
  /* public counters */
  uint32_t nowned;   /* optimizer refs to it or its views */
  uint64_t gathers, scatters;
  /* held ranges looked at (index nodes visited, by lookups, inserts and
   * removals): tests bound it, so the work of one registration is shown
   * not to grow with the views already held */
  uint64_t held_probes;
  shardd__optim *owner; /* when referenced whole */
  /* The last scatter brought a gradient for the buffer from some rank (1
   * before any scatter, and after one from a client that sends no mask):
   * a whole-buffer ref without one is skipped by the step, as torch skips
   * a parameter whose .grad is None. */
  int grad_seen;
  /* private */
  int masked; /* some view has grad_seen 0 (a scatter sent a mask) */
  /* holds by collectives queued or running on it (and by steps of an
   * optimizer over it); changed only through shardd__buffer_hold,
   * shardd__optim_hold and their releases, so unregister's refusal stays
   * the registry's own rule */
  uint32_t inflight;
  shardd__map views; /* by name */
  /* read-only: views with requires_grad false (their merged ranges:
   * shardd__buffer_frozen) */
  uint32_t nfrozen;
  /* index nodes and ranges looked at by the frozen bookkeeping (treaps of
   * frozen and trainable views, merging the ranges): tests bound it, so a
   * registration, change or removal is shown to cost O(log n) and a read
   * after changes one pass, never a sort of every frozen view per change */
  uint64_t frozen_probes;
  /* private: frozen ([0]) and trainable ([1]) views by offset, treaps
   * through the views' kind_* links, each node knowing the furthest end
   * below it, so "does [s, e) meet a view of this kind" is O(log n); and
   * the union of the frozen ranges, merged, in offset order, recomputed
   * from kind_root[0] at the first read after a change (frozen_stale;
   * read it through shardd__buffer_frozen).
   * frozen_cap >= nfrozen always, so that read cannot fail. */
  shardd__view *kind_root[2];
  uint64_t (*frozen_union)[2];
  size_t nfrozen_union, frozen_cap;
  int frozen_stale;
  /* the views optimizers hold, by offset: a treap through the views' own
   * held_* links, so the held check is O(log n) instead of listing every
   * view of the buffer per registration (70k optimizers took 969 s).
   * Changed only by optim_create and optim_destroy; held views never
   * overlap, so their ends ascend with their offsets. */
  shardd__view *held_root;
  size_t nheld;
  /* multi-node scatter: padded_numel fp32 where the local ranks' gradients
   * are summed before the fabric; allocated at the first such scatter */
  shardd__region *stage;
  /* the reduced shards hold the gradient of a scatter no step has
   * consumed yet: an accumulating scatter adds to them only then (engine,
   * loop thread) */
  int reduced_live;
  /* the shards hold trained (a step ran) or restored values; until then
   * the first init checksum a rank gave (dispatch) */
  int settled;
  /* 16-bit buffers until their first step, per rank: the exact fp32
   * initial values a trainer gave (shardd__buffer_seed), the master of
   * every optimizer shard over (b, rank). They are in one place only:
   * seed[rank] (fp32 shard_numel) while no optimizer shard over (b, rank)
   * holds them, else the master of seed_holder[rank], which a shard
   * registered later copies; so a 16-bit unit holds no fp32 copy beside
   * its masters. NULL arrays or entries: none. Both go at the buffer's
   * first step (shardd__buffer_seed_drop). */
  shardd__region **seed;
  struct shardd__optim_shard **seed_holder;
  int has_init_sum;
  uint64_t init_sum;
  uint32_t init_rank;
};

struct shardd__view {
  shardd__obj hdr;
  shardd__buffer *buf;
  uint64_t offset, numel;
  int64_t *shape;
  int ndim;
  int requires_grad; /* 0: frozen; never overlaps a trainable view */
  /* As the buffer's grad_seen, for this view: a held view without a
   * gradient from any rank in the last scatter is skipped by the step. */
  int grad_seen;
  shardd__optim *owner;
  uint32_t owner_ref; /* its index in owner->refs (and ref_steps) */
  /* private: links in buf->held_root while owner is set */
  shardd__view *held_l, *held_r;
  uint64_t held_prio;
  /* private: links in buf->kind_root[requires_grad], and the furthest end
   * of a view in the subtree under this one */
  shardd__view *kind_l, *kind_r;
  uint64_t kind_max;
};

typedef struct {
  uint64_t start; /* element index inside the rank's shard */
  uint64_t len;
  uint32_t group;
  uint32_t ref; /* index in the optimizer's refs: one ref per segment, so a
                   ref skipped by a step is skipped whole */
} shardd__seg;

/* The part of an optimizer that lives on one rank's shard of one buffer. */
typedef struct shardd__optim_shard {
  shardd__buffer *buf;
  uint32_t rank;
  shardd__region *state; /* fp32: [master if 16-bit][state arrays] */
  size_t master_off;
  size_t state_offs[3];
  int nstate; /* fp32 state arrays after the master copy */
  int master_valid;
  shardd__seg *segs;
  size_t nsegs;
} shardd__optim_shard;

struct shardd__optim {
  shardd__obj hdr;
  shardd_optim_kind kind;
  shardd__hp *groups; /* resolved hyperparameters per group */
  size_t ngroups;
  shardd__optim_shard *shards;
  size_t nshards;
  shardd__obj **refs; /* buffers and views it owns */
  size_t nrefs;
  /* steps each ref has taken ([nrefs]): torch's state[p]["step"], which a
   * parameter skipped (frozen, or no gradient) does not advance; its bias
   * correction uses its own count */
  uint64_t *ref_steps;
  /* each ref's buffer's scatters count when the last step ran ([nrefs]):
   * a step consumes the reduced gradient, so a ref whose buffer had no
   * scatter since is skipped as torch skips a .grad that is None, never
   * given the old gradient again (engine, loop thread) */
  uint64_t *ref_scatters;
  uint64_t steps; /* steps of the optimizer (each one counts, skips or not) */
  /* a clip_grad_norm_ since the last step (engine, loop thread): the
   * next step multiplies the gradients by clip_scale */
  int clip_pending;
  float clip_scale;
  uint8_t *spec; /* packed registration, to recognise an identical one */
  size_t spec_len;
  /* private: steps queued or running on it; changed only through
   * shardd__optim_hold and shardd__optim_release_hold */
  uint32_t inflight;
};

struct shardd__registry {
  /* read-only */
  shardd__backend *backend;
  /* public config */
  uint64_t job_memory_limit; /* bytes one job may hold; 0 unlimited */
  /* bytes all jobs of one uid other than root may hold; 0 unlimited */
  uint64_t uid_memory_limit;
  size_t max_jobs;           /* jobs at once; 0 unlimited */
  /* jobs one uid other than root may hold at once (lingering ones count):
   * 4,096 empty jobs from one user filled --max-jobs in 0.32 s */
  size_t max_jobs_per_uid;
  /* transient areas a rank may lease at once, per kind (gather, gradient):
   * FSDP's limit_all_gathers is 2 */
  uint32_t leases_per_rank[2];
  /* Memory regions (rank blocks) held at once, in all and by one uid other
   * than root; 0 unlimited. On the host backend each is a descriptor: one
   * job of world 16384 used every descriptor of the daemon in 0.4 s, and
   * then every connect failed. main sizes them from RLIMIT_NOFILE. A
   * transient job's pools, and with the fd store an optimizer shard's
   * state, a 16-bit buffer's seeds and a multi-node buffer's staging
   * area, are memfds too, and count. */
  uint64_t max_blocks;
  uint64_t max_blocks_per_uid;
  /* Views held at once, in all and by one uid other than root; 0
   * unlimited. Nothing bounded them: 200k views cost 240 MB. */
  uint64_t max_views;
  uint64_t max_views_per_uid;
  /* private */
  uint64_t nblocks;
  uint64_t nviews; /* over every job; each job counts its own */
  uint64_t next_id;
  uint64_t next_mark; /* shardd__registry_new_mark's */
  shardd__map objects; /* id -> shardd__obj */
  shardd__map jobs;    /* "UID/NAME" -> job: a job is (owner, name) */
  /* uid -> the last pool id handed to that uid's jobs (areas.c): a pool id
   * counts the uid's own pools only, never another uid's */
  shardd__map pool_ids;
  /* while a batch registers buffers (shardd__buffer_slabs_begin): the
   * slab of each of slab_job's local ranks, their rank blocks' source */
  shardd__slab **slabs;
  shardd__job *slab_job;
};

/* The most ranks a job may have (job_get refuses more). */
#define SHARDD__WORLD_MAX 65536u

void shardd__registry_init(shardd__registry *reg, shardd__backend *backend);
/* Sizes max_blocks from the process's descriptor limit (on the host
 * backend each rank block is a descriptor), leaving keep of them to the
 * rest of the daemon; one uid gets a quarter, so no single user can starve
 * the others (or the accept loop). No limit: unchanged. */
void shardd__registry_fit_blocks(shardd__registry *reg, uint64_t keep);
/* Releases every job and frees everything; the backend stays the caller's. */
void shardd__registry_free(shardd__registry *reg);

/* Finds uid's job called name or creates it for uid with world ranks
 * (mismatching world: SHARDD_E_MISMATCH). Job names are per uid: another
 * uid's job of the same name is another job, never this one. A name with
 * a '/' is refused (SHARDD_E_INVAL): "N/NAME" is how an admin names uid N's
 * job, and must name that job only. */
shardd_err shardd__job_get(shardd__registry *reg, const char *name,
                           uint32_t world, uint32_t uid, shardd__job **out,
                           char *err, size_t errlen);
/* uid's job called name, or NULL. */
shardd__job *shardd__job_find(shardd__registry *reg, uint32_t uid,
                              const char *name);
/* Makes job span nodes daemons, this one being node_rank: it then holds the
 * world/nodes ranks of that node only. Only before the job has buffers;
 * world must divide evenly (SHARDD_E_RANGE / SHARDD_E_STATE otherwise). */
shardd_err shardd__job_set_layout(shardd__job *job, uint32_t nodes,
                                  uint32_t node_rank, char *err,
                                  size_t errlen);
static inline int shardd__job_rank_local(const shardd__job *job,
                                         uint32_t rank) {
  return rank >= job->local_first && rank - job->local_first < job->local_ranks;
}
/* Frees the job and all it owns. The caller has failed its collectives. */
void shardd__job_release(shardd__registry *reg, shardd__job *job);
void shardd__registry_each_job(shardd__registry *reg,
                               void (*fn)(shardd__job *job, void *arg),
                               void *arg);

/* Looks up any object by id; NULL when none is live. */
shardd__obj *shardd__registry_get(const shardd__registry *reg, uint64_t id);
/* A new mark for one pass over a list of ids (shardd__registry_mark_once). */
uint64_t shardd__registry_new_mark(shardd__registry *reg);
/* 1 the first time mark meets o in its pass, 0 after (o named twice): a
 * list's repeats found in one lookup an id, where a sort of the list was a
 * seventh of a batch's unregistration. */
int shardd__registry_mark_once(shardd__obj *o, uint64_t mark);
/* Whether id was handed out once (and so, if not live, was freed). */
int shardd__registry_issued(const shardd__registry *reg, uint64_t id);
/* Ids are one counter for every uid, so what a uid is told of an id it
 * does not hold must not depend on whether another uid holds it, or held
 * it. Visible: whether the holder of job (NULL: none) may learn that o
 * exists, its kind or its name (o is its uid's, or job is root's).
 * Known_freed: whether it may be told that id, not live, was issued and
 * freed (root's jobs: any issued id; others: an id freed from job itself,
 * among the freed handles it remembers). Elsewhere ids read as never
 * issued. */
int shardd__registry_visible(const shardd__job *job, const shardd__obj *o);
int shardd__registry_known_freed(const shardd__registry *reg,
                                 const shardd__job *job, uint64_t id);
/* Resolves id to an object of kind in job, with a message naming what is
 * wrong otherwise (unknown, freed, another job of the uid, another kind);
 * an id of another uid's object is answered as one never issued (the same
 * code and message). */
shardd_err shardd__registry_resolve(const shardd__registry *reg,
                                    const shardd__job *job, uint64_t id,
                                    shardd__obj_kind kind, shardd__obj **out,
                                    char *err, size_t errlen);
/* As resolve, and refused with SHARDD_E_STALE when generation (0: not
 * checked) is not the object's. A freed id whose name was registered again
 * since is SHARDD_E_STALE in both, naming the current handle. */
shardd_err shardd__registry_resolve_gen(const shardd__registry *reg,
                                        const shardd__job *job, uint64_t id,
                                        uint64_t generation,
                                        shardd__obj_kind kind,
                                        shardd__obj **out, char *err,
                                        size_t errlen);
/* Whether (id, generation) is a stale handle of job: a live object of
 * another generation (generation 0 is never stale when live), or a freed
 * one whose name has been registered again since. Fills err with
 * `buffer 5 ("layer0") is stale: generation 1, current is buffer 9
 * generation 2` when it is. */
int shardd__registry_stale(const shardd__registry *reg, const shardd__job *job,
                           uint64_t id, uint64_t generation, char *err,
                           size_t errlen);
/* Sets the generation of o (restore: the recorded one + 1) and raises its
 * name's count in the job to it. */
void shardd__obj_set_generation(shardd__obj *o, uint64_t generation);

/* Until shardd__buffer_slabs_end, the rank blocks of job's buffers made
 * are taken from one memfd per local rank (a slab, backend.h), each with
 * room for nblocks blocks of bytes in all; nothing is done where the
 * backend has no slabs. A slab is one more region per rank against the
 * bounds on regions (else SHARDD_E_LIMIT). */
shardd_err shardd__buffer_slabs_begin(shardd__registry *reg, shardd__job *job,
                                      uint64_t bytes, size_t nblocks,
                                      char *err, size_t errlen);
/* No more blocks: each slab is sealed, and kept by its blocks (one no
 * block took goes now). SHARDD_E_IO (err) when one could not be: its
 * blocks must be freed without being handed out. */
shardd_err shardd__buffer_slabs_end(shardd__registry *reg, char *err,
                                    size_t errlen);
/* The bytes of each rank block a new buffer of job would take (0 when
 * dtype or numel would be refused). */
uint64_t shardd__buffer_block_bytes(const shardd__job *job, shardd_dtype dtype,
                                    uint64_t numel);
/* Adoption at a restart put k regions the job counted one each into slabs
 * already counted (backend wrap_slab): k fewer. */
void shardd__registry_regions_merged(shardd__registry *reg, shardd__job *job,
                                     uint64_t k);

/* Creates a buffer, or attaches when one of that name exists with the same
 * dtype and numel (*created tells which). */
shardd_err shardd__buffer_register(shardd__registry *reg, shardd__job *job,
                                   const char *name, shardd_dtype dtype,
                                   uint64_t numel, shardd__buffer **out,
                                   int *created, char *err, size_t errlen);
shardd_err shardd__buffer_unregister(shardd__registry *reg, shardd__job *job,
                                     uint64_t id, char *err, size_t errlen);
/* Whether buffer id could be unregistered now (registered in job, held by
 * no optimizer, no collective in flight), without doing it: a batch checks
 * every entry first. */
shardd_err shardd__buffer_unregister_check(shardd__registry *reg,
                                           shardd__job *job, uint64_t id,
                                           char *err, size_t errlen);
/* Undoes the registration that created b (buffer_register with *created
 * 1), as if it never happened: its name's generation goes back and no
 * freed handle is recorded, so a refused batch leaves no trace. */
void shardd__buffer_abandon(shardd__registry *reg, shardd__buffer *b);
/* Pins b while a collective is queued or running on it: buffer_unregister
 * refuses it with SHARDD_E_BUSY until every hold is released. Holds count,
 * and each is undone by one release_hold; releasing one never taken is the
 * caller's bug. */
void shardd__buffer_hold(shardd__buffer *b);
void shardd__buffer_release_hold(shardd__buffer *b);

shardd_err shardd__view_register(shardd__registry *reg, shardd__job *job,
                                 uint64_t buffer, const char *name,
                                 uint64_t offset, uint64_t numel,
                                 const int64_t *shape, int ndim,
                                 shardd__view **out, int *created, char *err,
                                 size_t errlen);
/* As view_register, with requires_grad (0: a frozen range; refused with
 * SHARDD_E_OVERLAP where it meets a view of the other kind and
 * SHARDD_E_BUSY in a buffer an optimizer holds whole) and the buffer's
 * expected generation (0: not checked). */
shardd_err shardd__view_register_ex(shardd__registry *reg, shardd__job *job,
                                    uint64_t buffer, uint64_t buffer_gen,
                                    const char *name, uint64_t offset,
                                    uint64_t numel, const int64_t *shape,
                                    int ndim, int requires_grad,
                                    shardd__view **out, int *created,
                                    char *err, size_t errlen);
/* Elements of buf with gradients: the complement of its frozen views,
 * clipped to [lo, hi), as up to cap (start, len) pairs in out; returns how
 * many there are (may exceed cap: then call again with more room). */
size_t shardd__buffer_trainable(shardd__buffer *buf, uint64_t lo,
                                uint64_t hi,
                                uint64_t (*out)[2], size_t cap);
/* The union of buf's frozen views' ranges, merged, in offset order: sets
 * *ranges to that many (start, len) pairs, borrowed, valid until buf's
 * views change, and returns how many. The first read after changes merges
 * the frozen views in one pass (O(frozen views), no sort); cannot fail. */
size_t shardd__buffer_frozen(shardd__buffer *buf, uint64_t (**ranges)[2]);

/* Takes rank's fp32 values, written into its reduced-gradient area, as
 * the exact initial values of b's 16-bit shard: the master of every
 * optimizer shard over (b, rank) now, and of those registered later until
 * b's first step (shardd__buffer_seed_drop). A region of their own holds
 * them only while no optimizer shard over (b, rank) exists. The reduced
 * area is zeroed. SHARDD_E_INVAL for an fp32 buffer (its shard is its
 * master), SHARDD_E_BUSY while a collective holds b, SHARDD_E_NO_MEMORY
 * past a memory limit (err names its flag). */
shardd_err shardd__buffer_seed(shardd__registry *reg, shardd__buffer *b,
                               uint32_t rank, char *err, size_t errlen);
/* Frees b's seeds (its first step made the masters authoritative). */
void shardd__buffer_seed_drop(shardd__registry *reg, shardd__buffer *b);
/* Registering sh (its state not yet allocated): moves the seed of its
 * buffer's rank, if it has a region of its own and no gradient lives in
 * the reduced area, into that area and frees its region, so it and sh's
 * state are never held together. Returns whether it did (then pass 1 to
 * shardd__optim_shard_seed, or call shardd__optim_shard_seed_unpark when
 * the state cannot be had). */
int shardd__optim_shard_seed_park(shardd__registry *reg,
                                  shardd__optim_shard *sh);
void shardd__optim_shard_seed_unpark(shardd__registry *reg,
                                     shardd__optim_shard *sh);
/* Copies the seed of sh's buffer and rank, if any (parked, in a region of
 * its own, which is then freed, or in another shard's master), into sh's
 * master (validating it); sh holds it then if no other shard did. */
shardd_err shardd__optim_shard_seed(shardd__registry *reg,
                                    shardd__optim_shard *sh, int parked);
/* Before sh's state is freed (its optimizer unregistered, or its
 * registration failed): if sh holds its buffer's seed, another shard over
 * the same rank that has it takes over, else it goes back into a region
 * of its own (sh's state freed first when it can go through the reduced
 * area). Nothing while the job is released. */
void shardd__optim_shard_unseed(shardd__registry *reg, shardd__optim_shard *sh);

/* One parameter's optimizer state (see OptimState on the wire): ref_id a
 * view or buffer o holds; *nstate its state arrays, *numel its elements,
 * *steps its step count. count > 0 fp32 elements of array at offset are
 * copied into io (write 0) or from it (write 1), across the shards of the
 * ranks of this node (SHARDD_E_STATE for another node's). array
 * SHARDD__OPTIM_MASTER: the fp32 master of a 16-bit buffer instead
 * (SHARDD_E_INVAL for fp32, SHARDD_E_STATE before a shard has one); its
 * reads may name a view or buffer o does not hold, over o's shards (then
 * *steps is NULL).
 * SHARDD_E_BUSY while a step of o is queued or running. */
#define SHARDD__OPTIM_MASTER UINT32_MAX
shardd_err shardd__optim_state_io(shardd__registry *reg, shardd__optim *o,
                                  uint64_t ref_id, uint32_t array,
                                  uint64_t offset, uint64_t count, float *io,
                                  int write, uint32_t *nstate, uint64_t *numel,
                                  uint64_t **steps, char *err, size_t errlen);

/* Allocates b's multi-node staging area (padded_numel fp32 on the device
 * of the job's first local rank, a private region where the backend has
 * them) unless it has one; it counts towards the job's bytes, within its
 * memory limits (else SHARDD_E_NO_MEMORY), and when it holds a descriptor
 * towards the memory regions (else SHARDD_E_LIMIT), as a rank block does;
 * freed with b. */
shardd_err shardd__buffer_stage(shardd__registry *reg, shardd__buffer *b,
                                char *err, size_t errlen);

/* ---- transient areas (areas.c) -------------------------------------------
 * In a transient job each rank's gather area (and, for backward, its
 * gradient area) of a buffer is leased from pools of a bounded count of
 * slots. Gradient areas come from one pool per device, shared by the
 * job's ranks on that device, reg->leases_per_rank[GRAD] slots per local
 * rank. Gather areas, on a host-mapped backend, are the node's: one slot
 * per gathered buffer that every local rank holding a lease of it shares
 * (counted by reference; the last return frees it), in one pool of
 * local_ranks * (leases_per_rank[GATHER] - 1) + 1 slots, handed to
 * trainers read-only (shardd__area.readonly). Gathers lease for every
 * local rank at once, in one order, so when the newest held buffer was
 * last leased every rank held at most leases_per_rank - 1 others, which it
 * still holds or gave back: no more slots are ever held. On a host-mapped
 * backend each slot is a region of its own (its own pool id), made at the
 * first lease that finds no free slot holding its unit, as large as that
 * unit; a free slot too small is made anew larger before another is made,
 * so a pool holds as many slots as were held at once, each the size of
 * the largest unit it held. On another backend (cuda) each rank's gather
 * areas are its own, in its device's pool, with leases_per_rank[GATHER]
 * more slots per rank, and a pool is one exportable region (a trainer maps
 * it once) of equal slots as large as the job's largest unit, made at the
 * first lease and remade larger only when nothing of it is leased. Either
 * way the memory limits reserve the count's worst case, every slot as
 * large as the job's largest unit (shardd__areas_reserve). */

typedef enum { SHARDD__AREA_GATHER = 0, SHARDD__AREA_GRAD = 1 } shardd__area_kind;

typedef struct {
  shardd__region *pool;
  uint64_t pool_id;
  size_t off; /* bytes into the pool */
  /* the node's shared gather pool: every local rank reads the area, so
   * trainers get the pool's descriptor read-only */
  int readonly;
} shardd__area;

/* The job's gather and gradient areas leased (on) or resident (off). Only
 * while the job has no buffer: SHARDD_E_MISMATCH otherwise when asked for
 * the other way; with another backend than a host-mapped one, transient
 * areas are SHARDD_E_STATE (not built for the cuda backend yet). */
shardd_err shardd__job_set_transient(shardd__job *job, int on, char *err,
                                     size_t errlen);
/* rank's area of kind for b: the one it holds, or a new lease. Over the
 * rank's leases of that kind: SHARDD_E_LIMIT naming the buffers it holds;
 * in a pool of equal slots (cuda), a unit larger than its slots while the
 * pool is in use: SHARDD_E_BUSY. *took says whether this call leased it. */
shardd_err shardd__area_lease(shardd__registry *reg, shardd__buffer *b,
                              uint32_t rank, shardd__area_kind kind,
                              shardd__area *out, int *took, char *err,
                              size_t errlen);
/* Whether rank holds an area of kind for b (filled into *out if so). */
int shardd__area_held(const shardd__buffer *b, uint32_t rank,
                      shardd__area_kind kind, shardd__area *out);
/* Returns rank's area of kind for b (nothing when it holds none). */
void shardd__area_return(shardd__buffer *b, uint32_t rank,
                         shardd__area_kind kind);
/* Returns every area rank holds in job (a rank that left), whatever is
 * queued on its buffers: at once, or, on a buffer whose areas a running
 * collective uses, when the last of those ends (shardd__areas_idle), so no
 * pool task writes into an area leased again meanwhile. */
void shardd__area_return_rank(shardd__job *job, uint32_t rank);
/* A collective starts using b's areas (the ones it found leased at its
 * start) / has ended (failed or not): the areas of ranks that left in
 * between are returned by the last idle. Loop thread; paired. */
void shardd__areas_busy(shardd__buffer *b);
void shardd__areas_idle(shardd__buffer *b);
/* Bytes the job's pools hold now (persistent = job->bytes - this). */
uint64_t shardd__job_pool_bytes(const shardd__job *job);
/* What of them is gathered copies: the pool bytes set aside for gather
 * areas (the node's gather pool; on a backend without one, the gather
 * slots of the per-device pools), the bytes and number of the slots held
 * now (a node-shared copy once, however many ranks hold it), and whether
 * the copies are the node's (shared) or each rank's. */
typedef struct {
  uint64_t pool_bytes, held_bytes;
  uint32_t held, shared;
} shardd__gather_usage;
void shardd__job_gather_usage(const shardd__job *job, shardd__gather_usage *out);
/* Bytes the job's pools may take beyond what they hold, once every slot
 * is made as large as the job's largest unit, or b when larger (b: a
 * buffer being registered, NULL none). The memory limits count them from the
 * registration that makes them needed (shardd__within_quota), so a job
 * learns it is over one when it registers, not at its first gather. */
uint64_t shardd__areas_reserve(shardd__job *job, const shardd__buffer *b);
/* b joins / leaves its transient job's units (buffer.c). */
void shardd__areas_unit_added(shardd__buffer *b);
void shardd__areas_unit_removed(shardd__buffer *b);

shardd_err shardd__view_unregister(shardd__registry *reg, shardd__job *job,
                                   uint64_t id, char *err, size_t errlen);
/* Whether view id could be unregistered now (registered in job, held by
 * no optimizer), without doing it: a batch checks every entry first. */
shardd_err shardd__view_unregister_check(shardd__registry *reg,
                                         shardd__job *job, uint64_t id,
                                         char *err, size_t errlen);
/* Undoes the registration that created v (view_register_ex with *created
 * 1), as if it never happened: its name's generation goes back and no
 * freed handle is recorded, so a refused batch leaves no trace. Views
 * created after v must be abandoned first (newest first). */
void shardd__view_abandon(shardd__registry *reg, shardd__view *v);
/* Freezes (requires_grad 0) or unfreezes a view: gradual unfreezing. The
 * rules of view_register_ex hold (a frozen view meets no trainable one and
 * lies in no buffer held whole: SHARDD_E_OVERLAP, SHARDD_E_BUSY); a view an
 * optimizer holds stays held, and its steps skip it while it is frozen.
 * Takes effect for collectives not started yet. generation 0: unchecked. */
shardd_err shardd__view_set_requires_grad(shardd__registry *reg,
                                          shardd__job *job, uint64_t id,
                                          uint64_t generation,
                                          int requires_grad, char *err,
                                          size_t errlen);
/* The step count of ref o (a view or buffer) in its optimizer; 0 when no
 * optimizer holds it. */
uint64_t shardd__ref_steps(const shardd__obj *o);

/* A validated optimizer description (see validate.h) turned into an
 * optimizer: takes ownership of plan's arrays on success. */
typedef struct {
  shardd__obj *obj; /* buffer or view */
  shardd__buffer *buf;
  uint64_t offset, numel; /* element range inside buf */
  uint32_t group;
} shardd__plan_ref;

typedef struct {
  char *name;
  shardd_optim_kind kind;
  shardd__hp *groups;
  size_t ngroups;
  shardd__plan_ref *refs;
  size_t nrefs;
  uint8_t *spec;
  size_t spec_len;
} shardd__optim_plan;

void shardd__optim_plan_free(shardd__optim_plan *plan);

shardd_err shardd__optim_create(shardd__registry *reg, shardd__job *job,
                                shardd__optim_plan *plan, shardd__optim **out,
                                char *err, size_t errlen);
shardd__optim *shardd__optim_find(shardd__job *job, const char *name);
/* Layout of one optimizer shard's state region: the fp32 master copy (for
 * bf16/fp16 params) at *master_off, then nstate arrays of shard_numel
 * floats; returns the bytes used (0: no state). */
size_t shardd__optim_state_layout(shardd_dtype dtype, uint64_t shard_numel,
                                  int nstate, size_t *master_off,
                                  size_t state_offs[3]);
shardd_err shardd__optim_unregister(shardd__registry *reg, shardd__job *job,
                                    uint64_t id, char *err, size_t errlen);
/* Pins o while a step is queued or running on it: optim_unregister refuses
 * it with SHARDD_E_BUSY, and the buffer of each of its shards is held as by
 * buffer_hold, once per shard (a buffer with k local shards, k times).
 * release_hold undoes exactly one hold, o's shards being fixed at create.
 * Counted as buffer holds are. */
void shardd__optim_hold(shardd__optim *o);
void shardd__optim_release_hold(shardd__optim *o);

/* Buffers of a job in id order; *out caller-freed with free(). */
shardd_err shardd__job_buffers(shardd__job *job, shardd__buffer ***out,
                               size_t *n);
shardd_err shardd__job_optims(shardd__job *job, shardd__optim ***out,
                              size_t *n);
/* Of the views of buf that optimizers hold, the one with the lowest
 * offset among those ending after start; NULL when none. Borrowed. O(log n)
 * in the held views; counted in buf->held_probes. */
const shardd__view *shardd__buffer_held_from(shardd__buffer *buf,
                                             uint64_t start);
/* Views of a buffer in offset order; *out caller-freed with free(). */
shardd_err shardd__buffer_views(shardd__buffer *buf, shardd__view ***out,
                                size_t *n);

static inline int shardd__rank_device(const shardd__registry *reg,
                                      uint32_t rank) {
  return (int)(rank % (uint32_t)reg->backend->ndevices);
}

#endif /* SHARDD_REGISTRY_H */
