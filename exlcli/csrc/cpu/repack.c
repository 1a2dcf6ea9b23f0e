// qmatmul's weight layout built from GGUF blocks at load, on the kernel pool's threads.
//
// A model file is read through a memory map and each linear's rows go straight from the file's blocks to
// the groups of 16 output columns that qmatmul.c streams (its layout is written in
// exlcli/ops/formats/cpu_qmatmul.py, whose QuantCpuLinear builds the same bytes with torch ops from a
// format's unpack(): the oracle of the tests). Per (group, block of 32 weights) the 16 rows' blocks are
// decoded into q values, scales and offsets the way the format modules' unpack() computes them (the same
// fp32 products, so the same bits), then written in the layout of `bits`. Groups are independent, so the
// pool's threads share them and the result is the same with any number of threads.
// With SSSE3 the common pairings (4 bits from Q4_x, 5/6 bits from Q5_x/Q6_K, 8 bits from Q8_0/Q5_x/Q6_K) take
// a vector path that places 16 columns' bytes with shuffles and transposes instead of weight by weight; the
// scalar loop below stays the definition of each layout and builds the rest.

#include <stdatomic.h>
#include <stdint.h>
#include <string.h>
#ifdef __SSSE3__
#include <immintrin.h>
#endif

#include "args.h"
#include "bf16.h"
#include "pool.h"

#define CG 16  // output columns per group, as in qmatmul.c
#define BLOCK 32

enum { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };

int exl_repack_available(void) { return 1; }

// fp16 bits -> fp32, exact (a NaN keeps its payload, made quiet, as the CPU's conversion does).
static float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, bits;
    float f;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (man << 13) | (man ? 0x400000u : 0);
    } else if (exp) {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    } else {
        f = (float)man * 0x1p-24f;  // zero or a subnormal: exact in fp32
        memcpy(&bits, &f, 4);
        bits |= sign;
    }
    memcpy(&f, &bits, 4);
    return f;
}

static float half_at(const uint8_t *p) { return half_to_float((uint16_t)(p[0] | (p[1] << 8))); }

static int exact_in_half(float x) { return (float)(_Float16)x == x; }

// One block of 32 weights as the format's unpack() gives it: q[32], its scale (two for Q6_K, one per 16)
// and offset, w = q * scale + offset.
typedef struct {
    int32_t q[BLOCK];
    float scale[2];
    float offset;
} decoded;

// Q4_K and Q5_K's 6-bit scale and min of sub-block s (kquant_scales.py's unpack_scale_min_k4).
static void scale_min_k4(const uint8_t *p, int s, int *sc, int *m) {
    if (s < 4) {
        *sc = p[s] & 63;
        *m = p[s + 4] & 63;
    } else {
        *sc = (p[s + 4] & 15) | ((p[s - 4] >> 6) << 4);
        *m = (p[s + 4] >> 4) | ((p[s] >> 6) << 4);
    }
}

static void low_high_nibbles(const uint8_t *qs, int32_t *q) {
    for (int j = 0; j < 16; j++) {
        q[j] = qs[j] & 15;
        q[j + 16] = qs[j] >> 4;
    }
}

static void five_bits(const uint8_t *qh, const uint8_t *qs, int32_t *q) {
    low_high_nibbles(qs, q);
    uint32_t high = (uint32_t)qh[0] | ((uint32_t)qh[1] << 8) | ((uint32_t)qh[2] << 16) | ((uint32_t)qh[3] << 24);
    for (int j = 0; j < BLOCK; j++) q[j] |= (int32_t)((high >> j) & 1) << 4;
}

