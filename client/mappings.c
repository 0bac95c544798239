/* mappings.c — the memory the daemon hands a connection: each registered
 * buffer's rank block (an mmap of its memfd, or its CUDA IPC handle opened)
 * in a table by buffer id, and the transient-area pools a gather's reply
 * names, mapped once per connection; the areas of a gather found in them. */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "client_int.h"

/* Whether n elements of esz bytes at byte off lie within total bytes, at an
 * element-aligned offset, without the sums wrapping. */
static int area_ok(uint64_t off, uint64_t n, size_t esz, uint64_t total) {
  return n <= total / esz && off <= total - n * esz && off % esz == 0;
}

static void unmap(mapping *m) {
  if (m->device < 0) {
    munmap(m->base, m->len);
    return;
  }
  shardd__cudart_ipc_close(m->base, m->device);
}

/* Why a descriptor from the daemon cannot back a mapping of bytes: 0 when
 * it can, 1 when the file is smaller (*size its size, -1 unknown), 2 when
 * it is not a memfd sealed against shrinking. A mapping past the end of
 * the file, or of a file shrunk later, faults (SIGBUS) at first touch
 * instead of failing here. */
static int memfd_unfit(int fd, uint64_t bytes, intmax_t *size) {
  struct stat st;
  if (fstat(fd, &st) != 0)
    st.st_size = -1;
  *size = (intmax_t)st.st_size;
  if (st.st_size < 0 || (uint64_t)st.st_size < bytes)
    return 1;
  int seals = fcntl(fd, F_GET_SEALS);
  if (seals < 0 || !(seals & F_SEAL_SHRINK))
    return 2;
  return 0;
}

pool_map *shardd__find_pool(shardd_client_t *c, uint64_t id) {
  for (pool_map *p = c->pools; p; p = p->next)
    if (p->id == id)
      return p; /* newest first: a pool remapped larger shadows the old */
  return NULL;
}

/* A cuda daemon's pool: its IPC handle opened once on its device. */
static shardd_err pool_adopt_ipc(shardd_client_t *c,
                                 const Shardwire__GatherReply *gr, char *why,
                                 size_t whylen) {
  pool_map *p = shardd__find_pool(c, gr->pool);
  if (p && p->len >= gr->pool_bytes)
    return SHARDD_OK; /* sent again: opened already */
  if (gr->cuda_ipc_handle.len != CUDA_IPC_BYTES || !gr->has_device ||
      gr->device > INT_MAX || gr->pool_bytes == 0 ||
      (uint64_t)(size_t)gr->pool_bytes != gr->pool_bytes) {
    snprintf(why, whylen, "pool %" PRIu64 ": a CUDA IPC handle of %zu bytes (not "
             "%d) or a bad device or size in the daemon's reply", gr->pool,
             gr->cuda_ipc_handle.len, CUDA_IPC_BYTES);
    return SHARDD_E_PROTOCOL;
  }
  if (!shardd__cudart_ready()) {
    snprintf(why, whylen,
             "pool %" PRIu64 " lives in GPU memory (cuda backend): "
             "opening its CUDA IPC handle needs the CUDA runtime: %.300s",
             gr->pool, shardd__cudart_why());
    return SHARDD_E_NO_CUDA;
  }
  pool_map *n = malloc(sizeof *n);
  if (n == NULL) {
    snprintf(why, whylen, "out of memory");
    return SHARDD_E_NO_MEMORY;
  }
  const char *what = NULL;
  size_t avail = 0;
  int e = shardd__cudart_ipc_open(gr->cuda_ipc_handle.data, (int)gr->device,
                                  &n->base, &avail, &what);
  if (e != 0) {
    snprintf(why, whylen, "pool %" PRIu64 ": %s: %s", gr->pool, what,
             e == -1 ? "no cuMemGetAddressRange_v2 to check the mapping's size"
             : e == -2 ? "a range that does not hold the opened pointer"
                       : shardd__cudart_str(e));
    free(n);
    return e == -2 ? SHARDD_E_IO : SHARDD_E_NO_CUDA;
  }
  if (avail < gr->pool_bytes) { /* trainers would write past the pool */
    unmap(&(mapping){.base = n->base, .device = (int)gr->device});
    snprintf(why, whylen, "pool %" PRIu64 ": the CUDA IPC handle maps %zu bytes, "
             "not the %" PRIu64 " advertised", gr->pool, avail, gr->pool_bytes);
    free(n);
    return SHARDD_E_PROTOCOL;
  }
  n->id = gr->pool;
  n->len = (size_t)gr->pool_bytes;
  n->device = (int)gr->device;
  n->next = c->pools;
  c->pools = n;
  return SHARDD_OK;
}

