/* Small-batch GEMM with 4-bit weights (GGUF Q4_0 / Q4_1 blocks), AVX512-BF16.
 *
 *   out[m, n] = sum_k x[m, k] * w[n, k],   w[n, k] = (q[n, k] - 8) * scale[n, k/32] + zero[n, k/32]
 *
 * computed per 32-column group g as
 *
 *   out[m, n] += scale[n, g] * sum_{k in g} (q[n, k] - 8) x[m, k]  +  zero[n, g] * sum_{k in g} x[m, k]
 *
 * where (q - 8) is exact in bf16, so the inner sums are exact products accumulated in float32.
 *
 * Packed layout (built once at load time by streamkv/models/q4_linear.py), per tile t of 16
 * output rows and group g:
 *
 *   w  [T][G][16 pairs][16 rows] uint8    byte = q[row][2p] | q[row][2p + 1] << 4
 *   sz [T][G][2][16] bf16                 scale and zero of the 16 rows
 *
 * A pair's 16 bytes expand (vpmovzxbd, two 16-entry vpermd tables) into one vector of 16
 * dwords, each the bf16 pair (q[row][2p] - 8, q[row][2p + 1] - 8), which vdpbf16ps multiplies
 * by the broadcast pair (x[m][2p], x[m][2p + 1]): the 16 lanes are the 16 output rows, so no
 * horizontal sums are needed. Rows of x go up to 4 at a time with 4 independent accumulator
 * chains per row (batch-1 decode with a single chain is latency-bound at a third of the memory
 * bandwidth); the chains are the same for every row blocking, so each row's result is
 * independent of how many rows share the call.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>

static inline __m512 bf16x16_to_f32(const uint16_t* p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}

static inline void store_row(void* out, int bf16_out, int64_t at, __mmask16 keep, __m512 v) {
    if (bf16_out)
        _mm256_mask_storeu_epi16((uint16_t*)out + at, keep, (__m256i)_mm512_cvtneps_pbh(v));
    else
        _mm512_mask_storeu_ps((float*)out + at, keep, v);
}

/* bf16 bits of q - 8 for q = 0..15 */
#define Q4_TABLE _mm512_setr_epi32(0xC100, 0xC0E0, 0xC0C0, 0xC0A0, 0xC080, 0xC040, 0xC000, 0xBF80, \
                                   0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0)

/* Group g of rows [m0, m0 + R) of x: o[m] += scale * sum_p (q - 8) x + zero * xsum, with the
 * group's 16 expanded pair vectors W already built. C = 4 chains per row for every R. */
#define DEFINE_ROWS(NAME, R)                                                                              \
static inline void NAME(const uint16_t* x, const float* xsum, int m0, int K, int g, const __m512i W[16],   \
                        __m512 sc, __m512 zr, __m512* o) {                                               \
    const int G = K / 32;                                                                                \
    __m512 a[R][4];                                                                                      \
    for (int m = 0; m < R; m++) for (int c = 0; c < 4; c++) a[m][c] = _mm512_setzero_ps();              \
    for (int p = 0; p < 16; p += 4)                                                                      \
        for (int c = 0; c < 4; c++)                                                                      \
            for (int m = 0; m < R; m++) {                                                                \
                int32_t xp;                                                                              \
                memcpy(&xp, x + (int64_t)(m0 + m) * K + 32 * g + 2 * (p + c), 4);                        \
                a[m][c] = _mm512_dpbf16_ps(a[m][c], (__m512bh)W[p + c], (__m512bh)_mm512_set1_epi32(xp)); \
            }                                                                                            \
    for (int m = 0; m < R; m++) {                                                                        \
        __m512 s = _mm512_add_ps(_mm512_add_ps(a[m][0], a[m][1]), _mm512_add_ps(a[m][2], a[m][3]));      \
        o[m] = _mm512_fmadd_ps(s, sc, o[m]);                                                             \
        o[m] = _mm512_fmadd_ps(zr, _mm512_set1_ps(xsum[(int64_t)(m0 + m) * G + g]), o[m]);              \
    }                                                                                                    \
}

