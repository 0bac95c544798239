/* gpu_bench.c — the cuda backend's gather / scatter / step against a
 * device-to-device cudaMemcpy measured in the same run (bench/gpu_check.sh
 * runs it on a machine with a GPU).
 *
 * It drives the backend ops exactly as collective.c does — one task per
 * rank, all ranks' tasks at once on their own threads, each rank's block
 * laid out as shard | reduced (fp32) | gather area | gradient area — for a
 * world of WORLD ranks placed round-robin on the daemon's GPUs, and reports
 * the median of REPS runs as memory traffic (bytes read + bytes written per
 * second) beside memcpy's traffic (2 x bytes copied per second):
 *   gather: every rank copies every shard into its gather area;
 *   scatter: every rank's shard of the reduced gradient = mean over ranks;
 *   step: Adam (fp32 params) / AdamW (bf16 params, fp32 master) per shard.
 * and then the backend's NCCL path as collective.c uses it for a job with a
 * rank per GPU (allgather / reduce_scatter over min(WORLD, GPUs) ranks, one
 * call for the whole collective; with one GPU that is a one-rank
 * communicator, i.e. NCCL's copy and fp32 widen+sum overheads alone).
 * Environment: GPU_BENCH_MIB (parameter size, default 256), GPU_BENCH_WORLD
 * (default 4). Benchmarks assert nothing; built without CUDA this prints
 * "built without CUDA" and exits 0. */
#ifndef SHARDD_HAVE_CUDA
#include <stdio.h>

int main(void) {
  printf("gpu_bench: built without CUDA (make CUDA=1)\n");
  return 0;
}
#else
#define CUDA_API_PER_THREAD_DEFAULT_STREAM 1

#include <cuda_runtime_api.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "backend.h"
#include "optim.h"

