/* Query-aware page selection (Quest-style upper bounds): the native form of
 * streamkv.policies.read.QuestPolicy.select / compact.
 *
 * q       [R, kvh, g, D] float32 or bfloat16: one sequence's query rows (one layer)
 * bounds  [num_blocks, kvh, 2D] bfloat16: per block, channel-wise key max then min
 * cand    [P] block ids (the candidate pages, in sequence order)
 * pos     [keep] positions in cand of the pages to read, ascending
 *
 * Per (kv head, query row): ub[p] = [q+ | q-] . [kmax | kmin] (q scaled, rounded to bf16),
 * turned into a softmax over pages; a page scores its largest share over rows and heads.
 *
 * Layout of the AVX512-BF16 path: the n = R * g rows of a head sit in the 16 lanes of a
 * tile, their queries as channel pairs qt [2D/2][16 lanes][2]; a page's bound pair (two
 * bf16 = 32 bits) is broadcast straight from the cache-side bounds, so one vdpbf16ps adds
 * 2 channels of 16 rows for one page:
 *
 *     acc[page][lane] += qt[c][lane] . bounds[page][c]      (c: channel pair, 64 of them)
 *
 * A decode row has n = g rows (3 here), so 13 of 16 lanes would idle: up to FEW rows, 16 pages
 * go in the lanes instead (page_tile(): bounds transposed, one query pair broadcast per row),
 * with the same bits.
 *
 * Without AVX512-BF16 (an AVX2 CPU, or none) the bounds and queries are widened to float32 and
 * every (page, row) is one fma chain over the 2D channels in order, c = 0 .. 2D - 1:
 *
 *     ub = fma(q[2D-1], b[2D-1], ... fma(q[1], b[1], fma(q[0], b[0], 0)))
 *
 * written out for AVX2 both ways round (rows in lanes: tile(); pages in lanes: page_tile()) and
 * for the scalar build: the same operations in the same order. (This file is built with
 * -ffast-math, which leaves the compiler free to reorder the scalar loop; the test builds both
 * and checks that they rank every page alike.)
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#define PS_BF16 1
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PS_AVX2 1
#endif

#define LANES 16  /* query rows per tile */
#define PT 8      /* pages per tile */

