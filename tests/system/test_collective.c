/* test_collective.c — gather, scatter, all_reduce and barrier across the
 * ranks of a job, against a real shardd with --devices 4 (1 for the
 * scatter with no work: a wholly frozen buffer's): exact concatenations
 * and sums, mismatched arguments, ordering, buckets. Ranks are libshardd
 * clients driven from threads (the collective calls block until every rank
 * made them), or raw wire clients where a test needs to know a request has
 * been queued. Every expected value is computed here. */
#include <criterion/criterion.h>
#include <criterion/parameterized.h>
#include <float.h>
#include <inttypes.h>
#include <math.h>
#include <pthread.h>

#include "harness.h"
#include "collective_fixture.h"

/* ---- gather: exactly the concatenation ----------------------------------- */

typedef struct {
  int world;
  uint64_t numel;
  int dtype;
  int op; /* scatter only */
} layout;

static void check_layout(const shardd_buffer_info *b, int r, int world, uint64_t numel,
                         shardd_dtype dt) {
  uint64_t s = (numel + (uint64_t)world - 1) / (uint64_t)world;
  cr_assert_eq(b->shard_numel, s, "shard_numel %llu, want %llu",
               (unsigned long long)b->shard_numel, (unsigned long long)s);
  cr_assert_eq(b->padded_numel, s * (uint64_t)world);
  cr_assert_geq(b->padded_numel, numel);
  cr_assert_lt(b->padded_numel - numel, (uint64_t)world);
  cr_assert_eq(b->numel, numel);
  cr_assert_eq(b->world, (uint32_t)world);
  cr_assert_eq(b->rank, (uint32_t)r);
  cr_assert_eq(b->device, (uint32_t)(r % 4), "rank %d on device %u", r, b->device);
  cr_assert_eq(b->dtype, dt);
  cr_assert_not_null(b->shard);
  cr_assert_not_null(b->gather);
  cr_assert_not_null(b->grad);
  cr_assert_not_null(b->reduced);
}

static void check_gathered(const shardd_buffer_info *b, int world) {
  size_t sb = b[0].shard_numel * esize(b[0].dtype);
  for (int r = 0; r < world; r++)
    for (int q = 0; q < world; q++)
      cr_assert_eq(memcmp((char *)b[r].gather + (size_t)q * sb, b[q].shard, sb), 0,
                   "rank %d's gather area, shard %d, differs from rank %d's shard", r, q, q);
}

ParameterizedTestParameters(collective, gather) {
  static layout cases[] = {
      {4, 4096, SHARDD_DTYPE_FP32, 0}, {4, 4099, SHARDD_DTYPE_FP32, 0},
      {3, 4099, SHARDD_DTYPE_FP32, 0}, {4, 4099, SHARDD_DTYPE_BF16, 0},
      {3, 4099, SHARDD_DTYPE_FP16, 0}, {4, 4097, SHARDD_DTYPE_FP16, 0},
      {4, 1, SHARDD_DTYPE_FP32, 0},    {3, 2, SHARDD_DTYPE_BF16, 0},
      {2, 300001, SHARDD_DTYPE_FP32, 0},
      /* many claimed chunks (coll.c's run_claimed): with the loop thread
       * claiming too (2 MiB over the ranks), and without (16 MiB) */
      {4, 250001, SHARDD_DTYPE_BF16, 0}, {4, 1000003, SHARDD_DTYPE_FP32, 0},
  };
  return cr_make_param_array(layout, cases, sizeof cases / sizeof cases[0]);
}

ParameterizedTest(layout *l, collective, gather, .init = start4, .fini = stop_daemon, .timeout = 60) {
  team t;
  team_open(&t, "gather", l->world);
  shardd_buffer_info b[MAXW];
  team_buffer(&t, "flat", (shardd_dtype)l->dtype, l->numel, b);
  for (int r = 0; r < l->world; r++)
    check_layout(&b[r], r, l->world, l->numel, (shardd_dtype)l->dtype);
  /* shards start zeroed */
  size_t sb = b[0].shard_numel * esize(b[0].dtype);
  for (int r = 0; r < l->world; r++)
    for (size_t k = 0; k < sb; k++)
      cr_assert_eq(((unsigned char *)b[r].shard)[k], 0, "rank %d shard byte %zu not zero", r, k);

  fill_shards(b, l->world, 1);
  unsigned char *saved[MAXW];
  for (int r = 0; r < l->world; r++) {
    saved[r] = malloc(sb);
    memcpy(saved[r], b[r].shard, sb);
  }
  team_all(&t, OP_GATHER, b[0].id, SHARDD_REDUCE_SUM);
  check_gathered(b, l->world);
  for (int r = 0; r < l->world; r++)
    cr_assert_eq(memcmp(saved[r], b[r].shard, sb), 0, "gather changed rank %d's shard", r);
  /* new shard values show in the next gather */
  fill_shards(b, l->world, 2);
  team_all(&t, OP_GATHER, b[0].id, SHARDD_REDUCE_SUM);
  check_gathered(b, l->world);
  for (int r = 0; r < l->world; r++)
    free(saved[r]);
  team_close(&t);
}

/* ---- scatter: exact sums and means ------------------------------------- */

static void check_reduced(const shardd_buffer_info *b, int world, uint32_t salt, int op) {
  uint64_t s = b[0].shard_numel;
  for (int q = 0; q < world; q++)
    for (size_t i = 0; i < s; i++) {
      float want = expected_reduced(world, (size_t)q * s + i, salt, op);
      float got = f32_at(b[q].reduced, i);
      cr_assert_eq(f32_bits(got), f32_bits(want),
                   "rank %d reduced[%zu] (element %zu) = %a, want %a", q, i,
                   (size_t)q * s + i, (double)got, (double)want);
    }
}

