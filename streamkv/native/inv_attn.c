/* Batch-invariant attention over the paged KV cache: one kernel for every row of a step.
 *
 * q     [T, H, D] float32         the step's query rows (D a multiple of 16, at most 256)
 * k, v  [S, Hk, D] bf16 or f32    one layer's paged cache (slot-major)
 * seqs  [B, 4] int64              (row0, nq, off, L): sequence b's rows [row0, row0 + nq) sit at
 *                                 context indices [L - nq, L) of its slots[off .. off + L) and
 *                                 attend causally (a decode row is nq = 1)
 * out   [T, H, D] float32
 *
 * Invariance: the result of a row depends only on its query, its context and its position,
 * never on the other rows of the call (decodes, prefill chunks, their split points). Every row
 * runs the same arithmetic:
 *
 *   context index   0 ........ 511 | 512 ....... 1023 | 1024 .. i       (CHUNK = 512, absolute)
 *
 *   score     s_j = v_hsum(a),  a = q[0:16] k_j[0:16], then a = fma(q[16b:16b+16], k_j[..], a)
 *             for b = 1 .. D/16 - 1 (q pre-scaled), one key at a time
 *   chunk c:  m = max_j s_j;  p_j = exp(s_j - m);  l = v_hsum(sum over 16-key groups of p,
 *             lane-wise in order);  o = sum_j p_j v_j, j in order (one fma chain per element)
 *   merge:    chunks 0, 1, 2, ... in order (flash-decoding's log-sum-exp merge), out = O / L
 *
 * Work items are (sequence, tile of QT rows, kv head, chunk), or every kv head for a few-row tile
 * over a float32 cache (ALL_HEADS below); each writes per-(row, head, chunk) partials (m, l, o[D]),
 * merged in a second pass. Parallel with OpenMP. Inside an item, VB keys
 * of a bf16 K (then V) are gathered and widened once into an L1 buffer that serves every query
 * vector of the tile, each cache row prefetched PFD keys ahead; a float32 cache is read in place
 * (block_rows); none of this changes any element's order of operations.
 */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#include "vec16.h"

#define CHUNK 512
#define QT 16
#define VB 64
#define MAXD 256
#define ALL_HEADS_MAX 12  /* at most this many query vectors (rows x H) run every kv head in one item */
#define GROUP_SLACK 110  /* percent: see streamkv_inv_attn */
#define PFD 16   /* the K / V gathers prefetch the cache row this many keys ahead */

/* rows [i0, i1) of sequence b, kv heads [hk, h1), chunk c */
typedef struct { int b, i0, i1, hk, h1, c; int64_t w; } Item;   /* w: item_work() */

/* the keys of the item's chunk that the tile's last row (its largest context limit) sees */
static inline int item_keys(const Item* it, const int64_t* seqs) {
    const int64_t last = seqs[4 * it->b + 3] - seqs[4 * it->b + 1] + it->i1, c0 = (int64_t)it->c * CHUNK;
    return (int)((last < c0 + CHUNK ? last : c0 + CHUNK) - c0);
}

/* one kv head's D bf16 values of a cache row, towards L1 (a decode's gathers waited on memory: 0.40
 * -> 0.33 ms per layer for a decode row over 6,500 keys on an AVX2 EPYC, the cache in L3) */
static inline void prefetch_row(const uint16_t* base, int64_t at, int D) {
    for (int o = 0; o < 2 * D; o += 64) __builtin_prefetch((const char*)(base + at) + o, 0, 3);
}

/* rows[j] <- the D floats of the cache row of key sl[j], j < nb (ahead: keys from sl[0] on that
 * exist, for the prefetch). A float32 cache is read in place: the rows stream from
 * memory under the hardware prefetchers and stay in L1 for the item's other vectors (a decode row
 * over 6,500 keys x 30 layers: 23.7 -> 21.9 ms on an AVX2 EPYC; copying, with or without software
 * prefetch, held it to ~12 GB/s; and for whole 16-row tiles too: 30 layers of a 1,024-row chunk over
 * 2,048 keys 13-17% less, of 5-12 verify rows over 1,400 keys 10-20% less). A bf16 cache's rows are
 * gathered and widened once into vb, contiguous in L1 for the tile's query vectors. */
