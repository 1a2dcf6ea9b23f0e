// qmatmul's weight layout built from GGUF blocks at load, on the kernel pool's threads.
//
// A model file is read through a memory map and each linear's rows go straight from the file's blocks to
// the groups of 16 output columns that qmatmul.c streams (its layout is written in
// exlcli/ops/formats/cpu_qmatmul.py, whose QuantCpuLinear builds the same bytes with torch ops from a
// format's unpack(): the oracle of the tests). Per (group, block of 32 weights) the 16 rows' blocks are
// decoded into q values, scales and offsets the way the format modules' unpack() computes them (the same
// fp32 products, so the same bits), then written in the layout of `bits`. Groups are independent, so the
// pool's threads share them and the result is the same with any number of threads.

#include <stdatomic.h>
#include <stdint.h>
#include <string.h>

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

// Block b (of 32 weights) of a row; 0, or -1 for a format this file does not decode.
static int decode(int format, const uint8_t *row, int64_t b, decoded *out) {
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

static void repack_groups(void *ctx, int64_t begin, int64_t end) {
    repack_job *job = (repack_job *)ctx;
    const exl_repack_args *a = job->a;
    const int64_t nb = job->nb, bytes = layout_bytes(a->bits);
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
                    if (decode(a->format, a->src + r * a->row_bytes, b, &blk) != 0) {
                        atomic_store(&job->failed, 1);
                        return;
                    }
                } else {  // padding rows: q = 0, no scale or offset
                    memset(&blk, 0, sizeof blk);
                }
                place_column(a->bits, c, blk.q, a->zero, v, a->qs + (g * nb + b) * bytes);
                for (int s = 0; s < spb; s++) {
                    d[s * CG + c] = blk.scale[s];
                    not_half |= !exact_in_half(blk.scale[s]);
                }
                m[c] = blk.offset;
                any_offset |= blk.offset != 0.0f;
                not_half |= !exact_in_half(blk.offset);
            }
            if (a->bits == 5 || a->bits == 6) write_block(&job->t, a->bits, v, a->qs + (g * nb + b) * bytes);
        }
    }
    if (any_offset) atomic_store(&job->any_offset, 1);
    if (not_half) atomic_store(&job->not_half, 1);
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
