// GEMMs on GGUF's quantized blocks (Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q5_K, Q6_K), AVX512-VNNI.
//
// y[m, n] = sum_k x[m, k] * w[n, k] + bias[n], with w in its GGUF blocks, re-laid out once by
// `gguf_linear.repack` into tiles of 16 output channels (same bytes as the file's blocks):
//   tile t, block b (32 weights per channel, 256 for the K-quants): a header (fp16 scales of the 16 channels,
//   K-quant scale bytes), then for each 32-weight sub-block the 16 channels' integer codes:
//   - 8-bit codes (Q8_0, stored + 128): 8 vectors of [16 channels][4 consecutive k];
//   - 4..6-bit codes: 4 vectors of nibbles, byte j of channel c in vector g holding k = 8g + j (low) and
//     8g + 4 + j (high), then one 64-bit mask per 4 k for bit 4 (Q5_0, Q5_K, Q6_K) and for bit 5 (Q6_K),
//     bit 4c + j of mask p being code bit of channel c at k = 4p + j.
// Activations are quantized per row and block of 32 to int8 (one fp32 scale each, as llama.cpp's q8_0), so
// every block product is an exact integer dot product (`vpdpbusd`, unsigned codes x signed activations);
// code offsets (Q4_0's 8, Q5_0's 16, Q6_K's 32, Q8_0's 128) are taken off with the activation block sums,
// minima (Q4_1, Q4_K, Q5_K) with the scaled sums. A tile's block is decoded once per 8 rows and serves them
// all. Each row's quantization and accumulation order are the same whatever the number of rows, so a
// verification row equals the single-token row bit for bit.

#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,f16c,fma")))
#define INLINE static inline __attribute__((always_inline, target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,f16c,fma")))

enum { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };

int gguf_supported(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
           __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("f16c") && __builtin_cpu_supports("fma");
}

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

typedef struct {  // one row's quantized activations
    const int8_t* q;      // [K]
    const float* d;       // [K / 32] scales
    const float* fs;      // [K / 32] d * (sum of the block's integers)
    const int32_t* bs16;  // [K / 16] sums of 16 integers
} act_t;

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

// Row x (K values) -> int8 per block of 32: d = max|x| / 127, q = round-to-even(x / d).
TARGET static void quantize_row(const void* x, int x_is_f32, int64_t K, int8_t* q, float* d, float* fs,
                                int32_t* bs16) {
    for (int64_t b = 0; b < K / 32; b++) {
        __m512 v0, v1;
        if (x_is_f32) {
            v0 = _mm512_loadu_ps((const float*)x + 32 * b);
            v1 = _mm512_loadu_ps((const float*)x + 32 * b + 16);
        } else {
            const uint16_t* xb = (const uint16_t*)x + 32 * b;
            v0 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)xb)), 16));
            v1 = _mm512_castsi512_ps(
                _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(xb + 16))), 16));
        }
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
        const float db = amax / 127.0f;
        const __m512 inv = _mm512_set1_ps(db > 0.0f ? 127.0f / amax : 0.0f);
        const __m512i i0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, inv)), i1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, inv));
        _mm_storeu_si128((__m128i*)(q + 32 * b), _mm512_cvtsepi32_epi8(i0));
        _mm_storeu_si128((__m128i*)(q + 32 * b + 16), _mm512_cvtsepi32_epi8(i1));
        const int32_t s0 = _mm512_reduce_add_epi32(i0), s1 = _mm512_reduce_add_epi32(i1);
        bs16[2 * b] = s0;
        bs16[2 * b + 1] = s1;
        d[b] = db;
        fs[b] = db * (float)(s0 + s1);
    }
}

INLINE __m512i bcast4(const int8_t* p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}

// init + sum over 4 k-quads (16 k) of codes w[0..3] x activations q[0..15].
INLINE __m512i dot16(const __m512i* w, const int8_t* q, __m512i acc) {
    acc = _mm512_dpbusd_epi32(acc, w[0], bcast4(q));
    acc = _mm512_dpbusd_epi32(acc, w[1], bcast4(q + 4));
    acc = _mm512_dpbusd_epi32(acc, w[2], bcast4(q + 8));
    return _mm512_dpbusd_epi32(acc, w[3], bcast4(q + 12));
}

INLINE __m512i dot32(const __m512i* w, const int8_t* q, __m512i acc) {
    return dot16(w + 4, q + 16, dot16(w, q, acc));
}

// The 8 code vectors of a 32-weight sub-block: nibbles (256 bytes) then `hi` bit masks (64 bytes each).
INLINE const uint8_t* decode_sub(const uint8_t* p, int hi, __m512i* w) {
    const __m512i lo4 = _mm512_set1_epi8(0x0F);
    for (int g = 0; g < 4; g++) {
        const __m512i v = _mm512_loadu_si512(p + 64 * g);
        w[2 * g] = _mm512_and_si512(v, lo4);
        w[2 * g + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), lo4);
    }
    p += 256;
    for (int h = 0; h < hi; h++) {
        const __m512i add = _mm512_set1_epi8((char)(16 << h));
        for (int j = 0; j < 8; j++) {
            uint64_t m;
            memcpy(&m, p + 8 * j, 8);
            w[j] = _mm512_mask_add_epi8(w[j], (__mmask64)m, w[j], add);
        }
        p += 64;
    }
    return p;
}

