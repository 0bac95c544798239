/* shardd.h — the public C API of libshardd, the client library of the shardd
 * daemon, and the one error table shared by daemon, library and shardctl.
 *
 * A trainer connects with shardd_connect() naming its job, rank and world,
 * registers flat buffers (each call hands back the caller's rank block,
 * already mapped: its shard, its gather area and its gradient area), names
 * views inside them, registers an optimizer over those, and then drives the
 * training loop with shardd_gather(), shardd_scatter() and shardd_step().
 *
 * Threading: a shardd_client_t is used by one thread at a time; open one
 * connection per rank. Calls are synchronous; collectives return when every
 * rank of the job has made the same call.
 */
#ifndef SHARDD_H
#define SHARDD_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define SHARDD_VERSION "0.1.0"
#define SHARDD_PROTOCOL_VERSION 1
#define SHARDD_DEFAULT_SOCKET "/run/shardd/shardd.sock"
/* Frames above this are refused and the connection is closed. */
#define SHARDD_MAX_FRAME (16u * 1024u * 1024u)

/* XX(NAME, value, message). Values are wire values (proto StatusCode) and
 * are never renumbered; append only. */
#define SHARDD_ERRNO_MAP(XX)                                                  \
  XX(OK, 0, "success")                                                        \
  XX(E_INVAL, 1, "invalid argument")                                          \
  XX(E_PROTOCOL, 2, "protocol error")                                         \
  XX(E_VERSION, 3, "protocol version mismatch")                               \
  XX(E_FRAME_TOO_LARGE, 4, "frame too large")                                 \
  XX(E_NOT_FOUND, 5, "no such object")                                        \
  XX(E_NOT_OWNED, 6, "not owned by this job")                                 \
  XX(E_DUPLICATE, 7, "parameter referenced more than once")                   \
  XX(E_OVERLAP, 8, "views overlap")                                           \
  XX(E_DTYPE, 9, "unsupported dtype")                                         \
  XX(E_RANGE, 10, "value out of range")                                       \
  XX(E_BUSY, 11, "object in use")                                             \
  XX(E_NO_MEMORY, 12, "out of device memory")                                 \
  XX(E_PEER_LOST, 13, "a rank of the collective was lost")                    \
  XX(E_TIMEOUT, 14, "timed out")                                              \
  XX(E_PERMISSION, 15, "permission denied")                                   \
  XX(E_STALE, 16, "stale reference")                                          \
  XX(E_IO, 17, "I/O error")                                                   \
  XX(E_CONNECT, 18, "cannot connect to the daemon")                           \
  XX(E_CLOSED, 19, "connection closed")                                       \
  XX(E_MISMATCH, 20, "conflicts with an existing registration")               \
  XX(E_NO_CUDA, 21, "CUDA is not available")                                  \
  XX(E_STATE, 22, "not allowed in this session state")                        \
  XX(E_LIMIT, 23, "limit exceeded")                                           \
  XX(E_INTERNAL, 24, "internal error")                                        \
  XX(E_SHUTDOWN, 25, "the daemon is stopping")

typedef enum {
#define XX(name, val, msg) SHARDD_##name = val,
  SHARDD_ERRNO_MAP(XX)
#undef XX
  SHARDD_ERR_COUNT
} shardd_err;

/* Static message for a code; never NULL ("unknown error" out of range). */
const char *shardd_strerror(shardd_err err);
/* Static symbolic name ("E_NOT_OWNED"); never NULL. */
const char *shardd_err_name(shardd_err err);

typedef enum {
  SHARDD_DTYPE_FP32 = 1,
  SHARDD_DTYPE_BF16 = 2,
  SHARDD_DTYPE_FP16 = 3
} shardd_dtype;

/* Bytes per element, 0 for an unknown dtype. */
size_t shardd_dtype_size(shardd_dtype dtype);
/* "fp32", "bf16", "fp16" or NULL. */
const char *shardd_dtype_name(shardd_dtype dtype);
/* Parses a dtype's name, case-insensitively: fp32, float32, float, f32; bf16,
 * bfloat16; fp16, float16, half, f16. SHARDD_E_DTYPE when unknown (*out
 * untouched). */
shardd_err shardd_dtype_parse(const char *s, shardd_dtype *out);

typedef enum {
  SHARDD_OPTIM_SGD = 1,
  SHARDD_OPTIM_ADAM = 2,
  SHARDD_OPTIM_ADAMW = 3
} shardd_optim_kind;

/* Scatter takes SUM and MEAN; shardd_all_reduce all four. */
typedef enum {
  SHARDD_REDUCE_SUM = 0,
  SHARDD_REDUCE_MEAN = 1,
  SHARDD_REDUCE_MAX = 2,
  SHARDD_REDUCE_MIN = 3
} shardd_reduce_op;

/* Values one shardd_all_reduce may carry. */
#define SHARDD_ALL_REDUCE_MAX 64

typedef struct shardd_client shardd_client_t;

/* Options of shardd_connect(). Created with SHARDD_CONNECT_OPTS_INIT; fields
 * are only ever appended. job == NULL or "" makes a control session
 * (status/inspect only). */
