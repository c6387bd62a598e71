/* One-token attention over a KV cache with AVX2, FMA and F16C: decode_attention.c's part (a chunk
 * of slots: its scores, softmax numerators and weighted values) on x86-64 CPUs without AVX-512.
 *
 * decode_attention.c's vector-extension path is written for 32 zmm registers: compiled for AVX2
 * its 16-float vectors are register pairs, and its 16 x 16 sums spill on every slot. Here each
 * loop keeps at most 16 ymm registers live:
 * - Scores: the dot products of 4 slots with the 3 query heads of a KV head (2 heads: 4 slots; 1:
 *   8 slots) are 8-lane sums in registers. Each 8-element piece of a key row is loaded, and
 *   widened from int8 codes or float16 halves, once for all of them; each head's sums end in a
 *   horizontal-add tree.
 * - Softmax numerators 8 at a time, with exp_nonpositive's polynomial.
 * - Weighted values: 3 heads x 32 dimensions of sums (1 head: 64) stay in registers while the
 *   part's value rows are read, each slot's weight broadcast from the scores.
 * int8 codes and float16 halves are widened in these loops (vpmovsxbd + vcvtdq2ps, vcvtph2ps),
 * with no pass through a buffer. With a scale per row (CACHE_I8_ROWS), a slot's dot product is
 * multiplied by its key row's scale and its softmax numerator by its value row's.
 * With Job.int8_dot, int8 codes are multiplied as integers instead (INT8_WORDS): 16 codes widen to
 * int16 words in one instruction and vpmaddwd takes 16 products where an FMA on widened floats
 * takes 8. The query is rounded to int16 words per head and the softmax numerators to 15 bits, as
 * the AVX-512 VNNI path does (attention_int8_dot.c). In the model at 2,048 slots an int4 SmolLM2
 * step's attention took 6-10 % less time than with the codes widened (bench/PERFORMANCE.md,
 * twenty-first round); on one thread with the cache in L2, 75 us per call instead of 94. The
 * twenty-second round (bench/kernel_cache_levels.py) took that to 68 us: the integer tree, the key
 * rows' FMA and the softmax's exponent folded into one FMA each, and two loops in asm where GCC
 * spilled sums. The floor at that shape: 7.6 cycles per 4 slots x 16 dimensions for the score loop
 * and 9 per 2 slots x 32 for the value loop on their own, about 18 cycles per slot and KV head in
 * all, against 35 measured (the rest: the trees, the softmax and the passes' overhead).
 * Keys stored in blocks of slots (Job.key_blocks, attention_common.h) are scored without trees:
 * per dimension pair, one vpmaddwd adds to 8 slots' scores (score_tile_blocks). On one thread a
 * 2,048-slot call's scores took 28 us against 34 as rows; in all, a call took 0.94x as long from
 * memory and 0.85-0.88x from cache (bench/attention_key_blocks.py; the pass is now bound by its
 * 12 vpmaddwd and 12 vpaddd per slot and KV head, which rows need as well).
 * Passes take a tile of about 8 KB of rows at a time (each KV head's, each group of query heads'
 * in turn), so a tile's rows come from memory once and from L1 for the other passes. The part's
 * key rows, then its value rows, are prefetched as one stream, a tile ahead, spread evenly over the
 * passes: the misses overlap the arithmetic, and no burst of prefetches stalls the core. With a
 * float32 cache, 2,048 slots from memory on one thread: 190 us per call with a tile of 8 KB, 202
 * with 12 KB, 210-340 with 64- and 128-slot tiles (the first pass over a tile outran the
 * prefetches); the lead beyond a tile made no difference (4-32 KB).
 */
#include "attention_common.h"

#if LITEKV_AVX2
#include <stdatomic.h>

#include "avx2_common.h"

#define TARGET AVX2_TARGET
#define KERNEL TARGET static inline __attribute__((always_inline))

/* A fifth cache "type" within this file: int8 codes (CACHE_I8 or CACHE_I8_ROWS) multiplied as
 * integers (Job.int8_dot), where the others widen them to floats. */
#define INT8_WORDS 16

KERNEL size_t element_bytes_of(int type) { return type == INT8_WORDS ? 1 : cache_element_bytes(type); }

#ifndef AVX2_PREFETCH_BYTES
#define AVX2_PREFETCH_BYTES 4096 /* how far the prefetches run ahead of the loads, at least a tile */
#endif
#ifndef TILE_BYTES
#define TILE_BYTES 8192 /* the rows a pass takes before the next pass over them, in L1 for it */
#endif

static atomic_int cpu_has_avx2 = -1, avx2_allowed = 1;

int litekv_decode_avx2(void) {
    int has = atomic_load_explicit(&cpu_has_avx2, memory_order_relaxed);
    if (has < 0) { /* once: every part asks */
        has = cpu_has_avx2_fma_f16c() && !cpu_has(CPU_AVX512F);
        atomic_store_explicit(&cpu_has_avx2, has, memory_order_relaxed);
    }
    return has && atomic_load_explicit(&avx2_allowed, memory_order_relaxed);
}

/* For tests and benchmarks: allow 0 sends decode attention to the portable path where the AVX2
 * path would run, 2 keeps the AVX2 path but widens int8 codes to floats even with Job.int8_dot,
 * 1 (the default) back. Returns whether the AVX2 path runs now. Not for use while calls run. */
int litekv_decode_avx2_allow(int allow) {
    atomic_store_explicit(&avx2_allowed, allow, memory_order_relaxed);
    return litekv_decode_avx2();
}

/* Elements i..i+7 of a cache of `type` (CACHE_I8 for any int8 codes) as floats. `type` is a
 * constant where this is inlined. */
KERNEL __m256 load8(const void *base, size_t i, int type) {
    if (type == CACHE_F32) return _mm256_loadu_ps((const float *)base + i);
    if (type == CACHE_F16) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)base + i)));
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)((const int8_t *)base + i))));
}

/* Lanes r and 4 + r: the sums of lanes 0-3 and of lanes 4-7 of a[r] (two levels of a
 * transpose-and-add tree: shuffles and adds, 2 a cycle here, where vhaddps takes 2 cycles). */
KERNEL __m256 halves4x8(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
    /* per 128-bit half: [a0_0 + a0_2, a1_0 + a1_2, a0_1 + a0_3, a1_1 + a1_3] */
    const __m256 t0 = _mm256_add_ps(_mm256_unpacklo_ps(a0, a1), _mm256_unpackhi_ps(a0, a1));
    const __m256 t1 = _mm256_add_ps(_mm256_unpacklo_ps(a2, a3), _mm256_unpackhi_ps(a2, a3));
    return _mm256_add_ps(_mm256_shuffle_ps(t0, t1, 0x44), _mm256_shuffle_ps(t0, t1, 0xEE));
}

