/* AMX tiles for the invariant kernels (inv_gemm.c, inv_attn_bf16.c): compiled only for CPUs with
 * AMX-TILE, AMX-BF16 and AVX512-BF16 (-march=native there); elsewhere AMX stays undefined and the
 * callers keep their vector paths. */
#ifndef STREAMKV_AMX_H
#define STREAMKV_AMX_H
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define AMX 1
#include <immintrin.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

/* AMX tile data allowed for this process (ask once, before any parallel region; the kernel's
 * answer never changes afterwards) */
static int amx_enabled(void) {
    static int state = -1;
    if (state < 0) state = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    return state;
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileConfig;

/* this thread's tiles 0-7, 64 bytes a row: tiles 0-4 (C: m x 16 float32; A: m rows x 32 bf16) m
 * rows, 5-7 (B: 16 bf16 pairs, VNNI rows, x 16 columns) 16 rows. Each C element is computed from
 * its own A row alone, so m never changes a row's bits, only the work on rows nobody reads. */
static inline void amx_configure_rows(int m) {
    TileConfig c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int i = 0; i < 8; i++) { c.rows[i] = i < 5 ? (uint8_t)m : 16; c.colsb[i] = 64; }
    _tile_loadconfig(&c);
}

static inline void amx_configure(void) { amx_configure_rows(16); }
#endif
#endif
