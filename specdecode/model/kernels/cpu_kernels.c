// GEMMs, AVX512-BF16 / VNNI: weight-only int8 / int4, the model's own bf16 weights, int8 x int8
// (int8-dynamic) and fp32, tuned for a few rows of activations (decode and verification), bf16 and fp32 for
// prefill's many rows too; then RMSNorm, rope and SiLU-times-up for bf16 forwards, and attention (bf16 or fp32,
// any number of queries).
//
// y[m, n] = sum_k x[m, k] * w[n, k] with x in bf16 (fp32 inputs are rounded to bf16 first, as torch's
// weight-only kernels do) and fp32 accumulation. A block of 4 output channels is decoded once per 2 rows
// of x and stays in L1 for the next rows, so the weights stream from memory once per call. Each output
// element is computed by one thread in the same order whatever the number of rows, so a row's result
// does not depend on the other rows of the forward (speculative verification gives, bit for bit, the
// rows of single-token forwards). Threads split the output channels.
//
// int8: w[n, k] = q[n, k] * scale[n]; q int8 [N, K] in tiles of 4 rows (below); scale bf16 [N].
// int4: w[n, k] = (128 + q) * scale[n, g] + offset[n, g] for the group g = k / 128; q in 0..15, packed
//       [N, K / 2] bytes (layout below) in tiles of 4 rows; scale, offset: fp32 [N, K / 128] (offset =
//       minimum - 128 * scale).
//       sum x * w over a group is computed as scale * (sum x * (128 + q)) + offset * sum x.

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,avx512vnni")))

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

int cpu_supported(void) {  // every CPU with AVX512-BF16 (Cooper Lake, Sapphire Rapids, Zen 4) has VNNI too
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bf16") &&
           __builtin_cpu_supports("avx512vnni");
}

// x as bf16 [M, K]: the input itself (bf16) or a rounded copy (fp32); NULL if the copy is not needed.
static uint16_t* bf16_rows(const void* x, int x_is_f32, int64_t M, int64_t K) {
    if (!x_is_f32) return NULL;
    uint16_t* out = (uint16_t*)malloc((size_t)(M * K) * sizeof(uint16_t));
    const float* xf = (const float*)x;
    for (int64_t i = 0; i < M * K; i++) out[i] = f32_to_bf16(xf[i]);
    return out;
}

static inline void store(void* y, int y_is_f32, int64_t idx, float v) {
    if (y_is_f32)
        ((float*)y)[idx] = v;
    else
        ((uint16_t*)y)[idx] = f32_to_bf16(v);
}

// ---- int8 ------------------------------------------------------------------------------------------
// 64 weights are loaded at once and split into four vectors of 16 with in-lane byte shuffles (one mask
// for byte 3): byte j of each 32-bit lane, moved to the top byte, is the integer q * 2^24 (exact),
// converted to fp32. The sign-extending loads (vpmovsxbd) would be simpler but cross lanes and halve
// the decode rate on Zen 4.
// Lane i of vector j holds weight 4i + j of the chunk, so x is permuted to match once per call; the
// 2^-24 is folded into the channel's scale.

#define NR8 4  // output channels per block
#define MB8 2  // activation rows per pass over a block (4 x 4 decoded vectors + 2 x 4 accumulators + x)

// Row-major weights (bf16): software prefetch of the next block of rows into L2 while this one is computed.
// On the 2-core Zen 4 VMs it took the int8 kernel, row-major then, from ~21 to ~33 GB/s for rows of 1536 (L1
// prefetches: no gain; none: 16). Tiled weights (int8 x int8, weight-only int8 / int4) prefetch PF_AHEAD
// bytes ahead in their one stream instead.
#ifndef PF_HINT
#define PF_HINT _MM_HINT_T1
#endif
#define ALWAYS_INLINE TARGET static inline __attribute__((always_inline))
#define PF_AHEAD 4096  // one token: bytes of its own stream prefetched ahead (measured: 1-8 KB alike, none -5%)

ALWAYS_INLINE __m512 bf16x16_to_f32(__m256i v) {  // 16 bf16 numbers -> fp32 (exact)
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

ALWAYS_INLINE __m512 load_bf16x16(const uint16_t* p, __mmask16 m) {
    return bf16x16_to_f32(_mm256_maskz_loadu_epi16(m, p));
}

ALWAYS_INLINE __m512 round_bf16x16(__m512 v) {  // fp32 -> nearest bf16 (ties to even) -> fp32
    return bf16x16_to_f32((__m256i)_mm512_cvtneps_pbh(v));
}

// The sum of v's 16 lanes by a fixed tree (lanes i + (i + 8), then i + (i + 4), i + (i + 2), 0 + 1: GCC's
// _mm512_reduce_add_ps), spelled out so that `hsum16x16`, which sums 16 vectors at once by the same tree,
// gives the GEMMs' many-row passes the bits of their few-row passes whatever the compiler.
ALWAYS_INLINE float hsum16(__m512 v) {
    const __m256 h = _mm256_add_ps(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)),
                                   _mm512_castps512_ps256(v));
    const __m128 q = _mm_add_ps(_mm256_extractf128_ps(h, 1), _mm256_castps256_ps128(h));
    const __m128 p = _mm_add_ps(q, _mm_movehl_ps(q, q));
    return _mm_cvtss_f32(_mm_add_ss(p, _mm_movehdup_ps(p)));
}

static inline __mmask16 tail16(int64_t left) { return left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1u); }

// The row the block starting at n0 prefetches: ~6 KB of weights ahead (measured best for rows of 768 B to
// 9 KB), rounded to whole blocks; the last blocks prefetch themselves.
static inline int64_t prefetch_row(int64_t n0, int64_t rows_per_block, int64_t N, int64_t row_bytes) {
    int64_t blocks = 6144 / (rows_per_block * row_bytes);
    if (blocks < 1) blocks = 1;
    const int64_t row = n0 + blocks * rows_per_block;
    return row + rows_per_block <= N ? row : n0;
}

// One pass over NR8 output channels for MB rows of x (permuted fp32 [M, Kp]); MB is a constant after inlining.
// `tile`: the block's rows as `native_layouts.tile_rows(q, 4)` stores them (chunk c of row r at
// tile + (c * NR8 + r) * 64: one sequential stream, prefetched PF_AHEAD bytes ahead).
ALWAYS_INLINE void int8_pass(const int MB, const float* xp, int64_t Kp, int64_t K, const int8_t* tile,
                             float* out) {
    // vpshufb controls: byte j of each 32-bit lane to its top byte, zeros below (0x80 clears a byte); the
    // indices count bytes within each 128-bit lane, so dword d takes byte 4d + j.
    __m512i to_top[3];
#pragma GCC unroll 3
    for (int j = 0; j < 3; j++)
        to_top[j] = _mm512_broadcast_i32x4(_mm_set_epi32((int)(0x0C808080u + ((unsigned)j << 24)),
                                                         (int)(0x08808080u + ((unsigned)j << 24)),
                                                         (int)(0x04808080u + ((unsigned)j << 24)),
                                                         (int)(0x00808080u + ((unsigned)j << 24))));
    const __m512i top = _mm512_set1_epi32((int)0xFF000000u);
    __m512 acc[NR8][MB8];
#pragma GCC unroll 4
    for (int r = 0; r < NR8; r++)
#pragma GCC unroll 4
        for (int i = 0; i < MB; i++) acc[r][i] = _mm512_setzero_ps();
    for (int64_t k = 0; k < Kp; k += 64) {
        const __mmask64 mask = K - k >= 64 ? ~(__mmask64)0 : (((__mmask64)1 << (K - k)) - 1);
        __m512 wv[NR8][4];
#pragma GCC unroll 4
        for (int r = 0; r < NR8; r++) {
            const int8_t* chunk = tile + (k / 64 * NR8 + r) * 64;
            _mm_prefetch((const char*)(chunk + PF_AHEAD), PF_HINT);
            const __m512i v = _mm512_maskz_loadu_epi8(mask, chunk);
#pragma GCC unroll 3
            for (int j = 0; j < 3; j++) wv[r][j] = _mm512_cvtepi32_ps(_mm512_shuffle_epi8(v, to_top[j]));
            wv[r][3] = _mm512_cvtepi32_ps(_mm512_and_si512(v, top));
        }
#pragma GCC unroll 4
        for (int i = 0; i < MB; i++) {
            const float* xi = xp + i * Kp + k;
#pragma GCC unroll 4
            for (int j = 0; j < 4; j++) {
                const __m512 xv = _mm512_loadu_ps(xi + 16 * j);
#pragma GCC unroll 4
                for (int r = 0; r < NR8; r++) acc[r][i] = _mm512_fmadd_ps(wv[r][j], xv, acc[r][i]);
            }
        }
    }
#pragma GCC unroll 4
    for (int r = 0; r < NR8; r++)
#pragma GCC unroll 4
        for (int i = 0; i < MB; i++) out[i * NR8 + r] = _mm512_reduce_add_ps(acc[r][i]);
}

