// bf16 GEMM for a few rows of activations on CPUs with AVX2 + FMA but without AVX512-BF16 (e.g. Zen 2/3,
// Haswell to Ice Lake client parts). There, neither our AVX512 kernels nor oneDNN's bf16 matmul run, and
// torch's bf16 linear falls back to a scalar-ish path (~1 GB/s for one token). Here each bf16 weight becomes
// an fp32 by moving its 16 bits to the top of a 32-bit lane (exact), and FMAs accumulate in fp32.
//
// y[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]), x rounded to bf16 first (as the AVX512 kernel does). Each
// output is one chain of FMAs over k = 0, 1, ..., K-1 whatever M and the blocking, so a row's result is the
// same whatever the other rows of the forward (verification rows equal single-token forwards bit for bit).
//
// Weights are pre-packed (`bf16_pack_avx2`): groups of 16 output channels, k-major inside a group
// ([N/16][K][16]), so that one 32-byte load gives 16 channels at one k, and each broadcast activation feeds
// 2 FMAs per group (an outer product: as BLAS kernels do, and ~1.5x fewer loads per FMA than dot products over
// the [N, K] layout, which mattered because verification rows are bound by arithmetic here). Inside a group
// the channels are stored in the order 0-3, 8-11, 4-7, 12-15: unpacking 16 bf16 against zero works per
// 128-bit half, so the low unpack then gives channels 0-7 and the high one 8-15. Threads split the groups.
//
// Weight-only int8 (`int8_gemm`) uses the same layout and loops with int8 weights ([N/16][K][16], channels in
// natural order: each half of 16 bytes sign-extends to 8 int32, then converts to fp32 exactly) and one scale per
// output channel applied to the finished sum: half the bytes of bf16 for a draft's or an opted-in target's
// single-token reads.
//
// The fp32 GEMM (`f32_gemm`) reads the fp32 model's own [N, K] weights: each output a dot product over k in 8 lanes
// summed in a fixed order, whatever the blocking of rows and channels around it.
//
// The decoder ops and the layer stack (`rms_norm_bf16`, `rope_qkv_bf16`, `silu_mul_bf16`, `decode_layers`) are
// cpu_kernels.c's for these CPUs: the same roundings in the same order, 8-wide, with every linear of the stack a
// GEMM function of this library or the GGUF one (`LIN_GEMM_FN`).
//
// Attention (`attend_bf16`, `attend_f32`) is cpu_kernels.c's in 8-wide vectors: each query over the slots it sees,
// gathered in slot order, so that a token's result does not depend on the forward it is in.

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define TARGET __attribute__((target("avx2,fma")))
#define GROUP 16
#define NB_MAX 4  // channel groups per pass: 4 for one row, 2 for two or three, else 1 (8 to 12 chains in flight)
#define RB_MAX 6  // rows per pass: 6 x 2 accumulators + 2 weight registers + 1 broadcast of 16 ymm registers

int avx2_supported(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

int bf16_pack_group(void) { return GROUP; }

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

enum { W_BF16 = 0, W_INT8 = 1 };

// The 16 weights of a group at k as fp32 (channels 0-7, 8-15).
TARGET static inline __attribute__((always_inline)) void weights_at(const int W, const void* group, int64_t k,
                                                                      __m256* lo, __m256* hi) {
    if (W == W_BF16) {
        const __m256i v = _mm256_loadu_si256((const __m256i*)((const uint16_t*)group + k * GROUP));
        *lo = _mm256_castsi256_ps(_mm256_unpacklo_epi16(_mm256_setzero_si256(), v));  // channels 0-7
        *hi = _mm256_castsi256_ps(_mm256_unpackhi_epi16(_mm256_setzero_si256(), v));  // channels 8-15
    } else {
        const int8_t* q = (const int8_t*)group + k * GROUP;
        *lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)q)));
        *hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(q + 8))));
    }
}

