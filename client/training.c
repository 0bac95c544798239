/* training.c — a rank's training requests besides the collectives: the
 * optimizer step and the gradient norm, optimizer state read and written,
 * the fp32 master seeded, a view's requires-grad. */
#include <inttypes.h>
#include <math.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include "client_int.h"

shardd_err shardd_seed_master(shardd_client_t *c, uint64_t buffer) {
  if (c == NULL)
    return SHARDD_E_INVAL; /* no client to hold a message */
  Shardwire__Request req = SHARDWIRE__REQUEST__INIT;
  Shardwire__SeedMaster sm = SHARDWIRE__SEED_MASTER__INIT;
  sm.buffer = buffer;
  req.body_case = SHARDWIRE__REQUEST__BODY_SEED_MASTER;
  req.seed_master = &sm;
  return shardd__call_status_only(c, &req);
}

/* One OptimState request; resp kept for the caller when out_resp. */
static shardd_err optim_state_req(shardd_client_t *c, Shardwire__OptimState *os,
                                  Shardwire__Response **out_resp) {
  Shardwire__Request req = SHARDWIRE__REQUEST__INIT;
  req.body_case = SHARDWIRE__REQUEST__BODY_OPTIM_STATE;
  req.optim_state = os;
  Shardwire__Response *resp;
  shardd_err rc = shardd__call_expect(
      c, &req, SHARDWIRE__RESPONSE__BODY_OPTIM_STATE, &resp, NULL);
  if (rc == SHARDD_OK && out_resp) {
    *out_resp = resp;
    return rc;
  }
  if (resp)
    shardwire__response__free_unpacked(resp, NULL);
  return rc;
}

/* the master is its own field on the wire, not an array index */
static void set_array(Shardwire__OptimState *os, uint32_t array) {
  if (array == SHARDD_OPTIM_MASTER) {
    os->has_master = 1;
    os->master = 1;
  } else {
    os->has_array = 1;
    os->array = array;
  }
}

#define OPTIM_STATE_CHUNK ((uint64_t)1 << 20) /* the daemon's per-request limit */

shardd_err shardd_optim_state_get(shardd_client_t *c, uint64_t opt, uint64_t ref,
                                  uint32_t array, uint64_t offset, uint64_t count,
                                  float *out, shardd_optim_state_info *info) {
  if (c == NULL)
    return SHARDD_E_INVAL; /* no client to hold a message */
  if (count > 0 && out == NULL)
    return shardd__set_err(c, SHARDD_E_INVAL,
                           "shardd_optim_state_get: out is NULL");
  uint64_t done = 0;
  do {
    uint64_t n = count - done < OPTIM_STATE_CHUNK ? count - done : OPTIM_STATE_CHUNK;
    Shardwire__OptimState os = SHARDWIRE__OPTIM_STATE__INIT;
    os.optimizer = opt;
    os.ref = ref;
    set_array(&os, array);
    os.has_offset = 1;
    os.offset = offset + done;
    os.has_count = 1;
    os.count = n;
    Shardwire__Response *resp = NULL;
    shardd_err rc = optim_state_req(c, &os, &resp);
    if (rc != SHARDD_OK)
      return rc;
    const Shardwire__OptimStateReply *r = resp->optim_state;
    if (n > 0 && (!r->has_data || r->data.len != n * 4)) {
      shardwire__response__free_unpacked(resp, NULL);
      return shardd__set_err(c, SHARDD_E_PROTOCOL,
                             "optimizer state: %zu bytes came back "
                             "for %" PRIu64 " elements",
                             r->has_data ? r->data.len : 0, n);
    }
    if (n > 0)
      memcpy(out + done, r->data.data, n * 4);
    if (info) {
      info->nstate = r->nstate;
      info->numel = r->numel;
      info->steps = r->steps;
      info->optimizer_steps = r->optimizer_steps;
    }
    shardwire__response__free_unpacked(resp, NULL);
    done += n;
  } while (done < count);
  return SHARDD_OK;
}

shardd_err shardd_optim_state_set(shardd_client_t *c, uint64_t opt, uint64_t ref,
                                  uint32_t array, uint64_t offset, uint64_t count,
                                  const float *in) {
  if (c == NULL)
    return SHARDD_E_INVAL; /* no client to hold a message */
  if (count > 0 && in == NULL)
    return shardd__set_err(c, SHARDD_E_INVAL,
                           "shardd_optim_state_set: in is NULL");
  for (uint64_t done = 0; done < count;) {
    uint64_t n = count - done < OPTIM_STATE_CHUNK ? count - done : OPTIM_STATE_CHUNK;
    Shardwire__OptimState os = SHARDWIRE__OPTIM_STATE__INIT;
    os.optimizer = opt;
    os.ref = ref;
    set_array(&os, array);
    os.has_offset = 1;
    os.offset = offset + done;
    os.has_data = 1;
    os.data.data = (uint8_t *)(in + done);
    os.data.len = n * 4;
    shardd_err rc = optim_state_req(c, &os, NULL);
    if (rc != SHARDD_OK)
      return rc;
    done += n;
  }
  return SHARDD_OK;
}

