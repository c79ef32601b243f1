// CUDA forward/backward for bfloat16 storage (see glu_launch.cuh).
#include "cuda/glu_launch.cuh"
#include "cuda/entry.h"

namespace expertact::cuda {
Status forward_bf16(const detail::GluProblem& p, const detail::FwdOutput& o, cudaStream_t st) {
  return run_forward<__nv_bfloat16>(p, o, st);
}
Status backward_bf16(const detail::GluProblem& p, const detail::BwdIO& io, cudaStream_t st) {
  return run_backward<__nv_bfloat16>(p, io, st);
}
}  // namespace expertact::cuda
