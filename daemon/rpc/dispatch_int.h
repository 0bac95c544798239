/* dispatch_int.h — what the dispatcher's files share and nothing outside
 * them sees (as libuv's internal.h): the reply builder, the handler type,
 * and the entry points each file gives the command table, the connection
 * hooks and the engine's hooks in dispatch.c. Loop thread only. */
#ifndef SHARDD_DISPATCH_INT_H
#define SHARDD_DISPATCH_INT_H

#include <stdint.h>
#include <uv.h>

#include "dispatch.h"
#include "proto/shardd.pb-c.h"

#define ERRLEN 512

static inline double now_s(const shardd__dispatch *d) {
  return (double)uv_now(d->loop) / 1000.0;
}

/* A request's handler, one per body in the command table (dispatch.c). */
typedef void (*handler)(shardd__dispatch *d, shardd__conn *c, uint64_t seq,
                        const Shardwire__Request *req);

/* ---- the reply builder (reply.c) ---------------------------------------- */

/* A successful reply of body case bc; the caller sets the body. */
static inline Shardwire__Response ok_resp(uint64_t seq,
                                          Shardwire__Response__BodyCase bc) {
  Shardwire__Response resp = SHARDWIRE__RESPONSE__INIT;
  resp.seq = seq;
  resp.code = SHARDWIRE__STATUS_CODE__OK;
  resp.body_case = bc;
  return resp;
}

/* Sends resp on c, with fd (>= 0) travelling with it; fd is closed when c
 * is going away or the reply would be over the frame limit (then c is
 * told so instead). */
void shardd__send_resp(shardd__dispatch *d, shardd__conn *c,
                       const Shardwire__Response *resp, int fd);
/* As shardd__send_resp, with n descriptors in order (all >= 0); they are
 * the hook's from here, or closed; or with borrowed (n >= 2 only) they
 * stay the caller's (see the send_fds hook). */
void shardd__send_resp_fds(shardd__dispatch *d, shardd__conn *c,
                           const Shardwire__Response *resp, int *fds, size_t n,
                           int borrowed);
/* n zeroed elements of size bytes for the request being handled, taken
 * back with its decoded message when its handler returns (never kept past
 * it); NULL when out of memory. A batch's per-entry arrays come from here
 * instead of a malloc and free each (4096 entries' are past malloc's mmap
 * threshold until glibc raises it). */
void *shardd__req_scratch(shardd__dispatch *d, size_t n, size_t size);
/* A ViewsBatch registration's OK reply (one ViewReply per entry), packed
 * by hand: the bytes shardwire__response__pack writes for it, where
 * protobuf-c sized each entry again at each level above it (a sixth of a
 * batched view's registration). out NULL: the length alone; else the
 * bytes written. */
size_t shardd__views_reply_pack(uint64_t seq, const Shardwire__ViewReply *vr,
                                size_t n, uint8_t *out);
/* Sends that reply on c, as shardd__send_resp would. */
void shardd__send_views_reply(shardd__dispatch *d, shardd__conn *c,
                              uint64_t seq, const Shardwire__ViewReply *vr,
                              size_t n);
/* A status-only reply (msg NULL: the code's own words). */
void shardd__reply(shardd__dispatch *d, shardd__conn *c, uint64_t seq,
                   shardd_err code, const char *msg);
/* Refuses a request reusing the seq of what (a collective checkpoint, a
 * bucket) still being answered. */
void shardd__seq_refuse(shardd__dispatch *d, shardd__conn *c, uint64_t seq,
                        const char *what);

/* A batch's refused or failed entries (ViewsBatch, BuffersBatch, Bucket):
 * the reply's errors list and its message. */
typedef struct {
  uint32_t base; /* the request's first_index */
  /* [cap] each, allocated at the first refusal: most batches have none,
   * and two allocations per bucket were a cost of every one */
  Shardwire__BatchError *errs, **errp;
  size_t cap, n, total;
  size_t bytes; /* of the errors' messages */
  shardd_err first;
  char *msg; /* BATCH_MSG_MAX bytes, from the first refusal (NULL before) */
  size_t len;
  size_t listed; /* entries the message names */
  int cut;       /* the message ran out of room */
} batch_errs;

/* For n entries, the first numbered base. Cannot fail: it allocates
 * nothing, the lists are made at the first refusal (batch_err_add). */
