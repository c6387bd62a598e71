/* What the AVX2 + FMA + F16C paths share (decode_attention_avx2.c, prefill_attention_avx2.c,
 * linear_avx2.c): the CPU check and the 8-lane helpers each of them needs. Include only where
 * x86-64 with GCC or Clang is checked. */
#ifndef LITEKV_AVX2_COMMON_H
#define LITEKV_AVX2_COMMON_H

#include <immintrin.h>

#include "cpu_isa.h"

#define AVX2_TARGET __attribute__((target("avx2,fma,f16c")))
#define AVX2_HELPER static inline __attribute__((always_inline)) AVX2_TARGET

/* Whether this CPU has AVX2, FMA and F16C, under LITEKV_MAX_ISA (each path adds its own condition on
 * AVX-512). */
static inline int cpu_has_avx2_fma_f16c(void) { return cpu_has(CPU_AVX2 | CPU_FMA | CPU_F16C); }

/* The sum and the largest of v's 8 lanes. */
AVX2_HELPER float horizontal_sum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

AVX2_HELPER float horizontal_max(__m256 v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}

/* exp_nonpositive (attention_common.h) on 8 lanes: the same clamp, rounding and polynomial, and 0
 * below -87. */
AVX2_HELPER __m256 exp_nonpositive8(__m256 x) {
    const __m256 floor = _mm256_set1_ps(-87.0f);
    const __m256 t = _mm256_mul_ps(_mm256_max_ps(x, floor), _mm256_set1_ps(1.44269504f));
    const __m256 n = _mm256_floor_ps(_mm256_add_ps(t, _mm256_set1_ps(0.5f))), f = _mm256_sub_ps(t, n);
    __m256 p = _mm256_set1_ps(1.5403530e-4f);
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.3333558e-3f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.6181291e-3f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.5504109e-2f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.4022651e-1f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.9314718e-1f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
    const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    const __m256 e = _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
    return _mm256_andnot_ps(_mm256_cmp_ps(x, floor, _CMP_LT_OQ), e);
}

#endif
