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
 * horizontal sums are needed. Rows of x go R at a time with C independent accumulator chains
 * per row (R * C = 4..8 chains hide the dot product's latency; batch-1 decode with a single
 * chain is latency-bound at a third of the memory bandwidth).
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

/* Rows [m0, m0 + R) of x against tile t: out[m, 16t .. 16t + 16) (masked to N). */
#define DEFINE_TILE(NAME, R, C)                                                                           \
static void NAME(const uint16_t* x, const float* xsum, int m0, int K, const uint8_t* wt, const uint16_t* st, \
                 void* out, int bf16_out, int64_t ldo, int col0, __mmask16 keep) {                        \
    const int G = K / 32;                                                                                \
    const __m512i tlo = Q4_TABLE, thi = _mm512_slli_epi32(Q4_TABLE, 16), nib = _mm512_set1_epi32(0xF);    \
    __m512 o[R];                                                                                         \
    for (int m = 0; m < R; m++) o[m] = _mm512_setzero_ps();                                              \
    for (int g = 0; g < G; g++) {                                                                        \
        __m512 a[R][C];                                                                                  \
        for (int m = 0; m < R; m++) for (int c = 0; c < C; c++) a[m][c] = _mm512_setzero_ps();          \
        const uint8_t* wg = wt + g * 256;                                                                \
        for (int p = 0; p < 16; p += C)                                                                  \
            for (int c = 0; c < C; c++) {                                                                \
                __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(wg + 16 * (p + c)))); \
                __m512i wv = _mm512_or_si512(_mm512_permutexvar_epi32(_mm512_and_si512(v, nib), tlo),   \
                                             _mm512_permutexvar_epi32(_mm512_srli_epi32(v, 4), thi));    \
                for (int m = 0; m < R; m++) {                                                            \
                    int32_t xp;                                                                          \
                    memcpy(&xp, x + (int64_t)(m0 + m) * K + 32 * g + 2 * (p + c), 4);                    \
                    a[m][c] = _mm512_dpbf16_ps(a[m][c], (__m512bh)wv, (__m512bh)_mm512_set1_epi32(xp)); \
                }                                                                                        \
            }                                                                                            \
        __m512 sc = bf16x16_to_f32(st + g * 32), zr = bf16x16_to_f32(st + g * 32 + 16);                  \
        for (int m = 0; m < R; m++) {                                                                    \
            __m512 s = a[m][0];                                                                          \
            for (int c = 1; c < C; c++) s = _mm512_add_ps(s, a[m][c]);                                   \
            o[m] = _mm512_fmadd_ps(s, sc, o[m]);                                                         \
            o[m] = _mm512_fmadd_ps(zr, _mm512_set1_ps(xsum[(int64_t)(m0 + m) * G + g]), o[m]);          \
        }                                                                                                \
    }                                                                                                    \
    for (int m = 0; m < R; m++) store_row(out, bf16_out, (int64_t)(m0 + m) * ldo + col0, keep, o[m]);     \
}

DEFINE_TILE(tile_r8, 8, 1)
DEFINE_TILE(tile_r4, 4, 2)
DEFINE_TILE(tile_r2, 2, 4)
DEFINE_TILE(tile_r1, 1, 4)

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
    #pragma omp parallel for schedule(static)
    for (int t = 0; t < T; t++) {
        const uint8_t* wt = w + (int64_t)t * G * 256;
        const uint16_t* st = sz + (int64_t)t * G * 32;
        int ncols = N - 16 * t < 16 ? N - 16 * t : 16;
        __mmask16 keep = (__mmask16)((1u << ncols) - 1);
        int m0 = 0;
        for (; m0 + 8 <= M; m0 += 8) tile_r8(x, xsum, m0, K, wt, st, out, bf16_out, N, 16 * t, keep);
        if (M - m0 >= 4) { tile_r4(x, xsum, m0, K, wt, st, out, bf16_out, N, 16 * t, keep); m0 += 4; }
        if (M - m0 >= 2) { tile_r2(x, xsum, m0, K, wt, st, out, bf16_out, N, 16 * t, keep); m0 += 2; }
        if (M - m0 >= 1) tile_r1(x, xsum, m0, K, wt, st, out, bf16_out, N, 16 * t, keep);
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