// Block b (of 32 weights) of a row; 0, or -1 for a format this file does not decode. Inlined where `format`
// is a constant, so that the switch folds away in each format's own copy of the repack loop.
static inline __attribute__((always_inline)) int decode(int format, const uint8_t *row, int64_t b, decoded *out) {
    const uint8_t *p;
    int s = (int)(b % 8), sc, mn;
    out->scale[1] = 0.0f;
    out->offset = 0.0f;
    switch (format) {
    case Q4_0:
        p = row + b * 18;
        out->scale[0] = half_at(p);
        out->offset = -8.0f * out->scale[0];
        low_high_nibbles(p + 2, out->q);
        return 0;
    case Q4_1:
        p = row + b * 20;
        out->scale[0] = half_at(p);
        out->offset = half_at(p + 2);
        low_high_nibbles(p + 4, out->q);
        return 0;
    case Q5_0:
        p = row + b * 22;
        out->scale[0] = half_at(p);
        five_bits(p + 2, p + 6, out->q);
        for (int j = 0; j < BLOCK; j++) out->q[j] -= 16;
        return 0;
    case Q5_1:
        p = row + b * 24;
        out->scale[0] = half_at(p);
        out->offset = half_at(p + 2);
        five_bits(p + 4, p + 8, out->q);
        return 0;
    case Q8_0:
        p = row + b * 34;
        out->scale[0] = half_at(p);
        for (int j = 0; j < BLOCK; j++) out->q[j] = (int8_t)p[2 + j];
        return 0;
    case Q4_K:
    case Q5_K: {
        p = row + (b / 8) * (format == Q4_K ? 144 : 176);
        scale_min_k4(p + 4, s, &sc, &mn);
        out->scale[0] = half_at(p) * (float)sc;
        out->offset = -(half_at(p + 2) * (float)mn);
        const uint8_t *qs = p + (format == Q4_K ? 16 : 48) + 32 * (s / 2);
        for (int i = 0; i < BLOCK; i++) out->q[i] = (qs[i] >> (4 * (s & 1))) & 15;
        if (format == Q5_K)
            for (int i = 0; i < BLOCK; i++) out->q[i] |= ((p[16 + i] >> s) & 1) << 4;
        return 0;
    }
    case Q6_K: {
        p = row + (b / 8) * 210;
        float d = half_at(p + 208);
        out->scale[0] = d * (float)(int8_t)p[192 + 2 * s];
        out->scale[1] = d * (float)(int8_t)p[192 + 2 * s + 1];
        // weight 32s + i of the 256: half h = s / 4; its low four bits in byte 64h + 32(s % 2) + i of ql, shifted
        // by 4((s % 4) / 2), its high two in byte 32h + i of qh, shifted by 2(s % 4)
        const uint8_t *ql = p + 64 * (s / 4) + 32 * (s % 2), *qh = p + 128 + 32 * (s / 4);
        const int low_shift = 4 * ((s % 4) / 2), high_shift = 2 * (s % 4);
        for (int i = 0; i < BLOCK; i++)
            out->q[i] = (((ql[i] >> low_shift) & 15) | (((qh[i] >> high_shift) & 3) << 4)) - 32;
        return 0;
    }
    default:
        return -1;
    }
}

// Where each byte of a (group, block) of the 5- and 6-bit layouts takes its weights from (column * 32 + k):
// see _q5_sources and _q6_plane_sources in cpu_qmatmul.py.
typedef struct {
    int16_t lo5[256];        // the low nibble of byte j (the high one: lo5[j] + 4)
    int16_t plane5[64][8];   // bits 5: bit t of plane byte j holds the high bit of weight plane5[j][t]
    int16_t plane6[128][4];  // bits 6: bits 2u, 2u + 1 of plane byte j the high two of weight plane6[j][u]
} sources;

static void make_sources(sources *t) {
    for (int c = 0; c < 4; c++)
        for (int h = 0; h < 2; h++)
            for (int i = 0; i < 32; i++) t->lo5[64 * c + 32 * h + i] = (int16_t)((8 * h + i / 4) * BLOCK + 8 * c + i % 4);
    // plane h's byte i: bit 2c + j from chunk c's low (j = 0) or high (j = 1) nibble at byte 64c + 32h + i
    for (int h = 0; h < 2; h++)
        for (int i = 0; i < 32; i++)
            for (int c = 0; c < 4; c++)
                for (int j = 0; j < 2; j++) t->plane5[32 * h + i][2 * c + j] = (int16_t)(t->lo5[64 * c + 32 * h + i] + 4 * j);
    // plane (h, v)'s byte i: bits 2u, 2u + 1 from (c, j) = (2v + u / 2, u % 2)
    for (int h = 0; h < 2; h++)
        for (int pv = 0; pv < 2; pv++)
            for (int i = 0; i < 32; i++)
                for (int u = 0; u < 4; u++)
                    t->plane6[64 * h + 32 * pv + i][u] = t->plane5[32 * h + i][2 * (2 * pv + u / 2) + u % 2];
}

static int64_t layout_bytes(int bits) { return bits == 8 ? 512 : bits == 4 ? 256 : 256 + 64 * (bits - 4); }

// The 5- or 6-bit layout's bytes of one (group, block) from its 16 columns' held q (q + zero), v[column * 32 + k].
static void write_block(const sources *t, int bits, const uint8_t *v, uint8_t *out) {
    for (int j = 0; j < 256; j++) out[j] = (uint8_t)((v[t->lo5[j]] & 15) | ((v[t->lo5[j] + 4] & 15) << 4));
    uint8_t *plane = out + 256;
    if (bits == 5) {
        for (int j = 0; j < 64; j++) {
            int byte = 0;
            for (int bit = 0; bit < 8; bit++) byte |= (v[t->plane5[j][bit]] >> 4) << bit;
            plane[j] = (uint8_t)byte;
        }
    } else {
        for (int j = 0; j < 128; j++) {
            int byte = 0;
            for (int u = 0; u < 4; u++) byte |= (v[t->plane6[j][u]] >> 4) << (2 * u);
            plane[j] = (uint8_t)byte;
        }
    }
}

