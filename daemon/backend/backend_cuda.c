/* backend_cuda.c — the cuda backend: device d of the daemon is CUDA device
 * d (the first --devices GPUs, default all visible), each with its primary
 * context. Regions are cudaMalloc allocations (never managed memory), zeroed
 * with cudaMemset, exported to clients as CUDA IPC handles.
 *
 * Threads: every op first calls cudaSetDevice for the device it works on
 * (libuv worker threads carry no device of their own), and runs on that
 * thread's per-thread default stream (CUDA_API_PER_THREAD_DEFAULT_STREAM
 * below, cudaStreamPerThread for launches), so tasks on different worker
 * threads overlap instead of serialising on the legacy stream. Each op waits
 * for its own stream before returning: ops run on worker threads, so the
 * loop is never blocked, and a task's completion means its memory is written.
 *
 * Bulk data between devices moves with cudaMemcpyPeerAsync; a reduction
 * whose sources sit on a device the destination cannot address directly
 * (no peer access) stages them through a stream-ordered scratch area on the
 * destination. The kernels are in optim_cuda.cu.
 *
 * Whole collectives (allgather, reduce_scatter) run on NCCL: one
 * communicator per job (comm_create: ncclCommInitAll over the devices of the
 * job's ranks, one non-blocking stream per device), each collective one
 * ncclGroupStart/ncclGroupEnd over every rank from the calling worker
 * thread, then cudaStreamSynchronize of every stream on that same thread —
 * the loop is never blocked, and the op returning means the data is there.
 * Reduce-scatter accumulates in fp32: 16-bit gradients are first widened
 * (exactly) into a stream-ordered fp32 staging area, a bounded chunk at a
 * time, and NCCL sums fp32; mean is sum then one division (as the host).
 * NCCL communicators must not be used from two threads at once, and
 * kernels of two communicators on the same GPUs can deadlock when launched
 * in different orders, so every NCCL call of the backend is serialised by
 * one mutex (nccl_mu), held from group start to stream completion. */
#define CUDA_API_PER_THREAD_DEFAULT_STREAM 1

#include "backend.h"

#include <cuda_runtime_api.h>
#include <nccl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "optim_cuda.h"

/* Allocation granularity the used-bytes count is kept in. */
#define CUDA_GRAIN ((size_t)512)
/* Elements per source staged at once when a source is not peer-accessible. */
#define STAGE_ELEMS ((size_t)4 << 20)
/* Bytes of a CUDA IPC handle (CUDA_IPC_HANDLE_SIZE). */
#define IPC_BYTES 64
/* fp32 elements of one device's reduce-scatter staging area (128 MiB). */
#define RS_STAGE_ELEMS ((size_t)32 << 20)

typedef struct {
  char name[64];
  uint64_t total;
  uint64_t used; /* under lock */
  uint64_t peak; /* under lock: the high-water of used */
  uint64_t allocs; /* under lock: regions allocated */
} cuda_dev;

typedef struct {
  pthread_mutex_t lock;
  pthread_mutex_t nccl_mu; /* every NCCL call, group start to completion */
  cuda_dev *dev;
  unsigned char *peer; /* [n*n]: peer[a*n+b] = device a can address b's memory */
} cuda_priv;

static void log_cuda(const char *what, cudaError_t e) {
  fprintf(stderr, "shardd: cuda backend: %s: %s (%s)\n", what,
          cudaGetErrorString(e), cudaGetErrorName(e));
}

/* Maps a CUDA error of an op to the daemon's code, logging the detail the
 * code cannot carry. */
static shardd_err fail(const char *what, cudaError_t e) {
  log_cuda(what, e);
  (void)cudaGetLastError(); /* clear a non-sticky error for the next op */
  return e == cudaErrorMemoryAllocation ? SHARDD_E_NO_MEMORY : SHARDD_E_IO;
}

#define CU(what, call)                                                         \
  do {                                                                         \
    cudaError_t e_ = (call);                                                   \
    if (e_ != cudaSuccess)                                                     \
      return fail(what, e_);                                                   \
  } while (0)

static void *at(shardd__region *r, size_t off) { return (char *)r->ptr + off; }

