/* bf16 GEMM over a GGUF's 4-bit weights that gives the dense bf16 GEMM's bits (inv_gemm.c).
 *
 * A bf16 model loaded from a GGUF holds each weight as bf16(d * q + m): gguf's float32 weight
 * (d * q is exact, so one rounding, which fma(d, q, m) reproduces) rounded to nearest even, as
 * vcvtne2ps2bf16 rounds (no such value is a float32 subnormal: d and m are float16 values). A
 * (column, 32-wide k group) block has 16 possible weights, so each block is rebuilt by a table
 * lookup: the 16 values bf16(fma(d, q, m)) for q = 0..15, then one vpmultishiftqb (each word
 * takes its nibble) and one vpermw give the block's 32 weights along k.
 *
 * Packed layout (models/deq_linear.py: pack_deq_bf16), panel t = columns [16t, 16t + 16), group g:
 *
 *   q  [T][G][16][16] uint8:  column c's 32 nibbles, word k of the lookup <- nibble k (order: Q4_ORDER
 *                             in deq_linear.py, nibbles.h)
 *   dm [T][G][16][2] float32: d, m of column c (float16 values)
 *
 * Two ways to the dense bits:
 *
 *   few rows, AMX tiles: the dense tile GEMM computes C[m][n] = sum over 32-wide k blocks, in order,
 *     of TDPBF16PS(x rows as A, weight pairs as B). Here the roles swap: A = 16 weight columns x 32 k
 *     (the lookups, as they come), B = x transposed into k pairs, C'[n][m]. TDPBF16PS adds, per
 *     element and k pair, the products a[2p] b[2p] and a[2p + 1] b[2p + 1] in a fixed order; both
 *     products are exact in float32 and equal whichever operand holds the weight, so C'[n][m] runs
 *     C[m][n]'s chain and gets its bits (tests/test_deq_gemm.py, on an AMX CPU). A decode step (up
 *     to 16 rows) runs four panels at once, four accumulations in flight (quad_1: 0.174 -> 0.155 ms
 *     for one layer's four linears at one row, Intel Xeon, 2 threads);
 *   otherwise: every panel dequantized (lookups, then a 16 x 16 dword transpose into the VNNI
 *     rows) into the dense layout, and streamkv_inv_gemm itself runs over it.
 */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#include "vec16.h"
#include "transpose16.h"
#include "nibbles.h"
#include "amx.h"

int streamkv_inv_gemm(const void* x, int64_t M, int K, const void* wp, int wbf16, int N, void* out, int out_bf16,
                      int path);

#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512VBMI__)
#define DEQ_BF16 1

/* the 32 bf16 weights of one column's group: bf16(fma(d, q, m)) looked up by nibble (vpermw reads
 * 5 index bits; the table is there twice, so the 5th, the next nibble's bit, does not matter) */
static inline __m512i col_weights(const uint8_t* p16, const float* dm, __m512i ctrl, v16 qv) {
    const v16 t = _mm512_fmadd_ps(_mm512_set1_ps(dm[0]), qv, _mm512_set1_ps(dm[1]));
    const __m512i table = (__m512i)_mm512_cvtne2ps_pbh(t, t);
    const __m512i v = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i*)p16));
    return _mm512_permutexvar_epi16(_mm512_multishift_epi64_epi8(ctrl, v), table);
}

/* the 32 bf16 weights of one column's 8-bit group: bf16(d q) (the product exact in float32, then
 * rounded to nearest even as the loader's bf16 copy is) */
static inline __m512i col_weights8(const int8_t* p32, float d) {
    const __m512 dv = _mm512_set1_ps(d);
    const __m512 lo = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p32))), dv);
    const __m512 hi = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(p32 + 16)))), dv);
    return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
}

/* bytes of q and floats of dm per (panel, group): 4-bit [16][16] and [16][2], 8-bit [16][32] and [16] */
#define QG(bits) ((bits) == 4 ? 256 : 512)
#define DG(bits) ((bits) == 4 ? 32 : 16)