// One pass over K for NB channel groups and RB rows: out[i * stride + b * 16 + c], channels in natural order.
TARGET static inline __attribute__((always_inline)) void pass(const int W, const int NB, const int RB, const float* xt,
                                                                int64_t M, int64_t K, const void* const* groups,
                                                                float* out, int stride) {
    __m256 acc[NB_MAX][2][RB_MAX];
    for (int b = 0; b < NB; b++)
        for (int i = 0; i < RB; i++) acc[b][0][i] = acc[b][1][i] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k++) {
        const float* xk = xt + k * M;
#pragma GCC unroll 4
        for (int b = 0; b < NB; b++) {
            __m256 lo, hi;
            weights_at(W, groups[b], k, &lo, &hi);
#pragma GCC unroll 6
            for (int i = 0; i < RB; i++) {
                const __m256 xv = _mm256_broadcast_ss(xk + i);
                acc[b][0][i] = _mm256_fmadd_ps(lo, xv, acc[b][0][i]);
                acc[b][1][i] = _mm256_fmadd_ps(hi, xv, acc[b][1][i]);
            }
        }
    }
    for (int b = 0; b < NB; b++)
        for (int i = 0; i < RB; i++) {
            _mm256_storeu_ps(out + i * stride + b * GROUP, acc[b][0][i]);
            _mm256_storeu_ps(out + i * stride + b * GROUP + 8, acc[b][1][i]);
        }
}

// Rows [m0, m0 + rb) through the unit's nb groups into out [rb][nb * 16]; returns rb. Constant NB and RB keep
// the accumulators in registers; a unit of 2 groups takes up to 3 rows together, more rows one group at a time.
TARGET static inline __attribute__((always_inline)) int rows_pass(const int W, int nb, const float* xt, int64_t M,
                                                                    int64_t m0, int64_t K, const void* const* groups,
                                                                    float* out) {
    const int s = nb * GROUP;
    if (nb == NB_MAX) {  // one row
        pass(W, NB_MAX, 1, xt, M, K, groups, out, s);
        return 1;
    }
    const int rb = M - m0 < RB_MAX ? (int)(M - m0) : RB_MAX;
    const float* xm = xt + m0;
    switch (rb) {
        case 1: pass(W, 2, 1, xm, M, K, groups, out, s); break;
        case 2: pass(W, 2, 2, xm, M, K, groups, out, s); break;
        case 3: pass(W, 2, 3, xm, M, K, groups, out, s); break;
        case 4: pass(W, 1, 4, xm, M, K, groups, out, s); pass(W, 1, 4, xm, M, K, groups + 1, out + GROUP, s); break;
        case 5: pass(W, 1, 5, xm, M, K, groups, out, s); pass(W, 1, 5, xm, M, K, groups + 1, out + GROUP, s); break;
        default:
            pass(W, 1, RB_MAX, xm, M, K, groups, out, s);
            pass(W, 1, RB_MAX, xm, M, K, groups + 1, out + GROUP, s);
            break;
    }
    return rb;
}

