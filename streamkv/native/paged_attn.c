/* Mixed-batch attention over a paged bf16 KV cache with head_dim 64 (AVX512-BF16).
 *
 * One call serves a whole step: prefill chunks (with or without earlier context) and decode
 * rows alike. Sequence b owns query rows [row0, row0 + nq) and context slots
 * slots[off .. off + L); its query j sits at context index L - nq + j and attends causally to
 * context indices <= that.
 *
 * q     [T, H, 64] bf16           out [T, H, 64] float32
 * k, v  [S, Hk, 64] bf16          the paged cache of one layer (slot-major, keys after RoPE)
 * seqs  [B, 4] int64              (row0, nq, off, L) per sequence
 *
 * Work items = (sequence, query tile, context chunk), every head. An item walks its chunk 64
 * keys at a time (prefetching the next 64) and, per kv head, 16 keys at a time:
 *
 *   K block [16 keys][32 dim pairs]  --transpose-->  Kt[pair][16 keys]   (dword = 2 bf16)
 *   scores[row][16] = sum over pairs  dpbf16(Kt[pair], broadcast(q[row].pair))
 *   V block: key pairs interleaved   Vp[keypair][4][16 dims]            (dword = 2 bf16)
 *   acc[row][64]   += sum over keypairs dpbf16(Vp[keypair], broadcast(p[row].keypair))
 *
 * with an online softmax per row (float32 max and sum). Items write partials (max, sum,
 * unnormalized acc) that are merged per row afterwards (split-K). Accumulator lanes follow the
 * interleave order of _mm512_unpack{lo,hi}_epi16; the merge maps them back to dims.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>

#include "simd.h"
#include "transpose16.h"

#define ROWS_MAX 288  /* query rows (query, head) per item */
#define QK_GROUP 16    /* rows whose scores share one pass over the transposed keys */
#define NB 4          /* 16-key blocks per super-block (one softmax update per row) */

typedef struct { int64_t b, q0, q1, c0, c1, prow; } Item;

/* Load a 16-key block (n valid keys) of head hk: Kt[32] (pair-major) and Vp[8][4]. */
static inline void load_block(const uint16_t* kc, const uint16_t* vc, const int64_t* slots, int n, int Hk,
                              int hk, __m512i Kt[32], __m512i Vp[8][4]) {
    __m512i lo[16], hi[16];
    for (int i = 0; i < 16; i++) {
        if (i < n) {
            const uint16_t* k = kc + (slots[i] * Hk + hk) * 64;
            lo[i] = _mm512_loadu_si512((const void*)k);
            hi[i] = _mm512_loadu_si512((const void*)(k + 32));
        } else {
            lo[i] = hi[i] = _mm512_setzero_si512();
        }
    }
    transpose16(lo);
    transpose16(hi);
    for (int p = 0; p < 16; p++) { Kt[p] = lo[p]; Kt[16 + p] = hi[p]; }
    for (int kp = 0; kp < 8; kp++) {
        __m512i a0 = _mm512_setzero_si512(), a1 = a0, b0 = a0, b1 = a0;
        if (2 * kp < n) {
            const uint16_t* va = vc + (slots[2 * kp] * Hk + hk) * 64;
            a0 = _mm512_loadu_si512((const void*)va);
            a1 = _mm512_loadu_si512((const void*)(va + 32));
        }
        if (2 * kp + 1 < n) {
            const uint16_t* vb = vc + (slots[2 * kp + 1] * Hk + hk) * 64;
            b0 = _mm512_loadu_si512((const void*)vb);
            b1 = _mm512_loadu_si512((const void*)(vb + 32));
        }
        Vp[kp][0] = _mm512_unpacklo_epi16(a0, b0);
        Vp[kp][1] = _mm512_unpackhi_epi16(a0, b0);
        Vp[kp][2] = _mm512_unpacklo_epi16(a1, b1);
        Vp[kp][3] = _mm512_unpackhi_epi16(a1, b1);
    }
}

/* Accumulator lane -> head dim (the unpack{lo,hi}_epi16 interleave). */
static inline int lane_dim(int j, int lane) {
    int L = lane >> 2, i = lane & 3;
    return 32 * (j >> 1) + 8 * L + 4 * (j & 1) + i;
}

/* Online-softmax update of one row with the scores of one super-block (nk keys; key i is
 * visible when i <= rel): updates M and S, leaves the bf16 probabilities in pp and returns the
 * factor that rescales the row's accumulator (-1: nothing visible, skip the row). */
