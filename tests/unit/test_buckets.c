/* test_buckets.c — a bucket's Request decoded by hand (rpc/buckets.c's
 * shardd__bucket_decode) against protobuf-c's decoding of the same bytes:
 * every request clients send (packed by protobuf-c, random entries) reads
 * the same both ways; any other frame (a no-gradient list, too many
 * entries, an unknown field, another request, every prefix and random
 * byte changes of a bucket) is either left to protobuf-c (NULL) or reads
 * the same as protobuf-c reads it. */
#include <criterion/criterion.h>
#include <stdlib.h>
#include <string.h>

#include "decode_pool.h"
#include "dispatch_int.h"

/* a as protobuf-c decoded it equals b as the hand decoder did */
static void expect_same(const Shardwire__Request *a, const Shardwire__Request *b) {
  cr_assert_eq(a->seq, b->seq);
  cr_assert_eq(a->body_case, SHARDWIRE__REQUEST__BODY_BUCKET);
  cr_assert_eq(b->body_case, SHARDWIRE__REQUEST__BODY_BUCKET);
  const Shardwire__Bucket *x = a->bucket, *y = b->bucket;
  cr_assert_eq(x->op_case, y->op_case);
  if (x->op_case == SHARDWIRE__BUCKET__OP_GATHER) {
    cr_assert_eq(x->gather->n_gathers, y->gather->n_gathers);
    cr_assert_eq(x->gather->has_first_index, y->gather->has_first_index);
    cr_assert_eq(x->gather->first_index, y->gather->first_index);
    for (size_t i = 0; i < x->gather->n_gathers; i++) {
      const Shardwire__Gather *g = x->gather->gathers[i], *h = y->gather->gathers[i];
      cr_assert_eq(g->base.descriptor, h->base.descriptor);
      cr_assert_eq(g->buffer, h->buffer);
      cr_assert_eq(g->has_generation, h->has_generation);
      cr_assert_eq(g->generation, h->generation);
      cr_assert_eq(g->has_want_grad, h->has_want_grad);
      cr_assert_eq(g->want_grad, h->want_grad);
    }
    return;
  }
  cr_assert_eq(x->op_case, SHARDWIRE__BUCKET__OP_SCATTER);
  cr_assert_eq(x->scatter->n_scatters, y->scatter->n_scatters);
  cr_assert_eq(x->scatter->has_first_index, y->scatter->has_first_index);
  cr_assert_eq(x->scatter->first_index, y->scatter->first_index);
  for (size_t i = 0; i < x->scatter->n_scatters; i++) {
    const Shardwire__Scatter *g = x->scatter->scatters[i], *h = y->scatter->scatters[i];
    cr_assert_eq(g->base.descriptor, h->base.descriptor);
    cr_assert_eq(g->buffer, h->buffer);
    cr_assert_eq(g->has_op, h->has_op);
    cr_assert_eq(g->op, h->op);
    cr_assert_eq(g->has_generation, h->has_generation);
    cr_assert_eq(g->generation, h->generation);
    cr_assert_eq(g->has_accumulate, h->has_accumulate);
    cr_assert_eq(g->accumulate, h->accumulate);
    cr_assert_eq(g->n_no_grad, 0);
    cr_assert_eq(h->n_no_grad, 0);
    cr_assert_eq(g->has_no_grad_all, h->has_no_grad_all);
  }
}

/* a random bucket request of n entries, packed; its length */
static size_t pack_random(uint64_t *s, size_t n, int gather, uint8_t *out,
                          size_t cap) {
  Shardwire__Request req = SHARDWIRE__REQUEST__INIT;
  Shardwire__Bucket bk = SHARDWIRE__BUCKET__INIT;
  Shardwire__GatherMany gm = SHARDWIRE__GATHER_MANY__INIT;
  Shardwire__ScatterMany sm = SHARDWIRE__SCATTER_MANY__INIT;
  Shardwire__Gather g[80];
  Shardwire__Scatter sc[80];
  Shardwire__Gather *gp[80];
  Shardwire__Scatter *sp[80];
  /* ids and generations of every width a varint takes, under 2^63 */
  int shift = (int)(rnd(s) % 63);
  req.seq = rnd(s) >> (rnd(s) % 63 + 1);
  req.body_case = SHARDWIRE__REQUEST__BODY_BUCKET;
  req.bucket = &bk;
  for (size_t i = 0; i < n; i++) {
    Shardwire__Gather gi = SHARDWIRE__GATHER__INIT;
    Shardwire__Scatter si = SHARDWIRE__SCATTER__INIT;
    g[i] = gi;
    sc[i] = si;
    uint64_t id = (rnd(s) >> 1) >> shift, gen = rnd(s) >> (rnd(s) % 63 + 1);
    int flags = (int)(rnd(s) & 15);
    g[i].buffer = sc[i].buffer = id;
    g[i].has_generation = sc[i].has_generation = flags & 1;
    g[i].generation = sc[i].generation = flags & 1 ? gen : 0;
    g[i].has_want_grad = (flags >> 1) & 1;
    g[i].want_grad = (flags >> 2) & 1;
    sc[i].has_op = (flags >> 1) & 1;
    sc[i].op = (flags >> 2) & 1 ? SHARDWIRE__REDUCE_OP__MEAN : SHARDWIRE__REDUCE_OP__SUM;
    sc[i].has_accumulate = (flags >> 3) & 1;
    sc[i].accumulate = (rnd(s) & 1) != 0;
    gp[i] = &g[i];
    sp[i] = &sc[i];
  }
  int first = (int)(rnd(s) & 1);
  uint32_t fi = (uint32_t)rnd(s) >> (rnd(s) % 32);
  if (gather) {
    bk.op_case = SHARDWIRE__BUCKET__OP_GATHER;
    bk.gather = &gm;
    gm.n_gathers = n;
    gm.gathers = gp;
    gm.has_first_index = first;
    gm.first_index = first ? fi : 0;
  } else {
    bk.op_case = SHARDWIRE__BUCKET__OP_SCATTER;
    bk.scatter = &sm;
    sm.n_scatters = n;
    sm.scatters = sp;
    sm.has_first_index = first;
    sm.first_index = first ? fi : 0;
  }
  size_t len = shardwire__request__get_packed_size(&req);
  cr_assert_leq(len, cap);
  shardwire__request__pack(&req, out);
  return len;
}

