// The portable kernel of gguf_common.c's GEMM (built with no instruction-set flags), for CPUs without
// AVX2: the same integer sums and the same fp32 operations (`fmaf` where the vector kernels fuse) in the same
// order, so the same bits as the vector kernels, at a fraction of their speed.

#include <math.h>

#define ISA_FN
#define ROWS_MAX 8

int gguf_supported(void) { return 1; }

const char* gguf_isa(void) { return "scalar"; }

// Round to nearest even for |y| < 2^22 (the default rounding mode, as the vector conversions).
static inline int32_t round_even(float y) {
    const float magic = 12582912.0f;  // 1.5 * 2^23
    return (int32_t)((y + magic) - magic);
}

// Row x (K values) -> int8 per block of 32: d = max|x| / 127, q = round-to-even(x / d).
static void quantize_row(const void* x, int x_is_f32, int64_t K, act_t* out, int64_t stride) {
    for (int64_t b = 0; b < K / 32; b++) {
        act_t* o = out + b * stride;
        float v[32], amax = 0.0f;
        for (int i = 0; i < 32; i++) {
            v[i] = x_is_f32 ? ((const float*)x)[32 * b + i] : bf16_to_f32(((const uint16_t*)x)[32 * b + i]);
            amax = fabsf(v[i]) > amax ? fabsf(v[i]) : amax;
        }
        const float db = amax / 127.0f, inv = db > 0.0f ? 127.0f / amax : 0.0f;
        int32_t s[2] = {0, 0};
        for (int i = 0; i < 32; i++) {
            int32_t r = round_even(v[i] * inv);
            r = r > 127 ? 127 : r < -127 ? -127 : r;
            o->q[i] = (int8_t)r;
            s[i / 16] += r;
        }
        o->bs16[0] = s[0];
        o->bs16[1] = s[1];
        o->d = db;
        o->fs = db * (float)(s[0] + s[1]);
    }
}

static void f16x16(const uint8_t* p, float* out) {
    for (int c = 0; c < 16; c++) out[c] = f16_to_f32((uint16_t)(p[2 * c] | p[2 * c + 1] << 8));
}

// codes[c][k] of a 32-weight sub-block: nibbles (256 bytes) then `hi` bit masks (64 bytes each); Q8_0
// (hi < 0): 8 vectors of 8-bit codes.
static const uint8_t* decode_sub(const uint8_t* p, int hi, uint8_t codes[16][32]) {
    if (hi < 0) {
        for (int v = 0; v < 8; v++)
            for (int c = 0; c < 16; c++)
                for (int j = 0; j < 4; j++) codes[c][4 * v + j] = p[64 * v + 4 * c + j];
        return p + 512;
    }
    for (int g = 0; g < 4; g++)
        for (int c = 0; c < 16; c++)
            for (int j = 0; j < 4; j++) {
                const uint8_t byte = p[64 * g + 4 * c + j];
                codes[c][8 * g + j] = byte & 15;
                codes[c][8 * g + 4 + j] = byte >> 4;
            }
    p += 256;
    for (int b = 0; b < hi; b++) {
        for (int v = 0; v < 8; v++) {
            uint64_t m;
            memcpy(&m, p + 8 * v, 8);
            for (int c = 0; c < 16; c++)
                for (int j = 0; j < 4; j++) codes[c][4 * v + j] += (uint8_t)(((m >> (4 * c + j)) & 1) << (4 + b));
        }
        p += 64;
    }
    return p;
}

static int32_t idot(const uint8_t* w, const int8_t* q, int n) {
    int32_t s = 0;
    for (int k = 0; k < n; k++) s += (int32_t)w[k] * q[k];
    return s;
}

static void tile_simple(int64_t type, const uint8_t* p, int64_t nb, const act_t* a, int R, float (*acc)[16]) {
    uint8_t codes[16][32];
    float dw[16], mw[16];
    const int hi = type == Q8_0 ? -1 : type == Q5_0;
    const int off = type == Q4_0 ? -8 : type == Q5_0 ? -16 : type == Q8_0 ? -128 : 0;
    for (int64_t b = 0; b < nb; b++) {
        f16x16(p, dw);
        p += 32;
        if (type == Q4_1) {
            f16x16(p, mw);
            p += 32;
        }
        p = decode_sub(p, hi, codes);
        for (int r = 0; r < R; r++) {
            const int32_t init = off * (ACT(b).bs16[0] + ACT(b).bs16[1]);
            for (int c = 0; c < 16; c++) {
                const float s = (float)(init + idot(codes[c], ACT(b).q, 32)) * ACT(b).d;
                acc[r][c] = fmaf(s, dw[c], acc[r][c]);
                if (type == Q4_1) acc[r][c] = fmaf(mw[c], ACT(b).fs, acc[r][c]);
            }
        }
    }
}