TARGET static void int8_block(const float* xp, int64_t M, int64_t Kp, int64_t K, const int8_t* w,
                              const uint16_t* scale, int64_t n0, int64_t N, void* y, int y_is_f32) {
    const int8_t* tile = w + n0 * Kp;  // the block's NR8 rows, each zero-padded to Kp, zero rows past N
    float out[MB8 * NR8];
    for (int64_t m0 = 0; m0 < M; m0 += MB8) {
        const int mb = M - m0 < MB8 ? (int)(M - m0) : MB8;
        const float* xm = xp + m0 * Kp;
        if (mb == 1)  // constant row counts: the accumulators stay in registers
            int8_pass(1, xm, Kp, K, tile, out);
        else
            int8_pass(2, xm, Kp, K, tile, out);
        for (int r = 0; r < NR8 && n0 + r < N; r++) {
            const float s = bf16_to_f32(scale[n0 + r]) * 0x1p-24f;  // exact: a power of two
            for (int i = 0; i < mb; i++) store(y, y_is_f32, (m0 + i) * N + n0 + r, s * out[i * NR8 + r]);
        }
    }
}

TARGET void woq_int8_gemm(const void* x, int x_is_f32, int64_t M, int64_t K, const int8_t* w, const uint16_t* scale,
                          int64_t N, void* y, int y_is_f32, int threads) {
    // x rounded to bf16 (as torch's weight-only kernels take it), held as fp32, permuted to the lanes of the
    // decoded weights and zero-padded to whole chunks of 64.
    const int64_t Kp = (K + 63) / 64 * 64;
    float* xp = (float*)calloc((size_t)(M * Kp), sizeof(float));
    for (int64_t m = 0; m < M; m++)
        for (int64_t k = 0; k < K; k++) {
            const int64_t c = k / 64 * 64, j = k % 4, i = (k % 64) / 4;
            const float v = x_is_f32 ? bf16_to_f32(f32_to_bf16(((const float*)x)[m * K + k]))
                                     : bf16_to_f32(((const uint16_t*)x)[m * K + k]);
            xp[m * Kp + c + j * 16 + i] = v;
        }
    const int64_t blocks = (N + NR8 - 1) / NR8;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t b = 0; b < blocks; b++) int8_block(xp, M, Kp, K, w, scale, b * NR8, N, y, y_is_f32);
    free(xp);
}

// ---- int4 ------------------------------------------------------------------------------------------
// Groups of 128 weights, one 64-byte chunk each: 16-bit word i holds the nibbles of weights i, i + 32,
// i + 64 and i + 96 (lowest first). Shifts and one ternary logic op per vector give four vectors of 32
// bf16 numbers 128 + q in the weights' own order (bits 0x4300 | q), all in-lane.
// Rows come in tiles of NR4 (`native_layouts.tile_rows(packed, 4)`): chunk c of row r of a block is at
// tile + (c * NR4 + r) * 64, so a block reads one sequential stream rather than NR4 streams a row apart
// (decode step of the int4 1.5B target: 42-44 ms against 46-53 on 2 Intel Xeon cores, docs/kernels.md).

#define NR4 4
#define MB4 2

// One pass over NR4 output channels for MB rows of x (bf16 [M, K]): sums of scale * x * (128 + q).
ALWAYS_INLINE void int4_pass(const int MB, const uint16_t* xb, int64_t K, const uint8_t* tile,
                             const float* const* scales, float* out) {
    const __m512i nib = _mm512_set1_epi16(0x0F), magic = _mm512_set1_epi16(0x4300);
    __m512 acc[NR4][MB4];
#pragma GCC unroll 4
    for (int r = 0; r < NR4; r++)
#pragma GCC unroll 4
        for (int i = 0; i < MB; i++) acc[r][i] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 128) {
#pragma GCC unroll 4
        for (int r = 0; r < NR4; r++) {
            const uint8_t* chunk = tile + (k / 128 * NR4 + r) * 64;
            _mm_prefetch((const char*)(chunk + PF_AHEAD), PF_HINT);
            const __m512i v = _mm512_loadu_si512(chunk);
            __m512bh wv[4];
            wv[0] = (__m512bh)_mm512_ternarylogic_epi32(v, nib, magic, 0xEA);  // (v & nib) | magic
            wv[1] = (__m512bh)_mm512_ternarylogic_epi32(_mm512_srli_epi16(v, 4), nib, magic, 0xEA);
            wv[2] = (__m512bh)_mm512_ternarylogic_epi32(_mm512_srli_epi16(v, 8), nib, magic, 0xEA);
            wv[3] = (__m512bh)_mm512_or_si512(_mm512_srli_epi16(v, 12), magic);
            const __m512 s = _mm512_set1_ps(scales[r][k / 128]);  // a broadcast memory operand
#pragma GCC unroll 4
            for (int i = 0; i < MB; i++) {
                const uint16_t* xi = xb + i * K + k;
                // Two short dependency chains rather than one of four.
                __m512 a = _mm512_dpbf16_ps(_mm512_setzero_ps(), wv[0], (__m512bh)_mm512_loadu_si512(xi));
                __m512 b = _mm512_dpbf16_ps(_mm512_setzero_ps(), wv[1], (__m512bh)_mm512_loadu_si512(xi + 32));
                a = _mm512_dpbf16_ps(a, wv[2], (__m512bh)_mm512_loadu_si512(xi + 64));
                b = _mm512_dpbf16_ps(b, wv[3], (__m512bh)_mm512_loadu_si512(xi + 96));
                acc[r][i] = _mm512_fmadd_ps(_mm512_add_ps(a, b), s, acc[r][i]);
            }
        }
    }
#pragma GCC unroll 4
    for (int r = 0; r < NR4; r++)
#pragma GCC unroll 4
        for (int i = 0; i < MB; i++) out[i * NR4 + r] = _mm512_reduce_add_ps(acc[r][i]);
}

// sum over the groups of offset * (sum of x over the group), 16 groups at a time.
ALWAYS_INLINE float int4_offset(const float* offset, const float* xs, int64_t G) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; g += 16) {
        const __mmask16 mask = G - g >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (G - g)) - 1u);
        acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(mask, offset + g), _mm512_maskz_loadu_ps(mask, xs + g), acc);
    }
    return _mm512_reduce_add_ps(acc);
}

TARGET static void int4_block(const uint16_t* xb, const float* xsum, int64_t M, int64_t K, const uint8_t* w,
                              const float* scale, const float* offset, int64_t n0, int64_t N, void* y,
                              int y_is_f32) {
    const int64_t G = K / 128;
    const uint8_t* tile = w + n0 * (K / 2);  // the block's NR4 rows, zero-padded past N
    const float* scales[NR4];
    for (int r = 0; r < NR4; r++) scales[r] = scale + (n0 + r < N ? n0 + r : N - 1) * G;  // a tail repeats the last
    float out[MB4 * NR4];
    for (int64_t m0 = 0; m0 < M; m0 += MB4) {
        const int mb = M - m0 < MB4 ? (int)(M - m0) : MB4;
        const uint16_t* xm = xb + m0 * K;
        if (mb == 1)  // constant row counts: the accumulators stay in registers
            int4_pass(1, xm, K, tile, scales, out);
        else
            int4_pass(2, xm, K, tile, scales, out);
        for (int r = 0; r < NR4 && n0 + r < N; r++) {
            for (int i = 0; i < mb; i++)
                store(y, y_is_f32, (m0 + i) * N + n0 + r,
                      out[i * NR4 + r] + int4_offset(offset + (n0 + r) * G, xsum + (m0 + i) * G, G));
        }
    }
}

