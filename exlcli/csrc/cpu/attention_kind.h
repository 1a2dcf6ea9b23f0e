// A layer's attention kind as the CPU attention kernels take it (ops/attention.py states it):
// a window W (a query at position p sees keys > p - W), a soft-cap c (each scaled score s becomes
// c * tanh(s / c), before the mask) and sinks (one logit a query head, added to the softmax's
// denominator with no value; the max is taken over the scores and the sink). Scalar parts only.
#pragma once
#include <math.h>
#include <stdint.h>

// The first key a row of `limit` keys (a query at position limit - 1) sees.
static inline int64_t kind_first_key(int64_t window, int64_t limit) {
    return window > 0 && limit > window ? limit - window : 0;
}

// s[lo, limit) -> cap * tanh(s / cap) when the layer has a soft-cap (cap > 0).
static inline void kind_soft_cap(float *s, int64_t lo, int64_t limit, float cap) {
    if (cap > 0.0f)
        for (int64_t j = lo; j < limit; j++) s[j] = cap * tanhf(s[j] / cap);
}
