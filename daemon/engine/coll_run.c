/* coll_run.c — running a phase's tasks: on libuv's pool, by the loop
 * thread for a small collective on host memory, and small collectives
 * handed to the pool together in batches. */
#include "coll_int.h"

#include <sched.h>
#include <stdlib.h>
#include <string.h>

/* Bytes a collective may move and still run as one pool task: below it
 * the per-task cost (a pool wake-up and a loop wake-up each) outweighs
 * spreading the copies over the workers. */
#define SMALL_COLL_BYTES ((uint64_t)256 << 10)

/* The bytes c's gather or scatter moves over all its ranks; 0 otherwise. */
static uint64_t coll_bytes(const coll *c) {
  if (c->buf == NULL || shardd__coll_multi(c) || c->bulk ||
      (c->args.kind != SHARDD__COLL_GATHER && c->args.kind != SHARDD__COLL_SCATTER))
    return 0;
  return c->buf->padded_numel * shardd_dtype_size(c->buf->dtype) *
         (c->one_area ? 1 : c->job->world);
}

/* Whether c is a single-node gather or scatter of a small buffer (every
 * rank's side of it together under SMALL_COLL_BYTES). */
static int small_coll(const coll *c) {
  uint64_t bytes = coll_bytes(c);
  return bytes > 0 && bytes <= SMALL_COLL_BYTES;
}

/* Whether the loop thread claims tasks of a collective of bytes, taking
 * them from its budget: LOOP_HELP_BYTES for the request being submitted
 * (the last rank's arrival starts the collective), over every collective
 * it starts, a bucket's entries included (64 entries of 4 MiB would
 * otherwise copy hundreds of MiB there while every other session waits).
 * Collectives started by another's completion get none: the pool runs
 * them, as their ranks are not the ones waiting on this callback. */
static int loop_helps(shardd__coll_engine *e, uint64_t bytes) {
  if (!(e->be->caps & SHARDD__BACKEND_CAP_HOST_MAPPED) || bytes == 0 ||
      bytes > e->help_left)
    return 0;
  e->help_left -= bytes;
  return 1;
}

/* ---- completion on the loop's own turn ------------------------------- */

/* A collective whose whole phase the loop thread ran, or that had nothing
 * to run, completes after the callback that started it returns, in the
 * check phase of this very loop turn: no pool turn is queued for it (a
 * futex wake of a worker) and no cancelled turn's end comes back through
 * libuv's async (an eventfd write and read, one more poll). Never inside
 * shardd__coll_schedule() still: completion may free c and release the
 * job. Started from a check or closing callback (the server's fair turns
 * submit from one), the check handle runs on the next turn, and the idle
 * handle keeps that turn's poll from waiting for other I/O meanwhile. */

static void fin_open(shardd__coll_engine *e);

static void fin_spin(uv_idle_t *h) { (void)h; }

static void fin_closed(uv_handle_t *h) {
  shardd__coll_engine *e = h->data;
  if (--e->fin_closing > 0)
    return;
  e->fin_state = 0;
  if (e->fin_head != NULL) /* listed while the handles closed */
    fin_open(e);
}

static void fin_run(uv_check_t *h) {
  shardd__coll_engine *e = h->data;
  /* a completion may start and list others (the job's next ones): they
   * complete here too, in the order they were listed */
  coll *c;
  do {
    /* one scheduling pass after the lot, not one per completion */
    shardd__coll_sched_hold(e);
    while ((c = e->fin_head) != NULL) {
      if ((e->fin_head = c->fin_next) == NULL)
        e->fin_tailp = &e->fin_head;
      shardd__coll_task_done(&c->tasks[0].req, 0);
    }
    shardd__coll_sched_release(e);
  } while (e->fin_head != NULL);
  /* closed when idle, so a stopped engine leaves no handle open */
  e->fin_state = 2;
  e->fin_closing = 2;
  uv_close((uv_handle_t *)&e->fin_check, fin_closed);
  uv_close((uv_handle_t *)&e->fin_spin, fin_closed);
}

