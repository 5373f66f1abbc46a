/* Move KV rows between cache slots in every layer, re-positioning the keys (RoPE rotation):
 * the native form of streamkv.runner.kv_ops.KVOps.copy, all ranges of a call at once.
 *
 * k, v    [L, S, H, D] bfloat16 (bf16 = 1) or float32 caches, contiguous
 * src,dst [N] slots; row i of every layer goes from src[i] to dst[i] (a dst slot that is also a
 *         src slot: streamkv_kv_move_ordered, or a staged copy, see _kv_move in __init__.py)
 * cs      [N, D/2, 2] float32 (cos, sin) of row i's shift per frequency, or NULL (no rotation)
 *
 * Keys use the rotate-half layout (x1 = x[:D/2], x2 = x[D/2:]); in float32, rounded once:
 *
 *     out1 = x1 * cos - x2 * sin        out2 = x2 * cos + x1 * sin
 *
 * Values carry no position: copied as they are. One pass over the rows, parallel over
 * (layer, row) pairs (or (layer, k/v) for an ordered in-place move); each output element is computed by one thread in a fixed order, so
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

/* Row i of one layer of one of the caches: src slot so -> dst slot d (row elements each);
 * keys (cs != NULL) rotated by row i's (cos, sin). so == d is allowed (an in-place rotation
 * reads each pair before writing it; memmove for the copy). */
static inline void move_row(int bf16, const char *s, char *dd, int64_t so, int64_t d, int64_t row, int64_t esz,
                            const float *cs, int heads, int dim) {
    if (cs == NULL) {
        memmove(dd + d * esz, s + so * esz, row * esz);
        return;
    }
    for (int h = 0; h < heads; h++) {
        if (bf16)
            rotate_bf16((const uint16_t *)s + so + h * dim, (uint16_t *)dd + d + h * dim, cs, dim / 2);
        else
            rotate_f32((const float *)s + so + h * dim, (float *)dd + d + h * dim, cs, dim / 2);
    }
}

static int bad_slots(const int64_t *src, const int64_t *dst, int64_t n, int64_t src_slots, int64_t dst_slots) {
    for (int64_t i = 0; i < n; i++)
        if (src[i] < 0 || src[i] >= src_slots || dst[i] < 0 || dst[i] >= dst_slots) return 1;
    return 0;
}

/* Rows src[i] of (ks, vs) [L, src_slots, H, D] -> rows dst[i] of (kd, vd) [L, dst_slots, H, D]. The
 * two pairs may be the same tensors only when no dst slot is also a src slot (threads run over
 * rows in any order); an in-place move whose ranges overlap goes through streamkv_kv_move_ordered
 * or a staging copy (this function with the staged rows as the source). The same arithmetic,
 * the same bits, on every path. */
int streamkv_kv_move_between(int bf16, const void *ks, const void *vs, int64_t src_slots, void *kd, void *vd,
                             int64_t dst_slots, int layers, int heads, int dim,
                             const int64_t *src, const int64_t *dst, int64_t n, const float *cs) {
    if (dim % 2 || layers < 1 || heads < 1 || n < 0) return 1;
    if (bad_slots(src, dst, n, src_slots, dst_slots)) return 2;
    const int64_t row = (int64_t)heads * dim, esz = bf16 ? 2 : 4;
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < (int64_t)layers * n; t++) {
        int64_t l = t / n, i = t % n;
        int64_t so = (l * src_slots + src[i]) * row, d = (l * dst_slots + dst[i]) * row;
        move_row(bf16, (const char *)vs, (char *)vd, so, d, row, esz, NULL, heads, dim);
        move_row(bf16, (const char *)ks, (char *)kd, so, d, row, esz, cs == NULL ? NULL : cs + i * dim, heads, dim);
    }
    return 0;
}

/* The same move within one pair of caches [L, slots, H, D], rows taken in index order: row i is
 * read before row i is written, and before any row after it. A dst slot may so be a src slot,
 * provided the row that reads it comes no later than the row that writes it (an eviction
 * moving rows down: dst position < src position). Parallel over (layer, k or v) only, so no
 * staging copy: each element is still computed by one thread, by the same arithmetic. */
int streamkv_kv_move_ordered(int bf16, void *k, void *v, int layers, int64_t slots, int heads, int dim,
                             const int64_t *src, const int64_t *dst, int64_t n, const float *cs) {
    if (dim % 2 || layers < 1 || heads < 1 || n < 0) return 1;
    if (bad_slots(src, dst, n, slots, slots)) return 2;
    const int64_t row = (int64_t)heads * dim, esz = bf16 ? 2 : 4;
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < 2 * (int64_t)layers; t++) {
        const int is_k = (int)(t % 2);
        const int64_t l = t / 2;
        char *c = is_k ? (char *)k : (char *)v;
        for (int64_t i = 0; i < n; i++)
            move_row(bf16, c, c, (l * slots + src[i]) * row, (l * slots + dst[i]) * row, row, esz,
                     is_k && cs != NULL ? cs + i * dim : NULL, heads, dim);
    }
    return 0;
}