static inline __attribute__((always_inline)) void block_rows(const void* cache, int bf16, const int64_t* sl, int nb,
                                                             int ahead, int Hk, int hk, const int nd, float* vb,
                                                             const float** rows) {
    const int D = 16 * nd;
    if (!bf16) {
        for (int j = 0; j < nb; j++) rows[j] = (const float*)cache + (sl[j] * Hk + hk) * D;
        return;
    }
    const uint16_t* c = cache;
    for (int j = 0; j < nb; j++) {
        if (j + PFD < ahead) prefetch_row(c, (sl[j + PFD] * Hk + hk) * D, D);
        const uint16_t* row = c + (sl[j] * Hk + hk) * D;
        for (int d = 0; d < nd; d++) v_store(vb + (size_t)j * D + 16 * d, v_load_bf16(row + 16 * d));
        rows[j] = vb + (size_t)j * D;
    }
}

/* the query head of an item's vector x: vectors run per kv head (nvh each), row-major, then by
 * the G query heads of the kv head */
static inline int vec_head(const Item* it, int x, int nvh, int G) { return (it->hk + x / nvh) * G + x % G; }

/* keys of the block [j0, j0 + nb) that a query vector seeing the chunk's first n keys attends to */
static inline int block_keys(int n, int j0, int nb) { return n - j0 < 0 ? 0 : n - j0 < nb ? n - j0 : nb; }

/* the 16 partial sums of q . k (lane l sums d = l, l + 16, ...); the score is their v_hsum */
static inline __attribute__((always_inline)) v16 dot_v(const float* q, const float* k, const int nd) {
    v16 a = v_mul(v_load(q), v_load(k));
    for (int d = 1; d < nd; d++) a = v_fma(v_load(q + 16 * d), v_load(k + 16 * d), a);
    return a;
}

/* o0 += sum_{j < e0} p0_j v_j and o1 += sum_{j < e1} p1_j v_j for two query vectors, 32 dims at a
 * time, each element one fma chain in key order (as for one vector): the vectors share every V
 * load (one vector's 8 fmas per key needed 9 loads on AVX2, over its two 256-bit loads a cycle). */
static inline __attribute__((always_inline)) void pv_pair(const float* p0, const float* p1, int e0, int e1,
                                                          const float* const* vr, const int nd, float* o0, float* o1) {
    const int both = e0 < e1 ? e0 : e1;
    for (int d0 = 0; d0 < nd; d0 += 2) {
        const int w = nd - d0 < 2 ? nd - d0 : 2;
        v16 a0[2], a1[2];
        for (int d = 0; d < w; d++) { a0[d] = v_load(o0 + 16 * (d0 + d)); a1[d] = v_load(o1 + 16 * (d0 + d)); }
        int j = 0;
        for (; j < both; j++) {
            const v16 b0 = v_set1(p0[j]), b1 = v_set1(p1[j]);
            for (int d = 0; d < w; d++) {
                const v16 v = v_load(vr[j] + 16 * (d0 + d));
                a0[d] = v_fma(b0, v, a0[d]);
                a1[d] = v_fma(b1, v, a1[d]);
            }
        }
        for (int k = j; k < e0; k++)                      /* a causal tile's later row sees more keys */
            for (int d = 0; d < w; d++) a0[d] = v_fma(v_set1(p0[k]), v_load(vr[k] + 16 * (d0 + d)), a0[d]);
        for (int k = j; k < e1; k++)
            for (int d = 0; d < w; d++) a1[d] = v_fma(v_set1(p1[k]), v_load(vr[k] + 16 * (d0 + d)), a1[d]);
        for (int d = 0; d < w; d++) { v_store(o0 + 16 * (d0 + d), a0[d]); v_store(o1 + 16 * (d0 + d), a1[d]); }
    }
}

/* One item: rows [i0, i1) of sequence b (context indices L - nq + i), kv heads [hk, h1), chunk c;
 * nd = D / 16 is a compile-time constant in each specialisation (see item() below). Returns 0, or 1
 * when its scratch cannot be allocated (nothing written). */