// Column c's 32 held values of a (group, block): bits 4 and 8 straight into the layout (out), the weights of
// one column landing in bytes of their own; bits 5 and 6 into v[c * 32 + k] for write_block.
//   bits 4: byte 64i + 16(c / 4) + 8u + 2(c % 4) + e holds k = 8i + 2u + e (low nibble) and k + 4 (high), which
//           is q4_byte_sources() turned around: vector i, pair 4i + u (low) and 4i + u + 2 (high), slot 2c + e
//   bits 8: byte 32p + 2c + e holds k = 2p + e
static void place_column(int bits, int c, const int32_t *q, int zero, uint8_t *v, uint8_t *out) {
    if (bits == 4) {
        for (int i = 0; i < 4; i++)
            for (int u = 0; u < 2; u++)
                for (int e = 0; e < 2; e++) {
                    int k = 8 * i + 2 * u + e;
                    out[64 * i + 16 * (c / 4) + 8 * u + 2 * (c % 4) + e] = (uint8_t)(q[k] | (q[k + 4] << 4));
                }
    } else if (bits == 8) {
        for (int p = 0; p < 16; p++) {
            out[32 * p + 2 * c] = (uint8_t)(q[2 * p] + zero);
            out[32 * p + 2 * c + 1] = (uint8_t)(q[2 * p + 1] + zero);
        }
    } else {
        for (int k = 0; k < BLOCK; k++) v[BLOCK * c + k] = (uint8_t)(q[k] + zero);
    }
}

typedef struct {
    const exl_repack_args *a;
    sources t;
    int64_t nb;
    atomic_int any_offset, not_half, failed;
} repack_job;

// Column c's scales (one, or two for Q6_K) and offset into the (group, block)'s d and m, noting whether any
// offset is non-zero and whether any of them is not exact in fp16 (the flags exl_repack returns).
static inline __attribute__((always_inline)) void put_scales(float *d, float *m, int c, int spb, const float *scale,
                                                             float offset, int *any_offset, int *not_half) {
    for (int k = 0; k < spb; k++) {
        d[k * CG + c] = scale[k];
        *not_half |= !exact_in_half(scale[k]);
    }
    m[c] = offset;
    *any_offset |= offset != 0.0f;
    *not_half |= !exact_in_half(offset);
}

// The generic loop, one copy per (format, bits) so that decode() and place_column() fold their switches.
static inline __attribute__((always_inline)) void repack_groups_of(repack_job *job, int64_t begin, int64_t end,
                                                                   const int format, const int bits) {
    const exl_repack_args *a = job->a;
    const int64_t nb = job->nb, bytes = layout_bytes(bits);
    const int spb = a->scales_per_block;
    int any_offset = 0, not_half = 0;
    uint8_t v[CG * BLOCK];
    decoded blk;
    for (int64_t g = begin; g < end; g++) {
        for (int64_t b = 0; b < nb; b++) {
            float *d = a->d + (g * nb + b) * spb * CG, *m = a->m + (g * nb + b) * CG;
            for (int c = 0; c < CG; c++) {
                int64_t r = g * CG + c;
                if (r < a->rows) {
                    if (decode(format, a->src + r * a->row_bytes, b, &blk) != 0) {
                        atomic_store(&job->failed, 1);
                        return;
                    }
                } else {  // padding rows: q = 0, no scale or offset
                    memset(&blk, 0, sizeof blk);
                }
                place_column(bits, c, blk.q, a->zero, v, a->qs + (g * nb + b) * bytes);
                put_scales(d, m, c, spb, blk.scale, blk.offset, &any_offset, &not_half);
            }
            if (bits == 5 || bits == 6) write_block(&job->t, bits, v, a->qs + (g * nb + b) * bytes);
        }
    }
    if (any_offset) atomic_store(&job->any_offset, 1);
    if (not_half) atomic_store(&job->not_half, 1);
}

