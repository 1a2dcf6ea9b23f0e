// The decode linear kernel's fused combinations with an rms_norm prologue or a rope + KV-write
// epilogue (a file of their own so the build compiles them beside linear.cu's).
#include "common.cuh"
#include "decode_gemv.cuh"

namespace exlcli {
namespace gemv {

bool launch_fused_combos(const Params& p, at::ScalarType dtype, In in, Out out, cudaStream_t stream, bool pdl) {
  auto go = [&](auto tag) {
    using T = decltype(tag);
    if (in == In::kNorm && out == Out::kPlain) {
      launch_rows<T, In::kNorm, Out::kPlain>(p, stream, pdl);
    } else if (in == In::kNorm && out == Out::kFloat) {
      launch_rows<T, In::kNorm, Out::kFloat>(p, stream, pdl);
    } else if (in == In::kNorm && out == Out::kRopeKV) {
      launch_rows<T, In::kNorm, Out::kRopeKV>(p, stream, pdl);
    } else if (in == In::kPlain && out == Out::kRopeKV) {
      launch_rows<T, In::kPlain, Out::kRopeKV>(p, stream, pdl);
    } else {
      return false;
    }
    return true;
  };
  return dtype == at::kBFloat16 ? go(__nv_bfloat16{}) : go(__half{});
}

}  // namespace gemv
}  // namespace exlcli