/* column c of a (panel, group) block, either width */
static inline __m512i col_w(int bits, const uint8_t* qg, const float* dmg, int c, __m512i ctrl, v16 qv) {
    return bits == 4 ? col_weights(qg + 16 * c, dmg + 2 * c, ctrl, qv) : col_weights8((const int8_t*)qg + 32 * c, dmg[c]);
}

static inline v16 q_values(void) {
    return _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
}

/* the whole weight in inv_gemm.c's bf16 panel layout wp[t][k/2][16][2] */
static void dense_panels(int bits, const uint8_t* q, const float* dm, int K, int T, uint16_t* wp) {
    const int G = K / 32;
    #pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < (int64_t)T * G; i++) {
        const __m512i ctrl = nibble_ctrl();
        const v16 qv = q_values();
        __m512i r[16];
        for (int c = 0; c < 16; c++) r[c] = col_w(bits, q + i * QG(bits), dm + i * DG(bits), c, ctrl, qv);
        transpose16(r);  /* r[p]: dword c = (w[c][2p], w[c][2p + 1]) */
        const int64_t t = i / G, g = i % G;
        for (int p = 0; p < 16; p++) _mm512_storeu_si512((void*)(wp + ((t * K / 2 + 16 * g + p) * 32)), r[p]);
    }
}

#ifdef AMX
#define TILE_ROWS 64  /* rows on tiles per call: four C' tiles of 16 x-rows */
/* gcc's _tile_loadd is an asm that does not say it reads memory: without this barrier the stores
 * that fill a buffer just before it may be dropped or moved past it (a's were: NaN outputs) */
#define TILE_READS(p) __asm__ volatile("" : : "r"(p) : "memory")

/* group g's packed bytes (4-bit: 256 of q, 128 of d and m; 8-bit: 512 and 64) towards L1, a few
 * groups ahead */
#define PF_AHEAD 2
static inline void prefetch_group(int bits, const uint8_t* q, const float* dm) {
    for (int o = 0; o < QG(bits); o += 64) __builtin_prefetch(q + o, 0, 3);
    for (int o = 0; o < DG(bits); o += 16) __builtin_prefetch(dm + o, 0, 3);
}

/* A = a panel's 16 columns x 32 k of group g, as the lookups give them */
static inline __attribute__((always_inline)) void build_a(const int bits, const uint8_t* q, const float* dm, uint16_t* a, __m512i ctrl, v16 qv) {
    for (int col = 0; col < 16; col++)
        _mm512_storeu_si512((void*)(a + 32 * col), col_w(bits, q, dm, col, ctrl, qv));
    TILE_READS(a);
}

/* two panels at once (two independent accumulations in flight, each A built while the other's
 * product runs): C' tiles 0, 1 (panel t, row blocks 0 and 1) and 2, 3 (panel t + 1); A tiles 4, 6
 * double-buffered by group; x blocks in 5, 7. Stored to c: panel t at c, panel t + 1 at c + 512. */
