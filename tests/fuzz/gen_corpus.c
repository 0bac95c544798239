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

static void emit(Shardd__Request *r) {
  static uint64_t seq;
  r->seq = ++seq;
  size_t n = shardd__request__get_packed_size(r);
  uint8_t *buf = malloc(n + 4);
  shardd__frame_put_header(buf, (uint32_t)n);
  shardd__request__pack(r, buf + 4);
  fwrite(buf, 1, n + 4, out);
  free(buf);
}

static void hello(const char *job, uint32_t rank, uint32_t world) {
  Shardd__Request r = SHARDD__REQUEST__INIT;
  Shardd__Hello h = SHARDD__HELLO__INIT;
  h.protocol_version = 1;
  h.job = (char *)job;
  h.has_rank = h.has_world = 1;
  h.rank = rank;
  h.world = world;
  r.body_case = SHARDD__REQUEST__BODY_HELLO;
  r.hello = &h;
  emit(&r);
}

static void reg_buffer(const char *name, Shardd__DType dt, uint64_t numel) {
  Shardd__Request r = SHARDD__REQUEST__INIT;
  Shardd__RegisterBuffer b = SHARDD__REGISTER_BUFFER__INIT;
  b.name = (char *)name;
  b.dtype = dt;
  b.numel = numel;
  r.body_case = SHARDD__REQUEST__BODY_REGISTER_BUFFER;
  r.register_buffer = &b;
  emit(&r);
}

static void reg_view(uint64_t buf, const char *name, uint64_t off, uint64_t n) {
  Shardd__Request r = SHARDD__REQUEST__INIT;
  Shardd__RegisterView v = SHARDD__REGISTER_VIEW__INIT;
  int64_t shape[1] = {(int64_t)n};
  v.buffer = buf;
  v.name = (char *)name;
  v.offset = off;
  v.numel = n;
  v.n_shape = 1;
  v.shape = shape;
  r.body_case = SHARDD__REQUEST__BODY_REGISTER_VIEW;
  r.register_view = &v;
  emit(&r);
}

static void reg_optim(Shardd__OptimKind kind, const uint64_t *ids, size_t n) {
  Shardd__Request r = SHARDD__REQUEST__INIT;
  Shardd__RegisterOptimizer o = SHARDD__REGISTER_OPTIMIZER__INIT;
  Shardd__ParamGroup g = SHARDD__PARAM_GROUP__INIT;
  Shardd__ParamGroup *gp = &g;
  Shardd__ParamRef refs[8], *rp[8];
  Shardd__HyperParams hp = SHARDD__HYPER_PARAMS__INIT;
  hp.has_lr = 1;
  hp.lr = 0.01;
  for (size_t i = 0; i < n; i++) {
    shardd__param_ref__init(&refs[i]);
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
  r.body_case = SHARDD__REQUEST__BODY_REGISTER_OPTIMIZER;
  r.register_optimizer = &o;
  emit(&r);
}

static void simple(Shardd__Request__BodyCase bc, uint64_t id) {
  Shardd__Request r = SHARDD__REQUEST__INIT;
  Shardd__Gather g = SHARDD__GATHER__INIT;
  Shardd__Scatter s = SHARDD__SCATTER__INIT;
  Shardd__Step st = SHARDD__STEP__INIT;
  Shardd__StatusRequest sr = SHARDD__STATUS_REQUEST__INIT;
  Shardd__Inspect in = SHARDD__INSPECT__INIT;
  r.body_case = bc;
  switch (bc) {
  case SHARDD__REQUEST__BODY_GATHER:
    g.buffer = id;
    r.gather = &g;
    break;
  case SHARDD__REQUEST__BODY_SCATTER:
    s.buffer = id;
    s.has_op = 1;
    s.op = SHARDD__REDUCE_OP__MEAN;
    r.scatter = &s;
    break;
  case SHARDD__REQUEST__BODY_STEP:
    st.optimizer = id;
    st.has_max_norm = 1;
    st.max_norm = 1.0;
    r.step = &st;
    break;
  case SHARDD__REQUEST__BODY_INSPECT:
    in.has_id = 1;
    in.id = id;
    r.inspect = &in;
    break;
  default:
    r.body_case = SHARDD__REQUEST__BODY_STATUS;
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
  reg_buffer("b", SHARDD__DTYPE__FP32, 1000);
  reg_view(1, "w", 0, 600);
  reg_view(1, "bias", 600, 400);
  uint64_t ids[2] = {2, 3};
  reg_optim(SHARDD__OPTIM_KIND__ADAMW, ids, 2);
  simple(SHARDD__REQUEST__BODY_GATHER, 1);
  simple(SHARDD__REQUEST__BODY_SCATTER, 1);
  simple(SHARDD__REQUEST__BODY_STEP, 4);
  simple(SHARDD__REQUEST__BODY_INSPECT, 1);
  simple(SHARDD__REQUEST__BODY_STATUS, 0);
  fclose(out);

  open_seed(dir, "bf16_sgd_world2");
  hello("fuzz2", 1, 2);
  reg_buffer("h", SHARDD__DTYPE__BF16, 77);
  uint64_t one = 1;
  reg_optim(SHARDD__OPTIM_KIND__SGD, &one, 1);
  simple(SHARDD__REQUEST__BODY_GATHER, 1);
  fclose(out);

  open_seed(dir, "bad_refs");
  hello("fuzz3", 0, 1);
  reg_buffer("x", SHARDD__DTYPE__FP16, 10);
  uint64_t bad[4] = {0, 1, 1, 999};
  reg_optim(SHARDD__OPTIM_KIND__ADAM, bad, 4);
  fclose(out);

  open_seed(dir, "control");
  hello("", 0, 0);
  simple(SHARDD__REQUEST__BODY_STATUS, 0);
  simple(SHARDD__REQUEST__BODY_INSPECT, 5);
  fclose(out);
  return 0;
}
