// The AVX512-VNNI kernel of gguf_common.c's GEMM: a tile's 16 channels in one 512-bit register, every
// block product with `vpdpbusd` (unsigned codes x signed activations), each decoded tile-block serving up to
// 16 rows (a 16-row verification decodes and reads each weight block once: 10-20% less time than two passes
// of 8 rows, `benchmarks/kernels/gguf_rows.py --rows-max 8,16`).

#include <immintrin.h>

#define TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,f16c,fma")))
#define ISA_FN TARGET
#define INLINE static inline __attribute__((always_inline, target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,f16c,fma")))

int gguf_supported(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
           __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("f16c") && __builtin_cpu_supports("fma");
}

const char* gguf_isa(void) { return "avx512"; }

// Row x (K values) -> int8 per block of 32: d = max|x| / 127, q = round-to-even(x / d).
TARGET static void quantize_row(const void* x, int x_is_f32, int64_t K, act_t* out, int64_t stride) {
    for (int64_t b = 0; b < K / 32; b++) {
        act_t* o = out + b * stride;
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
        _mm_storeu_si128((__m128i*)(o->q), _mm512_cvtsepi32_epi8(i0));
        _mm_storeu_si128((__m128i*)(o->q + 16), _mm512_cvtsepi32_epi8(i1));
        const int32_t s0 = _mm512_reduce_add_epi32(i0), s1 = _mm512_reduce_add_epi32(i1);
        o->bs16[0] = s0;
        o->bs16[1] = s1;
        o->d = db;
        o->fs = db * (float)(s0 + s1);
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
    prefetch_ahead(p, 256 + 64 * hi);
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

// acc[r] (16 channels) += this tile's products with the R rows of `a` over all of K. Unrolled, so that the
// accumulators stay in registers and each row's activations are read at fixed offsets.
#define ROWS_LOOP _Pragma("GCC unroll 16") for (int r = 0; r < R; r++)

INLINE void tile_simple(int64_t type, const uint8_t* p, int64_t nb, const act_t* a, int R, __m512* acc) {
    __m512i w[8];
    const int hi = type == Q5_0;
    const int off = type == Q4_0 ? -8 : type == Q5_0 ? -16 : type == Q8_0 ? -128 : 0;
    for (int64_t b = 0; b < nb; b++) {
        // The block's header, and Q8_0's codes (decode_sub prefetches the other types' codes).
        prefetch_ahead(p, type == Q4_1 ? 64 : type == Q8_0 ? 32 + 512 : 32);
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
            const __m512i init = _mm512_set1_epi32(off * (ACT(b).bs16[0] + ACT(b).bs16[1]));
            const __m512 s = _mm512_mul_ps(_mm512_cvtepi32_ps(dot32(w, ACT(b).q, init)), _mm512_set1_ps(ACT(b).d));
            acc[r] = _mm512_fmadd_ps(s, dw, acc[r]);
            if (type == Q4_1) acc[r] = _mm512_fmadd_ps(mw, _mm512_set1_ps(ACT(b).fs), acc[r]);
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
        prefetch_ahead(p, 256);
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
                const __m512 s = _mm512_mul_ps(_mm512_cvtepi32_ps(dot32(w, ACT(blk).q, _mm512_setzero_si512())),
                                               _mm512_set1_ps(ACT(blk).d));
                acc[r] = _mm512_fmadd_ps(s, dsc, acc[r]);
                acc[r] = _mm512_fnmadd_ps(dmn, _mm512_set1_ps(ACT(blk).fs), acc[r]);
            }
        }
    }
}

// Q6_K: d (fp16 x 16), int8 scales [16 sub-blocks of 16][16 channels], 8 sub-blocks of 32 with 2 bit planes.
INLINE void tile_q6k(const uint8_t* p, int64_t nb, const act_t* a, int R, __m512* acc) {
    __m512i w[8];
    for (int64_t b = 0; b < nb; b++) {
        prefetch_ahead(p, 288);
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
                const int8_t* q = ACT(blk).q;
                const __m512i i0 = dot16(w, q, _mm512_set1_epi32(-32 * ACT(blk).bs16[0]));
                const __m512i i1 = dot16(w + 4, q + 16, _mm512_set1_epi32(-32 * ACT(blk).bs16[1]));
                __m512 t = _mm512_mul_ps(_mm512_cvtepi32_ps(i0), s0);
                t = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i1), s1, t);
                acc[r] = _mm512_fmadd_ps(t, _mm512_set1_ps(ACT(blk).d), acc[r]);
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

#define ROWS_MAX 16  // 16 accumulators + 8 code vectors + temporaries in 32 zmm registers

// One tile (16 channels) for up to ROWS_MAX rows into out[r][16]; the row count is a constant in each
// specialization, so the accumulators stay in registers.
#define SPECIALIZE(RR)                                                                                   \
    TARGET static void tile_##RR(int64_t type, const uint8_t* p, int64_t K, const act_t* a, float (*out)[16]) { \
        __m512 acc[RR];                                                                                  \
        tile_rows(type, p, K, a, RR, acc);                                                               \
        for (int r = 0; r < RR; r++) _mm512_storeu_ps(out[r], acc[r]);                                   \
    }
SPECIALIZE(1)
SPECIALIZE(2)
SPECIALIZE(3)
SPECIALIZE(4)
SPECIALIZE(5)
SPECIALIZE(6)
SPECIALIZE(7)
SPECIALIZE(8)
SPECIALIZE(9)
SPECIALIZE(10)
SPECIALIZE(11)
SPECIALIZE(12)
SPECIALIZE(13)
SPECIALIZE(14)
SPECIALIZE(15)
SPECIALIZE(16)

typedef void (*tile_fn)(int64_t, const uint8_t*, int64_t, const act_t*, float (*)[16]);
static const tile_fn TILE_FNS[17] = {NULL,    tile_1,  tile_2,  tile_3,  tile_4,  tile_5,  tile_6,  tile_7, tile_8,
                                     tile_9, tile_10, tile_11, tile_12, tile_13, tile_14, tile_15, tile_16};

static void tile_rows_out(int R, int64_t type, const uint8_t* p, int64_t K, const act_t* a, float (*out)[16]) {
    TILE_FNS[R](type, p, K, a, out);
}
