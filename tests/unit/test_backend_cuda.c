/* test_backend_cuda.c — the cuda backend against the host backend, the
 * reference: every kernel (reduce fp32/bf16/fp16, sum of squares, SGD /
 * Adam / AdamW updates with fp32 params and with an fp32 master for bf16 /
 * fp16 params, widen) and copy run on both backends over the same random
 * data (never zeros), outputs poisoned with 0xff (NaN) first, and the whole
 * region — outputs and the poisoned gaps around them — must come back
 * bit-identical (sum of squares: to double rounding, its summation order
 * differs).
 *
 * The whole-collective ops (NCCL allgather / reduce_scatter, one rank per
 * GPU over every GPU present, up to 8) run against the host backend doing
 * the same collective rank by rank with copy / reduce: allgather must be
 * bit-identical; reduce_scatter bit-identical with one rank and, with
 * several, equal outside the outputs and within fp32 reordering inside
 * (NCCL's summation order is not rank order), fp32 accumulation for bf16 /
 * fp16 included, with and without mean, in one and in several staging
 * chunks.
 *
 * Built without CUDA, or with no device, every test skips visibly:
 * "built without CUDA" / "no CUDA device" (Criterion [SKIP]), never a pass. */
#include <criterion/criterion.h>
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "dtype.h"
#include "optim.h"

#ifdef SHARDD_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

static shardd__backend *g_cuda, *g_host;

static void need_cuda(void) {
#ifndef SHARDD_HAVE_CUDA
  cr_skip_test("built without CUDA");
#else
  if (shardd__cuda_device_count() == 0)
    cr_skip_test("no CUDA device");
  char err[256];
  shardd_err rc = shardd__backend_cuda_create(0, &g_cuda, err, sizeof err);
  cr_assert_eq(rc, SHARDD_OK, "cuda backend: %s", err);
  rc = shardd__backend_host_create(g_cuda->ndevices, (uint64_t)4 << 30,
                                   &g_host, err, sizeof err);
  cr_assert_eq(rc, SHARDD_OK, "host backend: %s", err);
#endif
}

static void cu_upload(shardd__region *c, const void *src, size_t bytes) {
#ifdef SHARDD_HAVE_CUDA
  cudaError_t e = cudaSetDevice(c->device);
  if (e == cudaSuccess)
    e = cudaMemcpy(c->ptr, src, bytes, cudaMemcpyHostToDevice);
  if (e == cudaSuccess) /* pageable copies may still be in flight */
    e = cudaDeviceSynchronize();
  cr_assert_eq(e, cudaSuccess, "upload: %s", cudaGetErrorString(e));
#else
  (void)c, (void)src, (void)bytes;
#endif
}

static void cu_download(void *dst, shardd__region *c, size_t bytes) {
#ifdef SHARDD_HAVE_CUDA
  cudaError_t e = cudaSetDevice(c->device);
  if (e == cudaSuccess)
    e = cudaMemcpy(dst, c->ptr, bytes, cudaMemcpyDeviceToHost);
  cr_assert_eq(e, cudaSuccess, "download: %s", cudaGetErrorString(e));
#else
  (void)dst, (void)c, (void)bytes;
#endif
}

/* ---- paired regions: the same bytes on the host and on a GPU ------------ */

typedef struct {
  shardd__region *h, *c;
  size_t bytes;
} pair;

static pair pair_alloc(int device, size_t bytes) {
  pair p = {0};
  char err[256];
  shardd_err rc = g_cuda->ops->alloc(g_cuda, device, bytes, "test", &p.c, err,
                                     sizeof err);
  cr_assert_eq(rc, SHARDD_OK, "cuda alloc %zu on %d: %s", bytes, device, err);
  rc = g_host->ops->alloc(g_host, device, bytes, "test", &p.h, err, sizeof err);
  cr_assert_eq(rc, SHARDD_OK, "host alloc %zu: %s", bytes, err);
  p.bytes = bytes;
  memset(p.h->ptr, 0xff, p.h->bytes); /* poison: NaN in every dtype */
  return p;
}

static void pair_free(pair *p) {
  g_cuda->ops->free(g_cuda, p->c);
  g_host->ops->free(g_host, p->h);
  p->c = p->h = NULL;
}

/* Makes the GPU copy equal to the host copy (after the host was filled). */
static void pair_push(pair *p) { cu_upload(p->c, p->h->ptr, p->bytes); }

static void *hat(pair *p, size_t off) { return (char *)p->h->ptr + off; }

/* The GPU copy must equal the host copy, every byte of it. */
static void pair_expect_same(pair *p, const char *what) {
  unsigned char *got = malloc(p->bytes);
  cr_assert_not_null(got);
  cu_download(got, p->c, p->bytes);
  const unsigned char *want = p->h->ptr;
  if (memcmp(got, want, p->bytes) != 0) {
    size_t i = 0, bad = 0;
    while (want[i] == got[i])
      i++;
    for (size_t j = i; j < p->bytes; j++)
      bad += want[j] != got[j];
    size_t w = i & ~(size_t)3;
    uint32_t a, b;
    float fa, fb;
    memcpy(&a, want + w, 4);
    memcpy(&b, got + w, 4);
    memcpy(&fa, &a, 4);
    memcpy(&fb, &b, 4);
    free(got);
    cr_assert_fail("%s: %zu bytes differ, first at byte %zu: host word "
                   "0x%08x (%.9g as fp32), cuda 0x%08x (%.9g)",
                   what, bad, i, a, (double)fa, b, (double)fb);
  }
  free(got);
}

/* ---- random data ------------------------------------------------------ */

