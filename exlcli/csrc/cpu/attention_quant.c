// Paged attention on the CPU over quantized KV pages (exlcli/ops/kv_quant.py: q8_0 and q4_0 as
// llama.cpp lays them, q4h and q3h) or fp16 / bf16 pages, K and V each of its own type; bf16 q in,
// bf16 out. exlcli/ops/attention.py checks the inputs and calls it once per layer.
//
// Pages are read as they are stored: a unit of work (up to QBLK queries of one sequence, one kv
// head) decodes the rows it needs block by block in registers (bytes -> int32 -> fp32, or q4h's and q3h's
// code -> its level by a table permute, times the block's scale: the exact values the torch
// decoder gives) into fp32 rows kf, vf [j][dim], which
// every query head of the group and every query of the unit then reads. For the rotated types the
// caller rotates q (so scores against rotated keys need no inverse) and turns the output back once.
// Per query row, in the order of attention_avx2.h:
//   s_j  = hsum8(sum over d0 = 0, 8, .. of q[d0..d0+7] * k_j[d0..d0+7]) * scale
//   p_j  = exp(s_j - max s)             lo <= j < limit = the row's position + 1
//   sum  = sum_j p_j                    lane j % 8 adds its keys in order, then a fixed tree
//   o_d  = (sum_j p_j v_jd) / sum       j = lo, lo + 1, ... in turn; one rounding to bf16 (RNE)
// The layer's kind (attention_kind.h) as attention.c takes it: with a window lo = limit - window and
// a unit decodes only the rows from the first its first query sees; scores are soft-capped before
// the softmax; a sink logit joins the max and exp(sink - max) the sum.
//
// Batch invariance: a row's arithmetic depends only on its q, its keys, its limit and its kind; how the work
// is cut into units and which thread runs them change no bit. AVX2 + FMA + F16C (which every
// AVX-512 CPU has too); elsewhere exl_paged_attention_quant_available() is 0 and the reference runs.

#include <math.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "args.h"
#include "attention_kind.h"
#include "bf16.h"
#include "pool.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define EXL_QATTN 1
#include <immintrin.h>

#include "softmax8.h"
#else
#define EXL_QATTN 0
#endif

// Page types (ops/attention.py's _KV_FORMATS mirrors these numbers).
enum { EXL_KV_BF16 = 0, EXL_KV_F16 = 1, EXL_KV_Q8_0 = 2, EXL_KV_Q4_0 = 3, EXL_KV_Q4H = 4, EXL_KV_Q3H = 5 };

#define QVL 8     // fp32 lanes
#define QBLK 32   // most queries of one sequence in a unit of work
#define QRT 4     // query rows per tile (heads of one token sharing a kv head)

int exl_paged_attention_quant_available(void) { return EXL_QATTN; }

// Bytes of one head vector of `dim` values; 0 for an unknown type.
static int64_t row_bytes(int format, int64_t dim) {
    switch (format) {
        case EXL_KV_BF16:
        case EXL_KV_F16: return dim * 2;
        case EXL_KV_Q8_0: return dim / 32 * 34;
        case EXL_KV_Q4_0:
        case EXL_KV_Q4H: return dim / 32 * 18;
        case EXL_KV_Q3H: return dim / 32 * 14;
        default: return 0;
    }
}

// q4h's and q3h's levels (ops/kv_quant.py's LEVELS, in 256ths: the Gaussian's Lloyd-Max levels):
// code q stands for level[q] * scale_of(e), exact in fp32, e the byte of its 16 values.
#define LV(k) ((float)(k) / 256.0f)
static const float Q4H_LEVELS[16] = {LV(-700), LV(-530), LV(-414), LV(-322), LV(-241), LV(-168), LV(-99), LV(-33),
                                     LV(33),   LV(99),   LV(168),  LV(241),  LV(322),  LV(414),  LV(530), LV(700)};
static const float Q3H_LEVELS[8] = {LV(-551), LV(-344), LV(-194), LV(-63), LV(63), LV(194), LV(344), LV(551)};
#undef LV
static const float SCALE_MANTISSAS[12] = {256, 271, 287, 304, 323, 342, 362, 384, 406, 431, 456, 483};

// ops/kv_quant.py's scales()[e]: 0 for e = 0, else mantissa (12 steps an octave) * 2^(e / 12 - 19).
static inline float scale_of(int e) { return e ? ldexpf(SCALE_MANTISSAS[e % 12], e / 12 - 19) : 0.0f; }

