// Decode linear layers (1 to 4 token rows, bf16 / fp16) on the kernel of decode_gemv.cuh:
// decode_linear (the plain product when no fused stage is asked for) and decode_qkv_rope. cuBLAS
// reaches 1.1 to 3.3 TB/s on these shapes at one row (measured on the H200).
//
// The inputs are checked in Python (exlcli/ops/cuda/checks.py) before these run; the checks here
// only guard against a call that bypasses that layer.
#include <ATen/ops/empty.h>
#include <cuda_runtime.h>

#include "common.cuh"
#include "decode_gemv.cuh"
#include "ops.h"

namespace exlcli {
namespace {

// x's rows as a pointer and row stride the kernel can read with 16-byte loads (a copy otherwise).
at::Tensor loadable_rows(const at::Tensor& x) {
  const int64_t vw = 16 / x.element_size();
  if (x.dim() == 2 && x.stride(1) == 1 && x.stride(0) % vw == 0 && aligned16(x.data_ptr())) return x;
  return x.contiguous();
}

void check_weight(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                  const std::optional<at::Tensor>& weight_scale, int64_t k) {
  EXL_CHECK_CUDA_TENSOR(x, "decode linear: x");
  EXL_CHECK_CUDA_TENSOR(weight, "decode linear: weight");
  TORCH_CHECK(x.device() == weight.device(), "decode linear: x and weight are on different devices");
  TORCH_CHECK(x.dim() == 2 && x.size(0) >= 1 && x.size(0) <= 4, "decode linear: x must be [1 to 4, k]");
  TORCH_CHECK(weight.dim() == 2 && weight.size(1) == k, "decode linear: weight must be [n, ", k, "]");
  if (weight_scale.has_value()) {
    TORCH_CHECK(x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kFloat8_e4m3fn,
                "decode linear: a weight scale goes with float8_e4m3fn weights and bfloat16 x");
    TORCH_CHECK(k % 16 == 0, "decode linear: e4m3 weight rows must be a multiple of 16 elements");
    TORCH_CHECK(weight_scale->is_cuda() && weight_scale->device() == x.device() && weight_scale->dim() == 1 &&
                    weight_scale->size(0) == weight.size(0) && weight_scale->is_contiguous() &&
                    weight_scale->scalar_type() == at::kFloat,
                "decode linear: weight_scale must be a contiguous float32 [", weight.size(0), "]");
  } else {
    TORCH_CHECK(x.scalar_type() == weight.scalar_type() &&
                    (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf),
                "decode linear: x and weight must both be bfloat16 or both float16");
  }
  TORCH_CHECK(k % 8 == 0 && weight.is_contiguous() && aligned16(weight.data_ptr()),
              "decode linear: weight must be contiguous with rows a multiple of 8 elements");
  if (bias.has_value()) {
    TORCH_CHECK(bias->is_cuda() && bias->dim() == 1 && bias->size(0) == weight.size(0) && bias->is_contiguous() &&
                    bias->scalar_type() == x.scalar_type(),
                "decode linear: bias must be a contiguous [", weight.size(0), "] of x's dtype");
  }
}

gemv::Params base_params(const at::Tensor& xc, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                         const std::optional<at::Tensor>& weight_scale, int64_t k) {
  gemv::Params p{};
  p.w = weight.data_ptr();
  p.w_scale = weight_scale.has_value() ? weight_scale->data_ptr<float>() : nullptr;
  p.bias = bias.has_value() ? bias->data_ptr() : nullptr;
  p.n = static_cast<int>(weight.size(0));
  p.k = static_cast<int>(k);
  p.x = xc.data_ptr();
  p.x_stride = xc.stride(0);
  p.rows = static_cast<int>(xc.size(0));
  return p;
}

void run(const gemv::Params& p, at::ScalarType dtype, gemv::In in, gemv::Out out, bool pdl) {
  const cudaStream_t stream = current_stream();
  if (!gemv::launch_plain_combos(p, dtype, in, out, stream, pdl) &&
      !gemv::launch_fused_combos(p, dtype, in, out, stream, pdl)) {
    TORCH_CHECK(false, "decode linear: unsupported combination of fused stages");
  }
}

}  // namespace

namespace gemv {

bool launch_plain_combos(const Params& p, at::ScalarType dtype, In in, Out out, cudaStream_t stream, bool pdl) {
  auto go = [&](auto t_tag, auto w_tag) {
    using T = decltype(t_tag);
    using W = decltype(w_tag);
    if (in == In::kPlain && out == Out::kPlain) {
      launch_rows<T, W, In::kPlain, Out::kPlain>(p, stream, pdl);
    } else if (in == In::kPlain && out == Out::kResidual) {
      launch_rows<T, W, In::kPlain, Out::kResidual>(p, stream, pdl);
    } else if (in == In::kSilu && out == Out::kResidual) {
      launch_rows<T, W, In::kSilu, Out::kResidual>(p, stream, pdl);
    } else if (in == In::kSilu && out == Out::kPlain) {
      launch_rows<T, W, In::kSilu, Out::kPlain>(p, stream, pdl);
    } else {
      return false;
    }
    return true;
  };
  return with_types(dtype, p.w_scale != nullptr, go);
}

}  // namespace gemv

at::Tensor decode_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                         const std::optional<at::Tensor>& weight_scale, const std::optional<at::Tensor>& norm_weight, double eps, bool silu,
                         const std::optional<at::Tensor>& residual, bool float_out, bool pdl) {
  TORCH_CHECK(x.dim() == 2, "decode_linear: x must be [rows, features]");
  const int64_t k = silu ? x.size(1) / 2 : x.size(1);
  check_weight(x, weight, bias, weight_scale, k);
  TORCH_CHECK(!(silu && norm_weight.has_value()), "decode_linear: silu and norm_weight are exclusive");
  TORCH_CHECK(!(float_out && residual.has_value()), "decode_linear: float_out and residual are exclusive");
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t n = weight.size(0);
  at::Tensor y = at::empty({x.size(0), n}, x.options().dtype(float_out ? at::kFloat : x.scalar_type())
                                               .memory_format(at::MemoryFormat::Contiguous));
  if (n == 0) return y;
  const at::Tensor xc = loadable_rows(x);
  gemv::Params p = base_params(xc, weight, bias, weight_scale, k);
  p.y = y.data_ptr();
  gemv::In in = gemv::In::kPlain;
  gemv::Out out = gemv::Out::kPlain;
  if (norm_weight.has_value()) {
    TORCH_CHECK(norm_weight->is_cuda() && norm_weight->dim() == 1 && norm_weight->size(0) == k &&
                    norm_weight->is_contiguous() && norm_weight->scalar_type() == x.scalar_type(),
                "decode_linear: norm_weight must be a contiguous [", k, "] of x's dtype");
    TORCH_CHECK(k <= 8 * gemv::kNormMaxThreads * gemv::kNormChunksPerThread, "decode_linear: rows too long to norm");
    p.norm_w = norm_weight->data_ptr();
    p.eps = static_cast<float>(eps);
    in = gemv::In::kNorm;
  } else if (silu) {
    in = gemv::In::kSilu;
  }
  at::Tensor res;
  if (residual.has_value()) {
    TORCH_CHECK(residual->is_cuda() && residual->dim() == 2 && residual->size(0) == x.size(0) &&
                    residual->size(1) == n && residual->stride(1) == 1 && residual->scalar_type() == x.scalar_type(),
                "decode_linear: residual must be [", x.size(0), ", ", n, "] of x's dtype");
    p.residual = residual->data_ptr();
    p.res_stride = residual->stride(0);
    out = gemv::Out::kResidual;
  } else if (float_out) {
    out = gemv::Out::kFloat;
  }
  run(p, x.scalar_type(), in, out, pdl);
  return y;
}

