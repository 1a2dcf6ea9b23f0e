// Run 22: the 6-bit variants (pick in groups.cuh).
#include "groups.cuh"

template void pick<6>(int64_t, const Params&, cudaStream_t);
