/* server.h — the transport: the listening socket, one session per client
 * connection, frames in and out (replies with descriptors), backpressure,
 * connection limits and deadlines, the periodic tick and the signals. Each
 * whole frame goes to the dispatcher (dispatch.h), which is all it knows of
 * requests; replies come back through the send hook it gives the
 * dispatcher.
 *
 * Ownership: the server owns its sessions, the dispatcher (and through it
 * the core) and, after init, the backend. Sessions are freed in their close
 * callback, never inside a read callback that still runs; a session whose
 * reply fails is closed on the next loop turn, never inside whoever was
 * answering it. Everything here runs on the loop thread. */
#ifndef SHARDD_SERVER_H
#define SHARDD_SERVER_H

#include <stdatomic.h>
#include <stdint.h>
#include <sys/socket.h>
#include <uv.h>

#include "dispatch.h"
#include "frame.h"
#include "opts.h"

typedef struct shardd__session shardd__session;
typedef struct shardd__server shardd__server;
typedef struct shardd__reply_uid shardd__reply_uid;

/* What the unwritten replies of one uid's sessions hold (replybudget.c),
 * and their partial frames (framebudget.c): one per uid other than root
 * and --admin-group with a session, its sessions' reference kept until
 * their last write is done. */
struct shardd__reply_uid {
  uint32_t uid;
  uint32_t refs;    /* sessions pointing here, closed or not */
  uint64_t bytes;   /* reply bytes queued, with their write requests */
  uint32_t fds;     /* descriptors held for those replies */
  uint32_t waiters; /* sessions not read until these drain */
  int warned;       /* this episode of waiting was logged */
  double loud_next; /* server clock: the next episode logged as a warning */
  uint64_t partial;      /* partial-frame budget charged to its sessions */
  uint32_t room_waiters; /* its sessions waiting for room (budget_wait 1) */
  shardd__reply_uid *next;
};

struct shardd__session {
  uv_pipe_t pipe; /* first: the handle's address is the session's */
  shardd__conn conn; /* the dispatcher's (id, peer, job, rank) */
  shardd__server *srv;
  /* private */
  shardd__frame_reader rd;
  int closing;
  int close_after_write;
  /* kept open by a stopping server until its checkpoint's reply is out */
  int kept;
  /* A reply could not be sent: the session is dropped on the next loop
   * turn (server.c), never inside the caller that was answering it. */
  int close_deferred;
  uint32_t writes; /* replies handed to libuv whose write_done has not run */
  /* Unread replies (replybudget.c): the bytes and descriptors this
   * session's unwritten replies hold; read_paused: not read until they
   * drain below half of --max-reply-bytes / --max-reply-fds; reply_wait:
   * not read until its uid's (reply_uid, NULL for root and --admin-group)
   * drain below half of the per-uid bounds. */
  uint64_t reply_bytes;
  uint32_t reply_fds;
  int read_paused;
  int reply_wait;
  shardd__reply_uid *reply_uid;
  double since;         /* connected (server clock, seconds) */
  double partial_since; /* a partial frame is buffered since; < 0 none */
  /* The partial-frame budget (framebudget.c): bytes of it this session
   * holds (its reader's whole frame-to-be), and whether it is not read
   * until the budget has room for more: 1 waiting for room (in all, in the
   * users' part, or within its uid's fair share while others wait), 2
   * for its uid's quarter. */
  uint64_t charged;
  int budget_wait;
  /* Fair turns (server.c): whole frames are left in rd for a later loop
   * turn, the session not read meanwhile; while set it is on the server's
   * turn queue (turn_prev/turn_next), eligible from the turn after
   * turn_round. */
  int deferred;
  uint64_t turn_round;
  shardd__session *turn_prev, *turn_next;
  shardd__session *prev, *next;
};

struct shardd__server {
  /* read-only */
  uv_loop_t *loop;
  shardd__server_opts opts;
  char socket_path[108];
  shardd__backend *backend;
  shardd__dispatch d; /* the requests, and the core behind them */
  /* private */
  uv_pipe_t listener;
  uv_timer_t tick;
  uv_idle_t reaper; /* closes close_deferred sessions on the next turn */
  /* Fair turns: after each poll, the sessions with deferred frames take a
   * turn each, oldest first (turns); spin is active while any wait, so
   * the poll before their turn does not block. */
  uv_check_t turns;
  uv_idle_t spin;
  shardd__session *turn_head, *turn_tail;
  uint64_t turn_round;
  uv_signal_t sigterm, sigint;
  int own_socket_file; /* unlink it on stop */
  int stopping;
  int stop_signal; /* the signal that stopped the loop, 0 if none did */
  uint64_t next_session;
  uint32_t nclients;
  shardd__session *sessions;
  /* the partial-frame budget: bytes charged over every session, the most
   * one uid other than root and --admin-group may hold (also what is kept
   * for root and --admin-group), sessions waiting for room, and whether
   * this episode of waiting has been logged; of the uids other than root
   * and --admin-group: bytes charged, how many uids hold some or wait for
   * room, and their sessions waiting for room */
  uint64_t partial_bytes;
  uint64_t partial_share;
  uint64_t partial_users;
  uint32_t partial_uids;
  uint32_t room_waiters;
  uint32_t budget_waiters;
  int budget_warned;
  /* unread replies over every session (bytes, descriptors), and by uid */
  uint64_t reply_bytes;
  uint64_t reply_fds;
  shardd__reply_uid *reply_uids;
  /* shardd__server_fail_replies; there in every build so that the struct
   * is one layout for the test build's server.o and the other objects */
  atomic_uint fail_replies;
};

/* Takes ownership of backend. Binds (or adopts opts->listen_fd) and starts
 * listening; SIGTERM/SIGINT stop the loop cleanly. */
shardd_err shardd__server_init(shardd__server *srv, uv_loop_t *loop,
                               shardd__backend *backend,
                               const shardd__server_opts *opts, char *err,
                               size_t errlen);
/* Closes every handle; run the loop afterwards to let close callbacks run,
 * then call shardd__server_free. Idempotent. */
void shardd__server_stop(shardd__server *srv);
void shardd__server_free(shardd__server *srv);

/* Serves an already connected stream socket as a client session (the
 * fuzzer and in-process tests drive the dispatcher this way). The session
 * owns fd from here on, also on failure after uv_pipe_open. */
shardd_err shardd__server_adopt(shardd__server *srv, int fd);

/* Test hook (fault injection): the next n replies, to any session, fail
 * as if their buffer could not be allocated. Callable from any thread.
 * Compiled only with SHARDD_TEST_HOOKS (the Makefile builds that server.o
 * for test_server alone), so the daemon checks nothing per reply. */
void shardd__server_fail_replies(shardd__server *srv, unsigned n);

/* Seconds since the loop started (monotonic). */
double shardd__server_now(const shardd__server *srv);

#endif /* SHARDD_SERVER_H */