/* Pool id of bytes mapped from descriptor fd (-1: the reply brought none,
 * so it must be mapped already). */
static shardd_err pool_adopt_fd(shardd_client_t *c, uint64_t id, uint64_t bytes,
                                int fd, char *why, size_t whylen) {
  pool_map *p = shardd__find_pool(c, id);
  if (fd < 0) {
    if (p == NULL) {
      snprintf(why, whylen, "the daemon's gather reply names pool %" PRIu64
               ", which this connection has not mapped, and carries no "
               "descriptor for it (a cuda backend sends none yet; the first "
               "reply naming a pool must carry it)", id);
      return SHARDD_E_PROTOCOL;
    }
    if (bytes > p->len) {
      snprintf(why, whylen, "the daemon's gather reply gives pool %" PRIu64
               " %" PRIu64 " bytes, but the %zu mapped here came without a "
               "new descriptor", id, bytes, p->len);
      return SHARDD_E_PROTOCOL;
    }
    return SHARDD_OK;
  }
  if (p && p->len >= bytes)
    return SHARDD_OK; /* sent again: the mapping there is the same file */
  if (bytes == 0 || (uint64_t)(size_t)bytes != bytes) {
    snprintf(why, whylen, "pool %" PRIu64 ": size %" PRIu64 " cannot be mapped",
             id, bytes);
    return SHARDD_E_PROTOCOL;
  }
  intmax_t size;
  switch (memfd_unfit(fd, bytes, &size)) {
  case 1:
    snprintf(why, whylen, "pool %" PRIu64 ": the daemon's descriptor holds "
             "%jd bytes, not the %" PRIu64 " of the pool", id, size, bytes);
    return SHARDD_E_PROTOCOL;
  case 2:
    snprintf(why, whylen, "pool %" PRIu64 ": the daemon's descriptor is not a "
             "memfd sealed against shrinking (F_SEAL_SHRINK)", id);
    return SHARDD_E_PROTOCOL;
  default:
    break;
  }
  /* A descriptor opened read-only is the daemon's way of keeping trainers
   * from writing a copy other ranks read (the node's gathered copies):
   * map it so, where a writable map would fail; a write faults. */
  int acc = fcntl(fd, F_GETFL);
  int prot = acc >= 0 && (acc & O_ACCMODE) == O_RDONLY ? PROT_READ
                                                       : PROT_READ | PROT_WRITE;
  pool_map *n = malloc(sizeof *n);
  if (n == NULL) {
    snprintf(why, whylen, "out of memory");
    return SHARDD_E_NO_MEMORY;
  }
  n->base = mmap(NULL, (size_t)bytes, prot, MAP_SHARED, fd, 0);
  if (n->base == MAP_FAILED) {
    snprintf(why, whylen, "mmap of pool %" PRIu64 " (%" PRIu64 " bytes): %s",
             id, bytes, strerror(errno));
    free(n);
    return SHARDD_E_IO;
  }
  /* A pool remade larger keeps its old mapping too, until close: areas
   * handed out from it may still be read by the caller. */
  n->id = id;
  n->len = (size_t)bytes;
  n->device = -1;
  n->next = c->pools;
  c->pools = n;
  return SHARDD_OK;
}

