/* test_server_cuda.c — the daemon on the cuda backend end to end, through
 * libshardd in another process (so the CUDA IPC handles really cross a
 * process boundary): the same registrations, random parameters and
 * gradients and the same gather / scatter / step sequence run against a
 * `--backend cuda` daemon and a `--backend host` daemon, and every gathered
 * and reduced byte must be identical (the host backend is the reference;
 * with the ranks on one GPU the reduction order is rank order on both).
 * Also: the pointers handed out are device pointers, attaching after a
 * reconnect finds the bytes, and status names the GPU.
 *
 * Built without CUDA, or with no device, every test skips visibly. */
#include <criterion/criterion.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>

#include "harness.h"

#ifdef SHARDD_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

static int have_gpu(void) {
#ifdef SHARDD_HAVE_CUDA
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return n > 0;
#else
  return 0;
#endif
}

static void need_gpu(void) {
#ifndef SHARDD_HAVE_CUDA
  cr_skip_test("built without CUDA");
#else
  if (!have_gpu())
    cr_skip_test("no CUDA device");
#endif
}

/* Copies between an area handed out by libshardd and host memory, whichever
 * backend it came from. */
static void put(const shardd_buffer_info *b, void *area, const void *src,
                size_t bytes) {
  if (!b->is_device) {
    memcpy(area, src, bytes);
    return;
  }
#ifdef SHARDD_HAVE_CUDA
  cudaError_t e = cudaSetDevice((int)b->device);
  if (e == cudaSuccess)
    e = cudaMemcpy(area, src, bytes, cudaMemcpyHostToDevice);
  if (e == cudaSuccess)
    e = cudaDeviceSynchronize(); /* complete before the daemon reads it */
  cr_assert_eq(e, cudaSuccess, "upload: %s", cudaGetErrorString(e));
#endif
}

static void get(const shardd_buffer_info *b, void *dst, const void *area,
                size_t bytes) {
  if (!b->is_device) {
    memcpy(dst, area, bytes);
    return;
  }
#ifdef SHARDD_HAVE_CUDA
  cudaError_t e = cudaSetDevice((int)b->device);
  if (e == cudaSuccess)
    e = cudaMemcpy(dst, area, bytes, cudaMemcpyDeviceToHost);
  cr_assert_eq(e, cudaSuccess, "download: %s", cudaGetErrorString(e));
#endif
}

static float rnd(uint64_t *s) {
  *s = *s * 6364136223846793005ull + 1442695040888963407ull;
  return (float)((*s >> 40) & 0xffffff) / 16777216.0f * 2.0f - 1.0f;
}

/* Random finite values in [-1, 1) of dtype: bf16 is the upper half of a
 * random fp32; fp16 keeps sign, 4 exponent bits (< 15) and the mantissa. */
static void fill(uint64_t *s, void *dst, shardd_dtype dt, size_t n) {
  for (size_t i = 0; i < n; i++) {
    float f = rnd(s);
    uint32_t u;
    memcpy(&u, &f, 4);
    if (dt == SHARDD_DTYPE_FP32)
      ((float *)dst)[i] = f;
    else if (dt == SHARDD_DTYPE_BF16)
      ((uint16_t *)dst)[i] = (uint16_t)(u >> 16);
    else
      ((uint16_t *)dst)[i] =
          (uint16_t)(((u >> 16) & 0x8000u) | ((u >> 10) & 0x3bffu));
  }
}

#define WORLD_MAX 2
#define STEPS 4
/* A second backward per step, scattered with accumulate (needs the
 * backend's reduce_add). */
#define RUN_ACCUMULATE 1
/* The trainer writes new values into its shard after step 1's gather (a
 * 16-bit shard's write is adopted into the master by the next step). */
#define RUN_REWRITE 2

typedef struct {
  const char *sock;
  const char *job;
  uint32_t rank, world;
  shardd_dtype dtype;
  shardd_optim_kind kind;
  uint64_t numel;
  uint64_t seed;
  int flags; /* RUN_* */
  /* out: what the rank saw after the last step */
  unsigned char *gathered; /* padded_numel * esz */
  unsigned char *reduced;  /* shard_numel * 4 */
  int is_device;
  char err[512];
} rank_run;

/* One rank of a job: registers a buffer with two views and an optimizer,
 * then STEPS x (write grad, scatter mean, step, gather). Every rank of every
 * run writes the same values for the same (seed, rank). */
