/* GGUF block dequantization into float32, one pass, bit-identical to the torch decoder
 * (streamkv/loading/gguf_decode.py) and to gguf-py:
 *
 *     Q8_0: d f16 | 32 x int8                          w[j] = d * q[j]
 *     Q4_0: d f16 | 16 bytes (j low, j + 16 high)      w[j] = d * (q[j] - 8)
 *     Q4_1: d f16 | m f16 | 16 bytes                   w[j] = d * q[j] + m
 *
 * raw  [B, size] bytes (size 34 / 18 / 20), out [B, 32] float32.
 * Every product d * q is exact in float32 (an 11-bit significand times an integer of at most
 * 8 bits), so each value rounds at most once (the + m), whatever the compiler contracts;
 * built without fast-math all the same. Blocks are independent: parallel over blocks.
 */
#include <stdint.h>
#include <string.h>

static inline float half_to_float(uint16_t h) { /* exact for every half, NaN payloads kept */
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, bits;
    if (exp == 0x1fu) {
        bits = sign | 0x7f800000u | (man << 13);
    } else if (exp != 0) {
        bits = sign | ((exp + 112u) << 23) | (man << 13);
    } else if (man == 0) {
        bits = sign;
    } else { /* subnormal: normalise */
        int e = -1;
        do { man <<= 1; e++; } while (!(man & 0x400u));
        bits = sign | ((uint32_t)(112 - e) << 23) | ((man & 0x3ffu) << 13);
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint16_t rd16(const uint8_t *p) { return (uint16_t)(p[0] | (p[1] << 8)); }

/* kind 0: Q8_0, 1: Q4_0, 2: Q4_1; returns -1 for an unknown kind */
int streamkv_gguf_dequant(int kind, const uint8_t *raw, int64_t blocks, float *out) {
    static const int size[3] = {34, 18, 20};
    if (kind < 0 || kind > 2 || blocks < 0) return -1;
    const int bs = size[kind];
#pragma omp parallel for schedule(static) if (blocks >= 4096)
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *p = raw + b * bs;
        float *w = out + b * 32, d = half_to_float(rd16(p));
        if (kind == 0) {
            const int8_t *q = (const int8_t *)(p + 2);
            for (int j = 0; j < 32; j++) w[j] = d * (float)q[j];
        } else if (kind == 1) {
            for (int j = 0; j < 16; j++) {
                w[j] = d * (float)((p[2 + j] & 15) - 8);
                w[j + 16] = d * (float)((p[2 + j] >> 4) - 8);
            }
        } else {
            float m = half_to_float(rd16(p + 2));
            for (int j = 0; j < 16; j++) {
                w[j] = d * (float)(p[4 + j] & 15) + m;
                w[j + 16] = d * (float)(p[4 + j] >> 4) + m;
            }
        }
    }
    return 0;
}