/* Makes sure the pools a GatherReply names are mapped: the first reply
 * naming one on this connection brings its descriptor (fds: nfds of them,
 * the gather pool's first, then the gradient pool's when grad_pool_fd; the
 * caller closes them), later ones do not. Done for every GatherReply
 * whichever call reads it (gather, gather_area, an async gather's reply
 * read by another call): a descriptor comes once, so one dropped would
 * leave its pool unreachable for the connection's life. On failure why
 * holds the reason. */
shardd_err shardd__pool_adopt(shardd_client_t *c,
                              const Shardwire__GatherReply *gr, const int *fds,
                              int nfds, char *why, size_t whylen) {
  int gfd = gr->has_grad_pool && gr->grad_pool_fd && nfds > 0 ? fds[nfds - 1]
                                                              : -1;
  int fd = nfds - (gfd >= 0) > 0 ? fds[0] : -1;
  shardd_err rc;
  if (fd < 0 && gr->has_cuda_ipc_handle)
    rc = pool_adopt_ipc(c, gr, why, whylen);
  else
    rc = pool_adopt_fd(c, gr->pool, gr->pool_bytes, fd, why, whylen);
  if (rc != SHARDD_OK || !gr->has_grad_pool)
    return rc;
  if (!gr->has_grad_pool_bytes) {
    snprintf(why, whylen, "the daemon's gather reply names gradient pool %"
             PRIu64 " without its size", gr->grad_pool);
    return SHARDD_E_PROTOCOL;
  }
  return pool_adopt_fd(c, gr->grad_pool, gr->grad_pool_bytes, gfd, why, whylen);
}

static size_t maps_slot(const shardd_client_t *c, uint64_t id) {
  /* Fibonacci hashing: ids are consecutive, the multiply spreads them */
  return (size_t)((id * UINT64_C(0x9E3779B97F4A7C15)) >> 32) & (c->maps_cap - 1);
}

/* Links m into c's table (one mapping per buffer id: shardd__buffer_adopt drops
 * a stale one first); fails (E_NO_MEMORY) only when no table can be made: one
 * that cannot grow takes longer chains. */
static shardd_err maps_put(shardd_client_t *c, mapping *m) {
  mapping **nt = NULL;
  size_t ncap = c->maps_cap ? c->maps_cap * 2 : 64;
  if (c->maps_n >= c->maps_cap && (nt = calloc(ncap, sizeof *nt)) == NULL &&
      c->maps_cap == 0)
    return SHARDD_E_NO_MEMORY;
  if (nt) {
    size_t ocap = c->maps_cap;
    mapping **ot = c->maps;
    c->maps = nt;
    c->maps_cap = ncap;
    for (size_t i = 0; i < ocap; i++)
      while (ot[i]) {
        mapping *x = ot[i];
        ot[i] = x->next;
        size_t k = maps_slot(c, x->buffer);
        x->next = nt[k];
        nt[k] = x;
      }
    free(ot);
  }
  size_t k = maps_slot(c, m->buffer);
  m->next = c->maps[k];
  c->maps[k] = m;
  c->maps_n++;
  return SHARDD_OK;
}

static mapping *maps_get(const shardd_client_t *c, uint64_t id) {
  if (c->maps_cap == 0)
    return NULL;
  for (mapping *m = c->maps[maps_slot(c, id)]; m; m = m->next)
    if (m->buffer == id)
      return m;
  return NULL;
}

void shardd__unmap_buffer(shardd_client_t *c, uint64_t id) {
  if (c->maps_cap == 0)
    return;
  for (mapping **pp = &c->maps[maps_slot(c, id)]; *pp;) {
    mapping *m = *pp;
    if (m->buffer == id) {
      *pp = m->next;
      unmap(m);
      free(m);
      c->maps_n--;
    } else {
      pp = &m->next;
    }
  }
}

