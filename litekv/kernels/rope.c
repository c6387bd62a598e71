/* Rotary position embedding for a decode step's query and key heads, as one custom op: XNNPACK
 * runs the graph form (a FULLY_CONNECTED by a signed permutation, two products and a sum) on its
 * thread pool, and with the step's linears in litekv's kernels those were the pool's only work:
 * each woke XNNPACK's worker across cores (32 sleeps a step, bench/PERFORMANCE.md, fifteenth round). */
#include "linear.h"

/* x and out [tokens][heads][dim]; cos and sin [tokens][dim] (each half-table repeated):
 * out = x * cos + rotate_half(x) * sin, rotate_half(x) = (-x[dim/2:], x[:dim/2]). */
void rope_apply(const float *restrict x, const float *restrict cos, const float *restrict sin, float *restrict out,
                int tokens, int heads, int dim) {
    const int half = dim / 2;
    for (int t = 0; t < tokens; t++) {
        const float *c = cos + (size_t)t * dim, *s = sin + (size_t)t * dim;
        for (int h = 0; h < heads; h++) {
            const float *v = x + ((size_t)t * heads + h) * dim;
            float *o = out + ((size_t)t * heads + h) * dim;
            for (int i = 0; i < half; i++) {
                o[i] = v[i] * c[i] - v[i + half] * s[i];
                o[i + half] = v[i + half] * c[i + half] + v[i] * s[i + half];
            }
        }
    }
}
