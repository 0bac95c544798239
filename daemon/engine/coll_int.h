/* coll_int.h — what the engine's files share (coll.c: queue, matching,
 * phases, completion; coll_work.c: planning and per-rank work; coll_bulk.c:
 * whole collectives through the backend; coll_fabric.c: the cross-node
 * exchange). Only they include it. Loop thread unless a field says. */
#ifndef SHARDD_COLL_INT_H
#define SHARDD_COLL_INT_H

#include <math.h>
#include <pthread.h>
#include <stdatomic.h>

#include "coll.h"
#include "fabric.h"
#include "map.h"

typedef struct coll coll;
typedef struct coll_fab coll_fab;
typedef struct shardd__coll_helper shardd__coll_helper;

typedef struct {
  shardd__coll_member *m; /* NULL when not arrived or gone */
  uint64_t seq;
  int arrived;
  int want_grad; /* gather of a transient job: lease the gradient area too */
  /* this rank sent it as an entry of a bucket (its own args.bucket set):
   * its answer carries the entry's result, whoever made the collective */
  int in_bucket;
  double *vals;  /* all_reduce: this rank's values (owned) */
  /* scatter: this rank's views without a gradient (sorted, unique), or
   * none_all: the whole buffer */
  uint64_t *no_grad;
  size_t nno_grad;
  int none_all;
} waiter;

/* One piece of work on the pool: elements [start, start+len) of unit
 * (a, b): gather: a = destination rank, range in the padded buffer;
 * scatter: a = owner rank, range in its shard; step: a = optimizer shard,
 * b = its first segment of a run of adjacent ones with one group and one
 * step count, range from that segment's start. Large units are cut in chunks so a
 * big shard uses every worker, not one. */
typedef struct {
  uv_work_t req;
  coll *c;
  size_t a, b;
  uint64_t start, len;
  double sumsq;
  shardd_err rc;
  int fabric; /* the collective's exchange, on a fabric thread */
  int bulk;   /* the whole collective through the backend's comm ops */
  /* > 1: this task's pool turn runs tasks [0, group) of its collective
   * one after the other (a small collective: one pool round trip, not
   * one per rank; coll.c's run_phase decides) */
  size_t group;
} task;

#define CHUNK_ELEMS ((uint64_t)1 << 18)
/* tasks a collective keeps in itself (a small buffer: one per rank) */
#define COLL_FEW_TASKS 4
/* a single-node gather's or scatter's (claimed) chunk */
#define COPY_CHUNK_ELEMS ((uint64_t)1 << 16)

enum { BULK_NONE, BULK_UP, BULK_FAILED };

/* The engine's state of one job: its queue, its backend communicator and
 * (multi-node) its fabric. */