/* What is wrong with br's layout (NULL: nothing). The reply is checked
 * before anything is mapped: the pointers handed out are computed from it,
 * so a wrong layout would have the caller write past the mapping. */
static const char *layout_bad(const Shardwire__BufferReply *br, size_t esz,
                              int transient) {
  if (esz == 0)
    return "unknown dtype";
  if (br->world == 0 || br->rank >= br->world ||
      br->numel > br->padded_numel ||
      br->shard_numel > br->padded_numel / br->world ||
      br->shard_numel * br->world != br->padded_numel)
    return "element counts"; /* rank * shard_numel indexes the gather area */
  if (br->block_bytes == 0 ||
      (uint64_t)(size_t)br->block_bytes != br->block_bytes)
    return "block size";
  if (!area_ok(br->shard_offset, br->shard_numel, esz, br->block_bytes))
    return "shard area";
  /* a transient block has no gather or gradient area: its offsets are 0
   * and unused, each gather's reply says where the areas are */
  if (!transient &&
      !area_ok(br->gather_offset, br->padded_numel, esz, br->block_bytes))
    return "gather area";
  if (!transient &&
      !area_ok(br->grad_offset, br->padded_numel, esz, br->block_bytes))
    return "gradient area";
  if (br->has_reduced_offset &&
      !area_ok(br->reduced_offset, br->shard_numel, 4, br->block_bytes))
    return "reduced-gradient area";
  return NULL;
}

/* Where br's block starts in its descriptor's file. */
static uint64_t block_off(const Shardwire__BufferReply *br) {
  return br->has_block_offset ? br->block_offset : 0;
}

/* Checks what br's block comes through: a CUDA IPC handle (*device its
 * device, the runtime loaded) or fd, a memfd large enough (*device -1). */
static shardd_err block_source(shardd_client_t *c,
                               const Shardwire__BufferReply *br, int fd,
                               shardd__fd_fit *fit, int *device) {
  *device = -1; /* host mapping */
  if (fd < 0 && br->has_cuda_ipc_handle) {
    if (br->cuda_ipc_handle.len != CUDA_IPC_BYTES)
      return shardd__set_err(c, SHARDD_E_PROTOCOL,
                             "buffer %" PRIu64
                             ": CUDA IPC handle of %zu bytes, not %d",
                             br->id, br->cuda_ipc_handle.len, CUDA_IPC_BYTES);
    /* -1 is the host marker of a mapping; larger ordinals wrap into it */
    if (br->device > INT_MAX)
      return shardd__set_err(c, SHARDD_E_PROTOCOL,
                             "buffer %" PRIu64 ": CUDA device %" PRIu32
                             " out of range",
                             br->id, br->device);
    if (!shardd__cudart_ready())
      return shardd__set_err(
          c, SHARDD_E_NO_CUDA,
          "buffer %" PRIu64 " lives in GPU memory (cuda backend): "
          "opening its CUDA IPC handle needs the CUDA runtime: %s; "
          "or run the daemon with --backend host to use host memory",
          br->id, shardd__cudart_why());
    *device = (int)br->device;
    return SHARDD_OK;
  }
  if (fd < 0)
    return shardd__set_err(
        c, SHARDD_E_PROTOCOL,
        "the daemon sent no descriptor for buffer %" PRIu64
        " (is this a cuda backend? this call maps host memory)",
        br->id);
  uint64_t off = block_off(br);
  long pg = sysconf(_SC_PAGESIZE);
  if (pg <= 0 || off % (uint64_t)pg != 0 ||
      br->block_bytes > (uint64_t)INTMAX_MAX ||
      off > (uint64_t)INTMAX_MAX - br->block_bytes)
    return shardd__set_err(c, SHARDD_E_PROTOCOL,
                           "buffer %" PRIu64 ": its block at byte %" PRIu64
                           " of its descriptor, not at a page", br->id, off);
  /* the file is checked once for every block in it: its size and seals
   * do not change (sealed), only what each block needs of it */
  shardd__fd_fit here = {-1, 0};
  if (fit == NULL)
    fit = &here;
  if (fit->size < 0 && (fit->unfit = memfd_unfit(fd, 0, &fit->size)) == 1)
    fit->size = -1; /* fstat failed */
  intmax_t size = fit->size;
  int unfit = fit->unfit == 2 ? 2
              : size < 0 || (uint64_t)size < off + br->block_bytes ? 1 : 0;
  if (unfit == 1)
    return shardd__set_err(c, SHARDD_E_PROTOCOL,
                           "buffer %" PRIu64
                           ": the daemon's descriptor holds %jd "
                           "bytes, not the %" PRIu64 " of its block at byte %"
                           PRIu64, br->id, size, br->block_bytes, off);
  if (unfit == 2)
    return shardd__set_err(c, SHARDD_E_PROTOCOL,
                           "buffer %" PRIu64
                           ": the daemon's descriptor is not a memfd "
                           "sealed against shrinking (F_SEAL_SHRINK)",
                           br->id);
  return SHARDD_OK;
}

