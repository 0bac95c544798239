/* coll_run.c — running a phase's tasks: on libuv's pool, by the loop
 * thread for a small collective on host memory, and small collectives
 * handed to the pool together in batches. */
#include "coll_int.h"

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
 * every turn has ended. */
#define BATCH_TURNS 4

static void batch_start(shardd__coll_engine *e);

typedef struct {
  uv_work_t turns[BATCH_TURNS];
  size_t nturns, left, n;
  atomic_size_t claim;
  coll *colls[]; /* [n], in start order */
} coll_batch;

static void batch_run(coll_batch *b) {
  size_t i;
  while ((i = atomic_fetch_add_explicit(&b->claim, 1, memory_order_relaxed)) < b->n)
    shardd__coll_work(&b->colls[i]->tasks[0].req);
}

static void batch_work(uv_work_t *req) { batch_run(req->data); }

static void batch_done(uv_work_t *req, int status) {
  coll_batch *b = req->data;
  (void)status; /* no turn is cancelled: each ran, maybe finding none left */
  if (--b->left > 0)
    return;
  /* each completion may free its coll: b is the list; what they make
   * ready starts in one scheduling pass after the lot */
  shardd__coll_engine *e = b->colls[0]->e;
  shardd__coll_sched_hold(e);
  for (size_t i = 0; i < b->n; i++)
    shardd__coll_task_done(&b->colls[i]->tasks[0].req, 0);
  free(b);
  shardd__coll_sched_release(e);
}

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
  batch_start(e);
  e->help_left = 0;
}

/* Starts the small collectives listed while batching (their request's
 * budget still set): on the loop alone when their bytes fit what the loop
 * may still copy for the request, else spread over pool turns. Not both:
 * on a small machine the wake-up of a pool turn took the loop thread off
 * its CPU for longer (80-170 us on a 2-vCPU VM, where the turn's thread
 * preempts it) than the loop needs for a whole bucket of 64 x 16 KiB on 4
 * ranks (4 MiB over the ranks, about 60 us of copies or reductions), and
 * a turn that started late found nothing left to claim. */
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
  if (loop_helps(e, total)) {
    /* the loop runs them all, in start order (the list, newest first,
     * reversed), and no pool turn is queued: they complete on this loop
     * turn (fin_defer) */
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
    return;
  }
  coll_batch *b = malloc(sizeof *b + n * sizeof(coll *));
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
  b->nturns = n < BATCH_TURNS ? n : BATCH_TURNS;
  if (b->nturns > e->cpus)
    b->nturns = e->cpus;
  b->left = b->nturns;
  for (size_t k = 0; k < b->nturns; k++) {
    b->turns[k].data = b;
    /* fails only without a work callback (UV_EINVAL) */
    (void)uv_queue_work(e->cfg.loop, &b->turns[k], batch_work, batch_done);
  }
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
