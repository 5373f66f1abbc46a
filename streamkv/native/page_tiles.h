/* The page-scoring tiles of page_select.c (included there, after LANES, PT, bf16_to_f32 and
 * PS_BF16 / PS_AVX2): tile() puts 16 query rows in the lanes, page_tile() 16 pages (a few
 * rows), each an AVX512-BF16, AVX2 and (tile() only) scalar form with the same chains; see the
 * layouts at the top of page_select.c. */
#ifndef STREAMKV_PAGE_TILES_H
#define STREAMKV_PAGE_TILES_H

/* One tile: ub[pp][lane] for PT pages (block ids c[0..PT)) and the LANES rows of qt. */
static void tile(const uint16_t *qt, const uint16_t *bounds, const int64_t *c, int kvh, int h, int D2, float *ub) {
    const uint16_t *b[PT];
    for (int pp = 0; pp < PT; pp++) b[pp] = bounds + ((size_t)c[pp] * kvh + h) * D2;
#ifdef PS_BF16
    __m512 acc[PT];
    for (int pp = 0; pp < PT; pp++) acc[pp] = _mm512_setzero_ps();
    for (int cp = 0; cp < D2 / 2; cp++) {
        __m512bh qv = (__m512bh)_mm512_loadu_si512(qt + (size_t)cp * LANES * 2);
        for (int pp = 0; pp < PT; pp++) {
            int32_t pair;
            memcpy(&pair, b[pp] + 2 * cp, sizeof pair);
            acc[pp] = _mm512_dpbf16_ps(acc[pp], qv, (__m512bh)_mm512_set1_epi32(pair));
        }
    }
    for (int pp = 0; pp < PT; pp++) _mm512_storeu_ps(ub + pp * LANES, acc[pp]);
#elif defined(PS_AVX2)
    /* a 32-bit lane of qt holds one row's channel pair: low half channel 2cp, high half 2cp + 1 */
    const __m256i high = _mm256_set1_epi32((int)0xffff0000u);
    for (int p0 = 0; p0 < PT; p0 += 4) {
        __m256 acc[4][2];
        for (int pp = 0; pp < 4; pp++) acc[pp][0] = acc[pp][1] = _mm256_setzero_ps();
        for (int cp = 0; cp < D2 / 2; cp++) {
            __m256 qe[2], qo[2];
            for (int hf = 0; hf < 2; hf++) {              /* rows 8 hf .. 8 hf + 7 */
                __m256i x = _mm256_loadu_si256((const __m256i *)(qt + ((size_t)cp * LANES + 8 * hf) * 2));
                qe[hf] = _mm256_castsi256_ps(_mm256_slli_epi32(x, 16));
                qo[hf] = _mm256_castsi256_ps(_mm256_and_si256(x, high));
            }
            for (int pp = 0; pp < 4; pp++) {
                const __m256 be = _mm256_set1_ps(bf16_to_f32(b[p0 + pp][2 * cp]));
                const __m256 bo = _mm256_set1_ps(bf16_to_f32(b[p0 + pp][2 * cp + 1]));
                for (int hf = 0; hf < 2; hf++)
                    acc[pp][hf] = _mm256_fmadd_ps(qo[hf], bo, _mm256_fmadd_ps(qe[hf], be, acc[pp][hf]));
            }
        }
        for (int pp = 0; pp < 4; pp++)
            for (int hf = 0; hf < 2; hf++) _mm256_storeu_ps(ub + (p0 + pp) * LANES + 8 * hf, acc[pp][hf]);
    }
#else
    for (int pp = 0; pp < PT; pp++)
        for (int l = 0; l < LANES; l++) {
            float s = 0.f;
            for (int cp = 0; cp < D2 / 2; cp++)
                for (int e = 0; e < 2; e++)
                    s = fmaf(bf16_to_f32(qt[((size_t)cp * LANES + l) * 2 + e]), bf16_to_f32(b[pp][2 * cp + e]), s);
            ub[pp * LANES + l] = s;
        }
#endif
}

#define FEW 4      /* rows (n = R g) up to which the pages go in lanes (page_tile()) */
#define GROUPS 4   /* 16-page groups per page_tile() call */

#ifdef PS_BF16
#include "transpose16.h"

/* The same ub as tile() for FEW rows (a decode row's kv group), pages in lanes instead of rows:
 * 16 pages' bound pairs transposed (Bt[c][page]) and each row's query pair broadcast, so one
 * vdpbf16ps adds 2 channels of 16 pages for one row. Per (page, row) it is the same chain of
 * vdpbf16ps over c = 0 .. D2/2 - 1 with the same products (the instruction multiplies its two
 * bf16 sources lane by lane, so which one holds the query does not matter): the same bits as
 * tile(), with 16 / n times fewer instructions when n rows would fill 16 lanes. It writes lanes
 * [lane0, lane0 + n) of ub (the caller zeroes the rest, as tile() gets them from zero queries).
 * A call runs GROUPS n independent vdpbf16ps chains. */
static inline __attribute__((always_inline)) void page_chains(const int NR, int ng, int C, const __m512i *Bt,
                                                               const uint16_t *qt, __m512 acc[GROUPS][FEW]) {
    for (int gi = 0; gi < ng; gi++)
        for (int i = 0; i < NR; i++) acc[gi][i] = _mm512_setzero_ps();
    for (int c = 0; c < C; c++)
        for (int i = 0; i < NR; i++) {
            int32_t pair;
            memcpy(&pair, qt + ((size_t)c * LANES + i) * 2, sizeof pair);
            const __m512bh qb = (__m512bh)_mm512_set1_epi32(pair);
            for (int gi = 0; gi < ng; gi++) acc[gi][i] = _mm512_dpbf16_ps(acc[gi][i], (__m512bh)Bt[gi * C + c], qb);
        }
}

