/* server_int.h — what the transport's files share (server.c: sessions,
 * writes, admission, the tick; reads.c: reading and fair turns;
 * framebudget.c: the partial-frame budget; replybudget.c: the bounds on
 * unread replies). Only they include it. Loop thread only. */
#ifndef SHARDD_SERVER_INT_H
#define SHARDD_SERVER_INT_H

#include "server.h"

/* Whether s may be read now (not closing, not paused for its or its
 * uid's replies or for the budget, no frames of it deferred to a later
 * turn). */
int shardd__session_may_read(const shardd__session *s);
/* server.c: closes s now (its close callback frees it); a status-only
 * reply from the transport itself. */
void shardd__session_close(shardd__session *s);
void shardd__session_refuse(shardd__session *s, shardd_err code,
                            const char *msg);

/* reads.c: starts reading s; dispatches the whole frames its reader holds
 * (within its turn); takes s off the turn queue (at close). */
void shardd__session_read_start(shardd__session *s);
void shardd__session_read_frames(shardd__session *s);
void shardd__turn_unlink(shardd__session *s);
/* s, no longer held back by its replies, takes a turn (the whole frames
 * it holds are dispatched there) and is then read again, if nothing else
 * holds it. Never dispatches itself. */
void shardd__session_resume(shardd__session *s);
/* Charges s what its frame reader needs now, releasing what it needs no
 * longer, or stops reading it until that fits; 1 when it released bytes
 * or, closing, stopped waiting for room (a waiting session may fit now).
 * Never dispatches. */
int shardd__budget_account(shardd__session *s);
/* Lets waiting sessions in, oldest first, as long as they fit. */
void shardd__budget_resume(shardd__server *srv);

/* replybudget.c. join: s (just opened, its peer known) is counted with
 * its uid's sessions (root and --admin-group are not); leave: at its
 * close callback, once every write has called back. charge/release: a
 * reply handed to libuv, its write done (release resumes s, or its uid's
 * sessions, once drained below half the bounds). hold: before each frame
 * of s; 1 when s (or its uid) is past a bound, s then not read. closed: s
 * waits no longer (it is closing). */
shardd_err shardd__replies_join(shardd__session *s);
void shardd__replies_leave(shardd__session *s);
void shardd__replies_charge(shardd__session *s, uint64_t bytes, uint32_t fds);
void shardd__replies_release(shardd__session *s, uint64_t bytes, uint32_t fds);
int shardd__replies_hold(shardd__session *s);
void shardd__replies_closed(shardd__session *s);

#endif /* SHARDD_SERVER_INT_H */
