/* Decode attention over a paged KV cache (one query row per sequence), for CPUs.
 *
 * q     [B, H, D] float32          one decode row per sequence
 * k, v  [S, Hk, D] bf16 or f32     the paged cache of one layer (slot-major)
 * slots [sum_b L_b] int64          context slots of sequence b at offsets[b] .. offsets[b+1]
 * out   [B, H, D] float32
 *
 * Work items = (sequence, kv head, chunk of the context): each computes a partial softmax
 * (max, sum, weighted V) for its G = H / Hk query heads; partials are merged per head
 * (split-K / flash-decoding). The bf16 head_dim-64 path makes one item per (sequence, chunk)
 * for all H heads, reading each slot's Hk heads together (contiguous) and prefetching ahead.
 * Parallel with OpenMP (the process' libgomp, shared with torch).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline float bf2f(uint16_t h) { uint32_t u = ((uint32_t)h) << 16; float f; memcpy(&f, &u, 4); return f; }

#define DEFINE_CHUNK(NAME, T, LOAD)                                                            \
static void NAME(const float* q, const T* kc, const T* vc, const int64_t* slots, int64_t n,    \
                 int Hk, int hk, int G, int D, float scale, float* m, float* s, float* acc,    \
                 float* sc) {                                                                  \
    float row[512];                                                                           \
    for (int g = 0; g < G; g++) m[g] = -INFINITY;                                              \
    for (int64_t i = 0; i < n; i++) {                                                         \
        const T* k = kc + (slots[i] * Hk + hk) * D;                                           \
        for (int d = 0; d < D; d++) row[d] = LOAD(k[d]);                                      \
        for (int g = 0; g < G; g++) {                                                          \
            const float* qg = q + g * D;                                                       \
            float x = 0.f;                                                                     \
            for (int d = 0; d < D; d++) x += qg[d] * row[d];                                   \
            x *= scale;                                                                        \
            sc[g * n + i] = x;                                                                 \
            if (x > m[g]) m[g] = x;                                                            \
        }                                                                                      \
    }                                                                                          \
    for (int g = 0; g < G; g++) {                                                              \
        float tot = 0.f;                                                                       \
        for (int64_t i = 0; i < n; i++) { float e = expf(sc[g * n + i] - m[g]); sc[g * n + i] = e; tot += e; } \
        s[g] = tot;                                                                            \
    }                                                                                          \
    memset(acc, 0, sizeof(float) * G * D);                                                     \
    for (int64_t i = 0; i < n; i++) {                                                         \
        const T* v = vc + (slots[i] * Hk + hk) * D;                                           \
        for (int d = 0; d < D; d++) row[d] = LOAD(v[d]);                                      \
        for (int g = 0; g < G; g++) {                                                          \
            float p = sc[g * n + i];                                                           \
            float* a = acc + g * D;                                                            \
            for (int d = 0; d < D; d++) a[d] += p * row[d];                                    \
        }                                                                                      \
    }                                                                                          \
}

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>

#include "simd.h"

/* sc[0..n) <- exp(sc - mx); returns the sum. */
static inline float exp_sum(float* sc, int64_t n, float mx) {
    __m512 vm = _mm512_set1_ps(mx), tot = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m512 e = exp_neg(_mm512_sub_ps(_mm512_loadu_ps(sc + i), vm));
        _mm512_storeu_ps(sc + i, e);
        tot = _mm512_add_ps(tot, e);
    }
    float rest = 0.f;
    for (; i < n; i++) { float e = expf(sc[i] - mx); sc[i] = e; rest += e; }
    return _mm512_reduce_add_ps(tot) + rest;
}
/* Paged blocks are scattered, so hardware prefetchers (which stop at 4 KiB pages) lag:
 * fetch the item's heads of the slot PREFETCH keys ahead explicitly (128 bytes = 2 cache
 * lines per head). */
#define PREFETCH 16
static inline void prefetch_heads(const uint16_t* p, int nh) {
    for (int l = 0; l < 2 * nh; l++) _mm_prefetch((const char*)(p + 32 * l), _MM_HINT_T0);
}

