/* test_dispatch.c — the batched view requests (ViewsBatch) against a real
 * shardd, through libshardd's shardd_views_register / _unregister and
 * through raw frames: a batch registers what the single requests would,
 * a refused batch names every bad entry and leaves nothing behind (names'
 * generations included), a call longer than one request is undone whole,
 * unregistering checks every id first, and malformed batches are answered,
 * not fatal. Expected ids, codes and generations come from the single-view
 * calls and the rules they document. */
#include <criterion/criterion.h>
#include <dirent.h>
#include <errno.h>
#include <inttypes.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include "harness.h"

static test_daemon d;
static shardd_client_t *c;
static shardd_buffer_info b;

static void start(void) {
  const char *args[] = {"--devices", "1", NULL};
  test_daemon_start(&d, args);
  c = test_connect(&d, "batch", 0, 1);
  cr_assert_eq(shardd_buffer_register(c, "flat", SHARDD_DTYPE_FP32, 1 << 20, &b),
               SHARDD_OK, "%s", shardd_last_error(c));
}

static void stop(void) {
  shardd_close(c);
  c = NULL;
  test_daemon_finish(&d);
}

TestSuite(dispatch, .init = start, .fini = stop);

static const int64_t shape4[2] = {2, 2};

static shardd_view_spec spec(const char *name, uint64_t off, uint64_t numel,
                             const int64_t *shape, int ndim, int rg) {
  shardd_view_spec s = SHARDD_VIEW_SPEC_INIT;
  s.buffer = b.id;
  s.name = name;
  s.offset = off;
  s.numel = numel;
  s.shape = shape;
  s.ndim = ndim;
  s.requires_grad = rg;
  return s;
}

/* Registers one view alone; its info. */
static shardd_view_info one(const shardd_view_spec *s, shardd_err want) {
  shardd_view_opts o = SHARDD_VIEW_OPTS_INIT;
  o.requires_grad = s->requires_grad;
  shardd_view_info vi;
  shardd_err rc = shardd_view_register_ex(c, s->buffer, s->name, s->offset,
                                          s->numel, s->shape, s->ndim, &o, &vi);
  cr_assert_eq(rc, want, "%s: %s, expected %s (%s)", s->name,
               shardd_err_name(rc), shardd_err_name(want), shardd_last_error(c));
  return vi;
}

Test(dispatch, batch_registers_what_single_requests_would) {
  int64_t sc[1] = {3};
  shardd_view_spec s[3] = {spec("w", 0, 4, shape4, 2, 1),
                           spec("frozen", 4, 3, sc, 1, 0),
                           spec("scalar", 7, 1, NULL, 0, 1)};
  shardd_view_info vi[3];
  shardd_err errs[3];
  cr_assert_eq(shardd_views_register(c, 3, s, vi, errs), SHARDD_OK, "%s",
               shardd_last_error(c));
  for (int i = 0; i < 3; i++) {
    cr_assert_eq(errs[i], SHARDD_OK);
    cr_assert_neq(vi[i].id, 0);
    cr_assert_eq(vi[i].created, 1);
    cr_assert_eq(vi[i].generation, 1);
    for (int j = 0; j < i; j++)
      cr_assert_neq(vi[i].id, vi[j].id);
  }
  /* the single request attaches to the batch's views, same ids */
  for (int i = 0; i < 3; i++) {
    shardd_view_info a = one(&s[i], SHARDD_OK);
    cr_assert_eq(a.id, vi[i].id);
    cr_assert_eq(a.created, 0);
  }
  /* the frozen entry is frozen: attaching as trainable is a mismatch */
  shardd_view_spec t = s[1];
  t.requires_grad = 1;
  one(&t, SHARDD_E_MISMATCH);
  /* and the batch again attaches */
  shardd_view_info again[3];
  cr_assert_eq(shardd_views_register(c, 3, s, again, NULL), SHARDD_OK, "%s",
               shardd_last_error(c));
  for (int i = 0; i < 3; i++) {
    cr_assert_eq(again[i].id, vi[i].id);
    cr_assert_eq(again[i].created, 0);
  }
  /* an empty call sends nothing and succeeds */
  cr_assert_eq(shardd_views_register(c, 0, NULL, NULL, NULL), SHARDD_OK);
}

Test(dispatch, an_async_reply_read_during_a_batch_is_kept_for_its_wait) {
  /* a release of a resident buffer is refused on the loop at once, so its
   * reply comes before the batch's and is read by the batch's receive
   * (its replies decoded into the batch's arena): noted, message and all,
   * for the ticket; the batch's own reply read after it */
  shardd_ticket t;
  cr_assert_eq(shardd_release_async(c, b.id, &t), SHARDD_OK, "%s",
               shardd_last_error(c));
  shardd_view_spec s[2] = {spec("during.a", 0, 4, shape4, 2, 1),
                           spec("during.b", 4, 4, shape4, 2, 1)};
  shardd_view_info vi[2];
  cr_assert_eq(shardd_views_register(c, 2, s, vi, NULL), SHARDD_OK, "%s",
               shardd_last_error(c));
  cr_expect(vi[0].id != 0 && vi[1].id != 0 && vi[0].id != vi[1].id);
  cr_expect_eq(vi[0].created, 1);
  cr_assert_eq(shardd_wait(c, t), SHARDD_E_STATE, "%s", shardd_last_error(c));
  cr_expect(strstr(shardd_last_error(c), "nothing to release") != NULL, "%s",
            shardd_last_error(c));
  /* and the next batch again */
  cr_assert_eq(shardd_views_register(c, 2, s, vi, NULL), SHARDD_OK, "%s",
               shardd_last_error(c));
  cr_expect_eq(vi[0].created, 0);
}

Test(dispatch, refused_batch_names_every_bad_entry_and_keeps_nothing) {
  int64_t s3[1] = {3};
  shardd_view_spec s[6] = {
      spec("ok0", 0, 4, shape4, 2, 1),
      spec("outside", (1 << 20) - 2, 4, shape4, 2, 1), /* past the end */
      spec("ok2", 8, 4, shape4, 2, 1),
      spec("badshape", 12, 4, s3, 1, 1),          /* 3 elements, numel 4 */
      spec("frozen_on_ok0", 2, 4, shape4, 2, 0),  /* meets entry 0 */
      spec("ok5", 16, 4, shape4, 2, 0),
  };
  shardd_view_info vi[6];
  shardd_err errs[6];
  shardd_err rc = shardd_views_register(c, 6, s, vi, errs);
  cr_assert_eq(rc, SHARDD_E_RANGE, "the first refused entry's code, got %s",
               shardd_err_name(rc));
  shardd_err want[6] = {SHARDD_OK, SHARDD_E_RANGE, SHARDD_OK,
                        SHARDD_E_MISMATCH, SHARDD_E_OVERLAP, SHARDD_OK};
  for (int i = 0; i < 6; i++) {
    cr_assert_eq(errs[i], want[i], "entry %d: %s, expected %s", i,
                 shardd_err_name(errs[i]), shardd_err_name(want[i]));
    cr_assert_eq(vi[i].id, 0, "no id is handed out on a refusal");
  }
  const char *m = shardd_last_error(c);
  cr_assert(strstr(m, "3 of 6 views refused"), "%s", m);
  cr_assert(strstr(m, "[1] E_RANGE") && strstr(m, "\"outside\""), "%s", m);
  cr_assert(strstr(m, "[3] E_MISMATCH") && strstr(m, "\"badshape\""), "%s", m);
  cr_assert(strstr(m, "[4] E_OVERLAP") && strstr(m, "\"frozen_on_ok0\""), "%s", m);
  cr_assert_null(strstr(m, "[0]"), "%s", m);
  /* nothing stayed: the good entries register anew, as the first of their
   * names (generation 1, not 2), and a frozen view may now take the range
   * entry 0 would have held trainable */
  shardd_view_info a = one(&s[0], SHARDD_OK);
  cr_assert_eq(a.created, 1);
  cr_assert_eq(a.generation, 1);
  shardd_view_info f = one(&s[5], SHARDD_OK);
  cr_assert_eq(f.created, 1);
  cr_assert_eq(f.generation, 1);
  shardd_view_spec other = spec("ok2", 8, 4, shape4, 2, 0);
  cr_assert_eq(one(&other, SHARDD_OK).created, 1, "ok2 was not kept trainable");
}

