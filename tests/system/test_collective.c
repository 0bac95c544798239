/* test_collective.c — gather, scatter and step across the ranks of a job,
 * against a real shardd with --devices 4 (1 for the scatter with no work:
 * a wholly frozen buffer's). Ranks are libshardd clients driven
 * from threads (the collective calls block until every rank made them), or
 * raw wire clients where a test needs to know a request has been queued
 * (pipelined Ping) or to kill a rank from a child process. Every expected
 * value is computed here: concatenations, exact sums, and an optimizer
 * reference written from torch.optim's formulas (not kernels/optim.c). */
#include <criterion/criterion.h>
#include <criterion/parameterized.h>
#include <float.h>
#include <math.h>
#include <pthread.h>

#include "harness.h"

#define MAXW 4

static test_daemon d;

static void start4(void) {
  const char *args[] = {"--devices", "4", NULL};
  test_daemon_start(&d, args);
}

/* The test that waits for the timeout on purpose takes this long; 5 s, so
 * that a rank thread that starts late on a loaded machine still arrives
 * before the timeout (the message must name only the rank never called). */
static void start4_timeout(void) {
  const char *args[] = {"--devices", "4", "--collective-timeout", "5", NULL};
  test_daemon_start(&d, args);
}

static void stop_daemon(void) { test_daemon_finish(&d); }

/* ---- a team of libshardd ranks, one thread each per collective ---------- */

typedef struct {
  int world;
  shardd_client_t *c[MAXW];
} team;

enum { OP_GATHER, OP_SCATTER, OP_STEP };

typedef struct {
  shardd_client_t *c;
  int kind;
  uint64_t id;
  shardd_reduce_op op;
  shardd_step_opts so;
  shardd_step_result res;
  shardd_err rc;
  char msg[1024];
  pthread_t th;
} call;

static void team_open(team *t, const char *job, int world) {
  memset(t, 0, sizeof *t);
  t->world = world;
  for (int r = 0; r < world; r++)
    t->c[r] = test_connect(&d, job, (uint32_t)r, (uint32_t)world);
}

static void team_close(team *t) {
  for (int r = 0; r < t->world; r++)
    shardd_close(t->c[r]);
  memset(t, 0, sizeof *t);
}

static void team_buffer(team *t, const char *name, shardd_dtype dt, uint64_t numel,
                        shardd_buffer_info *out) {
  for (int r = 0; r < t->world; r++) {
    shardd_err rc = shardd_buffer_register(t->c[r], name, dt, numel, &out[r]);
    cr_assert_eq(rc, SHARDD_OK, "rank %d: register %s: %s", r, name,
                 shardd_last_error(t->c[r]));
    cr_assert_eq(out[r].id, out[0].id);
    cr_assert_eq(out[r].created, r == 0);
  }
}

static void team_view(team *t, uint64_t buf, const char *name, uint64_t off,
                      uint64_t numel, const int64_t *shape, int ndim, uint64_t *id) {
  for (int r = 0; r < t->world; r++) {
    uint64_t got;
    shardd_err rc = shardd_view_register(t->c[r], buf, name, off, numel, shape, ndim, &got);
    cr_assert_eq(rc, SHARDD_OK, "rank %d: view %s: %s", r, name, shardd_last_error(t->c[r]));
    if (r == 0)
      *id = got;
    cr_assert_eq(got, *id);
  }
}

static void team_optimizer(team *t, const char *name, shardd_optim_kind kind,
                           const shardd_hparams *hp, const shardd_param_group *g,
                           size_t ng, uint64_t *id) {
  for (int r = 0; r < t->world; r++) {
    uint64_t got;
    shardd_err rc = shardd_optimizer_register(t->c[r], name, kind, hp, g, ng, &got);
    cr_assert_eq(rc, SHARDD_OK, "rank %d: optimizer %s: %s", r, name,
                 shardd_last_error(t->c[r]));
    if (r == 0)
      *id = got;
    cr_assert_eq(got, *id);
  }
}

static void *call_main(void *p) {
  call *k = p;
  switch (k->kind) {
  case OP_GATHER:
    k->rc = shardd_gather(k->c, k->id);
    break;
  case OP_SCATTER:
    k->rc = shardd_scatter(k->c, k->id, k->op);
    break;
  default:
    k->rc = shardd_step(k->c, k->id, &k->so, &k->res);
    break;
  }
  snprintf(k->msg, sizeof k->msg, "%s", k->rc ? shardd_last_error(k->c) : "");
  return NULL;
}

/* Runs calls[r] on ranks where calls[r].c is set, all at once; joins. */
static void run_calls(call *calls, int n) {
  for (int r = 0; r < n; r++)
    if (calls[r].c)
      cr_assert_eq(pthread_create(&calls[r].th, NULL, call_main, &calls[r]), 0);
  for (int r = 0; r < n; r++)
    if (calls[r].c)
      pthread_join(calls[r].th, NULL);
}

static void team_all_res(team *t, int kind, uint64_t id, shardd_reduce_op op,
                         const shardd_step_opts *so, shardd_step_result *res) {
  call calls[MAXW];
  memset(calls, 0, sizeof calls);
  for (int r = 0; r < t->world; r++) {
    calls[r].c = t->c[r];
    calls[r].kind = kind;
    calls[r].id = id;
    calls[r].op = op;
    shardd_step_opts dflt = SHARDD_STEP_OPTS_INIT;
    calls[r].so = so ? *so : dflt;
  }
  run_calls(calls, t->world);
  for (int r = 0; r < t->world; r++) {
    cr_assert_eq(calls[r].rc, SHARDD_OK, "rank %d: collective %d on %llu: %s: %s", r,
                 kind, (unsigned long long)id, shardd_err_name(calls[r].rc),
                 calls[r].msg);
    if (res)
      res[r] = calls[r].res;
  }
}

static void team_all(team *t, int kind, uint64_t id, shardd_reduce_op op) {
  team_all_res(t, kind, id, op, NULL, NULL);
}

/* ---- values ------------------------------------------------------------- */

static uint32_t mix(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  x ^= x >> 16;
  return x;
}

static size_t esize(shardd_dtype dt) { return dt == SHARDD_DTYPE_FP32 ? 4 : 2; }

/* A value +-(1 + m/128) * 2^e, e in [-2, 2]: exact in bf16, fp16 and fp32,
 * and sums of up to four of them are exact in fp32 (at most 12 significant
 * bits), while most are not representable in bf16. */
static double grid_value(uint32_t h) {
  int m = (int)(h & 127u);
  int e = (int)((h >> 7) % 5u) - 2;
  double v = ldexp(1.0 + m / 128.0, e);
  return (h >> 12) & 1u ? -v : v;
}

/* The bit pattern of a grid value, encoded by hand for each format. */
static void put_grid(shardd_dtype dt, void *base, size_t i, uint32_t h) {
  uint32_t m = h & 127u;
  int e = (int)((h >> 7) % 5u) - 2;
  uint32_t sign = (h >> 12) & 1u;
  if (dt == SHARDD_DTYPE_FP32) {
    uint32_t u = sign << 31 | (uint32_t)(e + 127) << 23 | m << 16;
    memcpy((char *)base + 4 * i, &u, 4);
  } else if (dt == SHARDD_DTYPE_BF16) {
    uint16_t u = (uint16_t)(sign << 15 | (uint32_t)(e + 127) << 7 | m);
    memcpy((char *)base + 2 * i, &u, 2);
  } else {
    uint16_t u = (uint16_t)(sign << 15 | (uint32_t)(e + 15) << 10 | m << 3);
    memcpy((char *)base + 2 * i, &u, 2);
  }
}

static float f32_at(const void *base, size_t i) {
  float f;
  memcpy(&f, (const char *)base + 4 * i, 4);
  return f;
}

static uint32_t f32_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
}

/* bf16 round-to-nearest-even of a finite float, by the definition: the
 * nearer of the two neighbours with 8 significant bits, even on a tie. */
static int representable_bf16(double v) {
  if (v == 0)
    return 1;
  int e;
  double m = frexp(fabs(v), &e); /* [0.5, 1) */
  double scaled = ldexp(m, 8);   /* 8 significant bits */
  return scaled == floor(scaled);
}

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

