// Greedy picks on the CPU (exlcli/ops/argmax.py): each fp32 logits row's argmax and whether the row is
// fit to sample from, in one call, where torch's six ops (argmax, amax, isfinite, not, a cast and a cat)
// take about 150 us on one thread for a row of 32,000 logits (argmax alone 100 us): 3-5% of a small
// model's decode step. The values are argmax_and_nonfinite_ref's:
//   id   = the first index of the row's largest value; a NaN counts as larger than anything (torch.argmax
//          takes the first NaN), so a row with a NaN gives its first NaN's index;
//   flag = 1 when the row's max (amax: NaN if it holds one) is not finite: a NaN, a +Inf, or no finite
//          value at all (every entry -Inf); else 0.
// Two passes over a row: its max over the non-NaN values with a NaN seen or not, then the first index
// of that max (or of the first NaN). Each row depends on itself only (batch-invariant).

#include <math.h>
#include <stdint.h>

#include "args.h"
#include "pool.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

int exl_argmax_available(void) { return 1; }

// The row's largest non-NaN value (-Inf when none), and whether it holds a NaN.
static float row_max(const float *x, int64_t n, int *has_nan) {
    int64_t i = 0;
    float m = -INFINITY;
    int nan = 0;
#if defined(__AVX2__)
    __m256 vmax = _mm256_set1_ps(-INFINITY), vnan = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) {
        __m256 v = _mm256_loadu_ps(x + i);
        vnan = _mm256_or_ps(vnan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        vmax = _mm256_max_ps(v, vmax);  // a NaN in v gives the second operand: NaNs are left out
    }
    nan = _mm256_movemask_ps(vnan) != 0;
    float lanes[8];
    _mm256_storeu_ps(lanes, vmax);
    for (int l = 0; l < 8; l++) m = lanes[l] > m ? lanes[l] : m;
#endif
    for (; i < n; i++) {
        if (x[i] != x[i]) nan = 1;
        else if (x[i] > m) m = x[i];
    }
    *has_nan = nan;
    return m;
}

// The first index whose value is `m` (nan: the first NaN); n when none.
static int64_t first_index(const float *x, int64_t n, float m, int nan) {
    int64_t i = 0;
#if defined(__AVX2__)
    __m256 vm = _mm256_set1_ps(m);
    for (; i + 8 <= n; i += 8) {
        __m256 v = _mm256_loadu_ps(x + i);
        int hits = _mm256_movemask_ps(nan ? _mm256_cmp_ps(v, v, _CMP_UNORD_Q) : _mm256_cmp_ps(v, vm, _CMP_EQ_OQ));
        if (hits) return i + __builtin_ctz((unsigned)hits);
    }
#endif
    for (; i < n; i++)
        if (nan ? x[i] != x[i] : x[i] == m) return i;
    return n;
}

static void pick_rows(void *ctx, int64_t begin, int64_t end) {
    const exl_argmax_args *a = (const exl_argmax_args *)ctx;
    for (int64_t r = begin; r < end; r++) {
        const float *x = a->logits + r * a->stride;
        int nan;
        float m = row_max(x, a->vocab, &nan);
        a->out[r] = first_index(x, a->vocab, m, nan);
        a->out[a->rows + r] = nan || isinf(m);
    }
}

// Returns 0; 6 sizes that do not fit together.
int exl_argmax(const exl_argmax_args *a) {
    if (a->rows < 0 || a->vocab < 1 || a->stride < a->vocab) return 6;
    // many rows: the pool shares them (one row of a large vocabulary is a few microseconds)
    if (a->rows > 1 && a->rows * a->vocab >= 1 << 20) exl_parallel_for(pick_rows, (void *)a, a->rows);
    else pick_rows((void *)a, 0, a->rows);
    return 0;
}
