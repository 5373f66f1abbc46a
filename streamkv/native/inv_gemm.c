/* Batch-invariant dense GEMM: out[m, n] = sum_k x[m, k] * w[n, k], one fixed chain per element.
 *
 * Every output element is ONE accumulator updated in increasing k (float32 weights: a fused
 * multiply-add per k; bf16 weights: one vdpbf16ps per k pair on AVX512-BF16 CPUs, else two
 * fused multiply-adds of the exact bf16 values). Path "fma" (gemm=fma, AVX512-BF16 builds) runs
 * each vdpbf16ps as two float32 fmas of the same exact products, the pair's odd element first
 * (the instruction's definition), for CPUs that issue vdpbf16ps at half the fma rate: x is
 * widened to float32 once per call, each weight pair vector as it is read. The micro-kernels
 * below differ only in how many rows (R) and 16-column panels (P) they keep in registers, never
 * in that chain, so a row's result is bit-identical for any M, any position in the batch and any
 * thread count.
 *
 * Packed weights (built once by streamkv/models/linear.py), panel t = columns [16t, 16t + 16):
 *
 *   float32:  wp[t][k][16]            wp[t][k][c]    = w[16t + c][k]
 *   bf16:     wp[t][k/2][16][2]       wp[t][p][c][e] = w[16t + c][2p + e]     (K even)
 *
 * Columns past N are zero (the last panel's padding) and never stored.
 *
 * On CPUs with AMX (compiled with -march=native there, and allowed by the kernel) every bf16
 * GEMM whose K is a multiple of 32 runs on tiles instead, whatever M, so the choice never
 * depends on the batch: C tiles of 16 rows x 16 columns stay in tile registers over the whole
 * K, one TDPBF16PS per 32-wide K block in increasing order (the bf16 panels above are the
 * tiles' VNNI layout). The caller chooses per call (tiles = 1; the choice is measured at first start,
 * streamkv/native/tuning.py); without AMX the flag is ignored.
 *
 *   parallel over (block of MB rows, unit of UP / 2 .. UP panels: units.h), row blocks outer:
 *     for rows in steps of R (6, then the remainder):
 *       for panels in steps of P(R):  acc[R][P] over the whole K, then store
 */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#include "vec16.h"

#include "amx.h"
#include "units.h"

#define MB 96
/* rows per block on tiles: each block streams every weight panel once, and 96-row blocks read a
 * prompt chunk's weights ~11 times per 1,024 rows; 256 rows of x (K <= 1,536: <= 768 KB) and a unit's
 * 8 panels (<= 384 KB) still share a core's 2 MB L2 on the AMX Xeons. Fewer rows keep 96-row blocks
 * (more items for the threads). Only the work split changes: every element keeps its chain. */
#define MB_AMX 256
#define UP 8

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#define BF16_DOT 1
#endif

#if defined(__AVX512F__)
static inline int panels_for(int R) { return R == 1 ? 8 : R == 2 ? 4 : R <= 4 ? 3 : 2; }
#else
static inline int panels_for(int R) { return R == 1 ? 4 : R <= 3 ? 2 : 1; }
#endif

static inline void store_out(void* out, int out_bf16, int64_t at, int ncols, v16 a) {
    if (ncols == 16) {  /* a whole panel: one vector store (v_store_bf16 rounds as f32_to_bf16) */
        if (out_bf16) v_store_bf16((uint16_t*)out + at, a);
        else v_store((float*)out + at, a);
        return;
    }
    float t[16];
    v_store(t, a);
    if (out_bf16) {
        uint16_t* o = (uint16_t*)out + at;
        for (int c = 0; c < ncols; c++) o[c] = f32_to_bf16(t[c]);
    } else {
        float* o = (float*)out + at;
        for (int c = 0; c < ncols; c++) o[c] = t[c];
    }
}

/* float32 weights; x float32 rows (ldx = K). */
static inline __attribute__((always_inline)) void mk_f32(const int R, const int P, const float* x, int K,
                                                         const float* wp, v16 acc[6][8]) {
    for (int r = 0; r < R; r++) for (int p = 0; p < P; p++) acc[r][p] = v_zero();
    for (int k = 0; k < K; k++) {
        v16 w[8];
        for (int p = 0; p < P; p++) w[p] = v_load(wp + ((int64_t)p * K + k) * 16);
        for (int r = 0; r < R; r++) {
            v16 xb = v_set1(x[(int64_t)r * K + k]);
            for (int p = 0; p < P; p++) acc[r][p] = v_fma(xb, w[p], acc[r][p]);
        }
    }
}

