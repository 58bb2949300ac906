/* The block kernel's arithmetic written out plainly, one output at a time (tests/unit/test_blockq.py
   compares rakv/kernels/blockq.c with it bit for bit).

   y[r][n] = tree16(lanes) (+ bias[n]): lane l (0..15) starts at 0 and adds, block after block b,
   w[n][32b + l] x[r][32b + l] and then w[n][32b + 16 + l] x[r][32b + 16 + l], each with one fma;
   tree16 adds lane l to lane l + 8, then + 4, + 2, + 1. The weight is rebuilt as the GGUF
   dequantizer does: fma(d, q, m) for Q4 (kind 4) and Q8X (kind 9, d and m per 16 inputs), d * q for
   Q8 (kind 8). */
#include <math.h>
#include <stdint.h>

static float weight(int64_t kind, int64_t K, const uint8_t *qs, const float *d, const float *m, int64_t n,
                    int64_t k) {
    const int64_t nb = K / 32, b = k / 32, j = k % 32;
    if (kind == 4) {
        const uint8_t byte = qs[(n * nb + b) * 16 + j % 16];
        return fmaf(d[n * nb + b], (float)(j < 16 ? byte & 15 : byte >> 4), m[n * nb + b]);
    }
    if (kind == 9) {
        const int64_t h = 2 * (n * nb + b) + j / 16;
        return fmaf(d[h], (float)qs[(n * nb + b) * 32 + j], m[h]);
    }
    return d[n * nb + b] * (float)(int8_t)qs[(n * nb + b) * 32 + j];
}

void reference_linear(int64_t kind, int64_t N, int64_t K, const uint8_t *qs, const float *d, const float *m,
                      const float *x, int64_t M, float *y, const float *bias) {
    for (int64_t r = 0; r < M; r++)
        for (int64_t n = 0; n < N; n++) {
            float a[16] = {0}, s8[8], s4[4], s2[2];
            for (int64_t b = 0; b < K / 32; b++)
                for (int half = 0; half < 2; half++)
                    for (int l = 0; l < 16; l++) {
                        const int64_t k = 32 * b + 16 * half + l;
                        a[l] = fmaf(weight(kind, K, qs, d, m, n, k), x[r * K + k], a[l]);
                    }
            for (int i = 0; i < 8; i++) s8[i] = a[i] + a[i + 8];
            for (int i = 0; i < 4; i++) s4[i] = s8[i] + s8[i + 4];
            for (int i = 0; i < 2; i++) s2[i] = s4[i] + s4[i + 2];
            float s = s2[0] + s2[1];
            if (bias) s += bias[n];
            y[r * N + n] = s;
        }
}
