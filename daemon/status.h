/* status.h — the daemon's reports: Status (daemon, devices, jobs,
 * optimizers) and Inspect (one buffer or view), built as protobuf replies.
 *
 * Ownership: a built reply and every string and array in it belong to the
 * returned report; shardd__report_free releases all of it at once. */
#ifndef SHARDD_STATUS_H
#define SHARDD_STATUS_H

#include "server.h"

typedef struct shardd__report shardd__report;

/* Lists the jobs viewer may see (shardd__session_may_see). */
shardd_err shardd__status_build(shardd__server *srv,
                                const shardd__session *viewer,
                                shardd__report **out,
                                Shardd__StatusReply **reply);
/* By id (when id != 0) or by name, searched in s's job first, then in
 * every job s may see; an object of a job s may not see is
 * SHARDD_E_PERMISSION. */
shardd_err shardd__inspect_build(shardd__server *srv, shardd__session *s,
                                 uint64_t id, const char *name,
                                 shardd__report **out,
                                 Shardd__InspectReply **reply, char *err,
                                 size_t errlen);
void shardd__report_free(shardd__report *r);

#endif /* SHARDD_STATUS_H */