static shardd_err cuda_alloc(shardd__backend *b, int device, size_t bytes,
                             const char *label, shardd__region **out,
                             char *err, size_t errlen) {
  cuda_priv *cp = b->priv;
  *out = NULL;
  if (device < 0 || device >= b->ndevices) {
    snprintf(err, errlen, "no device %d (cuda backend has %d)", device,
             b->ndevices);
    return SHARDD_E_INVAL;
  }
  size_t sz = (bytes ? bytes : 1);
  sz = (sz + CUDA_GRAIN - 1) / CUDA_GRAIN * CUDA_GRAIN;
  cudaError_t e = cudaSetDevice(device);
  size_t freeb = 0, total = 0;
  if (e == cudaSuccess)
    e = cudaMemGetInfo(&freeb, &total);
  if (e != cudaSuccess) {
    snprintf(err, errlen, "device %d: %s", device, cudaGetErrorString(e));
    (void)cudaGetLastError();
    return SHARDD_E_IO;
  }
  pthread_mutex_lock(&cp->lock);
  uint64_t used = cp->dev[device].used;
  pthread_mutex_unlock(&cp->lock);
  if (sz > freeb) {
    snprintf(err, errlen,
             "device %d (%s): %zu bytes requested, %zu of %zu bytes free "
             "(shardd holds %llu)",
             device, cp->dev[device].name, sz, freeb, total,
             (unsigned long long)used);
    return SHARDD_E_NO_MEMORY;
  }
  void *p = NULL;
  e = cudaMalloc(&p, sz);
  if (e != cudaSuccess) {
    snprintf(err, errlen,
             "device %d (%s): cudaMalloc of %zu bytes%s%s: %s (%zu bytes free)",
             device, cp->dev[device].name, sz, label ? " for " : "",
             label ? label : "", cudaGetErrorString(e), freeb);
    (void)cudaGetLastError();
    return e == cudaErrorMemoryAllocation ? SHARDD_E_NO_MEMORY : SHARDD_E_IO;
  }
  e = cudaMemsetAsync(p, 0, sz, cudaStreamPerThread);
  if (e == cudaSuccess)
    e = cudaStreamSynchronize(cudaStreamPerThread);
  shardd__region *r = e == cudaSuccess ? calloc(1, sizeof *r) : NULL;
  if (r == NULL) {
    snprintf(err, errlen, "device %d: zeroing %zu bytes: %s", device, sz,
             e != cudaSuccess ? cudaGetErrorString(e) : "out of memory");
    (void)cudaGetLastError();
    cudaFree(p);
    return e != cudaSuccess ? SHARDD_E_IO : SHARDD_E_NO_MEMORY;
  }
  r->device = device;
  r->bytes = sz;
  r->ptr = p;
  r->fd = -1;
  pthread_mutex_lock(&cp->lock);
  cp->dev[device].used += sz;
  cp->dev[device].allocs++;
  if (cp->dev[device].used > cp->dev[device].peak)
    cp->dev[device].peak = cp->dev[device].used;
  pthread_mutex_unlock(&cp->lock);
  *out = r;
  return SHARDD_OK;
}

static void cuda_free_region(shardd__backend *b, shardd__region *r) {
  cuda_priv *cp = b->priv;
  if (r == NULL)
    return;
  cudaError_t e = cudaSetDevice(r->device);
  if (e == cudaSuccess)
    e = cudaFree(r->ptr);
  if (e != cudaSuccess) {
    log_cuda("cudaFree", e);
    (void)cudaGetLastError();
  }
  pthread_mutex_lock(&cp->lock);
  cp->dev[r->device].used -= r->bytes;
  pthread_mutex_unlock(&cp->lock);
  free(r);
}

static shardd_err cuda_export_fd(shardd__backend *b, shardd__region *r,
                                 int *fd) {
  *fd = -1; /* device memory has no descriptor; see export_ipc */
  return SHARDD_E_NO_CUDA;
}

static shardd_err cuda_export_ipc(shardd__backend *b, shardd__region *r,
                                  void *handle, size_t cap, size_t *len) {
  cudaIpcMemHandle_t h;
  *len = 0;
  if (cap < sizeof h)
    return SHARDD_E_INVAL;
  CU("cudaSetDevice", cudaSetDevice(r->device));
  CU("cudaIpcGetMemHandle", cudaIpcGetMemHandle(&h, r->ptr));
  memcpy(handle, &h, sizeof h);
  *len = sizeof h;
  return SHARDD_OK;
}

static shardd_err cuda_copy(shardd__backend *b, shardd__region *dst,
                            size_t dst_off, shardd__region *src,
                            size_t src_off, size_t bytes) {
  if (bytes == 0)
    return SHARDD_OK;
  CU("cudaSetDevice", cudaSetDevice(dst->device));
  if (dst->device == src->device)
    CU("cudaMemcpyAsync",
       cudaMemcpyAsync(at(dst, dst_off), at(src, src_off), bytes,
                       cudaMemcpyDeviceToDevice, cudaStreamPerThread));
  else
    CU("cudaMemcpyPeerAsync",
       cudaMemcpyPeerAsync(at(dst, dst_off), dst->device, at(src, src_off),
                           src->device, bytes, cudaStreamPerThread));
  CU("copy", cudaStreamSynchronize(cudaStreamPerThread));
  return SHARDD_OK;
}

static shardd_err cuda_read(shardd__backend *b, shardd__region *r, size_t off,
                            void *dst, size_t bytes) {
  if (bytes == 0)
    return SHARDD_OK;
  CU("cudaSetDevice", cudaSetDevice(r->device));
  CU("cudaMemcpyAsync (to host)",
     cudaMemcpyAsync(dst, at(r, off), bytes, cudaMemcpyDeviceToHost,
                     cudaStreamPerThread));
  CU("read", cudaStreamSynchronize(cudaStreamPerThread));
  return SHARDD_OK;
}

