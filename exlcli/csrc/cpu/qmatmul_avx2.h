// The AVX2 body of qmatmul.c, included once from it where the compiler targets AVX2 (AVX-512 CPUs too):
// the activations' int8 quantization and the 256-bit tiles (qmm2_groups256). It reads the repacked layout
// that qmatmul.c describes, through the pieces it shares with the AVX-512 VNNI body (qmatmul_common.h).
//
// Integer dot products, as llama.cpp's CPU kernels do: each row's activations are quantized per
// block of 32 to int8 (q8 below), and a block's products are exact 8 x 8-bit integer sums
// (vpmaddubsw + vpmaddwd), one float scale per block. An fp32 product per weight is compute-bound:
// 2.4-2.8x slower per call on an AVX2 AMD EPYC.
//
// Activations, per row and block of 32 (v = the bf16 values as fp32):
//   amax = max |v|; dx = amax / 127; xq = rint(v * (amax > 0 ? 127 / amax : 0)) (nearest, ties to
//   even), in -127..127; xs = dx * sum(xq). A block holding a NaN or an infinity gets dx = NaN and xq = 0.
// 5- and 6-bit weights are held as 5 / 6 bits (q in 0..31 / 0..63: a nibble and planes of the high bits,
// merged in registers); Q5_0's q - 16 (5-bit without offsets) and Q6_K's q - 32 are summed as
// sum(q xq) - 16 sum(xq) (- 32 sum(xq) per 16 k), the same integers as the 8-bit path's.
// Each output, blocks in order from 0, separate fp32 multiplies and adds (no fused multiply-add, so
// that torch ops reproduce it bit for bit: QuantCpuLinear.emulate_kernel):
//   acc = 0; per block: acc = acc + float(sum_k q_k xq_k) * (d * dx)          (one scale)
//                    or acc = acc + float(sum_{k<16}) * (d0 * dx); acc = acc + float(sum_{k>=16}) * (d1 * dx)
//                       then, with offsets, acc = acc + m * xs;
//   y = acc + bias.
// The integer sums are exact (|sum| < 2^24, so float() is too). Every output is made by the same
// operations whatever M is and wherever its row sits, so rows are the same in any batch.

#pragma once
#include <immintrin.h>
#include <math.h>
#include <stdlib.h>

#include "pool.h"
#include "qmatmul_common.h"

#define RT 4  // rows sharing each weight vector

// xq int8 [M, K], dx and xs fp32 [M, nb]: the rule above, 8 lanes at a time (a max, a product rounded
// to the nearest integer, ties to even, as rintf does, and an integer sum: the same values as one
// at a time).
static void quantize_rows(const uint16_t *x, int64_t M, int64_t K, int8_t *xq, float *dx, float *xs,
                          int32_t *xsum, int32_t *xsum16) {
    int64_t nb = K / BLOCK;
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    const __m256 largest = _mm256_set1_ps(3.40282347e38f);
    const __m256i q_max = _mm256_set1_epi32(127), q_min = _mm256_set1_epi32(-127);
    const __m256i dword_order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // undoes the packs' lane interleave
    for (int64_t r = 0; r < M; r++) {
        for (int64_t b = 0; b < nb; b++) {
            const uint16_t *src = x + r * K + b * BLOCK;
            int8_t *dst = xq + r * K + b * BLOCK;
            __m256 v[4], amax8 = _mm256_setzero_ps();
            int finite = 0xff;
            for (int i = 0; i < 4; i++) {
                __m128i h = _mm_loadu_si128((const __m128i *)(src + 8 * i));
                v[i] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
                __m256 a = _mm256_and_ps(v[i], abs_mask);
                finite &= _mm256_movemask_ps(_mm256_cmp_ps(a, largest, _CMP_LE_OQ));  // NaN compares false
                amax8 = _mm256_max_ps(amax8, a);
            }
            if (finite != 0xff) {  // a NaN or an infinity
                memset(dst, 0, BLOCK);
                dx[r * nb + b] = xs[r * nb + b] = NAN;
                xsum[r * nb + b] = xsum16[2 * (r * nb + b)] = xsum16[2 * (r * nb + b) + 1] = 0;
                continue;
            }
            __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax8), _mm256_extractf128_ps(amax8, 1));
            m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
            float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1)));
            float scale = amax / 127.0f, id = amax > 0.0f ? 127.0f / amax : 0.0f;
            __m256 vid = _mm256_set1_ps(id);
            __m256i q[4];
            for (int i = 0; i < 4; i++) {
                __m256 t = _mm256_round_ps(_mm256_mul_ps(v[i], vid), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
                q[i] = _mm256_max_epi32(_mm256_min_epi32(_mm256_cvtps_epi32(t), q_max), q_min);
            }
            int32_t half_sums[2];  // k < 16, k >= 16
            for (int j = 0; j < 2; j++) {
                __m256i s8 = _mm256_add_epi32(q[2 * j], q[2 * j + 1]);
                __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s8), _mm256_extracti128_si256(s8, 1));
                s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
                s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1));
                half_sums[j] = _mm_cvtsi128_si32(s4);
            }
            __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
            _mm256_storeu_si256((__m256i *)dst, _mm256_permutevar8x32_epi32(bytes, dword_order));
            dx[r * nb + b] = scale;
            xsum16[2 * (r * nb + b)] = half_sums[0];
            xsum16[2 * (r * nb + b) + 1] = half_sums[1];
            xsum[r * nb + b] = half_sums[0] + half_sums[1];
            xs[r * nb + b] = scale * (float)xsum[r * nb + b];
        }
    }
}

