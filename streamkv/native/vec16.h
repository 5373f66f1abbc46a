/* 16-float vectors for the batch-invariant kernels (inv_gemm.c, inv_attn.c).
 *
 * One type, v16, on every x86 CPU: a zmm with AVX-512F, two ymm with AVX2+FMA, a plain array
 * elsewhere. Every operation is lane-wise IEEE arithmetic with one rounding (v_fma is a fused
 * multiply-add), and the two reductions have a fixed order:
 *
 *   v_hsum(a):  t[i] = a[i] + a[i + 8]   (i < 8)
 *               u[i] = t[i] + t[i + 4]   (i < 4)
 *               w[i] = u[i] + u[i + 2]   (i < 2)
 *               sum  = w[0] + w[1]
 *   v_hmax(a) = the largest lane (exact in any order)
 *
 * so a kernel built from them computes each output element with the same sequence of roundings
 * whatever else it computes in the same call. These files are compiled WITHOUT -ffast-math
 * (see streamkv/native/__init__.py): no reassociation, no contraction the code did not write.
 */
#ifndef STREAMKV_VEC16_H
#define STREAMKV_VEC16_H
#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

static inline float bf16_to_f32(uint16_t h) { uint32_t u = ((uint32_t)h) << 16; float f; memcpy(&f, &u, 4); return f; }

/* round to nearest even (finite values; NaN stays NaN) */
static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

