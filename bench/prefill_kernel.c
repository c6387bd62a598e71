/* The prefill-attention kernel outside any model: one chunk of query tokens against a cache, on one
 * or two threads taking the chunk's tasks in turn as decode_attention.c's helper does, the AVX2
 * path and the portable one alternating in one process (litekv_prefill_avx2).
 *
 * Usage: prefill_kernel SLOTS FIRST TOKENS THREADS REPEATS ROUNDS CACHE LAYOUT [avx2]
 *   SmolLM2's heads (9 query, 3 KV, head_dim 64); the chunk's tokens sit at slots FIRST.. of a
 *   SLOTS-slot cache of CACHE elements (f32, f16, i8, i8rows). LAYOUT litert: slot-major rows
 *   [S][KVH * D] and a causal mask [T][S], as a LiteRT bundle calls it; onnx: head-major
 *   [KVH][S][D] and no mask (the causal span from FIRST), as ONNX Runtime's PrefillAttention does.
 *   Each round times REPEATS calls with each path in turn (with `avx2`, only the AVX2 path: for
 *   a profiler).
 * Prints one JSON line: every round's microseconds per call for each path ("avx2" absent where the
 * CPU has AVX-512 or lacks AVX2), and the largest difference between the paths' outputs.
 * Built by prefill_kernel.py, against the kernel's own sources. */
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "attention_common.h"

int litekv_prefill_avx2(int enable);

#define HEADS 9
#define KV_HEADS 3
#define HEAD_DIM 64

