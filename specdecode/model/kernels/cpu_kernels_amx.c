// bf16 GEMM on AMX tiles (Intel Sapphire Rapids and later) for the exact bf16 target: one kernel for every
// row count, so verification rows equal single-token rows bit for bit, at nearly the cost of one token.
//
// Why: on these Xeons vdpbf16ps runs at 1.6 G/s a core (benchmarks/kernels/instruction_rates.c), so the AVX512
// kernel's cost grows with the rows of a forward (1.5B target: 112 ms for one token, 192 for 8, 330 for 16).
// One tdpbf16ps multiplies a 16 x 32 tile of activations by a 32 x 16 tile of weights; a token's forward
// needs ~1/15 of the time its weights take to stream from memory, so up to 16 rows cost one row's time.
// oneDNN's AMX matmul is as fast but its blocking depends on the row count, so its rows differ in the last
// bits between a verification and a single-token forward; here each output is one tile chain over k in the
// same order whatever the number of rows (AMX computes each row of a tile from that row of A alone).
//
// y[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]): x rounded to bf16 first (as the AVX512 kernel takes it),
// fp32 accumulation in the tiles, the bias added to the fp32 sum before the one rounding of the output.
//
// Weights (`native_layouts.pack_bf16_amx`): output channels in groups of 64 (4 tiles of 16 columns), zero-
// padded; for each 32-wide step of k the group's 4 tiles of 1 KB are stored together: [N/64][K/32][4][16][16][2]
// with element (p, n, j) = w[64 g + 16 t + n][32 s + 2 p + j] (AMX's pairs of k). A group then streams as one
// sequential read, as the tiled int8 / int4 weights do.

#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define TARGET __attribute__((target("avx512f,avx512bw,avx512bf16,amx-tile,amx-bf16")))
#define COLS 64      // output channels per group (4 C tiles)
#define KSTEP 32     // k per tile step (16 pairs)
#define TILE_BYTES 1024
#ifndef PF_AHEAD
#define PF_AHEAD 2048  // bytes of the group's stream prefetched ahead into L2 (measured: 0-8 KB alike)
#endif
#ifndef PF_HINT
#define PF_HINT _MM_HINT_T1
#endif

typedef struct {  // the tile configuration (palette 1)
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tilecfg_t;

int amx_supported(void) {  // the CPU has AMX-BF16 and Linux grants this process the tile state
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("avx512bf16")) return 0;
    unsigned a, b, c, d;
    __asm__ volatile("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(7), "c"(0));
    if (!((d >> 22) & 1) || !((d >> 24) & 1)) return 0;  // AMX-BF16, AMX-TILE
    return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0;
}

static inline float bf16_to_f32(uint16_t v) {
    uint32_t u = (uint32_t)v << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {  // round to nearest even (no NaN inputs here)
    uint32_t u;
    memcpy(&u, &f, 4);
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

TARGET static void configure(int rows) {  // C tiles 0-3, A tile 4: `rows` rows; B tiles 5-7: 16 pairs
    tilecfg_t cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    for (int t = 0; t < 8; t++) {
        cfg.colsb[t] = 64;
        cfg.rows[t] = t < 5 ? (uint8_t)rows : 16;
    }
    _tile_loadconfig(&cfg);
}

// Group g's 64 outputs for rows [m0, m0 + rows) of x (bf16 [Mp, Kp], Kp a multiple of 32).
TARGET static void group_rows(const uint16_t* x, int64_t Kp, const uint16_t* wg, int64_t steps, float* c) {
    const int64_t stride = Kp * 2;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t s = 0; s < steps; s++) {
        const char* b = (const char*)(wg + s * (4 * TILE_BYTES / 2));
        for (int i = 0; i < 4 * TILE_BYTES; i += 64) _mm_prefetch(b + PF_AHEAD + i, PF_HINT);
        _tile_loadd(4, x + s * KSTEP, stride);
        _tile_loadd(5, b, 64);
        _tile_dpbf16ps(0, 4, 5);
        _tile_loadd(6, b + TILE_BYTES, 64);
        _tile_dpbf16ps(1, 4, 6);
        _tile_loadd(7, b + 2 * TILE_BYTES, 64);
        _tile_dpbf16ps(2, 4, 7);
        _tile_loadd(5, b + 3 * TILE_BYTES, 64);
        _tile_dpbf16ps(3, 4, 5);
    }
    _tile_stored(0, c, COLS * 4);  // c: fp32 [16, 64]
    _tile_stored(1, c + 16, COLS * 4);
    _tile_stored(2, c + 32, COLS * 4);
    _tile_stored(3, c + 48, COLS * 4);
}

// y = x w^T + bias, x bf16 or fp32 [M, K] (fp32 rounded to bf16), y bf16 or fp32 [M, N]; w packed as above.
TARGET void amx_bf16_gemm(const void* x, int x_is_f32, int64_t M, int64_t K, const uint16_t* w, const uint16_t* bias,
                          int64_t N, void* y, int y_is_f32, int threads) {
    const int64_t Kp = (K + KSTEP - 1) / KSTEP * KSTEP, steps = Kp / KSTEP, groups = (N + COLS - 1) / COLS;
    uint16_t* copy = NULL;  // x as bf16 [M, Kp] when it is fp32 or K is not a multiple of 32
    const uint16_t* xb = (const uint16_t*)x;
    if (x_is_f32 || Kp != K) {
        copy = (uint16_t*)calloc((size_t)(M * Kp), sizeof(uint16_t));
        for (int64_t m = 0; m < M; m++)
            for (int64_t k = 0; k < K; k++)
                copy[m * Kp + k] = x_is_f32 ? f32_to_bf16(((const float*)x)[m * K + k]) : xb[m * K + k];
        xb = copy;
    }
#pragma omp parallel num_threads(threads)
    {
        float c[16 * COLS] __attribute__((aligned(64)));
        int configured = 0;
#pragma omp for schedule(static)
        for (int64_t g = 0; g < groups; g++) {
            const uint16_t* wg = w + g * steps * (4 * TILE_BYTES / 2);
            for (int64_t m0 = 0; m0 < M; m0 += 16) {
                const int rows = M - m0 < 16 ? (int)(M - m0) : 16;
                if (rows != configured) {
                    configure(rows);
                    configured = rows;
                }
                group_rows(xb + m0 * Kp, Kp, wg, steps, c);
                for (int i = 0; i < rows; i++)
                    for (int n = 0; n < COLS && g * COLS + n < N; n++) {
                        const int64_t col = g * COLS + n;
                        const float v = c[i * COLS + n] + (bias ? bf16_to_f32(bias[col]) : 0.0f);
                        if (y_is_f32)
                            ((float*)y)[(m0 + i) * N + col] = v;
                        else
                            ((uint16_t*)y)[(m0 + i) * N + col] = f32_to_bf16(v);
                    }
            }
        }
        if (configured) _tile_release();
    }
    free(copy);
}