// y [M, N] = (x [M, K] rounded to bf16) times the packed weights (W: bf16 or int8, each group K * 16 elements of
// `width` bytes), times scale[n] (bf16, int8 only), plus bias[n] (bf16 or NULL), rounded once at the end.
TARGET static inline __attribute__((always_inline)) void gemm(const int W, const void* x, int x_is_f32, int64_t M,
                                                                int64_t K, const void* wp, const uint16_t* scale,
                                                                const uint16_t* bias, int64_t N, void* y,
                                                                int y_is_f32, int threads) {
    const int64_t width = W == W_BF16 ? 2 : 1;
    float* xt = (float*)malloc((size_t)(M * K) * sizeof(float));  // [K, M]: a pass's broadcasts share lines
    for (int64_t m = 0; m < M; m++)
        for (int64_t k = 0; k < K; k++) {
            const int64_t idx = m * K + k;
            xt[k * M + m] = x_is_f32 ? bf16_to_f32(f32_to_bf16(((const float*)x)[idx]))
                                     : bf16_to_f32(((const uint16_t*)x)[idx]);
        }
    const int64_t n_groups = (N + GROUP - 1) / GROUP;
    const int nb = M == 1 ? NB_MAX : 2;
    const int64_t units = (n_groups + nb - 1) / nb;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t u = 0; u < units; u++) {
        const int64_t g0 = u * nb;
        const int used = (int)(n_groups - g0 < nb ? n_groups - g0 : nb);
        const void* groups[NB_MAX];
        for (int b = 0; b < nb; b++)  // a tail repeats the last group
            groups[b] = (const char*)wp + (g0 + (b < used ? b : used - 1)) * K * GROUP * width;
        float out[RB_MAX * NB_MAX * GROUP];
        for (int64_t m0 = 0; m0 < M;) {
            const int rb = rows_pass(W, nb, xt, M, m0, K, groups, out);
            for (int i = 0; i < rb; i++)
                for (int b = 0; b < used; b++)
                    for (int c = 0; c < GROUP && (g0 + b) * GROUP + c < N; c++) {
                        const int64_t n = (g0 + b) * GROUP + c;
                        float v = out[(i * nb + b) * GROUP + c];
                        if (scale) v *= bf16_to_f32(scale[n]);
                        if (bias) v += bf16_to_f32(bias[n]);
                        const int64_t idx = (m0 + i) * N + n;
                        if (y_is_f32)
                            ((float*)y)[idx] = v;
                        else
                            ((uint16_t*)y)[idx] = f32_to_bf16(v);
                    }
            m0 += rb;
        }
    }
    free(xt);
}

// wp bf16 [N/16 rounded up][K][16] (bf16_pack_avx2); x [M, K] fp32 or bf16; y [M, N] fp32 or bf16; bias bf16 [N]
// or NULL, added in fp32 before the result is rounded.
TARGET void bf16_gemm(const void* x, int x_is_f32, int64_t M, int64_t K, const uint16_t* wp, const uint16_t* bias,
                      int64_t N, void* y, int y_is_f32, int threads) {
    gemm(W_BF16, x, x_is_f32, M, K, wp, NULL, bias, N, y, y_is_f32, threads);
}

// qp int8 [N/16 rounded up][K][16] (int8_pack_avx2), scale bf16 [N]: y = (x q^T) * scale, as torch's
// _weight_int8pack_mm computes it.
TARGET void int8_gemm(const void* x, int x_is_f32, int64_t M, int64_t K, const int8_t* qp, const uint16_t* scale,
                      int64_t N, void* y, int y_is_f32, int threads) {
    gemm(W_INT8, x, x_is_f32, M, K, qp, scale, NULL, N, y, y_is_f32, threads);
}

// ---- fp32 ----------------------------------------------------------------------------------------------------

TARGET static inline __attribute__((always_inline)) float hsum8(__m256 v) {  // fixed order: halves, pairs, lanes
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

// Rows [0, MB) of x against NR weight rows: out[i * NR + r] = x[i] . w[r], lanes k mod 8, the tail masked.
TARGET static inline __attribute__((always_inline)) void f32_pass(const int NR, const int MB, const float* x,
                                                                    int64_t K, const float* const* rows, float* out) {
    __m256 acc[8][2];
    for (int r = 0; r < NR; r++)
        for (int i = 0; i < MB; i++) acc[r][i] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k += 8) {
        const int64_t left = K - k;
        const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(left < 8 ? (int)left : 8),
                                                _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
        __m256 xv[2];
        for (int i = 0; i < MB; i++) xv[i] = _mm256_maskload_ps(x + i * K + k, mask);
        for (int r = 0; r < NR; r++) {
            const __m256 wv = _mm256_maskload_ps(rows[r] + k, mask);
            for (int i = 0; i < MB; i++) acc[r][i] = _mm256_fmadd_ps(wv, xv[i], acc[r][i]);
        }
    }
    for (int r = 0; r < NR; r++)
        for (int i = 0; i < MB; i++) out[i * NR + r] = hsum8(acc[r][i]);
}

