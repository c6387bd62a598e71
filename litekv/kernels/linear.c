/* One-token linears over int4, int8 and fp32 weights (linear.h).
 *
 * A decode step reads every weight once, so the kernel has to keep up with the memory: about 45
 * GB/s here, 23 bytes a nanosecond. XNNPACK's int4 path reached about 21 GB/s in the model (its
 * arithmetic, bench/PERFORMANCE.md), and the int4 offsets cost it two more small matmuls per
 * projection. Here, with AVX-512 VNNI:
 * - The activations are quantized once per call to int8, a scale per block of 32 (Prepared).
 * - int4: a 64-byte load holds 128 codes, 4 blocks of 32. XOR 0x88 turns each signed nibble into
 *   code + 8, unsigned, which is what vpdpbusd multiplies; the even elements' nibbles meet the even
 *   activations and the odd ones the odd (both split out once per call), so dword lane j sums 8
 *   elements of one block. Each lane starts at -8 times its activations' sum, which takes the +8 off
 *   again. The lanes then take their block's scales (the weights' times the activations') in
 *   float. The offsets' share, offset * (x's sum over the block), adds up 16 blocks at a time.
 * - int8: vpdpbusd wants one unsigned operand: |code| against the activation with the code's sign;
 *   the lanes take their block's activation scale, the row its weights' scale.
 * - fp32 (an LM head): a float dot product per row, streamed and prefetched.
 * Without VNNI but with AVX2 (+FMA, F16C), linear_avx2.c computes the same as this path. Elsewhere a
 * portable float loop computes the same (without quantizing the activations). */
#include "linear.h"

#include "attention_common.h" /* half_to_float, LITEKV_INT8_DOT */

#include <math.h>
#include <stdatomic.h>
#include <string.h>

/* Weight bytes per task: at least 8 tasks a call, so the helper's share evens out, each of 16-128 KB.
 * Fewer, larger tasks bounce the task counter's line between the cores less: the step's linears
 * (91 MB) took 1.74-1.76 ms at best so (52 GB/s), against 1.95-2.06 in tasks of 32 KB. */
#define TASK_MIN_BYTES 16384
#define TASK_MAX_BYTES 131072
#define MIN_TASKS 8

int linear_check(const LinearJob *job) {
    if (job->tokens <= 0 || job->in <= 0 || job->out <= 0 || !job->x || !job->y || !job->codes) return 1;
    if (job->format == LINEAR_F32) return 0;
    if (!job->row_scales) return 1;
    if (job->format == LINEAR_INT8 || job->format == LINEAR_INT8_FLOAT) return 0;
    if (!linear_format_int4(job->format) || job->block <= 0 || job->block % 2 || job->in % job->block) return 1;
    return !job->block_scales || !job->offsets;
}

static size_t row_bytes(const LinearJob *job) {
    return linear_format_int4(job->format) ? (size_t)job->in / 2
           : job->format == LINEAR_F32    ? sizeof(float) * (size_t)job->in
                                          : (size_t)job->in;
}

int linear_tasks(const LinearJob *job) { return (job->out + job->rows_per_task - 1) / job->rows_per_task; }

/* ---- the portable path ---------------------------------------------------------------------- */

