/* The one-token linears' AVX2 path (linear.h), for x86-64 CPUs with AVX2, FMA and F16C but not
 * AVX-512 VNNI (AMD Zen 2 and 3, Intel before Ice Lake). It computes what the VNNI path in linear.c
 * does, with the same numbers: activations quantized to int8 per block of 32 (scale = largest
 * |x| / 127, rounded to nearest even), weights as stored, the products exact in integers.
 * - AVX2 has no vpdpbusd. vpmaddubsw (u8 x s8, adjacent pairs summed to int16, saturating) and
 *   vpmaddwd by ones (int16 pairs to int32) add the same, and nothing saturates (below).
 * - int4: a 32-byte span of a row holds 64 codes, two blocks. XOR 0x88 turns each signed nibble
 *   into code + 8, unsigned (LINEAR_UINT4 holds that already); the low nibbles meet the even
 *   activations and the high the odd (split out once per call), each int16 pair at most
 *   2 x 15 x 127 and both nibbles' 7,620. A span's low 128 bits hold its first block and the high
 *   its second, so 4 spans (8 blocks) add their pairs per block in int16 by unpacks and shuffles
 *   that keep the halves (at most 30,480), then vpmaddwd: one int32 per block, converted and
 *   scaled once per 8 blocks, in the order 0 2 4 6 | 1 3 5 7 (GROUP_ORDER: the activations' scales
 *   are prepared so, the weights' float16 scales shuffled so). The +8 comes off per block in float
 *   (-8 x the block's code sum x its scale), and the offsets' share is added per 8 blocks too.
 * - int8: |code| against the activation carrying the code's sign (vpsignb), a pair at most
 *   2 x 128 x 127; a span is one block.
 * - fp32: a float dot product per row, four sums, left to the hardware prefetchers.
 * A decode step's linears are bound by memory: SmolLM2's int4 step (92 MB) reads at 26-28 GB/s
 * with both threads where a plain read reaches 28-30; in cache a core computes int4 rows of 576
 * codes at 19 GB/s, of 1536 at 28, int8 at 33. Each thread reads one row at a time, a single
 * stream the hardware prefetchers follow: 2 or 4 rows interleaved computed faster in cache but
 * read the step 10-20 % slower. */
#include "linear.h"

#if LITEKV_LINEAR_AVX2
#include <string.h>

#include "avx2_common.h"
#include "linear_avx2_act.h"

#define TARGET AVX2_TARGET
#ifndef LINEAR_AVX2_PREFETCH
#define LINEAR_AVX2_PREFETCH 4096 /* bytes ahead: the hardware prefetcher stops at 4 KB pages */
#endif

int linear_cpu_has_avx2(void) {
    return cpu_has_avx2_fma_f16c();
}

/* ---- the prepared activations ------------------------------------------------------------- */

size_t linear_avx2_stride(const LinearJob *job) {
    const size_t floats = padded_blocks(job->in) * (job->format == LINEAR_INT8 ? 1 : 3);
    return ((size_t)job->in + sizeof(float) * floats + 63) / 64 * 64;
}

TARGET static inline int sum8i(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
    return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 1)));
}

/* Lane j: the sum of v[j]'s lanes. A row's sum, reduced on its own, ends a chain of dependent adds
 * that short rows (576 codes: 9 spans) could not hide; 8 rows at once take 21 instructions, not 48. */
TARGET static inline __m256 sums8(const __m256 v[8]) {
    __m256 pair[4], quad[2];
    for (int i = 0; i < 4; i++) /* lanes: v[2i] 0+1, 2+3, v[2i+1] 0+1, 2+3 | the same for lanes 4-7 */
        pair[i] = _mm256_add_ps(_mm256_shuffle_ps(v[2 * i], v[2 * i + 1], 0x88),
                                _mm256_shuffle_ps(v[2 * i], v[2 * i + 1], 0xDD));
    for (int i = 0; i < 2; i++) /* v[4i..4i+3], each a half's sum | the other half's */
        quad[i] = _mm256_add_ps(_mm256_shuffle_ps(pair[2 * i], pair[2 * i + 1], 0x88),
                                _mm256_shuffle_ps(pair[2 * i], pair[2 * i + 1], 0xDD));
    return _mm256_add_ps(_mm256_permute2f128_ps(quad[0], quad[1], 0x20),
                         _mm256_permute2f128_ps(quad[0], quad[1], 0x31));
}