shardd_err shardd_optim_steps_set(shardd_client_t *c, uint64_t opt, uint64_t ref,
                                  uint64_t steps, uint64_t optimizer_steps) {
  if (c == NULL)
    return SHARDD_E_INVAL; /* no client to hold a message */
  Shardwire__OptimState os = SHARDWIRE__OPTIM_STATE__INIT;
  os.optimizer = opt;
  os.ref = ref;
  os.has_set_steps = 1;
  os.set_steps = steps;
  os.has_set_optimizer_steps = 1;
  os.set_optimizer_steps = optimizer_steps;
  return optim_state_req(c, &os, NULL);
}

shardd_err shardd_view_set_requires_grad(shardd_client_t *c, uint64_t view,
                                         int requires_grad) {
  if (c == NULL)
    return SHARDD_E_INVAL; /* no client to hold a message */

  Shardwire__Request req = SHARDWIRE__REQUEST__INIT;
  Shardwire__SetRequiresGrad sr = SHARDWIRE__SET_REQUIRES_GRAD__INIT;
  sr.view = view;
  sr.requires_grad = requires_grad != 0;
  req.body_case = SHARDWIRE__REQUEST__BODY_SET_REQUIRES_GRAD;
  req.set_requires_grad = &sr;
  return shardd__call_status_only(c, &req);
}

/* One Step round trip (a step, or a norm-only one); out (may be NULL)
 * gets the count and the norm the reply carries. */
static shardd_err step_call(shardd_client_t *c, Shardwire__Step *st,
                            shardd_step_result *out, int *skipped) {
  Shardwire__Request req = SHARDWIRE__REQUEST__INIT;
  req.body_case = SHARDWIRE__REQUEST__BODY_STEP;
  req.step = st;
  Shardwire__Response *resp;
  shardd_err rc =
      shardd__call_expect(c, &req, SHARDWIRE__RESPONSE__BODY_STEP, &resp, NULL);
  if (rc == SHARDD_OK && out) {
    out->step = resp->step->step;
    out->total_norm = resp->step->has_total_norm ? resp->step->total_norm : 0;
  }
  if (rc == SHARDD_OK && skipped)
    *skipped = resp->step->has_applied && !resp->step->applied;
  if (resp)
    shardwire__response__free_unpacked(resp, NULL);
  return rc;
}

shardd_err shardd_step(shardd_client_t *c, uint64_t opt,
                       const shardd_step_opts *opts, shardd_step_result *out) {
  if (c == NULL)
    return SHARDD_E_INVAL; /* no client to hold a message */

  if (out)
    memset(out, 0, sizeof *out);
  Shardwire__Step st = SHARDWIRE__STEP__INIT;
  st.optimizer = opt;
  if (opts && opts->lr >= 0) {
    st.has_lr = 1;
    st.lr = opts->lr;
  }
  if (opts && opts->max_norm > 0) {
    st.has_max_norm = 1;
    st.max_norm = opts->max_norm;
  }
  Shardwire__HyperParams *hw = NULL, **hp = NULL;
  size_t ng = opts && opts->size >= offsetof(shardd_step_opts, ngroups) +
                                        sizeof opts->ngroups
                  ? opts->ngroups
                  : 0;
  if (ng > 0) {
    if (opts->groups == NULL)
      return shardd__set_err(c, SHARDD_E_INVAL,
                             "shardd_step: ngroups %zu with groups NULL", ng);
    hw = calloc(ng, sizeof *hw);
    hp = calloc(ng, sizeof *hp);
    if (hw == NULL || hp == NULL) {
      free(hw);
      free(hp);
      return shardd__set_err(c, SHARDD_E_NO_MEMORY, "out of memory");
    }
    for (size_t g = 0; g < ng; g++) {
      shardd__hp_to_wire(&opts->groups[g], &hw[g]);
      hp[g] = &hw[g];
    }
    st.n_groups = ng;
    st.groups = hp;
  }
  int *skipped = NULL;
  if (opts && opts->size >= offsetof(shardd_step_opts, skipped) + sizeof opts->skipped) {
    if (opts->expect_step > 0) {
      st.has_expect_step = 1;
      st.expect_step = opts->expect_step;
    }
    skipped = opts->skipped;
    if (skipped)
      *skipped = 0;
  }
  shardd_err rc = step_call(c, &st, out, skipped);
  free(hw);
  free(hp);
  return rc;
}

shardd_err shardd_clip_grad_norm(shardd_client_t *c, uint64_t opt,
                                 double max_norm, double *total_norm) {
  if (c == NULL)
    return SHARDD_E_INVAL; /* no client to hold a message */
  if (total_norm)
    *total_norm = 0;
  if (!(max_norm >= 0))
    return shardd__set_err(c, SHARDD_E_RANGE,
                           "shardd_clip_grad_norm: max_norm %g must "
                           "be >= 0 (0 or inf: the norm only)",
                           max_norm);
  Shardwire__Step st = SHARDWIRE__STEP__INIT;
  st.optimizer = opt;
  st.has_norm_only = 1;
  st.norm_only = 1;
  if (max_norm > 0 && isfinite(max_norm)) {
    st.has_max_norm = 1;
    st.max_norm = max_norm;
  }
  shardd_step_result res;
  shardd_err rc = step_call(c, &st, &res, NULL);
  if (rc == SHARDD_OK && total_norm)
    *total_norm = res.total_norm;
  return rc;
}