static void *run_rank(void *p) {
  rank_run *a = p;
  shardd_connect_opts o = SHARDD_CONNECT_OPTS_INIT;
  o.job = a->job;
  o.rank = a->rank;
  o.world = a->world;
  shardd_client_t *c = NULL;
  if (shardd_connect(a->sock, &o, &c, a->err, sizeof a->err) != SHARDD_OK)
    return NULL;
  shardd_buffer_info b;
  size_t esz = shardd_dtype_size(a->dtype);
  shardd_err rc = shardd_buffer_register(c, "flat", a->dtype, a->numel, &b);
  uint64_t half = a->numel / 2;
  int64_t s0[1] = {(int64_t)half}, s1[1] = {(int64_t)(a->numel - half)};
  uint64_t v[2] = {0, 0};
  if (rc == SHARDD_OK)
    rc = shardd_view_register(c, b.id, "a.weight", 0, half, s0, 1, &v[0]);
  if (rc == SHARDD_OK)
    rc = shardd_view_register(c, b.id, "a.bias", half, a->numel - half, s1, 1,
                              &v[1]);
  shardd_hparams hp = {0};
  hp.set = SHARDD_HP_LR | SHARDD_HP_WEIGHT_DECAY;
  hp.lr = 1e-2;
  hp.weight_decay = 0.1;
  if (a->kind == SHARDD_OPTIM_SGD) {
    hp.set |= SHARDD_HP_MOMENTUM | SHARDD_HP_NESTEROV;
    hp.momentum = 0.9;
    hp.nesterov = 1;
  } else {
    hp.set |= SHARDD_HP_AMSGRAD;
    hp.amsgrad = 1;
  }
  shardd_param_ref refs[2] = {{v[0], "a.weight"}, {v[1], "a.bias"}};
  shardd_param_group g = {refs, 2, {0}};
  uint64_t opt = 0;
  if (rc == SHARDD_OK)
    rc = shardd_optimizer_register(c, "opt", a->kind, &hp, &g, 1, &opt);
  if (rc != SHARDD_OK) {
    snprintf(a->err, sizeof a->err, "setup: %s: %s", shardd_err_name(rc),
             shardd_last_error(c));
    shardd_close(c);
    return NULL;
  }
  a->is_device = b.is_device;
  size_t shard_bytes = b.shard_numel * esz, full = b.padded_numel * esz;
  unsigned char *host = malloc(full);
  uint64_t st = a->seed * 1000003u + a->rank;
  fill(&st, host, a->dtype, b.shard_numel);
  put(&b, b.shard, host, shard_bytes);
  for (int s = 0; s < STEPS && rc == SHARDD_OK; s++) {
    fill(&st, host, a->dtype, b.padded_numel);
    put(&b, b.grad, host, full);
    rc = shardd_scatter(c, b.id, SHARDD_REDUCE_MEAN);
    if (rc == SHARDD_OK && (a->flags & RUN_ACCUMULATE)) {
      fill(&st, host, a->dtype, b.padded_numel);
      put(&b, b.grad, host, full);
      rc = shardd_scatter_accumulate(c, b.id, SHARDD_REDUCE_MEAN);
    }
    if (rc == SHARDD_OK)
      rc = shardd_step(c, opt, NULL, NULL);
    if (rc == SHARDD_OK)
      rc = shardd_gather(c, b.id);
    if (rc == SHARDD_OK && s == 1 && (a->flags & RUN_REWRITE)) {
      fill(&st, host, a->dtype, b.shard_numel);
      put(&b, b.shard, host, shard_bytes);
    }
  }
  if (rc != SHARDD_OK) {
    snprintf(a->err, sizeof a->err, "step loop: %s: %s", shardd_err_name(rc),
             shardd_last_error(c));
  } else {
    a->gathered = malloc(full);
    a->reduced = malloc(b.shard_numel * 4);
    get(&b, a->gathered, b.gather, full);
    get(&b, a->reduced, b.reduced, b.shard_numel * 4);
  }
  free(host);
  shardd_close(c);
  return NULL;
}

/* Runs the job on a daemon with args, world ranks as threads. */
static void run_job_flags(const char *const *args, uint32_t world,
                          shardd_dtype dt, shardd_optim_kind kind,
                          uint64_t numel, int flags, rank_run *out) {
  test_daemon d;
  test_daemon_start(&d, args);
  pthread_t th[WORLD_MAX];
  for (uint32_t r = 0; r < world; r++) {
    memset(&out[r], 0, sizeof out[r]);
    out[r] = (rank_run){.sock = d.sock, .job = "cuda-e2e", .rank = r,
                        .world = world, .dtype = dt, .kind = kind,
                        .numel = numel, .seed = 7, .flags = flags};
    pthread_create(&th[r], NULL, run_rank, &out[r]);
  }
  for (uint32_t r = 0; r < world; r++)
    pthread_join(th[r], NULL);
  for (uint32_t r = 0; r < world; r++)
    if (out[r].gathered == NULL)
      test_daemon_dump_log(&d);
  cr_assert_eq(test_daemon_stop(&d), 0, "daemon %s exited badly", args[1]);
  for (uint32_t r = 0; r < world; r++)
    cr_assert_not_null(out[r].gathered, "%s daemon, rank %u: %s", args[1], r,
                       out[r].err);
}

