/* The decoder layers of the invariant numerics in C: one call per step runs every layer.
 *
 * A decode step of a 30-layer model used to be ~1,500 small torch ops (norms, RoPE, casts,
 * residual adds, KV writes) around the native GEMMs and attention; here each layer is
 *
 *   x [T, d] float32 (residual)
 *   xn  = rms_norm(x, attn_norm)             -> act dtype (bf16 with bf16/4-bit weights, else f32)
 *   qkv = xn @ Wqkv (+ bias)                 float32 [T, (H + 2 Hk) D]
 *   q, k = rope(qk_norm(q, k)), per head     float32; k, v -> cache slots (cache dtype)
 *   a   = attention(q, cache)                float32 [T, H, D] (inv_attn or inv_attn_bf16)
 *   x  += act(a) @ Wo (+ bias)
 *   gu  = rms_norm(x, mlp_norm) @ Wgu        float32 [T, 2I]
 *   x  += act(silu(g) * u) @ Wdown           (dense Wgu: one GEMM whose epilogue writes act,
 *                                             streamkv_inv_gemm_silu(_f32): the same bits)
 *
 * Invariance: every op is either one of the batch-invariant kernels (inv_gemm.c, q4_gemm.c,
 * inv_attn*.c; deq_gemm.c gives inv_gemm.c's bits, so which of the two a step takes never matters) or works on one row alone in a fixed order (the norm's sum of squares: lane l
 * adds elements l, l + 16, ... in order, then v_hsum), so a row's bits never depend on T or on
 * the other rows. The Python side calls streamkv_fwd for a whole step, or streamkv_fwd_pre /
 * streamkv_fwd_attn / streamkv_fwd_post per layer when a read policy picks pages from each
 * layer's queries; both run the same functions, so they agree to the bit.
 *
 * Threads: GEMMs and attention parallelise inside; the row-wise glue splits rows across threads
 * from PAR_ROWS rows on (which thread handles a row never changes its arithmetic). The glue is
 * tiny in FLOPs but runs right after a GEMM has streamed megabytes of weights past the caches, so
 * its rows come back from memory: run by one thread it cost 5.5 of a 47 ms step of 32 decodes on
 * the EPYC (norms alone 3.0 ms, ~100 us per layer); split across 2 threads, 1.2 ms.
 */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#include "vec16.h"

int streamkv_inv_gemm(const void* x, int64_t M, int K, const void* wp, int wbf16, int N, void* out, int out_bf16,
                      int path);
int streamkv_q4_gemm(const uint16_t* x, int M, int K, const uint8_t* w, const uint16_t* sz, int N, void* out,
                     int bf16_out, int fma);
int streamkv_deq_gemm(const float* x, int64_t M, int K, const void* q, const uint16_t* dm, int bits, int N,
                      void* out, int out_bf16);
int streamkv_inv_gemm_silu(const uint16_t* x, int64_t M, int K, const void* wp, int I, uint16_t* act,
                           int path);
int streamkv_inv_gemm_silu_f32(const float* x, int64_t M, int K, const float* wp, int I, float* act);
int streamkv_deq_gemm_bf16(const uint16_t* x, int64_t M, int K, const uint8_t* q, const float* dm, int bits, int N,
                           void* out, int out_bf16, int path);
int streamkv_inv_attn(const float* q, const void* kc, const void* vc, int bf16, const int64_t* seqs, int B,
                      const int64_t* slots, int H, int Hk, int D, float scale, float* out);
int streamkv_inv_attn_bf16(const float* q, const uint16_t* kc, const uint16_t* vc, const int64_t* seqs, int B,
                           const int64_t* slots, int H, int Hk, int D, float scale, float* out, int mode);

typedef struct {
    int kind;            /* 0: dense panels (inv_gemm.c), 1: GGUF 4-bit (q4_gemm.c) */
    int N, K, wbf16;     /* wbf16: dense panels are bf16 */
    int tiles;           /* dense bf16: inv_gemm.c's path (1 AMX tiles where the CPU has them, 2 the fma
                          * chain); 4-bit: q4_gemm.c's fma chain */
    const void* w;       /* panels, or packed nibbles */
    const void* sz;      /* 4-bit: scales and zeros */
    const float* bias;   /* [N] or NULL */
    const void* deq;     /* the GGUF's 4-bit values with the panels' bits, or NULL: float32 panels
                            deq_gemm.c (deq_dm float16), bf16 panels deq_bf16.c (deq_dm float32) */
    const uint16_t* deq_dm;
    int deq_rows;        /* steps of at most this many rows read deq instead of the panels */
} SkLinear;