ParameterizedTestParameters(collective, scatter) {
  static layout cases[] = {
      {4, 4096, SHARDD_DTYPE_FP32, SHARDD_REDUCE_SUM},
      {4, 4099, SHARDD_DTYPE_FP32, SHARDD_REDUCE_SUM},
      {3, 4099, SHARDD_DTYPE_FP32, SHARDD_REDUCE_SUM},
      {4, 4099, SHARDD_DTYPE_FP32, SHARDD_REDUCE_MEAN},
      {3, 4099, SHARDD_DTYPE_FP32, SHARDD_REDUCE_MEAN},
      {4, 4099, SHARDD_DTYPE_BF16, SHARDD_REDUCE_SUM},
      {3, 4099, SHARDD_DTYPE_BF16, SHARDD_REDUCE_MEAN},
      {4, 4099, SHARDD_DTYPE_FP16, SHARDD_REDUCE_SUM},
      {3, 4097, SHARDD_DTYPE_FP16, SHARDD_REDUCE_MEAN},
      {4, 1, SHARDD_DTYPE_FP32, SHARDD_REDUCE_SUM},
      {2, 200003, SHARDD_DTYPE_BF16, SHARDD_REDUCE_SUM},
      /* many claimed chunks, with and without the loop thread claiming */
      {4, 200003, SHARDD_DTYPE_FP32, SHARDD_REDUCE_MEAN},
      {4, 1000003, SHARDD_DTYPE_FP32, SHARDD_REDUCE_SUM},
  };
  return cr_make_param_array(layout, cases, sizeof cases / sizeof cases[0]);
}

ParameterizedTest(layout *l, collective, scatter, .init = start4, .fini = stop_daemon, .timeout = 60) {
  team t;
  team_open(&t, "scatter", l->world);
  shardd_buffer_info b[MAXW];
  shardd_dtype dt = (shardd_dtype)l->dtype;
  team_buffer(&t, "flat", dt, l->numel, b);
  for (int r = 0; r < l->world; r++)
    check_layout(&b[r], r, l->world, l->numel, dt);
  fill_shards(b, l->world, 5);
  size_t gb = b[0].padded_numel * esize(dt), sb = b[0].shard_numel * esize(dt);
  unsigned char *grad_copy[MAXW], *shard_copy[MAXW];
  for (uint32_t salt = 1; salt <= 2; salt++) {
    fill_grads(b, l->world, salt);
    for (int r = 0; r < l->world; r++) {
      grad_copy[r] = malloc(gb);
      shard_copy[r] = malloc(sb);
      memcpy(grad_copy[r], b[r].grad, gb);
      memcpy(shard_copy[r], b[r].shard, sb);
    }
    team_all(&t, OP_SCATTER, b[0].id, (shardd_reduce_op)l->op);
    check_reduced(b, l->world, salt, l->op);
    for (int r = 0; r < l->world; r++) {
      cr_assert_eq(memcmp(grad_copy[r], b[r].grad, gb), 0, "scatter wrote rank %d's grad area", r);
      cr_assert_eq(memcmp(shard_copy[r], b[r].shard, sb), 0, "scatter wrote rank %d's shard", r);
      free(grad_copy[r]);
      free(shard_copy[r]);
    }
  }
  if (dt != SHARDD_DTYPE_FP32 && l->numel > 100) {
    /* self-check: these sums would not survive a 16-bit accumulator */
    size_t inexact = 0;
    for (size_t j = 0; j < l->numel; j++) {
      double s = 0;
      for (int r = 0; r < l->world; r++)
        s += grid_value(grad_hash(r, j, 2));
      inexact += !representable_bf16(s);
    }
    cr_assert_gt(inexact, l->numel / 4, "test values do not exercise fp32 accumulation");
  }
  team_close(&t);
}

/* ---- mismatched arguments ---------------------------------------------- */

Test(collective, mismatched_scatter_op_fails_all, .init = start4, .fini = stop_daemon, .timeout = 60) {
  /* rank 1 disagrees in the middle: ranks 2 and 3 arrive after the
   * disagreement and must be told too, not left waiting */
  test_raw r[4];
  shardd_buffer_info b[4];
  for (int k = 0; k < 4; k++) {
    test_raw_open(&d, &r[k]);
    test_raw_hello(&r[k], "mm", (uint32_t)k, 4);
    test_raw_register_buffer(&r[k], "g", SHARDD_DTYPE_FP32, 1024, &b[k]);
    for (size_t j = 0; j < b[k].padded_numel; j++)
      put_grid(SHARDD_DTYPE_FP32, b[k].grad, j, grad_hash(k, j, 4));
  }
  unsigned char *sv[4];
  for (int k = 0; k < 4; k++) {
    sv[k] = malloc(b[k].shard_numel * 4);
    memcpy(sv[k], b[k].reduced, b[k].shard_numel * 4);
  }
  uint64_t seq[4];
  Shardwire__Response *early[4] = {NULL, NULL, NULL, NULL};
  for (int k = 0; k < 4; k++) {
    seq[k] = test_raw_send_scatter(&r[k], b[0].id, k == 1 ? SHARDD_REDUCE_MEAN : SHARDD_REDUCE_SUM);
    if (k < 3)
      test_raw_sync_keep(&r[k], &early[k]); /* in this order */
  }
  for (int k = 0; k < 4; k++) {
    Shardwire__Response *resp = early[k] ? early[k] : test_raw_recv(&r[k]);
    cr_assert_not_null(resp, "rank %d: closed", k);
    cr_assert_eq(resp->seq, seq[k]);
    cr_assert_eq(resp->code, SHARDWIRE__STATUS_CODE__E_MISMATCH, "rank %d: %s (%s)", k,
                 shardd_err_name((shardd_err)resp->code), resp->message);
    cr_assert_not_null(strstr(resp->message, "rank 1"), "rank %d: \"%s\"", k, resp->message);
    shardwire__response__free_unpacked(resp, NULL);
  }
  for (int k = 0; k < 4; k++) {
    cr_assert_eq(memcmp(sv[k], b[k].reduced, b[k].shard_numel * 4), 0,
                 "rank %d's reduced shard changed", k);
    free(sv[k]);
  }
  /* the job is not wedged: an agreeing scatter works next */
  for (int k = 0; k < 4; k++)
    seq[k] = test_raw_send_scatter(&r[k], b[0].id, SHARDD_REDUCE_SUM);
  for (int k = 0; k < 4; k++)
    shardwire__response__free_unpacked(test_raw_expect(&r[k], seq[k], SHARDD_OK), NULL);
  check_reduced(b, 4, 4, SHARDD_REDUCE_SUM);
  for (int k = 0; k < 4; k++)
    test_raw_close(&r[k]);
}

