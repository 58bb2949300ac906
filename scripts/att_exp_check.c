/* The attention's exp (rakv/kernels/blockq.c: att_exp, att_exp16) on every float x in [EXP_LO, 0]:
   how far it is from the C library's expf in ulps, and (with AVX-512) whether the 16-lane form
   gives the scalar form's bits on every one (docs/fastpath.md#attention).

       cc -O3 -march=native -ffp-contract=off -fopenmp -o /tmp/att_exp_check scripts/att_exp_check.c -lm
       /tmp/att_exp_check          # ~10 s: 1.1e9 inputs */
#include <stdio.h>
#include <string.h>
#include "../rakv/kernels/blockq.c"

static int64_t ulps(float a, float b) {
    int32_t x, y;
    memcpy(&x, &a, 4);
    memcpy(&y, &b, 4);
    return x > y ? (int64_t)x - y : (int64_t)y - x;
}

int main(void) {
    const float flo = EXP_LO;
    uint32_t lo;
    memcpy(&lo, &flo, 4);
    int64_t n = 0, off = 0, maxu = 0, lanes_differ = 0;
    float worst = 0.0f, buf[16];
    for (uint64_t u = 0x80000000u; u <= lo; u += 16) {      /* -0, then down to EXP_LO */
        for (int l = 0; l < 16; l++) {
            const uint32_t b = u + l > lo ? lo : (uint32_t)(u + l);
            memcpy(&buf[l], &b, 4);
        }
        float vec[16];
#ifdef RAKV_AVX512
        _mm512_storeu_ps(vec, att_exp16(_mm512_loadu_ps(buf)));
#else
        for (int l = 0; l < 16; l++) vec[l] = att_exp(buf[l]);
#endif
        for (int l = 0; l < 16; l++) {
            const float a = att_exp(buf[l]);
            const int64_t d = ulps(a, expf(buf[l]));
            lanes_differ += memcmp(&a, &vec[l], 4) != 0;
            n++;
            off += d > 0;
            if (d > maxu) { maxu = d; worst = buf[l]; }
        }
    }
    printf("inputs %lld in [%.9g, 0]; 16-lane form != scalar form: %lld; max |att_exp - expf| %lld ulp "
           "(at %.9g); differ from expf: %lld (%.2f%%)\n", (long long)n, flo, (long long)lanes_differ,
           (long long)maxu, worst, (long long)off, 100.0 * off / n);
    return lanes_differ != 0 || maxu > 1;
}
