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
// The dot products run on AVX512-BF16 (vdpbf16ps): each instruction takes one pair of x values,
// broadcast, against that pair of weights of all 16 columns; bf16 products are exact in fp32 and
// accumulate in fp32. 4-bit q is expanded to bf16(128 + q), whose bit pattern is 0x4300 | q: a byte
// interleave with a constant. The 128 * sum(x) that adds is taken back in the offset term, with
// per-block coefficient m - 128 d (the two terms are added block by block, so they cancel as they
// go rather than at the end).
//
// Batch invariance: every output is made by the same sequence of operations whatever M is and
// wherever its row sits in a tile; tiles of MT rows only share the weight expansion.
//
// Where the compiler targets AVX2 but not AVX-512 BF16, qmatmul_avx2.h reads the same layout with
// integer dot products over activations quantized to int8 per block of 32 (as llama.cpp's CPU kernels
// do; its arithmetic is written there). exl_qmatmul_available() says which.

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "args.h"
#include "bf16.h"
#include "pool.h"
#include "qmatmul.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__) && defined(__AVX512VL__)
#define EXL_QMM 1
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__FMA__)
#define EXL_QMM_AVX2 1  // qmatmul_avx2.h: the same layout and contract, int8 dot products
#define EXL_QMM 0
#else
#define EXL_QMM 0
#endif

#define CG 16      // output columns per group: one per fp32 lane
#define MT 4       // rows sharing one weight expansion
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

// Which arithmetic the kernel was built with: 1 exact bf16 products, 2 q8 activations, 0 none.
int exl_qmatmul_available(void) {
#if EXL_QMM_AVX2
    return 2;
#else
    return EXL_QMM;
#endif
}

// 1 when the kernel takes fp16 scales and offsets (exl_qmatmul_args.half_scales), 0 when only fp32.
int exl_qmatmul_half_scales_available(void) { return EXL_QMM_HALF_SCALES; }

#if EXL_QMM

// Sum of each 32-value block of each row: sx[m * nb + b].
static void block_sums(const uint16_t *x, int64_t M, int64_t K, float *sx) {
    int64_t nb = K / BLOCK;
    for (int64_t m = 0; m < M; m++) {
        for (int64_t b = 0; b < nb; b++) {
            const uint16_t *xb = x + m * K + b * BLOCK;
            sx[m * nb + b] = _mm512_reduce_add_ps(_mm512_add_ps(bf16_load16(xb), bf16_load16(xb + 16)));
        }
    }
}

// The 16 weight vectors of one (group, block): w[p] holds the pair k = 2p, 2p + 1 of every column.
// 4-bit: 256 bytes, 4 loads of 64; each gives 4 vectors through nibble masks and byte unpacks
// (the repack put every nibble where these land it).
static inline void expand_q4(const uint8_t *qs, __m512bh w[16]) {
    const __m512i low4 = _mm512_set1_epi8(0x0f);
    const __m512i c43 = _mm512_set1_epi8(0x43);
    for (int i = 0; i < 4; i++) {
        __m512i v = _mm512_loadu_si512((const void *)(qs + 64 * i));
        __m512i lo = _mm512_and_si512(v, low4);
        __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
        w[4 * i + 0] = (__m512bh)_mm512_unpacklo_epi8(lo, c43);
        w[4 * i + 1] = (__m512bh)_mm512_unpackhi_epi8(lo, c43);
        w[4 * i + 2] = (__m512bh)_mm512_unpacklo_epi8(hi, c43);
        w[4 * i + 3] = (__m512bh)_mm512_unpackhi_epi8(hi, c43);
    }
}

// 8-bit: 512 bytes, pair-major: 32 signed bytes (column 0's pair, column 1's, ...) per vector.
static inline void expand_q8(const uint8_t *qs, __m512bh w[16]) {
    for (int p = 0; p < 16; p++) {
        __m256i v = _mm256_loadu_si256((const __m256i *)(qs + 32 * p));
        __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(v)));
        __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(v, 1)));
        w[p] = _mm512_cvtne2ps_pbh(hi, lo);  // elements 0..15 from lo, 16..31 from hi
    }
}

static inline __m512bh pair_of(const uint16_t *xb, int p) {
    int32_t v;
    memcpy(&v, xb + 2 * p, 4);
    return (__m512bh)_mm512_set1_epi32(v);
}

