/* test_reply.c — the dispatcher's reply builder (rpc/reply.c): the
 * batched views' reply packed by hand is, byte for byte, the Response
 * protobuf-c packs, for every size of varint in its fields. */
#include <criterion/criterion.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "dispatch_int.h"

Test(reply, a_views_batch_reply_packed_by_hand_is_protobuf_cs_bytes) {
  enum { N = 700 };
  static Shardwire__ViewReply vr[N];
  static Shardwire__ViewReply *vrp[N];
  for (int i = 0; i < N; i++) {
    shardwire__view_reply__init(&vr[i]);
    vr[i].id = i % 3 == 0 ? (uint64_t)i : (uint64_t)i << (i % 57);
    vr[i].created = i % 2;
    vr[i].has_generation = i % 5 != 0;
    vr[i].generation = (uint64_t)1 << (i % 64);
    vrp[i] = &vr[i];
  }
  const struct {
    uint64_t seq;
    size_t n;
  } cases[] = {{1, 0}, {1, 1}, {127, 2}, {128, 10}, {UINT64_MAX, N},
               {UINT64_C(1) << 35, 300}};
  for (size_t t = 0; t < sizeof cases / sizeof cases[0]; t++) {
    Shardwire__Response resp = SHARDWIRE__RESPONSE__INIT;
    Shardwire__ViewsBatchReply vb = SHARDWIRE__VIEWS_BATCH_REPLY__INIT;
    resp.seq = cases[t].seq;
    resp.code = SHARDWIRE__STATUS_CODE__OK;
    resp.body_case = SHARDWIRE__RESPONSE__BODY_VIEWS_BATCH;
    vb.n_views = cases[t].n;
    vb.views = vrp;
    resp.views_batch = &vb;
    size_t want_len = shardwire__response__get_packed_size(&resp);
    uint8_t *want = malloc(want_len), *got = malloc(want_len + 64);
    cr_assert(want && got);
    shardwire__response__pack(&resp, want);
    size_t len = shardd__views_reply_pack(cases[t].seq, vr, cases[t].n, NULL);
    cr_assert_eq(len, want_len, "case %zu: %zu bytes, protobuf-c %zu", t, len,
                 want_len);
    cr_assert_eq(shardd__views_reply_pack(cases[t].seq, vr, cases[t].n, got),
                 want_len, "case %zu", t);
    cr_expect_eq(memcmp(got, want, want_len), 0, "case %zu: other bytes", t);
    /* and it decodes to the same replies */
    Shardwire__Response *back = shardwire__response__unpack(NULL, len, got);
    cr_assert_not_null(back);
    cr_expect_eq(back->views_batch->n_views, cases[t].n);
    shardwire__response__free_unpacked(back, NULL);
    free(want);
    free(got);
  }
}
