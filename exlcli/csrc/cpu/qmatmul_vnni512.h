// The body for CPUs with AVX-512 VNNI (every width; 2-bit with F16C), included once from qmatmul.c. One 512-bit
// vector holds a group's 16 columns x 4 k as bytes q (the layout of expand_group's wide bytes; 8-bit as
// q + 128, below), and one vpdpbusd per row and 4 k adds those 64 products into the row's 16 int32 sums.
// (The AVX2 tiles take a vpmaddubsw per 8 columns x 4 k, an int16 add, and a vpmaddwd per few of those.)
// Tiles of up to 8 rows; each block's vectors come from the packed block, expanded in registers, or from
// memory where the group was expanded once (from WIDE512_MIN_ROWS rows). One row of the 5-bit products of
// 30 cold SmolLM2 layers, 2 threads, the Zen 5 VM: 80 us a layer against the AVX2 tiles' 146.
//
// The integer sums are exact either way (vpdpbusd adds four u8 x s8 products into int32 without
// saturating; a block's sum is below 2^21), and the fp32 steps of each output are block_step's, in the
// header's order, one lane per column: so this gives the same bits as the AVX2 tiles, and batch
// invariance holds across the two (tests/ops/formats/test_cpu_qmatmul.py compares each body with the torch
// emulation and with the others).
//
// 8-bit weights: vpdpbusd takes unsigned bytes, so the expansion holds q + 128 (q ^ 0x80, in 0..255) and
// each block (or half block, with two scales) subtracts 128 * sum(xq): sum((q + 128) xq) - 128 sum(xq) =
// sum(q xq), the integer of the AVX2 path's |q| x sign(xq, q).

#pragma once
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "qmatmul_common.h"

#define W512_ROWS 8  // rows per tile: their int32 sums and fp32 accumulators take 16 of the 32 registers
// From this many rows a group's blocks are expanded once into memory (wide) and read back by each tile of
// 8 rows; below, each tile expands them in registers. 30 layers of cold SmolLM2 products, 2 threads, the Zen 5
// VM, us a layer, packed / wide: 5-bit 194 / 221 at 16 rows, 261 / 284 at 24, 560 / 551 at 64; 8-bit 234 / 279
// at 16, 411 / 414 at 32. At 256 rows, one thread, hot: wide 1.1-1.4x faster (8-bit most: quad_q8's shuffles).
#define WIDE512_MIN_ROWS 32

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
    if (has_off) {  // the offsets from gm, or Q4_0's -8 d (offsets8 in qmatmul_avx2.h)
        __m512 m = gm ? scales16(gm, mi, a->half) : _mm512_mul_ps(d, _mm512_set1_ps(-8.0f));
        acc = _mm512_add_ps(acc, _mm512_mul_ps(m, _mm512_set1_ps(a->xs[i])));
    }
    return acc;
}

// One block of a group's 16 columns as 8 vectors of 16 columns x 4 k (w[u]: k = 4u .. 4u + 3, column j in
// 32-bit lane j), the bytes of the wide layout: loaded from it, or expanded from the packed block in
// registers (chunk_q4 / _q5 / _q6 and quad_q8 of both halves at once; 8-bit as q + 128).
static inline __attribute__((always_inline)) void block16_from_wide(const uint8_t *wb, __m512i w[8]) {
    for (int u = 0; u < 8; u++) w[u] = _mm512_loadu_si512((const void *)(wb + 64 * u));
}

static inline __attribute__((always_inline)) __m512i bit_to_4_512(__m512i v, int t) {
    return t < 4 ? _mm512_slli_epi16(v, 4 - t) : t == 4 ? v : _mm512_srli_epi16(v, t - 4);
}

static inline __attribute__((always_inline)) __m512i bits_to_45_512(__m512i v, int u) {
    return u < 2 ? _mm512_slli_epi16(v, 4 - 2 * u) : u == 2 ? v : _mm512_srli_epi16(v, 2);
}

static inline __attribute__((always_inline)) __m512i halves512(__m256i h0, __m256i h1) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(h0), h1, 1);
}

// table: 4-bit indices looked up in lut, the 16 values + 128 in each 128-bit lane (table_u8).
static inline __attribute__((always_inline)) __m512i table_u8(const int8_t *table) {
    const __m512i values = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)table));
    return _mm512_xor_si512(values, _mm512_set1_epi8((char)0x80));
}

