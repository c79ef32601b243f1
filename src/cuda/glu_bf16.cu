// CUDA forward/backward for bfloat16 storage (see glu_launch.cuh).
#include "cuda/glu_launch.cuh"
#include "cuda/entry.h"

namespace expertact::cuda {
Status forward_bf16(const detail::GluProblem& p, const detail::FwdOutput& o, KernelChoice k,
                  cudaStream_t st) {
  return run_forward<__nv_bfloat16>(p, o, k, st);
}
Status backward_bf16(const detail::GluProblem& p, const detail::BwdIO& io, KernelChoice k,
                   cudaStream_t st) {
  return run_backward<__nv_bfloat16>(p, io, k, st);
}
}  // namespace expertact::cuda
