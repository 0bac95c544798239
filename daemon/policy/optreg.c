/* optreg.c — registering an optimizer, from a client or a checkpoint (see
 * optreg.h). */
#include "optreg.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "optcodec.h"
#include "validate.h"

shardd_err shardd__optreg_register(shardd__registry *reg, shardd__job *job,
                                   const shardd__optspec *spec, unsigned flags,
                                   shardd__optreg_result *res, char *err,
                                   size_t errlen) {
  memset(res, 0, sizeof *res);
  const char *name = spec->name && spec->name[0] ? spec->name : "default";
  uint8_t *bytes;
  size_t len;
  if (shardd__optspec_encode(spec, &bytes, &len) != SHARDD_OK) {
    snprintf(err, errlen, "out of memory");
    return SHARDD_E_NO_MEMORY;
  }

  shardd__optim *existing =
      flags & SHARDD__OPTREG_ATTACH ? shardd__optim_find(job, name) : NULL;
  if (existing) {
    int same =
        existing->spec_len == len && memcmp(existing->spec, bytes, len) == 0;
    free(bytes);
    if (!same) {
      snprintf(err, errlen,
               "optimizer \"%s\" (id %" PRIu64 ") exists in job \"%s\" with "
               "another registration; ranks must register identical "
               "optimizers, or use another name",
               name, existing->hdr.id, job->name);
      return SHARDD_E_MISMATCH;
    }
    res->optim = existing;
    return SHARDD_OK;
  }

  shardd__optim_plan plan;
  shardd_err rc = shardd__validate_optimizer(reg, job, spec, &plan, &res->list);
  if (rc != SHARDD_OK) {
    free(bytes);
    res->refused = 1;
    return rc;
  }
  plan.spec = bytes; /* the plan owns them now */
  plan.spec_len = len;
  rc = shardd__optim_create(reg, job, &plan, &res->optim, err, errlen);
  shardd__optim_plan_free(&plan);
  if (rc != SHARDD_OK)
    return rc;
  res->created = 1;
  return SHARDD_OK;
}
