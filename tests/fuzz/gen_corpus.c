/* gen_corpus.c — writes the fuzzer's seed corpus: client byte streams of
 * valid framed Requests (hello, register, views, optimizer, gather, scatter,
 * step, status, inspect, and the later bodies: batched views, frozen views,
 * seeded masters, accumulating and masked scatters, per-group and norm-only
 * steps, optimizer state, all-reduce, collective checkpoints, job release,
 * buckets of gathers and scatters),
 * so mutation starts from inputs that reach deep into dispatch.
 * Usage: gen_corpus DIR. The seeds are committed; after adding one, rebuild
 * and rerun it (cc -D_GNU_SOURCE -Iclient -Ibuild/gen tests/fuzz/gen_corpus.c
 * client/frame.c build/gen/proto/shardd.pb-c.c -lprotobuf-c). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "frame.h"
#include "proto/shardd.pb-c.h"

static FILE *out;

static void emit(Shardwire__Request *r) {
  static uint64_t seq;
  r->seq = ++seq;
  size_t n = shardwire__request__get_packed_size(r);
  uint8_t *buf = malloc(n + 4);
  shardd__frame_put_header(buf, (uint32_t)n);
  shardwire__request__pack(r, buf + 4);
  fwrite(buf, 1, n + 4, out);
  free(buf);
}

static void hello(const char *job, uint32_t rank, uint32_t world) {
  Shardwire__Request r = SHARDWIRE__REQUEST__INIT;
  Shardwire__Hello h = SHARDWIRE__HELLO__INIT;
  h.protocol_version = 1;
  h.job = (char *)job;
  h.has_rank = h.has_world = 1;
  h.rank = rank;
  h.world = world;
  r.body_case = SHARDWIRE__REQUEST__BODY_HELLO;
  r.hello = &h;
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

static void open_seed(const char *dir, const char *name) {
  char path[512];
  snprintf(path, sizeof path, "%s/%s", dir, name);
  out = fopen(path, "wb");
  if (out == NULL) {
    perror(path);
    exit(1);
  }
}

int main(int argc, char **argv) {
  if (argc != 2) {
    fprintf(stderr, "usage: gen_corpus DIR\n");
    return 2;
  }
  const char *dir = argv[1];
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
  return 0;
}
