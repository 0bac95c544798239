/* client.c — libshardd: the connection, the synchronous request/response
 * exchange, and the mappings of rank blocks handed out by the daemon
 * (host backend: mmap of the memfd; cuda backend: cudaIpcOpenMemHandle
 * through libcudart loaded at run time, so libshardd never links CUDA). */
#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <math.h>
#include <stddef.h>
#include <fcntl.h>
#include <inttypes.h>
#include <limits.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "frame.h"
#include "proto/shardd.pb-c.h"
#include "shardd.h"
#include "strbuf.h"

#include "fmt.h"

typedef struct mapping {
  struct mapping *next;
  uint64_t buffer;
  void *base;
  size_t len;
  int device; /* -1: host mmap; else the CUDA device base was opened on */
  /* the layout, for gathers: a transient block has no gather or grad area;
   * a resident one's are at these offsets; areas are padded_numel of esz */
  int transient;
  uint64_t gather_off, grad_off, padded_numel;
  size_t esz;
} mapping;

/* A transient-area pool of the daemon (one per device of a job), mapped
 * once per connection at the first reply naming it: gathers hand out
 * offsets into it, so none maps anything. */
typedef struct pool_map {
  struct pool_map *next;
  uint64_t id;
  void *base;
  size_t len;
  int device; /* -1: a host mapping; else opened by CUDA IPC on it */
} pool_map;

/* ---- CUDA IPC without linking CUDA --------------------------------------
 * The few runtime calls needed, declared here and resolved from libcudart
 * on first use. cudaIpcMemHandle_t is a struct of 64 bytes passed by value,
 * cudaError_t an int-sized enum; 0 is cudaSuccess. */
#define CUDA_IPC_BYTES 64
#define CUDA_IPC_LAZY_PEER 0x01 /* cudaIpcMemLazyEnablePeerAccess */

typedef struct {
  char reserved[CUDA_IPC_BYTES];
} cuda_ipc_handle;

static struct {
  pthread_once_t once;
  void *lib;
  char why[512];
  int (*ipc_open)(void **ptr, cuda_ipc_handle h, unsigned int flags);
  int (*ipc_close)(void *ptr);
  int (*get_device)(int *dev);
  int (*set_device)(int dev);
  const char *(*error_string)(int e);
} cudart = {PTHREAD_ONCE_INIT, NULL, "", NULL, NULL, NULL, NULL, NULL};

/* Why dlopen() failed, copied at once: the next dl* call overwrites it. */
static void *cudart_open(const char *name, char *why, size_t whylen) {
  void *lib = dlopen(name, RTLD_NOW | RTLD_LOCAL);
  if (lib == NULL) {
    const char *e = dlerror();
    snprintf(why, whylen, "%s", e ? e : "unknown dlopen error");
  }
  return lib;
}

static void cudart_load(void) {
  static const char *names[] = {"libcudart.so", "libcudart.so.13",
                                "libcudart.so.12"};
  char last[256] = "";
  /* Hosts with several CUDA versions pick the runtime matching the
   * daemon's; read once, at the first CUDA handle of the process. */
  const char *env = getenv("SHARDD_CUDART");
  if (env != NULL) {
    /* dlopen("") would hand back the program itself, not a runtime. */
    if (env[0] == '\0') {
      snprintf(cudart.why, sizeof cudart.why,
               "SHARDD_CUDART is set but empty: name the libcudart to load, "
               "or unset it to try libcudart.so, .so.13, .so.12");
      return;
    }
    cudart.lib = cudart_open(env, last, sizeof last);
    if (cudart.lib == NULL) {
      snprintf(cudart.why, sizeof cudart.why,
               "SHARDD_CUDART=%s could not be loaded: %s", env, last);
      return;
    }
  }
  for (size_t i = 0; i < sizeof names / sizeof names[0] && !cudart.lib; i++)
    cudart.lib = cudart_open(names[i], last, sizeof last);
  if (cudart.lib == NULL) {
    snprintf(cudart.why, sizeof cudart.why,
             "libcudart could not be loaded (tried libcudart.so, .so.13, "
             ".so.12; last: %s): install the CUDA runtime, add its folder "
             "to LD_LIBRARY_PATH or name it in SHARDD_CUDART", last);
    return;
  }
  *(void **)&cudart.ipc_open = dlsym(cudart.lib, "cudaIpcOpenMemHandle");
  *(void **)&cudart.ipc_close = dlsym(cudart.lib, "cudaIpcCloseMemHandle");
  *(void **)&cudart.get_device = dlsym(cudart.lib, "cudaGetDevice");
  *(void **)&cudart.set_device = dlsym(cudart.lib, "cudaSetDevice");
  *(void **)&cudart.error_string = dlsym(cudart.lib, "cudaGetErrorString");
  if (!cudart.ipc_open || !cudart.ipc_close || !cudart.get_device ||
      !cudart.set_device || !cudart.error_string) {
    snprintf(cudart.why, sizeof cudart.why,
             "the loaded library (%s) lacks cudaIpcOpenMemHandle and friends: "
             "it is not a CUDA runtime", env ? env : "libcudart");
    dlclose(cudart.lib);
    cudart.lib = NULL;
  }
}

/* The driver's cuMemGetAddressRange, which tells how large the allocation
 * an opened IPC pointer lies in is (the runtime has no call for it): looked
 * up in the runtime first, then in the libcuda.so.1 the runtime loaded to
 * open a handle (RTLD_NOLOAD: this never loads a driver of its own). */
static const char range_call[] = "cuMemGetAddressRange_v2";

static struct {
  pthread_once_t once;
  int (*get_range)(unsigned long long *base, size_t *size, unsigned long long ptr);
} cudrv = {PTHREAD_ONCE_INIT, NULL};

static void cudrv_load(void) {
  *(void **)&cudrv.get_range = dlsym(cudart.lib, "cuMemGetAddressRange_v2");
  if (cudrv.get_range == NULL) {
    void *drv = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL | RTLD_NOLOAD);
    if (drv != NULL) /* kept: the runtime holds it for the process's life */
      *(void **)&cudrv.get_range = dlsym(drv, "cuMemGetAddressRange_v2");
  }
}

static int cudart_ready(void) {
  pthread_once(&cudart.once, cudart_load);
  return cudart.lib != NULL;
}

static const char *cuda_str(int e) {
  const char *s = cudart.error_string ? cudart.error_string(e) : NULL;
  return s ? s : "unknown CUDA error";
}

/* Opens handle on device dev (the caller's current device is kept) and
 * says in *avail how many bytes the allocation holds from the pointer on
 * (a block the daemon advertised larger than its memory would let the
 * trainer write past it). On failure *what names the CUDA call that
 * failed and the handle is closed; -1 is "no call to measure the mapping
 * with". */
static int cuda_open(const void *handle, int dev, void **out, size_t *avail,
                     const char **what) {
  cuda_ipc_handle h;
  memcpy(&h, handle, sizeof h);
  int cur = -1;
  *what = "cudaGetDevice";
  int e = cudart.get_device(&cur);
  if (e == 0 && cur != dev) {
    *what = "cudaSetDevice";
    e = cudart.set_device(dev);
  }
  if (e == 0) {
    *what = "cudaIpcOpenMemHandle";
    e = cudart.ipc_open(out, h, CUDA_IPC_LAZY_PEER);
  }
  if (e == 0) {
    pthread_once(&cudrv.once, cudrv_load);
    *what = range_call;
    unsigned long long base = 0, p = (unsigned long long)(uintptr_t)*out;
    size_t size = 0;
    e = cudrv.get_range ? cudrv.get_range(&base, &size, p) : -1;
    if (e == 0 && (p < base || p - base > size))
      e = -2; /* not an address inside the range it reported */
    if (e == 0)
      *avail = size - (size_t)(p - base);
    else
      (void)cudart.ipc_close(*out);
  }
  if (cur >= 0 && cur != dev)
    (void)cudart.set_device(cur);
  return e;
}

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
  int cur = -1;
  if (cudart.get_device(&cur) == 0 && cur != m->device)
    (void)cudart.set_device(m->device);
  (void)cudart.ipc_close(m->base);
  if (cur >= 0 && cur != m->device)
    (void)cudart.set_device(cur);
}

/* A request sent with shardd_gather_async, until shardd_wait takes it. */
typedef struct async_op {
  struct async_op *next;
  uint64_t seq;
  uint64_t buffer;
  int done;
  shardd_err code;
  char *msg;
  /* the reply's GatherReply (transient areas), for shardd_wait_area */
  int has_area;
  uint64_t pool, gather_off;
} async_op;

struct shardd_client {
  int fd;
  uint64_t seq;
  shardd__frame_reader rd;
  /* The last error: short ones in err (the frame layer writes its reasons
   * there); one that does not fit (a refused optimizer's list of every bad
   * ref, as long as a frame) in err_long, which shardd_last_error prefers.
   * A fixed buffer alone cut that list at 2047 bytes with no sign. */
  char err[2048];
  char *err_long; /* NULL unless the last error is longer than err */
  char version[64];
  char backend[32];
  uint32_t bucket_max; /* entries per bucket request: the daemon's --max-pending, at most 64 */
  int resumed;          /* the Hello reply: the job is resumed, at resumed_step */
  uint64_t resumed_step;
  /* the buffers' mappings, chained by buffer id: a model registers 10^4
   * buffers and every gather looks its own up, so no list walk */
  mapping **maps;
  size_t maps_cap, maps_n; /* cap a power of 2 (or 0), n <= cap */
  pool_map *pools; /* newest first */
  async_op *async; /* oldest first */
  uint32_t max_async;
  /* Seconds of silence from the daemon a call waits before it pings, and
   * then before it fails with SHARDD_E_TIMEOUT (<= 0: forever); the path
   * is for that message. */
  double timeout;
  char socket_path[sizeof ((struct sockaddr_un *)0)->sun_path];
};

static shardd_err set_err(shardd_client_t *c, shardd_err rc, const char *fmt,
                          ...) __attribute__((format(printf, 3, 4)));

static void clear_err(shardd_client_t *c) {
  c->err[0] = '\0';
  free(c->err_long);
  c->err_long = NULL;
}

/* Formatted aside first: an argument may be the last error itself. */
static shardd_err set_err(shardd_client_t *c, shardd_err rc, const char *fmt,
                          ...) {
  char small[sizeof c->err];
  char *big = NULL;
  va_list ap, again;
  va_start(ap, fmt);
  va_copy(again, ap);
  int n = vsnprintf(small, sizeof small, fmt, ap);
  va_end(ap);
  if (n < 0) {
    snprintf(small, sizeof small, "%s (and the message could not be formatted)",
             shardd_strerror(rc));
  } else if ((size_t)n >= sizeof small) {
    big = malloc((size_t)n + 1);
    if (big != NULL) {
      vsnprintf(big, (size_t)n + 1, fmt, again);
    } else { /* say that it is cut rather than cut it silently */
      static const char cut[] = "\n... (message cut: out of memory)";
      memcpy(small + sizeof small - sizeof cut, cut, sizeof cut);
    }
  }
  va_end(again);
  free(c->err_long);
  c->err_long = big;
  memcpy(c->err, small, sizeof small);
  return rc;
}

const char *shardd_last_error(const shardd_client_t *c) {
  if (c == NULL)
    return "no client";
  return c->err_long ? c->err_long : c->err;
}

const char *shardd_version(void) { return SHARDD_VERSION; }

const char *shardd_daemon_version(const shardd_client_t *c) {
  return c ? c->version : "";
}

const char *shardd_daemon_backend(const shardd_client_t *c) {
  return c ? c->backend : "";
}

void shardd_free(void *p) { free(p); }

/* A send found the connection closed. The daemon may have refused it (client
 * limit, oversized frame) and closed it before reading our request; its
 * reason, a seq-0 reply, then still waits in the socket. Returns that code
 * with its message in c->err, else rc unchanged. Never blocks. */
static shardd_err closed_reason(shardd_client_t *c, shardd_err rc) {
  int flags = fcntl(c->fd, F_GETFL);
  if (flags < 0 || fcntl(c->fd, F_SETFL, flags | O_NONBLOCK) < 0)
    return rc;
  const uint8_t *payload;
  size_t len;
  int fds[4], nfds = 0;
  char ignored[128];
  if (shardd__frame_recv(c->fd, &c->rd, &payload, &len, fds, 4, &nfds, ignored,
                         sizeof ignored) == SHARDD_OK) {
    Shardwire__Response *resp = shardwire__response__unpack(NULL, len, payload);
    if (resp && resp->seq == 0 && resp->code != SHARDWIRE__STATUS_CODE__OK) {
      rc = (shardd_err)resp->code;
      set_err(c, rc, "%s", resp->message ? resp->message : shardd_strerror(rc));
    }
    if (resp)
      shardwire__response__free_unpacked(resp, NULL);
  }
  for (int i = 0; i < nfds; i++)
    close(fds[i]);
  fcntl(c->fd, F_SETFL, flags);
  return rc;
}

/* The daemon's end of the connection is gone (EOF, ECONNRESET, EPIPE):
 * unless a last frame of its own says why (closed_reason), it stopped or
 * died, which the trainer must hear as such -- naming the daemon and what
 * to do -- rather than as the socket layer's "recv: Connection reset by
 * peer". */
