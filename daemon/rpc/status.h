/* status.h — the daemon's reports: Status (daemon, devices, jobs,
 * optimizers) and Inspect (one buffer or view), built as protobuf replies
 * from a small context of what they report on, not from the server.
 *
 * Ownership: a built reply and every string and array in it belong to the
 * returned report; shardd__report_free releases all of it at once. */
#ifndef SHARDD_STATUS_H
#define SHARDD_STATUS_H

#include "access.h"
#include "coll.h"
#include "jobs.h"
#include "proto/shardd.pb-c.h"
#include "registry.h"

typedef struct {
  shardd__registry *reg;
  shardd__coll_engine *coll;
  shardd__jobs *jobs;
  double uptime_s;
  const char *socket_path;
  uint32_t clients; /* connections open now */
  uint64_t partial_frame_bytes; /* charged to --max-partial-bytes now */
  /* The operators' checkpoints of job waiting for its quiescent point
   * (kept above, in dispatch): the i-th oldest, or 0 past the last. dir
   * stays valid while the report is built. NULL: none are listed. */
  int (*pending_checkpoint)(void *arg, const shardd__job *job, size_t i,
                            const char **dir, double *waited_s, double *wait_s);
  void *pending_arg;
  /* what replies unread by their clients hold now (when has_) */
  int has_unread_replies;
  uint64_t unread_reply_bytes, unread_reply_fds;
} shardd__status_ctx;

typedef struct shardd__report shardd__report;

/* Lists the jobs viewer may see (shardd__access_may_see; viewer NULL:
 * every job), sorted by name and owner, from the first_job-th on: at most
 * 256 of them (jobs_more counts the rest), each summarized (ranks,
 * collectives and optimizers cut, their _more fields counting the rest),
 * so the reply fits a frame and costs what it lists. */
shardd_err shardd__status_build(const shardd__status_ctx *ctx,
                                const shardd__peer *viewer, uint32_t first_job,
                                shardd__report **out,
                                Shardwire__StatusReply **reply);
/* By id (when id != 0) or by name, searched in own_job first (may be
 * NULL), then in every job viewer may see; an object of a job viewer may
 * not see is SHARDD_E_PERMISSION. */
shardd_err shardd__inspect_build(const shardd__status_ctx *ctx,
                                 const shardd__peer *viewer,
                                 shardd__job *own_job, uint64_t id,
                                 const char *name, shardd__report **out,
                                 Shardwire__InspectReply **reply, char *err,
                                 size_t errlen);
void shardd__report_free(shardd__report *r);

#endif /* SHARDD_STATUS_H */
