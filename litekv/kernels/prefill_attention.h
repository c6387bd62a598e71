/* What the prefill-attention kernel's files share (prefill_attention.c and its AVX2 path,
 * prefill_attention_avx2.c): a task's tile of query rows for one KV head, where its rows come from
 * and go to, and the AVX2 path's entry points. */
#ifndef LITEKV_PREFILL_ATTENTION_H
#define LITEKV_PREFILL_ATTENTION_H

#include "attention_common.h"

/* Where a task's rows live: row r is token t0 + r / group, head kv * group + r % group; the
 * tile's span of slots is lo..hi (lo > hi if no row sees any slot). */
typedef struct {
    int t0, tokens, kv, group, rows, lo, hi;
} Tile;

/* Slots lo..hi that token t sees in a job without a mask. */
INLINE void visible(const PrefillJob *job, int token, int *lo, int *hi) {
    *hi = job->first + token;
    *lo = job->window && *hi - job->window + 1 > 0 ? *hi - job->window + 1 : 0;
}

/* Row r's query (scaled) and output rows, head_dim floats each. */
INLINE const float *query_row_of(const PrefillJob *job, const Tile *t, int r) {
    return job->query + (size_t)(t->t0 + r / t->group) * job->heads * job->head_dim +
           (size_t)(t->kv * t->group + r % t->group) * job->head_dim;
}

INLINE float *out_row(const PrefillJob *job, const Tile *t, int r) {
    return job->out + (size_t)(t->t0 + r / t->group) * job->heads * job->head_dim +
           (size_t)(t->kv * t->group + r % t->group) * job->head_dim;
}

/* The AVX2 path (prefill_attention_avx2.c): whether it computes this job's tiles (the CPU has
 * AVX2, FMA and F16C but not AVX-512, head_dim is a multiple of 8, and litekv_prefill_avx2 has
 * not turned it off); one tile's attention for KV head t->kv, with the scratch the portable
 * path's layout gives (prefill_scratch_floats); and mask_span (attention_common.h). */
int prefill_avx2_usable(int head_dim);
void prefill_tile_avx2(const PrefillJob *job, const Tile *t, float *scratch);
void prefill_mask_span_avx2(const float *m, int slots, int *lo, int *hi);

#endif
