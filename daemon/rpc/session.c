/* session.c — a session's own requests: Hello (claiming a job's rank),
 * Goodbye, Ping; the reports (Status, Inspect, built by status.c); and
 * releasing jobs (see dispatch_int.h). */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dispatch_int.h"
#include "log.h"
#include "status.h"

/* Whether job holds trained or restored state (a buffer a step ran on or
 * a restore made), which a rank joining it resumes; *step: the most steps
 * one of its optimizers took. A fresh launch's ranks all connect before
 * any step can run, so they are never told they resume. */
static int job_resumed(shardd__job *job, uint64_t *step) {
  *step = 0;
  shardd__buffer **bufs;
  shardd__optim **opts;
  size_t nb, no;
  int settled = 0;
  if (shardd__job_buffers(job, &bufs, &nb) == SHARDD_OK) {
    for (size_t i = 0; i < nb && !settled; i++)
      settled = bufs[i]->settled;
    free(bufs);
  }
  if (settled && shardd__job_optims(job, &opts, &no) == SHARDD_OK) {
    for (size_t i = 0; i < no; i++)
      if (opts[i]->steps > *step)
        *step = opts[i]->steps;
    free(opts);
  }
  return settled;
}


/* The uid and name a job is named by: the peer's own, or for root
 * "UID/NAME" another uid's. name points into job. */
static uint32_t named_uid(const shardd__conn *c, const char *job,
                          const char **name) {
  const char *slash = strchr(job, '/');
  *name = job;
  if (c->peer.uid == 0 && slash && slash > job &&
      strspn(job, "0123456789") == (size_t)(slash - job)) {
    *name = slash + 1;
    return (uint32_t)strtoul(job, NULL, 10);
  }
  return (uint32_t)c->peer.uid;
}

/* A job the fd store held torn at start (the daemon died inside one of
 * its steps): no rank attaches to it, and the refusal names the step and
 * the checkpoint to restore. 1 when refused. */
static int torn_refused(shardd__dispatch *d, shardd__conn *c, uint64_t seq,
                        const char *job) {
  char msg[ERRLEN];
  const char *name;
  uint32_t uid = named_uid(c, job, &name);
  if (d->fdstore == NULL || shardd__job_find(&d->reg, uid, name) != NULL ||
      !shardd__fdstore_torn(d->fdstore, uid, name, msg, sizeof msg))
    return 0;
  shardd__reply(d, c, seq, SHARDD_E_STATE, msg);
  return 1;
}

