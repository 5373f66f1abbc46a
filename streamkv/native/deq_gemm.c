/* Float32 GEMM over a GGUF's quantized weights that gives the dense float32 GEMM's bits.
 *
 * A float32 model loaded from a GGUF holds w = d * q + m per weight (Q4_1), d * (q - 8) (Q4_0)
 * or d * q (Q8_0), with d and m the block's float16 values (gguf's own dequantization, in numpy
 * float32). d * q is exact in float32 (at most 11 + 8 significant bits), so each weight is ONE
 * rounding of d * q + m, which is what fma(d, q, m) computes (Q4_0: m = -8d; Q8_0: m = 0). This
 * kernel rebuilds the weights that way, a 32-wide group of k at a time into an L1 buffer, and runs
 * inv_gemm.c's float32 chain over them:
 *
 *     acc = 0;  for k = 0 .. K-1:  acc = fma(x[m, k], w[n, k], acc)      (one accumulator per element)
 *
 * so its output equals streamkv_inv_gemm's on the dequantized float32 panels bit for bit, for
 * every M (tests/test_deq_gemm.py). It reads 0.625 (4-bit) or 1.06 (8-bit) bytes per weight
 * instead of 4, which is what a decode step is bound by; since the bits are the same, the caller
 * takes it or the dense GEMM by row count (the crossover is measured, native/tuning.py).
 *
 * Packed layout (models/q4_linear.py: pack_deq), panel t = columns [16t, 16t + 16), group g =
 * k in [32g, 32g + 32):
 *
 *   4-bit: q  [T][G][32][8]  uint8:   byte b of row k = q[16t + b][32g + k] | q[16t + b + 8][32g + k] << 4
 *          dm [T][G][2][16]  float16: d, then m, of columns 16t .. 16t + 15
 *   8-bit: q  [T][G][32][16] int8:    q[16t + c][32g + k]
 *          dm [T][G][1][16]  float16: d
 *
 * Columns past N are zero and never stored.
 *
 *   parallel over (block of MB rows, unit of panels):
 *     for chunks of P panels:       acc [rows][P x 16] in an L1 buffer, zeroed
 *       for each group g:           dequantize the P panels' group once (wb [P][32][16])
 *         for rows in steps of R:   acc[R][P] in registers over the group's 32 k, then back
 *       store acc
 */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#include "units.h"
#include "vec16.h"

#define MB 96
#define PMAX 4
#define FUSED_ROWS 6   /* the most rows per fused() block (AVX2: 2 x 6 accumulators, w, x in 16 ymm) */
#ifndef FUSED_MAX
#define FUSED_MAX 16   /* steps of at most this many rows run fused() */
#endif

/* float16 -> float32 (exact; every float16 is a float32) */
static inline float f16_to_f32(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ffu;
    uint32_t u;
    if (exp == 0x1f) u = sign | 0x7f800000u | (man << 13);
    else if (exp) u = sign | ((exp + 112) << 23) | (man << 13);
    else if (!man) u = sign;
    else {  /* subnormal: normalise */
        int e = -1;
        uint32_t m = man;
        do { e++; m <<= 1; } while (!(m & 0x400u));
        u = sign | ((uint32_t)(112 - e) << 23) | ((m & 0x3ffu) << 13);
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* 16 float16 values without F16C */
static inline v16 ld_f16_soft(const uint16_t* p) {
    float t[16];
    for (int i = 0; i < 16; i++) t[i] = f16_to_f32(p[i]);
    return v_load(t);
}

/* 16 lanes: float16 values; the nibbles of a 4-bit row (lanes 0-7 low, 8-15 high); int8 values */
#if defined(__AVX512F__)
static inline v16 ld_f16(const uint16_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p)); }
static inline v16 ld_q4(const uint8_t* p) {
    const __m128i b = _mm_loadl_epi64((const __m128i*)p), m = _mm_set1_epi8(0x0f);
    const __m128i v = _mm_unpacklo_epi64(_mm_and_si128(b, m), _mm_and_si128(_mm_srli_epi16(b, 4), m));
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(v));
}
static inline v16 ld_q8(const int8_t* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
}
#elif defined(__AVX2__) && defined(__FMA__)
#if defined(__F16C__)
static inline v16 ld_f16(const uint16_t* p) {
    v16 r = {_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)), _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(p + 8)))};
    return r;
}
#else
static inline v16 ld_f16(const uint16_t* p) { return ld_f16_soft(p); }
#endif
static inline v16 ld_q4(const uint8_t* p) {
    const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p));
    v16 r = {_mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(0x0f))),
             _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4))};
    return r;
}
static inline v16 ld_q8(const int8_t* p) {
    v16 r = {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p))),
             _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(p + 8))))};
    return r;
}
#else
static inline v16 ld_f16(const uint16_t* p) { return ld_f16_soft(p); }
static inline v16 ld_q4(const uint8_t* p) {
    float t[16];
    for (int i = 0; i < 8; i++) { t[i] = (float)(p[i] & 15); t[i + 8] = (float)(p[i] >> 4); }
    return v_load(t);
}
static inline v16 ld_q8(const int8_t* p) {
    float t[16];
    for (int i = 0; i < 16; i++) t[i] = (float)p[i];
    return v_load(t);
}
#endif