static inline float softmax_row(const float* sc, int nk, int64_t rel, __m512 lanes, __m512 ninf, __m512 vscale,
                                float* M, float* S, uint32_t pp[NB][8]) {
    int64_t lim = rel + 1 < nk ? rel + 1 : nk;  /* visible keys */
    if (lim <= 0) return -1.f;
    int nb = (int)((lim + 15) / 16);
    __m512 s[NB];
    __mmask16 valid[NB];
    __m512 mx = ninf;
    for (int x = 0; x < nb; x++) {
        int64_t l = lim - 16 * x;
        valid[x] = l >= 16 ? (__mmask16)0xffff : _mm512_cmp_ps_mask(lanes, _mm512_set1_ps((float)l), _CMP_LT_OQ);
        s[x] = _mm512_mask_blend_ps(valid[x], ninf, _mm512_mul_ps(_mm512_loadu_ps(sc + 16 * x), vscale));
        mx = _mm512_max_ps(mx, s[x]);
    }
    float mo = *M, bm = _mm512_reduce_max_ps(mx), mn = bm > mo ? bm : mo;
    float alpha = mo == -INFINITY ? 0.f : expf(mo - mn);
    __m512 vm = _mm512_set1_ps(mn), tot = _mm512_setzero_ps();
    for (int x = 0; x < NB; x++) {
        __m512 pr = x < nb ? _mm512_maskz_mov_ps(valid[x], exp_neg(_mm512_sub_ps(s[x], vm))) : _mm512_setzero_ps();
        tot = _mm512_add_ps(tot, pr);
        _mm256_storeu_si256((__m256i*)pp[x], (__m256i)_mm512_cvtneps_pbh(pr));
    }
    *S = *S * alpha + _mm512_reduce_add_ps(tot);
    *M = mn;
    return alpha;
}

/* acc[row] = acc[row] * alpha[row] + P[row] V for two rows at once (each V pair load serves
 * both): 8 independent dpbf16 chains. */
static inline void pv_rows2(__m512i Vp[NB][8][4], int nb, const uint32_t pa[NB][8], const uint32_t pb[NB][8],
                            float alpha_a, float alpha_b, float* a, float* b) {
    __m512 ca[4], cb[4];
    __m512 va = _mm512_set1_ps(alpha_a), vb = _mm512_set1_ps(alpha_b);
    for (int j = 0; j < 4; j++) {
        ca[j] = _mm512_mul_ps(_mm512_loadu_ps(a + 16 * j), va);
        cb[j] = _mm512_mul_ps(_mm512_loadu_ps(b + 16 * j), vb);
    }
    for (int x = 0; x < nb; x++)
        for (int kp = 0; kp < 8; kp++) {
            __m512bh wa = (__m512bh)_mm512_set1_epi32((int)pa[x][kp]);
            __m512bh wb = (__m512bh)_mm512_set1_epi32((int)pb[x][kp]);
            for (int j = 0; j < 4; j++) {
                ca[j] = _mm512_dpbf16_ps(ca[j], (__m512bh)Vp[x][kp][j], wa);
                cb[j] = _mm512_dpbf16_ps(cb[j], (__m512bh)Vp[x][kp][j], wb);
            }
        }
    for (int j = 0; j < 4; j++) {
        _mm512_storeu_ps(a + 16 * j, ca[j]);
        _mm512_storeu_ps(b + 16 * j, cb[j]);
    }
}

/* Prefetch head hk's K and V rows (128 bytes each) at n slots into L2: paged blocks are
 * scattered and hardware prefetchers stop at 4 KiB pages. */
static inline void prefetch_head(const uint16_t* kc, const uint16_t* vc, const int64_t* slots, int n, int Hk,
                                 int hk) {
    for (int i = 0; i < n; i++) {
        const uint16_t* k = kc + (slots[i] * Hk + hk) * 64;
        const uint16_t* v = vc + (slots[i] * Hk + hk) * 64;
        _mm_prefetch((const char*)k, _MM_HINT_T1);
        _mm_prefetch((const char*)(k + 32), _MM_HINT_T1);
        _mm_prefetch((const char*)v, _MM_HINT_T1);
        _mm_prefetch((const char*)(v + 32), _MM_HINT_T1);
    }
}

/* One item: every query head of queries [q0, q1) against context [c0, c1). Rows are grouped
 * by kv head: row r = hk * R + (j - q0) * G + g with R = (q1 - q0) * G, so each kv head's
 * rows share its transposed key block. */