#define PAIR(NB)                                                                                        \
static inline __attribute__((always_inline)) void pair_##NB(const int bits, const uint8_t* q, const float* dm, int G, const uint16_t* xt, uint16_t* a, float* c, \
                      __m512i ctrl, v16 qv) {                                                           \
    const uint8_t* q1 = q + (int64_t)G * QG(bits);                                                           \
    const float* dm1 = dm + (int64_t)G * DG(bits);                                                            \
    _tile_zero(0); _tile_zero(2); if (NB > 1) { _tile_zero(1); _tile_zero(3); }                         \
    for (int g = 0; g < G; g++) {                                                                       \
        uint16_t* a0 = a + (g & 1) * 1024;                                                              \
        if (g + PF_AHEAD < G) {                                                                         \
            prefetch_group(bits, q + (int64_t)(g + PF_AHEAD) * QG(bits), dm + (int64_t)(g + PF_AHEAD) * DG(bits));       \
            prefetch_group(bits, q1 + (int64_t)(g + PF_AHEAD) * QG(bits), dm1 + (int64_t)(g + PF_AHEAD) * DG(bits));     \
        }                                                                                               \
        build_a(bits, q + (int64_t)g * QG(bits), dm + (int64_t)g * DG(bits), a0, ctrl, qv);                              \
        build_a(bits, q1 + (int64_t)g * QG(bits), dm1 + (int64_t)g * DG(bits), a0 + 512, ctrl, qv);                      \
        const uint16_t* b = xt + (int64_t)g * NB * 512;                                                 \
        _tile_loadd(4, a0, 64); _tile_loadd(6, a0 + 512, 64); _tile_loadd(5, b, 64);                    \
        _tile_dpbf16ps(0, 4, 5); _tile_dpbf16ps(2, 6, 5);                                               \
        if (NB > 1) { _tile_loadd(7, b + 512, 64); _tile_dpbf16ps(1, 4, 7); _tile_dpbf16ps(3, 6, 7); }  \
    }                                                                                                   \
    _tile_stored(0, c, 64); _tile_stored(2, c + 512, 64);                                               \
    if (NB > 1) { _tile_stored(1, c + 256, 64); _tile_stored(3, c + 768, 64); }                         \
}
PAIR(1) PAIR(2)

/* four panels, one block of x rows (decode steps): four independent accumulations in flight, C'
 * tiles 0-3 (panel t + p stored at c + 512 p), x in tile 5, the A tiles rotating over 4, 6, 7; a
 * holds two groups' A tiles (8 x 512) */
static inline __attribute__((always_inline)) void quad_1(const int bits, const uint8_t* q, const float* dm, int G, const uint16_t* xt, uint16_t* a, float* c,
                   __m512i ctrl, v16 qv) {
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    for (int g = 0; g < G; g++) {
        uint16_t* ab = a + (g & 1) * 2048;
        for (int p = 0; p < 4; p++) {
            const int64_t at = (int64_t)p * G + g;
            if (g + PF_AHEAD < G) prefetch_group(bits, q + (at + PF_AHEAD) * QG(bits), dm + (at + PF_AHEAD) * DG(bits));
            build_a(bits, q + at * QG(bits), dm + at * DG(bits), ab + 512 * p, ctrl, qv);
        }
        _tile_loadd(5, xt + (int64_t)g * 512, 64);
        _tile_loadd(4, ab, 64); _tile_dpbf16ps(0, 4, 5);
        _tile_loadd(6, ab + 512, 64); _tile_dpbf16ps(1, 6, 5);
        _tile_loadd(7, ab + 1024, 64); _tile_dpbf16ps(2, 7, 5);
        _tile_loadd(4, ab + 1536, 64); _tile_dpbf16ps(3, 4, 5);
    }
    _tile_stored(0, c, 64); _tile_stored(1, c + 512, 64); _tile_stored(2, c + 1024, 64); _tile_stored(3, c + 1536, 64);
}

/* one panel: C'[i] (16 columns x 16 rows of x, block i) over every group, then stored to c */
#define PANEL(NB)                                                                                       \
static inline __attribute__((always_inline)) void panel_##NB(const int bits, const uint8_t* q, const float* dm, const uint16_t* xt, int G, uint16_t* a, float* c, \
                       __m512i ctrl, v16 qv) {                                                          \
    _tile_zero(0); if (NB > 1) _tile_zero(1); if (NB > 2) _tile_zero(2); if (NB > 3) _tile_zero(3);     \
    for (int g = 0; g < G; g++) {                                                                       \
        if (g + PF_AHEAD < G) prefetch_group(bits, q + (int64_t)(g + PF_AHEAD) * QG(bits), dm + (int64_t)(g + PF_AHEAD) * DG(bits)); \
        build_a(bits, q + (int64_t)g * QG(bits), dm + (int64_t)g * DG(bits), a, ctrl, qv);                               \
        _tile_loadd(4, a, 64);                                                                          \
        const uint16_t* b = xt + (int64_t)g * NB * 512;                                                 \
        _tile_loadd(5, b, 64); _tile_dpbf16ps(0, 4, 5);                                                 \
        if (NB > 1) { _tile_loadd(6, b + 512, 64); _tile_dpbf16ps(1, 4, 6); }                           \
        if (NB > 2) { _tile_loadd(7, b + 1024, 64); _tile_dpbf16ps(2, 4, 7); }                          \
        if (NB > 3) { _tile_loadd(5, b + 1536, 64); _tile_dpbf16ps(3, 4, 5); }                          \
    }                                                                                                   \
    _tile_stored(0, c, 64);                                                                             \
    if (NB > 1) _tile_stored(1, c + 256, 64);                                                           \
    if (NB > 2) _tile_stored(2, c + 512, 64);                                                           \
    if (NB > 3) _tile_stored(3, c + 768, 64);                                                           \
}
PANEL(1) PANEL(2) PANEL(3) PANEL(4)