TARGET void woq_int4_gemm(const void* x, int x_is_f32, int64_t M, int64_t K, const uint8_t* w, const float* scale,
                          const float* offset, int64_t N, void* y, int y_is_f32, int threads) {
    uint16_t* copy = bf16_rows(x, x_is_f32, M, K);
    const uint16_t* xb = copy ? copy : (const uint16_t*)x;
    const int64_t G = K / 128;
    float* xsum = (float*)malloc((size_t)(M * G) * sizeof(float));  // [M, G] sums of the bf16 inputs
    for (int64_t i = 0; i < M; i++)
        for (int64_t g = 0; g < G; g++) {  // 8 vectors of 16 (a scalar chain took ~0.5 ms a token)
            const uint16_t* xg = xb + i * K + g * 128;
            __m512 s = load_bf16x16(xg, 0xFFFF);
            for (int j = 16; j < 128; j += 16) s = _mm512_add_ps(s, load_bf16x16(xg + j, 0xFFFF));
            xsum[i * G + g] = _mm512_reduce_add_ps(s);
        }
    const int64_t blocks = (N + NR4 - 1) / NR4;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t b = 0; b < blocks; b++) int4_block(xb, xsum, M, K, w, scale, offset, b * NR4, N, y, y_is_f32);
    free(xsum);
    free(copy);
}

// ---- blocks of rows (bf16 and int8 x int8) ------------------------------------------------------
// Output channels per pass. One token streams 16 rows at once: more rows in flight keep more cache misses
// outstanding (bf16: 40-50 GB/s against oneDNN's 27-31 for its pre-packed weights). Several tokens take
// 4 rows x 4 tokens per pass (register blocks). The weight-only kernels above are bound by decoding their
// weights and keep 4 rows.
#define NR_ONE 16
// bf16, one token, rows of at most this many weights (3 KB for the 1.5B target's 1536): one row per pass, one
// accumulation chain reading memory in address order. Against 16 rows per pass, 1536 x 8960 matrices read 5%
// faster in the fast memory state (46.3 vs 44.0 GB/s) and 2% in the slow one; the 8960-wide rows of the down
// projection were 11% slower that way and keep 16 rows (2026-12-01, kernel A/B in one process, random order).
#define NR_SINGLE_MAX_K 2048
#define NR_MANY 4
#define NR_MAX 16
#define MBB_MAX 4

// The int8 x int8 kernel reads its weights tiled by `native_layouts.tile_rows`: rows in blocks of TILE_ROWS,
// each row cut into 64-byte chunks, chunk j of a block's rows stored together (1 KB), zero-padded to whole
// blocks and chunks. One token's pass over a block is then one sequential stream, which the prefetchers
// follow at the machine's full read speed: 16 row-major rows are 16 short streams, ~10-15% slower when
// memory is fast (55-60 vs 50-52 GB/s; equal when it is slow, ~35). The bf16 weights stay row-major: on
// tiles, our kernel's prefill (many rows) is 15-35% slower than torch's matmul on row-major weights, and
// untiling per call costs as much (docs/kernels.md).
#define TILE_ROWS 16
#define CHUNK_BYTES 64
#define TILE_CHUNK_BYTES (TILE_ROWS * CHUNK_BYTES)

// The tile block holding row n0 (a multiple of TILE_ROWS); chunk j of its row r is at
// tile + j * TILE_CHUNK_BYTES + r * CHUNK_BYTES.
static inline const uint8_t* tile_at(const void* w, int64_t row_bytes_padded, int64_t n0) {
    return (const uint8_t*)w + (n0 / TILE_ROWS) * TILE_ROWS * row_bytes_padded;
}

// ---- bf16 ------------------------------------------------------------------------------------------
// The model's own bf16 weights [N, K] (row-major, torch's layout) for the exact target's decode and
// verification forwards: 32 products per vdpbf16ps (a product of two bf16 numbers is exact in fp32), the
// same prefetch as above, nothing to decode. Every output element is one accumulation chain over k in the
// same order whatever the block shape.

ALWAYS_INLINE void bf16_pass(const int NR, const int MB, const uint16_t* xb, int64_t K, const uint16_t* const* rows,
                             const uint16_t* next, float* out) {
    __m512 acc[NR_MAX][MBB_MAX];
#pragma GCC unroll 16
    for (int r = 0; r < NR; r++)
#pragma GCC unroll 4
        for (int i = 0; i < MB; i++) acc[r][i] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 32) {
        const __mmask32 mask = K - k >= 32 ? ~(__mmask32)0 : (((__mmask32)1 << (K - k)) - 1);
        __m512bh wv[NR_MAX];
#pragma GCC unroll 16
        for (int r = 0; r < NR; r++) {
            _mm_prefetch((const char*)(next + r * K + k), PF_HINT);
            // One token's 16 streams: also into L1, 256 bytes ahead (+3-4% read speed, 2026-12-01 A/B).
            if (NR == NR_ONE || NR == 1) _mm_prefetch((const char*)(rows[r] + k + 128), _MM_HINT_T0);
            wv[r] = (__m512bh)_mm512_maskz_loadu_epi16(mask, rows[r] + k);
        }
#pragma GCC unroll 4
        for (int i = 0; i < MB; i++) {
            const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(mask, xb + i * K + k);
#pragma GCC unroll 16
            for (int r = 0; r < NR; r++) acc[r][i] = _mm512_dpbf16_ps(acc[r][i], wv[r], xv);
        }
    }
#pragma GCC unroll 16
    for (int r = 0; r < NR; r++)
#pragma GCC unroll 4
        for (int i = 0; i < MB; i++) out[i * NR + r] = hsum16(acc[r][i]);
}

// Output channels [n0, n0 + NR) for all M rows, MBB_MAX rows per pass (NR is a constant after inlining).
ALWAYS_INLINE void bf16_block(const int NR, const uint16_t* xb, int64_t M, int64_t K, const uint16_t* w,
                              const uint16_t* bias, int64_t n0, int64_t N, void* y, int y_is_f32) {
    const uint16_t* rows[NR_MAX];
    for (int r = 0; r < NR; r++) rows[r] = w + (n0 + r < N ? n0 + r : N - 1) * K;  // a tail repeats the last row
    const uint16_t* next = w + prefetch_row(n0, NR, N, 2 * K) * K;
    float out[MBB_MAX * NR_MAX];
    for (int64_t m0 = 0; m0 < M; m0 += MBB_MAX) {
        const int mb = M - m0 < MBB_MAX ? (int)(M - m0) : MBB_MAX;
        const uint16_t* xm = xb + m0 * K;
        switch (mb) {  // constant row counts: the accumulators stay in registers
            case 1: bf16_pass(NR, 1, xm, K, rows, next, out); break;
            case 2: bf16_pass(NR, 2, xm, K, rows, next, out); break;
            case 3: bf16_pass(NR, 3, xm, K, rows, next, out); break;
            default: bf16_pass(NR, 4, xm, K, rows, next, out); break;
        }
        for (int r = 0; r < NR && n0 + r < N; r++) {
            const float b = bias ? bf16_to_f32(bias[n0 + r]) : 0.0f;
            for (int i = 0; i < mb; i++) store(y, y_is_f32, (m0 + i) * N + n0 + r, out[i * NR + r] + b);
        }
    }
}

TARGET static void bf16_block_one(const uint16_t* xb, int64_t K, const uint16_t* w, const uint16_t* bias,
                                  int64_t n0, int64_t N, void* y, int y_is_f32) {
    bf16_block(NR_ONE, xb, 1, K, w, bias, n0, N, y, y_is_f32);
}

// One token, short rows (K <= NR_SINGLE_MAX_K): one row at a time, so the pass reads memory in address order.
TARGET static void bf16_block_single(const uint16_t* xb, int64_t K, const uint16_t* w, const uint16_t* bias,
                                     int64_t n0, int64_t N, void* y, int y_is_f32) {
    bf16_block(1, xb, 1, K, w, bias, n0, N, y, y_is_f32);
}

