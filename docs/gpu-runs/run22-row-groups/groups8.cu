// Run 22: the 8-bit variants (pick in groups.cuh).
#include "groups.cuh"

template void pick<8>(int64_t, const Params&, cudaStream_t);