static uint64_t rng = 0x9e3779b97f4a7c15ull;

static uint64_t next_u64(void) {
  rng ^= rng << 13;
  rng ^= rng >> 7;
  rng ^= rng << 17;
  return rng;
}

/* Finite, nonzero, spread over 2^-8..2^8 in magnitude, either sign. */
static float rand_f32(void) {
  uint64_t u = next_u64();
  float m = (float)((u >> 40) + 1) / 16777216.0f; /* (0, 1] */
  int e = (int)((u >> 8) & 15) - 8;
  float f = ldexpf(m, e);
  return (u & 1) ? -f : f;
}

/* Random finite 16-bit bit patterns (subnormals included). */
static uint16_t rand_16(shardd_dtype dt) {
  for (;;) {
    uint16_t h = (uint16_t)next_u64();
    if (dt == SHARDD_DTYPE_BF16) {
      if (((h >> 7) & 0xff) != 0xff && (h & 0x7fff) != 0)
        return h;
    } else if (((h >> 10) & 0x1f) != 0x1f && (h & 0x7fff) != 0) {
      return h;
    }
  }
}

static void fill(shardd_dtype dt, void *dst, size_t n) {
  if (dt == SHARDD_DTYPE_FP32) {
    float *f = dst;
    for (size_t i = 0; i < n; i++)
      f[i] = rand_f32();
  } else {
    uint16_t *h = dst;
    for (size_t i = 0; i < n; i++)
      h[i] = rand_16(dt);
  }
}

/* Values a param of dtype can hold, as Adam/SGD see them (no inf from fp16
 * overflow in the update). */
static void fill_param(shardd_dtype dt, void *dst, size_t n) {
  if (dt == SHARDD_DTYPE_FP32) {
    fill(dt, dst, n);
    return;
  }
  uint16_t *h = dst;
  for (size_t i = 0; i < n; i++) {
    float f = rand_f32();
    h[i] = dt == SHARDD_DTYPE_BF16 ? shardd__f32_to_bf16(f)
                                   : shardd__f32_to_f16(f);
  }
}

static void fill_nonneg(float *f, size_t n) {
  for (size_t i = 0; i < n; i++)
    f[i] = fabsf(rand_f32());
}

static const char *dt_name(shardd_dtype dt) {
  return dt == SHARDD_DTYPE_FP32 ? "fp32" : dt == SHARDD_DTYPE_BF16 ? "bf16" : "fp16";
}

/* ---- reduce ------------------------------------------------------------ */

/* nsrc sources (each in its own region, on devices round-robin so peer
 * copies or staging are exercised where there are several GPUs) reduced
 * into one fp32 destination on device 0; offsets aligned or not. */
static void check_reduce_op(shardd_dtype dt, int nsrc, float divisor,
                            int misaligned, size_t n, int add) {
  size_t esz = shardd_dtype_size(dt);
  size_t soff = misaligned ? 3 * esz : 64;
  size_t doff = misaligned ? 4 : 128;
  pair *src = calloc((size_t)(nsrc ? nsrc : 1), sizeof *src);
  shardd__region **hs = calloc((size_t)(nsrc ? nsrc : 1), sizeof *hs);
  shardd__region **cs = calloc((size_t)(nsrc ? nsrc : 1), sizeof *cs);
  size_t *offs = calloc((size_t)(nsrc ? nsrc : 1), sizeof *offs);
  cr_assert(src && hs && cs && offs);
  for (int i = 0; i < nsrc; i++) {
    src[i] = pair_alloc(i % g_cuda->ndevices, soff + n * esz + 256);
    fill(dt, hat(&src[i], soff), n);
    pair_push(&src[i]);
    hs[i] = src[i].h;
    cs[i] = src[i].c;
    offs[i] = soff;
  }
  pair dst = pair_alloc(0, doff + n * 4 + 256);
  if (add) /* the earlier backwards' reduced gradient to add to */
    fill(SHARDD_DTYPE_FP32, hat(&dst, doff), n);
  pair_push(&dst); /* all poison, or that gradient */
  shardd_err rc = (add ? g_host->ops->reduce_add : g_host->ops->reduce)(
      g_host, dt, divisor, dst.h, doff, hs, offs, nsrc, n);
  cr_assert_eq(rc, SHARDD_OK);
  cr_assert_not_null(g_cuda->ops->reduce_add);
  rc = (add ? g_cuda->ops->reduce_add : g_cuda->ops->reduce)(
      g_cuda, dt, divisor, dst.c, doff, cs, offs, nsrc, n);
  cr_assert_eq(rc, SHARDD_OK, "cuda reduce: %s", shardd_strerror(rc));
  char what[128];
  snprintf(what, sizeof what, "%s %s nsrc=%d divisor=%g %s n=%zu",
           add ? "reduce_add" : "reduce", dt_name(dt), nsrc, (double)divisor,
           misaligned ? "misaligned" : "aligned", n);
  pair_expect_same(&dst, what);
  for (int i = 0; i < nsrc; i++) /* sources untouched */
    pair_expect_same(&src[i], "reduce source");
  for (int i = 0; i < nsrc; i++)
    pair_free(&src[i]);
  pair_free(&dst);
  free(src);
  free(hs);
  free(cs);
  free(offs);
}

static void check_reduce(shardd_dtype dt, int nsrc, float divisor,
                         int misaligned, size_t n) {
  check_reduce_op(dt, nsrc, divisor, misaligned, n, 0);
}

