// ---- the GEMM around a kernel: quantize the rows, then each tile for up to ROWS_MAX rows at a time --------
// The kernel file defines ISA_FN (the functions' target attribute), ROWS_MAX, quantize_row and tile_rows_out.

// x: [M, K] bf16 (or fp32); lin: a gguf_linear_t; bias: bf16 [N] or NULL; y: [M, N] bf16 (or fp32).
// The signature of the native stack's GEMM_FN entries (cpu_kernels.c's gemm_fn).
ISA_FN void gguf_gemm(const void* x, int x_is_f32, int64_t M, int64_t K, const void* lin_, const uint16_t* bias,
                      int64_t N, void* y, int y_is_f32, int threads) {
    const gguf_linear_t* lin = (const gguf_linear_t*)lin_;
    const int64_t nb32 = K / 32;
    act_t* acts = (act_t*)malloc((size_t)(M * nb32) * sizeof(act_t));  // groups of ROWS_MAX rows, block-major
    const size_t xsz = x_is_f32 ? 4 : 2;
#pragma omp parallel for num_threads(threads) schedule(static) if (M >= 8)
    for (int64_t m = 0; m < M; m++) {
        const int64_t r0 = m - m % ROWS_MAX, R = M - r0 < ROWS_MAX ? M - r0 : ROWS_MAX;
        quantize_row((const char*)x + (size_t)(m * K) * xsz, x_is_f32, K, acts + r0 * nb32 + m - r0, R);
    }
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
            float out[ROWS_MAX][16];
            tile_rows_out(R, pt->type, p, K, acts + r0 * nb32, out);
            for (int r = 0; r < R; r++) {
                const int64_t base = (r0 + r) * N + col;
                for (int c = 0; c < 16; c++) {
                    const float v = out[r][c] + bv[c];
                    if (y_is_f32)
                        ((float*)y)[base + c] = v;
                    else
                        ((uint16_t*)y)[base + c] = f32_to_bf16(v);
                }
            }
        }
    }
    free(acts);
}
