/* Batch-invariant attention over a bf16 paged KV cache with bf16 dot products (AVX512-BF16).
 *
 * Same contract as inv_attn.c (q [T, H, D] float32, seqs (row0, nq, off, L), out [T, H, D]
 * float32), for a bf16 cache and D a multiple of 16 up to 128. Every row, decode or prompt, goes
 * through the same arithmetic, which depends only on the row's query, its context and its
 * context index i:
 *
 *   context index  0 ... 63 | 64 ... 127 | ... 511 | 512 ...            (absolute positions)
 *                  [ super-block ][ super-block ]    chunk 0 | chunk 1 ...
 *
 *   q           rounded to bf16 pairs (q[2p], q[2p + 1])
 *   score s_j   one chain of vdpbf16ps over the pairs p = 0 .. D/2 - 1, times scale (float32)
 *   chunk c     (keys [512c, 512c + 512) that the row sees) an online softmax over its 64-key
 *               super-blocks in order: m' = max(m, block max), a = exp(m - m'),
 *               p_j = exp(s_j - m') rounded to bf16, l = l a + hsum(p), o = o a + P V where
 *               P V is one vdpbf16ps chain per element over the key pairs in order
 *   merge       chunks 0, 1, 2, ... left to right (log-sum-exp, merge() below), out = O / L
 *
 * Keys are transposed 16 at a time so that one vector holds one dim pair of 16 keys:
 *
 *   K block [16 keys][D/2 pairs]  --transpose-->  Kt[pair][16 keys]       (dword = 2 bf16)
 *   V block: key pairs interleaved               Vp[keypair][D/16][16]    (dword = 2 bf16)
 *
 * Accumulator lanes follow _mm512_unpack{lo,hi}_epi16's interleave (lane_dim() maps them back).
 *
 * A prompt whose rows span several tiles has its key blocks transposed once per call, before the
 * items run (pretranspose()); other items transpose the blocks they read as they go. Rows run four
 * at a time (super_block()): their scores together, each row's softmax, their P V together.
 *
 * Work items are (sequence, tile of query rows, kv head, range of chunks). An item that starts
 * at chunk 0 merges its chunks in place and writes the output; otherwise (few-row sequences:
 * decode rows, a decode row with its drafts; split for parallelism) it writes one partial per row
 * and chunk and a second pass merges them in order. Both call the same merge() on the same
 * per-chunk partials, so the split never changes a bit.
 * A split item covers one chunk, all its rows and every kv head (run_heads()): per super-block it first
 * copies the block's cache rows, all heads, in address order into a staging buffer, then runs each
 * head from there (or, with mode & 4, the measured `attention_gather=direct`, transposes each head's
 * blocks straight from the pool: on the Intel Xeon without AMX a decode over 2,048 keys 0.087 ->
 * 0.063 ms per layer, 2 threads, L3-resident; on the EPYC staging measured faster inside a step).
 * Staged, the rows are read as one sequential stream (a per-head gather reads 128
 * of every 384 bytes and streamed at ~12 GB/s on the EPYC, vs ~28 GB/s for the copy), and each
 * head's rows still run exactly a per-head item's operations (a super-block whose slots are one run
 * in the pool already has that layout: it is read in place, no copy). A step of only a few chunk items
 * (fewer than 2 per thread) gives each kv head its own item instead, copying that head's part.
 * A row skips super-blocks where it sees no key and, in a partly visible block, key pairs it does
 * not see at all, so a prompt row runs exactly the operations its own decode would.
 *
 * With tiles (the "amx" attention path, AMX CPUs only) every super-block of every item, decode or
 * prompt, runs on AMX tiles instead (attn_amx_rows.h): the same layouts and chains per element, the
 * dot products as TDPBF16PS, and a softmax of its own (the scale folded into a base-2 exponent: ~40%
 * fewer vector operations per score). Whether TDPBF16PS gives vdpbf16ps's bits is the hardware's
 * business anyway, so the two paths are separate choices: one of them serves every row.
 */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vec16.h"
