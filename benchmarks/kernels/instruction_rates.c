// Throughput of the dot-product instructions the CPU kernels are built from, one core, 24 independent
// accumulator chains, operands in registers (so neither memory nor latency limits them):
//     gcc -O2 benchmarks/kernels/instruction_rates.c -o rates && ./rates
// Each line: the instruction (or the pair the AVX2 GGUF kernel uses where VNNI is missing), its rate in
// G/s and the u8 x s8 (or bf16, fp32) products each one does. Instructions the CPU lacks are skipped, so it
// runs on every x86-64 CPU with AVX2. `row_cost_bound.py` turns the rates into each GGUF kernel's
// per-row bound. Per-core VNNI on 512-bit registers runs at half the rate of vdpbf16ps on Zen 4, so an integer
// kernel only pays while it needs at most one vpdpbusd per 64 weights (docs/kernels.md).
#include <immintrin.h>
#include <stdio.h>
#include <time.h>

#define N_ITER 50000000L

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

// Times N_ITER rounds of 24 independent `acc[i] = OP` and prints the rate; `x` is opaque to the compiler.
#define RATE(name, products, vec, init, x0, OP, reduce)                        \
    {                                                                          \
        vec acc[24];                                                           \
        for (int i = 0; i < 24; i++) acc[i] = init(i);                         \
        vec x = x0;                                                            \
        double t = now();                                                      \
        for (long it = 0; it < N_ITER; it++) {                                 \
            _Pragma("GCC unroll 24") for (int i = 0; i < 24; i++) acc[i] = OP; \
            __asm__ volatile("" : "+v"(x));                                    \
        }                                                                      \
        t = now() - t;                                                         \
        vec s = acc[0];                                                        \
        for (int i = 1; i < 24; i++) s = s + acc[i];                           \
        printf("%-20s %.3f G/s %d products (%g)\n", name, N_ITER * 24 / t / 1e9, products, (double)reduce(s)); \
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

T512 static void zmm_vnni(void) {
    RATE("zmm vpdpbusd", 64, __m512i, I512, I512(3), _mm512_dpbusd_epi32(acc[i], x, x), r512i)
}
T512 static void zmm_fma(void) {
    RATE("zmm fp32 fma", 16, __m512, F512, F512(1), _mm512_fmadd_ps(acc[i], x, x), r512)
}
TBF16 static void zmm_bf16(void) {
    RATE("zmm vdpbf16ps", 32, __m512, F512, F512(1), _mm512_dpbf16_ps(acc[i], (__m512bh)x, (__m512bh)x), r512)
}
TVNNI static void ymm_vnni(void) {
    RATE("ymm vpdpbusd", 32, __m256i, I256, I256(3), _mm256_dpbusd_avx_epi32(acc[i], x, x), r256i)
}
// AVX2 without VNNI: u8 x s8 pairs summed to int16, then int16 pairs to int32 and added (what vpdpbusd fuses).
TAVX2 static void ymm_maddubs(void) {
    RATE("ymm maddubs+maddwd", 32, __m256i, I256, I256(3),
         _mm256_add_epi32(acc[i], _mm256_madd_epi16(_mm256_maddubs_epi16(x, x), I256(0x00010001))), r256i)
}
TAVX2 static void ymm_fma(void) {
    RATE("ymm fp32 fma", 8, __m256, F256, F256(1), _mm256_fmadd_ps(acc[i], x, x), r256)
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