INLINE __m512 h16(const uint8_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p)); }

// acc[r] (16 channels) += this tile's products with rows a[0..R) over all of K.
#define ROWS_LOOP for (int r = 0; r < R; r++)

INLINE void tile_simple(int64_t type, const uint8_t* p, int64_t nb, const act_t* a, int R, __m512* acc) {
    __m512i w[8];
    const int hi = type == Q5_0;
    const int off = type == Q4_0 ? -8 : type == Q5_0 ? -16 : type == Q8_0 ? -128 : 0;
    for (int64_t b = 0; b < nb; b++) {
        const __m512 dw = h16(p);
        __m512 mw = _mm512_setzero_ps();
        p += 32;
        if (type == Q4_1) {
            mw = h16(p);
            p += 32;
        }
        if (type == Q8_0) {
            for (int j = 0; j < 8; j++) w[j] = _mm512_loadu_si512(p + 64 * j);
            p += 512;
        } else {
            p = decode_sub(p, hi, w);
        }
        ROWS_LOOP {
            const __m512i init = _mm512_set1_epi32(off * (a[r].bs16[2 * b] + a[r].bs16[2 * b + 1]));
            const __m512 s = _mm512_mul_ps(_mm512_cvtepi32_ps(dot32(w, a[r].q + 32 * b, init)), _mm512_set1_ps(a[r].d[b]));
            acc[r] = _mm512_fmadd_ps(s, dw, acc[r]);
            if (type == Q4_1) acc[r] = _mm512_fmadd_ps(mw, _mm512_set1_ps(a[r].fs[b]), acc[r]);
        }
    }
}

// Q4_K / Q5_K: d, dmin (fp16 x 16), the 12 scale bytes as 3 vectors [16 channels][4 bytes], 8 sub-blocks.
INLINE void tile_q45k(int64_t type, const uint8_t* p, int64_t nb, const act_t* a, int R, __m512* acc) {
    __m512i w[8];
    const int hi = type == Q5_K;
    const __m512i m6 = _mm512_set1_epi8(0x3F), m4 = _mm512_set1_epi8(0x0F), m30 = _mm512_set1_epi8(0x30);
    const __m512i ff = _mm512_set1_epi32(0xFF);
    for (int64_t b = 0; b < nb; b++) {
        const __m512 d = h16(p), dmin = h16(p + 32);
        const __m512i p0 = _mm512_loadu_si512(p + 64), p1 = _mm512_loadu_si512(p + 128), p2 = _mm512_loadu_si512(p + 192);
        p += 256;
        __m512i sc[2], mn[2];
        sc[0] = _mm512_and_si512(p0, m6);
        mn[0] = _mm512_and_si512(p1, m6);
        sc[1] = _mm512_or_si512(_mm512_and_si512(p2, m4), _mm512_and_si512(_mm512_srli_epi32(p0, 2), m30));
        mn[1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(p2, 4), m4), _mm512_and_si512(_mm512_srli_epi32(p1, 2), m30));
        for (int j = 0; j < 8; j++) {
            const int sh = 8 * (j & 3);
            const __m512 dsc = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(sc[j >> 2], sh), ff)));
            const __m512 dmn = _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(mn[j >> 2], sh), ff)));
            p = decode_sub(p, hi, w);
            const int64_t blk = 8 * b + j;
            ROWS_LOOP {
                const __m512 s = _mm512_mul_ps(_mm512_cvtepi32_ps(dot32(w, a[r].q + 32 * blk, _mm512_setzero_si512())),
                                               _mm512_set1_ps(a[r].d[blk]));
                acc[r] = _mm512_fmadd_ps(s, dsc, acc[r]);
                acc[r] = _mm512_fnmadd_ps(dmn, _mm512_set1_ps(a[r].fs[blk]), acc[r]);
            }
        }
    }
}

// Q6_K: d (fp16 x 16), int8 scales [16 sub-blocks of 16][16 channels], 8 sub-blocks of 32 with 2 bit planes.
INLINE void tile_q6k(const uint8_t* p, int64_t nb, const act_t* a, int R, __m512* acc) {
    __m512i w[8];
    for (int64_t b = 0; b < nb; b++) {
        const __m512 d = h16(p);
        const uint8_t* scales = p + 32;
        p += 32 + 256;
        for (int j = 0; j < 8; j++) {
            const __m512 s0 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                                   _mm_loadu_si128((const __m128i*)(scales + 32 * j)))));
            const __m512 s1 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                                   _mm_loadu_si128((const __m128i*)(scales + 32 * j + 16)))));
            p = decode_sub(p, 2, w);
            const int64_t blk = 8 * b + j;
            ROWS_LOOP {
                const int8_t* q = a[r].q + 32 * blk;
                const __m512i i0 = dot16(w, q, _mm512_set1_epi32(-32 * a[r].bs16[2 * blk]));
                const __m512i i1 = dot16(w + 4, q + 16, _mm512_set1_epi32(-32 * a[r].bs16[2 * blk + 1]));
                __m512 t = _mm512_mul_ps(_mm512_cvtepi32_ps(i0), s0);
                t = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i1), s1, t);
                acc[r] = _mm512_fmadd_ps(t, _mm512_set1_ps(a[r].d[blk]), acc[r]);
            }
        }
    }
}