static void run_item(const Item* it, const uint16_t* q, const uint16_t* kc, const uint16_t* vc,
                     const int64_t* seqs, const int64_t* slots, int H, int Hk, float scale,
                     float* M, float* S, float* A) {
    const int64_t* sq = seqs + 4 * it->b;
    int64_t row0 = sq[0], nq = sq[1], off = sq[2], L = sq[3], start = L - nq;
    int G = H / Hk, R = (int)(it->q1 - it->q0) * G, nrows = R * Hk;
    uint32_t qbuf[ROWS_MAX][32];  /* the item's query rows as bf16 pairs, back to back */
    int64_t pos[ROWS_MAX];
    for (int r = 0; r < nrows; r++) {
        int hk = r / R, j = (r % R) / G, g = r % G;
        memcpy(qbuf[r], q + ((row0 + it->q0 + j) * H + hk * G + g) * 64, 128);
        pos[r] = start + it->q0 + j;
        M[r] = -INFINITY;
        S[r] = 0.f;
    }
    memset(A, 0, sizeof(float) * 64 * nrows);
    int64_t last = start + it->q1 - 1;  /* the newest context index any row sees */
    int64_t c1 = it->c1 < last + 1 ? it->c1 : last + 1;
    __m512i Kt[NB][32], Vp[NB][8][4];
    float sc[QK_GROUP][16 * NB], alpha[QK_GROUP], scratch[64] = {0};
    uint32_t pp[QK_GROUP][NB][8], pz[NB][8];
    memset(pz, 0, sizeof(pz));
    const __m512 lanes = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512 ninf = _mm512_set1_ps(-INFINITY), vscale = _mm512_set1_ps(scale);
    for (int64_t k0 = it->c0; k0 < c1; k0 += 16 * NB) {
        int nk = c1 - k0 < 16 * NB ? (int)(c1 - k0) : 16 * NB;  /* keys in this super-block */
        int nb = (nk + 15) / 16;
        int64_t k1 = k0 + 16 * NB, nn = c1 - k1 < 16 * NB ? c1 - k1 : 16 * NB;
        for (int hk = 0; hk < Hk; hk++) {
            if (nn > 0) prefetch_head(kc, vc, slots + off + k1, (int)nn, Hk, hk);  /* the next super-block */
            for (int x = 0; x < nb; x++) {
                int n = nk - 16 * x < 16 ? nk - 16 * x : 16;
                load_block(kc, vc, slots + off + k0 + 16 * x, n, Hk, hk, Kt[x], Vp[x]);
            }
            for (int g0 = hk * R; g0 < (hk + 1) * R; g0 += QK_GROUP) {
                int ng = (hk + 1) * R - g0 < QK_GROUP ? (hk + 1) * R - g0 : QK_GROUP;
                for (int x = 0; x < nb; x++) {
                    __m512 acc[QK_GROUP];
                    for (int r = 0; r < ng; r++) acc[r] = _mm512_setzero_ps();
                    for (int p = 0; p < 32; p++)
                        for (int r = 0; r < ng; r++)
                            acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)Kt[x][p],
                                                      (__m512bh)_mm512_set1_epi32((int)qbuf[g0 + r][p]));
                    for (int r = 0; r < ng; r++) _mm512_storeu_ps(sc[r] + 16 * x, acc[r]);
                }
                int live[QK_GROUP], nlive = 0;
                for (int r = 0; r < ng; r++) {
                    alpha[r] = softmax_row(sc[r], nk, pos[g0 + r] - k0, lanes, ninf, vscale, M + g0 + r,
                                           S + g0 + r, pp[r]);
                    if (alpha[r] >= 0.f) live[nlive++] = r;
                }
                for (int i = 0; i < nlive; i += 2) {
                    int ra = live[i];
                    if (i + 1 == nlive)  /* odd one out: paired with a scratch row of zero weights */
                        pv_rows2(Vp, nb, pp[ra], pz, alpha[ra], 0.f, A + 64 * (g0 + ra), scratch);
                    else
                        pv_rows2(Vp, nb, pp[ra], pp[live[i + 1]], alpha[ra], alpha[live[i + 1]],
                                 A + 64 * (g0 + ra), A + 64 * (g0 + live[i + 1]));
                }
            }
        }
    }
}

