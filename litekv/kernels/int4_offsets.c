/* The offsets' share of an int4 projection over a prefill chunk (linear.h: int4_offsets_*).
 *
 * litekv's int4 grid is asymmetric, W[o, k] = code * scale[o, b] + offset[o, b] * offset_scale[o],
 * and ONNX Runtime's MatMulNBits computes only the codes' part. The rest is
 *   y[t, o] += offset_scale[o] * sum_b offset[o, b] * xsum[t, b],  xsum[t, b] = sum of x[t] over block b,
 * a [T, blocks] x [blocks, out] product with blocks = in / 32: little arithmetic, but as ONNX nodes
 * (a block-sum matmul, a matmul by the folded offsets and an add) it took 18 of a 256-token
 * prefill's 197 ms, and the folded offsets were a float copy of the int8 ones.
 *
 * Work comes in tasks: first the block sums, a span of tokens each, then tiles of OFFSET_TILE
 * output columns, each converting its offsets once and adding them to every token's row. On a CPU
 * with AVX2 but not AVX-512 the tiles' sums are held in ymm registers (tile_rows_avx2): the 16-float
 * vectors below are two ymm each there, and 4 tokens x 64 columns of them spilled in every block. */
#include "attention_common.h" /* v16, load16, VECTOR_CLONES */
#include "linear.h"

#define OFFSET_TILE 64       /* columns per tile: four 16-float vectors of sums in registers */
#define SUM_TASK_TOKENS 64   /* tokens per block-sum task */

size_t int4_offsets_scratch_floats(const Int4Offsets *job) {
    return (size_t)job->blocks * OFFSET_TILE;
}

int int4_offsets_sum_tasks(const Int4Offsets *job) { return (job->tokens + SUM_TASK_TOKENS - 1) / SUM_TASK_TOKENS; }

int int4_offsets_tile_tasks(const Int4Offsets *job) { return (job->out + OFFSET_TILE - 1) / OFFSET_TILE; }

/* xsum of tokens [task * SUM_TASK_TOKENS, ...) into job->sums [tokens][blocks]. */
VECTOR_CLONES void int4_offsets_sums(const Int4Offsets *job, int task) {
    const size_t block = (size_t)job->in / (size_t)job->blocks;
    const int first = task * SUM_TASK_TOKENS, last = first + SUM_TASK_TOKENS < job->tokens ? first + SUM_TASK_TOKENS
                                                                                          : job->tokens;
    for (int t = first; t < last; t++) {
        const float *x = job->x + (size_t)t * job->in;
        for (int b = 0; b < job->blocks; b++) {
            float total = 0.0f;
            for (size_t k = 0; k < block; k++) total += x[(size_t)b * block + k];
            job->sums[(size_t)t * job->blocks + b] = total;
        }
    }
}

/* Tokens t0..t0+TOKENS-1 of a tile: TOKENS x OFFSET_TILE sums in registers, so each converted
 * offset loaded serves TOKENS tokens. */
#define OFFSET_TOKENS 4
INLINE void tile_rows(const Int4Offsets *job, const float *weights, int o0, int width, int t0, int tokens) {
    const int blocks = job->blocks;
    v16 acc[OFFSET_TOKENS][OFFSET_TILE / 16] = {{{0}}};
    for (int b = 0; b < blocks; b++) {
        v16 w[OFFSET_TILE / 16];
        for (int i = 0; i < OFFSET_TILE / 16; i++) w[i] = load16(weights + (size_t)b * OFFSET_TILE + 16 * i);
        for (int t = 0; t < OFFSET_TOKENS; t++) {
            const float s = t < tokens ? job->sums[(size_t)(t0 + t) * blocks + b] : 0.0f;
            for (int i = 0; i < OFFSET_TILE / 16; i++) acc[t][i] += s * w[i];
        }
    }
    for (int t = 0; t < tokens; t++) {
        const float *y = job->y + (size_t)(t0 + t) * job->out + o0;
        float *out = job->result + (size_t)(t0 + t) * job->out + o0;
        if (width == OFFSET_TILE) {
            for (int i = 0; i < OFFSET_TILE / 16; i++) {
                const v16 sum = acc[t][i] + load16(y + 16 * i);
                memcpy(out + 16 * i, &sum, sizeof sum);
            }
        } else {
            for (int j = 0; j < width; j++) out[j] = y[j] + acc[t][j / 16][j % 16];
        }
    }
}

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define AVX2_TOKENS 6 /* tokens x 16 columns: 12 ymm sums, two weight vectors and a broadcast */

static int avx2_tiles(void) {
    static int state; /* 0: not yet known; 1: AVX2 tiles; 2: the vector-extension ones */
    if (!__atomic_load_n(&state, __ATOMIC_RELAXED)) {
        const int avx2 = !cpu_has(CPU_AVX512F) && cpu_has(CPU_AVX2 | CPU_FMA);
        __atomic_store_n(&state, avx2 ? 1 : 2, __ATOMIC_RELAXED);
    }
    return __atomic_load_n(&state, __ATOMIC_RELAXED) == 1;
}

