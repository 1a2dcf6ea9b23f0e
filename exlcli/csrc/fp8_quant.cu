// Activations quantized per row (token) to e4m3 for the FP8 products of exlcli/ops/formats/cuda_fp8.py
// (torch._scaled_mm with a scale per token and one per weight row): scale = amax(|row|) / 448 (the
// largest finite e4m3), q = x * (448 / amax) rounded to nearest e4m3 with saturation. A row of zeros
// takes amax = kMinAmax, so its scale is not zero. The torch reference is quantize_rows_reference in
// cuda_fp8.py, bit for bit.
#include <ATen/ops/empty.h>
#include <cuda_fp8.h>

#include "common.cuh"
#include "ops.h"

namespace exlcli {
namespace {

constexpr int kThreads = 256;
constexpr float kE4m3Max = 448.0f;
constexpr float kMinAmax = 1e-12f;

// One block per row: the row's amax (16-byte loads), then the quantized row, 8 elements a thread.
__global__ void __launch_bounds__(kThreads) quantize_rows_kernel(const __nv_bfloat16* __restrict__ x,
                                                                  __nv_fp8_e4m3* __restrict__ q,
                                                                  float* __restrict__ scale, int k) {
  __shared__ float s_warp[kThreads / 32];
  grid_dependency_wait();
  grid_dependents_launch();
  const int64_t row = blockIdx.x;
  const uint4* xr = reinterpret_cast<const uint4*>(x + row * k);
  const int chunks = k / 8;
  float amax = 0.f;
  for (int c = threadIdx.x; c < chunks; c += kThreads) {
    const uint4 v = xr[c];
    const __nv_bfloat16* e = reinterpret_cast<const __nv_bfloat16*>(&v);
#pragma unroll
    for (int i = 0; i < 8; ++i) amax = fmaxf(amax, fabsf(__bfloat162float(e[i])));
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));
  if ((threadIdx.x & 31) == 0) s_warp[threadIdx.x >> 5] = amax;
  __syncthreads();
  amax = kMinAmax;
#pragma unroll
  for (int w = 0; w < kThreads / 32; ++w) amax = fmaxf(amax, s_warp[w]);
  const float inv = kE4m3Max / amax;
  if (threadIdx.x == 0) scale[row] = amax / kE4m3Max;
  uint2* qr = reinterpret_cast<uint2*>(q + row * k);
  for (int c = threadIdx.x; c < chunks; c += kThreads) {
    const uint4 v = xr[c];
    const __nv_bfloat162* e = reinterpret_cast<const __nv_bfloat162*>(&v);
    uint32_t out[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const float2 a = __bfloat1622float2(e[2 * i]), b = __bfloat1622float2(e[2 * i + 1]);
      const uint32_t lo = __nv_cvt_float2_to_fp8x2(make_float2(a.x * inv, a.y * inv), __NV_SATFINITE, __NV_E4M3);
      const uint32_t hi = __nv_cvt_float2_to_fp8x2(make_float2(b.x * inv, b.y * inv), __NV_SATFINITE, __NV_E4M3);
      out[i] = lo | (hi << 16);
    }
    qr[c] = make_uint2(out[0], out[1]);
  }
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> quantize_rows_e4m3(const at::Tensor& x, bool pdl) {
  EXL_CHECK_CUDA_TENSOR(x, "quantize_rows_e4m3: x");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous() && aligned16(x.data_ptr()) &&
                  x.size(1) % 8 == 0,
              "quantize_rows_e4m3: x must be a contiguous, 16-byte aligned bfloat16 [m, k] with k a multiple of 8");
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t m = x.size(0), k = x.size(1);
  at::Tensor q = at::empty({m, k}, x.options().dtype(at::kFloat8_e4m3fn));
  at::Tensor scale = at::empty({m, 1}, x.options().dtype(at::kFloat));
  if (m == 0) return {q, scale};
  launch_pdl(quantize_rows_kernel, dim3(static_cast<unsigned>(m)), dim3(kThreads), 0, current_stream(), pdl,
             static_cast<const __nv_bfloat16*>(x.data_ptr()), static_cast<__nv_fp8_e4m3*>(q.data_ptr()),
             scale.data_ptr<float>(), static_cast<int>(k));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {q, scale};
}

}  // namespace exlcli
