// The fused grouped GEMM, backward: dgate_up (and the weights' gradient) from dh, for the silu activation: one CUTLASS
// kernel per translation unit, so that a parallel build compiles them side by side.
#include "cuda/gemm/moe_gemm_run.cuh"

namespace expertact::gemm::detail {
Status bwd_silu(const GroupedShape& s, const BwdEpilogueParams& p, void* stream) {
  return run_grouped<GluBwdCallbacks<Activation::kSilu>, void>(s, p, p.offsets, static_cast<cudaStream_t>(stream));
}
}  // namespace expertact::gemm::detail