/* Tokens t0..t0+tokens-1 (at most AVX2_TOKENS, a constant where inlined) x columns c0..c0+15 of a
 * tile: each weight vector loaded serves every token, each block sum broadcast two columns' vectors. */
static inline __attribute__((always_inline, target("avx2,fma"))) void tile_block_avx2(
    const Int4Offsets *job, const float *weights, int o0, int width, int c0, int t0, const int tokens) {
    const int blocks = job->blocks;
    const float *sums = job->sums + (size_t)t0 * blocks;
    __m256 acc[AVX2_TOKENS][2];
    _Pragma("GCC unroll 6") for (int t = 0; t < tokens; t++) acc[t][0] = acc[t][1] = _mm256_setzero_ps();
    for (int b = 0; b < blocks; b++) {
        const __m256 w0 = _mm256_loadu_ps(weights + (size_t)b * OFFSET_TILE + c0),
                     w1 = _mm256_loadu_ps(weights + (size_t)b * OFFSET_TILE + c0 + 8);
        _Pragma("GCC unroll 6") for (int t = 0; t < tokens; t++) {
            const __m256 s = _mm256_broadcast_ss(sums + (size_t)t * blocks + b);
            acc[t][0] = _mm256_fmadd_ps(s, w0, acc[t][0]);
            acc[t][1] = _mm256_fmadd_ps(s, w1, acc[t][1]);
        }
    }
    _Pragma("GCC unroll 6") for (int t = 0; t < tokens; t++) {
        const size_t at = (size_t)(t0 + t) * job->out + o0 + c0;
        if (c0 + 16 <= width) {
            _mm256_storeu_ps(job->result + at, _mm256_add_ps(acc[t][0], _mm256_loadu_ps(job->y + at)));
            _mm256_storeu_ps(job->result + at + 8, _mm256_add_ps(acc[t][1], _mm256_loadu_ps(job->y + at + 8)));
        } else {
            float share[16];
            _mm256_storeu_ps(share, acc[t][0]);
            _mm256_storeu_ps(share + 8, acc[t][1]);
            for (int j = 0; c0 + j < width; j++) job->result[at + j] = job->y[at + j] + share[j];
        }
    }
}

__attribute__((target("avx2,fma"))) static void tile_rows_avx2(const Int4Offsets *job, const float *weights, int o0,
                                                               int width) {
    for (int t0 = 0; t0 < job->tokens; t0 += AVX2_TOKENS) {
        const int tokens = job->tokens - t0 < AVX2_TOKENS ? job->tokens - t0 : AVX2_TOKENS;
        for (int c0 = 0; c0 < width; c0 += 16) {
            switch (tokens) {
            case 6: tile_block_avx2(job, weights, o0, width, c0, t0, 6); break;
            case 5: tile_block_avx2(job, weights, o0, width, c0, t0, 5); break;
            case 4: tile_block_avx2(job, weights, o0, width, c0, t0, 4); break;
            case 3: tile_block_avx2(job, weights, o0, width, c0, t0, 3); break;
            case 2: tile_block_avx2(job, weights, o0, width, c0, t0, 2); break;
            default: tile_block_avx2(job, weights, o0, width, c0, t0, 1);
            }
        }
    }
}
#endif

/* out[t, tile] = y[t, tile] + the offsets' share, for every token; `weights` holds blocks x
 * OFFSET_TILE floats (int4_offsets_scratch_floats), the worker's own. */
VECTOR_CLONES void int4_offsets_tile(const Int4Offsets *job, int tile, float *weights) {
    const int o0 = tile * OFFSET_TILE, width = job->out - o0 < OFFSET_TILE ? job->out - o0 : OFFSET_TILE;
    const int blocks = job->blocks;
    /* weights[b][j] = offset[o0 + j, b] * offset_scale[o0 + j], zero past the last column */
    for (int b = 0; b < blocks; b++)
        for (int j = 0; j < OFFSET_TILE; j++)
            weights[(size_t)b * OFFSET_TILE + j] =
                j < width ? (float)job->offsets[(size_t)(o0 + j) * blocks + b] * job->offset_scales[o0 + j] : 0.0f;
#if defined(__x86_64__) && defined(__GNUC__)
    if (avx2_tiles()) {
        tile_rows_avx2(job, weights, o0, width);
        return;
    }
#endif
    int t0 = 0;
    for (; t0 + OFFSET_TOKENS <= job->tokens; t0 += OFFSET_TOKENS)
        tile_rows(job, weights, o0, width, t0, OFFSET_TOKENS);
    if (t0 < job->tokens) tile_rows(job, weights, o0, width, t0, job->tokens - t0);
}