INLINE void tile_rows(int64_t type, const uint8_t* p, int64_t K, const act_t* a, int R, __m512* acc) {
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    const int64_t nb = K / block_k(type);
    if (type == Q6_K)
        tile_q6k(p, nb, a, R, acc);
    else if (type == Q4_K || type == Q5_K)
        tile_q45k(type, p, nb, a, R, acc);
    else
        tile_simple(type, p, nb, a, R, acc);
}

#define ROWS_MAX 8

// One tile (16 channels) for up to ROWS_MAX rows; the row count is a constant in each specialization, so
// the accumulators stay in registers.
#define SPECIALIZE(RR)                                                                                     \
    TARGET static void tile_##RR(int64_t type, const uint8_t* p, int64_t K, const act_t* a, __m512* acc) { \
        tile_rows(type, p, K, a, RR, acc);                                                                 \
    }
SPECIALIZE(1)
SPECIALIZE(2)
SPECIALIZE(3)
SPECIALIZE(4)
SPECIALIZE(5)
SPECIALIZE(6)
SPECIALIZE(7)
SPECIALIZE(8)

typedef void (*tile_fn)(int64_t, const uint8_t*, int64_t, const act_t*, __m512*);
static const tile_fn TILE_FNS[ROWS_MAX + 1] = {NULL, tile_1, tile_2, tile_3, tile_4, tile_5, tile_6, tile_7, tile_8};

// x: [M, K] bf16 (or fp32); lin: a gguf_linear_t; bias: bf16 [N] or NULL; y: [M, N] bf16 (or fp32).
// The signature of the native stack's GEMM_FN entries (cpu_kernels.c's gemm_fn).
TARGET void gguf_gemm(const void* x, int x_is_f32, int64_t M, int64_t K, const void* lin_, const uint16_t* bias,
                      int64_t N, void* y, int y_is_f32, int threads) {
    const gguf_linear_t* lin = (const gguf_linear_t*)lin_;
    const int64_t nb32 = K / 32;
    int8_t* q = (int8_t*)malloc((size_t)(M * K));
    float* d = (float*)malloc((size_t)(M * nb32 * 2) * sizeof(float));
    int32_t* bs16 = (int32_t*)malloc((size_t)(M * nb32 * 2) * sizeof(int32_t));
    const size_t xsz = x_is_f32 ? 4 : 2;
#pragma omp parallel for num_threads(threads) schedule(static) if (M >= 8)
    for (int64_t m = 0; m < M; m++)
        quantize_row((const char*)x + (size_t)(m * K) * xsz, x_is_f32, K, q + m * K, d + m * 2 * nb32,
                     d + m * 2 * nb32 + nb32, bs16 + m * 2 * nb32);
    int64_t tiles = 0;
    for (int64_t i = 0; i < lin->n_parts; i++) tiles += lin->parts[i].n / 16;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t t = 0; t < tiles; t++) {
        int64_t part = 0, tt = t, col = 0;
        while (tt >= lin->parts[part].n / 16) {
            tt -= lin->parts[part].n / 16;
            col += lin->parts[part].n;
            part++;
        }
        const gguf_part_t* pt = lin->parts + part;
        const int64_t tile_bytes = (K / block_k(pt->type)) * gguf_tile_block_bytes(pt->type);
        const uint8_t* p = pt->data + tt * tile_bytes;
        col += 16 * tt;
        float bv[16];
        for (int c = 0; c < 16; c++) bv[c] = bias ? bf16_to_f32(bias[col + c]) : 0.0f;
        for (int64_t r0 = 0; r0 < M; r0 += ROWS_MAX) {
            const int R = (int)(M - r0 < ROWS_MAX ? M - r0 : ROWS_MAX);
            act_t a[ROWS_MAX];
            for (int r = 0; r < R; r++) {
                const int64_t m = r0 + r;
                a[r] = (act_t){q + m * K, d + m * 2 * nb32, d + m * 2 * nb32 + nb32, bs16 + m * 2 * nb32};
            }
            __m512 acc[ROWS_MAX];
            TILE_FNS[R](pt->type, p, K, a, acc);
            for (int r = 0; r < R; r++) {
                float out[16];
                _mm512_storeu_ps(out, _mm512_add_ps(acc[r], _mm512_loadu_ps(bv)));
                const int64_t base = (r0 + r) * N + col;
                if (y_is_f32)
                    memcpy((float*)y + base, out, sizeof(out));
                else
                    for (int c = 0; c < 16; c++) ((uint16_t*)y)[base + c] = f32_to_bf16(out[c]);
            }
        }
    }
    free(bs16);
    free(d);
    free(q);
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