#define BIG 10000 /* many requests of SHARDD_VIEWS_PER_REQUEST */

static char names[BIG][16];
static shardd_view_spec big[BIG];
static shardd_view_info bigi[BIG];
static shardd_err bige[BIG];

static void big_specs(const char *prefix) {
  for (int i = 0; i < BIG; i++) {
    snprintf(names[i], sizeof names[i], "%s%d", prefix, i);
    big[i] = spec(names[i], (uint64_t)i * 4, 4, shape4, 2, 1);
  }
}

Test(dispatch, call_longer_than_a_request_is_undone_whole) {
  cr_assert_gt(BIG, 2 * SHARDD_VIEWS_PER_REQUEST);
  big_specs("a");
  big[9000].numel = 5; /* in the third request: shape says 4 */
  big[9001].offset = 1 << 20;
  shardd_err rc = shardd_views_register(c, BIG, big, bigi, bige);
  cr_assert_eq(rc, SHARDD_E_MISMATCH, "%s: %s", shardd_err_name(rc),
               shardd_last_error(c));
  /* the refused request's end: entries after it were not sent */
  int end = (9000 / SHARDD_VIEWS_PER_REQUEST + 1) * SHARDD_VIEWS_PER_REQUEST;
  cr_assert_lt(end, BIG);
  for (int i = 0; i < BIG; i++)
    cr_assert_eq(bige[i], i == 9000 ? SHARDD_E_MISMATCH
                          : i == 9001 ? SHARDD_E_RANGE
                          : i >= end ? SHARDD_E_STATE : SHARDD_OK,
                 "entry %d: %s", i, shardd_err_name(bige[i]));
  const char *m = shardd_last_error(c);
  cr_assert(strstr(m, "[9000] E_MISMATCH") && strstr(m, "[9001] E_RANGE"),
            "indices count from the call's first entry: %s", m);
  /* the first two requests' views were unregistered again */
  cr_assert_eq(one(&big[0], SHARDD_OK).created, 1);
  cr_assert_eq(one(&big[5000], SHARDD_OK).created, 1);
  cr_assert_eq(one(&big[8999], SHARDD_OK).created, 1);

  big_specs("b");
  cr_assert_eq(shardd_views_register(c, BIG, big, bigi, bige), SHARDD_OK, "%s",
               shardd_last_error(c));
  for (int i = 0; i < BIG; i++) {
    cr_assert_eq(bigi[i].created, 1);
    cr_assert(i == 0 || bigi[i].id != bigi[i - 1].id);
    cr_assert_eq(bige[i], SHARDD_OK);
  }
  /* unregister them all in one call, then they are gone */
  static uint64_t ids[BIG];
  for (int i = 0; i < BIG; i++)
    ids[i] = bigi[i].id;
  cr_assert_eq(shardd_views_unregister(c, BIG, ids, NULL, NULL), SHARDD_OK, "%s",
               shardd_last_error(c));
  cr_assert_eq(shardd_view_unregister(c, ids[0]), SHARDD_E_NOT_FOUND, "%s",
               shardd_last_error(c));
  cr_assert(strstr(shardd_last_error(c), "unregistered"), "%s",
            shardd_last_error(c));
  cr_assert_eq(shardd_view_unregister(c, ids[BIG - 1]), SHARDD_E_NOT_FOUND);
}

Test(dispatch, unregister_checks_every_id_before_any_goes) {
  shardd_view_spec s[2] = {spec("u0", 0, 4, shape4, 2, 1),
                           spec("u1", 4, 4, shape4, 2, 1)};
  shardd_view_info vi[2];
  cr_assert_eq(shardd_views_register(c, 2, s, vi, NULL), SHARDD_OK);
  uint64_t ids[4] = {vi[0].id, 999999, vi[1].id, vi[0].id};
  shardd_err errs[4];
  shardd_err rc = shardd_views_unregister(c, 4, ids, NULL, errs);
  cr_assert_eq(rc, SHARDD_E_NOT_FOUND, "%s: %s", shardd_err_name(rc),
               shardd_last_error(c));
  cr_assert_eq(errs[0], SHARDD_OK);
  cr_assert_eq(errs[1], SHARDD_E_NOT_FOUND);
  cr_assert(strstr(shardd_last_error(c), "[1] E_NOT_FOUND"), "%s",
            shardd_last_error(c));
  /* a repeated id is refused too, naming the repeat */
  uint64_t dup[3] = {vi[0].id, vi[1].id, vi[0].id};
  rc = shardd_views_unregister(c, 3, dup, NULL, errs);
  cr_assert_eq(rc, SHARDD_E_INVAL, "%s", shardd_last_error(c));
  cr_assert_eq(errs[2], SHARDD_E_INVAL);
  cr_assert_eq(errs[0], SHARDD_OK);
  /* a wrong generation */
  uint64_t pair[2] = {vi[0].id, vi[1].id};
  uint64_t gens[2] = {vi[0].generation, vi[1].generation + 1};
  rc = shardd_views_unregister(c, 2, pair, gens, errs);
  cr_assert_eq(rc, SHARDD_E_STALE, "%s", shardd_last_error(c));
  cr_assert_eq(errs[1], SHARDD_E_STALE);
  /* none went: both are still there (attach) */
  cr_assert_eq(one(&s[0], SHARDD_OK).id, vi[0].id);
  cr_assert_eq(one(&s[1], SHARDD_OK).id, vi[1].id);
  uint64_t both[2] = {vi[0].id, vi[1].id};
  uint64_t good[2] = {vi[0].generation, vi[1].generation};
  cr_assert_eq(shardd_views_unregister(c, 2, both, good, NULL), SHARDD_OK, "%s",
               shardd_last_error(c));
  cr_assert_eq(one(&s[0], SHARDD_OK).generation, 2);
}

/* Frozen and trainable views in batches: the merged frozen ranges inspect
 * shows are those of the views kept, after a batch refused for a view
 * meeting the other kind (its good entries abandoned) and a batched
 * unregistering. Group g (32 elements from 32g): frozen [0,8) and [4,16),
 * trainable [16,24) and [20,32). */