static void run_job(const char *const *args, uint32_t world, shardd_dtype dt,
                    shardd_optim_kind kind, uint64_t numel, rank_run *out) {
  run_job_flags(args, world, dt, kind, numel, 0, out);
}

static void compare_flags(shardd_dtype dt, shardd_optim_kind kind,
                          uint32_t world, uint64_t numel, int flags) {
  need_gpu();
  static const char *const cuda_args[] = {"--backend", "cuda", "--devices",
                                          "1", NULL};
  static const char *const host_args[] = {"--backend", "host", "--devices",
                                          "1", NULL};
  rank_run cu[WORLD_MAX], ho[WORLD_MAX];
  run_job_flags(cuda_args, world, dt, kind, numel, flags, cu);
  run_job_flags(host_args, world, dt, kind, numel, flags, ho);
  uint64_t shard = (numel + world - 1) / world;
  size_t full = shard * world * shardd_dtype_size(dt);
  for (uint32_t r = 0; r < world; r++) {
    cr_assert(cu[r].is_device, "cuda daemon handed out host memory");
    cr_assert(!ho[r].is_device);
    size_t bad = 0;
    for (size_t i = 0; i < full; i++)
      bad += cu[r].gathered[i] != ho[r].gathered[i];
    cr_expect_eq(bad, 0, "rank %u: %zu of %zu gathered bytes differ", r, bad,
                 full);
    bad = 0;
    for (size_t i = 0; i < shard * 4; i++)
      bad += cu[r].reduced[i] != ho[r].reduced[i];
    cr_expect_eq(bad, 0, "rank %u: %zu reduced-gradient bytes differ", r, bad);
    free(cu[r].gathered);
    free(cu[r].reduced);
    free(ho[r].gathered);
    free(ho[r].reduced);
  }
}

static void compare(shardd_dtype dt, shardd_optim_kind kind, uint32_t world,
                    uint64_t numel) {
  compare_flags(dt, kind, world, numel, 0);
}

/* Gradient accumulation (two backwards a step) and a trainer's write into
 * its 16-bit shard after a step: the cuda backend adds and adopts as the
 * host does, every byte. */
Test(server_cuda, accumulate_and_adopt_bf16_two_ranks_match_host, .timeout = 120) {
  compare_flags(SHARDD_DTYPE_BF16, SHARDD_OPTIM_ADAMW, 2, 100003,
                RUN_ACCUMULATE | RUN_REWRITE);
}

Test(server_cuda, accumulate_fp32_one_rank_matches_host, .timeout = 120) {
  compare_flags(SHARDD_DTYPE_FP32, SHARDD_OPTIM_SGD, 1, 30001, RUN_ACCUMULATE);
}

Test(server_cuda, adamw_fp32_one_rank_matches_host, .timeout = 120) {
  compare(SHARDD_DTYPE_FP32, SHARDD_OPTIM_ADAMW, 1, 300001);
}

Test(server_cuda, adam_bf16_two_ranks_one_gpu_matches_host, .timeout = 120) {
  compare(SHARDD_DTYPE_BF16, SHARDD_OPTIM_ADAM, 2, 100003);
}

Test(server_cuda, sgd_fp16_two_ranks_one_gpu_matches_host, .timeout = 120) {
  compare(SHARDD_DTYPE_FP16, SHARDD_OPTIM_SGD, 2, 70001);
}

/* The shard is device memory of the daemon's; a rank that reconnects
 * (--job-linger) attaches to the same bytes through a fresh IPC handle, and
 * status names the GPU. */
