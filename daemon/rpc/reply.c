/* reply.c — the one reply builder of the dispatcher: packs a Response with
 * room for the transport's header and hands it to the send hook (see
 * dispatch_int.h). */
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "dispatch_int.h"
#include "frame.h"
#include "log.h"
#include "varint.h"

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

static size_t view_reply_len(const Shardwire__ViewReply *v) {
  return 1 + shardd__varint_len(v->id) + 2 +
         (v->has_generation ? 1 + shardd__varint_len(v->generation) : 0);
}

size_t shardd__views_reply_pack(uint64_t seq, const Shardwire__ViewReply *vr,
                                size_t n, uint8_t *out) {
  /* Response { seq = 1; code = 2 (OK); views_batch = 25 { views = 1 ... } },
   * in field order as protobuf-c writes it */
  size_t body = 0;
  for (size_t i = 0; i < n; i++) {
    size_t e = view_reply_len(&vr[i]);
    body += 1 + shardd__varint_len(e) + e;
  }
  size_t len = 1 + shardd__varint_len(seq) + 2 + 2 + shardd__varint_len(body) + body;
  if (out == NULL)
    return len;
  uint8_t *p = out;
  *p++ = 0x08; /* seq: 1, varint */
  p = shardd__varint_put(p, seq);
  *p++ = 0x10; /* code: 2, varint */
  *p++ = (uint8_t)SHARDWIRE__STATUS_CODE__OK;
  *p++ = 0xca; /* views_batch: 25, length-delimited */
  *p++ = 0x01;
  p = shardd__varint_put(p, body);
  for (size_t i = 0; i < n; i++) {
    const Shardwire__ViewReply *v = &vr[i];
    *p++ = 0x0a; /* views: 1, length-delimited */
    p = shardd__varint_put(p, view_reply_len(v));
    *p++ = 0x08; /* id */
    p = shardd__varint_put(p, v->id);
    *p++ = 0x10; /* created */
    *p++ = v->created ? 1 : 0;
    if (v->has_generation) {
      *p++ = 0x18; /* generation */
      p = shardd__varint_put(p, v->generation);
    }
  }
  return (size_t)(p - out);
}

void shardd__send_views_reply(shardd__dispatch *d, shardd__conn *c,
                              uint64_t seq, const Shardwire__ViewReply *vr,
                              size_t n) {
  if (!d->io.live(d->io.ctx, c))
    return;
  size_t len = shardd__views_reply_pack(seq, vr, n, NULL);
  if (len > SHARDD_MAX_FRAME) {
    char msg[256];
    snprintf(msg, sizeof msg, "the reply would be %zu bytes, over the %u-byte "
             "frame limit", len, SHARDD_MAX_FRAME);
    shardd__reply(d, c, seq, SHARDD_E_LIMIT, msg);
    return;
  }
  uint8_t *frame = malloc(SHARDD_FRAME_HEADER + len);
  if (frame)
    shardd__views_reply_pack(seq, vr, n, frame + SHARDD_FRAME_HEADER);
  d->io.send(d->io.ctx, c, frame, len, -1);
}

/* As send_resp, with n descriptors in order (all >= 0); they are the
 * hook's from here, or closed; borrowed (n >= 2): the caller's. */