TARGET static void bf16_block_many(const uint16_t* xb, int64_t M, int64_t K, const uint16_t* w,
                                   const uint16_t* bias, int64_t n0, int64_t N, void* y, int y_is_f32) {
    bf16_block(NR_MANY, xb, M, K, w, bias, n0, N, y, y_is_f32);
}

// ---- many rows (prefill) ---------------------------------------------------------------------------
// Past PREFILL_ROWS rows, each thread takes superblocks of output channels whose weights fill part of L2
// (SUPER_BYTES) and streams every row through them, 6 rows at a time (their activations stay in L1), in
// register blocks of 4 channels x 6 rows whose sums are reduced 16 at a time (`hsum16x16`) and stored as
// vectors: the weights are read from memory once, and there is no scalar work per output. Each output
// element is still the one accumulation chain of the few-row passes above (the same vectors in the same order,
// the same reduction tree), so a token's result is the same in a prefill of any length as in a decode step.
#define PREFILL_ROWS 65
#define SUPER_BYTES (384 * 1024)

// The 16 sums of v[0..15] by `hsum16`'s tree, pairs of vectors at a time: lane 4i + r holds the sum of
// v[4r + i] (channel r, row i of 4 x 4 sums).
ALWAYS_INLINE __m512 hsum16x16(const __m512* v) {
    __m512 c[8], d[4], e[2];
#pragma GCC unroll 8
    for (int p = 0; p < 8; p++)  // lanes i + (i + 8): v[2p] in the low half, v[2p + 1] in the high one
        c[p] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * p], v[2 * p + 1], 0x44),
                             _mm512_shuffle_f32x4(v[2 * p], v[2 * p + 1], 0xEE));
#pragma GCC unroll 4
    for (int q = 0; q < 4; q++)  // then i + (i + 4): one vector per 128-bit lane
        d[q] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * q], c[2 * q + 1], 0x88),
                             _mm512_shuffle_f32x4(c[2 * q], c[2 * q + 1], 0xDD));
#pragma GCC unroll 2
    for (int t = 0; t < 2; t++)  // then i + (i + 2)
        e[t] = _mm512_add_ps(_mm512_shuffle_ps(d[2 * t], d[2 * t + 1], 0x44),
                             _mm512_shuffle_ps(d[2 * t], d[2 * t + 1], 0xEE));
    return _mm512_add_ps(_mm512_shuffle_ps(e[0], e[1], 0x88), _mm512_shuffle_ps(e[0], e[1], 0xDD));  // then 0 + 1
}

// acc[a] of channel r, row i of a 4-channel x 6-row block: rows 0-3 at 4r + i, rows 4-5 at 16 + 4r + (i - 4),
// so that `hsum16x16` of acc and of acc + 16 gives rows 0-3 and 4-5 four channels to a row.
#define BIG_ACC(r, i) ((i) < 4 ? 4 * (r) + (i) : 16 + 4 * (r) + (i) - 4)

ALWAYS_INLINE void bf16_big_step(const int MB, const uint16_t* xb, int64_t K, const uint16_t* const* rows,
                                 int64_t k, __mmask32 mask, __m512* acc) {
    __m512bh wv[4];
#pragma GCC unroll 4
    for (int r = 0; r < 4; r++) wv[r] = (__m512bh)_mm512_maskz_loadu_epi16(mask, rows[r] + k);
#pragma GCC unroll 6
    for (int i = 0; i < MB; i++) {
        const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(mask, xb + i * K + k);
#pragma GCC unroll 4
        for (int r = 0; r < 4; r++) acc[BIG_ACC(r, i)] = _mm512_dpbf16_ps(acc[BIG_ACC(r, i)], wv[r], xv);
    }
}

ALWAYS_INLINE void f32_big_step(const int MB, const float* x, int64_t K, const float* const* rows, int64_t k,
                                __mmask16 mask, __m512* acc) {
    __m512 wv[4];
#pragma GCC unroll 4
    for (int r = 0; r < 4; r++) wv[r] = _mm512_maskz_loadu_ps(mask, rows[r] + k);
#pragma GCC unroll 6
    for (int i = 0; i < MB; i++) {
        const __m512 xv = _mm512_maskz_loadu_ps(mask, x + i * K + k);
#pragma GCC unroll 4
        for (int r = 0; r < 4; r++) acc[BIG_ACC(r, i)] = _mm512_fmadd_ps(wv[r], xv, acc[BIG_ACC(r, i)]);
    }
}

// The block's sums: out[0] lane 4i + r = row i, channel r (rows 0-3); out[1] likewise for rows 4-5.
ALWAYS_INLINE void big_pass(const int f32, const int MB, const void* x, int64_t K, const void* const* rows,
                            __m512* out) {
    __m512 acc[32];
#pragma GCC unroll 32
    for (int a = 0; a < 32; a++) acc[a] = _mm512_setzero_ps();
    int64_t k = 0;
    if (f32) {
        for (; k + 16 <= K; k += 16) f32_big_step(MB, (const float*)x, K, (const float* const*)rows, k, 0xFFFF, acc);
        if (k < K) f32_big_step(MB, (const float*)x, K, (const float* const*)rows, k, tail16(K - k), acc);
    } else {
        for (; k + 32 <= K; k += 32)
            bf16_big_step(MB, (const uint16_t*)x, K, (const uint16_t* const*)rows, k, ~(__mmask32)0, acc);
        if (k < K) {
            const __mmask32 tail = ((__mmask32)1 << (K - k)) - 1;
            bf16_big_step(MB, (const uint16_t*)x, K, (const uint16_t* const*)rows, k, tail, acc);
        }
    }
    out[0] = hsum16x16(acc);
    if (MB > 4) out[1] = hsum16x16(acc + 16);
}

// Output channels [c0, c1) of every row: x bf16 [M, K] or fp32 (f32: w, bias and y fp32 too; else bf16, y
// as y_is_f32 says).
ALWAYS_INLINE void big_rows(const int f32, const void* x, int64_t M, int64_t K, const void* w, const void* bias,
                            int64_t c0, int64_t c1, int64_t N, void* y, int y_is_f32) {
    const int64_t xsz = f32 ? 4 : 2;
    for (int64_t m0 = 0; m0 < M; m0 += 6) {
        const int mb = M - m0 < 6 ? (int)(M - m0) : 6;
        const char* xm = (const char*)x + m0 * K * xsz;
        for (int64_t n0 = c0; n0 < c1; n0 += 4) {
            const int nr = c1 - n0 < 4 ? (int)(c1 - n0) : 4;
            const __mmask16 valid = (__mmask16)((1u << nr) - 1u);
            const void* rows[4];
            for (int r = 0; r < 4; r++) rows[r] = (const char*)w + (n0 + r < N ? n0 + r : N - 1) * K * xsz;
            __m512 sum[2];
            switch (mb) {  // constant row counts: the accumulators stay in registers
                case 1: big_pass(f32, 1, xm, K, rows, sum); break;
                case 2: big_pass(f32, 2, xm, K, rows, sum); break;
                case 3: big_pass(f32, 3, xm, K, rows, sum); break;
                case 4: big_pass(f32, 4, xm, K, rows, sum); break;
                case 5: big_pass(f32, 5, xm, K, rows, sum); break;
                default: big_pass(f32, 6, xm, K, rows, sum); break;
            }
            __m128 b4 = _mm_setzero_ps();
            if (bias && f32)
                b4 = _mm_maskz_loadu_ps(valid, (const float*)bias + n0);
            else if (bias)  // bf16 -> fp32: the 16 bits moved to the top
                b4 = _mm_castsi128_ps(_mm_slli_epi32(
                    _mm_cvtepu16_epi32(_mm_maskz_loadu_epi16(valid, (const uint16_t*)bias + n0)), 16));
            const __m512 b = _mm512_broadcast_f32x4(b4);  // the bias, as the scalar stores add it
            for (int h = 0; h < (mb > 4 ? 2 : 1); h++) {
                const __m512 out = _mm512_add_ps(sum[h], b);
                const int rows_here = h ? mb - 4 : (mb < 4 ? mb : 4);
                if (f32 || y_is_f32) {
                    float o[16];
                    _mm512_storeu_ps(o, out);
                    for (int i = 0; i < rows_here; i++)
                        memcpy((float*)y + (m0 + 4 * h + i) * N + n0, o + 4 * i, 4 * (size_t)nr);
                } else {
                    uint16_t o[16];
                    _mm256_storeu_si256((__m256i*)o, (__m256i)_mm512_cvtneps_pbh(out));  // f32_to_bf16's rounding
                    for (int i = 0; i < rows_here; i++)
                        memcpy((uint16_t*)y + (m0 + 4 * h + i) * N + n0, o + 4 * i, 2 * (size_t)nr);
                }
            }
        }
    }
}