Test(backend_cuda, reduce_fp32) {
  need_cuda();
  check_reduce(SHARDD_DTYPE_FP32, 1, 1.0f, 0, 100003);
  check_reduce(SHARDD_DTYPE_FP32, 4, 4.0f, 0, 100003);
  check_reduce(SHARDD_DTYPE_FP32, 3, 3.0f, 1, 100003);
  check_reduce(SHARDD_DTYPE_FP32, 11, 1.0f, 0, 65537); /* > 8 sources */
  check_reduce(SHARDD_DTYPE_FP32, 11, 11.0f, 1, 4099);
  check_reduce(SHARDD_DTYPE_FP32, 0, 1.0f, 0, 1000); /* zero sources: zeros */
}

Test(backend_cuda, reduce_bf16) {
  need_cuda();
  check_reduce(SHARDD_DTYPE_BF16, 1, 1.0f, 0, 100003);
  check_reduce(SHARDD_DTYPE_BF16, 4, 4.0f, 0, 100003);
  check_reduce(SHARDD_DTYPE_BF16, 5, 5.0f, 1, 100003);
  check_reduce(SHARDD_DTYPE_BF16, 9, 9.0f, 0, 65537);
}

Test(backend_cuda, reduce_fp16) {
  need_cuda();
  check_reduce(SHARDD_DTYPE_FP16, 1, 1.0f, 0, 100003);
  check_reduce(SHARDD_DTYPE_FP16, 4, 4.0f, 0, 100003);
  check_reduce(SHARDD_DTYPE_FP16, 5, 5.0f, 1, 100003);
  check_reduce(SHARDD_DTYPE_FP16, 17, 1.0f, 0, 65537);
}

/* An accumulating scatter's reduce: added to what the destination holds,
 * the sum divided before the addition, bit for bit as the host. */
Test(backend_cuda, reduce_add) {
  need_cuda();
  check_reduce_op(SHARDD_DTYPE_FP32, 2, 2.0f, 0, 100003, 1);
  check_reduce_op(SHARDD_DTYPE_FP32, 3, 1.0f, 1, 4099, 1);
  check_reduce_op(SHARDD_DTYPE_FP32, 11, 11.0f, 0, 65537, 1); /* > 8 sources */
  check_reduce_op(SHARDD_DTYPE_BF16, 4, 4.0f, 1, 100003, 1);
  check_reduce_op(SHARDD_DTYPE_FP16, 5, 5.0f, 0, 70001, 1);
  check_reduce_op(SHARDD_DTYPE_FP32, 0, 2.0f, 0, 1000, 1); /* nothing added */
}

/* A trainer's write to a 16-bit shard is adopted into the master, as the
 * host does: params that are the master's rounding keep it, others
 * (every third) replace it. */
Test(backend_cuda, adopt) {
  need_cuda();
  shardd_dtype dts[2] = {SHARDD_DTYPE_BF16, SHARDD_DTYPE_FP16};
  for (int d = 0; d < 2; d++) {
    for (int mis = 0; mis < 2; mis++) {
      size_t n = 70001, moff = 64 + (mis ? 4 : 0), poff = 32 + (mis ? 2 : 0);
      pair m = pair_alloc(0, moff + n * 4 + 64);
      pair p = pair_alloc(0, poff + n * 2 + 64);
      float *mf = hat(&m, moff);
      uint16_t *pu = hat(&p, poff);
      fill(SHARDD_DTYPE_FP32, mf, n);
      fill(dts[d], pu, n);
      for (size_t i = 0; i < n; i++)
        if (i % 3 != 0)
          pu[i] = dts[d] == SHARDD_DTYPE_BF16 ? shardd__f32_to_bf16(mf[i])
                                               : shardd__f32_to_f16(mf[i]);
      pair_push(&m);
      pair_push(&p);
      cr_assert_eq(g_host->ops->adopt(g_host, dts[d], m.h, moff, p.h, poff, n),
                   SHARDD_OK);
      cr_assert_not_null(g_cuda->ops->adopt);
      cr_assert_eq(g_cuda->ops->adopt(g_cuda, dts[d], m.c, moff, p.c, poff, n),
                   SHARDD_OK);
      pair_expect_same(&m, dts[d] == SHARDD_DTYPE_BF16 ? "adopt bf16" : "adopt fp16");
      pair_expect_same(&p, "adopt leaves the param");
      pair_free(&m);
      pair_free(&p);
    }
  }
}

/* Several worker threads reducing at once, as collective.c's tasks do. */
typedef struct {
  shardd__region *dst;
  shardd__region **srcs;
  size_t *offs;
  int nsrc;
  size_t n;
  shardd_err rc;
} reduce_job;

static void *reduce_thread(void *arg) {
  reduce_job *j = arg;
  for (int rep = 0; rep < 4 && j->rc == SHARDD_OK; rep++)
    j->rc = g_cuda->ops->reduce(g_cuda, SHARDD_DTYPE_BF16, (float)j->nsrc,
                                j->dst, 0, j->srcs, j->offs, j->nsrc, j->n);
  return NULL;
}

