/* framebudget.c — the transport's budget for bytes held in partial frames
 * (see server_int.h). */
#include "server_int.h"

#include <inttypes.h>
#include <stdio.h>

#include "log.h"

/* A frame is read whole before it is dispatched, and up to 16 MiB of it
 * may sit in the daemon meanwhile: 64 connections each holding half of one
 * cost 1 GB for as long as --frame-timeout let them. So before the daemon
 * reads more of a frame, the session is charged the bytes its reader will
 * hold once that frame is whole (shardd__frame_reader_need). The charges
 * of all sessions stay within --max-partial-bytes. A session that finds no
 * room is not read (backpressure, not failure: the client's send waits in
 * the kernel) until charges are released, when frames complete or
 * sessions close. Whole frames that came in the same read are dispatched
 * all the same (in as many fair turns as they take, server.c), so small
 * requests get through while the budget is full, and a waiting session
 * holds at most one read (64 KiB) beyond its charge.
 *
 * Uids other than root and --admin-group (those the connection reserve
 * exempts) share the budget so that none can lock the others out:
 *  - together they hold at most three quarters of it: the last quarter is
 *    kept for root and --admin-group, whose frames (shardctl's, an
 *    operator's) so never wait for users' (four uids each within its
 *    quarter filled it all);
 *  - one uid holds at most a quarter;
 *  - while a session of another uid waits for room, a uid that holds more
 *    than its fair share (the users' three quarters over the uids that
 *    hold some or wait for room) is charged no more, and waits with it:
 *    the bytes frames give back go to the uids below their share first,
 *    so a newcomer waits for frames in flight to finish (at most
 *    --frame-timeout), never for the others' next ones.
 * The quarter and the fair share let a session in regardless when its uid
 * holds nothing else, the users' part when no other user's session holds
 * anything, the total when no other session does: a budget below one
 * frame slows the daemon, never stops it. */

int shardd__session_may_read(const shardd__session *s) {
  return !s->closing && !s->close_after_write && !s->close_deferred &&
         !s->read_paused && !s->reply_wait && !s->budget_wait && !s->deferred;
}

static int uid_active(const shardd__reply_uid *u) {
  return u->partial > 0 || u->room_waiters > 0;
}

/* Whether s may be charged more bytes: 0 yes, else why not in msg and 1
 * (it waits for room) or 2 (for its uid's quarter). */
static int budget_fits(const shardd__session *s, uint64_t more, char *msg,
                       size_t msglen) {
  const shardd__server *srv = s->srv;
  uint64_t max = srv->opts.max_partial_bytes;
  if (max == 0)
    return 0;
  if (srv->partial_bytes > s->charged && srv->partial_bytes + more > max) {
    snprintf(msg, msglen, "partial frames hold %" PRIu64 " bytes, %" PRIu64
             " more would pass --max-partial-bytes %" PRIu64,
             srv->partial_bytes, more, max);
    return 1;
  }
  const shardd__reply_uid *u = s->reply_uid;
  if (s->conn.peer.admin || u == NULL)
    return 0;
  uint32_t uid = u->uid;
  uint64_t users = max - srv->partial_share;
  if (srv->partial_users > s->charged && srv->partial_users + more > users) {
    snprintf(msg, msglen, "users' partial frames hold %" PRIu64 " bytes, %"
             PRIu64 " more would pass their %" PRIu64 " (a quarter of "
             "--max-partial-bytes is kept for root and --admin-group)",
             srv->partial_users, more, users);
    return 1;
  }
  uint64_t mine = u->partial;
  if (mine > s->charged && mine + more > srv->partial_share) {
    snprintf(msg, msglen, "uid %" PRIu32 "'s partial frames hold %" PRIu64
             " bytes, %" PRIu64 " more would pass its share of %" PRIu64
             " (a quarter of --max-partial-bytes)", uid, mine, more,
             srv->partial_share);
    return 2;
  }
  /* s's own wait (if any) is its uid's: only other uids' count */
  if (mine > s->charged && srv->room_waiters > u->room_waiters) {
    uint64_t fair = users / (srv->partial_uids ? srv->partial_uids : 1);
    if (mine + more > fair) {
      snprintf(msg, msglen, "uid %" PRIu32 "'s partial frames hold %" PRIu64
               " bytes, %" PRIu64 " more would pass its fair share of %"
               PRIu64 " while other uids wait (%" PRIu32 " uids hold "
               "partial frames or wait)", uid, mine, more, fair,
               srv->partial_uids);
      return 1;
    }
  }
  return 0;
}