typedef struct {
  size_t size;
  const char *job;
  uint32_t rank;
  uint32_t world;
  const char *client_name;
  /* shardd_gather_async: at most this many in flight (0: 2), like FSDP's
   * limit_all_gathers. */
  uint32_t max_inflight_gathers;
  /* 1: ask for a job with transient areas (FSDP's reshard): its buffers'
   * rank blocks keep only the shard and the fp32 reduced-gradient shard,
   * and each gather leases this rank's gather area (and, asked, its
   * gradient area) from a pool of its device: see shardd_gather_area().
   * The Hello that creates the job decides; a later rank asking otherwise
   * is refused (SHARDD_E_MISMATCH). (Appended; a caller built against an
   * older header, whose size ends before it, gets resident areas.) */
  int transient_areas;
  /* Seconds the daemon may stay silent before a call on this client fails
   * with SHARDD_E_TIMEOUT, "daemon at SOCKET did not answer for N s": a
   * stopped or hung daemon is reported instead of blocking forever. After
   * half of it without a reply, the call sends a Ping; the daemon answers
   * it while a collective still waits for a slow peer, so a collective
   * lasts as long as the daemon's --collective-timeout lets it, and only
   * a daemon that answers nothing for timeout_s fails the call. The
   * request stays outstanding (its outcome unknown; a later reply to it is
   * dropped) and the client stays usable. Also bounds the Hello.
   * 0: $SHARDD_TIMEOUT when set (seconds), else SHARDD_DEFAULT_TIMEOUT;
   * negative (or $SHARDD_TIMEOUT 0): wait forever, as before. (Appended.) */
  double timeout_s;
} shardd_connect_opts;
#define SHARDD_CONNECT_OPTS_INIT {sizeof(shardd_connect_opts), NULL, 0, 1, NULL, 0, 0, 0.0}

/* shardd_connect_opts.timeout_s's default, in seconds: far below any
 * sensible --collective-timeout (300 s by default), far above one turn of
 * a daemon that is alive. */
#define SHARDD_DEFAULT_TIMEOUT 60.0

/* Connects to the daemon at socket_path (NULL: $SHARDD_SOCKET, then
 * SHARDD_DEFAULT_SOCKET) and performs the Hello handshake. On success *out
 * is a new client the caller closes with shardd_close(). On failure *out is
 * NULL and, when errbuf is not NULL, it holds the reason. */
shardd_err shardd_connect(const char *socket_path,
                          const shardd_connect_opts *opts,
                          shardd_client_t **out, char *errbuf, size_t errlen);

/* Changes c's silence deadline (shardd_connect_opts.timeout_s; here 0 is
 * the default and negative none) for the calls that follow: e.g. none
 * around a call known to keep the daemon's loop busy for long. */
void shardd_set_timeout(shardd_client_t *c, double timeout_s);

/* Closes the connection, unmaps every area handed out on it and frees c.
 * NULL is a no-op. To the daemon this is a rank that went away (as if it
 * crashed): its job lingers for --job-linger, for a relaunch to resume.
 * A trainer that is done says so with shardd_finish(). */
void shardd_close(shardd_client_t *c);

/* A clean close: tells the daemon this rank is finished with its job (a
 * Goodbye), then closes as shardd_close(c). Once every rank of the job has
 * finished, the daemon releases the job at once (memory back) and a new
 * run of its name starts fresh instead of resuming it. Returns the
 * Goodbye's result (c is closed and freed whatever it is); NULL is a
 * no-op (SHARDD_OK). */
shardd_err shardd_finish(shardd_client_t *c);

/* 1 when the job this client joined holds trained or restored state that
 * this rank resumes (its ranks died and were relaunched, a rank rejoining,
 * a restored job), with *step (when not NULL) the most steps one of its
 * optimizers took; 0 for a fresh job (and control sessions). */
int shardd_resumed(const shardd_client_t *c, uint64_t *step);

/* Detail of the last failed call on c (the daemon's message when it sent
 * one, whole, however long: a refused optimizer's lists every bad ref).
 * Borrowed; valid until the next call on c. Never NULL. */
const char *shardd_last_error(const shardd_client_t *c);

/* This library's version (SHARDD_VERSION): the one version string of the
 * project; the Makefile, pkg-config and the Python binding read it from
 * here. */
const char *shardd_version(void);

/* Description of the daemon from the handshake. Borrowed; valid until
 * shardd_close(c). */
const char *shardd_daemon_version(const shardd_client_t *c);
const char *shardd_daemon_backend(const shardd_client_t *c);

/* Round trip of an empty request: the cost floor of every call. */
shardd_err shardd_ping(shardd_client_t *c);

/* Daemon status as one JSON document or as `key: value` text. *out is
 * caller-freed with shardd_free(). */
shardd_err shardd_status_json(shardd_client_t *c, char **out);
shardd_err shardd_status_text(shardd_client_t *c, char **out);
/* As above, listing jobs from the first_job-th on (sorted by name, then
 * owner): a status lists at most 256 jobs, and says how many follow
 * (`jobs_more`); a job of a huge world lists 64 of each kind of rank and
 * counts the rest (`*_more`). */
shardd_err shardd_status_json_from(shardd_client_t *c, uint32_t first_job,
                                   char **out);
shardd_err shardd_status_text_from(shardd_client_t *c, uint32_t first_job,
                                   char **out);

/* One buffer or view, by id (name NULL) or by name (id 0), as JSON or text.
 * *out is caller-freed with shardd_free(). */
shardd_err shardd_inspect_json(shardd_client_t *c, uint64_t id,
                               const char *name, char **out);
shardd_err shardd_inspect_text(shardd_client_t *c, uint64_t id,
                               const char *name, char **out);

void shardd_free(void *p);