static inline __attribute__((always_inline)) int item_nd(const Item* it, const float* q, const void* kc,
                                                          const void* vc, int bf16, const int64_t* seqs,
                                                          const int64_t* slots, const int64_t* part_off, int H,
                                                          int Hk, const int nd, float scale, float* part) {
    const int64_t row0 = seqs[4 * it->b], nq = seqs[4 * it->b + 1], off = seqs[4 * it->b + 2], L = seqs[4 * it->b + 3];
    const int D = 16 * nd, G = H / Hk, nc = (int)((L + CHUNK - 1) / CHUNK), W = D + 2;
    const int64_t c0 = (int64_t)it->c * CHUNK;
    const int n_all = item_keys(it, seqs);
    const int nh = it->h1 - it->hk, nvh = (it->i1 - it->i0) * G, nv = nvh * nh;   /* vectors: per head, nvh */
    /* pairs: two vectors share each V load, for tiles of 2 or more rows (a lone row's G vectors
     * ran 2% slower as pairs) and every tile over a gathered bf16 block */
    const int pairs = bf16 || nvh > G;
    float* qs = malloc(sizeof(float) * ((size_t)nv * D + (size_t)nv * (CHUNK + 16) + (bf16 ? (size_t)VB * D : 0)));
    if (!qs) return 1;
    float* sb = qs + (size_t)nv * D;                      /* scores, then weights, per query vector */
    float* vb = sb + (size_t)nv * (CHUNK + 16);           /* VB rows of a bf16 K or V, widened */
    int nvalid[QT * 32];
    for (int x = 0; x < nv; x++) {
        const int i = it->i0 + x % nvh / G;
        const float* src = q + ((row0 + i) * H + vec_head(it, x, nvh, G)) * D;
        for (int d = 0; d < D; d += 16) v_store(qs + x * D + d, v_mul(v_load(src + d), v_set1(scale)));
        const int64_t lim = L - nq + i + 1 - c0;          /* keys of this chunk the row sees */
        nvalid[x] = lim <= 0 ? 0 : lim < n_all ? (int)lim : n_all;
    }
    /* scores: VB keys of K at a time (block_rows) serve every query vector from L1; four keys
     * share one reduction network (v_hsum4 == v_hsum per key) */
    for (int j0 = 0; j0 < n_all; j0 += VB) for (int hl = 0; hl < nh; hl++) {
        const int nb = n_all - j0 < VB ? n_all - j0 : VB;
        const float* kr[VB];                              /* each key's D floats */
        block_rows(kc, bf16, slots + off + c0 + j0, nb, n_all - j0, Hk, it->hk + hl, nd, vb, kr);
        for (int x = hl * nvh; x < (hl + 1) * nvh; x++) {
            const int end = block_keys(nvalid[x], j0, nb);
            float* s = sb + (size_t)x * (CHUNK + 16) + j0;
            const float* qx = qs + x * D;
            v16 qv[MAXD / 16];                            /* the query stays in registers over its keys */
            for (int d = 0; d < nd; d++) qv[d] = v_load(qx + 16 * d);
            int j = 0;
            for (; j + 4 <= end; j += 4) {
                const float *k0 = kr[j], *k1 = kr[j + 1], *k2 = kr[j + 2], *k3 = kr[j + 3];
                v16 a0 = v_mul(qv[0], v_load(k0)), a1 = v_mul(qv[0], v_load(k1));
                v16 a2 = v_mul(qv[0], v_load(k2)), a3 = v_mul(qv[0], v_load(k3));
                for (int d = 1; d < nd; d++) {            /* dot_v's chain per key, four keys abreast */
                    a0 = v_fma(qv[d], v_load(k0 + 16 * d), a0);
                    a1 = v_fma(qv[d], v_load(k1 + 16 * d), a1);
                    a2 = v_fma(qv[d], v_load(k2 + 16 * d), a2);
                    a3 = v_fma(qv[d], v_load(k3 + 16 * d), a3);
                }
                v_hsum4(a0, a1, a2, a3, s + j);
            }
            for (; j < end; j++) s[j] = v_hsum(dot_v(qx, kr[j], nd));
        }
    }
    float* dst[QT * 32];
    for (int x = 0; x < nv; x++) {                        /* softmax weights, m and l */
        const int i = it->i0 + x % nvh / G, n = nvalid[x];
        dst[x] = part + (part_off[it->b] + ((int64_t)i * H + vec_head(it, x, nvh, G)) * nc + it->c) * W;
        for (int d = 0; d < nd; d++) v_store(dst[x] + 2 + 16 * d, v_zero());
        if (n == 0) { dst[x][0] = -INFINITY; dst[x][1] = 0.f; continue; }
        float* s = sb + (size_t)x * (CHUNK + 16);
        for (int j = n; j < ((n + 15) & ~15); j++) s[j] = -INFINITY;
        v16 mx = v_load(s);                               /* the max is exact in any order: 16 lanes */
        for (int j = 16; j < n; j += 16) mx = v_max(mx, v_load(s + j));   /* (a scalar loop cost ~6%) */
        const float m = v_hmax(mx);
        v16 lv = v_zero(), mv = v_set1(m);
        for (int j = 0; j < n; j += 16) {
            v16 p = v_exp(v_sub(v_load(s + j), mv));
            v_store(s + j, p);
            for (int t = n - j; t < 16; t++) s[j + t] = 0.f;   /* past the row's context */
            lv = v_add(lv, v_load(s + j));
        }
        dst[x][0] = m;
        dst[x][1] = v_hsum(lv);
    }
    /* o = sum_j p_j v_j, one fma chain per element in key order; VB keys of V at a time
     * (block_rows) serve every query vector from L1. */
    for (int j0 = 0; j0 < n_all; j0 += VB) for (int hl = 0; hl < nh; hl++) {
        const int nb = n_all - j0 < VB ? n_all - j0 : VB, xe = (hl + 1) * nvh;
        const float* vr[VB];
        block_rows(vc, bf16, slots + off + c0 + j0, nb, n_all - j0, Hk, it->hk + hl, nd, vb, vr);
        int x = hl * nvh;
        for (; pairs && x + 2 <= xe; x += 2) {            /* two vectors share each V load (from L1) */
            const float* s0 = sb + (size_t)x * (CHUNK + 16) + j0;
            pv_pair(s0, s0 + CHUNK + 16, block_keys(nvalid[x], j0, nb), block_keys(nvalid[x + 1], j0, nb), vr, nd,
                    dst[x] + 2, dst[x + 1] + 2);
        }
        for (; x < xe; x++) {
            const int end = block_keys(nvalid[x], j0, nb);
            if (end == 0) continue;
            const float* s = sb + (size_t)x * (CHUNK + 16) + j0;
            v16 o[MAXD / 16];
            for (int d = 0; d < nd; d++) o[d] = v_load(dst[x] + 2 + 16 * d);
            for (int j = 0; j < end; j++) {
                v16 pj = v_set1(s[j]);
                for (int d = 0; d < nd; d++) o[d] = v_fma(pj, v_load(vr[j] + 16 * d), o[d]);
            }
            for (int d = 0; d < nd; d++) v_store(dst[x] + 2 + 16 * d, o[d]);
        }
    }
    free(qs);
    return 0;
}