#include "transpose16.h"
#include "amx.h"

#if defined(__AVX512BF16__) && defined(__AVX512F__)

#define CHUNK 512
#define SB 64            /* keys per super-block: one softmax update */
#define NB (SB / 16)
#define MAXDB 4          /* 32-dim blocks: D <= 128 */
#define ROWS 48          /* query rows (query, head of the kv group) per item */
#define PRE_AHEAD 2      /* pretranspose() prefetches the cache rows this many 16-key blocks ahead */
#define FMA_WIDEN_ROWS 8  /* the fma chain widens a super-block's blocks once for this many rows or more */
#define SPLIT_MIN 1      /* a lone few-row sequence with more chunks than this is split one item per chunk */
/* Few-row sequences (nq H / Hk <= ROWS: decode rows, a decode row with its speculative drafts; up
 * to 16 rows with SmolLM2's 9 / 3 heads) run as one item per chunk (run_heads; one per chunk and
 * kv head when nq H > ROWS) when there are several of them or more than one chunk; a lone
 * one-chunk one keeps one item per kv head (run_item). A lone 7-row verify step over ~1.5k keys
 * was 3 items (one per kv head) for 2 threads before nq H > ROWS could split: 7.1-7.3 -> 5.7-6.0
 * ms of attention per step (Intel Xeon without AMX, 30 layers). Measured on the EPYC, 2 threads, a lone
 * decode (us per layer): 1,024 keys 100 -> 50 as 2 chunk items instead of 3 head items; 576 keys
 * 38 -> 27 and 1,536 keys 87 -> 74 with a chunk item per kv head. Only the work split differs:
 * the bits are the same either way. */
#define FEW(nq) ((nq) * (H / Hk) <= ROWS)    /* a kv head's rows fit one item */
#define WHOLE(nq) ((nq) * H <= ROWS)        /* every kv head's rows fit one item */
#define SPLIT(nq, nc) (FEW(nq) && (nfew > 1 || (nc) > SPLIT_MIN))

/* a split sequence's items per chunk: one over every kv head, or one per kv head when the step
 * splits them apart or the sequence has more rows than one item holds for every kv head */
static inline int split_items(int apart, int whole, int Hk) { return apart || !whole ? Hk : 1; }

/* A tile of one sequence's query rows [q0, q1) over chunks [c0, c1): one kv head (run_item(),
 * merged in place), or hk = -1: kv heads [h0, h1), one chunk, partials at part (run_heads()) */
typedef struct { int b, q0, q1, hk, c0, c1, h0, h1; int64_t part; } Item;

typedef struct {
    const uint16_t* kc;
    const uint16_t* vc;
    const int64_t* seqs;
    const int64_t* slots;
    const float* q;
    float* out;
    float* part;
    int H, Hk, D, DB;
    float scale;
    __m512i* pre;             /* prompts' blocks transposed once per call (pre_at[b] >= 0), or NULL */
    const int64_t* pre_at;    /* per sequence: offset of its blocks in pre, in vectors, or -1 */
    int tiles;                /* every super-block on AMX tiles (attn_amx_rows.h) */
    int fma;                  /* every super-block on the fma chain (attn_bf16_rows.h) */
    int direct;               /* split items read the cache rows in place, no staging copy (run_heads) */
} Ctx;

/* 32 bf16 of one key row at dims [32h, 32h + 32), zeros past D */
static inline __m512i load32(const uint16_t* row, int h, int D) {
    const int left = D - 32 * h;
    if (left >= 32) return _mm512_loadu_si512((const void*)(row + 32 * h));
    return _mm512_maskz_loadu_epi16((__mmask32)((1u << left) - 1), row + 32 * h);
}

/* A 16-key block (n valid keys, the rest zero) of kv head hk: Kt[16 DB] pair-major, Vp[8][2 DB]
 * (Vp[kp][j] at Vp + 2 DB kp + j). Blocks lie 16 DB vectors apart (KS) in both arrays. */