#ifdef BF16_DOT
/* bf16 weights and rows, vdpbf16ps per k pair. */
static inline __attribute__((always_inline)) void mk_bf16(const int R, const int P, const uint16_t* x, int K,
                                                          const uint16_t* wp, v16 acc[6][8]) {
    for (int r = 0; r < R; r++) for (int p = 0; p < P; p++) acc[r][p] = v_zero();
    for (int k = 0; k < K; k += 2) {
        __m512i w[8];
        for (int p = 0; p < P; p++) w[p] = _mm512_loadu_si512((const void*)(wp + ((int64_t)p * K + k) * 16));
        for (int r = 0; r < R; r++) {
            int32_t xp;
            memcpy(&xp, x + (int64_t)r * K + k, 4);
            __m512bh xb = (__m512bh)_mm512_set1_epi32(xp);
            for (int p = 0; p < P; p++) acc[r][p] = _mm512_dpbf16_ps(acc[r][p], (__m512bh)w[p], xb);
        }
    }
}

/* bf16 weights as vdpbf16ps's fma chain (path 2): x already widened to float32 (exact), each
 * pair's two exact products added odd element first, as vdpbf16ps defines them */
static inline __attribute__((always_inline)) void mk_bf16_fma(const int R, const int P, const float* x, int K,
                                                              const uint16_t* wp, v16 acc[6][8]) {
    for (int r = 0; r < R; r++) for (int p = 0; p < P; p++) acc[r][p] = v_zero();
    for (int k = 0; k < K; k += 2) {
        v16 we[8], wo[8];
        for (int p = 0; p < P; p++)
            v_bf16_pairs(_mm512_loadu_si512((const void*)(wp + ((int64_t)p * K + k) * 16)), &we[p], &wo[p]);
        for (int r = 0; r < R; r++) {
            v16 x0 = v_set1(x[(int64_t)r * K + k]), x1 = v_set1(x[(int64_t)r * K + k + 1]);
            for (int p = 0; p < P; p++) acc[r][p] = v_fma(x0, we[p], v_fma(x1, wo[p], acc[r][p]));
        }
    }
}
#else
/* bf16 weights without bf16 dot products: x already widened to float32 (exact), each pair's two
 * exact products added in k order. */
static inline __attribute__((always_inline)) void mk_bf16(const int R, const int P, const float* x, int K,
                                                          const uint16_t* wp, v16 acc[6][8]) {
    for (int r = 0; r < R; r++) for (int p = 0; p < P; p++) acc[r][p] = v_zero();
    for (int k = 0; k < K; k += 2) {
        v16 we[8], wo[8];
        for (int p = 0; p < P; p++) {
            const uint16_t* q = wp + ((int64_t)p * K + k) * 16;
            uint16_t e[16], o[16];
            for (int c = 0; c < 16; c++) { e[c] = q[2 * c]; o[c] = q[2 * c + 1]; }
            we[p] = v_load_bf16(e);
            wo[p] = v_load_bf16(o);
        }
        for (int r = 0; r < R; r++) {
            v16 x0 = v_set1(x[(int64_t)r * K + k]), x1 = v_set1(x[(int64_t)r * K + k + 1]);
            for (int p = 0; p < P; p++) acc[r][p] = v_fma(x1, wo[p], v_fma(x0, we[p], acc[r][p]));
        }
    }
}
#endif

typedef struct {
    const void* x;      /* rows: float32, or bf16 (bf16 weights with BF16_DOT), or widened float32 */
    int K, N, wbf16, out_bf16;
    const void* wp;
    void* out;
    int silu_I;         /* the fused gate_up (streamkv_inv_gemm_silu): I; else 0 */
    int fma;            /* bf16 weights on the fma chain (path 2, BF16_DOT): x widened */
    uint16_t* pad;      /* AMX tiles, M not a multiple of 16: [threads][32 K] bf16, the last row tile zero-padded */
} Gemm;

/* R rows from row m against bf16 panels wp: vdpbf16ps, its fma chain (g->fma) or, without bf16
 * dot products, the fmas of the widened rows */
