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

#include "qmatmul_common.h"  // CG, BLOCK, the build's switches (EXL_QMM_*), what both bodies share
#if EXL_QMM_AVX2
#include "qmatmul_avx2.h"
#endif
#if EXL_QMM_VNNI512
#include "qmatmul_vnni512.h"
#endif

#if EXL_QMM_AVX2
// The column groups begin .. end - 1 of one product (ctx: its qmm2_args), on the widest body built.
static void qmm2_groups(void *ctx, int64_t begin, int64_t end) {
    const qmm2_args *a = (const qmm2_args *)ctx;
#if EXL_QMM_VNNI512
    if (a->bits != 2 || EXL_QMM_HALF_SCALES) {  // (2-bit: packed tiles only, with F16C)
        uint8_t *wide = a->M >= WIDE512_MIN_ROWS && a->bits != 2 ? (uint8_t *)malloc((size_t)(a->nb * 512)) : NULL;
        qmm2_groups512(a, begin, end, wide);  // without wide, the packed blocks: the same bits
        free(wide);
        return;
    }
#endif
    qmm2_groups256(a, begin, end);
}

// The column groups of several products of one x (a projection's parts, each y at its column of a wide
// output), shared among the pool's threads as one job: part i's groups are g_first[i] .. g_first[i + 1] - 1.
typedef struct {
    const qmm2_args *parts;
    const int64_t *g_first;
    int64_t n_parts;
} qmm2_job;

static void qmm2_job_groups(void *ctx, int64_t begin, int64_t end) {
    const qmm2_job *j = (const qmm2_job *)ctx;
    int64_t lo_part = 0, hi_part = j->n_parts - 1;  // the part holding group `begin` (many parts: the experts')
    while (lo_part < hi_part) {
        int64_t mid = (lo_part + hi_part + 1) / 2;
        if (j->g_first[mid] <= begin) lo_part = mid;
        else hi_part = mid - 1;
    }
    for (int64_t i = lo_part; i < j->n_parts && j->g_first[i] < end; i++) {
        int64_t lo = begin > j->g_first[i] ? begin : j->g_first[i];
        int64_t hi = end < j->g_first[i + 1] ? end : j->g_first[i + 1];
        if (lo < hi) qmm2_groups((void *)&j->parts[i], lo - j->g_first[i], hi - j->g_first[i]);
    }
}

#define QMM2_MAX_PARTS 8

// Whether a part's offsets are where the kernel reads them: in m, or (m NULL) Q4_0's -8 d, which only 4-bit
// weights with one scale a block and no table may leave to the kernel.
static int offsets_held(const exl_qmatmul_args *p) {
    int has_off = (p->bits == 4 && !p->table) || p->offsets;
    return !has_off || p->m || (p->bits == 4 && !p->table && p->scales_per_block == 1);
}

// y [M, ldy] (y_fp32 or bf16), columns side by side from col 0: the products of x with each part's
// weights (their x, rows and y fields unused), x quantized once. The same bits as one call per part.
static int qmatmul_avx2_parts(const exl_qmatmul_args *parts, int64_t n_parts, const uint16_t *x, int64_t M,
                              void *y, int64_t ldy, int y_fp32) {
    int64_t K = parts[0].in_features, nb = K / BLOCK, col = 0;
    for (int64_t i = 0; i < n_parts; i++) {
        if (parts[i].in_features != K || !offsets_held(&parts[i])) return 6;
        col += parts[i].out_features;
    }
    if (col > ldy) return 6;
    float *scales = (float *)malloc(sizeof(float) * (size_t)(5 * M * nb + 1));  // dx, xs, sum(xq), its halves
    int8_t *xq = (int8_t *)malloc((size_t)(M * K + 1));
    if (!scales || !xq) {
        free(scales);
        free(xq);
        return -1;
    }
    int32_t *xsum = (int32_t *)(scales + 2 * M * nb);
    quantize_task q = {x, K, xq, scales, scales + M * nb, xsum, xsum + M * nb};
    if (M >= QUANTIZE_PARALLEL_ROWS) exl_parallel_for(quantize_rows_task, &q, M);
    else quantize_rows_task(&q, 0, M);
    qmm2_args a[QMM2_MAX_PARTS];
    int64_t g_first[QMM2_MAX_PARTS + 1] = {0};
    col = 0;
    for (int64_t i = 0; i < n_parts; i++) {
        const exl_qmatmul_args *p = &parts[i];
        int zero = p->bits == 6 ? 32 : p->bits == 5 && !p->offsets ? 16 : 0;
        const int8_t *table = p->bits == 4 ? p->table : NULL;
        int two_scales = p->scales_per_block == 2, has_off = (p->bits == 4 && !table) || p->offsets;
        void *yp = y_fp32 ? (void *)((float *)y + col) : (void *)((uint16_t *)y + col);
        qmm2_args ai = {xq, scales, scales + M * nb, M, K, nb, p->out_features, xsum, xsum + M * nb, p->bits, y_fp32,
                        two_scales, has_off, p->half_scales != 0, zero, p->qs, p->d, p->m, table, p->bias, yp, ldy};
        a[i] = ai;
        g_first[i + 1] = g_first[i] + (p->out_features + CG - 1) / CG;
        col += p->out_features;
    }
    qmm2_job job = {a, g_first, n_parts};
    exl_parallel_for(qmm2_job_groups, &job, g_first[n_parts]);
    free(scales);
    free(xq);
    return 0;
}

