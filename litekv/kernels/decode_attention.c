/* One-token attention over a KV cache, as a LiteRT custom op ("litekv.decode_attention").
 *
 * A decode step's attention reads each layer's whole cache for a single query row. XNNPACK runs
 * it as two batch matmuls that repack the cache on every call; this kernel streams each cached
 * row once, in place, for all heads.
 *
 * Inputs:  query  f32 [1, 1, H*D]   (RoPE and the attention scale already applied)
 *          keys   f32 [1, S, KVH*D] (the cache rows, this step's row already written)
 *          values f32 [1, S, KVH*D]
 *          mask   f32 [.., S]       (0 = attend; <= -1e30 = masked; added to the scores)
 * Output:  f32 [1, 1, H*D], head h attending with KV head h / (H / KVH).
 * "litekv.decode_attention_int8" takes int8 keys and values instead: the codes of a cache with one
 * static scale per channel, which the graph folds into the query (keys) and the output (values),
 * so the kernel reads a quarter of the bytes and needs no scales. "litekv.decode_attention_f16"
 * takes float16 keys and values: half the bytes, with no scales at all.
 * S and H come from the buffer sizes, D from the registration (AttentionConfig), which also
 * carries the two LiteRT entry points the kernel calls, so this library does not link LiteRT.
 *
 * The unmasked span of slots is cut in chunks (chunk_slots()); each chunk's scores, softmax
 * numerators and weighted values are computed on their own and merged with their maxima (as in
 * split-K "flash decoding"). With two threads, the caller and a helper thread take chunks until
 * none is left: the helper starts 15-25 us after it is signalled here (XNNPACK's worker spins on the
 * other core for that long after its last task, however the graph ends before this op), so a fixed
 * half for it would leave the caller waiting. Between calls the helper polls, then sleeps (at once
 * where the step's linears are not litekv's: helper_main).
 *
 * "litekv.decode_attention_rope", "..._rope_f16" and "..._rope_int8" take a float32, float16 or
 * statically scaled int8 step's query and new rows as projected, and apply RoPE and the scale and
 * convert (or quantize) and write the rows themselves (run_rope), where the graph spent 7 ops a layer
 * on that (16 for int8).
 *
 * The same registration serves "litekv.linear_int4" / "litekv.linear_int8" (linear.c: a decode
 * step's quantized projections, their rows shared by the same two threads) and "litekv.rope"
 * (rope.c), so that a step built with them gives XNNPACK's worker nothing to wake for.
 */
#define _GNU_SOURCE /* pthread_setname_np */
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "attention_common.h"
#include "linear.h"

