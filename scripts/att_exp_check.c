/* The kernel's exp (rakv/kernels/blockq.c: exp_f, exp_f16; the attention's softmax and the C
   layers' SiLU) on every one of the 2^32 floats: how far it is from the C library's expf in ulps,
   and (with AVX-512) whether the 16-lane form gives the scalar form's bits on every one
   (docs/fastpath.md#attention). Exit status 0 when every input is within 1 ulp and the forms agree.

       cc -O3 -march=native -ffp-contract=off -fopenmp -o /tmp/att_exp_check scripts/att_exp_check.c -lm
       /tmp/att_exp_check          # ~30 s on 2 cores
   -DSTRIDE=4099: every 4099th float only (the test suite's quick form). */
#include <stdio.h>
#include <string.h>
#include "../rakv/kernels/blockq.c"
#ifndef STRIDE
#define STRIDE 1
#endif

static int64_t ulps(float a, float b) {
    if (a != a || b != b) return (a != a) == (b != b) ? 0 : INT32_MAX;
    int32_t x, y;
    memcpy(&x, &a, 4);
    memcpy(&y, &b, 4);
    return x > y ? (int64_t)x - y : (int64_t)y - x;
}

int main(void) {
    int64_t n = 0, off = 0, maxu = 0, lanes_differ = 0;
    float worst = 0.0f;
    #pragma omp parallel for reduction(+ : n, off, lanes_differ) reduction(max : maxu) schedule(static)
    for (int64_t blk = 0; blk < (1LL << 28) / STRIDE; blk++) {
        float buf[16], vec[16];
        for (int l = 0; l < 16; l++) {
            const uint32_t b = (uint32_t)((blk * 16 + l) * (int64_t)STRIDE);
            memcpy(&buf[l], &b, 4);
        }
#ifdef RAKV_AVX512
        _mm512_storeu_ps(vec, exp_f16(_mm512_loadu_ps(buf)));
#else
        for (int l = 0; l < 16; l++) vec[l] = exp_f(buf[l]);
#endif
        for (int l = 0; l < 16; l++) {
            const float a = exp_f(buf[l]);
            const int64_t d = ulps(a, expf(buf[l]));
            lanes_differ += memcmp(&a, &vec[l], 4) != 0;
            n++;
            off += d > 0;
            if (d > maxu) {
                maxu = d;
                #pragma omp critical
                worst = buf[l];
            }
        }
    }
    printf("inputs %lld (every %d-th float); 16-lane form != scalar form: %lld; max |exp_f - expf| %lld ulp "
           "(e.g. at %.9g); differ from expf: %lld (%.2f%%)\n", (long long)n, STRIDE, (long long)lanes_differ,
           (long long)maxu, worst, (long long)off, 100.0 * off / n);
    return lanes_differ != 0 || maxu > 1;
}
