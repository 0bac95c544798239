/* validate.h — optimizer registration checks: every ref must resolve, in the
 * caller's job, to a daemon-owned flat buffer or a view of one; none may
 * appear twice or belong to another optimizer; no two may overlap; dtypes
 * and hyperparameters must suit the kind. A refusal lists every offending
 * ref and nothing is registered. The registration is a shardd__optspec
 * (optspec.h), not the wire message: optcodec.h converts. */
#ifndef SHARDD_VALIDATE_H
#define SHARDD_VALIDATE_H

#include "optspec.h"
#include "registry.h"

/* req is borrowed for the call only. On SHARDD_OK fills plan (caller
 * frees with shardd__optim_plan_free, or hands it to shardd__optim_create).
 * Otherwise returns the code of the first problem and *msg (caller frees
 * with free()) lists all of them, one per line, each naming group, ref
 * index, name and reason. */
shardd_err shardd__validate_optimizer(const shardd__registry *reg,
                                      const shardd__job *job,
                                      const shardd__optspec *req,
                                      shardd__optim_plan *plan, char **msg);

/* The fields h sets replace hp's (h NULL: none). */
void shardd__hp_overlay(shardd__hp *hp, const shardd__optspec_hp *h);

/* Resolves hyperparameters: torch defaults of kind, then `top`, then
 * `group` (either may be NULL). */
void shardd__hp_resolve(shardd_optim_kind kind, const shardd__optspec_hp *top,
                        const shardd__optspec_hp *group, shardd__hp *out);

#endif /* SHARDD_VALIDATE_H */
