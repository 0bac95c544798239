/* dispatch.h — requests to the core and back: one command table from a
 * Request's body to its handler, the conversion of wire messages to core
 * calls, and one reply builder. Below the transport (server.c hands it each
 * whole frame and hears of each closed connection), above the core
 * (registry, optimizer registration, job lifetime, access, status,
 * checkpoints) and the collective engine.
 *
 * It never calls the transport: replies leave through the send hook it was
 * given at init, as packed frames.
 *
 * Ownership: the dispatcher owns the registry, the collective engine and
 * the job lifetime state; the backend stays its creator's. A connection
 * (shardd__conn) is embedded by the transport in its own session struct and
 * must be closed here (shardd__dispatch_closed) before it is freed. Loop
 * thread only. */
#ifndef SHARDD_DISPATCH_H
#define SHARDD_DISPATCH_H

#include <stddef.h>
#include <stdint.h>
#include <uv.h>

#include "access.h"
#include "arena.h"
#include "coll.h"
#include "fdstore.h"
#include "jobs.h"
#include "opts.h"
#include "registry.h"

/* What the dispatcher knows of one connection. */
typedef struct {
  /* read-only after hello: the job and rank it claimed (m.job NULL for
   * control sessions and before hello) */
  shardd__coll_member m;
  shardd__peer peer;
  uint64_t id;
  int hello_done;
  int bye; /* it said Goodbye: its close is a clean finish of its rank */
  /* its client maps a block at an offset of a descriptor several blocks
   * share (Hello.blocks_at_offsets): its batches' blocks go in slabs */
  int at_offsets;
  /* transient areas: the pool ids whose descriptor this connection was
   * sent (a trainer maps each pool once); owned, freed at close */
  uint64_t *pools_sent;
  size_t npools_sent;
  /* a collective checkpoint this rank asked for: its barrier's seq and
   * the directory (owned), until answered */
  uint64_t ckc_seq;
  char *ckc_dir;
  /* frames held while its job is being checkpointed (a step, and every
   * frame behind it, so the rank's order stays), in arrival order; owned,
   * dispatched when the checkpoint ends, freed at close */
  struct shardd__held_frame *held_first, *held_last;
  size_t held_bytes;
  int held_listed; /* on the dispatcher's held_conns list */
} shardd__conn;

typedef struct {
  void *ctx;
  /* Sends one reply on c: frame holds SHARDD_FRAME_HEADER free bytes, then
   * len bytes of packed Response; fd >= 0 travels with it. Both are the
   * hook's from here (also when it fails). It must not close c before it
   * returns (replies go out from inside walks over shared state): a reply
   * that cannot be sent marks c for closing on a later loop turn. */
  void (*send)(void *ctx, shardd__conn *c, uint8_t *frame, size_t len, int fd);
  /* connections open now (status) */
  uint32_t (*clients)(void *ctx);
  /* whether c may still be answered (not closing, no reply lost) */
  int (*live)(void *ctx, const shardd__conn *c);
  /* bytes charged to the partial-frame budget now (status) */
  uint64_t (*partial_bytes)(void *ctx);
  /* A Hello wants the rank connection id holds: closes that connection
   * now (shardd__dispatch_closed runs inside) when its client is already
   * gone but the transport has not read its end yet, and returns 1; else
   * 0. Called only outside walks over shared state; the job the rank
   * belongs to may be released inside (--job-linger 0). NULL: never. */
  int (*reclaim)(void *ctx, uint64_t id);
  /* As send, with nfds (>= 2) descriptors (fds[k] >= 0) travelling with
   * the frame in order; the descriptors are the hook's from here (it sets
   * the entries it took to -1 and closes any it could not send), or with
   * borrowed the caller's still: the hook sends them before it returns or
   * duplicates those it keeps (a rank block's own memfd, not a duplicate
   * made for the reply and closed after it). */
  void (*send_fds)(void *ctx, shardd__conn *c, uint8_t *frame, size_t len,
                   int *fds, size_t nfds, int borrowed);
  /* what unread replies hold now, bytes and descriptors (status); NULL:
   * nothing is said */
  void (*unread_replies)(void *ctx, uint64_t *bytes, uint64_t *fds);
} shardd__dispatch_io;

