/* One super-block of query rows on AMX tiles, for inv_attn_bf16.c (attention path "amx").
 *
 * Included by inv_attn_bf16.c after attn_bf16_rows.h, inside its AVX512-BF16 section; the tile
 * code only where AMX is compiled (amx.h), the dispatch at the end (rows_block()) everywhere.
 * The same steps as super_block() there, 16 rows at a time, with every dot product on tiles; the
 * key blocks' layouts are already the tiles' VNNI B layout:
 *
 *   Q tile   A[r][p]     = q pair p of row r (32 dims = 16 pairs per tile, dim block h)
 *   Kt       B[p][key]   = dim pair p of 16 keys           (Kt + KS x + 16 h, 64-byte rows)
 *   scores   S[r][16 x + i] = sum over h of TDPBF16PS(Q_h, Kt_{x,h})      (unscaled; C tiles 0-3)
 *   softmax  per row (softmax_rows() with tile = 1, this path's own: the scale folded into a base-2 exponent):
 *            b = max of the row's unscaled visible scores, m' = max(m, b scale), a = exp(m - m'),
 *            p = 2^(s c - m' log2 e) with c = scale log2 e (zero where the row sees no key),
 *            P = bf16(p), l = l a + sum p
 *   P tile   A[r][kp]    = P pair kp of row r over a 32-key group t (keys 32 t .. 32 t + 31)
 *   Vp       B[kp][lane] = V pair kp of lane block j          (Vp + 16 t nv + j, nv-vector rows)
 *   P V      o = o a (skipped where a == 1: the same bits), then o += TDPBF16PS(P_t, Vp_{t,j}) over
 *            t in order, the C tiles loaded from and stored to the rows' RowState.o in place
 *
 * Per element: scores are one chain of bf16 pair products over the dim pairs in order, P V one
 * chain over the key pairs in order starting from o a, as on the vector path; a row's tile row
 * depends on nothing but the row. Key pairs a row does not see add exact zeros (P = 0 there, and
 * the padding of a last odd 16-key block is a zero V copy), so a prompt row and its own decode,
 * whose context ends at that key, give the same bits.
 *
 * tiles: 0-3 C, 4 A, 5-6 B (amx_configure_rows(tr) per work item: tr = 16 row tiles, or a
 * few-row item's own row count, so a decode's kv group of 3 runs 3-row tiles).
 */
#ifndef STREAMKV_ATTN_AMX_ROWS_H
#define STREAMKV_ATTN_AMX_ROWS_H
#ifdef AMX

/* scores of 16 rows (qa: 64-dword rows, pairs past D/2 zero) against the nb key blocks: S[r][16x + i] */
static inline void tile_scores(int DB, int nb, const uint32_t (*qa)[64], const __m512i* Kt, float S[16][SB]) {
    const int KS = 16 * DB;
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    for (int h = 0; h < DB; h++) {
        _tile_loadd(4, qa[0] + 16 * h, 256);
        _tile_loadd(5, Kt + 16 * h, 64);
        _tile_dpbf16ps(0, 4, 5);
        if (nb > 1) { _tile_loadd(6, Kt + KS + 16 * h, 64); _tile_dpbf16ps(1, 4, 6); }
        if (nb > 2) { _tile_loadd(5, Kt + 2 * KS + 16 * h, 64); _tile_dpbf16ps(2, 4, 5); }
        if (nb > 3) { _tile_loadd(6, Kt + 3 * KS + 16 * h, 64); _tile_dpbf16ps(3, 4, 6); }
    }
    _tile_stored(0, S[0], SB * 4);
    if (nb > 1) _tile_stored(1, S[0] + 16, SB * 4);
    if (nb > 2) _tile_stored(2, S[0] + 32, SB * 4);
    if (nb > 3) _tile_stored(3, S[0] + 48, SB * 4);
}

/* o += P V over the ng 32-key groups for lane blocks [j0, j0 + nj), nj <= 4: row r's lane block j
 * is st[r].o[j] (the C tiles' rows are RowStates apart); group t's V rows at vb[t] + j, nv vectors apart */