static void fin_open(shardd__coll_engine *e) {
  uv_check_init(e->cfg.loop, &e->fin_check);
  uv_idle_init(e->cfg.loop, &e->fin_spin);
  e->fin_check.data = e->fin_spin.data = e;
  uv_check_start(&e->fin_check, fin_run);
  uv_idle_start(&e->fin_spin, fin_spin);
  e->fin_state = 1;
}

/* Lists c (its phase run, or empty) for completion on this loop turn. */
static void fin_defer(coll *c) {
  shardd__coll_engine *e = c->e;
  c->left = 1;
  c->fin_next = NULL;
  *e->fin_tailp = c;
  e->fin_tailp = &c->fin_next;
  if (e->fin_state == 0)
    fin_open(e);
}

/* Starts c's tasks as claims: `turns` pool turns (queued on the reqs of
 * tasks[0..turns)) each run the next unclaimed task until none is left,
 * and so does the loop thread first when help is set; the turns no pool
 * thread had started by then are cancelled (their after-work callback
 * comes on the next loop turn, UV_ECANCELED). With help and no turns the
 * loop runs them all and c completes through fin_defer. Completion is
 * never inside shardd__coll_schedule(). */
static void run_claimed(coll *c, size_t turns, int help) {
  c->claiming = 1;
  atomic_store(&c->claim, 0);
  if (help && turns == 0) {
    /* the loop runs it whole: no pool turn, completion this loop turn */
    shardd__coll_claim_run(c);
    fin_defer(c);
    return;
  }
  c->left = turns;
  for (size_t i = 0; i < turns; i++)
    /* fails only without a work callback (UV_EINVAL) */
    (void)uv_queue_work(c->e->cfg.loop, &c->tasks[i].req, shardd__coll_work,
                        shardd__coll_task_done);
  if (!help)
    return;
  shardd__coll_claim_run(c);
  /* UV_EBUSY for a turn a pool thread took: it finds no task left */
  for (size_t i = 0; i < turns; i++)
    (void)uv_cancel((uv_req_t *)&c->tasks[i].req);
}

/* A bucket's small collectives, started together (shardd__coll_batch_end):
 * like one collective's claimed tasks, each turn runs the next unclaimed
 * collective's tasks until none is left; the collectives complete when
 * every turn has ended, or, when the loop claims beside the turns, as soon
 * as every collective's work has (batch_start). */
#define BATCH_TURNS 4

/* Bytes (a bucket's, over its ranks) from which the loop thread, when the
 * bucket fits its budget, may queue pool turns beside itself: a turn
 * started 16-56 us after it was queued on a 2-vCPU VM, and queueing and
 * cancelling it cost the loop 10-25 us, while the loop alone copies or
 * sums a bucket's MiB in 45-70 us; at 2 MiB (64 x 16 KiB on 2 ranks) the
 * turn made the bucket slower (coll_bench, alternating pairs), at 4 MiB
 * the loop's part took 97-106 us against 176-199 us alone when the turn
 * found the other vCPU free (under load it does not pay: batch_split). */
#define BATCH_SPLIT_BYTES ((uint64_t)3 << 20)
/* How long the loop waits, after claiming the last collective, for a turn
 * still running one it claimed (at most 256 KiB, 64 KiB in a bucket of 64
 * x 16 KiB on 4 ranks: 2-4 us) rather than hear of it through the pool's
 * wake-up of the loop; past that (the turn's thread preempted) the turns'
 * ends complete them. */
#define BATCH_WAIT_NS ((uint64_t)20 * 1000)
/* Of the buckets that may split, every this many runs the way that was
 * slower lately, so each way's time stays current (batch_split). */
#define BATCH_RETRY 64u

static void batch_start(shardd__coll_engine *e);

