// GEMMs on GGUF's quantized blocks (Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q5_K, Q6_K): what every instruction set's
// kernel shares. A library is this file, one kernel file (gguf_kernels.c for AVX512-VNNI,
// gguf_kernels_avx2.c for AVX2 with or without AVX-VNNI, gguf_kernels_scalar.c for any CPU) and
// gguf_driver.c, concatenated by `gguf_linear` and built with that kernel's flags.
//
// y[m, n] = sum_k x[m, k] * w[n, k] + bias[n], with w in its GGUF blocks, re-laid out once by `gguf_repack`
// into tiles of 16 output channels (same bytes as the file's blocks):
//   tile t, block b (32 weights per channel, 256 for the K-quants): a header (fp16 scales of the 16 channels,
//   K-quant scale bytes), then for each 32-weight sub-block the 16 channels' integer codes:
//   - 8-bit codes (Q8_0, stored + 128): 8 vectors of [16 channels][4 consecutive k];
//   - 4..6-bit codes: 4 vectors of nibbles, byte j of channel c in vector g holding k = 8g + j (low) and
//     8g + 4 + j (high), then one 64-bit mask per 4 k for bit 4 (Q5_0, Q5_K, Q6_K) and for bit 5 (Q6_K),
//     bit 4c + j of mask p being code bit of channel c at k = 4p + j.
// Every field splits by channel halves (channels 0-7 first), so 256-bit kernels read one half at a time.
// Activations are quantized per row and block of 32 to int8 (one fp32 scale each, as llama.cpp's q8_0), so
// every block product is an exact integer dot product; code offsets (Q4_0's 8, Q5_0's 16, Q6_K's 32, Q8_0's
// 128) are taken off with the activation block sums, minima (Q4_1, Q4_K, Q5_K) with the scaled sums. The fp32
// operations after the integer sums are the same, in the same order, in every kernel: all give the same
// bits. Each row's quantization and accumulation order are the same whatever the number of rows, so a
// verification row equals the single-token row bit for bit.

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };

// Bytes of one tile-block (16 channels) and weights per block, by type; 0: not supported.
int64_t gguf_tile_block_bytes(int64_t type) {
    switch (type) {
        case Q4_0: return 16 * 18;
        case Q4_1: return 16 * 20;
        case Q5_0: return 16 * 22;
        case Q8_0: return 16 * 34;
        case Q4_K: return 16 * 144;
        case Q5_K: return 16 * 176;
        case Q6_K: return 16 * 210;
        default: return 0;
    }
}

static int64_t block_k(int64_t type) { return type >= Q4_K ? 256 : 32; }

typedef struct {  // one output slice of a linear (q, k, v of a fused projection...): all fields 8 bytes
    int64_t type, n;
    const uint8_t* data;  // [n / 16 tiles][K / block_k blocks][tile-block bytes]
} gguf_part_t;

typedef struct {
    int64_t n_parts;
    gguf_part_t parts[4];
} gguf_linear_t;

typedef struct {  // one row's block of 32 activations, quantized (48 bytes)
    int8_t q[32];
    float d;          // scale
    float fs;         // d * (sum of the 32 integers)
    int32_t bs16[2];  // sums of each 16 integers
} act_t;

// The kernels see a group of R rows (R <= ROWS_MAX) block-major: block b of row r at a[b * R + r], so a
// tile's loop over the rows of one block reads consecutive memory at offsets fixed by R from one pointer.
#define ACT(b) a[(b) * R + r]

// Software prefetch of the weight stream, PREFETCH_AHEAD bytes ahead of the `bytes` read now: a tile is one
// sequential stream, but a sub-block's work for many rows is long enough that the out-of-order window holds
// too few of the next loads to keep memory busy (on AVX512 a 16-row GEMM of the 1.5B's gate/up runs ~20%
// faster with it, a 1-row one ~25%).
#define PREFETCH_AHEAD 4096

static inline void prefetch_ahead(const uint8_t* p, int bytes) {
    for (int o = 0; o < bytes; o += 64) __builtin_prefetch(p + PREFETCH_AHEAD + o, 0, 3);
}

