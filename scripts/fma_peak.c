/* This machine's arithmetic peaks, the ceilings a verify row cannot pass (docs/results.md, "Where
   the targets stand", V(8)/t): the fp32 FMA peak (exact fp32 rows) and, with `vnni`, the AVX-512 VNNI
   `vpdpbusd` rate with the activation quad broadcast from memory as the q8 kernel's tiled form
   issues it (one per 64 weights a row).
   gcc -O3 -march=native -fopenmp scripts/fma_peak.c -o fma_peak && ./fma_peak [vnni]
   Needs AVX-512F (and VNNI for `vnni`). Two threads, 12 independent chains each, best of 5. */
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <omp.h>

#define CHAINS 12

/* one thread's chains: fp32 FMAs (vnni 0) or vpdpbusd with a broadcast quad (vnni 1) */
static float chains(long iters, int vnni, int t) {
    if (vnni) {
#ifdef __AVX512VNNI__
        __m512i acc[CHAINS];
        int8_t x[64];
        memset(x, 1 + t, sizeof(x));
        for (int i = 0; i < CHAINS; i++) acc[i] = _mm512_set1_epi32(i);
        const __m512i w = _mm512_set1_epi8(3);
        for (long it = 0; it < iters; it++)
            for (int i = 0; i < CHAINS; i++) {
                int32_t v;
                memcpy(&v, x + 4 * i, 4);
                acc[i] = _mm512_dpbusd_epi32(acc[i], w, _mm512_set1_epi32(v));
            }
        __m512i s = acc[0];
        for (int i = 1; i < CHAINS; i++) s = _mm512_add_epi32(s, acc[i]);
        return (float)_mm512_reduce_add_epi32(s);
#else
        return 0.0f;
#endif
    }
    __m512 acc[CHAINS];
    for (int i = 0; i < CHAINS; i++) acc[i] = _mm512_set1_ps(0.001f * (i + t));
    const __m512 x = _mm512_set1_ps(0.999999f), y = _mm512_set1_ps(1e-7f);
    for (long it = 0; it < iters; it++)
        for (int i = 0; i < CHAINS; i++) acc[i] = _mm512_fmadd_ps(acc[i], x, y);
    __m512 s = acc[0];
    for (int i = 1; i < CHAINS; i++) s = _mm512_add_ps(s, acc[i]);
    return _mm512_reduce_add_ps(s);
}

int main(int argc, char **argv) {
    const int vnni = argc > 1 && strcmp(argv[1], "vnni") == 0;
    const long iters = 200000000L / CHAINS;
    double best = 0;
    for (int rep = 0; rep < 5; rep++) {
        struct timespec a, b;
        clock_gettime(CLOCK_MONOTONIC, &a);
        float sink = 0;
        #pragma omp parallel num_threads(2) reduction(+:sink)
        sink += chains(iters, vnni, omp_get_thread_num());
        clock_gettime(CLOCK_MONOTONIC, &b);
        double sec = (b.tv_sec - a.tv_sec) + 1e-9 * (b.tv_nsec - a.tv_nsec);
        double per = 2.0 * iters * CHAINS / sec / 1e9;            /* instructions a second, 2 threads */
        if (per > best) best = per;
        if (sink == 12345) printf("x");
    }
    if (vnni)
        printf("vpdpbusd (zmm, broadcast quad), 2 threads: %.2f G/s = %.0f G byte products/s\n", best, 64 * best);
    else
        printf("fp32 FMA peak, 2 threads: %.0f GFLOP/s\n", best * 16 * 2);
    return 0;
}