static void rows_portable(const LinearJob *job, int first, int last) {
    const int in = job->in, blocks = linear_format_int4(job->format) ? in / job->block : 0;
    const int flip = job->format == LINEAR_INT4 ? 8 : 0; /* a signed nibble's bits XOR 8 are code + 8 */
    for (int t = 0; t < job->tokens; t++) {
        const float *x = job->x + (size_t)t * in;
        for (int o = first; o < last; o++) {
            float total = 0.0f;
            if (job->format == LINEAR_F32) {
                const float *w = (const float *)job->codes + (size_t)o * in;
                for (int k = 0; k < in; k++) total += w[k] * x[k];
            } else if (job->format == LINEAR_INT8 || job->format == LINEAR_INT8_FLOAT) {
                const int8_t *w = (const int8_t *)job->codes + (size_t)o * in;
                for (int k = 0; k < in; k++) total += (float)w[k] * x[k];
                total *= job->row_scales[o];
            } else {
                const uint8_t *w = (const uint8_t *)job->codes + (size_t)o * (in / 2);
                for (int b = 0; b < blocks; b++) {
                    float dot = 0.0f, sum = 0.0f;
                    for (int k = b * job->block; k < (b + 1) * job->block; k++) {
                        const int nibble = (w[k / 2] >> (4 * (k & 1))) & 0xF;
                        dot += (float)((nibble ^ flip) - 8) * x[k];
                        sum += x[k];
                    }
                    total += dot * half_to_float(job->block_scales[(size_t)o * blocks + b]) +
                             sum * (float)job->offsets[(size_t)o * blocks + b] * job->row_scales[o];
                }
            }
            job->y[(size_t)t * job->out + o] = total;
        }
    }
}

/* ---- the AVX-512 VNNI path ------------------------------------------------------------------ */

#if LITEKV_INT8_DOT
#define TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,f16c")))
#ifndef PREFETCH_AHEAD
#define PREFETCH_AHEAD 4096 /* bytes: the hardware prefetcher stops at 4 KB pages (LM head 1.55 -> 0.69 ms) */
#endif

/* The prepared activations of one token, inside its stride of the scratch. Each block of 32 is
 * int8 with its own scale (largest |x| / 127), as llama.cpp's Q8_0: a scale per token put SmolLM2's
 * KL at 0.038 from activations alone (fp32 weights, the numpy reference), XNNPACK's per-token
 * asymmetric form at 0.022, blocks of 32 at 0.003 (bench/PERFORMANCE.md, fifteenth round).
 * int4: even [in/2 padded to 64] int8, odd (the same), lane sums [lanes] int32 (-8 * the 8 codes
 *       each dword lane meets), block scales [blocks padded to 16] float, block sums (of x
 *       itself, for the offsets) [the same] float;
 * int8: codes [in padded to 64] int8, lane scales [in / 64 rounded up][16] float (each dword lane's
 *       block scale). */
typedef struct {
    const int8_t *even, *odd;
    const int32_t *lane_sums;
    const float *block_scales, *block_sums;
} Prepared;

static size_t lanes(int in) { return round_up((size_t)in, 128) / 8; }

static size_t padded_blocks(int in) { return round_up((size_t)(in / 32), 16); }

static Prepared prepared(const LinearJob *job, int t) {
    const uint8_t *p = (const uint8_t *)job->prepared + (size_t)t * job->prepared_stride;
    Prepared r = {0};
    if (job->format == LINEAR_INT8) {
        r.even = (const int8_t *)p;
        r.block_scales = (const float *)(const void *)(p + round_up((size_t)job->in, 64));
        return r;
    }
    const size_t half = round_up((size_t)job->in / 2, 64);
    r.even = (const int8_t *)p, r.odd = (const int8_t *)(p + half);
    r.lane_sums = (const int32_t *)(const void *)(p + 2 * half);
    r.block_scales = (const float *)(const void *)(p + 2 * half + 4 * lanes(job->in));
    r.block_sums = r.block_scales + padded_blocks(job->in);
    return r;
}

static size_t prepared_stride(const LinearJob *job) {
    if (job->format == LINEAR_INT8) return round_up((size_t)job->in, 64) * 2; /* codes, then 16 floats per 64 */
    return 2 * round_up((size_t)job->in / 2, 64) + 4 * lanes(job->in) + 8 * padded_blocks(job->in);
}