at::Tensor decode_qkv_rope(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                           const std::optional<at::Tensor>& weight_scale, const std::optional<at::Tensor>& norm_weight, double eps, const at::Tensor& positions,
                           const at::Tensor& cos_sin, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& slot_mapping, int64_t num_heads, bool pdl) {
  TORCH_CHECK(x.dim() == 2, "decode_qkv_rope: x must be [rows, features]");
  const int64_t k = x.size(1);
  check_weight(x, weight, bias, weight_scale, k);
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor q_out;
  const RopeKV rope = rope_kv_params("decode_qkv_rope", x.size(0), x.options(), weight.size(0), positions, cos_sin,
                                     k_cache, v_cache, slot_mapping, num_heads, q_out);
  const at::Tensor xc = loadable_rows(x);
  gemv::Params p = base_params(xc, weight, bias, weight_scale, k);
  gemv::In in = gemv::In::kPlain;
  if (norm_weight.has_value()) {
    TORCH_CHECK(norm_weight->is_cuda() && norm_weight->dim() == 1 && norm_weight->size(0) == k &&
                    norm_weight->is_contiguous() && norm_weight->scalar_type() == x.scalar_type(),
                "decode_qkv_rope: norm_weight must be a contiguous [", k, "] of x's dtype");
    TORCH_CHECK(k <= 8 * gemv::kNormMaxThreads * gemv::kNormChunksPerThread, "decode_qkv_rope: rows too long to norm");
    p.norm_w = norm_weight->data_ptr();
    p.eps = static_cast<float>(eps);
    in = gemv::In::kNorm;
  }
  p.rope = rope;
  run(p, x.scalar_type(), in, gemv::Out::kRopeKV, pdl);
  return q_out;
}

}  // namespace exlcli