typedef struct {
    SkLinear qkv, o, gate_up, down;
    const float* attn_norm;  /* [d] */
    const float* mlp_norm;   /* [d] */
    const float* qk_norm;    /* [H + Hk, D] (Qwen3) or NULL */
    void* kc;                /* [S, Hk, D] cache dtype */
    void* vc;
} SkLayer;

typedef struct {
    int n_layers, d, H, Hk, D, inter;
    int act_bf16;            /* GEMM inputs in bf16 */
    int kv_bf16;             /* cache dtype */
    int attn_bf16;           /* attention through inv_attn_bf16.c: 1, 2 on AMX tiles, 3 the fma chain (0: inv_attn.c);
                                plus 4: its few-row items gather from the pool (passed on as mode's bit 4) */
    float eps, scale;
    const float* cos_t;      /* [positions, D]: cos, and sin with the rotate-half sign folded in */
    const float* sin_t;
    const SkLayer* layers;
    double* prof;            /* NULL, or seconds per phase accumulated here (see PHASES) */
} SkModel;

/* phases timed when prof is set: norms and casts, GEMMs, qk-norm + RoPE + KV writes, attention,
 * SiLU, residual adds, page selection (streamkv_fwd_sel) */
enum { P_NORM, P_GEMM, P_ROPE, P_ATTN, P_SILU, P_RESID, P_SEL, PHASES };
#define TIC(m) double tic_ = (m)->prof ? omp_get_wtime() : 0.0
#define TOC(m, phase) do { if ((m)->prof) { double t_ = omp_get_wtime(); (m)->prof[phase] += t_ - tic_; tic_ = t_; } } while (0)

#define PAR_ROWS 4           /* steps with at least this many rows split the glue across threads */

static inline v16 load_n(const float* p, int n) {   /* up to 16 floats, zeros past n */
    if (n >= 16) return v_load(p);
    float t[16] = {0};
    for (int i = 0; i < n; i++) t[i] = p[i];
    return v_load(t);
}

/* out[at:at + n] = v in the act dtype (bf16: nearest even, the same bits as f32_to_bf16) */
static inline void store_act(void* out, int bf16, int64_t at, const float* v, int n) {
    if (!bf16) { memcpy((float*)out + at, v, sizeof(float) * n); return; }
    uint16_t* o = (uint16_t*)out + at;
    int i = 0;
    for (; i + 16 <= n; i += 16) v_store_bf16(o + i, v_load(v + i));
    for (; i < n; i++) o[i] = f32_to_bf16(v[i]);
}

/* 1 / sqrt(mean(x[0:n]^2) + eps): lane l sums x[l]^2, x[l + 16]^2, ... in order, then v_hsum */
static inline float rms_scale(const float* x, int n, float eps) {
    v16 acc = v_zero();
    for (int i = 0; i < n; i += 16) { v16 a = load_n(x + i, n - i); acc = v_fma(a, a, acc); }
    return 1.f / sqrtf(v_hsum(acc) / (float)n + eps);
}

/* x [T, d] float32 -> out [T, d] = x * rms_scale * w (w may be NULL) in the act dtype */
int streamkv_rms_norm(const float* x, int64_t T, int d, const float* w, float eps, void* out, int out_bf16) {
    if (T <= 0 || d <= 0) return 1;
    #pragma omp parallel for schedule(static) if (T >= PAR_ROWS)
    for (int64_t t = 0; t < T; t++) {
        const float* xr = x + t * d;
        const float r = rms_scale(xr, d, eps);
        const v16 vr = v_set1(r);
        float y[64];
        for (int i = 0; i < d; i += 64) {
            const int k = d - i < 64 ? d - i : 64;
            int j = 0;
            for (; j + 16 <= k; j += 16) {
                const v16 a = v_mul(v_load(xr + i + j), vr);
                v_store(y + j, w ? v_mul(a, v_load(w + i + j)) : a);
            }
            for (; j < k; j++) y[j] = w ? (xr[i + j] * r) * w[i + j] : xr[i + j] * r;
            store_act(out, out_bf16, t * d + i, y, k);
        }
    }
    return 0;
}