/* A registered flat buffer as seen by this rank. The four pointers are
 * mappings owned by c: valid until the buffer is unregistered on c or c is
 * closed. shard holds shard_numel elements (this rank's slice, elements
 * [rank*shard_numel, (rank+1)*shard_numel) of the padded buffer); gather and
 * grad hold padded_numel elements each.
 *
 * Cuda backend (is_device 1): shard, gather, grad and reduced are CUDA
 * device pointers into the daemon's allocation on GPU `device`, opened with
 * cudaIpcOpenMemHandle — usable by kernels and cudaMemcpy, never
 * dereferenced on the host. libshardd does not link CUDA: it loads
 * libcudart.so at run time for this ($SHARDD_CUDART, when set, names the
 * library instead; SHARDD_E_NO_CUDA when it cannot be loaded), and
 * closes the handle (cudaIpcCloseMemHandle) on unregister and close. Work
 * written there must be complete (stream synchronised) before the gather,
 * scatter or step that reads it is requested. Host backend: is_device 0,
 * host mappings. */
typedef struct {
  uint64_t id;
  shardd_dtype dtype;
  uint64_t numel;
  uint64_t padded_numel;
  uint64_t shard_numel;
  uint32_t world;
  uint32_t rank;
  uint32_t device;
  int created; /* 1 when this call created it, 0 when it attached */
  void *shard;
  void *gather;
  void *grad;
  void *reduced; /* shard_numel fp32: this rank's reduced gradient shard */
  /* The generation of the buffer's name in the job: 1 at the first
   * registration, +1 at each re-registration after an unregister and at
   * each restore. An id freed and re-registered since is refused with
   * SHARDD_E_STALE, naming the current handle. (Appended; 0 from a daemon
   * that predates generations.) */
  uint64_t generation;
  /* 1: the pointers above are CUDA device pointers (cuda backend); 0: host
   * memory. (Appended.) */
  int is_device;
  /* 1: the job has transient areas (shardd_connect_opts.transient_areas):
   * gather and grad are NULL, as the block holds only shard and reduced;
   * each shardd_gather_area() says where this rank's areas are. (Appended.) */
  int transient;
  /* 1: the shards hold trained or restored values (a step ran on them, or
   * a restore made the buffer): attach to them; 0: write initial values.
   * (Appended.) */
  int existing;
} shardd_buffer_info;

/* Creates the job's flat buffer called name, or attaches to it when another
 * rank created it already (same dtype and numel, else SHARDD_E_MISMATCH).
 * Its shards start zeroed. */
shardd_err shardd_buffer_register(shardd_client_t *c, const char *name,
                                  shardd_dtype dtype, uint64_t numel,
                                  shardd_buffer_info *out);

typedef struct {
  size_t size;
  /* set: a checksum of this rank's whole flattened initial values; while
   * the buffer is not existing, a rank whose checksum differs from the
   * first rank's is refused (SHARDD_E_MISMATCH naming both ranks) */
  int has_init_checksum;
  uint64_t init_checksum;
} shardd_buffer_opts;
#define SHARDD_BUFFER_OPTS_INIT {sizeof(shardd_buffer_opts), 0, 0}

/* shardd_buffer_register with opts (NULL: none). */
shardd_err shardd_buffer_register_opts(shardd_client_t *c, const char *name,
                                       shardd_dtype dtype, uint64_t numel,
                                       const shardd_buffer_opts *opts,
                                       shardd_buffer_info *out);

/* Frees the buffer and its views for the whole job (SHARDD_E_BUSY while an
 * optimizer names it or a collective on it is in flight). */
shardd_err shardd_buffer_unregister(shardd_client_t *c, uint64_t buffer);

/* One entry of shardd_buffers_register(): the arguments and options of
 * shardd_buffer_register_opts(). Created with SHARDD_BUFFER_SPEC_INIT;
 * fields are only ever appended, and size (the same in every entry) is
 * the array's stride. name is borrowed for the call. */
typedef struct {
  size_t size;
  const char *name;
  shardd_dtype dtype;
  uint64_t numel;
  int has_init_checksum;
  uint64_t init_checksum;
} shardd_buffer_spec;
#define SHARDD_BUFFER_SPEC_INIT {sizeof(shardd_buffer_spec), NULL, SHARDD_DTYPE_FP32, 0, 0, 0}

/* Entries per request of shardd_buffers_register / _unregister: a reply
 * brings at most one descriptor per buffer (host backend: the blocks a
 * request makes share one memfd per rank, sent once), under the kernel's
 * 253 per message (SCM_MAX_FD). */
#define SHARDD_BUFFERS_PER_REQUEST 250

/* Registers (or attaches to) n buffers at once, all or nothing: one request
 * per up to SHARDD_BUFFERS_PER_REQUEST entries instead of one per buffer,
 * each entry handled as shardd_buffer_register_opts would (out[i] as its
 * out; mappings are shared with the single call's). When an entry is
 * refused nothing of that request is kept, the buffers created by the
 * call's earlier requests are unregistered again, and the error names
 * every refused entry of the request ("[index] CODE: why"); errs (NULL,
 * or n entries) gets each entry's code, SHARDD_E_STATE for the entries
 * after the refused request (not checked). One thing is not undone across
 * requests: the initial checksum an earlier request recorded on a buffer
 * it attached to (the next registration of that rank records its own). */
shardd_err shardd_buffers_register(shardd_client_t *c, size_t n,
                                   const shardd_buffer_spec *specs,
                                   shardd_buffer_info *out, shardd_err *errs);