TARGET static void big_rows_bf16(const void* x, int64_t M, int64_t K, const void* w, const void* bias, int64_t c0,
                                 int64_t c1, int64_t N, void* y, int y_is_f32) {
    big_rows(0, x, M, K, w, bias, c0, c1, N, y, y_is_f32);
}

TARGET static void big_rows_f32(const void* x, int64_t M, int64_t K, const void* w, const void* bias, int64_t c0,
                                int64_t c1, int64_t N, void* y) {
    big_rows(1, x, M, K, w, bias, c0, c1, N, y, 1);
}

// Output channels per superblock: a multiple of 4 whose weights take about SUPER_BYTES.
static void big_gemm(const int f32, const void* x, int64_t M, int64_t K, const void* w, const void* bias, int64_t N,
                     void* y, int y_is_f32, int threads) {
    int64_t nc = SUPER_BYTES / (K * (f32 ? 4 : 2)) / 4 * 4;
    nc = nc < 4 ? 4 : nc;
    const int64_t supers = (N + nc - 1) / nc;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int64_t s = 0; s < supers; s++) {
        const int64_t c0 = s * nc, c1 = c0 + nc < N ? c0 + nc : N;
        if (f32)
            big_rows_f32(x, M, K, w, bias, c0, c1, N, y);
        else
            big_rows_bf16(x, M, K, w, bias, c0, c1, N, y, y_is_f32);
    }
}

// y = x w^T + bias (bf16 [N], or NULL), x as bf16 (fp32 inputs rounded to bf16 first), fp32 accumulation.
TARGET void bf16_gemm(const void* x, int x_is_f32, int64_t M, int64_t K, const uint16_t* w, const uint16_t* bias,
                      int64_t N, void* y, int y_is_f32, int threads) {
    uint16_t* copy = bf16_rows(x, x_is_f32, M, K);
    const uint16_t* xb = copy ? copy : (const uint16_t*)x;
    const int single = M == 1 && K <= NR_SINGLE_MAX_K;
    const int64_t nr = single ? 1 : M == 1 ? NR_ONE : NR_MANY;
    const int64_t blocks = (N + nr - 1) / nr;
    if (M > PREFILL_ROWS) {
        big_gemm(0, xb, M, K, w, bias, N, y, y_is_f32, threads);
    } else {
#pragma omp parallel for schedule(static) num_threads(threads)
        for (int64_t b = 0; b < blocks; b++) {
            if (single)
                bf16_block_single(xb, K, w, bias, b, N, y, y_is_f32);
            else if (M == 1)
                bf16_block_one(xb, K, w, bias, b * nr, N, y, y_is_f32);
            else
                bf16_block_many(xb, M, K, w, bias, b * nr, N, y, y_is_f32);
        }
    }
    free(copy);
}

// ---- fp32 ------------------------------------------------------------------------------------------
// The fp32 model's weights [N, K] (row-major, torch's layout), as the bf16 kernel above with 16 products per
// FMA: every output element is one accumulation chain over k in the same order whatever the number of rows,
// so a row's result does not depend on the other rows (torch's fp32 matmul picks its blocking, and so its
// rounding, by the row count).

ALWAYS_INLINE void f32_pass(const int NR, const int MB, const float* x, int64_t K, const float* const* rows,
                            const float* next, float* out) {
    __m512 acc[NR_MAX][MBB_MAX];
#pragma GCC unroll 16
    for (int r = 0; r < NR; r++)
#pragma GCC unroll 4
        for (int i = 0; i < MB; i++) acc[r][i] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 16) {
        const __mmask16 mask = tail16(K - k);
        __m512 wv[NR_MAX];
#pragma GCC unroll 16
        for (int r = 0; r < NR; r++) {
            _mm_prefetch((const char*)(next + r * K + k), PF_HINT);
            wv[r] = _mm512_maskz_loadu_ps(mask, rows[r] + k);
        }
#pragma GCC unroll 4
        for (int i = 0; i < MB; i++) {
            const __m512 xv = _mm512_maskz_loadu_ps(mask, x + i * K + k);
#pragma GCC unroll 16
            for (int r = 0; r < NR; r++) acc[r][i] = _mm512_fmadd_ps(wv[r], xv, acc[r][i]);
        }
    }
#pragma GCC unroll 16
    for (int r = 0; r < NR; r++)
#pragma GCC unroll 4
        for (int i = 0; i < MB; i++) out[i * NR + r] = hsum16(acc[r][i]);
}

ALWAYS_INLINE void f32_block(const int NR, const float* x, int64_t M, int64_t K, const float* w, const float* bias,
                             int64_t n0, int64_t N, float* y) {
    const float* rows[NR_MAX];
    for (int r = 0; r < NR; r++) rows[r] = w + (n0 + r < N ? n0 + r : N - 1) * K;  // a tail repeats the last row
    const float* next = w + prefetch_row(n0, NR, N, 4 * K) * K;
    float out[MBB_MAX * NR_MAX];
    for (int64_t m0 = 0; m0 < M; m0 += MBB_MAX) {
        const int mb = M - m0 < MBB_MAX ? (int)(M - m0) : MBB_MAX;
        const float* xm = x + m0 * K;
        switch (mb) {
            case 1: f32_pass(NR, 1, xm, K, rows, next, out); break;
            case 2: f32_pass(NR, 2, xm, K, rows, next, out); break;
            case 3: f32_pass(NR, 3, xm, K, rows, next, out); break;
            default: f32_pass(NR, 4, xm, K, rows, next, out); break;
        }
        for (int r = 0; r < NR && n0 + r < N; r++) {
            const float b = bias ? bias[n0 + r] : 0.0f;
            for (int i = 0; i < mb; i++) y[(m0 + i) * N + n0 + r] = out[i * NR + r] + b;
        }
    }
}

TARGET static void f32_block_one(const float* x, int64_t K, const float* w, const float* bias, int64_t n0,
                                 int64_t N, float* y) {
    f32_block(NR_ONE, x, 1, K, w, bias, n0, N, y);
}

TARGET static void f32_block_many(const float* x, int64_t M, int64_t K, const float* w, const float* bias,
                                  int64_t n0, int64_t N, float* y) {
    f32_block(NR_MANY, x, M, K, w, bias, n0, N, y);
}

// y = x w^T + bias, all fp32: x [M, K], w [N, K], bias [N] or NULL, y [M, N].
TARGET void f32_gemm(const float* x, int64_t M, int64_t K, const float* w, const float* bias, int64_t N, float* y,
                     int threads) {
    if (M > PREFILL_ROWS) {
        big_gemm(1, x, M, K, w, bias, N, y, 1, threads);
        return;
    }
    const int64_t nr = M == 1 ? NR_ONE : NR_MANY, blocks = (N + nr - 1) / nr;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t b = 0; b < blocks; b++) {
        if (M == 1)
            f32_block_one(x, K, w, bias, b * nr, N, y);
        else
            f32_block_many(x, M, K, w, bias, b * nr, N, y);
    }
}

// ---- int8 x int8 (int8-dynamic) ------------------------------------------------------------------
// int8 weights q [N, K] (tiled, above) with an fp32 scale per output channel, times activations quantized
// per row here: scale = max|x| / qmax, u = round(x / scale) + 128 as unsigned bytes. vpdpbusd sums 64
// u8 x s8 products per instruction into int32 (exact); subtracting 128 * sum(q[n]) gives the integer
// dot product of the signed values, exact. y = float(dot) * wscale[n] * xscale (+ bias), the order of
// the torch path this replaces. Rows are quantized and computed on their own.

