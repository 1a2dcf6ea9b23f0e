// Prefill and many-row decode (M >= WIDE_MIN_ROWS) on CPUs with AVX-512 VNNI, included by qmatmul_avx2.h:
// the same expanded bytes q as qmm2_groups_wide (expand_group; 8-bit as q + 128, below), but one 512-bit
// vector holds a group's 16 columns x 4 k, and one vpdpbusd per row and 4 k adds those 64 products into
// the row's 16 int32 sums. The AVX2 tile takes a vpmaddubsw per 8 columns x 4 k, an int16 add, and a
// vpmaddwd per few of those.
//
// The integer sums are exact either way (vpdpbusd adds four u8 x s8 products into int32 without
// saturating; a block's sum is below 2^21), and the fp32 steps of each output are block_step's, in the
// header's order, one lane per column: so this gives the same bits as the AVX2 tiles, and batch
// invariance holds across the two (tests/ops/test_cpu_qmatmul.py compares both with the torch emulation).
//
// 8-bit weights: vpdpbusd takes unsigned bytes, so the expansion holds q + 128 (q ^ 0x80, in 0..255) and
// each block (or half block, with two scales) subtracts 128 * sum(xq): sum((q + 128) xq) - 128 sum(xq) =
// sum(q xq), the integer of the AVX2 path's |q| x sign(xq, q).

#define W512_ROWS 8  // rows per tile: their int32 sums and fp32 accumulators take 16 of the 32 registers

static inline __attribute__((always_inline)) __m512 scales16(const void *base, int64_t i, int half) {
    if (half) return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)base + i)));
    return _mm512_loadu_ps((const float *)base + i);
}

// block_step for 16 columns: acc + float(sum - zero * xsum) * (d * dx), then + m * xs with offsets.
static inline __attribute__((always_inline)) __m512 block_step16(const qmm2_args *a, __m512 acc, __m512i sum, int zero,
                                                                 int32_t xsum, __m512 d, int64_t i, int has_off,
                                                                 const void *gm, int64_t mi) {
    if (zero) sum = _mm512_sub_epi32(sum, _mm512_set1_epi32(zero * xsum));
    acc = _mm512_add_ps(acc, _mm512_mul_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(d, _mm512_set1_ps(a->dx[i]))));
    if (has_off) acc = _mm512_add_ps(acc, _mm512_mul_ps(scales16(gm, mi, a->half), _mm512_set1_ps(a->xs[i])));
    return acc;
}

// zero, has_off and two (a scale per 16 k) are constants once inlined, as in wide_tile.
static inline __attribute__((always_inline)) void wide512_tile(const qmm2_args *a, const uint8_t *wide, const void *gd,
                                                                const void *gm, int64_t r0, int rows, int zero,
                                                                int has_off, int two, __m512 acc[W512_ROWS]) {
    for (int r = 0; r < rows; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < a->nb; b++) {
        const uint8_t *wb = wide + b * 512;
        const int8_t *xb = a->xq + r0 * a->K + b * BLOCK;
        __m512i s[W512_ROWS];
        for (int r = 0; r < rows; r++) s[r] = _mm512_setzero_si512();
#pragma GCC unroll 8
        for (int u = 0; u < 8; u++) {  // x[4u .. 4u + 3] of this block
            const __m512i w = _mm512_loadu_si512((const void *)(wb + 64 * u));
            for (int r = 0; r < rows; r++) {
                int32_t x4;
                memcpy(&x4, xb + r * a->K + 4 * u, 4);
                s[r] = _mm512_dpbusd_epi32(s[r], w, _mm512_set1_epi32(x4));
            }
            if (two && u % 4 == 3) {  // a scale per 16 k
                __m512 d = scales16(gd, (2 * b + u / 4) * CG, a->half);
                for (int r = 0; r < rows; r++) {
                    int64_t i = (r0 + r) * a->nb + b;
                    acc[r] = block_step16(a, acc[r], s[r], zero, a->xsum16[2 * i + u / 4], d, i, 0, gm, 0);
                    s[r] = _mm512_setzero_si512();
                }
            }
        }
        if (two) continue;
        __m512 d = scales16(gd, b * CG, a->half);
        for (int r = 0; r < rows; r++) {
            int64_t i = (r0 + r) * a->nb + b;
            acc[r] = block_step16(a, acc[r], s[r], zero, a->xsum[i], d, i, has_off, gm, b * CG);
        }
    }
}

