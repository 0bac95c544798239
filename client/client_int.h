/* client_int.h — what libshardd's files share and nothing outside them
 * sees: the client's state, the mappings it keeps, and each file's entry
 * points. Every declaration here is hidden: the .so exports the public API
 * of shardd.h only (and the frame, fmt and strbuf helpers it always had).
 *
 *   connection.c    the connection: connect, Hello, send, the receive loop,
 *                   the last error, close
 *   mappings.c      the mappings of rank blocks and transient-area pools
 *   cuda_ipc.c      CUDA IPC through libcudart loaded at run time
 *   registration.c  buffers, views, optimizers, one at a time and in batches
 *   collectives.c   gather, scatter, buckets, all-reduce, barrier
 *   training.c      step, gradient norm, optimizer state, seed, requires-grad
 *   async.c         async gathers and their tickets
 *   admin.c         status, inspect, checkpoints, restore, release of a job */
#ifndef SHARDD_CLIENT_INT_H
#define SHARDD_CLIENT_INT_H

#include <stddef.h>
#include <stdint.h>
#include <sys/un.h>

#include "frame.h"
#include "proto/shardd.pb-c.h"
#include "shardd.h"

#pragma GCC visibility push(hidden)

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

/* A request sent with shardd_gather_async or shardd_release_async, until
 * shardd_wait takes it. */
typedef struct async_op {
  struct async_op *next;
  uint64_t seq;
  uint64_t buffer;
  int gather; /* a gather (max_async bounds those), not a release */
  int done;
  shardd_err code;
  char *msg;
  int want_grad; /* a gather that also leases the gradient area */
  /* the reply's GatherReply (transient areas), for shardd_wait_area */
  int has_area;
  uint64_t pool, gather_off;
  int has_grad_off, has_grad_pool;
  uint64_t grad_off, grad_pool;
} async_op;

/* What a batch's replies are decoded into (see shardd__reply_arena_use):
 * chunks pieces are bumped out of, taken back at once. */
typedef struct reply_chunk reply_chunk;
typedef struct {
  ProtobufCAllocator a; /* allocator_data is this arena */
  reply_chunk *chunks;  /* newest first */
} reply_arena;

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
  /* NULL: replies are malloc'ed piece by piece (freed with
   * free_unpacked); else the reply to the awaited request is decoded into
   * this arena (a batch's: one ViewReply each of 4096 entries, whose
   * mallocs and frees were half of decoding them) */
  reply_arena *reply_in;
  reply_arena batch_replies;
};

/* ---- connection.c ---- */

/* Sets the last error of c to the formatted message; returns rc. */
shardd_err shardd__set_err(shardd_client_t *c, shardd_err rc, const char *fmt,
                           ...) __attribute__((format(printf, 3, 4)));
void shardd__clear_err(shardd_client_t *c);
/* Sends req with the next seq. */
shardd_err shardd__send_req(shardd_client_t *c, Shardwire__Request *req);
/* The two halves of shardd__send_req, so a request can be packed while
 * the daemon works on the one before it: req_pack gives req the next seq
 * and packs it into *buf (n bytes, the caller's: send_packed frees it,
 * or free() when it is not sent; a seq not sent is skipped, harmless);
 * send_packed sends it. */
shardd_err shardd__req_pack(shardd_client_t *c, Shardwire__Request *req,
                            uint8_t **buf, size_t *n);
shardd_err shardd__send_packed(shardd_client_t *c, uint8_t *buf, size_t n);
/* From shardd__reply_arena_use to _stop, the replies recv_for_many reads
 * are decoded into c's batch arena: the caller does not free_unpacked the
 * one returned but calls shardd__reply_arena_reset when done with it
 * (replies to async requests read meanwhile are noted, copied, as
 * before). _free (shardd_close) gives back the chunk reset keeps. */
void shardd__reply_arena_use(shardd_client_t *c);
void shardd__reply_arena_stop(shardd_client_t *c);
void shardd__reply_arena_reset(shardd_client_t *c);
void shardd__reply_arena_free(shardd_client_t *c);
/* Reads responses until the one to seq (connection.c says how). */
shardd_err shardd__recv_for_many(shardd_client_t *c, uint64_t seq,
                                 Shardwire__Response **out, int *fd, int *many,
                                 int maxmany, int *nmany);
