// The activation's rowwise FP8 kernels, forward and backward, for bfloat16 storage
// (fp8_glu_rowwise.cuh, fp8_backward.cuh; declared in fp8_act_entry.h).
#include "cuda/fp8_act_entry.h"
#include "cuda/fp8_backward.cuh"
#include "cuda/fp8_glu_rowwise.cuh"

namespace expertact::cuda {
Status fp8_glu_rowwise_bf16(const detail::GluProblem& p, const detail::Fp8Out& o, const detail::GluBias* bias,
                            const detail::Fp8ColAmax* amax, const math::Coeffs& c, unsigned* am, cudaStream_t st) {
  return detail::run_glu_rowwise<__nv_bfloat16>(p, o, bias, amax, c, am, st);
}
Status fp8_glu_backward_rowwise_bf16(const detail::GluProblem& p, const detail::Fp8BwdOut& o,
                                     const detail::GluBias* bias, cudaStream_t st) {
  return detail::run_glu_backward_rowwise<__nv_bfloat16>(p, o, bias, st);
}
}  // namespace expertact::cuda