typedef struct {
    __m256i codes; /* 32 int8, in order */
    float scale, sum;
    int code_sum;
} Block;

/* One block of 32 activations as the VNNI path quantizes it (linear.c, prepare_token). */
TARGET static inline Block quantize_block(const float *x) {
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 v[4], largest = _mm256_setzero_ps(), total = _mm256_setzero_ps();
    for (int i = 0; i < 4; i++) {
        v[i] = _mm256_loadu_ps(x + 8 * i);
        largest = _mm256_max_ps(largest, _mm256_and_ps(v[i], magnitude));
        total = _mm256_add_ps(total, v[i]);
    }
    const float m = horizontal_max(largest);
    const __m256 inverse = _mm256_set1_ps(m > 0.0f ? 127.0f / m : 0.0f);
    __m256i c[4], codes = _mm256_setzero_si256();
    for (int i = 0; i < 4; i++) {
        c[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inverse));
        codes = _mm256_add_epi32(codes, c[i]);
    }
    /* packs works within 128-bit lanes: dword k of the packed bytes holds c[k % 4][4 (k / 4) ..] */
    const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(c[0], c[1]), _mm256_packs_epi32(c[2], c[3]));
    return (Block){_mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)), m / 127.0f,
                   horizontal_sum(total), sum8i(codes)};
}

TARGET static void prepare_int4(const LinearJob *job, const float *x, int8_t *even, int8_t *odd, float *scales) {
    const int blocks = job->in / 32;
    float *bias = scales + padded_blocks(job->in), *sums = bias + padded_blocks(job->in);
    memset(scales, 0, 3 * sizeof(float) * padded_blocks(job->in));
    /* each 128-bit lane's even bytes, then its odd ones */
    const __m256i split = _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15,
                                           0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
    for (int b = 0; b < blocks; b++) {
        const Block q = quantize_block(x + 32 * b);
        const __m256i halves = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(q.codes, split), 0xD8);
        _mm_store_si128((__m128i *)(void *)(even + 16 * b), _mm256_castsi256_si128(halves));
        _mm_store_si128((__m128i *)(void *)(odd + 16 * b), _mm256_extracti128_si256(halves, 1));
        const int at = b / 8 * 8 + group_position(b % 8);
        scales[at] = q.scale, bias[at] = -8.0f * (float)q.code_sum * q.scale, sums[b] = q.sum;
    }
}

TARGET static void prepare_int8(const LinearJob *job, const float *x, int8_t *codes, float *scales) {
    const int blocks = job->in / 32;
    memset(scales, 0, sizeof(float) * padded_blocks(job->in));
    for (int b = 0; b < blocks; b++) {
        const Block q = quantize_block(x + 32 * b);
        _mm256_store_si256((__m256i *)(void *)(codes + 32 * b), q.codes);
        scales[b] = q.scale;
    }
}

void linear_avx2_prepare(const LinearJob *job) {
    for (int t = 0; t < job->tokens; t++) {
        const Act a = act(job, t);
        int8_t *even = (int8_t *)a.even;
        const float *x = job->x + (size_t)t * job->in;
        if (job->format == LINEAR_INT8)
            prepare_int8(job, x, even, (float *)a.scales);
        else
            prepare_int4(job, x, even, (int8_t *)a.odd, (float *)a.scales);
    }
}

/* ---- int4 ---------------------------------------------------------------------------------- */

/* A row's weights for one group of 8 blocks (`count` of them at the row's end, even): block scales
 * float16, in GROUP_ORDER, and offsets int8, as floats. A short group reads past its row when the
 * array goes on (the extra lanes zeroed), else copies. */
