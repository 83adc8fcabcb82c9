// The AVX2 kernel of gguf_common.c's GEMM, built with -mavx2 -mfma (and -mavxvnni for its AVX-VNNI
// version): one half of a tile (8 channels) per 256-bit register, the two halves one after the other.
//
// Block products: with AVX-VNNI, `vpdpbusd` as on AVX512. Without it, `vpmaddubsw` (unsigned codes x signed
// activations -> pairs summed in int16, saturating) then `vpmaddwd` by ones into int32. No sum can saturate:
// activations are in [-127, 127], so a pair is at most 2 * 63 * 127 = 16002 for 6-bit codes (two pairs
// still fit int16 and are added before widening), 2 * 31 * 127 = 7874 for 5-bit and smaller codes (four
// are added). Q8_0's codes go back to signed and take the sign trick (|w| x sign(w) a, at most
// 2 * 128 * 127 = 32512 a pair), with no offset to take off. Either way the integer sums are exact, so the
// results are those of the AVX512 kernel bit for bit. fp16 scales convert without F16C (`h8`).

#include <immintrin.h>

#define ISA_FN
#define INLINE static inline __attribute__((always_inline))
#define ROWS_MAX 4  // 4 accumulators + 8 code vectors + temporaries in 16 ymm registers

int gguf_supported(void) {
    __builtin_cpu_init();
    int ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#ifdef __AVXVNNI__
    ok = ok && __builtin_cpu_supports("avxvnni");
#endif
    return ok;
}

#ifdef __AVXVNNI__
const char* gguf_isa(void) { return "avxvnni"; }
#else
const char* gguf_isa(void) { return "avx2"; }
#endif

INLINE float hmax8(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

INLINE int32_t hsum8(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1)));
}

// Row x (K values) -> int8 per block of 32: d = max|x| / 127, q = round-to-even(x / d).
static void quantize_row(const void* x, int x_is_f32, int64_t K, act_t* out, int64_t stride) {
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // undoes the packs' per-lane order
    for (int64_t b = 0; b < K / 32; b++) {
        act_t* o = out + b * stride;
        __m256 v[4];
        for (int i = 0; i < 4; i++) {
            if (x_is_f32) {
                v[i] = _mm256_loadu_ps((const float*)x + 32 * b + 8 * i);
            } else {
                const __m128i h = _mm_loadu_si128((const __m128i*)((const uint16_t*)x + 32 * b + 8 * i));
                v[i] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
            }
        }
        const __m256 m = _mm256_max_ps(_mm256_max_ps(_mm256_and_ps(v[0], absmask), _mm256_and_ps(v[1], absmask)),
                                       _mm256_max_ps(_mm256_and_ps(v[2], absmask), _mm256_and_ps(v[3], absmask)));
        const float amax = hmax8(m);
        const float db = amax / 127.0f;
        const __m256 inv = _mm256_set1_ps(db > 0.0f ? 127.0f / amax : 0.0f);
        __m256i i[4];
        for (int j = 0; j < 4; j++) i[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], inv));
        const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(i[0], i[1]), _mm256_packs_epi32(i[2], i[3]));
        _mm256_storeu_si256((__m256i*)(o->q), _mm256_permutevar8x32_epi32(p, order));
        const int32_t s0 = hsum8(_mm256_add_epi32(i[0], i[1])), s1 = hsum8(_mm256_add_epi32(i[2], i[3]));
        o->bs16[0] = s0;
        o->bs16[1] = s1;
        o->d = db;
        o->fs = db * (float)(s0 + s1);
    }
}

// 8 fp16 (the half's channels) -> fp32, exact for finite values (gguf_common.c's f16_to_f32).
INLINE __m256 h8(const uint8_t* p) {
    const __m256i h = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p));
    const __m256i mag = _mm256_slli_epi32(_mm256_and_si256(h, _mm256_set1_epi32(0x7FFF)), 13);
    const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(h, _mm256_set1_epi32(0x8000)), 16);
    const __m256 f = _mm256_mul_ps(_mm256_castsi256_ps(mag), _mm256_castsi256_ps(_mm256_set1_epi32(0x77800000)));
    return _mm256_or_ps(f, _mm256_castsi256_ps(sign));
}

