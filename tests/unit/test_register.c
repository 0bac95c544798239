/* test_register.c — a views batch registration's Request decoded by hand
 * (rpc/register.c's shardd__views_decode) against protobuf-c's decoding of
 * the same bytes: every request clients send (packed as protobuf-c packs
 * it, which libshardd's packer matches byte for byte, random entries)
 * reads the same both ways; any other frame (an unregistration, a packed
 * or negative or 65-dimension shape, a field repeated or unknown or
 * missing, another request, every prefix and random byte changes) is
 * either left to protobuf-c (NULL) or reads the same as protobuf-c reads
 * it. */
#include <string.h>

#include "decode_pool.h"
#include "dispatch_int.h"

/* a as protobuf-c decoded it equals b as the hand decoder did */
static void expect_same(const Shardwire__Request *a, const Shardwire__Request *b) {
  cr_assert_eq(a->seq, b->seq);
  cr_assert_eq(a->body_case, SHARDWIRE__REQUEST__BODY_VIEWS_BATCH);
  cr_assert_eq(b->body_case, SHARDWIRE__REQUEST__BODY_VIEWS_BATCH);
  cr_assert_eq(a->views_batch->op_case, SHARDWIRE__VIEWS_BATCH__OP_REGISTER);
  cr_assert_eq(b->views_batch->op_case, SHARDWIRE__VIEWS_BATCH__OP_REGISTER);
  cr_assert_eq(a->views_batch->base.descriptor, b->views_batch->base.descriptor);
  const Shardwire__RegisterViews *x = a->views_batch->register_;
  const Shardwire__RegisterViews *y = b->views_batch->register_;
  cr_assert_eq(x->base.descriptor, y->base.descriptor);
  cr_assert_eq(x->n_views, y->n_views);
  cr_assert_eq(x->has_first_index, y->has_first_index);
  cr_assert_eq(x->first_index, y->first_index);
  for (size_t i = 0; i < x->n_views; i++) {
    const Shardwire__RegisterView *g = x->views[i], *h = y->views[i];
    cr_assert_eq(g->base.descriptor, h->base.descriptor);
    cr_assert_eq(g->buffer, h->buffer);
    cr_assert_str_eq(g->name, h->name);
    cr_assert_eq(g->offset, h->offset);
    cr_assert_eq(g->numel, h->numel);
    cr_assert_eq(g->n_shape, h->n_shape);
    for (size_t k = 0; k < g->n_shape; k++)
      cr_assert_eq(g->shape[k], h->shape[k]);
    cr_assert_eq(g->has_requires_grad, h->has_requires_grad);
    cr_assert_eq(g->requires_grad, h->requires_grad);
    cr_assert_eq(g->has_buffer_generation, h->has_buffer_generation);
    cr_assert_eq(g->buffer_generation, h->buffer_generation);
  }
}

/* the entries of one request, and what they point at */
typedef struct {
  Shardwire__Request req;
  Shardwire__ViewsBatch vb;
  Shardwire__RegisterViews rq;
  Shardwire__RegisterView v[300], *vp[300];
  char names[300][48];
  int64_t shapes[300][8];
} views_msg;

/* a random registration of n views (n <= 300) into m; dims beyond 8 and
 * negative ones are the callers' to set */
static void random_views(uint64_t *s, size_t n, views_msg *m) {
  Shardwire__Request ri = SHARDWIRE__REQUEST__INIT;
  Shardwire__ViewsBatch bi = SHARDWIRE__VIEWS_BATCH__INIT;
  Shardwire__RegisterViews qi = SHARDWIRE__REGISTER_VIEWS__INIT;
  m->req = ri;
  m->vb = bi;
  m->rq = qi;
  /* values of every width a varint takes, under 2^63 */
  int shift = (int)(rnd(s) % 63);
  m->req.seq = rnd(s) >> (rnd(s) % 63 + 1);
  m->req.body_case = SHARDWIRE__REQUEST__BODY_VIEWS_BATCH;
  m->req.views_batch = &m->vb;
  m->vb.op_case = SHARDWIRE__VIEWS_BATCH__OP_REGISTER;
  m->vb.register_ = &m->rq;
  for (size_t i = 0; i < n; i++) {
    Shardwire__RegisterView vi = SHARDWIRE__REGISTER_VIEW__INIT;
    Shardwire__RegisterView *v = &m->v[i];
    *v = vi;
    v->buffer = (rnd(s) >> 1) >> shift;
    size_t len = rnd(s) % 48; /* 0: an empty name, the handler's to refuse */
    for (size_t k = 0; k < len; k++)
      m->names[i][k] = (char)(1 + rnd(s) % 255); /* any byte but NUL */
    m->names[i][len] = '\0';
    v->name = m->names[i];
    v->offset = rnd(s) >> (rnd(s) % 63 + 1);
    v->numel = rnd(s) >> (rnd(s) % 63 + 1);
    v->n_shape = rnd(s) % 5;
    for (size_t k = 0; k < v->n_shape; k++)
      m->shapes[i][k] = (int64_t)(rnd(s) >> (rnd(s) % 63 + 1));
    v->shape = m->shapes[i];
    int flags = (int)(rnd(s) & 7);
    v->has_requires_grad = flags & 1;
    v->requires_grad = (flags >> 1) & 1;
    v->has_buffer_generation = (flags >> 2) & 1;
    v->buffer_generation = v->has_buffer_generation ? rnd(s) >> (rnd(s) % 63 + 1) : 0;
    m->vp[i] = v;
  }
  m->rq.n_views = n;
  m->rq.views = m->vp;
  m->rq.has_first_index = (int)(rnd(s) & 1);
  m->rq.first_index = m->rq.has_first_index ? (uint32_t)rnd(s) >> (rnd(s) % 32) : 0;
}

