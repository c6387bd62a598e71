/* How fast two threads can get through a decode step's fp32 weight matrices, op by op.
 *
 * Usage: fp32_read_floor MODE REPEATS OUTxIN...   (each OUTxIN one matrix, in step order)
 * MODE:
 *   stream  every matrix read as one array split in two halves, no wait between matrices: the
 *           read loop's rate over the same bytes
 *   ops     each matrix split in two halves, the threads meeting after each one: the floor of any
 *           chain of one-token linears, whose every op needs the output of the one before
 *   gemv    y = W x for each matrix, rows taken in tiles of 16 by whichever thread is free, the
 *           threads meeting after each one: a plain AVX2 matrix-vector chain
 * Two persistent threads spin at the meeting points, so no wake-up is timed. Prints one JSON line
 * with the median and best milliseconds per pass over all matrices. Built by fp32_read_floor.py. */
#include <immintrin.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define TILE_ROWS 16
#define MAX_MATRICES 512

enum { STREAM, OPS, GEMV };
static int mode, matrices, repeats;
static int out_dim[MAX_MATRICES], in_dim[MAX_MATRICES];
static float *weights[MAX_MATRICES], *x, *y;
static atomic_int next_tile[MAX_MATRICES];
static atomic_int arrived, generation, started, finished;
static double sink[2]; /* keeps the reads from being optimized away */

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static void meet(void) {
    const int seen = atomic_load(&generation);
    if (atomic_fetch_add(&arrived, 1) == 1) {
        atomic_store(&arrived, 0);
        atomic_fetch_add(&generation, 1);
    } else {
        while (atomic_load(&generation) == seen) _mm_pause();
    }
}

static float sum_lanes(__m256 v) {
    float lanes[8], total = 0.0f;
    _mm256_storeu_ps(lanes, v);
    for (int j = 0; j < 8; j++) total += lanes[j];
    return total;
}

static double read_floats(const float *p, size_t n) {
    __m256 s0 = _mm256_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
    size_t i = 0;
    for (; i + 32 <= n; i += 32) {
        s0 = _mm256_add_ps(s0, _mm256_loadu_ps(p + i));
        s1 = _mm256_add_ps(s1, _mm256_loadu_ps(p + i + 8));
        s2 = _mm256_add_ps(s2, _mm256_loadu_ps(p + i + 16));
        s3 = _mm256_add_ps(s3, _mm256_loadu_ps(p + i + 24));
    }
    float total = sum_lanes(_mm256_add_ps(_mm256_add_ps(s0, s1), _mm256_add_ps(s2, s3)));
    for (; i < n; i++) total += p[i];
    return total;
}

static float dot(const float *w, const float *v, int n) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    int k = 0;
    for (; k + 32 <= n; k += 32) {
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w + k), _mm256_loadu_ps(v + k), a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(w + k + 8), _mm256_loadu_ps(v + k + 8), a1);
        a2 = _mm256_fmadd_ps(_mm256_loadu_ps(w + k + 16), _mm256_loadu_ps(v + k + 16), a2);
        a3 = _mm256_fmadd_ps(_mm256_loadu_ps(w + k + 24), _mm256_loadu_ps(v + k + 24), a3);
    }
    float total = sum_lanes(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
    for (; k < n; k++) total += w[k] * v[k];
    return total;
}

/* Thread `id`'s part of one pass over every matrix. */
static void pass(int id) {
    for (int m = 0; m < matrices; m++) {
        const size_t elements = (size_t)out_dim[m] * in_dim[m], half = elements / 2;
        if (mode != GEMV) {
            sink[id] += id == 0 ? read_floats(weights[m], half) : read_floats(weights[m] + half, elements - half);
            if (mode == OPS) meet();
            continue;
        }
        const int tiles = (out_dim[m] + TILE_ROWS - 1) / TILE_ROWS;
        for (int t; (t = atomic_fetch_add(&next_tile[m], 1)) < tiles;) {
            const int last = (t + 1) * TILE_ROWS < out_dim[m] ? (t + 1) * TILE_ROWS : out_dim[m];
            for (int o = t * TILE_ROWS; o < last; o++) y[o] = dot(weights[m] + (size_t)o * in_dim[m], x, in_dim[m]);
        }
        meet();
        if (id == 0) atomic_store(&next_tile[m], 0); /* nobody takes tiles of m again in this pass */
    }
    if (mode == STREAM) meet();
}

static void *helper(void *unused) {
    (void)unused;
    for (int r = 0; r < repeats; r++) {
        while (atomic_load(&started) <= r) _mm_pause();
        pass(1);
        atomic_fetch_add(&finished, 1);
    }
    return NULL;
}

static int compare(const void *a, const void *b) {
    const double d = *(const double *)a - *(const double *)b;
    return (d > 0) - (d < 0);
}

int main(int argc, char **argv) {
    if (argc < 4 || argc - 3 > MAX_MATRICES) {
        fprintf(stderr, "usage: %s stream|ops|gemv REPEATS OUTxIN...\n", argv[0]);
        return 2;
    }
    mode = !strcmp(argv[1], "stream") ? STREAM : !strcmp(argv[1], "ops") ? OPS : !strcmp(argv[1], "gemv") ? GEMV : -1;
    repeats = atoi(argv[2]);
    matrices = argc - 3;
    if (mode < 0 || repeats < 1) {
        fprintf(stderr, "unknown mode %s or repeats %s\n", argv[1], argv[2]);
        return 2;
    }
    size_t bytes = 0;
    int widest_in = 1, widest_out = 1;
    for (int m = 0; m < matrices; m++) {
        if (sscanf(argv[3 + m], "%dx%d", &out_dim[m], &in_dim[m]) != 2 || out_dim[m] < 1 || in_dim[m] < 1) {
            fprintf(stderr, "bad matrix shape %s (want OUTxIN)\n", argv[3 + m]);
            return 2;
        }
        const size_t elements = (size_t)out_dim[m] * in_dim[m];
        weights[m] = aligned_alloc(64, (elements * sizeof(float) + 63) / 64 * 64);
        if (!weights[m]) return 1;
        for (size_t i = 0; i < elements; i++) weights[m][i] = (float)(i % 7) * 0.01f;
        bytes += elements * sizeof(float);
        widest_in = in_dim[m] > widest_in ? in_dim[m] : widest_in;
        widest_out = out_dim[m] > widest_out ? out_dim[m] : widest_out;
    }
    x = aligned_alloc(64, sizeof(float) * ((widest_in + 15) / 16 * 16));
    y = aligned_alloc(64, sizeof(float) * ((widest_out + 15) / 16 * 16));
    if (!x || !y) return 1;
    for (int i = 0; i < widest_in; i++) x[i] = 1.0f;
    pthread_t thread;
    if (pthread_create(&thread, NULL, helper, NULL)) return 1;
    double *seconds = malloc(sizeof(double) * repeats);
    for (int r = 0; r < repeats; r++) {
        const double start = now();
        atomic_store(&started, r + 1);
        pass(0);
        while (atomic_load(&finished) <= r) _mm_pause();
        seconds[r] = now() - start;
    }
    pthread_join(thread, NULL);
    qsort(seconds, repeats, sizeof(double), compare);
    printf("{\"mode\": \"%s\", \"mb\": %.1f, \"median_ms\": %.3f, \"best_ms\": %.3f, \"checksum\": %.0f}\n", argv[1],
           bytes / 1e6, 1e3 * seconds[repeats / 2], 1e3 * seconds[0], sink[0] + sink[1] + y[0]);
    return 0;
}
