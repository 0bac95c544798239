/* replybudget.c — the transport's bounds on replies its clients have not
 * read (see server_int.h). */
#include "server_int.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>

#include "log.h"

/* A reply is held by the daemon (its bytes, its write request and, for a
 * RegisterBuffer, the block's descriptor) until the kernel takes it, and
 * the kernel takes no more once the client stops reading. A client that
 * sent requests and never read made the daemon hold ~90 MiB and 313
 * descriptors per connection; 256 connections of one uid would have been
 * 23 GiB and 80k descriptors (the unit allows 65536). So before each
 * frame is dispatched its session is checked, as the partial-frame budget
 * (framebudget.c) checks a frame's bytes before they are read:
 *  - a session whose unwritten replies hold --max-reply-bytes or
 *    --max-reply-fds is not read (read_paused) until they drain below
 *    half of both;
 *  - the sessions of one uid other than root and --admin-group (those the
 *    connection reserve exempts) together likewise at
 *    --max-reply-bytes-per-uid and --max-reply-fds-per-uid: every session
 *    of that uid waits (reply_wait) until the uid's replies drain below
 *    half of both.
 * Not read is backpressure, not failure: the client's sends wait in the
 * kernel, then in the client, and every reply comes, in order, once it
 * reads. The check comes before a frame, so one reply (at most a 16 MiB
 * frame, or 250 descriptors of a RegisterBuffers) may pass a bound; a
 * uid's sessions all stop once one of them passes it, so the uid holds at
 * most its bound plus that one reply. Replies to collectives that were
 * queued before (small status replies) are sent regardless. Other uids'
 * sessions are not held back by one uid's unread replies: there is no
 * bound in all, which one uid's hundreds of sessions could fill to lock
 * everyone out; the daemon's total is at most the per-uid bound times the
 * uids connected, plus --max-reply-bytes per root or admin session. */

static int session_over(const shardd__session *s, uint64_t bytes, uint32_t fds) {
  return s->reply_bytes >= bytes || s->reply_fds >= fds;
}

static int uid_over(const shardd__reply_uid *u, uint64_t bytes, uint32_t fds) {
  return u->bytes >= bytes || u->fds >= fds;
}

shardd_err shardd__replies_join(shardd__session *s) {
  shardd__server *srv = s->srv;
  if (s->conn.peer.admin)
    return SHARDD_OK;
  uint32_t uid = (uint32_t)s->conn.peer.uid;
  shardd__reply_uid *u = srv->reply_uids;
  while (u && u->uid != uid)
    u = u->next;
  if (u == NULL) {
    if ((u = calloc(1, sizeof *u)) == NULL)
      return SHARDD_E_NO_MEMORY;
    u->uid = uid;
    u->next = srv->reply_uids;
    srv->reply_uids = u;
  }
  u->refs++;
  s->reply_uid = u;
  return SHARDD_OK;
}

void shardd__replies_leave(shardd__session *s) {
  shardd__reply_uid *u = s->reply_uid;
  if (s->reply_bytes || s->reply_fds)
    /* every write has called back by the close callback: a bug */
    shardd__log(1, "session %" PRIu64 " freed with %" PRIu64 " reply bytes "
                "and %" PRIu32 " descriptors still charged", s->conn.id,
                s->reply_bytes, s->reply_fds);
  s->reply_uid = NULL;
  if (u == NULL || --u->refs > 0)
    return;
  shardd__reply_uid **pp = &s->srv->reply_uids;
  while (*pp && *pp != u)
    pp = &(*pp)->next;
  if (*pp)
    *pp = u->next;
  free(u);
}

void shardd__replies_closed(shardd__session *s) {
  if (s->reply_wait) {
    s->reply_wait = 0;
    s->reply_uid->waiters--;
  }
}

