// Rotary embedding (rotate-half form) of q and k, fused with writing k and v into their KV pages.
// The rotation uses the same rounded fp32 products as exlcli/ops/rope.py (no fused multiply-add),
// so the rotated values match the torch reference bit for bit. The caches hold T, or e4m3 bytes
// (kv_e4m3.cuh) of the same T values.
#include <ATen/ops/empty.h>

#include "common.cuh"
#include "kv_e4m3.cuh"
#include "ops.h"

namespace exlcli {
namespace {

// A T value as a cache of C holds it: C is T, or uint8_t for e4m3 bytes.
template <typename C, typename T>
__device__ __forceinline__ C cached(T x) {
  if constexpr (std::is_same_v<C, T>) {
    return x;
  } else {
    return e4m3_of(x);
  }
}

template <typename T, typename C>
__device__ __forceinline__ void rotate(const T* src, C* dst, int j, int half, float c, float s) {
  const float x1 = to_float(src[j]), x2 = to_float(src[j + half]);
  dst[j] = cached<C>(from_float<T>(__fsub_rn(__fmul_rn(x1, c), __fmul_rn(x2, s))));
  dst[j + half] = cached<C>(from_float<T>(__fadd_rn(__fmul_rn(x2, c), __fmul_rn(x1, s))));
}

constexpr int kHeadsPerBlock = 8;  // a warp per head: fewer, fuller blocks than one per (token, head)

// Warp w of block (t, y) takes head y * kHeadsPerBlock + w of token t: heads below num_heads
// rotate a query head, the others rotate one kv head of k and copy the same head of v into the
// pages. A negative slot (a padded row of a captured decode graph) skips the write.
template <typename T, typename C>
__global__ void __launch_bounds__(32 * kHeadsPerBlock)
rope_and_write_kv_kernel(T* __restrict__ q_out, const T* __restrict__ q, int64_t q_stride,
                         const T* __restrict__ k, int64_t k_stride,
                         const T* __restrict__ v, int64_t v_stride,
                         const int64_t* __restrict__ positions,
                         const float* __restrict__ cos_sin, int64_t cs_stride,
                         C* __restrict__ k_cache, C* __restrict__ v_cache,
                         const int64_t* __restrict__ slots, int num_heads, int num_kv_heads,
                         int head_dim) {
  grid_dependency_wait();  // launched with launch_pdl: the previous kernel may still run
  grid_dependents_launch();
  const int64_t t = blockIdx.x;
  const int head = blockIdx.y * kHeadsPerBlock + threadIdx.y;
  if (head >= num_heads + num_kv_heads) return;
  const int lane = threadIdx.x;
  const int half = head_dim / 2;
  const float* cs = cos_sin + positions[t] * cs_stride;  // cos in [0, half), sin in [half, D)
  if (head < num_heads) {
    const T* src = q + t * q_stride + head * head_dim;
    T* dst = q_out + (t * num_heads + head) * head_dim;
    for (int j = lane; j < half; j += 32) rotate(src, dst, j, half, cs[j], cs[half + j]);
    return;
  }
  const int64_t slot = slots[t];
  if (slot < 0) return;
  const int h = head - num_heads;
  C* kc = k_cache + (slot * num_kv_heads + h) * head_dim;
  C* vc = v_cache + (slot * num_kv_heads + h) * head_dim;
  const T* ks = k + t * k_stride + h * head_dim;
  const T* vs = v + t * v_stride + h * head_dim;
  for (int j = lane; j < half; j += 32) rotate(ks, kc, j, half, cs[j], cs[half + j]);
  for (int i = lane; i < head_dim; i += 32) vc[i] = cached<C>(vs[i]);
}

// [T, heads, D] whose heads and elements are packed (rows may be strided: views of a fused qkv).
void check_token_heads(const at::Tensor& x, const char* name, int64_t tokens, int64_t head_dim) {
  TORCH_CHECK(x.dim() == 3, "rope_and_write_kv: ", name, " must be [tokens, heads, head_dim], got ", x.sizes());
  TORCH_CHECK(x.size(0) == tokens && x.size(2) == head_dim, "rope_and_write_kv: ", name, " has shape ",
              x.sizes(), ", expected [", tokens, ", heads, ", head_dim, "]");
  TORCH_CHECK(x.stride(2) == 1 && x.stride(1) == head_dim, "rope_and_write_kv: ", name,
              " must have contiguous heads and elements");
}

}  // namespace

at::Tensor rope_and_write_kv(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             const at::Tensor& positions, const at::Tensor& cos_sin,
                             const at::Tensor& k_cache, const at::Tensor& v_cache,
                             const at::Tensor& slot_mapping, bool pdl) {
  for (const at::Tensor* t : {&q, &k, &v, &positions, &cos_sin, &k_cache, &v_cache, &slot_mapping}) {
    EXL_CHECK_CUDA_TENSOR(*t, "rope_and_write_kv: every input");
    TORCH_CHECK(t->device() == q.device(), "rope_and_write_kv: inputs are on different devices");
  }
  const int64_t tokens = q.size(0), head_dim = q.size(-1);
  TORCH_CHECK(head_dim % 2 == 0, "rope_and_write_kv: head_dim must be even, got ", head_dim);
  check_token_heads(q, "q", tokens, head_dim);
  check_token_heads(k, "k", tokens, head_dim);
  check_token_heads(v, "v", tokens, head_dim);
  TORCH_CHECK(k.size(1) == v.size(1), "rope_and_write_kv: k and v have different head counts");
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(),
              "rope_and_write_kv: q, k and v must share a dtype");
  for (const at::Tensor* c : {&k_cache, &v_cache}) {
    TORCH_CHECK(c->dim() == 4 && c->size(2) == k.size(1) && c->size(3) == head_dim,
                "rope_and_write_kv: caches must be [pages, page_size, ", k.size(1), ", ", head_dim, "], got ",
                c->sizes());
    TORCH_CHECK(c->is_contiguous(), "rope_and_write_kv: caches must be contiguous");
    TORCH_CHECK(c->scalar_type() == q.scalar_type() || (is_e4m3_cache(*c) && q.scalar_type() != at::kFloat),
                "rope_and_write_kv: cache dtype ", c->scalar_type(), " is neither q's dtype ", q.scalar_type(),
                " nor e4m3 beside 16-bit q");
  }
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes() && k_cache.scalar_type() == v_cache.scalar_type(),
              "rope_and_write_kv: k_cache and v_cache differ in shape or dtype");
  EXL_CHECK_DTYPE(positions, at::kLong, "rope_and_write_kv: positions");
  EXL_CHECK_DTYPE(slot_mapping, at::kLong, "rope_and_write_kv: slot_mapping");
  TORCH_CHECK(positions.dim() == 1 && positions.size(0) == tokens && positions.is_contiguous(),
              "rope_and_write_kv: positions must be a contiguous [", tokens, "]");
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.size(0) == tokens && slot_mapping.is_contiguous(),
              "rope_and_write_kv: slot_mapping must be a contiguous [", tokens, "]");
  EXL_CHECK_DTYPE(cos_sin, at::kFloat, "rope_and_write_kv: cos_sin");
  TORCH_CHECK(cos_sin.dim() == 2 && cos_sin.size(1) == head_dim && cos_sin.stride(1) == 1,
              "rope_and_write_kv: cos_sin must be [positions, ", head_dim, "] with contiguous rows");

  const c10::cuda::CUDAGuard guard(q.device());
  at::Tensor q_out = at::empty(q.sizes(), q.options().memory_format(at::MemoryFormat::Contiguous));
  if (tokens == 0) return q_out;
  EXL_DISPATCH_FLOAT(q.scalar_type(), "rope_and_write_kv", [&] {
    using T = scalar_t;
    const int heads = static_cast<int>(q.size(1) + k.size(1));
    const dim3 grid(static_cast<unsigned>(tokens), static_cast<unsigned>(ceil_div(heads, kHeadsPerBlock)));
    auto launch = [&](auto cache_type) {
      using C = decltype(cache_type);
      launch_pdl(rope_and_write_kv_kernel<T, C>, grid, dim3(32, kHeadsPerBlock), 0, current_stream(), pdl,
          static_cast<T*>(q_out.data_ptr()), static_cast<const T*>(q.data_ptr()), q.stride(0),
          static_cast<const T*>(k.data_ptr()), k.stride(0), static_cast<const T*>(v.data_ptr()), v.stride(0),
          positions.data_ptr<int64_t>(), cos_sin.data_ptr<float>(), cos_sin.stride(0),
          static_cast<C*>(k_cache.data_ptr()), static_cast<C*>(v_cache.data_ptr()), slot_mapping.data_ptr<int64_t>(),
          static_cast<int>(q.size(1)), static_cast<int>(k.size(1)), static_cast<int>(head_dim));
    };
    if constexpr (std::is_same_v<T, float>) {
      launch(T{});  // an e4m3 cache beside fp32 q was refused above
    } else if (is_e4m3_cache(k_cache)) {
      launch(uint8_t{});
    } else {
      launch(T{});
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return q_out;
}

}  // namespace exlcli