/* Opens br's CUDA IPC handle on device into *base, its size checked
 * against the block's. */
static shardd_err block_open_ipc(shardd_client_t *c,
                                 const Shardwire__BufferReply *br, int device,
                                 void **base) {
  const char *what;
  size_t avail = 0;
  int e = shardd__cudart_ipc_open(br->cuda_ipc_handle.data, device, base,
                                  &avail, &what);
  if (e == -1)
    return shardd__set_err(
        c, SHARDD_E_NO_CUDA,
        "buffer %" PRIu64 ": the CUDA IPC handle opened, but its "
        "size cannot be checked against the %" PRIu64 " bytes "
        "advertised: neither the runtime nor libcuda.so.1 has "
        "cuMemGetAddressRange_v2",
        br->id, br->block_bytes);
  if (e == -2)
    return shardd__set_err(c, SHARDD_E_IO,
                           "buffer %" PRIu64
                           ": cuMemGetAddressRange_v2 gave a range "
                           "that does not hold the opened pointer",
                           br->id);
  if (e == 0 && avail < br->block_bytes) {
    unmap(&(mapping){.base = *base, .device = device});
    return shardd__set_err(
        c, SHARDD_E_PROTOCOL,
        "buffer %" PRIu64 ": the CUDA IPC handle maps %zu bytes, "
        "fewer than the %" PRIu64 " bytes the daemon advertised "
        "for its block",
        br->id, avail, br->block_bytes);
  }
  /* the driver's CUresult is no cudaError_t */
  if (e != 0 && what == shardd__cudart_range_call)
    return shardd__set_err(c, SHARDD_E_IO,
                           "buffer %" PRIu64
                           ": measuring its opened CUDA IPC mapping: "
                           "%s failed (CUresult %d)",
                           br->id, what, e);
  if (e != 0)
    return shardd__set_err(
        c, SHARDD_E_IO,
        "opening the CUDA IPC handle of buffer %" PRIu64 " (%" PRIu64
        " bytes on CUDA device %d): %s: %s "
        "(error %d); the trainer "
        "must see the daemon's GPUs under the same ordinals "
        "(CUDA_VISIBLE_DEVICES) and be another process",
        br->id, br->block_bytes, device, what, shardd__cudart_str(e), e);
  return SHARDD_OK;
}

/* Maps br's block (from fd, or its IPC handle on device >= 0) and links
 * the mapping into c's table; *base is where it starts. */
