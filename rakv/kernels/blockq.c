/* Exact fp32 linear layers over block-coded weights (rakv/blockq.py builds and loads this file).

   A weight W [N, K] whose every block of 32 consecutive inputs of one output row is exactly
     Q4:  w = fma(d, q, m),  q in 0..15   (GGUF's Q4_1: a scale and a minimum per block), or
     Q8:  w = d * q,         q in -128..127 (GGUF's Q8_0)
   (checked element by element before this kernel is used) is stored as those codes: 4.5 or 8.5
   bits a weight instead of 32. Each weight is rebuilt in fp32 exactly as it was (the products are
   exact in fp32) and multiplied in fp32, so y = x W^T (+ b) is the fp32 linear of the same weights;
   only the order of the additions is this kernel's own. That order does not depend on how many
   rows x has, nor on the thread count: row r of y is bit-identical whether it is computed alone
   (a decode step) or among the k + 1 rows of a verify.

   Order of one output y[r][n]: 16 lanes, lane l accumulates, block after block, the products of
   inputs 32b + l and then 32b + 16 + l (fma); then the 16 lanes are added as a tree
   (l + 8, then + 4, + 2, + 1); then the bias.

     Q8X: w = fma(d, q, m),  q in 0..255, a scale and a minimum per 16 inputs (what GGUF's Q5_1 and
          its K-quants Q2_K, Q3_K, Q5_K, Q6_K dequantize to: rakv/kernels/blockq.py from_gguf)

   Shapes: x [M, K] row-major, y [M, N]; Q4 codes [N, K/32, 16] bytes (byte j of a block: input j in
   the low nibble, input j + 16 in the high one, as GGUF lays them out); Q8 and Q8X codes [N, K/32, 32];
   d, m [N, K/32] fp32 (Q8X: [N, K/16]). K is a multiple of 32. */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#define RAKV_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define RAKV_AVX2 1
#endif

#define LANES 16
#define BLK 32
#define MR_MAX 12         /* rows per pass over the weights */
#ifndef PREFETCH
#define PREFETCH 2        /* tiles ahead a thread prefetches (into all cache levels: a non-temporal hint measured slower) */
#endif

static inline float tree16(const float *a) {
    float s8[8], s4[4], s2[2];
    for (int i = 0; i < 8; i++) s8[i] = a[i] + a[i + 8];
    for (int i = 0; i < 4; i++) s4[i] = s8[i] + s8[i + 4];
    for (int i = 0; i < 2; i++) s2[i] = s4[i] + s4[i + 2];
    return s2[0] + s2[1];
}

#ifdef RAKV_AVX512
/* tree16 on a register: the same additions in the same order */
static inline float tree_reg(__m512 acc) {
    const __m256 s8 = _mm256_add_ps(_mm512_castps512_ps256(acc),
                                    _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc), 1)));
    const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
    const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    return _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
}

static inline void store_out(__m512 acc, float *dst, const float *bias, int64_t n) {
    float s = tree_reg(acc);
    if (bias) s += bias[n];
    *dst = s;
}

/* NT outputs x MR rows, one pass over the NT weight rows; NT * MR accumulators in registers, each
   weight rebuilt once, each x vector loaded once per block */
#define Q_TILE(NAME, NT, MR, DEQ)                                                              \
static inline void NAME(const float *x, int64_t K, int64_t nb, const uint8_t *qs, int64_t qstride, \
                        const float *d, const float *m, float *y, int64_t N, const float *bias,  \
                        int64_t n0) {                                                          \
    __m512 acc[NT][MR];                                                                        \
    for (int t = 0; t < NT; t++) for (int r = 0; r < MR; r++) acc[t][r] = _mm512_setzero_ps(); \
    for (int64_t b = 0; b < nb; b++) {                                                         \
        __m512 w0[NT], w1[NT];                                                                 \
        for (int t = 0; t < NT; t++) {                                                         \
            const int64_t row = n0 + t;                                                        \
            const uint8_t *blk = qs + row * qstride + b * (qstride / nb);                      \
            const __m512 vd = _mm512_set1_ps(d[row * nb + b]);                                 \
            DEQ                                                                                \
        }                                                                                      \
        for (int r = 0; r < MR; r++) {                                                         \
            const float *xr = x + r * K + b * BLK;                                             \
            __m512 x0 = _mm512_loadu_ps(xr), x1 = _mm512_loadu_ps(xr + LANES);                 \
            __asm__("" : "+v"(x0), "+v"(x1));   /* in registers: each x load serves all NT outputs */ \
            for (int t = 0; t < NT; t++) {                                                     \
                acc[t][r] = _mm512_fmadd_ps(w0[t], x0, acc[t][r]);                             \
                acc[t][r] = _mm512_fmadd_ps(w1[t], x1, acc[t][r]);                             \
            }                                                                                  \
        }                                                                                      \
    }                                                                                          \
    for (int t = 0; t < NT; t++)                                                               \
        for (int r = 0; r < MR; r++) store_out(acc[t][r], y + r * N + n0 + t, bias, n0 + t);  \
}

/* Q4: the block's 16 possible weights fma(d, j, m), j = 0..15, then each weight looked up by its code
   (vpermps reads the low 4 bits of each lane): the same values as fma(d, q, m), fewer instructions */
#define DEQ4                                                                                   \
    {   const __m512 tab = _mm512_fmadd_ps(vd, _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, \
                                           3, 2, 1, 0), _mm512_set1_ps(m[row * nb + b]));      \
        const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)blk));         \
        w0[t] = _mm512_permutexvar_ps(v, tab);                                                 \
        w1[t] = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), tab); }

#define DEQ8                                                                                   \
    {   const __m512i a = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)blk));         \
        const __m512i c = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(blk + 16)));  \
        w0[t] = _mm512_mul_ps(vd, _mm512_cvtepi32_ps(a));                                      \
        w1[t] = _mm512_mul_ps(vd, _mm512_cvtepi32_ps(c)); }

/* Q8X: unsigned 8-bit codes, each half of the block (16 inputs) with its own scale and minimum */
#define DEQ8X                                                                                  \
    {   const int64_t h = 2 * (row * nb + b);                                                  \
        const __m512i a = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)blk));         \
        const __m512i c = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(blk + 16)));  \
        (void)vd;                                                                              \
        w0[t] = _mm512_fmadd_ps(_mm512_set1_ps(d[h]), _mm512_cvtepi32_ps(a), _mm512_set1_ps(m[h])); \
        w1[t] = _mm512_fmadd_ps(_mm512_set1_ps(d[h + 1]), _mm512_cvtepi32_ps(c),               \
                                _mm512_set1_ps(m[h + 1])); }

#else  /* portable: the same order, lane arrays the compiler may vectorize */
static inline void store_out(const float *acc, float *dst, const float *bias, int64_t n) {
    float s = tree16(acc);
    if (bias) s += bias[n];
    *dst = s;
}

#define Q_TILE(NAME, NT, MR, DEQ)                                                              \
static inline void NAME(const float *x, int64_t K, int64_t nb, const uint8_t *qs, int64_t qstride, \
                        const float *d, const float *m, float *y, int64_t N, const float *bias,  \
                        int64_t n0) {                                                          \
    float acc[NT][MR][LANES];                                                                  \
    memset(acc, 0, sizeof acc);                                                                \
    for (int64_t b = 0; b < nb; b++) {                                                         \
        for (int t = 0; t < NT; t++) {                                                         \
            const int64_t row = n0 + t;                                                        \
            const uint8_t *blk = qs + row * qstride + b * (qstride / nb);                      \
            const float vd = d[row * nb + b];                                                  \
            float w0[LANES], w1[LANES];                                                        \
            DEQ                                                                                \
            for (int r = 0; r < MR; r++) {                                                     \
                const float *xr = x + r * K + b * BLK;                                         \
                for (int l = 0; l < LANES; l++) acc[t][r][l] = fmaf(w0[l], xr[l], acc[t][r][l]); \
                for (int l = 0; l < LANES; l++)                                                \
                    acc[t][r][l] = fmaf(w1[l], xr[LANES + l], acc[t][r][l]);                   \
            }                                                                                  \
        }                                                                                      \
    }                                                                                          \
    for (int t = 0; t < NT; t++)                                                               \
        for (int r = 0; r < MR; r++) store_out(acc[t][r], y + r * N + n0 + t, bias, n0 + t);  \
}

#define DEQ4                                                                                   \
    {   const float vm = m[row * nb + b];                                                      \
        for (int l = 0; l < LANES; l++) {                                                      \
            w0[l] = fmaf(vd, (float)(blk[l] & 15), vm);                                        \
            w1[l] = fmaf(vd, (float)(blk[l] >> 4), vm); } }

#define DEQ8                                                                                   \
    {   for (int l = 0; l < LANES; l++) {                                                      \
            w0[l] = vd * (float)(int8_t)blk[l];                                                \
            w1[l] = vd * (float)(int8_t)blk[LANES + l]; } }

#define DEQ8X                                                                                  \
    {   const int64_t h = 2 * (row * nb + b);                                                  \
        (void)vd;                                                                              \
        for (int l = 0; l < LANES; l++) {                                                      \
            w0[l] = fmaf(d[h], (float)blk[l], m[h]);                                           \
            w1[l] = fmaf(d[h + 1], (float)blk[LANES + l], m[h + 1]); } }
#endif

#ifndef RAKV_AVX2
#define TILES(P, DEQ)                                                                          \
    Q_TILE(P##_4x1, 4, 1, DEQ) Q_TILE(P##_4x2, 4, 2, DEQ) Q_TILE(P##_4x3, 4, 3, DEQ)           \
    Q_TILE(P##_4x4, 4, 4, DEQ) Q_TILE(P##_2x5, 2, 5, DEQ) Q_TILE(P##_2x6, 2, 6, DEQ)           \
    Q_TILE(P##_2x7, 2, 7, DEQ) Q_TILE(P##_2x8, 2, 8, DEQ) Q_TILE(P##_2x9, 2, 9, DEQ)           \
    Q_TILE(P##_2x10, 2, 10, DEQ) Q_TILE(P##_2x11, 2, 11, DEQ) Q_TILE(P##_2x12, 2, 12, DEQ)     \
    Q_TILE(P##_1x1, 1, 1, DEQ) Q_TILE(P##_1x2, 1, 2, DEQ) Q_TILE(P##_1x3, 1, 3, DEQ)           \
    Q_TILE(P##_1x4, 1, 4, DEQ) Q_TILE(P##_1x5, 1, 5, DEQ) Q_TILE(P##_1x6, 1, 6, DEQ)           \
    Q_TILE(P##_1x7, 1, 7, DEQ) Q_TILE(P##_1x8, 1, 8, DEQ) Q_TILE(P##_1x9, 1, 9, DEQ)           \
    Q_TILE(P##_1x10, 1, 10, DEQ) Q_TILE(P##_1x11, 1, 11, DEQ) Q_TILE(P##_1x12, 1, 12, DEQ)

TILES(q4, DEQ4)
TILES(q8, DEQ8)
TILES(q8x, DEQ8X)

typedef void (*tile_fn)(const float *, int64_t, int64_t, const uint8_t *, int64_t, const float *,
                        const float *, float *, int64_t, const float *, int64_t);

/* by rows in a pass: NT outputs at a time, 4 up to 4 rows, then 2 (NT * MR <= 24 accumulators) */
#define ONES(P) P##_1x1, P##_1x2, P##_1x3, P##_1x4, P##_1x5, P##_1x6, P##_1x7, P##_1x8, P##_1x9,     \
                P##_1x10, P##_1x11, P##_1x12
#define WIDE(P) P##_4x1, P##_4x2, P##_4x3, P##_4x4, P##_2x5, P##_2x6, P##_2x7, P##_2x8, P##_2x9,     \
                P##_2x10, P##_2x11, P##_2x12
static const tile_fn Q4_WIDE[MR_MAX + 1] = {0, WIDE(q4)};
static const tile_fn Q4_ONE[MR_MAX + 1] = {0, ONES(q4)};
static const tile_fn Q8_WIDE[MR_MAX + 1] = {0, WIDE(q8)};
static const tile_fn Q8_ONE[MR_MAX + 1] = {0, ONES(q8)};
static const tile_fn Q8X_WIDE[MR_MAX + 1] = {0, WIDE(q8x)};
static const tile_fn Q8X_ONE[MR_MAX + 1] = {0, ONES(q8x)};

static void run(const tile_fn *wide, const tile_fn *one, const float *x, int64_t M, int64_t K,
                const uint8_t *qs, int64_t qstride, const float *d, const float *m, int64_t N,
                float *y, const float *bias, int threads, int64_t dper) {
    const int64_t nb = K / BLK;
    for (int64_t r0 = 0; r0 < M; r0 += MR_MAX) {
        const int mr = (int)(M - r0 < MR_MAX ? M - r0 : MR_MAX);
        const int nt = mr <= 4 ? 4 : 2;
        const int64_t tiles = N / nt;
        const float *xr = x + r0 * K;
        float *yr = y + r0 * N;
        const int64_t span = nt * qstride, dspan = nt * nb * dper * (int64_t)sizeof(float);
        #pragma omp parallel for schedule(static) num_threads(threads)
        for (int64_t i = 0; i < tiles; i++) {
            if (PREFETCH > 0 && i + PREFETCH < tiles) {     /* the tile PREFETCH ahead: codes, d, m */
                const char *p = (const char *)(qs + (i + PREFETCH) * span);
                for (int64_t o = 0; o < span; o += 64) __builtin_prefetch(p + o, 0, 3);
                const char *pd = (const char *)(d + (i + PREFETCH) * nt * nb * dper);
                const char *pm = (const char *)(m + (i + PREFETCH) * nt * nb * dper);
                for (int64_t o = 0; o < dspan; o += 64) {
                    __builtin_prefetch(pd + o, 0, 3);
                    if (m != d) __builtin_prefetch(pm + o, 0, 3);
                }
            }
            wide[mr](xr, K, nb, qs, qstride, d, m, yr, N, bias, i * nt);
        }
        for (int64_t n0 = tiles * nt; n0 < N; n0++)
            one[mr](xr, K, nb, qs, qstride, d, m, yr, N, bias, n0);
    }
}
#endif

#ifdef RAKV_AVX2
/* AVX2 (8 lanes a register, 16 registers). Lanes 0-7 and lanes 8-15 of an output are two separate
   chains of fmas (lane l adds inputs 32b + l, then 32b + 16 + l, block after block), held in two
   registers ("halves": half h has the inputs 32b + 8h .. + 7 and 32b + 16 + 8h .. + 7 of every
   block b) and joined by the lane tree's first addition. Two ways, by the number of rows M:
   - few rows (direct_rows): each weight block is rebuilt into registers and used there by every
     row, NT outputs x MR rows at a time (2 NT MR accumulators);
   - more rows: a thread rebuilds STRIP weight rows at a time into an fp32 buffer laid out in
     halves, then runs all rows of x (laid out in halves once per call) over it, one half after the
     other, in register tiles of NT outputs x MR rows (NT MR accumulators, one register each).
   Each output's additions are the ones above in the same order for any M, tile or thread count. */
#define STRIP 12          /* weight rows a thread rebuilds at a time (its buffer: STRIP K floats) */
#ifndef STRIP_AHEAD
#define STRIP_AHEAD 1     /* strips ahead a thread prefetches the codes of */
#endif
#define MR_TILE 6         /* most rows in a register tile */
#define NT_MAX 4          /* most outputs in a register tile */
#define ACC_MAX 12        /* most accumulators in a register tile (+ its weights and one x: 16 registers) */
#ifndef NT_OF
#define NT_OF {0, 4, 4, 3, 3, 2, 2}
#endif

/* a buffered register tile's outputs for mr rows: as many as ACC_MAX accumulators allow, up to NT_MAX */
static inline int tile_outputs(int mr) {
    static const int nt[MR_TILE + 1] = NT_OF;
    return nt[mr];
}

/* how many rows the i-th of M's row tiles has: ceil(M / MR_TILE) tiles as equal as they can be (a
   tile of few rows has too few accumulators to keep both fma pipes busy) */
static inline int tile_rows(int64_t M, int64_t i) {
    const int64_t tiles = (M + MR_TILE - 1) / MR_TILE;
    return (int)(M / tiles + (i < M % tiles));
}

typedef struct {
    int kind;                          /* 4: Q4, 8: Q8, 9: Q8X */
    int64_t K, nb, qstride;
    const uint8_t *qs;
    const float *d, *m;
} codes;

/* a buffer of at least n floats, one per thread and slot, kept for the next call */
static __thread float *scratch_mem[2];
static __thread size_t scratch_cap[2];
static float *scratch(int slot, size_t n) {
    if (n > scratch_cap[slot]) {
        free(scratch_mem[slot]);
        scratch_mem[slot] = aligned_alloc(64, (n * sizeof(float) + 63) / 64 * 64);
        scratch_cap[slot] = scratch_mem[slot] ? n : 0;
    }
    return scratch_mem[slot];
}

/* inputs 32b + 8j .. 32b + 8j + 7 (j = 0..3) of a K-vector in halves: half j % 2, position 16b + 8 (j / 2) */
static inline float *in_halves(float *base, int64_t K, int64_t b, int j) {
    return base + (j & 1) * (K / 2) + b * (BLK / 2) + (j >> 1) * 8;
}

/* the 32 weights of block b of weight row n rebuilt exactly, w[j] = inputs 32b + 8j .. 32b + 8j + 7:
   fma(d, q, m) (Q4, Q8X) or d * q (Q8), the values the GGUF dequantizer and the other builds compute */
static inline __attribute__((always_inline)) void rebuild_block(const codes *c, const int kind, int64_t n,
                                                                int64_t b, __m256 w[4]) {
    const int64_t i = n * c->nb + b;
    const uint8_t *blk = c->qs + i * (kind == 4 ? BLK / 2 : BLK);
    if (kind == 4) {
        const __m128i low4 = _mm_set1_epi8(15);
        const __m128i raw = _mm_loadu_si128((const __m128i *)blk);
        const __m128i lo = _mm_and_si128(raw, low4), hi = _mm_and_si128(_mm_srli_epi16(raw, 4), low4);
        const __m256 vd = _mm256_set1_ps(c->d[i]), vm = _mm256_set1_ps(c->m[i]);
        w[0] = _mm256_fmadd_ps(vd, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)), vm);
        w[1] = _mm256_fmadd_ps(vd, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))), vm);
        w[2] = _mm256_fmadd_ps(vd, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)), vm);
        w[3] = _mm256_fmadd_ps(vd, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))), vm);
    } else if (kind == 8) {
        const __m256 vd = _mm256_set1_ps(c->d[i]);
        for (int j = 0; j < 4; j++)
            w[j] = _mm256_mul_ps(vd, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                _mm_loadl_epi64((const __m128i *)(blk + 8 * j)))));
    } else {
        for (int j = 0; j < 4; j++)
            w[j] = _mm256_fmadd_ps(_mm256_set1_ps(c->d[2 * i + j / 2]), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(
                _mm_loadl_epi64((const __m128i *)(blk + 8 * j)))), _mm256_set1_ps(c->m[2 * i + j / 2]));
    }
}