#define FG 40
Test(dispatch, frozen_views_in_batches_merge_as_single_requests_would) {
  static const uint64_t o[4] = {0, 4, 16, 20}, l[4] = {8, 12, 8, 12};
  static char nm[4 * FG + 2][16];
  static int64_t sh[4 * FG + 2][1];
  static shardd_view_spec s[4 * FG + 2];
  static shardd_view_info vi[4 * FG + 2];
  for (int i = 0; i < 4 * FG; i++) {
    snprintf(nm[i], sizeof nm[i], "g%d.%d", i / 4, i % 4);
    sh[i][0] = (int64_t)l[i % 4];
    s[i] = spec(nm[i], (uint64_t)(i / 4) * 32 + o[i % 4], l[i % 4], sh[i], 1,
                i % 4 >= 2);
  }
  cr_assert_eq(shardd_views_register(c, 4 * FG, s, vi, NULL), SHARDD_OK, "%s",
               shardd_last_error(c));
  /* a good frozen view past the groups, then one meeting trainable [16,24)
   * of group 3: the batch goes whole */
  shardd_view_spec bad[2];
  int64_t b4[1] = {4};
  bad[0] = spec("late", 32 * FG, 4, b4, 1, 0);
  bad[1] = spec("meets", 3 * 32 + 14, 4, b4, 1, 0);
  shardd_err errs[2];
  cr_assert_eq(shardd_views_register(c, 2, bad, NULL, errs), SHARDD_E_OVERLAP);
  cr_assert_eq(errs[0], SHARDD_OK);
  /* odd groups lose their frozen [4,16) */
  uint64_t un[FG / 2];
  for (int g = 1; g < FG; g += 2)
    un[g / 2] = vi[4 * g + 1].id;
  cr_assert_eq(shardd_views_unregister(c, FG / 2, un, NULL, NULL), SHARDD_OK, "%s",
               shardd_last_error(c));
  char *js = NULL;
  cr_assert_eq(shardd_inspect_json(c, b.id, NULL, &js), SHARDD_OK, "%s",
               shardd_last_error(c));
  tj *j = tj_parse(js);
  cr_assert_not_null(j, "%s", js);
  const tj *fr = tj_need(j, "frozen", TJ_ARR);
  cr_assert_eq(fr->n, FG, "one frozen range per group, \"late\" abandoned");
  for (int g = 0; g < FG; g++) {
    cr_expect_eq(tj_need(fr->kids[g], "offset", TJ_NUM)->num, 32 * g, "group %d", g);
    cr_expect_eq(tj_need(fr->kids[g], "numel", TJ_NUM)->num, g % 2 ? 8 : 16,
                 "group %d", g);
  }
  tj_free(j);
  shardd_free(js);
}

Test(dispatch, view_held_by_an_optimizer_refuses_the_batch) {
  shardd_view_spec s[2] = {spec("h0", 0, 4, shape4, 2, 1),
                           spec("h1", 4, 4, shape4, 2, 1)};
  shardd_view_info vi[2];
  cr_assert_eq(shardd_views_register(c, 2, s, vi, NULL), SHARDD_OK);
  shardd_param_ref ref = {vi[1].id, "h1"};
  shardd_param_group g = {&ref, 1, {0}};
  uint64_t opt;
  cr_assert_eq(shardd_optimizer_register(c, "opt", SHARDD_OPTIM_SGD, NULL, &g, 1,
                                         &opt),
               SHARDD_OK, "%s", shardd_last_error(c));
  uint64_t ids[2] = {vi[0].id, vi[1].id};
  shardd_err errs[2];
  cr_assert_eq(shardd_views_unregister(c, 2, ids, NULL, errs), SHARDD_E_BUSY);
  cr_assert_eq(errs[0], SHARDD_OK);
  cr_assert_eq(errs[1], SHARDD_E_BUSY);
  cr_assert(strstr(shardd_last_error(c), "optimizer"), "%s",
            shardd_last_error(c));
  cr_assert_eq(one(&s[0], SHARDD_OK).id, vi[0].id, "h0 stayed");
}

Test(dispatch, client_checks_arguments_before_sending) {
  shardd_view_spec s[2] = {spec("n0", 0, 4, shape4, 2, 1),
                           spec(NULL, 4, 4, shape4, 2, 1)};
  shardd_err errs[2];
  cr_assert_eq(shardd_views_register(c, 2, s, NULL, errs), SHARDD_E_INVAL);
  cr_assert_eq(errs[1], SHARDD_E_INVAL);
  cr_assert_eq(one(&s[0], SHARDD_OK).created, 1, "nothing was sent");
  cr_assert_eq(shardd_views_register(c, 2, NULL, NULL, NULL), SHARDD_E_INVAL);
  shardd_view_spec small = s[0];
  small.size = sizeof(size_t);
  cr_assert_eq(shardd_views_register(c, 1, &small, NULL, NULL), SHARDD_E_INVAL);
  cr_assert_eq(shardd_views_register(NULL, 1, s, NULL, NULL), SHARDD_E_INVAL);
  cr_assert_eq(shardd_views_unregister(c, 1, NULL, NULL, NULL), SHARDD_E_INVAL);
}

/* What libshardd never sends: no operation, too many dimensions, a
 * missing body of an entry. Answered, and the daemon goes on. */
Test(dispatch, malformed_batches_are_answered) {
  test_raw r;
  test_raw_open(&d, &r);
  test_raw_hello(&r, "raw", 0, 1);
  shardd_buffer_info rb;
  test_raw_register_buffer(&r, "flat", SHARDD_DTYPE_FP32, 64, &rb);
  Shardwire__Request req = SHARDWIRE__REQUEST__INIT;
  Shardwire__ViewsBatch vb = SHARDWIRE__VIEWS_BATCH__INIT;
  req.body_case = SHARDWIRE__REQUEST__BODY_VIEWS_BATCH;
  req.views_batch = &vb;
  uint64_t seq = test_raw_send(&r, &req);
  shardwire__response__free_unpacked(test_raw_expect(&r, seq, SHARDD_E_INVAL),
                                     NULL);

  int64_t dims[65];
  for (int i = 0; i < 65; i++)
    dims[i] = 1;
  Shardwire__RegisterView rv[2] = {SHARDWIRE__REGISTER_VIEW__INIT,
                                   SHARDWIRE__REGISTER_VIEW__INIT};
  rv[0].buffer = rb.id;
  rv[0].name = "deep";
  rv[0].numel = 1;
  rv[0].n_shape = 65;
  rv[0].shape = dims;
  rv[1].buffer = 424242; /* no such buffer */
  rv[1].name = "lost";
  rv[1].numel = 1;
  Shardwire__RegisterView *rvp[2] = {&rv[0], &rv[1]};
  Shardwire__RegisterViews rq = SHARDWIRE__REGISTER_VIEWS__INIT;
  rq.n_views = 2;
  rq.views = rvp;
  rq.has_first_index = 1;
  rq.first_index = 100;
  vb.op_case = SHARDWIRE__VIEWS_BATCH__OP_REGISTER;
  vb.register_ = &rq;
  req.seq = 0;
  seq = test_raw_send(&r, &req);
  Shardwire__Response *resp = test_raw_expect(&r, seq, SHARDD_E_RANGE);
  cr_assert_eq(resp->body_case, SHARDWIRE__RESPONSE__BODY_VIEWS_BATCH);
  const Shardwire__ViewsBatchReply *rep = resp->views_batch;
  cr_assert_eq(rep->errors_total, 2);
  cr_assert_eq(rep->n_errors, 2);
  cr_assert_eq(rep->errors[0]->index, 100);
  cr_assert_eq(rep->errors[0]->code, SHARDWIRE__STATUS_CODE__E_RANGE);
  cr_assert_eq(rep->errors[1]->index, 101);
  cr_assert_eq(rep->errors[1]->code, SHARDWIRE__STATUS_CODE__E_NOT_FOUND);
  cr_assert(strstr(resp->message, "from entry 100"), "%s", resp->message);
  shardwire__response__free_unpacked(resp, NULL);

  /* an empty batch registers nothing and says so */
  rq.n_views = 0;
  req.seq = 0;
  seq = test_raw_send(&r, &req);
  resp = test_raw_expect(&r, seq, SHARDD_OK);
  cr_assert_eq(resp->views_batch->n_views, 0);
  shardwire__response__free_unpacked(resp, NULL);
  test_raw_sync(&r);
  test_raw_close(&r);
  cr_assert(test_daemon_alive(&d));
}

/* The request after a refused one is never sent (libshardd packs it while
 * the daemon works on the one before): none of its views was registered,
 * so each comes back new, at generation 1. */
