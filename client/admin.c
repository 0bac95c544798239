/* admin.c — the requests of operators and of a job as a whole: Status and
 * Inspect (formatted by fmt.c), checkpoints, restore, release of a job. */
#include <stdio.h>
#include <string.h>

#include "client_int.h"
#include "fmt.h"

static shardd_err get_status(shardd_client_t *c, uint32_t first_job,
                             Shardwire__Response **resp) {
  Shardwire__Request req = SHARDWIRE__REQUEST__INIT;
  Shardwire__StatusRequest st = SHARDWIRE__STATUS_REQUEST__INIT;
  if (first_job > 0) {
    st.has_first_job = 1;
    st.first_job = first_job;
  }
  req.body_case = SHARDWIRE__REQUEST__BODY_STATUS;
  req.status = &st;
  return shardd__call_expect(c, &req, SHARDWIRE__RESPONSE__BODY_STATUS, resp,
                             NULL);
}

static shardd_err status_fmt(shardd_client_t *c, uint32_t first_job,
                             char **out, int json) {
  *out = NULL;
  Shardwire__Response *resp;
  shardd_err rc = get_status(c, first_job, &resp);
  if (rc == SHARDD_OK) {
    *out = json ? shardd__fmt_status_json(resp->status)
                : shardd__fmt_status_text(resp->status);
    if (*out == NULL)
      rc = shardd__set_err(c, SHARDD_E_NO_MEMORY,
                           "out of memory formatting status");
  }
  if (resp)
    shardwire__response__free_unpacked(resp, NULL);
  return rc;
}

shardd_err shardd_status_json(shardd_client_t *c, char **out) {
  if (c == NULL)
    return SHARDD_E_INVAL; /* no client to hold a message */
  if (out == NULL)
    return shardd__set_err(c, SHARDD_E_INVAL,
                           "shardd_status_json: out is NULL");

  return status_fmt(c, 0, out, 1);
}

shardd_err shardd_status_json_from(shardd_client_t *c, uint32_t first_job,
                                   char **out) {
  if (c == NULL)
    return SHARDD_E_INVAL; /* no client to hold a message */
  if (out == NULL)
    return shardd__set_err(c, SHARDD_E_INVAL,
                           "shardd_status_json_from: out is NULL");
  return status_fmt(c, first_job, out, 1);
}

shardd_err shardd_status_text_from(shardd_client_t *c, uint32_t first_job,
                                   char **out) {
  if (c == NULL)
    return SHARDD_E_INVAL; /* no client to hold a message */
  if (out == NULL)
    return shardd__set_err(c, SHARDD_E_INVAL,
                           "shardd_status_text_from: out is NULL");
  return status_fmt(c, first_job, out, 0);
}

shardd_err shardd_status_text(shardd_client_t *c, char **out) {
  if (c == NULL)
    return SHARDD_E_INVAL; /* no client to hold a message */
  if (out == NULL)
    return shardd__set_err(c, SHARDD_E_INVAL,
                           "shardd_status_text: out is NULL");

  return status_fmt(c, 0, out, 0);
}

static shardd_err inspect_fmt(shardd_client_t *c, uint64_t id,
                              const char *name, char **out, int json) {
  *out = NULL;
  Shardwire__Request req = SHARDWIRE__REQUEST__INIT;
  Shardwire__Inspect in = SHARDWIRE__INSPECT__INIT;
  if (id) {
    in.has_id = 1;
    in.id = id;
  }
  in.name = (char *)name;
  req.body_case = SHARDWIRE__REQUEST__BODY_INSPECT;
  req.inspect = &in;
  Shardwire__Response *resp;
  shardd_err rc = shardd__call_expect(
      c, &req, SHARDWIRE__RESPONSE__BODY_INSPECT, &resp, NULL);
  if (rc == SHARDD_OK) {
    *out = json ? shardd__fmt_inspect_json(resp->inspect)
                : shardd__fmt_inspect_text(resp->inspect);
    if (*out == NULL)
      rc = shardd__set_err(c, SHARDD_E_NO_MEMORY,
                           "out of memory formatting inspect");
  }
  if (resp)
    shardwire__response__free_unpacked(resp, NULL);
  return rc;
}

shardd_err shardd_inspect_json(shardd_client_t *c, uint64_t id,
                               const char *name, char **out) {
  if (c == NULL)
    return SHARDD_E_INVAL; /* no client to hold a message */
  if (out == NULL)
    return shardd__set_err(c, SHARDD_E_INVAL,
                           "shardd_inspect_json: out is NULL");

  return inspect_fmt(c, id, name, out, 1);
}

shardd_err shardd_inspect_text(shardd_client_t *c, uint64_t id,
                               const char *name, char **out) {
  if (c == NULL)
    return SHARDD_E_INVAL; /* no client to hold a message */
  if (out == NULL)
    return shardd__set_err(c, SHARDD_E_INVAL,
                           "shardd_inspect_text: out is NULL");

  return inspect_fmt(c, id, name, out, 0);
}

