/* gen_corpus.c — writes the fuzzer's seed corpus: client byte streams of
 * valid framed Requests (hello, register, views, optimizer, gather, scatter,
 * step, status, inspect, and the later bodies: batched views, frozen views,
 * seeded masters, accumulating and masked scatters, per-group and norm-only
 * steps, optimizer state, all-reduce, collective checkpoints, job release,
 * buckets of gathers and scatters; frozen views in batches and batched
 * unregistering, buffers in batches, optimizer state and masters of every
 * shape, releases by UID/NAME, a seq reused under a collective
 * checkpoint, transient areas: gathers with the gradient area, the next
 * one prefetched before a scatter, releases, an abandoned iteration),
 * so mutation starts from inputs that reach deep into dispatch; and with
 * RANKS_DIR, fuzz_ranks' seeds: two or three ranks of one job through
 * gathers, scatters, steps and buckets, a rank lost, cut off mid-frame or
 * back, replies left unread, transient areas with backward's prefetch
 * (see fuzz_ranks.c for their records).
 * Usage: gen_corpus DIR [RANKS_DIR] (tests/fuzz/corpus and
 * tests/fuzz/corpus_ranks). The seeds are committed; after adding one,
 * rebuild and rerun it (cc -D_GNU_SOURCE -Iinclude -Icommon -Ibuild/gen
 * tests/fuzz/gen_corpus.c common/frame.c build/gen/proto/shardd.pb-c.c
 * -lprotobuf-c). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "frame.h"
#include "proto/shardd.pb-c.h"

static FILE *out;

static uint64_t last_seq;

/* fuzz_ranks' seeds (see fuzz_ranks.c): each frame is a record sent on
 * connection conn (-1: fuzz_request's plain stream), with op 0 (sent and
 * its replies read) or 1 (left unread). */
static int conn = -1, conn_op;
/* fuzz_ranks: the next frame is cut after its first half */
static int half;

static void record(int op, const uint8_t *bytes, size_t n) {
  uint8_t head[3] = {(uint8_t)(conn | op << 2), (uint8_t)n, (uint8_t)(n >> 8)};
  fwrite(head, 1, op == 0 || op == 1 ? 3 : 1, out);
  fwrite(bytes, 1, n, out);
}

/* Writes r framed, with seq (0: the next one). */
static void emit_seq(Shardwire__Request *r, uint64_t seq) {
  r->seq = seq ? seq : ++last_seq;
  size_t n = shardwire__request__get_packed_size(r);
  uint8_t *buf = malloc(n + 4);
  shardd__frame_put_header(buf, (uint32_t)n);
  shardwire__request__pack(r, buf + 4);
  if (conn < 0)
    fwrite(buf, 1, n + 4, out);
  else
    record(conn_op, buf, half ? (n + 4) / 2 : n + 4);
  free(buf);
}

/* The frames emitted next go to connection k of a fuzz_ranks seed. */
static void on(int k) {
  conn = k;
  conn_op = 0;
}

/* fuzz_ranks' other records on connection k: 2 shut its writing side, 3
 * close it, 4 close and reopen it, 5 wait past the collective timeout. */
static void act(int k, int op) {
  int was = conn;
  conn = k;
  record(op, NULL, 0);
  conn = was;
}

static void emit(Shardwire__Request *r) { emit_seq(r, 0); }

/* A Hello that creates (or joins) a job: with transient areas, and (or)
 * a client mapping blocks at offsets, whose batches' blocks then come in
 * slabs (one memfd per rank, replies naming an offset and fd index). */
static void hello_opts(const char *job, uint32_t rank, uint32_t world,
                       int transient, int at_offsets) {
  Shardwire__Request r = SHARDWIRE__REQUEST__INIT;
  Shardwire__Hello h = SHARDWIRE__HELLO__INIT;
  h.protocol_version = 1;
  h.job = (char *)job;
  h.has_rank = h.has_world = 1;
  h.rank = rank;
  h.world = world;
  h.has_transient_areas = h.transient_areas = transient;
  h.has_blocks_at_offsets = h.blocks_at_offsets = at_offsets;
  r.body_case = SHARDWIRE__REQUEST__BODY_HELLO;
  r.hello = &h;
  emit(&r);
}

static void hello(const char *job, uint32_t rank, uint32_t world) {
  hello_opts(job, rank, world, 0, 0);
}

static void hello_transient(const char *job, uint32_t rank, uint32_t world) {
  hello_opts(job, rank, world, 1, 0);
}

static void hello_at_offsets(const char *job, uint32_t rank, uint32_t world) {
  hello_opts(job, rank, world, 0, 1);
}

/* A Gather leasing the gradient area too (backward, and its prefetch). */
static void gather_grad(uint64_t buf) {
  Shardwire__Request r = SHARDWIRE__REQUEST__INIT;
  Shardwire__Gather g = SHARDWIRE__GATHER__INIT;
  g.buffer = buf;
  g.has_want_grad = g.want_grad = 1;
  r.body_case = SHARDWIRE__REQUEST__BODY_GATHER;
  r.gather = &g;
  emit(&r);
}

/* Release of buf's gather area (and, grad, its unscattered gradient area). */
static void release_area(uint64_t buf, int grad) {
  Shardwire__Request r = SHARDWIRE__REQUEST__INIT;
  Shardwire__Release rl = SHARDWIRE__RELEASE__INIT;
  rl.buffer = buf;
  rl.has_grad = rl.grad = grad != 0;
  r.body_case = SHARDWIRE__REQUEST__BODY_RELEASE;
  r.release = &rl;
  emit(&r);
}

static void reg_buffer(const char *name, Shardwire__DType dt, uint64_t numel) {
  Shardwire__Request r = SHARDWIRE__REQUEST__INIT;
  Shardwire__RegisterBuffer b = SHARDWIRE__REGISTER_BUFFER__INIT;
  b.name = (char *)name;
  b.dtype = dt;
  b.numel = numel;
  r.body_case = SHARDWIRE__REQUEST__BODY_REGISTER_BUFFER;
  r.register_buffer = &b;
  emit(&r);
}

