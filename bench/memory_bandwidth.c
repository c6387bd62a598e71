/* Sustained read bandwidth: sum a large float array with 2 OpenMP threads, AVX2 loads, and an
 * optional software prefetch distance. Usage: memory_bandwidth MIB REPEATS PREFETCH_FLOATS
 * Prints one JSON line with the best GB/s over the repeats. Built by memory_bandwidth.py. */
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <time.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

int main(int argc, char **argv) {
    if (argc != 4) {
        fprintf(stderr, "usage: %s MIB REPEATS PREFETCH_FLOATS\n", argv[0]);
        return 2;
    }
    size_t n = (size_t)atol(argv[1]) * 1024 * 1024 / sizeof(float);
    int repeats = atoi(argv[2]);
    size_t ahead = (size_t)atol(argv[3]);
    size_t bytes = (n * sizeof(float) + (2u << 20) - 1) / (2u << 20) * (2u << 20);
    float *a = aligned_alloc(2u << 20, bytes + ahead * sizeof(float));
    if (!a) return 1;
    madvise(a, bytes, MADV_HUGEPAGE);
#pragma omp parallel for
    for (size_t i = 0; i < n + ahead; i++) a[i] = 1.0f;
    double best = 1e30, total = 0;
    for (int r = 0; r < repeats; r++) {
        double start = now(), sum = 0;
#pragma omp parallel reduction(+ : sum)
        {
            __m256 s0 = _mm256_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
#pragma omp for
            for (size_t i = 0; i < n; i += 64) {  /* one 256-byte step: 4 cache lines */
                if (ahead) {
                    _mm_prefetch((const char *)(a + i + ahead), _MM_HINT_T0);
                    _mm_prefetch((const char *)(a + i + ahead + 32), _MM_HINT_T0);
                }
                s0 = _mm256_add_ps(s0, _mm256_add_ps(_mm256_load_ps(a + i), _mm256_load_ps(a + i + 32)));
                s1 = _mm256_add_ps(s1, _mm256_add_ps(_mm256_load_ps(a + i + 8), _mm256_load_ps(a + i + 40)));
                s2 = _mm256_add_ps(s2, _mm256_add_ps(_mm256_load_ps(a + i + 16), _mm256_load_ps(a + i + 48)));
                s3 = _mm256_add_ps(s3, _mm256_add_ps(_mm256_load_ps(a + i + 24), _mm256_load_ps(a + i + 56)));
            }
            float lanes[8];
            _mm256_storeu_ps(lanes, _mm256_add_ps(_mm256_add_ps(s0, s1), _mm256_add_ps(s2, s3)));
            for (int j = 0; j < 8; j++) sum += lanes[j];
        }
        double seconds = now() - start;
        if (seconds < best) best = seconds;
        total += sum;
    }
    printf("{\"mib\": %s, \"threads\": %d, \"prefetch_floats\": %zu, \"gb_s\": %.2f, \"checksum\": %.0f}\n",
           argv[1], omp_get_max_threads(), ahead, n * sizeof(float) / best / 1e9, total);
    free(a);
    return 0;
}