static void page_tile(const uint16_t *qt, const uint16_t *bounds, const int64_t *c, int ng, int kvh, int h, int D2,
                      int n, int lane0, float *ub) {
    const int C = D2 / 2;                                 /* channel pairs */
    __m512i Bt[GROUPS * 64];                              /* Bt[g C + pair][page]; D2 <= 128 */
    for (int gi = 0; gi < ng; gi++)
        for (int v = 0; v < C / 16; v++) {                /* pairs 16 v .. 16 v + 15 of 16 pages */
            __m512i r[16];
            for (int pp = 0; pp < 16; pp++)
                r[pp] = _mm512_loadu_si512(bounds + ((size_t)c[16 * gi + pp] * kvh + h) * D2 + 32 * v);
            transpose16(r);
            for (int j = 0; j < 16; j++) Bt[gi * C + 16 * v + j] = r[j];
        }
    __m512 acc[GROUPS][FEW];
    switch (n) {                                          /* constant row counts: accumulators in registers */
    case 1: page_chains(1, ng, C, Bt, qt, acc); break;
    case 2: page_chains(2, ng, C, Bt, qt, acc); break;
    case 3: page_chains(3, ng, C, Bt, qt, acc); break;
    default: page_chains(4, ng, C, Bt, qt, acc); break;
    }
    for (int gi = 0; gi < ng; gi++) {
        float t[FEW][16];
        for (int i = 0; i < n; i++) _mm512_storeu_ps(t[i], acc[gi][i]);
        for (int pp = 0; pp < 16; pp++)
            for (int i = 0; i < n; i++) ub[(16 * gi + pp) * LANES + lane0 + i] = t[i][pp];
    }
}
#elif defined(PS_AVX2)
/* rows r[pp] = 8 channels of page pp -> r[j] = channel j of the 8 pages */
static inline __attribute__((always_inline)) void transpose8(__m256 r[8]) {
    __m256 t[8], u[8];
    for (int i = 0; i < 4; i++) {
        t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 2; i++) {
        u[4 * i] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
        u[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
        u[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
        u[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
    }
    for (int i = 0; i < 4; i++) {
        r[i] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x20);
        r[i + 4] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x31);
    }
}

/* 16 pages (two groups of 8 lanes, two independent chains per row) against NR rows: the
 * bounds of 8 channels of 8 pages are widened and transposed, then each row's channel is
 * broadcast; per (page, row) the channels are added in order */
static inline __attribute__((always_inline)) void page_chains(const int NR, const uint16_t *const *b, int D2,
                                                               const float *qf, __m256 acc[2][FEW]) {
    for (int gi = 0; gi < 2; gi++)
        for (int i = 0; i < NR; i++) acc[gi][i] = _mm256_setzero_ps();
    for (int d0 = 0; d0 < D2; d0 += 8) {
        __m256 r[2][8];
        for (int gi = 0; gi < 2; gi++) {
            for (int pp = 0; pp < 8; pp++) {
                const __m128i h = _mm_loadu_si128((const __m128i *)(b[8 * gi + pp] + d0));
                r[gi][pp] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
            }
            transpose8(r[gi]);
        }
        for (int j = 0; j < 8; j++)
            for (int i = 0; i < NR; i++) {
                const __m256 qb = _mm256_set1_ps(qf[i * D2 + d0 + j]);
                for (int gi = 0; gi < 2; gi++) acc[gi][i] = _mm256_fmadd_ps(qb, r[gi][j], acc[gi][i]);
            }
    }
}

/* The same ub as tile() for FEW rows, pages in lanes; writes lanes [lane0, lane0 + n) of ub. */
static void page_tile(const uint16_t *qt, const uint16_t *bounds, const int64_t *c, int ng, int kvh, int h, int D2,
                      int n, int lane0, float *ub) {
    float qf[FEW * 128];                                  /* the rows' queries, widened: qf[i][channel] */
    for (int i = 0; i < n; i++)
        for (int d = 0; d < D2; d++) qf[i * D2 + d] = bf16_to_f32(qt[((size_t)(d / 2) * LANES + i) * 2 + d % 2]);
    for (int gi = 0; gi < ng; gi++) {
        const uint16_t *b[16];
        for (int pp = 0; pp < 16; pp++) b[pp] = bounds + ((size_t)c[16 * gi + pp] * kvh + h) * D2;
        __m256 acc[2][FEW];
        switch (n) {                                      /* constant row counts: accumulators in registers */
        case 1: page_chains(1, b, D2, qf, acc); break;
        case 2: page_chains(2, b, D2, qf, acc); break;
        case 3: page_chains(3, b, D2, qf, acc); break;
        default: page_chains(4, b, D2, qf, acc); break;
        }
        float t[2][FEW][8];
        for (int hf = 0; hf < 2; hf++)
            for (int i = 0; i < n; i++) _mm256_storeu_ps(t[hf][i], acc[hf][i]);
        for (int pp = 0; pp < 16; pp++)
            for (int i = 0; i < n; i++) ub[(16 * gi + pp) * LANES + lane0 + i] = t[pp / 8][i][pp % 8];
    }
}
#endif

#endif  /* STREAMKV_PAGE_TILES_H */
