/* One super-block of query rows for inv_attn_bf16.c: scores, the online-softmax update, P V.
 *
 * Included by inv_attn_bf16.c inside its AVX512-BF16 section, after NB (16-key blocks per
 * super-block) and MAXDB (32-dim blocks per head, D <= 32 MAXDB). Key blocks come transposed
 * (load_block() there): K block x at Kt + 16 DB x, pair-major (Kt[16 DB x + p] holds dim pair p of
 * its 16 keys); V block x at Vp + 16 DB x, key pairs interleaved (Vp[(8 x + kp) 2 DB + j]).
 *
 *   rows r0 .. r0+3:  acc[r][x] = q_r . K block x      one vdpbf16ps chain per key over dim pairs
 *   each row:         m' = max(m, block max), a = exp(m - m'), p = bf16(exp(s - m')), l = l a + sum p
 *   rows r0 .. r0+3:  o[r][j] = o[r][j] a_r + P V      one vdpbf16ps chain per element over key pairs
 *
 * Whatever the grouping (four rows, two, or one row with a partly visible block), each element
 * sees the same operations in the same order: a row's bits never depend on its neighbours.
 *
 * The fma chain (F = 1, attention path "bf16f"): every vdpbf16ps above as two float32 fmas of the
 * same exact products, the pair's odd element first (as the instruction's definition adds them):
 *
 *   acc = fma(q[2p], k[2p], fma(q[2p + 1], k[2p + 1], acc))       o = fma(p[2kp], v[2kp], fma(p[2kp + 1], ...))
 *
 * from blocks widened once per super-block (widen_blocks(): Kf[2 (16 DB x + p) + {0, 1}] the even /
 * odd dim of K's pair p, Vf[2 ((8 x + kp) 2 DB + j) + {0, 1}] key 2kp's / 2kp + 1's element), q and
 * P widened per group of rows (exact). vdpbf16ps flushes denormal inputs and sums to zero, the fmas
 * keep them; otherwise the bits are the same (tests/test_attention_fma.py). Where vdpbf16ps issues
 * at half the float32 fma rate (the Intel Xeon without AMX) this is the faster of the two.
 */
#ifndef STREAMKV_ATTN_BF16_ROWS_H
#define STREAMKV_ATTN_BF16_ROWS_H

typedef struct {
    float m, l;
    v16 o[2 * MAXDB];
} RowState;

/* keys of a super-block of nk keys that a row at context index pos (relative to its first key) sees */
static inline int row_lim(int64_t pos, int nk) { return pos + 1 <= 0 ? 0 : pos + 1 < nk ? (int)(pos + 1) : nk; }

/* 2^t, t <= 0 up to rounding (a lane past a row's keys may hold anything: it is masked after): a
 * degree-4 fit of 2^f on [0, 1), f = t - floor(t) (relative error 2.7e-6, far below P's bf16
 * rounding), scaled by 2^floor(t) (vscalefps floors its exponent itself). The tile path's exp. */
static inline __m512 exp2_tile(__m512 t) {
    const __m512 f = _mm512_reduce_ps(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);   /* t - floor(t) */
    __m512 p = _mm512_set1_ps(0.013534167781472206f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.052011460065841675f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.2414427548646927f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.6930038332939148f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0000026226043701f));
    return _mm512_scalef_ps(p, t);
}

/* The tile path's p and P of one row over its nx key blocks (lim keys visible): p = 2^(s c + k),
 * zero past lim; two blocks' P converted and stored together (the same rounding as one at a time) */
static inline __attribute__((always_inline)) void tile_exp_row(const int nx, const int lim, const __m512* s,
                                                               __m512 vc, __m512 vk, uint32_t (*P)[8],
                                                               __m512* tot) {
    for (int x = 0; x < nx; x += 2) {
        __m512 p[2];
        for (int i = 0; i < 2 && x + i < nx; i++) {
            const int left = lim - 16 * (x + i);
            p[i] = exp2_tile(_mm512_fmadd_ps(s[x + i], vc, vk));
            if (left < 16) p[i] = _mm512_maskz_mov_ps((__mmask16)((1u << left) - 1), p[i]);
            *tot = _mm512_add_ps(*tot, p[i]);
        }
        if (x + 1 < nx) _mm512_storeu_si512((void*)P[x], (__m512i)_mm512_cvtne2ps_pbh(p[1], p[0]));
        else _mm256_storeu_si256((__m256i*)P[x], (__m256i)_mm512_cvtneps_pbh(p[0]));
    }
}