/* Unregisters n buffers, all or nothing per request (up to
 * SHARDD_BUFFERS_PER_REQUEST ids): every id is checked first (registered,
 * not held by an optimizer, no collective in flight, generation current
 * when generations[i] is not 0, named once) and none of the request goes
 * when any fails; the requests before a refused one stay done. errs as in
 * shardd_buffers_register. generations may be NULL. */
shardd_err shardd_buffers_unregister(shardd_client_t *c, size_t n,
                                     const uint64_t *buffers,
                                     const uint64_t *generations,
                                     shardd_err *errs);

/* Names elements [offset, offset+numel) of a buffer as an original
 * parameter of the given shape (product == numel; ndim 0 is a scalar).
 * Attaches when the same view exists already. */
shardd_err shardd_view_register(shardd_client_t *c, uint64_t buffer,
                                const char *name, uint64_t offset,
                                uint64_t numel, const int64_t *shape,
                                int ndim, uint64_t *out_id);
shardd_err shardd_view_unregister(shardd_client_t *c, uint64_t view);

/* Options of shardd_view_register_ex(). Created with SHARDD_VIEW_OPTS_INIT;
 * fields are only ever appended.
 * requires_grad 0 registers a frozen range (LoRA/PEFT base weights next to
 * trainable adapters in one flat buffer): scatter computes no reduced
 * gradient for its elements (their reduced-gradient elements are left
 * untouched) and no reduce work at all for a rank whose shard is wholly
 * frozen; an optimizer may name it (its steps skip it while it stays
 * frozen, as torch skips a parameter with requires_grad=False), but not
 * the whole buffer holding it. A
 * frozen view may not overlap a trainable one (SHARDD_E_OVERLAP) nor be
 * added to a buffer an optimizer holds whole (SHARDD_E_BUSY); attaching
 * with the other requires_grad is SHARDD_E_MISMATCH.
 * buffer_generation, when not 0, must be the buffer's generation
 * (shardd_buffer_info.generation), else SHARDD_E_STALE. */
typedef struct {
  size_t size;
  int requires_grad;
  uint64_t buffer_generation;
} shardd_view_opts;
#define SHARDD_VIEW_OPTS_INIT {sizeof(shardd_view_opts), 1, 0}

/* A registered view: its id and generation (see shardd_buffer_info), and
 * whether this call created it. */
typedef struct {
  uint64_t id;
  uint64_t generation;
  int created;
} shardd_view_info;

/* shardd_view_register with options (opts NULL: the defaults); out may be
 * NULL. */
shardd_err shardd_view_register_ex(shardd_client_t *c, uint64_t buffer,
                                   const char *name, uint64_t offset,
                                   uint64_t numel, const int64_t *shape,
                                   int ndim, const shardd_view_opts *opts,
                                   shardd_view_info *out);

/* One entry of shardd_views_register(): the arguments and options of
 * shardd_view_register_ex(). Created with SHARDD_VIEW_SPEC_INIT; fields
 * are only ever appended, and size (the same in every entry) is the
 * array's stride. name and shape are borrowed for the call. */
typedef struct {
  size_t size;
  uint64_t buffer;
  const char *name;
  uint64_t offset;
  uint64_t numel;
  const int64_t *shape;
  int ndim;
  int requires_grad;
  uint64_t buffer_generation; /* 0: not checked */
} shardd_view_spec;
#define SHARDD_VIEW_SPEC_INIT {sizeof(shardd_view_spec), 0, NULL, 0, 0, NULL, 0, 1, 0}

/* Registers (or attaches to) n views at once, all or nothing: one request
 * per up to SHARDD_VIEWS_PER_REQUEST entries instead of one per view
 * (100,000 views: 2.4 s one by one). Each entry is checked as
 * shardd_view_register_ex would check it, in order, so it also meets the
 * entries before it (a frozen entry overlapping a trainable one earlier
 * in the list is refused). When any entry is refused, no view of the call
 * is kept and last_error names every refused entry by index ("[7]
 * E_RANGE: ..."); errs, when not NULL, gets each entry's code (SHARDD_OK
 * for the entries that were fine). All or nothing because a model is
 * wrapped whole or not at all: a half-registered model would make the
 * corrected retry attach to stale views, and FSDP users fix every bad
 * parameter from one report, as torch's load_state_dict(strict=True)
 * lists every missing key at once. out (n entries, may be NULL) gets each
 * view's id, generation and created flag on success.
 *
 * A call larger than one request is sent as several; when a later one is
 * refused, the views the earlier ones created are unregistered again
 * (their names' generations then count that registration, and a rank
 * that attached to them meanwhile sees them go), and the requests after
 * it are not sent: their entries are reported as not checked
 * (SHARDD_E_STATE in errs, "and N entries not checked" in the message).
 * 256 entries per request keep each one near the daemon's 1 ms turn per
 * session, so other clients wait for one request, not for the call. */
#define SHARDD_VIEWS_PER_REQUEST 256
shardd_err shardd_views_register(shardd_client_t *c, size_t n,
                                 const shardd_view_spec *specs,
                                 shardd_view_info *out, shardd_err *errs);

/* Unregisters n views, all or nothing per request (up to
 * SHARDD_VIEWS_PER_REQUEST ids): every id is checked first (a view of the
 * job, held by no optimizer, named once, and when generations is not
 * NULL and generations[i] is not 0, of that generation) and, when one
 * fails, none of that request's views goes and last_error names every
 * refused entry. Requests already done stay done (a view cannot be
 * registered back under its id), so on a refusal the views of earlier
 * requests are gone: errs (may be NULL) then says SHARDD_OK for those,
 * the refusals' codes, and SHARDD_E_STATE for the entries not sent. */
