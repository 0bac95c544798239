/* async.c — async gathers and releases: a Gather or Release sent without
 * waiting, its ticket, and its reply kept (whichever call reads it) until
 * shardd_wait takes it. */
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "client_int.h"

static async_op *find_async(shardd_client_t *c, uint64_t seq) {
  for (async_op *a = c->async; a; a = a->next)
    if (a->seq == seq)
      return a;
  return NULL;
}

/* Keeps an async gather's result for shardd_wait: code (the daemon's, or
 * why its pool could not be mapped) with msg (NULL: none), and where its
 * areas are. */
static void async_note(async_op *a, const Shardwire__Response *resp,
                       shardd_err code, const char *msg) {
  a->done = 1;
  a->code = code;
  a->msg = code != SHARDD_OK && msg && msg[0] ? strdup(msg) : NULL;
  if (code == SHARDD_OK && resp->body_case == SHARDWIRE__RESPONSE__BODY_GATHER) {
    a->has_area = 1;
    a->pool = resp->gather->pool;
    a->gather_off = resp->gather->gather_offset;
    a->has_grad_off = resp->gather->has_grad_offset;
    a->grad_off = resp->gather->grad_offset;
    a->has_grad_pool = resp->gather->has_grad_pool;
    a->grad_pool = resp->gather->grad_pool;
  }
}

void shardd__async_reply(shardd_client_t *c, const Shardwire__Response *resp,
                         shardd_err pool_rc, const char *why) {
  async_op *a = find_async(c, resp->seq);
  if (a && !a->done) {
    if (pool_rc != SHARDD_OK)
      async_note(a, resp, pool_rc, why);
    else
      async_note(a, resp, (shardd_err)resp->code, resp->message);
  }
}

void shardd__async_free(shardd_client_t *c) {
  while (c->async) {
    async_op *a = c->async;
    c->async = a->next;
    free(a->msg);
    free(a);
  }
}

/* Receives until a's reply has come (a stays listed, its result kept). */
static shardd_err await_op(shardd_client_t *c, async_op *a) {
  if (a->done)
    return SHARDD_OK;
  Shardwire__Response *resp;
  shardd_err rc = shardd__recv_for(c, a->seq, &resp, NULL);
  if (resp) {
    async_note(a, resp, rc, shardd_last_error(c));
    shardwire__response__free_unpacked(resp, NULL);
    return SHARDD_OK;
  }
  return rc; /* the connection failed: no reply will come */
}

shardd_err shardd_wait(shardd_client_t *c, shardd_ticket t) {
  if (c == NULL)
    return SHARDD_E_INVAL; /* no client to hold a message */

  return shardd_wait_area(c, t, NULL);
}

shardd_err shardd_wait_area(shardd_client_t *c, shardd_ticket t,
                            shardd_area *out) {
  if (c == NULL)
    return SHARDD_E_INVAL; /* no client to hold a message */

  if (out)
    memset(out, 0, sizeof *out);
  async_op **pp = &c->async;
  while (*pp && (*pp)->seq != t)
    pp = &(*pp)->next;
  if (*pp == NULL)
    return shardd__set_err(c, SHARDD_E_INVAL,
                           "ticket %" PRIu64 " is not outstanding", t);
  async_op *a = *pp;
  shardd__clear_err(c);
  shardd_err rc = await_op(c, a);
  if (rc == SHARDD_OK) {
    rc = a->code;
    if (rc != SHARDD_OK)
      shardd__set_err(c, rc, "%s", a->msg ? a->msg : shardd_strerror(rc));
  }
  if (rc == SHARDD_OK && out) {
    Shardwire__GatherReply gr = SHARDWIRE__GATHER_REPLY__INIT;
    gr.pool = a->pool;
    gr.gather_offset = a->gather_off;
    gr.has_grad_offset = a->has_grad_off;
    gr.grad_offset = a->grad_off;
    gr.has_grad_pool = a->has_grad_pool;
    gr.grad_pool = a->grad_pool;
    /* the pools were mapped when the reply came; only the size is not kept */
    const pool_map *p = a->has_area ? shardd__find_pool(c, a->pool) : NULL;
    gr.pool_bytes = p ? p->len : 0;
    rc = shardd__area_fill(c, a->buffer, a->has_area ? &gr : NULL, a->want_grad,
                           out);
    if (rc != SHARDD_OK)
      memset(out, 0, sizeof *out);
  }
  *pp = a->next;
  free(a->msg);
  free(a);
  return rc;
}