Test(dispatch, the_request_after_a_refused_one_is_never_sent) {
  big_specs("n");
  big[3].numel = 3; /* in the first request: shape says 4 */
  cr_assert_eq(shardd_views_register(c, 3 * SHARDD_VIEWS_PER_REQUEST, big,
                                     NULL, bige),
               SHARDD_E_MISMATCH);
  for (int i = SHARDD_VIEWS_PER_REQUEST; i < 3 * SHARDD_VIEWS_PER_REQUEST;
       i += SHARDD_VIEWS_PER_REQUEST / 2) {
    shardd_view_info vi = one(&big[i], SHARDD_OK);
    cr_assert_eq(vi.created, 1, "view %d", i);
    cr_assert_eq(vi.generation, 1, "view %d was registered before", i);
  }
}

/* A refusal in the first request: its entries' codes, the rest not
 * checked, and nothing kept. */
Test(dispatch, refusal_in_the_first_request_leaves_the_rest_unchecked) {
  big_specs("z");
  for (int i = 0; i < 3000; i++)
    big[i].numel = 3; /* shape says 4 */
  shardd_err rc = shardd_views_register(c, 3000, big, NULL, bige);
  cr_assert_eq(rc, SHARDD_E_MISMATCH);
  const char *m = shardd_last_error(c);
  char want[96];
  snprintf(want, sizeof want, "%d of %d views refused", SHARDD_VIEWS_PER_REQUEST,
           SHARDD_VIEWS_PER_REQUEST);
  cr_assert(strstr(m, want), "%.200s", m);
  snprintf(want, sizeof want, "and %d entries after them not checked",
           3000 - SHARDD_VIEWS_PER_REQUEST);
  cr_assert(strstr(m, want), "%s", m + (strlen(m) > 300 ? strlen(m) - 300 : 0));
  for (int i = 0; i < 3000; i++)
    cr_assert_eq(bige[i], i < SHARDD_VIEWS_PER_REQUEST ? SHARDD_E_MISMATCH
                                                       : SHARDD_E_STATE,
                 "entry %d: %s", i, shardd_err_name(bige[i]));
}

/* A raw request of more refused entries than the message has room for:
 * every one in the reply's errors, the message cut with a count. */
Test(dispatch, thousands_of_refusals_are_counted_and_bounded) {
  test_raw r;
  test_raw_open(&d, &r);
  test_raw_hello(&r, "raw", 0, 1);
  shardd_buffer_info rb;
  test_raw_register_buffer(&r, "flat", SHARDD_DTYPE_FP32, 64, &rb);
  enum { N = 3000 };
  static Shardwire__RegisterView rv[N];
  static Shardwire__RegisterView *rvp[N];
  static char nm[N][16];
  for (int i = 0; i < N; i++) {
    shardwire__register_view__init(&rv[i]);
    snprintf(nm[i], sizeof nm[i], "v%d", i);
    rv[i].buffer = rb.id;
    rv[i].name = nm[i];
    rv[i].offset = 60;
    rv[i].numel = 8; /* past the end of 64 */
    rvp[i] = &rv[i];
  }
  Shardwire__RegisterViews rq = SHARDWIRE__REGISTER_VIEWS__INIT;
  rq.n_views = N;
  rq.views = rvp;
  Shardwire__ViewsBatch vb = SHARDWIRE__VIEWS_BATCH__INIT;
  vb.op_case = SHARDWIRE__VIEWS_BATCH__OP_REGISTER;
  vb.register_ = &rq;
  Shardwire__Request req = SHARDWIRE__REQUEST__INIT;
  req.body_case = SHARDWIRE__REQUEST__BODY_VIEWS_BATCH;
  req.views_batch = &vb;
  uint64_t seq = test_raw_send(&r, &req);
  Shardwire__Response *resp = test_raw_expect(&r, seq, SHARDD_E_RANGE);
  cr_assert(strstr(resp->message, "3000 of 3000 views refused"), "%.200s",
            resp->message);
  cr_assert(strstr(resp->message, "more"), "cut with a count: %s",
            resp->message + strlen(resp->message) - 100);
  cr_assert_lt(strlen(resp->message), 70 * 1024);
  cr_assert_eq(resp->views_batch->errors_total, N);
  cr_assert_eq(resp->views_batch->n_errors, N);
  for (int i = 0; i < N; i++)
    cr_assert_eq(resp->views_batch->errors[i]->index, (uint32_t)i);
  shardwire__response__free_unpacked(resp, NULL);
  test_raw_sync(&r);
  test_raw_close(&r);
}

/* ---- batches of buffers (BuffersBatch) -------------------------------- */

static shardd_buffer_spec bspec(const char *name, shardd_dtype dt,
                                uint64_t numel) {
  shardd_buffer_spec s = SHARDD_BUFFER_SPEC_INIT;
  s.name = name;
  s.dtype = dt;
  s.numel = numel;
  return s;
}

Test(dispatch, buffers_batch_maps_each_buffer_s_own_block) {
  /* every entry's descriptor is its own: a pattern written through each
   * shard comes back in that buffer's gather area (world 1: the gather
   * copies the rank's shard) */
  enum { N = 7 };
  shardd_buffer_spec s[N];
  char bnm[N][16];
  for (int i = 0; i < N; i++) {
    snprintf(bnm[i], sizeof bnm[i], "bb%d", i);
    s[i] = bspec(bnm[i], SHARDD_DTYPE_FP32, 100 + 37 * (uint64_t)i);
  }
  shardd_buffer_info bi[N];
  shardd_err errs[N];
  cr_assert_eq(shardd_buffers_register(c, N, s, bi, errs), SHARDD_OK, "%s",
               shardd_last_error(c));
  for (int i = 0; i < N; i++) {
    cr_assert_eq(errs[i], SHARDD_OK);
    cr_assert_eq(bi[i].created, 1);
    cr_assert_eq(bi[i].numel, 100 + 37 * (uint64_t)i);
    cr_assert_eq(bi[i].generation, 1);
    cr_assert(i == 0 || bi[i].id != bi[i - 1].id);
    float *p = bi[i].shard;
    for (uint64_t k = 0; k < bi[i].numel; k++)
      p[k] = (float)(i * 1000 + (int)k);
  }
  for (int i = 0; i < N; i++) {
    cr_assert_eq(shardd_gather(c, bi[i].id), SHARDD_OK, "%s",
                 shardd_last_error(c));
    const float *g = bi[i].gather;
    for (uint64_t k = 0; k < bi[i].numel; k++)
      cr_assert_eq(g[k], (float)(i * 1000 + (int)k), "buffer %d elem %" PRIu64,
                   i, k);
  }
  /* attaching again, one by one, finds the same buffers and mappings */
  shardd_buffer_info one_b;
  cr_assert_eq(shardd_buffer_register(c, "bb3", SHARDD_DTYPE_FP32, 100 + 37 * 3,
                                      &one_b), SHARDD_OK);
  cr_assert_eq(one_b.id, bi[3].id);
  cr_assert_eq(one_b.created, 0);
  cr_assert_eq(one_b.shard, bi[3].shard);
  /* and a batch attaching to them says so */
  shardd_buffer_info again[N];
  cr_assert_eq(shardd_buffers_register(c, N, s, again, NULL), SHARDD_OK);
  for (int i = 0; i < N; i++) {
    cr_assert_eq(again[i].id, bi[i].id);
    cr_assert_eq(again[i].created, 0);
  }
  cr_assert_eq(shardd_buffers_register(c, 0, NULL, NULL, NULL), SHARDD_OK);
}

#define BBIG 600 /* three requests of SHARDD_BUFFERS_PER_REQUEST */
static char bbnames[BBIG][24];
static shardd_buffer_spec bbig[BBIG];
static shardd_buffer_info bbi[BBIG];
static shardd_err bbe[BBIG];

