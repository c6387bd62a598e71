/* The decode-attention kernel outside any model, with its cache in L2, in L3 or coming from
 * memory, against one core reading the same bytes with no arithmetic.
 *
 * Usage: kernel_cache_levels SLOTS THREADS SETS LAYERS REPEATS [float|f16|head-major]
 *   Allocates SETS x LAYERS caches, int8 codes (float32 with `float`, float16 with `f16`; SmolLM2: 9
 *   query and 3 KV heads, head_dim 64, SLOTS rows each for keys and values; `head-major`: int8 codes
 *   as ONNX bundles keep them, [KV head][slot][D], where the others are LiteRT's [slot][KV head][D]),
 *   each on transparent huge pages where the system allows them, as KVCache puts a runtime's cache
 *   (4 KB pages made a call from memory up to a tenth slower, by the page walks), and times LAYERS
 *   consecutive calls, each on the next layer's cache, the sets taking turns. SETS 1 LAYERS 1
 *   keeps one layer in L2; SETS 1 LAYERS 30 keeps 30 layers (23.6 MB of int8 codes at 2,048
 *   slots) in the L3; SETS 8 reads from memory.
 * Prints one JSON line: the best time of REPEATS for the LAYERS calls, and for the read loop; on
 * CPUs with AVX-512 VNNI also how many 512-bit vpdpbusd / vpdpwssd one core retires per second,
 * which with the kernel's count of them (slots x heads x head_dim / 16 per call) bounds its
 * arithmetic.
 * Built by kernel_cache_levels.py, against the kernel's own sources. */
#include "decode_attention.c"

#include <stdio.h>
#include <sys/mman.h>

/* n bytes (rounded up to 2 MB) on a 2 MB boundary, advised for transparent huge pages. */
static void *huge_page_alloc(size_t n) {
    const size_t huge = (size_t)1 << 21;
    n = (n + huge - 1) / huge * huge;
    void *p = aligned_alloc(huge, n);
#ifdef MADV_HUGEPAGE
    if (p) madvise(p, n, MADV_HUGEPAGE); /* only advice: 4 KB pages serve where it is refused */
#endif
    return p;
}

#define HEADS 9
#define KV_HEADS 3
#define HEAD_DIM 64

static double best_of(double best, double start) {
    const double t = seconds() - start;
    return t < best ? t : best;
}

/* Reads every 64-byte line of n bytes (n a multiple of 64); returns a value that depends on all of
 * them. Two 32-byte halves a line into two sums, with an AVX2 (or AVX-512) clone: a 64-byte vector
 * compiled for the baseline ISA went through the stack every line, and timed store forwarding (72 us
 * for a 2,048-slot layer in L2 on the Zen 3, against 70 for the kernel itself). */
typedef long long Half __attribute__((vector_size(32)));
__attribute__((target_clones("avx512f", "avx2", "default"))) static long long read_all(const int8_t *p, size_t n) {
    Half low = {0}, high = {0};
    for (size_t i = 0; i < n; i += 64) {
        Half a, b;
        memcpy(&a, p + i, sizeof a);
        memcpy(&b, p + i + 32, sizeof b);
        low += a, high += b;
    }
    low += high;
    return low[0] + low[1] + low[2] + low[3];
}

#if LITEKV_INT8_DOT
/* One core's throughput for the kernel's two dot-product instructions in its mix (vpdpbusd for
 * scores, vpdpwssd for values, as many of each), on 12 independent sums held in registers. In asm:
 * compiled from intrinsics, the sums went through the stack every round and the stores, not the
 * dot products, set the rate (half the true one). */
__attribute__((target("avx512f,avx512bw,avx512vnni"))) static double vnni_per_second(void) {
    enum { PER_ROUND = 12, ROUNDS = 1000000 };
    double best = 0.0;
    for (int repeat = 0; repeat < 20; repeat++) {
        long rounds = ROUNDS;
        const double start = seconds();
        __asm__ volatile("vpternlogd $0xff, %%zmm30, %%zmm30, %%zmm30\n\t"
                         "vpabsb %%zmm30, %%zmm31\n\t"
                         "1:\n\t"
#define PAIR(a, b) "vpdpbusd %%zmm30, %%zmm31, %%zmm" #a "\n\tvpdpwssd %%zmm30, %%zmm31, %%zmm" #b "\n\t"
                         PAIR(0, 1) PAIR(2, 3) PAIR(4, 5) PAIR(6, 7) PAIR(8, 9) PAIR(10, 11)
#undef PAIR
                         "dec %0\n\t"
                         "jnz 1b"
                         : "+r"(rounds)
                         :
                         : "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10",
                           "xmm11", "xmm30", "xmm31", "cc");
        const double rate = (double)PER_ROUND * ROUNDS / (seconds() - start);
        best = rate > best ? rate : best;
    }
    return best;
}
#endif