ALWAYS_INLINE void i8_pass(const int NR, const int MB, const uint8_t* xu, int64_t Kp, const uint8_t* tile,
                           const uint8_t* pf, int32_t* out) {
    __m512i acc[NR_MAX][MBB_MAX];
#pragma GCC unroll 16
    for (int r = 0; r < NR; r++)
#pragma GCC unroll 4
        for (int i = 0; i < MB; i++) acc[r][i] = _mm512_setzero_si512();
    for (int64_t k = 0, c = 0; k < Kp; k += 64, c += TILE_CHUNK_BYTES) {  // x and w zero-padded past K
        __m512i xv[MBB_MAX];
#pragma GCC unroll 4
        for (int i = 0; i < MB; i++) xv[i] = _mm512_loadu_si512(xu + i * Kp + k);
#pragma GCC unroll 16
        for (int r = 0; r < NR; r++) {
            _mm_prefetch((const char*)(pf + c + r * CHUNK_BYTES), PF_HINT);
            const __m512i wv = _mm512_loadu_si512(tile + c + r * CHUNK_BYTES);
#pragma GCC unroll 4
            for (int i = 0; i < MB; i++) acc[r][i] = _mm512_dpbusd_epi32(acc[r][i], xv[i], wv);
        }
    }
#pragma GCC unroll 16
    for (int r = 0; r < NR; r++)
#pragma GCC unroll 4
        for (int i = 0; i < MB; i++) out[i * NR + r] = _mm512_reduce_add_epi32(acc[r][i]);
}

// Stores rows [m0, m0 + mb) of output channels [n, n + nr) from the pass's integer sums.
ALWAYS_INLINE void i8_store(const int32_t* out, int nr, int mb, int64_t m0, int64_t n, int64_t N, const int32_t* wsum,
                            const float* wscale, const float* xscale, const float* bias, void* y, int y_is_f32) {
    for (int r = 0; r < nr && n + r < N; r++)
        for (int i = 0; i < mb; i++) {
            const float v = (float)(out[i * nr + r] - 128 * wsum[n + r]) * wscale[n + r] * xscale[m0 + i];
            store(y, y_is_f32, (m0 + i) * N + n + r, bias ? bias[n + r] + v : v);
        }
}

// Output channels [n0, n0 + 16) of a tile block for all M rows: the first row streams the block in one
// sequential pass; the others take 4 x 4 register blocks over its 4-row slices from L2 while the next block
// is prefetched. (4 x 4 passes straight from memory read each 1 KB chunk in 256-byte pieces: ~20% slower.)
TARGET static void i8_block(const uint8_t* xu, const float* xscale, int64_t M, int64_t Kp, const void* w,
                            const int32_t* wsum, const float* wscale, const float* bias, int64_t n0, int64_t N,
                            void* y, int y_is_f32) {
    const uint8_t* tile = tile_at(w, Kp, n0);
    int32_t out[MBB_MAX * NR_MAX];
    i8_pass(NR_ONE, 1, xu, Kp, tile, tile + PF_AHEAD, out);
    i8_store(out, NR_ONE, 1, 0, n0, N, wsum, wscale, xscale, bias, y, y_is_f32);
    for (int s = 0; s < NR_ONE; s += NR_MANY) {
        const uint8_t* slice = tile + s * CHUNK_BYTES;
        const uint8_t* pf = slice + TILE_ROWS * Kp;  // the same slice of the next block, while this one computes
        for (int64_t m0 = 1; m0 < M; m0 += MBB_MAX) {
            const int mb = M - m0 < MBB_MAX ? (int)(M - m0) : MBB_MAX;
            const uint8_t* xm = xu + m0 * Kp;
            switch (mb) {  // constant row counts: the accumulators stay in registers
                case 1: i8_pass(NR_MANY, 1, xm, Kp, slice, pf, out); break;
                case 2: i8_pass(NR_MANY, 2, xm, Kp, slice, pf, out); break;
                case 3: i8_pass(NR_MANY, 3, xm, Kp, slice, pf, out); break;
                default: i8_pass(NR_MANY, 4, xm, Kp, slice, pf, out); break;
            }
            i8_store(out, NR_MANY, mb, m0, n0 + s, N, wsum, wscale, xscale, bias, y, y_is_f32);
        }
    }
}

// Per-row quantization of x (fp32 or bf16 [M, K]) to u8 [M, Kp] (zero-padded) and scales [M].
TARGET static void quantize_rows(const void* x, int x_is_f32, int64_t M, int64_t K, int64_t Kp, float qmax,
                                 uint8_t* xu, float* xscale) {
#pragma omp parallel for schedule(static) if (M > 16)
    for (int64_t m = 0; m < M; m++) {
        float amax = 0.0f;
        for (int64_t k = 0; k < K; k++) {
            const float v = x_is_f32 ? ((const float*)x)[m * K + k] : bf16_to_f32(((const uint16_t*)x)[m * K + k]);
            amax = fabsf(v) > amax ? fabsf(v) : amax;
        }
        const float scale = (amax > 1e-30f ? amax : 1e-30f) / qmax;
        xscale[m] = scale;
        for (int64_t k = 0; k < K; k++) {
            const float v = x_is_f32 ? ((const float*)x)[m * K + k] : bf16_to_f32(((const uint16_t*)x)[m * K + k]);
            xu[m * Kp + k] = (uint8_t)((int)nearbyintf(v / scale) + 128);  // ties to even, as torch.round
        }
        memset(xu + m * Kp + K, 0, (size_t)(Kp - K));
    }
}

TARGET void int8_dynamic_gemm(const void* x, int x_is_f32, int64_t M, int64_t K, const void* w, const int32_t* wsum,
                              const float* wscale, const float* bias, float qmax, int64_t N, void* y, int y_is_f32,
                              int threads) {
    const int64_t Kp = (K + 63) / 64 * 64;
    uint8_t* xu = (uint8_t*)malloc((size_t)(M * Kp));
    float* xscale = (float*)malloc((size_t)M * sizeof(float));
    quantize_rows(x, x_is_f32, M, K, Kp, qmax, xu, xscale);
    const int64_t blocks = (N + TILE_ROWS - 1) / TILE_ROWS;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t b = 0; b < blocks; b++) {
        i8_block(xu, xscale, M, Kp, w, wsum, wscale, bias, b * TILE_ROWS, N, y, y_is_f32);
    }
    free(xscale);
    free(xu);
}

// ---- per-layer glue for a few rows -------------------------------------------------------------------
// RMSNorm and attention of decode / verification forwards: in torch each is a handful of small ops
// (~40 us a norm, ~70 us a layer's attention on 2 cores) where the arithmetic is a few microseconds.
// Every row is computed on its own, so a row's result does not depend on the other rows.

// y = weight * bf16(x * rsqrt(mean(x^2) + eps)) per row, x / weight / y bf16 [M, D]: the reference
// implementation's order of roundings (fp32 statistics, the normalized row rounded to bf16, then the
// bf16 product with the weight).
TARGET void rms_norm_bf16(const uint16_t* x, const uint16_t* w, float eps, int64_t M, int64_t D, uint16_t* y) {
#pragma omp parallel for schedule(static) if (M > 16)
    for (int64_t m = 0; m < M; m++) {
        const uint16_t* xm = x + m * D;
        __m512 acc = _mm512_setzero_ps();
        for (int64_t k = 0; k < D; k += 16) {
            const __m512 v = load_bf16x16(xm + k, tail16(D - k));
            acc = _mm512_fmadd_ps(v, v, acc);
        }
        const float r = 1.0f / sqrtf(_mm512_reduce_add_ps(acc) / (float)D + eps);
        const __m512 rv = _mm512_set1_ps(r);
        for (int64_t k = 0; k < D; k += 16) {
            const __mmask16 mk = tail16(D - k);
            const __m512 normed = round_bf16x16(_mm512_mul_ps(load_bf16x16(xm + k, mk), rv));
            const __m512 out = _mm512_mul_ps(normed, load_bf16x16(w + k, mk));
            _mm256_mask_storeu_epi16(y + m * D + k, mk, (__m256i)_mm512_cvtneps_pbh(out));
        }
    }
}