static int linear(const SkLinear* l, const void* x, int64_t T, float* out) {
    int rc = l->kind == 1 ? streamkv_q4_gemm((const uint16_t*)x, (int)T, l->K, (const uint8_t*)l->w,
                                             (const uint16_t*)l->sz, l->N, out, 0, l->tiles)
           : l->deq && T <= l->deq_rows
               ? (l->wbf16 ? streamkv_deq_gemm_bf16((const uint16_t*)x, T, l->K, (const uint8_t*)l->deq,
                                                    (const float*)(const void*)l->deq_dm, 4, l->N, out, 0, l->tiles)
                           : streamkv_deq_gemm((const float*)x, T, l->K, l->deq, l->deq_dm, 4, l->N, out, 0))
               : streamkv_inv_gemm(x, T, l->K, l->w, l->wbf16, l->N, out, 0, l->tiles);
    if (rc == 0 && l->bias)
        for (int64_t t = 0; t < T; t++) for (int n = 0; n < l->N; n++) out[t * l->N + n] += l->bias[n];
    return rc;
}

/* Workspace of a step of T rows, carved in this order (64-byte aligned start, 128 bytes of slack):
 *
 *   f    float [T, max(qkv, 2I, d)]       q    float [T, H D]       attn  float [T, H D]
 *   act  [T, max(d, H D, I)] (bf16 or float by act_bf16)
 *   act2 [T, I] (act's dtype): the fused gate_up's output (its input, act, is still being read
 *        while it writes)
 *
 * WsDims holds the row widths both the size and the carving read, so they cannot drift. */
typedef struct { int64_t a, f, hd, ab; } WsDims;  /* act width, f width, H D, act bytes per value */

static WsDims ws_dims(const SkModel* m) {
    const int64_t hd = (int64_t)m->H * m->D, nqkv = (int64_t)(m->H + 2 * m->Hk) * m->D, i2 = 2 * (int64_t)m->inter;
    WsDims d = {m->d > hd ? m->d : hd, nqkv > i2 ? nqkv : i2, hd, m->act_bf16 ? 2 : 4};
    if (m->inter > d.a) d.a = m->inter;
    if (m->d > d.f) d.f = m->d;
    return d;
}

size_t streamkv_fwd_workspace(const SkModel* m, int64_t T) {
    const WsDims d = ws_dims(m);
    return (size_t)T * (size_t)(4 * d.f + 8 * d.hd + (d.a + m->inter) * d.ab) + 128;
}

typedef struct { void* act; float* f; float* q; float* attn; void* act2; } Work;

static Work carve(const SkModel* m, int64_t T, void* ws) {
    const WsDims d = ws_dims(m);
    char* p = (char*)(((uintptr_t)ws + 63) & ~(uintptr_t)63);
    Work w;
    w.f = (float*)p; p += T * d.f * 4;
    w.q = (float*)p; p += T * d.hd * 4;
    w.attn = (float*)p; p += T * d.hd * 4;
    w.act = p; p += T * d.a * d.ab;
    w.act2 = (void*)(((uintptr_t)p + 63) & ~(uintptr_t)63);
    return w;
}

/* one head in place: optional per-head RMSNorm, then RoPE at position pos (D a multiple of 16) */
static inline void head_transform(float* v, int D, const float* norm, float eps, const float* cs, const float* sn) {
    float rot[256];
    if (norm) {
        const v16 r = v_set1(rms_scale(v, D, eps));
        for (int i = 0; i < D; i += 16) v_store(v + i, v_mul(v_mul(v_load(v + i), r), v_load(norm + i)));
    }
    memcpy(rot, v + D / 2, sizeof(float) * (D / 2));  /* rot[i] = v[(i + D/2) % D] */
    memcpy(rot + D / 2, v, sizeof(float) * (D / 2));
    for (int i = 0; i < D; i += 16)
        v_store(v + i, v_fma(v_load(rot + i), v_load(sn + i), v_mul(v_load(v + i), v_load(cs + i))));
}