static inline __attribute__((always_inline)) void rebuild_row_kind(const codes *c, const int kind, int64_t n,
                                                                   float *w) {
    for (int64_t b = 0; b < c->nb; b++) {
        __m256 v[4];
        rebuild_block(c, kind, n, b, v);
        for (int j = 0; j < 4; j++) _mm256_storeu_ps(in_halves(w, c->K, b, j), v[j]);
    }
}

/* weight row n rebuilt exactly into w [K] in halves */
static void rebuild_row(const codes *c, int64_t n, float *w) {
    if (c->kind == 4) rebuild_row_kind(c, 4, n, w);
    else if (c->kind == 8) rebuild_row_kind(c, 8, n, w);
    else rebuild_row_kind(c, 9, n, w);
}

/* rows x [M, K] laid out in halves into xh [M, K] */
static void x_in_halves(const float *x, int64_t M, int64_t K, float *xh) {
    for (int64_t r = 0; r < M; r++)
        for (int64_t b = 0; b < K / BLK; b++)
            for (int j = 0; j < 4; j++)
                _mm256_storeu_ps(in_halves(xh + r * K, K, b, j), _mm256_loadu_ps(x + r * K + b * BLK + 8 * j));
}

/* the lane tree of lanes 0-7 (lo) and 8-15 (hi): tree16's additions, in its order */
static inline float tree_halves(__m256 lo, __m256 hi) {
    const __m256 s8 = _mm256_add_ps(lo, hi);
    const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
    const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    return _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
}

/* one half of NT outputs x MR rows over its K / 2 inputs: w [NT] rows and x [MR] rows at stride
   K; the lane sums into out[t * MR_TILE + r] */
static inline __attribute__((always_inline)) void half_tile(const float *w, const float *x, int64_t K,
                                                            __m256 *out, const int NT, const int MR) {
    __m256 acc[NT_MAX][MR_TILE];
    for (int t = 0; t < NT; t++) for (int r = 0; r < MR; r++) acc[t][r] = _mm256_setzero_ps();
    for (int64_t j = 0; j < K / 2; j += 8) {
        __m256 wv[NT_MAX];
        for (int t = 0; t < NT; t++) wv[t] = _mm256_load_ps(w + t * K + j);
        for (int r = 0; r < MR; r++) {
            __m256 xv = _mm256_load_ps(x + r * K + j);
            __asm__("" : "+x"(xv));    /* x in a register, used NT times (not NT loads as fma operands) */
            for (int t = 0; t < NT; t++) acc[t][r] = _mm256_fmadd_ps(wv[t], xv, acc[t][r]);
        }
    }
    for (int t = 0; t < NT; t++) for (int r = 0; r < MR; r++) out[t * MR_TILE + r] = acc[t][r];
}

#define HALF_CASE(NT, MR) \
    case (NT) * 16 + (MR): if ((NT) * (MR) <= ACC_MAX) { half_tile(w, x, K, out, NT, MR); } break;
#define HALF_CASES(NT) HALF_CASE(NT, 1) HALF_CASE(NT, 2) HALF_CASE(NT, 3) HALF_CASE(NT, 4) HALF_CASE(NT, 5) \
    HALF_CASE(NT, 6)
static void half_any(int nt, int mr, const float *w, const float *x, int64_t K, __m256 *out) {
    switch (nt * 16 + mr) {
        HALF_CASES(1) HALF_CASES(2) HALF_CASES(3) HALF_CASES(4)
        default: break;
    }
}

/* outputs n0 .. n0 + cnt - 1 of all M rows from their rebuilt weights w [cnt, K] in halves: for
   each row tile, the first halves of all cnt outputs, then the second halves joined to them */
static void strip_rows(const float *w, int cnt, const float *xh, int64_t M, int64_t K, float *y, int64_t N,
                       const float *bias, int64_t n0) {
    __m256 lo[STRIP * MR_TILE], hi[NT_MAX * MR_TILE];
    int64_t r0 = 0;
    for (int64_t i = 0; r0 < M; r0 += tile_rows(M, i++)) {
        const int mr = tile_rows(M, i), ntile = tile_outputs(mr);
        for (int t0 = 0; t0 < cnt; t0 += ntile)
            half_any(cnt - t0 < ntile ? cnt - t0 : ntile, mr, w + t0 * K, xh + r0 * K, K, lo + t0 * MR_TILE);
        for (int t0 = 0; t0 < cnt; t0 += ntile) {
            const int nt = cnt - t0 < ntile ? cnt - t0 : ntile;
            half_any(nt, mr, w + t0 * K + K / 2, xh + r0 * K + K / 2, K, hi);
            for (int t = 0; t < nt; t++)
                for (int r = 0; r < mr; r++) {
                    float s = tree_halves(lo[(t0 + t) * MR_TILE + r], hi[t * MR_TILE + r]);
                    if (bias) s += bias[n0 + t0 + t];
                    y[(r0 + r) * N + n0 + t0 + t] = s;
                }
        }
    }
}

/* the codes, scales and offsets of weight rows n0 .. n0 + count - 1 into the caches */
static void prefetch_rows(const codes *c, int64_t n0, int64_t count, int64_t N) {
    const int64_t rows = N - n0 < count ? N - n0 : count, groups = c->kind == 9 ? 2 * c->nb : c->nb;
    const char *q = (const char *)(c->qs + n0 * c->qstride);
    for (int64_t o = 0; o < rows * c->qstride; o += 64) __builtin_prefetch(q + o, 0, 3);
    const char *d = (const char *)(c->d + n0 * groups), *m = (const char *)(c->m + n0 * groups);
    for (int64_t o = 0; o < rows * groups * (int64_t)sizeof(float); o += 64) {
        __builtin_prefetch(d + o, 0, 3);
        if (c->m != c->d) __builtin_prefetch(m + o, 0, 3);
    }
}

/* few rows: each weight block rebuilt into registers and used there by every row, no buffer. NT
   outputs x MR rows, both halves of each (2 NT MR accumulators) */
#define DIRECT_NT 4
#define DIRECT_MR MR_TILE
static inline __attribute__((always_inline)) void direct_tile(const codes *c, const int kind, int64_t n0,
        const float *x, float *y, int64_t N, const float *bias, const int NT, const int MR) {
    const int64_t K = c->K;
    __m256 lo[DIRECT_NT][DIRECT_MR], hi[DIRECT_NT][DIRECT_MR];
    for (int t = 0; t < NT; t++)
        for (int r = 0; r < MR; r++) lo[t][r] = hi[t][r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < c->nb; b++)
        for (int t = 0; t < NT; t++) {
            __m256 w[4];
            rebuild_block(c, kind, n0 + t, b, w);
            for (int r = 0; r < MR; r++) {
                const float *xr = x + r * K + b * BLK;
                lo[t][r] = _mm256_fmadd_ps(w[0], _mm256_loadu_ps(xr), lo[t][r]);
                hi[t][r] = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(xr + 8), hi[t][r]);
                lo[t][r] = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(xr + 16), lo[t][r]);
                hi[t][r] = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xr + 24), hi[t][r]);
            }
        }
    for (int t = 0; t < NT; t++)
        for (int r = 0; r < MR; r++) {
            float s = tree_halves(lo[t][r], hi[t][r]);
            if (bias) s += bias[n0 + t];
            y[r * N + n0 + t] = s;
        }
}

#define DIRECT_CASE(KIND, NT, MR) case (KIND) * 256 + (NT) * 16 + (MR): \
    if ((NT) <= DIRECT_NT && (MR) <= DIRECT_MR) { direct_tile(c, KIND, n0, x, y, N, bias, NT, MR); } break;
#define DIRECT_CASES(KIND, NT) DIRECT_CASE(KIND, NT, 1) DIRECT_CASE(KIND, NT, 2) DIRECT_CASE(KIND, NT, 3) \
    DIRECT_CASE(KIND, NT, 4) DIRECT_CASE(KIND, NT, 5) DIRECT_CASE(KIND, NT, 6)
#define DIRECT_KIND(KIND) DIRECT_CASES(KIND, 1) DIRECT_CASES(KIND, 2) DIRECT_CASES(KIND, 3) DIRECT_CASES(KIND, 4)
static void direct_any(const codes *c, int nt, int mr, int64_t n0, const float *x, float *y, int64_t N,
                       const float *bias) {
    switch (c->kind * 256 + nt * 16 + mr) {
        DIRECT_KIND(4) DIRECT_KIND(8) DIRECT_KIND(9)
        default: break;
    }
}

#ifndef DIRECT_AHEAD
#define DIRECT_AHEAD 2    /* tiles ahead a thread prefetches the codes of (as the other builds) */
#endif
#ifndef DIRECT_ROWS
#define DIRECT_ROWS 8
#endif
#ifndef DIRECT_NT_OF
#define DIRECT_NT_OF {0, 4, 2, 2, 1, 1, 1}   /* a direct tile's outputs for mr rows (2 NT MR <= 12 accumulators) */
#endif
/* whether M rows run the direct way (each weight used by few rows: no buffer round trip; past
   DIRECT_ROWS the buffered tiles win, docs/fastpath.md) */
static inline int direct_rows(int64_t M) { return M <= DIRECT_ROWS; }

static void run_direct(const codes *c, const float *x, int64_t M, int64_t N, float *y, const float *bias,
                       int threads) {
    static const int nts[DIRECT_MR + 1] = DIRECT_NT_OF;
    const int nt = nts[tile_rows(M, 0)];
    const int64_t tiles = (N + nt - 1) / nt;
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t i = 0; i < tiles; i++) {
        const int64_t n0 = i * nt;
        if (DIRECT_AHEAD > 0 && n0 + DIRECT_AHEAD * nt < N)
            prefetch_rows(c, n0 + DIRECT_AHEAD * nt, nt, N);
        int64_t r0 = 0;
        for (int64_t j = 0; r0 < M; r0 += tile_rows(M, j++))
            direct_any(c, N - n0 < nt ? (int)(N - n0) : nt, tile_rows(M, j), n0, x + r0 * c->K, y + r0 * N, N, bias);
    }
}

static void run_avx2(const codes *c, const float *x, int64_t M, int64_t N, float *y, const float *bias,
                     int threads) {
    if (M <= 0)
        return;
    if (direct_rows(M)) {
        run_direct(c, x, M, N, y, bias, threads);
        return;
    }
    const int64_t K = c->K, strips = (N + STRIP - 1) / STRIP;
    float *xh = scratch(0, M * K);
    if (xh == NULL) {                  /* no memory for the buffers: the same sums without them */
        run_direct(c, x, M, N, y, bias, threads);
        return;
    }
    x_in_halves(x, M, K, xh);
    #pragma omp parallel num_threads(threads)
    {
        float *buf = scratch(1, STRIP * K);
        #pragma omp for schedule(static)
        for (int64_t s = 0; s < strips; s++) {
            const int64_t n0 = s * STRIP;
            const int cnt = (int)(N - n0 < STRIP ? N - n0 : STRIP);
            if (STRIP_AHEAD > 0 && s + STRIP_AHEAD < strips)
                prefetch_rows(c, (s + STRIP_AHEAD) * STRIP, STRIP, N);
            if (buf == NULL) {
                for (int t = 0; t < cnt; t++)
                    for (int64_t r0 = 0, j = 0; r0 < M; r0 += tile_rows(M, j++))
                        direct_any(c, 1, tile_rows(M, j), n0 + t, x + r0 * K, y + r0 * N, N, bias);
                continue;
            }
            for (int t = 0; t < cnt; t++) rebuild_row(c, n0 + t, buf + t * K);
            strip_rows(buf, cnt, xh, M, K, y, N, bias, n0);
        }
    }
}
#endif

/* y [M, N] = x [M, K] W^T (+ bias), W in Q4 codes (see above) */
static void rakv_q4_linear(const float *x, int64_t M, int64_t K, const uint8_t *qs, const float *d,
                    const float *m, int64_t N, float *y, const float *bias, int threads) {
#ifdef RAKV_AVX2
    const codes c = {4, K, K / BLK, K / 2, qs, d, m};
    run_avx2(&c, x, M, N, y, bias, threads);
#else
    run(Q4_WIDE, Q4_ONE, x, M, K, qs, K / 2, d, m, N, y, bias, threads, 1);
#endif
}

/* y [M, N] = x [M, K] W^T (+ bias), W in Q8 codes (see above) */
static void rakv_q8_linear(const float *x, int64_t M, int64_t K, const int8_t *qs, const float *d,
                    int64_t N, float *y, const float *bias, int threads) {
#ifdef RAKV_AVX2
    const codes c = {8, K, K / BLK, K, (const uint8_t *)qs, d, d};
    run_avx2(&c, x, M, N, y, bias, threads);
#else
    run(Q8_WIDE, Q8_ONE, x, M, K, (const uint8_t *)qs, K, d, d, N, y, bias, threads, 1);
#endif
}