int main(int argc, char **argv) {
    const int head_major = argc == 7 && strcmp(argv[6], "head-major") == 0;
    const int type = argc == 6 || head_major ? CACHE_I8
                     : strcmp(argv[6], "float") == 0 ? CACHE_F32
                     : strcmp(argv[6], "f16") == 0   ? CACHE_F16
                                                     : -1;
    if ((argc != 6 && argc != 7) || type < 0) {
        fprintf(stderr, "usage: %s SLOTS THREADS SETS LAYERS REPEATS [float|f16|head-major]\n", argv[0]);
        return 2;
    }
    const int slots = atoi(argv[1]), threads = atoi(argv[2]), sets = atoi(argv[3]), layers = atoi(argv[4]),
              repeats = atoi(argv[5]);
    if (slots < 16 || threads < 1 || sets < 1 || layers < 1 || repeats < 1) return 2;
    const size_t elements = (size_t)slots * KV_HEADS * HEAD_DIM, count = (size_t)sets * layers;
    const size_t bytes = elements * cache_element_bytes(type);
    int8_t **keys = calloc(count, sizeof *keys), **values = calloc(count, sizeof *values);
    float query[HEADS * HEAD_DIM], out[HEADS * HEAD_DIM], *mask = calloc((size_t)slots, sizeof(float));
    if (!keys || !values || !mask) return 1;
    srand(1);
    for (size_t l = 0; l < count; l++) {
        keys[l] = huge_page_alloc(bytes);
        values[l] = huge_page_alloc(bytes);
        if (!keys[l] || !values[l]) return 1;
        for (size_t i = 0; i < elements; i++) {
            const int k = rand() % 255 - 127, v = rand() % 255 - 127;
            if (type == CACHE_F32)
                ((float *)(void *)keys[l])[i] = (float)k * 0.01f, ((float *)(void *)values[l])[i] = (float)v * 0.01f;
            else if (type == CACHE_F16)
                ((_Float16 *)(void *)keys[l])[i] = (_Float16)(k * 0.01f), ((_Float16 *)(void *)values[l])[i] = (_Float16)(v * 0.01f);
            else
                keys[l][i] = (int8_t)k, values[l][i] = (int8_t)v;
        }
    }
    for (int i = 0; i < HEADS * HEAD_DIM; i++) query[i] = (float)(rand() % 1000 - 500) * 1e-4f;
    AttentionConfig cfg = {0};
    cfg.head_dim = HEAD_DIM, cfg.threads = threads, cfg.max_slots = slots, cfg.num_heads = HEADS, cfg.int8_dot = 1;
    double kernel = 1e9, reading = 1e9;
    long long sink = 0;
    for (int r = 0; r < repeats; r++) { /* the sets in turns: a set is cold again after SETS - 1 others */
        const size_t first = (size_t)(r % sets) * layers;
        const double start = seconds();
        for (size_t l = first; l < first + (size_t)layers; l++)
            if ((head_major ? litekv_attention_head_major(&cfg, query, keys[l], values[l], out, HEADS, KV_HEADS, slots,
                                                          HEAD_DIM, 0, slots - 1, type, NULL)
                            : litekv_attention_run(&cfg, query, keys[l], values[l], NULL, NULL, mask, out, HEADS,
                                                   KV_HEADS, slots, type)) != 0)
                return 1;
        kernel = best_of(kernel, start);
    }
    for (int r = 0; r < repeats; r++) { /* the same bytes in the same turns, one core, no arithmetic */
        const size_t first = (size_t)(r % sets) * layers;
        const double start = seconds();
        for (size_t l = first; l < first + (size_t)layers; l++) sink += read_all(keys[l], bytes) + read_all(values[l], bytes);
        reading = best_of(reading, start);
    }
    const int int8_dot = type == CACHE_I8 ? ((State *)cfg.state)->int8_dot : INT8_DOT_NONE; /* an Int8Dot */
    litekv_attention_release(&cfg);
    double vnni = 0.0;
#if LITEKV_INT8_DOT
    if (int8_dot == INT8_DOT_VNNI) vnni = vnni_per_second(); /* AVX2's integer path has no VNNI to count */
#endif
    printf("{\"heads\": %d, \"head_dim\": %d, \"slots\": %d, \"threads\": %d, \"sets\": %d, \"layers\": %d, "
           "\"cache\": \"%s\", \"layout\": \"%s\", \"int8_dot\": %d, \"kernel_ms\": %.4f, "
           "\"read_ms\": %.4f, \"vnni_per_second\": %.4g, \"sink\": %llu}\n",
           HEADS, HEAD_DIM, slots, threads, sets, layers, type == CACHE_I8 ? "int8" : type == CACHE_F16 ? "float16" : "float32", head_major ? "head-major" : "rows", int8_dot, 1e3 * kernel, 1e3 * reading, vnni, (unsigned long long)(sink & 1));
    return 0;
}