/* Lane r: the sum of the 8 lanes of a[r]. */
KERNEL __m128 sum4x8(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
    const __m256 s = halves4x8(a0, a1, a2, a3);
    return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}

KERNEL __m256 sum8x8(const __m256 *a) {
    const __m256 s0 = halves4x8(a[0], a[1], a[2], a[3]), s1 = halves4x8(a[4], a[5], a[6], a[7]);
    return _mm256_add_ps(_mm256_permute2f128_ps(s0, s1, 0x20), _mm256_permute2f128_ps(s0, s1, 0x31));
}

/* The first element of each of S key rows from element at, `row` apart; rows r >= `rows` are the
 * first again (dots' and dots_words' last block of a part). */
KERNEL void row_starts(size_t *k, size_t at, size_t row, int rows, int S) {
#pragma GCC unroll 8
    for (int r = 0; r < S; r++) k[r] = at + (size_t)(r < rows ? r : 0) * row;
}

/* Lane r (of the low 4 for S 4): the sum of the 8 lanes of a[r]. */
KERNEL __m256 row_sums(const __m256 *a, int S) {
    return S == 8 ? sum8x8(a) : _mm256_castps128_ps256(sum4x8(a[0], a[1], a[2], a[3]));
}

/* The dot products of S key rows (row r from element at + r * row; rows r >= `rows` are the first
 * again) with G query heads' rows (head g at q + g * d): lane r of sums[g] (of its low 4 for S 4).
 * S x G sums stay in registers (12 for 4 x 3), each 8-element piece of a key row widened once for
 * the G heads. */
KERNEL void dots(const void *keys, int type, size_t at, size_t row, int rows, const float *q, int d, int G, int S,
                 __m256 *sums) {
    __m256 acc[3][8];
    size_t k[8];
    row_starts(k, at, row, rows, S);
#pragma GCC unroll 3
    for (int g = 0; g < G; g++)
#pragma GCC unroll 8
        for (int r = 0; r < S; r++) acc[g][r] = _mm256_setzero_ps();
    for (int c = 0; c < d; c += 8) {
        /* the G query pieces, then one key piece at a time: 12 sums + 3 + 1 registers (loading the 4
         * key pieces first, GCC spilled a sum every piece) */
        __m256 qv[3];
#pragma GCC unroll 3
        for (int g = 0; g < G; g++) qv[g] = _mm256_loadu_ps(q + (size_t)g * d + c);
#pragma GCC unroll 8
        for (int r = 0; r < S; r++) {
            const __m256 key = load8(keys, k[r] + c, type);
#pragma GCC unroll 3
            for (int g = 0; g < G; g++) acc[g][r] = _mm256_fmadd_ps(key, qv[g], acc[g][r]);
        }
    }
#pragma GCC unroll 3
    for (int g = 0; g < G; g++) sums[g] = row_sums(acc[g], S);
}

/* vpmaddwd with b from memory, in asm so the compiler cannot hoist the load: loaded once for a
 * loop's S rows, the G query pieces took 3 registers and one of 12 sums lived on the stack. */
KERNEL __m256i madd_from_memory(__m256i a, const int16_t *b) {
    __m256i product;
    __asm__("vpmaddwd %2, %1, %0" : "=x"(product) : "x"(a), "m"(*(const __m256i *)b));
    return product;
}

/* Lane r of the low 4 (S 4, integer sums): the sum of the 8 int32 lanes of a[r]. */
KERNEL __m128i int_sum4x8(__m256i a0, __m256i a1, __m256i a2, __m256i a3) {
    const __m256i t0 = _mm256_add_epi32(_mm256_unpacklo_epi32(a0, a1), _mm256_unpackhi_epi32(a0, a1));
    const __m256i t1 = _mm256_add_epi32(_mm256_unpacklo_epi32(a2, a3), _mm256_unpackhi_epi32(a2, a3));
    const __m256i s = _mm256_add_epi32(_mm256_unpacklo_epi64(t0, t1), _mm256_unpackhi_epi64(t0, t1));
    return _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
}

/* dots_words' sums for 4 whole key rows (row r at k + r * row) and 3 heads (head g's words at
 * q + g * d) into acc[g][r], in asm: per 16-dimension piece, the first two heads' words are loaded
 * once for the 4 rows and the third's come from memory, which fills the 16 registers with the 12
 * sums. In C every head's words came from memory for every row (no register was left for them):
 * 16 loads a piece for 12 vpmaddwd, and the loads bound the loop; now 10. A 512-slot call in L2
 * took 0.94x the time on one thread, the int4 step's attention at 2,048 tokens 0.97x. */
KERNEL void dots_words4x3(const int8_t *k, size_t row, const int16_t *q, int d, __m256i acc[3][8]) {
    __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0, a8 = a0,
            a9 = a0, a10 = a0, a11 = a0;
    const size_t qstride = (size_t)d * sizeof *q;
    const int8_t *k3 = k + 3 * row;
#define SLOT(key, A, B, C)                          \
    "vpmovsxbw " key ", %%ymm14\n\t"                \
    "vpmaddwd %%ymm12, %%ymm14, %%ymm15\n\t"        \
    "vpaddd %%ymm15, %" A ", %" A "\n\t"            \
    "vpmaddwd %%ymm13, %%ymm14, %%ymm15\n\t"        \
    "vpaddd %%ymm15, %" B ", %" B "\n\t"            \
    "vpmaddwd (%14,%15,2), %%ymm14, %%ymm14\n\t"    \
    "vpaddd %%ymm14, %" C ", %" C "\n\t"
    for (int c = 0; c < d; c += 16)
        __asm__("vmovdqu (%14), %%ymm12\n\t"
                "vmovdqu (%14,%15), %%ymm13\n\t"
                SLOT("(%12)", "0", "4", "8") SLOT("(%12,%13)", "1", "5", "9") SLOT("(%12,%13,2)", "2", "6", "10")
                SLOT("(%16)", "3", "7", "11")
                : "+x"(a0), "+x"(a1), "+x"(a2), "+x"(a3), "+x"(a4), "+x"(a5), "+x"(a6), "+x"(a7), "+x"(a8),
                  "+x"(a9), "+x"(a10), "+x"(a11)
                : "r"(k + c), "r"(row), "r"(q + c), "r"(qstride), "r"(k3 + c)
                : "xmm12", "xmm13", "xmm14", "xmm15", "memory");
#undef SLOT
    acc[0][0] = a0, acc[0][1] = a1, acc[0][2] = a2, acc[0][3] = a3, acc[1][0] = a4, acc[1][1] = a5;
    acc[1][2] = a6, acc[1][3] = a7, acc[2][0] = a8, acc[2][1] = a9, acc[2][2] = a10, acc[2][3] = a11;
}