// y = x w^T + bias, all fp32: x [M, K], w [N, K], bias [N] or NULL, y [M, N]. One row: 8 channels per pass (reads
// the weights once); more: 4 channels by 2 rows.
TARGET void f32_gemm(const float* x, int64_t M, int64_t K, const float* w, const float* bias, int64_t N, float* y,
                     int threads) {
    const int nr = M == 1 ? 8 : 4;
    const int64_t blocks = (N + nr - 1) / nr;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t n0 = b * nr;
        const float* rows[8];
        for (int r = 0; r < nr; r++) rows[r] = w + (n0 + r < N ? n0 + r : N - 1) * K;  // a tail repeats the last
        float out[16];
        for (int64_t m0 = 0; m0 < M; m0 += 2) {
            const int mb = M - m0 < 2 ? 1 : 2;
            if (nr == 8)
                f32_pass(8, 1, x + m0 * K, K, rows, out);
            else if (mb == 1)
                f32_pass(4, 1, x + m0 * K, K, rows, out);
            else
                f32_pass(4, 2, x + m0 * K, K, rows, out);
            for (int r = 0; r < nr && n0 + r < N; r++)
                for (int i = 0; i < mb; i++) y[(m0 + i) * N + n0 + r] = out[i * nr + r] + (bias ? bias[n0 + r] : 0.0f);
        }
    }
}

// ---- attention ------------------------------------------------------------------------------------------------

// p * 2^n for integral n in [-126, 128], from the exponent bits (128 gives inf): exact scaling.
TARGET static inline __attribute__((always_inline)) __m256 times_pow2(__m256 p, __m256 n) {
    const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

// exp(x) for x <= 0, as cpu_kernels.c's exp_nonpositive: 2^n * e^r, |r| <= ln2 / 2, degree-6 polynomial;
// below -87.3 (and -inf, a masked score) gives 0.
TARGET static inline __attribute__((always_inline)) __m256 exp_nonpositive8(__m256 x) {
    const __m256 lo = _mm256_set1_ps(-87.3f);
    const __m256 tiny = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    x = _mm256_max_ps(x, lo);
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);  // ln2 in two parts (Cody-Waite)
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.0f / 720);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    return _mm256_andnot_ps(tiny, times_pow2(p, n));  // n in [-126, 0]
}

