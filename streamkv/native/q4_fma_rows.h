/* The fma chain's many-row items for q4_gemm.c (``linear=q4f``): R (1-6) rows x P (1-3) tiles.
 *
 * Included by q4_gemm.c inside its AVX512-BF16 section, after Q4, PF and group_end(). The pairs
 * come widened to float32 once per block of rows (big_tiles()): per group g, pair p, tile i
 * wp[((16 g + p) P + i) 2 + {0, 1}] holds the 16 rows' (q[2p] - 8, q[2p + 1] - 8). Per element:
 *
 *   s = 0;  s = fma(x[2p], q[2p] - 8, fma(x[2p + 1], q[2p + 1] - 8, s))  for p = 0 .. 15
 *   o = fma(s, scale, o);  o = fma(zero, xsum, o)                         (group_end())
 *
 * the chain of the header of q4_gemm.c, whatever R, P or the groups a call covers.
 */
#ifndef STREAMKV_Q4_FMA_ROWS_H
#define STREAMKV_Q4_FMA_ROWS_H

/* the fma chain, groups [g0, g1) of R rows from m x P tiles: the pairs read widened (wp [G][16][P][2]
 * float32: big_tiles), s and o in registers (fixed sizes: no spills), o [R][PF] kept in memory between
 * calls (a block's rows run KG groups at a time, so those groups' pairs, 6 KB each, stay in L1) */
static inline __attribute__((always_inline)) void fma_blk(const Q4* a, const int R, const int P, int64_t m, int g0,
                                                          int g1, const __m512* wp, const __m512* scz, __m512* ob) {
    __m512 o[6][PF];
    for (int r = 0; r < R; r++) for (int i = 0; i < P; i++) o[r][i] = ob[PF * r + i];
    for (int g = g0; g < g1; g++) {
        __m512 s[6][PF];
        for (int r = 0; r < R; r++) for (int i = 0; i < P; i++) s[r][i] = _mm512_setzero_ps();
        const float* x = a->xw + m * a->K + 32 * g;
        const __m512* w = wp + g * 32 * P;
        for (int p = 0; p < 16; p++, w += 2 * P, x += 2)
            for (int r = 0; r < R; r++) {
                const __m512 x0 = _mm512_set1_ps(x[(int64_t)r * a->K]), x1 = _mm512_set1_ps(x[(int64_t)r * a->K + 1]);
                for (int i = 0; i < P; i++) s[r][i] = _mm512_fmadd_ps(x0, w[2 * i], _mm512_fmadd_ps(x1, w[2 * i + 1], s[r][i]));
            }
        for (int r = 0; r < R; r++)
            for (int i = 0; i < P; i++)
                o[r][i] = group_end(a, 0, s[r][i], scz[(g * P + i) * 2], scz[(g * P + i) * 2 + 1], m + r, g, o[r][i]);
    }
    for (int r = 0; r < R; r++) for (int i = 0; i < P; i++) ob[PF * r + i] = o[r][i];
}

#define FMA_ROWS(R)                                                                                           \
    static void fma##R(const Q4* a, int P, int64_t m, int g0, int g1, const __m512* wp, const __m512* scz,     \
                       __m512* ob) {                                                                          \
        if (P == 3) fma_blk(a, R, 3, m, g0, g1, wp, scz, ob);                                                  \
        else if (P == 2) fma_blk(a, R, 2, m, g0, g1, wp, scz, ob); else fma_blk(a, R, 1, m, g0, g1, wp, scz, ob); \
    }
FMA_ROWS(1) FMA_ROWS(2) FMA_ROWS(3) FMA_ROWS(4) FMA_ROWS(5) FMA_ROWS(6)

#endif