static inline void load_block(const Ctx* cx, const int64_t* slots, int n, int hk, __m512i* Kt, __m512i* Vp) {
    const int DB = cx->DB, D = cx->D, Hk = cx->Hk;
    for (int h = 0; h < DB; h++) {
        __m512i r[16];
        for (int i = 0; i < 16; i++)
            r[i] = i < n ? load32(cx->kc + (slots[i] * Hk + hk) * D, h, D) : _mm512_setzero_si512();
        transpose16(r);
        for (int p = 0; p < 16; p++) Kt[16 * h + p] = r[p];
    }
    for (int kp = 0; kp < 8; kp++)
        for (int h = 0; h < DB; h++) {
            __m512i a = 2 * kp < n ? load32(cx->vc + (slots[2 * kp] * Hk + hk) * D, h, D) : _mm512_setzero_si512();
            __m512i b = 2 * kp + 1 < n ? load32(cx->vc + (slots[2 * kp + 1] * Hk + hk) * D, h, D)
                                       : _mm512_setzero_si512();
            Vp[kp * 2 * DB + 2 * h] = _mm512_unpacklo_epi16(a, b);
            Vp[kp * 2 * DB + 2 * h + 1] = _mm512_unpackhi_epi16(a, b);
        }
}

/* Prefetches (into L2) elements [at, at + w) of the K and V cache rows (row = Hk D) of slots
 * sl[i0, i1): one head's part (run_item(): the next super-block) or the staged heads' part.
 * run_heads() spreads the next super-block's rows over this block's 16-key blocks and heads, so
 * they arrive while those compute: otherwise the copy and the compute add up (on the EPYC, for a
 * 6,000-key decode row, ~190 + ~130 us per layer). One burst per block measured slower: the
 * prefetches queue. */
static inline void prefetch_rows(const Ctx* cx, const int64_t* sl, int64_t i0, int64_t i1, int row, int at, int w) {
    for (int64_t i = i0; i < i1; i++) {
        const char *k = (const char*)(cx->kc + sl[i] * row + at), *v = (const char*)(cx->vc + sl[i] * row + at);
        for (int o = 0; o < 2 * w; o += 64) { _mm_prefetch(k + o, _MM_HINT_T1); _mm_prefetch(v + o, _MM_HINT_T1); }
    }
}

/* accumulator lane -> head dim (the unpack{lo,hi}_epi16 interleave) */
static inline int lane_dim(int j, int lane) { return 32 * (j >> 1) + 8 * (lane >> 2) + 4 * (j & 1) + (lane & 3); }

/* the log-sum-exp merge of a chunk partial (m, l, o) into the running (M, L, O) */
static inline void merge(float* M, float* L, v16* O, float m, float l, const v16* o, int nv) {
    const float mn = m > *M ? m : *M;
    const float a = *M == -INFINITY ? 0.f : s_exp(*M - mn), e = s_exp(m - mn);
    *L = *L * a + l * e;
    for (int i = 0; i < nv; i++) O[i] = v_fma(o[i], v_set1(e), v_mul(O[i], v_set1(a)));
    *M = mn;
}

#include "attn_bf16_rows.h"
#include "attn_amx_rows.h"

/* out = o / l in head-dim order: accumulators 2h and 2h + 1 hold dims [32h, 32h + 32) as lane_dim()
 * spreads them (128-bit quarters alternating: 2h's quarter i is dims 32h + 8i + [0, 4), 2h + 1's
 * the next 4), so two permutes give dims in order; the division per lane as a scalar one would */
static void store_out(const Ctx* cx, float* dst, const RowState* s) {
    const __m512i lo = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i hi = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    const __m512 l = v_set1(s->l);
    for (int h = 0; h < cx->DB; h++) {
        const __m512 a = s->o[2 * h], b = s->o[2 * h + 1];
        v_store(dst + 32 * h, _mm512_div_ps(_mm512_permutex2var_ps(a, lo, b), l));
        if (32 * h + 16 < cx->D) v_store(dst + 32 * h + 16, _mm512_div_ps(_mm512_permutex2var_ps(a, hi, b), l));
    }
}