Test(collective, mismatched_op_from_threads, .init = start4, .fini = stop_daemon, .timeout = 60) {
  team t;
  team_open(&t, "mm2", 4);
  shardd_buffer_info b[MAXW];
  team_buffer(&t, "g", SHARDD_DTYPE_FP32, 100, b);
  for (int round = 0; round < 4; round++) {
    call calls[MAXW];
    memset(calls, 0, sizeof calls);
    for (int r = 0; r < 4; r++) {
      calls[r].c = t.c[r];
      calls[r].kind = OP_SCATTER;
      calls[r].id = b[0].id;
      calls[r].op = r == round ? SHARDD_REDUCE_MEAN : SHARDD_REDUCE_SUM;
    }
    run_calls(calls, 4);
    for (int r = 0; r < 4; r++)
      cr_assert_eq(calls[r].rc, SHARDD_E_MISMATCH, "round %d rank %d: %s: %s", round, r,
                   shardd_err_name(calls[r].rc), calls[r].msg);
  }
  team_close(&t);
}

/* ---- ordering ------------------------------------------------------------- */

Test(collective, different_buffers_in_flight_at_once, .init = start4, .fini = stop_daemon, .timeout = 60) {
  test_raw r[4];
  shardd_buffer_info a[4], bb[4];
  for (int k = 0; k < 4; k++) {
    test_raw_open(&d, &r[k]);
    test_raw_hello(&r[k], "ab", (uint32_t)k, 4);
    test_raw_register_buffer(&r[k], "A", SHARDD_DTYPE_FP32, 4099, &a[k]);
    test_raw_register_buffer(&r[k], "B", SHARDD_DTYPE_BF16, 1001, &bb[k]);
  }
  fill_shards(a, 4, 11);
  fill_shards(bb, 4, 12);
  /* ranks 0 and 1 ask for A then B, ranks 2 and 3 for B then A: with one
   * collective at a time per job this would deadlock */
  uint64_t first[4], second[4];
  for (int k = 0; k < 4; k++) {
    uint64_t x = k < 2 ? a[0].id : bb[0].id, y = k < 2 ? bb[0].id : a[0].id;
    first[k] = test_raw_send_gather(&r[k], x);
    second[k] = test_raw_send_gather(&r[k], y);
  }
  for (int k = 0; k < 4; k++) {
    int got1 = 0, got2 = 0;
    for (int n = 0; n < 2; n++) {
      Shardwire__Response *resp = test_raw_recv(&r[k]);
      cr_assert_not_null(resp);
      cr_assert_eq(resp->code, SHARDWIRE__STATUS_CODE__OK, "rank %d: %s", k, resp->message);
      got1 += resp->seq == first[k];
      got2 += resp->seq == second[k];
      shardwire__response__free_unpacked(resp, NULL);
    }
    cr_assert(got1 == 1 && got2 == 1);
  }
  check_gathered(a, 4);
  check_gathered(bb, 4);
  for (int k = 0; k < 4; k++)
    test_raw_close(&r[k]);
}

/* ---- a collective with no work ------------------------------------------
 * A scatter of a buffer whose every element is frozen has no task to run.
 * It used to complete inside the scheduler that started it, which then
 * walked on from the collective that completion freed (a use-after-free in
 * schedule()); now its one empty task goes through the pool. Three rounds,
 * with a gather of the same buffer queued between, so the queue has a
 * successor each time. */

static void start1(void) {
  const char *args[] = {"--devices", "1", NULL};
  test_daemon_start(&d, args);
}

static uint64_t raw_view(test_raw *r, uint64_t buf, const char *name,
                         uint64_t off, uint64_t numel, int requires_grad) {
  Shardwire__Request req = SHARDWIRE__REQUEST__INIT;
  Shardwire__RegisterView rv = SHARDWIRE__REGISTER_VIEW__INIT;
  int64_t shape[1] = {(int64_t)numel};
  rv.buffer = buf;
  rv.name = (char *)name;
  rv.offset = off;
  rv.numel = numel;
  rv.shape = shape;
  rv.n_shape = 1;
  rv.has_requires_grad = 1;
  rv.requires_grad = requires_grad;
  req.body_case = SHARDWIRE__REQUEST__BODY_REGISTER_VIEW;
  req.register_view = &rv;
  uint64_t seq = test_raw_send(r, &req);
  Shardwire__Response *resp = test_raw_expect(r, seq, SHARDD_OK);
  uint64_t id = resp->view->id;
  shardwire__response__free_unpacked(resp, NULL);
  return id;
}

Test(collective, scatter_with_no_work_completes_and_daemon_lives, .init = start1,
     .fini = stop_daemon, .timeout = 60) {
  test_raw r;
  test_raw_open(&d, &r);
  test_raw_hello(&r, "frozen-all", 0, 1);
  shardd_buffer_info b;
  test_raw_register_buffer(&r, "w", SHARDD_DTYPE_FP32, 64, &b);
  raw_view(&r, b.id, "base", 0, 64, 0);
  for (int i = 0; i < 3; i++) {
    uint64_t s1 = test_raw_send_scatter(&r, b.id, SHARDD_REDUCE_SUM);
    uint64_t g = test_raw_send_gather(&r, b.id);
    uint64_t s2 = test_raw_send_scatter(&r, b.id, SHARDD_REDUCE_MEAN);
    shardwire__response__free_unpacked(test_raw_expect(&r, s1, SHARDD_OK), NULL);
    shardwire__response__free_unpacked(test_raw_expect(&r, g, SHARDD_OK), NULL);
    shardwire__response__free_unpacked(test_raw_expect(&r, s2, SHARDD_OK), NULL);
  }
  test_raw_sync(&r);
  test_raw_close(&r);
  cr_assert(test_daemon_alive(&d), "the daemon died");
}