static inline __attribute__((always_inline)) void mk_w16(const Gemm* g, const int R, const int P, int64_t m,
                                                         const uint16_t* wp, v16 acc[6][8]) {
#ifdef BF16_DOT
    if (g->fma) {
        mk_bf16_fma(R, P, (const float*)g->x + m * g->K, g->K, wp, acc);
        return;
    }
    mk_bf16(R, P, (const uint16_t*)g->x + m * g->K, g->K, wp, acc);
#else
    mk_bf16(R, P, (const float*)g->x + m * g->K, g->K, wp, acc);
#endif
}

/* R rows from row m against panels [t, t + P) into acc: bf16 panels (mk_w16) or float32 (mk_f32) */
static inline __attribute__((always_inline)) void panels(const Gemm* g, const int R, const int P, int64_t m, int t,
                                                         v16 acc[6][8]) {
    const int K = g->K;
    if (g->wbf16) mk_w16(g, R, P, m, (const uint16_t*)g->wp + (int64_t)t * K * 16, acc);
    else mk_f32(R, P, (const float*)g->x + m * K, K, (const float*)g->wp + (int64_t)t * K * 16, acc);
}

/* R rows starting at row m against panels [t0, t0 + P); with g->silu_I (the fused gate_up), g panels
 * [t0, t0 + P), then their u panels t0 + I/16 .., each the same chains as unfused, leaving as act =
 * silu(g) * u in the output's dtype (bf16 only with bf16 dot products or tiles: the entry points
 * decline the rest) */
static inline __attribute__((always_inline)) void block(const Gemm* g, const int R, const int P, int64_t m, int t0) {
    v16 acc[6][8];
    panels(g, R, P, m, t0, acc);
    if (g->silu_I) {
        const int I = g->silu_I;
        v16 accu[6][8];
        panels(g, R, P, m, t0 + I / 16, accu);
        for (int r = 0; r < R; r++)
            for (int p = 0; p < P; p++) {
                const v16 a = v_silu_mul(acc[r][p], accu[r][p]);
                const int64_t at = (m + r) * I + 16 * (t0 + p);
                if (g->out_bf16) v_store_bf16((uint16_t*)g->out + at, a);
                else v_store((float*)g->out + at, a);
            }
        return;
    }
    for (int r = 0; r < R; r++)
        for (int p = 0; p < P; p++) {
            int col = 16 * (t0 + p), ncols = g->N - col < 16 ? g->N - col : 16;
            store_out(g->out, g->out_bf16, (m + r) * g->N + col, ncols, acc[r][p]);
        }
}

#define CASE_P(R, P) case P: block(g, R, P, m, t); break;
#define ROWS(R)                                                                               \
    static void rows##R(const Gemm* g, int64_t m, int t, int t1) {                            \
        while (t < t1) {                                                                      \
            int P = panels_for(R);                                                            \
            if (t1 - t < P) P = t1 - t;                                                       \
            switch (P) { CASE_P(R, 1) CASE_P(R, 2) CASE_P(R, 3) CASE_P(R, 4) CASE_P(R, 5)      \
                         CASE_P(R, 6) CASE_P(R, 7) CASE_P(R, 8) }                             \
            t += P;                                                                           \
        }                                                                                     \
    }
ROWS(1) ROWS(2) ROWS(3) ROWS(4) ROWS(5) ROWS(6)

static void unit(const Gemm* g, int64_t m0, int64_t m1, int t0, int t1) {
    int64_t m = m0;
    for (; m + 6 <= m1; m += 6) rows6(g, m, t0, t1);
    switch (m1 - m) {
        case 5: rows5(g, m, t0, t1); break;
        case 4: rows4(g, m, t0, t1); break;
        case 3: rows3(g, m, t0, t1); break;
        case 2: rows2(g, m, t0, t1); break;
        case 1: rows1(g, m, t0, t1); break;
        default: break;
    }
}

#include "gemm_amx.h"  /* unit_amx(): the tile units */

