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
 * of all sessions stay within --max-partial-bytes, and those of one uid
 * other than root and --admin-group within a quarter of it, as the
 * connection reserve exempts them. A session that finds no room is not
 * read (backpressure, not failure: the client's send waits in the kernel)
 * until charges are released, when frames complete or sessions close.
 * Whole frames that came in the same read are dispatched all the same (in
 * as many fair turns as they take, server.c), so small requests get
 * through while the budget is full, and a waiting session holds at most
 * one read (64 KiB) beyond its charge. A session
 * is let in regardless when no other session holds any of the budget (for
 * the share: none of its uid): a budget below one frame slows the daemon,
 * never stops it. */

int shardd__session_may_read(const shardd__session *s) {
  return !s->closing && !s->close_after_write && !s->close_deferred &&
         !s->read_paused && !s->reply_wait && !s->budget_wait && !s->deferred;
}

static uint64_t uid_charged(const shardd__server *srv, uint32_t uid) {
  uint64_t n = 0;
  for (const shardd__session *o = srv->sessions; o; o = o->next)
    if (o->conn.peer.uid == uid)
      n += o->charged;
  return n;
}

/* Whether s may be charged more bytes; else why not, in msg. */
static int budget_fits(const shardd__session *s, uint64_t more, char *msg,
                       size_t msglen) {
  const shardd__server *srv = s->srv;
  uint64_t max = srv->opts.max_partial_bytes;
  if (max == 0)
    return 1;
  if (srv->partial_bytes > s->charged && srv->partial_bytes + more > max) {
    snprintf(msg, msglen, "partial frames hold %" PRIu64 " bytes, %" PRIu64
             " more would pass --max-partial-bytes %" PRIu64,
             srv->partial_bytes, more, max);
    return 0;
  }
  if (s->conn.peer.admin)
    return 1;
  uint32_t uid = (uint32_t)s->conn.peer.uid;
  uint64_t mine = uid_charged(srv, uid);
  if (mine > s->charged && mine + more > srv->partial_share) {
    snprintf(msg, msglen, "uid %" PRIu32 "'s partial frames hold %" PRIu64
             " bytes, %" PRIu64 " more would pass its share of %" PRIu64
             " (a quarter of --max-partial-bytes)", uid, mine, more,
             srv->partial_share);
    return 0;
  }
  return 1;
}

/* Charges s what its reader needs now, releasing what it needs no longer,
 * or stops reading it until that fits. Returns 1 when it released bytes
 * (a waiting session may fit now). Never dispatches, so it is safe from
 * anywhere on the loop thread. */
int shardd__budget_account(shardd__session *s) {
  shardd__server *srv = s->srv;
  uint64_t need = s->closing ? 0 : shardd__frame_reader_need(&s->rd);
  char msg[256];
  if (need > s->charged && !budget_fits(s, need - s->charged, msg, sizeof msg)) {
    if (!s->budget_wait) {
      s->budget_wait = 1;
      srv->budget_waiters++;
      uv_read_stop((uv_stream_t *)&s->pipe);
      /* once per episode: a full budget under load is normal, and a line
       * per session would be thousands */
      shardd__log(srv->budget_warned ? 3 : 1, "session %" PRIu64 " (uid %"
                  PRIu32 ") not read until partial frames finish: %s",
                  s->conn.id, (uint32_t)s->conn.peer.uid, msg);
      srv->budget_warned = 1;
    }
    return 0;
  }
  int released = need < s->charged;
  srv->partial_bytes = srv->partial_bytes - s->charged + need;
  s->charged = need;
  if (s->budget_wait) {
    s->budget_wait = 0;
    if (--srv->budget_waiters == 0 && srv->budget_warned) {
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

