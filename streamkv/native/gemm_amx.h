/* inv_gemm.c's AMX tile units (gemm=amx), included there after block(): C tiles of 16 x 16
 * float32 over the whole K, one TDPBF16PS per 32-wide K block in increasing order. Only where
 * the CPU has AMX (AMX defined by amx.h). */
#ifndef STREAMKV_GEMM_AMX_H
#define STREAMKV_GEMM_AMX_H
#ifdef AMX

/* C[32 x 32] (at c, row stride ldc bytes) = rows x[0..32) (row stride ldx bytes) against the panels
 * wp and wq (the next one, or the fused gate_up's u panel); nr row tiles and np panels (1 or 2 each)
 * are used. */
#define AMX_BLOCK(NR, NP)                                                                        \
static void amx_##NR##NP(const uint16_t* x, int64_t ldx, const uint16_t* wp, const uint16_t* wq, int K, float* c, \
                         int64_t ldc) { \
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);                                  \
    for (int k = 0; k < K; k += 32) {                                                            \
        _tile_loadd(4, x + k, ldx);                                                              \
        if (NR == 2) _tile_loadd(5, (const char*)(x + k) + 16 * ldx, ldx);                       \
        _tile_loadd(6, wp + (int64_t)k * 16, 64);                                                \
        if (NP == 2) _tile_loadd(7, wq + (int64_t)k * 16, 64);                                   \
        _tile_dpbf16ps(0, 4, 6);                                                                 \
        if (NP == 2) _tile_dpbf16ps(1, 4, 7);                                                    \
        if (NR == 2) _tile_dpbf16ps(2, 5, 6);                                                    \
        if (NR == 2 && NP == 2) _tile_dpbf16ps(3, 5, 7);                                         \
    }                                                                                            \
    _tile_stored(0, c, ldc);                                                                     \
    if (NP == 2) _tile_stored(1, c + 16, ldc);                                                   \
    if (NR == 2) _tile_stored(2, (char*)c + 16 * ldc, ldc);                                      \
    if (NR == 2 && NP == 2) _tile_stored(3, (char*)c + 16 * ldc + 64, ldc);                     \
}
AMX_BLOCK(1, 1) AMX_BLOCK(1, 2) AMX_BLOCK(2, 1) AMX_BLOCK(2, 2)

/* rows [m0, m1) x panels [t0, t1) on tiles; a last partial row tile reads a zero-padded copy (this
 * thread's part of g->pad). With g->silu_I (the fused gate_up, streamkv_inv_gemm_silu), panel t is
 * a g panel: it runs beside its u panel t + I/16 and the 32 x (16 + 16) products leave as
 * act = silu(g) * u in bf16. */
static void unit_amx(const Gemm* g, int64_t m0, int64_t m1, int t0, int t1) {
    const int K = g->K, I = g->silu_I, step = I ? 1 : 2;
    float cbuf[32 * 32] __attribute__((aligned(64)));
    uint16_t* pad = g->pad ? g->pad + (size_t)omp_get_thread_num() * 32 * K : NULL;  /* tile_pads() */
    amx_configure();
    for (int64_t m = m0; m < m1; m += 32) {
        const int rows = m1 - m < 32 ? (int)(m1 - m) : 32, nr = rows > 16 ? 2 : 1;
        const uint16_t* x = (const uint16_t*)g->x + m * K;
        int64_t ldx = (int64_t)K * 2;
        if (rows % 16) {                                  /* only the last rows of the call: pad set */
            memset(pad, 0, (size_t)32 * K * 2);
            memcpy(pad, x, (size_t)rows * K * 2);
            __asm__ volatile("" : : "r"(pad) : "memory");  /* _tile_loadd's asm does not say it reads pad */
            x = pad;
        }
        for (int t = t0; t < t1; t += step) {
            const int np = I || t1 - t >= 2 ? 2 : 1;
            const uint16_t* wp = (const uint16_t*)g->wp + (int64_t)t * K * 16;
            const uint16_t* wq = wp + (int64_t)(I ? I : 16) * K;   /* u panel t + I/16, or panel t + 1 */
            /* whole tiles of float32 output go straight to it; the rest through cbuf */
            const int direct = !I && !g->out_bf16 && rows % 16 == 0 && 16 * (t + np) <= g->N;
            float* c = direct ? (float*)g->out + m * g->N + 16 * t : cbuf;
            const int64_t ldc = direct ? (int64_t)g->N * 4 : 128;
            if (nr == 2) { if (np == 2) amx_22(x, ldx, wp, wq, K, c, ldc); else amx_21(x, ldx, wp, wq, K, c, ldc); }
            else { if (np == 2) amx_12(x, ldx, wp, wq, K, c, ldc); else amx_11(x, ldx, wp, wq, K, c, ldc); }
            if (direct) continue;
            if (I) {                              /* row r: g in cbuf[32 r, +16), u in cbuf[32 r + 16, +16) */
                for (int r = 0; r < rows; r++)
                    v_store_bf16((uint16_t*)g->out + (m + r) * I + 16 * t,
                                 v_silu_mul(v_load(cbuf + r * 32), v_load(cbuf + r * 32 + 16)));
                continue;
            }
            for (int r = 0; r < rows; r++)
                for (int p = 0; p < np; p++) {
                    int col = 16 * (t + p), ncols = g->N - col < 16 ? g->N - col : 16;
                    store_out(g->out, g->out_bf16, (m + r) * g->N + col, ncols, v_load(cbuf + r * 32 + 16 * p));
                }
        }
    }
    _tile_release();
}
#endif
#endif