/* dots() on int8 codes as integers: the query in int16 words (head g's at q + g * d, each head's
 * unit applied by the caller), each 16-code piece of a key row widened to words once for the G
 * heads and multiplied by vpmaddwd, which takes 16 products per instruction where a widened float
 * FMA takes 8 (and the widening, 8 codes per instruction to floats, bound the float path). An int32
 * lane sums d / 8 products of |code| <= 128 and |word| <= 32767: exact for head_dim up to 4,096.
 * 4 rows' sums end in int_sum4x8's integer tree and one conversion; 8 rows' in dots()'s float tree,
 * converted first (24 bits hold them to 1e-7). */
KERNEL void dots_words(const int8_t *keys, size_t at, size_t row, int rows, const int16_t *q, int d, int G, int S,
                       __m256 *sums) {
    __m256i acc[3][8];
    if (G == 3 && S == 4 && rows == 4) {
        dots_words4x3(keys + at, row, q, d, acc);
    } else {
        size_t k[8];
        row_starts(k, at, row, rows, S);
#pragma GCC unroll 3
        for (int g = 0; g < G; g++)
#pragma GCC unroll 8
            for (int r = 0; r < S; r++) acc[g][r] = _mm256_setzero_si256();
        for (int c = 0; c < d; c += 16) {
#pragma GCC unroll 8
            for (int r = 0; r < S; r++) {
                const __m256i key = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(keys + k[r] + c)));
#pragma GCC unroll 3
                for (int g = 0; g < G; g++) /* 12 sums + key + product */
                    acc[g][r] = _mm256_add_epi32(acc[g][r], madd_from_memory(key, q + (size_t)g * d + c));
            }
        }
    }
#pragma GCC unroll 3
    for (int g = 0; g < G; g++) {
        if (S == 4) { /* the tree in integers: vpaddd on 4 pipes, one conversion */
            const __m128i total = int_sum4x8(acc[g][0], acc[g][1], acc[g][2], acc[g][3]);
            sums[g] = _mm256_castps128_ps256(_mm_cvtepi32_ps(total));
            continue;
        }
        __m256 f[8];
#pragma GCC unroll 8
        for (int r = 0; r < S; r++) f[r] = _mm256_cvtepi32_ps(acc[g][r]);
        sums[g] = row_sums(f, S);
    }
}

/* Query heads scored (or weighed) together: 3 where it can (4 are 2 + 2: 12 sums in registers
 * at most). Only a group of 1 leaves 1. */
KERNEL int heads_at_once(int left) { return left == 4 || left == 2 ? 2 : left >= 3 ? 3 : 1; }

/* Passes over a tile's rows for each KV head: its query heads, heads_at_once at a time. */
KERNEL int head_passes(int group) {
    int passes = 0;
    for (int g0 = 0; g0 < group; g0 += heads_at_once(group - g0)) passes++;
    return passes;
}

/* The part's rows as one stream for software prefetching: the key rows, then the value rows
 * ("virtual" rows 0..2n-1). Each pass over a tile advances the stream by its share of the tile's
 * rows, so the misses spread evenly over the arithmetic and the prefetches stay `lead` rows ahead
 * of the loads. A row is one span of bytes ([S][KVH * D]: every KV head's), or KVH spans of D
 * elements, head_bytes apart (head-major); the stream counts the bytes of one span. */
typedef struct {
    const char *keys, *values; /* the part's first row (KV head 0's) */
    size_t row_bytes, head_bytes, half; /* half: the key rows' bytes in a span */
    size_t next;                        /* the first byte of the stream not yet prefetched */
    int spans, lead, tile;              /* tile: slots a pass takes at a time */
} Stream;

KERNEL Stream stream(const Job *job, const Part *part, size_t element_bytes) {
    const int interleaved = job->head_stride == (size_t)job->head_dim, n = part->hi - part->lo + 1;
    const size_t row_bytes = (size_t)job->row * element_bytes, first = (size_t)part->lo * row_bytes;
    const int spans = interleaved ? 1 : job->kv_heads;
    const size_t slot_bytes = row_bytes * (size_t)spans; /* all of a slot's keys (or values) */
    int tile = (int)(TILE_BYTES / slot_bytes) / 8 * 8, lead = (int)(AVX2_PREFETCH_BYTES / slot_bytes);
    tile = tile < 8 ? 8 : tile > 128 ? 128 : tile;
    return (Stream){(const char *)job->keys + first, (const char *)job->values + first, row_bytes,
                    job->head_stride * element_bytes, (size_t)n * row_bytes, 0, spans, lead > tile ? lead : tile, tile};
}

/* Prefetches the stream's virtual rows before `target`, from the first byte not yet prefetched.
 * Most calls prefetch a line or a few: the loops keep to a few instructions a line (the Stream
 * fields read once), which at L2 cost 1.4 of a 384-slot call's 17 us with a general loop. */
KERNEL void stream_to(Stream *st, int target) {
    const size_t limit = 2 * st->half, wanted = (size_t)target * st->row_bytes, end = wanted < limit ? wanted : limit;
    size_t next = st->next;
    if (next >= end) return;
    const size_t keys_end = end < st->half ? end : st->half;
    if (st->spans == 1) {
        for (; next < keys_end; next += 64) _mm_prefetch(st->keys + next, _MM_HINT_T1);
        for (; next < end; next += 64) _mm_prefetch(st->values + (next - st->half), _MM_HINT_T1);
    } else {
        for (; next < end; next += 64) {
            const char *at = next < st->half ? st->keys + next : st->values + (next - st->half);
            for (int k = 0; k < st->spans; k++) _mm_prefetch(at + (size_t)k * st->head_bytes, _MM_HINT_T1);
        }
    }
    st->next = next;
}

/* The stream's advance over a tile of `rows` virtual rows from v, spread over `steps` loop steps
 * (of all the passes over the tile): a target in 16.16 fixed point, and its increment per step. */
typedef struct {
    int target, step;
} Share;

KERNEL Share share(const Stream *st, int v, int rows, int steps) {
    return (Share){(v + st->lead) << 16, (rows << 16) / steps};
}

KERNEL void share_step(Stream *st, Share *sh) {
    sh->target += sh->step;
    stream_to(st, sh->target >> 16);
}

/* The masked scores of slots t0..t0+rows-1 of the part (counted from part->lo) for query heads
 * h0..h0+G-1 of KV head kv, S slots at a time; `scaled`: the keys have a scale per row (constant
 * where this is inlined, as the branch in the loop cost a few percent). tops[8 h + lane] keeps head
 * h's largest score so far in that lane (the first S lanes), so the softmax needs no pass of its own
 * to find the maximum. */
