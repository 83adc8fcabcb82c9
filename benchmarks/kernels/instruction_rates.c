// Throughput of the dot-product instructions the CPU kernels are built from, one core, 24 independent
// accumulator chains, operands in registers (so neither memory nor latency limits them):
//     gcc -O2 benchmarks/kernels/instruction_rates.c -o rates && ./rates
// On the 2-core Zen 4 VMs (2026-12-02), per core: zmm vpdpbusd 1.53 G/s (64 u8 x s8 products each), ymm
// vpdpbusd 3.36 G/s (32), zmm vdpbf16ps 3.51 G/s (32 bf16 products), zmm fp32 FMA 3.19 G/s (16); a second run
// gave 1.65, 3.04, 3.36 and 3.29. VNNI on 512-bit registers runs at half the rate of vdpbf16ps there, so an
// integer kernel only pays while it needs at most one vpdpbusd per 64 weights (docs/kernels.md).
#include <immintrin.h>
#include <stdio.h>
#include <time.h>

#define T __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx512bf16")))
#define N_ITER 50000000L

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

// Times N_ITER rounds of 24 independent `acc[i] = OP` and prints the rate; `x` is opaque to the compiler.
#define RATE(name, vec, init, x0, OP, reduce)                                  \
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
        printf("%-16s %.2f G/s (%g)\n", name, N_ITER * 24 / t / 1e9, (double)reduce(s)); \
    }

T static int r512i(__m512i v) { return _mm512_reduce_add_epi32(v); }
T static int r256i(__m256i v) { return _mm256_extract_epi32(v, 0); }
T static float r512(__m512 v) { return _mm512_reduce_add_ps(v); }
#define I512(i) _mm512_set1_epi32(i)
#define I256(i) _mm256_set1_epi32(i)
#define F512(i) _mm512_set1_ps((float)(i))

T int main(void) {
    RATE("zmm vpdpbusd", __m512i, I512, I512(3), _mm512_dpbusd_epi32(acc[i], x, x), r512i)
    RATE("ymm vpdpbusd", __m256i, I256, I256(3), _mm256_dpbusd_epi32(acc[i], x, x), r256i)
    RATE("zmm vdpbf16ps", __m512, F512, F512(1), _mm512_dpbf16_ps(acc[i], (__m512bh)x, (__m512bh)x), r512)
    RATE("zmm fp32 fma", __m512, F512, F512(1), _mm512_fmadd_ps(acc[i], x, x), r512)
    return 0;
}