static double seconds(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* The call the threads share: tasks taken in turn from `next`, `done` counted. */
typedef struct {
    const PrefillJob *job;
    float *scratch[2];
    atomic_int next, done, generation, quit;
    int count;
} Pool;

static void take(Pool *p, int worker) {
    for (int task; (task = atomic_fetch_add(&p->next, 1)) < p->count;) {
        prefill_task(p->job, task, p->scratch[worker]);
        atomic_fetch_add(&p->done, 1);
    }
}

static void *helper(void *arg) {
    Pool *p = arg;
    int seen = 0;
    while (!atomic_load(&p->quit)) {
        const int g = atomic_load(&p->generation);
        if (g == seen) {
            sched_yield();
            continue;
        }
        seen = g;
        take(p, 1);
    }
    return NULL;
}

static void call(Pool *p, int threads) {
    p->count = prefill_tasks(p->job);
    atomic_store(&p->done, 0);
    atomic_store(&p->next, 0);
    if (threads > 1) atomic_fetch_add(&p->generation, 1);
    take(p, 0);
    while (atomic_load(&p->done) != p->count) sched_yield();
}

static float uniform(unsigned *state) {
    *state = *state * 1664525u + 1013904223u;
    return (float)(*state >> 8) / (float)(1u << 24) * 2.0f - 1.0f;
}

static void *cache_of(int type, size_t n, unsigned *state) {
    void *c = malloc(n * cache_element_bytes(type));
    for (size_t i = 0; i < n; i++) {
        const float x = uniform(state);
        if (type == CACHE_F32) ((float *)c)[i] = x;
        else if (type == CACHE_F16) {
            _Float16 h = (_Float16)x;
            memcpy((uint16_t *)c + i, &h, 2);
        } else ((int8_t *)c)[i] = (int8_t)(x * 127.0f);
    }
    return c;
}

int main(int argc, char **argv) {
    static const char *types[] = {"f32", "i8", "f16", "i8rows"};
    int type = -1;
    for (int i = 0; (argc == 9 || argc == 10) && i < 4; i++)
        if (!strcmp(argv[7], types[i])) type = i;
    if (type < 0 || (strcmp(argv[8], "litert") && strcmp(argv[8], "onnx"))) {
        fprintf(stderr, "usage: %s SLOTS FIRST TOKENS THREADS REPEATS ROUNDS f32|f16|i8|i8rows litert|onnx [avx2]\n",
                argv[0]);
        return 2;
    }
    const int slots = atoi(argv[1]), first = atoi(argv[2]), tokens = atoi(argv[3]), threads = atoi(argv[4]),
              repeats = atoi(argv[5]), rounds = atoi(argv[6]), onnx = !strcmp(argv[8], "onnx");
    if (first + tokens > slots || threads < 1 || threads > 2) return 2;
    unsigned state = 7;
    const size_t n = (size_t)slots * KV_HEADS * HEAD_DIM, width = (size_t)HEADS * HEAD_DIM;
    float *query = malloc(sizeof(float) * tokens * width), *out[2];
    for (size_t i = 0; i < tokens * width; i++) query[i] = uniform(&state) * (type == CACHE_I8 ? 0.01f : 0.3f);
    void *keys = cache_of(type, n, &state), *values = cache_of(type, n, &state);
    float *scales[2] = {NULL, NULL};
    if (type == CACHE_I8_ROWS)
        for (int k = 0; k < 2; k++) {
            scales[k] = malloc(sizeof(float) * slots * KV_HEADS);
            for (int i = 0; i < slots * KV_HEADS; i++) scales[k][i] = 0.01f * (1.5f + uniform(&state));
        }
    float *mask = NULL;
    if (!onnx) {
        mask = malloc(sizeof(float) * tokens * slots);
        for (int t = 0; t < tokens; t++)
            for (int s = 0; s < slots; s++) mask[(size_t)t * slots + s] = s <= first + t ? 0.0f : -3.4e38f;
    }
    for (int k = 0; k < 2; k++) out[k] = calloc(tokens * width, sizeof(float));
    PrefillJob job = {query, mask, keys, values, scales[0], scales[1], NULL, type, tokens, slots, HEADS, KV_HEADS,
                      HEAD_DIM, onnx ? HEAD_DIM : KV_HEADS * HEAD_DIM,
                      onnx ? (size_t)slots * HEAD_DIM : (size_t)HEAD_DIM, onnx ? first : 0, 0, NULL};
    const size_t floats = prefill_scratch_floats(HEADS, HEAD_DIM, slots);
    Pool pool = {.job = &job};
    for (int w = 0; w < 2; w++) pool.scratch[w] = aligned_alloc(64, (sizeof(float) * floats + 63) / 64 * 64);
    pthread_t thread;
    if (threads > 1) pthread_create(&thread, NULL, helper, &pool);
    const int has_avx2 = litekv_prefill_avx2(1);
    const int paths = has_avx2 ? 2 : 1, only_avx2 = has_avx2 && argc == 10; /* path 0: portable, 1: AVX2 */
    double us[2][64] = {{0}};
    for (int r = 0; r < rounds && r < 64; r++)
        for (int path = only_avx2; path < paths; path++) {
            litekv_prefill_avx2(path);
            job.out = out[path];
            call(&pool, threads); /* warm */
            const double start = seconds();
            for (int i = 0; i < repeats; i++) call(&pool, threads);
            us[path][r] = (seconds() - start) * 1e6 / repeats;
        }
    double diff = 0.0, top = 0.0;
    for (size_t i = 0; paths == 2 && !only_avx2 && i < tokens * width; i++) {
        diff = fmax(diff, fabs((double)out[0][i] - out[1][i]));
        top = fmax(top, fabs((double)out[0][i]));
    }
    atomic_store(&pool.quit, 1);
    if (threads > 1) pthread_join(thread, NULL);
    printf("{\"portable_us\": [");
    for (int r = 0; r < rounds; r++) printf("%s%.1f", r ? ", " : "", us[0][r]);
    printf("]");
    if (paths == 2) {
        printf(", \"avx2_us\": [");
        for (int r = 0; r < rounds; r++) printf("%s%.1f", r ? ", " : "", us[1][r]);
        printf("]");
        if (!only_avx2) printf(", \"max_difference\": %.3g, \"max_output\": %.3g", diff, top);
    }
    printf("}\n");
    return 0;
}