/* y [M, N] = x [M, K] W^T (+ bias), W in Q8X codes (see above) */
static void rakv_q8x_linear(const float *x, int64_t M, int64_t K, const uint8_t *qs, const float *d,
                            const float *m, int64_t N, float *y, const float *bias, int threads) {
#ifdef RAKV_AVX2
    const codes c = {9, K, K / BLK, K, qs, d, m};
    run_avx2(&c, x, M, N, y, bias, threads);
#else
    run(Q8X_WIDE, Q8X_ONE, x, M, K, qs, K, d, m, N, y, bias, threads, 2);
#endif
}

/* the vector width of the linear kernel's build, in bits: 512 (AVX-512), 256 (AVX2 + FMA), 0 (portable C) */
int rakv_blockq_simd(void) {
#if defined(RAKV_AVX512)
    return 512;
#elif defined(RAKV_AVX2)
    return 256;
#else
    return 0;
#endif
}

/* ---- causal attention of n new query rows over a KV cache (decode and verify steps), fp32.

   q: row i, head h at q + i * q_rs + h * D; k, v: kv head g, position j at k + g * kv_hs + j * D
   (v likewise with its own head stride); query row i sees positions 0 .. past + i; query head h
   reads kv head h / (Hq / Hk). out [n, Hq, D] contiguous. Each (row, head) is computed alone and in
   the same order whatever n is, so a row of a verify equals the same row as a decode step, bit for
   bit: scores s_j = (q . k_j) scale (16 lanes, then the lane tree), p_j = exp(s_j - max s), then
   o = sum_j p_j v_j in order of j, divided by sum_j p_j (added in order of j). D % 16 == 0.
   window > 0 (a sliding-window layer): row i sees only its last `window` positions,
   max(0, past + i + 1 - window) .. past + i. softcap > 0 (Gemma 2): each score becomes
   tanh(s / softcap) softcap, as HF's eager attention caps them. */
#define ATT_STACK 8192
#define ATT_ROWS_MAX 256    /* a tree's rows up to which its ancestry positions live on the stack */

/* q . k over D (a multiple of 16): 16 lanes (lane l adds q[c + l] k[c + l], c = 0, 16, ...), then
   tree16; and o += p v over D: element by element, one fma each. The AVX-512 forms are the same
   operations in the same order (the same bits). */
#ifdef RAKV_AVX512
static inline float dot_lanes(const float *q, const float *k, int64_t D) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t c = 0; c < D; c += LANES) acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + c), _mm512_loadu_ps(k + c), acc);
    return tree_reg(acc);
}

static inline void axpy(float p, const float *v, float *o, int64_t D) {
    const __m512 vp = _mm512_set1_ps(p);
    for (int64_t c = 0; c < D; c += LANES)
        _mm512_storeu_ps(o + c, _mm512_fmadd_ps(vp, _mm512_loadu_ps(v + c), _mm512_loadu_ps(o + c)));
}
#else
static inline float dot_lanes(const float *q, const float *k, int64_t D) {
    float acc[LANES] = {0};
    for (int64_t c = 0; c < D; c += LANES)
        for (int l = 0; l < LANES; l++) acc[l] = fmaf(q[c + l], k[c + l], acc[l]);
    return tree16(acc);
}

static inline void axpy(float p, const float *v, float *o, int64_t D) {
    for (int64_t c = 0; c < D; c++) o[c] = fmaf(p, v[c], o[c]);
}
#endif

/* exp(x) in fp32 operations that every build does alike (the AVX-512 form below runs 16 at once,
   each lane the same operations): x = n ln2 + r with n the nearest integer to x log2(e) and r by
   two fmas (ln2 in a high part with few bits and a low part), exp(r) by a degree-7 polynomial
   (Cephes' expf coefficients) in fmas, then times 2^h and 2^(n - h), h = floor(n / 2) (each a
   normal float, so the first product is exact and only the second rounds: overflow to inf and
   results below 2^-126 come out as a single rounding would give them). Within 1 ulp of the C
   library's expf on every float (scripts/att_exp_check.c); above EXP_HI inf, below EXP_LO 0. The
   attention's softmax and the SiLU of the C layers use it: libm's expf, called per element, was
   ~40% of the attention's time and ~0.2 ms of each row of a step's SiLU. */
#define EXP_HI 88.7228394f         /* exp(x) > FLT_MAX above */
#define EXP_LO (-103.972084f)      /* exp(x) < 2^-150 below: rounds to 0 */
static const float EXP_C[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f,
                               1.6666665459e-1f, 5.0000001201e-1f};
#define LOG2E_F 1.44269504088896341f
#define LN2_HI 0.693359375f
#define LN2_LO (-2.12194440e-4f)

static inline float pow2i(int32_t e) {
    union { uint32_t u; float f; } v = {.u = (uint32_t)(e + 127) << 23};
    return v.f;
}

static inline float exp_f(float x) {
    if (x != x) return x;
    if (x > EXP_HI) return INFINITY;
    if (x < EXP_LO) return 0.0f;
    const float n = nearbyintf(x * LOG2E_F);
    float r = fmaf(n, -LN2_HI, x);
    r = fmaf(n, -LN2_LO, r);
    float p = EXP_C[0];
    for (int i = 1; i < 6; i++) p = fmaf(p, r, EXP_C[i]);
    p = fmaf(p, r * r, r) + 1.0f;
    const int32_t ni = (int32_t)n, h = ni >> 1;        /* arithmetic shift: floor(n / 2) */
    return (p * pow2i(h)) * pow2i(ni - h);
}

#ifdef RAKV_AVX512
/* exp_f of 16 lanes */
static inline __m512 exp_f16(__m512 x) {
    const __mmask16 hi = _mm512_cmp_ps_mask(x, _mm512_set1_ps(EXP_HI), _CMP_GT_OQ);
    const __mmask16 lo = _mm512_cmp_ps_mask(x, _mm512_set1_ps(EXP_LO), _CMP_LT_OQ);
    const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(LOG2E_F)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(-LN2_HI), x);
    r = _mm512_fmadd_ps(n, _mm512_set1_ps(-LN2_LO), r);
    __m512 p = _mm512_set1_ps(EXP_C[0]);
    for (int i = 1; i < 6; i++) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_C[i]));
    p = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.0f));
    /* out-of-range lanes hold garbage here and are replaced below; n of them is kept small */
    const __m512i ni = _mm512_cvt_roundps_epi32(_mm512_max_ps(_mm512_min_ps(n, _mm512_set1_ps(128.0f)),
                                                _mm512_set1_ps(-150.0f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512i h = _mm512_srai_epi32(ni, 1), bias = _mm512_set1_epi32(127);
    const __m512 s1 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(h, bias), 23));
    const __m512 s2 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_sub_epi32(ni, h), bias), 23));
    __m512 y = _mm512_mul_ps(_mm512_mul_ps(p, s1), s2);
    y = _mm512_mask_mov_ps(y, hi, _mm512_set1_ps(INFINITY));
    y = _mm512_mask_mov_ps(y, lo, _mm512_setzero_ps());
    return _mm512_mask_mov_ps(y, nan, x);
}
#endif

#ifdef RAKV_AVX512
/* scores of 16 consecutive keys: lane l of key u's accumulator adds q[c + l] k_u[c + l] over c as
   dot_lanes does; then tree16's additions for all 16 keys at once (each level adds the same two
   lanes of the same key as tree16: the pairs are moved side by side by shuffles), the result
   scaled; lane j = key j */
static inline __m512 scores16(const float *qi, const float *k0, int64_t D, __m512 vscale) {
    __m512 a[16];
    for (int u = 0; u < 16; u++) a[u] = _mm512_setzero_ps();
    for (int64_t c = 0; c < D; c += LANES) {
        const __m512 qc = _mm512_loadu_ps(qi + c);
        for (int u = 0; u < 16; u++) a[u] = _mm512_fmadd_ps(qc, _mm512_loadu_ps(k0 + u * D + c), a[u]);
    }
    __m512 d8[8], d4[4], d2[2];
    for (int p = 0; p < 8; p++)      /* [s8 of key 2p | s8 of key 2p + 1]: a[i] + a[i + 8] */
        d8[p] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * p], a[2 * p + 1], 0x44),
                              _mm512_shuffle_f32x4(a[2 * p], a[2 * p + 1], 0xEE));
    for (int r = 0; r < 4; r++)      /* chunk c: s4 of key 4r + c: s8[i] + s8[i + 4] */
        d4[r] = _mm512_add_ps(_mm512_shuffle_f32x4(d8[2 * r], d8[2 * r + 1], 0x88),
                              _mm512_shuffle_f32x4(d8[2 * r], d8[2 * r + 1], 0xDD));
    for (int r = 0; r < 2; r++)      /* chunk c: s2 of keys 8r + c, 8r + 4 + c: s4[i] + s4[i + 2] */
        d2[r] = _mm512_add_ps(_mm512_shuffle_ps(d4[2 * r], d4[2 * r + 1], 0x44),
                              _mm512_shuffle_ps(d4[2 * r], d4[2 * r + 1], 0xEE));
    /* lane 4c + i: key c + 4i, s2[0] + s2[1] */
    const __m512 s = _mm512_add_ps(_mm512_shuffle_ps(d2[0], d2[1], 0x88), _mm512_shuffle_ps(d2[0], d2[1], 0xDD));
    const __m512i to_keys = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
    return _mm512_mul_ps(_mm512_permutexvar_ps(to_keys, s), vscale);
}
#endif

#define ATT_HEADS 4         /* query heads of one row attended together (independent chains) */

/* One row's heads h = 0 .. nh - 1 (nh <= ATT_HEADS): query q[h], keys and values kg[h], vg[h]
   (its kv head), output o[h]; each over the same keys: cache positions a .. b - 1, then `ne` more
   at positions extra[0 ..] (a tree row's ancestry; NULL, 0 for a decode or verify row). Each
   head's arithmetic is attend's, alone: heads run side by side only so that their chains of
   additions overlap. s: nh * (b - a + ne) floats. */
static void attend_heads(int nh, const float *const *q, const float *const *kg, const float *const *vg,
                         int64_t a, int64_t b, const int64_t *extra, int64_t ne, int64_t D, float scale,
                         float softcap, float *const *o, float *s) {
    const int64_t nc = b - a, nk = nc + ne;
    float mx[ATT_HEADS], sum[ATT_HEADS];
    int64_t j16 = 0;                                 /* keys scored 16 at a time, all heads */
    for (int h = 0; h < nh; h++) mx[h] = -INFINITY;
#ifdef RAKV_AVX512
    if (softcap <= 0.0f) {
        /* key block by key block, every head: the block's keys (shared by heads of one KV head)
           stay in L1 from the first head's scores to the last's */
        const __m512 vscale = _mm512_set1_ps(scale);
        __m512 vmx[ATT_HEADS];
        for (int h = 0; h < ATT_HEADS; h++) vmx[h] = _mm512_set1_ps(-INFINITY);
        for (; j16 + 16 <= nc; j16 += 16)
            for (int h = 0; h < nh; h++) {
                const __m512 sc = scores16(q[h], kg[h] + (a + j16) * D, D, vscale);
                _mm512_storeu_ps(s + h * nk + j16, sc);
                vmx[h] = _mm512_max_ps(sc, vmx[h]);  /* a NaN score is skipped, as the scalar test skips it */
            }
        for (int h = 0; h < nh; h++) mx[h] = _mm512_reduce_max_ps(vmx[h]);
    }
#endif
    for (int h = 0; h < nh; h++) {
        float *sh = s + h * nk;
        int64_t j = j16;
        for (; j < nk; j++) {
            const int64_t pos = j < nc ? a + j : extra[j - nc];
            sh[j] = dot_lanes(q[h], kg[h] + pos * D, D) * scale;
            if (softcap > 0.0f) sh[j] = tanhf(sh[j] / softcap) * softcap;
            if (sh[j] > mx[h]) mx[h] = sh[j];
        }
        j = 0;
#ifdef RAKV_AVX512
        for (const __m512 vm = _mm512_set1_ps(mx[h]); j + 16 <= nk; j += 16)
            _mm512_storeu_ps(sh + j, exp_f16(_mm512_sub_ps(_mm512_loadu_ps(sh + j), vm)));
#endif
        for (; j < nk; j++) sh[j] = exp_f(sh[j] - mx[h]);
        sum[h] = 0.0f;
    }
    for (int64_t j = 0; j < nk; j++)                 /* each head's sum in order of j */
        for (int h = 0; h < nh; h++) sum[h] += s[h * nk + j];
    /* o = sum_j p_j v_j in order of j, one fma per element (axpy's), the sums kept in registers */
    int64_t c = 0;
#ifdef RAKV_AVX512
    for (; c + 4 * LANES <= D; c += 4 * LANES) {
        __m512 acc[ATT_HEADS][4];
        for (int h = 0; h < ATT_HEADS; h++)
            for (int r = 0; r < 4; r++) acc[h][r] = _mm512_setzero_ps();
        for (int64_t j = 0; j < nk; j++) {
            const int64_t pos = j < nc ? a + j : extra[j - nc];
            for (int h = 0; h < ATT_HEADS; h++) {
                if (h >= nh) break;
                const float *vj = vg[h] + pos * D + c;
                const __m512 p = _mm512_set1_ps(s[h * nk + j]);
                for (int r = 0; r < 4; r++) acc[h][r] = _mm512_fmadd_ps(p, _mm512_loadu_ps(vj + r * LANES), acc[h][r]);
            }
        }
        for (int h = 0; h < nh; h++)
            for (int r = 0; r < 4; r++) _mm512_storeu_ps(o[h] + c + r * LANES, acc[h][r]);
    }
#endif
    if (c < D)
        for (int h = 0; h < nh; h++) {
            for (int64_t e = c; e < D; e++) o[h][e] = 0.0f;
            for (int64_t j = 0; j < nk; j++)
                axpy(s[h * nk + j], vg[h] + (j < nc ? a + j : extra[j - nc]) * D + c, o[h] + c, D - c);
        }
    for (int h = 0; h < nh; h++) {
        const float inv = 1.0f / sum[h];
        for (int64_t e = 0; e < D; e++) o[h][e] *= inv;
    }
}

/* how many head chunks each row's Hq heads run in: at most ATT_HEADS heads a chunk; a lone row
   (a decode step) in at least `threads` chunks, so that every thread has some */
static inline int64_t head_chunks(int64_t n, int64_t Hq, int threads) {
    int64_t c = (Hq + ATT_HEADS - 1) / ATT_HEADS;
    if (n == 1 && c < threads) c = threads < Hq ? threads : Hq;
    else if (n == 1 && c % threads) c = (c / threads + 1) * threads < Hq ? (c / threads + 1) * threads : Hq;
    return c;
}

/* one (row, head chunk) task: the row's keys j0 .. T - 1 (of its own sequence: cache positions,
   then for a tree row its ancestry's rows at positions `pos`) */
static void attend_task(const float *q, int64_t i, int64_t h0, int64_t h1, int64_t Hq, int64_t D,
                        int64_t q_rs, const float *k, int64_t k_hs, const float *v, int64_t v_hs,
                        int64_t group, int64_t a, int64_t b, const int64_t *pos, int64_t ne, float scale,
                        float softcap, float *out, float *s) {
    const float *qs[ATT_HEADS], *ks[ATT_HEADS], *vs[ATT_HEADS];
    float *os[ATT_HEADS];
    for (int64_t h = h0; h < h1; h++) {
        const int64_t u = h - h0, g = h / group;
        qs[u] = q + i * q_rs + h * D;
        ks[u] = k + g * k_hs;
        vs[u] = v + g * v_hs;
        os[u] = out + (i * Hq + h) * D;
    }
    attend_heads((int)(h1 - h0), qs, ks, vs, a, b, pos, ne, D, scale, softcap, os, s);
}