static void fill_shards(const shardd_buffer_info *b, int world, uint32_t salt) {
  for (int r = 0; r < world; r++) {
    size_t bytes = b[r].shard_numel * esize(b[r].dtype);
    unsigned char *p = b[r].shard;
    for (size_t k = 0; k < bytes; k++)
      p[k] = (unsigned char)mix(salt * 977u + (uint32_t)r * 100003u + (uint32_t)k);
  }
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

static uint32_t grad_hash(int r, size_t j, uint32_t salt) {
  return mix((uint32_t)j * 2654435761u ^ (uint32_t)r * 40503u ^ salt);
}

static void fill_grads(const shardd_buffer_info *b, int world, uint32_t salt) {
  for (int r = 0; r < world; r++)
    for (size_t j = 0; j < b[r].padded_numel; j++)
      put_grid(b[r].dtype, b[r].grad, j, grad_hash(r, j, salt));
}

/* The reduced value of element j, in double (exact), then to float. */
static float expected_reduced(int world, size_t j, uint32_t salt, int op) {
  double s = 0;
  for (int r = 0; r < world; r++)
    s += grid_value(grad_hash(r, j, salt));
  float f = (float)s;
  cr_assert_eq((double)f, s, "test values must sum exactly in fp32");
  return op == SHARDD_REDUCE_MEAN ? f / (float)world : f;
}

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

/* ---- a rank lost mid-collective ----------------------------------------- */

#define LOST_NUMEL 4099

static void child_rank3(const char *sock, int ready, int go, int kind) {
  shardd_connect_opts o = SHARDD_CONNECT_OPTS_INIT;
  o.job = "lost";
  o.rank = 3;
  o.world = 4;
  shardd_client_t *c;
  char err[256], ch = 0;
  if (shardd_connect(sock, &o, &c, err, sizeof err) != SHARDD_OK)
    _exit(10);
  shardd_buffer_info b;
  if (shardd_buffer_register(c, "g", SHARDD_DTYPE_FP32, LOST_NUMEL, &b) != SHARDD_OK)
    _exit(11);
  for (size_t i = 0; i < b.shard_numel; i++)
    ((float *)b.shard)[i] = (float)(3000000 + i);
  for (size_t j = 0; j < b.padded_numel; j++)
    put_grid(SHARDD_DTYPE_FP32, b.grad, j, grad_hash(3, j, 1));
  if (write(ready, "r", 1) != 1)
    _exit(12);
  shardd_err rc = kind == OP_GATHER ? shardd_gather(c, b.id)
                                    : shardd_scatter(c, b.id, SHARDD_REDUCE_SUM);
  if (rc != SHARDD_OK)
    _exit(13);
  if (write(ready, "s", 1) != 1)
    _exit(14);
  if (read(go, &ch, 1) != 1)
    _exit(15);
  _exit(0); /* gone without a word, mid-collective for the others */
}

typedef struct {
  int kind;
} lost_case;

ParameterizedTestParameters(collective, rank_lost_mid_collective) {
  static lost_case cases[] = {{OP_SCATTER}, {OP_GATHER}};
  return cr_make_param_array(lost_case, cases, 2);
}

ParameterizedTest(lost_case *lc, collective, rank_lost_mid_collective, .init = start4,
                  .fini = stop_daemon, .timeout = 60) {
  int ready[2], go[2];
  cr_assert_eq(pipe(ready), 0);
  cr_assert_eq(pipe(go), 0);
  pid_t child = fork();
  cr_assert(child >= 0);
  if (child == 0) {
    close(ready[0]);
    close(go[1]);
    child_rank3(d.sock, ready[1], go[0], lc->kind);
  }
  close(ready[1]);
  close(go[0]);

  test_raw r[3];
  shardd_buffer_info b[4];
  for (int k = 0; k < 3; k++) {
    test_raw_open(&d, &r[k]);
    test_raw_hello(&r[k], "lost", (uint32_t)k, 4);
    test_raw_register_buffer(&r[k], "g", SHARDD_DTYPE_FP32, LOST_NUMEL, &b[k]);
    for (size_t i = 0; i < b[k].shard_numel; i++)
      ((float *)b[k].shard)[i] = (float)(1000000 * k + (int)i);
    for (size_t j = 0; j < b[k].padded_numel; j++)
      put_grid(SHARDD_DTYPE_FP32, b[k].grad, j, grad_hash(k, j, 1));
  }
  char ch;
  cr_assert_eq(read(ready[0], &ch, 1), 1, "rank 3 did not get ready");
  /* one complete collective with rank 3, so the areas hold known data */
  uint64_t seq[3];
  for (int k = 0; k < 3; k++)
    seq[k] = lc->kind == OP_GATHER ? test_raw_send_gather(&r[k], b[0].id)
                                   : test_raw_send_scatter(&r[k], b[0].id, SHARDD_REDUCE_SUM);
  for (int k = 0; k < 3; k++)
    shardwire__response__free_unpacked(test_raw_expect(&r[k], seq[k], SHARDD_OK), NULL);
  cr_assert_eq(read(ready[0], &ch, 1), 1, "rank 3's first collective failed");
  uint64_t s = b[0].shard_numel;
  if (lc->kind == OP_SCATTER) {
    for (int k = 0; k < 3; k++)
      for (size_t i = 0; i < s; i++)
        cr_assert_eq(f32_at(b[k].reduced, i),
                     expected_reduced(4, (size_t)k * s + i, 1, SHARDD_REDUCE_SUM));
  } else {
    for (size_t j = 0; j < b[0].padded_numel; j++) {
      size_t q = j / s, i = j % s;
      cr_assert_eq(f32_at(b[1].gather, j), (float)(1000000 * (int)q + (int)i));
    }
  }

  /* New inputs, then the state right before the collective that will fail. */
  for (int k = 0; k < 3; k++) {
    for (size_t i = 0; i < s; i++)
      ((float *)b[k].shard)[i] = -(float)(1000000 * k + (int)i);
    for (size_t j = 0; j < b[k].padded_numel; j++)
      put_grid(SHARDD_DTYPE_FP32, b[k].grad, j, grad_hash(k, j, 9));
  }
  size_t sb = s * 4, gb = b[0].padded_numel * 4;
  unsigned char *sv_shard[3], *sv_red[3], *sv_gather[3];
  for (int k = 0; k < 3; k++) {
    sv_shard[k] = malloc(sb);
    sv_red[k] = malloc(sb);
    sv_gather[k] = malloc(gb);
    memcpy(sv_shard[k], b[k].shard, sb);
    memcpy(sv_red[k], b[k].reduced, sb);
    memcpy(sv_gather[k], b[k].gather, gb);
  }
  /* ranks 0-2 submit and are known to be queued (the Pong comes after) */
  for (int k = 0; k < 3; k++) {
    seq[k] = lc->kind == OP_GATHER ? test_raw_send_gather(&r[k], b[0].id)
                                   : test_raw_send_scatter(&r[k], b[0].id, SHARDD_REDUCE_SUM);
    test_raw_sync(&r[k]);
  }
  /* rank 3 dies */
  cr_assert_eq(write(go[1], "g", 1), 1);
  int st;
  cr_assert_eq(waitpid(child, &st, 0), child);
  cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == 0, "rank 3 child exited %d",
            WIFEXITED(st) ? WEXITSTATUS(st) : -1);
  close(ready[0]);
  close(go[1]);
  for (int k = 0; k < 3; k++) {
    Shardwire__Response *resp = test_raw_expect(&r[k], seq[k], SHARDD_E_PEER_LOST);
    cr_assert_not_null(strstr(resp->message, "rank 3"), "rank %d: \"%s\" does not name rank 3",
                       k, resp->message);
    shardwire__response__free_unpacked(resp, NULL);
  }
  for (int k = 0; k < 3; k++) {
    cr_assert_eq(memcmp(sv_shard[k], b[k].shard, sb), 0, "rank %d's shard changed", k);
    cr_assert_eq(memcmp(sv_red[k], b[k].reduced, sb), 0, "rank %d's reduced shard changed", k);
    cr_assert_eq(memcmp(sv_gather[k], b[k].gather, gb), 0, "rank %d's gather area changed", k);
    free(sv_shard[k]);
    free(sv_red[k]);
    free(sv_gather[k]);
  }
  /* rank 3's block is intact too: a new rank 3 attaches and looks */
  shardd_client_t *c3 = NULL;
  for (double end = test_mono_s() + TEST_HANG_S;;) {
    shardd_connect_opts o = SHARDD_CONNECT_OPTS_INIT;
    o.job = "lost";
    o.rank = 3;
    o.world = 4;
    char err[256];
    shardd_err rc = shardd_connect(d.sock, &o, &c3, err, sizeof err);
    if (rc == SHARDD_OK)
      break;
    cr_assert_lt(test_mono_s(), end, "rank 3 cannot reconnect: %s", err);
    test_sleep_ms(10);
  }
  shardd_buffer_info b3;
  cr_assert_eq(shardd_buffer_register(c3, "g", SHARDD_DTYPE_FP32, LOST_NUMEL, &b3), SHARDD_OK);
  cr_assert(!b3.created);
  for (size_t i = 0; i < s; i++) {
    cr_assert_eq(f32_at(b3.shard, i), (float)(3000000 + i), "rank 3 shard[%zu]", i);
    if (lc->kind == OP_SCATTER)
      cr_assert_eq(f32_at(b3.reduced, i),
                   expected_reduced(4, 3 * s + i, 1, SHARDD_REDUCE_SUM), "rank 3 reduced[%zu]", i);
  }
  /* and the job trains on: a full collective with the new rank 3 */
  for (int k = 0; k < 3; k++)
    seq[k] = test_raw_send_gather(&r[k], b[0].id);
  cr_assert_eq(shardd_gather(c3, b3.id), SHARDD_OK, "%s", shardd_last_error(c3));
  for (int k = 0; k < 3; k++)
    shardwire__response__free_unpacked(test_raw_expect(&r[k], seq[k], SHARDD_OK), NULL);
  for (size_t i = 0; i < s; i++)
    cr_assert_eq(f32_at(b3.gather, i), -(float)i);
  shardd_client_t *ctl = test_connect(&d, NULL, 0, 1);
  char *js;
  cr_assert_eq(shardd_status_json(ctl, &js), SHARDD_OK);
  tj *j = tj_parse(js);
  cr_assert_not_null(j);
  const tj *jobs = tj_need(j, "jobs", TJ_ARR);
  cr_assert_eq(jobs->n, 1);
  cr_assert_eq(tj_need(jobs->kids[0], "collectives_in_flight", TJ_NUM)->num, 0.0);
  tj_free(j);
  shardd_free(js);
  shardd_close(ctl);
  shardd_close(c3);
  for (int k = 0; k < 3; k++)
    test_raw_close(&r[k]);
}