// Rows begin .. end - 1 of quantize_rows, for the pool: each row's values depend on that row only. From
// QUANTIZE_PARALLEL_ROWS rows on the pool shares them (512 x 576: ~0.15 ms a call on one thread).
#define QUANTIZE_PARALLEL_ROWS 64
typedef struct {
    const uint16_t *x;
    int64_t K;
    int8_t *xq;
    float *dx, *xs;
    int32_t *xsum, *xsum16;
} quantize_task;

static void quantize_rows_task(void *ctx, int64_t begin, int64_t end) {
    const quantize_task *t = (const quantize_task *)ctx;
    int64_t nb = t->K / BLOCK;
    quantize_rows(t->x + begin * t->K, end - begin, t->K, t->xq + begin * t->K, t->dx + begin * nb,
                  t->xs + begin * nb, t->xsum + begin * nb, t->xsum16 + 2 * begin * nb);
}


// One (group, block, chunk c, half h) of 4-bit weights as two vectors of 8 columns x 4 k, one column
// per 32-bit lane: lo holds k = 8c + 0..3, hi k = 8c + 4..7 (q in 0..15, as unsigned bytes). The 32
// bytes at 64c + 32h hold columns 8h..8h+3 (lane 0) and the next four (lane 1); in each 16-byte lane
// bytes 0-7 carry the pairs (k, k+1) of the four columns for k = 8c, bytes 8-15 for k = 8c + 2, low
// nibbles for those k, high nibbles for k + 4: a byte shuffle gathers each column's four.
static inline __attribute__((always_inline)) void chunk_q4(const uint8_t *blk, int c, int h, __m256i *lo,
                                                            __m256i *hi) {
    const __m256i low4 = _mm256_set1_epi8(0x0f);
    const __m256i gather = _mm256_setr_epi8(0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15,
                                            0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15);
    __m256i v = _mm256_loadu_si256((const __m256i *)(blk + 64 * c + 32 * h));
    *lo = _mm256_shuffle_epi8(_mm256_and_si256(v, low4), gather);
    *hi = _mm256_shuffle_epi8(_mm256_and_si256(_mm256_srli_epi16(v, 4), low4), gather);
}


static inline __m256i bcast4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

// With AVX-VNNI (Intel's client cores from Alder Lake on; AMD's Zen 4 and 5, which take the AVX-512 body)
// one vpdpbusd adds four u8 x s8 products into each int32 lane, exactly: the integer sums of vpmaddubsw
// then vpmaddwd, without their int16 step. The tiles below take it where it is built.
#if defined(__AVXVNNI__)
#define EXL_QMM_AVXVNNI 1
#else
#define EXL_QMM_AVXVNNI 0
#endif

// acc + the int32 sums of u (unsigned bytes) times s (signed bytes), four a lane.
static inline __attribute__((always_inline)) __m256i dot_add(__m256i acc, __m256i u, __m256i s) {
#if EXL_QMM_AVXVNNI
    return _mm256_dpbusd_avx_epi32(acc, u, s);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}

// The int32 sums of u0 s0 + u1 s1 where each lane's pair of vpmaddubsw pairs fits int16 (the callers' bounds).
static inline __attribute__((always_inline)) __m256i pair_dot(__m256i u0, __m256i s0, __m256i u1, __m256i s1) {
#if EXL_QMM_AVXVNNI
    return _mm256_dpbusd_avx_epi32(_mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u0, s0), u1, s1);
#else
    return _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(u0, s0), _mm256_maddubs_epi16(u1, s1)),
                             _mm256_set1_epi16(1));
#endif
}




// 8 columns' scales or offsets from scales_at's base, widened to fp32.
static inline __attribute__((always_inline)) __m256 scales8(const void *base, int64_t i, int half) {
#if EXL_QMM_HALF_SCALES
    if (half) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)base + i)));
#endif
    (void)half;
    return _mm256_loadu_ps((const float *)base + i);
}


// 8 columns' offsets: from gm, or where the layout holds none for 4-bit weights with offsets (Q4_0, whose offset
// is always -8 d: exl_qmatmul_args.m NULL) -8 d of the same columns' scales, exact in fp32, so the same bits as
// the stored values; the weights' bytes a block fall from 320 to 288 (fp16 scales), llama.cpp's Q4_0 blocks'.
static inline __attribute__((always_inline)) __m256 offsets8(const void *gm, int64_t mi, int half, __m256 d) {
    return gm ? scales8(gm, mi, half) : _mm256_mul_ps(d, _mm256_set1_ps(-8.0f));
}

// acc + float(sum) * (d * dx): the scaled step of the order in the header.
static inline __attribute__((always_inline)) __m256 add_scaled(__m256 acc, __m256i sum, __m256 d, float dx) {
    return _mm256_add_ps(acc, _mm256_mul_ps(_mm256_cvtepi32_ps(sum), _mm256_mul_ps(d, _mm256_set1_ps(dx))));
}

// acc += float(sum - zero * xsum) * (d * dx) (+ m * xs with offsets, m of column mi): a block's step in the
// header's order, for every width and tile shape.
static inline __attribute__((always_inline)) __m256 block_step(const qmm2_args *a, __m256 acc, __m256i sum, int zero,
                                                               int32_t xsum, __m256 d, int64_t i, int has_off,
                                                               const void *gm, int64_t mi) {
    if (zero) sum = _mm256_sub_epi32(sum, _mm256_set1_epi32(zero * xsum));
    acc = add_scaled(acc, sum, d, a->dx[i]);
    if (has_off) acc = _mm256_add_ps(acc, _mm256_mul_ps(offsets8(gm, mi, a->half, d), _mm256_set1_ps(a->xs[i])));
    return acc;
}