#ifdef __SSSE3__
// One block's 32 nibbles of a 4-bit format's row as two vectors, weights 0-15 and 16-31 (one per byte),
// with the block's scale and offset (as decode() computes them).
static inline __attribute__((always_inline)) void nibbles4(const int format, const uint8_t *row, int64_t b,
                                                           __m128i *lo, __m128i *hi, float *scale, float *offset) {
    const __m128i low4 = _mm_set1_epi8(15);
    if (format == Q4_K) {
        const uint8_t *p = row + (b / 8) * 144;
        int s = (int)(b % 8), sc, mn;
        scale_min_k4(p + 4, s, &sc, &mn);
        *scale = half_at(p) * (float)sc;
        *offset = -(half_at(p + 2) * (float)mn);
        const uint8_t *qs = p + 16 + 32 * (s / 2);
        const __m128i shift = _mm_cvtsi32_si128(4 * (s & 1));
        *lo = _mm_and_si128(_mm_srl_epi16(_mm_loadu_si128((const __m128i *)qs), shift), low4);
        *hi = _mm_and_si128(_mm_srl_epi16(_mm_loadu_si128((const __m128i *)(qs + 16)), shift), low4);
    } else {  // Q4_0, Q4_1: weight j in the low nibble of byte j, weight j + 16 in its high one
        const uint8_t *p = row + b * (format == Q4_0 ? 18 : 20);
        *scale = half_at(p);
        *offset = format == Q4_0 ? -8.0f * *scale : half_at(p + 2);
        const __m128i q = _mm_loadu_si128((const __m128i *)(p + (format == Q4_0 ? 2 : 4)));
        *lo = _mm_and_si128(q, low4);
        *hi = _mm_and_si128(_mm_srli_epi16(q, 4), low4);
    }
}

// The 4-bit layout from Q4_0, Q4_1 and Q4_K, four columns at a time: column c's byte for k = 8i + 2u + e
// (q[k] | q[k + 4] << 4) sits at 64i + 16(c / 4) + 8u + 2(c % 4) + e (place_column's bits == 4).
// Per column, t = [pairs of weights 0-7 | 8-15 | 16-23 | 24-31] packs that byte for each k (its 16-bit word
// 2i + u holds e = 0, 1); four columns' words interleave into the layout's 16-byte rows.
static inline __attribute__((always_inline)) void repack4_groups_of(repack_job *job, int64_t begin, int64_t end,
                                                                    const int format) {
    const exl_repack_args *a = job->a;
    const int64_t nb = job->nb;
    int any_offset = 0, not_half = 0;
    for (int64_t g = begin; g < end; g++) {
        for (int64_t b = 0; b < nb; b++) {
            float *d = a->d + (g * nb + b) * CG, *m = a->m + (g * nb + b) * CG;
            uint8_t *out = a->qs + (g * nb + b) * 256;
            __m128i t[CG];
            for (int c = 0; c < CG; c++) {
                int64_t r = g * CG + c;
                __m128i lo = _mm_setzero_si128(), hi = _mm_setzero_si128();
                float scale = 0.0f, offset = 0.0f;
                if (r < a->rows) nibbles4(format, a->src + r * a->row_bytes, b, &lo, &hi, &scale, &offset);
                // bytes 0-3 and 8-11 of lo | (bytes 4-7 and 12-15) << 4, likewise hi: 32-bit lanes 0 and 2
                __m128i plo = _mm_or_si128(lo, _mm_slli_epi16(_mm_srli_si128(lo, 4), 4));
                __m128i phi = _mm_or_si128(hi, _mm_slli_epi16(_mm_srli_si128(hi, 4), 4));
                t[c] = _mm_castps_si128(_mm_shuffle_ps(_mm_castsi128_ps(plo), _mm_castsi128_ps(phi),
                                                       _MM_SHUFFLE(2, 0, 2, 0)));
                put_scales(d, m, c, 1, &scale, offset, &any_offset, &not_half);
            }
            for (int quad = 0; quad < 4; quad++) {
                const __m128i *q4 = t + 4 * quad;
                __m128i x01 = _mm_unpacklo_epi16(q4[0], q4[1]), x23 = _mm_unpacklo_epi16(q4[2], q4[3]);
                __m128i y01 = _mm_unpackhi_epi16(q4[0], q4[1]), y23 = _mm_unpackhi_epi16(q4[2], q4[3]);
                _mm_storeu_si128((__m128i *)(out + 0 + 16 * quad), _mm_unpacklo_epi32(x01, x23));
                _mm_storeu_si128((__m128i *)(out + 64 + 16 * quad), _mm_unpackhi_epi32(x01, x23));
                _mm_storeu_si128((__m128i *)(out + 128 + 16 * quad), _mm_unpacklo_epi32(y01, y23));
                _mm_storeu_si128((__m128i *)(out + 192 + 16 * quad), _mm_unpackhi_epi32(y01, y23));
            }
        }
    }
    if (any_offset) atomic_store(&job->any_offset, 1);
    if (not_half) atomic_store(&job->not_half, 1);
}