/* the hand decoder leaves it to protobuf-c, or reads what protobuf-c reads */
static int check_frame(const uint8_t *buf, size_t len) {
  return decoded_as_protobuf_c(shardd__bucket_decode, expect_same, buf, len);
}

Test(buckets, requests_clients_send_read_as_protobuf_c_reads_them) {
  uint64_t s = 0x9e3779b97f4a7c15ull;
  static uint8_t buf[1 << 16];
  for (int k = 0; k < 2000; k++) {
    size_t n = rnd(&s) % 65;
    size_t len = pack_random(&s, n, (int)(k & 1), buf, sizeof buf);
    cr_assert(check_frame(buf, len), "a bucket of %zu entries decoded by hand", n);
  }
}

Test(buckets, other_frames_are_left_to_protobuf_c) {
  uint64_t s = 12345;
  static uint8_t buf[1 << 16];
  /* 65 entries: more than a request may list (refused after decoding) */
  size_t len = pack_random(&s, 65, 0, buf, sizeof buf);
  cr_assert(!check_frame(buf, len));
  /* a scatter with a no-gradient list */
  Shardwire__Request req = SHARDWIRE__REQUEST__INIT;
  Shardwire__Bucket bk = SHARDWIRE__BUCKET__INIT;
  Shardwire__ScatterMany sm = SHARDWIRE__SCATTER_MANY__INIT;
  Shardwire__Scatter sc = SHARDWIRE__SCATTER__INIT, *sp = &sc;
  uint64_t ng[2] = {3, 4};
  sc.buffer = 7;
  sc.n_no_grad = 2;
  sc.no_grad = ng;
  sm.n_scatters = 1;
  sm.scatters = &sp;
  bk.op_case = SHARDWIRE__BUCKET__OP_SCATTER;
  bk.scatter = &sm;
  req.seq = 9;
  req.body_case = SHARDWIRE__REQUEST__BODY_BUCKET;
  req.bucket = &bk;
  len = shardwire__request__pack(&req, buf);
  cr_assert(!check_frame(buf, len));
  /* the same without it, then an unknown field after the request's own */
  sc.n_no_grad = 0;
  len = shardwire__request__pack(&req, buf);
  cr_assert(check_frame(buf, len));
  buf[len] = 0x98; /* field 99, a varint: its key 792 as a varint */
  buf[len + 1] = 0x06;
  buf[len + 2] = 1;
  cr_assert(!check_frame(buf, len + 3));
  /* a Hello */
  Shardwire__Request hr = SHARDWIRE__REQUEST__INIT;
  Shardwire__Hello h = SHARDWIRE__HELLO__INIT;
  hr.seq = 1;
  hr.body_case = SHARDWIRE__REQUEST__BODY_HELLO;
  hr.hello = &h;
  len = shardwire__request__pack(&hr, buf);
  cr_assert(!check_frame(buf, len));
  /* an empty bucket (no list): protobuf-c's, refused by the handler */
  Shardwire__Bucket none = SHARDWIRE__BUCKET__INIT;
  req.bucket = &none;
  len = shardwire__request__pack(&req, buf);
  cr_assert(!check_frame(buf, len));
}

Test(buckets, prefixes_and_changed_bytes_read_as_protobuf_c_reads_them) {
  uint64_t s = 777;
  static uint8_t buf[1 << 16], mut[1 << 16];
  for (int k = 0; k < 40; k++) {
    size_t len = pack_random(&s, rnd(&s) % 9, (int)(k & 1), buf, sizeof buf);
    for (size_t cut = 0; cut < len; cut++)
      check_frame(buf, cut);
    for (int m = 0; m < 300; m++) {
      memcpy(mut, buf, len);
      for (int j = 0; j < 1 + (int)(rnd(&s) % 3); j++)
        mut[rnd(&s) % len] = (uint8_t)rnd(&s);
      check_frame(mut, len);
    }
  }
}