KERNEL void score_tile(const Job *job, const Part *part, int type, int scaled, int kv, int h0, int G, int S, int t0,
                       int rows, Stream *st, Share *sh, float *tops) {
    const int d = job->head_dim;
    const size_t row = (size_t)job->row, at = (size_t)part->lo * row + (size_t)kv * job->head_stride;
    const size_t stride = (size_t)job->stride;
    const float *q = job->query + (size_t)h0 * d, *mask = job->mask + part->lo;
    const float *kscale = scaled ? job->key_scales + (size_t)kv * job->scale_stride + part->lo : NULL;
    float *sc = job->scores + (size_t)h0 * stride + part->first;
    const int16_t *words = type == INT8_WORDS ? job->digits->words + (size_t)h0 * d : NULL;
    __m256 unit[3], top[3]; /* S 4: the low 4 lanes of top */
#pragma GCC unroll 3
    for (int g = 0; g < G; g++) {
        unit[g] = _mm256_set1_ps(type == INT8_WORDS ? job->digits->unit[h0 + g] : 1.0f);
        top[g] = _mm256_loadu_ps(tops + 8 * (h0 + g));
    }
    const int end = t0 + rows;
    int i = t0;
    for (; i + S <= end; i += S) {
        share_step(st, sh);
        __m256 sums[3];
        if (type == INT8_WORDS)
            dots_words(job->keys, at + (size_t)i * row, row, S, words, d, G, S, sums);
        else
            dots(job->keys, type, at + (size_t)i * row, row, S, q, d, G, S, sums);
        /* score = sum x unit x row scale + mask: one FMA a head where there are no row scales. With S 4
         * in xmm: lanes 4-7 of the sums are undefined, and arithmetic on them (denormals, NaNs) cost a
         * float32 call 2-3 %. */
        if (S == 4) {
            const __m128 m = _mm_loadu_ps(mask + i), scale = scaled ? _mm_loadu_ps(kscale + i) : _mm_set1_ps(1.0f);
#pragma GCC unroll 3
            for (int g = 0; g < G; g++) {
                const __m128 sum = _mm256_castps256_ps128(sums[g]), u = _mm256_castps256_ps128(unit[g]);
                const __m128 score = type == INT8_WORDS || scaled
                                         ? _mm_fmadd_ps(sum, scaled ? _mm_mul_ps(u, scale) : u, m)
                                         : _mm_add_ps(sum, m);
                _mm_storeu_ps(sc + g * stride + i, score);
                top[g] = _mm256_castps128_ps256(_mm_max_ps(_mm256_castps256_ps128(top[g]), score));
            }
            continue;
        }
        const __m256 m = _mm256_loadu_ps(mask + i), scale = scaled ? _mm256_loadu_ps(kscale + i) : _mm256_set1_ps(1.0f);
#pragma GCC unroll 3
        for (int g = 0; g < G; g++) {
            const __m256 score = type == INT8_WORDS || scaled
                                     ? _mm256_fmadd_ps(sums[g], scaled ? _mm256_mul_ps(unit[g], scale) : unit[g], m)
                                     : _mm256_add_ps(sums[g], m);
            _mm256_storeu_ps(sc + g * stride + i, score);
            top[g] = _mm256_max_ps(top[g], score);
        }
    }
#pragma GCC unroll 3
    for (int g = 0; g < G; g++)
        if (S == 4)
            _mm_storeu_ps(tops + 8 * (h0 + g), _mm256_castps256_ps128(top[g]));
        else
            _mm256_storeu_ps(tops + 8 * (h0 + g), top[g]);
    if (i < end) { /* the part's last rows: fewer than S */
        share_step(st, sh);
        __m256 sums[3];
        float out[8];
        if (type == INT8_WORDS)
            dots_words(job->keys, at + (size_t)i * row, row, end - i, words, d, G, S, sums);
        else
            dots(job->keys, type, at + (size_t)i * row, row, end - i, q, d, G, S, sums);
        for (int g = 0; g < G; g++) {
            _mm256_storeu_ps(out, _mm256_mul_ps(sums[g], unit[g]));
            for (int r = 0; i + r < end; r++) {
                const float score = out[r] * (scaled ? kscale[i + r] : 1.0f) + mask[i + r];
                sc[g * stride + i + r] = score;
                tops[8 * (h0 + g) + r] = score > tops[8 * (h0 + g) + r] ? score : tops[8 * (h0 + g) + r];
            }
        }
    }
}

/* The integer dot products of B blocks of keys (Job.key_blocks; block b at k + b * block_bytes) with
 * G query heads' words (head g's at q + g * d): lane r of acc[g][b] is slot r of block b. Per pair
 * of dimensions, each block's 16 codes are widened once and one vpmaddwd per head adds the pair to
 * all 8 slots, against the pair's two query words broadcast: no reduction tree. */
KERNEL void block_dots(const int8_t *k, size_t block_bytes, const int16_t *q, int d, int G, int B,
                       __m256i acc[3][3]) {
#pragma GCC unroll 3
    for (int g = 0; g < G; g++)
#pragma GCC unroll 3
        for (int b = 0; b < B; b++) acc[g][b] = _mm256_setzero_si256();
    for (int p = 0; p < d / 2; p++) {
        __m256i codes[3];
#pragma GCC unroll 3
        for (int b = 0; b < B; b++)
            codes[b] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(k + (size_t)b * block_bytes + 16 * p)));
#pragma GCC unroll 3
        for (int g = 0; g < G; g++) {
            int32_t pair;
            memcpy(&pair, q + (size_t)g * d + 2 * p, sizeof pair);
            const __m256i words = _mm256_set1_epi32(pair);
#pragma GCC unroll 3
            for (int b = 0; b < B; b++) acc[g][b] = _mm256_add_epi32(acc[g][b], _mm256_madd_epi16(codes[b], words));
        }
    }
}

/* block_dots for 3 heads and 2 blocks, 4 dimension pairs per asm block: in C, GCC copied each of
 * the 6 sums to another register and back every pair. */