void rakv_attend(const float *q, int64_t n, int64_t Hq, int64_t D, int64_t q_rs, const float *k,
                 int64_t k_hs, const float *v, int64_t v_hs, int64_t Hk, int64_t past, float scale,
                 float *out, int threads, int64_t window, float softcap) {
    const int64_t group = Hq / Hk, C = head_chunks(n, Hq, threads), tasks = n * C;
    #pragma omp parallel num_threads(threads)
    {
        float stack[ATT_STACK];
        const int64_t need = ATT_HEADS * (past + n);
        float *s = need <= ATT_STACK ? stack : (float *)malloc(sizeof(float) * need);
        #pragma omp for schedule(static)
        for (int64_t t = 0; t < tasks; t++) {
            const int64_t i = t / C, c = t % C, T = past + i + 1;
            const int64_t j0 = window > 0 && T > window ? T - window : 0;
            attend_task(q, i, c * Hq / C, (c + 1) * Hq / C, Hq, D, q_rs, k, k_hs, v, v_hs, group, j0, T,
                        NULL, 0, scale, softcap, out, s);
        }
        if (s != stack) free(s);
    }
}

/* ---- tree attention: n new query rows forming a token tree over a KV cache (a tree verify), fp32.

   Row i's tree ancestry is path[i * path_rs + 0 .. depth[i]]: the rows of its ancestors from the
   root (depth 0) down, ending with i itself; its keys are positions 0 .. past - 1 of the cache,
   then those rows (row r's key at cache position past + r), in that order. That is exactly the key
   sequence a decode step of the same token sees (the committed tokens, then the accepted path one
   token at a time), and each key is combined with attend's arithmetic in that order, so a tree
   row equals the decode step bit for bit. window > 0: the row sees only its last `window` keys
   (counted in positions: its own position is past + depth[i]). */
void rakv_attend_tree(const float *q, int64_t n, int64_t Hq, int64_t D, int64_t q_rs, const float *k,
                      int64_t k_hs, const float *v, int64_t v_hs, int64_t Hk, int64_t past, float scale,
                      float *out, int threads, int64_t window, float softcap, const int64_t *path,
                      int64_t path_rs, const int64_t *depth) {
    const int64_t group = Hq / Hk, C = head_chunks(n, Hq, threads), tasks = n * C;
    #pragma omp parallel num_threads(threads)
    {
        float stack[ATT_STACK];
        const int64_t need = ATT_HEADS * (past + n);
        float *s = need <= ATT_STACK ? stack : (float *)malloc(sizeof(float) * need);
        int64_t pos_stack[ATT_ROWS_MAX];
        int64_t *pos = n <= ATT_ROWS_MAX ? pos_stack : (int64_t *)malloc(sizeof(int64_t) * n);
        #pragma omp for schedule(static)
        for (int64_t t = 0; t < tasks; t++) {
            const int64_t i = t / C, c = t % C, T = past + depth[i] + 1;
            const int64_t j0 = window > 0 && T > window ? T - window : 0;
            const int64_t *anc = path + i * path_rs;
            int64_t ne = 0;
            for (int64_t jj = j0 > past ? j0 : past; jj < T; jj++) pos[ne++] = past + anc[jj - past];
            attend_task(q, i, c * Hq / C, (c + 1) * Hq / C, Hq, D, q_rs, k, k_hs, v, v_hs, group,
                        j0 < past ? j0 : past, past, pos, ne, scale, softcap, out, s);
        }
        if (pos != pos_stack) free(pos);
        if (s != stack) free(s);
    }
}

/* one linear layer's codes (rakv/kernels/blockq.py _LayerDesc) */
typedef struct {
    int64_t kind, N, K;    /* kind 4: Q4 codes, 8: Q8 codes, 9: Q8X codes */
    const uint8_t *qs;
    const float *d, *m;
    int64_t numerics;      /* 0: fp32 (the codes' exact weights, fp32 products), 1: q8 (below) */
    const uint8_t *isc;    /* K-quant scales or NULL: Q4 uint8 [N, K/32] (Q4_K's 6-bit scales), Q8X int8 [N, K/16] */
    const uint8_t *imn;    /* Q4: uint8 [N, K/32], Q4_K's 6-bit minimums */
    const float *dg, *mg;  /* [N, K/256]: d (and, Q4, -dmin) per super-block */
    /* K-quant codes under q8 numerics: the same codes and scales tiled by 16 outputs (T = N / 16
       rounded up, zero past N), the "tiled K-quant" form below; NULL otherwise */
    const uint8_t *tq;     /* Q4: [T, K/32, 4, 16, 4] bytes (byte i of quad v of output j: inputs 4v + i,
                              low nibble, and 16 + 4v + i, high); Q8X: [T, K/16, 4, 16, 4] codes */
    const uint8_t *tsc;    /* Q4: uint8 [T, K/32, 16]; Q8X: int8 [T, K/16, 16] */
    const int16_t *tmn;    /* Q4: int16 [T, K/64 rounded up, 16, 2]: lane j's minimums of blocks 2p, 2p + 1 */
    const float *tdg, *tmg;  /* [T, K/256, 16] */
} rakv_layer;

/* ---- q8 numerics: integer dot products of 8-bit activation groups with the weight codes

   `--numerics q8` (llama.cpp's kind of arithmetic). Each row of x is quantized on its own, group by
   group of 256 inputs (as llama.cpp's Q8_K; the last group of a row may be shorter, whole blocks of
   32): dx = max_j |x_j| / 127 over the group, xq_j = round-half-even(x_j * (1 / dx)) (0 where dx = 0),
   so |xq_j| <= 127. Then every (row, block of 32) dot product of the codes q with xq is an exact int32
   sum, and only the scales are floating point:

     Q4:  y = sum_b D_b dx (q . xq)_b + sum_b M_b dx (sum xq)_b                (D, M per 32 inputs)
     Q8:  y = sum_b D_b dx ((q + 128) . xq)_b - sum_b D_b 128 dx (sum xq)_b     (q signed; exact)
     Q8X: y = sum_h D_h dx (q . xq)_h + sum_h M_h dx (sum xq)_h                 (D, M per 16 inputs)

   The order, fixed whatever the number of rows, threads or build (portable C, AVX-512 VNNI): the
   integer sums are taken in 16 lanes of 4 consecutive inputs each, two blocks b = 2p, 2p + 1 at a
   time ("pair" p; the second block is absent, all zero, when the row has an odd number of blocks):
     Q4 lanes:  0-3 block 2p inputs 0-15, 4-7 block 2p+1 inputs 0-15, 8-11 block 2p inputs 16-31,
                12-15 block 2p+1 inputs 16-31 (the nibble layout of the codes);
     Q8, Q8X:   0-7 block 2p inputs 0-31, 8-15 block 2p+1 inputs 0-31 (in order, 4 a lane).
   Per group, lane l: t_l = t_l + (float)P_l * D_l pair after pair (a product, then a sum: no fma),
   D_l the weights' scale of lane l's inputs; then acc_l = acc_l + t_l * dx. The offsets: lane
   (g mod 16) of a second register adds M_g * u_g in order of g (g a block for Q4 and Q8, M = D and
   u_g = -128 dx (sum of g's xq) for Q8; a group of 16 inputs for Q8X; u_g = dx (sum of g's xq)
   otherwise, computed once per row). y = tree16(acc) + tree16(off) (+ bias). A verify row is
   therefore the decode step's row bit for bit, and tests/q8_reference.py computes the same sums in
   plain torch. */

#define QGROUP 8         /* blocks of 32 per activation group (256 inputs) */
#define Q8ACT_ROWS 12    /* rows sharing one pass over the codes (a verify of up to k = 11 reads them once) */

typedef struct {
    int8_t *xa;          /* [np * 64] Q4 lane layout (above), zero for an absent block */
    int8_t *xb;          /* [np * 64] inputs in order, two blocks a pair */
    float *dx;           /* [ngroups] */
    float *u32, *v8, *u16;  /* [nb16], [nb16], [2 nb16 rounded]: per-block / per-16 offset factors */
    int32_t *s32, *s16;  /* [nb16], [2 nb16 rounded]: the sum of xq per block of 32, and 32 x the sum per 16 */
    int32_t *s32p;       /* [np rounded]: s32 of blocks 2p, 2p + 1 as two int16 (|s32| <= 32 x 127), 0 if absent */
} qrow;

static inline int64_t round16(int64_t n) { return (n + 15) / 16 * 16; }

static size_t qrow_bytes(int64_t nb) {
    const int64_t np = (nb + 1) / 2, ng = (nb + QGROUP - 1) / QGROUP;
    return (size_t)(np * 64 * 2 + round16(ng) * 4 + round16(nb) * 12 + round16(2 * nb) * 8 + round16(np) * 4 + 64 * 9);
}

static qrow qrow_at(char *base, int64_t nb) {
    const int64_t np = (nb + 1) / 2, ng = (nb + QGROUP - 1) / QGROUP;
    qrow r;
    char *p = (char *)(((uintptr_t)base + 63) / 64 * 64);
    r.xa = (int8_t *)p; p += np * 64;
    r.xb = (int8_t *)p; p += np * 64;
    r.dx = (float *)p; p += (round16(ng) * 4 + 63) / 64 * 64;
    r.u32 = (float *)p; p += (round16(nb) * 4 + 63) / 64 * 64;
    r.v8 = (float *)p; p += (round16(nb) * 4 + 63) / 64 * 64;
    r.u16 = (float *)p; p += (round16(2 * nb) * 4 + 63) / 64 * 64;
    r.s32 = (int32_t *)p; p += (round16(nb) * 4 + 63) / 64 * 64;
    r.s16 = (int32_t *)p; p += (round16(2 * nb) * 4 + 63) / 64 * 64;
    r.s32p = (int32_t *)p;
    return r;
}

/* quantize one row x [K] into r (the layouts above) */
static void quantize_row(const float *x, int64_t K, qrow *r) {
    const int64_t nb = K / BLK, np = (nb + 1) / 2;
    memset(r->xa, 0, np * 64);
    memset(r->xb, 0, np * 64);
    memset(r->u32, 0, round16(nb) * 4);
    memset(r->v8, 0, round16(nb) * 4);
    memset(r->u16, 0, round16(2 * nb) * 4);
    for (int64_t g0 = 0; g0 < nb; g0 += QGROUP) {
        const int64_t g1 = g0 + QGROUP < nb ? g0 + QGROUP : nb;
        float amax = 0.0f;
        for (int64_t j = g0 * BLK; j < g1 * BLK; j++) {
            const float a = fabsf(x[j]);
            amax = a > amax ? a : amax;
        }
        const float dx = amax / 127.0f, id = dx != 0.0f ? 1.0f / dx : 0.0f;
        r->dx[g0 / QGROUP] = dx;
        for (int64_t b = g0; b < g1; b++) {
            int8_t q[BLK];
            int32_t s16[2] = {0, 0};
            for (int j = 0; j < BLK; j++) {
                const float v = nearbyintf(x[b * BLK + j] * id);
                q[j] = (int8_t)(v > 127.0f ? 127 : (v < -127.0f ? -127 : (int)v));
                s16[j / 16] += q[j];
            }
            const int64_t p = b / 2, h = b % 2;
            memcpy(r->xa + p * 64 + h * 16, q, 16);
            memcpy(r->xa + p * 64 + 32 + h * 16, q + 16, 16);
            memcpy(r->xb + p * 64 + h * 32, q, BLK);
            r->u32[b] = dx * (float)(s16[0] + s16[1]);
            r->v8[b] = -128.0f * r->u32[b];
            r->u16[2 * b] = dx * (float)s16[0];
            r->u16[2 * b + 1] = dx * (float)s16[1];
            r->s32[b] = s16[0] + s16[1];
            r->s16[2 * b] = 32 * s16[0];
            r->s16[2 * b + 1] = 32 * s16[1];
        }
    }
    for (int64_t p = 0; p < np; p++) {
        const int32_t hi = 2 * p + 1 < nb ? r->s32[2 * p + 1] : 0;
        r->s32p[p] = (int32_t)(((uint32_t)(uint16_t)(int16_t)hi << 16) | (uint16_t)(int16_t)r->s32[2 * p]);
    }
}

/* scale D of block b (Q4, Q8) or of group of 16 h (Q8X) of output n: d, or with K-quant scales
   dg sc (the same float: a float16 times a small integer, exact), and offset M (mg mn; -32 D) */
static inline float scale_of(const rakv_layer *L, int64_t nb, int64_t n, int64_t i) {
    if (!L->isc) return L->d[n * (L->kind == 9 ? 2 * nb : nb) + i];
    const int64_t ng = (nb + QGROUP - 1) / QGROUP;
    if (L->kind == 9) return L->dg[n * ng + i / (2 * QGROUP)] * (float)((const int8_t *)L->isc)[n * 2 * nb + i];
    return L->dg[n * ng + i / QGROUP] * (float)L->isc[n * nb + i];
}

static inline float offset_of(const rakv_layer *L, int64_t nb, int64_t n, int64_t i) {
    if (L->kind == 8) return L->d[n * nb + i];
    if (!L->isc) return L->m[n * (L->kind == 9 ? 2 * nb : nb) + i];
    if (L->kind == 9) return -32.0f * scale_of(L, nb, n, i);
    const int64_t ng = (nb + QGROUP - 1) / QGROUP;
    return L->mg[n * ng + i / QGROUP] * (float)L->imn[n * nb + i];
}

/* the weights' scale of each lane of pair p of output row n */
static inline void lane_scales(const rakv_layer *L, int64_t nb, int64_t n, int64_t p, float D[16]) {
    const int kind = (int)L->kind;
    const int64_t b = 2 * p;
    const int two = b + 1 < nb;
    if (kind == 9) {
        for (int l = 0; l < 16; l++) D[l] = (l >= 8 && !two) ? 0.0f : scale_of(L, nb, n, 2 * b + l / 4);
    } else {
        const float d0 = scale_of(L, nb, n, b), d1 = two ? scale_of(L, nb, n, b + 1) : 0.0f;
        for (int l = 0; l < 16; l++) D[l] = (kind == 4 ? (l / 4) % 2 : l / 8) ? d1 : d0;
    }
}

/* the integer lane sums of pair p of output n against row r (Q8's codes + 128) */
static inline void lane_sums(int kind, const uint8_t *qs, int64_t nb, int64_t n, int64_t p, const qrow *r,
                             int32_t P[16]) {
    const int64_t b = 2 * p;
    const int two = b + 1 < nb;
    int w[64];
    memset(w, 0, sizeof(w));
    const int8_t *x = (kind == 4 ? r->xa : r->xb) + p * 64;
    for (int h = 0; h < 1 + two; h++) {
        if (kind == 4) {
            const uint8_t *c = qs + (n * nb + b + h) * (BLK / 2);
            for (int j = 0; j < 16; j++) {
                w[h * 16 + j] = c[j] & 15;
                w[32 + h * 16 + j] = c[j] >> 4;
            }
        } else {
            const uint8_t *c = qs + (n * nb + b + h) * BLK;
            for (int j = 0; j < BLK; j++) w[h * 32 + j] = kind == 8 ? (int)(int8_t)c[j] + 128 : (int)c[j];
        }
    }
    for (int l = 0; l < 16; l++) {
        int32_t s = 0;
        for (int t = 0; t < 4; t++) s += w[4 * l + t] * x[4 * l + t];
        P[l] = s;
    }
}

/* the offsets' sum of output n for row r */
static inline float offsets_sum(const rakv_layer *L, int64_t nb, int64_t n, const qrow *r) {
    const int kind = (int)L->kind;
    const int64_t G = kind == 9 ? 2 * nb : nb;
    const float *u = kind == 4 ? r->u32 : (kind == 8 ? r->v8 : r->u16);
    if (L->isc) {               /* K-quant scales: the offsets made here, lane by lane as below */
        float off[16] = {0};
        for (int64_t g = 0; g < G; g++) off[g % 16] = off[g % 16] + offset_of(L, nb, n, g) * u[g];
        return tree16(off);
    }
    const float *mg = (kind == 8 ? L->d : L->m) + n * G;
#ifdef RAKV_AVX512
    __m512 off = _mm512_setzero_ps();
    int64_t g = 0;
    for (; g + 16 <= G; g += 16)
        off = _mm512_add_ps(off, _mm512_mul_ps(_mm512_loadu_ps(mg + g), _mm512_loadu_ps(u + g)));
    if (g < G) {
        const __mmask16 k = (__mmask16)((1u << (G - g)) - 1);
        off = _mm512_add_ps(off, _mm512_mul_ps(_mm512_maskz_loadu_ps(k, mg + g), _mm512_maskz_loadu_ps(k, u + g)));
    }
    return tree_reg(off);
#else
    float off[16] = {0};
    for (int64_t g = 0; g < G; g++) off[g % 16] = off[g % 16] + mg[g] * u[g];
    return tree16(off);
#endif
}