void shardd__batch_errs_init(batch_errs *b, size_t n, uint32_t base);
void shardd__batch_errs_free(batch_errs *b);
/* Records entry i's refusal; out of memory only shortens the lists. */
void shardd__batch_err_add(batch_errs *b, size_t i, shardd_err rc,
                           const char *why);
/* The reply of a batch some of whose entries were refused or failed: the
 * first entry's code, head then every listed entry named, and the entries
 * in the reply body that what names ("views", "buffers", "bucket ..."). */
void shardd__batch_send(shardd__dispatch *d, shardd__conn *c, uint64_t seq,
                        const batch_errs *b, const char *head,
                        const char *what);
/* The refusal of a whole batch of n entries: the first entry's code, every
 * listed entry named. */
void shardd__batch_refuse(shardd__dispatch *d, shardd__conn *c, uint64_t seq,
                          size_t n, batch_errs *b, const char *what);

/* ---- the command table (dispatch.c) ------------------------------------- */

/* Decodes one frame's Request and runs its handler (a held frame too,
 * when its job's checkpoint ended). */
void shardd__dispatch_one(shardd__dispatch *d, shardd__conn *c,
                          const uint8_t *payload, size_t len);

/* ---- checkpoints and restores (ckpt_operator.c) ------------------------- */

void shardd__on_checkpoint(shardd__dispatch *d, shardd__conn *c, uint64_t seq,
                           const Shardwire__Request *req);
void shardd__on_restore(shardd__dispatch *d, shardd__conn *c, uint64_t seq,
                        const Shardwire__Request *req);
/* The Checkpoint reply to c for job's checkpoint in dir. */
void shardd__reply_checkpoint(shardd__dispatch *d, shardd__conn *c,
                              uint64_t seq, shardd__job *job, const char *dir);
/* --checkpoint-root: whether c may name dir (with create, its user's
 * directory is made); home gets that directory (empty: not confined). */
shardd_err shardd__checkpoint_dir_ok(shardd__dispatch *d, const shardd__conn *c,
                                     const char *dir, int create, char *home,
                                     size_t homelen, char *err, size_t errlen);
/* A checkpoint of job ended (job NULL: none): its held frames go on, and
 * the next operator's checkpoint waiting for it may start (dispatch.c's
 * hook, so the checkpoint files do not call back up into the table). */
static inline void shardd__ckpt_after(shardd__dispatch *d, shardd__job *job) {
  d->ckpt_ended(d, job);
}
/* The engine found job quiet: an operator's checkpoint waiting may start. */
void shardd__ckpt_pends_kick(shardd__dispatch *d, shardd__job *job);
/* The operators' checkpoints that waited past their bound are refused. */
void shardd__ckpt_pends_expire(shardd__dispatch *d, double now);
/* status' view of the i-th operator's checkpoint waiting for job (arg is
 * the dispatcher); 0 past the last. */
int shardd__ckpt_pending(void *arg, const shardd__job *job, size_t i,
                         const char **dir, double *waited_s, double *wait_s);
/* c is going away: what it waits for is dropped or forgotten. */
void shardd__ckpt_closed(shardd__dispatch *d, shardd__conn *c);
void shardd__ckpt_free(shardd__dispatch *d);

/* ---- collective checkpoints (ckpt_collective.c) ------------------------- */

/* A Checkpoint with collective set: c (a rank) asks for its job's
 * collective checkpoint. */
void shardd__on_checkpoint_collective(shardd__dispatch *d, shardd__conn *c,
                                      uint64_t seq,
                                      const Shardwire__Request *req);
/* The engine ended c's collective checkpoint request seq (its barrier, or
 * its seal exchange). */
void shardd__ckpt_collective_done(shardd__dispatch *d, shardd__conn *c,
                                  uint64_t seq, shardd_err code,
                                  const char *msg,
                                  const shardd__coll_result *res);
/* jobs.c's released hook (arg is the dispatcher). */
void shardd__ckpt_collective_released(void *arg, shardd__job *job);
void shardd__ckpt_collective_closed(shardd__dispatch *d, shardd__conn *c);
void shardd__ckpt_collective_free(shardd__dispatch *d);

/* ---- buckets (buckets.c) ------------------------------------------------- */

/* A bucket's Request decoded by hand (buckets.c: the shape clients send,
 * into what protobuf-c would fill), its pieces from alloc(ctx, bytes);
 * NULL for any other frame, which protobuf-c then decodes. */
typedef void *(*shardd__decode_alloc)(void *ctx, size_t n);
Shardwire__Request *shardd__bucket_decode(shardd__decode_alloc alloc, void *ctx,
                                          const uint8_t *payload, size_t len);
