/* test_coll_helper.c — the engine's helper thread (engine/coll_helper.c)
 * on its own: its life (started asleep, woken to spin, stopped from
 * either), an item posted runs once on its thread, an item taken back
 * before it was taken never runs, and an item whose end the loop waits
 * for comes back once on the loop thread, through a handle that is
 * closed afterwards (the loop closes cleanly). The split bucket itself is
 * test_coll.c's. */
#include <criterion/criterion.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <uv.h>

#include "coll_int.h"

typedef struct {
  shardd__coll_help w;
  atomic_int runs;
  atomic_int hold;   /* run waits while set */
  atomic_int inside; /* run has started */
  int back_ret;      /* what run returns */
  pthread_t ran_on;
  int backs;
  pthread_t back_on;
} item;

static int item_run(shardd__coll_help *w) {
  item *it = (item *)w;
  it->ran_on = pthread_self();
  atomic_store(&it->inside, 1);
  while (atomic_load(&it->hold))
    sched_yield();
  atomic_fetch_add(&it->runs, 1);
  return it->back_ret;
}

static void item_back(shardd__coll_help *w) {
  item *it = (item *)w;
  it->backs++;
  it->back_on = pthread_self();
}

static void item_init(item *it, int back_ret) {
  memset(it, 0, sizeof *it);
  it->w.run = item_run;
  it->w.back_fn = item_back;
  it->back_ret = back_ret;
  atomic_init(&it->runs, 0);
  atomic_init(&it->hold, 0);
  atomic_init(&it->inside, 0);
}

static uv_loop_t loop;

static void setup(void) { cr_assert_eq(uv_loop_init(&loop), 0); }

static void teardown(void) {
  cr_expect_eq(uv_loop_close(&loop), 0, "the helper leaves no handle open");
}

TestSuite(coll_helper, .init = setup, .fini = teardown, .timeout = 30);

Test(coll_helper, stops_asleep_and_while_spinning) {
  shardd__coll_helper *h;
  cr_assert_eq(shardd__coll_helper_start(&loop, &h), SHARDD_OK);
  cr_assert_not_null(h);
  shardd__coll_helper_stop(h); /* never woken */
  cr_assert_eq(shardd__coll_helper_start(&loop, &h), SHARDD_OK);
  shardd__coll_helper_ready(h); /* spinning, waiting for work */
  shardd__coll_helper_stop(h);
  shardd__coll_helper_stop(NULL);
}

Test(coll_helper, a_posted_item_runs_once_on_its_thread) {
  shardd__coll_helper *h;
  cr_assert_eq(shardd__coll_helper_start(&loop, &h), SHARDD_OK);
  for (int k = 0; k < 50; k++) {
    item it;
    item_init(&it, 0);
    cr_assert(shardd__coll_helper_post(h, &it.w));
    while (atomic_load(&it.runs) == 0)
      sched_yield();
    cr_assert(!shardd__coll_helper_take_back(h, &it.w), "taken: not there");
    cr_assert(!pthread_equal(it.ran_on, pthread_self()), "on the helper's thread");
    cr_assert_eq(atomic_load(&it.runs), 1);
    cr_assert_eq(it.backs, 0, "its end not handed back when run says so");
  }
  cr_assert_eq(shardd__coll_helper_runs(h), 50);
  uv_run(&loop, UV_RUN_NOWAIT);
  shardd__coll_helper_stop(h);
}

/* Posted and taken back at once: the helper took it (it runs once) or it
 * did not (it never runs); never both, never neither. */
Test(coll_helper, an_item_taken_back_never_runs) {
  shardd__coll_helper *h;
  cr_assert_eq(shardd__coll_helper_start(&loop, &h), SHARDD_OK);
  int taken_back = 0;
  for (int k = 0; k < 200; k++) {
    item it;
    item_init(&it, 0);
    if (k % 2)
      shardd__coll_helper_ready(h);
    cr_assert(shardd__coll_helper_post(h, &it.w));
    if (shardd__coll_helper_take_back(h, &it.w)) {
      taken_back++;
      continue; /* it must not run: it goes out of scope now */
    }
    while (atomic_load(&it.runs) == 0)
      sched_yield();
  }
  cr_assert_eq(shardd__coll_helper_runs(h) + (unsigned long)taken_back, 200);
  shardd__coll_helper_stop(h);
}

/* The loop stops waiting for an item still running (its thread
 * preempted): named as expected, its end comes back once, on the loop
 * thread, and the handle it came through is closed after. */
Test(coll_helper, an_end_the_loop_waits_for_comes_back_on_the_loop) {
  shardd__coll_helper *h;
  cr_assert_eq(shardd__coll_helper_start(&loop, &h), SHARDD_OK);
  item it[3];
  for (int k = 0; k < 3; k++) {
    item_init(&it[k], 1);
    atomic_store(&it[k].hold, 1);
    cr_assert_eq(shardd__coll_helper_expect(h, &it[k].w), SHARDD_OK);
  }
  /* one at a time: the next once the helper has taken the one before */
  for (int k = 0; k < 3; k++) {
    shardd__coll_helper_post(h, &it[k].w);
    while (!atomic_load(&it[k].inside))
      sched_yield();
    atomic_store(&it[k].hold, 0);
  }
  uv_run(&loop, UV_RUN_DEFAULT); /* returns once the handle is closed */
  for (int k = 0; k < 3; k++) {
    cr_assert_eq(atomic_load(&it[k].runs), 1);
    cr_assert_eq(it[k].backs, 1, "its end came back once");
    cr_assert(pthread_equal(it[k].back_on, pthread_self()), "on the loop");
  }
  shardd__coll_helper_stop(h);
}

/* Named as expected, then ended by the loop itself (the helper was done
 * first): the handle opened for it is closed, nothing comes back. */
Test(coll_helper, an_end_no_longer_expected_closes_the_handle) {
  shardd__coll_helper *h;
  cr_assert_eq(shardd__coll_helper_start(&loop, &h), SHARDD_OK);
  item it;
  item_init(&it, 0);
  cr_assert_eq(shardd__coll_helper_expect(h, &it.w), SHARDD_OK);
  shardd__coll_helper_unexpect(h, &it.w);
  uv_run(&loop, UV_RUN_DEFAULT);
  cr_assert_eq(it.backs, 0);
  shardd__coll_helper_stop(h);
}