typedef struct {
  shardd__coll_engine *e;
  shardd__job *job;
  coll *head;
  coll **tailp; /* the last one's next, or &head (NULL: not set yet) */
  uint32_t count;
  int quiet_due; /* count fell to 0 since job_quiet was last called */
  /* the backend communicator of the job (comm_create). Only pool threads
   * take the mutex (creation may block for seconds); the loop reads the
   * state atomically, so it never waits for a communicator. */
  pthread_mutex_t bulk_mu;
  void *bulk_comm;
  atomic_int bulk_state;
  coll_fab *fab; /* NULL on one node */
  /* ranks whose member was lost and has not joined again ([world], made
   * at the first loss; NULL before): since when (loop seconds, < 0 held),
   * the engine's epoch at the loss (members that joined before it were the
   * lost one's peers), and whether the loss was logged as failing others */
  double *lost_at;
  uint64_t *lost_epoch;
  uint8_t *lost_told;
  /* the ranks lost now (lost_at >= 0), nlost of [world], in no order: the
   * tick's doom check walks these for each waiting collective, not the
   * world (32 jobs of world 65536 with one rank lost and 32 barriers each
   * kept the loop 20% busy doing nothing); lost_pos[r] is rank r's place
   * there while it is lost, so a rank joining again leaves the list in
   * O(1) (a search from the front made relaunching 65536 ranks O(n^2)) */
  uint32_t *lost_ranks;
  uint32_t *lost_pos;
  uint32_t nlost;
  /* the latest loss noted: its loop time and epoch. Once every local rank
   * is lost it is the latest of theirs (a rank lost after it would be lost
   * too), so the tick's check of a multi-node job whose ranks all left
   * reads these, not its ranks (abandon_fabric) */
  double last_lost_at;
  uint64_t last_lost_epoch;
  /* a multi-node job: the latest lost_epoch of this node's ranks when its
   * fabric's work was last abandoned for their all being gone (0 never) */
  uint64_t fab_abandoned;
  /* a refusal every collective of the job depends on (a rank's initial
   * values differ: shardd__coll_job_break), SHARDD_OK none: each later
   * collective of a member that joined before it (the engine's epoch then)
   * is refused with it at once, until broken_rank joins again */
  shardd_err broken;
  uint32_t broken_rank;
  uint64_t broken_epoch;
  char broken_msg[384];
  /* loop seconds of the last submission to the job: ranks waiting in each
   * other's collectives count as stuck only after --peer-grace without
   * one (shardd__coll_tick) */
  double last_submit;
  /* collectives unlinked from the queue so far: a scheduling pass that
   * saw it unchanged across a start goes on from there instead of from
   * the head (shardd__coll_schedule) */
  uint64_t unlinked;
  /* per rank ([world], made at the first submit; NULL: out of memory, the
   * match then walks from the head): the oldest collective of the queue
   * that rank has not joined, NULL none. Every one before it the rank has
   * joined (arrived is never cleared), so matching starts there: a
   * bucket's entry k no longer walks past the k entries before it. */
  coll **unjoined;
} coll_job;

struct shardd__coll_engine {
  shardd__coll_config cfg;
  shardd__backend *be;
  int stopping;
  uint64_t epoch; /* counts joins and losses, to order them */
  shardd__map jobs; /* job address -> coll_job */
  /* between shardd__coll_batch_begin and _end: small collectives started
   * are listed here (by batch_next) and go to the pool together at the
   * end, a few pool turns for the lot instead of one each */
  int batching;
  coll *batch_head;
  size_t nbatch;
  /* the queue the batch's entries were admitted to, and its job: a
   * bucket's 64 entries look their job's queue up once, not each
   * (cleared at the batch's end and when that queue is freed) */
  const shardd__job *batch_job;
  coll_job *batch_cj;
  /* pool turns a collective's claimed tasks are spread over: the pool's
   * threads; and, when the loop claims too (a small collective), the CPUs,
   * as more turns would only preempt the loop */
  size_t workers, cpus;
  /* a big bucket within the loop's budget (coll_run.c's batch_split), of
   * gathers [0] or scatters [1]: the loop's nanoseconds per byte of it,
   * alone [.][0] and with pool turns beside it [.][1] (moving averages, 0
   * before the first), and the buckets since the slower way last ran */
  double split_ns[2][2];
  uint32_t split_since[2];
  /* bytes the loop thread may still copy for the request being submitted
   * (coll.c's loop_helps); 0 outside shardd__coll_submit and a batch */
  uint64_t help_left;
  /* collectives whose whole phase the loop thread ran (a small one of the
   * request being submitted, or one with nothing to run): their completion
   * is due later in this loop turn (coll_run.c's fin_check), not after a
   * pool round trip; oldest first, by fin_next. The two handles are open
   * only while some are listed (fin_state 1; 2 while closing, 0 closed),
   * so the engine leaves none open when idle. */
  coll *fin_head, **fin_tailp;
  uv_check_t fin_check; /* completes them after this turn's callbacks */
  uv_idle_t fin_spin;   /* keeps the poll from blocking meanwhile */
  int fin_state, fin_closing;
  /* > 0 while a bucket's entries are submitted (a batch) or a batch of
   * collectives completes: shardd__coll_schedule only notes the job
   * (sched_due) and one pass at the end starts what the many arrivals
   * or completions made ready, instead of a pass over the queue each */
  int sched_hold;
  coll_job *sched_due;
  shardd__coll_counters counters;
  /* monotonic seconds (uv_hrtime, not the tick's argument, which tests
   * drive by hand) of the last shardd__coll_tick, 0 before the first: a
   * gap far longer than the tick's period is the daemon's own stall */
  double last_tick;
  /* blocks of freed collectives kept for the next ones of the same size
   * (one job's world): a bucket makes and frees one collective per entry,
   * and a block of a few KiB is past malloc's per-thread cache: its malloc
   * and free were about 5% of the daemon's CPU outside the copies in a
   * bucket of 64 small gathers on 4 ranks. Linked through their first bytes; at
   * most COLL_SPARE_MAX, each of spare_size bytes (at most
   * COLL_SPARE_BYTES); freed with the engine. */
  void *spare;
  size_t nspare, spare_size;
  /* the helper thread beside the loop (coll_helper.c): made with the
   * engine when the process may run on more than one CPU; NULL otherwise
   * (or when it could not be made: pool turns then) */
  shardd__coll_helper *helper;
  /* bytes of the collectives the batch being submitted made (a bucket's
   * first rank: its entries wait for the others), for the helper's early
   * wake (coll_run.c) */
  uint64_t batch_new_bytes;
  int batch_new_kind; /* theirs: 0 gather, 1 scatter */
};

