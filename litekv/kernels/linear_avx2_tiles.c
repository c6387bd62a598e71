/* int4 linears over many tokens (a prefill chunk's projections) on AVX2, with the one-token path's
 * numbers (linear_avx2.c: the same prepared activations, products exact in integers, the same
 * float steps per block), computed in tiles of 8 rows x 4 tokens.
 *
 * The one-token path reduces each row's products across a vector's lanes. A row that meets many
 * tokens pays that reduction, and the unpacking of its nibbles, once per token: 60-86 GMAC/s on two
 * threads, about XNNPACK's block-wise int4 rate here. A tile instead puts 8 rows in a vector's 8
 * dword lanes, so nothing is reduced across lanes:
 * - The tile's codes are regrouped once (8 x 8 dword transposes): for each step of 8 codes, row r's
 *   4 bytes in dword r. Its low nibbles are the step's even codes, the high ones its odd codes.
 * - Per token, the step's 4 even activations (and 4 odd), broadcast, meet every row at once in
 *   vpmaddubsw; 4 steps (a block of 32) add up in int16 (at most 16 x 15 x 127 = 30,480), vpmaddwd
 *   makes one int32 per row, and the float steps of the one-token path follow, 8 rows a vector.
 * - A block's codes are unpacked once for 4 tokens. The regrouped tile (in / 2 x 8 bytes) stays in
 *   L1 while the tokens' activations stream from L2. */
#include "linear.h"

#if LITEKV_LINEAR_AVX2
#include <string.h>

#include "avx2_common.h"
#include "linear_avx2_act.h"

#define TARGET AVX2_TARGET
#define TILE_ROWS LINEAR_TILE_ROWS
#define TILE_TOKENS 4
#define MAX_IN 8192 /* the regrouped tile lives on the stack: in x 8 bytes of codes, in / 2 of floats */

/* A tile's weights, regrouped: codes [in / 8 steps][8 rows] dwords (code + 8 in each nibble);
 * scales and offsets (times the row's offset scale) float [blocks][8 rows]. */
typedef struct {
    const uint8_t *codes;
    const float *scales, *offsets;
} Tile;

/* 8 rows of 8 dwords each to 8 vectors of one dword per row: out[s] holds dword s of every row. */
AVX2_HELPER void transpose8(const __m256i in[8], __m256i out[8]) {
    __m256i a[8], b[8];
    for (int i = 0; i < 4; i++) {
        a[2 * i] = _mm256_unpacklo_epi32(in[2 * i], in[2 * i + 1]);
        a[2 * i + 1] = _mm256_unpackhi_epi32(in[2 * i], in[2 * i + 1]);
    }
    for (int i = 0; i < 2; i++)
        for (int j = 0; j < 2; j++) {
            b[4 * i + j] = _mm256_unpacklo_epi64(a[4 * i + j], a[4 * i + 2 + j]);
            b[4 * i + 2 + j] = _mm256_unpackhi_epi64(a[4 * i + j], a[4 * i + 2 + j]);
        }
    /* b[0..3]: rows 0-3's dwords {0,4}, {2,6}, {1,5}, {3,7} in their 128-bit halves; b[4..7] rows 4-7 */
    static const int order[4] = {0, 2, 1, 3};
    for (int i = 0; i < 4; i++) {
        out[order[i]] = _mm256_permute2x128_si256(b[i], b[4 + i], 0x20);
        out[order[i] + 4] = _mm256_permute2x128_si256(b[i], b[4 + i], 0x31);
    }
}

/* Rows [o, o + 8) regrouped into `codes`, `scales` and `offsets` (32-byte aligned). */
TARGET static void regroup(const LinearJob *job, int o, uint8_t *codes, float *scales, float *offsets) {
    const size_t row_bytes = (size_t)job->in / 2, blocks = (size_t)job->in / 32;
    const __m256i flip = _mm256_set1_epi8(job->format == LINEAR_INT4 ? (char)0x88 : 0);
    const uint8_t *w = (const uint8_t *)job->codes + (size_t)o * row_bytes;
    for (size_t at = 0; at < row_bytes; at += 32) { /* 8 steps of 8 codes */
        __m256i rows[8], steps[8];
        for (int r = 0; r < 8; r++)
            rows[r] = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(const void *)(w + r * row_bytes + at)),
                                       flip);
        transpose8(rows, steps);
        const __m256i low = _mm256_set1_epi8(0x0F);
        for (int s = 0; s < 8; s++) {
            uint8_t *step = codes + 16 * at + 64 * s;
            _mm256_store_si256((__m256i *)(void *)step, _mm256_and_si256(steps[s], low));
            _mm256_store_si256((__m256i *)(void *)(step + 32), _mm256_and_si256(_mm256_srli_epi16(steps[s], 4), low));
        }
    }
    for (size_t b = 0; b < blocks; b++) {
        uint16_t half[8];
        for (int r = 0; r < 8; r++) {
            half[r] = job->block_scales[(size_t)(o + r) * blocks + b];
            offsets[8 * b + r] = (float)job->offsets[(size_t)(o + r) * blocks + b] * job->row_scales[o + r];
        }
        _mm256_store_ps(scales + 8 * b, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(const void *)half)));
    }
}

