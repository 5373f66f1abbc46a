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
 * largest key by quickselect (keys are unique), then one pass in page order. Returns 0, or 1 with
 * no memory for the keys (out not written). */
static int top_keep(const float *score, int n, int keep, int64_t *out) {
    uint64_t stack_keys[1024], *key = n <= 1024 ? stack_keys : malloc(sizeof(uint64_t) * (size_t)n);
    if (!key) return 1;
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
    return 0;
}

#include "page_tiles.h"  /* tile(), page_tile(), FEW, GROUPS */

/* qt [kvh][blocks][2D/2][LANES][2] bf16: row i of head h = lane i % 16 of block i / 16,
 * holding scale * [q+ | q-]; padding rows are zero. */
static uint16_t *split_queries(const void *q, int q_bf16, int R, int kvh, int g, int D, float scale, int nb) {
    int D2 = 2 * D;
    uint16_t *qt = calloc((size_t)kvh * nb * D2 * LANES, sizeof(uint16_t));
    if (!qt) return NULL;
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
    if (!ub) return NULL;
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
    if (!cp) return NULL;
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
    int n = R * g, D2 = 2 * D, nb = (n + LANES - 1) / LANES, Pp = (P + 15) / 16 * 16, passes = 0, packed = 0;
    int64_t *cp = padded(cand, P, Pp);
    uint16_t *qt = cp ? split_queries(q, q_bf16, R, kvh, g, D, scale, nb) : NULL;
    /* ub [h][block][page][lane], lane = row; with pages in lanes and kvh n <= 16, one block of
     * every head's rows (lane h n + row): one softmax pass below instead of kvh mostly idle ones */
    float *ub = qt ? upper_bounds(qt, bounds, cp, n, kvh, D2, nb, Pp, 0, &passes, &packed) : NULL;
    float *score = ub ? calloc((size_t)P, sizeof(float)) : NULL, inv[LANES];
    int rc = score ? 0 : 3;   /* 3: no memory (pos and slots not written) */
    for (int hb = 0; rc == 0 && hb < passes; hb++) {
        float *u = ub + (size_t)hb * Pp * LANES;
        int valid = packed ? kvh * n : n - (hb % nb) * LANES;
        lane_softmax(u, P, valid < LANES ? valid : LANES, inv);  /* padding rows weigh 0 */
        for (int p = 0; p < P; p++) {
            float best = score[p];
            for (int l = 0; l < LANES; l++) best = fmaxf(best, u[p * LANES + l] * inv[l]);
            score[p] = best;
        }
    }
    if (rc == 0 && top_keep(score, P, keep, pos)) rc = 3;
    if (rc == 0 && full) streamkv_compact_slots(full, sink_len, pos, keep, bs, tail_from, ctx_len, slots);
    free(score);
    free(ub);
    free(qt);
    free(cp);
    return rc;
}

/* The rows in the lanes of rows-in-lanes pass hb (nb blocks of LANES rows per head): *at, the
 * first one's index among its head's n rows; returns how many lanes hold a row. */