typedef struct {
    __m256 scales, offsets;
} GroupWeights;

TARGET static inline GroupWeights group_weights(const LinearJob *job, size_t at, int count, int past_end) {
    const __m128i order = _mm_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15);
    __m128i scales, offsets;
    if (count == 8 || !past_end) {
        scales = _mm_loadu_si128((const __m128i *)(const void *)(job->block_scales + at));
        offsets = _mm_loadl_epi64((const __m128i *)(const void *)(job->offsets + at));
        if (count < 8) {
            static const int8_t keep[32] = {-1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1};
            scales = _mm_and_si128(scales, _mm_loadu_si128((const __m128i *)(const void *)(keep + 16 - 2 * count)));
            offsets = _mm_and_si128(offsets, _mm_loadu_si128((const __m128i *)(const void *)(keep + 16 - count)));
        }
    } else {
        uint16_t s[8] = {0};
        int8_t o[16] = {0};
        memcpy(s, job->block_scales + at, sizeof(uint16_t) * (size_t)count);
        memcpy(o, job->offsets + at, (size_t)count);
        scales = _mm_loadu_si128((const __m128i *)(const void *)s);
        offsets = _mm_loadu_si128((const __m128i *)(const void *)o);
    }
    return (GroupWeights){_mm256_cvtph_ps(_mm_shuffle_epi8(scales, order)),
                          _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(offsets))};
}

#define INLINE_ALWAYS static inline __attribute__((always_inline))

/* The +8 codes' products with one span of activations, as int16 pairs: lanes 0-7 the span's first
 * block's, 8-15 its second's, each at most 2 (2 x 15 x 127) = 7,620. */
TARGET INLINE_ALWAYS __m256i int4_pairs(const uint8_t *w, const int flip, __m256i even, __m256i odd) {
    const __m256i low = _mm256_set1_epi8(0x0F);
    __m256i codes = _mm256_loadu_si256((const __m256i *)(const void *)w);
    if (flip) codes = _mm256_xor_si256(codes, _mm256_set1_epi8((char)0x88));
    const __m256i lo = _mm256_and_si256(codes, low), hi = _mm256_and_si256(_mm256_srli_epi16(codes, 4), low);
    return _mm256_add_epi16(_mm256_maddubs_epi16(lo, even), _mm256_maddubs_epi16(hi, odd));
}

/* Four spans' pairs (8 blocks) summed to one int32 per block, in GROUP_ORDER: in each 128-bit lane
 * (a block of each span) int16 sums of 2, then 4 pairs (at most 30,480), then vpmaddwd. 12
 * instructions for 4 spans, against 16 to scale each span's lanes on their own (vphaddw takes 2
 * cycles here). */
TARGET INLINE_ALWAYS __m256i group_dots(__m256i p0, __m256i p1, __m256i p2, __m256i p3) {
    const __m256i q01 = _mm256_add_epi16(_mm256_unpacklo_epi64(p0, p1), _mm256_unpackhi_epi64(p0, p1)),
                  q23 = _mm256_add_epi16(_mm256_unpacklo_epi64(p2, p3), _mm256_unpackhi_epi64(p2, p3));
    const __m256 a = _mm256_castsi256_ps(q01), b = _mm256_castsi256_ps(q23);
    const __m256i quads = _mm256_add_epi16(_mm256_castps_si256(_mm256_shuffle_ps(a, b, 0x88)),
                                           _mm256_castps_si256(_mm256_shuffle_ps(a, b, 0xDD)));
    return _mm256_madd_epi16(quads, _mm256_set1_epi16(1));
}

/* A row's sums so far, in GROUP_ORDER lanes: the codes' (with their scales) and the offsets'. */
typedef struct {
    __m256 codes, offsets;
} RowSums;

/* One group of `count` blocks (8, or fewer at a row's end) of row o, from its codes w: the blocks'
 * dot products times the activations' scales, plus the bias (-8 x the codes' sum x scale), times
 * the weights' scales; the offsets times the activations' sums (the row's offset scale comes
 * later). flip and count are constants in each caller, so the loops unroll. */
