/* optcodec.h — the one place an optimizer registration crosses between the
 * wire (Shardwire__RegisterOptimizer) and the core (shardd__optspec).
 *
 * Identity: two registrations are the same when their encodings are equal.
 * shardd__optspec_encode packs the spec as the RegisterOptimizer it came
 * from, fields in number order, so for a client's message (no fields this
 * daemon does not know) it gives the very bytes that message packs to, and
 * decode then encode of a manifest's recorded bytes gives them back: the
 * request path and restore compute identity the same way, and checkpoints
 * written before this module (packed RegisterOptimizer bytes) still
 * restore. Fields unknown to this daemon are not part of the spec. */
#ifndef SHARDD_OPTCODEC_H
#define SHARDD_OPTCODEC_H

#include <stddef.h>
#include <stdint.h>

#include "optspec.h"
#include "proto/shardd.pb-c.h"
#include "shardd.h"

/* Fills *out with a deep copy of ro (out owns it all; ro is not kept).
 * SHARDD_E_NO_MEMORY leaves *out empty. */
shardd_err shardd__optspec_from_wire(const Shardwire__RegisterOptimizer *ro,
                                     shardd__optspec *out);

/* Unpacks len bytes of a packed RegisterOptimizer into *out (owned as
 * above). SHARDD_E_INVAL when they do not decode; *out is empty then. */
shardd_err shardd__optspec_decode(const uint8_t *bytes, size_t len,
                                  shardd__optspec *out);

/* The canonical bytes of spec: *bytes (caller frees with free(); never
 * NULL on SHARDD_OK, even for 0 bytes) and *len. */
shardd_err shardd__optspec_encode(const shardd__optspec *spec, uint8_t **bytes,
                                  size_t *len);

/* One HyperParams, presence flags kept (a step's per-group overrides). */
void shardd__optspec_hp_from_wire(const Shardwire__HyperParams *h,
                                  shardd__optspec_hp *o);

/* Releases what optcodec put in spec and empties it; NULL or an empty spec
 * is fine. */
void shardd__optspec_free(shardd__optspec *spec);

#endif /* SHARDD_OPTCODEC_H */