Test(collective, rank_never_arrives_times_out, .init = start4_timeout, .fini = stop_daemon, .timeout = 60) {
  team t;
  team_open(&t, "slow", 4);
  shardd_buffer_info b[MAXW];
  team_buffer(&t, "g", SHARDD_DTYPE_FP32, 1000, b);
  fill_shards(b, 4, 3);
  fill_grads(b, 4, 3);
  unsigned char *sv[MAXW];
  for (int r = 0; r < 4; r++) {
    sv[r] = malloc(b[r].shard_numel * 4);
    memcpy(sv[r], b[r].reduced, b[r].shard_numel * 4);
  }
  call calls[MAXW];
  memset(calls, 0, sizeof calls);
  for (int r = 0; r < 3; r++) { /* rank 3 is connected but never calls */
    calls[r].c = t.c[r];
    calls[r].kind = OP_SCATTER;
    calls[r].id = b[0].id;
  }
  run_calls(calls, 3);
  for (int r = 0; r < 3; r++) {
    cr_assert_eq(calls[r].rc, SHARDD_E_PEER_LOST, "rank %d: %s: %s", r,
                 shardd_err_name(calls[r].rc), calls[r].msg);
    cr_assert_not_null(strstr(calls[r].msg, "timed out"), "rank %d: \"%s\"", r, calls[r].msg);
    cr_assert_not_null(strstr(calls[r].msg, "rank 3"), "rank %d: \"%s\"", r, calls[r].msg);
  }
  for (int r = 0; r < 4; r++) {
    cr_assert_eq(memcmp(sv[r], b[r].reduced, b[r].shard_numel * 4), 0);
    free(sv[r]);
  }
  for (int r = 0; r < 4; r++)
    cr_assert_eq(shardd_ping(t.c[r]), SHARDD_OK);
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

/* ---- optimizer reference (torch.optim formulas, in float) ---------------- */

typedef struct {
  shardd_optim_kind kind;
  double lr, momentum, dampening, wd, beta1, beta2, eps;
  int nesterov, amsgrad, maximize;
} ref_hp;

typedef struct {
  float *p, *buf, *m, *v, *vmax;
  size_t n;
} ref_state;

/* torch.optim.SGD, one element, step t (1-based). */
static void ref_sgd(const ref_hp *h, int t, float *p, float g, float *buf) {
  float dp = h->maximize ? -g : g;
  if (h->wd != 0)
    dp = dp + (float)h->wd * *p;
  if (h->momentum != 0) {
    if (t == 1)
      *buf = dp;
    else
      *buf = *buf * (float)h->momentum + (float)(1 - h->dampening) * dp;
    dp = h->nesterov ? dp + (float)h->momentum * *buf : *buf;
  }
  *p = *p - (float)h->lr * dp;
}

/* torch.optim.Adam / AdamW (torch 2.x single-tensor form: lerp for the
 * first moment), one element, step t. */
static void ref_adam(const ref_hp *h, int t, float *p, float g, float *m, float *v,
                     float *vmax) {
  if (h->maximize)
    g = -g;
  if (h->kind == SHARDD_OPTIM_ADAMW)
    *p = *p * (float)(1 - h->lr * h->wd);
  else if (h->wd != 0)
    g = g + (float)h->wd * *p;
  *m = *m + (float)(1 - h->beta1) * (g - *m);
  *v = *v * (float)h->beta2 + (float)(1 - h->beta2) * g * g;
  double bc1 = 1 - pow(h->beta1, t), bc2 = 1 - pow(h->beta2, t);
  double step_size = h->lr / bc1;
  float s = *v;
  if (h->amsgrad) {
    *vmax = fmaxf(*vmax, *v);
    s = *vmax;
  }
  float denom = sqrtf(s) / (float)sqrt(bc2) + (float)h->eps;
  *p = *p - (float)step_size * (*m / denom);
}

static void hp_set(shardd_hparams *o, const ref_hp *h) {
  memset(o, 0, sizeof *o);
  o->set = SHARDD_HP_LR | SHARDD_HP_WEIGHT_DECAY;
  o->lr = h->lr;
  o->weight_decay = h->wd;
  if (h->kind == SHARDD_OPTIM_SGD) {
    o->set |= SHARDD_HP_MOMENTUM | SHARDD_HP_DAMPENING | SHARDD_HP_NESTEROV;
    o->momentum = h->momentum;
    o->dampening = h->dampening;
    o->nesterov = h->nesterov;
  } else {
    o->set |= SHARDD_HP_BETA1 | SHARDD_HP_BETA2 | SHARDD_HP_EPS | SHARDD_HP_AMSGRAD;
    o->beta1 = h->beta1;
    o->beta2 = h->beta2;
    o->eps = h->eps;
    o->amsgrad = h->amsgrad;
  }
  if (h->maximize) {
    o->set |= SHARDD_HP_MAXIMIZE;
    o->maximize = 1;
  }
}

typedef struct {
  const char *name;
  uint64_t off, numel;
  int64_t shape[2];
  int ndim;
  int group;
} view_spec;

static float init_param(size_t j) {
  float mag = 0.5f + (float)((j * 37) % 100) / 100.0f;
  return j % 2 ? mag : -mag;
}

static float step_grad(int r, int t, size_t j) {
  return (float)((int)((j * 31 + (size_t)r * 17 + (size_t)t * 7) % 64) - 32) / 256.0f;
}

/* The mean over 4 ranks, exact. */
static float mean_grad(int t, size_t j) {
  double s = 0;
  for (int r = 0; r < 4; r++)
    s += step_grad(r, t, j);
  return (float)(s / 4);
}

static void write_params(const shardd_buffer_info *b) {
  for (int r = 0; r < 4; r++)
    for (size_t i = 0; i < b[r].shard_numel; i++)
      ((float *)b[r].shard)[i] = init_param((size_t)r * b[r].shard_numel + i);
}

static void write_step_grads(const shardd_buffer_info *b, int t) {
  for (int r = 0; r < 4; r++)
    for (size_t j = 0; j < b[r].padded_numel; j++)
      ((float *)b[r].grad)[j] = step_grad(r, t, j);
}

static double rel_err(float got, float want) {
  return fabs((double)got - (double)want) / fmax(fabs((double)want), 1e-30);
}

/* Every rank's gather area against the reference; elements outside any view
 * must be bit-identical to their initial values. */
static void check_params(const shardd_buffer_info *b, const float *want, const char *what) {
  double worst = 0;
  size_t worst_j = 0;
  for (int r = 0; r < 4; r++)
    for (size_t j = 0; j < b[r].padded_numel; j++) {
      float got = f32_at(b[r].gather, j);
      cr_assert(isfinite(got), "%s: rank %d element %zu = %g", what, r, j, (double)got);
      double e = rel_err(got, want[j]);
      if (e > worst) {
        worst = e;
        worst_j = j;
      }
    }
  cr_assert_leq(worst, 1e-6, "%s: element %zu off by %.3g relative (got %.9g, want %.9g)",
                what, worst_j, worst, (double)f32_at(b[0].gather, worst_j),
                (double)want[worst_j]);
  /* shards agree with the gathered copy */
  size_t s = b[0].shard_numel;
  for (int r = 0; r < 4; r++)
    cr_assert_eq(memcmp(b[r].shard, (float *)b[0].gather + (size_t)r * s, s * 4), 0);
}

static int status_steps(const char *job, const char *opt, double *steps) {
  char args[256], *out;
  snprintf(args, sizeof args, "--socket %s status --json", d.sock);
  int rc = test_shardctl(NULL, args, &out, NULL);
  cr_assert_eq(rc, 0);
  tj *j = tj_parse(out);
  cr_assert_not_null(j, "%s", out);
  int found = 0;
  const tj *jobs = tj_need(j, "jobs", TJ_ARR);
  for (size_t i = 0; i < jobs->n; i++) {
    if (strcmp(tj_need(jobs->kids[i], "name", TJ_STR)->str, job))
      continue;
    const tj *opts = tj_need(jobs->kids[i], "optimizers", TJ_ARR);
    for (size_t k = 0; k < opts->n; k++)
      if (!strcmp(tj_need(opts->kids[k], "name", TJ_STR)->str, opt)) {
        *steps = tj_need(opts->kids[k], "steps", TJ_NUM)->num;
        found = 1;
      }
  }
  tj_free(j);
  free(out);
  return found;
}

Test(collective, steps_sgd_momentum_and_adamw_over_views, .init = start4, .fini = stop_daemon, .timeout = 60) {
  team t;
  team_open(&t, "train", 4);
  /* buffer S: 1030 fp32 -> shards of 258 (0, 258, 516, 774), 2 padding */
  shardd_buffer_info bs[MAXW], ba[MAXW];
  team_buffer(&t, "S", SHARDD_DTYPE_FP32, 1030, bs);
  /* buffer A: 999 fp32 -> shards of 250, 1 padding */
  team_buffer(&t, "A", SHARDD_DTYPE_FP32, 999, ba);
  const view_spec sv[] = {
      {"l1.weight", 0, 600, {20, 30}, 2, 0}, /* crosses shards 0|1|2 */
      {"l1.bias", 600, 20, {20, 0}, 1, 0},
      {"l2.weight", 700, 300, {10, 30}, 2, 1}, /* crosses 2|3 */
  };
  const view_spec av[] = {
      {"a.w", 0, 400, {20, 20}, 2, 0}, /* crosses 0|1 */
      {"a.b", 400, 10, {10, 0}, 1, 0},
      {"a.v", 500, 499, {499, 0}, 1, 1}, /* crosses 2|3, ends at numel */
  };
  uint64_t sid[3], aid[3];
  for (int i = 0; i < 3; i++) {
    team_view(&t, bs[0].id, sv[i].name, sv[i].off, sv[i].numel, sv[i].shape, sv[i].ndim, &sid[i]);
    team_view(&t, ba[0].id, av[i].name, av[i].off, av[i].numel, av[i].shape, av[i].ndim, &aid[i]);
  }
  ref_hp sgd0 = {SHARDD_OPTIM_SGD, 0.1, 0.9, 0.1, 0.01, 0, 0, 0, 0, 0, 0};
  ref_hp sgd1 = sgd0;
  sgd1.lr = 0.05;
  sgd1.nesterov = 1;
  sgd1.dampening = 0;
  ref_hp adw0 = {SHARDD_OPTIM_ADAMW, 0.01, 0, 0, 0.05, 0.9, 0.99, 1e-8, 0, 0, 0};
  ref_hp adw1 = adw0;
  adw1.lr = 0.02;
  adw1.wd = 0;
  adw1.amsgrad = 1;

  shardd_hparams top;
  hp_set(&top, &sgd0);
  shardd_param_ref sg0[] = {{sid[0], "l1.weight"}, {sid[1], "l1.bias"}};
  shardd_param_ref sg1[] = {{sid[2], "l2.weight"}};
  shardd_param_group sgroups[2] = {{sg0, 2, {0}}, {sg1, 1, {0}}};
  sgroups[1].overrides.set = SHARDD_HP_LR | SHARDD_HP_NESTEROV | SHARDD_HP_DAMPENING;
  sgroups[1].overrides.lr = sgd1.lr;
  sgroups[1].overrides.nesterov = 1;
  sgroups[1].overrides.dampening = 0;
  uint64_t osgd, oadw;
  team_optimizer(&t, "sgd", SHARDD_OPTIM_SGD, &top, sgroups, 2, &osgd);

  hp_set(&top, &adw0);
  shardd_param_ref ag0[] = {{aid[0], "a.w"}, {aid[1], "a.b"}};
  shardd_param_ref ag1[] = {{aid[2], "a.v"}};
  shardd_param_group agroups[2] = {{ag0, 2, {0}}, {ag1, 1, {0}}};
  agroups[1].overrides.set = SHARDD_HP_LR | SHARDD_HP_WEIGHT_DECAY | SHARDD_HP_AMSGRAD;
  agroups[1].overrides.lr = adw1.lr;
  agroups[1].overrides.weight_decay = 0;
  agroups[1].overrides.amsgrad = 1;
  team_optimizer(&t, "adamw", SHARDD_OPTIM_ADAMW, &top, agroups, 2, &oadw);

  /* reference state over the padded arrays; group -1 = not in a view */
  size_t ns = bs[0].padded_numel, na = ba[0].padded_numel;
  float *ps = calloc(ns, 4), *buf = calloc(ns, 4);
  float *pa = calloc(na, 4), *m = calloc(na, 4), *v = calloc(na, 4), *vmax = calloc(na, 4);
  int *gs = malloc(ns * sizeof(int)), *ga = malloc(na * sizeof(int));
  for (size_t j = 0; j < ns; j++) {
    ps[j] = init_param(j);
    gs[j] = -1;
  }
  for (size_t j = 0; j < na; j++) {
    pa[j] = init_param(j);
    ga[j] = -1;
  }
  for (int i = 0; i < 3; i++) {
    for (uint64_t j = sv[i].off; j < sv[i].off + sv[i].numel; j++)
      gs[j] = sv[i].group;
    for (uint64_t j = av[i].off; j < av[i].off + av[i].numel; j++)
      ga[j] = av[i].group;
  }
  write_params(bs);
  write_params(ba);

  for (int step = 1; step <= 3; step++) {
    write_step_grads(bs, step);
    write_step_grads(ba, step);
    team_all(&t, OP_SCATTER, bs[0].id, SHARDD_REDUCE_MEAN);
    team_all(&t, OP_SCATTER, ba[0].id, SHARDD_REDUCE_MEAN);
    shardd_step_result res[MAXW];
    team_all_res(&t, OP_STEP, osgd, 0, NULL, res);
    for (int r = 0; r < 4; r++)
      cr_assert_eq(res[r].step, (uint64_t)step, "rank %d: sgd step count %llu", r,
                   (unsigned long long)res[r].step);
    team_all_res(&t, OP_STEP, oadw, 0, NULL, res);
    for (int r = 0; r < 4; r++)
      cr_assert_eq(res[r].step, (uint64_t)step);
    for (size_t j = 0; j < ns; j++)
      if (gs[j] >= 0)
        ref_sgd(gs[j] ? &sgd1 : &sgd0, step, &ps[j], mean_grad(step, j), &buf[j]);
    for (size_t j = 0; j < na; j++)
      if (ga[j] >= 0)
        ref_adam(ga[j] ? &adw1 : &adw0, step, &pa[j], mean_grad(step, j), &m[j], &v[j],
                 &vmax[j]);
    team_all(&t, OP_GATHER, bs[0].id, 0);
    team_all(&t, OP_GATHER, ba[0].id, 0);
    char what[64];
    snprintf(what, sizeof what, "SGD after step %d", step);
    check_params(bs, ps, what);
    snprintf(what, sizeof what, "AdamW after step %d", step);
    check_params(ba, pa, what);
  }
  /* outside the views nothing moved, bit for bit */
  for (size_t j = 0; j < ns; j++)
    if (gs[j] < 0)
      cr_assert_eq(f32_bits(f32_at(bs[2].gather, j)), f32_bits(init_param(j)), "S[%zu]", j);
  for (size_t j = 0; j < na; j++)
    if (ga[j] < 0)
      cr_assert_eq(f32_bits(f32_at(ba[1].gather, j)), f32_bits(init_param(j)), "A[%zu]", j);

  double steps = -1;
  cr_assert(status_steps("train", "sgd", &steps), "optimizer sgd not in status");
  cr_assert_eq(steps, 3.0, "status says sgd did %g steps", steps);
  cr_assert(status_steps("train", "adamw", &steps), "optimizer adamw not in status");
  cr_assert_eq(steps, 3.0, "status says adamw did %g steps", steps);

  free(ps);
  free(buf);
  free(pa);
  free(m);
  free(v);
  free(vmax);
  free(gs);
  free(ga);
  team_close(&t);
}

Test(collective, step_max_norm_clips_and_reports_total_norm, .init = start4,
     .fini = stop_daemon, .timeout = 60) {
  team t;
  team_open(&t, "clip", 4);
  shardd_buffer_info b1[MAXW], b2[MAXW];
  team_buffer(&t, "C1", SHARDD_DTYPE_FP32, 1030, b1);
  team_buffer(&t, "C2", SHARDD_DTYPE_FP32, 203, b2); /* shards of 51, 1 padding */
  uint64_t v1, v2;
  int64_t sh1[1] = {300}, sh2[1] = {200};
  team_view(&t, b1[0].id, "w", 100, 300, sh1, 1, &v1); /* crosses 0|1 */
  team_view(&t, b1[0].id, "u", 700, 200, sh2, 1, &v2); /* crosses 2|3 */
  ref_hp h = {SHARDD_OPTIM_SGD, 0.5, 0, 0, 0, 0, 0, 0, 0, 0, 0};
  shardd_hparams top;
  hp_set(&top, &h);
  /* views of C1 and C2 whole (FSDP1 style): the norm spans both */
  shardd_param_ref refs[] = {{v1, "w"}, {v2, "u"}, {b2[0].id, "C2"}};
  shardd_param_group g = {refs, 3, {0}};
  uint64_t opt;
  team_optimizer(&t, "clipped", SHARDD_OPTIM_SGD, &top, &g, 1, &opt);
  write_params(b1);
  write_params(b2);
  float *p1 = malloc(b1[0].padded_numel * 4), *p2 = malloc(b2[0].padded_numel * 4);
  for (size_t j = 0; j < b1[0].padded_numel; j++)
    p1[j] = init_param(j);
  for (size_t j = 0; j < b2[0].padded_numel; j++)
    p2[j] = init_param(j);
  const double max_norms[] = {0.05, 1e9};
  for (int step = 1; step <= 2; step++) {
    /* gradients everywhere, padding and gaps included: only the
     * optimizer's elements may count */
    write_step_grads(b1, step);
    write_step_grads(b2, step);
    team_all(&t, OP_SCATTER, b1[0].id, SHARDD_REDUCE_MEAN);
    team_all(&t, OP_SCATTER, b2[0].id, SHARDD_REDUCE_MEAN);
    double sumsq = 0;
    for (size_t j = 100; j < 400; j++)
      sumsq += (double)mean_grad(step, j) * mean_grad(step, j);
    for (size_t j = 700; j < 900; j++)
      sumsq += (double)mean_grad(step, j) * mean_grad(step, j);
    for (size_t j = 0; j < 203; j++)
      sumsq += (double)mean_grad(step, j) * mean_grad(step, j);
    double want_norm = sqrt(sumsq);
    shardd_step_opts so = SHARDD_STEP_OPTS_INIT;
    so.max_norm = max_norms[step - 1];
    shardd_step_result res[MAXW];
    team_all_res(&t, OP_STEP, opt, 0, &so, res);
    for (int r = 0; r < 4; r++) {
      cr_assert_eq(res[r].step, (uint64_t)step);
      cr_assert_leq(fabs(res[r].total_norm - want_norm), 1e-6 * want_norm,
                    "rank %d: total_norm %.9g, want %.9g", r, res[r].total_norm, want_norm);
    }
    /* torch.nn.utils.clip_grad_norm_: coef = max_norm / (norm + 1e-6), clamped to 1 */
    double coef = so.max_norm / (want_norm + 1e-6);
    float c = (float)(coef < 1 ? coef : 1);
    if (step == 1)
      cr_assert_lt(coef, 0.5, "test must clip");
    for (size_t j = 0; j < b1[0].padded_numel; j++)
      if ((j >= 100 && j < 400) || (j >= 700 && j < 900))
        ref_sgd(&h, step, &p1[j], mean_grad(step, j) * c, NULL);
    for (size_t j = 0; j < 203; j++)
      ref_sgd(&h, step, &p2[j], mean_grad(step, j) * c, NULL);
    team_all(&t, OP_GATHER, b1[0].id, 0);
    team_all(&t, OP_GATHER, b2[0].id, 0);
    check_params(b1, p1, "clipped C1");
    check_params(b2, p2, "clipped C2");
  }
  /* without max_norm no norm is reported */
  shardd_step_result res[MAXW];
  team_all_res(&t, OP_STEP, opt, 0, NULL, res);
  for (int r = 0; r < 4; r++) {
    cr_assert_eq(res[r].step, 3);
    cr_assert_eq(res[r].total_norm, 0.0);
  }
  free(p1);
  free(p2);
  team_close(&t);
}

Test(collective, same_buffer_runs_in_submission_order, .init = start4, .fini = stop_daemon, .timeout = 60) {
  /* each rank pipelines scatter -> step -> gather on one buffer; the gather
   * must see the stepped values and the replies come in that order */
  team t;
  team_open(&t, "order", 4);
  shardd_buffer_info b[MAXW];
  team_buffer(&t, "P", SHARDD_DTYPE_FP32, 4099, b);
  ref_hp h = {SHARDD_OPTIM_SGD, 0.25, 0, 0, 0, 0, 0, 0, 0, 0, 0};
  shardd_hparams top;
  hp_set(&top, &h);
  shardd_param_ref refs[] = {{b[0].id, "P"}};
  shardd_param_group g = {refs, 1, {0}};
  uint64_t opt;
  team_optimizer(&t, "o", SHARDD_OPTIM_SGD, &top, &g, 1, &opt);
  team_close(&t); /* the raw clients take the ranks over */

  test_raw r[4];
  shardd_buffer_info rb[4];
  for (int k = 0; k < 4; k++) {
    /* until the daemon saw the old rank leave */
    for (double end = test_mono_s() + TEST_HANG_S;;) {
      test_raw_open(&d, &r[k]);
      uint64_t seq = test_raw_send_hello(&r[k], SHARDD_PROTOCOL_VERSION, "order", (uint32_t)k, 4);
      Shardwire__Response *resp = test_raw_recv(&r[k]);
      cr_assert_not_null(resp);
      cr_assert_eq(resp->seq, seq);
      int ok = resp->code == SHARDWIRE__STATUS_CODE__OK;
      shardwire__response__free_unpacked(resp, NULL);
      if (ok)
        break;
      test_raw_close(&r[k]);
      cr_assert_lt(test_mono_s(), end, "rank %d never freed after its holder closed", k);
      test_sleep_ms(10);
    }
    test_raw_register_buffer(&r[k], "P", SHARDD_DTYPE_FP32, 4099, &rb[k]);
  }
  write_params(rb);
  write_step_grads(rb, 1);
  uint64_t s1[4], s2[4], s3[4];
  for (int k = 0; k < 4; k++) {
    s1[k] = test_raw_send_scatter(&r[k], rb[0].id, SHARDD_REDUCE_MEAN);
    s2[k] = test_raw_send_step(&r[k], opt);
    s3[k] = test_raw_send_gather(&r[k], rb[0].id);
  }
  for (int k = 0; k < 4; k++) {
    shardwire__response__free_unpacked(test_raw_expect(&r[k], s1[k], SHARDD_OK), NULL);
    Shardwire__Response *resp = test_raw_expect(&r[k], s2[k], SHARDD_OK);
    cr_assert_eq(resp->body_case, SHARDWIRE__RESPONSE__BODY_STEP);
    cr_assert_eq(resp->step->step, 1);
    shardwire__response__free_unpacked(resp, NULL);
    shardwire__response__free_unpacked(test_raw_expect(&r[k], s3[k], SHARDD_OK), NULL);
  }
  float *want = malloc(rb[0].padded_numel * 4);
  for (size_t j = 0; j < rb[0].padded_numel; j++) {
    want[j] = init_param(j);
    if (j < 4099)
      ref_sgd(&h, 1, &want[j], mean_grad(1, j), NULL);
  }
  check_params(rb, want, "gather after a pipelined step");
  free(want);
  for (int k = 0; k < 4; k++)
    test_raw_close(&r[k]);
}

Test(collective, bf16_adam_keeps_an_fp32_master, .init = start4, .fini = stop_daemon, .timeout = 60) {
  team t;
  team_open(&t, "half", 4);
  shardd_buffer_info b[MAXW];
  team_buffer(&t, "H", SHARDD_DTYPE_BF16, 1001, b);
  ref_hp h = {SHARDD_OPTIM_ADAM, 1e-3, 0, 0, 0, 0.9, 0.999, 1e-8, 0, 0, 0};
  shardd_hparams top;
  hp_set(&top, &h);
  shardd_param_ref refs[] = {{b[0].id, "H"}};
  shardd_param_group g = {refs, 1, {0}};
  uint64_t opt;
  team_optimizer(&t, "adam16", SHARDD_OPTIM_ADAM, &top, &g, 1, &opt);
  size_t n = b[0].padded_numel, s = b[0].shard_numel;
  float *master = malloc(n * 4), *m = calloc(n, 4), *v = calloc(n, 4);
  for (int r = 0; r < 4; r++)
    for (size_t i = 0; i < s; i++)
      put_grid(SHARDD_DTYPE_BF16, b[r].shard, i, grad_hash(r, i, 77));
  for (size_t j = 0; j < n; j++)
    master[j] = (float)grid_value(grad_hash((int)(j / s), j % s, 77));
  for (int step = 1; step <= 5; step++) {
    for (int r = 0; r < 4; r++)
      for (size_t j = 0; j < n; j++)
        put_grid(SHARDD_DTYPE_BF16, b[r].grad, j, grad_hash(r, j, 100 + (uint32_t)step));
    team_all(&t, OP_SCATTER, b[0].id, SHARDD_REDUCE_SUM);
    team_all(&t, OP_STEP, opt, 0);
    for (size_t j = 0; j < 1001; j++)
      ref_adam(&h, step, &master[j], expected_reduced(4, j, 100 + (uint32_t)step, 0), &m[j],
               &v[j], NULL);
  }
  team_all(&t, OP_GATHER, b[0].id, 0);
  /* lr 1e-3 over 5 steps moves a value far less than a bf16 ulp sometimes:
   * only an fp32 master keeps those moves; the shard is the master rounded */
  for (size_t j = 0; j < n; j++) {
    uint16_t got;
    memcpy(&got, (char *)b[0].gather + 2 * j, 2);
    uint32_t u = (uint32_t)got << 16;
    float gf;
    memcpy(&gf, &u, 4);
    float want = j < 1001 ? master[j] : (float)grid_value(grad_hash((int)(j / s), j % s, 77));
    /* within one bf16 ulp of the reference master (rounding of a value
     * that itself may differ from ours in its last float bits) */
    double ulp = ldexp(1.0, ilogb(want) - 7);
    cr_assert_leq(fabs((double)gf - want), ulp, "H[%zu] = %.9g, reference master %.9g", j,
                  (double)gf, (double)want);
  }
  /* the master itself, read back (a state dict of a bf16 run needs it):
   * the reference's to float rounding, and the shard its bf16 rounding */
  float *got = malloc(1001 * 4);
  cr_assert_eq(shardd_optim_state_get(t.c[0], opt, b[0].id, SHARDD_OPTIM_MASTER, 0, 1001,
                                      got, NULL), SHARDD_OK, "%s", shardd_last_error(t.c[0]));
  for (size_t j = 0; j < 1001; j++) {
    cr_assert_leq(fabs((double)got[j] - master[j]), 1e-6 * fabs(master[j]) + 1e-12,
                  "master[%zu] = %.9g, reference %.9g", j, (double)got[j], (double)master[j]);
    uint16_t sh;
    memcpy(&sh, (char *)b[0].gather + 2 * j, 2);
    uint32_t u;
    memcpy(&u, &got[j], 4);
    cr_assert_eq(sh, (uint16_t)((u + 0x7fff + ((u >> 16) & 1)) >> 16), "shard[%zu]", j);
  }
  /* a written master (across the shards of ranks 0 and 1) rounds into the
   * shards too and is what is read back */
  float w[8] = {0.1f, -0.2f, 0.3f, 1.0f / 3, 7.77f, -1e-3f, 42.5f, 0.0f};
  size_t at = s - 4;
  cr_assert_eq(shardd_optim_state_set(t.c[1], opt, b[0].id, SHARDD_OPTIM_MASTER, at, 8, w),
               SHARDD_OK, "%s", shardd_last_error(t.c[1]));
  cr_assert_eq(shardd_optim_state_get(t.c[2], opt, b[0].id, SHARDD_OPTIM_MASTER, at, 8,
                                      got, NULL), SHARDD_OK);
  cr_assert_eq(memcmp(got, w, sizeof w), 0);
  for (int k = 0; k < 8; k++) {
    int r = (int)((at + k) / s);
    uint16_t sh;
    memcpy(&sh, (char *)b[r].shard + 2 * ((at + k) % s), 2);
    uint32_t u;
    memcpy(&u, &w[k], 4);
    cr_assert_eq(sh, (uint16_t)((u + 0x7fff + ((u >> 16) & 1)) >> 16), "shard at %zu",
                 at + k);
  }
  free(got);
  free(master);
  free(m);
  free(v);
  team_close(&t);
}

Test(collective, busy_while_in_flight_and_bad_targets, .init = start4, .fini = stop_daemon, .timeout = 60) {
  test_raw r;
  test_raw_open(&d, &r);
  test_raw_hello(&r, "busy", 0, 2);
  shardd_buffer_info b;
  test_raw_register_buffer(&r, "x", SHARDD_DTYPE_FP32, 10, &b);
  uint64_t g = test_raw_send_gather(&r, b.id);
  /* the waiting collective shows in status */
  {
    char args[256], *out;
    snprintf(args, sizeof args, "--socket %s status --json", d.sock);
    cr_assert_eq(test_shardctl(NULL, args, &out, NULL), 0);
    tj *j = tj_parse(out);
    cr_assert_not_null(j, "%s", out);
    const tj *jobs = tj_need(j, "jobs", TJ_ARR);
    cr_assert_eq(jobs->n, 1);
    cr_assert_eq(tj_need(jobs->kids[0], "collectives_in_flight", TJ_NUM)->num, 1.0, "%s", out);
    tj_free(j);
    free(out);
  }
  /* unregistering a buffer a collective waits on is refused */
  Shardwire__Request req = SHARDWIRE__REQUEST__INIT;
  Shardwire__UnregisterBuffer ub = SHARDWIRE__UNREGISTER_BUFFER__INIT;
  ub.id = b.id;
  req.body_case = SHARDWIRE__REQUEST__BODY_UNREGISTER_BUFFER;
  req.unregister_buffer = &ub;
  uint64_t u = test_raw_send(&r, &req);
  shardwire__response__free_unpacked(test_raw_expect(&r, u, SHARDD_E_BUSY), NULL);
  /* unknown ids answer at once, without waiting for rank 1 */
  uint64_t bad = test_raw_send_gather(&r, 999999);
  shardwire__response__free_unpacked(test_raw_expect(&r, bad, SHARDD_E_NOT_FOUND), NULL);
  bad = test_raw_send_step(&r, b.id); /* a buffer is not an optimizer */
  shardwire__response__free_unpacked(test_raw_expect(&r, bad, SHARDD_E_INVAL), NULL);
  /* rank 1 arrives: the gather completes */
  shardd_client_t *c1 = test_connect(&d, "busy", 1, 2);
  shardd_buffer_info b1;
  cr_assert_eq(shardd_buffer_register(c1, "x", SHARDD_DTYPE_FP32, 10, &b1), SHARDD_OK);
  cr_assert_eq(shardd_gather(c1, b1.id), SHARDD_OK, "%s", shardd_last_error(c1));
  shardwire__response__free_unpacked(test_raw_expect(&r, g, SHARDD_OK), NULL);
  shardd_close(c1);
  test_raw_close(&r);
}

Test(collective, step_lr_override_applies_to_every_group, .init = start4, .fini = stop_daemon,
     .timeout = 60) {
  team t;
  team_open(&t, "lr", 4);
  shardd_buffer_info b[MAXW];
  team_buffer(&t, "P", SHARDD_DTYPE_FP32, 777, b);
  uint64_t v0, v1;
  int64_t s0[1] = {300}, s1[1] = {400};
  team_view(&t, b[0].id, "p0", 0, 300, s0, 1, &v0);
  team_view(&t, b[0].id, "p1", 300, 400, s1, 1, &v1);
  ref_hp h = {SHARDD_OPTIM_SGD, 0.25, 0.5, 0, 0, 0, 0, 0, 0, 0, 0};
  shardd_hparams top;
  hp_set(&top, &h);
  shardd_param_ref r0[] = {{v0, "p0"}}, r1[] = {{v1, "p1"}};
  shardd_param_group g[2] = {{r0, 1, {0}}, {r1, 1, {0}}};
  g[1].overrides.set = SHARDD_HP_LR;
  g[1].overrides.lr = 0.125;
  uint64_t opt;
  team_optimizer(&t, "o", SHARDD_OPTIM_SGD, &top, g, 2, &opt);
  write_params(b);
  float *want = malloc(b[0].padded_numel * 4), *buf = calloc(b[0].padded_numel, 4);
  for (size_t j = 0; j < b[0].padded_numel; j++)
    want[j] = init_param(j);
  for (int step = 1; step <= 2; step++) {
    write_step_grads(b, step);
    team_all(&t, OP_SCATTER, b[0].id, SHARDD_REDUCE_MEAN);
    shardd_step_opts so = SHARDD_STEP_OPTS_INIT;
    if (step == 2)
      so.lr = 0.75; /* this step only, every group */
    team_all_res(&t, OP_STEP, opt, 0, &so, NULL);
    ref_hp h0 = h, h1 = h;
    h1.lr = 0.125;
    if (step == 2)
      h0.lr = h1.lr = 0.75;
    for (size_t j = 0; j < 700; j++)
      ref_sgd(j < 300 ? &h0 : &h1, step, &want[j], mean_grad(step, j), &buf[j]);
  }
  team_all(&t, OP_GATHER, b[0].id, 0);
  check_params(b, want, "SGD with an lr override");
  free(want);
  free(buf);
  team_close(&t);
}

/* ---- a step a trainer can retry -------------------------------------------
 * Step.expect_step: a retry of a step that ran (its reply lost) is answered
 * at once on each rank alone, skipped, with the count now, and changes no
 * byte; a count the optimizer is more than one step short of is refused;
 * the next step, sent with its count, runs; in the end the parameters are
 * two SGD steps' worth, not three. */
Test(collective, step_with_expect_step_runs_once, .init = start4, .fini = stop_daemon,
     .timeout = 60) {
  team t;
  team_open(&t, "once", 4);
  shardd_buffer_info b[MAXW];
  team_buffer(&t, "P", SHARDD_DTYPE_FP32, 777, b);
  uint64_t v0;
  int64_t s0[1] = {700};
  team_view(&t, b[0].id, "p0", 0, 700, s0, 1, &v0);
  ref_hp h = {SHARDD_OPTIM_SGD, 0.25, 0.5, 0, 0, 0, 0, 0, 0, 0, 0};
  shardd_hparams top;
  hp_set(&top, &h);
  shardd_param_ref r0[] = {{v0, "p0"}};
  shardd_param_group g[1] = {{r0, 1, {0}}};
  uint64_t opt;
  team_optimizer(&t, "o", SHARDD_OPTIM_SGD, &top, g, 1, &opt);
  write_params(b);
  float *want = malloc(b[0].padded_numel * 4), *buf = calloc(b[0].padded_numel, 4);
  for (size_t j = 0; j < b[0].padded_numel; j++)
    want[j] = init_param(j);
  size_t sb = b[0].shard_numel * 4;
  unsigned char *sv[MAXW];
  for (int step = 1; step <= 2; step++) {
    write_step_grads(b, step);
    team_all(&t, OP_SCATTER, b[0].id, SHARDD_REDUCE_MEAN);
    call calls[MAXW];
    int skipped[MAXW];
    memset(calls, 0, sizeof calls);
    for (int r = 0; r < 4; r++) {
      shardd_step_opts so = SHARDD_STEP_OPTS_INIT;
      so.expect_step = (uint64_t)step;
      skipped[r] = -1;
      so.skipped = &skipped[r];
      calls[r] = (call){.c = t.c[r], .kind = OP_STEP, .id = opt, .so = so};
    }
    run_calls(calls, 4);
    for (int r = 0; r < 4; r++) {
      cr_assert_eq(calls[r].rc, SHARDD_OK, "rank %d step %d: %s", r, step, calls[r].msg);
      cr_assert_eq(skipped[r], 0, "rank %d: step %d was not run", r, step);
      cr_assert_eq(calls[r].res.step, (uint64_t)step);
    }
    for (size_t j = 0; j < 700; j++)
      ref_sgd(&h, step, &want[j], mean_grad(step, j), &buf[j]);
    if (step == 2)
      break;
    /* every rank retries step 1, one after the other: none waits for the
     * others (no collective runs) and no byte changes */
    for (int r = 0; r < 4; r++) {
      sv[r] = malloc(sb);
      memcpy(sv[r], b[r].shard, sb);
    }
    for (int r = 0; r < 4; r++) {
      shardd_step_opts so = SHARDD_STEP_OPTS_INIT;
      shardd_step_result res;
      int sk = -1;
      so.expect_step = 1;
      so.skipped = &sk;
      cr_assert_eq(shardd_step(t.c[r], opt, &so, &res), SHARDD_OK, "rank %d: %s", r,
                   shardd_last_error(t.c[r]));
      cr_assert_eq(sk, 1, "rank %d's retry of step 1 ran", r);
      cr_assert_eq(res.step, 1);
    }
    for (int r = 0; r < 4; r++) {
      cr_assert_eq(memcmp(sv[r], b[r].shard, sb), 0, "rank %d's shard changed", r);
      free(sv[r]);
    }
    /* a trainer two steps ahead of the daemon is told, nothing runs */
    shardd_step_opts so = SHARDD_STEP_OPTS_INIT;
    so.expect_step = 3;
    cr_assert_eq(shardd_step(t.c[0], opt, &so, NULL), SHARDD_E_MISMATCH);
    cr_assert_not_null(strstr(shardd_last_error(t.c[0]), "is at step 1"), "%s",
                       shardd_last_error(t.c[0]));
    double steps = -1;
    cr_assert(status_steps("once", "o", &steps));
    cr_assert_eq(steps, 1.0);
  }
  team_all(&t, OP_GATHER, b[0].id, 0);
  check_params(b, want, "SGD, step 1 retried");
  double steps = -1;
  cr_assert(status_steps("once", "o", &steps));
  cr_assert_eq(steps, 2.0);
  free(want);
  free(buf);
  team_close(&t);
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

/* ---- a rank killed between collectives (--peer-grace) ------------------- */

#define PEER_NUMEL 1001

static void start_grace1(void) {
  const char *args[] = {"--devices", "4", "--peer-grace", "1", NULL};
  test_daemon_start(&d, args);
}

static void start_grace3(void) {
  const char *args[] = {"--devices", "4", "--peer-grace", "3", NULL};
  test_daemon_start(&d, args);
}

/* Rank 1 of job "between" (world 2) in a process of its own: it registers
 * "p", writes 'r', gathers once with rank 0 when gather_once, writes 'g',
 * then waits to be killed. A relaunch (gather_once 0) connects as soon as
 * the daemon has let the dead one's rank go, attaches, writes 'r', and on
 * 'g' from go gathers and checks the bytes: exit 0 when all held. */
static void child_rank1(const char *sock, int ready, int go, int first) {
  shardd_connect_opts o = SHARDD_CONNECT_OPTS_INIT;
  o.job = "between";
  o.rank = 1;
  o.world = 2;
  shardd_client_t *c = NULL;
  char err[256], ch = 0;
  for (double end = test_mono_s() + TEST_HANG_S;;) {
    if (shardd_connect(sock, &o, &c, err, sizeof err) == SHARDD_OK)
      break;
    if (test_mono_s() > end)
      _exit(10);
    test_sleep_ms(5);
  }
  shardd_buffer_info b;
  if (shardd_buffer_register(c, "p", SHARDD_DTYPE_FP32, PEER_NUMEL, &b) != SHARDD_OK)
    _exit(11);
  if (b.created != first)
    _exit(12);
  for (size_t i = 0; i < b.shard_numel; i++)
    ((float *)b.shard)[i] = (float)(1000000 + i);
  if (write(ready, "r", 1) != 1)
    _exit(13);
  if (first) {
    if (shardd_gather(c, b.id) != SHARDD_OK)
      _exit(14);
    if (write(ready, "g", 1) != 1)
      _exit(15);
    for (;;)
      pause(); /* SIGKILL: gone between collectives */
  }
  if (read(go, &ch, 1) != 1)
    _exit(16);
  if (shardd_gather(c, b.id) != SHARDD_OK)
    _exit(17);
  for (size_t j = 0; j < b.padded_numel; j++) {
    size_t s = b.shard_numel;
    float want = j < s ? (float)j : (float)(1000000 + (j - s));
    if (f32_at(b.gather, j) != want)
      _exit(18);
  }
  _exit(0);
}

static pid_t spawn_rank1(int ready[2], int go[2], int first) {
  cr_assert_eq(pipe(ready), 0);
  cr_assert_eq(pipe(go), 0);
  pid_t pid = fork();
  cr_assert(pid >= 0);
  if (pid == 0) {
    close(ready[0]);
    close(go[1]);
    child_rank1(d.sock, ready[1], go[0], first);
  }
  close(ready[1]);
  close(go[0]);
  return pid;
}

static void close_pipes(int ready[2], int go[2]) {
  close(ready[0]);
  close(go[1]);
}

/* Rank 0 as a raw client (so it can see a reply come or not), its shard
 * 0, 1, 2, ...; and a first gather with the first rank 1. */
static void rank0_and_a_live_rank1(test_raw *r0, shardd_buffer_info *b0,
                                   int ready[2], int go[2], pid_t *child) {
  *child = spawn_rank1(ready, go, 1);
  char ch;
  cr_assert_eq(read(ready[0], &ch, 1), 1, "rank 1 did not get ready");
  test_raw_open(&d, r0);
  test_raw_hello(r0, "between", 0, 2);
  test_raw_register_buffer(r0, "p", SHARDD_DTYPE_FP32, PEER_NUMEL, b0);
  for (size_t i = 0; i < b0->shard_numel; i++)
    ((float *)b0->shard)[i] = (float)i;
  uint64_t seq = test_raw_send_gather(r0, b0->id);
  shardwire__response__free_unpacked(test_raw_expect(r0, seq, SHARDD_OK), NULL);
  cr_assert_eq(read(ready[0], &ch, 1), 1, "rank 1's gather failed");
}

static void kill_rank(pid_t child) {
  cr_assert_eq(kill(child, SIGKILL), 0);
  int st;
  cr_assert_eq(waitpid(child, &st, 0), child);
}

/* Killed between collectives, under the default --collective-timeout of
 * 300 s: rank 0's next gather fails E_PEER_LOST naming rank 1 once the 1 s
 * grace is over (not before, and within 2 s past it), the one after that
 * at once, and the loss is logged. A relaunched rank 1, back long after
 * the grace, trains on with rank 0. */
Test(collective, rank_killed_between_collectives_fails_the_next_fast,
     .init = start_grace1, .fini = stop_daemon, .timeout = 60) {
  int ready[2], go[2];
  pid_t child;
  test_raw r0;
  shardd_buffer_info b0;
  rank0_and_a_live_rank1(&r0, &b0, ready, go, &child);
  kill_rank(child);
  double t0 = test_mono_s();
  close_pipes(ready, go);
  uint64_t seq = test_raw_send_gather(&r0, b0.id);
  Shardwire__Response *resp = test_raw_expect(&r0, seq, SHARDD_E_PEER_LOST);
  double took = test_mono_s() - t0;
  cr_log_info("pending gather failed %.3f s after the kill (grace 1 s)", took);
  cr_assert_not_null(strstr(resp->message, "rank 1 of job \"between\" disconnected"),
                     "%s", resp->message);
  cr_assert_not_null(strstr(resp->message, "--peer-grace"), "%s", resp->message);
  shardwire__response__free_unpacked(resp, NULL);
  cr_assert_geq(took, 0.9, "failed %.3f s after the kill, inside the 1 s grace", took);
  cr_assert_lt(took, 1.0 + 2.0, "failed %.3f s after the kill (grace 1 s)", took);
  /* past the grace the next one fails at once */
  t0 = test_mono_s();
  seq = test_raw_send_gather(&r0, b0.id);
  shardwire__response__free_unpacked(test_raw_expect(&r0, seq, SHARDD_E_PEER_LOST), NULL);
  took = test_mono_s() - t0;
  cr_log_info("next gather failed after %.3f s", took);
  cr_assert_lt(took, 2.0, "the next collective failed after %.3f s", took);
  cr_assert(test_daemon_log_has(&d, "peer lost"), "the loss is not in the log");
  /* a relaunched rank 1 rejoins: the job trains again */
  child = spawn_rank1(ready, go, 0);
  char ch;
  cr_assert_eq(read(ready[0], &ch, 1), 1, "the relaunched rank 1 did not get ready");
  seq = test_raw_send_gather(&r0, b0.id);
  cr_assert_eq(write(go[1], "g", 1), 1);
  shardwire__response__free_unpacked(test_raw_expect(&r0, seq, SHARDD_OK), NULL);
  for (size_t j = 0; j < b0.padded_numel; j++) {
    size_t s = b0.shard_numel;
    cr_assert_eq(f32_at(b0.gather, j), j < s ? (float)j : (float)(1000000 + (j - s)));
  }
  int st;
  cr_assert_eq(waitpid(child, &st, 0), child);
  cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == 0, "relaunched rank 1 exited %d",
            WIFEXITED(st) ? WEXITSTATUS(st) : -1);
  close_pipes(ready, go);
  test_raw_close(&r0);
}

/* Killed, then relaunched within the 3 s grace: rank 0's gather, waiting
 * meanwhile, is not failed even once the grace is over, and completes with
 * both ranks' bytes when the new rank 1 gathers. While it waits, status
 * shows rank 1 missing and the gather's arrivals. */
Test(collective, rank_back_within_the_grace_fails_nobody, .init = start_grace3,
     .fini = stop_daemon, .timeout = 60) {
  int ready[2], go[2];
  pid_t child;
  test_raw r0;
  shardd_buffer_info b0;
  rank0_and_a_live_rank1(&r0, &b0, ready, go, &child);
  kill_rank(child);
  double t0 = test_mono_s();
  close_pipes(ready, go);
  uint64_t seq = test_raw_send_gather(&r0, b0.id);
  Shardwire__Response *early;
  test_raw_sync_keep(&r0, &early);
  cr_assert_null(early, "the gather was answered inside the grace");

  /* status: who is missing, what the gather waits on (the close came on
   * another socket than the gather, so it may be read a little later) */
  shardd_client_t *ctl = test_connect(&d, NULL, 0, 1);
  tj *j = NULL;
  const tj *job = NULL;
  for (double end = test_mono_s() + 2.0;;) {
    char *js;
    cr_assert_eq(shardd_status_json(ctl, &js), SHARDD_OK);
    tj_free(j);
    j = tj_parse(js);
    shardd_free(js);
    cr_assert_not_null(j);
    job = tj_need(j, "jobs", TJ_ARR)->kids[0];
    if (tj_need(job, "missing_ranks", TJ_ARR)->n == 1)
      break;
    cr_assert_lt(test_mono_s(), end, "status never showed rank 1 missing");
    test_sleep_ms(10);
  }
  const tj *conn = tj_need(job, "connected_ranks", TJ_ARR);
  cr_assert_eq(conn->n, 1);
  cr_assert_eq(conn->kids[0]->num, 0.0);
  cr_assert_eq(tj_need(job, "missing_ranks", TJ_ARR)->kids[0]->num, 1.0);
  double gone = tj_need(job, "missing_for_s", TJ_ARR)->kids[0]->num;
  cr_assert(gone >= 0 && gone < 3.0, "rank 1 gone for %.3f s", gone);
  const tj *colls = tj_need(job, "collectives", TJ_ARR);
  cr_assert_eq(colls->n, 1);
  const tj *c0 = colls->kids[0];
  cr_assert_str_eq(tj_need(c0, "kind", TJ_STR)->str, "gather");
  cr_assert_eq(tj_need(c0, "target", TJ_NUM)->num, (double)b0.id);
  cr_assert_str_eq(tj_need(c0, "name", TJ_STR)->str, "p");
  cr_assert_eq(tj_need(c0, "running", TJ_BOOL)->boolean, 0);
  const tj *arr = tj_need(c0, "arrived", TJ_ARR), *wf = tj_need(c0, "waiting_for", TJ_ARR);
  cr_assert_eq(arr->n, 1);
  cr_assert_eq(arr->kids[0]->num, 0.0);
  cr_assert_eq(wf->n, 1);
  cr_assert_eq(wf->kids[0]->num, 1.0);
  tj_free(j);
  char *text;
  cr_assert_eq(shardd_status_text(ctl, &text), SHARDD_OK);
  cr_assert_not_null(strstr(text, "ranks connected: 0 missing: 1"), "%s", text);
  cr_assert_not_null(strstr(text, "rank 1: disconnected"), "%s", text);
  cr_assert_not_null(strstr(text, "collective gather buffer"), "%s", text);
  cr_assert_not_null(strstr(text, "arrived 0, waiting for 1"), "%s", text);
  shardd_free(text);

  /* the relaunch, inside the grace */
  child = spawn_rank1(ready, go, 0);
  char ch;
  cr_assert_eq(read(ready[0], &ch, 1), 1, "the relaunched rank 1 did not get ready");
  double back = test_mono_s() - t0;
  cr_log_info("rank 1 back %.3f s after the kill (grace 3 s)", back);
  cr_assert_lt(back, 3.0, "the relaunch took %.3f s, past the grace", back);
  /* past the grace: nothing failed, rank 1 shows connected again */
  while (test_mono_s() < t0 + 4.0)
    test_sleep_ms(50);
  char *js;
  cr_assert_eq(shardd_status_json(ctl, &js), SHARDD_OK);
  j = tj_parse(js);
  shardd_free(js);
  job = tj_need(j, "jobs", TJ_ARR)->kids[0];
  cr_assert_eq(tj_need(job, "connected_ranks", TJ_ARR)->n, 2);
  cr_assert_eq(tj_need(job, "missing_ranks", TJ_ARR)->n, 0);
  cr_assert_eq(tj_need(job, "collectives", TJ_ARR)->n, 1, "the gather still waits");
  tj_free(j);
  shardd_close(ctl);
  cr_assert_eq(write(go[1], "g", 1), 1);
  shardwire__response__free_unpacked(test_raw_expect(&r0, seq, SHARDD_OK), NULL);
  for (size_t k = 0; k < b0.padded_numel; k++) {
    size_t s = b0.shard_numel;
    cr_assert_eq(f32_at(b0.gather, k), k < s ? (float)k : (float)(1000000 + (k - s)));
  }
  int st;
  cr_assert_eq(waitpid(child, &st, 0), child);
  cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == 0, "relaunched rank 1 exited %d",
            WIFEXITED(st) ? WEXITSTATUS(st) : -1);
  close_pipes(ready, go);
  test_raw_close(&r0);
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

/* ---- a trainer SIGKILLed mid-gather, mid-scatter, mid-step (issue 21) ----
 * Job "killed", world 3: ranks 0 and 1 are raw clients of this process,
 * rank 2 a process of its own, SIGKILLed mid-collective in one of two
 * orders, both arranged without timing:
 *  - victim_waits: rank 2 sends the collective and blocks in it; the
 *    daemon's status shows it in flight; SIGKILL; then ranks 0 and 1
 *    send theirs.
 *  - others_wait: ranks 0 and 1 send theirs and are known queued (the
 *    Pong after them); rank 2, connected and idle, is SIGKILLed.
 * Ranks 0 and 1 get E_PEER_LOST naming rank 2; no byte of any rank's
 * shard, reduced or gather area and no optimizer state or step count
 * changes; another job is served meanwhile; a relaunched rank 2 finds its
 * shard intact and the job runs the collective with it. */

#define KILL_NUMEL 3001

typedef struct {
  int kind;
  int victim_waits;
} kill_case;

static int job_inflight(const char *job) {
  shardd_client_t *ctl = test_connect(&d, NULL, 0, 1);
  char *js;
  cr_assert_eq(shardd_status_json(ctl, &js), SHARDD_OK);
  tj *j = tj_parse(js);
  cr_assert_not_null(j);
  int n = -1;
  const tj *jobs = tj_need(j, "jobs", TJ_ARR);
  for (size_t i = 0; i < jobs->n; i++)
    if (!strcmp(tj_need(jobs->kids[i], "name", TJ_STR)->str, job))
      n = (int)tj_need(jobs->kids[i], "collectives_in_flight", TJ_NUM)->num;
  tj_free(j);
  shardd_free(js);
  shardd_close(ctl);
  return n;
}

static shardd_client_t *connect_rank(const char *job, uint32_t rank, uint32_t world) {
  for (double end = test_mono_s() + TEST_HANG_S;;) {
    shardd_connect_opts o = SHARDD_CONNECT_OPTS_INIT;
    o.job = job;
    o.rank = rank;
    o.world = world;
    shardd_client_t *c;
    char err[256];
    if (shardd_connect(d.sock, &o, &c, err, sizeof err) == SHARDD_OK)
      return c;
    cr_assert_lt(test_mono_s(), end, "rank %u of %s cannot connect: %s", rank, job, err);
    test_sleep_ms(10);
  }
}

/* rank 2: attach, say 'r'; on 'g' run the collective (blocks: the others
 * have not sent theirs); killed before it returns */
static void victim(int ready, int go, int kind, uint64_t opt) {
  shardd_client_t *c = connect_rank("killed", 2, 3);
  shardd_buffer_info b;
  if (shardd_buffer_register(c, "P", SHARDD_DTYPE_FP32, KILL_NUMEL, &b) != SHARDD_OK)
    _exit(11);
  char ch;
  if (write(ready, "r", 1) != 1 || read(go, &ch, 1) != 1)
    _exit(12);
  shardd_err rc = kind == OP_GATHER    ? shardd_gather(c, b.id)
                  : kind == OP_SCATTER ? shardd_scatter(c, b.id, SHARDD_REDUCE_MEAN)
                                       : shardd_step(c, opt, NULL, NULL);
  _exit(rc == SHARDD_OK ? 13 : 14); /* it must not come back: killed inside */
}

static uint64_t kill_send(test_raw *r, int kind, uint64_t buf, uint64_t opt) {
  return kind == OP_GATHER    ? test_raw_send_gather(r, buf)
         : kind == OP_SCATTER ? test_raw_send_scatter(r, buf, SHARDD_REDUCE_MEAN)
                              : test_raw_send_step(r, opt);
}

ParameterizedTestParameters(collective, rank_sigkilled_mid_collective) {
  static kill_case cases[] = {{OP_GATHER, 1}, {OP_SCATTER, 1}, {OP_STEP, 1},
                              {OP_GATHER, 0}, {OP_SCATTER, 0}, {OP_STEP, 0}};
  return cr_make_param_array(kill_case, cases, sizeof cases / sizeof cases[0]);
}

ParameterizedTest(kill_case *kc, collective, rank_sigkilled_mid_collective,
                  .init = start_grace1, .fini = stop_daemon, .timeout = 60) {
  const char *what = kc->kind == OP_GATHER ? "gather" : kc->kind == OP_SCATTER ? "scatter" : "step";
  /* a trained job: one scatter, SGD-momentum step and gather by all three */
  team t;
  team_open(&t, "killed", 3);
  shardd_buffer_info tb[MAXW];
  team_buffer(&t, "P", SHARDD_DTYPE_FP32, KILL_NUMEL, tb);
  ref_hp h = {SHARDD_OPTIM_SGD, 0.25, 0.5, 0, 0, 0, 0, 0, 0, 0, 0};
  shardd_hparams top;
  hp_set(&top, &h);
  shardd_param_ref refs[] = {{tb[0].id, "P"}};
  shardd_param_group g = {refs, 1, {0}};
  uint64_t opt, buf = tb[0].id;
  team_optimizer(&t, "o", SHARDD_OPTIM_SGD, &top, &g, 1, &opt);
  for (int r = 0; r < 3; r++)
    for (size_t i = 0; i < tb[r].shard_numel; i++)
      ((float *)tb[r].shard)[i] = init_param((size_t)r * tb[r].shard_numel + i);
  for (int r = 0; r < 3; r++)
    for (size_t j = 0; j < tb[r].padded_numel; j++)
      ((float *)tb[r].grad)[j] = (float)grid_value(grad_hash(r, j, 1));
  team_all(&t, OP_SCATTER, buf, SHARDD_REDUCE_MEAN);
  team_all(&t, OP_STEP, opt, 0);
  team_all(&t, OP_GATHER, buf, 0);
  float *mom0 = malloc(KILL_NUMEL * 4), *mom1 = malloc(KILL_NUMEL * 4);
  cr_assert_eq(shardd_optim_state_get(t.c[0], opt, buf, 0, 0, KILL_NUMEL, mom0, NULL),
               SHARDD_OK, "%s", shardd_last_error(t.c[0]));
  team_close(&t);

  int ready[2], go[2];
  cr_assert_eq(pipe(ready), 0);
  cr_assert_eq(pipe(go), 0);
  pid_t child = fork();
  cr_assert(child >= 0);
  if (child == 0) {
    close(ready[0]);
    close(go[1]);
    victim(ready[1], go[0], kc->kind, opt);
  }
  close(ready[1]);
  close(go[0]);
  test_raw r[2];
  shardd_buffer_info b[2];
  for (int k = 0; k < 2; k++) {
    for (double end = test_mono_s() + TEST_HANG_S;;) { /* until the team's rank left */
      test_raw_open(&d, &r[k]);
      uint64_t seq = test_raw_send_hello(&r[k], SHARDD_PROTOCOL_VERSION, "killed", (uint32_t)k, 3);
      Shardwire__Response *resp = test_raw_recv(&r[k]);
      cr_assert_not_null(resp);
      cr_assert_eq(resp->seq, seq);
      int ok = resp->code == SHARDWIRE__STATUS_CODE__OK;
      shardwire__response__free_unpacked(resp, NULL);
      if (ok)
        break;
      test_raw_close(&r[k]);
      cr_assert_lt(test_mono_s(), end, "rank %d never freed", k);
      test_sleep_ms(10);
    }
    test_raw_register_buffer(&r[k], "P", SHARDD_DTYPE_FP32, KILL_NUMEL, &b[k]);
  }
  char ch;
  cr_assert_eq(read(ready[0], &ch, 1), 1, "rank 2 did not get ready");
  /* new gradients, so a scatter or step that ran would change something */
  for (int k = 0; k < 2; k++)
    for (size_t j = 0; j < b[k].padded_numel; j++)
      ((float *)b[k].grad)[j] = (float)grid_value(grad_hash(k, j, 2));
  size_t sb = b[0].shard_numel * 4, gb = b[0].padded_numel * 4;
  unsigned char *sv[2][3];
  for (int k = 0; k < 2; k++) {
    sv[k][0] = malloc(sb);
    sv[k][1] = malloc(sb);
    sv[k][2] = malloc(gb);
    memcpy(sv[k][0], b[k].shard, sb);
    memcpy(sv[k][1], b[k].reduced, sb);
    memcpy(sv[k][2], b[k].gather, gb);
  }
  double steps0 = -1;
  cr_assert(status_steps("killed", "o", &steps0));
  cr_assert_eq(steps0, 1.0);

  uint64_t seq[2];
  if (kc->victim_waits) {
    cr_assert_eq(write(go[1], "g", 1), 1);
    for (double end = test_mono_s() + TEST_HANG_S; job_inflight("killed") < 1;) {
      cr_assert_lt(test_mono_s(), end, "rank 2's %s never reached the daemon", what);
      test_sleep_ms(5);
    }
    cr_assert_eq(kill(child, SIGKILL), 0); /* inside its call, waiting for 0 and 1 */
    int st;
    cr_assert_eq(waitpid(child, &st, 0), child);
    cr_assert(WIFSIGNALED(st) && WTERMSIG(st) == SIGKILL, "rank 2 returned from its %s", what);
    for (int k = 0; k < 2; k++)
      seq[k] = kill_send(&r[k], kc->kind, buf, opt);
  } else {
    for (int k = 0; k < 2; k++) {
      seq[k] = kill_send(&r[k], kc->kind, buf, opt);
      test_raw_sync(&r[k]); /* queued: the Pong comes after */
    }
    cr_assert_eq(job_inflight("killed"), 1);
    cr_assert_eq(kill(child, SIGKILL), 0);
    int st;
    cr_assert_eq(waitpid(child, &st, 0), child);
    cr_assert(WIFSIGNALED(st), "rank 2 exited on its own");
  }
  close(ready[0]);
  close(go[1]);
  for (int k = 0; k < 2; k++) {
    Shardwire__Response *resp = test_raw_expect(&r[k], seq[k], SHARDD_E_PEER_LOST);
    cr_log_info("%s, %s: rank %d: %s", what, kc->victim_waits ? "victim waited" : "others waited",
                k, resp->message);
    cr_assert_not_null(strstr(resp->message, "rank 2"), "rank %d: \"%s\" does not name rank 2",
                       k, resp->message);
    shardwire__response__free_unpacked(resp, NULL);
  }
  for (int k = 0; k < 2; k++) {
    cr_assert_eq(memcmp(sv[k][0], b[k].shard, sb), 0, "%s: rank %d's shard changed", what, k);
    cr_assert_eq(memcmp(sv[k][1], b[k].reduced, sb), 0, "%s: rank %d's reduced changed", what, k);
    cr_assert_eq(memcmp(sv[k][2], b[k].gather, gb), 0, "%s: rank %d's gather changed", what, k);
  }
  double steps = -1;
  cr_assert(status_steps("killed", "o", &steps));
  cr_assert_eq(steps, 1.0, "%s: the step count moved", what);

  /* another job is served meanwhile */
  shardd_client_t *other = test_connect(&d, "bystander", 0, 1);
  shardd_buffer_info ob;
  cr_assert_eq(shardd_buffer_register(other, "q", SHARDD_DTYPE_FP32, 100, &ob), SHARDD_OK);
  ((float *)ob.shard)[7] = 7.0f;
  cr_assert_eq(shardd_gather(other, ob.id), SHARDD_OK, "%s", shardd_last_error(other));
  cr_assert_eq(((float *)ob.gather)[7], 7.0f);
  shardd_close(other);

  /* rank 2 relaunched: its shard and the optimizer state are as they were */
  shardd_client_t *c2 = connect_rank("killed", 2, 3);
  shardd_buffer_info b2;
  cr_assert_eq(shardd_buffer_register(c2, "P", SHARDD_DTYPE_FP32, KILL_NUMEL, &b2), SHARDD_OK);
  cr_assert(!b2.created);
  cr_assert_eq(memcmp(b2.shard, (const float *)b[0].gather + 2 * b[0].shard_numel, sb), 0,
               "%s: rank 2's shard changed", what);
  cr_assert_eq(shardd_optim_state_get(c2, opt, buf, 0, 0, KILL_NUMEL, mom1, NULL), SHARDD_OK,
               "%s", shardd_last_error(c2));
  cr_assert_eq(memcmp(mom0, mom1, KILL_NUMEL * 4), 0, "%s: the momentum changed", what);
  /* and the job runs the collective with it */
  for (int k = 0; k < 2; k++)
    seq[k] = kill_send(&r[k], kc->kind, buf, opt);
  shardd_err rc = kc->kind == OP_GATHER    ? shardd_gather(c2, b2.id)
                  : kc->kind == OP_SCATTER ? shardd_scatter(c2, b2.id, SHARDD_REDUCE_MEAN)
                                           : shardd_step(c2, opt, NULL, NULL);
  cr_assert_eq(rc, SHARDD_OK, "%s with the relaunched rank 2: %s", what, shardd_last_error(c2));
  for (int k = 0; k < 2; k++)
    shardwire__response__free_unpacked(test_raw_expect(&r[k], seq[k], SHARDD_OK), NULL);
  cr_assert(status_steps("killed", "o", &steps));
  cr_assert_eq(steps, kc->kind == OP_STEP ? 2.0 : 1.0);
  for (int k = 0; k < 2; k++)
    for (int a = 0; a < 3; a++)
      free(sv[k][a]);
  free(mom0);
  free(mom1);
  shardd_close(c2);
  for (int k = 0; k < 2; k++)
    test_raw_close(&r[k]);
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
