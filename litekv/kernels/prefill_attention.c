/* A prefill chunk's attention over a KV cache ("litekv.prefill_attention"): T query tokens, each
 * attending to the cached slots its mask row leaves open.
 *
 * Builtin ops compute a chunk's scores against every slot of a fixed capacity, so a bundle needs
 * one entry point per capacity to keep short contexts cheap, and each entry point costs memory.
 * This kernel reads only the span of slots some row of a tile can see: a chunk at the start of
 * the cache touches the causal triangle, whatever the capacity, so one entry point per chunk
 * length serves every context.
 *
 * Work is cut in tasks of a tile of tokens. For each KV head in turn, the tile's query rows (its
 * tokens x the heads sharing that KV head, about TILE_ROWS) are scored against the tile's span in
 * two passes over the slots, keeping the scores in L2:
 * - scores: a block of 16 key rows is transposed once into 16-slot columns, and groups of
 *   ROW_GROUP query rows multiply it with broadcast query elements, sums in registers;
 * - softmax per row (mask added, so causality and holes need no special case), then the weighted
 *   values, a few rows' sums in registers while each value row is read.
 * An int8 cache's codes and a float16 cache are widened to floats as a block is read; for int8
 * codes with static scales the graph folds the scales into the query and the output, as for
 * decode, and codes with a scale per row are multiplied by it as they are widened.
 *
 * The vector code here is shaped for AVX-512's 32 zmm registers. On x86-64 CPUs with AVX2 but not
 * AVX-512, prefill_attention_avx2.c computes the same tiles with blocks for 16 ymm registers (its
 * 16-float vectors spilled there: a 256-token chunk ran 12-19x slower); tasks and scratch are
 * these. On a Zen 3 (512 KB L2) 48 rows' scores at 4,096 slots no longer fit in L2: the AVX2 path
 * keeps ~65 % of its FMA rate there, against ~72 % at 1,024 slots.
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "prefill_attention.h"

#ifndef TILE_ROWS
#define TILE_ROWS 48 /* query rows per task: 48 rows' scores at 4,096 slots are 768 KB, in L2 */
#endif
#ifndef ROW_GROUP
#define ROW_GROUP 8 /* rows whose scores stay in registers while a key block is read */
#endif
/* Rows are padded to ROW_GROUP, and the weighted values go 1, 2 or 4 rows at a time. */
_Static_assert(ROW_GROUP % 4 == 0, "ROW_GROUP must be a multiple of 4");
#define BLOCK 16     /* slots per block: one vector of scores */

static int tile_tokens(const PrefillJob *job) {
    const int group = job->heads / job->kv_heads;
    return group >= TILE_ROWS ? 1 : TILE_ROWS / group;
}

int prefill_tasks(const PrefillJob *job) {
    const int tq = tile_tokens(job);
    return (job->tokens + tq - 1) / tq;
}

static size_t max_rows(int heads) { return round_up(heads > TILE_ROWS ? heads : TILE_ROWS, ROW_GROUP); }

size_t prefill_scratch_floats(int heads, int head_dim, int max_slots) {
    const size_t rows = max_rows(heads);
    /* query rows, value sums, scores, row sums (whole vectors: what follows stays aligned), a
     * transposed key block, a widened value block */
    return rows * (size_t)head_dim * 2 + rows * round_up(max_slots, BLOCK) + round_up(rows, 16) +
           2 * (size_t)BLOCK * (size_t)head_dim;
}

/* Rows first..first+count-1 of KV head `kv` in a cache as floats, and the stride between them:
 * float rows where they lie, int8 codes or float16 widened into `buffer` [count][D] a row at a
 * time (codes times their row's scale, with `scales` [KVH][slots]). */
INLINE const float *cache_rows(const PrefillJob *job, const void *cache, const float *scales, int first, int count,
                               int kv, float *restrict buffer, size_t *stride) {
    const int d = job->head_dim;
    const size_t at = (size_t)first * job->row + (size_t)kv * job->head_stride;
    if (job->cache_type == CACHE_F32) {
        *stride = (size_t)job->row;
        return (const float *)cache + at;
    }
    for (int i = 0; i < count; i++) {
        float *row = buffer + (size_t)i * d;
        widen(row, cache, cache_element_bytes(job->cache_type), at + (size_t)i * job->row, (size_t)d);
        if (scales) {
            const float scale = row_scale(scales, job->slots, kv, first + i);
            for (int j = 0; j < d; j++) row[j] *= scale;
        }
    }
    *stride = (size_t)d;
    return buffer;
}