/* Returns 0; 1 shapes rejected; 3 no memory (out not written). */
int streamkv_paged_attn(const uint16_t* q, const uint16_t* kc, const uint16_t* vc, const int64_t* seqs,
                        int64_t B, const int64_t* slots, int H, int Hk, float scale, int64_t chunk_len,
                        float* out) {
    if (H % Hk != 0 || chunk_len <= 0 || chunk_len % 16 != 0) return 1;
    int G = H / Hk;
    if (H > ROWS_MAX) return 1;
    int64_t qt = ROWS_MAX / H;  /* queries per tile */
    int64_t n_items = 0, cap = 64;
    Item* items = malloc(sizeof(Item) * cap);
    if (!items) return 3;
    int64_t prow = 0;
    for (int64_t b = 0; b < B; b++) {
        int64_t nq = seqs[4 * b + 1], L = seqs[4 * b + 3];
        for (int64_t q0 = 0; q0 < nq; q0 += qt) {
            int64_t q1 = q0 + qt < nq ? q0 + qt : nq;
            int64_t see = L - nq + q1;  /* context entries visible to the tile */
            for (int64_t c0 = 0; c0 < see; c0 += chunk_len) {
                if (n_items == cap) {
                    Item* more = realloc(items, sizeof(Item) * cap * 2);
                    if (!more) { free(items); return 3; }
                    items = more;
                    cap *= 2;
                }
                int64_t c1 = c0 + chunk_len < see ? c0 + chunk_len : see;
                items[n_items++] = (Item){b, q0, q1, c0, c1, prow};
                prow += (q1 - q0) * H;
            }
        }
    }
    float* M = malloc(sizeof(float) * (prow ? prow : 1));
    float* S = malloc(sizeof(float) * (prow ? prow : 1));
    float* A = malloc(sizeof(float) * 64 * (prow ? prow : 1));
    if (!M || !S || !A) {   /* out untouched: rc 3, never a crash */
        free(items); free(M); free(S); free(A);
        return 3;
    }
    #pragma omp parallel for schedule(dynamic, 1)
    for (int64_t i = 0; i < n_items; i++)
        run_item(&items[i], q, kc, vc, seqs, slots, H, Hk, scale, M + items[i].prow, S + items[i].prow,
                 A + 64 * items[i].prow);
    /* merge: the chunks of one (sequence, tile, head) are consecutive items */
    #pragma omp parallel for schedule(dynamic, 4)
    for (int64_t i = 0; i < n_items; i++) {
        if (items[i].c0 != 0) continue;
        int64_t e = i + 1;
        while (e < n_items && items[e].c0 != 0) e++;
        const Item* it = &items[i];
        int64_t row0 = seqs[4 * it->b];
        int R = (int)(it->q1 - it->q0) * G, nrows = R * Hk;
        for (int r = 0; r < nrows; r++) {
            float mx = -INFINITY, tot = 0.f, o[64] = {0};
            for (int64_t c = i; c < e; c++) if (M[items[c].prow + r] > mx) mx = M[items[c].prow + r];
            for (int64_t c = i; c < e; c++) {
                float m = M[items[c].prow + r];
                if (m == -INFINITY) continue;
                float w = expf(m - mx);
                tot += S[items[c].prow + r] * w;
                const float* a = A + 64 * (items[c].prow + r);
                for (int d = 0; d < 64; d++) o[d] += a[d] * w;
            }
            int64_t j = it->q0 + (r % R) / G;
            int h = (r / R) * G + r % G;
            float* dst = out + ((row0 + j) * H + h) * 64;
            float inv = tot > 0.f ? 1.f / tot : 0.f;
            for (int jj = 0; jj < 4; jj++)
                for (int lane = 0; lane < 16; lane++) dst[lane_dim(jj, lane)] = o[16 * jj + lane] * inv;
        }
    }
    free(items); free(M); free(S); free(A);
    return 0;
}

int streamkv_paged_attn_available(void) { return 1; }
#else
int streamkv_paged_attn(const uint16_t* q, const uint16_t* kc, const uint16_t* vc, const int64_t* seqs,
                        int64_t B, const int64_t* slots, int H, int Hk, float scale, int64_t chunk_len,
                        float* out) {
    (void)q; (void)kc; (void)vc; (void)seqs; (void)B; (void)slots; (void)H; (void)Hk; (void)scale;
    (void)chunk_len; (void)out;
    return 2;
}

int streamkv_paged_attn_available(void) { return 0; }
#endif