/* s waits (why: 1 or 2, see budget_wait) or no longer (0), counted so. */
static void set_wait(shardd__session *s, int why) {
  shardd__server *srv = s->srv;
  shardd__reply_uid *u = s->reply_uid;
  if ((s->budget_wait != 0) != (why != 0))
    srv->budget_waiters += why ? 1 : -1;
  if ((s->budget_wait == 1) != (why == 1)) {
    int d = why == 1 ? 1 : -1;
    srv->room_waiters += (uint32_t)d;
    if (u != NULL) {
      int was = uid_active(u);
      u->room_waiters += (uint32_t)d;
      srv->partial_uids += (uint32_t)(uid_active(u) - was);
    }
  }
  s->budget_wait = why;
}

/* Charges s what its reader needs now, releasing what it needs no longer,
 * or stops reading it until that fits. Returns 1 when it released bytes
 * or stopped waiting for room as it closed (a waiting session may fit
 * now). Never dispatches, so it is safe from
 * anywhere on the loop thread. */
int shardd__budget_account(shardd__session *s) {
  shardd__server *srv = s->srv;
  uint64_t need = s->closing ? 0 : shardd__frame_reader_need(&s->rd);
  char msg[320];
  int why;
  if (need > s->charged &&
      (why = budget_fits(s, need - s->charged, msg, sizeof msg)) != 0) {
    if (!s->budget_wait) {
      uv_read_stop((uv_stream_t *)&s->pipe);
      /* once per episode: a full budget under load is normal, and a line
       * per session would be thousands */
      shardd__log(srv->budget_warned ? 3 : 1, "session %" PRIu64 " (uid %"
                  PRIu32 ") not read until partial frames finish: %s",
                  s->conn.id, (uint32_t)s->conn.peer.uid, msg);
      srv->budget_warned = 1;
    }
    set_wait(s, why);
    return 0;
  }
  /* a waiter closing releases nothing, but may have held back the uids
   * above their fair share: they may fit now */
  int released = need < s->charged || (s->closing && s->budget_wait == 1);
  srv->partial_bytes = srv->partial_bytes - s->charged + need;
  shardd__reply_uid *u = s->reply_uid;
  if (u != NULL && !s->conn.peer.admin) {
    int was = uid_active(u);
    u->partial = u->partial - s->charged + need;
    srv->partial_users = srv->partial_users - s->charged + need;
    srv->partial_uids += (uint32_t)(uid_active(u) - was);
  }
  s->charged = need;
  if (s->budget_wait) {
    set_wait(s, 0);
    if (srv->budget_waiters == 0 && srv->budget_warned) {
      srv->budget_warned = 0;
      shardd__log(2, "partial frames fit their budget again; every session "
                  "is read");
    }
    if (shardd__session_may_read(s))
      shardd__session_read_start(s);
  }
  return released;
}

/* Lets waiting sessions in, oldest first, as long as they fit. */
void shardd__budget_resume(shardd__server *srv) {
  if (srv->stopping)
    return;
  shardd__session *tail = srv->sessions;
  while (tail && tail->next)
    tail = tail->next;
  for (shardd__session *s = tail; s && srv->budget_waiters > 0; s = s->prev)
    if (s->budget_wait)
      shardd__budget_account(s);
}