/* lane r = the largest lane of v[r], r < 16: a tree of shuffles over all 16 rows at once (4 steps
 * of 16 -> 8 -> 4 -> 2 -> 1 partials per row, then one permute; a max is exact in any order) */
static inline __m512 v_hmax16(const __m512 v[16]) {
    __m512 w[8], x[4], y[2];
    for (int i = 0; i < 8; i++)                   /* 256-bit half h of w[i]: row 2i + h */
        w[i] = _mm512_max_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
    for (int i = 0; i < 4; i++)                   /* 128-bit lane q of x[i]: row 4i + q */
        x[i] = _mm512_max_ps(_mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0xDD));
    for (int i = 0; i < 2; i++)                   /* lane q, elements 2e + (0, 1): row 4 (2i + e) + q */
        y[i] = _mm512_max_ps(_mm512_shuffle_ps(x[2 * i], x[2 * i + 1], 0x44),
                             _mm512_shuffle_ps(x[2 * i], x[2 * i + 1], 0xEE));
    /* lane q, element e: row 4e + q */
    const __m512 z = _mm512_max_ps(_mm512_shuffle_ps(y[0], y[1], 0x88), _mm512_shuffle_ps(y[0], y[1], 0xDD));
    return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), z);
}

/* The online-softmax update of rows [0, n), n <= 16: the one definition for every row grouping of
 * super_block() and few_rows() (tile = 0) and for the tile path's tile_softmax() (tile = 1, its own
 * numerics). Per row r with lims[r] > 0:
 *
 *   s[r][x]  row r's unscaled scores of key block x
 *   tile 0:  s scaled, -inf past lims[r] (in place); b = block max; p = exp(s - m')
 *   tile 1:  b = max of the unscaled visible scores, times scale; p = 2^(s c - m' log2 e), c =
 *            scale log2 e (the scale folded into the exponent: ~40% fewer vector operations)
 *   m' = max(m, b), a[r] = exp(m - m') (0 on the row's first block; every row's in one v_exp, lane
 *   r of which equals s_exp of lane r's value), p = 0 past lims[r], P[r][x] = bf16(p) (16 keys per
 *   block x), l = l a + hsum(p), m = m'
 *
 * Rows with lims[r] == 0 are left alone (a[r], P[r] unset). v_hsum4 == v_hsum per row. ``full``
 * (tile only, n = 16): every row sees all NB blocks, constant bounds (the same operations). */