void shardd__replies_charge(shardd__session *s, uint64_t bytes, uint32_t fds) {
  shardd__server *srv = s->srv;
  s->reply_bytes += bytes;
  s->reply_fds += fds;
  srv->reply_bytes += bytes;
  srv->reply_fds += fds;
  if (s->reply_uid) {
    s->reply_uid->bytes += bytes;
    s->reply_uid->fds += fds;
  }
}

/* Every session of u waiting for its replies to drain takes a turn (its
 * whole frames are dispatched there, then it is read again). */
static void uid_resume(shardd__server *srv, shardd__reply_uid *u) {
  for (shardd__session *o = srv->sessions; o && u->waiters > 0; o = o->next)
    if (o->reply_uid == u && o->reply_wait) {
      o->reply_wait = 0;
      u->waiters--;
      shardd__session_resume(o);
    }
  if (u->warned) {
    u->warned = 0;
    shardd__log(3, "uid %" PRIu32 "'s unread replies drained below half "
                "their bounds; its connections are read again", u->uid);
  }
}

void shardd__replies_release(shardd__session *s, uint64_t bytes, uint32_t fds) {
  shardd__server *srv = s->srv;
  const shardd__server_opts *o = &srv->opts;
  s->reply_bytes -= bytes;
  s->reply_fds -= fds;
  srv->reply_bytes -= bytes;
  srv->reply_fds -= fds;
  shardd__reply_uid *u = s->reply_uid;
  if (u) {
    u->bytes -= bytes;
    u->fds -= fds;
  }
  if (srv->stopping)
    return;
  if (s->read_paused && !s->closing &&
      !session_over(s, o->max_reply_bytes / 2, o->max_reply_fds / 2)) {
    s->read_paused = 0;
    shardd__log(3, "session %" PRIu64 ": replies drained; reading again",
                s->conn.id);
    shardd__session_resume(s);
  }
  if (u && u->waiters > 0 &&
      !uid_over(u, o->max_reply_bytes_per_uid / 2, o->max_reply_fds_per_uid / 2))
    uid_resume(srv, u);
}

int shardd__replies_hold(shardd__session *s) {
  shardd__server *srv = s->srv;
  const shardd__server_opts *o = &srv->opts;
  if (session_over(s, o->max_reply_bytes, o->max_reply_fds)) {
    if (!s->read_paused)
      shardd__log(3, "session %" PRIu64 ": %" PRIu64 " bytes and %" PRIu32
                  " descriptors of replies unread by the client (--max-reply-"
                  "bytes %" PRIu64 ", --max-reply-fds %" PRIu32 "); not "
                  "reading it until they drain", s->conn.id, s->reply_bytes,
                  s->reply_fds, o->max_reply_bytes, o->max_reply_fds);
    s->read_paused = 1;
    uv_read_stop((uv_stream_t *)&s->pipe);
    return 1;
  }
  shardd__reply_uid *u = s->reply_uid;
  if (u == NULL ||
      !uid_over(u, o->max_reply_bytes_per_uid, o->max_reply_fds_per_uid))
    return 0;
  if (!s->reply_wait) {
    s->reply_wait = 1;
    u->waiters++;
  }
  uv_read_stop((uv_stream_t *)&s->pipe);
  if (!u->warned) {
    /* once per episode, not per session: there may be hundreds; and a
     * warning at most every 10 s, as a client reading in bursts makes
     * episode after episode */
    double now = shardd__server_now(srv);
    int loud = now >= u->loud_next;
    if (loud)
      u->loud_next = now + 10;
    u->warned = 1;
    shardd__log(loud ? 1 : 3, "uid %" PRIu32 "'s connections leave %" PRIu64 " bytes "
                "and %" PRIu32 " descriptors of replies unread (--max-reply-"
                "bytes-per-uid %" PRIu64 ", --max-reply-fds-per-uid %" PRIu32
                "); none of them is read until those drain", u->uid, u->bytes,
                u->fds, o->max_reply_bytes_per_uid, o->max_reply_fds_per_uid);
  }
  return 1;
}