static int item(const Item* it, const float* q, const void* kc, const void* vc, int bf16, const int64_t* seqs,
                 const int64_t* slots, const int64_t* part_off, int H, int Hk, int D, float scale, float* part) {
    switch (D / 16) {
#define ND(N) case N: return item_nd(it, q, kc, vc, bf16, seqs, slots, part_off, H, Hk, N, scale, part);
        ND(1) ND(2) ND(4) ND(8)
#undef ND
        default: return item_nd(it, q, kc, vc, bf16, seqs, slots, part_off, H, Hk, D / 16, scale, part);
    }
}

/* an item's query-key pairs: rows x heads x item_keys() */
static int64_t item_work(const Item* it, const int64_t* seqs) {
    return (int64_t)(it->i1 - it->i0) * (it->h1 - it->hk) * item_keys(it, seqs);
}

/* more work first; equal work in the order the items were made (sequence, tile, head, chunk) */
static int by_work(const void* a, const void* b) {
    const Item *x = a, *y = b;
    if (x->w != y->w) return x->w > y->w ? -1 : 1;
    const int64_t kx[4] = {x->b, x->i0, x->hk, x->c}, ky[4] = {y->b, y->i0, y->hk, y->c};
    for (int i = 0; i < 4; i++)
        if (kx[i] != ky[i]) return kx[i] < ky[i] ? -1 : 1;
    return 0;
}