#ifndef IDLE_SECONDS
#define IDLE_SECONDS 0.002
#endif
#define MAX_RANK 8
#ifndef CHUNK_SLOTS
#define CHUNK_SLOTS 1024 /* an int8 cache's chunks: each restarts the passes over the rows (their first prefetched
                            rows arrive late), and with the helper joining within a microsecond (the steps' linears
                            are litekv's) two chunks of 1,024 beat six of 342 at 2,048 slots: an int4 SmolLM2 step
                            6.58-6.71 ms against 6.84-7.23 (512: 6.82-6.86; 256: 7.06-7.12), alternating */
#endif
#ifndef SPLIT_SLOTS
#define SPLIT_SLOTS 192 /* an int8 cache's calls over more slots than this go in two chunks at least. With the
                           helper polling (litekv's linears), a 320-slot call of an int4 SmolLM2 step took 12-16 us
                           in two chunks against 16-24 in one (at 384; 9 processes each, taking turns) */
#endif
#ifndef FLOAT_CHUNK_SLOTS
#define FLOAT_CHUNK_SLOTS 192 /* a float cache's row is 4x the bytes: 384 slots were one chunk, which left the
                                 helper idle through the 256-384 slots of a short chat (56 us per call,
                                 24 in chunks of 192; 128: 29, 96: 28) */
#endif
#ifndef FLOAT_PREFETCH_ROWS
#define FLOAT_PREFETCH_ROWS 24 /* 32 rows of SmolLM2's 768 bytes are 6 pages exactly, and prefetches at the loads'
                                  offset within a page ran slower: 118-124 us per 2,048-slot call against 106-114
                                  for 20-40 rows off a page multiple; 16 and 48 rows (also multiples) as slow */
#endif
/* A chunk's numerators, a zero after an odd count, even. A chunk holds at most CHUNK_SLOTS slots, or
 * with keys in blocks 8 more (its ends are rounded to the nearest block boundary, compute()). */
#define NUMERATOR_STRIDE (CHUNK_SLOTS + KEY_BLOCK_SLOTS + 2)
/* The rope forms' inputs (run_rope): query, caches, mask, new key and value rows, cos, sin, slot, scale. */
#define ROPE_INPUTS 10
/* The int8 rope form's: the same 9, then the query's factors, the key and value rows' inverse scales
 * and the output's factors, in place of the scale. */
#define ROPE_INT8_INPUTS 13

typedef int Status; /* LiteRtStatus: 0 = ok */
enum { STATUS_OK = 0, STATUS_INVALID_ARGUMENT = 1, STATUS_RUNTIME_FAILURE = 3 };

typedef struct {
    unsigned int rank : 7;
    bool has_strides : 1;
    int32_t dimensions[MAX_RANK];
    uint32_t strides[MAX_RANK];
} Layout; /* LiteRtLayout */

typedef Status (*HostMemoryFn)(void *buffer, void **address);
typedef Status (*SizeFn)(void *buffer, size_t *size);

/* What Python hands to the kernel as user data; one per compiled model. */
typedef struct {
    HostMemoryFn host_memory;
    SizeFn buffer_size;
    int32_t head_dim;
    int32_t threads;
    int32_t max_slots; /* scratch is sized for this many slots per head */
    int32_t num_heads;
    int32_t int8_dot; /* int8 caches: integer dot products where the CPU has them (else codes widen to floats) */
    void *state; /* owned by this library: scratch and the helper thread */
} AttentionConfig;

enum { TASK_DECODE, TASK_PREFILL, TASK_LINEAR };

/* Each part's sums, maxima and numerators start a page (the sums and numerators) or a cache line
 * (the maxima) of their own: the two threads write their parts at once, and parts packed end to end
 * shared lines, which bounced between the cores. An int4 SmolLM2 step at 2,048 tokens took 0.975x
 * the time (LiteRT; ONNX 0.986x), the helper's chunk the most (bench/PERFORMANCE.md, thirty-fourth
 * round). */
#define PART_ALIGN_BYTES 4096
#define LINE_FLOATS 16

typedef struct {
    float *scores;         /* [heads][max_slots] */
    float *acc, *max, *sum; /* [max_parts][acc_stride], [max_parts][max_stride] x 2 */
    int16_t *numerators;   /* [max_parts][numerator_part]: [heads][NUMERATOR_STRIDE] each, for the int8 dot-product path */
    size_t acc_stride, max_stride, numerator_part; /* a part's, rounded up (PART_ALIGN_BYTES, LINE_FLOATS) */
    int8_t *digit_bytes;   /* [2][heads * D] behind `digits` */
    Digits digits;
    Part *parts;           /* [max_parts] */
    int max_slots, max_parts, int8_dot; /* int8_dot: an Int8Dot */
    int vector_linears; /* the linears' vector path: allowed (AttentionConfig.int8_dot) and on this CPU */
    pthread_t helper;
    pthread_mutex_t lock;
    pthread_cond_t wake;
    atomic_int stop;
    atomic_int serves_linears; /* set once a linear's rows were shared: the helper polls between calls */
    uint64_t calls;
    Job job;
    PrefillJob prefill;     /* the call's job when kind == TASK_PREFILL */
    LinearJob linear;       /* ... TASK_LINEAR */
    int kind;
    void *linear_scratch;   /* the activations as linear_prepare writes them, grown to the widest call */
    size_t linear_scratch_bytes;
    float *screen_heap;     /* a screened head's keep lower bounds, grown to the largest keep */
    int screen_heap_floats;
    uint64_t stat_screened_rows, stat_screened_calls; /* rows a screened head computed exactly, and its calls */
    float *prefill_scratch[2]; /* the caller's and the helper's, made at the first prefill call */
    float *zero_mask;       /* max_slots zeros: the mask of a call given its span (ONNX Runtime's op) */
    float *rotated;         /* [2 heads * D]: a rope form's query, then its key row, after RoPE */
    int8_t *unblocked;      /* keys in blocks as rows, for the paths that read rows (made at first use) */
    size_t unblocked_bytes; /* max_slots x heads x D: room for any call's keys */
    int helper_running;
    const LentThreads *lent; /* the current call's threads in place of the helper (NULL: the helper's) */
    /* What the threads write while the other reads: each on its own cache line, away from the job
     * (a shared line would bounce between the cores on every access to the job's fields). */
    _Alignas(64) atomic_int generation;
    _Atomic double signalled; /* seconds() when the caller offered the latest call's chunks */
    /* the chunks on offer: call number << 40 | end << 20 | next chunk, chunks [next, end) left. A
     * thread takes a chunk by advancing `next` (or, the helper in a linear, lowering `end`) with a
     * compare-and-swap, so a thread holding an old value can never take a chunk of a later call. */
    _Alignas(64) _Atomic uint64_t ticket;
    _Alignas(64) atomic_int completed;
    /* Counters for litekv_attention_stats: the caller's, then the helper's on its own line. Of the
     * calls offered to the helper (shared), the caller's time in its own chunks and waiting for the
     * helper's after them, and the helper's time in its chunks: where two threads lose to one. */
    _Alignas(64) uint64_t stat_calls, stat_nanoseconds, stat_chunks;
    uint64_t stat_shared_calls, stat_caller_chunk_nanoseconds, stat_wait_nanoseconds;
    _Alignas(64) _Atomic uint64_t stat_helper_chunks, stat_helper_joins, stat_helper_delay_nanoseconds;
    _Atomic uint64_t stat_helper_chunk_nanoseconds;
    _Atomic uint64_t stat_lent_chunks; /* chunks a lent thread other than the caller computed */
    char padding[56];
} State;

/* ---- the arithmetic ------------------------------------------------------------------------- */

/* Adds the mask to n scores and replaces them with e^(score - max); returns their sum, the max in
 * *best. Masked slots need no special case: a score plus a mask <= -1e30 is far below the maximum
 * (an unmasked slot: the live span ends in unmasked slots and each part has one), so e^ is 0. */
INLINE float softmax_numerators(float *restrict scores, const float *restrict mask, int n, float *best) {
    float total = 0.0f;
    for (int i = 0; i < n; i++) scores[i] += mask[i];
    const float top = max_of(scores, n); /* a local: through `best` the stores could change it */
    for (int i = 0; i < n; i++) {
        scores[i] = exp_nonpositive(scores[i] - top);
        total += scores[i];
    }
    *best = top;
    return total;
}

/* Lane r of the result is the sum of the 16 lanes of a[r]: a transpose-and-add tree, 45 vector
 * operations for 16 dot products instead of 16 horizontal sums. */
INLINE v16 sum16x16(const v16 *a) {
    v16 b[8], c[4], d[2];
    for (int j = 0; j < 8; j++)
        b[j] = __builtin_shufflevector(a[2 * j], a[2 * j + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
               __builtin_shufflevector(a[2 * j], a[2 * j + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    for (int j = 0; j < 4; j++)
        c[j] = __builtin_shufflevector(b[2 * j], b[2 * j + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
               __builtin_shufflevector(b[2 * j], b[2 * j + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    for (int j = 0; j < 2; j++)
        d[j] = __builtin_shufflevector(c[2 * j], c[2 * j + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
               __builtin_shufflevector(c[2 * j], c[2 * j + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
    return __builtin_shufflevector(d[0], d[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
           __builtin_shufflevector(d[0], d[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

#define BLOCK 16 /* slots per block: one vector of scores per head */

/* Widened codes of rows s0.. times their scales, with a scale per row (CACHE_I8_ROWS). */
INLINE void scale_rows(const Job *job, float *restrict rows_out, const float *scales, int s0, int rows) {
    if (!scales) return;
    const int d = job->head_dim;
    for (int r = 0; r < rows; r++)
        for (int kv = 0; kv < job->kv_heads; kv++) {
            const float scale = row_scale(scales, job->scale_stride, kv, s0 + r);
            float *x = rows_out + (size_t)r * job->row + (size_t)kv * d;
            for (int j = 0; j < d; j++) x[j] *= scale;
        }
}

/* Prefetches slice `part` of `parts` of the 64-byte lines of the rows `ahead` slots past
 * s0..s0+rows-1 (contiguous). The passes call it once per head or row, so the prefetches spread
 * over the arithmetic: issued as one burst per block, they filled the core's miss buffers and
 * stalled it, and a float cache (12 lines a row) streamed at half a core's read rate. */
INLINE void prefetch_slice(const char *base, size_t row_bytes, int s0, int rows, int ahead, int part, int parts) {
    const size_t lines = (size_t)rows * row_bytes / 64, from = lines * part / parts, to = lines * (part + 1) / parts;
    const char *first = base + (size_t)(s0 + ahead) * row_bytes;
    for (size_t line = from; line < to; line++) __builtin_prefetch(first + 64 * line, 0, PREFETCH_LOCALITY);
}

/* Rows s0..s0+rows-1 of an int8 or float16 cache widened to floats in `buffer`: [rows][row] for a
 * [S][KVH * D] cache, [KVH][BLOCK][D] for a head-major one (each KV head's rows are contiguous). */
INLINE void widen_rows(const Job *job, float *restrict buffer, const void *cache, size_t element_bytes, int s0, int rows,
                       bool interleaved) {
    const size_t row = (size_t)job->row;
    if (interleaved) {
        widen(buffer, cache, element_bytes, (size_t)s0 * row, (size_t)rows * row);
        return;
    }
    for (int kv = 0; kv < job->kv_heads; kv++)
        widen(buffer + (size_t)kv * BLOCK * row, cache, element_bytes, (size_t)kv * job->head_stride + (size_t)s0 * row,
              (size_t)rows * row);
}

/* Scores, softmax numerators and weighted values of slots part->lo..hi for every head, head_dim =
 * 16 * C, cache elements of type T (float; int8_t codes or float16 bits widened a block of rows at a
 * time into an L1 buffer). Slots go in blocks of 16: each head's 16 dot products end in one reduction tree,
 * and the weighted values of GB heads at a time stay in registers while the block's rows are
 * read. Prefetching runs the same bytes ahead for any T, spread over the passes. */
#define ROWS_AS_FLOAT(cache, scales, s0, rows, buffer)                                                 \
    (sizeof(*(cache)) < sizeof(float)                                                                  \
         ? (widen_rows(job, buffer, cache, sizeof(*(cache)), s0, rows, interleaved),                   \
            scale_rows(job, buffer, scales, s0, rows), (const float *)(buffer))                        \
         : (const float *)(const void *)(cache) + (size_t)(s0) * row)
#define DEFINE_PART(NAME, C, GB, T)                                                                    \
    INLINE void NAME(const Job *job, Part *part) {                                                     \
        const int heads = job->heads, group = heads / job->kv_heads, row = job->row;                   \
        const int n = part->hi - part->lo + 1,                                                         \
                  ahead = sizeof(T) == 1 ? PREFETCH_ROWS * 4 : FLOAT_PREFETCH_ROWS * 4 / (int)sizeof(T); \
        const int passes = (group + GB - 1) / GB; /* value passes over a block per KV head */          \
        const T *keys = job->keys, *values = job->values;                                              \
        /* a head-major cache: each KV head's rows are prefetched on their own */                      \
        const bool interleaved = job->head_stride == (size_t)job->head_dim;                            \
        float widened[sizeof(T) < sizeof(float) ? BLOCK * job->kv_heads * job->head_dim : 1];          \
        /* from one KV head's row to the next in `block`: widened head-major rows are [KVH][BLOCK][D] */ \
        const size_t bhead = sizeof(T) < sizeof(float) && !interleaved ? (size_t)BLOCK * row : job->head_stride; \
        for (int i0 = 0; i0 < n; i0 += BLOCK) {                                                        \
            const int rows = n - i0 < BLOCK ? n - i0 : BLOCK, s0 = part->lo + i0;                      \
            const float *block = ROWS_AS_FLOAT(keys, job->key_scales, s0, rows, widened);              \
            for (int kv = 0; kv < job->kv_heads; kv++)                                                 \
                for (int g = 0; g < group; g++) {                                                      \
                    const int h = kv * group + g;                                                      \
                    if (interleaved)                                                                   \
                        prefetch_slice((const char *)keys, sizeof(T) * row, s0, rows, ahead, h, heads); \
                    else                                                                               \
                        prefetch_slice((const char *)(keys + (size_t)kv * job->head_stride), sizeof(T) * row, s0, \
                                       rows, ahead, g, group);                                         \
                    const float *q = job->query + (size_t)h * 16 * C;                                  \
                    v16 a[BLOCK];                                                                      \
                    _Pragma("GCC unroll 16") for (int r = 0; r < BLOCK; r++) {                         \
                        const float *k = block + (size_t)(r < rows ? r : 0) * row + (size_t)kv * bhead;   \
                        a[r] = load16(q) * load16(k);                                                  \
                        _Pragma("GCC unroll 16") for (int c = 1; c < C; c++) a[r] += load16(q + 16 * c) * load16(k + 16 * c); \
                    }                                                                                  \
                    const v16 sums = sum16x16(a);                                                      \
                    memcpy(job->scores + (size_t)h * job->stride + part->first + i0, &sums, sizeof(float) * rows); \
                }                                                                                      \
        }                                                                                              \
        for (int h = 0; h < heads; h++)                                                                \
            part->sum[h] = softmax_numerators(job->scores + (size_t)h * job->stride + part->first,     \
                                              job->mask + part->lo, n, &part->max[h]);                 \
        memset(part->acc, 0, sizeof(float) * (size_t)heads * 16 * C);                                  \
        for (int i0 = 0; i0 < n; i0 += BLOCK) {                                                        \
            const int rows = n - i0 < BLOCK ? n - i0 : BLOCK, s0 = part->lo + i0;                      \
            const float *block = ROWS_AS_FLOAT(values, job->value_scales, s0, rows, widened);          \
            for (int kv = 0; kv < job->kv_heads; kv++)                                                 \
                for (int g0 = 0; g0 < group; g0 += GB) {                                               \
                    const int gb = group - g0 < GB ? group - g0 : GB;                                  \
                    v16 acc[GB][C];                                                                    \
                    float *dst = part->acc + (size_t)(kv * group + g0) * 16 * C;                       \
                    _Pragma("GCC unroll 16") for (int g = 0; g < GB; g++)                              \
                        _Pragma("GCC unroll 16") for (int c = 0; c < C; c++) acc[g][c] = g < gb ? load16(dst + (g * C + c) * 16) : (v16){0}; \
                    for (int r = 0; r < rows; r++) {                                                   \
                        if (interleaved)                                                               \
                            prefetch_slice((const char *)values, sizeof(T) * row, s0, rows, ahead,     \
                                           (kv * passes + g0 / GB) * rows + r, job->kv_heads * passes * rows); \
                        else                                                                           \
                            prefetch_slice((const char *)(values + (size_t)kv * job->head_stride), sizeof(T) * row, \
                                           s0, rows, ahead, g0 / GB * rows + r, passes * rows);        \
                        const float *v = block + (size_t)r * row + (size_t)kv * bhead;                 \
                        v16 value[C];                                                                  \
                        _Pragma("GCC unroll 16") for (int c = 0; c < C; c++) value[c] = load16(v + 16 * c); \
                        _Pragma("GCC unroll 16") for (int g = 0; g < GB; g++) {                        \
                            const float w = g < gb ? job->scores[(size_t)(kv * group + g0 + g) * job->stride + part->first + i0 + r] : 0.0f; \
                            _Pragma("GCC unroll 16") for (int c = 0; c < C; c++) acc[g][c] += w * value[c]; \
                        }                                                                              \
                    }                                                                                  \
                    for (int g = 0; g < gb; g++) memcpy(dst + g * C * 16, acc[g], sizeof acc[g]);      \
                }                                                                                      \
        }                                                                                              \
    }

DEFINE_PART(part_4, 4, 3, float)
DEFINE_PART(part_8, 8, 1, float)
DEFINE_PART(part_16, 16, 1, float)
DEFINE_PART(part_4_i8, 4, 3, int8_t)
DEFINE_PART(part_8_i8, 8, 1, int8_t)
DEFINE_PART(part_16_i8, 16, 1, int8_t)
DEFINE_PART(part_4_f16, 4, 3, uint16_t)
DEFINE_PART(part_8_f16, 8, 1, uint16_t)
DEFINE_PART(part_16_f16, 16, 1, uint16_t)

/* Any head_dim: the same computation one element at a time. */
INLINE void part_any(const Job *job, Part *part) {
    const int d = job->head_dim, heads = job->heads, group = heads / job->kv_heads, n = part->hi - part->lo + 1;
    for (int h = 0; h < heads; h++) {
        const float *q = job->query + (size_t)h * d;
        float *sc = job->scores + (size_t)h * job->stride + part->first, best = -INFINITY, total = 0.0f;
        for (int i = 0; i < n; i++) {
            const int s = part->lo + i;
            const size_t k = (size_t)s * job->row + (size_t)(h / group) * job->head_stride;
            float dot = 0.0f;
            for (int j = 0; j < d; j++) dot += q[j] * element(job->keys, k + j, job->cache_type);
            dot *= row_scale(job->key_scales, job->scale_stride, h / group, s);
            sc[i] = job->mask[s] <= MASKED_BELOW ? -INFINITY : dot + job->mask[s];
            best = sc[i] > best ? sc[i] : best;
        }
        float *acc = part->acc + (size_t)h * d;
        memset(acc, 0, sizeof(float) * d);
        for (int i = 0; i < n; i++) {
            sc[i] = exp_nonpositive(sc[i] - best);
            total += sc[i];
            const size_t v = (size_t)(part->lo + i) * job->row + (size_t)(h / group) * job->head_stride;
            const float w = sc[i] * row_scale(job->value_scales, job->scale_stride, h / group, part->lo + i);
            for (int j = 0; j < d; j++) acc[j] += w * element(job->values, v + j, job->cache_type);
        }
        part->max[h] = best;
        part->sum[h] = total;
    }
}

VECTOR_CLONES static void attend_part(const Job *job, Part *part) {
#if LITEKV_INT8_DOT
    if (job->int8_dot == INT8_DOT_VNNI) {
        attend_part_int8_dot(job, part);
        return;
    }
#endif
#if LITEKV_AVX2
    if (avx2_head_dim(job->head_dim) && litekv_decode_avx2()) { /* with Job.int8_dot: integer dot products */
        attend_part_avx2(job, part);
        return;
    }
#endif
#define SHAPE(type, head_dim) ((type) << 16 | (head_dim))
    switch (SHAPE(job->cache_type, job->head_dim)) {
    case SHAPE(CACHE_F32, 64): part_4(job, part); break;
    case SHAPE(CACHE_F32, 128): part_8(job, part); break;
    case SHAPE(CACHE_F32, 256): part_16(job, part); break;
    case SHAPE(CACHE_I8, 64): part_4_i8(job, part); break;
    case SHAPE(CACHE_I8, 128): part_8_i8(job, part); break;
    case SHAPE(CACHE_I8, 256): part_16_i8(job, part); break;
    case SHAPE(CACHE_I8_ROWS, 64): part_4_i8(job, part); break;
    case SHAPE(CACHE_I8_ROWS, 128): part_8_i8(job, part); break;
    case SHAPE(CACHE_I8_ROWS, 256): part_16_i8(job, part); break;
    case SHAPE(CACHE_F16, 64): part_4_f16(job, part); break;
    case SHAPE(CACHE_F16, 128): part_8_f16(job, part); break;
    case SHAPE(CACHE_F16, 256): part_16_f16(job, part); break;
    default: part_any(job, part);
    }
#undef SHAPE
}

/* out[h] = sum over parts of acc * e^(max - M) / sum over parts of sum * e^(max - M). */
static void merge(const Job *job, const Part *parts, int count, float *out) {
    const int d = job->head_dim;
    for (int h = 0; h < job->heads; h++) {
        float best = -INFINITY, total = 0.0f, weight[count];
        for (int p = 0; p < count; p++) best = parts[p].max[h] > best ? parts[p].max[h] : best;
        for (int p = 0; p < count; p++) {
            weight[p] = parts[p].sum[h] > 0.0f ? exp_nonpositive(parts[p].max[h] - best) : 0.0f;
            total += weight[p] * parts[p].sum[h];
        }
        float *o = out + (size_t)h * d;
        memset(o, 0, sizeof(float) * d);
        for (int p = 0; p < count; p++) {
            const float w = weight[p] / total, *acc = parts[p].acc + (size_t)h * d;
            for (int j = 0; j < d; j++) o[j] += w * acc[j];
        }
    }
}

/* ---- the helper thread ---------------------------------------------------------------------- */

static double seconds(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

#define TICKET_FIELD 0xFFFFFu

/* Takes and computes chunks of the current call until none is left; returns how many it took.
 * The helper counts its chunks, and the call as joined `delay` seconds after the offer, before it
 * reports each chunk complete: when the caller returns, the counters include the whole call. */
static uint64_t take_chunks(State *st, bool helper, double delay) {
    /* In a linear the helper takes rows from the end, so each thread streams its own span of the
     * weights: taken in turn, the chunks of a 4,096 x 576 int8 linear read at 40 GB/s from memory,
     * split at 57-59 (bench/PERFORMANCE.md, fifteenth round). */
    const bool from_end = helper && st->kind == TASK_LINEAR;
    uint64_t t = atomic_load_explicit(&st->ticket, memory_order_acquire), taken = 0;
    while ((t & TICKET_FIELD) < ((t >> 20) & TICKET_FIELD)) {
        const uint64_t next = from_end ? t - ((uint64_t)1 << 20) : t + 1;
        if (atomic_compare_exchange_weak_explicit(&st->ticket, &t, next, memory_order_acq_rel, memory_order_acquire)) {
            const int task = (int)(from_end ? ((t >> 20) & TICKET_FIELD) - 1 : t & TICKET_FIELD);
            if (helper && st->kind == TASK_DECODE) {
                if (!taken) {
                    atomic_fetch_add_explicit(&st->stat_helper_joins, 1, memory_order_relaxed);
                    atomic_fetch_add_explicit(&st->stat_helper_delay_nanoseconds, (uint64_t)(1e9 * delay),
                                              memory_order_relaxed);
                }
                atomic_fetch_add_explicit(&st->stat_helper_chunks, 1, memory_order_relaxed);
            }
            if (st->kind == TASK_PREFILL)
                prefill_task(&st->prefill, task, st->prefill_scratch[helper]);
            else if (st->kind == TASK_LINEAR)
                linear_task(&st->linear, task);
            else {
                const double start = helper ? seconds() : 0.0; /* the caller's chunks are timed in share() */
                attend_part(&st->job, &st->parts[task]);
                if (helper)
                    atomic_fetch_add_explicit(&st->stat_helper_chunk_nanoseconds,
                                              (uint64_t)(1e9 * (seconds() - start)), memory_order_relaxed);
            }
            atomic_fetch_add_explicit(&st->completed, 1, memory_order_release);
            t = atomic_load_explicit(&st->ticket, memory_order_acquire);
            taken++;
        }
    }
    return taken;
}

/* Where a step's linears are litekv's too, the helper's next work is microseconds away, and waking
 * a sleeping thread costs more than that here (a VM's cross-core wake-up). So the helper polls,
 * yielding the core to any thread that wants it, and sleeps only once no work came for
 * IDLE_SECONDS: the application is between steps, not inside one. Where the linears are another
 * pool's (XNNPACK's float projections), the attention calls are hundreds of microseconds apart and
 * the pool's worker holds the other core anyway: polling there only took time slices from that
 * worker (an fp32 SmolLM2 decode 1-2 % slower, bench/PERFORMANCE.md, twenty-fifth round), so the
 * helper sleeps as soon as a call's work is done. */
static void *helper_main(void *arg) {
    State *st = arg;
    int seen = 0;
    for (;;) {
        const double idle_since = seconds();
        for (int polls = 0; atomic_load_explicit(&st->generation, memory_order_acquire) == seen &&
                            !atomic_load(&st->stop); polls++) {
            const bool poll = atomic_load_explicit(&st->serves_linears, memory_order_relaxed);
            if (poll) sched_yield();
            if (!poll || (polls % 64 == 63 && seconds() - idle_since > IDLE_SECONDS)) {
                pthread_mutex_lock(&st->lock);
                while (atomic_load(&st->generation) == seen && !atomic_load(&st->stop))
                    pthread_cond_wait(&st->wake, &st->lock);
                pthread_mutex_unlock(&st->lock);
            }
        }
        if (atomic_load(&st->stop)) return NULL;
        seen = atomic_load_explicit(&st->generation, memory_order_acquire);
        take_chunks(st, true, seconds() - atomic_load_explicit(&st->signalled, memory_order_relaxed));
    }
}

/* ---- the computation, on host arrays -------------------------------------------------------- */

/* The mask's live span (mask_span), in each ISA's clone for the vector compare. */
VECTOR_CLONES static void live_span(const float *mask, int slots, int *lo, int *hi) { mask_span(mask, slots, lo, hi); }

static void compute(State *st, Job *job, int lo, int hi, float *out);
static void share(State *st, int count);

/* One call over slots lo..hi (none if lo > hi), which the mask may mask further, counted for
 * litekv_attention_stats (a clock read costs tens of nanoseconds; a call microseconds). */
static void attend_span(State *st, Job *job, int lo, int hi, float *out) {
    const double start = seconds();
    compute(st, job, lo, hi, out);
    st->stat_calls++;
    st->stat_nanoseconds += (uint64_t)(1e9 * (seconds() - start));
}

/* One call over the mask's live span. */
static void attend(State *st, Job *job, int slots, float *out) {
    int lo, hi;
    live_span(job->mask, slots, &lo, &hi);
    attend_span(st, job, lo, hi, out);
}

/* Slots per chunk for a cache of this element type. */
static int chunk_slots(const Job *job) { return int8_codes(job->cache_type) ? CHUNK_SLOTS : FLOAT_CHUNK_SLOTS; }

/* A call's chunks, taken in turn by the threads a caller lends. */
/* A call's chunks (a decode's parts, or a linear's tasks), taken by the threads a caller lends:
 * worker 0 from the front and worker 1 from the back, so in a linear each streams its own span of
 * the weights (as the helper does: in take_chunks). `span` holds the chunks left, end << 32 | next. */
typedef struct {
    const Job *job;          /* a decode's, with its parts */
    Part *parts;
    const LinearJob *linear; /* else a linear's */
    _Atomic uint64_t span;
    pthread_t caller;
    _Atomic uint64_t *others_chunks; /* counts the chunks threads other than the caller took */
} LentWork;

static LentWork lent_work(const Job *job, Part *parts, const LinearJob *linear, int count, _Atomic uint64_t *counter) {
    return (LentWork){job, parts, linear, (uint64_t)count << 32, pthread_self(), counter};
}

/* The next chunk for `worker` (from the front for 0, the back for 1), or -1 when none is left. */
static int lent_take(LentWork *work, size_t worker) {
    uint64_t span = atomic_load_explicit(&work->span, memory_order_acquire);
    for (;;) {
        const uint32_t next = (uint32_t)span, end = (uint32_t)(span >> 32);
        if (next >= end) return -1;
        const uint64_t left = worker ? (uint64_t)(end - 1) << 32 | next : (uint64_t)end << 32 | (next + 1);
        if (atomic_compare_exchange_weak_explicit(&work->span, &span, left, memory_order_acq_rel,
                                                  memory_order_acquire))
            return (int)(worker ? end - 1 : next);
    }
}

static void lent_worker(void *data, size_t worker) {
    LentWork *work = data;
    uint64_t taken = 0;
    for (int i; (i = lent_take(work, worker)) >= 0; taken++) {
        if (work->linear)
            linear_task(work->linear, i);
        else
            attend_part(work->job, &work->parts[i]);
    }
    if (!pthread_equal(pthread_self(), work->caller))
        atomic_fetch_add_explicit(work->others_chunks, taken, memory_order_relaxed);
}

/* Runs a call's chunks on the lent threads, and on this one whatever they could not take. */
static void run_lent(const LentThreads *lent, LentWork *work) {
    if (lent->run(lent->pool, lent_worker, work)) lent_worker(work, 0);
}

/* Whether attend_part reads this job's keys in blocks (Job.key_blocks) as they are: the AVX2
 * integer path. */
static bool reads_key_blocks(const Job *job) {
#if LITEKV_AVX2
    return job->int8_dot == INT8_DOT_AVX2 && avx2_head_dim(job->head_dim) && litekv_decode_avx2() &&
           avx2_reads_key_blocks(job);
#else
    (void)job;
    return false;
#endif
}

/* The scratch keys_as_rows writes, made by the entry points of calls with keys in blocks (so a
 * failed allocation is their error, not a silent result). */
static Status make_unblocked(State *st) {
    if (!st->unblocked) st->unblocked = malloc(st->unblocked_bytes);
    return st->unblocked ? STATUS_OK : STATUS_RUNTIME_FAILURE;
}

/* Keys in blocks rewritten as rows lo..hi into the state's scratch (make_unblocked), for a path
 * that reads rows; returns them, laid out as the cache's rows would be. The entry points' checks
 * bound the rows to the scratch (slots <= max_slots, KVH <= heads). */
static const void *keys_as_rows(State *st, const void *keys, size_t row, size_t head_stride, int head_dim,
                                int kv_heads, int lo, int hi) {
    unblock_keys(st->unblocked, keys, row, head_stride, head_dim, kv_heads, lo, hi);
    return st->unblocked;
}

static void compute(State *st, Job *job, int lo, int hi, float *out) {
    const size_t width = (size_t)job->heads * job->head_dim;
    if (lo > hi) {
        memset(out, 0, sizeof(float) * width);
        return;
    }
    if (job->key_blocks && !reads_key_blocks(job)) {
        job->keys = keys_as_rows(st, job->keys, (size_t)job->row, job->head_stride, job->head_dim, job->kv_heads, lo, hi);
        job->key_blocks = 0;
    }
#if LITEKV_INT8_DOT
    if (job->int8_dot) {
        if (job->int8_dot == INT8_DOT_VNNI)
            int8_dot_digits(job, &st->digits);
        else
            avx2_query_words(job, &st->digits);
        job->digits = &st->digits;
    }
#endif
    /* At most chunk_slots() a chunk (8 more with keys in blocks: NUMERATOR_STRIDE), an even count of
     * near-equal chunks, so that neither of two threads waits for the other's last one: 2,048 slots
     * in chunks of 384 were 5 and one of 128,
     * one thread's share 1,152 slots and the other's 896. An int8 cache's calls over more than
     * SPLIT_SLOTS slots take two chunks at least. The same with one thread, whose sums then are the
     * same as two threads'. */
    const int slots = hi - lo + 1;
    int count = (slots - 1) / chunk_slots(job) + 1;
    if (count == 1 && int8_codes(job->cache_type) && slots > SPLIT_SLOTS) count = 2;
    if (count > 1 && count % 2 && count < st->max_parts) count++;
    const int chunk = (slots + count - 1) / count;
    int parts = 0;
    for (int start = lo, i = 0; start <= hi; i++) {
        int end = start + chunk; /* one past the chunk's last slot */
        if (job->key_blocks) /* chunks cut between blocks, so only the span's ends cut one */
            end = i + 1 >= count ? hi + 1
                                 : (lo + (i + 1) * chunk + KEY_BLOCK_SLOTS / 2) / KEY_BLOCK_SLOTS * KEY_BLOCK_SLOTS;
        if (end <= start) continue;
        end = end > hi + 1 ? hi + 1 : end;
        st->parts[parts] = (Part){start, end - 1, start - lo, st->acc + parts * st->acc_stride,
                                  st->max + parts * st->max_stride, st->sum + parts * st->max_stride,
                                  st->numerators ? st->numerators + parts * st->numerator_part
                                                 : NULL,
                                  NUMERATOR_STRIDE};
        parts++, start = end;
    }
    count = parts;
    st->stat_chunks += (uint64_t)count;
    if (st->lent && count > 1) {
        LentWork work = lent_work(job, st->parts, NULL, count, &st->stat_lent_chunks);
        run_lent(st->lent, &work);
    } else if (!st->helper_running || st->lent) {
        for (int i = 0; i < count; i++) attend_part(job, &st->parts[i]);
    } else {
        st->job = *job;
        st->kind = TASK_DECODE;
        share(st, count);
    }
    merge(job, st->parts, count, out);
}

/* Offers the `count` chunks of the job set in the state to the helper thread, takes chunks
 * itself, and returns when all are computed. */
static void share(State *st, int count) {
    atomic_store_explicit(&st->completed, 0, memory_order_relaxed);
    st->calls = (st->calls + 1) & 0xFFFFFF;
    atomic_store_explicit(&st->ticket, st->calls << 40 | (uint64_t)count << 20, memory_order_release);
    if (count > 1) { /* one chunk is not worth the helper's start-up */
        pthread_mutex_lock(&st->lock);
        atomic_store_explicit(&st->signalled, seconds(), memory_order_relaxed); /* before generation */
        atomic_fetch_add_explicit(&st->generation, 1, memory_order_release);
        pthread_cond_signal(&st->wake);
        pthread_mutex_unlock(&st->lock);
    }
    const bool timed = st->kind == TASK_DECODE && count > 1; /* not the linears: 121 calls a step */
    const double start = timed ? seconds() : 0.0;
    take_chunks(st, false, 0.0);
    const double own = timed ? seconds() : 0.0;
    while (atomic_load_explicit(&st->completed, memory_order_acquire) != count) sched_yield();
    if (timed) {
        st->stat_shared_calls++;
        st->stat_caller_chunk_nanoseconds += (uint64_t)(1e9 * (own - start));
        st->stat_wait_nanoseconds += (uint64_t)(1e9 * (seconds() - own));
    }
}

/* A prefill chunk's attention, its tasks shared between the threads like a decode's chunks. */
static Status compute_prefill(State *st, const PrefillJob *job) {
    if (!st->prefill_scratch[0]) { /* both or neither: the helper's only where it runs */
        const size_t bytes = (sizeof(float) * prefill_scratch_floats(job->heads, job->head_dim, st->max_slots) + 63) /
                             64 * 64;
        float *mine = aligned_alloc(64, bytes), *helper = st->helper_running ? aligned_alloc(64, bytes) : NULL;
        if (!mine || (st->helper_running && !helper)) {
            free(mine), free(helper);
            return STATUS_RUNTIME_FAILURE;
        }
        st->prefill_scratch[0] = mine, st->prefill_scratch[1] = helper;
    }
    const int count = prefill_tasks(job);
    if (!st->helper_running) {
        for (int i = 0; i < count; i++) prefill_task(job, i, st->prefill_scratch[0]);
    } else {
        st->prefill = *job;
        st->kind = TASK_PREFILL;
        share(st, count);
    }
    return STATUS_OK;
}

/* A linear: the activations prepared once, then its rows shared between the threads: the lent
 * ones if given (counted in stat_lent_chunks), else the helper. */
static Status compute_linear(State *st, LinearJob *job, const LentThreads *lent) {
    const size_t bytes = linear_scratch_bytes(job);
    if (bytes > st->linear_scratch_bytes) { /* once per model: the widest input and the most tokens */
        void *grown = aligned_alloc(64, round_up(bytes, 64));
        if (!grown) return STATUS_RUNTIME_FAILURE;
        free(st->linear_scratch);
        st->linear_scratch = grown, st->linear_scratch_bytes = bytes;
    }
    linear_prepare(job, st->vector_linears ? st->linear_scratch : NULL); /* no scratch: the portable path */
    const int count = linear_tasks(job);
    if (lent && count > 1) {
        LentWork work = lent_work(NULL, NULL, job, count, &st->stat_lent_chunks);
        run_lent(lent, &work);
    } else if (!st->helper_running || count == 1 || lent) {
        for (int i = 0; i < count; i++) linear_task(job, i);
    } else {
        st->linear = *job;
        st->kind = TASK_LINEAR;
        /* a float head is a step's only litekv linear: between steps the helper's polling would take
           time slices from XNNPACK's worker (helper_main), so it sleeps and this offer wakes it */
        if (job->format != LINEAR_F32 && job->format != LINEAR_INT8_FLOAT)
            atomic_store_explicit(&st->serves_linears, 1, memory_order_relaxed);
        share(st, count);
    }
    return STATUS_OK;
}

#if LITEKV_INT8_DOT
/* How int8 caches of this head_dim are multiplied as integers here: AVX-512 VNNI (whole 64-byte
 * lines), else AVX2 (vpmaddwd, the AVX2 path's whole 32-dimension passes). */
static Int8Dot int8_cpu_dot(int head_dim) {
    if (litekv_cpu_has_int8_dot()) return int8_dot_head_dim(head_dim) ? INT8_DOT_VNNI : INT8_DOT_NONE;
    return avx2_head_dim(head_dim) && litekv_decode_avx2() ? INT8_DOT_AVX2 : INT8_DOT_NONE;
}
#endif

static State *state_create(int heads, int head_dim, int max_slots, int threads, int int8_dot) {
    State *st = calloc(1, sizeof(State));
    if (!st) return NULL;
    const size_t width = (size_t)heads * head_dim;
    st->max_slots = max_slots;
    st->unblocked_bytes = (size_t)max_slots * width;
#if LITEKV_INT8_DOT
    st->vector_linears = int8_dot && linear_cpu_vector(); /* VNNI or AVX2; once: the linears run 121 times a step */
#endif
    const int smallest = CHUNK_SLOTS < FLOAT_CHUNK_SLOTS ? CHUNK_SLOTS : FLOAT_CHUNK_SLOTS;
    st->max_parts = (max_slots + smallest - 1) / smallest;
#if LITEKV_INT8_DOT
    st->int8_dot = int8_dot ? int8_cpu_dot(head_dim) : INT8_DOT_NONE;
#else
    (void)int8_dot;
#endif
    const size_t parts = (size_t)st->max_parts;
    st->acc_stride = round_up(width, PART_ALIGN_BYTES / sizeof(float));
    st->max_stride = round_up((size_t)heads, LINE_FLOATS);
    st->numerator_part = round_up((size_t)heads * NUMERATOR_STRIDE, PART_ALIGN_BYTES / sizeof(int16_t));
    st->scores = aligned_alloc(64, round_up(sizeof(float) * (size_t)heads * (size_t)max_slots, 64));
    st->acc = aligned_alloc(PART_ALIGN_BYTES, sizeof(float) * parts * st->acc_stride);
    st->max = aligned_alloc(64, sizeof(float) * 2 * parts * st->max_stride);
    st->parts = malloc(sizeof(Part) * parts);
    st->zero_mask = calloc((size_t)max_slots, sizeof(float));
    st->rotated = malloc(sizeof(float) * 2 * width);
    if (st->int8_dot) {
        st->numerators = aligned_alloc(PART_ALIGN_BYTES, sizeof(int16_t) * parts * st->numerator_part);
        st->digit_bytes = malloc(2 * width + (sizeof(int32_t) + sizeof(float)) * (size_t)heads);
    }
    if (!st->scores || !st->acc || !st->max || !st->parts || !st->zero_mask || !st->rotated ||
        (st->int8_dot && (!st->numerators || !st->digit_bytes))) {
        free(st->scores), free(st->acc), free(st->max), free(st->parts), free(st->numerators), free(st->digit_bytes);
        free(st->zero_mask), free(st->rotated);
        free(st);
        return NULL;
    }
    st->sum = st->max + parts * st->max_stride;
    if (st->int8_dot) {
        int8_t *bytes = st->digit_bytes;
        st->digits = (Digits){bytes, bytes + width, (int32_t *)(void *)(bytes + 2 * width),
                              (float *)(void *)(bytes + 2 * width + sizeof(int32_t) * (size_t)heads),
                              (int16_t *)(void *)bytes};
    }
    pthread_mutex_init(&st->lock, NULL);
    pthread_cond_init(&st->wake, NULL);
    if (threads > 1 && pthread_create(&st->helper, NULL, helper_main, st) == 0) {
        st->helper_running = 1;
#ifdef __linux__
        pthread_setname_np(st->helper, "litekv-attn"); /* what top, perf and /proc show for it */
#endif
    }
    return st;
}

static void state_destroy(State *st) {
    if (st->helper_running) {
        pthread_mutex_lock(&st->lock);
        atomic_store(&st->stop, 1);
        pthread_cond_signal(&st->wake);
        pthread_mutex_unlock(&st->lock);
        pthread_join(st->helper, NULL);
    }
    pthread_mutex_destroy(&st->lock);
    pthread_cond_destroy(&st->wake);
    free(st->scores), free(st->acc), free(st->max), free(st->parts), free(st->numerators), free(st->digit_bytes);
    free(st->prefill_scratch[0]), free(st->prefill_scratch[1]), free(st->linear_scratch), free(st->zero_mask);
    free(st->unblocked), free(st->rotated), free(st->screen_heap);
    free(st);
}

/* A head y = W x (x [in], W [out][in] fp32) whose rows that can rank among the `keep` largest are
 * exact and the rest -FLT_MAX (ScreenedHead, linear.h): the screen's rows (codes, row_scales) go to
 * the threads as any linear's; `keep` outside 1 .. out - 1 computes the whole head from W. *computed (if
 * given): the rows computed from W. */
static Status compute_screened_head(State *st, const float *x, float *y, const float *w, const int8_t *codes,
                                    const float *row_scales, const float *bounds, int keep, int in, int out,
                                    const LentThreads *lent, int *computed) {
    LinearJob exact = {x, y, w, NULL, NULL, NULL, LINEAR_F32, 1, in, out, 0, 0, 0, NULL, 0};
    if (computed) *computed = out;
    if (keep <= 0 || keep >= out) return compute_linear(st, &exact, lent);
    LinearJob screen = {x, y, codes, NULL, NULL, row_scales, LINEAR_INT8_FLOAT, 1, in, out, 0, 0, 0, NULL, 0};
    if (linear_check(&screen) || linear_check(&exact)) return STATUS_INVALID_ARGUMENT;
    Status status = compute_linear(st, &screen, lent);
    if (status != STATUS_OK) return status;
    if (keep > st->screen_heap_floats) {
        float *grown = realloc(st->screen_heap, sizeof(float) * (size_t)keep);
        if (!grown) return STATUS_RUNTIME_FAILURE;
        st->screen_heap = grown, st->screen_heap_floats = keep;
    }
    linear_prepare(&exact, st->vector_linears ? st->linear_scratch : NULL); /* the path the whole head takes */
    exact.rows_per_task = 1;
    const ScreenedHead head = {&exact, bounds, keep};
    const int rows = screened_head_finish(&head, st->screen_heap);
    if (rows < 0) return STATUS_INVALID_ARGUMENT;
    if (computed) *computed = rows;
    st->stat_screened_rows += (uint64_t)rows, st->stat_screened_calls++;
    return STATUS_OK;
}

/* ---- LiteRT custom op callbacks ------------------------------------------------------------- */

static Status op_init(void *user_data, const void *init_data, size_t init_data_size) {
    (void)init_data;
    (void)init_data_size;
    AttentionConfig *cfg = user_data;
    if (cfg->state) return STATUS_OK; /* one registration serves every node and entry point */
    cfg->state = state_create(cfg->num_heads, cfg->head_dim, cfg->max_slots, cfg->threads, cfg->int8_dot);
    return cfg->state ? STATUS_OK : STATUS_RUNTIME_FAILURE;
}

static Status op_output_layouts(void *user_data, size_t num_inputs, const Layout *inputs, size_t num_outputs,
                                Layout *outputs) {
    (void)user_data;
    /* 4 inputs, 6 (row scales, or keys in blocks), ROPE_INPUTS or ROPE_INT8_INPUTS (the rope forms) */
    if ((num_inputs != 4 && num_inputs != 6 && num_inputs != ROPE_INPUTS && num_inputs != ROPE_INT8_INPUTS) ||
        num_outputs != 1)
        return STATUS_INVALID_ARGUMENT;
    outputs[0] = inputs[0]; /* the output has the query's shape */
    return STATUS_OK;
}

static Status buffer(const AttentionConfig *cfg, void *handle, void **address, size_t *count, size_t element) {
    size_t bytes = 0;
    if (cfg->host_memory(handle, address) != STATUS_OK || cfg->buffer_size(handle, &bytes) != STATUS_OK)
        return STATUS_RUNTIME_FAILURE;
    *count = bytes / element;
    return STATUS_OK;
}

/* Checks the sizes (nk, nv in cache elements) and fills the job; the scores go to the state's
 * scratch, max_slots columns per head. */
static Status make_job(Job *job, const float *q, size_t nq, const void *k, size_t nk, const void *v, size_t nv,
                       const float *ks, const float *vs, size_t n_scales, int cache_type, const float *m, size_t slots,
                       int head_dim, int max_heads, const State *st) {
    if (head_dim <= 0 || slots == 0 || slots > (size_t)st->max_slots || nq % head_dim || nk != nv || nk % slots ||
        (nk / slots) % head_dim || nq / head_dim > (size_t)max_heads)
        return STATUS_INVALID_ARGUMENT;
    const int heads = (int)(nq / head_dim), kv_heads = (int)(nk / slots / head_dim);
    if (heads == 0 || kv_heads == 0 || heads % kv_heads) return STATUS_INVALID_ARGUMENT;
    const int rows = cache_type == CACHE_I8_ROWS; /* a scale per slot and KV head, for keys and values */
    if (rows != (ks && vs) || (rows && n_scales != slots * (size_t)kv_heads)) return STATUS_INVALID_ARGUMENT;
    *job = (Job){q, m, k, v, ks, vs, (int)slots, cache_type, int8_codes(cache_type) ? st->int8_dot : 0, heads, kv_heads,
                 head_dim, kv_heads * head_dim, st->scores, st->max_slots, NULL, (size_t)head_dim};
    return STATUS_OK;
}

/* An op call's query, keys, values, mask and output (and with row scales, the keys' and values'
 * scales, inputs 4 and 5): their host addresses and element counts. */
typedef struct {
    void *q, *k, *v, *m, *o, *ks, *vs;
    size_t nq, nk, nv, nm, no, nks, nvs;
} OpBuffers;

static Status op_buffers(const AttentionConfig *cfg, size_t num_inputs, void *const *inputs, size_t num_outputs,
                         void **outputs, int cache_type, OpBuffers *b) {
    const size_t expected = cache_type == CACHE_I8_ROWS ? 6 : 4;
    if (!cfg->state || num_inputs != expected || num_outputs != 1) return STATUS_INVALID_ARGUMENT;
    const size_t element = cache_element_bytes(cache_type);
    *b = (OpBuffers){0};
    if (buffer(cfg, inputs[0], &b->q, &b->nq, sizeof(float)) || buffer(cfg, inputs[1], &b->k, &b->nk, element) ||
        buffer(cfg, inputs[2], &b->v, &b->nv, element) || buffer(cfg, inputs[3], &b->m, &b->nm, sizeof(float)) ||
        buffer(cfg, outputs[0], &b->o, &b->no, sizeof(float)))
        return STATUS_RUNTIME_FAILURE;
    if (expected == 6 && (buffer(cfg, inputs[4], &b->ks, &b->nks, sizeof(float)) ||
                          buffer(cfg, inputs[5], &b->vs, &b->nvs, sizeof(float))))
        return STATUS_RUNTIME_FAILURE;
    if (b->nks != b->nvs) return STATUS_INVALID_ARGUMENT;
    return STATUS_OK;
}

static Status run(void *user_data, size_t num_inputs, void *const *inputs, size_t num_outputs, void **outputs,
                  int cache_type) {
    AttentionConfig *cfg = user_data;
    OpBuffers b;
    Status status = op_buffers(cfg, num_inputs, inputs, num_outputs, outputs, cache_type, &b);
    if (status != STATUS_OK) return status;
    Job job;
    /* a decode mask holds one row of S slots */
    if (b.nq != b.no || make_job(&job, b.q, b.nq, b.k, b.nk, b.v, b.nv, b.ks, b.vs, b.nks, cache_type, b.m, b.nm,
                                 cfg->head_dim, cfg->num_heads, cfg->state))
        return STATUS_INVALID_ARGUMENT;
    attend(cfg->state, &job, (int)b.nm, b.o);
    return STATUS_OK;
}

static Status op_run(void *user_data, size_t num_inputs, void *const *inputs, size_t num_outputs, void **outputs) {
    return run(user_data, num_inputs, inputs, num_outputs, outputs, CACHE_F32);
}

static Status op_run_int8(void *user_data, size_t num_inputs, void *const *inputs, size_t num_outputs,
                          void **outputs) {
    return run(user_data, num_inputs, inputs, num_outputs, outputs, CACHE_I8);
}

static Status op_run_f16(void *user_data, size_t num_inputs, void *const *inputs, size_t num_outputs,
                         void **outputs) {
    return run(user_data, num_inputs, inputs, num_outputs, outputs, CACHE_F16);
}

static Status op_run_int8_rows(void *user_data, size_t num_inputs, void *const *inputs, size_t num_outputs,
                               void **outputs) {
    return run(user_data, num_inputs, inputs, num_outputs, outputs, CACHE_I8_ROWS);
}

/* A prefill chunk: query [1, T, H*D], caches [1, S, KVH*D], mask [.., T, S]; H from the
 * registration, so T = query size / (H * D), S = mask size / T. */
static Status make_prefill_job(PrefillJob *job, const float *q, size_t nq, const void *k, size_t nk, const void *v,
                               size_t nv, const float *ks, const float *vs, size_t n_scales, int cache_type,
                               const float *m, size_t nm, float *o, size_t no, int heads, int head_dim,
                               const State *st) {
    const size_t width = (size_t)heads * head_dim;
    if (head_dim <= 0 || heads <= 0 || nq == 0 || nq % width || no != nq) return STATUS_INVALID_ARGUMENT;
    const size_t tokens = nq / width;
    if (nm % tokens) return STATUS_INVALID_ARGUMENT;
    const size_t slots = nm / tokens;
    if (slots == 0 || slots > (size_t)st->max_slots || nk != nv || nk % (slots * head_dim)) return STATUS_INVALID_ARGUMENT;
    const size_t kv_heads = nk / (slots * head_dim);
    if (kv_heads == 0 || heads % kv_heads || tokens > INT32_MAX) return STATUS_INVALID_ARGUMENT;
    const int rows = cache_type == CACHE_I8_ROWS;
    if (rows != (ks && vs) || (rows && n_scales != slots * kv_heads)) return STATUS_INVALID_ARGUMENT;
    *job = (PrefillJob){q, m, k, v, ks, vs, o, cache_type, (int)tokens, (int)slots, heads, (int)kv_heads, head_dim,
                        (int)kv_heads * head_dim, (size_t)head_dim, 0, 0};
    /* the ticket counts tasks in 20 bits */
    return prefill_tasks(job) <= (int)TICKET_FIELD ? STATUS_OK : STATUS_INVALID_ARGUMENT;
}

static Status run_prefill(void *user_data, size_t num_inputs, void *const *inputs, size_t num_outputs,
                          void **outputs, int cache_type) {
    AttentionConfig *cfg = user_data;
    OpBuffers b;
    Status status = op_buffers(cfg, num_inputs, inputs, num_outputs, outputs, cache_type, &b);
    if (status != STATUS_OK) return status;
    PrefillJob job;
    if (make_prefill_job(&job, b.q, b.nq, b.k, b.nk, b.v, b.nv, b.ks, b.vs, b.nks, cache_type, b.m, b.nm, b.o, b.no,
                         cfg->num_heads, cfg->head_dim, cfg->state))
        return STATUS_INVALID_ARGUMENT;
    return compute_prefill(cfg->state, &job);
}

static Status op_run_prefill(void *user_data, size_t num_inputs, void *const *inputs, size_t num_outputs,
                             void **outputs) {
    return run_prefill(user_data, num_inputs, inputs, num_outputs, outputs, CACHE_F32);
}

static Status op_run_prefill_int8(void *user_data, size_t num_inputs, void *const *inputs, size_t num_outputs,
                                  void **outputs) {
    return run_prefill(user_data, num_inputs, inputs, num_outputs, outputs, CACHE_I8);
}

static Status op_run_prefill_f16(void *user_data, size_t num_inputs, void *const *inputs, size_t num_outputs,
                                 void **outputs) {
    return run_prefill(user_data, num_inputs, inputs, num_outputs, outputs, CACHE_F16);
}

static Status op_run_prefill_int8_rows(void *user_data, size_t num_inputs, void *const *inputs, size_t num_outputs,
                                       void **outputs) {
    return run_prefill(user_data, num_inputs, inputs, num_outputs, outputs, CACHE_I8_ROWS);
}

/* "litekv.decode_attention_int8_blocks" and "litekv.prefill_attention_int8_blocks": the int8 forms
 * over keys in blocks (Job.key_blocks), which the op writes itself (a graph's DYNAMIC_UPDATE_SLICE
 * writes rows). Inputs: query, keys (the bound cache, [1, S, KVH*D] in blocks), values (written by
 * the graph), mask, the tokens' new key codes [1, T, KVH*D] and the first token's slot, int32 [1]. */
static Status run_key_blocks(void *user_data, size_t num_inputs, void *const *inputs, size_t num_outputs,
                             void **outputs, int prefill) {
    AttentionConfig *cfg = user_data;
    if (num_inputs != 6) return STATUS_INVALID_ARGUMENT;
    OpBuffers b;
    Status status = op_buffers(cfg, 4, inputs, num_outputs, outputs, CACHE_I8, &b);
    if (status != STATUS_OK) return status;
    void *rows, *first_slot;
    size_t n_rows, n_first;
    if (buffer(cfg, inputs[4], &rows, &n_rows, 1) || buffer(cfg, inputs[5], &first_slot, &n_first, sizeof(int32_t)))
        return STATUS_RUNTIME_FAILURE;
    State *st = cfg->state;
    const size_t width = (size_t)cfg->num_heads * cfg->head_dim, tokens = b.nq / width;
    const size_t slots = tokens ? b.nm / tokens : 0, row = slots ? b.nk / slots : 0;
    const int64_t first = n_first ? ((const int32_t *)first_slot)[0] : -1;
    if (!tokens || b.nq % width || !slots || !key_blocks_fit((int64_t)slots, cfg->head_dim) || !row || b.nk % slots ||
        row % cfg->head_dim || n_rows != tokens * row || first < 0 || first + (int64_t)tokens > (int64_t)slots ||
        (!prefill && tokens != 1))
        return STATUS_INVALID_ARGUMENT;
    if (make_unblocked(st) != STATUS_OK) return STATUS_RUNTIME_FAILURE;
    const int kv_heads = (int)(row / cfg->head_dim), last = (int)first + (int)tokens - 1;
    /* every check before the rows are written: a refused call leaves the cache as it was */
    PrefillJob chunk;
    Job step;
    if (prefill ? make_prefill_job(&chunk, b.q, b.nq, b.k, b.nk, b.v, b.nv, NULL, NULL, 0, CACHE_I8, b.m, b.nm, b.o,
                                   b.no, cfg->num_heads, cfg->head_dim, st)
                : b.nq != b.no || make_job(&step, b.q, b.nq, b.k, b.nk, b.v, b.nv, NULL, NULL, 0, CACHE_I8, b.m, b.nm,
                                           cfg->head_dim, cfg->num_heads, st))
        return STATUS_INVALID_ARGUMENT;
    block_keys(b.k, rows, row, cfg->head_dim, cfg->head_dim, kv_heads, (int)first, last, row);
    if (prefill) { /* the prefill kernels read rows: slots 0..last, once for the chunk */
        chunk.keys = keys_as_rows(st, b.k, row, cfg->head_dim, cfg->head_dim, kv_heads, 0, last);
        return compute_prefill(st, &chunk);
    }
    step.key_blocks = 1;
    attend(st, &step, (int)b.nm, b.o);
    return STATUS_OK;
}

static Status op_run_int8_blocks(void *user_data, size_t num_inputs, void *const *inputs, size_t num_outputs,
                                 void **outputs) {
    return run_key_blocks(user_data, num_inputs, inputs, num_outputs, outputs, 0);
}

static Status op_run_prefill_int8_blocks(void *user_data, size_t num_inputs, void *const *inputs, size_t num_outputs,
                                         void **outputs) {
    return run_key_blocks(user_data, num_inputs, inputs, num_outputs, outputs, 1);
}

/* int8 codes round(x * inverse) (ties to even, as a builtin ROUND), clipped to +-127: what the graph's
 * MUL, ROUND, MINIMUM, MAXIMUM and CAST store for an int8 cache's new row. */
static void quantize_row(const float *x, const float *inverse, size_t n, int8_t *codes) {
    for (size_t i = 0; i < n; i++) {
        const float code = __builtin_rintf(x[i] * inverse[i]);
        codes[i] = (int8_t)(code > 127.0f ? 127.0f : code < -127.0f ? -127.0f : code);
    }
}

/* "litekv.decode_attention_rope", "..._rope_f16" and "..._rope_int8": a decode step's attention over a
 * float32, float16 or statically scaled int8 cache, with what the graph did around it in 7 ops a
 * layer (16 for int8: RoPE on the query and key, the query's scale, converting and writing the new
 * rows, and for int8 the output's scale), each a dispatch a step.
 * Inputs: the query [1, 1, H*D] and the new key and value rows [1, 1, KVH*D] as the projections left
 * them (before RoPE and the scale), the caches [1, S, KVH*D] (signature inputs only: the op writes the
 * step's rows at `slot`), the mask [.., S], cos and sin [1, 1, 1, D] (litekv.rope's rows) and the slot
 * int32 [1]. Then the float forms take the scale float32 [1]; the int8 form the query's factors [H*D]
 * (the attention scale times each channel's key scale, as q . (codes * s) = (q * s) . codes), the key
 * and value rows' inverse scales [KVH*D], and the output's factors [H*D] (each channel's value scale).
 * Every size is checked before the rows are written. */
static Status run_rope(void *user_data, size_t num_inputs, void *const *inputs, size_t num_outputs, void **outputs,
                       int cache_type) {
    AttentionConfig *cfg = user_data;
    const int int8 = cache_type == CACHE_I8;
    if (num_inputs != (int8 ? ROPE_INT8_INPUTS : ROPE_INPUTS)) return STATUS_INVALID_ARGUMENT;
    OpBuffers b;
    Status status = op_buffers(cfg, 4, inputs, num_outputs, outputs, cache_type, &b);
    if (status != STATUS_OK) return status;
    void *key, *value, *cos, *sin, *slot, *scale, *key_inverse = NULL, *value_inverse = NULL, *out_factor = NULL;
    size_t n_key, n_value, n_cos, n_sin, n_slot, n_scale, n_key_inverse = 0, n_value_inverse = 0, n_out_factor = 0;
    if (buffer(cfg, inputs[4], &key, &n_key, sizeof(float)) || buffer(cfg, inputs[5], &value, &n_value, sizeof(float)) ||
        buffer(cfg, inputs[6], &cos, &n_cos, sizeof(float)) || buffer(cfg, inputs[7], &sin, &n_sin, sizeof(float)) ||
        buffer(cfg, inputs[8], &slot, &n_slot, sizeof(int32_t)) ||
        buffer(cfg, inputs[9], &scale, &n_scale, sizeof(float)))
        return STATUS_RUNTIME_FAILURE;
    if (int8 && (buffer(cfg, inputs[10], &key_inverse, &n_key_inverse, sizeof(float)) ||
                 buffer(cfg, inputs[11], &value_inverse, &n_value_inverse, sizeof(float)) ||
                 buffer(cfg, inputs[12], &out_factor, &n_out_factor, sizeof(float))))
        return STATUS_RUNTIME_FAILURE;
    State *st = cfg->state;
    const size_t d = (size_t)cfg->head_dim, row = n_key, at = n_slot == 1 ? (size_t)((const int32_t *)slot)[0] : 0;
    float *query = st->rotated, *key_row = st->rotated + (size_t)cfg->num_heads * d;
    Job job;
    const int factors_fit = int8 ? n_scale == b.nq && n_key_inverse == row && n_value_inverse == row &&
                                       n_out_factor == b.nq
                                 : n_scale == 1;
    if (d % 2 || b.nq != b.no || b.nq > (size_t)cfg->num_heads * d || n_value != row || n_cos != d || n_sin != d ||
        n_slot != 1 || ((const int32_t *)slot)[0] < 0 || !factors_fit || !b.nm || row != b.nk / b.nm ||
        at >= b.nm || row > b.nq ||
        make_job(&job, query, b.nq, b.k, b.nk, b.v, b.nv, NULL, NULL, 0, cache_type, b.m, b.nm, cfg->head_dim,
                 cfg->num_heads, st))
        return STATUS_INVALID_ARGUMENT;
    rope_apply(b.q, cos, sin, query, 1, (int)(b.nq / d), (int)d);
    if (int8)
        for (size_t i = 0; i < b.nq; i++) query[i] *= ((const float *)scale)[i];
    else
        for (size_t i = 0; i < b.nq; i++) query[i] *= ((const float *)scale)[0];
    rope_apply(key, cos, sin, key_row, 1, (int)(row / d), (int)d);
    if (int8) {
        quantize_row(key_row, key_inverse, row, (int8_t *)b.k + at * row);
        quantize_row(value, value_inverse, row, (int8_t *)b.v + at * row);
    } else if (cache_type == CACHE_F16) {
        uint16_t *keys = (uint16_t *)b.k + at * row, *values = (uint16_t *)b.v + at * row;
        for (size_t i = 0; i < row; i++) keys[i] = float_to_half(key_row[i]), values[i] = float_to_half(((const float *)value)[i]);
    } else {
        memcpy((float *)b.k + at * row, key_row, row * sizeof(float));
        memcpy((float *)b.v + at * row, value, row * sizeof(float));
    }
    attend(st, &job, (int)b.nm, b.o);
    if (int8)
        for (size_t i = 0; i < b.no; i++) ((float *)b.o)[i] *= ((const float *)out_factor)[i];
    return STATUS_OK;
}

static Status op_run_rope_f32(void *user_data, size_t num_inputs, void *const *inputs, size_t num_outputs,
                              void **outputs) {
    return run_rope(user_data, num_inputs, inputs, num_outputs, outputs, CACHE_F32);
}

static Status op_run_rope_f16(void *user_data, size_t num_inputs, void *const *inputs, size_t num_outputs,
                              void **outputs) {
    return run_rope(user_data, num_inputs, inputs, num_outputs, outputs, CACHE_F16);
}

static Status op_run_rope_int8(void *user_data, size_t num_inputs, void *const *inputs, size_t num_outputs,
                               void **outputs) {
    return run_rope(user_data, num_inputs, inputs, num_outputs, outputs, CACHE_I8);
}

/* ---- the one-token linears' callbacks --------------------------------------------------------- */

/* "litekv.linear_int4": x [.., in], codes uint8 [out, in/2], block scales float16 [out, blocks],
 * offsets int8 [out, blocks], offset scales float32 [out]. "litekv.linear_int8": x, codes int8
 * [out, in], row scales float32 [out]. "litekv.linear_f32" (x, W) and "..._screened" (x, W, then the
 * screen's four inputs). Output [.., out]. */
static Status linear_output_layouts(void *user_data, size_t num_inputs, const Layout *inputs, size_t num_outputs,
                                    Layout *outputs) {
    (void)user_data;
    if ((num_inputs != 2 && num_inputs != 3 && num_inputs != 5 && num_inputs != 6) || num_outputs != 1 ||
        inputs[0].rank < 1 || inputs[1].rank != 2)
        return STATUS_INVALID_ARGUMENT;
    outputs[0] = inputs[0];
    outputs[0].has_strides = false;
    outputs[0].dimensions[inputs[0].rank - 1] = inputs[1].dimensions[0];
    return STATUS_OK;
}

/* The job from the buffers' sizes alone (a run sees no shapes): `out` is the row scales' count. */
static Status linear_job(LinearJob *job, int format, const float *x, size_t nx, const void *codes, size_t ncodes,
                         const uint16_t *block_scales, size_t nblock_scales, const int8_t *offsets, size_t noffsets,
                         const float *row_scales, size_t out, float *y, size_t ny) {
    if (out == 0 || ncodes % out) return STATUS_INVALID_ARGUMENT;
    const size_t in = linear_format_int4(format) ? 2 * (ncodes / out) : ncodes / out;
    if (in == 0 || nx % in || ny != nx / in * out || nx / in > INT32_MAX || in > INT32_MAX || out > INT32_MAX)
        return STATUS_INVALID_ARGUMENT;
    size_t block = 0;
    if (linear_format_int4(format)) {
        const size_t blocks = nblock_scales / out;
        if (blocks == 0 || nblock_scales != blocks * out || noffsets != nblock_scales || in % blocks)
            return STATUS_INVALID_ARGUMENT;
        block = in / blocks;
    }
    *job = (LinearJob){x, y, codes, block_scales, offsets, row_scales, format, (int)(nx / in), (int)in, (int)out,
                       (int)block, 0, 0, NULL, 0};
    return linear_check(job) ? STATUS_INVALID_ARGUMENT : STATUS_OK;
}

static Status linear_run(void *user_data, size_t num_inputs, void *const *inputs, size_t num_outputs,
                         void **outputs, int format) {
    AttentionConfig *cfg = user_data;
    if (format == LINEAR_F32) {
        /* "litekv.linear_f32": x [.., in] (one row), W float32 [out, in]. A run sees no shapes, and
           with one row x's count is `in` and y's `out`. */
        void *x, *w, *y;
        size_t nx, nw, ny;
        if (!cfg->state || num_inputs != 2 || num_outputs != 1) return STATUS_INVALID_ARGUMENT;
        if (buffer(cfg, inputs[0], &x, &nx, sizeof(float)) || buffer(cfg, inputs[1], &w, &nw, sizeof(float)) ||
            buffer(cfg, outputs[0], &y, &ny, sizeof(float)))
            return STATUS_RUNTIME_FAILURE;
        if (!nx || !ny || nw / nx != ny || nw % nx || nx > INT32_MAX || ny > INT32_MAX) return STATUS_INVALID_ARGUMENT;
        LinearJob job = {x, y, w, NULL, NULL, NULL, LINEAR_F32, 1, (int)nx, (int)ny, 0, 0, 0, NULL, 0};
        return linear_check(&job) ? STATUS_INVALID_ARGUMENT : compute_linear(cfg->state, &job, NULL);
    }
    const size_t expected = format == LINEAR_INT4 ? 5 : 3;
    if (!cfg->state || num_inputs != expected || num_outputs != 1) return STATUS_INVALID_ARGUMENT;
    void *x, *codes, *y, *row_scales, *block_scales = NULL, *offsets = NULL;
    size_t nx, ncodes, ny, nrow, nblock = 0, noffsets = 0;
    if (buffer(cfg, inputs[0], &x, &nx, sizeof(float)) || buffer(cfg, inputs[1], &codes, &ncodes, 1) ||
        buffer(cfg, inputs[expected - 1], &row_scales, &nrow, sizeof(float)) ||
        buffer(cfg, outputs[0], &y, &ny, sizeof(float)))
        return STATUS_RUNTIME_FAILURE;
    if (format == LINEAR_INT4 && (buffer(cfg, inputs[2], &block_scales, &nblock, sizeof(uint16_t)) ||
                                  buffer(cfg, inputs[3], &offsets, &noffsets, 1)))
        return STATUS_RUNTIME_FAILURE;
    LinearJob job;
    Status status = linear_job(&job, format, x, nx, codes, ncodes, block_scales, nblock, offsets, noffsets, row_scales,
                               nrow, y, ny);
    return status == STATUS_OK ? compute_linear(cfg->state, &job, NULL) : status;
}

static Status op_run_linear_int4(void *user_data, size_t num_inputs, void *const *inputs, size_t num_outputs,
                                 void **outputs) {
    return linear_run(user_data, num_inputs, inputs, num_outputs, outputs, LINEAR_INT4);
}

static Status op_run_linear_int8(void *user_data, size_t num_inputs, void *const *inputs, size_t num_outputs,
                                 void **outputs) {
    return linear_run(user_data, num_inputs, inputs, num_outputs, outputs, LINEAR_INT8);
}

static Status op_run_linear_f32(void *user_data, size_t num_inputs, void *const *inputs, size_t num_outputs,
                                void **outputs) {
    return linear_run(user_data, num_inputs, inputs, num_outputs, outputs, LINEAR_F32);
}

/* "litekv.linear_f32_screened": x [.., in] (one row), W float32 [out, in], the screen's codes int8
 * [out, in] and row scales [out], bounds [out], keep int32 [1] (a signature input: 0 for the whole
 * head, the sampler's candidates when it samples in the graph) -> [.., out] (compute_screened_head). */
static Status op_run_screened_head(void *user_data, size_t num_inputs, void *const *inputs, size_t num_outputs,
                                   void **outputs) {
    AttentionConfig *cfg = user_data;
    void *x, *w, *codes, *scales, *bounds, *keep, *y;
    size_t nx, nw, ncodes, nscales, nbounds, nkeep, ny;
    if (!cfg->state || num_inputs != 6 || num_outputs != 1) return STATUS_INVALID_ARGUMENT;
    if (buffer(cfg, inputs[0], &x, &nx, sizeof(float)) || buffer(cfg, inputs[1], &w, &nw, sizeof(float)) ||
        buffer(cfg, inputs[2], &codes, &ncodes, 1) || buffer(cfg, inputs[3], &scales, &nscales, sizeof(float)) ||
        buffer(cfg, inputs[4], &bounds, &nbounds, sizeof(float)) ||
        buffer(cfg, inputs[5], &keep, &nkeep, sizeof(int32_t)) || buffer(cfg, outputs[0], &y, &ny, sizeof(float)))
        return STATUS_RUNTIME_FAILURE;
    if (!nx || !ny || nw != nx * ny || ncodes != nw || nscales != ny || nbounds != ny || nkeep != 1 ||
        nx > INT32_MAX || ny > INT32_MAX)
        return STATUS_INVALID_ARGUMENT;
    return compute_screened_head(cfg->state, x, y, w, codes, scales, bounds, *(const int32_t *)keep, (int)nx, (int)ny,
                                 NULL, NULL);
}

/* "litekv.rope": x [.., T, H, D], cos and sin [.., T, 1, D] -> [.., T, H, D]. */
static Status rope_output_layouts(void *user_data, size_t num_inputs, const Layout *inputs, size_t num_outputs,
                                  Layout *outputs) {
    (void)user_data;
    if (num_inputs != 3 || num_outputs != 1) return STATUS_INVALID_ARGUMENT;
    outputs[0] = inputs[0];
    outputs[0].has_strides = false;
    return STATUS_OK;
}

static Status op_run_rope(void *user_data, size_t num_inputs, void *const *inputs, size_t num_outputs,
                          void **outputs) {
    AttentionConfig *cfg = user_data;
    void *x, *cos, *sin, *out;
    size_t nx, ncos, nsin, nout;
    if (num_inputs != 3 || num_outputs != 1) return STATUS_INVALID_ARGUMENT;
    if (buffer(cfg, inputs[0], &x, &nx, sizeof(float)) || buffer(cfg, inputs[1], &cos, &ncos, sizeof(float)) ||
        buffer(cfg, inputs[2], &sin, &nsin, sizeof(float)) || buffer(cfg, outputs[0], &out, &nout, sizeof(float)))
        return STATUS_RUNTIME_FAILURE;
    const size_t dim = (size_t)cfg->head_dim, tokens = ncos / (dim ? dim : 1);
    if (dim == 0 || dim % 2 || ncos != nsin || ncos % dim || tokens == 0 || nx != nout || nx % (tokens * dim) ||
        nx / dim > INT32_MAX)
        return STATUS_INVALID_ARGUMENT;
    rope_apply(x, cos, sin, out, (int)tokens, (int)(nx / (tokens * dim)), (int)dim);
    return STATUS_OK;
}

static Status op_destroy(void *user_data) {
    (void)user_data; /* the state lives until litekv_attention_release: entry points share it */
    return STATUS_OK;
}

/* ---- exported ------------------------------------------------------------------------------- */

typedef struct {
    void *init, *output_layouts, *run, *destroy;
} Kernel; /* LiteRtCustomOpKernel */

/* The callbacks of "litekv.decode_attention" (or "litekv.prefill_attention" if `prefill`) in the
 * form for a cache of `cache_type`, a CacheType (another value: nonzero is returned). All ops
 * share one registration's state: scratch and helper thread. */
int litekv_attention_kernel(Kernel *kernel, int cache_type, int prefill) {
    static void *const decode_runs[] = {(void *)op_run, (void *)op_run_int8, (void *)op_run_f16,
                                        (void *)op_run_int8_rows};
    static void *const prefill_runs[] = {(void *)op_run_prefill, (void *)op_run_prefill_int8,
                                         (void *)op_run_prefill_f16, (void *)op_run_prefill_int8_rows};
    const int key_blocks = cache_type == (CACHE_I8 | CACHE_KEY_BLOCKS); /* the only form over keys in blocks */
    if (!valid_cache_type(cache_type) && !key_blocks) return STATUS_INVALID_ARGUMENT;
    kernel->init = (void *)op_init;
    kernel->output_layouts = (void *)op_output_layouts;
    if (key_blocks)
        kernel->run = prefill ? (void *)op_run_prefill_int8_blocks : (void *)op_run_int8_blocks;
    else
        kernel->run = prefill ? prefill_runs[cache_type] : decode_runs[cache_type];
    kernel->destroy = (void *)op_destroy;
    return STATUS_OK;
}

/* The callbacks of "litekv.decode_attention_rope" (cache_type CACHE_F32), "..._rope_f16" (CACHE_F16) or
 * "..._rope_int8" (CACHE_I8: static scales), sharing the other ops' state. */
int litekv_attention_rope_kernel(Kernel *kernel, int cache_type) {
    if (cache_type != CACHE_F32 && cache_type != CACHE_F16 && cache_type != CACHE_I8) return STATUS_INVALID_ARGUMENT;
    kernel->init = (void *)op_init;
    kernel->output_layouts = (void *)op_output_layouts;
    kernel->run = cache_type == CACHE_F16  ? (void *)op_run_rope_f16
                  : cache_type == CACHE_I8 ? (void *)op_run_rope_int8
                                           : (void *)op_run_rope_f32;
    kernel->destroy = (void *)op_destroy;
    return STATUS_OK;
}

/* The callbacks of "litekv.linear_int4" or "litekv.linear_int8" (`format`, a LINEAR_ value),
 * sharing the attention ops' state: the same helper thread takes their rows. */
int litekv_linear_kernel(Kernel *kernel, int format) {
    if (format != LINEAR_INT4 && format != LINEAR_INT8 && format != LINEAR_F32) return STATUS_INVALID_ARGUMENT;
    kernel->init = (void *)op_init;
    kernel->output_layouts = (void *)linear_output_layouts;
    kernel->run = format == LINEAR_INT4   ? (void *)op_run_linear_int4
                  : format == LINEAR_INT8 ? (void *)op_run_linear_int8
                                          : (void *)op_run_linear_f32;
    kernel->destroy = (void *)op_destroy;
    return STATUS_OK;
}

/* The callbacks of "litekv.linear_f32_screened", sharing the other ops' state. */
int litekv_screened_head_kernel(Kernel *kernel) {
    kernel->init = (void *)op_init;
    kernel->output_layouts = (void *)linear_output_layouts;
    kernel->run = (void *)op_run_screened_head;
    kernel->destroy = (void *)op_destroy;
    return STATUS_OK;
}

/* The callbacks of "litekv.rope" (head_dim from the registration). */
int litekv_rope_kernel(Kernel *kernel) {
    kernel->init = (void *)op_init;
    kernel->output_layouts = (void *)rope_output_layouts;
    kernel->run = (void *)op_run_rope;
    kernel->destroy = (void *)op_destroy;
    return STATUS_OK;
}

/* A linear on host arrays, with the registration's state (ort_ops.c, tests, benchmarks): x
 * [tokens][in], y [tokens][out], the weights as the ops take them (block_scales and offsets NULL for
 * int8 and f32, row_scales too for f32); its rows go to `lent` threads if given, else the helper. */
int litekv_linear_run(AttentionConfig *cfg, int format, const float *x, float *y, const void *codes,
                      const uint16_t *block_scales, const int8_t *offsets, const float *row_scales, int tokens, int in,
                      int out, int block, const LentThreads *lent) {
    const int int4 = linear_format_int4(format);
    if (tokens <= 0 || in <= 0 || out <= 0 || (format != LINEAR_INT8 && format != LINEAR_F32 && !int4) ||
        (int4 && (block <= 0 || in % block)))
        return STATUS_INVALID_ARGUMENT;
    if (!cfg->state && op_init(cfg, NULL, 0) != STATUS_OK) return STATUS_RUNTIME_FAILURE;
    const size_t n_out = (size_t)out, blocks = int4 ? (size_t)(in / block) * n_out : 0;
    const size_t ncodes = int4 ? n_out * (size_t)in / 2 : n_out * (size_t)in;
    LinearJob job;
    Status status = linear_job(&job, format, x, (size_t)tokens * in, codes, ncodes, block_scales, blocks, offsets,
                               blocks, row_scales, n_out, y, (size_t)tokens * n_out);
    return status == STATUS_OK ? compute_linear(cfg->state, &job, lent) : status;
}

/* A screened head on host arrays (ort_ops.c, tests, benchmarks): x [in], y [out], W [out][in], the
 * screen's codes [out][in] and row scales [out], bounds [out] (compute_screened_head); the screen's
 * rows go to `lent` threads if given, else the helper. *computed (if not NULL): the rows computed
 * exactly, out for the whole head. */
int litekv_screened_head_run(AttentionConfig *cfg, const float *x, float *y, const float *w, const int8_t *codes,
                             const float *row_scales, const float *bounds, int keep, int in, int out,
                             const LentThreads *lent, int *computed) {
    if (in <= 0 || out <= 0 || !x || !y || !w || (keep > 0 && keep < out && (!codes || !row_scales || !bounds)))
        return STATUS_INVALID_ARGUMENT;
    if (!cfg->state && op_init(cfg, NULL, 0) != STATUS_OK) return STATUS_RUNTIME_FAILURE;
    return compute_screened_head(cfg->state, x, y, w, codes, row_scales, bounds, keep, in, out, lent, computed);
}

/* Whether int8 caches get integer dot products on this CPU (AttentionConfig.int8_dot): 2 with
 * AVX-512 VNNI, 1 with AVX2's vpmaddwd (SmolLM2's head_dim of 64), else 0. */
int litekv_attention_int8_dot(void) {
#if LITEKV_INT8_DOT
    return (int)int8_cpu_dot(64);
#else
    return 0;
#endif
}

/* Counters since the state was made: calls, nanoseconds inside them (the caller's wall time),
 * chunks, chunks the helper thread computed, calls it joined, the nanoseconds from the caller's
 * offer to the helper's start summed over those calls, chunks ONNX Runtime's pool computed; then
 * the calls offered to the helper, the caller's nanoseconds in its own chunks of those and waiting
 * for the helper's after them, and the helper's nanoseconds in its chunks. All zero before the
 * first call. Read them between calls: the caller's counters are not atomic. */
void litekv_attention_stats(const AttentionConfig *cfg, uint64_t out[11]) {
    State *st = cfg->state;
    out[0] = st ? st->stat_calls : 0;
    out[1] = st ? st->stat_nanoseconds : 0;
    out[2] = st ? st->stat_chunks : 0;
    out[3] = st ? atomic_load_explicit(&st->stat_helper_chunks, memory_order_relaxed) : 0;
    out[4] = st ? atomic_load_explicit(&st->stat_helper_joins, memory_order_relaxed) : 0;
    out[5] = st ? atomic_load_explicit(&st->stat_helper_delay_nanoseconds, memory_order_relaxed) : 0;
    out[6] = st ? atomic_load_explicit(&st->stat_lent_chunks, memory_order_relaxed) : 0;
    out[7] = st ? st->stat_shared_calls : 0;
    out[8] = st ? st->stat_caller_chunk_nanoseconds : 0;
    out[9] = st ? st->stat_wait_nanoseconds : 0;
    out[10] = st ? atomic_load_explicit(&st->stat_helper_chunk_nanoseconds, memory_order_relaxed) : 0;
}

/* A screened head's counters since the state was made: its screened calls, and the rows they
 * computed exactly (the whole head's calls not counted). */
void litekv_screened_head_stats(const AttentionConfig *cfg, uint64_t out[2]) {
    const State *st = cfg->state;
    out[0] = st ? st->stat_screened_calls : 0;
    out[1] = st ? st->stat_screened_rows : 0;
}

/* Stops the helper thread and frees the scratch; call after the compiled model is destroyed. */
void litekv_attention_release(AttentionConfig *cfg) {
    if (cfg->state) state_destroy(cfg->state);
    cfg->state = NULL;
}

/* The same computation on host arrays, with the registration's state (tests, benchmarks): query
 * [H*D], keys and values [slots, KVH*D] (elements of `cache_type`), their row scales [KVH, slots]
 * for CACHE_I8_ROWS (else NULL), mask [slots], out [H*D]. */
int litekv_attention_run(AttentionConfig *cfg, const float *query, const void *keys, const void *values,
                         const float *key_scales, const float *value_scales, const float *mask, float *out, int heads,
                         int kv_heads, int slots, int cache_type) {
    const int key_blocks = (cache_type & CACHE_KEY_BLOCKS) != 0;
    cache_type &= ~CACHE_KEY_BLOCKS;
    if (heads <= 0 || kv_heads <= 0 || slots <= 0 || !valid_cache_type(cache_type) ||
        (key_blocks && (!int8_codes(cache_type) || !key_blocks_fit(slots, cfg->head_dim))))
        return STATUS_INVALID_ARGUMENT;
    if (!cfg->state && op_init(cfg, NULL, 0) != STATUS_OK) return STATUS_RUNTIME_FAILURE;
    const size_t n = (size_t)slots * kv_heads * cfg->head_dim;
    Job job;
    State *st = cfg->state;
    Status status = make_job(&job, query, (size_t)heads * cfg->head_dim, keys, n, values, n, key_scales, value_scales,
                             (size_t)slots * kv_heads, cache_type, mask, (size_t)slots, cfg->head_dim, cfg->num_heads, st);
    job.key_blocks = key_blocks;
    if (status == STATUS_OK && key_blocks) status = make_unblocked(st);
    if (status == STATUS_OK) attend(st, &job, slots, out);
    return status;
}

/* A prefill chunk on host arrays: query and out [tokens][H*D], keys and values [slots, KVH*D]
 * (elements of `cache_type`) with their row scales as for litekv_attention_run, mask [tokens][slots]. */
int litekv_prefill_attention_run(AttentionConfig *cfg, const float *query, const void *keys, const void *values,
                                 const float *key_scales, const float *value_scales, const float *mask, float *out,
                                 int tokens, int kv_heads, int slots, int cache_type) {
    const int key_blocks = (cache_type & CACHE_KEY_BLOCKS) != 0;
    cache_type &= ~CACHE_KEY_BLOCKS;
    if (tokens <= 0 || kv_heads <= 0 || slots <= 0 || !valid_cache_type(cache_type) ||
        (key_blocks && (!int8_codes(cache_type) || !key_blocks_fit(slots, cfg->head_dim))))
        return STATUS_INVALID_ARGUMENT;
    if (!cfg->state && op_init(cfg, NULL, 0) != STATUS_OK) return STATUS_RUNTIME_FAILURE;
    const size_t nq = (size_t)tokens * cfg->num_heads * cfg->head_dim, nk = (size_t)slots * kv_heads * cfg->head_dim;
    PrefillJob job;
    Status status = make_prefill_job(&job, query, nq, keys, nk, values, nk, key_scales, value_scales,
                                     (size_t)slots * kv_heads, cache_type, mask, (size_t)tokens * slots, out, nq,
                                     cfg->num_heads, cfg->head_dim, cfg->state);
    if (status == STATUS_OK && key_blocks) { /* the prefill kernels read rows: one rewrite for the chunk */
        if (make_unblocked(cfg->state) != STATUS_OK) return STATUS_RUNTIME_FAILURE;
        job.keys = keys_as_rows(cfg->state, keys, (size_t)job.row, job.head_stride, job.head_dim, kv_heads, 0,
                                slots - 1);
    }
    return status == STATUS_OK ? compute_prefill(cfg->state, &job) : status;
}

/* One decode step's attention over a cache in ONNX Runtime's head-major layout, keys and values
 * [kv_heads][slots][head_dim] (the registration's) of CACHE_F32 floats or CACHE_I8 codes (their
 * static scales folded into the query and the output by the caller), for query rows [heads][D]
 * (RoPE and scale applied), attending to slots lo..hi: out [heads][D]. For ort_ops.c's attention
 * ops, which have written the step's row. Its chunks go to `lent` threads if given (the caller's
 * pool), else to the helper thread. */
int litekv_attention_head_major(AttentionConfig *cfg, const float *query, const void *keys, const void *values,
                                float *out, int heads, int kv_heads, int slots, int head_dim, int lo, int hi,
                                int cache_type, const LentThreads *lent) {
    const int key_blocks = (cache_type & CACHE_KEY_BLOCKS) != 0;
    cache_type &= ~CACHE_KEY_BLOCKS;
    if (heads <= 0 || kv_heads <= 0 || heads % kv_heads || heads > cfg->num_heads || head_dim != cfg->head_dim ||
        slots <= 0 || lo < 0 || hi < lo || hi >= slots || (cache_type != CACHE_F32 && cache_type != CACHE_I8) ||
        (key_blocks && (cache_type != CACHE_I8 || !key_blocks_fit(slots, head_dim))))
        return STATUS_INVALID_ARGUMENT;
    if (!cfg->state && op_init(cfg, NULL, 0) != STATUS_OK) return STATUS_RUNTIME_FAILURE;
    State *st = cfg->state;
    if (slots > st->max_slots) return STATUS_INVALID_ARGUMENT; /* the scores' scratch and the zero mask */
    const int d = cfg->head_dim;
    Job job = {query, st->zero_mask, keys, values, NULL, NULL, slots, cache_type,
               cache_type == CACHE_I8 ? st->int8_dot : 0, heads, kv_heads, d, d, st->scores, st->max_slots, NULL,
               (size_t)slots * d, key_blocks};
    if (key_blocks && make_unblocked(st) != STATUS_OK) return STATUS_RUNTIME_FAILURE;
    st->lent = lent;
    attend_span(st, &job, lo, hi, out);
    st->lent = NULL;
    return STATUS_OK;
}
