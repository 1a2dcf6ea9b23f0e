// Programmatic dependent launch (Hopper), the device side; kept free of torch headers so that
// kernel headers which include only CUDA's can use it (launch_pdl, the host side, is in common.cuh).
#pragma once

namespace exlcli {

// A kernel launched with launch_pdl() may start while the kernel before it in the stream is still
// finishing. Its blocks may read data that no earlier kernel writes (weights) at once, but must
// call grid_dependency_wait() before they read anything an earlier kernel wrote and before they
// write anything at all. grid_dependents_launch() lets the next kernel's blocks start early.
__device__ __forceinline__ void grid_dependency_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void grid_dependents_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" :::);
#endif
}

}  // namespace exlcli
