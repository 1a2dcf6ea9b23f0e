// Run 30 (docs/gpu-results.md): the dp4a decode product (csrc/quant_gemv_dp4a.cuh) in several tilings
// against the tensor-core kernel at 1-4 tokens, an experiment outside the library (dp4a_probe.py).
#include <torch/extension.h>
#include <c10/cuda/CUDAStream.h>
#include "quant_gemv_dp4a.cuh"

using namespace exlcli::qlinear;

template <int BITS, int M, int RT, int UNROLL, int WARPS = kWarps>
void dp4a(const Params& p, cudaStream_t s) {
  auto kern = quant_gemv_dp4a_kernel<BITS, M, RT, UNROLL, false, WARPS>;
  const size_t smem = dp4a_smem_bytes(M, p.k);
  cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
  kern<<<p.n / (kTileRows * RT), WARPS * 32, smem, s>>>(p);
}

template <int BITS, int M>
void variant(int v, const Params& p, cudaStream_t s) {
  switch (v) {
    case 0: quant_linear_kernel<BITS, false, 1, 1, 4, false><<<p.n / kTileRows, kWarps * 32, 0, s>>>(p); break;
    case 1: dp4a<BITS, M, 1, 4>(p, s); break;
#ifndef WARPS_SWEEP  // (the second sweep compiles only the variants it runs)
    case 2: dp4a<BITS, M, 1, 8>(p, s); break;
    case 3: dp4a<BITS, M, 2, 4>(p, s); break;
    case 4: dp4a<BITS, M, 4, 2>(p, s); break;
    case 5: dp4a<BITS, M, 4, 4>(p, s); break;
    case 6: dp4a<BITS, M, 2, 2>(p, s); break;
    case 7: dp4a<BITS, M, 1, 2>(p, s); break;
#endif
    case 8: dp4a<BITS, M, 1, 4, 16>(p, s); break;
    case 9: dp4a<BITS, M, 1, 2, 16>(p, s); break;
    case 10: dp4a<BITS, M, 1, 8, 16>(p, s); break;
    default: TORCH_CHECK(false, "no variant ", v);
  }
}

template <int BITS>
void by_m(int v, const Params& p, cudaStream_t s) {
  switch (p.m) {
    case 1: variant<BITS, 1>(v, p, s); break;
    case 2: variant<BITS, 2>(v, p, s); break;
#ifndef WARPS_SWEEP
    case 4: variant<BITS, 4>(v, p, s); break;
#endif
    default: TORCH_CHECK(false, "m ", p.m);
  }
}

void run(int64_t v, const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales, int64_t bits,
         int64_t group_log2, at::Tensor& out) {
  Params p{};
  p.x = static_cast<const __nv_bfloat16*>(x.data_ptr());
  p.qweight = static_cast<const uint32_t*>(qweight.data_ptr());
  p.scales = static_cast<const uint32_t*>(scales.data_ptr());
  p.out = out.data_ptr();
  p.m = static_cast<int>(x.size(0));
  p.n = static_cast<int>(out.size(1));
  p.k = static_cast<int>(x.size(1));
  p.group_log2 = static_cast<int>(group_log2);
  const cudaStream_t s = at::cuda::getCurrentCUDAStream();
  if (bits == 4) by_m<4>(static_cast<int>(v), p, s); else if (bits == 6) by_m<6>(static_cast<int>(v), p, s); else by_m<8>(static_cast<int>(v), p, s);
  C10_CUDA_CHECK(cudaGetLastError());
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("run", &run); }