static void tile_q45k(int64_t type, const uint8_t* p, int64_t nb, const act_t* a, int R, float (*acc)[16]) {
    uint8_t codes[16][32];
    float d[16], dmin[16];
    for (int64_t b = 0; b < nb; b++) {
        f16x16(p, d);
        f16x16(p + 32, dmin);
        uint32_t sc[2][16], mn[2][16];
        for (int c = 0; c < 16; c++) {
            uint32_t p0, p1, p2;
            memcpy(&p0, p + 64 + 4 * c, 4);
            memcpy(&p1, p + 128 + 4 * c, 4);
            memcpy(&p2, p + 192 + 4 * c, 4);
            sc[0][c] = p0 & 0x3F3F3F3Fu;
            mn[0][c] = p1 & 0x3F3F3F3Fu;
            sc[1][c] = (p2 & 0x0F0F0F0Fu) | ((p0 >> 2) & 0x30303030u);
            mn[1][c] = ((p2 >> 4) & 0x0F0F0F0Fu) | ((p1 >> 2) & 0x30303030u);
        }
        p += 256;
        for (int j = 0; j < 8; j++) {
            const int sh = 8 * (j & 3);
            float dsc[16], dmn[16];
            for (int c = 0; c < 16; c++) {
                dsc[c] = d[c] * (float)((sc[j >> 2][c] >> sh) & 0xFF);
                dmn[c] = dmin[c] * (float)((mn[j >> 2][c] >> sh) & 0xFF);
            }
            p = decode_sub(p, type == Q5_K, codes);
            const int64_t blk = 8 * b + j;
            for (int r = 0; r < R; r++)
                for (int c = 0; c < 16; c++) {
                    const float s = (float)idot(codes[c], ACT(blk).q, 32) * ACT(blk).d;
                    acc[r][c] = fmaf(s, dsc[c], acc[r][c]);
                    acc[r][c] = fmaf(-dmn[c], ACT(blk).fs, acc[r][c]);
                }
        }
    }
}

static void tile_q6k(const uint8_t* p, int64_t nb, const act_t* a, int R, float (*acc)[16]) {
    uint8_t codes[16][32];
    float d[16];
    for (int64_t b = 0; b < nb; b++) {
        f16x16(p, d);
        const int8_t* scales = (const int8_t*)(p + 32);
        p += 32 + 256;
        for (int j = 0; j < 8; j++) {
            p = decode_sub(p, 2, codes);
            const int64_t blk = 8 * b + j;
            for (int r = 0; r < R; r++) {
                const int8_t* q = ACT(blk).q;
                for (int c = 0; c < 16; c++) {
                    const float s0 = d[c] * (float)scales[32 * j + c], s1 = d[c] * (float)scales[32 * j + 16 + c];
                    const int32_t i0 = -32 * ACT(blk).bs16[0] + idot(codes[c], q, 16);
                    const int32_t i1 = -32 * ACT(blk).bs16[1] + idot(codes[c] + 16, q + 16, 16);
                    const float t = fmaf((float)i1, s1, (float)i0 * s0);
                    acc[r][c] = fmaf(t, ACT(blk).d, acc[r][c]);
                }
            }
        }
    }
}

static void tile_rows_out(int R, int64_t type, const uint8_t* p, int64_t K, const act_t* a, float (*out)[16]) {
    for (int r = 0; r < R; r++)
        for (int c = 0; c < 16; c++) out[r][c] = 0.0f;
    const int64_t nb = K / block_k(type);
    if (type == Q6_K)
        tile_q6k(p, nb, a, R, out);
    else if (type == Q4_K || type == Q5_K)
        tile_q45k(type, p, nb, a, R, out);
    else
        tile_simple(type, p, nb, a, R, out);
}
