// Per-dtype CUDA launchers, one translation unit each (glu_f32.cu, glu_f16.cu,
// glu_bf16.cu), and the choice of kernels they are handed.
#pragma once

#include <cuda_runtime.h>

#include "core/problem.h"

namespace expertact::cuda {

// Which kernels serve the calls whose operands all allow 16-byte packs and that
// want no weight gradient (the others always take the row kernels or the
// realigning kernels): the row kernels (glu_kernels.cuh), or the flat kernels
// (glu_flat.cuh) in blocks of 256 or 128 threads. A tuning knob:
// EXPERTACT_CUDA_KERNEL=rows|flat|flat128, read once per process (glu_cuda.cu).
enum class KernelChoice { kRows, kFlat, kFlat128 };
// Without the variable (docs/perf-notes.md, "Fourth session").
constexpr KernelChoice kDefaultKernel = KernelChoice::kRows;

Status forward_f32(const detail::GluProblem& p, const detail::FwdOutput& o, KernelChoice k,
                   cudaStream_t st);
Status forward_f16(const detail::GluProblem& p, const detail::FwdOutput& o, KernelChoice k,
                   cudaStream_t st);
Status forward_bf16(const detail::GluProblem& p, const detail::FwdOutput& o, KernelChoice k,
                    cudaStream_t st);
Status backward_f32(const detail::GluProblem& p, const detail::BwdIO& io, KernelChoice k,
                    cudaStream_t st);
Status backward_f16(const detail::GluProblem& p, const detail::BwdIO& io, KernelChoice k,
                    cudaStream_t st);
Status backward_bf16(const detail::GluProblem& p, const detail::BwdIO& io, KernelChoice k,
                     cudaStream_t st);
}  // namespace expertact::cuda