void shardd__on_hello(shardd__dispatch *d, shardd__conn *c, uint64_t seq,
                      const Shardwire__Request *req) {
  const Shardwire__Hello *h = req->hello;
  char err[ERRLEN];
  if (c->hello_done) {
    shardd__reply(d, c, seq, SHARDD_E_STATE, "Hello was already sent");
    return;
  }
  if (h->protocol_version != SHARDD_PROTOCOL_VERSION) {
    snprintf(err, sizeof err, "client speaks protocol %" PRIu32
             ", this daemon speaks %d", h->protocol_version,
             SHARDD_PROTOCOL_VERSION);
    shardd__reply(d, c, seq, SHARDD_E_VERSION, err);
    return;
  }
  int reclaimed = 0;
  if (h->job && h->job[0] && torn_refused(d, c, seq, h->job))
    return;
  if (h->job && h->job[0]) {
  again:;
    /* The peer's own job of that name, made when missing: another uid's
     * job of the same name is another job. Only root joins another's, by
     * naming it "UID/NAME". */
    shardd__job *job = shardd__access_find_job(&d->reg, &c->peer, h->job);
    shardd_err rc;
    if (job && (rc = shardd__access_join(&c->peer, job, err, sizeof err)) !=
                   SHARDD_OK) {
      shardd__reply(d, c, seq, rc, err);
      return;
    }
    if (job && shardd__jobs_restoring(&d->jobs, job)) {
      /* its payloads are still loading on the pool */
      snprintf(err, sizeof err, "job \"%s\" is being restored", job->name);
      shardd__reply(d, c, seq, SHARDD_E_BUSY, err);
      return;
    }
    uint32_t world = h->has_world ? h->world : 1;
    rc = shardd__job_get(&d->reg, job ? job->name : h->job, world,
                         job ? job->uid : c->peer.uid, &job, err, sizeof err);
    if (rc != SHARDD_OK) {
      shardd__reply(d, c, seq, rc, err);
      return;
    }
    uint32_t rank = h->has_rank ? h->rank : 0;
    /* --job-spec: a multi-node job holds its node's ranks only */
    rc = shardd__jobs_layout(&d->jobs, job, rank, err, sizeof err);
    if (rc == SHARDD_OK && rank >= job->world) {
      snprintf(err, sizeof err, "rank %" PRIu32 " is outside world %" PRIu32,
               rank, job->world);
      rc = SHARDD_E_RANGE;
    }
    if (rc == SHARDD_OK)
      rc = shardd__job_set_transient(job, h->has_transient_areas && h->transient_areas,
                                     err, sizeof err);
    int32_t holder = 0;
    int claim_failed = rc == SHARDD_OK &&
                       (rc = shardd__jobs_claim(&d->jobs, job, rank, c->id,
                                                (int32_t)c->peer.pid, &holder)) !=
                           SHARDD_OK;
    /* A trainer that closes and reconnects at once can be here before the
     * transport has read its old connection's end (that session is not
     * being read: its frames wait their turn, its replies or the frame
     * budget hold it back, or a failed reply closes it next turn). The old
     * holder is closed now when its client is gone, and the Hello is
     * taken again from the top: that close may have released the job. */
    if (claim_failed && rc == SHARDD_E_STATE && !reclaimed && d->io.reclaim &&
        d->io.reclaim(d->io.ctx, shardd__jobs_holder(&d->jobs, job, rank))) {
      reclaimed = 1;
      goto again;
    }
    if (claim_failed) {
      if (rc == SHARDD_E_STATE)
        snprintf(err, sizeof err,
                 "rank %" PRIu32 " of job \"%s\" is already connected (pid %d)",
                 rank, job->name, (int)holder);
      else
        snprintf(err, sizeof err, "out of memory");
    }
    if (rc != SHARDD_OK) {
      shardd__reply(d, c, seq, rc, err);
      shardd__jobs_unclaimed(&d->jobs, job, now_s(d), 1);
      return;
    }
    c->m.job = job;
    c->m.rank = rank;
    shardd__coll_member_joined(d->coll, &c->m);
    shardd__log(2,
                "session %" PRIu64 ": rank %" PRIu32 "/%" PRIu32
                " of job \"%s\" (pid %d uid %d)",
                c->id, rank, job->world, job->name, (int)c->peer.pid,
                (int)c->peer.uid);
  }
  c->hello_done = 1;
  c->at_offsets = h->has_blocks_at_offsets && h->blocks_at_offsets;
  Shardwire__Response resp = ok_resp(seq, SHARDWIRE__RESPONSE__BODY_HELLO);
  Shardwire__HelloReply hr = SHARDWIRE__HELLO_REPLY__INIT;
  if (c->m.job && job_resumed(c->m.job, &hr.resumed_step)) {
    hr.has_resumed = hr.has_resumed_step = hr.resumed = 1;
    shardd__log(2, "session %" PRIu64 ": rank %" PRIu32 " resumes job \"%s\" "
                "at step %" PRIu64, c->id, c->m.rank, c->m.job->name,
                hr.resumed_step);
  }
  hr.protocol_version = SHARDD_PROTOCOL_VERSION;
  hr.daemon_version = SHARDD_VERSION;
  hr.session_id = c->id;
  hr.backend = (char *)d->backend->name;
  hr.devices = (uint32_t)d->backend->ndevices;
  hr.has_max_pending = 1;
  hr.max_pending = d->opts.max_pending;
  resp.hello = &hr;
  shardd__send_resp(d, c, &resp, -1);
}

/* The rank is finished: its close will be a clean one (jobs_leave). */
void shardd__on_goodbye(shardd__dispatch *d, shardd__conn *c, uint64_t seq,
                        const Shardwire__Request *req) {
  c->bye = 1;
  shardd__reply(d, c, seq, SHARDD_OK, NULL);
}