#if defined(__AVX512F__)
#define STREAMKV_VEC_ISA "avx512f"
typedef __m512 v16;
static inline v16 v_zero(void) { return _mm512_setzero_ps(); }
static inline v16 v_set1(float a) { return _mm512_set1_ps(a); }
static inline v16 v_load(const float* p) { return _mm512_loadu_ps(p); }
static inline v16 v_load_bf16(const uint16_t* p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}
static inline void v_store(float* p, v16 a) { _mm512_storeu_ps(p, a); }
/* 16 lanes of bf16 pairs -> each pair's low (even) and high (odd) element as float32, exact */
static inline void v_bf16_pairs(__m512i v, v16* even, v16* odd) {
    *even = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
    *odd = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32((int)0xFFFF0000)));
}
static inline v16 v_fma(v16 a, v16 b, v16 c) { return _mm512_fmadd_ps(a, b, c); }
static inline v16 v_mul(v16 a, v16 b) { return _mm512_mul_ps(a, b); }
static inline v16 v_add(v16 a, v16 b) { return _mm512_add_ps(a, b); }
static inline v16 v_sub(v16 a, v16 b) { return _mm512_sub_ps(a, b); }
static inline v16 v_max(v16 a, v16 b) { return _mm512_max_ps(a, b); }
static inline v16 v_div(v16 a, v16 b) { return _mm512_div_ps(a, b); }
/* lane-wise x < 0 ? a : b */
static inline v16 v_neg_select(v16 x, v16 a, v16 b) {
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ), b, a);
}
static inline v16 v_round(v16 a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
/* a * 2^n for integral n in [-126, 127] */
static inline v16 v_ldexp(v16 a, v16 n) {
    __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(a, _mm512_castsi512_ps(e));
}
static inline float v_hsum(v16 a) {
    __m256 t = _mm256_add_ps(_mm512_castps512_ps256(a), _mm512_extractf32x8_ps(a, 1));
    __m128 u = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
    __m128 w = _mm_add_ps(u, _mm_movehl_ps(u, u));
    return _mm_cvtss_f32(_mm_add_ss(w, _mm_shuffle_ps(w, w, 1)));
}
static inline float v_hmax(v16 a) { return _mm512_reduce_max_ps(a); }
#elif defined(__AVX2__) && defined(__FMA__)
#define STREAMKV_VEC_ISA "avx2"
typedef struct { __m256 lo, hi; } v16;
static inline v16 v_zero(void) { v16 r = {_mm256_setzero_ps(), _mm256_setzero_ps()}; return r; }
static inline v16 v_set1(float a) { v16 r = {_mm256_set1_ps(a), _mm256_set1_ps(a)}; return r; }
static inline v16 v_load(const float* p) { v16 r = {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; return r; }
static inline __m256 bf8(const uint16_t* p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}
static inline v16 v_load_bf16(const uint16_t* p) { v16 r = {bf8(p), bf8(p + 8)}; return r; }
static inline void v_store(float* p, v16 a) { _mm256_storeu_ps(p, a.lo); _mm256_storeu_ps(p + 8, a.hi); }
#define V2(EXPR_LO, EXPR_HI) do { v16 r = {EXPR_LO, EXPR_HI}; return r; } while (0)
static inline v16 v_fma(v16 a, v16 b, v16 c) { V2(_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)); }
static inline v16 v_mul(v16 a, v16 b) { V2(_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)); }
static inline v16 v_add(v16 a, v16 b) { V2(_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)); }
static inline v16 v_sub(v16 a, v16 b) { V2(_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)); }
static inline v16 v_max(v16 a, v16 b) { V2(_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)); }
static inline v16 v_div(v16 a, v16 b) { V2(_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)); }
#define NEG(x) _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_LT_OQ)
static inline v16 v_neg_select(v16 x, v16 a, v16 b) {
    V2(_mm256_blendv_ps(b.lo, a.lo, NEG(x.lo)), _mm256_blendv_ps(b.hi, a.hi, NEG(x.hi)));
}
#undef NEG
#define RND(x) _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
static inline v16 v_round(v16 a) { V2(RND(a.lo), RND(a.hi)); }
static inline __m256 ldexp8(__m256 a, __m256 n) {
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(a, _mm256_castsi256_ps(e));
}
static inline v16 v_ldexp(v16 a, v16 n) { V2(ldexp8(a.lo, n.lo), ldexp8(a.hi, n.hi)); }
static inline float v_hsum(v16 a) {
    __m256 t = _mm256_add_ps(a.lo, a.hi);
    __m128 u = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
    __m128 w = _mm_add_ps(u, _mm_movehl_ps(u, u));
    return _mm_cvtss_f32(_mm_add_ss(w, _mm_shuffle_ps(w, w, 1)));
}
static inline float v_hmax(v16 a) {
    float t[16];
    v_store(t, a);
    float m = t[0];
    for (int i = 1; i < 16; i++) m = t[i] > m ? t[i] : m;
    return m;
}
#undef RND
#undef V2
#else
#define STREAMKV_VEC_ISA "scalar"
typedef struct { float f[16]; } v16;
#define LANES(EXPR) do { v16 r; for (int i = 0; i < 16; i++) r.f[i] = (EXPR); return r; } while (0)
static inline v16 v_zero(void) { LANES(0.f); }
static inline v16 v_set1(float a) { LANES(a); }
static inline v16 v_load(const float* p) { LANES(p[i]); }
static inline v16 v_load_bf16(const uint16_t* p) { LANES(bf16_to_f32(p[i])); }
static inline void v_store(float* p, v16 a) { memcpy(p, a.f, sizeof a.f); }
static inline v16 v_fma(v16 a, v16 b, v16 c) { LANES(fmaf(a.f[i], b.f[i], c.f[i])); }
static inline v16 v_mul(v16 a, v16 b) { LANES(a.f[i] * b.f[i]); }
static inline v16 v_add(v16 a, v16 b) { LANES(a.f[i] + b.f[i]); }
static inline v16 v_sub(v16 a, v16 b) { LANES(a.f[i] - b.f[i]); }
static inline v16 v_max(v16 a, v16 b) { LANES(a.f[i] > b.f[i] ? a.f[i] : b.f[i]); }
static inline v16 v_div(v16 a, v16 b) { LANES(a.f[i] / b.f[i]); }
static inline v16 v_neg_select(v16 x, v16 a, v16 b) { LANES(x.f[i] < 0.f ? a.f[i] : b.f[i]); }
static inline v16 v_round(v16 a) { LANES(nearbyintf(a.f[i])); }
static inline v16 v_ldexp(v16 a, v16 n) { LANES(ldexpf(a.f[i], (int)n.f[i])); }
static inline float v_hsum(v16 a) {
    float t[8], u[4];
    for (int i = 0; i < 8; i++) t[i] = a.f[i] + a.f[i + 8];
    for (int i = 0; i < 4; i++) u[i] = t[i] + t[i + 4];
    return (u[0] + u[2]) + (u[1] + u[3]);
}
static inline float v_hmax(v16 a) {
    float m = a.f[0];
    for (int i = 1; i < 16; i++) m = a.f[i] > m ? a.f[i] : m;
    return m;
}
#undef LANES
#endif

