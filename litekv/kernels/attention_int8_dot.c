/* One-token attention over an int8 KV cache with AVX-512 VNNI integer dot products.
 *
 * The portable path (decode_attention.c) widens every code to a float and ends each 16 dot
 * products in a shuffle tree, so it is bound by arithmetic, not by the cache bytes it reads. Here
 * the codes are multiplied as integers:
 * - Scores: the query (the key scales already folded in) is written in two int8 digits, q ~ (256 *
 *   hi + lo) / s, 15 bits and a sign as on the AVX2 path. A block of 16 key rows is transposed to
 *   4-byte columns, so lane r of one vpdpbusd adds 4 dimensions of slot r times a broadcast word of
 *   digits: no tree. vpdpbusd wants unsigned codes, so the keys go in as k + 128 and 128 * (256 *
 *   sum(hi) + sum(lo)) comes off the sum.
 * - Weighted values: the softmax numerators are int16 (p * 32767), and two slots' value rows are
 *   interleaved as int16 pairs, so one vpdpwssd adds both slots' share to 16 dimensions. The int32
 *   sums are added into the float accumulator every FLUSH_PAIRS pairs, before they can overflow.
 * With a scale per row (CACHE_I8_ROWS), each slot's dot product is multiplied by its key row's
 * scale, and each numerator by its value row's scale before it is rounded to int16.
 * head_dim must pass int8_dot_head_dim: a multiple of 64 (a row segment is one 64-byte line) and
 * at most 256 (int32 range of the scores). */
#include "attention_common.h"

#if LITEKV_INT8_DOT
#include <immintrin.h>

#define TARGET __attribute__((target("avx512f,avx512bw,avx512vnni")))
#define BLOCK 16
#define FLUSH_PAIRS 128 /* |pair sum| <= 2 * 32767 * 127: 256 pairs fit an int32 */
#define VALUE_HEADS 4   /* query heads whose value sums stay in registers at once */
/* The value pass takes a row in about a third of the time the scores do, so it prefetches further
 * ahead than PREFETCH_ROWS for the same lead in time (in the model: 32 rows 69 us per call, 48 rows
 * 64, 64 rows 62, 96 rows 60; fifth round of bench/PERFORMANCE.md). */
#define VALUE_PREFETCH_ROWS 64
#define SCORE_DIGIT 32639.0f /* 127 * 256 + 127: the largest |query| as two signed digits */
#define NUMERATOR_ONE 32767.0f

int litekv_cpu_has_int8_dot(void) {
    return cpu_has(CPU_AVX512F | CPU_AVX512BW | CPU_AVX512VNNI);
}