static inline void cache_write(void* cache, int bf16, int64_t at, const float* v, int n) { store_act(cache, bf16, at, v, n); }

int streamkv_fwd_pre(const SkModel* m, int layer, const float* x, int64_t T, const int64_t* pos,
                     const int64_t* slot_mapping, float* q_out, void* ws) {
    const SkLayer* L = m->layers + layer;
    const int H = m->H, Hk = m->Hk, D = m->D, nqkv = (H + 2 * Hk) * D;
    Work w = carve(m, T, ws);
    TIC(m);
    int rc = streamkv_rms_norm(x, T, m->d, L->attn_norm, m->eps, w.act, m->act_bf16);
    TOC(m, P_NORM);
    if (rc == 0) rc = linear(&L->qkv, w.act, T, w.f);
    TOC(m, P_GEMM);
    if (rc != 0) return rc;
    #pragma omp parallel for schedule(static) if (T >= PAR_ROWS)
    for (int64_t t = 0; t < T; t++) {
        float* r = w.f + t * nqkv;
        const float* cs = m->cos_t + pos[t] * D;
        const float* sn = m->sin_t + pos[t] * D;
        for (int h = 0; h < H + Hk; h++)
            head_transform(r + h * D, D, L->qk_norm ? L->qk_norm + h * D : NULL, m->eps, cs, sn);
        memcpy(q_out + t * H * D, r, sizeof(float) * H * D);
        const int64_t at = slot_mapping[t] * Hk * D;
        cache_write(L->kc, m->kv_bf16, at, r + H * D, Hk * D);
        cache_write(L->vc, m->kv_bf16, at, r + (H + Hk) * D, Hk * D);
    }
    TOC(m, P_ROPE);
    return 0;
}

int streamkv_fwd_attn(const SkModel* m, int layer, const float* q, const int64_t* seqs, int B,
                      const int64_t* slots, float* out) {
    const SkLayer* L = m->layers + layer;
    TIC(m);
    const int rc = m->attn_bf16
        ? streamkv_inv_attn_bf16(q, (const uint16_t*)L->kc, (const uint16_t*)L->vc, seqs, B, slots, m->H, m->Hk,
                                 m->D, m->scale, out, m->attn_bf16 - 1)
        : streamkv_inv_attn(q, L->kc, L->vc, m->kv_bf16, seqs, B, slots, m->H, m->Hk, m->D, m->scale, out);
    TOC(m, P_ATTN);
    return rc;
}

/* x[t] += y[t] for rows [0, T) of width n */
static void residual(float* x, const float* y, int64_t T, int n) {
    #pragma omp parallel for schedule(static) if (T >= PAR_ROWS)
    for (int64_t t = 0; t < T; t++)
        for (int i = 0; i < n; i += 16) {
            const int k = n - i < 16 ? n - i : 16;
            if (k == 16) v_store(x + t * n + i, v_add(v_load(x + t * n + i), v_load(y + t * n + i)));
            else for (int j = 0; j < k; j++) x[t * n + i + j] += y[t * n + i + j];
        }
}

/* act[t] = silu(g) * u in the act dtype, gu [T, 2I] = [g | u] per row (v_silu_mul of vec16.h) */
int streamkv_silu_mul(const float* gu, int64_t T, int I, void* act, int bf16) {
    if (T <= 0 || I <= 0) return 1;
    #pragma omp parallel for schedule(static) if (T >= PAR_ROWS)
    for (int64_t t = 0; t < T; t++) {
        float y[16];
        for (int i = 0; i < I; i += 16) {
            const int k = I - i < 16 ? I - i : 16;
            const v16 out = v_silu_mul(load_n(gu + t * 2 * I + i, k), load_n(gu + t * 2 * I + I + i, k));
            if (k == 16 && bf16) v_store_bf16((uint16_t*)act + t * I + i, out);
            else { v_store(y, out); store_act(act, bf16, t * I + i, y, k); }
        }
    }
    return 0;
}