typedef struct {
    const float* x;     /* [M, K] float32 */
    int K, N, bits;     /* bits: 4 or 8 */
    const void* q;      /* packed values (layout above) */
    const uint16_t* dm; /* float16 d (and m) per panel and group */
    void* out;          /* [M, N] float32, or bf16 when out_bf16 */
    int out_bf16;
} Deq;

/* wb [32][16] = the weights of panel t, group g: fma(d, q, m) per element (one rounding) */
static inline void dequant(const Deq* g, int t, int grp, float* wb) {
    const int G = g->K / 32;
    if (g->bits == 4) {
        const uint16_t* dm = g->dm + ((int64_t)t * G + grp) * 32;
        const uint8_t* q = (const uint8_t*)g->q + ((int64_t)t * G + grp) * 256;
        const v16 d = ld_f16(dm), m = ld_f16(dm + 16);
        for (int k = 0; k < 32; k++) v_store(wb + 16 * k, v_fma(d, ld_q4(q + 8 * k), m));
    } else {
        const uint16_t* dm = g->dm + ((int64_t)t * G + grp) * 16;
        const int8_t* q = (const int8_t*)g->q + ((int64_t)t * G + grp) * 512;
        const v16 d = ld_f16(dm);
        for (int k = 0; k < 32; k++) v_store(wb + 16 * k, v_mul(ld_q8(q + 16 * k), d));
    }
}

/* acc[r][p] (row stride ldc floats) += the group's 32 k for R rows of x (from column k0) */
static inline __attribute__((always_inline)) void rk(const int R, const int P, const float* x, int K, int k0,
                                                      const float* wb, float* acc, int ldc) {
    v16 a[6][PMAX];
    for (int r = 0; r < R; r++) for (int p = 0; p < P; p++) a[r][p] = v_load(acc + r * ldc + 16 * p);
    for (int k = 0; k < 32; k++) {
        v16 w[PMAX];
        for (int p = 0; p < P; p++) w[p] = v_load(wb + (p * 32 + k) * 16);
        for (int r = 0; r < R; r++) {
            const v16 xb = v_set1(x[(int64_t)r * K + k0 + k]);
            for (int p = 0; p < P; p++) a[r][p] = v_fma(xb, w[p], a[r][p]);
        }
    }
    for (int r = 0; r < R; r++) for (int p = 0; p < P; p++) v_store(acc + r * ldc + 16 * p, a[r][p]);
}

#if defined(__AVX512F__)
#define RMAX(P) ((P) == 1 ? 6 : (P) == 2 ? 6 : 4)
#else
#define RMAX(P) ((P) == 1 ? 6 : (P) == 2 ? 3 : 2)
#endif

#define RK_CASE(R, P) case R: rk(R, P, x, K, k0, wb, acc, ldc); break;
#define RK_P(P)                                                                                      \
    static void rows_p##P(const float* x, int64_t rows, int K, int k0, const float* wb, float* acc, int ldc) { \
        int64_t r = 0;                                                                               \
        while (r < rows) {                                                                           \
            int R = rows - r < RMAX(P) ? (int)(rows - r) : RMAX(P);                                  \
            switch (R) { RK_CASE(1, P) RK_CASE(2, P) RK_CASE(3, P) RK_CASE(4, P) RK_CASE(5, P) RK_CASE(6, P) } \
            x += (int64_t)R * K;                                                                     \
            acc += (int64_t)R * ldc;                                                                 \
            r += R;                                                                                  \
        }                                                                                            \
    }