// Rows r0 .. r0 + rows - 1, half h (columns n0 + 8h ..) of one column group of 4-bit weights.
// q <= 15 and |xq| <= 127: a pair is at most 3,810, so the 8 pairs of a block's 32 k fit int16.
static inline __attribute__((always_inline)) void group_half_q4_body(const qmm2_args *a, const uint8_t *gq,
                                                                      const void *gd, const void *gm, int64_t r0,
                                                                      int rows, int h, __m256 acc[RT]) {
    const __m256i ones = _mm256_set1_epi16(1);
    for (int r = 0; r < rows; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < a->nb; b++) {
        const uint8_t *blk = gq + b * 256;
        const int8_t *xb = a->xq + r0 * a->K + b * BLOCK;
        if (h == 0 && r0 == 0) prefetch_ahead(blk, 256);
        __m256i s16[RT];
        for (int r = 0; r < rows; r++) s16[r] = _mm256_setzero_si256();
        for (int c = 0; c < 4; c++) {
            __m256i lo, hi;
            chunk_q4(blk, c, h, &lo, &hi);
            for (int r = 0; r < rows; r++) {
                const int8_t *x = xb + r * a->K + 8 * c;
#if EXL_QMM_AVXVNNI  // int32 sums in s16
                s16[r] = dot_add(dot_add(s16[r], lo, bcast4(x)), hi, bcast4(x + 4));
#else
                s16[r] = _mm256_add_epi16(s16[r], _mm256_maddubs_epi16(lo, bcast4(x)));
                s16[r] = _mm256_add_epi16(s16[r], _mm256_maddubs_epi16(hi, bcast4(x + 4)));
#endif
            }
        }
        __m256 d = scales8(gd, b * CG + 8 * h, a->half), mv = offsets8(gm, b * CG + 8 * h, a->half, d);
        for (int r = 0; r < rows; r++) {
            int64_t i = (r0 + r) * a->nb + b;
            acc[r] = add_scaled(acc[r], EXL_QMM_AVXVNNI ? s16[r] : _mm256_madd_epi16(s16[r], ones), d, a->dx[i]);
            acc[r] = _mm256_add_ps(acc[r], _mm256_mul_ps(mv, _mm256_set1_ps(a->xs[i])));
        }
    }
}

static inline __attribute__((always_inline)) void group_half_q4(const qmm2_args *a, const uint8_t *gq,
                                                                 const void *gd, const void *gm, int64_t r0,
                                                                 int rows, int h, __m256 acc[RT]) {
    if (gm) group_half_q4_body(a, gq, gd, gm, r0, rows, h, acc);  // gm a constant in each: no test per block
    else group_half_q4_body(a, gq, gd, NULL, r0, rows, h, acc);
}

// 4-bit indices into a table of 16 int8 values (IQ4): chunk_q4's nibbles looked up (one byte shuffle),
// then the 8-bit path's |w| against x with w's sign. |w| <= 128: a pair is at most 32,512, so each is widened
// to int32 at once (the 4-bit path's int16 sums would overflow). The block's steps: group_half_q8's, with one
// scale or two (per 16 k: Q3_K).
static inline __attribute__((always_inline)) __m256i table_lookup(const int8_t *table) {
    return _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)table));
}

static inline __attribute__((always_inline)) void group_half_q4t(const qmm2_args *a, const uint8_t *gq,
                                                                  const void *gd, int64_t r0, int rows, int h,
                                                                  __m256 acc[RT]) {
    const __m256i lut = table_lookup(a->table);
    const int64_t spb = a->two_scales ? 2 : 1;
    for (int r = 0; r < rows; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < a->nb; b++) {
        const uint8_t *blk = gq + b * 256;
        const int8_t *xb = a->xq + r0 * a->K + b * BLOCK;
        const int64_t db = b * spb * CG + 8 * h;
        if (h == 0 && r0 == 0) prefetch_ahead(blk, 256);
        __m256i s[RT];
        for (int r = 0; r < rows; r++) s[r] = _mm256_setzero_si256();
        for (int c = 0; c < 4; c++) {
            if (c == 2 && a->two_scales) {  // k < 16 enters acc with its own scale
                __m256 d0 = scales8(gd, db, a->half);
                for (int r = 0; r < rows; r++) {
                    acc[r] = add_scaled(acc[r], s[r], d0, a->dx[(r0 + r) * a->nb + b]);
                    s[r] = _mm256_setzero_si256();
                }
            }
            __m256i lo, hi;
            chunk_q4(blk, c, h, &lo, &hi);
            lo = _mm256_shuffle_epi8(lut, lo), hi = _mm256_shuffle_epi8(lut, hi);
            const __m256i lo_abs = _mm256_abs_epi8(lo), hi_abs = _mm256_abs_epi8(hi);
            for (int r = 0; r < rows; r++) {
                const int8_t *x = xb + r * a->K + 8 * c;
                s[r] = dot_add(dot_add(s[r], lo_abs, _mm256_sign_epi8(bcast4(x), lo)), hi_abs,
                               _mm256_sign_epi8(bcast4(x + 4), hi));
            }
        }
        __m256 d = scales8(gd, db + (a->two_scales ? CG : 0), a->half);
        for (int r = 0; r < rows; r++) {
            int64_t i = (r0 + r) * a->nb + b;
            acc[r] = block_step(a, acc[r], s[r], 0, 0, d, i, 0, NULL, 0);
        }
    }
}