int streamkv_fwd_post(const SkModel* m, int layer, float* x, int64_t T, const float* attn, void* ws) {
    const SkLayer* L = m->layers + layer;
    const int hd = m->H * m->D, I = m->inter;
    Work w = carve(m, T, ws);
    TIC(m);
    #pragma omp parallel for schedule(static) if (T >= PAR_ROWS)
    for (int64_t t = 0; t < T; t++) store_act(w.act, m->act_bf16, t * hd, attn + t * hd, hd);
    TOC(m, P_NORM);
    int rc = linear(&L->o, w.act, T, w.f);
    TOC(m, P_GEMM);
    if (rc != 0) return rc;
    residual(x, w.f, T, m->d);
    TOC(m, P_RESID);
    rc = streamkv_rms_norm(x, T, m->d, L->mlp_norm, m->eps, w.act, m->act_bf16);
    TOC(m, P_NORM);
    /* dense gate_up rows (bf16 weights and activations, or float32 both): the GEMM applies silu(g) * u
     * itself where it can (same bits, and the float32 [T, 2I] never goes through memory); else the
     * GEMM, then the pass over its output */
    const SkLinear* gu = &L->gate_up;
    const int dense = rc == 0 && gu->kind == 0 && !gu->bias && !(gu->deq && T <= gu->deq_rows);
    const int fused = dense && (m->act_bf16
        ? gu->wbf16 && streamkv_inv_gemm_silu(w.act, T, gu->K, gu->w, I, w.act2, gu->tiles) == 0
        : !gu->wbf16 && streamkv_inv_gemm_silu_f32(w.act, T, gu->K, gu->w, I, w.act2) == 0);
    if (!fused) {
        if (rc == 0) rc = linear(gu, w.act, T, w.f);
        TOC(m, P_GEMM);
        if (rc != 0) return rc;
        streamkv_silu_mul(w.f, T, I, w.act, m->act_bf16);
    }
    TOC(m, fused ? P_GEMM : P_SILU);
    rc = linear(&L->down, fused ? w.act2 : w.act, T, w.f);
    TOC(m, P_GEMM);
    if (rc != 0) return rc;
    residual(x, w.f, T, m->d);
    TOC(m, P_RESID);
    return 0;
}

int streamkv_page_select(const void* q, int q_bf16, int R, int kvh, int g, int D, const uint16_t* bounds,
                         const int64_t* cand, int P, int keep, float scale, int64_t* pos, const int64_t* full,
                         int64_t sink_len, int64_t tail_from, int64_t ctx_len, int bs, int64_t* slots);
int streamkv_page_shares(const void* q, int q_bf16, int R, int kvh, int g, int D, const uint16_t* bounds,
                         const int64_t* cand, int P, float scale, float* out, int keep, int64_t* pos,
                         const int64_t* full, int64_t sink_len, int64_t tail_from, int64_t first, int bs,
                         int64_t* slots);

/* A decode row that reads `keep` pages per layer (Quest, streamkv_fwd_sel) and writes its
 * compacted context slots (sinks, the pages, the tail of `full`) at slots + out_off each layer:
 *   picked == NULL: with the layer's query of row q_row it ranks the P candidate pages by their
 *                  key bounds and keeps the `keep` best (rescore);
 *   picked != NULL: the pages it took before (a row reusing its remembered picks): picked
 *                  [layers][keep] holds each layer's page positions (ascending);
 *   rows > 0:      a session question's rows q_row .. q_row + rows - 1, each ranking the pages
 *                  with its own query (streamkv_page_shares: a row's bits whatever rows come
 *                  with it, its shares of every page in scratch [rows][P]); row r's slots
 *                  (sinks, its pages, the first `first` + r tail slots) follow row r - 1's, and
 *                  shares [layers][wrows][P] (when wrows > 0) keeps the last wrows rows' shares
 *                  (the answer's window). */
typedef struct {
    int64_t q_row;
    const int64_t* cand;
    int P, keep;
    const int64_t* full;
    int64_t sink_len, tail_from, ctx_len, out_off;
    int64_t* pos;  /* [keep] scratch ([rows][keep] for a question) */
    const int64_t* picked;
    int rows, wrows;
    int64_t first;
    float* scratch;
    float* shares;
} SkSelect;

