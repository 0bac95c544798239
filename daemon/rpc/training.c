/* training.c — a rank's training requests, each submitted to the
 * collective engine (gather, scatter, step, the scalar all-reduce) or run
 * on its job's state (seeding master weights, optimizer state, requires
 * grad); the engine's done hook answers the collectives (see
 * dispatch_int.h). */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dispatch_int.h"
#include "log.h"
#include "optcodec.h"

void shardd__on_gather(shardd__dispatch *d, shardd__conn *c, uint64_t seq,
                       const Shardwire__Request *req) {
  shardd__coll_args ca = {.kind = SHARDD__COLL_GATHER,
                          .target = req->gather->buffer,
                          .generation = req->gather->generation,
                          .want_grad = req->gather->has_want_grad &&
                                       req->gather->want_grad};
  shardd__coll_submit(d->coll, &c->m, seq, &ca);
}

void shardd__on_scatter(shardd__dispatch *d, shardd__conn *c, uint64_t seq,
                        const Shardwire__Request *req) {
  shardd__coll_args ca = {.kind = SHARDD__COLL_SCATTER,
                          .target = req->scatter->buffer,
                          .generation = req->scatter->generation,
                          .op = (shardd_reduce_op)req->scatter->op,
                          .accumulate = req->scatter->has_accumulate &&
                                        req->scatter->accumulate,
                          .no_grad = req->scatter->no_grad,
                          .nno_grad = req->scatter->n_no_grad,
                          .no_grad_all = req->scatter->has_no_grad_all &&
                                         req->scatter->no_grad_all};
  if (ca.op != SHARDD_REDUCE_SUM && ca.op != SHARDD_REDUCE_MEAN) {
    shardd__reply(d, c, seq, SHARDD_E_INVAL, "scatter op must be sum or mean");
    return;
  }
  shardd__coll_submit(d->coll, &c->m, seq, &ca);
}

/* A step sent with the count it produces (Step.expect_step) that the
 * optimizer has reached already: the retry of a step whose reply was lost
 * (the daemon stopped, the connection broke). Answered here, alone, with
 * the count now and nothing run; every rank's retry is answered the same,
 * as no step can have run in between (a step needs every rank). -> 1 when
 * answered (a skip, or a count the trainer is ahead of: E_MISMATCH). */
static int step_answered(shardd__dispatch *d, shardd__conn *c, uint64_t seq,
                         const Shardwire__Step *st) {
  if (!st->has_expect_step || st->expect_step == 0 ||
      (st->has_norm_only && st->norm_only))
    return 0;
  char err[ERRLEN];
  shardd__obj *o;
  if (shardd__registry_resolve(&d->reg, c->m.job, st->optimizer, SHARDD__OBJ_OPTIM,
                               &o, err, sizeof err) != SHARDD_OK)
    return 0; /* the engine refuses it with its own words */
  uint64_t now = ((const shardd__optim *)o)->steps;
  if (now + 1 < st->expect_step) {
    snprintf(err, sizeof err, "step: optimizer %" PRIu64 " is at step %" PRIu64
             ", so this step would make %" PRIu64 ", not the %" PRIu64
             " expected (restored from an older checkpoint?)", st->optimizer,
             now, now + 1, st->expect_step);
    shardd__reply(d, c, seq, SHARDD_E_MISMATCH, err);
    return 1;
  }
  if (now < st->expect_step)
    return 0; /* this is the step that makes it */
  Shardwire__Response resp = ok_resp(seq, SHARDWIRE__RESPONSE__BODY_STEP);
  Shardwire__StepReply sr = SHARDWIRE__STEP_REPLY__INIT;
  sr.step = now;
  sr.has_applied = 1;
  sr.applied = 0;
  resp.step = &sr;
  shardd__send_resp(d, c, &resp, -1);
  return 1;
}

void shardd__on_step(shardd__dispatch *d, shardd__conn *c, uint64_t seq,
                     const Shardwire__Request *req) {
  const Shardwire__Step *st = req->step;
  if (step_answered(d, c, seq, st))
    return;
  if (!(st->has_norm_only && st->norm_only)) /* it changes the state */
    shardd__jobs_advancing(&d->jobs, c->m.job);
  shardd__coll_args ca = {.kind = SHARDD__COLL_STEP,
                          .target = st->optimizer,
                          .has_lr = st->has_lr,
                          .lr = st->lr,
                          .max_norm = st->has_max_norm ? st->max_norm : 0,
                          .norm_only = st->has_norm_only && st->norm_only};
  shardd__optspec_hp *ghp = NULL;
  if (st->n_groups > 0) {
    if ((ghp = calloc(st->n_groups, sizeof *ghp)) == NULL) {
      shardd__reply(d, c, seq, SHARDD_E_NO_MEMORY, "out of memory");
      return;
    }
    for (size_t g = 0; g < st->n_groups; g++)
      shardd__optspec_hp_from_wire(st->groups[g], &ghp[g]);
    ca.group_hp = ghp;
    ca.ngroup_hp = st->n_groups;
  }
  shardd__coll_submit(d->coll, &c->m, seq, &ca);
  free(ghp);
}

void shardd__on_seed_master(shardd__dispatch *d, shardd__conn *c, uint64_t seq,
                            const Shardwire__Request *req) {
  char err[ERRLEN];
  shardd__obj *o;
  shardd_err rc = shardd__registry_resolve(&d->reg, c->m.job,
                                           req->seed_master->buffer,
                                           SHARDD__OBJ_BUFFER, &o, err, sizeof err);
  if (rc == SHARDD_OK)
    rc = shardd__buffer_seed(&d->reg, (shardd__buffer *)o, c->m.rank, err,
                             sizeof err);
  shardd__reply(d, c, seq, rc, rc == SHARDD_OK ? NULL : err);
}

