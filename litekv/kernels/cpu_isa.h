/* The CPU features the kernels dispatch on (cpu_isa.c): what the CPU has, less what the environment
 * variable LITEKV_MAX_ISA caps ("avx2": no AVX-512; "baseline": none of these). Every dispatch on
 * the CPU asks this, not __builtin_cpu_supports. The value never changes (read once, at load). */
#ifndef LITEKV_CPU_ISA_H
#define LITEKV_CPU_ISA_H

enum {
    CPU_AVX2 = 1 << 0,
    CPU_FMA = 1 << 1,
    CPU_F16C = 1 << 2,
    CPU_AVX512F = 1 << 3,
    CPU_AVX512BW = 1 << 4,
    CPU_AVX512VNNI = 1 << 5,
};

__attribute__((visibility("hidden"), const)) int litekv_cpu_features(void);

/* Whether the capped CPU has every feature in `wanted` (CPU_* bits). */
static inline int cpu_has(int wanted) { return (litekv_cpu_features() & wanted) == wanted; }

#endif