void shardd__send_resp_fds(shardd__dispatch *d, shardd__conn *c,
                           const Shardwire__Response *resp, int *fds,
                           size_t n, int borrowed) {
  if (n <= 1) {
    /* send owns its descriptor: a borrowed one (a slab's, which all of a
     * batch's entries name) goes as a duplicate */
    int fd = n == 0 ? -1 : borrowed ? fcntl(fds[0], F_DUPFD_CLOEXEC, 0) : fds[0];
    if (n == 1 && fd < 0) {
      shardd__reply(d, c, resp->seq, SHARDD_E_IO, "duplicating a descriptor "
                    "for the reply failed");
      return;
    }
    shardd__send_resp(d, c, resp, fd);
    return;
  }
  size_t len = shardwire__response__get_packed_size(resp);
  if (!d->io.live(d->io.ctx, c) || len > SHARDD_MAX_FRAME) {
    for (size_t i = 0; i < n && !borrowed; i++)
      close(fds[i]);
    shardd__send_resp(d, c, resp, -1); /* says why, or nothing */
    return;
  }
  uint8_t *frame = malloc(SHARDD_FRAME_HEADER + len);
  if (frame)
    shardwire__response__pack(resp, frame + SHARDD_FRAME_HEADER);
  d->io.send_fds(d->io.ctx, c, frame, len, fds, n, borrowed);
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

/* ---- batch replies: the entries refused or failed --------------------- */

/* The reply's errors list refused entries while their text stays under
 * this (libshardd's requests of 256 entries always fit: 512 bytes
 * each); errors_total counts them all. A raw client's 100,000 bad entries
 * would not fit one frame. */
#define BATCH_ERRORS_BYTES (8u << 20)
/* The message's size: the entries it has room for, then "and N more". */
#define BATCH_MSG_MAX (64 * 1024)

void shardd__batch_errs_free(batch_errs *b) {
  for (size_t i = 0; i < b->n; i++)
    free(b->errs[i].message);
  free(b->errs);
  free(b->errp);
  free(b->msg);
}

/* Records entry i's refusal; out of memory only shortens the lists. */
void shardd__batch_err_add(batch_errs *b, size_t i, shardd_err rc,
                           const char *why) {
  i += b->base;
  if (b->total++ == 0)
    b->first = rc;
  if (b->errs == NULL && b->cap > 0) {
    b->errs = calloc(b->cap, sizeof *b->errs);
    b->errp = calloc(b->cap, sizeof *b->errp);
    if (b->errs == NULL || b->errp == NULL) {
      free(b->errs);
      free(b->errp);
      b->errs = NULL;
      b->errp = NULL;
      b->cap = 0; /* out of memory: the message and the count only */
    }
  }
  if (b->bytes < BATCH_ERRORS_BYTES && b->n < b->cap) {
    Shardwire__BatchError *e = &b->errs[b->n];
    shardwire__batch_error__init(e);
    e->index = (uint32_t)i;
    e->code = (Shardwire__StatusCode)rc;
    e->message = strdup(why);
    if (e->message) {
      b->errp[b->n] = e;
      b->n++;
      b->bytes += strlen(why) + 16;
    }
  }
  /* the message's room is taken at the first refusal: most batches have
   * none, and 64 KiB per request was a cost of every bucket */
  if (b->msg == NULL && !b->cut && (b->msg = malloc(BATCH_MSG_MAX)) == NULL)
    b->cut = 1; /* out of memory: the list only, and the count */
  if (b->msg && !b->cut) {
    int k = snprintf(b->msg + b->len, BATCH_MSG_MAX - b->len, "%s[%zu] %s: %s",
                     b->total > 1 ? "; " : "", i, shardd_err_name(rc), why);
    if (k < 0 || (size_t)k >= BATCH_MSG_MAX - b->len - 64)
      b->cut = 1; /* keeps the 64 bytes for the count */
    else {
      b->len += (size_t)k;
      b->listed++;
    }
  }
}

/* The reply of a batch some of whose entries were refused or failed: the
 * first entry's code, head then every listed entry named, and the entries
 * in the reply body that what names ("views", "buffers", "bucket ..."). */
void shardd__batch_send(shardd__dispatch *d, shardd__conn *c, uint64_t seq,
                        const batch_errs *b, const char *head,
                        const char *what) {
  size_t hl = strlen(head);
  char *m = malloc(hl + b->len + 96);
  if (m) {
    memcpy(m, head, hl);
    memcpy(m + hl, b->msg ? b->msg : "", b->len);
    m[hl + b->len] = '\0';
    if (b->listed < b->total)
      snprintf(m + hl + b->len, 96, "%sand %zu more", b->listed ? "; " : "",
               b->total - b->listed);
  }
  Shardwire__Response resp = SHARDWIRE__RESPONSE__INIT;
  resp.seq = seq;
  resp.code = (Shardwire__StatusCode)b->first;
  resp.message = m ? m : (char *)shardd_strerror(b->first);
  Shardwire__ViewsBatchReply vb = SHARDWIRE__VIEWS_BATCH_REPLY__INIT;
  Shardwire__BuffersBatchReply bb = SHARDWIRE__BUFFERS_BATCH_REPLY__INIT;
  Shardwire__BucketReply kb = SHARDWIRE__BUCKET_REPLY__INIT;
  /* the three reply types carry the same error fields under their own
   * generated names */
#define BATCH_ERRORS(r)                                                       \
  ((r).n_errors = b->n, (r).errors = b->errp, (r).has_errors_total = 1,      \
   (r).errors_total = (uint32_t)b->total)
  if (strncmp(what, "bucket", 6) == 0) {
    BATCH_ERRORS(kb);
    resp.body_case = SHARDWIRE__RESPONSE__BODY_BUCKET;
    resp.bucket = &kb;
  } else if (strncmp(what, "buffer", 6) == 0) {
    BATCH_ERRORS(bb);
    resp.body_case = SHARDWIRE__RESPONSE__BODY_BUFFERS_BATCH;
    resp.buffers_batch = &bb;
  } else {
    BATCH_ERRORS(vb);
    resp.body_case = SHARDWIRE__RESPONSE__BODY_VIEWS_BATCH;
    resp.views_batch = &vb;
  }
#undef BATCH_ERRORS
  shardd__send_resp(d, c, &resp, -1);
  free(m);
}

/* The refusal: the first entry's code, every listed entry named. */
void shardd__batch_refuse(shardd__dispatch *d, shardd__conn *c, uint64_t seq,
                          size_t n, batch_errs *b, const char *what) {
  char head[128];
  int reg = strcmp(what, "views") == 0 || strcmp(what, "buffers") == 0;
  if (strncmp(what, "bucket", 6) == 0)
    /* what: "bucket gathers" or "bucket scatters" */
    snprintf(head, sizeof head, "%zu of the %zu entries of a %s refused, "
             "none submitted: ", b->total, n, what);
  else if (b->base)
    snprintf(head, sizeof head, "%zu of the %zu %s from entry %" PRIu32
             " refused, none of them %s: ", b->total, n, what, b->base,
             reg ? "registered" : "unregistered");
  else
    snprintf(head, sizeof head, "%zu of %zu %s refused, none %s: ", b->total,
             n, what, reg ? "registered" : "unregistered");
  shardd__batch_send(d, c, seq, b, head, what);
}

void shardd__batch_errs_init(batch_errs *b, size_t n, uint32_t base) {
  memset(b, 0, sizeof *b);
  b->base = base;
  b->cap = n;
}