void streamkv_compact_slots(const int64_t* full, int64_t sink_len, const int64_t* pos, int keep, int bs,
                            int64_t tail_from, int64_t ctx_len, int64_t* slots);

/* streamkv_fwd with page selection inside the layer loop: the same functions in the same order
 * as the per-layer calls with a Python selector between them (so the same bits), without a
 * round trip per layer. bounds: [layers][blocks][Hk][2D] bf16, `stride` elements per layer.
 * q_out (when q_layers != 0): the queries after RoPE of each layer l with bit l of q_layers set,
 * [layers sampled][T][H][D] float32 in layer order, copied out for the sampled attention recall
 * (computed by the caller; it changes nothing here). */
int streamkv_fwd_sel(const SkModel* m, float* x, int64_t T, const int64_t* pos, const int64_t* slot_mapping,
                     const int64_t* seqs, int B, int64_t* slots, void* ws, const SkSelect* sel, int nsel,
                     const uint16_t* bounds, int64_t stride, int bs, uint64_t q_layers, float* q_out) {
    if (T <= 0 || m->D % 16 != 0 || m->D > 256 || (q_layers && !q_out)) return 1;
    Work w = carve(m, T, ws);
    const int hd = m->H * m->D;
    for (int l = 0; l < m->n_layers; l++) {
        int rc = streamkv_fwd_pre(m, l, x, T, pos, slot_mapping, w.q, ws);
        if (l < 64 && (q_layers >> l) & 1) {  /* the sampled layers' queries, in layer order */
            memcpy(q_out, w.q, sizeof(float) * (size_t)T * hd);
            q_out += (size_t)T * hd;
        }
        TIC(m);
        for (int s = 0; s < nsel && rc == 0; s++) {
            const SkSelect* e = sel + s;
            if (e->rows > 0) {
                rc = streamkv_page_shares(w.q + e->q_row * hd, 0, e->rows, m->Hk, m->H / m->Hk, m->D, bounds + l * stride,
                                          e->cand, e->P, m->scale, e->scratch, e->keep, e->pos, e->full, e->sink_len,
                                          e->tail_from, e->first, bs, slots + e->out_off);
                if (e->wrows > 0)
                    memcpy(e->shares + (int64_t)l * e->wrows * e->P, e->scratch + (int64_t)(e->rows - e->wrows) * e->P,
                           sizeof(float) * (size_t)e->wrows * e->P);
                continue;
            }
            if (e->picked) {
                streamkv_compact_slots(e->full, e->sink_len, e->picked + (int64_t)l * e->keep, e->keep, bs,
                                       e->tail_from, e->ctx_len, slots + e->out_off);
                continue;
            }
            rc = streamkv_page_select(w.q + e->q_row * hd, 0, 1, m->Hk, m->H / m->Hk, m->D, bounds + l * stride,
                                      e->cand, e->P, e->keep, m->scale, e->pos, e->full, e->sink_len, e->tail_from,
                                      e->ctx_len, bs, slots + e->out_off);
        }
        TOC(m, P_SEL);
        if (rc == 0) rc = streamkv_fwd_attn(m, l, w.q, seqs, B, slots, w.attn);
        if (rc == 0) rc = streamkv_fwd_post(m, l, x, T, w.attn, ws);
        if (rc != 0) return 100 + rc;
    }
    return 0;
}

/* Every layer of one step: x [T, d] float32 holds the embeddings on entry and the last layer's
 * residual stream on return. */
int streamkv_fwd(const SkModel* m, float* x, int64_t T, const int64_t* pos, const int64_t* slot_mapping,
                 const int64_t* seqs, int B, const int64_t* slots, void* ws) {
    if (T <= 0 || m->D % 16 != 0 || m->D > 256) return 1;
    Work w = carve(m, T, ws);
    for (int l = 0; l < m->n_layers; l++) {
        int rc = streamkv_fwd_pre(m, l, x, T, pos, slot_mapping, w.q, ws);
        if (rc == 0) rc = streamkv_fwd_attn(m, l, w.q, seqs, B, slots, w.attn);
        if (rc == 0) rc = streamkv_fwd_post(m, l, x, T, w.attn, ws);
        if (rc != 0) return 100 + rc;
    }
    return 0;
}