static inline __attribute__((always_inline)) void block16_from_packed(int bits, int table, __m512i lut,
                                                                       const uint8_t *blk, __m512i w[8]) {
    const __m512i low4 = _mm512_set1_epi8(0x0f);
    if (bits == 8) {
        const __m512i flip = _mm512_set1_epi8((char)0x80);
        for (int c = 0; c < 4; c++) {
            w[2 * c] = _mm512_xor_si512(halves512(quad_q8(blk, 4 * c, 0), quad_q8(blk, 4 * c, 1)), flip);
            w[2 * c + 1] = _mm512_xor_si512(halves512(quad_q8(blk, 4 * c + 2, 0), quad_q8(blk, 4 * c + 2, 1)), flip);
        }
        return;
    }
    const __m512i gather = _mm512_broadcast_i32x4(_mm_setr_epi8(0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15));
    const __m512i plane5 = bits == 5 ? _mm512_loadu_si512((const void *)(blk + 256)) : _mm512_setzero_si512();
    for (int c = 0; c < 4; c++) {
        __m512i v = _mm512_loadu_si512((const void *)(blk + 64 * c));
        __m512i lo = _mm512_and_si512(v, low4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
        if (bits == 4) {
            lo = _mm512_shuffle_epi8(lo, gather), hi = _mm512_shuffle_epi8(hi, gather);
            if (table) lo = _mm512_shuffle_epi8(lut, lo), hi = _mm512_shuffle_epi8(lut, hi);
        } else if (bits == 5) {
            const __m512i bit4 = _mm512_set1_epi8(0x10);
            lo = _mm512_or_si512(lo, _mm512_and_si512(bit_to_4_512(plane5, 2 * c), bit4));
            hi = _mm512_or_si512(hi, _mm512_and_si512(bit_to_4_512(plane5, 2 * c + 1), bit4));
        } else {  // 6
            const __m512i bits45 = _mm512_set1_epi8(0x30);
            const uint8_t *p = blk + 256 + 32 * (c / 2);
            __m512i plane = halves512(_mm256_loadu_si256((const __m256i *)p),
                                      _mm256_loadu_si256((const __m256i *)(p + 64)));
            int u = 2 * (c % 2);
            lo = _mm512_or_si512(lo, _mm512_and_si512(bits_to_45_512(plane, u), bits45));
            hi = _mm512_or_si512(hi, _mm512_and_si512(bits_to_45_512(plane, u + 1), bits45));
        }
        w[2 * c] = lo, w[2 * c + 1] = hi;
    }
}

// Block b's products for rows r0 .. r0 + rows - 1 into acc: zero, has_off and two (a scale per 16 k) are
// constants once inlined, as in wide_tile.
static inline __attribute__((always_inline)) void block16_step(const qmm2_args *a, const __m512i w[8], int64_t b,
                                                                const void *gd, const void *gm, int64_t r0, int rows,
                                                                int zero, int has_off, int two, __m512 acc[W512_ROWS]) {
    const int8_t *xb = a->xq + r0 * a->K + b * BLOCK;
    __m512i s[W512_ROWS];
    for (int r = 0; r < rows; r++) s[r] = _mm512_setzero_si512();
#pragma GCC unroll 8
    for (int u = 0; u < 8; u++) {  // x[4u .. 4u + 3] of this block
        for (int r = 0; r < rows; r++) {
            int32_t x4;
            memcpy(&x4, xb + r * a->K + 4 * u, 4);
            s[r] = _mm512_dpbusd_epi32(s[r], w[u], _mm512_set1_epi32(x4));
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
    if (two) return;
    __m512 d = scales16(gd, b * CG, a->half);
    for (int r = 0; r < rows; r++) {
        int64_t i = (r0 + r) * a->nb + b;
        acc[r] = block_step16(a, acc[r], s[r], zero, a->xsum[i], d, i, has_off, gm, b * CG);
    }
}

// A tile of rows over every block of one group: from the wide bytes (src = the group's expansion) or from
// the packed blocks (src = the group's qs, packed = 1: expanded per block in registers, prefetched ahead
// by the tile of rows 0 as group_half_* do).
static inline __attribute__((always_inline)) void tile16(const qmm2_args *a, const uint8_t *src, int packed,
                                                          const void *gd, const void *gm, int64_t r0, int rows,
                                                          int bits, int table, int zero, int has_off, int two,
                                                          __m512 acc[W512_ROWS]) {
    const int64_t qbytes = qbytes_of(bits);
    const __m512i lut = table && packed ? table_u8(a->table) : _mm512_setzero_si512();
    for (int r = 0; r < rows; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < a->nb; b++) {
        __m512i w[8];
        if (packed) {
            const uint8_t *blk = src + b * qbytes;
            if (r0 == 0) prefetch_ahead(blk, qbytes);
            block16_from_packed(bits, table, lut, blk, w);
        } else {
            block16_from_wide(src + b * 512, w);
        }
        block16_step(a, w, b, gd, gm, r0, rows, zero, has_off, two, acc);
    }
}

static inline __attribute__((always_inline)) void tile16_rows(const qmm2_args *a, const uint8_t *src, int packed,
                                                               const void *gd, const void *gm, int64_t r0, int rows,
                                                               __m512 acc[W512_ROWS]) {
    if (a->table && a->two_scales) tile16(a, src, packed, gd, gm, r0, rows, 4, 1, 128, 0, 1, acc);
    else if (a->table) tile16(a, src, packed, gd, gm, r0, rows, 4, 1, 128, 0, 0, acc);
    else if (a->bits == 4) tile16(a, src, packed, gd, gm, r0, rows, 4, 0, 0, 1, 0, acc);
    else if (a->bits == 6) tile16(a, src, packed, gd, gm, r0, rows, 6, 0, 32, 0, 1, acc);
    else if (a->bits == 5 && a->has_off) tile16(a, src, packed, gd, gm, r0, rows, 5, 0, 0, 1, 0, acc);
    else if (a->bits == 5) tile16(a, src, packed, gd, gm, r0, rows, 5, 0, 16, 0, 0, acc);
    else if (a->two_scales) tile16(a, src, packed, gd, gm, r0, rows, 8, 0, 128, 0, 1, acc);
    else if (a->has_off) tile16(a, src, packed, gd, gm, r0, rows, 8, 0, 128, 1, 0, acc);
    else tile16(a, src, packed, gd, gm, r0, rows, 8, 0, 128, 0, 0, acc);
}

// 2-bit (Q2_K, qmatmul_avx2.h's group_half_q2): each block expanded in registers (chunk_q2 of both halves:
// vectors u = 0..3 hold k < 16, 4..7 k >= 16), and each half block's step is group_half_q2's, 16 columns at
// once: acc + float(sum(q xq)) * (d * sc * dx), then + (-dmin * m) * (dx * float(sum(xq))).
#if EXL_QMM_HALF_SCALES
static inline __attribute__((always_inline)) void tile16_q2(const qmm2_args *a, const uint8_t *gq, const void *gd,
                                                             const void *gm, int64_t r0, int rows,
                                                             __m512 acc[W512_ROWS]) {
    const __m512i low2 = _mm512_set1_epi8(0x03), low4 = _mm512_set1_epi32(0x0f);
    const __m512i gather = _mm512_broadcast_i32x4(_mm_setr_epi8(0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15));
    for (int r = 0; r < rows; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < a->nb; b++) {
        const uint8_t *blk = gq + b * 128;
        if (r0 == 0) prefetch_ahead(blk, 128);
        __m512i w[8];
        for (int c = 0; c < 4; c++) {
            __m512i v = _mm512_loadu_si512((const void *)(blk + 64 * (c / 2)));
            if (c % 2) v = _mm512_srli_epi16(v, 2);
            w[2 * c] = _mm512_shuffle_epi8(_mm512_and_si512(v, low2), gather);
            w[2 * c + 1] = _mm512_shuffle_epi8(_mm512_and_si512(_mm512_srli_epi16(v, 4), low2), gather);
        }
        const uint16_t *f = (const uint16_t *)gd + (b / 8) * 2 * CG;
        const __m512 dsup = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)f));
        const __m512 msup = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(f + CG)));
        const uint8_t *sm = (const uint8_t *)gm + b * 2 * CG;
        const int8_t *xb = a->xq + r0 * a->K + b * BLOCK;
        for (int j = 0; j < 2; j++) {
            __m512i s[W512_ROWS];
            for (int r = 0; r < rows; r++) s[r] = _mm512_setzero_si512();
            for (int u = 4 * j; u < 4 * j + 4; u++)
                for (int r = 0; r < rows; r++) {
                    int32_t x4;
                    memcpy(&x4, xb + r * a->K + 4 * u, 4);
                    s[r] = _mm512_dpbusd_epi32(s[r], w[u], _mm512_set1_epi32(x4));
                }
            __m512i packed = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(sm + j * CG)));
            __m512 d = _mm512_mul_ps(dsup, _mm512_cvtepi32_ps(_mm512_and_si512(packed, low4)));
            __m512 mv = _mm512_mul_ps(msup, _mm512_cvtepi32_ps(_mm512_srli_epi32(packed, 4)));
            for (int r = 0; r < rows; r++) {
                int64_t i = (r0 + r) * a->nb + b;
                acc[r] = _mm512_add_ps(acc[r], _mm512_mul_ps(_mm512_cvtepi32_ps(s[r]),
                                                             _mm512_mul_ps(d, _mm512_set1_ps(a->dx[i]))));
                __m512 xs = _mm512_set1_ps(a->dx[i] * (float)a->xsum16[2 * i + j]);
                acc[r] = _mm512_add_ps(acc[r], _mm512_mul_ps(mv, xs));
            }
        }
    }
}
#endif