static size_t pack(const Shardwire__Request *req, uint8_t *out, size_t cap) {
  size_t len = shardwire__request__get_packed_size(req);
  cr_assert_leq(len, cap);
  return shardwire__request__pack(req, out);
}

/* the hand decoder leaves it to protobuf-c, or reads what protobuf-c reads */
static int check_frame(const uint8_t *buf, size_t len) {
  return decoded_as_protobuf_c(shardd__views_decode, expect_same, buf, len);
}

static views_msg msg;
static uint8_t buf[1 << 17], mut[1 << 17];

Test(register, views_requests_clients_send_read_as_protobuf_c_reads_them) {
  uint64_t s = 0x9e3779b97f4a7c15ull;
  for (int k = 0; k < 2000; k++) {
    size_t n = k < 1000 ? rnd(&s) % 9 : rnd(&s) % 301;
    random_views(&s, n, &msg);
    size_t len = pack(&msg.req, buf, sizeof buf);
    cr_assert(check_frame(buf, len), "a batch of %zu views decoded by hand", n);
  }
}

/* one view of msg changed by change, packed, then checked: 1 when the
 * hand decoder read it */
static int one_view(void (*change)(Shardwire__RegisterView *)) {
  uint64_t s = 99;
  random_views(&s, 3, &msg);
  change(&msg.v[1]);
  return check_frame(buf, pack(&msg.req, buf, sizeof buf));
}

static void dims_65(Shardwire__RegisterView *v) {
  static int64_t d[65];
  for (int k = 0; k < 65; k++)
    d[k] = 1;
  v->shape = d;
  v->n_shape = 65;
}

static void dims_64(Shardwire__RegisterView *v) {
  static int64_t d[64];
  for (int k = 0; k < 64; k++)
    d[k] = k;
  v->shape = d;
  v->n_shape = 64;
}

static void dim_negative(Shardwire__RegisterView *v) {
  static int64_t d[2] = {4, -1};
  v->shape = d;
  v->n_shape = 2;
}

static void nothing(Shardwire__RegisterView *v) { (void)v; }

Test(register, other_view_frames_are_left_to_protobuf_c) {
  cr_assert(one_view(nothing));
  cr_assert(one_view(dims_64));
  cr_assert(!one_view(dims_65)); /* refused by the handler, after decoding */
  cr_assert(!one_view(dim_negative)); /* a 10-byte varint */
  /* an unknown field after the request's own */
  uint64_t s = 5;
  random_views(&s, 2, &msg);
  size_t len = pack(&msg.req, buf, sizeof buf);
  cr_assert(check_frame(buf, len));
  buf[len] = 0x98; /* field 99, a varint: its key 792 as a varint */
  buf[len + 1] = 0x06;
  buf[len + 2] = 1;
  cr_assert(!check_frame(buf, len + 3));
  /* an unregistration */
  Shardwire__UnregisterViews uq = SHARDWIRE__UNREGISTER_VIEWS__INIT;
  Shardwire__UnregisterView u = SHARDWIRE__UNREGISTER_VIEW__INIT, *up = &u;
  u.id = 3;
  uq.n_views = 1;
  uq.views = &up;
  msg.vb.op_case = SHARDWIRE__VIEWS_BATCH__OP_UNREGISTER;
  msg.vb.unregister = &uq;
  cr_assert(!check_frame(buf, pack(&msg.req, buf, sizeof buf)));
  /* a ViewsBatch naming nothing: protobuf-c's, refused by the handler */
  msg.vb.op_case = SHARDWIRE__VIEWS_BATCH__OP__NOT_SET;
  cr_assert(!check_frame(buf, pack(&msg.req, buf, sizeof buf)));
  /* an empty list is read (the handler answers it) */
  msg.vb.op_case = SHARDWIRE__VIEWS_BATCH__OP_REGISTER;
  msg.vb.register_ = &msg.rq; /* one union with unregister */
  msg.rq.n_views = 0;
  cr_assert(check_frame(buf, pack(&msg.req, buf, sizeof buf)));
  /* a Hello */
  Shardwire__Request hr = SHARDWIRE__REQUEST__INIT;
  Shardwire__Hello h = SHARDWIRE__HELLO__INIT;
  hr.seq = 1;
  hr.body_case = SHARDWIRE__REQUEST__BODY_HELLO;
  hr.hello = &h;
  cr_assert(!check_frame(buf, pack(&hr, buf, sizeof buf)));
}