Test(backend_cuda, reduce_from_threads) {
  need_cuda();
  enum { T = 4 };
  size_t n = 1 << 18;
  pair src[T], dst[T];
  shardd__region *hs[T], *cs[T];
  size_t offs[T];
  for (int i = 0; i < T; i++) {
    src[i] = pair_alloc(i % g_cuda->ndevices, n * 2 * T);
    fill(SHARDD_DTYPE_BF16, hat(&src[i], 0), n * T);
    pair_push(&src[i]);
    hs[i] = src[i].h;
    cs[i] = src[i].c;
  }
  pthread_t th[T];
  reduce_job jobs[T];
  for (int t = 0; t < T; t++) {
    dst[t] = pair_alloc(t % g_cuda->ndevices, n * 4);
    pair_push(&dst[t]);
    offs[t] = (size_t)t * n * 2; /* rank t's slice of every source */
  }
  for (int t = 0; t < T; t++) {
    size_t *o = malloc(T * sizeof *o);
    for (int i = 0; i < T; i++)
      o[i] = offs[t];
    jobs[t] = (reduce_job){dst[t].c, cs, o, T, n, SHARDD_OK};
    cr_assert_eq(pthread_create(&th[t], NULL, reduce_thread, &jobs[t]), 0);
  }
  for (int t = 0; t < T; t++) {
    pthread_join(th[t], NULL);
    cr_assert_eq(jobs[t].rc, SHARDD_OK, "thread %d: %s", t,
                 shardd_strerror(jobs[t].rc));
    g_host->ops->reduce(g_host, SHARDD_DTYPE_BF16, (float)T, dst[t].h, 0, hs,
                        jobs[t].offs, T, n);
    pair_expect_same(&dst[t], "reduce from a worker thread");
    free(jobs[t].offs);
  }
  for (int i = 0; i < T; i++) {
    pair_free(&src[i]);
    pair_free(&dst[i]);
  }
}

/* ---- sum of squares ---------------------------------------------------- */

static void check_sumsq(size_t off, size_t n) {
  pair p = pair_alloc(0, off + n * 4 + 64);
  fill(SHARDD_DTYPE_FP32, hat(&p, off), n);
  pair_push(&p);
  double want = -1, got = -1;
  cr_assert_eq(g_host->ops->sumsq(g_host, p.h, off, n, &want), SHARDD_OK);
  shardd_err rc = g_cuda->ops->sumsq(g_cuda, p.c, off, n, &got);
  cr_assert_eq(rc, SHARDD_OK, "cuda sumsq: %s", shardd_strerror(rc));
  cr_assert(want > 0, "host sumsq of random data is %g", want);
  cr_assert(fabs(got - want) <= 1e-12 * want,
            "sumsq off=%zu n=%zu: cuda %.17g, host %.17g", off, n, got, want);
  pair_expect_same(&p, "sumsq input"); /* untouched */
  pair_free(&p);
}

Test(backend_cuda, sumsq) {
  need_cuda();
  check_sumsq(0, 1);
  check_sumsq(0, 1000003);
  check_sumsq(4, 1000003); /* not 16-byte aligned: scalar path */
  check_sumsq(256, 4096);
  double s = -1;
  pair p = pair_alloc(0, 64);
  cr_assert_eq(g_cuda->ops->sumsq(g_cuda, p.c, 0, 0, &s), SHARDD_OK);
  cr_expect_eq(s, 0.0);
  pair_free(&p);
}

/* ---- updates ----------------------------------------------------------- */

typedef struct {
  const char *name;
  shardd__hp hp;
} upd_case;

static shardd__hp hp_of(shardd_optim_kind kind) {
  shardd__hp hp;
  shardd__hp_defaults(kind, &hp);
  return hp;
}

static int make_cases(upd_case *c) {
  int n = 0;
  shardd__hp h;

  h = hp_of(SHARDD_OPTIM_SGD);
  h.lr = 0.05;
  c[n++] = (upd_case){"sgd plain", h};
  h.weight_decay = 0.01;
  c[n++] = (upd_case){"sgd wd", h};
  h.momentum = 0.9;
  h.dampening = 0.1;
  c[n++] = (upd_case){"sgd momentum dampening wd", h};
  h = hp_of(SHARDD_OPTIM_SGD);
  h.lr = 0.03;
  h.momentum = 0.8;
  h.nesterov = 1;
  c[n++] = (upd_case){"sgd nesterov", h};
  h.weight_decay = 1e-3;
  h.maximize = 1;
  c[n++] = (upd_case){"sgd nesterov wd maximize", h};

  h = hp_of(SHARDD_OPTIM_ADAM);
  c[n++] = (upd_case){"adam", h};
  h.weight_decay = 0.01;
  h.lr = 3e-3;
  c[n++] = (upd_case){"adam l2", h};
  h = hp_of(SHARDD_OPTIM_ADAM);
  h.amsgrad = 1;
  h.beta1 = 0.8;
  h.beta2 = 0.99;
  h.eps = 1e-6;
  c[n++] = (upd_case){"adam amsgrad", h};
  h.maximize = 1;
  h.weight_decay = 0.05;
  c[n++] = (upd_case){"adam amsgrad l2 maximize", h};

  h = hp_of(SHARDD_OPTIM_ADAMW);
  c[n++] = (upd_case){"adamw", h};
  h.amsgrad = 1;
  h.lr = 1e-2;
  c[n++] = (upd_case){"adamw amsgrad", h};
  h = hp_of(SHARDD_OPTIM_ADAMW);
  h.weight_decay = 0;
  h.maximize = 1;
  c[n++] = (upd_case){"adamw no wd maximize", h};
  return n;
}

/* Runs steps first..first+nsteps-1 of one case on both backends: a block
 * with the param (dtype) and the gradient, a state region with the fp32
 * master (16-bit params: widened first, as update_task does) and the state
 * arrays, laid out with poisoned gaps. resume: state starts random (a later
 * step of a run), else zero (Adam) / poison (SGD's buffer, unread on step 1). */