TARGET INLINE_ALWAYS RowSums int4_block_group(const LinearJob *job, const Act *a, int o, const uint8_t *w, int g,
                                              const int count, const int flip, RowSums sums) {
    const int blocks = job->in / 32;
    __m256i pairs[4];
    for (int c = 0; c < 4; c++) {
        const size_t span = 16 * (size_t)g + 32 * (size_t)c;
        if (c < count / 2) {
            if (c % 2 == 0) __builtin_prefetch(w + span + LINEAR_AVX2_PREFETCH, 0, 2);
            pairs[c] = int4_pairs(w + span, flip, _mm256_load_si256((const __m256i *)(const void *)(a->even + span)),
                                  _mm256_load_si256((const __m256i *)(const void *)(a->odd + span)));
        } else {
            pairs[c] = _mm256_setzero_si256();
        }
    }
    const size_t at = (size_t)o * blocks + g;
    const GroupWeights gw = group_weights(job, at, count, count < 8 && at + 8 > (size_t)job->out * blocks);
    const __m256 dots = _mm256_cvtepi32_ps(group_dots(pairs[0], pairs[1], pairs[2], pairs[3]));
    const __m256 x_side = _mm256_fmadd_ps(dots, _mm256_load_ps(a->scales + g), _mm256_load_ps(a->bias + g));
    return (RowSums){_mm256_fmadd_ps(x_side, gw.scales, sums.codes),
                     _mm256_fmadd_ps(gw.offsets, _mm256_load_ps(a->sums + g), sums.offsets)};
}

/* Row o of one token, its sum not yet added across lanes. */
TARGET INLINE_ALWAYS __m256 int4_row(const LinearJob *job, const Act *a, int o, const int flip) {
    const int blocks = job->in / 32;
    const uint8_t *w = (const uint8_t *)job->codes + (size_t)o * (size_t)(job->in / 2);
    RowSums sums = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    int g = 0;
    for (; g + 8 <= blocks; g += 8) sums = int4_block_group(job, a, o, w, g, 8, flip, sums);
    switch (blocks - g) { /* in is a multiple of 64: whole spans */
    case 2: sums = int4_block_group(job, a, o, w, g, 2, flip, sums); break;
    case 4: sums = int4_block_group(job, a, o, w, g, 4, flip, sums); break;
    case 6: sums = int4_block_group(job, a, o, w, g, 6, flip, sums); break;
    default: break;
    }
    return _mm256_fmadd_ps(sums.offsets, _mm256_broadcast_ss(job->row_scales + o), sums.codes);
}

/* One row at a time (a single stream), their sums added across lanes 8 rows at a time. */
TARGET INLINE_ALWAYS void int4_rows_of(const LinearJob *job, int first, int last, const int flip) {
    for (int t = 0; t < job->tokens; t++) {
        const Act a = act(job, t);
        float *y = job->y + (size_t)t * job->out;
        int o = first;
        for (; o + 8 <= last; o += 8) {
            __m256 v[8];
            for (int i = 0; i < 8; i++) v[i] = int4_row(job, &a, o + i, flip);
            _mm256_storeu_ps(y + o, sums8(v));
        }
        for (; o < last; o++) y[o] = horizontal_sum(int4_row(job, &a, o, flip));
    }
}

TARGET static void int4_rows(const LinearJob *job, int first, int last) {
    if (job->format == LINEAR_INT4)
        int4_rows_of(job, first, last, 1);
    else
        int4_rows_of(job, first, last, 0);
}

/* ---- int8 and fp32 ------------------------------------------------------------------------- */