// One block's contribution to one row: d * dot(q, x) (+ (m - 128 d) * sum(x) for 4-bit, m * sum(x)
// for 8-bit with offsets). With two scales per block, d0 * dot of k < 16 + d1 * dot of k >= 16.
static inline __m512 row_block(const __m512bh *w, const uint16_t *xb, __m512 dvec, int two_scales, __m512 d1vec,
                               int has_off, __m512 offvec, float sxb, __m512 acc) {
    __m512 pa = _mm512_setzero_ps(), pb = _mm512_setzero_ps();
    for (int p = 0; p < 8; p++) pa = _mm512_dpbf16_ps(pa, w[p], pair_of(xb, p));
    for (int p = 8; p < 16; p++) pb = _mm512_dpbf16_ps(pb, w[p], pair_of(xb, p));
    if (two_scales) {
        acc = _mm512_fmadd_ps(pa, dvec, acc);
        acc = _mm512_fmadd_ps(pb, d1vec, acc);
    } else {
        acc = _mm512_fmadd_ps(_mm512_add_ps(pa, pb), dvec, acc);
    }
    if (has_off) acc = _mm512_fmadd_ps(offvec, _mm512_set1_ps(sxb), acc);
    return acc;
}

static inline void expand(const uint8_t *qs, int bits, __m512bh w[16]) {
    if (bits == 4) expand_q4(qs, w);
    else expand_q8(qs, w);
}

// Rows m0 .. m0 + rows - 1 of one column group. `expanded` holds the group's weights already
// expanded (nb * 16 vectors), or is NULL to expand them block by block here.
static inline __attribute__((always_inline)) void group_rows(
        const uint16_t *x, int64_t K, int64_t nb, const float *sx, int64_t m0, int rows, int bits, int has_off,
        int two_scales, const uint8_t *qs, const float *d, const float *m, const __m512bh *expanded,
        __m512 acc[MT]) {
    int64_t qbytes = bits == 4 ? 256 : 512;
    const __m512 minus128 = _mm512_set1_ps(-128.0f);
    for (int i = 0; i < MT; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        __m512bh local[16];
        const __m512bh *w = local;
        if (expanded) w = expanded + b * 16;
        else expand(qs + b * qbytes, bits, local);
        __m512 dvec = _mm512_loadu_ps(d + (two_scales ? 2 * b : b) * CG);
        __m512 d1vec = two_scales ? _mm512_loadu_ps(d + (2 * b + 1) * CG) : dvec;
        __m512 offvec = bits == 4 ? _mm512_fmadd_ps(minus128, dvec, _mm512_loadu_ps(m + b * CG))
                        : has_off ? _mm512_loadu_ps(m + b * CG)
                                  : _mm512_setzero_ps();
        for (int i = 0; i < rows; i++) {
            const uint16_t *xb = x + (m0 + i) * K + b * BLOCK;
            float sxb = has_off ? sx[(m0 + i) * nb + b] : 0.0f;
            acc[i] = row_block(w, xb, dvec, two_scales, d1vec, has_off, offvec, sxb, acc[i]);
        }
    }
}

typedef struct {
    const uint16_t *x;
    int64_t M, K, nb, N;
    int bits, y_fp32, has_off, two_scales;
    const uint8_t *qs;
    const float *d, *m, *sx;
    const uint16_t *bias;
    void *y;
} qmm_args;