static void run_item(const Item* it, const Ctx* cx) {
    const int64_t* sq = cx->seqs + 4 * it->b;
    const int64_t row0 = sq[0], nq = sq[1], off = sq[2], L = sq[3], start = L - nq;
    const int H = cx->H, Hk = cx->Hk, D = cx->D, G = H / Hk, nv = 2 * cx->DB;
    const int R = (it->q1 - it->q0) * G;
    uint32_t qp[ROWS][64];
    int64_t ctx[ROWS], rel[ROWS];
    RowState st[ROWS], run[ROWS];
    for (int r = 0; r < R; r++) {
        const int j = it->q0 + r / G, h = it->hk * G + r % G;
        q_pairs(cx->q + ((row0 + j) * H + h) * D, D, cx->DB, qp[r]);
        ctx[r] = start + j;
        run[r].m = -INFINITY; run[r].l = 0.f;
        for (int i = 0; i < nv; i++) run[r].o[i] = v_zero();
    }
    const int64_t end = start + it->q1;               /* the tile sees context [0, end) */
    const int tr = tiles_begin(cx, 16);
    if (cx->tiles) memset(qp[R], 0, sizeof(uint32_t) * 64 * (ROWS - R));   /* whole tiles read zeros */
    const int KS = 16 * cx->DB;
    __m512i Kloc[NB * 16 * MAXDB], Vloc[NB * 16 * MAXDB];
    const __m512i* Kpre = NULL;                       /* this kv head's pre-transposed blocks */
    if (cx->pre_at && cx->pre_at[it->b] >= 0)
        Kpre = cx->pre + cx->pre_at[it->b] + (int64_t)it->hk * 2 * KS * ((L + 15) / 16);
    for (int c = it->c0; c < it->c1; c++) {
        const int64_t c0 = (int64_t)c * CHUNK, c1 = c0 + CHUNK < end ? c0 + CHUNK : end;
        for (int r = 0; r < R; r++) {
            st[r].m = -INFINITY; st[r].l = 0.f;
            for (int i = 0; i < nv; i++) st[r].o[i] = v_zero();
        }
        for (int64_t k0 = c0; k0 < c1; k0 += SB) {
            const int nk = c1 - k0 < SB ? (int)(c1 - k0) : SB, nb = (nk + 15) / 16;
            const int64_t k1 = k0 + SB;
            const __m512i *Kt = Kloc, *Vp = Vloc;
            if (Kpre) {                                   /* blocks k0/16 ... of the pre-pass */
                Kt = Kpre + KS * (k0 / 16);
                Vp = Kpre + KS * ((L + 15) / 16 + k0 / 16);
            } else {
                if (k1 < c1) prefetch_rows(cx, cx->slots + off + k1, 0, c1 - k1 < SB ? c1 - k1 : SB, Hk * D, it->hk * D, D);
                for (int x = 0; x < nb; x++) {
                    const int n = nk - 16 * x < 16 ? nk - 16 * x : 16;
                    load_block(cx, cx->slots + off + k0 + 16 * x, n, it->hk, Kloc + x * KS, Vloc + x * KS);
                }
            }
            for (int r = 0; r < R; r++) rel[r] = ctx[r] - k0;
            rows_block(cx, (const uint32_t (*)[64])qp, 1, rel, R, tr, nk, Kt, Vp, st);
        }
        for (int r = 0; r < R; r++)
            if (st[r].m != -INFINITY)                     /* else the row sees nothing of this chunk */
                merge(&run[r].m, &run[r].l, run[r].o, st[r].m, st[r].l, st[r].o, nv);
    }
    tiles_end(cx);
    for (int r = 0; r < R; r++) {
        const int j = it->q0 + r / G, h = it->hk * G + r % G;
        store_out(cx, cx->out + ((row0 + j) * H + h) * D, &run[r]);
    }
}

/* Row r of a split item (rows grouped per kv head, R = nq G of them each): row hk R + j G + g is
 * query row j, head hk G + g */