INLINE __m256i bcast4(const int8_t* p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

// 32 mask bits -> 32 bytes, 0xFF where the bit is set (byte i <- bit i).
INLINE __m256i expand_bits(uint32_t m) {
    const __m256i shuf = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                          2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    const __m256i sel = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    const __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32((int)m), shuf);
    return _mm256_cmpeq_epi8(_mm256_and_si256(v, sel), sel);
}

// acc + sum over 16 k (4 quads) of codes w[0..3] x activations q[0..15]; `bits`: the codes' width.
INLINE __m256i dot16(const __m256i* w, const int8_t* q, __m256i acc, int bits) {
#ifdef __AVXVNNI__
    (void)bits;
    for (int i = 0; i < 4; i++) acc = _mm256_dpbusd_avx_epi32(acc, w[i], bcast4(q + 4 * i));
    return acc;
#else
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i p[4];
    for (int i = 0; i < 4; i++) p[i] = _mm256_maddubs_epi16(w[i], bcast4(q + 4 * i));
    if (bits <= 5)
        return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_add_epi16(_mm256_add_epi16(p[0], p[1]),
                                                                         _mm256_add_epi16(p[2], p[3])), ones));
    acc = _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_add_epi16(p[0], p[1]), ones));
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_add_epi16(p[2], p[3]), ones));
#endif
}

INLINE __m256i dot32(const __m256i* w, const int8_t* q, __m256i acc, int bits) {
    return dot16(w + 4, q + 16, dot16(w, q, acc, bits), bits);
}

#ifndef __AVXVNNI__
// Q8_0: signed codes s[0..7] (|s| in a[0..7]) x q[0..31], one pair sum widened at a time.
INLINE __m256i dot32_signed(const __m256i* a, const __m256i* s, const int8_t* q, __m256i acc) {
    const __m256i ones = _mm256_set1_epi16(1);
    for (int i = 0; i < 8; i++)
        acc = _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(a[i], _mm256_sign_epi8(bcast4(q + 4 * i), s[i])),
                                                      ones));
    return acc;
}
#endif

// Half h's 8 code vectors of a 32-weight sub-block: nibbles (256 bytes) then `hi` bit masks (64 bytes each).
INLINE const uint8_t* decode_sub(const uint8_t* p, int hi, int h, __m256i* w) {
    const __m256i lo4 = _mm256_set1_epi8(0x0F);
    if (h == 0) prefetch_ahead(p, 256 + 64 * hi);  // the second half's pass finds the bytes in cache
    for (int g = 0; g < 4; g++) {
        const __m256i v = _mm256_loadu_si256((const __m256i*)(p + 64 * g + 32 * h));
        w[2 * g] = _mm256_and_si256(v, lo4);
        w[2 * g + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), lo4);
    }
    p += 256;
    for (int b = 0; b < hi; b++) {
        const __m256i add = _mm256_set1_epi8((char)(16 << b));
        for (int j = 0; j < 8; j++) {
            uint32_t m;
            memcpy(&m, p + 8 * j + 4 * h, 4);
            w[j] = _mm256_add_epi8(w[j], _mm256_and_si256(expand_bits(m), add));
        }
        p += 64;
    }
    return p;
}

#define ROWS_LOOP for (int r = 0; r < R; r++)

