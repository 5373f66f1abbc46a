/* Move KV rows between cache slots in every layer, re-positioning the keys (RoPE rotation):
 * the native form of streamkv.runner.kv_ops.KVOps.copy, all ranges of a call at once.
 *
 * k, v    [L, S, H, D] bfloat16 (bf16 = 1) or float32 caches, contiguous
 * src,dst [N] slots; row i of every layer goes from src[i] to dst[i] (no dst slot is a src slot:
 *         KVOps.copy stages an overlapping move, see streamkv_kv_move_between)
 * cs      [N, D/2, 2] float32 (cos, sin) of row i's shift per frequency, or NULL (no rotation)
 *
 * Keys use the rotate-half layout (x1 = x[:D/2], x2 = x[D/2:]); in float32, rounded once:
 *
 *     out1 = x1 * cos - x2 * sin        out2 = x2 * cos + x1 * sin
 *
 * Values carry no position: copied as they are. One pass over the rows, parallel over
 * (layer, row) pairs; each output element is computed by one thread in a fixed order, so
 * the result does not depend on the thread count.
 */
#include <stdint.h>
#include <string.h>

static inline float bf(uint16_t x) {
    uint32_t bits = (uint32_t)x << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint16_t to_bf(float f) { /* round to nearest even, like torch's .to(bfloat16) */
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40);
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

static void rotate_bf16(const uint16_t *x, uint16_t *y, const float *cs, int half) {
    for (int j = 0; j < half; j++) {
        float c = cs[2 * j], s = cs[2 * j + 1];
        float x1 = bf(x[j]), x2 = bf(x[j + half]);
        float a = x1 * c, b = x2 * s, e = x2 * c, f = x1 * s;
        y[j] = to_bf(a - b);
        y[j + half] = to_bf(e + f);
    }
}

static void rotate_f32(const float *x, float *y, const float *cs, int half) {
    for (int j = 0; j < half; j++) {
        float c = cs[2 * j], s = cs[2 * j + 1];
        float x1 = x[j], x2 = x[j + half];
        float a = x1 * c, b = x2 * s, e = x2 * c, f = x1 * s;
        y[j] = a - b;
        y[j + half] = e + f;
    }
}

/* Rows src[i] of (ks, vs) [L, src_slots, H, D] -> rows dst[i] of (kd, vd) [L, dst_slots, H, D]. The
 * two pairs may be the same tensors only when no dst slot is also a src slot (threads run over
 * rows in any order): an in-place move whose ranges overlap goes through a staging copy
 * (streamkv_kv_move_between with the staged rows as the source; the same arithmetic, the same bits). */
int streamkv_kv_move_between(int bf16, const void *ks, const void *vs, int64_t src_slots, void *kd, void *vd,
                             int64_t dst_slots, int layers, int heads, int dim,
                             const int64_t *src, const int64_t *dst, int64_t n, const float *cs) {
    if (dim % 2 || layers < 1 || heads < 1 || n < 0) return 1;
    const int64_t row = (int64_t)heads * dim, esz = bf16 ? 2 : 4;
    const int half = dim / 2;
    for (int64_t i = 0; i < n; i++)
        if (src[i] < 0 || src[i] >= src_slots || dst[i] < 0 || dst[i] >= dst_slots) return 2;
    const char *ksb = (const char *)ks, *vsb = (const char *)vs;
    char *kdb = (char *)kd, *vdb = (char *)vd;
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < (int64_t)layers * n; t++) {
        int64_t l = t / n, i = t % n;
        int64_t so = (l * src_slots + src[i]) * row, d = (l * dst_slots + dst[i]) * row;
        memcpy(vdb + d * esz, vsb + so * esz, row * esz);
        if (cs == NULL) {
            memcpy(kdb + d * esz, ksb + so * esz, row * esz);
            continue;
        }
        const float *c = cs + i * dim;  /* half pairs of (cos, sin) */
        for (int h = 0; h < heads; h++) {
            if (bf16)
                rotate_bf16((const uint16_t *)ksb + so + h * dim, (uint16_t *)kdb + d + h * dim, c, half);
            else
                rotate_f32((const float *)ksb + so + h * dim, (float *)kdb + d + h * dim, c, half);
        }
    }
    return 0;
}

int streamkv_kv_move(int bf16, void *k, void *v, int layers, int64_t slots, int heads, int dim,
                     const int64_t *src, const int64_t *dst, int64_t n, const float *cs) {
    return streamkv_kv_move_between(bf16, k, v, slots, k, v, slots, layers, heads, dim, src, dst, n, cs);
}
