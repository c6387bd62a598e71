/* The AVX2 linears' prepared activations (linear_avx2_prepare), read by the one-token rows
 * (linear_avx2.c) and the many-token tiles (linear_avx2_tiles.c). */
#ifndef LITEKV_LINEAR_AVX2_ACT_H
#define LITEKV_LINEAR_AVX2_ACT_H

#include <stddef.h>
#include <stdint.h>

#include "linear.h"

/* One token's activations inside its stride of the scratch, every array 32-byte aligned:
 * int4: even [in / 2], odd [in / 2] int8 (in a multiple of 64: whole spans), then per block, in
 *       groups of 8 blocks in GROUP_ORDER and padded with zeros to a whole group: scales (largest
 *       |x| / 127) and bias (-8 x the codes' sum x the scale) float; sums of x itself (for the
 *       offsets), float in block order;
 * int8: codes [in] int8 (in a multiple of 32), then the blocks' scales as above, in block order. */
typedef struct {
    const int8_t *even, *odd; /* int8: even holds all the codes */
    const float *scales, *bias, *sums;
} Act;

static inline size_t padded_blocks(int in) { return ((size_t)in / 32 + 7) / 8 * 8; }

/* Where block i of a group of 8 sits in GROUP_ORDER: span c's blocks 2c and 2c + 1 at c and 4 + c,
 * where group_dots leaves their sums (each span's low 128 bits, then its high). */
static inline int group_position(int i) { return i % 2 * 4 + i / 2; }

static inline Act act(const LinearJob *job, int t) {
    const int8_t *p = (const int8_t *)job->prepared + (size_t)t * job->prepared_stride;
    const float *f = (const float *)(const void *)(p + job->in);
    const size_t groups = padded_blocks(job->in);
    return (Act){p, p + job->in / 2, f, f + groups, f + 2 * groups};
}

#endif