static shardd_err block_map(shardd_client_t *c,
                            const Shardwire__BufferReply *br, int fd,
                            int device, int transient, size_t esz,
                            void **base) {
  mapping *m = malloc(sizeof *m);
  if (m == NULL)
    return shardd__set_err(c, SHARDD_E_NO_MEMORY, "out of memory");
  if (device >= 0) {
    shardd_err rc = block_open_ipc(c, br, device, base);
    if (rc != SHARDD_OK) {
      free(m);
      return rc;
    }
  } else {
    *base = mmap(NULL, br->block_bytes, PROT_READ | PROT_WRITE, MAP_SHARED,
                 fd, (off_t)block_off(br));
    if (*base == MAP_FAILED) {
      free(m);
      return shardd__set_err(c, SHARDD_E_IO,
                             "mmap of buffer %" PRIu64 " (%" PRIu64
                             " bytes): %s",
                             br->id, br->block_bytes, strerror(errno));
    }
  }
  m->buffer = br->id;
  m->base = *base;
  m->len = br->block_bytes;
  m->device = device;
  m->transient = transient;
  m->gather_off = br->gather_offset;
  m->grad_off = br->grad_offset;
  m->padded_numel = br->padded_numel;
  m->esz = esz;
  if (maps_put(c, m) != SHARDD_OK) {
    unmap(m);
    free(m);
    return shardd__set_err(c, SHARDD_E_NO_MEMORY, "out of memory");
  }
  return SHARDD_OK;
}

shardd_err shardd__buffer_adopt(shardd_client_t *c,
                                const Shardwire__BufferReply *br, int fd,
                                shardd__fd_fit *fit, shardd_buffer_info *out) {
  size_t esz = shardd_dtype_size((shardd_dtype)br->dtype);
  int transient = br->has_transient && br->transient;
  const char *bad = layout_bad(br, esz, transient);
  if (bad)
    return shardd__set_err(c, SHARDD_E_PROTOCOL,
                           "buffer %" PRIu64
                           ": inconsistent layout (%s) in a block of "
                           "%" PRIu64 " bytes",
                           br->id, bad, br->block_bytes);
  int device;
  shardd_err rc = block_source(c, br, fd, fit, &device);
  if (rc != SHARDD_OK)
    return rc;
  /* Registering again on one connection hands back the same mapping, so
   * pointers from the first call stay valid as the header promises. */
  void *base = NULL;
  const mapping *had = maps_get(c, br->id);
  if (had && had->len == br->block_bytes && had->device == device)
    base = had->base;
  else if (had)
    /* ids are never reused: another block under one id is the daemon's
     * error, and unmapping the first would pull memory from under the
     * pointers handed out for it */
    return shardd__set_err(
        c, SHARDD_E_PROTOCOL,
        "buffer %" PRIu64 ": the daemon sent a block of %" PRIu64
        " bytes on device %d; this connection mapped it as %zu "
        "bytes on device %d",
        br->id, br->block_bytes, device, had->len, had->device);
  if (base == NULL) {
    rc = block_map(c, br, fd, device, transient, esz, &base);
    if (rc != SHARDD_OK)
      return rc;
  }
  out->id = br->id;
  out->dtype = (shardd_dtype)br->dtype;
  out->numel = br->numel;
  out->padded_numel = br->padded_numel;
  out->shard_numel = br->shard_numel;
  out->world = br->world;
  out->rank = br->rank;
  out->device = br->device;
  out->created = br->created;
  out->shard = (char *)base + br->shard_offset;
  out->gather = transient ? NULL : (char *)base + br->gather_offset;
  out->grad = transient ? NULL : (char *)base + br->grad_offset;
  out->reduced =
      br->has_reduced_offset ? (char *)base + br->reduced_offset : NULL;
  out->generation = br->has_generation ? br->generation : 0;
  out->is_device = device >= 0;
  out->transient = transient;
  out->existing = br->has_existing && br->existing;
  return SHARDD_OK;
}