static shardd__status_ctx status_ctx(shardd__dispatch *d) {
  shardd__status_ctx ctx = {&d->reg, d->coll, &d->jobs, now_s(d) - d->started,
                            d->socket_path, d->io.clients(d->io.ctx),
                            d->io.partial_bytes(d->io.ctx), shardd__ckpt_pending, d,
                            0, 0, 0};
  if (d->io.unread_replies) {
    ctx.has_unread_replies = 1;
    d->io.unread_replies(d->io.ctx, &ctx.unread_reply_bytes, &ctx.unread_reply_fds);
  }
  return ctx;
}

void shardd__on_status(shardd__dispatch *d, shardd__conn *c, uint64_t seq,
                       const Shardwire__Request *req) {
  shardd__report *r;
  Shardwire__StatusReply *st;
  shardd__status_ctx ctx = status_ctx(d);
  const Shardwire__StatusRequest *sr = req->status;
  uint32_t first = sr && sr->has_first_job ? sr->first_job : 0;
  shardd_err rc = shardd__status_build(&ctx, &c->peer, first, &r, &st);
  if (rc != SHARDD_OK) {
    shardd__reply(d, c, seq, rc, "out of memory building status");
  } else {
    Shardwire__Response resp = ok_resp(seq, SHARDWIRE__RESPONSE__BODY_STATUS);
    resp.status = st;
    shardd__send_resp(d, c, &resp, -1);
  }
  shardd__report_free(r);
}

void shardd__on_inspect(shardd__dispatch *d, shardd__conn *c, uint64_t seq,
                        const Shardwire__Request *req) {
  const Shardwire__Inspect *in = req->inspect;
  char err[ERRLEN];
  shardd__report *r;
  Shardwire__InspectReply *ir;
  shardd__status_ctx ctx = status_ctx(d);
  shardd_err rc = shardd__inspect_build(&ctx, &c->peer, c->m.job,
                                        in->has_id ? in->id : 0, in->name, &r,
                                        &ir, err, sizeof err);
  if (rc != SHARDD_OK) {
    shardd__reply(d, c, seq, rc, err);
  } else {
    Shardwire__Response resp = ok_resp(seq, SHARDWIRE__RESPONSE__BODY_INSPECT);
    resp.inspect = ir;
    shardd__send_resp(d, c, &resp, -1);
  }
  shardd__report_free(r);
}

void shardd__on_ping(shardd__dispatch *d, shardd__conn *c, uint64_t seq,
                     const Shardwire__Request *req) {
  const Shardwire__Ping *p = req->ping;
  Shardwire__Response resp = ok_resp(seq, SHARDWIRE__RESPONSE__BODY_PONG);
  Shardwire__Pong pong = SHARDWIRE__PONG__INIT;
  if (p->has_payload) {
    pong.has_payload = 1;
    pong.payload = p->payload;
  }
  resp.pong = &pong;
  shardd__send_resp(d, c, &resp, -1);
}

void shardd__on_release(shardd__dispatch *d, shardd__conn *c, uint64_t seq,
                        const Shardwire__Request *req) {
  char err[ERRLEN];
  shardd__obj *o;
  shardd_err rc = shardd__registry_resolve(&d->reg, c->m.job,
                                           req->release->buffer,
                                           SHARDD__OBJ_BUFFER, &o, err, sizeof err);
  shardd__buffer *b = (shardd__buffer *)o;
  int grad = req->release->has_grad && req->release->grad;
  int scattering = 0;
  if (rc == SHARDD_OK && !c->m.job->transient) {
    snprintf(err, sizeof err, "job \"%s\" has resident areas: nothing to "
             "release", c->m.job->name);
    rc = SHARDD_E_STATE;
  } else if (rc == SHARDD_OK && !shardd__area_held(b, c->m.rank,
                                                   SHARDD__AREA_GATHER, NULL) &&
             !(grad && shardd__area_held(b, c->m.rank, SHARDD__AREA_GRAD, NULL))) {
    snprintf(err, sizeof err, "rank %" PRIu32 " holds no gather area of buffer "
             "%" PRIu64 " (\"%s\")", c->m.rank, b->hdr.id, b->hdr.name);
    rc = SHARDD_E_STATE;
  } else if (rc == SHARDD_OK && shardd__coll_gathering(d->coll, b)) {
    /* a running gather writes into the area being given back (a queued
     * one is fine: it leases again when it starts) */
    snprintf(err, sizeof err, "buffer %" PRIu64 " (\"%s\") is being gathered; "
             "release it after the gather ends", b->hdr.id, b->hdr.name);
    rc = SHARDD_E_BUSY;
  } else if (rc == SHARDD_OK && grad &&
             (scattering = shardd__coll_scattering(d->coll, b, c->m.rank))) {
    /* the scatter reads this gradient area (a queued one when it starts):
     * given back now, another lease could take the slot and write into the
     * sum. Refused like a release under a gather, not deferred: a client
     * that sends it before its scatter's answer made a mistake */
    snprintf(err, sizeof err, "rank %" PRIu32 "'s scatter of buffer %" PRIu64
             " (\"%s\") is %s and reads its gradient area; release it after "
             "the scatter ends", c->m.rank, b->hdr.id, b->hdr.name,
             scattering == 2 ? "running" : "queued");
    rc = SHARDD_E_BUSY;
  }
  if (rc == SHARDD_OK) {
    shardd__area_return(b, c->m.rank, SHARDD__AREA_GATHER);
    if (grad)
      shardd__area_return(b, c->m.rank, SHARDD__AREA_GRAD);
  }
  shardd__reply(d, c, seq, rc, rc == SHARDD_OK ? NULL : err);
}