typedef struct {
  uv_work_t turns[BATCH_TURNS];
  /* the helper thread's turn (coll_helper.c), when it was posted */
  shardd__coll_help help;
  size_t nturns, n;
  atomic_size_t claim;
  /* collectives whose work has ended, whichever thread ran it (release:
   * their bytes are written before the loop reads the count) */
  atomic_size_t done;
  /* beside the loop: the CPU the loop ran on when it queued the turns (a
   * turn woken there returns at once: it would only take turns with the
   * loop on one CPU), and whether the loop completed every collective
   * itself (the turns' ends then only free b); -1 and 0 otherwise */
  int loop_cpu;
  int completed;
  /* what still holds b, counted on the loop thread: each pool turn until
   * its end came back, the loop while it works beside them, the helper's
   * turn until the loop knows it ended. The last one frees b, completing
   * its collectives first unless the loop already did. */
  size_t refs;
  /* the helper's turn: H_RUNNING while posted or run, H_DONE once it
   * ended (its last touch of b), H_WAITING when the loop stopped waiting
   * for it first (its end then comes back through the helper's handle) */
  atomic_int hstate;
  int helped; /* the helper took its turn (the loop did not take it back) */
  coll *colls[]; /* [n], in start order */
} coll_batch;

enum { H_RUNNING, H_WAITING, H_DONE };

/* Runs the next unclaimed collectives until none is left. */
static void batch_run(coll_batch *b) {
  size_t i;
  while ((i = atomic_fetch_add_explicit(&b->claim, 1, memory_order_relaxed)) <
         b->n) {
    shardd__coll_work(&b->colls[i]->tasks[0].req);
    atomic_fetch_add_explicit(&b->done, 1, memory_order_release);
  }
}

static void batch_work(uv_work_t *req) {
  coll_batch *b = req->data;
  if (b->loop_cpu >= 0 && sched_getcpu() == b->loop_cpu)
    return;
  batch_run(b);
}

/* Drops one of b's references (loop thread); the last completes b's
 * collectives unless the loop did, and frees b. */
static void batch_drop(coll_batch *b) {
  if (--b->refs > 0)
    return;
  if (b->completed) {
    free(b);
    return;
  }
  /* each completion may free its coll: b is the list; what they make
   * ready starts in one scheduling pass after the lot */
  shardd__coll_engine *e = b->colls[0]->e;
  shardd__coll_sched_hold(e);
  for (size_t i = 0; i < b->n; i++)
    shardd__coll_task_done(&b->colls[i]->tasks[0].req, 0);
  free(b);
  shardd__coll_sched_release(e);
}

static void batch_done(uv_work_t *req, int status) {
  /* a turn the loop cancelled (UV_ECANCELED) ran none; any other ran,
   * maybe finding none left */
  (void)status;
  batch_drop(req->data);
}

static coll_batch *batch_of_help(shardd__coll_help *w) {
  return (coll_batch *)(void *)((char *)w - offsetof(coll_batch, help));
}

/* The helper's turn (its thread): like a pool turn's; then it tells the
 * loop it ended, unless the loop stopped waiting first: 1 then, and
 * helper_back runs on the loop. */
static int helper_run(shardd__coll_help *w) {
  coll_batch *b = batch_of_help(w);
  if (!(b->loop_cpu >= 0 && sched_getcpu() == b->loop_cpu))
    batch_run(b);
  int running = H_RUNNING;
  /* after this b may be freed by the loop */
  return !atomic_compare_exchange_strong(&b->hstate, &running, H_DONE);
}

static void helper_back(shardd__coll_help *w) { batch_drop(batch_of_help(w)); }

static int split_wanted(const shardd__coll_engine *e, int k);

void shardd__coll_batch_begin(shardd__coll_engine *e) {
  if (e->batching++ > 0)
    return;
  e->help_left = LOOP_HELP_BYTES; /* the bucket's request's budget */
  /* the entries' arrivals start what they complete in one pass, at the
   * end (each would otherwise walk the queue again) */
  shardd__coll_sched_hold(e);
}

void shardd__coll_batch_end(shardd__coll_engine *e) {
  if (e->batching == 0)
    return;
  if (e->batching == 1) /* still batching: its small ones join the batch */
    shardd__coll_sched_release(e);
  if (--e->batching > 0)
    return;
  e->batch_job = NULL;
  e->batch_cj = NULL;
  uint64_t made = e->batch_new_bytes;
  e->batch_new_bytes = 0;
  batch_start(e);
  e->help_left = 0;
  /* A bucket's first rank made its entries, which wait for the others:
   * when it is one the helper will split with the loop, wake the helper
   * now, so it is running when the last rank's request comes (a sleeping
   * thread took 16-56 us to start, a third of the bucket's work) */
  if (e->helper != NULL && made >= BATCH_SPLIT_BYTES &&
      made <= LOOP_HELP_BYTES && e->cpus > 1 &&
      split_wanted(e, e->batch_new_kind))
    shardd__coll_helper_ready(e->helper);
}