static void reg_view(uint64_t buf, const char *name, uint64_t off, uint64_t n) {
  Shardwire__Request r = SHARDWIRE__REQUEST__INIT;
  Shardwire__RegisterView v = SHARDWIRE__REGISTER_VIEW__INIT;
  int64_t shape[1] = {(int64_t)n};
  v.buffer = buf;
  v.name = (char *)name;
  v.offset = off;
  v.numel = n;
  v.n_shape = 1;
  v.shape = shape;
  r.body_case = SHARDWIRE__REQUEST__BODY_REGISTER_VIEW;
  r.register_view = &v;
  emit(&r);
}

static void reg_optim(Shardwire__OptimKind kind, const uint64_t *ids, size_t n) {
  Shardwire__Request r = SHARDWIRE__REQUEST__INIT;
  Shardwire__RegisterOptimizer o = SHARDWIRE__REGISTER_OPTIMIZER__INIT;
  Shardwire__ParamGroup g = SHARDWIRE__PARAM_GROUP__INIT;
  Shardwire__ParamGroup *gp = &g;
  Shardwire__ParamRef refs[8], *rp[8];
  Shardwire__HyperParams hp = SHARDWIRE__HYPER_PARAMS__INIT;
  hp.has_lr = 1;
  hp.lr = 0.01;
  for (size_t i = 0; i < n; i++) {
    shardwire__param_ref__init(&refs[i]);
    refs[i].id = ids[i];
    refs[i].name = "p";
    rp[i] = &refs[i];
  }
  g.refs = rp;
  g.n_refs = n;
  o.kind = kind;
  o.hyper = &hp;
  o.groups = &gp;
  o.n_groups = 1;
  r.body_case = SHARDWIRE__REQUEST__BODY_REGISTER_OPTIMIZER;
  r.register_optimizer = &o;
  emit(&r);
}

static void simple(Shardwire__Request__BodyCase bc, uint64_t id) {
  Shardwire__Request r = SHARDWIRE__REQUEST__INIT;
  Shardwire__Gather g = SHARDWIRE__GATHER__INIT;
  Shardwire__Scatter s = SHARDWIRE__SCATTER__INIT;
  Shardwire__Step st = SHARDWIRE__STEP__INIT;
  Shardwire__StatusRequest sr = SHARDWIRE__STATUS_REQUEST__INIT;
  Shardwire__Inspect in = SHARDWIRE__INSPECT__INIT;
  r.body_case = bc;
  switch (bc) {
  case SHARDWIRE__REQUEST__BODY_GATHER:
    g.buffer = id;
    r.gather = &g;
    break;
  case SHARDWIRE__REQUEST__BODY_SCATTER:
    s.buffer = id;
    s.has_op = 1;
    s.op = SHARDWIRE__REDUCE_OP__MEAN;
    r.scatter = &s;
    break;
  case SHARDWIRE__REQUEST__BODY_STEP:
    st.optimizer = id;
    st.has_max_norm = 1;
    st.max_norm = 1.0;
    r.step = &st;
    break;
  case SHARDWIRE__REQUEST__BODY_INSPECT:
    in.has_id = 1;
    in.id = id;
    r.inspect = &in;
    break;
  default:
    r.body_case = SHARDWIRE__REQUEST__BODY_STATUS;
    r.status = &sr;
  }
  emit(&r);
}

static void views_batch(uint64_t buf, uint64_t nviews, uint64_t each) {
  Shardwire__Request r = SHARDWIRE__REQUEST__INIT;
  Shardwire__ViewsBatch vb = SHARDWIRE__VIEWS_BATCH__INIT;
  Shardwire__RegisterViews rv = SHARDWIRE__REGISTER_VIEWS__INIT;
  Shardwire__RegisterView v[4], *vp[4];
  int64_t shape[4][1];
  char names[4][8];
  for (uint64_t i = 0; i < nviews && i < 4; i++) {
    shardwire__register_view__init(&v[i]);
    snprintf(names[i], sizeof names[i], "v%u", (unsigned)i);
    shape[i][0] = (int64_t)each;
    v[i].buffer = buf;
    v[i].name = names[i];
    v[i].offset = i * each;
    v[i].numel = each;
    v[i].n_shape = 1;
    v[i].shape = shape[i];
    vp[i] = &v[i];
  }
  rv.views = vp;
  rv.n_views = nviews < 4 ? nviews : 4;
  vb.op_case = SHARDWIRE__VIEWS_BATCH__OP_REGISTER;
  vb.register_ = &rv;
  r.body_case = SHARDWIRE__REQUEST__BODY_VIEWS_BATCH;
  r.views_batch = &vb;
  emit(&r);
}

static void set_requires_grad(uint64_t view, int on) {
  Shardwire__Request r = SHARDWIRE__REQUEST__INIT;
  Shardwire__SetRequiresGrad s = SHARDWIRE__SET_REQUIRES_GRAD__INIT;
  s.view = view;
  s.requires_grad = on;
  r.body_case = SHARDWIRE__REQUEST__BODY_SET_REQUIRES_GRAD;
  r.set_requires_grad = &s;
  emit(&r);
}

static void seed_master(uint64_t buf) {
  Shardwire__Request r = SHARDWIRE__REQUEST__INIT;
  Shardwire__SeedMaster s = SHARDWIRE__SEED_MASTER__INIT;
  s.buffer = buf;
  r.body_case = SHARDWIRE__REQUEST__BODY_SEED_MASTER;
  r.seed_master = &s;
  emit(&r);
}

static void scatter_masked(uint64_t buf, uint64_t no_grad_view) {
  Shardwire__Request r = SHARDWIRE__REQUEST__INIT;
  Shardwire__Scatter s = SHARDWIRE__SCATTER__INIT;
  s.buffer = buf;
  s.has_accumulate = 1;
  s.accumulate = 1;
  s.n_no_grad = 1;
  s.no_grad = &no_grad_view;
  r.body_case = SHARDWIRE__REQUEST__BODY_SCATTER;
  r.scatter = &s;
  emit(&r);
}