/* Writes one token's activations in the layout of Prepared. */
TARGET static void prepare_token(const LinearJob *job, const float *x, uint8_t *p) {
    const int in = job->in, blocks = in / 32;
    memset(p, 0, job->prepared_stride);
    int8_t q[in]; /* in <= a few thousand */
    float scales[blocks], sums[blocks];
    for (int b = 0; b < blocks; b++) {
        const __m512 lo = _mm512_loadu_ps(x + 32 * b), hi = _mm512_loadu_ps(x + 32 * b + 16);
        const float largest = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
        const __m512 inverse = _mm512_set1_ps(largest > 0.0f ? 127.0f / largest : 0.0f);
        scales[b] = largest / 127.0f;
        sums[b] = _mm512_reduce_add_ps(_mm512_add_ps(lo, hi));
        _mm_storeu_si128((__m128i *)(void *)(q + 32 * b), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(lo, inverse))));
        _mm_storeu_si128((__m128i *)(void *)(q + 32 * b + 16),
                         _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(hi, inverse))));
    }
    if (job->format == LINEAR_INT8) {
        memcpy(p, q, (size_t)in);
        float *lane_scales = (float *)(void *)(p + round_up((size_t)in, 64));
        for (int lane = 0; lane < in / 4; lane++) lane_scales[lane] = scales[lane / 8];
        return;
    }
    const size_t half = round_up((size_t)in / 2, 64);
    int8_t *even = (int8_t *)p, *odd = (int8_t *)(p + half);
    int32_t *lane_sums = (int32_t *)(void *)(p + 2 * half);
    float *block_scales = (float *)(void *)(p + 2 * half + 4 * lanes(in)), *block_sums = block_scales + padded_blocks(in);
    for (int k = 0; k < in / 2; k++) even[k] = q[2 * k], odd[k] = q[2 * k + 1];
    for (int lane = 0; lane < in / 8; lane++) {
        int sum = 0;
        for (int e = 0; e < 8; e++) sum += q[8 * lane + e];
        lane_sums[lane] = -8 * sum;
    }
    memcpy(block_scales, scales, sizeof scales);
    memcpy(block_sums, sums, sizeof sums); /* the offsets take x's own sums */
}

/* Lane j of a 128-code span belongs to block j / 4 of the span's 4 */
#define SPREAD(first) _mm512_set_epi32(first + 3, first + 3, first + 3, first + 3, first + 2, first + 2, first + 2, \
                                       first + 2, first + 1, first + 1, first + 1, first + 1, first, first, first, first)

/* Rows o..o+R-1 (R <= 4) of one token. Per 128-code span (64 bytes of a row): the codes' dot
 * products by lane, times their blocks' scales, in `acc`. Per 16 blocks (4 spans): the offsets
 * times the blocks' activation sums, in `offset_acc`. */
TARGET static inline void int4_group(const LinearJob *job, const Prepared *a, int o, int R, float *y) {
    const int in = job->in, blocks = in / 32, spans = (in + 127) / 128;
    const size_t bytes = (size_t)in / 2;
    const __m512i low = _mm512_set1_epi8(0x0F), flip = _mm512_set1_epi8(job->format == LINEAR_INT4 ? 0x08 : 0);
    __m512 acc[4], scales[4] = {0}, offset_acc[4];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps(), offset_acc[r] = _mm512_setzero_ps();
    for (int c = 0; c < spans; c++) {
        const __mmask64 m = 64 * c + 64 <= (int)bytes ? ~(__mmask64)0 : (__mmask64)0xFFFFFFFFu; /* the tail: 2 blocks */
        if (c % 4 == 0) {
            const int left = blocks - 4 * c;
            const __mmask16 b = left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
            const __m512 sums = _mm512_load_ps(a->block_sums + 4 * c), x_scales = _mm512_load_ps(a->block_scales + 4 * c);
            for (int r = 0; r < R; r++) {
                const size_t row = (size_t)(o + r) * blocks + 4 * c;
                __builtin_prefetch(job->block_scales + row + PREFETCH_AHEAD / 8, 0, 2);
                __builtin_prefetch(job->offsets + row + PREFETCH_AHEAD / 8, 0, 2);
                scales[r] = _mm512_mul_ps(_mm512_cvtph_ps(_mm256_maskz_loadu_epi16(b, job->block_scales + row)), x_scales);
                const __m512i offsets = _mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(b, job->offsets + row));
                offset_acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(offsets), sums, offset_acc[r]);
            }
        }
        const __m512i spread = _mm512_add_epi32(SPREAD(0), _mm512_set1_epi32(4 * (c % 4)));
        const __m512i even = _mm512_load_si512(a->even + 64 * c), odd = _mm512_load_si512(a->odd + 64 * c);
        const __m512i start = _mm512_load_si512(a->lane_sums + 16 * c); /* -8 x each lane's activations */
        for (int r = 0; r < R; r++) {
            const uint8_t *w = (const uint8_t *)job->codes + (size_t)(o + r) * bytes + 64 * c;
            __builtin_prefetch(w + PREFETCH_AHEAD, 0, 2);
            const __m512i codes = _mm512_maskz_loadu_epi8(m, w);
            /* (nibble & 0xF) ^ flip in one ternary-logic op: the code + 8 */
            const __m512i lo = _mm512_ternarylogic_epi32(codes, low, flip, 0x6A),
                          hi = _mm512_ternarylogic_epi32(_mm512_srli_epi16(codes, 4), low, flip, 0x6A);
            const __m512i d = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(start, lo, even), hi, odd);
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_permutexvar_ps(spread, scales[r]), acc[r]);
        }
    }
    for (int r = 0; r < R; r++)
        y[o + r] = _mm512_reduce_add_ps(_mm512_fmadd_ps(offset_acc[r], _mm512_set1_ps(job->row_scales[o + r]), acc[r]));
}