#define COLL_SPARE_MAX 128
#if defined(__SANITIZE_ADDRESS__)
/* none kept: AddressSanitizer then still sees a freed collective's use */
#define COLL_SPARE_BYTES ((size_t)0)
#else
#define COLL_SPARE_BYTES ((size_t)16 << 10)
#endif
#if defined(__SANITIZE_ADDRESS__)
#define COLL_MAP_BYTES SIZE_MAX /* AddressSanitizer sees allocations only */
#else
#define COLL_MAP_BYTES ((size_t)256 << 10)
#endif

/* coll.c: a block of bytes for a collective (a spare one when there is
 * one of that size); *zeroed says whether it is all zero already, else the
 * caller zeroes what it reads; NULL when out of memory; coll.c's coll_free
 * keeps it as a spare or frees it. A block of COLL_MAP_BYTES or more (a
 * world of thousands: 85 bytes a rank) is mapped fresh, so it costs the
 * pages of the ranks that arrive, not the world's: zeroing a world of
 * 65536's 5.5 MiB took 35 ms of the loop per collective, and one uid's
 * connections could hold 64 such collectives each. */
void *shardd__coll_block_get(shardd__coll_engine *e, size_t bytes, int *zeroed);

struct coll {
  coll *next;
  shardd__coll_engine *e;
  shardd__job *job;
  coll_job *cj;
  shardd__coll_args args;
  shardd__buffer *buf; /* gather / scatter */
  shardd__optim *opt;  /* step */
  waiter *waiters;     /* [world] */
  uint32_t arrived;
  /* the ranks that arrived, in order: the first `arrived` of [world] in
   * c's allocation. Walks over the waiters that matter (answers, frees,
   * status) read these, not the world: the waiters of a job of world
   * 65536 whose one rank left 32 barriers are 5 MB each never touched,
   * and walking them all faulted every page in (1024 such collectives
   * held the loop 20 s as their rank closed) */
  uint32_t *order;
  double deadline;
  int started;
  int phase; /* step: 0 norms, 1 updates */
  int step_begun; /* step: the step_begin hook was told (step_end is due) */
  int adding; /* scatter: args.accumulate and a live reduced gradient */
  size_t ntasks, left;
  task *tasks; /* few_tasks, or allocated when more */
  /* claimed tasks (run_claimed): the pool turns queued on the reqs of
   * tasks[0..turns), and maybe the loop thread, each run the next
   * unclaimed task until none is left; a turn the loop cancelled before a
   * thread took it ran none */
  int claiming;
  atomic_size_t claim;
  float grad_scale;
  double total_norm;
  uint64_t step;
  shardd__hp *hp; /* step: groups with any lr override applied */
  /* step: per optimizer ref, the count this step gives it, 0 when the step
   * skips it (frozen, or no gradient in its buffer's last scatter) */
  uint64_t *ref_step;
  shardd_err rc;
  /* set when a rank joined with other arguments: the collective never runs
   * and every rank, including those still to arrive, gets this error */
  shardd_err refused;
  /* refused because the ranks' buckets differ: every rank is answered as
   * it arrives, and the other entries of its bucket fail with it */
  int bucket_bad;
  /* multi-node: stage 0 local, 1 fabric, 2 local fan-out (gather, scatter);
   * step: 1 while the sum of squares crosses nodes */
  int stage;
  uint64_t name_key; /* fab_key of the kind and the target's name */
  uint32_t tag;      /* Gloo's, from name_key */
  const char *name;  /* the target's (it outlives c: the hold keeps it) */
  uint64_t fab_seq;  /* exchanges of this kind and target before this one */
  /* the job's fabric epoch when the collective was made (coll_fabric.c:
   * one made after the fabric failed may re-form it; one made before
   * fails with the failure, wherever it is then), and what this node's
   * state looked like at its exchange's submit when the fabric was not up
   * (fab_join_ok): compared at the (re)forming */
  uint64_t fab_epoch;
  int fab_join_ok;
  struct {
    uint64_t nbufs, bufs_digest, nopts, opts_digest, steps_min, steps_max;
  } fab_state;
  double sumsq_all;
  double *reduced; /* all_reduce: the result ([args.target], owned) */
  /* the exchange in flight: its task, its place in the job's fabric queue
   * and the handle that brings its end back to the loop */
  task *fab_task;
  coll *fab_next;
  uv_async_t fab_async;
  int fab_busy; /* the exchange is queued or running: its end not back yet */
  int bulk; /* this phase is one bulk task (decided once, in start_phase) */
  /* gather and scatter: each rank's side of the buffer, the gather's
   * destination or the scatter's gradients: its block's resident area, or
   * in a transient job the area it leased ([world], set at the start) */
  shardd__region **area_reg;
  size_t *area_off;
  uint8_t *took; /* transient gather: 1 gather lease taken, 2 gradient too */
  int areas_set; /* area_reg and area_off filled (set_areas ran); the three
                    arrays, like waiters, share c's allocation */
  int areas_busy; /* transient: set_areas succeeded (shardd__areas_busy) */
  /* gather: every local rank's area is the same one (the node's gathered
   * copy, host backend), filled once, from the first local rank's entry */
  int one_area;
  /* multi-node scatter: which views (the buffer's, in offset order, by id)
   * had a gradient on some rank of each node: [nodes][nmask + 1] flags,
   * the last one the whole buffer's; this node's row is set on the loop
   * thread before the exchange, the others' arrive with it */
  uint8_t *fab_mask;
  uint64_t *fab_mask_ids;
  size_t nmask;
  size_t alloc_bytes; /* of c's one block (submit_new), for its reuse */
  coll *batch_next; /* on the engine's batch list (small, started) */
  coll *fin_next;   /* on the engine's list of completions due (fin_head) */
  /* Last, and not zeroed when c is made (submit_new zeroes all before
   * them): 1.4 KiB of the 2.4 a bucket's entry zeroed for each of its
   * collectives, each read only after it is written (run_phase zeroes
   * the tasks it uses; the messages start empty) */
  task few_tasks[COLL_FEW_TASKS];
  /* refused's message (read only when refused is set) */
  char refused_msg[256];
  char fab_msg[384]; /* written by the fabric thread, read after it */
};

