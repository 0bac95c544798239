/* test_collective_misuse.c — ranks of one job making different collective
 * calls against a real shardd: each rank is refused with E_MISMATCH, and
 * the daemon serves on. A plain gather meeting a collective made from the
 * other ranks' bucket entries crashed the daemon (it read the plain
 * request's bucket-entry result, which has none). */
#include <criterion/criterion.h>
#include <pthread.h>

#include "harness.h"

static test_daemon d;

static void start(void) {
  const char *args[] = {"--devices", "3", NULL};
  test_daemon_start(&d, args);
}

static void stop(void) { test_daemon_finish(&d); }

typedef struct {
  shardd_client_t *c;
  uint64_t id;
  shardd_err rc;
} bucket_call;

static void *gather_bucket(void *p) {
  bucket_call *b = p;
  shardd_err errs[1];
  b->rc = shardd_gather_many(b->c, 1, &b->id, errs);
  return NULL;
}

Test(misuse, a_plain_gather_meeting_bucket_entries_is_refused_and_the_daemon_serves_on,
     .init = start, .fini = stop, .timeout = 60) {
  shardd_client_t *c[3];
  shardd_buffer_info info[3];
  for (uint32_t r = 0; r < 3; r++) {
    c[r] = test_connect(&d, "misuse", r, 3);
    cr_assert_eq(shardd_buffer_register(c[r], "a", SHARDD_DTYPE_FP32, 300,
                                        &info[r]),
                 SHARDD_OK, "%s", shardd_last_error(c[r]));
  }
  bucket_call b[2];
  pthread_t th[2];
  for (int r = 0; r < 2; r++) {
    b[r] = (bucket_call){c[r], info[r].id, SHARDD_OK};
    cr_assert_eq(pthread_create(&th[r], NULL, gather_bucket, &b[r]), 0);
  }
  test_sleep_ms(300); /* ranks 0 and 1's bucket entries wait for rank 2 */
  shardd_err rc = shardd_gather(c[2], info[2].id);
  cr_expect_eq(rc, SHARDD_E_MISMATCH, "rank 2's plain gather: %s: %s",
               shardd_err_name(rc), shardd_last_error(c[2]));
  for (int r = 0; r < 2; r++) {
    cr_assert_eq(pthread_join(th[r], NULL), 0);
    cr_expect_eq(b[r].rc, SHARDD_E_MISMATCH, "rank %d's bucket: %s: %s", r,
                 shardd_err_name(b[r].rc), shardd_last_error(c[r]));
  }
  cr_assert(test_daemon_alive(&d), "the daemon died");
  /* and it serves another job */
  shardd_client_t *o = test_connect(&d, "other", 0, 1);
  shardd_buffer_info oi;
  cr_assert_eq(shardd_buffer_register(o, "b", SHARDD_DTYPE_FP32, 8, &oi),
               SHARDD_OK, "%s", shardd_last_error(o));
  cr_assert_eq(shardd_gather(o, oi.id), SHARDD_OK, "%s", shardd_last_error(o));
  shardd_close(o);
  for (int r = 0; r < 3; r++)
    shardd_close(c[r]);
}