static void step_groups(uint64_t optim, int norm_only) {
  Shardwire__Request r = SHARDWIRE__REQUEST__INIT;
  Shardwire__Step st = SHARDWIRE__STEP__INIT;
  Shardwire__HyperParams hp = SHARDWIRE__HYPER_PARAMS__INIT;
  Shardwire__HyperParams *hpp = &hp;
  hp.has_lr = 1;
  hp.lr = 0.5;
  hp.has_weight_decay = 1;
  hp.weight_decay = 0.1;
  st.optimizer = optim;
  st.groups = &hpp;
  st.n_groups = 1;
  st.has_max_norm = 1;
  st.max_norm = 1.0 / 0.0;
  st.has_norm_only = norm_only;
  st.norm_only = norm_only;
  r.body_case = SHARDWIRE__REQUEST__BODY_STEP;
  r.step = &st;
  emit(&r);
}

static void optim_state(uint64_t optim, uint64_t ref, int write) {
  Shardwire__Request r = SHARDWIRE__REQUEST__INIT;
  Shardwire__OptimState o = SHARDWIRE__OPTIM_STATE__INIT;
  static const float vals[4] = {1, -2, 0.5f, 3};
  o.optimizer = optim;
  o.ref = ref;
  o.has_array = o.has_offset = o.has_count = 1;
  o.array = 1;
  o.offset = 2;
  o.count = 4;
  if (write) {
    o.has_data = 1;
    o.data.data = (uint8_t *)vals;
    o.data.len = sizeof vals;
    o.has_set_steps = 1;
    o.set_steps = 3;
  }
  r.body_case = SHARDWIRE__REQUEST__BODY_OPTIM_STATE;
  r.optim_state = &o;
  emit(&r);
}

static void all_reduce(size_t n) {
  Shardwire__Request r = SHARDWIRE__REQUEST__INIT;
  Shardwire__AllReduce a = SHARDWIRE__ALL_REDUCE__INIT;
  double v[3] = {1.5, -2.0, 1e300};
  a.has_op = 1;
  a.op = SHARDWIRE__REDUCE_OP__MAX;
  a.values = v;
  a.n_values = n;
  r.body_case = SHARDWIRE__REQUEST__BODY_ALL_REDUCE;
  r.all_reduce = &a;
  emit(&r);
}

static void checkpoint_collective(const char *dir) {
  Shardwire__Request r = SHARDWIRE__REQUEST__INIT;
  Shardwire__Checkpoint c = SHARDWIRE__CHECKPOINT__INIT;
  c.dir = (char *)dir;
  c.has_collective = 1;
  c.collective = 1;
  c.has_wait_s = 1;
  c.wait_s = 0.01;
  r.body_case = SHARDWIRE__REQUEST__BODY_CHECKPOINT;
  r.checkpoint = &c;
  emit(&r);
}

static void release_job(const char *job) {
  Shardwire__Request r = SHARDWIRE__REQUEST__INIT;
  Shardwire__ReleaseJob j = SHARDWIRE__RELEASE_JOB__INIT;
  j.job = (char *)job;
  r.body_case = SHARDWIRE__REQUEST__BODY_RELEASE_JOB;
  r.release_job = &j;
  emit(&r);
}

/* A Bucket of gathers (scatter 0) or scatters over ids, the scatters' first
 * entry masking view no_grad_view (0: none). */
static void bucket(int scatter, const uint64_t *ids, size_t n,
                   uint64_t no_grad_view) {
  Shardwire__Request r = SHARDWIRE__REQUEST__INIT;
  Shardwire__Bucket bk = SHARDWIRE__BUCKET__INIT;
  Shardwire__GatherMany gm = SHARDWIRE__GATHER_MANY__INIT;
  Shardwire__ScatterMany sm = SHARDWIRE__SCATTER_MANY__INIT;
  Shardwire__Gather g[8];
  Shardwire__Scatter sc[8];
  void *p[8];
  for (size_t i = 0; i < n && i < 8; i++) {
    shardwire__gather__init(&g[i]);
    shardwire__scatter__init(&sc[i]);
    g[i].buffer = sc[i].buffer = ids[i];
    sc[i].has_op = 1;
    sc[i].op = SHARDWIRE__REDUCE_OP__MEAN;
    p[i] = scatter ? (void *)&sc[i] : (void *)&g[i];
  }
  if (scatter && no_grad_view) {
    sc[0].n_no_grad = 1;
    sc[0].no_grad = &no_grad_view;
  }
  if (scatter) {
    sm.n_scatters = n;
    sm.scatters = (Shardwire__Scatter **)p;
    bk.op_case = SHARDWIRE__BUCKET__OP_SCATTER;
    bk.scatter = &sm;
  } else {
    gm.n_gathers = n;
    gm.gathers = (Shardwire__Gather **)p;
    bk.op_case = SHARDWIRE__BUCKET__OP_GATHER;
    bk.gather = &gm;
  }
  r.body_case = SHARDWIRE__REQUEST__BODY_BUCKET;
  r.bucket = &bk;
  emit(&r);
}

/* A ViewsBatch registering n views of buf: [off[i], off[i]+len[i]),
 * frozen where rg[i] is 0 (frozen and trainable ranges, overlapping their
 * own kind, refused where they meet the other). */
static void views_batch_rg(uint64_t buf, size_t n, const uint64_t *off,
                           const uint64_t *len, const int *rg) {
  Shardwire__Request r = SHARDWIRE__REQUEST__INIT;
  Shardwire__ViewsBatch vb = SHARDWIRE__VIEWS_BATCH__INIT;
  Shardwire__RegisterViews rv = SHARDWIRE__REGISTER_VIEWS__INIT;
  Shardwire__RegisterView v[8], *vp[8];
  int64_t shape[8][1];
  char names[8][8];
  for (size_t i = 0; i < n && i < 8; i++) {
    shardwire__register_view__init(&v[i]);
    snprintf(names[i], sizeof names[i], "f%u", (unsigned)i);
    shape[i][0] = (int64_t)len[i];
    v[i].buffer = buf;
    v[i].name = names[i];
    v[i].offset = off[i];
    v[i].numel = len[i];
    v[i].n_shape = 1;
    v[i].shape = shape[i];
    v[i].has_requires_grad = 1;
    v[i].requires_grad = rg[i];
    vp[i] = &v[i];
  }
  rv.views = vp;
  rv.n_views = n < 8 ? n : 8;
  rv.has_first_index = 1;
  rv.first_index = 0;
  vb.op_case = SHARDWIRE__VIEWS_BATCH__OP_REGISTER;
  vb.register_ = &rv;
  r.body_case = SHARDWIRE__REQUEST__BODY_VIEWS_BATCH;
  r.views_batch = &vb;
  emit(&r);
}