// A tile of rows from the packed blocks, every width.
static inline __attribute__((always_inline)) void packed_rows(const qmm2_args *a, const uint8_t *gq, const void *gd,
                                                               const void *gm, int64_t r0, int rows,
                                                               __m512 acc[W512_ROWS]) {
#if EXL_QMM_HALF_SCALES
    if (a->bits == 2) {
        tile16_q2(a, gq, gd, gm, r0, rows, acc);
        return;
    }
#endif
    tile16_rows(a, gq, 1, gd, gm, r0, rows, acc);
}

// A group's expansion into memory: each block's vectors of block16_from_packed (the same bytes as
// expand_group's first 512 for 4-, 5- and 6-bit weights; 8-bit ones and tables' values + 128).
static void expand_group16(const qmm2_args *a, const uint8_t *gq, uint8_t *wide) {
    const int64_t qbytes = qbytes_of(a->bits);
    const __m512i lut = a->table ? table_u8(a->table) : _mm512_setzero_si512();
    for (int64_t b = 0; b < a->nb; b++) {
        const uint8_t *blk = gq + b * qbytes;
        for (int64_t l = 0; l < qbytes; l += 64)
            _mm_prefetch((const char *)(blk + EXPAND_PREFETCH_BYTES + l), _MM_HINT_T0);
        __m512i w[8];
        switch (a->bits) {  // constant widths for block16_from_packed
            case 4:
                if (a->table) block16_from_packed(4, 1, lut, blk, w);
                else block16_from_packed(4, 0, lut, blk, w);
                break;
            case 5: block16_from_packed(5, 0, lut, blk, w); break;
            case 6: block16_from_packed(6, 0, lut, blk, w); break;
            default: block16_from_packed(8, 0, lut, blk, w); break;
        }
        for (int u = 0; u < 8; u++) _mm512_storeu_si512((void *)(wide + b * 512 + 64 * u), w[u]);
    }
}

