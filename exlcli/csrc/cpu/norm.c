// RMSNorm over bf16 rows, alone and fused with the residual add, on the CPU.
//
// Bitwise the same as the torch reference (exlcli/ops/norm.py), single- or multi-threaded:
//   residual = bf16(x + residual)                      (fp32 add, one rounding)
//   ms = sum(r * r) / D                                (fp32; squares of bf16 values are exact)
//   y  = bf16(r * (1 / sqrt(ms + eps)))                 (F.rms_norm, then .to(bf16))
//   out = bf16(w * y)                                   (the weight multiply in bf16)
// The sum runs in the order of torch's CPU sum kernel for a contiguous inner reduction
// (aten/src/ATen/native/cpu/SumKernel.cpp). torch runs the AVX2 build of that kernel even on an
// AVX-512 CPU (its sums match this 8-lane order bit for bit, which the tests check through
// exl_mean_squares), so the partial sums are 8-lane vectors: four interleaved accumulators over
// groups of four vectors, cascaded every 16 groups, folded 0+1+2+3 (plus the vectors left over after
// the last group), then a float that starts at 0 takes the scalar tail (D % 8) and the 8 lanes, in
// order. That order depends only on D, never on the row count, so each row comes out the same
// alone or in a batch.
//
// Rows are addressed as x + (r / inner) * stride_outer + (r % inner) * stride_inner, which covers
// [T, H] and the per-head [T, heads, D] of a q/k norm whose heads are a view into a wider row.
// Enough rows are shared among the pool's threads (csrc/cpu/pool.h); a row's numbers never depend
// on which thread computes it.

#include <math.h>
#include <stdint.h>

#include "args.h"
#include "bf16.h"
#include "pool.h"

// No fused multiply-add contraction: the reference rounds every product.
#if defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define EXL_NORM 1
#include <immintrin.h>
#elif defined(__AVX2__)
#define EXL_NORM 2  // 8 lanes for the elementwise parts; the sum is 8-lane on both
#include <immintrin.h>
#else
#define EXL_NORM 0
#endif

int exl_norm_available(void) { return EXL_NORM != 0; }

#if EXL_NORM

#define LANES (EXL_NORM == 1 ? 16 : 8)

static inline int64_t ceil_log2(int64_t x) {
    if (x <= 2) return 1;
    int64_t n = 0;
    for (uint64_t v = (uint64_t)(x - 1); v; v >>= 1) n++;
    return n;
}

// torch runs its AVX2 sum kernel under the AVX512 capability (the sum stub has no AVX512 build), so
// its reduction works on 8-lane vectors; so does this one.
#define SUM_LANES 8

static inline __m256 square8(const uint16_t *row, int64_t vec) {
    __m128i h = _mm_loadu_si128((const __m128i *)(row + vec * SUM_LANES));
    __m256 v = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    return _mm256_mul_ps(v, v);
}

static inline __m256 square8_f32(const float *row, int64_t vec) {
    __m256 v = _mm256_loadu_ps(row + vec * SUM_LANES);
    return _mm256_mul_ps(v, v);
}

// Sum of squares of one bf16 row of length d, in torch's order (see the top of the file).
// A row is bf16 (`row`) or fp32 (`row_f32`, where `row` is NULL: an fp32 residual stream).
#define SQUARE8(vec) (row ? square8(row, (vec)) : square8_f32(row_f32, (vec)))
static float sum_squares_of(const uint16_t *row, const float *row_f32, int64_t d) {
    const int64_t nvec = d / SUM_LANES;  // whole vectors
    const int64_t groups = nvec / 4;     // groups of 4 vectors (torch's ilp factor)
    const int64_t power = ceil_log2(groups) / 4 > 4 ? ceil_log2(groups) / 4 : 4;
    const int64_t step = (int64_t)1 << power, mask = step - 1;
    __m256 acc[4][4];  // [cascade level][interleaved accumulator]
    for (int l = 0; l < 4; l++)
        for (int k = 0; k < 4; k++) acc[l][k] = _mm256_setzero_ps();
    int64_t g = 0;
    while (g + step <= groups) {
        for (int64_t j = 0; j < step; j++, g++)
            for (int k = 0; k < 4; k++) acc[0][k] = _mm256_add_ps(acc[0][k], SQUARE8(g * 4 + k));
        for (int l = 1; l < 4; l++) {
            for (int k = 0; k < 4; k++) {
                acc[l][k] = _mm256_add_ps(acc[l][k], acc[l - 1][k]);
                acc[l - 1][k] = _mm256_setzero_ps();
            }
            if ((g & (mask << (l * power))) != 0) break;
        }
    }
    for (; g < groups; g++)
        for (int k = 0; k < 4; k++) acc[0][k] = _mm256_add_ps(acc[0][k], SQUARE8(g * 4 + k));
    for (int l = 1; l < 4; l++)
        for (int k = 0; k < 4; k++) acc[0][k] = _mm256_add_ps(acc[0][k], acc[l][k]);
    for (int64_t i = groups * 4; i < nvec; i++) acc[0][0] = _mm256_add_ps(acc[0][0], SQUARE8(i));
    __m256 part = acc[0][0];
    for (int k = 1; k < 4; k++) part = _mm256_add_ps(part, acc[0][k]);
    float total = 0.0f;
    for (int64_t i = nvec * SUM_LANES; i < d; i++) {
        float v = row ? bf16_to_f32(row[i]) : row_f32[i];
        total += v * v;
    }
    float lanes[SUM_LANES];
    _mm256_storeu_ps(lanes, part);
    for (int k = 0; k < SUM_LANES; k++) total += lanes[k];
    return total;
}
#undef SQUARE8