static shardd_err cuda_write(shardd__backend *b, shardd__region *r, size_t off,
                             const void *src, size_t bytes) {
  if (bytes == 0)
    return SHARDD_OK;
  CU("cudaSetDevice", cudaSetDevice(r->device));
  CU("cudaMemcpyAsync (from host)",
     cudaMemcpyAsync(at(r, off), src, bytes, cudaMemcpyHostToDevice,
                     cudaStreamPerThread));
  CU("write", cudaStreamSynchronize(cudaStreamPerThread));
  return SHARDD_OK;
}

static int can_address(shardd__backend *b, int from, int to) {
  cuda_priv *cp = b->priv;
  return from == to || cp->peer[from * b->ndevices + to];
}

static shardd_err cuda_reduce(shardd__backend *b, shardd_dtype dtype,
                              float divisor, shardd__region *dst,
                              size_t dst_off, shardd__region *const *srcs,
                              const size_t *src_offs, int nsrc, size_t n) {
  size_t esz = shardd_dtype_size(dtype);
  if (esz == 0)
    return SHARDD_E_DTYPE;
  if (n == 0)
    return SHARDD_OK;
  int d = dst->device;
  CU("cudaSetDevice", cudaSetDevice(d));
  float *acc = at(dst, dst_off);
  cudaStream_t st = cudaStreamPerThread;
  if (nsrc == 0) {
    CU("cudaMemsetAsync", cudaMemsetAsync(acc, 0, n * sizeof *acc, st));
    CU("reduce", cudaStreamSynchronize(st));
    return SHARDD_OK;
  }
  int staged = 0;
  for (int i = 0; i < nsrc; i++)
    staged += !can_address(b, d, srcs[i]->device);
  /* Without staging one pass covers everything; with it, STAGE_ELEMS at a
   * time through up to MAX_SRC scratch slots. */
  size_t chunk = staged ? STAGE_ELEMS : n;
  int slots = nsrc < SHARDD__CUDA_REDUCE_MAX_SRC ? nsrc : SHARDD__CUDA_REDUCE_MAX_SRC;
  char *scratch = NULL;
  if (staged)
    CU("cudaMallocAsync",
       cudaMallocAsync((void **)&scratch, (size_t)slots * chunk * esz, st));
  cudaError_t e = cudaSuccess;
  const char *what = "reduce kernel";
  int do_div = divisor != 1.0f; /* as the host: no division by 1 at all */
  for (size_t base = 0; base < n && e == cudaSuccess; base += chunk) {
    size_t m = n - base < chunk ? n - base : chunk;
    for (int g = 0; g < nsrc && e == cudaSuccess;
         g += SHARDD__CUDA_REDUCE_MAX_SRC) {
      int k = nsrc - g < SHARDD__CUDA_REDUCE_MAX_SRC ? nsrc - g
                                                     : SHARDD__CUDA_REDUCE_MAX_SRC;
      const void *ptrs[SHARDD__CUDA_REDUCE_MAX_SRC];
      for (int j = 0; j < k && e == cudaSuccess; j++) {
        shardd__region *s = srcs[g + j];
        const char *p = (const char *)s->ptr + src_offs[g + j] + base * esz;
        if (can_address(b, d, s->device)) {
          ptrs[j] = p;
        } else {
          char *slot = scratch + (size_t)j * chunk * esz;
          e = cudaMemcpyPeerAsync(slot, d, p, s->device, m * esz, st);
          what = "cudaMemcpyPeerAsync (staging)";
          ptrs[j] = slot;
        }
      }
      if (e != cudaSuccess)
        break;
      int last = g + k >= nsrc;
      e = (cudaError_t)shardd__cuda_reduce((int)dtype, acc + base, ptrs, k,
                                           g == 0, last && do_div, divisor, m,
                                           st);
      what = "reduce kernel";
    }
  }
  if (scratch) {
    cudaError_t e2 = cudaFreeAsync(scratch, st);
    if (e == cudaSuccess && e2 != cudaSuccess) {
      e = e2;
      what = "cudaFreeAsync";
    }
  }
  cudaError_t e3 = cudaStreamSynchronize(st);
  if (e == cudaSuccess && e3 != cudaSuccess) {
    e = e3;
    what = "reduce";
  }
  if (e != cudaSuccess)
    return fail(what, e);
  return SHARDD_OK;
}

/* dst += the sources' reduce: the reduce goes to a stream-ordered fp32
 * scratch area first, then one addition, so each element is
 * acc + (sum / divisor) rounded as the host's reduce_add rounds it. */
