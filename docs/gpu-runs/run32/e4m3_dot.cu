// Run 32 probe: the decode linear kernel (decode_gemv.cuh, plain in and out) over e4m3 weights with
// three ways of turning the weights into fp32 (gemv_variants.cuh's dot16_e4m3 V0, V1, V2), and over
// bf16 weights for comparison. Built by e4m3_dot.py.
#include <torch/extension.h>

#include "gemv_variants.cuh"

namespace gp = exlcli::gemv_probe;

template <typename W, int M, int V>
void launch(const gp::Params& p0) {
  gp::Params p = p0;
  p.warps_per_group = gp::warps_per_group(p.k / gp::chunk_weights<W>());
  p.num_units = exlcli::ceil_div(p.n, gp::kRows);
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  const int groups = gp::kWarps / p.warps_per_group;
  const int grid = std::max(1, std::min(exlcli::ceil_div(p.num_units, groups), PROBE_MINB * sms));
  gp::decode_gemv_kernel<__nv_bfloat16, W, M, gp::In::kPlain, gp::Out::kPlain, V>
      <<<grid, gp::kThreads, 0, exlcli::current_stream()>>>(p);
}

at::Tensor gemv(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& scale, int64_t v) {
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor y = at::empty({x.size(0), w.size(0)}, x.options());
  gp::Params p{};
  p.w = w.data_ptr();
  p.w_scale = scale.has_value() ? scale->data_ptr<float>() : nullptr;
  p.n = static_cast<int>(w.size(0));
  p.k = static_cast<int>(x.size(1));
  p.x = x.data_ptr();
  p.x_stride = x.stride(0);
  p.rows = static_cast<int>(x.size(0));
  p.y = y.data_ptr();
  const bool fp8 = w.scalar_type() == at::kFloat8_e4m3fn;
#ifdef PROBE_SWEEP
  TORCH_CHECK(p.rows == 1, "the sweep builds take one token");
  if (!fp8) {
    launch<__nv_bfloat16, 1, 0>(p);
  } else if (v == 10) {
    launch<__nv_fp8_e4m3, 1, 10>(p);
  } else {
    launch<__nv_fp8_e4m3, 1, 0>(p);
  }
#else
  const bool four = p.rows > 1;
  if (!fp8) {
    if (v == 10) {
      four ? launch<__nv_bfloat16, 4, 10>(p) : launch<__nv_bfloat16, 1, 10>(p);
    } else {
      four ? launch<__nv_bfloat16, 4, 0>(p) : launch<__nv_bfloat16, 1, 0>(p);
    }
  } else if (v == 10) {
    four ? launch<__nv_fp8_e4m3, 4, 10>(p) : launch<__nv_fp8_e4m3, 1, 10>(p);
  } else if (v == 11) {
    four ? launch<__nv_fp8_e4m3, 4, 11>(p) : launch<__nv_fp8_e4m3, 1, 11>(p);
  } else if (v == 3) {
    four ? launch<__nv_fp8_e4m3, 4, 3>(p) : launch<__nv_fp8_e4m3, 1, 3>(p);
  } else if (v == 4) {
    four ? launch<__nv_fp8_e4m3, 4, 4>(p) : launch<__nv_fp8_e4m3, 1, 4>(p);
  } else if (v == 13) {
    four ? launch<__nv_fp8_e4m3, 4, 13>(p) : launch<__nv_fp8_e4m3, 1, 13>(p);
  } else if (v == 14) {
    four ? launch<__nv_fp8_e4m3, 4, 14>(p) : launch<__nv_fp8_e4m3, 1, 14>(p);
  } else if (v == 0) {
    four ? launch<__nv_fp8_e4m3, 4, 0>(p) : launch<__nv_fp8_e4m3, 1, 0>(p);
  } else if (v == 1) {
    four ? launch<__nv_fp8_e4m3, 4, 1>(p) : launch<__nv_fp8_e4m3, 1, 1>(p);
  } else {
    four ? launch<__nv_fp8_e4m3, 4, 2>(p) : launch<__nv_fp8_e4m3, 1, 2>(p);
  }
#endif
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("gemv", &gemv); }