/* In place: r[j] lane i becomes r[i] lane j (16 x 16 int32). */
TARGET static inline void transpose16(__m512i r[16]) {
    __m512i t[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    /* r[4i + b], 128-bit lane L: column 4L + b of rows 4i..4i+3 */
    for (int i = 0; i < 4; i++) {
        r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int b = 0; b < 4; b++) {
        t[4 * b] = _mm512_shuffle_i32x4(r[b], r[4 + b], 0x44);
        t[4 * b + 1] = _mm512_shuffle_i32x4(r[b], r[4 + b], 0xEE);
        t[4 * b + 2] = _mm512_shuffle_i32x4(r[8 + b], r[12 + b], 0x44);
        t[4 * b + 3] = _mm512_shuffle_i32x4(r[8 + b], r[12 + b], 0xEE);
    }
    for (int b = 0; b < 4; b++) {
        r[b] = _mm512_shuffle_i32x4(t[4 * b], t[4 * b + 2], 0x88);
        r[4 + b] = _mm512_shuffle_i32x4(t[4 * b], t[4 * b + 2], 0xDD);
        r[8 + b] = _mm512_shuffle_i32x4(t[4 * b + 1], t[4 * b + 3], 0x88);
        r[12 + b] = _mm512_shuffle_i32x4(t[4 * b + 1], t[4 * b + 3], 0xDD);
    }
}

/* One head's digits; returns 1/s, and *offset. */
TARGET static float query_digits(const float *q, int d, int8_t *hi, int8_t *lo, int32_t *offset) {
    float top = 0.0f;
    for (int j = 0; j < d; j++) top = __builtin_fabsf(q[j]) > top ? __builtin_fabsf(q[j]) : top;
    const float s = top > 0.0f ? SCORE_DIGIT / top : 0.0f;
    int32_t sum_hi = 0, sum_lo = 0;
    for (int j = 0; j < d; j++) {
        /* lo in -128..127 takes the low byte whole, so hi is rounded down from x + 128 */
        const float x = __builtin_roundf(q[j] * s), h = __builtin_floorf((x + 128.0f) / 256.0f);
        hi[j] = (int8_t)h;
        lo[j] = (int8_t)(x - 256.0f * h);
        sum_hi += hi[j], sum_lo += lo[j];
    }
    *offset = 128 * (256 * sum_hi + sum_lo);
    return top > 0.0f ? 1.0f / s : 0.0f;
}

TARGET static inline int32_t word(const void *p) {
    int32_t w;
    memcpy(&w, p, sizeof w);
    return w;
}

/* The scores of the 16 slots from s0 (the first `rows` of them stored), the mask added, for the query
 * heads of KV head kv, head_dim = 64 * chunks; chunks is a constant after inlining, so for one chunk
 * the transposed keys stay in registers. top[16 h + lane] keeps head h's largest score in that lane,
 * so the softmax needs no pass of its own to find the maximum. */
TARGET static inline __attribute__((always_inline)) void score_block(const Job *job, const Part *part, int s0,
                                                                     int rows, int kv, int group, const Digits *q,
                                                                     int chunks, float *top) {
    const int d = job->head_dim, row = job->row;
    const int8_t *keys = (const int8_t *)job->keys + (size_t)kv * job->head_stride;
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    __m512i col[4][BLOCK];
    for (int c = 0; c < chunks; c++) {
#pragma GCC unroll 16
        for (int r = 0; r < BLOCK; r++)
            col[c][r] = _mm512_xor_si512(flip, _mm512_loadu_si512(keys + (size_t)(s0 + (r < rows ? r : 0)) * row + 64 * c));
        transpose16(col[c]); /* col[c][j] lane r: dimensions 64c + 4j .. 64c + 4j + 3 of slot s0 + r, plus 128 */
    }
    const __mmask16 stored = (__mmask16)((1u << rows) - 1);
    /* a scale per row (CACHE_I8_ROWS, [KVH][S]) multiplies each slot's dot product; static scales are
     * in the query */
    const __m512 row_scale =
        job->key_scales ? _mm512_maskz_loadu_ps(stored, job->key_scales + (size_t)kv * job->scale_stride + s0)
                        : _mm512_set1_ps(1.0f);
    for (int g = 0; g < group; g++) {
        const int h = kv * group + g;
        const int8_t *hi = q->hi + (size_t)h * d, *lo = q->lo + (size_t)h * d;
        /* two sums per digit, even and odd columns: a vpdpbusd waits 4 cycles for the previous one
         * into its sum */
        __m512i a[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()}, b[2] = {a[0], a[0]};
        for (int c = 0; c < chunks; c++)
#pragma GCC unroll 16
            for (int j = 0; j < 16; j++) {
                a[j % 2] = _mm512_dpbusd_epi32(a[j % 2], col[c][j], _mm512_set1_epi32(word(hi + 64 * c + 4 * j)));
                b[j % 2] = _mm512_dpbusd_epi32(b[j % 2], col[c][j], _mm512_set1_epi32(word(lo + 64 * c + 4 * j)));
            }
        const __m512i high = _mm512_add_epi32(a[0], a[1]), low = _mm512_add_epi32(b[0], b[1]);
        /* |256 * high + low| <= 256 * 127 * 255 * 256 + 128 * 255 * 256 < 2^31 up to head_dim 256 */
        const __m512i exact = _mm512_sub_epi32(_mm512_add_epi32(_mm512_slli_epi32(high, 8), low),
                                               _mm512_set1_epi32(q->offset[h]));
        const __m512 score = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(exact), row_scale),
                                             _mm512_set1_ps(q->unit[h]), _mm512_maskz_loadu_ps(stored, job->mask + s0));
        _mm512_mask_storeu_ps(job->scores + (size_t)h * job->stride + part->first + (s0 - part->lo), stored, score);
        const __m512 best = _mm512_loadu_ps(top + 16 * h);
        _mm512_storeu_ps(top + 16 * h, _mm512_mask_max_ps(best, stored, best, score));
    }
}

/* The masked scores of slots part->lo..hi into job->scores, a block of 16 slots at a time, and
 * their lane maxima into top. */