static inline __attribute__((always_inline)) void softmax_rows(const int n, const int tile, const int full,
                                                               __m512 (*s)[NB], const int* lims, float scale,
                                                               uint32_t (*P)[NB][8], float* a, RowState* st) {
    const float LOG2E = 1.4426950408889634f;
    const __m512 vscale = v_set1(scale), vc = v_set1(scale * LOG2E);
    float mo[16], mn[16], ea[16], sums[16];
    __m512 tot[16], mx[16];
    for (int r = 0; r < 16; r++) mx[r] = _mm512_set1_ps(-INFINITY);
    for (int r = 0; r < n; r++) {
        tot[r] = _mm512_setzero_ps();
        mo[r] = st[r].m;
        const int lim = full ? SB : lims[r];
        if (lim == 0) continue;
        for (int x = 0; x < (full ? NB : (lim + 15) / 16); x++) {
            const int left = full ? 16 : lim - 16 * x;
            const __mmask16 seen = (__mmask16)((1u << (left < 16 ? left : 0)) - 1);
            if (tile) {
                mx[r] = left < 16 ? _mm512_mask_max_ps(mx[r], seen, mx[r], s[r][x]) : _mm512_max_ps(mx[r], s[r][x]);
                continue;
            }
            s[r][x] = _mm512_mul_ps(s[r][x], vscale);
            if (left < 16) s[r][x] = _mm512_mask_blend_ps(seen, _mm512_set1_ps(-INFINITY), s[r][x]);
            mx[r] = _mm512_max_ps(mx[r], s[r][x]);
        }
    }
    for (int r = n; r < 16; r++) mo[r] = -INFINITY;
    /* every row's block max at once (lane r: row r; a max is exact in any order), then m', a */
    __m512 bm = v_hmax16(mx), m = v_load(mo);
    if (tile) bm = _mm512_mul_ps(bm, vscale);
    const __m512 mnv = _mm512_max_ps(bm, m);      /* bm > m ? bm : m */
    v_store(mn, mnv);
    v_store(ea, v_exp(_mm512_sub_ps(m, mnv)));
    for (int r = 0; r < n; r++) {
        const int lim = full ? SB : lims[r];
        if (lim == 0) continue;
        a[r] = st[r].m == -INFINITY ? 0.f : ea[r];
        const int nx = full ? NB : (lim + 15) / 16;
        if (tile) { tile_exp_row(nx, lim, s[r], vc, _mm512_set1_ps(-mn[r] * LOG2E), P[r], &tot[r]); continue; }
        for (int x = 0; x < nx; x++) {
            const int left = lim - 16 * x;
            __m512 pr = v_exp(_mm512_sub_ps(s[r][x], _mm512_set1_ps(mn[r])));
            if (left < 16) pr = _mm512_maskz_mov_ps((__mmask16)((1u << left) - 1), pr);
            tot[r] = _mm512_add_ps(tot[r], pr);
            _mm256_storeu_si256((__m256i*)P[r][x], (__m256i)_mm512_cvtneps_pbh(pr));
        }
    }
    int r = 0;
    for (; r + 4 <= n; r += 4) v_hsum4(tot[r], tot[r + 1], tot[r + 2], tot[r + 3], sums + r);
    for (; r < n; r++) sums[r] = v_hsum(tot[r]);
    for (r = 0; r < n; r++) {
        if (!full && lims[r] == 0) continue;
        st[r].l = st[r].l * a[r] + sums[r];
        st[r].m = mn[r];
    }
}

/* the vector path's update (tile = 0) */
static inline __attribute__((always_inline)) void rows_softmax(const int n, __m512 (*s)[NB], const int* lims,
                                                               float scale, uint32_t (*P)[NB][8], float* a,
                                                               RowState* st) {
    softmax_rows(n, 0, 0, s, lims, scale, P, a, st);
}

/* P V of rows [0, NR) over the nb whole 16-key blocks of a super-block, interleaved: element j of
 * row r is still one vdpbf16ps chain over the key pairs in order, o[r][j] = s[r].o[j] * a[r] first;
 * only the schedule differs from one row at a time (NR * NV independent chains instead of NV, so
 * the chains' latency hides behind each other; each V vector is loaded once for the NR rows). */
static inline __attribute__((always_inline)) void pv_rows(const int NR, const int NV, int nb,
                                                          const __m512i* Vp, uint32_t pp[][NB][8],
                                                          const float* a, RowState* st) {
    __m512 o[4][8];
    for (int r = 0; r < NR; r++) {
        const __m512 va = _mm512_set1_ps(a[r]);
        for (int j = 0; j < NV; j++) o[r][j] = _mm512_mul_ps(st[r].o[j], va);
    }
    for (int x = 0; x < nb; x++)
        for (int kp = 0; kp < 8; kp++)
            for (int r = 0; r < NR; r++) {
                const __m512bh w = (__m512bh)_mm512_set1_epi32((int)pp[r][x][kp]);
                for (int j = 0; j < NV; j++)
                    o[r][j] = _mm512_dpbf16_ps(o[r][j], (__m512bh)Vp[(8 * x + kp) * NV + j], w);
            }
    for (int r = 0; r < NR; r++)
        for (int j = 0; j < NV; j++) st[r].o[j] = o[r][j];
}

/* The scores of rows [0, nr) against nbk 16-key blocks: acc[r][x] lane i = one vdpbf16ps chain over
 * the dim pairs p = 0 .. P - 1 of q_r and key 16x + i (unscaled). */