RK_P(1)

/* the packed bytes of panels [t, t + P), group grp, towards L1 (a decode step streams them from
 * memory once; the hardware prefetcher alone left the kernel waiting on 5 streams per thread) */
#define PF_GROUPS 2
static inline void prefetch_group(const Deq* g, int t, int P, int grp) {
    const int G = g->K / 32, vb = g->bits == 4 ? 256 : 512, db = g->bits == 4 ? 64 : 32;
    for (int p = 0; p < P; p++) {
        const int64_t at = (int64_t)(t + p) * G + grp;
        const char* q = (const char*)g->q + at * vb;
        for (int o = 0; o < vb; o += 64) __builtin_prefetch(q + o, 0, 3);
        __builtin_prefetch((const char*)g->dm + at * db, 0, 3);
    }
}

/* Few rows: R rows x P panels over the whole K with the weights dequantized in registers (no
 * buffer round trip); the same chain per element as chunk(). P panels keep 2 P R independent fma
 * chains in flight (one row alone over one panel waited on the fma latency). */
static inline __attribute__((always_inline)) void fused(const Deq* g, const int R, const int P, const float* x,
                                                         int t, float* acc) {
    const int K = g->K, G = K / 32;
    v16 a[FUSED_ROWS][PMAX];
    for (int r = 0; r < R; r++) for (int p = 0; p < P; p++) a[r][p] = v_zero();
    for (int grp = 0; grp < G; grp++) {
        const float* xg = x + 32 * grp;
        if (grp + PF_GROUPS < G) prefetch_group(g, t, P, grp + PF_GROUPS);
        if (g->bits == 4) {
            const uint16_t* dm = g->dm + ((int64_t)t * G + grp) * 32;
            const uint8_t* q = (const uint8_t*)g->q + ((int64_t)t * G + grp) * 256;
            for (int k = 0; k < 32; k++)
                for (int p = 0; p < P; p++) {
                    const int64_t o = (int64_t)p * G;
                    const v16 w = v_fma(ld_f16(dm + o * 32), ld_q4(q + o * 256 + 8 * k), ld_f16(dm + o * 32 + 16));
                    for (int r = 0; r < R; r++) a[r][p] = v_fma(v_set1(xg[(int64_t)r * K + k]), w, a[r][p]);
                }
        } else {
            const uint16_t* dm = g->dm + ((int64_t)t * G + grp) * 16;
            const int8_t* q = (const int8_t*)g->q + ((int64_t)t * G + grp) * 512;
            for (int k = 0; k < 32; k++)
                for (int p = 0; p < P; p++) {
                    const int64_t o = (int64_t)p * G;
                    const v16 w = v_mul(ld_q8(q + o * 512 + 16 * k), ld_f16(dm + o * 16));
                    for (int r = 0; r < R; r++) a[r][p] = v_fma(v_set1(xg[(int64_t)r * K + k]), w, a[r][p]);
                }
        }
    }
    for (int r = 0; r < R; r++) for (int p = 0; p < P; p++) v_store(acc + (r * PMAX + p) * 16, a[r][p]);
}

/* panels per fused() call for R rows */
static inline int fused_panels(int R) { return R == 1 ? 4 : R == 2 ? 2 : 1; }

#define FUSED_CASE(R, P) case R * 8 + P: fused(g, R, P, x, t, acc); break;

/* rows [m0, m1) x panels [t0, t1) through fused(): the fewest row blocks of at most FUSED_ROWS, of
 * sizes within one of each other (each block dequantizes the weights again, so a block costs about
 * as much as its dequantization whatever its rows: 5 rows as 4 + 1 cost ~1.35x 5 rows as one block
 * on a 2-thread AVX2 EPYC, 7 as 4 + 3 less than as 6 + 1 or as one spilling block of 7), panels in
 * groups of fused_panels(rows). Blocks split rows, never an element's chain: the same bits. */
