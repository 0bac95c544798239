/* reply.c — the one reply builder of the dispatcher: packs a Response with
 * room for the transport's header and hands it to the send hook (see
 * dispatch_int.h). */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "dispatch_int.h"
#include "frame.h"
#include "log.h"

/* The frame is packed here, with room for the transport's header in
 * front, so a reply is copied once. A connection that is going away gets
 * nothing (not even the frame-limit check's log line). */
void shardd__send_resp(shardd__dispatch *d, shardd__conn *c,
                       const Shardwire__Response *resp, int fd) {
  if (!d->io.live(d->io.ctx, c)) {
    if (fd >= 0)
      close(fd);
    return;
  }
  size_t n = shardwire__response__get_packed_size(resp);
  if (n > SHARDD_MAX_FRAME) {
    /* The client refuses a frame past the limit and drops the connection:
     * status with ~60k optimizers failed even for root, inspect of a
     * buffer with 200k views for its owner. Say so instead. */
    if (fd >= 0)
      close(fd);
    char msg[256];
    snprintf(msg, sizeof msg, "the reply would be %zu bytes, over the %u-byte "
             "frame limit; ask for less (one job's status, one buffer)", n,
             SHARDD_MAX_FRAME);
    shardd__log(1, "session %" PRIu64 ": %s", c->id, msg);
    shardd__reply(d, c, resp->seq, SHARDD_E_LIMIT, msg);
    return;
  }
  uint8_t *frame = malloc(SHARDD_FRAME_HEADER + n);
  if (frame)
    shardwire__response__pack(resp, frame + SHARDD_FRAME_HEADER);
  d->io.send(d->io.ctx, c, frame, n, fd);
}

/* As send_resp, with n descriptors in order (all >= 0); they are the
 * hook's from here, or closed. */
void shardd__send_resp_fds(shardd__dispatch *d, shardd__conn *c,
                           const Shardwire__Response *resp, int *fds, size_t n) {
  if (n <= 1) {
    shardd__send_resp(d, c, resp, n == 1 ? fds[0] : -1);
    return;
  }
  size_t len = shardwire__response__get_packed_size(resp);
  if (!d->io.live(d->io.ctx, c) || len > SHARDD_MAX_FRAME) {
    for (size_t i = 0; i < n; i++)
      close(fds[i]);
    shardd__send_resp(d, c, resp, -1); /* says why, or nothing */
    return;
  }
  uint8_t *frame = malloc(SHARDD_FRAME_HEADER + len);
  if (frame)
    shardwire__response__pack(resp, frame + SHARDD_FRAME_HEADER);
  d->io.send_fds(d->io.ctx, c, frame, len, fds, n);
}

/* A status-only reply (msg NULL: the code's own words). */
void shardd__reply(shardd__dispatch *d, shardd__conn *c, uint64_t seq,
                   shardd_err code, const char *msg) {
  Shardwire__Response resp = SHARDWIRE__RESPONSE__INIT;
  resp.seq = seq;
  resp.code = (Shardwire__StatusCode)code;
  resp.message = (char *)(msg ? msg : shardd_strerror(code));
  shardd__send_resp(d, c, &resp, -1);
}

void shardd__dispatch_refuse(shardd__dispatch *d, shardd__conn *c,
                             shardd_err code, const char *msg) {
  shardd__reply(d, c, 0, code, msg);
}

/* The collective engine answers by a request's seq, and the daemon keeps
 * what a collective checkpoint or a bucket waits for by it: a request that
 * reuses the seq of one still being answered (what) would have its end
 * taken for theirs, or theirs for its, so it is refused. */
void shardd__seq_refuse(shardd__dispatch *d, shardd__conn *c, uint64_t seq,
                        const char *what) {
  char msg[ERRLEN];
  snprintf(msg, sizeof msg, "seq %" PRIu64 " is the seq of this session's "
           "%s: every request needs a seq of its own until it is answered",
           seq, what);
  shardd__reply(d, c, seq, SHARDD_E_PROTOCOL, msg);
}