static inline int pass_rows(int hb, int nb, int n, int *at) {
    *at = (hb % nb) * LANES;
    return n - *at < LANES ? n - *at : LANES;
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
    int n = R * g, D2 = 2 * D, nb = (n + LANES - 1) / LANES, Pp = (P + 15) / 16 * 16, passes = 0, packed = 0;
    int64_t *cp = padded(cand, P, Pp);
    uint16_t *qt = cp ? split_queries(q, q_bf16, R, kvh, g, D, scale, nb) : NULL;
    float *ub = qt ? upper_bounds(qt, bounds, cp, n, kvh, D2, nb, Pp, 1, &passes, &packed) : NULL;
    float *inv = ub ? malloc(sizeof(float) * (size_t)passes * LANES) : NULL;
    if (!inv) {   /* no memory: nothing written */
        free(ub);
        free(qt);
        free(cp);
        return 3;
    }
    /* each pass's (kv head, row block's) softmax on its own, then each page's best share over
     * the passes: max is exact, so any split gives the same bits (rows share pages across
     * heads, so the threads split the pages, not the passes) */
    #pragma omp parallel for schedule(static) if (passes >= 4)
    for (int hb = 0; hb < passes; hb++) {
        int at;
        lane_softmax(ub + (size_t)hb * Pp * LANES, P, pass_rows(hb, nb, n, &at), inv + (size_t)hb * LANES);
    }
    memset(out, 0, sizeof(float) * (size_t)R * P);
    const int span = 64, spans = (P + span - 1) / span;
    #pragma omp parallel for schedule(static) if (passes >= 4)
    for (int sp = 0; sp < spans; sp++) {
        const int p0 = sp * span, p1 = p0 + span < P ? p0 + span : P;
        for (int hb = 0; hb < passes; hb++) {
            const float *u = ub + (size_t)hb * Pp * LANES, *iv = inv + (size_t)hb * LANES;
            int at, valid = pass_rows(hb, nb, n, &at);
            for (int l = 0; l < valid; l++) {
                float *row = out + (size_t)((at + l) / g) * P;
                for (int p = p0; p < p1; p++) row[p] = fmaxf(row[p], u[p * LANES + l] * iv[l]);
            }
        }
    }
    int rc = 0;
    if (keep > 0 && pos) {
        const int64_t width = sink_len + (int64_t)keep * bs + first;  /* row r's slots: width + r */
        #pragma omp parallel for schedule(static) if (R >= 8)
        for (int r = 0; r < R; r++) {
            int64_t *mine = pos + (size_t)r * keep;
            if (top_keep(out + (size_t)r * P, P, keep, mine)) {
                #pragma omp atomic write
                rc = 3;   /* no memory: this row's picks and slots not written */
                continue;
            }
            if (full)
                streamkv_compact_slots(full, sink_len, mine, keep, bs, tail_from, tail_from + first + r,
                                       slots + r * width + (int64_t)r * (r - 1) / 2);
        }
    }
    free(inv);
    free(ub);
    free(qt);
    free(cp);
    return rc;
}

/* float32 -> bfloat16 rounded outward: toward +inf (up) or -inf; exact values stay (bit patterns
 * order the magnitudes, so dropping the low half rounds toward zero and one more bf16 unit away
 * from it). The bits of kv/bounds.py's _round: a value that RNE rounds the wrong way steps once. */
static inline uint16_t bf16_outward(float f, int up) {
    uint32_t b;
    memcpy(&b, &f, sizeof b);
    const uint16_t t = (uint16_t)(b >> 16);
    if (!(b & 0xffffu)) return t;
    return (uint16_t)(t + ((b >> 31) ? !up : up));
}

/* Page bounds of a bfloat16 or float32 cache (k_f32): for each of the n blocks and every layer,
 * out[l][block][h] = [channel-wise max | channel-wise min] of the block's bs keys (bf16 cache:
 * exact, the max of bf16 values is one of them; float32: the max and min rounded outward to
 * bf16, so they still bound every key).
 * k [layers][slots][kvh][D] bf16 or float32; out [layers][num_blocks][kvh][2D] bf16. */
void streamkv_page_bounds(const void *k, int k_f32, int layers, int64_t slots, int kvh, int D, int bs,
                          const int64_t *blocks, int n, uint16_t *out, int64_t num_blocks) {
    int hd = kvh * D;
    #pragma omp parallel for schedule(static)
    for (int w = 0; w < layers * n; w++) {
        int l = w / n, i = w % n;
        const size_t at = ((size_t)l * slots + (size_t)blocks[i] * bs) * hd;
        const uint16_t *src = (const uint16_t *)k + at;
        const float *srcf = (const float *)k + at;
        uint16_t *dst = out + ((size_t)l * num_blocks + (size_t)blocks[i]) * 2 * hd;
        float hi[1024], lo[1024];
        if (hd > 1024) continue;
        for (int e = 0; e < hd; e++) hi[e] = lo[e] = k_f32 ? srcf[e] : bf16_to_f32(src[e]);
        for (int t = 1; t < bs; t++)
            for (int e = 0; e < hd; e++) {
                float v = k_f32 ? srcf[(size_t)t * hd + e] : bf16_to_f32(src[(size_t)t * hd + e]);
                hi[e] = v > hi[e] ? v : hi[e];
                lo[e] = v < lo[e] ? v : lo[e];
            }
        for (int h = 0; h < kvh; h++)
            for (int d = 0; d < D; d++) {
                dst[(size_t)h * 2 * D + d] = bf16_outward(hi[h * D + d], 1);
                dst[(size_t)h * 2 * D + D + d] = bf16_outward(lo[h * D + d], 0);
            }
    }
}
