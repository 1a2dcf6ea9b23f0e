// SiLU(gate) * up over a fused [T, 2I] gate|up projection -> [T, I].
// Rounding follows F.silu(gate) * up in the dtype: silu rounded, then the product rounded.
#include <ATen/ops/empty.h>

#include "common.cuh"
#include "ops.h"

namespace exlcli {
namespace {

// Grid-stride over chunks of VW elements of the output.
template <typename T, int VW>
__global__ void silu_and_mul_kernel(T* __restrict__ out, const T* __restrict__ x, int64_t x_stride,
                                    int inter, int64_t num_chunks) {
  grid_dependency_wait();  // launched with launch_pdl: the previous kernel may still run
  grid_dependents_launch();
  const int chunks_per_row = inter / VW;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < num_chunks;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t row = i / chunks_per_row;
    const int col = static_cast<int>(i % chunks_per_row) * VW;
    const T* gate = x + row * x_stride + col;
    const T* up = gate + inter;
    T* dst = out + row * inter + col;
    if constexpr (VW == Vec<T>::N) {
      const Vec<T> g = load_vec(gate), u = load_vec(up);
      Vec<T> o;
#pragma unroll
      for (int e = 0; e < VW; ++e) o.v[e] = silu_mul(g.v[e], u.v[e]);
      store_vec(dst, o);
    } else {
      dst[0] = silu_mul(gate[0], up[0]);
    }
  }
}

}  // namespace

at::Tensor silu_and_mul(const at::Tensor& x, bool pdl) {
  EXL_CHECK_CUDA_TENSOR(x, "silu_and_mul: x");
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) % 2 == 0, "silu_and_mul: last dim must be even, got ", x.sizes());
  const c10::cuda::CUDAGuard guard(x.device());
  const at::Tensor x2 = (x.dim() == 2 && x.stride(1) == 1) ? x : x.contiguous().view({-1, x.size(-1)});
  const int inter = static_cast<int>(x.size(-1) / 2);
  auto sizes = x.sizes().vec();
  sizes.back() = inter;
  at::Tensor out = at::empty(sizes, x.options().memory_format(at::MemoryFormat::Contiguous));
  const int64_t rows = x2.size(0);
  if (rows == 0 || inter == 0) return out;
  EXL_DISPATCH_FLOAT(x.scalar_type(), "silu_and_mul", [&] {
    using T = scalar_t;
    constexpr int VW = Vec<T>::N;
    const T* src = static_cast<const T*>(x2.data_ptr());
    T* dst = static_cast<T*>(out.data_ptr());
    const bool vec_ok = inter % VW == 0 && x2.stride(0) % VW == 0 && aligned16(src);
    const int chunk = vec_ok ? VW : 1;
    const int64_t num_chunks = rows * (inter / chunk);
    const int threads = 256;
    const int64_t blocks = std::min<int64_t>((num_chunks + threads - 1) / threads, 1 << 16);
    if (vec_ok) {
      launch_pdl(silu_and_mul_kernel<T, VW>, dim3(blocks), dim3(threads), 0, current_stream(), pdl, dst, src,
                 x2.stride(0), inter, num_chunks);
    } else {
      launch_pdl(silu_and_mul_kernel<T, 1>, dim3(blocks), dim3(threads), 0, current_stream(), pdl, dst, src,
                 x2.stride(0), inter, num_chunks);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

}  // namespace exlcli
