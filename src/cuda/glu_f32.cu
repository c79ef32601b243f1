// CUDA forward/backward for float32 storage (see glu_launch.cuh).
#include "cuda/glu_launch.cuh"
#include "cuda/entry.h"

namespace expertact::cuda {
Status forward_f32(const detail::GluProblem& p, const detail::FwdOutput& o, cudaStream_t st) {
  return run_forward<float>(p, o, st);
}
Status backward_f32(const detail::GluProblem& p, const detail::BwdIO& io, cudaStream_t st) {
  return run_backward<float>(p, io, st);
}
}  // namespace expertact::cuda