/* C'[n][m] (row blocks of 16 rows, 256 floats apart) -> out[m][16t + n] */
static void store_panel(const float* c, int64_t M, int N, int t, void* out, int out_bf16) {
    const int ncols = N - 16 * t < 16 ? N - 16 * t : 16;
    for (int64_t m = 0; m < M; m++)
        for (int n = 0; n < ncols; n++) {
            const float v = c[(m / 16) * 256 + n * 16 + m % 16];
            if (out_bf16) ((uint16_t*)out)[m * N + 16 * t + n] = f32_to_bf16(v);
            else ((float*)out)[m * N + 16 * t + n] = v;
        }
}

/* The panels of one thread (an orphaned omp for: called inside few_rows_tiles()'s parallel region),
 * a row-tile config set: T panels of the packed weights (bits wide, a constant in each caller below,
 * so the per-column width branch folds away) against the NB 16-row blocks of xt; a, c the thread's
 * A tiles and C' buffers. */
static inline __attribute__((always_inline)) void tile_units(const int bits, const uint8_t* q, const float* dm,
                                                              int G, int T, int NB, int64_t M, int N,
                                                              const uint16_t* xt, void* out, int out_bf16) {
    uint16_t a[8 * 512] __attribute__((aligned(64)));
    float c[4 * 512] __attribute__((aligned(64)));
    const __m512i ctrl = nibble_ctrl();
    const v16 qv = q_values();
    const int pairs = NB <= 2;  /* four C' tiles hold two panels' rows up to 32, four panels' up to 16 */
    const int per = NB == 1 ? 4 : pairs ? 2 : 1, units = (T + per - 1) / per;
    #pragma omp for schedule(static)
    for (int u = 0; u < units; u++) {
        const int t0 = per * u, left = T - t0 < per ? T - t0 : per;
        if (left == 4) {
            quad_1(bits, q + (int64_t)t0 * G * QG(bits), dm + (int64_t)t0 * G * DG(bits), G, xt, a, c, ctrl, qv);
            for (int p = 0; p < 4; p++) store_panel(c + 512 * p, M, N, t0 + p, out, out_bf16);
            continue;
        }
        for (int t = t0; t < t0 + left; t += pairs ? 2 : 1) {
            const int np = pairs && t + 1 < t0 + left ? 2 : 1;
            const uint8_t* qt = q + (int64_t)t * G * QG(bits);
            const float* dmt = dm + (int64_t)t * G * DG(bits);
            if (np == 2) {
                if (NB == 1) pair_1(bits, qt, dmt, G, xt, a, c, ctrl, qv);
                else pair_2(bits, qt, dmt, G, xt, a, c, ctrl, qv);
            } else {
                switch (NB) {
                    case 1: panel_1(bits, qt, dmt, xt, G, a, c, ctrl, qv); break;
                    case 2: panel_2(bits, qt, dmt, xt, G, a, c, ctrl, qv); break;
                    case 3: panel_3(bits, qt, dmt, xt, G, a, c, ctrl, qv); break;
                    default: panel_4(bits, qt, dmt, xt, G, a, c, ctrl, qv); break;
                }
            }
            for (int p = 0; p < np; p++)
                store_panel(c + (np == 2 ? 512 * p : 0), M, N, t + p, out, out_bf16);
        }
    }
}

