// CUDA forward/backward for float32 storage (see glu_launch.cuh).
#include "cuda/glu_launch.cuh"
#include "cuda/entry.h"

namespace expertact::cuda {
Status forward_f32(const detail::GluProblem& p, const detail::FwdOutput& o, KernelChoice k,
                  cudaStream_t st) {
  return run_forward<float>(p, o, k, st);
}
Status backward_f32(const detail::GluProblem& p, const detail::BwdIO& io, KernelChoice k,
                   cudaStream_t st) {
  return run_backward<float>(p, io, k, st);
}
}  // namespace expertact::cuda