/* ---- all_reduce and barrier (shardd_all_reduce, shardd_barrier) ---------- */

typedef struct {
  shardd_client_t *c;
  double v[3];
  size_t n;
  shardd_reduce_op op;
  shardd_err rc, barrier_rc;
  pthread_t th;
} ar_call;

static void *ar_main(void *p) {
  ar_call *a = p;
  a->rc = shardd_all_reduce(a->c, a->v, a->n, a->op);
  a->barrier_rc = shardd_barrier(a->c);
  return NULL;
}

/* Four ranks all-reduce three doubles with each op, then meet at a
 * barrier: each gets the rank-order fold, bit for bit; while rank 0 alone
 * waits, status shows the all_reduce with its arrivals. */
Test(collective, all_reduce_and_barrier_over_four_ranks, .init = start4,
     .fini = stop_daemon, .timeout = 60) {
  static const double in[4][3] = {
      {1.0, -2.5, 1e300}, {0.1, 3.25, 1e300}, {0.2, -0.75, -1e300}, {-0.3, 1e-17, 5.0}};
  team t;
  team_open(&t, "scalars", 4);
  shardd_reduce_op ops[] = {SHARDD_REDUCE_SUM, SHARDD_REDUCE_MEAN, SHARDD_REDUCE_MAX,
                            SHARDD_REDUCE_MIN};
  for (int k = 0; k < 4; k++) {
    ar_call a[4];
    memset(a, 0, sizeof a);
    for (int r = 0; r < 4; r++) {
      a[r].c = t.c[r];
      a[r].n = 3;
      a[r].op = ops[k];
      memcpy(a[r].v, in[r], sizeof a[r].v);
    }
    cr_assert_eq(pthread_create(&a[0].th, NULL, ar_main, &a[0]), 0);
    if (k == 0) { /* rank 0 waits alone: status says on whom */
      shardd_client_t *ctl = test_connect(&d, NULL, 0, 1);
      char *text = NULL;
      for (double end = test_mono_s() + TEST_HANG_S;;) {
        cr_assert_eq(shardd_status_text(ctl, &text), SHARDD_OK);
        if (strstr(text, "collective all_reduce of 3 values"))
          break;
        shardd_free(text);
        cr_assert_lt(test_mono_s(), end, "status never showed the all_reduce");
        test_sleep_ms(10);
      }
      cr_assert_not_null(strstr(text, "arrived 0, waiting for 1-3"), "%s", text);
      shardd_free(text);
      shardd_close(ctl);
    }
    for (int r = 1; r < 4; r++)
      cr_assert_eq(pthread_create(&a[r].th, NULL, ar_main, &a[r]), 0);
    for (int r = 0; r < 4; r++)
      pthread_join(a[r].th, NULL);
    for (int i = 0; i < 3; i++) {
      double want = in[0][i];
      for (int r = 1; r < 4; r++) {
        double v = in[r][i];
        if (ops[k] == SHARDD_REDUCE_MAX)
          want = v > want ? v : want;
        else if (ops[k] == SHARDD_REDUCE_MIN)
          want = v < want ? v : want;
        else
          want = want + v;
      }
      if (ops[k] == SHARDD_REDUCE_MEAN)
        want /= 4;
      for (int r = 0; r < 4; r++) {
        cr_assert_eq(a[r].rc, SHARDD_OK, "op %d rank %d: %s", k, r,
                     shardd_last_error(t.c[r]));
        cr_assert_eq(a[r].barrier_rc, SHARDD_OK, "rank %d barrier: %s", r,
                     shardd_last_error(t.c[r]));
        cr_assert(memcmp(&a[r].v[i], &want, sizeof want) == 0,
                  "op %d value %d rank %d: %.17g, want %.17g", k, i, r, a[r].v[i], want);
      }
    }
  }
  /* ranks that disagree on the count all fail */
  ar_call a[4];
  memset(a, 0, sizeof a);
  for (int r = 0; r < 4; r++) {
    a[r].c = t.c[r];
    a[r].n = r == 2 ? 2 : 3;
    cr_assert_eq(pthread_create(&a[r].th, NULL, ar_main, &a[r]), 0);
  }
  for (int r = 0; r < 4; r++) {
    pthread_join(a[r].th, NULL);
    cr_assert_eq(a[r].rc, SHARDD_E_MISMATCH, "rank %d: %s", r, shardd_err_name(a[r].rc));
    cr_assert_eq(a[r].barrier_rc, SHARDD_OK);
  }
  double big[SHARDD_ALL_REDUCE_MAX + 1] = {0};
  cr_assert_eq(shardd_all_reduce(t.c[0], big, SHARDD_ALL_REDUCE_MAX + 1, SHARDD_REDUCE_SUM),
               SHARDD_E_RANGE);
  team_close(&t);
}

/* ---- buckets: shardd_gather_many / shardd_scatter_many ------------------ */

#define NBK 70 /* more than one request's SHARDD_BUCKET_PER_REQUEST */

typedef struct {
  shardd_client_t *c;
  int scatter;
  const uint64_t *ids;
  size_t n;
  shardd_reduce_op op;
  shardd_err errs[NBK];
  shardd_err rc;
  char msg[4096];
  double took;
  pthread_t th;
} bucket_call;

static void *bucket_main(void *p) {
  bucket_call *k = p;
  double t0 = test_mono_s();
  k->rc = k->scatter ? shardd_scatter_many(k->c, k->n, k->ids, k->op, k->errs)
                     : shardd_gather_many(k->c, k->n, k->ids, k->errs);
  k->took = test_mono_s() - t0;
  snprintf(k->msg, sizeof k->msg, "%s", k->rc ? shardd_last_error(k->c) : "");
  return NULL;
}

/* every rank's bucket call at once (ids[r] its list), joined */
static void run_buckets(bucket_call *k, int world) {
  for (int r = 0; r < world; r++)
    cr_assert_eq(pthread_create(&k[r].th, NULL, bucket_main, &k[r]), 0);
  for (int r = 0; r < world; r++)
    pthread_join(k[r].th, NULL);
}

