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
#define NR_MAX 8
#define MB_MAX 3

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

// One pass over NR output channels for MB rows of x: out[i * NR + r] = sum over whole chunks of 16. Each sum
// is one chain of FMAs (low half, then high half of each chunk), whatever NR and MB: the blocking changes
// speed, never bits. Each chunk's weights are decoded once for the MB rows.
TARGET static inline __attribute__((always_inline)) void pass(const int NR, const int MB, const float* xm,
                                                                int64_t K16, const uint16_t* const* rows,
                                                                float* out) {
    const __m256i zero = _mm256_setzero_si256();
    __m256 acc[NR_MAX][MB_MAX];
    for (int r = 0; r < NR; r++)
        for (int i = 0; i < MB; i++) acc[r][i] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K16; k += 16) {
#pragma GCC unroll 8
        for (int r = 0; r < NR; r++) {
            const __m256i v = _mm256_loadu_si256((const __m256i*)(rows[r] + k));
            const __m256 lo = _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, v));
            const __m256 hi = _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, v));
#pragma GCC unroll 4
            for (int i = 0; i < MB; i++) {
                const float* xi = xm + i * K16 + k;
                acc[r][i] = _mm256_fmadd_ps(lo, _mm256_loadu_ps(xi), acc[r][i]);
                acc[r][i] = _mm256_fmadd_ps(hi, _mm256_loadu_ps(xi + 8), acc[r][i]);
            }
        }
    }
    for (int r = 0; r < NR; r++)
        for (int i = 0; i < MB; i++) out[i * NR + r] = hsum(acc[r][i]);
}

// Output channels [n0, n0 + nr) for all M rows: one token takes 8 channels at a time (8 chains, 8 streams),
// more tokens 4 channels x up to 3 rows (12 accumulators: each decoded chunk serves 3 rows, and each chunk
// of a row read from cache serves 4 channels).
TARGET static void block(const float* xp, const void* x, int x_is_f32, int64_t M, int64_t K, int64_t K16,
                         const uint16_t* w, const uint16_t* bias, int64_t n0, int64_t nr, int64_t N, void* y,
                         int y_is_f32) {
    const uint16_t* rows[NR_MAX];
    for (int r = 0; r < nr; r++) rows[r] = w + (n0 + r < N ? n0 + r : N - 1) * K;  // a tail repeats the last row
    float out[NR_MAX * MB_MAX];
    for (int64_t m0 = 0; m0 < M;) {
        const float* xm = xp + m0 * K16;
        int mb;
        if (nr == 8) {
            mb = 1;
            pass(8, 1, xm, K16, rows, out);
        } else {
            mb = M - m0 < MB_MAX ? (int)(M - m0) : MB_MAX;
            switch (mb) {  // constant row counts: the accumulators stay in registers
                case 1: pass(4, 1, xm, K16, rows, out); break;
                case 2: pass(4, 2, xm, K16, rows, out); break;
                default: pass(4, 3, xm, K16, rows, out); break;
            }
        }
        for (int r = 0; r < nr && n0 + r < N; r++)
            for (int i = 0; i < mb; i++) {
                const int64_t m = m0 + i;
                float s = out[i * nr + r];
                for (int64_t k = K16; k < K; k++) s += x_at(x, x_is_f32, m * K + k) * bf16_to_f32(rows[r][k]);
                if (bias) s += bf16_to_f32(bias[n0 + r]);
                const int64_t idx = m * N + n0 + r;
                if (y_is_f32)
                    ((float*)y)[idx] = s;
                else
                    ((uint16_t*)y)[idx] = f32_to_bf16(s);
            }
        m0 += mb;
    }
}

// y = x w^T + bias (bf16 [N], or NULL); w bf16 [N, K] row-major; y [M, N] fp32 or bf16.
TARGET void bf16_gemm(const void* x, int x_is_f32, int64_t M, int64_t K, const uint16_t* w,
                      const uint16_t* bias, int64_t N, void* y, int y_is_f32, int threads) {
    const int64_t K16 = K / 16 * 16;
    float* xp = permuted_rows(x, x_is_f32, M, K, K16);
    const int64_t nr = M == 1 ? 8 : 4;
    const int64_t blocks = (N + nr - 1) / nr;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t b = 0; b < blocks; b++) block(xp, x, x_is_f32, M, K, K16, w, bias, b * nr, nr, N, y, y_is_f32);
    free(xp);
}
