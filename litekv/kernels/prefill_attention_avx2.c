/* The prefill-attention kernel's tiles with AVX2 + FMA (+ F16C for float16 caches), on x86-64
 * CPUs without AVX-512: prefill_task (prefill_attention.c) hands each tile and KV head here.
 *
 * The portable path's 16-float vectors are two ymm registers on AVX2, and its register blocks
 * (8 rows x 16 slots of scores, 16 x 16 transposes, 4 rows x D of value sums) were shaped for 32
 * zmm registers: compiled for AVX2 they spill to the stack in every inner loop. This path keeps the
 * same two passes over the tile's span, with blocks shaped for 16 ymm registers:
 * - scores: a block of 16 key rows is transposed (8 x 8 at a time) into D columns of 16 slots,
 *   and 6 query rows x 16 slots sum in 12 registers: per dimension, two column loads and six
 *   broadcast query elements feed 12 FMAs;
 * - softmax per row over its scores (mask added; without a mask only the row's causal or windowed
 *   span is weighed), vectorized;
 * - weighted values over blocks of 32 slots: 6 rows x 16 dimensions sum in 12 registers, per slot
 *   two value loads and six broadcast weights.
 * Float16 and int8 rows are widened (vcvtph2ps, vpmovsxbd) once per block into L1, codes with a
 * scale per row multiplied by it, as the portable path does.
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "prefill_attention.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include "avx2_common.h"

#define TARGET AVX2_TARGET
#define AVX2_INLINE AVX2_HELPER

#define KEY_BLOCK 16   /* slots per key block: two vectors of scores */
#define VALUE_BLOCK 32 /* slots per value block: the key block's columns and widened rows, reused */
#define ROWS 6         /* query rows per register block, in both passes */

/* 0: not yet known; 1: AVX2 path; 2: portable path (no AVX2, AVX-512 present, or turned off). */
static int avx2_state;

static int cpu_wants_avx2(void) {
    return !cpu_has(CPU_AVX512F) && cpu_has_avx2_fma_f16c();
}

/* Turns the AVX2 path on (1, only where the CPU wants it) or off (0), or leaves it (-1); returns
 * whether it is on. For tests and benchmarks that compare it with the portable path in one process. */
int litekv_prefill_avx2(int enable) {
    if (enable >= 0 || !__atomic_load_n(&avx2_state, __ATOMIC_RELAXED))
        __atomic_store_n(&avx2_state, enable != 0 && cpu_wants_avx2() ? 1 : 2, __ATOMIC_RELAXED);
    return __atomic_load_n(&avx2_state, __ATOMIC_RELAXED) == 1;
}

int prefill_avx2_usable(int head_dim) {
    const int state = __atomic_load_n(&avx2_state, __ATOMIC_RELAXED);
    return head_dim % 8 == 0 && (state ? state == 1 : litekv_prefill_avx2(-1));
}

/* Whether m[0..31] are all masked: `<=` as in attention_common.h's all_masked, so a NaN counts alike. */
AVX2_INLINE int all_masked32(const float *m) {
    const __m256 below = _mm256_set1_ps(MASKED_BELOW);
    const __m256 a = _mm256_and_ps(_mm256_cmp_ps(_mm256_loadu_ps(m), below, _CMP_LE_OQ),
                                   _mm256_cmp_ps(_mm256_loadu_ps(m + 8), below, _CMP_LE_OQ));
    const __m256 b = _mm256_and_ps(_mm256_cmp_ps(_mm256_loadu_ps(m + 16), below, _CMP_LE_OQ),
                                   _mm256_cmp_ps(_mm256_loadu_ps(m + 24), below, _CMP_LE_OQ));
    return _mm256_movemask_ps(_mm256_and_ps(a, b)) == 0xFF;
}

/* mask_span (attention_common.h) 32 entries at a time: its 16-float vectors spill on AVX2, and a
 * chunk at the start of a 4,096-slot cache scans ~4,000 masked entries per row (with that scan, a
 * third of this path's time for 256 tokens at slot 0). */
TARGET void prefill_mask_span_avx2(const float *m, int slots, int *lo, int *hi) {
    int a = 0, b = slots - 1;
    while (a + 31 <= b && all_masked32(m + a)) a += 32;
    while (a <= b && m[a] <= MASKED_BELOW) a++;
    while (b - 31 >= a && all_masked32(m + b - 31)) b -= 32;
    while (b >= a && m[b] <= MASKED_BELOW) b--;
    *lo = a, *hi = b;
}

/* Slots s0..s0+count-1 of KV head kv as float rows, and the stride between them: float32 rows where
 * they lie, float16 or int8 codes widened into `buffer` [count][D] (codes times their row's scale). */