static inline __attribute__((always_inline)) void qk_rows(const int nr, const int nbk, int P, int KS,
                                                          const uint32_t (*qp)[64], const __m512i* Kt,
                                                          __m512 acc[4][NB]) {
    for (int r = 0; r < nr; r++) for (int x = 0; x < nbk; x++) acc[r][x] = _mm512_setzero_ps();
    for (int p = 0; p < P; p++)
        for (int r = 0; r < nr; r++) {
            const __m512bh qb = (__m512bh)_mm512_set1_epi32((int)qp[r][p]);
            for (int x = 0; x < nbk; x++) acc[r][x] = _mm512_dpbf16_ps(acc[r][x], (__m512bh)Kt[x * KS + p], qb);
        }
}

#include "attn_fma_rows.h"


/* P V of one row over its lim visible keys (the partly visible super-blocks of a prompt's diagonal,
 * a decode row's last block): key pairs the row does not see at all are skipped. F: the chain
 * (attn_fma_rows.h; Vp then widened when F = 1). */
static inline __attribute__((always_inline)) void pv_row(const int F, int nv, int lim, const void* Vp,
                                                         uint32_t pp[NB][8], float a, RowState* s) {
    const int rb = (lim + 15) / 16;
    const __m512 va = _mm512_set1_ps(a);
    float pf[SB];
    if (F) widen_p(rb, pp, pf);
    __m512 o[2 * MAXDB];
    for (int j = 0; j < nv; j++) o[j] = _mm512_mul_ps(s->o[j], va);
    for (int x = 0; x < rb; x++) {
        const int left = lim - 16 * x, npairs = left >= 16 ? 8 : (left + 1) / 2;
        for (int kp = 0; kp < npairs; kp++) {
            const int at = (8 * x + kp) * nv;
            if (F) {
                const __m512 pe = _mm512_set1_ps(pf[16 * x + 2 * kp]), po = _mm512_set1_ps(pf[16 * x + 2 * kp + 1]);
                for (int j = 0; j < nv; j++) {
                    __m512 ve, vo;
                    kv_pair(F == 1, Vp, at + j, &ve, &vo);
                    o[j] = _mm512_fmadd_ps(pe, ve, _mm512_fmadd_ps(po, vo, o[j]));
                }
                continue;
            }
            const __m512bh w = (__m512bh)_mm512_set1_epi32((int)pp[x][kp]);
            for (int j = 0; j < nv; j++) o[j] = _mm512_dpbf16_ps(o[j], (__m512bh)((const __m512i*)Vp)[at + j], w);
        }
    }
    for (int j = 0; j < nv; j++) s->o[j] = o[j];
}

/* Rows [0, rn), rn < 4 (a decode row's kv group of 3, a tile's last rows): the scores together,
 * each row's softmax, then P V: together for a kv group of 3 over a whole super-block that every
 * row sees (decode rows away from the context's end: pv_rows() with constant bounds, the
 * accumulators in registers), else row by row (pv_row()). Per element the same operations as
 * super_block()'s four-row groups. (Those groups' code run with fewer rows measured ~6% slower on
 * decode kv groups of 3.) */
static inline __attribute__((always_inline)) void few_rows(const int F, int D, float scale, const uint32_t (*qp)[64],
                                                          const int64_t* pos, int rn, int nk, const __m512i* Kt,
                                                          const __m512i* Vp, RowState* st) {
    const int DB = (D + 31) / 32, P = D / 2, nv = 2 * DB, nb = (nk + 15) / 16, KS = 16 * DB;
    __m512 acc[4][NB];
    if (rn == 3 && nb == NB) QK_ROWS(F, 3, NB, P, KS, qp, Kt, acc);   /* constant bounds: unrolled */
    else QK_ROWS(F, rn, nb, P, KS, qp, Kt, acc);
    uint32_t pp[4][NB][8];
    float a[4];
    int lims[4], whole = rn == 3 && nk == SB && nv <= 4;
    for (int r = 0; r < rn; r++) {
        lims[r] = row_lim(pos[r], nk);
        whole &= lims[r] == nk;
    }
    rows_softmax(rn, acc, lims, scale, pp, a, st);
    if (whole && nv == 2) PV_ROWS(F, 3, 2, NB, Vp, pp, a, st);
    else if (whole) PV_ROWS(F, 3, 4, NB, Vp, pp, a, st);
    else
        for (int r = 0; r < rn; r++)
            if (lims[r] > 0) pv_row(F, nv, lims[r], Vp, pp[r], a[r], st + r);
}

