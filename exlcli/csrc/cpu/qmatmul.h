// qmatmul.c's entry for the other C files (not a kernel of its own: Python never calls it).
#pragma once
#include <stdint.h>

#include "args.h"

// The products of x [rows, K] (bf16) with each part's weights (their x, rows, y and y_fp32 fields unused),
// side by side in y [rows, ldy] (bf16) from its column 0, x quantized once and the parts' column groups
// shared among the pool's threads as one job: the same bits as one exl_qmatmul per part. Returns 0, -1
// without scratch memory, 6 on a bad shape, or 1 where this build has no such path (the AVX2 body only):
// then call exl_qmatmul per part.
__attribute__((visibility("hidden"))) int qmatmul_parts(const exl_qmatmul_args *parts, int64_t n_parts,
                                                        const uint16_t *x, int64_t rows, uint16_t *y, int64_t ldy);

// One block of rows of a grouped product: x's rows row0 .. row0 + rows - 1 times the weights of n_parts parts,
// their outputs side by side in y [rows, ldy] (bf16) from its column 0.
typedef struct {
    const exl_qmatmul_args *parts;  // their x, rows, y and y_fp32 fields unused
    int64_t n_parts;
    int64_t row0;
    int64_t rows;
    uint16_t *y;
    int64_t ldy;
} qmm_group;

// Every block's products, x [rows, K] (bf16) quantized once and all the blocks' column groups shared among the
// pool's threads as one job: each block's weights are read once for all its rows, and each row's outputs are the
// bits of one exl_qmatmul of its block. Returns 0, -1 without scratch memory, 6 on a bad shape, or 1 where this
// build has no such path (the AVX2 body only).
__attribute__((visibility("hidden"))) int qmatmul_grouped(const qmm_group *groups, int64_t n_groups,
                                                          const uint16_t *x, int64_t rows, int64_t K);