// The same for 8-bit weights: |q| <= 128 against x with q's sign, a pair at most 32,512 (int16), each
// pair widened to int32 at once. With two scales per block the k < 16 sum enters acc before the rest.
static inline __attribute__((always_inline)) void group_half_q8(const qmm2_args *a, const uint8_t *gq,
                                                                 const void *gd, const void *gm, int64_t r0,
                                                                 int rows, int h, __m256 acc[RT]) {
    int64_t spb = a->two_scales ? 2 : 1;
    for (int r = 0; r < rows; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < a->nb; b++) {
        const uint8_t *blk = gq + b * 512;
        const int8_t *xb = a->xq + r0 * a->K + b * BLOCK;
        if (h == 0 && r0 == 0) prefetch_ahead(blk, 512);
        const int64_t db = b * spb * CG + 8 * h;
        __m256i s[RT];
        for (int r = 0; r < rows; r++) s[r] = _mm256_setzero_si256();
        for (int p = 0; p < 16; p += 2) {
            if (p == 8 && a->two_scales) {
                __m256 d0 = scales8(gd, db, a->half);
                for (int r = 0; r < rows; r++) {
                    acc[r] = add_scaled(acc[r], s[r], d0, a->dx[(r0 + r) * a->nb + b]);
                    s[r] = _mm256_setzero_si256();
                }
            }
            __m256i w = quad_q8(blk, p, h), wabs = _mm256_abs_epi8(w);
            for (int r = 0; r < rows; r++) {
                s[r] = dot_add(s[r], wabs, _mm256_sign_epi8(bcast4(xb + r * a->K + 2 * p), w));
            }
        }
        __m256 d = scales8(gd, db + (a->two_scales ? CG : 0), a->half);
        for (int r = 0; r < rows; r++) {
            int64_t i = (r0 + r) * a->nb + b;
            acc[r] = block_step(a, acc[r], s[r], 0, 0, d, i, a->has_off, gm, b * CG + 8 * h);
        }
    }
}

// Bit t of each byte moved to bit 4 (t a constant once inlined): the 16-bit shifts move no other
// byte's bit there.
static inline __attribute__((always_inline)) __m256i bit_to_4(__m256i v, int t) {
    switch (t) {
        case 0: return _mm256_slli_epi16(v, 4);
        case 1: return _mm256_slli_epi16(v, 3);
        case 2: return _mm256_slli_epi16(v, 2);
        case 3: return _mm256_slli_epi16(v, 1);
        case 4: return v;
        case 5: return _mm256_srli_epi16(v, 1);
        case 6: return _mm256_srli_epi16(v, 2);
        default: return _mm256_srli_epi16(v, 3);
    }
}

// 5-bit (this file's own layout): a (group, block) is 320 bytes. The 32 bytes at 64c + 32h hold columns
// 8h..8h+7 for k = 8c .. 8c + 7, one column per 32-bit lane, byte i the low four bits of k = 8c + i % 4
// (low nibble: lo) and of k + 4 (high nibble: hi), so no shuffle is needed; then per half h a 32-byte
// plane of the high bits at 256 + 32h: bit 2c (2c + 1) of its byte i is the high bit of lo's (hi's) byte i.
static inline __attribute__((always_inline)) void chunk_q5(const uint8_t *blk, __m256i plane, int c, int h,
                                                            __m256i *lo, __m256i *hi) {
    const __m256i low4 = _mm256_set1_epi8(0x0f), bit4 = _mm256_set1_epi8(0x10);
    __m256i v = _mm256_loadu_si256((const __m256i *)(blk + 64 * c + 32 * h));
    *lo = _mm256_or_si256(_mm256_and_si256(v, low4), _mm256_and_si256(bit_to_4(plane, 2 * c), bit4));
    *hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), low4),
                          _mm256_and_si256(bit_to_4(plane, 2 * c + 1), bit4));
}

// q in 0..31: a pair is at most 7,874, so four fit int16 (two chunks summed there, then widened to int32).
// The block's eight weight vectors are expanded once, then each row takes them in turn (rows inside: the
// 4-row tile's sums then fit the 16 registers beside them). Per block sum(q xq) - zero * sum(xq), then
// the order of the header.
static inline __attribute__((always_inline)) __m256i dot_q5(const __m256i w[8], const int8_t *x, int c) {
#if EXL_QMM_AVXVNNI
    __m256i s = pair_dot(w[2 * c], bcast4(x + 8 * c), w[2 * c + 1], bcast4(x + 8 * c + 4));
    return dot_add(dot_add(s, w[2 * c + 2], bcast4(x + 8 * c + 8)), w[2 * c + 3], bcast4(x + 8 * c + 12));
#else
    __m256i p0 = _mm256_add_epi16(_mm256_maddubs_epi16(w[2 * c], bcast4(x + 8 * c)),
                                  _mm256_maddubs_epi16(w[2 * c + 1], bcast4(x + 8 * c + 4)));
    __m256i p1 = _mm256_add_epi16(_mm256_maddubs_epi16(w[2 * c + 2], bcast4(x + 8 * c + 8)),
                                  _mm256_maddubs_epi16(w[2 * c + 3], bcast4(x + 8 * c + 12)));
    return _mm256_madd_epi16(_mm256_add_epi16(p0, p1), _mm256_set1_epi16(1));
#endif
}