void shardd__on_bucket(shardd__dispatch *d, shardd__conn *c, uint64_t seq,
                       const Shardwire__Request *req);
/* c's bucket answered by seq; NULL: none. */
struct shardd__bucket_wait *
shardd__bucket_find(shardd__dispatch *d, const shardd__conn *c, uint64_t seq);
/* One entry of w ended (the engine's done hook): the bucket's reply goes
 * when it was the last. */
void shardd__bucket_note(shardd__dispatch *d, struct shardd__bucket_wait *w,
                         shardd_err code, const char *msg,
                         const shardd__coll_result *res);
/* c is going away (after the engine lost its member). */
void shardd__buckets_closed(shardd__dispatch *d, const shardd__conn *c);
void shardd__buckets_free(shardd__dispatch *d);

/* ---- session requests (session.c) -------------------------------------- */

void shardd__on_goodbye(shardd__dispatch *d, shardd__conn *c, uint64_t seq,
                        const Shardwire__Request *req);
void shardd__on_hello(shardd__dispatch *d, shardd__conn *c, uint64_t seq,
                      const Shardwire__Request *req);
void shardd__on_inspect(shardd__dispatch *d, shardd__conn *c, uint64_t seq,
                        const Shardwire__Request *req);
void shardd__on_ping(shardd__dispatch *d, shardd__conn *c, uint64_t seq,
                     const Shardwire__Request *req);
void shardd__on_release(shardd__dispatch *d, shardd__conn *c, uint64_t seq,
                        const Shardwire__Request *req);
void shardd__on_release_job(shardd__dispatch *d, shardd__conn *c, uint64_t seq,
                            const Shardwire__Request *req);
void shardd__on_status(shardd__dispatch *d, shardd__conn *c, uint64_t seq,
                       const Shardwire__Request *req);

/* ---- registration (register.c) ----------------------------------------- */

void shardd__on_buffers_batch(shardd__dispatch *d, shardd__conn *c,
                              uint64_t seq, const Shardwire__Request *req);
void shardd__on_register_buffer(shardd__dispatch *d, shardd__conn *c,
                                uint64_t seq, const Shardwire__Request *req);
void shardd__on_register_optimizer(shardd__dispatch *d, shardd__conn *c,
                                   uint64_t seq, const Shardwire__Request *req);
void shardd__on_register_view(shardd__dispatch *d, shardd__conn *c,
                              uint64_t seq, const Shardwire__Request *req);
void shardd__on_unregister_buffer(shardd__dispatch *d, shardd__conn *c,
                                  uint64_t seq, const Shardwire__Request *req);
void shardd__on_unregister_optimizer(shardd__dispatch *d, shardd__conn *c,
                                     uint64_t seq,
                                     const Shardwire__Request *req);
void shardd__on_unregister_view(shardd__dispatch *d, shardd__conn *c,
                                uint64_t seq, const Shardwire__Request *req);
/* A views batch registration's Request decoded by hand (register.c, as
 * shardd__bucket_decode); NULL for any other frame. */
Shardwire__Request *shardd__views_decode(shardd__decode_alloc alloc, void *ctx,
                                         const uint8_t *payload, size_t len);
void shardd__on_views_batch(shardd__dispatch *d, shardd__conn *c, uint64_t seq,
                            const Shardwire__Request *req);

/* ---- training requests (training.c) ------------------------------------ */

void shardd__on_all_reduce(shardd__dispatch *d, shardd__conn *c, uint64_t seq,
                           const Shardwire__Request *req);
void shardd__on_gather(shardd__dispatch *d, shardd__conn *c, uint64_t seq,
                       const Shardwire__Request *req);
void shardd__on_optim_state(shardd__dispatch *d, shardd__conn *c, uint64_t seq,
                            const Shardwire__Request *req);
void shardd__on_scatter(shardd__dispatch *d, shardd__conn *c, uint64_t seq,
                        const Shardwire__Request *req);
void shardd__on_seed_master(shardd__dispatch *d, shardd__conn *c, uint64_t seq,
                            const Shardwire__Request *req);
void shardd__on_set_requires_grad(shardd__dispatch *d, shardd__conn *c,
                                  uint64_t seq, const Shardwire__Request *req);
void shardd__on_step(shardd__dispatch *d, shardd__conn *c, uint64_t seq,
                     const Shardwire__Request *req);

#endif /* SHARDD_DISPATCH_INT_H */