static shardd_err cuda_reduce_add(shardd__backend *b, shardd_dtype dtype,
                                  float divisor, shardd__region *dst,
                                  size_t dst_off, shardd__region *const *srcs,
                                  const size_t *src_offs, int nsrc, size_t n) {
  if (shardd_dtype_size(dtype) == 0)
    return SHARDD_E_DTYPE;
  if (n == 0 || nsrc == 0)
    return SHARDD_OK;
  cudaStream_t st = cudaStreamPerThread;
  CU("cudaSetDevice", cudaSetDevice(dst->device));
  float *tmp = NULL;
  CU("cudaMallocAsync (accumulating reduce)",
     cudaMallocAsync((void **)&tmp, n * sizeof *tmp, st));
  shardd__region scratch = {.device = dst->device, .bytes = n * sizeof *tmp,
                            .ptr = tmp, .fd = -1};
  shardd_err rc = cuda_reduce(b, dtype, divisor, &scratch, 0, srcs, src_offs,
                              nsrc, n);
  cudaError_t e = cudaSuccess;
  const char *what = "add kernel";
  if (rc == SHARDD_OK)
    e = (cudaError_t)shardd__cuda_add(at(dst, dst_off), tmp, n, st);
  cudaError_t e2 = cudaFreeAsync(tmp, st);
  if (e == cudaSuccess && e2 != cudaSuccess) {
    e = e2;
    what = "cudaFreeAsync (accumulating reduce)";
  }
  cudaError_t e3 = cudaStreamSynchronize(st);
  if (e == cudaSuccess && e3 != cudaSuccess) {
    e = e3;
    what = "accumulating reduce";
  }
  if (rc != SHARDD_OK)
    return rc;
  return e == cudaSuccess ? SHARDD_OK : fail(what, e);
}

static shardd_err cuda_sumsq(shardd__backend *b, shardd__region *r, size_t off,
                             size_t n, double *out) {
  *out = 0;
  if (n == 0)
    return SHARDD_OK;
  double part[SHARDD__CUDA_SUMSQ_BLOCKS];
  double *dpart = NULL;
  cudaStream_t st = cudaStreamPerThread;
  CU("cudaSetDevice", cudaSetDevice(r->device));
  CU("cudaMallocAsync", cudaMallocAsync((void **)&dpart, sizeof part, st));
  cudaError_t e = (cudaError_t)shardd__cuda_sumsq(at(r, off), n, dpart, st);
  if (e == cudaSuccess)
    e = cudaMemcpyAsync(part, dpart, sizeof part, cudaMemcpyDeviceToHost, st);
  cudaError_t e2 = cudaFreeAsync(dpart, st);
  cudaError_t e3 = cudaStreamSynchronize(st);
  if (e == cudaSuccess)
    e = e2 != cudaSuccess ? e2 : e3;
  if (e != cudaSuccess)
    return fail("sumsq", e);
  double s = 0;
  for (int i = 0; i < SHARDD__CUDA_SUMSQ_BLOCKS; i++)
    s += part[i];
  *out = s;
  return SHARDD_OK;
}

static shardd_err cuda_update(shardd__backend *b, const shardd__hp *hp,
                              uint64_t step, shardd_dtype dtype,
                              shardd__region *param, size_t param_off,
                              shardd__region *master, size_t master_off,
                              shardd__region *grad, size_t grad_off,
                              float grad_scale, shardd__region *state,
                              const size_t *state_offs, size_t n) {
  if (n == 0)
    return SHARDD_OK;
  if (hp->kind != SHARDD_OPTIM_SGD && hp->kind != SHARDD_OPTIM_ADAM &&
      hp->kind != SHARDD_OPTIM_ADAMW)
    return SHARDD_E_INVAL;
  if (dtype != SHARDD_DTYPE_FP32 && master == NULL)
    return SHARDD_E_INVAL;
  shardd__cuda_upd k;
  shardd__cuda_fill_upd(hp, step, grad_scale, &k);
  float *st[3] = {NULL, NULL, NULL};
  int ns = shardd__optim_state_count(hp);
  for (int i = 0; i < ns; i++)
    st[i] = at(state, state_offs[i]);
  float *p;
  void *p16 = NULL;
  if (dtype == SHARDD_DTYPE_FP32) {
    p = at(param, param_off);
  } else {
    p = at(master, master_off);
    p16 = at(param, param_off);
  }
  CU("cudaSetDevice", cudaSetDevice(param->device));
  CU("update kernel",
     (cudaError_t)shardd__cuda_update(&k, p, at(grad, grad_off), st[0], st[1],
                                      st[2], (int)dtype, p16, n,
                                      cudaStreamPerThread));
  CU("update", cudaStreamSynchronize(cudaStreamPerThread));
  return SHARDD_OK;
}

static shardd_err cuda_widen(shardd__backend *b, shardd_dtype dtype,
                             shardd__region *master, size_t master_off,
                             shardd__region *param, size_t param_off,
                             size_t n) {
  if (n == 0)
    return SHARDD_OK;
  CU("cudaSetDevice", cudaSetDevice(master->device));
  CU("widen kernel",
     (cudaError_t)shardd__cuda_widen((int)dtype, at(master, master_off),
                                     at(param, param_off), n,
                                     cudaStreamPerThread));
  CU("widen", cudaStreamSynchronize(cudaStreamPerThread));
  return SHARDD_OK;
}

