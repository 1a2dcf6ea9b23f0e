// Activations quantized per row (token) to e4m3 for the FP8 products of exlcli/ops/formats/cuda_fp8.py
// (the form and its reference: e4m3_rows.cuh).
#include <ATen/ops/empty.h>
#include <cuda_fp8.h>

#include "common.cuh"
#include "e4m3_rows.cuh"
#include "ops.h"

namespace exlcli {
namespace {

constexpr int kThreads = 256;

// One block per row: the row's amax (16-byte loads), then the quantized row, 8 elements a thread.
__global__ void __launch_bounds__(kThreads) quantize_rows_kernel(const __nv_bfloat16* __restrict__ x,
                                                                  __nv_fp8_e4m3* __restrict__ q,
                                                                  float* __restrict__ scale, int k) {
  __shared__ float s_warp[32];
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
  amax = block_max(amax, s_warp);
  const float inv = e4m3_inverse_scale(amax);
  if (threadIdx.x == 0) scale[row] = e4m3_scale(amax);
  uint2* qr = reinterpret_cast<uint2*>(q + row * k);
  for (int c = threadIdx.x; c < chunks; c += kThreads) {
    const uint4 v = xr[c];
    const __nv_bfloat16* e = reinterpret_cast<const __nv_bfloat16*>(&v);
    float f[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) f[i] = __bfloat162float(e[i]);
    qr[c] = e4m3x8(f, inv);
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