/* Fills *out with buffer's areas after a gather whose reply was gr (NULL:
 * a status-only reply, a job with resident areas). The offsets are checked
 * against the pool before any pointer is made of them: the caller writes
 * a whole buffer there. */
shardd_err shardd__area_fill(shardd_client_t *c, uint64_t buffer,
                             const Shardwire__GatherReply *gr, int want_grad,
                             shardd_area *out) {
  const mapping *m = maps_get(c, buffer);
  if (gr == NULL) {
    if (m == NULL)
      return shardd__set_err(c, SHARDD_E_STATE,
                             "buffer %" PRIu64
                             " is not registered on this connection: "
                             "its gather area is unknown here",
                             buffer);
    if (m->transient)
      return shardd__set_err(c, SHARDD_E_PROTOCOL,
                             "buffer %" PRIu64
                             " has transient areas but the daemon's "
                             "gather reply did not say where they are",
                             buffer);
    out->gather = (char *)m->base + m->gather_off;
    out->grad = want_grad ? (char *)m->base + m->grad_off : NULL;
    out->pool = 0;
    return SHARDD_OK;
  }
  const pool_map *p = shardd__find_pool(c, gr->pool);
  if (p == NULL) /* shardd__pool_adopt has refused such a reply already */
    return shardd__set_err(c, SHARDD_E_INTERNAL,
                           "pool %" PRIu64 " is not mapped", gr->pool);
  /* A buffer gathered without being registered here: its size is not
   * known, only that the areas start inside the pool. */
  uint64_t n = m ? m->padded_numel : 1;
  size_t esz = m ? m->esz : 1;
  if (!area_ok(gr->gather_offset, n, esz, p->len))
    return shardd__set_err(
        c, SHARDD_E_PROTOCOL,
        "buffer %" PRIu64 ": gather area at byte %" PRIu64 " (%" PRIu64
        " elements of %zu bytes) outside pool %" PRIu64 " of %zu bytes",
        buffer, gr->gather_offset, n, esz, gr->pool, p->len);
  if (want_grad && !gr->has_grad_offset)
    return shardd__set_err(c, SHARDD_E_PROTOCOL,
                           "buffer %" PRIu64
                           ": the daemon leased no gradient area "
                           "(its gather reply has no grad_offset)",
                           buffer);
  /* the gradient area: in the gather's pool, or (host backend, where the
   * gather area is the node's read-only copy) in this rank's own */
  const pool_map *gp = p;
  uint64_t gid = gr->pool;
  if (want_grad && gr->has_grad_pool) {
    gid = gr->grad_pool;
    if ((gp = shardd__find_pool(c, gid)) == NULL)
      return shardd__set_err(c, SHARDD_E_INTERNAL,
                             "pool %" PRIu64 " is not mapped", gid);
  }
  if (want_grad && !area_ok(gr->grad_offset, n, esz, gp->len))
    return shardd__set_err(
        c, SHARDD_E_PROTOCOL,
        "buffer %" PRIu64 ": gradient area at byte %" PRIu64 " (%" PRIu64
        " elements of %zu bytes) outside pool %" PRIu64 " of %zu bytes",
        buffer, gr->grad_offset, n, esz, gid, gp->len);
  out->gather = (char *)p->base + gr->gather_offset;
  out->grad = want_grad ? (char *)gp->base + gr->grad_offset : NULL;
  out->pool = gr->pool;
  return SHARDD_OK;
}

void shardd__mappings_free(shardd_client_t *c) {
  for (size_t i = 0; i < c->maps_cap; i++)
    while (c->maps[i]) {
      mapping *m = c->maps[i];
      c->maps[i] = m->next;
      unmap(m);
      free(m);
    }
  free(c->maps);
  while (c->pools) {
    pool_map *p = c->pools;
    c->pools = p->next;
    mapping m = {.base = p->base, .len = p->len, .device = p->device};
    unmap(&m); /* munmap, or the CUDA IPC close on its device */
    free(p);
  }
}