shardd_err shardd_views_unregister(shardd_client_t *c, size_t n,
                                   const uint64_t *views,
                                   const uint64_t *generations,
                                   shardd_err *errs);

/* Hyperparameters; only fields whose SHARDD_HP_* bit is in `set` are sent,
 * the others take torch.optim's defaults (or, in a group, the optimizer's). */
enum {
  SHARDD_HP_LR = 1u << 0,
  SHARDD_HP_MOMENTUM = 1u << 1,
  SHARDD_HP_DAMPENING = 1u << 2,
  SHARDD_HP_WEIGHT_DECAY = 1u << 3,
  SHARDD_HP_NESTEROV = 1u << 4,
  SHARDD_HP_MAXIMIZE = 1u << 5,
  SHARDD_HP_BETA1 = 1u << 6,
  SHARDD_HP_BETA2 = 1u << 7,
  SHARDD_HP_EPS = 1u << 8,
  SHARDD_HP_AMSGRAD = 1u << 9
};

typedef struct {
  uint32_t set;
  double lr, momentum, dampening, weight_decay;
  double beta1, beta2, eps;
  int nesterov, maximize, amsgrad;
} shardd_hparams;

typedef struct {
  uint64_t id;      /* buffer or view id; 0 for "not a shardd tensor" */
  const char *name; /* the trainer's name for it, echoed in refusals */
} shardd_param_ref;

typedef struct {
  const shardd_param_ref *refs;
  size_t nrefs;
  shardd_hparams overrides;
} shardd_param_group;

/* Validates and registers an optimizer over the groups. On refusal nothing
 * is registered and shardd_last_error(c) lists every offending ref. name
 * (NULL: "default") lets every rank register the same optimizer: an identical
 * registration under an existing name attaches to it. */
shardd_err shardd_optimizer_register(shardd_client_t *c, const char *name,
                                     shardd_optim_kind kind,
                                     const shardd_hparams *hyper,
                                     const shardd_param_group *groups,
                                     size_t ngroups, uint64_t *out_id);
shardd_err shardd_optimizer_unregister(shardd_client_t *c, uint64_t opt);

/* All-gather: returns when every rank's gather area holds the whole buffer. */
shardd_err shardd_gather(shardd_client_t *c, uint64_t buffer);

/* Where one gather put this rank's areas. gather holds padded_numel
 * elements of the buffer's dtype (the whole buffer), grad as many for the
 * gradient (NULL unless asked for). Transient areas: mappings owned by c
 * that stay valid until shardd_close(c). On the host backend the gather
 * area is the node's one copy of the buffer, which every local rank of the
 * job reads: it lies in the job's gather pool `pool`, mapped read-only (a
 * write faults), and grad in the pool of this rank's device; on the cuda
 * backend both lie in the pool `pool` of this rank's device. What they
 * hold is this rank's only until shardd_release() (gather) and the scatter
 * that consumes the gradient (grad), after which the daemon may lease the
 * memory to another buffer.
 * Resident areas (a job without transient areas): the block's gather and
 * grad areas of shardd_buffer_info, pool 0. */
typedef struct {
  void *gather;
  void *grad;
  uint64_t pool;
} shardd_area;

/* shardd_gather, and where this rank's areas are. want_grad 1 also leases
 * the gradient area (transient areas), kept until a scatter of the buffer
 * has consumed it: backward's re-gather. At the daemon's limit of leases a
 * rank may hold (2 gathered units by default, FSDP's limit_all_gathers)
 * the gather is refused with SHARDD_E_LIMIT naming the buffers it holds:
 * release one first. The first reply naming a pool carries its descriptor,
 * mapped here once per connection. *out is zeroed on failure. */
shardd_err shardd_gather_area(shardd_client_t *c, uint64_t buffer,
                              int want_grad, shardd_area *out);

/* A 16-bit buffer's fp32 master from exact values (FSDP's mixed
 * precision keeps the fp32 parameters): write this rank's shard values as
 * fp32 into info.reduced (shard_numel floats), then call this; they become
 * the master of every optimizer over this rank's shard, and of those
 * registered later until the buffer's first step (without it the master
 * is widened from the 16-bit shard at the first step). The reduced area is
 * zeroed after. SHARDD_E_INVAL for an fp32 buffer. */
shardd_err shardd_seed_master(shardd_client_t *c, uint64_t buffer);

/* Returns this rank's gather area of buffer to its device's pool (FSDP's
 * reshard after forward, or after backward's scatter); pointers from the
 * gather_area that leased it must not be used any more. SHARDD_E_STATE
 * when this rank holds no gather area of it, or the job has resident
 * areas. */
shardd_err shardd_release(shardd_client_t *c, uint64_t buffer);

/* shardd_release, and the gradient area this rank holds of buffer too
 * (unscattered: an iteration abandoned after a peer was lost). */
shardd_err shardd_release_all(shardd_client_t *c, uint64_t buffer);

/* Reduce-scatter: each rank has written its full gradient into its grad
 * area; returns when the owners hold the reduced shards. */
shardd_err shardd_scatter(shardd_client_t *c, uint64_t buffer,
                          shardd_reduce_op op);

/* All-reduce of a few scalars over the ranks of the job (metrics, loss
 * logging): every rank calls it with the same n (at most
 * SHARDD_ALL_REDUCE_MAX) and op (SUM, MEAN, MAX or MIN); when all have,
 * values[0..n) is overwritten with the element-wise reduction, taken in
 * rank order, so every rank gets the same bits (a NaN stays NaN). A
 * collective, like shardd_gather; ranks that disagree on n or op all fail
 * with SHARDD_E_MISMATCH. Single-node jobs only for now (SHARDD_E_STATE). */