#if EXL_QATTN

// fp32 -> fp16, round to nearest even (torch's .half())
static inline uint16_t exl_f32_to_f16(float f) { return (uint16_t)_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT); }

static inline __m256 codes8(__m128i bytes) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes)); }

// (code - offset) * d for 32 codes held as nibbles: byte i has code i low and code i + 16 high.
static inline void decode_nibbles(const uint8_t *src, float offset, float *dst) {
    __m256 d = _mm256_set1_ps(_cvtsh_ss(*(const uint16_t *)src)), off = _mm256_set1_ps(offset);
    __m128i b = _mm_loadu_si128((const __m128i *)(src + 2)), mask = _mm_set1_epi8(0x0f);
    __m128i lo = _mm_and_si128(b, mask), hi = _mm_and_si128(_mm_srli_epi16(b, 4), mask);
    _mm256_storeu_ps(dst, _mm256_mul_ps(_mm256_sub_ps(codes8(lo), off), d));
    _mm256_storeu_ps(dst + 8, _mm256_mul_ps(_mm256_sub_ps(codes8(_mm_srli_si128(lo, 8)), off), d));
    _mm256_storeu_ps(dst + 16, _mm256_mul_ps(_mm256_sub_ps(codes8(hi), off), d));
    _mm256_storeu_ps(dst + 24, _mm256_mul_ps(_mm256_sub_ps(codes8(_mm_srli_si128(hi, 8)), off), d));
}

// Q4H_LEVELS[code] * scale for 32 codes held as nibbles (decode_nibbles' order: values 0..15 low, with
// the scale of byte 0, 16..31 high, byte 1's): the low 3 bits pick a level from each half of the table
// (a permute), the high bit the half (a blend on the sign bit).
static inline __m256 levels16_8(__m128i codes, __m256 low_half, __m256 high_half, __m256 d) {
    __m256i idx = _mm256_cvtepu8_epi32(codes);
    __m256 pick = _mm256_castsi256_ps(_mm256_slli_epi32(idx, 28));
    __m256 v = _mm256_blendv_ps(_mm256_permutevar8x32_ps(low_half, idx), _mm256_permutevar8x32_ps(high_half, idx), pick);
    return _mm256_mul_ps(v, d);
}

static inline void decode_levels16(const uint8_t *src, float *dst) {
    __m256 d0 = _mm256_set1_ps(scale_of(src[0])), d1 = _mm256_set1_ps(scale_of(src[1]));
    __m256 low_half = _mm256_loadu_ps(Q4H_LEVELS), high_half = _mm256_loadu_ps(Q4H_LEVELS + 8);
    __m128i b = _mm_loadu_si128((const __m128i *)(src + 2)), mask = _mm_set1_epi8(0x0f);
    __m128i lo = _mm_and_si128(b, mask), hi = _mm_and_si128(_mm_srli_epi16(b, 4), mask);
    _mm256_storeu_ps(dst, levels16_8(lo, low_half, high_half, d0));
    _mm256_storeu_ps(dst + 8, levels16_8(_mm_srli_si128(lo, 8), low_half, high_half, d0));
    _mm256_storeu_ps(dst + 16, levels16_8(hi, low_half, high_half, d1));
    _mm256_storeu_ps(dst + 24, levels16_8(_mm_srli_si128(hi, 8), low_half, high_half, d1));
}