/* Sends req and lists it, oldest first, for shardd_wait: *t its ticket. */
static shardd_err send_async(shardd_client_t *c, Shardwire__Request *req,
                             uint64_t buffer, int gather, int want_grad,
                             shardd_ticket *t) {
  async_op *a = calloc(1, sizeof *a);
  if (a == NULL)
    return shardd__set_err(c, SHARDD_E_NO_MEMORY, "out of memory");
  shardd_err rc = shardd__send_req(c, req);
  if (rc != SHARDD_OK) {
    free(a);
    return rc;
  }
  a->seq = req->seq;
  a->buffer = buffer;
  a->gather = gather;
  a->want_grad = want_grad;
  async_op **tail = &c->async;
  while (*tail)
    tail = &(*tail)->next;
  *tail = a;
  *t = a->seq;
  return SHARDD_OK;
}

shardd_err shardd_gather_async(shardd_client_t *c, uint64_t buffer,
                               shardd_ticket *t) {
  if (c == NULL)
    return SHARDD_E_INVAL; /* no client to hold a message */
  if (t == NULL)
    return shardd__set_err(c, SHARDD_E_INVAL, "shardd_gather_async: t is NULL");

  return shardd_gather_area_async(c, buffer, 0, t);
}

shardd_err shardd_gather_area_async(shardd_client_t *c, uint64_t buffer,
                                    int want_grad, shardd_ticket *t) {
  if (c == NULL)
    return SHARDD_E_INVAL; /* no client to hold a message */
  if (t == NULL)
    return shardd__set_err(c, SHARDD_E_INVAL,
                           "shardd_gather_area_async: t is NULL");

  *t = 0;
  shardd__clear_err(c);
  /* limit_all_gathers: with max_async still in flight, the oldest is
   * awaited first (its ticket keeps its result for shardd_wait), which
   * bounds the gather areas being filled ahead of use. */
  size_t n = 0;
  async_op *oldest = NULL;
  for (async_op *a = c->async; a; a = a->next)
    if (!a->done && a->gather) {
      n++;
      if (oldest == NULL)
        oldest = a;
    }
  if (n >= c->max_async) {
    shardd_err rc = await_op(c, oldest);
    if (rc != SHARDD_OK)
      return rc;
  }
  Shardwire__Request req = SHARDWIRE__REQUEST__INIT;
  Shardwire__Gather g = SHARDWIRE__GATHER__INIT;
  g.buffer = buffer;
  if (want_grad) {
    g.has_want_grad = 1;
    g.want_grad = 1;
  }
  req.body_case = SHARDWIRE__REQUEST__BODY_GATHER;
  req.gather = &g;
  return send_async(c, &req, buffer, 1, want_grad != 0, t);
}

shardd_err shardd_release_async(shardd_client_t *c, uint64_t buffer,
                                shardd_ticket *t) {
  if (c == NULL)
    return SHARDD_E_INVAL; /* no client to hold a message */
  if (t == NULL)
    return shardd__set_err(c, SHARDD_E_INVAL, "shardd_release_async: t is NULL");

  *t = 0;
  shardd__clear_err(c);
  Shardwire__Request req = SHARDWIRE__REQUEST__INIT;
  Shardwire__Release r = SHARDWIRE__RELEASE__INIT;
  r.buffer = buffer;
  req.body_case = SHARDWIRE__REQUEST__BODY_RELEASE;
  req.release = &r;
  return send_async(c, &req, buffer, 0, 0, t);
}
