/* optreg.h — the optimizer-registration use case: one function that the
 * request path (a client's RegisterOptimizer) and checkpoint restore (a
 * recorded one, ids remapped) both call, so an optimizer comes to exist in
 * exactly one way. It knows no wire type and no session: the caller
 * converts with optcodec.h and turns the outcome into a reply or a
 * refusal of its own.
 *
 * Every rank registers the same optimizer: with SHARDD__OPTREG_ATTACH an
 * identical registration (equal canonical bytes, optcodec.h) under a name
 * already taken attaches to it; any other registration under that name is
 * SHARDD_E_MISMATCH. Otherwise the spec is validated (validate.h) and the
 * optimizer created (shardd__optim_create), recording the canonical bytes
 * as its identity. Loop thread only, like the registry. */
#ifndef SHARDD_OPTREG_H
#define SHARDD_OPTREG_H

#include <stddef.h>

#include "optspec.h"
#include "registry.h"

/* Attach to an identical registration under the same name instead of
 * refusing the name as taken. Restore leaves it out: its job is new, and a
 * manifest naming one optimizer twice is refused as before. */
#define SHARDD__OPTREG_ATTACH 1u

typedef struct {
  /* on SHARDD_OK: the optimizer, borrowed from the registry */
  shardd__optim *optim;
  int created; /* 1 registered by this call, 0 attached to an identical one */
  /* refused 1: validation refused the spec, and list (caller frees with
   * free(); NULL only when out of memory) names every problem, one per
   * line, unbounded by err. refused 0 on failure: err says why. */
  int refused;
  char *list;
} shardd__optreg_result;

/* Registers spec (borrowed for the call) in job. *res is always filled;
 * err (errlen bytes, may be cut) holds the reason of a failure that is
 * not a validation refusal: a mismatch, a create failure, out of memory. */
shardd_err shardd__optreg_register(shardd__registry *reg, shardd__job *job,
                                   const shardd__optspec *spec, unsigned flags,
                                   shardd__optreg_result *res, char *err,
                                   size_t errlen);

#endif /* SHARDD_OPTREG_H */