/* One block of 32 codes: acc + their dot product with the activations times the activations' scale. */
TARGET INLINE_ALWAYS __m256 int8_block(const int8_t *w, const Act *a, int k, __m256 acc) {
    const __m256i x = _mm256_load_si256((const __m256i *)(const void *)(a->even + k)),
                  codes = _mm256_loadu_si256((const __m256i *)(const void *)(w + k));
    const __m256i pairs = _mm256_maddubs_epi16(_mm256_abs_epi8(codes), _mm256_sign_epi8(x, codes));
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, _mm256_set1_epi16(1))),
                           _mm256_broadcast_ss(a->scales + k / 32), acc);
}

/* Row o of one token, its sum not yet added across lanes or scaled. Two sums, even and odd blocks:
 * one chain of FMAs (4 cycles each) held a row to 8 bytes a cycle. */
TARGET INLINE_ALWAYS __m256 int8_row(const LinearJob *job, const Act *a, int o) {
    const int in = job->in;
    const int8_t *w = (const int8_t *)job->codes + (size_t)o * in;
    __m256 even = _mm256_setzero_ps(), odd = _mm256_setzero_ps();
    int k = 0;
    for (; k + 64 <= in; k += 64) {
        __builtin_prefetch(w + k + LINEAR_AVX2_PREFETCH, 0, 2);
        even = int8_block(w, a, k, even);
        odd = int8_block(w, a, k + 32, odd);
    }
    if (k < in) even = int8_block(w, a, k, even);
    return _mm256_add_ps(even, odd);
}

TARGET static void int8_rows(const LinearJob *job, int first, int last) {
    for (int t = 0; t < job->tokens; t++) {
        const Act a = act(job, t);
        float *y = job->y + (size_t)t * job->out;
        int o = first;
        for (; o + 8 <= last; o += 8) {
            __m256 v[8];
            for (int i = 0; i < 8; i++) v[i] = int8_row(job, &a, o + i);
            _mm256_storeu_ps(y + o, _mm256_mul_ps(sums8(v), _mm256_loadu_ps(job->row_scales + o)));
        }
        for (; o < last; o++) y[o] = job->row_scales[o] * horizontal_sum(int8_row(job, &a, o));
    }
}

/* Lanes below n (0-8) set: a partial vector's mask for vmaskmov. */
TARGET static inline __m256i first_lanes(int n) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

/* One row at a time: a single stream per thread, which the hardware prefetchers follow. Software
 * prefetches, which the int4 and int8 rows gain from, cost float rows: a whole SmolLM2 fp32 step's
 * 538 MB took 19.4 ms with them and 17.2 without, and ONNX fp32 (its LM head here) decoded at
 * 58.9 tok/s with them against 60.7 (bench/PERFORMANCE.md, twentieth round). */
TARGET static void f32_rows(const LinearJob *job, int first, int last) {
    const int in = job->in;
    for (int t = 0; t < job->tokens; t++) {
        const float *x = job->x + (size_t)t * in;
        for (int o = first; o < last; o++) {
            const float *w = (const float *)job->codes + (size_t)o * in;
            __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
            int k = 0;
            for (; k + 32 <= in; k += 32) {
                for (int i = 0; i < 4; i++)
                    acc[i] = _mm256_fmadd_ps(_mm256_loadu_ps(w + k + 8 * i), _mm256_loadu_ps(x + k + 8 * i), acc[i]);
            }
            for (; k < in; k += 8) {
                const __m256i m = first_lanes(in - k);
                acc[0] = _mm256_fmadd_ps(_mm256_maskload_ps(w + k, m), _mm256_maskload_ps(x + k, m), acc[0]);
            }
            job->y[(size_t)t * job->out + o] =
                horizontal_sum(_mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3])));
        }
    }
}

/* LINEAR_INT8_FLOAT (a screened head's screen): int8 codes widened to float against x as it is, so the
 * row's error is its codes' rounding alone. 8 rows at once share the reduction, as int8_rows do; the
 * read-bound rows prefetch as theirs (a quarter of an fp32 head's bytes: 28 MB for SmolLM2). */