static shardd_err cuda_adopt(shardd__backend *b, shardd_dtype dtype,
                             shardd__region *master, size_t master_off,
                             shardd__region *param, size_t param_off,
                             size_t n) {
  if (n == 0 || dtype == SHARDD_DTYPE_FP32)
    return SHARDD_OK;
  CU("cudaSetDevice", cudaSetDevice(master->device));
  CU("adopt kernel",
     (cudaError_t)shardd__cuda_adopt((int)dtype, at(master, master_off),
                                     at(param, param_off), n,
                                     cudaStreamPerThread));
  CU("adopt", cudaStreamSynchronize(cudaStreamPerThread));
  return SHARDD_OK;
}

static void cuda_device_info(shardd__backend *b, int device,
                             shardd__device_info *out) {
  cuda_priv *cp = b->priv;
  memset(out, 0, sizeof *out);
  if (device < 0 || device >= b->ndevices)
    return;
  snprintf(out->name, sizeof out->name, "%s", cp->dev[device].name);
  out->capacity_bytes = cp->dev[device].total;
  pthread_mutex_lock(&cp->lock);
  out->used_bytes = cp->dev[device].used;
  out->peak_bytes = cp->dev[device].peak;
  out->allocs = cp->dev[device].allocs;
  pthread_mutex_unlock(&cp->lock);
  size_t freeb = 0, total = 0;
  cudaError_t e = cudaSetDevice(device);
  if (e == cudaSuccess)
    e = cudaMemGetInfo(&freeb, &total);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    freeb = out->capacity_bytes > out->used_bytes
                ? out->capacity_bytes - out->used_bytes
                : 0;
  }
  out->free_bytes = freeb;
}

/* ---- NCCL ---------------------------------------------------------------- */

typedef struct {
  int n;
  int *devs;
  ncclComm_t *comms;
  cudaStream_t *streams;
} cuda_comm;

static shardd_err nccl_err(const char *what, ncclResult_t r, ncclComm_t comm,
                           char *err, size_t errlen) {
  const char *last = ncclGetLastError(comm);
  snprintf(err, errlen, "%s: %s%s%s", what, ncclGetErrorString(r),
           last && *last ? ": " : "", last ? last : "");
  fprintf(stderr, "shardd: cuda backend: %s\n", err);
  return SHARDD_E_IO;
}

static shardd_err cuda_err(const char *what, int dev, cudaError_t e, char *err,
                           size_t errlen) {
  snprintf(err, errlen, "%s on device %d: %s (%s)", what, dev,
           cudaGetErrorString(e), cudaGetErrorName(e));
  fprintf(stderr, "shardd: cuda backend: %s\n", err);
  (void)cudaGetLastError();
  return e == cudaErrorMemoryAllocation ? SHARDD_E_NO_MEMORY : SHARDD_E_IO;
}

/* Frees cc; its communicators only when have_comms. Under nccl_mu when so. */
static void comm_free(cuda_comm *cc, int have_comms) {
  if (cc == NULL)
    return;
  if (have_comms) {
    /* Several communicators driven by one thread: finalize them in one
     * group (each finalize waits for its peers), then free each. */
    ncclResult_t r = ncclGroupStart();
    for (int i = 0; i < cc->n && r == ncclSuccess; i++)
      r = ncclCommFinalize(cc->comms[i]);
    ncclResult_t r2 = ncclGroupEnd();
    if (r != ncclSuccess || r2 != ncclSuccess)
      fprintf(stderr, "shardd: cuda backend: ncclCommFinalize: %s\n",
              ncclGetErrorString(r != ncclSuccess ? r : r2));
    for (int i = 0; i < cc->n; i++) {
      r = ncclCommDestroy(cc->comms[i]);
      if (r != ncclSuccess)
        fprintf(stderr, "shardd: cuda backend: ncclCommDestroy: %s\n",
                ncclGetErrorString(r));
    }
  }
  for (int i = 0; cc->streams && i < cc->n; i++) {
    if (cc->streams[i] == NULL)
      continue;
    if (cudaSetDevice(cc->devs[i]) != cudaSuccess ||
        cudaStreamDestroy(cc->streams[i]) != cudaSuccess)
      (void)cudaGetLastError();
  }
  free(cc->devs);
  free(cc->comms);
  free(cc->streams);
  free(cc);
}

