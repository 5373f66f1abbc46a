/* GEMM with GGUF block-quantized weights (Q4_0 / Q4_1, and Q8_0 for LM heads), AVX512-BF16;
 * batch-invariant.
 *
 *   out[m, n] = sum_k x[m, k] * w[n, k],   w[n, k] = (q[n, k] - 8) * scale[n, k/32] + zero[n, k/32]
 *
 * Every output element runs the same chain of roundings whatever M, its row's place in the
 * batch, the blocking or the thread count:
 *
 *   o = 0
 *   for each 32-column group g, in order:
 *       s = 0;  s = vdpbf16ps(s, (q - 8) pair p, x pair p)  for p = 0 .. 15       (exact products)
 *       o = fma(s, scale[n, g], o);  o = fma(zero[n, g], xsum[m, g], o)
 *
 * (q - 8) is exact in bf16; xsum[m, g] is the group's sum of x in float32 (v_hsum of two
 * lane-wise halves). Lanes are 16 output rows n, so no horizontal sums are needed.
 *
 * The fma chain (fma = 1, ``linear=q4f``) replaces each vdpbf16ps by two float32 fmas of the same
 * exact products, the pair's odd k first, as the instruction's definition adds them:
 *
 *       s = fma(x[2p], q[2p] - 8, fma(x[2p + 1], q[2p + 1] - 8, s))
 *
 * the same for every M (every blocking below takes it). vdpbf16ps rounds each addition to nearest
 * even and flushes float32 denormals (inputs and results) to zero; the fmas round alike and keep
 * denormals, so the two chains agree wherever no partial sum or x falls below 2^-126 (on the Intel
 * Xeons: bit for bit over random prompts, tests/test_q4_fma.py). Where vdpbf16ps issues at
 * half the float32 fma rate (Intel Xeons without AMX: 207 vs 422 GFLOP/s register-only, 2 vCPUs,
 * benchmarks/fma_peak.c) it runs a 1,024-row prompt GEMM ~1.4x faster; the choice between the two
 * is measured (native/tuning.py). x is widened to float32 once per call (exact).
 *
 * Packed layout (streamkv/models/q4_linear.py: pack_native), per tile t of 16 output rows and
 * group g:  w [T][G][16 pairs][16 bytes]   byte = q[row][2p] | q[row][2p + 1] << 4
 *           sz [T][G][2][16] bf16          scale and zero of the 16 rows
 * with the 16 bytes of a pair in the row order ROWS below, so that one 128-bit broadcast, one
 * vpmultishiftqb (each 16-bit word picks its nibble) and one vpermw (nibble -> bf16(q - 8))
 * expand a pair into the 16-lane vector of (q[row][2p] - 8, q[row][2p + 1] - 8) bf16 pairs.
 *
 * Q8_0 (w = d * q, q int8): the same chain with the int8 pairs widened exactly to bf16 and no
 * zero term (o = fma(s, d[n, g], o)); packed w [T][G][16 pairs][32 bytes] (row r's pair at bytes
 * 2r, 2r + 1), d [T][G][16] float32 (the file's f16 scales, exact).
 *
 * Three blockings of the same arithmetic:
 *   few rows (M < 8):  all M rows x P tiles of accumulators in registers, pairs expanded as they
 *                      are used, one pass over the weights (decode: bound by the weight bytes);
 *                      the fma chain instead takes the next blocking from 1 row on;
 *   fma, <= 32 rows:   chunks of up to 16 rows (balanced; 2 tiles at a time for up to 8 rows,
 *                      else 1) with the pairs expanded and widened as they are read, x transposed
 *                      so a pair's rows are adjacent (q4_fma_rows.h: mid_rows). Against the
 *                      blocking below, per layer of the 135M model, 2 threads, Intel Xeon without
 *                      AMX: 5 rows -15%, 8 -15%, 16 -19%, 32 -8% time; at 44-48 rows it loses 8-13%;
 *   more rows:         two tiles' pairs are expanded once per block of 96 rows (x stays in L2),
 *                      then 6 rows at a time stream past them (4 + 3 or 4 + 4 for a remainder of
 *                      7 or 8: no block of 1-2 rows); threads take (row block, tiles) items one
 *                      at a time (dynamic: a vCPU the host slows takes fewer). The fma chain
 *                      takes three tiles at a time, their pairs widened to float32 once per block
 *                      of 192 rows (no widening in the inner loop: 36 fmas per pair for 6 rows x 3
 *                      tiles, 6 vector and 12 broadcast loads), and runs the block's rows 4 groups
 *                      at a time (48 KB of widened pairs, in L1; the outputs wait in memory between
 *                      passes). One 512 x 576 x 1,536 GEMM, 1 thread, Intel Xeon without AMX:
 *                      133 -> 150-165 GFLOP/s (torch float32: ~189; the fma peak: 213).
 */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vec16.h"
