/* reads.c — the transport's reading side: read callbacks, frames out of
 * each session's reader, and fair turns between sessions (see
 * server_int.h). */
#include "server_int.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "log.h"

static void alloc_cb(uv_handle_t *h, size_t suggested, uv_buf_t *buf);
static void read_cb(uv_stream_t *stream, ssize_t nread, const uv_buf_t *buf);
static void on_turns(uv_check_t *h);

void shardd__session_read_start(shardd__session *s) {
  uv_read_start((uv_stream_t *)&s->pipe, alloc_cb, read_cb);
}

/* ---- reads ------------------------------------------------------------ */

static void alloc_cb(uv_handle_t *h, size_t suggested, uv_buf_t *buf) {
  static char slab[65536]; /* loop-thread only: consumed before the next read */
  buf->base = slab;
  buf->len = sizeof slab;
}

static void read_cb(uv_stream_t *stream, ssize_t nread, const uv_buf_t *buf) {
  shardd__session *s = (shardd__session *)stream;
  if (nread < 0) {
    if (nread != UV_EOF)
      shardd__log(3, "session %" PRIu64 ": read: %s", s->conn.id,
                  uv_strerror((int)nread));
    shardd__session_close(s);
    return;
  }
  if (s->closing || s->close_after_write || s->close_deferred)
    return;
  if (uv_pipe_pending_count(&s->pipe) > 0) {
    s->close_after_write = 1; /* before the reply: net_send's fast path */
    shardd__session_refuse(s, SHARDD_E_PROTOCOL, "clients may not send descriptors to the daemon");
    uv_read_stop(stream);
    return;
  }
  if (shardd__frame_reader_feed(&s->rd, buf->base, (size_t)nread) != SHARDD_OK) {
    shardd__session_close(s);
    return;
  }
  shardd__session_read_frames(s);
}

/* Fair turns. A read hands over up to 64 KiB, and libuv reads a ready
 * session up to 32 times before it looks at anyone else, so dispatching
 * every whole frame a read delivered let one client that pipelined
 * expensive requests keep the loop: 64 refused RegisterOptimizer requests
 * (each listing thousands of bad refs) in one write stalled every other
 * client for their whole cost (issue 20 item 10). So a session dispatches
 * for one turn, TURN_NS of loop time (at least one frame), then its reading
 * stops and the rest of its frames wait, in s->rd (charged to the
 * partial-frame budget as before), on the turn queue. After each poll,
 * on_turns gives every session queued before it one more turn, oldest
 * first; the idle handle spin keeps that poll from blocking meanwhile, so
 * other sessions' I/O is served between two turns of one session and a
 * queued session resumes without waiting for I/O. A session leaves the
 * queue when its turn ends with no whole frame left (it is read again if
 * nothing else holds it), when its replies (or its uid's) back up
 * (replybudget.c resumes it through a turn once they drain), or when it
 * closes (session_close unlinks it before anything else, so no turn
 * touches a closed session). */
#define TURN_NS ((uint64_t)1000000)

static void on_spin(uv_idle_t *h) { (void)h; }

static void turn_queue(shardd__session *s) {
  shardd__server *srv = s->srv;
  if (s->deferred || srv->stopping)
    return;
  s->deferred = 1;
  s->turn_round = srv->turn_round;
  uv_read_stop((uv_stream_t *)&s->pipe);
  s->turn_next = NULL;
  s->turn_prev = srv->turn_tail;
  if (srv->turn_tail)
    srv->turn_tail->turn_next = s;
  else
    srv->turn_head = s;
  srv->turn_tail = s;
  if (!uv_is_active((uv_handle_t *)&srv->turns)) {
    uv_check_start(&srv->turns, on_turns);
    uv_idle_start(&srv->spin, on_spin);
  }
}

void shardd__session_resume(shardd__session *s) {
  if (s->closing || s->close_after_write || s->close_deferred ||
      s->read_paused || s->reply_wait)
    return;
  turn_queue(s);
}

void shardd__turn_unlink(shardd__session *s) {
  shardd__server *srv = s->srv;
  if (s->turn_prev)
    s->turn_prev->turn_next = s->turn_next;
  else
    srv->turn_head = s->turn_next;
  if (s->turn_next)
    s->turn_next->turn_prev = s->turn_prev;
  else
    srv->turn_tail = s->turn_prev;
  s->turn_prev = s->turn_next = NULL;
  s->deferred = 0;
  if (srv->turn_head == NULL) {
    uv_check_stop(&srv->turns);
    uv_idle_stop(&srv->spin);
  }
}

/* One round: each session queued before it began takes one turn. One
 * re-queued by its turn goes to the tail with this round's number, which
 * ends the round; so does a session closed meanwhile, being unlinked. */
static void on_turns(uv_check_t *h) {
  shardd__server *srv = h->data;
  uint64_t round = ++srv->turn_round;
  while (srv->turn_head && srv->turn_head->turn_round < round)
    shardd__session_read_frames(srv->turn_head);
}

/* Dispatches the whole frames s->rd holds for one turn, unless replies
 * back up first. Returns 1 when the turn ended with bytes left that may
 * hold a whole frame. */
static int dispatch_frames(shardd__session *s) {
  uv_stream_t *stream = (uv_stream_t *)&s->pipe;
  uint64_t start = uv_hrtime();
  for (int n = 0;; n++) {
    if (s->closing || s->close_deferred)
      return 0; /* a reply failed (or the session ended) meanwhile */
    if (shardd__replies_hold(s))
      return 0; /* its replies, or its uid's, back up: write_done resumes it */
    if (n > 0 && uv_hrtime() - start >= TURN_NS)
      return shardd__frame_reader_pending(&s->rd) > 0;
    const uint8_t *payload;
    size_t len;
    shardd_err rc = shardd__frame_reader_next(&s->rd, &payload, &len);
    if (rc != SHARDD_OK) {
      char msg[128];
      snprintf(msg, sizeof msg, "frame over the %u-byte limit; closing",
               SHARDD_MAX_FRAME);
      shardd__log(1, "session %" PRIu64 ": %s", s->conn.id, msg);
      s->close_after_write = 1; /* before the reply: net_send's fast path */
      shardd__session_refuse(s, SHARDD_E_FRAME_TOO_LARGE, msg);
      uv_read_stop(stream);
      return 0;
    }
    if (payload == NULL)
      return 0;
    shardd__dispatch_frame(&s->srv->d, &s->conn, payload, len);
  }
}

/* One turn of dispatch_frames (taking s off the turn queue, and back on
 * when frames are left), then the budget charged for what s->rd holds. */
void shardd__session_read_frames(shardd__session *s) {
  int was_deferred = s->deferred;
  if (was_deferred)
    shardd__turn_unlink(s);
  int more = dispatch_frames(s);
  if (s->closing)
    return; /* session_close has settled its charge */
  if (more)
    turn_queue(s);
  else if (was_deferred && shardd__session_may_read(s))
    shardd__session_read_start(s); /* the deferral was what stopped it */
  shardd__frame_reader_trim(&s->rd); /* no payload is in use here */
  if (shardd__budget_account(s) && s->srv->budget_waiters > 0)
    shardd__budget_resume(s->srv);
}

