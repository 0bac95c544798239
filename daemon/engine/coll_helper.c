/* coll_helper.c — the engine's helper thread: one thread of its own that
 * works beside the loop thread on a big bucket (coll_run.c's split).
 *
 * Why not libuv's pool: a pool turn is a futex wake of a sleeping worker
 * when the work is queued, 16-56 us on a 2-vCPU VM before it runs, and an
 * async wake-up of the loop when it ends; a bucket of 64 x 16 KiB on 4
 * ranks is 60-120 us of summing, so the turn often started after the loop
 * had done most of it. The helper is woken earlier instead: when the first
 * rank's request of a big bucket arrives (shardd__coll_helper_ready), and
 * it then spins (yielding its CPU to any runnable thread) for up to
 * HELPER_SPIN_NS waiting for the bucket, which the loop posts when the
 * last rank's request completes it: the helper is running by then, and
 * takes the work within a microsecond. Its end needs no wake-up of the
 * loop when the loop finished the bucket itself (the helper only drops
 * its reference); only when the loop gave up waiting for it (the helper
 * was preempted) does the item come back through an async handle, opened
 * for that and closed once nothing is out, so an idle engine keeps no
 * handle open. Ownership: the engine owns the helper (e->helper); a
 * posted item stays its poster's, and the helper calls its run once. */
#include "coll_int.h"

#include <errno.h>
#include <linux/futex.h>
#include <sched.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

/* How long the helper looks for work after a wake before it sleeps
 * again: the ranks of one bucket send it within
 * tens of microseconds of each other when they run in step; past that
 * the wait costs a CPU that others may want (it yields each turn). */
#define HELPER_SPIN_NS ((uint64_t)300 * 1000)

/* An async handle the loop opened while items are out whose end must come
 * back to it; closed (and freed) when its last one has. */
typedef struct helper_back {
  uv_async_t async;
  pthread_mutex_t mu;
  shardd__coll_help *head; /* handed back, not yet taken by the loop */
  size_t out;              /* items whose end comes here (loop thread) */
  shardd__coll_helper *h;
} helper_back;

struct shardd__coll_helper {
  pthread_t th;
  uv_loop_t *loop;
  _Atomic(shardd__coll_help *) slot; /* the posted item, not yet taken */
  atomic_uint wake;                   /* futex word: bumped by every wake */
  /* the wake count when the work it was woken for was last over (the
   * loop ran it, or the helper did): while it equals wake the helper has
   * nothing to wait for */
  atomic_uint rest;
  atomic_int sleeping;
  atomic_int stop;
  helper_back *back; /* the open handle for ends (loop thread), or NULL */
  /* the CPU the loop thread ran on when it last woke or posted (-1 none),
   * the CPUs the helper may run on, and whether it left the loop's out */
  atomic_int loop_cpu;
  cpu_set_t allowed;
  int narrowed;
  atomic_ulong runs; /* items the helper ran (tests) */
};

static uint64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static void futex_wait(atomic_uint *w, unsigned seen) {
  (void)syscall(SYS_futex, (unsigned *)w, FUTEX_WAIT_PRIVATE, seen, NULL,
                NULL, 0);
}

static void futex_wake(atomic_uint *w) {
  (void)syscall(SYS_futex, (unsigned *)w, FUTEX_WAKE_PRIVATE, 1, NULL, NULL,
                0);
}

static void hand_back(shardd__coll_help *w) {
  helper_back *bk = w->back;
  pthread_mutex_lock(&bk->mu);
  w->next = bk->head;
  bk->head = w;
  pthread_mutex_unlock(&bk->mu);
  uv_async_send(&bk->async);
}

/* A woken thread is put beside its waker when the other CPUs look busy
 * (wake-affine): on the loop's CPU the helper only takes turns with it,
 * and a spinning thread that yields is not moved by the balancer for
 * milliseconds. So the helper leaves the loop's CPU (its allowed CPUs
 * less that one) while it spins, and gets them all back to sleep. */
static void leave_loop_cpu(shardd__coll_helper *h) {
  int lc = atomic_load_explicit(&h->loop_cpu, memory_order_relaxed);
  if (lc < 0 || sched_getcpu() != lc || !CPU_ISSET(lc, &h->allowed) ||
      CPU_COUNT(&h->allowed) < 2)
    return;
  cpu_set_t set = h->allowed;
  CPU_CLR(lc, &set);
  if (sched_setaffinity(0, sizeof set, &set) == 0)
    h->narrowed = 1;
}

/* Runs the item posted within HELPER_SPIN_NS, if any; 1 when told to
 * stop. */
static int spin(shardd__coll_helper *h) {
  uint64_t until = now_ns() + HELPER_SPIN_NS;
  for (;;) {
    leave_loop_cpu(h);
    shardd__coll_help *w = atomic_exchange(&h->slot, NULL);
    if (w != NULL) {
      /* the wakes so far were for this item (a later one's ready is not) */
      unsigned upto = atomic_load(&h->wake);
      atomic_fetch_add(&h->runs, 1);
      if (w->run(w))
        hand_back(w);
      atomic_store(&h->rest, upto);
      /* the bucket it was woken for is done: the next one wakes it
       * again, and spinning on would only take a CPU from the ranks */
      return atomic_load(&h->stop);
    }
    if (atomic_load(&h->stop))
      return 1;
    if (now_ns() >= until || atomic_load(&h->rest) == atomic_load(&h->wake))
      return 0;
    sched_yield();
  }
}