// One stored head vector -> its dim fp32 values (a rotated type's still rotated). Every value is
// exact: a code (or q4h's / q3h's level) times its scale fits fp32's mantissa.
static void decode_row(int format, const uint8_t *src, int64_t dim, float *dst) {
    switch (format) {
        case EXL_KV_BF16:
            for (int64_t i = 0; i < dim; i += QVL) _mm256_storeu_ps(dst + i, bf16_load8_n((const uint16_t *)src + i, QVL));
            return;
        case EXL_KV_F16:
            for (int64_t i = 0; i < dim; i += QVL)
                _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + 2 * i))));
            return;
        case EXL_KV_Q8_0:
            for (int64_t blk = 0; blk < dim / 32; blk++, src += 34, dst += 32) {
                __m256 d = _mm256_set1_ps(_cvtsh_ss(*(const uint16_t *)src));
                for (int g = 0; g < 4; g++) {
                    __m128i b = _mm_loadl_epi64((const __m128i *)(src + 2 + 8 * g));
                    _mm256_storeu_ps(dst + 8 * g, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)), d));
                }
            }
            return;
        case EXL_KV_Q4_0:
            for (int64_t blk = 0; blk < dim / 32; blk++) decode_nibbles(src + 18 * blk, 8.0f, dst + 32 * blk);
            return;
        case EXL_KV_Q4H:
            for (int64_t blk = 0; blk < dim / 32; blk++) decode_levels16(src + 18 * blk, dst + 32 * blk);
            return;
        case EXL_KV_Q3H:
            // 2 low bits: byte i % 8 from bit 2 * (i / 8); high bit: byte 8 + i % 4, bit i / 4
            for (int64_t blk = 0; blk < dim / 32; blk++, src += 14, dst += 32) {
                const uint8_t *low = src + 2, *high = src + 10;
                int32_t q[32];
                for (int i = 0; i < 32; i++)
                    q[i] = ((low[i % 8] >> (2 * (i / 8))) & 3) | (((high[i % 4] >> (i / 4)) & 1) << 2);
                __m256 table = _mm256_loadu_ps(Q3H_LEVELS);
                for (int g = 0; g < 4; g++) {
                    __m256i idx = _mm256_loadu_si256((const __m256i *)(q + 8 * g));
                    __m256 d = _mm256_set1_ps(scale_of(src[g / 2]));  // values 0..15: byte 0; 16..31: byte 1
                    _mm256_storeu_ps(dst + 8 * g, _mm256_mul_ps(_mm256_permutevar8x32_ps(table, idx), d));
                }
            }
            return;
    }
}

typedef struct {
    int64_t seq, tok0, tok1, h;
} QUnit;

typedef struct {
    const exl_paged_attention_quant_args *a;
    const QUnit *units;
    atomic_int failed;
} QJob;

static int64_t qunit_keys(const exl_paged_attention_quant_args *a, const QUnit *u) {
    int64_t n = a->query_start_loc[u->seq + 1] - a->query_start_loc[u->seq];
    return a->seq_lens[u->seq] - n + u->tok1;
}

// The first key the unit's first query sees (0 without a window): no row before it is decoded.
static int64_t qunit_first(const exl_paged_attention_quant_args *a, const QUnit *u) {
    int64_t n = a->query_start_loc[u->seq + 1] - a->query_start_loc[u->seq];
    return kind_first_key(a->window, a->seq_lens[u->seq] - n + u->tok0 + 1);
}

// Where the unit's rows kf, vf and a row's scores start: qunit_first rounded down to a whole vector,
// so key j sits in lane j % 8 in whatever unit it is computed.
static int64_t qunit_base(const exl_paged_attention_quant_args *a, const QUnit *u) {
    return qunit_first(a, u) / QVL * QVL;
}

// s[r][j] for rows 0 .. rows - 1 (qf [rows][dim]) and keys lo <= j < limit.
static inline __attribute__((always_inline)) void qscore_rows(const float *qf, const float *kf, int64_t dim, int rows,
                                                               int64_t lo, int64_t limit, float scale, float *s,
                                                               int64_t padded) {
    for (int64_t j = lo; j < limit; j++) {
        __m256 acc[QRT];
        for (int r = 0; r < rows; r++) acc[r] = _mm256_setzero_ps();
        for (int64_t d = 0; d < dim; d += QVL) {
            __m256 k = _mm256_loadu_ps(kf + j * dim + d);
            for (int r = 0; r < rows; r++) acc[r] = _mm256_fmadd_ps(_mm256_loadu_ps(qf + r * dim + d), k, acc[r]);
        }
        for (int r = 0; r < rows; r++) s[r * padded + j] = hsum8(acc[r]) * scale;
    }
}

