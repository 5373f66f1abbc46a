/* The machine's float32 FMA ceiling, register-only: no memory traffic, nothing else in the loop.
 *
 *   peak   C independent accumulator chains per thread, a = fma(a, b, c), widest vectors the
 *          build has (AVX-512: 16 lanes, AVX2 + FMA: 8), every thread of OpenMP; best of 5
 *   lat    one dependent chain: nanoseconds per fma (its latency at the clock it runs at)
 *
 * A loop with fewer chains than latency x fma ports runs below the peak whatever else it does
 * (4 chains reach half of it on a 4-cycle fma with 2 ports). The clock moves with the load on
 * the host (3.0-3.9 GHz on the 2-vCPU AMD EPYC), so the peak is measured in the same run as the
 * figures it bounds. Printed as one JSON line:
 *   {"isa": ..., "threads": T, "peak_gflops": {"4": .., "8": .., "12": ..}, "fma_latency_ns": ..}
 *   bf16   (AVX512-BF16 builds only) the same loop of vdpbf16ps, 12 chains: 64 FLOP per instruction
 *          (16 lanes x 2 products x 2). On Intel Xeons without AMX it runs at half the float32 FMA
 *          rate (207 vs 422 GFLOP/s, 2 vCPUs, 2026-12-06), on the AMD Zen 4 at about the same rate:
 *          which of bf16 and float32 arithmetic a CPU does faster is measured, not assumed.
 * Built and run by benchmarks/common.py (measure_ceilings). */
#include <omp.h>
#include <stdio.h>

#if defined(__AVX512F__)
#include <immintrin.h>
typedef __m512 V;
#define LANES 16
#define ISA "avx512"
static inline V vset(float x) { return _mm512_set1_ps(x); }
static inline V vfma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
static inline float vfirst(V a) { return _mm512_cvtss_f32(a); }
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
typedef __m256 V;
#define LANES 8
#define ISA "avx2"
static inline V vset(float x) { return _mm256_set1_ps(x); }
static inline V vfma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
static inline float vfirst(V a) { return _mm256_cvtss_f32(a); }
#else
typedef float V;
#define LANES 1
#define ISA "scalar"
static inline V vset(float x) { return x; }
static inline V vfma(V a, V b, V c) { return __builtin_fmaf(a, b, c); }
static inline float vfirst(V a) { return a; }
#endif

#define N_ITER 20000000L

/* C chains, each a named variable so that all stay in registers (an array of them spilled) */
#define D(i) V a##i = vset(0.5f + i);
#define F(i) a##i = vfma(a##i, b, c);
#define S(i) sink += vfirst(a##i);
#define L4(M) M(0) M(1) M(2) M(3)
#define L8(M) L4(M) M(4) M(5) M(6) M(7)
#define L12(M) L8(M) M(8) M(9) M(10) M(11)
#define CHAINS(C)                                                                            \
    static double run##C(void) {                                                             \
        double best = 0;                                                                     \
        for (int rep = 0; rep < 5; rep++) {                                                  \
            float sink = 0;                                                                  \
            double t = omp_get_wtime();                                                      \
            _Pragma("omp parallel reduction(+ : sink)") {                                    \
                const V b = vset(0.99999f), c = vset(1e-6f);                                 \
                L##C(D)                                                                      \
                for (long n = 0; n < N_ITER; n++) {                                          \
                    L##C(F)                                                                  \
                    __asm__ volatile("" : "+x"(a0));                                         \
                }                                                                            \
                L##C(S)                                                                      \
            }                                                                                \
            t = omp_get_wtime() - t;                                                         \
            const double g = omp_get_max_threads() * (double)N_ITER * C * LANES * 2 / t / 1e9; \
            if (g > best) best = g;                                                          \
            if (sink == 12345.f) printf("#");                                                \
        }                                                                                    \
        return best;                                                                         \
    }
CHAINS(4)
CHAINS(8)
CHAINS(12)

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#define BD(i) __m512 d##i = _mm512_set1_ps(0.5f + i);
#define BF(i) d##i = _mm512_dpbf16_ps(d##i, xb, yb);
#define BS(i) sink += _mm512_cvtss_f32(d##i);
static double bf16_dot_peak(void) {
    double best = 0;
    for (int rep = 0; rep < 5; rep++) {
        float sink = 0;
        double t = omp_get_wtime();
        #pragma omp parallel reduction(+ : sink)
        {
            const __m512bh xb = (__m512bh)_mm512_set1_epi32(0x3f803f80), yb = (__m512bh)_mm512_set1_epi32(0x33d633d6);
            L12(BD)
            for (long n = 0; n < N_ITER; n++) {
                L12(BF)
                __asm__ volatile("" : "+v"(d0));
            }
            L12(BS)
        }
        t = omp_get_wtime() - t;
        const double g = omp_get_max_threads() * (double)N_ITER * 12 * 64 / t / 1e9;
        if (g > best) best = g;
        if (sink == 12345.f) printf("#");
    }
    return best;
}
#endif

static double latency_ns(void) {
    V a = vset(0.5f), b = vset(0.99999f), c = vset(1e-6f);
    double t = omp_get_wtime();
    for (long n = 0; n < N_ITER; n++) {
        a = vfma(a, b, c);
        __asm__ volatile("" : "+x"(a));
    }
    t = omp_get_wtime() - t;
    if (vfirst(a) == 12345.f) printf("#");
    return t / N_ITER * 1e9;
}

int main(void) {
    const double p4 = run4(), p8 = run8(), p12 = run12(), lat = latency_ns();
    double bf = -1;
#if defined(__AVX512BF16__) && defined(__AVX512F__)
    bf = bf16_dot_peak();
#endif
    printf("{\"isa\": \"%s\", \"threads\": %d, \"peak_gflops\": {\"4\": %.1f, \"8\": %.1f, \"12\": %.1f}, "
           "\"fma_latency_ns\": %.3f, \"bf16_dot_peak_gflops\": %.1f}\n", ISA, omp_get_max_threads(), p4, p8, p12, lat, bf);
    return 0;
}