#if defined(RAKV_AVX512) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define RAKV_VNNI 1
/* pair p of output n as 64 code bytes in its lane layout (Q8: + 128, unsigned) */
static inline __attribute__((always_inline)) __m512i pair_codes(int kind, const uint8_t *qs, int64_t nb, int64_t n,
                                                                int64_t p) {
    const int64_t b = 2 * p;
    const int two = b + 1 < nb;
    if (kind == 4) {
        const uint8_t *c = qs + (n * nb + b) * (BLK / 2);
        const __m256i v = two ? _mm256_loadu_si256((const __m256i *)c)
                              : _mm256_zextsi128_si256(_mm_loadu_si128((const __m128i *)c));
        const __m256i lo = _mm256_and_si256(v, _mm256_set1_epi8(15));
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(15));
        return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
    }
    const uint8_t *c = qs + (n * nb + b) * BLK;
    __m512i w = two ? _mm512_loadu_si512((const void *)c) : _mm512_maskz_loadu_epi8(0xFFFFFFFFull, c);
    if (kind == 8) w = _mm512_maskz_xor_epi32(two ? 0xFFFF : 0x00FF, w, _mm512_set1_epi8((char)0x80));
    return w;
}

static inline __attribute__((always_inline)) __m512 pair_scales(int kind, int compact, const rakv_layer *L,
                                                               int64_t nb, int64_t n, int64_t p) {
    const int64_t b = 2 * p;
    const int two = b + 1 < nb;
    const float *d = L->d;
    if (compact) {              /* dg sc: the pair lies in one super-block */
        const int64_t ng = (nb + QGROUP - 1) / QGROUP;
        const __m128 dg = _mm_set1_ps(L->dg[n * ng + b / QGROUP]);
        __m128 sc;
        if (kind == 9) {
            const int8_t *c = (const int8_t *)L->isc + n * 2 * nb + 2 * b;
            int32_t w4;
            memcpy(&w4, c, two ? 4 : 2);
            if (!two) w4 &= 0xFFFF;
            sc = _mm_cvtepi32_ps(_mm_cvtepi8_epi32(_mm_cvtsi32_si128(w4)));
        } else {
            const uint8_t *c = L->isc + n * nb + b;
            const int32_t w2 = two ? (int32_t)c[0] | ((int32_t)c[1] << 8) : (int32_t)c[0];
            sc = _mm_cvtepi32_ps(_mm_cvtepu8_epi32(_mm_cvtsi32_si128(w2)));
        }
        const __m512i idx = kind == 9 ? _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0)
                          : kind == 4 ? _mm512_set_epi32(1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0)
                                      : _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
        return _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(_mm_mul_ps(dg, sc)));
    }
    if (kind == 9) {
        const __m128 g = two ? _mm_loadu_ps(d + n * 2 * nb + 2 * b)
                             : _mm_castpd_ps(_mm_load_sd((const double *)(d + n * 2 * nb + 2 * b)));
        const __m512i idx = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
        return _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(g));
    }
    const __m128 g = two ? _mm_castpd_ps(_mm_load_sd((const double *)(d + n * nb + b)))
                         : _mm_load_ss(d + n * nb + b);
    const __m512i idx = kind == 4 ? _mm512_set_epi32(1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0)
                                  : _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    return _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(g));
}

/* MR rows of output n: y[r * N + n] */
static inline __attribute__((always_inline)) void q8act_out(int kind, int compact, int MR, const rakv_layer *L,
                                                            int64_t nb, int64_t n, const qrow *rows,
                                                            float *y, int64_t N, const float *bias) {
    const int64_t np = (nb + 1) / 2;
    const uint8_t *qs = L->qs;
    __m512 acc[Q8ACT_ROWS], t[Q8ACT_ROWS];
    for (int r = 0; r < MR; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t p0 = 0; p0 < np; p0 += QGROUP / 2) {
        const int64_t p1 = p0 + QGROUP / 2 < np ? p0 + QGROUP / 2 : np;
        for (int r = 0; r < MR; r++) t[r] = _mm512_setzero_ps();
        for (int64_t p = p0; p < p1; p++) {
            const __m512i w = pair_codes(kind, qs, nb, n, p);
            const __m512 D = pair_scales(kind, compact, L, nb, n, p);
            for (int r = 0; r < MR; r++) {
                const __m512i x = _mm512_load_si512((const void *)((kind == 4 ? rows[r].xa : rows[r].xb) + p * 64));
                const __m512i P = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, x);
                t[r] = _mm512_add_ps(t[r], _mm512_mul_ps(_mm512_cvtepi32_ps(P), D));
            }
        }
        for (int r = 0; r < MR; r++)
            acc[r] = _mm512_add_ps(acc[r], _mm512_mul_ps(t[r], _mm512_set1_ps(rows[r].dx[p0 / (QGROUP / 2)])));
    }
    /* the offsets: 16 at a time, each chunk's M made once for all the rows (lane g mod 16 as above) */
    __m512 off[Q8ACT_ROWS];
    for (int r = 0; r < MR; r++) off[r] = _mm512_setzero_ps();
    const int64_t G = kind == 9 ? 2 * nb : nb, ng = (nb + QGROUP - 1) / QGROUP;
    for (int64_t g = 0; g < G; g += 16) {
        const __mmask16 k = G - g >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (G - g)) - 1);
        __m512 Mv;
        if (!compact) {
            Mv = _mm512_maskz_loadu_ps(k, (kind == 8 ? L->d : L->m) + n * G + g);
        } else if (kind == 4) {       /* mg mn: blocks g .. g + 15 lie in super-blocks g / 8 and g / 8 + 1 */
            const __m512 mn = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(k, L->imn + n * nb + g)));
            const float m0 = L->mg[n * ng + g / QGROUP];
            const float m1 = g / QGROUP + 1 < ng ? L->mg[n * ng + g / QGROUP + 1] : 0.0f;
            Mv = _mm512_mul_ps(_mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(m0), _mm512_set1_ps(m1)), mn);
        } else {                      /* -32 dg sc: 16 groups of 16 are one super-block */
            const __m512 sc = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                _mm_maskz_loadu_epi8(k, (const int8_t *)L->isc + n * 2 * nb + g)));
            Mv = _mm512_mul_ps(_mm512_set1_ps(-32.0f), _mm512_mul_ps(_mm512_set1_ps(L->dg[n * ng + g / 16]), sc));
        }
        for (int r = 0; r < MR; r++) {
            const float *u = kind == 4 ? rows[r].u32 : (kind == 8 ? rows[r].v8 : rows[r].u16);
            off[r] = _mm512_add_ps(off[r], _mm512_mul_ps(Mv, _mm512_maskz_loadu_ps(k, u + g)));
        }
    }
    for (int r = 0; r < MR; r++) {
        float v = tree_reg(acc[r]) + tree_reg(off[r]);
        if (bias) v += bias[n];
        y[r * N + n] = v;
    }
}
#else
/* every other build: the same integer lane sums and the same float operations, lane by lane */
static inline void q8act_out(int kind, int compact, int MR, const rakv_layer *L, int64_t nb,
                             int64_t n, const qrow *rows, float *y, int64_t N, const float *bias) {
    const int64_t np = (nb + 1) / 2;
    const uint8_t *qs = L->qs;
    (void)compact;
    float acc[Q8ACT_ROWS][16], t[Q8ACT_ROWS][16];
    memset(acc, 0, sizeof(acc));
    for (int64_t p0 = 0; p0 < np; p0 += QGROUP / 2) {
        const int64_t p1 = p0 + QGROUP / 2 < np ? p0 + QGROUP / 2 : np;
        memset(t, 0, sizeof(t));
        for (int64_t p = p0; p < p1; p++) {
            float D[16];
            lane_scales(L, nb, n, p, D);
            for (int r = 0; r < MR; r++) {
                int32_t P[16];
                lane_sums(kind, qs, nb, n, p, rows + r, P);
                for (int l = 0; l < 16; l++) t[r][l] = t[r][l] + (float)P[l] * D[l];
            }
        }
        for (int r = 0; r < MR; r++) {
            const float dx = rows[r].dx[p0 / (QGROUP / 2)];
            for (int l = 0; l < 16; l++) acc[r][l] = acc[r][l] + t[r][l] * dx;
        }
    }
    for (int r = 0; r < MR; r++) {
        float v = tree16(acc[r]) + offsets_sum(L, nb, n, rows + r);
        if (bias) v += bias[n];
        y[r * N + n] = v;
    }
}
#endif


#define Q8ACT_CASE(KIND, C, MR) case ((KIND) * 2 + (C)) * 16 + (MR): \
    { for (int64_t n = n0; n < n1; n++) q8act_out(KIND, C, MR, L, nb, n, rows, y, N, bias); } break;
#define Q8ACT_KIND(KIND, C) Q8ACT_CASE(KIND, C, 1) Q8ACT_CASE(KIND, C, 2) Q8ACT_CASE(KIND, C, 3) \
    Q8ACT_CASE(KIND, C, 4) Q8ACT_CASE(KIND, C, 5) Q8ACT_CASE(KIND, C, 6) Q8ACT_CASE(KIND, C, 7) Q8ACT_CASE(KIND, C, 8) \
    Q8ACT_CASE(KIND, C, 9) Q8ACT_CASE(KIND, C, 10) Q8ACT_CASE(KIND, C, 11) Q8ACT_CASE(KIND, C, 12)

static void q8act_range(const rakv_layer *L, int mr, int64_t nb, int64_t n0, int64_t n1, const qrow *rows,
                        float *y, int64_t N, const float *bias) {
    const int compact = L->isc != NULL && L->kind != 8;
    switch (((int)L->kind * 2 + compact) * 16 + mr) {
        Q8ACT_KIND(4, 0) Q8ACT_KIND(8, 0) Q8ACT_KIND(9, 0) Q8ACT_KIND(4, 1) Q8ACT_KIND(9, 1)
        default: break;
    }
}

/* ---- q8 numerics on tiled K-quant codes (Q4_K, Q6_K: the codes with the file's integer scales)

   Outputs go 16 at a time (a tile; one output a lane). For row r and output n, every block b of 32
   inputs (Q4) or group h of 16 (Q8X) gives an exact integer I = sum q xq; the super-block g (256
   inputs, the row's activation group) then gives exact integers

     Q4:  S_g = sum_b sc_b I_b,              O_g = sum_b mn_b (sum of b's xq)
     Q8X: S_g = sum_h sc_h (I_h - 32 (sum of h's xq))       (Q6_K's codes are q + 32)

   and only then floats, super-block after super-block, in this order:
     acc = acc + ((float)S_g * dg_g) * dx_g;   off = off + ((float)O_g * mg_g) * dx_g   (Q4)
   y = acc + off (Q4) or acc (Q8X), + bias. Every integer is exact whatever the order it is summed
   in, so this build, the portable one and tests/q8_reference.py give the same bits, and a row's
   output does not depend on the rows beside it or the threads. */

#define TILE 16
#ifndef PF_AHEAD
#define PF_AHEAD 2048    /* bytes of codes prefetched ahead of the pass (the next blocks of the tile, or the next tile) */
#endif
#define TROWS 9          /* rows sharing one pass over a tile's codes (tiled_range has cases up to 9) */

#if defined(RAKV_VNNI)
static inline __attribute__((always_inline)) __m512i bcast32(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}

/* I[r]: the exact sums of block b's tiled Q4 codes (4 quads of nibbles at c) with row r's xq */
static inline __attribute__((always_inline)) void q4_sums(int R, const uint8_t *c, const qrow *rows, int64_t b,
                                                          __m512i *I) {
    const __m512i low = _mm512_set1_epi8(15);
    for (int r = 0; r < R; r++) I[r] = _mm512_setzero_si512();
    for (int v = 0; v < 4; v++) {
        const __m512i raw = _mm512_loadu_si512((const void *)(c + 64 * v));
        const __m512i lo = _mm512_and_si512(raw, low);
        const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);
        for (int r = 0; r < R; r++) {
            const int8_t *xq = rows[r].xb + b * BLK;
            I[r] = _mm512_dpbusd_epi32(I[r], lo, bcast32(xq + 4 * v));
            I[r] = _mm512_dpbusd_epi32(I[r], hi, bcast32(xq + 16 + 4 * v));
        }
    }
}

static inline __attribute__((always_inline)) void tiled_q4(int R, const rakv_layer *L, int64_t nb, int64_t t,
                                                           const qrow *rows, float *y, int64_t N, const float *bias) {
    const int64_t ng = (nb + QGROUP - 1) / QGROUP, np = (nb + 1) / 2;
    __attribute__((aligned(64))) float acc[TROWS][TILE], off[TROWS][TILE];   /* in L1: touched once a super-block */
    for (int r = 0; r < R; r++) {
        _mm512_store_ps(acc[r], _mm512_setzero_ps());
        _mm512_store_ps(off[r], _mm512_setzero_ps());
    }
    for (int64_t g = 0; g < ng; g++) {
        __m512i S[TROWS];
        for (int r = 0; r < R; r++) S[r] = _mm512_setzero_si512();
        const int64_t b0 = g * QGROUP, b1 = (g + 1) * QGROUP < nb ? (g + 1) * QGROUP : nb;
        for (int64_t b = b0; b < b1; b++) {
            __m512i I[TROWS];
            const uint8_t *pf = L->tq + (t * nb + b) * 256 + PF_AHEAD;
            for (int i = 0; i < 4; i++) _mm_prefetch((const char *)pf + 64 * i, _MM_HINT_T0);
            q4_sums(R, L->tq + (t * nb + b) * 256, rows, b, I);
            const __m512i sc = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(L->tsc + (t * nb + b) * TILE)));
            for (int r = 0; r < R; r++) S[r] = _mm512_add_epi32(S[r], _mm512_mullo_epi32(I[r], sc));
        }
        const __m512 dg = _mm512_loadu_ps(L->tdg + (t * ng + g) * TILE);
        const __m512 mg = _mm512_loadu_ps(L->tmg + (t * ng + g) * TILE);
        for (int r = 0; r < R; r++) {
            __m512i O = _mm512_setzero_si512();      /* sum_b mn_b (sum of b's xq), two blocks an instruction */
            for (int64_t p = b0 / 2; p < (b1 + 1) / 2; p++)
                O = _mm512_dpwssd_epi32(O, _mm512_loadu_si512((const void *)(L->tmn + (t * np + p) * 2 * TILE)),
                                        _mm512_set1_epi32(rows[r].s32p[p]));
            const __m512 dx = _mm512_set1_ps(rows[r].dx[g]);
            _mm512_store_ps(acc[r], _mm512_add_ps(_mm512_load_ps(acc[r]),
                                                  _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(S[r]), dg), dx)));
            _mm512_store_ps(off[r], _mm512_add_ps(_mm512_load_ps(off[r]),
                                                  _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(O), mg), dx)));
        }
    }
    const int64_t n0 = t * TILE;
    const __mmask16 k = N - n0 >= TILE ? (__mmask16)0xFFFF : (__mmask16)((1u << (N - n0)) - 1);
    for (int r = 0; r < R; r++) {
        __m512 v = _mm512_add_ps(_mm512_load_ps(acc[r]), _mm512_load_ps(off[r]));
        if (bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(k, bias + n0));
        _mm512_mask_storeu_ps(y + r * N + n0, k, v);
    }
}