/* A ViewsBatch unregistering ids (generation gen[i], 0: unchecked). */
static void views_unbatch(size_t n, const uint64_t *ids, const uint64_t *gen) {
  Shardwire__Request r = SHARDWIRE__REQUEST__INIT;
  Shardwire__ViewsBatch vb = SHARDWIRE__VIEWS_BATCH__INIT;
  Shardwire__UnregisterViews uv = SHARDWIRE__UNREGISTER_VIEWS__INIT;
  Shardwire__UnregisterView v[8], *vp[8];
  for (size_t i = 0; i < n && i < 8; i++) {
    shardwire__unregister_view__init(&v[i]);
    v[i].id = ids[i];
    v[i].has_generation = gen[i] != 0;
    v[i].generation = gen[i];
    vp[i] = &v[i];
  }
  uv.views = vp;
  uv.n_views = n < 8 ? n : 8;
  vb.op_case = SHARDWIRE__VIEWS_BATCH__OP_UNREGISTER;
  vb.unregister = &uv;
  r.body_case = SHARDWIRE__REQUEST__BODY_VIEWS_BATCH;
  r.views_batch = &vb;
  emit(&r);
}

/* A BuffersBatch registering n buffers (dtype dt[i], numel numel[i]). */
static void buffers_batch(size_t n, const char *const *names,
                          const Shardwire__DType *dt, const uint64_t *numel) {
  Shardwire__Request r = SHARDWIRE__REQUEST__INIT;
  Shardwire__BuffersBatch bb = SHARDWIRE__BUFFERS_BATCH__INIT;
  Shardwire__RegisterBuffers rb = SHARDWIRE__REGISTER_BUFFERS__INIT;
  Shardwire__RegisterBuffer b[8], *bp[8];
  for (size_t i = 0; i < n && i < 8; i++) {
    shardwire__register_buffer__init(&b[i]);
    b[i].name = (char *)names[i];
    b[i].dtype = dt[i];
    b[i].numel = numel[i];
    bp[i] = &b[i];
  }
  rb.buffers = bp;
  rb.n_buffers = n < 8 ? n : 8;
  bb.op_case = SHARDWIRE__BUFFERS_BATCH__OP_REGISTER;
  bb.register_ = &rb;
  r.body_case = SHARDWIRE__REQUEST__BODY_BUFFERS_BATCH;
  r.buffers_batch = &bb;
  emit(&r);
}

static void buffers_unbatch(size_t n, const uint64_t *ids) {
  Shardwire__Request r = SHARDWIRE__REQUEST__INIT;
  Shardwire__BuffersBatch bb = SHARDWIRE__BUFFERS_BATCH__INIT;
  Shardwire__UnregisterBuffers ub = SHARDWIRE__UNREGISTER_BUFFERS__INIT;
  Shardwire__UnregisterBuffer b[8], *bp[8];
  for (size_t i = 0; i < n && i < 8; i++) {
    shardwire__unregister_buffer__init(&b[i]);
    b[i].id = ids[i];
    bp[i] = &b[i];
  }
  ub.buffers = bp;
  ub.n_buffers = n < 8 ? n : 8;
  bb.op_case = SHARDWIRE__BUFFERS_BATCH__OP_UNREGISTER;
  bb.unregister = &ub;
  r.body_case = SHARDWIRE__REQUEST__BODY_BUFFERS_BATCH;
  r.buffers_batch = &bb;
  emit(&r);
}

/* OptimState of every shape: info only (count 0), a read or a write of
 * array, the master (array UINT32_MAX or master set), step counts. */
static void optim_state_ex(uint64_t optim, uint64_t ref, uint32_t array,
                           uint64_t count, int write, int master,
                           uint64_t steps, uint64_t optim_steps) {
  Shardwire__Request r = SHARDWIRE__REQUEST__INIT;
  Shardwire__OptimState o = SHARDWIRE__OPTIM_STATE__INIT;
  static const float vals[8] = {1, -2, 0.5f, 3, 0, -0.0f, 1e30f, 7};
  o.optimizer = optim;
  o.ref = ref;
  o.has_array = o.has_offset = o.has_count = 1;
  o.array = array;
  o.offset = 0;
  o.count = count;
  if (write) {
    o.has_data = 1;
    o.data.data = (uint8_t *)vals;
    o.data.len = (count < 8 ? count : 8) * sizeof(float);
  }
  o.has_master = master;
  o.master = master;
  o.has_set_steps = steps != 0;
  o.set_steps = steps;
  o.has_set_optimizer_steps = optim_steps != 0;
  o.set_optimizer_steps = optim_steps;
  r.body_case = SHARDWIRE__REQUEST__BODY_OPTIM_STATE;
  r.optim_state = &o;
  emit(&r);
}

/* A collective checkpoint sent with seq, and a gather of buf reusing it. */
static void checkpoint_then_same_seq(const char *dir, uint64_t buf,
                                     uint64_t seq) {
  Shardwire__Request r = SHARDWIRE__REQUEST__INIT;
  Shardwire__Checkpoint c = SHARDWIRE__CHECKPOINT__INIT;
  c.dir = (char *)dir;
  c.has_collective = 1;
  c.collective = 1;
  r.body_case = SHARDWIRE__REQUEST__BODY_CHECKPOINT;
  r.checkpoint = &c;
  emit_seq(&r, seq);
  Shardwire__Request g = SHARDWIRE__REQUEST__INIT;
  Shardwire__Gather ga = SHARDWIRE__GATHER__INIT;
  ga.buffer = buf;
  g.body_case = SHARDWIRE__REQUEST__BODY_GATHER;
  g.gather = &ga;
  emit_seq(&g, seq);
}