/* Buffers of every layout the single gather and scatter tests use, and
 * more of them than one request carries: each lands exactly as its own
 * gather and scatter would put it (concatenation, exact sums). */
Test(collective, bucket_gathers_and_scatters_many_buffers, .init = start4,
     .fini = stop_daemon, .timeout = 120) {
  static const struct {
    shardd_dtype dt;
    uint64_t numel;
  } kinds[] = {{SHARDD_DTYPE_FP32, 4099}, {SHARDD_DTYPE_BF16, 1001},
               {SHARDD_DTYPE_FP32, 1},    {SHARDD_DTYPE_FP16, 4097},
               {SHARDD_DTYPE_FP32, 37}};
  team t;
  team_open(&t, "bucket", 4);
  static shardd_buffer_info b[NBK][MAXW];
  uint64_t ids[NBK];
  for (int i = 0; i < NBK; i++) {
    char name[32];
    snprintf(name, sizeof name, "p%d", i);
    team_buffer(&t, name, kinds[i % 5].dt, kinds[i % 5].numel, b[i]);
    ids[i] = b[i][0].id;
    fill_shards(b[i], 4, 100u + (uint32_t)i);
  }
  bucket_call k[MAXW];
  memset(k, 0, sizeof k);
  for (int r = 0; r < 4; r++) {
    k[r].c = t.c[r];
    k[r].ids = ids;
    k[r].n = NBK;
  }
  run_buckets(k, 4);
  for (int r = 0; r < 4; r++) {
    cr_assert_eq(k[r].rc, SHARDD_OK, "rank %d: %s", r, k[r].msg);
    for (int i = 0; i < NBK; i++)
      cr_assert_eq(k[r].errs[i], SHARDD_OK);
  }
  for (int i = 0; i < NBK; i++)
    check_gathered(b[i], 4);

  /* scatter: fp32 buffers (the exact-sum values are fp32 grid values) */
  uint64_t fids[NBK];
  size_t nf = 0;
  for (int i = 0; i < NBK; i++)
    if (kinds[i % 5].dt == SHARDD_DTYPE_FP32) {
      fill_grads(b[i], 4, 200u + (uint32_t)i);
      fids[nf++] = ids[i];
    }
  for (int op = 0; op < 2; op++) {
    memset(k, 0, sizeof k);
    for (int r = 0; r < 4; r++) {
      k[r].c = t.c[r];
      k[r].scatter = 1;
      k[r].ids = fids;
      k[r].n = nf;
      k[r].op = op ? SHARDD_REDUCE_MEAN : SHARDD_REDUCE_SUM;
    }
    run_buckets(k, 4);
    for (int r = 0; r < 4; r++)
      cr_assert_eq(k[r].rc, SHARDD_OK, "rank %d: %s", r, k[r].msg);
    for (int i = 0; i < NBK; i++)
      if (kinds[i % 5].dt == SHARDD_DTYPE_FP32)
        check_reduced(b[i], 4, 200u + (uint32_t)i,
                      op ? SHARDD_REDUCE_MEAN : SHARDD_REDUCE_SUM);
  }
  /* nothing is left queued, and an empty bucket is a no-op */
  cr_assert_eq(job_inflight("bucket"), 0);
  cr_assert_eq(shardd_gather_many(t.c[0], 0, NULL, NULL), SHARDD_OK);
  team_close(&t);
}

/* On 2 ranks of job: n fp32 buffers of numel0 + step * i elements, each
 * gathered and reduce-scattered (sum) in buckets; every byte lands as the
 * collective alone would put it. */
static void bucket_round(const char *job, int n, uint64_t numel0, uint64_t step,
                         uint32_t salt) {
  enum { NMAX = 20 };
  cr_assert_leq(n, NMAX);
  team t;
  team_open(&t, job, 2);
  static shardd_buffer_info b[NMAX][MAXW];
  uint64_t ids[NMAX];
  for (int i = 0; i < n; i++) {
    char name[32];
    snprintf(name, sizeof name, "p%d", i);
    team_buffer(&t, name, SHARDD_DTYPE_FP32, numel0 + step * (uint64_t)i, b[i]);
    ids[i] = b[i][0].id;
    fill_shards(b[i], 2, salt + (uint32_t)i);
    fill_grads(b[i], 2, salt + 100u + (uint32_t)i);
  }
  bucket_call k[MAXW];
  for (int scatter = 0; scatter < 2; scatter++) {
    memset(k, 0, sizeof k);
    for (int r = 0; r < 2; r++) {
      k[r].c = t.c[r];
      k[r].ids = ids;
      k[r].n = (size_t)n;
      k[r].scatter = scatter;
      k[r].op = SHARDD_REDUCE_SUM;
    }
    run_buckets(k, 2);
    for (int r = 0; r < 2; r++)
      cr_assert_eq(k[r].rc, SHARDD_OK, "rank %d: %s", r, k[r].msg);
  }
  for (int i = 0; i < n; i++) {
    check_gathered(b[i], 2);
    check_reduced(b[i], 2, salt + 100u + (uint32_t)i, SHARDD_REDUCE_SUM);
  }
  cr_assert_eq(job_inflight(job), 0);
  team_close(&t);
}

/* A bucket of entries too large to batch (each its own claimed collective,
 * the loop thread helping with the first until its request's budget is
 * spent, the pool alone with the rest). */
Test(collective, bucket_of_large_entries_lands_exactly, .init = start4,
     .fini = stop_daemon, .timeout = 120) {
  bucket_round("bucketbig", 5, 300001, 2, 500);
}

static void start4_pending8(void) {
  const char *args[] = {"--devices", "4", "--max-pending", "8", NULL};
  test_daemon_start(&d, args);
}

/* A daemon whose --max-pending is under a bucket's 64 entries says so at
 * connect, and libshardd cuts its buckets to fit: before, every full
 * bucket was refused E_LIMIT. */
Test(collective, buckets_fit_a_smaller_max_pending, .init = start4_pending8,
     .fini = stop_daemon, .timeout = 60) {
  bucket_round("bucketpend", 20, 33, 1, 300);
}