Test(dispatch, buffers_call_longer_than_a_request_is_undone_whole) {
  cr_assert_gt(BBIG, 2 * SHARDD_BUFFERS_PER_REQUEST);
  for (int i = 0; i < BBIG; i++) {
    snprintf(bbnames[i], sizeof bbnames[i], "big%d", i);
    bbig[i] = bspec(bbnames[i], SHARDD_DTYPE_BF16, 64);
  }
  bbig[520].dtype = (shardd_dtype)77; /* in the third request */
  bbig[521].numel = 0;
  shardd_err rc = shardd_buffers_register(c, BBIG, bbig, bbi, bbe);
  cr_assert_eq(rc, SHARDD_E_DTYPE, "%s: %s", shardd_err_name(rc),
               shardd_last_error(c));
  for (int i = 0; i < BBIG; i++)
    cr_assert_eq(bbe[i], i == 520 ? SHARDD_E_DTYPE
                         : i == 521 ? SHARDD_E_RANGE : SHARDD_OK,
                 "entry %d: %s", i, shardd_err_name(bbe[i]));
  const char *m = shardd_last_error(c);
  cr_assert(strstr(m, "[520] E_DTYPE") && strstr(m, "[521] E_RANGE") &&
                strstr(m, "2 of the 100 buffers from entry 500 refused"),
            "indices count from the call's first entry: %s", m);
  /* nothing is left: the refused request's buffers were abandoned (their
   * generation back to none), the earlier requests' unregistered */
  shardd_buffer_info x;
  cr_assert_eq(shardd_buffer_register(c, "big519", SHARDD_DTYPE_BF16, 64, &x),
               SHARDD_OK);
  cr_assert_eq(x.created, 1);
  cr_assert_eq(x.generation, 1);
  cr_assert_eq(shardd_buffer_register(c, "big0", SHARDD_DTYPE_BF16, 64, &x),
               SHARDD_OK);
  cr_assert_eq(x.created, 1);
  cr_assert_eq(x.generation, 2); /* it was registered, then unregistered */
  uint64_t two[2] = {x.id, 0};
  cr_assert_eq(shardd_buffer_register(c, "big519", SHARDD_DTYPE_BF16, 64, &x),
               SHARDD_OK);
  two[1] = x.id;
  cr_assert_eq(shardd_buffers_unregister(c, 2, two, NULL, NULL), SHARDD_OK, "%s",
               shardd_last_error(c));

  bbig[520].dtype = SHARDD_DTYPE_BF16;
  bbig[521].numel = 64;
  cr_assert_eq(shardd_buffers_register(c, BBIG, bbig, bbi, bbe), SHARDD_OK, "%s",
               shardd_last_error(c));
  static uint64_t ids[BBIG];
  for (int i = 0; i < BBIG; i++) {
    cr_assert_eq(bbi[i].created, 1);
    cr_assert_neq(bbi[i].shard, NULL);
    ((uint16_t *)bbi[i].shard)[0] = (uint16_t)i; /* mapped, writable */
    ids[i] = bbi[i].id;
  }
  /* the client's table of mappings grew past its first size while these
   * were mapped: each id still finds its own block */
  for (int i = 0; i < BBIG; i += 149) {
    shardd_area a;
    cr_assert_eq(shardd_gather_area(c, bbi[i].id, 1, &a), SHARDD_OK, "%s",
                 shardd_last_error(c));
    cr_assert_eq(a.gather, bbi[i].gather);
    cr_assert_eq(a.grad, bbi[i].grad);
    cr_assert_eq(((uint16_t *)a.gather)[0], (uint16_t)i);
  }
  cr_assert_eq(shardd_buffers_unregister(c, BBIG, ids, NULL, NULL), SHARDD_OK,
               "%s", shardd_last_error(c));
  cr_assert_eq(shardd_buffer_unregister(c, ids[0]), SHARDD_E_NOT_FOUND);
  cr_assert_eq(shardd_buffer_unregister(c, ids[BBIG - 1]), SHARDD_E_NOT_FOUND);
}

Test(dispatch, views_unregister_names_each_repeat_after_the_first) {
  shardd_view_spec s[3] = {spec("r0", 0, 4, shape4, 2, 1),
                           spec("r1", 4, 4, shape4, 2, 1),
                           spec("r2", 8, 4, shape4, 2, 1)};
  shardd_view_info vi[3];
  cr_assert_eq(shardd_views_register(c, 3, s, vi, NULL), SHARDD_OK, "%s",
               shardd_last_error(c));
  /* r0 three times, r2 twice: the later ones refused, the first kept */
  uint64_t ids[6] = {vi[0].id, vi[2].id, vi[0].id, vi[1].id, vi[0].id, vi[2].id};
  shardd_err errs[6];
  shardd_err rc = shardd_views_unregister(c, 6, ids, NULL, errs);
  cr_assert_eq(rc, SHARDD_E_INVAL, "%s", shardd_last_error(c));
  const shardd_err want[6] = {SHARDD_OK, SHARDD_OK, SHARDD_E_INVAL, SHARDD_OK,
                              SHARDD_E_INVAL, SHARDD_E_INVAL};
  for (int i = 0; i < 6; i++)
    cr_expect_eq(errs[i], want[i], "entry %d: %s", i, shardd_err_name(errs[i]));
  char named[64];
  snprintf(named, sizeof named, "view %" PRIu64 " is named twice", vi[2].id);
  cr_expect(strstr(shardd_last_error(c), named), "%s", shardd_last_error(c));
  /* nothing went; each once, the same ids again: they all go */
  uint64_t once[3] = {vi[2].id, vi[0].id, vi[1].id};
  cr_assert_eq(shardd_views_unregister(c, 3, once, NULL, errs), SHARDD_OK, "%s",
               shardd_last_error(c));
  shardd_view_info again[3];
  cr_assert_eq(shardd_views_register(c, 3, s, again, NULL), SHARDD_OK);
  for (int i = 0; i < 3; i++)
    cr_expect_eq(again[i].created, 1);
}

Test(dispatch, buffers_unregister_checks_every_id_before_any_goes) {
  shardd_buffer_spec s[3] = {bspec("u0", SHARDD_DTYPE_FP32, 8),
                             bspec("u1", SHARDD_DTYPE_FP32, 8),
                             bspec("u2", SHARDD_DTYPE_FP32, 8)};
  shardd_buffer_info bi[3];
  cr_assert_eq(shardd_buffers_register(c, 3, s, bi, NULL), SHARDD_OK);
  uint64_t ids[4] = {bi[0].id, bi[1].id, 999999, bi[0].id};
  shardd_err errs[4];
  shardd_err rc = shardd_buffers_unregister(c, 4, ids, NULL, errs);
  cr_assert_eq(rc, SHARDD_E_NOT_FOUND, "%s: %s", shardd_err_name(rc),
               shardd_last_error(c));
  cr_assert_eq(errs[0], SHARDD_OK);
  cr_assert_eq(errs[2], SHARDD_E_NOT_FOUND);
  /* a repeated id, and a stale generation */
  uint64_t gens[3] = {0, bi[1].generation + 1, 0};
  uint64_t rep[3] = {bi[0].id, bi[1].id, bi[0].id};
  rc = shardd_buffers_unregister(c, 3, rep, gens, errs);
  cr_assert_eq(rc, SHARDD_E_STALE, "%s", shardd_last_error(c));
  cr_assert_eq(errs[1], SHARDD_E_STALE);
  rc = shardd_buffers_unregister(c, 3, rep, NULL, errs);
  cr_assert_eq(rc, SHARDD_E_INVAL, "%s", shardd_last_error(c));
  cr_assert_eq(errs[2], SHARDD_E_INVAL);
  cr_assert(strstr(shardd_last_error(c), "named twice"), "%s",
            shardd_last_error(c));
  /* none went: all three still attach */
  shardd_buffer_info again[3];
  cr_assert_eq(shardd_buffers_register(c, 3, s, again, NULL), SHARDD_OK);
  for (int i = 0; i < 3; i++)
    cr_assert_eq(again[i].created, 0);
  uint64_t all[3] = {bi[0].id, bi[1].id, bi[2].id};
  cr_assert_eq(shardd_buffers_unregister(c, 3, all, NULL, NULL), SHARDD_OK);
}