static inline __attribute__((always_inline)) void wide512_rows(const qmm2_args *a, const uint8_t *wide,
                                                                const void *gd, const void *gm, int64_t r0, int rows,
                                                                __m512 acc[W512_ROWS]) {
    if (a->bits == 4) wide512_tile(a, wide, gd, gm, r0, rows, 0, 1, 0, acc);
    else if (a->bits == 6) wide512_tile(a, wide, gd, gm, r0, rows, 32, 0, 1, acc);
    else if (a->bits == 5 && a->has_off) wide512_tile(a, wide, gd, gm, r0, rows, 0, 1, 0, acc);
    else if (a->bits == 5) wide512_tile(a, wide, gd, gm, r0, rows, 16, 0, 0, acc);
    else if (a->two_scales) wide512_tile(a, wide, gd, gm, r0, rows, 128, 0, 1, acc);
    else if (a->has_off) wide512_tile(a, wide, gd, gm, r0, rows, 128, 1, 0, acc);
    else wide512_tile(a, wide, gd, gm, r0, rows, 128, 0, 0, acc);
}

// The 8-bit expansion as unsigned bytes q + 128 (the other widths: expand_group's first 512 bytes as they are).
static void expand_group_u8(int bits, const uint8_t *gq, int64_t nb, uint8_t *wide) {
    if (bits != 8) {
        expand_group(bits, gq, nb, wide);
        return;
    }
    const __m256i flip = _mm256_set1_epi8((char)0x80);
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = gq + b * 512;
        uint8_t *wb = wide + b * 512;
        for (int64_t l = 0; l < 512; l += 64) _mm_prefetch((const char *)(blk + EXPAND_PREFETCH_BYTES + l), _MM_HINT_T0);
        for (int h = 0; h < 2; h++)
            for (int c = 0; c < 4; c++) {
                _mm256_storeu_si256((__m256i *)(wb + 64 * (2 * c) + 32 * h), _mm256_xor_si256(quad_q8(blk, 4 * c, h), flip));
                _mm256_storeu_si256((__m256i *)(wb + 64 * (2 * c + 1) + 32 * h),
                                    _mm256_xor_si256(quad_q8(blk, 4 * c + 2, h), flip));
            }
    }
}

// Output row r, the group's 16 columns from n0 (store_half per 8: the same bias adds and roundings).
static inline void store16(const qmm2_args *a, int64_t r, int64_t n0, __m512 acc) {
    store_half(a, r, n0, 0, _mm512_castps512_ps256(acc));
    if (n0 + 8 < a->N) store_half(a, r, n0, 1, _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc), 1)));
}

// wide: 512 bytes a block (expand_group_u8).
static void qmm2_groups_wide512(const qmm2_args *a, int64_t begin, int64_t end, uint8_t *wide) {
    int64_t nb = a->nb, spb = a->two_scales ? 2 : 1;
    for (int64_t g = begin; g < end; g++) {
        expand_group_u8(a->bits, a->qs + g * nb * qbytes_of(a->bits), nb, wide);
        const void *gd = scales_at(a->d, g * nb * spb * CG, a->half);
        const void *gm = a->has_off ? scales_at(a->m, g * nb * CG, a->half) : NULL;
        int64_t n0 = g * CG;
        for (int64_t r0 = 0; r0 < a->M;) {
            int64_t left = a->M - r0;
            int rows = left >= 8 ? 8 : left >= 4 ? 4 : left >= 2 ? 2 : 1;
            __m512 acc[W512_ROWS];
            switch (rows) {  // constant row counts keep the sums in registers
                case 8: wide512_rows(a, wide, gd, gm, r0, 8, acc); break;
                case 4: wide512_rows(a, wide, gd, gm, r0, 4, acc); break;
                case 2: wide512_rows(a, wide, gd, gm, r0, 2, acc); break;
                default: wide512_rows(a, wide, gd, gm, r0, 1, acc); break;
            }
            for (int i = 0; i < rows; i++) store16(a, r0 + i, n0, acc[i]);
            r0 += rows;
        }
    }
}