/* bf16 cache, head_dim 64: kv heads [hk0, hk0 + nh) of one sequence, their nh * G query rows
 * (<= 16) in one item, with AVX512-BF16 dot products (q rounded to bf16: exact when the model
 * runs in bfloat16, as q comes from a bf16 projection). With every head of a slot in the item
 * (nh = Hk) keys are read in slot order, the slot's heads together (the contiguous Hk * 128
 * bytes), which streams the cache from DRAM at about twice the rate of per-head reads. */
static int chunk_bf16_d64(const float* q, const uint16_t* kc, const uint16_t* vc, const int64_t* slots,
                          int64_t n, int Hk, int hk0, int nh, int G, float scale, float* m, float* s, float* acc,
                          float* sc) {
    int R = nh * G;
    if (R > 16) return 0;
    __m512bh qv[16][2];
    for (int r = 0; r < R; r++) {
        const float* qr = q + r * 64;
        qv[r][0] = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(qr + 16), _mm512_loadu_ps(qr));
        qv[r][1] = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(qr + 48), _mm512_loadu_ps(qr + 32));
        m[r] = -INFINITY;
    }
    for (int64_t i = 0; i < n; i++) {
        const uint16_t* k = kc + (slots[i] * Hk + hk0) * 64;
        if (i + PREFETCH < n) prefetch_heads(kc + (slots[i + PREFETCH] * Hk + hk0) * 64, nh);
        for (int x = 0; x < nh; x++) {
            __m512bh k0 = (__m512bh)_mm512_loadu_si512((const void*)(k + x * 64));
            __m512bh k1 = (__m512bh)_mm512_loadu_si512((const void*)(k + x * 64 + 32));
            for (int g = 0; g < G; g++) {
                int r = x * G + g;
                __m512 a = _mm512_dpbf16_ps(_mm512_setzero_ps(), k0, qv[r][0]);
                a = _mm512_dpbf16_ps(a, k1, qv[r][1]);
                float v = _mm512_reduce_add_ps(a) * scale;
                sc[r * n + i] = v;
                if (v > m[r]) m[r] = v;
            }
        }
    }
    for (int r = 0; r < R; r++) s[r] = exp_sum(sc + r * n, n, m[r]);
    __m512 av[16][4];
    for (int r = 0; r < R; r++) for (int j = 0; j < 4; j++) av[r][j] = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i++) {
        const uint16_t* v = vc + (slots[i] * Hk + hk0) * 64;
        if (i + PREFETCH < n) prefetch_heads(vc + (slots[i + PREFETCH] * Hk + hk0) * 64, nh);
        for (int x = 0; x < nh; x++) {
            __m512 vf[4];
            for (int j = 0; j < 4; j++)
                vf[j] = _mm512_castsi512_ps(_mm512_slli_epi32(
                    _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(v + x * 64 + 16 * j))), 16));
            for (int g = 0; g < G; g++) {
                int r = x * G + g;
                __m512 p = _mm512_set1_ps(sc[r * n + i]);
                for (int j = 0; j < 4; j++) av[r][j] = _mm512_fmadd_ps(p, vf[j], av[r][j]);
            }
        }
    }
    for (int r = 0; r < R; r++) for (int j = 0; j < 4; j++) _mm512_storeu_ps(acc + r * 64 + 16 * j, av[r][j]);
    return 1;
}
#define FAST_BF16_D64 1
#else
#define FAST_BF16_D64 0
#endif

#define LOAD_BF16(x) bf2f(x)
#define LOAD_F32(x) (x)
DEFINE_CHUNK(chunk_bf16, uint16_t, LOAD_BF16)
DEFINE_CHUNK(chunk_f32, float, LOAD_F32)

