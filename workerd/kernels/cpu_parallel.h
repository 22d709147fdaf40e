/* How kvloom's CPU kernels share a call among threads: torch's own OpenMP
 * pool when built with -fopenmp (workerd/kernels/loader.py: by the time a
 * kernel runs, the worker has loaded torch's libgomp and the library binds to
 * that same copy, so the kernels' threads and torch's are one pool and never
 * compete for cores), as many threads as the caller passes: torch's
 * get_num_threads(), read per call (OpenMP's own count is per thread, and a
 * rank may run its steps off the main thread, where torch's setting is not
 * OpenMP's). Work is split
 * by the kernel into independent units; each unit is computed the same way
 * whichever thread takes it, so results never depend on the thread count. */
#ifndef KVLOOM_CPU_PARALLEL_H
#define KVLOOM_CPU_PARALLEL_H

#include <stdint.h>

#ifdef _OPENMP
#include <omp.h>
/* The threads for `units` units of work: one below min_units (too small a
 * call to share), else up to max_threads (torch's count), never more than
 * units. */
static inline int parallel_threads(int64_t units, int64_t min_units, int64_t max_threads) {
    if (units < min_units || max_threads <= 1) return 1;
    return (int)(max_threads < units ? max_threads : units);
}
static inline int thread_index(void) { return omp_get_thread_num(); }
static inline int thread_count(void) { return omp_get_num_threads(); }
#else
static inline int parallel_threads(int64_t units, int64_t min_units, int64_t max_threads) {
    (void)units;
    (void)min_units;
    (void)max_threads;
    return 1;
}
static inline int thread_index(void) { return 0; }
static inline int thread_count(void) { return 1; }
#endif

/* Thread tid's contiguous share [*begin, *end) of n units among nt threads. */
static inline void thread_share(int64_t n, int tid, int nt, int64_t *begin, int64_t *end) {
    *begin = n * tid / nt;
    *end = n * (tid + 1) / nt;
}

#endif