typedef struct shardd__dispatch {
  /* read-only after init */
  shardd__server_opts opts;
  shardd__backend *backend;
  shardd__dispatch_io io;
  uv_loop_t *loop;
  double started; /* loop seconds at init */
  const char *socket_path;
  /* the core it drives (owned) */
  shardd__registry reg;
  shardd__coll_engine *coll;
  shardd__jobs jobs;
  /* opts.fd_store: the jobs kept in the service manager's fd store; NULL
   * without one (owned) */
  shardd__fdstore *fdstore;
  /* private: checkpoints and restores whose replies wait for their files */
  struct shardd__ckpt_wait *ckpt_waits;
  /* collective checkpoints whose barrier ended for some ranks */
  struct shardd__ckpt_group *ckpt_groups;
  /* operators' checkpoints waiting for their job's next quiescent point */
  struct shardd__ckpt_pend *ckpt_pends;
  /* bucket requests whose entries' collectives have not all ended */
  struct shardd__bucket_wait *buckets;
  /* a checkpoint of a job ended: its held frames go on (set at init; the
   * checkpoint files call it, so they never call up into the table) */
  void (*ckpt_ended)(struct shardd__dispatch *d, shardd__job *job);
  /* connections with held frames (at most max_clients) */
  shardd__conn **held_conns;
  size_t nheld_conns, cap_held_conns;
  /* what a request is decoded into, rewound when its dispatch returns:
   * nothing of a request outlives its dispatch (a handler copies what it
   * keeps, as the engine copies a collective's arguments) */
  shardd__arena req_arena;
} shardd__dispatch;

/* socket_path is borrowed (it lives as long as d). */
shardd_err shardd__dispatch_init(shardd__dispatch *d, uv_loop_t *loop,
                                 shardd__backend *backend,
                                 const shardd__server_opts *opts,
                                 const char *socket_path,
                                 const shardd__dispatch_io *io, char *err,
                                 size_t errlen);
/* The daemon is stopping (why, borrowed, says so: "daemon stopping
 * (SIGTERM)"): no job is released from here on, and the collectives still
 * waiting fail with SHARDD_E_SHUTDOWN naming why. */
void shardd__dispatch_stop(shardd__dispatch *d, const char *why);
/* Releases every job and frees the core; the backend stays the caller's. */
void shardd__dispatch_free(shardd__dispatch *d);

/* A new connection of peer (the transport reads the credentials). */
void shardd__dispatch_opened(shardd__dispatch *d, shardd__conn *c,
                             uint64_t id, const shardd__peer *peer);
/* One whole frame's payload from c: decoded, dispatched, answered. */
void shardd__dispatch_frame(shardd__dispatch *d, shardd__conn *c,
                            const uint8_t *payload, size_t len);
/* A status-only reply the transport itself has to give (a refused
 * connection, a frame over the limit, a descriptor sent to the daemon). */
void shardd__dispatch_refuse(shardd__dispatch *d, shardd__conn *c,
                             shardd_err code, const char *msg);
/* Whether c waits only for the files of a checkpoint or restore it asked
 * for (being written or read on libuv's pool, which ends by itself): a
 * stopping transport answers it before closing it, as the files will be
 * whole (an operator's checkpoint is not reported E_CLOSED). */
int shardd__dispatch_awaits_files(const shardd__dispatch *d,
                                  const shardd__conn *c);
/* c is going away: its collectives are failed or forgotten, its rank let
 * go (its job may be released). */
void shardd__dispatch_closed(shardd__dispatch *d, shardd__conn *c);
/* The periodic tick, in two parts so the transport can close its idle
 * connections between them (as the daemon always did): collectives that
 * waited past the timeout, then jobs that lingered past --job-linger. */
void shardd__dispatch_timeouts(shardd__dispatch *d, double now);
void shardd__dispatch_expire(shardd__dispatch *d, double now);

#endif /* SHARDD_DISPATCH_H */