static inline __attribute__((always_inline)) void group_half_q5(const qmm2_args *a, const uint8_t *gq,
                                                                 const void *gd, const void *gm, int64_t r0,
                                                                 int rows, int h, __m256 acc[RT]) {
    for (int r = 0; r < rows; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < a->nb; b++) {
        const uint8_t *blk = gq + b * 320;
        const int8_t *xb = a->xq + r0 * a->K + b * BLOCK;
        const __m256i plane = _mm256_loadu_si256((const __m256i *)(blk + 256 + 32 * h));
        if (h == 0 && r0 == 0) prefetch_ahead(blk, 320);
        __m256i w[8];
        for (int c = 0; c < 4; c++) chunk_q5(blk, plane, c, h, &w[2 * c], &w[2 * c + 1]);
        __m256 d = scales8(gd, b * CG + 8 * h, a->half);
        for (int r = 0; r < rows; r++) {
            const int8_t *x = xb + r * a->K;
            __m256i sum = _mm256_add_epi32(dot_q5(w, x, 0), dot_q5(w, x, 2));
            int64_t i = (r0 + r) * a->nb + b;
            acc[r] = block_step(a, acc[r], sum, a->zero, a->xsum[i], d, i, a->has_off, gm, b * CG + 8 * h);
        }
    }
}

// 6-bit (Q6_K: two scales per block, no offsets, q - 32 held as q in 0..63): a (group, block) is 384
// bytes, the 256 of the 5-bit layout for the low four bits, then per half h two 32-byte planes of the
// high two bits at 256 + 64h (chunks 0, 1: k < 16) and 256 + 64h + 32 (chunks 2, 3): bits 2u, 2u + 1 of
// byte i of the plane of chunks (c, c + 1) are for byte i of chunk c + u / 2's lo (u even) or hi (u odd).
static inline __attribute__((always_inline)) __m256i bits_to_45(__m256i v, int u) {
    switch (u) {
        case 0: return _mm256_slli_epi16(v, 4);
        case 1: return _mm256_slli_epi16(v, 2);
        case 2: return v;
        default: return _mm256_srli_epi16(v, 2);
    }
}

static inline __attribute__((always_inline)) void chunk_q6(const uint8_t *blk, __m256i plane, int c, int h,
                                                            __m256i *lo, __m256i *hi) {
    const __m256i low4 = _mm256_set1_epi8(0x0f), bits45 = _mm256_set1_epi8(0x30);
    __m256i v = _mm256_loadu_si256((const __m256i *)(blk + 64 * c + 32 * h));
    int u = 2 * (c % 2);
    *lo = _mm256_or_si256(_mm256_and_si256(v, low4), _mm256_and_si256(bits_to_45(plane, u), bits45));
    *hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), low4),
                          _mm256_and_si256(bits_to_45(plane, u + 1), bits45));
}

// q <= 63: a chunk's lo + hi pair is at most 32,004 (int16), widened at once. Each half block's sum is
// sum(q xq) - 32 * sum(xq) over its 16 k, entering acc with its scale as the 8-bit path's do.
static inline __attribute__((always_inline)) void group_half_q6(const qmm2_args *a, const uint8_t *gq,
                                                                 const void *gd, int64_t r0, int rows, int h,
                                                                 __m256 acc[RT]) {
    for (int r = 0; r < rows; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < a->nb; b++) {
        const uint8_t *blk = gq + b * 384;
        const int8_t *xb = a->xq + r0 * a->K + b * BLOCK;
        if (h == 0 && r0 == 0) prefetch_ahead(blk, 384);
        __m256i s[RT];
#pragma GCC unroll 4
        for (int c = 0; c < 4; c++) {
            const __m256i plane = _mm256_loadu_si256((const __m256i *)(blk + 256 + 64 * h + 32 * (c / 2)));
            __m256i lo, hi;
            chunk_q6(blk, plane, c, h, &lo, &hi);
            for (int r = 0; r < rows; r++) {
                const int8_t *x = xb + r * a->K + 8 * c;
                __m256i wide = pair_dot(lo, bcast4(x), hi, bcast4(x + 4));
                s[r] = c % 2 == 0 ? wide : _mm256_add_epi32(s[r], wide);
            }
            if (c % 2 == 1) {
                __m256 d = scales8(gd, (2 * b + c / 2) * CG + 8 * h, a->half);
                for (int r = 0; r < rows; r++) {
                    int64_t i = (r0 + r) * a->nb + b;
                    __m256i sum = _mm256_sub_epi32(s[r], _mm256_set1_epi32(32 * a->xsum16[2 * i + c / 2]));
                    acc[r] = add_scaled(acc[r], sum, d, a->dx[i]);
                }
            }
        }
    }
}

// Prefill (M >= WIDE_MIN_ROWS), 4-, 5- and 6-bit weights: the group's weights are expanded once per call
// into bytes q (expand_group: for block b, chunk c, j = 0 (lo) / 1 (hi) and half h, the vector of
// chunk_q4 / _q5 / _q6 at wide + b * 512 + 64 (2c + j) + 32h), and a tile of WIDE_ROWS rows covers both
// halves of the group: one broadcast of x serves the 16 columns, and the expansion is not redone per
// tile of rows. Per 4-bit 32 k, 5-bit 16 k and 6-bit 8 k the pairs are summed in int16 (the bounds of
// group_half_q4 / _q5 / _q6), then widened; the integer sums and the fp32 steps of each output are those
// of group_half_*, in the same order, so the outputs are the same bits.
// Against the 4-row, 8-column tiles (one thread, 512 rows, the 2-core EPYC): 5-bit 1536 x 576 20.4 ms against
// 26.1, 6-bit 576 x 1536 25.6 against 29.6, 4-bit 576 x 1536 19.3 against 20.2. Its vpmaddubsw and vpmaddwd take
// 2 cycles each on its one vector multiply pipe: 40 cycles per 16 columns x 32 k at 5 bits, the bound here.
#define WIDE_MIN_ROWS 8
#define WIDE_ROWS 2