static inline float bf16_to_f32(uint16_t x) {
    uint32_t bits = (uint32_t)x << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {  /* round to nearest even */
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    return (uint16_t)((bits + 0x7fff + ((bits >> 16) & 1)) >> 16);
}

/* exp(x) for x <= 0, written so the compiler vectorizes the loops that call it. */
static inline float exp_le0(float x) {
    x = x < -87.f ? -87.f : x;
    float t = x * 1.44269504088896341f;
    float n = floorf(t + 0.5f);
    float f = (t - n) * 0.69314718055994531f;
    float p = 1.f / 720.f;
    p = p * f + 1.f / 120.f;
    p = p * f + 1.f / 24.f;
    p = p * f + 1.f / 6.f;
    p = p * f + 0.5f;
    p = p * f + 1.f;
    p = p * f + 1.f;
    int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

/* A page's rank key: larger is better; the score's order (as float >, -0 == +0) in the high
 * half, then the earlier page first (ties go to the earlier page); unique per page. */
static inline uint64_t rank_key(float s, int i) {
    uint32_t b;
    memcpy(&b, &s, sizeof b);
    if ((b & 0x7fffffffu) == 0) b = 0;                /* -0 ranks as +0 (in bits: -ffast-math) */
    b = (b & 0x80000000u) ? ~b : (b | 0x80000000u);   /* float order as unsigned order */
    return ((uint64_t)b << 32) | (uint32_t)(0xffffffffu - (uint32_t)i);
}

/* The keep best of the n pages (score desc, then the earlier page), ascending in out: the keep-th
 * largest key by quickselect (keys are unique), then one pass in page order. */
static void top_keep(const float *score, int n, int keep, int64_t *out) {
    uint64_t stack_keys[1024], *key = n <= 1024 ? stack_keys : malloc(sizeof(uint64_t) * (size_t)n);
    for (int i = 0; i < n; i++) key[i] = rank_key(score[i], i);
    int lo = 0, hi = n - 1, k = keep - 1;             /* key[k] of the descending order */
    while (lo < hi) {
        const uint64_t pv = key[lo + (hi - lo) / 2];
        int i = lo, j = hi;
        while (i <= j) {
            while (key[i] > pv) i++;
            while (key[j] < pv) j--;
            if (i <= j) { uint64_t t = key[i]; key[i] = key[j]; key[j] = t; i++; j--; }
        }
        if (k <= j) hi = j;
        else if (k >= i) lo = i;
        else break;
    }
    const uint64_t kth = key[k];
    for (int i = 0, o = 0; i < n && o < keep; i++)
        if (rank_key(score[i], i) >= kth) out[o++] = i;
    if (key != stack_keys) free(key);
}

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

/* qt [kvh][blocks][2D/2][LANES][2] bf16: row i of head h = lane i % 16 of block i / 16,
 * holding scale * [q+ | q-]; padding rows are zero. */
static uint16_t *split_queries(const void *q, int q_bf16, int R, int kvh, int g, int D, float scale, int nb) {
    int D2 = 2 * D;
    uint16_t *qt = calloc((size_t)kvh * nb * D2 * LANES, sizeof(uint16_t));
    #pragma omp parallel for schedule(static) if (R * g >= 32)  /* a question's rows; heads write apart */
    for (int h = 0; h < kvh; h++)
        for (int r = 0; r < R; r++)
            for (int j = 0; j < g; j++) {
                int i = r * g + j;
                size_t at = (((size_t)r * kvh + h) * g + j) * D;
                uint16_t *t = qt + ((size_t)(h * nb + i / LANES) * D2) * LANES;
                for (int d = 0; d < D2; d++) {
                    int src = d < D ? d : d - D;
                    float v = (q_bf16 ? bf16_to_f32(((const uint16_t *)q)[at + src]) : ((const float *)q)[at + src]) * scale;
                    v = d < D ? (v > 0.f ? v : 0.f) : (v < 0.f ? v : 0.f);  /* q+ pairs with max, q- with min */
                    t[((size_t)(d / 2) * LANES + i % LANES) * 2 + d % 2] = f32_to_bf16(v);
                }
            }
    return qt;
}

/* ub [passes][Pp][LANES]: every (kv head, query row) lane's bound for every candidate page.
 * Lane l of pass hb is row i = (hb % nb) LANES + l of head hb / nb, or with ``packed`` (one
 * pass) row l % n of head l / n. ``rows_in_lanes`` always takes tile() (rows in lanes): a
 * lane's bits then never depend on the other rows (page_shares()). Caller frees. */
static float *upper_bounds(const uint16_t *qt, const uint16_t *bounds, const int64_t *cp, int n, int kvh, int D2,
                           int nb, int Pp, int rows_in_lanes, int *passes, int *packed) {
    *passes = kvh * nb;
    *packed = 0;
    float *ub = malloc(sizeof(float) * (size_t)kvh * nb * Pp * LANES);
#if defined(PS_BF16) || defined(PS_AVX2)
    if (!rows_in_lanes && n <= FEW && D2 % 32 == 0 && D2 <= 128) {
        *packed = kvh * n <= LANES;
        if (*packed) *passes = 1;
        memset(ub, 0, sizeof(float) * (size_t)*passes * Pp * LANES);   /* the lanes no row fills */
        const int groups = Pp / 16, calls = (groups + GROUPS - 1) / GROUPS, pk = *packed;
        #pragma omp parallel for schedule(static) if (kvh * calls >= 4)
        for (int w = 0; w < kvh * calls; w++) {
            /* heads innermost: a thread reads its pages' bounds (every head) as one stream */
            const int h = w % kvh, g0 = GROUPS * (w / kvh), ng = groups - g0 < GROUPS ? groups - g0 : GROUPS;
            page_tile(qt + (size_t)h * D2 * LANES, bounds, cp + (size_t)g0 * 16, ng, kvh, h, D2, n, pk ? h * n : 0,
                      ub + ((size_t)(pk ? 0 : h) * Pp + (size_t)g0 * 16) * LANES);
        }
        return ub;
    }
#endif
    int tiles = Pp / PT, work = kvh * nb * tiles;
    #pragma omp parallel for schedule(static) if (work >= 64)
    for (int w = 0; w < work; w++) {
        int hb = w / tiles, t = w % tiles;
        tile(qt + (size_t)hb * D2 * LANES, bounds, cp + (size_t)t * PT, kvh, hb / nb, D2,
             ub + ((size_t)hb * Pp + (size_t)t * PT) * LANES);
    }
    return ub;
}

/* Each lane's softmax over the P pages, in place in u [Pp][LANES]; inv[l] = 1 / its sum
 * (0 for the lanes from ``valid`` on, which hold no row). */
static void lane_softmax(float *u, int P, int valid, float *inv) {
    float m[LANES], sum[LANES];
    for (int l = 0; l < LANES; l++) { m[l] = -INFINITY; sum[l] = 0.f; }
    for (int p = 0; p < P; p++)
        for (int l = 0; l < LANES; l++) m[l] = u[p * LANES + l] > m[l] ? u[p * LANES + l] : m[l];
    for (int p = 0; p < P; p++)
        for (int l = 0; l < LANES; l++) { u[p * LANES + l] = exp_le0(u[p * LANES + l] - m[l]); sum[l] += u[p * LANES + l]; }
    for (int l = 0; l < LANES; l++) inv[l] = l < valid ? 1.f / sum[l] : 0.f;
}

static int64_t *padded(const int64_t *cand, int P, int Pp) {  /* candidates padded with the first one */
    int64_t *cp = malloc(sizeof(int64_t) * (size_t)Pp);
    for (int p = 0; p < Pp; p++) cp[p] = cand[p < P ? p : 0];
    return cp;
}

/* The compacted context slots of one row: full[0, sink_len) + the pages at positions pos[0, keep)
 * (page p = full[sink_len + p * bs, + bs)) + full[tail_from, ctx_len). */
void streamkv_compact_slots(const int64_t *full, int64_t sink_len, const int64_t *pos, int keep, int bs,
                            int64_t tail_from, int64_t ctx_len, int64_t *slots) {
    int64_t o = sink_len;
    memcpy(slots, full, sizeof(int64_t) * (size_t)sink_len);
    for (int k = 0; k < keep; k++, o += bs) memcpy(slots + o, full + sink_len + pos[k] * bs, sizeof(int64_t) * bs);
    memcpy(slots + o, full + tail_from, sizeof(int64_t) * (size_t)(ctx_len - tail_from));
}

/* With full != NULL, also writes the compacted context slots: full[0, sink_len) + the
 * picked pages' slots (page p = full[sink_len + p * bs, + bs)) + full[tail_from, ctx_len). */
int streamkv_page_select(const void *q, int q_bf16, int R, int kvh, int g, int D, const uint16_t *bounds,
                         const int64_t *cand, int P, int keep, float scale, int64_t *pos,
                         const int64_t *full, int64_t sink_len, int64_t tail_from, int64_t ctx_len, int bs,
                         int64_t *slots) {
    if (keep <= 0 || keep > P || D % 2) return 1;
    int n = R * g, D2 = 2 * D, nb = (n + LANES - 1) / LANES, Pp = (P + 15) / 16 * 16, passes, packed;
    int64_t *cp = padded(cand, P, Pp);
    uint16_t *qt = split_queries(q, q_bf16, R, kvh, g, D, scale, nb);
    /* ub [h][block][page][lane], lane = row; with pages in lanes and kvh n <= 16, one block of
     * every head's rows (lane h n + row): one softmax pass below instead of kvh mostly idle ones */
    float *ub = upper_bounds(qt, bounds, cp, n, kvh, D2, nb, Pp, 0, &passes, &packed);
    float *score = calloc((size_t)P, sizeof(float)), inv[LANES];
    for (int hb = 0; hb < passes; hb++) {
        float *u = ub + (size_t)hb * Pp * LANES;
        int valid = packed ? kvh * n : n - (hb % nb) * LANES;
        lane_softmax(u, P, valid < LANES ? valid : LANES, inv);  /* padding rows weigh 0 */
        for (int p = 0; p < P; p++) {
            float best = score[p];
            for (int l = 0; l < LANES; l++) best = fmaxf(best, u[p * LANES + l] * inv[l]);
            score[p] = best;
        }
    }
    top_keep(score, P, keep, pos);
    if (full) streamkv_compact_slots(full, sink_len, pos, keep, bs, tail_from, ctx_len, slots);
    free(score);
    free(ub);
    free(qt);
    free(cp);
    return 0;
}

/* Each query row's own share of every page: out [R][P] = max over the row's (kv head, group
 * member) softmaxes over the pages (streamkv.policies.read.QuestPolicy.row_scores). Rows
 * always sit in lanes (tile()), so a row's bits are the same whatever rows come with it.
 * With keep > 0, also each row's keep best pages pos [R][keep] (ascending) and, with full !=
 * NULL, the rows' compacted context slots back to back in ``slots``: row r reads full[0,
 * sink_len), its pages (page p = full[sink_len + p bs, + bs)) and full[tail_from, tail_from +
 * first + r) (the tail up to its own row). */
int streamkv_page_shares(const void *q, int q_bf16, int R, int kvh, int g, int D, const uint16_t *bounds,
                         const int64_t *cand, int P, float scale, float *out, int keep, int64_t *pos,
                         const int64_t *full, int64_t sink_len, int64_t tail_from, int64_t first, int bs,
                         int64_t *slots) {
    if (P <= 0 || D % 2 || keep > P) return 1;
    int n = R * g, D2 = 2 * D, nb = (n + LANES - 1) / LANES, Pp = (P + 15) / 16 * 16, passes, packed;
    int64_t *cp = padded(cand, P, Pp);
    uint16_t *qt = split_queries(q, q_bf16, R, kvh, g, D, scale, nb);
    float *ub = upper_bounds(qt, bounds, cp, n, kvh, D2, nb, Pp, 1, &passes, &packed);
    float *inv = malloc(sizeof(float) * (size_t)passes * LANES);
    /* each pass's (kv head, row block's) softmax on its own, then each page's best share over
     * the passes: max is exact, so any split gives the same bits (rows share pages across
     * heads, so the threads split the pages, not the passes) */
    #pragma omp parallel for schedule(static) if (passes >= 4)
    for (int hb = 0; hb < passes; hb++) {
        int at = (hb % nb) * LANES, valid = n - at < LANES ? n - at : LANES;
        lane_softmax(ub + (size_t)hb * Pp * LANES, P, valid, inv + (size_t)hb * LANES);
    }
    memset(out, 0, sizeof(float) * (size_t)R * P);
    const int span = 64, spans = (P + span - 1) / span;
    #pragma omp parallel for schedule(static) if (passes >= 4)
    for (int sp = 0; sp < spans; sp++) {
        const int p0 = sp * span, p1 = p0 + span < P ? p0 + span : P;
        for (int hb = 0; hb < passes; hb++) {
            const float *u = ub + (size_t)hb * Pp * LANES, *iv = inv + (size_t)hb * LANES;
            int at = (hb % nb) * LANES, valid = n - at < LANES ? n - at : LANES;
            for (int l = 0; l < valid; l++) {
                float *row = out + (size_t)((at + l) / g) * P;
                for (int p = p0; p < p1; p++) row[p] = fmaxf(row[p], u[p * LANES + l] * iv[l]);
            }
        }
    }
    if (keep > 0 && pos) {
        const int64_t width = sink_len + (int64_t)keep * bs + first;  /* row r's slots: width + r */
        #pragma omp parallel for schedule(static) if (R >= 8)
        for (int r = 0; r < R; r++) {
            int64_t *mine = pos + (size_t)r * keep;
            top_keep(out + (size_t)r * P, P, keep, mine);
            if (full)
                streamkv_compact_slots(full, sink_len, mine, keep, bs, tail_from, tail_from + first + r,
                                       slots + r * width + (int64_t)r * (r - 1) / 2);
        }
    }
    free(inv);
    free(ub);
    free(qt);
    free(cp);
    return 0;
}

/* Page bounds of a bfloat16 cache: for each of the n blocks and every layer,
 * out[l][block][h] = [channel-wise max | channel-wise min] of the block's bs keys (exact:
 * the max of bf16 values is one of them).
 * k [layers][slots][kvh][D] bf16; out [layers][num_blocks][kvh][2D] bf16. */
void streamkv_page_bounds(const uint16_t *k, int layers, int64_t slots, int kvh, int D, int bs,
                          const int64_t *blocks, int n, uint16_t *out, int64_t num_blocks) {
    int hd = kvh * D;
    #pragma omp parallel for schedule(static)
    for (int w = 0; w < layers * n; w++) {
        int l = w / n, i = w % n;
        const uint16_t *src = k + ((size_t)l * slots + (size_t)blocks[i] * bs) * hd;
        uint16_t *dst = out + ((size_t)l * num_blocks + (size_t)blocks[i]) * 2 * hd;
        float hi[1024], lo[1024];
        if (hd > 1024) continue;
        for (int e = 0; e < hd; e++) hi[e] = lo[e] = bf16_to_f32(src[e]);
        for (int t = 1; t < bs; t++)
            for (int e = 0; e < hd; e++) {
                float v = bf16_to_f32(src[(size_t)t * hd + e]);
                hi[e] = v > hi[e] ? v : hi[e];
                lo[e] = v < lo[e] ? v : lo[e];
            }
        for (int h = 0; h < kvh; h++)
            for (int d = 0; d < D; d++) {
                uint32_t a, b;
                memcpy(&a, &hi[h * D + d], sizeof a);
                memcpy(&b, &lo[h * D + d], sizeof b);
                dst[(size_t)h * 2 * D + d] = (uint16_t)(a >> 16);
                dst[(size_t)h * 2 * D + D + d] = (uint16_t)(b >> 16);
            }
    }
}