static inline int shardd__coll_multi(const coll *c) { return c->job->nodes > 1; }

/* acc (op) v for the scalar all_reduce, over local ranks (coll.c) and then
 * nodes (coll_fabric.c) alike: a NaN anywhere stays NaN, as in
 * torch.distributed. Sum, mean (divided by the caller) and any op outside
 * the wire's (the daemon's own, such as a checkpoint's) add. */
static inline double shardd__coll_combine(int op, double acc, double v) {
  if (op == SHARDD_REDUCE_MAX)
    return (v > acc || isnan(v)) && !isnan(acc) ? v : acc;
  if (op == SHARDD_REDUCE_MIN)
    return (v < acc || isnan(v)) && !isnan(acc) ? v : acc;
  return acc + v;
}

const char *shardd__coll_target_word(shardd__coll_kind k);

/* Jobs are kept by address: the engine's state of a job lives from its
 * first collective (or span) to shardd__coll_job_free, which the owner of
 * the job calls before every release, so an address is never reused while
 * its entry exists. */
static inline uint64_t shardd__coll_job_key(const shardd__job *job) {
  return (uint64_t)(uintptr_t)job;
}

/* Bytes up to which the loop thread claims a collective's tasks too, on a
 * backend whose memory it can touch: it is awake when the last rank
 * arrives, while a pool thread takes a wake-up (tens of microseconds on a
 * virtual machine, as long as copying a few hundred KiB) to start, and
 * the loop another to hear it ended. Bounded, as the loop serves every
 * other session meanwhile: about 0.2 ms of copying. */
