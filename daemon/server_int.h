/* server_int.h — what the transport's files share (server.c: sessions,
 * reads, writes, admission, the tick; framebudget.c: the partial-frame
 * budget). Only they include it. Loop thread only. */
#ifndef SHARDD_SERVER_INT_H
#define SHARDD_SERVER_INT_H

#include "server.h"

/* Whether s may be read now (not closing, not paused for its replies or
 * for the budget, no frames of it deferred to a later turn). */
int shardd__session_may_read(const shardd__session *s);
/* Starts reading s (server.c's read callbacks). */
void shardd__session_read_start(shardd__session *s);
/* Charges s what its frame reader needs now, releasing what it needs no
 * longer, or stops reading it until that fits; 1 when it released bytes
 * (a waiting session may fit now). Never dispatches. */
int shardd__budget_account(shardd__session *s);
/* Lets waiting sessions in, oldest first, as long as they fit. */
void shardd__budget_resume(shardd__server *srv);

#endif /* SHARDD_SERVER_INT_H */