KERNEL void block_dots3x2(const int8_t *k, size_t block_bytes, const int16_t *q, int d, __m256i acc[3][3]) {
    __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0;
    const size_t qstride = (size_t)d * sizeof *q;
#define PAIR(key, word)                                          \
    "vpmovsxbw " key "(%6), %%ymm12\n\t"                          \
    "vpmovsxbw " key "(%6,%7), %%ymm13\n\t"                       \
    "vpbroadcastd " word "(%8), %%ymm14\n\t"                      \
    "vpmaddwd %%ymm14, %%ymm12, %%ymm15\n\t"                      \
    "vpaddd %%ymm15, %0, %0\n\t"                                  \
    "vpmaddwd %%ymm14, %%ymm13, %%ymm14\n\t"                      \
    "vpaddd %%ymm14, %1, %1\n\t"                                  \
    "vpbroadcastd " word "(%8,%9), %%ymm14\n\t"                   \
    "vpmaddwd %%ymm14, %%ymm12, %%ymm15\n\t"                      \
    "vpaddd %%ymm15, %2, %2\n\t"                                  \
    "vpmaddwd %%ymm14, %%ymm13, %%ymm14\n\t"                      \
    "vpaddd %%ymm14, %3, %3\n\t"                                  \
    "vpbroadcastd " word "(%8,%9,2), %%ymm14\n\t"                 \
    "vpmaddwd %%ymm14, %%ymm12, %%ymm12\n\t"                      \
    "vpaddd %%ymm12, %4, %4\n\t"                                  \
    "vpmaddwd %%ymm14, %%ymm13, %%ymm13\n\t"                      \
    "vpaddd %%ymm13, %5, %5\n\t"
    for (int p = 0; p < d / 2; p += 4)
        __asm__(PAIR("0", "0") PAIR("16", "4") PAIR("32", "8") PAIR("48", "12")
                : "+x"(a0), "+x"(a1), "+x"(a2), "+x"(a3), "+x"(a4), "+x"(a5)
                : "r"(k + 16 * (size_t)p), "r"(block_bytes), "r"(q + 2 * p), "r"(qstride)
                : "xmm12", "xmm13", "xmm14", "xmm15", "memory");
#undef PAIR
    acc[0][0] = a0, acc[0][1] = a1, acc[1][0] = a2, acc[1][1] = a3, acc[2][0] = a4, acc[2][1] = a5;
}

/* score_tile over keys in blocks (Job.key_blocks), int8 codes as integers: the masked scores of
 * slots part->lo + t0 .. + rows - 1, B blocks at a time. A block that the span cuts (its first or
 * last) is computed whole and stored lane by lane, in the span only. */
KERNEL void score_tile_blocks(const Job *job, const Part *part, int scaled, int kv, int h0, int G, int B, int t0,
                              int rows, Stream *st, Share *sh, float *tops) {
    const int d = job->head_dim, first = part->lo + t0, end = first + rows;
    const size_t block_bytes = (size_t)KEY_BLOCK_SLOTS * job->row, stride = (size_t)job->stride;
    const int8_t *keys = (const int8_t *)job->keys;
    const float *kscale = scaled ? job->key_scales + (size_t)kv * job->scale_stride : NULL;
    float *sc = job->scores + (size_t)h0 * stride + part->first; /* column i: slot part->lo + i */
    const int16_t *words = job->digits->words + (size_t)h0 * d;
    __m256 unit[3], top[3];
#pragma GCC unroll 3
    for (int g = 0; g < G; g++) {
        unit[g] = _mm256_set1_ps(job->digits->unit[h0 + g]);
        top[g] = _mm256_loadu_ps(tops + 8 * (h0 + g));
    }
    for (int s = first / KEY_BLOCK_SLOTS * KEY_BLOCK_SLOTS; s < end;) {
        const int whole = s >= first && s + B * KEY_BLOCK_SLOTS <= end, blocks = whole ? B : 1;
        share_step(st, sh);
        __m256i acc[3][3];
        const int8_t *k = keys + key_block_offset((size_t)job->row, job->head_stride, d, s, kv);
        if (whole && G == 3 && B == 2)
            block_dots3x2(k, block_bytes, words, d, acc);
        else if (whole)
            block_dots(k, block_bytes, words, d, G, B, acc);
        else
            block_dots(k, block_bytes, words, d, G, 1, acc);
        for (int b = 0; b < blocks; b++, s += KEY_BLOCK_SLOTS) {
            const int in_span = s >= first && s + KEY_BLOCK_SLOTS <= end;
            const __m256 m = in_span ? _mm256_loadu_ps(job->mask + s) : _mm256_setzero_ps();
            const __m256 scale = scaled && in_span ? _mm256_loadu_ps(kscale + s) : _mm256_set1_ps(1.0f);
#pragma GCC unroll 3
            for (int g = 0; g < G; g++) {
                const __m256 sum = _mm256_cvtepi32_ps(acc[g][b]);
                if (in_span) {
                    const __m256 score = _mm256_fmadd_ps(sum, scaled ? _mm256_mul_ps(unit[g], scale) : unit[g], m);
                    _mm256_storeu_ps(sc + g * stride + (s - part->lo), score);
                    top[g] = _mm256_max_ps(top[g], score);
                    continue;
                }
                float lanes[8], best[8]; /* the vector path's arithmetic, lane by lane */
                _mm256_storeu_ps(lanes, sum);
                _mm256_storeu_ps(best, top[g]);
                const float u = _mm256_cvtss_f32(unit[g]);
                for (int r = 0; r < KEY_BLOCK_SLOTS; r++) {
                    const int slot = s + r;
                    if (slot < first || slot >= end) continue;
                    const float score = __builtin_fmaf(lanes[r], scaled ? u * kscale[slot] : u, job->mask[slot]);
                    sc[g * stride + (slot - part->lo)] = score;
                    best[r] = score > best[r] ? score : best[r];
                }
                top[g] = _mm256_loadu_ps(best);
            }
        }
    }
#pragma GCC unroll 3
    for (int g = 0; g < G; g++) _mm256_storeu_ps(tops + 8 * (h0 + g), top[g]);
}

/* score_tile for G query heads, in a function of its own (per cache type, as `type` is constant
 * where it is called): inlined into the loops over tiles and heads, GCC ran out of general
 * registers for the pointers and kept them on the stack. Without tree-PRE, as in
 * attention_int8_dot.c: with it GCC 12 copied the integer sums to other registers and back every
 * step (a 2,048-slot int8 call took 98.8 us with it, 95.4 without; float calls the same either way). */
#define PASS TARGET static __attribute__((noinline, optimize("no-tree-pre"))) void
PASS score_pass(const Job *job, const Part *part, int type, int kv, int h0, int G, int t0, int rows, Stream *st,
                Share *sh, float *tops) {
    const int scaled = job->key_scales != NULL;
    /* S slots a step as rows, B blocks a step as blocks (3 heads: 2 blocks, 6 sums in registers) */
#define SCORE_TILE(G, S, B)                                                                               \
    (job->key_blocks ? (scaled ? score_tile_blocks(job, part, 1, kv, h0, G, B, t0, rows, st, sh, tops)    \
                               : score_tile_blocks(job, part, 0, kv, h0, G, B, t0, rows, st, sh, tops))   \
     : scaled        ? score_tile(job, part, type, 1, kv, h0, G, S, t0, rows, st, sh, tops)               \
                     : score_tile(job, part, type, 0, kv, h0, G, S, t0, rows, st, sh, tops))
    if (G == 3)
        SCORE_TILE(3, 4, 2);
    else if (G == 2)
        SCORE_TILE(2, 4, 3);
    else
        SCORE_TILE(1, 8, 3);
#undef SCORE_TILE
}

/* The masked scores of slots part->lo..hi for every head, into job->scores, a tile of slots
 * at a time: per KV head, its query heads 3 (or 2) at a time over 4 slots, or one over 8 (a
 * group of one). */
