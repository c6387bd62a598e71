/* One-token linears (y = x W^T) over quantized weights, for decode steps: the weights are read
 * where the model file holds them, and the rows are cut into tasks the attention kernel's two
 * threads share (decode_attention.c), so XNNPACK's worker has no parallel work in a decode step. */
#ifndef LITEKV_LINEAR_H
#define LITEKV_LINEAR_H

#include <stddef.h>
#include <stdint.h>

enum {
    LINEAR_INT4 = 0, /* codes: int4 [out, in] packed two a byte, even element low; block scales float16
                        [out, in/block]; offsets int8 [out, in/block] times offset_scales [out]:
                        W[o, k] = code * scale[o, b] + offset[o, b] * offset_scale[o] for k in block b */
    LINEAR_INT8 = 1, /* codes: int8 [out, in]; row_scales [out]: W[o, k] = code * row_scale[o] */
    LINEAR_UINT4 = 2, /* LINEAR_INT4 with each nibble holding code + 8, unsigned: the layout of ONNX
                         Runtime's MatMulNBits without zero points, so one tensor serves both */
    LINEAR_F32 = 3,   /* codes: float [out, in], W itself; no scales (an fp32 LM head, one row a step) */
    LINEAR_INT8_FLOAT = 4, /* LINEAR_INT8's weights times x as it is, products in float: the only error is
                              the weights' rounding, which a screened head bounds (screened_head.c) */
};

/* Whether a format holds 4-bit codes (LINEAR_INT4 or LINEAR_UINT4). */
static inline int linear_format_int4(int format) { return format == LINEAR_INT4 || format == LINEAR_UINT4; }

typedef struct {
    const float *x;  /* [tokens][in] */
    float *y;        /* [tokens][out] */
    const void *codes;
    const uint16_t *block_scales; /* int4: float16 bits */
    const int8_t *offsets;        /* int4 */
    const float *row_scales;      /* int4: the offsets' scale per row; int8: the codes'; f32: NULL */
    int format, tokens, in, out, block;
    int rows_per_task;
    /* filled by linear_prepare from x: the activations as int8 (vector paths) */
    int vector; /* the path that runs: LINEAR_PORTABLE, LINEAR_VNNI or LINEAR_AVX2 */
    void *prepared;
    size_t prepared_stride; /* bytes per token */
} LinearJob;

/* The paths a job can take: float loops anywhere, AVX-512 VNNI (linear.c), or AVX2 with FMA and F16C
 * where the CPU lacks VNNI (linear_avx2.c). Both vector paths quantize the activations alike. */
enum { LINEAR_PORTABLE = 0, LINEAR_VNNI = 1, LINEAR_AVX2 = 2 };
/* The vector path this CPU runs (checked once), or LINEAR_PORTABLE. */
int linear_cpu_vector(void);

/* Checks the shapes; 0 when the job can run. */
int linear_check(const LinearJob *job);
/* Bytes of scratch linear_prepare needs for a job's activations. */
size_t linear_scratch_bytes(const LinearJob *job);
/* Chooses the path and, for a vector path, writes the activations into `scratch` (64-byte
 * aligned, linear_scratch_bytes long). Run once per call, before the tasks. A scratch lets the
 * CPU's vector path run (linear_cpu_vector), where the shapes allow; NULL runs the portable path. */
void linear_prepare(LinearJob *job, void *scratch);
int linear_tasks(const LinearJob *job);
/* Rows [task * rows_per_task, ...) of y for every token. */
void linear_task(const LinearJob *job, int task);

/* A gated MLP's activations: y [tokens][half] = act(rows [0, half)) * rows [half, 2 half) of each
 * token's 2 half rows, act silu (LINEAR_GATE_SILU) or tanh-approximated gelu (LINEAR_GATE_GELU_TANH). */