#define LOOP_HELP_BYTES ((uint64_t)4 << 20)

/* coll.c: the loop's clock, in seconds. */
double shardd__coll_loop_now(const shardd__coll_engine *e);
/* coll.c: answers every rank still there with code/msg and forgets the
 * collective. */
void shardd__coll_finish(coll *c, shardd_err code, const char *msg);
/* coll.c: answers every rank of c still there with code/msg now and
 * forgets them, while c goes on (its exchange still runs for the other
 * nodes); how many were answered. */
uint32_t shardd__coll_answer_now(coll *c, shardd_err code, const char *msg);
/* coll.c: starts every collective of q whose ranks all arrived and that
 * no older one conflicts with. */
void shardd__coll_schedule(coll_job *q);
/* coll.c: holds scheduling (nests) / releases it, running the pass that
 * was due when the last hold ends; and runs a due pass now, held or not
 * (before anything that looks at which collectives started). */
void shardd__coll_sched_hold(shardd__coll_engine *e);
void shardd__coll_sched_release(shardd__coll_engine *e);
void shardd__coll_sched_flush(shardd__coll_engine *e);
/* coll.c: tells the owner of q's job its last collective ended; last in
 * each entry point. */
void shardd__coll_job_maybe_quiet(coll_job *q);

/* coll_phase.c: starts c's next phase (its first: c just started). */
void shardd__coll_start_phase(coll *c);
/* coll_phase.c: what a rank hears of c failing in its cross-node exchange
 * for why. */
void shardd__coll_fabric_failure(const coll *c, const char *why, char *msg,
                                 size_t len);

/* coll_run.c: runs the tasks of c's phase (the pool, the loop, a batch). */
void shardd__coll_run_phase(coll *c);

/* coll_members.c: the missing rank that dooms unstarted c at now, or -1. */
int64_t shardd__coll_doomed_by(const coll *c, double now);
/* coll_members.c: fails c for rank r, missing past the grace at now. */
void shardd__coll_fail_doomed_one(coll *c, uint32_t r, double now);

/* coll.c: the engine's state of job (created when create and missing;
 * NULL when out of memory or, without create, missing). */
coll_job *shardd__coll_job_of(shardd__coll_engine *e, shardd__job *job,
                              int create);
/* coll_phase.c: this node's row of c->fab_mask (multi-node scatter), on the
 * loop thread before the exchange; SHARDD_E_NO_MEMORY leaves it NULL. */
shardd_err shardd__coll_mask_row(coll *c);
/* coll_phase.c: a task of c ended (pool or fabric thread done); loop
 * thread. */
void shardd__coll_task_done(uv_work_t *req, int status);

/* coll_work.c */
size_t shardd__coll_plan(coll *c, task *out); /* out NULL: count only */
void shardd__coll_work(uv_work_t *req);       /* a pool thread runs a task */
/* runs c's unclaimed tasks until none is left (c->claiming); any thread */
void shardd__coll_claim_run(coll *c);
void shardd__coll_gather_unit(coll *c, task *t);
void shardd__coll_scatter_unit(coll *c, task *t);

/* coll_bulk.c */
int shardd__coll_bulk_ok(const coll *c);
void shardd__coll_bulk_task(coll *c, task *t);
void shardd__coll_bulk_free(coll_job *cj);

/* coll_exchange.c: the exchange of c on fabric f (a fabric thread): header,
 * check, data. A failure that leaves f unusable is t->rc with *lost set. */
void shardd__coll_fab_exchange(coll *c, task *t, shardd__fabric *f, int *lost);

/* coll_join.c: c->fab_state, this node's state summed for the join; loop
 * thread (c->fab_join_ok says whether it could be listed). */
void shardd__coll_fab_state_of(coll *c);
/* coll_join.c: the join of new fabric f (jf's, for c): the nodes' lineage
 * (this node's: lineage, 0 none) and states compared; *out the lineage
 * they agreed on. */
