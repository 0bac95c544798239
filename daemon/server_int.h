/* server_int.h — what the transport's files share (server.c: sessions,
 * writes, admission, the tick; reads.c: reading and fair turns;
 * framebudget.c: the partial-frame budget). Only they include it. Loop
 * thread only. */
#ifndef SHARDD_SERVER_INT_H
#define SHARDD_SERVER_INT_H

#include "server.h"

/* Whether s may be read now (not closing, not paused for its replies or
 * for the budget, no frames of it deferred to a later turn). */
int shardd__session_may_read(const shardd__session *s);
/* server.c: closes s now (its close callback frees it); a status-only
 * reply from the transport itself; whether s's unwritten replies are past
 * the high (or not below the low) backpressure mark. */
void shardd__session_close(shardd__session *s);
void shardd__session_refuse(shardd__session *s, shardd_err code,
                            const char *msg);
int shardd__session_backlog(shardd__session *s, int high);

/* reads.c: starts reading s; dispatches the whole frames its reader holds
 * (within its turn); takes s off the turn queue (at close). */
void shardd__session_read_start(shardd__session *s);
void shardd__session_read_frames(shardd__session *s);
void shardd__turn_unlink(shardd__session *s);
/* Charges s what its frame reader needs now, releasing what it needs no
 * longer, or stops reading it until that fits; 1 when it released bytes
 * (a waiting session may fit now). Never dispatches. */
int shardd__budget_account(shardd__session *s);
/* Lets waiting sessions in, oldest first, as long as they fit. */
void shardd__budget_resume(shardd__server *srv);

#endif /* SHARDD_SERVER_INT_H */
