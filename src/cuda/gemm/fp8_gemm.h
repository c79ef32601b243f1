// The FP8 blockwise grouped GEMM's launchers (src/cuda/gemm/fp8_gemm_m.cu, fp8_gemm_k.cu: one
// CUTLASS instantiation each, built for sm_90a when the CUTLASS headers are found), with no
// CUTLASS type in sight, so that the API boundary (src/api_fp8_gemm.cpp) includes it as
// plain C++.
#pragma once

#include <cstddef>
#include <cstdint>

#include "cuda/gemm/fp8_gemm_plan.h"
#include "expertact/expertact.hpp"

namespace expertact::fp8gemm {

// Run p (validated by the API boundary) with the workspace given; stream: a cudaStream_t.
Status run_m_grouped(const Problem& p, void* workspace, size_t workspace_bytes, void* stream);
Status run_k_grouped(const Problem& p, void* workspace, size_t workspace_bytes, void* stream);
// The workspace each needs for E experts: the per-group arrays and CUTLASS's own.
size_t workspace_bytes_m_grouped(int64_t E);
size_t workspace_bytes_k_grouped(int64_t E);

}  // namespace expertact::fp8gemm