static void open_seed(const char *dir, const char *name) {
  char path[512];
  snprintf(path, sizeof path, "%s/%s", dir, name);
  out = fopen(path, "wb");
  if (out == NULL) {
    perror(path);
    exit(1);
  }
}

/* One rank's setup in a fuzz_ranks seed: Hello to job with rank and
 * world, buffer 1 (fp32, 1000) with views 2 and 3 and AdamW 4 over them. */
static void rank_setup(int k, const char *job, uint32_t rank, uint32_t world) {
  on(k);
  hello(job, rank, world);
  reg_buffer("b", SHARDWIRE__DTYPE__FP32, 1000);
  reg_view(1, "w", 0, 600);
  reg_view(1, "bias", 600, 400);
  uint64_t ids[2] = {2, 3};
  reg_optim(SHARDWIRE__OPTIM_KIND__ADAMW, ids, 2);
}

/* fuzz_ranks' seeds: two or three ranks of one job through gathers,
 * scatters, steps and buckets, one rank lost or back mid-way. */
static void ranks_seeds(const char *dir) {
  static const uint8_t two = 0, three = 1, two_small = 2;

  open_seed(dir, "gather_scatter_step");
  fwrite(&two, 1, 1, out);
  rank_setup(0, "r1", 0, 2);
  rank_setup(1, "r1", 1, 2);
  for (int k = 0; k < 2; k++) {
    on(k);
    simple(SHARDWIRE__REQUEST__BODY_GATHER, 1);
  }
  for (int k = 0; k < 2; k++) {
    on(k);
    scatter_masked(1, 3);
  }
  for (int k = 0; k < 2; k++) {
    on(k);
    step_groups(4, 0);
  }
  on(0);
  simple(SHARDWIRE__REQUEST__BODY_STATUS, 0);
  simple(SHARDWIRE__REQUEST__BODY_INSPECT, 1);
  fclose(out);

  /* buckets both ranks send alike, then ones they disagree on */
  open_seed(dir, "buckets_two");
  fwrite(&two, 1, 1, out);
  for (int k = 0; k < 2; k++) {
    on(k);
    hello("r2", (uint32_t)k, 2);
    reg_buffer("k1", SHARDWIRE__DTYPE__FP32, 40);
    reg_buffer("k2", SHARDWIRE__DTYPE__BF16, 7);
    reg_buffer("k3", SHARDWIRE__DTYPE__FP32, 1);
    reg_view(1, "kv", 0, 8);
  }
  {
    uint64_t kids[3] = {1, 2, 3}, other[3] = {3, 2, 1};
    for (int k = 0; k < 2; k++) {
      on(k);
      bucket(0, kids, 3, 0);
    }
    for (int k = 0; k < 2; k++) {
      on(k);
      bucket(1, kids, 3, 4);
    }
    on(0);
    bucket(1, kids, 3, 0);
    on(1);
    bucket(1, other, 3, 0);
    act(0, 5);
    on(1);
    bucket(0, kids, 2, 0);
    on(0);
    simple(SHARDWIRE__REQUEST__BODY_GATHER, 1);
  }
  fclose(out);

  /* a rank sends half a bucket and dies while the other's entries wait */
  open_seed(dir, "bucket_half_dies");
  fwrite(&two, 1, 1, out);
  for (int k = 0; k < 2; k++) {
    on(k);
    hello("r3", (uint32_t)k, 2);
    reg_buffer("k1", SHARDWIRE__DTYPE__FP32, 40);
    reg_buffer("k2", SHARDWIRE__DTYPE__FP32, 9);
  }
  {
    uint64_t kids[2] = {1, 2};
    on(0);
    bucket(1, kids, 2, 0);
    on(1);
    half = 1;
    bucket(1, kids, 2, 0);
    half = 0;
    act(1, 3);
    act(0, 5);
    on(0);
    bucket(0, kids, 2, 0);
  }
  fclose(out);

  /* a rank lost while the other waits in a gather, back in its place */
  open_seed(dir, "rank_rejoin");
  fwrite(&two, 1, 1, out);
  rank_setup(0, "r4", 0, 2);
  rank_setup(1, "r4", 1, 2);
  on(0);
  simple(SHARDWIRE__REQUEST__BODY_GATHER, 1);
  act(1, 4);
  rank_setup(1, "r4", 1, 2);
  simple(SHARDWIRE__REQUEST__BODY_GATHER, 1);
  on(0);
  simple(SHARDWIRE__REQUEST__BODY_STATUS, 0);
  act(0, 4);
  rank_setup(0, "r4", 0, 2);
  on(1);
  simple(SHARDWIRE__REQUEST__BODY_SCATTER, 1);
  fclose(out);

  /* replies written in parts to ranks that do not read, one closing */
  open_seed(dir, "unread_replies");
  fwrite(&two_small, 1, 1, out);
  rank_setup(0, "r5", 0, 2);
  rank_setup(1, "r5", 1, 2);
  for (int i = 0; i < 4; i++)
    for (int k = 0; k < 2; k++) {
      on(k);
      conn_op = 1;
      simple(SHARDWIRE__REQUEST__BODY_GATHER, 1);
      simple(SHARDWIRE__REQUEST__BODY_STATUS, 0);
      simple(SHARDWIRE__REQUEST__BODY_INSPECT, 1);
    }
  act(0, 3);
  on(1);
  simple(SHARDWIRE__REQUEST__BODY_STATUS, 0);
  act(1, 2);
  fclose(out);

  /* three ranks: all-reduce, a collective checkpoint, one rank missing */
  open_seed(dir, "three_ranks");
  fwrite(&three, 1, 1, out);
  for (int k = 0; k < 3; k++)
    rank_setup(k, "r6", (uint32_t)k, 3);
  for (int k = 0; k < 3; k++) {
    on(k);
    all_reduce(3);
  }
  for (int k = 0; k < 3; k++) {
    on(k);
    checkpoint_collective("rk");
  }
  for (int k = 0; k < 2; k++) {
    on(k);
    simple(SHARDWIRE__REQUEST__BODY_GATHER, 1);
  }
  act(2, 5);
  on(2);
  simple(SHARDWIRE__REQUEST__BODY_GATHER, 1);
  act(2, 3);
  on(0);
  simple(SHARDWIRE__REQUEST__BODY_STATUS, 0);
  fclose(out);

  /* a rank that never reads its buffers' descriptors (past the bound on
   * unread replies, so it is not read) and closes with them queued, while
   * the other rank's gather waits for it */
  open_seed(dir, "unread_fds");
  fwrite(&two_small, 1, 1, out);
  rank_setup(0, "r7", 0, 2);
  simple(SHARDWIRE__REQUEST__BODY_GATHER, 1);
  on(1);
  conn_op = 1;
  hello("r7", 1, 2);
  for (int i = 0; i < 70; i++) {
    char name[8];
    snprintf(name, sizeof name, "u%d", i);
    reg_buffer(name, SHARDWIRE__DTYPE__FP32, 4);
  }
  act(1, 3);
  on(0);
  simple(SHARDWIRE__REQUEST__BODY_STATUS, 0);
  fclose(out);

  /* three ranks with buckets queued; rank 2 leaves mid-bucket and comes
   * back, its bucket sent again */
  open_seed(dir, "bucket_rejoin");
  fwrite(&three, 1, 1, out);
  for (int k = 0; k < 3; k++) {
    on(k);
    hello("r8", (uint32_t)k, 3);
    reg_buffer("k1", SHARDWIRE__DTYPE__FP32, 40);
    reg_buffer("k2", SHARDWIRE__DTYPE__BF16, 12);
  }
  {
    uint64_t kids[2] = {1, 2};
    for (int k = 0; k < 2; k++) {
      on(k);
      bucket(1, kids, 2, 0);
    }
    act(2, 4);
    on(2);
    hello("r8", 2, 3);
    reg_buffer("k1", SHARDWIRE__DTYPE__FP32, 40);
    reg_buffer("k2", SHARDWIRE__DTYPE__BF16, 12);
    bucket(1, kids, 2, 0);
    for (int k = 0; k < 3; k++) {
      on(k);
      bucket(0, kids, 2, 0);
    }
    on(1);
    simple(SHARDWIRE__REQUEST__BODY_STATUS, 0);
  }
  fclose(out);

  /* uids 4241 and 4242 (fuzz_ranks as root): the same job name is two
   * jobs; the other uid's ids, release and checkpoint are refused */
  static const uint8_t two_uids = 2 << 2, root_and_two = 3 << 2 | 1;
  open_seed(dir, "two_uids");
  fwrite(&two_uids, 1, 1, out);
  rank_setup(0, "u1", 0, 2);
  on(1);
  hello("u1", 1, 2);
  simple(SHARDWIRE__REQUEST__BODY_INSPECT, 1);
  simple(SHARDWIRE__REQUEST__BODY_GATHER, 1);
  seed_master(1);
  {
    uint64_t ids[2] = {1, 2};
    bucket(1, ids, 2, 0);
  }
  optim_state(4, 2, 1);
  release_job("4241/u1");
  checkpoint_collective("ck");
  simple(SHARDWIRE__REQUEST__BODY_STATUS, 0);
  on(0);
  simple(SHARDWIRE__REQUEST__BODY_GATHER, 1);
  fclose(out);

  /* root, 4241 and 4242 with control sessions and jobs side by side */
  open_seed(dir, "root_and_two_uids");
  fwrite(&root_and_two, 1, 1, out);
  rank_setup(1, "u2", 0, 1);
  on(2); /* 4242's job: buffer 5, views 6 and 7, SGD 8 */
  hello("u2", 0, 1);
  reg_buffer("b", SHARDWIRE__DTYPE__FP32, 1000);
  reg_view(5, "w", 0, 600);
  reg_view(5, "bias", 600, 400);
  {
    uint64_t ids[2] = {6, 7};
    reg_optim(SHARDWIRE__OPTIM_KIND__SGD, ids, 2);
  }
  simple(SHARDWIRE__REQUEST__BODY_GATHER, 5);
  simple(SHARDWIRE__REQUEST__BODY_GATHER, 1);
  on(0);
  hello("", 0, 0);
  simple(SHARDWIRE__REQUEST__BODY_STATUS, 0);
  simple(SHARDWIRE__REQUEST__BODY_INSPECT, 1);
  release_job("4242/u2");
  on(1);
  simple(SHARDWIRE__REQUEST__BODY_INSPECT, 5);
  release_job("4242/u2");
  checkpoint_collective("../4242/x");
  simple(SHARDWIRE__REQUEST__BODY_STEP, 8);
  on(2);
  simple(SHARDWIRE__REQUEST__BODY_SCATTER, 5);
  simple(SHARDWIRE__REQUEST__BODY_STEP, 4);
  fclose(out);
  conn = -1;
  /* Transient areas on two ranks: backward with the next buffer's gather
   * prefetched, one rank closing with its gradient areas leased and
   * coming back, the other's prefetch cut off mid-frame. */
  open_seed(dir, "transient_two_ranks");
  fwrite(&two, 1, 1, out);
  for (int k = 0; k < 2; k++) {
    on(k);
    hello_transient("rT", (uint32_t)k, 2);
    reg_buffer("t1", SHARDWIRE__DTYPE__FP32, 100);
    reg_buffer("t2", SHARDWIRE__DTYPE__FP32, 30);
  }
  for (int k = 0; k < 2; k++) {
    on(k);
    gather_grad(2);
  }
  for (int k = 0; k < 2; k++) {
    on(k);
    gather_grad(1);
    simple(SHARDWIRE__REQUEST__BODY_SCATTER, 2);
    release_area(2, 0);
  }
  act(1, 4); /* rank 1 back in its place: its leases were returned */
  on(1);
  hello_transient("rT", 1, 2);
  gather_grad(2);
  on(0);
  simple(SHARDWIRE__REQUEST__BODY_SCATTER, 1);
  half = 1;
  gather_grad(2);
  half = 0;
  act(0, 3);
  on(1);
  release_area(2, 1);
  fclose(out);
}