static int run(int bf16, const float* q, const void* kc, const void* vc, const int64_t* slots,
               const int64_t* offsets, int64_t B, int H, int Hk, int D, float scale, int64_t chunk_len,
               float* out) {
    if (D > 512 || H % Hk != 0 || chunk_len <= 0) return 1;
    /* all-heads items (one per chunk, G = H rows) for the bf16 d64 path; else one per kv head */
    int all = FAST_BF16_D64 && bf16 && D == 64 && H <= 16;
    int G = all ? H : H / Hk, Hi = all ? 1 : Hk;
    int64_t* first = malloc(sizeof(int64_t) * (B + 1));  /* first item of each sequence */
    if (!first) return 3;
    first[0] = 0;
    for (int64_t b = 0; b < B; b++) {
        int64_t L = offsets[b + 1] - offsets[b];
        int64_t nc = L > 0 ? (L + chunk_len - 1) / chunk_len : 1;
        first[b + 1] = first[b] + Hi * nc;
    }
    int64_t items = first[B];
    float* M = malloc(sizeof(float) * items * G);
    float* S = malloc(sizeof(float) * items * G);
    float* A = malloc(sizeof(float) * items * G * D);
    if (!M || !S || !A) {
        free(first); free(M); free(S); free(A);
        return 3;
    }
    int nomem = 0;
    #pragma omp parallel for schedule(dynamic, 1)
    for (int64_t it = 0; it < items; it++) {
        int64_t b = 0;
        while (first[b + 1] <= it) b++;
        int64_t L = offsets[b + 1] - offsets[b];
        int64_t nc = (first[b + 1] - first[b]) / Hi, local = it - first[b];
        int hk = (int)(local / nc);
        int64_t c = local % nc, l0 = c * chunk_len, l1 = l0 + chunk_len < L ? l0 + chunk_len : L;
        float* sc = malloc(sizeof(float) * G * (l1 > l0 ? l1 - l0 : 1));
        if (!sc) {
            #pragma omp atomic write
            nomem = 1;
            continue;
        }
        const float* qb = q + (b * H + hk * G) * D;
        int done = 0;
#if FAST_BF16_D64
        if (bf16 && D == 64)
            done = chunk_bf16_d64(qb, (const uint16_t*)kc, (const uint16_t*)vc, slots + offsets[b] + l0, l1 - l0,
                                  Hk, all ? 0 : hk, all ? Hk : 1, H / Hk, scale, M + it * G, S + it * G,
                                  A + it * G * D, sc);
#endif
        if (done)
            ;
        else if (bf16)
            chunk_bf16(qb, (const uint16_t*)kc, (const uint16_t*)vc, slots + offsets[b] + l0, l1 - l0, Hk, hk, G, D,
                       scale, M + it * G, S + it * G, A + it * G * D, sc);
        else
            chunk_f32(qb, (const float*)kc, (const float*)vc, slots + offsets[b] + l0, l1 - l0, Hk, hk, G, D,
                      scale, M + it * G, S + it * G, A + it * G * D, sc);
        free(sc);
    }
    /* merge (not after an item found no memory: out untouched, rc 3, never a crash) */
    for (int64_t b = 0; b < (nomem ? 0 : B); b++) {
        int64_t nc = (first[b + 1] - first[b]) / Hi;
        for (int hk = 0; hk < Hi; hk++) for (int g = 0; g < G; g++) {
            float mx = -INFINITY, tot = 0.f;
            float* o = out + (b * H + hk * G + g) * D;
            for (int64_t c = 0; c < nc; c++) { float x = M[(first[b] + hk * nc + c) * G + g]; if (x > mx) mx = x; }
            memset(o, 0, sizeof(float) * D);
            for (int64_t c = 0; c < nc; c++) {
                int64_t it = first[b] + hk * nc + c;
                if (M[it * G + g] == -INFINITY) continue;
                float w = expf(M[it * G + g] - mx);
                tot += S[it * G + g] * w;
                for (int d = 0; d < D; d++) o[d] += A[(it * G + g) * D + d] * w;
            }
            if (tot > 0.f) for (int d = 0; d < D; d++) o[d] /= tot;
        }
    }
    free(first); free(M); free(S); free(A);
    return nomem ? 3 : 0;
}

/* Returns 0; 1 shapes rejected; 3 no memory (out not written). */
int streamkv_decode_attn(int bf16, const float* q, const void* kc, const void* vc, const int64_t* slots,
                         const int64_t* offsets, int64_t B, int H, int Hk, int D, float scale,
                         int64_t chunk_len, float* out) {
    return run(bf16, q, kc, vc, slots, offsets, B, H, Hk, D, scale, chunk_len, out);
}