// A 32-bit mask's bits 0-15 (lo) and 16-31 (hi) as bytes of 0 or 1.
static inline __attribute__((always_inline)) void bits_to_bytes(uint32_t bits, __m128i *lo, __m128i *hi) {
    const __m128i x = _mm_set1_epi32((int)bits);
    const __m128i select = _mm_set1_epi64x((long long)0x8040201008040201ULL), one = _mm_set1_epi8(1);
    const __m128i b01 = _mm_shuffle_epi8(x, _mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1));
    const __m128i b23 = _mm_shuffle_epi8(x, _mm_setr_epi8(2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
    *lo = _mm_and_si128(_mm_cmpeq_epi8(_mm_and_si128(b01, select), select), one);
    *hi = _mm_and_si128(_mm_cmpeq_epi8(_mm_and_si128(b23, select), select), one);
}

// One block's 32 held values (q + zero) of a 5- or 6-bit format, split as the layout stores them: low
// nibbles l[0] (weights 0-15) and l[1] (16-31), high bits (value >> 4) h[0], h[1]; with its scales and offset
// (as decode() computes them).
static inline __attribute__((always_inline)) void values56(const int format, const uint8_t *row, int64_t b,
                                                           __m128i l[2], __m128i h[2], float scale[2],
                                                           float *offset) {
    const __m128i low4 = _mm_set1_epi8(15);
    const int s = (int)(b % 8);
    const uint8_t *p;
    scale[1] = 0.0f;
    *offset = 0.0f;
    if (format == Q6_K) {
        p = row + (b / 8) * 210;
        float d = half_at(p + 208);
        scale[0] = d * (float)(int8_t)p[192 + 2 * s];
        scale[1] = d * (float)(int8_t)p[192 + 2 * s + 1];
        const uint8_t *ql = p + 64 * (s / 4) + 32 * (s % 2), *qh = p + 128 + 32 * (s / 4);
        const __m128i low_shift = _mm_cvtsi32_si128(4 * ((s % 4) / 2)), high_shift = _mm_cvtsi32_si128(2 * (s % 4));
        const __m128i two = _mm_set1_epi8(3);
        for (int half = 0; half < 2; half++) {
            l[half] = _mm_and_si128(_mm_srl_epi16(_mm_loadu_si128((const __m128i *)(ql + 16 * half)), low_shift), low4);
            h[half] = _mm_and_si128(_mm_srl_epi16(_mm_loadu_si128((const __m128i *)(qh + 16 * half)), high_shift), two);
        }
    } else if (format == Q5_K) {
        int sc, mn;
        p = row + (b / 8) * 176;
        scale_min_k4(p + 4, s, &sc, &mn);
        scale[0] = half_at(p) * (float)sc;
        *offset = -(half_at(p + 2) * (float)mn);
        const uint8_t *qs = p + 48 + 32 * (s / 2);
        const __m128i nibble_shift = _mm_cvtsi32_si128(4 * (s & 1)), bit_shift = _mm_cvtsi32_si128(s);
        const __m128i one = _mm_set1_epi8(1);
        for (int half = 0; half < 2; half++) {
            l[half] = _mm_and_si128(_mm_srl_epi16(_mm_loadu_si128((const __m128i *)(qs + 16 * half)), nibble_shift), low4);
            h[half] = _mm_and_si128(_mm_srl_epi16(_mm_loadu_si128((const __m128i *)(p + 16 + 16 * half)), bit_shift), one);
        }
    } else {  // Q5_0, Q5_1: weight j in the low nibble of byte j, j + 16 in its high one; high bit j of qh
        p = row + b * (format == Q5_0 ? 22 : 24);
        scale[0] = half_at(p);
        if (format == Q5_1) *offset = half_at(p + 2);
        const uint8_t *qh = p + (format == Q5_0 ? 2 : 4);
        const __m128i q = _mm_loadu_si128((const __m128i *)(qh + 4));
        l[0] = _mm_and_si128(q, low4);
        l[1] = _mm_and_si128(_mm_srli_epi16(q, 4), low4);
        bits_to_bytes((uint32_t)qh[0] | ((uint32_t)qh[1] << 8) | ((uint32_t)qh[2] << 16) | ((uint32_t)qh[3] << 24),
                      &h[0], &h[1]);
    }
}

// Bytes 0-3 of x | (x >> 4 bytes) << w | (x >> 8 bytes) << 2w | (x >> 12 bytes) << 3w: four values of a
// 16-byte vector packed per byte, w bits apart (each value below 2^w).
static inline __attribute__((always_inline)) __m128i pack_fours(__m128i x, int w) {
    __m128i y = _mm_or_si128(x, _mm_sll_epi16(_mm_srli_si128(x, 4), _mm_cvtsi32_si128(w)));
    y = _mm_or_si128(y, _mm_sll_epi16(_mm_srli_si128(x, 8), _mm_cvtsi32_si128(2 * w)));
    return _mm_or_si128(y, _mm_sll_epi16(_mm_srli_si128(x, 12), _mm_cvtsi32_si128(3 * w)));
}

// The 32-bit lanes 0 of four vectors, side by side.
static inline __attribute__((always_inline)) __m128i lanes0(__m128i a, __m128i b, __m128i c, __m128i d) {
    return _mm_unpacklo_epi64(_mm_unpacklo_epi32(a, b), _mm_unpacklo_epi32(c, d));
}

// The 5- and 6-bit layouts (write_block's, from make_sources' tables), a (group, block) at a time:
//   nibbles: byte 64i + 4c + t holds column c's weight k = 8i + t (low nibble) and k + 4 (high)
//   bits 5: plane byte 4c + t holds bit m of weight 4m + t's high bit (m = 0..7)
//   bits 6: plane byte 64(c / 8) + 32v + 4(c % 8) + t holds in bits 2u, 2u + 1 the high two of weight
//           16v + 4u + t
static inline __attribute__((always_inline)) void repack56_groups_of(repack_job *job, int64_t begin, int64_t end,
                                                                     const int format, const int bits) {
    const exl_repack_args *a = job->a;
    const int64_t nb = job->nb, bytes = layout_bytes(bits);
    const int spb = a->scales_per_block;
    int any_offset = 0, not_half = 0;
    for (int64_t g = begin; g < end; g++) {
        for (int64_t b = 0; b < nb; b++) {
            float *d = a->d + (g * nb + b) * spb * CG, *m = a->m + (g * nb + b) * CG;
            uint8_t *out = a->qs + (g * nb + b) * bytes, *plane = out + 256;
            __m128i nib[CG], planes[2][CG];
            for (int c = 0; c < CG; c++) {
                int64_t r = g * CG + c;
                // padding rows hold q = 0, so the value `zero`
                __m128i l[2] = {_mm_set1_epi8((char)(a->zero & 15)), _mm_set1_epi8((char)(a->zero & 15))};
                __m128i h[2] = {_mm_set1_epi8((char)(a->zero >> 4)), _mm_set1_epi8((char)(a->zero >> 4))};
                float scale[2] = {0.0f, 0.0f}, offset = 0.0f;
                if (r < a->rows) values56(format, a->src + r * a->row_bytes, b, l, h, scale, &offset);
                __m128i plo = _mm_or_si128(l[0], _mm_slli_epi16(_mm_srli_si128(l[0], 4), 4));
                __m128i phi = _mm_or_si128(l[1], _mm_slli_epi16(_mm_srli_si128(l[1], 4), 4));
                nib[c] = _mm_castps_si128(_mm_shuffle_ps(_mm_castsi128_ps(plo), _mm_castsi128_ps(phi),
                                                         _MM_SHUFFLE(2, 0, 2, 0)));
                if (bits == 5) {
                    planes[0][c] = _mm_or_si128(pack_fours(h[0], 1), _mm_slli_epi16(pack_fours(h[1], 1), 4));
                } else {
                    planes[0][c] = pack_fours(h[0], 2);
                    planes[1][c] = pack_fours(h[1], 2);
                }
                put_scales(d, m, c, spb, scale, offset, &any_offset, &not_half);
            }
            for (int quad = 0; quad < 4; quad++) {
                __m128 r0 = _mm_castsi128_ps(nib[4 * quad]), r1 = _mm_castsi128_ps(nib[4 * quad + 1]);
                __m128 r2 = _mm_castsi128_ps(nib[4 * quad + 2]), r3 = _mm_castsi128_ps(nib[4 * quad + 3]);
                _MM_TRANSPOSE4_PS(r0, r1, r2, r3);
                _mm_storeu_si128((__m128i *)(out + 16 * quad), _mm_castps_si128(r0));
                _mm_storeu_si128((__m128i *)(out + 64 + 16 * quad), _mm_castps_si128(r1));
                _mm_storeu_si128((__m128i *)(out + 128 + 16 * quad), _mm_castps_si128(r2));
                _mm_storeu_si128((__m128i *)(out + 192 + 16 * quad), _mm_castps_si128(r3));
                const __m128i *p0 = planes[0] + 4 * quad, *p1 = planes[1] + 4 * quad;
                if (bits == 5) {
                    _mm_storeu_si128((__m128i *)(plane + 16 * quad), lanes0(p0[0], p0[1], p0[2], p0[3]));
                } else {
                    uint8_t *at = plane + 64 * (quad / 2) + 16 * (quad % 2);
                    _mm_storeu_si128((__m128i *)at, lanes0(p0[0], p0[1], p0[2], p0[3]));
                    _mm_storeu_si128((__m128i *)(at + 32), lanes0(p1[0], p1[1], p1[2], p1[3]));
                }
            }
        }
    }
    if (any_offset) atomic_store(&job->any_offset, 1);
    if (not_half) atomic_store(&job->not_half, 1);
}

// Eight vectors of eight 16-bit words, transposed in place: word j of r[i] <-> word i of r[j].
static inline __attribute__((always_inline)) void transpose8x16(__m128i r[8]) {
    __m128i a[8], b[8];
    for (int i = 0; i < 4; i++) {
        a[2 * i] = _mm_unpacklo_epi16(r[2 * i], r[2 * i + 1]);
        a[2 * i + 1] = _mm_unpackhi_epi16(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 2; i++)
        for (int h = 0; h < 2; h++) {
            b[4 * i + 2 * h] = _mm_unpacklo_epi32(a[4 * i + h], a[4 * i + 2 + h]);
            b[4 * i + 2 * h + 1] = _mm_unpackhi_epi32(a[4 * i + h], a[4 * i + 2 + h]);
        }
    for (int i = 0; i < 4; i++) {
        r[2 * i] = _mm_unpacklo_epi64(b[i], b[4 + i]);
        r[2 * i + 1] = _mm_unpackhi_epi64(b[i], b[4 + i]);
    }
}

// The 8-bit layout (place_column's bits == 8: byte 32p + 2c + e holds column c's weight 2p + e as q + zero),
// a (group, block) at a time: each column's 32 bytes are 16 words, and the block is their 16 x 16 transpose.
static inline __attribute__((always_inline)) void repack8_groups_of(repack_job *job, int64_t begin, int64_t end,
                                                                    const int format) {
    const exl_repack_args *a = job->a;
    const int64_t nb = job->nb;
    const int spb = a->scales_per_block;
    // the stored q of the 5- and 6-bit formats is their value less this (decode()'s q)
    const int bias = format == Q6_K ? 32 : format == Q5_0 ? 16 : 0;
    const __m128i shift = _mm_set1_epi8((char)(a->zero - bias));
    int any_offset = 0, not_half = 0;
    for (int64_t g = begin; g < end; g++) {
        for (int64_t b = 0; b < nb; b++) {
            float *d = a->d + (g * nb + b) * spb * CG, *m = a->m + (g * nb + b) * CG;
            uint8_t *out = a->qs + (g * nb + b) * 512;
            __m128i lo[CG], hi[CG];  // column c's weights 0-15 and 16-31, a byte each
            for (int c = 0; c < CG; c++) {
                int64_t r = g * CG + c;
                float scale[2] = {0.0f, 0.0f}, offset = 0.0f;
                if (r >= a->rows) {  // padding rows: q = 0
                    lo[c] = hi[c] = _mm_set1_epi8((char)a->zero);
                } else if (format == Q8_0) {
                    const uint8_t *p = a->src + r * a->row_bytes + b * 34;
                    scale[0] = half_at(p);
                    lo[c] = _mm_add_epi8(_mm_loadu_si128((const __m128i *)(p + 2)), shift);
                    hi[c] = _mm_add_epi8(_mm_loadu_si128((const __m128i *)(p + 18)), shift);
                } else {
                    __m128i l[2], h[2];
                    values56(format, a->src + r * a->row_bytes, b, l, h, scale, &offset);
                    lo[c] = _mm_add_epi8(_mm_or_si128(l[0], _mm_slli_epi16(h[0], 4)), shift);
                    hi[c] = _mm_add_epi8(_mm_or_si128(l[1], _mm_slli_epi16(h[1], 4)), shift);
                }
                put_scales(d, m, c, spb, scale, offset, &any_offset, &not_half);
            }
            // words p of columns 0-7 and 8-15: out + 32p and + 32p + 16, p = 0-7 from lo, 8-15 from hi
            for (int half = 0; half < 2; half++)
                for (int cols = 0; cols < 2; cols++) {
                    __m128i t[8];
                    for (int i = 0; i < 8; i++) t[i] = half ? hi[8 * cols + i] : lo[8 * cols + i];
                    transpose8x16(t);
                    for (int p = 0; p < 8; p++)
                        _mm_storeu_si128((__m128i *)(out + 32 * (8 * half + p) + 16 * cols), t[p]);
                }
        }
    }
    if (any_offset) atomic_store(&job->any_offset, 1);
    if (not_half) atomic_store(&job->not_half, 1);
}
#endif

static void repack_groups(void *ctx, int64_t begin, int64_t end) {
    repack_job *job = (repack_job *)ctx;
    const int format = job->a->format, bits = job->a->bits;
#ifdef __SSSE3__
    if (bits == 4) {
        if (format == Q4_0) return repack4_groups_of(job, begin, end, Q4_0);
        if (format == Q4_1) return repack4_groups_of(job, begin, end, Q4_1);
        if (format == Q4_K) return repack4_groups_of(job, begin, end, Q4_K);
    }
    // the held value q + zero is the stored one (0-31 or 0-63) for these zeros, as cpu_qmatmul.py picks them
    if (bits == 6 && format == Q6_K && job->a->zero == 32) return repack56_groups_of(job, begin, end, Q6_K, 6);
    if (bits == 5 && format == Q5_0 && job->a->zero == 16) return repack56_groups_of(job, begin, end, Q5_0, 5);
    if (bits == 5 && format == Q5_1 && job->a->zero == 0) return repack56_groups_of(job, begin, end, Q5_1, 5);
    if (bits == 5 && format == Q5_K && job->a->zero == 0) return repack56_groups_of(job, begin, end, Q5_K, 5);
    if (bits == 8) {
        if (format == Q8_0) return repack8_groups_of(job, begin, end, Q8_0);
        if (format == Q6_K) return repack8_groups_of(job, begin, end, Q6_K);
        if (format == Q5_0) return repack8_groups_of(job, begin, end, Q5_0);
        if (format == Q5_1) return repack8_groups_of(job, begin, end, Q5_1);
        if (format == Q5_K) return repack8_groups_of(job, begin, end, Q5_K);
    }
#endif
#define REPACK_AS(F, B) if (format == F && bits == B) return repack_groups_of(job, begin, end, F, B)
    REPACK_AS(Q4_0, 4); REPACK_AS(Q4_1, 4); REPACK_AS(Q4_K, 4);
    REPACK_AS(Q5_0, 5); REPACK_AS(Q5_1, 5); REPACK_AS(Q5_K, 5); REPACK_AS(Q6_K, 6);
    REPACK_AS(Q8_0, 8); REPACK_AS(Q6_K, 8); REPACK_AS(Q5_K, 8); REPACK_AS(Q4_K, 8);
#undef REPACK_AS
    repack_groups_of(job, begin, end, format, bits);  // a pairing no copy above is made for
}

static int known_format(int f) {
    return f == Q4_0 || f == Q4_1 || f == Q5_0 || f == Q5_1 || f == Q8_0 || f == Q4_K || f == Q5_K || f == Q6_K;
}

// Whether the format's row length fits its blocks.
static int fits_blocks(int f, int64_t in_features) {
    return in_features % ((f == Q4_K || f == Q5_K || f == Q6_K) ? 256 : BLOCK) == 0;
}

// The bits of the format's q: a layout of fewer would drop some, one of more (other than 8) has no such q.
static int q_bits(int f) {
    return (f == Q4_0 || f == Q4_1 || f == Q4_K) ? 4 : (f == Q5_0 || f == Q5_1 || f == Q5_K) ? 5 : f == Q6_K ? 6 : 8;
}

int exl_repack(const exl_repack_args *args) {
    const int f = args->format, bits = args->bits;
    if (bits != 8 && bits != q_bits(f)) return 2;
    if (!known_format(f) || !fits_blocks(f, args->in_features) || (bits != 4 && bits != 5 && bits != 6 && bits != 8) || args->in_features % BLOCK ||
        args->scales_per_block != (f == Q6_K ? 2 : 1))
        return 2;
    repack_job job;
    job.a = args;
    job.nb = args->in_features / BLOCK;
    make_sources(&job.t);
    atomic_init(&job.any_offset, 0);
    atomic_init(&job.not_half, 0);
    atomic_init(&job.failed, 0);
    int64_t groups = (args->rows + CG - 1) / CG;
    exl_parallel_for(repack_groups, &job, groups);
    if (atomic_load(&job.failed)) return 2;
    *args->found = (atomic_load(&job.any_offset) ? 1 : 0) | (atomic_load(&job.not_half) ? 0 : 2);
    return 0;
}

static void dequantize_rows(void *ctx, int64_t begin, int64_t end) {
    const exl_dequantize_args *a = (const exl_dequantize_args *)ctx;
    const int64_t nb = a->in_features / BLOCK;
    // Q5_0's and Q6_K's dequantize() compute q * scale alone; the others add the offset, even where it is zero
    // (+0.0 turns a product of -0.0 into +0.0), and Q4_K / Q5_K subtract dmin * m, the same as adding -(dmin * m)
    const int adds_offset = a->format != Q5_0 && a->format != Q6_K;
    decoded blk;
    for (int64_t r = begin; r < end; r++) {
        const uint8_t *row = a->src + r * a->row_bytes;
        for (int64_t b = 0; b < nb; b++) {
            decode(a->format, row, b, &blk);
            float w[BLOCK];
            for (int k = 0; k < BLOCK; k++) {
                float scale = a->format == Q6_K ? blk.scale[k / 16] : blk.scale[0];
                w[k] = adds_offset ? (float)blk.q[k] * scale + blk.offset : (float)blk.q[k] * scale;
            }
            int64_t at = r * a->in_features + b * BLOCK;
            if (a->bf16) {
                uint16_t *out = (uint16_t *)a->out + at;
                for (int k = 0; k < BLOCK; k++) out[k] = f32_to_bf16(w[k]);
            } else {
                memcpy((float *)a->out + at, w, sizeof w);
            }
        }
    }
}

int exl_dequantize(const exl_dequantize_args *args) {
    if (!known_format(args->format) || !fits_blocks(args->format, args->in_features)) return 2;
    exl_parallel_for(dequantize_rows, (void *)args, args->rows);
    return 0;
}