Test(dispatch, buffers_batch_checksum_refusal_puts_the_first_back) {
  /* rank 0 records a checksum, then a refused batch of rank 0 records
   * another on the attached buffer: the refusal puts the first back, so
   * rank 1 sending the first is accepted (with the second it would be
   * E_MISMATCH) */
  shardd_client_t *r0 = test_connect(&d, "ck", 0, 2);
  shardd_client_t *r1 = test_connect(&d, "ck", 1, 2);
  shardd_buffer_opts o = SHARDD_BUFFER_OPTS_INIT;
  o.has_init_checksum = 1;
  o.init_checksum = 0x1111;
  shardd_buffer_info x;
  cr_assert_eq(shardd_buffer_register_opts(r0, "ck", SHARDD_DTYPE_FP32, 16, &o,
                                           &x), SHARDD_OK, "%s",
               shardd_last_error(r0));
  shardd_buffer_spec s[2] = {bspec("ck", SHARDD_DTYPE_FP32, 16),
                             bspec("ck2", SHARDD_DTYPE_FP32, 0)};
  s[0].has_init_checksum = 1;
  s[0].init_checksum = 0x2222;
  shardd_buffer_info bi[2];
  cr_assert_eq(shardd_buffers_register(r0, 2, s, bi, NULL), SHARDD_E_RANGE);
  cr_assert_eq(shardd_buffer_register_opts(r1, "ck", SHARDD_DTYPE_FP32, 16, &o,
                                           &x), SHARDD_OK, "%s",
               shardd_last_error(r1));
  cr_assert_eq(x.created, 0);
  /* and the rule itself holds in a batch: rank 1 with another checksum */
  s[0].init_checksum = 0x3333;
  s[1].numel = 4;
  shardd_err errs[2];
  cr_assert_eq(shardd_buffers_register(r1, 2, s, bi, errs), SHARDD_E_MISMATCH);
  cr_assert_eq(errs[0], SHARDD_E_MISMATCH);
  cr_assert_eq(errs[1], SHARDD_OK);
  shardd_close(r0);
  shardd_close(r1);
}

Test(dispatch, malformed_buffer_batches_are_answered) {
  test_raw r;
  test_raw_open(&d, &r);
  test_raw_hello(&r, "rawb", 0, 1);
  Shardwire__Request req = SHARDWIRE__REQUEST__INIT;
  Shardwire__BuffersBatch bb = SHARDWIRE__BUFFERS_BATCH__INIT;
  req.body_case = SHARDWIRE__REQUEST__BODY_BUFFERS_BATCH;
  req.buffers_batch = &bb;
  uint64_t seq = test_raw_send(&r, &req);
  shardwire__response__free_unpacked(test_raw_expect(&r, seq, SHARDD_E_INVAL),
                                     NULL);
  /* over the per-request count: refused whole, nothing made */
  enum { OVER = SHARDD_BUFFERS_PER_REQUEST + 1 };
  static Shardwire__RegisterBuffer rb[OVER];
  static Shardwire__RegisterBuffer *rbp[OVER];
  static char nm[OVER][16];
  for (int i = 0; i < OVER; i++) {
    shardwire__register_buffer__init(&rb[i]);
    snprintf(nm[i], sizeof nm[i], "o%d", i);
    rb[i].name = nm[i];
    rb[i].dtype = SHARDWIRE__DTYPE__FP32;
    rb[i].numel = 4;
    rbp[i] = &rb[i];
  }
  Shardwire__RegisterBuffers rq = SHARDWIRE__REGISTER_BUFFERS__INIT;
  rq.n_buffers = OVER;
  rq.buffers = rbp;
  bb.op_case = SHARDWIRE__BUFFERS_BATCH__OP_REGISTER;
  bb.register_ = &rq;
  req.seq = 0;
  seq = test_raw_send(&r, &req);
  Shardwire__Response *resp = test_raw_expect(&r, seq, SHARDD_E_LIMIT);
  cr_assert(strstr(resp->message, "at most 250"), "%s", resp->message);
  shardwire__response__free_unpacked(resp, NULL);
  /* an empty batch registers nothing and says so */
  rq.n_buffers = 0;
  req.seq = 0;
  seq = test_raw_send(&r, &req);
  resp = test_raw_expect(&r, seq, SHARDD_OK);
  cr_assert_eq(resp->body_case, SHARDWIRE__RESPONSE__BODY_BUFFERS_BATCH);
  cr_assert_eq(resp->buffers_batch->n_buffers, 0);
  shardwire__response__free_unpacked(resp, NULL);
  test_raw_sync(&r);
  test_raw_close(&r);
  cr_assert(test_daemon_alive(&d));
  /* none of the 251 was made */
  shardd_client_t *o = test_connect(&d, "rawb", 0, 1);
  shardd_buffer_info x;
  cr_assert_eq(shardd_buffer_register(o, "o0", SHARDD_DTYPE_FP32, 4, &x),
               SHARDD_OK);
  cr_assert_eq(x.created, 1);
  shardd_close(o);
}

/* ---- a batch's descriptors on the wire -------------------------------- */

/* Reads one frame from r byte-exact to its end with room for 64
 * descriptors a read: its payload (caller frees), its descriptors in fds
 * (*nfds), the reads that carried any (*fd_reads) and the most one read
 * carried (*most). */
static uint8_t *read_frame_fds(test_raw *r, int *fds, int maxfds, int *nfds,
                               int *fd_reads, int *most, size_t *len) {
  uint8_t hdr[SHARDD_FRAME_HEADER], *payload = NULL;
  size_t got = 0, want = sizeof hdr;
  *nfds = *fd_reads = *most = 0;
  while (got < want) {
    union {
      struct cmsghdr align;
      char space[CMSG_SPACE(sizeof(int) * 64)];
    } ctl;
    uint8_t *dst = got < sizeof hdr ? hdr + got : payload + got - sizeof hdr;
    size_t room = got < sizeof hdr ? sizeof hdr - got : want - got;
    struct iovec iov = {dst, room};
    struct msghdr msg = {0};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = ctl.space;
    msg.msg_controllen = sizeof ctl.space;
    ssize_t n = recvmsg(r->fd, &msg, MSG_CMSG_CLOEXEC);
    cr_assert_gt(n, 0, "recvmsg: %s", n < 0 ? strerror(errno) : "EOF");
    cr_assert_eq(msg.msg_flags & MSG_CTRUNC, 0, "descriptors cut off");
    int here = 0;
    for (struct cmsghdr *cm = CMSG_FIRSTHDR(&msg); cm; cm = CMSG_NXTHDR(&msg, cm))
      if (cm->cmsg_level == SOL_SOCKET && cm->cmsg_type == SCM_RIGHTS) {
        int k = (int)((cm->cmsg_len - CMSG_LEN(0)) / sizeof(int));
        cr_assert_leq(*nfds + k, maxfds);
        memcpy(fds + *nfds, CMSG_DATA(cm), (size_t)k * sizeof(int));
        *nfds += k;
        here += k;
      }
    if (here) {
      ++*fd_reads;
      if (here > *most)
        *most = here;
    }
    got += (size_t)n;
    if (got == sizeof hdr && payload == NULL) {
      *len = (size_t)hdr[0] | (size_t)hdr[1] << 8 | (size_t)hdr[2] << 16 |
             (size_t)hdr[3] << 24;
      want += *len;
      payload = malloc(*len ? *len : 1);
      cr_assert_not_null(payload);
    }
  }
  return payload;
}