static shardd_err cuda_comm_create(shardd__backend *b, const int *devs, int n,
                                   void **out, char *err, size_t errlen) {
  cuda_priv *cp = b->priv;
  *out = NULL;
  if (n < 1) {
    snprintf(err, errlen, "a communicator needs at least one rank");
    return SHARDD_E_INVAL;
  }
  for (int i = 0; i < n; i++) {
    if (devs[i] < 0 || devs[i] >= b->ndevices) {
      snprintf(err, errlen, "rank %d: no device %d (cuda backend has %d)", i,
               devs[i], b->ndevices);
      return SHARDD_E_INVAL;
    }
    for (int j = 0; j < i; j++)
      if (devs[j] == devs[i]) {
        snprintf(err, errlen,
                 "ranks %d and %d are both on device %d: NCCL needs one "
                 "rank per GPU", j, i, devs[i]);
        return SHARDD_E_INVAL;
      }
  }
  cuda_comm *cc = calloc(1, sizeof *cc);
  if (cc == NULL || (cc->devs = malloc((size_t)n * sizeof *cc->devs)) == NULL ||
      (cc->comms = calloc((size_t)n, sizeof *cc->comms)) == NULL ||
      (cc->streams = calloc((size_t)n, sizeof *cc->streams)) == NULL) {
    comm_free(cc, 0);
    snprintf(err, errlen, "out of memory");
    return SHARDD_E_NO_MEMORY;
  }
  cc->n = n;
  memcpy(cc->devs, devs, (size_t)n * sizeof *devs);
  for (int i = 0; i < n; i++) {
    cudaError_t e = cudaSetDevice(devs[i]);
    if (e == cudaSuccess)
      e = cudaStreamCreateWithFlags(&cc->streams[i], cudaStreamNonBlocking);
    if (e != cudaSuccess) {
      cc->streams[i] = NULL;
      shardd_err rc = cuda_err("cudaStreamCreate", devs[i], e, err, errlen);
      comm_free(cc, 0);
      return rc;
    }
  }
  pthread_mutex_lock(&cp->nccl_mu);
  ncclResult_t r = ncclCommInitAll(cc->comms, n, devs);
  pthread_mutex_unlock(&cp->nccl_mu);
  if (r != ncclSuccess) {
    shardd_err rc = nccl_err("ncclCommInitAll", r, NULL, err, errlen);
    comm_free(cc, 0);
    return rc;
  }
  *out = cc;
  return SHARDD_OK;
}

static void cuda_comm_destroy(shardd__backend *b, void *comm) {
  cuda_priv *cp = b->priv;
  if (comm == NULL)
    return;
  pthread_mutex_lock(&cp->nccl_mu);
  comm_free(comm, 1);
  pthread_mutex_unlock(&cp->nccl_mu);
}

/* Waits for every stream of cc; the first error is reported. */
static shardd_err comm_sync(cuda_comm *cc, shardd_err rc, char *err,
                            size_t errlen) {
  for (int i = 0; i < cc->n; i++) {
    cudaError_t e = cudaSetDevice(cc->devs[i]);
    if (e == cudaSuccess)
      e = cudaStreamSynchronize(cc->streams[i]);
    if (e != cudaSuccess && rc == SHARDD_OK)
      rc = cuda_err("cudaStreamSynchronize", cc->devs[i], e, err, errlen);
  }
  return rc;
}

static shardd_err cuda_allgather(shardd__backend *b, void *comm,
                                 shardd__region *const *src, size_t src_off,
                                 shardd__region *const *dst, size_t dst_off,
                                 size_t bytes, char *err, size_t errlen) {
  cuda_priv *cp = b->priv;
  cuda_comm *cc = comm;
  if (bytes == 0)
    return SHARDD_OK;
  for (int i = 0; i < cc->n; i++)
    if (src[i]->device != cc->devs[i] || dst[i]->device != cc->devs[i]) {
      snprintf(err, errlen, "allgather: rank %d's regions are not on its "
               "device %d", i, cc->devs[i]);
      return SHARDD_E_INVAL;
    }
  shardd_err rc = SHARDD_OK;
  pthread_mutex_lock(&cp->nccl_mu);
  ncclResult_t r = ncclGroupStart();
  int bad = -1;
  for (int i = 0; i < cc->n && r == ncclSuccess; i++) {
    r = ncclAllGather(at(src[i], src_off), at(dst[i], dst_off), bytes,
                      ncclUint8, cc->comms[i], cc->streams[i]);
    bad = i;
  }
  ncclResult_t r2 = ncclGroupEnd();
  if (r != ncclSuccess)
    rc = nccl_err("ncclAllGather", r, cc->comms[bad < 0 ? 0 : bad], err,
                  errlen);
  else if (r2 != ncclSuccess)
    rc = nccl_err("ncclGroupEnd (allgather)", r2, cc->comms[0], err, errlen);
  rc = comm_sync(cc, rc, err, errlen);
  pthread_mutex_unlock(&cp->nccl_mu);
  return rc;
}