/* In place: lane j of a[i] becomes lane i of a[j]. Each stage swaps the off-diagonal b x b blocks
 * of every 2b x 2b block (rows i and i + b trade the halves whose column bit b differs from
 * theirs); after b = 8, 4, 2, 1 every bit of the row and column index has been exchanged. */
#define LO8 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23
#define HI8 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31
#define LO4 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27
#define HI4 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31
#define LO2 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29
#define HI2 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31
#define LO1 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30
#define HI1 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31
#define STAGE(a, b, LO, HI)                                                  \
    _Pragma("GCC unroll 16") for (int i = 0; i < 16; i++) if (!(i & (b))) { \
        const v16 x = a[i], y = a[i + (b)];                                   \
        a[i] = __builtin_shufflevector(x, y, LO);                             \
        a[i + (b)] = __builtin_shufflevector(x, y, HI);                       \
    }

INLINE void transpose16(v16 a[16]) {
    STAGE(a, 8, LO8, HI8)
    STAGE(a, 4, LO4, HI4)
    STAGE(a, 2, LO2, HI2)
    STAGE(a, 1, LO1, HI1)
}

/* The tile of `task`, for KV head 0 (its mask rows scanned with AVX2 if `avx2`): the last tokens
 * first, since their spans are the longest and threads that take tasks in order then finish
 * together. lo > hi if no row sees any slot. */
INLINE Tile tile_of(const PrefillJob *job, int task, int avx2) {
    const int tq = tile_tokens(job), tiles = (job->tokens + tq - 1) / tq, tile = tiles - 1 - task;
    Tile t = {tile * tq, 0, 0, job->heads / job->kv_heads, 0, job->slots, -1};
    t.tokens = job->tokens - t.t0 < tq ? job->tokens - t.t0 : tq;
    t.rows = t.tokens * t.group;
    if (!job->mask) { /* causal: the first token sees the lowest slot, the last the highest */
        visible(job, t.t0, &t.lo, &t.hi);
        int lo, hi;
        visible(job, t.t0 + t.tokens - 1, &lo, &hi);
        t.hi = hi;
        return t;
    }
    for (int i = 0; i < t.tokens; i++) {
        const float *m = job->mask + (size_t)(t.t0 + i) * job->slots;
        int lo, hi; /* a causal row's masked tail is most of the row at the start of a long cache */
        if (avx2)
            prefill_mask_span_avx2(m, job->slots, &lo, &hi);
        else
            mask_span(m, job->slots, &lo, &hi);
        if (lo <= hi) {
            t.lo = lo < t.lo ? lo : t.lo;
            t.hi = hi > t.hi ? hi : t.hi;
        }
    }
    return t;
}

/* Adds row r's mask to its n scores and replaces them with e^(score - max); returns their sum,
 * 0 (and zero numerators) if the row sees no slot of the span. */
INLINE float row_numerators(const PrefillJob *job, const Tile *t, int r, float *restrict s, int n) {
    float total = 0.0f;
    if (job->mask) {
        const float *restrict m = job->mask + (size_t)(t->t0 + r / t->group) * job->slots + t->lo;
        for (int i = 0; i < n; i++) s[i] += m[i];
    } else { /* slots outside the row's causal span */
        int lo, hi;
        visible(job, t->t0 + r / t->group, &lo, &hi);
        for (int i = 0; i < n; i++)
            if (t->lo + i < lo || t->lo + i > hi) s[i] = -INFINITY;
    }
    const float top = max_of(s, n);
    if (top <= MASKED_BELOW) {
        memset(s, 0, sizeof(float) * (size_t)n);
        return 0.0f;
    }
    for (int i = 0; i < n; i++) {
        s[i] = exp_nonpositive(s[i] - top);
        total += s[i];
    }
    return total;
}