#define REPS 10
#define MAX_WORLD 64

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static int cmp_d(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

static double median(double *v, int n) {
  qsort(v, (size_t)n, sizeof *v, cmp_d);
  return v[n / 2];
}

typedef struct {
  shardd__backend *b;
  int world;
  shardd_dtype dtype;
  size_t esz, numel, shard; /* numel = world * shard */
  size_t shard_off, reduced_off, gather_off, grad_off;
  shardd__region *blk[MAX_WORLD];
  shardd__region *st[MAX_WORLD]; /* master | m | v */
  size_t st_offs[3], master_off;
  shardd__hp hp;
  uint64_t step;
} world_t;

typedef struct {
  world_t *w;
  int rank, kind;
  shardd_err rc;
} task_t;

enum { K_GATHER, K_SCATTER, K_STEP };

static void *task_main(void *arg) {
  task_t *t = arg;
  world_t *w = t->w;
  shardd__backend *b = w->b;
  int r = t->rank;
  size_t bytes = w->shard * w->esz;
  if (t->kind == K_GATHER) {
    for (int q = 0; q < w->world && t->rc == SHARDD_OK; q++)
      t->rc = b->ops->copy(b, w->blk[r], w->gather_off + (size_t)q * bytes,
                           w->blk[q], w->shard_off, bytes);
  } else if (t->kind == K_SCATTER) {
    size_t offs[MAX_WORLD];
    for (int q = 0; q < w->world; q++)
      offs[q] = w->grad_off + (size_t)r * bytes;
    t->rc = b->ops->reduce(b, w->dtype, (float)w->world, w->blk[r],
                           w->reduced_off, w->blk, offs, w->world, w->shard);
  } else {
    int wide = w->dtype != SHARDD_DTYPE_FP32;
    t->rc = b->ops->update(b, &w->hp, w->step, w->dtype, w->blk[r],
                           w->shard_off, wide ? w->st[r] : NULL, w->master_off,
                           w->blk[r], w->reduced_off, 1.0f, w->st[r],
                           w->st_offs, w->shard);
  }
  return NULL;
}

/* One collective: all ranks' tasks at once; returns seconds, < 0 on error. */
static double run_once(world_t *w, int kind) {
  pthread_t th[MAX_WORLD];
  task_t t[MAX_WORLD];
  double t0 = now_s();
  for (int r = 0; r < w->world; r++) {
    t[r] = (task_t){w, r, kind, SHARDD_OK};
    if (pthread_create(&th[r], NULL, task_main, &t[r]) != 0)
      return -1;
  }
  for (int r = 0; r < w->world; r++)
    pthread_join(th[r], NULL);
  double dt = now_s() - t0;
  for (int r = 0; r < w->world; r++)
    if (t[r].rc != SHARDD_OK) {
      fprintf(stderr, "gpu_bench: rank %d: %s\n", r, shardd_strerror(t[r].rc));
      return -1;
    }
  return dt;
}

static double timed(world_t *w, int kind) {
  double v[REPS];
  for (int i = 0; i < 2; i++) /* warm up */
    if (run_once(w, kind) < 0)
      return -1;
  for (int i = 0; i < REPS; i++) {
    if (kind == K_STEP)
      w->step++;
    v[i] = run_once(w, kind);
    if (v[i] < 0)
      return -1;
  }
  return median(v, REPS);
}

static size_t up(size_t n) { return (n + 4095) / 4096 * 4096; }

static int world_setup(world_t *w, shardd__backend *b, int world,
                       shardd_dtype dt, size_t param_bytes) {
  char err[256];
  memset(w, 0, sizeof *w);
  w->b = b;
  w->world = world;
  w->dtype = dt;
  w->esz = shardd_dtype_size(dt);
  w->shard = param_bytes / w->esz / (size_t)world;
  w->numel = w->shard * (size_t)world;
  w->shard_off = 0;
  w->reduced_off = up(w->shard * w->esz);
  w->gather_off = up(w->reduced_off + w->shard * 4);
  w->grad_off = up(w->gather_off + w->numel * w->esz);
  size_t blk = up(w->grad_off + w->numel * w->esz);
  size_t arr = up(w->shard * 4);
  w->master_off = 0;
  w->st_offs[0] = arr;
  w->st_offs[1] = 2 * arr;
  w->st_offs[2] = 3 * arr;
  shardd__hp_defaults(dt == SHARDD_DTYPE_FP32 ? SHARDD_OPTIM_ADAM
                                              : SHARDD_OPTIM_ADAMW,
                      &w->hp);
  w->step = 1;
  for (int r = 0; r < world; r++) {
    int dev = r % b->ndevices;
    if (b->ops->alloc(b, dev, blk, "bench", &w->blk[r], err, sizeof err) !=
            SHARDD_OK ||
        b->ops->alloc(b, dev, 3 * arr, "bench-state", &w->st[r], err,
                      sizeof err) != SHARDD_OK) {
      fprintf(stderr, "gpu_bench: %s\n", err);
      return -1;
    }
  }
  /* nonzero data: a gradient of ones everywhere (regions start zeroed) */
  float *ones = malloc(w->shard * 4);
  if (ones == NULL)
    return -1;
  for (size_t i = 0; i < w->shard; i++)
    ones[i] = 1.0f;
  for (int r = 0; r < world; r++) {
    cudaSetDevice(w->blk[r]->device);
    cudaMemcpy((char *)w->blk[r]->ptr + w->reduced_off, ones, w->shard * 4,
               cudaMemcpyHostToDevice);
    cudaMemset((char *)w->blk[r]->ptr + w->grad_off, 0x3c, w->numel * w->esz);
  }
  free(ones);
  return 0;
}

static void world_free(world_t *w) {
  for (int r = 0; r < w->world; r++) {
    if (w->blk[r])
      w->b->ops->free(w->b, w->blk[r]);
    if (w->st[r])
      w->b->ops->free(w->b, w->st[r]);
  }
}

/* The NCCL rows: one allgather / reduce_scatter for the whole world. */
static double nccl_once(world_t *w, void *comm, int kind) {
  shardd__backend *b = w->b;
  char err[512] = "";
  double t0 = now_s();
  shardd_err rc =
      kind == K_GATHER
          ? b->ops->allgather(b, comm, w->blk, w->shard_off, w->blk,
                              w->gather_off, w->shard * w->esz, err, sizeof err)
          : b->ops->reduce_scatter(b, comm, w->dtype, (float)w->world, w->blk,
                                   w->grad_off, w->blk, w->reduced_off,
                                   w->shard, err, sizeof err);
  double dt = now_s() - t0;
  if (rc != SHARDD_OK) {
    fprintf(stderr, "gpu_bench: nccl %s: %s\n",
            kind == K_GATHER ? "allgather" : "reduce_scatter", err);
    return -1;
  }
  return dt;
}

static double nccl_timed(world_t *w, void *comm, int kind) {
  double v[REPS];
  for (int i = 0; i < 2; i++)
    if (nccl_once(w, comm, kind) < 0)
      return -1;
  for (int i = 0; i < REPS; i++)
    if ((v[i] = nccl_once(w, comm, kind)) < 0)
      return -1;
  return median(v, REPS);
}

/* gather and scatter through NCCL over nw ranks, rank r on GPU r */
static int nccl_rows(shardd__backend *b, int nw, shardd_dtype dt,
                     size_t param_bytes, double memcpy_traffic) {
  if (b->ops->comm_create == NULL)
    return 0;
  world_t w;
  if (world_setup(&w, b, nw, dt, param_bytes) != 0) {
    world_free(&w);
    return 1;
  }
  int devs[MAX_WORLD];
  for (int r = 0; r < nw; r++)
    devs[r] = r;
  void *comm = NULL;
  char err[512];
  if (b->ops->comm_create(b, devs, nw, &comm, err, sizeof err) != SHARDD_OK) {
    fprintf(stderr, "gpu_bench: comm_create over %d GPUs: %s\n", nw, err);
    world_free(&w);
    return 1;
  }
  const char *dn = dt == SHARDD_DTYPE_FP32 ? "fp32" : "bf16";
  double n = (double)w.numel, es = (double)w.esz, W = (double)nw;
  struct {
    const char *what;
    int kind;
    double traffic; /* as the per-rank rows count it */
  } rows[2] = {{"nccl gather", K_GATHER, 2.0 * W * n * es},
               {"nccl scatter (mean)", K_SCATTER, W * n * es + n * 4.0}};
  int rc = 0;
  for (int i = 0; i < 2 && rc == 0; i++) {
    double t = nccl_timed(&w, comm, rows[i].kind);
    if (t < 0) {
      rc = 1;
      break;
    }
    char label[64];
    snprintf(label, sizeof label, "%s %s x%d", rows[i].what, dn, nw);
    printf("%-24s %9.3f ms %8.1f GB/s read+write = %.2fx memcpy\n", label,
           t * 1e3, rows[i].traffic / t / 1e9,
           rows[i].traffic / t / memcpy_traffic);
  }
  b->ops->comm_destroy(b, comm);
  world_free(&w);
  return rc;
}

int main(void) {
  if (shardd__cuda_device_count() == 0) {
    printf("gpu_bench: no CUDA device\n");
    return 0;
  }
  const char *e = getenv("GPU_BENCH_MIB");
  size_t mib = e && atoi(e) > 0 ? (size_t)atoi(e) : 256;
  e = getenv("GPU_BENCH_WORLD");
  int world = e && atoi(e) > 0 ? atoi(e) : 4;
  if (world > MAX_WORLD)
    world = MAX_WORLD;
  char err[256];
  shardd__backend *b;
  if (shardd__backend_cuda_create(0, &b, err, sizeof err) != SHARDD_OK) {
    fprintf(stderr, "gpu_bench: %s\n", err);
    return 1;
  }
  shardd__device_info di;
  b->ops->device_info(b, 0, &di);
  size_t param_bytes = mib << 20;
  printf("gpu_bench: %s x%d (%.1f GiB), world %d, parameter %zu MiB\n",
         di.name, b->ndevices, (double)di.capacity_bytes / (1 << 30), world,
         mib);

  /* the reference: one device-to-device cudaMemcpy of the parameter size */
  void *src = NULL, *dst = NULL;
  cudaSetDevice(0);
  if (cudaMalloc(&src, param_bytes) != cudaSuccess ||
      cudaMalloc(&dst, param_bytes) != cudaSuccess) {
    fprintf(stderr, "gpu_bench: cudaMalloc of %zu MiB failed\n", 2 * mib);
    return 1;
  }
  cudaMemset(src, 1, param_bytes);
  double v[REPS];
  for (int i = -2; i < REPS; i++) {
    double t0 = now_s();
    cudaMemcpyAsync(dst, src, param_bytes, cudaMemcpyDeviceToDevice,
                    cudaStreamPerThread);
    cudaStreamSynchronize(cudaStreamPerThread);
    if (i >= 0)
      v[i] = now_s() - t0;
  }
  cudaError_t ce = cudaGetLastError();
  if (ce != cudaSuccess) {
    fprintf(stderr, "gpu_bench: memcpy: %s\n", cudaGetErrorString(ce));
    return 1;
  }
  double tm = median(v, REPS);
  double memcpy_traffic = 2.0 * (double)param_bytes / tm;
  cudaFree(src);
  cudaFree(dst);
  printf("%-24s %9.3f ms %8.1f GB/s copied, %8.1f GB/s read+write\n",
         "memcpy d2d (reference)", tm * 1e3, (double)param_bytes / tm / 1e9,
         memcpy_traffic / 1e9);

  int rc = 0;
  shardd_dtype dts[2] = {SHARDD_DTYPE_FP32, SHARDD_DTYPE_BF16};
  for (int d = 0; d < 2 && rc == 0; d++) {
    world_t w;
    if (world_setup(&w, b, world, dts[d], param_bytes) != 0) {
      world_free(&w);
      rc = 1;
      break;
    }
    const char *dn = dts[d] == SHARDD_DTYPE_FP32 ? "fp32" : "bf16";
    double n = (double)w.numel, es = (double)w.esz, W = (double)world;
    struct {
      const char *what;
      int kind;
      double traffic; /* bytes read + written by one collective */
    } rows[3] = {
        /* every rank reads every shard and writes it into its gather area */
        {"gather", K_GATHER, 2.0 * W * n * es},
        /* each rank reads world shards of gradient, writes one fp32 shard */
        {"scatter (mean)", K_SCATTER, W * n * es + n * 4.0},
        /* Adam fp32: p rw, g r, m rw, v rw = 28 B; AdamW bf16 with master:
         * master rw, g r, m rw, v rw, param w = 30 B */
        {dts[d] == SHARDD_DTYPE_FP32 ? "step adam" : "step adamw+master",
         K_STEP, n * (dts[d] == SHARDD_DTYPE_FP32 ? 28.0 : 30.0)},
    };
    for (int i = 0; i < 3; i++) {
      double t = timed(&w, rows[i].kind);
      if (t < 0) {
        rc = 1;
        break;
      }
      char label[64];
      snprintf(label, sizeof label, "%s %s", rows[i].what, dn);
      printf("%-24s %9.3f ms %8.1f GB/s read+write = %.2fx memcpy\n", label,
             t * 1e3, rows[i].traffic / t / 1e9,
             rows[i].traffic / t / memcpy_traffic);
    }
    world_free(&w);
    if (rc == 0)
      rc = nccl_rows(b, world < b->ndevices ? world : b->ndevices, dts[d],
                     param_bytes, memcpy_traffic);
  }
  b->ops->destroy(b);
  return rc;
}
#endif