static void check_update(const upd_case *uc, shardd_dtype dt, int misaligned,
                         uint64_t first, int nsteps, int resume,
                         float grad_scale, size_t n) {
  char err[256];
  cr_assert_eq(shardd__hp_check(&uc->hp, err, sizeof err), SHARDD_OK, "%s: %s",
               uc->name, err);
  size_t esz = shardd_dtype_size(dt);
  size_t skew = misaligned ? 4 : 0; /* bytes: breaks 16-byte alignment */
  size_t param_off = 256 + (misaligned ? esz : 0);
  size_t grad_off = (param_off + n * esz + 511) / 512 * 512 + skew;
  pair blk = pair_alloc(0, grad_off + n * 4 + 256);
  int wide = dt != SHARDD_DTYPE_FP32;
  int ns = shardd__optim_state_count(&uc->hp);
  size_t arr = (n * 4 + 511) / 512 * 512;
  size_t master_off = 128 + skew;
  size_t offs[3];
  for (int k = 0; k < 3; k++)
    offs[k] = master_off + (size_t)(k + 1) * (arr + 128);
  pair st = pair_alloc(0, offs[2] + arr + 128);

  fill_param(dt, hat(&blk, param_off), n);
  fill(SHARDD_DTYPE_FP32, hat(&blk, grad_off), n);
  for (int k = 0; k < ns; k++) {
    float *s = hat(&st, offs[k]);
    if (resume) {
      if (uc->hp.kind == SHARDD_OPTIM_SGD || k == 0)
        fill(SHARDD_DTYPE_FP32, s, n);
      else
        fill_nonneg(s, n);
    } else if (uc->hp.kind != SHARDD_OPTIM_SGD) {
      memset(s, 0, n * 4);
    } /* SGD's buffer stays poison: step 1 must not read it */
  }
  if (resume && ns == 3) { /* max_exp_avg_sq >= exp_avg_sq somewhere only */
    float *v = hat(&st, offs[1]), *vm = hat(&st, offs[2]);
    for (size_t i = 0; i < n; i += 2)
      vm[i] = v[i] * 1.5f;
  }
  pair_push(&blk);
  pair_push(&st);

  char what[256];
  if (wide) {
    cr_assert_eq(g_host->ops->widen(g_host, dt, st.h, master_off, blk.h,
                                    param_off, n), SHARDD_OK);
    shardd_err rc = g_cuda->ops->widen(g_cuda, dt, st.c, master_off, blk.c,
                                       param_off, n);
    cr_assert_eq(rc, SHARDD_OK, "cuda widen: %s", shardd_strerror(rc));
    snprintf(what, sizeof what, "widen %s", dt_name(dt));
    pair_expect_same(&st, what);
  }
  for (int s = 0; s < nsteps; s++) {
    uint64_t step = first + (uint64_t)s;
    if (s > 0) { /* a new gradient each step */
      fill(SHARDD_DTYPE_FP32, hat(&blk, grad_off), n);
      cu_upload(blk.c, blk.h->ptr, blk.bytes);
    }
    shardd_err rc = g_host->ops->update(
        g_host, &uc->hp, step, dt, blk.h, param_off, wide ? st.h : NULL,
        master_off, blk.h, grad_off, grad_scale, st.h, offs, n);
    cr_assert_eq(rc, SHARDD_OK);
    rc = g_cuda->ops->update(g_cuda, &uc->hp, step, dt, blk.c, param_off,
                             wide ? st.c : NULL, master_off, blk.c, grad_off,
                             grad_scale, st.c, offs, n);
    cr_assert_eq(rc, SHARDD_OK, "cuda update: %s", shardd_strerror(rc));
    snprintf(what, sizeof what,
             "%s, %s params, %s, step %llu, grad_scale %g: param/grad block",
             uc->name, dt_name(dt), misaligned ? "misaligned" : "aligned",
             (unsigned long long)step, (double)grad_scale);
    pair_expect_same(&blk, what);
    snprintf(what, sizeof what,
             "%s, %s params, %s, step %llu, grad_scale %g: master/state",
             uc->name, dt_name(dt), misaligned ? "misaligned" : "aligned",
             (unsigned long long)step, (double)grad_scale);
    pair_expect_same(&st, what);
  }
  pair_free(&blk);
  pair_free(&st);
}

static void check_all_cases(shardd_dtype dt) {
  upd_case cases[32];
  int nc = make_cases(cases);
  for (int i = 0; i < nc; i++) {
    check_update(&cases[i], dt, 0, 1, 3, 0, 1.0f, 50003);
    check_update(&cases[i], dt, 1, 1, 2, 0, 0.37f, 50003);
    check_update(&cases[i], dt, 0, 7, 2, 1, 0.81f, 20001);
    check_update(&cases[i], dt, 1, 12, 1, 1, 1.0f, 4097);
  }
}

Test(backend_cuda, update_fp32) {
  need_cuda();
  check_all_cases(SHARDD_DTYPE_FP32);
}

Test(backend_cuda, update_bf16_master) {
  need_cuda();
  check_all_cases(SHARDD_DTYPE_BF16);
}

Test(backend_cuda, update_fp16_master) {
  need_cuda();
  check_all_cases(SHARDD_DTYPE_FP16);
}

Test(backend_cuda, widen) {
  need_cuda();
  shardd_dtype dts[2] = {SHARDD_DTYPE_BF16, SHARDD_DTYPE_FP16};
  for (int d = 0; d < 2; d++) {
    for (int mis = 0; mis < 2; mis++) {
      size_t n = 70001, soff = 64 + (mis ? 2 : 0), doff = 32 + (mis ? 4 : 0);
      pair src = pair_alloc(0, soff + n * 2 + 64);
      pair dst = pair_alloc(0, doff + n * 4 + 64);
      fill(dts[d], hat(&src, soff), n); /* subnormals included */
      pair_push(&src);
      pair_push(&dst);
      cr_assert_eq(g_host->ops->widen(g_host, dts[d], dst.h, doff, src.h, soff, n),
                   SHARDD_OK);
      cr_assert_eq(g_cuda->ops->widen(g_cuda, dts[d], dst.c, doff, src.c, soff, n),
                   SHARDD_OK);
      pair_expect_same(&dst, dts[d] == SHARDD_DTYPE_BF16 ? "widen bf16" : "widen fp16");
      pair_free(&src);
      pair_free(&dst);
    }
  }
}