#include "nibbles.h"

#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>

#define MB 96    /* rows per block (x stays in L2) */
#define MBF 192  /* the fma chain's rows per block: its pairs, widened, cost twice as much to expand */
#define PF 3     /* the fma chain's tiles per item (6 rows x 3 tiles of accumulators) */
#define MID_MAX 32  /* the fma chain, 1-32 rows: chunks of <= MID_RMAX rows, pairs expanded as read */
#define MID_RMAX 16
#define MID_P2 8     /* chunks of up to this many rows take 2 tiles at a time, longer ones 1 */
#define KG 4     /* the fma chain: groups per pass over a block's rows (their widened pairs stay in L1) */

/* bf16 bits of q - 8 for q = 0..15, twice (vpermw reads 5 index bits; the 5th is don't-care) */
static inline __m512i q4_table(void) {
    static const uint16_t t[32] = {0xC100, 0xC0E0, 0xC0C0, 0xC0A0, 0xC080, 0xC040, 0xC000, 0xBF80,
                                   0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0,
                                   0xC100, 0xC0E0, 0xC0C0, 0xC0A0, 0xC080, 0xC040, 0xC000, 0xBF80,
                                   0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0};
    return _mm512_loadu_si512((const void*)t);
}

#if defined(__AVX512VBMI__)
static inline __m512i shift_ctrl(void) { return nibble_ctrl(); }  /* nibbles.h */

static inline __m512i expand(const uint8_t* p16, __m512i ctrl, __m512i table) {
    const __m512i v = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i*)p16));
    return _mm512_permutexvar_epi16(_mm512_multishift_epi64_epi8(ctrl, v), table);
}
#else
/* without VBMI: widen the 16 bytes, put them back in row order, look both nibbles up */
static inline __m512i shift_ctrl(void) {
    return _mm512_setr_epi32(0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15);  /* lane -> byte */
}

static inline __m512i expand(const uint8_t* p16, __m512i ctrl, __m512i table) {
    const __m512i v = _mm512_permutexvar_epi32(ctrl, _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p16)));
    const __m512i lo = _mm512_and_si512(v, _mm512_set1_epi32(0xF)), hi = _mm512_srli_epi32(v, 4);
    return _mm512_or_si512(_mm512_and_si512(_mm512_permutexvar_epi16(lo, table), _mm512_set1_epi32(0xFFFF)),
                           _mm512_slli_epi32(_mm512_permutexvar_epi16(hi, table), 16));
}
#endif

/* Q8_0: 16 rows' pair p (32 int8, row-major pairs) -> 16 lanes of 2 bf16, exact */
static inline __m512i expand8(const int8_t* p32) {
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p32)));
    const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(p32 + 16))));
    return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
}

static inline __m512 bf16x16(const uint16_t* p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}

static inline void store_row(void* out, int bf16_out, int64_t at, __mmask16 keep, __m512 v) {
    if (bf16_out) {
        uint16_t t[16];
        v_store_bf16(t, v);
        _mm256_mask_storeu_epi16((uint16_t*)out + at, keep, _mm256_loadu_si256((const __m256i*)t));
    } else {
        _mm512_mask_storeu_ps((float*)out + at, keep, v);
    }
}

typedef struct {
    const uint16_t* x;   /* [M, K] bf16 */
    const float* xsum;   /* [M, G] (Q4 only) */
    const float* xw;     /* [M, K] x widened to float32: the fma chain; NULL: vdpbf16ps */
    const float* xt;     /* [K / 2][M][2] the same, transposed: the fma chain's mid rows */
    const uint8_t* w;
    const void* sz;      /* Q4: scale and zero bf16 [T][G][2][16]; Q8: d float32 [T][G][16] */
    void* out;
    int64_t M;
    int K, G, N, T, bf16_out;
} Q4;