/* at most this many elements per OptimState (4 MiB of data) */
#define OPTIM_STATE_MAX ((uint64_t)1 << 20)

void shardd__on_optim_state(shardd__dispatch *d, shardd__conn *c, uint64_t seq,
                            const Shardwire__Request *req) {
  const Shardwire__OptimState *os = req->optim_state;
  char err[ERRLEN];
  shardd__obj *o;
  shardd_err rc = shardd__registry_resolve(&d->reg, c->m.job, os->optimizer,
                                           SHARDD__OBJ_OPTIM, &o, err, sizeof err);
  if (rc != SHARDD_OK) {
    shardd__reply(d, c, seq, rc, err);
    return;
  }
  int write = os->has_data;
  uint64_t count = write ? os->data.len / 4 : (os->has_count ? os->count : 0);
  if ((write && os->data.len % 4 != 0) || count > OPTIM_STATE_MAX) {
    snprintf(err, sizeof err, "optimizer state: %" PRIu64 " elements per request "
             "at most, whole fp32", OPTIM_STATE_MAX);
    shardd__reply(d, c, seq, SHARDD_E_RANGE, err);
    return;
  }
  float *io = write ? (float *)os->data.data : NULL;
  float *mine = NULL;
  if (!write && count > 0 && (io = mine = malloc(count * 4)) == NULL) {
    shardd__reply(d, c, seq, SHARDD_E_NO_MEMORY, "out of memory");
    return;
  }
  /* the wire's bytes carry no alignment: copied where it matters */
  if (write && count > 0 && ((uintptr_t)io % _Alignof(float)) != 0) {
    if ((mine = malloc(count * 4)) == NULL) {
      shardd__reply(d, c, seq, SHARDD_E_NO_MEMORY, "out of memory");
      return;
    }
    memcpy(mine, os->data.data, count * 4);
    io = mine;
  }
  uint32_t nstate = 0;
  uint64_t numel = 0, *steps = NULL;
  shardd__optim *opt = (shardd__optim *)o;
  uint32_t array = os->has_array ? os->array : 0;
  if (os->has_master && os->master)
    array = SHARDD__OPTIM_MASTER;
  else if (array == SHARDD__OPTIM_MASTER)
    array = UINT32_MAX - 1; /* out of range, not the master by accident */
  rc = shardd__optim_state_io(&d->reg, opt, os->ref, array,
                              os->has_offset ? os->offset : 0, count, io, write,
                              &nstate, &numel, &steps, err, sizeof err);
  if (rc == SHARDD_OK && steps == NULL &&
      (os->has_set_steps || os->has_set_optimizer_steps)) {
    snprintf(err, sizeof err, "optimizer \"%s\" holds no parameter %" PRIu64,
             opt->hdr.name, os->ref);
    rc = SHARDD_E_NOT_FOUND;
  }
  if (rc == SHARDD_OK && os->has_set_steps)
    *steps = os->set_steps;
  if (rc == SHARDD_OK && os->has_set_optimizer_steps)
    opt->steps = os->set_optimizer_steps;
  if (rc != SHARDD_OK) {
    free(mine);
    shardd__reply(d, c, seq, rc, err);
    return;
  }
  Shardwire__Response resp = ok_resp(seq, SHARDWIRE__RESPONSE__BODY_OPTIM_STATE);
  Shardwire__OptimStateReply sr = SHARDWIRE__OPTIM_STATE_REPLY__INIT;
  sr.nstate = nstate;
  sr.steps = steps != NULL ? *steps : 0;
  sr.numel = numel;
  sr.optimizer_steps = opt->steps;
  if (!write && count > 0) {
    sr.has_data = 1;
    sr.data.data = (uint8_t *)io;
    sr.data.len = count * 4;
  }
  resp.optim_state = &sr;
  shardd__send_resp(d, c, &resp, -1);
  free(mine);
}

void shardd__on_all_reduce(shardd__dispatch *d, shardd__conn *c, uint64_t seq,
                           const Shardwire__Request *req) {
  const Shardwire__AllReduce *ar = req->all_reduce;
  shardd__coll_args ca = {.kind = SHARDD__COLL_ALL_REDUCE,
                          .target = ar->n_values,
                          .op = ar->has_op ? (shardd_reduce_op)ar->op : SHARDD_REDUCE_SUM,
                          .values = ar->values};
  if (ca.op != SHARDD_REDUCE_SUM && ca.op != SHARDD_REDUCE_MEAN &&
      ca.op != SHARDD_REDUCE_MAX && ca.op != SHARDD_REDUCE_MIN) {
    shardd__reply(d, c, seq, SHARDD_E_INVAL, "all_reduce op must be sum, mean, max or min");
    return;
  }
  shardd__coll_submit(d->coll, &c->m, seq, &ca);
}

void shardd__on_set_requires_grad(shardd__dispatch *d, shardd__conn *c,
                                  uint64_t seq, const Shardwire__Request *req) {
  char err[ERRLEN];
  const Shardwire__SetRequiresGrad *sr = req->set_requires_grad;
  shardd_err rc = shardd__view_set_requires_grad(
      &d->reg, c->m.job, sr->view, sr->has_generation ? sr->generation : 0,
      sr->requires_grad, err, sizeof err);
  shardd__reply(d, c, seq, rc, rc == SHARDD_OK ? NULL : err);
}