KERNEL void scores(const Job *job, const Part *part, int type, Stream *st, float *tops) {
    const int group = job->heads / job->kv_heads, n = part->hi - part->lo + 1, S = group == 1 ? 8 : 4;
    const int passes = job->kv_heads * head_passes(group);
    stream_to(st, st->lead); /* the first rows: the part's loads wait for these */
    /* With keys in blocks, tiles end on block boundaries, so only the part's ends cut a block, and
     * hold pairs of blocks, so none is left to take alone (40-slot tiles left every fifth); a pass
     * steps a block at a time, one more for a cut one. */
    const int blocks = job->key_blocks, block = KEY_BLOCK_SLOTS;
    const int tile = blocks ? (st->tile + block) / (2 * block) * (2 * block) : st->tile;
    for (int t0 = 0; t0 < n;) {
        const int end = blocks ? (part->lo + t0) / block * block + tile - part->lo : t0 + tile;
        const int rows = (end < n ? end : n) - t0, steps = blocks ? (rows + 2 * block - 1) / block : (rows + S - 1) / S;
        Share sh = share(st, t0, rows, passes * steps);
        for (int kv = 0; kv < job->kv_heads; kv++)
            for (int g0 = 0; g0 < group;) {
                const int G = heads_at_once(group - g0), h0 = kv * group + g0;
                score_pass(job, part, type, kv, h0, G, t0, rows, st, &sh, tops);
                g0 += G;
            }
        t0 += rows;
    }
}

/* A head's n masked scores replaced by e^(score - top), top their maximum, times the value rows'
 * scales if given (scale[i]: slot i's); returns the sum of the e^ (unscaled). */
KERNEL float numerators(float *sc, const float *scale, int n, float top) {
    __m256 total = _mm256_setzero_ps();
    const __m256 top8 = _mm256_set1_ps(top);
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 e = exp_nonpositive8(_mm256_sub_ps(_mm256_loadu_ps(sc + i), top8));
        total = _mm256_add_ps(total, e);
        _mm256_storeu_ps(sc + i, scale ? _mm256_mul_ps(e, _mm256_loadu_ps(scale + i)) : e);
    }
    float sum = horizontal_sum(total);
    for (; i < n; i++) {
        const float e = exp_nonpositive(sc[i] - top);
        sum += e;
        sc[i] = scale ? e * scale[i] : e;
    }
    return sum;
}

/* part->acc for query heads h0..h0+G-1 (of KV head kv), dimensions c0..c0+8*CB-1, plus slots
 * t0..t0+rows-1's value rows weighed by the heads' numerators (job->scores); the tile from slot 0
 * starts the sums. G x CB sums stay in registers, the G weights of a slot broadcast once. */
KERNEL void weigh_tile(const Job *job, Part *part, int type, int kv, int h0, int G, int CB, int c0, int t0, int rows,
                       Stream *st, Share *sh) {
    const int d = job->head_dim;
    const size_t element_bytes = element_bytes_of(type), row_bytes = (size_t)job->row * element_bytes;
    const char *v = (const char *)job->values +
                    ((size_t)(part->lo + t0) * job->row + (size_t)kv * job->head_stride + (size_t)c0) * element_bytes;
    const float *w = job->scores + (size_t)h0 * job->stride + part->first + t0;
    float *out = part->acc + (size_t)h0 * d + c0;
    __m256 acc[3][8];
#pragma GCC unroll 3
    for (int g = 0; g < G; g++)
#pragma GCC unroll 8
        for (int c = 0; c < CB; c++) acc[g][c] = t0 ? _mm256_loadu_ps(out + (size_t)g * d + 8 * c) : _mm256_setzero_ps();
    for (int i0 = 0; i0 < rows; i0 += 4) { /* the stream advances every 4 slots: a step costs a few instructions */
        share_step(st, sh);
        const int end = rows - i0 < 4 ? rows : i0 + 4;
        for (int i = i0; i < end; i++, v += row_bytes) {
            __m256 weight[3];
#pragma GCC unroll 3
            for (int g = 0; g < G; g++) weight[g] = _mm256_broadcast_ss(w + (size_t)g * job->stride + i);
#pragma GCC unroll 8
            for (int c = 0; c < CB; c++) {
                const __m256 value = load8(v, 8 * c, type);
#pragma GCC unroll 3
                for (int g = 0; g < G; g++) acc[g][c] = _mm256_fmadd_ps(weight[g], value, acc[g][c]);
            }
        }
    }
#pragma GCC unroll 3
    for (int g = 0; g < G; g++)
#pragma GCC unroll 8
        for (int c = 0; c < CB; c++) _mm256_storeu_ps(out + (size_t)g * d + 8 * c, acc[g][c]);
}

KERNEL int32_t numerator_pair(const int16_t *p) {
    int32_t pair;
    memcpy(&pair, p, sizeof pair);
    return pair;
}

/* One pair of slots (codes at a and b) of weigh_tile_words for 3 heads (numerator pairs at w,
 * w + stride, w + 2 stride) over 32 dimensions, in asm: 12 sums, 2 temporaries and the unpacked
 * codes fill the 16 ymm registers exactly, and GCC, given the same in C, kept two sums on the
 * stack. */
KERNEL void weigh_pair3(const int8_t *a, const int8_t *b, const int16_t *w, size_t stride, __m256i acc[3][4]) {
#define WEIGH_HEAD(w, lo, hi) \
    "vpbroadcastd " w ", %%ymm15\n\t" \
    "vpmaddwd %%ymm15, %%ymm12, %%ymm13\n\t" \
    "vpaddd %%ymm13, %" lo ", %" lo "\n\t" \
    "vpmaddwd %%ymm15, %%ymm14, %%ymm13\n\t" \
    "vpaddd %%ymm13, %" hi ", %" hi "\n\t"
#define WEIGH_BLOCK(off, l0, h0, l1, h1, l2, h2) \
    "vpmovsxbw " off "(%12), %%ymm12\n\t" \
    "vpmovsxbw " off "(%13), %%ymm13\n\t" \
    "vpunpckhwd %%ymm13, %%ymm12, %%ymm14\n\t" \
    "vpunpcklwd %%ymm13, %%ymm12, %%ymm12\n\t" \
    WEIGH_HEAD("(%14)", l0, h0) WEIGH_HEAD("(%14,%15)", l1, h1) WEIGH_HEAD("(%14,%15,2)", l2, h2)
    __asm__(WEIGH_BLOCK("0", "0", "1", "4", "5", "8", "9") WEIGH_BLOCK("16", "2", "3", "6", "7", "10", "11")
            : "+x"(acc[0][0]), "+x"(acc[0][1]), "+x"(acc[0][2]), "+x"(acc[0][3]), "+x"(acc[1][0]), "+x"(acc[1][1]),
              "+x"(acc[1][2]), "+x"(acc[1][3]), "+x"(acc[2][0]), "+x"(acc[2][1]), "+x"(acc[2][2]), "+x"(acc[2][3])
            : "r"(a), "r"(b), "r"(w), "r"(stride * sizeof *w)
            : "xmm12", "xmm13", "xmm14", "xmm15", "memory"); /* memory: it reads the rows and numerators */
#undef WEIGH_BLOCK
#undef WEIGH_HEAD
}