/* One super-block for rows [0, R): scores, softmax update, P V. pos[r] is row r's context index
 * relative to the super-block's first key. Rows go four at a time: their scores together, then
 * each row's softmax, then their P V together when all four see every key of the block (whole
 * 16-key blocks), else row by row; the last R % 4 rows go through few_rows(). Either way the
 * same operations per element. */
static inline __attribute__((always_inline)) void super_block(const int F, int D, float scale,
                                                             const uint32_t (*qp)[64], const int64_t* pos, int R,
                                                             int nk, const __m512i* Kt, const __m512i* Vp,
                                                             RowState* st) {
    const int DB = (D + 31) / 32, P = D / 2, nv = 2 * DB, nb = (nk + 15) / 16, KS = 16 * DB;
    int r0 = 0;
    for (; r0 + 4 <= R; r0 += 4) {
        __m512 acc[4][NB];
        if (nb == NB) QK_ROWS(F, 4, NB, P, KS, qp + r0, Kt, acc);   /* constant bounds: unrolled */
        else QK_ROWS(F, 4, nb, P, KS, qp + r0, Kt, acc);
        uint32_t pp[4][NB][8];
        float a[4];
        int lims[4], whole = nk % 16 == 0;
        for (int r = 0; r < 4; r++) {
            lims[r] = row_lim(pos[r0 + r], nk);
            whole &= lims[r] == nk;
        }
        rows_softmax(4, acc, lims, scale, pp, a, st + r0);
        if (whole && nv <= 4) {                            /* D <= 64: 4 rows x nv chains */
            if (nv == 2) PV_ROWS(F, 4, 2, nb, Vp, pp, a, st + r0);
            else PV_ROWS(F, 4, 4, nb, Vp, pp, a, st + r0);
        } else if (whole) {                                /* D <= 128: two rows at a time */
            for (int h = 0; h < 4; h += 2)
                if (nv == 6) PV_ROWS(F, 2, 6, nb, Vp, pp + h, a + h, st + r0 + h);
                else PV_ROWS(F, 2, 8, nb, Vp, pp + h, a + h, st + r0 + h);
        } else {
            for (int r = 0; r < 4; r++)
                if (lims[r] > 0) pv_row(F, nv, lims[r], Vp, pp[r], a[r], st + r0 + r);
        }
    }
    if (r0 < R) few_rows(F, D, scale, qp + r0, pos + r0, R - r0, nk, Kt, Vp, st + r0);
}

/* the chains' super-blocks (F = 0: vdpbf16ps over Kt, Vp; F = 1: fmas over the widened blocks;
 * F = 2: fmas over Kt, Vp, widened as they are read: the same values, for a few rows) */
static void super_block_dp(int D, float scale, const uint32_t (*qp)[64], const int64_t* pos, int R, int nk,
                           const __m512i* Kt, const __m512i* Vp, RowState* st) {
    super_block(0, D, scale, qp, pos, R, nk, Kt, Vp, st);
}

static void super_block_fma(int D, float scale, const uint32_t (*qp)[64], const int64_t* pos, int R, int nk,
                            const __m512* Kf, const __m512* Vf, RowState* st) {
    super_block(1, D, scale, qp, pos, R, nk, (const __m512i*)Kf, (const __m512i*)Vf, st);
}

static void super_block_fma_few(int D, float scale, const uint32_t (*qp)[64], const int64_t* pos, int R, int nk,
                                const __m512i* Kt, const __m512i* Vp, RowState* st) {
    super_block(2, D, scale, qp, pos, R, nk, Kt, Vp, st);
}

#endif