static inline void split_row(int r, int R, int G, int* j, int* h) { *j = (r % R) / G; *h = (r / R) * G + r % G; }

/* Copies elements [at, at + w) of the cache rows (row = Hk D bf16, every kv head) of slots sl[0, n)
 * into dst, K then V (dst + SB w), one after another: one stream instead of a per-head gather. */
static inline void stage_rows(const Ctx* cx, const int64_t* sl, int n, int row, int at, int w, uint16_t* dst) {
    uint16_t* vd = dst + (size_t)SB * w;
    if (w % 32 == 0) {                                /* whole 64-byte vectors; dst is 64-byte aligned */
        for (int i = 0; i < n; i++) {
            const uint16_t *k = cx->kc + sl[i] * row + at, *v = cx->vc + sl[i] * row + at;
            for (int o = 0; o < w; o += 32) {
                _mm512_store_si512((void*)(dst + (size_t)i * w + o), _mm512_loadu_si512((const void*)(k + o)));
                _mm512_store_si512((void*)(vd + (size_t)i * w + o), _mm512_loadu_si512((const void*)(v + o)));
            }
        }
        return;
    }
    for (int i = 0; i < n; i++) memcpy(dst + (size_t)i * w, cx->kc + sl[i] * row + at, (size_t)w * 2);
    for (int i = 0; i < n; i++) memcpy(vd + (size_t)i * w, cx->vc + sl[i] * row + at, (size_t)w * 2);
}


/* A split item (it->hk < 0): chunk it->c0 of a few-row sequence, all its nq rows, kv heads
 * [h0, h1), partials out (rows as split_row() numbers them). stage holds SB cache rows of K and
 * of V (those heads' part): up to 2 * SB * Hk * D bf16. */
static void run_heads(const Item* it, const Ctx* cx, uint16_t* stage) {
    const int64_t* sq = cx->seqs + 4 * it->b;
    const int64_t row0 = sq[0], nq = sq[1], off = sq[2], L = sq[3], start = L - nq;
    const int H = cx->H, Hk = cx->Hk, D = cx->D, G = H / Hk, nv = 2 * cx->DB, row = Hk * D, R = (int)nq * G;
    const int h0 = it->h0, h1 = it->h1, at = h0 * D, w = (h1 - h0) * D;
    uint32_t qp[ROWS][64];
    int64_t rel[ROWS], iota[SB];
    RowState st[ROWS];
    const int nr = (h1 - h0) * R;                /* qp and st hold rows h0 R .. h1 R - 1 from 0 */
    for (int r = 0; r < nr; r++) {
        int j, h;
        split_row(h0 * R + r, R, G, &j, &h);
        q_pairs(cx->q + ((row0 + j) * H + h) * D, D, cx->DB, qp[r]);
        st[r].m = -INFINITY; st[r].l = 0.f;
        for (int i = 0; i < nv; i++) st[r].o[i] = v_zero();
    }
    for (int i = 0; i < SB; i++) iota[i] = i;
    Ctx sc = *cx;                  /* the block's rows, slot i = its key i: kc/vc set per super-block */
    sc.Hk = h1 - h0;
    const int64_t c0 = (int64_t)it->c0 * CHUNK, c1 = c0 + CHUNK < L ? c0 + CHUNK : L;
    const int KS = 16 * cx->DB;
    __m512i Kt[NB * 16 * MAXDB], Vp[NB * 16 * MAXDB];
    const int tr = tiles_begin(cx, R);
    for (int64_t k0 = c0; k0 < c1; k0 += SB) {
        const int nk = c1 - k0 < SB ? (int)(c1 - k0) : SB, nb = (nk + 15) / 16;
        const int64_t* sl = cx->slots + off + k0;
        const int64_t left = c1 - k0 - SB, nx = left <= 0 ? 0 : left < SB ? left : SB;   /* the next block's keys */
        /* the block's slots in one run over every kv head: its cache rows are already the staged
         * layout, read in place (same bits); else copied */
        int run = w == row;
        for (int i = 1; run && i < nk; i++) run = sl[i] == sl[0] + i;
        const int direct = cx->direct && !run;        /* each head's blocks gathered from the pool */
        if (run) { sc.kc = cx->kc + sl[0] * row; sc.vc = cx->vc + sl[0] * row; }
        else if (!direct) { sc.kc = stage; sc.vc = stage + (size_t)SB * w; stage_rows(cx, sl, nk, row, at, w, stage); }
        for (int r = 0; r < R; r++) rel[r] = start + r / G - k0;
        for (int hk = h0; hk < h1; hk++) {
            for (int x = 0; x < nb; x++) {
                const int u = (hk - h0) * nb + x, U = (h1 - h0) * nb;
                prefetch_rows(cx, sl + SB, nx * u / U, nx * (u + 1) / U, row, at, w);
                const int n = nk - 16 * x < 16 ? nk - 16 * x : 16;
                if (direct) load_block(cx, sl + 16 * x, n, hk, Kt + x * KS, Vp + x * KS);
                else load_block(&sc, iota + 16 * x, n, hk - h0, Kt + x * KS, Vp + x * KS);
            }
            rows_block(cx, (const uint32_t (*)[64])qp[(hk - h0) * R], 0, rel, R, tr, nk, Kt, Vp, st + (hk - h0) * R);
        }
    }
    tiles_end(cx);
    /* partials at part + ((j H + h) nc + c) W; a row that sees nothing of the chunk (a draft's
     * keys past an earlier row) leaves m = -inf, which the merge skips */
    const int64_t nc = (L + CHUNK - 1) / CHUNK;
    for (int r = 0; r < nr; r++) {
        int j, h;
        split_row(h0 * R + r, R, G, &j, &h);
        float* p = cx->part + it->part + (((int64_t)j * H + h) * nc + it->c0) * (2 + 16 * nv);
        p[0] = st[r].m; p[1] = st[r].l;
        if (st[r].m != -INFINITY)
            for (int i = 0; i < nv; i++) v_store(p + 2 + 16 * i, st[r].o[i]);
    }
}

