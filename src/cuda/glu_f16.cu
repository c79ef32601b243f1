// CUDA forward/backward for float16 storage (see glu_launch.cuh).
#include "cuda/glu_launch.cuh"
#include "cuda/entry.h"

namespace expertact::cuda {
Status forward_f16(const detail::GluProblem& p, const detail::FwdOutput& o, KernelChoice k,
                  cudaStream_t st) {
  return run_forward<__half>(p, o, k, st);
}
Status backward_f16(const detail::GluProblem& p, const detail::BwdIO& io, KernelChoice k,
                   cudaStream_t st) {
  return run_backward<__half>(p, io, k, st);
}
}  // namespace expertact::cuda