/* ---- copy, memory, export ---------------------------------------------- */

Test(backend_cuda, copy_within_and_across_devices) {
  need_cuda();
  int last = g_cuda->ndevices - 1;
  pair a = pair_alloc(0, 1 << 20), b = pair_alloc(last, 1 << 20);
  fill(SHARDD_DTYPE_FP32, hat(&a, 0), (1 << 20) / 4);
  pair_push(&a);
  pair_push(&b);
  struct { size_t doff, soff, bytes; } cs[] = {
      {0, 0, 1 << 19}, {4096 + 3, 17, 100001}, {(1 << 20) - 5, 0, 5}, {0, 0, 0}};
  for (size_t i = 0; i < sizeof cs / sizeof cs[0]; i++) {
    cr_assert_eq(g_host->ops->copy(g_host, b.h, cs[i].doff, a.h, cs[i].soff,
                                   cs[i].bytes), SHARDD_OK);
    cr_assert_eq(g_cuda->ops->copy(g_cuda, b.c, cs[i].doff, a.c, cs[i].soff,
                                   cs[i].bytes), SHARDD_OK);
    pair_expect_same(&b, "copy across devices");
    /* and within a device */
    cr_assert_eq(g_host->ops->copy(g_host, a.h, (1 << 19) + cs[i].doff / 2,
                                   a.h, cs[i].soff, cs[i].bytes / 2), SHARDD_OK);
    cr_assert_eq(g_cuda->ops->copy(g_cuda, a.c, (1 << 19) + cs[i].doff / 2,
                                   a.c, cs[i].soff, cs[i].bytes / 2), SHARDD_OK);
    pair_expect_same(&a, "copy within a device");
  }
  pair_free(&a);
  pair_free(&b);
}

Test(backend_cuda, alloc_zeroed_and_accounted) {
  need_cuda();
  shardd__device_info before, during, after;
  g_cuda->ops->device_info(g_cuda, 0, &before);
  cr_assert(before.name[0] != '\0', "device 0 has no name");
  cr_assert_gt(before.capacity_bytes, 0);
  char err[256];
  size_t bytes = (size_t)64 << 20;
  unsigned char *junk = malloc(bytes), *back = malloc(bytes);
  cr_assert(junk && back);
  memset(junk, 0xa5, bytes);
  for (int round = 0; round < 2; round++) {
    /* a second allocation likely reuses the first one's dirty memory */
    shardd__region *r;
    cr_assert_eq(g_cuda->ops->alloc(g_cuda, 0, bytes, "zero", &r, err, sizeof err),
                 SHARDD_OK, "%s", err);
    cr_assert_eq(r->fd, -1);
    cr_assert_geq(r->bytes, bytes);
    g_cuda->ops->device_info(g_cuda, 0, &during);
    cr_assert_eq(during.used_bytes, before.used_bytes + r->bytes);
    cu_download(back, r, bytes);
    for (size_t i = 0; i < bytes; i++)
      if (back[i] != 0)
        cr_assert_fail("round %d: byte %zu of a new region is 0x%02x, not 0",
                       round, i, back[i]);
    cu_upload(r, junk, bytes);
    g_cuda->ops->free(g_cuda, r);
  }
  g_cuda->ops->device_info(g_cuda, 0, &after);
  cr_assert_eq(after.used_bytes, before.used_bytes);
  free(junk);
  free(back);
}

Test(backend_cuda, alloc_refusals) {
  need_cuda();
  shardd__device_info di;
  g_cuda->ops->device_info(g_cuda, 0, &di);
  shardd__region *r = (shardd__region *)1;
  char err[256] = "";
  shardd_err rc = g_cuda->ops->alloc(g_cuda, 0, (size_t)di.capacity_bytes * 2,
                                     "huge", &r, err, sizeof err);
  cr_assert_eq(rc, SHARDD_E_NO_MEMORY, "got %s", shardd_strerror(rc));
  cr_assert_null(r);
  cr_assert(strstr(err, "device 0") != NULL, "message: %s", err);
  cr_assert(strstr(err, "bytes requested") != NULL, "message: %s", err);
  rc = g_cuda->ops->alloc(g_cuda, g_cuda->ndevices, 64, "x", &r, err, sizeof err);
  cr_assert_eq(rc, SHARDD_E_INVAL);
  cr_assert(strstr(err, "no device") != NULL, "message: %s", err);
}

Test(backend_cuda, export_ipc_not_fd) {
  need_cuda();
  cr_assert_not_null(g_cuda->ops->export_ipc);
  cr_assert_null(g_host->ops->export_ipc);
  pair p = pair_alloc(0, 4096);
  unsigned char h[64];
  memset(h, 0, sizeof h);
  size_t len = 0;
  cr_assert_eq(g_cuda->ops->export_ipc(g_cuda, p.c, h, sizeof h, &len), SHARDD_OK);
  cr_assert_eq(len, 64);
  int nz = 0;
  for (size_t i = 0; i < len; i++)
    nz |= h[i];
  cr_assert(nz, "IPC handle is all zero");
  cr_assert_eq(g_cuda->ops->export_ipc(g_cuda, p.c, h, 8, &len), SHARDD_E_INVAL);
  int fd = 123;
  cr_assert_neq(g_cuda->ops->export_fd(g_cuda, p.c, &fd), SHARDD_OK);
  cr_assert_eq(fd, -1);
  pair_free(&p);
}