/* A tile of few query vectors over every kv head, on a float32 cache (decode and short verify
 * rows: (i1 - i0) H <= ALL_HEADS_MAX), may run all kv heads in one item per chunk, block
 * by block: the heads' parts of each cache row are then read together, one sequential stream,
 * where a per-head item reads 1 of every Hk parts of each row. Only the work split changes: each
 * vector runs the same operations. Used when the step still has at least 2 items per thread, or
 * fewer that balance about as well as the per-head ones (see streamkv_inv_attn). */
#define ALL_HEADS(i0, i1) (!bf16 && ((i1) - (i0)) * H <= ALL_HEADS_MAX)

/* The step's work items, per kv head or (all != 0) with every few-row tile's kv heads in one item
 * (ALL_HEADS), weighed by item_work() and sorted largest first; returns how many. */
static int64_t make_items(Item* items, const int64_t* seqs, int B, int H, int Hk, int bf16, int all) {
    int64_t n = 0;
    for (int b = 0; b < B; b++) {
        const int64_t nq = seqs[4 * b + 1], L = seqs[4 * b + 3];
        for (int64_t i0 = 0; i0 < nq; i0 += QT) {
            const int64_t i1 = i0 + QT < nq ? i0 + QT : nq;
            const int ncs = (int)((L - nq + i1 + CHUNK - 1) / CHUNK), joint = all && ALL_HEADS(i0, i1);
            for (int hk = 0; hk < Hk; hk += joint ? Hk : 1)
                for (int c = 0; c < ncs; c++) items[n++] = (Item){b, (int)i0, (int)i1, hk, joint ? Hk : hk + 1, c, 0};
        }
    }
    /* largest items first, so the dynamic schedule ends on its smallest ones (a lone decode over 640
     * keys had left one thread a whole 512-key chunk after the other's last short one: 30 layers
     * 5-14% less in alternating runs on a 2-thread AVX2 EPYC); the order of items changes no bit */
    for (int64_t t = 0; t < n; t++) items[t].w = item_work(&items[t], seqs);
    qsort(items, (size_t)n, sizeof(Item), by_work);
    return n;
}

/* The longest thread's work when the sorted items go, one by one, to the least loaded of T
 * threads (what the dynamic schedule does with equal speeds). */
static int64_t makespan(const Item* items, int64_t n, int T) {
    int64_t load[64] = {0}, most = 0;
    T = T < 1 ? 1 : T > 64 ? 64 : T;
    for (int64_t t = 0; t < n; t++) {
        int at = 0;
        for (int i = 1; i < T; i++) at = load[i] < load[at] ? i : at;
        load[at] += items[t].w;
        most = load[at] > most ? load[at] : most;
    }
    return most;
}