static inline void tile_pv(int nv, int ng, int j0, int nj, uint16_t Pb[16][SB], const __m512i* const* vb, RowState* st) {
    const int ld = 64 * nv, lo = (int)sizeof(RowState);
    _tile_loadd(0, st->o + j0, lo);
    if (nj > 1) _tile_loadd(1, st->o + j0 + 1, lo);
    if (nj > 2) _tile_loadd(2, st->o + j0 + 2, lo);
    if (nj > 3) _tile_loadd(3, st->o + j0 + 3, lo);
    for (int t = 0; t < ng; t++) {
        _tile_loadd(4, Pb[0] + 32 * t, SB * 2);
        _tile_loadd(5, vb[t] + j0, ld);
        _tile_dpbf16ps(0, 4, 5);
        if (nj > 1) { _tile_loadd(6, vb[t] + j0 + 1, ld); _tile_dpbf16ps(1, 4, 6); }
        if (nj > 2) { _tile_loadd(5, vb[t] + j0 + 2, ld); _tile_dpbf16ps(2, 4, 5); }
        if (nj > 3) { _tile_loadd(6, vb[t] + j0 + 3, ld); _tile_dpbf16ps(3, 4, 6); }
    }
    _tile_stored(0, st->o + j0, lo);
    if (nj > 1) _tile_stored(1, st->o + j0 + 1, lo);
    if (nj > 2) _tile_stored(2, st->o + j0 + 2, lo);
    if (nj > 3) _tile_stored(3, st->o + j0 + 3, lo);
}

/* softmax_rows() (tile = 1) of rows [0, rn) over their unscaled scores S, writing P over the 32 ng
 * keys the tiles read (bf16, zero where a row sees no key, rows [rn, tr) all zero) and each row's
 * rescale factor a; lims[r]: keys of the super-block row r sees */
static inline void tile_softmax(float scale, const int64_t* pos, int rn, int tr, int nk, int ng, float S[16][SB],
                                uint16_t Pb[16][SB], float* a, int* lims, RowState* st) {
    for (int r = rn; r < tr; r++) memset(Pb[r], 0, sizeof(uint16_t) * 32 * ng);
    int full = rn == 16 && nk == SB;
    for (int r = 0; r < rn; r++) {
        lims[r] = row_lim(pos[r], nk);
        full &= lims[r] == SB;
        const int rb = (lims[r] + 15) / 16;
        if (rb < 2 * ng) memset(Pb[r] + 16 * rb, 0, sizeof(uint16_t) * 16 * (2 * ng - rb));
    }
    __m512 (*sv)[NB] = (__m512 (*)[NB])S;
    uint32_t (*pv)[NB][8] = (uint32_t (*)[NB][8])Pb;
    if (full) softmax_rows(16, 1, 1, sv, lims, scale, pv, a, st);   /* constant bounds: unrolled */
    else softmax_rows(rn, 1, 0, sv, lims, scale, pv, a, st);
}

/* Rows [0, rn) of one super-block on tiles of tr rows, rn <= tr <= 16 (qp rows 64 dwords, pairs
 * past D/2 zero; with padded, rows [rn, tr) of qp are readable zeros too). */
static void tile_rows(int D, float scale, const uint32_t (*qp)[64], int padded, const int64_t* pos, int rn, int tr,
                      int nk, const __m512i* Kt, const __m512i* Vp, RowState* st) {
    const int DB = (D + 31) / 32, nv = 2 * DB, nb = (nk + 15) / 16, ng = (nb + 1) / 2;
    float S[16][SB] __attribute__((aligned(64)));
    uint16_t Pb[16][SB] __attribute__((aligned(64)));
    uint32_t qloc[16][64] __attribute__((aligned(64)));
    __m512i vtail[16 * 2 * MAXDB];
    const uint32_t (*qa)[64] = qp;
    if (rn < tr && !padded) {                     /* a last partial tile: zero rows past rn */
        memset(qloc, 0, sizeof qloc);
        for (int r = 0; r < rn; r++) memcpy(qloc[r], qp[r], sizeof(uint32_t) * 16 * DB);
        qa = (const uint32_t (*)[64])qloc;
    }
    __asm__ volatile("" : : "r"(qa) : "memory");  /* qloc's copy before the tile loads read it (above) */
    tile_scores(DB, nb, qa, Kt, S);
    float a[16];
    int lims[16];
    tile_softmax(scale, pos, rn, tr, nk, ng, S, Pb, a, lims, st);
    const __m512i* vb[NB / 2];
    for (int t = 0; t < ng; t++) vb[t] = Vp + 16 * t * nv;
    if (nb % 2) {                                 /* the last group's second block: zeros */
        memcpy(vtail, vb[ng - 1], sizeof(__m512i) * 8 * nv);
        memset(vtail + 8 * nv, 0, sizeof(__m512i) * 8 * nv);
        vb[ng - 1] = vtail;
    }
    /* o a in place (a == 1: o, so skipped); a row that takes no part keeps its o: saved around the
     * tiles (its P row is zero, but o + 0 is not o for o = -0). A partial tile (rn < tr) runs on a
     * copy whose rows past rn are zeros: the tiles must not touch what lies past the item's rows. */
    RowState pad[16], *so = st;
    if (rn < tr) {
        memcpy(pad, st, sizeof(RowState) * rn);
        memset(pad + rn, 0, sizeof(RowState) * (tr - rn));
        so = pad;
    }
    __m512 keep[16][2 * MAXDB];
    for (int r = 0; r < rn; r++) {
        if (lims[r] == 0) { for (int j = 0; j < nv; j++) keep[r][j] = so[r].o[j]; continue; }
        if (a[r] != 1.f)
            for (int j = 0; j < nv; j++) so[r].o[j] = _mm512_mul_ps(so[r].o[j], v_set1(a[r]));
    }
    /* gcc's _tile_loadd does not say it reads memory: the stores above (o a, the pad copy) and the
     * softmax's P must not move past the tile loads */
    __asm__ volatile("" : : "r"(so), "r"(Pb) : "memory");
    for (int j0 = 0; j0 < nv; j0 += 4) tile_pv(nv, ng, j0, nv - j0 < 4 ? nv - j0 : 4, Pb, vb, so);
    for (int r = 0; r < rn; r++)
        if (lims[r] == 0)
            for (int j = 0; j < nv; j++) so[r].o[j] = keep[r][j];
    if (so != st) memcpy(st, pad, sizeof(RowState) * rn);
}

