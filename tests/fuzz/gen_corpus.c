/* gen_corpus.c — writes the fuzzer's seed corpus: client byte streams of
 * valid framed Requests (hello, register, views, optimizer, gather, scatter,
 * step, status, inspect), so mutation starts from inputs that reach deep
 * into dispatch. Usage: gen_corpus DIR */
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
  return 0;
}