// out[r][d0 .. d0 + 8 * nvec) = (sum_j p[r][j] v_j) / total[r] over lo <= j < limit, rounded to bf16.
static inline __attribute__((always_inline)) void qpv_rows(const float *p, int64_t padded, const float *vf,
                                                            int64_t dim, int64_t lo, int64_t limit, int rows,
                                                            int64_t d0, int nvec, const float *total,
                                                            uint16_t *const out[QRT]) {
    __m256 acc[QRT][4];
    for (int r = 0; r < rows; r++)
        for (int x = 0; x < nvec; x++) acc[r][x] = _mm256_setzero_ps();
    for (int64_t j = lo; j < limit; j++) {
        __m256 v[4];
        for (int x = 0; x < nvec; x++) v[x] = _mm256_loadu_ps(vf + j * dim + d0 + QVL * x);
        for (int r = 0; r < rows; r++) {
            __m256 pb = _mm256_broadcast_ss(p + r * padded + j);
            for (int x = 0; x < nvec; x++) acc[r][x] = _mm256_fmadd_ps(pb, v[x], acc[r][x]);
        }
    }
    for (int r = 0; r < rows; r++) {
        __m256 t = _mm256_set1_ps(total[r]);
        for (int x = 0; x < nvec; x++) bf16_store8_n(out[r] + d0 + QVL * x, _mm256_div_ps(acc[r][x], t), QVL);
    }
}

// Rows of keys lo .. limit - 1 (counted from the unit's base); sinks: the rows' sink logits, or NULL.
static void qattend_tile(const exl_paged_attention_quant_args *a, const float *qf, const float *kf, const float *vf,
                         int rows, int64_t lo, int64_t limit, const float *sinks, float *s, int64_t padded,
                         uint16_t *const out[QRT]) {
    switch (rows) {  // constant row counts keep the sums in registers
        case 1: qscore_rows(qf, kf, a->dim, 1, lo, limit, a->scale, s, padded); break;
        case 2: qscore_rows(qf, kf, a->dim, 2, lo, limit, a->scale, s, padded); break;
        case 3: qscore_rows(qf, kf, a->dim, 3, lo, limit, a->scale, s, padded); break;
        default: qscore_rows(qf, kf, a->dim, 4, lo, limit, a->scale, s, padded); break;
    }
    float total[QRT];
    for (int r = 0; r < rows; r++) {
        kind_soft_cap(s + r * padded, lo, limit, a->softcap);
        total[r] = softmax_range8(s + r * padded, lo, limit, sinks ? sinks + r : NULL);
    }
    for (int64_t d0 = 0; d0 < a->dim; d0 += 4 * QVL) {
        int64_t left = (a->dim - d0) / QVL;
        int nvec = left < 4 ? (int)left : 4;
#define QPV(R)                                                                              \
    switch (nvec) {                                                                         \
        case 1: qpv_rows(s, padded, vf, a->dim, lo, limit, R, d0, 1, total, out); break;    \
        case 2: qpv_rows(s, padded, vf, a->dim, lo, limit, R, d0, 2, total, out); break;    \
        case 3: qpv_rows(s, padded, vf, a->dim, lo, limit, R, d0, 3, total, out); break;    \
        default: qpv_rows(s, padded, vf, a->dim, lo, limit, R, d0, 4, total, out); break;   \
    }
        switch (rows) {
            case 1: QPV(1) break;
            case 2: QPV(2) break;
            case 3: QPV(3) break;
            default: QPV(4) break;
        }
#undef QPV
    }
}

static void qattend_unit(const exl_paged_attention_quant_args *a, const QUnit *u, float *work) {
    int64_t heads = a->heads, kv_heads = a->kv_heads, dim = a->dim, group = heads / kv_heads, h = u->h;
    int64_t b = u->seq, q0 = a->query_start_loc[b], n = a->query_start_loc[b + 1] - q0, len = a->seq_lens[b];
    int64_t kbase = qunit_base(a, u), keys = qunit_keys(a, u) - kbase, padded = (keys + QVL - 1) / QVL * QVL;
    int64_t kbytes = row_bytes(a->k_format, dim), vbytes = row_bytes(a->v_format, dim);
    const int32_t *pages = a->block_tables + b * a->max_pages;
    float *kf = work, *vf = kf + keys * dim, *s = vf + keys * dim, *qf = s + QRT * padded;
    for (int64_t j = qunit_first(a, u); j < kbase + keys; j++) {
        int64_t slot = (int64_t)pages[j / a->page_size] * a->page_size + j % a->page_size;
        decode_row(a->k_format, a->k_cache + (slot * kv_heads + h) * kbytes, dim, kf + (j - kbase) * dim);
        decode_row(a->v_format, a->v_cache + (slot * kv_heads + h) * vbytes, dim, vf + (j - kbase) * dim);
    }
    for (int64_t t = u->tok0; t < u->tok1; t++) {
        int64_t limit = len - n + t + 1, lo = kind_first_key(a->window, limit) - kbase;
        limit -= kbase;
        for (int64_t g0 = 0; g0 < group; g0 += QRT) {
            int rows = (int)(group - g0 < QRT ? group - g0 : QRT);
            uint16_t *orow[QRT];
            for (int r = 0; r < rows; r++) {
                int64_t off = ((q0 + t) * heads + h * group + g0 + r) * dim;
                for (int64_t d = 0; d < dim; d += QVL) _mm256_storeu_ps(qf + r * dim + d, bf16_load8_n(a->q + off + d, QVL));
                orow[r] = a->out + off;
            }
            qattend_tile(a, qf, kf, vf, rows, lo, limit, a->sinks ? a->sinks + h * group + g0 : NULL, s, padded,
                         orow);
        }
    }
}