TARGET static void scores(const Job *job, const Part *part, const Digits *q, float *top) {
    const int row = job->row, n = part->hi - part->lo + 1, group = job->heads / job->kv_heads;
    for (int i0 = 0; i0 < n; i0 += BLOCK) {
        const int rows = n - i0 < BLOCK ? n - i0 : BLOCK, s0 = part->lo + i0;
        /* the rows PREFETCH_ROWS on, all KV heads: one contiguous span, or one per KV head in a
         * head-major cache ([KVH][S][D], Job.head_stride) */
        const int spans = job->head_stride == (size_t)job->head_dim ? 1 : job->kv_heads;
        for (int kv = 0; kv < spans; kv++) {
            const char *ahead = (const char *)job->keys + (size_t)kv * job->head_stride + (size_t)(s0 + PREFETCH_ROWS) * row;
            for (int b = 0; b < BLOCK * row; b += 64) _mm_prefetch(ahead + b, _MM_HINT_T1);
        }
        for (int kv = 0; kv < job->kv_heads; kv++) switch (job->head_dim / 64) {
            case 1: score_block(job, part, s0, rows, kv, group, q, 1, top); break;
            case 2: score_block(job, part, s0, rows, kv, group, q, 2, top); break;
            case 3: score_block(job, part, s0, rows, kv, group, q, 3, top); break;
            default: score_block(job, part, s0, rows, kv, group, q, 4, top); break;
            }
    }
}

/* acc[h * D + c + dimension] += the int32 sums of heads h0..h0+gb-1. Their lane order is that of
 * unpacking the two halves of a 64-dimension segment (see `values`): lane 4L + t of sums m and m + 1
 * (m even) holds dimensions 32 (m / 2) + 8L + t and + 4 + t, so one two-source permute per 16
 * dimensions puts them in order. */
TARGET static inline __attribute__((always_inline)) void flush(float *acc, int d, int h0, int gb, int c,
                                                               __m512i sums[VALUE_HEADS][4]) {
    const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
#pragma GCC unroll 4
    for (int g = 0; g < gb; g++)
#pragma GCC unroll 2
        for (int m = 0; m < 4; m += 2) {
            float *out = acc + (size_t)(h0 + g) * d + c + 32 * (m / 2);
            const __m512i lower = _mm512_permutex2var_epi32(sums[g][m], first, sums[g][m + 1]);
            const __m512i upper = _mm512_permutex2var_epi32(sums[g][m], second, sums[g][m + 1]);
            _mm512_storeu_ps(out, _mm512_add_ps(_mm512_loadu_ps(out), _mm512_cvtepi32_ps(lower)));
            _mm512_storeu_ps(out + 16, _mm512_add_ps(_mm512_loadu_ps(out + 16), _mm512_cvtepi32_ps(upper)));
            sums[g][m] = sums[g][m + 1] = _mm512_setzero_si512();
        }
}

/* part->acc += numerators x values, for query heads h0..h0+gb-1 (one KV head) and dimensions
 * c..c+63, two slots at a time. gb is a constant after inlining, so the sums stay in registers. */
TARGET static inline __attribute__((always_inline)) void values(const Job *job, Part *part, int kv, int h0, int gb, int c) {
    const int d = job->head_dim, row = job->row, n = part->hi - part->lo + 1;
    const int8_t *base = (const int8_t *)job->values + (size_t)part->lo * row + (size_t)kv * job->head_stride + c;
    __m512i sums[VALUE_HEADS][4];
#pragma GCC unroll 16
    for (int g = 0; g < VALUE_HEADS; g++)
#pragma GCC unroll 4
        for (int m = 0; m < 4; m++) sums[g][m] = _mm512_setzero_si512();
    /* FLUSH_PAIRS pairs per pass, then a flush: no test for it inside the loop, whose sums stay in
     * registers */
    const int pairs = (n + 1) / 2;
    for (int i0 = 0; i0 < pairs; i0 += FLUSH_PAIRS) {
        const int end = pairs - i0 < FLUSH_PAIRS ? pairs : i0 + FLUSH_PAIRS;
        for (int i = i0; i < end; i++) {
            const int8_t *a = base + (size_t)2 * i * row, *b = 2 * i + 1 < n ? a + row : a; /* b weighs 0 then */
            _mm_prefetch((const char *)a + (size_t)VALUE_PREFETCH_ROWS * row, _MM_HINT_T1);
            _mm_prefetch((const char *)a + (size_t)(VALUE_PREFETCH_ROWS + 1) * row, _MM_HINT_T1);
            const __m512i a_lo = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const void *)a));
            const __m512i a_hi = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const void *)(a + 32)));
            const __m512i b_lo = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const void *)b));
            const __m512i b_hi = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const void *)(b + 32)));
            /* int32 lane = (slot a, slot b) of one dimension: 4L + t <- 8L + t (+ 4 for the unpackhi) */
            const __m512i pair[4] = {_mm512_unpacklo_epi16(a_lo, b_lo), _mm512_unpackhi_epi16(a_lo, b_lo),
                                     _mm512_unpacklo_epi16(a_hi, b_hi), _mm512_unpackhi_epi16(a_hi, b_hi)};
