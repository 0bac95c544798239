/* reduce.h — the host reduction kernel of scatter: the element-wise sum of
 * several ranks' gradients (fp32, bf16 or fp16, widened to fp32) in rank
 * order, into an fp32 array. The caller owns every array. */
#ifndef SHARDD_REDUCE_H
#define SHARDD_REDUCE_H

#include <stddef.h>

#include "shardd.h"

/* acc[i] = (...((src[0][i] + src[1][i]) + src[2][i]) ...) + src[nsrc-1][i]
 * for i < n, each term widened from dtype to fp32 and every addition one
 * fp32 addition in that order (the bits of adding one source after the
 * other); with add set the sum goes on from acc's values instead
 * (acc[i] + src[0][i] + ...). nsrc 0 leaves acc alone. acc must not overlap
 * a source. One pass over acc for up to four sources at a time, not one
 * per source: a pass re-reads and re-writes acc, and with a bucket's many
 * small shards (a few KiB each, page-aligned like the sources) those
 * passes, not the sources' reads, were most of a scatter's time. */
void shardd__reduce_sum(shardd_dtype dtype, float *acc,
                        const void *const *srcs, int nsrc, size_t n, int add);

#endif /* SHARDD_REDUCE_H */
