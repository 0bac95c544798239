/* opts.h — the daemon's configuration, as cli.c parses it from the command
 * line (see shardd --help); every layer reads the part it needs. A leaf
 * header: plain values and borrowed strings that live until exit. */
#ifndef SHARDD_OPTS_H
#define SHARDD_OPTS_H

#include <stddef.h>
#include <stdint.h>

#include "jobspec.h"
#include "shardd.h"

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
   * (the daemon writes with its own rights), and a uid other than root
   * only below its own <root>/<uid>; NULL: any absolute path. */
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
  /* bytes all jobs of one uid other than root may hold over all devices:
   * --job-memory-limit is per job, so 21 jobs of one user exhausted
   * device memory for everyone. 0 unlimited; SHARDD__UID_MEMORY_DEFAULT
   * a quarter of the backend's capacity (dispatch sizes it). */
  uint64_t uid_memory_limit;
  /* Bytes held in partial frames over every session (a quarter of it per
   * uid other than root and --admin-group): 64 connections each holding
   * half a 16 MiB frame cost 1 GB. Past it, sessions are not read. */
  uint64_t max_partial_bytes;
  /* views held at once, and by one uid other than root (0: a quarter of
   * max_views) */
  uint32_t max_views;
  uint32_t max_views_per_uid;
  /* --peer-grace: seconds a rank whose connection closed has to come back
   * before its peers' collectives fail (they waited the whole collective
   * timeout for a rank the daemon had seen go) */
  double peer_grace;
  /* Unread replies: a client that sent requests and never read made the
   * daemon hold ~90 MiB and 313 descriptors per connection, 256
   * connections of one uid 23 GiB and 80k descriptors. A session whose
   * unwritten replies hold max_reply_bytes or max_reply_fds is not read
   * until they drain below half; all sessions of one uid other than root
   * and --admin-group, likewise at the _per_uid bounds. */
  uint64_t max_reply_bytes;
  uint32_t max_reply_fds;
  uint64_t max_reply_bytes_per_uid;
  uint32_t max_reply_fds_per_uid;
  /* keep every single-node job's memory and description in the service
   * manager's file descriptor store (fdstore.h); main decides, from
   * $NOTIFY_SOCKET and $FDSTORE, with the host backend in
   * SHARDD__PERSIST_ON */
  int fd_store;
} shardd__server_opts;

#define SHARDD__UID_MEMORY_DEFAULT UINT64_MAX

/* Past --max-clients, root and --admin-group still get this many more
 * connections, so an operator can always look (shardctl status). */
#define SHARDD__ADMIN_RESERVE 8u

#define SHARDD__SERVER_OPTS_INIT \
  {sizeof(shardd__server_opts), SHARDD_DEFAULT_SOCKET, -1, 300.0, 600.0, 1024, 64, 2, -1, 0, NULL, NULL, 0, 16, 4096, 10.0, 30.0, 256, 512, SHARDD__UID_MEMORY_DEFAULT, (uint64_t)256 << 20, 4194304, 0, 1.0, \
   (uint64_t)16 << 20, 64, (uint64_t)64 << 20, 256, 0}

#endif /* SHARDD_OPTS_H */
