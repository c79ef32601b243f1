// The fused grouped GEMM, forward: gate_up and h, for the silu activation: one CUTLASS
// kernel per translation unit, so that a parallel build compiles them side by side.
#include "cuda/gemm/moe_gemm_run.cuh"

namespace expertact::gemm::detail {
Status fwd_silu(const GroupedShape& s, const FwdEpilogueParams& p, void* stream) {
  return run_grouped<GluFwdCallbacks<Activation::kSilu>, Bf16>(s, p, p.offsets, static_cast<cudaStream_t>(stream));
}
}  // namespace expertact::gemm::detail