TARGET static void int4_rows_vnni(const LinearJob *job, int first, int last) {
    for (int t = 0; t < job->tokens; t++) {
        const Prepared a = prepared(job, t);
        float *y = job->y + (size_t)t * job->out;
        int o = first;
        for (; o + 4 <= last; o += 4) int4_group(job, &a, o, 4, y);
        for (; o < last; o++) int4_group(job, &a, o, 1, y);
    }
}

/* fp32 rows one at a time: a single stream per thread, prefetched a few KB ahead, read an LM head
 * of 113 MB at 33-42 GB/s here, against 29-34 with 4 or 8 rows interleaved (and ONNX Runtime's
 * MatMul at 29). Four sums per row keep the FMAs from waiting on each other. */
TARGET static void f32_rows_vector(const LinearJob *job, int first, int last) {
    const int in = job->in;
    for (int t = 0; t < job->tokens; t++) {
        const float *x = job->x + (size_t)t * in;
        for (int o = first; o < last; o++) {
            const float *w = (const float *)job->codes + (size_t)o * in;
            __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
            int k = 0;
            for (; k + 16 <= in; k += 16) {
                _mm_prefetch((const char *)(w + k) + PREFETCH_AHEAD, _MM_HINT_T0);
                acc[(k / 16) % 4] = _mm512_fmadd_ps(_mm512_loadu_ps(w + k), _mm512_loadu_ps(x + k), acc[(k / 16) % 4]);
            }
            if (k < in) {
                const __mmask16 m = (__mmask16)((1u << (in - k)) - 1);
                acc[0] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, w + k), _mm512_maskz_loadu_ps(m, x + k), acc[0]);
            }
            job->y[(size_t)t * job->out + o] =
                _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3])));
        }
    }
}

TARGET static void int8_rows_vnni(const LinearJob *job, int first, int last) {
    const int in = job->in;
    for (int t = 0; t < job->tokens; t++) {
        const Prepared a = prepared(job, t);
        float *y = job->y + (size_t)t * job->out;
        for (int o = first; o < last; o++) {
            const int8_t *w = (const int8_t *)job->codes + (size_t)o * in;
            __m512 acc = _mm512_setzero_ps();
            for (int k = 0; k < in; k += 64) { /* two blocks: lanes 0-7 and 8-15 */
                const __mmask64 m = in - k >= 64 ? ~(__mmask64)0 : (((__mmask64)1 << (in - k)) - 1);
                __builtin_prefetch(w + k + PREFETCH_AHEAD, 0, 2);
                const __m512i codes = _mm512_maskz_loadu_epi8(m, w + k), x = _mm512_load_si512(a.even + k);
                const __m512i signed_x = _mm512_mask_sub_epi8(x, _mm512_movepi8_mask(codes), _mm512_setzero_si512(), x);
                const __m512i d = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_abs_epi8(codes), signed_x);
                acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_load_ps(a.block_scales + k / 4), acc);
            }
            y[o] = job->row_scales[o] * _mm512_reduce_add_ps(acc);
        }
    }
}
#endif