/* pair p of group g of tile t, expanded (Q8: compile-time constant) */
static inline __attribute__((always_inline)) __m512i wvec(const Q4* a, const int Q8, int t, int g, int p,
                                                          __m512i ctrl, __m512i table) {
    if (Q8) return expand8((const int8_t*)a->w + (((int64_t)t * a->G + g) * 16 + p) * 32);
    return expand(a->w + ((int64_t)t * a->G + g) * 256 + 16 * p, ctrl, table);
}

static inline __attribute__((always_inline)) void group_scale(const Q4* a, const int Q8, int t, int g, __m512* sc,
                                                              __m512* zr) {
    if (Q8) {
        *sc = _mm512_loadu_ps((const float*)a->sz + ((int64_t)t * a->G + g) * 16);
        *zr = _mm512_setzero_ps();
        return;
    }
    const uint16_t* st = (const uint16_t*)a->sz + ((int64_t)t * a->G + g) * 32;
    *sc = bf16x16(st);
    *zr = bf16x16(st + 16);
}

/* o = fma(s, scale, o), then (Q4) o = fma(zero, xsum, o) */
static inline __attribute__((always_inline)) __m512 group_end(const Q4* a, const int Q8, __m512 s, __m512 sc,
                                                              __m512 zr, int64_t m, int g, __m512 o) {
    o = _mm512_fmadd_ps(s, sc, o);
    return Q8 ? o : _mm512_fmadd_ps(zr, _mm512_set1_ps(a->xsum[m * a->G + g]), o);
}

static inline uint32_t xpair(const Q4* a, int64_t m, int g, int p) {
    uint32_t v;
    memcpy(&v, a->x + m * a->K + 32 * g + 2 * p, 4);
    return v;
}

/* inside a team: this thread's contiguous share [*t0, *t1) of T tiles (balanced to one tile) */
static inline void my_tiles(int T, int* t0, int* t1) {
    const int nth = omp_get_num_threads(), id = omp_get_thread_num();
    *t0 = (int)((int64_t)T * id / nth);
    *t1 = (int)((int64_t)T * (id + 1) / nth);
}

static inline __mmask16 keep_of(const Q4* a, int t) {
    const int n = a->N - 16 * t < 16 ? a->N - 16 * t : 16;
    return (__mmask16)((1u << n) - 1);
}

