/* The fma chain's blockings for q4_gemm.c (``linear=q4f``): mid_rows() for 1-32 rows (chunks of up
 * to 16 rows, pairs expanded as read), and the many-row items, R (1-6) rows x P (1-3) tiles.
 *
 * Included by q4_gemm.c inside its AVX512-BF16 section, after Q4, PF, the MID_* constants and the
 * helpers used here (wvec(), group_scale(), group_end(), store_row(), keep_of(), my_tiles()). For the many-row
 * items the pairs come widened to float32 once per block of rows (big_tiles()): per group g, pair
 * p, tile i wp[((16 g + p) P + i) 2 + {0, 1}] holds the 16 rows' (q[2p] - 8, q[2p + 1] - 8); the
 * mid rows widen each pair as they read it. Per element, either way:
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

/* mid rows (the fma chain, 1..MID_MAX rows): R (1-16) rows x P (1-4) tiles over every group, each
 * pair expanded and widened as it is read (no widening pass through memory). x comes transposed,
 * xt [G * 16 pairs][M][2]: a pair's R rows are contiguous, so every broadcast is one base pointer
 * plus a constant (16 rows' pointers overflowed the general registers and were reloaded from the
 * stack every pair). o waits in memory between groups. */
static inline __attribute__((always_inline)) void fma_mid(const Q4* a, const int R, const int P, int64_t m0, int t0) {
    const __m512i ctrl = shift_ctrl(), table = q4_table();
    __m512 o[16][4];
    for (int r = 0; r < R; r++) for (int i = 0; i < P; i++) o[r][i] = _mm512_setzero_ps();
    for (int g = 0; g < a->G; g++) {
        __m512 s[16][4];
        for (int r = 0; r < R; r++) for (int i = 0; i < P; i++) s[r][i] = _mm512_setzero_ps();
        const float* x = a->xt + ((int64_t)g * 16 * a->M + m0) * 2;
        for (int p = 0; p < 16; p++, x += 2 * a->M) {
            __m512 we[4], wo[4];
            for (int i = 0; i < P; i++) v_bf16_pairs(wvec(a, 0, t0 + i, g, p, ctrl, table), &we[i], &wo[i]);
            for (int r = 0; r < R; r++) {
                const __m512 x0 = _mm512_set1_ps(x[2 * r]), x1 = _mm512_set1_ps(x[2 * r + 1]);
                for (int i = 0; i < P; i++) s[r][i] = _mm512_fmadd_ps(x0, we[i], _mm512_fmadd_ps(x1, wo[i], s[r][i]));
            }
        }
        for (int i = 0; i < P; i++) {
            __m512 sc, zr;
            group_scale(a, 0, t0 + i, g, &sc, &zr);
            for (int r = 0; r < R; r++) o[r][i] = group_end(a, 0, s[r][i], sc, zr, m0 + r, g, o[r][i]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int i = 0; i < P; i++)
            store_row(a->out, a->bf16_out, (m0 + r) * a->N + 16 * (t0 + i), keep_of(a, t0 + i), o[r][i]);
}

#define MID_R(R)                                                                                  \
    static void mid##R(const Q4* a, int P, int64_t m0, int t0) {                                  \
        if (P >= 4) fma_mid(a, R, 4, m0, t0); else if (P == 3) fma_mid(a, R, 3, m0, t0);          \
        else if (P == 2) fma_mid(a, R, 2, m0, t0); else fma_mid(a, R, 1, m0, t0);                 \
    }
MID_R(1) MID_R(2) MID_R(3) MID_R(4) MID_R(5) MID_R(6) MID_R(7) MID_R(8)
MID_R(9) MID_R(10) MID_R(11) MID_R(12) MID_R(13) MID_R(14) MID_R(15) MID_R(16)

/* tiles per item for R rows: enough chains in flight (R x P >= 8) within the registers */
static inline int mid_tiles(int R) { return R <= 2 ? 4 : R == 3 ? 3 : R <= MID_P2 ? 2 : 1; }

/* the fma chain for 1..MID_MAX rows: n chunks of at most MID_RMAX rows (balanced). One chunk: each
 * thread takes a contiguous range of tiles (balanced to one tile); several: (chunk, tiles) items
 * handed out one at a time. */
static void mid_rows(const Q4* a) {
    void (*const f[17])(const Q4*, int, int64_t, int) = {NULL, mid1, mid2, mid3, mid4, mid5, mid6, mid7, mid8,
                                                         mid9, mid10, mid11, mid12, mid13, mid14, mid15, mid16};
    const int T = a->T, n = (int)((a->M + MID_RMAX - 1) / MID_RMAX);
    const int step = mid_tiles((int)((a->M + n - 1) / n)), items = (T + step - 1) / step;
    if (n == 1) {
        #pragma omp parallel
        {
            int t0, t1;
            my_tiles(T, &t0, &t1);
            for (int t = t0; t < t1; t += step) f[a->M](a, t1 - t < step ? t1 - t : step, 0, t);
        }
        return;
    }
    #pragma omp parallel for schedule(dynamic, 1)
    for (int j = 0; j < n * items; j++) {
        const int c = j / items, t = (j % items) * step;
        const int64_t m0 = (int64_t)c * (a->M / n) + (c < a->M % n ? c : a->M % n);
        f[a->M / n + (c < a->M % n)](a, T - t < step ? T - t : step, m0, t);
    }
}

#endif
