/* fabric_stub.c — the fabric interface (fabric.h) for a daemon built
 * without Gloo: every call refuses, so multi-node jobs fail with a message
 * saying how to get them, and everything else works. */
#include "fabric.h"

#include <stdio.h>

#ifndef SHARDD_HAVE_GLOO

static shardd_err none(char *err, size_t errlen) {
  if (err == NULL || errlen == 0)
    return SHARDD_E_STATE;
  snprintf(err, errlen,
           "multi-node jobs need a fabric engine: this shardd was built "
           "without Gloo (install libgloo-dev and rebuild)");
  return SHARDD_E_STATE;
}

const char *shardd__fabric_engine(void) { return NULL; }

shardd_err shardd__fabric_create(const shardd__fabric_opts *opts,
                                 shardd__fabric **out, char *err,
                                 size_t errlen) {
  if (out)
    *out = NULL;
  return none(err, errlen);
}

void shardd__fabric_abort(shardd__fabric *f, const char *why) {
  (void)f;
  (void)why;
}

shardd_err shardd__fabric_allgather(shardd__fabric *f, void *buf,
                                    size_t bytes_per_node, uint32_t tag,
                                    char *err, size_t errlen) {
  return none(err, errlen);
}

shardd_err shardd__fabric_reduce_scatter_f32(shardd__fabric *f, float *buf,
                                             size_t count, uint32_t tag,
                                             char *err, size_t errlen) {
  return none(err, errlen);
}

void shardd__fabric_destroy(shardd__fabric *f) {}

#else
typedef int shardd__fabric_stub_unused; /* ISO C: no empty translation unit */
#endif