/* All or nothing: every bad entry is named, and none of the good ones was
 * submitted (rank 1 never calls: a submitted gather would wait for it). */
Test(collective, bucket_refusal_names_every_bad_entry_and_runs_none,
     .init = start4, .fini = stop_daemon, .timeout = 60) {
  team t;
  team_open(&t, "bucketbad", 2);
  shardd_buffer_info a[MAXW], b2[MAXW];
  team_buffer(&t, "a", SHARDD_DTYPE_FP32, 64, a);
  team_buffer(&t, "b", SHARDD_DTYPE_FP32, 64, b2);
  uint64_t ids[5] = {a[0].id, 987654321, b2[0].id, a[0].id, 0};
  shardd_err errs[5];
  shardd_err rc = shardd_gather_many(t.c[0], 5, ids, errs);
  const char *msg = shardd_last_error(t.c[0]);
  cr_assert_eq(rc, SHARDD_E_NOT_FOUND, "%s: %s", shardd_err_name(rc), msg);
  cr_assert_eq(errs[0], SHARDD_OK);
  cr_assert_eq(errs[1], SHARDD_E_NOT_FOUND);
  cr_assert_eq(errs[2], SHARDD_OK);
  cr_assert_eq(errs[3], SHARDD_E_DUPLICATE);
  cr_assert_eq(errs[4], SHARDD_E_NOT_FOUND);
  cr_assert_not_null(strstr(msg, "3 of the 5 entries"), "%s", msg);
  cr_assert_not_null(strstr(msg, "[1] "), "%s", msg);
  cr_assert_not_null(strstr(msg, "[3] "), "%s", msg);
  cr_assert_not_null(strstr(msg, "[4] "), "%s", msg);
  cr_assert_eq(job_inflight("bucketbad"), 0, "a refused bucket queued something");
  /* a scatter op other than sum or mean is refused per entry too */
  cr_assert_eq(shardd_scatter_many(t.c[0], 2, ids + 2, SHARDD_REDUCE_MAX, errs),
               SHARDD_E_INVAL, "%s", shardd_last_error(t.c[0]));
  cr_assert_eq(errs[0], SHARDD_E_INVAL);
  cr_assert_eq(errs[1], SHARDD_E_INVAL);
  cr_assert_eq(job_inflight("bucketbad"), 0);
  team_close(&t);
}

/* A buffer named more than once in a bucket: every later entry naming it
 * is refused E_DUPLICATE and names the first entry that did (not the one
 * just before it), whatever the order of the ids; an entry that fails its
 * own check (an unknown id) is refused for that even when repeated. */
Test(collective, bucket_names_the_first_entry_of_a_repeated_buffer,
     .init = start4, .fini = stop_daemon, .timeout = 60) {
  team t;
  team_open(&t, "bucketrep", 2);
  shardd_buffer_info a[MAXW], b2[MAXW];
  team_buffer(&t, "a", SHARDD_DTYPE_FP32, 64, a);
  team_buffer(&t, "b", SHARDD_DTYPE_FP32, 64, b2);
  /* the larger id first, so the ids' order is not the entries' */
  uint64_t hi = a[0].id > b2[0].id ? a[0].id : b2[0].id;
  uint64_t lo = a[0].id > b2[0].id ? b2[0].id : a[0].id;
  uint64_t ids[7] = {hi, lo, hi, 987654321, lo, hi, 987654321};
  shardd_err errs[7];
  shardd_err rc = shardd_scatter_many(t.c[0], 7, ids, SHARDD_REDUCE_SUM, errs);
  const char *msg = shardd_last_error(t.c[0]);
  cr_assert_eq(rc, SHARDD_E_DUPLICATE, "%s: %s", shardd_err_name(rc), msg);
  shardd_err want[7] = {SHARDD_OK, SHARDD_OK, SHARDD_E_DUPLICATE,
                        SHARDD_E_NOT_FOUND, SHARDD_E_DUPLICATE,
                        SHARDD_E_DUPLICATE, SHARDD_E_NOT_FOUND};
  for (int i = 0; i < 7; i++)
    cr_assert_eq(errs[i], want[i], "entry %d: %s", i, shardd_err_name(errs[i]));
  char exp[3][160];
  snprintf(exp[0], sizeof exp[0], "[2] E_DUPLICATE: buffer %" PRIu64
           " is named twice (entry 0 too)", hi);
  snprintf(exp[1], sizeof exp[1], "[4] E_DUPLICATE: buffer %" PRIu64
           " is named twice (entry 1 too)", lo);
  snprintf(exp[2], sizeof exp[2], "[5] E_DUPLICATE: buffer %" PRIu64
           " is named twice (entry 0 too)", hi);
  for (int k = 0; k < 3; k++)
    cr_assert_not_null(strstr(msg, exp[k]), "want \"%s\" in: %s", exp[k], msg);
  cr_assert_not_null(strstr(msg, "5 of the 7 entries"), "%s", msg);
  cr_assert_eq(job_inflight("bucketrep"), 0, "a refused bucket queued something");
  /* ascending ids but for a repeat next to its first (the daemon skips the
   * search for repeats in an ascending list: equal neighbours are not
   * ascending), at the end and inside */
  uint64_t up[2][3] = {{lo, hi, hi}, {lo, lo, hi}};
  for (int k = 0; k < 2; k++) {
    rc = shardd_scatter_many(t.c[0], 3, up[k], SHARDD_REDUCE_SUM, errs);
    msg = shardd_last_error(t.c[0]);
    cr_assert_eq(rc, SHARDD_E_DUPLICATE, "list %d: %s: %s", k, shardd_err_name(rc), msg);
    int dup = k == 0 ? 2 : 1;
    for (int i = 0; i < 3; i++)
      cr_assert_eq(errs[i], i == dup ? SHARDD_E_DUPLICATE : SHARDD_OK, "list %d entry %d: %s",
                   k, i, shardd_err_name(errs[i]));
    cr_assert_eq(job_inflight("bucketrep"), 0, "a refused bucket queued something");
  }
  team_close(&t);
}

/* Ranks that disagree on the bucket (another buffer, another order, a
 * lone gather) all fail at once with E_MISMATCH, long before the
 * collective timeout, leave nothing queued, and the next agreeing bucket
 * works. */