// Output row r, the group's 16 columns from n0 (store_half per 8: the same bias adds and roundings).
static inline void store16(const qmm2_args *a, int64_t r, int64_t n0, __m512 acc) {
    store_half(a, r, n0, 0, _mm512_castps512_ps256(acc));
    if (n0 + 8 < a->N) store_half(a, r, n0, 1, _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc), 1)));
}

// The groups begin .. end - 1 for every row: from 8 rows on from each group's expansion (wide: 512 bytes a
// block, expand_group16) in tiles of 8, 4, 2 and 1 rows; below, or without wide, from the packed blocks,
// all rows in one tile (so each block is expanded once per group either way, up to 8 rows).
static void qmm2_groups512(const qmm2_args *a, int64_t begin, int64_t end, uint8_t *wide) {
    int64_t nb = a->nb;
    for (int64_t g = begin; g < end; g++) {
        const uint8_t *gq = a->qs + g * nb * qbytes_of(a->bits);
        if (wide) expand_group16(a, gq, wide);
        const void *gd, *gm;
        group_scales(a, g, &gd, &gm);
        int64_t n0 = g * CG;
        for (int64_t r0 = 0; r0 < a->M;) {
            int64_t left = a->M - r0;
            __m512 acc[W512_ROWS];
            int rows;
            if (wide) {
                rows = left >= 8 ? 8 : left >= 4 ? 4 : left >= 2 ? 2 : 1;
                switch (rows) {  // constant row counts keep the sums in registers
                    case 8: tile16_rows(a, wide, 0, gd, gm, r0, 8, acc); break;
                    case 4: tile16_rows(a, wide, 0, gd, gm, r0, 4, acc); break;
                    case 2: tile16_rows(a, wide, 0, gd, gm, r0, 2, acc); break;
                    default: tile16_rows(a, wide, 0, gd, gm, r0, 1, acc); break;
                }
            } else {
                rows = left >= 8 ? 8 : (int)left;
                switch (rows) {
                    case 8: packed_rows(a, gq, gd, gm, r0, 8, acc); break;
                    case 7: packed_rows(a, gq, gd, gm, r0, 7, acc); break;
                    case 6: packed_rows(a, gq, gd, gm, r0, 6, acc); break;
                    case 5: packed_rows(a, gq, gd, gm, r0, 5, acc); break;
                    case 4: packed_rows(a, gq, gd, gm, r0, 4, acc); break;
                    case 3: packed_rows(a, gq, gd, gm, r0, 3, acc); break;
                    case 2: packed_rows(a, gq, gd, gm, r0, 2, acc); break;
                    default: packed_rows(a, gq, gd, gm, r0, 1, acc); break;
                }
            }
            for (int i = 0; i < rows; i++) store16(a, r0 + i, n0, acc[i]);
            r0 += rows;
        }
    }
}