/* Whether a bucket of total bytes in n collectives, which fits the loop's
 * budget, may get pool turns beside the loop: big enough, and a CPU to
 * spare. */
static int batch_may_split(const shardd__coll_engine *e, uint64_t total,
                           size_t n) {
  return total >= BATCH_SPLIT_BYTES && e->cpus > 1 && n > 1;
}

/* Whether such a bucket, of kind k (0 gather, 1 scatter: their bytes
 * cost differently), gets them: whichever way (the loop alone, or with
 * turns) took the loop less time per byte lately, and the other every
 * BATCH_RETRY buckets; each way once first. A turn helps only when its
 * thread finds a CPU idle: on a machine busy with other work it wakes on
 * the loop's CPU (and returns at once, batch_work) or late, and the loop
 * is better off alone. */
static int batch_split(shardd__coll_engine *e, int k) {
  double *ns = e->split_ns[k];
  if (ns[1] == 0)
    return 1;
  if (ns[0] == 0)
    return 0;
  /* turns beside the loop cost CPU time of their own (the wake-up, the
   * pool's lock): they must take the loop a tenth less time to be chosen */
  int best = ns[1] < 0.9 * ns[0];
  if (++e->split_since[k] >= BATCH_RETRY) {
    e->split_since[k] = 0;
    return !best;
  }
  return best;
}

/* What batch_split would answer next for kind k, without counting a
 * bucket (the helper's early wake asks before the bucket is complete). */
static int split_wanted(const shardd__coll_engine *e, int k) {
  const double *ns = e->split_ns[k];
  if (ns[1] == 0)
    return 1;
  if (ns[0] == 0)
    return 0;
  return (ns[1] < 0.9 * ns[0]) != (e->split_since[k] + 1 >= BATCH_RETRY);
}

/* Notes the loop's time for a bucket of kind k and bytes run one way
 * (split: with turns beside it): a moving average of its nanoseconds per
 * byte. */
static void batch_timed(shardd__coll_engine *e, int k, int split, uint64_t ns,
                        uint64_t bytes) {
  double v = (double)ns / (double)bytes, *avg = &e->split_ns[k][split];
  *avg = *avg == 0 ? v : *avg + (v - *avg) / 4;
}

/* The loop's side of a split bucket b of kind and bytes, its turns queued
 * (or posted to the helper) at t0: it claims collectives beside the turns,
 * waits briefly for those a turn still runs, and completes them all on
 * this loop turn when they ended (else the last turn's end does). */
static void batch_beside(shardd__coll_engine *e, coll_batch *b, int kind,
                         uint64_t t0, uint64_t bytes) {
  batch_run(b);
  /* UV_EBUSY for a turn a pool thread took: it finds none left, or ends
   * the one it claimed */
  for (size_t k = 0; k < b->nturns; k++)
    (void)uv_cancel((uv_req_t *)&b->turns[k]);
  if (b->helped && shardd__coll_helper_take_back(e->helper, &b->help)) {
    b->helped = 0; /* never taken: it runs nothing */
    b->refs--;
    shardd__coll_helper_rest(e->helper); /* nor spins on for it */
  }
  size_t n = b->n;
  if (atomic_load_explicit(&b->done, memory_order_acquire) < n) {
    uint64_t until = uv_hrtime() + BATCH_WAIT_NS;
    while (atomic_load_explicit(&b->done, memory_order_acquire) < n &&
           uv_hrtime() < until)
      ;
  }
  e->counters.split++;
  batch_timed(e, kind, 1, uv_hrtime() - t0, bytes);
  if (b->helped) {
    /* the helper's end: known now (H_DONE), or it comes back through its
     * handle, named before the helper can hand it back */
    int running = H_RUNNING;
    int expect = shardd__coll_helper_expect(e->helper, &b->help) == SHARDD_OK;
    if (expect &&
        atomic_compare_exchange_strong(&b->hstate, &running, H_WAITING)) {
      /* helper_back drops its reference */
    } else {
      if (expect)
        shardd__coll_helper_unexpect(e->helper, &b->help);
      /* ended, or (out of memory) about to: its work is a few KiB */
      while (atomic_load(&b->hstate) != H_DONE)
        sched_yield();
      b->refs--;
    }
  }
  if (atomic_load_explicit(&b->done, memory_order_acquire) == n) {
    b->completed = 1;
    for (size_t i = 0; i < n; i++)
      fin_defer(b->colls[i]);
  }
  /* not the last while a turn still runs one: the last one's end
   * completes them (batch_drop), never inside this call */
  batch_drop(b);
}