/* ---- gates ------------------------------------------------------------------------------------ */

static float gate_scalar(float g, int gate) {
    if (gate == LINEAR_GATE_SILU) return g / (1.0f + expf(-g));
    return 0.5f * g * (1.0f + tanhf(0.7978845608f * (g + 0.044715f * g * g * g)));
}

#if LITEKV_INT8_DOT
/* e^x for 16 lanes: x = n ln 2 + r with |r| <= ln 2 / 2, e^r by its Taylor series to r^7 (relative
 * error below 2e-7), times 2^n by vscalefps. libm's expf one lane at a time took 13 us of a 3,072-row
 * gated call, more than the nodes the gate replaces. */
TARGET static __m512 exp16(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145752f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860677e-6f), r); /* ln 2 in two parts: r stays exact */
    __m512 p = _mm512_set1_ps(1.0f / 5040);
    static const float taylor[] = {1.0f / 720, 1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f};
    for (int i = 0; i < 7; i++) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(taylor[i]));
    return _mm512_scalef_ps(p, n);
}

TARGET static void gate_vector(const float *g, const float *u, float *out, size_t n, int gate) {
    const __m512 one = _mm512_set1_ps(1.0f);
    size_t i = 0;
    for (; i + 16 <= n; i += 16) {
        const __m512 x = _mm512_loadu_ps(g + i);
        __m512 act;
        if (gate == LINEAR_GATE_SILU) {
            act = _mm512_div_ps(x, _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), x))));
        } else { /* 0.5 x (1 + tanh y) = x (1 - 1 / (e^(2y) + 1)) */
            const __m512 y = _mm512_mul_ps(_mm512_set1_ps(0.7978845608f),
                                           _mm512_fmadd_ps(_mm512_mul_ps(_mm512_set1_ps(0.044715f), x),
                                                           _mm512_mul_ps(x, x), x));
            const __m512 e = exp16(_mm512_add_ps(y, y));
            act = _mm512_mul_ps(x, _mm512_sub_ps(one, _mm512_div_ps(one, _mm512_add_ps(e, one))));
        }
        _mm512_storeu_ps(out + i, _mm512_mul_ps(act, _mm512_loadu_ps(u + i)));
    }
    for (; i < n; i++) out[i] = gate_scalar(g[i], gate) * u[i];
}
#endif

void linear_gate(const float *rows, float *y, size_t tokens, size_t half, int gate) {
    const int vector = linear_cpu_vector(); /* VNNI implies AVX-512 F */
    for (size_t t = 0; t < tokens; t++) {
        const float *g = rows + 2 * half * t, *u = g + half;
        float *out = y + half * t;
#if LITEKV_INT8_DOT
        if (vector == LINEAR_VNNI) {
            gate_vector(g, u, out, half, gate);
            continue;
        }
#endif
#if LITEKV_LINEAR_AVX2
        if (vector == LINEAR_AVX2) {
            linear_avx2_gate(g, u, out, half, gate);
            continue;
        }
#endif
        for (size_t i = 0; i < half; i++) out[i] = gate_scalar(g[i], gate) * u[i];
    }
}

/* ---- entry points --------------------------------------------------------------------------- */

static int find_cpu_vector(void) {
#if LITEKV_INT8_DOT
    if (litekv_cpu_has_int8_dot()) return LINEAR_VNNI;
#endif
#if LITEKV_LINEAR_AVX2
    if (linear_cpu_has_avx2()) return LINEAR_AVX2;
#endif
    return LINEAR_PORTABLE;
}

int linear_cpu_vector(void) {
    static _Atomic int found = -1; /* any thread may find it first: each finds the same */
    int path = atomic_load_explicit(&found, memory_order_relaxed);
    if (path < 0) atomic_store_explicit(&found, path = find_cpu_vector(), memory_order_relaxed);
    return path;
}

