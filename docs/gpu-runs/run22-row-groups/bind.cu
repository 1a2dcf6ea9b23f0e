// Run 22: the entry point (groups.cuh).
#include "groups.cuh"

void run(int64_t v, int64_t bits, at::Tensor x, at::Tensor qweight, at::Tensor scales, int64_t group_log2, at::Tensor out) {
  Params p{};
  p.x = static_cast<const __nv_bfloat16*>(x.data_ptr());
  p.qweight = static_cast<const uint32_t*>(qweight.data_ptr());
  p.scales = static_cast<const uint32_t*>(scales.data_ptr());
  p.out = out.data_ptr();
  p.m = x.size(0);
  p.n = out.size(1);
  p.k = x.size(1);
  p.group_log2 = group_log2;
  cudaStream_t s = c10::cuda::getCurrentCUDAStream();
  if (bits == 4) pick<4>(v, p, s); else if (bits == 6) pick<6>(v, p, s); else pick<8>(v, p, s);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("run", &run); }