// exp(x) for x <= 0 (softmax after subtracting the maximum), ~1 ulp: 2^n * e^r with |r| <= ln2 / 2 and a
// degree-6 polynomial; -inf (masked) gives 0.
ALWAYS_INLINE __m512 exp_nonpositive(__m512 x) {
    const __m512 lo = _mm512_set1_ps(-87.3f);
    const __mmask16 tiny = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
    x = _mm512_max_ps(x, lo);
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);  // ln2 in two parts (Cody-Waite)
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.0f / 720);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    const __m512 e = _mm512_scalef_ps(p, n);
    return _mm512_maskz_mov_ps(~tiny, e);
}

// Attention against the cache, in fp32 like torch's small-query path: q [B, H, T, hd] (contiguous, roped);
// k, v: cache rows of layer l, element (b, kvh, s, d) at b * bs + kvh * hs + s * hd + d; mask [B, T, S]
// (1 = attend) or NULL = every slot < S; out [B, T, H * hd]. All bf16 (`attend_bf16`) or all fp32
// (`attend_f32`). Head h reads KV head h / (H / KVH). scores = q.k * scale, softmax over s, probabilities @ v.
// Each query is computed on its own: the slots it sees are gathered first and everything after runs over that
// dense list in slot order, so the result depends only on the keys and values seen: not on where masked slots
// sit (a tree node sees its ancestors at scattered slots; plain decoding sees the same tokens at consecutive
// ones), not on the other queries or rows, not on the number of queries (decode, verification and a prefill of
// any length or chunking give a token the same bits). hd must be a multiple of 16 and at most 256.
ALWAYS_INLINE __m512 load16(const void* p, int64_t i, int f32) {
    return f32 ? _mm512_loadu_ps((const float*)p + i) : load_bf16x16((const uint16_t*)p + i, 0xFFFF);
}

ALWAYS_INLINE void attend(const int f32, const void* q, const void* k, const void* v, const uint8_t* mask,
                          int64_t B, int64_t H, int64_t KVH, int64_t T, int64_t S, int64_t hd, int64_t bs,
                          int64_t hs, float scale, void* out, int threads) {
    const int64_t groups = H / KVH;
#pragma omp parallel num_threads(threads)
    {
        float* p = (float*)malloc((size_t)S * sizeof(float));  // scores, then probabilities, of seen slots
        int64_t* seen = (int64_t*)malloc((size_t)S * sizeof(int64_t));
#pragma omp for schedule(static) collapse(2)
        for (int64_t b = 0; b < B; b++)
            for (int64_t h = 0; h < H; h++) {
                const int64_t kv_at = b * bs + (h / groups) * hs;
                for (int64_t t = 0; t < T; t++) {
                    const int64_t q_at = ((b * H + h) * T + t) * hd;
                    const uint8_t* mr = mask ? mask + (b * T + t) * S : NULL;
                    __m512 qv[16];
                    for (int64_t d = 0; d < hd; d += 16) qv[d / 16] = load16(q, q_at + d, f32);
                    int64_t n = 0;
                    float mx = -INFINITY;
                    for (int64_t s = 0; s < S; s++) {
                        if (mr && !mr[s]) continue;
                        __m512 acc = _mm512_setzero_ps();
                        for (int64_t d = 0; d < hd; d += 16)
                            acc = _mm512_fmadd_ps(qv[d / 16], load16(k, kv_at + s * hd + d, f32), acc);
                        p[n] = _mm512_reduce_add_ps(acc) * scale;
                        mx = p[n] > mx ? p[n] : mx;
                        seen[n++] = s;
                    }
                    __m512 sum = _mm512_setzero_ps();
                    const __m512 mxv = _mm512_set1_ps(mx);
                    for (int64_t i = 0; i < n; i += 16) {
                        const __mmask16 mi = tail16(n - i);
                        const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(mi, p + i), mxv));
                        _mm512_mask_storeu_ps(p + i, mi, e);
                        sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(mi, e));
                    }
                    const float inv = 1.0f / _mm512_reduce_add_ps(sum);
                    __m512 o[16];
                    for (int64_t d = 0; d < hd; d += 16) o[d / 16] = _mm512_setzero_ps();
                    for (int64_t i = 0; i < n; i++) {
                        const __m512 ps = _mm512_set1_ps(p[i] * inv);
                        const int64_t v_at = kv_at + seen[i] * hd;
                        for (int64_t d = 0; d < hd; d += 16)
                            o[d / 16] = _mm512_fmadd_ps(ps, load16(v, v_at + d, f32), o[d / 16]);
                    }
                    const int64_t o_at = (b * T + t) * H * hd + h * hd;
                    for (int64_t d = 0; d < hd; d += 16) {
                        if (f32)
                            _mm512_storeu_ps((float*)out + o_at + d, o[d / 16]);
                        else
                            _mm256_storeu_si256((__m256i*)((uint16_t*)out + o_at + d),
                                                (__m256i)_mm512_cvtneps_pbh(o[d / 16]));
                    }
                }
            }
        free(seen);
        free(p);
    }
}

TARGET void attend_bf16(const uint16_t* q, const uint16_t* k, const uint16_t* v, const uint8_t* mask, int64_t B,
                        int64_t H, int64_t KVH, int64_t T, int64_t S, int64_t hd, int64_t bs, int64_t hs,
                        float scale, uint16_t* out, int threads) {
    attend(0, q, k, v, mask, B, H, KVH, T, S, hd, bs, hs, scale, out, threads);
}

TARGET void attend_f32(const float* q, const float* k, const float* v, const uint8_t* mask, int64_t B, int64_t H,
                       int64_t KVH, int64_t T, int64_t S, int64_t hd, int64_t bs, int64_t hs, float scale,
                       float* out, int threads) {
    attend(1, q, k, v, mask, B, H, KVH, T, S, hd, bs, hs, scale, out, threads);
}

// Rotary embedding of a fused q/k/v projection, with k and v written to the cache: the reference's
// `x * cos + rotate_half(x) * sin` in bf16, each product and the sum rounded to bf16 as torch's bf16 ops
// do (sin holds the sign of rotate_half in its first half), so the bits are torch's.
// qkv [B * T, (H + 2 * KVH) * hd], cos / sin [B * T, hd], slots [B * T]; q_out [B, H, T, hd]; the cache
// layer's k / v [B, KVH, S, hd] with strides (sb, sh, hd, 1).
static inline void rope_row(const uint16_t* x, const uint16_t* c, const uint16_t* s, int64_t hd, uint16_t* y) {
    const int64_t half = hd / 2;
    for (int64_t i = 0; i < hd; i++) {
        const float xr = bf16_to_f32(x[i < half ? i + half : i - half]);
        const float a = bf16_to_f32(f32_to_bf16(bf16_to_f32(x[i]) * bf16_to_f32(c[i])));
        const float b = bf16_to_f32(f32_to_bf16(xr * bf16_to_f32(s[i])));
        y[i] = f32_to_bf16(a + b);
    }
}

void rope_qkv_bf16(const uint16_t* qkv, const uint16_t* cos, const uint16_t* sin, const int64_t* slots, int64_t B,
                   int64_t T, int64_t H, int64_t KVH, int64_t hd, uint16_t* q_out, uint16_t* kc, uint16_t* vc,
                   int64_t sb, int64_t sh) {
    for (int64_t b = 0; b < B; b++)
        for (int64_t t = 0; t < T; t++) {
            const int64_t bt = b * T + t;
            const uint16_t* row = qkv + bt * (H + 2 * KVH) * hd;
            const uint16_t *c = cos + bt * hd, *s = sin + bt * hd;
            for (int64_t h = 0; h < H; h++) rope_row(row + h * hd, c, s, hd, q_out + ((b * H + h) * T + t) * hd);
            for (int64_t g = 0; g < KVH; g++) {
                const int64_t at = b * sb + g * sh + slots[bt] * hd;
                rope_row(row + (H + g) * hd, c, s, hd, kc + at);
                memcpy(vc + at, row + (H + KVH + g) * hd, (size_t)hd * sizeof(uint16_t));
            }
        }
}