shardd_err shardd_all_reduce(shardd_client_t *c, double *values, size_t n,
                             shardd_reduce_op op);

/* Returns once every rank of the job has called it (an all-reduce of no
 * values). */
shardd_err shardd_barrier(shardd_client_t *c);

/* Options of shardd_scatter_ex(). Created with SHARDD_SCATTER_OPTS_INIT;
 * fields are only ever appended.
 * no_grad: the views of the buffer that got no gradient on this rank
 * (torch: their .grad is None; the grad area holds zeros there), nno_grad
 * of them (borrowed for the call); no_grad_all 1: the whole buffer got
 * none. After the scatter, a view that no rank sent a gradient for is
 * skipped by the next step of its optimizer (no weight decay, no moment
 * update, its own step count stays), as torch.optim skips it; a view with
 * a gradient on some ranks only is stepped (the others' is zero, as on
 * the global batch), over every node of a multi-node job. A view of
 * another buffer is SHARDD_E_NOT_FOUND. */
typedef struct {
  size_t size;
  shardd_reduce_op op;
  uint64_t generation; /* 0: not checked (see shardd_scatter_checked) */
  const uint64_t *no_grad;
  size_t nno_grad;
  int no_grad_all;
  /* 1: shardd_scatter_accumulate's adding to the reduced gradient held */
  int accumulate;
} shardd_scatter_opts;
#define SHARDD_SCATTER_OPTS_INIT                                               \
  {sizeof(shardd_scatter_opts), SHARDD_REDUCE_SUM, 0, NULL, 0, 0, 0}

/* shardd_scatter with options (opts NULL: the defaults). */
shardd_err shardd_scatter_ex(shardd_client_t *c, uint64_t buffer,
                             const shardd_scatter_opts *opts);

/* Bucketed collectives (issue 17): several small gathers or scatters in
 * one request, so a model's small tensors (norms, biases) cost one round
 * trip per bucket instead of one each, as DDP's buckets and ZeRO's
 * reduce_bucket_size do. Entries per request: at most 64 (the daemon's
 * --max-pending default), fewer when the daemon says at connect that its
 * --max-pending is smaller; a longer list goes as several requests, one
 * after the other. */
#define SHARDD_BUCKET_PER_REQUEST 64

/* All-gathers n buffers (resident areas: each lands in its block's gather
 * area, as shardd_gather would put it), one request per up to
 * SHARDD_BUCKET_PER_REQUEST of them (or the daemon's --max-pending); returns when all have completed.
 * Every rank must pass the same buffers in the same order: a rank whose
 * bucket differs fails the buckets involved at once with
 * SHARDD_E_MISMATCH, on every rank. Each request is all or nothing up
 * front: when an entry is refused (an unknown or stale buffer, one named
 * twice) none of that request runs and the error names every refused
 * entry ("[index] CODE: why"). A request that failed while running (a
 * peer lost, a mismatch, a timeout) names each failed entry; its other
 * entries ran. The requests after a failed one are not sent. errs (NULL,
 * or n entries) gets each entry's code, SHARDD_E_STATE for those not
 * sent. Jobs with transient areas refuse gather buckets (SHARDD_E_STATE):
 * each gather leases a slot as large as the largest unit, 2 per rank.
 * Over several nodes each entry crosses them as its own exchange, paired
 * by the buffer's name (a node's ranks may order their bucket otherwise
 * than another node's); ranks of one node that disagree fail every entry
 * of their buckets on every node (E_MISMATCH) when the buckets hold the
 * same buffers. When they do not, an entry no other local rank sent waits,
 * as for a rank that never calls, until the collective timeout; the other
 * nodes' exchanges of it time out too, and they lose the fabric
 * (E_PEER_LOST). */
shardd_err shardd_gather_many(shardd_client_t *c, size_t n,
                              const uint64_t *buffers, shardd_err *errs);

/* Reduce-scatters n buffers with op, as shardd_gather_many gathers them
 * (transient areas too: a scatter leases nothing). */
shardd_err shardd_scatter_many(shardd_client_t *c, size_t n,
                               const uint64_t *buffers, shardd_reduce_op op,
                               shardd_err *errs);

/* shardd_scatter_many with each entry's options: opts is NULL (the
 * defaults) or n shardd_scatter_opts, made with SHARDD_SCATTER_OPTS_INIT,
 * opts[0].size being the array's stride (every entry the same size; a
 * size of 0 makes that one struct every entry's, with today's layout). */
shardd_err shardd_scatter_many_ex(shardd_client_t *c, size_t n,
                                  const uint64_t *buffers,
                                  const shardd_scatter_opts *opts,
                                  shardd_err *errs);

/* Freezes (requires_grad 0) or unfreezes a view for the whole job:
 * gradual unfreezing. A view an optimizer holds stays held and its steps
 * skip it while it is frozen; unfrozen, it is stepped again with its own
 * step count (torch's state["step"] of a parameter it skipped). The rules
 * of shardd_view_register_ex hold: SHARDD_E_OVERLAP where the view meets
 * one of the other kind, SHARDD_E_BUSY freezing a view of a buffer an
 * optimizer holds whole. It applies to collectives not started yet, so
 * every rank may call it before its next scatter. It changes this
 * daemon's registry only: in a multi-node job a rank of every node must
 * call it (shardd.nn's ranks all do), or the nodes would disagree. */