/* item i of run_units(): row block i / U (mb rows), unit i % U (P panels of the T) */
static inline void run_item(const Gemm* g, int64_t i, int64_t M, int64_t mb, int T, int P, int U, int tiles) {
    const int64_t m0 = i / U * mb, m1 = m0 + mb < M ? m0 + mb : M;
    const int u = (int)(i % U), t1 = (u + 1) * P < T ? (u + 1) * P : T;
#ifdef AMX
    if (tiles) { unit_amx(g, m0, m1, u * P, t1); return; }
#else
    (void)tiles;
#endif
    unit(g, m0, m1, u * P, t1);
}

/* One parallel loop over (row block, unit of P panels of the T), row block outer: a thread's items
 * run row block by row block, so its x rows stay in L2 while its units' panels pass; with few units
 * (N = 576: 5) a loop per row block left one of two threads idle a third of the time. AMX tiles keep
 * units of UP. With several row blocks the items go to the threads as they free up, still in row
 * block order: a static deal of contiguous shares counted every row block as full, so 100 rows
 * (96 + 4) left one thread the 96-row block and the other the 4 rows, and 1,024 rows (10 x 96 +
 * 64) gave the first thread 3.1% more; a thread slowed by its neighbours also kept its share (30
 * layers' four GEMMs on a 2-thread AVX2 EPYC, two builds alternating: 100 rows 246 -> 144 ms, 200
 * 376 -> 264, 300 606 -> 474, 512 844 -> 759, 1,024 rows 0.2-9% less in each of 6 runs). The unit
 * width is still balanced_units()' choice, which models the static deal (exact for one row block).
 * Only the work split: every element keeps its chain. */
static void run_units(const Gemm* g, int64_t M, int T, int tiles) {
    const int64_t mb = tiles && M >= 2 * MB_AMX ? MB_AMX : MB, NMB = (M + mb - 1) / mb;  /* >= 2 row blocks */
    /* units never narrower than the register block of the step's rows (AVX-512, 1 row: 8 panels) */
    const int fill = panels_for(M < 6 ? (int)M : 6), lo = fill > UP / 2 ? fill : UP / 2;
    const int P = tiles ? UP : balanced_units(T, NMB, lo, UP, omp_get_max_threads()), U = (T + P - 1) / P;
    if (NMB >= 2) {
        #pragma omp parallel for schedule(dynamic, 1)
        for (int64_t i = 0; i < NMB * U; i++) run_item(g, i, M, mb, T, P, U, tiles);
        return;
    }
    #pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < NMB * U; i++) run_item(g, i, M, mb, T, P, U, tiles);
}

/* x [M, K] bf16 as float32 (exact; caller frees; NULL: no memory) */
static float* widen_rows(const uint16_t* x, int64_t M, int K) {
    float* wide = malloc(sizeof(float) * (size_t)M * K);
    if (!wide) return NULL;
    #pragma omp parallel for schedule(static) if (M * K >= 65536)
    for (int64_t m = 0; m < M; m++)
        for (int k = 0; k < K; k++) wide[m * K + k] = bf16_to_f32(x[m * K + k]);
    return wide;
}

/* bf16 rows widened for the chain that needs them (path 2's fma chain, or every path without bf16
 * dot products; set in g), else the rows as they are; returns what the caller frees (NULL:
 * nothing), and *rc = 3 when out of memory */
static float* rows_for(Gemm* g, const uint16_t* x, int64_t M, int K, int path, int* rc) {
    *rc = 0;
#ifdef BF16_DOT
    g->fma = path == 2;
    if (!g->fma) return NULL;
#else
    (void)path;
#endif
    float* wide = widen_rows(x, M, K);
    if (!wide) *rc = 3;
    g->x = wide;
    return wide;
}

/* on AMX tiles with a partial last row tile (M % 16): each thread's zero-padded copy of it in g->pad
 * (every buffer before any output: out of memory, nothing is written); 3: no memory */
static int tile_pads(Gemm* g, int64_t M, int tiles) {
    if (!tiles || M % 16 == 0) return 0;
    g->pad = malloc((size_t)omp_get_max_threads() * 32 * (size_t)g->K * 2);
    return g->pad ? 0 : 3;
}

/* x [M, K] (float32, or bf16 when wbf16) -> out [M, N] (float32, or bf16 when out_bf16); ``path``
 * for bf16 weights: 0 the vector units, 1 AMX tiles (K a multiple of 32, where the CPU has them),
 * 2 the fma chain (AVX512-BF16 builds: vdpbf16ps's bits on float32 fmas). 1: bad shapes, 3: no
 * memory (out not written). */