int main(int argc, char **argv) {
  if (argc != 2 && argc != 3) {
    fprintf(stderr, "usage: gen_corpus DIR [RANKS_DIR]\n");
    return 2;
  }
  const char *dir = argv[1], *ranks_dir = argc == 3 ? argv[2] : NULL;
  /* Ids are daemon-wide and the fuzzer's daemon lives across inputs, so
   * seeds name small ids; mutation explores the rest. */
  open_seed(dir, "train_fp32");
  hello("fuzz", 0, 1);
  reg_buffer("b", SHARDWIRE__DTYPE__FP32, 1000);
  reg_view(1, "w", 0, 600);
  reg_view(1, "bias", 600, 400);
  uint64_t ids[2] = {2, 3};
  reg_optim(SHARDWIRE__OPTIM_KIND__ADAMW, ids, 2);
  simple(SHARDWIRE__REQUEST__BODY_GATHER, 1);
  simple(SHARDWIRE__REQUEST__BODY_SCATTER, 1);
  simple(SHARDWIRE__REQUEST__BODY_STEP, 4);
  simple(SHARDWIRE__REQUEST__BODY_INSPECT, 1);
  simple(SHARDWIRE__REQUEST__BODY_STATUS, 0);
  fclose(out);

  open_seed(dir, "bf16_sgd_world2");
  hello("fuzz2", 1, 2);
  reg_buffer("h", SHARDWIRE__DTYPE__BF16, 77);
  uint64_t one = 1;
  reg_optim(SHARDWIRE__OPTIM_KIND__SGD, &one, 1);
  simple(SHARDWIRE__REQUEST__BODY_GATHER, 1);
  fclose(out);

  open_seed(dir, "bad_refs");
  hello("fuzz3", 0, 1);
  reg_buffer("x", SHARDWIRE__DTYPE__FP16, 10);
  uint64_t bad[4] = {0, 1, 1, 999};
  reg_optim(SHARDWIRE__OPTIM_KIND__ADAM, bad, 4);
  fclose(out);

  open_seed(dir, "control");
  hello("", 0, 0);
  simple(SHARDWIRE__REQUEST__BODY_STATUS, 0);
  simple(SHARDWIRE__REQUEST__BODY_INSPECT, 5);
  fclose(out);

  /* The later bodies, on one job so ids line up: buffer 1, views 2..5. */
  open_seed(dir, "train_extras");
  hello("fuzz4", 0, 1);
  reg_buffer("m", SHARDWIRE__DTYPE__BF16, 64);
  views_batch(1, 4, 16);
  set_requires_grad(3, 0);
  seed_master(1);
  uint64_t vids[4] = {2, 3, 4, 5};
  reg_optim(SHARDWIRE__OPTIM_KIND__ADAMW, vids, 4);
  simple(SHARDWIRE__REQUEST__BODY_GATHER, 1);
  scatter_masked(1, 4);
  step_groups(6, 1);
  step_groups(6, 0);
  optim_state(6, 2, 0);
  optim_state(6, 5, 1);
  all_reduce(3);
  all_reduce(0);
  set_requires_grad(3, 1);
  checkpoint_collective("ck");
  fclose(out);

  open_seed(dir, "control_release");
  hello("", 0, 0);
  release_job("fuzz4");
  release_job("");
  fclose(out);

  /* Buckets (issue 17): buffers 1..3, view 4 of buffer 1; a good gather
   * and scatter bucket, then one with a duplicate and an unknown id. */
  open_seed(dir, "buckets");
  hello("fuzz5", 0, 1);
  reg_buffer("k1", SHARDWIRE__DTYPE__FP32, 40);
  reg_buffer("k2", SHARDWIRE__DTYPE__BF16, 7);
  reg_buffer("k3", SHARDWIRE__DTYPE__FP32, 1);
  reg_view(1, "kv", 0, 8);
  uint64_t kids[3] = {1, 2, 3}, kbad[3] = {1, 1, 999};
  bucket(0, kids, 3, 0);
  bucket(1, kids, 3, 4);
  bucket(0, kbad, 3, 0);
  fclose(out);

  /* Frozen and trainable views in batches: buffer 1, views 2..6 (frozen
   * [0,32) and [16,48), trainable [64,96) and [80,128), frozen [200,256));
   * a batch refused for meeting the other kind, freezing and unfreezing,
   * collectives over the frozen ranges, inspect, batched unregistering. */
  open_seed(dir, "views_frozen");
  hello("fuzz6", 0, 1);
  reg_buffer("f", SHARDWIRE__DTYPE__FP32, 256);
  {
    uint64_t off[5] = {0, 16, 64, 80, 200}, len[5] = {32, 32, 32, 48, 56};
    int rg[5] = {0, 0, 1, 1, 0};
    views_batch_rg(1, 5, off, len, rg);
    uint64_t boff[3] = {130, 90, 20}, blen[3] = {10, 10, 10};
    int brg[3] = {0, 0, 1}; /* the last two meet the other kind */
    views_batch_rg(1, 3, boff, blen, brg);
  }
  set_requires_grad(2, 1); /* meets frozen view 3: refused */
  set_requires_grad(6, 1);
  set_requires_grad(4, 0); /* meets trainable view 5: refused */
  simple(SHARDWIRE__REQUEST__BODY_GATHER, 1);
  simple(SHARDWIRE__REQUEST__BODY_SCATTER, 1);
  scatter_masked(1, 4);
  simple(SHARDWIRE__REQUEST__BODY_INSPECT, 1);
  {
    uint64_t un[3] = {3, 2, 999}, gen[3] = {1, 7, 0};
    views_unbatch(3, un, gen);
    uint64_t ok[2] = {3, 2}, nogen[2] = {0, 0};
    views_unbatch(2, ok, nogen);
  }
  simple(SHARDWIRE__REQUEST__BODY_SCATTER, 1);
  simple(SHARDWIRE__REQUEST__BODY_STATUS, 0);
  fclose(out);

  /* Buffers in batches: attach, a bad dtype refusing the batch, and
   * batched unregistering with an unknown id. */
  open_seed(dir, "buffers_batch");
  hello("fuzz7", 0, 2);
  {
    const char *names[4] = {"p", "q", "p", "bad"};
    Shardwire__DType dt[4] = {SHARDWIRE__DTYPE__FP32, SHARDWIRE__DTYPE__BF16,
                              SHARDWIRE__DTYPE__FP32, (Shardwire__DType)99};
    uint64_t numel[4] = {10, 20, 10, 5};
    buffers_batch(4, names, dt, numel);
    buffers_batch(3, names, dt, numel);
    uint64_t un[3] = {1, 2, 999}, ok[2] = {1, 2};
    buffers_unbatch(3, un);
    buffers_unbatch(2, ok);
  }
  fclose(out);

  /* Buffers in slabs: a batch made in one memfd (a name twice), one of
   * them attached alone, one freed (punched) while the others live, a
   * batch refused half way (its slab's blocks undone), the rest freed. */
  open_seed(dir, "buffers_slab");
  hello_at_offsets("fuzz10", 0, 2);
  {
    const char *names[4] = {"s1", "s2", "s1", "s3"};
    Shardwire__DType dt[4] = {SHARDWIRE__DTYPE__FP32, SHARDWIRE__DTYPE__BF16,
                              SHARDWIRE__DTYPE__FP32, SHARDWIRE__DTYPE__FP16};
    uint64_t numel[4] = {1000, 20, 1000, 5000};
    buffers_batch(4, names, dt, numel);
    reg_buffer("s2", SHARDWIRE__DTYPE__BF16, 20);
    simple(SHARDWIRE__REQUEST__BODY_GATHER, 1);
    uint64_t one[1] = {2}, rest[2] = {1, 3};
    buffers_unbatch(1, one);
    const char *half[3] = {"t1", "t2", "t3"};
    Shardwire__DType hdt[3] = {SHARDWIRE__DTYPE__FP32, SHARDWIRE__DTYPE__FP32,
                               (Shardwire__DType)99};
    uint64_t hn[3] = {64, 64, 64};
    buffers_batch(3, half, hdt, hn);
    buffers_unbatch(2, rest);
  }
  fclose(out);

  /* Optimizer state and seeded masters: bf16 buffer 1 seeded before its
   * first step, view 2, Adam 3 over it; state read, written, the master,
   * step counts; an fp32 buffer 4 seeded (refused). */
  open_seed(dir, "optim_state");
  hello("fuzz8", 0, 1);
  reg_buffer("o", SHARDWIRE__DTYPE__BF16, 64);
  seed_master(1);
  reg_view(1, "ov", 0, 32);
  {
    uint64_t v = 2;
    reg_optim(SHARDWIRE__OPTIM_KIND__ADAM, &v, 1);
  }
  reg_buffer("o32", SHARDWIRE__DTYPE__FP32, 8);
  seed_master(4);
  optim_state_ex(3, 2, 0, 0, 0, 0, 0, 0);
  simple(SHARDWIRE__REQUEST__BODY_GATHER, 1);
  simple(SHARDWIRE__REQUEST__BODY_SCATTER, 1);
  simple(SHARDWIRE__REQUEST__BODY_STEP, 3);
  optim_state_ex(3, 2, 1, 8, 0, 0, 0, 0);
  optim_state_ex(3, 2, 0, 8, 1, 0, 5, 9);
  optim_state_ex(3, 2, 0xffffffffu, 4, 1, 0, 0, 0);
  optim_state_ex(3, 2, 0, 4, 0, 1, 0, 0);
  optim_state_ex(3, 2, 7, 1u << 30, 0, 0, 0, 0);
  optim_state_ex(3, 999, 0, 1, 0, 0, 0, 0);
  optim_state_ex(1, 2, 0, 1, 0, 0, 0, 0);
  fclose(out);

  /* Releasing jobs by UID/NAME and names with a slash. */
  open_seed(dir, "release_names");
  hello("", 0, 0);
  release_job("0/fuzz6");
  release_job("fuzz6/x");
  release_job("4294967296/fuzz6");
  fclose(out);

  /* A collective checkpoint and a request reusing its seq, then the job
   * goes with the connection and the next input's job takes its place. */
  open_seed(dir, "checkpoint_seq");
  hello("fuzz9", 0, 1);
  reg_buffer("c", SHARDWIRE__DTYPE__FP32, 16);
  checkpoint_then_same_seq("ckseq", 1, 1000);
  checkpoint_collective("ck2");
  simple(SHARDWIRE__REQUEST__BODY_GATHER, 1);
  fclose(out);

  /* Transient areas: forward gathers and releases, then backward with
   * the next unit's gather (and its gradient area) prefetched before this
   * one's scatter, a step, an iteration abandoned with its gradient area
   * unscattered, and more leases than a rank may hold. Buffers 1 and 2,
   * SGD 3 over both. Its seqs do not count for the seeds after it, which
   * were written before it came. */
  uint64_t seq_before = last_seq;
  open_seed(dir, "transient_prefetch");
  hello_transient("fuzzT", 0, 1);
  reg_buffer("l1", SHARDWIRE__DTYPE__FP32, 1000);
  reg_buffer("l2", SHARDWIRE__DTYPE__BF16, 300);
  {
    uint64_t bufs[2] = {1, 2};
    reg_optim(SHARDWIRE__OPTIM_KIND__SGD, bufs, 2);
  }
  simple(SHARDWIRE__REQUEST__BODY_GATHER, 1);
  release_area(1, 0);
  simple(SHARDWIRE__REQUEST__BODY_GATHER, 2);
  release_area(2, 0);
  gather_grad(2);
  gather_grad(1); /* the prefetch */
  simple(SHARDWIRE__REQUEST__BODY_SCATTER, 2);
  release_area(2, 0);
  simple(SHARDWIRE__REQUEST__BODY_SCATTER, 1);
  release_area(1, 0);
  simple(SHARDWIRE__REQUEST__BODY_STEP, 3);
  gather_grad(1);
  release_area(1, 1); /* abandoned: its gradient area back unscattered */
  gather_grad(2);
  gather_grad(2);
  gather_grad(2); /* past the leases a rank may hold */
  simple(SHARDWIRE__REQUEST__BODY_INSPECT, 2);
  simple(SHARDWIRE__REQUEST__BODY_STATUS, 0);
  fclose(out);
  last_seq = seq_before;

  if (ranks_dir)
    ranks_seeds(ranks_dir);
  return 0;
}
