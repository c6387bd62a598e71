/* How long one thread takes to hand work to a thread on the other core: the cost the attention
 * kernel's helper pays at the start of every call. A "waker" pinned to CPU 0 stamps the time and
 * bumps a counter; a "waiter" pinned to CPU 1 notices and records the delay. CPU 1 is either idle
 * or also running a "spinner", a thread that spins on PAUSE the way XNNPACK's worker does between
 * its tasks.
 *
 * Usage: wake_latency WAIT SPINNER WAITER_POLICY SAMPLES
 *   WAIT           futex (the waiter sleeps) or yield (it polls with sched_yield)
 *   SPINNER        none, other (SCHED_OTHER) or idle (SCHED_IDLE)
 *   WAITER_POLICY  other, or fifo (SCHED_FIFO 1; needs CAP_SYS_NICE)
 * Prints one JSON line: the handoffs seen, their median and 10th / 90th percentiles in µs. A
 * handoff the waiter misses entirely (the next one came first) counts as one fewer sample.
 * Built by wake_latency.py. */
#define _GNU_SOURCE
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define GAP_MICROSECONDS 200 /* between handoffs: longer than any delay measured here */

static atomic_int counter, stop;
static _Atomic double stamp;
static double *delays;
static int samples, seen_count, use_futex, spinner_idle, waiter_fifo;

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static int pin(int cpu) {
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpu, &set);
    return pthread_setaffinity_np(pthread_self(), sizeof set, &set);
}

static void *waiter(void *unused) {
    (void)unused;
    pin(1);
    int seen = 0;
    while (!atomic_load(&stop)) {
        while (atomic_load(&counter) == seen && !atomic_load(&stop)) {
            if (use_futex)
                syscall(SYS_futex, &counter, FUTEX_WAIT_PRIVATE, seen, NULL, NULL, 0);
            else
                sched_yield();
        }
        seen = atomic_load(&counter);
        if (!atomic_load(&stop) && seen_count < samples) delays[seen_count++] = now() - atomic_load(&stamp);
    }
    return NULL;
}

static void *spinner(void *unused) {
    (void)unused;
    pin(1);
    if (spinner_idle) {
        struct sched_param none = {0};
        pthread_setschedparam(pthread_self(), SCHED_IDLE, &none);
    }
    while (!atomic_load(&stop))
        for (int i = 0; i < 1000; i++) __builtin_ia32_pause();
    return NULL;
}

static int by_value(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv) {
    if (argc != 5) {
        fprintf(stderr, "usage: %s futex|yield none|other|idle other|fifo SAMPLES\n", argv[0]);
        return 2;
    }
    use_futex = strcmp(argv[1], "futex") == 0;
    const int with_spinner = strcmp(argv[2], "none") != 0;
    spinner_idle = strcmp(argv[2], "idle") == 0;
    waiter_fifo = strcmp(argv[3], "fifo") == 0;
    samples = atoi(argv[4]);
    delays = calloc((size_t)samples, sizeof(double));
    if (!delays || samples < 10) return 2;
    if (sysconf(_SC_NPROCESSORS_ONLN) < 2 || pin(0) != 0) {
        fprintf(stderr, "wake_latency needs CPUs 0 and 1\n");
        return 3;
    }
    pthread_t wait_thread, spin_thread;
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    if (waiter_fifo) { /* set at creation, so a refusal is reported instead of measured as "other" */
        struct sched_param first = {1};
        pthread_attr_setinheritsched(&attr, PTHREAD_EXPLICIT_SCHED);
        pthread_attr_setschedpolicy(&attr, SCHED_FIFO);
        pthread_attr_setschedparam(&attr, &first);
    }
    if (with_spinner) pthread_create(&spin_thread, NULL, spinner, NULL);
    if (pthread_create(&wait_thread, &attr, waiter, NULL) != 0) {
        fprintf(stderr, "wake_latency: cannot start a SCHED_FIFO thread (needs CAP_SYS_NICE)\n");
        atomic_store(&stop, 1);
        if (with_spinner) pthread_join(spin_thread, NULL);
        return 4;
    }
    usleep(20000);
    const struct timespec gap = {0, GAP_MICROSECONDS * 1000};
    for (int i = 0; i < samples; i++) {
        nanosleep(&gap, NULL);
        atomic_store(&stamp, now());
        atomic_fetch_add(&counter, 1);
        if (use_futex) syscall(SYS_futex, &counter, FUTEX_WAKE_PRIVATE, 1, NULL, NULL, 0);
    }
    usleep(20000);
    atomic_store(&stop, 1);
    atomic_fetch_add(&counter, 1);
    syscall(SYS_futex, &counter, FUTEX_WAKE_PRIVATE, 1, NULL, NULL, 0);
    pthread_join(wait_thread, NULL);
    if (with_spinner) pthread_join(spin_thread, NULL);
    const int n = seen_count;
    qsort(delays, (size_t)n, sizeof(double), by_value);
    printf("{\"wait\": \"%s\", \"spinner\": \"%s\", \"waiter\": \"%s\", \"offered\": %d, \"seen\": %d, "
           "\"median_us\": %.2f, \"p10_us\": %.2f, \"p90_us\": %.2f}\n",
           argv[1], argv[2], argv[3], samples, n, n ? 1e6 * delays[n / 2] : 0.0, n ? 1e6 * delays[n / 10] : 0.0,
           n ? 1e6 * delays[9 * n / 10] : 0.0);
    free(delays);
    return 0;
}