TARGET static inline __attribute__((always_inline)) __m256 load8(const void* p, int64_t i, int f32) {
    if (f32) return _mm256_loadu_ps((const float*)p + i);
    const __m128i h = _mm_loadu_si128((const __m128i*)((const uint16_t*)p + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// q [B, H, T, hd] (contiguous, roped); k, v: element (b, kvh, s, d) at b * bs + kvh * hs + s * hd + d; mask
// [B, T, S] (1 = attend) or NULL = every slot < S; out [B, T, H * hd]; all bf16 or all fp32. hd: a multiple of 16,
// at most 256 (as the AVX512 kernel takes).
TARGET static inline __attribute__((always_inline)) void attend(const int f32, const void* q, const void* k,
                                                                  const void* v, const uint8_t* mask, int64_t B,
                                                                  int64_t H, int64_t KVH, int64_t T, int64_t S,
                                                                  int64_t hd, int64_t bs, int64_t hs, float scale,
                                                                  void* out, int threads) {
    const int64_t groups = H / KVH;
#pragma omp parallel num_threads(threads)
    {
        float* p = (float*)malloc((size_t)(S + 8) * sizeof(float));  // scores, then probabilities, of seen slots
        int64_t* seen = (int64_t*)malloc((size_t)S * sizeof(int64_t));
#pragma omp for schedule(static) collapse(2)
        for (int64_t b = 0; b < B; b++)
            for (int64_t h = 0; h < H; h++) {
                const int64_t kv_at = b * bs + (h / groups) * hs;
                for (int64_t t = 0; t < T; t++) {
                    const int64_t q_at = ((b * H + h) * T + t) * hd;
                    const uint8_t* mr = mask ? mask + (b * T + t) * S : NULL;
                    __m256 qv[32];
                    for (int64_t d = 0; d < hd; d += 8) qv[d / 8] = load8(q, q_at + d, f32);
                    int64_t n = 0;
                    float mx = -INFINITY;
                    for (int64_t s = 0; s < S; s++) {
                        if (mr && !mr[s]) continue;
                        __m256 acc = _mm256_setzero_ps();
                        for (int64_t d = 0; d < hd; d += 8)
                            acc = _mm256_fmadd_ps(qv[d / 8], load8(k, kv_at + s * hd + d, f32), acc);
                        p[n] = hsum8(acc) * scale;
                        mx = p[n] > mx ? p[n] : mx;
                        seen[n++] = s;
                    }
                    for (int64_t i = n; i < n + 8; i++) p[i] = -INFINITY;  // the last vector's tail: exp gives 0
                    __m256 sum = _mm256_setzero_ps();
                    const __m256 mxv = _mm256_set1_ps(mx);
                    for (int64_t i = 0; i < n; i += 8) {
                        const __m256 e = exp_nonpositive8(_mm256_sub_ps(_mm256_loadu_ps(p + i), mxv));
                        _mm256_storeu_ps(p + i, e);
                        sum = _mm256_add_ps(sum, e);
                    }
                    const float inv = 1.0f / hsum8(sum);
                    __m256 o[32];
                    for (int64_t d = 0; d < hd; d += 8) o[d / 8] = _mm256_setzero_ps();
                    for (int64_t i = 0; i < n; i++) {
                        const __m256 ps = _mm256_set1_ps(p[i] * inv);
                        const int64_t v_at = kv_at + seen[i] * hd;
                        for (int64_t d = 0; d < hd; d += 8)
                            o[d / 8] = _mm256_fmadd_ps(ps, load8(v, v_at + d, f32), o[d / 8]);
                    }
                    const int64_t o_at = (b * T + t) * H * hd + h * hd;
                    for (int64_t d = 0; d < hd; d += 8) {
                        float lane[8];
                        _mm256_storeu_ps(lane, o[d / 8]);
                        for (int j = 0; j < 8; j++) {
                            if (f32)
                                ((float*)out)[o_at + d + j] = lane[j];
                            else
                                ((uint16_t*)out)[o_at + d + j] = f32_to_bf16(lane[j]);
                        }
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

// ---- decoder ops ----------------------------------------------------------------------------------------------

TARGET static inline __attribute__((always_inline)) __m256 load_bf16x8(const uint16_t* p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}

TARGET static inline __attribute__((always_inline)) __m256i bf16_bits8(__m256 v) {  // round to nearest even
    const __m256i u = _mm256_castps_si256(v);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    return _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), odd), 16);
}

TARGET static inline __attribute__((always_inline)) __m256 round_bf16x8(__m256 v) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits8(v), 16));
}

TARGET static inline __attribute__((always_inline)) void store_bf16x8(uint16_t* p, __m256 v) {
    const __m256i b = bf16_bits8(v);
    _mm_storeu_si128((__m128i*)p, _mm_packus_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1)));
}

// y = weight * bf16(x * rsqrt(mean(x^2) + eps)) per row, bf16 [M, D] (D a multiple of 8 is fast, any D works).
TARGET void rms_norm_bf16(const uint16_t* x, const uint16_t* w, float eps, int64_t M, int64_t D, uint16_t* y) {
    const int64_t D8 = D - D % 8;
    for (int64_t m = 0; m < M; m++) {
        const uint16_t* xm = x + m * D;
        __m256 acc = _mm256_setzero_ps();
        for (int64_t k = 0; k < D8; k += 8) {
            const __m256 v = load_bf16x8(xm + k);
            acc = _mm256_fmadd_ps(v, v, acc);
        }
        float ss = hsum8(acc);
        for (int64_t k = D8; k < D; k++) ss += bf16_to_f32(xm[k]) * bf16_to_f32(xm[k]);
        const float r = 1.0f / sqrtf(ss / (float)D + eps);
        const __m256 rv = _mm256_set1_ps(r);
        for (int64_t k = 0; k < D8; k += 8) {
            const __m256 normed = round_bf16x8(_mm256_mul_ps(load_bf16x8(xm + k), rv));
            store_bf16x8(y + m * D + k, _mm256_mul_ps(normed, load_bf16x8(w + k)));
        }
        for (int64_t k = D8; k < D; k++)
            y[m * D + k] = f32_to_bf16(bf16_to_f32(f32_to_bf16(bf16_to_f32(xm[k]) * r)) * bf16_to_f32(w[k]));
    }
}

