/* backend.h — the memory backend interface: where shards, gather areas,
 * gradient areas and optimizer state live, and the bulk operations on them.
 * Two implementations: backend_host (memfd arenas, one per virtual device)
 * and backend_cuda (cudaMalloc on each GPU, CUDA IPC, NCCL).
 *
 * Ownership: a region belongs to the backend that allocated it and is freed
 * only with ops->free. The bulk operations are called from worker threads
 * on disjoint byte ranges; alloc/free/device_info from the loop thread. */
#ifndef SHARDD_BACKEND_H
#define SHARDD_BACKEND_H

#include <stddef.h>
#include <stdint.h>

#include "optim.h"
#include "shardd.h"

typedef struct shardd__backend shardd__backend;

/* No backend rounds a region's size up by this much: the host backend
 * rounds to the page (at most 64 KiB, arm64's largest), cuda to 512 bytes.
 * A size read back from a file (a checkpoint's optimizer state records its
 * region's rounded size) is at most what it describes plus this. */
#define SHARDD__REGION_GRAIN_MAX ((size_t)64 << 10)

/* Host: one memfd holding the rank blocks of one batched registration
 * and rank (see slab_open); opaque. */
typedef struct shardd__slab shardd__slab;

typedef struct {
  /* read-only after alloc */
  int device;
  size_t bytes;     /* rounded to the backend's granularity */
  void *ptr;        /* daemon's mapping (host) or device pointer (cuda) */
  int fd;           /* host: the memfd; -1 otherwise */
  /* host: where the region starts in fd's file (page-aligned); 0 unless
   * it is a block of a slab */
  size_t off;
  shardd__slab *slab; /* the slab it is a block of; NULL: fd is its own */
  void *priv;
} shardd__region;

typedef struct {
  char name[64];
  uint64_t capacity_bytes;
  uint64_t used_bytes; /* by shardd's regions */
  /* the most used_bytes has been since the backend was created: what a
   * memory bound is checked against (a transient area counts while held) */
  uint64_t peak_bytes;
  /* regions allocated on the device since the backend was created: a
   * steady state that allocates nothing keeps it still */
  uint64_t allocs;
  /* what the device has free now, whoever holds the rest (cuda:
   * cudaMemGetInfo; host: capacity_bytes - used_bytes) */
  uint64_t free_bytes;
} shardd__device_info;

