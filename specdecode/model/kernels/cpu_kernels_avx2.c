// bf16 GEMM for a few rows of activations on CPUs with AVX2 + FMA but without AVX512-BF16 (e.g. Zen 2/3,
// Haswell to Ice Lake client parts). There, neither our AVX512 kernels nor oneDNN's bf16 matmul run, and
// torch's bf16 linear falls back to a scalar-ish path (~1 GB/s for one token). Here each bf16 weight becomes
// an fp32 by moving its 16 bits to the top of a 32-bit lane (exact), and FMAs accumulate in fp32.
//
// y[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]), x rounded to bf16 first (as the AVX512 kernel does), fp32
// accumulation in an order that does not depend on M, so a row's result is the same whatever the other
// rows of the forward (verification rows equal single-token forwards bit for bit). Threads split the
// output channels.

#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define TARGET __attribute__((target("avx2,fma")))
#define NR 4  // output channels per pass: 4 weight streams, 8 accumulation chains for one token

int avx2_supported(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
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

static inline float round_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }

// x [M, K] (fp32 or bf16) as fp32 values of bf16, each chunk of 16 permuted to the lanes that the weight
// decode produces: unpacking 16 bf16 against zero gives, per 128-bit half, elements 0-3 / 8-11 (low) and
// 4-7 / 12-15 (high). Returns [M, K16] with K16 = K rounded down to 16; the tail stays in `x`.
static float* permuted_rows(const void* x, int x_is_f32, int64_t M, int64_t K, int64_t K16) {
    float* out = (float*)malloc((size_t)(M * (K16 > 0 ? K16 : 1)) * sizeof(float));
    static const int order[16] = {0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15};
    for (int64_t m = 0; m < M; m++)
        for (int64_t k = 0; k < K16; k += 16)
            for (int j = 0; j < 16; j++) {
                const int64_t idx = m * K + k + order[j];
                const float v = x_is_f32 ? round_bf16(((const float*)x)[idx]) : bf16_to_f32(((const uint16_t*)x)[idx]);
                out[m * K16 + k + j] = v;
            }
    return out;
}

static inline float x_at(const void* x, int x_is_f32, int64_t idx) {
    return x_is_f32 ? round_bf16(((const float*)x)[idx]) : bf16_to_f32(((const uint16_t*)x)[idx]);
}

TARGET static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

TARGET static void block(const float* xp, const void* x, int x_is_f32, int64_t M, int64_t K, int64_t K16,
                         const uint16_t* w, const uint16_t* bias, int64_t n0, int64_t N, void* y, int y_is_f32) {
    const uint16_t* rows[NR];
    for (int r = 0; r < NR; r++) rows[r] = w + (n0 + r < N ? n0 + r : N - 1) * K;  // a tail repeats the last row
    const __m256i zero = _mm256_setzero_si256();
    for (int64_t m = 0; m < M; m++) {  // later rows find the block's weights in L2
        const float* xm = xp + m * K16;
        __m256 lo[NR], hi[NR];
        for (int r = 0; r < NR; r++) lo[r] = hi[r] = _mm256_setzero_ps();
        for (int64_t k = 0; k < K16; k += 16) {
            const __m256 xl = _mm256_loadu_ps(xm + k), xh = _mm256_loadu_ps(xm + k + 8);
#pragma GCC unroll 4
            for (int r = 0; r < NR; r++) {
                const __m256i v = _mm256_loadu_si256((const __m256i*)(rows[r] + k));
                lo[r] = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, v)), xl, lo[r]);
                hi[r] = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, v)), xh, hi[r]);
            }
        }
        for (int r = 0; r < NR && n0 + r < N; r++) {
            float s = hsum(_mm256_add_ps(lo[r], hi[r]));
            for (int64_t k = K16; k < K; k++) s += x_at(x, x_is_f32, m * K + k) * bf16_to_f32(rows[r][k]);
            if (bias) s += bf16_to_f32(bias[n0 + r]);
            const int64_t idx = m * N + n0 + r;
            if (y_is_f32)
                ((float*)y)[idx] = s;
            else
                ((uint16_t*)y)[idx] = f32_to_bf16(s);
        }
    }
}

// y = x w^T + bias (bf16 [N], or NULL); w bf16 [N, K] row-major; y [M, N] fp32 or bf16.
TARGET void bf16_gemm(const void* x, int x_is_f32, int64_t M, int64_t K, const uint16_t* w,
                      const uint16_t* bias, int64_t N, void* y, int y_is_f32, int threads) {
    const int64_t K16 = K / 16 * 16;
    float* xp = permuted_rows(x, x_is_f32, M, K, K16);
    const int64_t blocks = (N + NR - 1) / NR;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t b = 0; b < blocks; b++) block(xp, x, x_is_f32, M, K, K16, w, bias, b * NR, N, y, y_is_f32);
    free(xp);
}
