/* The fma chain of inv_attn_bf16.c's vector path (attention path "bf16f"), for attn_bf16_rows.h.
 *
 * Included by attn_bf16_rows.h after qk_rows() and pv_rows(), inside the AVX512-BF16 section. Each
 * vdpbf16ps of those becomes two float32 fmas of the same exact products, the pair's odd element
 * first (the instruction's definition). K and V blocks come as bf16 pairs (Kt, Vp) or widened
 * (widen_blocks(): two float32 vectors per pair vector, even then odd elements); kv_pair() reads
 * either (W), so a few rows skip the widening pass and more rows run it once per super-block.
 * QK_ROWS / PV_ROWS (and pv_row()'s F) pick the chain: 0 vdpbf16ps, 1 widened blocks, 2 pairs widened
 * as read.
 */
#ifndef STREAMKV_ATTN_FMA_ROWS_H
#define STREAMKV_ATTN_FMA_ROWS_H

/* q's pairs of rows [0, nr), widened: qe[r][p] = q_r[2p], qo[r][p] = q_r[2p + 1] (exact) */
static inline __attribute__((always_inline)) void widen_q(const int nr, int P, const uint32_t (*qp)[64],
                                                          float qe[4][64], float qo[4][64]) {
    for (int r = 0; r < nr; r++)
        for (int p = 0; p < P; p += 16) {   /* qp is zero past D/2 up to whole 16-pair vectors */
            __m512 e, o;
            v_bf16_pairs(_mm512_loadu_si512((const void*)(qp[r] + p)), &e, &o);
            v_store(qe[r] + p, e);
            v_store(qo[r] + p, o);
        }
}

/* vector i of a block array as its pairs' even and odd elements: W = 1 widened (2 float32 vectors
 * per pair vector), W = 0 bf16 pairs widened here (the same values) */
static inline __attribute__((always_inline)) void kv_pair(const int W, const void* base, int64_t i, __m512* e,
                                                          __m512* o) {
    if (W) {
        *e = ((const __m512*)base)[2 * i];
        *o = ((const __m512*)base)[2 * i + 1];
        return;
    }
    v_bf16_pairs(((const __m512i*)base)[i], e, o);
}

/* qk_rows() as the fma chain over K blocks (Kf: widened if W) */
static inline __attribute__((always_inline)) void qk_rows_f(const int W, const int nr, const int nbk, int P, int KS,
                                                            const uint32_t (*qp)[64], const void* Kf,
                                                            __m512 acc[4][NB]) {
    float qe[4][64], qo[4][64];
    widen_q(nr, P, qp, qe, qo);
    for (int r = 0; r < nr; r++) for (int x = 0; x < nbk; x++) acc[r][x] = _mm512_setzero_ps();
    for (int p = 0; p < P; p++) {
        __m512 be[4], bo[4];
        for (int r = 0; r < nr; r++) { be[r] = _mm512_set1_ps(qe[r][p]); bo[r] = _mm512_set1_ps(qo[r][p]); }
        for (int x = 0; x < nbk; x++) {
            __m512 ke, ko;
            kv_pair(W, Kf, x * KS + p, &ke, &ko);
            for (int r = 0; r < nr; r++) acc[r][x] = _mm512_fmadd_ps(be[r], ke, _mm512_fmadd_ps(bo[r], ko, acc[r][x]));
        }
    }
}

/* row r's P of nb key blocks as float32 in key order (exact: bf16 -> float32) */
static inline void widen_p(int nb, uint32_t pp[NB][8], float* pf) {
    for (int x = 0; x < nb; x++) v_store(pf + 16 * x, v_load_bf16((const uint16_t*)pp[x]));
}

/* pv_rows() as the fma chain over V blocks (Vf: widened if W) */
static inline __attribute__((always_inline)) void pv_rows_f(const int W, const int NR, const int NV, int nb,
                                                            const void* Vf, uint32_t pp[][NB][8], const float* a,
                                                            RowState* st) {
    float pf[4][SB];
    __m512 o[4][8];
    for (int r = 0; r < NR; r++) {
        widen_p(nb, pp[r], pf[r]);
        const __m512 va = _mm512_set1_ps(a[r]);
        for (int j = 0; j < NV; j++) o[r][j] = _mm512_mul_ps(st[r].o[j], va);
    }
    for (int k = 0; k < 16 * nb; k += 2) {            /* key pair (k, k + 1) */
        __m512 ve[8], vo[8];
        for (int j = 0; j < NV; j++) kv_pair(W, Vf, (k / 2) * NV + j, &ve[j], &vo[j]);
        for (int r = 0; r < NR; r++) {
            const __m512 pe = _mm512_set1_ps(pf[r][k]), po = _mm512_set1_ps(pf[r][k + 1]);
            for (int j = 0; j < NV; j++) o[r][j] = _mm512_fmadd_ps(pe, ve[j], _mm512_fmadd_ps(po, vo[j], o[r][j]));
        }
    }
    for (int r = 0; r < NR; r++)
        for (int j = 0; j < NV; j++) st[r].o[j] = o[r][j];
}

/* n vectors of bf16 pairs -> 2n float32 vectors: each pair's low (even) then high (odd) element */
static inline void widen_blocks(int n, const __m512i* src, __m512* dst) {
    for (int i = 0; i < n; i++) v_bf16_pairs(src[i], dst + 2 * i, dst + 2 * i + 1);
}

/* the chain F picks: 0 vdpbf16ps, 1 fmas over widened K and V blocks, 2 fmas widening as they go */
#define QK_ROWS(F, nr, nbk, P, KS, qp, Kt, acc) \
    (F ? qk_rows_f(F == 1, nr, nbk, P, KS, qp, Kt, acc) : qk_rows(nr, nbk, P, KS, qp, Kt, acc))
#define PV_ROWS(F, NR, NV, nb, Vp, pp, a, st) \
    (F ? pv_rows_f(F == 1, NR, NV, nb, Vp, pp, a, st) : pv_rows(NR, NV, nb, Vp, pp, a, st))

#endif