// Per block; 4-bit with a table is expanded as 8-bit (the values, not the indices).
static inline int64_t wide_bytes(int bits) { return bits == 8 ? 1024 : 512; }


// 8-bit (and 4-bit with a table: its values): |q| in the 512 bytes of the other widths' layout, then q (for
// the signs) in the next 512.
static void expand_group(int bits, const int8_t *table, const uint8_t *gq, int64_t nb, uint8_t *wide) {
    int64_t qbytes = qbytes_of(bits);
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = gq + b * qbytes;
        uint8_t *wb = wide + b * wide_bytes(table ? 8 : bits);
        for (int64_t l = 0; l < qbytes; l += 64)
            _mm_prefetch((const char *)(blk + EXPAND_PREFETCH_BYTES + l), _MM_HINT_T0);
        for (int h = 0; h < 2; h++) {
            for (int c = 0; c < 4; c++) {
                __m256i lo, hi;
                const uint8_t *plane = blk + 256 + (bits == 5 ? 32 * h : 64 * h + 32 * (c / 2));
                if (bits == 4) {
                    chunk_q4(blk, c, h, &lo, &hi);
                    if (table) lo = _mm256_shuffle_epi8(table_lookup(table), lo),
                               hi = _mm256_shuffle_epi8(table_lookup(table), hi);
                } else if (bits == 5) chunk_q5(blk, _mm256_loadu_si256((const __m256i *)plane), c, h, &lo, &hi);
                else if (bits == 6) chunk_q6(blk, _mm256_loadu_si256((const __m256i *)plane), c, h, &lo, &hi);
                else lo = quad_q8(blk, 4 * c, h), hi = quad_q8(blk, 4 * c + 2, h);
                if (bits == 8 || table) {
                    _mm256_storeu_si256((__m256i *)(wb + 512 + 64 * (2 * c) + 32 * h), lo);
                    _mm256_storeu_si256((__m256i *)(wb + 512 + 64 * (2 * c + 1) + 32 * h), hi);
                    lo = _mm256_abs_epi8(lo), hi = _mm256_abs_epi8(hi);
                }
                _mm256_storeu_si256((__m256i *)(wb + 64 * (2 * c) + 32 * h), lo);
                _mm256_storeu_si256((__m256i *)(wb + 64 * (2 * c + 1) + 32 * h), hi);
            }
        }
    }
}

// bits, zero, has_off and two (scales per 16 k) are constants once inlined: (4, 0, 1, 0), (5, 16, 0, 0),
// (5, 0, 1, 0), (6, 32, 0, 1), (8, 0, 0 or 1, 0), (8, 0, 0, 1). 8-bit: |q| against x with q's sign, as
// group_half_q8 does.
static inline __attribute__((always_inline)) void wide_tile(const qmm2_args *a, const uint8_t *wide, const void *gd,
                                                             const void *gm, int64_t r0, int rows, int bits, int zero,
                                                             int has_off, int two, __m256 acc[WIDE_ROWS][2]) {
    const __m256i ones = _mm256_set1_epi16(1);
    const int per16 = bits == 4 ? 8 : bits == 5 ? 4 : bits == 6 ? 2 : 1;  // x vectors (4 k) whose pairs int16 holds
    for (int r = 0; r < rows; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t b = 0; b < a->nb; b++) {
        const uint8_t *wb = wide + b * wide_bytes(bits);
        const int8_t *xb = a->xq + r0 * a->K + b * BLOCK;
        __m256i s[WIDE_ROWS][2], p[WIDE_ROWS][2];
#pragma GCC unroll 8
        for (int u = 0; u < 8; u++) {  // x[4u .. 4u + 3] of this block
            const __m256i w0 = _mm256_loadu_si256((const __m256i *)(wb + 64 * u));
            const __m256i w1 = _mm256_loadu_si256((const __m256i *)(wb + 64 * u + 32));
            __m256i q0 = w0, q1 = w1;
            if (bits == 8) {
                q0 = _mm256_loadu_si256((const __m256i *)(wb + 512 + 64 * u));
                q1 = _mm256_loadu_si256((const __m256i *)(wb + 512 + 64 * u + 32));
            }
#if EXL_QMM_AVXVNNI  // straight into s, from zero at the block's (or the 16 k's) first u
            for (int r = 0; r < rows; r++) {
                __m256i xv = bcast4(xb + r * a->K + 4 * u);
                int first = two ? u % 4 == 0 : u == 0;
                for (int h = 0; h < 2; h++) {
                    __m256i from = first ? _mm256_setzero_si256() : s[r][h];
                    __m256i sx = bits == 8 ? _mm256_sign_epi8(xv, h ? q1 : q0) : xv;
                    s[r][h] = dot_add(from, h ? w1 : w0, sx);
                }
            }
            (void)p, (void)ones, (void)per16;
#else
            for (int r = 0; r < rows; r++) {
                __m256i xv = bcast4(xb + r * a->K + 4 * u);
                __m256i m0 = _mm256_maddubs_epi16(w0, bits == 8 ? _mm256_sign_epi8(xv, q0) : xv);
                __m256i m1 = _mm256_maddubs_epi16(w1, bits == 8 ? _mm256_sign_epi8(xv, q1) : xv);
                p[r][0] = u % per16 == 0 ? m0 : _mm256_add_epi16(p[r][0], m0);
                p[r][1] = u % per16 == 0 ? m1 : _mm256_add_epi16(p[r][1], m1);
            }
            if (u % per16 == per16 - 1) {
                for (int r = 0; r < rows; r++)
                    for (int h = 0; h < 2; h++) {
                        __m256i w32 = _mm256_madd_epi16(p[r][h], ones);
                        int first = two ? u % 4 == per16 - 1 : u == per16 - 1;  // of the block (or of 16 k)
                        s[r][h] = first ? w32 : _mm256_add_epi32(s[r][h], w32);
                    }
            }
#endif
            if (two && u % 4 == 3) {  // a scale per 16 k
                for (int h = 0; h < 2; h++) {
                    __m256 d = scales8(gd, (2 * b + u / 4) * CG + 8 * h, a->half);
                    for (int r = 0; r < rows; r++) {
                        int64_t i = (r0 + r) * a->nb + b;
                        acc[r][h] = block_step(a, acc[r][h], s[r][h], zero, a->xsum16[2 * i + u / 4], d, i, 0, gm, 0);
                    }
                }
            }
        }
        if (two) continue;
        for (int h = 0; h < 2; h++) {
            __m256 d = scales8(gd, b * CG + 8 * h, a->half);
            for (int r = 0; r < rows; r++) {
                int64_t i = (r0 + r) * a->nb + b;
                acc[r][h] = block_step(a, acc[r][h], s[r][h], zero, a->xsum[i], d, i, has_off, gm, b * CG + 8 * h);
            }
        }
    }
}