Test(collective, bucket_mismatch_fails_every_rank_at_once, .init = start4,
     .fini = stop_daemon, .timeout = 60) {
  team t;
  team_open(&t, "bucketmm", 3);
  shardd_buffer_info a[MAXW], b2[MAXW], c3[MAXW];
  team_buffer(&t, "a", SHARDD_DTYPE_FP32, 300, a);
  team_buffer(&t, "b", SHARDD_DTYPE_FP32, 300, b2);
  team_buffer(&t, "c", SHARDD_DTYPE_FP32, 300, c3);
  uint64_t ab[2] = {a[0].id, b2[0].id}, ac[2] = {a[0].id, c3[0].id},
           ba[2] = {b2[0].id, a[0].id}, lone[1] = {a[0].id};
  const uint64_t *odd[3] = {ac, ba, lone};
  size_t oddn[3] = {2, 2, 1};
  for (int round = 0; round < 3; round++) {
    for (int who = 0; who < 3; who++) {
      bucket_call k[MAXW];
      memset(k, 0, sizeof k);
      for (int r = 0; r < 3; r++) {
        k[r].c = t.c[r];
        k[r].ids = r == who ? odd[round] : ab;
        k[r].n = r == who ? oddn[round] : 2;
      }
      run_buckets(k, 3);
      for (int r = 0; r < 3; r++) {
        cr_assert_eq(k[r].rc, SHARDD_E_MISMATCH, "round %d, odd rank %d: rank %d: %s: %s",
                     round, who, r, shardd_err_name(k[r].rc), k[r].msg);
        cr_assert_lt(k[r].took, 20.0, "rank %d waited %.1f s", r, k[r].took);
      }
      fill_shards(a, 3, 7u + (uint32_t)round);
      cr_assert_eq(job_inflight("bucketmm"), 0, "round %d, odd rank %d", round, who);
    }
  }
  /* the one that disagreed says so */
  {
    bucket_call k[MAXW];
    memset(k, 0, sizeof k);
    for (int r = 0; r < 3; r++) {
      k[r].c = t.c[r];
      k[r].ids = r == 2 ? ba : ab;
      k[r].n = 2;
    }
    run_buckets(k, 3);
    int named = 0;
    for (int r = 0; r < 3; r++)
      named += strstr(k[r].msg, "every rank must send the same buffers in the "
                                "same order") != NULL;
    cr_assert_geq(named, 1, "%s | %s | %s", k[0].msg, k[1].msg, k[2].msg);
  }
  cr_assert_eq(job_inflight("bucketmm"), 0);
  /* agreeing now: it runs */
  fill_shards(a, 3, 31);
  fill_shards(b2, 3, 32);
  bucket_call k[MAXW];
  memset(k, 0, sizeof k);
  for (int r = 0; r < 3; r++) {
    k[r].c = t.c[r];
    k[r].ids = ab;
    k[r].n = 2;
  }
  run_buckets(k, 3);
  for (int r = 0; r < 3; r++)
    cr_assert_eq(k[r].rc, SHARDD_OK, "rank %d: %s", r, k[r].msg);
  check_gathered(a, 3);
  check_gathered(b2, 3);
  team_close(&t);
}

/* A bucket of gathers sent with a seq of the caller's choosing. */
static void raw_gather_bucket(test_raw *r, uint64_t seq, const uint64_t *ids, size_t n) {
  Shardwire__Gather g[4], *gp[4];
  cr_assert_leq(n, 4);
  for (size_t i = 0; i < n; i++) {
    shardwire__gather__init(&g[i]);
    g[i].buffer = ids[i];
    gp[i] = &g[i];
  }
  Shardwire__GatherMany gm = SHARDWIRE__GATHER_MANY__INIT;
  gm.gathers = gp;
  gm.n_gathers = n;
  Shardwire__Bucket bk = SHARDWIRE__BUCKET__INIT;
  bk.op_case = SHARDWIRE__BUCKET__OP_GATHER;
  bk.gather = &gm;
  Shardwire__Request req = SHARDWIRE__REQUEST__INIT;
  req.seq = seq;
  req.body_case = SHARDWIRE__REQUEST__BODY_BUCKET;
  req.bucket = &bk;
  test_raw_send(r, &req);
}

/* A bucket's entries are told apart from the rank's other collectives by
 * the request's seq: a bucket sent with the seq of the rank's gather still
 * waiting is refused (E_PROTOCOL naming the seq), and a gather with the seq
 * of a bucket still running too. The bucket used to be taken: the gather's
 * end counted as one of its entries, the bucket was answered and freed
 * early, and its last entry's end, routed as a plain gather, read an area
 * pool that was never set (the daemon crashed). */
