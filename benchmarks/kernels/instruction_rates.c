// Throughput of the dot-product instructions the CPU kernels are built from, one core, 12 independent
// accumulator chains, operands in registers (so neither memory nor latency limits them):
//     gcc -O2 benchmarks/kernels/instruction_rates.c -o rates && ./rates
// Each line: the instruction (or the pair the AVX2 GGUF kernel uses where VNNI is missing), its rate in
// G/s and the u8 x s8 (or bf16, fp32) products each one does. Instructions the CPU lacks are skipped, so it
// runs on every x86-64 CPU with AVX2. `row_cost_bound.py` turns the rates into each GGUF kernel's
// per-row bound (docs/kernels.md).
#include <immintrin.h>
#include <stdio.h>
#include <time.h>

#define N_ITER 50000000L

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

// Times N_ITER rounds of 12 independent `a = OP(a)` and prints the rate; `x` is opaque to the compiler. The
// accumulators are 12 named variables, which stay in registers (an array of them ends up in memory, and the
// loop then measures its stores).
#define RATE(name, products, vec, init, x0, OP, reduce)                                       \
    {                                                                                         \
        vec x = x0;                                                                           \
        vec a0 = init(0), a1 = init(1), a2 = init(2), a3 = init(3), a4 = init(4), a5 = init(5);        \
        vec a6 = init(6), a7 = init(7), a8 = init(8), a9 = init(9), a10 = init(10), a11 = init(11);    \
        double t = now();                                                                     \
        for (long it = 0; it < N_ITER; it++) {                                                \
            a0 = OP(a0), a1 = OP(a1), a2 = OP(a2), a3 = OP(a3), a4 = OP(a4), a5 = OP(a5);             \
            a6 = OP(a6), a7 = OP(a7), a8 = OP(a8), a9 = OP(a9), a10 = OP(a10), a11 = OP(a11);         \
            __asm__ volatile("" : "+v"(x));                                                   \
        }                                                                                     \
        t = now() - t;                                                                        \
        vec s = a0 + a1 + a2 + a3 + a4 + a5 + a6 + a7 + a8 + a9 + a10 + a11;                  \
        printf("%-20s %.3f G/s %d products (%g)\n", name, N_ITER * 12 / t / 1e9, products,     \
               (double)reduce(s));                                                            \
    }

#define T512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))
#define TBF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
#define TVNNI __attribute__((target("avx2,avxvnni")))
#define TAVX2 __attribute__((target("avx2,fma")))

T512 static int r512i(__m512i v) { return _mm512_reduce_add_epi32(v); }
TAVX2 static int r256i(__m256i v) { return _mm256_extract_epi32(v, 0); }
T512 static float r512(__m512 v) { return _mm512_reduce_add_ps(v); }
TAVX2 static float r256(__m256 v) { return _mm256_cvtss_f32(v); }
#define I512(i) _mm512_set1_epi32(i)
#define I256(i) _mm256_set1_epi32(i)
#define F512(i) _mm512_set1_ps((float)(i))
#define F256(i) _mm256_set1_ps((float)(i))

#define VNNI512(a) _mm512_dpbusd_epi32(a, x, x)
#define FMA512(a) _mm512_fmadd_ps(a, x, x)
#define BF16512(a) _mm512_dpbf16_ps(a, (__m512bh)x, (__m512bh)x)
#define VNNI256(a) _mm256_dpbusd_avx_epi32(a, x, x)
#define FMA256(a) _mm256_fmadd_ps(a, x, x)

T512 static void zmm_vnni(void) {
    RATE("zmm vpdpbusd", 64, __m512i, I512, I512(3), VNNI512, r512i)
}
T512 static void zmm_fma(void) {
    RATE("zmm fp32 fma", 16, __m512, F512, F512(1), FMA512, r512)
}
TBF16 static void zmm_bf16(void) {
    RATE("zmm vdpbf16ps", 32, __m512, F512, F512(1), BF16512, r512)
}
TVNNI static void ymm_vnni(void) {
    RATE("ymm vpdpbusd", 32, __m256i, I256, I256(3), VNNI256, r256i)
}
// AVX2 without VNNI: u8 x s8 pairs summed to int16, then int16 pairs to int32 and added (what vpdpbusd fuses).
// The signed operands are 12 constants and the unsigned one changes every round, so no product is computed once
// for all, and no chain waits on another product's latency.
TAVX2 static void ymm_maddubs(void) {
    __m256i x = I256(3), one = _mm256_set1_epi16(1);
    __m256i a0 = I256(0), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0, a8 = a0, a9 = a0, a10 = a0,
            a11 = a0;
    __m256i y0 = I256(5), y1 = I256(6), y2 = I256(7), y3 = I256(8), y4 = I256(9), y5 = I256(10), y6 = I256(11), y7 = I256(12), y8 = I256(13), y9 = I256(14), y10 = I256(15), y11 = I256(16);
    double t = now();
    for (long it = 0; it < N_ITER; it++) {
            a0 = _mm256_add_epi32(a0, _mm256_madd_epi16(_mm256_maddubs_epi16(x, y0), one));
            a1 = _mm256_add_epi32(a1, _mm256_madd_epi16(_mm256_maddubs_epi16(x, y1), one));
            a2 = _mm256_add_epi32(a2, _mm256_madd_epi16(_mm256_maddubs_epi16(x, y2), one));
            a3 = _mm256_add_epi32(a3, _mm256_madd_epi16(_mm256_maddubs_epi16(x, y3), one));
            a4 = _mm256_add_epi32(a4, _mm256_madd_epi16(_mm256_maddubs_epi16(x, y4), one));
            a5 = _mm256_add_epi32(a5, _mm256_madd_epi16(_mm256_maddubs_epi16(x, y5), one));
            a6 = _mm256_add_epi32(a6, _mm256_madd_epi16(_mm256_maddubs_epi16(x, y6), one));
            a7 = _mm256_add_epi32(a7, _mm256_madd_epi16(_mm256_maddubs_epi16(x, y7), one));
            a8 = _mm256_add_epi32(a8, _mm256_madd_epi16(_mm256_maddubs_epi16(x, y8), one));
            a9 = _mm256_add_epi32(a9, _mm256_madd_epi16(_mm256_maddubs_epi16(x, y9), one));
            a10 = _mm256_add_epi32(a10, _mm256_madd_epi16(_mm256_maddubs_epi16(x, y10), one));
            a11 = _mm256_add_epi32(a11, _mm256_madd_epi16(_mm256_maddubs_epi16(x, y11), one));
        __asm__ volatile("" : "+v"(x));
    }
    t = now() - t;
    __m256i s = a0 + a1 + a2 + a3 + a4 + a5 + a6 + a7 + a8 + a9 + a10 + a11;
    printf("%-20s %.3f G/s %d products (%g)\n", "ymm maddubs+maddwd", N_ITER * 12 / t / 1e9, 32, (double)r256i(s));
}
TAVX2 static void ymm_fma(void) {
    RATE("ymm fp32 fma", 8, __m256, F256, F256(1), FMA256, r256)
}

int main(void) {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512vnni")) zmm_vnni();
    if (__builtin_cpu_supports("avx512bf16")) zmm_bf16();
    if (__builtin_cpu_supports("avx512f")) zmm_fma();
    if (__builtin_cpu_supports("avxvnni")) ymm_vnni();
    ymm_maddubs();
    ymm_fma();
    return 0;
}
