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
 * output columns, each converting its offsets once and adding them to every token's row. */
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
    int t0 = 0;
    for (; t0 + OFFSET_TOKENS <= job->tokens; t0 += OFFSET_TOKENS)
        tile_rows(job, weights, o0, width, t0, OFFSET_TOKENS);
    if (t0 < job->tokens) tile_rows(job, weights, o0, width, t0, job->tokens - t0);
}
