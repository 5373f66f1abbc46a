/* The vpmultishiftqb control that spreads 16 bytes of 4-bit values over 32 words (q4_gemm.c,
 * deq_bf16.c): qword i of a 128-bit broadcast reads half (i % 2) of the 16 bytes; its words
 * 4i .. 4i + 3 take the low and high nibbles of bytes b, b + 1 of that half, b = i - i % 2. A vpermw
 * then looks each word's nibble up (it reads 5 index bits: tables hold their 16 entries twice). */
#ifndef STREAMKV_NIBBLES_H
#define STREAMKV_NIBBLES_H
#if defined(__AVX512VBMI__)
#include <immintrin.h>
#include <stdint.h>

static inline __m512i nibble_ctrl(void) {
    uint8_t c[64] = {0};
    for (int i = 0; i < 8; i++) {
        const int b = i - i % 2;
        c[8 * i + 0] = (uint8_t)(8 * b);
        c[8 * i + 2] = (uint8_t)(8 * b + 4);
        c[8 * i + 4] = (uint8_t)(8 * (b + 1));
        c[8 * i + 6] = (uint8_t)(8 * (b + 1) + 4);
    }
    return _mm512_loadu_si512((const void*)c);
}
#endif
#endif
