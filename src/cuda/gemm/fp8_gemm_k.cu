// The K-grouped FP8 blockwise grouped GEMM: one CUTLASS instantiation (fp8_gemm_sm90.cuh),
// compiled for sm_90a only (src/cuda/gemm/CMakeLists.txt), always optimised.
#include "cuda/gemm/fp8_gemm.h"
#include "cuda/gemm/fp8_gemm_sm90.cuh"

namespace expertact::fp8gemm {

using MainloopK = MainloopBuilder<ScalesK>::CollectiveOp;
using GemmK = GroupedGemm<ScalesK, MainloopK>;

Status run_k_grouped(const Problem& p, void* workspace, size_t workspace_size, void* stream) {
  return run<GemmK>(p, workspace, workspace_size, static_cast<cudaStream_t>(stream));
}

size_t workspace_bytes_k_grouped(int64_t E) { return workspace_bytes<GemmK>(E); }

}  // namespace expertact::fp8gemm