static void *helper_main(void *arg) {
  shardd__coll_helper *h = arg;
  /* named for top -H and perf (at most 15 characters) */
  pthread_setname_np(pthread_self(), "shardd-helper");
  for (;;) {
    /* read before the last look at the slot: a post after it changes the
     * word, so the wait below returns at once */
    unsigned seen = atomic_load(&h->wake);
    if (spin(h))
      return NULL;
    if (h->narrowed) {
      (void)sched_setaffinity(0, sizeof h->allowed, &h->allowed);
      h->narrowed = 0;
    }
    atomic_store(&h->sleeping, 1);
    if (atomic_load(&h->slot) == NULL && !atomic_load(&h->stop))
      futex_wait(&h->wake, seen);
    atomic_store(&h->sleeping, 0);
  }
}

static void wake(shardd__coll_helper *h) {
  atomic_store_explicit(&h->loop_cpu, sched_getcpu(), memory_order_relaxed);
  atomic_fetch_add(&h->wake, 1);
  if (atomic_load(&h->sleeping))
    futex_wake(&h->wake);
}

shardd_err shardd__coll_helper_start(uv_loop_t *loop, shardd__coll_helper **out) {
  *out = NULL;
  shardd__coll_helper *h = calloc(1, sizeof *h);
  if (h == NULL)
    return SHARDD_E_NO_MEMORY;
  h->loop = loop;
  atomic_init(&h->slot, NULL);
  atomic_init(&h->wake, 0);
  atomic_init(&h->sleeping, 0);
  atomic_init(&h->stop, 0);
  atomic_init(&h->runs, 0);
  atomic_init(&h->rest, 0);
  atomic_init(&h->loop_cpu, -1);
  if (sched_getaffinity(0, sizeof h->allowed, &h->allowed) != 0)
    CPU_ZERO(&h->allowed); /* unknown: it never leaves a CPU */
  if (pthread_create(&h->th, NULL, helper_main, h) != 0) {
    free(h);
    return SHARDD_E_NO_MEMORY;
  }
  *out = h;
  return SHARDD_OK;
}

void shardd__coll_helper_stop(shardd__coll_helper *h) {
  if (h == NULL)
    return;
  atomic_store(&h->stop, 1);
  wake(h);
  futex_wake(&h->wake);
  pthread_join(h->th, NULL);
  /* an item still posted was never taken: the poster takes it back
   * before its callback returns, so there is none here */
  free(h);
}

void shardd__coll_helper_rest(shardd__coll_helper *h) {
  /* the loop alone bumps wake, so this names every wake so far */
  if (h != NULL)
    atomic_store(&h->rest, atomic_load(&h->wake));
}

void shardd__coll_helper_ready(shardd__coll_helper *h) {
  if (h != NULL)
    wake(h);
}

static void back_closed(uv_handle_t *hd) {
  helper_back *bk = hd->data;
  pthread_mutex_destroy(&bk->mu);
  free(bk);
}

static void back_cb(uv_async_t *a) {
  helper_back *bk = a->data;
  pthread_mutex_lock(&bk->mu);
  shardd__coll_help *w = bk->head;
  bk->head = NULL;
  pthread_mutex_unlock(&bk->mu);
  while (w != NULL) {
    shardd__coll_help *next = w->next;
    bk->out--;
    w->back_fn(w); /* may free w */
    w = next;
  }
  if (bk->out > 0)
    return;
  if (bk->h->back == bk)
    bk->h->back = NULL;
  uv_close((uv_handle_t *)&bk->async, back_closed);
}

int shardd__coll_helper_post(shardd__coll_helper *h, shardd__coll_help *w) {
  if (h == NULL)
    return 0;
  w->next = NULL;
  atomic_store(&h->slot, w);
  wake(h);
  return 1;
}

int shardd__coll_helper_take_back(shardd__coll_helper *h, shardd__coll_help *w) {
  shardd__coll_help *exp = w;
  return atomic_compare_exchange_strong(&h->slot, &exp, NULL);
}

shardd_err shardd__coll_helper_expect(shardd__coll_helper *h,
                                      shardd__coll_help *w) {
  helper_back *bk = h->back;
  if (bk == NULL) {
    if ((bk = calloc(1, sizeof *bk)) == NULL)
      return SHARDD_E_NO_MEMORY;
    if (uv_async_init(h->loop, &bk->async, back_cb) != 0) {
      free(bk);
      return SHARDD_E_NO_MEMORY;
    }
    pthread_mutex_init(&bk->mu, NULL);
    bk->async.data = bk;
    bk->h = h;
    h->back = bk;
  }
  bk->out++;
  w->back = bk;
  return SHARDD_OK;
}

void shardd__coll_helper_unexpect(shardd__coll_helper *h, shardd__coll_help *w) {
  helper_back *bk = w->back;
  w->back = NULL;
  if (bk == NULL || --bk->out > 0)
    return;
  if (h->back == bk)
    h->back = NULL;
  uv_close((uv_handle_t *)&bk->async, back_closed);
}

unsigned long shardd__coll_helper_runs(const shardd__coll_helper *h) {
  return h ? atomic_load(&((shardd__coll_helper *)h)->runs) : 0;
}