// The products of blocks of x's rows, each block with its own weights (an expert's, for the experts' one call,
// moe.c): x [rows, K] quantized once, every block's parts' column groups shared among the pool's threads as
// one job, so each weight is read once for all the rows of its block. Each row's outputs are the bits of an
// exl_qmatmul of that block alone (a row's quantization and products do not depend on the rows around it).
static int qmatmul_avx2_grouped(const qmm_group *groups, int64_t n_groups, const uint16_t *x, int64_t M, int64_t K) {
    int64_t nb = K / BLOCK, n_parts = 0;
    if (K % BLOCK || K <= 0) return 6;
    for (int64_t i = 0; i < n_groups; i++) {
        const qmm_group *g = &groups[i];
        if (g->n_parts < 1 || g->row0 < 0 || g->rows < 0 || g->row0 + g->rows > M) return 6;
        int64_t col = 0;
        for (int64_t p = 0; p < g->n_parts; p++) {
            if (g->parts[p].in_features != K || !offsets_held(&g->parts[p])) return 6;
            if ((g->parts[p].half_scales || g->parts[p].bits == 2) && !EXL_QMM_HALF_SCALES) return -1;
            col += g->parts[p].out_features;
        }
        if (col > g->ldy) return 6;
        n_parts += g->n_parts;
    }
    if (M == 0 || n_parts == 0) return 0;
    float *scales = (float *)malloc(sizeof(float) * (size_t)(5 * M * nb + 1));  // dx, xs, sum(xq), its halves
    int8_t *xq = (int8_t *)malloc((size_t)(M * K + 1));
    qmm2_args *a = (qmm2_args *)malloc(sizeof(qmm2_args) * (size_t)n_parts);
    int64_t *g_first = (int64_t *)malloc(sizeof(int64_t) * (size_t)(n_parts + 1));
    if (!scales || !xq || !a || !g_first) {
        free(scales), free(xq), free(a), free(g_first);
        return -1;
    }
    int32_t *xsum = (int32_t *)(scales + 2 * M * nb), *xsum16 = xsum + M * nb;
    quantize_task q = {x, K, xq, scales, scales + M * nb, xsum, xsum16};
    if (M >= QUANTIZE_PARALLEL_ROWS) exl_parallel_for(quantize_rows_task, &q, M);
    else quantize_rows_task(&q, 0, M);
    int64_t n = 0;
    g_first[0] = 0;
    for (int64_t i = 0; i < n_groups; i++) {
        const qmm_group *g = &groups[i];
        if (g->rows == 0) continue;
        int64_t r0 = g->row0, col = 0;
        for (int64_t pi = 0; pi < g->n_parts; pi++) {
            const exl_qmatmul_args *p = &g->parts[pi];
            int zero = p->bits == 6 ? 32 : p->bits == 5 && !p->offsets ? 16 : 0;
            const int8_t *table = p->bits == 4 ? p->table : NULL;
            int two_scales = p->scales_per_block == 2, has_off = (p->bits == 4 && !table) || p->offsets;
            qmm2_args ai = {xq + r0 * K, scales + r0 * nb, scales + M * nb + r0 * nb, g->rows, K, nb,
                            p->out_features, xsum + r0 * nb, xsum16 + 2 * r0 * nb, p->bits, 0, two_scales, has_off,
                            p->half_scales != 0, zero, p->qs, p->d, p->m, table, p->bias, g->y + col, g->ldy};
            a[n] = ai;
            g_first[n + 1] = g_first[n] + (p->out_features + CG - 1) / CG;
            col += p->out_features;
            n++;
        }
    }
    // a chunk per column group: the job is long (every expert's), and on a busy machine a worker preempted in a
    // long chunk holds the caller up until it runs again (docs/kernels.md has the measurement)
    qmm2_job job = {a, g_first, n};
    exl_parallel_for_chunks(qmm2_job_groups, &job, g_first[n], g_first[n]);
    free(scales), free(xq), free(a), free(g_first);
    return 0;
}

static int qmatmul_avx2(const exl_qmatmul_args *args) {
    return qmatmul_avx2_parts(args, 1, args->x, args->rows, args->y, args->out_features, args->y_fp32);
}
#endif  // EXL_QMM_AVX2

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

int qmatmul_grouped(const qmm_group *groups, int64_t n_groups, const uint16_t *x, int64_t rows, int64_t K) {
#if EXL_QMM_AVX2
    return qmatmul_avx2_grouped(groups, n_groups, x, rows, K);
#else
    (void)groups, (void)n_groups, (void)x, (void)rows, (void)K;
    return 1;
#endif
}
