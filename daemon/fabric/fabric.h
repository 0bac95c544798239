/* fabric.h — cross-node collectives of one job: the daemons of a job's
 * nodes form one communicator (one member per node, not per rank) and move
 * whole per-node slices between each other. The collective module runs the
 * local part of a two-level collective on the thread pool, then the
 * collective's cross-node exchange (fabric calls) on one of the job's
 * fabric threads, then the local fan-out on the pool.
 *
 * Implementations: fabric_gloo.cc (Gloo's TCP transport, rendezvous through
 * a shared directory, which must be the daemon's uid's or root's and
 * writable by no other uid: SHARDD_E_PERMISSION naming it otherwise) for
 * host memory.
 * fabric_stub.c answers SHARDD_E_STATE when the daemon was built without
 * Gloo. A cuda fabric (NCCL: ncclCommInitRank with one rank per GPU, the
 * ncclUniqueId exchanged through the same rendezvous) would implement this
 * interface with device pointers and a stream; it is not written yet, and
 * a multi-node job on the cuda backend is refused at Hello.
 *
 * Threads: create, the operations and destroy block and must never run on
 * the loop thread: create until every node joined (up to the timeout), an
 * operation while it waits for its peers (up to the timeout per wait),
 * destroy until Gloo's network thread lets go of the sockets (some 20 ms,
 * never a peer). Operations of one fabric may run concurrently on several
 * threads when their tags differ, which is what keeps a node that reached
 * its exchanges in another order than its peers from waiting on itself.
 * Operations of one tag must not overlap on a node, and every node must
 * issue them in the same order: Gloo pairs them by tag, first come first
 * matched, and would mix the data of two that overlap.
 *
 * Errors: an operation that fails (a peer gone, a timeout) leaves the
 * fabric unusable -- Gloo's connections latch their first error, and a
 * timeout closes all of them -- so the caller fails the operations that
 * were meant for it too, and makes a new fabric (coll_fabric.c re-forms
 * it for the next collective). Messages name the operation and the peer
 * where Gloo does.
 *
 * Abort: shardd__fabric_abort (any thread) ends every wait of the fabric's
 * operations at once, whatever the peers do, and fails them and every later
 * one with SHARDD_E_SHUTDOWN; a rendezvous in progress ends when opts.stop
 * says so. A stopping daemon uses it so that its stop is not held up by a
 * peer that never answers (up to the timeout otherwise).
 *
 * Ownership: a fabric is its creator's, freed with shardd__fabric_destroy.
 * Buffers are borrowed for the duration of a call. */
#ifndef SHARDD_FABRIC_H
#define SHARDD_FABRIC_H

#include <stddef.h>
#include <stdint.h>

#include "shardd.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct shardd__fabric shardd__fabric;

typedef struct {
  size_t size;
  const char *rendezvous; /* shared directory every node can read and write */
  const char *prefix;     /* key namespace in it (the job name) */
  const char *host;       /* address this node listens on, e.g. 127.0.0.1 */
  uint32_t nodes, node_rank;
  double timeout_s; /* rendezvous, and every operation end to end */
  /* polled (every 10 ms, any thread) while waiting for the other nodes at
   * the rendezvous: nonzero ends it with SHARDD_E_SHUTDOWN. NULL: never */
  int (*stop)(void *arg);
  void *stop_arg;
} shardd__fabric_opts;

#define SHARDD__FABRIC_OPTS_INIT \
  {sizeof(shardd__fabric_opts), NULL, NULL, "127.0.0.1", 1, 0, 300.0, NULL, NULL}

/* "gloo" when built with a fabric engine, NULL otherwise. Any thread. */
const char *shardd__fabric_engine(void);

/* Joins the other nodes through the rendezvous directory. Files an earlier
 * incarnation of the job left there (the job made again while the daemons
 * run, or a daemon restarted) are no obstacle: the nodes agree on a fresh
 * namespace first (fabric_gloo.cc). Fails with SHARDD_E_PEER_LOST and a
 * message naming the nodes that did not join within the timeout,
 * SHARDD_E_STATE without an engine, SHARDD_E_PERMISSION naming the
 * rendezvous directory when it is a symlink, or belongs to another uid
 * than the daemon's or root, or its group or others may write it (every
 * file in it is opened relative to it, without following symlinks),
 * SHARDD_E_IO when the rendezvous files or the transport cannot be set
 * up. */
shardd_err shardd__fabric_create(const shardd__fabric_opts *opts,
                                 shardd__fabric **out, char *err,
                                 size_t errlen);

/* In place: buf holds nodes * bytes_per_node bytes; this node's part at
 * node_rank * bytes_per_node is sent, every other part received. */
shardd_err shardd__fabric_allgather(shardd__fabric *f, void *buf,
                                    size_t bytes_per_node, uint32_t tag,
                                    char *err, size_t errlen);

/* buf holds nodes * count fp32; afterwards this node's part (at
 * node_rank * count) holds the sum over nodes, summed in a fixed order for
 * a fixed layout (so repeated runs are bit-identical). Other parts are
 * left unspecified (they hold partial sums). Each node sends and receives
 * (nodes - 1) * count floats: a ring, not an allreduce. */
shardd_err shardd__fabric_reduce_scatter_f32(shardd__fabric *f, float *buf,
                                             size_t count, uint32_t tag,
                                             char *err, size_t errlen);

/* Every operation of f waiting now ends (in milliseconds, not at the
 * timeout) and fails with SHARDD_E_SHUTDOWN and a message ending in why
 * (copied), and so does every later one: the data an aborted operation was
 * moving is unspecified. Nothing is sent to the peers: they learn when f is
 * destroyed. Any thread, while f lives; a second call does nothing. */
void shardd__fabric_abort(shardd__fabric *f, const char *why);

/* Closes the connections; pending operations of the peers fail. */
void shardd__fabric_destroy(shardd__fabric *f);

#ifdef __cplusplus
}
#endif

#endif /* SHARDD_FABRIC_H */
