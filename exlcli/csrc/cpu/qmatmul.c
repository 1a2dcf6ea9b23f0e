// y[M, N] = x[M, K] (bf16) @ W[N, K]^T for GGUF block-quantized W (Q4_0, Q4_1, Q8_0, the K-quants
// Q2_K .. Q6_K, Q5_0, Q5_1), on the CPU.
//
// Weights stay quantized; exlcli/ops/formats/cpu_qmatmul.py repacks them at load into groups of
// CG = 16 output columns, one column per SIMD lane, so that a group streams through memory in one
// pass and the result of a group is one vector of 16 outputs (no horizontal sums). Per block of 32:
//   w = q * d + m   (Q4_1, Q4_K: q in 0..15; Q4_0: m = -8d; Q8_0: q signed, m = 0; the 5- and 6-bit
//                    formats: q as a signed byte, with m (`offsets`) or without)
//   sum_k x_k w_k = d * dot(q, x) + m * sum(x)
// or, with two scales per block (Q6_K's sub-blocks of 16, 8-bit, no offset), d0 * dot(q, x) over
// k < 16 + d1 * dot(q, x) over k >= 16: the two partial sums the dot products already keep apart.
//
// The dot products (qmatmul_avx2.h, whose arithmetic is written there) are integer ones over the
// activations quantized to int8 per block of 32, as llama.cpp's CPU kernels do: 256-bit AVX2, on AVX-512
// CPUs too, except where the CPU has AVX-512 VNNI: there 512-bit vpdpbusd (qmatmul_vnni512.h: the same
// integer sums, so the same bits). With AVX-VNNI and no AVX-512 (Intel's client cores) the AVX2 tiles take
// 256-bit vpdpbusd in place of vpmaddubsw + vpmaddwd (again the same sums). There is no body of exact bf16
// products on AVX-512 BF16 CPUs: one runs the default model 1.8-2.1x slower than the int8 body on a 2-core
// Intel Xeon.
//
// Batch invariance: every output is made by the same sequence of operations whatever M is and
// wherever its row sits in a tile; tiles of rows only share the weight expansion.

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "args.h"
#include "bf16.h"
#include "pool.h"
#include "qmatmul.h"

#if defined(__AVX2__) && defined(__FMA__)
#define EXL_QMM_AVX2 1  // qmatmul_avx2.h: int8 dot products
#else
#define EXL_QMM_AVX2 0
#endif

#define CG 16      // output columns per group: one per fp32 lane
#define BLOCK 32

// fp16 scales (half_scales) need F16C's widening loads; only the AVX2 body reads them.
#if EXL_QMM_AVX2 && defined(__F16C__)
#define EXL_QMM_HALF_SCALES 1
#else
#define EXL_QMM_HALF_SCALES 0
#endif

#if EXL_QMM_AVX2
#include "qmatmul_avx2.h"
#endif

// Which arithmetic the kernel is built with: 2 q8 activations (the AVX2 body), 0 none. (1 is not used: it
// would name exact bf16 products, which no body makes; the int8 body is the faster on AVX-512 BF16 CPUs too.)
int exl_qmatmul_available(void) { return EXL_QMM_AVX2 ? 2 : 0; }

// 1 when the kernel takes fp16 scales and offsets (exl_qmatmul_args.half_scales), 0 when only fp32.
int exl_qmatmul_half_scales_available(void) { return EXL_QMM_HALF_SCALES; }

// x: bf16 [M, K]; bias: bf16 [N] or NULL; y: [M, N], fp32 when y_fp32 else bf16.
// bits 4: qs [groups][nb][256], d and m fp32 [groups][nb][CG]; with a table (IQ4), q indexes its 16 int8 values,
// w = table[q] * d, no m.
// bits 8: qs [groups][nb][512], d fp32 [groups][nb][CG], m fp32 [groups][nb][CG] read with offsets only.
// scales_per_block 2: d fp32 [groups][nb][2][CG], the scales of k < 16 and k >= 16 of each block.
// bits 5 (the AVX2 body only): qs [groups][nb][320], q in 0..31 (qmatmul_avx2.h); without offsets q - 16.
// bits 6 (the AVX2 body only): qs [groups][nb][384], q - 32 for q in 0..63, two scales per block, no offsets.
// bits 2 (with F16C only; Q2_K): qs [groups][nb][128], q in 0..3; d fp16 [groups][nb / 8][2][CG]
// (each super-block's d and -dmin), m uint8 [groups][nb][2][CG] (sc | m << 4 per 16 weights).
// w = d * sc * q + (-dmin) * m per 16 weights (qmatmul_avx2.h).
// The column groups are shared among the pool's threads. Returns 0, or -1 when the kernel is not
// built or its scratch cannot be had.
int exl_qmatmul(const exl_qmatmul_args *args) {
    if (args->half_scales && !EXL_QMM_HALF_SCALES) return -1;
#if EXL_QMM_AVX2
    if (args->bits == 2 && !EXL_QMM_HALF_SCALES) return -1;
    return qmatmul_avx2(args);
#else
    (void)args;
    return -1;
#endif
}

int qmatmul_parts(const exl_qmatmul_args *parts, int64_t n_parts, const uint16_t *x, int64_t rows, uint16_t *y,
                  int64_t ldy) {
#if EXL_QMM_AVX2
    if (n_parts < 1 || n_parts > QMM2_MAX_PARTS) return 1;
    for (int64_t i = 0; i < n_parts; i++)
        if ((parts[i].half_scales || parts[i].bits == 2) && !EXL_QMM_HALF_SCALES) return -1;
    return qmatmul_avx2_parts(parts, n_parts, x, rows, y, ldy, 0);
#else
    (void)parts, (void)n_parts, (void)x, (void)rows, (void)y, (void)ldy;
    return 1;
#endif
}