/* Starts the small collectives listed while batching (their request's
 * budget still set). When their bytes fit what the loop may still copy
 * for the request, the loop runs them: alone for a small bucket (queueing
 * a pool turn took the loop off its CPU for longer, 80-170 us on a 2-vCPU
 * VM where the turn's thread preempted it, than a bucket of 64 x 16 KiB
 * on 4 ranks needs), and for a big one (BATCH_SPLIT_BYTES) with pool turns
 * beside it on the other CPUs, each claiming the next collective, so
 * whichever thread is awake works. Over the budget, spread over pool
 * turns alone. */
static void batch_start(shardd__coll_engine *e) {
  if (e->batch_head == NULL)
    return;
  size_t n = e->nbatch;
  coll *list = e->batch_head;
  e->batch_head = NULL;
  e->nbatch = 0;
  uint64_t total = 0;
  for (coll *c = list; c; c = c->batch_next)
    total += coll_bytes(c);
  int help = loop_helps(e, total);
  int may = help && batch_may_split(e, total, n);
  /* the kind of the bucket's bytes (its first collective's: a bucket's
   * entries are of one kind; only the timing it is noted under depends
   * on it) */
  int kind = list->args.kind == SHARDD__COLL_SCATTER;
  coll_batch *b = NULL;
  if (!help || (may && batch_split(e, kind)))
    b = malloc(sizeof *b + n * sizeof(coll *));
  if (help && b == NULL) {
    /* the loop runs them all, in start order (the list, newest first,
     * reversed), and no pool turn is queued: they complete on this loop
     * turn (fin_defer) */
    uint64_t t0 = may ? uv_hrtime() : 0;
    coll *first = NULL;
    while (list) {
      coll *next = list->batch_next;
      list->batch_next = first;
      first = list;
      list = next;
    }
    for (coll *c = first; c; c = c->batch_next) {
      shardd__coll_work(&c->tasks[0].req);
      fin_defer(c);
    }
    if (may) {
      batch_timed(e, kind, 0, uv_hrtime() - t0, total);
      shardd__coll_helper_rest(e->helper); /* woken for it: not needed */
    }
    return;
  }
  if (b == NULL) {
    /* out of memory: each alone, its tasks grouped on tasks[0] */
    for (coll *c = list; c; c = c->batch_next)
      (void)uv_queue_work(e->cfg.loop, &c->tasks[0].req, shardd__coll_work,
                          shardd__coll_task_done);
    return;
  }
  /* in start order (the list is newest first) */
  size_t i = n;
  for (coll *c = list; c; c = c->batch_next)
    b->colls[--i] = c;
  b->n = n;
  atomic_init(&b->claim, 0);
  atomic_init(&b->done, 0);
  atomic_init(&b->hstate, H_RUNNING);
  b->completed = 0;
  b->loop_cpu = help ? sched_getcpu() : -1;
  /* beside the loop: one turn fewer than the CPUs (the loop has one),
   * the helper's first when there is one */
  size_t most = help ? e->cpus - 1 : e->cpus;
  if (help && most > n - 1)
    most = n - 1;
  uint64_t t0 = help ? uv_hrtime() : 0;
  b->helped = 0;
  if (help && most > 0) {
    b->help.run = helper_run;
    b->help.back_fn = helper_back;
    b->help.back = NULL;
    b->helped = shardd__coll_helper_post(e->helper, &b->help);
    most -= (size_t)b->helped;
  }
  b->nturns = n < BATCH_TURNS ? n : BATCH_TURNS;
  if (b->nturns > most)
    b->nturns = most;
  b->refs = b->nturns + (size_t)b->helped + (help ? 1 : 0);
  for (size_t k = 0; k < b->nturns; k++) {
    b->turns[k].data = b;
    /* fails only without a work callback (UV_EINVAL) */
    (void)uv_queue_work(e->cfg.loop, &b->turns[k], batch_work, batch_done);
  }
  if (help)
    batch_beside(e, b, kind, t0, total);
}

