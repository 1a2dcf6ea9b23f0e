// Run 21 (docs/gpu-results.md): tile shapes of the packed kernel at 32-64 tokens (python3 tiles64.py [variants] [tokens]).
#include <torch/extension.h>
#include <c10/cuda/CUDAStream.h>
#include "quant_linear.cuh"
using namespace exlcli::qlinear;

template <int BITS, int NT, int RT, int UNROLL>
void go(const Params& p, cudaStream_t s) {
  dim3 grid(p.n / (kTileRows * RT), (p.m + 8 * NT - 1) / (8 * NT));
  quant_linear_kernel<BITS, false, NT, RT, UNROLL, false><<<grid, kWarps * 32, 0, s>>>(p);
}

template <int BITS>
void pick(int64_t v, const Params& p, cudaStream_t s) {
  switch (v) {
    case 0: go<BITS, 8, 2, 2>(p, s); break;  // today's 33-64 tokens
    case 1: go<BITS, 8, 2, 4>(p, s); break;
    case 2: go<BITS, 8, 2, 1>(p, s); break;
    case 3: go<BITS, 4, 4, 2>(p, s); break;
    case 4: go<BITS, 4, 4, 1>(p, s); break;
    case 5: go<BITS, 8, 4, 1>(p, s); break;
    case 6: go<BITS, 8, 3, 1>(p, s); break;
    case 7: go<BITS, 4, 2, 2>(p, s); break;
    default: TORCH_CHECK(false, "variant");
  }
}

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
  if (bits == 4) pick<4>(v, p, s); else pick<8>(v, p, s);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("run", &run); }