static int64_t qworkspace_floats(int64_t keys, int64_t dim) {
    int64_t padded = (keys + QVL - 1) / QVL * QVL;
    return 2 * keys * dim + QRT * padded + QRT * dim;
}

static void qattend_units(void *ctx, int64_t begin, int64_t end) {
    QJob *job = (QJob *)ctx;
    int64_t most = 0;
    for (int64_t i = begin; i < end; i++) {
        int64_t need = qworkspace_floats(qunit_keys(job->a, &job->units[i]) - qunit_base(job->a, &job->units[i]),
                                         job->a->dim);
        if (need > most) most = need;
    }
    float *work = (float *)aligned_alloc(64, (size_t)(most + 16) / 16 * 64);
    if (!work) {
        atomic_store(&job->failed, 1);
        return;
    }
    for (int64_t i = begin; i < end; i++) qattend_unit(job->a, &job->units[i], work);
    free(work);
}

// Returns 0; 1 when a used block-table entry is outside [0, num_pages); 2 for an unknown page type
// or a head_dim that is not a multiple of 32; -1 when out of memory. The caller checked the rest.
int exl_paged_attention_quant(const exl_paged_attention_quant_args *a) {
    if (!row_bytes(a->k_format, a->dim) || !row_bytes(a->v_format, a->dim) || a->dim % 32) return 2;
    int64_t count = 0;
    for (int64_t b = 0; b < a->num_seqs; b++) {
        const int32_t *pages = a->block_tables + b * a->max_pages;
        int64_t n = a->query_start_loc[b + 1] - a->query_start_loc[b];
        if (n == 0) continue;
        for (int64_t i = kind_first_key(a->window, a->seq_lens[b] - n + 1) / a->page_size;
             i < (a->seq_lens[b] + a->page_size - 1) / a->page_size; i++)
            if (pages[i] < 0 || pages[i] >= a->num_pages) return 1;
        count += (n + QBLK - 1) / QBLK;
    }
    QUnit *units = (QUnit *)malloc(sizeof(QUnit) * (size_t)(count * a->kv_heads + 1));
    if (!units) return -1;
    int64_t nu = 0;
    for (int64_t b = 0; b < a->num_seqs; b++) {
        int64_t n = a->query_start_loc[b + 1] - a->query_start_loc[b];
        for (int64_t t = 0; t < n; t += QBLK)
            for (int64_t h = 0; h < a->kv_heads; h++) units[nu++] = (QUnit){b, t, t + QBLK < n ? t + QBLK : n, h};
    }
    QJob job = {a, units, 0};
    exl_parallel_for(qattend_units, &job, nu);
    free(units);
    return atomic_load(&job.failed) ? -1 : 0;
}