static float sum_squares(const uint16_t *row, int64_t d) { return sum_squares_of(row, NULL, d); }

// out = bf16(w * bf16(r * inv)) over one row.
#if EXL_NORM == 1
static void scale_row(const uint16_t *r, const uint16_t *w, uint16_t *out, int64_t d, float inv) {
    const __m512 vinv = _mm512_set1_ps(inv);
    for (int64_t i = 0; i < d; i += LANES) {
        __mmask16 m = lanes16(d - i);
        __m512 y = bf16_round(_mm512_mul_ps(bf16_load16_masked(r + i, m), vinv));
        bf16_store16_masked(out + i, _mm512_mul_ps(bf16_load16_masked(w + i, m), y), m);
    }
}
#else
static void scale_row(const uint16_t *r, const uint16_t *w, uint16_t *out, int64_t d, float inv) {
    const __m256 vinv = _mm256_set1_ps(inv);
    for (int64_t i = 0; i < d; i += LANES) {
        __m256 y = bf16_round8(_mm256_mul_ps(bf16_load8_n(r + i, d - i), vinv));
        bf16_store8_n(out + i, _mm256_mul_ps(bf16_load8_n(w + i, d - i), y), d - i);
    }
}
#endif

static float inv_rms(const uint16_t *r, int64_t d, float eps) {
    float ms = sum_squares(r, d) / (float)d;
    return 1.0f / sqrtf(ms + eps);
}

// The fp32-residual forms: out = bf16(w * bf16(r * inv)) from an fp32 row r, 8 lanes on either ISA
// (each lane's arithmetic is the same at any width).
static void scale_row_f32(const float *r, const uint16_t *w, uint16_t *out, int64_t d, float inv) {
    const __m256 vinv = _mm256_set1_ps(inv);
    for (int64_t i = 0; i < d; i += 8) {
        __m256 y = bf16_round8(_mm256_mul_ps(f32_load8_n(r + i, d - i), vinv));
        bf16_store8_n(out + i, _mm256_mul_ps(bf16_load8_n(w + i, d - i), y), d - i);
    }
}

static float inv_rms_f32(const float *r, int64_t d, float eps) {
    float ms = sum_squares_of(NULL, r, d) / (float)d;
    return 1.0f / sqrtf(ms + eps);
}

// Below this many elements a call stays on the caller's thread: waking the pool costs more.
#define PARALLEL_MIN_ELEMS 32768

typedef struct {
    const uint16_t *x, *residual, *w;
    uint16_t *residual_out, *out;
    const float *residual_f32;  // the fp32 residual stream's form: these instead of residual(_out)
    float *residual_out_f32;
    int64_t stride_outer, stride_inner, inner, d;
    float eps;
} norm_args;

static void norm_rows(void *ctx, int64_t begin, int64_t end) {
    const norm_args *a = (const norm_args *)ctx;
    for (int64_t r = begin; r < end; r++) {
        const uint16_t *row = a->x + (r / a->inner) * a->stride_outer + (r % a->inner) * a->stride_inner;
        scale_row(row, a->w, a->out + r * a->d, a->d, inv_rms(row, a->d, a->eps));
    }
}

