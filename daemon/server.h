/* server.h — the daemon's event loop: the listening socket, one session per
 * client connection, request dispatch, replies (with descriptors), the
 * periodic tick that times out collectives and releases lingering jobs.
 *
 * Ownership: the server owns its sessions, the registry and (after init) the
 * backend. Sessions are freed in their close callback, never inside a read
 * callback that still runs; a session whose reply fails is closed on the
 * next loop turn, never inside whoever was answering it. Everything here
 * runs on the loop thread. */
#ifndef SHARDD_SERVER_H
#define SHARDD_SERVER_H

#include <stdatomic.h>
#include <stdint.h>
#include <sys/socket.h>
#include <uv.h>

#include "frame.h"
#include "jobspec.h"
#include "proto/shardd.pb-c.h"
#include "registry.h"

typedef struct {
  size_t size;
  const char *socket_path;
  int listen_fd;             /* >= 0: an activated socket to use as is */
  double collective_timeout; /* seconds a collective waits for all ranks */
  double job_linger;         /* seconds a job outlives its last client; < 0 never */
  uint32_t max_clients;
  uint32_t max_pending; /* queued collectives per session */
  int log_level;        /* 0 error, 1 warn, 2 info, 3 debug */
  int64_t admin_gid;    /* members may see every job; < 0 none */
  uint64_t job_memory_limit; /* bytes a job may hold; 0 unlimited */
  /* Checkpoint/Restore requests may only name directories below this one
   * (the daemon writes with its own rights); NULL: any absolute path. */
  const char *checkpoint_root;
  /* --job-spec: multi-node layouts by job name (borrowed, live until exit) */
  const shardd__jobspec *jobspecs;
  size_t njobspecs;
  uint32_t max_inflight_gathers; /* per session, like limit_all_gathers */
  uint32_t max_jobs;             /* jobs at once (lingering ones count) */
  /* A connection that sends no Hello, or holds a partial frame, this long
   * is closed: idle connections filled --max-clients and locked out even
   * root's shardctl, and each partial 16 MiB frame was held forever. */
  double hello_timeout;
  double frame_timeout;
  /* connections one uid (not root, not --admin-group) may hold at once */
  uint32_t max_clients_per_uid;
  uint32_t max_jobs_per_uid; /* jobs one uid (not root) may hold */
} shardd__server_opts;

/* Past --max-clients, root and --admin-group still get this many more
 * connections, so an operator can always look (shardctl status). */
#define SHARDD__ADMIN_RESERVE 8u

#define SHARDD__SERVER_OPTS_INIT \
  {sizeof(shardd__server_opts), SHARDD_DEFAULT_SOCKET, -1, 300.0, 600.0, 1024, 64, 2, -1, 0, NULL, NULL, 0, 16, 4096, 10.0, 30.0, 256, 512}

typedef struct shardd__session shardd__session;
typedef struct shardd__server shardd__server;

struct shardd__session {
  uv_pipe_t pipe; /* first: the handle's address is the session's */
  /* read-only after hello */
  shardd__server *srv;
  uint64_t id;
  shardd__job *job; /* NULL for control sessions and before hello */
  uint32_t rank;
  int hello_done;
  struct ucred cred;
  int admin; /* root or --admin-group: sees every job */
  /* private */
  shardd__frame_reader rd;
  uint32_t pending; /* collectives it waits in */
  int closing;
  int close_after_write;
  /* A reply could not be sent: the session is dropped on the next loop
   * turn (server.c), never inside the caller that was answering it. */
  int close_deferred;
  uint32_t writes; /* replies handed to libuv whose write_done has not run */
  int read_paused; /* not read until its replies drain (server.c) */
  double since;         /* connected (server clock, seconds) */
  double partial_since; /* a partial frame is buffered since; < 0 none */
  shardd__session *prev, *next;
};

struct shardd__server {
  /* read-only */
  uv_loop_t *loop;
  shardd__server_opts opts;
  char socket_path[108];
  shardd__backend *backend;
  shardd__registry reg;
  double started; /* uv_now seconds at init */
  /* private */
  uv_pipe_t listener;
  uv_timer_t tick;
  uv_idle_t reaper; /* closes close_deferred sessions on the next turn */
  uv_signal_t sigterm, sigint;
  int own_socket_file; /* unlink it on stop */
  int stopping;
  uint64_t next_session;
  uint32_t nclients;
  shardd__session *sessions;
  atomic_uint fail_replies; /* shardd__server_fail_replies */
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
 * as if their buffer could not be allocated. Callable from any thread; the
 * daemon itself never calls it. */
void shardd__server_fail_replies(shardd__server *srv, unsigned n);

/* Whether s may see job: its owner's uid, root, or the admin group. */
int shardd__session_may_see(const shardd__session *s, const shardd__job *job);

/* Checkpoints job to dir (refused while it has collectives in flight). */
shardd_err shardd__server_checkpoint(shardd__server *srv, shardd__job *job,
                                     const char *dir, int64_t as_uid, char *err,
                                     size_t errlen);
/* Called when job may have become idle (a client left, a collective
 * ended); releases it at once under --job-linger 0. job may be freed. */
void shardd__server_job_idle(shardd__server *srv, shardd__job *job);

/* Starts the linger clock of a job that has no client (after a restore). */
void shardd__job_mark_idle(shardd__server *srv, shardd__job *job);

/* Seconds since the loop started (monotonic). */
double shardd__server_now(const shardd__server *srv);

/* Sends resp on s; fd >= 0 travels with it (SCM_RIGHTS) and is closed here
 * after sending. Never closes s before it returns, so collectives may answer
 * their waiters while they walk them: when a reply cannot be sent, s gets
 * no further replies or requests and is closed on the next loop turn. */
void shardd__session_send(shardd__session *s, Shardd__Response *resp, int fd);
/* A status-only reply. */
void shardd__session_reply(shardd__session *s, uint64_t seq, shardd_err code,
                           const char *msg);

void shardd__log(const shardd__server *srv, int level, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

#endif /* SHARDD_SERVER_H */
