// Per-dtype CUDA launchers, one translation unit each (glu_f32.cu, glu_f16.cu,
// glu_bf16.cu), and the choice of kernels they are handed.
#pragma once

#include <cuda_runtime.h>

#include "core/problem.h"

namespace expertact::cuda {

// Which kernels serve the calls whose operands all allow 16-byte packs and that
// want no weight gradient (the others always take the row kernels or the
// realigning kernels): the row kernels (glu_kernels.cuh), the flat kernels
// (glu_flat.cuh), or per call (auto, below). A tuning knob:
// EXPERTACT_CUDA_KERNEL=auto|rows|flat, read once per process (glu_cuda.cu).
enum class KernelChoice { kAuto, kRows, kFlat };
// The choice when EXPERTACT_CUDA_KERNEL is unset.
constexpr KernelChoice kDefaultKernel = KernelChoice::kAuto;

// What auto takes for one call, from the A/B of rows against flat (docs/notes/perf-notes.md,
// "Flat kernels and the `auto` choice"; bench/kernel_variants.cu): the flat kernels won everywhere
// at 16,384 x 1,536 (4-9% in forward) and 65,536 x 1,536, and at the seed size
// (1,045,081 x 3,072) for the presets without a limit (-1.1 to -1.9% forward, -0.4
// to -0.8% backward, both rounds), but (a) the interleaved forward there was 2-8%
// slower flat, and (b) with a limit (swiglu_clamped, swiglu_oai) the flat kernels
// moved by up to 5% between rounds at the seed size while the row kernels held
// 100.3-100.6% of the copy floor: those two keep the row kernels above the sizes
// measured flat-better.
inline KernelChoice resolve_auto(KernelChoice k, const detail::GluProblem& p, bool backward) {
  if (k != KernelChoice::kAuto) return k;
  const int64_t n = p.rows * p.F;
  if (!backward && p.step == 2 && n > (int64_t{1} << 25)) return KernelChoice::kRows;
  if (p.has_limit && n > (int64_t{1} << 28)) return KernelChoice::kRows;
  return KernelChoice::kFlat;
}

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