/* Returns 0; 1, 2 shapes rejected; 3 no memory (out not written). */
int streamkv_inv_attn(const float* q, const void* kc, const void* vc, int bf16, const int64_t* seqs, int B,
                      const int64_t* slots, int H, int Hk, int D, float scale, float* out) {
    if (D % 16 != 0 || D > MAXD || Hk <= 0 || H % Hk != 0 || H / Hk > 32 || B <= 0) return 1;
    const int W = D + 2, T = omp_get_max_threads();
    int64_t* part_off = malloc(sizeof(int64_t) * (B + 1));
    if (!part_off) return 3;
    int64_t nitems = 0, grouped = 0;                  /* items per head, and with all-heads items */
    part_off[0] = 0;
    for (int b = 0; b < B; b++) {
        const int64_t nq = seqs[4 * b + 1], L = seqs[4 * b + 3];
        if (nq <= 0 || nq > L) { free(part_off); return 2; }
        const int64_t nc = (L + CHUNK - 1) / CHUNK;
        part_off[b + 1] = part_off[b] + nq * H * nc;
        for (int64_t i0 = 0; i0 < nq; i0 += QT) {
            const int64_t i1 = i0 + QT < nq ? i0 + QT : nq, ncs = (L - nq + i1 + CHUNK - 1) / CHUNK;
            nitems += Hk * ncs;
            grouped += ALL_HEADS(i0, i1) ? ncs : Hk * ncs;
        }
    }
    Item* items = malloc(sizeof(Item) * nitems);
    float* part = malloc(sizeof(float) * (size_t)part_off[B] * (size_t)W);
    if (!items || !part) {
        free(part);
        free(items);
        free(part_off);
        return 3;
    }
    /* all-heads items read each cache row once, in one stream, so they go faster per key: with
     * at least 2 of them per thread they are taken; with fewer, where they still balance within
     * GROUP_SLACK of the per-head split (a decode over 1,040 keys: 512 + 512 + 16 keys, 4-8% less
     * time than 9 per-head items in alternating runs on a 2-thread AVX2 EPYC) */
    const int can = Hk > 1 && grouped < nitems, joint = can && grouped >= 2 * T;
    int64_t n = make_items(items, seqs, B, H, Hk, bf16, joint);
    Item* other = !joint && can && grouped >= T ? malloc(sizeof(Item) * grouped) : NULL;
    if (other) {
        const int64_t ng = make_items(other, seqs, B, H, Hk, bf16, 1);
        if (makespan(other, ng, T) * 100 <= makespan(items, n, T) * GROUP_SLACK) {
            Item* t = items;
            items = other;
            other = t;
            n = ng;
        }
        free(other);
    }
    nitems = n;
    int nomem = 0;
    #pragma omp parallel for schedule(dynamic, 1)
    for (int64_t t = 0; t < nitems; t++)
        if (item(&items[t], q, kc, vc, bf16, seqs, slots, part_off, H, Hk, D, scale, part)) {
            #pragma omp atomic write
            nomem = 1;
        }
    /* merge every (row, head) over its chunks, in chunk order (not after an item found no
     * memory: out stays untouched and the caller gets rc 3, never a crash) */
    #pragma omp parallel for schedule(static)
    for (int b = 0; b < (nomem ? 0 : B); b++) {
        const int64_t row0 = seqs[4 * b], nq = seqs[4 * b + 1], L = seqs[4 * b + 3];
        const int64_t nc = (L + CHUNK - 1) / CHUNK;
        for (int64_t i = 0; i < nq; i++) {
            const int64_t used = (L - nq + i + CHUNK) / CHUNK;  /* chunks holding [0, L - nq + i] */
            for (int h = 0; h < H; h++) {
                const float* pr = part + (part_off[b] + (i * H + h) * nc) * W;
                float m = -INFINITY, l = 0.f;
                v16 o[MAXD / 16];
                for (int d = 0; d < D / 16; d++) o[d] = v_zero();
                for (int64_t c = 0; c < used; c++) {
                    const float* s = pr + c * W;
                    float mn = s[0] > m ? s[0] : m;
                    float a = m == -INFINITY ? 0.f : s_exp(m - mn), e = s_exp(s[0] - mn);
                    l = l * a + s[1] * e;
                    for (int d = 0; d < D / 16; d++) o[d] = v_fma(v_load(s + 2 + 16 * d), v_set1(e), v_mul(o[d], v_set1(a)));
                    m = mn;
                }
                float* dst = out + ((row0 + i) * H + h) * D;
                for (int d = 0; d < D / 16; d++) {
                    float t[16];
                    v_store(t, o[d]);
                    for (int x = 0; x < 16; x++) dst[16 * d + x] = t[x] / l;
                }
            }
        }
    }
    free(part);
    free(items);
    free(part_off);
    return nomem ? 3 : 0;
}

const char* streamkv_inv_isa(void) { return STREAMKV_VEC_ISA; }