/* Whether the vector paths take a job's shapes (both the same ones). */
static int vector_shapes(const LinearJob *job) {
    if (job->format == LINEAR_F32 || job->format == LINEAR_INT8_FLOAT) return 1;
    return job->in % 32 == 0 && (job->format == LINEAR_INT8 || (job->block == 32 && job->in % 64 == 0));
}

/* The vector path a job takes on this CPU: linear_cpu_vector's, except that int4 jobs of many tokens
 * take the AVX2 tiles on VNNI CPUs too. The tiles have no VNNI form, and one token at a time a VNNI
 * row still unpacks its nibbles and reduces its lanes once per token. */
static int job_vector(const LinearJob *job) {
    const int path = linear_cpu_vector();
#if LITEKV_LINEAR_AVX2
    if (job->format == LINEAR_INT8_FLOAT) /* one AVX2 loop for every vector CPU: the screen is read-bound */
        return path != LINEAR_PORTABLE && linear_cpu_has_avx2() ? LINEAR_AVX2 : LINEAR_PORTABLE;
    if (path == LINEAR_VNNI && linear_avx2_tiles_take(job) && linear_cpu_has_avx2())
        return LINEAR_AVX2;
#endif
    return path;
}

size_t linear_scratch_bytes(const LinearJob *job) {
    if (job->format == LINEAR_F32 || job->format == LINEAR_INT8_FLOAT) return 64; /* read as it is */
    switch (job_vector(job)) {
#if LITEKV_INT8_DOT
    case LINEAR_VNNI: return (size_t)job->tokens * prepared_stride(job);
#endif
#if LITEKV_LINEAR_AVX2
    case LINEAR_AVX2: return (size_t)job->tokens * linear_avx2_stride(job);
#endif
    default: return 0;
    }
}

void linear_prepare(LinearJob *job, void *scratch) {
    const size_t bytes = row_bytes(job), whole = (size_t)job->out * bytes / MIN_TASKS;
    const size_t task = whole > TASK_MAX_BYTES ? TASK_MAX_BYTES : whole < TASK_MIN_BYTES ? TASK_MIN_BYTES : whole;
    int rows = (int)(task / (bytes ? bytes : 1));
    const int multiple = job->tokens > 1 ? LINEAR_TILE_ROWS : 4; /* many tokens: whole tiles (linear_avx2_tiles.c) */
    job->rows_per_task = rows < multiple ? multiple : rows / multiple * multiple;
    job->vector = scratch && vector_shapes(job) ? job_vector(job) : LINEAR_PORTABLE;
    if (job->format == LINEAR_F32 || job->format == LINEAR_INT8_FLOAT) return;
    job->prepared = scratch;
#if LITEKV_INT8_DOT
    if (job->vector == LINEAR_VNNI) {
        job->prepared_stride = prepared_stride(job);
        for (int t = 0; t < job->tokens; t++)
            prepare_token(job, job->x + (size_t)t * job->in, (uint8_t *)scratch + (size_t)t * job->prepared_stride);
    }
#endif
#if LITEKV_LINEAR_AVX2
    if (job->vector == LINEAR_AVX2) {
        job->prepared_stride = linear_avx2_stride(job);
        linear_avx2_prepare(job);
    }
#endif
}

void linear_task(const LinearJob *job, int task) {
    const int first = task * job->rows_per_task, end = first + job->rows_per_task,
              last = end < job->out ? end : job->out;
#if LITEKV_INT8_DOT
    if (job->vector == LINEAR_VNNI) {
        (linear_format_int4(job->format) ? int4_rows_vnni
         : job->format == LINEAR_F32    ? f32_rows_vector
                                        : int8_rows_vnni)(job, first, last);
        return;
    }
#endif
#if LITEKV_LINEAR_AVX2
    if (job->vector == LINEAR_AVX2) {
        linear_avx2_rows(job, first, last);
        return;
    }
#endif
    rows_portable(job, first, last);
}