shardd_err shardd__coll_fab_join(coll_fab *jf, const coll *c, shardd__fabric *f,
                                 uint64_t lineage, int rejoining, uint64_t *out,
                                 char *err, size_t errlen);

/* coll_fabric.c */
uint64_t shardd__coll_fab_key(shardd__coll_kind kind, const char *name);
uint32_t shardd__coll_fab_tag(uint64_t key);
/* Queues c's exchange (task t) for the job's fabric threads; its end
 * always comes back through c->fab_async, failures too. */
void shardd__coll_fab_submit(coll *c, task *t);
void shardd__coll_fab_free(shardd__coll_engine *e, coll_fab *jf);
/* The fabric's epoch now (+1 at each failure); any thread. */
uint64_t shardd__coll_fab_epoch(coll_fab *jf);
/* The daemon is stopping: aborts the job's fabric, so every exchange queued
 * or running ends at once with SHARDD_E_SHUTDOWN naming why (copied), and
 * every later one too; then waits (loop thread, up to max_s) until no
 * fabric thread is inside an exchange. 1 when none is: every busy
 * exchange's task rc and fab_msg are final (their ends still come back
 * through fab_async); 0 when one still runs. */
int shardd__coll_fab_abort(coll_fab *jf, const char *why, double max_s);
/* Every rank of this node left the job (coll.c's tick, past --peer-grace):
 * what the job's fabric is doing -- an exchange, a (re-)forming's
 * rendezvous -- is abandoned, ending with SHARDD_E_PEER_LOST naming why
 * (copied), its collectives' ends coming back through fab_async as
 * always; returns at once (loop thread), the fabric threads leaving on
 * their own. Exchanges made later re-form the fabric as after any
 * failure (one queued before the threads left is abandoned with the
 * rest). 1 when there was something to abandon, 0 when nothing was in
 * flight. */
int shardd__coll_fab_cancel(coll_fab *jf, const char *why);

/* coll_helper.c: the helper thread (see there). An item it runs: run is
 * called once on the helper's thread and returns 1 when the item must come
 * back to the loop thread, where back_fn is then called (after
 * shardd__coll_helper_expect named it, before it could be handed back). */
typedef struct shardd__coll_help {
  int (*run)(struct shardd__coll_help *w);
  void (*back_fn)(struct shardd__coll_help *w);
  struct shardd__coll_help *next;
  struct helper_back *back; /* where its end comes back, or NULL */
} shardd__coll_help;

/* Starts the thread (asleep); SHARDD_E_NO_MEMORY when it cannot be. */
shardd_err shardd__coll_helper_start(uv_loop_t *loop, shardd__coll_helper **out);
/* Stops and joins it; NULL is fine. Loop thread, with nothing posted and
 * no item out (the loop drained every end first). */
void shardd__coll_helper_stop(shardd__coll_helper *h);
/* Wakes it to spin for work to come (a big bucket's first request); and
 * tells it the work it was woken for is over (the loop ran it): it sleeps
 * at once instead of spinning on (NULL is fine for both). */
void shardd__coll_helper_ready(shardd__coll_helper *h);
void shardd__coll_helper_rest(shardd__coll_helper *h);
/* Posts w (one at a time; its back NULL, or set by _expect) and wakes
 * the helper; 0 when h is NULL. */
int shardd__coll_helper_post(shardd__coll_helper *h, shardd__coll_help *w);
/* Takes posted w back if the helper has not taken it: 1 then (it never
 * runs), 0 when the helper has it. */
int shardd__coll_helper_take_back(shardd__coll_helper *h, shardd__coll_help *w);
/* Loop thread: w's end may come back (its run may return 1): opens the
 * async handle it comes through if none is open; and the converse, when
 * it will not after all (the loop ended it itself). */
shardd_err shardd__coll_helper_expect(shardd__coll_helper *h, shardd__coll_help *w);
void shardd__coll_helper_unexpect(shardd__coll_helper *h, shardd__coll_help *w);
/* Items the helper ran so far (tests). */
unsigned long shardd__coll_helper_runs(const shardd__coll_helper *h);

#endif /* SHARDD_COLL_INT_H */
