// The operand checks of the FP8 x FP8 products (fp8_linear.cu, fp8_gemm.cu): e4m3 activations xq
// [m, k] with a float32 scale per token, e4m3 weights [n, k] with a float32 scale per row, and an
// optional bfloat16 bias [n], all on one device. The Python wrappers check the same first
// (kernels._fp8_operands), so these guard direct calls of the ops.
#pragma once

#include <cstdint>
#include <optional>

#include "common.cuh"

namespace exlcli {

// The checked operands, as the products' kernel parameters start (they derive from it).
struct Fp8Operands {
  const uint8_t* xq;          // [m, k] e4m3, rows 16-byte aligned
  const float* x_scale;       // [m]
  const uint8_t* w;           // [n, k] e4m3
  const float* w_scale;       // [n]
  const __nv_bfloat16* bias;  // [n] or null
  int m, n, k;
};

inline Fp8Operands check_fp8_operands(const char* op, const at::Tensor& xq, const at::Tensor& x_scale,
                                      const at::Tensor& weight, const at::Tensor& w_scale,
                                      const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(xq.is_cuda() && weight.is_cuda(), op, ": xq and weight must be CUDA tensors, got ", xq.device(),
              " and ", weight.device());
  TORCH_CHECK(xq.dim() == 2 && xq.scalar_type() == at::kFloat8_e4m3fn && xq.is_contiguous() &&
                  aligned16(xq.data_ptr()),
              op, ": xq must be a contiguous, aligned float8_e4m3fn [m, k]");
  const int64_t m = xq.size(0), k = xq.size(1);
  TORCH_CHECK(weight.dim() == 2 && weight.size(1) == k && weight.scalar_type() == at::kFloat8_e4m3fn &&
                  weight.is_contiguous() && aligned16(weight.data_ptr()),
              op, ": weight must be a contiguous, aligned float8_e4m3fn [n, ", k, "]");
  const int64_t n = weight.size(0);
  TORCH_CHECK(x_scale.scalar_type() == at::kFloat && x_scale.numel() == m && x_scale.is_contiguous() &&
                  w_scale.scalar_type() == at::kFloat && w_scale.numel() == n && w_scale.is_contiguous(),
              op, ": x_scale and w_scale must be contiguous float32 of m and n elements");
  TORCH_CHECK(x_scale.device() == xq.device() && w_scale.device() == xq.device() && weight.device() == xq.device(),
              op, ": every tensor must be on one device");
  Fp8Operands operands{static_cast<const uint8_t*>(xq.data_ptr()), x_scale.data_ptr<float>(),
                       static_cast<const uint8_t*>(weight.data_ptr()), w_scale.data_ptr<float>(), nullptr,
                       static_cast<int>(m), static_cast<int>(n), static_cast<int>(k)};
  if (bias.has_value()) {
    TORCH_CHECK(bias->device() == xq.device() && bias->dim() == 1 && bias->size(0) == n && bias->is_contiguous() &&
                    bias->scalar_type() == at::kBFloat16,
                op, ": bias must be a contiguous bfloat16 [", n, "]");
    operands.bias = static_cast<const __nv_bfloat16*>(bias->data_ptr());
  }
  return operands;
}

}  // namespace exlcli
