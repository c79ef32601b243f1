// Per-dtype CUDA launchers, one translation unit each (glu_f32.cu, glu_f16.cu, glu_bf16.cu).
#pragma once

#include <cuda_runtime.h>

#include "core/problem.h"

namespace expertact::cuda {
Status forward_f32(const detail::GluProblem& p, const detail::FwdOutput& o, cudaStream_t st);
Status forward_f16(const detail::GluProblem& p, const detail::FwdOutput& o, cudaStream_t st);
Status forward_bf16(const detail::GluProblem& p, const detail::FwdOutput& o, cudaStream_t st);
Status backward_f32(const detail::GluProblem& p, const detail::BwdIO& io, cudaStream_t st);
Status backward_f16(const detail::GluProblem& p, const detail::BwdIO& io, cudaStream_t st);
Status backward_bf16(const detail::GluProblem& p, const detail::BwdIO& io, cudaStream_t st);
}  // namespace expertact::cuda