Test(backend_cuda, read_write_host) {
  need_cuda();
  cr_assert_not_null(g_cuda->ops->read);
  cr_assert_not_null(g_cuda->ops->write);
  cr_assert_null(g_host->ops->read);
  size_t n = 100001;
  pair p = pair_alloc(0, n * 4 + 64);
  pair_push(&p);
  float *src = malloc(n * 4), *back = malloc(n * 4);
  cr_assert(src && back);
  fill(SHARDD_DTYPE_FP32, src, n);
  memcpy(hat(&p, 12), src, n * 4);
  cr_assert_eq(g_cuda->ops->write(g_cuda, p.c, 12, src, n * 4), SHARDD_OK);
  pair_expect_same(&p, "write from host");
  cr_assert_eq(g_cuda->ops->read(g_cuda, p.c, 12, back, n * 4), SHARDD_OK);
  cr_assert(memcmp(src, back, n * 4) == 0, "read back differs");
  free(src);
  free(back);
  pair_free(&p);
}

Test(backend_cuda, create_refuses_too_many_devices) {
  need_cuda();
  shardd__backend *b = NULL;
  char err[256];
  shardd_err rc = shardd__backend_cuda_create(g_cuda->ndevices + 1, &b, err,
                                              sizeof err);
  cr_assert_eq(rc, SHARDD_E_RANGE);
  cr_assert_null(b);
  cr_assert(strstr(err, "visible") != NULL, "message: %s", err);
}

/* ---- whole collectives (NCCL) ------------------------------------------ */

/* n ranks (rank r on device r), each a block laid out as in the registry:
 * shard (dtype) | reduced (fp32) | gather (dtype) | grad (dtype), at odd
 * offsets; everything poisoned, then shards and grads random. */
typedef struct {
  int n;
  shardd_dtype dt;
  size_t esz, s; /* s: shard elements; padded = n * s */
  size_t shard_off, reduced_off, gather_off, grad_off;
  pair p[16];
  shardd__region *h[16], *c[16];
  void *comm;
} coll_world;

static int coll_ranks(int want) {
  int n = g_cuda->ndevices < want ? g_cuda->ndevices : want;
  return n < 16 ? n : 16;
}

static void cw_setup(coll_world *w, int n, shardd_dtype dt, size_t s) {
  memset(w, 0, sizeof *w);
  w->n = n;
  w->dt = dt;
  w->esz = shardd_dtype_size(dt);
  w->s = s;
  w->shard_off = 3 * w->esz; /* misaligned for 16-byte vectors */
  w->reduced_off = (w->shard_off + s * w->esz + 255) / 256 * 256 + 4;
  w->gather_off = w->reduced_off + s * 4 + 6;
  w->grad_off = w->gather_off + (size_t)n * s * w->esz + 2 * w->esz;
  size_t bytes = w->grad_off + (size_t)n * s * w->esz + 128;
  for (int r = 0; r < n; r++) {
    w->p[r] = pair_alloc(r, bytes);
    fill_param(dt, hat(&w->p[r], w->shard_off), s);
    fill_param(dt, hat(&w->p[r], w->grad_off), (size_t)n * s);
    pair_push(&w->p[r]);
    w->h[r] = w->p[r].h;
    w->c[r] = w->p[r].c;
  }
  int devs[16];
  for (int r = 0; r < n; r++)
    devs[r] = r;
  char err[512];
  cr_assert_not_null(g_cuda->ops->comm_create);
  shardd_err rc = g_cuda->ops->comm_create(g_cuda, devs, n, &w->comm, err,
                                           sizeof err);
  cr_assert_eq(rc, SHARDD_OK, "comm_create over %d devices: %s", n, err);
}

static void cw_free(coll_world *w) {
  g_cuda->ops->comm_destroy(g_cuda, w->comm);
  for (int r = 0; r < w->n; r++)
    pair_free(&w->p[r]);
}

static float widen_at(shardd_dtype dt, const void *p, size_t i) {
  if (dt == SHARDD_DTYPE_FP32)
    return ((const float *)p)[i];
  uint16_t h = ((const uint16_t *)p)[i];
  return dt == SHARDD_DTYPE_BF16 ? shardd__bf16_to_f32(h) : shardd__f16_to_f32(h);
}

static void check_allgather(shardd_dtype dt, int n, size_t s) {
  coll_world w;
  cw_setup(&w, n, dt, s);
  size_t bytes = s * w.esz;
  for (int i = 0; i < n; i++) /* the host reference: rank by rank copies */
    for (int j = 0; j < n; j++)
      cr_assert_eq(g_host->ops->copy(g_host, w.h[i], w.gather_off + j * bytes,
                                     w.h[j], w.shard_off, bytes), SHARDD_OK);
  char err[512] = "";
  shardd_err rc = g_cuda->ops->allgather(g_cuda, w.comm, w.c, w.shard_off,
                                         w.c, w.gather_off, bytes, err,
                                         sizeof err);
  cr_assert_eq(rc, SHARDD_OK, "allgather: %s", err);
  char what[128];
  for (int r = 0; r < n; r++) {
    snprintf(what, sizeof what, "allgather %s n=%d s=%zu, rank %d's block",
             dt_name(dt), n, s, r);
    pair_expect_same(&w.p[r], what);
  }
  cw_free(&w);
}

/* Bit-identical to the host outside [off, off+4m); inside, within the
 * rounding a different fp32 summation order of nsum terms can give. */
