// The activation's rowwise FP8 kernels per storage type, one translation unit each
// (fp8_act_f32.cu, fp8_act_f16.cu, fp8_act_bf16.cu), called by the entries in
// fp8_glu_rowwise.cu and fp8_backward.cu once the operands are checked.
#pragma once

#include <cuda_runtime.h>

#include "core/math.h"
#include "cpu/fp8_cpu.h"

namespace expertact::cuda {

// The forward (fp8_glu_rowwise.cuh): c, the activation's coefficients; am, col_amax's words.
Status fp8_glu_rowwise_f32(const detail::GluProblem& p, const detail::Fp8Out& o, const detail::GluBias* bias,
                           const detail::Fp8ColAmax* amax, const math::Coeffs& c, unsigned* am, cudaStream_t st);
Status fp8_glu_rowwise_f16(const detail::GluProblem& p, const detail::Fp8Out& o, const detail::GluBias* bias,
                           const detail::Fp8ColAmax* amax, const math::Coeffs& c, unsigned* am, cudaStream_t st);
Status fp8_glu_rowwise_bf16(const detail::GluProblem& p, const detail::Fp8Out& o, const detail::GluBias* bias,
                            const detail::Fp8ColAmax* amax, const math::Coeffs& c, unsigned* am, cudaStream_t st);

// The backward (fp8_backward.cuh).
Status fp8_glu_backward_rowwise_f32(const detail::GluProblem& p, const detail::Fp8BwdOut& o,
                                    const detail::GluBias* bias, cudaStream_t st);
Status fp8_glu_backward_rowwise_f16(const detail::GluProblem& p, const detail::Fp8BwdOut& o,
                                    const detail::GluBias* bias, cudaStream_t st);
Status fp8_glu_backward_rowwise_bf16(const detail::GluProblem& p, const detail::Fp8BwdOut& o,
                                     const detail::GluBias* bias, cudaStream_t st);

}  // namespace expertact::cuda