/* Sequences whose rows span several tiles read every key block once per tile (and kv head); for
 * them the blocks are transposed once here, in parallel, into cx->pre (per sequence and kv head:
 * its ceil(L / 16) K blocks, then its V blocks, 16 DB vectors each; the same bits load_block
 * would give each tile). Returns pre_at (per sequence: its offset in vectors, or -1), or NULL
 * (none to transpose, or no memory: then *nomem = 1). */
static int64_t* pretranspose(Ctx* cx, int B, int TQ, int nfew, int* nomem) {
    const int KS = 16 * cx->DB, H = cx->H, Hk = cx->Hk;
    int64_t* at = malloc(sizeof(int64_t) * B), total = 0;
    if (!at) { *nomem = 1; return NULL; }
    for (int b = 0; b < B; b++) {
        const int64_t nq = cx->seqs[4 * b + 1], L = cx->seqs[4 * b + 3], nc = (L + CHUNK - 1) / CHUNK;
        at[b] = -1;
        if (SPLIT(nq, nc) || nq <= TQ) continue;
        at[b] = total;
        total += (int64_t)cx->Hk * 2 * KS * ((L + 15) / 16);
    }
    if (total == 0) { free(at); return NULL; }
    cx->pre = aligned_alloc(64, sizeof(__m512i) * total);
    if (!cx->pre) { free(at); *nomem = 1; return NULL; }
    for (int b = 0; b < B; b++) {
        if (at[b] < 0) continue;
        const int64_t off = cx->seqs[4 * b + 2], L = cx->seqs[4 * b + 3], nblk = (L + 15) / 16;
        const int row = cx->Hk * cx->D;
        #pragma omp parallel for schedule(static)
        for (int64_t j = 0; j < nblk; j++) {
            const int64_t* sl = cx->slots + off + 16 * j;
            const int n = L - 16 * j < 16 ? (int)(L - 16 * j) : 16;
            const int64_t ahead = 16 * (j + PRE_AHEAD), left = L - ahead;
            if (left > 0) prefetch_rows(cx, cx->slots + off + ahead, 0, left < 16 ? left : 16, row, 0, row);
            for (int hk = 0; hk < cx->Hk; hk++) {
                __m512i* base = cx->pre + at[b] + (int64_t)hk * 2 * KS * nblk;
                load_block(cx, sl, n, hk, base + KS * j, base + KS * (nblk + j));
            }
        }
    }
    return at;
}