/* weigh_tile on int8 codes as integers, for dimensions c0..c0+31: the numerators are int16
 * (part->numerators), and two slots' codes are widened to words and interleaved, 16 dimensions at a
 * time, so int32 lane j of one vpmaddwd adds both slots' share of a dimension, the pair of
 * numerators broadcast as one word. The G x 4 int32 sums stay in registers through the tile (at
 * most 64 pairs; 256 pairs of |2 * 32767 * 128| fit) and are added to the float sums at its end. */
KERNEL void weigh_tile_words(const Job *job, Part *part, int kv, int h0, int G, int c0, int t0, int rows,
                             Stream *st, Share *sh) {
    enum { CB = 2 }; /* 16-dimension blocks: 32 dimensions a pass, as weigh_tile's */
    const int d = job->head_dim;
    const size_t row = (size_t)job->row, numerator_stride = (size_t)part->numerator_stride;
    const int8_t *v = (const int8_t *)job->values + (size_t)(part->lo + t0) * row + (size_t)kv * job->head_stride + c0;
    const int16_t *w = part->numerators + (size_t)h0 * numerator_stride + t0;
    __m256i acc[3][4];
#pragma GCC unroll 3
    for (int g = 0; g < G; g++)
#pragma GCC unroll 4
        for (int m = 0; m < 2 * CB; m++) acc[g][m] = _mm256_setzero_si256();
    for (int i0 = 0; i0 < rows; i0 += 4) { /* the stream advances every 4 slots, as in weigh_tile */
        share_step(st, sh);
        if (G == 3 && i0 + 4 <= rows) { /* two whole pairs: no partner to choose (2-3 % of a call on one thread) */
            const int8_t *a = v + (size_t)i0 * row;
            weigh_pair3(a, a + row, w + i0, numerator_stride, acc);
            weigh_pair3(a + 2 * row, a + 3 * row, w + i0 + 2, numerator_stride, acc);
            continue;
        }
        const int end = rows - i0 < 4 ? rows : i0 + 4;
        for (int i = i0; i < end; i += 2) {
            /* an odd last slot pairs with itself, its partner's numerator 0 (numerators[n]) */
            const int8_t *a = v + (size_t)i * row, *b = i + 1 < end ? a + row : a;
            if (G == 3) {
                weigh_pair3(a, b, w + i, numerator_stride, acc);
                continue;
            }
            __m256i weight[3]; /* 2 heads at most here: 8 sums, the weights and the codes fit the registers */
#pragma GCC unroll 3
            for (int g = 0; g < G; g++)
                weight[g] = _mm256_set1_epi32(numerator_pair(w + (size_t)g * numerator_stride + i));
#pragma GCC unroll 2
            for (int cb = 0; cb < CB; cb++) {
                const __m256i wa = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(a + 16 * cb)));
                const __m256i wb = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(b + 16 * cb)));
                /* lane 4L + t: dimension 8L + t (unpacklo) or 8L + 4 + t (unpackhi), slots a and b */
                const __m256i lo = _mm256_unpacklo_epi16(wa, wb), hi = _mm256_unpackhi_epi16(wa, wb);
#pragma GCC unroll 3
                for (int g = 0; g < G; g++) {
                    acc[g][2 * cb] = _mm256_add_epi32(acc[g][2 * cb], _mm256_madd_epi16(lo, weight[g]));
                    acc[g][2 * cb + 1] = _mm256_add_epi32(acc[g][2 * cb + 1], _mm256_madd_epi16(hi, weight[g]));
                }
            }
        }
    }
#pragma GCC unroll 3
    for (int g = 0; g < G; g++)
#pragma GCC unroll 2
        for (int cb = 0; cb < CB; cb++) {
            float *out = part->acc + (size_t)(h0 + g) * d + c0 + 16 * cb;
            __m256 low = _mm256_cvtepi32_ps(_mm256_permute2x128_si256(acc[g][2 * cb], acc[g][2 * cb + 1], 0x20));
            __m256 high = _mm256_cvtepi32_ps(_mm256_permute2x128_si256(acc[g][2 * cb], acc[g][2 * cb + 1], 0x31));
            if (t0) low = _mm256_add_ps(low, _mm256_loadu_ps(out)), high = _mm256_add_ps(high, _mm256_loadu_ps(out + 8));
            _mm256_storeu_ps(out, low);
            _mm256_storeu_ps(out + 8, high);
        }
}

/* weigh_tile for G query heads over `width` dimensions, in a function of its own (score_pass). */
PASS weigh_pass(const Job *job, Part *part, int type, int kv, int h0, int G, int width, int c0, int t0, int rows,
                Stream *st, Share *sh) {
    if (type == INT8_WORDS) {
        if (G == 3)
            weigh_tile_words(job, part, kv, h0, 3, c0, t0, rows, st, sh);
        else if (G == 2)
            weigh_tile_words(job, part, kv, h0, 2, c0, t0, rows, st, sh);
        else
            weigh_tile_words(job, part, kv, h0, 1, c0, t0, rows, st, sh);
    } else if (G == 3)
        weigh_tile(job, part, type, kv, h0, 3, 4, c0, t0, rows, st, sh);
    else if (G == 2)
        weigh_tile(job, part, type, kv, h0, 2, 4, c0, t0, rows, st, sh);
    else if (width == 64)
        weigh_tile(job, part, type, kv, h0, 1, 8, c0, t0, rows, st, sh);
    else
        weigh_tile(job, part, type, kv, h0, 1, 4, c0, t0, rows, st, sh);
}

/* Every head's weighted values into part->acc, a tile of slots at a time: per KV head, its
 * query heads 3 (or 2, or 1) at a time, 32 dimensions at a time (64 for one head, where head_dim
 * allows). */
KERNEL void weighted_values(const Job *job, Part *part, int type, Stream *st) {
    const int d = job->head_dim, group = job->heads / job->kv_heads, n = part->hi - part->lo + 1;
    const int width = group == 1 && d % 64 == 0 && type != INT8_WORDS ? 64 : 32;
    const int passes = job->kv_heads * head_passes(group) * (d / width);
    for (int t0 = 0; t0 < n; t0 += st->tile) {
        const int rows = n - t0 < st->tile ? n - t0 : st->tile;
        Share sh = share(st, n + t0, rows, passes * ((rows + 3) / 4));
        for (int kv = 0; kv < job->kv_heads; kv++)
            for (int g0 = 0; g0 < group;) {
                const int G = heads_at_once(group - g0), h0 = kv * group + g0;
                for (int c0 = 0; c0 < d; c0 += width)
                    weigh_pass(job, part, type, kv, h0, G, width, c0, t0, rows, st, &sh);
                g0 += G;
            }
    }
}