#pragma GCC unroll 16
            for (int g = 0; g < gb; g++) {
                const __m512i weight =
                    _mm512_set1_epi32(word(part->numerators + (size_t)(h0 + g) * part->numerator_stride + 2 * i));
#pragma GCC unroll 4
                for (int m = 0; m < 4; m++) sums[g][m] = _mm512_dpwssd_epi32(sums[g][m], pair[m], weight);
            }
        }
        flush(part->acc, d, h0, gb, c, sums);
    }
}

/* part->acc = numerators x values, all heads. Without tree-PRE: with it GCC 12 copies each of the
 * loop's sums to another register and back every pair, which costs more than the dot products. */
TARGET __attribute__((noinline, optimize("no-tree-pre"))) static void weighted_values(const Job *job, Part *part) {
    const int d = job->head_dim, group = job->heads / job->kv_heads;
    memset(part->acc, 0, sizeof(float) * (size_t)job->heads * d);
    for (int kv = 0; kv < job->kv_heads; kv++)
        for (int c = 0; c < d; c += 64)
            for (int g0 = 0; g0 < group; g0 += VALUE_HEADS) {
                const int h0 = kv * group + g0;
                switch (group - g0 < VALUE_HEADS ? group - g0 : VALUE_HEADS) {
                case 1: values(job, part, kv, h0, 1, c); break;
                case 2: values(job, part, kv, h0, 2, c); break;
                case 3: values(job, part, kv, h0, 3, c); break;
                default: values(job, part, kv, h0, 4, c); break;
                }
            }
}

TARGET void int8_dot_digits(const Job *job, Digits *out) {
    const int d = job->head_dim;
    for (int h = 0; h < job->heads; h++)
        out->unit[h] = query_digits(job->query + (size_t)h * d, d, out->hi + (size_t)h * d, out->lo + (size_t)h * d,
                                    out->offset + h);
}

/* With a scale per value row, a numerator weighs e^(score - top) * scale, rounded in the units of
 * the head's largest such weight in the part: the int16 range goes to the rows the head attends
 * to, whatever the scales of rows it ignores. The sum stays e^(score - top) summed, so the weighted
 * values are brought to the same units after the pass (`units`). `sc` is the head's scores,
 * overwritten with the weights. */
TARGET static float row_numerators(const float *restrict scale, float *restrict sc, float top, int n,
                                   int16_t *restrict numerators, float *unit) {
    float total = 0.0f;
    for (int i = 0; i < n; i++) {
        const float e = exp_nonpositive(sc[i] - top);
        total += e;
        sc[i] = e * scale[i];
    }
    const float largest = max_of(sc, n); /* a vector max: a conditional max would not vectorize (NaNs) */
    const float step = largest > 0.0f ? NUMERATOR_ONE / largest : 0.0f;
    for (int i = 0; i < n; i++) numerators[i] = (int16_t)(int32_t)(sc[i] * step + 0.5f);
    *unit = largest / NUMERATOR_ONE;
    return total;
}

TARGET void attend_part_int8_dot(const Job *job, Part *part) {
    const int heads = job->heads, n = part->hi - part->lo + 1, group = heads / job->kv_heads;
    float tops[16 * heads]; /* per head, the largest of its masked scores so far in each lane */
    float units[heads];     /* with row scales, per head, what one step of the weighted values' sums is worth */
    for (int i = 0; i < 16 * heads; i++) tops[i] = MASKED_BELOW * 2.0f;
    scores(job, part, job->digits, tops);
    for (int h = 0; h < heads; h++) {
        float *sc = job->scores + (size_t)h * job->stride + part->first;
        const float top = _mm512_reduce_max_ps(_mm512_loadu_ps(tops + 16 * h));
        int16_t *numerators = part->numerators + (size_t)h * part->numerator_stride;
        if (job->value_scales) {
            const float *scale = job->value_scales + (size_t)(h / group) * job->scale_stride + part->lo;
            part->sum[h] = row_numerators(scale, sc, top, n, numerators, &units[h]);
        } else {
            int32_t total = 0; /* <= 32767 * CHUNK_SLOTS */
            for (int i = 0; i < n; i++) {
                numerators[i] = (int16_t)(int32_t)(exp_nonpositive(sc[i] - top) * NUMERATOR_ONE + 0.5f);
                total += numerators[i];
            }
            part->sum[h] = (float)total;
        }
        numerators[n] = 0; /* the partner of an odd last slot */
        part->max[h] = top;
    }
    weighted_values(job, part);
    if (job->value_scales) scale_heads(part->acc, units, heads, job->head_dim);
}

#endif