static inline __attribute__((always_inline)) void wide_rows(const qmm2_args *a, const uint8_t *wide, const void *gd,
                                                             const void *gm, int64_t r0, int rows,
                                                             __m256 acc[WIDE_ROWS][2]) {
    if (a->table && a->two_scales) wide_tile(a, wide, gd, gm, r0, rows, 8, 0, 0, 1, acc);
    else if (a->table) wide_tile(a, wide, gd, gm, r0, rows, 8, 0, 0, 0, acc);
    else if (a->bits == 4) wide_tile(a, wide, gd, gm, r0, rows, 4, 0, 1, 0, acc);
    else if (a->bits == 6) wide_tile(a, wide, gd, gm, r0, rows, 6, 32, 0, 1, acc);
    else if (a->bits == 5 && a->has_off) wide_tile(a, wide, gd, gm, r0, rows, 5, 0, 1, 0, acc);
    else if (a->bits == 5) wide_tile(a, wide, gd, gm, r0, rows, 5, 16, 0, 0, acc);
    else if (a->two_scales) wide_tile(a, wide, gd, gm, r0, rows, 8, 0, 0, 1, acc);
    else if (a->has_off) wide_tile(a, wide, gd, gm, r0, rows, 8, 0, 1, 0, acc);
    else wide_tile(a, wide, gd, gm, r0, rows, 8, 0, 0, 0, acc);
}

static void qmm2_groups_wide(const qmm2_args *a, int64_t begin, int64_t end, uint8_t *wide) {
    int64_t nb = a->nb;
    for (int64_t g = begin; g < end; g++) {
        expand_group(a->bits, a->table, a->qs + g * nb * qbytes_of(a->bits), nb, wide);
        const void *gd, *gm;
        group_scales(a, g, &gd, &gm);
        int64_t n0 = g * CG;
        for (int64_t r0 = 0; r0 < a->M; r0 += WIDE_ROWS) {
            int rows = (int)(a->M - r0 < WIDE_ROWS ? a->M - r0 : WIDE_ROWS);
            __m256 acc[WIDE_ROWS][2];
            switch (rows) {  // constant row counts keep the sums in registers
                case WIDE_ROWS: wide_rows(a, wide, gd, gm, r0, WIDE_ROWS, acc); break;
#if WIDE_ROWS > 2
                case 2: wide_rows(a, wide, gd, gm, r0, 2, acc); break;
#endif
                default: wide_rows(a, wide, gd, gm, r0, 1, acc); break;
            }
            for (int i = 0; i < rows; i++)
                for (int h = 0; h < 2 && n0 + 8 * h < a->N; h++) store_half(a, r0 + i, n0, h, acc[i][h]);
        }
    }
}

// 2-bit (Q2_K: w = d * sc * q - dmin * m per 16 weights, q in 0..3): a (group, block) is 128 bytes, byte i at
// 64p + 32h the byte i at 64c + 32h of the 4-bit layout for chunk c = 2p (bits 0-1 and 4-5) and c = 2p + 1
// (bits 2-3 and 6-7), so chunk_q4's shuffle follows a shift and a mask of two bits.
static inline __attribute__((always_inline)) void chunk_q2(const uint8_t *blk, int c, int h, __m256i *lo,
                                                            __m256i *hi) {
    const __m256i low2 = _mm256_set1_epi8(0x03);
    const __m256i gather = _mm256_setr_epi8(0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15,
                                            0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15);
    __m256i v = _mm256_loadu_si256((const __m256i *)(blk + 64 * (c / 2) + 32 * h));
    if (c % 2) v = _mm256_srli_epi16(v, 2);
    *lo = _mm256_shuffle_epi8(_mm256_and_si256(v, low2), gather);
    *hi = _mm256_shuffle_epi8(_mm256_and_si256(_mm256_srli_epi16(v, 4), low2), gather);
}