// Column groups begin .. end - 1 (columns CG * g ..) for all rows.
static void qmm_groups(void *ctx, int64_t begin, int64_t end) {
    const qmm_args *a = (const qmm_args *)ctx;
    int64_t nb = a->nb, qbytes = a->bits == 4 ? 256 : 512;
    // More rows than one tile: expand each group once into a buffer that every tile reads
    // (the same values as expanding per tile, so the same results).
    __m512bh *expanded = NULL;
    if (a->M > MT) expanded = (__m512bh *)aligned_alloc(64, (size_t)nb * 16 * sizeof(__m512bh));
    for (int64_t g = begin; g < end; g++) {
        const uint8_t *gq = a->qs + g * nb * qbytes;
        if (expanded)
            for (int64_t b = 0; b < nb; b++) expand(gq + b * qbytes, a->bits, expanded + b * 16);
        const float *gd = a->d + g * nb * CG * (a->two_scales ? 2 : 1);
        const float *gm = a->has_off ? a->m + g * nb * CG : NULL;
        int64_t n0 = g * CG;
        __mmask16 keep = lanes16(a->N - n0);  // the group's columns that exist (CG == 16)
        __m512 bvec = _mm512_setzero_ps();
        if (a->bias) bvec = bf16_load16_masked(a->bias + n0, keep);
        for (int64_t m0 = 0; m0 < a->M; m0 += MT) {
            int rows = (int)(a->M - m0 < MT ? a->M - m0 : MT);
            __m512 acc[MT];
            switch (rows) {  // constant row counts let the compiler keep acc in registers
#define EXL_GROUP_ROWS(R) group_rows(a->x, a->K, nb, a->sx, m0, R, a->bits, a->has_off, a->two_scales, gq, gd, gm, \
                                     expanded, acc)
                case 4: EXL_GROUP_ROWS(4); break;
                case 3: EXL_GROUP_ROWS(3); break;
                case 2: EXL_GROUP_ROWS(2); break;
                default: EXL_GROUP_ROWS(1); break;
#undef EXL_GROUP_ROWS
            }
            for (int i = 0; i < rows; i++) {
                __m512 out = a->bias ? _mm512_add_ps(acc[i], bvec) : acc[i];
                if (a->y_fp32) _mm512_mask_storeu_ps((float *)a->y + (m0 + i) * a->N + n0, keep, out);
                else bf16_store16_masked((uint16_t *)a->y + (m0 + i) * a->N + n0, out, keep);
            }
        }
    }
    free(expanded);
}
#endif

// x: bf16 [M, K]; bias: bf16 [N] or NULL; y: [M, N], fp32 when y_fp32 else bf16.
// bits 4: qs [groups][nb][256], d and m fp32 [groups][nb][CG].
// bits 8: qs [groups][nb][512], d fp32 [groups][nb][CG], m fp32 [groups][nb][CG] read with offsets only.
// scales_per_block 2: d fp32 [groups][nb][2][CG], the scales of k < 16 and k >= 16 of each block.
// bits 5 (the AVX2 body only): qs [groups][nb][320], q in 0..31 (qmatmul_avx2.h); without offsets q - 16.
// bits 6 (the AVX2 body only): qs [groups][nb][384], q - 32 for q in 0..63, two scales per block, no offsets.
// bits 2 (the AVX2 body with F16C only; Q2_K): qs [groups][nb][128], q in 0..3; d fp16 [groups][nb / 8][2][CG]
// (each super-block's d and -dmin), m uint8 [groups][nb][2][CG] (sc | m << 4 per 16 weights).
// w = d * sc * q + (-dmin) * m per 16 weights (qmatmul_avx2.h).
// The column groups are shared among the pool's threads. Returns 0, or -1 when the kernel is not
// built or its scratch cannot be had.
int exl_qmatmul(const exl_qmatmul_args *args) {
    if (args->half_scales && !EXL_QMM_HALF_SCALES) return -1;
#if EXL_QMM
    if (args->bits == 2 || args->bits == 5 || args->bits == 6) return -1;  // the AVX2 body's layouts
    const uint16_t *x = args->x, *bias = args->bias;
    int64_t M = args->rows, K = args->in_features, N = args->out_features;
    int bits = args->bits, y_fp32 = args->y_fp32;
    int has_off = bits == 4 || args->offsets, two_scales = args->scales_per_block == 2;
    const uint8_t *qs = args->qs;
    const float *d = args->d, *m = args->m;
    void *y = args->y;
    int64_t nb = K / BLOCK;
    float *sx = NULL;
    if (has_off) {
        sx = (float *)malloc(sizeof(float) * (size_t)(M * nb + 1));
        if (!sx) return -1;
        block_sums(x, M, K, sx);
    }
    qmm_args a = {x, M, K, nb, N, bits, y_fp32, has_off, two_scales, qs, d, m, sx, bias, y};
    exl_parallel_for(qmm_groups, &a, (N + CG - 1) / CG);
    free(sx);
    return 0;
#elif EXL_QMM_AVX2
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