/* v_hsum of four vectors at once, with exactly v_hsum's tree for each (so either may be used
 * for any element): out[i] = v_hsum(a_i). */
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#if defined(__AVX512F__)
static inline __m256 hsum_t(v16 a) { return _mm256_add_ps(_mm512_castps512_ps256(a), _mm512_extractf32x8_ps(a, 1)); }
#else
static inline __m256 hsum_t(v16 a) { return _mm256_add_ps(a.lo, a.hi); }
#endif
static inline void v_hsum4(v16 a0, v16 a1, v16 a2, v16 a3, float* out) {
    __m256 t0 = hsum_t(a0), t1 = hsum_t(a1), t2 = hsum_t(a2), t3 = hsum_t(a3);
    /* u[i] = t[i] + t[i + 4]: [u0 | u1] and [u2 | u3] */
    __m256 u01 = _mm256_add_ps(_mm256_permute2f128_ps(t0, t1, 0x20), _mm256_permute2f128_ps(t0, t1, 0x31));
    __m256 u23 = _mm256_add_ps(_mm256_permute2f128_ps(t2, t3, 0x20), _mm256_permute2f128_ps(t2, t3, 0x31));
    /* w[i] = u[i] + u[i + 2]: lane 0 (w0_0 w0_1 w2_0 w2_1), lane 1 (w1_0 w1_1 w3_0 w3_1) */
    __m256 w = _mm256_add_ps(_mm256_shuffle_ps(u01, u23, _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm256_shuffle_ps(u01, u23, _MM_SHUFFLE(3, 2, 3, 2)));
    /* s = w0 + w1: lane 0 (s0 s2 s0 s2), lane 1 (s1 s3 s1 s3) */
    __m256 r = _mm256_add_ps(_mm256_shuffle_ps(w, w, _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm256_shuffle_ps(w, w, _MM_SHUFFLE(3, 1, 3, 1)));
    float t[8];
    _mm256_storeu_ps(t, r);
    out[0] = t[0]; out[1] = t[4]; out[2] = t[1]; out[3] = t[5];
}
#else
static inline void v_hsum4(v16 a0, v16 a1, v16 a2, v16 a3, float* out) {
    out[0] = v_hsum(a0); out[1] = v_hsum(a1); out[2] = v_hsum(a2); out[3] = v_hsum(a3);
}
#endif

/* exp(x) for x <= 0 (inputs below -87 give exp(-87)): 2^n * p(f), f = (x log2e - n) ln2, |f| <= ln2/2. */
static inline v16 v_exp(v16 x) {
    x = v_max(x, v_set1(-87.f));
    v16 t = v_mul(x, v_set1(1.44269504088896341f));
    v16 n = v_round(t);
    v16 f = v_mul(v_sub(t, n), v_set1(0.69314718055994531f));
    v16 p = v_set1(1.f / 720.f);
    p = v_fma(p, f, v_set1(1.f / 120.f));
    p = v_fma(p, f, v_set1(1.f / 24.f));
    p = v_fma(p, f, v_set1(1.f / 6.f));
    p = v_fma(p, f, v_set1(0.5f));
    p = v_fma(p, f, v_set1(1.f));
    p = v_fma(p, f, v_set1(1.f));
    return v_ldexp(p, n);
}

/* silu(g) * u, silu(g) = g * sigmoid(g) with sigmoid from exp(-|g|): the one definition for
 * layer.c's pass over a gate_up output and inv_gemm.c's fused epilogue (the same bits) */
static inline v16 v_silu_mul(v16 g, v16 u) {
    const v16 e = v_exp(v_neg_select(g, g, v_sub(v_zero(), g)));        /* exp(-|g|) */
    const v16 one = v_set1(1.f);
    const v16 sig = v_div(v_neg_select(g, e, one), v_add(one, e));
    return v_mul(v_mul(g, sig), u);
}

/* 16 lanes rounded to bf16 exactly as f32_to_bf16 does (nearest even; NaN stays NaN). */
#if defined(__AVX512F__)
static inline void v_store_bf16(uint16_t* p, v16 a) {
    const __m512i u = _mm512_castps_si512(a), hi = _mm512_srli_epi32(u, 16);
    __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_and_si512(hi, _mm512_set1_epi32(1)),
                                                    _mm512_set1_epi32(0x7fff)));
    r = _mm512_srli_epi32(r, 16);
    r = _mm512_mask_or_epi32(r, _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q), hi, _mm512_set1_epi32(0x40));
    _mm256_storeu_si256((__m256i*)p, _mm512_cvtepi32_epi16(r));
}
#else
static inline void v_store_bf16(uint16_t* p, v16 a) {
    float t[16];
    v_store(t, a);
    for (int i = 0; i < 16; i++) p[i] = f32_to_bf16(t[i]);
}
#endif

/* The same exp for one value (lane 0 of the vector function, so scalar and vector agree). */
static inline float s_exp(float x) {
    float t[16];
    v_store(t, v_exp(v_set1(x)));
    return t[0];
}
#endif