static shardd_err cuda_reduce_scatter(shardd__backend *b, void *comm,
                                      shardd_dtype dtype, float divisor,
                                      shardd__region *const *src,
                                      size_t src_off,
                                      shardd__region *const *dst,
                                      size_t dst_off, size_t n, char *err,
                                      size_t errlen) {
  cuda_priv *cp = b->priv;
  cuda_comm *cc = comm;
  size_t esz = shardd_dtype_size(dtype);
  if (esz == 0) {
    snprintf(err, errlen, "reduce_scatter: unknown dtype %d", (int)dtype);
    return SHARDD_E_DTYPE;
  }
  if (n == 0)
    return SHARDD_OK;
  for (int i = 0; i < cc->n; i++)
    if (src[i]->device != cc->devs[i] || dst[i]->device != cc->devs[i]) {
      snprintf(err, errlen, "reduce_scatter: rank %d's regions are not on "
               "its device %d", i, cc->devs[i]);
      return SHARDD_E_INVAL;
    }
  int w = cc->n;
  if (w < 1) /* comm_create makes none smaller; this tells the compiler */
    return SHARDD_E_INVAL;
  int wide = dtype != SHARDD_DTYPE_FP32;
  int do_div = divisor != 1.0f; /* as the host: no division by 1 at all */
  /* fp32 gradients go to NCCL as they are, in one call; 16-bit ones are
   * widened into [w][m] fp32 staging, m shard elements at a time. */
  size_t m = n;
  if (wide) {
    m = RS_STAGE_ELEMS / (size_t)w;
    if (m == 0)
      m = 1;
    if (m > n)
      m = n;
  }
  shardd_err rc = SHARDD_OK;
  float **stage = calloc((size_t)w, sizeof *stage);
  if (stage == NULL) {
    snprintf(err, errlen, "out of memory");
    return SHARDD_E_NO_MEMORY;
  }
  pthread_mutex_lock(&cp->nccl_mu);
  for (int i = 0; wide && i < w && rc == SHARDD_OK; i++) {
    cudaError_t e = cudaSetDevice(cc->devs[i]);
    if (e == cudaSuccess)
      e = cudaMallocAsync((void **)&stage[i], (size_t)w * m * sizeof(float),
                          cc->streams[i]);
    if (e != cudaSuccess) {
      stage[i] = NULL;
      rc = cuda_err("cudaMallocAsync (reduce-scatter staging)", cc->devs[i],
                    e, err, errlen);
    }
  }
  for (size_t base = 0; base < n && rc == SHARDD_OK; base += m) {
    size_t k = n - base < m ? n - base : m;
    if (wide) {
      /* stage[i][j*k ..] = rank i's gradient elements j*n + base .. +k:
       * the chunk of rank j's shard, in the layout NCCL scatters */
      for (int i = 0; i < w && rc == SHARDD_OK; i++) {
        cudaError_t e = cudaSetDevice(cc->devs[i]);
        for (int j = 0; j < w && e == cudaSuccess; j++)
          e = (cudaError_t)shardd__cuda_widen(
              (int)dtype, stage[i] + (size_t)j * k,
              (const char *)at(src[i], src_off) +
                  ((size_t)j * n + base) * esz,
              k, cc->streams[i]);
        if (e != cudaSuccess)
          rc = cuda_err("widen kernel (reduce-scatter)", cc->devs[i], e, err,
                        errlen);
      }
      if (rc != SHARDD_OK)
        break;
    }
    ncclResult_t r = ncclGroupStart();
    int bad = 0;
    for (int i = 0; i < w && r == ncclSuccess; i++) {
      const void *send = wide ? (const void *)stage[i] : at(src[i], src_off);
      r = ncclReduceScatter(send, (float *)at(dst[i], dst_off) + base, k,
                            ncclFloat32, ncclSum, cc->comms[i],
                            cc->streams[i]);
      bad = i;
    }
    ncclResult_t r2 = ncclGroupEnd();
    if (r != ncclSuccess)
      rc = nccl_err("ncclReduceScatter", r, cc->comms[bad], err, errlen);
    else if (r2 != ncclSuccess)
      rc = nccl_err("ncclGroupEnd (reduce-scatter)", r2, cc->comms[0], err,
                    errlen);
    for (int i = 0; do_div && i < w && rc == SHARDD_OK; i++) {
      /* in place: acc[e] = acc[e] / divisor, element by element */
      float *acc = (float *)at(dst[i], dst_off) + base;
      const void *one[1] = {acc};
      cudaError_t e = cudaSetDevice(cc->devs[i]);
      if (e == cudaSuccess)
        e = (cudaError_t)shardd__cuda_reduce((int)SHARDD_DTYPE_FP32, acc, one,
                                             1, 1, 1, divisor, k,
                                             cc->streams[i]);
      if (e != cudaSuccess)
        rc = cuda_err("divide kernel (reduce-scatter mean)", cc->devs[i], e,
                      err, errlen);
    }
  }
  for (int i = 0; i < w; i++) {
    if (stage[i] == NULL)
      continue;
    cudaError_t e = cudaSetDevice(cc->devs[i]);
    if (e == cudaSuccess)
      e = cudaFreeAsync(stage[i], cc->streams[i]);
    if (e != cudaSuccess && rc == SHARDD_OK)
      rc = cuda_err("cudaFreeAsync (reduce-scatter staging)", cc->devs[i], e,
                    err, errlen);
  }
  rc = comm_sync(cc, rc, err, errlen);
  pthread_mutex_unlock(&cp->nccl_mu);
  free(stage);
  return rc;
}

