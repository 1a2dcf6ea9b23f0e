// RMSNorm, alone and fused with the residual add, writing bf16 rows or (for FP8 products) e4m3 rows
// with a scale per row (e4m3_rows.cuh). One block per row; the row stays in registers.
//
// Rounding follows the torch reference (exlcli/ops/norm.py): the residual sum is rounded to the
// dtype, the normalised row is rounded to the dtype before the weight multiply.
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>

#include <type_traits>

#include "common.cuh"
#include "e4m3_rows.cuh"
#include "ops.h"

namespace exlcli {
namespace {

constexpr int kMaxChunksPerThread = 4;
constexpr int kPrefetchWeightRows = 4;  // the rows up to which a block prefetches the weight (see the kernel)

template <typename T, int VW>
__device__ __forceinline__ void load_chunk(const T* p, float (&dst)[VW]) {
  if constexpr (VW == Vec<T>::N) {
    const Vec<T> x = load_vec(p);
#pragma unroll
    for (int e = 0; e < VW; ++e) dst[e] = to_float(x.v[e]);
  } else {
#pragma unroll
    for (int e = 0; e < VW; ++e) dst[e] = to_float(p[e]);
  }
}

template <typename T, int VW>
__device__ __forceinline__ void store_chunk(T* p, const float (&src)[VW]) {
  if constexpr (VW == Vec<T>::N) {
    Vec<T> x;
#pragma unroll
    for (int e = 0; e < VW; ++e) x.v[e] = from_float<T>(src[e]);
    store_vec(p, x);
  } else {
#pragma unroll
    for (int e = 0; e < VW; ++e) p[e] = from_float<T>(src[e]);
  }
}

// out[row] = weight * round(r * rsqrt(mean(r^2) + eps)), r = x[row] (+ residual[row], rounded and
// written to residual_out[row] when ADD). Chunks of VW elements; chunk c of a row goes to thread
// c % blockDim.x, so the reduction order depends only on the row length. With E4M3 (bf16, VW 8) the
// row, rounded to bf16, is written as e4m3 to q[row] with its scale in q_scale[row] instead of to out.
template <typename T, int VW, bool ADD, bool E4M3 = false>
__global__ void rms_norm_kernel(T* __restrict__ out, T* __restrict__ residual_out,
                                const T* __restrict__ x, int64_t x_stride,
                                const T* __restrict__ residual, int64_t res_stride,
                                const T* __restrict__ weight, int hidden, float eps,
                                uint8_t* __restrict__ q, float* __restrict__ q_scale, bool prefetch_weight) {
  static_assert(!E4M3 || (VW == 8 && std::is_same_v<T, __nv_bfloat16>), "e4m3 rows come from bf16 chunks of 8");
  const int num_chunks = hidden / VW;
  // The weight does not depend on the previous kernel, so with few rows L1 is asked for it before
  // waiting for that kernel: it has usually left L2 since the last step, and its load would otherwise
  // wait for memory after the sum of squares. A 32-layer chain of 4-bit products at one token takes
  // 1.613-1.614 ms instead of 1.633-1.637 on an H100. With 64 rows every block asking for the same
  // lines makes that chain 0.3-0.9% slower, hence the row limit. (The weight is not held in registers
  // across the wait: that takes 64+ registers a thread instead of 54, and spills.)
  if (prefetch_weight) {
#pragma unroll
    for (int i = 0; i < kMaxChunksPerThread; ++i) {
      const int c = threadIdx.x + i * blockDim.x;
      if (c < num_chunks) asm volatile("prefetch.global.L1 [%0];" ::"l"(weight + c * VW));
    }
  }
  grid_dependency_wait();  // launched with launch_pdl: the previous kernel may still run
  grid_dependents_launch();
  __shared__ float scratch[32];
  const int64_t row = blockIdx.x;
  float vals[kMaxChunksPerThread][VW];
  float sumsq = 0.f;
#pragma unroll
  for (int i = 0; i < kMaxChunksPerThread; ++i) {
    const int c = threadIdx.x + i * blockDim.x;
    if (c < num_chunks) {
      load_chunk<T, VW>(x + row * x_stride + c * VW, vals[i]);
      if constexpr (ADD) {
        float r[VW];
        load_chunk<T, VW>(residual + row * res_stride + c * VW, r);
#pragma unroll
        for (int e = 0; e < VW; ++e) vals[i][e] = round_to<T>(vals[i][e] + r[e]);
        store_chunk<T, VW>(residual_out + row * hidden + c * VW, vals[i]);
      }
#pragma unroll
      for (int e = 0; e < VW; ++e) sumsq = fmaf(vals[i][e], vals[i][e], sumsq);
    }
  }
  const float total = block_sum(sumsq, scratch);
  const float inv = rsqrtf(total * (1.f / hidden) + eps);
  float amax = 0.f;
#pragma unroll
  for (int i = 0; i < kMaxChunksPerThread; ++i) {
    const int c = threadIdx.x + i * blockDim.x;
    if (c < num_chunks) {
      float w[VW];
      load_chunk<T, VW>(weight + c * VW, w);
      float y[VW];
#pragma unroll
      for (int e = 0; e < VW; ++e) y[e] = w[e] * round_to<T>(vals[i][e] * inv);
      if constexpr (E4M3) {
#pragma unroll
        for (int e = 0; e < VW; ++e) {
          vals[i][e] = round_to<T>(y[e]);
          amax = fmaxf(amax, fabsf(vals[i][e]));
        }
      } else {
        store_chunk<T, VW>(out + row * hidden + c * VW, y);
      }
    }
  }
  if constexpr (E4M3) {
    amax = block_max(amax, scratch);
    const float q_inv = e4m3_inverse_scale(amax);
    if (threadIdx.x == 0) q_scale[row] = e4m3_scale(amax);
#pragma unroll
    for (int i = 0; i < kMaxChunksPerThread; ++i) {
      const int c = threadIdx.x + i * blockDim.x;
      if (c < num_chunks) *reinterpret_cast<uint2*>(q + row * hidden + c * VW) = e4m3x8(vals[i], q_inv);
    }
  }
}

// [rows, hidden] with a contiguous last dim (a copy only when the leading dims do not flatten).
at::Tensor as_rows(const at::Tensor& x) {
  if (x.dim() == 2 && x.stride(1) == 1) return x;
  return x.contiguous().view({-1, x.size(-1)});
}

template <typename T, bool ADD>
void launch_rms_norm(const at::Tensor& out, const at::Tensor& residual_out, const at::Tensor& x2,
                     const at::Tensor& r2, const at::Tensor& weight, double eps, bool pdl) {
  const int64_t rows = x2.size(0);
  const int hidden = static_cast<int>(x2.size(1));
  if (rows == 0) return;
  constexpr int VW = Vec<T>::N;
  const T* x = static_cast<const T*>(x2.data_ptr());
  const T* r = ADD ? static_cast<const T*>(r2.data_ptr()) : nullptr;
  bool vec_ok = hidden % VW == 0 && aligned16(x) && x2.stride(0) % VW == 0 && aligned16(weight.data_ptr());
  if (ADD) vec_ok = vec_ok && aligned16(r) && r2.stride(0) % VW == 0;
  const int chunk = vec_ok ? VW : 1;
  const int num_chunks = hidden / chunk;
  const int threads = std::min(1024, std::max(32, ceil_div(num_chunks, 32) * 32));
  TORCH_CHECK(num_chunks <= threads * kMaxChunksPerThread, "rms_norm: rows of ", hidden,
              " elements are longer than this kernel supports");
  const dim3 grid(static_cast<unsigned>(rows));
  T* o = static_cast<T*>(out.data_ptr());
  T* ro = ADD ? static_cast<T*>(residual_out.data_ptr()) : nullptr;
  const T* w = static_cast<const T*>(weight.data_ptr());
  const int64_t rs = ADD ? r2.stride(0) : 0;
  if (vec_ok) {
    launch_pdl(rms_norm_kernel<T, VW, ADD>, grid, dim3(threads), 0, current_stream(), pdl, o, ro, x, x2.stride(0), r,
               rs, w, hidden, static_cast<float>(eps), static_cast<uint8_t*>(nullptr), static_cast<float*>(nullptr),
               rows <= kPrefetchWeightRows);
  } else {
    launch_pdl(rms_norm_kernel<T, 1, ADD>, grid, dim3(threads), 0, current_stream(), pdl, o, ro, x, x2.stride(0), r,
               rs, w, hidden, static_cast<float>(eps), static_cast<uint8_t*>(nullptr), static_cast<float*>(nullptr),
               rows <= kPrefetchWeightRows);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// The rows of x2 (+ r2 when ADD) normalised into e4m3 q [rows, hidden] and scale [rows] (bf16, hidden
// a multiple of 8, 16-byte aligned rows: the callers check).
template <bool ADD>
void launch_rms_norm_e4m3(const at::Tensor& q, const at::Tensor& scale, const at::Tensor& residual_out,
                          const at::Tensor& x2, const at::Tensor& r2, const at::Tensor& weight, double eps, bool pdl) {
  using T = __nv_bfloat16;
  const int64_t rows = x2.size(0);
  const int hidden = static_cast<int>(x2.size(1));
  if (rows == 0) return;
  const int num_chunks = hidden / 8;
  const int threads = std::min(1024, std::max(32, ceil_div(num_chunks, 32) * 32));
  TORCH_CHECK(num_chunks <= threads * kMaxChunksPerThread, "rms_norm: rows of ", hidden,
              " elements are longer than this kernel supports");
  launch_pdl(rms_norm_kernel<T, 8, ADD, true>, dim3(static_cast<unsigned>(rows)), dim3(threads), 0, current_stream(),
             pdl, static_cast<T*>(nullptr), ADD ? static_cast<T*>(residual_out.data_ptr()) : static_cast<T*>(nullptr),
             static_cast<const T*>(x2.data_ptr()), x2.stride(0),
             ADD ? static_cast<const T*>(r2.data_ptr()) : static_cast<const T*>(nullptr),
             ADD ? r2.stride(0) : int64_t{0}, static_cast<const T*>(weight.data_ptr()), hidden,
             static_cast<float>(eps), static_cast<uint8_t*>(q.data_ptr()), scale.data_ptr<float>(),
             rows <= kPrefetchWeightRows);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void check_norm_inputs(const at::Tensor& x, const at::Tensor& weight) {
  EXL_CHECK_CUDA_TENSOR(x, "rms_norm: x");
  EXL_CHECK_CUDA_TENSOR(weight, "rms_norm: weight");
  TORCH_CHECK(x.device() == weight.device(), "rms_norm: x and weight are on different devices");
  TORCH_CHECK(x.dim() >= 1, "rms_norm: x must have at least one dimension");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(-1), "rms_norm: weight must be [",
              x.size(-1), "], got ", weight.sizes());
  TORCH_CHECK(weight.is_contiguous(), "rms_norm: weight must be contiguous");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), "rms_norm: weight dtype ", weight.scalar_type(),
              " differs from x dtype ", x.scalar_type());
}

}  // namespace

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, bool pdl) {
  check_norm_inputs(x, weight);
  const c10::cuda::CUDAGuard guard(x.device());
  const at::Tensor x2 = as_rows(x);
  at::Tensor out = at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
  EXL_DISPATCH_FLOAT(x.scalar_type(), "rms_norm", [&] {
    launch_rms_norm<scalar_t, false>(out, out, x2, x2, weight, eps, pdl);
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> fused_add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                      const at::Tensor& weight, double eps, bool pdl) {
  check_norm_inputs(x, weight);
  EXL_CHECK_CUDA_TENSOR(residual, "fused_add_rms_norm: residual");
  TORCH_CHECK(residual.sizes() == x.sizes(), "fused_add_rms_norm: residual shape ", residual.sizes(),
              " differs from x shape ", x.sizes());
  TORCH_CHECK(residual.scalar_type() == x.scalar_type(), "fused_add_rms_norm: residual dtype differs from x");
  TORCH_CHECK(residual.device() == x.device(), "fused_add_rms_norm: residual is on another device");
  const c10::cuda::CUDAGuard guard(x.device());
  const at::Tensor x2 = as_rows(x), r2 = as_rows(residual);
  const auto opts = x.options().memory_format(at::MemoryFormat::Contiguous);
  at::Tensor out = at::empty(x.sizes(), opts);
  at::Tensor residual_out = at::empty(x.sizes(), opts);
  EXL_DISPATCH_FLOAT(x.scalar_type(), "fused_add_rms_norm", [&] {
    launch_rms_norm<scalar_t, true>(out, residual_out, x2, r2, weight, eps, pdl);
  });
  return {out, residual_out};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> rms_norm_e4m3(const at::Tensor& x,
                                                            const std::optional<at::Tensor>& residual,
                                                            const at::Tensor& weight, double eps, bool pdl) {
  check_norm_inputs(x, weight);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous() && aligned16(x.data_ptr()) &&
                  x.size(1) % 8 == 0 && aligned16(weight.data_ptr()),
              "rms_norm_e4m3: x must be a contiguous, 16-byte aligned bfloat16 [rows, hidden] with hidden a "
              "multiple of 8");
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor q = at::empty(x.sizes(), x.options().dtype(at::kFloat8_e4m3fn));
  at::Tensor scale = at::empty({x.size(0), 1}, x.options().dtype(at::kFloat));
  if (!residual.has_value()) {
    launch_rms_norm_e4m3<false>(q, scale, x, x, x, weight, eps, pdl);
    return {q, scale, x};
  }
  const at::Tensor& r = *residual;
  TORCH_CHECK(r.sizes() == x.sizes() && r.scalar_type() == x.scalar_type() && r.device() == x.device() &&
                  r.is_contiguous() && aligned16(r.data_ptr()),
              "rms_norm_e4m3: residual must be a contiguous, 16-byte aligned bfloat16 tensor shaped like x");
  at::Tensor residual_out = at::empty_like(x);
  launch_rms_norm_e4m3<true>(q, scale, residual_out, x, r, weight, eps, pdl);
  return {q, scale, residual_out};
}

}  // namespace exlcli
