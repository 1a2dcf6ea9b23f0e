// What qmatmul.c's two bodies share (qmatmul_avx2.h, and qmatmul_vnni512.h where the CPU has AVX-512
// VNNI): the build's switches, the layout constants, one product's arguments (qmm2_args), where a column
// group's weights and scales sit, the weights' prefetch, the 8-bit pair loads and the output stores. Each
// body includes this; neither includes the other, and qmatmul.c includes each once and dispatches.
#pragma once
#include <stdint.h>
#include <string.h>

#include "bf16.h"

#if defined(__AVX2__) && defined(__FMA__)
#define EXL_QMM_AVX2 1  // qmatmul_avx2.h: int8 dot products
#else
#define EXL_QMM_AVX2 0
#endif

// The AVX-512 VNNI body (qmatmul_vnni512.h) takes the column groups where the CPU has it.
#if EXL_QMM_AVX2 && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define EXL_QMM_VNNI512 1
#else
#define EXL_QMM_VNNI512 0
#endif

#define CG 16      // output columns per group: one per fp32 lane
#define BLOCK 32

// fp16 scales (half_scales) need F16C's widening loads; only the AVX2 build reads them.
#if EXL_QMM_AVX2 && defined(__F16C__)
#define EXL_QMM_HALF_SCALES 1
#else
#define EXL_QMM_HALF_SCALES 0
#endif

#if EXL_QMM_AVX2
#include <immintrin.h>

typedef struct {
    const int8_t *xq;
    const float *dx, *xs;
    int64_t M, K, nb, N;
    const int32_t *xsum, *xsum16;  // sum(xq) per row and block, and per its halves k < 16, k >= 16
    int bits, y_fp32, two_scales, has_off, half;  // half: d and m are fp16
    int zero;  // 5- and 6-bit: what q is stored above its value (16 for Q5_0's q - 16, 32 for Q6_K's, else 0)
    const uint8_t *qs;
    const void *d, *m;
    const int8_t *table;  // 4-bit: NULL, or the 16 values q indexes (then 8-bit arithmetic: |w| x sign(xq, w))
    const uint16_t *bias;
    void *y;
    int64_t ldy;  // elements from one row of y to the next (N, or wider where parts sit side by side)
} qmm2_args;

static inline int64_t qbytes_of(int bits) {
    return bits == 2 ? 128 : bits == 4 ? 256 : bits == 5 ? 320 : bits == 6 ? 384 : 512;
}

// Scales and offsets are fp32, or fp16 where they are exact in it (the legacy formats' own fp16
// values: 2 bytes a block less to read); widened to fp32 on load, so both give the same bits.
static inline const void *scales_at(const void *base, int64_t i, int half) {
    return half ? (const void *)((const uint16_t *)base + i) : (const void *)((const float *)base + i);
}

// Group g's scales (gd) and offsets (gm, NULL without offsets, or where they are Q4_0's -8 d: offsets_of)
// in a's layout: [nb][scales per block][CG] and [nb][CG], fp32 or fp16; 2-bit: fp16 (d, -dmin) per super-block
// of 8 blocks, a byte per sub-block of 16.
static inline void group_scales(const qmm2_args *a, int64_t g, const void **gd, const void **gm) {
    const int64_t nb = a->nb, spb = a->two_scales ? 2 : 1;
    if (a->bits == 2) {
        *gd = (const uint16_t *)a->d + g * (nb / 8) * 2 * CG;
        *gm = (const uint8_t *)a->m + g * nb * 2 * CG;
        return;
    }
    *gd = scales_at(a->d, g * nb * spb * CG, a->half);
    *gm = a->has_off && a->m ? scales_at(a->m, g * nb * CG, a->half) : NULL;
}

#define PREFETCH_BLOCKS 8  // blocks ahead of the first half's pass: the group's next (or the next group's)
// Software prefetch of the weights PREFETCH_BLOCKS blocks ahead, from the first half's pass (the second
// reads the same lines). Without it the 5-bit matmul of a cold 1536 x 576 weight runs at 145 us, with it
// 76-84 us (hot in cache: 64 us), one thread on the 2-core EPYC: the hardware prefetcher alone does
// not keep up with a stream this dense in compute.
static inline __attribute__((always_inline)) void prefetch_ahead(const uint8_t *blk, int64_t block_bytes) {
    for (int64_t l = 0; l < block_bytes; l += 64)
        _mm_prefetch((const char *)(blk + PREFETCH_BLOCKS * block_bytes + l), _MM_HINT_T0);
}

// The expansion reads its weights once, with little work per byte, so it prefetches further ahead than
// the tiles (PREFETCH_BLOCKS): 16 rows of 5-bit weights in 30 layers' worth of cold SmolLM2 products, 2
// threads, the Zen 5 VM: 529 us a layer without, 355 at 8 blocks ahead, 217-276 at 4 to 16 KB (noise).
#define EXPAND_PREFETCH_BYTES 8192

// 8-bit: pair p (k = 2p, 2p + 1) of columns 8h..8h+7 is 16 bytes at 32p + 16h, a column's pair per
// two bytes. Pairs p and p + 1 interleaved by 16-bit elements give each column's k = 2p .. 2p + 3.
static inline __attribute__((always_inline)) __m256i quad_q8(const uint8_t *blk, int p, int h) {
    __m128i a = _mm_loadu_si128((const __m128i *)(blk + 32 * p + 16 * h));
    __m128i b = _mm_loadu_si128((const __m128i *)(blk + 32 * (p + 1) + 16 * h));
    return _mm256_set_m128i(_mm_unpackhi_epi16(a, b), _mm_unpacklo_epi16(a, b));
}

// Output row r, columns n0 + 8h ..: acc + bias, the lanes that exist only (8 lanes at a time: the same
// sums and roundings as one at a time; 1-2% of a 512-row product of 576 inputs went to the scalar loop).
static inline void store_half(const qmm2_args *a, int64_t r, int64_t n0, int h, __m256 acc) {
    int64_t col = n0 + 8 * h, count = a->N - col < 8 ? a->N - col : 8;
    if (a->bias) acc = _mm256_add_ps(acc, bf16_load8_n(a->bias + col, count));
    if (!a->y_fp32) {
        bf16_store8_n((uint16_t *)a->y + r * a->ldy + col, acc, count);
    } else if (count == 8) {
        _mm256_storeu_ps((float *)a->y + r * a->ldy + col, acc);
    } else {
        float out[8];
        _mm256_storeu_ps(out, acc);
        memcpy((float *)a->y + r * a->ldy + col, out, sizeof(float) * (size_t)count);
    }
}

#endif  // EXL_QMM_AVX2