static shardd_err daemon_gone(shardd_client_t *c, shardd_err rc) {
  char was[128]; /* the socket layer's few words */
  snprintf(was, sizeof was, "%.100s", c->err);
  rc = closed_reason(c, rc);
  if (rc != SHARDD_E_CLOSED)
    return rc;
  /* the frame layer's words for an end of stream repeat what this says */
  if (strcmp(was, "the daemon closed the connection") == 0)
    snprintf(was, sizeof was, "end of stream");
  return set_err(c, rc, "daemon at %s closed the connection (%s): it stopped "
                 "or died (a stop or restart, a crash, kill -9, the OOM "
                 "killer); the request's outcome is unknown. Find why in its "
                 "log (journalctl -u shardd), then reconnect once it serves "
                 "again: a daemon restarted with --restore brings the job back "
                 "at the step its log names, and relaunched ranks are told it",
                 c->socket_path, was);
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

static pool_map *find_pool(shardd_client_t *c, uint64_t id) {
  for (pool_map *p = c->pools; p; p = p->next)
    if (p->id == id)
      return p; /* newest first: a pool remapped larger shadows the old */
  return NULL;
}

/* A cuda daemon's pool: its IPC handle opened once on its device. */
static shardd_err pool_adopt_ipc(shardd_client_t *c,
                                 const Shardwire__GatherReply *gr, char *why,
                                 size_t whylen) {
  pool_map *p = find_pool(c, gr->pool);
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
  if (!cudart_ready()) {
    snprintf(why, whylen, "pool %" PRIu64 " lives in GPU memory (cuda backend): "
             "opening its CUDA IPC handle needs the CUDA runtime: %.300s",
             gr->pool, cudart.why);
    return SHARDD_E_NO_CUDA;
  }
  pool_map *n = malloc(sizeof *n);
  if (n == NULL) {
    snprintf(why, whylen, "out of memory");
    return SHARDD_E_NO_MEMORY;
  }
  const char *what = NULL;
  size_t avail = 0;
  int e = cuda_open(gr->cuda_ipc_handle.data, (int)gr->device, &n->base, &avail,
                    &what);
  if (e != 0) {
    snprintf(why, whylen, "pool %" PRIu64 ": %s: %s", gr->pool, what,
             e == -1 ? "no cuMemGetAddressRange_v2 to check the mapping's size"
             : e == -2 ? "a range that does not hold the opened pointer"
                       : cuda_str(e));
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

/* Makes sure the pool a GatherReply names is mapped: the first reply naming
 * it on this connection brings its descriptor (fd, else -1; the caller
 * closes it), later ones do not. Done for every GatherReply whichever call
 * reads it (gather, gather_area, an async gather's reply read by another
 * call): the descriptor comes once, so one dropped would leave the pool
 * unreachable for the connection's life. On failure why holds the reason. */
static shardd_err pool_adopt_ipc(shardd_client_t *c,
                                 const Shardwire__GatherReply *gr, char *why,
                                 size_t whylen);

static shardd_err pool_adopt(shardd_client_t *c, const Shardwire__GatherReply *gr,
                             int fd, char *why, size_t whylen) {
  pool_map *p = find_pool(c, gr->pool);
  if (fd < 0 && gr->has_cuda_ipc_handle)
    return pool_adopt_ipc(c, gr, why, whylen);
  if (fd < 0) {
    if (p == NULL) {
      snprintf(why, whylen, "the daemon's gather reply names pool %" PRIu64
               ", which this connection has not mapped, and carries no "
               "descriptor for it (a cuda backend sends none yet; the first "
               "reply naming a pool must carry it)", gr->pool);
      return SHARDD_E_PROTOCOL;
    }
    if (gr->pool_bytes > p->len) {
      snprintf(why, whylen, "the daemon's gather reply gives pool %" PRIu64
               " %" PRIu64 " bytes, but the %zu mapped here came without a "
               "new descriptor", gr->pool, gr->pool_bytes, p->len);
      return SHARDD_E_PROTOCOL;
    }
    return SHARDD_OK;
  }
  if (p && p->len >= gr->pool_bytes)
    return SHARDD_OK; /* sent again: the mapping there is the same file */
  if (gr->pool_bytes == 0 || (uint64_t)(size_t)gr->pool_bytes != gr->pool_bytes) {
    snprintf(why, whylen, "pool %" PRIu64 ": size %" PRIu64 " cannot be mapped",
             gr->pool, gr->pool_bytes);
    return SHARDD_E_PROTOCOL;
  }
  intmax_t size;
  switch (memfd_unfit(fd, gr->pool_bytes, &size)) {
  case 1:
    snprintf(why, whylen, "pool %" PRIu64 ": the daemon's descriptor holds "
             "%jd bytes, not the %" PRIu64 " of the pool", gr->pool, size,
             gr->pool_bytes);
    return SHARDD_E_PROTOCOL;
  case 2:
    snprintf(why, whylen, "pool %" PRIu64 ": the daemon's descriptor is not a "
             "memfd sealed against shrinking (F_SEAL_SHRINK)", gr->pool);
    return SHARDD_E_PROTOCOL;
  default:
    break;
  }
  /* A descriptor opened read-only is the daemon's way of keeping trainers
   * from writing a copy other ranks read: map it so, where a writable map
   * would fail. */
  int acc = fcntl(fd, F_GETFL);
  int prot = acc >= 0 && (acc & O_ACCMODE) == O_RDONLY ? PROT_READ
                                                       : PROT_READ | PROT_WRITE;
  pool_map *n = malloc(sizeof *n);
  if (n == NULL) {
    snprintf(why, whylen, "out of memory");
    return SHARDD_E_NO_MEMORY;
  }
  n->base = mmap(NULL, (size_t)gr->pool_bytes, prot, MAP_SHARED, fd, 0);
  if (n->base == MAP_FAILED) {
    snprintf(why, whylen, "mmap of pool %" PRIu64 " (%" PRIu64 " bytes): %s",
             gr->pool, gr->pool_bytes, strerror(errno));
    free(n);
    return SHARDD_E_IO;
  }
  /* A pool remade larger keeps its old mapping too, until close: areas
   * handed out from it may still be read by the caller. */
  n->id = gr->pool;
  n->len = (size_t)gr->pool_bytes;
  n->device = -1;
  n->next = c->pools;
  c->pools = n;
  return SHARDD_OK;
}

static async_op *find_async(shardd_client_t *c, uint64_t seq) {
  for (async_op *a = c->async; a; a = a->next)
    if (a->seq == seq)
      return a;
  return NULL;
}

/* Keeps an async gather's result for shardd_wait: code (the daemon's, or
 * why its pool could not be mapped) with msg (NULL: none), and where its
 * areas are. */
static void async_note(async_op *a, const Shardwire__Response *resp,
                       shardd_err code, const char *msg) {
  a->done = 1;
  a->code = code;
  a->msg = code != SHARDD_OK && msg && msg[0] ? strdup(msg) : NULL;
  if (code == SHARDD_OK && resp->body_case == SHARDWIRE__RESPONSE__BODY_GATHER) {
    a->has_area = 1;
    a->pool = resp->gather->pool;
    a->gather_off = resp->gather->gather_offset;
  }
}

static double mono_now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + (double)t.tv_nsec / 1e9;
}

/* c->timeout in ms for the frame layer (-1: none). */
static int timeout_ms(const shardd_client_t *c) {
  if (!(c->timeout > 0))
    return -1;
  return c->timeout >= INT_MAX / 1000 ? INT_MAX : (int)(c->timeout * 1000.0 + 0.5);
}

/* The liveness probe: a Ping sent while a call waits. The daemon answers a
 * session's requests as each completes, not in order, so its Pong comes
 * back while a collective of the session still waits for a slow peer: it
 * proves the daemon alive without failing the collective. Returns its seq,
 * 0 when it could not be sent (the wait goes on; a daemon that is gone
 * shows as the connection closing). */
static uint64_t send_probe(shardd_client_t *c) {
  Shardwire__Request req = SHARDWIRE__REQUEST__INIT;
  Shardwire__Ping ping = SHARDWIRE__PING__INIT;
  req.body_case = SHARDWIRE__REQUEST__BODY_PING;
  req.ping = &ping;
  req.seq = ++c->seq;
  uint8_t buf[64];
  size_t n = shardwire__request__get_packed_size(&req);
  if (n > sizeof buf)
    return 0;
  shardwire__request__pack(&req, buf);
  char why[128];
  /* a tiny frame: a socket buffer with no room for it means the daemon has
   * read nothing for a while, and the wait below decides */
  shardd_err rc = shardd__frame_send_within(c->fd, buf, n, 0, why, sizeof why);
  if (rc == SHARDD_E_TIMEOUT) {
    /* nothing of it was written (a socket write of a few bytes is whole
     * or nothing), so the stream is intact */
    return 0;
  }
  return rc == SHARDD_OK ? req.seq : 0;
}

/* Sends req with the next seq. */
static shardd_err send_req(shardd_client_t *c, Shardwire__Request *req) {
  if (c->fd < 0)
    return set_err(c, SHARDD_E_CLOSED, "the connection was closed earlier");
  req->seq = ++c->seq;
  size_t n = shardwire__request__get_packed_size(req);
  if (n > SHARDD_MAX_FRAME)
    return set_err(c, SHARDD_E_FRAME_TOO_LARGE,
                   "request of %zu bytes exceeds the %u-byte frame limit", n,
                   SHARDD_MAX_FRAME);
  uint8_t *buf = malloc(n ? n : 1);
  if (buf == NULL)
    return set_err(c, SHARDD_E_NO_MEMORY, "out of memory");
  shardwire__request__pack(req, buf);
  shardd_err rc = shardd__frame_send_within(c->fd, buf, n, timeout_ms(c),
                                            c->err, sizeof c->err);
  free(buf);
  if (rc != SHARDD_OK) { /* the reason is the frame layer's, in err */
    free(c->err_long);
    c->err_long = NULL;
  }
  if (rc == SHARDD_E_TIMEOUT) {
    /* part of the frame may be written: the stream cannot go on */
    close(c->fd);
    c->fd = -1;
    return set_err(c, rc, "daemon at %s did not answer for %g s: it read "
                   "none of a request for that long (stopped or hung?); "
                   "the connection is closed", c->socket_path, c->timeout);
  }
  if (rc == SHARDD_E_CLOSED)
    rc = daemon_gone(c, rc);
  return rc;
}

/* Reads responses until the one to seq. Replies to outstanding async
 * requests that arrive first are kept for shardd_wait; others (to requests
 * nobody waits for any more) are dropped, but a pool descriptor any gather
 * reply brings is mapped (pool_adopt). On SHARDD_OK *out is the response
 * (caller frees with shardwire__response__free_unpacked); a daemon error
 * code, or the reason a gather reply's pool could not be mapped, is
 * returned with its message in c->err and *out still set. A descriptor
 * that came with the reply is returned in *fd (else -1); a gather reply's
 * is the pool's and is never returned. */
/* With many set, the descriptors of the reply to seq (at most maxmany) are
 * returned there in order, counted in *nmany, instead of in *fd. */
static shardd_err recv_for_many(shardd_client_t *c, uint64_t seq,
                                Shardwire__Response **out, int *fd, int *many,
                                int maxmany, int *nmany) {
  *out = NULL;
  if (fd)
    *fd = -1;
  if (nmany)
    *nmany = 0;
  int local[4];
  int *fds = many ? many : local;
  int maxfds = many ? maxmany : 4;
  if (c->fd < 0)
    return set_err(c, SHARDD_E_CLOSED, "the connection was closed earlier");
  /* Liveness: after half the timeout without a frame, a Ping goes out;
   * silence for the whole timeout (the Ping unanswered for at least half
   * of it) fails the call. Any frame restarts the clock, so a collective
   * waiting on a slow peer for as long as --collective-timeout lasts. */
  double heard = mono_now();
  uint64_t probe = 0; /* the Ping's seq while its Pong is awaited */
  int pinged = 0;     /* a Ping went out (or could not) since the last Pong */
  for (;;) {
    const uint8_t *payload;
    size_t len;
    int nfds = 0;
    int wait_ms = -1;
    if (c->timeout > 0) {
      double left = heard + (pinged ? c->timeout : c->timeout / 2) - mono_now();
      wait_ms = left <= 0 ? 0 : left >= INT_MAX / 1000 ? INT_MAX
                                                       : (int)(left * 1000.0) + 1;
    }
    shardd_err rc = shardd__frame_recv_within(c->fd, &c->rd, &payload, &len, fds,
                                              maxfds, &nfds, wait_ms, c->err,
                                              sizeof c->err);
    if (rc == SHARDD_E_TIMEOUT) {
      for (int i = 0; i < nfds; i++)
        close(fds[i]);
      if (!pinged) {
        pinged = 1;
        probe = send_probe(c);
        continue;
      }
      if (mono_now() - heard < c->timeout)
        continue;
      /* the request stays outstanding: a reply that comes later is
       * dropped as one nobody waits for, so the connection stays usable */
      return set_err(c, SHARDD_E_TIMEOUT, "daemon at %s did not answer for "
                     "%g s (%s: is it stopped or hung?); the request's "
                     "outcome is unknown", c->socket_path, c->timeout,
                     probe ? "a Ping went unanswered too"
                           : "it did not read a Ping either");
    }
    if (rc != SHARDD_OK) {
      free(c->err_long); /* the reason is the frame layer's, in err */
      c->err_long = NULL;
      /* descriptors of a frame that never completed belong to no reply */
      for (int i = 0; i < nfds; i++)
        close(fds[i]);
      /* An oversized header cannot be skipped: every later read would hit
       * it again, so the connection is given up (mappings stay valid). */
      if (rc == SHARDD_E_FRAME_TOO_LARGE) {
        close(c->fd);
        c->fd = -1;
      }
      return rc == SHARDD_E_CLOSED ? daemon_gone(c, rc) : rc;
    }
    heard = mono_now();
    Shardwire__Response *resp = shardwire__response__unpack(NULL, len, payload);
    if (resp == NULL) {
      for (int i = 0; i < nfds; i++)
        close(fds[i]);
      return set_err(c, SHARDD_E_PROTOCOL,
                     "the daemon's %zu-byte reply could not be decoded", len);
    }
    if (probe != 0 && resp->seq == probe)
      probe = 0, pinged = 0; /* the daemon lives: the next silence pings */
    /* A gather's reply may bring a pool's descriptor, its only one: mapped
     * here for every reply, the one waited for or not. */
    shardd_err pool_rc = SHARDD_OK;
    char why[512] = "";
    if (resp->code == SHARDWIRE__STATUS_CODE__OK &&
        resp->body_case == SHARDWIRE__RESPONSE__BODY_GATHER) {
      pool_rc = pool_adopt(c, resp->gather, nfds > 0 ? fds[0] : -1, why,
                           sizeof why);
      for (int i = 0; i < nfds; i++)
        close(fds[i]);
      nfds = 0;
    }
    /* seq 0 is the daemon speaking about the connection itself. */
    if (resp->seq != seq && resp->seq != 0) {
      async_op *a = find_async(c, resp->seq);
      if (a && !a->done) {
        if (pool_rc != SHARDD_OK)
          async_note(a, resp, pool_rc, why);
        else
          async_note(a, resp, (shardd_err)resp->code, resp->message);
      }
      for (int i = 0; i < nfds; i++)
        close(fds[i]);
      shardwire__response__free_unpacked(resp, NULL);
      continue;
    }
    if (pool_rc != SHARDD_OK) {
      *out = resp;
      return set_err(c, pool_rc, "%s", why);
    }
    *out = resp;
    rc = (shardd_err)resp->code;
    if (many) {
      if (rc != SHARDD_OK) {
        for (int i = 0; i < nfds; i++)
          close(fds[i]);
        nfds = 0;
      }
      *nmany = nfds;
    } else {
      for (int i = 0; i < nfds; i++) {
        if (fd && *fd < 0 && rc == SHARDD_OK)
          *fd = fds[i];
        else
          close(fds[i]);
      }
    }
    if (rc != SHARDD_OK)
      set_err(c, rc, "%s", resp->message ? resp->message : shardd_strerror(rc));
    return rc;
  }
}

static shardd_err recv_for(shardd_client_t *c, uint64_t seq,
                           Shardwire__Response **out, int *fd) {
  return recv_for_many(c, seq, out, fd, NULL, 0, NULL);
}

/* Sends req and waits for the response to it (see recv_for). */
static shardd_err call(shardd_client_t *c, Shardwire__Request *req,
                       Shardwire__Response **out, int *fd) {
  *out = NULL;
  if (fd)
    *fd = -1;
  clear_err(c); /* the last error is the last failed call's, not older */
  shardd_err rc = send_req(c, req);
  if (rc != SHARDD_OK)
    return rc;
  return recv_for(c, req->seq, out, fd);
}

/* A call whose reply body must be of one kind. */
static shardd_err call_expect(shardd_client_t *c, Shardwire__Request *req,
                              Shardwire__Response__BodyCase want,
                              Shardwire__Response **out, int *fd) {
  shardd_err rc = call(c, req, out, fd);
  if (rc == SHARDD_OK && (*out)->body_case != want) {
    int got = (int)(*out)->body_case;
    shardwire__response__free_unpacked(*out, NULL);
    *out = NULL;
    if (fd && *fd >= 0) {
      close(*fd);
      *fd = -1;
    }
    return set_err(c, SHARDD_E_PROTOCOL,
                   "the daemon answered with body %d, expected %d", got,
                   (int)want);
  }
  return rc;
}

static shardd_err call_status_only(shardd_client_t *c, Shardwire__Request *req) {
  Shardwire__Response *resp;
  shardd_err rc = call(c, req, &resp, NULL);
  if (resp)
    shardwire__response__free_unpacked(resp, NULL);
  return rc;
}

/* The connect error for socket_path, naming what is missing or refused:
 * ENOENT was the same "No such file or directory" for a daemon that is not
 * running and for a socket directory that does not exist. */
static shardd_err connect_error(shardd_client_t *c, const char *socket_path,
                                int e) {
  char dir[sizeof ((struct sockaddr_un *)0)->sun_path];
  snprintf(dir, sizeof dir, "%s", socket_path);
  char *slash = strrchr(dir, '/');
  if (slash == dir)
    slash[1] = '\0';
  else if (slash)
    *slash = '\0';
  else
    snprintf(dir, sizeof dir, ".");
  struct stat st;
  const char *pre = "cannot connect to shardd at";
  if (e == ENOENT && stat(dir, &st) != 0 && (errno == ENOENT || errno == ENOTDIR))
    return set_err(c, SHARDD_E_CONNECT, "%s %s: directory %s does not exist "
                   "(is shardd installed and started?)", pre, socket_path, dir);
  if (e == ENOENT)
    return set_err(c, SHARDD_E_CONNECT, "%s %s: no socket there (is shardd "
                   "running? --socket or SHARDD_SOCKET name another)", pre,
                   socket_path);
  if (e == EACCES)
    return set_err(c, SHARDD_E_CONNECT, "%s %s: permission denied (this user "
                   "may not open the socket or search %s; the packaged socket "
                   "is for group shardd)", pre, socket_path, dir);
  if (e == ECONNREFUSED)
    return set_err(c, SHARDD_E_CONNECT, "%s %s: connection refused (a socket "
                   "file no daemon listens on)", pre, socket_path);
  return set_err(c, SHARDD_E_CONNECT, "%s %s: %s", pre, socket_path, strerror(e));
}

/* c->timeout from opts (when the caller's struct reaches the field), else
 * $SHARDD_TIMEOUT, else the default. */
static shardd_err pick_timeout(shardd_client_t *c,
                               const shardd_connect_opts *opts) {
  c->timeout = SHARDD_DEFAULT_TIMEOUT;
  if (opts && opts->size >= offsetof(shardd_connect_opts, timeout_s) +
                                sizeof opts->timeout_s &&
      opts->timeout_s != 0) {
    if (isnan(opts->timeout_s))
      return set_err(c, SHARDD_E_INVAL, "timeout_s is NaN");
    c->timeout = opts->timeout_s;
    return SHARDD_OK;
  }
  const char *env = getenv("SHARDD_TIMEOUT");
  if (env && env[0]) {
    char *end;
    errno = 0;
    double v = strtod(env, &end);
    if (errno != 0 || *end != '\0' || end == env || isnan(v) || v < 0)
      return set_err(c, SHARDD_E_INVAL, "SHARDD_TIMEOUT=%s is not a number of "
                     "seconds (0: no timeout)", env);
    c->timeout = v == 0 ? -1 : v;
  }
  return SHARDD_OK;
}

shardd_err shardd_connect(const char *socket_path,
                          const shardd_connect_opts *opts,
                          shardd_client_t **out, char *errbuf, size_t errlen) {
  if (out == NULL) {
    if (errbuf && errlen)
      snprintf(errbuf, errlen, "shardd_connect: out is NULL");
    return SHARDD_E_INVAL;
  }
  *out = NULL;
  if (socket_path == NULL || socket_path[0] == '\0') {
    socket_path = getenv("SHARDD_SOCKET");
    if (socket_path == NULL || socket_path[0] == '\0')
      socket_path = SHARDD_DEFAULT_SOCKET;
  }
  shardd_client_t *c = calloc(1, sizeof *c);
  if (c == NULL) {
    if (errbuf)
      snprintf(errbuf, errlen, "out of memory");
    return SHARDD_E_NO_MEMORY;
  }
  c->fd = -1; /* calloc's 0 is stdin, which the failure path would close */
  shardd__frame_reader_init(&c->rd, SHARDD_MAX_FRAME);
  struct sockaddr_un sa = {.sun_family = AF_UNIX};
  shardd_err rc;
  if (strlen(socket_path) >= sizeof sa.sun_path) {
    rc = set_err(c, SHARDD_E_INVAL, "socket path %s is too long", socket_path);
    goto fail;
  }
  snprintf(sa.sun_path, sizeof sa.sun_path, "%s", socket_path);
  snprintf(c->socket_path, sizeof c->socket_path, "%s", socket_path);
  rc = pick_timeout(c, opts);
  if (rc != SHARDD_OK)
    goto fail;
  c->fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (c->fd < 0) {
    rc = set_err(c, SHARDD_E_IO, "socket: %s", strerror(errno));
    goto fail;
  }
  if (connect(c->fd, (struct sockaddr *)&sa, sizeof sa) != 0) {
    rc = connect_error(c, socket_path, errno);
    goto fail;
  }

  Shardwire__Request req = SHARDWIRE__REQUEST__INIT;
  Shardwire__Hello hello = SHARDWIRE__HELLO__INIT;
  hello.protocol_version = SHARDD_PROTOCOL_VERSION;
  if (opts && opts->job && opts->job[0]) {
    hello.job = (char *)opts->job;
    hello.has_rank = 1;
    hello.rank = opts->rank;
    hello.has_world = 1;
    hello.world = opts->world;
  }
  if (opts && opts->client_name)
    hello.client_name = (char *)opts->client_name;
  /* Read only when the caller's struct reaches it: one built against an
   * older header ends before, and what lies there is not ours. Sent only
   * when asked, so a plain Hello stays what older daemons know. */
  if (opts && opts->size >= offsetof(shardd_connect_opts, transient_areas) +
                                sizeof opts->transient_areas &&
      opts->transient_areas) {
    hello.has_transient_areas = 1;
    hello.transient_areas = 1;
  }
  req.body_case = SHARDWIRE__REQUEST__BODY_HELLO;
  req.hello = &hello;
  Shardwire__Response *resp;
  rc = call_expect(c, &req, SHARDWIRE__RESPONSE__BODY_HELLO, &resp, NULL);
  if (rc != SHARDD_OK) {
    if (resp)
      shardwire__response__free_unpacked(resp, NULL);
    goto fail;
  }
  /* A daemon of another protocol may read these messages differently:
   * refusing here beats a wrong answer later. */
  if (resp->hello->protocol_version != SHARDD_PROTOCOL_VERSION) {
    rc = set_err(c, SHARDD_E_VERSION,
                 "protocol version mismatch: the daemon at %s (shardd %s) "
                 "speaks protocol %" PRIu32 ", this client (libshardd %s) "
                 "speaks protocol %d; use a libshardd of the daemon's version",
                 socket_path, resp->hello->daemon_version,
                 resp->hello->protocol_version, SHARDD_VERSION,
                 SHARDD_PROTOCOL_VERSION);
    shardwire__response__free_unpacked(resp, NULL);
    goto fail;
  }
  c->max_async = opts && opts->size >= offsetof(shardd_connect_opts, max_inflight_gathers) +
                                        sizeof opts->max_inflight_gathers &&
                          opts->max_inflight_gathers
                      ? opts->max_inflight_gathers
                      : 2;
  snprintf(c->version, sizeof c->version, "%s", resp->hello->daemon_version);
  snprintf(c->backend, sizeof c->backend, "%s", resp->hello->backend);
  c->bucket_max = SHARDD_BUCKET_PER_REQUEST;
  if (resp->hello->has_max_pending && resp->hello->max_pending > 0 &&
      resp->hello->max_pending < c->bucket_max)
    c->bucket_max = resp->hello->max_pending;
  c->resumed = resp->hello->has_resumed && resp->hello->resumed;
  c->resumed_step = resp->hello->resumed_step;
  shardwire__response__free_unpacked(resp, NULL);
  clear_err(c);
  *out = c;
  return SHARDD_OK;

fail:
  if (errbuf)
    snprintf(errbuf, errlen, "%s", shardd_last_error(c));
  if (c->fd >= 0)
    close(c->fd);
  shardd__frame_reader_free(&c->rd);
  free(c->err_long);
  free(c);
  return rc;
}

void shardd_set_timeout(shardd_client_t *c, double timeout_s) {
  if (c == NULL || isnan(timeout_s))
    return;
  c->timeout = timeout_s == 0 ? SHARDD_DEFAULT_TIMEOUT : timeout_s;
}

static size_t maps_slot(const shardd_client_t *c, uint64_t id) {
  /* Fibonacci hashing: ids are consecutive, the multiply spreads them */
  return (size_t)((id * UINT64_C(0x9E3779B97F4A7C15)) >> 32) & (c->maps_cap - 1);
}

/* Links m into c's table (one mapping per buffer id: buffer_adopt drops a
 * stale one first); fails (E_NO_MEMORY) only when no table can be made: one
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

static void unmap_buffer(shardd_client_t *c, uint64_t id) {
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

void shardd_close(shardd_client_t *c) {
  if (c == NULL)
    return;
  while (c->async) {
    async_op *a = c->async;
    c->async = a->next;
    free(a->msg);
    free(a);
  }
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
  if (c->fd >= 0)
    close(c->fd);
  shardd__frame_reader_free(&c->rd);
  free(c->err_long);
  free(c);
}

shardd_err shardd_finish(shardd_client_t *c) {
  if (c == NULL)
    return SHARDD_OK;
  Shardwire__Request req = SHARDWIRE__REQUEST__INIT;
  Shardwire__Goodbye bye = SHARDWIRE__GOODBYE__INIT;
  req.body_case = SHARDWIRE__REQUEST__BODY_GOODBYE;
  req.goodbye = &bye;
  /* answered: the daemon has read it before the close it precedes */
  shardd_err rc = call_status_only(c, &req);
  shardd_close(c);
  return rc;
}

int shardd_resumed(const shardd_client_t *c, uint64_t *step) {
  if (step)
    *step = c && c->resumed ? c->resumed_step : 0;
  return c != NULL && c->resumed;
}

shardd_err shardd_ping(shardd_client_t *c) {
  if (c == NULL)
    return SHARDD_E_INVAL; /* no client to hold a message */

  Shardwire__Request req = SHARDWIRE__REQUEST__INIT;
  Shardwire__Ping ping = SHARDWIRE__PING__INIT;
  req.body_case = SHARDWIRE__REQUEST__BODY_PING;
  req.ping = &ping;
  return call_status_only(c, &req);
}

static shardd_err get_status(shardd_client_t *c, uint32_t first_job,
                             Shardwire__Response **resp) {
  Shardwire__Request req = SHARDWIRE__REQUEST__INIT;
  Shardwire__StatusRequest st = SHARDWIRE__STATUS_REQUEST__INIT;
  if (first_job > 0) {
    st.has_first_job = 1;
    st.first_job = first_job;
  }
  req.body_case = SHARDWIRE__REQUEST__BODY_STATUS;
  req.status = &st;
  return call_expect(c, &req, SHARDWIRE__RESPONSE__BODY_STATUS, resp, NULL);
}

static shardd_err status_fmt(shardd_client_t *c, uint32_t first_job,
                             char **out, int json) {
  *out = NULL;
  Shardwire__Response *resp;
  shardd_err rc = get_status(c, first_job, &resp);
  if (rc == SHARDD_OK) {
    *out = json ? shardd__fmt_status_json(resp->status)
                : shardd__fmt_status_text(resp->status);
    if (*out == NULL)
      rc = set_err(c, SHARDD_E_NO_MEMORY, "out of memory formatting status");
  }
  if (resp)
    shardwire__response__free_unpacked(resp, NULL);
  return rc;
}

shardd_err shardd_status_json(shardd_client_t *c, char **out) {
  if (c == NULL)
    return SHARDD_E_INVAL; /* no client to hold a message */
  if (out == NULL)
    return set_err(c, SHARDD_E_INVAL, "shardd_status_json: out is NULL");

  return status_fmt(c, 0, out, 1);
}

shardd_err shardd_status_json_from(shardd_client_t *c, uint32_t first_job,
                                   char **out) {
  if (c == NULL)
    return SHARDD_E_INVAL; /* no client to hold a message */
  if (out == NULL)
    return set_err(c, SHARDD_E_INVAL, "shardd_status_json_from: out is NULL");
  return status_fmt(c, first_job, out, 1);
}

shardd_err shardd_status_text_from(shardd_client_t *c, uint32_t first_job,
                                   char **out) {
  if (c == NULL)
    return SHARDD_E_INVAL; /* no client to hold a message */
  if (out == NULL)
    return set_err(c, SHARDD_E_INVAL, "shardd_status_text_from: out is NULL");
  return status_fmt(c, first_job, out, 0);
}

shardd_err shardd_status_text(shardd_client_t *c, char **out) {
  if (c == NULL)
    return SHARDD_E_INVAL; /* no client to hold a message */
  if (out == NULL)
    return set_err(c, SHARDD_E_INVAL, "shardd_status_text: out is NULL");

  return status_fmt(c, 0, out, 0);
}

static shardd_err inspect_fmt(shardd_client_t *c, uint64_t id,
                              const char *name, char **out, int json) {
  *out = NULL;
  Shardwire__Request req = SHARDWIRE__REQUEST__INIT;
  Shardwire__Inspect in = SHARDWIRE__INSPECT__INIT;
  if (id) {
    in.has_id = 1;
    in.id = id;
  }
  in.name = (char *)name;
  req.body_case = SHARDWIRE__REQUEST__BODY_INSPECT;
  req.inspect = &in;
  Shardwire__Response *resp;
  shardd_err rc = call_expect(c, &req, SHARDWIRE__RESPONSE__BODY_INSPECT, &resp, NULL);
  if (rc == SHARDD_OK) {
    *out = json ? shardd__fmt_inspect_json(resp->inspect)
                : shardd__fmt_inspect_text(resp->inspect);
    if (*out == NULL)
      rc = set_err(c, SHARDD_E_NO_MEMORY, "out of memory formatting inspect");
  }
  if (resp)
    shardwire__response__free_unpacked(resp, NULL);
  return rc;
}

shardd_err shardd_inspect_json(shardd_client_t *c, uint64_t id,
                               const char *name, char **out) {
  if (c == NULL)
    return SHARDD_E_INVAL; /* no client to hold a message */
  if (out == NULL)
    return set_err(c, SHARDD_E_INVAL, "shardd_inspect_json: out is NULL");

  return inspect_fmt(c, id, name, out, 1);
}

shardd_err shardd_inspect_text(shardd_client_t *c, uint64_t id,
                               const char *name, char **out) {
  if (c == NULL)
    return SHARDD_E_INVAL; /* no client to hold a message */
  if (out == NULL)
    return set_err(c, SHARDD_E_INVAL, "shardd_inspect_text: out is NULL");

  return inspect_fmt(c, id, name, out, 0);
}

/* Checks br's layout and maps (or finds the mapping of) its block from fd
 * (host) or its CUDA IPC handle, filling out. fd stays the caller's. */
static shardd_err buffer_adopt(shardd_client_t *c,
                               const Shardwire__BufferReply *br, int fd,
                               shardd_buffer_info *out) {
  shardd_err rc = SHARDD_OK;
  size_t esz = shardd_dtype_size((shardd_dtype)br->dtype);
  int transient = br->has_transient && br->transient;
  int device = -1; /* host mapping */
  /* The reply is checked before anything is mapped: the pointers handed
   * out are computed from it, so a wrong layout would have the caller
   * write past the mapping. */
  const char *bad = NULL;
  if (esz == 0)
    bad = "unknown dtype";
  else if (br->world == 0 || br->rank >= br->world ||
           br->numel > br->padded_numel ||
           br->shard_numel > br->padded_numel / br->world ||
           br->shard_numel * br->world != br->padded_numel)
    bad = "element counts"; /* rank * shard_numel indexes the gather area */
  else if (br->block_bytes == 0 ||
           (uint64_t)(size_t)br->block_bytes != br->block_bytes)
    bad = "block size";
  else if (!area_ok(br->shard_offset, br->shard_numel, esz, br->block_bytes))
    bad = "shard area";
  /* a transient block has no gather or gradient area: its offsets are 0
   * and unused, each gather's reply says where the areas are */
  else if (!transient &&
           !area_ok(br->gather_offset, br->padded_numel, esz, br->block_bytes))
    bad = "gather area";
  else if (!transient &&
           !area_ok(br->grad_offset, br->padded_numel, esz, br->block_bytes))
    bad = "gradient area";
  else if (br->has_reduced_offset &&
           !area_ok(br->reduced_offset, br->shard_numel, 4, br->block_bytes))
    bad = "reduced-gradient area";
  if (bad) {
    rc = set_err(c, SHARDD_E_PROTOCOL,
                 "buffer %" PRIu64 ": inconsistent layout (%s) in a block of "
                 "%" PRIu64 " bytes", br->id, bad, br->block_bytes);
    return rc;
  }
  if (fd < 0 && br->has_cuda_ipc_handle) {
    if (br->cuda_ipc_handle.len != CUDA_IPC_BYTES) {
      rc = set_err(c, SHARDD_E_PROTOCOL,
                   "buffer %" PRIu64 ": CUDA IPC handle of %zu bytes, not %d",
                   br->id, br->cuda_ipc_handle.len, CUDA_IPC_BYTES);
      return rc;
    }
    /* -1 is the host marker of a mapping; larger ordinals wrap into it */
    if (br->device > INT_MAX) {
      rc = set_err(c, SHARDD_E_PROTOCOL,
                   "buffer %" PRIu64 ": CUDA device %" PRIu32 " out of range",
                   br->id, br->device);
      return rc;
    }
    if (!cudart_ready()) {
      rc = set_err(c, SHARDD_E_NO_CUDA,
                   "buffer %" PRIu64 " lives in GPU memory (cuda backend): "
                   "opening its CUDA IPC handle needs the CUDA runtime: %s; "
                   "or run the daemon with --backend host to use host memory",
                   br->id, cudart.why);
      return rc;
    }
    device = (int)br->device;
  } else if (fd < 0) {
    rc = set_err(c, SHARDD_E_PROTOCOL,
                 "the daemon sent no descriptor for buffer %" PRIu64
                 " (is this a cuda backend? this call maps host memory)",
                 br->id);
    return rc;
  } else {
    intmax_t size;
    int unfit = memfd_unfit(fd, br->block_bytes, &size);
    if (unfit == 1) {
      rc = set_err(c, SHARDD_E_PROTOCOL,
                   "buffer %" PRIu64 ": the daemon's descriptor holds %jd "
                   "bytes, not the %" PRIu64 " of its block", br->id, size,
                   br->block_bytes);
      return rc;
    }
    if (unfit == 2) {
      rc = set_err(c, SHARDD_E_PROTOCOL,
                   "buffer %" PRIu64 ": the daemon's descriptor is not a memfd "
                   "sealed against shrinking (F_SEAL_SHRINK)", br->id);
      return rc;
    }
  }
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
    return set_err(c, SHARDD_E_PROTOCOL,
                   "buffer %" PRIu64 ": the daemon sent a block of %" PRIu64
                   " bytes on device %d; this connection mapped it as %zu "
                   "bytes on device %d", br->id, br->block_bytes, device,
                   had->len, had->device);
  if (base == NULL) {
    mapping *m = malloc(sizeof *m);
    if (m == NULL) {
      rc = set_err(c, SHARDD_E_NO_MEMORY, "out of memory");
      return rc;
    }
    if (device >= 0) {
      const char *what;
      size_t avail = 0;
      int e = cuda_open(br->cuda_ipc_handle.data, device, &base, &avail, &what);
      if (e == -1) {
        free(m);
        rc = set_err(c, SHARDD_E_NO_CUDA,
                     "buffer %" PRIu64 ": the CUDA IPC handle opened, but its "
                     "size cannot be checked against the %" PRIu64 " bytes "
                     "advertised: neither the runtime nor libcuda.so.1 has "
                     "cuMemGetAddressRange_v2", br->id, br->block_bytes);
        return rc;
      }
      if (e == -2) {
        free(m);
        rc = set_err(c, SHARDD_E_IO,
                     "buffer %" PRIu64 ": cuMemGetAddressRange_v2 gave a range "
                     "that does not hold the opened pointer", br->id);
        return rc;
      }
      if (e == 0 && avail < br->block_bytes) {
        unmap(&(mapping){.base = base, .device = device});
        free(m);
        rc = set_err(c, SHARDD_E_PROTOCOL,
                     "buffer %" PRIu64 ": the CUDA IPC handle maps %zu bytes, "
                     "fewer than the %" PRIu64 " bytes the daemon advertised "
                     "for its block", br->id, avail, br->block_bytes);
        return rc;
      }
      if (e != 0 && what == range_call) { /* its CUresult is no cudaError_t */
        free(m);
        rc = set_err(c, SHARDD_E_IO,
                     "buffer %" PRIu64 ": measuring its opened CUDA IPC mapping: "
                     "%s failed (CUresult %d)", br->id, what, e);
        return rc;
      }
      if (e != 0) {
        free(m);
        rc = set_err(c, SHARDD_E_IO,
                     "opening the CUDA IPC handle of buffer %" PRIu64
                     " (%" PRIu64 " bytes on CUDA device %d): %s: %s "
                     "(error %d); the trainer "
                     "must see the daemon's GPUs under the same ordinals "
                     "(CUDA_VISIBLE_DEVICES) and be another process",
                     br->id, br->block_bytes, device, what, cuda_str(e), e);
        return rc;
      }
    } else {
      base = mmap(NULL, br->block_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
      if (base == MAP_FAILED) {
        free(m);
        rc = set_err(c, SHARDD_E_IO, "mmap of buffer %" PRIu64 " (%" PRIu64
                     " bytes): %s", br->id, br->block_bytes, strerror(errno));
        return rc;
      }
    }
    m->buffer = br->id;
    m->base = base;
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
      return set_err(c, SHARDD_E_NO_MEMORY, "out of memory");
    }
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
  out->reduced = br->has_reduced_offset ? (char *)base + br->reduced_offset : NULL;
  out->generation = br->has_generation ? br->generation : 0;
  out->is_device = device >= 0;
  out->transient = transient;
  out->existing = br->has_existing && br->existing;

  return rc;
}

shardd_err shardd_buffer_register(shardd_client_t *c, const char *name,
                                  shardd_dtype dtype, uint64_t numel,
                                  shardd_buffer_info *out) {
  return shardd_buffer_register_opts(c, name, dtype, numel, NULL, out);
}

shardd_err shardd_buffer_register_opts(shardd_client_t *c, const char *name,
                                       shardd_dtype dtype, uint64_t numel,
                                       const shardd_buffer_opts *opts,
                                       shardd_buffer_info *out) {
  if (c == NULL)
    return SHARDD_E_INVAL; /* no client to hold a message */
  if (out == NULL)
    return set_err(c, SHARDD_E_INVAL, "shardd_buffer_register: out is NULL");

  memset(out, 0, sizeof *out);
  if (name == NULL)
    return set_err(c, SHARDD_E_INVAL, "buffer name is NULL");
  Shardwire__Request req = SHARDWIRE__REQUEST__INIT;
  Shardwire__RegisterBuffer rb = SHARDWIRE__REGISTER_BUFFER__INIT;
  rb.name = (char *)name;
  rb.dtype = (Shardwire__DType)dtype;
  rb.numel = numel;
  if (opts && opts->size >= offsetof(shardd_buffer_opts, init_checksum) +
                                sizeof opts->init_checksum &&
      opts->has_init_checksum) {
    rb.has_init_checksum = 1;
    rb.init_checksum = opts->init_checksum;
  }
  req.body_case = SHARDWIRE__REQUEST__BODY_REGISTER_BUFFER;
  req.register_buffer = &rb;
  Shardwire__Response *resp;
  int fd;
  shardd_err rc = call_expect(c, &req, SHARDWIRE__RESPONSE__BODY_BUFFER, &resp, &fd);
  if (rc != SHARDD_OK) {
    if (resp)
      shardwire__response__free_unpacked(resp, NULL);
    return rc;
  }
  rc = buffer_adopt(c, resp->buffer, fd, out);
  if (rc != SHARDD_OK)
    memset(out, 0, sizeof *out);
  if (fd >= 0)
    close(fd);
  shardwire__response__free_unpacked(resp, NULL);
  return rc;
}

shardd_err shardd_buffer_unregister(shardd_client_t *c, uint64_t buffer) {
  if (c == NULL)
    return SHARDD_E_INVAL; /* no client to hold a message */

  Shardwire__Request req = SHARDWIRE__REQUEST__INIT;
  Shardwire__UnregisterBuffer ub = SHARDWIRE__UNREGISTER_BUFFER__INIT;
  ub.id = buffer;
  req.body_case = SHARDWIRE__REQUEST__BODY_UNREGISTER_BUFFER;
  req.unregister_buffer = &ub;
  shardd_err rc = call_status_only(c, &req);
  if (rc == SHARDD_OK)
    unmap_buffer(c, buffer);
  return rc;
}

shardd_err shardd_view_register(shardd_client_t *c, uint64_t buffer,
                                const char *name, uint64_t offset,
                                uint64_t numel, const int64_t *shape, int ndim,
                                uint64_t *out_id) {
  if (c == NULL)
    return SHARDD_E_INVAL; /* no client to hold a message */

  if (out_id)
    *out_id = 0;
  if (name == NULL || ndim < 0 || (ndim > 0 && shape == NULL))
    return set_err(c, SHARDD_E_INVAL, "view: NULL name or shape");
  Shardwire__Request req = SHARDWIRE__REQUEST__INIT;
  Shardwire__RegisterView rv = SHARDWIRE__REGISTER_VIEW__INIT;
  rv.buffer = buffer;
  rv.name = (char *)name;
  rv.offset = offset;
  rv.numel = numel;
  rv.n_shape = (size_t)ndim;
  rv.shape = (int64_t *)shape;
  req.body_case = SHARDWIRE__REQUEST__BODY_REGISTER_VIEW;
  req.register_view = &rv;
  Shardwire__Response *resp;
  shardd_err rc = call_expect(c, &req, SHARDWIRE__RESPONSE__BODY_VIEW, &resp, NULL);
  if (rc == SHARDD_OK && out_id)
    *out_id = resp->view->id;
  if (resp)
    shardwire__response__free_unpacked(resp, NULL);
  return rc;
}

shardd_err shardd_view_register_ex(shardd_client_t *c, uint64_t buffer,
                                   const char *name, uint64_t offset,
                                   uint64_t numel, const int64_t *shape,
                                   int ndim, const shardd_view_opts *opts,
                                   shardd_view_info *out) {
  if (c == NULL)
    return SHARDD_E_INVAL; /* no client to hold a message */

  if (out)
    memset(out, 0, sizeof *out);
  if (name == NULL || ndim < 0 || (ndim > 0 && shape == NULL))
    return set_err(c, SHARDD_E_INVAL, "view: NULL name or shape");
  shardd_view_opts o = SHARDD_VIEW_OPTS_INIT;
  if (opts) { /* an older caller's smaller struct keeps the defaults after it */
    size_t n = opts->size < sizeof o ? opts->size : sizeof o;
    memcpy(&o, opts, n);
    o.size = sizeof o;
  }
  Shardwire__Request req = SHARDWIRE__REQUEST__INIT;
  Shardwire__RegisterView rv = SHARDWIRE__REGISTER_VIEW__INIT;
  rv.buffer = buffer;
  rv.name = (char *)name;
  rv.offset = offset;
  rv.numel = numel;
  rv.n_shape = (size_t)ndim;
  rv.shape = (int64_t *)shape;
  if (!o.requires_grad) {
    rv.has_requires_grad = 1;
    rv.requires_grad = 0;
  }
  if (o.buffer_generation) {
    rv.has_buffer_generation = 1;
    rv.buffer_generation = o.buffer_generation;
  }
  req.body_case = SHARDWIRE__REQUEST__BODY_REGISTER_VIEW;
  req.register_view = &rv;
  Shardwire__Response *resp;
  shardd_err rc = call_expect(c, &req, SHARDWIRE__RESPONSE__BODY_VIEW, &resp, NULL);
  if (rc == SHARDD_OK && out) {
    out->id = resp->view->id;
    out->generation = resp->view->has_generation ? resp->view->generation : 0;
    out->created = resp->view->created;
  }
  if (resp)
    shardwire__response__free_unpacked(resp, NULL);
  return rc;
}

shardd_err shardd_view_unregister(shardd_client_t *c, uint64_t view) {
  if (c == NULL)
    return SHARDD_E_INVAL; /* no client to hold a message */

  Shardwire__Request req = SHARDWIRE__REQUEST__INIT;
  Shardwire__UnregisterView uv = SHARDWIRE__UNREGISTER_VIEW__INIT;
  uv.id = view;
  req.body_case = SHARDWIRE__REQUEST__BODY_UNREGISTER_VIEW;
  req.unregister_view = &uv;
  return call_status_only(c, &req);
}

/* ---- batches of views ------------------------------------------------- */

/* A request's share of the frame: a quarter of the limit, so the largest
 * names and shapes still fit (256 views of 255-byte names and 64
 * dimensions are ~0.3 MiB; the count, not the bytes, cuts in practice). */
#define VIEWS_REQ_BYTES (SHARDD_MAX_FRAME / 4)

/* Entries [lo, *hi) of one request: at most SHARDD_VIEWS_PER_REQUEST, at
 * most VIEWS_REQ_BYTES packed (at least one). */
static size_t views_chunk_end(Shardwire__RegisterView *rv, size_t lo, size_t n) {
  size_t hi = lo, bytes = 0;
  while (hi < n && hi - lo < SHARDD_VIEWS_PER_REQUEST) {
    size_t b = shardwire__register_view__get_packed_size(&rv[hi]) + 8;
    if (hi > lo && bytes + b > VIEWS_REQ_BYTES)
      break;
    bytes += b;
    hi++;
  }
  return hi;
}

/* The refused (or, for a bucket, failed) entries' codes from a batch
 * reply of any kind: views, buffers or bucket (indices count from the
 * call's first entry; only those of [lo, hi), the request's, are taken). */
static void batch_errs_fill(const Shardwire__Response *resp, size_t lo,
                            size_t hi, shardd_err *errs) {
  if (errs == NULL || resp == NULL)
    return;
  size_t n = 0;
  Shardwire__BatchError **e = NULL;
  switch (resp->body_case) {
  case SHARDWIRE__RESPONSE__BODY_VIEWS_BATCH:
    n = resp->views_batch->n_errors;
    e = resp->views_batch->errors;
    break;
  case SHARDWIRE__RESPONSE__BODY_BUFFERS_BATCH:
    n = resp->buffers_batch->n_errors;
    e = resp->buffers_batch->errors;
    break;
  case SHARDWIRE__RESPONSE__BODY_BUCKET:
    n = resp->bucket->n_errors;
    e = resp->bucket->errors;
    break;
  default:
    return;
  }
  for (size_t k = 0; k < n; k++)
    if (e[k]->index >= lo && e[k]->index < hi)
      errs[e[k]->index] = (shardd_err)e[k]->code;
}

/* A request of [lo, hi) of a call of n entries failed with rc (resp: its
 * reply, or NULL): errs gets the daemon's per-entry codes and E_STATE for
 * the entries after the request (never sent), and last_error, which lists
 * the daemon's refusals (indices from the call's first entry), says what
 * became of those: "and N entries after them <after>". */
static void batch_fail(shardd_client_t *c, shardd_err rc,
                       const Shardwire__Response *resp, size_t lo, size_t hi,
                       size_t n, shardd_err *errs, const char *after) {
  batch_errs_fill(resp, lo, hi, errs);
  if (errs)
    for (size_t i = hi; i < n; i++)
      errs[i] = SHARDD_E_STATE;
  if (hi == n)
    return;
  char *copy = strdup(shardd_last_error(c));
  if (copy == NULL)
    return;
  set_err(c, rc, "%s; and %zu entries after them %s", copy, n - hi, after);
  free(copy);
}

shardd_err shardd_views_register(shardd_client_t *c, size_t n,
                                 const shardd_view_spec *specs,
                                 shardd_view_info *out, shardd_err *errs) {
  if (c == NULL)
    return SHARDD_E_INVAL; /* no client to hold a message */
  if (out)
    memset(out, 0, n * sizeof *out);
  if (errs)
    for (size_t i = 0; i < n; i++)
      errs[i] = SHARDD_OK;
  if (n == 0)
    return SHARDD_OK;
  if (specs == NULL)
    return set_err(c, SHARDD_E_INVAL, "shardd_views_register: specs is NULL");
  if (n > UINT32_MAX) /* the wire's entry indices */
    return set_err(c, SHARDD_E_RANGE, "shardd_views_register: %zu views, at "
                   "most %" PRIu32 " per call", n, UINT32_MAX);
  size_t stride = specs->size;
  if (stride < offsetof(shardd_view_spec, requires_grad) + sizeof(int))
    return set_err(c, SHARDD_E_INVAL,
                   "shardd_views_register: specs[0].size %zu is too small "
                   "(use SHARDD_VIEW_SPEC_INIT)", stride);
  Shardwire__RegisterView *rv = calloc(n, sizeof *rv);
  Shardwire__RegisterView **rvp = calloc(n, sizeof *rvp);
  /* the views created so far, for the undo of a later refusal */
  uint64_t *made = malloc(n * sizeof *made);
  shardd_err rc = SHARDD_OK;
  size_t nmade = 0;
  if (rv == NULL || rvp == NULL || made == NULL) {
    rc = set_err(c, SHARDD_E_NO_MEMORY, "out of memory");
    goto done;
  }
  for (size_t i = 0; i < n; i++) {
    shardd_view_spec e = SHARDD_VIEW_SPEC_INIT;
    const shardd_view_spec *sp =
        (const shardd_view_spec *)((const char *)specs + i * stride);
    memcpy(&e, sp, stride < sizeof e ? stride : sizeof e);
    if (e.size != stride) {
      rc = set_err(c, SHARDD_E_INVAL, "views: entry %zu has size %zu, entry 0 "
                   "%zu (every entry the same)", i, e.size, stride);
      goto done;
    }
    if (e.name == NULL || e.ndim < 0 || (e.ndim > 0 && e.shape == NULL)) {
      if (errs)
        errs[i] = SHARDD_E_INVAL;
      rc = set_err(c, SHARDD_E_INVAL, "views: entry %zu has a NULL name or "
                   "shape; nothing was sent", i);
      goto done;
    }
    shardwire__register_view__init(&rv[i]);
    rv[i].buffer = e.buffer;
    rv[i].name = (char *)e.name;
    rv[i].offset = e.offset;
    rv[i].numel = e.numel;
    rv[i].n_shape = (size_t)e.ndim;
    rv[i].shape = (int64_t *)e.shape;
    if (!e.requires_grad) {
      rv[i].has_requires_grad = 1;
      rv[i].requires_grad = 0;
    }
    if (e.buffer_generation) {
      rv[i].has_buffer_generation = 1;
      rv[i].buffer_generation = e.buffer_generation;
    }
    rvp[i] = &rv[i];
  }
  for (size_t lo = 0; lo < n;) {
    size_t hi = views_chunk_end(rv, lo, n);
    Shardwire__Request req = SHARDWIRE__REQUEST__INIT;
    Shardwire__ViewsBatch vb = SHARDWIRE__VIEWS_BATCH__INIT;
    Shardwire__RegisterViews rq = SHARDWIRE__REGISTER_VIEWS__INIT;
    rq.n_views = hi - lo;
    rq.views = rvp + lo;
    rq.has_first_index = lo > 0;
    rq.first_index = (uint32_t)lo;
    vb.op_case = SHARDWIRE__VIEWS_BATCH__OP_REGISTER;
    vb.register_ = &rq;
    req.body_case = SHARDWIRE__REQUEST__BODY_VIEWS_BATCH;
    req.views_batch = &vb;
    Shardwire__Response *resp;
    rc = call_expect(c, &req, SHARDWIRE__RESPONSE__BODY_VIEWS_BATCH, &resp, NULL);
    if (rc == SHARDD_OK && resp->views_batch->n_views != hi - lo) {
      rc = set_err(c, SHARDD_E_PROTOCOL, "the daemon answered %zu views for a "
                   "request of %zu", resp->views_batch->n_views, hi - lo);
      /* what it did create is unknown: nothing to undo by id */
    } else if (rc == SHARDD_OK) {
      for (size_t i = lo; i < hi; i++) {
        const Shardwire__ViewReply *r = resp->views_batch->views[i - lo];
        if (out) {
          out[i].id = r->id;
          out[i].generation = r->has_generation ? r->generation : 0;
          out[i].created = r->created;
        }
        if (r->created)
          made[nmade++] = r->id;
      }
    } else {
      batch_fail(c, rc, resp, lo, hi, n, errs,
                 "not checked (no view of this call was kept)");
    }
    if (resp)
      shardwire__response__free_unpacked(resp, NULL);
    if (rc != SHARDD_OK)
      break;
    lo = hi;
  }
  if (rc != SHARDD_OK && nmade > 0) {
    /* the refusal's message is the call's error, not the undo's */
    size_t ml = strlen(shardd_last_error(c));
    char *msg = malloc(ml + 1);
    if (msg)
      memcpy(msg, shardd_last_error(c), ml + 1);
    shardd_err urc = shardd_views_unregister(c, nmade, made, NULL, NULL);
    if (msg && urc == SHARDD_OK)
      set_err(c, rc, "%s", msg);
    else if (msg)
      set_err(c, rc, "%s; undoing the %zu views created by earlier requests "
              "failed too: %s", msg, nmade, shardd_last_error(c));
    free(msg);
  }
  if (rc != SHARDD_OK && out)
    memset(out, 0, n * sizeof *out);

done:
  free(rv);
  free(rvp);
  free(made);
  return rc;
}

shardd_err shardd_views_unregister(shardd_client_t *c, size_t n,
                                   const uint64_t *views,
                                   const uint64_t *generations,
                                   shardd_err *errs) {
  if (c == NULL)
    return SHARDD_E_INVAL; /* no client to hold a message */
  if (errs)
    for (size_t i = 0; i < n; i++)
      errs[i] = SHARDD_OK;
  if (n == 0)
    return SHARDD_OK;
  if (views == NULL)
    return set_err(c, SHARDD_E_INVAL, "shardd_views_unregister: views is NULL");
  if (n > UINT32_MAX)
    return set_err(c, SHARDD_E_RANGE, "shardd_views_unregister: %zu views, at "
                   "most %" PRIu32 " per call", n, UINT32_MAX);
  size_t per = SHARDD_VIEWS_PER_REQUEST;
  Shardwire__UnregisterView *uv = calloc(per, sizeof *uv);
  Shardwire__UnregisterView **uvp = calloc(per, sizeof *uvp);
  shardd_err rc = SHARDD_OK;
  if (uv == NULL || uvp == NULL) {
    rc = set_err(c, SHARDD_E_NO_MEMORY, "out of memory");
    goto done;
  }
  for (size_t lo = 0; lo < n; lo += per) {
    size_t hi = n - lo < per ? n : lo + per;
    for (size_t i = lo; i < hi; i++) {
      Shardwire__UnregisterView *u = &uv[i - lo];
      shardwire__unregister_view__init(u);
      u->id = views[i];
      if (generations && generations[i]) {
        u->has_generation = 1;
        u->generation = generations[i];
      }
      uvp[i - lo] = u;
    }
    Shardwire__Request req = SHARDWIRE__REQUEST__INIT;
    Shardwire__ViewsBatch vb = SHARDWIRE__VIEWS_BATCH__INIT;
    Shardwire__UnregisterViews rq = SHARDWIRE__UNREGISTER_VIEWS__INIT;
    rq.n_views = hi - lo;
    rq.views = uvp;
    rq.has_first_index = lo > 0;
    rq.first_index = (uint32_t)lo;
    vb.op_case = SHARDWIRE__VIEWS_BATCH__OP_UNREGISTER;
    vb.unregister = &rq;
    req.body_case = SHARDWIRE__REQUEST__BODY_VIEWS_BATCH;
    req.views_batch = &vb;
    Shardwire__Response *resp;
    rc = call_expect(c, &req, SHARDWIRE__RESPONSE__BODY_VIEWS_BATCH, &resp, NULL);
    if (rc != SHARDD_OK) {
      batch_fail(c, rc, resp, lo, hi, n, errs,
                 "not checked (the views of the entries before these are "
                 "unregistered)");
    }
    if (resp)
      shardwire__response__free_unpacked(resp, NULL);
    if (rc != SHARDD_OK)
      break;
  }

done:
  free(uv);
  free(uvp);
  return rc;
}

/* ---- batches of buffers ----------------------------------------------- */

shardd_err shardd_buffers_register(shardd_client_t *c, size_t n,
                                   const shardd_buffer_spec *specs,
                                   shardd_buffer_info *out, shardd_err *errs) {
  if (c == NULL)
    return SHARDD_E_INVAL; /* no client to hold a message */
  if (out)
    memset(out, 0, n * sizeof *out);
  if (errs)
    for (size_t i = 0; i < n; i++)
      errs[i] = SHARDD_OK;
  if (n == 0)
    return SHARDD_OK;
  if (specs == NULL || out == NULL)
    return set_err(c, SHARDD_E_INVAL,
                   "shardd_buffers_register: specs or out is NULL");
  if (n > UINT32_MAX)
    return set_err(c, SHARDD_E_RANGE, "shardd_buffers_register: %zu buffers, "
                   "at most %" PRIu32 " per call", n, UINT32_MAX);
  size_t stride = specs->size;
  if (stride < offsetof(shardd_buffer_spec, init_checksum) + sizeof(uint64_t))
    return set_err(c, SHARDD_E_INVAL,
                   "shardd_buffers_register: specs[0].size %zu is too small "
                   "(use SHARDD_BUFFER_SPEC_INIT)", stride);
  Shardwire__RegisterBuffer *rb = calloc(n, sizeof *rb);
  Shardwire__RegisterBuffer **rbp = calloc(n, sizeof *rbp);
  uint64_t *made = malloc(n * sizeof *made); /* for the undo */
  int fds[SHARDD_BUFFERS_PER_REQUEST];
  shardd_err rc = SHARDD_OK;
  size_t nmade = 0;
  if (rb == NULL || rbp == NULL || made == NULL) {
    rc = set_err(c, SHARDD_E_NO_MEMORY, "out of memory");
    goto done;
  }
  for (size_t i = 0; i < n; i++) {
    shardd_buffer_spec e = SHARDD_BUFFER_SPEC_INIT;
    const shardd_buffer_spec *sp =
        (const shardd_buffer_spec *)((const char *)specs + i * stride);
    memcpy(&e, sp, stride < sizeof e ? stride : sizeof e);
    if (e.size != stride) {
      rc = set_err(c, SHARDD_E_INVAL, "buffers: entry %zu has size %zu, entry "
                   "0 %zu (every entry the same)", i, e.size, stride);
      goto done;
    }
    if (e.name == NULL) {
      if (errs)
        errs[i] = SHARDD_E_INVAL;
      rc = set_err(c, SHARDD_E_INVAL, "buffers: entry %zu has a NULL name; "
                   "nothing was sent", i);
      goto done;
    }
    shardwire__register_buffer__init(&rb[i]);
    rb[i].name = (char *)e.name;
    rb[i].dtype = (Shardwire__DType)e.dtype;
    rb[i].numel = e.numel;
    if (e.has_init_checksum) {
      rb[i].has_init_checksum = 1;
      rb[i].init_checksum = e.init_checksum;
    }
    rbp[i] = &rb[i];
  }
  for (size_t lo = 0; lo < n && rc == SHARDD_OK;) {
    size_t hi = n - lo < SHARDD_BUFFERS_PER_REQUEST ? n
                                                    : lo + SHARDD_BUFFERS_PER_REQUEST;
    Shardwire__Request req = SHARDWIRE__REQUEST__INIT;
    Shardwire__BuffersBatch bb = SHARDWIRE__BUFFERS_BATCH__INIT;
    Shardwire__RegisterBuffers rq = SHARDWIRE__REGISTER_BUFFERS__INIT;
    rq.n_buffers = hi - lo;
    rq.buffers = rbp + lo;
    rq.has_first_index = lo > 0;
    rq.first_index = (uint32_t)lo;
    bb.op_case = SHARDWIRE__BUFFERS_BATCH__OP_REGISTER;
    bb.register_ = &rq;
    req.body_case = SHARDWIRE__REQUEST__BODY_BUFFERS_BATCH;
    req.buffers_batch = &bb;
    Shardwire__Response *resp = NULL;
    int nfds = 0;
    clear_err(c);
    rc = send_req(c, &req);
    if (rc == SHARDD_OK)
      rc = recv_for_many(c, req.seq, &resp, NULL, fds,
                         SHARDD_BUFFERS_PER_REQUEST, &nfds);
    if (rc == SHARDD_OK &&
        resp->body_case != SHARDWIRE__RESPONSE__BODY_BUFFERS_BATCH)
      rc = set_err(c, SHARDD_E_PROTOCOL, "the daemon answered with body %d to "
                   "a batch of buffers", (int)resp->body_case);
    else if (rc == SHARDD_OK && resp->buffers_batch->n_buffers != hi - lo)
      rc = set_err(c, SHARDD_E_PROTOCOL, "the daemon answered %zu buffers for "
                   "a request of %zu", resp->buffers_batch->n_buffers, hi - lo);
    else if (rc == SHARDD_OK && nfds != 0 && (size_t)nfds != hi - lo)
      rc = set_err(c, SHARDD_E_PROTOCOL, "the daemon sent %d descriptors for "
                   "%zu buffers", nfds, hi - lo);
    if (rc == SHARDD_OK) {
      for (size_t i = lo; i < hi; i++) {
        const Shardwire__BufferReply *br = resp->buffers_batch->buffers[i - lo];
        if (br->created)
          made[nmade++] = br->id;
      }
      for (size_t i = lo; i < hi && rc == SHARDD_OK; i++)
        rc = buffer_adopt(c, resp->buffers_batch->buffers[i - lo],
                          nfds ? fds[i - lo] : -1, &out[i]);
    } else {
      batch_fail(c, rc, resp, lo, hi, n, errs,
                 "not checked (no buffer of this call was kept)");
    }
    for (int k = 0; k < nfds; k++)
      close(fds[k]);
    if (resp)
      shardwire__response__free_unpacked(resp, NULL);
    lo = hi;
  }
  if (rc != SHARDD_OK && nmade > 0) {
    /* the refusal's message is the call's error, not the undo's */
    char *msg = strdup(shardd_last_error(c));
    shardd_err urc = shardd_buffers_unregister(c, nmade, made, NULL, NULL);
    if (msg && urc == SHARDD_OK)
      set_err(c, rc, "%s", msg);
    else if (msg)
      set_err(c, rc, "%s; undoing the %zu buffers created by earlier requests "
              "failed too: %s", msg, nmade, shardd_last_error(c));
    free(msg);
  }
  if (rc != SHARDD_OK)
    memset(out, 0, n * sizeof *out);

done:
  free(rb);
  free(rbp);
  free(made);
  return rc;
}

shardd_err shardd_buffers_unregister(shardd_client_t *c, size_t n,
                                     const uint64_t *buffers,
                                     const uint64_t *generations,
                                     shardd_err *errs) {
  if (c == NULL)
    return SHARDD_E_INVAL; /* no client to hold a message */
  if (errs)
    for (size_t i = 0; i < n; i++)
      errs[i] = SHARDD_OK;
  if (n == 0)
    return SHARDD_OK;
  if (buffers == NULL)
    return set_err(c, SHARDD_E_INVAL,
                   "shardd_buffers_unregister: buffers is NULL");
  if (n > UINT32_MAX)
    return set_err(c, SHARDD_E_RANGE, "shardd_buffers_unregister: %zu buffers, "
                   "at most %" PRIu32 " per call", n, UINT32_MAX);
  size_t per = SHARDD_BUFFERS_PER_REQUEST;
  Shardwire__UnregisterBuffer ub[SHARDD_BUFFERS_PER_REQUEST];
  Shardwire__UnregisterBuffer *ubp[SHARDD_BUFFERS_PER_REQUEST];
  shardd_err rc = SHARDD_OK;
  for (size_t lo = 0; lo < n; lo += per) {
    size_t hi = n - lo < per ? n : lo + per;
    for (size_t i = lo; i < hi; i++) {
      Shardwire__UnregisterBuffer *u = &ub[i - lo];
      shardwire__unregister_buffer__init(u);
      u->id = buffers[i];
      if (generations && generations[i]) {
        u->has_generation = 1;
        u->generation = generations[i];
      }
      ubp[i - lo] = u;
    }
    Shardwire__Request req = SHARDWIRE__REQUEST__INIT;
    Shardwire__BuffersBatch bb = SHARDWIRE__BUFFERS_BATCH__INIT;
    Shardwire__UnregisterBuffers rq = SHARDWIRE__UNREGISTER_BUFFERS__INIT;
    rq.n_buffers = hi - lo;
    rq.buffers = ubp;
    rq.has_first_index = lo > 0;
    rq.first_index = (uint32_t)lo;
    bb.op_case = SHARDWIRE__BUFFERS_BATCH__OP_UNREGISTER;
    bb.unregister = &rq;
    req.body_case = SHARDWIRE__REQUEST__BODY_BUFFERS_BATCH;
    req.buffers_batch = &bb;
    Shardwire__Response *resp;
    rc = call_expect(c, &req, SHARDWIRE__RESPONSE__BODY_BUFFERS_BATCH, &resp,
                     NULL);
    if (rc == SHARDD_OK) {
      for (size_t i = lo; i < hi; i++)
        unmap_buffer(c, buffers[i]);
    } else {
      batch_fail(c, rc, resp, lo, hi, n, errs,
                 "not checked (the buffers of the entries before these are "
                 "unregistered)");
    }
    if (resp)
      shardwire__response__free_unpacked(resp, NULL);
    if (rc != SHARDD_OK)
      break;
  }
  return rc;
}

static void hp_to_wire(const shardd_hparams *h, Shardwire__HyperParams *w) {
  shardwire__hyper_params__init(w);
  if (h == NULL)
    return;
#define HP(bit, field)                 \
  if (h->set & (bit)) {                \
    w->has_##field = 1;                \
    w->field = h->field;               \
  }
  HP(SHARDD_HP_LR, lr)
  HP(SHARDD_HP_MOMENTUM, momentum)
  HP(SHARDD_HP_DAMPENING, dampening)
  HP(SHARDD_HP_WEIGHT_DECAY, weight_decay)
  HP(SHARDD_HP_NESTEROV, nesterov)
  HP(SHARDD_HP_MAXIMIZE, maximize)
  HP(SHARDD_HP_BETA1, beta1)
  HP(SHARDD_HP_BETA2, beta2)
  HP(SHARDD_HP_EPS, eps)
  HP(SHARDD_HP_AMSGRAD, amsgrad)
#undef HP
}

shardd_err shardd_optimizer_register(shardd_client_t *c, const char *name,
                                     shardd_optim_kind kind,
                                     const shardd_hparams *hyper,
                                     const shardd_param_group *groups,
                                     size_t ngroups, uint64_t *out_id) {
  if (c == NULL)
    return SHARDD_E_INVAL; /* no client to hold a message */

  if (out_id)
    *out_id = 0;
  if (ngroups > 0 && groups == NULL)
    return set_err(c, SHARDD_E_INVAL, "optimizer: NULL groups");
  size_t nrefs = 0;
  for (size_t g = 0; g < ngroups; g++) {
    /* a wrapped sum would size the arrays below smaller than the loop */
    if (groups[g].nrefs > SIZE_MAX - nrefs)
      return set_err(c, SHARDD_E_INVAL, "optimizer: too many refs");
    nrefs += groups[g].nrefs;
  }
  Shardwire__ParamGroup *pg = calloc(ngroups ? ngroups : 1, sizeof *pg);
  Shardwire__ParamGroup **pgp = calloc(ngroups ? ngroups : 1, sizeof *pgp);
  Shardwire__HyperParams *ov = calloc(ngroups ? ngroups : 1, sizeof *ov);
  Shardwire__ParamRef *refs = calloc(nrefs ? nrefs : 1, sizeof *refs);
  Shardwire__ParamRef **refp = calloc(nrefs ? nrefs : 1, sizeof *refp);
  shardd_err rc;
  if (pg == NULL || pgp == NULL || ov == NULL || refs == NULL || refp == NULL) {
    rc = set_err(c, SHARDD_E_NO_MEMORY, "out of memory");
    goto done;
  }
  size_t k = 0;
  for (size_t g = 0; g < ngroups; g++) {
    shardwire__param_group__init(&pg[g]);
    hp_to_wire(&groups[g].overrides, &ov[g]);
    if (groups[g].overrides.set)
      pg[g].overrides = &ov[g];
    pg[g].refs = &refp[k];
    pg[g].n_refs = groups[g].nrefs;
    for (size_t i = 0; i < groups[g].nrefs; i++, k++) {
      shardwire__param_ref__init(&refs[k]);
      refs[k].id = groups[g].refs[i].id;
      refs[k].name = (char *)groups[g].refs[i].name;
      refp[k] = &refs[k];
    }
    pgp[g] = &pg[g];
  }
  Shardwire__Request req = SHARDWIRE__REQUEST__INIT;
  Shardwire__RegisterOptimizer ro = SHARDWIRE__REGISTER_OPTIMIZER__INIT;
  Shardwire__HyperParams top;
  hp_to_wire(hyper, &top);
  ro.name = (char *)name;
  ro.kind = (Shardwire__OptimKind)kind;
  ro.hyper = &top;
  ro.groups = pgp;
  ro.n_groups = ngroups;
  req.body_case = SHARDWIRE__REQUEST__BODY_REGISTER_OPTIMIZER;
  req.register_optimizer = &ro;
  Shardwire__Response *resp;
  rc = call_expect(c, &req, SHARDWIRE__RESPONSE__BODY_OPTIMIZER, &resp, NULL);
  if (rc == SHARDD_OK && out_id)
    *out_id = resp->optimizer->id;
  if (resp)
    shardwire__response__free_unpacked(resp, NULL);
done:
  free(pg);
  free(pgp);
  free(ov);
  free(refs);
  free(refp);
  return rc;
}

shardd_err shardd_optimizer_unregister(shardd_client_t *c, uint64_t opt) {
  if (c == NULL)
    return SHARDD_E_INVAL; /* no client to hold a message */

  Shardwire__Request req = SHARDWIRE__REQUEST__INIT;
  Shardwire__UnregisterOptimizer uo = SHARDWIRE__UNREGISTER_OPTIMIZER__INIT;
  uo.id = opt;
  req.body_case = SHARDWIRE__REQUEST__BODY_UNREGISTER_OPTIMIZER;
  req.unregister_optimizer = &uo;
  return call_status_only(c, &req);
}

shardd_err shardd_gather(shardd_client_t *c, uint64_t buffer) {
  if (c == NULL)
    return SHARDD_E_INVAL; /* no client to hold a message */

  return shardd_gather_checked(c, buffer, 0);
}

shardd_err shardd_gather_checked(shardd_client_t *c, uint64_t buffer,
                                 uint64_t generation) {
  if (c == NULL)
    return SHARDD_E_INVAL; /* no client to hold a message */

  Shardwire__Request req = SHARDWIRE__REQUEST__INIT;
  Shardwire__Gather g = SHARDWIRE__GATHER__INIT;
  g.buffer = buffer;
  if (generation) {
    g.has_generation = 1;
    g.generation = generation;
  }
  req.body_case = SHARDWIRE__REQUEST__BODY_GATHER;
  req.gather = &g;
  return call_status_only(c, &req);
}

/* Fills *out with buffer's areas after a gather whose reply was gr (NULL:
 * a status-only reply, a job with resident areas). The offsets are checked
 * against the pool before any pointer is made of them: the caller writes
 * a whole buffer there. */
static shardd_err area_fill(shardd_client_t *c, uint64_t buffer,
                            const Shardwire__GatherReply *gr, int want_grad,
                            shardd_area *out) {
  const mapping *m = maps_get(c, buffer);
  if (gr == NULL) {
    if (m == NULL)
      return set_err(c, SHARDD_E_STATE,
                     "buffer %" PRIu64 " is not registered on this connection: "
                     "its gather area is unknown here", buffer);
    if (m->transient)
      return set_err(c, SHARDD_E_PROTOCOL,
                     "buffer %" PRIu64 " has transient areas but the daemon's "
                     "gather reply did not say where they are", buffer);
    out->gather = (char *)m->base + m->gather_off;
    out->grad = want_grad ? (char *)m->base + m->grad_off : NULL;
    out->pool = 0;
    return SHARDD_OK;
  }
  const pool_map *p = find_pool(c, gr->pool);
  if (p == NULL) /* pool_adopt has refused such a reply already */
    return set_err(c, SHARDD_E_INTERNAL, "pool %" PRIu64 " is not mapped", gr->pool);
  /* A buffer gathered without being registered here: its size is not
   * known, only that the areas start inside the pool. */
  uint64_t n = m ? m->padded_numel : 1;
  size_t esz = m ? m->esz : 1;
  if (!area_ok(gr->gather_offset, n, esz, p->len))
    return set_err(c, SHARDD_E_PROTOCOL,
                   "buffer %" PRIu64 ": gather area at byte %" PRIu64
                   " (%" PRIu64 " elements of %zu bytes) outside pool %" PRIu64
                   " of %zu bytes", buffer, gr->gather_offset, n, esz, gr->pool,
                   p->len);
  if (want_grad && !gr->has_grad_offset)
    return set_err(c, SHARDD_E_PROTOCOL,
                   "buffer %" PRIu64 ": the daemon leased no gradient area "
                   "(its gather reply has no grad_offset)", buffer);
  if (want_grad && !area_ok(gr->grad_offset, n, esz, p->len))
    return set_err(c, SHARDD_E_PROTOCOL,
                   "buffer %" PRIu64 ": gradient area at byte %" PRIu64
                   " (%" PRIu64 " elements of %zu bytes) outside pool %" PRIu64
                   " of %zu bytes", buffer, gr->grad_offset, n, esz, gr->pool,
                   p->len);
  out->gather = (char *)p->base + gr->gather_offset;
  out->grad = want_grad ? (char *)p->base + gr->grad_offset : NULL;
  out->pool = gr->pool;
  return SHARDD_OK;
}

shardd_err shardd_gather_area(shardd_client_t *c, uint64_t buffer,
                              int want_grad, shardd_area *out) {
  if (c == NULL)
    return SHARDD_E_INVAL; /* no client to hold a message */
  if (out == NULL)
    return set_err(c, SHARDD_E_INVAL, "shardd_gather_area: out is NULL");

  memset(out, 0, sizeof *out);
  Shardwire__Request req = SHARDWIRE__REQUEST__INIT;
  Shardwire__Gather g = SHARDWIRE__GATHER__INIT;
  g.buffer = buffer;
  if (want_grad) {
    g.has_want_grad = 1;
    g.want_grad = 1;
  }
  req.body_case = SHARDWIRE__REQUEST__BODY_GATHER;
  req.gather = &g;
  Shardwire__Response *resp;
  shardd_err rc = call(c, &req, &resp, NULL);
  if (rc == SHARDD_OK) {
    if (resp->body_case == SHARDWIRE__RESPONSE__BODY_GATHER)
      rc = area_fill(c, buffer, resp->gather, want_grad, out);
    else if (resp->body_case == SHARDWIRE__RESPONSE__BODY__NOT_SET)
      rc = area_fill(c, buffer, NULL, want_grad, out);
    else
      rc = set_err(c, SHARDD_E_PROTOCOL,
                   "the daemon answered a gather with body %d",
                   (int)resp->body_case);
    if (rc != SHARDD_OK)
      memset(out, 0, sizeof *out);
  }
  if (resp)
    shardwire__response__free_unpacked(resp, NULL);
  return rc;
}

static shardd_err release_req(shardd_client_t *c, uint64_t buffer, int grad) {
  if (c == NULL)
    return SHARDD_E_INVAL; /* no client to hold a message */

  Shardwire__Request req = SHARDWIRE__REQUEST__INIT;
  Shardwire__Release r = SHARDWIRE__RELEASE__INIT;
  r.buffer = buffer;
  if (grad) {
    r.has_grad = 1;
    r.grad = 1;
  }
  req.body_case = SHARDWIRE__REQUEST__BODY_RELEASE;
  req.release = &r;
  return call_status_only(c, &req);
}

shardd_err shardd_release(shardd_client_t *c, uint64_t buffer) {
  return release_req(c, buffer, 0);
}

shardd_err shardd_release_all(shardd_client_t *c, uint64_t buffer) {
  return release_req(c, buffer, 1);
}

shardd_err shardd_scatter(shardd_client_t *c, uint64_t buffer,
                          shardd_reduce_op op) {
  if (c == NULL)
    return SHARDD_E_INVAL; /* no client to hold a message */

  return shardd_scatter_checked(c, buffer, 0, op);
}

static shardd_err scatter_req(shardd_client_t *c, uint64_t buffer,
                              uint64_t generation, shardd_reduce_op op,
                              int accumulate) {
  if (c == NULL)
    return SHARDD_E_INVAL; /* no client to hold a message */

  shardd_scatter_opts o = SHARDD_SCATTER_OPTS_INIT;
  o.op = op;
  o.generation = generation;
  o.accumulate = accumulate;
  return shardd_scatter_ex(c, buffer, &o);
}

shardd_err shardd_scatter_ex(shardd_client_t *c, uint64_t buffer,
                             const shardd_scatter_opts *opts) {
  if (c == NULL)
    return SHARDD_E_INVAL; /* no client to hold a message */

  shardd_scatter_opts o = SHARDD_SCATTER_OPTS_INIT;
  if (opts) { /* an older caller's smaller struct keeps the defaults after it */
    size_t n = opts->size < sizeof o ? opts->size : sizeof o;
    memcpy(&o, opts, n);
    o.size = sizeof o;
  }
  if (o.nno_grad > 0 && o.no_grad == NULL)
    return set_err(c, SHARDD_E_INVAL, "scatter: nno_grad without no_grad");
  Shardwire__Request req = SHARDWIRE__REQUEST__INIT;
  Shardwire__Scatter s = SHARDWIRE__SCATTER__INIT;
  s.buffer = buffer;
  s.has_op = 1;
  s.op = (Shardwire__ReduceOp)o.op;
  if (o.generation) {
    s.has_generation = 1;
    s.generation = o.generation;
  }
  s.n_no_grad = o.nno_grad;
  s.no_grad = (uint64_t *)o.no_grad;
  if (o.no_grad_all) {
    s.has_no_grad_all = 1;
    s.no_grad_all = 1;
  }
  if (o.accumulate) {
    s.has_accumulate = 1;
    s.accumulate = 1;
  }
  req.body_case = SHARDWIRE__REQUEST__BODY_SCATTER;
  req.scatter = &s;
  return call_status_only(c, &req);
}

shardd_err shardd_scatter_checked(shardd_client_t *c, uint64_t buffer,
                                  uint64_t generation, shardd_reduce_op op) {
  return scatter_req(c, buffer, generation, op, 0);
}

shardd_err shardd_scatter_accumulate(shardd_client_t *c, uint64_t buffer,
                                     shardd_reduce_op op) {
  return scatter_req(c, buffer, 0, op, 1);
}

/* ---- buckets ------------------------------------------------------------ */

/* A bucket request's packed bytes stay under this (scatter entries carry
 * their no_grad lists): a quarter of the frame limit, as for views. */
#define BUCKET_REQ_BYTES (SHARDD_MAX_FRAME / 4)

/* One bucket call: gathers (sc NULL) or scatters (sc[i] each entry's). */
static shardd_err bucket_call(shardd_client_t *c, size_t n,
                              const uint64_t *buffers,
                              Shardwire__Scatter *sc, shardd_err *errs,
                              const char *fn) {
  if (errs)
    for (size_t i = 0; i < n; i++)
      errs[i] = SHARDD_OK;
  if (n == 0)
    return SHARDD_OK;
  if (buffers == NULL)
    return set_err(c, SHARDD_E_INVAL, "%s: buffers is NULL", fn);
  if (n > UINT32_MAX)
    return set_err(c, SHARDD_E_RANGE, "%s: %zu buffers, at most %" PRIu32
                   " per call", fn, n, UINT32_MAX);
  Shardwire__Gather *g = NULL;
  void **ptrs = calloc(n, sizeof *ptrs);
  if (ptrs == NULL || (sc == NULL && (g = calloc(n, sizeof *g)) == NULL)) {
    free(ptrs);
    return set_err(c, SHARDD_E_NO_MEMORY, "out of memory");
  }
  for (size_t i = 0; i < n; i++) {
    if (sc) {
      ptrs[i] = &sc[i];
    } else {
      shardwire__gather__init(&g[i]);
      g[i].buffer = buffers[i];
      ptrs[i] = &g[i];
    }
  }
  shardd_err rc = SHARDD_OK;
  for (size_t lo = 0; lo < n && rc == SHARDD_OK;) {
    /* [lo, hi): at most SHARDD_BUCKET_PER_REQUEST entries (fewer under
     * a daemon's smaller --max-pending, which every rank of the node
     * shares) and BUCKET_REQ_BYTES packed (at least one); every rank cuts
     * the same list the same way */
    size_t hi = lo, bytes = 0;
    while (hi < n && hi - lo < c->bucket_max) {
      size_t b = (sc ? shardwire__scatter__get_packed_size(&sc[hi])
                     : shardwire__gather__get_packed_size(&g[hi])) + 8;
      if (hi > lo && bytes + b > BUCKET_REQ_BYTES)
        break;
      bytes += b;
      hi++;
    }
    Shardwire__Request req = SHARDWIRE__REQUEST__INIT;
    Shardwire__Bucket bk = SHARDWIRE__BUCKET__INIT;
    Shardwire__GatherMany gm = SHARDWIRE__GATHER_MANY__INIT;
    Shardwire__ScatterMany sm = SHARDWIRE__SCATTER_MANY__INIT;
    if (sc) {
      sm.n_scatters = hi - lo;
      sm.scatters = (Shardwire__Scatter **)ptrs + lo;
      sm.has_first_index = lo > 0;
      sm.first_index = (uint32_t)lo;
      bk.op_case = SHARDWIRE__BUCKET__OP_SCATTER;
      bk.scatter = &sm;
    } else {
      gm.n_gathers = hi - lo;
      gm.gathers = (Shardwire__Gather **)ptrs + lo;
      gm.has_first_index = lo > 0;
      gm.first_index = (uint32_t)lo;
      bk.op_case = SHARDWIRE__BUCKET__OP_GATHER;
      bk.gather = &gm;
    }
    req.body_case = SHARDWIRE__REQUEST__BODY_BUCKET;
    req.bucket = &bk;
    Shardwire__Response *resp = NULL;
    rc = call(c, &req, &resp, NULL);
    if (rc == SHARDD_OK && resp->body_case != SHARDWIRE__RESPONSE__BODY_BUCKET)
      rc = set_err(c, SHARDD_E_PROTOCOL, "the daemon answered with body %d to "
                   "a bucket", (int)resp->body_case);
    if (rc != SHARDD_OK) {
      batch_fail(c, rc, resp, lo, hi, n, errs, "were not sent");
    }
    if (resp)
      shardwire__response__free_unpacked(resp, NULL);
    lo = hi;
  }
  free(g);
  free(ptrs);
  return rc;
}

shardd_err shardd_gather_many(shardd_client_t *c, size_t n,
                              const uint64_t *buffers, shardd_err *errs) {
  if (c == NULL)
    return SHARDD_E_INVAL; /* no client to hold a message */
  return bucket_call(c, n, buffers, NULL, errs, "shardd_gather_many");
}

shardd_err shardd_scatter_many(shardd_client_t *c, size_t n,
                               const uint64_t *buffers, shardd_reduce_op op,
                               shardd_err *errs) {
  if (c == NULL)
    return SHARDD_E_INVAL; /* no client to hold a message */
  shardd_scatter_opts o = SHARDD_SCATTER_OPTS_INIT;
  o.op = op;
  o.size = 0; /* the same options for every entry: a stride of 0 */
  return shardd_scatter_many_ex(c, n, buffers, &o, errs);
}

shardd_err shardd_scatter_many_ex(shardd_client_t *c, size_t n,
                                  const uint64_t *buffers,
                                  const shardd_scatter_opts *opts,
                                  shardd_err *errs) {
  if (c == NULL)
    return SHARDD_E_INVAL; /* no client to hold a message */
  /* opts->size 0 (shardd_scatter_many's): one struct for all entries */
  size_t stride = opts ? opts->size : 0;
  if (opts && stride != 0 &&
      stride < offsetof(shardd_scatter_opts, no_grad_all) + sizeof(int))
    return set_err(c, SHARDD_E_INVAL, "shardd_scatter_many_ex: opts[0].size "
                   "%zu is too small (use SHARDD_SCATTER_OPTS_INIT)", stride);
  Shardwire__Scatter *sc = calloc(n ? n : 1, sizeof *sc);
  if (sc == NULL)
    return set_err(c, SHARDD_E_NO_MEMORY, "out of memory");
  for (size_t i = 0; i < n; i++) {
    shardd_scatter_opts o = SHARDD_SCATTER_OPTS_INIT;
    if (opts) {
      const shardd_scatter_opts *e =
          (const shardd_scatter_opts *)((const char *)opts + i * stride);
      size_t k = stride ? stride : sizeof o;
      memcpy(&o, e, k < sizeof o ? k : sizeof o);
      if (stride && e->size != stride) {
        free(sc);
        return set_err(c, SHARDD_E_INVAL, "shardd_scatter_many_ex: entry %zu "
                       "has size %zu, entry 0 %zu (every entry the same)", i,
                       e->size, stride);
      }
    }
    if (o.nno_grad > 0 && o.no_grad == NULL) {
      free(sc);
      return set_err(c, SHARDD_E_INVAL, "shardd_scatter_many_ex: entry %zu: "
                     "nno_grad without no_grad", i);
    }
    shardwire__scatter__init(&sc[i]);
    sc[i].buffer = buffers ? buffers[i] : 0;
    sc[i].has_op = 1;
    sc[i].op = (Shardwire__ReduceOp)o.op;
    if (o.generation) {
      sc[i].has_generation = 1;
      sc[i].generation = o.generation;
    }
    sc[i].n_no_grad = o.nno_grad;
    sc[i].no_grad = (uint64_t *)o.no_grad;
    if (o.no_grad_all) {
      sc[i].has_no_grad_all = 1;
      sc[i].no_grad_all = 1;
    }
    if (o.accumulate) {
      sc[i].has_accumulate = 1;
      sc[i].accumulate = 1;
    }
  }
  shardd_err rc = bucket_call(c, n, buffers, sc, errs, "shardd_scatter_many");
  free(sc);
  return rc;
}

shardd_err shardd_all_reduce(shardd_client_t *c, double *values, size_t n,
                             shardd_reduce_op op) {
  if (c == NULL)
    return SHARDD_E_INVAL; /* no client to hold a message */

  if (n > SHARDD_ALL_REDUCE_MAX)
    return set_err(c, SHARDD_E_RANGE, "all_reduce of %zu values: at most %d", n,
                   SHARDD_ALL_REDUCE_MAX);
  if (n > 0 && values == NULL)
    return set_err(c, SHARDD_E_INVAL, "all_reduce: values is NULL");
  Shardwire__Request req = SHARDWIRE__REQUEST__INIT;
  Shardwire__AllReduce ar = SHARDWIRE__ALL_REDUCE__INIT;
  ar.has_op = 1;
  ar.op = (Shardwire__ReduceOp)op;
  ar.n_values = n;
  ar.values = values;
  req.body_case = SHARDWIRE__REQUEST__BODY_ALL_REDUCE;
  req.all_reduce = &ar;
  Shardwire__Response *resp;
  shardd_err rc = call_expect(c, &req, SHARDWIRE__RESPONSE__BODY_ALL_REDUCE, &resp, NULL);
  if (rc == SHARDD_OK && resp->all_reduce->n_values != n)
    rc = set_err(c, SHARDD_E_PROTOCOL, "all_reduce: %zu values came back for %zu",
                 resp->all_reduce->n_values, n);
  else if (rc == SHARDD_OK && n > 0)
    memcpy(values, resp->all_reduce->values, n * sizeof *values);
  if (resp)
    shardwire__response__free_unpacked(resp, NULL);
  return rc;
}

shardd_err shardd_seed_master(shardd_client_t *c, uint64_t buffer) {
  if (c == NULL)
    return SHARDD_E_INVAL; /* no client to hold a message */
  Shardwire__Request req = SHARDWIRE__REQUEST__INIT;
  Shardwire__SeedMaster sm = SHARDWIRE__SEED_MASTER__INIT;
  sm.buffer = buffer;
  req.body_case = SHARDWIRE__REQUEST__BODY_SEED_MASTER;
  req.seed_master = &sm;
  return call_status_only(c, &req);
}

/* One OptimState request; resp kept for the caller when out_resp. */
static shardd_err optim_state_req(shardd_client_t *c, Shardwire__OptimState *os,
                                  Shardwire__Response **out_resp) {
  Shardwire__Request req = SHARDWIRE__REQUEST__INIT;
  req.body_case = SHARDWIRE__REQUEST__BODY_OPTIM_STATE;
  req.optim_state = os;
  Shardwire__Response *resp;
  shardd_err rc = call_expect(c, &req, SHARDWIRE__RESPONSE__BODY_OPTIM_STATE, &resp, NULL);
  if (rc == SHARDD_OK && out_resp) {
    *out_resp = resp;
    return rc;
  }
  if (resp)
    shardwire__response__free_unpacked(resp, NULL);
  return rc;
}

/* the master is its own field on the wire, not an array index */
static void set_array(Shardwire__OptimState *os, uint32_t array) {
  if (array == SHARDD_OPTIM_MASTER) {
    os->has_master = 1;
    os->master = 1;
  } else {
    os->has_array = 1;
    os->array = array;
  }
}

#define OPTIM_STATE_CHUNK ((uint64_t)1 << 20) /* the daemon's per-request limit */

shardd_err shardd_optim_state_get(shardd_client_t *c, uint64_t opt, uint64_t ref,
                                  uint32_t array, uint64_t offset, uint64_t count,
                                  float *out, shardd_optim_state_info *info) {
  if (c == NULL)
    return SHARDD_E_INVAL; /* no client to hold a message */
  if (count > 0 && out == NULL)
    return set_err(c, SHARDD_E_INVAL, "shardd_optim_state_get: out is NULL");
  uint64_t done = 0;
  do {
    uint64_t n = count - done < OPTIM_STATE_CHUNK ? count - done : OPTIM_STATE_CHUNK;
    Shardwire__OptimState os = SHARDWIRE__OPTIM_STATE__INIT;
    os.optimizer = opt;
    os.ref = ref;
    set_array(&os, array);
    os.has_offset = 1;
    os.offset = offset + done;
    os.has_count = 1;
    os.count = n;
    Shardwire__Response *resp = NULL;
    shardd_err rc = optim_state_req(c, &os, &resp);
    if (rc != SHARDD_OK)
      return rc;
    const Shardwire__OptimStateReply *r = resp->optim_state;
    if (n > 0 && (!r->has_data || r->data.len != n * 4)) {
      shardwire__response__free_unpacked(resp, NULL);
      return set_err(c, SHARDD_E_PROTOCOL, "optimizer state: %zu bytes came back "
                     "for %" PRIu64 " elements", r->has_data ? r->data.len : 0, n);
    }
    if (n > 0)
      memcpy(out + done, r->data.data, n * 4);
    if (info) {
      info->nstate = r->nstate;
      info->numel = r->numel;
      info->steps = r->steps;
      info->optimizer_steps = r->optimizer_steps;
    }
    shardwire__response__free_unpacked(resp, NULL);
    done += n;
  } while (done < count);
  return SHARDD_OK;
}

shardd_err shardd_optim_state_set(shardd_client_t *c, uint64_t opt, uint64_t ref,
                                  uint32_t array, uint64_t offset, uint64_t count,
                                  const float *in) {
  if (c == NULL)
    return SHARDD_E_INVAL; /* no client to hold a message */
  if (count > 0 && in == NULL)
    return set_err(c, SHARDD_E_INVAL, "shardd_optim_state_set: in is NULL");
  for (uint64_t done = 0; done < count;) {
    uint64_t n = count - done < OPTIM_STATE_CHUNK ? count - done : OPTIM_STATE_CHUNK;
    Shardwire__OptimState os = SHARDWIRE__OPTIM_STATE__INIT;
    os.optimizer = opt;
    os.ref = ref;
    set_array(&os, array);
    os.has_offset = 1;
    os.offset = offset + done;
    os.has_data = 1;
    os.data.data = (uint8_t *)(in + done);
    os.data.len = n * 4;
    shardd_err rc = optim_state_req(c, &os, NULL);
    if (rc != SHARDD_OK)
      return rc;
    done += n;
  }
  return SHARDD_OK;
}

shardd_err shardd_optim_steps_set(shardd_client_t *c, uint64_t opt, uint64_t ref,
                                  uint64_t steps, uint64_t optimizer_steps) {
  if (c == NULL)
    return SHARDD_E_INVAL; /* no client to hold a message */
  Shardwire__OptimState os = SHARDWIRE__OPTIM_STATE__INIT;
  os.optimizer = opt;
  os.ref = ref;
  os.has_set_steps = 1;
  os.set_steps = steps;
  os.has_set_optimizer_steps = 1;
  os.set_optimizer_steps = optimizer_steps;
  return optim_state_req(c, &os, NULL);
}

shardd_err shardd_barrier(shardd_client_t *c) {
  return shardd_all_reduce(c, NULL, 0, SHARDD_REDUCE_SUM);
}

shardd_err shardd_view_set_requires_grad(shardd_client_t *c, uint64_t view,
                                         int requires_grad) {
  if (c == NULL)
    return SHARDD_E_INVAL; /* no client to hold a message */

  Shardwire__Request req = SHARDWIRE__REQUEST__INIT;
  Shardwire__SetRequiresGrad sr = SHARDWIRE__SET_REQUIRES_GRAD__INIT;
  sr.view = view;
  sr.requires_grad = requires_grad != 0;
  req.body_case = SHARDWIRE__REQUEST__BODY_SET_REQUIRES_GRAD;
  req.set_requires_grad = &sr;
  return call_status_only(c, &req);
}

/* One Step round trip (a step, or a norm-only one); out (may be NULL)
 * gets the count and the norm the reply carries. */
static shardd_err step_call(shardd_client_t *c, Shardwire__Step *st,
                            shardd_step_result *out, int *skipped) {
  Shardwire__Request req = SHARDWIRE__REQUEST__INIT;
  req.body_case = SHARDWIRE__REQUEST__BODY_STEP;
  req.step = st;
  Shardwire__Response *resp;
  shardd_err rc = call_expect(c, &req, SHARDWIRE__RESPONSE__BODY_STEP, &resp, NULL);
  if (rc == SHARDD_OK && out) {
    out->step = resp->step->step;
    out->total_norm = resp->step->has_total_norm ? resp->step->total_norm : 0;
  }
  if (rc == SHARDD_OK && skipped)
    *skipped = resp->step->has_applied && !resp->step->applied;
  if (resp)
    shardwire__response__free_unpacked(resp, NULL);
  return rc;
}

shardd_err shardd_step(shardd_client_t *c, uint64_t opt,
                       const shardd_step_opts *opts, shardd_step_result *out) {
  if (c == NULL)
    return SHARDD_E_INVAL; /* no client to hold a message */

  if (out)
    memset(out, 0, sizeof *out);
  Shardwire__Step st = SHARDWIRE__STEP__INIT;
  st.optimizer = opt;
  if (opts && opts->lr >= 0) {
    st.has_lr = 1;
    st.lr = opts->lr;
  }
  if (opts && opts->max_norm > 0) {
    st.has_max_norm = 1;
    st.max_norm = opts->max_norm;
  }
  Shardwire__HyperParams *hw = NULL, **hp = NULL;
  size_t ng = opts && opts->size >= offsetof(shardd_step_opts, ngroups) +
                                        sizeof opts->ngroups
                  ? opts->ngroups
                  : 0;
  if (ng > 0) {
    if (opts->groups == NULL)
      return set_err(c, SHARDD_E_INVAL, "shardd_step: ngroups %zu with groups NULL", ng);
    hw = calloc(ng, sizeof *hw);
    hp = calloc(ng, sizeof *hp);
    if (hw == NULL || hp == NULL) {
      free(hw);
      free(hp);
      return set_err(c, SHARDD_E_NO_MEMORY, "out of memory");
    }
    for (size_t g = 0; g < ng; g++) {
      hp_to_wire(&opts->groups[g], &hw[g]);
      hp[g] = &hw[g];
    }
    st.n_groups = ng;
    st.groups = hp;
  }
  int *skipped = NULL;
  if (opts && opts->size >= offsetof(shardd_step_opts, skipped) + sizeof opts->skipped) {
    if (opts->expect_step > 0) {
      st.has_expect_step = 1;
      st.expect_step = opts->expect_step;
    }
    skipped = opts->skipped;
    if (skipped)
      *skipped = 0;
  }
  shardd_err rc = step_call(c, &st, out, skipped);
  free(hw);
  free(hp);
  return rc;
}

shardd_err shardd_clip_grad_norm(shardd_client_t *c, uint64_t opt,
                                 double max_norm, double *total_norm) {
  if (c == NULL)
    return SHARDD_E_INVAL; /* no client to hold a message */
  if (total_norm)
    *total_norm = 0;
  if (!(max_norm >= 0))
    return set_err(c, SHARDD_E_RANGE, "shardd_clip_grad_norm: max_norm %g must "
                   "be >= 0 (0 or inf: the norm only)", max_norm);
  Shardwire__Step st = SHARDWIRE__STEP__INIT;
  st.optimizer = opt;
  st.has_norm_only = 1;
  st.norm_only = 1;
  if (max_norm > 0 && isfinite(max_norm)) {
    st.has_max_norm = 1;
    st.max_norm = max_norm;
  }
  shardd_step_result res;
  shardd_err rc = step_call(c, &st, &res, NULL);
  if (rc == SHARDD_OK && total_norm)
    *total_norm = res.total_norm;
  return rc;
}

static shardd_err checkpoint_req(shardd_client_t *c, const char *job,
                                 const char *dir, int collective,
                                 double wait_s) {
  if (c == NULL)
    return SHARDD_E_INVAL; /* no client to hold a message */

  if (dir == NULL || dir[0] == '\0')
    return set_err(c, SHARDD_E_INVAL, "checkpoint: no directory");
  Shardwire__Request req = SHARDWIRE__REQUEST__INIT;
  Shardwire__Checkpoint cp = SHARDWIRE__CHECKPOINT__INIT;
  cp.dir = (char *)dir;
  cp.job = (char *)job;
  if (collective) {
    cp.has_collective = 1;
    cp.collective = 1;
  }
  if (wait_s > 0) {
    cp.has_wait_s = 1;
    cp.wait_s = wait_s;
  }
  req.body_case = SHARDWIRE__REQUEST__BODY_CHECKPOINT;
  req.checkpoint = &cp;
  Shardwire__Response *resp;
  shardd_err rc = call_expect(c, &req, SHARDWIRE__RESPONSE__BODY_CHECKPOINT, &resp, NULL);
  if (resp)
    shardwire__response__free_unpacked(resp, NULL);
  return rc;
}

shardd_err shardd_checkpoint(shardd_client_t *c, const char *job,
                             const char *dir) {
  return checkpoint_req(c, job, dir, 0, 0);
}

shardd_err shardd_checkpoint_wait(shardd_client_t *c, const char *job,
                                  const char *dir, double timeout_s) {
  if (c == NULL)
    return SHARDD_E_INVAL;
  if (!(timeout_s >= 0 && timeout_s <= 86400))
    return set_err(c, SHARDD_E_RANGE, "checkpoint: timeout must be 0..86400 s");
  return checkpoint_req(c, job, dir, 0, timeout_s);
}

shardd_err shardd_checkpoint_collective(shardd_client_t *c, const char *dir) {
  return checkpoint_req(c, NULL, dir, 1, 0);
}

shardd_err shardd_release_job(shardd_client_t *c, const char *job,
                              uint32_t *buffers, uint32_t *optimizers) {
  if (c == NULL)
    return SHARDD_E_INVAL;
  if (buffers)
    *buffers = 0;
  if (optimizers)
    *optimizers = 0;
  if (job == NULL || job[0] == '\0')
    return set_err(c, SHARDD_E_INVAL, "release: no job");
  Shardwire__Request req = SHARDWIRE__REQUEST__INIT;
  Shardwire__ReleaseJob rj = SHARDWIRE__RELEASE_JOB__INIT;
  rj.job = (char *)job;
  req.body_case = SHARDWIRE__REQUEST__BODY_RELEASE_JOB;
  req.release_job = &rj;
  Shardwire__Response *resp;
  shardd_err rc = call_expect(c, &req, SHARDWIRE__RESPONSE__BODY_RELEASE_JOB, &resp, NULL);
  if (rc == SHARDD_OK) {
    if (buffers)
      *buffers = resp->release_job->buffers;
    if (optimizers)
      *optimizers = resp->release_job->optimizers;
  }
  if (resp)
    shardwire__response__free_unpacked(resp, NULL);
  return rc;
}

shardd_err shardd_restore(shardd_client_t *c, const char *dir, uint32_t world,
                          char *job, size_t joblen) {
  if (c == NULL)
    return SHARDD_E_INVAL; /* no client to hold a message */

  if (job && joblen)
    job[0] = '\0';
  if (dir == NULL || dir[0] == '\0')
    return set_err(c, SHARDD_E_INVAL, "restore: no directory");
  Shardwire__Request req = SHARDWIRE__REQUEST__INIT;
  Shardwire__Restore rs = SHARDWIRE__RESTORE__INIT;
  rs.dir = (char *)dir;
  if (world) {
    rs.has_world = 1;
    rs.world = world;
  }
  req.body_case = SHARDWIRE__REQUEST__BODY_RESTORE;
  req.restore = &rs;
  Shardwire__Response *resp;
  shardd_err rc = call_expect(c, &req, SHARDWIRE__RESPONSE__BODY_CHECKPOINT, &resp, NULL);
  if (rc == SHARDD_OK && job && joblen)
    snprintf(job, joblen, "%s", resp->checkpoint->job);
  if (resp)
    shardwire__response__free_unpacked(resp, NULL);
  return rc;
}

/* Receives until a's reply has come (a stays listed, its result kept). */
static shardd_err await_op(shardd_client_t *c, async_op *a) {
  if (a->done)
    return SHARDD_OK;
  Shardwire__Response *resp;
  shardd_err rc = recv_for(c, a->seq, &resp, NULL);
  if (resp) {
    async_note(a, resp, rc, shardd_last_error(c));
    shardwire__response__free_unpacked(resp, NULL);
    return SHARDD_OK;
  }
  return rc; /* the connection failed: no reply will come */
}

shardd_err shardd_wait(shardd_client_t *c, shardd_ticket t) {
  if (c == NULL)
    return SHARDD_E_INVAL; /* no client to hold a message */

  return shardd_wait_area(c, t, NULL);
}

shardd_err shardd_wait_area(shardd_client_t *c, shardd_ticket t,
                            shardd_area *out) {
  if (c == NULL)
    return SHARDD_E_INVAL; /* no client to hold a message */

  if (out)
    memset(out, 0, sizeof *out);
  async_op **pp = &c->async;
  while (*pp && (*pp)->seq != t)
    pp = &(*pp)->next;
  if (*pp == NULL)
    return set_err(c, SHARDD_E_INVAL, "ticket %" PRIu64 " is not outstanding", t);
  async_op *a = *pp;
  clear_err(c);
  shardd_err rc = await_op(c, a);
  if (rc == SHARDD_OK) {
    rc = a->code;
    if (rc != SHARDD_OK)
      set_err(c, rc, "%s", a->msg ? a->msg : shardd_strerror(rc));
  }
  if (rc == SHARDD_OK && out) {
    Shardwire__GatherReply gr = SHARDWIRE__GATHER_REPLY__INIT;
    gr.pool = a->pool;
    gr.gather_offset = a->gather_off;
    /* the pool was mapped when the reply came; only the size is not kept */
    const pool_map *p = a->has_area ? find_pool(c, a->pool) : NULL;
    gr.pool_bytes = p ? p->len : 0;
    rc = area_fill(c, a->buffer, a->has_area ? &gr : NULL, 0, out);
    if (rc != SHARDD_OK)
      memset(out, 0, sizeof *out);
  }
  *pp = a->next;
  free(a->msg);
  free(a);
  return rc;
}

shardd_err shardd_gather_async(shardd_client_t *c, uint64_t buffer,
                               shardd_ticket *t) {
  if (c == NULL)
    return SHARDD_E_INVAL; /* no client to hold a message */
  if (t == NULL)
    return set_err(c, SHARDD_E_INVAL, "shardd_gather_async: t is NULL");

  *t = 0;
  clear_err(c);
  /* limit_all_gathers: with max_async still in flight, the oldest is
   * awaited first (its ticket keeps its result for shardd_wait), which
   * bounds the gather areas being filled ahead of use. */
  size_t n = 0;
  async_op *oldest = NULL;
  for (async_op *a = c->async; a; a = a->next)
    if (!a->done) {
      n++;
      if (oldest == NULL)
        oldest = a;
    }
  if (n >= c->max_async) {
    shardd_err rc = await_op(c, oldest);
    if (rc != SHARDD_OK)
      return rc;
  }
  async_op *a = calloc(1, sizeof *a);
  if (a == NULL)
    return set_err(c, SHARDD_E_NO_MEMORY, "out of memory");
  Shardwire__Request req = SHARDWIRE__REQUEST__INIT;
  Shardwire__Gather g = SHARDWIRE__GATHER__INIT;
  g.buffer = buffer;
  req.body_case = SHARDWIRE__REQUEST__BODY_GATHER;
  req.gather = &g;
  shardd_err rc = send_req(c, &req);
  if (rc != SHARDD_OK) {
    free(a);
    return rc;
  }
  a->seq = req.seq;
  a->buffer = buffer;
  async_op **tail = &c->async;
  while (*tail)
    tail = &(*tail)->next;
  *tail = a;
  *t = a->seq;
  return SHARDD_OK;
}
