/* dispatch_int.h — what the dispatcher's files share and nothing outside
 * them sees (as libuv's internal.h): the reply builder, the handler type,
 * and the entry points each file gives the command table, the connection
 * hooks and the engine's hooks in dispatch.c. Loop thread only. */
#ifndef SHARDD_DISPATCH_INT_H
#define SHARDD_DISPATCH_INT_H

#include <stdint.h>
#include <uv.h>

#include "dispatch.h"
#include "proto/shardd.pb-c.h"

#define ERRLEN 512

static inline double now_s(const shardd__dispatch *d) {
  return (double)uv_now(d->loop) / 1000.0;
}

/* A request's handler, one per body in the command table (dispatch.c). */
typedef void (*handler)(shardd__dispatch *d, shardd__conn *c, uint64_t seq,
                        const Shardwire__Request *req);

/* ---- the reply builder (reply.c) ---------------------------------------- */

/* A successful reply of body case bc; the caller sets the body. */
static inline Shardwire__Response ok_resp(uint64_t seq,
                                          Shardwire__Response__BodyCase bc) {
  Shardwire__Response resp = SHARDWIRE__RESPONSE__INIT;
  resp.seq = seq;
  resp.code = SHARDWIRE__STATUS_CODE__OK;
  resp.body_case = bc;
  return resp;
}

/* Sends resp on c, with fd (>= 0) travelling with it; fd is closed when c
 * is going away or the reply would be over the frame limit (then c is
 * told so instead). */
void shardd__send_resp(shardd__dispatch *d, shardd__conn *c,
                       const Shardwire__Response *resp, int fd);
/* As shardd__send_resp, with n descriptors in order (all >= 0); they are
 * the hook's from here, or closed. */
void shardd__send_resp_fds(shardd__dispatch *d, shardd__conn *c,
                           const Shardwire__Response *resp, int *fds, size_t n);
/* A status-only reply (msg NULL: the code's own words). */
void shardd__reply(shardd__dispatch *d, shardd__conn *c, uint64_t seq,
                   shardd_err code, const char *msg);
/* Refuses a request reusing the seq of what (a collective checkpoint, a
 * bucket) still being answered. */
void shardd__seq_refuse(shardd__dispatch *d, shardd__conn *c, uint64_t seq,
                        const char *what);

#endif /* SHARDD_DISPATCH_INT_H */