/* Sends a RegisterBuffers of n buffers "<prefix><i>" of 64 + 1024 i
 * fp32, each name padded with 'x' to namelen bytes (0: not). */
static uint64_t send_buffers_batch_ex(test_raw *r, const char *prefix, int n,
                                      int namelen) {
  Shardwire__RegisterBuffer *rb = calloc((size_t)n, sizeof *rb);
  Shardwire__RegisterBuffer **rbp = calloc((size_t)n, sizeof *rbp);
  char (*nm)[256] = calloc((size_t)n, sizeof *nm);
  cr_assert(rb && rbp && nm);
  cr_assert_lt(namelen, 256);
  for (int i = 0; i < n; i++) {
    shardwire__register_buffer__init(&rb[i]);
    int k = snprintf(nm[i], sizeof nm[i], "%s%d", prefix, i);
    for (; k < namelen; k++)
      nm[i][k] = 'x';
    rb[i].name = nm[i];
    rb[i].dtype = SHARDWIRE__DTYPE__FP32;
    rb[i].numel = 64 + 1024 * (uint64_t)i; /* every block of its own size */
    rbp[i] = &rb[i];
  }
  Shardwire__Request req = SHARDWIRE__REQUEST__INIT;
  Shardwire__BuffersBatch bb = SHARDWIRE__BUFFERS_BATCH__INIT;
  Shardwire__RegisterBuffers rq = SHARDWIRE__REGISTER_BUFFERS__INIT;
  rq.n_buffers = (size_t)n;
  rq.buffers = rbp;
  bb.op_case = SHARDWIRE__BUFFERS_BATCH__OP_REGISTER;
  bb.register_ = &rq;
  req.body_case = SHARDWIRE__REQUEST__BODY_BUFFERS_BATCH;
  req.buffers_batch = &bb;
  uint64_t seq = test_raw_send(r, &req);
  free(rb);
  free(rbp);
  free(nm);
  return seq;
}

static uint64_t send_buffers_batch(test_raw *r, const char *prefix, int n) {
  return send_buffers_batch_ex(r, prefix, n, 0);
}

/* Reads the reply to seq, a batch of n buffers: each descriptor is its
 * own entry's block (sizes in order), none came with more than a reader
 * of SHARDD_FRAME_FDS_PER_READ takes; the reads that carried descriptors. */
static int expect_buffers_reply(test_raw *r, uint64_t seq, int n) {
  int fds[SHARDD_BUFFERS_PER_REQUEST], nfds, fd_reads, most;
  size_t len = 0;
  uint8_t *p = read_frame_fds(r, fds, SHARDD_BUFFERS_PER_REQUEST, &nfds,
                              &fd_reads, &most, &len);
  Shardwire__Response *resp = shardwire__response__unpack(NULL, len, p);
  free(p);
  cr_assert_not_null(resp);
  cr_assert_eq(resp->seq, seq);
  cr_assert_eq(resp->code, SHARDWIRE__STATUS_CODE__OK, "%s", resp->message);
  cr_assert_eq(resp->buffers_batch->n_buffers, (size_t)n);
  cr_assert_eq(nfds, n);
  cr_assert_leq(most, SHARDD_FRAME_FDS_PER_READ);
  for (int i = 0; i < n; i++) {
    struct stat st;
    cr_assert_eq(fstat(fds[i], &st), 0);
    cr_assert_eq((uint64_t)st.st_size,
                 resp->buffers_batch->buffers[i]->block_bytes,
                 "descriptor %d is entry %d's block", i, i);
    close(fds[i]);
  }
  shardwire__response__free_unpacked(resp, NULL);
  return fd_reads;
}

Test(dispatch, buffers_batch_descriptors_come_in_reads_of_sixteen) {
  /* a reply's descriptors go SHARDD_FRAME_FDS_PER_READ to a write (what
   * every libshardd's reads take), not one write and one read each */
  test_raw r;
  test_raw_open(&d, &r);
  test_raw_hello(&r, "rawfds", 0, 1);
  uint64_t seq = send_buffers_batch(&r, "g", 40);
  int reads = expect_buffers_reply(&r, seq, 40);
  cr_assert_eq(reads, (40 + SHARDD_FRAME_FDS_PER_READ - 1) /
                          SHARDD_FRAME_FDS_PER_READ,
               "40 descriptors came in %d reads", reads);
  test_raw_sync(&r);
  test_raw_close(&r);
}

Test(dispatch, pipelined_buffers_batches_each_get_their_own_descriptors) {
  /* requests sent before any reply is read: the replies, written back to
   * back, still bring each entry its own descriptor, in order, frame by
   * frame */
  test_raw r;
  test_raw_open(&d, &r);
  test_raw_hello(&r, "rawpipe", 0, 1);
  enum { REQS = 12 };
  uint64_t seq[REQS];
  for (int q = 0; q < REQS; q++) {
    char prefix[16];
    snprintf(prefix, sizeof prefix, "p%d.", q);
    seq[q] = send_buffers_batch(&r, prefix, SHARDD_BUFFERS_PER_REQUEST - q);
  }
  for (int q = 0; q < REQS; q++)
    expect_buffers_reply(&r, seq[q], SHARDD_BUFFERS_PER_REQUEST - q);
  test_raw_sync(&r);
  test_raw_close(&r);
}

Test(dispatch, buffers_replies_cut_off_mid_payload_keep_their_descriptors) {
  /* replies of 250 entries with 255-byte names (some 80 KiB each, past
   * one socket buffer write) pipelined: the socket fills inside a reply's
   * last part too, after its last descriptors went, and the rest follows
   * without them; every reply still brings its own descriptors */
  test_raw r;
  test_raw_open(&d, &r);
  test_raw_hello(&r, "rawlong", 0, 1);
  enum { REQS = 12 };
  /* the requests (70 KiB each) from a child: the daemon stops reading
   * them while this reads no reply (its reply bounds), so one sender
   * alone would wait for itself */
  uint64_t first = r.seq + 1;
  pid_t pid = fork();
  cr_assert_geq(pid, 0);
  if (pid == 0) {
    for (int q = 0; q < REQS; q++)
      send_buffers_batch_ex(&r, "L", SHARDD_BUFFERS_PER_REQUEST, 255);
    _exit(0);
  }
  r.seq += REQS;
  for (int q = 0; q < REQS; q++)
    expect_buffers_reply(&r, first + (uint64_t)q, SHARDD_BUFFERS_PER_REQUEST);
  test_expect_child_ok(pid, "sender");
  test_raw_sync(&r);
  test_raw_close(&r);
}

/* ---- a batch's descriptors while its replies are queued --------------- */

/* The daemon's open descriptors (/proc/PID/fd). */
static int daemon_fds(void) {
  char path[64];
  snprintf(path, sizeof path, "/proc/%d/fd", (int)d.pid);
  DIR *dir = opendir(path);
  cr_assert_not_null(dir, "%s: %s", path, strerror(errno));
  int n = 0;
  for (struct dirent *e; (e = readdir(dir)) != NULL;)
    if (e->d_name[0] != '.')
      n++;
  closedir(dir);
  return n;
}

/* Waits up to 10 s for the daemon's descriptors to meet want (cmp 0:
 * equal, 1: above); the last count. */
static int daemon_fds_wait(int want, int cmp) {
  int n = daemon_fds();
  for (int i = 0; i < 1000 && (cmp ? n <= want : n != want); i++) {
    test_sleep_ms(10);
    n = daemon_fds();
  }
  return n;
}

/* Waits up to 10 s for Status to count descriptors in unread replies;
 * the count. */