static void cuda_destroy(shardd__backend *b) {
  cuda_priv *cp = b->priv;
  pthread_mutex_destroy(&cp->lock);
  pthread_mutex_destroy(&cp->nccl_mu);
  free(cp->dev);
  free(cp->peer);
  free(cp);
  free(b);
}

static const shardd__backend_ops cuda_ops = {
    .alloc = cuda_alloc,
    .free = cuda_free_region,
    .export_fd = cuda_export_fd,
    .export_ipc = cuda_export_ipc,
    .read = cuda_read,
    .write = cuda_write,
    .copy = cuda_copy,
    .reduce = cuda_reduce,
    .reduce_add = cuda_reduce_add,
    .adopt = cuda_adopt,
    .sumsq = cuda_sumsq,
    .update = cuda_update,
    .widen = cuda_widen,
    .device_info = cuda_device_info,
    .destroy = cuda_destroy,
    .comm_create = cuda_comm_create,
    .comm_destroy = cuda_comm_destroy,
    .allgather = cuda_allgather,
    .reduce_scatter = cuda_reduce_scatter,
};

int shardd__cuda_device_count(void) {
  int n = 0;
  cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return n;
}

shardd_err shardd__backend_cuda_create(int ndevices, shardd__backend **out,
                                       char *err, size_t errlen) {
  *out = NULL;
  int count = 0;
  cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess || count <= 0) {
    snprintf(err, errlen, "no CUDA device found (cudaGetDeviceCount: %s)%s",
             e != cudaSuccess ? cudaGetErrorString(e) : "0 devices",
             e == cudaErrorInsufficientDriver
                 ? "; is an NVIDIA driver loaded? --backend host runs without one"
                 : "");
    (void)cudaGetLastError();
    return SHARDD_E_NO_CUDA;
  }
  if (ndevices <= 0)
    ndevices = count;
  if (ndevices > count) {
    snprintf(err, errlen, "--devices %d: only %d CUDA device%s visible",
             ndevices, count, count == 1 ? " is" : "s are");
    return SHARDD_E_RANGE;
  }
  shardd__backend *b = calloc(1, sizeof *b);
  cuda_priv *cp = calloc(1, sizeof *cp);
  cuda_dev *dev = calloc((size_t)ndevices, sizeof *dev);
  unsigned char *peer = calloc((size_t)ndevices * (size_t)ndevices, 1);
  if (b == NULL || cp == NULL || dev == NULL || peer == NULL) {
    free(b);
    free(cp);
    free(dev);
    free(peer);
    snprintf(err, errlen, "out of memory");
    return SHARDD_E_NO_MEMORY;
  }
  for (int d = 0; d < ndevices; d++) {
    struct cudaDeviceProp prop;
    size_t freeb = 0, total = 0;
    e = cudaSetDevice(d);
    if (e == cudaSuccess)
      e = cudaGetDeviceProperties(&prop, d);
    if (e == cudaSuccess)
      e = cudaFree(NULL); /* creates the primary context now, not mid-task */
    if (e == cudaSuccess)
      e = cudaMemGetInfo(&freeb, &total);
    if (e != cudaSuccess) {
      snprintf(err, errlen, "CUDA device %d: %s", d, cudaGetErrorString(e));
      (void)cudaGetLastError();
      free(b);
      free(cp);
      free(dev);
      free(peer);
      return SHARDD_E_NO_CUDA;
    }
    /* device_info's name holds 63 characters; longer ones are cut */
    size_t nl = strnlen(prop.name, sizeof prop.name);
    if (nl >= sizeof dev[d].name)
      nl = sizeof dev[d].name - 1;
    memcpy(dev[d].name, prop.name, nl);
    dev[d].name[nl] = '\0';
    dev[d].total = total;
  }
  /* Peer access where the hardware has it, so kernels on one GPU read the
   * others' shards directly; the rest is staged (see cuda_reduce). */
  for (int a = 0; a < ndevices; a++) {
    for (int c = 0; c < ndevices; c++) {
      int ok = 0;
      if (a == c || cudaDeviceCanAccessPeer(&ok, a, c) != cudaSuccess || !ok)
        continue;
      if (cudaSetDevice(a) != cudaSuccess)
        continue;
      e = cudaDeviceEnablePeerAccess(c, 0);
      if (e == cudaSuccess || e == cudaErrorPeerAccessAlreadyEnabled)
        peer[a * ndevices + c] = 1;
      (void)cudaGetLastError();
    }
  }
  (void)cudaGetLastError();
  pthread_mutex_init(&cp->lock, NULL);
  pthread_mutex_init(&cp->nccl_mu, NULL);
  cp->dev = dev;
  cp->peer = peer;
  b->ops = &cuda_ops;
  b->name = "cuda";
  b->caps = 0; /* device memory: reached through read/write */
  b->ndevices = ndevices;
  b->priv = cp;
  *out = b;
  return SHARDD_OK;
}
