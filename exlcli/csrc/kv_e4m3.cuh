// The fp8 KV cache (--kv-cache-dtype fp8): K and V stored as e4m3 bytes with no scale, as vLLM's
// fp8 cache stores them with its default scale of 1. A value is first rounded to the activations'
// dtype T (the value a T cache would hold), then to the nearest e4m3, saturating at +-448: the
// reference (exlcli/ops/rope.py, to_cache_dtype) clamps and casts the same T values, so the bytes
// match. Reading back is exact: every e4m3 value is a bf16 and an fp16 value. (ops.h's
// is_e4m3_cache tells such a cache tensor on the host.)
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>
#include <type_traits>

#include "common.cuh"

namespace exlcli {

// The e4m3 byte of a T value (saturating, round to nearest even).
template <typename T>
__device__ __forceinline__ uint8_t e4m3_of(T x) {
  return static_cast<uint8_t>(__nv_cvt_float_to_fp8(to_float(x), __NV_SATFINITE, __NV_E4M3));
}

// Two e4m3 bytes (the first in the low byte) as a packed pair of T, the first in the low half.
template <typename T>
__device__ __forceinline__ uint32_t e4m3x2_as(uint16_t pair) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(pair), __NV_E4M3);
  if constexpr (std::is_same_v<T, __half>) {
    return static_cast<uint32_t>(h.x) | (static_cast<uint32_t>(h.y) << 16);
  } else {
    static_assert(std::is_same_v<T, __nv_bfloat16>, "e4m3 pairs read as fp16 or bf16");
    const float2 f = __half22float2(__half2(h));  // exact, and so is the bf16 of an e4m3 value
    const __nv_bfloat162 b = __floats2bfloat162_rn(f.x, f.y);
    return *reinterpret_cast<const uint32_t*>(&b);
  }
}

}  // namespace exlcli
