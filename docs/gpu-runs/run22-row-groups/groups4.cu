// Run 22: the 4-bit variants (pick in groups.cuh).
#include "groups.cuh"

template void pick<4>(int64_t, const Params&, cudaStream_t);