INLINE void tile_simple(int64_t type, const uint8_t* p, int64_t nb, const act_t* a, int R, int h, __m256* acc) {
    __m256i w[8];
    const int hi = type == Q5_0, bits = type == Q5_0 ? 5 : 4;
#ifdef __AVXVNNI__
    const int off = type == Q4_0 ? -8 : type == Q5_0 ? -16 : type == Q8_0 ? -128 : 0;
#else
    const int off = type == Q4_0 ? -8 : type == Q5_0 ? -16 : 0;
    __m256i ws[8];
#endif
    for (int64_t b = 0; b < nb; b++) {
        // The block's header, and Q8_0's codes (decode_sub prefetches the other types' codes).
        if (h == 0) prefetch_ahead(p, type == Q4_1 ? 64 : type == Q8_0 ? 32 + 512 : 32);
        const __m256 dw = h8(p + 16 * h);
        __m256 mw = _mm256_setzero_ps();
        p += 32;
        if (type == Q4_1) {
            mw = h8(p + 16 * h);
            p += 32;
        }
        if (type == Q8_0) {
            for (int j = 0; j < 8; j++) {
                w[j] = _mm256_loadu_si256((const __m256i*)(p + 64 * j + 32 * h));
#ifndef __AVXVNNI__
                ws[j] = _mm256_xor_si256(w[j], _mm256_set1_epi8((char)0x80));  // code - 128
                w[j] = _mm256_abs_epi8(ws[j]);
#endif
            }
            p += 512;
        } else {
            p = decode_sub(p, hi, h, w);
        }
        ROWS_LOOP {
            const __m256i init = _mm256_set1_epi32(off * (ACT(b).bs16[0] + ACT(b).bs16[1]));
            __m256i isum;
#ifndef __AVXVNNI__
            if (type == Q8_0)
                isum = dot32_signed(w, ws, ACT(b).q, init);
            else
#endif
                isum = dot32(w, ACT(b).q, init, bits);
            const __m256 s = _mm256_mul_ps(_mm256_cvtepi32_ps(isum), _mm256_set1_ps(ACT(b).d));
            acc[r] = _mm256_fmadd_ps(s, dw, acc[r]);
            if (type == Q4_1) acc[r] = _mm256_fmadd_ps(mw, _mm256_set1_ps(ACT(b).fs), acc[r]);
        }
    }
}

// Q4_K / Q5_K: d, dmin (fp16 x 16), the 12 scale bytes as 3 vectors [16 channels][4 bytes], 8 sub-blocks.
INLINE void tile_q45k(int64_t type, const uint8_t* p, int64_t nb, const act_t* a, int R, int h, __m256* acc) {
    __m256i w[8];
    const int hi = type == Q5_K, bits = type == Q5_K ? 5 : 4;
    const __m256i m6 = _mm256_set1_epi8(0x3F), m4 = _mm256_set1_epi8(0x0F), m30 = _mm256_set1_epi8(0x30);
    const __m256i ff = _mm256_set1_epi32(0xFF);
    for (int64_t b = 0; b < nb; b++) {
        if (h == 0) prefetch_ahead(p, 256);
        const __m256 d = h8(p + 16 * h), dmin = h8(p + 32 + 16 * h);
        const __m256i p0 = _mm256_loadu_si256((const __m256i*)(p + 64 + 32 * h));
        const __m256i p1 = _mm256_loadu_si256((const __m256i*)(p + 128 + 32 * h));
        const __m256i p2 = _mm256_loadu_si256((const __m256i*)(p + 192 + 32 * h));
        p += 256;
        __m256i sc[2], mn[2];
        sc[0] = _mm256_and_si256(p0, m6);
        mn[0] = _mm256_and_si256(p1, m6);
        sc[1] = _mm256_or_si256(_mm256_and_si256(p2, m4), _mm256_and_si256(_mm256_srli_epi32(p0, 2), m30));
        mn[1] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(p2, 4), m4), _mm256_and_si256(_mm256_srli_epi32(p1, 2), m30));
        for (int j = 0; j < 8; j++) {
            const int sh = 8 * (j & 3);
            const __m256 dsc = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(sc[j >> 2], sh), ff)));
            const __m256 dmn = _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(mn[j >> 2], sh), ff)));
            p = decode_sub(p, hi, h, w);
            const int64_t blk = 8 * b + j;
            ROWS_LOOP {
                const __m256 s = _mm256_mul_ps(_mm256_cvtepi32_ps(dot32(w, ACT(blk).q, _mm256_setzero_si256(), bits)),
                                               _mm256_set1_ps(ACT(blk).d));
                acc[r] = _mm256_fmadd_ps(s, dsc, acc[r]);
                acc[r] = _mm256_fnmadd_ps(dmn, _mm256_set1_ps(ACT(blk).fs), acc[r]);
            }
        }
    }
}