DEFINE_ROWS(rows4, 4)
DEFINE_ROWS(rows2, 2)
DEFINE_ROWS(rows1, 1)

#define MAX_M 64

/* Rows [0, M) (M <= MAX_M) of x against tile t: out[m, 16t .. 16t + 16) (masked to N). Each
 * group's pairs are expanded once and serve every row; a row's arithmetic is the same for
 * every M. */
static void tile(const uint16_t* x, const float* xsum, int M, int K, const uint8_t* wt, const uint16_t* st,
                 void* out, int bf16_out, int64_t ldo, int col0, __mmask16 keep) {
    const int G = K / 32;
    const __m512i tlo = Q4_TABLE, thi = _mm512_slli_epi32(Q4_TABLE, 16), nib = _mm512_set1_epi32(0xF);
    __m512 o[MAX_M];
    __m512i W[16];
    for (int m = 0; m < M; m++) o[m] = _mm512_setzero_ps();
    for (int g = 0; g < G; g++) {
        const uint8_t* wg = wt + g * 256;
        for (int p = 0; p < 16; p++) {
            __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(wg + 16 * p)));
            W[p] = _mm512_or_si512(_mm512_permutexvar_epi32(_mm512_and_si512(v, nib), tlo),
                                   _mm512_permutexvar_epi32(_mm512_srli_epi32(v, 4), thi));
        }
        __m512 sc = bf16x16_to_f32(st + g * 32), zr = bf16x16_to_f32(st + g * 32 + 16);
        int m0 = 0;
        for (; m0 + 4 <= M; m0 += 4) rows4(x, xsum, m0, K, g, W, sc, zr, o + m0);
        if (M - m0 >= 2) { rows2(x, xsum, m0, K, g, W, sc, zr, o + m0); m0 += 2; }
        if (M - m0 >= 1) rows1(x, xsum, m0, K, g, W, sc, zr, o + m0);
    }
    for (int m = 0; m < M; m++) store_row(out, bf16_out, (int64_t)m * ldo + col0, keep, o[m]);
}

/* out [M, N]: float32, or bf16 when bf16_out (rounded to nearest even). */
int streamkv_q4_gemm(const uint16_t* x, int M, int K, const uint8_t* w, const uint16_t* sz, int N, void* out,
                     int bf16_out) {
    if (K % 32 != 0 || M <= 0 || N <= 0) return 1;
    const int G = K / 32;
    float* xsum = malloc(sizeof(float) * M * G);
    for (int m = 0; m < M; m++)
        for (int g = 0; g < G; g++) {
            __m512 lo = bf16x16_to_f32(x + (int64_t)m * K + 32 * g);
            __m512 hi = bf16x16_to_f32(x + (int64_t)m * K + 32 * g + 16);
            xsum[m * G + g] = _mm512_reduce_add_ps(_mm512_add_ps(lo, hi));
        }
    int T = (N + 15) / 16;
    size_t esz = bf16_out ? 2 : 4;
    #pragma omp parallel for schedule(static)
    for (int t = 0; t < T; t++) {
        int ncols = N - 16 * t < 16 ? N - 16 * t : 16;
        __mmask16 keep = (__mmask16)((1u << ncols) - 1);
        for (int m0 = 0; m0 < M; m0 += MAX_M) {
            int mc = M - m0 < MAX_M ? M - m0 : MAX_M;
            tile(x + (int64_t)m0 * K, xsum + (int64_t)m0 * G, mc, K, w + (int64_t)t * G * 256, sz + (int64_t)t * G * 32,
                 (char*)out + (size_t)m0 * N * esz, bf16_out, N, 16 * t, keep);
        }
    }
    free(xsum);
    return 0;
}

int streamkv_q4_available(void) { return 1; }
#else
int streamkv_q4_gemm(const uint16_t* x, int M, int K, const uint8_t* w, const uint16_t* sz, int N, void* out,
                     int bf16_out) {
    (void)x; (void)M; (void)K; (void)w; (void)sz; (void)N; (void)out; (void)bf16_out;
    return 2;
}

int streamkv_q4_available(void) { return 0; }
#endif