int streamkv_inv_gemm(const void* x, int64_t M, int K, const void* wp, int wbf16, int N, void* out, int out_bf16,
                      int path) {
    if (M <= 0 || K <= 0 || N <= 0 || (wbf16 && K % 2 != 0)) return 1;
    Gemm g = {x, K, N, wbf16, out_bf16, wp, out, 0, 0, NULL};
    int rc = 0;
    float* wide = wbf16 ? rows_for(&g, (const uint16_t*)x, M, K, path, &rc) : NULL;
    if (rc) return rc;
    int tiles = 0;
#ifdef AMX
    tiles = path == 1 && wbf16 && K % 32 == 0 && amx_enabled();
#endif
    if ((rc = tile_pads(&g, M, tiles)) == 0) run_units(&g, M, (N + 15) / 16, tiles);
    free(g.pad);
    free(wide);
    return rc;
}

/* act [M, I] bf16 = silu(x Wg^T) * (x Wu^T) for a gate_up weight packed as one bf16 GEMM of N = 2I
 * columns (g panels [0, I/16), u panels [I/16, I/8)): each g panel runs beside its u panel, so the
 * float32 [M, 2I] products never reach memory. On AMX tiles (path 1, where streamkv_inv_gemm
 * would take them) or with bf16 dot products (path 0, or their fma chain: 2); the bits of
 * streamkv_inv_gemm(..., path) followed by streamkv_silu_mul (layer.c): the same chains, the same
 * v_silu_mul, the same work split. Returns 0, or nonzero where it cannot run here (I not a
 * multiple of 16, no bf16 dot products, no memory): the caller then takes those two passes. */
int streamkv_inv_gemm_silu(const uint16_t* x, int64_t M, int K, const void* wp, int I, uint16_t* act,
                           int path) {
    if (M <= 0 || K <= 0 || K % 2 != 0 || I <= 0 || I % 16 != 0) return 1;
    int tiles = 0;
#ifdef AMX
    tiles = path == 1 && K % 32 == 0 && amx_enabled();
#endif
#ifndef BF16_DOT
    if (!tiles) return 1;
#endif
    Gemm g = {x, K, 2 * I, 1, 1, wp, act, I, 0, NULL};
    int rc = 0;
    float* wide = tiles ? NULL : rows_for(&g, x, M, K, path, &rc);
    if (rc) return rc;
    if ((rc = tile_pads(&g, M, tiles)) == 0) run_units(&g, M, I / 16, tiles);  /* each g panel with its u panel */
    free(g.pad);
    free(wide);
    return rc;
}

/* act [M, I] float32 = silu(x Wg^T) * (x Wu^T) for a float32 gate_up weight packed as one GEMM of
 * N = 2I columns, x [M, K] float32: as streamkv_inv_gemm_silu, each g panel beside its u panel, so
 * the float32 [M, 2I] products never reach memory (1,024 rows of the embedded model: 12.6 MB a
 * layer written and read back, and the pass over them, ~40 ms a chunk on a 2-core AVX2 EPYC).
 * The bits of streamkv_inv_gemm followed by streamkv_silu_mul: the same mk_f32 chains, the same
 * v_silu_mul. Returns 0, or 1 for shapes it does not take (I not a multiple of 16), nothing
 * written: the caller then takes the two passes. */
int streamkv_inv_gemm_silu_f32(const float* x, int64_t M, int K, const float* wp, int I, float* act) {
    if (M <= 0 || K <= 0 || I <= 0 || I % 16 != 0) return 1;
    Gemm g = {x, K, 2 * I, 0, 0, wp, act, I, 0, NULL};
    run_units(&g, M, I / 16, 0);  /* each g panel with its u panel */
    return 0;
}

/* what bf16 weights can run on: "amx" (tiles available, K a multiple of 32), else "avx512bf16" or "fma" */
const char* streamkv_inv_gemm_bf16_path(void) {
#ifdef AMX
    if (amx_enabled()) return "amx";
#endif
#ifdef BF16_DOT
    return "avx512bf16";
#else
    return "fma";
#endif
}

int streamkv_inv_gemm_bf16_dot(void) {
#ifdef BF16_DOT
    return 1;
#else
    return 0;
#endif
}