static void few(const Deq* g, int64_t m0, int64_t m1, int t0, int t1, float* acc) {
    const int64_t blocks = (m1 - m0 + FUSED_ROWS - 1) / FUSED_ROWS;
    for (int64_t b = 0, r0 = m0; b < blocks; b++) {
        const int R = (int)((m1 - r0) / (blocks - b));  /* the larger blocks last */
        const float* x = g->x + r0 * g->K;
        for (int t = t0; t < t1;) {
            const int P = t1 - t < fused_panels(R) ? t1 - t : fused_panels(R);
            switch (R * 8 + P) {
                FUSED_CASE(1, 1) FUSED_CASE(1, 2) FUSED_CASE(1, 3) FUSED_CASE(1, 4)
                FUSED_CASE(2, 1) FUSED_CASE(2, 2) FUSED_CASE(3, 1) FUSED_CASE(4, 1)
                FUSED_CASE(5, 1) FUSED_CASE(6, 1)
                default: break;
            }
            for (int r = 0; r < R; r++)
                for (int p = 0; p < P; p++) {
                    const int col = 16 * (t + p), ncols = g->N - col < 16 ? g->N - col : 16;
                    const float* a = acc + (r * PMAX + p) * 16;
                    if (g->out_bf16) {
                        uint16_t* o = (uint16_t*)g->out + (r0 + r) * g->N + col;
                        for (int c = 0; c < ncols; c++) o[c] = f32_to_bf16(a[c]);
                    } else {
                        memcpy((float*)g->out + (r0 + r) * g->N + col, a, sizeof(float) * ncols);
                    }
                }
            t += P;
        }
        r0 += R;
    }
}

/* rows [m0, m1) x panels [t, t + P) */
static void chunk(const Deq* g, int64_t m0, int64_t m1, int t, int P, float* wb, float* acc) {
    const int K = g->K, G = K / 32, ldc = 16 * P;
    const int64_t rows = m1 - m0;
    memset(acc, 0, sizeof(float) * rows * ldc);
    const float* x = g->x + m0 * K;
    for (int grp = 0; grp < G; grp++) {
        for (int p = 0; p < P; p++) {
            dequant(g, t + p, grp, wb);
            rows_p1(x, rows, K, 32 * grp, wb, acc + 16 * p, ldc);
        }
    }
    for (int64_t r = 0; r < rows; r++)
        for (int p = 0; p < P; p++) {
            const int col = 16 * (t + p), ncols = g->N - col < 16 ? g->N - col : 16;
            const float* a = acc + r * ldc + 16 * p;
            if (g->out_bf16) {
                uint16_t* o = (uint16_t*)g->out + (m0 + r) * g->N + col;
                for (int c = 0; c < ncols; c++) o[c] = f32_to_bf16(a[c]);
            } else {
                memcpy((float*)g->out + (m0 + r) * g->N + col, a, sizeof(float) * ncols);
            }
        }
}

/* x [M, K] float32 @ the packed [N, K] weights (bits 4 or 8) -> out [M, N] float32 (or bf16).
 * Returns 1 on bad shapes (K must be a multiple of 32), 3 when a thread finds no memory for its
 * buffers (then no thread writes any output). */
int streamkv_deq_gemm(const float* x, int64_t M, int K, const void* q, const uint16_t* dm, int bits, int N,
                      void* out, int out_bf16) {
    if (M <= 0 || K <= 0 || K % 32 || N <= 0 || (bits != 4 && bits != 8)) return 1;
    Deq g = {x, K, N, bits, q, dm, out, out_bf16};
    const int T = (N + 15) / 16;
    /* units of P panels (units.h; the split never changes an element's chain, so never a bit) */
    const int64_t NMB = (M + MB - 1) / MB;
    const int P = balanced_units(T, NMB, PMAX / 2, PMAX, omp_get_max_threads()), U = (T + P - 1) / P;
    int failed = 0;
    #pragma omp parallel
    {
        float* wb = malloc(sizeof(float) * 512);
        float* acc = malloc(sizeof(float) * MB * PMAX * 16);
        if (!wb || !acc) {
            #pragma omp atomic write
            failed = 1;
        }
        #pragma omp barrier
        /* every thread reads failed after the barrier: all take no unit, or all run */
        #pragma omp for schedule(static)
        for (int64_t i = 0; i < NMB * U; i++) {
            if (failed) continue;
            const int64_t m0 = i / U * MB, m1 = m0 + MB < M ? m0 + MB : M;
            const int t = (int)(i % U) * P, np = T - t < P ? T - t : P;
            if (M <= FUSED_MAX) few(&g, m0, m1, t, t + np, acc);
            else chunk(&g, m0, m1, t, np, wb, acc);
        }
        free(wb);
        free(acc);
    }
    return failed ? 3 : 0;
}