// 16 values of q4h or q3h (ops/kv_quant.py's _gaussian_codes, step for step): the scale byte e of least
// squared error among SCALE_SPAN from the first whose scale reaches amax * lowest (the first on a tie;
// the error summed in fp64, each term exact), each value's code the count of level midpoints times the
// scale below it. Every product here is exact or rounded once as torch rounds it, so the bytes are the
// torch encoder's.
#define SCALE_SPAN 9
static uint8_t gaussian_half(const float *x, const float *levels, int count, float lowest, uint8_t *codes) {
    float amax = 0.0f, bounds[15];
    for (int i = 0; i < 16; i++) amax = fabsf(x[i]) > amax ? fabsf(x[i]) : amax;
    float target = amax * lowest;
    int first = 0;
    while (first < 256 && scale_of(first) < target) first++;
    double best_err = 0.0;
    int best_e = 0;
    for (int i = 0; i < SCALE_SPAN; i++) {
        int e = first + i > 255 ? 255 : first + i;
        float d = scale_of(e);
        for (int j = 0; j + 1 < count; j++) bounds[j] = (levels[j] + levels[j + 1]) / 2.0f * d;
        uint8_t q[16];
        double err = 0.0;
        for (int v = 0; v < 16; v++) {
            int c = 0;
            for (int j = 0; j + 1 < count; j++) c += x[v] > bounds[j];
            q[v] = (uint8_t)c;
            double diff = (double)(levels[c] * d - x[v]);
            err += diff * diff;
        }
        if (i == 0 || err < best_err) {
            best_err = err;
            best_e = e;
            memcpy(codes, q, 16);
        }
    }
    return (uint8_t)best_e;
}

// The K/V write's rows: q8_0 and q4_0 as llama.cpp's quantize_row_q8_0_ref and quantize_row_q4_0_ref
// write them, q4h and q3h as gaussian_half (scalar: the write is a few rows a step). Returns 0; 2 for
// another type or a dim that is not a multiple of 32.
int exl_kv_quantize(const exl_kv_quantize_args *a) {
    if (a->dim % 32 || a->format < EXL_KV_Q8_0 || a->format > EXL_KV_Q3H) return 2;
    int64_t bytes = row_bytes(a->format, a->dim);
    for (int64_t r = 0; r < a->rows; r++) {
        const float *x = a->x + r * a->dim;
        uint8_t *o = a->out + r * bytes;
        for (int64_t blk = 0; blk < a->dim / 32; blk++, x += 32) {
            uint16_t h;
            if (a->format == EXL_KV_Q4H || a->format == EXL_KV_Q3H) {
                uint8_t q[32];
                int four = a->format == EXL_KV_Q4H;
                const float *levels = four ? Q4H_LEVELS : Q3H_LEVELS;
                float lowest = four ? 21.0f / 64.0f : 24.0f / 64.0f;  // ops/kv_quant.py's SCALE_FLOOR
                o[0] = gaussian_half(x, levels, four ? 16 : 8, lowest, q);
                o[1] = gaussian_half(x + 16, levels, four ? 16 : 8, lowest, q + 16);
                if (four) {
                    for (int i = 0; i < 16; i++) o[2 + i] = (uint8_t)(q[i] | (q[i + 16] << 4));
                    o += 18;
                } else {  // 2 low bits: byte i % 8 from bit 2 * (i / 8); high bit: byte 8 + i % 4, bit i / 4
                    memset(o + 2, 0, 12);
                    for (int i = 0; i < 32; i++) {
                        o[2 + i % 8] |= (uint8_t)((q[i] & 3) << (2 * (i / 8)));
                        o[10 + i % 4] |= (uint8_t)((q[i] >> 2) << (i / 4));
                    }
                    o += 14;
                }
                continue;
            }
            float amax = 0.0f, max = 0.0f;
            for (int i = 0; i < 32; i++)
                if (amax < fabsf(x[i])) {
                    amax = fabsf(x[i]);
                    max = x[i];
                }
            if (a->format == EXL_KV_Q8_0) {
                float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
                h = exl_f32_to_f16(d);
                memcpy(o, &h, 2);
                for (int i = 0; i < 32; i++) ((int8_t *)o)[2 + i] = (int8_t)roundf(x[i] * id);
                o += 34;
            } else {
                float d = max / -8.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
                h = exl_f32_to_f16(d);
                memcpy(o, &h, 2);
                for (int i = 0; i < 16; i++) {
                    float lo = x[i] * id + 8.5f, hi = x[i + 16] * id + 8.5f;
                    int ql = lo < 0.0f ? 0 : (int)lo, qh = hi < 0.0f ? 0 : (int)hi;  // trunc, clamped to 0 .. 15
                    o[2 + i] = (uint8_t)((ql > 15 ? 15 : ql) | ((qh > 15 ? 15 : qh) << 4));
                }
                o += 18;
            }
        }
    }
    return 0;
}

#else

int exl_kv_quantize(const exl_kv_quantize_args *a) {
    (void)a;
    return -1;
}

int exl_paged_attention_quant(const exl_paged_attention_quant_args *a) {
    (void)a;
    return -1;
}

#endif