Test(collective, a_request_reusing_a_running_requests_seq_is_refused, .init = start4,
     .fini = stop_daemon, .timeout = 60) {
  test_raw a, b;
  test_raw_open(&d, &a);
  test_raw_open(&d, &b);
  test_raw_hello(&a, "seqs", 0, 2);
  test_raw_hello(&b, "seqs", 1, 2);
  shardd_buffer_info ax, ay, bx, by;
  test_raw_register_buffer(&a, "x", SHARDD_DTYPE_FP32, 1000, &ax);
  test_raw_register_buffer(&a, "y", SHARDD_DTYPE_FP32, 1000, &ay);
  test_raw_register_buffer(&b, "x", SHARDD_DTYPE_FP32, 1000, &bx);
  test_raw_register_buffer(&b, "y", SHARDD_DTYPE_FP32, 1000, &by);
  const uint64_t ids[2] = {ax.id, ay.id};
  const uint64_t s = 1000, t = 2000;

  /* a bucket behind a waiting gather of the same seq */
  Shardwire__Request req = SHARDWIRE__REQUEST__INIT;
  Shardwire__Gather g = SHARDWIRE__GATHER__INIT;
  g.buffer = ax.id;
  req.seq = s;
  req.body_case = SHARDWIRE__REQUEST__BODY_GATHER;
  req.gather = &g;
  test_raw_send(&a, &req);
  raw_gather_bucket(&a, s, ids, 2);
  Shardwire__Response *early;
  test_raw_sync_keep(&a, &early);
  int refused = early != NULL;
  cr_expect(refused, "a bucket reusing the seq of a waiting gather was taken");
  if (early) {
    cr_expect_eq(early->seq, s);
    cr_expect_eq((int)early->code, (int)SHARDD_E_PROTOCOL, "%s",
                 early->message ? early->message : "");
    cr_expect(early->message && strstr(early->message, "seq 1000") &&
                  strstr(early->message, "collective still in flight"),
              "%s", early->message ? early->message : "");
    shardwire__response__free_unpacked(early, NULL);
  }
  uint64_t gb = test_raw_send_gather(&b, bx.id);
  shardwire__response__free_unpacked(test_raw_expect(&b, gb, SHARDD_OK), NULL);
  if (refused) /* the gather's own reply */
    shardwire__response__free_unpacked(test_raw_expect(&a, s, SHARDD_OK), NULL);
  const uint64_t bids[2] = {bx.id, by.id};
  raw_gather_bucket(&b, 3000, bids, 2);
  if (refused) { /* a's bucket, sent again under a seq of its own */
    raw_gather_bucket(&a, t, ids, 2);
    shardwire__response__free_unpacked(test_raw_expect(&a, t, SHARDD_OK), NULL);
  }
  shardwire__response__free_unpacked(test_raw_expect(&b, 3000, SHARDD_OK), NULL);

  /* a gather while a bucket of that seq waits for rank 1 */
  raw_gather_bucket(&a, t + 1, ids, 2);
  g.buffer = ay.id;
  req.seq = t + 1;
  test_raw_send(&a, &req);
  test_raw_sync_keep(&a, &early);
  cr_assert_not_null(early, "a gather reusing the seq of a waiting bucket was taken");
  cr_expect_eq(early->seq, t + 1);
  cr_expect_eq((int)early->code, (int)SHARDD_E_PROTOCOL, "%s",
               early->message ? early->message : "");
  cr_expect(early->message && strstr(early->message, "bucket"), "%s",
            early->message ? early->message : "");
  shardwire__response__free_unpacked(early, NULL);
  raw_gather_bucket(&b, 3001, bids, 2);
  shardwire__response__free_unpacked(test_raw_expect(&a, t + 1, SHARDD_OK), NULL);
  shardwire__response__free_unpacked(test_raw_expect(&b, 3001, SHARDD_OK), NULL);
  test_raw_close(&a);
  test_raw_close(&b);
}

/* A rank that goes away mid-bucket, after its bucket joined the one its
 * peer sent: its peer's bucket fails at once, every entry
 * naming the lost rank (E_PEER_LOST, one reply), nothing is left queued,
 * and once the rank is back the next bucket of every rank lands exactly. */
Test(collective, a_rank_gone_mid_bucket_fails_it_for_its_peer_and_the_next_runs,
     .init = start4, .fini = stop_daemon, .timeout = 60) {
  enum { NR = 3, NU = 4 };
  test_raw r[NR];
  shardd_buffer_info b[NR][NU];
  uint64_t ids[NR][NU];
  for (int k = 0; k < NR; k++) {
    test_raw_open(&d, &r[k]);
    test_raw_hello(&r[k], "bucketgone", (uint32_t)k, NR);
    for (int i = 0; i < NU; i++) {
      char name[16];
      snprintf(name, sizeof name, "u%d", i);
      test_raw_register_buffer(&r[k], name, SHARDD_DTYPE_FP32, 300 + 7 * (uint64_t)i,
                               &b[k][i]);
      ids[k][i] = b[k][i].id;
    }
  }
  raw_gather_bucket(&r[0], 100, ids[0], NU);
  test_raw_sync(&r[0]);
  raw_gather_bucket(&r[1], 100, ids[1], NU);
  test_raw_sync(&r[1]);
  cr_assert_eq(job_inflight("bucketgone"), NU, "both buckets wait for rank 2");
  test_raw_close(&r[1]);
  Shardwire__Response *resp = test_raw_expect(&r[0], 100, SHARDD_E_PEER_LOST);
  cr_assert(resp->message && strstr(resp->message, "4 of the 4 entries") &&
                strstr(resp->message, "rank 1"),
            "%s", resp->message ? resp->message : "");
  shardwire__response__free_unpacked(resp, NULL);
  cr_assert_eq(job_inflight("bucketgone"), 0, "the failed bucket left something queued");
  /* rank 1 back: the next bucket of every rank runs, each byte in place */
  test_raw_open(&d, &r[1]);
  test_raw_hello(&r[1], "bucketgone", 1, NR);
  for (int i = 0; i < NU; i++) {
    char name[16];
    snprintf(name, sizeof name, "u%d", i);
    test_raw_register_buffer(&r[1], name, SHARDD_DTYPE_FP32, 300 + 7 * (uint64_t)i,
                             &b[1][i]);
    ids[1][i] = b[1][i].id;
  }
  for (int k = 0; k < NR; k++)
    for (int i = 0; i < NU; i++)
      for (size_t j = 0; j < b[k][i].shard_numel; j++)
        ((float *)b[k][i].shard)[j] = (float)(100000 * k + 1000 * i + (int)j);
  for (int k = 0; k < NR; k++)
    raw_gather_bucket(&r[k], 101, ids[k], NU);
  for (int k = 0; k < NR; k++)
    shardwire__response__free_unpacked(test_raw_expect(&r[k], 101, SHARDD_OK), NULL);
  for (int k = 0; k < NR; k++)
    for (int i = 0; i < NU; i++) {
      uint64_t s = b[k][i].shard_numel;
      for (size_t j = 0; j < b[k][i].padded_numel; j++)
        cr_assert_eq(((float *)b[k][i].gather)[j],
                     (float)(100000 * (int)(j / s) + 1000 * i + (int)(j % s)),
                     "rank %d buffer %d element %zu", k, i, j);
    }
  for (int k = 0; k < NR; k++)
    test_raw_close(&r[k]);
}
