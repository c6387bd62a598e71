/* What the attention kernels share: the jobs a call hands a thread, the float vector type, the
 * softmax's exponential, and the prefetch distance. */
#ifndef LITEKV_ATTENTION_COMMON_H
#define LITEKV_ATTENTION_COMMON_H

#include <stdint.h>
#include <string.h>

#include "cpu_isa.h"

#define MASKED_BELOW (-1e30f)
/* Helpers are inlined into the ISA-specific functions, so each gets its own vector code. */
#define INLINE static inline __attribute__((always_inline))

/* n rounded up to a multiple of `to` */
static inline size_t round_up(size_t n, size_t to) { return (n + to - 1) / to * to; }

/* Built where it runs, but possibly for a wider family (a wheel): pick AVX-512 or AVX2 at load. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define VECTOR_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define VECTOR_CLONES
#endif

/* 16 floats; GCC and Clang lower it to one AVX-512 register, two AVX2 registers, or four SSE ones. */
typedef float v16 __attribute__((vector_size(64)));

INLINE v16 load16(const float *p) {
    v16 v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* Whether all of m[0..15] are masked: one vector compare, folded in halves (testing the lanes one
 * by one compiles to 16 extractions). `<=` as in the scalar tests, so a NaN counts alike in both. */
INLINE int all_masked(const float *m) {
    typedef int32_t v16i __attribute__((vector_size(64)));
    typedef int32_t v8i __attribute__((vector_size(32)));
    typedef int32_t v4i __attribute__((vector_size(16)));
    const v16i masked = load16(m) <= MASKED_BELOW;
    const v8i half = __builtin_shufflevector(masked, masked, 0, 1, 2, 3, 4, 5, 6, 7) &
                     __builtin_shufflevector(masked, masked, 8, 9, 10, 11, 12, 13, 14, 15);
    const v4i quarter = __builtin_shufflevector(half, half, 0, 1, 2, 3) & __builtin_shufflevector(half, half, 4, 5, 6, 7);
    return (quarter[0] & quarter[1] & quarter[2] & quarter[3]) != 0;
}

/* The unmasked span lo..hi of a mask row, or lo > hi. A short context in a long cache, or a
 * sliding window, leaves long masked ends, and every call scans them: 16 entries at a time, then
 * one at a time. */
INLINE void mask_span(const float *m, int slots, int *lo, int *hi) {
    int a = 0, b = slots - 1;
    while (a + 15 <= b && all_masked(m + a)) a += 16;
    while (a <= b && m[a] <= MASKED_BELOW) a++;
    while (b - 15 >= a && all_masked(m + b - 15)) b -= 16;
    while (b >= a && m[b] <= MASKED_BELOW) b--;
    *lo = a, *hi = b;
}

/* What a cache holds, as the op names say: float32 ("litekv.decode_attention"), int8 codes of a
 * statically scaled cache ("_int8"), float16 ("_f16", half a float32 cache's bytes to read), or
 * int8 codes with a scale per row ("_int8_rows"): each slot's head vector quantized on its own as
 * it was written, its float32 scale in a [KVH][S] tensor beside the codes (each KV head's scales
 * contiguous, as the kernels read them), for keys and values. */
typedef enum { CACHE_F32 = 0, CACHE_I8 = 1, CACHE_F16 = 2, CACHE_I8_ROWS = 3 } CacheType;

INLINE int valid_cache_type(int type) { return type >= CACHE_F32 && type <= CACHE_I8_ROWS; }

INLINE int int8_codes(int type) { return type == CACHE_I8 || type == CACHE_I8_ROWS; }

INLINE size_t cache_element_bytes(int type) { return int8_codes(type) ? 1 : type == CACHE_F16 ? 2 : 4; }

/* A float16's bits as a float, in integer and float arithmetic that vectorizes: GCC converts
 * _Float16 one element at a time without AVX512-FP16. The multiply rebases the exponent (15 to
 * 127), which also makes subnormals exact; infinities and NaNs keep an all-ones exponent. */
INLINE float half_to_float(uint16_t h) {
    const uint32_t magnitude = (uint32_t)(h & 0x7fffu) << 13, sign = (uint32_t)(h & 0x8000u) << 16;
    union { uint32_t u; float f; } x = {magnitude};
    x.f *= 0x1p112f;
    if ((h & 0x7c00u) == 0x7c00u) x.u = magnitude | 0x7f800000u;
    x.u |= sign;
    return x.f;
}

/* x rounded to the nearest float16 (ties to even), as its bits: what a builtin CAST to float16 stores.
 * In integer arithmetic, so it holds under the library's -fassociative-math. */
INLINE uint16_t float_to_half(float value) {
    union { float f; uint32_t u; } x = {value};
    const uint16_t sign = (uint16_t)((x.u >> 16) & 0x8000u);
    const uint32_t f = x.u & 0x7fffffffu;
    if (f >= 0x7f800000u) return sign | (f > 0x7f800000u ? 0x7e00u : 0x7c00u); /* NaN, infinity */
    if (f >= 0x477ff000u) return sign | 0x7c00u;                              /* 65,520 and above round to infinity */
    const uint32_t exponent = f >> 23, mantissa = (f & 0x7fffffu) | 0x800000u;
    /* a normal half keeps 10 of the 23 mantissa bits; below 2^-14 a subnormal keeps fewer */
    const uint32_t shift = exponent >= 113 ? 13 : 126 - exponent;
    if (shift > 24) return sign; /* below 2^-25: rounds to zero */
    uint32_t bits = exponent >= 113 ? ((exponent - 112) << 10) | ((f & 0x7fffffu) >> 13) : mantissa >> shift;
    const uint32_t rest = (exponent >= 113 ? f : mantissa) & ((1u << shift) - 1), halfway = 1u << (shift - 1);
    bits += rest > halfway || (rest == halfway && (bits & 1u)); /* a carry moves into the exponent, as it should */
    return sign | (uint16_t)bits;
}

/* count float16 values (their bits) as floats. With AVX-512, 16 per instruction (vcvtph2ps); a
 * call widens a block of rows, so the check and the call are per block, not per element. */
#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
__attribute__((target("avx512f"))) static void widen_halves_avx512(float *restrict out, const uint16_t *restrict in,
                                                                  size_t count) {
    size_t i = 0;
    for (; i + 16 <= count; i += 16) _mm512_storeu_ps(out + i, _mm512_cvtph_ps(_mm256_loadu_si256((const void *)(in + i))));
    for (; i < count; i++) out[i] = half_to_float(in[i]);
}
#endif
INLINE void widen_halves(float *restrict out, const uint16_t *restrict in, size_t count) {
#if defined(__x86_64__) && defined(__GNUC__)
    if (cpu_has(CPU_AVX512F)) {
        widen_halves_avx512(out, in, count);
        return;
    }
#endif
    for (size_t i = 0; i < count; i++) out[i] = half_to_float(in[i]);
}

/* Elements at..at+count-1 of an int8 (element_bytes 1) or float16 (2) cache as floats: plain
 * loops, which the vectorizer turns into widening loads (vpmovsxbd) and conversions, where
 * converting vector-extension types went lane by lane. `element_bytes` is a constant where this
 * is inlined, so one loop remains. */
INLINE void widen(float *restrict out, const void *restrict cache, size_t element_bytes, size_t at, size_t count) {
    if (element_bytes == 1) {
        const int8_t *restrict in = (const int8_t *)cache + at;
        for (size_t i = 0; i < count; i++) out[i] = (float)in[i];
    } else {
        widen_halves(out, (const uint16_t *)cache + at, count);
    }
}

/* Element i of a cache as a float (an int8 code unscaled). */
INLINE float element(const void *base, size_t i, int type) {
    return int8_codes(type)    ? (float)((const int8_t *)base)[i]
           : type == CACHE_F16 ? half_to_float(((const uint16_t *)base)[i])
                               : ((const float *)base)[i];
}

/* The scale of slot s's row of KV head kv: scales [KVH][slots], or 1 without them. */
INLINE float row_scale(const float *scales, int slots, int kv, int s) {
    return scales ? scales[(size_t)kv * slots + s] : 1.0f;
}

typedef int32_t i32x16 __attribute__((vector_size(64)));

INLINE v16 max16(v16 a, v16 b) {
    const i32x16 greater = a > b;
    return (v16)((greater & (i32x16)a) | (~greater & (i32x16)b));
}

/* The largest of x[0..n-1] (n >= 1), 16 lanes at a time. */
INLINE float max_of(const float *x, int n) {
    float best = x[0];
    int i = 0;
    if (n >= 16) {
        v16 m = load16(x);
        for (i = 16; i + 16 <= n; i += 16) m = max16(m, load16(x + i));
        for (int j = 0; j < 16; j++) best = m[j] > best ? m[j] : best;
    }
    for (; i < n; i++) best = x[i] > best ? x[i] : best;
    return best;
}

/* The query for the integer dot-product paths, made once per call. AVX-512 VNNI: two int8 digits
 * per element, head h's q ~ unit[h] * (128 * hi + lo), and offset[h] = 128 * (128 * sum(hi) +
 * sum(lo)), what adding 128 to every key code adds to a dot product. AVX2: one int16 word per
 * element, q ~ unit[h] * words (the bytes of hi and lo). */
typedef struct {
    int8_t *hi, *lo; /* [heads][D] */
    int32_t *offset;
    float *unit;
    int16_t *words; /* [heads][D], where hi and lo are */
} Digits;

typedef struct {
    const float *query, *mask;
    const void *keys, *values;          /* elements of `cache_type` */
    const float *key_scales, *value_scales; /* CACHE_I8_ROWS: [KVH][scale_stride] row scales; else NULL */
    int scale_stride;                   /* the cache's slots */
    int cache_type, int8_dot;           /* int8_dot: an Int8Dot path for int8 codes (INT8_DOT_NONE: widened) */
    int heads, kv_heads, head_dim, row; /* row: elements from one slot to the next */
    float *scores;                      /* [heads][stride]: column i is slot lo + i */
    int stride;
    const Digits *digits;               /* int8_dot: the query's digits, made once per call */
    size_t head_stride; /* elements from one KV head's row to the next: D in a [S][KVH * D] cache (row =
                           KVH * D); S * D in ONNX Runtime's head-major [KVH][S][D] (row = D, float only) */
    int key_blocks;     /* int8 keys stored in blocks of KEY_BLOCK_SLOTS slots (key_block_offset), not rows */
} Job;

/* Keys in blocks (Job.key_blocks): int8 codes of KEY_BLOCK_SLOTS consecutive slots, per dimension pair
 * the block's slots side by side ([D / 2][KEY_BLOCK_SLOTS][2] per KV head), so one vpmaddwd against a
 * broadcast pair of query words adds a pair of dimensions to the scores of all KEY_BLOCK_SLOTS slots, and
 * no reduction tree ends a slot's dot product. A block holds every KV head's ([S / KEY_BLOCK_SLOTS][KVH]
 * [D / 2][KEY_BLOCK_SLOTS][2] for a [S][KVH * D] cache, Job.row = KVH * D), or each KV head's blocks are
 * contiguous (head-major, [KVH][S / KEY_BLOCK_SLOTS][...], Job.row = D). Slots: a multiple of KEY_BLOCK_SLOTS. */
#define KEY_BLOCK_SLOTS 8

/* The offset of slot s's block of KV head kv (the code of dimension c: + (c / 2) * 2 * KEY_BLOCK_SLOTS +
 * (s % KEY_BLOCK_SLOTS) * 2 + c % 2). */
INLINE size_t key_block_offset(size_t row, size_t head_stride, int head_dim, int s, int kv) {
    const size_t head = head_stride == (size_t)head_dim ? (size_t)KEY_BLOCK_SLOTS * head_dim : head_stride;
    return (size_t)(s / KEY_BLOCK_SLOTS) * KEY_BLOCK_SLOTS * row + (size_t)kv * head;
}

/* Or'ed into a cache type at the host-array entry points (litekv_attention_run and its kin): int8
 * keys in blocks. */
#define CACHE_KEY_BLOCKS 0x100

/* Whether a cache of `slots` slots and this head_dim can hold its keys in blocks: whole blocks, and
 * dimensions in pairs. */
INLINE int key_blocks_fit(int64_t slots, int head_dim) { return slots % KEY_BLOCK_SLOTS == 0 && head_dim % 2 == 0; }
INLINE size_t key_block_code(int s, int c) { return (size_t)(c / 2) * 2 * KEY_BLOCK_SLOTS + (size_t)(s % KEY_BLOCK_SLOTS) * 2 + c % 2; }

/* Rows lo..hi of blocked int8 keys (key_block_offset) written as rows (Job.row, head_stride) to
 * `rows`, at the same offsets a row cache puts them: for the paths that read rows. A dimension
 * pair moves as one 16-bit unit. */
INLINE void unblock_keys(int8_t *restrict rows, const int8_t *restrict blocks, size_t row, size_t head_stride,
                         int head_dim, int kv_heads, int lo, int hi) {
    for (int s = lo; s <= hi; s++)
        for (int kv = 0; kv < kv_heads; kv++) {
            const int8_t *block = blocks + key_block_offset(row, head_stride, head_dim, s, kv) + key_block_code(s, 0);
            int8_t *out = rows + (size_t)s * row + (size_t)kv * head_stride;
            for (int p = 0; p < head_dim / 2; p++) memcpy(out + 2 * p, block + (size_t)p * 2 * KEY_BLOCK_SLOTS, 2);
        }
}

/* The rows of slots lo..hi (`rows` at slot lo's, `row` elements apart, KV head kv's D at kv *
 * head_dim in a row) written into blocked keys of that row and head stride. */
INLINE void block_keys(int8_t *restrict blocks, const int8_t *restrict rows, size_t row, size_t head_stride,
                       int head_dim, int kv_heads, int lo, int hi, size_t rows_row) {
    for (int s = lo; s <= hi; s++)
        for (int kv = 0; kv < kv_heads; kv++) {
            int8_t *block = blocks + key_block_offset(row, head_stride, head_dim, s, kv) + key_block_code(s, 0);
            const int8_t *in = rows + (size_t)(s - lo) * rows_row + (size_t)kv * head_dim;
            for (int p = 0; p < head_dim / 2; p++) memcpy(block + (size_t)p * 2 * KEY_BLOCK_SLOTS, in + 2 * p, 2);
        }
}

typedef struct {
    int lo, hi, first; /* slots lo..hi; their scores start at column `first` */
    float *acc;        /* [heads * D] weighted values, not yet divided by the sum */
    float *max, *sum;  /* [heads] */
    int16_t *numerators; /* [heads][numerator_stride]: softmax numerators * 32767 (int8_dot only) */
    int numerator_stride;
} Part;

/* Threads a caller lends for one call's decode chunks, in place of the helper thread (ort_ops.c:
 * ONNX Runtime's pool, whose worker is awake between the nodes of its session). run(pool, worker,
 * data) calls worker(data, w) for w = 0 and 1 at once and returns when both have; it returns 0, or
 * nonzero if it could not run them, and then the caller runs the chunks left itself. */
typedef struct {
    int (*run)(void *pool, void (*worker)(void *, size_t), void *data);
    void *pool;
} LentThreads;

/* e^x for x <= 0 (a score minus a maximum), 0 below -87: 2^n * 2^f with a degree-6 polynomial
 * for 2^f, f in [-0.5, 0.5], relative error ~2e-7. Plain arithmetic, so loops over it vectorize. */
INLINE float exp_nonpositive(float x) {
    const float t = (x < -87.0f ? -87.0f : x) * 1.44269504f;
    const float n = __builtin_floorf(t + 0.5f), f = t - n;
    float p = 1.5403530e-4f;
    p = p * f + 1.3333558e-3f;
    p = p * f + 9.6181291e-3f;
    p = p * f + 5.5504109e-2f;
    p = p * f + 2.4022651e-1f;
    p = p * f + 6.9314718e-1f;
    p = p * f + 1.0f;
    union { uint32_t u; float f; } scale = {(uint32_t)((int32_t)n + 127) << 23};
    return x < -87.0f ? 0.0f : p * scale.f;
}

/* A prefill chunk's attention (prefill_attention.c): tokens query rows of every head against the
 * cache, each row attending where its mask row is unmasked. Cut into prefill_tasks() independent
 * tasks (a tile of tokens), which threads take in any order, each with its own
 * scratch of prefill_scratch_floats() floats. */
typedef struct {
    const float *query, *mask;          /* [tokens][heads * D] (scaled), [tokens][slots]; see `first` */
    const void *keys, *values;          /* [slots][row]: elements of `cache_type` */
    const float *key_scales, *value_scales; /* CACHE_I8_ROWS: [KVH][slots] row scales; else NULL */
    float *out;                         /* [tokens][heads * D] */
    int cache_type, tokens, slots, heads, kv_heads, head_dim, row;
    size_t head_stride; /* elements from one KV head's row to the next (Job.head_stride) */
    /* No mask: causal, token t at slot first + t sees slots first + t - window + 1 .. first + t
     * (window 0: from slot 0), as ONNX Runtime's op computes it rather than reading a mask */
    int first, window;
    const float *out_scales; /* [KVH][D]: each output row times its KV head's (an int8 cache's static
                                value scales, on codes weighed as they are); NULL: none */
} PrefillJob;

int prefill_tasks(const PrefillJob *job);
size_t prefill_scratch_floats(int heads, int head_dim, int max_slots);
void prefill_task(const PrefillJob *job, int task, float *scratch);

#ifndef PREFETCH_ROWS
#define PREFETCH_ROWS 32 /* slots ahead: software prefetch crosses the 4 KB pages hardware stops at */
#endif
#ifndef PREFETCH_LOCALITY
#define PREFETCH_LOCALITY 2 /* into L2, which takes more misses in flight than L1 */
#endif

/* How int8 codes are multiplied as integers (Job.int8_dot, decided once per state): AVX-512 VNNI's
 * vpdpbusd (attention_int8_dot.c), AVX2's vpmaddwd (decode_attention_avx2.c), or not at all. */
typedef enum { INT8_DOT_NONE = 0, INT8_DOT_AVX2 = 1, INT8_DOT_VNNI = 2 } Int8Dot;

/* Head h's weighted values times units[h]: integer sums brought to the units of the float ones. */
INLINE void scale_heads(float *acc, const float *units, int heads, int d) {
    for (int h = 0; h < heads; h++)
        for (int j = 0; j < d; j++) acc[(size_t)h * d + j] *= units[h];
}

/* AVX-512 VNNI integer dot products for int8 caches (attention_int8_dot.c), on x86-64 CPUs that
 * have them: the part the float path would compute, with acc and sum in other units (their ratio
 * is the same). A head row is whole 64-byte lines, and int32 holds its scores up to 256. */
INLINE int int8_dot_head_dim(int head_dim) { return head_dim % 64 == 0 && head_dim <= 256; }
#if defined(__x86_64__) && defined(__GNUC__)
#define LITEKV_INT8_DOT 1
int litekv_cpu_has_int8_dot(void);
void int8_dot_digits(const Job *job, Digits *out);
void attend_part_int8_dot(const Job *job, Part *part);
#else
#define LITEKV_INT8_DOT 0
#endif

/* Decode attention with AVX2, FMA and F16C (decode_attention_avx2.c), on x86-64 CPUs that have
 * them and no AVX-512 (where decode_attention.c's 16-float vectors are one register): every cache
 * type, head_dim a multiple of 32 (a head's row is whole 8-float vectors, 32 dimensions a pass). */
#if defined(__x86_64__) && defined(__GNUC__)
#define LITEKV_AVX2 1
int litekv_decode_avx2(void); /* this CPU takes the AVX2 path (and tests allow it) */
int litekv_decode_avx2_allow(int allow);
void attend_part_avx2(const Job *job, Part *part); /* int8 codes as integers with Job.int8_dot */
int avx2_reads_key_blocks(const Job *job);
void avx2_query_words(const Job *job, Digits *out);
#else
#define LITEKV_AVX2 0
#endif
INLINE int avx2_head_dim(int head_dim) { return head_dim > 0 && head_dim % 32 == 0; }

#endif