TARGET static inline __m256 int8_float_row(const int8_t *w, const float *x, int in) {
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    int k = 0;
    for (; k + 32 <= in; k += 32) {
        __builtin_prefetch(w + k + LINEAR_AVX2_PREFETCH, 0, 2);
        for (int i = 0; i < 4; i++) {
            const __m256i codes = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(const void *)(w + k + 8 * i)));
            acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(codes), _mm256_loadu_ps(x + k + 8 * i), acc[i]);
        }
    }
    float tail = 0.0f;
    for (; k < in; k++) tail += (float)w[k] * x[k];
    const __m256 sum = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
    return _mm256_add_ps(sum, _mm256_setr_ps(tail, 0, 0, 0, 0, 0, 0, 0));
}

TARGET static void int8_float_rows(const LinearJob *job, int first, int last) {
    const int in = job->in;
    const int8_t *codes = job->codes;
    for (int t = 0; t < job->tokens; t++) {
        const float *x = job->x + (size_t)t * in;
        float *y = job->y + (size_t)t * job->out;
        int o = first;
        for (; o + 8 <= last; o += 8) {
            __m256 v[8];
            for (int i = 0; i < 8; i++) v[i] = int8_float_row(codes + (size_t)(o + i) * in, x, in);
            _mm256_storeu_ps(y + o, _mm256_mul_ps(sums8(v), _mm256_loadu_ps(job->row_scales + o)));
        }
        for (; o < last; o++) y[o] = job->row_scales[o] * horizontal_sum(int8_float_row(codes + (size_t)o * in, x, in));
    }
}

void linear_avx2_rows(const LinearJob *job, int first, int last) {
    if (linear_avx2_tiles_take(job)) { /* whole tiles, then any rows left */
        const int tiled = first + (last - first) / LINEAR_TILE_ROWS * LINEAR_TILE_ROWS;
        linear_avx2_tiles(job, first, tiled);
        first = tiled;
    }
    (linear_format_int4(job->format)         ? int4_rows
     : job->format == LINEAR_F32             ? f32_rows
     : job->format == LINEAR_INT8_FLOAT      ? int8_float_rows
                                             : int8_rows)(job, first, last);
}

/* ---- gates --------------------------------------------------------------------------------- */

/* e^x for 8 lanes as linear.c's exp16: x = n ln 2 + r, e^r by its Taylor series to r^7, times 2^n
 * built from its exponent bits (no vscalefps in AVX2; n stays within the normal range). */
TARGET static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145752f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.42860677e-6f), r); /* ln 2 in two parts: r stays exact */
    __m256 p = _mm256_set1_ps(1.0f / 5040);
    static const float taylor[] = {1.0f / 720, 1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f};
    for (int i = 0; i < 7; i++) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(taylor[i]));
    const __m256i two_n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(two_n));
}

TARGET static inline __m256 gate8(__m256 x, int gate) {
    const __m256 one = _mm256_set1_ps(1.0f);
    if (gate == LINEAR_GATE_SILU)
        return _mm256_div_ps(x, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), x))));
    /* 0.5 x (1 + tanh y) = x (1 - 1 / (e^(2y) + 1)) */
    const __m256 cubic = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_set1_ps(0.044715f), x), _mm256_mul_ps(x, x), x);
    const __m256 y = _mm256_mul_ps(_mm256_set1_ps(0.7978845608f), cubic);
    const __m256 e = exp8(_mm256_add_ps(y, y));
    return _mm256_mul_ps(x, _mm256_sub_ps(one, _mm256_div_ps(one, _mm256_add_ps(e, one))));
}

TARGET void linear_avx2_gate(const float *g, const float *u, float *out, size_t n, int gate) {
    size_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(out + i, _mm256_mul_ps(gate8(_mm256_loadu_ps(g + i), gate), _mm256_loadu_ps(u + i)));
    if (i < n) { /* the tail, masked */
        const __m256i m = first_lanes((int)(n - i));
        const __m256 act = gate8(_mm256_maskload_ps(g + i, m), gate);
        _mm256_maskstore_ps(out + i, m, _mm256_mul_ps(act, _mm256_maskload_ps(u + i, m)));
    }
}
#endif