shardd_err shardd_view_set_requires_grad(shardd_client_t *c, uint64_t view,
                                         int requires_grad);

/* shardd_gather / shardd_scatter of a handle the caller kept with its
 * generation: refused with SHARDD_E_STALE (nothing runs) when the buffer
 * is not that generation any more, e.g. a handle from before a restore or
 * a re-registration. generation 0 is not checked. */
shardd_err shardd_gather_checked(shardd_client_t *c, uint64_t buffer,
                                 uint64_t generation);
shardd_err shardd_scatter_checked(shardd_client_t *c, uint64_t buffer,
                                  uint64_t generation, shardd_reduce_op op);

/* shardd_scatter for a later backward of gradient accumulation: the
 * reduced gradient is added to what the scatters since the buffer's last
 * step left (torch's .grad accumulating over backward calls), or replaces
 * it when a step has consumed it since (or no scatter ran yet). Every rank
 * must pass the same. */
shardd_err shardd_scatter_accumulate(shardd_client_t *c, uint64_t buffer,
                                     shardd_reduce_op op);

typedef struct {
  size_t size;
  double lr;       /* < 0: keep the registered learning rates */
  /* > 0: clip the global gradient norm to this; INFINITY reports the norm
   * without clipping */
  double max_norm;
  /* (Appended.) ngroups 0, or one per param group in registration order:
   * hyperparameters for this step, each overlaid on its group's
   * registered ones after lr (what torch's param_groups hold once a
   * scheduler wrote them; amsgrad may not change). Every rank must pass
   * the same (SHARDD_E_MISMATCH). */
  const shardd_hparams *groups;
  size_t ngroups;
  /* (Appended.) A step a trainer can retry after a lost reply (the daemon
   * stopped or the connection broke mid-step): > 0 is the step count this
   * step produces (the count before it + 1). When the optimizer has reached
   * it already nothing runs, *skipped is 1 and out->step is the count now
   * (total_norm 0): a retry never applies a step twice. A count the
   * optimizer is more than one step short of is SHARDD_E_MISMATCH (e.g.
   * restored from an older checkpoint). 0: not checked. Every rank should
   * pass the same. */
  uint64_t expect_step;
  int *skipped; /* (Appended.) may be NULL; set to 0 or 1 on success */
} shardd_step_opts;
#define SHARDD_STEP_OPTS_INIT {sizeof(shardd_step_opts), -1.0, 0.0, NULL, 0, 0, NULL}

typedef struct {
  uint64_t step;     /* the optimizer's step count after this step */
  double total_norm; /* global gradient norm before clipping, if asked */
} shardd_step_result;

/* Collective: updates every shard the optimizer owns from the reduced
 * gradients. opts and out may be NULL. Whether a step whose reply never
 * came ran: its retry with opts->expect_step says (skipped), and
 * shardd_optim_state_get() (count 0) tells the count, info->optimizer_steps. */
shardd_err shardd_step(shardd_client_t *c, uint64_t opt,
                       const shardd_step_opts *opts, shardd_step_result *out);

/* FSDP's clip_grad_norm_ (collective): *total_norm = the global L2 norm of
 * the reduced gradients the optimizer's next step would apply (over every
 * shard, every rank and node); with max_norm > 0 (finite) that step
 * scales them by min(1, max_norm / (norm + 1e-6)), as torch's clipping in
 * place would. max_norm 0 or INFINITY: the norm only. Nothing is updated
 * and the step count stays. total_norm may be NULL. */
shardd_err shardd_clip_grad_norm(shardd_client_t *c, uint64_t opt,
                                 double max_norm, double *total_norm);

/* One parameter's optimizer state as torch keeps it per parameter, for
 * state_dict / load_state_dict: ref is a view or buffer opt holds; the
 * state is over the whole parameter (every rank's shard of this node). */
typedef struct {
  uint32_t nstate;          /* Adam 2 (exp_avg, exp_avg_sq), amsgrad 3
                               (max_exp_avg_sq); SGD with momentum 1
                               (momentum_buffer); else 0 */
  uint64_t numel;           /* the parameter's elements */
  uint64_t steps;           /* its step count (torch's state["step"]) */
  uint64_t optimizer_steps; /* the optimizer's */
} shardd_optim_state_info;

/* As `array` of shardd_optim_state_get/_set: the parameter's fp32 master
 * (16-bit buffers, as FSDP's mixed precision keeps the fp32 parameters),
 * once it exists (the first step or shardd_seed_master made it;
 * SHARDD_E_STATE before, SHARDD_E_INVAL for fp32). A written master is
 * rounded into the 16-bit shard too, and is what the next step updates; a
 * write before the master exists takes the rest of it from the shard
 * first, as the first step would. */
#define SHARDD_OPTIM_MASTER UINT32_MAX

/* Reads count fp32 of state array `array` from element offset into out
 * (count 0: info only; info may be NULL). SHARDD_E_BUSY while a step of
 * opt is queued or running. */
shardd_err shardd_optim_state_get(shardd_client_t *c, uint64_t opt, uint64_t ref,
                                  uint32_t array, uint64_t offset, uint64_t count,
                                  float *out, shardd_optim_state_info *info);
/* Writes count fp32 from in into state array `array` from offset. */
shardd_err shardd_optim_state_set(shardd_client_t *c, uint64_t opt, uint64_t ref,
                                  uint32_t array, uint64_t offset, uint64_t count,
                                  const float *in);