static inline __attribute__((always_inline)) void tiled_q8x(int R, const rakv_layer *L, int64_t nb, int64_t t,
                                                            const qrow *rows, float *y, int64_t N, const float *bias) {
    const int64_t ng = (nb + QGROUP - 1) / QGROUP, nh = 2 * nb;
    __attribute__((aligned(64))) float acc[TROWS][TILE];      /* in L1: touched once a super-block */
    for (int r = 0; r < R; r++) _mm512_store_ps(acc[r], _mm512_setzero_ps());
    for (int64_t g = 0; g < ng; g++) {
        __m512i S[TROWS];
        for (int r = 0; r < R; r++) S[r] = _mm512_setzero_si512();
        const int64_t h1 = (g + 1) * 2 * QGROUP < nh ? (g + 1) * 2 * QGROUP : nh;
        for (int64_t h = g * 2 * QGROUP; h < h1; h++) {
            const uint8_t *c = L->tq + (t * nh + h) * 256;
            for (int i = 0; i < 4; i++) _mm_prefetch((const char *)c + PF_AHEAD + 64 * i, _MM_HINT_T0);
            __m512i I[TROWS];
            for (int r = 0; r < R; r++) I[r] = _mm512_set1_epi32(-rows[r].s16[h]);
            for (int v = 0; v < 4; v++) {
                const __m512i w = _mm512_loadu_si512((const void *)(c + 64 * v));
                for (int r = 0; r < R; r++) I[r] = _mm512_dpbusd_epi32(I[r], w, bcast32(rows[r].xb + h * 16 + 4 * v));
            }
            const __m512i sc = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(L->tsc + (t * nh + h) * TILE)));
            for (int r = 0; r < R; r++) S[r] = _mm512_add_epi32(S[r], _mm512_mullo_epi32(I[r], sc));
        }
        const __m512 dg = _mm512_loadu_ps(L->tdg + (t * ng + g) * TILE);
        for (int r = 0; r < R; r++)
            _mm512_store_ps(acc[r], _mm512_add_ps(_mm512_load_ps(acc[r]), _mm512_mul_ps(_mm512_mul_ps(
                _mm512_cvtepi32_ps(S[r]), dg), _mm512_set1_ps(rows[r].dx[g]))));
    }
    const int64_t n0 = t * TILE;
    const __mmask16 k = N - n0 >= TILE ? (__mmask16)0xFFFF : (__mmask16)((1u << (N - n0)) - 1);
    for (int r = 0; r < R; r++) {
        __m512 v = _mm512_load_ps(acc[r]);
        if (bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(k, bias + n0));
        _mm512_mask_storeu_ps(y + r * N + n0, k, v);
    }
}

/* Q4 and Q8 codes with a float scale per block (Q4_0, Q4_1, Q5_0, Q8_0 ...): I_b exact, then per
   super-block t = t + (float)I_b * d_b block after block, acc = acc + t * dx; Q4's offsets
   off = off + m_b * u_b block after block (u_b = dx (float)(sum of b's xq), the row's) */
static inline __attribute__((always_inline)) void tiled_fb(int kind, int R, const rakv_layer *L, int64_t nb,
                                                           int64_t t, const qrow *rows, float *y, int64_t N,
                                                           const float *bias) {
    const int64_t ng = (nb + QGROUP - 1) / QGROUP;
    __attribute__((aligned(64))) float acc[TROWS][TILE], off[TROWS][TILE];   /* in L1 */
    for (int r = 0; r < R; r++) {
        _mm512_store_ps(acc[r], _mm512_setzero_ps());
        _mm512_store_ps(off[r], _mm512_setzero_ps());
    }
    for (int64_t g = 0; g < ng; g++) {
        __m512 tt[TROWS];
        for (int r = 0; r < R; r++) tt[r] = _mm512_setzero_ps();
        const int64_t b1 = (g + 1) * QGROUP < nb ? (g + 1) * QGROUP : nb;
        for (int64_t b = g * QGROUP; b < b1; b++) {
            __m512i I[TROWS];
            if (kind == 4) {
                const uint8_t *pf = L->tq + (t * nb + b) * 256 + PF_AHEAD;
                for (int i = 0; i < 4; i++) _mm_prefetch((const char *)pf + 64 * i, _MM_HINT_T0);
                q4_sums(R, L->tq + (t * nb + b) * 256, rows, b, I);
            } else {
                const uint8_t *c = L->tq + (t * nb + b) * 512;
                for (int i = 0; i < 8; i++) _mm_prefetch((const char *)c + PF_AHEAD + 64 * i, _MM_HINT_T0);
                for (int r = 0; r < R; r++) I[r] = _mm512_set1_epi32(-128 * rows[r].s32[b]);
                for (int v = 0; v < 8; v++) {
                    const __m512i w = _mm512_loadu_si512((const void *)(c + 64 * v));
                    for (int r = 0; r < R; r++) I[r] = _mm512_dpbusd_epi32(I[r], w, bcast32(rows[r].xb + b * BLK + 4 * v));
                }
            }
            const __m512 d = _mm512_loadu_ps(L->tdg + (t * nb + b) * TILE);
            for (int r = 0; r < R; r++) tt[r] = _mm512_add_ps(tt[r], _mm512_mul_ps(_mm512_cvtepi32_ps(I[r]), d));
            if (kind == 4) {
                const __m512 m = _mm512_loadu_ps(L->tmg + (t * nb + b) * TILE);
                for (int r = 0; r < R; r++)
                    _mm512_store_ps(off[r], _mm512_add_ps(_mm512_load_ps(off[r]), _mm512_mul_ps(m, _mm512_set1_ps(rows[r].u32[b]))));
            }
        }
        for (int r = 0; r < R; r++)
            _mm512_store_ps(acc[r], _mm512_add_ps(_mm512_load_ps(acc[r]), _mm512_mul_ps(tt[r], _mm512_set1_ps(rows[r].dx[g]))));
    }
    const int64_t n0 = t * TILE;
    const __mmask16 k = N - n0 >= TILE ? (__mmask16)0xFFFF : (__mmask16)((1u << (N - n0)) - 1);
    for (int r = 0; r < R; r++) {
        __m512 v = kind == 4 ? _mm512_add_ps(_mm512_load_ps(acc[r]), _mm512_load_ps(off[r])) : _mm512_load_ps(acc[r]);
        if (bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(k, bias + n0));
        _mm512_mask_storeu_ps(y + r * N + n0, k, v);
    }
}
static inline __attribute__((always_inline)) void tiled_q4f(int R, const rakv_layer *L, int64_t nb, int64_t t,
                                                            const qrow *rows, float *y, int64_t N, const float *bias) {
    tiled_fb(4, R, L, nb, t, rows, y, N, bias);
}
static inline __attribute__((always_inline)) void tiled_q8f(int R, const rakv_layer *L, int64_t nb, int64_t t,
                                                            const qrow *rows, float *y, int64_t N, const float *bias) {
    tiled_fb(8, R, L, nb, t, rows, y, N, bias);
}
#else
/* the portable form: the same integers, the same float operations lane by lane */
static void tiled_any(int kind, int R, const rakv_layer *L, int64_t nb, int64_t t, const qrow *rows,
                      float *y, int64_t N, const float *bias) {
    const int64_t ng = (nb + QGROUP - 1) / QGROUP, nh = 2 * nb;
    if (!L->tsc) {              /* a float scale per block (Q4 with offsets, Q8) */
        for (int r = 0; r < R; r++) {
            float acc[TILE] = {0}, off[TILE] = {0};
            for (int64_t g = 0; g < ng; g++) {
                float tt[TILE] = {0};
                const int64_t b1 = (g + 1) * QGROUP < nb ? (g + 1) * QGROUP : nb;
                for (int64_t b = g * QGROUP; b < b1; b++) {
                    const int8_t *xq = rows[r].xb + b * BLK;
                    for (int j = 0; j < TILE; j++) {
                        int32_t I = 0;
                        if (kind == 4) {
                            const uint8_t *c = L->tq + (t * nb + b) * 256;
                            for (int v = 0; v < 4; v++)
                                for (int i = 0; i < 4; i++) {
                                    const uint8_t q = c[64 * v + 4 * j + i];
                                    I += (q & 15) * xq[4 * v + i] + (q >> 4) * xq[16 + 4 * v + i];
                                }
                        } else {
                            const uint8_t *c = L->tq + (t * nb + b) * 512;
                            I = -128 * rows[r].s32[b];
                            for (int v = 0; v < 8; v++)
                                for (int i = 0; i < 4; i++) I += c[64 * v + 4 * j + i] * xq[4 * v + i];
                        }
                        tt[j] = tt[j] + (float)I * L->tdg[(t * nb + b) * TILE + j];
                        if (kind == 4) off[j] = off[j] + L->tmg[(t * nb + b) * TILE + j] * rows[r].u32[b];
                    }
                }
                const float dx = rows[r].dx[g];
                for (int j = 0; j < TILE; j++) acc[j] = acc[j] + tt[j] * dx;
            }
            for (int j = 0; j < TILE && t * TILE + j < N; j++) {
                float v = kind == 4 ? acc[j] + off[j] : acc[j];
                if (bias) v += bias[t * TILE + j];
                y[r * N + t * TILE + j] = v;
            }
        }
        return;
    }
    for (int r = 0; r < R; r++) {
        float acc[TILE] = {0}, off[TILE] = {0};
        for (int64_t g = 0; g < ng; g++) {
            int32_t S[TILE] = {0}, O[TILE] = {0};
            if (kind == 4) {
                const int64_t b1 = (g + 1) * QGROUP < nb ? (g + 1) * QGROUP : nb;
                for (int64_t b = g * QGROUP; b < b1; b++) {
                    const uint8_t *c = L->tq + (t * nb + b) * 256;
                    const int8_t *xq = rows[r].xb + b * BLK;
                    for (int j = 0; j < TILE; j++) {
                        int32_t I = 0;
                        for (int v = 0; v < 4; v++)
                            for (int i = 0; i < 4; i++) {
                                const uint8_t q = c[64 * v + 4 * j + i];
                                I += (q & 15) * xq[4 * v + i] + (q >> 4) * xq[16 + 4 * v + i];
                            }
                        S[j] += (int32_t)L->tsc[(t * nb + b) * TILE + j] * I;
                        O[j] += (int32_t)L->tmn[((t * ((nb + 1) / 2) + b / 2) * TILE + j) * 2 + b % 2] * rows[r].s32[b];
                    }
                }
            } else {
                const int64_t h1 = (g + 1) * 2 * QGROUP < nh ? (g + 1) * 2 * QGROUP : nh;
                for (int64_t h = g * 2 * QGROUP; h < h1; h++) {
                    const uint8_t *c = L->tq + (t * nh + h) * 256;
                    const int8_t *xq = rows[r].xb + h * 16;
                    for (int j = 0; j < TILE; j++) {
                        int32_t I = -rows[r].s16[h];
                        for (int v = 0; v < 4; v++)
                            for (int i = 0; i < 4; i++) I += c[64 * v + 4 * j + i] * xq[4 * v + i];
                        S[j] += (int32_t)((const int8_t *)L->tsc)[(t * nh + h) * TILE + j] * I;
                    }
                }
            }
            const float dx = rows[r].dx[g];
            for (int j = 0; j < TILE; j++) {
                acc[j] = acc[j] + ((float)S[j] * L->tdg[(t * ng + g) * TILE + j]) * dx;
                if (kind == 4) off[j] = off[j] + ((float)O[j] * L->tmg[(t * ng + g) * TILE + j]) * dx;
            }
        }
        for (int j = 0; j < TILE && t * TILE + j < N; j++) {
            float v = kind == 4 ? acc[j] + off[j] : acc[j];
            if (bias) v += bias[t * TILE + j];
            y[r * N + t * TILE + j] = v;
        }
    }
}
#endif

static void tiled_range(const rakv_layer *L, int R, int64_t nb, int64_t t0, int64_t t1, const qrow *rows,
                        float *y, int64_t N, const float *bias) {
#if defined(RAKV_VNNI)
#define TILED_CASE(KIND, FN, RR) case (KIND) * 16 + (RR): \
        { for (int64_t t = t0; t < t1; t++) FN(RR, L, nb, t, rows, y, N, bias); } break;
#define TILED_KIND(KIND, FN) TILED_CASE(KIND, FN, 1) TILED_CASE(KIND, FN, 2) TILED_CASE(KIND, FN, 3) \
        TILED_CASE(KIND, FN, 4) TILED_CASE(KIND, FN, 5) TILED_CASE(KIND, FN, 6) TILED_CASE(KIND, FN, 7) \
        TILED_CASE(KIND, FN, 8) TILED_CASE(KIND, FN, 9)
    switch (((int)L->kind + (L->tsc ? 0 : 16)) * 16 + R) {
        TILED_KIND(4, tiled_q4) TILED_KIND(9, tiled_q8x) TILED_KIND(20, tiled_q4f) TILED_KIND(24, tiled_q8f)
        default: break;
    }
#undef TILED_KIND
#undef TILED_CASE
#else
    for (int64_t t = t0; t < t1; t++) tiled_any((int)L->kind, R, L, nb, t, rows, y, N, bias);
#endif
}

/* ---- the tiled form on AMX-INT8 tiles (Intel AMX; a verify or prefill of 2+ rows): the same exact
   block sums I (C [rows, 16 outputs] = A (the rows' xq of a block) . B (the tile's codes of it)), then
   the same integer and float steps as above, so the bits equal the VNNI and portable forms' */
#if defined(RAKV_VNNI) && defined(__AMX_TILE__) && defined(__AMX_INT8__)
#define RAKV_AMX 1
#include <sys/syscall.h>
#include <unistd.h>