AVX2_INLINE const float *cache_rows(const PrefillJob *job, const void *cache, const float *scales, int s0, int count,
                                    int kv, float *restrict buffer, size_t *stride) {
    const int d = job->head_dim;
    const size_t at = (size_t)s0 * job->row + (size_t)kv * job->head_stride;
    if (job->cache_type == CACHE_F32) {
        *stride = (size_t)job->row;
        return (const float *)cache + at;
    }
    for (int i = 0; i < count; i++) {
        float *out = buffer + (size_t)i * d;
        const size_t from = at + (size_t)i * job->row;
        const __m256 scale = _mm256_set1_ps(row_scale(scales, job->slots, kv, s0 + i));
        if (job->cache_type == CACHE_F16) {
            const uint16_t *in = (const uint16_t *)cache + from;
            for (int j = 0; j < d; j += 8)
                _mm256_storeu_ps(out + j, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(in + j))));
        } else {
            const int8_t *in = (const int8_t *)cache + from;
            for (int j = 0; j < d; j += 8) {
                const __m256i codes = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(in + j)));
                __m256 x = _mm256_cvtepi32_ps(codes);
                if (scales) x = _mm256_mul_ps(x, scale);
                _mm256_storeu_ps(out + j, x);
            }
        }
    }
    *stride = (size_t)d;
    return buffer;
}