typedef struct {
  /* Allocates bytes of zeroed memory on device; SHARDD_E_NO_MEMORY with the
   * device, request and remaining capacity in err when it does not fit. */
  shardd_err (*alloc)(shardd__backend *b, int device, size_t bytes,
                      const char *label, shardd__region **out, char *err,
                      size_t errlen);
  /* As alloc, for memory that never leaves the daemon (optimizer state):
   * the host backend then needs no descriptor for it. NULL: use alloc. */
  shardd_err (*alloc_private)(shardd__backend *b, int device, size_t bytes,
                              const char *label, shardd__region **out,
                              char *err, size_t errlen);
  void (*free)(shardd__backend *b, shardd__region *r);
  /* Host: a new descriptor for r that the caller owns and closes. */
  shardd_err (*export_fd)(shardd__backend *b, shardd__region *r, int *fd);
  /* Host: as export_fd, opened read-only, so that a trainer's mapping of it
   * cannot be made writable (memory other trainers read). NULL: none. */
  shardd_err (*export_fd_ro)(shardd__backend *b, shardd__region *r, int *fd);
  /* Cuda: the CUDA IPC handle of r (*len bytes, at most cap, 64 today) for a
   * client to open with cudaIpcOpenMemHandle. NULL for backends whose
   * regions are exported with export_fd. */
  shardd_err (*export_ipc)(shardd__backend *b, shardd__region *r, void *handle,
                           size_t cap, size_t *len);
  /* Moves bytes between r (at off) and host memory, for callers that need
   * the contents on the host (checkpoints). NULL when r->ptr is host memory
   * the caller may use directly (host backend, which sets
   * SHARDD__BACKEND_CAP_HOST_MAPPED); set by the cuda backend. */
  shardd_err (*read)(shardd__backend *b, shardd__region *r, size_t off,
                     void *dst, size_t bytes);
  shardd_err (*write)(shardd__backend *b, shardd__region *r, size_t off,
                      const void *src, size_t bytes);
  shardd_err (*copy)(shardd__backend *b, shardd__region *dst, size_t dst_off,
                     shardd__region *src, size_t src_off, size_t bytes);
  /* dst (fp32 at dst_off) = sum over i of srcs[i] (dtype, at src_offs[i]),
   * divided by divisor; summed in rank order in fp32. */
  shardd_err (*reduce)(shardd__backend *b, shardd_dtype dtype, float divisor,
                       shardd__region *dst, size_t dst_off,
                       shardd__region *const *srcs, const size_t *src_offs,
                       int nsrc, size_t n);
  /* reduce, added to what dst holds: dst += (sum over i of srcs[i]) /
   * divisor, the division before the addition, as a second backward adds
   * its reduced gradient to the first's. NULL where unsupported (a
   * backend may leave it out): callers refuse an accumulating scatter
   * then. */
  shardd_err (*reduce_add)(shardd__backend *b, shardd_dtype dtype,
                           float divisor, shardd__region *dst, size_t dst_off,
                           shardd__region *const *srcs, const size_t *src_offs,
                           int nsrc, size_t n);
  /* *out = sum of squares of n fp32 at off, accumulated in double. */
  shardd_err (*sumsq)(shardd__backend *b, shardd__region *r, size_t off,
                      size_t n, double *out);
  /* One optimizer update of n elements. param holds dtype elements at
   * param_off; for bf16/fp16 master (fp32 at master_off) is updated and
   * param rewritten from it, for fp32 master is NULL. grad is fp32.
   * state holds shardd__optim_state_count(hp) fp32 arrays at state_offs. */
  shardd_err (*update)(shardd__backend *b, const shardd__hp *hp, uint64_t step,
                       shardd_dtype dtype, shardd__region *param,
                       size_t param_off, shardd__region *master,
                       size_t master_off, shardd__region *grad, size_t grad_off,
                       float grad_scale, shardd__region *state,
                       const size_t *state_offs, size_t n);
  /* Where param's (dtype) bits are not master's (fp32) rounding -- the
   * trainer wrote the shard since the last step -- master takes param's
   * value: a write to a 16-bit shard is adopted, never undone by the next
   * step. NULL: writes are not looked for (the step's rounding of the
   * master wins). */
  shardd_err (*adopt)(shardd__backend *b, shardd_dtype dtype,
                      shardd__region *master, size_t master_off,
                      shardd__region *param, size_t param_off, size_t n);
  /* master (fp32) = param (dtype), for the first step of a 16-bit param. */
  shardd_err (*widen)(shardd__backend *b, shardd_dtype dtype,
                      shardd__region *master, size_t master_off,
                      shardd__region *param, size_t param_off, size_t n);
  void (*device_info)(shardd__backend *b, int device, shardd__device_info *out);
  void (*destroy)(shardd__backend *b);
  /* A region of device around fd, a memfd a previous daemon allocated and
   * the service manager kept (its fd store, under store_name): mapped,
   * never copied, counted as used; *out owns fd from here (also on
   * failure, where fd is closed). The size is the file's. NULL on
   * backends whose memory no descriptor holds (cuda). */
  shardd_err (*wrap_fd)(shardd__backend *b, int device, int fd,
                        const char *store_name, shardd__region **out,
                        char *err, size_t errlen);

  /* ---- slabs (host; NULL elsewhere: callers allocate one region at a
   * time). A batched registration's rank blocks of one rank in one memfd,
   * each at a page-aligned offset: five system calls for the batch where
   * a memfd per block took five each, and one descriptor for the client.
   * A slab holds blocks of one job and rank only, so whoever is handed
   * its descriptor reaches nothing another rank's or uid's descriptor
   * would not. */
  /* An open slab on device room for at most nblocks blocks of bytes in
   * all (its file is cut to what was taken at close). */
  shardd_err (*slab_open)(shardd__backend *b, int device, uint64_t bytes,
                          size_t nblocks, const char *label,
                          shardd__slab **out, char *err, size_t errlen);
  /* The next block of s, bytes zeroed; counted used on s's device as
   * alloc's regions are. Freed with free: while s is open its bytes are
   * given back at once; once closed its pages are punched out and its
   * bytes stay counted until s's last block goes (a client holding the
   * descriptor could fault pages back into the range: they are the
   * slab's until it closes, and counted). */
  shardd_err (*slab_take)(shardd__backend *b, shardd__slab *s, size_t bytes,
                          shardd__region **out, char *err, size_t errlen);
  /* No more blocks: the file is cut to its blocks' end and sealed (and
   * stored, with the fd store); s goes now if no block lives, else with
   * its last block. On failure (err) s is closed all the same, unsealed:
   * the caller frees its blocks and sends no descriptor of it. */
  shardd_err (*slab_close)(shardd__backend *b, shardd__slab *s, char *err,
                           size_t errlen);
  /* As wrap_fd, for a slab a previous daemon stored: its n blocks at
   * offs[i] of bytes[i] each, out[i]; ranges no block holds (blocks
   * freed before the restart) are punched out again. */
  shardd_err (*wrap_slab)(shardd__backend *b, int device, int fd,
                          const char *store_name, size_t n,
                          const size_t *offs, const size_t *bytes,
                          shardd__region **out, char *err, size_t errlen);

  /* ---- whole-collective ops (cuda: NCCL). All four NULL on backends
   * without them (host): collective.c then copies and reduces rank by rank
   * with the ops above. */
  /* A communicator over n ranks, rank i on device devs[i] (n distinct
   * devices, in rank order): blocks while it connects, so it is created on
   * a worker thread; *comm is freed with comm_destroy (loop thread, when no
   * op of it runs). */
  shardd_err (*comm_create)(shardd__backend *b, const int *devs, int n,
                            void **comm, char *err, size_t errlen);
  void (*comm_destroy)(shardd__backend *b, void *comm);
  /* All-gather over comm's n ranks: for every rank i and every rank j,
   * bytes at dst[i] + dst_off + j*bytes = the bytes at src[j] + src_off.
   * Returns when every rank's copy is complete (blocks: worker threads). */
  shardd_err (*allgather)(shardd__backend *b, void *comm,
                          shardd__region *const *src, size_t src_off,
                          shardd__region *const *dst, size_t dst_off,
                          size_t bytes, char *err, size_t errlen);
  /* Reduce-scatter over comm's n ranks: for every rank i, dst[i] (n fp32 at
   * dst_off) = the sum over ranks j of src[j]'s elements [i*n, (i+1)*n)
   * (dtype, at src_off), accumulated in fp32 (16-bit inputs widened exactly
   * first), then divided by divisor unless it is 1. The summation order is
   * the library's, not rank order: equal to reduce's up to fp32 rounding.
   * Returns when complete (blocks: worker threads). */
  shardd_err (*reduce_scatter)(shardd__backend *b, void *comm,
                               shardd_dtype dtype, float divisor,
                               shardd__region *const *src, size_t src_off,
                               shardd__region *const *dst, size_t dst_off,
                               size_t n, char *err, size_t errlen);
} shardd__backend_ops;