/* a call that found no memory frees what it took and returns 3 (nothing written, never a crash) */
static int no_memory(void* part, void* items) {
    free(part);
    free(items);
    return 3;
}

/* mode & 3: 0 vdpbf16ps; 1 every row on AMX tiles where this build and CPU have them (else
 * ignored: check streamkv_inv_attn_amx_available()); 2 the fma chain. mode & 4: split items gather
 * each head's blocks from the pool instead of staging the super-block's rows (the same bits).
 * Returns 0; 1, 2 shapes rejected; 4 mode rejected; 3 no memory (nothing written); 5 not built. */
int streamkv_inv_attn_bf16(const float* q, const uint16_t* kc, const uint16_t* vc, const int64_t* seqs, int B,
                           const int64_t* slots, int H, int Hk, int D, float scale, float* out, int mode) {
    if (D % 16 != 0 || D > 32 * MAXDB || Hk <= 0 || H % Hk != 0 || H / Hk > ROWS || B <= 0) return 1;
    if (mode < 0 || (mode & 3) == 3 || mode > 7) return 4;
    const int G = H / Hk, TQ = ROWS / G, nv = 2 * ((D + 31) / 32), W = 2 + 16 * nv;
    Ctx cx = {kc, vc, seqs, slots, q, out, NULL, H, Hk, D, (D + 31) / 32, scale, NULL, NULL, 0, (mode & 3) == 2,
              (mode & 4) != 0};
#ifdef AMX
    cx.tiles = (mode & 3) == 1 && amx_enabled();
#endif
    int64_t nitems = 0, npart = 0, nsplit = 0, nwide = 0;   /* nwide: split chunks of rows too many for one item */
    int nfew = 0;
    for (int b = 0; b < B; b++) nfew += FEW(seqs[4 * b + 1]);
    for (int b = 0; b < B; b++) {
        const int64_t nq = seqs[4 * b + 1], L = seqs[4 * b + 3];
        if (nq <= 0 || nq > L) return 2;
        const int64_t nc = (L + CHUNK - 1) / CHUNK;
        if (SPLIT(nq, nc)) { nsplit += nc; nwide += WHOLE(nq) ? 0 : nc; npart += nq * H * nc * W; }
        else nitems += Hk * ((nq + TQ - 1) / TQ);
    }
    /* A step of nothing but a few chunk items (a lone decode over 513-1,536 keys, a Quest
     * decode's picked pages) splits each chunk per kv head too: 2 chunks of 512 + 64 keys are
     * otherwise 512 keys on one thread and 64 on the other. */
    const int apart = nitems == 0 && Hk > 1 && nsplit < 2 * omp_get_max_threads();
    nitems += (nsplit - nwide) * split_items(apart, 1, Hk) + nwide * split_items(apart, 0, Hk);
    Item* items = malloc(sizeof(Item) * nitems);
    cx.part = npart ? malloc(sizeof(float) * npart) : NULL;
    int nomem = !items || (npart && !cx.part);
    if (nomem) return no_memory(cx.part, items);
    int64_t n = 0, po = 0;
    for (int b = 0; b < B; b++) {
        const int64_t nq = seqs[4 * b + 1], L = seqs[4 * b + 3];
        const int nc = (int)((L + CHUNK - 1) / CHUNK);
        if (SPLIT(nq, nc)) {
            const int per = split_items(apart, WHOLE(nq), Hk), hs = Hk / per;   /* heads per item */
            for (int c = 0; c < nc; c++)
                for (int h = 0; h < per; h++) items[n++] = (Item){b, 0, (int)nq, -1, c, c + 1, h * hs, (h + 1) * hs, po};
            po += nq * H * nc * W;
        } else {
            for (int q0 = 0; q0 < nq; q0 += TQ)
                for (int hk = 0; hk < Hk; hk++) {
                    const int q1 = q0 + TQ < nq ? q0 + TQ : (int)nq;
                    const int ncs = (int)((L - nq + q1 + CHUNK - 1) / CHUNK);
                    items[n++] = (Item){b, q0, q1, hk, 0, ncs, 0, 0, -1};
                }
        }
    }
    int64_t* pre_at = pretranspose(&cx, B, TQ, nfew, &nomem);
    if (nomem) return no_memory(cx.part, items);
    cx.pre_at = pre_at;
    if (npart == 0) {
        #pragma omp parallel for schedule(dynamic, 1)
        for (int64_t t = 0; t < nitems; t++) run_item(&items[t], &cx);
    } else {
        #pragma omp parallel
        {
            /* each thread's own staging rows (its own malloc arena, reused call after call) */
            const size_t bytes = ((size_t)2 * SB * Hk * D * sizeof(uint16_t) + 63) / 64 * 64;  /* K and V rows */
            uint16_t* stage = aligned_alloc(64, bytes);
            if (!stage) {
                #pragma omp atomic write
                nomem = 1;
            }
            #pragma omp barrier
            /* every thread reads nomem after the barrier: all take no item, or all run */
            #pragma omp for schedule(dynamic, 1)
            for (int64_t t = 0; t < nitems; t++) {
                if (nomem) continue;
                if (items[t].hk < 0) run_heads(&items[t], &cx, stage);
                else run_item(&items[t], &cx);
            }
            free(stage);
        }
    }
    /* merge the split rows: per (sequence, row, head), its chunks in order (not after a thread
     * found no memory: then no item ran and out is not written) */
    #pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < (nomem ? 0 : nitems); t++) {
        const Item* it = &items[t];
        if (it->part < 0 || it->c0 != 0 || it->h0 != 0) continue;   /* once per sequence */
        const int64_t* sq = seqs + 4 * it->b;
        const int nc = (int)((sq[3] + CHUNK - 1) / CHUNK);
        for (int jh = 0; jh < sq[1] * H; jh++) {      /* split items cover every row and head */
            RowState s;
            s.m = -INFINITY; s.l = 0.f;
            for (int i = 0; i < nv; i++) s.o[i] = v_zero();
            for (int c = 0; c < nc; c++) {
                const float* p = cx.part + it->part + ((int64_t)jh * nc + c) * W;
                if (p[0] == -INFINITY) continue;
                v16 o[2 * MAXDB];
                for (int i = 0; i < nv; i++) o[i] = v_load(p + 2 + 16 * i);
                merge(&s.m, &s.l, s.o, p[0], p[1], o, nv);
            }
            store_out(&cx, out + (sq[0] * H + jh) * D, &s);
        }
    }
    free(cx.pre);
    free(pre_at);
    free(cx.part);
    free(items);
    return nomem ? 3 : 0;
}

int streamkv_inv_attn_bf16_available(void) { return 1; }
#else
int streamkv_inv_attn_bf16(const float* q, const uint16_t* kc, const uint16_t* vc, const int64_t* seqs, int B,
                           const int64_t* slots, int H, int Hk, int D, float scale, float* out, int mode) {
    (void)q; (void)kc; (void)vc; (void)seqs; (void)B; (void)slots; (void)H; (void)Hk; (void)D; (void)scale; (void)out;
    (void)mode;
    return 5;  /* not built (3 is no memory) */
}

int streamkv_inv_attn_bf16_available(void) { return 0; }
#endif

/* whether tiles = 1 runs on AMX tiles here (built for AMX, and the kernel allows tile data) */
int streamkv_inv_attn_amx_available(void) {
#ifdef AMX
    return amx_enabled();
#else
    return 0;
#endif
}
