/* This machine's fp32 FMA peak (the ceiling a verify of exact fp32 rows cannot pass; docs/results.md,
   "Where the targets stand", V(8)/t): gcc -O3 -march=native -fopenmp scripts/fma_peak.c -o fma_peak && ./fma_peak
   Needs AVX-512F. Two threads, 12 independent 512-bit FMA chains each, best of 5. */
#include <immintrin.h>
#include <stdio.h>
#include <time.h>
#include <omp.h>
/* fp32 FMA peak: 12 independent 512-bit accumulators per thread */
int main(void) {
    const long iters = 200000000L / 12;
    double best = 0;
    for (int rep = 0; rep < 5; rep++) {
        struct timespec a, b;
        clock_gettime(CLOCK_MONOTONIC, &a);
        float sink = 0;
        #pragma omp parallel num_threads(2) reduction(+:sink)
        {
            __m512 acc[12];
            for (int i = 0; i < 12; i++) acc[i] = _mm512_set1_ps(0.001f * (i + omp_get_thread_num()));
            const __m512 x = _mm512_set1_ps(0.999999f), y = _mm512_set1_ps(1e-7f);
            for (long it = 0; it < iters; it++)
                for (int i = 0; i < 12; i++) acc[i] = _mm512_fmadd_ps(acc[i], x, y);
            __m512 s = acc[0];
            for (int i = 1; i < 12; i++) s = _mm512_add_ps(s, acc[i]);
            sink += _mm512_reduce_add_ps(s);
        }
        clock_gettime(CLOCK_MONOTONIC, &b);
        double sec = (b.tv_sec - a.tv_sec) + 1e-9 * (b.tv_nsec - a.tv_nsec);
        double gf = 2.0 * iters * 12 * 16 * 2 / sec / 1e9;   /* 2 threads x iters x 12 chains x 16 lanes x 2 flops */
        if (gf > best) best = gf;
        if (sink == 12345) printf("x");
    }
    printf("fp32 FMA peak, 2 threads: %.0f GFLOP/s\n", best);
    return 0;
}