/* Request{seq 7, ViewsBatch{register{views [entry]}}} around entry's bytes */
static size_t wrap_entry(const uint8_t *entry, uint8_t elen, uint8_t *out) {
  uint8_t *p = out;
  *p++ = 0x08;
  *p++ = 7;
  *p++ = 0x82;
  *p++ = 0x02;
  *p++ = (uint8_t)(elen + 4);
  *p++ = 0x0a;
  *p++ = (uint8_t)(elen + 2);
  *p++ = 0x0a;
  *p++ = elen;
  memcpy(p, entry, elen);
  return (size_t)(p - out) + elen;
}

Test(register, view_fields_out_of_the_plain_shape) {
  /* buffer 1, name "a", offset 2, numel 3, shape 4 5 apart */
  static const uint8_t plain[] = {0x28, 4, 0x08, 1, 0x12, 1, 'a',
                                  0x18, 2, 0x20, 3, 0x28, 5};
  cr_assert(check_frame(buf, wrap_entry(plain, sizeof plain, buf)));
  /* the same shape packed: left to protobuf-c, which reads it alike */
  static const uint8_t packed[] = {0x08, 1, 0x12, 1, 'a', 0x18, 2,
                                   0x20, 3, 0x2a, 2, 4, 5};
  cr_assert(!check_frame(buf, wrap_entry(packed, sizeof packed, buf)));
  /* numel missing (required): protobuf-c refuses it */
  static const uint8_t no_numel[] = {0x08, 1, 0x12, 1, 'a', 0x18, 2};
  cr_assert(!check_frame(buf, wrap_entry(no_numel, sizeof no_numel, buf)));
  cr_assert_null(shardwire__request__unpack(
      NULL, wrap_entry(no_numel, sizeof no_numel, buf), buf));
  /* buffer twice: protobuf-c keeps the last */
  static const uint8_t twice[] = {0x08, 1, 0x12, 1, 'a', 0x18, 2,
                                  0x20, 3, 0x08, 9};
  cr_assert(!check_frame(buf, wrap_entry(twice, sizeof twice, buf)));
  /* a name holding a NUL: read as protobuf-c reads it (cut there) */
  static const uint8_t nul[] = {0x08, 1, 0x12, 3, 'a', 0, 'b',
                                0x18, 2, 0x20, 3};
  cr_assert(check_frame(buf, wrap_entry(nul, sizeof nul, buf)));
  /* a key padded past 5 bytes (buffer's, 1): protobuf-c refuses it */
  static const uint8_t long_key[] = {0x88, 0x80, 0x80, 0x80, 0x80, 0x00, 1,
                                     0x12, 1, 'a', 0x18, 2, 0x20, 3};
  cr_assert(!check_frame(buf, wrap_entry(long_key, sizeof long_key, buf)));
  /* a name's length padded past 5 bytes: protobuf-c refuses it */
  static const uint8_t long_len[] = {0x08, 1, 0x12, 0x81, 0x80, 0x80, 0x80,
                                     0x80, 0x00, 'a', 0x18, 2, 0x20, 3};
  cr_assert(!check_frame(buf, wrap_entry(long_len, sizeof long_len, buf)));
}

Test(register, view_prefixes_and_changed_bytes_read_as_protobuf_c_reads_them) {
  uint64_t s = 777;
  for (int k = 0; k < 40; k++) {
    random_views(&s, rnd(&s) % 6, &msg);
    size_t len = pack(&msg.req, buf, sizeof buf);
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