/* In place: lane j of r[i] becomes lane i of r[j]. */
AVX2_INLINE void transpose8(__m256 r[8]) {
    __m256 t[8], u[8];
    for (int i = 0; i < 4; i++) {
        t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 2; i++) { /* u[4i + b]: column b (and b + 4) of rows 4i..4i+3 */
        u[4 * i] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
        u[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
        u[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
        u[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
    }
    for (int b = 0; b < 4; b++) {
        r[b] = _mm256_permute2f128_ps(u[b], u[4 + b], 0x20);
        r[4 + b] = _mm256_permute2f128_ps(u[b], u[4 + b], 0x31);
    }
}

/* columns [D][16]: column d holds element d of key rows 0..15 (zero past `count`). */
AVX2_INLINE void key_columns(const float *k, size_t stride, int count, int d, float *restrict columns) {
    for (int half = 0; half < 2; half++) {
        for (int d0 = 0; d0 < d; d0 += 8) {
            __m256 r[8];
            for (int i = 0; i < 8; i++)
                r[i] = 8 * half + i < count ? _mm256_loadu_ps(k + (size_t)(8 * half + i) * stride + d0)
                                            : _mm256_setzero_ps();
            transpose8(r);
            for (int i = 0; i < 8; i++) _mm256_storeu_ps(columns + (size_t)(d0 + i) * KEY_BLOCK + 8 * half, r[i]);
        }
    }
}

/* Scores of `rows` (<= ROWS, a constant where inlined) query rows q [rows][D] against a key block's
 * columns, into s (rows `stride` apart): the sums stay in registers across the dimensions. */
AVX2_INLINE void score_block(const float *q, int d, const float *columns, float *s, size_t stride, const int rows) {
    __m256 a[ROWS][2];
    _Pragma("GCC unroll 6") for (int r = 0; r < rows; r++) a[r][0] = a[r][1] = _mm256_setzero_ps();
    _Pragma("GCC unroll 2") for (int j = 0; j < d; j++) {
        const __m256 k0 = _mm256_loadu_ps(columns + (size_t)j * KEY_BLOCK),
                     k1 = _mm256_loadu_ps(columns + (size_t)j * KEY_BLOCK + 8);
        _Pragma("GCC unroll 6") for (int r = 0; r < rows; r++) {
            const __m256 x = _mm256_broadcast_ss(q + (size_t)r * d + j);
            a[r][0] = _mm256_fmadd_ps(x, k0, a[r][0]);
            a[r][1] = _mm256_fmadd_ps(x, k1, a[r][1]);
        }
    }
    _Pragma("GCC unroll 6") for (int r = 0; r < rows; r++) {
        _mm256_storeu_ps(s + (size_t)r * stride, a[r][0]);
        _mm256_storeu_ps(s + (size_t)r * stride + 8, a[r][1]);
    }
}

/* acc [rows][D] (columns d0..d0 + 8 * width - 1, width 1 or 2) += weights [rows][count] (rows
 * `stride` apart) x value rows v [count] (`v_stride` apart, already offset by d0). */
AVX2_INLINE void weigh_block(float *acc, int d, const float *w, size_t stride, const float *v, size_t v_stride,
                             int count, const int rows, const int width) {
    __m256 a[ROWS][2];
    _Pragma("GCC unroll 6") for (int r = 0; r < rows; r++)
        _Pragma("GCC unroll 2") for (int c = 0; c < width; c++) a[r][c] = _mm256_loadu_ps(acc + (size_t)r * d + 8 * c);
    for (int j = 0; j < count; j++) {
        __m256 x[2];
        _Pragma("GCC unroll 2") for (int c = 0; c < width; c++) x[c] = _mm256_loadu_ps(v + (size_t)j * v_stride + 8 * c);
        _Pragma("GCC unroll 6") for (int r = 0; r < rows; r++) {
            const __m256 p = _mm256_broadcast_ss(w + (size_t)r * stride + j);
            _Pragma("GCC unroll 2") for (int c = 0; c < width; c++) a[r][c] = _mm256_fmadd_ps(p, x[c], a[r][c]);
        }
    }
    _Pragma("GCC unroll 6") for (int r = 0; r < rows; r++)
        _Pragma("GCC unroll 2") for (int c = 0; c < width; c++) _mm256_storeu_ps(acc + (size_t)r * d + 8 * c, a[r][c]);
}

/* The register blocks above with their row count (and width) made constants. */
TARGET static void score_rows(const float *q, int d, const float *columns, float *s, size_t stride, int rows) {
    switch (rows) {
    case 6: score_block(q, d, columns, s, stride, 6); break;
    case 5: score_block(q, d, columns, s, stride, 5); break;
    case 4: score_block(q, d, columns, s, stride, 4); break;
    case 3: score_block(q, d, columns, s, stride, 3); break;
    case 2: score_block(q, d, columns, s, stride, 2); break;
    default: score_block(q, d, columns, s, stride, 1);
    }
}

#define WEIGH_CASES(WIDTH)                                                       \
    switch (rows) {                                                              \
    case 6: weigh_block(acc, d, w, stride, v, v_stride, count, 6, WIDTH); break; \
    case 5: weigh_block(acc, d, w, stride, v, v_stride, count, 5, WIDTH); break; \
    case 4: weigh_block(acc, d, w, stride, v, v_stride, count, 4, WIDTH); break; \
    case 3: weigh_block(acc, d, w, stride, v, v_stride, count, 3, WIDTH); break; \
    case 2: weigh_block(acc, d, w, stride, v, v_stride, count, 2, WIDTH); break; \
    default: weigh_block(acc, d, w, stride, v, v_stride, count, 1, WIDTH);       \
    }

TARGET static void weigh_rows(float *acc, int d, const float *w, size_t stride, const float *v, size_t v_stride,
                              int count, int rows, int width) {
    if (width == 2) {
        WEIGH_CASES(2)
    } else {
        WEIGH_CASES(1)
    }
}

/* The largest of s[a..b], once m[a..b] is added to them if given: one pass over the scores. A NaN
 * score is passed over, as the portable path's comparisons do. */
AVX2_INLINE float add_and_max(float *restrict s, const float *restrict m, int a, int b) {
    __m256 top8 = _mm256_set1_ps(-INFINITY);
    int i = a;
    for (; i + 8 <= b + 1; i += 8) {
        __m256 x = _mm256_loadu_ps(s + i);
        if (m) {
            x = _mm256_add_ps(x, _mm256_loadu_ps(m + i));
            _mm256_storeu_ps(s + i, x);
        }
        top8 = _mm256_max_ps(x, top8); /* the second operand where either is NaN */
    }
    float top = horizontal_max(top8);
    for (; i <= b; i++) {
        if (m) s[i] += m[i];
        top = s[i] > top ? s[i] : top;
    }
    return top;
}

/* Row r's n scores become softmax numerators e^(score + mask - max), and their sum is returned; 0
 * (and zero numerators) if the row sees no slot. Without a mask, slots outside the row's own span
 * get a zero numerator. */
AVX2_INLINE float row_numerators(const PrefillJob *job, const Tile *t, int r, float *restrict s, int n) {
    int a = 0, b = n - 1; /* the entries that may count */
    const float *m = NULL;
    if (job->mask) {
        m = job->mask + (size_t)(t->t0 + r / t->group) * job->slots + t->lo;
    } else {
        int lo, hi;
        visible(job, t->t0 + r / t->group, &lo, &hi);
        a = lo - t->lo > 0 ? lo - t->lo : 0;
        b = hi - t->lo < n - 1 ? hi - t->lo : n - 1;
    }
    const float top = add_and_max(s, m, a, b);
    if (top <= MASKED_BELOW) { /* as the portable path tests it */
        memset(s, 0, sizeof(float) * (size_t)n);
        return 0.0f;
    }
    if (a > 0) memset(s, 0, sizeof(float) * (size_t)a);
    if (b < n - 1) memset(s + b + 1, 0, sizeof(float) * (size_t)(n - 1 - b));
    const __m256 shift = _mm256_set1_ps(top);
    __m256 sum = _mm256_setzero_ps();
    int i = a;
    for (; i + 8 <= b + 1; i += 8) {
        const __m256 e = exp_nonpositive8(_mm256_sub_ps(_mm256_loadu_ps(s + i), shift));
        _mm256_storeu_ps(s + i, e);
        sum = _mm256_add_ps(sum, e);
    }
    float total = horizontal_sum(sum);
    for (; i <= b; i++) {
        s[i] = exp_nonpositive(s[i] - top);
        total += s[i];
    }
    return total;
}

/* Scratch as the portable path lays it out: query rows [rows][D], value sums [rows][D], scores
 * [rows][stride], row sums, then 32 x D floats for a key block's columns and widened rows, or a
 * value block's widened rows. */
TARGET void prefill_tile_avx2(const PrefillJob *job, const Tile *t, float *scratch) {
    const int d = job->head_dim, rows = t->rows, n = t->hi - t->lo + 1;
    const size_t stride = (size_t)(n + KEY_BLOCK - 1) / KEY_BLOCK * KEY_BLOCK;
    float *q = scratch, *acc = q + (size_t)rows * d, *scores = acc + (size_t)rows * d;
    float *sums = scores + (size_t)rows * stride, *block = sums + (rows + 15) / 16 * 16;
    float *columns = block, *widened = block + (size_t)KEY_BLOCK * d;
    for (int r = 0; r < rows; r++) memcpy(q + (size_t)r * d, query_row_of(job, t, r), sizeof(float) * d);
    for (int j0 = 0; j0 < n; j0 += KEY_BLOCK) {
        const int count = n - j0 < KEY_BLOCK ? n - j0 : KEY_BLOCK;
        size_t k_stride;
        const float *k = cache_rows(job, job->keys, job->key_scales, t->lo + j0, count, t->kv, widened, &k_stride);
        key_columns(k, k_stride, count, d, columns);
        for (int r0 = 0; r0 < rows; r0 += ROWS)
            score_rows(q + (size_t)r0 * d, d, columns, scores + r0 * stride + j0, stride,
                       rows - r0 < ROWS ? rows - r0 : ROWS);
    }
    for (int r = 0; r < rows; r++) sums[r] = row_numerators(job, t, r, scores + r * stride, n);
    memset(acc, 0, sizeof(float) * (size_t)rows * d);
    for (int j0 = 0; j0 < n; j0 += VALUE_BLOCK) {
        const int count = n - j0 < VALUE_BLOCK ? n - j0 : VALUE_BLOCK;
        size_t v_stride;
        const float *v = cache_rows(job, job->values, job->value_scales, t->lo + j0, count, t->kv, block, &v_stride);
        for (int r0 = 0; r0 < rows; r0 += ROWS) {
            const int group = rows - r0 < ROWS ? rows - r0 : ROWS;
            for (int d0 = 0; d0 < d; d0 += 16)
                weigh_rows(acc + (size_t)r0 * d + d0, d, scores + r0 * stride + j0, stride, v + d0, v_stride, count,
                           group, d - d0 >= 16 ? 2 : 1);
        }
    }
    const float *os = job->out_scales ? job->out_scales + (size_t)t->kv * d : NULL;
    for (int r = 0; r < rows; r++) {
        float *o = out_row(job, t, r);
        const __m256 scale = _mm256_set1_ps(sums[r] > 0.0f ? 1.0f / sums[r] : 0.0f);
        for (int j = 0; j < d; j += 8) {
            __m256 x = _mm256_mul_ps(_mm256_loadu_ps(acc + (size_t)r * d + j), scale);
            if (os) x = _mm256_mul_ps(x, _mm256_loadu_ps(os + j));
            _mm256_storeu_ps(o + j, x);
        }
    }
}

#else /* not x86-64 with GCC or Clang: the portable path only */

int litekv_prefill_avx2(int enable) {
    (void)enable;
    return 0;
}

int prefill_avx2_usable(int head_dim) {
    (void)head_dim;
    return 0;
}

void prefill_tile_avx2(const PrefillJob *job, const Tile *t, float *scratch) {
    (void)job, (void)t, (void)scratch;
}

void prefill_mask_span_avx2(const float *m, int slots, int *lo, int *hi) { mask_span(m, slots, lo, hi); }

#endif