Test(server_cuda, reattach_and_status, .timeout = 120) {
  need_gpu();
  test_daemon d;
  test_daemon_start(&d, (const char *const[]){"--backend", "cuda", "--devices",
                                              "1", "--job-linger", "30", NULL});
  float vals[1000], back[1000];
  uint64_t st = 11;
  fill(&st, vals, SHARDD_DTYPE_FP32, 1000);
  shardd_client_t *c = test_connect(&d, "lingers", 0, 1);
  cr_assert_str_eq(shardd_daemon_backend(c), "cuda");
  shardd_buffer_info b;
  cr_assert_eq(shardd_buffer_register(c, "w", SHARDD_DTYPE_FP32, 1000, &b),
               SHARDD_OK, "%s", shardd_last_error(c));
  cr_assert(b.is_device);
  cr_assert_eq(b.device, 0);
  put(&b, b.shard, vals, sizeof vals);
  shardd_close(c); /* closes the IPC mappings */

  c = test_connect(&d, "lingers", 0, 1);
  shardd_buffer_info b2;
  cr_assert_eq(shardd_buffer_register(c, "w", SHARDD_DTYPE_FP32, 1000, &b2),
               SHARDD_OK, "%s", shardd_last_error(c));
  cr_assert_eq(b2.created, 0, "attached, not created");
  cr_assert_eq(b2.id, b.id);
  get(&b2, back, b2.shard, sizeof back);
  cr_assert_eq(memcmp(vals, back, sizeof vals), 0, "shard bytes lost");
  cr_assert_eq(shardd_gather(c, b2.id), SHARDD_OK, "%s", shardd_last_error(c));
  get(&b2, back, b2.gather, sizeof back);
  cr_assert_eq(memcmp(vals, back, sizeof vals), 0, "gather differs from shard");
  shardd_close(c);

  shardd_client_t *ctl = test_connect(&d, NULL, 0, 1);
  char *text = NULL;
  cr_assert_eq(shardd_status_text(ctl, &text), SHARDD_OK);
#ifdef SHARDD_HAVE_CUDA
  struct cudaDeviceProp prop;
  cr_assert_eq(cudaGetDeviceProperties(&prop, 0), cudaSuccess);
  cr_assert_not_null(strstr(text, prop.name), "status names no GPU:\n%s", text);
#endif
  shardd_free(text);
  shardd_close(ctl);
  cr_assert_eq(test_daemon_stop(&d), 0);
}

/* Transient areas on the cuda backend: each pool is one cudaMalloc region
 * a trainer opens once by IPC handle; a gather leases areas in it, the
 * gradient area comes zeroed, and the scatter's mean lands in the reduced
 * shards, as on the host backend. */
typedef struct {
  const char *sock;
  uint32_t rank;
  char err[512];
  float gathered[1000];
  float reduced[500];
  int zero_grad, is_device;
} tr_run;

static void *tr_rank(void *p) {
  tr_run *a = p;
  shardd_connect_opts o = SHARDD_CONNECT_OPTS_INIT;
  o.job = "cuda-transient";
  o.rank = a->rank;
  o.world = 2;
  o.transient_areas = 1;
  shardd_client_t *c = NULL;
  if (shardd_connect(a->sock, &o, &c, a->err, sizeof a->err) != SHARDD_OK)
    return NULL;
  shardd_buffer_info b;
  shardd_area ar;
  float vals[1000];
  shardd_err rc = shardd_buffer_register(c, "w", SHARDD_DTYPE_FP32, 1000, &b);
  if (rc == SHARDD_OK) {
    for (int i = 0; i < 500; i++)
      vals[i] = (float)(a->rank * 500 + i);
    put(&b, b.shard, vals, 500 * 4);
    rc = shardd_gather_area(c, b.id, 1, &ar);
  }
  if (rc == SHARDD_OK) {
    a->is_device = b.is_device;
    get(&b, a->gathered, ar.gather, sizeof a->gathered);
    get(&b, vals, ar.grad, sizeof vals);
    a->zero_grad = 1;
    for (int i = 0; i < 1000; i++)
      a->zero_grad &= vals[i] == 0.0f;
    for (int i = 0; i < 1000; i++)
      vals[i] = (float)(a->rank + 1);
    put(&b, ar.grad, vals, sizeof vals);
    rc = shardd_scatter(c, b.id, SHARDD_REDUCE_MEAN);
  }
  if (rc == SHARDD_OK)
    rc = shardd_release(c, b.id);
  if (rc == SHARDD_OK)
    get(&b, a->reduced, b.reduced, sizeof a->reduced);
  if (rc != SHARDD_OK)
    snprintf(a->err, sizeof a->err, "%s: %s", shardd_err_name(rc), shardd_last_error(c));
  shardd_close(c);
  return NULL;
}