/* Sets parameter ref's step count and the optimizer's. */
shardd_err shardd_optim_steps_set(shardd_client_t *c, uint64_t opt, uint64_t ref,
                                  uint64_t steps, uint64_t optimizer_steps);

/* Writes the job's registry, every shard, optimizer state and step counts
 * to dir, a directory on the daemon's machine (created if missing), as files
 * with CRC32C-checked headers and a manifest written last. job NULL: the
 * caller's own job (a control session must name one). Refused with
 * SHARDD_E_BUSY while a collective of the job is in flight. */
shardd_err shardd_checkpoint(shardd_client_t *c, const char *job,
                             const char *dir);

/* shardd_checkpoint of a job whose ranks may be training (shardctl
 * checkpoint): with collectives in flight it waits up to timeout_s seconds
 * for the job's next quiescent point (no collective queued or running,
 * e.g. between a step's reply and the next gather) and is taken there; the
 * ranks' steps sent while the files are written wait for them, nothing of
 * theirs fails. Past timeout_s: SHARDD_E_TIMEOUT, the message naming the
 * collectives it waited on and the ranks that have and have not arrived.
 * timeout_s 0 is shardd_checkpoint; at most 86400. */
shardd_err shardd_checkpoint_wait(shardd_client_t *c, const char *job,
                                  const char *dir, double timeout_s);

/* Frees job (as named to shardd_checkpoint) in the daemon now: its
 * buffers, views, optimizers and areas, so shardd_restore into its name
 * can follow. Its uid or root only. Refused (SHARDD_E_BUSY, naming them)
 * while any of its ranks is connected (release never ends a trainer:
 * stop them first), or while it is being checkpointed or restored or has
 * collectives in flight. buffers and optimizers (may be NULL) receive how
 * many were freed. */
shardd_err shardd_release_job(shardd_client_t *c, const char *job,
                              uint32_t *buffers, uint32_t *optimizers);

/* shardd_checkpoint as a job collective: every rank of the caller's job
 * calls it with the same dir; it is taken once all have, after the
 * collectives each rank sent before it (no SHARDD_E_BUSY for work of
 * theirs in flight), and returns on every rank once the files are
 * written. Single-node jobs. */
shardd_err shardd_checkpoint_collective(shardd_client_t *c, const char *dir);

/* Recreates the job recorded in dir (which must not exist in the daemon),
 * with world ranks (0: the recorded world; another count reshards, as
 * shards are keyed by element offset, not by rank);
 * every file is checked before the job becomes visible, and a corrupt or
 * partial checkpoint is refused with a message naming the bad file. Ranks
 * then connect and register the same buffers, views and optimizer, which
 * attach to the restored ones. When job is not NULL it receives the job's
 * name (NUL-terminated, cut at joblen). */
shardd_err shardd_restore(shardd_client_t *c, const char *dir, uint32_t world,
                          char *job, size_t joblen);

/* shardd_restore, and *step (when not NULL) the step the restored job is
 * at: the most steps one of its optimizers took (0 when none stepped, or
 * from a daemon that does not say). */
shardd_err shardd_restore_ex(shardd_client_t *c, const char *dir,
                             uint32_t world, char *job, size_t joblen,
                             uint64_t *step);

/* Prefetch. shardd_gather_async sends the all-gather of buffer and returns
 * at once with a ticket; shardd_wait(c, ticket) returns when that gather has
 * completed (every rank's gather area holds the buffer) with its result.
 * Other calls on c may be made in between. With max_inflight_gathers
 * gathers still running, gather_async first waits for the oldest to
 * complete (its ticket keeps the result). Every ticket is waited for once;
 * waiting again is SHARDD_E_INVAL. */
typedef uint64_t shardd_ticket;
shardd_err shardd_gather_async(shardd_client_t *c, uint64_t buffer,
                               shardd_ticket *t);
shardd_err shardd_wait(shardd_client_t *c, shardd_ticket t);

/* shardd_release sent without waiting for its answer (FSDP's reshard
 * without a round trip): returns at once with a ticket for shardd_wait,
 * which returns the release's result (SHARDD_E_STATE as shardd_release's).
 * The daemon serves a connection's requests in order, so the area is back
 * in its pool for every later request of c (a gather that needs its
 * lease). The pointers into the area must not be used from this call on.
 * Releases do not count against max_inflight_gathers. */
shardd_err shardd_release_async(shardd_client_t *c, uint64_t buffer,
                                shardd_ticket *t);

/* shardd_gather_async that, with want_grad 1, also leases this rank's
 * gradient area (transient areas), as shardd_gather_area's want_grad does:
 * backward prefetch, where the unit whose backward comes next needs both.
 * shardd_wait_area of its ticket says where both are. Counts against
 * max_inflight_gathers as shardd_gather_async. */
shardd_err shardd_gather_area_async(shardd_client_t *c, uint64_t buffer,
                                    int want_grad, shardd_ticket *t);

/* shardd_wait, and where the gather's areas are (see shardd_gather_area;
 * grad is NULL unless the gather was a shardd_gather_area_async with
 * want_grad). Transient
 * areas are supported on the async path: a pool's descriptor arriving with
 * an async reply is mapped then, whichever call is reading, so later
 * gathers on c find the pool; a reply that could not be mapped fails its
 * ticket with the reason. out may be NULL (then this is shardd_wait). */
shardd_err shardd_wait_area(shardd_client_t *c, shardd_ticket t,
                            shardd_area *out);

#ifdef __cplusplus
}
#endif

#endif /* SHARDD_H */
