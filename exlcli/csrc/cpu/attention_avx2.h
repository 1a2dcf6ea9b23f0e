// The AVX2 + FMA body of attention.c, for CPUs without AVX-512; included by attention.c only there.
// Same contract and the same invariance; its own fixed order of operations, 8 lanes wide:
//   a unit converts its sequence's keys and values, head by head, to fp32 rows (kf, vf: [j][dim]);
//   s_j  = hsum8(sum over d0 = 0, 8, .. of q[d0..d0+7] * k_j[d0..d0+7]) * scale   (an FMA chain
//          per lane in d order, then a fixed tree over the 8 lanes)
//   p_j  = exp(s_j - max s)             lo <= j < limit
//   sum  = sum_j p_j                    lane j % 8 adds its keys in order, then the same tree
//   o_d  = (sum_j p_j v_jd) / sum       j = lo, lo + 1, ... in turn; one rounding to bf16 (RNE)
// The layer's kind as attention.c takes it (softmax8.h's softmax_range8 adds the sink). A row's
// numbers depend only on its q, its keys, its limit and its kind: rows are tiled (up to RT query
// heads of one token) only to share loads.

#define VL 8  // fp32 lanes

#include "softmax8.h"

// Floats of scratch for a unit of `keys` keys (from its base on): one head's keys and values in
// fp32, the scores of one tile of rows (padded to whole vectors) and its fp32 queries.
static int64_t workspace_floats(int64_t keys, int64_t heads, int64_t dim) {
    (void)heads;
    int64_t padded = (keys + VL - 1) / VL * VL;
    return 2 * keys * dim + RT * padded + RT * dim;
}

#define PREFETCH_KEYS 16  // keys ahead whose rows convert_head asks memory for

// Key / value rows from .. len - 1 of kv head h, from the pages into kf, vf [j - kbase][dim]. A key's
// head row is a few cache lines a slot apart (the other heads sit between), which the hardware
// prefetcher follows poorly: the loads of a decode row's keys stalled on memory for most of the
// attention's time (perf, the 2-core EPYC), so the rows PREFETCH_KEYS ahead are asked for early.
static void convert_head(const AttentionArgs *a, const int32_t *pages, int64_t h, int64_t kbase, int64_t from,
                         int64_t len, float *kf, float *vf) {
    int64_t row_len = a->kv_heads * a->dim;
    for (int64_t j = from; j < len; j++) {
        if (j + PREFETCH_KEYS < len) {
            int64_t jp = j + PREFETCH_KEYS;
            int64_t ahead = ((int64_t)pages[jp / a->page_size] * a->page_size + jp % a->page_size) * row_len + h * a->dim;
            for (int64_t d = 0; d < a->dim; d += 32) {
                _mm_prefetch((const char *)(a->k_cache + ahead + d), _MM_HINT_T0);
                _mm_prefetch((const char *)(a->v_cache + ahead + d), _MM_HINT_T0);
            }
        }
        int64_t off = ((int64_t)pages[j / a->page_size] * a->page_size + j % a->page_size) * row_len + h * a->dim;
        int64_t at = (j - kbase) * a->dim;
        for (int64_t d = 0; d < a->dim; d += VL) {
            _mm256_storeu_ps(kf + at + d, bf16_load8_n(a->k_cache + off + d, VL));
            _mm256_storeu_ps(vf + at + d, bf16_load8_n(a->v_cache + off + d, VL));
        }
    }
}

// s[r][j] for rows 0 .. rows - 1 (qf [rows][dim]) and keys lo <= j < limit.
static inline __attribute__((always_inline)) void score_rows(const float *qf, const float *kf, int64_t dim,
                                                              int rows, int64_t lo, int64_t limit, float scale,
                                                              float *s, int64_t padded) {
    for (int64_t j = lo; j < limit; j++) {
        __m256 acc[RT];
        for (int r = 0; r < rows; r++) acc[r] = _mm256_setzero_ps();
        for (int64_t d = 0; d < dim; d += VL) {
            __m256 k = _mm256_loadu_ps(kf + j * dim + d);
            for (int r = 0; r < rows; r++) acc[r] = _mm256_fmadd_ps(_mm256_loadu_ps(qf + r * dim + d), k, acc[r]);
        }
        for (int r = 0; r < rows; r++) s[r * padded + j] = hsum8(acc[r]) * scale;
    }
}

