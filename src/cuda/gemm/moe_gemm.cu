// The fused grouped GEMMs' entry behind the C++ API: enter the tensors' device, prove
// every pointer is its memory and that it is a Hopper GPU (the kernels are sm_90a machine
// code only), zero the weight gradient the backward accumulates, dispatch on activation.
#include <cuda_runtime.h>

#include "core/error.h"
#include "cuda/common.cuh"
#include "cuda/device.h"
#include "cuda/gemm/moe_gemm.h"

namespace expertact::gemm {
namespace {

__global__ void zero_strided(float* x, int64_t n, int64_t stride) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) x[i * stride] = 0.0f;
}

// wgmma and setmaxnreg exist on sm_90a only: another GPU would fail the launch with
// "no kernel image", after the caller's tensors were allocated; say so up front.
Status check_hopper(int device) {
  int major = 0, minor = 0;
  EA_TRY(cuda::cuda_check(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device),
                          "cudaDeviceGetAttribute"));
  EA_TRY(cuda::cuda_check(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device),
                          "cudaDeviceGetAttribute"));
  if (major != 9 || minor != 0)
    return ::expertact::detail::fail(
        Status::kUnsupported, "the fused grouped GEMM runs on Hopper (sm_90) GPUs only; cuda:",
        device, " is sm_", major, minor, " (use the unfused path there)");
  return Status::kOk;
}

}  // namespace

Status fused_forward(Activation act, const GroupedShape& s, const FwdEpilogueParams& p,
                     void* stream) {
  cuda::DeviceGuard guard(s.device);
  EA_TRY(::expertact::detail::enter_operands(
      s.device, guard,
      {{"x", s.a}, {"w13", s.b}, {"offsets", p.offsets}, {"weights", p.w}, {"gate_up", s.d},
       {"h", p.h}}));
  EA_TRY(check_hopper(s.device));
  switch (act) {
    case Activation::kSilu: return detail::fwd_silu(s, p, stream);
    case Activation::kGeluTanh: return detail::fwd_gelu(s, p, stream);
  }
  return ::expertact::detail::fail(Status::kInternal, "fused_forward: activation ",
                                   static_cast<int>(act));
}

Status fused_backward(Activation act, const GroupedShape& s, const BwdEpilogueParams& p,
                      void* stream) {
  cuda::DeviceGuard guard(s.device);
  EA_TRY(::expertact::detail::enter_operands(
      s.device, guard,
      {{"grad_y", s.a}, {"w2", s.b}, {"offsets", p.offsets}, {"gate_up", p.gate_up},
       {"weights", p.w}, {"grad_gate_up", p.dgate_up}, {"grad_weights", p.dw}}));
  EA_TRY(check_hopper(s.device));
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  if (p.dw != nullptr) {  // the epilogue adds each tile's row sums into it
    if (p.dw_stride == 1) {
      EA_TRY(cuda::cuda_check(cudaMemsetAsync(p.dw, 0, static_cast<size_t>(s.T) * sizeof(float), st),
                              "cudaMemsetAsync (grad_weights)"));
    } else {
      const int threads = 256;
      zero_strided<<<static_cast<unsigned>((s.T + threads - 1) / threads), threads, 0, st>>>(
          p.dw, s.T, p.dw_stride);
      EA_TRY(cuda::cuda_check(cudaGetLastError(), "zero grad_weights kernel launch"));
    }
  }
  if (s.N == 0) return Status::kOk;  // F == 0: the zeroed weight gradient is the whole answer
  switch (act) {
    case Activation::kSilu: return detail::bwd_silu(s, p, stream);
    case Activation::kGeluTanh: return detail::bwd_gelu(s, p, stream);
  }
  return ::expertact::detail::fail(Status::kInternal, "fused_backward: activation ",
                                   static_cast<int>(act));
}

}  // namespace expertact::gemm
