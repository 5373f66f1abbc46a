/* How a GEMM's (row block, unit of panels) items go to the threads (inv_gemm.c, deq_gemm.c). Only
 * the work split: every element keeps its chain, so no choice here changes a bit. */
#ifndef STREAMKV_UNITS_H
#define STREAMKV_UNITS_H

#include <stdint.h>

/* the panels of the busiest thread when NMB row blocks x units of P of the T panels go to the
 * threads as a static schedule deals them (contiguous shares, the first n % threads one item more) */
static inline int64_t busiest(int T, int64_t NMB, int P, int threads) {
    const int U = (T + P - 1) / P;
    const int64_t n = NMB * U;
    int64_t worst = 0, i = 0;
    for (int t = 0; t < threads; t++) {
        int64_t load = 0;
        for (int64_t j = n / threads + (t < n % threads); j > 0; j--, i++)
            load += i % U == U - 1 ? T - (int64_t)(U - 1) * P : P;
        worst = load > worst ? load : worst;
    }
    return worst;
}

/* panels per unit: of lo .. hi, the one whose busiest thread gets the fewest panels, the larger on
 * ties (hi wherever the items already split evenly). A static split of uneven units left a thread
 * idle: the 576 -> 960 QKV GEMM on 2 threads made 15 units of 4 panels (deq_gemm.c; 20 of 3 now:
 * 1-7% less at 1-4 rows on a 2-thread AVX2 EPYC), and N = 576 in a 17-96-row step (one row block)
 * 5 units of 8 (inv_gemm.c; 24 panels on one thread, 12 on the other; 6 units of 6 now: 4-9% less
 * at 24-96 rows). */
static inline int balanced_units(int T, int64_t NMB, int lo, int hi, int threads) {
    int best = hi;
    int64_t least = busiest(T, NMB, hi, threads);
    for (int P = hi - 1; P >= lo; P--) {
        const int64_t load = busiest(T, NMB, P, threads);
        if (load < least) { best = P; least = load; }
    }
    return best;
}

#endif  /* STREAMKV_UNITS_H */