/* numerators() for the integer weighted values: a head's n masked scores made int16 numerators in
 * words, words[n] a 0 for an odd last slot's partner. Without row scales, e^(score - top) * 32767
 * rounded, in one pass, and the sum returned is theirs, in the same units. With them, e^(score -
 * top) * scale in units (*unit) of the head's largest such weight in the part, so the int16 range
 * goes to the rows the head attends to, whatever the scales of rows it ignores; the sum is the e^
 * summed, and the caller brings the weighted values to its units. `sc` may be overwritten. */
KERNEL float numerators_words(float *sc, const float *scale, int n, float top, int16_t *words, float *unit) {
    const float one = 32767.0f;
    float largest = 1.0f, total = 0.0f;
    if (scale) {
        total = numerators(sc, scale, n, top); /* sc: e^ x scale, at least 0 */
        largest = max_of(sc, n);
    }
    const float step = largest > 0.0f ? one / largest : 0.0f;
    const __m256 step8 = _mm256_set1_ps(step);
    /* Without row scales, e^(x - top) x 32767 as 2^t, t = x log2(e) - top log2(e) + log2(32767) in
     * one FMA, floored at -30 (2^-30 rounds to 0, so no compare), and 2^frac(t) by a 4th-degree
     * polynomial (relative error 2.7e-6, a tenth of the rounding's step at 32767): 17 instructions
     * for 8 numerators where exp_nonpositive8 and a multiply took 24. */
    const __m256 log2e = _mm256_set1_ps(1.44269504f), lowest = _mm256_set1_ps(-30.0f);
    const __m256 bias = _mm256_set1_ps(14.9999560f - top * 1.44269504f); /* log2(32767) */
    __m256i sum = _mm256_setzero_si256();
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 x = _mm256_loadu_ps(sc + i);
        __m256i q;
        if (scale) {
            q = _mm256_cvtps_epi32(_mm256_mul_ps(x, step8));
        } else {
            const __m256 t = _mm256_max_ps(_mm256_fmadd_ps(x, log2e, bias), lowest);
            const __m256 whole = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            const __m256 f = _mm256_sub_ps(t, whole);
            __m256 p = _mm256_fmadd_ps(_mm256_set1_ps(9.56999324e-3f), f, _mm256_set1_ps(5.59175424e-2f));
            p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.40247443e-1f));
            p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.93121850e-1f));
            p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.99999285e-1f));
            const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(whole), _mm256_set1_epi32(127)),
                                                   23); /* 2^whole */
            q = _mm256_cvtps_epi32(_mm256_mul_ps(p, _mm256_castsi256_ps(bits)));
        }
        sum = _mm256_add_epi32(sum, q);
        _mm_storeu_si128((__m128i *)(words + i),
                         _mm_packs_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1)));
    }
    __m128i half = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
    half = _mm_add_epi32(half, _mm_shuffle_epi32(half, 0x4E));
    int32_t count = _mm_cvtsi128_si32(_mm_add_epi32(half, _mm_shuffle_epi32(half, 0xB1)));
    for (; i < n; i++)
        count += words[i] = (int16_t)__builtin_lrintf((scale ? sc[i] : exp_nonpositive(sc[i] - top)) * step);
    words[n] = 0;
    *unit = largest / one;
    return scale ? total : (float)count;
}

KERNEL void attend_typed(const Job *job, Part *part, int type) {
    const int n = part->hi - part->lo + 1, group = job->heads / job->kv_heads;
    Stream st = stream(job, part, element_bytes_of(type));
    float tops[8 * job->heads]; /* per head, its largest score so far in each lane */
    for (int i = 0; i < 8 * job->heads; i++) tops[i] = -__builtin_inff();
    scores(job, part, type, &st, tops);
    float units[type == INT8_WORDS ? job->heads : 1]; /* per head, what a step of its integer sums is worth */
    for (int h = 0; h < job->heads; h++) {
        const float *scale = job->value_scales ? job->value_scales + (size_t)(h / group) * job->scale_stride + part->lo
                                               : NULL;
        float *sc = job->scores + (size_t)h * job->stride + part->first;
        const float top = part->max[h] = horizontal_max(_mm256_loadu_ps(tops + 8 * h));
        if (type == INT8_WORDS)
            part->sum[h] = numerators_words(sc, scale, n, top, part->numerators + (size_t)h * part->numerator_stride,
                                            &units[h]);
        else
            part->sum[h] = numerators(sc, scale, n, top);
    }
    weighted_values(job, part, type, &st);
    if (type == INT8_WORDS && job->value_scales) scale_heads(part->acc, units, job->heads, job->head_dim);
}

/* The query in int16 words for the integer path: head h's q ~ unit[h] * words[h], its largest
 * element 32767. */
TARGET void avx2_query_words(const Job *job, Digits *out) {
    const int d = job->head_dim;
    for (int h = 0; h < job->heads; h++) {
        const float *q = job->query + (size_t)h * d;
        int16_t *words = out->words + (size_t)h * d;
        float top = 0.0f;
        for (int j = 0; j < d; j++) top = __builtin_fabsf(q[j]) > top ? __builtin_fabsf(q[j]) : top;
        const float step = top > 0.0f ? 32767.0f / top : 0.0f;
        for (int j = 0; j < d; j++) words[j] = (int16_t)__builtin_lrintf(q[j] * step);
        out->unit[h] = top / 32767.0f;
    }
}

/* Whether attend_part_avx2 reads this job's keys in blocks itself (else they must come as rows). */
TARGET int avx2_reads_key_blocks(const Job *job) {
    /* a lane sums a slot's whole dot product: d x 128 x 32767 fits int32 up to d = 512 */
    return job->int8_dot && int8_codes(job->cache_type) && job->head_dim <= 512 &&
           atomic_load_explicit(&avx2_allowed, memory_order_relaxed) == 1;
}

TARGET void attend_part_avx2(const Job *job, Part *part) {
    const int integer = atomic_load_explicit(&avx2_allowed, memory_order_relaxed) == 1; /* not 2 (tests) */
    if (job->int8_dot && int8_codes(job->cache_type) && integer) {
        attend_typed(job, part, INT8_WORDS);
        return;
    }
    switch (job->cache_type) {
    case CACHE_F32: attend_typed(job, part, CACHE_F32); break;
    case CACHE_F16: attend_typed(job, part, CACHE_F16); break;
    default: attend_typed(job, part, CACHE_I8); break; /* CACHE_I8 and CACHE_I8_ROWS: int8 codes */
    }
}

#endif