/* super_block() on tiles of tr rows (tiles_begin()): rows [0, R) tr at a time */
static void super_block_amx(int D, float scale, const uint32_t (*qp)[64], int padded, const int64_t* pos, int R,
                            int tr, int nk, const __m512i* Kt, const __m512i* Vp, RowState* st) {
    for (int r0 = 0; r0 < R; r0 += tr)
        tile_rows(D, scale, qp + r0, padded, pos + r0, R - r0 < tr ? R - r0 : tr, tr, nk, Kt, Vp, st + r0);
}

#endif

/* The item's path, in every build (Ctx is inv_attn_bf16.c's, defined before this header). */

/* one super-block of rows [0, R) on the item's path (tiles: tr rows a tile; padded: qp's rows up
 * to the last tile's end are readable, zero past R) */
static inline void rows_block(const Ctx* cx, const uint32_t (*qp)[64], int padded, const int64_t* pos, int R,
                              int tr, int nk, const __m512i* Kt, const __m512i* Vp, RowState* st) {
#ifdef AMX
    if (cx->tiles) { super_block_amx(cx->D, cx->scale, qp, padded, pos, R, tr, nk, Kt, Vp, st); return; }
#else
    (void)padded; (void)tr;
#endif
    if (cx->fma && R < FMA_WIDEN_ROWS) {   /* a few rows: each pair widened where it is used */
        super_block_fma_few(cx->D, cx->scale, qp, pos, R, nk, Kt, Vp, st);
        return;
    }
    if (cx->fma) {   /* more: the super-block's K and V blocks widened once for every row */
        __m512 Kf[2 * NB * 16 * MAXDB], Vf[2 * NB * 16 * MAXDB];
        const int n = (nk + 15) / 16 * 16 * cx->DB;
        widen_blocks(n, Kt, Kf);
        widen_blocks(n, Vp, Vf);
        super_block_fma(cx->D, cx->scale, qp, pos, R, nk, Kf, Vf, st);
        return;
    }
    super_block_dp(cx->D, cx->scale, qp, pos, R, nk, Kt, Vp, st);
}

/* q pairs of one row (bf16, low half the even dim), zero past D/2 up to whole 32-dim blocks */
static inline void q_pairs(const float* src, int D, int DB, uint32_t* qp) {
    /* pair p's low half is dim 2p: in memory, the dims' bf16 in order (D is a multiple of 16) */
    for (int i = 0; i < D / 16; i++) v_store_bf16((uint16_t*)qp + 16 * i, v_load(src + 16 * i));
    for (int p = D / 2; p < 16 * DB; p++) qp[p] = 0;
}

/* an item's tile rows for R rows: whole 16-row tiles, or a few-row item's own count; configures
 * them on tiles */
static inline int tiles_begin(const Ctx* cx, int R) {
    const int tr = R < 16 ? R : 16;
#ifdef AMX
    if (cx->tiles) amx_configure_rows(tr);
#else
    (void)cx;
#endif
    return tr;
}

static inline void tiles_end(const Ctx* cx) {
#ifdef AMX
    if (cx->tiles) _tile_release();
#else
    (void)cx;
#endif
}

#endif