typedef struct __attribute__((packed)) {
    uint8_t palette, start, rsv[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_cfg;

#define AMX_ROWS 16

static int amx_state;          /* 0 not asked yet, 1 usable, -1 not (no RAKV_AMX=1, or the kernel refuses) */

static int amx_usable(void) {
    if (amx_state == 0) {
        const char *e = getenv("RAKV_AMX");    /* opt-in: slower than VNNI at 2-64 rows (docs/fastpath.md) */
        amx_state = !(e && e[0] == '1') ? -1 : (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */,
                                                        18 /* XFEATURE_XTILEDATA */) == 0 ? 1 : -1);
    }
    return amx_state > 0;
}

/* tiles: 0-3 C [R, 16] int32 of four tiles of outputs; 4 A [R, 32] (Q8X: [R, 16]) the rows' inputs of
   one block (group); 5, 6 B [8 quads, 64] (Q8X: [4, 64]) the codes of a tile, two in flight */
static void amx_config(int R, int k16) {
    amx_cfg c;
    memset(&c, 0, sizeof(c));
    c.palette = 1;
    for (int i = 0; i < 4; i++) { c.rows[i] = (uint8_t)R; c.colsb[i] = 64; }
    c.rows[4] = (uint8_t)R; c.colsb[4] = k16 ? 16 : 32;
    c.rows[5] = c.rows[6] = k16 ? 4 : 8; c.colsb[5] = c.colsb[6] = 64;
    _tile_loadconfig(&c);
}

/* C [4][R, 16]: the exact sums of the rows' inputs a (stride rs) with four tiles' codes b[0..3] */
static inline __attribute__((always_inline)) void amx_sums4(const int8_t *a, int64_t rs, const uint8_t *const *b,
                                                            int32_t *C) {
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    _tile_loadd(4, a, rs);
    _tile_loadd(5, b[0], 64);
    _tile_loadd(6, b[1], 64);
    _tile_dpbsud(0, 4, 5);
    _tile_dpbsud(1, 4, 6);
    _tile_loadd(5, b[2], 64);
    _tile_loadd(6, b[3], 64);
    _tile_dpbsud(2, 4, 5);
    _tile_dpbsud(3, 4, 6);
    _tile_stored(0, C, 64);
    _tile_stored(1, C + AMX_ROWS * TILE, 64);
    _tile_stored(2, C + 2 * AMX_ROWS * TILE, 64);
    _tile_stored(3, C + 3 * AMX_ROWS * TILE, 64);
}

/* the 8 quads of Q4 block codes (4 x 64 bytes of nibbles) as bytes, in input order */
static inline __attribute__((always_inline)) void q4_quads(const uint8_t *c, uint8_t *B) {
    const __m512i low = _mm512_set1_epi8(15);
    for (int v = 0; v < 4; v++) {
        const __m512i raw = _mm512_loadu_si512((const void *)(c + 64 * v));
        _mm512_store_si512((void *)(B + 64 * v), _mm512_and_si512(raw, low));
        _mm512_store_si512((void *)(B + 64 * (4 + v)), _mm512_and_si512(_mm512_srli_epi16(raw, 4), low));
    }
}

/* four tiles of 16 outputs t0 .. t0 + 3, R rows (rows[r].xb at a stride of rs bytes), on AMX */
static void amx_chunk4(const rakv_layer *L, int R, int64_t nb, int64_t t0, const qrow *rows, int64_t rs,
                       float *y, int64_t N, const float *bias) {
    const int kind = (int)L->kind, compact = L->tsc != NULL;
    const int64_t ng = (nb + QGROUP - 1) / QGROUP, nh = 2 * nb;
    __attribute__((aligned(64))) uint8_t Bq[4][512];
    __attribute__((aligned(64))) int32_t C[4 * AMX_ROWS * TILE];
    __m512 acc[4][AMX_ROWS], off[4][AMX_ROWS], tt[4][AMX_ROWS];
    __m512i S[4][AMX_ROWS], O[4][AMX_ROWS];
    const uint8_t *bp[4];
    for (int i = 0; i < 4; i++)
        for (int r = 0; r < R; r++) acc[i][r] = off[i][r] = _mm512_setzero_ps();
    const int8_t *x0 = rows[0].xb;
    for (int64_t g = 0; g < ng; g++) {
        for (int i = 0; i < 4; i++)
            for (int r = 0; r < R; r++) { S[i][r] = O[i][r] = _mm512_setzero_si512(); tt[i][r] = _mm512_setzero_ps(); }
        if (kind == 9) {               /* Q8X (Q6_K): groups of 16, integer scales */
            const int64_t h1 = (g + 1) * 2 * QGROUP < nh ? (g + 1) * 2 * QGROUP : nh;
            for (int64_t h = g * 2 * QGROUP; h < h1; h++) {
                for (int i = 0; i < 4; i++) bp[i] = L->tq + ((t0 + i) * nh + h) * 256;
                amx_sums4(x0 + h * 16, rs, bp, C);
                for (int i = 0; i < 4; i++) {
                    const __m512i sc = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(L->tsc + ((t0 + i) * nh + h) * TILE)));
                    for (int r = 0; r < R; r++) {
                        const __m512i I = _mm512_sub_epi32(_mm512_load_si512((const void *)(C + (i * AMX_ROWS + r) * TILE)),
                                                           _mm512_set1_epi32(rows[r].s16[h]));
                        S[i][r] = _mm512_add_epi32(S[i][r], _mm512_mullo_epi32(I, sc));
                    }
                }
            }
        } else {
            const int64_t b1 = (g + 1) * QGROUP < nb ? (g + 1) * QGROUP : nb;
            for (int64_t b = g * QGROUP; b < b1; b++) {
                for (int i = 0; i < 4; i++) {
                    if (kind == 4) {
                        q4_quads(L->tq + ((t0 + i) * nb + b) * 256, Bq[i]);
                        bp[i] = Bq[i];
                    } else {
                        bp[i] = L->tq + ((t0 + i) * nb + b) * 512;
                    }
                }
                amx_sums4(x0 + b * BLK, rs, bp, C);
                for (int i = 0; i < 4; i++) {
                    const int64_t tb = ((t0 + i) * nb + b) * TILE;
                    if (compact) {     /* Q4_K: integer scales and minimums */
                        const __m512i sc = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(L->tsc + tb)));
                        const __m512i mp = _mm512_loadu_si512((const void *)(L->tmn + (((t0 + i) * ((nb + 1) / 2) + b / 2) * TILE) * 2));
                        const __m512i mn = b % 2 ? _mm512_srai_epi32(mp, 16) : _mm512_srai_epi32(_mm512_slli_epi32(mp, 16), 16);
                        for (int r = 0; r < R; r++) {
                            S[i][r] = _mm512_add_epi32(S[i][r], _mm512_mullo_epi32(
                                _mm512_load_si512((const void *)(C + (i * AMX_ROWS + r) * TILE)), sc));
                            O[i][r] = _mm512_add_epi32(O[i][r], _mm512_mullo_epi32(mn, _mm512_set1_epi32(rows[r].s32[b])));
                        }
                    } else {           /* a float scale (and Q4 offset) per block */
                        const __m512 d = _mm512_loadu_ps(L->tdg + tb);
                        for (int r = 0; r < R; r++) {
                            __m512i I = _mm512_load_si512((const void *)(C + (i * AMX_ROWS + r) * TILE));
                            if (kind == 8) I = _mm512_sub_epi32(I, _mm512_set1_epi32(128 * rows[r].s32[b]));
                            tt[i][r] = _mm512_add_ps(tt[i][r], _mm512_mul_ps(_mm512_cvtepi32_ps(I), d));
                        }
                        if (kind == 4) {
                            const __m512 m = _mm512_loadu_ps(L->tmg + tb);
                            for (int r = 0; r < R; r++)
                                off[i][r] = _mm512_add_ps(off[i][r], _mm512_mul_ps(m, _mm512_set1_ps(rows[r].u32[b])));
                        }
                    }
                }
            }
        }
        for (int i = 0; i < 4; i++) {
            if (compact) {
                const __m512 dg = _mm512_loadu_ps(L->tdg + ((t0 + i) * ng + g) * TILE);
                const __m512 mg = kind == 4 ? _mm512_loadu_ps(L->tmg + ((t0 + i) * ng + g) * TILE) : _mm512_setzero_ps();
                for (int r = 0; r < R; r++) {
                    const __m512 dx = _mm512_set1_ps(rows[r].dx[g]);
                    acc[i][r] = _mm512_add_ps(acc[i][r], _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(S[i][r]), dg), dx));
                    if (kind == 4)
                        off[i][r] = _mm512_add_ps(off[i][r], _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(O[i][r]), mg), dx));
                }
            } else {
                for (int r = 0; r < R; r++)
                    acc[i][r] = _mm512_add_ps(acc[i][r], _mm512_mul_ps(tt[i][r], _mm512_set1_ps(rows[r].dx[g])));
            }
        }
    }
    for (int i = 0; i < 4; i++) {
        const int64_t n0 = (t0 + i) * TILE;
        const __mmask16 k = N - n0 >= TILE ? (__mmask16)0xFFFF : (__mmask16)((1u << (N - n0)) - 1);
        for (int r = 0; r < R; r++) {
            __m512 v = kind == 4 ? _mm512_add_ps(acc[i][r], off[i][r]) : acc[i][r];
            if (bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(k, bias + n0));
            _mm512_mask_storeu_ps(y + r * N + n0, k, v);
        }
    }
}
#endif

/* which form runs the tiled codes: 2 AMX (rows >= 2 where usable), 1 VNNI, 0 portable */
int rakv_tiled_simd(int64_t M) {
#if defined(RAKV_AMX)
    if (M >= 2 && amx_usable()) return 2;
#endif
#if defined(RAKV_VNNI)
    return 1;
#else
    (void)M;
    return 0;
#endif
}

/* y [M, N] = the q8 numerics' linear of x [M, K] with the layer's codes; returns 0, or 1 when out of memory */
static int rakv_q8act_linear(const rakv_layer *L, const float *x, int64_t M, float *y, const float *bias,
                             int threads) {
    const int64_t K = L->K, N = L->N, nb = K / BLK;
    const size_t rb = (qrow_bytes(nb) + 63) / 64 * 64;
    char *mem = aligned_alloc(64, (size_t)(M > 0 ? M : 1) * rb);
    qrow *rows = malloc(sizeof(qrow) * (size_t)(M > 0 ? M : 1));
    if (!mem || !rows) { free(mem); free(rows); return 1; }
    for (int64_t i = 0; i < M; i++) rows[i] = qrow_at(mem + i * rb, nb);
    const int64_t T = (N + TILE - 1) / TILE;
#if defined(RAKV_AMX)
    if (L->tq && rakv_tiled_simd(M) == 2) {     /* AMX: up to 16 rows a tile product */
        #pragma omp parallel num_threads(threads)
        {
            int configured = 0;
            #pragma omp for schedule(static)
            for (int64_t i = 0; i < M; i++) quantize_row(x + i * K, K, rows + i);
            #pragma omp for schedule(static)
            for (int64_t c = 0; c < (T + 3) / 4; c++) {
                const int64_t t0 = 4 * c, t1 = t0 + 4 < T ? t0 + 4 : T;
                for (int64_t r0 = 0; r0 < M; r0 += AMX_ROWS) {
                    const int R = (int)(M - r0 < AMX_ROWS ? M - r0 : AMX_ROWS);
                    if (R == 1 || t1 - t0 < 4) {        /* one row, or a last part chunk: VNNI */
                        for (int64_t q0 = 0; q0 < R; q0 += TROWS)
                            tiled_range(L, (int)(R - q0 < TROWS ? R - q0 : TROWS), nb, t0, t1, rows + r0 + q0,
                                        y + (r0 + q0) * N, N, bias);
                        continue;
                    }
                    if (configured != R) { amx_config(R, L->kind == 9); configured = R; }
                    amx_chunk4(L, R, nb, t0, rows + r0, (int64_t)rb, y + r0 * N, N, bias);
                }
            }
            if (configured) _tile_release();
        }
        free(mem);
        free(rows);
        return 0;
    }
#endif
    if (L->tq) {                 /* tiled codes: tiles of 16 outputs, TROWS rows a pass; one parallel region */
        #pragma omp parallel num_threads(threads)
        {
            #pragma omp for schedule(static)
            for (int64_t i = 0; i < M; i++) quantize_row(x + i * K, K, rows + i);
            #pragma omp for schedule(static)
            for (int64_t c = 0; c < (T + 3) / 4; c++) {
                const int64_t t0 = 4 * c, t1 = t0 + 4 < T ? t0 + 4 : T;
                for (int64_t r0 = 0; r0 < M; r0 += TROWS)
                    tiled_range(L, (int)(M - r0 < TROWS ? M - r0 : TROWS), nb, t0, t1, rows + r0, y + r0 * N, N, bias);
            }
        }
        free(mem);
        free(rows);
        return 0;
    }
    #pragma omp parallel for num_threads(threads) schedule(static) if (M > 1)
    for (int64_t i = 0; i < M; i++) quantize_row(x + i * K, K, rows + i);
    for (int64_t r0 = 0; r0 < M; r0 += Q8ACT_ROWS) {
        const int mr = (int)(M - r0 < Q8ACT_ROWS ? M - r0 : Q8ACT_ROWS);
        const int64_t chunk = 16;
        const int64_t nchunks = (N + chunk - 1) / chunk;
        #pragma omp parallel for num_threads(threads) schedule(static)
        for (int64_t c = 0; c < nchunks; c++) {
            const int64_t n0 = c * chunk, n1 = n0 + chunk < N ? n0 + chunk : N;
            q8act_range(L, mr, nb, n0, n1, rows + r0, y + r0 * N, N, bias);
        }
    }
    free(mem);
    free(rows);
    return 0;
}

/* which form of the q8 numerics' kernel this build runs: 2 AVX-512 VNNI, 0 portable */
int rakv_q8act_simd(void) {
#ifdef RAKV_VNNI
    return 2;
#else
    return 0;
#endif
}

/* one call per linear: the layer's codes described once (rakv/blockq.py keeps it), so a call passes
   six arguments instead of ten */

void rakv_linear(const rakv_layer *L, const float *x, int64_t M, float *y, const float *bias, int threads) {
    if (L->numerics == 1) {
        if (rakv_q8act_linear(L, x, M, y, bias, threads))
            for (int64_t i = 0; i < M * L->N; i++) y[i] = NAN;          /* out of memory: never a silent value */
        return;
    }
    if (L->kind == 4)
        rakv_q4_linear(x, M, L->K, L->qs, L->d, L->m, L->N, y, bias, threads);
    else if (L->kind == 9)
        rakv_q8x_linear(x, M, L->K, L->qs, L->d, L->m, L->N, y, bias, threads);
    else
        rakv_q8_linear(x, M, L->K, (const int8_t *)L->qs, L->d, L->N, y, bias, threads);
}

/* How many rows of W [N, K] (element (n, k) at w[n * ws_n + k * ws_k]) the codes do NOT rebuild:
   0 when every element equals its rebuilt value (d q + m, or d q), the encoder's own test
   (blockq.encode), here one streaming pass instead of a dequantized copy per layer. */
int64_t rakv_check(const rakv_layer *L, const float *w, int64_t ws_n, int64_t ws_k, int threads) {
    const int64_t nb = L->K / BLK;
    int64_t bad = 0;
    #pragma omp parallel for num_threads(threads) reduction(+:bad) schedule(static)
    for (int64_t n = 0; n < L->N; n++) {
        int row_bad = 0;
        for (int64_t b = 0; b < nb; b++) {
            const float *wb = w + n * ws_n + b * BLK * ws_k;
            if (L->kind == 9) {
                const int64_t h = 2 * (n * nb + b);
                const uint8_t *q = L->qs + (n * nb + b) * BLK;
                for (int j = 0; j < BLK; j++) {
                    const int64_t g = h + j / (BLK / 2);
                    row_bad |= fmaf(L->d[g], (float)q[j], L->m[g]) != wb[j * ws_k];
                }
                continue;
            }
            const float d = L->d[n * nb + b];
            if (L->kind == 4) {
                const float m = L->m[n * nb + b];
                const uint8_t *q = L->qs + (n * nb + b) * (BLK / 2);
                for (int j = 0; j < BLK / 2; j++) {
                    row_bad |= fmaf(d, (float)(q[j] & 15), m) != wb[j * ws_k];
                    row_bad |= fmaf(d, (float)(q[j] >> 4), m) != wb[(j + BLK / 2) * ws_k];
                }
            } else {
                const int8_t *q = (const int8_t *)L->qs + (n * nb + b) * BLK;
                for (int j = 0; j < BLK; j++) row_bad |= d * (float)q[j] != wb[j * ws_k];
            }
        }
        bad += row_bad;
    }
    return bad;
}

int rakv_blockq_avx512(void) {
#ifdef RAKV_AVX512
    return 1;
#else
    return 0;
#endif
}

/* ---- whole decoder layers of a decode or verify step (Llama, Mistral, Qwen2: RMSNorm, rotary q / k
   over all of the head, SiLU-gated MLP), the glue between the kernel calls in C as well: one call
   runs all the layers, where the Python forward spends most of a one-token step dispatching ~20
   small torch operations per layer.

   x [n, H] in place (the residual stream after the embedding -> after the last layer). Per layer,
   per row, each step alone and in an order that does not depend on n:
     xn = (x * r) * w1, r = 1 / sqrtf(sum_j x_j^2 / H + eps) (the squares added in order of j)
     h = qkv(xn) (+ bias); q, k rotated: y_d = x_d cos_d + x_(d + D/2 mod D) sin_d (sin carries
         rotate_half's sign); k, v written to the layer's buffers at positions past .. past + n - 1
     a = attention (rakv_attend); x = x + o(a)
     xn = (x * r) * w2; g | u = gate_up(xn); x = x + down(g / (1 + exp_f(-g)) * u)
   so a verify row equals the decode step of the same token, bit for bit. ``path`` (not NULL): the
   n rows are a token tree (rakv_attend_tree's path, path_rs and depth; cos and sin rows then at
   each row's own position), each row equal to the decode step of its token after its ancestry. */
