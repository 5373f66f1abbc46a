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
 *   softmax  per row, as super_block(): scale, mask, m' = max(m, block max), a = exp(m - m'),
 *            P = bf16(exp(s - m')) (zero where the row sees no key), l = l a + sum P
 *   P tile   A[r][kp]    = P pair kp of row r over a 32-key group t (keys 32 t .. 32 t + 31)
 *   Vp       B[kp][lane] = V pair kp of lane block j          (Vp + 16 t nv + j, nv-vector rows)
 *   P V      O[r][j] = o a, then += TDPBF16PS(P_t, Vp_{t,j}) over t in order  (C tiles 0-3)
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

/* O += P V over the ng 32-key groups for lane blocks [j0, j0 + nj), nj <= 4 (O: row r, lane
 * block j at O + 16 (nv r + j)); group t's V rows at vb[t] + j, nv vectors apart */
static inline void tile_pv(int nv, int ng, int j0, int nj, uint16_t Pb[16][SB], const __m512i* const* vb, float* O) {
    const int ld = 64 * nv;
    _tile_loadd(0, O + 16 * j0, ld);
    if (nj > 1) _tile_loadd(1, O + 16 * (j0 + 1), ld);
    if (nj > 2) _tile_loadd(2, O + 16 * (j0 + 2), ld);
    if (nj > 3) _tile_loadd(3, O + 16 * (j0 + 3), ld);
    for (int t = 0; t < ng; t++) {
        _tile_loadd(4, Pb[0] + 32 * t, SB * 2);
        _tile_loadd(5, vb[t] + j0, ld);
        _tile_dpbf16ps(0, 4, 5);
        if (nj > 1) { _tile_loadd(6, vb[t] + j0 + 1, ld); _tile_dpbf16ps(1, 4, 6); }
        if (nj > 2) { _tile_loadd(5, vb[t] + j0 + 2, ld); _tile_dpbf16ps(2, 4, 5); }
        if (nj > 3) { _tile_loadd(6, vb[t] + j0 + 3, ld); _tile_dpbf16ps(3, 4, 6); }
    }
    _tile_stored(0, O + 16 * j0, ld);
    if (nj > 1) _tile_stored(1, O + 16 * (j0 + 1), ld);
    if (nj > 2) _tile_stored(2, O + 16 * (j0 + 2), ld);
    if (nj > 3) _tile_stored(3, O + 16 * (j0 + 3), ld);
}

/* rows_softmax() of rows [0, rn) over their unscaled scores S (in place), writing P over the 32 ng
 * keys the tiles read (bf16, zero where a row sees no key, rows [rn, tr) all zero) and each row's
 * rescale factor a; lims[r]: keys of the super-block row r sees */
static inline void tile_softmax(float scale, const int64_t* pos, int rn, int tr, int nk, int ng, float S[16][SB],
                                uint16_t Pb[16][SB], float* a, int* lims, RowState* st) {
    for (int r = rn; r < tr; r++) memset(Pb[r], 0, sizeof(uint16_t) * 32 * ng);
    for (int r = 0; r < rn; r++) {
        lims[r] = row_lim(pos[r], nk);
        const int rb = (lims[r] + 15) / 16;
        memset(Pb[r] + 16 * rb, 0, sizeof(uint16_t) * 16 * (2 * ng - rb));
    }
    rows_softmax(rn, (__m512 (*)[NB])S, lims, scale, (uint32_t (*)[NB][8])Pb, a, st);
}

/* Rows [0, rn) of one super-block on tiles of tr rows, rn <= tr <= 16 (qp rows 64 dwords, pairs
 * past D/2 zero; with padded, rows [rn, tr) of qp are readable zeros too). */
static void tile_rows(int D, float scale, const uint32_t (*qp)[64], int padded, const int64_t* pos, int rn, int tr,
                      int nk, const __m512i* Kt, const __m512i* Vp, RowState* st) {
    const int DB = (D + 31) / 32, nv = 2 * DB, nb = (nk + 15) / 16, ng = (nb + 1) / 2;
    float S[16][SB] __attribute__((aligned(64)));
    uint16_t Pb[16][SB] __attribute__((aligned(64)));
    float O[16 * 16 * 2 * MAXDB] __attribute__((aligned(64)));   /* row r at O + 16 nv r */
    uint32_t qloc[16][64] __attribute__((aligned(64)));
    __m512i vtail[16 * 2 * MAXDB];
    const uint32_t (*qa)[64] = qp;
    if (rn < tr && !padded) {                     /* a last partial tile: zero rows past rn */
        memset(qloc, 0, sizeof qloc);
        for (int r = 0; r < rn; r++) memcpy(qloc[r], qp[r], sizeof(uint32_t) * 16 * DB);
        qa = (const uint32_t (*)[64])qloc;
    }
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
    for (int r = 0; r < tr; r++) {                /* o a; zeros for rows that take no part */
        if (r < rn && lims[r] > 0)
            for (int j = 0; j < nv; j++) _mm512_storeu_ps(O + 16 * (nv * r + j), _mm512_mul_ps(st[r].o[j], v_set1(a[r])));
        else
            memset(O + 16 * nv * r, 0, sizeof(float) * 16 * nv);
    }
    for (int j0 = 0; j0 < nv; j0 += 4) tile_pv(nv, ng, j0, nv - j0 < 4 ? nv - j0 : 4, Pb, vb, O);
    for (int r = 0; r < rn; r++)
        if (lims[r] > 0)
            for (int j = 0; j < nv; j++) st[r].o[j] = _mm512_loadu_ps(O + 16 * (nv * r + j));
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
    super_block(cx->D, cx->scale, qp, pos, R, nk, Kt, Vp, st);
}

/* q pairs of one row (bf16, low half the even dim), zero past D/2 up to whole 32-dim blocks */
static inline void q_pairs(const float* src, int D, int DB, uint32_t* qp) {
    int p = 0;
    for (; p < D / 2; p++) qp[p] = (uint32_t)f32_to_bf16(src[2 * p]) | (uint32_t)f32_to_bf16(src[2 * p + 1]) << 16;
    for (; p < 16 * DB; p++) qp[p] = 0;
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