static inline float bits_f32(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline float bf16_to_f32(uint16_t v) { return bits_f32((uint32_t)v << 16); }

static inline uint16_t f32_to_bf16(float f) {  // round to nearest even (no NaN inputs here)
    uint32_t u;
    memcpy(&u, &f, 4);
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

// fp16 -> fp32 without F16C, exact for finite values: the magnitude's bits moved to fp32's places, times
// 2^112 to re-bias the exponent (fp16 subnormals become fp32 subnormals first, then exact normals).
static inline float f16_to_f32(uint16_t h) {
    const float mag = bits_f32((uint32_t)(h & 0x7FFF) << 13) * bits_f32(0x77800000u);
    return h & 0x8000 ? -mag : mag;
}

// ---- the file's blocks -> the tiles above (`gguf_linear.repack` is the same in numpy) ----------------------

// Integer codes (unsigned, as the kernel multiplies them) of one block.
static void block_codes(int64_t type, const uint8_t* s, uint8_t* codes) {
    switch (type) {
        case Q8_0:
            for (int i = 0; i < 32; i++) codes[i] = s[2 + i] ^ 0x80;
            return;
        case Q4_0:
        case Q4_1: {
            const uint8_t* qs = s + (type == Q4_0 ? 2 : 4);
            for (int i = 0; i < 16; i++) codes[i] = qs[i] & 15, codes[16 + i] = qs[i] >> 4;
            return;
        }
        case Q5_0: {
            const uint32_t qh = (uint32_t)s[2] | (uint32_t)s[3] << 8 | (uint32_t)s[4] << 16 | (uint32_t)s[5] << 24;
            for (int i = 0; i < 32; i++) codes[i] = (uint8_t)(((s[6 + i % 16] >> (4 * (i / 16))) & 15) | ((qh >> i) & 1) << 4);
            return;
        }
        case Q4_K:
        case Q5_K: {
            const uint8_t* qs = s + (type == Q4_K ? 16 : 48);
            for (int c = 0; c < 4; c++)
                for (int l = 0; l < 32; l++) codes[64 * c + l] = qs[32 * c + l] & 15, codes[64 * c + 32 + l] = qs[32 * c + l] >> 4;
            if (type == Q5_K)
                for (int sb = 0; sb < 8; sb++)
                    for (int l = 0; l < 32; l++) codes[32 * sb + l] |= (uint8_t)(((s[16 + l] >> sb) & 1) << 4);
            return;
        }
        default: {  // Q6_K
            for (int h = 0; h < 2; h++)
                for (int sh = 0; sh < 2; sh++)
                    for (int l = 0; l < 64; l++) codes[128 * h + 64 * sh + l] = (s[64 * h + l] >> (4 * sh)) & 15;
            for (int h = 0; h < 2; h++)
                for (int sh = 0; sh < 4; sh++)
                    for (int l = 0; l < 32; l++)
                        codes[128 * h + 32 * sh + l] |= (uint8_t)(((s[128 + 32 * h + l] >> (2 * sh)) & 3) << 4);
        }
    }
}

// src: [N, K / block_k blocks of the type's bytes] (the file's rows); dst: [N / 16][K / block_k][tile-block].
void gguf_repack(int64_t type, const uint8_t* src, int64_t N, int64_t K, uint8_t* dst, int threads) {
    static const int F_OFF[][17] = {[Q4_0] = {0}, [Q4_1] = {0, 2}, [Q5_0] = {0}, [Q8_0] = {0},
                                    [Q4_K] = {0, 2, 4, 8, 12}, [Q5_K] = {0, 2, 4, 8, 12},
                                    [Q6_K] = {208, 192, 193, 194, 195, 196, 197, 198, 199, 200, 201, 202, 203, 204, 205, 206, 207}};
    static const int F_LEN[][17] = {[Q4_0] = {2}, [Q4_1] = {2, 2}, [Q5_0] = {2}, [Q8_0] = {2},
                                    [Q4_K] = {2, 2, 4, 4, 4}, [Q5_K] = {2, 2, 4, 4, 4},
                                    [Q6_K] = {2, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1}};
    const int64_t bk = block_k(type), ts = gguf_tile_block_bytes(type) / 16, nb = K / bk, row = nb * ts;
    const int hi = type == Q5_0 || type == Q5_K ? 1 : type == Q6_K ? 2 : 0;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t t = 0; t < N / 16; t++) {
        uint8_t codes[16][256];
        for (int64_t b = 0; b < nb; b++) {
            uint8_t* o = dst + (t * nb + b) * 16 * ts;
            for (int f = 0; f < 17 && F_LEN[type][f]; f++)
                for (int c = 0; c < 16; c++) {
                    memcpy(o, src + (16 * t + c) * row + b * ts + F_OFF[type][f], (size_t)F_LEN[type][f]);
                    o += F_LEN[type][f];
                }
            for (int c = 0; c < 16; c++) block_codes(type, src + (16 * t + c) * row + b * ts, codes[c]);
            for (int64_t sb = 0; sb < bk / 32; sb++) {
                const int k0 = (int)(32 * sb);
                if (type == Q8_0) {
                    for (int p = 0; p < 8; p++)
                        for (int c = 0; c < 16; c++)
                            for (int j = 0; j < 4; j++) *o++ = codes[c][k0 + 4 * p + j];
                    continue;
                }
                for (int g = 0; g < 4; g++)
                    for (int c = 0; c < 16; c++)
                        for (int j = 0; j < 4; j++)
                            *o++ = (uint8_t)((codes[c][k0 + 8 * g + j] & 15) | (codes[c][k0 + 8 * g + 4 + j] & 15) << 4);
                for (int h = 0; h < hi; h++)
                    for (int p = 0; p < 8; p++) {
                        uint64_t m = 0;
                        for (int c = 0; c < 16; c++)
                            for (int j = 0; j < 4; j++)
                                m |= (uint64_t)((codes[c][k0 + 4 * p + j] >> (4 + h)) & 1) << (4 * c + j);
                        memcpy(o, &m, 8);
                        o += 8;
                    }
            }
        }
    }
}