/* Plans c's phase and starts its tasks (on the pool, or the exchange on a
 * fabric thread). */
void shardd__coll_run_phase(coll *c) {
  /* before the first update touches a byte: a crash from here on may
   * leave the step half applied, and whoever listens records that */
  if (c->args.kind == SHARDD__COLL_STEP && c->phase == 1 && !c->step_begun &&
      c->refused == SHARDD_OK && c->e->cfg.hooks.step_begin) {
    c->step_begun = 1;
    c->e->cfg.hooks.step_begin(c->e->cfg.hooks.ctx, c->job, c->opt, c->step);
  }
  c->bulk = c->args.kind != SHARDD__COLL_STEP && c->refused == SHARDD_OK &&
            shardd__coll_bulk_ok(c);
  c->claiming = 0;
  int planned = c->args.kind != SHARDD__COLL_ALL_REDUCE || shardd__coll_multi(c);
  size_t n = planned ? shardd__coll_plan(c, NULL) : 0;
  if (c->tasks != c->few_tasks)
    free(c->tasks);
  /* a small buffer's few tasks live in c: a bucket's entries are many
   * small collectives, and an allocation each was a cost of its own */
  if (n <= COLL_FEW_TASKS) {
    /* the ones it uses (one when none: tasks[0] completes it) */
    memset(c->few_tasks, 0, (n ? n : 1) * sizeof *c->few_tasks);
    c->tasks = c->few_tasks;
  } else {
    c->tasks = calloc(n, sizeof *c->tasks);
  }
  if (c->tasks == NULL) {
    coll_job *q = c->cj;
    shardd__coll_finish(c, SHARDD_E_NO_MEMORY,
                        "out of memory starting a collective");
    shardd__coll_schedule(q);
    return;
  }
  if (planned)
    shardd__coll_plan(c, c->tasks);
  c->ntasks = n;
  c->left = n;
  if (n == 0) {
    /* Nothing to run (a wholly frozen scatter, an all_reduce): it completes
     * later in this loop turn (fin_defer), never inside
     * shardd__coll_schedule(), as completion may free c and release the
     * job. */
    c->tasks[0].c = c;
    c->tasks[0].req.data = &c->tasks[0];
    fin_defer(c);
    return;
  }
  for (size_t i = 0; i < n; i++) {
    c->tasks[i].c = c;
    c->tasks[i].req.data = &c->tasks[i];
  }
  if (small_coll(c) && c->e->batching) {
    /* a bucket's entry: it runs with the bucket's other small collectives
     * (shardd__coll_batch_end), its tasks grouped on tasks[0] */
    c->left = 1;
    c->tasks[0].group = n;
    c->batch_next = c->e->batch_head;
    c->e->batch_head = c;
    c->e->nbatch++;
    return;
  }
  if (!shardd__coll_multi(c) && !c->bulk) {
    /* a small buffer: the loop alone when it helps (any pool turn costs
     * a worker's wake-up and the loop's, more than its copies), else one
     * claiming turn; a larger one: a turn per worker */
    int help = loop_helps(c->e, coll_bytes(c));
    size_t turns = small_coll(c) ? (help ? 0 : 1)
                   : help        ? c->e->cpus
                                 : c->e->workers;
    run_claimed(c, n < turns ? n : turns, help);
    return;
  }
  for (size_t i = 0; i < n; i++) {
    task *t = &c->tasks[i];
    if (t->fabric) {
      shardd__coll_fab_submit(c, t);
      continue;
    }
    if (uv_queue_work(c->e->cfg.loop, &t->req, shardd__coll_work,
                      shardd__coll_task_done) != 0) {
      /* cannot happen for a valid loop; run inline then */
      shardd__coll_work(&t->req);
      shardd__coll_task_done(&t->req, 0);
    }
  }
}