/* A dword of the prepared activations, broadcast to every lane. */
AVX2_HELPER __m256i broadcast4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, sizeof v);
    return _mm256_set1_epi32(v);
}

/* The tile's 8 rows for tokens [t, t + count): y's 8 floats per token. count is a constant in each
 * caller, so the token loops unroll and the sums stay in registers. */
AVX2_HELPER void tile_tokens(const LinearJob *job, const Tile *tile, int o, int t, const int count) {
    const int blocks = job->in / 32;
    const __m256i ones = _mm256_set1_epi16(1);
    Act a[TILE_TOKENS];
    __m256 sums[TILE_TOKENS];
    for (int i = 0; i < count; i++) a[i] = act(job, t + i), sums[i] = _mm256_setzero_ps();
    for (int b = 0; b < blocks; b++) {
        __m256i dots[TILE_TOKENS];
        for (int i = 0; i < count; i++) dots[i] = _mm256_setzero_si256();
        /* not unrolled: unrolled, GCC computed all 32 products first and spilled them */
#pragma GCC unroll 1
        for (int s = 0; s < 4; s++) {
            const uint8_t *step = tile->codes + 64 * (4 * b + s);
            const __m256i even = _mm256_load_si256((const __m256i *)(const void *)step),
                          odd = _mm256_load_si256((const __m256i *)(const void *)(step + 32));
            const size_t at = 16 * (size_t)b + 4 * (size_t)s;
            for (int i = 0; i < count; i++) {
                dots[i] = _mm256_add_epi16(dots[i], _mm256_maddubs_epi16(even, broadcast4(a[i].even + at)));
                dots[i] = _mm256_add_epi16(dots[i], _mm256_maddubs_epi16(odd, broadcast4(a[i].odd + at)));
            }
        }
        const int at = b / 8 * 8 + group_position(b % 8);
        const __m256 scales = _mm256_load_ps(tile->scales + 8 * b), offsets = _mm256_load_ps(tile->offsets + 8 * b);
        for (int i = 0; i < count; i++) {
            const __m256 x_side = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(dots[i], ones)),
                                                  _mm256_broadcast_ss(a[i].scales + at),
                                                  _mm256_broadcast_ss(a[i].bias + at));
            sums[i] = _mm256_fmadd_ps(offsets, _mm256_broadcast_ss(a[i].sums + b),
                                      _mm256_fmadd_ps(x_side, scales, sums[i]));
        }
    }
    for (int i = 0; i < count; i++) _mm256_storeu_ps(job->y + (size_t)(t + i) * job->out + o, sums[i]);
}

int linear_avx2_tiles_take(const LinearJob *job) {
    return job->tokens >= TILE_TOKENS && linear_format_int4(job->format) && job->block == 32 && job->in <= MAX_IN;
}

TARGET void linear_avx2_tiles(const LinearJob *job, int first, int last) {
    const size_t code_bytes = (size_t)job->in * TILE_ROWS, float_bytes = sizeof(float) * TILE_ROWS * (job->in / 32);
    uint8_t space[code_bytes + 2 * float_bytes + 32];
    uint8_t *codes = (uint8_t *)(((uintptr_t)space + 31) & ~(uintptr_t)31);
    float *scales = (float *)(void *)(codes + code_bytes), *offsets = (float *)(void *)(codes + code_bytes + float_bytes);
    const Tile tile = {codes, scales, offsets};
    for (int o = first; o + TILE_ROWS <= last; o += TILE_ROWS) {
        regroup(job, o, codes, scales, offsets);
        int t = 0;
        for (; t + TILE_TOKENS <= job->tokens; t += TILE_TOKENS) tile_tokens(job, &tile, o, t, TILE_TOKENS);
        switch (job->tokens - t) {
        case 3: tile_tokens(job, &tile, o, t, 3); break;
        case 2: tile_tokens(job, &tile, o, t, 2); break;
        case 1: tile_tokens(job, &tile, o, t, 1); break;
        default: break;
        }
    }
}
#endif