// out[r][d0 .. d0 + 8 * nvec) = (sum_j p[r][j] v_j) / total[r] over lo <= j < limit, rounded to bf16.
static inline __attribute__((always_inline)) void pv_rows(const float *p, int64_t padded, const float *vf,
                                                           int64_t dim, int64_t lo, int64_t limit, int rows,
                                                           int64_t d0, int nvec, const float *total,
                                                           uint16_t *const out[RT]) {
    __m256 acc[RT][4];
    for (int r = 0; r < rows; r++)
        for (int x = 0; x < nvec; x++) acc[r][x] = _mm256_setzero_ps();
    for (int64_t j = lo; j < limit; j++) {
        __m256 v[4];
        for (int x = 0; x < nvec; x++) v[x] = _mm256_loadu_ps(vf + j * dim + d0 + VL * x);
        for (int r = 0; r < rows; r++) {
            __m256 pb = _mm256_broadcast_ss(p + r * padded + j);
            for (int x = 0; x < nvec; x++) acc[r][x] = _mm256_fmadd_ps(pb, v[x], acc[r][x]);
        }
    }
    for (int r = 0; r < rows; r++) {
        __m256 t = _mm256_set1_ps(total[r]);
        for (int x = 0; x < nvec; x++) bf16_store8_n(out[r] + d0 + VL * x, _mm256_div_ps(acc[r][x], t), VL);
    }
}

#define AVX2_ROWS(R, CALL) \
    case R: CALL; break;

// Rows of keys lo .. limit - 1 (counted from the unit's base, a multiple of 8); sinks: the rows'
// sink logits, or NULL.
static void attend_tile(const AttentionArgs *a, const float *qf, const float *kf, const float *vf, int rows,
                        int64_t lo, int64_t limit, const float *sinks, float *s, int64_t padded,
                        uint16_t *const out[RT]) {
    switch (rows) {  // constant row counts keep the sums in registers
        AVX2_ROWS(1, score_rows(qf, kf, a->dim, 1, lo, limit, a->scale, s, padded))
        AVX2_ROWS(2, score_rows(qf, kf, a->dim, 2, lo, limit, a->scale, s, padded))
        AVX2_ROWS(3, score_rows(qf, kf, a->dim, 3, lo, limit, a->scale, s, padded))
        default: score_rows(qf, kf, a->dim, 4, lo, limit, a->scale, s, padded); break;
    }
    float total[RT];
    for (int r = 0; r < rows; r++) {
        kind_soft_cap(s + r * padded, lo, limit, a->softcap);
        total[r] = softmax_range8(s + r * padded, lo, limit, sinks ? sinks + r : NULL);
    }
    for (int64_t d0 = 0; d0 < a->dim; d0 += 4 * VL) {
        int64_t left = (a->dim - d0) / VL;
        int nvec = left < 4 ? (int)left : 4;
#define PV(R)                                                                                       \
    switch (nvec) {                                                                                 \
        case 1: pv_rows(s, padded, vf, a->dim, lo, limit, R, d0, 1, total, out); break;             \
        case 2: pv_rows(s, padded, vf, a->dim, lo, limit, R, d0, 2, total, out); break;             \
        case 3: pv_rows(s, padded, vf, a->dim, lo, limit, R, d0, 3, total, out); break;             \
        default: pv_rows(s, padded, vf, a->dim, lo, limit, R, d0, 4, total, out); break;            \
    }
        switch (rows) {
            case 1: PV(1) break;
            case 2: PV(2) break;
            case 3: PV(3) break;
            default: PV(4) break;
        }
#undef PV
    }
}

static void attend_unit(const AttentionArgs *a, const Unit *u, const Unit *next, float *work) {
    (void)next;
    int64_t heads = a->heads, kv_heads = a->kv_heads, dim = a->dim, group = heads / kv_heads;
    int64_t b = u->seq, q0 = a->query_start_loc[b], n = a->query_start_loc[b + 1] - q0, len = a->seq_lens[b];
    int64_t kbase = unit_base(a, u), keys = unit_keys(a, u) - kbase, padded = (keys + VL - 1) / VL * VL;
    const int32_t *pages = a->block_tables + b * a->max_pages;
    float *kf = work, *vf = kf + keys * dim, *s = vf + keys * dim, *qf = s + RT * padded;
    for (int64_t h = u->h0; h < u->h1; h++) {
        convert_head(a, pages, h, kbase, unit_first(a, u), kbase + keys, kf, vf);
        for (int64_t t = u->tok0; t < u->tok1; t++) {
            int64_t limit = len - n + t + 1, lo = kind_first_key(a->window, limit) - kbase;
            limit -= kbase;
            for (int64_t g0 = 0; g0 < group; g0 += RT) {
                int rows = (int)(group - g0 < RT ? group - g0 : RT);
                uint16_t *orow[RT];
                for (int r = 0; r < rows; r++) {
                    int64_t off = ((q0 + t) * heads + h * group + g0 + r) * dim;
                    for (int64_t d = 0; d < dim; d += VL) _mm256_storeu_ps(qf + r * dim + d, bf16_load8_n(a->q + off + d, VL));
                    orow[r] = a->out + off;
                }
                attend_tile(a, qf, kf, vf, rows, lo, limit, a->sinks ? a->sinks + h * group + g0 : NULL, s, padded,
                            orow);
            }
        }
    }
}