// Q6_K: d (fp16 x 16), int8 scales [16 sub-blocks of 16][16 channels], 8 sub-blocks of 32 with 2 bit planes.
INLINE void tile_q6k(const uint8_t* p, int64_t nb, const act_t* a, int R, int h, __m256* acc) {
    __m256i w[8];
    for (int64_t b = 0; b < nb; b++) {
        if (h == 0) prefetch_ahead(p, 288);
        const __m256 d = h8(p + 16 * h);
        const uint8_t* scales = p + 32 + 8 * h;
        p += 32 + 256;
        for (int j = 0; j < 8; j++) {
            const __m256 s0 = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                                                   _mm_loadl_epi64((const __m128i*)(scales + 32 * j)))));
            const __m256 s1 = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                                                   _mm_loadl_epi64((const __m128i*)(scales + 32 * j + 16)))));
            p = decode_sub(p, 2, h, w);
            const int64_t blk = 8 * b + j;
            ROWS_LOOP {
                const int8_t* q = ACT(blk).q;
                const __m256i i0 = dot16(w, q, _mm256_set1_epi32(-32 * ACT(blk).bs16[0]), 6);
                const __m256i i1 = dot16(w + 4, q + 16, _mm256_set1_epi32(-32 * ACT(blk).bs16[1]), 6);
                __m256 t = _mm256_mul_ps(_mm256_cvtepi32_ps(i0), s0);
                t = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i1), s1, t);
                acc[r] = _mm256_fmadd_ps(t, _mm256_set1_ps(ACT(blk).d), acc[r]);
            }
        }
    }
}

// acc[r] (half h's 8 channels) = this tile's products with rows a[0..R) over all of K.
INLINE void tile_half(int64_t type, const uint8_t* p, int64_t K, const act_t* a, int R, int h, __m256* acc) {
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    const int64_t nb = K / block_k(type);
    if (type == Q6_K)
        tile_q6k(p, nb, a, R, h, acc);
    else if (type == Q4_K || type == Q5_K)
        tile_q45k(type, p, nb, a, R, h, acc);
    else
        tile_simple(type, p, nb, a, R, h, acc);
}

// One tile for R (a constant in each specialization: accumulators in registers) rows, half by half: the
// second half's pass finds the tile's bytes in cache.
#define SPECIALIZE(RR)                                                                                       \
    static void tile_##RR(int64_t type, const uint8_t* p, int64_t K, const act_t* a, float (*out)[16]) {     \
        __m256 acc[RR];                                                                                      \
        for (int h = 0; h < 2; h++) {                                                                        \
            tile_half(type, p, K, a, RR, h, acc);                                                            \
            for (int r = 0; r < RR; r++) _mm256_storeu_ps(out[r] + 8 * h, acc[r]);                           \
        }                                                                                                    \
    }
SPECIALIZE(1)
SPECIALIZE(2)
SPECIALIZE(3)
SPECIALIZE(4)

typedef void (*tile_fn)(int64_t, const uint8_t*, int64_t, const act_t*, float (*)[16]);
static const tile_fn TILE_FNS[ROWS_MAX + 1] = {NULL, tile_1, tile_2, tile_3, tile_4};

static void tile_rows_out(int R, int64_t type, const uint8_t* p, int64_t K, const act_t* a, float (*out)[16]) {
    TILE_FNS[R](type, p, K, a, out);
}
