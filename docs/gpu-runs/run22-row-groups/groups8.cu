// Run 22: the 8-bit variants (groups.cuh).
#include "groups.cuh"

template <int BITS>
void pick(int64_t v, const Params& p, cudaStream_t s) {
  switch (v) {
    case 0: if constexpr (BITS != 8) go<BITS, 4, 2, 2>(p, s); else go<BITS, 8, 2, 4>(p, s); break;  // today's 33-64
    case 1: grouped<BITS, 4, 2, 2, 2, false>(p, s); break;
    case 2: grouped<BITS, 4, 2, 2, 2, true>(p, s); break;
    case 3: grouped<BITS, 4, 2, 1, 2, true>(p, s); break;
    case 4: grouped<BITS, 4, 2, 4, 2, true, 1>(p, s); break;
    case 5: grouped<BITS, 4, 1, 4, 2, true, 1>(p, s); break;
    case 6: grouped<BITS, 4, 1, 2, 4, true>(p, s); break;
    case 7: grouped<BITS, 8, 1, 2, 2, true, 1>(p, s); break;
    case 8: grouped<BITS, 2, 2, 4, 2, true>(p, s); break;
    case 11: grouped<BITS, 4, 2, 2, 2, true, 1>(p, s); break;
    case 12: go<BITS, 8, 2, 2>(p, s); break;
    case 13: go<BITS, 4, 4, 2>(p, s); break;
    case 14: go<BITS, 8, 2, 4>(p, s); break;
    case 9: go<BITS, 8, 4, 1>(p, s); break;   // run 21's best LM head shape
    case 10: go<BITS, 4, 2, 4>(p, s); break;  // today's 17-32 tokens
    default: TORCH_CHECK(false, "variant");
  }
}


template void pick<8>(int64_t, const Params&, cudaStream_t);