/* head_dim = 16 * C. Scratch: query rows [rows][D], sums [rows][D], scores [rows][stride], row
 * sums, a key block [D] columns of 16 slots, a widened value block [16][D]; 64-byte aligned. */
#define DEFINE_TASK(NAME, C)                                                                             \
    INLINE void NAME(const PrefillJob *job, const Tile *t, float *scratch) {                             \
        enum { D = 16 * C, PV_ROWS = C >= 16 ? 1 : 16 / C };                                            \
        const int rows = (int)round_up(t->rows, ROW_GROUP), n = t->hi - t->lo + 1, stride = (int)round_up(n, BLOCK); \
        const int hd = job->heads * D;                                                                   \
        float *q = scratch, *acc = q + (size_t)rows * D, *scores = acc + (size_t)rows * D;              \
        float *sums = scores + (size_t)rows * stride;                                                   \
        v16 *columns = (v16 *)(void *)(sums + round_up(rows, 16));                                      \
        float *widened = (float *)(void *)(columns + D);                                                \
        for (int r = 0; r < rows; r++) {                                                                 \
            if (r < t->rows) memcpy(q + (size_t)r * D, job->query + (size_t)(t->t0 + r / t->group) * hd + \
                                    (size_t)(t->kv * t->group + r % t->group) * D, sizeof(float) * D);   \
            else memset(q + (size_t)r * D, 0, sizeof(float) * D);                                        \
        }                                                                                                \
        for (int j0 = 0; j0 < n; j0 += BLOCK) {                                                          \
            const int count = n - j0 < BLOCK ? n - j0 : BLOCK;                                           \
            size_t k_stride;                                                                             \
            const float *k = cache_rows(job, job->keys, job->key_scales, t->lo + j0, count, t->kv, widened, &k_stride); \
            for (int c = 0; c < C; c++) {                                                                \
                v16 block[BLOCK];                                                                        \
                for (int i = 0; i < BLOCK; i++) block[i] = i < count ? load16(k + i * k_stride + 16 * c) : (v16){0}; \
                transpose16(block);                                                                      \
                memcpy(columns + 16 * c, block, sizeof block);                                           \
            }                                                                                            \
            for (int r0 = 0; r0 < rows; r0 += ROW_GROUP) {                                               \
                v16 a[ROW_GROUP] = {0};                                                                  \
                const float *qr = q + (size_t)r0 * D;                                                    \
                _Pragma("GCC unroll 4") for (int d = 0; d < D; d++) {                                    \
                    const v16 k = columns[d];                                                            \
                    _Pragma("GCC unroll 8") for (int i = 0; i < ROW_GROUP; i++) a[i] += qr[i * D + d] * k; \
                }                                                                                        \
                _Pragma("GCC unroll 8") for (int i = 0; i < ROW_GROUP; i++)                              \
                    memcpy(scores + (size_t)(r0 + i) * stride + j0, &a[i], sizeof a[i]);                 \
            }                                                                                            \
        }                                                                                                \
        for (int r = 0; r < t->rows; r++) sums[r] = row_numerators(job, t, r, scores + (size_t)r * stride, n); \
        memset(acc, 0, sizeof(float) * (size_t)rows * D);                                                \
        for (int j0 = 0; j0 < n; j0 += BLOCK) {                                                          \
            const int count = n - j0 < BLOCK ? n - j0 : BLOCK;                                           \
            size_t v_stride;                                                                             \
            const float *v = cache_rows(job, job->values, job->value_scales, t->lo + j0, count, t->kv, widened, &v_stride); \
            for (int r0 = 0; r0 < t->rows; r0 += PV_ROWS) {                                              \
                v16 a[PV_ROWS][C];                                                                       \
                _Pragma("GCC unroll 16") for (int i = 0; i < PV_ROWS; i++)                               \
                    _Pragma("GCC unroll 16") for (int c = 0; c < C; c++) a[i][c] = load16(acc + (size_t)(r0 + i) * D + 16 * c); \
                for (int j = 0; j < count; j++) {                                                        \
                    v16 value[C];                                                                        \
                    _Pragma("GCC unroll 16") for (int c = 0; c < C; c++) value[c] = load16(v + j * v_stride + 16 * c); \
                    _Pragma("GCC unroll 16") for (int i = 0; i < PV_ROWS; i++) {                         \
                        const float w = scores[(size_t)(r0 + i) * stride + j0 + j];                      \
                        _Pragma("GCC unroll 16") for (int c = 0; c < C; c++) a[i][c] += w * value[c];    \
                    }                                                                                    \
                }                                                                                        \
                _Pragma("GCC unroll 16") for (int i = 0; i < PV_ROWS; i++)                               \
                    memcpy(acc + (size_t)(r0 + i) * D, a[i], sizeof a[i]);                               \
            }                                                                                            \
        }                                                                                                \
        const float *os = job->out_scales ? job->out_scales + (size_t)t->kv * D : NULL;                  \
        for (int r = 0; r < t->rows; r++) {                                                              \
            float *o = out_row(job, t, r);                                                               \
            const float scale = sums[r] > 0.0f ? 1.0f / sums[r] : 0.0f;                                  \
            if (os)                                                                                      \
                for (int d = 0; d < D; d++) o[d] = acc[(size_t)r * D + d] * scale * os[d];               \
            else                                                                                         \
                for (int d = 0; d < D; d++) o[d] = acc[(size_t)r * D + d] * scale;                       \
        }                                                                                                \
    }