static shardd_err checkpoint_req(shardd_client_t *c, const char *job,
                                 const char *dir, int collective,
                                 double wait_s) {
  if (c == NULL)
    return SHARDD_E_INVAL; /* no client to hold a message */

  if (dir == NULL || dir[0] == '\0')
    return shardd__set_err(c, SHARDD_E_INVAL, "checkpoint: no directory");
  Shardwire__Request req = SHARDWIRE__REQUEST__INIT;
  Shardwire__Checkpoint cp = SHARDWIRE__CHECKPOINT__INIT;
  cp.dir = (char *)dir;
  cp.job = (char *)job;
  if (collective) {
    cp.has_collective = 1;
    cp.collective = 1;
  }
  if (wait_s > 0) {
    cp.has_wait_s = 1;
    cp.wait_s = wait_s;
  }
  req.body_case = SHARDWIRE__REQUEST__BODY_CHECKPOINT;
  req.checkpoint = &cp;
  Shardwire__Response *resp;
  shardd_err rc = shardd__call_expect(
      c, &req, SHARDWIRE__RESPONSE__BODY_CHECKPOINT, &resp, NULL);
  if (resp)
    shardwire__response__free_unpacked(resp, NULL);
  return rc;
}

shardd_err shardd_checkpoint(shardd_client_t *c, const char *job,
                             const char *dir) {
  return checkpoint_req(c, job, dir, 0, 0);
}

shardd_err shardd_checkpoint_wait(shardd_client_t *c, const char *job,
                                  const char *dir, double timeout_s) {
  if (c == NULL)
    return SHARDD_E_INVAL;
  if (!(timeout_s >= 0 && timeout_s <= 86400))
    return shardd__set_err(c, SHARDD_E_RANGE,
                           "checkpoint: timeout must be 0..86400 s");
  return checkpoint_req(c, job, dir, 0, timeout_s);
}

shardd_err shardd_checkpoint_collective(shardd_client_t *c, const char *dir) {
  return checkpoint_req(c, NULL, dir, 1, 0);
}

shardd_err shardd_release_job(shardd_client_t *c, const char *job,
                              uint32_t *buffers, uint32_t *optimizers) {
  if (c == NULL)
    return SHARDD_E_INVAL;
  if (buffers)
    *buffers = 0;
  if (optimizers)
    *optimizers = 0;
  if (job == NULL || job[0] == '\0')
    return shardd__set_err(c, SHARDD_E_INVAL, "release: no job");
  Shardwire__Request req = SHARDWIRE__REQUEST__INIT;
  Shardwire__ReleaseJob rj = SHARDWIRE__RELEASE_JOB__INIT;
  rj.job = (char *)job;
  req.body_case = SHARDWIRE__REQUEST__BODY_RELEASE_JOB;
  req.release_job = &rj;
  Shardwire__Response *resp;
  shardd_err rc = shardd__call_expect(
      c, &req, SHARDWIRE__RESPONSE__BODY_RELEASE_JOB, &resp, NULL);
  if (rc == SHARDD_OK) {
    if (buffers)
      *buffers = resp->release_job->buffers;
    if (optimizers)
      *optimizers = resp->release_job->optimizers;
  }
  if (resp)
    shardwire__response__free_unpacked(resp, NULL);
  return rc;
}

shardd_err shardd_restore(shardd_client_t *c, const char *dir, uint32_t world,
                          char *job, size_t joblen) {
  return shardd_restore_ex(c, dir, world, job, joblen, NULL);
}

shardd_err shardd_restore_ex(shardd_client_t *c, const char *dir,
                             uint32_t world, char *job, size_t joblen,
                             uint64_t *step) {
  if (c == NULL)
    return SHARDD_E_INVAL; /* no client to hold a message */

  if (job && joblen)
    job[0] = '\0';
  if (step)
    *step = 0;
  if (dir == NULL || dir[0] == '\0')
    return shardd__set_err(c, SHARDD_E_INVAL, "restore: no directory");
  Shardwire__Request req = SHARDWIRE__REQUEST__INIT;
  Shardwire__Restore rs = SHARDWIRE__RESTORE__INIT;
  rs.dir = (char *)dir;
  if (world) {
    rs.has_world = 1;
    rs.world = world;
  }
  req.body_case = SHARDWIRE__REQUEST__BODY_RESTORE;
  req.restore = &rs;
  Shardwire__Response *resp;
  shardd_err rc = shardd__call_expect(
      c, &req, SHARDWIRE__RESPONSE__BODY_CHECKPOINT, &resp, NULL);
  if (rc == SHARDD_OK && job && joblen)
    snprintf(job, joblen, "%s", resp->checkpoint->job);
  if (rc == SHARDD_OK && step && resp->checkpoint->has_step)
    *step = resp->checkpoint->step;
  if (resp)
    shardwire__response__free_unpacked(resp, NULL);
  return rc;
}