static void tile_units4(const uint8_t* q, const float* dm, int G, int T, int NB, int64_t M, int N,
                        const uint16_t* xt, void* out, int out_bf16) {
    tile_units(4, q, dm, G, T, NB, M, N, xt, out, out_bf16);
}

static void tile_units8(const uint8_t* q, const float* dm, int G, int T, int NB, int64_t M, int N,
                        const uint16_t* xt, void* out, int out_bf16) {
    tile_units(8, q, dm, G, T, NB, M, N, xt, out, out_bf16);
}

/* M <= TILE_ROWS rows on tiles; 3: no memory (nothing written) */
static int few_rows_tiles(const uint16_t* x, int64_t M, int K, int bits, const uint8_t* q, const float* dm, int N,
                          void* out, int out_bf16) {
    const int G = K / 32, T = (N + 15) / 16, NB = (int)((M + 15) / 16);
    /* x in B's layout, per group and block of 16 rows: xt[g][i][p][r][e] = x[16i + r][32g + 2p + e] */
    uint16_t* xt = calloc((size_t)G * NB * 512, 2);
    if (!xt) return 3;
    for (int64_t m = 0; m < M; m++)
        for (int k = 0; k < K; k++)
            xt[(((int64_t)(k / 32) * NB + m / 16) * 16 + (k % 32) / 2) * 32 + (m % 16) * 2 + k % 2] = x[m * K + k];
    #pragma omp parallel
    {
        amx_configure();
        if (bits == 4) tile_units4(q, dm, G, T, NB, M, N, xt, out, out_bf16);
        else tile_units8(q, dm, G, T, NB, M, N, xt, out, out_bf16);
        _tile_release();
    }
    free(xt);
    return 0;
}
#endif

/* x [M, K] bf16 @ the packed [N, K] weights (bits 4: q, dm as above; 8: q [T][G][16][32] int8, column
 * c's 32 values along k, dm [T][G][16] float32 d) -> out [M, N] (float32, or bf16 when out_bf16), the
 * bits of streamkv_inv_gemm over the dense weights with the same path (0 vector units, 1 AMX tiles,
 * 2 the fma chain). 1: bad shapes (or no AVX512-BF16 build), 3: no memory (out not written). */
int streamkv_deq_gemm_bf16(const uint16_t* x, int64_t M, int K, const uint8_t* q, const float* dm, int bits, int N,
                           void* out, int out_bf16, int path) {
    if (M <= 0 || K <= 0 || K % 32 || N <= 0 || (bits != 4 && bits != 8)) return 1;
    const int T = (N + 15) / 16;
#ifdef AMX
    if (path == 1 && M <= TILE_ROWS && amx_enabled()) return few_rows_tiles(x, M, K, bits, q, dm, N, out, out_bf16);
#endif
    uint16_t* wp = malloc(sizeof(uint16_t) * (size_t)T * 16 * K);
    if (!wp) return 3;
    dense_panels(bits, q, dm, K, T, wp);
    const int rc = streamkv_inv_gemm(x, M, K, wp, 1, N, out, out_bf16, path);
    free(wp);
    return rc;
}

int streamkv_deq_bf16_available(void) { return 1; }
#else
int streamkv_deq_gemm_bf16(const uint16_t* x, int64_t M, int K, const uint8_t* q, const float* dm, int bits, int N,
                           void* out, int out_bf16, int path) {
    (void)x; (void)M; (void)K; (void)q; (void)dm; (void)bits; (void)N; (void)out; (void)out_bf16; (void)path;
    return 1;  /* needs AVX512-BF16 and VBMI */
}

int streamkv_deq_bf16_available(void) { return 0; }
#endif
