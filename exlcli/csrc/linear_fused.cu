// The decode linear kernel's fused combinations with an rms_norm prologue or a rope + KV-write
// epilogue (a file of their own so the build compiles them beside linear.cu's).
#include "common.cuh"
#include "decode_gemv.cuh"

namespace exlcli {
namespace gemv {

bool launch_fused_combos(const Params& p, at::ScalarType dtype, In in, Out out, cudaStream_t stream, bool pdl) {
  auto go = [&](auto t_tag, auto w_tag) {
    using T = decltype(t_tag);
    using W = decltype(w_tag);
    if (in == In::kNorm && out == Out::kPlain) {
      launch_rows<T, W, In::kNorm, Out::kPlain>(p, stream, pdl);
    } else if (in == In::kNorm && out == Out::kFloat) {
      launch_rows<T, W, In::kNorm, Out::kFloat>(p, stream, pdl);
    } else if (in == In::kNorm && out == Out::kRopeKV) {
      launch_rows<T, W, In::kNorm, Out::kRopeKV>(p, stream, pdl);
    } else if (in == In::kPlain && out == Out::kRopeKV) {
      launch_rows<T, W, In::kPlain, Out::kRopeKV>(p, stream, pdl);
    } else {
      return false;
    }
    return true;
  };
  return with_types(dtype, p.w_scale != nullptr, go);
}

}  // namespace gemv
}  // namespace exlcli