shardd_err shardd__recv_for(shardd_client_t *c, uint64_t seq,
                            Shardwire__Response **out, int *fd);
/* Sends req and waits for the response to it (see shardd__recv_for). */
shardd_err shardd__call(shardd_client_t *c, Shardwire__Request *req,
                        Shardwire__Response **out, int *fd);
/* A call whose reply body must be of one kind. */
shardd_err shardd__call_expect(shardd_client_t *c, Shardwire__Request *req,
                               Shardwire__Response__BodyCase want,
                               Shardwire__Response **out, int *fd);
shardd_err shardd__call_status_only(shardd_client_t *c,
                                    Shardwire__Request *req);

/* ---- cuda_ipc.c ---- */

/* cudaIpcMemHandle_t's size: a struct of 64 bytes. */
#define CUDA_IPC_BYTES 64

/* Loads libcudart once per process; 0 when it cannot be, with the reason
 * in shardd__cudart_why(). */
int shardd__cudart_ready(void);
const char *shardd__cudart_why(void);
const char *shardd__cudart_str(int e);
/* The driver call that measures an opened mapping: *what is this pointer
 * when it failed (its CUresult is no cudaError_t). */
extern const char shardd__cudart_range_call[];
int shardd__cudart_ipc_open(const void *handle, int dev, void **out,
                            size_t *avail, const char **what);
/* Closes an opened IPC pointer on its device (the current one kept). */
void shardd__cudart_ipc_close(void *base, int device);

/* ---- mappings.c ---- */

pool_map *shardd__find_pool(shardd_client_t *c, uint64_t id);
shardd_err shardd__pool_adopt(shardd_client_t *c,
                              const Shardwire__GatherReply *gr, const int *fds,
                              int nfds, char *why, size_t whylen);
/* What was found of a descriptor several replies' blocks share (a slab):
 * checked once for all of them. size < 0: not yet. */
typedef struct {
  intmax_t size;
  int unfit; /* memfd_unfit's reason: 0 fit, 1 too small, 2 not sealed */
} shardd__fd_fit;
/* Checks br's layout and maps (or finds the mapping of) its block: at
 * br's block_offset of fd (host) or its CUDA IPC handle, filling out. fd
 * stays the caller's; fit (NULL: none) keeps what fd's checks found for
 * the next block of the same descriptor. */
shardd_err shardd__buffer_adopt(shardd_client_t *c,
                                const Shardwire__BufferReply *br, int fd,
                                shardd__fd_fit *fit, shardd_buffer_info *out);
void shardd__unmap_buffer(shardd_client_t *c, uint64_t id);
shardd_err shardd__area_fill(shardd_client_t *c, uint64_t buffer,
                             const Shardwire__GatherReply *gr, int want_grad,
                             shardd_area *out);
/* Unmaps every buffer and pool of c (at close). */
void shardd__mappings_free(shardd_client_t *c);

/* ---- async.c ---- */

/* A reply to a request other than the one waited for: kept for shardd_wait
 * when it answers an outstanding async gather (code pool_rc with why when
 * its pool could not be mapped), else dropped. */
void shardd__async_reply(shardd_client_t *c, const Shardwire__Response *resp,
                         shardd_err pool_rc, const char *why);
/* Frees every ticket of c (at close). */
void shardd__async_free(shardd_client_t *c);

/* ---- registration.c ---- */

/* A ViewsBatch registration request of n entries (sizes[i]: each one's
 * packed size) with seq (first_index written when > 0), packed by hand
 * into *buf (malloc'ed, *len bytes): the bytes protobuf-c's pack writes,
 * with each entry sized and packed once. SHARDD_E_FRAME_TOO_LARGE (*len
 * set, nothing allocated) past the frame limit; E_INTERNAL when sizes are
 * not the entries'. */
shardd_err shardd__views_request_pack(uint64_t seq,
                                      Shardwire__RegisterView *const *views,
                                      const size_t *sizes, size_t n,
                                      uint32_t first_index, uint8_t **buf,
                                      size_t *len);

void shardd__batch_fail(shardd_client_t *c, shardd_err rc,
                        const Shardwire__Response *resp, size_t lo, size_t hi,
                        size_t n, shardd_err *errs, const char *after);
void shardd__hp_to_wire(const shardd_hparams *h, Shardwire__HyperParams *w);

#pragma GCC visibility pop

#endif