DEFINE_TASK(task_4, 4)
DEFINE_TASK(task_8, 8)
DEFINE_TASK(task_16, 16)

/* Any head_dim: the same computation one element at a time, row by row. */
INLINE void task_any(const PrefillJob *job, const Tile *t, float *scratch) {
    const int d = job->head_dim, n = t->hi - t->lo + 1;
    for (int r = 0; r < t->rows; r++) {
        const float *q = job->query + (size_t)(t->t0 + r / t->group) * job->heads * d +
                         (size_t)(t->kv * t->group + r % t->group) * d;
        for (int i = 0; i < n; i++) {
            const size_t k = (size_t)(t->lo + i) * job->row + (size_t)t->kv * job->head_stride;
            float dot = 0.0f;
            for (int j = 0; j < d; j++) dot += q[j] * element(job->keys, k + j, job->cache_type);
            scratch[i] = dot * row_scale(job->key_scales, job->slots, t->kv, t->lo + i);
        }
        const float total = row_numerators(job, t, r, scratch, n), scale = total > 0.0f ? 1.0f / total : 0.0f;
        float *o = out_row(job, t, r);
        memset(o, 0, sizeof(float) * d);
        for (int i = 0; i < n; i++) {
            const size_t v = (size_t)(t->lo + i) * job->row + (size_t)t->kv * job->head_stride;
            const float w = scratch[i] * row_scale(job->value_scales, job->slots, t->kv, t->lo + i);
            for (int j = 0; j < d; j++) o[j] += w * element(job->values, v + j, job->cache_type);
        }
        const float *os = job->out_scales ? job->out_scales + (size_t)t->kv * d : NULL;
        for (int j = 0; j < d; j++) o[j] *= os ? scale * os[j] : scale;
    }
}

/* A tile of tokens for every KV head in turn: the mask rows are scanned for the span once. On a
 * CPU with AVX2 but not AVX-512, prefill_attention_avx2.c computes the tiles. */
VECTOR_CLONES void prefill_task(const PrefillJob *job, int task, float *scratch) {
    const int avx2 = prefill_avx2_usable(job->head_dim);
    Tile t = tile_of(job, task, avx2);
    for (t.kv = 0; t.kv < job->kv_heads; t.kv++) {
        if (t.lo > t.hi) {
            for (int r = 0; r < t.rows; r++) memset(out_row(job, &t, r), 0, sizeof(float) * job->head_dim);
            continue;
        }
        if (avx2) {
            prefill_tile_avx2(job, &t, scratch);
            continue;
        }
        switch (job->head_dim) {
        case 64: task_4(job, &t, scratch); break;
        case 128: task_8(job, &t, scratch); break;
        case 256: task_16(job, &t, scratch); break;
        default: task_any(job, &t, scratch);
        }
    }
}