static void expect_close_f32(pair *p, size_t off, size_t m, const float *tol,
                             const char *what) {
  unsigned char *got = malloc(p->bytes);
  cr_assert_not_null(got);
  cu_download(got, p->c, p->bytes);
  const unsigned char *want = p->h->ptr;
  cr_assert(memcmp(got, want, off) == 0, "%s: bytes before the output differ", what);
  cr_assert(memcmp(got + off + 4 * m, want + off + 4 * m,
                   p->bytes - off - 4 * m) == 0,
            "%s: bytes after the output differ", what);
  for (size_t i = 0; i < m; i++) {
    float a, b;
    memcpy(&a, want + off + 4 * i, 4);
    memcpy(&b, got + off + 4 * i, 4);
    if (!(fabsf(a - b) <= tol[i])) {
      free(got);
      cr_assert_fail("%s: element %zu: host %.9g, cuda %.9g (tolerance %.3g)",
                     what, i, (double)a, (double)b, (double)tol[i]);
    }
  }
  free(got);
}

static void check_reduce_scatter(shardd_dtype dt, int n, size_t s,
                                 float divisor) {
  coll_world w;
  cw_setup(&w, n, dt, s);
  /* the host reference: rank i's shard of the sum, in rank order, fp32 */
  size_t offs[16];
  for (int i = 0; i < n; i++) {
    for (int j = 0; j < n; j++)
      offs[j] = w.grad_off + (size_t)i * s * w.esz;
    cr_assert_eq(g_host->ops->reduce(g_host, dt, divisor, w.h[i],
                                     w.reduced_off, w.h, offs, n, s),
                 SHARDD_OK);
  }
  char err[512] = "";
  shardd_err rc = g_cuda->ops->reduce_scatter(g_cuda, w.comm, dt, divisor, w.c,
                                              w.grad_off, w.c, w.reduced_off,
                                              s, err, sizeof err);
  cr_assert_eq(rc, SHARDD_OK, "reduce_scatter: %s", err);
  char what[160];
  float *tol = malloc(s * sizeof *tol);
  cr_assert_not_null(tol);
  for (int i = 0; i < n; i++) {
    snprintf(what, sizeof what,
             "reduce_scatter %s n=%d s=%zu divisor=%g, rank %d's block",
             dt_name(dt), n, s, (double)divisor, i);
    if (n == 1) { /* one term: no order to differ, must be exact */
      pair_expect_same(&w.p[i], what);
      continue;
    }
    for (size_t e = 0; e < s; e++) {
      double mag = 0;
      for (int j = 0; j < n; j++)
        mag += fabs((double)widen_at(dt, hat(&w.p[j], w.grad_off),
                                     (size_t)i * s + e));
      tol[e] = (float)(2.0 * n * mag * 0x1p-23 / divisor);
    }
    expect_close_f32(&w.p[i], w.reduced_off, s, tol, what);
  }
  free(tol);
  cw_free(&w);
}

Test(backend_cuda, nccl_allgather) {
  need_cuda();
  int n = coll_ranks(8);
  check_allgather(SHARDD_DTYPE_FP32, n, 100003);
  check_allgather(SHARDD_DTYPE_BF16, n, 65537);
  check_allgather(SHARDD_DTYPE_FP16, n, 1);
}

Test(backend_cuda, nccl_reduce_scatter_fp32) {
  need_cuda();
  int n = coll_ranks(8);
  check_reduce_scatter(SHARDD_DTYPE_FP32, n, 100003, 1.0f);
  check_reduce_scatter(SHARDD_DTYPE_FP32, n, 4099, (float)n);
}

Test(backend_cuda, nccl_reduce_scatter_16bit_in_fp32) {
  need_cuda();
  int n = coll_ranks(8);
  check_reduce_scatter(SHARDD_DTYPE_BF16, n, 100003, (float)n);
  check_reduce_scatter(SHARDD_DTYPE_FP16, n, 100003, 1.0f);
  check_reduce_scatter(SHARDD_DTYPE_BF16, n, 7, 3.0f);
}

/* More than one staging chunk (RS_STAGE_ELEMS fp32 per device, 32 Mi). */
Test(backend_cuda, nccl_reduce_scatter_chunked, .timeout = 120) {
  need_cuda();
  int n = coll_ranks(2);
  check_reduce_scatter(SHARDD_DTYPE_BF16, n, ((size_t)32 << 20) / (size_t)n + 5,
                       (float)n);
}

Test(backend_cuda, nccl_comm_refusals) {
  need_cuda();
  void *comm = (void *)1;
  char err[256];
  int two[2] = {0, 0};
  cr_assert_eq(g_cuda->ops->comm_create(g_cuda, two, 2, &comm, err, sizeof err),
               SHARDD_E_INVAL);
  cr_assert_null(comm);
  cr_assert(strstr(err, "both on device 0") != NULL, "message: %s", err);
  int bad = g_cuda->ndevices;
  cr_assert_eq(g_cuda->ops->comm_create(g_cuda, &bad, 1, &comm, err, sizeof err),
               SHARDD_E_INVAL);
  cr_assert_null(g_host->ops->comm_create);
  cr_assert_null(g_host->ops->allgather);
  cr_assert_null(g_host->ops->reduce_scatter);
}

Test(backend_cuda, device_info_free_bytes) {
  need_cuda();
  shardd__device_info di;
  g_cuda->ops->device_info(g_cuda, 0, &di);
  cr_assert_gt(di.free_bytes, 0);
  cr_assert_leq(di.free_bytes, di.capacity_bytes);
}