typedef struct {
    const rakv_layer *qkv, *o, *gate_up, *down;
    const float *qkv_bias, *o_bias, *gate_up_bias, *down_bias;     /* or NULL */
    const float *ln1, *ln2;                                          /* RMSNorm weights [H] */
    float *k, *v;                                                    /* [Hk, cap, D] buffers */
    int64_t cap, window;
    const rakv_layer *q_part, *k_part, *v_part;   /* qkv NULL: q, k, v apart (codes of different kinds,
                                                     e.g. a Q4_K_M file's Q4_K q, k and Q6_K v) */
    const rakv_layer *gate_part, *up_part;        /* gate_up NULL: gate and up apart */
} rakv_dlayer;

/* y [n, W] columns col .. col + P->N - 1 = the linear P of x (tmp: n * P->N floats) */
static void linear_cols(const rakv_layer *P, const float *x, int64_t n, float *y, int64_t W, int64_t col,
                        const float *bias, float *tmp, int threads) {
    rakv_linear(P, x, n, tmp, bias ? bias + col : NULL, threads);
    for (int64_t i = 0; i < n; i++) memcpy(y + i * W + col, tmp + i * P->N, sizeof(float) * P->N);
}

static void linear_parts(const rakv_layer *whole, const rakv_layer *const *parts, int np, const float *x,
                         int64_t n, float *y, int64_t W, const float *bias, float *tmp, int threads) {
    if (whole) {
        rakv_linear(whole, x, n, y, bias, threads);
        return;
    }
    int64_t col = 0;
    for (int i = 0; i < np; i++) {
        linear_cols(parts[i], x, n, y, W, col, bias, tmp, threads);
        col += parts[i]->N;
    }
}

/* row-wise steps of a few rows run on one thread: a parallel region costs more than the work */
#define SERIAL_ROWS 16

static void rms_rows(const float *x, int64_t n, int64_t H, const float *w, float eps, float *y, int threads) {
    #pragma omp parallel for num_threads(threads) schedule(static) if (n > SERIAL_ROWS)
    for (int64_t i = 0; i < n; i++) {
        const float *xi = x + i * H;
        float ss = 0.0f;
        for (int64_t j = 0; j < H; j++) ss += xi[j] * xi[j];
        const float r = 1.0f / sqrtf(ss / (float)H + eps);
        for (int64_t j = 0; j < H; j++) y[i * H + j] = (xi[j] * r) * w[j];
    }
}

static void rotate_heads(float *h, int64_t heads, int64_t D, const float *cos, const float *sin) {
    const int64_t R = D / 2;
    float tmp[D];
    for (int64_t g = 0; g < heads; g++) {
        float *x = h + g * D;
        for (int64_t d = 0; d < R; d++) tmp[d] = x[d] * cos[d] + x[d + R] * sin[d];
        for (int64_t d = R; d < D; d++) tmp[d] = x[d] * cos[d] + x[d - R] * sin[d];
        memcpy(x, tmp, sizeof(float) * D);
    }
}

/* m = g / (1 + exp(-g)) * u, element by element (SiLU(g) times u) */
static void silu_mul(const float *g, const float *u, float *m, int64_t I) {
    int64_t j = 0;
#ifdef RAKV_AVX512
    const __m512 one = _mm512_set1_ps(1.0f), neg = _mm512_set1_ps(-0.0f);
    for (; j + 16 <= I; j += 16) {
        const __m512 gj = _mm512_loadu_ps(g + j);
        const __m512 e = exp_f16(_mm512_xor_ps(gj, neg));
        _mm512_storeu_ps(m + j, _mm512_mul_ps(_mm512_div_ps(gj, _mm512_add_ps(one, e)), _mm512_loadu_ps(u + j)));
    }
#endif
    for (; j < I; j++) m[j] = g[j] / (1.0f + exp_f(-g[j])) * u[j];
}

static float *aligned_floats(int64_t n) {
    const size_t bytes = ((size_t)n * sizeof(float) + 63) / 64 * 64;
    return (float *)aligned_alloc(64, bytes ? bytes : 64);
}

/* The rows of a forward come in S segments, one per request: segment s is rows r0[s] .. r0[s] + n[s]
   - 1 (in order), at positions past[s] .. of its own KV buffers: layer l's are kbuf[l * S + s],
   vbuf[l * S + s] ([Hk, cap[s], D]). Every linear runs over all n rows at once (one pass over the
   codes; under the q8 numerics each row's arithmetic is its own, whatever rows share the pass), each
   segment's attention over its own cache only: a row of one request never reads another's KV. */
typedef struct {
    int64_t S;
    const int64_t *r0, *n, *past, *cap;
    float *const *kbuf, *const *vbuf;      /* NULL: one segment in the layers' own k, v, cap */
} rakv_segs;

static inline float *seg_k(const rakv_dlayer *L, const rakv_segs *g, int64_t l, int64_t s) {
    return g->kbuf ? g->kbuf[l * g->S + s] : L->k;
}
static inline float *seg_v(const rakv_dlayer *L, const rakv_segs *g, int64_t l, int64_t s) {
    return g->vbuf ? g->vbuf[l * g->S + s] : L->v;
}
static inline int64_t seg_cap(const rakv_dlayer *L, const rakv_segs *g, int64_t s) {
    return g->kbuf ? g->cap[s] : L->cap;
}

static int decode_segments(const rakv_dlayer *Ls, int64_t nL, float *x, int64_t n, int64_t H, int64_t Hq,
                           int64_t Hk, int64_t D, int64_t I, const rakv_segs *g, const float *cos,
                           const float *sin, float eps, float scale, int threads, const int64_t *path,
                           int64_t path_rs, const int64_t *depth, const float *final_w) {
    const int64_t sq = Hq * D, sk = Hk * D, W = sq + 2 * sk;
    int64_t *seg_of = malloc(sizeof(int64_t) * (size_t)(n > 0 ? n : 1));
    if (!seg_of) return 1;
    for (int64_t s = 0; s < g->S; s++)
        for (int64_t i = g->r0[s]; i < g->r0[s] + g->n[s]; i++) seg_of[i] = s;
    /* 64-byte aligned, as torch's own tensors: the kernel's row loads then never straddle lines */
    float *xn = aligned_floats(n * H), *h = aligned_floats(n * W), *a = aligned_floats(n * sq);
    float *y = aligned_floats(n * (2 * I > H ? 2 * I : H)), *m = aligned_floats(n * I);
    float *tmp = aligned_floats(n * (W > I ? W : I));
    if (!xn || !h || !a || !y || !m || !tmp) {
        free(xn); free(h); free(a); free(y); free(m); free(tmp); free(seg_of);
        return 1;
    }
    for (int64_t l = 0; l < nL; l++) {
        const rakv_dlayer *L = Ls + l;
        rms_rows(x, n, H, L->ln1, eps, xn, threads);
        const rakv_layer *qkv_parts[3] = {L->q_part, L->k_part, L->v_part};
        linear_parts(L->qkv, qkv_parts, 3, xn, n, h, W, L->qkv_bias, tmp, threads);
        #pragma omp parallel for num_threads(threads) schedule(static) if (n > SERIAL_ROWS)
        for (int64_t i = 0; i < n; i++) {
            float *hi = h + i * W;
            const int64_t s = seg_of[i], cap = seg_cap(L, g, s), at = g->past[s] + i - g->r0[s];
            float *kb = seg_k(L, g, l, s), *vb = seg_v(L, g, l, s);
            rotate_heads(hi, Hq + Hk, D, cos + i * D, sin + i * D);            /* q, then k: adjacent */
            for (int64_t e = 0; e < Hk; e++) {
                memcpy(kb + (e * cap + at) * D, hi + sq + e * D, sizeof(float) * D);
                memcpy(vb + (e * cap + at) * D, hi + sq + sk + e * D, sizeof(float) * D);
            }
        }
        for (int64_t s = 0; s < g->S; s++) {
            const int64_t r0 = g->r0[s], cap = seg_cap(L, g, s);
            float *kb = seg_k(L, g, l, s), *vb = seg_v(L, g, l, s);
            if (path)       /* a token tree (one segment): row i at position past + depth[i] */
                rakv_attend_tree(h, n, Hq, D, W, kb, cap * D, vb, cap * D, Hk, g->past[s], scale, a, threads,
                                 L->window, 0.0f, path, path_rs, depth);
            else
                rakv_attend(h + r0 * W, g->n[s], Hq, D, W, kb, cap * D, vb, cap * D, Hk, g->past[s], scale,
                            a + r0 * sq, threads, L->window, 0.0f);
        }
        rakv_linear(L->o, a, n, y, L->o_bias, threads);
        for (int64_t j = 0; j < n * H; j++) x[j] = x[j] + y[j];
        rms_rows(x, n, H, L->ln2, eps, xn, threads);
        const rakv_layer *gu_parts[2] = {L->gate_part, L->up_part};
        linear_parts(L->gate_up, gu_parts, 2, xn, n, y, 2 * I, L->gate_up_bias, tmp, threads);
        #pragma omp parallel for num_threads(threads) schedule(static) if (n > SERIAL_ROWS)
        for (int64_t i = 0; i < n; i++) silu_mul(y + i * 2 * I, y + i * 2 * I + I, m + i * I, I);
        rakv_linear(L->down, m, n, y, L->down_bias, threads);
        for (int64_t j = 0; j < n * H; j++) x[j] = x[j] + y[j];
    }
    /* the model's final RMSNorm (weights final_w, the layers' eps), in place: here the rows are
       still in cache, where torch's op after the call found its code and data cold (~0.1 ms) */
    if (final_w) rms_rows(x, n, H, final_w, eps, x, threads);
    free(xn); free(h); free(a); free(y); free(m); free(tmp); free(seg_of);
    return 0;
}

/* one request's rows (a decode or verify step, a token tree with path) in the layers' own buffers */
int rakv_decode_layers(const rakv_dlayer *Ls, int64_t nL, float *x, int64_t n, int64_t H, int64_t Hq,
                       int64_t Hk, int64_t D, int64_t I, int64_t past, const float *cos, const float *sin,
                       float eps, float scale, int threads, const int64_t *path, int64_t path_rs,
                       const int64_t *depth, const float *final_w) {
    const int64_t r0 = 0;
    const rakv_segs one = {1, &r0, &n, &past, NULL, NULL, NULL};
    return decode_segments(Ls, nL, x, n, H, Hq, Hk, D, I, &one, cos, sin, eps, scale, threads, path, path_rs,
                           depth, final_w);
}

/* several requests' rows in one pass (rakv_segs); no trees */
int rakv_decode_segments(const rakv_dlayer *Ls, int64_t nL, float *x, int64_t n, int64_t H, int64_t Hq,
                         int64_t Hk, int64_t D, int64_t I, int64_t S, const int64_t *r0, const int64_t *ns,
                         const int64_t *past, const int64_t *cap, float *const *kbuf, float *const *vbuf,
                         const float *cos, const float *sin, float eps, float scale, int threads,
                         const float *final_w) {
    const rakv_segs g = {S, r0, ns, past, cap, kbuf, vbuf};
    return decode_segments(Ls, nL, x, n, H, Hq, Hk, D, I, &g, cos, sin, eps, scale, threads, NULL, 0, NULL,
                           final_w);
}

/* ------------------------------------------------------------------ the seeded sampler
   Gumbel-max over rows of logits with the counter-based noise rakv/decoding/sampling.py defines (its
   docstring): the same 64-bit words, the same float64 and float32 operations in the same order,
   log from the C library (a libm may differ from torch's vectorised log in the last bit of a
   float64 log, which moves a float32 Gumbel with probability ~2**-29). Row r of z [n, V]:
       argmax over {x : z_x / T >= thr[r]} of  z_x / T + G_x        (float32; ties: the lowest x)
   with G the noise of block key kb[r] and slot key ks[r]. Block b's slots never exceed its
   maximum Gumbel M_b, so a block whose max z / T + M_b is below the best score found cannot hold
   the winner: the block with the largest such bound is scored first, then only the others whose
   bound reaches the best score (on an LM's logits: a block or two of the vocabulary). */
#define SAMPLE_BLOCK 64
#define GOLDEN 0x9E3779B97F4A7C15ULL

static inline uint64_t mix64(uint64_t x) {
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
    return x ^ (x >> 31);
}

static inline double exp1_of(uint64_t h) {     /* -log(u), u = ((h >> 12) + 2^51 + 0.5) 2^-52 */
    const int64_t s = ((int64_t)h) >> 12;       /* arithmetic shift, as torch's int64 >> */
    return -log(((double)s + 2251799813685248.5) * 0x1p-52);
}

static void score_block(const float *z, int64_t V, float T, int has_thr, float thr, uint64_t ks, int64_t b,
                        double e_over_b, float M, int64_t J, float *best, int64_t *best_x) {
    const int64_t x0 = b * SAMPLE_BLOCK;
    for (int64_t i = 0; i < SAMPLE_BLOCK && x0 + i < V; i++) {
        const int64_t x = x0 + i;
        const float zs = z[x] / T;
        if (has_thr && zs < thr) continue;
        float g = M;
        if (i != J) {
            const double e = exp1_of(mix64(ks + (uint64_t)(x + 1) * GOLDEN));
            g = (float)(-log(e + e_over_b));
            if (g > M) g = M;
        }
        const float s = zs + g;
        if (s > *best || (s == *best && x < *best_x)) { *best = s; *best_x = x; }
    }
}

/* z [n, V] f32, thr [n] or NULL, keys [n] each, out [n]; returns 0, or -1 when out of memory.
   expect [n - 1] or NULL: a verify's drafts; the rows stop after the first whose token differs
   from its draft (the rows past it are never used: out = -2 there). */
int rakv_gumbel_argmax(const float *z, int64_t n, int64_t V, float T, const float *thr,
                       const uint64_t *kb, const uint64_t *ks, int64_t *out, const int64_t *expect) {
    const int64_t nb = (V + SAMPLE_BLOCK - 1) / SAMPLE_BLOCK;
    const double log_block = log((double)SAMPLE_BLOCK);
    float *up = malloc(sizeof(float) * nb), *Ms = malloc(sizeof(float) * nb);
    double *eob = malloc(sizeof(double) * nb);
    int64_t *Js = malloc(sizeof(int64_t) * nb);
    if (!up || !Ms || !eob || !Js) { free(up); free(Ms); free(eob); free(Js); return -1; }
    for (int64_t r = 0; r < n; r++) {
        const float *zr = z + r * V;
        const int has_thr = thr != NULL;
        const float t = has_thr ? thr[r] : 0.0f;
        int64_t first = 0;
        for (int64_t b = 0; b < nb; b++) {
            float mx = -INFINITY;
            const int64_t end = (b + 1) * SAMPLE_BLOCK < V ? (b + 1) * SAMPLE_BLOCK : V;
            for (int64_t x = b * SAMPLE_BLOCK; x < end; x++) mx = zr[x] > mx ? zr[x] : mx;
            const float top = mx / T;                       /* = the block's largest z / T */
            const uint64_t h = mix64(kb[r] + (uint64_t)(b + 1) * GOLDEN);
            const double e = exp1_of(h);
            eob[b] = e * (1.0 / SAMPLE_BLOCK);
            Ms[b] = (float)(log_block - log(e));
            Js[b] = (int64_t)(h & (SAMPLE_BLOCK - 1));
            up[b] = (has_thr && top < t) ? -INFINITY : top + Ms[b];
            if (up[b] > up[first]) first = b;
        }
        float best = -INFINITY;
        int64_t best_x = -1;
        score_block(zr, V, T, has_thr, t, ks[r], first, eob[first], Ms[first], Js[first], &best, &best_x);
        for (int64_t b = 0; b < nb; b++)
            if (b != first && up[b] >= best)
                score_block(zr, V, T, has_thr, t, ks[r], b, eob[b], Ms[b], Js[b], &best, &best_x);
        out[r] = best_x;
        if (expect && r + 1 < n && best_x != expect[r]) {
            for (int64_t q = r + 1; q < n; q++) out[q] = -2;
            break;
        }
    }
    free(up); free(Ms); free(eob); free(Js);
    return 0;
}