enum { LINEAR_GATE_SILU = 1, LINEAR_GATE_GELU_TANH = 2 };
void linear_gate(const float *rows, float *y, size_t tokens, size_t half, int gate);

/* int4_offsets.c: the offsets' share of an int4 projection over many tokens, added to the codes'
 * share (ONNX Runtime's MatMulNBits output): result = y + offset_scales[o] * sum_b offsets[o, b] *
 * (x's sum over block b). Run every sum task, then every tile task; tasks of a kind in any order. */
typedef struct {
    const float *x, *y;          /* [tokens][in], [tokens][out] */
    const int8_t *offsets;       /* [out][blocks] */
    const float *offset_scales;  /* [out] */
    float *sums, *result;        /* [tokens][blocks] (scratch), [tokens][out] (may not alias y) */
    int tokens, in, out, blocks; /* in a multiple of blocks */
} Int4Offsets;
int int4_offsets_sum_tasks(const Int4Offsets *job);
int int4_offsets_tile_tasks(const Int4Offsets *job);
size_t int4_offsets_scratch_floats(const Int4Offsets *job); /* per worker, for int4_offsets_tile */
void int4_offsets_sums(const Int4Offsets *job, int task);
void int4_offsets_tile(const Int4Offsets *job, int tile, float *weights);

/* screened_head.c: the rows of an fp32 LM head y = W x that can rank among its `keep` largest,
 * exact, for samplers that draw from the `keep` most likely tokens (converters/sampling_graph.py), at
 * a quarter of the head's bytes. y holds the screen first: a LINEAR_INT8_FLOAT job over int8 codes C
 * and row scales s, so |(W x)[r] - y[r]| <= bounds[r] * |x|_2 (the converter folds the codes' rounding
 * and the float sums' into bounds). Every row whose upper bound reaches the keep-th largest lower
 * bound is then computed from W by linear_task(`exact`, r) (a LINEAR_F32 job, one row a task, so
 * its values are the whole head's to the bit) and every other row set to -FLT_MAX: no row of the
 * top `keep` can be among those. `heap` holds `keep` floats. Returns the rows computed exactly. */
typedef struct {
    const LinearJob *exact;  /* LINEAR_F32 over W [out][in], y as the screen's, rows_per_task 1 */
    const float *bounds;     /* [out] */
    int keep;                /* 1 .. out */
} ScreenedHead;
int screened_head_finish(const ScreenedHead *head, float *heap);

/* rope.c: x and out [tokens][heads][dim], cos and sin [tokens][dim]; out = x cos + rotate_half(x) sin. */
void rope_apply(const float *x, const float *cos, const float *sin, float *out, int tokens, int heads, int dim);

/* linear_avx2.c, the AVX2 path (x86-64 with GCC or Clang only): linear_prepare and linear_task call
 * it where linear_cpu_vector is LINEAR_AVX2, and linear_gate too. */
#if defined(__x86_64__) && defined(__GNUC__)
#define LITEKV_LINEAR_AVX2 1
int linear_cpu_has_avx2(void); /* AVX2, FMA and F16C */
size_t linear_avx2_stride(const LinearJob *job); /* prepared bytes per token */
void linear_avx2_prepare(const LinearJob *job);  /* into job->prepared, job->prepared_stride apart */
void linear_avx2_rows(const LinearJob *job, int first, int last);
void linear_avx2_gate(const float *g, const float *u, float *out, size_t n, int gate); /* out = act(g) u */
/* linear_avx2_tiles.c: int4 rows over many tokens in tiles of LINEAR_TILE_ROWS rows (first and last
 * multiples of it), for the jobs linear_avx2_tiles_take (4 tokens or more); linear_avx2_rows calls it. */
#define LINEAR_TILE_ROWS 8
int linear_avx2_tiles_take(const LinearJob *job);
void linear_avx2_tiles(const LinearJob *job, int first, int last);
#else
#define LITEKV_LINEAR_AVX2 0
#endif

#endif
