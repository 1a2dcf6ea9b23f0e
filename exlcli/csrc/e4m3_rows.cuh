// Rows quantized per row to e4m3 for the FP8 products (exlcli/ops/formats/cuda_fp8.py): scale =
// amax(|row|) / 448 (the largest finite e4m3), q = x * (448 / amax) rounded to nearest e4m3 with
// saturation; a row of zeros takes amax = kMinAmax, so its scale is not zero. fp8_quant.cu quantizes
// bf16 rows; norm.cu and activation.cu quantize the rows they compute, each value first rounded to
// bf16 as their unfused forms would write it, so both give the same bytes. The torch reference is
// quantize_rows_reference in cuda_fp8.py, bit for bit. (block_max, their reduction, is common.cuh's.)
#pragma once

#include <cuda_fp8.h>

#include <cstdint>

namespace exlcli {

constexpr float kE4m3Max = 448.0f;
constexpr float kMinAmax = 1e-12f;  // cuda_fp8.py's MIN_AMAX

// 448 / amax for a row whose largest |value| is `amax` (kMinAmax for a row of zeros); the row's
// scale is then e4m3_scale(amax).
__device__ __forceinline__ float e4m3_inverse_scale(float amax) { return kE4m3Max / fmaxf(amax, kMinAmax); }
__device__ __forceinline__ float e4m3_scale(float amax) { return fmaxf(amax, kMinAmax) / kE4m3Max; }

// Eight values times `inv`, as eight e4m3 bytes in order.
__device__ __forceinline__ uint2 e4m3x8(const float (&v)[8], float inv) {
  uint32_t w[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const uint32_t lo =
        __nv_cvt_float2_to_fp8x2(make_float2(v[4 * i] * inv, v[4 * i + 1] * inv), __NV_SATFINITE, __NV_E4M3);
    const uint32_t hi =
        __nv_cvt_float2_to_fp8x2(make_float2(v[4 * i + 2] * inv, v[4 * i + 3] * inv), __NV_SATFINITE, __NV_E4M3);
    w[i] = lo | (hi << 16);
  }
  return make_uint2(w[0], w[1]);
}

}  // namespace exlcli