/* few rows: R rows x P tiles [t0, t0 + P), every group, accumulators in registers */
static inline __attribute__((always_inline)) void small(const Q4* a, const int Q8, const int R, const int P,
                                                        int64_t m0, int t0) {
    const __m512i ctrl = shift_ctrl(), table = q4_table();
    __m512 o[7][4];
    for (int r = 0; r < R; r++) for (int i = 0; i < P; i++) o[r][i] = _mm512_setzero_ps();
    for (int g = 0; g < a->G; g++) {
        __m512 s[7][P];
        for (int r = 0; r < R; r++) for (int i = 0; i < P; i++) s[r][i] = _mm512_setzero_ps();
        for (int p = 0; p < 16; p++) {
            __m512i W[4];
            for (int i = 0; i < P; i++) W[i] = wvec(a, Q8, t0 + i, g, p, ctrl, table);
            for (int r = 0; r < R; r++) {
                const __m512bh xb = (__m512bh)_mm512_set1_epi32((int)xpair(a, m0 + r, g, p));
                for (int i = 0; i < P; i++) s[r][i] = _mm512_dpbf16_ps(s[r][i], (__m512bh)W[i], xb);
            }
        }
        for (int i = 0; i < P; i++) {
            __m512 sc, zr;
            group_scale(a, Q8, t0 + i, g, &sc, &zr);
            for (int r = 0; r < R; r++) o[r][i] = group_end(a, Q8, s[r][i], sc, zr, m0 + r, g, o[r][i]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int i = 0; i < P; i++) store_row(a->out, a->bf16_out, (m0 + r) * a->N + 16 * (t0 + i), keep_of(a, t0 + i), o[r][i]);
}

/* R (1-7) rows against tiles [t0, t1), all rows in one pass over the weights (5-7 rows used to be
 * 4 + the rest, two passes): up to 4 tiles at once for one row (its 16 dpbf16 chains of a group are
 * dependent: several tiles in flight hide their latency), fewer for more rows (R x P accumulators
 * and as many partial sums fit the registers; 5-7 rows x 1 tile are chains enough) */
#define SMALL_ROWS(NAME, Q8)                                                                                   \
    static void NAME(const Q4* a, int R, int64_t m0, int t0, int t1) {                                         \
        for (int t = t0; t < t1;) {                                                                            \
            const int left = t1 - t, P = left >= 4 && R <= 2 ? 4 : left >= 2 && R <= 4 ? 2 : 1;                \
            switch (R * 8 + P) {                                                                               \
                case 12: small(a, Q8, 1, 4, m0, t); break;  case 10: small(a, Q8, 1, 2, m0, t); break;         \
                case 9: small(a, Q8, 1, 1, m0, t); break;   case 20: small(a, Q8, 2, 4, m0, t); break;         \
                case 18: small(a, Q8, 2, 2, m0, t); break;  case 17: small(a, Q8, 2, 1, m0, t); break;         \
                case 26: small(a, Q8, 3, 2, m0, t); break;  case 25: small(a, Q8, 3, 1, m0, t); break;         \
                case 34: small(a, Q8, 4, 2, m0, t); break;  case 33: small(a, Q8, 4, 1, m0, t); break;         \
                case 41: small(a, Q8, 5, 1, m0, t); break;  case 49: small(a, Q8, 6, 1, m0, t); break;         \
                default: small(a, Q8, 7, 1, m0, t); break;                                                     \
            }                                                                                                  \
            t += P;                                                                                            \
        }                                                                                                      \
    }
SMALL_ROWS(small_rows_q4, 0)
SMALL_ROWS(small_rows_q8, 1)

/* more rows: R rows from m against P tiles whose pairs are expanded in buf [G][16][P] (and their
 * scales and zeros in sz [G][P][2]); accumulators and outputs in registers across the groups */
static inline __attribute__((always_inline)) void blk(const Q4* a, const int Q8, const int R, const int P, int64_t m,
                                                      int t, const __m512i* buf, const __m512* scz) {
    __m512 o[6][2];
    for (int r = 0; r < R; r++) for (int i = 0; i < P; i++) o[r][i] = _mm512_setzero_ps();
    for (int g = 0; g < a->G; g++) {
        __m512 s[6][P];
        for (int r = 0; r < R; r++) for (int i = 0; i < P; i++) s[r][i] = _mm512_setzero_ps();
        for (int p = 0; p < 16; p++)
            for (int r = 0; r < R; r++) {
                const __m512bh xb = (__m512bh)_mm512_set1_epi32((int)xpair(a, m + r, g, p));
                for (int i = 0; i < P; i++)
                    s[r][i] = _mm512_dpbf16_ps(s[r][i], (__m512bh)buf[(g * 16 + p) * P + i], xb);
            }
        for (int r = 0; r < R; r++)
            for (int i = 0; i < P; i++)
                o[r][i] = group_end(a, Q8, s[r][i], scz[(g * P + i) * 2], scz[(g * P + i) * 2 + 1], m + r, g, o[r][i]);
    }
    for (int r = 0; r < R; r++)
        for (int i = 0; i < P; i++) store_row(a->out, a->bf16_out, (m + r) * a->N + 16 * (t + i), keep_of(a, t + i), o[r][i]);
}

#define BLK_ROWS(R)                                                                                          \
    static void blk##R(const Q4* a, int q8, int P, int64_t m, int t, const __m512i* buf, const __m512* scz) { \
        if (q8) { if (P == 2) blk(a, 1, R, 2, m, t, buf, scz); else blk(a, 1, R, 1, m, t, buf, scz); }       \
        else { if (P == 2) blk(a, 0, R, 2, m, t, buf, scz); else blk(a, 0, R, 1, m, t, buf, scz); }          \
    }
BLK_ROWS(1) BLK_ROWS(2) BLK_ROWS(3) BLK_ROWS(4) BLK_ROWS(5) BLK_ROWS(6)

#include "q4_fma_rows.h"

/* n rows in blocks of 6; a remainder of 1 or 2 rows joins the last six as 4 + 3 or 4 + 4 (one or
 * two rows alone keep only 2-4 accumulator chains in flight, latency-bound) -> the block count */
static int row_blocks(int64_t n, int* sz) {
    int nb = 0;
    const int64_t six = n >= 6 && n % 6 > 0 && n % 6 < 3 ? n / 6 - 1 : n / 6;
    for (int64_t i = 0; i < six; i++, n -= 6) sz[nb++] = 6;
    if (n >= 7) { sz[nb++] = 4; n -= 4; }
    if (n > 0) sz[nb++] = (int)n;
    return nb;
}

/* rows [m0, m1) against tiles [t, t + P): expand every group of the P tiles once (buf), then
 * 6 rows at a time */
static void big_tiles(const Q4* a, int q8, int64_t m0, int64_t m1, int t, int P, __m512i* buf, __m512* scz,
                      __m512* ob) {
    const __m512i ctrl = shift_ctrl(), table = q4_table();
    for (int g = 0; g < a->G; g++)
        for (int i = 0; i < P; i++) {
            for (int p = 0; p < 16; p++) {
                const __m512i W = q8 ? wvec(a, 1, t + i, g, p, ctrl, table) : wvec(a, 0, t + i, g, p, ctrl, table);
                __m512* wide = (__m512*)buf + ((g * 16 + p) * P + i) * 2;   /* the fma chain's layout */
                if (a->xw) v_bf16_pairs(W, wide, wide + 1);
                else buf[(g * 16 + p) * P + i] = W;
            }
            if (q8) group_scale(a, 1, t + i, g, &scz[(g * P + i) * 2], &scz[(g * P + i) * 2 + 1]);
            else group_scale(a, 0, t + i, g, &scz[(g * P + i) * 2], &scz[(g * P + i) * 2 + 1]);
        }
    int sz[MBF / 6 + 2];
    const int nb = row_blocks(m1 - m0, sz);
    if (a->xw) {  /* the fma chain: group by group over every block of rows, o in ob [MBF][PF] */
        void (*const f[7])(const Q4*, int, int64_t, int, int, const __m512*, const __m512*, __m512*) = {
            NULL, fma1, fma2, fma3, fma4, fma5, fma6};
        for (int r = 0; r < PF * (m1 - m0); r++) ob[r] = _mm512_setzero_ps();
        for (int g = 0; g < a->G; g += KG)
            for (int64_t b = 0, m = m0; b < nb; m += sz[b++])
                f[sz[b]](a, P, m, g, g + KG < a->G ? g + KG : a->G, (const __m512*)buf, scz, ob + PF * (m - m0));
        for (int64_t m = m0; m < m1; m++)
            for (int i = 0; i < P; i++) store_row(a->out, a->bf16_out, m * a->N + 16 * (t + i), keep_of(a, t + i), ob[PF * (m - m0) + i]);
        return;
    }
    void (*const f[7])(const Q4*, int, int, int64_t, int, const __m512i*, const __m512*) = {
        NULL, blk1, blk2, blk3, blk4, blk5, blk6};
    for (int64_t b = 0, m = m0; b < nb; m += sz[b++]) f[sz[b]](a, q8, P, m, t, buf, scz);
}

static int gemm(const uint16_t* x, int M, int K, const uint8_t* w, const void* sz, int N, void* out, int bf16_out,
                int q8, int fma) {
    if (K % 32 != 0 || M <= 0 || N <= 0) return 1;
    const int G = K / 32, T = (N + 15) / 16;
    float* xsum = q8 ? NULL : malloc(sizeof(float) * (size_t)M * G);
    float* xw = fma ? malloc(sizeof(float) * (size_t)M * K) : NULL;
    if ((!q8 && !xsum) || (fma && !xw)) {
        free(xsum);
        free(xw);
        return 3;  /* no memory: never the other chain's bits instead */
    }
    const int mid = fma && M <= MID_MAX;   /* xw holds x transposed (xt) */
    /* per row (either way the same bits): the groups' sums; for the fma chain x widened to float32
     * (exact: bf16 -> float32 is a shift) */
    #pragma omp parallel for schedule(static) if (M >= 8)
    for (int64_t m = 0; m < M; m++) {
        for (int g = 0; !q8 && g < G; g++)
            xsum[m * G + g] = v_hsum(v_add(v_load_bf16(x + m * K + 32 * g), v_load_bf16(x + m * K + 32 * g + 16)));
        /* xt (mid rows): 8 pairs widened at a time, each pair's 8 bytes scattered to its place */
        const int64_t M2 = 2 * M;
        const __m512i at = _mm512_setr_epi64(0, M2, 2 * M2, 3 * M2, 4 * M2, 5 * M2, 6 * M2, 7 * M2);
        for (int k = 0; mid && k < K; k += 16)
            _mm512_i64scatter_epi64(xw + ((int64_t)(k / 2) * M + m) * 2, at,
                                    _mm512_castps_si512(v_load_bf16(x + m * K + k)), 4);
        for (int k = 0; fma && !mid && k < K; k += 16) v_store(xw + m * K + k, v_load_bf16(x + m * K + k));
    }
    const Q4 a = {x, xsum, mid ? NULL : xw, mid ? xw : NULL, w, sz, out, M, K, G, N, T, bf16_out};
    void (*small_rows)(const Q4*, int, int64_t, int, int) = q8 ? small_rows_q8 : small_rows_q4;
    if (mid) {
        mid_rows(&a);
    } else if (M < 8) {
        /* each thread takes a contiguous range of tiles (balanced to one tile) */
        #pragma omp parallel
        {
            int t0, t1;
            my_tiles(T, &t0, &t1);
            small_rows(&a, M, 0, t0, t1);
        }
    } else {
        /* one team for the whole call: (row block, tile item) pairs handed out one at a time,
         * block by block (a block's rows stay in L2 for both threads), so a thread the host slows
         * takes fewer pairs instead of holding the others at a barrier per block */
        const int mb = fma ? MBF : MB, step = fma ? PF : 2;   /* rows per block, tiles per item */
        const int items = (T + step - 1) / step, pairs = (int)((M + mb - 1) / mb) * items;
        int nomem = 0;
        #pragma omp parallel
        {
            /* each thread's own buffers (from its own malloc arena, reused call after call) */
            __m512i* buf = aligned_alloc(64, sizeof(__m512i) * (fma ? 32 * PF : 32) * G);  /* fma: widened */
            __m512* scz = aligned_alloc(64, sizeof(__m512) * 2 * PF * G);
            __m512* ob = fma ? aligned_alloc(64, sizeof(__m512) * PF * MBF) : NULL;  /* the fma chain's outputs */
            if (!buf || !scz || (fma && !ob)) {
                #pragma omp atomic write
                nomem = 1;
            }
            #pragma omp barrier
            /* every thread reads nomem after the barrier: all take no pair, or all run */
            #pragma omp for schedule(dynamic, 1)
            for (int j = 0; j < pairs; j++) {
                if (nomem) continue;
                const int64_t m0 = (int64_t)(j / items) * mb, m1 = m0 + mb < M ? m0 + mb : M;
                const int t = (j % items) * step;
                big_tiles(&a, q8, m0, m1, t, T - t < step ? T - t : step, buf, scz, ob);
            }
            free(buf);
            free(scz);
            free(ob);
        }
        if (nomem) {
            free(xsum);
            free(xw);
            return 3;  /* no memory: nothing written, never a crash */
        }
    }
    free(xsum);
    free(xw);
    return 0;
}

/* out [M, N]: float32, or bf16 when bf16_out (nearest even); fma: the fma chain (above) */
int streamkv_q4_gemm(const uint16_t* x, int M, int K, const uint8_t* w, const uint16_t* sz, int N, void* out,
                     int bf16_out, int fma) {
    return gemm(x, M, K, w, sz, N, out, bf16_out, 0, fma);
}

/* Q8_0 weights, out [M, N] float32 */
int streamkv_q8_gemm(const uint16_t* x, int M, int K, const int8_t* w, const float* d, int N, float* out) {
    return gemm(x, M, K, (const uint8_t*)w, d, N, out, 0, 1, 0);
}

int streamkv_q4_available(void) { return 1; }
#else
int streamkv_q4_gemm(const uint16_t* x, int M, int K, const uint8_t* w, const uint16_t* sz, int N, void* out,
                     int bf16_out, int fma) {
    (void)x; (void)M; (void)K; (void)w; (void)sz; (void)N; (void)out; (void)bf16_out; (void)fma;
    return 2;
}

int streamkv_q8_gemm(const uint16_t* x, int M, int K, const int8_t* w, const float* d, int N, float* out) {
    (void)x; (void)M; (void)K; (void)w; (void)d; (void)N; (void)out;
    return 2;
}

int streamkv_q4_available(void) { return 0; }
#endif