// exp(x) for 16 lanes: 2^n * e^r with r = x - n ln2 (|r| <= ln2 / 2, ln2 split in two for exact products)
// and a degree-7 Taylor polynomial: within ~2 fp32 ulps, far below the bf16 rounding that follows. vscalefps
// overflows to inf and underflows to 0 as expf does (silu(-100) is then -0, as torch's).
ALWAYS_INLINE __m512 exp16(__m512 x) {
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145752f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860677e-6f), r);
    __m512 p = _mm512_set1_ps(1.0f / 5040);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

// y = bf16(bf16(silu(gate)) * up) for gate_up [M, 2 * I] (gate first): F.silu(gate) * up in bf16, silu in
// fp32 as x / (1 + exp(-x)) (torch's own exp may differ in the last fp32 bit: rarely a bf16 rounding).
TARGET void silu_mul_bf16(const uint16_t* gate_up, int64_t M, int64_t I, uint16_t* y) {
    for (int64_t m = 0; m < M; m++)
        for (int64_t i = 0; i < I; i += 16) {
            const __mmask16 mask = tail16(I - i);
            const __m512 g = load_bf16x16(gate_up + m * 2 * I + i, mask);
            const __m512 one = _mm512_set1_ps(1.0f);
            const __m512 act = round_bf16x16(_mm512_div_ps(g, _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), g)))));
            const __m512 out = _mm512_mul_ps(act, load_bf16x16(gate_up + m * 2 * I + I + i, mask));
            _mm256_mask_storeu_epi16(y + m * I + i, mask, (__m256i)_mm512_cvtneps_pbh(out));
        }
}

// ---- the decoder layers of a few-row forward in one call ------------------------------------------------
// Between the native calls above, a module-by-module decode step of the 1.5B target spends ~7 ms a token
// (~250 us a layer) in Python and torch glue: wrappers, views, empty outputs, residual adds. Here each
// layer makes the same native calls in the same order, and the residual adds round as torch's bf16 adds do,
// so the bits are those of the module-by-module forward (tests/test_native_stack.py).

enum { LIN_BF16 = 0, LIN_INT8_DYNAMIC = 1, LIN_WOQ_INT8 = 2, LIN_WOQ_INT4 = 3, LIN_GEMM_FN = 4 };

// A GEMM of another library with bf16_gemm's arguments (the AMX kernel, cpu_kernels_amx.c).
typedef void (*gemm_fn)(const void* x, int x_is_f32, int64_t M, int64_t K, const uint16_t* w, const uint16_t* bias,
                        int64_t N, void* y, int y_is_f32, int threads);

typedef struct {  // one linear layer, as `native_stack.linear_entry` fills it (all fields 8 bytes)
    int64_t kind, n, k;
    const void* w;     // bf16 [N, K] | int8 tiles | int8 tiles | int4 tiles | the GEMM's own layout
    const void* a;     // int8-dynamic: weight sums int32 [N]; woq int8: scale bf16 [N]; int4: scale fp32 [N, G];
                       // GEMM_FN: the gemm_fn
    const void* b;     // int8-dynamic: scale fp32 [N]; int4: offset fp32 [N, G]
    const void* bias;  // bf16 [N] (fp32 for int8-dynamic), or NULL
    double qmax;       // int8-dynamic: activation range
} linear_t;

typedef struct {
    const uint16_t* norm1;  // input_layernorm weight, bf16 [D]
    const uint16_t* norm2;  // post_attention_layernorm weight
    linear_t qkv, o, gate_up, down;
} layer_t;

// y (bf16 [M, N]) += bias (bf16 [N]), rounded to bf16: torch's `y + bias` after the weight-only kernels.
// x (bf16 [n]) += y (bf16 [n]) likewise: the residual adds.
static void add_bf16(uint16_t* x, const uint16_t* y, int64_t n, int64_t rows, int64_t y_row_stride) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t i = 0; i < n; i++)
            x[r * n + i] = f32_to_bf16(bf16_to_f32(x[r * n + i]) + bf16_to_f32(y[r * y_row_stride + i]));
}

TARGET static void linear_run(const linear_t* l, const uint16_t* x, int64_t M, uint16_t* y, int threads) {
    switch (l->kind) {
        case LIN_BF16:
            bf16_gemm(x, 0, M, l->k, (const uint16_t*)l->w, (const uint16_t*)l->bias, l->n, y, 0, threads);
            return;
        case LIN_GEMM_FN:
            ((gemm_fn)l->a)(x, 0, M, l->k, (const uint16_t*)l->w, (const uint16_t*)l->bias, l->n, y, 0, threads);
            return;
        case LIN_INT8_DYNAMIC:
            int8_dynamic_gemm(x, 0, M, l->k, l->w, (const int32_t*)l->a, (const float*)l->b, (const float*)l->bias,
                              (float)l->qmax, l->n, y, 0, threads);
            return;
        case LIN_WOQ_INT8:
            woq_int8_gemm(x, 0, M, l->k, (const int8_t*)l->w, (const uint16_t*)l->a, l->n, y, 0, threads);
            break;
        default:
            woq_int4_gemm(x, 0, M, l->k, (const uint8_t*)l->w, (const float*)l->a, (const float*)l->b, l->n, y, 0,
                          threads);
            break;
    }
    if (l->bias) add_bf16(y, (const uint16_t*)l->bias, l->n, M, 0);
}

// x: the residual stream, bf16 [B * T, D], updated in place through `L` layers. cos / sin [B * T, hd],
// slots [B * T] and mask ([B, T, S] bytes, or NULL) as for rope_qkv_bf16 / attend_bf16; layer l's K / V
// cache starts at k_cache / v_cache + l * layer_stride, with strides (sb, sh, hd, 1); S = slots attended.
TARGET void decode_layers(uint16_t* x, int64_t B, int64_t T, int64_t D, const layer_t* layers, int64_t L, float eps,
                          const uint16_t* cos, const uint16_t* sin, const int64_t* slots, int64_t H, int64_t KVH,
                          int64_t hd, int64_t I, uint16_t* k_cache, uint16_t* v_cache, int64_t layer_stride,
                          int64_t sb, int64_t sh, int64_t S, const uint8_t* mask, float scale, int threads) {
    const int64_t M = B * T, qkv_width = (H + 2 * KVH) * hd;
    uint16_t* h = (uint16_t*)malloc((size_t)(M * D) * sizeof(uint16_t));
    uint16_t* qkv = (uint16_t*)malloc((size_t)(M * qkv_width) * sizeof(uint16_t));
    uint16_t* q = (uint16_t*)malloc((size_t)(M * H * hd) * sizeof(uint16_t));
    uint16_t* att = (uint16_t*)malloc((size_t)(M * H * hd) * sizeof(uint16_t));
    uint16_t* gu = (uint16_t*)malloc((size_t)(M * 2 * I) * sizeof(uint16_t));
    uint16_t* act = (uint16_t*)malloc((size_t)(M * I) * sizeof(uint16_t));
    for (int64_t l = 0; l < L; l++) {
        const layer_t* ly = layers + l;
        uint16_t *kc = k_cache + l * layer_stride, *vc = v_cache + l * layer_stride;
        rms_norm_bf16(x, ly->norm1, eps, M, D, h);
        linear_run(&ly->qkv, h, M, qkv, threads);
        rope_qkv_bf16(qkv, cos, sin, slots, B, T, H, KVH, hd, q, kc, vc, sb, sh);
        attend_bf16(q, kc, vc, mask, B, H, KVH, T, S, hd, sb, sh, scale, att, threads);
        linear_run(&ly->o, att, M, h, threads);
        add_bf16(x, h, D, M, D);
        rms_norm_bf16(x, ly->norm2, eps, M, D, h);
        linear_run(&ly->gate_up, h, M, gu, threads);
        silu_mul_bf16(gu, M, I, act);
        linear_run(&ly->down, act, M, h, threads);
        add_bf16(x, h, D, M, D);
    }
    free(act);
    free(gu);
    free(att);
    free(q);
    free(qkv);
    free(h);
}