static void fused_rows(void *ctx, int64_t begin, int64_t end) {
    const norm_args *a = (const norm_args *)ctx;
    const int64_t d = a->d;
    for (int64_t r = begin; r < end; r++) {
        const int64_t base = r * d;
        for (int64_t i = 0; i < d; i += LANES) {
#if EXL_NORM == 1
            __mmask16 m = lanes16(d - i);
            __m512 s = _mm512_add_ps(bf16_load16_masked(a->x + base + i, m),
                                     bf16_load16_masked(a->residual + base + i, m));
            bf16_store16_masked(a->residual_out + base + i, s, m);
#else
            __m256 s = _mm256_add_ps(bf16_load8_n(a->x + base + i, d - i), bf16_load8_n(a->residual + base + i, d - i));
            bf16_store8_n(a->residual_out + base + i, s, d - i);
#endif
        }
        scale_row(a->residual_out + base, a->w, a->out + base, d, inv_rms(a->residual_out + base, d, a->eps));
    }
}

// residual_out = x + residual in fp32 (no rounding to bf16), then the norm of that fp32 row.
static void fused_rows_f32(void *ctx, int64_t begin, int64_t end) {
    const norm_args *a = (const norm_args *)ctx;
    const int64_t d = a->d;
    for (int64_t r = begin; r < end; r++) {
        const int64_t base = r * d;
        float *ro = a->residual_out_f32 + base;
        for (int64_t i = 0; i < d; i += 8) {
            __m256 s = _mm256_add_ps(bf16_load8_n(a->x + base + i, d - i), f32_load8_n(a->residual_f32 + base + i, d - i));
            if (d - i >= 8) {
                _mm256_storeu_ps(ro + i, s);
            } else {
                float t[8];
                _mm256_storeu_ps(t, s);
                memcpy(ro + i, t, (size_t)(d - i) * sizeof(float));
            }
        }
        scale_row_f32(ro, a->w, a->out + base, d, inv_rms_f32(ro, d, a->eps));
    }
}

static void run(exl_task_fn task, norm_args *a, int64_t rows) {
    if (rows * a->d >= PARALLEL_MIN_ELEMS) exl_parallel_for(task, a, rows);
    else task(a, 0, rows);
}

// x rows (see the top of the file) -> out [rows, d] contiguous.
int exl_rms_norm(const exl_rms_norm_args *args) {
    const uint16_t *x = args->x, *w = args->weight;
    uint16_t *out = args->out;
    int64_t stride_outer = args->stride_outer, stride_inner = args->stride_inner, inner = args->inner;
    int64_t d = args->dim, rows = args->rows;
    float eps = args->eps;
    if (d <= 0 || inner <= 0 || rows < 0) return -1;
    norm_args a = {.x = x, .w = w, .out = out, .stride_outer = stride_outer, .stride_inner = stride_inner,
                   .inner = inner, .d = d, .eps = eps};
    run(norm_rows, &a, rows);
    return 0;
}

// out[r] = the fp32 mean of squares the norm uses for row r of x [rows, d] contiguous: what the tests
// compare with torch's x.float().pow(2).mean(-1), bit for bit.
int exl_mean_squares(const exl_mean_squares_args *args) {
    const uint16_t *x = args->x;
    int64_t d = args->dim, rows = args->rows;
    float *out = args->out;
    if (d <= 0 || rows < 0) return -1;
    for (int64_t r = 0; r < rows; r++) out[r] = sum_squares(x + r * d, d) / (float)d;
    return 0;
}

// residual_out = bf16(x + residual); out = rms_norm(residual_out); all [rows, d] contiguous. With
// residual_fp32 the residual and residual_out are fp32 rows and the sum is not rounded to bf16.
int exl_fused_add_rms_norm(const exl_fused_add_rms_norm_args *args) {
    const uint16_t *x = args->x, *residual = args->residual, *w = args->weight;
    uint16_t *residual_out = args->residual_out, *out = args->out;
    int64_t d = args->dim, rows = args->rows;
    float eps = args->eps;
    if (d <= 0 || rows < 0) return -1;
    norm_args a = {.x = x, .residual = residual, .w = w, .residual_out = residual_out, .out = out,
                   .d = d, .eps = eps};
    if (args->residual_fp32) {
        a.residual = a.residual_out = NULL;
        a.residual_f32 = (const float *)args->residual;
        a.residual_out_f32 = (float *)args->residual_out;
        run(fused_rows_f32, &a, rows);
        return 0;
    }
    run(fused_rows, &a, rows);
    return 0;
}

#endif