// The scales and offsets stay as the file has them: d holds fp16 (d, -dmin) of each column's super-block
// ([nb / 8][2][CG] per group), m the bytes sc | m << 4 of its sub-blocks ([nb][2][CG]). d * sc and -dmin * m
// are products of an fp16 and a 4-bit integer, exact in fp32: the values an fp32 copy would hold. Each half
// block (16 k) enters acc with its own pair: acc + float(sum(q xq)) * (d * sc * dx), then + (-dmin * m) * (dx *
// float(sum(xq))). q <= 3: a chunk's lo + hi pair is at most 762 (int16), widened at once.
#if EXL_QMM_HALF_SCALES  // the fp16 (d, -dmin) need F16C; exl_qmatmul refuses bits 2 without it
static inline __attribute__((always_inline)) void group_half_q2(const qmm2_args *a, const uint8_t *gq,
                                                                 const void *gd, const void *gm, int64_t r0,
                                                                 int rows, int h, __m256 acc[RT]) {
    const __m256i low4 = _mm256_set1_epi32(0x0f);
    for (int r = 0; r < rows; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < a->nb; b++) {
        const uint8_t *blk = gq + b * 128;
        const int8_t *xb = a->xq + r0 * a->K + b * BLOCK;
        if (h == 0 && r0 == 0) prefetch_ahead(blk, 128);
        const uint16_t *f = (const uint16_t *)gd + (b / 8) * 2 * CG + 8 * h;
        const __m256 dsup = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)f));
        const __m256 msup = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(f + CG)));
        const uint8_t *sm = (const uint8_t *)gm + b * 2 * CG + 8 * h;
        __m256i s[RT];
#pragma GCC unroll 4
        for (int c = 0; c < 4; c++) {
            __m256i lo, hi;
            chunk_q2(blk, c, h, &lo, &hi);
            for (int r = 0; r < rows; r++) {
                const int8_t *x = xb + r * a->K + 8 * c;
                __m256i wide = pair_dot(lo, bcast4(x), hi, bcast4(x + 4));
                s[r] = c % 2 == 0 ? wide : _mm256_add_epi32(s[r], wide);
            }
            if (c % 2 == 1) {
                int j = c / 2;
                __m256i packed = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(sm + j * CG)));
                __m256 d = _mm256_mul_ps(dsup, _mm256_cvtepi32_ps(_mm256_and_si256(packed, low4)));
                __m256 mv = _mm256_mul_ps(msup, _mm256_cvtepi32_ps(_mm256_srli_epi32(packed, 4)));
                for (int r = 0; r < rows; r++) {
                    int64_t i = (r0 + r) * a->nb + b;
                    acc[r] = add_scaled(acc[r], s[r], d, a->dx[i]);
                    __m256 xs = _mm256_set1_ps(a->dx[i] * (float)a->xsum16[2 * i + j]);
                    acc[r] = _mm256_add_ps(acc[r], _mm256_mul_ps(mv, xs));
                }
            }
        }
    }
}
#endif

static inline __attribute__((always_inline)) void group_half(const qmm2_args *a, const uint8_t *gq, const void *gd,
                                                              const void *gm, int64_t r0, int rows, int h,
                                                              __m256 acc[RT]) {
#if EXL_QMM_HALF_SCALES
    if (a->bits == 2) group_half_q2(a, gq, gd, gm, r0, rows, h, acc);
    else
#endif
    if (a->table) group_half_q4t(a, gq, gd, r0, rows, h, acc);
    else if (a->bits == 4) group_half_q4(a, gq, gd, gm, r0, rows, h, acc);
    else if (a->bits == 5) group_half_q5(a, gq, gd, gm, r0, rows, h, acc);
    else if (a->bits == 6) group_half_q6(a, gq, gd, r0, rows, h, acc);
    else group_half_q8(a, gq, gd, gm, r0, rows, h, acc);
}

// The column groups begin .. end - 1 of one product on the AVX2 tiles: from WIDE_MIN_ROWS rows each group
// expanded once (qmm2_groups_wide), below (or without memory for the expansion) the 4-row tiles.
static void qmm2_groups256(const qmm2_args *a, int64_t begin, int64_t end) {
    if (a->M >= WIDE_MIN_ROWS && a->bits != 2) {  // (2-bit: no wide layout; its tiles below)
        uint8_t *wide = (uint8_t *)malloc((size_t)(a->nb * wide_bytes(a->table ? 8 : a->bits)));
        if (wide) {  // else the tiles below: the same bits
            qmm2_groups_wide(a, begin, end, wide);
            free(wide);
            return;
        }
    }
    int64_t nb = a->nb, qbytes = qbytes_of(a->bits);
    for (int64_t g = begin; g < end; g++) {
        const uint8_t *gq = a->qs + g * nb * qbytes;  // the group's weights: 4.5 to 24 KB, L1/L2 across tiles
        const void *gd, *gm;
        group_scales(a, g, &gd, &gm);
        int64_t n0 = g * CG;
        for (int h = 0; h < 2; h++) {
            if (n0 + 8 * h >= a->N) break;
            for (int64_t r0 = 0; r0 < a->M; r0 += RT) {
                int rows = (int)(a->M - r0 < RT ? a->M - r0 : RT);
                __m256 acc[RT];
                switch (rows) {  // constant row counts let the compiler keep the sums in registers
                    case 4: group_half(a, gq, gd, gm, r0, 4, h, acc); break;
                    case 3: group_half(a, gq, gd, gm, r0, 3, h, acc); break;
                    case 2: group_half(a, gq, gd, gm, r0, 2, h, acc); break;
                    default: group_half(a, gq, gd, gm, r0, 1, h, acc); break;
                }
                for (int i = 0; i < rows; i++) store_half(a, r0 + i, n0, h, acc[i]);
            }
        }
    }
}