Test(server_cuda, transient_areas_lease_from_an_ipc_pool, .timeout = 120) {
  need_gpu();
  test_daemon d;
  test_daemon_start(&d, (const char *const[]){"--backend", "cuda", "--devices", "1", NULL});
  tr_run r[2] = {{.sock = d.sock, .rank = 0}, {.sock = d.sock, .rank = 1}};
  pthread_t th[2];
  for (int i = 0; i < 2; i++)
    pthread_create(&th[i], NULL, tr_rank, &r[i]);
  for (int i = 0; i < 2; i++)
    pthread_join(th[i], NULL);
  for (int i = 0; i < 2; i++) {
    cr_assert_str_eq(r[i].err, "", "rank %d: %s", i, r[i].err);
    cr_assert(r[i].is_device);
    cr_assert(r[i].zero_grad, "rank %d: the gradient area came unzeroed", i);
    for (int k = 0; k < 1000; k++)
      cr_assert_eq(r[i].gathered[k], (float)k, "rank %d gathered[%d]", i, k);
    for (int k = 0; k < 500; k++)
      cr_assert_eq(r[i].reduced[k], 1.5f, "rank %d reduced[%d]", i, k);
  }
  cr_assert_eq(test_daemon_stop(&d), 0);
}

/* A cuda job's checkpoint stages device memory to the host: written by a
 * cuda daemon, restored by a host daemon (the files do not depend on the
 * backend), the shards are the cuda run's bytes. */
Test(server_cuda, checkpoint_stages_device_memory, .timeout = 120) {
  need_gpu();
  char ck[128] = "/tmp/shardd-cuda-ck-XXXXXX";
  cr_assert_not_null(mkdtemp(ck));
  strcat(ck, "/ck");
  const char *const cuda_args[] = {"--backend", "cuda", "--devices", "1",
                                   "--checkpoint-on-exit", ck, NULL};
  rank_run cu[2];
  run_job(cuda_args, 2, SHARDD_DTYPE_BF16, SHARDD_OPTIM_ADAM, 1001, cu);
  test_daemon d;
  test_daemon_start(&d, (const char *const[]){"--backend", "host", "--devices", "1",
                                              "--restore", ck, NULL});
  for (uint32_t r = 0; r < 2; r++) {
    shardd_client_t *c = test_connect(&d, "cuda-e2e", r, 2);
    shardd_buffer_info b;
    cr_assert_eq(shardd_buffer_register(c, "flat", SHARDD_DTYPE_BF16, 1001, &b),
                 SHARDD_OK, "%s", shardd_last_error(c));
    cr_assert_eq(b.created, 0, "attached to the restored buffer");
    cr_assert_eq(memcmp(b.shard, cu[r].gathered + (size_t)r * b.shard_numel * 2,
                        b.shard_numel * 2), 0, "rank %u's restored shard differs", r);
    shardd_close(c);
  }
  cr_assert_eq(test_daemon_stop(&d), 0);
  for (uint32_t r = 0; r < 2; r++) {
    free(cu[r].gathered);
    free(cu[r].reduced);
  }
}

/* Without a GPU the cuda backend is refused at start with a clear message,
 * and auto falls back to host — the one part that runs here. */
Test(server_cuda, no_gpu_refused_or_falls_back, .timeout = 120) {
  if (have_gpu())
    cr_skip_test("a CUDA device is present");
  test_daemon d;
  test_daemon_start(&d, (const char *const[]){"--backend", "auto", NULL});
  shardd_client_t *c = test_connect(&d, NULL, 0, 1);
  cr_assert_str_eq(shardd_daemon_backend(c), "host");
  shardd_close(c);
  cr_assert_eq(test_daemon_stop(&d), 0);

  char cmd[512], *out = NULL;
  const char *bin = test_bin("SHARDD_BIN", "build/shardd");
  char dir[64] = "/tmp/shardd-cuda-XXXXXX";
  cr_assert_not_null(mkdtemp(dir));
  snprintf(cmd, sizeof cmd, "%s --backend cuda --socket %s/x.sock >%s/o 2>&1",
           bin, dir, dir);
  int st = system(cmd);
  cr_assert(WIFEXITED(st) && WEXITSTATUS(st) != 0,
            "shardd --backend cuda started without a GPU");
  char path[128];
  snprintf(path, sizeof path, "%s/o", dir);
  out = test_slurp(path);
  cr_assert_not_null(out);
#ifdef SHARDD_HAVE_CUDA
  cr_assert_not_null(strstr(out, "no CUDA device"), "message: %s", out);
#else
  cr_assert_not_null(strstr(out, "cuda"), "message: %s", out);
#endif
  free(out);
  unlink(path);
  rmdir(dir);
}