static double unread_reply_fds_wait(void) {
  double n = 0;
  for (int i = 0; i < 1000 && n == 0; i++) {
    if (i)
      test_sleep_ms(10);
    char *out = NULL;
    cr_assert_eq(shardd_status_json(c, &out), SHARDD_OK, "%s",
                 shardd_last_error(c));
    tj *j = tj_parse(out);
    free(out);
    cr_assert_not_null(j);
    n = tj_need(j, "unread_reply_fds", TJ_NUM)->num;
    tj_free(j);
  }
  return n;
}

enum { QN = 40, QREQS = 100 };

/* Reads a buffers batch reply of QN entries to seq: its descriptors'
 * inodes in ino[], created flags in created[], ids in ids[] (any may be
 * NULL); every descriptor is its own entry's size. */
static void read_buffers_inodes(test_raw *r, uint64_t seq, ino_t *ino,
                                int *created, uint64_t *ids) {
  int fds[QN], nfds, fd_reads, most;
  size_t len = 0;
  uint8_t *p = read_frame_fds(r, fds, QN, &nfds, &fd_reads, &most, &len);
  Shardwire__Response *resp = shardwire__response__unpack(NULL, len, p);
  free(p);
  cr_assert_not_null(resp);
  cr_assert_eq(resp->seq, seq);
  cr_assert_eq(resp->code, SHARDWIRE__STATUS_CODE__OK, "%s", resp->message);
  cr_assert_eq(resp->buffers_batch->n_buffers, (size_t)QN);
  cr_assert_eq(nfds, QN);
  for (int i = 0; i < QN; i++) {
    struct stat st;
    cr_assert_eq(fstat(fds[i], &st), 0);
    cr_assert_eq((uint64_t)st.st_size,
                 resp->buffers_batch->buffers[i]->block_bytes,
                 "reply %" PRIu64 ": descriptor %d is not entry %d's block",
                 seq, i, i);
    if (ino)
      ino[i] = st.st_ino;
    if (created)
      created[i] = resp->buffers_batch->buffers[i]->created;
    if (ids)
      ids[i] = resp->buffers_batch->buffers[i]->id;
    close(fds[i]);
  }
  shardwire__response__free_unpacked(resp, NULL);
}

/* Unregisters the buffers ids[0..n) in one batch; waits for its OK. */
static void unregister_buffers(test_raw *r, const uint64_t *ids, int n) {
  Shardwire__UnregisterBuffer ub[QN], *ubp[QN];
  cr_assert_leq(n, QN);
  for (int i = 0; i < n; i++) {
    shardwire__unregister_buffer__init(&ub[i]);
    ub[i].id = ids[i];
    ubp[i] = &ub[i];
  }
  Shardwire__Request req = SHARDWIRE__REQUEST__INIT;
  Shardwire__BuffersBatch bb = SHARDWIRE__BUFFERS_BATCH__INIT;
  Shardwire__UnregisterBuffers rq = SHARDWIRE__UNREGISTER_BUFFERS__INIT;
  rq.n_buffers = (size_t)n;
  rq.buffers = ubp;
  bb.op_case = SHARDWIRE__BUFFERS_BATCH__OP_UNREGISTER;
  bb.unregister = &rq;
  req.body_case = SHARDWIRE__REQUEST__BODY_BUFFERS_BATCH;
  req.buffers_batch = &bb;
  uint64_t seq = test_raw_send(r, &req);
  shardwire__response__free_unpacked(test_raw_expect(r, seq, SHARDD_OK), NULL);
}

Test(dispatch, queued_buffers_replies_keep_their_blocks_when_unregistered) {
  /* A client that does not read: its batch replies queue in the daemon,
   * their descriptors (the blocks' own, borrowed) duplicated for the
   * queue. Another rank then unregisters those buffers, closing the
   * blocks' memfds, and registers others, which take the freed descriptor
   * numbers: each queued reply must still bring its own block, never the
   * other rank's (nor a closed descriptor). */
  test_raw a, o;
  test_raw_open(&d, &a);
  test_raw_hello(&a, "qfree", 0, 2);
  test_raw_open(&d, &o);
  test_raw_hello(&o, "qfree", 1, 2);
  ino_t orig[QN], cur[QN], other[QN], got[QN];
  uint64_t ids[QN];
  int created[QN];
  read_buffers_inodes(&a, send_buffers_batch(&a, "q", QN), orig, NULL, ids);
  memcpy(cur, orig, sizeof cur);
  uint64_t seq[QREQS];
  for (int q = 0; q < QREQS; q++)
    seq[q] = send_buffers_batch(&a, "q", QN);
  cr_assert_gt(unread_reply_fds_wait(), 0, "no reply was queued");
  unregister_buffers(&o, ids, QN);
  read_buffers_inodes(&o, send_buffers_batch(&o, "n", QN), other, NULL, NULL);
  for (int q = 0; q < QREQS; q++) {
    read_buffers_inodes(&a, seq[q], got, created, NULL);
    for (int i = 0; i < QN; i++) {
      for (int j = 0; j < QN; j++)
        cr_assert_neq(got[i], other[j],
                      "reply %d entry %d brought rank 1's block %d", q, i, j);
      if (created[i]) /* made again after the unregistering */
        cur[i] = got[i];
      cr_assert_eq(got[i], cur[i], "reply %d entry %d: not its block", q, i);
    }
  }
  test_raw_sync(&a);
  test_raw_close(&a);
  test_raw_close(&o);
  cr_assert(test_daemon_alive(&d));
}

Test(dispatch, queued_buffers_replies_leave_no_descriptor_behind) {
  /* replies queued, then read; then queued and their client gone: the
   * daemon's descriptors come back to what the blocks and sessions hold */
  shardd_client_t *keep = test_connect(&d, "qleak", 1, 2); /* the job stays */
  test_raw a;
  test_raw_open(&d, &a);
  test_raw_hello(&a, "qleak", 0, 2);
  ino_t orig[QN], got[QN];
  read_buffers_inodes(&a, send_buffers_batch(&a, "k", QN), orig, NULL, NULL);
  test_raw_sync(&a);
  int base = daemon_fds();
  uint64_t seq[QREQS];
  for (int q = 0; q < QREQS; q++)
    seq[q] = send_buffers_batch(&a, "k", QN);
  cr_assert_gt(daemon_fds_wait(base, 1), base, "no reply was queued");
  for (int q = 0; q < QREQS; q++) {
    read_buffers_inodes(&a, seq[q], got, NULL, NULL);
    cr_assert_arr_eq(got, orig, sizeof got);
  }
  test_raw_sync(&a);
  int after = daemon_fds_wait(base, 0);
  cr_assert_eq(after, base, "read: %d descriptors, %d before", after, base);
  /* again, and the client closes with its replies queued, some of a
   * frame sent (the socket full mid-reply) */
  for (int q = 0; q < QREQS; q++)
    send_buffers_batch(&a, "k", QN);
  cr_assert_gt(daemon_fds_wait(base, 1), base, "no reply was queued");
  test_raw_close(&a);
  after = daemon_fds_wait(base - 1, 0);
  cr_assert_eq(after, base - 1, "closed: %d descriptors, %d before with "
               "its socket", after, base);
  /* and a client that closes right after sending: the daemon answers
   * (some of) what it had read into a socket whose peer is gone */
  test_raw_open(&d, &a);
  test_raw_hello(&a, "qleak", 0, 2);
  for (int q = 0; q < QREQS; q++)
    send_buffers_batch(&a, "k", QN);
  test_raw_close(&a);
  after = daemon_fds_wait(base - 1, 0);
  cr_assert_eq(after, base - 1, "closed at once: %d descriptors, %d before "
               "with its socket", after, base);
  cr_assert(test_daemon_alive(&d));
  shardd_close(keep);
}