/* Capability bits of a backend (shardd__backend.caps): what callers may
 * rely on, tested instead of the backend's name. */
/* Every region's ptr is memory of the daemon's own address space that the
 * loop thread and workers may read and write directly (the host backend's
 * memfd mappings); read/write are NULL then. Checkpoints and cross-node
 * collectives need it. */
#define SHARDD__BACKEND_CAP_HOST_MAPPED 0x1u

struct shardd__backend {
  /* read-only after create */
  const shardd__backend_ops *ops;
  const char *name; /* "host" or "cuda", for messages and status */
  unsigned caps;    /* SHARDD__BACKEND_CAP_* bits */
  int ndevices;
  void *priv;
};

/* ndevices virtual devices of capacity bytes each (0: physical memory split
 * evenly). Caller destroys with b->ops->destroy(b). */
shardd_err shardd__backend_host_create(int ndevices, uint64_t capacity,
                                       shardd__backend **out, char *err,
                                       size_t errlen);

/* The host backend and the service manager's file descriptor store
 * (fdstore.h): SHARDD__PERSIST_OFF, as without one; _ON: every region is a
 * memfd (optimizer state too) handed to the store when allocated
 * (FDSTORE=1, a name of its own) and taken out of it when freed
 * (FDSTOREREMOVE=1); _DETACHED: the daemon is stopping and its memory
 * outlives it in the store, so a free neither takes a region out nor
 * punches its pages away. */
#define SHARDD__PERSIST_OFF 0
#define SHARDD__PERSIST_ON 1
#define SHARDD__PERSIST_DETACHED 2
void shardd__backend_host_persist(shardd__backend *b, int mode);
/* The name r has in the fd store, NULL none (not stored; borrowed, lives
 * as r). */
const char *shardd__backend_region_store_name(const shardd__region *r);
/* What r counts for against the bounds on memory (*bytes) and on memory
 * regions (*fds: 1 for a region of its own; a slab, one descriptor for
 * all its blocks, counts with its first live block): taken, what its
 * alloc or slab_take added; given back, what freeing it now would give
 * back (a closed slab's bytes and descriptor with its last block,
 * nothing before). */
void shardd__backend_region_taken(const shardd__region *r, uint64_t *bytes,
                                  int *fds);
void shardd__backend_region_gives(const shardd__region *r, uint64_t *bytes,
                                  int *fds);
/* The prefix of every region's name in the fd store ("shardd-r"). */
#define SHARDD__STORE_REGION_PREFIX "shardd-r"

/* Number of CUDA devices, 0 when CUDA is absent or finds none. */
int shardd__cuda_device_count(void);
/* The cuda backend over the first ndevices GPUs (ndevices <= 0: all). */
shardd_err shardd__backend_cuda_create(int ndevices, shardd__backend **out,
                                       char *err, size_t errlen);

#endif /* SHARDD_BACKEND_H */