/* `shardctl release JOB`: the job's memory is freed now, so a restore
 * into its name can follow. Refused while a rank is connected: failing a
 * live trainer's collectives and pulling its mappings is not an operator
 * convenience (stop the trainers, then release). */
void shardd__on_release_job(shardd__dispatch *d, shardd__conn *c, uint64_t seq,
                            const Shardwire__Request *req) {
  const char *name = req->release_job->job;
  char err[ERRLEN];
  shardd__job *job = shardd__access_find_job(&d->reg, &c->peer, name);
  const char *torn_name;
  uint32_t torn_uid = name ? named_uid(c, name, &torn_name) : 0;
  if (job == NULL && name &&
      shardd__fdstore_forget_torn(d->fdstore, torn_uid, torn_name)) {
    /* a torn job held nothing but its memory in the store, gone now */
    Shardwire__ReleaseJobReply rr = SHARDWIRE__RELEASE_JOB_REPLY__INIT;
    rr.job = (char *)name;
    Shardwire__Response resp =
        ok_resp(seq, SHARDWIRE__RESPONSE__BODY_RELEASE_JOB);
    resp.release_job = &rr;
    shardd__send_resp(d, c, &resp, -1);
    return;
  }
  if (job == NULL) {
    snprintf(err, sizeof err, "no job \"%s\"", name ? name : "");
    shardd__reply(d, c, seq, SHARDD_E_NOT_FOUND, err);
    return;
  }
  shardd_err rc = shardd__access_release(&c->peer, job, err, sizeof err);
  if (rc != SHARDD_OK) {
    shardd__reply(d, c, seq, rc, err);
    return;
  }
  /* collective checkpoints some ranks asked for before all left go with
   * the job (shardd__ckpt_collective_released) */
  char qualified[300];
  if (job->uid != c->peer.uid)
    snprintf(qualified, sizeof qualified, "%" PRIu32 "/%s", job->uid, job->name);
  else
    snprintf(qualified, sizeof qualified, "%s", job->name);
  char jobname[256];
  snprintf(jobname, sizeof jobname, "%s", job->name);
  Shardwire__ReleaseJobReply rr = SHARDWIRE__RELEASE_JOB_REPLY__INIT;
  rr.job = qualified;
  rr.buffers = (uint32_t)shardd__map_count(&job->buffers);
  rr.optimizers = (uint32_t)shardd__map_count(&job->optims);
  rc = shardd__jobs_release_now(&d->jobs, job, err, sizeof err);
  if (rc != SHARDD_OK) {
    shardd__reply(d, c, seq, rc, err);
    return;
  }
  shardd__log(2, "job \"%s\" released by uid %" PRIu32 " (%" PRIu32 " buffers, %"
              PRIu32 " optimizers)", jobname, (uint32_t)c->peer.uid, rr.buffers,
              rr.optimizers);
  Shardwire__Response resp = ok_resp(seq, SHARDWIRE__RESPONSE__BODY_RELEASE_JOB);
  resp.release_job = &rr;
  shardd__send_resp(d, c, &resp, -1);
}