// Rotary embedding with the cache write, as cpu_kernels.c's (plain C: its cost is small beside the linears).
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

// exp(x) over the whole float range, as cpu_kernels.c's exp16: 2^n * e^r, degree-7 polynomial (x clamped so
// that n lies in [-126, 128]: 128 gives inf, as expf overflows).
TARGET static inline __attribute__((always_inline)) __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(89.0f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145752f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.42860677e-6f), r);
    __m256 p = _mm256_set1_ps(1.0f / 5040);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 720));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    return times_pow2(p, n);
}

// y = bf16(bf16(silu(gate)) * up) for gate_up [M, 2 * I] (gate first), silu in fp32 as x / (1 + exp(-x)).
TARGET void silu_mul_bf16(const uint16_t* gate_up, int64_t M, int64_t I, uint16_t* y) {
    const int64_t I8 = I - I % 8;
    const __m256 one = _mm256_set1_ps(1.0f);
    for (int64_t m = 0; m < M; m++) {
        const uint16_t *g = gate_up + m * 2 * I, *u = g + I;
        for (int64_t i = 0; i < I8; i += 8) {
            const __m256 gv = load_bf16x8(g + i);
            const __m256 act = round_bf16x8(_mm256_div_ps(gv, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv)))));
            store_bf16x8(y + m * I + i, _mm256_mul_ps(act, load_bf16x8(u + i)));
        }
        for (int64_t i = I8; i < I; i++) {
            const float gf = bf16_to_f32(g[i]);
            const float act = bf16_to_f32(f32_to_bf16(gf / (1.0f + expf(-gf))));
            y[m * I + i] = f32_to_bf16(act * bf16_to_f32(u[i]));
        }
    }
}

// ---- the decoder layers of a few-row forward in one call (cpu_kernels.c's `decode_layers`) ------------------

typedef void (*gemm_fn)(const void* x, int x_is_f32, int64_t M, int64_t K, const uint16_t* w, const uint16_t* bias,
                        int64_t N, void* y, int y_is_f32, int threads);

typedef struct {  // cpu_kernels.c's linear_t; here every linear is a GEMM function (the GGUF or the bf16 one)
    int64_t kind, n, k;
    const void* w;
    const void* a;  // the gemm_fn
    const void* b;
    const void* bias;
    double qmax;
} linear_t;

typedef struct {
    const uint16_t* norm1;
    const uint16_t* norm2;
    linear_t qkv, o, gate_up, down;
} layer_t;

static void add_bf16(uint16_t* x, const uint16_t* y, int64_t n, int64_t rows) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t i = 0; i < n; i++)
            x[r * n + i] = f32_to_bf16(bf16_to_f32(x[r * n + i]) + bf16_to_f32(y[r * n + i]));
}

static void linear_run(const linear_t* l, const uint16_t* x, int64_t M, uint16_t* y, int threads) {
    ((gemm_fn)l->a)(x, 0, M, l->k, (const uint16_t*)l->w, (const uint16_t*)l->bias, l->n, y, 0, threads);
}

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
        add_bf16(x, h, D, M);
        rms_norm_bf16(x, ly->norm2, eps, M, D, h);
        linear_run(&ly->gate_up, h, M, gu, threads);
        silu_mul_bf16(gu, M, I, act);
        linear_run(&ly->down, act, M, h, threads);
        add_bf16(x, h, D, M);
    }
    free(act);
    free(gu);
    free(att);
    free(q);
    free(qkv);
    free(h);
}
