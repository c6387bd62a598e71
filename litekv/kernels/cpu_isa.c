/* The CPU features the kernels dispatch on, capped by the environment variable LITEKV_MAX_ISA (as
 * oneDNN's ONEDNN_MAX_CPU_ISA): unset, empty or "avx512" = what the CPU has; "avx2" = as on a CPU
 * without AVX-512 (the AVX2 paths, no AVX-512 or VNNI one); "baseline" = neither (the portable
 * code). Case and surrounding blanks are ignored. litekv.native_attention refuses other values
 * before it loads the library; loaded another way, the library ignores them. Read once per process,
 * when the library is loaded. Functions compiled with target_clones (VECTOR_CLONES) still pick their
 * clone from the CPU itself. */
#include "cpu_isa.h"

#include <ctype.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

static int cpu_features(void) {
#if defined(__x86_64__) && defined(__GNUC__)
    __builtin_cpu_init();
    return (__builtin_cpu_supports("avx2") ? CPU_AVX2 : 0) | (__builtin_cpu_supports("fma") ? CPU_FMA : 0) |
           (__builtin_cpu_supports("f16c") ? CPU_F16C : 0) | (__builtin_cpu_supports("avx512f") ? CPU_AVX512F : 0) |
           (__builtin_cpu_supports("avx512bw") ? CPU_AVX512BW : 0) |
           (__builtin_cpu_supports("avx512vnni") ? CPU_AVX512VNNI : 0);
#else
    return 0;
#endif
}

/* The features LITEKV_MAX_ISA leaves: all of them unless it names a lower cap. */
static int isa_cap(void) {
    const char *value = getenv("LITEKV_MAX_ISA");
    if (!value) return -1;
    while (isspace((unsigned char)*value)) value++;
    size_t n = strlen(value);
    while (n && isspace((unsigned char)value[n - 1])) n--;
    if (n == 4 && !strncasecmp(value, "avx2", n)) return CPU_AVX2 | CPU_FMA | CPU_F16C;
    if (n == 8 && !strncasecmp(value, "baseline", n)) return 0;
    return -1; /* unset, empty, "avx512", or unknown */
}

static atomic_int features = -1;

int litekv_cpu_features(void) {
    int f = atomic_load_explicit(&features, memory_order_relaxed);
    if (f < 0) { /* not loaded by the constructor: any thread may find it first, each finds the same */
        f = cpu_features() & isa_cap();
        atomic_store_explicit(&features, f, memory_order_relaxed);
    }
    return f;
}

/* Read at load: the environment as the loader (native_attention._load) checked it. Not by calling
 * litekv_cpu_features, which is declared const: a call whose value is unused may be dropped. */
__attribute__((constructor)) static void read_cap_at_load(void) {
    atomic_store_explicit(&features, cpu_features() & isa_cap(), memory_order_relaxed);
}
